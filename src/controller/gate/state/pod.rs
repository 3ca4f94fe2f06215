//! What the gate controller keeps of a gated Pod (from the gated-Pods watch): enough to judge
//! it and to write its release.

use k8s_openapi::api::core::v1::{NodeAffinity, Pod};
use k8s_openapi::jiff::Timestamp;

use initium_engine::api::{GATE_PREFIX, GATED_LABEL};

/// A Pod, by namespace and name.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct PodKey {
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for PodKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// What the controller keeps of a gated Pod: enough to judge it and to write its release.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct GatedPod {
    pub key: PodKey,
    pub uid: String,
    pub resource_version: String,
    pub created: Option<Timestamp>,
    /// Every scheduling gate, in order (other controllers' too: a release keeps them).
    pub gates: Vec<String>,
    /// Whether the Pod carries `initium.dev/gated`.
    pub labeled: bool,
    /// `spec.affinity.nodeAffinity`, for narrowing to a DaemonSet's nodes.
    pub node_affinity: Option<NodeAffinity>,
}

impl GatedPod {
    /// The slim facts of `pod`; `None` without a name or namespace.
    pub(crate) fn of(pod: &Pod) -> Option<GatedPod> {
        let meta = &pod.metadata;
        let spec = pod.spec.as_ref();
        Some(GatedPod {
            key: PodKey {
                namespace: meta.namespace.clone()?,
                name: meta.name.clone()?,
            },
            uid: meta.uid.clone().unwrap_or_default(),
            resource_version: meta.resource_version.clone().unwrap_or_default(),
            created: meta.creation_timestamp.as_ref().map(|t| t.0),
            gates: spec
                .and_then(|s| s.scheduling_gates.as_ref())
                .map(|gates| gates.iter().map(|g| g.name.clone()).collect())
                .unwrap_or_default(),
            labeled: meta
                .labels
                .as_ref()
                .is_some_and(|l| l.contains_key(GATED_LABEL)),
            node_affinity: spec
                .and_then(|s| s.affinity.as_ref())
                .and_then(|a| a.node_affinity.clone()),
        })
    }

    /// initium's gates on the Pod.
    pub(crate) fn initium_gates(&self) -> impl Iterator<Item = &str> {
        self.gates
            .iter()
            .map(String::as_str)
            .filter(|g| g.starts_with(GATE_PREFIX))
    }
}
