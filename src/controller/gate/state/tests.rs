use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use serde_json::{Value, json};

use super::world::DepKey;
use super::*;
use initium_engine::api::GATED_LABEL;
use initium_engine::api::RuleSpec;
use initium_engine::compile;
use initium_engine::{Dependency, Reads, RuleId, RuleIndex};

const NS: &str = "shop";

fn rule(id: RuleId, gate: Value) -> Arc<initium_engine::CompiledRule> {
    let spec: RuleSpec = serde_json::from_value(json!({
        "match": {"kinds": ["Pod"], "labels": {"matchLabels": {"app": "web"}}},
        "gate": gate,
    }))
    .unwrap();
    Arc::new(compile(id, &spec).unwrap())
}

fn gates(rules: &[Arc<initium_engine::CompiledRule>]) -> Gates {
    Gates::of(&RuleIndex::shared(rules.to_vec()))
}

fn gate_of(rule: &initium_engine::CompiledRule) -> String {
    rule.gate().unwrap().name.clone()
}

fn ts(secs: i64) -> Timestamp {
    Timestamp::from_second(1_700_000_000 + secs).unwrap()
}

fn pod(name: &str, gates: &[&str]) -> GatedPod {
    GatedPod {
        key: PodKey {
            namespace: NS.into(),
            name: name.into(),
        },
        uid: format!("uid-{name}"),
        resource_version: "10".into(),
        created: Some(ts(0)),
        gates: gates.iter().map(|g| g.to_string()).collect(),
        labeled: true,
        node_affinity: None,
    }
}

fn slice(service: &str, slice: &str, ready: usize) -> Fact {
    Fact::Slice {
        namespace: NS.into(),
        name: slice.into(),
        service: Some(service.into()),
        ready,
    }
}

fn job(name: &str, uid: &str, succeeded: bool) -> Fact {
    Fact::Job {
        namespace: NS.into(),
        name: name.into(),
        uid: uid.into(),
        succeeded,
    }
}

fn ready_pod(name: &str, labels: &[(&str, &str)], node: &str, ds: Option<(&str, &str)>) -> Fact {
    Fact::Pod {
        namespace: NS.into(),
        name: name.into(),
        ready: true,
        labels: labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        node: Some(node.into()),
        daemon_set: ds.map(|(n, u)| (n.into(), u.into())),
    }
}

fn listed(world: &mut World, kind: WatchKind, facts: Vec<Fact>) -> Vec<DepKey> {
    world.apply(&kind, Update::Init);
    for fact in facts {
        world.apply(&kind, Update::InitApply(fact));
    }
    world.apply(&kind, Update::InitDone)
}

fn service_key(name: &str) -> DepKey {
    DepKey::Service {
        namespace: NS.into(),
        name: name.into(),
    }
}

fn reasons(verdict: &Verdict) -> Vec<(&str, Reason)> {
    verdict
        .release
        .iter()
        .map(|r| (r.gate.as_str(), r.reason))
        .collect()
}

#[test]
fn a_gate_waits_for_its_service_then_is_released_with_its_dependencies_named() {
    let r = rule(
        RuleId::namespaced(NS, "wait-db"),
        json!({"waitFor": [{"service": {"name": "db"}}], "timeout": "60s"}),
    );
    let gates = gates(std::slice::from_ref(&r));
    let gate = gate_of(&r);
    let p = pod("web-1", &[&gate]);
    let mut world = World::default();

    let waiting = judge(&p, &gates, &world, &BTreeSet::new(), ts(1));
    assert!(!waiting.is_release());
    assert_eq!(waiting.deadline, Some(ts(60)));
    assert_eq!(waiting.keys, BTreeSet::from([service_key("db")]));

    // A slice with no ready endpoint is not enough.
    let dirty = world.apply(
        &WatchKind::EndpointSlices,
        Update::Apply(slice("db", "db-a", 0)),
    );
    assert_eq!(dirty, vec![service_key("db")]);
    assert!(!judge(&p, &gates, &world, &BTreeSet::new(), ts(2)).is_release());

    world.apply(
        &WatchKind::EndpointSlices,
        Update::Apply(slice("db", "db-b", 1)),
    );
    let ready = judge(&p, &gates, &world, &BTreeSet::new(), ts(3));
    assert_eq!(reasons(&ready), [(gate.as_str(), Reason::Ready)]);
    assert_eq!(ready.release[0].dependencies, ["Service shop/db"]);
    assert_eq!(
        ready.release[0].rule,
        Some(RuleId::namespaced(NS, "wait-db"))
    );
    assert_eq!(ready.nodes, None);

    // The slice goes away: not ready again.
    world.apply(
        &WatchKind::EndpointSlices,
        Update::Delete(slice("db", "db-b", 1)),
    );
    assert!(!judge(&p, &gates, &world, &BTreeSet::new(), ts(4)).is_release());
}

#[test]
fn a_gate_whose_rule_is_gone_is_released_and_other_gates_are_left_alone() {
    let r = rule(
        RuleId::namespaced(NS, "wait-db"),
        json!({"waitFor": [{"service": {"name": "db"}}]}),
    );
    let gate = gate_of(&r);
    let p = pod(
        "web-1",
        &["example.com/other", &gate, "initium.dev/shop.deleted-rule"],
    );
    let verdict = judge(&p, &gates(&[r]), &World::default(), &BTreeSet::new(), ts(1));
    assert_eq!(
        reasons(&verdict),
        [("initium.dev/shop.deleted-rule", Reason::RuleGone)],
        "the foreign gate is not initium's; the live rule's gate still waits"
    );
    // Nothing is Ready at all: every initium gate goes.
    let verdict = judge(
        &p,
        &Gates::default(),
        &World::default(),
        &BTreeSet::new(),
        ts(1),
    );
    assert_eq!(
        reasons(&verdict),
        [
            (gate.as_str(), Reason::RuleGone),
            ("initium.dev/shop.deleted-rule", Reason::RuleGone)
        ]
    );
    assert!(verdict.keys.is_empty(), "a gone rule waits on nothing");
}

#[test]
fn a_changed_rule_judges_waiting_pods_by_its_current_dependencies_and_timeout() {
    let id = RuleId::namespaced(NS, "wait");
    let before = rule(
        id.clone(),
        json!({"waitFor": [{"service": {"name": "db"}}], "timeout": "60s"}),
    );
    let after = rule(
        id,
        json!({"waitFor": [{"job": {"name": "migrate"}}], "timeout": "300s"}),
    );
    assert_eq!(gate_of(&before), gate_of(&after), "same rule, same gate");
    let p = pod("web-1", &[&gate_of(&before)]);
    let mut world = World::default();
    world.apply(
        &WatchKind::EndpointSlices,
        Update::Apply(slice("db", "db-a", 1)),
    );
    assert!(judge(&p, &gates(&[before]), &world, &BTreeSet::new(), ts(1)).is_release());
    let now = judge(&p, &gates(&[after]), &world, &BTreeSet::new(), ts(100));
    assert!(!now.is_release(), "the Service no longer counts");
    assert_eq!(now.deadline, Some(ts(300)), "the new timeout");
    assert_eq!(
        now.keys,
        BTreeSet::from([DepKey::Job {
            namespace: NS.into(),
            name: "migrate".into()
        }])
    );
}

#[test]
fn a_timeout_releases_with_release_and_holds_once_with_hold() {
    let release = rule(
        RuleId::namespaced(NS, "r"),
        json!({"waitFor": [{"service": {"name": "db"}}], "timeout": "60s", "onTimeout": "Release"}),
    );
    let hold = rule(
        RuleId::namespaced(NS, "h"),
        json!({"waitFor": [{"service": {"name": "cache"}}], "timeout": "30s", "onTimeout": "Hold"}),
    );
    let gates = gates(&[release.clone(), hold.clone()]);
    let p = pod("web-1", &[&gate_of(&release), &gate_of(&hold)]);
    let mut world = World::default();

    let early = judge(&p, &gates, &world, &BTreeSet::new(), ts(10));
    assert!(!early.is_release());
    assert_eq!(early.deadline, Some(ts(30)), "the earliest of both");

    let at_30 = judge(&p, &gates, &world, &BTreeSet::new(), ts(30));
    assert!(!at_30.is_release());
    assert_eq!(at_30.newly_held.len(), 1);
    assert_eq!(at_30.newly_held[0].gate, gate_of(&hold));
    assert_eq!(at_30.newly_held[0].pending, ["Service shop/cache"]);
    assert_eq!(
        at_30.deadline,
        Some(ts(60)),
        "the held gate is no longer timed"
    );

    let held = BTreeSet::from([gate_of(&hold)]);
    let at_45 = judge(&p, &gates, &world, &held, ts(45));
    assert!(at_45.newly_held.is_empty(), "held once");
    assert_eq!(at_45.deadline, Some(ts(60)));
    assert!(
        at_45.keys.contains(&service_key("cache")),
        "a held gate still waits on its dependencies"
    );

    let at_60 = judge(&p, &gates, &world, &held, ts(60));
    assert_eq!(
        reasons(&at_60),
        [(gate_of(&release).as_str(), Reason::Timeout)]
    );
    assert_eq!(at_60.release[0].dependencies, ["Service shop/db"]);
    assert_eq!(
        at_60.release[0].timeout,
        Some(std::time::Duration::from_secs(60))
    );
    assert_eq!(at_60.deadline, None);

    // A held gate is released once its dependencies hold after all.
    world.apply(
        &WatchKind::EndpointSlices,
        Update::Apply(slice("cache", "c", 2)),
    );
    let later = judge(&p, &gates, &world, &held, ts(61));
    assert_eq!(
        reasons(&later),
        [
            (gate_of(&release).as_str(), Reason::Timeout),
            (gate_of(&hold).as_str(), Reason::Ready)
        ],
        "both in one write, in the Pod's order"
    );
}

#[test]
fn a_held_gates_event_tells_what_it_waits_for_as_last_judged_and_goes_out_once() {
    let hold = rule(
        RuleId::namespaced(NS, "h"),
        json!({"waitFor": [{"service": {"name": "cache"}}, {"service": {"name": "db"}}],
               "timeout": "30s", "onTimeout": "Hold"}),
    );
    let gates = gates(std::slice::from_ref(&hold));
    let p = pod("web-1", &[&gate_of(&hold)]);
    let mut waiting = Waiting::default();
    waiting.apply(PodEvent::Apply(p.clone()));
    let mut world = World::default();
    // Judged once per change; the event is built from that judgement, not from another.
    let judge_now = |waiting: &mut Waiting, world: &World, at: i64| {
        let entry = waiting.get_mut(&p.key).unwrap();
        let verdict = judge(&p, &gates, world, &entry.held_gates(), ts(at));
        entry.hold(&verdict);
    };

    judge_now(&mut waiting, &world, 30);
    // A follower: the event waits, and is refreshed when the Pod is judged again.
    world.apply(
        &WatchKind::EndpointSlices,
        Update::Apply(slice("cache", "c", 1)),
    );
    judge_now(&mut waiting, &world, 31);
    let entry = waiting.get_mut(&p.key).unwrap();
    let unsent = entry.take_unsent();
    assert_eq!(unsent.len(), 1);
    assert_eq!(unsent[0].gate, gate_of(&hold));
    assert_eq!(unsent[0].pending, ["Service shop/db"], "as last judged");
    assert!(entry.take_unsent().is_empty(), "out once");
    judge_now(&mut waiting, &world, 40);
    let entry = waiting.get_mut(&p.key).unwrap();
    assert!(entry.take_unsent().is_empty(), "still held, not told again");

    // Held, then ready before the event went out: nothing to tell.
    let q = pod("web-2", &[&gate_of(&hold)]);
    waiting.apply(PodEvent::Apply(q.clone()));
    let mut world = World::default();
    let entry = waiting.get_mut(&q.key).unwrap();
    let verdict = judge(&q, &gates, &world, &entry.held_gates(), ts(30));
    entry.hold(&verdict);
    for (service, slice_name) in [("cache", "c"), ("db", "d")] {
        world.apply(
            &WatchKind::EndpointSlices,
            Update::Apply(slice(service, slice_name, 1)),
        );
    }
    let verdict = judge(&q, &gates, &world, &entry.held_gates(), ts(31));
    assert_eq!(
        reasons(&verdict),
        [(gate_of(&hold).as_str(), Reason::Ready)]
    );
    entry.hold(&verdict);
    assert!(entry.take_unsent().is_empty());
}

#[test]
fn a_job_seen_succeeded_stays_satisfied_after_it_is_deleted() {
    let r = rule(
        RuleId::namespaced(NS, "after-init"),
        json!({"waitFor": [{"job": {"name": "init"}}]}),
    );
    let gates = gates(std::slice::from_ref(&r));
    let p = pod("web-1", &[&gate_of(&r)]);
    let mut world = World::default();
    let jobs = WatchKind::Jobs;
    let holds = |w: &World| judge(&p, &gates, w, &BTreeSet::new(), ts(1)).is_release();

    listed(&mut world, jobs.clone(), vec![job("init", "u1", false)]);
    assert!(!holds(&world));
    world.apply(&jobs, Update::Apply(job("init", "u1", true)));
    assert!(holds(&world));
    // TTL: the Job is deleted; a later Pod still goes.
    world.apply(&jobs, Update::Delete(job("init", "u1", true)));
    assert!(holds(&world));
    // A relist that no longer has it, the watch stopping, the duty restarting: remembered.
    listed(&mut world, jobs.clone(), vec![]);
    assert!(holds(&world));
    world.forget(&jobs);
    world.restart();
    assert!(holds(&world));
    // A new Job of that name that has not succeeded: it is the one that counts.
    world.apply(&jobs, Update::Apply(job("init", "u2", false)));
    assert!(!holds(&world));
    world.apply(&jobs, Update::Apply(job("init", "u2", true)));
    assert!(holds(&world));
}

#[test]
fn pods_dependencies_count_ready_pods_matching_the_selector_in_the_namespace() {
    let r = rule(
        RuleId::namespaced(NS, "after-db"),
        json!({"waitFor": [{"pods": {"selector": {"matchLabels": {"app": "db"}}}}]}),
    );
    let gates = gates(std::slice::from_ref(&r));
    let p = pod("web-1", &[&gate_of(&r)]);
    let mut world = World::default();
    let holds = |w: &World| judge(&p, &gates, w, &BTreeSet::new(), ts(1)).is_release();
    let pods = WatchKind::Pods;
    world.apply(
        &pods,
        Update::Apply(ready_pod("other", &[("app", "x")], "n1", None)),
    );
    assert!(!holds(&world));
    let dirty = world.apply(
        &pods,
        Update::Apply(ready_pod("db-0", &[("app", "db")], "n1", None)),
    );
    assert_eq!(
        dirty,
        vec![DepKey::Pods {
            namespace: NS.into()
        }]
    );
    assert!(holds(&world));
    // The same facts again change nothing, and re-judge nobody.
    assert!(
        world
            .apply(
                &pods,
                Update::Apply(ready_pod("db-0", &[("app", "db")], "n1", None))
            )
            .is_empty()
    );
    // Not Ready any more.
    world.apply(
        &pods,
        Update::Apply(Fact::Pod {
            namespace: NS.into(),
            name: "db-0".into(),
            ready: false,
            labels: BTreeMap::new(),
            node: None,
            daemon_set: None,
        }),
    );
    assert!(!holds(&world));
}

/// `reads`: the paths (dotted) the dependency's conditions read.
fn object_ref(
    kind: &str,
    namespace: &str,
    name: &str,
    own_namespace: bool,
    reads: &[&str],
) -> ObjectRef {
    ObjectRef {
        kind: ObjectKind {
            api_version: "example.com/v1".into(),
            kind: kind.into(),
        },
        namespace: namespace.into(),
        name: name.into(),
        own_namespace,
        reads: Reads::Under(
            reads
                .iter()
                .map(|path| path.split('.').map(String::from).collect())
                .collect(),
        ),
    }
}

fn object_fact(ns: Option<&str>, name: &str, phase: &str) -> Fact {
    Fact::Object {
        namespace: ns.map(Into::into),
        name: name.into(),
        value: Arc::new(json!({"metadata": {"name": name}, "status": {"phase": phase}})),
    }
}

#[test]
fn object_dependencies_hold_when_their_conditions_do() {
    let r = rule(
        RuleId::cluster("after-foo"),
        json!({"waitFor": [{"object": {"apiVersion": "example.com/v1", "kind": "Foo", "name": "f",
            "namespace": "infra", "conditions": [{"path": "$.status.phase", "equals": "Ready"}]}},
            {"object": {"apiVersion": "example.com/v1", "kind": "Zone", "name": "z"}}]}),
    );
    let gates = gates(std::slice::from_ref(&r));
    let p = pod("web-1", &[&gate_of(&r)]);
    // One watch per object named: the Foo in infra, the Zone in the Pod's namespace (if Zone
    // turns out namespaced; it is cluster-scoped here).
    let foo = object_ref("Foo", "infra", "f", false, &["status.phase"]);
    let zone = object_ref("Zone", NS, "z", false, &[]);
    let mut world = World::default();
    let holds = |w: &World| judge(&p, &gates, w, &BTreeSet::new(), ts(1)).is_release();
    let verdict = judge(&p, &gates, &world, &BTreeSet::new(), ts(1));
    assert_eq!(
        verdict
            .keys
            .iter()
            .flat_map(DepKey::kinds)
            .collect::<BTreeSet<_>>(),
        BTreeSet::from([
            WatchKind::Object(foo.clone()),
            WatchKind::Object(zone.clone())
        ])
    );
    world.set_namespaced(&foo, true);
    world.set_namespaced(&zone, false);
    world.apply(
        &WatchKind::Object(zone.clone()),
        Update::Apply(object_fact(None, "z", "")),
    );
    world.apply(
        &WatchKind::Object(foo.clone()),
        Update::Apply(object_fact(Some("infra"), "f", "Pending")),
    );
    assert!(!holds(&world));
    // Another object than the one named is not kept (a watch sends only its own).
    world.apply(
        &WatchKind::Object(foo.clone()),
        Update::Apply(object_fact(Some(NS), "f", "Ready")),
    );
    world.apply(
        &WatchKind::Object(foo.clone()),
        Update::Apply(object_fact(Some("infra"), "g", "Ready")),
    );
    assert!(!holds(&world));
    assert_eq!(world.objects(), 2);
    world.apply(
        &WatchKind::Object(foo.clone()),
        Update::Apply(object_fact(Some("infra"), "f", "Ready")),
    );
    assert!(
        holds(&world),
        "the cluster-scoped Zone exists, the Foo is Ready"
    );
    world.forget(&WatchKind::Object(zone));
    assert!(!holds(&world));
    assert_eq!(world.objects(), 1);
    // Deleted: nothing kept.
    world.apply(
        &WatchKind::Object(foo.clone()),
        Update::Delete(object_fact(Some("infra"), "f", "Ready")),
    );
    assert_eq!(world.objects(), 0);
}

#[test]
fn a_mutation_rules_dependency_on_a_cluster_scoped_object_is_never_judged() {
    // A custom kind the compile-time check cannot know: discovery finds it cluster-scoped.
    let r = rule(
        RuleId::namespaced(NS, "peek"),
        json!({"waitFor": [{"object": {"apiVersion": "example.com/v1", "kind": "Vault",
            "name": "main", "conditions": [{"path": "$.status.phase", "equals": "Ready"}]}}]}),
    );
    // The same dependency in a ClusterMutationRule.
    let c = rule(
        RuleId::cluster("vault"),
        json!({"waitFor": [{"object": {"apiVersion": "example.com/v1", "kind": "Vault",
            "name": "main", "conditions": [{"path": "$.status.phase", "equals": "Ready"}]}}]}),
    );
    let cluster_gates = gates(std::slice::from_ref(&c));
    let gates = gates(std::slice::from_ref(&r));
    let p = pod("web-1", &[&gate_of(&r)]);
    let vault = object_ref("Vault", NS, "main", true, &["status.phase"]);
    let mut world = World::default();
    let verdict = judge(&p, &gates, &world, &BTreeSet::new(), ts(1));
    assert_eq!(
        verdict.keys,
        BTreeSet::from([DepKey::Object(vault.clone())])
    );
    // Not resolved yet: an object the watch might send is not enough.
    world.apply(
        &WatchKind::Object(vault.clone()),
        Update::Apply(object_fact(Some(NS), "main", "Ready")),
    );
    assert!(!judge(&p, &gates, &world, &BTreeSet::new(), ts(1)).is_release());
    // Cluster-scoped: whatever the object says, never released on it.
    assert_eq!(
        world.set_namespaced(&vault, false),
        DepKey::Object(vault.clone())
    );
    world.apply(
        &WatchKind::Object(vault.clone()),
        Update::Apply(object_fact(None, "main", "Ready")),
    );
    let verdict = judge(&p, &gates, &world, &BTreeSet::new(), ts(1));
    assert!(!verdict.is_release(), "{verdict:?}");
    assert_eq!(
        verdict.keys,
        BTreeSet::from([DepKey::Object(vault.clone())]),
        "the parked watch stays (started again it would only discover again)"
    );
    // Its timeout says why, in a sentence.
    let late = judge(&p, &gates, &world, &BTreeSet::new(), ts(3600));
    let [release] = late.release.as_slice() else {
        panic!("{late:?}");
    };
    assert_eq!(release.reason, Reason::Timeout);
    assert_eq!(
        release.dependencies,
        vec![
            "Vault main (never judged: it is cluster-scoped, and a MutationRule may only wait on \
             namespaced objects of its own namespace; wait on an object in shop, or use a \
             ClusterMutationRule)"
                .to_string()
        ]
    );
    // The same object for a ClusterMutationRule is judged.
    let q = pod("web-2", &[&gate_of(&c)]);
    let shared = object_ref("Vault", NS, "main", false, &["status.phase"]);
    world.set_namespaced(&shared, false);
    world.apply(
        &WatchKind::Object(shared),
        Update::Apply(object_fact(None, "main", "Ready")),
    );
    assert!(judge(&q, &cluster_gates, &world, &BTreeSet::new(), ts(1)).is_release());
}

#[test]
fn a_daemon_set_dependency_narrows_to_the_nodes_where_it_is_ready() {
    let r = rule(
        RuleId::cluster("same-node"),
        json!({"waitFor": [{"daemonSet": {"name": "agent"}}]}),
    );
    let gates = gates(std::slice::from_ref(&r));
    let p = pod("web-1", &[&gate_of(&r)]);
    let mut world = World::default();
    let ds_key = DepKey::DaemonSet {
        namespace: NS.into(),
        name: "agent".into(),
    };
    let verdict = judge(&p, &gates, &world, &BTreeSet::new(), ts(1));
    assert_eq!(verdict.keys, BTreeSet::from([ds_key.clone()]));
    assert_eq!(
        ds_key.kinds(),
        [WatchKind::DaemonSets, WatchKind::Pods],
        "both watches feed it"
    );
    world.apply(
        &WatchKind::Pods,
        Update::Apply(ready_pod("agent-a", &[], "n2", Some(("agent", "ds-1")))),
    );
    assert!(
        !judge(&p, &gates, &world, &BTreeSet::new(), ts(1)).is_release(),
        "the DaemonSet itself is not known yet"
    );
    let dirty = world.apply(
        &WatchKind::DaemonSets,
        Update::Apply(Fact::DaemonSet {
            namespace: NS.into(),
            name: "agent".into(),
            uid: "ds-1".into(),
        }),
    );
    assert_eq!(dirty, vec![ds_key.clone()]);
    let dirty = world.apply(
        &WatchKind::Pods,
        Update::Apply(ready_pod("agent-b", &[], "n1", Some(("agent", "ds-1")))),
    );
    assert!(dirty.contains(&ds_key));
    // A Pod of another (older) DaemonSet of that name does not count.
    world.apply(
        &WatchKind::Pods,
        Update::Apply(ready_pod("agent-old", &[], "n3", Some(("agent", "ds-0")))),
    );
    let verdict = judge(&p, &gates, &world, &BTreeSet::new(), ts(1));
    assert_eq!(reasons(&verdict), [(gate_of(&r).as_str(), Reason::Ready)]);
    assert_eq!(
        verdict.nodes,
        Some(BTreeSet::from(["n1".to_string(), "n2".to_string()]))
    );
}

#[test]
fn daemon_sets_ready_on_no_common_node_keep_the_pod_waiting() {
    let a = rule(
        RuleId::cluster("a"),
        json!({"waitFor": [{"daemonSet": {"name": "da"}}]}),
    );
    let b = rule(
        RuleId::cluster("b"),
        json!({"waitFor": [{"daemonSet": {"name": "db"}}, {"service": {"name": "s"}}]}),
    );
    let c = rule(
        RuleId::cluster("c"),
        json!({"waitFor": [{"service": {"name": "s"}}]}),
    );
    let gates = gates(&[a.clone(), b.clone(), c.clone()]);
    let p = pod("web-1", &[&gate_of(&a), &gate_of(&b), &gate_of(&c)]);
    let mut world = World::default();
    for (name, uid, node) in [("da", "u-a", "n1"), ("db", "u-b", "n2")] {
        world.apply(
            &WatchKind::DaemonSets,
            Update::Apply(Fact::DaemonSet {
                namespace: NS.into(),
                name: name.into(),
                uid: uid.into(),
            }),
        );
        world.apply(
            &WatchKind::Pods,
            Update::Apply(ready_pod(
                &format!("{name}-x"),
                &[],
                node,
                Some((name, uid)),
            )),
        );
    }
    world.apply(
        &WatchKind::EndpointSlices,
        Update::Apply(slice("s", "s-1", 1)),
    );
    let verdict = judge(&p, &gates, &world, &BTreeSet::new(), ts(1));
    assert_eq!(
        reasons(&verdict),
        [(gate_of(&c).as_str(), Reason::Ready)],
        "only the gate that does not narrow goes"
    );
    assert_eq!(verdict.nodes, None);
    // Both DaemonSets on n2: both narrowing gates go, narrowed to n2.
    world.apply(
        &WatchKind::Pods,
        Update::Apply(ready_pod("da-y", &[], "n2", Some(("da", "u-a")))),
    );
    let verdict = judge(&p, &gates, &world, &BTreeSet::new(), ts(1));
    assert_eq!(verdict.release.len(), 3);
    assert_eq!(verdict.nodes, Some(BTreeSet::from(["n2".to_string()])));
}

#[test]
fn the_reverse_index_finds_the_pods_a_change_concerns_and_the_kinds_to_watch() {
    let mut waiting = Waiting::default();
    let a = pod("a", &["initium.dev/shop.x"]);
    let b = pod("b", &["initium.dev/shop.x"]);
    waiting.apply(PodEvent::Init);
    waiting.apply(PodEvent::InitApply(a.clone()));
    waiting.apply(PodEvent::InitApply(b.clone()));
    let dirty = waiting.apply(PodEvent::InitDone);
    assert_eq!(dirty, vec![a.key.clone(), b.key.clone()]);
    assert_eq!(waiting.waiting(), 2);

    let job = DepKey::Job {
        namespace: NS.into(),
        name: "init".into(),
    };
    waiting.set_keys(&a.key, BTreeSet::from([service_key("db"), job.clone()]));
    waiting.set_keys(&b.key, BTreeSet::from([service_key("db")]));
    assert_eq!(
        waiting.affected(&[service_key("db")]),
        vec![a.key.clone(), b.key.clone()]
    );
    assert_eq!(
        waiting.affected(std::slice::from_ref(&job)),
        vec![a.key.clone()]
    );
    assert!(waiting.affected(&[service_key("other")]).is_empty());
    assert_eq!(
        waiting.needed_kinds(),
        BTreeSet::from([WatchKind::EndpointSlices, WatchKind::Jobs])
    );

    // a no longer waits on the Job; then a is released (deleted from the watch).
    waiting.set_keys(&a.key, BTreeSet::from([service_key("db")]));
    assert_eq!(
        waiting.needed_kinds(),
        BTreeSet::from([WatchKind::EndpointSlices])
    );
    waiting.apply(PodEvent::Delete(a.key.clone()));
    assert_eq!(waiting.affected(&[service_key("db")]), vec![b.key.clone()]);

    // The same Pod again: nothing to judge; a new resourceVersion: judged.
    assert!(waiting.apply(PodEvent::Apply(b.clone())).is_empty());
    let mut b2 = b.clone();
    b2.resource_version = "11".into();
    assert_eq!(waiting.apply(PodEvent::Apply(b2)), vec![b.key.clone()]);

    // A relist without b: gone, with its keys.
    waiting.apply(PodEvent::Init);
    waiting.apply(PodEvent::InitDone);
    assert_eq!(waiting.reverse_len(), 0);
    assert!(waiting.needed_kinds().is_empty());
    assert_eq!(waiting.waiting(), 0);
}

#[test]
fn deadlines_are_kept_in_order_and_dropped_with_their_pod() {
    let mut waiting = Waiting::default();
    for name in ["a", "b", "c"] {
        waiting.apply(PodEvent::Apply(pod(name, &["initium.dev/shop.x"])));
    }
    let key = |n: &str| PodKey {
        namespace: NS.into(),
        name: n.into(),
    };
    waiting.set_deadline(&key("a"), Some(ts(30)));
    waiting.set_deadline(&key("b"), Some(ts(10)));
    waiting.set_deadline(&key("c"), Some(ts(20)));
    assert_eq!(waiting.next_deadline(), Some(ts(10)));
    assert_eq!(waiting.due(ts(20)), vec![key("b"), key("c")]);
    waiting.set_deadline(&key("b"), None);
    waiting.apply(PodEvent::Delete(key("c")));
    assert_eq!(waiting.next_deadline(), Some(ts(30)));
    assert_eq!(waiting.due(ts(25)), Vec::<PodKey>::new());
}

#[test]
fn a_recreated_pod_of_the_same_name_starts_over() {
    let mut waiting = Waiting::default();
    let a = pod("a", &["initium.dev/shop.x"]);
    waiting.apply(PodEvent::Apply(a.clone()));
    let entry = waiting.get_mut(&a.key).unwrap();
    entry.held.insert("initium.dev/shop.x".into(), None);
    entry.written = Some("10".into());
    let mut again = a.clone();
    again.uid = "another".into();
    waiting.apply(PodEvent::Apply(again));
    let entry = waiting.get(&a.key).unwrap();
    assert!(entry.held.is_empty());
    assert_eq!(entry.written, None);
}

#[test]
fn slices_follow_their_service_label_and_relists_drop_what_is_gone() {
    let mut world = World::default();
    let kind = WatchKind::EndpointSlices;
    let holds = |w: &World, service: &str| {
        w.holds(
            &Dependency::Service(initium_engine::Target {
                namespace: None,
                name: service.into(),
            }),
            NS,
            &RuleId::cluster("r"),
        )
    };
    let dirty = listed(&mut world, kind.clone(), vec![slice("db", "s1", 1)]);
    assert_eq!(dirty, vec![service_key("db")]);
    assert!(holds(&world, "db"));
    // The slice is relabelled to another Service.
    let dirty = world.apply(&kind, Update::Apply(slice("cache", "s1", 1)));
    assert_eq!(dirty, vec![service_key("db"), service_key("cache")]);
    assert!(!holds(&world, "db"));
    assert!(holds(&world, "cache"));
    let dirty = listed(&mut world, kind, vec![]);
    assert_eq!(dirty, vec![service_key("cache")]);
    assert!(!holds(&world, "cache"));
}

#[test]
fn gated_pod_facts_come_from_the_pod() {
    let p: Pod = serde_json::from_value(json!({
        "metadata": {"name": "web-1", "namespace": NS, "uid": "u", "resourceVersion": "7",
            "creationTimestamp": "2024-01-01T00:00:00Z", "labels": {GATED_LABEL: "true"}},
        "spec": {"containers": [], "schedulingGates": [{"name": "example.com/a"}, {"name": "initium.dev/shop.x"}],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution":
                {"nodeSelectorTerms": [{"matchExpressions": [{"key": "a", "operator": "Exists"}]}]}}}},
    }))
    .unwrap();
    let g = GatedPod::of(&p).unwrap();
    assert_eq!(g.key.to_string(), "shop/web-1");
    assert_eq!(g.resource_version, "7");
    assert_eq!(g.gates, ["example.com/a", "initium.dev/shop.x"]);
    assert_eq!(
        g.initium_gates().collect::<Vec<_>>(),
        ["initium.dev/shop.x"]
    );
    assert!(g.labeled);
    assert!(g.node_affinity.is_some());
    assert_eq!(g.created, Some("2024-01-01T00:00:00Z".parse().unwrap()));
}

#[test]
fn an_object_is_judged_once_for_all_the_pods_that_wait_on_it_until_what_it_reads_changes() {
    // A tenant's many Pods waiting on one object: the loop that releases everyone's Pods
    // judges its conditions once per change, not once per Pod.
    let r = rule(
        RuleId::namespaced(NS, "after-foo"),
        json!({"waitFor": [{"object": {"apiVersion": "example.com/v1", "kind": "Foo", "name": "f",
            "conditions": [{"path": "$.status.phase", "equals": "Ready"}]}}]}),
    );
    let gates = gates(std::slice::from_ref(&r));
    let foo = object_ref("Foo", NS, "f", true, &["status.phase"]);
    let pods: Vec<_> = (0..200)
        .map(|i| pod(&format!("web-{i}"), &[&gate_of(&r)]))
        .collect();
    let mut world = World::default();
    world.set_namespaced(&foo, true);
    let kind = WatchKind::Object(foo.clone());
    let judged = || initium_engine::JUDGED.with(std::cell::Cell::get);
    let releases = |world: &World| {
        pods.iter()
            .filter(|p| judge(p, &gates, world, &BTreeSet::new(), ts(1)).is_release())
            .count()
    };
    let reduced = |world: &mut World, phase: &str, other: &str| {
        let mut value = json!({"metadata": {"name": "f", "namespace": NS},
            "status": {"phase": phase}, "data": {"other": other}});
        foo.reads.keep(&mut value);
        world.apply(
            &kind,
            Update::Apply(Fact::Object {
                namespace: Some(NS.into()),
                name: "f".into(),
                value: Arc::new(value),
            }),
        )
    };
    assert_eq!(
        reduced(&mut world, "Pending", "a"),
        vec![DepKey::Object(foo.clone())]
    );
    // What the conditions do not read was never kept: a change there changes nothing.
    assert!(reduced(&mut world, "Pending", "b").is_empty());
    assert_eq!(
        world.object_bytes(),
        r#"{"status":{"phase":"Pending"}}"#.len()
    );
    let before = judged();
    assert_eq!(releases(&world), 0);
    assert_eq!(judged() - before, 1, "200 Pods, one judgement");
    reduced(&mut world, "Ready", "b");
    assert_eq!(releases(&world), 200);
    assert_eq!(judged() - before, 2, "judged again once, after the change");
}

#[test]
fn a_written_release_counts_until_the_watch_shows_the_pod_after_it() {
    let mut waiting = Waiting::default();
    let a = pod("a", &["initium.dev/shop.x", "initium.dev/shop.y"]);
    let b = pod("b", &["initium.dev/shop.x"]);
    waiting.apply(PodEvent::Apply(a.clone()));
    waiting.apply(PodEvent::Apply(b.clone()));
    assert_eq!(waiting.written_unseen(), 0);
    for key in [&a.key, &b.key] {
        waiting.get_mut(key).unwrap().written = Some("10".into());
    }
    assert_eq!(waiting.written_unseen(), 2);
    // a keeps another gate: the watch shows its next version.
    let mut a_after = a.clone();
    a_after.resource_version = "11".into();
    a_after.gates = vec!["initium.dev/shop.y".into()];
    waiting.apply(PodEvent::Apply(a_after));
    assert_eq!(waiting.written_unseen(), 1);
    // b lost initium's label: it leaves the watch.
    waiting.apply(PodEvent::Delete(b.key.clone()));
    assert_eq!(waiting.written_unseen(), 0);
}
