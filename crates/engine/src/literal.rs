//! Literal JSON values of compiled rules, stored compactly.
//!
//! `serde_json::Value` keeps an object in a `BTreeMap`, whose every node has room for eleven
//! entries: `{"metadata": {"labels": {"team": "a"}}}` costs about 2 KB. `initium serve` keeps
//! every rule of the cluster compiled, and ten thousand rules must fit in tens of megabytes, so
//! the literal parts of mutations (merge patches, upsert values, patch values) are kept as
//! [`Lit`]: boxed slices, in the key order `Value` iterates (sorted), about 40 bytes an entry.
//! They become `Value`s only when a mutation writes them into an object.

use serde_json::{Map, Number, Value};

/// Objects of up to this many entries become a `Map` by inserting each entry; larger ones by
/// collecting them (linear in the entries, as they are already sorted).
const INSERT_UP_TO: usize = 6;

/// A JSON value, immutable and compact.
#[derive(Clone, Debug, PartialEq)]
pub enum Lit {
    Null,
    Bool(bool),
    Number(Number),
    String(Box<str>),
    Array(Box<[Lit]>),
    /// Entries in `Value`'s (sorted) key order, keys unique.
    Object(Box<[(Box<str>, Lit)]>),
}

impl Lit {
    pub fn from_value(value: &Value) -> Lit {
        match value {
            Value::Null => Lit::Null,
            Value::Bool(b) => Lit::Bool(*b),
            Value::Number(n) => Lit::Number(n.clone()),
            Value::String(s) => Lit::String(s.as_str().into()),
            Value::Array(items) => Lit::Array(items.iter().map(Lit::from_value).collect()),
            Value::Object(map) => Lit::Object(
                map.iter()
                    .map(|(k, v)| (k.as_str().into(), Lit::from_value(v)))
                    .collect(),
            ),
        }
    }

    pub fn to_value(&self) -> Value {
        match self {
            Lit::Null => Value::Null,
            Lit::Bool(b) => Value::Bool(*b),
            Lit::Number(n) => Value::Number(n.clone()),
            // `String::from`, not `to_string`: a `Box<str>` has no fast `ToString`, it goes
            // through the formatter.
            Lit::String(s) => Value::String(String::from(&**s)),
            Lit::Array(items) => Value::Array(items.iter().map(Lit::to_value).collect()),
            // A few entries are inserted one by one (each insert compares with the keys
            // before it); collecting would also buffer, sort and then build them.
            Lit::Object(entries) if entries.len() <= INSERT_UP_TO => {
                let mut map = Map::new();
                for (k, v) in entries {
                    map.insert(String::from(&**k), v.to_value());
                }
                Value::Object(map)
            }
            Lit::Object(entries) => Value::Object(
                entries
                    .iter()
                    .map(|(k, v)| (String::from(&**k), v.to_value()))
                    .collect::<Map<String, Value>>(),
            ),
        }
    }
}

impl PartialEq<Value> for Lit {
    fn eq(&self, other: &Value) -> bool {
        match (self, other) {
            (Lit::Null, Value::Null) => true,
            (Lit::Bool(a), Value::Bool(b)) => a == b,
            (Lit::Number(a), Value::Number(b)) => a == b,
            (Lit::String(a), Value::String(b)) => **a == **b,
            (Lit::Array(a), Value::Array(b)) => {
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x == y)
            }
            (Lit::Object(a), Value::Object(b)) => {
                a.len() == b.len()
                    && a.iter()
                        .all(|(k, v)| b.get(k.as_ref()).is_some_and(|other| v == other))
            }
            _ => false,
        }
    }
}

/// What an RFC 7396 merge patch is read through: a rendered `Value` or a compiled [`Lit`].
pub(crate) trait MergePatch {
    /// The entries, when the patch is an object.
    fn entries(&self) -> Option<impl Iterator<Item = (&str, &Self)>>;
    fn is_null(&self) -> bool;
    /// Equal to `value` (for a patch that is not an object).
    fn same_as(&self, value: &Value) -> bool;
    fn to_value(&self) -> Value;
}

impl MergePatch for Value {
    fn entries(&self) -> Option<impl Iterator<Item = (&str, &Self)>> {
        self.as_object()
            .map(|map| map.iter().map(|(k, v)| (k.as_str(), v)))
    }

    fn is_null(&self) -> bool {
        Value::is_null(self)
    }

    fn same_as(&self, value: &Value) -> bool {
        self == value
    }

    fn to_value(&self) -> Value {
        self.clone()
    }
}

impl MergePatch for Lit {
    fn entries(&self) -> Option<impl Iterator<Item = (&str, &Self)>> {
        match self {
            Lit::Object(entries) => Some(entries.iter().map(|(k, v)| (k.as_ref(), v))),
            _ => None,
        }
    }

    fn is_null(&self) -> bool {
        matches!(self, Lit::Null)
    }

    fn same_as(&self, value: &Value) -> bool {
        self == value
    }

    fn to_value(&self) -> Value {
        Lit::to_value(self)
    }
}

/// RFC 7396 JSON merge patch: `patch` merged into `target` (as `json_patch::merge` does).
pub(crate) fn merge<P: MergePatch>(target: &mut Value, patch: &P) {
    let Some(entries) = patch.entries() else {
        *target = patch.to_value();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let Value::Object(map) = target else {
        return;
    };
    for (key, value) in entries {
        if value.is_null() {
            map.remove(key);
        } else if let Some(existing) = map.get_mut(key) {
            // Looked up first: `entry` takes an owned key, an allocation per key merged.
            merge(existing, value);
        } else {
            merge(map.entry(key).or_insert(Value::Null), value);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn round_trips_and_compares_with_values() {
        let value = json!({"b": [1, 2.5, -3, "x", null, true], "a": {"c": {}}, "d": []});
        let lit = Lit::from_value(&value);
        assert_eq!(lit.to_value(), value);
        assert!(lit == value);
        assert!(lit != json!({"b": [1, 2.5, -3, "x", null, true], "a": {"c": {}}}));
        assert!(Lit::from_value(&json!(1)) != json!(1.0));
        assert!(Lit::from_value(&json!({"a": 1})) != json!({"b": 1}));
        // Past INSERT_UP_TO entries an object is collected rather than inserted into.
        let wide: Value = (0..INSERT_UP_TO + 3)
            .map(|i| (format!("k{i}"), json!({"v": i})))
            .collect::<Map<String, Value>>()
            .into();
        assert_eq!(Lit::from_value(&wide).to_value(), wide);
    }

    #[test]
    fn merges_like_json_patch_for_values_and_literals() {
        let cases = [
            (
                json!({"a": 1, "b": {"c": 2}}),
                json!({"b": {"c": null, "d": [1]}, "e": "x"}),
            ),
            (json!({"a": 1}), json!({"a": null})),
            (json!("text"), json!({"a": {"b": 1}})),
            (json!({"a": {"b": 1}}), json!("replaced")),
            (json!({"a": [1, 2]}), json!({"a": [3]})),
            (json!({"a": 1}), json!({})),
            (json!(null), json!({"a": null, "b": null})),
        ];
        for (target, patch) in cases {
            let mut want = target.clone();
            json_patch::merge(&mut want, &patch);
            let mut by_value = target.clone();
            merge(&mut by_value, &patch);
            assert_eq!(by_value, want, "{target} + {patch}");
            let mut by_literal = target.clone();
            merge(&mut by_literal, &Lit::from_value(&patch));
            assert_eq!(by_literal, want, "{target} + {patch}");
        }
    }

    #[test]
    fn is_smaller_than_a_value() {
        // The point of the type: a one-entry object is a boxed slice of one entry.
        assert_eq!(std::mem::size_of::<Lit>(), 24);
        assert_eq!(std::mem::size_of::<(Box<str>, Lit)>(), 40);
    }
}
