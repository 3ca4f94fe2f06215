//! The gate controller's pure half: what it knows about the waiting Pods and about their
//! dependencies, and what follows from it. No client, no clock of its own (the caller passes
//! `now`), no I/O: everything here is unit-tested.
//!
//! - [`pod`]: the slim facts kept per gated Pod ([`GatedPod`], from the gated-Pods watch).
//! - [`world`]: the slim facts of the dependency kinds being watched, and the memory of Jobs
//!   seen succeeded ([`World`]).
//! - [`decision`]: the Ready rules that have a gate, by gate name ([`Gates`], from the rule
//!   index), and, for one Pod, which of its initium gates to release and why, how to narrow
//!   its node affinity, its next deadline, and what it waits on ([`judge()`]).
//! - [`waiting`]: every gated Pod with what it waits on, the reverse index (dependency →
//!   Pods) and the deadlines ([`Waiting`]).
//!
//! The release patch is not here: it is built where it is written (`release.rs`).

pub(crate) mod decision;
pub(crate) mod pod;
pub(crate) mod waiting;
pub(crate) mod world;

pub(crate) use decision::{Gates, Held, Reason, Release, Verdict, judge};
pub(crate) use pod::{GatedPod, PodKey};
pub(crate) use waiting::{PodEvent, Waiting};
pub(crate) use world::{Fact, ObjectKind, ObjectRef, Update, WatchKind, World};

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests;
