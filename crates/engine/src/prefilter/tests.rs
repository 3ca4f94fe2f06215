//! The prefilters' structures, and the property they must keep: on any rules and any object,
//! the admission with prefilters is the admission without them (same rules matched, applied,
//! skipped, audited, in the same order, same object and patch, same denial).

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::{Value, json};

use crate::api::Operation;
use crate::index::RuleIndex;
use crate::kind::Gvk;
use crate::limits::Limits;
use crate::parse::compile_document;
use crate::path::{Pointer, escape};
use crate::rule::CompiledRule;
use crate::subject::{RanBefore, Subject};

use super::{
    Affixes, End, Keyed, MapChange, Members, Prefilter, Reading, Survivors, anchored_prefix,
    common_affix, metadata_touched,
};

fn compiled(docs: &[Value]) -> Vec<CompiledRule> {
    docs.iter()
        .map(|doc| compile_document(doc, "shop").unwrap_or_else(|e| panic!("{e}")))
        .collect()
}

fn cmr(name: &str, spec: Value) -> Value {
    let mut spec = spec;
    spec["mutations"] = json!([{"merge": {"metadata": {"labels": {"seen": name}}}}]);
    json!({"apiVersion": "initium.dev/v1alpha1", "kind": "ClusterMutationRule",
           "metadata": {"name": name}, "spec": spec})
}

fn pod(metadata: Value, images: &[&str]) -> Value {
    let containers: Vec<Value> = images
        .iter()
        .enumerate()
        .map(|(i, image)| json!({"name": format!("c{i}"), "image": image}))
        .collect();
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": {"containers": containers}})
}

fn subject<'a>(
    gvk: &'a Gvk,
    operation: Operation,
    namespace_labels: Option<&'a BTreeMap<String, String>>,
) -> Subject<'a> {
    Subject {
        gvk,
        operation,
        namespace: Some("shop"),
        name: None,
        namespace_labels,
        lookups: None,
        ran_before: RanBefore::Unknown,
    }
}

/// The names of the rules a prefilter keeps for `object`.
fn kept(rules: &[CompiledRule], subject: &Subject, object: &Value) -> Vec<String> {
    let refs: Vec<&CompiledRule> = rules.iter().collect();
    let prefilter = Prefilter::new(&refs);
    let survivors = prefilter.survivors(&mut Reading::new(subject, object));
    kept_by(&prefilter, &survivors, rules)
}

fn kept_by(prefilter: &Prefilter, survivors: &Survivors, rules: &[CompiledRule]) -> Vec<String> {
    let mut names = Vec::new();
    let mut at = prefilter.next_survivor(survivors, 0);
    while at < rules.len() {
        names.push(rules[at].id.to_string());
        at = prefilter.next_survivor(survivors, at + 1);
    }
    names
}

#[test]
fn members_are_a_list_when_few_and_a_bitset_when_many() {
    assert_eq!(Members::new(vec![3, 70], 128), Members::Few(vec![3, 70]));
    let many = Members::new(vec![1, 2, 65], 128);
    assert_eq!(many, Members::Many(vec![0b110, 0b10]));
    let mut out = vec![0u64; 2];
    many.add_to(&mut out);
    Members::new(vec![127], 128).add_to(&mut out);
    assert_eq!(out, vec![0b110, 0b10 | 1 << 63]);
}

#[test]
fn anchored_patterns_give_the_literal_every_match_starts_with() {
    let cases = [
        ("^registry\\.other/team-7/", Some("registry.other/team-7/")),
        ("^nginx(:.*)?$", Some("nginx")),
        ("^docker\\.io/", Some("docker.io/")),
        // A quantified character may be absent or repeated; `+` keeps one.
        ("^abc?d", Some("ab")),
        ("^ab*", Some("a")),
        ("^ab{2}", Some("a")),
        ("^ab+c", Some("ab")),
        ("^a\\.?b", Some("a")),
        ("^[a-z]+", None),
        ("^\\d+", None),
        ("^\\<word", None),
        ("nginx", None),
        ("^a|b", None),
        ("(?i)^nginx", None),
        ("(?m)^nginx", None),
        ("^é/x", Some("é/x")),
    ];
    for (pattern, want) in cases {
        assert_eq!(anchored_prefix(pattern).as_deref(), want, "{pattern}");
        // Whatever the prefix, every string the regex matches starts with it.
        let re = regex::Regex::new(pattern).unwrap();
        for text in [
            "registry.other/team-7/x",
            "nginx:1",
            "docker.io/x",
            "abd",
            "abcd",
            "ab",
            "a",
            "abb",
            "abbc",
            "a.b",
            "ab",
            "é/x",
            "word",
        ] {
            if re.is_match(text)
                && let Some(prefix) = anchored_prefix(pattern)
            {
                assert!(text.starts_with(&prefix), "{pattern} matches {text}");
            }
        }
    }
}

#[test]
fn labels_keep_rules_whose_label_the_object_has() {
    let rules = compiled(&[
        cmr(
            "eq",
            json!({"match": {"kinds": ["Pod"], "labels": {"matchLabels": {"app": "web"}}}}),
        ),
        cmr(
            "in",
            json!({"match": {"kinds": ["Pod"], "labels": {"matchExpressions": [
            {"key": "tier", "operator": "In", "values": ["a", "b"]}]}}}),
        ),
        cmr(
            "exists",
            json!({"match": {"kinds": ["Pod"], "labels": {"matchExpressions": [
            {"key": "team", "operator": "Exists"}]}}}),
        ),
        cmr(
            "not-in",
            json!({"match": {"kinds": ["Pod"], "labels": {"matchExpressions": [
            {"key": "app", "operator": "NotIn", "values": ["web"]}]}}}),
        ),
        cmr(
            "does-not-exist",
            json!({"match": {"kinds": ["Pod"], "labels": {"matchExpressions": [
            {"key": "app", "operator": "DoesNotExist"}]}}}),
        ),
        cmr("none", json!({"match": {"kinds": ["Pod"]}})),
    ]);
    let gvk = Gvk::new("", "v1", "Pod");
    let subject = subject(&gvk, Operation::Create, None);
    let object = pod(
        json!({"labels": {"app": "web", "tier": "b", "team": 3}}),
        &[],
    );
    // `team: 3` is not a string: the selector reads it as absent. NotIn and DoesNotExist
    // are left to the matcher.
    assert_eq!(
        kept(&rules, &subject, &object),
        ["eq", "in", "not-in", "does-not-exist", "none"]
    );
    let object = pod(json!({"labels": {"app": "api", "team": "x"}}), &[]);
    assert_eq!(
        kept(&rules, &subject, &object),
        ["exists", "not-in", "does-not-exist", "none"]
    );
    assert_eq!(
        kept(&rules, &subject, &pod(json!({}), &[])),
        ["not-in", "does-not-exist", "none"]
    );
}

#[test]
fn names_keep_rules_by_literal_prefix_or_suffix() {
    let rules = compiled(&[
        cmr(
            "web",
            json!({"match": {"kinds": ["Pod"], "names": ["web-*"]}}),
        ),
        cmr(
            "canary",
            json!({"match": {"kinds": ["Pod"], "names": ["*-canary"]}}),
        ),
        cmr(
            "either",
            json!({"match": {"kinds": ["Pod"], "names": ["api-?", "*-canary"]}}),
        ),
        cmr(
            "any",
            json!({"match": {"kinds": ["Pod"], "names": ["x-*", "*"]}}),
        ),
        cmr(
            "exact",
            json!({"match": {"kinds": ["Pod"], "names": ["web-1"]}}),
        ),
    ]);
    let gvk = Gvk::new("", "v1", "Pod");
    let subject = subject(&gvk, Operation::Create, None);
    let named = |metadata: Value| kept(&rules, &subject, &pod(metadata, &[]));
    assert_eq!(named(json!({"name": "web-1"})), ["web", "any", "exact"]);
    assert_eq!(named(json!({"name": "web-10"})), ["web", "any", "exact"]);
    assert_eq!(
        named(json!({"name": "web-canary"})),
        ["web", "canary", "either", "any"]
    );
    assert_eq!(
        named(json!({"name": "api-canary"})),
        ["canary", "either", "any"]
    );
    // No name yet: the globs read generateName.
    assert_eq!(named(json!({"generateName": "web-"})), ["web", "any"]);
    assert_eq!(named(json!({})), ["any"]);
    // Multi-byte names are cut at character boundaries only.
    assert_eq!(named(json!({"name": "wé"})), ["any"]);
}

#[test]
fn the_keys_common_affix_is_cut_at_a_character_boundary() {
    let start = |keys: &[&'static str]| common_affix(keys.iter().copied(), End::Start);
    let end = |keys: &[&'static str]| common_affix(keys.iter().copied(), End::End);
    assert_eq!(start(&[]), "");
    assert_eq!(start(&["batch-1-"]), "batch-1-");
    assert_eq!(
        start(&[
            "registry.other/team-1/",
            "registry.other/team-22/",
            "registry.other/team-3"
        ]),
        "registry.other/team-"
    );
    assert_eq!(start(&["web-", "db-"]), "");
    // é and è share their first byte: the common prefix stops before the character.
    assert_eq!(start(&["wé-1", "wè-2"]), "w");
    assert_eq!(end(&["-canary", "-blue-canary"]), "-canary");
    assert_eq!(end(&["aé", "bé"]), "é");
    // é (C3 A9) and ũ (C5 A9) share their last byte only.
    assert_eq!(end(&["xé", "xũ"]), "");
    assert_eq!(end(&["-a", "-b"]), "");
}

#[test]
fn affixes_without_the_common_part_are_not_looked_up_and_the_others_are() {
    let affixes = |keys: &[(&str, u32)], end: End| {
        let mut keyed = Keyed::default();
        for (key, offset) in keys {
            keyed.add(key, *offset);
        }
        Affixes::new(keyed, 8, end)
    };
    let kept = |affixes: &Affixes, text: &str, end: End| {
        let mut out = vec![0u64; 1];
        affixes.add_kept(text, end, &mut out);
        (0..8)
            .filter(|i| out[0] & (1 << i) != 0)
            .collect::<Vec<u32>>()
    };
    let prefixes = affixes(
        &[
            ("reg/team-1/", 0),
            ("reg/team-1/x/", 1),
            ("reg/team-2/", 2),
            ("reg/t", 3),
        ],
        End::Start,
    );
    assert_eq!(prefixes.common, "reg/t");
    assert_eq!(kept(&prefixes, "reg/team-1/x/app:1", End::Start), [0, 1, 3]);
    assert_eq!(kept(&prefixes, "reg/team-2/app", End::Start), [2, 3]);
    assert_eq!(kept(&prefixes, "reg/t", End::Start), [3]);
    assert_eq!(kept(&prefixes, "reg/", End::Start), Vec::<u32>::new());
    assert_eq!(
        kept(&prefixes, "registry/team-1/", End::Start),
        Vec::<u32>::new()
    );
    assert_eq!(kept(&prefixes, "", End::Start), Vec::<u32>::new());
    let suffixes = affixes(&[("-canary", 4), ("-blue-canary", 5)], End::End);
    assert_eq!(suffixes.common, "-canary");
    assert_eq!(kept(&suffixes, "web-blue-canary", End::End), [4, 5]);
    assert_eq!(kept(&suffixes, "web-canary", End::End), [4]);
    assert_eq!(kept(&suffixes, "web-canary-2", End::End), Vec::<u32>::new());
    // Keys with nothing in common: every text is looked up.
    let mixed = affixes(&[("web-", 6), ("db-", 7)], End::Start);
    assert_eq!(mixed.common, "");
    assert_eq!(kept(&mixed, "db-main", End::Start), [7]);
    assert_eq!(kept(&mixed, "web-1", End::Start), [6]);
}

#[test]
fn annotations_operations_and_regexes_keep_rules_the_object_can_satisfy() {
    let rules = compiled(&[
        cmr(
            "annotated",
            json!({"match": {"kinds": ["Pod"], "annotations": {"inject": "t*"}}}),
        ),
        cmr(
            "update",
            json!({"match": {"kinds": ["Pod"], "operations": ["UPDATE"]}}),
        ),
        cmr(
            "nginx",
            json!({"match": {"kinds": ["Pod"]}, "conditions": [
            {"path": "$.spec.containers[*].image", "matches": "^nginx"}]}),
        ),
        cmr(
            "redis",
            json!({"match": {"kinds": ["Pod"]}, "conditions": [
            {"path": "$.spec.containers[*].image", "matches": "redis$"}]}),
        ),
        // The regex is the second condition: the first one, a query that cannot fail, runs
        // before it.
        cmr(
            "second",
            json!({"match": {"kinds": ["Pod"]}, "conditions": [
            {"path": "$.spec.hostNetwork", "exists": false},
            {"path": "$.metadata.name", "matches": "^db-"}]}),
        ),
        cmr(
            "equals",
            json!({"match": {"kinds": ["Pod"]}, "conditions": [
            {"path": "$.metadata.name", "equals": "x"}]}),
        ),
    ]);
    let gvk = Gvk::new("", "v1", "Pod");
    let create = subject(&gvk, Operation::Create, None);
    let object = pod(
        json!({"name": "web", "annotations": {"inject": "no"}}),
        &["nginx:1", "busybox"],
    );
    // The annotation glob is left to the matcher: the key is there. So is `redis$`, the
    // path's only pattern that is not an anchored prefix (too few to search here).
    assert_eq!(
        kept(&rules, &create, &object),
        ["annotated", "nginx", "redis", "equals"]
    );
    let object = pod(
        json!({"name": "db-1", "annotations": {"other": "x"}}),
        &["library/redis"],
    );
    assert_eq!(
        kept(&rules, &create, &object),
        ["redis", "second", "equals"]
    );
    let update = subject(&gvk, Operation::Update, None);
    // Rules that leave operations out act on CREATE only.
    assert_eq!(kept(&rules, &update, &pod(json!({}), &[])), ["update"]);
}

#[test]
fn a_few_patterns_on_a_path_are_left_to_the_rules_and_many_are_searched_as_a_set() {
    let rule = |name: &str, pattern: &str| {
        cmr(
            name,
            json!({"match": {"kinds": ["Pod"]}, "conditions": [
            {"path": "$.spec.containers[*].image", "matches": pattern}]}),
        )
    };
    let few = compiled(&[
        rule("cart", "cart"),
        rule("redis", "redis$"),
        rule("web", "we+b"),
    ]);
    let many = compiled(&[
        rule("cart", "cart"),
        rule("redis", "redis$"),
        rule("web", "we+b"),
        rule("digits", "[0-9]{3}"),
        rule("nginx", "(?i)NGINX"),
        rule("example", "example\\.com"),
    ]);
    // The sets of each path, by path.
    let sets = |rules: &[CompiledRule]| -> Vec<usize> {
        let refs: Vec<&CompiledRule> = rules.iter().collect();
        let prefilter = Prefilter::new(&refs);
        prefilter
            .conditions
            .paths
            .iter()
            .map(|path| path.sets.len())
            .collect()
    };
    assert_eq!(sets(&few), Vec::<usize>::new());
    assert_eq!(sets(&many), [1]);
    let gvk = Gvk::new("", "v1", "Pod");
    let create = subject(&gvk, Operation::Create, None);
    let object = pod(json!({"name": "p"}), &["shop/cart:1", "weeeb", "nginx:404"]);
    assert_eq!(
        kept(&many, &create, &object),
        ["cart", "web", "digits", "nginx"]
    );
    // A few patterns: every rule is kept, its own match searches its pattern once.
    let busybox = pod(json!({"name": "p"}), &["busybox"]);
    assert_eq!(kept(&few, &create, &busybox), ["cart", "redis", "web"]);
    assert!(kept(&many, &create, &busybox).is_empty());
    // The admission is the same either way: no rule matches busybox.
    let index = RuleIndex::new(few);
    let outcome = index
        .evaluate(&create, busybox, None)
        .unwrap_or_else(|d| panic!("{d}"));
    assert!(outcome.matched.is_empty(), "{:?}", outcome.matched);
}

#[test]
fn rules_with_a_namespace_selector_are_kept_where_it_cannot_be_told() {
    let rules = compiled(&[
        cmr(
            "selected",
            json!({"match": {"kinds": ["Pod"], "namespaceSelector": {"matchLabels": {"env": "prod"}},
            "labels": {"matchLabels": {"app": "web"}}, "names": ["web-*"]}}),
        ),
        cmr(
            "excluded",
            json!({"match": {"kinds": ["Pod"]},
            "exclude": {"namespaceSelector": {"matchLabels": {"env": "dev"}}},
            "conditions": [{"path": "$.spec.containers[*].image", "matches": "^nginx"}]}),
        ),
    ]);
    let gvk = Gvk::new("", "v1", "Pod");
    let object = pod(json!({"name": "web-1"}), &[]);
    // The Namespace's labels are unknown: both rules fail rather than not match, so neither
    // labels nor conditions may rule them out...
    let unknown = subject(&gvk, Operation::Create, None);
    assert_eq!(kept(&rules, &unknown, &object), ["selected", "excluded"]);
    // ...but the name, read before the selector, may.
    let other = pod(json!({"name": "api-1"}), &[]);
    assert_eq!(kept(&rules, &unknown, &other), ["excluded"]);
    // Known labels: every facet applies.
    let labels = BTreeMap::new();
    let known = subject(&gvk, Operation::Create, Some(&labels));
    assert_eq!(kept(&rules, &known, &object), Vec::<String>::new());
}

#[test]
fn a_change_looks_again_only_where_it_touched() {
    let rules = compiled(&[
        cmr(
            "labelled",
            json!({"match": {"kinds": ["Pod"], "labels": {"matchLabels": {"app": "web"}}}}),
        ),
        cmr(
            "image",
            json!({"match": {"kinds": ["Pod"]}, "conditions": [
            {"path": "$.spec.containers[*].image", "matches": "^mirror/"}]}),
        ),
        cmr(
            "noted",
            json!({"match": {"kinds": ["Pod"], "annotations": {"example.com/inject": "*"}}}),
        ),
    ]);
    let refs: Vec<&CompiledRule> = rules.iter().collect();
    let prefilter = Prefilter::new(&refs);
    let gvk = Gvk::new("", "v1", "Pod");
    let subject = subject(&gvk, Operation::Create, None);
    let mut object = pod(json!({}), &["nginx"]);
    let mut survivors = prefilter.survivors(&mut Reading::new(&subject, &object));
    assert!(kept_by(&prefilter, &survivors, &rules).is_empty());

    let at = |p: &str| Pointer::parse(p).unwrap_or_else(|e| panic!("{e}"));
    // Neither read: nothing looked up again.
    object["spec"]["volumes"] = json!([]);
    object["spec"]["containers"][0]["env"] = json!([]);
    let touched = [at("/spec/volumes"), at("/spec/containers/0/env")];
    let touched: Vec<&Pointer> = touched.iter().collect();
    let refresh = |survivors: &mut Survivors, object: &Value, touched: &[&Pointer]| {
        prefilter.refresh(survivors, &mut Reading::changed(&subject, object, touched))
    };
    assert!(!refresh(&mut survivors, &object, &touched));

    object["metadata"]["labels"] = json!({"app": "web"});
    assert!(refresh(&mut survivors, &object, &[&at("/metadata")]));
    assert_eq!(kept_by(&prefilter, &survivors, &rules), ["labelled"]);

    // Another label, or an annotation no rule reads: the labels are not looked at again.
    object["metadata"]["labels"]["team"] = json!("a");
    object["metadata"]["annotations"] = json!({"a/b": "c"});
    let (team, note) = (
        at("/metadata/labels/team"),
        at("/metadata/annotations/a~1b"),
    );
    assert!(!refresh(&mut survivors, &object, &[&team, &note]));
    // The label a rule reads, among others: they are.
    object["metadata"]["labels"]["app"] = json!("api");
    let app = at("/metadata/labels/app");
    assert!(refresh(&mut survivors, &object, &[&team, &app]));
    assert!(kept_by(&prefilter, &survivors, &rules).is_empty());
    object["metadata"]["labels"] = json!({"app": "web"});
    assert!(refresh(&mut survivors, &object, &[&at("/metadata/labels")]));
    assert_eq!(kept_by(&prefilter, &survivors, &rules), ["labelled"]);

    object["spec"]["containers"][0]["image"] = json!("mirror/nginx");
    let touched = at("/spec/containers/0/image");
    assert!(refresh(&mut survivors, &object, &[&touched]));
    assert_eq!(
        kept_by(&prefilter, &survivors, &rules),
        ["labelled", "image"]
    );

    // The annotation a rule reads, written escaped in the pointer.
    object["metadata"]["annotations"]["example.com/inject"] = json!("yes");
    let inject = at("/metadata/annotations/example.com~1inject");
    assert!(refresh(&mut survivors, &object, &[&note, &inject]));
    assert_eq!(
        kept_by(&prefilter, &survivors, &rules),
        ["labelled", "image", "noted"]
    );
}

#[test]
fn the_metadata_a_change_touches_is_read_from_its_pointer() {
    // The reference: a change at, above or below the field (pointers that hold one another).
    let at = |p: &str| Pointer::parse(p).unwrap_or_else(|e| panic!("{e}"));
    let near = |pointer: &Pointer, field: &str| {
        let field = at(field);
        pointer.contains(&field) || field.contains(pointer)
    };
    let pointers = [
        "",
        "/metadata",
        "/metadataX",
        "/metadataX/labels",
        "/metadata/labels",
        "/metadata/labels/app",
        "/metadata/labels/a~1b",
        "/metadata/labels/a~0b/c",
        "/metadata/labels/",
        "/metadata/labelsX",
        "/metadata/annotations",
        "/metadata/annotations/example.com~1namespace",
        "/metadata/name",
        "/metadata/names",
        "/metadata/generateName",
        "/metadata/ownerReferences/0",
        "/metadata/lab~0els",
        "/spec/metadata/labels",
        "/spec/containers/0/image",
        "/",
    ];
    // The reference for a map: the pointer at or above it, below it (the first token under
    // it, escaped again), or beside it.
    let map = |pointer: &Pointer, field: &str| -> MapChange<'static> {
        let field = at(field);
        if pointer.contains(&field) {
            return MapChange::Whole;
        }
        if !field.contains(pointer) {
            return MapChange::Not;
        }
        let key = pointer.tokens().nth(field.tokens().count()).map(|(t, _)| t);
        let key = escape(&key.unwrap_or_default()).into_owned();
        MapChange::Key(Box::leak(key.into_bytes().into_boxed_slice()))
    };
    for p in pointers {
        let pointer = at(p);
        let want = (
            map(&pointer, "/metadata/labels"),
            map(&pointer, "/metadata/annotations"),
            near(&pointer, "/metadata/name") || near(&pointer, "/metadata/generateName"),
        );
        assert_eq!(metadata_touched(&pointer), want, "{p}");
    }
    assert_eq!(
        metadata_touched(&at("/metadata/labels/app")),
        (MapChange::Key(b"app"), MapChange::Not, false)
    );
    assert_eq!(
        metadata_touched(&at("/metadata/annotations/example.com~1mode/x")),
        (MapChange::Not, MapChange::Key(b"example.com~1mode"), false)
    );
    assert_eq!(
        metadata_touched(&at("")),
        (MapChange::Whole, MapChange::Whole, true)
    );
}

#[test]
fn survivors_are_found_across_words() {
    // 150 rules over three bitset words; those that survive are every 7th.
    let docs: Vec<Value> = (0..150)
        .map(|i| {
            let app = if i % 7 == 0 {
                "web".to_string()
            } else {
                format!("app-{i}")
            };
            cmr(
                &format!("r{i:03}"),
                json!({"match": {"kinds": ["Pod"], "labels": {"matchLabels": {"app": app}}}}),
            )
        })
        .collect();
    let rules = compiled(&docs);
    let gvk = Gvk::new("", "v1", "Pod");
    let subject = subject(&gvk, Operation::Create, None);
    let want: Vec<String> = (0..150).step_by(7).map(|i| format!("r{i:03}")).collect();
    assert_eq!(
        kept(
            &rules,
            &subject,
            &pod(json!({"labels": {"app": "web"}}), &[])
        ),
        want
    );
}

// ---- The property: prefiltered admission == plain admission, on random rules and objects.

/// A small deterministic generator (SplitMix64): the same seed gives the same cases, so a
/// failure names the seed that reproduces it.
struct Random(u64);

impl Random {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }

    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len())]
    }

    fn some<'a>(&mut self, items: &[&'a str], most: usize) -> Vec<&'a str> {
        let n = self.below(most + 1);
        (0..n).map(|_| self.pick(items)).collect()
    }
}

const KEYS: [&str; 4] = ["app", "tier", "team", "example.com/env"];
const VALUES: [&str; 4] = ["web", "api", "a", "b"];
const ANNOTATION_KEYS: [&str; 3] = ["inject", "example.com/mode", "team"];
const ANNOTATION_VALUES: [&str; 3] = ["true", "false", "on"];
const NAMES: [&str; 6] = ["web-1", "web-2", "api-1", "db-main", "wé-3", "batch-7-x"];
const GLOBS: [&str; 12] = [
    "web-*",
    "*-1",
    "api-?",
    "*",
    "web-1",
    "b*x",
    "?eb-*",
    "db-*",
    "*main",
    "wé-*",
    "batch-7*",
    "batch-*-x",
];
const NAMESPACES: [&str; 3] = ["shop", "team-a", "team-b"];
const IMAGES: [&str; 5] = [
    "nginx:1",
    "registry.example.com/shop/web:1",
    "docker.io/library/redis",
    "shop/cart",
    "mirror.local/nginx:1",
];
const PATHS: [&str; 9] = [
    "$.spec.containers[*].image",
    "$.spec['containers','initContainers'][*].image",
    "$.metadata.name",
    "$.metadata.labels.app",
    "$.spec.containers[*].image",
    "$..image",
    "$.spec.containers[?match(@.image, 'nginx.*')].name",
    // Filters: told by their leading steps (a change to the annotations cannot change them),
    // unless they read from the root again.
    "$.metadata.labels[?@ == 'web']",
    "$.spec.containers[?@.name == $.metadata.labels.app].image",
];
const REGEXES: [&str; 13] = [
    "^nginx",
    "example\\.com",
    "redis$",
    "^shop/",
    "cart",
    "web",
    "^$",
    "c0",
    "^registry\\.example\\.com/",
    "^registry\\.example\\.com/shop/w",
    "^mirror\\.local/nginx",
    "^shop/c?art",
    "^web-",
];

fn selector(r: &mut Random) -> Value {
    let mut labels = serde_json::Map::new();
    for key in r.some(&KEYS, 2) {
        labels.insert(key.into(), json!(r.pick(&VALUES)));
    }
    let expressions: Vec<Value> = (0..r.below(3))
        .map(|_| {
            let key = r.pick(&KEYS);
            match r.below(4) {
                0 => json!({"key": key, "operator": "In", "values": r.some(&VALUES, 2).into_iter().chain([r.pick(&VALUES)]).collect::<Vec<_>>()}),
                1 => json!({"key": key, "operator": "NotIn", "values": [r.pick(&VALUES)]}),
                2 => json!({"key": key, "operator": "Exists"}),
                _ => json!({"key": key, "operator": "DoesNotExist"}),
            }
        })
        .collect();
    json!({"matchLabels": labels, "matchExpressions": expressions})
}

fn match_block(r: &mut Random, cluster: bool, exclude: bool) -> Value {
    let mut m = json!({});
    if !exclude || r.chance(20) {
        m["kinds"] = match r.below(10) {
            0 => json!(["*"]),
            1 => json!(["Pod", "ConfigMap"]),
            2 => json!(["v1/Pod"]),
            _ => json!(["Pod"]),
        };
    }
    if r.chance(25) {
        m["operations"] = match r.below(3) {
            0 => json!(["CREATE"]),
            1 => json!(["UPDATE"]),
            _ => json!(["CREATE", "UPDATE"]),
        };
    }
    if r.chance(35) {
        let mut globs = r.some(&GLOBS, 2);
        globs.push(r.pick(&GLOBS));
        m["names"] = json!(globs);
    }
    if cluster && r.chance(15) {
        m["namespaces"] = json!([r.pick(&NAMESPACES), r.pick(&["team-*", "shop", "s*"])]);
    }
    if cluster && r.chance(15) {
        m["namespaceSelector"] = selector(r);
    }
    if r.chance(50) {
        m["labels"] = selector(r);
    }
    if r.chance(25) {
        let mut annotations = serde_json::Map::new();
        for key in r.some(&ANNOTATION_KEYS, 2) {
            annotations.insert(key.into(), json!(r.pick(&["*", "t*", "true", "on"])));
        }
        m["annotations"] = json!(annotations);
    }
    if exclude && m.as_object().is_some_and(|o| o.is_empty()) {
        m["labels"] = json!({"matchLabels": {"tier": "batch"}});
    }
    m
}

fn condition(r: &mut Random) -> Value {
    let path = r.pick(&PATHS);
    match r.below(8) {
        0 => json!({"path": path, "equals": r.pick(&["web-1", "nginx:1", "web"])}),
        1 => json!({"path": path, "exists": r.chance(50)}),
        2 => json!({"path": path, "in": "$.metadata.labels.*"}),
        3 => json!({"path": path, "notEquals": "web"}),
        _ => json!({"path": path, "matches": r.pick(&REGEXES)}),
    }
}

fn mutation(r: &mut Random) -> Value {
    match r.below(8) {
        0 | 1 => json!({"merge": {"metadata": {"labels": {r.pick(&KEYS): r.pick(&VALUES)}}}}),
        2 => json!({"merge": {"metadata": {"labels": {r.pick(&KEYS): null}}}}),
        3 => {
            json!({"merge": {"metadata": {"annotations": {r.pick(&ANNOTATION_KEYS): r.pick(&ANNOTATION_VALUES)}}}})
        }
        4 => json!({"upsert": {"path": "/spec/containers", "key": "name",
            "value": {"name": format!("c{}", r.below(3)), "image": r.pick(&IMAGES)}}}),
        5 => json!({"forEach": "$.spec.containers[*]", "mutations": [
            {"rewrite": {"path": "/image", "regex": "^nginx", "replacement": "mirror.local/nginx"}}]}),
        6 => json!({"merge": {"metadata": {"generateName": r.pick(&["web-", "db-", "api-"])}}}),
        // Fails unless the Pod has that label: the rule is skipped or denies, undone.
        _ => json!({"patch": [{"op": "test", "path": "/metadata/labels/app", "value": "web"},
            {"op": "add", "path": "/spec/hostNetwork", "value": true}]}),
    }
}

fn random_rule(r: &mut Random, i: usize) -> Value {
    let cluster = r.chance(50);
    let mut spec = json!({
        "priority": r.below(4) * 50,
        "match": match_block(r, cluster, false),
        "mutations": (0..1 + r.below(2)).map(|_| mutation(r)).collect::<Vec<_>>(),
    });
    if r.chance(20) {
        spec["exclude"] = match_block(r, cluster, true);
    }
    if r.chance(45) {
        spec["conditions"] = json!(
            (0..1 + r.below(2))
                .map(|_| condition(r))
                .collect::<Vec<_>>()
        );
    }
    if r.chance(20) {
        spec["failurePolicy"] = json!("Fail");
    }
    if r.chance(10) {
        spec["mode"] = json!("Audit");
    }
    let name = format!("r{i}");
    if cluster {
        json!({"apiVersion": "initium.dev/v1alpha1", "kind": "ClusterMutationRule",
               "metadata": {"name": name}, "spec": spec})
    } else {
        json!({"apiVersion": "initium.dev/v1alpha1", "kind": "MutationRule",
               "metadata": {"name": name, "namespace": r.pick(&NAMESPACES)}, "spec": spec})
    }
}

fn random_object(r: &mut Random, namespace: &str) -> Value {
    let mut labels = serde_json::Map::new();
    for key in r.some(&KEYS, 3) {
        labels.insert(key.into(), json!(r.pick(&VALUES)));
    }
    if r.chance(10) {
        labels.insert(r.pick(&KEYS).into(), json!(7));
    }
    let mut annotations = serde_json::Map::new();
    for key in r.some(&ANNOTATION_KEYS, 2) {
        annotations.insert(key.into(), json!(r.pick(&ANNOTATION_VALUES)));
    }
    let mut metadata =
        json!({"namespace": namespace, "labels": labels, "annotations": annotations});
    match r.below(3) {
        0 => metadata["name"] = json!(r.pick(&NAMES)),
        1 => metadata["generateName"] = json!(r.pick(&["web-", "db-", "batch-7-"])),
        _ => {}
    }
    let images = r.some(&IMAGES, 3);
    let mut object = pod(metadata, &images);
    if r.chance(20) {
        object["spec"]["initContainers"] = json!([{"name": "init", "image": r.pick(&IMAGES)}]);
    }
    object
}

/// Objects admitted against each random rule set (compiling the rules costs the most).
const OBJECTS_PER_CASE: usize = 20;

/// Checks the property on `cases` random rule sets, several objects each; returns how many
/// admissions were compared.
fn check_property(seed: u64, cases: usize) -> usize {
    let mut r = Random(seed);
    let mut compared = 0;
    for case in 0..cases {
        let count = 1 + r.below(60);
        let docs: Vec<Value> = (0..count).map(|i| random_rule(&mut r, i)).collect();
        let rules: Vec<Arc<CompiledRule>> = docs
            .iter()
            .filter_map(|doc| compile_document(doc, "shop").ok())
            .map(Arc::new)
            .collect();
        // Prefilters over lists of every length (from 1), and as the index builds them.
        let from = [1, 2, 5, 16][r.below(4)];
        let index = RuleIndex::with_prefilter_from(rules, from);
        for _ in 0..OBJECTS_PER_CASE {
            let namespace = r.pick(&NAMESPACES);
            let object = random_object(&mut r, namespace);
            let gvk = Gvk::new("", "v1", "Pod");
            let mut namespace_labels = BTreeMap::new();
            for key in r.some(&KEYS, 2) {
                namespace_labels.insert(key.to_string(), r.pick(&VALUES).to_string());
            }
            let name = object["metadata"]["name"].as_str().map(str::to_string);
            let subject = Subject {
                gvk: &gvk,
                operation: if r.chance(70) {
                    Operation::Create
                } else {
                    Operation::Update
                },
                namespace: Some(namespace),
                name: name.as_deref().filter(|_| r.chance(50)),
                namespace_labels: if r.chance(70) {
                    Some(&namespace_labels)
                } else {
                    None
                },
                lookups: None,
                ran_before: RanBefore::Unknown,
            };
            let plain = index.evaluate_candidates(
                &subject,
                object.clone(),
                None,
                &Limits::default(),
                false,
            );
            let prefiltered =
                index.evaluate_candidates(&subject, object.clone(), None, &Limits::default(), true);
            if plain != prefiltered {
                let docs: Vec<String> = docs.iter().map(Value::to_string).collect();
                panic!(
                    "seed {seed}, case {case} (prefilters from {from}): the prefilters changed the admission of\n{object:#}\nby {subject:?}\nrules:\n{}\nplain: {plain:#?}\nprefiltered: {prefiltered:#?}",
                    docs.join("\n")
                );
            }
            if let Ok(outcome) = &plain {
                let (mut a, mut b) = (Vec::new(), Vec::new());
                outcome
                    .write_patch(&mut a)
                    .unwrap_or_else(|e| panic!("{e}"));
                if let Ok(p) = &prefiltered {
                    p.write_patch(&mut b).unwrap_or_else(|e| panic!("{e}"));
                }
                assert_eq!(a, b, "seed {seed}, case {case}: the patches differ");
            }
            compared += 1;
        }
    }
    compared
}

#[test]
fn prefiltered_admission_is_the_plain_admission() {
    // 100 rule sets of 1 to 60 rules, 20 objects each: 2,000 admissions compared both ways
    // (a few seconds; compiling the random rules' regexes costs the most). For a longer
    // search: INITIUM_PREFILTER_SEED=<n> INITIUM_PREFILTER_CASES=<n>.
    let seed = std::env::var("INITIUM_PREFILTER_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x1dea_5eed);
    let cases = std::env::var("INITIUM_PREFILTER_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100);
    let compared = check_property(seed, cases);
    assert_eq!(compared, cases * OBJECTS_PER_CASE);
}

#[test]
fn random_rules_exercise_what_the_property_is_about() {
    // A property that holds because nothing was ruled out, or nothing matched, tests nothing:
    // on the same cases, the prefilters rule rules out, and rules match and change objects.
    let mut r = Random(0x1dea_5eed);
    let (mut ruled_out, mut applied) = (0usize, 0usize);
    for _ in 0..50 {
        let count = 1 + r.below(60);
        let rules: Vec<Arc<CompiledRule>> = (0..count)
            .filter_map(|i| compile_document(&random_rule(&mut r, i), "shop").ok())
            .map(Arc::new)
            .collect();
        let index = RuleIndex::with_prefilter_from(rules, 1);
        let object = random_object(&mut r, "shop");
        let gvk = Gvk::new("", "v1", "Pod");
        let labels = BTreeMap::new();
        let subject = subject(&gvk, Operation::Create, Some(&labels));
        let all = index.candidates(&gvk, Some("shop"), true).len();
        let mut cursor = index.candidate_cursor(&gvk, Some("shop"), true);
        cursor.prefilter(&subject, &object);
        let mut left = 0;
        while cursor.next_rule().is_some() {
            left += 1;
        }
        ruled_out += all - left;
        if let Ok(outcome) = index.evaluate(&subject, object, None) {
            applied += outcome.applied.len();
        }
    }
    assert!(ruled_out > 200, "ruled out {ruled_out}");
    assert!(applied > 50, "applied {applied}");
}

#[test]
fn without_prefilters_the_cursor_gives_the_candidates() {
    let mut r = Random(7);
    for _ in 0..50 {
        let rules: Vec<Arc<CompiledRule>> = (0..1 + r.below(60))
            .filter_map(|i| compile_document(&random_rule(&mut r, i), "shop").ok())
            .map(Arc::new)
            .collect();
        let index = RuleIndex::with_prefilter_from(rules, 1);
        let gvk = Gvk::new("", "v1", "Pod");
        for (namespace, namespaced) in [(Some("shop"), true), (Some("team-a"), true), (None, false)]
        {
            let want: Vec<String> = index
                .candidates(&gvk, namespace, namespaced)
                .iter()
                .map(|r| r.id.to_string())
                .collect();
            let mut cursor = index.candidate_cursor(&gvk, namespace, namespaced);
            let mut got = Vec::new();
            while let Some(rule) = cursor.next_rule() {
                got.push(rule.id.to_string());
            }
            assert_eq!(got, want);
        }
    }
}
