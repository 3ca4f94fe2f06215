//! The webhook server on loopback over real TLS: a self-signed certificate for `localhost` to
//! serve with, and a client that trusts it and completes the handshake.

use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use axum_server::tls_rustls::RustlsConfig;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::{ClientConfig, ClientConnection, RootCertStore, StreamOwned};

/// A TLS connection from [`handshake`].
pub type Tls = StreamOwned<ClientConnection, TcpStream>;

/// A fresh self-signed certificate for `localhost`: the server's TLS configuration, and the
/// certificate a client trusts as its CA.
pub async fn self_signed() -> (RustlsConfig, CertificateDer<'static>) {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_string()])
        .expect("self-signed certificate");
    let ca = cert.cert.der().clone();
    let tls = RustlsConfig::from_pem(
        cert.cert.pem().into_bytes(),
        cert.signing_key.serialize_pem().into_bytes(),
    )
    .await
    .expect("TLS configuration");
    (tls, ca)
}

/// Connects to `addr` as `localhost`, trusting `ca`, offering `alpn`, with `read_timeout` on
/// the socket, and completes the TLS handshake.
pub fn handshake(
    addr: SocketAddr,
    ca: &CertificateDer<'static>,
    alpn: &[&[u8]],
    read_timeout: Duration,
) -> std::io::Result<Tls> {
    let mut roots = RootCertStore::empty();
    roots.add(ca.clone()).map_err(std::io::Error::other)?;
    let mut config = ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let name = ServerName::try_from("localhost").map_err(std::io::Error::other)?;
    let conn = ClientConnection::new(Arc::new(config), name).map_err(std::io::Error::other)?;
    let tcp = TcpStream::connect(addr)?;
    tcp.set_read_timeout(Some(read_timeout))?;
    let mut tls = StreamOwned::new(conn, tcp);
    while tls.conn.is_handshaking() {
        tls.conn.complete_io(&mut tls.sock)?;
    }
    Ok(tls)
}
