//! The pure engine: rules in, compiled index; object in, mutated object + patch + report out.
//! No Kubernetes client, no async, no I/O.

mod error;
mod evaluate;
mod glob;
mod index;
mod journal;
mod kind;
mod limits;
mod literal;
mod mutation;
mod parse;
mod path;
mod rule;
mod selector;
mod template;

pub use error::{FieldError, RuleErrors, sanitize};
pub use evaluate::{Denial, Outcome};
pub use index::RuleIndex;
pub use journal::PatchOp;
pub use kind::{Gvk, KindPattern, Segment};
pub use limits::{
    Limits, MAX_DEPTH, MAX_QUERY_DESCENDANTS, MAX_QUERY_NESTING, MAX_REGEX_BYTES, MAX_RULE_REGEXES,
    QUERY_WORK_LIMIT, RULE_REGEX_BYTES,
};
pub use parse::{RuleSource, compile_document, is_rule_document, parse_rule};
pub use path::type_name as describe_value;
pub use rule::{CompiledGate, CompiledRule, RuleId, Subject, compile, parse_duration};

/// Compiles every rule; the ones that fail are reported and left out, the others still work.
pub fn compile_all(sources: &[RuleSource]) -> (Vec<CompiledRule>, Vec<RuleErrors>) {
    let mut rules = Vec::new();
    let mut errors = Vec::new();
    for source in sources {
        match compile(source.id.clone(), &source.spec) {
            Ok(rule) => rules.push(rule),
            Err(e) => errors.push(e),
        }
    }
    (rules, errors)
}
