//! One test at a time, where tests share what they cannot share at once: cluster-wide rules
//! and webhook configurations, or the CPU a starting control plane needs.

use tokio::sync::{Mutex, MutexGuard};

/// One lock per test binary. A tokio mutex: async tests hold the guard across `.await`, and
/// a test that panics while holding it does not poison it for the others.
static SERIAL: Mutex<()> = Mutex::const_new(());

/// Waits until no other test of this binary holds the guard; hold it for the whole test.
pub async fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().await
}

/// [`serial`] for tests that are not async (it must not be called inside a runtime).
pub fn serial_blocking() -> MutexGuard<'static, ()> {
    SERIAL.blocking_lock()
}
