use std::fmt;

use crate::untrusted::escape;

/// A problem with one field of one rule: `<rule>: <field>: <message>`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldError {
    /// Field path from the rule's root, e.g. `spec.mutations[2].upsert.path`.
    pub field: String,
    pub message: String,
}

impl FieldError {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> FieldError {
        FieldError {
            field: field.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", escape(&self.field), escape(&self.message))
    }
}

/// All the problems found in one rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleErrors {
    /// `MutationRule payments/test-certs` or `ClusterMutationRule mirror`.
    pub rule: String,
    pub errors: Vec<FieldError>,
}

impl fmt::Display for RuleErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.errors.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{}: {}", escape(&self.rule), e)?;
        }
        Ok(())
    }
}

impl std::error::Error for RuleErrors {}

/// Collects field errors while compiling a rule, with a stack of field-path segments.
#[derive(Default)]
pub(crate) struct Errors {
    pub errors: Vec<FieldError>,
}

/// The most problems of one rule that are reported: one mistake repeated in every mutation of
/// a large rule (3,001 errors, 994 KB, for a rule over the regex count) would otherwise fill
/// a status, a denial and a log line with the same sentence.
pub const MAX_REPORTED_ERRORS: usize = 20;

impl Errors {
    /// The first [`MAX_REPORTED_ERRORS`] problems, and one more line that counts the rest.
    pub fn first_few(mut self) -> Vec<FieldError> {
        let more = self.errors.len().saturating_sub(MAX_REPORTED_ERRORS);
        if more > 0 {
            self.errors.truncate(MAX_REPORTED_ERRORS);
            self.errors.push(FieldError::new(
                "spec",
                format!("and {more} more problems like these; fix these first"),
            ));
        }
        self.errors
    }

    pub fn push(&mut self, field: impl Into<String>, message: impl fmt::Display) {
        self.errors
            .push(FieldError::new(field, message.to_string()));
    }
}

/// A panic caught at the rule boundary: a bug, here or in a library.
#[derive(Debug, thiserror::Error)]
#[error(
    "initium hit an internal error while running the rule ({}); the rule was skipped — please report this with the rule",
    escape(.detail)
)]
pub struct InternalError {
    detail: String,
}

impl InternalError {
    /// What the panic said.
    pub(crate) fn from_panic(panic: &(dyn std::any::Any + Send)) -> InternalError {
        let detail = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "no detail".to_string());
        InternalError { detail }
    }
}

/// A rule that would leave a label or annotation value that is not a string (a template that
/// selected a number, a boolean or an object, a value written inside `forEach` or into a Pod
/// template), or labels or annotations that are not an object: the API server refuses the
/// object with a message that does not name the rule.
#[derive(Debug, thiserror::Error)]
#[error(
    "the rule would set {field} to {found}; labels and annotations are maps of strings: quote a value written in the rule, and wrap a template that selects a number or boolean in toJson(...)"
)]
pub struct NotAString {
    /// `metadata.labels "team"`, `spec.template.metadata.annotations`.
    pub field: String,
    /// `a number`, `a boolean`, `a list`.
    pub found: &'static str,
}

/// A rule that would move the object to another name, namespace or type, which the API
/// server refuses with a message that does not name the rule.
#[derive(Debug, thiserror::Error)]
#[error(
    "the rule would change {field} from {before} to {after}; a rule may not change an object's apiVersion, kind, name or namespace"
)]
pub struct IdentityChange {
    pub field: &'static str,
    /// The value as the message shows it: quoted strings, `nothing`, or the type.
    pub before: String,
    pub after: String,
}
