//! `{{ <JSONPath> }}` templates in mutation values. `$` is the object (as the rule found it),
//! `@` the current `forEach` element, `lookups.<name>` an object the rule looks up
//! (`spec.lookups`). A template that is the whole string keeps the selected value's JSON type;
//! inside a longer string the value must be a scalar.

use serde_json::{Map, Value};

use super::limits::{MAX_DEPTH, Meter, Size, Stop, measure};
use super::literal::Lit;
use super::lookup::{Found, is_lookup_name};
use super::path::{Query, QueryError, type_name};

#[derive(Clone, Debug, PartialEq)]
enum Root {
    Object,
    Element,
    /// The rule's lookup at this position of `spec.lookups` (resolved ones, in order).
    Lookup(usize),
}

#[derive(Clone, Debug, PartialEq)]
struct Expr {
    root: Root,
    query: Query,
    source: String,
}

#[derive(Clone, Debug, PartialEq)]
enum Part {
    Text(String),
    Expr(Expr),
}

#[derive(Clone, Debug, PartialEq)]
enum Node {
    Literal(Lit),
    Whole(Expr),
    Parts(Vec<Part>),
    Array(Vec<Node>),
    Object(Vec<(String, Node)>),
}

/// A mutation value with its templates compiled. Values without templates are kept as
/// compact literals ([`Lit`]) and rendered by building the `Value`.
#[derive(Clone, Debug, PartialEq)]
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

/// What the templates of a value may refer to where it is, besides `$`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Roots<'a> {
    /// `@`: inside `forEach` only.
    pub element: bool,
    /// `lookups.<name>`: the names of the rule's lookups, in `spec.lookups` order.
    pub lookups: &'a [String],
}

impl Template {
    /// Compiles every string in `value`, with no lookups. `element_allowed` is false outside
    /// `forEach`. Mutations compile through [`Template::compile_in`].
    #[cfg(test)]
    pub fn compile(value: &Value, element_allowed: bool) -> Result<Template, MisplacedTemplate> {
        let roots = Roots {
            element: element_allowed,
            lookups: &[],
        };
        Template::compile_in(value, &roots)
    }

    /// Compiles every string in `value`, whose templates may refer to `roots`.
    pub fn compile_in(value: &Value, roots: &Roots) -> Result<Template, MisplacedTemplate> {
        let mut uses_element = false;
        let node = compile_node(value, "", roots, &mut uses_element)?;
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
    /// copied, so a template that copies the object into itself stops at the output limit
    /// instead of exhausting memory. The caller counts the fixed part ([`Template::size`]).
    pub fn render(&self, scope: &Scope, meter: &mut Meter) -> Result<Value, Stop> {
        render_node(&self.node, scope, meter)
    }
}

fn compile_node(
    value: &Value,
    at: &str,
    roots: &Roots,
    uses_element: &mut bool,
) -> Result<Node, MisplacedTemplate> {
    let node = match value {
        Value::String(s) => {
            compile_string(s, roots, uses_element).map_err(|error| MisplacedTemplate {
                at: at.to_string(),
                error,
            })?
        }
        Value::Array(items) => {
            let nodes = items
                .iter()
                .enumerate()
                .map(|(i, v)| compile_node(v, &format!("{at}/{i}"), roots, uses_element))
                .collect::<Result<Vec<_>, _>>()?;
            if nodes.iter().all(|n| matches!(n, Node::Literal(_))) {
                Node::Literal(Lit::from_value(value))
            } else {
                Node::Array(nodes)
            }
        }
        Value::Object(map) => {
            let nodes = map
                .iter()
                .map(|(k, v)| {
                    let escaped = k.replace('~', "~0").replace('/', "~1");
                    compile_node(v, &format!("{at}/{escaped}"), roots, uses_element)
                        .map(|n| (k.clone(), n))
                })
                .collect::<Result<Vec<_>, _>>()?;
            if nodes.iter().all(|(_, n)| matches!(n, Node::Literal(_))) {
                Node::Literal(Lit::from_value(value))
            } else {
                Node::Object(nodes)
            }
        }
        other => Node::Literal(Lit::from_value(other)),
    };
    Ok(node)
}

fn compile_string(s: &str, roots: &Roots, uses_element: &mut bool) -> Result<Node, TemplateError> {
    if !s.contains("{{") {
        return Ok(Node::Literal(Lit::String(s.into())));
    }
    let mut parts = Vec::new();
    let mut rest = s;
    while let Some(start) = rest.find("{{") {
        if start > 0 {
            parts.push(Part::Text(rest[..start].to_string()));
        }
        let after = &rest[start + 2..];
        let Some(end) = after.find("}}") else {
            return Err(TemplateError::Unclosed {
                text: s.to_string(),
            });
        };
        let source = after[..end].trim();
        parts.push(Part::Expr(parse_expr(source, roots, uses_element)?));
        rest = &after[end + 2..];
    }
    if !rest.is_empty() {
        parts.push(Part::Text(rest.to_string()));
    }
    if let [Part::Expr(expr)] = parts.as_slice() {
        return Ok(Node::Whole(expr.clone()));
    }
    Ok(Node::Parts(parts))
}

/// The prefix of a template that reads a looked-up object.
const LOOKUPS: &str = "lookups";

/// Parses one expression (what a template has between its braces, trimmed): a JSONPath from
/// `$` (the object), `@` (the `forEach` element, where `roots` allows it), or
/// `lookups.<name>` (the rule's lookup of that name, the rest a JSONPath continuation with `$`
/// the looked-up object). Every kind of expression is parsed here, so whatever takes an
/// expression takes every kind.
fn parse_expr(source: &str, roots: &Roots, uses_element: &mut bool) -> Result<Expr, TemplateError> {
    let expr = || source.to_string();
    let (root, query_text) = if let Some(tail) = source.strip_prefix('@') {
        if !roots.element {
            return Err(TemplateError::ElementOutsideForEach { expr: expr() });
        }
        *uses_element = true;
        (Root::Element, format!("${tail}"))
    } else if source.starts_with('$') {
        (Root::Object, source.to_string())
    } else if let Some(tail) = source
        .strip_prefix(LOOKUPS)
        .filter(|t| t.is_empty() || t.starts_with(['.', '[']))
    {
        let named = tail.strip_prefix('.').unwrap_or("");
        let end = named
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(named.len());
        let (name, rest) = named.split_at(end);
        if !is_lookup_name(name) || !(rest.is_empty() || rest.starts_with(['.', '['])) {
            return Err(TemplateError::NoLookupName { expr: expr() });
        }
        let Some(position) = roots.lookups.iter().position(|l| l == name) else {
            return Err(TemplateError::UnknownLookup {
                expr: expr(),
                name: name.to_string(),
                known: roots.lookups.to_vec(),
            });
        };
        (Root::Lookup(position), format!("${rest}"))
    } else {
        return Err(TemplateError::NoRoot { expr: expr() });
    };
    let query = Query::parse(&query_text).map_err(|error| TemplateError::Query {
        expr: expr(),
        source: error,
    })?;
    Ok(Expr {
        root,
        query,
        source: source.to_string(),
    })
}

fn render_node(node: &Node, scope: &Scope, meter: &mut Meter) -> Result<Value, Stop> {
    Ok(match node {
        Node::Literal(v) => v.to_value(),
        Node::Whole(expr) => {
            let selected = select_one(expr, scope)?;
            let size = measure(selected, meter.remaining(), MAX_DEPTH);
            meter.write(size.bytes)?;
            selected.clone()
        }
        Node::Parts(parts) => {
            let mut out = String::new();
            for part in parts {
                match part {
                    Part::Text(t) => out.push_str(t),
                    Part::Expr(expr) => match select_one(expr, scope)? {
                        Value::String(s) => {
                            meter.write(s.len())?;
                            out.push_str(s)
                        }
                        v @ (Value::Number(_) | Value::Bool(_)) => out.push_str(&v.to_string()),
                        Value::Null => {}
                        other => {
                            return Err(TemplateError::NotScalar {
                                expr: expr.source.clone(),
                                found: type_name(other),
                            }
                            .into());
                        }
                    },
                }
            }
            Value::String(out)
        }
        Node::Array(items) => Value::Array(
            items
                .iter()
                .map(|n| render_node(n, scope, meter))
                .collect::<Result<_, _>>()?,
        ),
        Node::Object(entries) => {
            let mut map = Map::new();
            for (k, n) in entries {
                map.insert(k.clone(), render_node(n, scope, meter)?);
            }
            Value::Object(map)
        }
    })
}

fn select_one<'a>(expr: &Expr, scope: &Scope<'a>) -> Result<&'a Value, TemplateError> {
    let mut looked_up = None;
    let doc = match expr.root {
        Root::Object => scope.object,
        Root::Element => scope.element.ok_or_else(|| TemplateError::ElementGone {
            expr: expr.source.clone(),
        })?,
        Root::Lookup(i) => {
            let found = scope
                .lookups
                .get(i)
                .ok_or_else(|| TemplateError::LookupNotResolved {
                    expr: expr.source.clone(),
                })?;
            looked_up = Some(found);
            found.value
        }
    };
    let found = expr
        .query
        .select(doc)
        .map_err(|source| TemplateError::Query {
            expr: expr.source.clone(),
            source,
        })?;
    match found.as_slice() {
        [one] => Ok(one),
        [] => Err(match looked_up {
            None => TemplateError::SelectedNothing {
                expr: expr.source.clone(),
            },
            Some(found) => TemplateError::LookupSelectedNothing {
                expr: expr.source.clone(),
                object: found.to_string(),
            },
        }),
        many => Err(TemplateError::SelectedMany {
            expr: expr.source.clone(),
            count: many.len(),
        }),
    }
}

/// A template that does not compile, or that cannot be rendered for this object. `expr` is the
/// JSONPath as written between the braces.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("template in {text:?} has no closing }}}}")]
    Unclosed { text: String },
    #[error("template {{{{ {expr} }}}}: @ (the current element) is only available inside forEach")]
    ElementOutsideForEach { expr: String },
    #[error(
        "template {{{{ {expr} }}}}: the JSONPath must start with $ (the object), @ (the forEach element) or lookups.<name> (a lookup of the rule)"
    )]
    NoRoot { expr: String },
    #[error(
        "template {{{{ {expr} }}}}: name a lookup of the rule, as in {{{{ lookups.<name>.data.<key> }}}}"
    )]
    NoLookupName { expr: String },
    #[error("template {{{{ {expr} }}}}: the rule has no lookup named {name:?} ({})", known_lookups(.known))]
    UnknownLookup {
        expr: String,
        name: String,
        known: Vec<String>,
    },
    #[error(
        "template {{{{ {expr} }}}} selected nothing in {object}: add what it selects to {object}, or change the template"
    )]
    LookupSelectedNothing { expr: String, object: String },
    /// A lookup template rendered without its lookup resolved: a bug.
    #[error("template {{{{ {expr} }}}}: its lookup was not read before the rule ran")]
    LookupNotResolved { expr: String },
    #[error("template {{{{ {expr} }}}}: {source}")]
    Query { expr: String, source: QueryError },
    #[error(
        "template {{{{ {expr} }}}}: the forEach element no longer exists: an earlier step of this forEach removed or replaced it"
    )]
    ElementGone { expr: String },
    #[error("template {{{{ {expr} }}}} selected nothing")]
    SelectedNothing { expr: String },
    #[error("template {{{{ {expr} }}}} selected {count} values; use a path that selects one")]
    SelectedMany { expr: String, count: usize },
    #[error(
        "template {{{{ {expr} }}}} selected {found}; inside a longer string only strings, numbers and booleans fit"
    )]
    NotScalar { expr: String, found: &'static str },
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

    fn render(value: Value, object: &Value, element: Option<&Value>) -> Result<Value, String> {
        let limits = crate::engine::Limits::default();
        let mut meter = Meter::new(&limits, None);
        Template::compile(&value, true)
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
        let misplaced = Template::compile(&json!({"a": ["{{ $.x"]}), false).unwrap_err();
        assert_eq!(
            (misplaced.at, misplaced.error.to_string()),
            (
                "/a/0".to_string(),
                "template in \"{{ $.x\" has no closing }}".to_string()
            )
        );
        assert!(
            Template::compile(&json!("{{ @.name }}"), false)
                .unwrap_err()
                .to_string()
                .contains("only available inside forEach")
        );
        assert!(
            Template::compile(&json!("{{ spec }}"), false)
                .unwrap_err()
                .to_string()
                .contains("must start with $")
        );
        assert!(
            Template::compile(&json!("{{ $.a[ }}"), false)
                .unwrap_err()
                .to_string()
                .contains("invalid JSONPath")
        );
    }

    #[test]
    fn literals_stay_literal() {
        let t = Template::compile(&json!({"a": [1, "x"], "b": null}), false).unwrap();
        assert_eq!(
            t.literal().map(Lit::to_value),
            Some(json!({"a": [1, "x"], "b": null}))
        );
    }
}
