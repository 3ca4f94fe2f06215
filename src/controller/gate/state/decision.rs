//! The decision for one Pod: which of its initium gates to release and why, how to narrow its
//! node affinity, its next deadline, and what it waits on; by the Ready rules that have a gate
//! ([`Gates`]) and the facts of the [`World`].

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use k8s_openapi::jiff::{SignedDuration, Timestamp};

use super::pod::GatedPod;
use super::world::{DepKey, World};
use initium_engine::api::OnTimeout;
use initium_engine::{CompiledGate, Dependency, RuleId, RuleIndex};

/// A Ready rule with a gate.
#[derive(Clone, Debug)]
pub(crate) struct GateRule {
    pub rule: RuleId,
    pub gate: Arc<CompiledGate>,
}

/// The Ready rules that have a gate, by gate name.
#[derive(Clone, Debug, Default)]
pub(crate) struct Gates(HashMap<String, GateRule>);

impl Gates {
    pub(crate) fn of(index: &RuleIndex) -> Gates {
        Gates(
            index
                .rules()
                .iter()
                .filter_map(|rule| {
                    rule.gate().map(|gate| {
                        (
                            gate.name.clone(),
                            GateRule {
                                rule: rule.id.clone(),
                                gate: gate.clone(),
                            },
                        )
                    })
                })
                .collect(),
        )
    }

    pub(crate) fn get(&self, gate: &str) -> Option<&GateRule> {
        self.0.get(gate)
    }
}

/// Why a gate is released.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reason {
    /// Every dependency holds.
    Ready,
    /// The timeout passed and the rule says `onTimeout: Release`.
    Timeout,
    /// No Ready rule has this gate any more.
    RuleGone,
}

impl Reason {
    /// The `reason` label of `initium_gate_releases_total`.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Reason::Ready => "ready",
            Reason::Timeout => "timeout",
            Reason::RuleGone => "rule_gone",
        }
    }
}

/// One gate to remove, and what to tell about it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Release {
    pub gate: String,
    pub reason: Reason,
    /// The rule, when it still has the gate.
    pub rule: Option<RuleId>,
    /// Ready: the dependencies (all ready). Timeout: the ones still not ready.
    pub dependencies: Vec<String>,
    /// The timeout, for the event of a timeout.
    pub timeout: Option<std::time::Duration>,
}

/// A gate whose timeout passed with `onTimeout: Hold`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Held {
    pub gate: String,
    pub rule: RuleId,
    pub pending: Vec<String>,
    pub timeout: std::time::Duration,
}

/// What follows for one Pod from the rules and the facts.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Verdict {
    /// Gates to remove now, in the Pod's order.
    pub release: Vec<Release>,
    /// Narrow the Pod to these nodes in the same write (the DaemonSets of the released gates
    /// are Ready there).
    pub nodes: Option<BTreeSet<String>>,
    /// The earliest timeout of a gate still timed.
    pub deadline: Option<Timestamp>,
    /// Gates that timed out just now with `onTimeout: Hold` (not in `held` before).
    pub newly_held: Vec<Held>,
    /// Gates in `held` that still wait, timed out with `onTimeout: Hold`, with what they wait
    /// for now: the details of their event while it is not out yet.
    pub still_held: Vec<Held>,
    /// What the Pod waits on (for the reverse index).
    pub keys: BTreeSet<DepKey>,
}

impl Verdict {
    pub(crate) fn is_release(&self) -> bool {
        !self.release.is_empty()
    }
}

/// When a gate of `gate` on a Pod created at `created` times out.
fn deadline(created: Option<Timestamp>, gate: &CompiledGate) -> Option<Timestamp> {
    let timeout = SignedDuration::try_from(gate.timeout).ok()?;
    created?.checked_add(timeout).ok()
}

/// Judges one Pod: for each of its initium gates, the rule that has it and whether its
/// dependencies hold (by the rule's current spec). `held` are the Pod's gates that already
/// timed out with `Hold` (they wait on, untimed).
pub(crate) fn judge(
    pod: &GatedPod,
    gates: &Gates,
    world: &World,
    held: &BTreeSet<String>,
    now: Timestamp,
) -> Verdict {
    let ns = pod.key.namespace.as_str();
    let mut verdict = Verdict::default();
    // Gates ready by their dependencies, with the nodes their DaemonSets allow.
    let mut ready: Vec<(Release, Option<BTreeSet<String>>)> = Vec::new();
    for name in pod.initium_gates() {
        let Some(GateRule { rule, gate }) = gates.get(name) else {
            verdict.release.push(Release {
                gate: name.to_string(),
                reason: Reason::RuleGone,
                rule: None,
                dependencies: Vec::new(),
                timeout: None,
            });
            continue;
        };
        let mut pending = Vec::new();
        let mut nodes: Option<BTreeSet<String>> = None;
        for dep in &gate.wait_for {
            let key = DepKey::of(dep, ns, rule);
            if let DepKey::Object(object) = &key
                && world.refused(object)
            {
                pending.push(format!(
                    "{} (never judged: it is cluster-scoped, and a MutationRule may only wait on \
                     namespaced objects of its own namespace; wait on an object in {ns}, or use \
                     a ClusterMutationRule)",
                    dep.describe(ns)
                ));
                verdict.keys.insert(key);
                continue;
            }
            verdict.keys.insert(key);
            if !world.holds(dep, ns, rule) {
                pending.push(dep.describe(ns));
                continue;
            }
            if let Dependency::DaemonSet(t) = dep {
                let here = world.daemon_set_nodes(dep.namespace(ns), &t.name);
                nodes = Some(match nodes {
                    None => here,
                    Some(n) => n.intersection(&here).cloned().collect(),
                });
            }
        }
        // Two DaemonSets Ready on no common node: not ready (the Pod could not run there).
        if pending.is_empty() && nodes.as_ref().is_none_or(|n| !n.is_empty()) {
            let release = Release {
                gate: name.to_string(),
                reason: Reason::Ready,
                rule: Some(rule.clone()),
                dependencies: gate.wait_for.iter().map(|d| d.describe(ns)).collect(),
                timeout: None,
            };
            ready.push((release, nodes));
            continue;
        }
        if pending.is_empty() {
            pending.push("DaemonSets Ready on a common node".into());
        }
        let due = deadline(pod.created, gate);
        if held.contains(name) {
            // Untimed now; what it still waits for, for its event if that is not out yet.
            if matches!(gate.on_timeout, OnTimeout::Hold) && due.is_some_and(|due| due <= now) {
                verdict.still_held.push(Held {
                    gate: name.to_string(),
                    rule: rule.clone(),
                    pending,
                    timeout: gate.timeout,
                });
            }
            continue;
        }
        match due {
            Some(due) if due <= now => match gate.on_timeout {
                OnTimeout::Release => verdict.release.push(Release {
                    gate: name.to_string(),
                    reason: Reason::Timeout,
                    rule: Some(rule.clone()),
                    dependencies: pending,
                    timeout: Some(gate.timeout),
                }),
                OnTimeout::Hold => verdict.newly_held.push(Held {
                    gate: name.to_string(),
                    rule: rule.clone(),
                    pending,
                    timeout: gate.timeout,
                }),
            },
            Some(due) => {
                verdict.deadline = Some(verdict.deadline.map_or(due, |d| d.min(due)));
            }
            None => {}
        }
    }
    // All ready gates go in the same write, narrowed to the nodes every one of them allows;
    // if their DaemonSets have no node in common, the ones that narrow wait.
    let mut nodes: Option<BTreeSet<String>> = None;
    for (_, n) in &ready {
        if let Some(n) = n {
            nodes = Some(match nodes {
                None => n.clone(),
                Some(all) => all.intersection(n).cloned().collect(),
            });
        }
    }
    let disjoint = nodes.as_ref().is_some_and(BTreeSet::is_empty);
    for (release, n) in ready {
        if disjoint && n.is_some() {
            continue;
        }
        verdict.release.push(release);
    }
    if !disjoint {
        verdict.nodes = nodes;
    }
    // In the Pod's order.
    let order: HashMap<&str, usize> = pod
        .gates
        .iter()
        .enumerate()
        .map(|(i, g)| (g.as_str(), i))
        .collect();
    verdict
        .release
        .sort_by_key(|r| order.get(r.gate.as_str()).copied());
    verdict
}
