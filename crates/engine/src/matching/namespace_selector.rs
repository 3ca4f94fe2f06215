//! `namespaceSelector`: a label selector on the object's Namespace (ClusterMutationRule only).
//! A rule with one matches namespaced objects, and Namespace objects by their own labels.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use crate::error::Errors;

use super::selector::Selector;
use super::{Candidate, MatchError};

#[derive(Clone, Debug)]
pub(super) struct NamespaceSelector(Option<Selector>);

impl NamespaceSelector {
    pub fn compile(
        selector: Option<&LabelSelector>,
        at: &str,
        errors: &mut Errors,
    ) -> NamespaceSelector {
        NamespaceSelector(
            selector.map(|s| Selector::compile(s, &format!("{at}.namespaceSelector"), errors)),
        )
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_none()
    }

    /// True when, for this object, a rule with a namespaceSelector fails instead of matching
    /// or not: the labels of the object's Namespace are not known.
    pub fn cannot_tell(candidate: &Candidate) -> bool {
        !candidate.subject.is_namespace_object()
            && candidate.namespace().is_some()
            && candidate.subject.namespace_labels.is_none()
    }

    /// An error when the labels of the object's Namespace are not known (yet): guessing "no
    /// labels" could match a NotIn or DoesNotExist selector wrongly.
    pub fn matches(&self, candidate: &Candidate) -> Result<bool, MatchError> {
        let Some(selector) = &self.0 else {
            return Ok(true);
        };
        if candidate.subject.is_namespace_object() {
            return Ok(selector.matches(candidate.labels()));
        }
        match (candidate.namespace(), candidate.subject.namespace_labels) {
            (None, _) => Ok(false),
            (Some(_), Some(labels)) => Ok(selector.matches_map(labels)),
            (Some(namespace), None) => Err(MatchError::NamespaceLabelsUnknown {
                namespace: namespace.to_string(),
            }),
        }
    }
}
