//! Bounds on the work a rule may do, so that no rule a tenant can write stalls or crashes
//! initium for everyone.
//!
//! Every rule is untrusted input. The engine bounds, for each admission:
//! - how deep a rule may nest what it writes ([`MAX_DEPTH`]), so that no recursion over an
//!   object (clone, drop, diff, serialization) can overflow a thread's stack;
//! - how many bytes one rule, and all rules together, may write into the object (templates
//!   that copy the object into itself, rewrites that double a string, forEach over many
//!   elements): [`Limits::rule_output_bytes`], [`Limits::admission_output_bytes`];
//! - how many element × mutation steps one rule's `forEach` may take
//!   ([`Limits::foreach_steps`]);
//! - how much a JSONPath query with descendant segments (`..`) may visit
//!   ([`QUERY_WORK_LIMIT`]);
//! - the latency budget, checked before every mutation and every few `forEach` elements,
//!   not only between rules.
//!
//! A rule over a limit fails by its `failurePolicy`, its changes rolled back, with a sentence
//! that names the field and the limit.

use std::sync::Arc;
use std::time::Instant;

use regex_automata::meta;
use serde_json::Value;

use super::stop::Stop;

/// The deepest nesting, counted from the object's root, that a rule may write. The API
/// server's own JSON decoder and `serde_json` (128) accept deeper objects, so whatever initium
/// writes can be read back; Kubernetes objects rarely nest past 20.
pub const MAX_DEPTH: usize = 100;

/// Nodes a JSONPath query with descendant segments may visit in one evaluation (estimated
/// before it runs as nodes × depth per further descendant segment).
pub const QUERY_WORK_LIMIT: usize = 1_000_000;

/// Bytes of one JSONPath query's text. Parsing costs about a kilobyte per segment (the
/// parser's tree), and a parsed query keeps a few hundred bytes per segment: a 700,000-segment
/// template query took 782 MB to compile and kept 165 MB. Real queries are under 200 bytes.
pub const MAX_QUERY_BYTES: usize = 1024;

/// Bytes of all the JSONPath queries of one rule together (conditions, paths, `forEach`,
/// templates, lookups, gates): with [`MAX_QUERY_BYTES`] this keeps what compiling a rule
/// allocates, and what it keeps, a small multiple of the rule's size, however many queries
/// its author writes.
pub const MAX_RULE_QUERY_BYTES: usize = 16 << 10;

/// Descendant segments (`..`) one JSONPath query may have: each multiplies the work.
pub const MAX_QUERY_DESCENDANTS: usize = 2;

/// Nesting of brackets and parentheses in a JSONPath query (the parser is recursive).
pub const MAX_QUERY_NESTING: usize = 32;

/// How deep template function calls may nest (`lower(trim(...))` is 2): the template parser
/// is recursive, and each level may build a value.
pub const MAX_CALL_NESTING: usize = 8;

/// Bytes of values (as canonical text) one `in:` condition may gather from an object before
/// any element is tested: a query such as `$..*` selects every node, and each node's text
/// holds all of its children's again, so without a bound the set grows with the object's size
/// times its depth.
pub const MAX_IN_SET_BYTES: usize = 1 << 20;

/// Regular expressions one rule may have (conditions, rewrites and the `replace()` calls of
/// templates together).
pub const MAX_RULE_REGEXES: usize = 32;

/// Compiled size of all of one rule's regular expressions together; each gets an equal share,
/// at most [`MAX_REGEX_BYTES`].
pub const RULE_REGEX_BYTES: usize = 4 << 20;

/// Compiled size of one regular expression.
pub const MAX_REGEX_BYTES: usize = 1 << 20;

/// Search work one search of a rule's regular expression may do (or all the searches of one
/// condition together), in units of one automaton step over one byte. A search cannot be
/// interrupted once it runs, so its cost is charged before it runs, as the text's length times
/// the expression's cost per byte ([`RuleRegex::work_per_byte`]); one unit takes about half a
/// nanosecond on the 2-core development VM in the worst case found (`a[ab]{20}c` on random
/// `a`/`b` text, where the lazy DFA builds a state at almost every byte), so no search runs
/// longer than a few tens of milliseconds. Between searches the latency budget is looked at,
/// so what a rule does in all stays within the budget.
pub const REGEX_SEARCH_WORK: u64 = 32_000_000;

/// The units a search costs per byte of text on top of the expression's size: what the lazy
/// DFA spends per byte when it builds a new state at every byte, whatever the expression.
pub const REGEX_WORK_PER_BYTE_BASE: u64 = 1024;

/// Bytes of an expression's automata that count as one unit per byte of text searched.
const REGEX_BYTES_PER_UNIT: u64 = 64;

/// What the rule being compiled on this thread has parsed and compiled so far.
#[derive(Clone, Copy, Debug, Default)]
struct Compiling {
    /// Bytes of JSONPath queries parsed.
    query_bytes: usize,
    /// Bytes the compiled regular expressions hold, and their search caches may grow to.
    regex_bytes: usize,
}

thread_local! {
    /// `None`: no rule is being compiled on this thread, nothing is counted.
    static COMPILING: std::cell::Cell<Option<Compiling>> = const { std::cell::Cell::new(None) };
}

/// While it lives, what is compiled on this thread is counted for one rule: the JSONPath
/// queries it parses against [`MAX_RULE_QUERY_BYTES`] ([`charge_query`]), and what its queries
/// and regular expressions hold ([`CompileMeter::held_bytes`]).
pub(crate) struct CompileMeter {
    previous: Option<Compiling>,
}

/// What a parsed query keeps per byte of its text: 700,000 segments of `.a` kept 165 MB.
const QUERY_HELD_PER_BYTE: usize = 128;

impl CompileMeter {
    pub(crate) fn start() -> CompileMeter {
        CompileMeter {
            previous: COMPILING.replace(Some(Compiling::default())),
        }
    }

    /// What the rule's compiled queries and regular expressions hold, as far as counted.
    pub(crate) fn held_bytes(&self) -> usize {
        COMPILING.get().map_or(0, |c| {
            c.query_bytes
                .saturating_mul(QUERY_HELD_PER_BYTE)
                .saturating_add(c.regex_bytes)
        })
    }
}

impl Drop for CompileMeter {
    fn drop(&mut self) {
        COMPILING.set(self.previous);
    }
}

/// Counts a query of `bytes` against the rule being compiled; false (and nothing counted)
/// when the rule's queries would be over [`MAX_RULE_QUERY_BYTES`].
pub(crate) fn charge_query(bytes: usize) -> bool {
    match COMPILING.get() {
        None => true,
        Some(mut c) => {
            let total = c.query_bytes.saturating_add(bytes);
            if total > MAX_RULE_QUERY_BYTES {
                return false;
            }
            c.query_bytes = total;
            COMPILING.set(Some(c));
            true
        }
    }
}

/// Counts what a compiled regular expression holds for the rule being compiled.
fn count_regex(bytes: usize) {
    if let Some(mut c) = COMPILING.get() {
        c.regex_bytes = c.regex_bytes.saturating_add(bytes);
        COMPILING.set(Some(c));
    }
}

/// Bounds on what rules may do to one object. The defaults suit `initium serve`; the flags
/// of `initium serve` change them (see docs/reliability.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Bytes (as JSON) one rule may write into an object: values it adds or replaces,
    /// strings it rewrites, templates it renders.
    pub rule_output_bytes: usize,
    /// Bytes all rules together may write into one object.
    pub admission_output_bytes: usize,
    /// Element × mutation steps one rule's `forEach` mutations may take in one object.
    pub foreach_steps: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            rule_output_bytes: 1 << 20,
            admission_output_bytes: 4 << 20,
            foreach_steps: 100_000,
        }
    }
}

/// The size of a JSON value: bytes as compact JSON (close enough: numbers count 8) and nesting
/// depth (0 for a scalar).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Size {
    pub bytes: usize,
    pub depth: usize,
}

/// Measures `value` without recursion, stopping early (with what it has counted so far, more
/// than `max_bytes` or deeper than `max_depth`) once either is passed.
pub fn measure(value: &Value, max_bytes: usize, max_depth: usize) -> Size {
    let mut size = Size::default();
    let mut stack: Vec<(&Value, usize)> = vec![(value, 0)];
    while let Some((v, depth)) = stack.pop() {
        size.depth = size.depth.max(depth);
        size.bytes += match v {
            Value::Null | Value::Bool(_) => 5,
            Value::Number(_) => 8,
            Value::String(s) => s.len() + 2,
            Value::Array(items) => {
                stack.extend(items.iter().map(|i| (i, depth + 1)));
                2 + items.len()
            }
            Value::Object(map) => {
                stack.extend(map.values().map(|i| (i, depth + 1)));
                2 + map.keys().map(|k| k.len() + 4).sum::<usize>()
            }
        };
        if size.bytes > max_bytes || size.depth > max_depth {
            break;
        }
    }
    size
}

/// Counts the nodes of `value`, without recursion, stopping once past `max`.
pub fn count_nodes(value: &Value, max: usize) -> usize {
    let mut count = 0;
    let mut stack = vec![value];
    while let Some(v) = stack.pop() {
        count += 1;
        if count > max {
            break;
        }
        match v {
            Value::Array(items) => stack.extend(items.iter()),
            Value::Object(map) => stack.extend(map.values()),
            _ => {}
        }
    }
    count
}

/// A limit a rule ran into while it was running.
#[derive(Debug, thiserror::Error)]
pub enum LimitError {
    #[error(
        "the rule would write more than {} into the object (the per-rule output limit, --max-rule-output)",
        human_bytes(*.limit)
    )]
    RuleOutput { limit: usize },
    #[error(
        "the rules together would write more than {} into the object (the per-object output limit, --max-admission-output)",
        human_bytes(*.limit)
    )]
    AdmissionOutput { limit: usize },
    #[error(
        "forEach would take more than {limit} element × mutation steps (the limit, --max-foreach-steps): {elements} elements × {mutations} mutations"
    )]
    ForEachSteps {
        limit: usize,
        elements: usize,
        mutations: usize,
    },
    #[error("the rule would nest the object more than {MAX_DEPTH} levels deep (the depth limit)")]
    Depth,
    #[error(transparent)]
    RegexWork(#[from] RegexWorkError),
}

/// Counts what the rules of one admission write and how long they take.
pub(crate) struct Meter<'a> {
    limits: &'a Limits,
    deadline: Option<Instant>,
    rule_written: usize,
    total_written: usize,
    steps: usize,
    ticks: u32,
}

/// Steps between two looks at the clock inside a rule.
const CLOCK_STRIDE: u32 = 8;

impl<'a> Meter<'a> {
    pub fn new(limits: &'a Limits, deadline: Option<Instant>) -> Meter<'a> {
        Meter {
            limits,
            deadline,
            rule_written: 0,
            total_written: 0,
            steps: 0,
            ticks: 0,
        }
    }

    /// When the latency budget runs out (`None`: never).
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// Starts counting for the next rule.
    pub fn start_rule(&mut self) {
        self.rule_written = 0;
        self.steps = 0;
    }

    /// Bytes the current rule may still write.
    pub fn remaining(&self) -> usize {
        (self.limits.rule_output_bytes - self.rule_written.min(self.limits.rule_output_bytes)).min(
            self.limits.admission_output_bytes
                - self.total_written.min(self.limits.admission_output_bytes),
        )
    }

    /// Counts `bytes` written by the current rule; over a limit, counts nothing and fails.
    pub fn write(&mut self, bytes: usize) -> Result<(), Stop> {
        let rule = self.rule_written.saturating_add(bytes);
        let total = self.total_written.saturating_add(bytes);
        if rule > self.limits.rule_output_bytes {
            return Err(LimitError::RuleOutput {
                limit: self.limits.rule_output_bytes,
            }
            .into());
        }
        if total > self.limits.admission_output_bytes {
            return Err(LimitError::AdmissionOutput {
                limit: self.limits.admission_output_bytes,
            }
            .into());
        }
        self.rule_written = rule;
        self.total_written = total;
        Ok(())
    }

    /// The current rule failed and its changes were undone: what it wrote no longer counts
    /// against the other rules.
    pub fn undo_rule(&mut self) {
        self.total_written -= self.rule_written.min(self.total_written);
        self.rule_written = 0;
    }

    /// Counts a value of `size` written `at_depth` levels below the object's root.
    pub fn write_sized(&mut self, size: Size, at_depth: usize) -> Result<(), Stop> {
        check_depth(size.depth, at_depth)?;
        self.write(size.bytes)
    }

    /// Before `elements` × `mutations` forEach steps.
    pub fn plan_steps(&mut self, elements: usize, mutations: usize) -> Result<(), Stop> {
        self.steps = self
            .steps
            .saturating_add(elements.saturating_mul(mutations));
        if self.steps > self.limits.foreach_steps {
            return Err(LimitError::ForEachSteps {
                limit: self.limits.foreach_steps,
                elements,
                mutations,
            }
            .into());
        }
        Ok(())
    }

    /// Before a unit of work: looks at the clock every few calls.
    pub fn tick(&mut self) -> Result<(), Stop> {
        self.ticks = self.ticks.wrapping_add(1);
        if self.ticks.is_multiple_of(CLOCK_STRIDE) {
            self.check_clock()?;
        }
        Ok(())
    }

    /// Looks at the clock now.
    pub fn check_clock(&self) -> Result<(), Stop> {
        match self.deadline {
            Some(d) if crate::pace::passed(d) => Err(Stop::Budget),
            _ => Ok(()),
        }
    }
}

/// A value `depth` levels deep written `at_depth` levels below the root must stay within
/// [`MAX_DEPTH`].
pub(crate) fn check_depth(depth: usize, at_depth: usize) -> Result<(), Stop> {
    if depth.saturating_add(at_depth) > MAX_DEPTH {
        return Err(LimitError::Depth.into());
    }
    Ok(())
}

/// `regex.replace_all(text, replacement)`, refusing before it builds a result larger than
/// the rule may still write (a replacement such as `$0$0` doubles the text each time a rule
/// applies it). `None` when nothing matched. Rewrites and the templates' `replace()` use it.
/// `once`: every match of the regex starts at the start of the text ([`starts_anchored`]), so
/// there is at most one, and no search for another after it.
pub(crate) fn replace_all(
    regex: &RuleRegex,
    once: bool,
    text: &str,
    replacement: &str,
    meter: &mut Meter,
) -> Result<Option<String>, Stop> {
    // Charged before the search: it cannot be interrupted once it runs.
    regex.check_search(text.len())?;
    // Each `$` reference expands to at most the whole match (groups lie inside it).
    let references = replacement.matches('$').count();
    let limit = meter.remaining();
    let mut out = String::new();
    let mut last = 0;
    let mut matched = false;
    let check = |meter: &mut Meter, out: &String, last: usize, start: usize, end: usize| {
        let most = out.len() + (start - last) + replacement.len() + references * (end - start);
        if most > limit {
            // Counting what it would write fails, with the limit in the message.
            return meter.write(most);
        }
        Ok(())
    };
    if references == 0 {
        for (n, m) in regex.regex.find_iter(text).enumerate() {
            check(meter, &out, last, m.start(), m.end())?;
            out.push_str(&text[last..m.start()]);
            out.push_str(replacement);
            last = m.end();
            matched = true;
            if once {
                break;
            }
            if n % 64 == 63 {
                meter.check_clock()?;
            }
        }
    } else {
        for (n, caps) in regex.regex.captures_iter(text).enumerate() {
            let Some(whole) = caps.get_match() else {
                continue;
            };
            check(meter, &out, last, whole.start(), whole.end())?;
            out.push_str(&text[last..whole.start()]);
            caps.interpolate_string_into(text, replacement, &mut out);
            last = whole.end();
            matched = true;
            if once {
                break;
            }
            if n % 64 == 63 {
                meter.check_clock()?;
            }
        }
    }
    if !matched {
        return Ok(None);
    }
    out.push_str(&text[last..]);
    meter.write(out.len())?;
    Ok(Some(out))
}

/// Whether every match of `pattern` starts at the start of the text (`^` outside multi-line
/// mode, on every branch): then it matches at most once. False when that cannot be told.
pub fn starts_anchored(pattern: &str) -> bool {
    regex_syntax::parse(pattern).is_ok_and(|hir| {
        hir.properties()
            .look_set_prefix()
            .contains(regex_syntax::hir::Look::Start)
    })
}

/// A rule's compiled regular expression: the meta engine the `regex` crate is built on,
/// configured so that what it holds stays within the rule's share.
///
/// The `regex` crate's own `Regex` also builds a one-pass DFA of up to 1 MiB per expression,
/// which its `size_limit` does not bound: 393 KiB for `^(\w+)$` and 1.1 MiB for
/// `^(\w+)/(\w+):(\w+)$` (BENCHMARKS.md, "Memory of rule regular expressions"), so 50 rules
/// of 16 such expressions, each within its share, took 1.1 GB. Here that DFA and the full DFA
/// are off: matches with groups run on the bounded backtracker or the PikeVM, as they already
/// did for every pattern that is not one-pass; searches without groups keep the lazy DFA,
/// whose cache is held to the share.
///
/// Searches are charged before they run (see [`REGEX_SEARCH_WORK`]): [`RuleRegex::check_search`]
/// refuses a text whose length times [`RuleRegex::work_per_byte`] is over the expression's
/// share, so no search a rule can cause runs longer than a few tens of milliseconds, whatever
/// the pattern and the object.
#[derive(Clone, Debug)]
pub struct RuleRegex {
    regex: meta::Regex,
    pattern: Arc<str>,
    /// Work units one byte of text costs this expression in the worst case.
    work_per_byte: u64,
    /// Work units this expression may spend on one search (or one condition's searches):
    /// [`REGEX_SEARCH_WORK`].
    work_limit: u64,
}

impl RuleRegex {
    /// The pattern as the rule wrote it.
    pub fn as_str(&self) -> &str {
        &self.pattern
    }

    /// Whether some part of `text` matches: the search charged first ([`RuleRegex::check_search`]).
    #[cfg(test)]
    pub fn is_match(&self, text: &str) -> Result<bool, RegexWorkError> {
        self.check_search(text.len())?;
        Ok(self.regex.is_match(text))
    }

    /// Whether some part of `text` matches, for a search already charged.
    pub(crate) fn is_match_charged(&self, text: &str) -> bool {
        self.regex.is_match(text)
    }

    /// Work units one byte of text costs a search in the worst case: a base for the lazy DFA
    /// building a state at every byte, plus the size of the automata (the PikeVM steps through
    /// every state of the NFA at every byte).
    pub fn work_per_byte(&self) -> u64 {
        self.work_per_byte
    }

    /// The most bytes one search (or all the searches of one condition together) may cover.
    pub fn max_search_bytes(&self) -> usize {
        // A search of n bytes is charged n + 1 bytes (an empty text is searched too).
        usize::try_from((self.work_limit / self.work_per_byte.max(1)).saturating_sub(1))
            .unwrap_or(usize::MAX)
    }

    /// Refuses, before any search runs, `bytes` of text that would cost this expression more
    /// than [`REGEX_SEARCH_WORK`].
    pub fn check_search(&self, bytes: usize) -> Result<(), RegexWorkError> {
        let work = (bytes as u64)
            .saturating_add(1)
            .saturating_mul(self.work_per_byte);
        if work > self.work_limit {
            return Err(RegexWorkError {
                pattern: self.pattern.to_string(),
                bytes,
                max_bytes: self.max_search_bytes(),
            });
        }
        Ok(())
    }

    /// Bytes the compiled expression holds (not counting the caches of searches).
    #[cfg(test)]
    pub fn memory_usage(&self) -> usize {
        self.regex.memory_usage()
    }
}

/// Compiles a rule's regular expression within `size_limit` bytes (its share of what all the
/// rule's regular expressions may use, see [`regex_share`]), so a rule cannot make initium
/// allocate without limit or spend seconds compiling. The syntax is the `regex` crate's.
pub fn compile_regex(pattern: &str, size_limit: usize) -> Result<RuleRegex, RegexError> {
    let config = meta::Config::new()
        .nfa_size_limit(Some(size_limit))
        .hybrid_cache_capacity(size_limit)
        .onepass(false)
        .dfa(false);
    meta::Builder::new()
        .configure(config)
        .build(pattern)
        .map(|regex| {
            let held = regex.memory_usage() as u64;
            // Its automata, and the lazy DFA's cache, which may grow to the same share.
            count_regex(regex.memory_usage().saturating_add(size_limit));
            RuleRegex {
                work_per_byte: REGEX_WORK_PER_BYTE_BASE + held / REGEX_BYTES_PER_UNIT,
                work_limit: REGEX_SEARCH_WORK,
                regex,
                pattern: pattern.into(),
            }
        })
        .map_err(|source| {
            let pattern = pattern.to_string();
            let source = Box::new(source);
            if let Some(syntax) = source.syntax_error() {
                // The syntax error's Display draws the pattern with a caret over several
                // lines; its last line says what is wrong.
                let text = syntax.to_string();
                let problem = text
                    .lines()
                    .last()
                    .unwrap_or_default()
                    .trim_start_matches("error: ")
                    .to_string();
                RegexError::Syntax {
                    pattern,
                    problem,
                    source,
                }
            } else if source.size_limit().is_some() {
                RegexError::TooBig {
                    pattern,
                    size_limit,
                    source,
                }
            } else {
                RegexError::Other { pattern, source }
            }
        })
}

/// Each of a rule's `count` regular expressions may compile to this many bytes.
pub fn regex_share(count: usize) -> usize {
    (RULE_REGEX_BYTES / count.max(1)).min(MAX_REGEX_BYTES)
}

/// A search a rule's regular expression may not run: the text is too long for the expression.
#[derive(Debug, thiserror::Error)]
#[error(
    "regular expression {pattern:?} would search {bytes} bytes, and it may search at most {max_bytes} at once (a search cannot be interrupted, so its cost, the text's length times the expression's size, is bounded before it runs): match a shorter field, or simplify the expression (fewer repetitions, [a-zA-Z0-9_] instead of \\w)"
)]
pub struct RegexWorkError {
    pub pattern: String,
    pub bytes: usize,
    pub max_bytes: usize,
}

/// A regular expression of a rule that does not compile, or not within its share.
#[derive(Debug, thiserror::Error)]
pub enum RegexError {
    #[error("invalid regular expression {pattern}: {problem}", pattern = crate::untrusted::InQuotes(.pattern))]
    Syntax {
        pattern: String,
        problem: String,
        #[source]
        source: Box<meta::BuildError>,
    },
    #[error(
        "regular expression {pattern} is too large once compiled (over {}; a rule's regular expressions share {}): simplify it, for example [a-zA-Z0-9_] instead of \\w, which matches every Unicode letter and digit, or fewer repetitions",
        human_bytes(*.size_limit),
        human_bytes(RULE_REGEX_BYTES), pattern = crate::untrusted::InQuotes(.pattern))]
    TooBig {
        pattern: String,
        size_limit: usize,
        #[source]
        source: Box<meta::BuildError>,
    },
    #[error("invalid regular expression {pattern}: {source}", pattern = crate::untrusted::InQuotes(.pattern))]
    Other {
        pattern: String,
        #[source]
        source: Box<meta::BuildError>,
    },
}

/// `1 MiB`, `512 KiB`, `1.5 MiB`, `100 bytes`: exact for a limit, one decimal otherwise.
pub fn human_bytes(n: usize) -> String {
    let (unit, name) = if n >= 1 << 20 {
        (1usize << 20, "MiB")
    } else if n >= 1 << 10 {
        (1 << 10, "KiB")
    } else {
        return format!("{n} bytes");
    };
    if n.is_multiple_of(unit) {
        format!("{} {name}", n / unit)
    } else {
        format!("{:.1} {name}", n as f64 / unit as f64)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn measures_bytes_and_depth_and_stops_early() {
        assert_eq!(measure(&json!("abc"), usize::MAX, usize::MAX).depth, 0);
        assert_eq!(measure(&json!({}), usize::MAX, usize::MAX).depth, 0);
        assert_eq!(measure(&json!({"a": {"b": [1]}}), usize::MAX, 99).depth, 3);
        let big = json!({"a": "x".repeat(1000)});
        assert!(measure(&big, usize::MAX, 99).bytes > 1000);
        // A deep chain is measured without recursion and only as far as needed.
        let mut deep = json!(1);
        for _ in 0..10_000 {
            deep = Value::Array(vec![deep]);
        }
        let size = measure(&deep, usize::MAX, 50);
        assert_eq!(size.depth, 51);
        assert!(size.bytes < 200, "{size:?}");
        // Tear the chain down iteratively too: dropping 10,000 levels recursively would
        // be the very overflow these limits prevent.
        let mut v = deep;
        while let Value::Array(mut items) = v {
            v = items.pop().unwrap_or(Value::Null);
        }
    }

    #[test]
    fn a_regex_anchored_at_the_start_is_replaced_once_as_replace_all_would() {
        for (pattern, anchored) in [
            (
                "^(?:docker\\.io/)?([a-z0-9_-]+(?:/[a-z0-9._-]+)+(?::[\\w.-]+)?)$",
                true,
            ),
            ("^a", true),
            ("(?:^a|^b)c", true),
            ("^", true),
            ("^a*", true),
            ("\\Aa", true),
            ("^a|b", false),
            ("(?m)^a", false),
            ("a", false),
            ("a*", false),
            ("\\ba", false),
        ] {
            assert_eq!(starts_anchored(pattern), anchored, "{pattern}");
            let regex = compile_regex(pattern, MAX_REGEX_BYTES).unwrap();
            let reference = regex::Regex::new(pattern).unwrap();
            for text in [
                "",
                "a",
                "aaa",
                "bc",
                "ac b",
                "docker.io/shop/app:1",
                "shop/app",
                "x\na",
            ] {
                assert_eq!(
                    regex.is_match(text).unwrap(),
                    reference.is_match(text),
                    "{pattern} on {text:?}"
                );
                for replacement in ["", "<$0>", "z", "$1", "${1}x", "$$", "$name"] {
                    let limits = Limits::default();
                    let mut meter = Meter::new(&limits, None);
                    let once =
                        replace_all(&regex, anchored, text, replacement, &mut meter).unwrap();
                    let all = replace_all(&regex, false, text, replacement, &mut meter).unwrap();
                    assert_eq!(once, all, "{pattern} on {text:?} with {replacement:?}");
                    let expected = reference.replace_all(text, replacement);
                    assert_eq!(
                        all.as_deref().unwrap_or(text),
                        expected,
                        "{pattern} on {text:?} with {replacement:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_rule_regex_holds_its_automata_and_no_one_pass_dfa() {
        // With the `regex` crate's one-pass DFA this pattern held 1.1 MiB (BENCHMARKS.md,
        // "Memory of rule regular expressions"); its automata alone are 170 KiB.
        let image = compile_regex("^(\\w+)/(\\w+):(\\w+)$", MAX_REGEX_BYTES).unwrap();
        assert!(image.memory_usage() < 256 << 10, "{}", image.memory_usage());
        // Whatever compiles holds at most its forward and reverse automata, each within the
        // share.
        for pattern in ["\\w{20}", "(\\w+\\s+){10}", "^docker\\.io/(.*)$", "[a-z]+"] {
            for share in [
                MAX_REGEX_BYTES,
                regex_share(4),
                regex_share(MAX_RULE_REGEXES),
            ] {
                if let Ok(regex) = compile_regex(pattern, share) {
                    assert!(
                        regex.memory_usage() <= 2 * share + (4 << 10),
                        "{pattern} within {share}: {}",
                        regex.memory_usage()
                    );
                    assert_eq!(regex.as_str(), pattern);
                }
            }
        }
    }

    #[test]
    fn a_search_is_charged_before_it_runs_by_text_length_times_program_size() {
        // `a[ab]{20}c` makes the lazy DFA build a state at almost every byte of random a/b
        // text: 58 s for a 1 MB rewrite before this bound.
        let thrash = compile_regex("a[ab]{20}c", MAX_REGEX_BYTES).unwrap();
        let small = compile_regex("^docker\\.io/", MAX_REGEX_BYTES).unwrap();
        let unicode = compile_regex("^(\\w+)/(\\w+):(\\w+)$", MAX_REGEX_BYTES).unwrap();
        // A bigger program costs more per byte, so it may search less text.
        assert!(unicode.work_per_byte() > thrash.work_per_byte());
        assert!(unicode.max_search_bytes() < thrash.max_search_bytes());
        // Whatever the pattern, an image or a name is always searched...
        for regex in [&thrash, &small, &unicode] {
            assert!(regex.max_search_bytes() >= 4 << 10, "{}", regex.as_str());
            assert!(regex.check_search(4 << 10).is_ok());
            // ...and a megabyte never is.
            let error = regex.check_search(1 << 20).unwrap_err();
            assert_eq!(error.bytes, 1 << 20);
            assert!(error.to_string().contains("may search at most"), "{error}");
        }
        // The bound is what makes the search short: the longest text allowed takes far less
        // than the latency budget, where the 1 MB text took seconds.
        let text: String = (0..thrash.max_search_bytes())
            .map(|i| if (i * 7919) % 13 < 6 { 'a' } else { 'b' })
            .collect();
        let limits = Limits::default();
        let mut meter = Meter::new(&limits, None);
        assert!(replace_all(&thrash, false, &text, "x", &mut meter).is_ok());
        let long = "ab".repeat(1 << 19);
        let refused = replace_all(&thrash, false, &long, "x", &mut meter).unwrap_err();
        assert!(
            refused.to_string().contains("may search at most"),
            "{refused}"
        );
    }

    #[test]
    fn meter_counts_per_rule_and_per_admission() {
        let limits = Limits {
            rule_output_bytes: 100,
            admission_output_bytes: 150,
            foreach_steps: 10,
        };
        let mut meter = Meter::new(&limits, None);
        meter.start_rule();
        assert!(meter.write(90).is_ok());
        let err = meter.write(20).unwrap_err().to_string();
        assert!(err.contains("more than 100 bytes"), "{err}");
        meter.start_rule();
        assert!(meter.write(40).is_ok());
        let err = meter.write(30).unwrap_err().to_string();
        assert!(err.contains("--max-admission-output"), "{err}");
        // A failed rule's writes are undone and no longer count.
        meter.undo_rule();
        meter.start_rule();
        assert!(meter.write(60).is_ok());
        meter.start_rule();
        assert!(meter.plan_steps(5, 2).is_ok());
        assert!(meter.plan_steps(1, 1).is_err());
        assert!(check_depth(10, MAX_DEPTH - 10).is_ok());
        assert!(check_depth(11, MAX_DEPTH - 10).is_err());
    }

    #[test]
    fn a_bad_regular_expression_says_what_is_wrong_and_keeps_the_library_error() {
        let error = compile_regex("a(b", MAX_REGEX_BYTES).unwrap_err();
        assert_eq!(
            error.to_string(),
            "invalid regular expression \"a(b\": unclosed group"
        );
        let source = std::error::Error::source(&error).map(|s| s.is::<Box<meta::BuildError>>());
        assert_eq!(source, Some(true));
        let big = compile_regex("\\w{100}", 1 << 10).unwrap_err().to_string();
        assert_eq!(
            big,
            "regular expression \"\\\\w{100}\" is too large once compiled (over 1 KiB; a rule's regular expressions share 4 MiB): simplify it, for example [a-zA-Z0-9_] instead of \\w, which matches every Unicode letter and digit, or fewer repetitions"
        );
    }

    #[test]
    fn an_expired_deadline_stops_at_the_next_look() {
        let limits = Limits::default();
        let meter = Meter::new(&limits, Some(Instant::now()));
        assert!(matches!(meter.check_clock(), Err(Stop::Budget)));
        let mut meter = Meter::new(&limits, Some(Instant::now()));
        let stopped = (0..CLOCK_STRIDE).any(|_| meter.tick().is_err());
        assert!(stopped);
    }
}
