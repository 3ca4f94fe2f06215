//! Structure-aware generators: objects (realistic Pods and Deployments, random and hostile
//! shapes), rule specs from the real vocabulary, and byte- and value-level mutation of valid
//! seed documents (examples/*/ and tests/data/).

use std::path::Path;
use std::sync::OnceLock;

use serde_json::{Map, Value, json};

use super::rng::Rng;

// ---------------------------------------------------------------------------------------------
// Seeds

/// Valid documents from the repository: rules, objects and recorded AdmissionReviews.
pub struct Seeds {
    /// Rule documents (examples/*/rules.yaml).
    pub rules: Vec<Value>,
    /// Objects (examples/*/objects.yaml, the objects of tests/data/admission/).
    pub objects: Vec<Value>,
    /// AdmissionReviews as recorded (tests/data/admission/*.json), as text.
    pub reviews: Vec<String>,
    /// Whole input files as text (examples/*/*.yaml, tests/data/*.yaml).
    pub files: Vec<String>,
}

pub fn seeds() -> &'static Seeds {
    static SEEDS: OnceLock<Seeds> = OnceLock::new();
    SEEDS.get_or_init(load_seeds)
}

fn load_seeds() -> Seeds {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut seeds = Seeds {
        rules: Vec::new(),
        objects: Vec::new(),
        reviews: Vec::new(),
        files: Vec::new(),
    };
    let mut dirs: Vec<_> = std::fs::read_dir(root.join("examples"))
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path()).collect())
        .unwrap_or_default();
    dirs.sort();
    for dir in dirs {
        for file in [
            "rules.yaml",
            "objects.yaml",
            "expected.yaml",
            "initium-test.yaml",
        ] {
            let Ok(text) = std::fs::read_to_string(dir.join(file)) else {
                continue;
            };
            if let Ok(docs) = serde_saphyr::from_multiple::<Value>(&text) {
                for doc in docs.into_iter().filter(Value::is_object) {
                    let kind = doc.get("kind").and_then(Value::as_str).unwrap_or("");
                    if kind.ends_with("MutationRule") {
                        seeds.rules.push(doc);
                    } else if file != "initium-test.yaml" {
                        seeds.objects.push(doc);
                    }
                }
            }
            seeds.files.push(text);
        }
    }
    if let Ok(text) = std::fs::read_to_string(root.join("tests/data/invalid-rules.yaml")) {
        seeds.files.push(text);
    }
    let mut reviews: Vec<_> = std::fs::read_dir(root.join("tests/data/admission"))
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path()).collect())
        .unwrap_or_default();
    reviews.sort();
    for path in reviews {
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        if let Ok(review) = serde_json::from_str::<Value>(&text) {
            let object = &review["request"]["object"];
            let kind = object.get("kind").and_then(Value::as_str).unwrap_or("");
            if kind.ends_with("MutationRule") {
                seeds.rules.push(object.clone());
            } else if object.is_object() {
                seeds.objects.push(object.clone());
            }
        }
        seeds.reviews.push(text);
    }
    assert!(
        !seeds.rules.is_empty() && !seeds.objects.is_empty() && !seeds.reviews.is_empty(),
        "fuzz seeds not found under {}",
        root.display()
    );
    seeds
}

// ---------------------------------------------------------------------------------------------
// Vocabulary

const NAMES: &[&str] = &[
    "web",
    "api",
    "app",
    "name",
    "image",
    "env",
    "value",
    "x",
    "a",
    "metrics",
    "envoy",
    "test-ca",
    "data",
    "team",
    "volumes",
    "containers",
];

const JSONPATHS: &[&str] = &[
    "$",
    "$.metadata.name",
    "$.metadata.namespace",
    "$.metadata.labels",
    "$.metadata.labels.app",
    "$.metadata.annotations",
    "$.spec",
    "$.spec.replicas",
    "$.spec.containers",
    "$.spec.containers[*]",
    "$.spec.containers[0]",
    "$.spec.containers[-1]",
    "$.spec.containers[0:2]",
    "$.spec.containers[::-1]",
    "$.spec.containers[*].image",
    "$.spec['containers','initContainers'][*]",
    "$.spec.template.spec.containers[*]",
    "$..containers[*]",
    "$..image",
    "$..name",
    "$..*",
    "$..[*]",
    "$.*",
    "$.spec.containers[?@.name == 'api']",
    "$.spec.containers[?@.image]",
    "$.spec.containers[?match(@.image, 'nginx.*')]",
    "$.spec.containers[?search(@.image, 'docker')]",
    "$.spec.containers[?length(@.ports) > 0]",
    "$.spec.containers[?count(@..*) > 3]",
    "$..[?@.name]",
    "$..[?@.name == 'x' || @.image != 'y']",
    "$.spec.volumes[?!@.secret]",
    "$.metadata.labels.*",
    "$['metadata']['name']",
    "$.metadata.annotations['initium.dev/mutated-by']",
    "$[",
    "$..",
    "$.a..b",
    "metadata.name",
    "$.spec.containers[?@.name ==",
    "$[?value(@..x) == 1]",
];

const SEGMENTS: &[&str] = &[
    ".spec",
    ".metadata",
    ".containers",
    ".name",
    ".image",
    ".labels",
    ".*",
    "..*",
    "[*]",
    "[0]",
    "[1]",
    "[-1]",
    "[0:1]",
    "[::2]",
    "..name",
    "..image",
    "['a','b']",
    "[?@.name]",
    "[?@ == 'x']",
    "[?length(@) > 1]",
    "[?@.a > 1 && @.b]",
    "['metadata','spec']",
    "..[*]",
    ".x",
    "[?match(@, '.*')]",
];

const POINTERS: &[&str] = &[
    "",
    "/",
    "/metadata",
    "/metadata/name",
    "/metadata/labels/app",
    "/metadata/annotations/a~1b",
    "/metadata/annotations/initium.dev~1mutated-by",
    "/spec",
    "/spec/containers",
    "/spec/containers/0",
    "/spec/containers/0/image",
    "/spec/containers/-",
    "/spec/volumes",
    "/spec/template/spec/containers",
    "/image",
    "/name",
    "/env",
    "/volumeMounts",
    "/x/y/z",
    "/~0",
    "/~2",
    "spec/volumes",
    "/metadata/labels/~",
    "/apiVersion",
    "/kind",
    // Kyverno-style list tokens (issue 36): `-1` (refused when compiled), `-` and indexes on
    // the way, into lists and parents that are missing or null.
    "/spec/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution/nodeSelectorTerms/-1/matchExpressions/-",
    "/spec/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution/nodeSelectorTerms/0/matchExpressions/-",
    "/spec/containers/-1/env",
    "/spec/containers/-1",
    "/spec/tolerations/-",
    "/spec/tolerations/-/key",
    "/spec/tolerations/0",
    "/spec/tolerations/0/key",
    "/spec/containers/3/env/-",
    "/spec/containers/0/env/-",
    "/spec/volumes/0/name",
    "/spec/x/-/y",
    "/spec/x/1/y",
    "/spec/template/spec/containers/0/env/-",
    "/metadata/labels/0",
    "/metadata/labels/-",
    "/metadata/labels/team",
    "/metadata/annotations/backup",
    "/metadata/annotations/0/x",
    "/spec/template/metadata/labels/tier",
    "/spec/template/metadata/annotations",
];

const REGEXES: &[&str] = &[
    "^docker\\.io/",
    "^nginx",
    "nginx",
    ".",
    "^",
    "$",
    "",
    "(?P<name>\\w+)",
    "(\\w+)/(\\w+)",
    "(a+)+$",
    "\\w{20}",
    "(\\w{20}){10}",
    "[",
    "(?i)X",
    ".*",
    "^$",
    "\\b",
    "(?s).",
    "x{1000}",
    "\\p{L}+",
    "[[:alpha:]]+",
    "(?m)^",
    "\\d+",
    "(",
    "a{2,1}",
    "\\",
];

const REPLACEMENTS: &[&str] = &[
    "$0$0",
    "$0",
    "$1",
    "${name}",
    "${2}${1}",
    "mirror.example.com/",
    "mirror.example.com/library/$0",
    "$",
    "$$",
    "${",
    "",
    "x",
    "${name}${name}${name}",
];

const REGEX_PAIRS: &[(&str, &str)] = &[
    // Rewrites whose output no longer matches: docs/rules.md promises idempotence for them.
    ("^docker\\.io/", "mirror.example.com/"),
    ("^nginx$", "mirror.example.com/library/nginx"),
    ("^registry\\.example\\.com/", "mirror.example.com/"),
    ("^([a-z]+):latest$", "$1:stable"),
];

const GLOBS: &[&str] = &[
    "*",
    "web-*",
    "?pi",
    "api",
    "a*b*c*d*e*f*g*h",
    "*-*-*",
    "",
    "[",
    "payments",
    "kube-*",
    "**",
    "?",
];

const KINDS: &[&str] = &[
    "Pod",
    "v1/Pod",
    "*/v1/Pod",
    "apps/v1/Deployment",
    "Deployment",
    "*",
    "*/*/*",
    "ConfigMap",
    "Namespace",
    "v1/Namespace",
    "apps/*/Deployment",
    "Service",
    "",
    "a/b/c/d",
    "v1/",
    "/Pod",
    "pod",
];

const TEMPLATES: &[&str] = &[
    "{{ $.metadata.name }}",
    "{{ $.metadata.namespace }}",
    "{{ $.metadata.labels.app }}",
    "{{ $.spec.replicas }}",
    "{{ @ }}",
    "{{ @.name }}",
    "{{ @.image }}",
    "{{ $ }}",
    "{{ $.spec }}",
    "{{ $..image }}",
    "{{ $..name }}",
    "prefix-{{ $.metadata.name }}-{{ $.metadata.namespace }}",
    "{{ @.name }}-{{ @.name }}-{{ @.name }}",
    "{{",
    "{{ }}",
    "}}{{",
    "{{ x }}",
    "{{ $.a[ }}",
    "{{ $.metadata.name }}{{ $.metadata.name }}",
    "{{ $.spec.containers[?@.name == 'api'].image }}",
    "{{ lower(@.name) }}",
    "{{ upper(trim($.metadata.name)) }}-x",
    "{{ join(',', $..image) }}",
    "{{ split($.metadata.name, '-') }}",
    "{{ split($.metadata.name, '') }}",
    "{{ replace(@.image, '(.)', '$1$1') }}",
    "{{ replace($.metadata.name, '(', 'x') }}",
    "{{ default($.metadata.labels.app, @) }}",
    "{{ base64Decode(base64Encode(toJson($))) }}",
    "{{ fromJson(toJson($.spec)).containers[0] }}",
    "{{ fromJson($.metadata.name) }}",
    "{{ sha256(@.name) }}",
    "{{ image(@.image) }}",
    "{{ image(@.image).tag }}/{{ image($.metadata.name)['digest'] }}",
    "{{ nope(@) }}",
    // Templated nulls, numbers and booleans (issue 36): written into labels, annotations and
    // defaults, they must not reach the object as such.
    "{{ default($.x, null) }}",
    "{{ default($.metadata.annotations.team, null) }}",
    "{{ default(@.x, null) }}",
    "{{ $.spec.priority }}",
    "{{ $.spec.hostNetwork }}",
    "{{ $.spec.template.spec.replicas }}",
    "{{ fromJson('true') }}",
    "{{ fromJson('12') }}",
    "{{ fromJson('null') }}",
    "{{ @.ports[0].containerPort }}",
    "{{ $.spec.tolerations }}",
    "{{ lower(lower(lower(lower(lower(lower(lower(lower(lower(@.name))))))))) }}",
];

pub fn name(rng: &mut Rng) -> String {
    match rng.below(12) {
        0 => String::new(),
        1 => format!("n{}", rng.below(1000)),
        2 => "x".repeat(rng.range(60, 300)),
        3 => "Bad_Name".to_string(),
        4 => "a\u{1b}[31mred\u{7}".to_string(),
        _ => rng.pick(NAMES).to_string(),
    }
}

pub fn jsonpath(rng: &mut Rng) -> String {
    if rng.chance(60) {
        return rng.pick(JSONPATHS).to_string();
    }
    let mut s = String::from(if rng.chance(85) { "$" } else { "@" });
    for _ in 0..rng.range(1, 5) {
        let segment = rng.pick::<&str>(SEGMENTS);
        s.push_str(segment);
    }
    s
}

pub fn element_jsonpath(rng: &mut Rng) -> String {
    if rng.chance(50) {
        return rng
            .pick(&[
                "$.spec.containers[*]",
                "$.spec['containers','initContainers'][*]",
                "$.spec.template.spec.containers[*]",
                "$..containers[*]",
                "$.spec.volumes[*]",
                "$..*",
                "$..[*]",
                "$.metadata",
                "$",
                "$.spec.containers[?@.name == 'api']",
                "$..[?@.image]",
                "$.spec.template.metadata",
                "$..metadata",
            ])
            .to_string();
    }
    jsonpath(rng)
}

pub fn pointer(rng: &mut Rng) -> String {
    if rng.chance(80) {
        return rng.pick(POINTERS).to_string();
    }
    let mut s = String::new();
    for _ in 0..rng.range(1, 4) {
        s.push('/');
        s.push_str(&name(rng).replace('~', "~0").replace('/', "~1"));
    }
    s
}

pub fn regex(rng: &mut Rng) -> String {
    if rng.chance(85) {
        return rng.pick(REGEXES).to_string();
    }
    let mut s = String::new();
    for _ in 0..rng.range(1, 4) {
        let part = rng.pick::<&str>(REGEXES);
        s.push_str(part);
    }
    s
}

pub fn template_string(rng: &mut Rng, element: bool) -> String {
    loop {
        let t = rng.pick(TEMPLATES);
        if element || !t.contains('@') {
            return t.to_string();
        }
    }
}

/// A string that is sometimes plain, sometimes a template.
fn value_string(rng: &mut Rng, element: bool, templates: bool) -> String {
    if templates && rng.chance(35) {
        template_string(rng, element)
    } else {
        match rng.below(6) {
            0 => rng.pick(NAMES).to_string(),
            1 => format!("{}:{}", rng.pick(NAMES), rng.below(10)),
            2 => "mirror.example.com/library/nginx".into(),
            3 => "yes".into(),
            4 => String::new(),
            _ => format!("v{}", rng.below(100)),
        }
    }
}

/// A random JSON value, at most `depth` deep.
pub fn value(rng: &mut Rng, depth: usize, element: bool, templates: bool) -> Value {
    let kind = if depth == 0 {
        rng.below(6)
    } else {
        rng.below(9)
    };
    match kind {
        0 => Value::Null,
        1 => json!(rng.chance(50)),
        2 => match rng.below(6) {
            0 => json!(-1),
            1 => json!(u64::MAX),
            2 => json!(1.5e300),
            3 => json!(i64::MIN),
            _ => json!(rng.below(100)),
        },
        3..=5 => Value::String(value_string(rng, element, templates)),
        6 => Value::Array(
            (0..rng.small(4))
                .map(|_| value(rng, depth - 1, element, templates))
                .collect(),
        ),
        _ => {
            let mut map = Map::new();
            for _ in 0..rng.small(4) {
                let v = value(rng, depth - 1, element, templates);
                map.insert(name(rng), v);
            }
            Value::Object(map)
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Objects

fn container(rng: &mut Rng, i: usize) -> Value {
    let image = rng
        .pick(&[
            "nginx",
            "nginx:latest",
            "docker.io/library/redis:7",
            "registry.example.com/payments/api:1.4",
            "busybox",
            "",
        ])
        .to_string();
    let mut c = json!({"name": format!("c{i}"), "image": image});
    if rng.chance(40) {
        c["env"] = json!([{"name": "A", "value": "1"}]);
    }
    if rng.chance(30) {
        c["volumeMounts"] = json!([{"name": "data", "mountPath": "/data"}]);
    }
    if rng.chance(20) {
        c["ports"] = json!([{"containerPort": 8080}]);
    }
    c
}

/// A Pod, Deployment, Namespace, ConfigMap or other object: mostly realistic, sometimes with
/// hostile shapes (thousands of containers, deep nesting, wrong types).
pub fn object(rng: &mut Rng) -> Value {
    let seeds = seeds();
    let mut obj = match rng.below(10) {
        0..=3 => rng.pick(&seeds.objects).clone(),
        4..=6 => {
            let n = if rng.chance(5) {
                rng.range(500, 3000)
            } else {
                rng.small(6)
            };
            let containers: Vec<Value> = (0..n).map(|i| container(rng, i)).collect();
            json!({"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": "web", "namespace": "payments",
                                "labels": {"app": "web"}},
                   "spec": {"containers": containers}})
        }
        7 => {
            // A controller with a Pod template (what autogen rules run on).
            let template = match rng.below(8) {
                0 => json!({"spec": {"containers": [container(rng, 0)]}}),
                1 => value(rng, 2, false, false),
                _ => json!({"metadata": {"labels": {"app": "web"}},
                            "spec": {"containers": [container(rng, 0), container(rng, 1)]}}),
            };
            let (api_version, kind) = *rng.pick(&[
                ("apps/v1", "Deployment"),
                ("apps/v1", "StatefulSet"),
                ("apps/v1", "DaemonSet"),
                ("apps/v1", "ReplicaSet"),
                ("batch/v1", "Job"),
                ("batch/v1", "CronJob"),
            ]);
            let spec = if kind == "CronJob" {
                json!({"schedule": "0 * * * *", "jobTemplate": {"spec": {"template": template}}})
            } else {
                json!({"replicas": 2, "template": template})
            };
            json!({"apiVersion": api_version, "kind": kind,
                   "metadata": {"name": "web", "namespace": "shop"}, "spec": spec})
        }
        8 => {
            json!({"apiVersion": "v1", "kind": rng.pick(&["Namespace", "ConfigMap", "Secret", "Service"]),
                    "metadata": {"name": name(rng), "labels": {"team": "a"}},
                    "data": value(rng, 3, false, false)})
        }
        _ => {
            let mut v = value(rng, 4, false, false);
            if !v.is_object() {
                v = json!({"spec": v});
            }
            v["apiVersion"] = json!(rng.pick(&["v1", "apps/v1", "x.example.com/v1", ""]));
            v["kind"] = json!(rng.pick(KINDS));
            v
        }
    };
    // Tweaks: names, generateName, labels, annotations, wrong types.
    for _ in 0..rng.small(3) {
        match rng.below(9) {
            0 => {
                if let Some(m) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
                    m.remove("name");
                    m.insert("generateName".into(), json!("api-"));
                }
            }
            1 => set_pointer(
                &mut obj,
                "/metadata/annotations",
                json!({"sidecar.initium.dev/inject": "envoy", "initium.dev/mutated-by": "x"}),
            ),
            2 => {
                let labels = json!({"app": name(rng), "team": "payments"});
                set_pointer(&mut obj, "/metadata/labels", labels);
            }
            3 => {
                let v = value(rng, 2, false, false);
                set_pointer(&mut obj, "/metadata", v);
            }
            4 => {
                let v = value(rng, 2, false, false);
                set_pointer(&mut obj, "/spec/containers", v);
            }
            5 => obj = nest(rng, obj),
            6 => {
                if let Some(m) = obj.as_object_mut() {
                    m.remove("metadata");
                }
            }
            7 => {
                let ns = json!(rng.pick(&["payments", "kube-system", "", "shop"]));
                set_pointer(&mut obj, "/metadata/namespace", ns);
            }
            8 if rng.chance(50) => {
                // Parents a path goes through that are null (issue 36), and numbers and
                // booleans for templates to select.
                let path = *rng.pick(&[
                    "/spec/tolerations",
                    "/spec/affinity",
                    "/spec/volumes",
                    "/spec/x",
                    "/metadata/labels",
                    "/metadata/annotations",
                    "/spec/template/metadata",
                ]);
                set_pointer(&mut obj, path, Value::Null);
                set_pointer(&mut obj, "/spec/priority", json!(rng.range(0, 20)));
                set_pointer(&mut obj, "/spec/hostNetwork", json!(rng.chance(50)));
            }
            _ => {
                let path = rng.pick(&["/spec/x", "/metadata/annotations/a", "/status"]);
                let v = value(rng, 3, false, false);
                set_pointer(&mut obj, path, v);
            }
        }
    }
    if !obj.is_object() {
        obj = json!({"apiVersion": "v1", "kind": "Pod", "spec": obj});
    }
    if rng.chance(4) {
        // Text the lazy DFA thrashes on (a/b with a `c` now and then), for counted repetitions
        // (issue 30: 58 s for a 1 MB rewrite), in the name and an annotation.
        let len = rng.range(1_000, 60_000);
        let text: String = (0..len)
            .map(|i| match (i * 2_654_435_761usize) % 97 {
                96 => 'c',
                n if n % 2 == 0 => 'a',
                _ => 'b',
            })
            .collect();
        set_pointer(&mut obj, "/metadata/annotations/blob", json!(text.clone()));
        if rng.chance(50) {
            set_pointer(&mut obj, "/metadata/name", json!(text));
        }
    }
    if rng.chance(3) {
        // Many nodes, nested: what `in: $..*` turns into keys (issue 30: a 61 KB Pod, 415 MB).
        obj = nest(rng, obj);
        let wide: Vec<Value> = (0..rng.range(100, 2_000))
            .map(|i| json!({"name": format!("e{i}"), "value": {"a": [i, {"b": "x"}]}}))
            .collect();
        set_pointer(&mut obj, "/spec/wide", json!(wide));
    }
    obj
}

/// Wraps a value deep inside nested objects or arrays (hostile depth, within what the API
/// server and serde_json's recursion limit let through).
fn nest(rng: &mut Rng, mut obj: Value) -> Value {
    let depth = rng.range(20, 110);
    let mut inner = json!("leaf");
    for i in 0..depth {
        inner = if i % 2 == 0 {
            json!({"n": inner})
        } else {
            json!([inner])
        };
    }
    set_pointer(&mut obj, "/spec/deep", inner);
    obj
}

fn set_pointer(obj: &mut Value, pointer: &str, v: Value) {
    let mut cur = obj;
    let tokens: Vec<&str> = pointer.split('/').skip(1).collect();
    for (i, t) in tokens.iter().enumerate() {
        if !cur.is_object() {
            *cur = json!({});
        }
        let map = cur.as_object_mut().expect("object");
        if i + 1 == tokens.len() {
            map.insert(t.to_string(), v);
            return;
        }
        cur = map.entry(t.to_string()).or_insert_with(|| json!({}));
    }
}

// ---------------------------------------------------------------------------------------------
// Rules

fn selector(rng: &mut Rng) -> Value {
    let mut s = Map::new();
    if rng.chance(60) {
        s.insert(
            "matchLabels".into(),
            json!({ rng.pick(NAMES).to_string(): name(rng) }),
        );
    }
    if rng.chance(50) {
        let op = rng.pick(&["In", "NotIn", "Exists", "DoesNotExist", "Equals", ""]);
        let values: Vec<String> = (0..rng.small(3)).map(|_| name(rng)).collect();
        s.insert(
            "matchExpressions".into(),
            json!([{"key": rng.pick(NAMES), "operator": op, "values": values}]),
        );
    }
    Value::Object(s)
}

fn match_resources(rng: &mut Rng, cluster: bool, exclude: bool) -> Value {
    let mut m = Map::new();
    if !exclude || rng.chance(20) {
        let kinds: Vec<&str> = if rng.chance(70) {
            vec![*rng.pick(&["Pod", "v1/Pod", "*", "apps/v1/Deployment"])]
        } else {
            (0..rng.small(3)).map(|_| *rng.pick(KINDS)).collect()
        };
        m.insert("kinds".into(), json!(kinds));
    }
    if rng.chance(25) {
        const OPERATIONS: &[&[&str]] = &[
            &["CREATE"],
            &["UPDATE"],
            &["CREATE", "UPDATE"],
            &["DELETE"],
            &[],
        ];
        let ops = *rng.pick(OPERATIONS);
        m.insert("operations".into(), json!(ops));
    }
    if rng.chance(15) || exclude && rng.chance(30) {
        let names: Vec<&str> = (0..rng.range(1, 3)).map(|_| *rng.pick(GLOBS)).collect();
        m.insert("names".into(), json!(names));
    }
    if (cluster || rng.chance(5)) && rng.chance(20) {
        let ns: Vec<&str> = (0..rng.range(1, 3)).map(|_| *rng.pick(GLOBS)).collect();
        m.insert("namespaces".into(), json!(ns));
    }
    if (cluster || rng.chance(5)) && rng.chance(10) {
        m.insert("namespaceSelector".into(), selector(rng));
    }
    if rng.chance(15) || exclude && rng.chance(40) {
        m.insert("labels".into(), selector(rng));
    }
    if rng.chance(15) || exclude && rng.chance(40) {
        m.insert(
            "annotations".into(),
            json!({ rng.pick(&["sidecar.initium.dev/inject", "a", "certs.example.com/inject"]).to_string(): rng.pick(GLOBS).to_string() }),
        );
    }
    Value::Object(m)
}

fn condition(rng: &mut Rng) -> Value {
    let path = jsonpath(rng);
    condition_on(rng, path)
}

/// A condition with `path` and a random test (sometimes two tests, or a bad bound).
fn condition_on(rng: &mut Rng, path: String) -> Value {
    match rng.below(9) {
        0 => json!({"path": path, "matches": regex(rng)}),
        1 => json!({"path": path, "equals": value(rng, 2, false, false)}),
        2 => json!({"path": path, "exists": rng.chance(50)}),
        3 => json!({"path": path, "notEquals": value(rng, 2, false, false)}),
        4 => {
            json!({"path": path, "in": if rng.chance(20) { "$..*".to_string() } else { jsonpath(rng) }})
        }
        5 => json!({"path": path, "greaterThan": *rng.pick(&["1", "512Mi", "250m", "x", "1e400"])}),
        6 => json!({"path": path, "lessThan": rng.range(0, 100)}),
        _ => json!({"path": path, "matches": regex(rng), "exists": true}),
    }
}

/// `remove` of the elements of a list chosen by conditions on each (`@`).
fn remove(rng: &mut Rng) -> Value {
    let field = *rng.pick(&["name", "hostPath", "image", "mountPath", "x"]);
    let path = if rng.chance(90) {
        format!("@.{field}")
    } else {
        jsonpath(rng)
    };
    let conditions: Vec<Value> = (0..rng.range(1, 3))
        .map(|_| condition_on(rng, path.clone()))
        .collect();
    json!({"remove": {"path": pointer(rng), "where": conditions}})
}

/// `defaults`: fields set where absent.
fn defaults(rng: &mut Rng, element: bool, templates: bool) -> Value {
    let mut v = value(rng, 3, element, templates);
    if !v.is_object() || rng.chance(30) {
        v = json!({"metadata": {"labels": {"team": value_string(rng, element, templates)}}});
    }
    if rng.chance(15) {
        v = metadata_values(rng, element, templates);
    }
    json!({"defaults": v})
}

fn patch_op(rng: &mut Rng, element: bool, templates: bool) -> Value {
    let op = *rng.pick(&["add", "remove", "replace", "move", "copy", "test", "bogus"]);
    let mut p = json!({"op": op, "path": pointer(rng)});
    if matches!(op, "move" | "copy") || rng.chance(5) {
        p["from"] = json!(pointer(rng));
    }
    if matches!(op, "add" | "replace" | "test") || rng.chance(5) {
        p["value"] = value(rng, 2, element, templates);
    }
    p
}

fn upsert(rng: &mut Rng, element: bool, templates: bool) -> Value {
    let key = *rng.pick(&["name", "name", "mountPath", "id", ""]);
    let mut v = value(rng, 2, element, templates);
    if rng.chance(85) {
        if !v.is_object() {
            v = json!({});
        }
        v[key] = json!(if templates && rng.chance(20) {
            template_string(rng, element)
        } else {
            rng.pick(NAMES).to_string()
        });
    }
    json!({"upsert": {"path": pointer(rng), "key": key, "value": v}})
}

fn rewrite(rng: &mut Rng) -> Value {
    let (regex, replacement) = if rng.chance(40) {
        let (r, p) = rng.pick(REGEX_PAIRS);
        (r.to_string(), p.to_string())
    } else {
        (regex(rng), rng.pick(REPLACEMENTS).to_string())
    };
    json!({"rewrite": {"path": pointer(rng), "regex": regex, "replacement": replacement}})
}

fn merge(rng: &mut Rng, element: bool, templates: bool) -> Value {
    let mut v = value(rng, 3, element, templates);
    if !v.is_object() || rng.chance(30) {
        v = json!({"metadata": {"labels": {"team": value_string(rng, element, templates)}}});
    }
    if rng.chance(15) {
        v = metadata_values(rng, element, templates);
    }
    json!({"merge": v})
}

/// Labels or annotations (of the object, of its Pod template, or of the `forEach` element,
/// which may be a `metadata`) whose values are templates that select numbers, booleans,
/// nulls or objects, or are unquoted scalars (`backup: yes` read as `true`): the engine must
/// not write what the API server refuses (issue 36).
fn metadata_values(rng: &mut Rng, element: bool, templates: bool) -> Value {
    let value = if templates && rng.chance(70) {
        json!(*rng.pick(&[
            "{{ $.spec.priority }}",
            "{{ $.spec.replicas }}",
            "{{ $.spec.hostNetwork }}",
            "{{ fromJson('true') }}",
            "{{ fromJson('12') }}",
            "{{ default($.metadata.annotations.team, null) }}",
            "{{ default($.x, null) }}",
            "{{ $.metadata.labels }}",
            "{{ $.spec.containers[*].name }}",
            "v{{ $.spec.replicas }}",
        ]))
    } else {
        rng.pick(&[
            json!(true),
            json!(3),
            json!("yes"),
            json!(null),
            json!(["a"]),
        ])
        .clone()
    };
    let key = if rng.chance(10) {
        rng.pick(&["0", "-", "-1"]).to_string()
    } else {
        rng.pick(&["team", "backup", "app"]).to_string()
    };
    let field = *rng.pick(&["labels", "annotations"]);
    let map = json!({ field: { key: value } });
    match rng.below(4) {
        0 if element => map,
        1 => json!({"spec": {"template": {"metadata": map}}}),
        _ => json!({ "metadata": map }),
    }
}

fn element_mutation(rng: &mut Rng, templates: bool) -> Value {
    match rng.below(6) {
        0 => merge(rng, true, templates),
        1 => {
            json!({"patch": (0..rng.range(1, 3)).map(|_| patch_op(rng, true, templates)).collect::<Vec<_>>()})
        }
        2 => upsert(rng, true, templates),
        3 => defaults(rng, true, templates),
        4 => remove(rng),
        _ => rewrite(rng),
    }
}

fn mutation(rng: &mut Rng) -> Value {
    let mut m = match rng.below(12) {
        0 | 1 => merge(rng, false, true),
        2 | 3 => {
            json!({"patch": (0..rng.range(1, 3)).map(|_| patch_op(rng, false, true)).collect::<Vec<_>>()})
        }
        4 | 5 => upsert(rng, false, true),
        6 | 7 => json!({"forEach": element_jsonpath(rng),
                        "mutations": (0..rng.range(1, 3)).map(|_| element_mutation(rng, true)).collect::<Vec<_>>()}),
        8 => defaults(rng, false, true),
        9 => remove(rng),
        _ => rewrite(rng),
    };
    if rng.chance(10)
        && let Some(upsert) = m.get_mut("upsert")
    {
        upsert["position"] = json!(*rng.pick(&["Prepend", "Append", "Middle"]));
    }
    if rng.chance(3) {
        // Two kinds at once, or a forEach without mutations: compile errors.
        let other = merge(rng, false, false);
        if let (Some(m), Some(o)) = (m.as_object_mut(), other.as_object()) {
            m.extend(o.clone());
        }
    }
    m
}

/// Rule specs built to be hostile: chained `forEach` with `{{ @ }}`, merges that copy the
/// whole object, rewrites that double strings, patches that copy the object into itself,
/// expensive regexes. Sizes are parameters, so the shrinker can cut them down.
fn hostile_mutations(rng: &mut Rng) -> Vec<Value> {
    let n = rng.range(2, 30);
    let kind = rng.below(10);
    (0..n)
        .map(|i| match kind {
            0 => json!({"forEach": rng.pick(&["$..*", "$..[*]", "$.spec..*"]).to_string(),
                        "mutations": [{"merge": {format!("k{}", i % 3): "{{ @ }}"}}]}),
            1 => json!({"merge": {format!("copy{}", i % 2): "{{ $ }}"}}),
            2 => json!({"rewrite": {"path": "/metadata/name", "regex": ".", "replacement": "$0$0"}}),
            3 => json!({"patch": [{"op": "copy", "from": "", "path": format!("/spec/c{}", i % 2)}]}),
            4 => json!({"forEach": "$..*", "mutations": [{"upsert": {"path": "/list", "key": "name",
                        "value": {"name": format!("e{i}"), "all": "{{ $ }}"}}}]}),
            5 => json!({"rewrite": {"path": "/metadata/name", "regex": format!("(\\w{{20}}){{{}}}", 1 + i % 20), "replacement": "$0"}}),
            // A template query of many segments (issue 30: 700,000 took 782 MB to compile).
            7 => json!({"merge": {"metadata": {"labels": {format!("q{i}"):
                        format!("{{{{ ${} }}}}", ".a".repeat(rng.range(1, 200_000)))}}}}),
            // Counted repetitions the lazy DFA thrashes on, over a string the rule grows.
            8 => json!({"rewrite": {"path": "/metadata/name",
                        "regex": format!("a[ab]{{{}}}c", rng.range(5, 400)), "replacement": "$0ab"}}),
            // `remove ... in:` over every node, inside forEach.
            9 => json!({"forEach": "$.spec.containers[*]", "mutations": [
                        {"remove": {"path": "/env", "where": [{"path": "@.name", "in": "$..*"}]}}]}),
            _ => json!({"forEach": "$.spec.containers[*]", "mutations": [
                        {"merge": {"env": [{"name": "X", "value": "{{ @.name }}{{ @.name }}"}], "args": "{{ @ }}"}}]}),
        })
        .collect()
}

/// A MutationRule or ClusterMutationRule document: mostly valid, often with compile errors,
/// sometimes hostile.
pub fn rule(rng: &mut Rng, index: usize) -> Value {
    let seeds = seeds();
    if rng.chance(15) {
        let mut r = rng.pick(&seeds.rules).clone();
        if rng.chance(50) {
            mutate_value(rng, &mut r);
        }
        return r;
    }
    let cluster = rng.chance(60);
    let mut spec = Map::new();
    if rng.chance(30) {
        spec.insert(
            "priority".into(),
            json!(*rng.pick(&[0i64, -5, 50, 100, i32::MAX as i64, i64::MAX])),
        );
    }
    if rng.chance(30) {
        spec.insert(
            "failurePolicy".into(),
            json!(rng.pick(&["Ignore", "Fail", "Bogus"])),
        );
    }
    spec.insert("match".into(), match_resources(rng, cluster, false));
    if rng.chance(15) {
        spec.insert("exclude".into(), match_resources(rng, cluster, true));
    }
    if rng.chance(25) {
        let conditions: Vec<Value> = (0..rng.range(1, 3)).map(|_| condition(rng)).collect();
        spec.insert("conditions".into(), json!(conditions));
    }
    let mutations: Vec<Value> = if rng.chance(12) {
        hostile_mutations(rng)
    } else {
        (0..rng.range(1, 4)).map(|_| mutation(rng)).collect()
    };
    spec.insert("mutations".into(), json!(mutations));
    if rng.chance(3) {
        let dependencies = [
            json!({"service": {"name": "db"}}),
            json!({"job": {"name": "migrate", "namespace": "shop"}}),
            json!({"pods": {"selector": {"matchLabels": {"app": "db"}}}}),
            json!({"daemonSet": {"name": "agent"}}),
            json!({"object": {"apiVersion": "example.com/v1", "kind": "Db", "name": "x",
                              "conditions": [condition(rng)]}}),
            json!({"service": {"name": "db"}, "job": {"name": "both"}}),
        ];
        let wait_for: Vec<Value> = (0..rng.range(0, 3))
            .map(|_| dependencies[rng.range(0, dependencies.len() - 1)].clone())
            .collect();
        spec.insert(
            "gate".into(),
            json!({"waitFor": wait_for, "timeout": rng.pick(&["30s", "10m", "x", "-1s", "0s"]),
                   "onTimeout": rng.pick(&["Release", "Hold"])}),
        );
        if rng.chance(2) {
            // A gate rule may have no mutations.
            spec.insert("mutations".into(), json!([]));
        }
    }
    if rng.chance(8) {
        // A well-formed gate on objects, its conditions often about what the subjects hold:
        // the gate controller keeps of an object only what these read, and must judge the
        // same on that as on the whole (the `rules` target's oracle).
        let wait_for: Vec<Value> = (0..rng.range(1, 2))
            .map(|_| {
                let conditions: Vec<Value> = (0..rng.range(0, 3))
                    .map(|_| match rng.below(6) {
                        0 => json!({"path": "$.metadata.name", "exists": true}),
                        1 => json!({"path": "$.spec.containers[*].image", "matches": "."}),
                        2 => json!({"path": "$.metadata.labels.*", "exists": true}),
                        3 => {
                            json!({"path": "$.spec.containers[?@.name].name", "in": "$.spec..name"})
                        }
                        _ => condition(rng),
                    })
                    .collect();
                json!({"object": {"apiVersion": "v1", "kind": "Pod", "name": "x",
                                  "conditions": conditions}})
            })
            .collect();
        spec.insert("gate".into(), json!({"waitFor": wait_for}));
    }
    if rng.chance(12) {
        // Autogen: the rule also runs on controllers' Pod templates (valid only on Pod rules
        // without a gate; otherwise a compile error to check).
        let controllers = [
            "Deployment",
            "StatefulSet",
            "DaemonSet",
            "ReplicaSet",
            "Job",
            "CronJob",
        ];
        let autogen = match rng.below(5) {
            0..=2 => json!({}),
            3 => {
                let picked: Vec<&str> = (0..rng.range(1, 3))
                    .map(|_| *rng.pick(&controllers))
                    .collect();
                json!({"controllers": picked})
            }
            _ => rng
                .pick(&[
                    json!({"controllers": ["Rollout"]}),
                    json!({"controllers": []}),
                    json!(true),
                ])
                .clone(),
        };
        spec.insert("autogen".into(), autogen);
        if rng.chance(60) {
            spec.insert("match".into(), json!({"kinds": ["Pod"]}));
        }
    }
    if rng.chance(3) {
        spec.insert("bogusField".into(), json!(1));
    }
    let mut doc = json!({
        "apiVersion": "initium.dev/v1alpha1",
        "kind": if cluster { "ClusterMutationRule" } else { "MutationRule" },
        "metadata": {"name": format!("r{index}")},
        "spec": spec,
    });
    if !cluster {
        doc["metadata"]["namespace"] = json!(rng.pick(&["payments", "shop", "default"]));
    }
    if rng.chance(5) {
        mutate_value(rng, &mut doc);
    }
    doc
}

/// A rule with one mutation of the kinds docs/rules.md promises are idempotent: `merge` and
/// `upsert` with literal values, `rewrite` whose output no longer matches, alone or in a
/// `forEach` over list elements.
pub fn idempotent_rule(rng: &mut Rng) -> Value {
    let one = |rng: &mut Rng, element: bool| match rng.below(5) {
        0 => merge(rng, element, false),
        1 => upsert(rng, element, false),
        2 => defaults(rng, element, false),
        3 => remove(rng),
        _ => {
            let (r, p) = rng.pick(REGEX_PAIRS);
            let path = if element { "/image" } else { "/metadata/name" };
            json!({"rewrite": {"path": path, "regex": r, "replacement": p}})
        }
    };
    let mutation = if rng.chance(40) {
        json!({"forEach": rng.pick(&["$.spec.containers[*]", "$.spec['containers','initContainers'][*]",
                                     "$.spec.template.spec.containers[*]"]).to_string(),
               "mutations": [one(rng, true)]})
    } else {
        one(rng, false)
    };
    json!({"apiVersion": "initium.dev/v1alpha1", "kind": "ClusterMutationRule",
           "metadata": {"name": "idempotent"},
           "spec": {"match": {"kinds": ["*"]}, "mutations": [mutation]}})
}

// ---------------------------------------------------------------------------------------------
// Mutation of valid documents

/// Changes one node of a JSON value: a field removed, a value replaced by a random one or a
/// different type, an array element duplicated.
pub fn mutate_value(rng: &mut Rng, v: &mut Value) {
    // Walk down a random path.
    let mut cur = v;
    loop {
        let descend = rng.chance(70);
        let next_key = match cur {
            Value::Object(map) if descend && !map.is_empty() => {
                let k = map.keys().nth(rng.below(map.len())).cloned();
                k.map(Ok)
            }
            Value::Array(items) if descend && !items.is_empty() => {
                Some(Err(rng.below(items.len())))
            }
            _ => None,
        };
        match next_key {
            Some(Ok(k)) => cur = cur.get_mut(&k).expect("key"),
            Some(Err(i)) => cur = cur.get_mut(i).expect("index"),
            None => break,
        }
    }
    match rng.below(6) {
        0 => *cur = value(rng, 2, true, true),
        1 => *cur = Value::Null,
        2 => {
            if let Value::Object(map) = cur
                && !map.is_empty()
            {
                let k = map.keys().nth(rng.below(map.len())).cloned().expect("key");
                map.remove(&k);
            }
        }
        3 => {
            if let Value::Array(items) = cur
                && !items.is_empty()
            {
                let i = rng.below(items.len());
                let dup = items[i].clone();
                items.insert(i, dup);
            }
        }
        4 => *cur = json!(template_string(rng, true)),
        _ => *cur = json!([cur.clone()]),
    }
}

const TOKENS: &[&[u8]] = &[
    b"{",
    b"}",
    b"[",
    b"]",
    b"\"",
    b":",
    b",",
    b"null",
    b"true",
    b"1e999",
    b"-0",
    b"\\u0000",
    b"\\ud800",
    b"\xff",
    b"\x00",
    b"\n",
    b"---\n",
    b"&a ",
    b"*a",
    b"!!binary ",
    b"<<: ",
    b"\t",
    b"{{ $ }}",
    b"{{ @ }}",
    b"$..*",
    b"~1",
    b"'",
    b"#",
    b"- ",
    b"? ",
    b"|",
    b">",
    b"18446744073709551616",
    b"0x1F",
    b"yes",
    b"\xef\xbb\xbf",
];

/// Byte-level mutation: flips, inserts, deletes, duplicates and splices of interesting tokens.
pub fn mutate_bytes(rng: &mut Rng, data: &mut Vec<u8>) {
    for _ in 0..rng.range(1, 8) {
        let len = data.len();
        let at = if len == 0 { 0 } else { rng.below(len + 1) };
        match rng.below(8) {
            0 if len > 0 => {
                let i = rng.below(len);
                data[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                data[i] = rng.byte();
            }
            2 => {
                let t = rng.pick(TOKENS);
                data.splice(at..at, t.iter().copied());
            }
            3 if len > 0 => {
                let end = (at + rng.range(1, 64)).min(len);
                data.drain(at.min(end)..end);
            }
            4 if len > 0 => {
                let start = rng.below(len);
                let end = (start + rng.range(1, 256)).min(len);
                let chunk = data[start..end].to_vec();
                let at = rng.below(data.len() + 1);
                data.splice(at..at, chunk);
            }
            5 if len > 0 => data.truncate(at),
            6 => {
                let t = rng.pick(TOKENS);
                let n = rng.range(2, 200);
                let run: Vec<u8> = t.iter().copied().cycle().take(t.len() * n).collect();
                data.splice(at..at, run);
            }
            _ => {
                let b = rng.byte();
                data.insert(at, b);
            }
        }
    }
    // Keep cases bounded: a case that is merely big wastes the run.
    data.truncate(1 << 20);
}

/// YAML written to be hostile to the parser: deep nesting, alias expansion, long scalars.
pub fn hostile_yaml(rng: &mut Rng) -> String {
    match rng.below(6) {
        0 => {
            let n = rng.range(100, 20_000);
            format!("a: {}1{}\n", "[".repeat(n), "]".repeat(n))
        }
        1 => {
            let n = rng.range(100, 20_000);
            format!("a: {}1{}\n", "{x: ".repeat(n), "}".repeat(n))
        }
        2 => {
            // Billion laughs: each level refers to the one before ten times.
            let levels = rng.range(3, 9);
            let mut s =
                String::from("a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n");
            for i in 1..levels {
                let refs = vec![format!("*a{}", i - 1); 10].join(", ");
                s.push_str(&format!("a{i}: &a{i} [{refs}]\n"));
            }
            s.push_str(&format!(
                "kind: Pod\napiVersion: v1\nmetadata: {{name: x}}\nspec: *a{}\n",
                levels - 1
            ));
            s
        }
        3 => {
            let n = rng.range(50, 3000);
            let mut s = String::new();
            for i in 0..n {
                s.push_str(&" ".repeat(i.min(4000)));
                s.push_str("- \n");
            }
            s
        }
        4 => format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {}\n",
            "x".repeat(rng.range(1000, 200_000))
        ),
        _ => "---\n".repeat(rng.range(10, 50_000)),
    }
}

// ---------------------------------------------------------------------------------------------
// Rules the policy compiler accepts, and objects they meet (tests/compiled.rs)
//
// `rule` above rarely writes a rule that `initium_engine::policy` compiles to a
// MutatingAdmissionPolicy (one `forEach`, `patch` or non-namespace template is enough to keep it
// on the webhook). These write mostly what it compiles: `merge`, `defaults` and `upsert` with
// literal values or `{{ $.metadata.namespace }}`, label, annotation and name selectors, `exists`
// conditions on plain paths, on Pods, Deployments and ConfigMaps; and objects drawn from the
// same small vocabulary, so that selectors match and mutations meet fields already there
// (sometimes holding exactly what the rule writes).

const C_LABEL_KEYS: &[&str] = &["app", "team", "tier", "app.kubernetes.io/name"];
const C_LABEL_VALUES: &[&str] = &["web", "api", "shop", "v1"];
const C_ANNOTATION_KEYS: &[&str] = &["a", "sidecar.initium.dev/inject", "example.com/note"];
const C_ANNOTATION_VALUES: &[&str] = &["envoy", "yes", "", "x-y"];
const C_NAMES: &[&str] = &["web", "api", "web-1", "debug-shell", "x"];
const C_NAME_GLOBS: &[&str] = &["web*", "*-1", "?pi", "w?b-*", "debug-*", "*", "x"];
const NAMESPACE_TEMPLATE: &str = "{{ $.metadata.namespace }}";

/// A string value: literal, or the object's namespace in a template.
fn c_string(rng: &mut Rng, literals: &[&str]) -> Value {
    match rng.below(6) {
        0 => json!(NAMESPACE_TEMPLATE),
        1 => json!(format!("ns-{NAMESPACE_TEMPLATE}")),
        2 => json!(format!("{NAMESPACE_TEMPLATE}.svc")),
        _ => json!(*rng.pick(literals)),
    }
}

/// `{key: value, ...}` of labels or annotations; `nulls` lets values be `null` (a merge that
/// removes the key).
fn c_meta_map(rng: &mut Rng, keys: &[&str], values: &[&str], nulls: bool) -> Value {
    let mut map = Map::new();
    for _ in 0..rng.range(1, 2) {
        let v = if nulls && rng.chance(20) {
            Value::Null
        } else {
            c_string(rng, values)
        };
        map.insert(rng.pick(keys).to_string(), v);
    }
    Value::Object(map)
}

/// Containers a rule adds and objects already hold (some equal, some differing in one field).
fn c_container(rng: &mut Rng) -> Value {
    match rng.below(5) {
        0 => json!({"name": "envoy", "image": "envoyproxy/envoy:v1.31.0",
                    "ports": [{"name": "admin", "containerPort": 9901}]}),
        1 => json!({"name": "envoy", "image": "envoyproxy/envoy:v1.30.0"}),
        2 => json!({"name": "agent", "image": "busybox", "args": ["sleep", "3600"],
                    "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}}}),
        3 => json!({"name": "app", "image": "registry.example.com/app:2",
                    "env": [{"name": "NS", "value": NAMESPACE_TEMPLATE}]}),
        _ => json!({"name": "app", "image": "nginx", "imagePullPolicy": "Always",
                    "terminationMessagePath": "/dev/termination-log",
                    "terminationMessagePolicy": "File"}),
    }
}

fn c_volume(rng: &mut Rng) -> Value {
    match rng.below(4) {
        0 => json!({"name": "data", "emptyDir": {}}),
        1 => json!({"name": "cfg", "configMap": {"name": "cfg"}}),
        2 => json!({"name": "cfg", "configMap": {"name": "cfg", "defaultMode": 420}}),
        _ => json!({"name": "ca", "secret": {"secretName": "ca-{{ $.metadata.namespace }}"}}),
    }
}

fn c_toleration(rng: &mut Rng) -> Value {
    match rng.below(3) {
        0 => {
            json!({"key": "dedicated", "operator": "Equal", "value": "batch", "effect": "NoSchedule"})
        }
        1 => json!({"key": "dedicated", "operator": "Exists"}),
        _ => {
            json!({"key": "gpu", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 60})
        }
    }
}

/// A label selector over the vocabulary, with every operator.
fn c_selector(rng: &mut Rng) -> Value {
    let mut s = Map::new();
    if rng.chance(60) {
        s.insert(
            "matchLabels".into(),
            json!({ rng.pick(C_LABEL_KEYS).to_string(): rng.pick(C_LABEL_VALUES).to_string() }),
        );
    }
    if s.is_empty() || rng.chance(40) {
        let op = *rng.pick(&["In", "NotIn", "Exists", "DoesNotExist"]);
        let mut e = json!({"key": rng.pick(C_LABEL_KEYS), "operator": op});
        if matches!(op, "In" | "NotIn") {
            let values: Vec<&str> = (0..rng.range(1, 2))
                .map(|_| *rng.pick(C_LABEL_VALUES))
                .collect();
            e["values"] = json!(values);
        }
        s.insert("matchExpressions".into(), json!([e]));
    }
    Value::Object(s)
}

/// What the rule's kinds have in common: a Pod spec (`Pod`, `Deployment`'s template), `data`
/// (`ConfigMap`), or only metadata (`Any`).
#[derive(Clone, Copy, PartialEq)]
enum CShape {
    Pod,
    Deployment,
    ConfigMap,
    Any,
}

/// One mutation for objects of `shape`.
fn c_mutation(rng: &mut Rng, shape: CShape) -> Value {
    let pod_spec = match shape {
        CShape::Pod => Some(vec!["spec"]),
        CShape::Deployment => Some(vec!["spec", "template", "spec"]),
        _ => None,
    };
    let nest = |path: &[&str], leaf: Value| -> Value {
        path.iter()
            .rev()
            .fold(leaf, |inner, key| json!({ key.to_string(): inner }))
    };
    let verb = if rng.chance(50) { "merge" } else { "defaults" };
    let nulls = verb == "merge";
    let choice = rng.below(12);
    match (choice, &pod_spec, shape) {
        (10 | 11, Some(spec), _) => {
            // forEach over every container (and init container): mutations relative to each.
            let at = spec.join(".");
            let query = if rng.chance(50) {
                format!("$.{at}.containers[*]")
            } else {
                format!("$.{at}['containers','initContainers'][*]")
            };
            let mut element = vec![
                json!({ verb: {"securityContext": {"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}}} }),
                json!({"upsert": {"path": "/env", "key": "name", "value": {"name": "NS", "value": NAMESPACE_TEMPLATE}}}),
                json!({"upsert": {"path": "/volumeMounts", "key": "name", "value": {"name": "data", "mountPath": "/data"}}}),
                json!({ verb: {"imagePullPolicy": "IfNotPresent"} }),
                json!({ verb: {"resources": {"limits": {"memory": "128Mi"}}} }),
                json!({"merge": {"terminationMessagePolicy": null, "workingDir": "/w"}}),
            ];
            let first = rng.below(element.len());
            let mut mutations = vec![element.remove(first)];
            if rng.chance(40) {
                let second = rng.below(element.len());
                mutations.push(element.remove(second));
            }
            json!({"forEach": query, "mutations": mutations})
        }
        (0 | 1, _, _) => {
            json!({ verb: {"metadata": {"labels": c_meta_map(rng, C_LABEL_KEYS, C_LABEL_VALUES, nulls)}} })
        }
        (2, _, _) => {
            json!({ verb: {"metadata": {"annotations": c_meta_map(rng, C_ANNOTATION_KEYS, C_ANNOTATION_VALUES, nulls)}} })
        }
        (3 | 4, Some(spec), _) => {
            let list = *rng.pick(&["containers", "volumes", "tolerations", "imagePullSecrets"]);
            let (key, value) = match list {
                "containers" => ("name", c_container(rng)),
                "volumes" => ("name", c_volume(rng)),
                "tolerations" => ("key", c_toleration(rng)),
                _ => (
                    "name",
                    json!({"name": c_string(rng, &["pull", "registry"])}),
                ),
            };
            let mut upsert =
                json!({"path": format!("/{}/{list}", spec.join("/")), "key": key, "value": value});
            if rng.chance(30) {
                upsert["position"] = json!("Prepend");
            }
            json!({ "upsert": upsert })
        }
        (5, Some(spec), _) => {
            let leaf = match rng.below(4) {
                0 => json!({"securityContext": {"runAsNonRoot": true, "runAsUser": 1000}}),
                1 => json!({"nodeSelector": c_meta_map(rng, C_LABEL_KEYS, C_LABEL_VALUES, nulls)}),
                2 => json!({"securityContext": {"seccompProfile": {"type": "RuntimeDefault"}}}),
                // Fields the API server defaults before admission.
                _ => json!({"terminationGracePeriodSeconds": 10, "dnsPolicy": "Default"}),
            };
            json!({ verb: nest(spec, leaf) })
        }
        (6, _, CShape::Deployment) => {
            let leaf = match rng.below(3) {
                0 => json!({"replicas": rng.range(0, 5)}),
                1 => json!({"minReadySeconds": 5, "revisionHistoryLimit": 3}),
                _ => {
                    json!({"template": {"metadata": {"labels": c_meta_map(rng, &["tier", "team"], C_LABEL_VALUES, nulls)}}})
                }
            };
            json!({ verb: {"spec": leaf} })
        }
        (6, _, CShape::ConfigMap) => {
            json!({ verb: {"data": c_meta_map(rng, &["x", "y", "config.yaml"], &["1", "on"], nulls)} })
        }
        (7, _, _) => {
            // A field the kind does not have: pruned, or refused, alike on every path?
            json!({ verb: {"spec": {"extra": {"flag": true}}} })
        }
        (8, _, _) if rng.chance(50) => {
            // An empty object, and a list of scalars.
            json!({ verb: {"spec": {"x": ["a", 1, true], "y": {}}} })
        }
        (9, _, _) => {
            // RFC 6902 adds of scalars to fields: compiled as the merge that does the same.
            let mut operations = vec![
                json!({"op": "add", "path": "/metadata/labels/team", "value": *rng.pick(C_LABEL_VALUES)}),
            ];
            if rng.chance(50) {
                operations.push(json!({"op": "add", "path": "/metadata/annotations/example.com~1note", "value": NAMESPACE_TEMPLATE}));
            }
            json!({ "patch": operations })
        }
        _ => json!({ "merge": {"metadata": {"labels": {"team": c_string(rng, C_LABEL_VALUES)}}} }),
    }
}

fn c_match(rng: &mut Rng, kinds: Value, exclude: bool) -> Value {
    let mut m = Map::new();
    if !exclude {
        m.insert("kinds".into(), kinds);
        if rng.chance(15) {
            m.insert(
                "operations".into(),
                json!(*rng.pick(&[&["CREATE"][..], &["CREATE", "UPDATE"][..]])),
            );
        }
    } else if rng.chance(20) {
        m.insert("operations".into(), json!(["UPDATE"]));
    } else if rng.chance(20) {
        m.insert("kinds".into(), json!([*rng.pick(&["ConfigMap", "Pod"])]));
    }
    if rng.chance(if exclude { 40 } else { 30 }) {
        let names: Vec<&str> = (0..rng.range(1, 2))
            .map(|_| *rng.pick(C_NAME_GLOBS))
            .collect();
        m.insert("names".into(), json!(names));
    }
    if rng.chance(if exclude { 40 } else { 25 }) {
        m.insert("labels".into(), c_selector(rng));
    }
    if rng.chance(if exclude { 30 } else { 20 }) {
        let glob = *rng.pick(&["*", "envoy", "y*", "*-y", "?"]);
        m.insert(
            "annotations".into(),
            json!({ rng.pick(C_ANNOTATION_KEYS).to_string(): glob }),
        );
    }
    if exclude && m.is_empty() {
        m.insert("names".into(), json!(["debug-*"]));
    }
    Value::Object(m)
}

/// A MutationRule (namespace `default`; callers give it its own) that the policy compiler
/// mostly accepts.
#[allow(dead_code)] // tests/compiled.rs uses it, tests/fuzz.rs does not
pub fn compilable_rule(rng: &mut Rng, index: usize) -> Value {
    let (kinds, shape) = match rng.below(9) {
        0..=2 => (json!(["Pod"]), CShape::Pod),
        3 => (json!(["v1/Pod"]), CShape::Pod),
        4 | 5 => (json!(["apps/v1/Deployment"]), CShape::Deployment),
        6 => (json!(["ConfigMap"]), CShape::ConfigMap),
        7 => (json!(["Pod", "apps/v1/Deployment"]), CShape::Any),
        _ => (json!(["Pod", "ConfigMap"]), CShape::Any),
    };
    let mut spec = Map::new();
    spec.insert("match".into(), c_match(rng, kinds, false));
    if rng.chance(20) {
        spec.insert("exclude".into(), c_match(rng, json!([]), true));
    }
    if rng.chance(30) {
        spec.insert(
            "failurePolicy".into(),
            json!(*rng.pick(&["Ignore", "Fail"])),
        );
    }
    if rng.chance(30) {
        let path = *rng.pick(&[
            "$.metadata.labels.team",
            "$.metadata.labels['app.kubernetes.io/name']",
            "$['metadata']['annotations']['a']",
            "$.spec.securityContext",
            "$.spec.template",
            "$.data.x",
            "$.spec.nodeSelector",
        ]);
        spec.insert(
            "conditions".into(),
            json!([{"path": path, "exists": rng.chance(50)}]),
        );
    }
    let mutations: Vec<Value> = (0..rng.range(1, 3))
        .map(|_| c_mutation(rng, shape))
        .collect();
    spec.insert("mutations".into(), json!(mutations));
    json!({
        "apiVersion": "initium.dev/v1alpha1",
        "kind": "MutationRule",
        "metadata": {"name": format!("r{index}"), "namespace": "default"},
        "spec": spec,
    })
}

/// A Pod, Deployment or ConfigMap from the vocabulary of [`compilable_rule`] (namespace
/// `default`; callers put it in theirs). `record`: a rule name to list, sometimes, in
/// `initium.dev/mutated-by`, as an object copied from a mutated one would.
#[allow(dead_code)] // tests/compiled.rs uses it, tests/fuzz.rs does not
pub fn compilable_object(rng: &mut Rng, record: &str) -> Value {
    let mut metadata = Map::new();
    // generateName: at admission the object has no name yet, and `names` globs see this.
    if rng.chance(25) {
        metadata.insert(
            "generateName".into(),
            json!(format!("{}-", rng.pick(C_NAMES))),
        );
    } else {
        metadata.insert("name".into(), json!(*rng.pick(C_NAMES)));
    }
    metadata.insert("namespace".into(), json!("default"));
    let mut labels = Map::new();
    for _ in 0..rng.small(3) {
        labels.insert(
            rng.pick(C_LABEL_KEYS).to_string(),
            json!(*rng.pick(C_LABEL_VALUES)),
        );
    }
    if !labels.is_empty() || rng.chance(20) {
        metadata.insert("labels".into(), Value::Object(labels));
    }
    let mut annotations = Map::new();
    for _ in 0..rng.small(2) {
        annotations.insert(
            rng.pick(C_ANNOTATION_KEYS).to_string(),
            json!(*rng.pick(C_ANNOTATION_VALUES)),
        );
    }
    if rng.chance(8) {
        annotations.insert("initium.dev/mutated-by".into(), json!(record));
    }
    if !annotations.is_empty() || rng.chance(10) {
        metadata.insert("annotations".into(), Value::Object(annotations));
    }
    let pod_spec = |rng: &mut Rng| {
        let mut containers = vec![json!({"name": "app", "image": "nginx"})];
        if rng.chance(30) {
            // A second container, under another name (two named "app" are refused).
            let extra = c_container(rng);
            if extra["name"] != "app" {
                containers.push(extra);
            }
        }
        let mut spec = json!({"containers": containers});
        if rng.chance(20) {
            spec["initContainers"] = json!([{"name": "init", "image": "busybox"}]);
        }
        if rng.chance(30) {
            spec["volumes"] = json!([c_volume(rng)]);
        }
        if rng.chance(20) {
            spec["tolerations"] = json!([c_toleration(rng)]);
        }
        if rng.chance(20) {
            spec["securityContext"] = json!({"runAsNonRoot": rng.chance(50)});
        }
        if rng.chance(15) {
            spec["nodeSelector"] = json!({"tier": "web"});
        }
        if rng.chance(10) {
            spec["terminationGracePeriodSeconds"] = json!(30);
        }
        spec
    };
    match rng.below(6) {
        0..=2 => {
            json!({"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec(rng)})
        }
        3 | 4 => {
            let mut template_labels = json!({"app": "web"});
            if rng.chance(30) {
                template_labels["tier"] = json!(*rng.pick(C_LABEL_VALUES));
            }
            let mut spec = json!({
                "selector": {"matchLabels": {"app": "web"}},
                "template": {"metadata": {"labels": template_labels}, "spec": pod_spec(rng)},
            });
            if rng.chance(50) {
                spec["replicas"] = json!(rng.range(1, 3));
            }
            json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": metadata, "spec": spec})
        }
        _ => {
            let mut data = Map::new();
            for _ in 0..rng.small(2) {
                data.insert(
                    rng.pick(&["x", "y"]).to_string(),
                    json!(*rng.pick(&["1", "on"])),
                );
            }
            json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data})
        }
    }
}
