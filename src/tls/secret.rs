//! The self-managed Secret: how the certificates are stored in it, its creation by the first
//! replica (conflicts: the first writer wins), and the leader's renewals and repairs.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use kube::api::{ObjectMeta, PostParams};

use super::pki::{Material, Meta, Plan, now_unix, plan};
use super::{TlsError, server_config};

/// The annotation with what initium knows about the certificates in the Secret (rcgen cannot
/// read certificates back, and the renewal plan needs more than their validity).
const META_ANNOTATION: &str = "initium.dev/certificates";

/// Data keys of the Secret. `tls.crt`/`tls.key` make it usable as a `kubernetes.io/tls`
/// Secret; `ca.crt` is the caBundle (every CA to trust, the signing one first).
const TLS_CRT: &str = "tls.crt";
const TLS_KEY: &str = "tls.key";
const CA_BUNDLE: &str = "ca.crt";
const SIGNING_CA_CRT: &str = "signing-ca.crt";
const SIGNING_CA_KEY: &str = "signing-ca.key";
const NEXT_CA_CRT: &str = "next-ca.crt";
const NEXT_CA_KEY: &str = "next-ca.key";

impl Material {
    pub(crate) fn from_secret(secret: &Secret) -> Result<Material, String> {
        let data = secret.data.clone().unwrap_or_default();
        let text = |key: &str| -> Result<String, String> {
            let bytes = data
                .get(key)
                .ok_or_else(|| format!("the Secret has no {key}"))?;
            String::from_utf8(bytes.0.clone()).map_err(|_| format!("{key} is not PEM text"))
        };
        let meta_json = secret
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(META_ANNOTATION))
            .ok_or_else(|| format!("the Secret has no {META_ANNOTATION} annotation"))?;
        let meta: Meta = serde_json::from_str(meta_json)
            .map_err(|e| format!("the {META_ANNOTATION} annotation is not valid: {e}"))?;
        let next_ca = match meta.next_ca {
            Some(_) => Some((text(NEXT_CA_CRT)?, text(NEXT_CA_KEY)?)),
            None => None,
        };
        let material = Material {
            meta,
            serving_cert: text(TLS_CRT)?,
            serving_key: text(TLS_KEY)?,
            ca_bundle: text(CA_BUNDLE)?,
            signing_ca_cert: text(SIGNING_CA_CRT)?,
            signing_ca_key: text(SIGNING_CA_KEY)?,
            next_ca,
        };
        server_config(
            material.serving_cert.as_bytes(),
            material.serving_key.as_bytes(),
        )?;
        Ok(material)
    }

    /// The Secret holding this material (`resource_version` makes a replace conditional).
    pub(crate) fn to_secret(&self, name: &str, resource_version: Option<String>) -> Secret {
        let mut data = BTreeMap::new();
        let mut put = |key: &str, value: &str| {
            data.insert(key.to_string(), ByteString(value.as_bytes().to_vec()));
        };
        put(TLS_CRT, &self.serving_cert);
        put(TLS_KEY, &self.serving_key);
        put(CA_BUNDLE, &self.ca_bundle);
        put(SIGNING_CA_CRT, &self.signing_ca_cert);
        put(SIGNING_CA_KEY, &self.signing_ca_key);
        if let Some((cert, key)) = &self.next_ca {
            put(NEXT_CA_CRT, cert);
            put(NEXT_CA_KEY, key);
        }
        Secret {
            metadata: ObjectMeta {
                name: Some(name.into()),
                resource_version,
                labels: Some(BTreeMap::from([(
                    "app.kubernetes.io/managed-by".to_string(),
                    "initium".to_string(),
                )])),
                annotations: Some(BTreeMap::from([(
                    META_ANNOTATION.to_string(),
                    serde_json::to_string(&self.meta).unwrap_or_default(),
                )])),
                ..ObjectMeta::default()
            },
            type_: Some("kubernetes.io/tls".into()),
            data: Some(data),
            ..Secret::default()
        }
    }
}

fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

/// Reads the Secret, creating it if it is missing (or replacing it if it is unusable). The
/// first writer wins: a replica whose create or replace conflicts reads the winner's.
pub(super) async fn load_or_create(
    api: &Api<Secret>,
    name: &str,
    names: &[String],
    origin: &str,
) -> Result<Material, TlsError> {
    let make = |message: String| TlsError::Certificate {
        origin: origin.to_string(),
        message,
    };
    let mut last_conflict = None;
    for _ in 0..5 {
        let existing = api
            .get_opt(name)
            .await
            .map_err(|e| TlsError::api("get", origin, e))?;
        let resource_version = match &existing {
            None => None,
            Some(secret) => match Material::from_secret(secret) {
                Ok(material) => return Ok(material),
                Err(why) => {
                    tracing::warn!(secret = %origin, problem = %why, "the TLS Secret is unusable; replacing it");
                    secret.metadata.resource_version.clone()
                }
            },
        };
        let material = Material::create(names, now_unix()).map_err(make)?;
        let secret = material.to_secret(name, resource_version.clone());
        let written = match resource_version {
            None => api.create(&PostParams::default(), &secret).await,
            Some(_) => api.replace(name, &PostParams::default(), &secret).await,
        };
        match written {
            Ok(_) => {
                tracing::info!(secret = %origin, names = ?names, "created a CA and serving certificate");
                return Ok(material);
            }
            Err(e) if is_conflict(&e) => last_conflict = Some(e),
            Err(e) => return Err(TlsError::api("create", origin, e)),
        }
    }
    Err(match last_conflict {
        Some(e) => TlsError::api("create", origin, e),
        None => make("gave up after repeated conflicts".into()),
    })
}

/// Reads the Secret; while leading, renews what is due, and writes a missing or unusable
/// Secret again from `current`, the material this replica serves and publishes now. Returns
/// the material now in the Secret, if usable (`None`: keep `current`).
///
/// A lost Secret never makes a new CA here: `current` is what every API server trusts, so
/// writing it back changes nothing for them. Should `current` be due for a new CA (even
/// expired), the renewal below stages it like any rotation: the new CA joins the caBundle
/// first and signs only [`CA_PROPAGATION`](super::pki::CA_PROPAGATION) later. A replica that does not lead never writes
/// the Secret; it keeps serving `current` until the leader has written it again.
pub(super) async fn refresh_secret(
    api: &Api<Secret>,
    name: &str,
    names: &[String],
    leading: bool,
    current: &Material,
    origin: &str,
) -> Result<Option<Material>, TlsError> {
    let secret = api
        .get_opt(name)
        .await
        .map_err(|e| TlsError::api("get", origin, e))?;
    let found = secret.as_ref().map(Material::from_secret);
    let resource_version = secret.and_then(|s| s.metadata.resource_version);
    let (mut material, mut resource_version) = match found {
        Some(Ok(material)) => (material, resource_version),
        _ if !leading => return Ok(None),
        problem => {
            match &problem {
                Some(Err(why)) => {
                    tracing::warn!(secret = %origin, problem = %why, "the TLS Secret is unusable; writing it again from the certificates in use")
                }
                _ => {
                    tracing::warn!(secret = %origin, "the TLS Secret is missing; writing it again from the certificates in use")
                }
            }
            let secret = current.to_secret(name, resource_version.clone());
            let (action, written) = match resource_version {
                None => ("create", api.create(&PostParams::default(), &secret).await),
                Some(_) => (
                    "replace",
                    api.replace(name, &PostParams::default(), &secret).await,
                ),
            };
            match written {
                Ok(written) => {
                    tracing::info!(secret = %origin, "wrote the TLS Secret again: same CA and serving certificate");
                    (current.clone(), written.metadata.resource_version)
                }
                // Someone else wrote it meanwhile: read theirs next time.
                Err(e) if is_conflict(&e) => return Ok(None),
                Err(e) => return Err(TlsError::api(action, origin, e)),
            }
        }
    };
    if !leading {
        return Ok(Some(material));
    }
    let make = |message: String| TlsError::Certificate {
        origin: origin.to_string(),
        message,
    };
    // At most a rename and a CA step; each step is written before the next is decided.
    for _ in 0..3 {
        let now = now_unix();
        let step = plan(&material.meta, names, now);
        if step == Plan::Keep {
            break;
        }
        let renewed = material.renew(step, names, now).map_err(make)?;
        match api
            .replace(
                name,
                &PostParams::default(),
                &renewed.to_secret(name, resource_version.clone()),
            )
            .await
        {
            Ok(written) => {
                tracing::info!(secret = %origin, step = ?step, "renewed the certificates");
                resource_version = written.metadata.resource_version;
                material = renewed;
            }
            // Someone else wrote meanwhile: look again next time.
            Err(e) if is_conflict(&e) => break,
            Err(e) => return Err(TlsError::api("replace", origin, e)),
        }
    }
    Ok(Some(material))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
pub(crate) mod tests {
    use std::sync::Arc;

    use kube::Client;
    use serde_json::json;

    use super::*;
    use crate::tls::pki::tests::{names, trusted};

    #[test]
    fn material_survives_the_secret() {
        let material = Material::create(&names(), now_unix()).unwrap();
        let secret = material.to_secret("initium-tls", None);
        assert_eq!(secret.type_.as_deref(), Some("kubernetes.io/tls"));
        assert_eq!(Material::from_secret(&secret).unwrap(), material);

        let mut broken = secret.clone();
        broken.data.as_mut().unwrap().remove(TLS_KEY);
        assert!(
            Material::from_secret(&broken)
                .unwrap_err()
                .contains("tls.key")
        );
        let mut mismatched = secret;
        let other = Material::create(&names(), now_unix()).unwrap();
        mismatched
            .data
            .as_mut()
            .unwrap()
            .insert(TLS_KEY.into(), ByteString(other.serving_key.into_bytes()));
        assert!(Material::from_secret(&mismatched).is_err());
    }

    /// (409 if it exists) and replace (409 unless the resourceVersion matches).
    pub(crate) fn fake_secrets() -> (Api<Secret>, Arc<std::sync::Mutex<Option<Secret>>>) {
        use axum::http::{Method, Request, Response, StatusCode};
        use kube::client::Body;
        let store = Arc::new(std::sync::Mutex::new(None::<Secret>));
        let stored = store.clone();
        let service = tower::service_fn(move |request: Request<Body>| {
            let store = stored.clone();
            async move {
                let method = request.method().clone();
                let body = request.into_body().collect_bytes().await.unwrap();
                let mut store = store.lock().unwrap();
                let respond = |status: StatusCode, json: String| {
                    Response::builder()
                        .status(status)
                        .header("content-type", "application/json")
                        .body(Body::from(json.into_bytes()))
                        .unwrap()
                };
                let status = |code: StatusCode| {
                    // kube tells "not found" from other errors by the reason.
                    let reason = match code {
                        StatusCode::NOT_FOUND => "NotFound",
                        StatusCode::CONFLICT => "Conflict",
                        _ => "MethodNotAllowed",
                    };
                    respond(
                        code,
                        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                               "message": reason, "reason": reason, "code": code.as_u16()})
                        .to_string(),
                    )
                };
                let response = match method {
                    Method::GET => match &*store {
                        Some(secret) => {
                            respond(StatusCode::OK, serde_json::to_string(secret).unwrap())
                        }
                        None => status(StatusCode::NOT_FOUND),
                    },
                    Method::POST | Method::PUT => {
                        let mut secret: Secret = serde_json::from_slice(&body).unwrap();
                        let existing = store
                            .as_ref()
                            .and_then(|s| s.metadata.resource_version.clone());
                        let (ok, rv) = if method == Method::POST {
                            (existing.is_none(), 1)
                        } else {
                            let rv = existing.as_deref().map_or(0, |v| v.parse().unwrap());
                            (
                                existing.is_some() && secret.metadata.resource_version == existing,
                                rv + 1,
                            )
                        };
                        if ok {
                            secret.metadata.resource_version = Some(rv.to_string());
                            *store = Some(secret.clone());
                            respond(StatusCode::OK, serde_json::to_string(&secret).unwrap())
                        } else {
                            status(StatusCode::CONFLICT)
                        }
                    }
                    _ => status(StatusCode::METHOD_NOT_ALLOWED),
                };
                Ok::<_, std::convert::Infallible>(response)
            }
        });
        let client = Client::new(service, "initium-system");
        (Api::namespaced(client, "initium-system"), store)
    }

    #[tokio::test]
    async fn a_deleted_secret_is_written_again_with_the_same_ca() {
        let (api, store) = fake_secrets();
        let origin = "Secret initium-system/initium-tls";
        let current = Material::create(&names(), now_unix()).unwrap();

        // Not leading: nothing is written, the certificates in use stay.
        let found = refresh_secret(&api, "initium-tls", &names(), false, &current, origin)
            .await
            .unwrap();
        assert_eq!(found, None);
        assert!(store.lock().unwrap().is_none(), "only the leader writes");

        // Leading: the Secret is written again from what is served, not from a new CA.
        let found = refresh_secret(&api, "initium-tls", &names(), true, &current, origin)
            .await
            .unwrap();
        assert_eq!(
            found.as_ref(),
            Some(&current),
            "the same CA and serving certificate"
        );
        let written = store.lock().unwrap().clone().expect("the Secret again");
        assert_eq!(Material::from_secret(&written).unwrap(), current);

        // Unusable (the key lost): replaced with what is served, too.
        store
            .lock()
            .unwrap()
            .as_mut()
            .unwrap()
            .data
            .as_mut()
            .unwrap()
            .remove(TLS_KEY);
        let found = refresh_secret(&api, "initium-tls", &names(), true, &current, origin)
            .await
            .unwrap();
        assert_eq!(found.as_ref(), Some(&current));
        let written = store.lock().unwrap().clone().unwrap();
        assert_eq!(Material::from_secret(&written).unwrap(), current);
        assert_eq!(written.metadata.resource_version.as_deref(), Some("2"));
    }

    #[tokio::test]
    async fn a_deleted_secret_with_a_ca_due_is_rotated_in_stages() {
        let (api, store) = fake_secrets();
        let origin = "Secret initium-system/initium-tls";
        let name = "initium.initium-system.svc";
        // Seven years old: the CA is due for renewal, the serving certificate has expired.
        let current = Material::create(&names(), now_unix() - 7 * 365 * 24 * 3600).unwrap();
        let found = refresh_secret(&api, "initium-tls", &names(), true, &current, origin)
            .await
            .unwrap()
            .expect("the Secret written and renewed");
        // The new CA is only staged: it is in the caBundle, next to the old one...
        assert_eq!(found.meta.signing_ca, current.meta.signing_ca);
        assert!(found.meta.next_ca.is_some() && found.next_ca.is_some());
        assert!(found.ca_bundle.starts_with(&current.signing_ca_cert));
        // ...and what is served is signed by the CA the published caBundle already trusts.
        trusted(&current.ca_bundle, &found.serving_cert, name).unwrap();
        let written = store.lock().unwrap().clone().unwrap();
        assert_eq!(Material::from_secret(&written).unwrap(), found);
    }
}
