//! The harness's messages: one line on stderr each.

use std::sync::atomic::{AtomicBool, Ordering};

/// Set while `up` takes down a plane that failed to start: what `down` says then is noise.
static QUIET: AtomicBool = AtomicBool::new(false);

/// A line on stderr, as every message of the harness.
pub(crate) fn log(message: impl std::fmt::Display) {
    if !QUIET.load(Ordering::Relaxed) {
        eprintln!("control-plane: {message}");
    }
}

pub(crate) fn set_quiet(quiet: bool) {
    QUIET.store(quiet, Ordering::Relaxed);
}
