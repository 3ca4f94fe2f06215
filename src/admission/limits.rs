//! What one client, or many, may hold of the webhook server: connections, time to send a
//! request, bytes of request bodies in flight, work on the blocking pool. Every limit has a
//! flag on `initium serve` (docs/operations.md, "Limits"); over a limit a client gets a status
//! and a sentence, or its connection is closed, and initium's memory stays bounded.

use std::future::Ready;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum_server::accept::Accept;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::MAX_BODY_BYTES;

/// The limits of the webhook server. [`Limits::default`] gives the defaults of the flags.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest request body (`--max-body-bytes`); above it, 413.
    pub max_body_bytes: usize,
    /// Bytes of request bodies being read or worked on, across all connections
    /// (`--max-inflight-bytes`); a request that would go over it gets 503.
    pub max_inflight_bytes: usize,
    /// Open connections (`--max-connections`); more are closed as soon as they are accepted.
    pub max_connections: usize,
    /// Time a client has to send a request's headers, every request on a connection, and the
    /// longest an idle keep-alive connection stays open (`--header-read-timeout`).
    pub header_read_timeout: Duration,
    /// Time a client has to send a request's body once its headers are in
    /// (`--body-read-timeout`); after it, 408 and the connection is closed.
    pub body_read_timeout: Duration,
    /// Largest request head: HTTP/1.1 headers, HTTP/2 header list (`--max-header-bytes`).
    pub max_header_bytes: usize,
    /// HTTP/2 streams (requests) open at once on one connection
    /// (`--http2-max-concurrent-streams`).
    pub http2_max_concurrent_streams: u32,
    /// `/validate` compiles running at once (`--max-concurrent-validations`); a rule that
    /// waits longer than the latency budget for its turn is denied with "retry".
    pub max_concurrent_validations: usize,
    /// `/mutate` reviews evaluated at once on the blocking pool (above 64 KiB, or out of their
    /// inline slice), in turns per namespace (`--max-blocking-reviews`); one that waits longer
    /// than the latency budget gets 503 and the API server applies the webhook's failure policy.
    pub max_blocking_reviews: usize,
    /// Memory the reviews on the blocking pool may take together, each charged its estimate
    /// ([`super::fair::review_memory`]) before it is parsed (`--max-review-memory`).
    pub max_review_memory: usize,
    /// JSON values (array elements, object members, containers) in a review above 64 KiB
    /// (`--max-json-values`); above it, 413 before the review is parsed. Parsed JSON takes up
    /// to 16 times the bytes of its text (8 MiB of `[0,0,...]` is 128 MiB of values), so the
    /// body limit alone does not bound the memory of parsing.
    pub max_json_values: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_body_bytes: MAX_BODY_BYTES,
            max_inflight_bytes: 32 * 1024 * 1024,
            max_connections: 512,
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(10),
            max_header_bytes: 16 * 1024,
            http2_max_concurrent_streams: 100,
            max_concurrent_validations: 2,
            max_blocking_reviews: 2,
            max_review_memory: 128 << 20,
            max_json_values: 1_000_000,
        }
    }
}

/// hyper cannot read an HTTP/1.1 head into a buffer smaller than this.
const MIN_HEADER_BYTES: usize = 8 * 1024;

impl Limits {
    /// Checks that the limits can work together; the error names the flag to change.
    pub fn validate(&self) -> Result<(), String> {
        let zero = |flag: &str| Err(format!("{flag} must be more than zero"));
        if self.max_body_bytes == 0 {
            return zero("--max-body-bytes");
        }
        if self.max_connections == 0 {
            return zero("--max-connections");
        }
        if self.header_read_timeout.is_zero() {
            return zero("--header-read-timeout");
        }
        if self.body_read_timeout.is_zero() {
            return zero("--body-read-timeout");
        }
        if self.http2_max_concurrent_streams == 0 {
            return zero("--http2-max-concurrent-streams");
        }
        if self.max_concurrent_validations == 0 {
            return zero("--max-concurrent-validations");
        }
        if self.max_blocking_reviews == 0 {
            return zero("--max-blocking-reviews");
        }
        if self.max_review_memory == 0 {
            return zero("--max-review-memory");
        }
        if self.max_json_values == 0 {
            return zero("--max-json-values");
        }
        if self.max_inflight_bytes < self.max_body_bytes {
            return Err(format!(
                "--max-inflight-bytes ({}) must be at least --max-body-bytes ({}), or no \
                 request of the largest size could ever be read",
                self.max_inflight_bytes, self.max_body_bytes
            ));
        }
        if self.max_header_bytes < MIN_HEADER_BYTES {
            return Err(format!(
                "--max-header-bytes must be at least {MIN_HEADER_BYTES}"
            ));
        }
        if u32::try_from(self.max_header_bytes).is_err() {
            return Err("--max-header-bytes must be below 4 GiB".into());
        }
        Ok(())
    }
}

/// Whether `body` holds at most `limit` JSON values, counted without parsing: every value
/// but the first of an array or object follows a `,`, the first follows its `[` or `{`, so
/// `,` `[` `{` outside strings (plus the document itself) bound the count from above. A
/// linear scan, run on the blocking pool before a large review is parsed.
pub(crate) fn json_values_within(body: &[u8], limit: usize) -> bool {
    let mut values = 1usize;
    let mut in_string = false;
    let mut escaped = false;
    for &byte in body {
        if in_string {
            match byte {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match byte {
            b'"' => in_string = true,
            b',' | b'[' | b'{' => {
                values += 1;
                if values > limit {
                    return false;
                }
            }
            _ => {}
        }
    }
    true
}

/// Bytes of request bodies in flight across all connections.
#[derive(Debug)]
pub(crate) struct InflightBytes {
    used: AtomicUsize,
    limit: usize,
}

impl InflightBytes {
    pub(crate) fn new(limit: usize) -> Arc<InflightBytes> {
        Arc::new(InflightBytes {
            used: AtomicUsize::new(0),
            limit,
        })
    }

    pub(crate) fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes reserved now, by every request.
    pub(crate) fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }
}

/// Bytes one request holds of [`InflightBytes`]; given back when dropped.
#[derive(Debug)]
pub(crate) struct Reservation {
    pool: Arc<InflightBytes>,
    bytes: usize,
}

impl Reservation {
    pub(crate) fn new(pool: Arc<InflightBytes>) -> Reservation {
        Reservation { pool, bytes: 0 }
    }

    /// Grows the reservation to `total` bytes; `false` (and nothing reserved) if that would
    /// take the pool over its limit.
    pub(crate) fn grow_to(&mut self, total: usize) -> bool {
        let Some(more) = total.checked_sub(self.bytes).filter(|n| *n > 0) else {
            return true;
        };
        let limit = self.pool.limit;
        let taken = self
            .pool
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(more).filter(|n| *n <= limit)
            });
        if taken.is_ok() {
            self.bytes = total;
        }
        taken.is_ok()
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.pool.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// The innermost acceptor of the webhook server: takes a connection slot before the TLS
/// handshake, and refuses (closes) the connection when there is none. The slot is given back
/// when the connection closes. It also sets `TCP_NODELAY` on the connections it keeps.
#[derive(Clone, Debug)]
pub(crate) struct ConnectionLimit {
    slots: Arc<Semaphore>,
    max: usize,
}

impl ConnectionLimit {
    pub(crate) fn new(max: usize) -> ConnectionLimit {
        ConnectionLimit {
            slots: Arc::new(Semaphore::new(max.min(Semaphore::MAX_PERMITS))),
            max,
        }
    }
}

impl<S> Accept<TcpStream, S> for ConnectionLimit {
    type Stream = Counted<TcpStream>;
    type Service = S;
    type Future = Ready<io::Result<(Counted<TcpStream>, S)>>;

    fn accept(&self, stream: TcpStream, service: S) -> Self::Future {
        std::future::ready(match self.slots.clone().try_acquire_owned() {
            Ok(slot) => {
                // An answer is written as several small TLS records (HTTP/2 HEADERS, then
                // DATA); with Nagle's algorithm the later ones wait for the API server to
                // acknowledge the first, which a delayed ACK can hold back for up to 40 ms.
                // Go (the API server's side) sets TCP_NODELAY on every connection; so do we.
                if let Err(e) = stream.set_nodelay(true) {
                    tracing::debug!(error = %e, "cannot set TCP_NODELAY on a webhook connection");
                }
                Ok((
                    Counted {
                        inner: stream,
                        _slot: slot,
                    },
                    service,
                ))
            }
            // Dropping the stream closes the connection.
            Err(_) => Err(io::Error::other(format!(
                "connection refused: {} connections are open (--max-connections)",
                self.max
            ))),
        })
    }
}

/// A connection that holds one slot of [`ConnectionLimit`].
#[derive(Debug)]
pub(crate) struct Counted<I> {
    inner: I,
    _slot: OwnedSemaphorePermit,
}

impl<I: AsyncRead + Unpin> AsyncRead for Counted<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Counted<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn kept_connections_have_nodelay_and_refused_ones_are_closed() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let limit = ConnectionLimit::new(1);
        let _client = TcpStream::connect(address).await.unwrap();
        let (stream, _) = listener.accept().await.unwrap();
        assert!(!stream.nodelay().unwrap(), "off until the acceptor sets it");
        let (kept, ()) = limit.accept(stream, ()).await.unwrap();
        assert!(kept.inner.nodelay().unwrap());

        let _second = TcpStream::connect(address).await.unwrap();
        let (stream, _) = listener.accept().await.unwrap();
        let refused = limit.accept(stream, ()).await.err().unwrap();
        assert!(
            refused.to_string().contains("--max-connections"),
            "{refused}"
        );
        drop(kept);
        let _third = TcpStream::connect(address).await.unwrap();
        let (stream, _) = listener.accept().await.unwrap();
        assert!(limit.accept(stream, ()).await.is_ok(), "the slot came back");
    }

    #[test]
    fn reservations_stay_within_the_pool_and_give_bytes_back() {
        let pool = InflightBytes::new(100);
        let mut a = Reservation::new(pool.clone());
        assert!(a.grow_to(60));
        let mut b = Reservation::new(pool.clone());
        assert!(!b.grow_to(41), "60 + 41 is over 100");
        assert_eq!(pool.used(), 60, "a refused reservation takes nothing");
        assert!(b.grow_to(40));
        assert_eq!(pool.used(), 100);
        assert!(a.grow_to(50), "shrinking is never refused");
        drop(a);
        assert_eq!(pool.used(), 40);
        drop(b);
        assert_eq!(pool.used(), 0);
    }

    #[test]
    fn json_values_are_counted_outside_strings() {
        assert!(json_values_within(b"[0,0,0]", 4));
        assert!(!json_values_within(b"[0,0,0]", 3));
        assert!(json_values_within(br#"{"a":"x,y,[{","b":[1]}"#, 4));
        assert!(
            json_values_within(br#"["\",",1]"#, 3),
            "an escaped quote ends no string"
        );
        assert!(
            !json_values_within(br#"["\\",1,2]"#, 3),
            "an escaped backslash escapes no quote"
        );
    }

    #[test]
    fn limits_name_the_flag_to_change() {
        assert!(Limits::default().validate().is_ok());
        let small = Limits {
            max_inflight_bytes: 1024,
            ..Limits::default()
        };
        let e = small.validate().unwrap_err();
        assert!(
            e.contains("--max-inflight-bytes") && e.contains("--max-body-bytes"),
            "{e}"
        );
        let zero = Limits {
            max_connections: 0,
            ..Limits::default()
        };
        assert_eq!(
            zero.validate().unwrap_err(),
            "--max-connections must be more than zero"
        );
    }
}
