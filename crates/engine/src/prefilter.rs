//! Prefilters over one list of candidate rules (a part of an index bucket: rules for one kind
//! and namespace). For an object, they find which rules can still match it for all the rules
//! at once, from what the object has — its labels, its annotation keys, its name, the values a
//! JSONPath selects — instead of asking each rule in turn.
//!
//! Each rule is kept by necessary conditions of its `match` and `conditions` ([`Needs`],
//! `Conditions::first_regex`): a rule they rule out would not have matched, and would not have
//! failed either; the rules they keep are matched in full. A rule that changes the object
//! can make a later rule match: the facets that read a part it touched are looked up again
//! (for labels and annotations, only when it touched a key some rule reads).

use foldhash::{HashMap, HashSet};

use regex::{RegexSet, RegexSetBuilder};

use crate::limits::{REGEX_WORK_PER_BYTE_BASE, RuleRegex};
use serde_json::{Map, Value};
use smallvec::{SmallVec, smallvec};

use crate::api::Operation;

use super::matching::{Candidate, LabelNeed};
use super::path::{Pointer, Query, after_token, escape};
use super::rule::CompiledRule;
use super::subject::Subject;

/// Rules per bitset word.
const WORD: usize = 64;

/// The `matches` patterns of one JSONPath compiled into one `RegexSet`, at most...
const REGEXES_PER_SET: usize = 4096;

/// ...within these limits (a set that does not fit leaves its rules unfiltered: they are
/// matched one by one, as without a prefilter).
const SET_SIZE_LIMIT: usize = 64 << 20;
const SET_DFA_SIZE_LIMIT: usize = 16 << 20;

/// The search work one `RegexSet` of many tenants' patterns may do on one text. A set's
/// search cannot be interrupted and costs the text's length times the size of every pattern
/// in it, one tenant's pathological pattern included; on a longer text the prefilter keeps
/// every rule of the set, and each rule's own match searches within its own bound
/// ([`crate::limits::REGEX_SEARCH_WORK`]), charged to that rule alone.
const SET_SEARCH_WORK: u64 = 32_000_000;

/// A `RegexSet` and the longest text it may search within [`SET_SEARCH_WORK`].
#[derive(Debug)]
struct SearchSet {
    set: RegexSet,
    max_bytes: usize,
}

/// A set of the part's rules, by offset in the part.
type Bits = Vec<u64>;

fn words(len: usize) -> usize {
    len.div_ceil(WORD)
}

fn insert(bits: &mut [u64], offset: usize) {
    if let Some(word) = bits.get_mut(offset / WORD) {
        *word |= 1 << (offset % WORD);
    }
}

fn union(into: &mut [u64], bits: &[u64]) {
    for (a, b) in into.iter_mut().zip(bits) {
        *a |= b;
    }
}

/// The rules keyed on one value (a label value, a name prefix, an annotation key).
#[derive(Debug, PartialEq)]
enum Members {
    /// Few: setting their bits one by one costs less than a word-by-word union.
    Few(Vec<u32>),
    Many(Bits),
}

impl Members {
    fn new(offsets: Vec<u32>, len: usize) -> Members {
        if offsets.len() <= words(len) {
            return Members::Few(offsets);
        }
        let mut bits = vec![0; words(len)];
        for offset in offsets {
            insert(&mut bits, offset as usize);
        }
        Members::Many(bits)
    }

    fn add_to(&self, out: &mut [u64]) {
        match self {
            Members::Few(offsets) => {
                for offset in offsets {
                    insert(out, *offset as usize);
                }
            }
            Members::Many(bits) => union(out, bits),
        }
    }
}

/// Offsets by key while a prefilter is built.
#[derive(Default)]
struct Keyed(HashMap<String, Vec<u32>>);

impl Keyed {
    fn add(&mut self, key: &str, offset: u32) {
        let list = self.0.entry(key.to_string()).or_default();
        if list.last() != Some(&offset) {
            list.push(offset);
        }
    }

    fn finish(self, len: usize) -> HashMap<String, Members> {
        self.0
            .into_iter()
            .map(|(key, offsets)| (key, Members::new(offsets, len)))
            .collect()
    }
}

/// `labels`: a rule is kept when the object has the label (and value) it needs.
#[derive(Debug)]
struct LabelFilter {
    /// Rules that need no label.
    free: Bits,
    keys: HashMap<String, LabelKey>,
    /// The keys of `keys` as a JSON pointer writes them: a change to another label leaves
    /// this facet as it was.
    read: HashSet<Vec<u8>>,
}

#[derive(Debug, Default)]
struct LabelKey {
    /// Rules that need the key with any value (`Exists`).
    any_value: Option<Members>,
    /// Rules that need the key with this value (`matchLabels`, `In`).
    values: HashMap<String, Members>,
}

/// Map keys as a JSON pointer's token writes them.
fn written<'k>(keys: impl Iterator<Item = &'k String>) -> HashSet<Vec<u8>> {
    keys.map(|key| escape(key).as_bytes().to_vec()).collect()
}

/// `out` becomes a copy of `bits`, in the memory it has.
fn reset(out: &mut Bits, bits: &[u64]) {
    out.clear();
    out.extend_from_slice(bits);
}

impl LabelFilter {
    fn kept(&self, labels: Option<&Map<String, Value>>, out: &mut Bits) {
        reset(out, &self.free);
        let Some(labels) = labels else {
            return;
        };
        let mut add = |rules: &LabelKey, value: &Value| {
            // The selector reads a label that is not a string as absent.
            let Some(value) = value.as_str() else {
                return;
            };
            if let Some(any) = &rules.any_value {
                any.add_to(out);
            }
            if let Some(members) = rules.values.get(value) {
                members.add_to(out);
            }
        };
        // Whichever side has fewer keys is walked, the other searched.
        if self.keys.len() < labels.len() {
            for (key, rules) in &self.keys {
                if let Some(value) = labels.get(key) {
                    add(rules, value);
                }
            }
        } else {
            for (key, value) in labels {
                if let Some(rules) = self.keys.get(key) {
                    add(rules, value);
                }
            }
        }
    }
}

/// `names`: a rule is kept when the name starts with the literal prefix of one of its globs
/// (or, for a glob that starts with a wildcard, ends with its literal suffix).
#[derive(Debug)]
struct NameFilter {
    /// Rules without names, or with a glob that has neither (`*`).
    free: Bits,
    prefixes: Affixes,
    suffixes: Affixes,
}

#[derive(Debug, Default)]
struct Affixes {
    by_text: HashMap<String, Members>,
    /// The byte lengths of the keys, ascending: one lookup per length.
    lengths: Vec<usize>,
    /// What every key starts with (prefixes) or ends with (suffixes): a text without it has
    /// none of the keys, and is ruled out before any lookup. The rules of one bucket often
    /// share it (`^registry\.corp/team-…`, `batch-…-*`).
    common: String,
}

/// Which end of a text the keys of [`Affixes`] are read from.
#[derive(Clone, Copy)]
enum End {
    Start,
    End,
}

impl Affixes {
    fn new(keyed: Keyed, len: usize, end: End) -> Affixes {
        let mut lengths: Vec<usize> = keyed.0.keys().map(String::len).collect();
        lengths.sort_unstable();
        lengths.dedup();
        let common = common_affix(keyed.0.keys().map(String::as_str), end).to_string();
        Affixes {
            by_text: keyed.finish(len),
            lengths,
            common,
        }
    }

    /// Adds the rules keyed on a prefix (`End::Start`) or suffix (`End::End`) of `text`.
    fn add_kept(&self, text: &str, end: End, out: &mut [u64]) {
        let has_common = match end {
            End::Start => text.starts_with(self.common.as_str()),
            End::End => text.ends_with(self.common.as_str()),
        };
        if !has_common {
            return;
        }
        for &length in &self.lengths {
            if length > text.len() {
                break;
            }
            let affix = match end {
                End::Start => text.get(..length),
                End::End => text.get(text.len() - length..),
            };
            if let Some(members) = affix.and_then(|a| self.by_text.get(a)) {
                members.add_to(out);
            }
        }
    }
}

/// The longest text that all `keys` start (`End::Start`) or end (`End::End`) with, cut at a
/// character boundary; empty when there are no keys.
fn common_affix<'k>(mut keys: impl Iterator<Item = &'k str>, end: End) -> &'k str {
    let Some(mut common) = keys.next() else {
        return "";
    };
    for key in keys {
        let shared = match end {
            End::Start => common
                .bytes()
                .zip(key.bytes())
                .take_while(|(a, b)| a == b)
                .count(),
            End::End => common
                .bytes()
                .rev()
                .zip(key.bytes().rev())
                .take_while(|(a, b)| a == b)
                .count(),
        };
        let mut cut = match end {
            End::Start => shared,
            End::End => common.len() - shared,
        };
        while !common.is_char_boundary(cut) {
            match end {
                End::Start => cut -= 1,
                End::End => cut += 1,
            }
        }
        common = match end {
            End::Start => common.get(..cut).unwrap_or(""),
            End::End => common.get(cut..).unwrap_or(""),
        };
    }
    common
}

impl NameFilter {
    fn kept(&self, name: &str, out: &mut Bits) {
        reset(out, &self.free);
        self.prefixes.add_kept(name, End::Start, out);
        self.suffixes.add_kept(name, End::End, out);
    }
}

/// `annotations`: a rule is kept when the object has the first annotation key it needs.
#[derive(Debug)]
struct AnnotationFilter {
    free: Bits,
    keys: HashMap<String, Members>,
    /// The keys of `keys` as a JSON pointer writes them.
    read: HashSet<Vec<u8>>,
}

impl AnnotationFilter {
    fn kept(&self, annotations: Option<&Map<String, Value>>, out: &mut Bits) {
        reset(out, &self.free);
        let Some(annotations) = annotations else {
            return;
        };
        // Whichever side has fewer keys is walked, the other searched.
        if self.keys.len() < annotations.len() {
            for (key, members) in &self.keys {
                if annotations.get(key).is_some_and(Value::is_string) {
                    members.add_to(out);
                }
            }
        } else {
            for (key, value) in annotations {
                if value.is_string()
                    && let Some(members) = self.keys.get(key)
                {
                    members.add_to(out);
                }
            }
        }
    }
}

/// `conditions`: a rule is kept when a value its first `matches` condition's path selects
/// matches the regex; every pattern on one path is tried at once.
#[derive(Debug)]
struct ConditionFilter {
    /// Rules without such a condition.
    free: Bits,
    paths: Vec<PathFilter>,
}

#[derive(Debug)]
struct PathFilter {
    query: Query,
    /// The rules whose condition reads this path.
    members: Bits,
    /// The rules whose pattern is anchored at the start and begins with a literal, by that
    /// literal: a value matches only if it starts with it (a lookup, not a regex search).
    prefixes: Affixes,
    /// The other patterns, and the rule of each pattern, where a path has more than a few.
    sets: Vec<(SearchSet, Vec<u32>)>,
}

/// Where a path has at most this many patterns that are not anchored prefixes, their rules
/// are not filtered on them: the prefilter would search each pattern on every value, and
/// again after every change to what the path selects, where the rule's own match searches
/// it once (a profile put a one-pattern set at a tenth of an admission; searched one by
/// one, the engine benchmark's one such pattern ran three times per admission, then once
/// more in its rule's match).
const UNFILTERED_UP_TO: usize = 4;

/// The literal text every match of `pattern` starts the haystack with, when the pattern says
/// so plainly: `^` then literal characters (`\.`-style escapes of punctuation included), as in
/// `^registry\.example\.com/`. Anything else (flags, alternation, classes, other escapes) gives
/// `None`, and the pattern is searched with the others.
fn anchored_prefix(pattern: &str) -> Option<String> {
    let rest = pattern.strip_prefix('^')?;
    // Flags may change what ^ or a letter means ((?m), (?i), (?x)); `|` may end the anchor's
    // reach.
    if pattern.contains("(?") || pattern.contains('|') {
        return None;
    }
    let mut prefix = String::new();
    let mut chars = rest.chars().peekable();
    while let Some(c) = chars.next() {
        let literal = match c {
            '\\' => match chars.next() {
                // `\<` and `\>` are word boundaries, not characters.
                Some(escaped)
                    if escaped.is_ascii_punctuation() && !matches!(escaped, '<' | '>') =>
                {
                    escaped
                }
                _ => break,
            },
            '.' | '+' | '*' | '?' | '(' | ')' | '[' | ']' | '{' | '}' | '^' | '$' => break,
            c => c,
        };
        match chars.peek() {
            // The character may be absent, or repeated: it is not part of every match.
            Some('?' | '*' | '{') => break,
            // At least once: the prefix ends with it.
            Some('+') => {
                prefix.push(literal);
                break;
            }
            _ => prefix.push(literal),
        }
    }
    (!prefix.is_empty()).then_some(prefix)
}

impl PathFilter {
    /// Adds the rules whose pattern matches a selected value.
    fn add_kept<'q>(&'q self, reading: &mut Reading<'q, '_>, out: &mut [u64]) {
        let Some(values) = reading.selected(&self.query) else {
            // The rule would fail on the query: it is not ruled out here.
            union(out, &self.members);
            return;
        };
        for text in values {
            self.prefixes.add_kept(text, End::Start, out);
            for (set, offsets) in &self.sets {
                if text.len() > set.max_bytes {
                    for offset in offsets {
                        insert(out, *offset as usize);
                    }
                    continue;
                }
                if !set.set.is_match(text) {
                    continue;
                }
                for pattern in set.set.matches(text).iter() {
                    if let Some(offset) = offsets.get(pattern) {
                        insert(out, *offset as usize);
                    }
                }
            }
        }
    }
}

/// What the prefilters read of the object, once for all the parts that read it: the parts
/// of one admission often hold rules with the same JSONPath.
pub(crate) struct Reading<'q, 'd> {
    subject: &'d Subject<'d>,
    doc: &'d Value,
    /// The object's metadata as the match fields read it, looked up when a facet needs it
    /// (after most changes none does).
    candidate: Option<Candidate<'d>>,
    /// The strings each path selects (`None`: the query fails), by the path's text.
    selected: Vec<(&'q str, Option<Vec<&'d str>>)>,
    /// What a rule that changed the object touched, when one did.
    touched: Option<Touched<'q, 'd>>,
}

/// The parts of the object a rule touched, as the prefilters read them.
struct Touched<'q, 'd> {
    pointers: &'d [&'d Pointer],
    /// Whether each path (by its text) may select something else, once told.
    paths: SmallVec<[(&'q str, bool); 4]>,
    labels: MapTouch<'d>,
    annotations: MapTouch<'d>,
    name: bool,
}

/// What one change did to a metadata map (labels or annotations).
#[derive(Clone, Copy, Debug, PartialEq)]
enum MapChange<'p> {
    /// Nothing in it.
    Not,
    /// The entry with this key (as the pointer writes it, escaped), or inside it.
    Key(&'p [u8]),
    /// The map itself, or what holds it.
    Whole,
}

/// What all of a rule's changes did to a metadata map: a rule that adds a label touches one
/// key, and only the rules that read that key are looked at again.
#[derive(Default)]
enum MapTouch<'d> {
    #[default]
    Not,
    Keys(SmallVec<[&'d [u8]; 4]>),
    Whole,
}

impl<'d> MapTouch<'d> {
    fn add(&mut self, change: MapChange<'d>) {
        match (&mut *self, change) {
            (_, MapChange::Not) | (MapTouch::Whole, _) => {}
            (_, MapChange::Whole) => *self = MapTouch::Whole,
            (MapTouch::Keys(keys), MapChange::Key(key)) => keys.push(key),
            (MapTouch::Not, MapChange::Key(key)) => *self = MapTouch::Keys(smallvec![key]),
        }
    }

    /// True when a key of `read` (written escaped), or the whole map, was touched.
    fn reaches(&self, read: &HashSet<Vec<u8>>) -> bool {
        match self {
            MapTouch::Not => false,
            MapTouch::Keys(keys) => keys.iter().any(|key| read.contains(*key)),
            MapTouch::Whole => true,
        }
    }
}

/// What a change at `pointer` may have changed of the metadata the facets read, from its
/// text (a change at, above or below a field changes it): (labels, annotations, name).
fn metadata_touched(pointer: &Pointer) -> (MapChange<'_>, MapChange<'_>, bool) {
    let text = pointer.as_str().as_bytes();
    let Some(rest) = after_token(text, b"/metadata") else {
        // The root, replaced whole, holds every field; any other change is outside metadata.
        return if text.is_empty() {
            (MapChange::Whole, MapChange::Whole, true)
        } else {
            (MapChange::Not, MapChange::Not, false)
        };
    };
    let Some(rest) = rest.strip_prefix(b"/") else {
        return (MapChange::Whole, MapChange::Whole, true);
    };
    // The field's token as written: a pointer's escapes are valid, and none spells a letter.
    let map = |name: &[u8]| match after_token(rest, name) {
        None => MapChange::Not,
        Some(after) => match after.strip_prefix(b"/") {
            None => MapChange::Whole,
            Some(entry) => MapChange::Key(entry.split(|&b| b == b'/').next().unwrap_or(entry)),
        },
    };
    let field = |name: &[u8]| after_token(rest, name).is_some();
    (
        map(b"labels"),
        map(b"annotations"),
        field(b"name") || field(b"generateName"),
    )
}

impl<'q, 'd> Reading<'q, 'd> {
    pub fn new(subject: &'d Subject<'d>, doc: &'d Value) -> Reading<'q, 'd> {
        Reading {
            subject,
            doc,
            candidate: None,
            selected: Vec::new(),
            touched: None,
        }
    }

    /// The object after a rule changed it at (or below) `touched`, which covers every change.
    pub fn changed(
        subject: &'d Subject<'d>,
        doc: &'d Value,
        touched: &'d [&'d Pointer],
    ) -> Reading<'q, 'd> {
        let (mut labels, mut annotations, mut name) =
            (MapTouch::default(), MapTouch::default(), false);
        for pointer in touched {
            let (l, a, n) = metadata_touched(pointer);
            labels.add(l);
            annotations.add(a);
            name |= n;
        }
        Reading {
            touched: Some(Touched {
                pointers: touched,
                paths: SmallVec::new(),
                labels,
                annotations,
                name,
            }),
            ..Reading::new(subject, doc)
        }
    }

    fn candidate(&mut self) -> Candidate<'d> {
        *self
            .candidate
            .get_or_insert_with(|| Candidate::new(self.subject, self.doc))
    }

    fn selected(&mut self, query: &'q Query) -> Option<&[&'d str]> {
        let text = query.text();
        let at = match self.selected.iter().position(|(t, _)| *t == text) {
            Some(at) => at,
            None => {
                let mut strings = Vec::new();
                let values = query
                    .select_each(self.doc, &mut |value| {
                        if let Some(text) = value.as_str() {
                            strings.push(text);
                        }
                    })
                    .ok()
                    .map(|()| strings);
                self.selected.push((text, values));
                self.selected.len() - 1
            }
        };
        self.selected
            .get(at)
            .and_then(|(_, values)| values.as_deref())
    }

    /// Whether `query` may select something else than before the change (told once for all
    /// the parts whose rules read the same path).
    fn path_touched(&mut self, query: &'q Query) -> bool {
        let Some(touched) = &mut self.touched else {
            return true;
        };
        let text = query.text();
        if let Some((_, told)) = touched.paths.iter().find(|(t, _)| *t == text) {
            return *told;
        }
        let told = touched.pointers.iter().any(|p| query.may_select_under(p));
        touched.paths.push((text, told));
        told
    }
}

/// The prefilters over one list of rules, in the index's order.
#[derive(Debug)]
pub(crate) struct Prefilter {
    len: usize,
    /// By `operation_slot`: the rules that accept the operation.
    operations: [Bits; 2],
    /// Rules with a namespaceSelector (in `match` or `exclude`): where it cannot be told,
    /// they fail rather than not match, so only what comes before it may rule them out.
    namespace_selector: Bits,
    labels: LabelFilter,
    names: NameFilter,
    annotations: AnnotationFilter,
    conditions: ConditionFilter,
}

fn operation_slot(operation: Operation) -> usize {
    match operation {
        Operation::Create => 0,
        Operation::Update => 1,
    }
}

impl Prefilter {
    pub fn new(rules: &[&CompiledRule]) -> Prefilter {
        let len = rules.len();
        let empty = || vec![0u64; words(len)];
        let mut operations = [empty(), empty()];
        let mut namespace_selector = empty();
        let (mut label_free, mut name_free, mut annotation_free, mut condition_free) =
            (empty(), empty(), empty(), empty());
        let mut label_values: HashMap<String, Keyed> = HashMap::default();
        let mut label_keys = Keyed::default();
        let (mut prefixes, mut suffixes, mut annotation_keys) =
            (Keyed::default(), Keyed::default(), Keyed::default());
        // Patterns by path text: (the query, (regex, offset)...).
        let mut patterns: Vec<(&Query, Vec<(&RuleRegex, u32)>)> = Vec::new();
        let mut path_of: HashMap<&str, usize> = HashMap::default();

        for (offset, rule) in rules.iter().enumerate() {
            let at = offset as u32;
            let needs = rule.needs();
            for operation in [Operation::Create, Operation::Update] {
                if needs.operations.is_empty() || needs.operations.contains(&operation) {
                    insert(&mut operations[operation_slot(operation)], offset);
                }
            }
            if rule.needs_namespace_labels() {
                insert(&mut namespace_selector, offset);
            }
            match needs.label {
                None => insert(&mut label_free, offset),
                Some(LabelNeed::Key(key)) => label_keys.add(key, at),
                Some(LabelNeed::Value(key, values)) => {
                    let keyed = label_values.entry(key.to_string()).or_default();
                    for value in values {
                        keyed.add(value, at);
                    }
                }
            }
            let mut any_name = needs.names.is_empty();
            for glob in needs.names {
                let (prefix, suffix) = (glob.literal_prefix(), glob.literal_suffix());
                if !prefix.is_empty() {
                    prefixes.add(&prefix, at);
                } else if !suffix.is_empty() {
                    suffixes.add(&suffix, at);
                } else {
                    any_name = true;
                }
            }
            if any_name {
                insert(&mut name_free, offset);
            }
            match needs.annotation {
                Some(key) => annotation_keys.add(key, at),
                None => insert(&mut annotation_free, offset),
            }
            match rule.first_regex() {
                Some((query, regex)) => {
                    let slot = *path_of.entry(query.text()).or_insert_with(|| {
                        patterns.push((query, Vec::new()));
                        patterns.len() - 1
                    });
                    if let Some((_, list)) = patterns.get_mut(slot) {
                        list.push((regex, at));
                    }
                }
                None => insert(&mut condition_free, offset),
            }
        }

        let mut keys: HashMap<String, LabelKey> = label_values
            .into_iter()
            .map(|(key, values)| {
                (
                    key,
                    LabelKey {
                        any_value: None,
                        values: values.finish(len),
                    },
                )
            })
            .collect();
        for (key, members) in label_keys.finish(len) {
            keys.entry(key).or_default().any_value = Some(members);
        }
        let annotation_keys = annotation_keys.finish(len);
        let mut paths = Vec::new();
        for (query, list) in patterns {
            let mut members = empty();
            let mut prefixes = Keyed::default();
            let mut searched = Vec::new();
            for (regex, offset) in list {
                match anchored_prefix(regex.as_str()) {
                    Some(prefix) => {
                        prefixes.add(&prefix, offset);
                        insert(&mut members, offset as usize);
                    }
                    None => searched.push((regex, offset)),
                }
            }
            let mut sets = Vec::new();
            if searched.len() <= UNFILTERED_UP_TO {
                for (_, offset) in searched {
                    insert(&mut condition_free, offset as usize);
                }
            } else {
                for chunk in searched.chunks(REGEXES_PER_SET) {
                    let built = RegexSetBuilder::new(chunk.iter().map(|(regex, _)| regex.as_str()))
                        .size_limit(SET_SIZE_LIMIT)
                        .dfa_size_limit(SET_DFA_SIZE_LIMIT)
                        .build();
                    for (_, offset) in chunk {
                        insert(
                            if built.is_ok() {
                                &mut members
                            } else {
                                &mut condition_free
                            },
                            *offset as usize,
                        );
                    }
                    if let Ok(set) = built {
                        // Searched as one automaton: one lazy-DFA base per byte, and the
                        // states of every pattern.
                        let per_byte =
                            chunk.iter().fold(REGEX_WORK_PER_BYTE_BASE, |sum, (r, _)| {
                                sum.saturating_add(r.work_per_byte() - REGEX_WORK_PER_BYTE_BASE)
                            });
                        let max_bytes =
                            usize::try_from(SET_SEARCH_WORK / per_byte).unwrap_or(usize::MAX);
                        let set = SearchSet { set, max_bytes };
                        sets.push((set, chunk.iter().map(|(_, offset)| *offset).collect()));
                    }
                }
            }
            let prefixes = Affixes::new(prefixes, len, End::Start);
            if !sets.is_empty() || !prefixes.lengths.is_empty() {
                paths.push(PathFilter {
                    query: query.clone(),
                    members,
                    prefixes,
                    sets,
                });
            }
        }
        Prefilter {
            len,
            operations,
            namespace_selector,
            labels: LabelFilter {
                free: label_free,
                read: written(keys.keys()),
                keys,
            },
            names: NameFilter {
                free: name_free,
                prefixes: Affixes::new(prefixes, len, End::Start),
                suffixes: Affixes::new(suffixes, len, End::End),
            },
            annotations: AnnotationFilter {
                free: annotation_free,
                read: written(annotation_keys.keys()),
                keys: annotation_keys,
            },
            conditions: ConditionFilter {
                free: condition_free,
                paths,
            },
        }
    }

    /// The rules that may match the object read (as the rules before have left it).
    pub fn survivors<'q>(&'q self, reading: &mut Reading<'q, '_>) -> Survivors {
        let candidate = reading.candidate();
        let mut survivors = Survivors {
            operation: operation_slot(candidate.operation()),
            cannot_tell: candidate.namespace_labels_unknown(),
            labels: Vec::with_capacity(words(self.len)),
            annotations: Vec::with_capacity(words(self.len)),
            names: Vec::with_capacity(words(self.len)),
            conditions: self.conditions.free.clone(),
            kept: Vec::with_capacity(words(self.len)),
        };
        self.labels.kept(candidate.labels(), &mut survivors.labels);
        self.annotations
            .kept(candidate.annotations(), &mut survivors.annotations);
        self.names.kept(candidate.glob_name(), &mut survivors.names);
        for path in &self.conditions.paths {
            path.add_kept(reading, &mut survivors.conditions);
        }
        self.spare_namespace_selectors(&mut survivors);
        self.combine(&mut survivors);
        survivors
    }

    /// Looks again at what a rule changed (a reading made by [`Reading::changed`]); false when
    /// it touched nothing this prefilter reads.
    pub fn refresh<'q>(&'q self, survivors: &mut Survivors, reading: &mut Reading<'q, '_>) -> bool {
        let (labels, annotations, name) = match &reading.touched {
            Some(t) => (
                t.labels.reaches(&self.labels.read),
                t.annotations.reaches(&self.annotations.read),
                t.name,
            ),
            None => (true, true, true),
        };
        let mut refreshed = false;
        if labels {
            let candidate = reading.candidate();
            self.labels.kept(candidate.labels(), &mut survivors.labels);
            refreshed = true;
        }
        if annotations {
            let candidate = reading.candidate();
            self.annotations
                .kept(candidate.annotations(), &mut survivors.annotations);
            refreshed = true;
        }
        if name {
            let candidate = reading.candidate();
            self.names.kept(candidate.glob_name(), &mut survivors.names);
            refreshed = true;
        }
        for path in &self.conditions.paths {
            if reading.path_touched(&path.query) {
                for (kept, members) in survivors.conditions.iter_mut().zip(&path.members) {
                    *kept &= !members;
                }
                path.add_kept(reading, &mut survivors.conditions);
                refreshed = true;
            }
        }
        if refreshed {
            self.spare_namespace_selectors(survivors);
            self.combine(survivors);
        }
        refreshed
    }

    /// Where a namespaceSelector cannot be told, its rules fail (by their failurePolicy) unless
    /// ruled out before the selector is read: by operation or name, not by labels, annotations
    /// or conditions, which are read after it.
    fn spare_namespace_selectors(&self, survivors: &mut Survivors) {
        if survivors.cannot_tell {
            union(&mut survivors.labels, &self.namespace_selector);
            union(&mut survivors.annotations, &self.namespace_selector);
            union(&mut survivors.conditions, &self.namespace_selector);
        }
    }

    /// `survivors.kept`: the rules every facet keeps, and that accept the operation.
    fn combine(&self, survivors: &mut Survivors) {
        let n = words(self.len);
        let kept = &mut survivors.kept;
        kept.clear();
        kept.resize(n, 0);
        let facets = (
            kept.get_mut(..n),
            self.operations[survivors.operation].get(..n),
            survivors.labels.get(..n),
            survivors.annotations.get(..n),
            survivors.names.get(..n),
            survivors.conditions.get(..n),
        );
        if let (Some(k), Some(o), Some(l), Some(a), Some(names), Some(c)) = facets {
            // Slices of one length: no bounds checks, and the words are ANDed a few at once.
            for i in 0..n {
                k[i] = o[i] & l[i] & a[i] & names[i] & c[i];
            }
        }
    }

    /// The first surviving offset at or after `from` (`len()` when none).
    pub fn next_survivor(&self, survivors: &Survivors, from: usize) -> usize {
        let kept = survivors.kept.as_slice();
        let mut index = from / WORD;
        let Some(first) = kept.get(index) else {
            return self.len;
        };
        let mut bits = first & (!0u64 << (from % WORD));
        while bits == 0 {
            index += 1;
            match kept.get(index) {
                Some(next) => bits = *next,
                None => return self.len,
            }
        }
        (index * WORD + bits.trailing_zeros() as usize).min(self.len)
    }
}

/// For one object, the rules of a [`Prefilter`] that each facet keeps.
#[derive(Debug)]
pub(crate) struct Survivors {
    operation: usize,
    /// The labels of the object's Namespace are not known (see `spare_namespace_selectors`).
    cannot_tell: bool,
    labels: Bits,
    annotations: Bits,
    names: Bits,
    conditions: Bits,
    /// What all of them keep: the candidates, read word by word by `next_survivor`.
    kept: Bits,
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests;
