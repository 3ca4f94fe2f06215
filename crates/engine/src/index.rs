//! The rule index: finds the candidate rules for an object by kind and namespace, without
//! looking at rules for other kinds or other namespaces; among the candidates of one kind and
//! namespace, prefilters (`prefilter.rs`) rule out at once the rules that cannot match.

use foldhash::HashMap;
use std::sync::Arc;

use serde_json::Value;
use smallvec::SmallVec;

use super::kind::Gvk;
use super::path::Pointer;
use super::prefilter::{Prefilter, Reading, Survivors};
use super::rule::CompiledRule;
use super::subject::Subject;

/// Lists shorter than this are matched rule by rule: looking up the prefilters for an object
/// (and again after each rule that changes it) costs more than matching a few rules.
const PREFILTER_FROM: usize = 16;

/// Rule positions (into the index's ordered rule list), ascending, with the prefilter over
/// them when there are many.
#[derive(Default, Debug)]
struct Part {
    positions: Vec<u32>,
    /// Boxed: most parts (a namespace's few rules) have none, and an index of ten thousand
    /// rules has thousands of parts.
    prefilter: Option<Box<Prefilter>>,
}

impl Part {
    fn finish(&mut self, rules: &[Arc<CompiledRule>], prefilter_from: usize) {
        if self.positions.len() >= prefilter_from.max(1) {
            let members: Vec<&CompiledRule> = self
                .positions
                .iter()
                .filter_map(|p| rules.get(*p as usize).map(|r| &**r))
                .collect();
            if members.len() == self.positions.len() {
                self.prefilter = Some(Box::new(Prefilter::new(&members)));
            }
        }
    }
}

/// Rule positions for one kind key.
#[derive(Default, Debug)]
struct Bucket {
    /// ClusterMutationRules for any namespace (or with namespace globs).
    cluster_any: Part,
    /// ClusterMutationRules listing literal namespaces.
    cluster_by_namespace: HashMap<Arc<str>, Part>,
    /// MutationRules, by their own namespace (the key shares the rule id's `Arc<str>`: an
    /// index of ten thousand tenants' rules, rebuilt on every rule change, copies no name).
    namespaced: HashMap<Arc<str>, Part>,
}

impl Bucket {
    fn add(&mut self, rule: &CompiledRule, position: u32) {
        match (&rule.id.namespace, rule.literal_namespaces()) {
            (Some(ns), _) => self
                .namespaced
                .entry(ns.clone())
                .or_default()
                .positions
                .push(position),
            (None, Some(namespaces)) => {
                for ns in namespaces {
                    let list = &mut self
                        .cluster_by_namespace
                        .entry(Arc::from(ns))
                        .or_default()
                        .positions;
                    if list.last() != Some(&position) {
                        list.push(position);
                    }
                }
            }
            (None, None) => self.cluster_any.positions.push(position),
        }
    }

    fn finish(&mut self, rules: &[Arc<CompiledRule>], prefilter_from: usize) {
        self.cluster_any.finish(rules, prefilter_from);
        for part in self
            .cluster_by_namespace
            .values_mut()
            .chain(self.namespaced.values_mut())
        {
            part.finish(rules, prefilter_from);
        }
    }

    /// The parts that hold the candidates for an object of `namespace`.
    fn parts<'b>(
        &'b self,
        namespace: Option<&str>,
        namespaced_object: bool,
        out: &mut Vec<&'b Part>,
    ) {
        out.push(&self.cluster_any);
        if let Some(ns) = namespace {
            if let Some(part) = self.cluster_by_namespace.get(ns) {
                out.push(part);
            }
            if namespaced_object && let Some(part) = self.namespaced.get(ns) {
                out.push(part);
            }
        }
    }
}

/// Every compiled rule, in the total order, plus lookup tables by kind. Rules are shared
/// (`Arc`) with whoever compiled them: `initium serve` rebuilds the index on every rule change
/// from the rules it keeps compiled, without copying them.
#[derive(Default, Debug)]
pub struct RuleIndex {
    rules: Vec<Arc<CompiledRule>>,
    by_kind: HashMap<String, Bucket>,
    any_kind: Bucket,
    /// Pod rules with `spec.autogen`, by the kinds of the controllers whose templates they
    /// mutate. Never prefiltered: the prefilters read the object's own fields, and these
    /// rules match the template's.
    templates: HashMap<String, Bucket>,
}

impl RuleIndex {
    pub fn new(rules: Vec<CompiledRule>) -> RuleIndex {
        RuleIndex::shared(rules.into_iter().map(Arc::new).collect())
    }

    /// An index of rules shared with the caller.
    pub fn shared(rules: Vec<Arc<CompiledRule>>) -> RuleIndex {
        RuleIndex::with_prefilter_from(rules, PREFILTER_FROM)
    }

    /// [`RuleIndex::shared`], with prefilters over lists of at least `prefilter_from` rules
    /// (tests use small ones, to check the prefilters on few rules).
    pub(crate) fn with_prefilter_from(
        mut rules: Vec<Arc<CompiledRule>>,
        prefilter_from: usize,
    ) -> RuleIndex {
        rules.sort_by(|a, b| a.order(b));
        let mut index = RuleIndex::default();
        for (position, rule) in rules.iter().enumerate() {
            let position = position as u32;
            let mut wildcard = false;
            let mut kinds: Vec<&str> = Vec::new();
            for pattern in rule.kinds() {
                match pattern.kind.exact() {
                    Some(kind) if !kinds.contains(&kind) => kinds.push(kind),
                    Some(_) => {}
                    None => wildcard = true,
                }
            }
            for pattern in rule.template_kinds() {
                if let Some(kind) = pattern.kind.exact() {
                    index
                        .templates
                        .entry(kind.to_string())
                        .or_default()
                        .add(rule, position);
                }
            }
            if wildcard {
                index.any_kind.add(rule, position);
            } else {
                for kind in kinds {
                    index
                        .by_kind
                        .entry(kind.to_string())
                        .or_default()
                        .add(rule, position);
                }
            }
        }
        index.any_kind.finish(&rules, prefilter_from);
        for bucket in index.by_kind.values_mut() {
            bucket.finish(&rules, prefilter_from);
        }
        for bucket in index.templates.values_mut() {
            bucket.finish(&rules, usize::MAX);
        }
        index.rules = rules;
        index
    }

    pub fn rules(&self) -> &[Arc<CompiledRule>] {
        &self.rules
    }

    pub fn len(&self) -> usize {
        self.rules.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// The rules that may apply, in order. `namespace` is the object's namespace (for a
    /// Namespace object, its own name); `namespaced_object` is false for cluster-scoped objects.
    pub fn candidates(
        &self,
        gvk: &Gvk,
        namespace: Option<&str>,
        namespaced_object: bool,
    ) -> Vec<&CompiledRule> {
        let mut positions = Vec::new();
        for part in self.parts(gvk, namespace, namespaced_object) {
            positions.extend_from_slice(&part.positions);
        }
        positions.sort_unstable();
        positions.dedup();
        positions
            .into_iter()
            .map(|p| &*self.rules[p as usize])
            .collect()
    }

    fn parts(&self, gvk: &Gvk, namespace: Option<&str>, namespaced_object: bool) -> Vec<&Part> {
        let mut parts = Vec::new();
        if let Some(bucket) = self.by_kind.get(&gvk.kind) {
            bucket.parts(namespace, namespaced_object, &mut parts);
        }
        if let Some(bucket) = self.templates.get(&gvk.kind) {
            bucket.parts(namespace, namespaced_object, &mut parts);
        }
        self.any_kind
            .parts(namespace, namespaced_object, &mut parts);
        parts
    }

    /// [`RuleIndex::candidates`] one at a time; with [`Candidates::prefilter`], without the
    /// rules the prefilters rule out.
    pub(crate) fn candidate_cursor(
        &self,
        gvk: &Gvk,
        namespace: Option<&str>,
        namespaced_object: bool,
    ) -> Candidates<'_> {
        Candidates {
            rules: &self.rules,
            parts: self
                .parts(gvk, namespace, namespaced_object)
                .into_iter()
                .filter(|part| !part.positions.is_empty())
                .map(|part| Cursor {
                    part,
                    next: 0,
                    survivors: None,
                    peeked: None,
                })
                .collect(),
            last: None,
        }
    }
}

/// The candidate rules for one object, in the rules' order: a merge of the parts that hold
/// them, each read past the rules its prefilter rules out.
pub(crate) struct Candidates<'i> {
    rules: &'i [Arc<CompiledRule>],
    parts: Vec<Cursor<'i>>,
    /// The last rule given (a rule is given once, whichever parts hold it).
    last: Option<u32>,
}

struct Cursor<'i> {
    part: &'i Part,
    /// The next offset into the part to look at.
    next: usize,
    /// `None`: every rule of the part is a candidate.
    survivors: Option<Survivors>,
    /// The next candidate's offset, once looked up.
    peeked: Option<usize>,
}

impl Cursor<'_> {
    fn peek(&mut self) -> Option<u32> {
        let offset = match self.peeked {
            Some(offset) => offset,
            None => {
                let offset = match (&self.part.prefilter, &self.survivors) {
                    (Some(prefilter), Some(survivors)) => {
                        prefilter.next_survivor(survivors, self.next)
                    }
                    _ => self.next,
                };
                self.peeked = Some(offset);
                offset
            }
        };
        self.part.positions.get(offset).copied()
    }

    fn advance(&mut self) {
        if let Some(offset) = self.peeked.take() {
            self.next = offset + 1;
        }
    }
}

impl<'i> Candidates<'i> {
    /// Turns the prefilters on, for `doc` (the object the first rule sees).
    pub fn prefilter(&mut self, subject: &Subject, doc: &Value) {
        let mut reading = Reading::new(subject, doc);
        for cursor in &mut self.parts {
            if let Some(prefilter) = &cursor.part.prefilter {
                cursor.survivors = Some(prefilter.survivors(&mut reading));
                cursor.peeked = None;
            }
        }
    }

    /// A rule changed `doc` at (or below) `touched`: the rules after it are looked up again
    /// where the prefilters read what it touched.
    pub fn object_changed<'p>(
        &mut self,
        subject: &Subject,
        doc: &Value,
        touched: impl Iterator<Item = &'p Pointer>,
    ) {
        if !self.is_prefiltered() {
            return;
        }
        let touched: SmallVec<[&Pointer; 8]> = touched.collect();
        let mut reading = Reading::changed(subject, doc, &touched);
        for cursor in &mut self.parts {
            if let (Some(prefilter), Some(survivors)) =
                (&cursor.part.prefilter, &mut cursor.survivors)
                && prefilter.refresh(survivors, &mut reading)
            {
                // A rule ruled out before may survive now, and its turn may have passed
                // while another part gave the rules before this one: it is not looked at
                // again.
                if let Some(last) = self.last {
                    let passed = cursor.part.positions.partition_point(|p| *p <= last);
                    cursor.next = cursor.next.max(passed);
                }
                cursor.peeked = None;
            }
        }
    }

    /// True when a part's candidates are prefiltered: what a rule changes may change them.
    fn is_prefiltered(&self) -> bool {
        self.parts.iter().any(|cursor| cursor.survivors.is_some())
    }

    /// True when no rule is a candidate.
    pub fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    /// The next candidate, in order.
    pub fn next_rule(&mut self) -> Option<&'i CompiledRule> {
        loop {
            let mut first: Option<(usize, u32)> = None;
            for (i, cursor) in self.parts.iter_mut().enumerate() {
                if let Some(position) = cursor.peek()
                    && first.is_none_or(|(_, p)| position < p)
                {
                    first = Some((i, position));
                }
            }
            let (i, position) = first?;
            if let Some(cursor) = self.parts.get_mut(i) {
                cursor.advance();
            }
            if self.last == Some(position) {
                continue;
            }
            self.last = Some(position);
            return self.rules.get(position as usize).map(|r| &**r);
        }
    }
}
