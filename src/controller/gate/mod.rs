//! The `gates` duty: removes initium's scheduling gates from Pods once their rule's
//! `gate.waitFor` dependencies hold, or on timeout, or when the rule is gone.
//!
//! **Watches only.** One watch of the gated Pods (label `initium.dev/gated`), keeping slim
//! facts per Pod ([`state::GatedPod`]), and one watch per dependency kind some waiting Pod
//! needs now ([`watch`]): EndpointSlices (`service`), Jobs (`job`), Pods (`pods`, and the
//! Pods of a `daemonSet`), DaemonSets (`daemonSet`), and one per object an `object`
//! dependency names (its kind resolved through discovery; field selector `metadata.name`, in
//! the object's namespace when the kind is namespaced, so only named objects are kept). A
//! MutationRule's `object` dependency on a kind discovery finds cluster-scoped is never
//! watched nor judged (see [`state::ObjectRef`]). A watch starts when the first waiting Pod
//! needs it and stops when the last one is released. A reverse index (dependency →
//! Pods) makes a change re-judge only the Pods waiting on it; a change of the rule index
//! re-judges every Pod by the rules' current specs. Timeouts are one timer on the earliest
//! deadline. Nothing is read per Pod, except the one Pod a 409 tells is stale.
//!
//! **Decisions** ([`state::judge`]): a gate whose rule is no longer Ready (or deleted) is
//! released (`GateRuleGone`); a gate whose dependencies all hold is released
//! (`GateReleased`); a gate past its timeout is released (`onTimeout: Release`) or kept with
//! one `GateTimedOut` event and no more timing (`Hold`; it is still released once its
//! dependencies hold). Nothing is judged before the rule index is complete.
//!
//! **Writes** ([`release`]): only the Lease holder writes; the others keep the same state
//! warm and, on gaining the Lease, release every releasable Pod at once. One merge patch per
//! Pod with its resourceVersion, at most `--gate-release-concurrency` at a time; as many more
//! wait for a slot with their patch ready (in the order they were dispatched), so a write that
//! ends is followed at once by the next, not after a turn of the duty's loop. A release
//! waiting for a slot was decided at most one round of writes before it is written.
//!
//! **Job memory**: a Job seen succeeded stays satisfied for later Pods after it is deleted
//! (a TTL), in every replica (all run the watches), so it survives a leader change. A
//! restart of every replica forgets it: a Pod then waits for the Job to reappear, or its
//! timeout. Only Jobs seen while some Pod waited on Jobs are remembered.

pub(crate) mod release;
pub(crate) mod state;
mod telemetry;
pub(crate) mod watch;

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use tokio::sync::{Semaphore, mpsc, watch as channel};
use tokio::task::JoinSet;
use tokio::time::Instant;

use self::release::{Done, Events, Outcome, Plan};
use self::state::{
    GatedPod, Gates as GateRules, PodEvent, PodKey, Reason, Verdict, Waiting, World,
};
use self::telemetry::Telemetry;
use self::watch::{KindEvent, KindUpdate, Watches};
use super::duty::{Context, Duty};
use super::rules::Snapshot;
use super::vocabulary::{ControllerError, FIELD_MANAGER, Leader, Readiness};
use crate::admission::state::Shared;
use crate::report::report;
use initium_engine::RuleIndex;
use initium_engine::api::GATED_LABEL;

/// How often the duty looks whether the rule index is complete, until it is (in memory).
const SYNC_CHECK: Duration = Duration::from_millis(100);
/// First retry of a failed release write; doubles up to [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(60);
/// Releases dispatched at once, in rounds of `--gate-release-concurrency`: one round writing,
/// the next waiting for their slots.
const DISPATCHED_ROUNDS: usize = 2;

/// The `gates` duty (see the module documentation).
pub(crate) struct Gates {
    client: Client,
    shared: Arc<Shared>,
    readiness: Arc<Readiness>,
    snapshot: channel::Receiver<Arc<Snapshot>>,
    leader: Leader,
    /// This replica's identity (the Lease's): the reporting instance of its Events.
    identity: String,
    /// Release writes in flight at most.
    concurrency: usize,
    /// Dependency facts; kept here so the memory of succeeded Jobs outlives a restart of the
    /// duty.
    world: World,
}

impl Gates {
    pub(crate) fn new(
        client: Client,
        shared: Arc<Shared>,
        readiness: Arc<Readiness>,
        snapshot: channel::Receiver<Arc<Snapshot>>,
        leader: Leader,
        identity: String,
        concurrency: usize,
    ) -> Gates {
        Gates {
            concurrency: concurrency.max(1),
            client,
            shared,
            readiness,
            snapshot,
            leader,
            identity,
            world: World::default(),
        }
    }
}

/// A Pod that can be written, with what to write.
struct Releasable {
    verdict: Verdict,
    trigger: Option<Instant>,
}

/// The state of one run of the duty.
struct Run<'a> {
    client: Client,
    shared: &'a Shared,
    telemetry: Telemetry<'a>,
    world: &'a mut World,
    leader: Leader,
    events: Events,
    concurrency: usize,
    /// Release writes dispatched now (writing or waiting for a slot) and written releases
    /// the watch has not shown yet: the Event publisher waits while there are any.
    writing: channel::Sender<usize>,
    /// `concurrency` slots: a dispatched release writes only while it holds one.
    slots: Arc<Semaphore>,
    waiting: Waiting,
    rules: GateRules,
    index: Option<Arc<RuleIndex>>,
    synced: bool,
    watches: Watches,
    /// Pods whose verdict is a release (or a left-over label), judged by every replica.
    releasable: BTreeMap<PodKey, Releasable>,
    in_flight: HashSet<PodKey>,
    writes: JoinSet<Done>,
    leader_since: Option<Instant>,
    retry: BTreeSet<PodKey>,
    retry_at: Option<Instant>,
    backoff: super::duty::Backoff,
}

impl Duty for Gates {
    const NAME: &'static str = "gates";

    async fn run(&mut self, mut context: Context) -> Result<(), ControllerError> {
        let Gates {
            client,
            shared,
            readiness,
            snapshot,
            leader,
            identity,
            concurrency,
            world,
        } = self;
        world.restart();
        let api = Api::<Pod>::all(client.clone());
        let mut pods = watcher(api, watcher::Config::default().labels(GATED_LABEL))
            .default_backoff()
            .boxed();
        let (tx, mut updates) = mpsc::unbounded_channel::<KindUpdate>();
        let reporter = Reporter {
            controller: FIELD_MANAGER.into(),
            instance: Some(identity.clone()),
        };
        let (writing_tx, writing_rx) = channel::channel(0);
        let mut run = Run {
            client: client.clone(),
            shared,
            telemetry: Telemetry(&shared.metrics),
            world,
            leader: leader.clone(),
            events: Events::start(Recorder::new(client.clone(), reporter), writing_rx),
            writing: writing_tx,
            concurrency: *concurrency,
            slots: Arc::new(Semaphore::new(*concurrency)),
            watches: Watches::new(client.clone(), tx, context.clone()),
            backoff: context.backoff(RETRY_FIRST, RETRY_MAX),
            waiting: Waiting::default(),
            rules: GateRules::default(),
            index: None,
            synced: false,
            releasable: BTreeMap::new(),
            in_flight: HashSet::new(),
            writes: JoinSet::new(),
            leader_since: leader.is_leader().then(Instant::now),
            retry: BTreeSet::new(),
            retry_at: None,
        };
        loop {
            let deadline = run.waiting.next_deadline().map(instant_of);
            let mut dirty: BTreeSet<PodKey> = BTreeSet::new();
            let mut rules_changed = false;
            let mut pod_events = Vec::new();
            let mut kind_updates = Vec::new();
            tokio::select! {
                () = context.stop.wait() => return Ok(()),
                event = pods.next() => pod_events.push(event),
                Some(update) = updates.recv() => kind_updates.push(update),
                changed = snapshot.changed() => {
                    if changed.is_err() {
                        return Ok(());
                    }
                    rules_changed = true;
                }
                () = leader.changed() => {
                    if leader.is_leader() && run.leader_since.is_none() {
                        run.leader_since = Some(Instant::now());
                        tracing::info!(duty = Self::NAME, releasable = run.releasable.len(), "leading: releasing every releasable Pod");
                        run.publish_held();
                    } else if !leader.is_leader() {
                        run.leader_since = None;
                    }
                }
                () = sleep_until(deadline) => {
                    dirty.extend(run.waiting.due(Timestamp::now()));
                }
                () = sleep_until(run.retry_at) => {
                    run.retry_at = None;
                    dirty.extend(std::mem::take(&mut run.retry));
                }
                Some(done) = run.writes.join_next(), if !run.writes.is_empty() => {
                    match done {
                        Ok(done) => run.done(done),
                        Err(e) => return Err(ControllerError::Task { task: Self::NAME, message: format!("a release write stopped: {e}") }),
                    }
                }
                () = tokio::time::sleep(SYNC_CHECK), if !run.synced => {}
            }
            let received = Instant::now();
            // Coalesce what is already waiting: a relist or a burst is judged once.
            while let Some(event) = pods.next().now_or_never() {
                pod_events.push(event);
            }
            while let Ok(update) = updates.try_recv() {
                kind_updates.push(update);
            }
            for event in pod_events {
                let event = match event {
                    Some(Ok(event)) => event,
                    Some(Err(e)) => {
                        context
                            .watch_failed("watching gated Pods failed; retrying with backoff", &e);
                        continue;
                    }
                    None => {
                        return Err(ControllerError::Task {
                            task: Self::NAME,
                            message: "the gated-Pods watch ended".into(),
                        });
                    }
                };
                let listed = matches!(event, watcher::Event::InitDone);
                let event = match event {
                    watcher::Event::Init => PodEvent::Init,
                    watcher::Event::InitDone => PodEvent::InitDone,
                    watcher::Event::InitApply(pod) => match GatedPod::of(&pod) {
                        Some(pod) => PodEvent::InitApply(pod),
                        None => continue,
                    },
                    watcher::Event::Apply(pod) => match GatedPod::of(&pod) {
                        Some(pod) => PodEvent::Apply(pod),
                        None => continue,
                    },
                    watcher::Event::Delete(pod) => match GatedPod::of(&pod) {
                        Some(pod) => {
                            run.releasable.remove(&pod.key);
                            PodEvent::Delete(pod.key)
                        }
                        None => continue,
                    },
                };
                dirty.extend(run.waiting.apply(event));
                if listed {
                    readiness.done(Readiness::GATED_PODS);
                }
            }
            for update in kind_updates {
                if !run.watches.is_current(&update) {
                    continue;
                }
                match update.event {
                    KindEvent::Namespaced(namespaced) => {
                        if let state::WatchKind::Object(object) = &update.kind {
                            let key = run.world.set_namespaced(object, namespaced);
                            dirty.extend(run.waiting.affected([&key]));
                        }
                    }
                    KindEvent::Update(u) => {
                        let keys = run.world.apply(&update.kind, u);
                        dirty.extend(run.waiting.affected(&keys));
                    }
                }
            }
            if !run.synced && run.shared.is_synced() {
                run.synced = true;
                rules_changed = true;
            }
            if rules_changed && run.synced {
                let index = run.shared.rules.load_full();
                if run.index.as_ref().is_none_or(|i| !Arc::ptr_eq(i, &index)) {
                    run.rules = GateRules::of(&index);
                    run.index = Some(index);
                    dirty.extend(run.waiting.keys().cloned());
                }
            }
            if run.synced {
                run.judge(dirty, received);
                run.sync_watches();
            }
            run.telemetry.holding(&run.waiting, run.world);
            if leader.is_leader() {
                run.dispatch();
            }
            // Events wait for the wave: the writes dispatched, and the releases written that
            // the watch has not shown yet (the API server is still sending them, to initium
            // and to every other watcher of these Pods).
            run.writing
                .send_replace(run.in_flight.len() + run.waiting.written_unseen());
        }
    }
}

impl Run<'_> {
    /// Judges `pods` again, keeps the reverse index, the deadlines and the watches current.
    fn judge(&mut self, pods: BTreeSet<PodKey>, received: Instant) {
        if pods.is_empty() {
            return;
        }
        let now = Timestamp::now();
        for key in pods {
            let Some(entry) = self.waiting.get(&key) else {
                self.releasable.remove(&key);
                continue;
            };
            let verdict = state::judge(
                &entry.pod,
                &self.rules,
                self.world,
                &entry.held_gates(),
                now,
            );
            let unlabel = entry.pod.labeled && entry.pod.initium_gates().next().is_none();
            self.waiting.set_keys(&key, verdict.keys.clone());
            self.waiting.set_deadline(&key, verdict.deadline);
            if let Some(entry) = self.waiting.get_mut(&key) {
                entry.hold(&verdict);
            }
            if verdict.is_release() || unlabel {
                let ready = verdict.release.iter().any(|r| r.reason == Reason::Ready);
                let trigger = self
                    .releasable
                    .get(&key)
                    .and_then(|r| r.trigger)
                    .or(ready.then_some(received));
                self.releasable.insert(key, Releasable { verdict, trigger });
            } else {
                self.releasable.remove(&key);
            }
        }
        if self.leader.is_leader() {
            self.publish_held();
        }
    }

    /// Starts and stops dependency watches to match what the waiting Pods need now.
    fn sync_watches(&mut self) {
        for kind in self.watches.sync(&self.waiting.needed_kinds()) {
            self.world.forget(&kind);
        }
    }

    /// Starts the writes of releasable Pods: `concurrency` write at a time (each holds a
    /// slot), and up to as many more wait for a slot with their plan, so that a slot freed is
    /// taken at once.
    fn dispatch(&mut self) {
        let mut gone = Vec::new();
        for (key, releasable) in &self.releasable {
            if self.in_flight.len() >= self.concurrency.saturating_mul(DISPATCHED_ROUNDS) {
                break;
            }
            if self.in_flight.contains(key) || self.retry.contains(key) {
                continue;
            }
            let Some(entry) = self.waiting.get(key) else {
                gone.push(key.clone());
                continue;
            };
            if entry.written.as_ref() == Some(&entry.pod.resource_version) {
                continue;
            }
            let trigger = match (releasable.trigger, self.leader_since) {
                (Some(t), Some(l)) => Some(t.max(l)),
                (t, _) => t,
            };
            let plan = Plan {
                pod: entry.pod.clone(),
                releases: releasable.verdict.release.clone(),
                nodes: releasable.verdict.nodes.clone(),
                trigger,
            };
            self.in_flight.insert(key.clone());
            let (client, events, slots, leader) = (
                self.client.clone(),
                self.events.clone(),
                self.slots.clone(),
                self.leader.clone(),
            );
            self.writes.spawn(async move {
                // The semaphore is never closed; were it, the write would go without a slot.
                let _slot = slots.acquire_owned().await.ok();
                // The Lease may have been lost while this release waited for its slot.
                if !leader.is_leader() {
                    return Done {
                        key: plan.pod.key.clone(),
                        plan,
                        outcome: Outcome::NotLeading,
                        conflicts: 0,
                    };
                }
                release::release(client, events, plan).await
            });
        }
        for key in gone {
            self.releasable.remove(&key);
        }
    }

    /// A write ended: metrics, and what to remember.
    fn done(&mut self, done: Done) {
        self.telemetry.written(&done);
        let Done {
            key, plan, outcome, ..
        } = done;
        self.in_flight.remove(&key);
        match outcome {
            Outcome::Released { over } => {
                self.backoff.succeeded();
                if let Some(entry) = self.waiting.get_mut(&key) {
                    entry.written = Some(over);
                }
                self.releasable.remove(&key);
                if plan.releases.is_empty() {
                    return;
                }
                let gates: Vec<&str> = plan.releases.iter().map(|r| r.gate.as_str()).collect();
                tracing::info!(duty = "gates", pod = %key, gates = ?gates, "released");
            }
            Outcome::AlreadyReleased { at } => {
                if let Some(entry) = self.waiting.get_mut(&key) {
                    entry.written = Some(at);
                }
                self.releasable.remove(&key);
            }
            Outcome::Gone => {
                self.releasable.remove(&key);
            }
            // Still releasable: written when this replica leads again.
            Outcome::NotLeading => {}
            Outcome::Conflicted => self.failed(
                key,
                &format!(
                    "releasing the gates of Pod {} met {} conflicts in a row; retrying",
                    plan.pod.key,
                    release::MAX_ATTEMPTS
                ),
            ),
            Outcome::Failed(e) => self.failed(
                key,
                &format!(
                    "releasing the gates of Pod {} failed: {}; retrying",
                    plan.pod.key,
                    report(&e)
                ),
            ),
        }
    }

    fn failed(&mut self, key: PodKey, message: &str) {
        let wait = self
            .backoff
            .failed("a release write failed; retrying with backoff", &message);
        self.retry.insert(key);
        let at = Instant::now() + wait;
        self.retry_at = Some(self.retry_at.map_or(at, |r| r.min(at)));
    }

    /// Publishes the `GateTimedOut` events of held gates not published yet (leader only),
    /// with what they wait for as last judged.
    fn publish_held(&mut self) {
        for entry in self.waiting.entries_mut() {
            for held in entry.take_unsent() {
                self.telemetry.held();
                self.events.held(entry.pod.clone(), held);
            }
        }
    }
}

/// A wall-clock deadline as a tokio instant.
fn instant_of(deadline: Timestamp) -> Instant {
    let wait = Timestamp::now().duration_until(deadline);
    Instant::now() + Duration::try_from(wait).unwrap_or(Duration::ZERO)
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
