//! An error and its causes as the one line a person reads: what `initium` prints and every
//! duty logs. A ground-floor module: every part of initium reports its errors through it, so
//! it knows none of them (only the kube client's errors, through [`crate::kube_errors`]).

use crate::kube_errors;

/// An error and its causes as one line of text, `outer: cause: cause`: what `initium` prints
/// and logs. A cause whose text the line already holds (an error that quotes its source) is
/// not repeated.
pub fn report(error: &(dyn std::error::Error + 'static)) -> String {
    // A kube client or watch error is a sentence of its own (kube's `Display` is a `Debug`
    // dump of the API server's Status) and ends the chain: its causes are in the sentence.
    if let Some(text) = kube_errors::sentence(error) {
        return text;
    }
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let (line, last) = match kube_errors::sentence(cause) {
            Some(sentence) => (sentence, true),
            None => (cause.to_string(), false),
        };
        if !line.is_empty() && !text.contains(&line) {
            text.push_str(": ");
            text.push_str(&line);
        }
        if last {
            break;
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use kube::core::Status;

    fn api(code: u16, reason: &str, message: &str) -> kube::Error {
        let mut status = Status::failure(message, reason);
        status.code = code;
        kube::Error::Api(Box::new(status))
    }

    /// An error of initium's own around a cause, as the controller's and the commands' are.
    #[derive(Debug, thiserror::Error)]
    #[error("{message}")]
    struct Outer<E: std::error::Error + 'static> {
        message: String,
        #[source]
        source: E,
    }

    #[test]
    fn report_follows_the_cause_chain_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let error = Outer {
            message: "rules.yaml: cannot read".into(),
            source: io,
        };
        assert_eq!(report(&error), "rules.yaml: cannot read: no such file");

        // A message that already quotes its cause does not repeat it.
        let io = std::io::Error::new(std::io::ErrorKind::AddrInUse, "address in use");
        let error = Outer {
            message: format!("cannot listen on :8443: {io}; stop it"),
            source: io,
        };
        assert_eq!(
            report(&error),
            "cannot listen on :8443: address in use; stop it"
        );
    }

    #[test]
    fn a_lease_error_is_the_sentence_of_the_kube_error_it_wraps() {
        let error = kube_lease_manager::LeaseManagerError::KubeError(api(
            409,
            "Conflict",
            "Operation cannot be fulfilled on leases.coordination.k8s.io \"initium\"",
        ));
        let text = report(&error);
        assert_eq!(
            text,
            "the API server answered: Operation cannot be fulfilled on \
             leases.coordination.k8s.io \"initium\" (409 Conflict). Someone else wrote the same \
             object at the same time; initium retries."
        );
        assert!(!text.contains("Kube error"), "{text}");
    }

    #[test]
    fn the_report_of_a_chain_ends_at_the_kube_error() {
        let error = Outer {
            message: "cannot get Lease initium-dev/initium".into(),
            source: api(404, "NotFound", "leases \"initium\" not found"),
        };
        let text = report(&error);
        assert_eq!(
            text,
            "cannot get Lease initium-dev/initium: the API server answered: leases \"initium\" \
             not found (404 NotFound)."
        );
    }
}
