//! `labels`: a label selector on the object's own labels.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use crate::error::Errors;

use super::selector::Selector;
use super::{Candidate, LabelNeed};

#[derive(Clone, Debug)]
pub(super) struct Labels(Option<Selector>);

impl Labels {
    pub fn compile(selector: Option<&LabelSelector>, at: &str, errors: &mut Errors) -> Labels {
        Labels(selector.map(|s| Selector::compile(s, &format!("{at}.labels"), errors)))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_none()
    }

    pub fn matches(&self, candidate: &Candidate) -> bool {
        self.0
            .as_ref()
            .is_none_or(|s| s.matches(candidate.labels()))
    }

    pub fn need(&self) -> Option<LabelNeed<'_>> {
        self.0.as_ref().and_then(Selector::label_need)
    }
}
