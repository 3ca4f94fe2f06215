//! Pure certificate logic: the CA and the serving certificate (rcgen), their validity windows
//! and the renewal plan. No I/O: the clock comes in as `now` (seconds since the Unix epoch),
//! so every decision is a function that tests can drive through years in microseconds (only
//! [`now_unix`], for the callers, reads the clock).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use serde::{Deserialize, Serialize};

/// How long a serving certificate is valid.
const SERVING_LIFETIME: Duration = Duration::from_secs(365 * 24 * 3600);
/// How long a CA is valid.
const CA_LIFETIME: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// A new CA is in the caBundle this long before it signs the serving certificate: time for
/// the leader to write the configurations and for every API server to see them.
pub(super) const CA_PROPAGATION: Duration = Duration::from_secs(600);
/// Certificates start this much in the past, for clocks that are a little behind.
const BACKDATE: Duration = Duration::from_secs(3600);

/// Times are whole seconds since the Unix epoch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct Validity {
    pub(super) not_before: i64,
    pub(super) not_after: i64,
}

impl Validity {
    fn new(now: i64, lifetime: Duration) -> Validity {
        Validity {
            not_before: now - BACKDATE.as_secs() as i64,
            not_after: now + lifetime.as_secs() as i64,
        }
    }

    /// Two thirds of the way through: time to renew.
    fn renew_at(&self) -> i64 {
        self.not_before + (self.not_after - self.not_before) * 2 / 3
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct Authority {
    pub(super) common_name: String,
    pub(super) validity: Validity,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct Meta {
    pub(super) signing_ca: Authority,
    /// A CA in the caBundle that has not signed anything yet, and since when.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) next_ca: Option<(Authority, i64)>,
    pub(super) serving: Validity,
    pub(super) names: Vec<String>,
}

/// Everything in the Secret, PEM-encoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Material {
    pub(super) meta: Meta,
    pub(super) serving_cert: String,
    pub(super) serving_key: String,
    pub(super) ca_bundle: String,
    pub(super) signing_ca_cert: String,
    pub(super) signing_ca_key: String,
    pub(super) next_ca: Option<(String, String)>,
}

/// What tests outside `tls` read of a [`Material`].
#[cfg(test)]
impl Material {
    pub(crate) fn serving_not_after(&self) -> i64 {
        self.meta.serving.not_after
    }

    pub(crate) fn serving_pem(&self) -> (&str, &str) {
        (&self.serving_cert, &self.serving_key)
    }
}

pub(crate) fn now_unix() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

fn certificate_error(message: impl std::fmt::Display) -> String {
    format!("cannot make a certificate: {message}")
}

fn ca_params(common_name: &str, validity: &Validity) -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.not_before =
        (UNIX_EPOCH + Duration::from_secs(validity.not_before.max(0) as u64)).into();
    params.not_after = (UNIX_EPOCH + Duration::from_secs(validity.not_after.max(0) as u64)).into();
    params
}

/// A new CA: certificate PEM, key PEM and what to remember about it.
fn new_authority(now: i64) -> Result<(String, String, Authority), String> {
    let authority = Authority {
        // Unique per CA, so a caBundle holding the old and the new one is unambiguous.
        common_name: format!("initium-ca-{now}"),
        validity: Validity::new(now, CA_LIFETIME),
    };
    let key = KeyPair::generate().map_err(certificate_error)?;
    let cert = ca_params(&authority.common_name, &authority.validity)
        .self_signed(&key)
        .map_err(certificate_error)?;
    Ok((cert.pem(), key.serialize_pem(), authority))
}

/// A serving certificate for `names`, signed by the CA with this key; certificate PEM, key
/// PEM and validity. It never outlives its CA.
fn new_serving(
    names: &[String],
    ca: &Authority,
    ca_key_pem: &str,
    now: i64,
) -> Result<(String, String, Validity), String> {
    let ca_key = KeyPair::from_pem(ca_key_pem).map_err(certificate_error)?;
    // rcgen signs with the issuer's name, key identifier and key usages, all of which follow
    // from the CA's parameters and key: no need to parse its certificate back.
    let issuer = Issuer::new(ca_params(&ca.common_name, &ca.validity), ca_key);
    let mut validity = Validity::new(now, SERVING_LIFETIME);
    validity.not_after = validity.not_after.min(ca.validity.not_after);
    let mut params = CertificateParams::new(names.to_vec()).map_err(certificate_error)?;
    let mut dn = DistinguishedName::new();
    dn.push(
        DnType::CommonName,
        names.first().map_or("initium", String::as_str),
    );
    params.distinguished_name = dn;
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.use_authority_key_identifier_extension = true;
    params.not_before =
        (UNIX_EPOCH + Duration::from_secs(validity.not_before.max(0) as u64)).into();
    params.not_after = (UNIX_EPOCH + Duration::from_secs(validity.not_after.max(0) as u64)).into();
    let key = KeyPair::generate().map_err(certificate_error)?;
    let cert = params.signed_by(&key, &issuer).map_err(certificate_error)?;
    Ok((cert.pem(), key.serialize_pem(), validity))
}

/// What the leader does with the Secret's certificates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Plan {
    Keep,
    /// Issue a new serving certificate from the signing CA (due, or the names changed).
    RenewServing,
    /// Put a new CA into the caBundle; it signs after [`CA_PROPAGATION`].
    StageCa,
    /// The staged CA has been in the caBundle long enough: let it sign a new serving
    /// certificate.
    PromoteCa,
}

pub(super) fn plan(meta: &Meta, names: &[String], now: i64) -> Plan {
    if meta.names != names {
        return Plan::RenewServing;
    }
    match &meta.next_ca {
        Some((_, since)) if now >= since + CA_PROPAGATION.as_secs() as i64 => {
            return Plan::PromoteCa;
        }
        None if now >= meta.signing_ca.validity.renew_at() => return Plan::StageCa,
        _ => {}
    }
    if now >= meta.serving.renew_at() {
        return Plan::RenewServing;
    }
    Plan::Keep
}

impl Material {
    pub(crate) fn create(names: &[String], now: i64) -> Result<Material, String> {
        let (ca_cert, ca_key, authority) = new_authority(now)?;
        let (serving_cert, serving_key, serving) = new_serving(names, &authority, &ca_key, now)?;
        Ok(Material {
            meta: Meta {
                signing_ca: authority,
                next_ca: None,
                serving,
                names: names.to_vec(),
            },
            serving_cert,
            serving_key,
            ca_bundle: ca_cert.clone(),
            signing_ca_cert: ca_cert,
            signing_ca_key: ca_key,
            next_ca: None,
        })
    }

    /// Carries out `plan` (anything but `Keep`).
    pub(crate) fn renew(&self, plan: Plan, names: &[String], now: i64) -> Result<Material, String> {
        let mut next = self.clone();
        match plan {
            Plan::Keep => {}
            Plan::RenewServing => {
                let (cert, key, validity) =
                    new_serving(names, &self.meta.signing_ca, &self.signing_ca_key, now)?;
                next.serving_cert = cert;
                next.serving_key = key;
                next.meta.serving = validity;
                next.meta.names = names.to_vec();
            }
            Plan::StageCa => {
                let (cert, key, authority) = new_authority(now)?;
                // The old bundle may hold a CA from the previous rotation: drop it now.
                next.ca_bundle = format!("{}{cert}", self.signing_ca_cert);
                next.meta.next_ca = Some((authority, now));
                next.next_ca = Some((cert, key));
            }
            Plan::PromoteCa => {
                let (Some((authority, _)), Some((cert, key))) = (&self.meta.next_ca, &self.next_ca)
                else {
                    return Err("no staged CA to promote".into());
                };
                let (serving_cert, serving_key, validity) =
                    new_serving(names, authority, key, now)?;
                next.signing_ca_cert = cert.clone();
                next.signing_ca_key = key.clone();
                next.meta.signing_ca = authority.clone();
                next.meta.next_ca = None;
                next.next_ca = None;
                next.serving_cert = serving_cert;
                next.serving_key = serving_key;
                next.meta.serving = validity;
                next.meta.names = names.to_vec();
            }
        }
        Ok(next)
    }
}

/// When the first certificate of a PEM chain (the serving certificate) expires: its notAfter,
/// in seconds since the Unix epoch.
pub(super) fn not_after(cert_pem: &[u8]) -> Result<i64, String> {
    let der = CertificateDer::pem_slice_iter(cert_pem)
        .next()
        .ok_or("no certificate found in the PEM")?
        .map_err(|e| format!("the certificate is not PEM: {e}"))?;
    validity_end(der.as_ref()).ok_or_else(|| "the certificate's validity cannot be read".into())
}

/// The notAfter of a DER certificate. X.509 fixes where it is: `Certificate` is a SEQUENCE
/// whose first element, `tbsCertificate`, holds an optional `[0]` version, the serial number,
/// the signature algorithm, the issuer and then `validity` (notBefore, notAfter). Walking
/// there takes a few lines; a full X.509 parser would be a dependency for one field.
fn validity_end(der: &[u8]) -> Option<i64> {
    const SEQUENCE: u8 = 0x30;
    const VERSION: u8 = 0xa0;
    let (SEQUENCE, certificate, _) = der_element(der)? else {
        return None;
    };
    let (SEQUENCE, mut tbs, _) = der_element(certificate)? else {
        return None;
    };
    if let (VERSION, _, rest) = der_element(tbs)? {
        tbs = rest;
    }
    for _serial_signature_issuer in 0..3 {
        tbs = der_element(tbs)?.2;
    }
    let (SEQUENCE, validity, _) = der_element(tbs)? else {
        return None;
    };
    let after_not_before = der_element(validity)?.2;
    let (tag, time, _) = der_element(after_not_before)?;
    der_time(tag, time)
}

/// One DER element at the start of `input`: its tag, its contents and what follows it.
fn der_element(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (length, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        // Long form: the low bits say how many length bytes follow (at most 4 here).
        let count = usize::from(first & 0x7f);
        if count == 0 || count > 4 || rest.len() < count {
            return None;
        }
        let (bytes, rest) = rest.split_at(count);
        let length = bytes
            .iter()
            .fold(0usize, |length, byte| (length << 8) | usize::from(*byte));
        (length, rest)
    };
    if rest.len() < length {
        return None;
    }
    let (contents, rest) = rest.split_at(length);
    Some((tag, contents, rest))
}

/// A UTCTime (`YYMMDDHHMMSSZ`, tag 0x17) or GeneralizedTime (`YYYYMMDDHHMMSSZ`, tag 0x18),
/// the two forms RFC 5280 allows, in seconds since the Unix epoch.
fn der_time(tag: u8, contents: &[u8]) -> Option<i64> {
    let text = std::str::from_utf8(contents).ok()?.strip_suffix('Z')?;
    if !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let (year, rest) = match (tag, text.len()) {
        (0x17, 12) => {
            let yy: i16 = text[..2].parse().ok()?;
            // RFC 5280: YY >= 50 is 19YY, otherwise 20YY.
            (if yy >= 50 { 1900 + yy } else { 2000 + yy }, &text[2..])
        }
        (0x18, 14) => (text[..4].parse().ok()?, &text[4..]),
        _ => return None,
    };
    let field = |at: usize| rest[at..at + 2].parse::<i8>().ok();
    let time = k8s_openapi::jiff::civil::DateTime::new(
        year,
        field(0)?,
        field(2)?,
        field(4)?,
        field(6)?,
        field(8)?,
        0,
    )
    .ok()?;
    let zoned = time.to_zoned(k8s_openapi::jiff::tz::TimeZone::UTC).ok()?;
    Some(zoned.timestamp().as_second())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
pub(crate) mod tests {
    use std::sync::Arc;

    use rustls::RootCertStore;
    use rustls::client::WebPkiServerVerifier;
    use rustls::client::danger::ServerCertVerifier;
    use rustls::pki_types::{ServerName, UnixTime};

    use super::*;
    use crate::tls::server_config;

    pub(crate) fn names() -> Vec<String> {
        vec![
            "initium.initium-system.svc".into(),
            "initium.initium-system.svc.cluster.local".into(),
            "127.0.0.1".into(),
        ]
    }

    /// Whether a client trusting `ca_bundle` accepts `serving_cert` for `name`.
    pub(in crate::tls) fn trusted(
        ca_bundle: &str,
        serving_cert: &str,
        name: &str,
    ) -> Result<(), String> {
        let mut roots = RootCertStore::empty();
        for ca in CertificateDer::pem_slice_iter(ca_bundle.as_bytes()) {
            roots
                .add(ca.map_err(|e| e.to_string())?)
                .map_err(|e| e.to_string())?;
        }
        let verifier = WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            Arc::new(rustls::crypto::ring::default_provider()),
        )
        .build()
        .map_err(|e| e.to_string())?;
        let leaf =
            CertificateDer::from_pem_slice(serving_cert.as_bytes()).map_err(|e| e.to_string())?;
        let server_name = ServerName::try_from(name.to_string()).map_err(|e| e.to_string())?;
        verifier
            .verify_server_cert(&leaf, &[], &server_name, &[], UnixTime::now())
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    #[test]
    fn the_serving_certificate_carries_the_webhook_names() {
        let material = Material::create(&names(), now_unix()).unwrap();
        for name in names() {
            trusted(&material.ca_bundle, &material.serving_cert, &name)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        assert!(
            trusted(
                &material.ca_bundle,
                &material.serving_cert,
                "other.initium-system.svc"
            )
            .is_err()
        );
        assert!(trusted(&material.ca_bundle, &material.serving_cert, "127.0.0.2").is_err());
        server_config(
            material.serving_cert.as_bytes(),
            material.serving_key.as_bytes(),
        )
        .unwrap();
    }

    #[test]
    fn renewal_is_planned_at_two_thirds_of_life() {
        let start = 1_000_000_000;
        let material = Material::create(&names(), start).unwrap();
        let meta = &material.meta;
        let day = 24 * 3600;
        assert_eq!(plan(meta, &names(), start), Plan::Keep);
        assert_eq!(plan(meta, &names(), start + 200 * day), Plan::Keep);
        assert_eq!(plan(meta, &names(), start + 244 * day), Plan::RenewServing);
        assert_eq!(
            plan(meta, &["other.svc".to_string()], start),
            Plan::RenewServing,
            "new names are needed at once"
        );
        assert_eq!(plan(meta, &names(), start + 2434 * day), Plan::StageCa);
    }

    #[test]
    fn a_ca_rotation_never_leaves_the_serving_certificate_untrusted() {
        let start = now_unix();
        let first = Material::create(&names(), start).unwrap();
        let name = "initium.initium-system.svc";

        let staged = first.renew(Plan::StageCa, &names(), start).unwrap();
        // The old certificate is still served and still trusted by the bundle...
        assert_eq!(staged.serving_cert, first.serving_cert);
        trusted(&staged.ca_bundle, &staged.serving_cert, name).unwrap();
        assert_eq!(plan(&staged.meta, &names(), start + 60), Plan::Keep);
        assert_eq!(
            plan(
                &staged.meta,
                &names(),
                start + CA_PROPAGATION.as_secs() as i64
            ),
            Plan::PromoteCa
        );

        let promoted = staged.renew(Plan::PromoteCa, &names(), start).unwrap();
        // ...and the new one is trusted by the bundle that was published before it.
        trusted(&staged.ca_bundle, &promoted.serving_cert, name).unwrap();
        trusted(&promoted.ca_bundle, &promoted.serving_cert, name).unwrap();
        assert!(
            trusted(&first.ca_bundle, &promoted.serving_cert, name).is_err(),
            "signed by the new CA"
        );
        assert_eq!(promoted.meta.next_ca, None);
        let reread = Material::from_secret(&promoted.to_secret("s", None)).unwrap();
        assert_eq!(reread, promoted);
    }

    /// An API server holding at most one Secret, enough for `refresh_secret`: get, create

    #[test]
    fn the_expiry_is_read_from_the_certificate() {
        let start = 1_000_000_000;
        let material = Material::create(&names(), start).unwrap();
        // The serving certificate, not the CA after it in a chain.
        let chain = format!("{}{}", material.serving_cert, material.signing_ca_cert);
        assert_eq!(
            not_after(chain.as_bytes()),
            Ok(material.meta.serving.not_after)
        );
        assert_eq!(
            not_after(material.signing_ca_cert.as_bytes()),
            Ok(material.meta.signing_ca.validity.not_after)
        );
        // Past 2049 certificates carry a GeneralizedTime instead of a UTCTime.
        let late = Material::create(&names(), 2_600_000_000).unwrap();
        assert!(late.meta.serving.not_after > 2_524_608_000, "after 2050");
        assert_eq!(
            not_after(late.serving_cert.as_bytes()),
            Ok(late.meta.serving.not_after)
        );
        assert!(not_after(b"not a certificate").is_err());
        let truncated = CertificateDer::from_pem_slice(material.serving_cert.as_bytes()).unwrap();
        assert_eq!(validity_end(&truncated.as_ref()[..40]), None);
    }

    #[test]
    fn der_times_follow_rfc_5280() {
        assert_eq!(der_time(0x17, b"700101000000Z"), Some(0));
        assert_eq!(der_time(0x17, b"491231235959Z"), Some(2_524_607_999));
        assert_eq!(der_time(0x18, b"20500101000000Z"), Some(2_524_608_000));
        assert_eq!(der_time(0x17, b"700101000000"), None, "no Z");
        assert_eq!(der_time(0x17, b"701301000000Z"), None, "month 13");
        assert_eq!(der_time(0x18, b"700101000000Z"), None, "too short");
        assert_eq!(der_time(0x04, b"700101000000Z"), None, "not a time");
    }
}
