//! Turns on the evaluation threads, handed out fairly across namespaces.
//!
//! A review that is large, or whose rules run longer than a short slice on the async runtime,
//! is evaluated on the blocking pool, a few at a time (`--max-blocking-reviews`). Which
//! review gets the next turn is decided here: every namespace waiting has a queue, and turns
//! go round the namespaces in order, one review each. A tenant that floods initium with slow
//! creates therefore waits behind itself: a review from any other namespace gets one of the
//! next turns, within one review's time (the latency budget bounds each) rather than behind
//! the whole flood.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::oneshot;

/// Turns handed out round-robin across keys (namespaces).
#[derive(Debug)]
pub(crate) struct FairTurns {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Turns nobody holds or waits for.
    free: usize,
    /// Waiters by key, oldest first.
    queues: HashMap<String, VecDeque<oneshot::Sender<Turn>>>,
    /// Keys with waiters, in the order their next turn comes.
    order: VecDeque<String>,
}

/// A turn: while it lives, one evaluation thread is this review's. Dropping it hands the turn
/// to the next namespace in line.
#[derive(Debug)]
pub(crate) struct Turn {
    turns: Option<Arc<FairTurns>>,
}

impl Drop for Turn {
    fn drop(&mut self) {
        if let Some(turns) = self.turns.take() {
            FairTurns::release(turns);
        }
    }
}

impl FairTurns {
    pub(crate) fn new(turns: usize) -> Arc<FairTurns> {
        Arc::new(FairTurns {
            state: Mutex::new(State {
                free: turns,
                ..State::default()
            }),
        })
    }

    /// A turn now, when one is free and nobody waits; otherwise a place in `key`'s queue.
    fn take(self: &Arc<FairTurns>, key: &str) -> Result<Turn, oneshot::Receiver<Turn>> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if state.free > 0 && state.order.is_empty() {
            state.free -= 1;
            return Ok(Turn {
                turns: Some(self.clone()),
            });
        }
        let (send, receive) = oneshot::channel();
        match state.queues.get_mut(key) {
            Some(queue) => queue.push_back(send),
            None => {
                state.queues.insert(key.to_string(), VecDeque::from([send]));
                state.order.push_back(key.to_string());
            }
        }
        Err(receive)
    }

    /// Waits for a turn for a review of namespace `key` until `deadline`; `None` when the
    /// deadline came first.
    pub(crate) async fn turn(
        self: &Arc<FairTurns>,
        key: &str,
        deadline: tokio::time::Instant,
    ) -> Option<Turn> {
        match self.take(key) {
            Ok(turn) => Some(turn),
            // A waiter that gives up drops its receiver: the turn goes on to the next.
            Err(receive) => tokio::time::timeout_at(deadline, receive).await.ok()?.ok(),
        }
    }

    /// Hands a released turn to the first waiter of the next namespace in line (skipping
    /// those that stopped waiting), or frees it.
    fn release(turns: Arc<FairTurns>) {
        let mut state = turns.state.lock().unwrap_or_else(PoisonError::into_inner);
        while let Some(key) = state.order.pop_front() {
            let Some(queue) = state.queues.get_mut(&key) else {
                continue;
            };
            let waiter = queue.pop_front();
            if queue.is_empty() {
                state.queues.remove(&key);
            } else {
                // This namespace's next review waits for every other namespace's first.
                state.order.push_back(key);
            }
            if let Some(waiter) = waiter {
                let turn = Turn {
                    turns: Some(turns.clone()),
                };
                match waiter.send(turn) {
                    Ok(()) => return,
                    // It stopped waiting: the turn came back (dropped without its owner, so
                    // not released again); try the next.
                    Err(mut unsent) => {
                        unsent.turns = None;
                    }
                }
            }
        }
        state.free += 1;
    }

    /// Turns free now (for tests and readiness).
    #[cfg(test)]
    pub(crate) fn free(&self) -> usize {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .free
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn later() -> tokio::time::Instant {
        tokio::time::Instant::now() + Duration::from_secs(5)
    }

    #[tokio::test]
    async fn turns_go_round_the_namespaces_not_to_the_longest_queue() {
        let turns = FairTurns::new(1);
        let held = turns.turn("tenant", later()).await.unwrap();
        // The tenant queues ten reviews, then another namespace one.
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut waiting = Vec::new();
        for i in 0..10 {
            let (turns, order) = (turns.clone(), order.clone());
            waiting.push(tokio::spawn(async move {
                let turn = turns.turn("tenant", later()).await.unwrap();
                order.lock().unwrap().push(format!("tenant{i}"));
                drop(turn);
            }));
            tokio::task::yield_now().await;
        }
        let (t, o) = (turns.clone(), order.clone());
        waiting.push(tokio::spawn(async move {
            let turn = t.turn("other", later()).await.unwrap();
            o.lock().unwrap().push("other".to_string());
            drop(turn);
        }));
        tokio::task::yield_now().await;
        drop(held);
        for w in waiting {
            w.await.unwrap();
        }
        let order = order.lock().unwrap().clone();
        // The other namespace waited for one of the tenant's reviews, not ten.
        assert_eq!(
            order.iter().position(|k| k == "other"),
            Some(1),
            "{order:?}"
        );
        assert_eq!(order.len(), 11);
        assert_eq!(turns.free(), 1);
    }

    #[tokio::test]
    async fn a_waiter_that_gives_up_does_not_keep_its_turn() {
        let turns = FairTurns::new(1);
        let held = turns.turn("a", later()).await.unwrap();
        let soon = tokio::time::Instant::now() + Duration::from_millis(20);
        assert!(turns.turn("b", soon).await.is_none());
        drop(held);
        // The turn went past the waiter that gave up and is free again.
        assert_eq!(turns.free(), 1);
        assert!(turns.turn("c", later()).await.is_some());
        assert_eq!(turns.free(), 1);
    }
}
