//! `kinds`: `Kind`, `version/Kind` or `group/version/Kind`, `*` allowed per segment.

use crate::error::Errors;
use crate::kind::KindPattern;
use crate::subject::Subject;

#[derive(Clone, Debug)]
pub(super) struct Kinds(Vec<KindPattern>);

impl Kinds {
    /// `match` must list a kind; `exclude` need not.
    pub fn compile(kinds: &[String], at: &str, is_exclude: bool, errors: &mut Errors) -> Kinds {
        let mut patterns = Vec::new();
        for (i, k) in kinds.iter().enumerate() {
            match KindPattern::parse(k) {
                Ok(p) => patterns.push(p),
                Err(e) => errors.push(format!("{at}.kinds[{i}]"), e),
            }
        }
        if !is_exclude && kinds.is_empty() {
            errors.push(
                format!("{at}.kinds"),
                "list at least one kind, e.g. [Pod] (use [\"*\"] for every kind)",
            );
        }
        Kinds(patterns)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn patterns(&self) -> &[KindPattern] {
        &self.0
    }

    pub fn matches(&self, subject: &Subject) -> bool {
        self.0.is_empty() || self.0.iter().any(|k| k.matches(subject.gvk))
    }
}
