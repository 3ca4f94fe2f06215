//! The plane's PKI in DIR/pki, made with rcgen as initium's own (src/tls/pki.rs): a CA, the
//! API server's serving certificate, client certificates (the admin's, and in a plane with
//! nodes one per node component) and the service-account signing key. ECDSA P-256 keys
//! throughout (the service-account tokens are ES256).

use std::net::{IpAddr, Ipv4Addr};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};

use crate::settings::NODE_COMPONENTS;

/// How long the certificates are valid (a plane lives minutes; a developer's a few days).
const LIFETIME: Duration = Duration::from_secs(365 * 24 * 3600);
/// Certificates start this much in the past, for clocks a little behind.
const BACKDATE: Duration = Duration::from_secs(3600);

/// The names the API server answers to: loopback, the first address of the service range
/// (the `kubernetes` Service) and the Service's DNS names.
const APISERVER_IPS: [Ipv4Addr; 2] = [Ipv4Addr::new(127, 0, 0, 1), Ipv4Addr::new(10, 0, 0, 1)];
const APISERVER_NAMES: [&str; 5] = [
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
];

/// The subject of a client certificate: the user (CN) and groups (O) the API server sees.
/// The controller manager and the scheduler are the users Kubernetes' bootstrap RBAC policy
/// grants their permissions to; kwok does what kubelets do for every node (status, leases,
/// deleting Pods), so it is an administrator, as kwokctl sets it up.
pub(crate) fn component_user(name: &str) -> (Option<&'static str>, &str) {
    match name {
        "kube-controller-manager" => (None, "system:kube-controller-manager"),
        "kube-scheduler" => (None, "system:kube-scheduler"),
        "kwok" => (Some("system:masters"), "initium-kwok"),
        // The real node's kubelet, as the Node authorizer knows it.
        "kubelet" => (Some("system:nodes"), "system:node:initium-node"),
        // kube-apiserver calling the kubelet (logs, exec, stats).
        "apiserver-kubelet-client" => (Some("system:masters"), "kube-apiserver-kubelet-client"),
        _ => (Some("system:masters"), "initium-admin"),
    }
}

fn error(e: rcgen::Error) -> anyhow::Error {
    anyhow::anyhow!("cannot make a certificate: {e}")
}

fn params(organization: Option<&str>, common_name: &str) -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    if let Some(organization) = organization {
        dn.push(DnType::OrganizationName, organization);
    }
    dn.push(DnType::CommonName, common_name);
    params.distinguished_name = dn;
    let now = SystemTime::now();
    params.not_before = (now - BACKDATE).into();
    params.not_after = (now + LIFETIME).into();
    params
}

fn ca_params() -> CertificateParams {
    let mut params = params(None, "initium-plane-ca");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    params
}

fn leaf_params(
    organization: Option<&str>,
    common_name: &str,
    usage: ExtendedKeyUsagePurpose,
) -> CertificateParams {
    let mut params = params(organization, common_name);
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![usage];
    params.use_authority_key_identifier_extension = true;
    params
}

fn write(path: &Path, contents: &str, mode: u32) -> Result<()> {
    std::fs::write(path, contents).with_context(|| format!("cannot write {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("cannot set the permissions of {}", path.display()))
}

/// Signs NAME.crt/NAME.key in `pki` with the CA.
fn sign(
    pki: &Path,
    name: &str,
    params: &CertificateParams,
    issuer: &Issuer<'_, KeyPair>,
) -> Result<()> {
    let key = KeyPair::generate().map_err(error)?;
    let cert = params.signed_by(&key, issuer).map_err(error)?;
    write(&pki.join(format!("{name}.crt")), &cert.pem(), 0o644)?;
    write(
        &pki.join(format!("{name}.key")),
        &key.serialize_pem(),
        0o600,
    )
}

/// DIR/pki: ca.crt/.key, apiserver.crt/.key, admin.crt/.key, sa.key/sa.pub, and with
/// `nodes` NAME.crt/.key for each node component.
pub(crate) fn generate(dir: &Path, nodes: bool, real_node: bool) -> Result<()> {
    let pki = dir.join("pki");
    std::fs::create_dir_all(&pki).with_context(|| format!("cannot create {}", pki.display()))?;
    std::fs::set_permissions(&pki, std::fs::Permissions::from_mode(0o700))?;

    let ca_key = KeyPair::generate().map_err(error)?;
    let ca_params = ca_params();
    let ca = ca_params.self_signed(&ca_key).map_err(error)?;
    write(&pki.join("ca.crt"), &ca.pem(), 0o644)?;
    write(&pki.join("ca.key"), &ca_key.serialize_pem(), 0o600)?;
    let issuer = Issuer::new(ca_params, ca_key);

    let mut serving = leaf_params(None, "kube-apiserver", ExtendedKeyUsagePurpose::ServerAuth);
    serving.subject_alt_names = APISERVER_IPS
        .iter()
        .map(|&ip| Ok(SanType::IpAddress(IpAddr::V4(ip))))
        .chain(
            APISERVER_NAMES
                .iter()
                .map(|&name| Ok(SanType::DnsName(name.try_into().map_err(error)?))),
        )
        .collect::<Result<_>>()?;
    sign(&pki, "apiserver", &serving, &issuer)?;

    let mut clients = vec!["admin"];
    if nodes {
        clients.extend(NODE_COMPONENTS);
    }
    if real_node {
        clients.extend(["kubelet", "apiserver-kubelet-client"]);
    }
    for name in clients {
        let (organization, user) = component_user(name);
        let params = leaf_params(organization, user, ExtendedKeyUsagePurpose::ClientAuth);
        sign(&pki, name, &params, &issuer)?;
    }

    // kube-apiserver signs service-account tokens with sa.key and verifies them with sa.pub;
    // the controller manager signs with sa.key too.
    let sa = KeyPair::generate().map_err(error)?;
    write(&pki.join("sa.key"), &sa.serialize_pem(), 0o600)?;
    write(&pki.join("sa.pub"), &sa.public_key_pem(), 0o644)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_pki_has_every_file_and_private_keys_only_the_owner_reads() {
        let dir = std::env::temp_dir().join(format!("plane-pki-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        generate(&dir, true, true).unwrap();
        let pki = dir.join("pki");
        for name in [
            "ca",
            "apiserver",
            "admin",
            "kube-controller-manager",
            "kube-scheduler",
            "kwok",
            "kubelet",
            "apiserver-kubelet-client",
        ] {
            let cert = std::fs::read_to_string(pki.join(format!("{name}.crt"))).unwrap();
            assert!(cert.starts_with("-----BEGIN CERTIFICATE-----"), "{name}");
            let mode = std::fs::metadata(pki.join(format!("{name}.key")))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600, "{name}.key");
        }
        assert!(
            std::fs::read_to_string(pki.join("sa.pub"))
                .unwrap()
                .starts_with("-----BEGIN PUBLIC KEY-----")
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
