//! The HTTPS admission webhooks: thin handlers around the pure engine.
//!
//! `POST /mutate` is the mutating webhook (rules applied, one JSON patch back); `POST /validate`
//! is the validating webhook for the rules themselves. Handlers parse the AdmissionReview, call
//! the engine and answer; nothing on this path waits on the network. What they read — the rule
//! index, the Namespace labels, readiness, the metrics — is [`state::Shared`], which the
//! controller's duties write.

pub mod audit;
mod fair;
pub(crate) mod limits;
mod mutate;
mod review;
pub mod state;
mod telemetry;
mod validate;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum_server::Handle;
use axum_server::tls_rustls::{RustlsAcceptor, RustlsConfig};
use futures::StreamExt as _;
use initium_engine::human_bytes;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use tracing::{Instrument as _, Span};

use state::Shared;

pub use limits::Limits;
pub use review::WARNING_MAX_CHARS;

use limits::{ConnectionLimit, Reservation};
use telemetry::Record;

/// Default largest AdmissionReview accepted (413 above; `--max-body-bytes`). The API server
/// caps an object at 3 MiB and an UPDATE review carries two of them; 8 MiB leaves room without
/// inviting abuse.
pub const MAX_BODY_BYTES: usize = 8 * 1024 * 1024;

/// A connection that has not sent a complete first request by then is closed: the API server
/// sends its request right after the handshake, so only stuck or hostile clients hit this.
/// (Also bounds HTTP/2's preface, which no header timeout covers.)
const FIRST_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// TLS handshakes that take longer are dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a review's rules may run on the async runtime before the review is handed to the
/// blocking pool (and evaluated again there, with the whole budget): ten times what a Pod with
/// a thousand candidate rules takes (BENCHMARKS.md), short enough that no async worker is held
/// long.
const INLINE_SLICE: Duration = Duration::from_millis(2);

/// HTTP/2 pings on idle connections: a peer that stops answering is dropped.
const HTTP2_KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(20);
const HTTP2_KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// Path of the mutating webhook: every object initium may initialize.
pub const MUTATE_PATH: &str = "/mutate";
/// Path of the validating webhook: the rules themselves, compiled before they are stored.
pub const VALIDATE_PATH: &str = "/validate";

/// The webhook routes. Bodies above `--max-body-bytes` get 413; a body that is not an
/// AdmissionReview gets 400 with a one-line reason; a body that does not arrive within
/// `--body-read-timeout` gets 408; a body that would take the bytes in flight over
/// `--max-inflight-bytes` gets 503.
pub fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route(MUTATE_PATH, post(mutate))
        .route(VALIDATE_PATH, post(validate))
        .with_state(shared)
}

/// Serves [`router`] over HTTPS on `listener` (already bound: `initium serve` binds before it
/// does anything else, so a port in use stops it at once) until `handle` shuts it down;
/// `handle.graceful_shutdown` stops accepting and lets requests in flight finish. While it
/// serves, `shared` says so (`/readyz`).
///
/// rustls speaks TLS 1.2 and 1.3 only. HTTP/1.1 and HTTP/2 are both served; HTTP/2 is offered
/// through ALPN when `tls` lists it, as `RustlsConfig::from_pem` and friends do. The rustls
/// crypto provider must be installed by the caller (the binary's `main`). The limits come from
/// `shared.config.limits`.
pub async fn serve(
    listener: std::net::TcpListener,
    tls: RustlsConfig,
    shared: Arc<Shared>,
    handle: Handle<SocketAddr>,
) -> std::io::Result<()> {
    if tls.get_inner().alpn_protocols.is_empty() {
        tracing::warn!(
            "the webhook's TLS configuration offers no ALPN protocols; clients will use HTTP/1.1"
        );
    }
    let limits = &shared.config.limits;
    let acceptor = RustlsAcceptor::new(tls)
        .handshake_timeout(HANDSHAKE_TIMEOUT)
        .acceptor(ConnectionLimit::new(limits.max_connections));
    let mut server = axum_server::from_tcp(listener)?
        .acceptor(acceptor)
        .handle(handle)
        .first_request_timeout(FIRST_REQUEST_TIMEOUT)
        .accept_error_handler(|peer, error| {
            // Failed handshakes are usually clients that do not trust our certificate (a stale
            // caBundle: the API server then reports "x509: certificate signed by unknown
            // authority"); at debug, because port scans and probes fail the same way.
            let peer = peer.map(ToString::to_string).unwrap_or_default();
            tracing::debug!(%peer, %error, "webhook connection failed before its first request");
        });
    let builder = server.http_builder();
    builder
        .http1()
        // hyper applies it to every request on a connection, and to an idle keep-alive
        // connection waiting for its next request.
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(limits.max_header_bytes);
    builder
        .http2()
        .max_concurrent_streams(limits.http2_max_concurrent_streams)
        .max_header_list_size(u32::try_from(limits.max_header_bytes).unwrap_or(u32::MAX))
        .keep_alive_interval(HTTP2_KEEP_ALIVE_INTERVAL)
        .keep_alive_timeout(HTTP2_KEEP_ALIVE_TIMEOUT);
    let serving = Serving::start(shared.clone());
    let result = server.serve(router(shared).into_make_service()).await;
    drop(serving);
    result
}

/// `/readyz` reports the webhook as serving while this lives.
struct Serving(Arc<Shared>);

impl Serving {
    fn start(shared: Arc<Shared>) -> Serving {
        shared.set_webhook_serving(true);
        Serving(shared)
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        self.0.set_webhook_serving(false);
    }
}

/// What a webhook handler answers.
pub(crate) enum Reply {
    /// 200 with an AdmissionReview (allowed or denied: both are answers).
    Review(Vec<u8>),
    /// 400: the body is not an AdmissionReview.
    BadRequest(String),
    /// 408: the body did not arrive in time; the connection is closed.
    TimedOut(String),
    /// 413: the review is too large to parse.
    TooLarge(String),
    /// 500: initium could not answer; the API server applies the webhook's failurePolicy.
    Internal(String),
    /// 503: initium is at a limit; the API server applies the webhook's failurePolicy, a
    /// client may retry.
    Busy(String),
}

impl Reply {
    fn status(&self) -> StatusCode {
        match self {
            Reply::Review(_) => StatusCode::OK,
            Reply::BadRequest(_) => StatusCode::BAD_REQUEST,
            Reply::TimedOut(_) => StatusCode::REQUEST_TIMEOUT,
            Reply::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Reply::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            Reply::Busy(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The sentence of an answer that is not a review.
    fn error(&self) -> Option<&str> {
        match self {
            Reply::Review(_) => None,
            Reply::BadRequest(message)
            | Reply::TimedOut(message)
            | Reply::TooLarge(message)
            | Reply::Internal(message)
            | Reply::Busy(message) => Some(message),
        }
    }
}

impl IntoResponse for Reply {
    fn into_response(self) -> Response {
        let status = self.status();
        match self {
            Reply::Review(json) => {
                ([(header::CONTENT_TYPE, "application/json")], json).into_response()
            }
            Reply::Busy(message) => (status, [(header::RETRY_AFTER, "1")], message).into_response(),
            Reply::BadRequest(message)
            | Reply::TimedOut(message)
            | Reply::TooLarge(message)
            | Reply::Internal(message) => (status, message).into_response(),
        }
    }
}

/// The pure part of a webhook: the body in, the answer out, what happened in the record.
type Work = fn(&Shared, &[u8], &mut Record) -> Reply;

/// `POST /mutate`: one span and one record for the request, from arrival to answer.
async fn mutate(State(shared): State<Arc<Shared>>, request: Request) -> Response {
    let record = Record::new(Instant::now());
    let answered = mutate_request(&shared, request, record)
        .instrument(telemetry::span(MUTATE_PATH))
        .await;
    finish(&shared, answered)
}

/// `POST /validate`: as [`mutate`].
async fn validate(State(shared): State<Arc<Shared>>, request: Request) -> Response {
    let record = Record::new(Instant::now());
    let answered = validate_request(&shared, request, record)
        .instrument(telemetry::span(VALIDATE_PATH))
        .await;
    finish(&shared, answered)
}

/// Where every request ends: its record goes to `/metrics` (once, whichever way it ended) and
/// its answer says how long it took.
fn finish(shared: &Shared, (reply, record): (Reply, Record)) -> Response {
    let response = reply.into_response();
    let elapsed = record.commit(&shared.metrics);
    with_server_timing(response, elapsed)
}

async fn mutate_request(
    shared: &Arc<Shared>,
    request: Request,
    mut record: Record,
) -> (Reply, Record) {
    let (body, reservation) = match read_body(shared, request).await {
        Ok(read) => read,
        Err(reply) => return (reply, record),
    };
    // Parsing and evaluating a Pod takes tens of microseconds, less than handing it to another
    // thread, so small reviews run right here, for at most INLINE_SLICE. Above
    // `inline_body_limit`, or when the rules are still running after the slice, the work goes
    // to the blocking pool, a few reviews at a time (`--max-blocking-reviews`), in turns that
    // go round the namespaces (`fair`): one tenant's slow rules wait behind each other, not in
    // front of everyone else's, and never on the threads that serve other requests and
    // `/readyz`.
    let namespace = if body.len() <= shared.config.inline_body_limit {
        let slice = Instant::now() + INLINE_SLICE;
        match mutate::admit(shared, &body, &mut record, Some(slice)) {
            mutate::Admitted::Answered(reply) => return (reply, record),
            mutate::Admitted::OutOfSlice { namespace } => namespace,
        }
    } else {
        let scanned = body.clone();
        tokio::task::spawn_blocking(move || review::namespace_of(&scanned))
            .await
            .unwrap_or_default()
    };
    let deadline = record
        .arrival()
        .checked_add(shared.config.budget)
        .unwrap_or(record.arrival());
    let turns = shared.blocking_reviews.clone();
    // Small reviews (they started inline) take a few MiB at most, whatever the rules.
    let memory = if body.len() <= shared.config.inline_body_limit {
        0
    } else {
        fair::review_memory(body.len(), shared.config.limits.max_review_memory)
    };
    match turns
        .turn(&namespace, memory, tokio::time::Instant::from_std(deadline))
        .await
    {
        Some(turn) => {
            let turn = fair::PacedTurn::new(turns, &namespace, turn, deadline);
            blocking(
                shared.clone(),
                body,
                reservation,
                turn,
                record,
                mutate::admit_blocking,
            )
            .await
        }
        None => {
            let limit = shared.config.limits.max_blocking_reviews;
            let pool = human_bytes(shared.config.limits.max_review_memory);
            let message = format!(
                "initium is busy: up to {limit} AdmissionReviews that are large or whose rules \
                 run long are being evaluated (--max-blocking-reviews), in at most {pool} of \
                 memory (--max-review-memory, this one needs {}), and this one waited its whole \
                 latency budget; the API server applies the webhook's failure policy, a client \
                 may retry",
                human_bytes(memory)
            );
            tracing::warn!(bytes = body.len(), "{message}");
            (Reply::Busy(message), record)
        }
    }
}

async fn validate_request(
    shared: &Arc<Shared>,
    request: Request,
    mut record: Record,
) -> (Reply, Record) {
    let (body, reservation) = match read_body(shared, request).await {
        Ok(read) => read,
        Err(reply) => return (reply, record),
    };
    // Compiling a rule builds its regexes, which can take milliseconds or more; rule changes
    // are rare, so they always go to the blocking pool, a few at a time
    // (`--max-concurrent-validations`), so that a flood of rules cannot take every thread
    // and all the memory.
    let turns = shared.validations.clone();
    match turn(shared, turns, record.arrival()).await {
        Some(turn) => {
            blocking(
                shared.clone(),
                body,
                reservation,
                turn,
                record,
                validate::review_rule,
            )
            .await
        }
        None => {
            let reply = validate::busy(shared, &body, &mut record);
            (reply, record)
        }
    }
}

/// A turn on `turns`, waited for until the request's latency budget runs out.
async fn turn(
    shared: &Shared,
    turns: Arc<Semaphore>,
    arrival: Instant,
) -> Option<OwnedSemaphorePermit> {
    if let Ok(turn) = turns.clone().try_acquire_owned() {
        return Some(turn);
    }
    let deadline = arrival.checked_add(shared.config.budget).unwrap_or(arrival);
    let deadline = tokio::time::Instant::from_std(deadline);
    tokio::time::timeout_at(deadline, turns.acquire_owned())
        .await
        .ok()?
        .ok()
}

/// What a review holds while it is evaluated on the blocking pool: given back when its work
/// ends.
trait Hold: Send + 'static {
    fn hold<R>(self, work: impl FnOnce() -> R) -> R;
}

/// A validation's turn: held throughout.
impl Hold for OwnedSemaphorePermit {
    fn hold<R>(self, work: impl FnOnce() -> R) -> R {
        let done = work();
        drop(self);
        done
    }
}

/// An admission's turn: shared in slices with the other namespaces' reviews that wait.
impl Hold for fair::PacedTurn {
    fn hold<R>(self, work: impl FnOnce() -> R) -> R {
        self.run(work)
    }
}

/// Runs `work` on the blocking pool, in the request's span, holding the request's bytes and its
/// turn until it ends.
async fn blocking(
    shared: Arc<Shared>,
    body: Bytes,
    reservation: Reservation,
    turn: impl Hold,
    mut record: Record,
    work: Work,
) -> (Reply, Record) {
    let arrival = record.arrival();
    // A span does not follow work to another thread by itself.
    let span = Span::current();
    let done = tokio::task::spawn_blocking(move || {
        let _entered = span.enter();
        let max = shared.config.limits.max_json_values;
        let reply = turn.hold(|| {
            if limits::json_values_within(&body, max) {
                work(&shared, &body, &mut record)
            } else {
                let message = format!(
                    "the AdmissionReview has more than {max} JSON values (--max-json-values); \
                     no object the API server stores has that many"
                );
                tracing::warn!(bytes = body.len(), error = %message, "rejected an admission request");
                Reply::TooLarge(message)
            }
        });
        drop(reservation);
        (reply, record)
    })
    .await;
    done.unwrap_or_else(|e| {
        // Only a panic gets here (the blocking pool is never cancelled): logged with its
        // message, answered with a sentence, counted as an error (what the record knew went
        // with the panic).
        tracing::error!(error = %e, "admission work failed");
        let reply = Reply::Internal(
            "initium failed while answering this request (its log has the details); the API \
             server applies the webhook's failure policy"
                .into(),
        );
        (reply, Record::new(arrival))
    })
}

/// Adds `Server-Timing: admission;dur=<ms>`: the time from the request's arrival to its answer
/// (reading the body, parsing, rules, patch, writing the AdmissionReview), to the microsecond.
/// The API server ignores it; `curl -v` and the webhook benchmark read it.
fn with_server_timing(mut response: Response, elapsed: Duration) -> Response {
    let micros = elapsed.as_micros();
    let value = format!("admission;dur={}.{:03}", micros / 1000, micros % 1000);
    if let Ok(value) = header::HeaderValue::from_str(&value) {
        response
            .headers_mut()
            .insert(header::HeaderName::from_static("server-timing"), value);
    }
    response
}

/// The whole body and the bytes it holds of `--max-inflight-bytes`, or the answer: 413 above
/// `--max-body-bytes`, 503 over `--max-inflight-bytes`, 408 when it does not arrive within
/// `--body-read-timeout`, 400 when it cannot be read.
async fn read_body(shared: &Shared, request: Request) -> Result<(Bytes, Reservation), Reply> {
    let limits = &shared.config.limits;
    let max = limits.max_body_bytes;
    let too_large = || {
        Reply::TooLarge(format!(
            "the AdmissionReview is larger than {max} bytes (--max-body-bytes); the API server \
             never sends one that large"
        ))
    };
    let busy = || {
        Reply::Busy(format!(
            "initium is busy: the request bodies being read take {} of their {} bytes \
             (--max-inflight-bytes); retry in a moment",
            shared.inflight.used(),
            shared.inflight.limit()
        ))
    };
    let rejected = |reply: Reply| {
        if let Some(message) = reply.error() {
            tracing::warn!(
                status = reply.status().as_u16(),
                error = %message,
                "rejected an admission request"
            );
        }
        reply
    };

    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    let mut reservation = Reservation::new(shared.inflight.clone());
    if let Some(declared) = declared {
        if declared > max {
            return Err(rejected(too_large()));
        }
        if !reservation.grow_to(declared) {
            return Err(rejected(busy()));
        }
    }
    let mut body = Vec::with_capacity(declared.unwrap_or(0));
    let deadline = tokio::time::Instant::now() + limits.body_read_timeout;
    let mut chunks = request.into_body().into_data_stream();
    loop {
        let chunk = match tokio::time::timeout_at(deadline, chunks.next()).await {
            Ok(Some(Ok(chunk))) => chunk,
            Ok(None) => break,
            Ok(Some(Err(e))) => {
                return Err(rejected(Reply::BadRequest(format!(
                    "cannot read the request body: {e}"
                ))));
            }
            Err(_) => {
                return Err(rejected(Reply::TimedOut(format!(
                    "the request body did not arrive within {:?} (--body-read-timeout); the \
                     connection is closed",
                    limits.body_read_timeout
                ))));
            }
        };
        let total = body.len() + chunk.len();
        if total > max {
            return Err(rejected(too_large()));
        }
        if !reservation.grow_to(total) {
            return Err(rejected(busy()));
        }
        body.extend_from_slice(&chunk);
    }
    Ok((Bytes::from(body), reservation))
}

fn answer(response: &review::AdmissionResponse) -> Reply {
    match response.to_review_json() {
        Ok(json) => Reply::Review(json),
        Err(e) => Reply::Internal(format!("cannot write the AdmissionReview response: {e}")),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::state::AdmissionConfig;
    use super::*;
    use axum::body::Body;
    use tower::ServiceExt as _;

    const RULE_REVIEW: &str =
        include_str!("../../tests/data/admission/mutationrule-create-valid.json");
    const POD_REVIEW: &str = include_str!("../../tests/data/admission/pod-create.json");

    fn shared() -> Arc<Shared> {
        Shared::new(AdmissionConfig {
            budget: Duration::from_millis(50),
            ..AdmissionConfig::default()
        })
    }

    async fn post(shared: &Arc<Shared>, path: &str, body: Vec<u8>) -> (StatusCode, String) {
        let request = axum::http::Request::post(path)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body))
            .expect("request");
        let response = router(shared.clone())
            .oneshot(request)
            .await
            .expect("infallible");
        let status = response.status();
        let body = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .expect("body");
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    #[tokio::test]
    async fn a_rule_that_waits_its_whole_budget_for_a_compile_turn_is_denied_with_retry() {
        let shared = shared();
        let turns = shared.validations.clone();
        let taken = turns
            .clone()
            .acquire_many_owned(shared.config.limits.max_concurrent_validations as u32)
            .await
            .expect("all turns");
        let started = Instant::now();
        let (status, text) = post(&shared, "/validate", RULE_REVIEW.into()).await;
        assert!(
            started.elapsed() >= Duration::from_millis(50),
            "waited the budget"
        );
        assert_eq!(status, StatusCode::OK, "{text}");
        let answer: serde_json::Value = serde_json::from_str(&text).expect("JSON");
        let response = &answer["response"];
        assert_eq!(response["allowed"], false, "{answer}");
        assert_eq!(response["status"]["code"], 429, "{answer}");
        let message = response["status"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("--max-concurrent-validations") && message.contains("retry"),
            "{message}"
        );
        assert_eq!(
            response["uid"],
            serde_json::from_str::<serde_json::Value>(RULE_REVIEW).expect("JSON")["request"]["uid"]
        );
        // A turn frees up: the rule is checked (and valid).
        drop(taken);
        let (status, text) = post(&shared, "/validate", RULE_REVIEW.into()).await;
        assert_eq!(status, StatusCode::OK);
        assert!(text.contains("\"allowed\":true"), "{text}");
    }

    #[tokio::test]
    async fn a_large_review_that_waits_its_whole_budget_for_a_turn_gets_503() {
        let shared = shared();
        // Above the inline limit: padding the review keeps it valid.
        let mut review: serde_json::Value = serde_json::from_str(POD_REVIEW).expect("JSON");
        review["padding"] = serde_json::Value::String("x".repeat(100 * 1024));
        let body = serde_json::to_vec(&review).expect("JSON");
        assert!(body.len() > shared.config.inline_body_limit);
        let later = tokio::time::Instant::now() + Duration::from_secs(60);
        let mut taken = Vec::new();
        for _ in 0..shared.config.limits.max_blocking_reviews {
            taken.push(
                shared
                    .blocking_reviews
                    .turn("other", 0, later)
                    .await
                    .expect("a turn"),
            );
        }
        let (status, text) = post(&shared, "/mutate", body.clone()).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{text}");
        assert!(text.contains("--max-blocking-reviews"), "{text}");
        // Small reviews do not wait for those turns.
        let (status, _) = post(&shared, "/mutate", POD_REVIEW.into()).await;
        assert_eq!(status, StatusCode::OK);
        drop(taken);
        let (status, text) = post(&shared, "/mutate", body).await;
        assert_eq!(status, StatusCode::OK, "{text}");
        assert_eq!(shared.inflight.used(), 0, "every byte given back");
    }

    /// Issue 30, finding 10 (d): a rule whose value nests 150 levels deep passes the API
    /// server (it reads JSON 10,000 levels deep) but not serde_json (128): the validating
    /// webhook answered 400, which kubectl showed as "the server rejected our request for an
    /// unknown reason". Now the rule is denied naming itself, the field and the limits.
    #[tokio::test]
    async fn a_rule_nested_deeper_than_initium_reads_is_denied_naming_the_rule_and_field() {
        let shared = shared();
        let nested = |levels: usize| {
            let mut value = serde_json::json!("x");
            for _ in 0..levels {
                value = serde_json::json!({ "a": value });
            }
            value
        };
        let review = |levels: usize| {
            let mut review: serde_json::Value = serde_json::from_str(RULE_REVIEW).expect("JSON");
            review["request"]["object"]["spec"]["mutations"][0] =
                serde_json::json!({ "merge": nested(levels) });
            serde_json::to_vec(&review).expect("JSON")
        };
        let (status, text) = post(&shared, "/validate", review(150)).await;
        assert_eq!(status, StatusCode::OK, "{text}");
        let answer: serde_json::Value = serde_json::from_str(&text).expect("JSON");
        let response = &answer["response"];
        assert_eq!(response["allowed"], false, "{answer}");
        assert_eq!(response["status"]["code"], 422, "{answer}");
        assert_eq!(
            response["uid"],
            serde_json::from_str::<serde_json::Value>(RULE_REVIEW).expect("JSON")["request"]["uid"]
        );
        let message = response["status"]["message"].as_str().unwrap_or_default();
        assert!(
            message.starts_with(
                "MutationRule payments/test-certs: spec.mutations[0].merge.a.a.a.a..."
            ) && message.contains("nests 154 levels deep")
                && message.contains("at most 125 levels deep")
                && message.contains("at most 100 levels below the object's root (the depth limit)"),
            "{message}"
        );
        let cause = &response["status"]["details"]["causes"][0];
        assert_eq!(
            cause["field"], "spec.mutations[0].merge.a.a.a.a...",
            "{answer}"
        );
        // Within what initium reads, the rule is compiled as any other: a value deeper than
        // a rule may write is refused by the depth limit, with its own sentence.
        let (status, text) = post(&shared, "/validate", review(120)).await;
        assert_eq!(status, StatusCode::OK, "{text}");
        assert!(!text.contains("initium reads a rule"), "{text}");
        assert!(
            text.contains("\"allowed\":false")
                && text.contains("spec.mutations[0].merge: the value nests 120 levels deep"),
            "{text}"
        );
    }
}
/// What one large review takes at its peak against what it is charged
/// ([`fair::REVIEW_MEMORY_PER_BYTE`]). Linux only (`/proc/self/clear_refs`), one test at a time:
/// `cargo test --lib review_memory -- --ignored --test-threads=1 --nocapture`.
#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod review_memory {
    use super::*;
    use axum::body::Body;
    use tower::ServiceExt as _;

    fn status_kib(field: &str) -> usize {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with(field)).unwrap();
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    }

    #[tokio::test]
    #[ignore = "measures the process's memory: run alone, see the module's doc"]
    async fn a_large_review_takes_at_most_the_memory_it_is_charged() {
        let review: serde_json::Value =
            serde_json::from_str(include_str!("../../tests/data/admission/pod-create.json"))
                .unwrap();
        let shared = Shared::new(state::AdmissionConfig {
            budget: Duration::from_secs(5),
            ..state::AdmissionConfig::default()
        });
        let rule = serde_json::json!({"apiVersion": "initium.dev/v1alpha1",
            "kind": "ClusterMutationRule", "metadata": {"name": "r"},
            "spec": {"match": {"kinds": ["Pod"]}, "mutations": [
                {"merge": {"metadata": {"labels": {"seen": "yes"}}}},
                {"forEach": "$.spec.containers[*]",
                 "mutations": [{"merge": {"imagePullPolicy": "Always"}}]}]}});
        let compiled = vec![initium_engine::compile_document(&rule, "default").unwrap()];
        shared
            .rules
            .store(Arc::new(initium_engine::RuleIndex::new(compiled)));
        // Dense JSON first (the most memory per byte: a map and two strings per 30 bytes),
        // while the allocator has kept nothing from earlier reviews.
        for shape in ["40,000 env vars", "one 1.7 MB annotation", "400,000 args"] {
            let mut review = review.clone();
            let pod = review.pointer_mut("/request/object").unwrap();
            match shape {
                "40,000 env vars" => {
                    pod["spec"]["containers"][0]["env"] = (0..40_000)
                        .map(|i| serde_json::json!({"name": format!("V{i}"), "value": "v"}))
                        .collect();
                }
                "one 1.7 MB annotation" => {
                    pod["metadata"]["annotations"] =
                        serde_json::json!({"big": "x".repeat(1_700_000)});
                }
                _ => {
                    pod["spec"]["containers"][0]["args"] = (0..400_000).map(|_| "1").collect();
                }
            }
            let body = serde_json::to_vec(&review).unwrap();
            let bytes = body.len();
            std::fs::write("/proc/self/clear_refs", "5").unwrap();
            let before = status_kib("VmRSS:");
            let request = axum::http::Request::post(MUTATE_PATH)
                .header(header::CONTENT_TYPE, "application/json")
                .header(header::CONTENT_LENGTH, bytes)
                .body(Body::from(body))
                .unwrap();
            let response = router(shared.clone()).oneshot(request).await.unwrap();
            assert_eq!(response.status(), StatusCode::OK, "{shape}");
            let answer = axum::body::to_bytes(response.into_body(), usize::MAX).await;
            assert!(answer.is_ok_and(|a| a.len() > 100), "{shape}");
            let peak = (status_kib("VmHWM:") - before) * 1024;
            eprintln!(
                "review memory: {shape}: {bytes} bytes of review, peak +{peak} bytes ({:.1} per byte; charged {})",
                peak as f64 / bytes as f64,
                fair::REVIEW_MEMORY_PER_BYTE
            );
            assert!(
                peak <= bytes * fair::REVIEW_MEMORY_PER_BYTE,
                "{shape}: a review of {bytes} bytes took {peak} bytes at its peak, more than it is charged"
            );
        }
    }
}
