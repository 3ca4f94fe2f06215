//! Change tracking without copying the object.
//!
//! A rule records, before each change, the prior value of the part of the object it is about
//! to touch (`Journal`). That is enough to undo a failed rule (atomicity), to tell whether
//! the rule changed anything, and, gathered over all rules (`Changes`), to produce the
//! RFC 6902 patch from the original object by diffing only the touched parts.

use std::collections::BTreeSet;

use json_patch::jsonptr::PointerBuf;
use json_patch::{AddOperation, PatchOperation, RemoveOperation, ReplaceOperation};
use serde_json::Value;

use super::json_out;
use super::path::{Pointer, Resolver, lookup};

/// Prior values of the parts a rule touched, in the order it touched them.
#[derive(Default, Debug)]
pub(crate) struct Journal {
    entries: Vec<(Pointer, Option<Value>)>,
    index: PointerIndex,
    /// Some part was recorded before an operation that may leave it as it was (`touch`),
    /// so `changed` has to compare.
    inexact: bool,
}

impl Journal {
    /// Records what is at `pointer` before it changes. Where the pointer does not exist
    /// yet, records that its first missing step is absent (so parents created on the way are
    /// undone too); where that step is a list index, records the whole list.
    pub fn touch(&mut self, doc: &Value, pointer: &Pointer) {
        self.touch_in(doc, &Pointer::root(), pointer);
    }

    /// `touch` for `pointer` relative to `target`, the value at `base`.
    pub fn touch_in(&mut self, target: &Value, base: &Pointer, pointer: &Pointer) {
        self.inexact = true;
        let mut current = target;
        let mut before = 0;
        let mut recorded: Option<(Pointer, Option<&Value>)> = None;
        for (token, end) in pointer.tokens() {
            let next = match current {
                Value::Object(map) => map.get(token.as_ref()),
                Value::Array(items) => token.parse::<usize>().ok().and_then(|i| items.get(i)),
                _ => None,
            };
            match next {
                Some(v) => {
                    current = v;
                    before = end;
                }
                None => {
                    recorded = Some(match current {
                        Value::Object(_) => (pointer.prefix(end), None),
                        // An append: undone by removing the new last element.
                        Value::Array(items) if token.parse::<usize>() == Ok(items.len()) => {
                            (pointer.prefix(end), None)
                        }
                        _ => (pointer.prefix(before), Some(current)),
                    });
                    break;
                }
            }
        }
        let (relative, prior) = recorded.unwrap_or_else(|| (pointer.clone(), Some(current)));
        self.record(base.join(&relative), prior);
    }

    /// Records the prior value at `pointer`, which the caller has looked up and is about to
    /// change (`None`: absent, its parent an object, or the next index of a list).
    pub fn record(&mut self, pointer: Pointer, prior: Option<&Value>) {
        self.record_with(pointer, || prior.cloned());
    }

    /// [`Journal::record`] for a caller that builds the prior value (only when it is needed).
    pub fn record_with(&mut self, pointer: Pointer, prior: impl FnOnce() -> Option<Value>) {
        if self.index.covers(&self.entries, &pointer) {
            return;
        }
        self.index.insert(&self.entries, &pointer);
        self.entries.push((pointer, prior()));
    }

    /// Every part the rule touched: nothing outside them changed.
    pub fn touched(&self) -> impl Iterator<Item = &Pointer> {
        self.entries.iter().map(|(pointer, _)| pointer)
    }

    /// True when some touched part differs from what it was.
    pub fn changed(&self, doc: &Value) -> bool {
        if !self.inexact {
            return !self.entries.is_empty();
        }
        self.entries
            .iter()
            .any(|(p, prior)| p.get(doc) != prior.as_ref())
    }

    /// When the value at `pointer` differs from what it was before the rule touched it, what
    /// it was (`None`: absent).
    pub fn changed_at(&self, doc: &Value, pointer: &Pointer) -> Option<Option<Value>> {
        for (p, prior) in &self.entries {
            if p.contains(pointer) {
                let before = prior.as_ref().and_then(|v| p.relative(pointer).get(v));
                let now = pointer.get(doc);
                return (before != now).then(|| before.cloned());
            }
        }
        // A part inside it changed (it was a list or object, which the API server refuses
        // anyway): compare nothing, report that it changed.
        self.entries
            .iter()
            .any(|(p, _)| pointer.contains(p))
            .then_some(None)
    }

    /// What the rule changed, as RFC 6902 operations from the object before the rule to
    /// `doc` (with their values): what an Audit rule reports before it is undone.
    pub fn preview(&self, doc: &Value) -> Vec<PatchOperation> {
        let mut changes = Changes::default();
        changes.absorb(Journal {
            entries: self.entries.clone(),
            index: PointerIndex::default(),
            inexact: self.inexact,
        });
        changes
            .patch(doc)
            .iter()
            .map(|op| op.to_operation(doc))
            .collect()
    }

    /// Puts every touched part back, newest first.
    pub fn rollback(self, doc: &mut Value) {
        for (pointer, prior) in self.entries.into_iter().rev() {
            pointer.set(doc, prior);
        }
    }
}

/// The original values of every part changed by any successful rule, as disjoint subtrees.
#[derive(Default, Debug)]
pub(crate) struct Changes {
    entries: Vec<(Pointer, Option<Value>)>,
    index: PointerIndex,
}

impl Changes {
    /// Takes in a successful rule's journal. A part already known keeps its older original;
    /// a part that contains known parts gets their originals put back into its own.
    pub fn absorb(&mut self, journal: Journal) {
        if self.entries.capacity() == 0 {
            self.entries.reserve(16);
        }
        for (pointer, mut prior) in journal.entries {
            if self.index.covers(&self.entries, &pointer) {
                continue;
            }
            if self.index.has_below(&self.entries, &pointer) {
                let mut kept = Vec::with_capacity(self.entries.len());
                for (inner, inner_prior) in std::mem::take(&mut self.entries) {
                    if pointer.contains(&inner) {
                        if let Some(value) = prior.as_mut() {
                            pointer.relative(&inner).set(value, inner_prior);
                        }
                    } else {
                        kept.push((inner, inner_prior));
                    }
                }
                self.entries = kept;
                self.index.rebuild(&self.entries);
            }
            self.index.insert(&self.entries, &pointer);
            self.entries.push((pointer, prior));
        }
    }

    /// Nothing was recorded: the patch is empty.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Replaces the original at `pointer` (inside whichever recorded part holds it).
    pub fn set_original(&mut self, pointer: &Pointer, value: Option<Value>) {
        for (p, prior) in &mut self.entries {
            if p.contains(pointer) {
                if p == pointer {
                    *prior = value;
                } else if let Some(v) = prior.as_mut() {
                    p.relative(pointer).set(v, value);
                }
                return;
            }
        }
    }

    /// The RFC 6902 operations that turn the original into `doc`; their values are read
    /// from `doc` when the patch is written.
    pub fn patch(&self, doc: &Value) -> Vec<PatchOp> {
        let mut ops = Vec::with_capacity(self.entries.len() + 4);
        self.diff_into(doc, &mut ops);
        ops
    }

    /// [`Changes::patch`], and the patch written as JSON into `out` as its operations are
    /// found: the diff holds each value it adds or replaces, where writing the patch later
    /// looks every one up again from the root.
    pub fn patch_written(
        &self,
        doc: &Value,
        out: &mut Vec<u8>,
    ) -> serde_json::Result<Vec<PatchOp>> {
        let mut written = Written {
            ops: Vec::with_capacity(self.entries.len() + 4),
            out,
            error: None,
        };
        written.out.push(b'[');
        self.diff_into(doc, &mut written);
        if let Some(error) = written.error {
            return Err(error);
        }
        written.out.push(b']');
        Ok(written.ops)
    }

    fn diff_into(&self, doc: &Value, ops: &mut impl Ops) {
        let mut resolver = Resolver::new(doc);
        let mut path = String::with_capacity(128);
        for (pointer, prior) in &self.entries {
            path.clear();
            path.push_str(pointer.as_str());
            diff(
                prior.as_ref(),
                resolver.get(pointer.as_str()),
                &mut path,
                ops,
            );
        }
    }
}

/// Where [`diff`] puts the operations it finds, each with the value it adds or replaces.
pub(crate) trait Ops {
    fn push(&mut self, op: PatchOp, value: Option<&Value>);
}

impl Ops for Vec<PatchOp> {
    fn push(&mut self, op: PatchOp, _: Option<&Value>) {
        Vec::push(self, op);
    }
}

/// The operations, and the patch's JSON written as they come.
struct Written<'o> {
    ops: Vec<PatchOp>,
    out: &'o mut Vec<u8>,
    /// The first error writing (none is expected: values are JSON, the output is memory).
    error: Option<serde_json::Error>,
}

impl Ops for Written<'_> {
    fn push(&mut self, op: PatchOp, value: Option<&Value>) {
        if self.error.is_none()
            && let Err(e) = write_op(self.out, !self.ops.is_empty(), &op, value)
        {
            self.error = Some(e);
        }
        self.ops.push(op);
    }
}

/// Answers "does a recorded part hold this pointer?" and "does this pointer hold a recorded
/// part?" for a list of recorded parts. A rule that touches a few parts (nearly all of them)
/// is answered by scanning the list; past [`INDEX_FROM`] parts (a `forEach` over thousands of
/// containers) a sorted set of the pointers answers in O(depth · log n), so recording stays
/// linear in the number of parts instead of quadratic.
#[derive(Default, Debug)]
struct PointerIndex {
    set: Option<BTreeSet<String>>,
}

/// Recorded parts from which the index is kept.
const INDEX_FROM: usize = 64;

impl PointerIndex {
    /// Called before `pointer` is pushed onto `entries`.
    fn insert(&mut self, entries: &[(Pointer, Option<Value>)], pointer: &Pointer) {
        match &mut self.set {
            Some(set) => {
                set.insert(pointer.as_str().to_string());
            }
            None if entries.len() + 1 >= INDEX_FROM => {
                let mut set: BTreeSet<String> = entries
                    .iter()
                    .map(|(p, _)| p.as_str().to_string())
                    .collect();
                set.insert(pointer.as_str().to_string());
                self.set = Some(set);
            }
            None => {}
        }
    }

    fn rebuild(&mut self, entries: &[(Pointer, Option<Value>)]) {
        self.set = None;
        if entries.len() >= INDEX_FROM {
            self.set = Some(
                entries
                    .iter()
                    .map(|(p, _)| p.as_str().to_string())
                    .collect(),
            );
        }
    }

    /// Some recorded part is `pointer` or one of its ancestors.
    fn covers(&self, entries: &[(Pointer, Option<Value>)], pointer: &Pointer) -> bool {
        let Some(set) = &self.set else {
            return entries.iter().any(|(p, _)| p.contains(pointer));
        };
        let text = pointer.as_str();
        set.contains("")
            || text
                .char_indices()
                .filter(|&(i, c)| c == '/' && i > 0)
                .any(|(i, _)| set.contains(&text[..i]))
            || set.contains(text)
    }

    /// Some recorded part lies strictly below `pointer`.
    fn has_below(&self, entries: &[(Pointer, Option<Value>)], pointer: &Pointer) -> bool {
        let Some(set) = &self.set else {
            return entries
                .iter()
                .any(|(p, _)| pointer.contains(p) && p != pointer);
        };
        let prefix = format!("{}/", pointer.as_str());
        set.range(prefix.clone()..)
            .next()
            .is_some_and(|k| k.starts_with(&prefix))
    }
}

/// One operation of the patch. `Add` and `Replace` take the value at `path` in the final
/// object, so the operations hold no copies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PatchOp {
    Add(String),
    Remove(String),
    Replace(String),
}

impl PatchOp {
    pub fn path(&self) -> &str {
        match self {
            PatchOp::Add(p) | PatchOp::Remove(p) | PatchOp::Replace(p) => p,
        }
    }

    fn name(&self) -> &'static str {
        match self {
            PatchOp::Add(_) => "add",
            PatchOp::Remove(_) => "remove",
            PatchOp::Replace(_) => "replace",
        }
    }

    /// The operation as a `json_patch` value (copies the value out of `doc`).
    pub fn to_operation(&self, doc: &Value) -> PatchOperation {
        // Paths are built from valid tokens, so parsing cannot fail; fall back to the root
        // rather than panic.
        let path = PointerBuf::parse(self.path()).unwrap_or_default();
        let value = || lookup(doc, self.path()).cloned().unwrap_or(Value::Null);
        match self {
            PatchOp::Add(_) => PatchOperation::Add(AddOperation {
                path,
                value: value(),
            }),
            PatchOp::Remove(_) => PatchOperation::Remove(RemoveOperation { path }),
            PatchOp::Replace(_) => PatchOperation::Replace(ReplaceOperation {
                path,
                value: value(),
            }),
        }
    }
}

/// Writes the operations as an RFC 6902 JSON document, values straight from `doc`.
pub fn write_patch(ops: &[PatchOp], doc: &Value, out: &mut Vec<u8>) -> serde_json::Result<()> {
    let mut resolver = Resolver::new(doc);
    out.push(b'[');
    for (i, op) in ops.iter().enumerate() {
        let value = match op {
            PatchOp::Remove(_) => None,
            _ => Some(resolver.get(op.path()).unwrap_or(&Value::Null)),
        };
        write_op(out, i > 0, op, value)?;
    }
    out.push(b']');
    Ok(())
}

/// One operation of a patch's JSON (after a comma when it is not the first); `value` is what
/// an `add` or `replace` puts (`null` when missing).
fn write_op(
    out: &mut Vec<u8>,
    after_another: bool,
    op: &PatchOp,
    value: Option<&Value>,
) -> serde_json::Result<()> {
    if after_another {
        out.push(b',');
    }
    out.extend_from_slice(b"{\"op\":\"");
    out.extend_from_slice(op.name().as_bytes());
    out.extend_from_slice(b"\",\"path\":");
    json_out::string(out, op.path());
    if !matches!(op, PatchOp::Remove(_)) {
        out.extend_from_slice(b",\"value\":");
        json_out::value(out, value.unwrap_or(&Value::Null))?;
    }
    out.push(b'}');
    Ok(())
}

/// A small, deterministic structural diff: objects key by key, lists element by element
/// (then appends or removals at the end), anything else replaced.
pub(crate) fn diff(
    before: Option<&Value>,
    after: Option<&Value>,
    path: &mut String,
    ops: &mut impl Ops,
) {
    match (before, after) {
        (None, None) => {}
        (None, Some(a)) => ops.push(PatchOp::Add(path.clone()), Some(a)),
        (Some(_), None) => ops.push(PatchOp::Remove(path.clone()), None),
        (Some(b), Some(a)) if b == a => {}
        (Some(Value::Object(b)), Some(Value::Object(a))) => {
            let len = path.len();
            for key in b.keys().filter(|k| !a.contains_key(*k)) {
                push_token(path, key);
                ops.push(PatchOp::Remove(path.clone()), None);
                path.truncate(len);
            }
            for (key, value) in a {
                push_token(path, key);
                diff(b.get(key), Some(value), path, ops);
                path.truncate(len);
            }
        }
        (Some(Value::Array(b)), Some(Value::Array(a))) => {
            let len = path.len();
            // Elements taken out of a list (the `remove` mutation): said as the removals,
            // not as every later element replaced by the one after it.
            if let Some(removed) = removed_elements(b, a) {
                for i in removed.into_iter().rev() {
                    push_index(path, i);
                    ops.push(PatchOp::Remove(path.clone()), None);
                    path.truncate(len);
                }
                return;
            }
            for i in 0..b.len().min(a.len()) {
                push_index(path, i);
                diff(Some(&b[i]), Some(&a[i]), path, ops);
                path.truncate(len);
            }
            for (i, value) in a.iter().enumerate().skip(b.len()) {
                push_index(path, i);
                ops.push(PatchOp::Add(path.clone()), Some(value));
                path.truncate(len);
            }
            for i in (a.len()..b.len()).rev() {
                push_index(path, i);
                ops.push(PatchOp::Remove(path.clone()), None);
                path.truncate(len);
            }
        }
        (Some(_), Some(a)) => ops.push(PatchOp::Replace(path.clone()), Some(a)),
    }
}

/// The indexes of `before` whose removal leaves `after`, when `after` is `before` with some
/// elements taken out (and nothing else changed).
fn removed_elements(before: &[Value], after: &[Value]) -> Option<Vec<usize>> {
    if after.len() >= before.len() {
        return None;
    }
    let mut removed = Vec::with_capacity(before.len() - after.len());
    let mut kept = after.iter().peekable();
    for (i, value) in before.iter().enumerate() {
        if kept.peek() == Some(&value) {
            kept.next();
        } else {
            removed.push(i);
        }
    }
    (kept.peek().is_none() && removed.len() == before.len() - after.len()).then_some(removed)
}

fn push_index(path: &mut String, i: usize) {
    path.push('/');
    super::path::push_index(path, i);
}

fn push_token(path: &mut String, token: &str) {
    path.push('/');
    path.push_str(&super::path::escape(token));
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use serde_json::json;

    fn p(s: &str) -> Pointer {
        Pointer::parse(s).unwrap()
    }

    #[test]
    fn rollback_restores_touched_parts_including_created_parents() {
        let original = json!({"metadata": {"name": "a"}, "spec": {"list": [1, 2]}});
        let mut doc = original.clone();
        let mut j = Journal::default();
        j.touch(&doc, &p("/metadata/annotations/x"));
        p("/metadata/annotations").set(&mut doc, Some(json!({"x": "1"})));
        j.touch(&doc, &p("/spec/list/5"));
        if let Some(Value::Array(l)) = p("/spec/list").get_mut(&mut doc) {
            l.push(json!(3));
        }
        j.touch(&doc, &p("/spec"));
        p("/spec/other").set(&mut doc, Some(json!(true)));
        assert!(j.changed(&doc));
        j.rollback(&mut doc);
        assert_eq!(doc, original);
    }

    #[test]
    fn changes_give_the_patch_from_the_original() {
        let original =
            json!({"metadata": {"labels": {"a": "1"}}, "spec": {"c": [{"n": 1}], "d": 1}});
        let mut doc = original.clone();
        let mut changes = Changes::default();
        // Rule 1 touches a label, rule 2 the whole metadata (which holds rule 1's change).
        let mut j = Journal::default();
        j.touch(&doc, &p("/metadata/labels/b"));
        p("/metadata/labels/b").set(&mut doc, Some(json!("2")));
        changes.absorb(j);
        let mut j = Journal::default();
        j.touch(&doc, &p("/metadata"));
        p("/metadata/annotations").set(&mut doc, Some(json!({"x": "y"})));
        j.touch(&doc, &p("/spec/c/0/n"));
        p("/spec/c/0/n").set(&mut doc, Some(json!(2)));
        j.touch(&doc, &p("/spec/d"));
        p("/spec/d").set(&mut doc, None);
        changes.absorb(j);
        let ops: Vec<PatchOperation> = changes
            .patch(&doc)
            .iter()
            .map(|op| op.to_operation(&doc))
            .collect();
        let mut patched = original.clone();
        json_patch::patch(&mut patched, &ops).unwrap();
        assert_eq!(patched, doc);
        assert_eq!(ops.len(), 4, "{ops:?}");
        // Written as the diff finds them: the same operations, the same JSON as written from
        // the object afterwards.
        let mut written = Vec::new();
        let found = changes.patch_written(&doc, &mut written).unwrap();
        assert_eq!(found, changes.patch(&doc));
        let mut afterwards = Vec::new();
        write_patch(&found, &doc, &mut afterwards).unwrap();
        assert_eq!(String::from_utf8(written), String::from_utf8(afterwards));
    }

    fn changes_ops(b: &Value, a: &Value) -> Vec<PatchOp> {
        let mut ops = Vec::new();
        diff(Some(b), Some(a), &mut String::new(), &mut ops);
        ops
    }

    #[test]
    fn diff_handles_lists_growing_and_shrinking() {
        for (b, a) in [
            (json!([1, 2, 3]), json!([1, 5])),
            (json!([1]), json!([1, {"x": 1}, 3])),
            (
                json!({"a": [1, {"b": 2}]}),
                json!({"a": [1, {"b": 3, "c": 4}], "z": null}),
            ),
            (json!("x"), json!({"y": 1})),
            (json!([1, 2, 3, 4]), json!([2, 4])),
            (json!([1, 2, 2, 3]), json!([2])),
        ] {
            let mut ops = Vec::new();
            diff(Some(&b), Some(&a), &mut String::new(), &mut ops);
            let ops: Vec<PatchOperation> = ops.iter().map(|op| op.to_operation(&a)).collect();
            let mut patched = b.clone();
            json_patch::patch(&mut patched, &ops).unwrap();
            let mut written = Vec::new();
            write_patch(&changes_ops(&b, &a), &a, &mut written).unwrap();
            let reparsed: json_patch::Patch = serde_json::from_slice(&written).unwrap();
            assert_eq!(reparsed.0, ops);
            // The same JSON when written as the diff goes.
            let mut as_found = Written {
                ops: Vec::new(),
                out: &mut Vec::new(),
                error: None,
            };
            as_found.out.push(b'[');
            diff(Some(&b), Some(&a), &mut String::new(), &mut as_found);
            as_found.out.push(b']');
            assert_eq!(*as_found.out, written, "{b} -> {a}");
            assert_eq!(patched, a);
        }
    }
}
