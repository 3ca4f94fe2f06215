//! `initium explain`: per object and rule, what the rule did to it or why it did not apply;
//! offline from files, or with `--cluster` against the rules (and the Namespaces and ConfigMaps
//! they read) of the cluster the kubeconfig names.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Write;
use std::path::PathBuf;

use serde_json::Value;

use crate::{Error, Result};
use initium_engine::api::API_VERSION;
use initium_engine::{RuleId, Step, StepResult};

use super::input::{Document, read_documents};
use super::offline::{
    LoadedRules, compile_documents, describe_object, explain, lookup_store, namespace_labels,
};
use super::{OperationArg, report};

#[derive(clap::Args, Debug)]
pub struct ExplainArgs {
    /// Rule files or directories (`-` for stdin); with --cluster, the cluster's rules are read
    /// instead.
    #[arg(short = 'r', long = "rules", num_args = 1.., required_unless_present = "cluster")]
    pub rules: Vec<PathBuf>,
    /// Object files or directories (`-` for stdin, e.g. `kubectl get pod web -o yaml |
    /// initium explain --cluster -f -`).
    #[arg(short = 'f', long = "filename", required = true, num_args = 1..)]
    pub objects: Vec<PathBuf>,
    /// Read the rules, the Namespaces' labels and the looked-up ConfigMaps from the cluster
    /// (KUBECONFIG), and say which rules are not Ready there.
    #[arg(long, conflicts_with = "rules")]
    pub cluster: bool,
    /// The admission operation to simulate.
    #[arg(long, value_enum, default_value = "CREATE")]
    pub operation: OperationArg,
    /// Namespace for namespaced objects and MutationRules that do not name one.
    #[arg(short = 'n', long, default_value = "default")]
    pub namespace: String,
    /// Also list, one per line, the rules written for other kinds (by default only counted).
    #[arg(long)]
    pub all: bool,
    /// Also say, under each rule, whether `initium serve --compile-rules auto` would have the
    /// API server serve it (and through which MutatingAdmissionPolicy) or the webhook (and
    /// why), and print the generated policies and bindings at the end (as `initium check
    /// --compile` does; kinds resolve from a table of common built-in kinds).
    #[arg(long)]
    pub compile: bool,
}

/// Runs `initium explain`.
pub fn run(args: ExplainArgs, out: &mut dyn Write, err: &mut dyn Write) -> Result<()> {
    let objects = read_documents(&args.objects)?;
    let (rule_docs, mut extra, not_ready) = if args.cluster {
        let fetched = cluster::fetch(&objects, &args.namespace)?;
        (fetched.rules, fetched.context, fetched.not_ready)
    } else {
        (read_documents(&args.rules)?, Vec::new(), BTreeMap::new())
    };
    let (loaded, invalid) = compile_documents(&rule_docs, &args.namespace);
    if !invalid.is_empty() {
        if !args.cluster {
            return Err(Error::InvalidRules(invalid));
        }
        // In a cluster an invalid rule is not Ready and not in effect: say so, go on.
        for e in &invalid {
            report(err, &format!("note: not in effect (invalid): {e}"))?;
        }
    }
    for (rule, reason) in &not_ready {
        report(
            err,
            &format!("note: {rule} is not Ready in the cluster: {reason}"),
        )?;
    }
    let sources = rule_sources(&rule_docs, &args.namespace);
    extra.extend(objects.iter().cloned());
    let namespaces = namespace_labels(&extra);
    let lookups = lookup_store(&loaded.index, &extra, &args.namespace);
    let serving = args.compile.then(|| serving(&loaded));
    let mut text = String::new();
    for doc in &objects {
        let (steps, _) = explain(
            &loaded.index,
            doc,
            args.operation.into(),
            &args.namespace,
            &namespaces,
            &lookups,
        )?;
        render(
            &mut text,
            doc,
            &steps,
            &sources,
            &loaded,
            args.all,
            serving.as_ref(),
        );
    }
    if let Some(serving) = &serving {
        let generated = serving.values().filter_map(|s| s.generated());
        let objects: Vec<&Value> = generated.flat_map(|g| [&g.policy, &g.binding]).collect();
        if !objects.is_empty() {
            text.push_str("# the generated MutatingAdmissionPolicies and bindings\n");
            text.push_str(&super::output::yaml_documents(objects.into_iter())?);
        }
    }
    out.write_all(text.as_bytes())
        .map_err(|e| Error::output("the explanation", e))
}

/// Each rule's document, by id: to quote the field that ruled an object out.
fn rule_sources(docs: &[Document], default_namespace: &str) -> HashMap<RuleId, Value> {
    docs.iter()
        .filter_map(|d| {
            let source = initium_engine::parse_rule(&d.value, default_namespace).ok()?;
            Some((source.id, d.value.clone()))
        })
        .collect()
}

/// How `--compile-rules auto` would serve each rule (offline settings: the installation
/// `initium`, namespaces `initium-system` and `kube-system` left out).
fn serving(loaded: &LoadedRules) -> BTreeMap<RuleId, initium_engine::policy::Serving> {
    use initium_engine::policy::{BuiltinResources, PolicySettings, plan};
    let settings = PolicySettings {
        owner: "initium".into(),
        excluded_namespaces: vec!["initium-system".into(), "kube-system".into()],
        max_compiled: initium_engine::policy::DEFAULT_MAX_COMPILED,
    };
    let specs: Vec<(RuleId, &initium_engine::api::RuleSpec)> = loaded
        .sources
        .iter()
        .map(|s| (s.id.clone(), &s.spec))
        .collect();
    let served = plan(&specs, &BuiltinResources, &settings);
    specs.into_iter().map(|(id, _)| id).zip(served).collect()
}

fn render(
    text: &mut String,
    doc: &Document,
    steps: &[Step],
    sources: &HashMap<RuleId, Value>,
    loaded: &LoadedRules,
    all: bool,
    serving: Option<&BTreeMap<RuleId, initium_engine::policy::Serving>>,
) {
    use std::fmt::Write as _;
    let _ = writeln!(text, "{} ({})", describe_object(&doc.value), doc.origin);
    if loaded.index.is_empty() {
        let _ = writeln!(text, "  no rules");
    }
    let mut other_kinds = Vec::new();
    for step in steps {
        if !all && step.what == StepResult::NotMatched("spec.match.kinds".into()) {
            other_kinds.push(step.rule.describe());
            continue;
        }
        let _ = writeln!(
            text,
            "  {} (priority {}): {}",
            step.rule.describe(),
            step.priority,
            step.describe()
        );
        if let StepResult::NotMatched(field) = &step.what
            && let Some(value) = sources.get(&step.rule).and_then(|d| field_value(d, field))
        {
            let _ = writeln!(text, "      {field}: {value}");
        }
        match serving.and_then(|s| s.get(&step.rule)) {
            Some(initium_engine::policy::Serving::ApiServer(generated)) => {
                let _ = writeln!(
                    text,
                    "      served by the API server: MutatingAdmissionPolicy {}",
                    generated.name
                );
            }
            Some(initium_engine::policy::Serving::Webhook(reason)) => {
                let reason = initium_engine::untrusted::escape(&reason.to_string()).into_owned();
                let _ = writeln!(text, "      served by the webhook: {reason}");
            }
            None => {}
        }
    }
    if !other_kinds.is_empty() {
        let shown: Vec<&str> = other_kinds.iter().take(5).map(String::as_str).collect();
        let more = other_kinds.len().saturating_sub(shown.len());
        let _ = writeln!(
            text,
            "  {} rule(s) for other kinds: {}{} (--all lists them)",
            other_kinds.len(),
            shown.join(", "),
            if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            }
        );
    }
}

/// `spec.conditions[1]` of a rule document as compact JSON, cut to 300 characters.
fn field_value(doc: &Value, field: &str) -> Option<String> {
    let mut pointer = String::new();
    for part in field.split('.') {
        match part.split_once('[') {
            Some((name, index)) => {
                pointer.push('/');
                pointer.push_str(name);
                pointer.push('/');
                pointer.push_str(index.trim_end_matches(']'));
            }
            None => {
                pointer.push('/');
                pointer.push_str(part);
            }
        }
    }
    let mut text = serde_json::to_string(doc.pointer(&pointer)?).ok()?;
    if let Some((at, _)) = text.char_indices().nth(300) {
        text.truncate(at);
        text.push('…');
    }
    Some(text)
}

mod cluster {
    //! What `--cluster` reads: every rule of both kinds with its Ready condition, the
    //! Namespaces of the objects (their labels, for `namespaceSelector`), and the ConfigMaps
    //! the rules look up.

    use super::*;
    use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, ListParams};

    pub(super) struct Fetched {
        pub rules: Vec<Document>,
        /// Namespaces and ConfigMaps, as offline inputs.
        pub context: Vec<Document>,
        /// Rules whose Ready condition is not True, with its message.
        pub not_ready: BTreeMap<String, String>,
    }

    pub(super) fn fetch(objects: &[Document], default_namespace: &str) -> Result<Fetched> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Error::serve_from("cannot start the async runtime", e))?;
        runtime.block_on(fetch_async(objects, default_namespace))
    }

    /// `object` as an input document, with the apiVersion and kind a list or a typed read
    /// leaves out.
    fn document(
        object: &impl serde::Serialize,
        api_version: &str,
        kind: &str,
        what: String,
    ) -> Document {
        let mut value = serde_json::to_value(object).unwrap_or(Value::Null);
        value["apiVersion"] = Value::from(api_version);
        value["kind"] = Value::from(kind);
        Document {
            origin: format!("cluster: {what}"),
            value,
        }
    }

    fn failed(what: String, e: kube::Error) -> Error {
        Error::serve(format!("cannot {what}: {}", crate::report(&e)))
    }

    async fn fetch_async(objects: &[Document], default_namespace: &str) -> Result<Fetched> {
        let client = crate::serve::api_client().await?;
        let mut rules = Vec::new();
        let mut not_ready = BTreeMap::new();
        for (kind, plural) in [
            ("ClusterMutationRule", "clustermutationrules"),
            ("MutationRule", "mutationrules"),
        ] {
            let gvk = GroupVersionKind::gvk(
                initium_engine::api::GROUP,
                initium_engine::api::VERSION,
                kind,
            );
            let resource = ApiResource::from_gvk_with_plural(&gvk, plural);
            let api: Api<DynamicObject> = Api::all_with(client.clone(), &resource);
            let list = api
                .list(&ListParams::default())
                .await
                .map_err(|e| failed(format!("list {plural}"), e))?;
            for item in list.items {
                let name = item.metadata.name.clone().unwrap_or_default();
                let id = match &item.metadata.namespace {
                    Some(ns) => format!("{kind} {ns}/{name}"),
                    None => format!("{kind} {name}"),
                };
                let doc = document(&item, API_VERSION, kind, id.clone());
                let ready = doc
                    .value
                    .pointer("/status/conditions")
                    .and_then(Value::as_array)
                    .and_then(|c| c.iter().find(|c| c["type"] == "Ready"));
                match ready {
                    Some(c) if c["status"] == "True" => {}
                    Some(c) => {
                        not_ready.insert(
                            id.clone(),
                            c["message"].as_str().unwrap_or("no message").to_string(),
                        );
                    }
                    None => {
                        not_ready.insert(id.clone(), "initium has not written a status".into());
                    }
                }
                rules.push(doc);
            }
        }
        let mut context = Vec::new();
        // The objects' Namespaces, for namespaceSelector.
        let wanted: BTreeSet<String> = objects
            .iter()
            .map(|d| {
                d.value
                    .pointer("/metadata/namespace")
                    .and_then(Value::as_str)
                    .filter(|ns| !ns.is_empty())
                    .unwrap_or(default_namespace)
                    .to_string()
            })
            .collect();
        let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
        for ns in &wanted {
            if let Some(found) = namespaces
                .get_opt(ns)
                .await
                .map_err(|e| failed(format!("read namespace {ns}"), e))?
            {
                context.push(document(
                    &found,
                    "v1",
                    "Namespace",
                    format!("Namespace {ns}"),
                ));
            }
        }
        // The ConfigMaps the rules look up: named ones, and for a lookup without a namespace,
        // the one in each object's namespace.
        let (loaded, _) = compile_documents(&rules, default_namespace);
        let mut targets = BTreeSet::new();
        for rule in loaded.index.rules() {
            for target in rule.lookup_targets() {
                match &target.namespace {
                    Some(ns) => {
                        targets.insert((ns.clone(), target.name.clone()));
                    }
                    None => {
                        targets.extend(wanted.iter().map(|ns| (ns.clone(), target.name.clone())))
                    }
                }
            }
        }
        for (ns, name) in targets {
            let api: Api<k8s_openapi::api::core::v1::ConfigMap> =
                Api::namespaced(client.clone(), &ns);
            if let Some(found) = api
                .get_opt(&name)
                .await
                .map_err(|e| failed(format!("read ConfigMap {ns}/{name}"), e))?
            {
                context.push(document(
                    &found,
                    "v1",
                    "ConfigMap",
                    format!("ConfigMap {ns}/{name}"),
                ));
            }
        }
        Ok(Fetched {
            rules,
            context,
            not_ready,
        })
    }
}
