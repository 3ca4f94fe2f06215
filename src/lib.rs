//! initium: a declarative initializer for Kubernetes.
//!
//! `engine` is pure: rules in, compiled index; object in, mutated object + patch + report out.
//! It is its own crate, `initium-engine` (crates/engine), with the CRD types (`api`) and the
//! escaping of untrusted text (`untrusted`); they are re-exported here under their names. The adapters around the engine: `admission` (the HTTPS webhook),
//! `controller` (the duties that talk to the API server), `tls` (the serving certificate),
//! `ops` (health and metrics). `serve` composes them into `initium serve`; `cli` is the command
//! line, and the offline commands (the engine with no cluster). See docs/architecture.md.

pub mod admission;
pub mod cli;
pub mod controller;
pub mod kube_errors;
pub mod metrics;
pub mod ops;
pub mod report;
pub mod serve;
pub mod tls;

pub use initium_engine as engine;
pub use initium_engine::{api, untrusted};

use engine::RuleErrors;
pub use report::report;

/// A cause kept below one of initium's errors, for the chain [`report`] prints.
pub type Cause = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong in initium's commands, with enough context to act on. The
/// library error an error comes from stays reachable through `source()`; [`report`] renders
/// the whole chain as the one sentence a person reads.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file or document could not be read, or is not what initium reads.
    #[error("{origin}: {message}")]
    Input {
        /// The file (`<stdin>`, `file.yaml#2` for the second document).
        origin: String,
        message: String,
        #[source]
        source: Option<Cause>,
    },
    /// One or more rules are invalid; every problem is listed.
    #[error("{}", render_rule_errors(.0))]
    InvalidRules(Vec<RuleErrors>),
    /// A `failurePolicy: Fail` rule rejected objects.
    #[error("{0}")]
    Denied(String),
    /// Writing results failed.
    #[error("cannot write {what}")]
    Output {
        /// What was being written: `the results`, `crds/initium.dev_mutationrules.yaml`.
        what: String,
        #[source]
        source: Cause,
    },
    /// `initium serve` could not start or stopped on an error.
    #[error("{message}")]
    Serve {
        message: String,
        #[source]
        source: Option<Cause>,
    },
    /// The controller's configuration is invalid, or it stopped: its own error and causes.
    #[error(transparent)]
    Controller(#[from] controller::ControllerError),
    /// The serving certificate could not be loaded: its own error and causes.
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
    /// Test cases failed (the report has the details).
    #[error("{failed} of {total} test case(s) failed")]
    TestsFailed { failed: usize, total: usize },
}

impl Error {
    /// A file or document that is not what initium reads; `message` says why.
    pub(crate) fn input(origin: impl Into<String>, message: impl Into<String>) -> Error {
        Error::Input {
            origin: origin.into(),
            message: message.into(),
            source: None,
        }
    }

    /// Reading `origin` failed with `source`; `message` says what initium was doing.
    pub(crate) fn input_from(
        origin: impl Into<String>,
        message: impl Into<String>,
        source: impl Into<Cause>,
    ) -> Error {
        Error::Input {
            origin: origin.into(),
            message: message.into(),
            source: Some(source.into()),
        }
    }

    /// Writing `what` failed.
    pub(crate) fn output(what: impl Into<String>, source: impl Into<Cause>) -> Error {
        Error::Output {
            what: what.into(),
            source: source.into(),
        }
    }

    /// `initium serve` cannot start or go on; `message` says why and what to do.
    pub(crate) fn serve(message: impl Into<String>) -> Error {
        Error::Serve {
            message: message.into(),
            source: None,
        }
    }

    /// `initium serve` cannot start or go on because of `source`.
    pub(crate) fn serve_from(message: impl Into<String>, source: impl Into<Cause>) -> Error {
        Error::Serve {
            message: message.into(),
            source: Some(source.into()),
        }
    }
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

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn report_follows_the_cause_chain_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let error = Error::input_from("rules.yaml", "cannot read", io);
        assert_eq!(report(&error), "rules.yaml: cannot read: no such file");
        let source = std::error::Error::source(&error).map(ToString::to_string);
        assert_eq!(
            source.as_deref(),
            Some("no such file"),
            "the cause stays reachable"
        );

        // A message that already quotes its cause does not repeat it.
        let io = std::io::Error::new(std::io::ErrorKind::AddrInUse, "address in use");
        let error = Error::serve_from(format!("cannot listen on :8443: {io}; stop it"), io);
        assert_eq!(
            report(&error),
            "cannot listen on :8443: address in use; stop it"
        );
    }
}
