//! `conditions`: RFC 9535 JSONPath over the object's content, each with one test (`matches`,
//! `equals`, `exists` or `in`). All must hold. The same conditions, with paths from `@`,
//! choose the list elements a `remove` mutation takes away.

use std::collections::HashSet;
use std::time::Instant;

use crate::limits::RuleRegex;
use serde_json::Value;

use crate::api::{self, exactly_one_of_message};
use crate::error::Errors;
use crate::limits::{MAX_DEPTH, MAX_IN_SET_BYTES, compile_regex, measure};
use crate::path::Query;

use super::MatchError;

#[derive(Clone, Debug)]
enum Test {
    Matches(RuleRegex),
    Equals(Value),
    Exists(bool),
    /// A query over the object: the condition holds when a value its path selects equals one
    /// of the values this selects.
    In(Query),
    NotEquals(Value),
    GreaterThan(f64),
    LessThan(f64),
}

/// The tests a condition may set, one of them, as a rule writes them.
const CONDITION_TESTS: [&str; 7] = [
    "matches",
    "equals",
    "notEquals",
    "exists",
    "in",
    "greaterThan",
    "lessThan",
];

#[derive(Clone, Debug)]
struct Condition {
    query: Query,
    test: Test,
}

#[derive(Clone, Debug, Default)]
pub struct Conditions(Vec<Condition>);

impl Conditions {
    /// Compiles `spec.conditions`; each `matches` may compile to `regex_limit` bytes.
    pub(crate) fn compile(
        conditions: &[api::Condition],
        regex_limit: usize,
        errors: &mut Errors,
    ) -> Conditions {
        Self::compile_at(conditions, "spec.conditions", regex_limit, errors)
    }

    /// [`Conditions::compile`] for conditions at `field` (e.g. a gate dependency's).
    pub(crate) fn compile_at(
        conditions: &[api::Condition],
        field: &str,
        regex_limit: usize,
        errors: &mut Errors,
    ) -> Conditions {
        Self::compile_with(conditions, field, regex_limit, errors, |path| {
            Query::parse(path).map_err(|e| e.to_string())
        })
    }

    /// Conditions on the elements of a list (`remove.where`): each path starts with `@`, the
    /// element; `in` queries still read the object (`$`).
    pub(crate) fn compile_on_elements(
        conditions: &[api::Condition],
        field: &str,
        regex_limit: usize,
        errors: &mut Errors,
    ) -> Conditions {
        Self::compile_with(conditions, field, regex_limit, errors, |path| {
            match path.strip_prefix('@') {
                // Parsed as a query from `$`, and told as the rule wrote it.
                Some(rest) => Query::parse(&format!("${rest}")).map_err(|e| {
                    let message = e.to_string();
                    message.replacen(
                        &format!("{:?}", format!("${rest}")),
                        &format!("{path:?}"),
                        1,
                    )
                }),
                None => Err(format!(
                    "{path:?} must start with @, the list element (like @.hostPath)"
                )),
            }
        })
    }

    fn compile_with(
        conditions: &[api::Condition],
        field: &str,
        regex_limit: usize,
        errors: &mut Errors,
        parse_path: impl Fn(&str) -> Result<Query, String>,
    ) -> Conditions {
        let mut compiled = Vec::new();
        for (i, c) in conditions.iter().enumerate() {
            let at = format!("{field}[{i}]");
            let query = parse_path(&c.path)
                .map_err(|e| errors.push(format!("{at}.path"), e))
                .ok();
            let set = [
                c.matches.is_some(),
                c.equals.is_some(),
                c.not_equals.is_some(),
                c.exists.is_some(),
                c.in_.is_some(),
                c.greater_than.is_some(),
                c.less_than.is_some(),
            ]
            .iter()
            .filter(|x| **x)
            .count();
            let bound = |value: &Value, name: &str, errors: &mut Errors| {
                number_or_quantity(value)
                    .ok_or_else(|| {
                        errors.push(
                            format!("{at}.{name}"),
                            format!(
                                "{value} is not a number or a Kubernetes quantity (like 3, \"0.5\", \"512Mi\", \"250m\")"
                            ),
                        )
                    })
                    .ok()
            };
            let test = if set != 1 {
                errors.push(
                    &at,
                    format!("{} (found {set})", exactly_one_of_message(&CONDITION_TESTS)),
                );
                None
            } else if let Some(re) = &c.matches {
                compile_regex(re, regex_limit)
                    .map(Test::Matches)
                    .map_err(|e| errors.push(format!("{at}.matches"), e))
                    .ok()
            } else if let Some(v) = &c.equals {
                Some(Test::Equals(v.clone()))
            } else if let Some(v) = &c.not_equals {
                Some(Test::NotEquals(v.clone()))
            } else if let Some(b) = c.exists {
                Some(Test::Exists(b))
            } else if let Some(q) = &c.in_ {
                Query::parse(q)
                    .map(Test::In)
                    .map_err(|e| errors.push(format!("{at}.in"), e))
                    .ok()
            } else if let Some(v) = &c.greater_than {
                bound(v, "greaterThan", errors).map(Test::GreaterThan)
            } else if let Some(v) = &c.less_than {
                bound(v, "lessThan", errors).map(Test::LessThan)
            } else {
                None
            };
            if let (Some(query), Some(test)) = (query, test) {
                compiled.push(Condition { query, test });
            }
        }
        Conditions(compiled)
    }

    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }

    /// A `matches` condition that rules the object out on its own when none of the values its
    /// path selects matches, for the index's prefilter: the first one, provided nothing that
    /// runs before it can fail instead (the `in` queries, looked up first, and the conditions
    /// before it), so that "does not hold" is what the rule would say too.
    pub(crate) fn first_regex(&self) -> Option<(&Query, &RuleRegex)> {
        let in_queries_cannot_fail = self.0.iter().all(|c| match &c.test {
            Test::In(query) => query.cannot_fail(),
            _ => true,
        });
        if !in_queries_cannot_fail {
            return None;
        }
        for c in &self.0 {
            if let Test::Matches(re) = &c.test {
                return Some((&c.query, re));
            }
            if !c.query.cannot_fail() {
                return None;
            }
        }
        None
    }

    /// The subtrees of an object these conditions read, each as the names from the root to
    /// it (no conditions: none); `None` when some condition may read anything. An object
    /// reduced to these subtrees holds the same conditions (see `gate::Reads`).
    pub(crate) fn reads(&self) -> Option<Vec<Vec<String>>> {
        let mut paths = Vec::new();
        for c in &self.0 {
            paths.push(c.query.reads_under()?.to_vec());
            if let Test::In(query) = &c.test {
                paths.push(query.reads_under()?.to_vec());
            }
        }
        Some(paths)
    }

    /// True when some condition reads the object besides what its path selects (`in`).
    pub(crate) fn reads_object(&self) -> bool {
        self.0.iter().any(|c| matches!(c.test, Test::In(_)))
    }

    /// Whether every condition holds; an error names the condition whose query would do too
    /// much work on this object.
    #[cfg(test)]
    pub(crate) fn hold(&self, object: &Value) -> Result<bool, MatchError> {
        self.hold_until(object, None)
    }

    /// The index of the first condition that does not hold for `object` (`None`: all hold).
    /// For `initium explain`.
    pub(crate) fn first_failing(&self, object: &Value) -> Result<Option<usize>, MatchError> {
        let prepared = self.prepare(object)?;
        for (index, c) in self.0.iter().enumerate() {
            let set = prepared.sets.get(index).and_then(Option::as_ref);
            if !c.holds(index, object, set)? {
                return Ok(Some(index));
            }
        }
        Ok(None)
    }

    /// Whether a change at `pointer` may change what some `in` query selects (then the sets
    /// [`Conditions::prepare`] built before the change may be stale).
    pub(crate) fn in_sets_may_see(&self, pointer: &crate::path::Pointer) -> bool {
        self.0.iter().any(|c| match &c.test {
            Test::In(query) => query.may_select_under(pointer),
            _ => false,
        })
    }

    /// What the `in` queries select from `object`, looked up once for many elements.
    pub(crate) fn prepare(&self, object: &Value) -> Result<Prepared, MatchError> {
        #[cfg(test)]
        PREPARED.with(|n| n.set(n.get() + 1));
        let mut sets = Vec::with_capacity(self.0.len());
        let mut count = 0usize;
        for (index, c) in self.0.iter().enumerate() {
            sets.push(match &c.test {
                Test::In(query) => {
                    let selected = query
                        .select(object)
                        .map_err(|source| MatchError::Condition { index, source })?;
                    count = count.saturating_add(selected.len());
                    // Charged before any key is built: each node's key holds its children's
                    // again, so the keys of `$..*` grow with the object's size times its depth.
                    let mut left = MAX_IN_SET_BYTES;
                    for value in &selected {
                        let bytes = measure(value, left, MAX_DEPTH).bytes;
                        left = left
                            .checked_sub(bytes)
                            .ok_or(MatchError::InSetTooLarge { index })?;
                    }
                    Some(selected.into_iter().map(value_key).collect())
                }
                _ => None,
            });
        }
        Ok(Prepared {
            sets,
            selected: count,
        })
    }

    /// Whether every condition holds for `value`, with the `in` sets of `prepared`.
    pub(crate) fn hold_prepared(
        &self,
        value: &Value,
        prepared: &Prepared,
    ) -> Result<bool, MatchError> {
        self.hold_prepared_until(value, prepared, None)
    }

    /// [`Conditions::hold`], looking at the clock before every condition that can take long: each
    /// condition's work is bounded (queries and searches are charged before they run), and
    /// the latency budget bounds them all.
    pub(crate) fn hold_until(
        &self,
        object: &Value,
        deadline: Option<Instant>,
    ) -> Result<bool, MatchError> {
        self.hold_prepared_until(object, &self.prepare(object)?, deadline)
    }

    fn hold_prepared_until(
        &self,
        value: &Value,
        prepared: &Prepared,
        deadline: Option<Instant>,
    ) -> Result<bool, MatchError> {
        for (index, c) in self.0.iter().enumerate() {
            // The clock is read only before a condition that can take long (a search, an `in`
            // test, a query that may refuse its work): reading it costs more than a simple
            // `equals` on the admission path.
            if c.can_take_long() && deadline.is_some_and(crate::pace::passed) {
                return Err(MatchError::OutOfTime);
            }
            let set = prepared.sets.get(index).and_then(Option::as_ref);
            if !c.holds(index, value, set)? {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

impl Condition {
    /// A regex search, an `in` test, or a query that may refuse its work.
    fn can_take_long(&self) -> bool {
        matches!(self.test, Test::Matches(_) | Test::In(_)) || !self.query.cannot_fail()
    }

    fn holds(
        &self,
        index: usize,
        value: &Value,
        set: Option<&HashSet<String>>,
    ) -> Result<bool, MatchError> {
        let found = self
            .query
            .select(value)
            .map_err(|source| MatchError::Condition { index, source })?;
        Ok(match &self.test {
            Test::Matches(re) => {
                // Every search is charged before the first runs: together they may cover at
                // most what one search may (`$..*` on a large object selects many strings).
                let bytes = found
                    .iter()
                    .filter_map(|v| v.as_str())
                    .fold(0usize, |sum, s| sum.saturating_add(s.len()));
                re.check_search(bytes)
                    .map_err(|source| MatchError::ConditionSearch { index, source })?;
                found
                    .iter()
                    .any(|v| v.as_str().is_some_and(|s| re.is_match_charged(s)))
            }
            Test::Equals(want) => found.iter().any(|v| same_value(v, want)),
            Test::Exists(want) => found.is_empty() != *want,
            Test::NotEquals(unwanted) => !found.iter().any(|v| same_value(v, unwanted)),
            Test::GreaterThan(bound) => found
                .iter()
                .any(|v| number_or_quantity(v).is_some_and(|n| n > *bound)),
            Test::LessThan(bound) => found
                .iter()
                .any(|v| number_or_quantity(v).is_some_and(|n| n < *bound)),
            Test::In(_) => set.is_some_and(|set| found.iter().any(|v| set.contains(&value_key(v)))),
        })
    }
}

/// A JSON number, or a string holding a number or a Kubernetes quantity (`"512Mi"`, `"250m"`,
/// `"1.5G"`, `"1e3"`), as a number; `None` for anything else.
pub(crate) fn number_or_quantity(value: &Value) -> Option<f64> {
    match value {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => quantity(s),
        _ => None,
    }
}

fn quantity(text: &str) -> Option<f64> {
    const SUFFIXES: [(&str, f64); 16] = [
        ("Ki", 1024.0),
        ("Mi", 1_048_576.0),
        ("Gi", 1_073_741_824.0),
        ("Ti", 1_099_511_627_776.0),
        ("Pi", 1_125_899_906_842_624.0),
        ("Ei", 1_152_921_504_606_846_976.0),
        ("n", 1e-9),
        ("u", 1e-6),
        ("m", 1e-3),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("T", 1e12),
        ("P", 1e15),
        ("E", 1e18),
        ("", 1.0),
    ];
    let text = text.trim();
    if text.is_empty() || text.len() > 64 {
        return None;
    }
    let (number, scale) = SUFFIXES
        .iter()
        .find_map(|(suffix, scale)| Some((text.strip_suffix(suffix)?, *scale)))?;
    // Plain decimal (and exponent) notation only: no "inf", "NaN", hex or leading '+' games.
    let plain = number
        .chars()
        .all(|c| c.is_ascii_digit() || matches!(c, '.' | '-' | '+' | 'e' | 'E'));
    let parsed: f64 = number.parse().ok().filter(|_| plain)?;
    Some(parsed * scale).filter(|n| n.is_finite())
}

#[cfg(test)]
thread_local! {
    /// How many times [`Conditions::prepare`] ran on this thread, for tests that count it.
    pub(crate) static PREPARED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// The values an `in` query selected, by [`value_key`]: a lookup per element, however many
/// values the query selected.
pub(crate) struct Prepared {
    sets: Vec<Option<HashSet<String>>>,
    /// How many values the `in` queries selected to build the sets: the work a rebuild costs.
    selected: usize,
}

impl Prepared {
    /// How many values the `in` queries selected to build these sets.
    pub(crate) fn selected(&self) -> usize {
        self.selected
    }
}

/// A text that two values share exactly when [`same_value`] holds for them (numbers by value,
/// object keys in order).
fn value_key(value: &Value) -> String {
    let mut key = String::new();
    write_key(value, &mut key);
    key
}

fn write_key(value: &Value, key: &mut String) {
    use std::fmt::Write as _;
    match value {
        Value::Number(n) => {
            let _ = match (n.as_i128(), n.as_f64()) {
                (Some(i), _) => write!(key, "n{i};"),
                (None, Some(f)) if f.fract() == 0.0 && f.abs() < 1e30 => {
                    write!(key, "n{};", f as i128)
                }
                (None, f) => write!(key, "n{f:?};"),
            };
        }
        Value::Array(items) => {
            key.push('[');
            for item in items {
                write_key(item, key);
            }
            key.push(']');
        }
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            key.push('{');
            for (k, v) in entries {
                key.push_str(&Value::String(k.clone()).to_string());
                write_key(v, key);
            }
            key.push('}');
        }
        other => {
            key.push_str(&other.to_string());
            key.push(';');
        }
    }
}

/// JSON equality with numbers compared by value, as JSONPath filters compare them: `60`,
/// `60.0` and `6e1` are the same number, whatever type YAML or JSON gave them.
pub(crate) fn same_value(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => match (x.as_i128(), y.as_i128()) {
            (Some(x), Some(y)) => x == y,
            _ => x.as_f64().zip(y.as_f64()).is_some_and(|(x, y)| x == y),
        },
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same_value(x, y))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| same_value(v, w)))
        }
        _ => a == b,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use serde_json::{Value, json};

    use super::{Conditions, same_value};
    use crate::error::Errors;
    use crate::limits::MAX_REGEX_BYTES;
    use crate::matching::MatchError;

    fn conditions(spec: Value) -> Conditions {
        let specs: Vec<crate::api::Condition> = serde_json::from_value(spec).unwrap();
        let mut errors = Errors::default();
        let compiled = Conditions::compile(&specs, MAX_REGEX_BYTES, &mut errors);
        assert!(errors.errors.is_empty(), "{:?}", errors.errors);
        compiled
    }

    /// A Pod-like object of about `bytes`, nested `depth` levels, full of strings.
    fn big_object(bytes: usize, depth: usize) -> Value {
        let mut leaf = json!({});
        for i in 0..bytes / 40 {
            leaf[format!("k{i}")] = json!("ab".repeat(16));
        }
        let mut object = leaf;
        for _ in 0..depth {
            object = json!({"a": object, "b": "x"});
        }
        json!({"metadata": {"name": "p"}, "spec": object})
    }

    #[test]
    fn an_in_set_over_every_node_is_refused_before_its_keys_are_built() {
        // Before: every node `$..*` selects became full canonical text, so a 61 KB Pod took
        // 415 MB offline (size × depth). Now the keys are measured first, within 1 MiB.
        let c = conditions(json!([{"path": "$.metadata.name", "in": "$..*"}]));
        let object = big_object(61 << 10, 60);
        let started = std::time::Instant::now();
        let error = c.hold(&object).unwrap_err();
        assert!(
            matches!(error, MatchError::InSetTooLarge { index: 0 }),
            "{error}"
        );
        assert!(
            error.to_string().starts_with("spec.conditions[0].in: "),
            "{error}"
        );
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
        // A set of a few names is fine.
        let names = conditions(json!([{"path": "$.metadata.name", "in": "$.spec..b"}]));
        assert!(!names.hold(&object).unwrap());
    }

    #[test]
    fn a_matches_condition_charges_all_its_searches_before_the_first() {
        let c = conditions(json!([{"path": "$..*", "matches": "a[ab]{20}c"}]));
        let error = c.hold(&big_object(1 << 20, 2)).unwrap_err();
        assert!(
            matches!(error, MatchError::ConditionSearch { index: 0, .. }),
            "{error}"
        );
        assert!(
            error
                .to_string()
                .starts_with("spec.conditions[0].matches: regular expression"),
            "{error}"
        );
        // A Pod's images are searched as before.
        let images = conditions(json!([{"path": "$.spec.b", "matches": "^x$"}]));
        assert!(images.hold(&big_object(1 << 20, 2)).unwrap());
    }

    #[test]
    fn numbers_are_equal_by_value() {
        assert!(same_value(&json!(60), &json!(60.0)));
        assert!(same_value(&json!(6e1), &json!(60)));
        assert!(same_value(&json!({"a": [1, 2.0]}), &json!({"a": [1.0, 2]})));
        assert!(!same_value(&json!(60), &json!(60.5)));
        assert!(!same_value(&json!(60), &json!("60")));
        assert!(!same_value(&json!(u64::MAX), &json!(-1)));
        assert!(!same_value(&json!({"a": 1}), &json!({"a": 1, "b": 2})));
        assert!(same_value(&json!(null), &json!(null)));
    }

    #[test]
    fn numbers_and_quantities() {
        use super::number_or_quantity as q;
        assert_eq!(q(&json!(3)), Some(3.0));
        assert_eq!(q(&json!("0.5")), Some(0.5));
        assert_eq!(q(&json!("512Mi")), Some(536_870_912.0));
        assert_eq!(q(&json!("250m")), Some(0.25));
        assert_eq!(q(&json!("1.5G")), Some(1.5e9));
        assert_eq!(q(&json!("1e3")), Some(1000.0));
        assert_eq!(q(&json!("2Ki")), Some(2048.0));
        for bad in [
            json!("inf"),
            json!("NaN"),
            json!("12Mib"),
            json!(""),
            json!(true),
            json!(null),
        ] {
            assert_eq!(q(&bad), None, "{bad}");
        }
    }

    #[test]
    fn value_keys_agree_with_same_value() {
        let values = [
            json!(60),
            json!(60.0),
            json!(6e1),
            json!(60.5),
            json!("60"),
            json!(null),
            json!(true),
            json!({"a": 1, "b": [2.0]}),
            json!({"b": [2], "a": 1.0}),
            json!([1, "x"]),
            json!(["x", 1]),
            json!(1u64 << 60),
            json!((1u64 << 60) as f64),
        ];
        for a in &values {
            for b in &values {
                assert_eq!(
                    super::value_key(a) == super::value_key(b),
                    same_value(a, b),
                    "{a} and {b}"
                );
            }
        }
    }
}
