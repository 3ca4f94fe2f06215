//! Checkpoints where an evaluation may pause for others.
//!
//! Every place the engine reads the clock against a deadline (between rules, between slow
//! conditions, every few steps inside a mutation, before a regex search) is a checkpoint: it
//! goes through [`passed`]. On its own that is a comparison with the clock. A caller that
//! shares a few evaluation threads among tenants runs the evaluation inside [`paced`] with a
//! [`Pacer`]: at each checkpoint the pacer may hand its thread to a review that waits (the
//! evaluation blocks until its next turn), so one tenant's slow rules take turns with others
//! instead of holding a thread for their whole latency budget. The engine stays free of any
//! runtime: the pacer is the caller's.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Instant;

/// What an evaluation does at a checkpoint before its deadline (see the module).
pub trait Pacer {
    /// Called at a checkpoint at `now`, which is before `deadline`. It may block, to let
    /// other work have the thread; it returns whether `deadline` has passed by the time it
    /// returns (or the evaluation may not go on: then it counts as out of time).
    fn checkpoint(&self, now: Instant, deadline: Instant) -> bool;
}

thread_local! {
    static PACER: RefCell<Option<Rc<dyn Pacer>>> = const { RefCell::new(None) };
}

/// Runs `work` (an evaluation) on this thread with `pacer` at its checkpoints; the thread's
/// previous pacer (normally none) is back when `work` returns or unwinds.
pub fn paced<R>(pacer: Rc<dyn Pacer>, work: impl FnOnce() -> R) -> R {
    struct Restore(Option<Rc<dyn Pacer>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let previous = self.0.take();
            PACER.with(|p| *p.borrow_mut() = previous);
        }
    }
    let previous = PACER.with(|p| p.borrow_mut().replace(pacer));
    let _restore = Restore(previous);
    work()
}

/// Whether `deadline` has passed: the checkpoint every clock read of an evaluation goes
/// through. Before the deadline, this thread's pacer (if any) may pause it first.
pub fn passed(deadline: Instant) -> bool {
    let now = Instant::now();
    if now >= deadline {
        return true;
    }
    // Nothing sets the pacer while it pauses: the borrow it holds meanwhile is never in the
    // way (and a checkpoint that finds it taken goes on without a pacer).
    PACER.with(|p| {
        p.try_borrow().is_ok_and(|p| {
            p.as_ref()
                .is_some_and(|pacer| pacer.checkpoint(now, deadline))
        })
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use std::cell::Cell;
    use std::time::Duration;

    use super::*;

    struct Counting {
        calls: Cell<u32>,
        out_of_time: bool,
    }

    impl Pacer for Counting {
        fn checkpoint(&self, _now: Instant, _deadline: Instant) -> bool {
            self.calls.set(self.calls.get() + 1);
            self.out_of_time
        }
    }

    #[test]
    fn a_checkpoint_asks_the_pacer_only_inside_paced_and_only_before_the_deadline() {
        let later = Instant::now() + Duration::from_secs(60);
        let pacer = Rc::new(Counting {
            calls: Cell::new(0),
            out_of_time: false,
        });
        assert!(!passed(later), "no pacer: only the clock");
        paced(pacer.clone(), || {
            assert!(!passed(later));
            assert!(passed(Instant::now()), "a deadline passed needs no pacer");
        });
        assert_eq!(pacer.calls.get(), 1);
        assert!(!passed(later));
        assert_eq!(pacer.calls.get(), 1, "the pacer is gone after paced");

        let stopping = Rc::new(Counting {
            calls: Cell::new(0),
            out_of_time: true,
        });
        assert!(
            paced(stopping, || passed(later)),
            "the pacer says out of time"
        );
    }

    #[test]
    fn the_pacer_is_gone_after_work_that_panics() {
        let pacer = Rc::new(Counting {
            calls: Cell::new(0),
            out_of_time: true,
        });
        let later = Instant::now() + Duration::from_secs(60);
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            paced(pacer.clone(), || panic!("a rule's bug"))
        }));
        assert!(caught.is_err());
        assert!(!passed(later), "no pacer after the unwind");
        assert_eq!(pacer.calls.get(), 0);
    }
}
