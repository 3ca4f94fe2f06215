//! `initium serve`: the webhook, the watches and the operations endpoints in one process.

use std::net::SocketAddr;
use std::time::Duration;

use crate::controller::{self, CaBundleSource, ControllerConfig, TlsSource, WebhookEndpoint};
use crate::engine::parse_duration;
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
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum LogFormat {
    Json,
    Text,
}

fn budget(text: &str) -> Result<Duration, String> {
    let d = parse_duration(text)?;
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
        .build()
        .map_err(|e| Error::Serve(format!("cannot start the async runtime: {e}")))?;
    runtime.block_on(serve(args))
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
        LogFormat::Text => builder.try_init(),
    };
}

async fn serve(args: ServeArgs) -> crate::Result<()> {
    let client = kube::Client::try_default().await.map_err(|e| {
        Error::Serve(format!(
            "cannot reach the Kubernetes API (KUBECONFIG or in-cluster config): {e}"
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
    let controller_error = |e: controller::ControllerError| Error::Serve(e.to_string());
    config.validate().map_err(controller_error)?;
    let tls = controller::tls(&client, &config)
        .await
        .map_err(controller_error)?;
    let rustls = tls.rustls_config();

    let shared = Shared::new(AdmissionConfig {
        budget: args.budget,
        ..AdmissionConfig::default()
    });
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };

    let ops = tokio::net::TcpListener::bind(args.ops_listen)
        .await
        .map_err(|e| {
            Error::Serve(format!(
                "cannot listen on {} (--ops-listen): {e}",
                args.ops_listen
            ))
        })?;
    let ops_task = tokio::spawn({
        let shared = shared.clone();
        let stop = stopped(stop_rx.clone());
        async move {
            axum::serve(ops, ops::router(shared))
                .with_graceful_shutdown(stop)
                .await
        }
    });

    let handle = axum_server::Handle::new();
    let webhook_task = tokio::spawn(admission::serve(
        args.listen,
        rustls,
        shared.clone(),
        handle.clone(),
    ));
    let controller_task = tokio::spawn(controller::run(
        client,
        shared.clone(),
        config,
        tls,
        stopped(stop_rx.clone()),
    ));
    tracing::info!(listen = %args.listen, ops = %args.ops_listen, budget = ?args.budget, "initium serving");

    let mut controller_task = controller_task;
    let failure = tokio::select! {
        () = shutdown_signal() => None,
        result = &mut controller_task => Some(format!("the controller stopped: {}", describe(result))),
    };
    tracing::info!("shutting down: finishing requests in flight");
    handle.graceful_shutdown(Some(args.shutdown_grace));
    let _ = stop_tx.send(true);
    let _ = webhook_task.await;
    let _ = ops_task.await;
    if failure.is_none() {
        // The controller releases the Lease on the way out, so another replica takes over
        // without waiting for it to expire.
        let _ = tokio::time::timeout(Duration::from_secs(5), controller_task).await;
    }
    match failure {
        None => Ok(()),
        Some(message) => Err(Error::Serve(message)),
    }
}

fn describe<E: std::fmt::Display>(result: Result<Result<(), E>, tokio::task::JoinError>) -> String {
    match result {
        Ok(Ok(())) => "it ended".into(),
        Ok(Err(e)) => e.to_string(),
        Err(e) => e.to_string(),
    }
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
