//! The benchmark workload: a ~4 KB Pod and a rule set of a given size of which a fixed 10
//! rules match it. Shared by the benchmarks (and the fault tests) so their figures describe
//! the same work.

use serde_json::{Value, json};

/// A realistic Pod of about 4 KB: two containers and an init container with env, probes,
/// resources, mounts; labels and annotations as a Deployment would leave them.
pub fn pod() -> Value {
    let container = |name: &str, image: &str| {
        json!({
            "name": name,
            "image": image,
            "imagePullPolicy": "IfNotPresent",
            "args": ["--port=8080", "--log-level=info", "--metrics-addr=:9090"],
            "ports": [{"name": "http", "containerPort": 8080, "protocol": "TCP"}, {"name": "metrics", "containerPort": 9090, "protocol": "TCP"}],
            "env": [
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                {"name": "LOG_FORMAT", "value": "json"},
                {"name": "FEATURE_FLAGS", "value": "checkout-v2,fast-cart"}
            ],
            "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}},
            "readinessProbe": {"httpGet": {"path": "/readyz", "port": 8080}, "periodSeconds": 5},
            "livenessProbe": {"httpGet": {"path": "/healthz", "port": 8080}, "periodSeconds": 10, "failureThreshold": 3},
            "volumeMounts": [{"name": "config", "mountPath": "/etc/app"}, {"name": "tmp", "mountPath": "/tmp"}],
            "securityContext": {"allowPrivilegeEscalation": false, "readOnlyRootFilesystem": true, "capabilities": {"drop": ["ALL"]}}
        })
    };
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": "checkout-7d9f8b6c4-",
            "namespace": "shop",
            "labels": {"app": "checkout", "pod-template-hash": "7d9f8b6c4", "tier": "frontend", "team": "shop"},
            "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": "9090", "kubectl.kubernetes.io/restartedAt": "2026-11-20T10:00:00Z"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "checkout-7d9f8b6c4", "uid": "5b1c0c7e-1e0b-4a43-9d0e-2a9b1c7d3e11", "controller": true, "blockOwnerDeletion": true}]
        },
        "spec": {
            "initContainers": [container("migrate", "docker.io/shop/migrate:2.3.1")],
            "containers": [container("checkout", "shop/checkout:2.3.1"), container("cart", "registry.example.com/shop/cart:1.9.0")],
            "volumes": [{"name": "config", "configMap": {"name": "checkout"}}, {"name": "tmp", "emptyDir": {}}],
            "serviceAccountName": "checkout",
            "securityContext": {"runAsNonRoot": true, "runAsUser": 10001, "fsGroup": 10001},
            "terminationGracePeriodSeconds": 30,
            "dnsPolicy": "ClusterFirst",
            "restartPolicy": "Always",
            "schedulerName": "default-scheduler",
            "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}]
        }
    })
}

fn rule(kind: &str, namespace: Option<&str>, name: &str, spec: Value) -> Value {
    let mut metadata = json!({"name": name});
    if let Some(ns) = namespace {
        metadata["namespace"] = json!(ns);
    }
    json!({"apiVersion": "initium.dev/v1alpha1", "kind": kind, "metadata": metadata, "spec": spec})
}

/// The 10 rules that match `pod()`, one of each kind of mutation and match.
pub fn matching_rules() -> Vec<Value> {
    let cmr = |name: &str, spec: Value| rule("ClusterMutationRule", None, name, spec);
    let mr = |name: &str, spec: Value| rule("MutationRule", Some("shop"), name, spec);
    vec![
        mr(
            "test-ca",
            json!({"match": {"kinds": ["Pod"]}, "mutations": [
                {"upsert": {"path": "/spec/volumes", "key": "name", "value": {"name": "test-ca", "secret": {"secretName": "test-ca"}}}},
                {"forEach": "$.spec.containers[*]", "mutations": [{"upsert": {"path": "/volumeMounts", "key": "name", "value": {"name": "test-ca", "mountPath": "/etc/ssl/test", "readOnly": true}}}]}
            ]}),
        ),
        cmr(
            "mirror",
            json!({"priority": 10, "match": {"kinds": ["Pod"]}, "mutations": [
                {"forEach": "$.spec['containers','initContainers'][*]", "mutations": [
                    {"rewrite": {"path": "/image", "regex": "^(?:docker\\.io/)?([a-z0-9_-]+(?:/[a-z0-9._-]+)+(?::[\\w.-]+)?)$", "replacement": "mirror.local/$1"}}
                ]}
            ]}),
        ),
        cmr(
            "team-label",
            json!({"match": {"kinds": ["Pod"], "labels": {"matchLabels": {"tier": "frontend"}}}, "mutations": [
                {"merge": {"metadata": {"labels": {"initium.dev/team": "{{ $.metadata.labels.team }}"}}}}
            ]}),
        ),
        cmr(
            "namespace-annotation",
            json!({"match": {"kinds": ["Pod"], "namespaces": ["shop"]}, "mutations": [
                {"patch": [{"op": "add", "path": "/metadata/annotations/example.com~1namespace", "value": "{{ $.metadata.namespace }}"}]}
            ]}),
        ),
        cmr(
            "sidecar",
            json!({"match": {"kinds": ["Pod"], "annotations": {"prometheus.io/scrape": "true"}}, "mutations": [
                {"upsert": {"path": "/spec/containers", "key": "name", "value": {"name": "metrics-proxy", "image": "registry.example.com/proxy:1", "ports": [{"containerPort": 9091}]}}}
            ]}),
        ),
        cmr(
            "env-defaults",
            json!({"match": {"kinds": ["Pod"], "names": ["checkout-*"]}, "mutations": [
                {"forEach": "$.spec.containers[*]", "mutations": [{"upsert": {"path": "/env", "key": "name", "value": {"name": "REGION", "value": "eu-west-1"}}}]}
            ]}),
        ),
        cmr(
            "conditions",
            json!({"match": {"kinds": ["v1/Pod"]}, "conditions": [
            {"path": "$.spec.containers[*].image", "matches": "checkout"},
            {"path": "$.spec.hostNetwork", "exists": false}
        ], "mutations": [{"merge": {"spec": {"enableServiceLinks": false}}}]}),
        ),
        cmr(
            "tolerations",
            json!({"match": {"kinds": ["*/*/Pod"]}, "mutations": [
                {"upsert": {"path": "/spec/tolerations", "key": "key", "value": {"key": "example.com/spot", "operator": "Exists", "effect": "NoSchedule"}}}
            ]}),
        ),
        mr(
            "priority-class",
            json!({"priority": 150, "match": {"kinds": ["Pod"]}, "exclude": {"labels": {"matchLabels": {"tier": "batch"}}}, "mutations": [
                {"merge": {"spec": {"priorityClassName": "shop-critical"}}}
            ]}),
        ),
        cmr(
            "security",
            json!({"priority": 200, "match": {"kinds": ["Pod"]}, "mutations": [
                {"forEach": "$.spec.containers[*]", "mutations": [{"merge": {"securityContext": {"seccompProfile": {"type": "RuntimeDefault"}}}}]}
            ]}),
        ),
    ]
}

/// Namespaced kinds every API server serves, other than Pods: the kinds of the rules that a
/// large cluster holds for other objects. (Served kinds, because on a real API server a rule
/// for a kind nobody serves is not Ready and never enters the index.)
const OTHER_KINDS: [&str; 12] = [
    "ConfigMap",
    "Secret",
    "Service",
    "ServiceAccount",
    "PersistentVolumeClaim",
    "apps/v1/StatefulSet",
    "apps/v1/DaemonSet",
    "apps/v1/ReplicaSet",
    "batch/v1/Job",
    "batch/v1/CronJob",
    "networking.k8s.io/v1/Ingress",
    "policy/v1/PodDisruptionBudget",
];

/// `total` rules, of which the 10 of `matching_rules()` match `pod()`. The others are what a
/// large cluster holds: rules for other kinds, MutationRules of other namespaces, and
/// ClusterMutationRules limited to other namespaces.
pub fn rules(total: usize) -> Vec<Value> {
    let mut rules = matching_rules();
    let mut i = 0;
    while rules.len() < total {
        let spec = |kinds: Value, extra: Value| {
            let mut s = json!({"match": {"kinds": kinds}, "mutations": [{"merge": {"metadata": {"labels": {format!("r{i}"): "x"}}}}]});
            if let Some(obj) = extra.as_object() {
                for (k, v) in obj {
                    s["match"][k] = v.clone();
                }
            }
            s
        };
        let r = match i % 3 {
            0 => rule(
                "ClusterMutationRule",
                None,
                &format!("other-kind-{i}"),
                spec(json!([OTHER_KINDS[(i / 3) % OTHER_KINDS.len()]]), json!({})),
            ),
            1 => rule(
                "MutationRule",
                Some(&format!("team-{i}")),
                &format!("team-rule-{i}"),
                spec(json!(["Pod"]), json!({})),
            ),
            _ => rule(
                "ClusterMutationRule",
                None,
                &format!("ns-limited-{i}"),
                spec(
                    json!(["Pod", "apps/v1/Deployment"]),
                    json!({"namespaces": [format!("team-{i}")]}),
                ),
            ),
        };
        rules.push(r);
        i += 1;
    }
    rules
}

/// `total` rules that all reach `pod()` through the index (Pods, namespace `shop`), of which
/// the 10 of `matching_rules()` match it. The others are the same bucket's rules that a busy
/// namespace holds and that must each be ruled out: half MutationRules of `shop`, half
/// ClusterMutationRules for Pods in any namespace; a third of them fail on labels, a third on
/// names, a third on a regex condition over the images (as the e2e benchmark's 1,000 rules).
pub fn same_bucket_rules(total: usize) -> Vec<Value> {
    let mut rules = matching_rules();
    let mut i = 0;
    while rules.len() < total {
        let mut spec = match i % 3 {
            0 => {
                json!({"match": {"kinds": ["Pod"], "labels": {"matchLabels": {"app": format!("other-{i}")}}}})
            }
            1 => json!({"match": {"kinds": ["Pod"], "names": [format!("batch-{i}-*")]}}),
            _ => json!({"match": {"kinds": ["Pod"]}, "conditions": [
                {"path": "$.spec.containers[*].image", "matches": format!("^registry\\.other/team-{i}/")}
            ]}),
        };
        spec["mutations"] =
            json!([{"merge": {"metadata": {"labels": {format!("other-{i}"): "x"}}}}]);
        let name = format!("other-{i}");
        rules.push(if i % 2 == 0 {
            rule("MutationRule", Some("shop"), &name, spec)
        } else {
            rule("ClusterMutationRule", None, &name, spec)
        });
        i += 1;
    }
    rules
}

/// `len` bytes of aperiodic `a`/`b` text (xorshift from `seed`, which must not be 0) with a
/// `c` every 97 bytes: on it `a[ab]{K}c` makes the regex engine's lazy DFA build a new state at
/// almost every byte (a periodic text would let it reuse its states), so a search costs what
/// its charge says it may. The hostile-tenant tests search it with such patterns.
pub fn thrashing_text(len: usize, mut seed: u64) -> String {
    (0..len)
        .map(|i| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            if i % 97 == 96 {
                'c'
            } else if seed.is_multiple_of(2) {
                'a'
            } else {
                'b'
            }
        })
        .collect()
}
