//! A rule compiled for evaluation: what it matches (see `matching`), its mutations, and how
//! it runs on an object: atomically, its failures left to its failure policy.

use std::cmp::Ordering;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, LazyLock};
use std::time::Instant;

use crate::limits::RuleRegex;
use serde_json::Value;

use crate::api::{self, FailurePolicy, GATED_LABEL, Mode, Operation, RuleSpec};

use super::autogen::{self, Templates};
use super::error::{Errors, IdentityChange, InternalError, NotAString, RuleErrors};
use super::gate::{self, CompiledGate};
use super::journal::Journal;
use super::kind::{Gvk, KindPattern};
use super::limits::{CompileMeter, MAX_RULE_REGEXES, Meter, regex_share};
use super::lookup::{self, CompiledLookup, Found, LookupTarget};
use super::matching::{Conditions, MatchError, Matcher, Needs};
use super::mutation::{self, Mutation, MutationError};
use super::path::{Pointer, Query, type_name as describe_value};
use super::stop::Stop;
use super::subject::{RuleId, Subject};
use super::untrusted::InQuotes;

/// A rule ready for the index.
#[derive(Clone, Debug)]
pub struct CompiledRule {
    pub id: RuleId,
    pub priority: i32,
    pub failure_policy: FailurePolicy,
    /// `Audit`: evaluated, its changes reported and undone (see `RuleIndex::evaluate_with`).
    pub mode: Mode,
    matcher: Matcher,
    /// Boxed: most rules have none, and every rule of a cluster is kept compiled.
    exclude: Option<Box<Matcher>>,
    conditions: Conditions,
    mutations: Vec<Mutation>,
    gate: Option<Gated>,
    lookups: Vec<CompiledLookup>,
    /// `spec.autogen`: the controllers whose Pod templates the rule also mutates.
    templates: Templates,
    /// What the compiled rule holds, measured when it was compiled ([`CompiledRule::held_bytes`]).
    held_bytes: usize,
}

/// A rule's gate: what the gate controller reads, and the mutations that hold a Pod.
#[derive(Clone, Debug)]
struct Gated {
    gate: Arc<CompiledGate>,
    hold: Vec<Mutation>,
}

/// The outcome of running one rule on an object.
pub(crate) enum RuleResult {
    NotMatched,
    Unchanged,
    Changed(Journal),
    /// The rule failed and its changes were undone.
    Failed(Stop),
    /// The rule failed and its changes could not be undone (an internal error while undoing
    /// them): the object is not fit to be admitted.
    Corrupted(UndoFailed),
}

/// A rule failed, and putting back what it had changed failed too.
#[derive(Debug, thiserror::Error)]
#[error("{failure}; then undoing its changes failed: {undo}")]
pub(crate) struct UndoFailed {
    failure: Stop,
    #[source]
    undo: InternalError,
}

impl UndoFailed {
    /// Undoing what an Audit rule changed (every Audit rule's changes are undone) panicked.
    pub(crate) fn audit(panic: &(dyn std::any::Any + Send)) -> UndoFailed {
        UndoFailed {
            failure: Stop::from(InternalError::from_panic(
                &"the rule runs in mode Audit, so its changes are undone",
            )),
            undo: InternalError::from_panic(panic),
        }
    }
}

impl CompiledRule {
    pub fn kinds(&self) -> &[KindPattern] {
        self.matcher.kinds()
    }

    /// The kinds whose Pod templates the rule also mutates (`spec.autogen`), for the webhook
    /// configuration and the index: `apps/*/Deployment`, ...
    pub fn template_kinds(&self) -> &[KindPattern] {
        self.templates.kinds()
    }

    /// The controllers whose Pod templates the rule also mutates (`spec.autogen`).
    pub fn autogen(&self) -> &[api::Controller] {
        self.templates.controllers()
    }

    /// The controller an object of `gvk` is, when the rule applies to its Pod template.
    fn template_of(&self, gvk: &Gvk) -> Option<api::Controller> {
        if self.templates.is_empty() {
            return None;
        }
        self.templates.of(gvk)
    }

    /// The rule's gate, if it has one (for the gate controller).
    pub fn gate(&self) -> Option<&Arc<CompiledGate>> {
        self.gate.as_ref().map(|g| &g.gate)
    }

    /// What the rule's lookups read (for the watches that keep the lookup store current).
    pub fn lookup_targets(&self) -> impl Iterator<Item = &LookupTarget> {
        self.lookups.iter().map(CompiledLookup::target)
    }

    /// The operations the rule can act on (for the webhook configuration).
    pub fn operations(&self) -> &[Operation] {
        self.matcher.operations()
    }

    /// What its `match` needs of an object (for the index's prefilter).
    pub(crate) fn needs(&self) -> Needs<'_> {
        self.matcher.needs()
    }

    /// True when it reads the labels of the object's Namespace (a namespaceSelector in
    /// `match` or `exclude`).
    pub(crate) fn needs_namespace_labels(&self) -> bool {
        self.matcher.needs().namespace_selector
            || self
                .exclude
                .as_ref()
                .is_some_and(|e| e.needs().namespace_selector)
    }

    /// A `matches` condition that rules the object out by itself (for the index's prefilter,
    /// see `Conditions::first_regex`).
    pub(crate) fn first_regex(&self) -> Option<(&Query, &RuleRegex)> {
        self.conditions.first_regex()
    }

    /// Namespace names the rule is limited to when they are all literal (for the index).
    pub fn literal_namespaces(&self) -> Option<Vec<String>> {
        self.matcher.literal_namespaces()
    }

    /// What the compiled rule holds, as measured when it was compiled: its spec's bytes, what
    /// its JSONPath queries keep, and its regular expressions' automata and search caches. What
    /// per-namespace quotas count (`--max-rule-bytes-per-namespace`).
    pub fn held_bytes(&self) -> usize {
        self.held_bytes
    }

    pub(crate) fn order(&self, other: &CompiledRule) -> Ordering {
        self.priority
            .cmp(&other.priority)
            .then_with(|| self.id.cmp(&other.id))
    }

    /// Whether the rule applies to the object; an error when that cannot be told (see
    /// `Subject::namespace_labels`), which the rule's failure policy then handles.
    /// Out of time ([`MatchError::OutOfTime`]) when `deadline` passes between two conditions.
    fn matches_until(
        &self,
        subject: &Subject,
        object: &Value,
        deadline: Option<Instant>,
    ) -> Result<bool, MatchError> {
        if !self.matcher.matches(subject, object)? {
            return Ok(false);
        }
        if let Some(exclude) = &self.exclude
            && exclude.matches(subject, object)?
        {
            return Ok(false);
        }
        self.conditions.hold_until(object, deadline)
    }

    /// Why the rule does not apply to the object, as the field of the rule that rules it out
    /// (`spec.match.labels`, `spec.exclude`, `spec.conditions[1]`); `None` when it applies.
    /// For `initium explain`: the admission path uses `matches`.
    pub(crate) fn why_not(
        &self,
        subject: &Subject,
        object: &Value,
    ) -> Result<Option<String>, MatchError> {
        if let Some(controller) = self.template_of(subject.gvk) {
            let mut doc = object.clone();
            return autogen::with_template(&mut doc, controller, subject, |pod_subject, pod| {
                self.why_not_direct(pod_subject, pod)
            })
            .unwrap_or_else(|| {
                Ok(Some(format!(
                    "spec.autogen: the object has no Pod template at {}",
                    autogen::template_field(controller)
                )))
            });
        }
        self.why_not_direct(subject, object)
    }

    fn why_not_direct(
        &self,
        subject: &Subject,
        object: &Value,
    ) -> Result<Option<String>, MatchError> {
        if let Some(field) = self.matcher.first_mismatch(subject, object)? {
            return Ok(Some(format!("spec.match.{field}")));
        }
        if let Some(exclude) = &self.exclude
            && exclude.matches(subject, object)?
        {
            return Ok(Some("spec.exclude".into()));
        }
        Ok(self
            .conditions
            .first_failing(object)?
            .map(|i| format!("spec.conditions[{i}]")))
    }

    /// `matches`, with anything unexpected inside (a bug, here or in a library) turned into
    /// an error of this rule instead of taking the process down.
    /// Out of time ([`MatchError::OutOfTime`]) when `deadline` passes before a condition.
    pub(crate) fn matches_guarded_until(
        &self,
        subject: &Subject,
        object: &Value,
        deadline: Option<Instant>,
    ) -> Result<bool, MatchError> {
        if let Some(controller) = self.template_of(subject.gvk) {
            let mut doc = object.clone();
            return autogen::with_template(&mut doc, controller, subject, |pod_subject, pod| {
                self.matches_guarded_direct(pod_subject, pod, deadline)
            })
            .unwrap_or(Ok(false));
        }
        self.matches_guarded_direct(subject, object, deadline)
    }

    fn matches_guarded_direct(
        &self,
        subject: &Subject,
        object: &Value,
        deadline: Option<Instant>,
    ) -> Result<bool, MatchError> {
        catch_unwind(AssertUnwindSafe(|| {
            self.matches_until(subject, object, deadline)
        }))
        .unwrap_or_else(|panic| Err(InternalError::from_panic(&*panic).into()))
    }

    /// Runs the rule on `doc` in place. The rule is atomic: when a mutation fails (or goes
    /// over a limit of `meter`), the journal puts back everything the rule had changed. This is
    /// the last line of defence at the rule boundary: whatever happens inside, even a panic,
    /// becomes this rule's failure, and the process and the other rules go on.
    pub(crate) fn run(&self, subject: &Subject, doc: &mut Value, meter: &mut Meter) -> RuleResult {
        match self.template_of(subject.gvk) {
            Some(controller) => self.run_on_template(controller, subject, doc, meter),
            None => self.run_direct(subject, doc, meter),
        }
    }

    /// `run` on the Pod template of a controller (`spec.autogen`): the rule runs on the Pod
    /// the template describes (see `autogen`), and records itself in the template's
    /// provenance. Its changes are the template's: one journal entry holds the template as it
    /// was, so they are undone, previewed and patched as any rule's.
    fn run_on_template(
        &self,
        controller: api::Controller,
        subject: &Subject,
        doc: &mut Value,
        meter: &mut Meter,
    ) -> RuleResult {
        let pointer = autogen::template_pointer(controller);
        if !pointer.get(doc).is_some_and(Value::is_object)
            || autogen::ran_before(doc, &pointer, subject, &self.id)
        {
            return RuleResult::NotMatched;
        }
        let mut journal = Journal::default();
        journal.touch(doc, &pointer);
        let ran = autogen::with_template(doc, controller, subject, |pod_subject, pod| {
            match self.run_direct(pod_subject, pod, meter) {
                RuleResult::Changed(pod_journal) => {
                    if let Some(error) = autogen::not_in_template(pod) {
                        let at = autogen::template_field(controller);
                        return match catch_unwind(AssertUnwindSafe(|| pod_journal.rollback(pod))) {
                            Ok(()) => {
                                meter.undo_rule();
                                RuleResult::Failed(Stop::from(error).context(|| at))
                            }
                            Err(panic) => RuleResult::Corrupted(UndoFailed {
                                failure: Stop::from(error).context(|| at),
                                undo: InternalError::from_panic(&*panic),
                            }),
                        };
                    }
                    super::provenance::record_provenance(pod, std::slice::from_ref(&self.id));
                    RuleResult::Changed(Journal::default())
                }
                other => other,
            }
        });
        match ran {
            Some(RuleResult::Changed(_)) => RuleResult::Changed(journal),
            other => {
                // Unchanged, not matched or undone: the template exactly as it was, whatever
                // lending it to the rule and taking it back did to its shape.
                if let Err(panic) = catch_unwind(AssertUnwindSafe(|| journal.rollback(doc))) {
                    return RuleResult::Corrupted(UndoFailed {
                        failure: Stop::from(InternalError::from_panic(
                            &"the Pod template was lent to the rule",
                        )),
                        undo: InternalError::from_panic(&*panic),
                    });
                }
                other.unwrap_or(RuleResult::NotMatched)
            }
        }
    }

    fn run_direct(&self, subject: &Subject, doc: &mut Value, meter: &mut Meter) -> RuleResult {
        match self.matches_guarded_direct(subject, doc, meter.deadline()) {
            Ok(true) => {}
            Ok(false) => return RuleResult::NotMatched,
            Err(MatchError::OutOfTime) => return RuleResult::Failed(Stop::Budget),
            Err(e) => return RuleResult::Failed(e.into()),
        }
        // Before any change: a lookup that cannot be read fails the rule, named.
        let found = match lookup::resolve(&self.lookups, subject) {
            Ok(found) => found,
            Err(stop) => return RuleResult::Failed(stop),
        };
        meter.start_rule();
        let mut journal = Journal::default();
        let result = catch_unwind(AssertUnwindSafe(|| {
            self.mutate(subject.operation, doc, &found, &mut journal, meter)?;
            check_identity(&journal, doc)?;
            check_metadata_values(&journal, doc)
        }))
        .unwrap_or_else(|panic| Err(InternalError::from_panic(&*panic).into()));
        match result {
            Ok(()) if journal.changed(doc) => RuleResult::Changed(journal),
            Ok(()) => RuleResult::Unchanged,
            Err(stop) => match catch_unwind(AssertUnwindSafe(|| journal.rollback(doc))) {
                Ok(()) => {
                    meter.undo_rule();
                    RuleResult::Failed(stop)
                }
                Err(panic) => RuleResult::Corrupted(UndoFailed {
                    failure: stop,
                    undo: InternalError::from_panic(&*panic),
                }),
            },
        }
    }

    fn mutate(
        &self,
        operation: Operation,
        doc: &mut Value,
        lookups: &[Found],
        journal: &mut Journal,
        meter: &mut Meter,
    ) -> Result<(), Stop> {
        let root = Pointer::root();
        for (i, m) in self.mutations.iter().enumerate() {
            m.apply(doc, &root, lookups, journal, meter)
                .map_err(|e| e.context(|| format!("spec.mutations[{i}]")))?;
        }
        // A gate is the Pod's pending slot: added at CREATE only (the API server refuses new
        // scheduling gates on an existing Pod), after the rule's own mutations.
        if let Some(gated) = &self.gate
            && operation == Operation::Create
        {
            if doc
                .pointer("/spec/nodeName")
                .and_then(Value::as_str)
                .is_some_and(|n| !n.is_empty())
            {
                return Err(Stop::from(MutationError::BoundPod).context(|| "spec.gate".to_string()));
            }
            for m in &gated.hold {
                m.apply(doc, &root, &[], journal, meter)
                    .map_err(|e| e.context(|| "spec.gate".to_string()))?;
            }
        }
        Ok(())
    }
}

/// The fields that say which object this is. A rule that changed them would move the object
/// to another name, namespace or type, which the API server refuses with a message that does
/// not name the rule: the rule fails instead, named.
fn check_identity(journal: &Journal, doc: &Value) -> Result<(), Stop> {
    static IDENTITY: LazyLock<[(Pointer, &str); 4]> = LazyLock::new(|| {
        [
            (Pointer::from_tokens(["apiVersion"]), "apiVersion"),
            (Pointer::from_tokens(["kind"]), "kind"),
            (Pointer::from_tokens(["metadata", "name"]), "metadata.name"),
            (
                Pointer::from_tokens(["metadata", "namespace"]),
                "metadata.namespace",
            ),
        ]
    });
    for (pointer, field) in IDENTITY.iter() {
        if let Some(before) = journal.changed_at(doc, pointer) {
            let show = |v: Option<&Value>| match v {
                None => "nothing".to_string(),
                Some(Value::String(s)) => format!("{s:?}"),
                Some(other) => describe_value(other).to_string(),
            };
            return Err(IdentityChange {
                field,
                before: show(before.as_ref()),
                after: show(pointer.get(doc)),
            }
            .into());
        }
    }
    Ok(())
}

/// Where an `ObjectMeta` is in the objects rules change: the object's own, and those of the
/// Pod and Job templates of the built-in controllers.
fn object_metas(doc: &Value) -> impl Iterator<Item = Pointer> + '_ {
    static FIXED: LazyLock<[Pointer; 4]> = LazyLock::new(|| {
        [
            Pointer::from_tokens(["metadata"]),
            Pointer::from_tokens(["spec", "template", "metadata"]),
            Pointer::from_tokens(["spec", "jobTemplate", "metadata"]),
            Pointer::from_tokens(["spec", "jobTemplate", "spec", "template", "metadata"]),
        ]
    });
    let claims = doc
        .pointer("/spec/volumeClaimTemplates")
        .and_then(Value::as_array)
        .map_or(0, Vec::len);
    FIXED.iter().cloned().chain((0..claims).map(|i| {
        Pointer::from_tokens(["spec", "volumeClaimTemplates"])
            .child_index(i)
            .child("metadata")
    }))
}

/// Labels and annotations are maps of strings. A rule that would leave a value that is not
/// one where there was a string or nothing (or the map itself not an object where there was
/// one or nothing) fails, named, rather than the API server refusing the object without
/// naming the rule. Values that were not strings before the rule are not its doing.
fn check_metadata_values(journal: &Journal, doc: &Value) -> Result<(), Stop> {
    for meta in object_metas(doc) {
        let Some(Value::Object(meta_map)) = meta.get(doc) else {
            continue;
        };
        for field in ["labels", "annotations"] {
            let at = meta.child(field);
            let shown = || at.as_str().trim_start_matches('/').replace('/', ".");
            match meta_map.get(field) {
                None | Some(Value::Null) => {}
                Some(Value::Object(entries)) => {
                    for (key, value) in entries {
                        if value.is_string() {
                            continue;
                        }
                        if let Some(before) = journal.changed_at(doc, &at.child(key))
                            && before.as_ref().is_none_or(Value::is_string)
                        {
                            return Err(NotAString {
                                field: format!("{} {}", shown(), InQuotes(key)),
                                found: describe_value(value),
                            }
                            .into());
                        }
                    }
                }
                Some(other) => {
                    if let Some(before) = journal.changed_at(doc, &at)
                        && before.as_ref().is_none_or(Value::is_object)
                    {
                        return Err(NotAString {
                            field: shown(),
                            found: describe_value(other),
                        }
                        .into());
                    }
                }
            }
        }
    }
    Ok(())
}

/// Compiles a rule, or lists every problem in it with its field path.
/// What a rule's values hold in memory per byte of its spec's JSON, at most (a JSON value in
/// memory takes a few times its text: a `String` or a map entry per short string).
const SPEC_HELD_PER_BYTE: usize = 4;

pub fn compile(id: RuleId, spec: &RuleSpec) -> Result<CompiledRule, RuleErrors> {
    let mut errors = Errors::default();
    let matcher = Matcher::compile(&spec.match_, "spec.match", false, &mut errors);
    let exclude = spec
        .exclude
        .as_ref()
        .map(|e| Box::new(Matcher::compile(e, "spec.exclude", true, &mut errors)));
    if exclude.as_ref().is_some_and(|m| m.is_empty()) {
        errors.push(
            "spec.exclude",
            "an empty exclude would skip every object; give at least one field or remove it",
        );
    }
    if id.namespace.is_some() {
        for (field, m) in [
            ("spec.match", Some(&spec.match_)),
            ("spec.exclude", spec.exclude.as_ref()),
        ] {
            let Some(m) = m else { continue };
            if !m.namespaces.is_empty() {
                errors.push(
                    format!("{field}.namespaces"),
                    "a MutationRule applies only to its own namespace; use a ClusterMutationRule",
                );
            }
            if m.namespace_selector.is_some() {
                errors.push(
                    format!("{field}.namespaceSelector"),
                    "a MutationRule applies only to its own namespace; use a ClusterMutationRule",
                );
            }
        }
    }
    let regexes = count_regexes(spec);
    if regexes > MAX_RULE_REGEXES {
        errors.push(
            "spec",
            format!("the rule has {regexes} regular expressions (conditions' matches, rewrites and replace() in templates); at most {MAX_RULE_REGEXES} are allowed: split it into several rules"),
        );
    }
    let regex_limit = regex_share(regexes);
    // Every JSONPath the rule's fields hold counts against one bound from here on (counting
    // the regexes above parsed the templates without keeping them), and what its queries and
    // regexes hold is measured.
    let meter = CompileMeter::start();
    let lookups = lookup::compile(&id, &spec.lookups, &mut errors);
    let conditions = Conditions::compile(&spec.conditions, regex_limit, &mut errors);
    if spec.mutations.is_empty() && spec.gate.is_none() {
        errors.push(
            "spec.mutations",
            "a rule needs at least one mutation (or a gate)",
        );
    }
    let mutations: Vec<Mutation> = spec
        .mutations
        .iter()
        .enumerate()
        .filter_map(|(i, m)| {
            mutation::compile(
                m,
                &format!("spec.mutations[{i}]"),
                regex_limit,
                &lookups.names,
                &mut errors,
            )
        })
        .collect();
    // A gate and autogen are for Pod rules only.
    let only_pods = !matcher.kinds().is_empty()
        && matcher
            .kinds()
            .iter()
            .all(|k| k.kind.exact() == Some("Pod") && k.group.exact().is_none_or(str::is_empty));
    let gate = spec.gate.as_ref().and_then(|g| {
        if !only_pods {
            errors.push(
                "spec.gate",
                "a gate holds Pods through scheduling gates: match.kinds must be only Pod",
            );
        }
        let exclude_labels = spec.exclude.as_ref().and_then(|e| {
            let only_labels = e.kinds.is_empty()
                && e.operations.is_none()
                && e.names.is_empty()
                && e.namespaces.is_empty()
                && e.namespace_selector.is_none()
                && e.annotations.is_empty();
            e.labels.as_ref().filter(|_| only_labels)
        });
        let own = gate::OwnPods {
            labels: spec.match_.labels.as_ref(),
            namespaces: &spec.match_.namespaces,
            exclude_labels,
        };
        let compiled = gate::compile(&id, g, &own, regex_limit, &mut errors)?;
        let hold = gate_mutations(&compiled.name, regex_limit, &mut errors);
        Some((compiled, hold))
    });
    let templates = match &spec.autogen {
        None => Templates::default(),
        Some(autogen) => {
            if !only_pods {
                errors.push(
                    "spec.autogen",
                    "autogen applies a Pod rule to Pod templates: match.kinds must be only Pod",
                );
            }
            if !matcher.operations().contains(&Operation::Create) {
                errors.push(
                    "spec.autogen",
                    "a Pod template describes Pods to be created: match.operations must include CREATE",
                );
            }
            if spec.gate.is_some() {
                errors.push(
                    "spec.autogen",
                    "a gate holds each Pod when it is created and cannot be put in a template: \
                     give the gate and the template mutations two rules, or remove autogen",
                );
            }
            Templates::new(
                autogen
                    .controllers
                    .as_deref()
                    .unwrap_or(&api::Controller::DEFAULT),
            )
        }
    };
    if !errors.errors.is_empty() {
        return Err(RuleErrors {
            rule: id.describe(),
            errors: errors.first_few(),
        });
    }
    // The rule's measured size: what the API server stored (its spec as JSON, a bound on what
    // the compiled literals hold) and what its queries and regexes hold.
    let spec_bytes = serde_json::to_vec(spec).map_or(0, |v| v.len());
    let held_bytes = spec_bytes
        .saturating_mul(SPEC_HELD_PER_BYTE)
        .saturating_add(meter.held_bytes());
    Ok(CompiledRule {
        held_bytes,
        id,
        priority: spec.priority,
        failure_policy: spec.failure_policy,
        mode: spec.mode,
        matcher,
        exclude,
        conditions,
        mutations,
        gate: gate.map(|(g, hold)| Gated {
            gate: Arc::new(g),
            hold,
        }),
        lookups: lookups.lookups,
        templates,
    })
}

/// What a gate rule adds to a Pod at CREATE, after its mutations: its scheduling gate (kept
/// once, whatever else is in the list) and the label the gate controller watches.
fn gate_mutations(name: &str, regex_limit: usize, errors: &mut Errors) -> Vec<Mutation> {
    let specs = [
        api::Mutation {
            upsert: Some(api::Upsert {
                path: "/spec/schedulingGates".into(),
                key: "name".into(),
                value: serde_json::json!({ "name": name }),
                position: api::Position::Append,
            }),
            ..Default::default()
        },
        api::Mutation {
            merge: Some(serde_json::json!({ "metadata": { "labels": { GATED_LABEL: "true" } } })),
            ..Default::default()
        },
    ];
    specs
        .iter()
        .filter_map(|m| mutation::compile(m, "spec.gate", regex_limit, &[], errors))
        .collect()
}

/// The regular expressions of a rule: conditions' `matches`, rewrites and templates'
/// `replace()`, also in `forEach`.
fn count_regexes(spec: &RuleSpec) -> usize {
    let conditions = spec
        .conditions
        .iter()
        .filter(|c| c.matches.is_some())
        .count();
    let mutations: usize = spec.mutations.iter().map(mutation::count_regexes).sum();
    conditions + mutations
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use serde_json::json;

    use crate::{Gvk, RanBefore, RuleIndex, compile_document};

    use super::*;

    /// The rule's mutations applied to `object` with `failurePolicy: Fail`: the output, or the
    /// denial's message.
    fn run(mutations: Value, object: Value) -> Result<Value, String> {
        let doc = json!({"apiVersion": "initium.dev/v1alpha1", "kind": "ClusterMutationRule",
                         "metadata": {"name": "r"},
                         "spec": {"failurePolicy": "Fail", "match": {"kinds": ["*"]},
                                  "mutations": mutations}});
        let rule = compile_document(&doc, "default").map_err(|e| e.to_string())?;
        let gvk = Gvk::from_api_version(
            object["apiVersion"].as_str().unwrap(),
            object["kind"].as_str().unwrap(),
        );
        let subject = Subject {
            gvk: &gvk,
            operation: Operation::Create,
            namespace: Some("default"),
            name: Some("web"),
            namespace_labels: None,
            lookups: None,
            ran_before: RanBefore::Unknown,
        };
        RuleIndex::new(vec![rule])
            .evaluate(&subject, object, None)
            .map(|o| o.object)
            .map_err(|d| d.message)
    }

    /// Fuzz, issue 36: templates that select numbers, booleans or objects, values written
    /// inside `forEach` or into a Pod template passed `initium check` and gave labels the API
    /// server refuses. The rule fails instead, saying what to do.
    #[test]
    fn a_rule_that_would_leave_a_label_value_that_is_not_a_string_fails() {
        let deployment = json!({"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "web", "labels": {"app": "web"}},
            "spec": {"replicas": 3, "template": {"metadata": {"labels": {"app": "web"}}}}});
        for (mutations, field, found) in [
            (
                json!([{"merge": {"metadata": {"labels": {"replicas": "{{ $.spec.replicas }}"}}}}]),
                "metadata.labels \"replicas\"",
                "a number",
            ),
            (
                json!([{"merge": {"spec": {"template": {"metadata": {"annotations": {"backup": true}}}}}}]),
                "spec.template.metadata.annotations \"backup\"",
                "a boolean",
            ),
            (
                json!([{"forEach": "$.metadata", "mutations": [{"merge": {"labels": {"all": "{{ $.metadata.labels }}"}}}]}]),
                "metadata.labels \"all\"",
                "an object",
            ),
            (
                json!([{"patch": [{"op": "add", "path": "/metadata/labels/0", "value": "x"}]},
                       {"patch": [{"op": "add", "path": "/spec/template/metadata/labels", "value": ["x"]}]}]),
                "spec.template.metadata.labels",
                "a list",
            ),
        ] {
            let message = run(mutations.clone(), deployment.clone()).unwrap_err();
            assert_eq!(
                message,
                format!(
                    "ClusterMutationRule r (failurePolicy Fail) failed: the rule would set {field} to {found}; labels and annotations are maps of strings: quote a value written in the rule, and wrap a template that selects a number or boolean in toJson(...)"
                ),
                "{mutations}"
            );
        }
    }

    /// Fuzz, issue 36: a template that renders null in a value written as it is (`upsert`,
    /// `patch`, a list in a `merge`) wrote `null`; it sets nothing, as in `defaults`. A null
    /// written in the rule stays.
    #[test]
    fn a_template_that_renders_null_in_a_written_value_sets_nothing() {
        let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web"},
                         "spec": {"containers": [{"name": "a"}]}});
        let out = run(
            json!([
                {"upsert": {"path": "/spec/containers/0/env", "key": "name",
                            "value": {"name": "A", "value": "{{ default($.x, null) }}"}}},
                {"patch": [{"op": "add", "path": "/metadata/labels/team",
                            "value": "{{ default($.metadata.annotations.team, null) }}"},
                           {"op": "add", "path": "/spec/x", "value": {"a": "{{ default($.x, null) }}", "b": null}}]},
                {"merge": {"spec": {"args": ["a", "{{ default($.x, null) }}"]}}},
            ]),
            pod,
        )
        .unwrap();
        assert_eq!(out["spec"]["containers"][0]["env"], json!([{"name": "A"}]));
        assert_eq!(out["metadata"].get("labels"), None);
        assert_eq!(out["spec"]["x"], json!({"b": null}));
        assert_eq!(out["spec"]["args"], json!(["a"]));
    }

    #[test]
    fn a_value_that_was_not_a_string_before_the_rule_is_not_its_doing() {
        let deployment = json!({"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "web", "labels": {"app": "web"}},
            "spec": {"replicas": 3, "template": {"metadata": {"labels": {"app": "web"}}}}});
        // What toJson makes is text; a value that was not a string before is not the rule's.
        let out = run(
            json!([{"merge": {"metadata": {"labels": {"replicas": "{{ toJson($.spec.replicas) }}"}}}}]),
            deployment.clone(),
        )
        .unwrap();
        assert_eq!(out["metadata"]["labels"]["replicas"], "3");
        let mut odd = deployment.clone();
        odd["metadata"]["labels"]["n"] = json!(1);
        let out = run(
            json!([{"merge": {"metadata": {"labels": {"team": "a"}}}}]),
            odd,
        )
        .unwrap();
        assert_eq!(out["metadata"]["labels"]["n"], 1);
    }
}
