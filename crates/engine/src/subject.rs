//! The words every floor of the engine shares about a rule and the object under admission:
//! which rule ([`RuleId`]), what is admitted ([`Subject`]) and which rules already ran on it
//! ([`RanBefore`]).

use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use crate::api::Operation;

use super::kind::Gvk;
use super::lookup_store::LookupStore;

/// Which rule: a ClusterMutationRule `name`, or a MutationRule `namespace/name`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RuleId {
    /// `Some` for a MutationRule.
    pub namespace: Option<Arc<str>>,
    pub name: Arc<str>,
}

impl RuleId {
    pub fn cluster(name: &str) -> RuleId {
        RuleId {
            namespace: None,
            name: name.into(),
        }
    }

    pub fn namespaced(namespace: &str, name: &str) -> RuleId {
        RuleId {
            namespace: Some(namespace.into()),
            name: name.into(),
        }
    }

    pub fn kind(&self) -> &'static str {
        if self.namespace.is_some() {
            "MutationRule"
        } else {
            "ClusterMutationRule"
        }
    }

    /// True when `text` names this rule as `initium.dev/mutated-by` does (its `Display`),
    /// compared without building the text.
    pub fn is_written(&self, text: &str) -> bool {
        match &self.namespace {
            Some(ns) => text
                .strip_prefix(&**ns)
                .and_then(|rest| rest.strip_prefix('/'))
                .is_some_and(|name| name == &*self.name),
            None => text == &*self.name,
        }
    }

    /// The rule as `initium.dev/mutated-by` names it (its `Display`), built without the
    /// formatter: every changed object writes the names of the rules that changed it.
    pub fn written(&self) -> String {
        let ns = self.namespace.as_deref();
        let mut text = String::with_capacity(ns.map_or(0, |ns| ns.len() + 1) + self.name.len());
        if let Some(ns) = ns {
            text.push_str(ns);
            text.push('/');
        }
        text.push_str(&self.name);
        text
    }

    /// `MutationRule payments/test-certs`.
    pub fn describe(&self) -> String {
        format!("{} {}", self.kind(), self)
    }
}

impl fmt::Display for RuleId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.namespace {
            Some(ns) => write!(f, "{ns}/{}", self.name),
            None => f.write_str(&self.name),
        }
    }
}

/// The total order of DESIGN.md §1: priority, ClusterMutationRule before MutationRule,
/// namespace, name.
impl Ord for RuleId {
    fn cmp(&self, other: &RuleId) -> Ordering {
        (self.namespace.is_some(), &self.namespace, &self.name).cmp(&(
            other.namespace.is_some(),
            &other.namespace,
            &other.name,
        ))
    }
}

impl PartialOrd for RuleId {
    fn partial_cmp(&self, other: &RuleId) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// What the engine knows about the object under admission besides its content: at admission,
/// `metadata.namespace` and `metadata.name` of the object may still be empty.
#[derive(Clone, Debug)]
pub struct Subject<'a> {
    pub gvk: &'a Gvk,
    pub operation: Operation,
    /// The request's namespace; `None` for cluster-scoped objects.
    pub namespace: Option<&'a str>,
    /// The request's name, when known.
    pub name: Option<&'a str>,
    /// Labels of the object's Namespace (for `namespaceSelector`). `None` means unknown:
    /// a rule that needs them then fails (and its `failurePolicy` decides) rather than
    /// guess; offline callers pass an empty map for namespaces they have no object for.
    pub namespace_labels: Option<&'a BTreeMap<String, String>>,
    /// The objects rules look up (`spec.lookups`). `None`: none can be read, and a rule with
    /// lookups fails (its `failurePolicy` decides).
    pub lookups: Option<&'a LookupStore>,
    /// Which rules already ran on this object during this admission request.
    pub ran_before: RanBefore<'a>,
}

/// Which rules already ran on the object during the current admission request: the API server
/// may send one object to initium more than once (one call per webhook whose rules cover it,
/// and a reinvocation when a later webhook changed it), and a rule that is not idempotent
/// (`add` to `/spec/tolerations/-`) must not run twice. A rule runs at most once per request.
#[derive(Clone, Copy, Debug)]
pub enum RanBefore<'a> {
    /// Run every matching rule: offline, and where idempotence itself is being checked.
    Unknown,
    /// At admission: the rules the object's `initium.dev/mutated-by` lists ran earlier in this
    /// request, except those the stored object (`stored`, its annotation on UPDATE; `None` on
    /// CREATE) already listed, which ran at an earlier write and run again.
    ///
    /// A controller's Pod template has provenance of its own (`spec.autogen`): at CREATE a
    /// rule its template lists is not run on it again (the template was copied from one the
    /// rule changed: a CronJob's Job, a Deployment's ReplicaSet); at UPDATE the rule runs on
    /// the template only when it differs from the stored one (`stored_template`).
    Listed {
        stored: Option<&'a str>,
        stored_template: Option<&'a serde_json::Value>,
    },
}

impl Subject<'_> {
    pub(crate) fn is_namespace_object(&self) -> bool {
        self.gvk.group.is_empty() && self.gvk.kind == "Namespace"
    }
}

#[cfg(test)]
mod tests {
    use super::RuleId;

    #[test]
    fn a_rule_is_recognised_as_provenance_writes_it() {
        let namespaced = RuleId::namespaced("payments", "certs");
        assert!(namespaced.is_written("payments/certs"));
        assert!(!namespaced.is_written("certs"));
        assert!(!namespaced.is_written("payments/certs2"));
        assert!(!namespaced.is_written("paymentscerts"));
        let cluster = RuleId::cluster("certs");
        assert!(cluster.is_written("certs"));
        assert!(!cluster.is_written("payments/certs"));
        for id in [namespaced, cluster] {
            assert!(id.is_written(&id.to_string()));
            assert_eq!(id.written(), id.to_string());
        }
    }
}
