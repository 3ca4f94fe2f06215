//! Why a rule stopped while it ran: out of time, or an error put in context. The ground floor
//! every part of the engine that runs a rule returns to: a [`Stop`] carries its cause boxed,
//! so the parts do not know each other's errors.

use std::error::Error;
use std::fmt;

/// Why a rule stopped: an error or a limit (a sentence for the client), or out of time.
#[derive(Debug)]
pub(crate) enum Stop {
    Error(Box<ApplyError>),
    Budget,
}

/// Any error of a part of the engine (a limit, a template, a query, a mutation...) stops the
/// rule with that error as its cause.
impl<E: Error + Send + Sync + 'static> From<E> for Stop {
    fn from(error: E) -> Self {
        Stop::Error(Box::new(ApplyError {
            at: Vec::new(),
            cause: Box::new(error),
        }))
    }
}

impl Stop {
    /// The same stop, put in context: where in the rule or the object it happened (the
    /// budget needs none).
    pub fn context(self, at: impl FnOnce() -> String) -> Stop {
        match self {
            Stop::Error(mut error) => {
                error.at.push(at());
                Stop::Error(error)
            }
            Stop::Budget => Stop::Budget,
        }
    }
}

impl fmt::Display for Stop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Stop::Error(error) => error.fmt(f),
            Stop::Budget => f.write_str("the latency budget ran out while the rule was running"),
        }
    }
}

/// Why a rule failed on an object: a sentence for the client that says where in the rule (and
/// in the object) it happened, then the cause, which is also its `source()`'s start.
#[derive(Debug)]
pub struct ApplyError {
    /// Where, innermost first: `where[0]`, `spec.mutations[2]`.
    at: Vec<String>,
    cause: Box<dyn Error + Send + Sync>,
}

impl ApplyError {
    /// The error the rule stopped on, without where it happened.
    pub fn cause(&self) -> &(dyn Error + Send + Sync + 'static) {
        &*self.cause
    }
}

impl fmt::Display for ApplyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for at in self.at.iter().rev() {
            write!(f, "{at}: ")?;
        }
        self.cause.fmt(f)
    }
}

impl Error for ApplyError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.cause.source()
    }
}
