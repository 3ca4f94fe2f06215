//! Engine benchmark: one admission of a ~4 KB Pod against 10 / 100 / 1,000 / 10,000 rules
//! of which 10 match: evaluate every rule and write the JSON patch. Two workloads: rules
//! spread over kinds and namespaces (`evaluate_pod_*`: the index rules most out by kind and
//! namespace), and 1,000 / 10,000 rules all for Pods in the Pod's namespace
//! (`same_bucket_pod_*`: each must be ruled out by what it matches). Run with
//! `cargo bench --bench engine`. It uses the allocator the `initium` binary uses.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[path = "../tests/support/mod.rs"]
mod support;

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use initium::api::Operation;
use initium::engine::{Gvk, Outcome, RanBefore, RuleIndex, Subject, compile_document};
use support::fixtures;

fn index(rules: Vec<serde_json::Value>) -> RuleIndex {
    let compiled = rules
        .iter()
        .map(|doc| compile_document(doc, "default").unwrap_or_else(|e| panic!("{e}")))
        .collect();
    RuleIndex::new(compiled)
}

fn admission(c: &mut Criterion) {
    measure(
        c,
        "evaluate_pod",
        &[10, 100, 1_000, 10_000],
        fixtures::rules,
    );
    measure(
        c,
        "same_bucket_pod",
        &[1_000, 10_000],
        fixtures::same_bucket_rules,
    );
}

/// One benchmark group `{name}_{pod bytes}b`: an admission of the Pod against each rule set.
fn measure(
    c: &mut Criterion,
    name: &str,
    totals: &[usize],
    rules: fn(usize) -> Vec<serde_json::Value>,
) {
    let pod = fixtures::pod();
    let size = serde_json::to_vec(&pod)
        .map(|v| v.len())
        .unwrap_or_default();
    let gvk = Gvk::new("", "v1", "Pod");
    let subject = Subject {
        gvk: &gvk,
        operation: Operation::Create,
        namespace: Some("shop"),
        name: None,
        namespace_labels: None,
        ran_before: RanBefore::Listed {
            stored: None,
            stored_template: None,
        },
        lookups: None,
    };
    let mut group = c.benchmark_group(format!("{name}_{size}b"));
    for &total in totals {
        let index = index(rules(total));
        let outcome = index
            .evaluate(&subject, pod.clone(), None)
            .unwrap_or_else(|d| panic!("{d}"));
        assert_eq!(
            outcome.applied.len(),
            10,
            "exactly the 10 matching rules change the Pod"
        );
        group.bench_with_input(BenchmarkId::new("rules", total), &index, |b, index| {
            // Each iteration starts from a fresh copy of the Pod, made just before and not
            // timed, as the webhook starts from the Pod it has just parsed.
            b.iter_custom(|iterations| {
                let mut spent = Duration::ZERO;
                for _ in 0..iterations {
                    let input = pod.clone();
                    let started = Instant::now();
                    let admitted = one_admission(index, black_box(&subject), input);
                    spent += started.elapsed();
                    black_box(admitted);
                }
                spent
            })
        });
    }
    group.finish();
}

/// What is timed: the rules evaluated and the patch written, as the webhook does for each
/// request. Not inlined, so that `scripts/bench instructions` counts exactly this.
#[inline(never)]
fn one_admission(
    index: &RuleIndex,
    subject: &Subject,
    object: serde_json::Value,
) -> (Outcome, Vec<u8>) {
    let outcome = index
        .evaluate(subject, object, None)
        .unwrap_or_else(|d| panic!("{d}"));
    let mut patch = Vec::with_capacity(1024);
    outcome
        .write_patch(&mut patch)
        .unwrap_or_else(|e| panic!("{e}"));
    (outcome, patch)
}

criterion_group!(benches, admission);
criterion_main!(benches);
