//! Provenance: `initium.dev/mutated-by`, the rules that changed an object, in order
//! (DESIGN.md section 3). Read to run a rule at most once per object, written after the rules.

use std::sync::LazyLock;

use serde_json::{Map, Value};

use crate::api::MUTATED_BY_ANNOTATION;

use super::path::Pointer;
use super::subject::RuleId;

/// Where the provenance is: `/metadata/annotations/initium.dev~1mutated-by`.
pub(crate) fn provenance_pointer() -> &'static Pointer {
    static POINTER: LazyLock<Pointer> =
        LazyLock::new(|| Pointer::from_tokens(["metadata", "annotations", MUTATED_BY_ANNOTATION]));
    &POINTER
}

/// The rules listed in `initium.dev/mutated-by`, split.
pub(crate) fn listed(annotation: &str) -> impl Iterator<Item = &str> {
    annotation
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
}

/// Appends the rules that changed the object to `initium.dev/mutated-by`, keeping what earlier
/// passes (reinvocation, updates) recorded, so running the pipeline again changes nothing.
pub(crate) fn record_provenance(object: &mut Value, applied: &[RuleId]) {
    let Some(obj) = object.as_object_mut() else {
        return;
    };
    let meta = obj
        .entry("metadata")
        .or_insert_with(|| Value::Object(Map::new()));
    let Some(meta) = meta.as_object_mut() else {
        return;
    };
    let annotations = meta
        .entry("annotations")
        .or_insert_with(|| Value::Object(Map::new()));
    if annotations.is_null() {
        *annotations = Value::Object(Map::new());
    }
    let Some(annotations) = annotations.as_object_mut() else {
        return;
    };
    let mut list: Vec<String> = annotations
        .get(MUTATED_BY_ANNOTATION)
        .and_then(Value::as_str)
        .map(|s| listed(s).map(String::from).collect())
        .unwrap_or_default();
    for id in applied {
        let name = id.written();
        if !list.contains(&name) {
            list.push(name);
        }
    }
    annotations.insert(
        MUTATED_BY_ANNOTATION.to_string(),
        Value::String(list.join(",")),
    );
}
