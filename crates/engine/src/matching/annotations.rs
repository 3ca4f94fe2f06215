//! `annotations`: annotation key -> glob on its value; `*` only requires the key.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::glob::Glob;

use super::Candidate;

#[derive(Clone, Debug)]
pub(super) struct Annotations(Vec<(String, Glob)>);

impl Annotations {
    pub fn compile(annotations: &BTreeMap<String, String>) -> Annotations {
        Annotations(
            annotations
                .iter()
                .map(|(k, v)| (k.clone(), Glob::new(v)))
                .collect(),
        )
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The key of the first annotation it requires: it cannot match an object without it.
    pub fn first_key(&self) -> Option<&str> {
        self.0.first().map(|(key, _)| key.as_str())
    }

    pub fn matches(&self, candidate: &Candidate) -> bool {
        if self.0.is_empty() {
            return true;
        }
        let annotations = candidate.annotations();
        self.0.iter().all(|(key, glob)| {
            annotations
                .and_then(|a| a.get(key))
                .and_then(Value::as_str)
                .is_some_and(|v| glob.matches(v))
        })
    }
}
