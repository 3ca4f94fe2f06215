//! Duties: the long-running parts of the controller (watches, writers, the Lease, certificate
//! reload), and the one supervisor that runs them.
//!
//! A duty is a type implementing [`Duty`], in its own file: its state that must outlive a
//! restart lives in the type (the sender it publishes on, the certificate it serves), the rest
//! in [`Duty::run`]. The [`Supervisor`] starts every duty, restarts one that fails with
//! backoff, counts its failures in `initium_duty_failures_total{duty}` and its restarts in
//! `initium_duty_restarts_total{duty}`, and takes the process down when a duty cannot go on:
//!
//! - a fatal error ([`ControllerError::is_fatal`]: the configuration cannot work), at once;
//! - [`MAX_CONSECUTIVE_FAILURES`] failed starts in a row (each run shorter than
//!   [`HEALTHY_RUN`]): about half a minute of restarts that did not help. The process exits
//!   with the last cause and Kubernetes restarts the container, rather than a replica that
//!   silently does less living on;
//! - a panic, at once.
//!
//! Inside a duty, failures that are retried in place (a write, a discovery read) go through
//! one [`Backoff`]: it logs the error with the duty's name, counts it in the same metric and
//! says how long to wait.

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::vocabulary::{ControllerError, Stop};
use crate::metrics::Metrics;
use crate::report::report;

/// A long-running part of the controller.
pub(crate) trait Duty: Send + 'static {
    /// The duty's name in logs and in the `duty` label of its metrics.
    const NAME: &'static str;

    /// Does the duty until `context.stop` is set, then returns `Ok`. Returning earlier, or
    /// with an error, makes the supervisor start it again after a backoff (or, for a fatal
    /// error, stop the process).
    fn run(&mut self, context: Context)
    -> impl Future<Output = Result<(), ControllerError>> + Send;
}

/// What the supervisor gives a duty each time it starts it.
#[derive(Clone, Debug)]
pub(crate) struct Context {
    /// Set once, on shutdown.
    pub(crate) stop: Stop,
    failures: Failures,
}

impl Context {
    /// A backoff for failures retried inside the duty: the first retry after `first`, each
    /// next one twice as late, at most `max`.
    pub(crate) fn backoff(&self, first: Duration, max: Duration) -> Backoff {
        Backoff {
            failures: self.failures.clone(),
            first,
            max,
            consecutive: 0,
        }
    }

    /// Logs and counts a failure that something else retries (a watch's own backoff).
    pub(crate) fn failed(&self, what: &str, error: &dyn std::fmt::Display) {
        self.failures.count();
        let error = error.to_string();
        let error =
            initium_engine::untrusted::capped(&error, initium_engine::untrusted::MAX_ERROR_BYTES);
        tracing::warn!(duty = self.failures.duty, error = %error, "{what}");
    }

    /// A watch's error, which the watch retries by itself: [`Context::failed`] with `what`,
    /// except an expired resourceVersion (410), which is the watch protocol asking for a new
    /// list. That is logged at info and not counted: in a large cluster it happens every few
    /// minutes, and counting it would keep `InitiumDutyFailing` firing on a healthy replica.
    pub(crate) fn watch_failed(&self, what: &str, error: &kube::runtime::watcher::Error) {
        if crate::kube_errors::is_expired(error) {
            tracing::info!(
                duty = self.failures.duty,
                detail = %report(error),
                "a watch's resourceVersion expired (410); listing again, as every Kubernetes \
                 client does"
            );
        } else {
            self.failed(what, &report(error));
        }
    }
}

/// The failure counter of one duty.
#[derive(Clone, Debug)]
struct Failures {
    duty: &'static str,
    counter: Counter,
}

impl Failures {
    fn count(&self) {
        self.counter.inc();
    }
}

/// Backoff between retries after consecutive failures: `first`, then doubling, at most `max`.
/// Every failure is logged with the duty's name and counted in its failure metric.
#[derive(Debug)]
pub(crate) struct Backoff {
    failures: Failures,
    first: Duration,
    max: Duration,
    consecutive: u32,
}

impl Backoff {
    /// Records a failure (`what` says what failed, as the log message) and returns how long
    /// to wait before trying again.
    pub(crate) fn failed(&mut self, what: &str, error: &dyn std::fmt::Display) -> Duration {
        self.consecutive = self.consecutive.saturating_add(1);
        let wait = self.delay();
        self.failures.count();
        let error = error.to_string();
        let error =
            initium_engine::untrusted::capped(&error, initium_engine::untrusted::MAX_ERROR_BYTES);
        tracing::warn!(
            duty = self.failures.duty,
            error = %error,
            retry_in = ?wait,
            "{what}"
        );
        wait
    }

    /// The attempt worked: the next failure waits `first` again.
    pub(crate) fn succeeded(&mut self) {
        self.consecutive = 0;
    }

    /// Failures since the last success.
    pub(crate) fn consecutive(&self) -> u32 {
        self.consecutive
    }

    fn delay(&self) -> Duration {
        // Doubling 2^6 times already reaches a minute from a second; no need to go on (and
        // overflow) past that.
        let doublings = self.consecutive.saturating_sub(1).min(6);
        self.first
            .checked_mul(1 << doublings)
            .map_or(self.max, |delay| delay.min(self.max))
    }
}

/// First wait before restarting a failed duty; it doubles with every failed start.
pub(crate) const RESTART_FIRST: Duration = Duration::from_secs(1);
/// Longest wait before restarting a failed duty.
pub(crate) const RESTART_MAX: Duration = Duration::from_secs(16);
/// A duty that fails this many times in a row (each run shorter than [`HEALTHY_RUN`]) takes
/// the process down: with the waits above, about half a minute of restarts.
pub(crate) const MAX_CONSECUTIVE_FAILURES: u32 = 6;
/// A duty that ran this long before failing is restarted as if for the first time.
pub(crate) const HEALTHY_RUN: Duration = Duration::from_secs(60);

/// Starts the duties and watches over them until shutdown.
pub(crate) struct Supervisor<'m> {
    metrics: &'m Metrics,
    stop: Stop,
    duties: JoinSet<Result<(), ControllerError>>,
    /// The duty each task runs, to name a duty that panicked.
    names: HashMap<tokio::task::Id, &'static str>,
}

impl<'m> Supervisor<'m> {
    pub(crate) fn new(metrics: &'m Metrics, stop: Stop) -> Supervisor<'m> {
        Supervisor {
            metrics,
            stop,
            duties: JoinSet::new(),
            names: HashMap::new(),
        }
    }

    /// Starts `duty` now, and again whenever it fails, until shutdown.
    pub(crate) fn start<D: Duty>(&mut self, duty: D) {
        let failures = Failures {
            duty: D::NAME,
            counter: self.metrics.duty_failures(D::NAME),
        };
        let restarts = self.metrics.duty_restarts(D::NAME);
        let stop = self.stop.clone();
        let task = self.duties.spawn(supervise(duty, stop, failures, restarts));
        self.names.insert(task.id(), D::NAME);
    }

    /// Runs until `shutdown` completes or a duty cannot go on (its error is returned), then
    /// sets `stop` with `stop_tx` and waits for every duty to finish.
    pub(crate) async fn run(
        mut self,
        shutdown: impl Future<Output = ()>,
        stop_tx: tokio::sync::watch::Sender<bool>,
    ) -> Result<(), ControllerError> {
        let mut result = Ok(());
        tokio::select! {
            () = shutdown => tracing::info!("controller shutting down"),
            Some(ended) = self.duties.join_next_with_id() => {
                // A duty returns before shutdown only once it cannot go on.
                result = Err(match ended {
                    Ok((_, Err(e))) => e,
                    Ok((id, Ok(()))) => ControllerError::Task {
                        task: self.name(id),
                        message: "ended before shutdown".into(),
                    },
                    Err(e) => ControllerError::Task {
                        task: self.name(e.id()),
                        message: e.to_string(),
                    },
                });
            }
        }
        let _ = stop_tx.send(true);
        while let Some(ended) = self.duties.join_next_with_id().await {
            let (id, error) = match ended {
                Ok((_, Ok(()))) => continue,
                Ok((id, Err(e))) => (id, report(&e)),
                Err(e) => (e.id(), e.to_string()),
            };
            tracing::warn!(duty = self.name(id), %error, "controller duty failed while stopping");
        }
        result
    }

    fn name(&self, task: tokio::task::Id) -> &'static str {
        self.names.get(&task).copied().unwrap_or("unknown")
    }
}

/// Runs `duty` until shutdown, restarting it with backoff; returns an error once it cannot go
/// on.
async fn supervise<D: Duty>(
    mut duty: D,
    mut stop: Stop,
    failures: Failures,
    restarts: Counter,
) -> Result<(), ControllerError> {
    let context = Context {
        stop: stop.clone(),
        failures,
    };
    let mut backoff = context.backoff(RESTART_FIRST, RESTART_MAX);
    loop {
        let started = Instant::now();
        let error = match duty.run(context.clone()).await {
            Ok(()) if stop.is_set() => return Ok(()),
            Ok(()) => ControllerError::Task {
                task: D::NAME,
                message: "ended before shutdown".into(),
            },
            Err(e) if e.is_fatal() || stop.is_set() => return Err(e),
            Err(e) => e,
        };
        if started.elapsed() >= HEALTHY_RUN {
            backoff.succeeded();
        }
        if backoff.consecutive() + 1 >= MAX_CONSECUTIVE_FAILURES {
            context.failures.count();
            return Err(ControllerError::Duty {
                duty: D::NAME,
                failures: MAX_CONSECUTIVE_FAILURES,
                source: Box::new(error),
            });
        }
        let wait = backoff.failed("the duty failed; restarting it", &report(&error));
        restarts.inc();
        if stop.sleep(wait).await {
            return Ok(());
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    fn context(metrics: &Metrics) -> (tokio::sync::watch::Sender<bool>, Context) {
        let (stop_tx, stop) = Stop::channel();
        let context = Context {
            stop,
            failures: Failures {
                duty: "test",
                counter: metrics.duty_failures("test"),
            },
        };
        (stop_tx, context)
    }

    #[test]
    fn backoff_doubles_up_to_its_cap_and_starts_over_after_a_success() {
        let metrics = Metrics::default();
        let (_stop, context) = context(&metrics);
        let mut backoff = context.backoff(Duration::from_millis(500), Duration::from_secs(5));
        let waits: Vec<Duration> = (0..6).map(|_| backoff.failed("failed", &"boom")).collect();
        let ms = |n| Duration::from_millis(n);
        assert_eq!(
            waits,
            [ms(500), ms(1000), ms(2000), ms(4000), ms(5000), ms(5000)]
        );
        assert_eq!(backoff.consecutive(), 6);
        assert_eq!(metrics.duty_failures("test").get(), 6);
        backoff.succeeded();
        assert_eq!(backoff.failed("failed", &"boom"), ms(500));
        assert_eq!(metrics.duty_failures("test").get(), 7);
    }

    #[test]
    fn an_expired_watch_is_not_counted_as_a_failure_and_other_watch_errors_are() {
        let metrics = Metrics::default();
        let (_stop, context) = context(&metrics);
        let watch_error = |code, reason: &str| {
            let mut status = kube::core::Status::failure("watch ended", reason);
            status.code = code;
            kube::runtime::watcher::Error::WatchError(Box::new(status))
        };
        context.watch_failed("watching things failed", &watch_error(410, "Expired"));
        assert_eq!(metrics.duty_failures("test").get(), 0);
        context.watch_failed("watching things failed", &watch_error(500, "InternalError"));
        assert_eq!(metrics.duty_failures("test").get(), 1);
    }

    #[test]
    fn backoff_does_not_overflow_after_many_failures() {
        let metrics = Metrics::default();
        let (_stop, context) = context(&metrics);
        let mut backoff = context.backoff(Duration::from_secs(1), Duration::from_secs(3600));
        for _ in 0..1000 {
            backoff.failed("failed", &"boom");
        }
        assert_eq!(backoff.failed("failed", &"boom"), Duration::from_secs(64));
    }

    /// Fails its first `failures` starts, then runs until shutdown; records when it started.
    struct Flaky {
        starts: Arc<AtomicU32>,
        failures: u32,
        started_at: Arc<std::sync::Mutex<Vec<Instant>>>,
    }

    impl Duty for Flaky {
        const NAME: &'static str = "flaky";

        async fn run(&mut self, mut context: Context) -> Result<(), ControllerError> {
            self.started_at
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(Instant::now());
            if self.starts.fetch_add(1, Ordering::SeqCst) < self.failures {
                return Err(ControllerError::Task {
                    task: Self::NAME,
                    message: "the watch ended".into(),
                });
            }
            context.stop.wait().await;
            Ok(())
        }
    }

    struct Misconfigured;

    impl Duty for Misconfigured {
        const NAME: &'static str = "misconfigured";

        async fn run(&mut self, _context: Context) -> Result<(), ControllerError> {
            Err(ControllerError::Config(
                "the Lease name must not be empty".into(),
            ))
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_failing_duty_is_restarted_with_backoff_and_its_failures_counted() {
        let metrics = Metrics::default();
        let (stop_tx, stop) = Stop::channel();
        let mut supervisor = Supervisor::new(&metrics, stop);
        let starts = Arc::new(AtomicU32::new(0));
        let started_at = Arc::new(std::sync::Mutex::new(Vec::new()));
        supervisor.start(Flaky {
            starts: starts.clone(),
            failures: 2,
            started_at: started_at.clone(),
        });
        let (shutdown_tx, shutdown_rx) = tokio::sync::oneshot::channel::<()>();
        let shutdown = async move {
            let _ = shutdown_rx.await;
        };
        let watch = async {
            tokio::time::sleep(Duration::from_secs(60)).await;
            assert_eq!(
                starts.load(Ordering::SeqCst),
                3,
                "two failures, then it runs"
            );
            let at = started_at
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone();
            assert_eq!(
                [at[1] - at[0], at[2] - at[1]],
                [RESTART_FIRST, RESTART_FIRST * 2],
                "restarted after the backoff"
            );
            assert_eq!(metrics.duty_failures("flaky").get(), 2);
            assert_eq!(metrics.duty_restarts("flaky").get(), 2);
            assert!(
                metrics
                    .encode()
                    .contains(r#"initium_duty_failures_total{duty="flaky"} 2"#),
                "{}",
                metrics.encode()
            );
            let _ = shutdown_tx.send(());
        };
        let (result, ()) = tokio::join!(supervisor.run(shutdown, stop_tx), watch);
        assert!(result.is_ok(), "a clean shutdown: {result:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_fatal_error_stops_the_controller_at_once() {
        let metrics = Metrics::default();
        let (stop_tx, stop) = Stop::channel();
        let mut supervisor = Supervisor::new(&metrics, stop.clone());
        let starts = Arc::new(AtomicU32::new(0));
        supervisor.start(Flaky {
            starts: starts.clone(),
            failures: 0,
            started_at: Arc::default(),
        });
        supervisor.start(Misconfigured);
        let result = supervisor.run(std::future::pending(), stop_tx).await;
        let Err(error) = result else {
            panic!("a fatal error must stop the controller");
        };
        assert_eq!(
            error.to_string(),
            "invalid configuration: the Lease name must not be empty"
        );
        assert!(stop.is_set(), "the other duties were told to stop");
        assert_eq!(metrics.duty_restarts("misconfigured").get(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_duty_that_keeps_failing_takes_the_controller_down() {
        let metrics = Metrics::default();
        let (stop_tx, stop) = Stop::channel();
        let mut supervisor = Supervisor::new(&metrics, stop);
        supervisor.start(Flaky {
            starts: Arc::default(),
            failures: u32::MAX,
            started_at: Arc::default(),
        });
        let started = Instant::now();
        let error = supervisor
            .run(std::future::pending(), stop_tx)
            .await
            .expect_err("the duty cannot go on");
        assert_eq!(
            report(&error),
            format!(
                "the flaky duty failed {MAX_CONSECUTIVE_FAILURES} times in a row and restarts did \
                 not help (check that the API server is reachable and that initium's RBAC allows \
                 what the duty does); the last failure: controller task flaky stopped: the watch \
                 ended"
            )
        );
        assert!(
            std::error::Error::source(&error).is_some(),
            "the cause is kept"
        );
        // 1 + 2 + 4 + 8 + 16 seconds of restarts.
        assert_eq!(started.elapsed(), Duration::from_secs(31));
        assert_eq!(
            metrics.duty_failures("flaky").get(),
            u64::from(MAX_CONSECUTIVE_FAILURES)
        );
        assert_eq!(
            metrics.duty_restarts("flaky").get(),
            u64::from(MAX_CONSECUTIVE_FAILURES - 1)
        );
    }

    struct Panicky;

    impl Duty for Panicky {
        const NAME: &'static str = "panicky";

        async fn run(&mut self, _context: Context) -> Result<(), ControllerError> {
            panic!("a bug");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_panic_stops_the_controller_and_names_the_duty() {
        let metrics = Metrics::default();
        let (stop_tx, stop) = Stop::channel();
        let mut supervisor = Supervisor::new(&metrics, stop);
        supervisor.start(Panicky);
        let error = supervisor
            .run(std::future::pending(), stop_tx)
            .await
            .expect_err("a panic cannot go on");
        let message = error.to_string();
        assert!(
            message.starts_with("controller task panicky stopped: ") && message.contains("panic"),
            "{message}"
        );
    }
}
