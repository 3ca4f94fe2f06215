//! The HTTPS admission webhooks: thin handlers around the pure engine.
//!
//! `POST /mutate` is the mutating webhook (rules applied, one JSON patch back); `POST /validate`
//! is the validating webhook for the rules themselves. Handlers parse the AdmissionReview, call
//! the engine and answer; nothing on this path waits on the network.

mod mutate;
mod review;
mod validate;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, FromRequest, Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum_server::Handle;
use axum_server::tls_rustls::RustlsConfig;

use crate::metrics::AdmissionLabels;
use crate::state::Shared;

pub use review::WARNING_MAX_CHARS;

/// Largest AdmissionReview accepted (413 above). The API server caps an object at 3 MiB and an
/// UPDATE review carries two of them; 8 MiB leaves room without inviting abuse.
pub const MAX_BODY_BYTES: usize = 8 * 1024 * 1024;

/// A connection that has not sent a complete first request by then is closed: the API server
/// sends its request right after the handshake, so only stuck or hostile clients hit this.
const FIRST_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The webhook routes. Bodies above [`MAX_BODY_BYTES`] get 413; a body that is not an
/// AdmissionReview gets 400 with a one-line reason.
pub fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/mutate", post(mutate))
        .route("/validate", post(validate))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(shared)
}

/// Serves [`router`] over HTTPS until `handle` shuts it down; `handle.graceful_shutdown`
/// stops accepting and lets requests in flight finish.
///
/// rustls speaks TLS 1.2 and 1.3 only. HTTP/1.1 and HTTP/2 are both served; HTTP/2 is offered
/// through ALPN when `tls` lists it, as `RustlsConfig::from_pem` and friends do. The rustls
/// crypto provider must be installed by the caller (the binary's `main`).
pub async fn serve(
    addr: SocketAddr,
    tls: RustlsConfig,
    shared: Arc<Shared>,
    handle: Handle<SocketAddr>,
) -> std::io::Result<()> {
    if tls.get_inner().alpn_protocols.is_empty() {
        tracing::warn!(
            "the webhook's TLS configuration offers no ALPN protocols; clients will use HTTP/1.1"
        );
    }
    axum_server::bind_rustls(addr, tls)
        .handle(handle)
        .first_request_timeout(FIRST_REQUEST_TIMEOUT)
        .accept_error_handler(|peer, error| {
            // Failed handshakes are usually clients that do not trust our certificate (a stale
            // caBundle: the API server then reports "x509: certificate signed by unknown
            // authority"); at debug, because port scans and probes fail the same way.
            tracing::debug!(peer = ?peer, %error, "webhook connection failed before its first request");
        })
        .serve(router(shared).into_make_service())
        .await
}

/// What a webhook handler answers.
pub(crate) enum Reply {
    /// 200 with an AdmissionReview (allowed or denied: both are answers).
    Review(Vec<u8>),
    /// 400: the body is not an AdmissionReview.
    BadRequest(String),
    /// 500: initium could not answer; the API server applies the webhook's failurePolicy.
    Internal(String),
}

impl IntoResponse for Reply {
    fn into_response(self) -> Response {
        match self {
            Reply::Review(json) => {
                ([(header::CONTENT_TYPE, "application/json")], json).into_response()
            }
            Reply::BadRequest(message) => (StatusCode::BAD_REQUEST, message).into_response(),
            Reply::Internal(message) => {
                (StatusCode::INTERNAL_SERVER_ERROR, message).into_response()
            }
        }
    }
}

type Work = fn(&Shared, &[u8], Instant) -> Reply;

async fn mutate(State(shared): State<Arc<Shared>>, request: Request) -> Response {
    let arrival = Instant::now();
    let body = match read_body(&shared, "mutate", request, arrival).await {
        Ok(body) => body,
        Err(response) => return response,
    };
    // Parsing and evaluating a Pod takes tens of microseconds, less than handing it to another
    // thread, so small reviews run right here. Above `inline_body_limit` the work grows with the
    // object and would hold up other requests on this worker: it goes to the blocking pool.
    let inline = body.len() <= shared.config.inline_body_limit;
    run(shared, body, arrival, inline, mutate::admit).await
}

async fn validate(State(shared): State<Arc<Shared>>, request: Request) -> Response {
    let arrival = Instant::now();
    let body = match read_body(&shared, "validate", request, arrival).await {
        Ok(body) => body,
        Err(response) => return response,
    };
    // Compiling a rule builds its regexes, which can take milliseconds; rule changes are rare,
    // so they always go to the blocking pool.
    run(shared, body, arrival, false, validate::review_rule).await
}

async fn run(
    shared: Arc<Shared>,
    body: Bytes,
    arrival: Instant,
    inline: bool,
    work: Work,
) -> Response {
    let response = if inline {
        work(&shared, &body, arrival).into_response()
    } else {
        match tokio::task::spawn_blocking(move || work(&shared, &body, arrival)).await {
            Ok(reply) => reply.into_response(),
            Err(e) => {
                tracing::error!(error = %e, "admission work failed");
                Reply::Internal(format!("admission failed: {e}")).into_response()
            }
        }
    };
    with_server_timing(response, arrival)
}

/// Adds `Server-Timing: admission;dur=<ms>`: the time from the request's arrival to its answer
/// (reading the body, parsing, rules, patch, writing the AdmissionReview), to the microsecond.
/// The API server ignores it; `curl -v` and the webhook benchmark read it.
fn with_server_timing(mut response: Response, arrival: Instant) -> Response {
    let micros = arrival.elapsed().as_micros();
    let value = format!("admission;dur={}.{:03}", micros / 1000, micros % 1000);
    if let Ok(value) = header::HeaderValue::from_str(&value) {
        response
            .headers_mut()
            .insert(header::HeaderName::from_static("server-timing"), value);
    }
    response
}

/// The whole body, or the error response: 413 above [`MAX_BODY_BYTES`], 400 when it cannot be
/// read.
async fn read_body(
    shared: &Shared,
    webhook: &'static str,
    request: Request,
    arrival: Instant,
) -> Result<Bytes, Response> {
    let rejection = match Bytes::from_request(request, &()).await {
        Ok(body) => return Ok(body),
        Err(rejection) => rejection,
    };
    let status = rejection.status();
    let message = if status == StatusCode::PAYLOAD_TOO_LARGE {
        format!("the AdmissionReview is larger than {MAX_BODY_BYTES} bytes")
    } else {
        format!("cannot read the request body: {}", rejection.body_text())
    };
    tracing::warn!(webhook, status = status.as_u16(), error = %message, "rejected an admission request");
    observe(shared, "unknown", "unknown", "error", arrival);
    Err((status, message).into_response())
}

/// Records the request's duration, from its arrival, and returns it (for the log).
fn observe(
    shared: &Shared,
    kind: &str,
    operation: &str,
    result: &'static str,
    arrival: Instant,
) -> Duration {
    let elapsed = arrival.elapsed();
    shared
        .metrics
        .admission_duration
        .get_or_create(&AdmissionLabels {
            kind: kind.to_string(),
            operation: operation_label(operation).to_string(),
            result: result.to_string(),
        })
        .observe(elapsed.as_secs_f64());
    elapsed
}

fn answer(response: &review::AdmissionResponse) -> Reply {
    match response.to_review_json() {
        Ok(json) => Reply::Review(json),
        Err(e) => Reply::Internal(format!("cannot write the AdmissionReview response: {e}")),
    }
}

/// Metric label for an operation: one of the four Kubernetes knows, so a client cannot grow the
/// label set.
fn operation_label(operation: &str) -> &'static str {
    match operation {
        "CREATE" => "CREATE",
        "UPDATE" => "UPDATE",
        "DELETE" => "DELETE",
        "CONNECT" => "CONNECT",
        _ => "unknown",
    }
}
