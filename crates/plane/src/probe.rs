//! Health probes: one HTTP GET on 127.0.0.1, plain or over TLS, blocking, with a 2 s
//! timeout (what `curl -fsS --max-time 2` did for the bash script).

use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{ClientConfig, ClientConnection, DigitallySignedStruct, RootCertStore, StreamOwned};

const TIMEOUT: Duration = Duration::from_secs(2);

/// How to reach a health endpoint.
pub(crate) enum Probe {
    Http,
    Https(Arc<ClientConfig>),
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl Probe {
    /// HTTPS, trusting the CA in `ca` and presenting the client certificate `cert`/`key`.
    pub(crate) fn with_client_cert(ca: &Path, cert: &Path, key: &Path) -> Result<Probe> {
        let mut roots = RootCertStore::empty();
        for der in CertificateDer::pem_file_iter(ca)
            .with_context(|| format!("cannot read {}", ca.display()))?
        {
            roots.add(der.with_context(|| format!("cannot read {}", ca.display()))?)?;
        }
        let chain = CertificateDer::pem_file_iter(cert)
            .with_context(|| format!("cannot read {}", cert.display()))?
            .collect::<Result<Vec<_>, _>>()
            .with_context(|| format!("cannot read {}", cert.display()))?;
        let key = PrivateKeyDer::from_pem_file(key)
            .with_context(|| format!("cannot read {}", key.display()))?;
        let config = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)?;
        Ok(Probe::Https(Arc::new(config)))
    }

    /// HTTPS to a server whose certificate is not checked (`curl -k`): the controller
    /// manager's and the scheduler's /healthz, served with a certificate they make up.
    pub(crate) fn any_certificate() -> Result<Probe> {
        let provider = provider();
        let verifier = AnyCertificate(provider.signature_verification_algorithms);
        let config = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_no_client_auth();
        Ok(Probe::Https(Arc::new(config)))
    }

    /// `GET path` on 127.0.0.1:port: the body of a 200 answer, or an error.
    pub(crate) fn get(&self, port: u16, path: &str) -> Result<String> {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let tcp = TcpStream::connect_timeout(&addr, TIMEOUT)?;
        tcp.set_read_timeout(Some(TIMEOUT))?;
        tcp.set_write_timeout(Some(TIMEOUT))?;
        let request =
            format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n");
        let response = match self {
            Probe::Http => exchange(tcp, &request)?,
            Probe::Https(config) => {
                let name =
                    ServerName::IpAddress(std::net::IpAddr::from(Ipv4Addr::LOCALHOST).into());
                let connection = ClientConnection::new(config.clone(), name)?;
                exchange(StreamOwned::new(connection, tcp), &request)?
            }
        };
        parse(&response)
    }
}

/// Sends the request and reads the answer until the server closes the connection.
fn exchange(mut stream: impl Read + Write, request: &str) -> Result<Vec<u8>> {
    stream.write_all(request.as_bytes())?;
    stream.flush()?;
    let mut response = Vec::new();
    let mut buffer = [0u8; 8192];
    loop {
        match stream.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => response.extend_from_slice(&buffer[..n]),
            // A TLS server that closes without close_notify: the answer is complete anyway.
            Err(e) if e.kind() == ErrorKind::UnexpectedEof && !response.is_empty() => break,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(response)
}

/// The body of a `200` HTTP/1.1 answer (chunked or not).
fn parse(response: &[u8]) -> Result<String> {
    let text = String::from_utf8_lossy(response);
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        bail!("an incomplete HTTP answer");
    };
    let mut lines = head.lines();
    let status = lines.next().unwrap_or_default();
    if status.split_whitespace().nth(1) != Some("200") {
        bail!("{status}: {}", body.trim());
    }
    let chunked = lines.any(|line| {
        line.split_once(':').is_some_and(|(name, value)| {
            name.trim().eq_ignore_ascii_case("transfer-encoding")
                && value.trim().eq_ignore_ascii_case("chunked")
        })
    });
    if !chunked {
        return Ok(body.to_owned());
    }
    let mut rest = body;
    let mut decoded = String::new();
    while let Some((size, after)) = rest.split_once("\r\n") {
        let size = usize::from_str_radix(size.split(';').next().unwrap_or_default().trim(), 16)
            .context("a bad chunk size")?;
        if size == 0 {
            break;
        }
        let chunk = after.get(..size).context("a truncated chunk")?;
        decoded.push_str(chunk);
        rest = after
            .get(size..)
            .unwrap_or_default()
            .trim_start_matches("\r\n");
    }
    Ok(decoded)
}

/// Accepts any server certificate, still checking the handshake's signatures.
#[derive(Debug)]
struct AnyCertificate(WebPkiSupportedAlgorithms);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::parse;

    #[test]
    fn a_200_answer_gives_its_body_plain_or_chunked_and_another_status_an_error() {
        assert_eq!(
            parse(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok").unwrap(),
            "ok"
        );
        assert_eq!(
            parse(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n3\r\n!!!\r\n0\r\n\r\n")
                .unwrap(),
            "ok!!!"
        );
        let error = parse(b"HTTP/1.1 500 Internal Server Error\r\n\r\n[-]etcd failed").unwrap_err();
        assert!(format!("{error}").contains("[-]etcd failed"), "{error}");
        assert!(parse(b"HTTP/1.1 200 OK\r\n").is_err());
    }
}
