//! initium's engine: rules in, compiled index; object in, mutated object + patch + report
//! out. Pure: no Kubernetes client, no async, no I/O. Its own crate, so that Cargo keeps it
//! so: it depends on the CRD types' crates (`kube`'s derive, `k8s-openapi`, `schemars`) and
//! on the libraries of the rule language, never on `kube`'s client, tokio or hyper.
//!
//! [`api`] holds the CRD types (what a rule is, as `kubectl` sees it); [`untrusted`] the
//! escaping of text that came from a rule or an object.

pub mod api;
pub mod untrusted;

mod autogen;
mod duration;
mod error;
mod evaluate;
mod explain;
mod gate;
mod glob;
mod index;
mod journal;
mod json_out;
mod kind;
mod limits;
mod literal;
mod lookup;
mod lookup_store;
mod matching;
mod mutation;
mod pace;
mod parse;
mod path;
pub mod policy;
mod prefilter;
mod provenance;
mod rule;
mod scan;
mod stop;
mod subject;
mod template;

pub use autogen::NotInTemplate;
pub use duration::{DurationError, parse_duration};
pub use error::{FieldError, IdentityChange, InternalError, NotAString, RuleErrors};
pub use evaluate::{Audited, Denial, Outcome, Verdict};
pub use explain::{Step, StepResult};
pub use gate::{
    CLUSTER_SCOPED_KINDS, CompiledGate, DEFAULT_GATE_TIMEOUT, DEPLOYMENT_PROGRESS_DEADLINE,
    Dependency, JUDGED, OBJECT_JUDGE_BUDGET, Reads, Target, cluster_scoped_message, gate_name,
    is_cluster_scoped,
};
pub use index::RuleIndex;
pub use journal::PatchOp;
pub use kind::{Gvk, KindError, KindPattern, Segment};
pub use limits::{
    LimitError, Limits, MAX_DEPTH, MAX_QUERY_DESCENDANTS, MAX_QUERY_NESTING, MAX_REGEX_BYTES,
    MAX_RULE_REGEXES, QUERY_WORK_LIMIT, RULE_REGEX_BYTES, RegexError, human_bytes,
};
pub use lookup::{
    LookupError, LookupKind, LookupScope, LookupStore, LookupTarget, MAX_LOOKUPS, ScopeObjects,
};
pub use matching::MatchError;
pub use matching::{Conditions, Selector};
pub use mutation::MutationError;
pub use pace::{Pacer, paced, passed as checkpoint};
pub use parse::{RuleSource, compile_document, is_rule_document, parse_rule};
pub use path::{PointerError, QueryError, QueryProblem, type_name as describe_value};
pub use rule::{CompiledRule, compile};
pub use stop::ApplyError;
pub use subject::{RanBefore, RuleId, Subject};
pub use template::{MisplacedTemplate, TemplateError};

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
