//! `patch`: RFC 6902 operations, for power users. Unlike plain RFC 6902, `add`, `copy` and
//! `move` create missing parent objects.

use json_patch::jsonptr::PointerBuf;
use json_patch::{
    AddOperation, CopyOperation, MoveOperation, PatchOperation, RemoveOperation, ReplaceOperation,
    TestOperation,
};
use serde_json::Value;

use crate::api::{self, PatchOp};
use crate::journal::Journal;
use crate::limits::{MAX_DEPTH, Meter, Size, measure};
use crate::path::Pointer;
use crate::stop::Stop;
use crate::template::Template;

use super::{Compiler, MutationError, Rendered, Site, count_write};

#[derive(Clone, Debug)]
pub(crate) struct Patch {
    steps: Vec<PatchStep>,
}

#[derive(Clone, Debug)]
struct PatchStep {
    op: PatchOp,
    path: Pointer,
    /// The last token of `path`, decoded (`None` for the root).
    last: Option<String>,
    path_buf: PointerBuf,
    from: Option<PointerBuf>,
    from_pointer: Option<Pointer>,
    value: Option<Template>,
}

pub(super) fn compile(ops: &[api::PatchOperation], at: &str, cx: &mut Compiler) -> Option<Patch> {
    if ops.is_empty() {
        cx.push(format!("{at}.patch"), "needs at least one operation");
        return None;
    }
    let before = cx.error_count();
    let mut steps = Vec::new();
    for (i, op) in ops.iter().enumerate() {
        let at = format!("{at}.patch[{i}]");
        let path = cx.pointer(&op.path, &format!("{at}.path"));
        let from = match (&op.op, &op.from) {
            (PatchOp::Move | PatchOp::Copy, Some(f)) => cx.pointer(f, &format!("{at}.from")),
            (PatchOp::Move | PatchOp::Copy, None) => {
                cx.push(
                    format!("{at}.from"),
                    format!("{:?} needs from", op.op).to_lowercase(),
                );
                None
            }
            (_, Some(_)) => {
                cx.push(format!("{at}.from"), "only move and copy take from");
                None
            }
            (_, None) => None,
        };
        let value = match (&op.op, &op.value) {
            (PatchOp::Add | PatchOp::Replace | PatchOp::Test, Some(v)) => {
                cx.template(v, &format!("{at}.value"))
            }
            (PatchOp::Add | PatchOp::Replace | PatchOp::Test, None) => {
                cx.push(
                    format!("{at}.value"),
                    format!("{:?} needs a value", op.op).to_lowercase(),
                );
                None
            }
            (_, Some(_)) => {
                cx.push(
                    format!("{at}.value"),
                    "only add, replace and test take a value",
                );
                None
            }
            (_, None) => None,
        };
        // What can never work is refused here, not on every object (or element) later.
        let whole = if cx.in_for_each {
            "the forEach element"
        } else {
            "the whole object"
        };
        if let Some(path) = &path
            && op.op == PatchOp::Remove
            && path.depth() == 0
        {
            cx.push(
                format!("{at}.path"),
                if cx.in_for_each {
                    format!(
                        "remove cannot remove {whole}; point the path at a field inside it, or to remove list elements use the `remove: {{path, where}}` mutation on the list (outside forEach)"
                    )
                } else {
                    format!("remove cannot remove {whole}; point the path at a field inside it")
                },
            );
            continue;
        }
        if let (Some(path), Some(from), PatchOp::Move) = (&path, &from, op.op)
            && from.contains(path)
            && from.depth() < path.depth()
        {
            cx.push(
                format!("{at}.from"),
                format!(
                    "move cannot move {:?} into its own child {:?}; use copy, or another path",
                    from.as_str(),
                    path.as_str()
                ),
            );
            continue;
        }
        if let Some(path) = path {
            let Ok(path_buf) = PointerBuf::parse(path.as_str()) else {
                cx.push(
                    format!("{at}.path"),
                    format!(
                        "invalid JSON pointer {}",
                        crate::untrusted::InQuotes(&op.path)
                    ),
                );
                continue;
            };
            let from_pointer = from;
            let from = from_pointer
                .as_ref()
                .and_then(|f| PointerBuf::parse(f.as_str()).ok());
            let last = path.tokens().last().map(|(token, _)| token.into_owned());
            steps.push(PatchStep {
                op: op.op,
                last,
                path,
                path_buf,
                from,
                from_pointer,
                value,
            });
        }
    }
    (cx.error_count() == before).then_some(Patch { steps })
}

impl Patch {
    pub(super) fn apply(
        &self,
        site: Site,
        journal: &mut Journal,
        meter: &mut Meter,
    ) -> Result<(), Stop> {
        // Every value is rendered against the object as it was before the first operation.
        let mut values = Vec::with_capacity(self.steps.len());
        for step in &self.steps {
            values.push(match &step.value {
                // A test compares with the value as rendered, nulls included.
                Some(t) if step.op == PatchOp::Test => Some(site.render(t, meter)?),
                Some(t) => Some(site.render_written(t, meter)?),
                None => None,
            });
        }
        let base = site.base();
        let target = site.target()?;
        for (i, (step, value)) in self.steps.iter().zip(values).enumerate() {
            if matches!(value, Some(Rendered::Value(Value::Null)))
                && matches!(step.op, PatchOp::Add | PatchOp::Replace)
            {
                // A template that renders null sets nothing, as in `defaults`.
                continue;
            }
            let in_context = |e: Stop| e.context(|| format!("patch[{i}] {}", step.describe()));
            step.count(target, base, value.as_ref(), meter)
                .map_err(in_context)?;
            let value = value.map_or(Value::Null, Rendered::into_value);
            step.apply_to(target, base, value, journal)
                .map_err(in_context)?;
        }
        Ok(())
    }
}

impl PatchStep {
    fn describe(&self) -> String {
        let op = format!("{:?}", self.op).to_lowercase();
        format!("{op} {}", self.path.as_str())
    }

    /// Counts what the operation writes: its value, or what a copy writes again.
    fn count(
        &self,
        target: &Value,
        base: &Pointer,
        value: Option<&Rendered>,
        meter: &mut Meter,
    ) -> Result<(), Stop> {
        let at_depth = base.depth() + self.path.depth();
        match (&self.value, self.op) {
            (_, PatchOp::Test) => Ok(()),
            (Some(t), _) => count_write(meter, t, value.and_then(Rendered::rendered), at_depth),
            (None, PatchOp::Copy | PatchOp::Move) => {
                // A copy writes the value again; a move only changes how deep it sits.
                let Some(from) = self.from_pointer.as_ref().and_then(|f| f.get(target)) else {
                    return Ok(());
                };
                let size = measure(from, meter.remaining(), MAX_DEPTH.saturating_sub(at_depth));
                let bytes = if self.op == PatchOp::Copy {
                    size.bytes
                } else {
                    0
                };
                meter.write_sized(
                    Size {
                        bytes,
                        depth: size.depth,
                    },
                    at_depth,
                )
            }
            (None, _) => Ok(()),
        }
    }

    /// The part an operation at `path` changes: the list when it inserts into or removes
    /// from a list (indices after it shift), the path itself otherwise.
    fn touched(target: &Value, path: &Pointer) -> Pointer {
        if let Some(parent) = path.parent()
            && parent.get(target).is_some_and(Value::is_array)
        {
            return parent;
        }
        path.clone()
    }

    fn apply_to(
        &self,
        target: &mut Value,
        base: &Pointer,
        value: Value,
        journal: &mut Journal,
    ) -> Result<(), Stop> {
        match self.op {
            PatchOp::Test => {}
            PatchOp::Replace => journal.touch_in(target, base, &self.path),
            PatchOp::Add | PatchOp::Remove | PatchOp::Copy => {
                journal.touch_in(target, base, &Self::touched(target, &self.path))
            }
            PatchOp::Move => {
                journal.touch_in(target, base, &Self::touched(target, &self.path));
                if let Some(from) = &self.from_pointer {
                    journal.touch_in(target, base, &Self::touched(target, from));
                }
            }
        }
        // The operations that write at `path` (add, copy, move) create missing parents, so a
        // rule does not depend on whether the object already has, say, annotations or
        // tolerations: a list when the path ends in `-` or an index, an object otherwise.
        if matches!(self.op, PatchOp::Add | PatchOp::Copy | PatchOp::Move)
            && let Some(parent) = self.path.parent()
        {
            let in_list = self.path.names_list_slot();
            let container = parent.get_or_create(target, || {
                if in_list {
                    Value::Array(Vec::new())
                } else {
                    Value::Object(Default::default())
                }
            })?;
            // An add into an object sets the member (RFC 6902 4.1), as `json_patch` would; done
            // here, where the parent is in hand, rather than by parsing and walking the path
            // again from the root (a third of a small rule's time). Lists and every other op
            // go through `json_patch`, with its errors.
            if let (PatchOp::Add, Value::Object(map), Some(last)) =
                (self.op, &mut *container, &self.last)
            {
                map.insert(last.clone(), value);
                return Ok(());
            }
        }
        if matches!(self.op, PatchOp::Remove | PatchOp::Replace) && self.path.get(target).is_none()
        {
            return Err(if self.op == PatchOp::Remove {
                MutationError::RemoveMissing
            } else {
                MutationError::ReplaceMissing
            }
            .into());
        }
        let path = self.path_buf.clone();
        let from = || self.from.clone().unwrap_or_default();
        let op = match self.op {
            PatchOp::Add => PatchOperation::Add(AddOperation { path, value }),
            PatchOp::Remove => PatchOperation::Remove(RemoveOperation { path }),
            PatchOp::Replace => PatchOperation::Replace(ReplaceOperation { path, value }),
            PatchOp::Move => PatchOperation::Move(MoveOperation { from: from(), path }),
            PatchOp::Copy => PatchOperation::Copy(CopyOperation { from: from(), path }),
            PatchOp::Test => PatchOperation::Test(TestOperation { path, value }),
        };
        // The rule's journal makes it atomic, so the patch need not copy the object first.
        json_patch::patch_unsafe(target, &[op])
            .map_err(|e| Stop::from(MutationError::Patch(e.kind)))
    }
}
