//! The errors of the Kubernetes client as sentences a person can act on.
//!
//! kube's own `Display` of an API error is `ApiError: <message> (Status { ... })`, a `Debug`
//! dump; a watch error wraps that again. `report` renders every kube error it meets in an
//! error chain with [`describe`], so what `initium` prints and logs says what the API server
//! answered and what to do about it.

use kube::runtime::watcher;

/// `error` as a sentence: what the API server answered (its message, code and reason) with a
/// hint for the codes a person can fix, or why the API server could not be reached.
pub fn describe(error: &kube::Error) -> String {
    match error {
        kube::Error::Api(status) => {
            let hint = match status.code {
                401 => {
                    " Check the credentials of the kubeconfig initium uses (KUBECONFIG, or the \
                     service account token in a Pod)."
                }
                403 => {
                    " initium's RBAC does not allow it: apply deploy/rbac.yaml (or the Helm \
                     chart) of this version again, or grant what the message names."
                }
                409 => " Someone else wrote the same object at the same time; initium retries.",
                429 => " The API server is overloaded; initium retries.",
                500..=599 => " The API server failed; initium retries.",
                _ => "",
            };
            let message = if status.message.is_empty() {
                "no message".to_string()
            } else {
                status.message.clone()
            };
            let reason = if status.reason.is_empty() {
                String::new()
            } else {
                format!(" {}", status.reason)
            };
            format!(
                "the API server answered: {message} ({}{reason}).{hint}",
                status.code
            )
        }
        kube::Error::HyperError(_) | kube::Error::Service(_) => format!(
            "cannot reach the API server: {}. Check that it runs and that the kubeconfig \
             (KUBECONFIG) points at it.",
            innermost(error)
        ),
        kube::Error::Auth(_) => format!(
            "cannot authenticate to the API server: {}. Check the credentials of the \
             kubeconfig (KUBECONFIG).",
            innermost(error)
        ),
        kube::Error::SerdeError(e) => {
            format!("the API server's answer could not be read: {e}")
        }
        kube::Error::InferConfig(e) => format!(
            "no usable Kubernetes configuration: {e}. Set KUBECONFIG to a kubeconfig file, or \
             run initium in a Pod with a service account."
        ),
        other => other.to_string(),
    }
}

/// A watch's error as a sentence: which step failed, and the API server's answer.
pub fn describe_watch(error: &watcher::Error) -> String {
    match error {
        watcher::Error::InitialListFailed(e) => format!("listing failed: {}", describe(e)),
        watcher::Error::WatchStartFailed(e) => {
            format!("starting the watch failed: {}", describe(e))
        }
        watcher::Error::WatchFailed(e) => format!("the watch failed: {}", describe(e)),
        watcher::Error::WatchError(status) => format!(
            "the API server ended the watch: {} ({} {}); initium lists again.",
            status.message, status.code, status.reason
        ),
        watcher::Error::NoResourceVersion => {
            "the API server sent no resourceVersion, so this kind cannot be watched".to_string()
        }
    }
}

/// The API server expired the watch's resourceVersion (410 Gone, reason `Expired`): the watch
/// protocol's normal way of saying "list again", which the watch does by itself. Every
/// Kubernetes client meets it (after a long disconnection, or when a new kind's watch cache
/// starts ahead of the list); it is not a failure, and nothing is lost.
pub fn is_expired(error: &watcher::Error) -> bool {
    match error {
        watcher::Error::WatchError(status) => status.code == 410,
        watcher::Error::InitialListFailed(kube::Error::Api(status))
        | watcher::Error::WatchStartFailed(kube::Error::Api(status))
        | watcher::Error::WatchFailed(kube::Error::Api(status)) => status.code == 410,
        _ => false,
    }
}

/// The deepest cause's text: for a connection failure, the operating system's reason
/// (`Connection refused (os error 111)`), not the layers of HTTP client around it.
fn innermost(error: &(dyn std::error::Error + 'static)) -> String {
    let mut last: &(dyn std::error::Error + 'static) = error;
    while let Some(next) = last.source() {
        last = next;
    }
    let text = last.to_string();
    if text.is_empty() {
        error.to_string()
    } else {
        text
    }
}

/// If `error` is a kube client or watch error, its sentence; such an error ends a chain for
/// `report` (its causes are in the sentence).
pub(crate) fn sentence(error: &(dyn std::error::Error + 'static)) -> Option<String> {
    if let Some(e) = error.downcast_ref::<kube::Error>() {
        return Some(describe(e));
    }
    if let Some(e) = error.downcast_ref::<watcher::Error>() {
        return Some(describe_watch(e));
    }
    // The Lease library's wrapper only prefixes kube's `Display` with "Kube error: ".
    if let Some(kube_lease_manager::LeaseManagerError::KubeError(e)) =
        error.downcast_ref::<kube_lease_manager::LeaseManagerError>()
    {
        return Some(describe(e));
    }
    None
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

    #[test]
    fn an_api_error_is_its_message_code_and_reason_without_a_debug_dump() {
        let text = describe(&api(
            404,
            "NotFound",
            "namespaces \"initium-dev\" not found",
        ));
        assert_eq!(
            text,
            "the API server answered: namespaces \"initium-dev\" not found (404 NotFound)."
        );
        assert!(!text.contains("Status {"), "{text}");
    }

    #[test]
    fn a_forbidden_answer_says_to_fix_the_rbac() {
        let text = describe(&api(
            403,
            "Forbidden",
            "leases.coordination.k8s.io is forbidden",
        ));
        assert!(text.contains("(403 Forbidden)"), "{text}");
        assert!(text.contains("deploy/rbac.yaml"), "{text}");
    }

    #[test]
    fn a_watch_error_names_the_step_and_the_answer() {
        let text = describe_watch(&watcher::Error::InitialListFailed(api(
            403,
            "Forbidden",
            "configmaps is forbidden",
        )));
        assert!(
            text.starts_with("listing failed: the API server answered: configmaps is forbidden"),
            "{text}"
        );
        assert!(!text.contains("ApiError"), "{text}");
    }

    #[test]
    fn an_expired_resource_version_is_the_watch_protocol_not_a_failure() {
        let status = |code, reason: &str, message: &str| {
            let mut status = Status::failure(message, reason);
            status.code = code;
            Box::new(status)
        };
        let expired = [
            watcher::Error::WatchError(status(
                410,
                "Expired",
                "too old resource version: 211 (212)",
            )),
            watcher::Error::InitialListFailed(api(
                410,
                "Expired",
                "The provided continue parameter is too old",
            )),
            watcher::Error::WatchStartFailed(api(410, "Gone", "too old resource version")),
        ];
        for error in &expired {
            assert!(is_expired(error), "{}", describe_watch(error));
        }
        let failures = [
            watcher::Error::WatchError(status(500, "InternalError", "etcd is down")),
            watcher::Error::WatchStartFailed(api(403, "Forbidden", "pods is forbidden")),
            watcher::Error::WatchFailed(api(404, "NotFound", "the server could not find it")),
            watcher::Error::NoResourceVersion,
        ];
        for error in &failures {
            assert!(!is_expired(error), "{}", describe_watch(error));
        }
    }
}
