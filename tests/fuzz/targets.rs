//! The three fuzz targets — AdmissionReviews through the webhook routers, rule specs through
//! the engine, files through the CLI — plus a self-test target that proves the harness catches
//! panics, crashes and slow cases. Each target generates a case (a JSON value, which is also
//! the reproducer) and runs it against its oracles.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use clap::Parser;
use initium::admission::state::{AdmissionConfig, Shared};
use initium::api::Operation;
use initium::engine::{Denial, Gvk, Outcome, RanBefore, RuleIndex, Subject, compile_document};
use regex::Regex;
use serde_json::{Value, json};
use tower::ServiceExt;

use super::generate::{self, seeds};
use super::rng::Rng;

/// One thing to fuzz.
pub struct Target {
    pub name: &'static str,
    pub generate: fn(&mut Rng) -> Value,
    pub run: fn(&Value) -> Result<(), String>,
}

pub const TARGETS: &[Target] = &[
    Target {
        name: "reviews",
        generate: generate_review,
        run: run_review,
    },
    Target {
        name: "rules",
        generate: generate_rules,
        run: run_rules,
    },
    Target {
        name: "cli",
        generate: generate_cli,
        run: run_cli,
    },
    Target {
        name: "selftest",
        generate: |_| json!({}),
        run: run_selftest,
    },
];

pub fn target(name: &str) -> Option<&'static Target> {
    TARGETS.iter().find(|t| t.name == name)
}

/// The latency budget the engine gets in the `rules` target, as `initium serve` gives it.
const BUDGET: Duration = Duration::from_millis(200);

// ---------------------------------------------------------------------------------------------
// Oracles shared by the targets

/// Debug output of Rust values (`Depth { depth: 65 }`, `Error { .. }`, `Some(..)`) in a message
/// meant for people. A marker that the input itself contains does not count.
pub fn debug_marker(message: &str, input: &str) -> Option<String> {
    static MARKERS: LazyLock<Regex> = LazyLock::new(|| {
        Regex::new(
            r"\b[A-Z][A-Za-z0-9_]*(::[A-Za-z0-9_]+)* \{ [a-z_][A-Za-z0-9_]*: |\bError \{|\b(Some|Ok|Err)\(",
        )
        .expect("regex")
    });
    MARKERS
        .find_iter(message)
        .map(|m| m.as_str())
        .find(|m| !input.contains(m))
        .map(str::to_string)
}

fn check_message(what: &str, message: &str, input: &str) -> Result<(), String> {
    if message.trim().is_empty() {
        return Err(format!("{what}: empty message"));
    }
    if let Some(marker) = debug_marker(message, input) {
        return Err(format!(
            "{what}: message has Debug output {marker:?}\n{}",
            cut(message)
        ));
    }
    Ok(())
}

/// Terminal control characters (ESC, BEL, ...) in text for a terminal.
fn check_terminal_text(what: &str, text: &str) -> Result<(), String> {
    if let Some(c) = text
        .chars()
        .find(|c| c.is_control() && !matches!(c, '\n' | '\t'))
    {
        let at = text.find(c).unwrap_or(0);
        let start = floor(text, at.saturating_sub(60));
        let end = floor(text, (at + 20).min(text.len()));
        return Err(format!(
            "{what}: raw control character {c:?} reaches the terminal\n{:?}",
            &text[start..end]
        ));
    }
    Ok(())
}

pub fn cut(s: &str) -> String {
    if s.len() <= 300 {
        s.to_string()
    } else {
        format!("{}…", &s[..floor(s, 300)])
    }
}

/// The largest char boundary at or below `i` (`str::floor_char_boundary` is newer than the
/// crate's rust-version).
pub fn floor(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

fn strings(v: &Value, field: &str) -> Vec<Value> {
    v.get(field)
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
}

// ---------------------------------------------------------------------------------------------
// rules: compile rule specs; evaluate the ones that compile on objects

fn generate_rules(rng: &mut Rng) -> Value {
    if rng.chance(20) {
        let obj = generate::object(rng);
        return json!({"rules": [generate::idempotent_rule(rng)], "idempotent": true,
                      "subjects": [subject_for(rng, obj)]});
    }
    let rules: Vec<Value> = (0..rng.range(1, 4))
        .map(|i| generate::rule(rng, i))
        .collect();
    let subjects: Vec<Value> = (0..rng.range(1, 2))
        .map(|_| {
            let obj = generate::object(rng);
            subject_for(rng, obj)
        })
        .collect();
    json!({"rules": rules, "subjects": subjects})
}

fn subject_for(rng: &mut Rng, object: Value) -> Value {
    let meta_ns = object
        .pointer("/metadata/namespace")
        .and_then(Value::as_str)
        .map(str::to_string);
    let namespace = match meta_ns {
        Some(ns) if rng.chance(90) => json!(ns),
        _ => json!(rng.pick(&[Some("payments"), Some("shop"), None, Some("")])),
    };
    let name = object
        .pointer("/metadata/name")
        .cloned()
        .unwrap_or(Value::Null);
    json!({
        "apiVersion": object.get("apiVersion").and_then(Value::as_str).unwrap_or("v1"),
        "kind": object.get("kind").and_then(Value::as_str).unwrap_or("Pod"),
        "operation": if rng.chance(80) { "CREATE" } else { "UPDATE" },
        "namespace": namespace,
        "name": if name.is_string() { name } else { Value::Null },
        "namespaceLabels": if rng.chance(80) { json!({"team": "payments"}) } else { Value::Null },
        "object": object,
    })
}

/// Everything about an evaluation, as bytes: two runs must give the same.
fn render(result: &Result<Outcome, Denial>) -> Vec<u8> {
    let mut out = Vec::new();
    match result {
        Ok(o) => {
            out.extend_from_slice(b"ok\n");
            out.extend(serde_json::to_vec(&o.object).unwrap_or_default());
            out.push(b'\n');
            let _ = o.write_patch(&mut out);
            for list in [&o.matched, &o.applied, &o.skipped] {
                out.push(b'\n');
                out.extend(
                    list.iter()
                        .map(|r| r.to_string())
                        .collect::<Vec<_>>()
                        .join(",")
                        .bytes(),
                );
            }
            for w in &o.warnings {
                out.push(b'\n');
                out.extend(w.bytes());
            }
        }
        Err(d) => {
            out.extend_from_slice(b"denied\n");
            out.extend(d.rule.to_string().bytes());
            out.push(b'\n');
            out.extend(d.message.bytes());
        }
    }
    out
}

fn budget_ran_out(result: &Result<Outcome, Denial>) -> bool {
    match result {
        Ok(o) => o.budget_exceeded,
        Err(d) => d.budget_exceeded,
    }
}

/// A gate's `object` dependency holds on what the gate controller keeps of an object (only
/// what its conditions read) exactly when it holds on the whole object. A judgement that ran
/// into its own time budget says nothing and is not compared.
fn gate_objects_judged_the_same_kept(
    gates: &[std::sync::Arc<initium::engine::CompiledGate>],
    object: &Value,
    what: &str,
) -> Result<(), String> {
    use initium::engine::Dependency;
    let judge = |dependency: &Dependency, object: &Value| {
        let started = Instant::now();
        let holds = dependency.object_holds(object);
        (
            holds,
            started.elapsed() < initium::engine::OBJECT_JUDGE_BUDGET,
        )
    };
    for dependency in gates.iter().flat_map(|g| g.wait_for.iter()) {
        let Dependency::Object { reads, .. } = dependency else {
            continue;
        };
        let mut kept = object.clone();
        reads.keep(&mut kept);
        let (whole, whole_in_time) = judge(dependency, object);
        let (trimmed, trimmed_in_time) = judge(dependency, &kept);
        if whole_in_time && trimmed_in_time && whole != trimmed {
            return Err(format!(
                "{what}: a gate's object dependency holds {whole} on the whole object but {trimmed} on what is kept of it ({reads:?}): {}",
                cut(&kept.to_string())
            ));
        }
    }
    Ok(())
}

fn run_rules(case: &Value) -> Result<(), String> {
    let input = case.to_string();
    let mut compiled = Vec::new();
    for (i, doc) in strings(case, "rules").iter().enumerate() {
        match compile_document(doc, "default") {
            Ok(rule) => compiled.push(rule),
            Err(errors) => check_message(
                &format!("rules[{i}] compile error"),
                &errors.to_string(),
                &input,
            )?,
        }
    }
    let gates: Vec<_> = compiled.iter().filter_map(|r| r.gate().cloned()).collect();
    let rules = strings(case, "rules");
    let index = RuleIndex::new(compiled);
    let idempotent = case.get("idempotent") == Some(&json!(true));
    for (i, s) in strings(case, "subjects").iter().enumerate() {
        let text = |f: &str| s.get(f).and_then(Value::as_str);
        let gvk = Gvk::from_api_version(
            text("apiVersion").unwrap_or("v1"),
            text("kind").unwrap_or("Pod"),
        );
        let labels: Option<BTreeMap<String, String>> = s
            .get("namespaceLabels")
            .and_then(|l| serde_json::from_value(l.clone()).ok());
        let subject = Subject {
            gvk: &gvk,
            operation: if text("operation") == Some("UPDATE") {
                Operation::Update
            } else {
                Operation::Create
            },
            namespace: text("namespace"),
            name: text("name"),
            namespace_labels: labels.as_ref(),
            ran_before: RanBefore::Unknown,
            lookups: None,
        };
        let object = s.get("object").cloned().unwrap_or(Value::Null);
        gate_objects_judged_the_same_kept(&gates, &object, &format!("subjects[{i}]"))?;
        let evaluate =
            |object: Value| index.evaluate(&subject, object, Instant::now().checked_add(BUDGET));
        let first = evaluate(object.clone());
        let what = format!("subjects[{i}]");
        if std::env::var_os("INITIUM_FUZZ_VERBOSE").is_some() {
            match &first {
                Ok(o) => eprintln!(
                    "{what}: applied {:?} skipped {:?} warnings {:?}; output {} bytes",
                    o.applied
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>(),
                    o.skipped
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>(),
                    o.warnings,
                    serde_json::to_vec(&o.object).map_or(0, |b| b.len())
                ),
                Err(d) => eprintln!("{what}: denied: {}", d.message),
            }
        }
        match &first {
            Ok(outcome) => {
                for w in &outcome.warnings {
                    check_message(&format!("{what} warning"), w, &input)?;
                }
                // The patch takes the input object to the output object.
                let mut bytes = Vec::new();
                outcome
                    .write_patch(&mut bytes)
                    .map_err(|e| format!("{what}: cannot write the patch\n{e}"))?;
                let patch: json_patch::Patch = serde_json::from_slice(&bytes)
                    .map_err(|e| format!("{what}: the patch is not RFC 6902\n{e}"))?;
                let mut patched = object.clone();
                json_patch::patch(&mut patched, &patch)
                    .map_err(|e| format!("{what}: the patch does not apply to the input\n{e}"))?;
                if patched != outcome.object {
                    return Err(format!(
                        "{what}: the patch applied to the input differs from the output object"
                    ));
                }
                refused_by_api_server(&object, &outcome.object, &rules)
                    .map_err(|e| format!("{what}: {e}"))?;
            }
            Err(denial) => check_message(&format!("{what} denial"), &denial.message, &input)?,
        }
        let second = evaluate(object.clone());
        if !budget_ran_out(&first) && !budget_ran_out(&second) && render(&first) != render(&second)
        {
            return Err(format!(
                "{what}: not deterministic: two evaluations of the same rules on the same object differ"
            ));
        }
        if idempotent
            && let Ok(outcome) = &first
            && outcome.skipped.is_empty()
            && !outcome.budget_exceeded
        {
            match evaluate(outcome.object.clone()) {
                Ok(again) if again.budget_exceeded => {}
                Ok(again) if again.object == outcome.object && again.ops.is_empty() => {}
                Ok(again) => {
                    return Err(format!(
                        "{what}: not idempotent: applying the rule to its own output changes it again\n{} ops, skipped {:?}",
                        again.ops.len(),
                        again.warnings
                    ));
                }
                Err(d) => {
                    return Err(format!(
                        "{what}: not idempotent: the rule denies its own output\n{}",
                        cut(&d.message)
                    ));
                }
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// rules: what the API server would refuse in an output object, that the engine made

/// Where an `ObjectMeta` lives in the objects rules change: the object's own `metadata`, and
/// the Pod and Job templates of the built-in controllers (`spec.template`, a CronJob's
/// `spec.jobTemplate` and its `spec.template`, a StatefulSet's `volumeClaimTemplates`).
pub fn object_metas(object: &Value) -> Vec<String> {
    let mut at = vec![
        "/metadata".to_string(),
        "/spec/template/metadata".to_string(),
        "/spec/jobTemplate/metadata".to_string(),
        "/spec/jobTemplate/spec/template/metadata".to_string(),
    ];
    if let Some(claims) = object
        .pointer("/spec/volumeClaimTemplates")
        .and_then(Value::as_array)
    {
        at.extend((0..claims.len()).map(|i| format!("/spec/volumeClaimTemplates/{i}/metadata")));
    }
    at
}

/// `-`, `0`, `12`, `-1`: a token a JSON pointer uses for a list element (`-1` is what Kyverno
/// users write for the last one).
fn list_token(key: &str) -> bool {
    let digits = key.strip_prefix('-').unwrap_or(key);
    key == "-" || (!digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()))
}

/// What the rule documents write literally, so the oracle does not flag what a rule asked for.
#[derive(Default)]
struct Literals {
    /// Every object key in the documents (a merge or upsert value that writes `"0": x`).
    keys: std::collections::HashSet<String>,
    /// Keys whose value in the documents is an object: a merge that writes `containers: {}`
    /// makes an object there, and a later `add .../containers/-` sets its member `-`.
    object_keys: std::collections::HashSet<String>,
    /// Some key holds a template: keys may then be any text a template selects.
    templated_keys: bool,
    /// The text of every scalar (what a templated key can render to).
    scalars: std::collections::HashSet<String>,
    /// Where a null is written literally: the member name, or `[]` for a list element.
    null_keys: std::collections::HashSet<String>,
}

impl Literals {
    fn of(rules: &[Value], input: &Value) -> Literals {
        let mut literals = Literals::default();
        for rule in rules {
            literals.walk(rule, true);
            // A patch operation writes its value under the path's last token.
            let mut stack = vec![rule];
            while let Some(v) = stack.pop() {
                match v {
                    Value::Object(map) => {
                        // A `copy` or `move` writes what the object holds at `from`,
                        // null or not: the rule's own instruction, as a literal is.
                        let copies =
                            matches!(map.get("op").and_then(Value::as_str), Some("copy" | "move"));
                        if let (Some(Value::String(path)), true) = (
                            map.get("path"),
                            copies || map.get("value") == Some(&Value::Null),
                        ) {
                            let last = path.rsplit('/').next().unwrap_or_default();
                            literals.null_keys.insert(if list_token(last) {
                                "[]".to_string()
                            } else {
                                last.replace("~1", "/").replace("~0", "~")
                            });
                        }
                        stack.extend(map.values());
                    }
                    Value::Array(items) => stack.extend(items),
                    _ => {}
                }
            }
        }
        // What the object holds may be copied (`copy`, `move`, `{{ $.spec }}`).
        literals.walk(input, false);
        literals
    }

    fn walk(&mut self, value: &Value, rule: bool) {
        let mut stack = vec![value];
        while let Some(v) = stack.pop() {
            match v {
                Value::Object(map) => {
                    for (k, v) in map {
                        self.keys.insert(k.clone());
                        if rule && k.contains("{{") {
                            self.templated_keys = true;
                        }
                        match v {
                            Value::Object(_) => {
                                self.object_keys.insert(k.clone());
                            }
                            Value::Null => {
                                self.null_keys.insert(k.clone());
                            }
                            _ => {}
                        }
                        stack.push(v);
                    }
                }
                Value::Array(items) => {
                    if items.iter().any(Value::is_null) {
                        self.null_keys.insert("[]".into());
                    }
                    stack.extend(items);
                }
                Value::String(s) => {
                    self.scalars.insert(s.clone());
                }
                Value::Number(n) => {
                    self.scalars.insert(n.to_string());
                }
                Value::Bool(_) | Value::Null => {}
            }
        }
    }
}

/// The value at the encoded pointer `at` followed by `key`.
fn child<'a>(v: Option<&'a Value>, key: &str) -> Option<&'a Value> {
    match v? {
        Value::Object(map) => map.get(key),
        Value::Array(items) => key.parse::<usize>().ok().and_then(|i| items.get(i)),
        _ => None,
    }
}

fn escape(token: &str) -> String {
    token.replace('~', "~0").replace('/', "~1")
}

/// What the API server would refuse in `output` that is the engine's doing, not the rule's
/// request nor already in `input`:
/// 1. a list token (`-`, `0`, `-1`) as a key of an object the input did not have there, that
///    no rule writes as a key, under a field no rule writes an object into (a path's list
///    token followed into a missing or null parent as if it were a member name);
/// 2. a label or annotation value of an `ObjectMeta` ([`object_metas`]) that is not a string
///    where the input's was a string or absent, or `labels`/`annotations` that is not an
///    object where the input's was an object or absent;
/// 3. a `null` where the input had none, under a member name (or in a list) where no rule
///    writes a null literally and the input holds none.
pub fn refused_by_api_server(input: &Value, output: &Value, rules: &[Value]) -> Result<(), String> {
    let literals = Literals::of(rules, input);
    // Walk the output beside the input, without recursion (objects nest deep here).
    let mut stack: Vec<(String, &Value, Option<&Value>, Option<String>)> =
        vec![(String::new(), output, Some(input), None)];
    while let Some((at, out, inp, key)) = stack.pop() {
        match out {
            Value::Object(map) => {
                let new_object = !inp.is_some_and(Value::is_object);
                let written_object = key
                    .as_ref()
                    .is_some_and(|k| literals.object_keys.contains(k));
                for (k, v) in map {
                    let before = child(inp, k);
                    if before.is_none()
                        && new_object
                        && !written_object
                        && list_token(k)
                        && !literals.keys.contains(k)
                        && !(literals.templated_keys && literals.scalars.contains(k))
                    {
                        return Err(format!(
                            "the list token {k:?} became an object key at {at}/{}: the API server would refuse (or misread) the object\n{}",
                            escape(k),
                            cut(&out.to_string())
                        ));
                    }
                    stack.push((format!("{at}/{}", escape(k)), v, before, Some(k.clone())));
                }
            }
            Value::Array(items) => {
                for (i, v) in items.iter().enumerate() {
                    stack.push((
                        format!("{at}/{i}"),
                        v,
                        child(inp, &i.to_string()),
                        Some("[]".into()),
                    ));
                }
            }
            Value::Null => {
                let written = key.as_ref().is_some_and(|k| literals.null_keys.contains(k));
                if !inp.is_some_and(Value::is_null) && !written {
                    return Err(format!(
                        "a null was written at {at}, where the input had {}: the API server would refuse or drop it",
                        inp.map_or("nothing", initium::engine::describe_value)
                    ));
                }
            }
            _ => {}
        }
    }
    for meta in object_metas(output) {
        for field in ["labels", "annotations"] {
            let at = format!("{meta}/{field}");
            let (Some(out), inp) = (output.pointer(&at), input.pointer(&at)) else {
                continue;
            };
            let Value::Object(entries) = out else {
                // `labels: null` is no map, which the API server takes; a null written is
                // the third check's.
                if !out.is_null() && inp.is_none_or(Value::is_object) {
                    return Err(format!(
                        "{at} is {}, not an object of strings, and the input's was {}: the API server would refuse the object",
                        initium::engine::describe_value(out),
                        inp.map_or("absent", |_| "an object")
                    ));
                }
                continue;
            };
            for (k, v) in entries {
                let before = child(inp, k);
                if !v.is_string() && before.is_none_or(Value::is_string) {
                    return Err(format!(
                        "{at}/{} is {}, not a string, and the input's was {}: the API server would refuse the object",
                        escape(k),
                        initium::engine::describe_value(v),
                        before.map_or("absent", |_| "a string")
                    ));
                }
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// reviews: AdmissionReviews posted to /mutate and /validate, in-process

fn review_for(rng: &mut Rng, object: Value, rule: bool) -> Value {
    let api_version = object
        .get("apiVersion")
        .and_then(Value::as_str)
        .unwrap_or("v1");
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    let mut kind = json!({"group": group, "version": version,
                          "kind": object.get("kind").and_then(Value::as_str).unwrap_or("Pod")});
    if rng.chance(5) {
        kind = json!({"group": "", "version": "v1", "kind": generate::name(rng)});
    }
    let operation = match rng.below(12) {
        0 => "DELETE",
        1 => "CONNECT",
        2 => "create",
        3..=5 => "UPDATE",
        _ => "CREATE",
    };
    let namespace = object
        .pointer("/metadata/namespace")
        .and_then(Value::as_str)
        .map(str::to_string)
        .unwrap_or_else(|| {
            rng.pick(&["payments", "shop", "", "kube-system"])
                .to_string()
        });
    let mut request = json!({
        "uid": format!("{:08x}-fuzz", rng.next_u64() as u32),
        "kind": kind,
        "resource": {"group": group, "version": version, "resource": if rule { "mutationrules" } else { "pods" }},
        "namespace": namespace,
        "operation": operation,
        "object": object,
        "userInfo": {"username": "fuzz"},
        "dryRun": rng.chance(10),
    });
    if let Some(name) = request.pointer("/object/metadata/name").cloned() {
        request["name"] = name;
    }
    if rng.chance(8) {
        request["subResource"] = json!(rng.pick(&["status", "scale", ""]));
    }
    if operation == "UPDATE" {
        let mut old = request["object"].clone();
        if rng.chance(50) {
            generate::mutate_value(rng, &mut old);
        }
        request["oldObject"] = old;
    }
    if rng.chance(5) {
        request["object"] = Value::Null;
    }
    json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request})
}

fn body_field(bytes: Vec<u8>) -> (String, Value) {
    match String::from_utf8(bytes) {
        Ok(text) => ("body".into(), json!(text)),
        Err(e) => ("bodyBase64".into(), json!(STANDARD.encode(e.into_bytes()))),
    }
}

fn generate_review(rng: &mut Rng) -> Value {
    let seeds = seeds();
    let mut rules: Vec<Value> = (0..rng.small(3)).map(|i| generate::rule(rng, i)).collect();
    if rng.chance(30) {
        rules.push(rng.pick(&seeds.rules).clone());
    }
    let validate = rng.chance(25);
    let path = if validate { "/validate" } else { "/mutate" };
    let mut case = json!({"rules": rules, "path": path,
                          "namespaces": {"payments": {"team": "payments"}, "shop": {}}});
    let review = if validate {
        let r = generate::rule(rng, 0);
        review_for(rng, r, true)
    } else {
        let obj = generate::object(rng);
        review_for(rng, obj, false)
    };
    match rng.below(10) {
        0..=4 => case["review"] = review,
        5 => {
            let mut review = review;
            generate::mutate_value(rng, &mut review);
            case["review"] = review;
        }
        _ => {
            let mut bytes = if rng.chance(50) {
                rng.pick(&seeds.reviews).clone().into_bytes()
            } else {
                serde_json::to_vec(&review).unwrap_or_default()
            };
            generate::mutate_bytes(rng, &mut bytes);
            let (field, value) = body_field(bytes);
            case[field] = value;
        }
    }
    case
}

fn review_body(case: &Value) -> Vec<u8> {
    if let Some(review) = case.get("review") {
        return serde_json::to_vec(review).unwrap_or_default();
    }
    if let Some(text) = case.get("body").and_then(Value::as_str) {
        return text.as_bytes().to_vec();
    }
    case.get("bodyBase64")
        .and_then(Value::as_str)
        .and_then(|b| STANDARD.decode(b).ok())
        .unwrap_or_default()
}

thread_local! {
    static RUNTIME: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
}

fn run_review(case: &Value) -> Result<(), String> {
    let input = case.to_string();
    let mut compiled = Vec::new();
    for (i, doc) in strings(case, "rules").iter().enumerate() {
        match compile_document(doc, "default") {
            Ok(rule) => compiled.push(rule),
            Err(errors) => check_message(
                &format!("rules[{i}] compile error"),
                &errors.to_string(),
                &input,
            )?,
        }
    }
    let shared = Shared::new(AdmissionConfig::default());
    shared.rules.store(Arc::new(RuleIndex::new(compiled)));
    let namespaces: HashMap<String, BTreeMap<String, String>> = case
        .get("namespaces")
        .and_then(|n| serde_json::from_value(n.clone()).ok())
        .unwrap_or_default();
    shared.namespaces.store(Arc::new(
        namespaces
            .into_iter()
            .map(|(name, labels)| (name, Arc::new(labels)))
            .collect(),
    ));
    let path = match case.get("path").and_then(Value::as_str) {
        Some("/validate") => "/validate",
        _ => "/mutate",
    };
    let body = review_body(case);
    let request = Request::builder()
        .method("POST")
        .uri(path)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.clone()))
        .map_err(|e| format!("cannot build the request\n{e}"))?;
    let (status, answer) = RUNTIME.with(|rt| {
        rt.block_on(async {
            let response = initium::admission::router(shared.clone())
                .oneshot(request)
                .await
                .expect("infallible");
            let status = response.status();
            let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
                .await
                .map(|b| b.to_vec())
                .unwrap_or_default();
            (status, bytes)
        })
    });
    check_answer(path, &body, status, &answer, &input)
}

/// The webhook's answer is an AdmissionReview (200) or a 400/413 with a one-line reason.
fn check_answer(
    path: &str,
    body: &[u8],
    status: StatusCode,
    answer: &[u8],
    input: &str,
) -> Result<(), String> {
    let text = String::from_utf8_lossy(answer);
    match status.as_u16() {
        400 | 413 => {
            check_message(&format!("{path} {status}"), &text, input)?;
            if text.contains('\n') {
                return Err(format!(
                    "{path} {status}: the reason is not one line: {}",
                    cut(&text)
                ));
            }
            Ok(())
        }
        200 => {
            let review: Value = serde_json::from_slice(answer)
                .map_err(|e| format!("{path}: 200 with a body that is not JSON\n{e}"))?;
            if review["apiVersion"] != "admission.k8s.io/v1" || review["kind"] != "AdmissionReview"
            {
                return Err(format!(
                    "{path}: 200 with a body that is not an AdmissionReview: {}",
                    cut(&text)
                ));
            }
            let response = &review["response"];
            // The handler skips fields it does not read without checking their UTF-8; read
            // the body the same way (the fields it reads would have failed it).
            let sent: Option<Value> = serde_json::from_slice(body)
                .ok()
                .or_else(|| serde_json::from_str(&String::from_utf8_lossy(body)).ok());
            let request = sent.as_ref().map(|s| &s["request"]);
            if let Some(uid) = request.and_then(|r| r.get("uid"))
                && response["uid"] != *uid
            {
                return Err(format!(
                    "{path}: the uid is not echoed\nsent {uid}, got {}",
                    response["uid"]
                ));
            }
            let Some(allowed) = response["allowed"].as_bool() else {
                return Err(format!(
                    "{path}: response.allowed is not a boolean: {}",
                    cut(&text)
                ));
            };
            let warnings = response
                .get("warnings")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            let mut total = 0;
            for w in &warnings {
                let w = w
                    .as_str()
                    .ok_or_else(|| format!("{path}: a warning is not a string"))?;
                check_message(&format!("{path} warning"), w, input)?;
                total += w.chars().count();
                if w.chars().count() > 256 || w.chars().any(char::is_control) {
                    return Err(format!(
                        "{path}: a warning the API server would drop or cut\n{w:?}"
                    ));
                }
            }
            if total > 4096 {
                return Err(format!(
                    "{path}: warnings total {total} characters (> 4096)"
                ));
            }
            if allowed {
                if let Some(patch) = response.get("patch") {
                    // kube-system is never mutated, whatever the review says (issue 15).
                    let claims = |p: &str| {
                        request.and_then(|r| r.pointer(p)).and_then(Value::as_str)
                            == Some("kube-system")
                    };
                    if claims("/namespace") || claims("/object/metadata/namespace") {
                        return Err(format!(
                            "{path}: an object in kube-system is mutated\n{}",
                            cut(&text)
                        ));
                    }
                    if response["patchType"] != "JSONPatch" {
                        return Err(format!("{path}: a patch without patchType JSONPatch"));
                    }
                    let bytes = STANDARD
                        .decode(patch.as_str().unwrap_or_default())
                        .map_err(|e| format!("{path}: the patch is not base64\n{e}"))?;
                    let patch: json_patch::Patch = serde_json::from_slice(&bytes)
                        .map_err(|e| format!("{path}: the patch is not RFC 6902\n{e}"))?;
                    let mut object = request.map(|r| r["object"].clone()).unwrap_or_default();
                    json_patch::patch(&mut object, &patch).map_err(|e| {
                        format!("{path}: the patch does not apply to the request's object\n{e}")
                    })?;
                }
                return Ok(());
            }
            let status = &response["status"];
            let message = status["message"].as_str().unwrap_or_default();
            check_message(&format!("{path} rejection"), message, input)?;
            let code = status["code"].as_u64().unwrap_or(0);
            if !(400..500).contains(&code) {
                return Err(format!(
                    "{path}: a rejection with code {code}: {}",
                    cut(&text)
                ));
            }
            if path == "/validate" {
                let causes = status.pointer("/details/causes").and_then(Value::as_array);
                if code != 422 || causes.is_none_or(|c| c.is_empty()) {
                    return Err(format!(
                        "{path}: an invalid rule without 422 and causes: {}",
                        cut(&text)
                    ));
                }
                for c in causes.into_iter().flatten() {
                    check_message(
                        &format!("{path} cause"),
                        c["message"].as_str().unwrap_or_default(),
                        input,
                    )?;
                }
            }
            Ok(())
        }
        _ => Err(format!("{path}: HTTP {status}\n{}", cut(&text))),
    }
}

// ---------------------------------------------------------------------------------------------
// cli: files through `initium apply/check/test`, in-process

fn yaml_docs(docs: &[Value]) -> String {
    docs.iter()
        .map(|d| format!("---\n{}", serde_saphyr::to_string(d).unwrap_or_default()))
        .collect()
}

fn file_field(bytes: Vec<u8>) -> Value {
    match String::from_utf8(bytes) {
        Ok(text) => json!(text),
        Err(e) => json!({"base64": STANDARD.encode(e.into_bytes())}),
    }
}

fn generate_cli(rng: &mut Rng) -> Value {
    let seeds = seeds();
    let rules: Vec<Value> = (0..rng.range(1, 3))
        .map(|i| generate::rule(rng, i))
        .collect();
    let objects: Vec<Value> = (0..rng.range(1, 3))
        .map(|_| generate::object(rng))
        .collect();
    let json_text = |docs: &[Value]| {
        docs.iter()
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join("\n")
    };
    let mut rules_text = match rng.below(4) {
        0 => rng.pick(&seeds.files).clone(),
        1 => json_text(&rules),
        _ => yaml_docs(&rules),
    };
    let mut objects_text = match rng.below(4) {
        0 => rng.pick(&seeds.files).clone(),
        1 => json_text(&objects),
        _ => yaml_docs(&objects),
    };
    let mut files = serde_json::Map::new();
    let (args, extra): (Vec<String>, Option<String>) = match rng.below(10) {
        0..=5 => {
            let mut a: Vec<String> = ["apply", "-r", "rules.yaml", "-f", "objects.yaml", "-o"]
                .iter()
                .map(|s| s.to_string())
                .collect();
            a.push(rng.pick(&["yaml", "json", "patch"]).to_string());
            if rng.chance(30) {
                a.extend(["--operation".into(), "UPDATE".into()]);
            }
            if rng.chance(20) {
                a.extend(["-n".into(), rng.pick(&["payments", "shop", ""]).to_string()]);
            }
            (a, None)
        }
        6 | 7 => (vec!["check".into(), "-r".into(), "rules.yaml".into()], None),
        _ => {
            let expected: Vec<Value> = if rng.chance(50) {
                objects.clone()
            } else {
                Vec::new()
            };
            let test = json!({"apiVersion": "initium.dev/v1alpha1", "kind": "RuleTest",
                              "rules": ["rules.yaml"],
                              "cases": [{"name": generate::name(rng), "objects": objects, "expected": expected,
                                         "expectWarnings": if rng.chance(20) { json!(["skipped"]) } else { json!([]) }}]});
            let text = serde_saphyr::to_string(&test).unwrap_or_default();
            (vec!["test".into(), "initium-test.yaml".into()], Some(text))
        }
    };
    let mut extra = extra;
    // Mutate one file's bytes, or replace it with hostile YAML.
    let which = rng.below(3);
    let target: &mut String = match (which, extra.as_mut()) {
        (2, Some(t)) => t,
        (1, _) => &mut objects_text,
        _ => &mut rules_text,
    };
    let mut replaced: Option<Vec<u8>> = None;
    match rng.below(10) {
        0..=4 => {}
        5..=8 => {
            let mut bytes = std::mem::take(target).into_bytes();
            generate::mutate_bytes(rng, &mut bytes);
            replaced = Some(bytes);
        }
        _ => *target = generate::hostile_yaml(rng),
    }
    let (mut r, mut o, mut t) = (
        file_field(rules_text.into_bytes()),
        file_field(objects_text.into_bytes()),
        extra.map(|e| file_field(e.into_bytes())),
    );
    if let Some(bytes) = replaced {
        match (which, t.is_some()) {
            (2, true) => t = Some(file_field(bytes)),
            (1, _) => o = file_field(bytes),
            _ => r = file_field(bytes),
        }
    }
    files.insert("rules.yaml".into(), std::mem::take(&mut r));
    files.insert("objects.yaml".into(), std::mem::take(&mut o));
    if let Some(t) = t {
        files.insert("initium-test.yaml".into(), t);
    }
    json!({"args": args, "files": files})
}

fn file_bytes(v: &Value) -> Vec<u8> {
    match v {
        Value::String(s) => s.as_bytes().to_vec(),
        other => other
            .get("base64")
            .and_then(Value::as_str)
            .and_then(|b| STANDARD.decode(b).ok())
            .unwrap_or_default(),
    }
}

/// Runs `initium <args>` in-process with the case's files in a fresh directory; returns the
/// result's message and what went to stdout and stderr.
fn cli(case: &Value, args: &[String]) -> Result<(Result<(), String>, String, String), String> {
    let dir = tempfile::tempdir().map_err(|e| format!("tempdir\n{e}"))?;
    let files = case
        .get("files")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    for (name, content) in &files {
        if name.contains('/') || name.starts_with('.') {
            continue;
        }
        std::fs::write(dir.path().join(name), file_bytes(content))
            .map_err(|e| format!("write\n{e}"))?;
    }
    let argv: Vec<String> = std::iter::once("initium".to_string())
        .chain(args.iter().map(|a| {
            if files.contains_key(a) {
                dir.path().join(a).display().to_string()
            } else {
                a.clone()
            }
        }))
        .collect();
    let cli = match initium::cli::Cli::try_parse_from(&argv) {
        Ok(cli) => cli,
        Err(e) => return Ok((Err(format!("usage: {e}")), String::new(), String::new())),
    };
    if matches!(
        cli.command,
        initium::cli::Command::Serve(_) | initium::cli::Command::Crd(_)
    ) {
        return Ok((Ok(()), String::new(), String::new()));
    }
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let result = initium::cli::run(cli.command, &mut out, &mut err).map_err(|e| e.to_string());
    let dir_text = dir.path().display().to_string();
    let clean = |b: Vec<u8>| String::from_utf8_lossy(&b).replace(&dir_text, ".");
    Ok((
        result.map_err(|e| e.replace(&dir_text, ".")),
        clean(out),
        clean(err),
    ))
}

fn run_cli(case: &Value) -> Result<(), String> {
    let input = case.to_string();
    let args: Vec<String> = strings(case, "args")
        .iter()
        .filter_map(|a| a.as_str().map(str::to_string))
        .collect();
    let (result, out, err) = cli(case, &args)?;
    if let Err(message) = &result {
        if message.starts_with("usage: ") {
            return Ok(());
        }
        check_message("error", message, &input)?;
        check_terminal_text("error", message)?;
    }
    check_terminal_text("stderr", &err)?;
    check_terminal_text("stdout", &out)?;
    if result.is_err() || args.first().map(String::as_str) != Some("apply") {
        return Ok(());
    }
    let format = args
        .iter()
        .position(|a| a == "-o")
        .and_then(|i| args.get(i + 1))
        .map(String::as_str);
    match format {
        Some("json") => {
            let list: Value = serde_json::from_str(&out)
                .map_err(|e| format!("apply -o json: output is not JSON\n{e}"))?;
            let items = list["items"].as_array().cloned().unwrap_or_default();
            // The YAML output must read back as the same objects, where the YAML reader's
            // nesting limit allows (docs/reliability.md: deeper objects go as JSON).
            if items
                .iter()
                .any(|item| nesting(item) + 2 > initium::cli::input::YAML_MAX_DEPTH)
            {
                return Ok(());
            }
            let mut yaml_args = args.clone();
            if let Some(i) = yaml_args.iter().position(|a| a == "json") {
                yaml_args[i] = "yaml".into();
            }
            let (yaml_result, yaml_out, _) = cli(case, &yaml_args)?;
            yaml_result.map_err(|e| {
                format!("apply -o yaml failed where -o json succeeded\n{}", cut(&e))
            })?;
            let docs =
                initium::cli::input::parse_documents("out.yaml", &yaml_out).map_err(|e| {
                    format!(
                        "apply -o yaml: the output does not read back\n{}",
                        cut(&e.to_string())
                    )
                })?;
            let back: Vec<Value> = docs.into_iter().map(|d| d.value).collect();
            if back != items {
                let at = back
                    .iter()
                    .zip(&items)
                    .position(|(a, b)| a != b)
                    .unwrap_or(back.len().min(items.len()));
                return Err(format!(
                    "apply -o yaml reads back different from -o json\nobject {at} of {}/{}: {} vs {}",
                    back.len(),
                    items.len(),
                    cut(&back.get(at).map(Value::to_string).unwrap_or_default()),
                    cut(&items.get(at).map(Value::to_string).unwrap_or_default())
                ));
            }
        }
        Some("patch") => {
            for line in out.lines() {
                let v: Value = serde_json::from_str(line)
                    .map_err(|e| format!("apply -o patch: a line is not JSON\n{e}"))?;
                serde_json::from_value::<json_patch::Patch>(v["patch"].clone())
                    .map_err(|e| format!("apply -o patch: not an RFC 6902 patch\n{e}"))?;
            }
        }
        _ => {}
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// selftest: proves that the harness reports panics, crashes and slow cases

fn run_selftest(case: &Value) -> Result<(), String> {
    fn recurse(n: u64) -> u64 {
        let pad = std::hint::black_box([n; 64]);
        if n == u64::MAX {
            0
        } else {
            recurse(n + 1).wrapping_add(pad[3])
        }
    }
    match case.get("do").and_then(Value::as_str) {
        Some("panic") => panic!("selftest panic"),
        Some("overflow") => {
            std::hint::black_box(recurse(0));
        }
        Some("sleep") => std::thread::sleep(Duration::from_millis(
            case.get("ms").and_then(Value::as_u64).unwrap_or(0),
        )),
        Some("fail") => return Err("selftest oracle failure with Foo { bar: 1 }".into()),
        _ => {}
    }
    let _ = std::io::stderr().flush();
    Ok(())
}

/// How deep `value` nests (0 for a scalar), without recursion.
fn nesting(value: &Value) -> usize {
    let mut deepest = 0;
    let mut stack = vec![(value, 0usize)];
    while let Some((v, depth)) = stack.pop() {
        deepest = deepest.max(depth);
        match v {
            Value::Array(items) => stack.extend(items.iter().map(|i| (i, depth + 1))),
            Value::Object(map) => stack.extend(map.values().map(|i| (i, depth + 1))),
            _ => {}
        }
    }
    deepest
}
