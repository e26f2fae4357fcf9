//! The console's own listener ([`crate::serve`]): HTTP/1 connections served by hyper with a
//! header-read timeout (which also closes a keep-alive connection idle that long), a cap on
//! open connections, a timeout per request, the client's address for the login limits, and a
//! graceful shutdown. `axum::serve` has none of the limits: 20,000 connections that each sent
//! half a request line held the process's descriptors and `/login` stopped answering.
//!
//! A connection serves a request (is busy) from the moment its request has arrived whole,
//! headers and body, until its response is written; the headers and the body each get the
//! header-read timeout. A connection that is not busy (still sending, or idle between
//! requests) may be closed to admit a new one:
//! - one address holds at most a quarter of the connections (by default): its next connection
//!   closes its own oldest idle one, or is turned away;
//! - at the cap, the oldest idle connection of the address that holds the most is closed.
//!
//! So a flood from a few addresses of connections that never finish a request (or trickle a
//! body) cannot keep out a client elsewhere that does; within one address the oldest go first.
//! Only when every open connection is busy is a new one turned away.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{Request, Response, StatusCode};
use axum::response::IntoResponse;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

/// The limits [`crate::serve`] puts on connections (an embedding service that mounts
/// [`crate::router`] on a server of its own sets its own).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// The most connections open at once (at the cap, the oldest idle connection of the
    /// address holding the most is closed to admit a new one).
    pub max_connections: usize,
    /// The most connections one client address holds (its next one closes its own oldest
    /// idle connection, or is turned away).
    pub max_connections_per_address: usize,
    /// How long a client may take to send a request's headers (and then its body), and how
    /// long a keep-alive connection may sit idle between requests, before it is closed.
    pub header_read_timeout: Duration,
    /// How long one request may take before it is answered 503.
    pub request_timeout: Duration,
}

impl Default for ConnectionLimits {
    /// 256 connections, 64 per address, 10 s to send the headers (or idle), 30 s per request.
    fn default() -> Self {
        Self {
            max_connections: 256,
            max_connections_per_address: 64,
            header_read_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(30),
        }
    }
}

/// The largest request body the console reads (its forms are a few hundred bytes).
const MAX_BODY: usize = 64 * 1024;

/// One open connection: its client's address, whether it serves a request now, and its close
/// switch.
struct Conn {
    id: u64,
    ip: IpAddr,
    busy: AtomicUsize,
    evict: CancellationToken,
}

/// The open connections, oldest first.
struct Connections {
    max: usize,
    per_address: usize,
    open: Mutex<VecDeque<Arc<Conn>>>,
    next: AtomicU64,
}

/// A connection's place among the open ones, given back when it is dropped.
struct Slot {
    conns: Arc<Connections>,
    conn: Arc<Conn>,
}

impl Connections {
    fn new(limits: &ConnectionLimits) -> Arc<Self> {
        Arc::new(Self {
            max: limits.max_connections.max(1),
            per_address: limits.max_connections_per_address.max(1),
            open: Mutex::new(VecDeque::new()),
            next: AtomicU64::new(0),
        })
    }

    /// A place for a new connection from `ip`, closing an idle one when `ip` holds its share
    /// (its own oldest) or the cap is reached (the oldest of the address holding the most);
    /// `None` when no idle connection may go.
    fn admit(self: &Arc<Self>, ip: IpAddr) -> Option<Slot> {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let idle = |c: &Arc<Conn>| c.busy.load(Ordering::Acquire) == 0;
        let mine = open.iter().filter(|c| c.ip == ip).count();
        let victim = if mine >= self.per_address {
            Some(open.iter().position(|c| c.ip == ip && idle(c))?)
        } else if open.len() >= self.max {
            let mut held: HashMap<IpAddr, usize> = HashMap::new();
            for c in open.iter() {
                *held.entry(c.ip).or_default() += 1;
            }
            let (at, _) = open
                .iter()
                .enumerate()
                .filter(|(_, c)| idle(c))
                .max_by_key(|(at, c)| (held[&c.ip], std::cmp::Reverse(*at)))?;
            Some(at)
        } else {
            None
        };
        if let Some(evicted) = victim.and_then(|at| open.remove(at)) {
            evicted.evict.cancel();
        }
        let conn = Arc::new(Conn {
            id: self.next.fetch_add(1, Ordering::Relaxed),
            ip,
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
    /// Marks `conn` busy, unless it was closed to admit another (under the lock that
    /// eviction takes, so a connection is never closed once a request of it began).
    fn new(conns: &Connections, conn: &Arc<Conn>) -> Option<Self> {
        let _open = conns.open.lock().unwrap_or_else(|e| e.into_inner());
        if conn.evict.is_cancelled() {
            return None;
        }
        conn.busy.fetch_add(1, Ordering::AcqRel);
        Some(Self(conn.clone()))
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Serves `app` on `listener` under `limits` until `shutdown` fires, then lets open requests
/// finish for up to `grace` and closes what is left.
pub(crate) async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    shutdown: CancellationToken,
    grace: Duration,
) {
    let conns = Connections::new(&limits);
    let graceful = GracefulShutdown::new();
    let mut tasks = JoinSet::new();
    let mut last_accept_warning: Option<Instant> = None;
    loop {
        while tasks.try_join_next().is_some() {}
        let (stream, peer) = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors, say: tried again shortly (the open connections'
                    // timeouts free them), warned about once a second at most.
                    if last_accept_warning.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
                        tracing::warn!(error = %e, "accepting a console connection failed; retrying");
                        last_accept_warning = Some(Instant::now());
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Some(slot) = conns.admit(peer.ip()) else {
            tracing::debug!(%peer, "refused a console connection: no idle connection may be closed for it");
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (conn, conns_of_request, app) = (slot.conn.clone(), conns.clone(), app.clone());
        let service = hyper::service::service_fn(move |mut request: Request<Incoming>| {
            request.extensions_mut().insert(ConnectInfo(peer));
            let (conn, conns, app) = (conn.clone(), conns_of_request.clone(), app.clone());
            async move {
                Ok::<_, std::convert::Infallible>(handle(app, request, &conns, &conn, limits).await)
            }
        });
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_read_timeout);
        let connection = graceful.watch(builder.serve_connection(TokioIo::new(stream), service));
        tasks.spawn(async move {
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
    if tokio::time::timeout(grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("console requests still open after the shutdown grace; closing them");
    }
    tasks.abort_all();
}

/// One request: its body read whole within the header-read timeout (a client that trickles
/// it is answered 408 and its connection stays closable meanwhile), then served by `app`
/// with the connection busy until the response is written, or 503 once the request timeout
/// passes.
async fn handle(
    app: Router,
    request: Request<Incoming>,
    conns: &Connections,
    conn: &Arc<Conn>,
    limits: ConnectionLimits,
) -> Response<Body> {
    let (parts, body) = request.into_parts();
    let read = tokio::time::timeout(
        limits.header_read_timeout,
        Limited::new(body, MAX_BODY).collect(),
    );
    let body = match read.await {
        Ok(Ok(body)) => body.to_bytes(),
        Ok(Err(_)) => {
            let msg = "refused: the request's body is too large or broken";
            return (StatusCode::PAYLOAD_TOO_LARGE, msg).into_response();
        }
        Err(_) => {
            let msg = "refused: the request's body took too long";
            return (StatusCode::REQUEST_TIMEOUT, msg).into_response();
        }
    };
    let Some(busy) = Busy::new(conns, conn) else {
        let msg = "the connection was closed to admit another; try again";
        return (StatusCode::SERVICE_UNAVAILABLE, msg).into_response();
    };
    let request = Request::from_parts(parts, Body::from(body));
    let response = answer(app, request, limits.request_timeout).await;
    // Busy until the body is written (dropped with it).
    response.map(|body| {
        Body::new(body.map_frame(move |frame| {
            let _busy = &busy;
            frame
        }))
    })
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

    fn limits(max: usize, per_address: usize) -> ConnectionLimits {
        ConnectionLimits {
            max_connections: max,
            max_connections_per_address: per_address,
            ..ConnectionLimits::default()
        }
    }

    #[test]
    fn at_the_cap_the_oldest_idle_connection_goes_first() {
        let ip: IpAddr = "127.0.0.1".parse().unwrap();
        let conns = Connections::new(&limits(2, 2));
        let a = conns.admit(ip).unwrap();
        let b = conns.admit(ip).unwrap();
        let busy_a = Busy::new(&conns, &a.conn).unwrap();
        // `a` serves a request: `b` (idle) is closed for `c`.
        let c = conns.admit(ip).unwrap();
        assert!(!a.conn.evict.is_cancelled());
        assert!(b.conn.evict.is_cancelled());
        assert!(
            Busy::new(&conns, &b.conn).is_none(),
            "a closed connection serves nothing"
        );
        // Every open connection busy: refused.
        let _busy_c = Busy::new(&conns, &c.conn).unwrap();
        assert!(conns.admit(ip).is_none());
        drop(busy_a);
        let _d = conns.admit(ip).unwrap();
        assert!(a.conn.evict.is_cancelled());
        drop(b);
        assert_eq!(conns.open.lock().unwrap().len(), 2);
    }

    #[test]
    fn a_flooding_address_loses_its_own_connections_first() {
        let (flood, client): (IpAddr, IpAddr) =
            ("127.0.0.2".parse().unwrap(), "127.0.0.1".parse().unwrap());
        let conns = Connections::new(&limits(4, 3));
        let mine = conns.admit(client).unwrap();
        let floods: Vec<Slot> = (0..3).map(|_| conns.admit(flood).unwrap()).collect();
        // The flood's fourth closes its own oldest (its share is 3), never the client's.
        let _more = conns.admit(flood).unwrap();
        assert!(floods[0].conn.evict.is_cancelled());
        assert!(!mine.conn.evict.is_cancelled());
        // At the cap, a new address closes the heaviest address' oldest idle connection.
        let _other = conns.admit("127.0.0.3".parse().unwrap()).unwrap();
        assert!(floods[1].conn.evict.is_cancelled());
        assert!(!mine.conn.evict.is_cancelled());
    }
}
