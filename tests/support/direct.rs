//! A client for `initium serve`'s webhook port, straight (not through the API server), and
//! what the benchmarks read about a process: keep-alive HTTPS connections trusting initium's
//! CA, one review sent with its `Server-Timing`, CPU time and resident set.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use tokio_rustls::rustls;

use super::measure::memory;

pub fn tls_config(ca_pem: &[u8]) -> Result<Arc<rustls::ClientConfig>> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem) {
        roots.add(cert.context("initium's CA bundle")?)?;
    }
    let mut config = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

pub type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

pub async fn connect(addr: std::net::SocketAddr, tls: Arc<rustls::ClientConfig>) -> Result<Sender> {
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    tcp.set_nodelay(true)?;
    let name = rustls::pki_types::ServerName::IpAddress(addr.ip().into());
    let stream = tokio_rustls::TlsConnector::from(tls)
        .connect(name, tcp)
        .await
        .context("TLS handshake with initium")?;
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(sender)
}

/// One review: the status, the answer, and the server time in microseconds.
pub async fn send(
    sender: &mut Sender,
    addr: std::net::SocketAddr,
    body: &Bytes,
) -> Result<(u16, Bytes, Option<u32>)> {
    sender.ready().await?;
    let request = hyper::Request::post("/mutate")
        .header(hyper::header::HOST, addr.to_string())
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(body.clone()))?;
    let response = sender.send_request(request).await?;
    let status = response.status().as_u16();
    let server_us = response
        .headers()
        .get("server-timing")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once("dur="))
        .and_then(|(_, ms)| ms.parse::<f64>().ok())
        .map(|ms| (ms * 1000.0).round() as u32);
    let body = response.into_body().collect().await?.to_bytes();
    Ok((status, body, server_us))
}

/// CPU time (user + system) a process has used, in seconds.
pub fn cpu_seconds(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which may hold spaces) start at field 3.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .context("unexpected /proc/PID/stat")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| -> Result<f64> {
        Ok(fields
            .get(i)
            .context("short /proc/PID/stat")?
            .parse::<f64>()?)
    };
    // utime and stime are fields 14 and 15 of stat, 12 and 13 after the name and state.
    let ticks_per_second = 100.0;
    Ok((ticks(11)? + ticks(12)?) / ticks_per_second)
}

/// Samples a process's resident set every 100 ms until stopped; the highest sample.
pub struct RssSampler {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<u64>,
}

impl RssSampler {
    pub fn start(pid: u32) -> RssSampler {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = std::thread::spawn({
            let stop = stop.clone();
            move || {
                let mut highest = 0;
                while !stop.load(Ordering::Relaxed) {
                    if let Ok(memory) = memory(pid) {
                        highest = highest.max(memory.rss_kib);
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
                highest
            }
        });
        RssSampler { stop, thread }
    }

    pub fn stop(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or(0)
    }
}
