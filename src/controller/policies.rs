//! The `policies` duty (leader only, `--compile-rules auto`): keeps the
//! MutatingAdmissionPolicies and bindings generated from the Ready rules the API server can
//! serve (`initium_engine::policy`) equal to what the rule table published, and says which are
//! in effect, so the webhook configuration stops covering a compiled rule only once its policy
//! serves it.
//!
//! Every generated object carries the label `initium.dev/compiled-by=<webhook configuration
//! name>`; objects with that label that no Ready rule wants are deleted, bindings first. Each
//! object is owned (ownerReference) by the CustomResourceDefinition
//! `clustermutationrules.initium.dev`: deleting initium's CRDs, which deletes every rule,
//! lets the garbage collector delete the policies too.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use kube::{Api, Client};
use serde_json::{Value, json};
use tokio::sync::watch;

use super::duty::{Context, Duty};
use super::vocabulary::{ControllerError, FIELD_MANAGER, Leader, json_hash};
use super::webhooks::Inputs;
use initium_engine::policy::{OWNER_LABEL, POLICY_API_VERSION};

/// Annotation on a generated object: a hash of what initium generated, so an unchanged policy
/// is not written again.
const HASH_ANNOTATION: &str = "initium.dev/generated-hash";

/// How long after writing a policy the webhook keeps covering its rule: the API server's
/// policy informer picks a new policy up within milliseconds; the margin covers a loaded one.
/// Until then the rule is applied by whichever runs first, never twice (the webhook skips a
/// rule listed in `initium.dev/mutated-by` by this request).
const SETTLE: Duration = Duration::from_secs(2);

const RETRY_FIRST: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(32);
const RESYNC: Duration = Duration::from_secs(60);

fn resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource {
        group: "admissionregistration.k8s.io".into(),
        version: "v1".into(),
        api_version: POLICY_API_VERSION.into(),
        kind: kind.into(),
        plural: plural.into(),
    }
}

pub(crate) struct Policies {
    client: Client,
    needs: watch::Receiver<Arc<Inputs>>,
    leader: Leader,
    /// The installation's name: the value of [`OWNER_LABEL`].
    owner: String,
    in_effect: watch::Sender<Arc<BTreeSet<String>>>,
}

impl Policies {
    pub(crate) fn new(
        client: Client,
        needs: watch::Receiver<Arc<Inputs>>,
        leader: Leader,
        owner: String,
        in_effect: watch::Sender<Arc<BTreeSet<String>>>,
    ) -> Policies {
        Policies {
            client,
            needs,
            leader,
            owner,
            in_effect,
        }
    }
}

/// The object to apply: `generated` with the hash annotation and the owner reference.
fn prepared(generated: &Value, owner: Option<&Value>) -> (Value, String) {
    let hash = format!("{:016x}", json_hash(&None, generated));
    let mut object = generated.clone();
    if let Some(annotations) = object
        .pointer_mut("/metadata/annotations")
        .and_then(Value::as_object_mut)
    {
        annotations.insert(HASH_ANNOTATION.into(), json!(hash));
    }
    if let Some(owner) = owner {
        object["metadata"]["ownerReferences"] = json!([owner]);
    }
    (object, hash)
}

/// Existing generated objects of one kind: name → hash annotation.
async fn existing(
    api: &Api<DynamicObject>,
    owner: &str,
) -> Result<Option<BTreeMap<String, String>>, kube::Error> {
    let params = ListParams::default().labels(&format!("{OWNER_LABEL}={owner}"));
    match api.list_metadata(&params).await {
        Ok(list) => Ok(Some(
            list.items
                .into_iter()
                .filter_map(|o| {
                    let hash = o
                        .metadata
                        .annotations
                        .as_ref()
                        .and_then(|a| a.get(HASH_ANNOTATION).cloned())
                        .unwrap_or_default();
                    Some((o.metadata.name?, hash))
                })
                .collect(),
        )),
        // Not served (before Kubernetes 1.36): nothing generated can exist.
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(None),
        Err(e) => Err(e),
    }
}

impl Policies {
    /// One pass: apply what is wanted and differs, delete what is not wanted. Returns the
    /// names now stored.
    async fn reconcile(&self, inputs: &Inputs) -> Result<BTreeSet<String>, ControllerError> {
        let policies = Api::<DynamicObject>::all_with(
            self.client.clone(),
            &resource("MutatingAdmissionPolicy", "mutatingadmissionpolicies"),
        );
        let bindings = Api::<DynamicObject>::all_with(
            self.client.clone(),
            &resource(
                "MutatingAdmissionPolicyBinding",
                "mutatingadmissionpolicybindings",
            ),
        );
        let list_error =
            |kind: &str, e| ControllerError::api("list", format!("generated {kind}s"), e);
        let Some(have_policies) = existing(&policies, &self.owner)
            .await
            .map_err(|e| list_error("MutatingAdmissionPolicy", e))?
        else {
            return Ok(BTreeSet::new());
        };
        let have_bindings = existing(&bindings, &self.owner)
            .await
            .map_err(|e| list_error("MutatingAdmissionPolicyBinding", e))?
            .unwrap_or_default();
        let owner = if inputs.compiled.is_empty() {
            None
        } else {
            let crds = Api::<CustomResourceDefinition>::all(self.client.clone());
            let name = format!("clustermutationrules.{}", initium_engine::api::GROUP);
            crds.get_opt(&name)
                .await
                .map_err(|e| {
                    ControllerError::api("get", format!("CustomResourceDefinition {name}"), e)
                })?
                .and_then(|crd| {
                    Some(json!({
                        "apiVersion": "apiextensions.k8s.io/v1",
                        "kind": "CustomResourceDefinition",
                        "name": name,
                        "uid": crd.metadata.uid?,
                    }))
                })
        };
        let params = PatchParams::apply(FIELD_MANAGER).force();
        let mut wanted = BTreeSet::new();
        for compiled in &inputs.compiled {
            let generated = &compiled.generated;
            wanted.insert(generated.name.clone());
            // The policy before its binding: a binding to a missing policy is an error the
            // API server reports on every request it matches.
            for (api, object, have, kind) in [
                (
                    &policies,
                    &generated.policy,
                    &have_policies,
                    "MutatingAdmissionPolicy",
                ),
                (
                    &bindings,
                    &generated.binding,
                    &have_bindings,
                    "MutatingAdmissionPolicyBinding",
                ),
            ] {
                let (object, hash) = prepared(object, owner.as_ref());
                if have.get(&generated.name) == Some(&hash) {
                    continue;
                }
                api.patch(&generated.name, &params, &Patch::Apply(&object))
                    .await
                    .map_err(|e| {
                        ControllerError::api(
                            "apply",
                            format!(
                                "{kind} {} (compiled from {})",
                                generated.name,
                                compiled.rule.describe()
                            ),
                            e,
                        )
                    })?;
                tracing::info!(rule = %compiled.rule.describe(), policy = %generated.name, kind, "applied a generated policy object");
            }
        }
        for (api, have, kind) in [
            (&bindings, &have_bindings, "MutatingAdmissionPolicyBinding"),
            (&policies, &have_policies, "MutatingAdmissionPolicy"),
        ] {
            for name in have.keys().filter(|n| !wanted.contains(*n)) {
                match api.delete(name, &DeleteParams::default()).await {
                    Ok(_) => {
                        tracing::info!(policy = %name, kind, "deleted a generated policy object no Ready rule wants")
                    }
                    Err(kube::Error::Api(status)) if status.code == 404 => {}
                    Err(e) => {
                        return Err(ControllerError::api("delete", format!("{kind} {name}"), e));
                    }
                }
            }
        }
        Ok(wanted)
    }
}

impl Duty for Policies {
    const NAME: &'static str = "policies";

    async fn run(&mut self, mut context: Context) -> Result<(), ControllerError> {
        let mut backoff = context.backoff(RETRY_FIRST, RETRY_MAX);
        let mut wait = Duration::ZERO;
        let mut leader = self.leader.clone();
        loop {
            tokio::select! {
                () = context.stop.wait() => return Ok(()),
                () = tokio::time::sleep(wait) => {}
                Ok(()) = self.needs.changed() => {}
                () = leader.changed() => {}
            }
            wait = RESYNC;
            if !leader.is_leader() {
                continue;
            }
            let inputs = self.needs.borrow_and_update().clone();
            if inputs.served.is_none() {
                continue;
            }
            match self.reconcile(&inputs).await {
                Ok(stored) => {
                    backoff.succeeded();
                    let newly = stored
                        .iter()
                        .any(|name| !self.in_effect.borrow().contains(name));
                    if newly {
                        tokio::time::sleep(SETTLE).await;
                    }
                    let stored = Arc::new(stored);
                    self.in_effect.send_if_modified(|current| {
                        if **current == *stored {
                            return false;
                        }
                        *current = stored;
                        true
                    });
                }
                Err(error) => {
                    wait = backoff.failed(
                        "writing the generated MutatingAdmissionPolicies failed; retrying",
                        &error,
                    );
                }
            }
        }
    }
}
