//! Waiting for what a real cluster or process does a moment later. Every wait has a
//! deadline and, when it runs out, says what it waited for and what the last attempt saw.

use std::fmt::Debug;
use std::future::Future;
use std::time::{Duration, Instant};

use anyhow::bail;

/// How often the test waits try again.
const EVERY: Duration = Duration::from_millis(100);

/// Calls `attempt` until it returns `Ok`, at most for `timeout`; the panic says what was
/// awaited and what the last attempt saw. For `#[tokio::test]`s.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut attempt: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        match attempt().await {
            Ok(value) => return value,
            Err(last) if Instant::now() >= deadline => {
                panic!("{}", timed_out(what, timeout, &last))
            }
            Err(_) => tokio::time::sleep(EVERY).await,
        }
    }
}

/// [`eventually`] for tests that are not async: blocks the calling thread between attempts.
pub fn eventually_blocking<T>(
    what: &str,
    timeout: Duration,
    mut attempt: impl FnMut() -> Result<T, String>,
) -> T {
    poll(what, timeout, EVERY, || Ok(attempt())).unwrap_or_else(|e| panic!("{e:#}"))
}

/// What one attempt of [`poll`] found. `Ok(Ok(value))` ends the wait with `value`;
/// `Ok(Err(seen))` is "not yet", `seen` saying what the attempt found (the timeout's message
/// quotes the last one); `Err` gives up at once: what is awaited cannot come any more (the
/// process exited, say).
pub type Attempt<T> = anyhow::Result<Result<T, String>>;

/// Calls `attempt` every `every` until it ends the wait, at most for `timeout`; blocking, and
/// an error rather than a panic, for the benchmarks (which report errors from `main`) and for
/// what the benchmarks and tests share.
pub fn poll<T>(
    what: &str,
    timeout: Duration,
    every: Duration,
    mut attempt: impl FnMut() -> Attempt<T>,
) -> anyhow::Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        match attempt()? {
            Ok(value) => return Ok(value),
            Err(last) if Instant::now() >= deadline => bail!(timed_out(what, timeout, &last)),
            Err(_) => std::thread::sleep(every),
        }
    }
}

/// Calls `check` every `every` until it says yes, at most for `timeout` (at least once);
/// whether it did. Blocking, for waits whose outcome the test then asserts in its own words.
pub fn within(timeout: Duration, every: Duration, mut check: impl FnMut() -> bool) -> bool {
    let started = Instant::now();
    loop {
        if check() {
            return true;
        }
        if started.elapsed() >= timeout {
            return false;
        }
        std::thread::sleep(every);
    }
}

/// An attempt that waits for a value: done when `seen` equals `want`, otherwise "not yet",
/// saying what it saw.
pub fn is<T, W>(seen: T, want: W) -> Result<(), String>
where
    T: PartialEq<W> + Debug,
    W: Debug,
{
    if seen == want {
        Ok(())
    } else {
        Err(format!("{seen:?}, not {want:?}"))
    }
}

fn timed_out(what: &str, timeout: Duration, last: &str) -> String {
    format!("timed out after {timeout:?} waiting for {what}; last attempt: {last}")
}
