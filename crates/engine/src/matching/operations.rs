//! `operations`: CREATE and/or UPDATE; `[CREATE]` when `match` leaves it out.

use crate::api::Operation;
use crate::error::Errors;
use crate::subject::Subject;

/// `None`: any operation (an `exclude` that leaves them out).
#[derive(Clone, Debug)]
pub(super) struct Operations(Option<Vec<Operation>>);

impl Operations {
    pub fn compile(
        operations: Option<&[Operation]>,
        at: &str,
        is_exclude: bool,
        errors: &mut Errors,
    ) -> Operations {
        if operations.is_some_and(<[Operation]>::is_empty) {
            errors.push(
                format!("{at}.operations"),
                "list at least one operation (CREATE, UPDATE) or leave it out",
            );
        }
        Operations(match operations {
            Some(ops) => Some(ops.to_vec()),
            None if is_exclude => None,
            None => Some(vec![Operation::Create]),
        })
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_none()
    }

    pub fn listed(&self) -> &[Operation] {
        self.0.as_deref().unwrap_or(&[])
    }

    pub fn matches(&self, subject: &Subject) -> bool {
        self.0
            .as_ref()
            .is_none_or(|ops| ops.contains(&subject.operation))
    }
}
