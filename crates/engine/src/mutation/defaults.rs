//! `defaults`: fields set only where the object has none (Kyverno's `+(key)` anchors). The
//! value is shaped like a merge patch; it never overwrites, so applying it again changes
//! nothing.

use serde_json::Value;

use crate::journal::Journal;
use crate::limits::Meter;
use crate::path::{Pointer, type_name};
use crate::stop::Stop;

use super::{Compiler, Site, count_write};
use crate::template::Template;

#[derive(Clone, Debug)]
pub(crate) struct Defaults {
    value: Template,
}

pub(super) fn compile(value: &Value, at: &str, cx: &mut Compiler) -> Option<Defaults> {
    let field = format!("{at}.defaults");
    let Some(map) = value.as_object() else {
        cx.push(
            field,
            format!("defaults must be an object, not {}", type_name(value)),
        );
        return None;
    };
    if map.is_empty() {
        cx.push(
            field,
            "empty defaults set nothing; list the fields to default",
        );
        return None;
    }
    if let Some(at_null) = find_null(value, &Pointer::root()) {
        cx.push(
            format!("{field} (at {})", at_null.as_str()),
            "a default cannot be null (it would set nothing); to remove a field use merge with null",
        );
        return None;
    }
    cx.template(value, &field).map(|value| Defaults { value })
}

/// The first null in `value`, which a default cannot mean anything by.
fn find_null(value: &Value, at: &Pointer) -> Option<Pointer> {
    match value {
        Value::Null => Some(at.clone()),
        Value::Object(map) => map.iter().find_map(|(k, v)| find_null(v, &at.child(k))),
        _ => None,
    }
}

impl Defaults {
    pub(super) fn apply(
        &self,
        site: Site,
        journal: &mut Journal,
        meter: &mut Meter,
    ) -> Result<(), Stop> {
        let value = site.render_missing(&self.value, meter)?;
        let base = site.base();
        let target = site.target()?;
        count_write(meter, &self.value, value.rendered(), base.depth())?;
        fill(target, base, value.into_value(), journal);
        Ok(())
    }
}

/// Sets each field of `defaults` that `target` (the value at `at`) lacks, going deeper where
/// both are objects; records what it adds.
fn fill(target: &mut Value, at: &Pointer, defaults: Value, journal: &mut Journal) {
    let Value::Object(wanted) = defaults else {
        return;
    };
    if target.is_null() {
        journal.record(at.clone(), Some(target));
        *target = Value::Object(Default::default());
    }
    let Value::Object(have) = target else {
        // A list or scalar where the defaults have an object: what is there stays.
        return;
    };
    for (key, value) in wanted {
        match have.get_mut(&key) {
            Some(current) if !current.is_null() => {
                if value.is_object() && current.is_object() {
                    fill(current, &at.child(&key), value, journal);
                }
            }
            current => {
                journal.record(at.child(&key), current.as_deref());
                have.insert(key, value);
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn only_missing_fields_are_set_at_every_depth() {
        let mut doc = json!({"securityContext": {"runAsNonRoot": false, "capabilities": ["x"]},
                             "ports": null});
        let defaults = json!({"securityContext": {"runAsNonRoot": true, "runAsUser": 1000,
                                                  "capabilities": {"drop": ["ALL"]},
                                                  "seccompProfile": {"type": "RuntimeDefault"}},
                              "ports": [], "name": "x"});
        let mut journal = Journal::default();
        fill(&mut doc, &Pointer::root(), defaults.clone(), &mut journal);
        assert_eq!(
            doc,
            json!({"securityContext": {"runAsNonRoot": false, "capabilities": ["x"], "runAsUser": 1000,
                                       "seccompProfile": {"type": "RuntimeDefault"}},
                   "ports": [], "name": "x"})
        );
        let before = doc.clone();
        let mut again = Journal::default();
        fill(&mut doc, &Pointer::root(), defaults, &mut again);
        assert_eq!(doc, before, "applying defaults twice changes nothing");
        assert!(!again.changed(&doc));
    }
}
