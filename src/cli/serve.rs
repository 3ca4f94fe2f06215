//! `initium serve`: the webhook, the watches and the operations endpoints in one process.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::task::JoinHandle;

use crate::admission::Limits;
use crate::controller::{self, CaBundleSource, ControllerConfig, TlsSource, WebhookEndpoint};
use crate::engine::{Limits as RuleLimits, parse_duration};
use crate::state::{AdmissionConfig, Shared};
use crate::{Error, admission, ops};

/// Flags of `initium serve`.
#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// Address of the HTTPS admission webhook.
    #[arg(long, default_value = "0.0.0.0:8443")]
    pub listen: SocketAddr,
    /// Address of the plain-HTTP operations port (`/healthz`, `/readyz`, `/metrics`).
    #[arg(long, default_value = "0.0.0.0:8080")]
    pub ops_listen: SocketAddr,
    /// Out-of-cluster mode: register this base URL (e.g. `https://127.0.0.1:8443`) in the
    /// webhook configurations instead of the Service.
    #[arg(long)]
    pub webhook_url: Option<String>,
    /// In-cluster mode: the Service in front of the replicas (port 443).
    #[arg(long, default_value = "initium")]
    pub service: String,
    /// initium's own namespace (never intercepted; holds the Lease and the TLS Secret).
    #[arg(long, env = "POD_NAMESPACE", default_value = "initium-system")]
    pub namespace: String,
    /// Namespaces never intercepted besides initium's own (repeat the flag for several).
    #[arg(long = "exclude-namespace", default_value = "kube-system")]
    pub exclude_namespaces: Vec<String>,
    /// Latency budget per admission request (`200ms`, `1s`). Rules not run when it is
    /// spent are skipped (`Ignore`) or deny (`Fail`). The webhook timeout is set to twice
    /// the budget (at least 1 s, at most 30 s).
    #[arg(long, default_value = "200ms", value_parser = budget)]
    pub budget: Duration,
    /// Name of the MutatingWebhookConfiguration and ValidatingWebhookConfiguration.
    #[arg(long, default_value = "initium")]
    pub webhook_name: String,
    /// Name of the Lease that elects the replica that writes (status, configurations).
    #[arg(long, default_value = "initium")]
    pub lease_name: String,
    /// This replica's identity in the Lease (default: the Pod name, else the host name).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// Serving certificate (PEM) from a file, e.g. from cert-manager, reloaded when it
    /// changes. Without it initium manages its own CA in a Secret.
    #[arg(long, requires = "tls_key_file")]
    pub tls_cert_file: Option<std::path::PathBuf>,
    /// Private key (PEM) for `--tls-cert-file`.
    #[arg(long, requires = "tls_cert_file")]
    pub tls_key_file: Option<std::path::PathBuf>,
    /// CA certificate (PEM) to publish as the webhooks' caBundle with `--tls-cert-file`
    /// (default: the certificate file itself).
    #[arg(long)]
    pub ca_file: Option<std::path::PathBuf>,
    /// Name of the Secret holding the self-managed CA and serving certificate.
    #[arg(long, default_value = "initium-tls")]
    pub tls_secret: String,
    /// How long in-flight requests may take to finish after SIGTERM.
    #[arg(long, default_value = "20s", value_parser = parse_duration)]
    pub shutdown_grace: Duration,
    /// Log format: `json` (one object per line) or `text`.
    #[arg(long, default_value = "json")]
    pub log_format: LogFormat,
    /// Largest AdmissionReview accepted (413 above), in bytes or with a suffix (`8Mi`).
    #[arg(long, default_value = "8Mi", value_parser = bytes)]
    pub max_body_bytes: usize,
    /// Bytes of request bodies read or worked on at once, across all connections; a request
    /// that would go over it gets 503 and may retry.
    #[arg(long, default_value = "32Mi", value_parser = bytes)]
    pub max_inflight_bytes: usize,
    /// Open webhook connections; more are closed as soon as they are accepted.
    #[arg(long, default_value_t = 512)]
    pub max_connections: usize,
    /// Time a client has to send a request's headers (every request; also how long an idle
    /// keep-alive connection stays open).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub header_read_timeout: Duration,
    /// Time a client has to send a request's body once its headers are in (408 after it).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub body_read_timeout: Duration,
    /// Largest request head (HTTP/1.1 headers, HTTP/2 header list), at least 8Ki.
    #[arg(long, default_value = "16Ki", value_parser = bytes)]
    pub max_header_bytes: usize,
    /// HTTP/2 requests open at once on one connection.
    #[arg(long, default_value_t = 100)]
    pub http2_max_concurrent_streams: u32,
    /// Rules compiled at once by the validating webhook; a rule that waits longer than the
    /// budget is denied with a message to retry.
    #[arg(long, default_value_t = 2)]
    pub max_concurrent_validations: usize,
    /// AdmissionReviews above 64 KiB evaluated at once; one that waits longer than the budget
    /// gets 503 and the API server applies the webhook's failure policy.
    #[arg(long, default_value_t = 2)]
    pub max_blocking_reviews: usize,
    /// JSON values (elements, members) in an AdmissionReview above 64 KiB; more gets 413
    /// before it is parsed (parsing takes up to 16 times a body's bytes).
    #[arg(long, default_value_t = 1_000_000)]
    pub max_json_values: usize,
    /// Bytes (as JSON) one rule may write into one object: values it adds or replaces, what
    /// its templates copy, what its rewrites produce. A rule over it fails by its
    /// failurePolicy, its changes undone (docs/rules.md, Limits).
    #[arg(long, default_value = "1Mi", value_parser = bytes)]
    pub max_rule_output: usize,
    /// Bytes all rules together may write into one object.
    #[arg(long, default_value = "4Mi", value_parser = bytes)]
    pub max_admission_output: usize,
    /// Element × mutation steps one rule's forEach mutations may take in one object.
    #[arg(long, default_value_t = 100_000)]
    pub max_foreach_steps: usize,
}

impl ServeArgs {
    /// What one admission's rules may do, from the flags.
    pub fn rule_limits(&self) -> RuleLimits {
        RuleLimits {
            rule_output_bytes: self.max_rule_output,
            admission_output_bytes: self.max_admission_output,
            foreach_steps: self.max_foreach_steps,
        }
    }

    /// The webhook server's limits from the flags.
    pub fn limits(&self) -> Limits {
        Limits {
            max_body_bytes: self.max_body_bytes,
            max_inflight_bytes: self.max_inflight_bytes,
            max_connections: self.max_connections,
            header_read_timeout: self.header_read_timeout,
            body_read_timeout: self.body_read_timeout,
            max_header_bytes: self.max_header_bytes,
            http2_max_concurrent_streams: self.http2_max_concurrent_streams,
            max_concurrent_validations: self.max_concurrent_validations,
            max_blocking_reviews: self.max_blocking_reviews,
            max_json_values: self.max_json_values,
        }
    }
}

/// The rule limits must let a rule write something, and one rule's share must fit in the
/// whole object's.
fn validate_rule_limits(limits: &RuleLimits) -> Result<(), String> {
    if limits.rule_output_bytes == 0 || limits.foreach_steps == 0 {
        return Err("--max-rule-output and --max-foreach-steps must be more than zero".into());
    }
    if limits.admission_output_bytes < limits.rule_output_bytes {
        return Err(format!(
            "--max-admission-output ({}) must be at least --max-rule-output ({})",
            limits.admission_output_bytes, limits.rule_output_bytes
        ));
    }
    Ok(())
}

/// A size in bytes: `1048576`, `512Ki`, `8Mi`, `1Gi`.
fn bytes(text: &str) -> Result<usize, String> {
    let (number, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(at) => text.split_at(at),
        None => (text, ""),
    };
    let unit: usize = match unit {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        _ => {
            return Err(format!(
                "{text:?} is not a size: write bytes, or a number with Ki, Mi or Gi (8Mi)"
            ));
        }
    };
    number
        .parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(unit))
        .ok_or_else(|| {
            format!("{text:?} is not a size: write bytes, or a number with Ki, Mi or Gi (8Mi)")
        })
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum LogFormat {
    Json,
    Text,
}

fn budget(text: &str) -> Result<Duration, String> {
    let d = parse_duration(text).map_err(|e| e.to_string())?;
    if d > Duration::from_secs(15) {
        return Err(
            "at most 15s: the webhook timeout is twice the budget and Kubernetes allows 30s".into(),
        );
    }
    Ok(d)
}

/// Runs `initium serve` until SIGTERM or SIGINT.
pub fn run(args: ServeArgs) -> crate::Result<()> {
    init_logging(args.log_format);
    // One crypto provider for every TLS connection (webhook server and kube client): ring.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("initium")
        // A margin against deep recursion (serializing or dropping a deeply nested object
        // recurses): 8 MiB rather than 2 MiB per thread, for the workers and the blocking pool.
        // The engine bounds depth; this is defence in depth, and costs only address space
        // until used.
        .thread_stack_size(THREAD_STACK_BYTES)
        .build()
        .map_err(|e| Error::Serve(format!("cannot start the async runtime: {e}")))?;
    runtime.block_on(serve(args))
}

/// Stack of every runtime thread.
const THREAD_STACK_BYTES: usize = 8 * 1024 * 1024;

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
        LogFormat::Text => builder.fmt_fields(text_fields()).try_init(),
    };
}

/// Field formatting of the text log: as tracing-subscriber's default, except that control
/// characters are escaped (`\u{1b}`), so a name or message from a client or a rule cannot
/// move the cursor, recolour or rewrite a terminal. (The JSON format escapes them already.)
pub fn text_fields() -> impl for<'w> tracing_subscriber::fmt::FormatFields<'w> + 'static {
    use tracing_subscriber::field::MakeExt as _;
    tracing_subscriber::fmt::format::debug_fn(|writer, field, value| {
        let text = escape_controls(&format!("{value:?}"));
        if field.name() == "message" {
            write!(writer, "{text}")
        } else {
            write!(writer, "{}={text}", field.name())
        }
    })
    .delimited(" ")
}

/// `text` with every control character (and the bidirectional overrides a terminal obeys)
/// written as a Rust escape: `\u{1b}`, `\n`.
pub fn escape_controls(text: &str) -> String {
    let unsafe_char = |c: char| {
        c.is_control()
            || matches!(c, '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
    };
    if !text.chars().any(unsafe_char) {
        return text.to_string();
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if unsafe_char(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

async fn serve(args: ServeArgs) -> crate::Result<()> {
    let limits = args.limits();
    limits
        .validate()
        .map_err(|e| Error::Serve(format!("invalid limits: {e}")))?;
    validate_rule_limits(&args.rule_limits())
        .map_err(|e| Error::Serve(format!("invalid limits: {e}")))?;
    // The ports first, before anything is written to the cluster: with a port taken, serve
    // stops here, and no Secret, Lease or webhook configuration points at another process.
    let webhook_listener = listen(args.listen, "--listen").await?;
    let ops_listener = listen(args.ops_listen, "--ops-listen").await?;
    let webhook_listener = webhook_listener.into_std().map_err(|e| {
        Error::Serve(format!(
            "cannot use the listener on {} (--listen): {e}",
            args.listen
        ))
    })?;

    let client = kube::Client::try_default().await.map_err(|e| {
        Error::Serve(format!(
            "cannot reach the Kubernetes API (KUBECONFIG or in-cluster config): {}",
            cause_chain(&e)
        ))
    })?;
    let endpoint = match &args.webhook_url {
        Some(url) => WebhookEndpoint::Url(url.clone()),
        None => WebhookEndpoint::Service {
            name: args.service.clone(),
            namespace: args.namespace.clone(),
            port: 443,
        },
    };
    let mut config = ControllerConfig::new(args.namespace.clone(), endpoint);
    config.excluded_namespaces = args.exclude_namespaces.clone();
    config.webhook_configuration = args.webhook_name.clone();
    config.lease.name = args.lease_name.clone();
    config.lease.identity = args.identity.clone();
    config.tls = match (&args.tls_cert_file, &args.tls_key_file) {
        (Some(cert), Some(key)) => TlsSource::files(
            cert,
            key,
            match &args.ca_file {
                Some(ca) => CaBundleSource::File(ca.clone()),
                None => CaBundleSource::ServingCertificate,
            },
        ),
        _ => TlsSource::SelfManaged {
            secret: args.tls_secret.clone(),
            refresh_interval: Duration::from_secs(60),
        },
    };
    let controller_error = |e: controller::ControllerError| Error::Serve(cause_chain(&e));
    config.validate().map_err(controller_error)?;
    let tls = controller::tls(&client, &config)
        .await
        .map_err(controller_error)?;
    let rustls = tls.rustls_config();

    let mut excluded_namespaces = vec![args.namespace.clone()];
    excluded_namespaces.extend(args.exclude_namespaces.iter().cloned());
    let shared = Shared::new(AdmissionConfig {
        budget: args.budget,
        excluded_namespaces,
        limits,
        rule_limits: args.rule_limits(),
        ..AdmissionConfig::default()
    });
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };

    let mut ops_task = Some(tokio::spawn({
        let shared = shared.clone();
        let stop = stopped(stop_rx.clone());
        async move {
            axum::serve(ops_listener, ops::router(shared))
                .with_graceful_shutdown(stop)
                .await
        }
    }));
    let handle = axum_server::Handle::new();
    let mut webhook_task = Some(tokio::spawn(admission::serve(
        webhook_listener,
        rustls,
        shared.clone(),
        handle.clone(),
    )));
    let mut controller_task = Some(tokio::spawn(controller::run(
        client,
        shared.clone(),
        config,
        tls,
        stopped(stop_rx.clone()),
    )));
    tracing::info!(listen = %args.listen, ops = %args.ops_listen, budget = ?args.budget, "initium serving");

    // Supervision: every long-running task runs until shutdown; one that ends before takes
    // the process down, with its cause.
    let failure = tokio::select! {
        () = shutdown_signal() => None,
        result = join(&mut controller_task) => Some(format!("the controller stopped: {}", ended(result))),
        result = join(&mut webhook_task) => Some(format!(
            "the webhook server on {} (--listen) stopped: {}", args.listen, ended(result)
        )),
        result = join(&mut ops_task) => Some(format!(
            "the operations server on {} (--ops-listen) stopped: {}", args.ops_listen, ended(result)
        )),
    };
    match &failure {
        None => tracing::info!("shutting down: finishing requests in flight"),
        Some(cause) => tracing::error!(error = %cause, "shutting down"),
    }
    shared.set_webhook_serving(false);
    handle.graceful_shutdown(Some(args.shutdown_grace));
    let _ = stop_tx.send(true);
    for task in [webhook_task.take(), ops_task.take()].into_iter().flatten() {
        let _ = task.await;
    }
    if let Some(controller) = controller_task.take() {
        // The controller releases the Lease on the way out, so another replica takes over
        // without waiting for it to expire.
        let _ = tokio::time::timeout(Duration::from_secs(5), controller).await;
    }
    match failure {
        None => Ok(()),
        Some(message) => Err(Error::Serve(message)),
    }
}

/// Binds `addr` for `flag`; the error says which flag and address, and what to do.
async fn listen(addr: SocketAddr, flag: &str) -> crate::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await.map_err(|e| {
        let hint = match e.kind() {
            std::io::ErrorKind::AddrInUse => {
                format!(
                    "another process uses this port: stop it or choose another address with {flag}"
                )
            }
            std::io::ErrorKind::AddrNotAvailable => {
                format!("this host has no such address: choose another with {flag}")
            }
            std::io::ErrorKind::PermissionDenied => {
                format!("not allowed to use this port: choose a port above 1023 with {flag}")
            }
            _ => format!("choose another address with {flag}"),
        };
        Error::Serve(format!("cannot listen on {addr} ({flag}): {e}; {hint}"))
    })
}

/// Waits for a supervised task; never completes for a task already taken (ended).
async fn join<T>(task: &mut Option<JoinHandle<T>>) -> Result<T, tokio::task::JoinError> {
    let Some(handle) = task.as_mut() else {
        return std::future::pending().await;
    };
    let result = handle.await;
    *task = None;
    result
}

/// Why a task that should run until shutdown ended: its error and that error's causes.
fn ended<E: std::error::Error + 'static>(
    result: Result<Result<(), E>, tokio::task::JoinError>,
) -> String {
    match result {
        Ok(Ok(())) => "it ended before shutdown".into(),
        Ok(Err(e)) => cause_chain(&e),
        Err(e) if e.is_panic() => {
            let payload = e.into_panic();
            let message = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "no message".into());
            format!("it panicked: {message}")
        }
        Err(_) => "it was cancelled".into(),
    }
}

/// An error's message followed by each of its sources, `: `-separated; a source whose text
/// the message already includes is not repeated.
pub fn cause_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let line = cause.to_string();
        if !line.is_empty() && !text.contains(&line) {
            text.push_str(": ");
            text.push_str(&line);
        }
        source = cause.source();
    }
    text
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        _ => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(clap::Parser)]
    struct Command {
        #[command(flatten)]
        serve: ServeArgs,
    }

    #[test]
    fn the_flags_default_to_the_documented_limits() {
        let args = Command::try_parse_from(["initium"]).expect("defaults parse");
        assert_eq!(args.serve.limits(), Limits::default());
        assert_eq!(args.serve.rule_limits(), RuleLimits::default());
        let args = Command::try_parse_from([
            "initium",
            "--max-rule-output",
            "8Mi",
            "--max-admission-output",
            "4Mi",
        ])
        .expect("sizes parse");
        let e = validate_rule_limits(&args.serve.rule_limits()).unwrap_err();
        assert_eq!(
            e,
            "--max-admission-output (4194304) must be at least --max-rule-output (8388608)"
        );
        let args = Command::try_parse_from([
            "initium",
            "--max-inflight-bytes",
            "64Mi",
            "--max-header-bytes",
            "8192",
        ])
        .expect("sizes parse");
        assert_eq!(args.serve.max_inflight_bytes, 64 << 20);
        assert_eq!(args.serve.max_header_bytes, 8192);
        let e = bytes("8MB").unwrap_err();
        assert!(e.contains("Ki, Mi or Gi"), "{e}");
    }

    #[test]
    fn text_logs_escape_control_characters_from_untrusted_text() {
        use std::sync::{Arc, Mutex};
        let written = Arc::new(Mutex::new(Vec::<u8>::new()));
        let sink = written.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .fmt_fields(text_fields())
            .with_writer(move || Sink(sink.clone()))
            .finish();
        let name = "web\u{1b}[2J\u{1b}[31mred\u{7}\u{202e}";
        tracing::subscriber::with_default(subscriber, || {
            tracing::info!(name = %name, kind = "Pod\u{1b}]0;title\u{7}", "admitted {name}");
        });
        let text = String::from_utf8(written.lock().map(|w| w.clone()).unwrap_or_default())
            .expect("UTF-8");
        assert!(
            !text.contains('\u{1b}') && !text.contains('\u{7}'),
            "{text:?}"
        );
        assert!(!text.contains('\u{202e}'), "{text:?}");
        assert!(
            text.contains(r"name=web\u{1b}[2J\u{1b}[31mred\u{7}\u{202e}"),
            "{text}"
        );
        assert!(text.contains(r"admitted web\u{1b}[2J"), "{text}");
        assert_eq!(text.trim_end().lines().count(), 1, "{text}");
    }

    struct Sink(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Sink {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            if let Ok(mut w) = self.0.lock() {
                w.extend_from_slice(buf);
            }
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_cause_chain_lists_each_cause_once() {
        #[derive(Debug, thiserror::Error)]
        #[error("the webhook server stopped")]
        struct Outer(#[source] std::io::Error);
        #[derive(Debug, thiserror::Error)]
        #[error("read failed: {0}")]
        struct Repeats(#[source] std::io::Error);
        let e = Outer(std::io::Error::other("too many open files"));
        assert_eq!(
            cause_chain(&e),
            "the webhook server stopped: too many open files"
        );
        let e = Repeats(std::io::Error::other("too many open files"));
        assert_eq!(cause_chain(&e), "read failed: too many open files");
    }
}
