//! The operations port (plain HTTP, for the kubelet and Prometheus): `/healthz`, `/readyz`,
//! `/metrics`. Kept apart from the webhook port so probes and scrapes need no TLS and never
//! compete with admission requests for a connection.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use crate::admission::state::Shared;

/// Content type of the OpenMetrics text exposition that `prometheus-client` writes.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

pub fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(shared)
}

/// Liveness: the process answers.
async fn healthz() -> &'static str {
    "ok"
}

/// Readiness: only while the webhook can answer, that is once every rule (and namespace) has
/// been listed, so a new replica does not admit objects with an empty or partial index, and
/// while the webhook server accepts connections (not before it starts, not after it stops or
/// once shutdown has begun).
async fn readyz(State(shared): State<Arc<Shared>>) -> Response {
    let not_ready = match (shared.is_webhook_serving(), shared.is_synced()) {
        (true, true) => return "ok".into_response(),
        (false, _) => "not ready: the webhook server has not started, or is shutting down",
        (true, false) => "not ready: the rules and namespaces have not been listed yet",
    };
    (StatusCode::SERVICE_UNAVAILABLE, not_ready).into_response()
}

async fn metrics(State(shared): State<Arc<Shared>>) -> Response {
    shared.prune_metrics();
    (
        [(header::CONTENT_TYPE, OPENMETRICS_CONTENT_TYPE)],
        shared.metrics.encode(),
    )
        .into_response()
}
