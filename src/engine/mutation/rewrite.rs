//! `rewrite`: a regular-expression rewrite of a string field; a missing field is left alone.

use regex::Regex;
use serde_json::Value;

use crate::api;
use crate::engine::journal::Journal;
use crate::engine::limits::{Meter, Stop};
use crate::engine::path::{Pointer, type_name};

use super::{Compiler, MutationError, Site};

#[derive(Clone, Debug)]
pub(crate) struct Rewrite {
    path: Pointer,
    regex: Regex,
    replacement: String,
}

pub(super) fn compile(spec: &api::Rewrite, at: &str, cx: &mut Compiler) -> Option<Rewrite> {
    let path = cx.pointer(&spec.path, &format!("{at}.rewrite.path"));
    let regex = cx.regex(&spec.regex, &format!("{at}.rewrite.regex"));
    Some(Rewrite {
        path: path?,
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
                if let Some(new) = rewrite(&self.regex, current, &self.replacement, meter)?
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

/// `regex.replace_all(text, replacement)`, refusing before it builds a result larger than
/// the rule may still write (a replacement such as `$0$0` doubles the text each time a rule
/// applies it). `None` when nothing matched.
fn rewrite(
    regex: &Regex,
    text: &str,
    replacement: &str,
    meter: &mut Meter,
) -> Result<Option<String>, Stop> {
    // Each `$` reference expands to at most the whole match (groups lie inside it).
    let references = replacement.matches('$').count();
    let limit = meter.remaining();
    let mut out = String::new();
    let mut last = 0;
    let mut matched = false;
    let check = |meter: &mut Meter, out: &String, last: usize, start: usize, end: usize| {
        let most = out.len() + (start - last) + replacement.len() + references * (end - start);
        if most > limit {
            // Counting what it would write fails, with the limit in the message.
            return meter.write(most);
        }
        Ok(())
    };
    if references == 0 {
        for (n, m) in regex.find_iter(text).enumerate() {
            check(meter, &out, last, m.start(), m.end())?;
            out.push_str(&text[last..m.start()]);
            out.push_str(replacement);
            last = m.end();
            matched = true;
            if n % 64 == 63 {
                meter.check_clock()?;
            }
        }
    } else {
        for (n, caps) in regex.captures_iter(text).enumerate() {
            let Some(whole) = caps.get(0) else {
                continue;
            };
            check(meter, &out, last, whole.start(), whole.end())?;
            out.push_str(&text[last..whole.start()]);
            caps.expand(replacement, &mut out);
            last = whole.end();
            matched = true;
            if n % 64 == 63 {
                meter.check_clock()?;
            }
        }
    }
    if !matched {
        return Ok(None);
    }
    out.push_str(&text[last..]);
    meter.write(out.len())?;
    Ok(Some(out))
}
