//! Turns on the evaluation threads, handed out fairly across namespaces.
//!
//! A review that is large, or whose rules run longer than a short slice on the async runtime,
//! is evaluated on the blocking pool, a few at a time (`--max-blocking-reviews`). Which
//! review gets the next turn is decided here: every namespace waiting has a queue, and turns
//! go round the namespaces in order, one review each. A tenant that floods initium with slow
//! creates therefore waits behind itself: a review from any other namespace gets one of the
//! next turns rather than waiting behind the whole flood.
//!
//! Turns are shared in slices ([`PacedTurn`]): an evaluation that has run [`TURN_SLICE`] while
//! a review of another namespace waits pauses at its next checkpoint and goes on at its
//! namespace's next turn. Without that, a turn lasted a whole review, up to its latency budget,
//! and a cheap review waiting behind two of a tenant's could see its own budget run out in line.
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

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::rc::Rc;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

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

impl State {
    /// Puts `waiter` in `key`'s line (at its front when `first`), and `key` in the order of
    /// namespaces if it was not waiting.
    fn enqueue(&mut self, key: &str, waiter: Waiter, first: bool) {
        match self.queues.get_mut(key) {
            Some(queue) if first => queue.push_front(waiter),
            Some(queue) => queue.push_back(waiter),
            None => {
                self.queues
                    .insert(key.to_string(), VecDeque::from([waiter]));
                self.order.push_back(key.to_string());
            }
        }
    }
}

/// A review waiting for its turn, and the memory it will hold.
#[derive(Debug)]
struct Waiter {
    memory: usize,
    send: Sender,
}

/// Where a waiter's turn goes: a task on the async runtime (a review that has yet to start),
/// or an evaluation thread that paused ([`Paced`]) and blocks until it may go on.
#[derive(Debug)]
enum Sender {
    Task(oneshot::Sender<Turn>),
    Thread(Arc<Resume>),
}

impl Sender {
    /// Whether the waiter gave up (its deadline passed): it holds nothing.
    fn is_closed(&self) -> bool {
        match self {
            Sender::Task(send) => send.is_closed(),
            Sender::Thread(resume) => matches!(*resume.lock(), Resuming::GaveUp),
        }
    }

    /// Hands `turn` over; back if the waiter gave up meanwhile.
    fn send(self, turn: Turn) -> Result<(), Turn> {
        match self {
            Sender::Task(send) => send.send(turn),
            Sender::Thread(resume) => {
                let mut state = resume.lock();
                if matches!(*state, Resuming::GaveUp) {
                    return Err(turn);
                }
                *state = Resuming::Given(turn);
                drop(state);
                resume.given.notify_one();
                Ok(())
            }
        }
    }
}

/// A paused evaluation waiting for its next turn on its own thread.
#[derive(Debug, Default)]
struct Resume {
    state: Mutex<Resuming>,
    given: Condvar,
}

#[derive(Debug, Default)]
enum Resuming {
    #[default]
    Waiting,
    Given(Turn),
    GaveUp,
}

impl Resume {
    fn lock(&self) -> std::sync::MutexGuard<'_, Resuming> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Blocks until the turn comes, or `deadline` passes (then the waiter gives up, unless the
    /// turn came just then).
    fn wait(&self, deadline: Instant) -> Option<Turn> {
        let mut state = self.lock();
        loop {
            if let Resuming::Given(_) = *state {
                return match std::mem::take(&mut *state) {
                    Resuming::Given(turn) => Some(turn),
                    _ => None,
                };
            }
            let now = Instant::now();
            if now >= deadline {
                *state = Resuming::GaveUp;
                return None;
            }
            state = self
                .given
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

/// A turn: while it lives, one evaluation thread (unless it paused) and `memory` bytes are
/// this review's. Dropping it hands them to the next namespace in line.
#[derive(Debug)]
pub(crate) struct Turn {
    turns: Option<Arc<FairTurns>>,
    memory: usize,
    /// Whether it holds a thread: a paused evaluation keeps its memory and gives its thread
    /// back.
    thread: bool,
}

impl Drop for Turn {
    fn drop(&mut self) {
        if let Some(turns) = self.turns.take() {
            FairTurns::release(turns, self.memory, self.thread);
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
                thread: true,
            });
        }
        let (send, receive) = oneshot::channel();
        let waiter = Waiter {
            memory,
            send: Sender::Task(send),
        };
        state.enqueue(key, waiter, false);
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
    fn release(turns: Arc<FairTurns>, memory: usize, thread: bool) {
        let mut state = turns.state.lock().unwrap_or_else(PoisonError::into_inner);
        if thread {
            state.free += 1;
        }
        state.free_memory += memory;
        turns.dispatch(&mut state);
    }

    /// Whether a review of a namespace other than `key` waits for a turn.
    fn others_waiting(&self, key: &str) -> bool {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.order.iter().any(|k| {
            k != key
                && state
                    .queues
                    .get(k)
                    .is_some_and(|q| q.iter().any(|w| !w.send.is_closed()))
        })
    }

    /// Pauses `turn`: its thread goes to the next namespace in line, its memory stays held.
    fn pause(self: &Arc<FairTurns>, turn: &mut Turn) {
        if !turn.thread {
            return;
        }
        turn.thread = false;
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.free += 1;
        self.dispatch(&mut state);
    }

    /// Blocks until `turn` (paused) has a thread again, first in its namespace's line (it is
    /// older than the reviews that wait behind it), or `deadline` passes: then `false`.
    fn resume(self: &Arc<FairTurns>, key: &str, turn: &mut Turn, deadline: Instant) -> bool {
        if turn.thread {
            return true;
        }
        let resume = Arc::new(Resume::default());
        {
            let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            if state.free > 0 && state.order.is_empty() {
                state.free -= 1;
                turn.thread = true;
                return true;
            }
            let waiter = Waiter {
                memory: 0,
                send: Sender::Thread(resume.clone()),
            };
            state.enqueue(key, waiter, true);
            self.dispatch(&mut state);
        }
        match resume.wait(deadline) {
            Some(mut given) => {
                // The thread it was given is now `turn`'s.
                given.turns = None;
                turn.thread = true;
                true
            }
            None => false,
        }
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
                thread: true,
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
    pub(crate) fn free_memory(&self) -> usize {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .free_memory
    }

    #[cfg(test)]
    pub(crate) fn free(&self) -> usize {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .free
    }
}

/// How long an evaluation on the blocking pool runs, while a review of another namespace
/// waits, before it pauses and lets that review have its thread.
pub(crate) const TURN_SLICE: Duration = Duration::from_millis(5);

/// A turn that is shared in slices: the evaluation it runs pauses at the engine's checkpoints
/// ([`initium_engine::Pacer`]) once it has run [`TURN_SLICE`] while a review of another
/// namespace waits, and goes on at its namespace's next turn. A tenant whose rules take their
/// whole latency budget then holds a thread for one slice at a time, not the budget: another
/// namespace's review waits for a slice, whatever the tenant's rules do. A paused evaluation
/// keeps its memory; it gives up at its deadline (the latency budget), as if its rules had
/// run out of it.
#[derive(Debug)]
pub(crate) struct PacedTurn {
    turns: Arc<FairTurns>,
    key: String,
    turn: Turn,
    deadline: Instant,
}

impl PacedTurn {
    /// `turn` of `turns`, for a review of namespace `key` whose budget ends at `deadline`.
    pub(crate) fn new(
        turns: Arc<FairTurns>,
        key: &str,
        turn: Turn,
        deadline: Instant,
    ) -> PacedTurn {
        PacedTurn {
            turns,
            key: key.to_string(),
            turn,
            deadline,
        }
    }

    /// Runs `work` (an evaluation, on this blocking thread) in slices; the turn is given back
    /// when it returns.
    pub(crate) fn run<R>(self, work: impl FnOnce() -> R) -> R {
        let pacer = Rc::new(Paced {
            slice_end: Cell::new(Instant::now() + TURN_SLICE),
            lost: Cell::new(false),
            turns: self.turns,
            key: self.key,
            turn: RefCell::new(self.turn),
            deadline: self.deadline,
        });
        initium_engine::paced(pacer, work)
    }
}

/// The pacer of a [`PacedTurn`]'s evaluation.
struct Paced {
    turns: Arc<FairTurns>,
    key: String,
    turn: RefCell<Turn>,
    deadline: Instant,
    /// When the current slice ends.
    slice_end: Cell<Instant>,
    /// The evaluation paused and its deadline passed before its next turn.
    lost: Cell<bool>,
}

impl initium_engine::Pacer for Paced {
    fn checkpoint(&self, now: Instant, deadline: Instant) -> bool {
        if self.lost.get() {
            return true;
        }
        if now < self.slice_end.get() {
            return false;
        }
        if !self.turns.others_waiting(&self.key) {
            self.slice_end.set(now + TURN_SLICE);
            return false;
        }
        let Ok(mut turn) = self.turn.try_borrow_mut() else {
            return false;
        };
        self.turns.pause(&mut turn);
        if !self.turns.resume(&self.key, &mut turn, self.deadline) {
            self.lost.set(true);
            return true;
        }
        let resumed = Instant::now();
        self.slice_end.set(resumed + TURN_SLICE);
        resumed >= deadline
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

    /// A tenant's evaluation on the only thread, with a checkpoint every millisecond, that
    /// goes on until `until` is set (or 10 s pass); it says whether `until` was set.
    fn evaluation(
        turns: &Arc<FairTurns>,
        turn: Turn,
        deadline: Instant,
        started: std::sync::mpsc::Sender<()>,
        until: Arc<std::sync::atomic::AtomicBool>,
    ) -> tokio::task::JoinHandle<(bool, bool)> {
        let paced = PacedTurn::new(turns.clone(), "tenant", turn, deadline);
        tokio::task::spawn_blocking(move || {
            paced.run(|| {
                started.send(()).unwrap();
                let end = Instant::now() + Duration::from_secs(10);
                let mut out_of_time = false;
                while !until.load(std::sync::atomic::Ordering::SeqCst)
                    && Instant::now() < end
                    && !out_of_time
                {
                    out_of_time = initium_engine::checkpoint(deadline);
                    std::thread::sleep(Duration::from_millis(1));
                }
                (until.load(std::sync::atomic::Ordering::SeqCst), out_of_time)
            })
        })
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_long_evaluation_pauses_for_another_namespace_and_goes_on_after_it() {
        let turns = FairTurns::new(1, 100);
        let turn = turns.turn("tenant", 40, later()).await.unwrap();
        let other_ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (started, running) = std::sync::mpsc::channel();
        let deadline = Instant::now() + Duration::from_secs(30);
        let tenant = evaluation(&turns, turn, deadline, started, other_ran.clone());
        running.recv().unwrap();
        // The only thread is the tenant's, for as long as 10 s unless it pauses.
        let other = turns
            .turn("other", 0, later())
            .await
            .expect("a turn within 5 s");
        assert_eq!(
            turns.free_memory(),
            60,
            "the paused tenant keeps its memory"
        );
        other_ran.store(true, std::sync::atomic::Ordering::SeqCst);
        drop(other);
        let (saw_other, out_of_time) = tenant.await.unwrap();
        assert!(
            saw_other,
            "the tenant went on after the other namespace's turn"
        );
        assert!(!out_of_time);
        assert_eq!((turns.free(), turns.free_memory()), (1, 100));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_evaluation_does_not_pause_for_its_own_namespace() {
        let turns = FairTurns::new(1, 100);
        let turn = turns.turn("tenant", 0, later()).await.unwrap();
        let next_ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (started, running) = std::sync::mpsc::channel();
        let deadline = Instant::now() + Duration::from_secs(30);
        let first = evaluation(&turns, turn, deadline, started, next_ran.clone());
        running.recv().unwrap();
        // The tenant's next review waits; the first keeps its thread for 300 ms.
        let (t, n) = (turns.clone(), next_ran.clone());
        let next = tokio::spawn(async move {
            let turn = t.turn("tenant", 0, later()).await.unwrap();
            n.store(true, std::sync::atomic::Ordering::SeqCst);
            drop(turn);
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            !next_ran.load(std::sync::atomic::Ordering::SeqCst),
            "the first review paused for its own namespace's next one"
        );
        // Then it is stopped, and the next review has its turn.
        next_ran.store(true, std::sync::atomic::Ordering::SeqCst);
        first.await.unwrap();
        next.await.unwrap();
        assert_eq!(turns.free(), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_paused_evaluation_whose_budget_runs_out_stops_and_gives_back_its_memory() {
        let turns = FairTurns::new(1, 100);
        let turn = turns.turn("tenant", 40, later()).await.unwrap();
        let never = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (started, running) = std::sync::mpsc::channel();
        let deadline = Instant::now() + Duration::from_millis(300);
        let tenant = evaluation(&turns, turn, deadline, started, never);
        running.recv().unwrap();
        // Another namespace takes the thread and keeps it past the tenant's budget.
        let other = turns.turn("other", 0, later()).await.unwrap();
        let (saw, out_of_time) = tenant.await.unwrap();
        assert!(!saw);
        assert!(
            out_of_time,
            "the budget ran out while the evaluation was paused"
        );
        assert_eq!(turns.free_memory(), 100, "its memory is back");
        drop(other);
        assert_eq!(turns.free(), 1);
    }
}
