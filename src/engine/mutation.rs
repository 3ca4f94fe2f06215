//! Compiled mutations and how they change an object.

use json_patch::jsonptr::PointerBuf;
use json_patch::{
    AddOperation, CopyOperation, MoveOperation, PatchOperation, RemoveOperation, ReplaceOperation,
    TestOperation,
};
use regex::Regex;
use serde_json::Value;

use crate::api::{self, PatchOp};

use super::error::Errors;
use super::journal::Journal;
use super::limits::{
    MAX_DEPTH, MAX_REGEX_BYTES, Meter, RULE_REGEX_BYTES, Size, Stop, human_bytes, measure,
};
use super::literal::{self, Lit, MergePatch};
use super::path::{Pointer, Query, type_name};
use super::template::{Scope, Template};

/// Compiles a rule's regular expression within `size_limit` bytes (its share of what all the
/// rule's regular expressions may use, see [`regex_share`]), so a rule cannot make initium
/// allocate without limit or spend seconds compiling.
pub fn compile_regex(pattern: &str, size_limit: usize) -> Result<Regex, String> {
    regex::RegexBuilder::new(pattern)
        .size_limit(size_limit)
        .dfa_size_limit(size_limit)
        .build()
        .map_err(|e| match &e {
            // The syntax error's Display draws the pattern with a caret over several lines;
            // its last line says what is wrong.
            regex::Error::Syntax(text) => format!(
                "invalid regular expression {pattern:?}: {}",
                text.lines()
                    .last()
                    .unwrap_or_default()
                    .trim_start_matches("error: ")
            ),
            regex::Error::CompiledTooBig(_) => format!(
                "regular expression {pattern:?} is too large once compiled (over {}; a rule's regular expressions share {}): simplify it, for example [a-zA-Z0-9_] instead of \\w, which matches every Unicode letter and digit, or fewer repetitions",
                human_bytes(size_limit),
                human_bytes(RULE_REGEX_BYTES)
            ),
            other => format!("invalid regular expression {pattern:?}: {other}"),
        })
}

/// Each of a rule's `count` regular expressions may compile to this many bytes.
pub fn regex_share(count: usize) -> usize {
    (RULE_REGEX_BYTES / count.max(1)).min(MAX_REGEX_BYTES)
}

#[derive(Clone, Debug)]
pub(crate) enum Mutation {
    Merge(Template),
    Patch(Vec<PatchStep>),
    Upsert {
        path: Pointer,
        key: String,
        value: Template,
    },
    Rewrite {
        path: Pointer,
        regex: Regex,
        replacement: String,
    },
    ForEach {
        query: Query,
        mutations: Vec<Mutation>,
        /// No nested mutation renders a template, so each element is looked up once.
        literal: bool,
    },
}

#[derive(Clone, Debug)]
pub(crate) struct PatchStep {
    op: PatchOp,
    path: Pointer,
    path_buf: PointerBuf,
    from: Option<PointerBuf>,
    from_pointer: Option<Pointer>,
    value: Option<Template>,
}

/// The fields shared by top-level and `forEach` mutations.
struct Parts<'a> {
    merge: &'a Option<Value>,
    patch: &'a Option<Vec<api::PatchOperation>>,
    upsert: &'a Option<api::Upsert>,
    rewrite: &'a Option<api::Rewrite>,
}

pub(crate) fn compile(
    m: &api::Mutation,
    at: &str,
    regex_limit: usize,
    errors: &mut Errors,
) -> Option<Mutation> {
    let parts = Parts {
        merge: &m.merge,
        patch: &m.patch,
        upsert: &m.upsert,
        rewrite: &m.rewrite,
    };
    let set = [
        m.merge.is_some(),
        m.patch.is_some(),
        m.upsert.is_some(),
        m.for_each.is_some(),
        m.rewrite.is_some(),
    ]
    .iter()
    .filter(|x| **x)
    .count();
    if set != 1 {
        errors.push(
            at,
            format!("set exactly one of merge, patch, upsert, forEach, rewrite (found {set})"),
        );
        return None;
    }
    if m.mutations.is_some() && m.for_each.is_none() {
        errors.push(format!("{at}.mutations"), "mutations go with forEach");
        return None;
    }
    let Some(for_each) = &m.for_each else {
        return compile_parts(&parts, at, false, regex_limit, errors);
    };
    let query = match Query::parse(for_each) {
        Ok(q) => Some(q),
        Err(e) => {
            errors.push(format!("{at}.forEach"), e);
            None
        }
    };
    let nested = match &m.mutations {
        Some(list) if !list.is_empty() => list,
        _ => {
            errors.push(
                format!("{at}.mutations"),
                "forEach needs at least one mutation",
            );
            return None;
        }
    };
    let mut mutations = Vec::new();
    for (i, n) in nested.iter().enumerate() {
        let at = format!("{at}.mutations[{i}]");
        let parts = Parts {
            merge: &n.merge,
            patch: &n.patch,
            upsert: &n.upsert,
            rewrite: &n.rewrite,
        };
        let set = [
            n.merge.is_some(),
            n.patch.is_some(),
            n.upsert.is_some(),
            n.rewrite.is_some(),
        ]
        .iter()
        .filter(|x| **x)
        .count();
        if set != 1 {
            errors.push(
                &at,
                format!("set exactly one of merge, patch, upsert, rewrite (found {set})"),
            );
            continue;
        }
        if let Some(m) = compile_parts(&parts, &at, true, regex_limit, errors) {
            mutations.push(m);
        }
    }
    let literal = mutations.iter().all(Mutation::is_literal);
    Some(Mutation::ForEach {
        query: query?,
        mutations,
        literal,
    })
}

fn compile_parts(
    p: &Parts,
    at: &str,
    in_for_each: bool,
    regex_limit: usize,
    errors: &mut Errors,
) -> Option<Mutation> {
    let template = |value: &Value, field: String, errors: &mut Errors| match Template::compile(
        value,
        in_for_each,
    ) {
        Ok(t) => Some(t),
        Err((inner, message)) => {
            let where_ = if inner.is_empty() {
                field
            } else {
                format!("{field} (at {inner})")
            };
            errors.push(where_, message);
            None
        }
    };
    let pointer = |text: &str, field: String, errors: &mut Errors| match Pointer::parse(text) {
        Ok(p) => Some(p),
        Err(e) => {
            errors.push(field, e);
            None
        }
    };
    if let Some(merge) = p.merge {
        if !merge.is_object() {
            errors.push(
                format!("{at}.merge"),
                format!("a merge patch must be an object, not {}", type_name(merge)),
            );
            return None;
        }
        if merge.as_object().is_some_and(|m| m.is_empty()) {
            errors.push(
                format!("{at}.merge"),
                "an empty merge patch changes nothing (if it held nulls, client-side `kubectl apply` removed them: apply rules with `kubectl apply --server-side`)",
            );
            return None;
        }
        return template(merge, format!("{at}.merge"), errors).map(Mutation::Merge);
    }
    if let Some(ops) = p.patch {
        if ops.is_empty() {
            errors.push(format!("{at}.patch"), "needs at least one operation");
            return None;
        }
        let before = errors.errors.len();
        let mut steps = Vec::new();
        for (i, op) in ops.iter().enumerate() {
            let at = format!("{at}.patch[{i}]");
            let path = pointer(&op.path, format!("{at}.path"), errors);
            let from = match (&op.op, &op.from) {
                (PatchOp::Move | PatchOp::Copy, Some(f)) => {
                    pointer(f, format!("{at}.from"), errors)
                }
                (PatchOp::Move | PatchOp::Copy, None) => {
                    errors.push(
                        format!("{at}.from"),
                        format!("{:?} needs from", op.op).to_lowercase(),
                    );
                    None
                }
                (_, Some(_)) => {
                    errors.push(format!("{at}.from"), "only move and copy take from");
                    None
                }
                (_, None) => None,
            };
            let value = match (&op.op, &op.value) {
                (PatchOp::Add | PatchOp::Replace | PatchOp::Test, Some(v)) => {
                    template(v, format!("{at}.value"), errors)
                }
                (PatchOp::Add | PatchOp::Replace | PatchOp::Test, None) => {
                    errors.push(
                        format!("{at}.value"),
                        format!("{:?} needs a value", op.op).to_lowercase(),
                    );
                    None
                }
                (_, Some(_)) => {
                    errors.push(
                        format!("{at}.value"),
                        "only add, replace and test take a value",
                    );
                    None
                }
                (_, None) => None,
            };
            if let Some(path) = path {
                let Ok(path_buf) = PointerBuf::parse(path.as_str()) else {
                    errors.push(
                        format!("{at}.path"),
                        format!("invalid JSON pointer {:?}", op.path),
                    );
                    continue;
                };
                let from_pointer = from;
                let from = from_pointer
                    .as_ref()
                    .and_then(|f| PointerBuf::parse(f.as_str()).ok());
                steps.push(PatchStep {
                    op: op.op,
                    path,
                    path_buf,
                    from,
                    from_pointer,
                    value,
                });
            }
        }
        return (errors.errors.len() == before).then_some(Mutation::Patch(steps));
    }
    if let Some(u) = p.upsert {
        let path = pointer(&u.path, format!("{at}.upsert.path"), errors);
        if u.key.is_empty() {
            errors.push(
                format!("{at}.upsert.key"),
                "must name the field that identifies an element",
            );
        }
        match u.value.get(&u.key) {
            _ if !u.value.is_object() => {
                errors.push(
                    format!("{at}.upsert.value"),
                    format!("must be an object, not {}", type_name(&u.value)),
                );
            }
            None if !u.key.is_empty() => {
                errors.push(
                    format!("{at}.upsert.value"),
                    format!("has no key field {:?}", u.key),
                );
            }
            _ => {}
        }
        let value = template(&u.value, format!("{at}.upsert.value"), errors);
        if u.key.is_empty() || u.value.get(&u.key).is_none() {
            return None;
        }
        return Some(Mutation::Upsert {
            path: path?,
            key: u.key.clone(),
            value: value?,
        });
    }
    if let Some(r) = p.rewrite {
        let path = pointer(&r.path, format!("{at}.rewrite.path"), errors);
        let regex = match compile_regex(&r.regex, regex_limit) {
            Ok(re) => Some(re),
            Err(e) => {
                errors.push(format!("{at}.rewrite.regex"), e);
                None
            }
        };
        return Some(Mutation::Rewrite {
            path: path?,
            regex: regex?,
            replacement: r.replacement.clone(),
        });
    }
    None
}

impl Mutation {
    /// True when applying it renders no template.
    fn is_literal(&self) -> bool {
        match self {
            Mutation::Merge(t) | Mutation::Upsert { value: t, .. } => t.literal().is_some(),
            Mutation::Patch(steps) => steps
                .iter()
                .all(|s| s.value.as_ref().is_none_or(|t| t.literal().is_some())),
            Mutation::Rewrite { .. } => true,
            Mutation::ForEach { .. } => false,
        }
    }

    /// Applies the mutation at `base` (the object root, or a `forEach` element), recording
    /// in `journal` what it changes. Templates read the object as it is now (`$`) and the
    /// element at `base` (`@`). The error says what went wrong, without the rule name.
    /// `meter` counts what the mutation writes and watches the latency budget.
    pub(crate) fn apply(
        &self,
        doc: &mut Value,
        base: &Pointer,
        journal: &mut Journal,
        meter: &mut Meter,
    ) -> Result<(), Stop> {
        meter.tick()?;
        if let Mutation::ForEach {
            query,
            mutations,
            literal,
        } = self
        {
            let elements = query.locate(doc)?;
            meter.plan_steps(elements.len(), mutations.len())?;
            for element in &elements {
                meter.tick()?;
                let result = if *literal {
                    // Nothing to render: look the element up once for all its mutations.
                    match element.get_mut(doc) {
                        Some(target) => mutations.iter().try_for_each(|m| {
                            m.apply_to(target, element, Rendered::None, journal, meter)
                        }),
                        None => Ok(()),
                    }
                } else {
                    mutations
                        .iter()
                        .try_for_each(|m| m.apply(doc, element, journal, meter))
                };
                result.map_err(|e| {
                    e.context(|e| format!("forEach element {}: {e}", element.as_str()))
                })?;
            }
            return Ok(());
        }
        let rendered = self.render(doc, base, meter)?;
        let target = base
            .get_mut(doc)
            .ok_or_else(|| format!("{} no longer exists", base.as_str()))?;
        self.apply_to(target, base, rendered, journal, meter)
    }

    /// Renders the mutation's templates against the object as it is now.
    fn render(&self, doc: &Value, base: &Pointer, meter: &mut Meter) -> Result<Rendered, Stop> {
        // `@` is looked up only for templates that use it.
        let mut render = |t: &Template| {
            let element = if t.uses_element() {
                base.get(doc)
            } else {
                None
            };
            t.render(
                &Scope {
                    object: doc,
                    element,
                },
                meter,
            )
        };
        Ok(match self {
            Mutation::Merge(t) | Mutation::Upsert { value: t, .. } if t.literal().is_none() => {
                Rendered::One(render(t)?)
            }
            Mutation::Patch(steps) if !self.is_literal() => Rendered::Steps(
                steps
                    .iter()
                    .map(|s| s.value.as_ref().map(&mut render).transpose())
                    .collect::<Result<_, _>>()?,
            ),
            _ => Rendered::None,
        })
    }

    /// Applies the mutation to `target`, the value at `base`, with its templates rendered.
    fn apply_to(
        &self,
        target: &mut Value,
        base: &Pointer,
        rendered: Rendered,
        journal: &mut Journal,
        meter: &mut Meter,
    ) -> Result<(), Stop> {
        match self {
            Mutation::Merge(t) => {
                match (rendered, t.literal()) {
                    (Rendered::One(patch), _) => {
                        count_write(meter, t, Some(&patch), base.depth())?;
                        merge_into(target, base, &patch, journal)
                    }
                    (_, Some(patch)) => {
                        count_write(meter, t, None, base.depth())?;
                        merge_into(target, base, patch, journal)
                    }
                    (_, None) => {
                        return Err(Stop::from("merge patch was not rendered".to_string()));
                    }
                }
                Ok(())
            }
            Mutation::Upsert {
                path,
                key,
                value: template,
            } => {
                let value = match rendered {
                    Rendered::One(v) => v,
                    _ => template
                        .literal()
                        .map(Lit::to_value)
                        .ok_or_else(|| "upsert value was not rendered".to_string())?,
                };
                if value.get(key).is_none() {
                    return Err(Stop::Error(format!(
                        "upsert {}: the value has no key field {key:?}",
                        path.as_str()
                    )));
                }
                // The value lands as an element of the list at `path`.
                let at_depth = base.depth() + path.depth() + 1;
                let rendered = template.literal().is_none().then_some(&value);
                count_write(meter, template, rendered, at_depth)?;
                let at = base.join(path);
                let list = match path.get_mut(target) {
                    Some(list) => list,
                    None => {
                        journal.touch_in(target, base, path);
                        path.get_or_create(target, || Value::Array(Vec::new()))?
                    }
                };
                upsert(list, &at, key, value, journal).map_err(Stop::Error)
            }
            Mutation::Rewrite {
                path,
                regex,
                replacement,
            } => match path.get_mut(target) {
                None => Ok(()),
                Some(Value::String(current)) => {
                    if let Some(new) = rewrite(regex, current, replacement, meter)?
                        && new != *current
                    {
                        let prior = std::mem::replace(current, new);
                        journal.record(base.join(path), Some(&Value::String(prior)));
                    }
                    Ok(())
                }
                Some(other) => Err(Stop::Error(format!(
                    "rewrite {}: the field is {}, not a string",
                    path.as_str(),
                    type_name(other)
                ))),
            },
            Mutation::Patch(steps) => {
                let mut values = match rendered {
                    Rendered::Steps(values) => values.into_iter(),
                    _ => Vec::new().into_iter(),
                };
                for (i, step) in steps.iter().enumerate() {
                    let rendered = values.next().flatten();
                    let at_depth = base.depth() + step.path.depth();
                    match (&step.value, step.op) {
                        (_, PatchOp::Test) => {}
                        (Some(t), _) => count_write(meter, t, rendered.as_ref(), at_depth)
                            .map_err(|e| {
                                e.context(|e| format!("patch[{i}] {}: {e}", step.describe()))
                            })?,
                        (None, PatchOp::Copy | PatchOp::Move) => {
                            // A copy writes the value again; a move only changes how deep it sits.
                            if let Some(from) =
                                step.from_pointer.as_ref().and_then(|f| f.get(target))
                            {
                                let size = measure(
                                    from,
                                    meter.remaining(),
                                    MAX_DEPTH.saturating_sub(at_depth),
                                );
                                let bytes = if step.op == PatchOp::Copy {
                                    size.bytes
                                } else {
                                    0
                                };
                                meter
                                    .write_sized(
                                        Size {
                                            bytes,
                                            depth: size.depth,
                                        },
                                        at_depth,
                                    )
                                    .map_err(|e| {
                                        e.context(|e| {
                                            format!("patch[{i}] {}: {e}", step.describe())
                                        })
                                    })?;
                            }
                        }
                        (None, _) => {}
                    }
                    let value = match rendered {
                        Some(v) => Some(v),
                        None => step
                            .value
                            .as_ref()
                            .and_then(Template::literal)
                            .map(Lit::to_value),
                    };
                    step.apply_to(target, base, value.unwrap_or(Value::Null), journal)
                        .map_err(|e| Stop::Error(format!("patch[{i}] {}: {e}", step.describe())))?;
                }
                Ok(())
            }
            Mutation::ForEach { .. } => Err(Stop::from("forEach cannot be nested".to_string())),
        }
    }
}

/// Counts a template's value about to be written `at_depth` levels below the root: its
/// fixed size, and for a rendered value the depth it reached (what its templates selected
/// was counted while rendering).
fn count_write(
    meter: &mut Meter,
    template: &Template,
    rendered: Option<&Value>,
    at_depth: usize,
) -> Result<(), Stop> {
    let mut size = template.size();
    if let Some(value) = rendered {
        size.depth = measure(value, usize::MAX, MAX_DEPTH.saturating_sub(at_depth)).depth;
    }
    meter.write_sized(size, at_depth)
}

/// `regex.replace_all(text, replacement)`, refusing before it builds a result larger than
/// the rule may still write (a replacement such as `$0$0` doubles the text each time a rule
/// applies it). `None` when nothing matched.
fn rewrite(
    regex: &Regex,
    text: &str,
    replacement: &str,
    meter: &mut Meter,
) -> Result<Option<String>, Stop> {
    // Each `$` reference expands to at most the whole match (groups lie inside it).
    let references = replacement.matches('$').count();
    let limit = meter.remaining();
    let mut out = String::new();
    let mut last = 0;
    let mut matched = false;
    let check = |meter: &mut Meter, out: &String, last: usize, start: usize, end: usize| {
        let most = out.len() + (start - last) + replacement.len() + references * (end - start);
        if most > limit {
            // Counting what it would write fails, with the limit in the message.
            return meter.write(most);
        }
        Ok(())
    };
    if references == 0 {
        for (n, m) in regex.find_iter(text).enumerate() {
            check(meter, &out, last, m.start(), m.end())?;
            out.push_str(&text[last..m.start()]);
            out.push_str(replacement);
            last = m.end();
            matched = true;
            if n % 64 == 63 {
                meter.check_clock()?;
            }
        }
    } else {
        for (n, caps) in regex.captures_iter(text).enumerate() {
            let Some(whole) = caps.get(0) else {
                continue;
            };
            check(meter, &out, last, whole.start(), whole.end())?;
            out.push_str(&text[last..whole.start()]);
            caps.expand(replacement, &mut out);
            last = whole.end();
            matched = true;
            if n % 64 == 63 {
                meter.check_clock()?;
            }
        }
    }
    if !matched {
        return Ok(None);
    }
    out.push_str(&text[last..]);
    meter.write(out.len())?;
    Ok(Some(out))
}

/// Template values rendered for one application of a mutation.
enum Rendered {
    /// Nothing to render: the mutation's values are literal.
    None,
    /// The merge patch or upsert value.
    One(Value),
    /// The value of each patch step.
    Steps(Vec<Option<Value>>),
}

/// Records the parts of `target` a merge patch will change: it recurses where both the patch
/// and the target are objects, and records each place the patch replaces, adds or removes
/// something (places it would leave as they are are not recorded).
fn merge_touches<P: MergePatch>(
    at: &Pointer,
    target: Option<&Value>,
    patch: &P,
    journal: &mut Journal,
) {
    match (patch.entries(), target) {
        (Some(entries), Some(Value::Object(t))) => {
            for (key, value) in entries {
                merge_touches(&at.child(key), t.get(key), value, journal);
            }
        }
        (None, None) if patch.is_null() => {}
        (None, Some(current)) if patch.same_as(current) => {}
        (_, prior) => journal.record(at.clone(), prior),
    }
}

/// Merges `patch` (RFC 7396) into `target`, the value at `base`, recording what it changes.
fn merge_into<P: MergePatch>(target: &mut Value, base: &Pointer, patch: &P, journal: &mut Journal) {
    merge_touches(base, Some(&*target), patch, journal);
    literal::merge(target, patch);
}

impl PatchStep {
    fn describe(&self) -> String {
        let op = format!("{:?}", self.op).to_lowercase();
        format!("{op} {}", self.path.as_str())
    }

    /// The part an operation at `path` changes: the list when it inserts into or removes
    /// from a list (indices after it shift), the path itself otherwise.
    fn touched(target: &Value, path: &Pointer) -> Pointer {
        if let Some(parent) = path.parent()
            && parent.get(target).is_some_and(Value::is_array)
        {
            return parent;
        }
        path.clone()
    }

    fn apply_to(
        &self,
        target: &mut Value,
        base: &Pointer,
        value: Value,
        journal: &mut Journal,
    ) -> Result<(), String> {
        match self.op {
            PatchOp::Test => {}
            PatchOp::Replace => journal.touch_in(target, base, &self.path),
            PatchOp::Add | PatchOp::Remove | PatchOp::Copy => {
                journal.touch_in(target, base, &Self::touched(target, &self.path))
            }
            PatchOp::Move => {
                journal.touch_in(target, base, &Self::touched(target, &self.path));
                if let Some(from) = &self.from_pointer {
                    journal.touch_in(target, base, &Self::touched(target, from));
                }
            }
        }
        // Unlike plain RFC 6902, the operations that write at `path` (add, copy, move) create
        // missing parent objects, so a rule does not depend on whether the object already has,
        // say, annotations.
        if matches!(self.op, PatchOp::Add | PatchOp::Copy | PatchOp::Move)
            && let Some(parent) = self.path.parent()
        {
            parent.get_or_create(target, || Value::Object(Default::default()))?;
        }
        let path = self.path_buf.clone();
        let from = || self.from.clone().unwrap_or_default();
        let op = match self.op {
            PatchOp::Add => PatchOperation::Add(AddOperation { path, value }),
            PatchOp::Remove => PatchOperation::Remove(RemoveOperation { path }),
            PatchOp::Replace => PatchOperation::Replace(ReplaceOperation { path, value }),
            PatchOp::Move => PatchOperation::Move(MoveOperation { from: from(), path }),
            PatchOp::Copy => PatchOperation::Copy(CopyOperation { from: from(), path }),
            PatchOp::Test => PatchOperation::Test(TestOperation { path, value }),
        };
        // The rule's journal makes it atomic, so the patch need not copy the object first.
        json_patch::patch_unsafe(target, &[op]).map_err(|e| e.kind.to_string())
    }
}

/// Replaces the element of `list` whose `key` equals the value's, or appends the value;
/// records only what it changes.
fn upsert(
    list: &mut Value,
    at: &Pointer,
    key: &str,
    value: Value,
    journal: &mut Journal,
) -> Result<(), String> {
    if list.is_null() {
        journal.record(at.clone(), Some(list));
        *list = Value::Array(Vec::new());
    }
    let Value::Array(items) = list else {
        return Err(format!(
            "upsert {}: the field is {}, not a list",
            at.as_str(),
            type_name(list)
        ));
    };
    let id = value.get(key);
    match items.iter().position(|item| item.get(key) == id) {
        Some(i) => {
            if items[i] != value {
                journal.record(at.child(&i.to_string()), Some(&items[i]));
                items[i] = value;
            }
        }
        None => {
            journal.record(at.child(&items.len().to_string()), None);
            items.push(value);
        }
    }
    Ok(())
}
