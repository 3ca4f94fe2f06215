//! The gate controller's metrics, written from this one place: what the duty holds after each
//! turn of its loop ([`Telemetry::holding`]), what one release write did
//! ([`Telemetry::written`], from the [`Done`] the write gives back) and a gate held on timeout
//! ([`Telemetry::held`]). Nothing else in `gate/` touches them.

use k8s_openapi::jiff::Timestamp;

use super::release::{Done, Outcome};
use super::state::{Reason, Waiting, World};
use crate::metrics::Metrics;

/// The gate metrics of `initium_*` (see `metrics.rs` for their names).
#[derive(Clone, Copy)]
pub(super) struct Telemetry<'a>(pub(super) &'a Metrics);

impl Telemetry<'_> {
    /// The gauges of what the duty holds now: the waiting Pods, and the objects kept for
    /// `object` dependencies with their size.
    pub(super) fn holding(self, waiting: &Waiting, world: &World) {
        let gauge = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        self.0.gated_pods.set(gauge(waiting.waiting()));
        self.0.gate_objects.set(gauge(world.objects()));
        self.0.gate_object_bytes.set(gauge(world.object_bytes()));
    }

    /// One release write ended: the conflicts it met and, once written, the gates it removed
    /// by reason, the timeouts it released, how long the Pod waited and (for a release by
    /// ready dependencies) how long since the last one became ready.
    pub(super) fn written(self, done: &Done) {
        let metrics = self.0;
        metrics
            .gate_write_conflicts
            .inc_by(u64::from(done.conflicts));
        let Outcome::Released { .. } = done.outcome else {
            return;
        };
        let plan = &done.plan;
        for release in &plan.releases {
            metrics.gate_released(release.reason.label());
            if release.reason == Reason::Timeout {
                metrics.gate_timed_out("Release");
            }
        }
        if plan.releases.is_empty() {
            return;
        }
        if let Some(created) = plan.pod.created {
            let waited = Timestamp::now().duration_since(created);
            metrics.gate_wait.observe(waited.as_secs_f64().max(0.0));
        }
        if let Some(trigger) = plan.trigger
            && plan.releases.iter().any(|r| r.reason == Reason::Ready)
        {
            metrics
                .gate_release_latency
                .observe(trigger.elapsed().as_secs_f64());
        }
    }

    /// A gate timed out and stays (`onTimeout: Hold`): counted when its event goes out.
    pub(super) fn held(self) {
        self.0.gate_timed_out("Hold");
    }
}
