use std::borrow::Cow;
use std::fmt;

/// Text that came from a rule or an object (names, values, patterns), made safe for a
/// terminal and a log line: control characters — escape sequences that could recolour or
/// rewrite a terminal, carriage returns, newlines — are written as `\u{1b}`-style escapes.
pub fn sanitize(text: &str) -> Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if c.is_control() {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

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
        write!(f, "{}: {}", sanitize(&self.field), sanitize(&self.message))
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
            write!(f, "{}: {}", sanitize(&self.rule), e)?;
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

impl Errors {
    pub fn push(&mut self, field: impl Into<String>, message: impl Into<String>) {
        self.errors.push(FieldError::new(field, message));
    }
}
