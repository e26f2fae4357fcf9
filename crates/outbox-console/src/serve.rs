//! The console's own listener ([`crate::serve`]): HTTP/1 connections served by hyper with a
//! header-read timeout (which also closes a keep-alive connection idle that long), a cap on
//! open connections, a timeout per request, the client's address for the login limits, and a
//! graceful shutdown. `axum::serve` has none of the limits: 20,000 connections that each sent
//! half a request line held the process's descriptors and `/login` stopped answering.
//!
//! At the cap, the oldest connection that is not serving a request (one still sending its
//! headers, or idle between requests) is closed to admit the new one; only when every open
//! connection is serving a request is the new one turned away. So a flood of connections that
//! never finish their request cannot keep a client that does out: the newest connection is the
//! last to go.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{Request, Response, StatusCode};
use axum::response::IntoResponse;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

/// The limits [`crate::serve`] puts on connections (an embedding service that mounts
/// [`crate::router`] on a server of its own sets its own).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// The most connections open at once (at the cap, the oldest connection not serving a
    /// request is closed to admit a new one).
    pub max_connections: usize,
    /// How long a client may take to send a request's headers, and how long a keep-alive
    /// connection may sit idle between requests, before it is closed.
    pub header_read_timeout: Duration,
    /// How long one request may take before it is answered 503.
    pub request_timeout: Duration,
}

impl Default for ConnectionLimits {
    /// 256 connections, 10 s to send the headers (or idle), 30 s per request.
    fn default() -> Self {
        Self {
            max_connections: 256,
            header_read_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(30),
        }
    }
}

/// One open connection: whether it serves a request now, and its close switch.
struct Conn {
    id: u64,
    busy: AtomicUsize,
    evict: CancellationToken,
}

/// The open connections, oldest first.
struct Connections {
    max: usize,
    open: Mutex<VecDeque<Arc<Conn>>>,
    next: AtomicU64,
}

/// A connection's place among the open ones, given back when it is dropped.
struct Slot {
    conns: Arc<Connections>,
    conn: Arc<Conn>,
}

impl Connections {
    fn new(max: usize) -> Arc<Self> {
        Arc::new(Self {
            max: max.max(1),
            open: Mutex::new(VecDeque::new()),
            next: AtomicU64::new(0),
        })
    }

    /// A place for a new connection: at the cap, the oldest connection not serving a request
    /// is closed for it; `None` when every open connection serves one.
    fn admit(self: &Arc<Self>) -> Option<Slot> {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        if open.len() >= self.max {
            let idle = open
                .iter()
                .position(|c| c.busy.load(Ordering::Acquire) == 0)?;
            if let Some(evicted) = open.remove(idle) {
                evicted.evict.cancel();
            }
        }
        let conn = Arc::new(Conn {
            id: self.next.fetch_add(1, Ordering::Relaxed),
            busy: AtomicUsize::new(0),
            evict: CancellationToken::new(),
        });
        open.push_back(conn.clone());
        Some(Slot {
            conns: self.clone(),
            conn,
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = self.conns.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(at) = open.iter().position(|c| c.id == self.conn.id) {
            open.remove(at);
        }
    }
}

/// Marks a connection busy while one of its requests is served.
struct Busy(Arc<Conn>);

impl Busy {
    fn new(conn: &Arc<Conn>) -> Self {
        conn.busy.fetch_add(1, Ordering::AcqRel);
        Self(conn.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Serves `app` on `listener` under `limits` until `shutdown` fires, then lets open requests
/// finish for up to `grace`.
pub(crate) async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    shutdown: CancellationToken,
    grace: Duration,
) {
    let conns = Connections::new(limits.max_connections);
    let graceful = GracefulShutdown::new();
    loop {
        let (stream, peer) = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors, say: the accept is tried again shortly; the open
                    // connections' timeouts free them.
                    tracing::warn!(error = %e, "accepting a console connection failed; retrying");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Some(slot) = conns.admit() else {
            tracing::warn!(%peer, max = limits.max_connections, "refused a console connection: every open connection is serving a request");
            continue;
        };
        let _ = stream.set_nodelay(true);
        let conn = slot.conn.clone();
        let app = app.clone();
        let service = hyper::service::service_fn(move |mut request: Request<Incoming>| {
            request.extensions_mut().insert(ConnectInfo(peer));
            let busy = Busy::new(&conn);
            let app = app.clone();
            async move {
                let _busy = busy;
                Ok::<_, std::convert::Infallible>(
                    answer(app, request.map(Body::new), limits.request_timeout).await,
                )
            }
        });
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_read_timeout);
        let connection = graceful.watch(builder.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            tokio::select! {
                served = connection => {
                    if let Err(e) = served {
                        tracing::debug!(%peer, error = %e, "a console connection ended with an error");
                    }
                }
                _ = slot.conn.evict.cancelled() => {
                    tracing::debug!(%peer, "closed a console connection to admit a new one");
                }
            }
            drop(slot);
        });
    }
    drop(listener);
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(grace) => {
            tracing::warn!("console requests still open after the shutdown grace; closing them");
        }
    }
}

/// `app`'s answer to `request`, or 503 once `timeout` passes.
async fn answer(app: Router, request: Request<Body>, timeout: Duration) -> Response<Body> {
    match tokio::time::timeout(timeout, app.oneshot(request)).await {
        Ok(Ok(response)) => response,
        Ok(Err(never)) => match never {},
        Err(_) => {
            tracing::warn!(
                timeout_ms = timeout.as_millis() as u64,
                "a console request timed out"
            );
            let msg = "the console took too long to answer; try again";
            (StatusCode::SERVICE_UNAVAILABLE, msg).into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn at_the_cap_the_oldest_idle_connection_goes_first() {
        let conns = Connections::new(2);
        let a = conns.admit().unwrap();
        let b = conns.admit().unwrap();
        let busy_a = Busy::new(&a.conn);
        // `a` serves a request: `b` (idle) is closed for `c`.
        let c = conns.admit().unwrap();
        assert!(!a.conn.evict.is_cancelled());
        assert!(b.conn.evict.is_cancelled());
        // Every open connection busy: refused.
        let _busy_c = Busy::new(&c.conn);
        assert!(conns.admit().is_none());
        drop(busy_a);
        let _d = conns.admit().unwrap();
        assert!(a.conn.evict.is_cancelled());
        drop(b);
        assert_eq!(conns.open.lock().unwrap().len(), 2);
    }
}
