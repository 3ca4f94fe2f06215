//! The objects lookups read ([`LookupStore`]), by where one watch looks ([`LookupScope`]),
//! and what one lookup reads ([`LookupTarget`]). Filled by the watches of `initium serve` and
//! from the input files offline; read by the engine on the request path.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::sync::Arc;

use serde_json::Value;

/// A kind of object a lookup reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LookupKind {
    ConfigMap,
}

impl LookupKind {
    /// The kind as the API server names it.
    pub fn as_str(self) -> &'static str {
        match self {
            LookupKind::ConfigMap => "ConfigMap",
        }
    }
}

/// What a lookup reads: one object name of one kind, in one namespace or (`namespace: None`)
/// in the namespace of whatever object is admitted. Rules that read the same target share
/// it; targets of one [`LookupScope`] share its watch.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LookupTarget {
    pub kind: LookupKind,
    pub namespace: Option<String>,
    pub name: String,
}

impl LookupTarget {
    /// The watch that reads it.
    pub fn scope(&self) -> LookupScope {
        LookupScope {
            kind: self.kind,
            namespace: self.namespace.clone(),
        }
    }
}

/// Where one watch of lookups looks: the objects of one kind in one namespace, or
/// (`namespace: None`) in every namespace, for lookups that read the admitted object's own
/// namespace. One watch per scope, whatever the number of names read there: the watch keeps
/// only the objects whose names rules read, and drops the others as they arrive. So the
/// watches (and the API server connections they hold) are bounded by the namespaces rules
/// look up in, plus one, never by the names.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LookupScope {
    pub kind: LookupKind,
    pub namespace: Option<String>,
}

impl fmt::Display for LookupScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.namespace {
            Some(ns) => write!(f, "{}s in namespace {ns}", self.kind.as_str()),
            None => write!(f, "{}s in every namespace", self.kind.as_str()),
        }
    }
}

impl fmt::Display for LookupTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.namespace {
            Some(ns) => write!(f, "{} {ns}/{}", self.kind.as_str(), self.name),
            None => write!(
                f,
                "{} {} (in every namespace)",
                self.kind.as_str(),
                self.name
            ),
        }
    }
}

/// The objects one scope's watch keeps, as it last saw them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ScopeObjects {
    /// The names the watch was keeping when it last listed: for them, an object that is not
    /// here does not exist. A name rules started to read since has not been read yet.
    pub listed: BTreeSet<String>,
    /// The objects by name, then by namespace, as JSON (`managedFields` left out).
    pub objects: HashMap<String, HashMap<String, Arc<Value>>>,
}

impl ScopeObjects {
    /// How many objects it holds.
    pub fn count(&self) -> usize {
        self.objects.values().map(HashMap::len).sum()
    }
}

/// Every object lookups may read, by scope. Swapped whole when a watch sees a change; a
/// request reads one version from start to end.
#[derive(Clone, Debug, Default)]
pub struct LookupStore {
    scopes: HashMap<LookupScope, Arc<ScopeObjects>>,
}

impl LookupStore {
    pub fn new(scopes: HashMap<LookupScope, Arc<ScopeObjects>>) -> LookupStore {
        LookupStore { scopes }
    }

    /// The store for offline runs: every target of `targets` listed, filled from `objects`
    /// (kind, namespace, object), as if the inputs were the cluster.
    pub fn offline<'a>(
        targets: impl IntoIterator<Item = LookupTarget>,
        objects: impl IntoIterator<Item = (LookupKind, &'a str, &'a Value)> + Clone,
    ) -> LookupStore {
        let mut scopes: HashMap<LookupScope, ScopeObjects> = HashMap::new();
        for target in targets {
            let scope = scopes.entry(target.scope()).or_default();
            scope.listed.insert(target.name.clone());
            for (kind, namespace, object) in objects.clone() {
                let name = object.pointer("/metadata/name").and_then(Value::as_str);
                if kind == target.kind
                    && name == Some(target.name.as_str())
                    && target.namespace.as_deref().is_none_or(|ns| ns == namespace)
                {
                    scope
                        .objects
                        .entry(target.name.clone())
                        .or_default()
                        .insert(namespace.to_string(), Arc::new(object.clone()));
                }
            }
        }
        LookupStore {
            scopes: scopes
                .into_iter()
                .map(|(scope, objects)| (scope, Arc::new(objects)))
                .collect(),
        }
    }

    /// How many scopes (watches) the store holds.
    pub fn len(&self) -> usize {
        self.scopes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.scopes.is_empty()
    }

    pub(crate) fn get(
        &self,
        scope: &LookupScope,
        name: &str,
        namespace: &str,
    ) -> Result<Option<&Value>, NotSynced> {
        let objects = self.scopes.get(scope).ok_or(NotSynced)?;
        if !objects.listed.contains(name) {
            return Err(NotSynced);
        }
        Ok(objects
            .objects
            .get(name)
            .and_then(|by_namespace| by_namespace.get(namespace))
            .map(|v| &**v))
    }
}

pub(crate) struct NotSynced;
