//! Which objects a rule applies to: `match` and `exclude` (one file per field, each with the
//! field's compile and matcher function) and `conditions` on the object's content.
//!
//! To add a match field: a field in `api::MatchResources`, a file here with its compiled form,
//! `compile` and `matches` (and `is_empty`), and one line each in [`Matcher`],
//! [`Matcher::compile`], [`Matcher::is_empty`] and [`Matcher::matches`]. Matching is on the
//! admission path of every candidate rule: keep it free of allocation.

mod annotations;
mod conditions;
mod kinds;
mod labels;
mod names;
mod namespace_selector;
mod namespaces;
mod operations;
mod selector;

use serde_json::{Map, Value};

use crate::api::{MatchResources, Operation};

use super::error::{Errors, InternalError};
use super::glob::Glob;
use super::kind::KindPattern;
use super::path::QueryError;
use super::subject::Subject;

use annotations::Annotations;
pub use conditions::Conditions;
#[cfg(test)]
pub(crate) use conditions::PREPARED;
pub(crate) use conditions::Prepared;
use kinds::Kinds;
use labels::Labels;
use names::Names;
use namespace_selector::NamespaceSelector;
use namespaces::Namespaces;
use operations::Operations;
pub use selector::Selector;

/// A compiled `match` or `exclude`: every field given must hold.
#[derive(Clone, Debug)]
pub(crate) struct Matcher {
    kinds: Kinds,
    operations: Operations,
    names: Names,
    namespaces: Namespaces,
    namespace_selector: NamespaceSelector,
    labels: Labels,
    annotations: Annotations,
}

impl Matcher {
    /// Compiles `match` (at `spec.match`) or, with `is_exclude`, `exclude`, whose omitted
    /// fields select nothing instead of their defaults.
    pub fn compile(m: &MatchResources, at: &str, is_exclude: bool, errors: &mut Errors) -> Matcher {
        Matcher {
            kinds: Kinds::compile(&m.kinds, at, is_exclude, errors),
            operations: Operations::compile(m.operations.as_deref(), at, is_exclude, errors),
            names: Names::compile(&m.names, at, errors),
            namespaces: Namespaces::compile(&m.namespaces, at, errors),
            namespace_selector: NamespaceSelector::compile(
                m.namespace_selector.as_ref(),
                at,
                errors,
            ),
            labels: Labels::compile(m.labels.as_ref(), at, errors),
            annotations: Annotations::compile(&m.annotations),
        }
    }

    /// True when no field is given (an `exclude` like that would skip every object).
    pub fn is_empty(&self) -> bool {
        self.kinds.is_empty()
            && self.operations.is_empty()
            && self.names.is_empty()
            && self.namespaces.is_empty()
            && self.namespace_selector.is_empty()
            && self.labels.is_empty()
            && self.annotations.is_empty()
    }

    pub fn kinds(&self) -> &[KindPattern] {
        self.kinds.patterns()
    }

    /// The operations matched; empty when any operation is (an `exclude` without them).
    pub fn operations(&self) -> &[Operation] {
        self.operations.listed()
    }

    /// What an object must have for this `match` to hold, as far as the index's prefilter can
    /// look it up (see [`Needs`]).
    pub fn needs(&self) -> Needs<'_> {
        Needs {
            operations: self.operations.listed(),
            label: self.labels.need(),
            names: self.names.globs(),
            annotation: self.annotations.first_key(),
            namespace_selector: !self.namespace_selector.is_empty(),
        }
    }

    /// Namespace names the matcher is limited to when they are all literal (for the index).
    pub fn literal_namespaces(&self) -> Option<Vec<String>> {
        self.namespaces.literal()
    }

    /// Whether the object matches. An error when it cannot be told: the labels of the
    /// object's Namespace are needed but not known (yet).
    pub fn matches(&self, subject: &Subject, object: &Value) -> Result<bool, MatchError> {
        // What the request says is checked before the object is looked into.
        if !self.kinds.matches(subject) || !self.operations.matches(subject) {
            return Ok(false);
        }
        let candidate = Candidate::new(subject, object);
        Ok(self.names.matches(&candidate)
            && self.namespaces.matches(&candidate)
            && self.namespace_selector.matches(&candidate)?
            && self.labels.matches(&candidate)
            && self.annotations.matches(&candidate))
    }
}

impl Matcher {
    /// The first field (its name in the API, e.g. `labels`) that does not hold for the object;
    /// `None` when every field holds. For `initium explain`, not the admission path.
    pub fn first_mismatch(
        &self,
        subject: &Subject,
        object: &Value,
    ) -> Result<Option<&'static str>, MatchError> {
        if !self.kinds.matches(subject) {
            return Ok(Some("kinds"));
        }
        if !self.operations.matches(subject) {
            return Ok(Some("operations"));
        }
        let candidate = Candidate::new(subject, object);
        Ok(if !self.names.matches(&candidate) {
            Some("names")
        } else if !self.namespaces.matches(&candidate) {
            Some("namespaces")
        } else if !self.namespace_selector.matches(&candidate)? {
            Some("namespaceSelector")
        } else if !self.labels.matches(&candidate) {
            Some("labels")
        } else if !self.annotations.matches(&candidate) {
            Some("annotations")
        } else {
            None
        })
    }
}

/// What a `match` needs of an object, each a necessary condition that the index's prefilter
/// looks up for many rules at once (`engine/prefilter.rs`); the matcher still decides.
#[derive(Debug)]
pub(crate) struct Needs<'r> {
    /// The operations it accepts (empty: any).
    pub operations: &'r [Operation],
    pub label: Option<LabelNeed<'r>>,
    /// The object's name (see [`Candidate::glob_name`]) must match one (empty: any name).
    pub names: &'r [Glob],
    /// An annotation key the object must have.
    pub annotation: Option<&'r str>,
    /// It has a namespaceSelector (see [`NamespaceSelector::cannot_tell`]).
    pub namespace_selector: bool,
}

/// A label the object must have.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum LabelNeed<'r> {
    /// The label `key` with one of these values.
    Value(&'r str, &'r [String]),
    /// The label `key`, with any value.
    Key(&'r str),
}

/// The object under admission as the match fields look at it.
#[derive(Clone, Copy)]
pub(crate) struct Candidate<'a> {
    subject: &'a Subject<'a>,
    metadata: Option<&'a Value>,
}

impl<'a> Candidate<'a> {
    pub(crate) fn new(subject: &'a Subject<'a>, object: &'a Value) -> Candidate<'a> {
        Candidate {
            subject,
            metadata: object.get("metadata"),
        }
    }

    /// A string field of `metadata`, when set and not empty.
    fn metadata_str(&self, field: &str) -> Option<&'a str> {
        self.metadata
            .and_then(|m| m.get(field))
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
    }

    /// A map field of `metadata` (`labels`, `annotations`).
    fn metadata_map(&self, field: &str) -> Option<&'a Map<String, Value>> {
        self.metadata
            .and_then(|m| m.get(field))
            .and_then(Value::as_object)
    }

    /// The request's operation.
    pub(crate) fn operation(&self) -> Operation {
        self.subject.operation
    }

    /// `metadata.labels`.
    pub(crate) fn labels(&self) -> Option<&'a Map<String, Value>> {
        self.metadata_map("labels")
    }

    /// `metadata.annotations`.
    pub(crate) fn annotations(&self) -> Option<&'a Map<String, Value>> {
        self.metadata_map("annotations")
    }

    /// The name `names` globs match: the name, or `generateName` while there is none.
    pub(crate) fn glob_name(&self) -> &'a str {
        self.name()
            .or_else(|| self.metadata_str("generateName"))
            .unwrap_or("")
    }

    /// True when a namespaceSelector cannot be told on this object (see
    /// [`NamespaceSelector::cannot_tell`]).
    pub(crate) fn namespace_labels_unknown(&self) -> bool {
        NamespaceSelector::cannot_tell(self)
    }

    /// The request's name, or the object's while the request has none.
    fn name(&self) -> Option<&'a str> {
        self.subject
            .name
            .filter(|n| !n.is_empty())
            .or_else(|| self.metadata_str("name"))
    }

    /// The namespace a rule restricted by namespace looks at: the object's, or a Namespace
    /// object's own name; `None` for other cluster-scoped objects, which such a rule never
    /// matches.
    fn namespace(&self) -> Option<&'a str> {
        if self.subject.is_namespace_object() {
            self.name()
        } else {
            self.subject.namespace.filter(|n| !n.is_empty())
        }
    }
}

/// Globs (names, namespaces) with an error for each empty one.
fn compile_globs(list: &[String], at: &str, errors: &mut Errors) -> Vec<Glob> {
    for (i, pattern) in list.iter().enumerate() {
        if pattern.is_empty() {
            errors.push(
                format!("{at}[{i}]"),
                "empty pattern matches nothing; use \"*\" for any",
            );
        }
    }
    list.iter().map(|p| Glob::new(p)).collect()
}

/// Why it cannot be told whether a rule applies to an object; the rule's failure policy
/// decides.
#[derive(Debug, thiserror::Error)]
pub enum MatchError {
    #[error("the labels of namespace {namespace} are not known yet (needed by namespaceSelector)")]
    NamespaceLabelsUnknown { namespace: String },
    #[error("spec.conditions[{index}].path: {source}")]
    Condition { index: usize, source: QueryError },
    #[error("spec.conditions[{index}].matches: {source}")]
    ConditionSearch {
        index: usize,
        source: crate::limits::RegexWorkError,
    },
    #[error(
        "spec.conditions[{index}].in: the values it selects from this object come to more than {} (the limit of an in: set); select fewer values, for example a list of names rather than $..*",
        crate::limits::human_bytes(crate::limits::MAX_IN_SET_BYTES)
    )]
    InSetTooLarge { index: usize },
    /// The latency budget ran out between two conditions: the rule is out of time.
    #[error("the latency budget ran out while the rule's conditions were tested")]
    OutOfTime,
    #[error(transparent)]
    Internal(#[from] InternalError),
}
