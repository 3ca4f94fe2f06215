//! CEL text for generated MutatingAdmissionPolicies: string literals, field access with the
//! presence tests that guard it, globs and label selectors. Everything that came from a rule
//! reaches the expression as a quoted string literal, never as expression text.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use serde_json::Value;

use super::NotCompiled;

/// A CEL string literal holding `text` exactly.
pub(super) fn quote(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 || c == '\u{7f}' => {
                out.push_str(&format!("\\u{:04x}", c as u32));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Words CEL reserves: a field with one of these names needs an escape that depends on the
/// kind's schema, so such paths are not compiled.
const RESERVED: &[&str] = &[
    "true",
    "false",
    "null",
    "in",
    "as",
    "break",
    "const",
    "continue",
    "else",
    "for",
    "function",
    "if",
    "import",
    "let",
    "loop",
    "package",
    "namespace",
    "return",
    "var",
    "void",
    "while",
];

fn is_identifier(segment: &str) -> bool {
    let mut chars = segment.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !segment.starts_with("__")
        && !RESERVED.contains(&segment)
}

/// A field path from `object` (`["metadata", "labels", "team"]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Path(pub(super) Vec<String>);

impl Path {
    pub(super) fn child(&self, key: &str) -> Path {
        let mut segments = self.0.clone();
        segments.push(key.to_string());
        Path(segments)
    }

    /// The RFC 6901 pointer.
    pub(super) fn pointer(&self) -> String {
        self.0
            .iter()
            .map(|s| format!("/{}", s.replace('~', "~0").replace('/', "~1")))
            .collect()
    }

    /// Whether the last segment can be read from CEL; `Err` names why not.
    pub(super) fn check(&self) -> Result<(), String> {
        for segment in &self.0 {
            if RESERVED.contains(&segment.as_str()) {
                return Err(format!(
                    "the field name {} is a CEL reserved word, escaped differently by each schema",
                    quote(segment)
                ));
            }
            if segment.starts_with("__") {
                return Err(format!(
                    "the field name {} starts with \"__\", which CEL escapes",
                    quote(segment)
                ));
            }
        }
        Ok(())
    }

    /// CEL that reads the value (valid only where [`Path::present`] holds).
    pub(super) fn access(&self) -> String {
        self.access_from("object")
    }

    /// [`Path::access`] from another variable than `object`.
    pub(super) fn access_from(&self, root: &str) -> String {
        let mut out = String::from(root);
        for segment in &self.0 {
            push_segment(&mut out, segment);
        }
        out
    }

    /// CEL that is true when every segment of the path is present.
    pub(super) fn present(&self) -> String {
        self.present_from("object")
    }

    /// [`Path::present`] from another variable than `object`.
    pub(super) fn present_from(&self, root: &str) -> String {
        let mut tests = Vec::with_capacity(self.0.len());
        let mut parent = String::from(root);
        for segment in &self.0 {
            tests.push(if is_identifier(segment) {
                format!("has({parent}.{segment})")
            } else {
                format!("{} in {parent}", quote(segment))
            });
            push_segment(&mut parent, segment);
        }
        if tests.is_empty() {
            "true".into()
        } else {
            tests.join(" && ")
        }
    }

    /// Whether `self` is `other` or lies under it, or the other way round.
    pub(super) fn related(&self, other: &Path) -> bool {
        let n = self.0.len().min(other.0.len());
        self.0[..n] == other.0[..n]
    }
}

fn push_segment(out: &mut String, segment: &str) {
    if is_identifier(segment) {
        out.push('.');
        out.push_str(segment);
    } else {
        out.push('[');
        out.push_str(&quote(segment));
        out.push(']');
    }
}

/// A JSON value as a CEL literal. Numbers must be integers: CEL's doubles come back as JSON
/// differently than initium writes them.
pub(super) fn literal(value: &Value) -> Result<String, String> {
    Ok(match value {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => match n.as_i64() {
            Some(i) => i.to_string(),
            None => {
                return Err(format!(
                    "the number {n} is not an integer; only integers are compiled"
                ));
            }
        },
        Value::String(s) => quote(s),
        Value::Array(items) => {
            let items: Result<Vec<String>, String> = items.iter().map(literal).collect();
            format!("[{}]", items?.join(", "))
        }
        Value::Object(map) => {
            let entries: Result<Vec<String>, String> = map
                .iter()
                .map(|(k, v)| Ok(format!("{}: {}", quote(k), literal(v)?)))
                .collect();
            format!("{{{}}}", entries?.join(", "))
        }
    })
}

/// CEL true when `subject` (a string expression) matches the shell glob (`*` any run, `?`
/// one character), as initium's globs do.
pub(super) fn glob(pattern: &str, subject: &str) -> String {
    if pattern == "*" {
        return "true".into();
    }
    let wild = |c: char| c == '*' || c == '?';
    if !pattern.contains(wild) {
        return format!("{subject} == {}", quote(pattern));
    }
    if let Some(prefix) = pattern.strip_suffix('*')
        && !prefix.contains(wild)
    {
        return format!("{subject}.startsWith({})", quote(prefix));
    }
    if let Some(suffix) = pattern.strip_prefix('*')
        && !suffix.contains(wild)
    {
        return format!("{subject}.endsWith({})", quote(suffix));
    }
    let mut regex = String::from("^");
    for c in pattern.chars() {
        match c {
            '*' => regex.push_str("(?s:.*)"),
            '?' => regex.push_str("(?s:.)"),
            c if c.is_ascii_alphanumeric() => regex.push(c),
            c if c.is_ascii() => {
                regex.push('\\');
                regex.push(c);
            }
            c => regex.push(c),
        }
    }
    regex.push('$');
    format!("{subject}.matches({})", quote(&regex))
}

/// CEL true when any of the globs matches.
pub(super) fn any_glob(patterns: &[String], subject: &str) -> String {
    let tests: Vec<String> = patterns.iter().map(|p| glob(p, subject)).collect();
    if tests.iter().any(|t| t == "true") {
        return "true".into();
    }
    format!("({})", tests.join(" || "))
}

/// CEL true when the labels at `map` (a path to a `map(string, string)` that may be absent)
/// satisfy the selector, with Kubernetes' semantics.
pub(super) fn selector(
    selector: &LabelSelector,
    map: &Path,
    field: &str,
) -> Result<String, NotCompiled> {
    let present = map.present();
    let labels = map.access();
    let has = |key: &str| format!("({present} && {} in {labels})", quote(key));
    let value = |key: &str| format!("{labels}[{}]", quote(key));
    let mut tests = Vec::new();
    for (key, wanted) in selector.match_labels.iter().flatten() {
        tests.push(format!(
            "({} && {} == {})",
            has(key),
            value(key),
            quote(wanted)
        ));
    }
    for (i, expression) in selector.match_expressions.iter().flatten().enumerate() {
        let key = &expression.key;
        let values: Vec<String> = expression
            .values
            .iter()
            .flatten()
            .map(|v| quote(v))
            .collect();
        let list = format!("[{}]", values.join(", "));
        tests.push(match expression.operator.as_str() {
            "In" => format!("({} && {} in {list})", has(key), value(key)),
            "NotIn" => format!("(!{} || !({} in {list}))", has(key), value(key)),
            "Exists" => has(key),
            "DoesNotExist" => format!("!{}", has(key)),
            other => {
                return Err(NotCompiled::new(
                    format!("{field}.matchExpressions[{i}].operator"),
                    format!(
                        "the operator {} is not a label selector operator",
                        quote(other)
                    ),
                ));
            }
        });
    }
    Ok(if tests.is_empty() {
        "true".into()
    } else {
        tests.join(" && ")
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn strings_are_quoted_so_nothing_escapes_the_literal() {
        assert_eq!(quote(r#"a"b\c"#), r#""a\"b\\c""#);
        assert_eq!(quote("x\ny\u{1}"), r#""x\ny\u0001""#);
        assert_eq!(quote("é"), "\"é\"");
    }

    #[test]
    fn paths_use_fields_for_identifiers_and_indexes_for_other_keys() {
        let path = Path(vec![
            "metadata".into(),
            "labels".into(),
            "app.kubernetes.io/name".into(),
        ]);
        assert_eq!(
            path.access(),
            r#"object.metadata.labels["app.kubernetes.io/name"]"#
        );
        assert_eq!(
            path.present(),
            r#"has(object.metadata) && has(object.metadata.labels) && "app.kubernetes.io/name" in object.metadata.labels"#
        );
        assert_eq!(path.pointer(), "/metadata/labels/app.kubernetes.io~1name");
        assert!(
            Path(vec!["metadata".into(), "namespace".into()])
                .check()
                .is_err()
        );
    }

    #[test]
    fn globs_become_the_cheapest_equal_test() {
        assert_eq!(glob("*", "n"), "true");
        assert_eq!(glob("web", "n"), r#"n == "web""#);
        assert_eq!(glob("debug-*", "n"), r#"n.startsWith("debug-")"#);
        assert_eq!(glob("*-canary", "n"), r#"n.endsWith("-canary")"#);
        assert_eq!(glob("a?.b*", "n"), r#"n.matches("^a(?s:.)\\.b(?s:.*)$")"#);
    }

    #[test]
    fn only_integers_become_literals() {
        assert_eq!(
            literal(&json!({"a": [1, "x", true, null]})).unwrap(),
            r#"{"a": [1, "x", true, null]}"#
        );
        assert!(literal(&json!(1.5)).is_err());
    }
}
