//! Namespace labels, for rules with a `namespaceSelector` and for the `webhooks` duty (which
//! keeps `fail-rules.initium.dev/<configuration>` on the namespaces with Fail rules): a metadata-only watch of
//! every Namespace, swapped into `shared.namespaces` whole when a Namespace's labels change,
//! at most once per [`PUBLISH_INTERVAL`] while changes keep coming (each swap copies the map:
//! ten thousand namespaces labeled one by one must not cost ten thousand copies).

use std::sync::Arc;
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use k8s_openapi::api::core::v1::Namespace;
use kube::core::PartialObjectMeta;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use tokio::sync::watch;
use tokio::time::Instant;

use super::duty::{Context, Duty};
use super::vocabulary::{ControllerError, Readiness};
use crate::admission::state::{NamespaceLabels, Shared};

/// Applies watch events to a copy of the labels; says whether anything changed.
#[derive(Default)]
struct Labels {
    current: NamespaceLabels,
    /// Namespaces listed so far by a (re)list in progress.
    relisting: Option<NamespaceLabels>,
}

impl Labels {
    fn apply(&mut self, event: watcher::Event<PartialObjectMeta<Namespace>>) -> bool {
        let entry = |ns: PartialObjectMeta<Namespace>| {
            (
                ns.metadata.name.unwrap_or_default(),
                Arc::new(ns.metadata.labels.unwrap_or_default()),
            )
        };
        match event {
            watcher::Event::Init => {
                self.relisting = Some(NamespaceLabels::new());
                false
            }
            watcher::Event::InitApply(ns) => {
                let (name, labels) = entry(ns);
                self.relisting.get_or_insert_default().insert(name, labels);
                false
            }
            watcher::Event::InitDone => {
                let listed = self.relisting.take().unwrap_or_default();
                let changed = listed != self.current;
                self.current = listed;
                changed
            }
            watcher::Event::Apply(ns) => {
                let (name, labels) = entry(ns);
                // Most Namespace updates (status, annotations, finalizers) leave labels alone.
                if self.current.get(&name) == Some(&labels) {
                    return false;
                }
                self.current.insert(name, labels);
                true
            }
            watcher::Event::Delete(ns) => {
                let (name, _) = entry(ns);
                self.current.remove(&name).is_some()
            }
        }
    }
}

/// Shortest time between two swaps of the labels while changes keep coming.
pub const PUBLISH_INTERVAL: Duration = Duration::from_millis(100);

/// The `namespaces` duty: watches Namespaces, keeping `shared.namespaces` current, and
/// publishing the same map on `published` (`None` until the first complete list).
pub(crate) struct Namespaces {
    client: Client,
    shared: Arc<Shared>,
    readiness: Arc<Readiness>,
    published: watch::Sender<Option<Arc<NamespaceLabels>>>,
}

impl Namespaces {
    pub(crate) fn new(
        client: Client,
        shared: Arc<Shared>,
        readiness: Arc<Readiness>,
        published: watch::Sender<Option<Arc<NamespaceLabels>>>,
    ) -> Self {
        Namespaces {
            client,
            shared,
            readiness,
            published,
        }
    }
}

/// Sleeps until `at`, or forever when there is nothing to wait for.
async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

impl Duty for Namespaces {
    const NAME: &'static str = "namespaces";

    async fn run(&mut self, mut context: Context) -> Result<(), ControllerError> {
        let api = Api::<PartialObjectMeta<Namespace>>::all(self.client.clone());
        let mut events = watcher(api, watcher::Config::default())
            .default_backoff()
            .boxed();
        let mut labels = Labels::default();
        let mut listed_once = false;
        let mut list_pending = false;
        let mut last_publish: Option<Instant> = None;
        // A swap is owed at this time.
        let mut due: Option<Instant> = None;
        loop {
            let event = tokio::select! {
                () = context.stop.wait() => return Ok(()),
                () = sleep_until_some(due) => None,
                event = events.next() => Some(event),
            };
            let mut changed = false;
            let mut listed = false;
            if let Some(event) = event {
                let mut batch = vec![event];
                // Coalesce what is already waiting (a relist of many Namespaces swaps once).
                while let Some(more) = events.next().now_or_never() {
                    batch.push(more);
                }
                for event in batch {
                    match event {
                        Some(Ok(event)) => {
                            listed |= matches!(event, watcher::Event::InitDone);
                            changed |= labels.apply(event);
                        }
                        // The watch retries with its own backoff.
                        Some(Err(e)) => context
                            .watch_failed("watching Namespaces failed; retrying with backoff", &e),
                        None => {
                            return Err(ControllerError::Task {
                                task: Self::NAME,
                                message: "the Namespace watch ended".into(),
                            });
                        }
                    }
                }
            }
            let now = Instant::now();
            if listed {
                // A complete list is published at once: readiness waits for it.
                list_pending = true;
                due = Some(now);
            } else if changed && due.is_none() {
                due = Some(last_publish.map_or(now, |last| (last + PUBLISH_INTERVAL).max(now)));
            }
            if due.is_some_and(|at| at <= now) {
                due = None;
                last_publish = Some(now);
                let current = Arc::new(labels.current.clone());
                self.shared.namespaces.store(current.clone());
                listed_once |= list_pending;
                if listed_once {
                    self.published.send_replace(Some(current));
                }
                if list_pending {
                    list_pending = false;
                    self.readiness.done(Readiness::NAMESPACES);
                }
            }
        }
    }
}

/// Labels of a namespace as [`NamespaceLabels`] stores them.
#[cfg(test)]
fn labels_of(pairs: &[(&str, &str)]) -> std::collections::BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use kube::api::ObjectMeta;

    fn ns(name: &str, labels: &[(&str, &str)]) -> PartialObjectMeta<Namespace> {
        PartialObjectMeta {
            types: None,
            metadata: ObjectMeta {
                name: Some(name.into()),
                labels: Some(labels_of(labels)),
                ..ObjectMeta::default()
            },
            _phantom: Default::default(),
        }
    }

    #[test]
    fn labels_follow_the_watch() {
        let mut labels = Labels::default();
        assert!(!labels.apply(watcher::Event::Init));
        assert!(!labels.apply(watcher::Event::InitApply(ns("a", &[("team", "x")]))));
        assert!(labels.apply(watcher::Event::InitDone));
        assert_eq!(*labels.current["a"], labels_of(&[("team", "x")]));

        assert!(
            !labels.apply(watcher::Event::Apply(ns("a", &[("team", "x")]))),
            "same labels: no swap"
        );
        assert!(labels.apply(watcher::Event::Apply(ns("a", &[("team", "y")]))));
        assert!(labels.apply(watcher::Event::Apply(ns("b", &[]))));
        assert!(labels.apply(watcher::Event::Delete(ns("a", &[]))));
        assert_eq!(labels.current.keys().collect::<Vec<_>>(), ["b"]);

        // A relist drops what is gone.
        labels.apply(watcher::Event::Init);
        labels.apply(watcher::Event::InitApply(ns("c", &[])));
        assert!(labels.apply(watcher::Event::InitDone));
        assert_eq!(labels.current.keys().collect::<Vec<_>>(), ["c"]);
    }
}
