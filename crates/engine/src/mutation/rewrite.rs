//! `rewrite`: a regular-expression rewrite of a string field; a missing field is left alone.

use crate::limits::RuleRegex;
use serde_json::Value;

use crate::api;
use crate::journal::Journal;
use crate::limits::{Meter, replace_all, starts_anchored};
use crate::path::{Pointer, type_name};
use crate::stop::Stop;

use super::{Compiler, MutationError, Site};

#[derive(Clone, Debug)]
pub(crate) struct Rewrite {
    path: Pointer,
    regex: RuleRegex,
    /// Every match starts at the start of the value: one search, not one more after it.
    once: bool,
    replacement: String,
}

pub(super) fn compile(spec: &api::Rewrite, at: &str, cx: &mut Compiler) -> Option<Rewrite> {
    let path = cx.pointer(&spec.path, &format!("{at}.rewrite.path"));
    let regex = cx.regex(&spec.regex, &format!("{at}.rewrite.regex"));
    Some(Rewrite {
        path: path?,
        once: starts_anchored(&spec.regex),
        regex: regex?,
        replacement: spec.replacement.clone(),
    })
}

impl Rewrite {
    pub(super) fn apply(
        &self,
        site: Site,
        journal: &mut Journal,
        meter: &mut Meter,
    ) -> Result<(), Stop> {
        let base = site.base();
        let target = site.target()?;
        match self.path.get_mut(target) {
            None => Ok(()),
            Some(Value::String(current)) => {
                if let Some(new) =
                    replace_all(&self.regex, self.once, current, &self.replacement, meter)?
                    && new != *current
                {
                    let prior = std::mem::replace(current, new);
                    journal.record(base.join(&self.path), Some(&Value::String(prior)));
                }
                Ok(())
            }
            Some(other) => Err(MutationError::RewriteNotString {
                path: self.path.as_str().to_string(),
                found: type_name(other),
            }
            .into()),
        }
    }
}
