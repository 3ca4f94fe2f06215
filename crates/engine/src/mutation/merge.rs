//! `merge`: an RFC 7396 JSON merge patch (`null` removes a field).

use serde_json::Value;

use crate::journal::Journal;
use crate::limits::Meter;
use crate::literal::{self, MergePatch};
use crate::path::{Pointer, type_name};
use crate::stop::Stop;
use crate::template::Template;

use super::{Compiler, Rendered, Site, count_write};

#[derive(Clone, Debug)]
pub(crate) struct Merge {
    patch: Template,
}

pub(super) fn compile(patch: &Value, at: &str, cx: &mut Compiler) -> Option<Merge> {
    let field = format!("{at}.merge");
    if !patch.is_object() {
        cx.push(
            field,
            format!("a merge patch must be an object, not {}", type_name(patch)),
        );
        return None;
    }
    if patch.as_object().is_some_and(|m| m.is_empty()) {
        cx.push(
            field,
            "an empty merge patch changes nothing (if it held nulls, client-side `kubectl apply` removed them: apply rules with `kubectl apply --server-side`)",
        );
        return None;
    }
    cx.template(patch, &field).map(|patch| Merge { patch })
}

impl Merge {
    pub(super) fn apply(
        &self,
        site: Site,
        journal: &mut Journal,
        meter: &mut Meter,
    ) -> Result<(), Stop> {
        let patch = site.render(&self.patch, meter)?;
        let base = site.base();
        let target = site.target()?;
        count_write(meter, &self.patch, patch.rendered(), base.depth())?;
        match &patch {
            Rendered::Literal(patch) => merge_into(target, base, *patch, journal),
            Rendered::Value(patch) => merge_into(target, base, patch, journal),
        }
        Ok(())
    }
}

/// Records the parts of `target` a merge patch will change: it recurses where both the patch
/// and the target are objects, and records each place the patch replaces, adds or removes
/// something (places it would leave as they are are not recorded).
fn merge_touches<P: MergePatch>(
    at: &mut Pointer,
    target: Option<&Value>,
    patch: &P,
    journal: &mut Journal,
) {
    match (patch.entries(), target) {
        (Some(entries), Some(Value::Object(t))) => {
            for (key, value) in entries {
                let len = at.push(key);
                merge_touches(at, t.get(key), value, journal);
                at.truncate(len);
            }
        }
        (None, None) if patch.is_null() => {}
        // A null in the patch removes the member, even one whose value is null.
        (None, Some(current)) if !patch.is_null() && patch.same_as(current) => {}
        (_, prior) => journal.record(at.clone(), prior),
    }
}

fn merge_into<P: MergePatch>(target: &mut Value, base: &Pointer, patch: &P, journal: &mut Journal) {
    merge_touches(&mut base.buffer(), Some(&*target), patch, journal);
    literal::merge(target, patch);
}
