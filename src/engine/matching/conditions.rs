//! `conditions`: RFC 9535 JSONPath over the object's content, each with one test (`matches`,
//! `equals` or `exists`). All must hold.

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
        let mut compiled = Vec::new();
        for (i, c) in conditions.iter().enumerate() {
            let at = format!("{field}[{i}]");
            let query = Query::parse(&c.path)
                .map_err(|e| errors.push(format!("{at}.path"), e))
                .ok();
            let set = [c.matches.is_some(), c.equals.is_some(), c.exists.is_some()]
                .iter()
                .filter(|x| **x)
                .count();
            let test = match (&c.matches, &c.equals, c.exists) {
                _ if set != 1 => {
                    errors.push(
                        &at,
                        format!(
                            "{} (found {set})",
                            exactly_one_of_message(&["matches", "equals", "exists"])
                        ),
                    );
                    None
                }
                (Some(re), _, _) => compile_regex(re, regex_limit)
                    .map(Test::Matches)
                    .map_err(|e| errors.push(format!("{at}.matches"), e))
                    .ok(),
                (_, Some(v), _) => Some(Test::Equals(v.clone())),
                (_, _, Some(b)) => Some(Test::Exists(b)),
                _ => None,
            };
            if let (Some(query), Some(test)) = (query, test) {
                compiled.push(Condition { query, test });
            }
        }
        Conditions(compiled)
    }

    /// Whether every condition holds; an error names the condition whose query would do too
    /// much work on this object.
    pub(crate) fn hold(&self, object: &Value) -> Result<bool, MatchError> {
        for (index, c) in self.0.iter().enumerate() {
            if !c
                .holds(object)
                .map_err(|source| MatchError::Condition { index, source })?
            {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

impl Condition {
    fn holds(&self, object: &Value) -> Result<bool, QueryError> {
        let found = self.query.select(object)?;
        Ok(match &self.test {
            Test::Matches(re) => found
                .iter()
                .any(|v| v.as_str().is_some_and(|s| re.is_match(s))),
            Test::Equals(want) => found.iter().any(|v| same_value(v, want)),
            Test::Exists(want) => found.is_empty() != *want,
        })
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
}
