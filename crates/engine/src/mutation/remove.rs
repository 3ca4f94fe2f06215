//! `remove`: takes away the elements of a list that satisfy every `where` condition (every
//! `hostPath` volume; the mounts whose name is one of theirs). A missing list is left alone.

use serde_json::Value;

use crate::api;
use crate::journal::Journal;
use crate::limits::Meter;
use crate::matching::{Conditions, MatchError, Prepared};
use crate::path::{Pointer, type_name};
use crate::stop::Stop;

use super::{Compiler, MutationError, Site};

#[derive(Clone, Debug)]
pub(crate) struct Remove {
    path: Pointer,
    conditions: Conditions,
}

pub(super) fn compile(spec: &api::Remove, at: &str, cx: &mut Compiler) -> Option<Remove> {
    let before = cx.error_count();
    let path = cx.pointer(&spec.path, &format!("{at}.remove.path"));
    if spec.where_.is_empty() {
        cx.push(
            format!("{at}.remove.where"),
            "needs at least one condition (to empty a list, use merge or patch)",
        );
    }
    let conditions = Conditions::compile_on_elements(
        &spec.where_,
        &format!("{at}.remove.where"),
        cx.regex_limit,
        cx.errors,
    );
    // `in` reads the object as it is when the mutation runs, so a `forEach` must give it.
    if conditions.reads_object() {
        cx.renders = true;
    }
    if cx.error_count() != before {
        return None;
    }
    Some(Remove {
        path: path?,
        conditions,
    })
}

impl Remove {
    /// True when some `where` condition is an `in`, which reads the whole object.
    pub(super) fn reads_object(&self) -> bool {
        self.conditions.reads_object()
    }

    /// Whether a change at or under `pointer` may change the `in` sets.
    pub(super) fn in_sets_may_see(&self, pointer: &Pointer) -> bool {
        self.conditions.in_sets_may_see(pointer)
    }

    pub(super) fn apply(
        &self,
        site: Site,
        journal: &mut Journal,
        meter: &mut Meter,
    ) -> Result<(), Stop> {
        self.apply_reusing(site, journal, meter, &mut None)
    }

    /// [`Remove::apply`] with the `in` sets of `sets` when it holds some, else with sets
    /// built from the object now and left in `sets`. The caller empties `sets` when the
    /// object changed where the `in` queries can see it (see `forEach`).
    pub(super) fn apply_reusing(
        &self,
        site: Site,
        journal: &mut Journal,
        meter: &mut Meter,
        sets: &mut Option<Prepared>,
    ) -> Result<(), Stop> {
        let in_context = |e: Stop| e.context(|| format!("remove {}", self.path.as_str()));
        let doomed = {
            let (object, target) = site.peek().map_err(in_context)?;
            let Some(list) = self.path.get(target) else {
                return Ok(());
            };
            let Value::Array(items) = list else {
                return Err(in_context(
                    MutationError::RemoveNotList {
                        found: type_name(list),
                    }
                    .into(),
                ));
            };
            meter
                .plan_steps(items.len(), self.conditions.len())
                .map_err(in_context)?;
            let prepared = match sets {
                Some(prepared) => prepared,
                None => {
                    let prepared = self
                        .conditions
                        .prepare(object.unwrap_or(&Value::Null))
                        .map_err(|e| in_context(where_error(e)))?;
                    // Each value the in: queries selected is a step of this rule's forEach
                    // budget: sets rebuilt at every element of a forEach (their queries see
                    // the elements) cost elements × object, and the steps bound that.
                    meter
                        .plan_steps(prepared.selected(), 1)
                        .map_err(in_context)?;
                    sets.insert(prepared)
                }
            };
            let mut doomed = Vec::with_capacity(items.len());
            for item in items {
                meter.tick()?;
                doomed.push(
                    self.conditions
                        .hold_prepared(item, prepared)
                        .map_err(|e| in_context(where_error(e)))?,
                );
            }
            doomed
        };
        if !doomed.contains(&true) {
            return Ok(());
        }
        let base = site.base();
        let target = site.target()?;
        let Some(Value::Array(items)) = self.path.get_mut(target) else {
            return Ok(());
        };
        journal.record_with(base.join(&self.path), || Some(Value::Array(items.clone())));
        let mut doomed = doomed.into_iter();
        items.retain(|_| !doomed.next().unwrap_or(false));
        Ok(())
    }
}

/// A `where` condition that could not be evaluated, told by its place in `where`.
fn where_error(error: MatchError) -> Stop {
    match error {
        MatchError::Condition { index, source } => {
            Stop::from(source).context(|| format!("where[{index}]"))
        }
        other => Stop::from(other),
    }
}
