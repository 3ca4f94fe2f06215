//! initium: a declarative initializer for Kubernetes.
//!
//! `engine` is pure: rules in, compiled index; object in, mutated object + patch + report out.
//! `api` holds the CRD types. The adapters around the engine: `admission` (the HTTPS webhook),
//! `controller` (the duties that talk to the API server), `tls` (the serving certificate) and
//! `cli` (the commands, offline ones included).

pub mod admission;
pub mod api;
pub mod cli;
pub mod controller;
pub mod engine;
pub mod metrics;
pub mod ops;
pub mod state;
pub mod tls;

use engine::RuleErrors;

/// Everything that can go wrong in initium's commands, with enough context to act on.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file or document could not be read.
    #[error("{origin}: {message}")]
    Input { origin: String, message: String },
    /// One or more rules are invalid; every problem is listed.
    #[error("{}", render_rule_errors(.0))]
    InvalidRules(Vec<RuleErrors>),
    /// A `failurePolicy: Fail` rule rejected objects.
    #[error("{0}")]
    Denied(String),
    /// Writing results failed.
    #[error("{0}")]
    Output(String),
    /// `initium serve` could not start or stopped on an error.
    #[error("{0}")]
    Serve(String),
    /// Test cases failed (the report has the details).
    #[error("{failed} of {total} test case(s) failed")]
    TestsFailed { failed: usize, total: usize },
}

fn render_rule_errors(errors: &[RuleErrors]) -> String {
    let count: usize = errors.iter().map(|e| e.errors.len()).sum();
    let lines: Vec<String> = errors.iter().map(ToString::to_string).collect();
    format!(
        "{count} error(s) in {} rule(s):\n{}",
        errors.len(),
        lines.join("\n")
    )
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
