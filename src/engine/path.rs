//! The two path languages of a rule: RFC 6901 JSON pointers (where to change) and RFC 9535
//! JSONPath queries (what to select).

use jsonpath_rust::parser::model::JpQuery;
use jsonpath_rust::parser::parse_json_path;
use jsonpath_rust::query::js_path_process;
use serde_json::Value;

/// A parsed RFC 6901 pointer. The empty pointer is the whole document.
#[derive(Clone, Debug, PartialEq)]
pub struct Pointer {
    tokens: Vec<String>,
    text: String,
}

impl Pointer {
    pub fn parse(text: &str) -> Result<Pointer, String> {
        if text.is_empty() {
            return Ok(Pointer {
                tokens: Vec::new(),
                text: String::new(),
            });
        }
        let Some(rest) = text.strip_prefix('/') else {
            return Err(format!(
                "invalid JSON pointer {text:?}: it must be empty or start with '/'"
            ));
        };
        let mut tokens = Vec::new();
        for raw in rest.split('/') {
            let mut token = String::with_capacity(raw.len());
            let mut chars = raw.chars();
            while let Some(c) = chars.next() {
                if c == '~' {
                    match chars.next() {
                        Some('0') => token.push('~'),
                        Some('1') => token.push('/'),
                        _ => {
                            return Err(format!(
                                "invalid JSON pointer {text:?}: '~' must be followed by 0 or 1"
                            ));
                        }
                    }
                } else {
                    token.push(c);
                }
            }
            tokens.push(token);
        }
        Ok(Pointer {
            tokens,
            text: text.to_string(),
        })
    }

    pub fn from_tokens(tokens: Vec<String>) -> Pointer {
        let mut text = String::new();
        for t in &tokens {
            text.push('/');
            text.push_str(&t.replace('~', "~0").replace('/', "~1"));
        }
        Pointer { tokens, text }
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }

    pub fn tokens(&self) -> &[String] {
        &self.tokens
    }

    pub fn get<'a>(&self, doc: &'a Value) -> Option<&'a Value> {
        self.tokens.iter().try_fold(doc, |v, t| step(v, t))
    }

    pub fn get_mut<'a>(&self, doc: &'a mut Value) -> Option<&'a mut Value> {
        self.tokens.iter().try_fold(doc, |v, t| step_mut(v, t))
    }

    /// The value at the pointer, creating missing objects on the way (and `leaf` at the end).
    /// Fails where an existing value on the way is not a container that can hold the next step.
    pub fn get_or_create<'a>(
        &self,
        doc: &'a mut Value,
        leaf: impl FnOnce() -> Value,
    ) -> Result<&'a mut Value, String> {
        let mut current = doc;
        let last = self.tokens.len();
        let mut leaf = Some(leaf);
        for (i, token) in self.tokens.iter().enumerate() {
            if current.is_null() {
                *current = Value::Object(Default::default());
            }
            current = match current {
                Value::Object(map) => map.entry(token.clone()).or_insert_with(|| {
                    if i + 1 == last {
                        leaf.take().map(|f| f()).unwrap_or(Value::Null)
                    } else {
                        Value::Object(Default::default())
                    }
                }),
                Value::Array(items) => {
                    let at = self.index(token, items.len())?;
                    &mut items[at]
                }
                other => {
                    return Err(format!(
                        "{}: cannot descend into {} at {:?}",
                        self.text,
                        type_name(other),
                        Pointer::from_tokens(self.tokens[..i].to_vec()).text
                    ));
                }
            };
        }
        Ok(current)
    }

    fn index(&self, token: &str, len: usize) -> Result<usize, String> {
        match token.parse::<usize>() {
            Ok(i) if i < len && (token == "0" || !token.starts_with('0')) => Ok(i),
            _ => Err(format!(
                "{}: no list element {token:?} (the list has {len})",
                self.text
            )),
        }
    }
}

fn step<'a>(v: &'a Value, token: &str) -> Option<&'a Value> {
    match v {
        Value::Object(map) => map.get(token),
        Value::Array(items) => parse_index(token).and_then(|i| items.get(i)),
        _ => None,
    }
}

fn step_mut<'a>(v: &'a mut Value, token: &str) -> Option<&'a mut Value> {
    match v {
        Value::Object(map) => map.get_mut(token),
        Value::Array(items) => parse_index(token).and_then(|i| items.get_mut(i)),
        _ => None,
    }
}

fn parse_index(token: &str) -> Option<usize> {
    if token.len() > 1 && token.starts_with('0') {
        return None;
    }
    token.parse().ok()
}

/// What a value is, with its article: "a string", "an object".
pub fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// A compiled RFC 9535 JSONPath query.
#[derive(Clone, Debug)]
pub struct Query {
    query: JpQuery,
    text: String,
}

impl PartialEq for Query {
    fn eq(&self, other: &Query) -> bool {
        self.text == other.text
    }
}

impl Query {
    pub fn parse(text: &str) -> Result<Query, String> {
        if !text.starts_with('$') {
            return Err(format!("invalid JSONPath {text:?}: it must start with '$'"));
        }
        let query = parse_json_path(text)
            .map_err(|e| format!("invalid JSONPath {text:?}: {}", one_line(&e.to_string())))?;
        Ok(Query {
            query,
            text: text.to_string(),
        })
    }

    /// The selected values. Queries are validated at compile time, so an evaluation error
    /// (which the library reports for some type mismatches) selects nothing.
    pub fn select<'a>(&self, doc: &'a Value) -> Vec<&'a Value> {
        js_path_process(&self.query, doc)
            .map(|found| found.into_iter().map(|r| r.val()).collect())
            .unwrap_or_default()
    }

    /// The pointers of the selected values, in document order.
    pub fn locate(&self, doc: &Value) -> Vec<Pointer> {
        js_path_process(&self.query, doc)
            .map(|found| {
                found
                    .into_iter()
                    .filter_map(|r| normalized_to_pointer(&r.path()))
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// The parser draws errors over several lines (`--> 1:19`, the text, a caret, `= expected x`);
/// a rule error is one line: "expected x at column 19".
fn one_line(message: &str) -> String {
    let expected = message
        .lines()
        .rev()
        .find_map(|l| l.trim().strip_prefix("= "))
        .map(str::to_string);
    let column = message
        .lines()
        .find_map(|l| l.trim().strip_prefix("--> "))
        .and_then(|pos| pos.split(':').nth(1))
        .map(str::to_string);
    match (expected, column) {
        (Some(e), Some(c)) => format!("{e} at column {c}"),
        (Some(e), None) => e,
        _ => message.split_whitespace().collect::<Vec<_>>().join(" "),
    }
}

/// Converts an RFC 9535 normalized path (`$['spec']['containers'][0]`) to a pointer.
fn normalized_to_pointer(path: &str) -> Option<Pointer> {
    let mut chars = path.strip_prefix('$')?.chars().peekable();
    let mut tokens = Vec::new();
    while let Some(c) = chars.next() {
        if c != '[' {
            return None;
        }
        if chars.peek() == Some(&'\'') {
            chars.next();
            let mut name = String::new();
            loop {
                match chars.next()? {
                    '\'' => break,
                    '\\' => match chars.next()? {
                        'b' => name.push('\u{0008}'),
                        'f' => name.push('\u{000C}'),
                        'n' => name.push('\n'),
                        'r' => name.push('\r'),
                        't' => name.push('\t'),
                        'u' => {
                            let hex: String = (0..4).filter_map(|_| chars.next()).collect();
                            name.push(char::from_u32(u32::from_str_radix(&hex, 16).ok()?)?);
                        }
                        other => name.push(other),
                    },
                    other => name.push(other),
                }
            }
            tokens.push(name);
            if chars.next()? != ']' {
                return None;
            }
        } else {
            let mut index = String::new();
            loop {
                match chars.next()? {
                    ']' => break,
                    d => index.push(d),
                }
            }
            tokens.push(index);
        }
    }
    Some(Pointer::from_tokens(tokens))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn pointers() {
        let doc = json!({"a": {"b/c": [1, {"d~e": 2}]}});
        assert_eq!(
            Pointer::parse("/a/b~1c/1/d~0e").unwrap().get(&doc),
            Some(&json!(2))
        );
        assert_eq!(Pointer::parse("/a/b~1c/01").unwrap().get(&doc), None);
        assert_eq!(Pointer::parse("").unwrap().get(&doc), Some(&doc));
        assert!(Pointer::parse("a/b").is_err());
        assert!(Pointer::parse("/a~2").is_err());
        let p = Pointer::from_tokens(vec!["b/c".into(), "d~e".into()]);
        assert_eq!(p.as_str(), "/b~1c/d~0e");
    }

    #[test]
    fn get_or_create_makes_parents() {
        let mut doc = json!({"spec": {}});
        let list = Pointer::parse("/spec/volumes")
            .unwrap()
            .get_or_create(&mut doc, || json!([]))
            .unwrap();
        assert_eq!(list, &json!([]));
        let mut doc = json!({"spec": "x"});
        let err = Pointer::parse("/spec/volumes")
            .unwrap()
            .get_or_create(&mut doc, || json!([]))
            .unwrap_err();
        assert_eq!(
            err,
            "/spec/volumes: cannot descend into a string at \"/spec\""
        );
    }

    #[test]
    fn queries_select_and_locate() {
        let doc = json!({"spec": {"containers": [{"name": "a", "image": "x"}, {"name": "b'q", "image": "y"}]}});
        let q = Query::parse("$.spec.containers[*]").unwrap();
        assert_eq!(q.select(&doc).len(), 2);
        let ptrs: Vec<String> = q
            .locate(&doc)
            .iter()
            .map(|p| p.as_str().to_string())
            .collect();
        assert_eq!(ptrs, vec!["/spec/containers/0", "/spec/containers/1"]);
        let q = Query::parse("$.spec.containers[?@.name == \"b'q\"].name").unwrap();
        assert_eq!(q.locate(&doc)[0].as_str(), "/spec/containers/1/name");
        assert!(Query::parse("$.spec[").is_err());
        assert!(Query::parse("spec.containers").is_err());
    }

    #[test]
    fn normalized_paths_with_escapes() {
        let p = normalized_to_pointer("$['a\\'b']['c\\\\d'][3]['\\u000b']").unwrap();
        assert_eq!(
            p.tokens(),
            &[
                "a'b".to_string(),
                "c\\d".into(),
                "3".into(),
                "\u{000b}".into()
            ]
        );
    }
}
