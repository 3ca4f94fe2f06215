//! `{{ ... }}` templates in mutation values and in the keys of their objects. Between the
//! braces is one expression ([`parse`]): a JSONPath query — `$` is the object (as the rule
//! found it), `@` the current `forEach` element, `lookups.<name>` an object the rule looks up
//! (`spec.lookups`) — or a call of one of the [`functions`], whose arguments are expressions
//! again. A template that is the whole string keeps the value's
//! JSON type; inside a longer string, and in a key, the value must be a scalar.
//!
//! Values without templates stay compact literals, and a whole-string query is selected and
//! copied as before functions existed: those are the paths nearly every rule takes.

mod catalog;
mod eval;
mod functions;
mod image;
mod parse;

use serde_json::map::Entry;
use serde_json::{Map, Value};

use super::limits::{MAX_DEPTH, Meter, RegexError, Size, measure};
use super::literal::Lit;
use super::lookup::Found;
use super::path::{QueryError, type_name};
use super::stop::Stop;
use catalog::Function;
use eval::{Evaluator, Val};
use parse::{Expr, Options, Parser, QueryExpr, Root};

/// One template: its expression and its text between the braces (for messages).
#[derive(Clone, Debug)]
struct Tmpl {
    expr: Expr,
    source: String,
}

#[derive(Clone, Debug)]
enum Part {
    Text(String),
    Expr(Tmpl),
}

#[derive(Clone, Debug)]
enum Key {
    Literal(String),
    /// A key with templates: always rendered as text.
    Parts {
        parts: Vec<Part>,
        source: String,
    },
}

#[derive(Clone, Debug)]
enum Node {
    Literal(Lit),
    Whole(Tmpl),
    Parts(Vec<Part>),
    Array(Vec<Node>),
    Object(Vec<(Key, Node)>),
}

/// A mutation value with its templates compiled. Values without templates are kept as
/// compact literals ([`Lit`]) and rendered by building the `Value`.
#[derive(Clone, Debug)]
pub struct Template {
    node: Node,
    uses_element: bool,
    /// The value as written in the rule (templates count as their text): what writing a
    /// literal costs, and the fixed part of what writing a rendered one costs.
    size: Size,
}

/// What templates can refer to.
pub struct Scope<'a> {
    pub object: &'a Value,
    pub element: Option<&'a Value>,
    /// The rule's lookups, resolved for this object, in `spec.lookups` order.
    pub lookups: &'a [Found<'a>],
}

/// What the templates of a value may refer to and use where it is, besides `$`.
#[derive(Clone, Copy, Debug)]
pub struct Roots<'a> {
    /// `@`: inside `forEach` only.
    pub element: bool,
    /// `lookups.<name>`: the names of the rule's lookups, in `spec.lookups` order.
    pub lookups: &'a [String],
    /// What each regular expression of `replace()` may compile to (the rule's share).
    pub regex_limit: usize,
}

impl Template {
    /// Compiles every string in `value`, with no lookups. `element_allowed` is false outside
    /// `forEach`. Mutations compile through [`Template::compile_in`].
    #[cfg(test)]
    pub fn compile(value: &Value, element_allowed: bool) -> Result<Template, MisplacedTemplate> {
        let roots = Roots {
            element: element_allowed,
            lookups: &[],
            regex_limit: super::limits::MAX_REGEX_BYTES,
        };
        Template::compile_in(value, &roots)
    }

    /// Compiles every string in `value`, and every key with a template, whose templates may
    /// refer to `roots`.
    pub fn compile_in(value: &Value, roots: &Roots) -> Result<Template, MisplacedTemplate> {
        let options = Options {
            element_allowed: roots.element,
            regex_limit: Some(roots.regex_limit),
            lookups: Some(roots.lookups),
        };
        let mut uses_element = false;
        let node = compile_node(value, "", &options, &mut uses_element)?;
        Ok(Template {
            node,
            uses_element,
            size: measure(value, usize::MAX, usize::MAX),
        })
    }

    /// The size of the value as written in the rule.
    pub fn size(&self) -> Size {
        self.size
    }

    pub fn uses_element(&self) -> bool {
        self.uses_element
    }

    /// The literal value, when there is no template in it.
    pub fn literal(&self) -> Option<&Lit> {
        match &self.node {
            Node::Literal(v) => Some(v),
            _ => None,
        }
    }

    /// Renders the value. What the templates select is counted by `meter` before it is
    /// copied, and what functions build before it is built, so a template that copies the
    /// object into itself stops at the output limit instead of exhausting memory. The caller
    /// counts the fixed part ([`Template::size`]).
    pub fn render(&self, scope: &Scope, meter: &mut Meter) -> Result<Value, Stop> {
        render_node(&self.node, scope, meter, Nulls::Kept)
    }

    /// Renders a value that is written as it is (an `upsert` value, a `patch` value), where a
    /// template that renders `null` sets nothing, as in `defaults`: a member or list element
    /// whose template renders `null` is left out. A `null` written in the rule stays.
    pub fn render_written(&self, scope: &Scope, meter: &mut Meter) -> Result<Value, Stop> {
        render_node(&self.node, scope, meter, Nulls::LeftOut)
    }

    /// Renders, as `defaults` needs it, only the fields `current` (what the object has where
    /// the value goes) lacks: a template of a field the object keeps is not rendered, so it
    /// cannot fail the rule. A field whose template renders `null` is left out (a default
    /// of null sets nothing).
    pub fn render_missing(
        &self,
        scope: &Scope,
        current: Option<&Value>,
        meter: &mut Meter,
    ) -> Result<Value, Stop> {
        Ok(render_missing(&self.node, scope, current, meter)?
            .unwrap_or_else(|| Value::Object(Map::new())))
    }
}

fn render_missing(
    node: &Node,
    scope: &Scope,
    current: Option<&Value>,
    meter: &mut Meter,
) -> Result<Option<Value>, Stop> {
    let Node::Object(entries) = node else {
        let value = render_node(node, scope, meter, Nulls::LeftOut)?;
        return Ok((!value.is_null()).then_some(value));
    };
    let empty = Map::new();
    let have = match current {
        None | Some(Value::Null) => &empty,
        Some(Value::Object(have)) => have,
        // A list or scalar where the defaults have an object: it stays, nothing to render.
        Some(_) => return Ok(None),
    };
    let mut map = Map::new();
    for (k, n) in entries {
        let keys = match k {
            Key::Literal(k) => vec![k.clone()],
            Key::Parts { parts, .. } => render_keys(parts, scope, meter)?,
        };
        for key in keys {
            let kept = have.get(&key).filter(|v| !v.is_null());
            if kept.is_some_and(|v| !(v.is_object() && matches!(n, Node::Object(_)))) {
                // Kept as it is: nothing to render.
                continue;
            }
            if let Some(value) = render_missing(n, scope, kept, meter)?
                && let Entry::Vacant(slot) = map.entry(key)
            {
                slot.insert(value);
            }
        }
    }
    // Nothing to write below: not an empty object either.
    Ok((!map.is_empty() || entries.is_empty()).then_some(Value::Object(map)))
}

/// The regular expressions the `replace()` calls in the templates of `value` compile (its
/// strings and keys), counted without compiling them: each gets a share of what the rule's
/// regular expressions may use. A template that does not parse counts what parsed before it.
pub fn count_regexes(value: &Value) -> usize {
    let options = Options {
        element_allowed: true,
        regex_limit: None,
        lookups: None,
    };
    let count = |s: &str| {
        if !s.contains("{{") {
            return 0;
        }
        let mut parser = Parser::new(s, &options);
        let _ = parse_string(s, &mut parser);
        parser.regexes
    };
    let mut total = 0;
    let mut stack = vec![value];
    while let Some(v) = stack.pop() {
        match v {
            Value::String(s) => total += count(s),
            Value::Array(items) => stack.extend(items),
            Value::Object(map) => {
                for (k, v) in map {
                    total += count(k);
                    stack.push(v);
                }
            }
            _ => {}
        }
    }
    total
}

fn compile_node(
    value: &Value,
    at: &str,
    options: &Options,
    uses_element: &mut bool,
) -> Result<Node, MisplacedTemplate> {
    let misplaced = |at: &str| {
        let at = at.to_string();
        move |error: TemplateError| MisplacedTemplate { at, error }
    };
    let node = match value {
        Value::String(s) => compile_string(s, options, uses_element).map_err(misplaced(at))?,
        Value::Array(items) => {
            let nodes = items
                .iter()
                .enumerate()
                .map(|(i, v)| compile_node(v, &format!("{at}/{i}"), options, uses_element))
                .collect::<Result<Vec<_>, _>>()?;
            if nodes.iter().all(|n| matches!(n, Node::Literal(_))) {
                Node::Literal(Lit::from_value(value))
            } else {
                Node::Array(nodes)
            }
        }
        Value::Object(map) => {
            let mut entries = Vec::with_capacity(map.len());
            for (k, v) in map {
                let at = format!("{at}/{}", k.replace('~', "~0").replace('/', "~1"));
                let key = if k.contains("{{") {
                    let mut parser = Parser::new(k, options);
                    let parts = parse_string(k, &mut parser).map_err(misplaced(&at))?;
                    *uses_element |= parser.uses_element;
                    Key::Parts {
                        parts,
                        source: k.clone(),
                    }
                } else {
                    Key::Literal(k.clone())
                };
                entries.push((key, compile_node(v, &at, options, uses_element)?));
            }
            let literal = entries
                .iter()
                .all(|(k, n)| matches!((k, n), (Key::Literal(_), Node::Literal(_))));
            if literal {
                Node::Literal(Lit::from_value(value))
            } else {
                Node::Object(entries)
            }
        }
        other => Node::Literal(Lit::from_value(other)),
    };
    Ok(node)
}

fn compile_string(
    s: &str,
    options: &Options,
    uses_element: &mut bool,
) -> Result<Node, TemplateError> {
    if !s.contains("{{") {
        return Ok(Node::Literal(Lit::String(s.into())));
    }
    let mut parser = Parser::new(s, options);
    let mut parts = parse_string(s, &mut parser)?;
    *uses_element |= parser.uses_element;
    if let [Part::Expr(_)] = parts.as_slice()
        && let Some(Part::Expr(t)) = parts.pop()
    {
        return Ok(Node::Whole(t));
    }
    Ok(Node::Parts(parts))
}

/// The text and templates of `s`, in order.
fn parse_string(s: &str, parser: &mut Parser) -> Result<Vec<Part>, TemplateError> {
    let mut parts = Vec::new();
    let mut from = 0;
    while let Some(start) = s[from..].find("{{").map(|i| from + i) {
        if start > from {
            parts.push(Part::Text(s[from..start].to_string()));
        }
        let (expr, source, next) = parser.template(start + 2)?;
        parts.push(Part::Expr(Tmpl { expr, source }));
        from = next;
    }
    if from < s.len() {
        parts.push(Part::Text(s[from..].to_string()));
    }
    Ok(parts)
}

/// What [`render_node`] does with a template that renders `null` inside an object or list.
#[derive(Clone, Copy, PartialEq)]
enum Nulls {
    /// Written: a merge removes the member.
    Kept,
    /// Left out: the value is written as it is, and a templated `null` sets nothing.
    LeftOut,
}

fn render_node(node: &Node, scope: &Scope, meter: &mut Meter, nulls: Nulls) -> Result<Value, Stop> {
    Ok(match node {
        Node::Literal(v) => v.to_value(),
        Node::Whole(t) => match &t.expr {
            // The common case: the selected value, counted, then copied.
            Expr::Query(q) => {
                let selected = select_one(q, &t.source, scope)?;
                let size = measure(selected, meter.remaining(), MAX_DEPTH);
                meter.write(size.bytes)?;
                selected.clone()
            }
            expr => {
                let mut eval = Evaluator {
                    scope,
                    meter,
                    source: &t.source,
                };
                match eval.value(expr)? {
                    Val::Ref(v) => {
                        let size = measure(v, meter.remaining(), MAX_DEPTH);
                        meter.write(size.bytes)?;
                        v.clone()
                    }
                    Val::Own(v) => v,
                }
            }
        },
        Node::Parts(parts) => Value::String(render_parts(parts, scope, meter)?),
        Node::Array(items) => {
            // A list is written as it is, by a merge too (RFC 7396 replaces lists whole).
            let mut out = Vec::with_capacity(items.len());
            for n in items {
                let v = render_node(n, scope, meter, Nulls::LeftOut)?;
                if !(v.is_null() && matches!(n, Node::Whole(_))) {
                    out.push(v);
                }
            }
            Value::Array(out)
        }
        Node::Object(entries) => {
            let mut map = Map::new();
            for (k, n) in entries {
                let keys = match k {
                    Key::Literal(k) => vec![k.clone()],
                    Key::Parts { parts, .. } => render_keys(parts, scope, meter)?,
                };
                if keys.is_empty() {
                    // A key over a query that selected nothing: no entry.
                    continue;
                }
                let rendered = render_node(n, scope, meter, nulls)?;
                if nulls == Nulls::LeftOut && rendered.is_null() && matches!(n, Node::Whole(_)) {
                    continue;
                }
                if let (Node::Object(written), Value::Object(got)) = (n, &rendered)
                    && !written.is_empty()
                    && got.is_empty()
                {
                    // Every key below was a query that selected nothing: nothing to write
                    // here either (not an empty object the patch would create).
                    continue;
                }
                let mut value = Some(rendered);
                if keys.len() > 1
                    && let Some(v) = &value
                {
                    // Each further key writes the value again.
                    let size = measure(v, meter.remaining(), MAX_DEPTH).bytes;
                    meter.write(size.saturating_mul(keys.len() - 1))?;
                }
                let count = keys.len();
                for (i, key) in keys.into_iter().enumerate() {
                    let v = if i + 1 == count {
                        value.take()
                    } else {
                        value.clone()
                    };
                    let Some(v) = v else { continue };
                    match map.entry(key) {
                        Entry::Vacant(slot) => {
                            slot.insert(v);
                        }
                        Entry::Occupied(taken) => {
                            let source = match k {
                                Key::Literal(k) | Key::Parts { source: k, .. } => k.clone(),
                            };
                            return Err(TemplateError::DuplicateKey {
                                written: source,
                                key: taken.key().clone(),
                            }
                            .into());
                        }
                    }
                }
            }
            Value::Object(map)
        }
    })
}

/// The keys a templated key renders to: one, or, when its only template is a query that can
/// select several values (`[*]`, a filter), one per selected value (none when it selects
/// none), so that one entry can be written for each container.
fn render_keys(parts: &[Part], scope: &Scope, meter: &mut Meter) -> Result<Vec<String>, Stop> {
    let exprs: Vec<&Tmpl> = parts
        .iter()
        .filter_map(|p| match p {
            Part::Expr(t) => Some(t),
            Part::Text(_) => None,
        })
        .collect();
    let [t] = exprs[..] else {
        return Ok(vec![render_parts(parts, scope, meter)?]);
    };
    let Expr::Query(q) = &t.expr else {
        return Ok(vec![render_parts(parts, scope, meter)?]);
    };
    if q.query.is_singular() {
        return Ok(vec![render_parts(parts, scope, meter)?]);
    }
    let (doc, _) = root(q.root, &t.source, scope)?;
    let found = q.query.select(doc).map_err(|error| TemplateError::Query {
        expr: t.source.clone(),
        source: error,
    })?;
    let mut keys = Vec::with_capacity(found.len());
    for value in found {
        let mut key = String::new();
        for part in parts {
            match part {
                Part::Text(text) => key.push_str(text),
                Part::Expr(_) => push_scalar(&mut key, value, &t.source)?,
            }
        }
        meter.write(key.len())?;
        keys.push(key);
    }
    Ok(keys)
}

/// Text and templates rendered into one string: each template's value must be a scalar.
fn render_parts(parts: &[Part], scope: &Scope, meter: &mut Meter) -> Result<String, Stop> {
    let mut out = String::new();
    for part in parts {
        let t = match part {
            Part::Text(text) => {
                out.push_str(text);
                continue;
            }
            Part::Expr(t) => t,
        };
        let value = match &t.expr {
            Expr::Query(q) => Val::Ref(select_one(q, &t.source, scope)?),
            expr => Evaluator {
                scope,
                meter,
                source: &t.source,
            }
            .value(expr)?,
        };
        if let (Value::String(s), Val::Ref(_)) = (value.get(), &value) {
            meter.write(s.len())?;
        }
        push_scalar(&mut out, value.get(), &t.source)?;
    }
    Ok(out)
}

/// Writes a template's value into a longer string: a scalar as its text, `null` as nothing.
fn push_scalar(out: &mut String, value: &Value, source: &str) -> Result<(), TemplateError> {
    match value {
        Value::String(s) => out.push_str(s),
        v @ (Value::Number(_) | Value::Bool(_)) => out.push_str(&v.to_string()),
        Value::Null => {}
        other => {
            return Err(TemplateError::NotScalar {
                expr: source.to_string(),
                found: type_name(other),
            });
        }
    }
    Ok(())
}

/// The one value a whole-template query selects.
fn select_one<'a>(
    q: &QueryExpr,
    source: &str,
    scope: &Scope<'a>,
) -> Result<&'a Value, TemplateError> {
    let (doc, looked_up) = root(q.root, source, scope)?;
    let found = q.query.select(doc).map_err(|error| TemplateError::Query {
        expr: source.to_string(),
        source: error,
    })?;
    match found.as_slice() {
        [one] => Ok(one),
        [] => Err(match looked_up {
            None => TemplateError::SelectedNothing {
                expr: source.to_string(),
            },
            Some(found) => TemplateError::LookupSelectedNothing {
                expr: source.to_string(),
                object: found.to_string(),
            },
        }),
        many => Err(TemplateError::SelectedMany {
            expr: source.to_string(),
            count: many.len(),
        }),
    }
}

/// What a query of `source` starts from, and the lookup when that is one.
fn root<'a, 's>(
    root: Root,
    source: &str,
    scope: &'s Scope<'a>,
) -> Result<(&'a Value, Option<&'s Found<'a>>), TemplateError> {
    Ok(match root {
        Root::Object => (scope.object, None),
        Root::Element => {
            let element = scope.element.ok_or_else(|| TemplateError::ElementGone {
                expr: source.to_string(),
            })?;
            (element, None)
        }
        Root::Lookup(i) => {
            let found = scope
                .lookups
                .get(i)
                .ok_or_else(|| TemplateError::LookupNotResolved {
                    expr: source.to_string(),
                })?;
            (found.value, Some(found))
        }
    })
}

/// A template that does not compile, or that cannot be rendered for this object. `expr` is the
/// template as written between the braces.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("template in {text} has no closing }}}}", text = crate::untrusted::InQuotes(.text))]
    Unclosed { text: String },
    #[error("template {{{{ {expr} }}}}: @ (the current element) is only available inside forEach", expr = crate::untrusted::Quoted(.expr))]
    ElementOutsideForEach { expr: String },
    #[error(
        "template {{{{ {expr} }}}}: a JSONPath must start with $ (the object), @ (the forEach element) or lookups.<name> (a lookup of the rule); a function is called as name(arguments), like lower($.metadata.name)", expr = crate::untrusted::Quoted(.expr))]
    NoRoot { expr: String },
    #[error(
        "template {{{{ {expr} }}}}: name a lookup of the rule, as in {{{{ lookups.<name>.data.<key> }}}}", expr = crate::untrusted::Quoted(.expr))]
    NoLookupName { expr: String },
    #[error("template {{{{ {expr} }}}}: the rule has no lookup named {name:?} ({})", known_lookups(.known), expr = crate::untrusted::Quoted(.expr))]
    UnknownLookup {
        expr: String,
        name: String,
        known: Vec<String>,
    },
    #[error(
        "template {{{{ {expr} }}}} selected nothing in {object}: add what it selects to {object}, or change the template", expr = crate::untrusted::Quoted(.expr))]
    LookupSelectedNothing { expr: String, object: String },
    /// A lookup template rendered without its lookup resolved: a bug.
    #[error("template {{{{ {expr} }}}}: its lookup was not read before the rule ran", expr = crate::untrusted::Quoted(.expr))]
    LookupNotResolved { expr: String },
    #[error("template {{{{ {expr} }}}}: {problem}", expr = crate::untrusted::Quoted(.expr))]
    Syntax { expr: String, problem: String },
    #[error("template {{{{ {expr} }}}}: {source}", expr = crate::untrusted::Quoted(.expr))]
    Query { expr: String, source: QueryError },
    #[error(
        "template {{{{ {expr} }}}}: there is no function {name}(); the functions are {}",
        Function::list(), expr = crate::untrusted::Quoted(.expr))]
    UnknownFunction { expr: String, name: String },
    #[error(
        "template {{{{ {expr} }}}}: {function}() takes {takes} argument{}, as in {signature}; it was given {found}",
        if *.takes == 1 { "" } else { "s" }, expr = crate::untrusted::Quoted(.expr))]
    Arity {
        expr: String,
        function: &'static str,
        signature: &'static str,
        takes: usize,
        found: usize,
    },
    #[error(
        "template {{{{ {expr} }}}}: function calls nest more than {} deep (the limit); split the work over several mutations",
        super::limits::MAX_CALL_NESTING, expr = crate::untrusted::Quoted(.expr))]
    CallsTooNested { expr: String },
    #[error(
        "template {{{{ {expr} }}}}: the regular expression of replace() must be a quoted string, replace(s, '^a(.*)$', 'b$1'), so that it is compiled once with the rule", expr = crate::untrusted::Quoted(.expr))]
    ReplaceNotLiteral { expr: String },
    #[error("template {{{{ {expr} }}}}: replace(): {source}", expr = crate::untrusted::Quoted(.expr))]
    ReplacePattern { expr: String, source: RegexError },
    #[error(
        "template {{{{ {expr} }}}}: the forEach element no longer exists: an earlier step of this forEach removed or replaced it", expr = crate::untrusted::Quoted(.expr))]
    ElementGone { expr: String },
    #[error("template {{{{ {expr} }}}} selected nothing", expr = crate::untrusted::Quoted(.expr))]
    SelectedNothing { expr: String },
    #[error("template {{{{ {expr} }}}} selected {count} values; use a path that selects one", expr = crate::untrusted::Quoted(.expr))]
    SelectedMany { expr: String, count: usize },
    #[error(
        "template {{{{ {expr} }}}}: {what} selected nothing; default({what}, fallback) gives a value for when it is missing", expr = crate::untrusted::Quoted(.expr))]
    Nothing { expr: String, what: String },
    #[error(
        "template {{{{ {expr} }}}}: {query} selected {count} values; {taker}: use a path that selects one", expr = crate::untrusted::Quoted(.expr))]
    SelectedManyInside {
        expr: String,
        query: String,
        count: usize,
        taker: String,
    },
    #[error("template {{{{ {expr} }}}}: {function}(): {problem}", expr = crate::untrusted::Quoted(.expr))]
    Function {
        expr: String,
        function: &'static str,
        problem: String,
    },
    #[error(
        "template {{{{ {expr} }}}} selected {found}; inside a longer string only strings, numbers and booleans fit", expr = crate::untrusted::Quoted(.expr))]
    NotScalar { expr: String, found: &'static str },
    #[error(
        "the key {written:?} renders to {key:?}, which another key of the same object has too; keys must render to different strings"
    )]
    DuplicateKey { written: String, key: String },
}

/// What the rule's lookups are, for the message about an unknown one.
fn known_lookups(known: &[String]) -> String {
    if known.is_empty() {
        "it has no spec.lookups".to_string()
    } else {
        format!("spec.lookups has {}", known.join(", "))
    }
}

/// A template that does not compile, and where it is in the value: a JSON pointer, empty
/// for the value itself.
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct MisplacedTemplate {
    pub at: String,
    pub error: TemplateError,
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use serde_json::json;

    fn compile(value: Value, element_allowed: bool) -> Result<Template, MisplacedTemplate> {
        Template::compile(&value, element_allowed)
    }

    /// The compile error's message, with where in the value it is.
    fn compile_error(value: Value) -> String {
        let e = compile(value, true).unwrap_err();
        format!("{} {}", e.at, e.error)
    }

    fn render_with(
        value: Value,
        object: &Value,
        element: Option<&Value>,
        limits: &crate::Limits,
    ) -> Result<Value, String> {
        let mut meter = Meter::new(limits, None);
        compile(value, true)
            .map_err(|e| e.to_string())?
            .render(
                &Scope {
                    object,
                    element,
                    lookups: &[],
                },
                &mut meter,
            )
            .map_err(|e| e.to_string())
    }

    fn render(value: Value, object: &Value, element: Option<&Value>) -> Result<Value, String> {
        render_with(value, object, element, &crate::Limits::default())
    }

    #[test]
    fn whole_templates_keep_type_and_parts_make_strings() {
        let obj = json!({"metadata": {"namespace": "payments", "labels": {"a": "b"}}, "spec": {"replicas": 3}});
        assert_eq!(
            render(json!("{{ $.metadata.namespace }}"), &obj, None).unwrap(),
            json!("payments")
        );
        assert_eq!(
            render(json!("{{$.spec.replicas}}"), &obj, None).unwrap(),
            json!(3)
        );
        assert_eq!(
            render(json!("{{ $.metadata.labels }}"), &obj, None).unwrap(),
            json!({"a": "b"})
        );
        assert_eq!(
            render(
                json!({"team": "ns-{{ $.metadata.namespace }}-{{ $.spec.replicas }}"}),
                &obj,
                None
            )
            .unwrap(),
            json!({"team": "ns-payments-3"})
        );
        let el = json!({"name": "web"});
        assert_eq!(
            render(json!(["{{ @.name }}", 1]), &obj, Some(&el)).unwrap(),
            json!(["web", 1])
        );
    }

    #[test]
    fn template_errors_are_clear() {
        let obj = json!({"spec": {"containers": [{"name": "a"}, {"name": "b"}]}});
        assert_eq!(
            render(json!("{{ $.spec.containers[*].name }}"), &obj, None).unwrap_err(),
            "template {{ $.spec.containers[*].name }} selected 2 values; use a path that selects one"
        );
        assert_eq!(
            render(json!("{{ $.nope }}"), &obj, None).unwrap_err(),
            "template {{ $.nope }} selected nothing"
        );
        assert_eq!(
            render(json!("x-{{ $.spec }}"), &obj, None).unwrap_err(),
            "template {{ $.spec }} selected an object; inside a longer string only strings, numbers and booleans fit"
        );
        let misplaced = compile(json!({"a": ["{{ $.x"]}), false).unwrap_err();
        assert_eq!(
            (misplaced.at, misplaced.error.to_string()),
            (
                "/a/0".to_string(),
                "template in \"{{ $.x\" has no closing }}".to_string()
            )
        );
        assert!(
            compile(json!("{{ @.name }}"), false)
                .unwrap_err()
                .to_string()
                .contains("only available inside forEach")
        );
        assert!(
            compile(json!("{{ spec }}"), false)
                .unwrap_err()
                .to_string()
                .contains("must start with $")
        );
        assert!(
            compile(json!("{{ $.a[ }}"), false)
                .unwrap_err()
                .to_string()
                .contains("invalid JSONPath")
        );
    }

    #[test]
    fn literals_stay_literal() {
        let t = compile(json!({"a": [1, "x"], "b": null}), false).unwrap();
        assert_eq!(
            t.literal().map(Lit::to_value),
            Some(json!({"a": [1, "x"], "b": null}))
        );
    }

    fn pod() -> Value {
        json!({"metadata": {"name": "web-1", "namespace": "payments",
                            "labels": {"team": " Payments "},
                            "annotations": {"config": "{\"replicas\": 2, \"tags\": [\"a\", \"b\"]}"}},
               "spec": {"containers": [{"name": "app", "image": "nginx:1.25", "args": ["-v", "--x"]},
                                       {"name": "side", "image": "ghcr.io/org/side@sha256:0123456789abcdef0123456789abcdef"}]}})
    }

    /// Renders the whole-string template `t` against [`pod`], its first container as `@`.
    fn eval(t: &str) -> Result<Value, String> {
        let object = pod();
        let element = object["spec"]["containers"][0].clone();
        render(json!(t), &object, Some(&element))
    }

    #[test]
    fn calls_nest_take_literals_and_keep_the_type_of_what_they_return() {
        assert_eq!(eval("{{ upper(@.name) }}").unwrap(), json!("APP"));
        assert_eq!(
            eval("{{ split($.metadata.name, '-') }}").unwrap(),
            json!(["web", "1"])
        );
        assert_eq!(
            eval("{{split($.metadata.name,'-')[1]}}").unwrap(),
            json!("1")
        );
        assert_eq!(
            eval("{{ split($.metadata.name, '-')[-2] }}").unwrap(),
            json!("web")
        );
        assert_eq!(
            eval("x={{ lower(trim($.metadata.labels.team)) }}/{{ @.name }}").unwrap(),
            json!("x=payments/app")
        );
        assert_eq!(
            eval("{{ join( ',' , split( trimSuffix( $.metadata.name , '-1' ), 'e' ) ) }}").unwrap(),
            json!("w,b")
        );
        // Literals: numbers, booleans, null, quoted text with \' and \\; a backslash before
        // anything else stays (regular expressions read as written); "}}" inside quotes.
        assert_eq!(eval("{{ default($.nope, 3) }}").unwrap(), json!(3));
        assert_eq!(eval("{{ default($.nope, -1.5) }}").unwrap(), json!(-1.5));
        assert_eq!(eval("{{ default($.nope, true) }}").unwrap(), json!(true));
        assert_eq!(eval("{{ default($.nope, null) }}").unwrap(), json!(null));
        assert_eq!(
            eval(r"{{ default($.nope, 'it\'s \\ \d }}') }}").unwrap(),
            json!(r"it's \ \d }}")
        );
        assert_eq!(eval("a {{ '{{' }} b").unwrap(), json!("a {{ b"));
        // Picks from an object result, by name or quoted.
        assert_eq!(
            eval("{{ fromJson($.metadata.annotations.config).tags[1] }}").unwrap(),
            json!("b")
        );
        assert_eq!(
            eval("{{ fromJson($.metadata.annotations.config)['replicas'] }}").unwrap(),
            json!(2)
        );
        // A JSONPath argument may hold commas and parentheses inside brackets and quotes.
        assert_eq!(
            eval("{{ join('+', $.spec.containers[?(@.name == 'a,)' || @.name == 'app')].name) }}")
                .unwrap(),
            json!("app")
        );
    }

    #[test]
    fn each_function_does_what_the_docs_say() {
        let cases = [
            (
                "{{ join(', ', $.spec.containers[*].name) }}",
                json!("app, side"),
            ),
            ("{{ join(' ', @.args) }}", json!("-v --x")),
            ("{{ join('-', $.spec.containers[5:].name) }}", json!("")),
            ("{{ join('/', split('a.b.c', '.')) }}", json!("a/b/c")),
            ("{{ split('a,,b', ',') }}", json!(["a", "", "b"])),
            ("{{ lower('ÀB') }}", json!("àb")),
            ("{{ upper('straße') }}", json!("STRASSE")),
            ("{{ trim('  a b \n') }}", json!("a b")),
            ("{{ trimPrefix('v1.2', 'v') }}", json!("1.2")),
            ("{{ trimPrefix('1.2', 'v') }}", json!("1.2")),
            ("{{ trimSuffix('app.yaml', '.yaml') }}", json!("app")),
            (
                r"{{ replace(@.image, '^(\w+):(.*)$', 'mirror.local/$1:${2}') }}",
                json!("mirror.local/nginx:1.25"),
            ),
            ("{{ replace('aaa', 'b', 'c') }}", json!("aaa")),
            ("{{ default($.metadata.labels.tier, 'web') }}", json!("web")),
            (
                "{{ default($.metadata.labels.team, 'web') }}",
                json!(" Payments "),
            ),
            (
                "{{ default(lower($.metadata.labels.tier), 'none') }}",
                json!("none"),
            ),
            (
                "{{ default(fromJson('{\"a\": null}').a, 'was null') }}",
                json!("was null"),
            ),
            (
                "{{ default(fromJson('{}').a, 'no field') }}",
                json!("no field"),
            ),
            (
                "{{ base64Encode('hello, world') }}",
                json!("aGVsbG8sIHdvcmxk"),
            ),
            (
                "{{ base64Decode('aGVsbG8sIHdvcmxk') }}",
                json!("hello, world"),
            ),
            ("{{ base64Decode('aGk') }}", json!("hi")),
            (
                "{{ sha256('abc') }}",
                json!("ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"),
            ),
            ("{{ toJson(@.args) }}", json!("[\"-v\",\"--x\"]")),
            (
                "{{ toJson($.metadata.labels) }}",
                json!("{\"team\":\" Payments \"}"),
            ),
            (
                "{{ fromJson('[1, {\"a\": \"b\"}]') }}",
                json!([1, {"a": "b"}]),
            ),
            (
                "{{ image(@.image) }}",
                json!({"registry": "docker.io", "repository": "library/nginx", "name": "nginx", "tag": "1.25", "digest": ""}),
            ),
            (
                "{{ image($.spec.containers[1].image).digest }}",
                json!("sha256:0123456789abcdef0123456789abcdef"),
            ),
            (
                "{{ image($.spec.containers[1].image).registry }}/{{ image($.spec.containers[1].image).tag }}",
                json!("ghcr.io/"),
            ),
            ("{{ image('busybox').tag }}", json!("latest")),
        ];
        for (template, want) in cases {
            assert_eq!(eval(template), Ok(want), "{template}");
        }
    }

    #[test]
    fn compile_errors_name_the_function_and_say_what_to_do() {
        let unknown = compile_error(json!({"a": ["{{ lowercase($.x) }}"]}));
        assert_eq!(
            unknown,
            "/a/0 template {{ lowercase($.x) }}: there is no function lowercase(); the functions are base64Decode(s), base64Encode(s), default(value, fallback), fromJson(s), image(s), join(separator, list), lower(s), replace(s, 'regex', replacement), sha256(s), split(s, separator), toJson(value), trim(s), trimPrefix(s, prefix), trimSuffix(s, suffix), upper(s)"
        );
        assert_eq!(
            compile_error(json!("{{ join($.a) }}")),
            " template {{ join($.a) }}: join() takes 2 arguments, as in join(separator, list); it was given 1"
        );
        assert_eq!(
            compile_error(json!("{{ lower() }}")),
            " template {{ lower() }}: lower() takes 1 argument, as in lower(s); it was given 0"
        );
        let nested = format!("{{{{ {}$.a{} }}}}", "lower(".repeat(9), ")".repeat(9));
        assert!(
            compile_error(json!(nested)).contains("function calls nest more than 8 deep"),
            "{}",
            compile_error(json!(nested))
        );
        let eight = format!("{{{{ {}'A'{} }}}}", "lower(".repeat(8), ")".repeat(8));
        assert_eq!(eval(&eight), Ok(json!("a")));
        assert!(
            compile_error(json!("{{ replace($.a, $.b, 'x') }}"))
                .contains("the regular expression of replace() must be a quoted string")
        );
        assert!(
            compile_error(json!("{{ replace($.a, '(', 'x') }}"))
                .contains("replace(): invalid regular expression \"(\": unclosed group")
        );
        for (template, problem) in [
            (
                "{{ lower($.a }}",
                "expected , or ) after an argument of lower()",
            ),
            (
                "{{ lower($.a) x }}",
                "expected }} after the expression, found 'x'",
            ),
            ("{{ }}", "the template is empty"),
            ("{{ lower(\"a\") }}", "text is written in single quotes"),
            ("{{ lower('a) }}", "a quoted string has no closing '"),
            ("{{ image('a'). }}", "expected a field name after '.'"),
            (
                "{{ image('a')[x] }}",
                "expected a field name in quotes or a list index",
            ),
            ("{{ 1.2.3 }}", "\"1.2.3\" is not a number"),
        ] {
            let error = compile_error(json!(template));
            assert!(error.contains(problem), "{template}: {error}");
        }
        assert!(
            compile(json!("{{ lower(@.name) }}"), false)
                .unwrap_err()
                .to_string()
                .contains("only available inside forEach")
        );
        assert!(
            compile_error(json!("{{ lower($.a[) }}")).contains("invalid JSONPath"),
            "{}",
            compile_error(json!("{{ lower($.a[) }}"))
        );
    }

    #[test]
    fn render_errors_name_the_template_and_function() {
        let cases = [
            (
                "{{ lower($.spec) }}",
                "template {{ lower($.spec) }}: lower(): its argument must be a string, not an object",
            ),
            (
                "{{ lower($.nope) }}",
                "template {{ lower($.nope) }}: $.nope selected nothing; default($.nope, fallback) gives a value for when it is missing",
            ),
            (
                "{{ lower($.spec.containers[*].name) }}",
                "template {{ lower($.spec.containers[*].name) }}: $.spec.containers[*].name selected 2 values; lower() takes one value there: use a path that selects one",
            ),
            (
                "{{ join(',', $.spec) }}",
                "template {{ join(',', $.spec) }}: join(): it takes a list, not an object",
            ),
            (
                "{{ join(',', $.spec.containers) }}",
                "template {{ join(',', $.spec.containers) }}: join(): element 0 of the list is an object; only strings, numbers and booleans are joined",
            ),
            (
                "{{ split('abc', '') }}",
                "template {{ split('abc', '') }}: split(): the separator is empty",
            ),
            (
                "{{ base64Decode('not base64!') }}",
                "template {{ base64Decode('not base64!') }}: base64Decode(): its argument is not valid base64 (Invalid symbol 32, offset 3.)",
            ),
            (
                "{{ base64Decode('/w==') }}",
                "template {{ base64Decode('/w==') }}: base64Decode(): the decoded bytes are not UTF-8 text, and only text can be written into a JSON string",
            ),
            (
                "{{ fromJson('{') }}",
                "template {{ fromJson('{') }}: fromJson(): its argument is not JSON (EOF while parsing an object at line 1 column 1)",
            ),
            (
                "{{ image('Nginx') }}",
                "template {{ image('Nginx') }}: image(): \"Nginx\" is not an image reference: the repository segment \"Nginx\" has upper-case letters; repositories are lower case",
            ),
            (
                "{{ image(@.image).nope }}",
                "template {{ image(@.image).nope }}: image(…).nope selected nothing; default(image(…).nope, fallback) gives a value for when it is missing",
            ),
            (
                "{{ split('a', ',')['x y'] }}",
                "template {{ split('a', ',')['x y'] }}: split(): ['x y'] picks from an object, but the result is a list",
            ),
            (
                "{{ split('a', ',')[1] }}",
                "template {{ split('a', ',')[1] }}: split(…)[1] selected nothing; default(split(…)[1], fallback) gives a value for when it is missing",
            ),
            (
                "{{ image(@.image)[0] }}",
                "template {{ image(@.image)[0] }}: image(): [0] picks from a list, but the result is an object",
            ),
            (
                "x{{ image(@.image) }}",
                "template {{ image(@.image) }} selected an object; inside a longer string only strings, numbers and booleans fit",
            ),
            (
                "{{ default($.spec.containers[*].name, 'x') }}",
                "template {{ default($.spec.containers[*].name, 'x') }}: $.spec.containers[*].name selected 2 values; default() takes one value there: use a path that selects one",
            ),
        ];
        for (template, want) in cases {
            assert_eq!(eval(template), Err(want.to_string()), "{template}");
        }
        let deep = format!("{}1{}", "[".repeat(101), "]".repeat(101));
        assert!(
            eval(&format!("{{{{ fromJson('{deep}') }}}}"))
                .unwrap_err()
                .contains("the JSON nests more than 100 levels deep (the depth limit)")
        );
    }

    #[test]
    fn keys_with_templates_are_rendered_and_must_stay_distinct() {
        let object = pod();
        let element = object["spec"]["containers"][0].clone();
        let value = json!({"metadata": {"annotations": {
            "container.apparmor.security.beta.kubernetes.io/{{ @.name }}": "runtime/default",
            "{{ upper(@.name) }}-{{ $.metadata.labels.team }}": 1,
            "n{{ $.spec.containers[0].args[0] }}": "{{ @.name }}"}}});
        assert_eq!(
            render(value.clone(), &object, Some(&element)).unwrap(),
            json!({"metadata": {"annotations": {
                "container.apparmor.security.beta.kubernetes.io/app": "runtime/default",
                "APP- Payments ": 1,
                "n-v": "app"}}})
        );
        let t = compile(value, true).unwrap();
        assert!(t.literal().is_none() && t.uses_element());
        assert_eq!(
            render(
                json!({"{{ @.name }}": 1, "app": 2}),
                &object,
                Some(&element)
            )
            .unwrap_err(),
            "the key \"{{ @.name }}\" renders to \"app\", which another key of the same object has too; keys must render to different strings"
        );
        assert_eq!(
            render(json!({"{{ @.args }}": 1}), &object, Some(&element)).unwrap_err(),
            "template {{ @.args }} selected a list; inside a longer string only strings, numbers and booleans fit"
        );
        // A whole-key template of a number renders as its text: keys are strings.
        assert_eq!(
            render(json!({"{{ $.n }}": true}), &json!({"n": 7}), None).unwrap(),
            json!({"7": true})
        );
        assert_eq!(
            compile_error(json!({"a": {"x/{{ nope(@.name) }}": 1}})),
            format!(
                "/a/x~1{{{{ nope(@.name) }}}} template {{{{ nope(@.name) }}}}: there is no function nope(); the functions are {}",
                Function::list()
            )
        );
        assert!(
            compile(json!({"{{ @.name }}": 1}), false)
                .unwrap_err()
                .to_string()
                .contains("only available inside forEach")
        );
    }

    #[test]
    fn function_outputs_are_counted_before_they_are_built() {
        let limits = crate::Limits {
            rule_output_bytes: 1000,
            admission_output_bytes: 1000,
            foreach_steps: 10,
        };
        let big = "a,".repeat(400);
        let object = json!({"big": big, "encoded": "YWFh".repeat(400), "json": format!("[{}0]", "0,".repeat(600))});
        let over = |template: &str| {
            let error = render_with(json!(template), &object, None, &limits).unwrap_err();
            assert!(
                error.contains("more than 1000 bytes"),
                "{template}: {error}"
            );
        };
        over("{{ split($.big, ',') }}"); // 401 pieces of 0-1 bytes: 1,600 bytes as JSON
        over("{{ base64Decode($.encoded) }}");
        over("{{ base64Encode($.big) }}");
        over("{{ replace($.big, ',', ',,,') }}");
        over("{{ join($.big, split($.big, ',')) }}");
        over("{{ fromJson($.json) }}");
        over("{{ toJson(split($.big, 'a')) }}");
        over("{{ upper(upper($.big)) }}"); // each call counts what it builds
        assert!(render_with(json!("{{ upper($.big) }}"), &object, None, &limits).is_ok());
    }

    #[test]
    fn replace_calls_are_counted_as_regular_expressions_without_compiling() {
        assert_eq!(
            count_regexes(&json!({
                "a": "{{ replace($.a, '\\w{1000}', 'x') }}-{{ lower(replace($.b, 'b', 'c')) }}",
                "{{ replace(@.name, 'x', 'y') }}": ["{{ replace('a', 'b'", "no {{ template", "{{ $.a }}"]})),
            3
        );
    }

    #[test]
    fn lookups_are_an_expression_like_the_others() {
        use crate::lookup::LookupKind;
        let config = json!({"data": {"registry": " Mirror.Local ", "ca.crt": "x"}});
        let lookups = [Found {
            value: &config,
            kind: LookupKind::ConfigMap,
            namespace: "team",
            name: "registry",
        }];
        let names = ["mirror".to_string()];
        let roots = Roots {
            element: false,
            lookups: &names,
            regex_limit: 1 << 20,
        };
        let render = |t: &str| {
            let limits = crate::Limits::default();
            let mut meter = Meter::new(&limits, None);
            let object = json!({});
            Template::compile_in(&json!(t), &roots)
                .map_err(|e| e.to_string())?
                .render(
                    &Scope {
                        object: &object,
                        element: None,
                        lookups: &lookups,
                    },
                    &mut meter,
                )
                .map_err(|e| e.to_string())
        };
        assert_eq!(
            render("{{ lower(trim(lookups.mirror.data.registry)) }}/app"),
            Ok(json!("mirror.local/app"))
        );
        assert_eq!(
            render("{{ default(lookups.mirror.data.nope, lookups.mirror.data['ca.crt']) }}"),
            Ok(json!("x"))
        );
        assert_eq!(
            render("{{ lookups.mirror.data.nope }}"),
            Err("template {{ lookups.mirror.data.nope }} selected nothing in ConfigMap team/registry: add what it selects to ConfigMap team/registry, or change the template".to_string())
        );
        assert!(
            render("{{ lower(lookups.other.data.x) }}")
                .unwrap_err()
                .contains("the rule has no lookup named \"other\" (spec.lookups has mirror)")
        );
        // Counting replace() patterns takes any lookup name, so none is missed after one.
        assert_eq!(
            count_regexes(&json!(
                "{{ lookups.any.data.x }}{{ replace($.a, 'b', 'c') }}"
            )),
            1
        );
    }
}
