//! `initium serve`, the online composition root: it parses the flags ([`args`]), starts the
//! log ([`logging`]), binds the ports, loads the serving certificate ([`crate::tls`]), and runs
//! the webhook server ([`crate::admission`]), the controller's duties ([`crate::controller`])
//! and the operations port ([`crate::ops`]) in one process until SIGTERM, supervising them: a
//! part that stops takes the process down with its cause.

pub mod args;
pub mod logging;

pub use args::{LogFormat, ServeArgs};

use std::net::SocketAddr;
use std::time::Duration;

use tokio::task::JoinHandle;

use crate::admission::state::{AdmissionConfig, Shared};
use crate::controller::{self, ControllerConfig, WebhookEndpoint};
use crate::tls::{CaBundleSource, TlsSource};
use crate::{Error, admission, ops};

/// A client for the API server (KUBECONFIG, else the in-cluster configuration) whose
/// requests carry `User-Agent: initium/<version>`, so audit logs and API server metrics tell
/// initium's requests apart.
pub(crate) async fn api_client() -> Result<kube::Client, Error> {
    const CANNOT: &str = "cannot reach the Kubernetes API (KUBECONFIG or in-cluster config)";
    if let Some(missing) = missing_kubeconfig() {
        return Err(Error::serve(missing));
    }
    let mut config = kube::Config::infer().await.map_err(|e| {
        Error::serve(format!(
            "cannot load the Kubernetes configuration: {}",
            crate::report(&e)
        ))
    })?;
    config.headers.push((
        http::header::USER_AGENT,
        http::HeaderValue::from_static(concat!("initium/", env!("CARGO_PKG_VERSION"))),
    ));
    kube::Client::try_from(config).map_err(|e| Error::serve_from(CANNOT, e))
}

/// Why no configuration can be found, as a sentence that says what to do; `None` when there
/// is one to try (a KUBECONFIG file, `~/.kube/config`, or a Pod's service account).
fn missing_kubeconfig() -> Option<String> {
    if let Some(paths) = std::env::var_os("KUBECONFIG").filter(|p| !p.is_empty()) {
        let missing: Vec<String> = std::env::split_paths(&paths)
            .filter(|p| !p.as_os_str().is_empty() && !p.exists())
            .map(|p| p.display().to_string())
            .collect();
        let all = std::env::split_paths(&paths)
            .filter(|p| !p.as_os_str().is_empty())
            .count();
        return (!missing.is_empty() && missing.len() == all).then(|| {
            format!(
                "KUBECONFIG names {}, which does not exist: point KUBECONFIG at a kubeconfig \
                 file (for the project's own control plane: eval \"$(scripts/control-plane env)\")",
                missing.join(", ")
            )
        });
    }
    let in_cluster = std::env::var_os("KUBERNETES_SERVICE_HOST").is_some();
    let home_config = std::env::var_os("HOME")
        .map(|home| std::path::Path::new(&home).join(".kube").join("config"))
        .is_some_and(|p| p.exists());
    (!in_cluster && !home_config).then(|| {
        "no Kubernetes configuration found: set KUBECONFIG to a kubeconfig file, put one at \
         ~/.kube/config, or run initium in a Pod with a service account"
            .to_string()
    })
}

/// Makes sure initium's own namespace (`--namespace`), which holds its Lease and TLS Secret,
/// exists: a first run out of cluster creates it. Returns whether it was created. When it is
/// missing and may not be created, the error says which `kubectl` command to run.
async fn ensure_namespace(client: &kube::Client, namespace: &str) -> crate::Result<bool> {
    use k8s_openapi::api::core::v1::Namespace;
    use kube::api::{Api, ObjectMeta, PostParams};
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let reached = |e: kube::Error| {
        Error::serve_from(format!("cannot check that namespace {namespace} exists"), e)
    };
    match namespaces.get_opt(namespace).await {
        Ok(Some(_)) => return Ok(false),
        Ok(None) => {}
        // Allowed to create but not to read, or read-only: the steps after this one say more.
        Err(kube::Error::Api(s)) if s.code == 403 => return Ok(false),
        Err(e) => return Err(reached(e)),
    }
    let wanted = Namespace {
        metadata: ObjectMeta {
            name: Some(namespace.to_string()),
            labels: Some(
                [(
                    "app.kubernetes.io/created-by".to_string(),
                    "initium".to_string(),
                )]
                .into(),
            ),
            ..ObjectMeta::default()
        },
        ..Namespace::default()
    };
    match namespaces.create(&PostParams::default(), &wanted).await {
        Ok(_) => Ok(true),
        // Another replica, or a person, created it meanwhile.
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
        Err(kube::Error::Api(s)) if s.code == 403 => Err(Error::serve(format!(
            "namespace {namespace} (--namespace) does not exist and initium may not create it \
             ({}): create it with `kubectl create namespace {namespace}`, or pass --namespace \
             with an existing one",
            s.message
        ))),
        Err(e) => Err(Error::serve_from(
            format!(
                "namespace {namespace} (--namespace) does not exist and creating it failed; \
                 create it with `kubectl create namespace {namespace}`"
            ),
            e,
        )),
    }
}

/// Stack of every runtime thread.
const THREAD_STACK_BYTES: usize = 8 * 1024 * 1024;

/// Runs `initium serve` until SIGTERM or SIGINT.
pub fn run(args: ServeArgs) -> crate::Result<()> {
    logging::init_logging(args.log_format);
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
        .map_err(|e| Error::serve_from("cannot start the async runtime", e))?;
    runtime.block_on(serve(args))
}

async fn serve(args: ServeArgs) -> crate::Result<()> {
    let limits = args.limits();
    limits
        .validate()
        .map_err(|e| Error::serve_from("invalid limits", e))?;
    args::validate_rule_limits(&args.rule_limits())
        .map_err(|e| Error::serve_from("invalid limits", e))?;
    // The ports first, before anything is written to the cluster: with a port taken, serve
    // stops here, and no Secret, Lease or webhook configuration points at another process.
    let webhook_listener = listen(args.listen, "--listen").await?;
    let ops_listener = listen(args.ops_listen, "--ops-listen").await?;
    let webhook_listener = webhook_listener.into_std().map_err(|e| {
        Error::serve_from(
            format!("cannot use the listener on {} (--listen)", args.listen),
            e,
        )
    })?;

    let client = api_client().await?;
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
    config.gate_release_concurrency = usize::from(args.gate_release_concurrency);
    config.audit_report_interval = args.audit_report_interval;
    config.quotas = crate::controller::Quotas {
        rules_per_namespace: args.max_rules_per_namespace,
        rule_bytes_per_namespace: args.max_rule_bytes_per_namespace,
    };
    config.max_audit_events_per_namespace = args.max_audit_events_per_namespace as usize;
    config.max_lookups_per_namespace = args.max_lookups_per_namespace;
    config.max_gate_objects_per_namespace = args.max_gate_objects_per_namespace;
    config.compile_rules = args.compile_rules;
    config.max_compiled_rules = args.max_compiled_rules;
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
    config.validate()?;
    if ensure_namespace(&client, &args.namespace).await? {
        tracing::info!(namespace = %args.namespace, "created initium's namespace (--namespace): it holds the Lease and the TLS Secret");
    }
    let tls = config.load_tls(&client).await?;
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
        signal = shutdown_signal() => {
            drain(signal, args.shutdown_delay, &shared).await;
            None
        }
        result = join(&mut controller_task) => Some(ended("the controller stopped".into(), result)),
        result = join(&mut webhook_task) => Some(ended(
            format!("the webhook server on {} (--listen) stopped", args.listen), result
        )),
        result = join(&mut ops_task) => Some(ended(
            format!("the operations server on {} (--ops-listen) stopped", args.ops_listen), result
        )),
    };
    match &failure {
        None => tracing::info!("shutting down: finishing requests in flight"),
        Some(cause) => tracing::error!(error = %crate::report(cause), "shutting down"),
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
        Some(error) => Err(error),
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
        // The cause sits inside the sentence, before the advice; `report` does not repeat it.
        Error::serve_from(format!("cannot listen on {addr} ({flag}): {e}; {hint}"), e)
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

/// Why `what`, a task that should run until shutdown, ended: its error (kept as the cause),
/// a panic's message, or that it returned.
fn ended<E: std::error::Error + Send + Sync + 'static>(
    what: String,
    result: Result<Result<(), E>, tokio::task::JoinError>,
) -> Error {
    match result {
        Ok(Ok(())) => Error::serve(format!("{what}: it ended before shutdown")),
        Ok(Err(e)) => Error::serve_from(what, e),
        Err(e) if e.is_panic() => {
            let payload = e.into_panic();
            let message = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "no message".into());
            Error::serve(format!("{what}: it panicked: {message}"))
        }
        Err(_) => Error::serve(format!("{what}: it was cancelled")),
    }
}

/// Which signal asked initium to stop.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Stop {
    /// SIGTERM: the kubelet stopping the Pod.
    Term,
    /// SIGINT: Ctrl-C in a terminal.
    Interrupt,
}

async fn shutdown_signal() -> Stop {
    use tokio::signal::unix::{SignalKind, signal};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => Stop::Term,
                _ = int.recv() => Stop::Interrupt,
            }
        }
        _ => {
            let _ = tokio::signal::ctrl_c().await;
            Stop::Interrupt
        }
    }
}

/// On SIGTERM: not ready at once, still serving for `delay`. The kubelet sends SIGTERM when
/// the Pod is deleted or evicted, at the same moment the endpoint controller marks it
/// terminating; the API server learns that a moment later and only then stops picking this
/// Pod. Measured on a real node (tests/real_node.rs): without the delay, a create racing a
/// rolling update failed with `EOF` under a `Fail` rule.
async fn drain(signal: Stop, delay: Duration, shared: &Shared) {
    shared.set_webhook_serving(false);
    if signal == Stop::Term && !delay.is_zero() {
        tracing::info!(
            delay = ?delay,
            "SIGTERM: not ready; serving on while the API server stops sending requests here"
        );
        tokio::time::sleep(delay).await;
    }
}
