//! A rule's mutations as MutatingAdmissionPolicy JSONPatch expressions, and the
//! `initium.dev/mutated-by` record the engine writes when a rule changes an object.
//!
//! A rule becomes one JSONPatch expression: the record of the rule in `initium.dev/mutated-by`
//! when any mutation is going to change the object, then each mutation's operations, all
//! computed from the object as it came in ([`rule`]). That equals the engine's mutations
//! applied one after the other because the compiler only accepts rules whose mutations write
//! disjoint fields, none of them the record: a mutation then reads only its own fields and
//! whether their parents are present, and the only thing an earlier part of the expression can
//! change for it is that presence. [`Ctx`] carries it: a parent an earlier mutation writes under
//! is present afterwards whatever the object, and `metadata.annotations` is present after the
//! record whenever the rule changes the object. Whether a mutation changes the object is the
//! same computed from the object as it came in as after the earlier mutations: where an earlier
//! one created a parent of its field, the field was missing, and it changes the object either
//! way.

use serde_json::{Map, Value};

use crate::api::{MUTATED_BY_ANNOTATION, Mutation, MutationKind, Position, Upsert};

use super::NotCompiled;
use super::cel::{Path, literal, quote};
use super::schema::{KindSchema, Step as SchemaStep};

/// JSONPatch operations, some of them only under a condition on the object.
#[derive(Clone, Debug)]
enum Ops {
    List(Vec<String>),
    /// A CEL expression that is a list of operations.
    Expr(String),
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
            Ops::Expr(expr) => format!("({expr})"),
            Ops::When(test, then, _) if test == "true" => then.render(),
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

fn annotations() -> Path {
    Path(vec!["metadata".into(), "annotations".into()])
}

fn record_path() -> Path {
    annotations().child(MUTATED_BY_ANNOTATION)
}

/// What the compiler knows while it writes a rule's expression: the kinds it acts on, and what
/// the parts of the expression before the current one leave present.
pub(super) struct Ctx<'a> {
    kinds: &'a [&'static KindSchema],
    /// Parents the earlier mutations leave present, whatever the object.
    created: Vec<Path>,
    /// CEL true when the rule changes the object: then the record, first in the expression,
    /// leaves `metadata.annotations` present.
    changed: Option<String>,
    /// In a `forEach`: the list whose elements the paths are relative to.
    element: Option<Path>,
}

/// The CEL variables of a `forEach` element and its index.
const ELEMENT: &str = "el";
const INDEX: &str = "ix";

impl<'a> Ctx<'a> {
    pub(super) fn new(kinds: &'a [&'static KindSchema]) -> Ctx<'a> {
        Ctx {
            kinds,
            created: Vec::new(),
            changed: None,
            element: None,
        }
    }

    fn root(&self) -> &'static str {
        if self.element.is_some() {
            ELEMENT
        } else {
            "object"
        }
    }

    /// CEL true when `path` is present in the object (or element) as it came in.
    fn present(&self, path: &Path) -> String {
        path.present_from(self.root())
    }

    /// CEL that reads `path` (where [`Ctx::present`] holds).
    fn access(&self, path: &Path) -> String {
        path.access_from(self.root())
    }

    /// The JSON pointer of `path` as a CEL string expression.
    fn pointer(&self, path: &Path) -> String {
        match &self.element {
            None => quote(&path.pointer()),
            Some(list) if path.0.is_empty() => {
                format!("{} + \"/\" + string({INDEX})", quote(&list.pointer()))
            }
            Some(list) => format!(
                "{} + \"/\" + string({INDEX}) + {}",
                quote(&list.pointer()),
                quote(&path.pointer())
            ),
        }
    }

    fn op(&self, verb: &str, path: &Path, value: Option<&str>) -> String {
        op_at(verb, &self.pointer(path), value)
    }

    /// CEL true when the parent `path` is present where the current mutation's operations
    /// apply (after the earlier parts of the expression).
    fn parent_present(&self, path: &Path) -> String {
        if self.created.contains(path) {
            return "true".into();
        }
        match &self.changed {
            Some(changed) if self.element.is_none() && *path == annotations() => {
                format!("(({}) || {changed})", self.present(path))
            }
            _ => self.present(path),
        }
    }

    /// After a mutation that wrote `writes`: their parents are present.
    fn wrote(&mut self, writes: &[Path]) {
        for write in writes {
            for n in 1..write.0.len() {
                let parent = Path(write.0[..n].to_vec());
                if !self.created.contains(&parent) {
                    self.created.push(parent);
                }
            }
        }
    }

    /// Refuses a write the compiled rule cannot do exactly: a metadata field the API server
    /// fills in, the record, or a field one of the rule's kinds does not have (`value` is what
    /// is written there, checked to its leaves).
    fn check_write(&self, path: &Path, value: &Value, field: &str) -> Result<(), NotCompiled> {
        path.check()
            .map_err(|reason| NotCompiled::new(field, reason))?;
        if let Some(list) = &self.element {
            let mut steps: Vec<SchemaStep<'_>> =
                list.0.iter().map(|s| SchemaStep::Field(s)).collect();
            steps.push(SchemaStep::Element);
            steps.extend(path.0.iter().map(|s| SchemaStep::Field(s)));
            return self.check_value(&steps, value, field);
        }
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
        if path.related(&record_path()) {
            return Err(NotCompiled::new(
                field,
                format!("writes {MUTATED_BY_ANNOTATION}, which initium keeps"),
            ));
        }
        let steps: Vec<SchemaStep<'_>> = path.0.iter().map(|s| SchemaStep::Field(s)).collect();
        self.check_value(&steps, value, field)
    }

    /// Every leaf of `value`, written at `steps`, is a field of every kind.
    fn check_value(
        &self,
        steps: &[SchemaStep<'_>],
        value: &Value,
        field: &str,
    ) -> Result<(), NotCompiled> {
        match value {
            Value::Object(map) if !map.is_empty() => {
                for (key, item) in map {
                    let mut deeper = steps.to_vec();
                    deeper.push(SchemaStep::Field(key));
                    self.check_value(&deeper, item, field)?;
                }
                Ok(())
            }
            Value::Array(items) if !items.is_empty() => {
                let mut deeper = steps.to_vec();
                deeper.push(SchemaStep::Element);
                for item in items {
                    self.check_value(&deeper, item, field)?;
                }
                Ok(())
            }
            _ => {
                for kind in self.kinds {
                    kind.accepts(steps, value).map_err(|why| {
                        NotCompiled::new(
                            field,
                            format!(
                                "{} {why}; a compiled rule writes only fields its kinds have, with their types (the API server refuses an object a policy gave an unknown field, where it drops the field from a webhook's patch)",
                                kind.gvk.kind
                            ),
                        )
                    })?;
                }
                Ok(())
            }
        }
    }
}

/// RFC 7396 merge of `patch` (an object) into the object at `at`, which is present.
fn merge(
    at: &Path,
    patch: &Map<String, Value>,
    field: &str,
    writes: &mut Writes,
    ctx: &Ctx<'_>,
) -> Result<(Ops, Vec<String>), NotCompiled> {
    let mut ops = Vec::new();
    let mut changes = Vec::new();
    for (key, v) in patch {
        if key.contains("{{") {
            return Err(not_template(field));
        }
        let child = at.child(key);
        let here = format!("{field}.{key}");
        let present = ctx.present(&child);
        match v {
            Value::Null => {
                ctx.check_write(&child, v, &here)?;
                writes.push(child.clone());
                ops.push(Ops::When(
                    present.clone(),
                    Box::new(Ops::List(vec![ctx.op("remove", &child, None)])),
                    Box::new(Ops::none()),
                ));
                changes.push(format!("({present})"));
            }
            Value::Object(inner) => {
                child
                    .check()
                    .map_err(|reason| NotCompiled::new(&here, reason))?;
                let (deeper, deeper_changes) = merge(&child, inner, &here, writes, ctx)?;
                let added = value(v, &here, true)?;
                if inner.is_empty() {
                    ctx.check_write(&child, v, &here)?;
                    writes.push(child.clone());
                }
                ops.push(Ops::When(
                    ctx.parent_present(&child),
                    Box::new(deeper),
                    Box::new(Ops::List(vec![ctx.op("add", &child, Some(&added))])),
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
                ctx.check_write(&child, scalar, &here)?;
                writes.push(child.clone());
                let wanted = value(scalar, &here, false)?;
                ops.push(Ops::List(vec![ctx.op("add", &child, Some(&wanted))]));
                changes.push(format!(
                    "!({present} && {} == {wanted})",
                    ctx.access(&child)
                ));
            }
        }
    }
    Ok((Ops::All(ops), changes))
}

/// `defaults`: each field set only where the object lacks it.
fn defaults(
    at: &Path,
    wanted: &Map<String, Value>,
    field: &str,
    writes: &mut Writes,
    ctx: &Ctx<'_>,
) -> Result<(Ops, Vec<String>), NotCompiled> {
    let mut ops = Vec::new();
    let mut changes = Vec::new();
    for (key, v) in wanted {
        if key.contains("{{") {
            return Err(not_template(field));
        }
        let child = at.child(key);
        let here = format!("{field}.{key}");
        let present = ctx.present(&child);
        let added = value(v, &here, false)?;
        match v {
            Value::Object(inner) if !inner.is_empty() => {
                child
                    .check()
                    .map_err(|reason| NotCompiled::new(&here, reason))?;
                let (deeper, deeper_changes) = defaults(&child, inner, &here, writes, ctx)?;
                ops.push(Ops::When(
                    ctx.parent_present(&child),
                    Box::new(deeper),
                    Box::new(Ops::List(vec![ctx.op("add", &child, Some(&added))])),
                ));
                changes.push(format!("(!({present}) || {})", any(deeper_changes)));
            }
            _ => {
                ctx.check_write(&child, v, &here)?;
                writes.push(child.clone());
                ops.push(Ops::When(
                    present.clone(),
                    Box::new(Ops::none()),
                    Box::new(Ops::List(vec![ctx.op("add", &child, Some(&added))])),
                ));
                changes.push(format!("!({present})"));
            }
        }
    }
    Ok((Ops::All(ops), changes))
}

/// Adds `value` at `path`, creating the missing parents as objects (as the engine does).
fn add_creating(path: &Path, value: String, ctx: &Ctx<'_>) -> Ops {
    let mut ops = Ops::List(vec![ctx.op("add", path, Some(&value))]);
    let mut wrapped = value;
    let mut at = path.clone();
    // From the deepest parent up: where it is missing, add it holding what is below.
    while at.0.len() > 1 {
        let key = at.0.pop().unwrap_or_default();
        wrapped = format!("{{{}: {wrapped}}}", quote(&key));
        let parent = at.clone();
        ops = Ops::When(
            ctx.parent_present(&parent),
            Box::new(ops),
            Box::new(Ops::List(vec![ctx.op("add", &parent, Some(&wrapped))])),
        );
    }
    ops
}

fn upsert(
    spec: &Upsert,
    field: &str,
    writes: &mut Writes,
    ctx: &Ctx<'_>,
) -> Result<(Ops, String), NotCompiled> {
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
    let list = Value::Array(vec![spec.value.clone()]);
    ctx.check_write(&path, &list, &format!("{field}.path"))?;
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
    let list = ctx.access(&path);
    let element_key = Path(vec![spec.key.clone()]);
    let has_key = element_key.present_from("e");
    let key_of = element_key.access_from("e");
    // Where the key is found: `e` and the key only ever occur as generated here.
    let same = format!("({has_key} && {key_of} == {wanted_key})");
    let found = format!("{list}.exists(e, {same})");
    let index = format!("{list}.map(e, {same}).indexOf(true)");
    let pointer = ctx.pointer(&path);
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
    let present = ctx.present(&path);
    let ops = Ops::When(
        present.clone(),
        Box::new(Ops::When(
            found.clone(),
            Box::new(replace),
            Box::new(Ops::List(vec![insert])),
        )),
        Box::new(add_creating(&path, format!("[{element}]"), ctx)),
    );
    let changes = format!("!(({present}) && {found} && {list}[{index}] == {element})");
    Ok((ops, changes))
}

/// What one mutation compiles to.
struct Compiled {
    ops: Ops,
    /// CEL true when the mutation will change the object, from the object as it came in.
    changes: String,
    /// Whether the parents of what it writes are present afterwards, whatever the object (a
    /// `forEach` creates nothing when its list is missing).
    creates_parents: bool,
}

/// Each mutation's kind with its field (`spec.mutations[i]`), or the first that sets none.
fn kinds_of<'m>(
    kinds: impl Iterator<Item = Option<MutationKind<'m>>>,
    at: &str,
) -> Result<Vec<(String, MutationKind<'m>)>, NotCompiled> {
    kinds
        .enumerate()
        .map(|(i, kind)| {
            let field = format!("{at}[{i}]");
            match kind {
                Some(kind) => Ok((field, kind)),
                None => Err(NotCompiled::new(field, "sets no mutation")),
            }
        })
        .collect()
}

/// The first pass over a rule's (or a `forEach` element's) mutations: whether each changes
/// the object as it came in, and that they write apart (`whose` names the list in the
/// reason). Returns the changes and every write.
fn changes_apart(
    steps: &[(String, MutationKind<'_>)],
    whose: &str,
    ctx: &Ctx<'_>,
) -> Result<(Vec<String>, Writes), NotCompiled> {
    let mut writes: Writes = Vec::new();
    let mut changes = Vec::new();
    for (field, kind) in steps {
        let before = writes.len();
        let compiled = step_kind(*kind, field, &mut writes, ctx)?;
        let (earlier, mine) = writes.split_at(before);
        if let Some(clash) = mine.iter().find(|w| earlier.iter().any(|e| e.related(w))) {
            return Err(NotCompiled::new(
                field,
                format!(
                    "writes {} which an earlier mutation of the {whose} writes too; mutations of a compiled rule must write apart",
                    clash.pointer()
                ),
            ));
        }
        changes.push(format!("({})", compiled.changes));
    }
    Ok((changes, writes))
}

/// The second pass: each mutation's operations, after the parents the earlier ones leave
/// present.
fn operations(
    steps: &[(String, MutationKind<'_>)],
    ctx: &mut Ctx<'_>,
) -> Result<Vec<Ops>, NotCompiled> {
    let mut writes: Writes = Vec::new();
    let mut parts = Vec::new();
    for (field, kind) in steps {
        let before = writes.len();
        let compiled = step_kind(*kind, field, &mut writes, ctx)?;
        if compiled.creates_parents {
            ctx.wrote(&writes[before..]);
        }
        parts.push(compiled.ops);
    }
    Ok(parts)
}

/// One mutation, of a rule or of a `forEach` element (`ctx` says which).
fn step_kind(
    kind: MutationKind<'_>,
    field: &str,
    writes: &mut Writes,
    ctx: &Ctx<'_>,
) -> Result<Compiled, NotCompiled> {
    let root = Path(Vec::new());
    let (ops, changes) = match kind {
        MutationKind::Merge(patch) => {
            let Some(map) = patch.as_object() else {
                return Err(NotCompiled::new(
                    format!("{field}.merge"),
                    "is not an object",
                ));
            };
            let (ops, changes) = merge(&root, map, &format!("{field}.merge"), writes, ctx)?;
            (ops, any(changes))
        }
        MutationKind::Defaults(wanted) => {
            let Some(map) = wanted.as_object() else {
                return Err(NotCompiled::new(
                    format!("{field}.defaults"),
                    "is not an object",
                ));
            };
            let (ops, changes) = defaults(&root, map, &format!("{field}.defaults"), writes, ctx)?;
            (ops, any(changes))
        }
        MutationKind::Upsert(spec) => upsert(spec, &format!("{field}.upsert"), writes, ctx)?,
        MutationKind::Patch(operations) => {
            let merged = patch_as_merge(operations, &format!("{field}.patch"))?;
            let (ops, changes) = merge(&root, &merged, &format!("{field}.patch"), writes, ctx)?;
            (ops, any(changes))
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
        MutationKind::ForEach { query, mutations } => {
            if ctx.element.is_some() {
                return Err(NotCompiled::new(
                    format!("{field}.forEach"),
                    "a forEach cannot nest",
                ));
            }
            let (ops, changes) = for_each(query, mutations.unwrap_or(&[]), field, writes, ctx)?;
            return Ok(Compiled {
                ops,
                changes,
                creates_parents: false,
            });
        }
    };
    Ok(Compiled {
        ops,
        changes,
        creates_parents: true,
    })
}

/// A `patch` made only of `add`s of strings, numbers and booleans to fields, as the merge
/// patch that does the same: the engine's `add` sets the field, creating missing parents as
/// objects, as a merge does (the schemas decide that no step is into a list). An `add` of an
/// object or list replaces what is there, which a merge does not; the other operations fail
/// the rule where the field is missing, which a policy does differently.
fn patch_as_merge(
    operations: &[crate::api::PatchOperation],
    field: &str,
) -> Result<Map<String, Value>, NotCompiled> {
    let mut merged = Map::new();
    for (i, operation) in operations.iter().enumerate() {
        let at = format!("{field}[{i}]");
        if operation.op != crate::api::PatchOp::Add || operation.from.is_some() {
            return Err(NotCompiled::new(
                format!("{at}.op"),
                "only `add` is compiled: the other operations fail the rule where a field is missing, which a policy's patch does differently",
            ));
        }
        let value = match &operation.value {
            Some(v @ (Value::String(_) | Value::Number(_) | Value::Bool(_))) => v.clone(),
            _ => {
                return Err(NotCompiled::new(
                    format!("{at}.value"),
                    "only an `add` of a string, number or boolean is compiled: an object or list replaces what is there, and null sets a null",
                ));
            }
        };
        let tokens: Vec<String> = crate::path::Pointer::parse(&operation.path)
            .map_err(|e| NotCompiled::new(format!("{at}.path"), e.to_string()))?
            .tokens()
            .map(|(t, _)| t.into_owned())
            .collect();
        let Some((last, parents)) = tokens.split_last() else {
            return Err(NotCompiled::new(
                format!("{at}.path"),
                "an `add` of the whole object is not compiled",
            ));
        };
        let mut map = &mut merged;
        for token in parents {
            let next = map
                .entry(token.clone())
                .or_insert_with(|| Value::Object(Map::new()));
            let Value::Object(inner) = next else {
                return Err(related_add(&at));
            };
            map = inner;
        }
        if map.contains_key(last) {
            return Err(related_add(&at));
        }
        map.insert(last.clone(), value);
    }
    Ok(merged)
}

fn related_add(at: &str) -> NotCompiled {
    NotCompiled::new(
        format!("{at}.path"),
        "writes where an earlier operation of the patch writes; not compiled",
    )
}

/// The lists a `forEach` query selects every element of: `$.a.b[*]`, or a union of lists
/// under one parent, `$.spec['containers','initContainers'][*]`; `None` for anything else
/// (filters, recursive descent, slices, ...).
fn for_each_lists(query: &str) -> Option<Vec<Path>> {
    let rest = query.trim().strip_suffix("[*]")?;
    if let Some(open) = rest.rfind('[')
        && rest.ends_with(']')
        && rest[open..].contains(',')
    {
        let parent = if &rest[..open] == "$" {
            Path(Vec::new())
        } else {
            super::simple_path(&rest[..open])?
        };
        let mut names = Vec::new();
        for part in rest[open + 1..rest.len() - 1].split(',') {
            let part = part.trim();
            let quote = part.chars().next().filter(|c| *c == '\'' || *c == '"')?;
            let name = part.strip_prefix(quote)?.strip_suffix(quote)?;
            if name.is_empty() || name.contains(['\\', '\'', '"']) {
                return None;
            }
            names.push(parent.child(name));
        }
        return Some(names);
    }
    Some(vec![super::simple_path(rest)?])
}

/// `forEach` over every element of the selected lists: each element's mutations, computed
/// from the element as it came in, the same way a rule's are from the object. The elements
/// are apart from one another, and from the rule's other mutations (their writes are checked
/// with the element as `*`).
fn for_each(
    query: &str,
    mutations: &[crate::api::ElementMutation],
    field: &str,
    writes: &mut Writes,
    ctx: &Ctx<'_>,
) -> Result<(Ops, String), NotCompiled> {
    let here = format!("{field}.forEach");
    let lists = for_each_lists(query).ok_or_else(|| {
        NotCompiled::new(
            &here,
            "only a JSONPath that selects every element of lists by name ($.spec.containers[*], $.spec['containers','initContainers'][*]) is compiled; filters and other selectors are not",
        )
    })?;
    if mutations.is_empty() {
        return Err(NotCompiled::new(
            format!("{field}.mutations"),
            "there are no mutations",
        ));
    }
    let mut parts = Vec::new();
    let mut changes = Vec::new();
    for list in &lists {
        list.check()
            .map_err(|reason| NotCompiled::new(&here, reason))?;
        let mut steps: Vec<SchemaStep<'_>> = list.0.iter().map(|s| SchemaStep::Field(s)).collect();
        steps.push(SchemaStep::Element);
        for kind in ctx.kinds {
            kind.check(&steps).map_err(|why| {
                NotCompiled::new(
                    &here,
                    format!(
                        "{} {why}; a compiled forEach walks lists the kinds have",
                        kind.gvk.kind
                    ),
                )
            })?;
        }
        let mut inner = Ctx {
            kinds: ctx.kinds,
            created: Vec::new(),
            changed: None,
            element: Some(list.clone()),
        };
        let steps = kinds_of(
            mutations.iter().map(|m| m.kinds().next()),
            &format!("{field}.mutations"),
        )?;
        // First whether an element changes, and that the element's mutations write apart.
        let (element_changes, mine) = changes_apart(&steps, "forEach", &inner)?;
        // Then the element's operations, each after what the earlier ones leave.
        let element_ops = operations(&steps, &mut inner)?;
        for write in mine {
            let mut path = list.clone();
            path.0.push("*".into());
            path.0.extend(write.0);
            writes.push(path);
        }
        let present = ctx.present(list);
        let access = ctx.access(list);
        parts.push(Ops::When(
            present.clone(),
            Box::new(Ops::Expr(format!(
                "{access}.transformList({INDEX}, {ELEMENT}, {}).flatten()",
                Ops::All(element_ops).render()
            ))),
            Box::new(Ops::none()),
        ));
        changes.push(format!(
            "(({present}) && {access}.exists({ELEMENT}, {}))",
            any(element_changes)
        ));
    }
    Ok((Ops::All(parts), any(changes)))
}

fn any(changes: Vec<String>) -> String {
    if changes.is_empty() {
        "false".into()
    } else {
        changes.join(" || ")
    }
}

/// A compiled rule's mutations.
pub(super) struct RuleExpression {
    /// CEL true when the rule changes the object: the policy's variable [`CHANGED`].
    pub(super) changed: String,
    /// The JSONPatch expression.
    pub(super) patch: String,
}

/// The policy variable that holds whether the rule changes the object (evaluated once, on the
/// object as it came in, however often the expression reads it).
pub(super) const CHANGED: &str = "changed";

/// A rule's mutations (`spec.mutations`) as one JSONPatch expression that records `written`
/// (the rule as `initium.dev/mutated-by` names it) when the rule changes the object, for a
/// rule acting on `kinds`.
pub(super) fn rule(
    mutations: &[Mutation],
    written: &str,
    kinds: &[&'static KindSchema],
) -> Result<RuleExpression, NotCompiled> {
    let steps = kinds_of(mutations.iter().map(|m| m.kinds().next()), "spec.mutations")?;
    // First, whether the rule changes the object, and that its mutations write apart.
    let mut ctx = Ctx::new(kinds);
    let (changes, _) = changes_apart(&steps, "rule", &ctx)?;
    let changed = any(changes);
    // Then the expression: the record, and each mutation after what the earlier ones leave.
    let variable = format!("variables.{CHANGED}");
    ctx.changed = Some(variable.clone());
    let mut parts = vec![record(written, &variable)];
    parts.extend(operations(&steps, &mut ctx)?);
    Ok(RuleExpression {
        changed,
        patch: Ops::All(parts).render(),
    })
}

/// The operations that record `written` when `changes` holds: appended to the list unless
/// listed, the list written back trimmed and without empty entries, as the engine writes it.
fn record(written: &str, changes: &str) -> Ops {
    let annotations = annotations();
    let record = record_path();
    let listed = format!(
        "({} ? {}.split(\",\").map(s, s.trim()).filter(s, s != \"\") : [])",
        record.present(),
        record.access()
    );
    let name = quote(written);
    let list =
        format!("({listed}.exists(s, s == {name}) ? {listed} : {listed} + [{name}]).join(\",\")");
    Ops::When(
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
    )
}
