//! Every gated Pod with what it waits on: the reverse index (dependency → Pods) and the
//! deadlines, fed by the gated-Pods watch.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use k8s_openapi::jiff::Timestamp;

use super::decision::{Held, Verdict};
use super::pod::{GatedPod, PodKey};
use super::world::{DepKey, WatchKind};

/// What the controller keeps per gated Pod.
#[derive(Clone, Debug)]
pub(crate) struct Entry {
    pub pod: GatedPod,
    /// What it waits on (as last judged).
    pub keys: BTreeSet<DepKey>,
    pub deadline: Option<Timestamp>,
    /// Gates that timed out with `Hold`, each with its event while that is not out yet (what
    /// it waits for as last judged).
    pub held: BTreeMap<String, Option<Held>>,
    /// The resourceVersion a release was written over: not written again until the watch
    /// shows a newer version.
    pub written: Option<String>,
}

impl Entry {
    pub(crate) fn held_gates(&self) -> BTreeSet<String> {
        self.held.keys().cloned().collect()
    }

    /// Records what `verdict`, judged on this Pod, says of its gates timed out with `Hold`:
    /// the new ones, with their event, and for those whose event is not out yet what they
    /// wait for now (nothing, and no event, for one ready or gone meanwhile).
    pub(crate) fn hold(&mut self, verdict: &Verdict) {
        for (gate, unsent) in &mut self.held {
            if unsent.is_some() {
                *unsent = verdict.still_held.iter().find(|h| &h.gate == gate).cloned();
            }
        }
        for held in &verdict.newly_held {
            self.held.insert(held.gate.clone(), Some(held.clone()));
        }
    }

    /// The events of held gates not out yet, in the Pod's order of gates; from now on they are
    /// out.
    pub(crate) fn take_unsent(&mut self) -> Vec<Held> {
        let unsent = self
            .pod
            .gates
            .iter()
            .filter_map(|gate| self.held.get_mut(gate).and_then(Option::take))
            .collect();
        for event in self.held.values_mut() {
            *event = None;
        }
        unsent
    }
}

/// Every gated Pod, the reverse index and the deadlines.
#[derive(Debug, Default)]
pub(crate) struct Waiting {
    pods: HashMap<PodKey, Entry>,
    reverse: HashMap<DepKey, HashSet<PodKey>>,
    deadlines: BTreeSet<(Timestamp, PodKey)>,
    relisting: Option<Vec<GatedPod>>,
}

/// An event of the gated-Pods watch, with the Pod's slim facts.
#[derive(Clone, Debug)]
pub(crate) enum PodEvent {
    Init,
    InitApply(GatedPod),
    InitDone,
    Apply(GatedPod),
    Delete(PodKey),
}

impl Waiting {
    /// Applies one event of the gated-Pods watch; returns the Pods to judge again.
    pub(crate) fn apply(&mut self, event: PodEvent) -> Vec<PodKey> {
        match event {
            PodEvent::Init => {
                self.relisting = Some(Vec::new());
                Vec::new()
            }
            PodEvent::InitApply(pod) => {
                self.relisting.get_or_insert_default().push(pod);
                Vec::new()
            }
            PodEvent::InitDone => {
                let listed = self.relisting.take().unwrap_or_default();
                let keep: HashSet<PodKey> = listed.iter().map(|p| p.key.clone()).collect();
                let gone: Vec<PodKey> = self
                    .pods
                    .keys()
                    .filter(|k| !keep.contains(*k))
                    .cloned()
                    .collect();
                for key in gone {
                    self.remove(&key);
                }
                listed
                    .into_iter()
                    .filter_map(|pod| self.upsert(pod))
                    .collect()
            }
            PodEvent::Apply(pod) => self.upsert(pod).into_iter().collect(),
            PodEvent::Delete(key) => {
                self.remove(&key);
                Vec::new()
            }
        }
    }

    /// Adds or updates a Pod; `Some` when it must be judged (new, or changed).
    fn upsert(&mut self, pod: GatedPod) -> Option<PodKey> {
        let key = pod.key.clone();
        match self.pods.get_mut(&key) {
            Some(entry) if entry.pod == pod => None,
            Some(entry) => {
                if entry.pod.uid != pod.uid {
                    // Same name, another Pod: nothing carries over.
                    entry.held.clear();
                    entry.written = None;
                }
                entry.pod = pod;
                Some(key)
            }
            None => {
                self.pods.insert(
                    key.clone(),
                    Entry {
                        pod,
                        keys: BTreeSet::new(),
                        deadline: None,
                        held: BTreeMap::new(),
                        written: None,
                    },
                );
                Some(key)
            }
        }
    }

    fn remove(&mut self, key: &PodKey) {
        self.set_keys(key, BTreeSet::new());
        self.set_deadline(key, None);
        self.pods.remove(key);
    }

    pub(crate) fn get(&self, key: &PodKey) -> Option<&Entry> {
        self.pods.get(key)
    }

    pub(crate) fn get_mut(&mut self, key: &PodKey) -> Option<&mut Entry> {
        self.pods.get_mut(key)
    }

    pub(crate) fn keys(&self) -> impl Iterator<Item = &PodKey> {
        self.pods.keys()
    }

    pub(crate) fn entries_mut(&mut self) -> impl Iterator<Item = &mut Entry> {
        self.pods.values_mut()
    }

    /// Pods released by a write whose result the watch has not shown yet (the Pod as last
    /// seen is the version the release was written over).
    pub(crate) fn written_unseen(&self) -> usize {
        self.pods
            .values()
            .filter(|e| e.written.as_deref() == Some(e.pod.resource_version.as_str()))
            .count()
    }

    /// Pods with at least one initium gate (the `initium_gated_pods` gauge).
    pub(crate) fn waiting(&self) -> usize {
        self.pods
            .values()
            .filter(|e| e.pod.initium_gates().next().is_some())
            .count()
    }

    /// Records what a Pod waits on (its verdict's keys) in the reverse index.
    pub(crate) fn set_keys(&mut self, key: &PodKey, keys: BTreeSet<DepKey>) {
        let Some(entry) = self.pods.get_mut(key) else {
            return;
        };
        for old in entry.keys.difference(&keys) {
            if let Some(pods) = self.reverse.get_mut(old) {
                pods.remove(key);
                if pods.is_empty() {
                    self.reverse.remove(old);
                }
            }
        }
        for new in keys.difference(&entry.keys) {
            self.reverse
                .entry(new.clone())
                .or_default()
                .insert(key.clone());
        }
        entry.keys = keys;
    }

    /// Records a Pod's next deadline.
    pub(crate) fn set_deadline(&mut self, key: &PodKey, deadline: Option<Timestamp>) {
        let Some(entry) = self.pods.get_mut(key) else {
            return;
        };
        if entry.deadline == deadline {
            return;
        }
        if let Some(old) = entry.deadline.take() {
            self.deadlines.remove(&(old, key.clone()));
        }
        if let Some(new) = deadline {
            self.deadlines.insert((new, key.clone()));
        }
        entry.deadline = deadline;
    }

    /// The earliest deadline of any Pod.
    pub(crate) fn next_deadline(&self) -> Option<Timestamp> {
        self.deadlines.first().map(|(t, _)| *t)
    }

    /// Pods whose deadline is at or before `now`.
    pub(crate) fn due(&self, now: Timestamp) -> Vec<PodKey> {
        self.deadlines
            .iter()
            .take_while(|(t, _)| *t <= now)
            .map(|(_, k)| k.clone())
            .collect()
    }

    /// The Pods waiting on any of `keys`.
    pub(crate) fn affected<'a>(&self, keys: impl IntoIterator<Item = &'a DepKey>) -> Vec<PodKey> {
        let mut pods: BTreeSet<PodKey> = BTreeSet::new();
        for key in keys {
            if let Some(waiting) = self.reverse.get(key) {
                pods.extend(waiting.iter().cloned());
            }
        }
        pods.into_iter().collect()
    }

    /// The kinds some waiting Pod needs watched.
    pub(crate) fn needed_kinds(&self) -> BTreeSet<WatchKind> {
        self.reverse.keys().flat_map(DepKey::kinds).collect()
    }

    /// Number of reverse-index keys (for tests and logs).
    #[cfg(test)]
    pub(crate) fn reverse_len(&self) -> usize {
        self.reverse.len()
    }
}
