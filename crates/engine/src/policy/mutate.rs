//! A rule's mutations as MutatingAdmissionPolicy JSONPatch expressions, and the
//! `initium.dev/mutated-by` record the engine writes when a rule changes an object.
//!
//! Each mutation becomes one JSONPatch expression evaluated on the object as the previous
//! ones left it, as the engine applies them. Before it, a second expression, evaluated on the
//! same object, records the rule in `initium.dev/mutated-by` when the mutation is going to
//! change something. That equals the engine's "the rule changed the object" because the
//! compiler only accepts rules whose mutations write disjoint fields, none of them the record.

use serde_json::{Map, Value};

use crate::api::{MUTATED_BY_ANNOTATION, Mutation, MutationKind, Position, Upsert};

use super::NotCompiled;
use super::cel::{Path, literal, quote};

/// JSONPatch operations, some of them only under a condition on the object.
#[derive(Clone, Debug)]
enum Ops {
    List(Vec<String>),
    When(String, Box<Ops>, Box<Ops>),
    All(Vec<Ops>),
}

impl Ops {
    fn none() -> Ops {
        Ops::List(Vec::new())
    }

    fn render(&self) -> String {
        match self {
            Ops::List(ops) => format!("[{}]", ops.join(", ")),
            Ops::When(test, then, otherwise) => {
                format!("({test} ? {} : {})", then.render(), otherwise.render())
            }
            Ops::All(parts) => {
                let parts: Vec<String> = parts
                    .iter()
                    .filter(|p| !matches!(p, Ops::List(ops) if ops.is_empty()))
                    .map(Ops::render)
                    .collect();
                if parts.is_empty() {
                    "[]".into()
                } else {
                    parts.join(" + ")
                }
            }
        }
    }
}

fn op(verb: &str, path: &Path, value: Option<&str>) -> String {
    op_at(verb, &quote(&path.pointer()), value)
}

fn op_at(verb: &str, pointer: &str, value: Option<&str>) -> String {
    match value {
        Some(value) => format!(
            "JSONPatch{{op: {}, path: {pointer}, value: {value}}}",
            quote(verb)
        ),
        None => format!("JSONPatch{{op: {}, path: {pointer}}}", quote(verb)),
    }
}

/// What one mutation compiles to.
pub(super) struct Step {
    /// The JSONPatch expression.
    pub(super) patch: String,
    /// CEL true when the mutation will change the object (evaluated before it runs).
    pub(super) changes: String,
}

/// The only template compiled: the object's namespace, which the API server has set on a
/// namespaced object before admission, as the engine fills it in.
const NAMESPACE_TEMPLATE: &str = "$.metadata.namespace";

/// A string value as CEL: a literal, or `request.namespace` where the string has the template
/// `{{ $.metadata.namespace }}`.
fn string_value(text: &str, field: &str) -> Result<String, NotCompiled> {
    if !text.contains("{{") && !text.contains("}}") {
        return Ok(quote(text));
    }
    let mut parts = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find("{{") {
        let Some(len) = rest[start..].find("}}") else {
            return Err(not_template(field));
        };
        let inside = rest[start + 2..start + len].trim();
        if inside != NAMESPACE_TEMPLATE {
            return Err(not_template(field));
        }
        if start > 0 {
            parts.push(quote(&rest[..start]));
        }
        parts.push("request.namespace".to_string());
        rest = &rest[start + len + 2..];
    }
    if rest.contains("}}") {
        return Err(not_template(field));
    }
    if !rest.is_empty() {
        parts.push(quote(rest));
    }
    Ok(parts.join(" + "))
}

fn not_template(field: &str) -> NotCompiled {
    NotCompiled::new(
        field,
        "templates other than {{ $.metadata.namespace }} have no CEL equivalent yet",
    )
}

/// A JSON value (with templated strings) as a CEL expression; nulls are dropped from objects
/// when `strip_nulls` (what a merge patch does to an object it adds).
fn value(v: &Value, field: &str, strip_nulls: bool) -> Result<String, NotCompiled> {
    match v {
        Value::String(s) => string_value(s, field),
        Value::Array(items) => {
            let items: Result<Vec<String>, NotCompiled> = items
                .iter()
                .enumerate()
                .map(|(i, item)| {
                    value(item, &format!("{field}[{i}]"), false).map(|v| format!("dyn({v})"))
                })
                .collect();
            Ok(format!("[{}]", items?.join(", ")))
        }
        Value::Object(map) => {
            let mut entries = Vec::new();
            for (k, item) in map {
                if k.contains("{{") {
                    return Err(not_template(field));
                }
                if strip_nulls && item.is_null() {
                    continue;
                }
                // dyn(): CEL types a literal's values alike unless told they may differ.
                entries.push(format!(
                    "{}: dyn({})",
                    quote(k),
                    value(item, &format!("{field}.{k}"), strip_nulls)?
                ));
            }
            Ok(format!("{{{}}}", entries.join(", ")))
        }
        other => literal(other).map_err(|reason| NotCompiled::new(field, reason)),
    }
}

/// Fields under `metadata` a compiled rule may write: the others (name, namespace,
/// creationTimestamp, ...) are filled in or defaulted differently at each step of admission.
const METADATA_MAPS: [&str; 2] = ["labels", "annotations"];

/// Leaves a mutation writes, to prove the rule's mutations disjoint.
pub(super) type Writes = Vec<Path>;

fn check_write(path: &Path, field: &str) -> Result<(), NotCompiled> {
    path.check()
        .map_err(|reason| NotCompiled::new(field, reason))?;
    if path.0.first().map(String::as_str) == Some("metadata") {
        match path.0.get(1) {
            Some(map) if METADATA_MAPS.contains(&map.as_str()) && path.0.len() >= 3 => {}
            Some(map) if METADATA_MAPS.contains(&map.as_str()) => {
                return Err(NotCompiled::new(
                    field,
                    format!("writing metadata.{map} as a whole is not compiled; name its keys"),
                ));
            }
            Some(other) => {
                return Err(NotCompiled::new(
                    field,
                    format!(
                        "metadata.{other} is filled in by the API server during admission; only labels and annotations are compiled"
                    ),
                ));
            }
            None => {
                return Err(NotCompiled::new(
                    field,
                    "writing metadata as a whole is not compiled",
                ));
            }
        }
    }
    let record = Path(vec![
        "metadata".into(),
        "annotations".into(),
        MUTATED_BY_ANNOTATION.into(),
    ]);
    if path.related(&record) {
        return Err(NotCompiled::new(
            field,
            format!("writes {MUTATED_BY_ANNOTATION}, which initium keeps"),
        ));
    }
    Ok(())
}

/// RFC 7396 merge of `patch` (an object) into the object at `at`, which is present.
fn merge(
    at: &Path,
    patch: &Map<String, Value>,
    field: &str,
    writes: &mut Writes,
) -> Result<(Ops, Vec<String>), NotCompiled> {
    let mut ops = Vec::new();
    let mut changes = Vec::new();
    for (key, v) in patch {
        if key.contains("{{") {
            return Err(not_template(field));
        }
        let child = at.child(key);
        let here = format!("{field}.{key}");
        let present = child.present();
        match v {
            Value::Null => {
                check_write(&child, &here)?;
                writes.push(child.clone());
                ops.push(Ops::When(
                    present.clone(),
                    Box::new(Ops::List(vec![op("remove", &child, None)])),
                    Box::new(Ops::none()),
                ));
                changes.push(format!("({present})"));
            }
            Value::Object(inner) => {
                child
                    .check()
                    .map_err(|reason| NotCompiled::new(&here, reason))?;
                let (deeper, deeper_changes) = merge(&child, inner, &here, writes)?;
                let added = value(v, &here, true)?;
                let mut creates = Vec::new();
                collect_leaves(&child, inner, &mut creates);
                for leaf in &creates {
                    check_write(leaf, &here)?;
                }
                if inner.is_empty() {
                    check_write(&child, &here)?;
                    writes.push(child.clone());
                }
                ops.push(Ops::When(
                    present.clone(),
                    Box::new(deeper),
                    Box::new(Ops::List(vec![op("add", &child, Some(&added))])),
                ));
                changes.push(format!("(!({present}) || {})", any(deeper_changes)));
            }
            scalar => {
                if matches!(scalar, Value::Array(items) if items.iter().any(|i| i.is_object() || i.is_array()))
                {
                    return Err(NotCompiled::new(
                        here,
                        "a list of objects or lists is compared differently by CEL; only lists of scalars are compiled",
                    ));
                }
                check_write(&child, &here)?;
                writes.push(child.clone());
                let wanted = value(scalar, &here, false)?;
                ops.push(Ops::List(vec![op("add", &child, Some(&wanted))]));
                changes.push(format!("!({present} && {} == {wanted})", child.access()));
            }
        }
    }
    Ok((Ops::All(ops), changes))
}

/// The leaves (non-object values, and empty objects) of an object added whole at `at`.
fn collect_leaves(at: &Path, map: &Map<String, Value>, out: &mut Vec<Path>) {
    for (key, v) in map {
        match v {
            Value::Object(inner) if !inner.is_empty() => collect_leaves(&at.child(key), inner, out),
            _ => out.push(at.child(key)),
        }
    }
}

/// `defaults`: each field set only where the object lacks it.
fn defaults(
    at: &Path,
    wanted: &Map<String, Value>,
    field: &str,
    writes: &mut Writes,
) -> Result<(Ops, Vec<String>), NotCompiled> {
    let mut ops = Vec::new();
    let mut changes = Vec::new();
    for (key, v) in wanted {
        if key.contains("{{") {
            return Err(not_template(field));
        }
        let child = at.child(key);
        let here = format!("{field}.{key}");
        let present = child.present();
        let added = value(v, &here, false)?;
        match v {
            Value::Object(inner) if !inner.is_empty() => {
                let mut creates = Vec::new();
                collect_leaves(&child, inner, &mut creates);
                for leaf in &creates {
                    check_write(leaf, &here)?;
                }
                child
                    .check()
                    .map_err(|reason| NotCompiled::new(&here, reason))?;
                let (deeper, deeper_changes) = defaults(&child, inner, &here, writes)?;
                ops.push(Ops::When(
                    present.clone(),
                    Box::new(deeper),
                    Box::new(Ops::List(vec![op("add", &child, Some(&added))])),
                ));
                changes.push(format!("(!({present}) || {})", any(deeper_changes)));
            }
            _ => {
                check_write(&child, &here)?;
                writes.push(child.clone());
                ops.push(Ops::When(
                    present.clone(),
                    Box::new(Ops::none()),
                    Box::new(Ops::List(vec![op("add", &child, Some(&added))])),
                ));
                changes.push(format!("!({present})"));
            }
        }
    }
    Ok((Ops::All(ops), changes))
}

/// Adds `value` at `path`, creating the missing parents as objects (as the engine does).
fn add_creating(path: &Path, value: String) -> Ops {
    let mut ops = Ops::List(vec![op("add", path, Some(&value))]);
    let mut wrapped = value;
    let mut at = path.clone();
    // From the deepest parent up: where it is missing, add it holding what is below.
    while at.0.len() > 1 {
        let key = at.0.pop().unwrap_or_default();
        wrapped = format!("{{{}: {wrapped}}}", quote(&key));
        let parent = at.clone();
        ops = Ops::When(
            parent.present(),
            Box::new(ops),
            Box::new(Ops::List(vec![op("add", &parent, Some(&wrapped))])),
        );
    }
    ops
}

fn upsert(spec: &Upsert, field: &str, writes: &mut Writes) -> Result<(Ops, String), NotCompiled> {
    let path = Path(
        crate::path::Pointer::parse(&spec.path)
            .map_err(|e| NotCompiled::new(format!("{field}.path"), e.to_string()))?
            .tokens()
            .map(|(t, _)| t.into_owned())
            .collect(),
    );
    if path.0.is_empty() {
        return Err(NotCompiled::new(
            format!("{field}.path"),
            "an upsert into the object's root is not compiled",
        ));
    }
    check_write(&path, &format!("{field}.path"))?;
    writes.push(path.clone());
    if spec.key.contains("{{") {
        return Err(not_template(&format!("{field}.key")));
    }
    let Some(key_value) = spec.value.get(&spec.key) else {
        return Err(NotCompiled::new(
            format!("{field}.value"),
            "has no key field",
        ));
    };
    let element = value(&spec.value, &format!("{field}.value"), false)?;
    let wanted_key = value(key_value, &format!("{field}.value.{}", spec.key), false)?;
    let list = path.access();
    let element_key = Path(vec![spec.key.clone()]);
    let has_key = element_key.present_from("e");
    let key_of = element_key.access_from("e");
    // Where the key is found: `e` and the key only ever occur as generated here.
    let same = format!("({has_key} && {key_of} == {wanted_key})");
    let found = format!("{list}.exists(e, {same})");
    let index = format!("{list}.map(e, {same}).indexOf(true)");
    let pointer = quote(&path.pointer());
    let replace = Ops::When(
        format!("{list}[{index}] == {element}"),
        Box::new(Ops::none()),
        Box::new(Ops::List(vec![op_at(
            "replace",
            &format!("{pointer} + \"/\" + string({index})"),
            Some(&element),
        )])),
    );
    let insert = match spec.position {
        Position::Append => op_at("add", &format!("{pointer} + \"/-\""), Some(&element)),
        Position::Prepend => op_at("add", &format!("{pointer} + \"/0\""), Some(&element)),
    };
    let present = path.present();
    let ops = Ops::When(
        present.clone(),
        Box::new(Ops::When(
            found.clone(),
            Box::new(replace),
            Box::new(Ops::List(vec![insert])),
        )),
        Box::new(add_creating(&path, format!("[{element}]"))),
    );
    let changes = format!("!(({present}) && {found} && {list}[{index}] == {element})");
    Ok((ops, changes))
}

/// One mutation of a rule (`spec.mutations[i]`).
pub(super) fn step(
    mutation: &Mutation,
    field: &str,
    writes: &mut Writes,
) -> Result<Step, NotCompiled> {
    let Some(kind) = mutation.kinds().next() else {
        return Err(NotCompiled::new(field, "sets no mutation"));
    };
    let root = Path(Vec::new());
    let (ops, changes) = match kind {
        MutationKind::Merge(patch) => {
            let Some(map) = patch.as_object() else {
                return Err(NotCompiled::new(
                    format!("{field}.merge"),
                    "is not an object",
                ));
            };
            let (ops, changes) = merge(&root, map, &format!("{field}.merge"), writes)?;
            (ops, any(changes))
        }
        MutationKind::Defaults(wanted) => {
            let Some(map) = wanted.as_object() else {
                return Err(NotCompiled::new(
                    format!("{field}.defaults"),
                    "is not an object",
                ));
            };
            let (ops, changes) = defaults(&root, map, &format!("{field}.defaults"), writes)?;
            (ops, any(changes))
        }
        MutationKind::Upsert(spec) => upsert(spec, &format!("{field}.upsert"), writes)?,
        MutationKind::Patch(_) => {
            return Err(NotCompiled::new(
                format!("{field}.patch"),
                "RFC 6902 operations fail differently in the API server (a failing operation there is not the rule failing); not compiled",
            ));
        }
        MutationKind::Rewrite(_) => {
            return Err(NotCompiled::new(
                format!("{field}.rewrite"),
                "regular expressions follow Rust's syntax and capture groups; CEL has no equivalent",
            ));
        }
        MutationKind::Remove(_) => {
            return Err(NotCompiled::new(
                format!("{field}.remove"),
                "its where conditions are JSONPath; not compiled yet",
            ));
        }
        MutationKind::ForEach { .. } => {
            return Err(NotCompiled::new(
                format!("{field}.forEach"),
                "a JSONPath over list elements has no exact CEL equivalent yet",
            ));
        }
    };
    Ok(Step {
        patch: ops.render(),
        changes,
    })
}

fn any(changes: Vec<String>) -> String {
    if changes.is_empty() {
        "false".into()
    } else {
        changes.join(" || ")
    }
}

/// The JSONPatch expression that records `written` (the rule as `initium.dev/mutated-by`
/// names it) when `changes` holds: appended to the list unless listed, the list written back
/// trimmed and without empty entries, as the engine writes it.
pub(super) fn record(written: &str, changes: &str) -> String {
    let annotations = Path(vec!["metadata".into(), "annotations".into()]);
    let record = annotations.child(MUTATED_BY_ANNOTATION);
    let listed = format!(
        "({} ? {}.split(\",\").map(s, s.trim()).filter(s, s != \"\") : [])",
        record.present(),
        record.access()
    );
    let name = quote(written);
    let list =
        format!("({listed}.exists(s, s == {name}) ? {listed} : {listed} + [{name}]).join(\",\")");
    let ops = Ops::When(
        changes.to_string(),
        Box::new(Ops::When(
            annotations.present(),
            Box::new(Ops::List(vec![op("add", &record, Some(&list))])),
            Box::new(Ops::List(vec![op(
                "add",
                &annotations,
                Some(&format!("{{{}: {name}}}", quote(MUTATED_BY_ANNOTATION))),
            )])),
        )),
        Box::new(Ops::none()),
    );
    ops.render()
}
