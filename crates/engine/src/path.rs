//! The two path languages of a rule: RFC 6901 JSON pointers (where to change) and RFC 9535
//! JSONPath queries (what to select).

use jsonpath_rust::parser::errors::JsonPathError;
use jsonpath_rust::parser::model::JpQuery;
use jsonpath_rust::parser::parse_json_path;
use jsonpath_rust::query::js_path_process;
use std::borrow::Cow;

use serde_json::Value;

use super::limits::{
    MAX_DEPTH, MAX_QUERY_BYTES, MAX_QUERY_DESCENDANTS, MAX_QUERY_NESTING, MAX_RULE_QUERY_BYTES,
    QUERY_WORK_LIMIT, charge_query, count_nodes, human_bytes,
};
use super::limits::{RegexError, compile_regex};
use super::scan;

/// An RFC 6901 pointer, kept in its encoded text form (`/metadata/annotations/a~1b`), which
/// is canonical, so prefixes can be compared as text. The empty pointer is the whole document.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pointer {
    text: String,
}

impl Pointer {
    pub fn parse(text: &str) -> Result<Pointer, PointerError> {
        if text.is_empty() {
            return Ok(Pointer::root());
        }
        let Some(rest) = text.strip_prefix('/') else {
            return Err(PointerError::NoLeadingSlash {
                text: text.to_string(),
            });
        };
        let mut chars = rest.chars();
        while let Some(c) = chars.next() {
            if c == '~' && !matches!(chars.next(), Some('0' | '1')) {
                return Err(PointerError::BadEscape {
                    text: text.to_string(),
                });
            }
        }
        Ok(Pointer {
            text: text.to_string(),
        })
    }

    pub fn root() -> Pointer {
        Pointer {
            text: String::new(),
        }
    }

    pub fn from_tokens<'a>(tokens: impl IntoIterator<Item = &'a str>) -> Pointer {
        let mut text = String::new();
        for t in tokens {
            text.push('/');
            text.push_str(&escape(t));
        }
        Pointer { text }
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// How many tokens deep the pointer reaches (0 for the whole document).
    pub fn depth(&self) -> usize {
        self.text.bytes().filter(|b| *b == b'/').count()
    }

    /// The decoded tokens, each with the byte length of the pointer up to and including it.
    pub fn tokens(&self) -> Tokens<'_> {
        Tokens::of(&self.text)
    }

    /// The pointer made of the first `len` bytes of this one (a `tokens()` offset).
    pub fn prefix(&self, len: usize) -> Pointer {
        Pointer {
            text: self.text[..len].to_string(),
        }
    }

    /// `self` followed by `rest`.
    pub fn join(&self, rest: &Pointer) -> Pointer {
        let mut text = String::with_capacity(self.text.len() + rest.text.len());
        text.push_str(&self.text);
        text.push_str(&rest.text);
        Pointer { text }
    }

    /// `self` with one more token.
    pub fn child(&self, token: &str) -> Pointer {
        let escaped = escape(token);
        let mut text = String::with_capacity(self.text.len() + 1 + escaped.len());
        text.push_str(&self.text);
        text.push('/');
        text.push_str(&escaped);
        Pointer { text }
    }

    /// `self` with one more token, a list index.
    pub fn child_index(&self, index: usize) -> Pointer {
        let mut text = String::with_capacity(self.text.len() + 4);
        text.push_str(&self.text);
        text.push('/');
        push_index(&mut text, index);
        Pointer { text }
    }

    pub fn parent(&self) -> Option<Pointer> {
        let at = self.text.rfind('/')?;
        Some(Pointer {
            text: self.text[..at].to_string(),
        })
    }

    /// True when `self` is `other` or one of its ancestors.
    pub fn contains(&self, other: &Pointer) -> bool {
        let (mine, theirs) = (self.text.as_bytes(), other.text.as_bytes());
        let n = mine.len();
        // Most pointers compared share their first tokens (`/spec/containers/...`) and differ
        // at the end: the boundary and the last byte rule most of them out before the
        // comparison of the whole prefix.
        theirs.len() >= n
            && (theirs.len() == n || theirs[n] == b'/')
            && (n == 0 || theirs[n - 1] == mine[n - 1])
            && theirs.starts_with(mine)
    }

    /// A copy with room to [`Pointer::push`] a few tokens without growing.
    pub fn buffer(&self) -> Pointer {
        let mut text = String::with_capacity(self.text.len() + 64);
        text.push_str(&self.text);
        Pointer { text }
    }

    /// Appends a token in place (a pointer reused while walking a tree) and returns the
    /// length to [`Pointer::truncate`] back to.
    pub fn push(&mut self, token: &str) -> usize {
        let len = self.text.len();
        self.text.push('/');
        self.text.push_str(&escape(token));
        len
    }

    /// [`Pointer::push`] for a list index.
    pub fn push_index(&mut self, index: usize) -> usize {
        let len = self.text.len();
        self.text.push('/');
        push_index(&mut self.text, index);
        len
    }

    /// Cuts the pointer back to `len` bytes, a length [`Pointer::push`] returned.
    pub fn truncate(&mut self, len: usize) {
        self.text.truncate(len);
    }

    /// The part of `other` below `self` (which must contain it).
    pub fn relative(&self, other: &Pointer) -> Pointer {
        Pointer {
            text: other
                .text
                .get(self.text.len()..)
                .unwrap_or_default()
                .to_string(),
        }
    }

    /// True when the last token is `-` (the end of a list) or a list index: a missing parent
    /// of this pointer is then created as a list, not an object.
    pub fn names_list_slot(&self) -> bool {
        self.tokens()
            .last()
            .is_some_and(|(token, _)| names_list_slot(&token))
    }

    pub fn get<'a>(&self, doc: &'a Value) -> Option<&'a Value> {
        self.tokens().try_fold(doc, |v, (t, _)| step(v, &t))
    }

    pub fn get_mut<'a>(&self, doc: &'a mut Value) -> Option<&'a mut Value> {
        self.tokens().try_fold(doc, |v, (t, _)| step_mut(v, &t))
    }

    /// Puts `value` at the pointer (`None` removes it). The parent must exist; returns false
    /// when it does not.
    pub fn set(&self, doc: &mut Value, value: Option<Value>) -> bool {
        let Some(at) = self.text.rfind('/') else {
            if let Some(v) = value {
                *doc = v;
            }
            return true;
        };
        let last = unescape(&self.text[at + 1..]);
        let Some(parent) = (Pointer {
            text: self.text[..at].to_string(),
        })
        .get_mut(doc) else {
            return false;
        };
        match (parent, value) {
            (Value::Object(map), Some(v)) => {
                map.insert(last.into_owned(), v);
            }
            (Value::Object(map), None) => {
                map.remove(last.as_ref());
            }
            (Value::Array(items), Some(v)) => match parse_index(&last) {
                Some(i) if i < items.len() => items[i] = v,
                Some(i) if i == items.len() => items.push(v),
                _ => return false,
            },
            (Value::Array(items), None) => match parse_index(&last) {
                Some(i) if i < items.len() => {
                    items.remove(i);
                }
                _ => return false,
            },
            _ => return false,
        }
        true
    }

    /// The value at the pointer, creating missing containers on the way (and `leaf` at the
    /// end): a list where the next token is `-` or a list index ([`Pointer::names_list_slot`]),
    /// an object otherwise; in a list, `-` or the index one past the end is a new element. Fails where an existing value on the way is not a container that
    /// can hold the next step.
    pub fn get_or_create<'a>(
        &self,
        doc: &'a mut Value,
        leaf: impl FnOnce() -> Value,
    ) -> Result<&'a mut Value, PointerError> {
        let mut current = doc;
        let mut leaf = Some(leaf);
        let mut before = 0;
        let mut tokens = self.tokens().peekable();
        while let Some((token, end)) = tokens.next() {
            let next = tokens.peek().map(|(t, _)| t.as_ref());
            if current.is_null() {
                // A null on the way counts as missing: it becomes the container this token
                // needs (a list for `-` or an index), so a list token never becomes a key.
                *current = new_container(Some(&token));
            }
            current = match current {
                Value::Object(map) => map.entry(token.into_owned()).or_insert_with(|| match next {
                    None => leaf.take().map(|f| f()).unwrap_or(Value::Null),
                    Some(next) if names_list_slot(next) => Value::Array(Vec::new()),
                    Some(_) => Value::Object(Default::default()),
                }),
                Value::Array(items) => match parse_index(&token) {
                    Some(i) if i < items.len() => &mut items[i],
                    // A parent on the way that is one past the end (`-`, or the index of the
                    // next element) is created as the list's new element, so `add
                    // /spec/terms/0/expressions/-` works on an object without terms.
                    Some(i) if i == items.len() => {
                        items.push(match next {
                            None => leaf.take().map(|f| f()).unwrap_or(Value::Null),
                            Some(_) => new_container(next),
                        });
                        &mut items[i]
                    }
                    None if token == "-" => {
                        items.push(match next {
                            None => leaf.take().map(|f| f()).unwrap_or(Value::Null),
                            Some(_) => new_container(next),
                        });
                        let last = items.len() - 1;
                        &mut items[last]
                    }
                    _ => {
                        return Err(PointerError::NoListElement {
                            pointer: self.text.clone(),
                            token: token.into_owned(),
                            len: items.len(),
                        });
                    }
                },
                other => {
                    return Err(PointerError::CannotDescend {
                        pointer: self.text.clone(),
                        found: type_name(other),
                        at: self.text[..before].to_string(),
                    });
                }
            };
            before = end;
        }
        Ok(current)
    }
}

/// The value at an encoded pointer (one this module built), without allocating for plain
/// tokens.
pub fn lookup<'a>(doc: &'a Value, pointer: &str) -> Option<&'a Value> {
    if !pointer.is_empty() && !pointer.starts_with('/') {
        return None;
    }
    Tokens::of(pointer).try_fold(doc, |v, (t, _)| step(v, &t))
}

/// Looks up one pointer after another in the same document, starting each from the deepest
/// value the previous one reached on the way they share: the pointers of a patch come in runs
/// under the same parents (`/spec/containers/0/env/4`, `/spec/containers/0/volumeMounts/2`),
/// and every step down an object is a key search.
pub(crate) struct Resolver<'d> {
    doc: &'d Value,
    /// The last pointer looked up.
    text: String,
    /// The values found along it: (byte length of the pointer up to the step, value).
    steps: Vec<(usize, &'d Value)>,
}

impl<'d> Resolver<'d> {
    pub fn new(doc: &'d Value) -> Resolver<'d> {
        Resolver {
            doc,
            text: String::with_capacity(64),
            steps: Vec::with_capacity(8),
        }
    }

    /// The value at the encoded pointer `pointer`, as [`lookup`] finds it.
    pub fn get(&mut self, pointer: &str) -> Option<&'d Value> {
        if !pointer.is_empty() && !pointer.starts_with('/') {
            return None;
        }
        let shared = self
            .text
            .bytes()
            .zip(pointer.bytes())
            .take_while(|(a, b)| a == b)
            .count();
        let bytes = pointer.as_bytes();
        while let Some(&(end, _)) = self.steps.last() {
            if end <= shared && (end == bytes.len() || bytes.get(end) == Some(&b'/')) {
                break;
            }
            self.steps.pop();
        }
        let (start, mut current) = self.steps.last().copied().unwrap_or((0, self.doc));
        self.text.clear();
        self.text.push_str(pointer);
        for (token, end) in Tokens::of(pointer.get(start..).unwrap_or_default()) {
            current = step(current, &token)?;
            self.steps.push((start + end, current));
        }
        Some(current)
    }
}

/// The decoded tokens of an encoded pointer, each with the byte length of the pointer up to
/// and including it. One pass over the bytes finds both the end of a token and whether it
/// holds an escape: lookups on the admission path walk pointers all the time, and splitting
/// then searching each token for `~` cost a tenth of an admission.
pub struct Tokens<'a> {
    /// What is left after the `/` that starts the next token; `None` when done.
    rest: Option<&'a str>,
    offset: usize,
}

impl<'a> Tokens<'a> {
    fn of(text: &'a str) -> Tokens<'a> {
        Tokens {
            rest: text.strip_prefix('/'),
            offset: 0,
        }
    }
}

impl<'a> Iterator for Tokens<'a> {
    type Item = (Cow<'a, str>, usize);

    fn next(&mut self) -> Option<Self::Item> {
        let rest = self.rest?;
        let bytes = rest.as_bytes();
        // The first `/` or `~`: a token ends at a `/`, and only a `~` starts an escape.
        let (end, escaped) = match find_slash_or_tilde(bytes) {
            None => (bytes.len(), false),
            Some(at) if bytes.get(at) == Some(&b'/') => (at, false),
            Some(at) => {
                let after = bytes.get(at..).unwrap_or_default();
                let end = after
                    .iter()
                    .position(|&b| b == b'/')
                    .map_or(bytes.len(), |slash| at + slash);
                (end, true)
            }
        };
        let raw = &rest[..end];
        // `None` past the last token (there is no `/` at `end`).
        self.rest = rest.get(end + 1..);
        self.offset += 1 + end;
        let token = if escaped {
            unescape(raw)
        } else {
            Cow::Borrowed(raw)
        };
        Some((token, self.offset))
    }
}

/// Where the first `/` or `~` of `bytes` is, eight bytes at a time.
fn find_slash_or_tilde(bytes: &[u8]) -> Option<usize> {
    scan::first(
        bytes,
        |word| scan::equal(word, b'/') | scan::equal(word, b'~'),
        |b| b == b'/' || b == b'~',
    )
}

/// The token `raw` with `~1` and `~0` decoded. Byte by byte from the first `~`: a rule's
/// label and annotation keys (`example.com~1team`) are decoded on every walk to them, and
/// searching for each `~` as a `char` cost several times the decoding.
fn unescape(raw: &str) -> Cow<'_, str> {
    let bytes = raw.as_bytes();
    let Some(first) = bytes.iter().position(|&b| b == b'~') else {
        return raw.into();
    };
    let mut out = Vec::with_capacity(raw.len());
    out.extend_from_slice(bytes.get(..first).unwrap_or_default());
    let mut rest = bytes.get(first..).unwrap_or_default();
    while let Some((&b, after)) = rest.split_first() {
        rest = after;
        if b != b'~' {
            out.push(b);
            continue;
        }
        match after.first() {
            Some(b'1') => out.push(b'/'),
            Some(b'0') => out.push(b'~'),
            // parse() rejects anything else after a `~`; keep it as written rather than guess.
            Some(&other) => out.extend_from_slice(&[b'~', other]),
            None => out.push(b'~'),
        }
        rest = after.get(1..).unwrap_or_default();
    }
    // Only ASCII was put in place of ASCII, so the bytes are still UTF-8.
    String::from_utf8(out).map_or(Cow::Borrowed(raw), Cow::Owned)
}

pub(super) fn escape(token: &str) -> Cow<'_, str> {
    if find_slash_or_tilde(token.as_bytes()).is_none() {
        return token.into();
    }
    let mut out = String::with_capacity(token.len() + 2);
    for c in token.chars() {
        match c {
            '~' => out.push_str("~0"),
            '/' => out.push_str("~1"),
            c => out.push(c),
        }
    }
    out.into()
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

/// The container a missing parent is created as: a list where the token after it is `-` or
/// an index, an object otherwise.
fn new_container(next: Option<&str>) -> Value {
    match next {
        Some(next) if names_list_slot(next) => Value::Array(Vec::new()),
        _ => Value::Object(Default::default()),
    }
}

/// `-` or a list index: a token that only a list can hold when its container is created.
/// (A missing object that should get a key like `"0"` has to be added first.)
fn names_list_slot(token: &str) -> bool {
    token == "-" || parse_index(token).is_some()
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

/// A JSON pointer of a rule that is not one, or that cannot be followed in an object.
#[derive(Debug, thiserror::Error)]
pub enum PointerError {
    #[error("invalid JSON pointer {text}: it must be empty or start with '/'", text = crate::untrusted::InQuotes(.text))]
    NoLeadingSlash { text: String },
    #[error("invalid JSON pointer {text}: '~' must be followed by 0 or 1", text = crate::untrusted::InQuotes(.text))]
    BadEscape { text: String },
    #[error("{pointer}: no list element {token:?} (the list has {len})")]
    NoListElement {
        pointer: String,
        token: String,
        len: usize,
    },
    #[error("{pointer}: cannot descend into {found} at {at:?}")]
    CannotDescend {
        pointer: String,
        found: &'static str,
        at: String,
    },
}

/// A JSONPath query of a rule that is not valid, or that would do too much work on an object.
#[derive(Debug, thiserror::Error)]
pub enum QueryError {
    #[error("invalid JSONPath {text}: {problem}", text = crate::untrusted::InQuotes(.text))]
    Invalid {
        text: String,
        #[source]
        problem: QueryProblem,
    },
    #[error(
        "JSONPath {text} would visit more than {QUERY_WORK_LIMIT} nodes of this object (the query work limit); avoid descendant segments (..) on large objects", text = crate::untrusted::InQuotes(.text))]
    TooMuchWork { text: String },
    #[error(
        "a JSONPath of {bytes} bytes is too long: at most {MAX_QUERY_BYTES} are allowed (a query is parsed into a node per segment); select with a shorter path"
    )]
    TooLong { bytes: usize },
    #[error(
        "the rule's JSONPath queries come to more than {} together (the limit of one rule); split the rule into several",
        human_bytes(MAX_RULE_QUERY_BYTES)
    )]
    RuleQueriesTooLong,
}

/// What is wrong with an invalid JSONPath query.
#[derive(Debug, thiserror::Error)]
pub enum QueryProblem {
    #[error("it must start with '$'")]
    NoRoot,
    #[error(
        "brackets and parentheses nest {nesting} deep; at most {MAX_QUERY_NESTING} are allowed"
    )]
    TooNested { nesting: usize },
    #[error(
        "it has {descendants} descendant segments (..); at most {MAX_QUERY_DESCENDANTS} are allowed, since each can visit the whole object again"
    )]
    TooManyDescendants { descendants: usize },
    /// The parser's message on one line; the parser's own error is the source.
    #[error("{message}")]
    Syntax {
        message: String,
        source: Box<JsonPathError>,
    },
    #[error(
        "the pattern of {function}() must be a string literal ({function}(@.x, 'pattern')): a pattern taken from the object would be compiled at every admission"
    )]
    PatternNotLiteral { function: &'static str },
    #[error("in match() or search(): {0}")]
    FunctionRegex(#[source] Box<RegexError>),
}

/// A compiled RFC 9535 JSONPath query.
///
/// Queries made only of names, indices, wildcards and name unions (`$.spec.containers[*]`,
/// `$.spec['containers','initContainers'][*].image`, nearly every query a rule uses) are
/// walked directly; the others (filters, descendants, slices) are evaluated by
/// `jsonpath-rust`. A test holds both to the same results.
#[derive(Clone, Debug)]
pub struct Query {
    query: JpQuery,
    simple: Option<Vec<Step>>,
    /// A simple query's steps as the tokens of a pointer are written (names escaped), for
    /// [`Query::may_select_under`].
    written: Option<Vec<Written>>,
    /// The single names the query takes from the root before anything else (see
    /// [`Query::reads_under`]).
    reads: Option<Vec<String>>,
    text: String,
    /// Descendant segments (`..`): each can visit the whole object again.
    descendants: usize,
    /// Calls of `match()` and `search()`, which compile their pattern at every node they test.
    regex_functions: usize,
}

/// A step of a simple query as a pointer's token is written: one of these names (escaped),
/// or any token (an index or a wildcard).
#[derive(Clone, Debug)]
enum Written {
    Names(Vec<String>),
    Any,
}

/// The text after `name` when `text` starts with the whole token `name` (the written form of
/// one or more tokens, as in `/metadata`).
pub(super) fn after_token<'t>(text: &'t [u8], name: &[u8]) -> Option<&'t [u8]> {
    let tail = text.strip_prefix(name)?;
    matches!(tail.first(), None | Some(b'/')).then_some(tail)
}

#[derive(Clone, Debug, PartialEq)]
enum Step {
    Names(Vec<String>),
    Index(i64),
    Wildcard,
}

impl PartialEq for Query {
    fn eq(&self, other: &Query) -> bool {
        self.text == other.text
    }
}

impl Query {
    pub fn parse(text: &str) -> Result<Query, QueryError> {
        let invalid = |problem| QueryError::Invalid {
            text: text.to_string(),
            problem,
        };
        if !text.starts_with('$') {
            return Err(invalid(QueryProblem::NoRoot));
        }
        // Before anything is parsed: parsing takes about a kilobyte per segment, and what a
        // parsed query keeps a few hundred bytes.
        if text.len() > MAX_QUERY_BYTES {
            return Err(QueryError::TooLong { bytes: text.len() });
        }
        if !charge_query(text.len()) {
            return Err(QueryError::RuleQueriesTooLong);
        }
        let shape = shape(text);
        if shape.nesting > MAX_QUERY_NESTING {
            return Err(invalid(QueryProblem::TooNested {
                nesting: shape.nesting,
            }));
        }
        if shape.descendants > MAX_QUERY_DESCENDANTS {
            return Err(invalid(QueryProblem::TooManyDescendants {
                descendants: shape.descendants,
            }));
        }
        let query = parse_json_path(text).map_err(|source| {
            invalid(QueryProblem::Syntax {
                message: one_line(&source.to_string()),
                source: Box::new(source),
            })
        })?;
        let patterns = regex_function_patterns(text)
            .map_err(|function| invalid(QueryProblem::PatternNotLiteral { function }))?;
        for pattern in &patterns {
            compile_regex(pattern, REGEX_FUNCTION_BYTES)
                .map_err(|source| invalid(QueryProblem::FunctionRegex(Box::new(source))))?;
        }
        let simple = parse_simple(text);
        // A query that is not simple selects under the nodes its leading simple steps select
        // (its filters read from `@`, under them), unless it reads from the root again (`$`
        // anywhere after the first character, even in a string, counts).
        let leading = match &simple {
            Some(steps) => Some(steps.clone()),
            None if !text[1..].contains('$') => Some(leading_steps(text).0),
            None => None,
        };
        let written = leading.as_ref().map(|steps| {
            steps
                .iter()
                .map(|step| match step {
                    Step::Names(names) => {
                        Written::Names(names.iter().map(|name| escape(name).into_owned()).collect())
                    }
                    Step::Index(_) | Step::Wildcard => Written::Any,
                })
                .collect()
        });
        let reads = leading.as_ref().map(|steps| {
            steps
                .iter()
                .map_while(|step| match step {
                    Step::Names(names) if names.len() == 1 => names.first().cloned(),
                    _ => None,
                })
                .collect()
        });
        Ok(Query {
            query,
            simple,
            written,
            reads,
            text: text.to_string(),
            descendants: shape.descendants,
            regex_functions: patterns.len(),
        })
    }

    /// Refuses a query with descendant segments on an object so large that it would visit more
    /// than [`QUERY_WORK_LIMIT`] nodes (estimated before it runs: the library that evaluates such
    /// queries cannot be interrupted). Only the nodes under the names the query takes from the
    /// root count ([`Query::reads_under`]): `$.spec.containers[?match(@.image, 'x')]` visits
    /// the containers, whatever else the object holds. So the estimate, and the verdict, are
    /// the same on an object and on what the gate controller keeps of it.
    fn check_work(&self, doc: &Value) -> Result<(), QueryError> {
        if self.descendants == 0 && self.regex_functions == 0 {
            return Ok(());
        }
        let scope = match &self.reads {
            Some(names) => names.iter().try_fold(doc, |value, name| value.get(name)),
            None => Some(doc),
        };
        // Nothing under those names: the query selects nothing, at no cost.
        let Some(scope) = scope else {
            return Ok(());
        };
        let nodes = count_nodes(scope, QUERY_WORK_LIMIT);
        let mut per_node = if self.descendants > 1 {
            nodes.min(MAX_DEPTH)
        } else {
            1
        };
        if self.regex_functions > 0 {
            per_node = per_node.saturating_mul(REGEX_FUNCTION_COST);
        }
        if nodes.saturating_mul(per_node) > QUERY_WORK_LIMIT {
            return Err(QueryError::TooMuchWork {
                text: self.text.clone(),
            });
        }
        Ok(())
    }

    /// True for an RFC 9535 singular query (only single names and indices, such as
    /// `$.spec.containers[0].args`): it selects at most one value, whatever the object.
    pub fn is_singular(&self) -> bool {
        self.simple.as_ref().is_some_and(|steps| {
            steps.iter().all(|step| match step {
                Step::Names(names) => names.len() == 1,
                Step::Index(_) => true,
                Step::Wildcard => false,
            })
        })
    }

    /// The query as the rule wrote it.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// True when [`Query::select`] cannot fail on any object (it never refuses the work).
    pub fn cannot_fail(&self) -> bool {
        self.simple.is_some() || (self.descendants == 0 && self.regex_functions == 0)
    }

    /// The names (unescaped) the query takes one by one from the root before any other step:
    /// everything it reads of an object is under them (`["status", "conditions"]` for
    /// `$.status.conditions[?@.type == 'Ready'].status`). `None` when it may read anything
    /// (it reads from the root again, `$` inside a filter).
    pub fn reads_under(&self) -> Option<&[String]> {
        self.reads.as_deref()
    }

    /// Whether a change at `pointer` may change what the query selects. It cannot when the
    /// pointer leaves the query's leading simple steps at a name they do not take
    /// (`/spec/volumes` for `$.spec.containers[*].image`, or for
    /// `$.spec.containers[?@.name == 'app'].image`); a query that reads from the root again
    /// inside (`$` in a filter) may be changed by anything. Indices count as any element,
    /// since inserting into a list moves the elements after it.
    pub fn may_select_under(&self, pointer: &Pointer) -> bool {
        let Some(steps) = &self.written else {
            return true;
        };
        // The pointer's text is read as written: a pointer's escapes are valid (`~0`, `~1`),
        // so two tokens are equal exactly when their written forms are. This runs after
        // every change to an object, for every prefiltered path.
        let mut rest = pointer.as_str().as_bytes();
        for step in steps {
            let Some(after) = rest.strip_prefix(b"/") else {
                // The pointer ends above the values: they may be under it.
                return true;
            };
            rest = match step {
                Written::Names(names) => {
                    match names
                        .iter()
                        .find_map(|name| after_token(after, name.as_bytes()))
                    {
                        Some(tail) => tail,
                        None => return false,
                    }
                }
                Written::Any => {
                    let end = after.iter().position(|b| *b == b'/').unwrap_or(after.len());
                    after.get(end..).unwrap_or_default()
                }
            };
        }
        true
    }

    /// The selected values. Queries are validated at compile time, so an evaluation error
    /// (which the library reports for some type mismatches) selects nothing. Fails only when
    /// the query would do too much work (see `check_work`).
    pub fn select<'a>(&self, doc: &'a Value) -> Result<Vec<&'a Value>, QueryError> {
        if let Some(steps) = &self.simple {
            let mut out = Vec::new();
            walk_values(doc, steps, &mut |value| out.push(value));
            return Ok(out);
        }
        self.check_work(doc)?;
        Ok(js_path_process(&self.query, doc)
            .map(|found| found.into_iter().map(|r| r.val()).collect())
            .unwrap_or_default())
    }

    /// [`Query::select`], each selected value given to `emit` rather than collected.
    pub(crate) fn select_each<'a>(
        &self,
        doc: &'a Value,
        emit: &mut impl FnMut(&'a Value),
    ) -> Result<(), QueryError> {
        if let Some(steps) = &self.simple {
            walk_values(doc, steps, emit);
            return Ok(());
        }
        for value in self.select(doc)? {
            emit(value);
        }
        Ok(())
    }

    /// For a simple query, how many values it selects (without collecting them); `None`
    /// for any other query.
    pub(crate) fn count_simple(&self, doc: &Value) -> Option<usize> {
        let steps = self.simple.as_ref()?;
        let mut count = 0;
        walk_values(doc, steps, &mut |_| count += 1);
        Some(count)
    }

    /// For a simple query, calls `visit` with each selected value (to change) and its
    /// pointer, in the order of [`Query::locate`], stopping at the first error; `None` for any
    /// other query. The values a simple query selects are all at one depth, so none holds
    /// another: changing one inside cannot move or remove the next.
    pub(crate) fn visit_simple_mut<E>(
        &self,
        doc: &mut Value,
        visit: &mut impl FnMut(&mut Value, &Pointer) -> Result<(), E>,
    ) -> Option<Result<(), E>> {
        let steps = self.simple.as_ref()?;
        Some(walk_mut(doc, steps, &mut Pointer::root().buffer(), visit))
    }

    /// The pointers of the selected values, in document order.
    pub fn locate(&self, doc: &Value) -> Result<Vec<Pointer>, QueryError> {
        if let Some(steps) = &self.simple {
            let mut out = Vec::new();
            walk(doc, steps, &mut String::new(), &mut |_, path| {
                out.push(Pointer {
                    text: path.to_string(),
                })
            });
            return Ok(out);
        }
        self.check_work(doc)?;
        Ok(js_path_process(&self.query, doc)
            .map(|found| {
                found
                    .into_iter()
                    .filter_map(|r| normalized_to_pointer(&r.path()))
                    .collect()
            })
            .unwrap_or_default())
    }
}

/// The library compiles the pattern of `match()` and `search()` anew at every node it tests,
/// so the pattern must be a string literal that compiles to at most this many bytes (checked
/// when the rule is compiled)...
const REGEX_FUNCTION_BYTES: usize = 64 * 1024;

/// ...and each node such a query may test counts as this many in the query work limit.
const REGEX_FUNCTION_COST: usize = 1_000;

/// The pattern argument of every `match()` and `search()` call in `text`, unescaped. A pattern
/// that is not a string literal (one taken from the object, say) is refused: it would be
/// compiled at every admission with no limit. The error names the function.
fn regex_function_patterns(text: &str) -> Result<Vec<String>, &'static str> {
    let chars: Vec<char> = text.chars().collect();
    let mut patterns = Vec::new();
    let mut skip_to = 0;
    for i in unquoted(&chars, 0) {
        if i < skip_to {
            continue;
        }
        let word_start = i == 0 || !(chars[i - 1].is_alphanumeric() || chars[i - 1] == '_');
        let name = ["match", "search"].into_iter().find(|name| {
            word_start && chars[i..].iter().take(name.len()).copied().eq(name.chars())
        });
        let Some(name) = name else { continue };
        let mut j = i + name.len();
        while chars.get(j).is_some_and(|c| c.is_whitespace()) {
            j += 1;
        }
        if chars.get(j) == Some(&'(') {
            patterns.push(second_argument(&chars, j + 1).ok_or(name)?);
            skip_to = j;
        }
    }
    Ok(patterns)
}

/// The positions, from `start`, of the characters outside string literals ('…' and "…",
/// with backslash escapes): where a query's syntax is.
fn unquoted(chars: &[char], start: usize) -> impl Iterator<Item = usize> + '_ {
    let mut quote: Option<char> = None;
    let mut escaped = false;
    (start..chars.len()).filter(move |&i| {
        let c = chars[i];
        match quote {
            Some(_) if escaped => escaped = false,
            Some(_) if c == '\\' => escaped = true,
            Some(q) if c == q => quote = None,
            Some(_) => {}
            None if c == '\'' || c == '"' => quote = Some(c),
            None => return true,
        }
        false
    })
}

/// The second argument of a call whose arguments start at `start`, when it is a string
/// literal.
fn second_argument(chars: &[char], start: usize) -> Option<String> {
    let mut depth = 0usize;
    let mut comma = None;
    let mut end = None;
    for i in unquoted(chars, start) {
        match chars[i] {
            '(' | '[' => depth += 1,
            ')' | ']' if depth == 0 => {
                end = Some(i);
                break;
            }
            ')' | ']' => depth -= 1,
            ',' if depth == 0 && comma.is_none() => comma = Some(i),
            _ => {}
        }
    }
    let argument: String = chars[comma? + 1..end?].iter().collect();
    let argument = argument.trim();
    let q = argument
        .chars()
        .next()
        .filter(|q| *q == '\'' || *q == '"')?;
    let inner = argument.strip_prefix(q)?.strip_suffix(q)?;
    let mut out = String::new();
    let mut it = inner.chars();
    while let Some(c) = it.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match it.next()? {
            'b' => out.push('\u{0008}'),
            'f' => out.push('\u{000C}'),
            'n' => out.push('\n'),
            'r' => out.push('\r'),
            't' => out.push('\t'),
            'u' => {
                let hex: String = it.by_ref().take(4).collect();
                out.push(char::from_u32(u32::from_str_radix(&hex, 16).ok()?)?);
            }
            other => out.push(other),
        }
    }
    Some(out)
}

/// What makes a query expensive to parse or run, read from its text: the deepest nesting of
/// brackets and parentheses, and the descendant segments (`..`), outside string literals.
struct Shape {
    nesting: usize,
    descendants: usize,
}

fn shape(text: &str) -> Shape {
    let chars: Vec<char> = text.chars().collect();
    let mut shape = Shape {
        nesting: 0,
        descendants: 0,
    };
    let mut depth: usize = 0;
    let mut after_dot = false;
    for i in unquoted(&chars, 0) {
        match chars[i] {
            '[' | '(' => {
                depth += 1;
                shape.nesting = shape.nesting.max(depth);
            }
            ']' | ')' => depth = depth.saturating_sub(1),
            // `..` is one descendant segment; `...` is not two.
            '.' if after_dot && i > 0 && chars[i - 1] == '.' => {
                shape.descendants += 1;
                after_dot = false;
                continue;
            }
            _ => {}
        }
        after_dot = chars[i] == '.';
    }
    shape
}

/// [`walk`] for the values only: no pointers built (`select` needs none, and building them
/// cost more than the walk on the admission path).
fn walk_values<'a>(node: &'a Value, steps: &[Step], emit: &mut impl FnMut(&'a Value)) {
    let Some((step, rest)) = steps.split_first() else {
        emit(node);
        return;
    };
    match (step, node) {
        (Step::Names(names), Value::Object(map)) => {
            for name in names {
                if let Some(child) = map.get(name) {
                    walk_values(child, rest, emit);
                }
            }
        }
        (Step::Index(i), Value::Array(items)) => {
            let len = items.len() as i64;
            let at = if *i < 0 { len + i } else { *i };
            if let Some(child) = usize::try_from(at).ok().and_then(|at| items.get(at)) {
                walk_values(child, rest, emit);
            }
        }
        (Step::Wildcard, Value::Object(map)) => {
            for child in map.values() {
                walk_values(child, rest, emit);
            }
        }
        (Step::Wildcard, Value::Array(items)) => {
            for child in items {
                walk_values(child, rest, emit);
            }
        }
        _ => {}
    }
}

fn walk<'a>(
    node: &'a Value,
    steps: &[Step],
    path: &mut String,
    emit: &mut dyn FnMut(&'a Value, &str),
) {
    let Some((step, rest)) = steps.split_first() else {
        emit(node, path);
        return;
    };
    let mut visit = |child: &'a Value, token: Token, path: &mut String| {
        let len = path.len();
        path.push('/');
        match token {
            Token::Name(name) => path.push_str(&escape(name)),
            Token::Index(i) => push_index(path, i),
        }
        walk(child, rest, path, emit);
        path.truncate(len);
    };
    match (step, node) {
        (Step::Names(names), Value::Object(map)) => {
            for name in names {
                if let Some(child) = map.get(name) {
                    visit(child, Token::Name(name), path);
                }
            }
        }
        (Step::Index(i), Value::Array(items)) => {
            let len = items.len() as i64;
            let at = if *i < 0 { len + i } else { *i };
            if (0..len).contains(&at) {
                visit(&items[at as usize], Token::Index(at as usize), path);
            }
        }
        (Step::Wildcard, Value::Object(map)) => {
            for (key, child) in map {
                visit(child, Token::Name(key), path);
            }
        }
        (Step::Wildcard, Value::Array(items)) => {
            for (i, child) in items.iter().enumerate() {
                visit(child, Token::Index(i), path);
            }
        }
        _ => {}
    }
}

/// [`walk`] with each selected value lent out to change, its pointer built in one buffer.
fn walk_mut<E>(
    node: &mut Value,
    steps: &[Step],
    path: &mut Pointer,
    visit: &mut impl FnMut(&mut Value, &Pointer) -> Result<(), E>,
) -> Result<(), E> {
    let Some((step, rest)) = steps.split_first() else {
        return visit(node, path);
    };
    match (step, node) {
        (Step::Names(names), Value::Object(map)) => {
            for name in names {
                if let Some(child) = map.get_mut(name) {
                    let len = path.push(name);
                    let result = walk_mut(child, rest, path, visit);
                    path.truncate(len);
                    result?;
                }
            }
        }
        (Step::Index(i), Value::Array(items)) => {
            let len = items.len() as i64;
            let at = if *i < 0 { len + i } else { *i };
            if let Some(child) = usize::try_from(at).ok().and_then(|at| items.get_mut(at)) {
                let len = path.push_index(at as usize);
                let result = walk_mut(child, rest, path, visit);
                path.truncate(len);
                result?;
            }
        }
        (Step::Wildcard, Value::Object(map)) => {
            for (key, child) in map.iter_mut() {
                let len = path.push(key);
                let result = walk_mut(child, rest, path, visit);
                path.truncate(len);
                result?;
            }
        }
        (Step::Wildcard, Value::Array(items)) => {
            for (i, child) in items.iter_mut().enumerate() {
                let len = path.push_index(i);
                let result = walk_mut(child, rest, path, visit);
                path.truncate(len);
                result?;
            }
        }
        _ => {}
    }
    Ok(())
}

/// A step of a path being built: a key, or a list index (written without allocating).
enum Token<'a> {
    Name(&'a str),
    Index(usize),
}

/// Appends the decimal digits of `i` (`to_string` would allocate for every element walked).
pub(crate) fn push_index(path: &mut String, i: usize) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    let mut n = i;
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    for &d in &digits[at..] {
        path.push(char::from(d));
    }
}

/// Parses the simple subset: `.name`, `.*`, `[*]`, `[index]`, `['name', ...]`. Anything else
/// (or anything unusual inside it, such as escapes) is left to the full evaluator.
fn parse_simple(text: &str) -> Option<Vec<Step>> {
    match leading_steps(text) {
        (steps, true) => Some(steps),
        (_, false) => None,
    }
}

/// The simple steps a query starts with (names, indices, wildcards, name unions), and
/// whether they are all of it. Each step ends where the next segment begins.
fn leading_steps(text: &str) -> (Vec<Step>, bool) {
    let mut steps = Vec::new();
    let Some(mut rest) = text.strip_prefix('$') else {
        return (steps, false);
    };
    loop {
        // RFC 9535 allows blank space between segments.
        rest = rest.trim_start_matches([' ', '\t', '\n', '\r']);
        if rest.is_empty() {
            return (steps, true);
        }
        match simple_step(rest) {
            Some((step, after)) => {
                steps.push(step);
                rest = after;
            }
            None => return (steps, false),
        }
    }
}

/// The simple step at the start of `rest`, and the text after it.
fn simple_step(rest: &str) -> Option<(Step, &str)> {
    if let Some(after) = rest.strip_prefix(".*") {
        return Some((Step::Wildcard, after));
    }
    if let Some(after) = rest.strip_prefix('.') {
        let end = after
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(after.len());
        let name = &after[..end];
        let next = &after[end..];
        // The name must end where a segment may begin (`.café` is one name, not `caf`).
        if name.is_empty()
            || name.starts_with(|c: char| c.is_ascii_digit())
            || !(next.is_empty() || next.starts_with(['.', '[', ' ', '\t', '\n', '\r']))
        {
            return None;
        }
        return Some((Step::Names(vec![name.to_string()]), next));
    }
    let after = rest.strip_prefix('[')?;
    let end = after.find(']')?;
    let inner = after[..end].trim();
    let rest = &after[end + 1..];
    if inner == "*" {
        return Some((Step::Wildcard, rest));
    }
    if inner.starts_with(['\'', '"']) {
        let mut names = Vec::new();
        for part in inner.split(',') {
            let part = part.trim();
            let quote = part.chars().next()?;
            let name = part.strip_prefix(quote)?.strip_suffix(quote)?;
            if !matches!(quote, '\'' | '"')
                || name.contains(['\\', '\'', '"'])
                || name.chars().any(char::is_control)
            {
                return None;
            }
            names.push(name.to_string());
        }
        return Some((Step::Names(names), rest));
    }
    let digits = inner.strip_prefix('-').unwrap_or(inner);
    let canonical = digits == "0" && !inner.starts_with('-')
        || (!digits.starts_with('0') && !digits.is_empty());
    if !canonical || !digits.chars().all(|c| c.is_ascii_digit()) || digits.len() > 15 {
        return None;
    }
    Some((Step::Index(inner.parse().ok()?), rest))
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
    Some(Pointer::from_tokens(tokens.iter().map(String::as_str)))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
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
        let p = Pointer::from_tokens(["b/c", "d~e"]);
        assert_eq!(p.as_str(), "/b~1c/d~0e");
    }

    #[test]
    fn tokens_are_decoded_with_the_length_up_to_each() {
        let p = Pointer::parse("/a~1b/~0c//d").unwrap();
        let tokens: Vec<(String, usize)> = p.tokens().map(|(t, e)| (t.into_owned(), e)).collect();
        assert_eq!(
            tokens,
            [
                ("a/b".to_string(), 5),
                ("~c".to_string(), 9),
                (String::new(), 10),
                ("d".to_string(), 12)
            ]
        );
        assert_eq!(Pointer::root().tokens().count(), 0);
        assert_eq!(
            Pointer::parse("/").unwrap().tokens().collect::<Vec<_>>(),
            [(Cow::Borrowed(""), 1)]
        );
        let mut q = Pointer::parse("/x").unwrap();
        let len = q.push("y/~");
        let inner = q.push_index(12);
        assert_eq!(q.as_str(), "/x/y~1~0/12");
        q.truncate(inner);
        assert_eq!(q.as_str(), "/x/y~1~0");
        q.truncate(len);
        assert_eq!(q, Pointer::parse("/x").unwrap());
        assert_eq!(Pointer::root().child_index(0).as_str(), "/0");
        // `contains` on shared prefixes, boundaries and the root.
        let c = |a: &str, b: &str| {
            Pointer::parse(a)
                .unwrap()
                .contains(&Pointer::parse(b).unwrap())
        };
        assert!(c("/spec/containers", "/spec/containers/0/env"));
        assert!(c("/spec/containers", "/spec/containers"));
        assert!(c("", "/spec"));
        assert!(!c("/spec/containers", "/spec/containersX"));
        assert!(!c("/spec/containers", "/spec/container"));
        assert!(!c("/spec/volumes", "/spec/containers/0"));
        assert!(!c("/spec/a", "/spec/b/c"));
    }

    /// The decoding as first written: a byte at a time, then `~1` and `~0` by characters.
    fn tokens_one_byte_at_a_time(text: &str) -> Vec<(String, usize)> {
        let Some(mut rest) = text.strip_prefix('/') else {
            return Vec::new();
        };
        let mut out = Vec::new();
        let mut offset = 0;
        loop {
            let end = rest.find('/').unwrap_or(rest.len());
            let mut token = String::new();
            let mut chars = rest[..end].chars();
            while let Some(c) = chars.next() {
                if c != '~' {
                    token.push(c);
                    continue;
                }
                match chars.next() {
                    Some('1') => token.push('/'),
                    Some('0') => token.push('~'),
                    Some(other) => {
                        token.push('~');
                        token.push(other);
                    }
                    None => token.push('~'),
                }
            }
            offset += 1 + end;
            out.push((token, offset));
            match rest.get(end + 1..) {
                Some(next) => rest = next,
                None => return out,
            }
        }
    }

    #[test]
    fn tokens_read_eight_bytes_at_a_time_decode_as_one_at_a_time() {
        // Every place of a `/` and a `~` around the eight-byte boundaries, and text that is not
        // ASCII, escapes that parse() would refuse, and runs of them.
        let mut texts: Vec<String> = vec![
            "/metadata/annotations/example.com~1namespace".into(),
            "/~~1/~x~/é~1ü/~".into(),
            "/a~0~1~01/~10//".into(),
            "/abcdefgh/ijklmnopqrstuvwx~1yz/0123456789abcdef".into(),
        ];
        for len in 0..20 {
            for at in 0..len {
                for special in ['/', '~'] {
                    let mut token: Vec<char> = "abcdefghijklmnopqrst"[..len].chars().collect();
                    token[at] = special;
                    let token: String = token.into_iter().collect();
                    texts.push(format!("/{token}"));
                    texts.push(format!("/x/{token}/y"));
                    texts.push(format!("/{token}~1{token}"));
                }
            }
        }
        for text in &texts {
            let fast: Vec<(String, usize)> =
                Tokens::of(text).map(|(t, e)| (t.into_owned(), e)).collect();
            assert_eq!(fast, tokens_one_byte_at_a_time(text), "{text}");
        }
        assert_eq!(find_slash_or_tilde(b"abcdefghijklmnop"), None);
        assert_eq!(find_slash_or_tilde(b"abcdefgh~ijklmn/p"), Some(8));
        assert_eq!(find_slash_or_tilde(b"abcdefg/"), Some(7));
        assert_eq!(find_slash_or_tilde(b""), None);
    }

    #[test]
    fn the_resolver_finds_what_lookup_finds_in_any_order() {
        let doc = json!({
            "a": {"b": [10, {"c": 1, "d/e": {"f": 2}}], "bc": 3},
            "x~": {"": 4},
            "s": "text"
        });
        let pointers = [
            "/a/b/1/c",
            "/a/b/1/d~1e/f",
            "/a/b/0",
            "/a/bc",
            "/a/b",
            "/a/b/1/missing/c",
            "/a/b/1/c",
            "/a/b/2",
            "/a/b/01",
            "",
            "/x~0/",
            "/x~0",
            "/s/0",
            "/a",
            "no-slash",
            "/a/b/-",
            "/a/b/1/d~1e",
        ];
        let mut resolver = Resolver::new(&doc);
        for _ in 0..2 {
            for (i, p) in pointers.iter().enumerate() {
                assert_eq!(resolver.get(p), lookup(&doc, p), "{p} (after {i} others)");
            }
            for p in pointers.iter().rev() {
                assert_eq!(resolver.get(p), lookup(&doc, p), "{p}, backwards");
            }
        }
    }

    #[test]
    fn the_streaming_walk_visits_what_locate_finds() {
        let doc = json!({"spec": {
            "containers": [{"name": "a", "env": [{"name": "x"}]}, {"name": "b/c"}],
            "initContainers": [{"name": "i"}],
            "m": {"k~1": {"v": 1}, "k2": {"v": 2}}
        }});
        for text in [
            "$.spec.containers[*]",
            "$.spec['containers','initContainers'][*]",
            "$.spec.containers[-1]",
            "$.spec.containers[5]",
            "$.spec.containers[*].env[*]",
            "$.spec.m.*",
            "$.spec.m[*].v",
            "$.spec.missing[*]",
            "$",
        ] {
            let q = Query::parse(text).unwrap();
            let located: Vec<String> = q
                .locate(&doc)
                .unwrap()
                .iter()
                .map(|p| p.as_str().to_string())
                .collect();
            assert_eq!(q.count_simple(&doc), Some(located.len()), "{text}");
            let mut copy = doc.clone();
            let mut visited = Vec::new();
            let done = q.visit_simple_mut(&mut copy, &mut |value, at: &Pointer| {
                assert_eq!(Some(&*value), at.get(&doc), "{text} at {}", at.as_str());
                *value = json!("seen");
                visited.push(at.as_str().to_string());
                Ok::<(), ()>(())
            });
            assert_eq!(done, Some(Ok(())), "{text}");
            assert_eq!(visited, located, "{text}");
            for p in &located {
                assert_eq!(lookup(&copy, p), Some(&json!("seen")), "{text}: {p}");
            }
        }
        // The first error stops the walk.
        let q = Query::parse("$.spec.containers[*]").unwrap();
        let mut seen = 0;
        let result = q.visit_simple_mut(&mut doc.clone(), &mut |_, _: &Pointer| {
            seen += 1;
            Err("stop")
        });
        assert_eq!((result, seen), (Some(Err("stop")), 1));
        // A query outside the simple subset is left to `locate`.
        let filtered = Query::parse("$.spec.containers[?@.name == 'a']").unwrap();
        assert_eq!(filtered.count_simple(&doc), None);
        assert!(
            filtered
                .visit_simple_mut(&mut doc.clone(), &mut |_, _: &Pointer| Ok::<(), ()>(()))
                .is_none()
        );
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
            err.to_string(),
            "/spec/volumes: cannot descend into a string at \"/spec\""
        );
        // A missing container whose next token is `-` or an index is a list, and `-` (or
        // the index one past the end) on the way is its new element: never an object key.
        let mut doc = json!({"spec": {}});
        Pointer::parse("/spec/a/-/b")
            .unwrap()
            .get_or_create(&mut doc, || json!(1))
            .unwrap();
        assert_eq!(doc, json!({"spec": {"a": [{"b": 1}]}}));
        Pointer::parse("/spec/c/0/1/d")
            .unwrap()
            .get_or_create(&mut doc, || json!(2))
            .unwrap_err();
        Pointer::parse("/spec/c/0/0/d")
            .unwrap()
            .get_or_create(&mut doc, || json!(2))
            .unwrap();
        assert_eq!(doc["spec"]["c"], json!([[{"d": 2}]]));
        // A null on the way is missing too (fuzz, issue 36: `upsert /spec/tolerations/-` on
        // `tolerations: null` wrote `tolerations: {"-": [...]}`).
        let mut doc = json!({"spec": {"tolerations": null, "containers": null}});
        Pointer::parse("/spec/tolerations/-")
            .unwrap()
            .get_or_create(&mut doc, || json!([]))
            .unwrap();
        Pointer::parse("/spec/containers/0/env")
            .unwrap()
            .get_or_create(&mut doc, || json!([]))
            .unwrap();
        assert_eq!(
            doc,
            json!({"spec": {"tolerations": [[]], "containers": [{"env": []}]}})
        );
        assert!(
            Pointer::parse("/spec/tolerations/-")
                .unwrap()
                .names_list_slot()
        );
        assert!(
            Pointer::parse("/spec/initContainers/0")
                .unwrap()
                .names_list_slot()
        );
        assert!(!Pointer::parse("/spec/x/01").unwrap().names_list_slot());
        assert!(
            !Pointer::parse("/metadata/labels/team")
                .unwrap()
                .names_list_slot()
        );
    }

    #[test]
    fn a_change_under_a_path_is_told_from_its_text_as_from_its_decoded_tokens() {
        // The reference: every decoded token against its step, as before the text was read
        // directly.
        fn reference(query: &Query, pointer: &Pointer) -> bool {
            let Some(steps) = &query.simple else {
                return true;
            };
            pointer
                .tokens()
                .zip(steps)
                .all(|((token, _), step)| match step {
                    Step::Names(names) => names.iter().any(|name| *name == token),
                    Step::Index(_) | Step::Wildcard => true,
                })
        }
        let queries = [
            "$.spec.containers[*].image",
            "$.spec['containers','initContainers'][*].image",
            "$.spec.containers[0].image",
            "$.metadata.labels['a/b']",
            "$.metadata.labels['a~b']",
            "$.metadata.labels['~x']",
            "$..image",
        ];
        let pointers = [
            "",
            "/",
            "//",
            "/spec",
            "/spec/",
            "/spec/containers",
            "/spec/containers/0",
            "/spec/containers/0/image",
            "/spec/containers/0/image/x",
            "/spec/containers/0/env",
            "/spec/initContainers/3/image",
            "/spec/cont",
            "/spec/containersX/0/image",
            "/spec/volumes/1",
            "/metadata",
            "/metadata/labels",
            "/metadata/labels/a~1b",
            "/metadata/labels/a~0b",
            "/metadata/labels/~0x",
            "/metadata/labels/~1",
            "/metadata/labels/a",
            "/metadata/labels/a/b",
            "/spec/contain~0ers/0/image",
            "/spec/containers/0/ima~1ge",
            "/spec/containers/~1/image",
        ];
        for q in queries {
            let query = Query::parse(q).unwrap();
            for p in pointers {
                let pointer = Pointer::parse(p).unwrap();
                assert_eq!(
                    query.may_select_under(&pointer),
                    reference(&query, &pointer),
                    "{q} at {p}"
                );
            }
        }
        // And it tells them apart: a sibling is not under the path; an ancestor and a
        // descendant are.
        let query = Query::parse("$.spec.containers[*].image").unwrap();
        let under = |p: &str| query.may_select_under(&Pointer::parse(p).unwrap());
        assert!(!under("/spec/containers/0/env"));
        assert!(!under("/spec/containersX/0/image"));
        assert!(under("/spec"));
        assert!(under("/spec/containers/1/image/x"));
        // A query with filters, slices or descendants: by its leading simple steps.
        let filtered = Query::parse("$.spec.volumes[?@.hostPath].name").unwrap();
        let under = |p: &str| filtered.may_select_under(&Pointer::parse(p).unwrap());
        assert!(!under("/spec/containers/0/volumeMounts"));
        assert!(!under("/metadata/name"));
        assert!(under("/spec/volumes/1/hostPath"));
        assert!(under("/spec"));
        // Unless it reads from the root again, or its first step is not simple.
        for q in [
            "$.spec.volumes[?@.name == $.metadata.name].name",
            "$..name",
            "$[?@.x].name",
            "$.spec.café[*].name",
        ] {
            let query = Query::parse(q).unwrap();
            assert!(
                query.may_select_under(&Pointer::parse("/metadata/name").unwrap())
                    || q.contains("café"),
                "{q}"
            );
            assert!(
                query.may_select_under(&Pointer::parse("/spec/café/0").unwrap()),
                "{q}"
            );
        }
    }

    #[test]
    fn queries_select_and_locate() {
        let doc = json!({"spec": {"containers": [{"name": "a", "image": "x"}, {"name": "b'q", "image": "y"}]}});
        let q = Query::parse("$.spec.containers[*]").unwrap();
        assert_eq!(q.select(&doc).unwrap().len(), 2);
        let ptrs: Vec<String> = q
            .locate(&doc)
            .unwrap()
            .iter()
            .map(|p| p.as_str().to_string())
            .collect();
        assert_eq!(ptrs, vec!["/spec/containers/0", "/spec/containers/1"]);
        let q = Query::parse("$.spec.containers[?@.name == \"b'q\"].name").unwrap();
        assert_eq!(
            q.locate(&doc).unwrap()[0].as_str(),
            "/spec/containers/1/name"
        );
        assert!(Query::parse("$.spec[").is_err());
        assert!(Query::parse("spec.containers").is_err());
    }

    #[test]
    fn the_direct_walk_agrees_with_jsonpath_rust() {
        let docs = [
            json!({"spec": {"containers": [{"name": "a", "image": "x", "env": [{"name": "E"}]}, {"name": "b", "image": "y"}],
                            "initContainers": [{"name": "i", "image": "z"}], "n": null},
                   "metadata": {"labels": {"a-b": "1", "c": "2"}, "name": "p"}}),
            json!([1, [2, 3], {"a": {"b": [4, 5, 6]}}]),
            json!("scalar"),
        ];
        let queries = [
            "$",
            "$.spec",
            "$.spec.containers[*]",
            "$.spec.containers[*].image",
            "$.spec.containers[0].name",
            "$.spec.containers[-1]",
            "$.spec.containers[-3]",
            "$.spec.containers[7]",
            "$.spec['containers','initContainers'][*].image",
            "$.spec[\"containers\"][1]",
            "$.metadata.labels['a-b']",
            "$.metadata.labels.*",
            "$.metadata.*",
            "$[*]",
            "$[1][0]",
            "$[2].a.b[*]",
            "$.*.containers[*].env[*].name",
            "$.spec.n",
            "$['spec'] ['n']",
            "$.nope[*]",
            "$[ 'spec' , 'metadata' ].name",
        ];
        for q in queries {
            let query = Query::parse(q).unwrap();
            assert!(query.simple.is_some(), "{q} should take the direct walk");
            for doc in &docs {
                let slow: Vec<(String, Value)> = js_path_process(&query.query, doc)
                    .unwrap()
                    .into_iter()
                    .map(|r| {
                        let path = r.clone().path();
                        (
                            normalized_to_pointer(&path).unwrap().as_str().to_string(),
                            r.val().clone(),
                        )
                    })
                    .collect();
                let fast: Vec<(String, Value)> = query
                    .locate(doc)
                    .unwrap()
                    .into_iter()
                    .map(|p| (p.as_str().to_string(), p.get(doc).cloned().unwrap()))
                    .collect();
                assert_eq!(fast, slow, "{q} on {doc}");
                assert_eq!(
                    query
                        .select(doc)
                        .unwrap()
                        .into_iter()
                        .cloned()
                        .collect::<Vec<_>>(),
                    slow.into_iter().map(|(_, v)| v).collect::<Vec<_>>()
                );
            }
        }
        for q in [
            "$..name",
            "$.spec.containers[?search(@.image, '^nginx')]",
            "$.spec.containers[?@.name == 'a']",
            "$.spec.containers[0:1]",
            "$['a\\'b']",
            "$.spec.containers[01]",
        ] {
            if let Ok(query) = Query::parse(q) {
                assert!(query.simple.is_none(), "{q} is for the full evaluator");
            }
        }
    }

    #[test]
    fn regex_functions_need_a_small_literal_pattern() {
        let doc = json!({"spec": {"containers": [{"image": "nginx:1"}, {"image": "redis"}]}});
        let q = Query::parse("$.spec.containers[?search(@.image, '^ngi\\\\w')].image").unwrap();
        assert_eq!(q.select(&doc).unwrap(), vec![&json!("nginx:1")]);
        assert_eq!(
            regex_function_patterns("$[?match(@.a, \"x\\\\d+\") && search(@.b, 'y')]").unwrap(),
            vec!["x\\d+".to_string(), "y".to_string()]
        );
        let from_object = Query::parse("$..[?search(@.image, @.pattern)]")
            .unwrap_err()
            .to_string();
        assert!(
            from_object.contains("must be a string literal"),
            "{from_object}"
        );
        let big = Query::parse("$..[?search(@, '\\\\w{30}\\\\w{30}')]")
            .unwrap_err()
            .to_string();
        assert!(big.contains("is too large once compiled"), "{big}");
        // Names that merely contain the words are not calls.
        assert!(
            regex_function_patterns("$.matches.research")
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn the_shape_of_a_query_ignores_string_literals() {
        let count = |q: &str| (shape(q).descendants, shape(q).nesting);
        assert_eq!(count("$.a.b"), (0, 0));
        assert_eq!(count("$..a..b"), (2, 0));
        assert_eq!(count("$['..', \"a..b\"]..c"), (1, 1));
        assert_eq!(count("$[?@.a == 'it\\'s ..']..x"), (1, 1));
        assert_eq!(count("$[?(@[?(@.a)])]"), (0, 4));
    }

    #[test]
    fn normalized_paths_with_escapes() {
        let p = normalized_to_pointer("$['a\\'b']['c\\\\d'][3]['\\u000b']").unwrap();
        let tokens: Vec<String> = p.tokens().map(|(t, _)| t.into_owned()).collect();
        assert_eq!(tokens, ["a'b", "c\\d", "3", "\u{000b}"]);
    }

    #[test]
    fn a_querys_work_is_estimated_under_the_names_it_takes_from_the_root() {
        // Found by the fuzzer: the estimate counted the whole object, so a gate's condition
        // was refused on a Pod with a large field it never reads and held on what the gate
        // controller keeps of that Pod.
        let query = Query::parse("$.spec.containers[?match(@.image, 'nginx.*')]").unwrap();
        let wide: Vec<Value> = (0..20_000).map(|i| serde_json::json!({"a": [i]})).collect();
        let containers = serde_json::json!([{"name": "c", "image": "nginx:1"}]);
        let object = serde_json::json!({"spec": {"wide": wide, "containers": containers}});
        assert_eq!(query.select(&object).unwrap().len(), 1);
        // The same many nodes where it does read them: refused.
        let object = serde_json::json!({"spec": {"containers": wide}});
        assert!(matches!(
            query.select(&object),
            Err(QueryError::TooMuchWork { .. })
        ));
        // Nothing under its names: nothing selected, nothing refused.
        assert!(
            query
                .select(&serde_json::json!({"spec": []}))
                .unwrap()
                .is_empty()
        );
    }
}
