//! `forEach`: a JSONPath selecting elements (`$.spec.containers[*]`), and mutations applied to
//! each, with paths relative to the element. It cannot nest.

use serde_json::Value;

use crate::api::{self, ELEMENT_MUTATION_KINDS};
use crate::journal::Journal;
use crate::limits::Meter;
use crate::matching::Prepared;
use crate::path::{Pointer, Query};
use crate::stop::Stop;

use super::{Compiler, Mutation, MutationError, Site, compile_kind};

#[derive(Clone, Debug)]
pub(crate) struct ForEach {
    query: Query,
    mutations: Vec<Mutation>,
    /// No nested mutation renders a template, so each element is looked up once.
    literal: bool,
}

pub(super) fn compile(
    query: &str,
    mutations: Option<&[api::ElementMutation]>,
    at: &str,
    cx: &mut Compiler,
) -> Option<ForEach> {
    let before = cx.error_count();
    let field = format!("{at}.forEach");
    let hint = "the JSONPath is fixed when the rule is compiled; it can choose elements by their content with a filter, like $.spec.containers[?@.name == 'app']";
    let query = if cx.fixed(query, &field, hint) {
        Query::parse(query).map_err(|e| cx.push(field, e)).ok()
    } else {
        None
    };
    let specs = match mutations {
        Some(list) if !list.is_empty() => list,
        _ => {
            cx.push(
                format!("{at}.mutations"),
                "forEach needs at least one mutation",
            );
            return None;
        }
    };
    let mut nested = cx.for_each();
    let mut mutations = Vec::new();
    for (i, spec) in specs.iter().enumerate() {
        let at = format!("{at}.mutations[{i}]");
        let Some(kind) = nested.exactly_one(spec.kinds(), ELEMENT_MUTATION_KINDS, &at) else {
            continue;
        };
        if let Some(m) = compile_kind(kind, &at, &mut nested) {
            mutations.push(m);
        }
    }
    let literal = !nested.renders();
    if cx.error_count() != before {
        return None;
    }
    Some(ForEach {
        query: query?,
        mutations,
        literal,
    })
}

impl ForEach {
    #[cfg(test)]
    pub(super) fn is_literal(&self) -> bool {
        self.literal
    }

    pub(super) fn apply(
        &self,
        site: Site,
        journal: &mut Journal,
        meter: &mut Meter,
    ) -> Result<(), Stop> {
        self.apply_with(site, journal, meter, true)
    }

    /// [`ForEach::apply`]; with `reuse`, a `remove` whose `where` has `in` conditions builds
    /// its `in` sets once and keeps them from element to element while nothing changes where
    /// its queries can see (without, it builds them again for every element: the sets cost
    /// as much as the values they select, so that was quadratic in the number of elements).
    pub(super) fn apply_with(
        &self,
        site: Site,
        journal: &mut Journal,
        meter: &mut Meter,
        reuse: bool,
    ) -> Result<(), Stop> {
        let lookups = site.lookups();
        let doc = site.into_object().ok_or(MutationError::NestedForEach)?;
        if self.literal
            && let Some(count) = self.query.count_simple(doc)
        {
            // Nothing to render: each element is changed where the walk finds it, without
            // a pointer per element looked up again from the root.
            meter.plan_steps(count, self.mutations.len())?;
            let mut visit = |target: &mut Value, element: &Pointer| -> Result<(), Stop> {
                meter.tick()?;
                self.mutations
                    .iter()
                    .try_for_each(|m| {
                        m.apply_at(Site::target_of(&mut *target, element), journal, meter)
                    })
                    .map_err(|e| e.context(|| format!("forEach element {}", element.as_str())))
            };
            if let Some(result) = self.query.visit_simple_mut(doc, &mut visit) {
                return result;
            }
        }
        let elements = self.query.locate(doc)?;
        meter.plan_steps(elements.len(), self.mutations.len())?;
        // Per mutation, the `in` sets of a `remove` built at an earlier element. Every
        // mutation here changes only its element (its paths are relative to it), so the sets
        // still hold at the next element unless the `in` queries may select at or under an
        // element that was visited since they were built: then they are built again.
        let mut sets: Vec<Option<Prepared>> = self.mutations.iter().map(|_| None).collect();
        for element in &elements {
            meter.tick()?;
            let result = if self.literal {
                // Nothing to render: look the element up once for all its mutations.
                match element.get_mut(doc) {
                    Some(target) => self.mutations.iter().try_for_each(|m| {
                        m.apply_at(Site::target_of(&mut *target, element), journal, meter)
                    }),
                    None => Ok(()),
                }
            } else {
                self.mutations
                    .iter()
                    .zip(sets.iter_mut())
                    .try_for_each(|(m, sets)| match m {
                        Mutation::Remove(remove) if reuse && remove.reads_object() => {
                            if remove.in_sets_may_see(element) {
                                // Built now, and again at the next element: mutations of this
                                // one may change what the queries select.
                                *sets = None;
                                m.apply(doc, element, lookups, journal, meter)
                            } else {
                                // As `Mutation::apply`: a step, then the mutation.
                                meter.tick()?;
                                remove.apply_reusing(
                                    Site::object(doc, element, lookups),
                                    journal,
                                    meter,
                                    sets,
                                )
                            }
                        }
                        _ => m.apply(doc, element, lookups, journal, meter),
                    })
            };
            result.map_err(|e| e.context(|| format!("forEach element {}", element.as_str())))?;
        }
        Ok(())
    }
}
