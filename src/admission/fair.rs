//! Turns on the evaluation threads, handed out fairly across namespaces.
//!
//! A review that is large, or whose rules run longer than a short slice on the async runtime,
//! is evaluated on the blocking pool, a few at a time (`--max-blocking-reviews`). Which
//! review gets the next turn is decided here: every namespace waiting has a queue, and turns
//! go round the namespaces in order, one review each. A tenant that floods initium with slow
//! creates therefore waits behind itself: a review from any other namespace gets one of the
//! next turns, within one review's time (the latency budget bounds each) rather than behind
//! the whole flood.
//!
//! A turn also holds memory: the memory its evaluation may take, estimated before it starts
//! from the review's size ([`review_memory`]), out of `--max-review-memory`. Parsing and
//! evaluating a review cannot be interrupted once it holds the memory, so the estimate is
//! charged first: two 3 MB reviews of dense JSON (tens of bytes per byte of text) wait for
//! each other instead of taking a replica over its memory limit together. A review that does
//! not fit in what is free keeps its place at the front of the line and lets smaller ones by;
//! the memory it waits for comes back as the large reviews before it finish. Reviews small
//! enough to start inline (64 KiB) are charged nothing: at 48 bytes per byte, the turns they
//! can hold add up to a few MiB.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::oneshot;

/// Turns handed out round-robin across keys (namespaces).
#[derive(Debug)]
pub(crate) struct FairTurns {
    state: Mutex<State>,
}

/// Bytes of memory an evaluation may take per byte of its AdmissionReview: a review of dense
/// JSON (a Pod with 40,000 environment variables, 1.2 MB) took 28 times its size at its peak,
/// parsed, evaluated by a rule and answered (measured in-process, see docs/reliability.md);
/// the rest covers the copies a rule's mutations make.
pub(crate) const REVIEW_MEMORY_PER_BYTE: usize = 48;

/// The memory a review of `bytes` is charged before it is evaluated, at most `pool` (a review
/// larger than the whole pool runs alone).
pub(crate) fn review_memory(bytes: usize, pool: usize) -> usize {
    bytes.saturating_mul(REVIEW_MEMORY_PER_BYTE).min(pool)
}

#[derive(Debug, Default)]
struct State {
    /// Turns nobody holds or waits for.
    free: usize,
    /// Bytes of memory no turn holds.
    free_memory: usize,
    /// Waiters by key, oldest first.
    queues: HashMap<String, VecDeque<Waiter>>,
    /// Keys with waiters, in the order their next turn comes.
    order: VecDeque<String>,
}

/// A review waiting for its turn, and the memory it will hold.
#[derive(Debug)]
struct Waiter {
    memory: usize,
    send: oneshot::Sender<Turn>,
}

/// A turn: while it lives, one evaluation thread and `memory` bytes are this review's.
/// Dropping it hands them to the next namespace in line.
#[derive(Debug)]
pub(crate) struct Turn {
    turns: Option<Arc<FairTurns>>,
    memory: usize,
}

impl Drop for Turn {
    fn drop(&mut self) {
        if let Some(turns) = self.turns.take() {
            FairTurns::release(turns, self.memory);
        }
    }
}

impl FairTurns {
    /// `turns` evaluations at a time, holding at most `memory` bytes together.
    pub(crate) fn new(turns: usize, memory: usize) -> Arc<FairTurns> {
        Arc::new(FairTurns {
            state: Mutex::new(State {
                free: turns,
                free_memory: memory,
                ..State::default()
            }),
        })
    }

    /// A turn now, when one is free and nobody waits; otherwise a place in `key`'s queue (and
    /// the turn at once if its review is the first that fits).
    fn take(
        self: &Arc<FairTurns>,
        key: &str,
        memory: usize,
    ) -> Result<Turn, oneshot::Receiver<Turn>> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if state.free > 0 && state.free_memory >= memory && state.order.is_empty() {
            state.free -= 1;
            state.free_memory -= memory;
            return Ok(Turn {
                turns: Some(self.clone()),
                memory,
            });
        }
        let (send, receive) = oneshot::channel();
        let waiter = Waiter { memory, send };
        match state.queues.get_mut(key) {
            Some(queue) => queue.push_back(waiter),
            None => {
                state
                    .queues
                    .insert(key.to_string(), VecDeque::from([waiter]));
                state.order.push_back(key.to_string());
            }
        }
        self.dispatch(&mut state);
        drop(state);
        Err(receive)
    }

    pub(crate) async fn turn(
        self: &Arc<FairTurns>,
        key: &str,
        memory: usize,
        deadline: tokio::time::Instant,
    ) -> Option<Turn> {
        match self.take(key, memory) {
            Ok(turn) => Some(turn),
            // A waiter that gives up drops its receiver: the turn goes on to the next.
            Err(receive) => tokio::time::timeout_at(deadline, receive).await.ok()?.ok(),
        }
    }

    /// Gives back what a turn held, and hands it on.
    fn release(turns: Arc<FairTurns>, memory: usize) {
        let mut state = turns.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.free += 1;
        state.free_memory += memory;
        turns.dispatch(&mut state);
    }

    /// Hands free turns round the namespaces: the next turn goes to the first namespace in
    /// line whose oldest review fits in the memory free now, and that namespace goes to the
    /// back. A review that does not fit keeps its place at the front and lets the others by:
    /// they need no more than what is free, and the memory it waits for comes back as the
    /// large reviews before it finish (small reviews hold almost none).
    fn dispatch(self: &Arc<FairTurns>, state: &mut State) {
        let State {
            free,
            free_memory,
            queues,
            order,
        } = state;
        while *free > 0 {
            let mut chosen = None;
            let mut position = 0;
            while let Some(key) = order.get(position).cloned() {
                let Some(queue) = queues.get_mut(&key) else {
                    order.remove(position);
                    continue;
                };
                // Waiters that gave up (their deadline passed) hold nothing.
                while queue.front().is_some_and(|w| w.send.is_closed()) {
                    queue.pop_front();
                }
                match queue.front() {
                    None => {
                        queues.remove(&key);
                        order.remove(position);
                    }
                    Some(head) if head.memory <= *free_memory => {
                        chosen = Some(position);
                        break;
                    }
                    Some(_) => position += 1,
                }
            }
            let Some(key) = chosen.and_then(|p| order.remove(p)) else {
                break;
            };
            let Some(queue) = queues.get_mut(&key) else {
                continue;
            };
            let Some(waiter) = queue.pop_front() else {
                continue;
            };
            if queue.is_empty() {
                queues.remove(&key);
            } else {
                order.push_back(key);
            }
            *free -= 1;
            *free_memory -= waiter.memory;
            let turn = Turn {
                turns: Some(self.clone()),
                memory: waiter.memory,
            };
            if let Err(mut unsent) = waiter.send.send(turn) {
                // Gave up between the look and the send: what it was given goes back.
                unsent.turns = None;
                *free += 1;
                *free_memory += unsent.memory;
            }
        }
    }

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
        let turns = FairTurns::new(1, 1 << 30);
        let held = turns.turn("tenant", 0, later()).await.unwrap();
        // The tenant queues ten reviews, then another namespace one.
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut waiting = Vec::new();
        for i in 0..10 {
            let (turns, order) = (turns.clone(), order.clone());
            waiting.push(tokio::spawn(async move {
                let turn = turns.turn("tenant", 0, later()).await.unwrap();
                order.lock().unwrap().push(format!("tenant{i}"));
                drop(turn);
            }));
            tokio::task::yield_now().await;
        }
        let (t, o) = (turns.clone(), order.clone());
        waiting.push(tokio::spawn(async move {
            let turn = t.turn("other", 0, later()).await.unwrap();
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
        let turns = FairTurns::new(1, 1 << 30);
        let held = turns.turn("a", 0, later()).await.unwrap();
        let soon = tokio::time::Instant::now() + Duration::from_millis(20);
        assert!(turns.turn("b", 0, soon).await.is_none());
        drop(held);
        // The turn went past the waiter that gave up and is free again.
        assert_eq!(turns.free(), 1);
        assert!(turns.turn("c", 0, later()).await.is_some());
        assert_eq!(turns.free(), 1);
    }

    #[tokio::test]
    async fn a_turn_holds_its_reviews_memory_and_a_review_that_does_not_fit_lets_others_by() {
        assert_eq!(review_memory(1_000, 1 << 30), 48_000);
        assert_eq!(
            review_memory(10 << 20, 128 << 20),
            128 << 20,
            "at most the pool"
        );
        let turns = FairTurns::new(3, 100);
        let a = turns.turn("a", 60, later()).await.unwrap();
        // Three turns, but not the memory of two 60s: b waits, first in line.
        let order = Arc::new(Mutex::new(Vec::new()));
        let (t, o) = (turns.clone(), order.clone());
        let b = tokio::spawn(async move {
            let turn = t.turn("b", 60, later()).await.unwrap();
            o.lock().unwrap().push("b");
            turn
        });
        tokio::task::yield_now().await;
        // A small review of another namespace fits: it goes by b.
        let c = turns.turn("c", 10, later()).await.unwrap();
        assert!(order.lock().unwrap().is_empty(), "b does not fit yet");
        drop(c);
        assert!(order.lock().unwrap().is_empty(), "b still does not fit");
        // The memory b waits for comes back: b has its turn.
        drop(a);
        let b = b.await.unwrap();
        assert_eq!(*order.lock().unwrap(), vec!["b"]);
        assert_eq!(turns.free(), 2);
        drop(b);
        assert_eq!(turns.free(), 3);
        // All the memory is back: a review that needs the whole pool gets it.
        assert!(turns.turn("d", 100, later()).await.is_some());
    }
}
