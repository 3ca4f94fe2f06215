//! The `initium.dev/v1alpha1` API: `MutationRule` (namespaced) and `ClusterMutationRule`
//! (cluster-scoped). Both share [`RuleSpec`]; doc comments here become `kubectl explain` text.

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, JSONSchemaProps, ValidationRule,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{
    Condition as StatusCondition, LabelSelector, ObjectMeta,
};
use kube::core::{CustomResourceExt, NamespaceResourceScope, Resource};
use kube::{CustomResource, KubeSchema};
use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Serialize};
use serde_json::Value;

pub const GROUP: &str = "initium.dev";
pub const VERSION: &str = "v1alpha1";
pub const API_VERSION: &str = "initium.dev/v1alpha1";
/// Annotation listing the rules that changed an object, in application order.
pub const MUTATED_BY_ANNOTATION: &str = "initium.dev/mutated-by";
pub const DEFAULT_PRIORITY: i32 = 100;
/// Label initium puts on every Pod it holds with a scheduling gate, so the gate controller
/// watches only those Pods. Removed with initium's last gate.
pub const GATED_LABEL: &str = "initium.dev/gated";
/// Prefix of every scheduling gate initium adds (`initium.dev/<rule>`); only initium removes
/// gates with it.
pub const GATE_PREFIX: &str = "initium.dev/";

/// A rule that initializes new objects: which objects it matches, and the mutations applied
/// to them while the API server holds the request.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "initium.dev",
    version = "v1alpha1",
    kind = "ClusterMutationRule",
    shortname = "cmr",
    category = "initium",
    status = "RuleStatus",
    derive = "PartialEq",
    doc = "ClusterMutationRule mutates matching objects in any namespace (or cluster-scoped objects) while the API server admits them.",
    printcolumn = r#"{"name":"Priority","type":"integer","jsonPath":".spec.priority","description":"Lower runs first"}"#,
    printcolumn = r#"{"name":"Kinds","type":"string","jsonPath":".spec.match.kinds","description":"Kinds the rule matches"}"#,
    printcolumn = r#"{"name":"Mode","type":"string","jsonPath":".spec.mode","description":"Enforce: changes objects; Audit: reports what it would change"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status","description":"Compiled and in the index"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = kube::core::Rule::new("has(self.match.kinds) && size(self.match.kinds) > 0").message("match.kinds must list at least one kind"),
    validation = kube::core::Rule::new("(has(self.mutations) && size(self.mutations) > 0) || has(self.gate)").message("a rule needs at least one mutation, or a gate"),
    validation = kube::core::Rule::new("!has(self.lookups) || self.lookups.all(l, self.lookups.exists_one(m, m.name == l.name))").message("lookup names must be unique within the rule")
)]
pub struct RuleSpec {
    /// Order of application: lower runs first (default 100). Ties are broken by scope
    /// (ClusterMutationRule before MutationRule), then namespace, then name.
    #[serde(default = "default_priority")]
    pub priority: i32,

    /// What happens when this rule fails or the latency budget runs out before it runs:
    /// `Ignore` (default) skips the rule with a warning to the client; `Fail` rejects the object.
    #[serde(default)]
    pub failure_policy: FailurePolicy,

    /// `Enforce` (default) applies the rule's changes. `Audit` evaluates the rule exactly
    /// as an enforced one, at the same place in the order, but keeps none of its changes and
    /// never rejects an object: what it would have changed (or why it would have failed) is
    /// told to the client as a warning, counted per rule in
    /// `initium_rule_audit_changes_total` and `initium_rule_audit_errors_total`, and summed
    /// up in Events on the rule. Rules after it see
    /// the object as if it had not run. See docs/rules.md, "Audit mode".
    #[serde(default)]
    pub mode: Mode,

    /// Which objects the rule applies to. Every field given must hold.
    #[serde(rename = "match")]
    pub match_: MatchResources,

    /// Objects matching this (same shape as `match`, every field given must hold) are skipped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exclude: Option<MatchResources>,

    /// Conditions on the object's content (RFC 9535 JSONPath). All must hold.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub conditions: Vec<Condition>,

    /// The mutations, applied in order; each sees the result of the previous one. Each sets
    /// one kind: `merge`, `patch`, `upsert`, `rewrite`, `defaults`, `remove`, or `forEach`
    /// (with `mutations`). A rule is atomic: if one mutation fails, none of the rule's changes
    /// are kept. May be empty only when the rule has a `gate`.
    #[serde(default)]
    #[schemars(length(max = 64))]
    pub mutations: Vec<Mutation>,

    /// Pods only: at CREATE, hold the Pod with a scheduling gate `initium.dev/<rule>` (added
    /// after the rule's mutations) until every dependency in `waitFor` is ready; initium's
    /// gate controller then removes that gate, and only it. See docs/gates.md.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gate: Option<Gate>,

    /// Objects whose content the rule's templates read: `{{ lookups.<name>.data.<key> }}`
    /// is a JSONPath with `$` the looked-up object (`{{ lookups.ca.data['ca.crt'] }}`).
    /// initium keeps them in memory through watches, so admission makes no API call. Every
    /// lookup must be found when the rule runs: a missing object or key is an error of the
    /// rule, handled by its `failurePolicy`. At most 8, with distinct names. See
    /// docs/rules.md, "Lookups".
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8))]
    pub lookups: Vec<Lookup>,

    /// Pod rules only (`match.kinds: [Pod]`, no `gate`): also apply the rule to the Pod
    /// templates of the built-in controllers when they are admitted, so `kubectl get
    /// deployment -o yaml` shows the change (Kyverno's "autogen"). Off when omitted: initium
    /// then mutates each Pod when it is created, which leaves the controllers as written
    /// (no drift for Argo CD or Flux). The template records the rule in
    /// `initium.dev/mutated-by`, so the Pods it makes are not mutated a second time. See
    /// docs/rules.md, "Pod templates (autogen)".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autogen: Option<Autogen>,
}

/// Which controllers' Pod templates a Pod rule also mutates.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Autogen {
    /// The controllers: `Deployment`, `StatefulSet`, `DaemonSet`, `ReplicaSet`, `Job`,
    /// `CronJob`. Omitted: Deployment, StatefulSet, DaemonSet, Job and CronJob (the
    /// ReplicaSets a Deployment makes copy its already mutated template).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 6))]
    pub controllers: Option<Vec<Controller>>,
}

/// A built-in controller with a Pod template.
#[derive(
    Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord,
)]
pub enum Controller {
    Deployment,
    StatefulSet,
    DaemonSet,
    ReplicaSet,
    Job,
    CronJob,
}

impl Controller {
    pub const ALL: [Controller; 6] = [
        Controller::Deployment,
        Controller::StatefulSet,
        Controller::DaemonSet,
        Controller::ReplicaSet,
        Controller::Job,
        Controller::CronJob,
    ];

    /// What `autogen: {}` covers.
    pub const DEFAULT: [Controller; 5] = [
        Controller::Deployment,
        Controller::StatefulSet,
        Controller::DaemonSet,
        Controller::Job,
        Controller::CronJob,
    ];

    pub fn kind(self) -> &'static str {
        match self {
            Controller::Deployment => "Deployment",
            Controller::StatefulSet => "StatefulSet",
            Controller::DaemonSet => "DaemonSet",
            Controller::ReplicaSet => "ReplicaSet",
            Controller::Job => "Job",
            Controller::CronJob => "CronJob",
        }
    }

    /// The API group that serves it.
    pub fn group(self) -> &'static str {
        match self {
            Controller::Job | Controller::CronJob => "batch",
            _ => "apps",
        }
    }

    /// Where its Pod template is, as JSON pointer tokens.
    pub fn template(self) -> &'static [&'static str] {
        match self {
            Controller::CronJob => &["spec", "jobTemplate", "spec", "template"],
            _ => &["spec", "template"],
        }
    }
}

fn default_priority() -> i32 {
    DEFAULT_PRIORITY
}

/// `Ignore` skips a failing rule with a warning; `Fail` rejects the object.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FailurePolicy {
    #[default]
    Ignore,
    Fail,
}

/// Whether a rule changes objects (`Enforce`) or only reports what it would change (`Audit`).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Mode {
    #[default]
    Enforce,
    Audit,
}

/// An admission operation.
#[derive(
    Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord,
)]
#[serde(rename_all = "UPPERCASE")]
pub enum Operation {
    Create,
    Update,
}

impl Operation {
    pub fn as_str(self) -> &'static str {
        match self {
            Operation::Create => "CREATE",
            Operation::Update => "UPDATE",
        }
    }
}

/// Selects objects. Every field given must hold; an omitted field selects everything.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct MatchResources {
    /// Kinds: `Kind`, `version/Kind` (core group, like `apiVersion: v1`) or
    /// `group/version/Kind`; any segment may be `*`. Required in `match`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub kinds: Vec<String>,

    /// Operations: `CREATE` and/or `UPDATE`. In `match` the default is `[CREATE]`; in
    /// `exclude` an omitted list means any operation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operations: Option<Vec<Operation>>,

    /// Globs (`*`, `?`) on `metadata.name`, or on `metadata.generateName` when the name is
    /// not set yet.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 256))]
    pub names: Vec<String>,

    /// Globs on the object's namespace. ClusterMutationRule only. A rule with `namespaces`
    /// matches only namespaced objects (and Namespace objects by their own name).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 256))]
    pub namespaces: Vec<String>,

    /// Label selector on the object's Namespace. ClusterMutationRule only. A rule with a
    /// namespace selector matches only namespaced objects (and Namespace objects by their own
    /// labels).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<LabelSelector>,

    /// Label selector on the object's own labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<LabelSelector>,

    /// Annotation key -> glob on its value; `*` only requires the key to be present.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// A condition on the object's content. Set `path` and exactly one of `matches`, `equals`,
/// `notEquals`, `exists`, `in`, `greaterThan`, `lessThan`.
// CEL cannot see `equals` (free-form JSON has no type), so "path plus exactly one of
// the tests" is said with property counts; `initium check` and the validating
// webhook give the precise message.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("minProperties" = 2, "maxProperties" = 2))]
pub struct Condition {
    /// RFC 9535 JSONPath over the object, e.g. `$.spec.containers[*].image`.
    #[schemars(length(max = 1024))]
    pub path: String,
    /// Regular expression; holds when any selected string value matches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub matches: Option<String>,
    /// JSON value; holds when any selected value is equal to it (`null` included; numbers
    /// compare by value: `60` equals `60.0`).
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(schema_with = "any_json_nullable")]
    pub equals: Option<Value>,
    /// `true`: the path selects at least one value; `false`: it selects none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exists: Option<bool>,
    /// RFC 9535 JSONPath over the object; holds when any selected value equals any value it
    /// selects (e.g. a volume mount whose name is one of `$.spec.volumes[?@.hostPath].name`).
    #[serde(rename = "in", default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub in_: Option<String>,
    /// JSON value; holds when no selected value equals it (also when the path selects
    /// nothing).
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(schema_with = "any_json_nullable")]
    pub not_equals: Option<Value>,
    /// A number or Kubernetes quantity (`3`, `"0.5"`, `"512Mi"`, `"250m"`); holds when any
    /// selected value (a number or quantity) is greater.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "int_or_string")]
    pub greater_than: Option<Value>,
    /// A number or Kubernetes quantity; holds when any selected value is less.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "int_or_string")]
    pub less_than: Option<Value>,
}

/// Defines the kinds of mutation once: each entry gives a field of [`Mutation`] and of
/// [`ElementMutation`] (with the doc `kubectl explain` prints), its name as a rule writes it,
/// and its [`MutationKind`] variant. From the one list come both structs, [`MUTATION_KINDS`],
/// [`MutationKind`] and its `name`, both `kinds()`, and the struct docs that list the kinds.
/// `forEach` (with its `mutations`) is the one kind an element cannot take, written below.
macro_rules! mutation_kinds {
    ($(
        $(#[doc = $doc:literal])*
        #[kind($name:literal, $variant:ident(&$borrowed:ty), $borrow:ident)]
        $(#[schemars($($schema:tt)*)])?
        $field:ident: $ty:ty,
    )*) => {
        #[doc = concat!(
            "One mutation. Set exactly one of ",
            $("`", $name, "`, ",)*
            "or `forEach` (with `mutations`). String values may contain `{{ <JSONPath> }}` ",
            "templates: `$` is the object, `@` the current `forEach` element; a template that is ",
            "the whole string keeps the JSON type of the selected value."
        )]
        #[derive(Serialize, Deserialize, KubeSchema, Clone, Debug, Default, PartialEq)]
        #[serde(rename_all = "camelCase")]
        #[x_kube(
            validation = exactly_one_of(&MUTATION_KINDS),
            validation = kube::core::Rule::new("has(self.forEach) == has(self.mutations)").message("forEach and mutations go together")
        )]
        pub struct Mutation {
            $(
                $(#[doc = $doc])*
                #[serde(default, skip_serializing_if = "Option::is_none")]
                $(#[schemars($($schema)*)])?
                pub $field: Option<$ty>,
            )*
            /// JSONPath selecting elements (e.g. `$.spec.containers[*]`); `mutations` are
            /// applied to each, with paths relative to the element.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            #[schemars(length(max = 1024))]
            pub for_each: Option<String>,

            /// The mutations applied to each `forEach` element (`forEach` cannot nest).
            #[serde(default, skip_serializing_if = "Option::is_none")]
            #[schemars(length(min = 1, max = 32))]
            pub mutations: Option<Vec<ElementMutation>>,
        }

        #[doc = concat!(
            "A mutation applied to each element selected by `forEach`; paths are relative to the ",
            "element. Set exactly one of ",
            $("`", $name, "`, ",)*
            "(`forEach` cannot nest)."
        )]
        #[derive(Serialize, Deserialize, KubeSchema, Clone, Debug, Default, PartialEq)]
        #[serde(rename_all = "camelCase")]
        #[x_kube(validation = exactly_one_of(&ELEMENT_MUTATION_KINDS))]
        pub struct ElementMutation {
            $(
                $(#[doc = $doc])*
                #[serde(default, skip_serializing_if = "Option::is_none")]
                $(#[schemars($($schema)*)])?
                pub $field: Option<$ty>,
            )*
        }

        /// The kinds of mutation a `forEach` element can take: all but `forEach`, in the order
        /// the CRD's CEL rule and `initium check` list them.
        pub const ELEMENT_MUTATION_KINDS: &[&str] = &[$($name),*];

        /// The kinds of mutation, named as a rule writes them, in the order the CRD's CEL rule
        /// and `initium check` list them. A [`Mutation`] sets exactly one; an
        /// [`ElementMutation`] one of [`ELEMENT_MUTATION_KINDS`].
        pub const MUTATION_KINDS: &[&str] = &[$($name,)* "forEach"];

        /// One kind of mutation as a rule writes it, borrowed from a [`Mutation`] or an
        /// [`ElementMutation`]: what the engine compiles.
        #[derive(Clone, Copy, Debug, PartialEq)]
        pub enum MutationKind<'a> {
            $($variant(&'a $borrowed),)*
            /// The JSONPath, and the mutations for each element (`None` when they are missing).
            ForEach {
                query: &'a str,
                mutations: Option<&'a [ElementMutation]>,
            },
        }

        impl MutationKind<'_> {
            /// The field a rule sets for this kind, as listed in [`MUTATION_KINDS`].
            pub fn name(&self) -> &'static str {
                match self {
                    $(MutationKind::$variant(_) => $name,)*
                    MutationKind::ForEach { .. } => "forEach",
                }
            }
        }

        impl Mutation {
            /// The kinds this mutation sets, in [`MUTATION_KINDS`] order; a valid one sets
            /// exactly one.
            pub fn kinds(&self) -> impl Iterator<Item = MutationKind<'_>> {
                [
                    $(self.$field.$borrow().map(MutationKind::$variant),)*
                    self.for_each.as_deref().map(|query| MutationKind::ForEach {
                        query,
                        mutations: self.mutations.as_deref(),
                    }),
                ]
                .into_iter()
                .flatten()
            }
        }

        impl ElementMutation {
            /// The kinds this element mutation sets, in [`ELEMENT_MUTATION_KINDS`] order; a
            /// valid one sets exactly one.
            pub fn kinds(&self) -> impl Iterator<Item = MutationKind<'_>> {
                [$(self.$field.$borrow().map(MutationKind::$variant),)*]
                    .into_iter()
                    .flatten()
            }
        }
    };
}

mutation_kinds! {
    /// RFC 7396 JSON merge patch applied to the object (in a `forEach`, to the element).
    /// `null` removes a field. Its strings and keys may hold templates, such as
    /// `{{ $.metadata.name }}` or `{{ lower(@.name) }}`.
    #[kind("merge", Merge(&Value), as_ref)]
    #[schemars(schema_with = "any_json_object")]
    merge: Value,

    /// RFC 6902 JSON patch operations (in a `forEach`, with paths relative to the element).
    /// `add`, `copy` and `move` create missing parent objects.
    #[kind("patch", Patch(&[PatchOperation]), as_deref)]
    #[schemars(length(max = 64))]
    patch: Vec<PatchOperation>,

    /// Insert or replace an element of a list of objects, identified by a key field.
    #[kind("upsert", Upsert(&Upsert), as_ref)]
    upsert: Upsert,

    /// Regular-expression rewrite of a string field.
    #[kind("rewrite", Rewrite(&Rewrite), as_ref)]
    rewrite: Rewrite,

    /// Sets fields only where the object (in a `forEach`, the element) has none: an object
    /// shaped like a merge patch, applied field by field, never overwriting a value that is
    /// there (Kyverno's `+(key)` anchors). Where both are objects it goes deeper; a list or
    /// scalar already there is left alone.
    #[kind("defaults", Defaults(&Value), as_ref)]
    #[schemars(schema_with = "any_json_object")]
    defaults: Value,

    /// Removes the elements of a list that satisfy every `where` condition (e.g. every
    /// `hostPath` volume).
    #[kind("remove", Remove(&Remove), as_ref)]
    remove: Remove,
}

/// The message for a value that sets none or several of `fields`, which are alternatives:
/// "set exactly one of a, b, c".
pub fn exactly_one_of_message(fields: &[&str]) -> String {
    format!("set exactly one of {}", fields.join(", "))
}

/// The CEL rule that `kubectl apply` checks for a struct whose `fields` are alternatives.
fn exactly_one_of(fields: &[&str]) -> kube::core::Rule {
    let has: Vec<String> = fields.iter().map(|f| format!("has(self.{f})")).collect();
    kube::core::Rule::new(format!("[{}].filter(x, x).size() == 1", has.join(", ")))
        .message(exactly_one_of_message(fields).as_str())
}

/// One RFC 6902 operation.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PatchOperation {
    /// `add`, `remove`, `replace`, `move`, `copy` or `test`.
    pub op: PatchOp,
    /// RFC 6901 JSON pointer, e.g. `/metadata/annotations/team`.
    #[schemars(length(max = 1024))]
    pub path: String,
    /// Source pointer for `move` and `copy`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    /// Value for `add`, `replace` and `test` (`null` included). Its strings and keys may hold
    /// templates.
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(schema_with = "any_json_nullable")]
    pub value: Option<Value>,
}

/// An RFC 6902 operation name.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum PatchOp {
    Add,
    Remove,
    Replace,
    Move,
    Copy,
    Test,
}

/// Idempotent insert-or-replace in a list of objects: the element whose `key` field equals
/// `value`'s is replaced by `value`; if there is none, `value` is appended. The list (and its
/// parents) are created when absent.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Upsert {
    /// RFC 6901 pointer to the list, e.g. `/spec/volumes`.
    #[schemars(length(max = 1024))]
    pub path: String,
    /// The field that identifies an element, e.g. `name`.
    #[schemars(length(max = 256))]
    pub key: String,
    /// The element; it must have the `key` field. Its strings and keys may hold templates.
    #[schemars(schema_with = "any_json_object")]
    pub value: Value,
    /// Where a new element goes: `Append` (the end of the list, the default) or `Prepend`
    /// (the start, e.g. a sidecar that must run before the app). A replaced element keeps
    /// its place.
    #[serde(default, skip_serializing_if = "Position::is_append")]
    pub position: Position,
}

/// Where `upsert` inserts a new element.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Position {
    #[default]
    Append,
    Prepend,
}

impl Position {
    fn is_append(&self) -> bool {
        *self == Position::Append
    }
}

/// Removes the elements of the list at `path` for which every `where` condition holds.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Remove {
    /// RFC 6901 pointer to the list, e.g. `/spec/volumes` (relative to the element inside
    /// `forEach`). A missing list is left alone.
    #[schemars(length(max = 1024))]
    pub path: String,
    /// Conditions on each element, all of which must hold for it to go. Their paths start
    /// with `@` (the list element, e.g. `@.hostPath`); `in` queries start with `$` (the
    /// object as it is when the mutation runs).
    #[serde(rename = "where")]
    #[schemars(length(min = 1, max = 16))]
    pub where_: Vec<Condition>,
}

/// Rewrites a string field with a regular expression. A missing field is left alone.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Rewrite {
    /// RFC 6901 pointer to a string field, e.g. `/image`.
    #[schemars(length(max = 1024))]
    pub path: String,
    /// Regular expression (Rust `regex` syntax); every match is replaced.
    #[schemars(length(max = 1024))]
    pub regex: String,
    /// Replacement; `$1` or `${name}` refer to capture groups.
    #[schemars(length(max = 1024))]
    pub replacement: String,
}

/// Holds a Pod with a scheduling gate until its dependencies are ready (Pods only).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Gate {
    /// Dependencies; all must hold before the gate is removed.
    #[schemars(length(min = 1, max = 32))]
    pub wait_for: Vec<Dependency>,
    /// How long to wait, e.g. `30s`, `10m`, `1h` (default `10m`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<String>,
    /// After the timeout: `Release` (default) removes the gate anyway; `Hold` keeps it.
    #[serde(default)]
    pub on_timeout: OnTimeout,
}

/// What the gate does when `timeout` passes.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OnTimeout {
    #[default]
    Release,
    Hold,
}

/// The kinds of gate dependency; a [`Dependency`] sets exactly one.
pub const DEPENDENCY_KINDS: [&str; 5] = ["service", "job", "pods", "object", "daemonSet"];

/// One dependency of a gate. Set exactly one field.
#[derive(Serialize, Deserialize, KubeSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = exactly_one_of(&DEPENDENCY_KINDS))]
pub struct Dependency {
    /// A Service with at least one ready endpoint in its EndpointSlices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<NamedRef>,
    /// A Job that has succeeded. Once initium has seen it succeed it stays satisfied, even
    /// after the Job is deleted (e.g. by its TTL).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<NamedRef>,
    /// At least one Ready Pod matching the selector. The selector must not select the Pods
    /// this rule holds (they would wait on themselves).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<PodsRef>,
    /// Any object (any kind the API server serves) whose conditions hold. A MutationRule may
    /// only name a namespaced object of its own namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub object: Option<ObjectRef>,
    /// A DaemonSet with at least one Ready Pod. On release, the Pod's required node affinity
    /// is narrowed to the nodes where that DaemonSet has a Ready Pod (the same-host case).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub daemon_set: Option<NamedRef>,
}

/// A named object; the namespace defaults to the Pod's.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NamedRef {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
}

/// Pods selected by labels; the namespace defaults to the Pod's.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PodsRef {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    pub selector: LabelSelector,
}

/// Any object, with conditions on its content.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ObjectRef {
    pub api_version: String,
    pub kind: String,
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Conditions on the object; all must hold.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub conditions: Vec<Condition>,
}

/// The kinds of object a lookup can read; a [`Lookup`] sets exactly one. ConfigMaps only:
/// reading Secrets would need initium to read every Secret of the cluster.
pub const LOOKUP_KINDS: [&str; 1] = ["configMap"];

/// An object the rule's templates read, by a name of the rule's choosing. Set `name` and
/// exactly one kind of object (today: `configMap`).
#[derive(Serialize, Deserialize, KubeSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = exactly_one_of(&LOOKUP_KINDS))]
pub struct Lookup {
    /// The name templates use, `{{ lookups.<name>... }}`: a lowercase letter, then letters,
    /// digits and `_`. Unique within the rule.
    #[schemars(length(min = 1, max = 63), pattern(r"^[a-z][a-zA-Z0-9_]*$"))]
    pub name: String,
    /// A ConfigMap; in templates `$` is the whole ConfigMap, so values are under `data`
    /// (`{{ lookups.<name>.data.<key> }}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_map: Option<LookupRef>,
}

impl Lookup {
    /// The kinds of object this lookup sets, in [`LOOKUP_KINDS`] order (with the object's
    /// reference); a valid one sets exactly one.
    pub fn kinds(&self) -> impl Iterator<Item = (&'static str, &LookupRef)> {
        // Destructured, so a field added to `Lookup` does not compile until it is listed.
        let Lookup {
            name: _,
            config_map,
        } = self;
        [config_map.as_ref().map(|r| ("configMap", r))]
            .into_iter()
            .flatten()
    }
}

/// The object a lookup reads.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct LookupRef {
    /// The object's name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// The object's namespace. Omitted: the namespace of the object being admitted. A
    /// MutationRule may only read objects of its own namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63))]
    pub namespace: Option<String>,
}

/// Observed state of a rule.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RuleStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`: True when the rule compiled and is in the index; False with the errors.
    /// `Stalled`: True, with the errors, while only a change to the rule can make it Ready.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<StatusCondition>,
}

/// A rule for the objects of one namespace, managed by that namespace's owners. It applies only
/// to namespaced objects in its own namespace and may not set `namespaces` or
/// `namespaceSelector`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct MutationRule {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    pub spec: RuleSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<RuleStatus>,
}

impl MutationRule {
    pub fn new(name: &str, namespace: &str, spec: RuleSpec) -> Self {
        MutationRule {
            api_version: API_VERSION.to_string(),
            kind: "MutationRule".to_string(),
            metadata: ObjectMeta {
                name: Some(name.to_string()),
                namespace: Some(namespace.to_string()),
                ..ObjectMeta::default()
            },
            spec,
            status: None,
        }
    }

    /// The CRD: the ClusterMutationRule schema, namespaced, with the namespace-owner limits
    /// expressed as CEL so `kubectl apply` rejects them.
    pub fn crd() -> CustomResourceDefinition {
        let mut crd = ClusterMutationRule::crd();
        crd.metadata.name = Some(format!("mutationrules.{GROUP}"));
        let names = &mut crd.spec.names;
        names.kind = "MutationRule".into();
        names.list_kind = Some("MutationRuleList".into());
        names.plural = "mutationrules".into();
        names.singular = Some("mutationrule".into());
        names.short_names = Some(vec!["mr".into()]);
        crd.spec.scope = "Namespaced".into();
        for version in &mut crd.spec.versions {
            let Some(schema) = version
                .schema
                .as_mut()
                .and_then(|s| s.open_api_v3_schema.as_mut())
            else {
                continue;
            };
            schema.description = Some(
                "MutationRule mutates matching objects of its own namespace while the API server admits them; namespace owners manage it with RBAC."
                    .into(),
            );
            if let Some(spec) = schema.properties.as_mut().and_then(|p| p.get_mut("spec")) {
                add_validation(
                    spec,
                    "!has(self.match.namespaces) && !has(self.match.namespaceSelector)",
                    "a MutationRule applies only to its own namespace: match.namespaces and match.namespaceSelector are for ClusterMutationRule",
                );
                add_validation(
                    spec,
                    "!has(self.exclude) || (!has(self.exclude.namespaces) && !has(self.exclude.namespaceSelector))",
                    "a MutationRule applies only to its own namespace: exclude.namespaces and exclude.namespaceSelector are for ClusterMutationRule",
                );
            }
        }
        crd
    }
}

fn add_validation(schema: &mut JSONSchemaProps, rule: &str, message: &str) {
    schema
        .x_kubernetes_validations
        .get_or_insert_with(Vec::new)
        .push(ValidationRule {
            rule: rule.into(),
            message: Some(message.into()),
            ..ValidationRule::default()
        });
}

impl Resource for MutationRule {
    type DynamicType = ();
    type Scope = NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        "MutationRule".into()
    }
    fn group(_: &()) -> Cow<'_, str> {
        GROUP.into()
    }
    fn version(_: &()) -> Cow<'_, str> {
        VERSION.into()
    }
    fn plural(_: &()) -> Cow<'_, str> {
        "mutationrules".into()
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// Both CRDs, MutationRule first, with descriptions unwrapped into paragraphs for
/// `kubectl explain`.
pub fn crds() -> Vec<CustomResourceDefinition> {
    [MutationRule::crd(), ClusterMutationRule::crd()]
        .into_iter()
        .map(|mut crd| {
            for version in &mut crd.spec.versions {
                if let Some(schema) = version
                    .schema
                    .as_mut()
                    .and_then(|s| s.open_api_v3_schema.as_mut())
                {
                    unwrap_descriptions(schema);
                }
            }
            crd
        })
        .collect()
}

/// Doc comments are wrapped at 100 columns; `kubectl explain` wraps again, so join lines and
/// keep only paragraph breaks.
fn unwrap_descriptions(schema: &mut JSONSchemaProps) {
    if let Some(d) = schema.description.as_mut() {
        *d = d
            .split("\n\n")
            .map(|p| p.split('\n').map(str::trim).collect::<Vec<_>>().join(" "))
            .collect::<Vec<_>>()
            .join("\n\n");
    }
    for child in schema.properties.iter_mut().flat_map(|p| p.values_mut()) {
        unwrap_descriptions(child);
    }
    if let Some(k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::JSONSchemaPropsOrArray::Schema(items)) =
        schema.items.as_mut()
    {
        unwrap_descriptions(items);
    }
    if let Some(k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::JSONSchemaPropsOrBool::Schema(extra)) =
        schema.additional_properties.as_mut()
    {
        unwrap_descriptions(extra);
    }
}

fn int_or_string(_: &mut SchemaGenerator) -> Schema {
    json_schema!({ "x-kubernetes-int-or-string": true })
}

fn any_json_nullable(_: &mut SchemaGenerator) -> Schema {
    json_schema!({ "x-kubernetes-preserve-unknown-fields": true, "nullable": true })
}

/// A field that is present is `Some`, even when it is `null` (`Option<Value>` alone reads a
/// JSON `null` as absent).
fn present<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(deserializer).map(Some)
}

fn any_json_object(_: &mut SchemaGenerator) -> Schema {
    json_schema!({ "type": "object", "x-kubernetes-preserve-unknown-fields": true })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_kinds_a_mutation_sets_are_the_listed_kinds_in_order() {
        let upsert = json!({"path": "/l", "key": "k", "value": {"k": 1}});
        let rewrite = json!({"path": "/p", "regex": "a", "replacement": "b"});
        let remove = json!({"path": "/l", "where": [{"path": "@.k", "exists": true}]});
        let every: Mutation = serde_json::from_value(json!({
            "remove": remove, "defaults": {}, "rewrite": rewrite, "forEach": "$",
            "mutations": [], "upsert": upsert, "patch": [], "merge": {}
        }))
        .unwrap();
        let names: Vec<&str> = every.kinds().map(|k| k.name()).collect();
        assert_eq!(names, MUTATION_KINDS);
        let every: ElementMutation = serde_json::from_value(json!({
            "remove": remove, "defaults": {}, "rewrite": rewrite, "upsert": upsert,
            "patch": [], "merge": {}
        }))
        .unwrap();
        let names: Vec<&str> = every.kinds().map(|k| k.name()).collect();
        assert_eq!(names, ELEMENT_MUTATION_KINDS);
        assert_eq!(Mutation::default().kinds().count(), 0);
    }

    /// `kubectl explain mutationrule.spec.mutations` prints these descriptions: each lists
    /// every kind a rule may set there.
    #[test]
    fn the_crd_describes_every_kind_of_mutation() {
        for crd in crds() {
            let schema = serde_json::to_value(&crd.spec.versions[0].schema).unwrap();
            let mutations =
                &schema["openAPIV3Schema"]["properties"]["spec"]["properties"]["mutations"];
            let described = mutations["description"].as_str().unwrap();
            for kind in MUTATION_KINDS {
                assert!(
                    described.contains(&format!("`{kind}`")),
                    "{kind} missing from {described}"
                );
            }
            let described = mutations["items"]["description"].as_str().unwrap();
            for kind in MUTATION_KINDS {
                assert!(
                    described.contains(&format!("`{kind}`")),
                    "{kind} missing from {described}"
                );
                assert!(
                    mutations["items"]["properties"].get(kind).is_some(),
                    "{kind}"
                );
            }
            let element = &mutations["items"]["properties"]["mutations"]["items"];
            let described = element["description"].as_str().unwrap();
            for kind in ELEMENT_MUTATION_KINDS {
                assert!(
                    described.contains(&format!("`{kind}`")),
                    "{kind} missing from {described}"
                );
                assert!(element["properties"].get(kind).is_some(), "{kind}");
            }
        }
    }

    #[test]
    fn alternatives_make_one_cel_rule() {
        let rule = serde_json::to_value(exactly_one_of(&["a", "b"])).unwrap();
        assert_eq!(
            rule,
            json!({"rule": "[has(self.a), has(self.b)].filter(x, x).size() == 1", "message": "set exactly one of a, b"})
        );
    }
}
