//! The rule index: finds the candidate rules for an object by kind and namespace, without
//! looking at rules for other kinds or other namespaces.

use std::collections::HashMap;
use std::sync::Arc;

use super::kind::Gvk;
use super::rule::CompiledRule;

/// Rule positions (into the index's ordered rule list) for one kind key.
#[derive(Default, Debug)]
struct Bucket {
    /// ClusterMutationRules for any namespace (or with namespace globs).
    cluster_any: Vec<u32>,
    /// ClusterMutationRules listing literal namespaces.
    cluster_by_namespace: HashMap<String, Vec<u32>>,
    /// MutationRules, by their own namespace.
    namespaced: HashMap<String, Vec<u32>>,
}

impl Bucket {
    fn add(&mut self, rule: &CompiledRule, position: u32) {
        match (&rule.id.namespace, rule.literal_namespaces()) {
            (Some(ns), _) => self
                .namespaced
                .entry(ns.to_string())
                .or_default()
                .push(position),
            (None, Some(namespaces)) => {
                for ns in namespaces {
                    let list = self.cluster_by_namespace.entry(ns).or_default();
                    if list.last() != Some(&position) {
                        list.push(position);
                    }
                }
            }
            (None, None) => self.cluster_any.push(position),
        }
    }

    fn collect(&self, namespace: Option<&str>, namespaced_object: bool, out: &mut Vec<u32>) {
        out.extend_from_slice(&self.cluster_any);
        if let Some(ns) = namespace {
            if let Some(list) = self.cluster_by_namespace.get(ns) {
                out.extend_from_slice(list);
            }
            if namespaced_object && let Some(list) = self.namespaced.get(ns) {
                out.extend_from_slice(list);
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
}

impl RuleIndex {
    pub fn new(rules: Vec<CompiledRule>) -> RuleIndex {
        RuleIndex::shared(rules.into_iter().map(Arc::new).collect())
    }

    /// An index of rules shared with the caller.
    pub fn shared(mut rules: Vec<Arc<CompiledRule>>) -> RuleIndex {
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
        if let Some(bucket) = self.by_kind.get(&gvk.kind) {
            bucket.collect(namespace, namespaced_object, &mut positions);
        }
        self.any_kind
            .collect(namespace, namespaced_object, &mut positions);
        positions.sort_unstable();
        positions.dedup();
        positions
            .into_iter()
            .map(|p| &*self.rules[p as usize])
            .collect()
    }
}
