//! Fuzzing on stable Rust (docs/fuzzing.md): AdmissionReviews through the webhook routers,
//! rule specs through the engine, and input files through the CLI, with a seeded generator,
//! structure-aware cases and byte-level mutation of the repository's own documents.
//!
//! `cargo test` runs a short fixed-seed run of each target; `scripts/fuzz` runs long campaigns
//! through the ignored `campaign` test. Cases run in worker processes (the ignored `worker`
//! test), so a crash names its input instead of taking the test binary down.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

#[path = "fuzz/generate.rs"]
mod generate;
#[path = "fuzz/harness.rs"]
mod harness;
#[path = "fuzz/rng.rs"]
mod rng;
#[path = "fuzz/targets.rs"]
mod targets;

use std::time::Duration;

use serde_json::json;

/// Fixed seeds: CI runs the same cases every time, so a failure there is reproducible with the
/// command the assertion prints. Long campaigns take a fresh seed each run.
/// The case counts take about 5 s per target in a debug build on a 2-core machine.
const SHORT_SEED: u64 = 0x1_2025_0715;

#[test]
fn fuzz_reviews() {
    harness::short("reviews", SHORT_SEED, 800);
}

#[test]
fn fuzz_rules() {
    harness::short("rules", SHORT_SEED, 160);
}

#[test]
fn fuzz_cli() {
    harness::short("cli", SHORT_SEED, 200);
}

/// The harness itself: a panic, an oracle failure, a stack overflow and a slow case in the
/// worker are each reported with the right class, and a passing input passes.
#[test]
fn harness_reports_every_kind_of_failure() {
    let target = targets::target("selftest").expect("selftest");
    let mut settings = harness::Settings::from_env();
    settings.case_bound = Duration::from_millis(300);
    let hang = Duration::from_secs(5);
    let class = |input| harness::replay(target, &input, &settings, hang).map(|f| f.class);
    assert_eq!(class(json!({})), None);
    assert_eq!(class(json!({"do": "panic"})).as_deref(), Some("panic"));
    assert_eq!(class(json!({"do": "fail"})).as_deref(), Some("oracle"));
    assert_eq!(
        class(json!({"do": "overflow"})).as_deref(),
        Some("stack-overflow")
    );
    assert_eq!(
        class(json!({"do": "sleep", "ms": 600})).as_deref(),
        Some("slow")
    );
    settings.case_bound = Duration::from_secs(60);
    let hang = Duration::from_millis(500);
    let class = |input| harness::replay(target, &input, &settings, hang).map(|f| f.class);
    assert_eq!(
        class(json!({"do": "sleep", "ms": 3000})).as_deref(),
        Some("hang")
    );
}

#[test]
fn debug_output_in_messages_is_recognised() {
    assert!(targets::debug_marker("budget breached: Depth { depth: 65 }", "").is_some());
    assert!(targets::debug_marker("failed: Error { kind: Eof }", "").is_some());
    assert!(targets::debug_marker("value was Some(3)", "").is_some());
    assert!(targets::debug_marker("spec.mutations[0]: invalid JSON pointer \"x\"", "").is_none());
    // Text the input itself contains is the user's, not a Debug dump.
    assert!(
        targets::debug_marker("name \"Foo { bar: 1 }\" is invalid", "Foo { bar: 1 }").is_none()
    );
}

/// Started by the supervisor in a child process; does nothing otherwise.
#[test]
#[ignore = "a fuzz worker process, started by the fuzz tests and scripts/fuzz"]
fn worker() {
    harness::worker_main();
}

/// `scripts/fuzz`: a long campaign (or `--replay FILE`), configured by environment variables.
#[test]
#[ignore = "long fuzz campaigns: run scripts/fuzz"]
fn campaign() {
    harness::campaign_main();
}
