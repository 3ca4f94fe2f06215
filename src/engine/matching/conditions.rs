//! `conditions`: RFC 9535 JSONPath over the object's content, each with one test (`matches`,
//! `equals`, `exists` or `in`). All must hold. The same conditions, with paths from `@`,
//! choose the list elements a `remove` mutation takes away.

use std::collections::HashSet;

use regex::Regex;
use serde_json::Value;

use crate::api::{self, exactly_one_of_message};
use crate::engine::error::Errors;
use crate::engine::limits::compile_regex;
use crate::engine::path::{Query, QueryError};

use super::MatchError;

#[derive(Clone, Debug)]
enum Test {
    Matches(Regex),
    Equals(Value),
    Exists(bool),
    /// A query over the object: the condition holds when a value its path selects equals one
    /// of the values this selects.
    In(Query),
}

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
            let tests = [
                c.matches.is_some(),
                c.equals.is_some(),
                c.exists.is_some(),
                c.in_.is_some(),
            ];
            let set = tests.iter().filter(|x| **x).count();
            let test = match (&c.matches, &c.equals, c.exists, &c.in_) {
                _ if set != 1 => {
                    errors.push(
                        &at,
                        format!(
                            "{} (found {set})",
                            exactly_one_of_message(&["matches", "equals", "exists", "in"])
                        ),
                    );
                    None
                }
                (Some(re), _, _, _) => compile_regex(re, regex_limit)
                    .map(Test::Matches)
                    .map_err(|e| errors.push(format!("{at}.matches"), e))
                    .ok(),
                (_, Some(v), _, _) => Some(Test::Equals(v.clone())),
                (_, _, Some(b), _) => Some(Test::Exists(b)),
                (_, _, _, Some(q)) => Query::parse(q)
                    .map(Test::In)
                    .map_err(|e| errors.push(format!("{at}.in"), e))
                    .ok(),
                _ => None,
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

    /// True when some condition reads the object besides what its path selects (`in`).
    pub(crate) fn reads_object(&self) -> bool {
        self.0.iter().any(|c| matches!(c.test, Test::In(_)))
    }

    /// Whether every condition holds; an error names the condition whose query would do too
    /// much work on this object.
    pub(crate) fn hold(&self, object: &Value) -> Result<bool, MatchError> {
        self.hold_on(object, object)
    }

    /// [`Conditions::hold`] with paths over `value` (a list element) and `in` queries over
    /// `object`.
    pub(crate) fn hold_on(&self, value: &Value, object: &Value) -> Result<bool, MatchError> {
        self.hold_prepared(value, &self.prepare(object)?)
    }

    /// What the `in` queries select from `object`, looked up once for many elements.
    pub(crate) fn prepare(&self, object: &Value) -> Result<Prepared, MatchError> {
        let mut sets = Vec::with_capacity(self.0.len());
        for (index, c) in self.0.iter().enumerate() {
            sets.push(match &c.test {
                Test::In(query) => Some(
                    query
                        .select(object)
                        .map_err(|source| MatchError::Condition { index, source })?
                        .into_iter()
                        .map(value_key)
                        .collect(),
                ),
                _ => None,
            });
        }
        Ok(Prepared { sets })
    }

    /// Whether every condition holds for `value`, with the `in` sets of `prepared`.
    pub(crate) fn hold_prepared(
        &self,
        value: &Value,
        prepared: &Prepared,
    ) -> Result<bool, MatchError> {
        for (index, c) in self.0.iter().enumerate() {
            let set = prepared.sets.get(index).and_then(Option::as_ref);
            if !c
                .holds(value, set)
                .map_err(|source| MatchError::Condition { index, source })?
            {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

impl Condition {
    fn holds(&self, value: &Value, set: Option<&HashSet<String>>) -> Result<bool, QueryError> {
        let found = self.query.select(value)?;
        Ok(match &self.test {
            Test::Matches(re) => found
                .iter()
                .any(|v| v.as_str().is_some_and(|s| re.is_match(s))),
            Test::Equals(want) => found.iter().any(|v| same_value(v, want)),
            Test::Exists(want) => found.is_empty() != *want,
            Test::In(_) => set.is_some_and(|set| found.iter().any(|v| set.contains(&value_key(v)))),
        })
    }
}

/// The values an `in` query selected, by [`value_key`]: a lookup per element, however many
/// values the query selected.
pub(crate) struct Prepared {
    sets: Vec<Option<HashSet<String>>>,
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
mod tests {
    use serde_json::json;

    use super::same_value;

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
