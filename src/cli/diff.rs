//! The unified diff `initium test` shows when an object differs from what a case expects,
//! in time linear in the texts' size (up to a log factor), however many lines differ.
//!
//! Myers' algorithm (what `similar` runs) takes time proportional to the texts' length times
//! the number of differences, and `similar`'s clean-up pass moves its operations around in
//! a vector: a Pod of 20,000 containers that each miss a line took minutes. So:
//!
//! * when the part between the common beginning and end is small (up to [`SMALL`] lines on
//!   both sides together), the diff is exactly `similar`'s, as it always was;
//! * otherwise the lines that occur once in each text anchor the diff (the longest
//!   increasing run of them, as in patience diff); each stretch between two anchors is
//!   diffed the same way, with Myers when it is small and the work spent so far allows it,
//!   and shown as "these lines became those" when not. Every stretch is charged to a budget
//!   proportional to the texts' size, so the whole diff stays linear.
//!
//! The result is always a correct diff (applying it to the expected text gives the actual
//! one); it may show a few more lines as changed than the smallest diff would.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::ops::Range;

use similar::algorithms::{Capture, DiffHook, NoFinishHook, Replace, myers};
use similar::{DiffOp, DiffableStr, group_diff_ops};

/// Lines between the common beginning and end (both sides) up to which `similar` diffs the
/// texts itself, with the output it always had.
const SMALL: usize = 4096;

/// The context lines around each change.
const CONTEXT: usize = 3;

/// A unified diff of `old` and `new` by lines, with `---`/`+++` headers named `old_name`
/// and `new_name`; empty when the texts are equal.
pub fn unified(old: &str, new: &str, old_name: &str, new_name: &str) -> String {
    let (a, b) = (old.tokenize_lines(), new.tokenize_lines());
    let prefix = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    let suffix = a[prefix..]
        .iter()
        .rev()
        .zip(b[prefix..].iter().rev())
        .take_while(|(x, y)| x == y)
        .count();
    if (a.len() - prefix - suffix) + (b.len() - prefix - suffix) <= SMALL {
        return similar::TextDiff::from_lines(old, new)
            .unified_diff()
            .context_radius(CONTEXT)
            .header(old_name, new_name)
            .to_string();
    }
    format(&a, &b, linear_ops(&a, &b), old_name, new_name)
}

/// The operations turning `a` into `b`, in linear time (see the module's comment).
fn linear_ops<'t>(a: &[&'t str], b: &[&'t str]) -> Vec<DiffOp> {
    // Lines as numbers: equal lines, equal numbers.
    let mut ids: HashMap<&'t str, u32> = HashMap::new();
    let mut intern = |line: &'t str| -> u32 {
        let next = u32::try_from(ids.len()).unwrap_or(u32::MAX);
        *ids.entry(line).or_insert(next)
    };
    let a: Vec<u32> = a.iter().map(|l| intern(l)).collect();
    let b: Vec<u32> = b.iter().map(|l| intern(l)).collect();
    let mut differ = Differ {
        a: &a,
        b: &b,
        hook: NoFinishHook::new(Replace::new(Capture::new())),
        // Myers on a stretch of n lines costs at most n² steps: together at most a few times
        // the texts' size, and some room for small texts.
        myers_budget: 64 * (a.len() + b.len()) + (1 << 22),
        // Each anchoring pass reads its stretch once.
        anchor_budget: 8 * (a.len() + b.len()) + (1 << 16),
    };
    differ.run(0..a.len(), 0..b.len());
    let mut hook = differ.hook.into_inner();
    // Capture and Replace cannot fail (their error type is Infallible).
    let _ = hook.finish();
    hook.into_inner().into_ops()
}

/// What is still to do, leftmost first.
enum Work {
    Stretch(Range<usize>, Range<usize>),
    Equal(usize, usize, usize),
}

struct Differ<'t> {
    a: &'t [u32],
    b: &'t [u32],
    hook: NoFinishHook<Replace<Capture>>,
    myers_budget: usize,
    anchor_budget: usize,
}

impl Differ<'_> {
    fn run(&mut self, a: Range<usize>, b: Range<usize>) {
        let mut stack = vec![Work::Stretch(a, b)];
        while let Some(work) = stack.pop() {
            match work {
                Work::Equal(i, j, len) => {
                    let _ = self.hook.equal(i, j, len);
                }
                Work::Stretch(a, b) => self.stretch(a, b, &mut stack),
            }
        }
    }

    /// Diffs one stretch, or pushes what remains of it onto `stack` (in reverse order).
    fn stretch(&mut self, mut a: Range<usize>, mut b: Range<usize>, stack: &mut Vec<Work>) {
        let head = self.a[a.clone()]
            .iter()
            .zip(&self.b[b.clone()])
            .take_while(|(x, y)| x == y)
            .count();
        if head > 0 {
            let _ = self.hook.equal(a.start, b.start, head);
            a.start += head;
            b.start += head;
        }
        let tail = self.a[a.clone()]
            .iter()
            .rev()
            .zip(self.b[b.clone()].iter().rev())
            .take_while(|(x, y)| x == y)
            .count();
        if tail > 0 {
            stack.push(Work::Equal(a.end - tail, b.end - tail, tail));
            a.end -= tail;
            b.end -= tail;
        }
        if a.is_empty() && b.is_empty() {
            return;
        }
        if a.is_empty() {
            let _ = self.hook.insert(a.start, b.start, b.len());
            return;
        }
        if b.is_empty() {
            let _ = self.hook.delete(a.start, a.len(), b.start);
            return;
        }
        let size = a.len() + b.len();
        let cost = size.saturating_mul(size);
        if size <= 256 && cost <= self.myers_budget {
            self.myers_budget -= cost;
            let _ = myers::diff(&mut self.hook, self.a, a, self.b, b);
            return;
        }
        let anchors = if size <= self.anchor_budget {
            self.anchor_budget -= size;
            self.anchors(a.clone(), b.clone())
        } else {
            Vec::new()
        };
        if anchors.is_empty() {
            // Nothing both sides hold once: Myers while the budget allows, else all of one
            // side became all of the other.
            if cost <= self.myers_budget && size <= SMALL {
                self.myers_budget -= cost;
                let _ = myers::diff(&mut self.hook, self.a, a, self.b, b);
            } else {
                let _ = self.hook.delete(a.start, a.len(), b.start);
                let _ = self.hook.insert(a.end, b.start, b.len());
            }
            return;
        }
        // Stretches between anchors, pushed last first so the first is done first.
        let mut end = (a.end, b.end);
        for &(i, j) in anchors.iter().rev() {
            stack.push(Work::Stretch(i + 1..end.0, j + 1..end.1));
            stack.push(Work::Equal(i, j, 1));
            end = (i, j);
        }
        stack.push(Work::Stretch(a.start..end.0, b.start..end.1));
    }

    /// The lines of the stretch that occur once on each side, in an order both sides share
    /// (the longest such run), as `(index in a, index in b)`.
    fn anchors(&self, a: Range<usize>, b: Range<usize>) -> Vec<(usize, usize)> {
        // Per line: occurrences in a, in b, and where.
        let mut seen: HashMap<u32, (u32, u32, usize, usize)> = HashMap::new();
        for i in a.clone() {
            let entry = seen.entry(self.a[i]).or_insert((0, 0, i, 0));
            entry.0 = entry.0.saturating_add(1);
        }
        for j in b {
            if let Some(entry) = seen.get_mut(&self.b[j]) {
                entry.1 = entry.1.saturating_add(1);
                entry.3 = j;
            }
        }
        let pairs: Vec<(usize, usize)> = a
            .filter_map(|i| {
                let &(in_a, in_b, _, j) = seen.get(&self.a[i])?;
                (in_a == 1 && in_b == 1).then_some((i, j))
            })
            .collect();
        longest_increasing(&pairs)
    }
}

/// The longest run of `pairs` (increasing in their first element) whose second elements
/// increase too, in n log n.
fn longest_increasing(pairs: &[(usize, usize)]) -> Vec<(usize, usize)> {
    // tails[k]: the index in `pairs` ending the best run of length k + 1 found so far.
    let mut tails: Vec<usize> = Vec::new();
    let mut before: Vec<Option<usize>> = vec![None; pairs.len()];
    for (n, &(_, j)) in pairs.iter().enumerate() {
        let k = tails.partition_point(|&t| pairs[t].1 < j);
        before[n] = k.checked_sub(1).map(|k| tails[k]);
        if k == tails.len() {
            tails.push(n);
        } else {
            tails[k] = n;
        }
    }
    let mut run = Vec::with_capacity(tails.len());
    let mut at = tails.last().copied();
    while let Some(n) = at {
        run.push(pairs[n]);
        at = before[n];
    }
    run.reverse();
    run
}

/// The unified diff of `ops`, written as `similar` writes it.
fn format(a: &[&str], b: &[&str], ops: Vec<DiffOp>, old_name: &str, new_name: &str) -> String {
    let mut out = String::new();
    for hunk in group_diff_ops(ops, CONTEXT) {
        if hunk.is_empty() {
            continue;
        }
        if out.is_empty() {
            let _ = writeln!(out, "--- {old_name}\n+++ {new_name}");
        }
        let _ = writeln!(out, "{}", similar::udiff::UnifiedHunkHeader::new(&hunk));
        for op in &hunk {
            for change in op.iter_changes(a, b) {
                out.push_str(&change.tag().to_string());
                out.push_str(change.value());
                if change.missing_newline() {
                    out.push_str("\n\\ No newline at end of file\n");
                }
            }
        }
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    /// Applies a unified diff's `-`, `+` and ` ` lines in order: what must give back the
    /// texts (with all the context, since the tests diff with whole-text context).
    fn sides(diff: &str) -> (String, String) {
        let (mut old, mut new) = (String::new(), String::new());
        for line in diff.split_inclusive('\n').skip(2) {
            if line.starts_with("@@") {
                continue;
            }
            let (tag, text) = line.split_at(1);
            match tag {
                " " => {
                    old.push_str(text);
                    new.push_str(text);
                }
                "-" => old.push_str(text),
                "+" => new.push_str(text),
                other => panic!("unexpected line tag {other:?} in {diff}"),
            }
        }
        (old, new)
    }

    /// A small deterministic generator (xorshift), so failures can be reproduced.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    fn text(rng: &mut Rng, lines: usize, alphabet: u64) -> Vec<String> {
        (0..lines)
            .map(|_| format!("line {}\n", rng.below(alphabet)))
            .collect()
    }

    #[test]
    fn the_linear_formatter_writes_what_similar_writes_for_the_same_operations() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for case in 0..300 {
            let a = text(&mut rng, (case % 40) + 1, 6);
            let mut b = a.clone();
            for _ in 0..rng.below(6) {
                let at = rng.below(b.len() as u64 + 1) as usize;
                match rng.below(3) {
                    0 if at < b.len() => {
                        b.remove(at);
                    }
                    1 if at < b.len() => b[at] = format!("changed {}\n", rng.below(4)),
                    _ => b.insert(at, format!("new {}\n", rng.below(4))),
                }
            }
            let (old, new) = (a.concat(), b.concat());
            let diff = similar::TextDiff::from_lines(&old, &new);
            let want = diff
                .unified_diff()
                .context_radius(CONTEXT)
                .header("expected", "actual")
                .to_string();
            let (la, lb) = (old.tokenize_lines(), new.tokenize_lines());
            let got = format(&la, &lb, diff.ops().to_vec(), "expected", "actual");
            assert_eq!(got, want, "case {case}: {old:?} -> {new:?}");
            // And small texts still get similar's own diff.
            assert_eq!(unified(&old, &new, "expected", "actual"), want);
        }
    }

    #[test]
    fn a_missing_final_newline_is_marked_as_similar_marks_it() {
        let (old, new) = ("a\nb\nc", "a\nB\nc");
        let want = similar::TextDiff::from_lines(old, new)
            .unified_diff()
            .context_radius(CONTEXT)
            .header("expected", "actual")
            .to_string();
        let ops = similar::TextDiff::from_lines(old, new).ops().to_vec();
        let got = format(
            &old.tokenize_lines(),
            &new.tokenize_lines(),
            ops,
            "expected",
            "actual",
        );
        assert_eq!(got, want);
    }

    #[test]
    fn large_diffs_are_correct_whatever_their_shape() {
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        for case in 0..40 {
            // Few distinct lines (no anchors), many, and a mix; big enough for the linear path.
            let alphabet = [3, 50, 100_000][case % 3];
            let a = text(&mut rng, 3000 + case * 37, alphabet);
            let mut b: Vec<String> = Vec::new();
            for line in &a {
                match rng.below(10) {
                    0 => {}
                    1 => b.push(format!("changed {}\n", rng.below(alphabet))),
                    2 => {
                        b.push(line.clone());
                        b.push(format!("new {}\n", rng.below(alphabet)));
                    }
                    _ => b.push(line.clone()),
                }
            }
            let (old, new) = (a.concat(), b.concat());
            let (la, lb) = (old.tokenize_lines(), new.tokenize_lines());
            let ops = linear_ops(&la, &lb);
            // With context as large as the texts, the diff holds both of them whole.
            let mut whole = String::new();
            for hunk in group_diff_ops(ops, usize::MAX / 4) {
                for op in &hunk {
                    for change in op.iter_changes(&la, &lb) {
                        whole.push_str(&change.tag().to_string());
                        whole.push_str(change.value());
                    }
                }
            }
            let (got_old, got_new) = sides(&format!("--- a\n+++ b\n{whole}"));
            assert_eq!(got_old, old, "case {case}");
            assert_eq!(got_new, new, "case {case}");
        }
    }

    /// Issue 30, finding 10: every one of 20,000 containers misses a line. Before, this took
    /// over a minute (Myers' time grows with the number of differences times the length);
    /// now well under a second, and every change is shown.
    #[test]
    fn twenty_thousand_differing_containers_are_diffed_in_linear_time() {
        let mut old = String::from("spec:\n  containers:\n");
        let mut new = old.clone();
        for i in 0..20_000 {
            let container = format!("  - image: nginx\n    name: c{i}\n");
            old.push_str(&container);
            new.push_str(&container);
            new.push_str("    env:\n    - name: A\n      value: b\n");
        }
        let started = std::time::Instant::now();
        let diff = unified(&old, &new, "expected", "actual");
        let took = started.elapsed();
        assert_eq!(diff.lines().filter(|l| l.starts_with('+')).count(), 60_001);
        assert_eq!(diff.lines().filter(|l| l.starts_with('-')).count(), 1);
        assert!(
            took < std::time::Duration::from_secs(10),
            "took {took:?} for 20,000 differing containers"
        );
    }
}
