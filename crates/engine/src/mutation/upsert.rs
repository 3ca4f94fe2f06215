//! `upsert`: idempotent insert-or-replace in a list of objects, keyed by a field. The list
//! (and its parents) are created when absent.

use serde_json::Value;

use crate::api;
use crate::journal::Journal;
use crate::limits::Meter;
use crate::path::{Pointer, type_name};
use crate::stop::Stop;
use crate::template::Template;

use super::{Compiler, MutationError, Site, count_write};

#[derive(Clone, Debug)]
pub(crate) struct Upsert {
    path: Pointer,
    key: String,
    value: Template,
    position: api::Position,
}

pub(super) fn compile(spec: &api::Upsert, at: &str, cx: &mut Compiler) -> Option<Upsert> {
    let mut path = cx.pointer(&spec.path, &format!("{at}.upsert.path"));
    // `-` is a new list element every time: the upsert would add another each time it runs.
    if path
        .as_ref()
        .is_some_and(|p| p.tokens().any(|(t, _)| t == "-"))
    {
        cx.push(
            format!("{at}.upsert.path"),
            "\"-\" names a new list element, so the upsert would add one every time the rule runs; point the path at the list itself (it is created when absent), or at an element by its index",
        );
        path = None;
    }
    let key_fixed = cx.fixed(
        &spec.key,
        &format!("{at}.upsert.key"),
        "the key field is fixed when the rule is compiled (its value in upsert.value may be a template)",
    );
    if spec.key.is_empty() {
        cx.push(
            format!("{at}.upsert.key"),
            "must name the field that identifies an element",
        );
    }
    match spec.value.get(&spec.key) {
        _ if !spec.value.is_object() => {
            cx.push(
                format!("{at}.upsert.value"),
                format!("must be an object, not {}", type_name(&spec.value)),
            );
        }
        None if key_fixed && !spec.key.is_empty() => {
            cx.push(
                format!("{at}.upsert.value"),
                format!("has no key field {}", crate::untrusted::InQuotes(&spec.key)),
            );
        }
        _ => {}
    }
    let value = cx.template(&spec.value, &format!("{at}.upsert.value"));
    if !key_fixed || spec.key.is_empty() || spec.value.get(&spec.key).is_none() {
        return None;
    }
    Some(Upsert {
        path: path?,
        key: spec.key.clone(),
        value: value?,
        position: spec.position,
    })
}

impl Upsert {
    pub(super) fn apply(
        &self,
        site: Site,
        journal: &mut Journal,
        meter: &mut Meter,
    ) -> Result<(), Stop> {
        let value = site.render_written(&self.value, meter)?;
        let base = site.base();
        let target = site.target()?;
        // The value lands as an element of the list at `path`.
        let at_depth = base.depth() + self.path.depth() + 1;
        let rendered = value.rendered().is_some();
        let value = value.into_value();
        if value.get(&self.key).is_none() {
            return Err(MutationError::UpsertNoKey {
                path: self.path.as_str().to_string(),
                key: self.key.clone(),
            }
            .into());
        }
        count_write(meter, &self.value, rendered.then_some(&value), at_depth)?;
        let at = base.join(&self.path);
        let list = match self.path.get_mut(target) {
            Some(list) => list,
            None => {
                journal.touch_in(target, base, &self.path);
                self.path
                    .get_or_create(target, || Value::Array(Vec::new()))?
            }
        };
        upsert(list, &at, &self.key, value, self.position, journal)
    }
}

/// Replaces the element of `list` whose `key` equals the value's, or inserts the value at
/// `position`; records only what it changes.
fn upsert(
    list: &mut Value,
    at: &Pointer,
    key: &str,
    value: Value,
    position: api::Position,
    journal: &mut Journal,
) -> Result<(), Stop> {
    if list.is_null() {
        journal.record(at.clone(), Some(list));
        *list = Value::Array(Vec::new());
    }
    let Value::Array(items) = list else {
        return Err(MutationError::UpsertNotList {
            path: at.as_str().to_string(),
            found: type_name(list),
        }
        .into());
    };
    let id = value.get(key);
    match items.iter().position(|item| item.get(key) == id) {
        Some(i) => {
            if items[i] != value {
                journal.record(at.child_index(i), Some(&items[i]));
                items[i] = value;
            }
        }
        None => match position {
            api::Position::Append => {
                journal.record(at.child_index(items.len()), None);
                items.push(value);
            }
            api::Position::Prepend => {
                // Every element moves up one: the whole list is what changes.
                journal.record_with(at.clone(), || Some(Value::Array(items.clone())));
                items.insert(0, value);
            }
        },
    }
    Ok(())
}
