//! Evaluating an expression: queries select from the object or the element, calls run their
//! function ([`super::functions`]) and pick from its result.
//!
//! What a function builds is counted by the meter before it is built; what a query selects is
//! borrowed and counted only when it is written into the object ([`Val::Ref`]).

use serde_json::Value;

use super::parse::{Call, Expr, Pick, QueryExpr};
use super::{Scope, TemplateError};
use crate::limits::Meter;
use crate::path::type_name;
use crate::stop::Stop;

/// A value an expression gave.
pub(super) enum Val<'a> {
    /// Selected from the object or the element, or a literal of the rule: not counted yet.
    Ref(&'a Value),
    /// Built by a function: counted already.
    Own(Value),
}

impl Val<'_> {
    pub fn get(&self) -> &Value {
        match self {
            Val::Ref(v) => v,
            Val::Own(v) => v,
        }
    }
}

/// Why an expression gave no value.
pub(super) enum Fail {
    /// A query selected nothing, or a pick found nothing (the query or pick, as the message
    /// shows it): `default()` gives its fallback, anywhere else it is the rule's error.
    Nothing(String),
    Stop(Stop),
}

impl<E: Into<Stop>> From<E> for Fail {
    fn from(error: E) -> Self {
        Fail::Stop(error.into())
    }
}

/// Evaluates the expressions of one template (`source`, as written between the braces).
pub(super) struct Evaluator<'a, 'x, 'm> {
    pub scope: &'x Scope<'a>,
    pub meter: &'x mut Meter<'m>,
    pub source: &'a str,
}

impl<'a> Evaluator<'a, '_, '_> {
    /// The value of the whole template's expression.
    pub fn value(&mut self, expr: &'a Expr) -> Result<Val<'a>, Stop> {
        let value = match expr {
            Expr::Query(q) => self.one(q, None),
            Expr::Literal(v) => Ok(Val::Ref(v)),
            Expr::Call(call) => self.call(call),
        };
        value.map_err(|fail| match fail {
            Fail::Nothing(what) => TemplateError::Nothing {
                expr: self.source.to_string(),
                what,
            }
            .into(),
            Fail::Stop(stop) => stop,
        })
    }

    /// The value of an argument of `function`: a query must select exactly one value.
    pub fn arg(&mut self, expr: &'a Expr, function: &'static str) -> Result<Val<'a>, Fail> {
        match expr {
            Expr::Query(q) => self.one(q, Some(function)),
            Expr::Literal(v) => Ok(Val::Ref(v)),
            Expr::Call(call) => self.call(call),
        }
    }

    /// A list argument: what a query selects (any number of values), or the elements of the
    /// list a singular query (`$.spec.args`), a call or a literal gives.
    pub fn list(&mut self, expr: &'a Expr, function: &'static str) -> Result<Vec<Val<'a>>, Fail> {
        if let Expr::Query(q) = expr
            && !q.query.is_singular()
        {
            return Ok(self.select(q)?.into_iter().map(Val::Ref).collect());
        }
        match self.arg(expr, function)? {
            Val::Ref(Value::Array(items)) => Ok(items.iter().map(Val::Ref).collect()),
            Val::Own(Value::Array(items)) => Ok(items.into_iter().map(Val::Own).collect()),
            other => Err(self
                .misuse(
                    function,
                    format!("it takes a list, not {}", type_name(other.get())),
                )
                .into()),
        }
    }

    fn select(&self, q: &QueryExpr) -> Result<Vec<&'a Value>, Stop> {
        let (doc, _) = super::root(q.root, self.source, self.scope)?;
        Ok(q.query.select(doc).map_err(|source| TemplateError::Query {
            expr: self.source.to_string(),
            source,
        })?)
    }

    fn one(&self, q: &QueryExpr, function: Option<&'static str>) -> Result<Val<'a>, Fail> {
        match self.select(q)?.as_slice() {
            [one] => Ok(Val::Ref(one)),
            [] => Err(Fail::Nothing(q.text.clone())),
            many => Err(TemplateError::SelectedManyInside {
                expr: self.source.to_string(),
                query: q.text.clone(),
                count: many.len(),
                taker: function.map_or_else(
                    || "the template takes one value".to_string(),
                    |f| format!("{f}() takes one value there"),
                ),
            }
            .into()),
        }
    }

    fn call(&mut self, call: &'a Call) -> Result<Val<'a>, Fail> {
        let mut value = self.apply(call)?;
        for pick in &call.picks {
            let name = call.function.name();
            let found = match (value, pick) {
                (Val::Ref(Value::Object(map)), Pick::Field(field)) => map.get(field).map(Val::Ref),
                (Val::Own(Value::Object(mut map)), Pick::Field(field)) => {
                    map.remove(field).map(Val::Own)
                }
                (Val::Ref(Value::Array(items)), Pick::Index(i)) => {
                    position(items.len(), *i).map(|i| Val::Ref(&items[i]))
                }
                (Val::Own(Value::Array(mut items)), Pick::Index(i)) => {
                    position(items.len(), *i).map(|i| Val::Own(items.swap_remove(i)))
                }
                (other, _) => {
                    let wants = match pick {
                        Pick::Field(_) => "an object",
                        Pick::Index(_) => "a list",
                    };
                    return Err(self
                        .misuse(
                            name,
                            format!(
                                "{pick} picks from {wants}, but the result is {}",
                                type_name(other.get())
                            ),
                        )
                        .into());
                }
            };
            value = found.ok_or_else(|| Fail::Nothing(format!("{name}(…){pick}")))?;
        }
        Ok(value)
    }

    /// The argument as text, or the rule's error naming the function and `what` it is.
    pub fn text(
        &mut self,
        expr: &'a Expr,
        function: &'static str,
        what: &str,
    ) -> Result<Text<'a>, Fail> {
        match self.arg(expr, function)? {
            Val::Ref(Value::String(s)) => Ok(Text::Ref(s)),
            Val::Own(Value::String(s)) => Ok(Text::Own(s)),
            other => Err(self
                .misuse(
                    function,
                    format!("{what} must be a string, not {}", type_name(other.get())),
                )
                .into()),
        }
    }

    /// Counts `bytes` a function is about to build.
    pub fn count(&mut self, bytes: usize) -> Result<(), Stop> {
        self.meter.write(bytes)
    }

    /// A function given what it cannot take: the rule's error.
    pub fn misuse(&self, function: &'static str, problem: String) -> TemplateError {
        TemplateError::Function {
            expr: self.source.to_string(),
            function,
            problem,
        }
    }
}

/// Text an argument gave, borrowed from the object or built by a function.
pub(super) enum Text<'a> {
    Ref(&'a str),
    Own(String),
}

impl Text<'_> {
    pub fn as_str(&self) -> &str {
        match self {
            Text::Ref(s) => s,
            Text::Own(s) => s,
        }
    }

    pub fn into_string(self) -> String {
        match self {
            Text::Ref(s) => s.to_string(),
            Text::Own(s) => s,
        }
    }
}

/// Index `i` of a list of `len` (from the end when negative).
fn position(len: usize, i: i64) -> Option<usize> {
    let i = if i < 0 {
        len.checked_sub(usize::try_from(i.unsigned_abs()).ok()?)?
    } else {
        usize::try_from(i).ok()?
    };
    (i < len).then_some(i)
}
