//! `namespaces`: globs on the object's namespace (ClusterMutationRule only). A rule with them
//! matches namespaced objects, and Namespace objects by their own name.

use crate::error::Errors;
use crate::glob::Glob;

use super::{Candidate, compile_globs};

#[derive(Clone, Debug)]
pub(super) struct Namespaces(Vec<Glob>);

impl Namespaces {
    pub fn compile(namespaces: &[String], at: &str, errors: &mut Errors) -> Namespaces {
        Namespaces(compile_globs(
            namespaces,
            &format!("{at}.namespaces"),
            errors,
        ))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The namespaces, when none is a pattern (the index keys rules on them).
    pub fn literal(&self) -> Option<Vec<String>> {
        if self.0.is_empty() {
            return None;
        }
        self.0.iter().map(Glob::literal).collect()
    }

    pub fn matches(&self, candidate: &Candidate) -> bool {
        if self.0.is_empty() {
            return true;
        }
        candidate
            .namespace()
            .is_some_and(|ns| self.0.iter().any(|g| g.matches(ns)))
    }
}
