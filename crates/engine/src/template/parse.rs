//! What is between `{{` and `}}`: one expression. [`Parser::expr`] parses every form, and a
//! function's arguments are parsed by calling it again, so a new form is one more arm there.
//!
//! - a JSONPath query rooted at `$` (the object) or `@` (the `forEach` element);
//! - `lookups.<name>...`: a lookup of the rule, the rest a JSONPath continuation with `$`
//!   the looked-up object;
//! - a function call `name(arg, ...)`, optionally followed by `.field`, `['field']` or
//!   `[index]` to pick from its result;
//! - a literal: `'text'` (`\'` is a quote, `\\` a backslash, and a backslash before anything
//!   else is kept, so regular expressions read as written), a number, `true`, `false`, `null`.

use crate::limits::RuleRegex;
use serde_json::{Number, Value};

use super::TemplateError;
use super::catalog::Function;
use crate::limits::{MAX_CALL_NESTING, compile_regex};
use crate::lookup::is_lookup_name;
use crate::path::Query;

#[derive(Clone, Debug)]
pub(super) enum Expr {
    Query(QueryExpr),
    Call(Box<Call>),
    Literal(Value),
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Root {
    Object,
    Element,
    /// The rule's lookup at this position of `spec.lookups` (resolved ones, in order).
    Lookup(usize),
}

#[derive(Clone, Debug)]
pub(super) struct QueryExpr {
    pub root: Root,
    pub query: Query,
    /// As written (`@.name`), for messages.
    pub text: String,
}

#[derive(Clone, Debug)]
pub(super) struct Call {
    pub function: Function,
    pub args: Vec<Expr>,
    /// The pattern of `replace()`, compiled with the rule.
    pub regex: Option<RuleRegex>,
    /// What to pick from the result, in order.
    pub picks: Vec<Pick>,
}

#[derive(Clone, Debug, PartialEq)]
pub(super) enum Pick {
    Field(String),
    /// From the end when negative, as in JSONPath.
    Index(i64),
}

impl std::fmt::Display for Pick {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Pick::Field(name) if is_identifier(name) => write!(f, ".{name}"),
            Pick::Field(name) => {
                write!(f, "['{}']", name.replace('\\', "\\\\").replace('\'', "\\'"))
            }
            Pick::Index(i) => write!(f, "[{i}]"),
        }
    }
}

/// `[A-Za-z_][A-Za-z0-9_]*`: a name that `.name` can pick.
fn is_identifier(name: &str) -> bool {
    name.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// What the templates of a value may use.
pub(super) struct Options<'r> {
    pub element_allowed: bool,
    /// What each `replace()` pattern may compile to; `None` only counts the patterns.
    pub regex_limit: Option<usize>,
    /// The names of the rule's lookups, in `spec.lookups` order; `None` (when only counting)
    /// takes any name.
    pub lookups: Option<&'r [String]>,
}

/// The prefix of a template that reads a looked-up object.
const LOOKUPS: &str = "lookups";

/// Parses the templates of one string, one at a time ([`Parser::template`]).
pub(super) struct Parser<'s, 'o> {
    text: &'s str,
    pos: usize,
    /// Where the current template starts (just after its `{{`).
    start: usize,
    options: &'o Options<'o>,
    /// Some template used `@`.
    pub uses_element: bool,
    /// `replace()` calls seen (each compiles a regular expression).
    pub regexes: usize,
}

impl<'s, 'o> Parser<'s, 'o> {
    pub fn new(text: &'s str, options: &'o Options<'o>) -> Self {
        Parser {
            text,
            pos: 0,
            start: 0,
            options,
            uses_element: false,
            regexes: 0,
        }
    }

    /// Parses the template whose `{{` ends at `after_open`: its expression and its text (what
    /// is between the braces, trimmed, for messages). Returns where the text after `}}` starts.
    pub fn template(&mut self, after_open: usize) -> Result<(Expr, String, usize), TemplateError> {
        self.pos = after_open;
        self.start = after_open;
        if !self.text[after_open..].contains("}}") {
            return Err(TemplateError::Unclosed {
                text: self.text.to_string(),
            });
        }
        self.skip_blank();
        let expr = self.expr(0)?;
        self.skip_blank();
        if !self.rest().starts_with("}}") {
            let found = self.rest().chars().next().unwrap_or(' ');
            return Err(self.syntax(format!(
                "expected }}}} after the expression, found {found:?}"
            )));
        }
        let source = self.text[self.start..self.pos].trim().to_string();
        Ok((expr, source, self.pos + 2))
    }

    /// One expression, of any form; `depth` is how many calls it is inside.
    fn expr(&mut self, depth: usize) -> Result<Expr, TemplateError> {
        match self.rest().as_bytes().first() {
            Some(b'$' | b'@') => self.query(),
            Some(b'\'') => self.string().map(Expr::Literal),
            Some(b'-' | b'0'..=b'9') => self.number().map(Expr::Literal),
            Some(b'"') => Err(self.syntax("text is written in single quotes: 'text'".into())),
            Some(c) if c.is_ascii_alphabetic() => {
                let begin = self.pos;
                let name = self.identifier();
                self.skip_blank();
                if self.eat("(") {
                    return self.call(name, depth);
                }
                if name == LOOKUPS {
                    self.pos = begin;
                    return self.lookup();
                }
                match name {
                    "true" => Ok(Expr::Literal(Value::Bool(true))),
                    "false" => Ok(Expr::Literal(Value::Bool(false))),
                    "null" => Ok(Expr::Literal(Value::Null)),
                    _ => Err(TemplateError::NoRoot {
                        expr: self.source(),
                    }),
                }
            }
            Some(b'}') if self.rest().starts_with("}}") => {
                Err(self.syntax("the template is empty".into()))
            }
            _ => Err(TemplateError::NoRoot {
                expr: self.source(),
            }),
        }
    }

    /// A JSONPath query: up to a `,` or `)` that ends a function argument, or the closing
    /// `}}`, outside brackets, parentheses and quotes.
    fn query(&mut self) -> Result<Expr, TemplateError> {
        let begin = self.pos;
        let text = self.text[begin..self.query_end()].trim_end();
        self.pos = begin + text.len();
        let (root, query_text) = match text.strip_prefix('@') {
            Some(tail) => {
                if !self.options.element_allowed {
                    return Err(TemplateError::ElementOutsideForEach {
                        expr: self.source(),
                    });
                }
                self.uses_element = true;
                (Root::Element, format!("${tail}"))
            }
            None => (Root::Object, text.to_string()),
        };
        let query = Query::parse(&query_text).map_err(|source| TemplateError::Query {
            expr: self.source(),
            source,
        })?;
        Ok(Expr::Query(QueryExpr {
            root,
            query,
            text: text.to_string(),
        }))
    }

    /// `lookups.<name>` and a JSONPath continuation (`.data.key`), up to where a query ends.
    fn lookup(&mut self) -> Result<Expr, TemplateError> {
        let begin = self.pos;
        let text = self.text[begin..self.query_end()].trim_end();
        self.pos = begin + text.len();
        let tail = &text[LOOKUPS.len()..];
        let named = tail.strip_prefix('.').unwrap_or("");
        let end = named
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(named.len());
        let (name, rest) = named.split_at(end);
        if !is_lookup_name(name) || !(rest.is_empty() || rest.starts_with(['.', '['])) {
            return Err(TemplateError::NoLookupName {
                expr: self.source(),
            });
        }
        let position = match self.options.lookups {
            None => 0,
            Some(known) => known.iter().position(|l| l == name).ok_or_else(|| {
                TemplateError::UnknownLookup {
                    expr: self.source(),
                    name: name.to_string(),
                    known: known.to_vec(),
                }
            })?,
        };
        let query = Query::parse(&format!("${rest}")).map_err(|source| {
            // Say it about what the user wrote (`lookups.d.data[...]`), not the query it
            // becomes.
            let problem = match source {
                crate::path::QueryError::Invalid { problem, .. }
                    if rest.contains("[@") || rest.contains("[$") =>
                {
                    format!(
                        "{text} names a member by a computed key, which is not supported ({problem}): name the key, as in lookups.{name}.data.key"
                    )
                }
                crate::path::QueryError::Invalid { problem, .. } => {
                    format!("{text} is not a valid lookup query: {problem}")
                }
                other => other.to_string(),
            };
            TemplateError::Syntax {
                expr: self.source(),
                problem,
            }
        })?;
        Ok(Expr::Query(QueryExpr {
            root: Root::Lookup(position),
            query,
            text: text.to_string(),
        }))
    }

    fn query_end(&self) -> usize {
        let bytes = self.text.as_bytes();
        let mut depth = 0usize;
        let mut quote = None;
        let mut i = self.pos;
        while i < bytes.len() {
            let b = bytes[i];
            if let Some(q) = quote {
                if b == b'\\' {
                    i += 1;
                } else if b == q {
                    quote = None;
                }
            } else {
                match b {
                    b'\'' | b'"' => quote = Some(b),
                    b'[' | b'(' => depth += 1,
                    b']' | b')' if depth > 0 => depth -= 1,
                    b']' | b')' | b',' if depth == 0 => break,
                    b'}' if depth == 0 && bytes.get(i + 1) == Some(&b'}') => break,
                    _ => {}
                }
            }
            i += 1;
        }
        i.min(bytes.len())
    }

    /// `name(` has been read.
    fn call(&mut self, name: &str, depth: usize) -> Result<Expr, TemplateError> {
        let Some(function) = Function::named(name) else {
            return Err(TemplateError::UnknownFunction {
                expr: self.source(),
                name: name.to_string(),
            });
        };
        if depth >= MAX_CALL_NESTING {
            return Err(TemplateError::CallsTooNested {
                expr: self.source(),
            });
        }
        let mut args = Vec::new();
        self.skip_blank();
        if !self.eat(")") {
            loop {
                self.skip_blank();
                args.push(self.expr(depth + 1)?);
                self.skip_blank();
                if self.eat(",") {
                    continue;
                }
                if self.eat(")") {
                    break;
                }
                return Err(self.syntax(format!(
                    "expected , or ) after an argument of {}()",
                    function.name()
                )));
            }
        }
        if args.len() != function.arity() {
            return Err(TemplateError::Arity {
                expr: self.source(),
                function: function.name(),
                signature: function.signature(),
                takes: function.arity(),
                found: args.len(),
            });
        }
        let regex = match (function, args.get(1)) {
            (Function::Replace, Some(Expr::Literal(Value::String(pattern)))) => {
                self.regexes += 1;
                match self.options.regex_limit {
                    Some(limit) => Some(compile_regex(pattern, limit).map_err(|source| {
                        TemplateError::ReplacePattern {
                            expr: self.source(),
                            source,
                        }
                    })?),
                    None => None,
                }
            }
            (Function::Replace, _) => {
                return Err(TemplateError::ReplaceNotLiteral {
                    expr: self.source(),
                });
            }
            _ => None,
        };
        let picks = self.picks()?;
        Ok(Expr::Call(Box::new(Call {
            function,
            args,
            regex,
            picks,
        })))
    }

    /// `.field`, `['field']` and `[index]` after a call.
    fn picks(&mut self) -> Result<Vec<Pick>, TemplateError> {
        let mut picks = Vec::new();
        loop {
            if self.eat(".") {
                let name = self.identifier();
                if name.is_empty() {
                    return Err(self.syntax("expected a field name after '.'".into()));
                }
                picks.push(Pick::Field(name.to_string()));
            } else if self.rest().starts_with("['") {
                self.pos += 1;
                let Value::String(name) = self.string()? else {
                    return Err(self.syntax("expected a quoted field name".into()));
                };
                if !self.eat("]") {
                    return Err(self.syntax("expected ] after the field name".into()));
                }
                picks.push(Pick::Field(name));
            } else if self.rest().starts_with('[') {
                self.pos += 1;
                let end = self.rest().find(']').unwrap_or(self.rest().len());
                let index = self.rest()[..end].trim().parse::<i64>().map_err(|_| {
                    self.syntax("expected a field name in quotes or a list index in [ ]".into())
                })?;
                self.pos += end;
                if !self.eat("]") {
                    return Err(self.syntax("expected ] after the index".into()));
                }
                picks.push(Pick::Index(index));
            } else {
                return Ok(picks);
            }
        }
    }

    /// A single-quoted string; the cursor is on its opening quote.
    fn string(&mut self) -> Result<Value, TemplateError> {
        let mut out = String::new();
        let mut chars = self.text[self.pos + 1..].char_indices();
        while let Some((i, c)) = chars.next() {
            match c {
                '\'' => {
                    self.pos += 1 + i + 1;
                    return Ok(Value::String(out));
                }
                '\\' => match chars.next() {
                    Some((_, c @ ('\'' | '\\'))) => out.push(c),
                    Some((_, c)) => {
                        out.push('\\');
                        out.push(c);
                    }
                    None => break,
                },
                c => out.push(c),
            }
        }
        Err(self.syntax("a quoted string has no closing '".into()))
    }

    fn number(&mut self) -> Result<Value, TemplateError> {
        let end = self
            .rest()
            .find(|c: char| !(c.is_ascii_digit() || matches!(c, '-' | '+' | '.' | 'e' | 'E')))
            .unwrap_or(self.rest().len());
        let text = &self.rest()[..end];
        let number = text
            .parse::<Number>()
            .map_err(|_| self.syntax(format!("{text:?} is not a number")))?;
        self.pos += end;
        Ok(Value::Number(number))
    }

    /// `[A-Za-z_][A-Za-z0-9_]*`, possibly empty.
    fn identifier(&mut self) -> &'s str {
        let rest = &self.text[self.pos..];
        let end = rest
            .char_indices()
            .find(|&(i, c)| !(c.is_ascii_alphabetic() || c == '_' || (i > 0 && c.is_ascii_digit())))
            .map_or(rest.len(), |(i, _)| i);
        self.pos += end;
        &rest[..end]
    }

    fn rest(&self) -> &'s str {
        &self.text[self.pos..]
    }

    fn eat(&mut self, token: &str) -> bool {
        let found = self.rest().starts_with(token);
        if found {
            self.pos += token.len();
        }
        found
    }

    fn skip_blank(&mut self) {
        let rest = self.rest();
        self.pos += rest.len() - rest.trim_start_matches([' ', '\t', '\n', '\r']).len();
    }

    /// The current template's text as the messages show it: up to the first `}}`.
    fn source(&self) -> String {
        let tail = &self.text[self.start..];
        tail[..tail.find("}}").unwrap_or(tail.len())]
            .trim()
            .to_string()
    }

    fn syntax(&self, problem: String) -> TemplateError {
        TemplateError::Syntax {
            expr: self.source(),
            problem,
        }
    }
}
