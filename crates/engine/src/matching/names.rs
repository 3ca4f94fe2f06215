//! `names`: globs on `metadata.name`, or on `metadata.generateName` while the name is not set.

use crate::error::Errors;
use crate::glob::Glob;

use super::{Candidate, compile_globs};

#[derive(Clone, Debug)]
pub(super) struct Names(Vec<Glob>);

impl Names {
    pub fn compile(names: &[String], at: &str, errors: &mut Errors) -> Names {
        Names(compile_globs(names, &format!("{at}.names"), errors))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn matches(&self, candidate: &Candidate) -> bool {
        if self.0.is_empty() {
            return true;
        }
        let name = candidate.glob_name();
        self.0.iter().any(|g| g.matches(name))
    }

    pub fn globs(&self) -> &[Glob] {
        &self.0
    }
}
