//! A COMMIT whose reply is lost: a TCP proxy in front of the server (or PgBouncer) that speaks
//! just enough of the PostgreSQL protocol to see a transaction's `COMMIT` go out and its
//! `CommandComplete` come back, and that, for one COMMIT in [`ReplyLoss::one_in`], closes both
//! sides instead of passing the reply on. The server has committed; the client sees its
//! connection die while it waits, and cannot tell whether the transaction landed: the window of
//! findings 4 and 5 of issue 36 (a release or `processed` write retried after its commit had
//! landed).
//!
//! The proxy answers an `SSLRequest` with `N` itself (so the bytes it reads are the protocol's,
//! never TLS) and then forwards the startup and every message unchanged. Statements that commit
//! on their own (a claim, a heartbeat) are not touched: only an explicit `COMMIT` (or `END`)
//! sent as a simple query or parsed as a prepared statement is.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;

use anyhow::{Context, Result};

use crate::postgres;

/// `SSLRequest` and `GSSENCRequest`: answered `N` by the proxy (no encryption).
const SSL_REQUEST: u32 = 80_877_103;
const GSSENC_REQUEST: u32 = 80_877_104;
/// `CancelRequest`: forwarded, then the connection ends.
const CANCEL_REQUEST: u32 = 80_877_102;

/// What the proxy did, shared by its threads.
#[derive(Default)]
struct Counters {
    connections: AtomicU64,
    commits: AtomicU64,
    lost: AtomicU64,
}

/// The running proxy (its threads end with the xtask process).
pub(super) struct ReplyLoss {
    /// `url` with its host and port replaced by the proxy's.
    pub(super) url: String,
    counters: Arc<Counters>,
    /// One COMMIT reply in this many is lost.
    pub(super) one_in: u64,
}

impl ReplyLoss {
    /// Starts the proxy in front of the server `url` names, losing one COMMIT reply in
    /// `one_in` (chosen with SplitMix64 from `seed` and the connection's number).
    pub(super) fn start(url: &str, one_in: u64, seed: u64) -> Result<Self> {
        let upstream = postgres::endpoint(url).map_err(anyhow::Error::msg)?;
        let listener = TcpListener::bind("127.0.0.1:0").context("binding the reply-loss proxy")?;
        let port = listener.local_addr()?.port();
        let counters = Arc::new(Counters::default());
        let shared = counters.clone();
        thread::spawn(move || {
            for (n, client) in listener.incoming().enumerate() {
                let Ok(client) = client else { continue };
                let counters = shared.clone();
                let upstream = (upstream.host.clone(), upstream.port);
                let mut rng = seed ^ (n as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                thread::spawn(move || {
                    let _ = relay(client, &upstream, one_in, &mut rng, &counters);
                });
            }
        });
        Ok(Self {
            url: postgres::with_port(url, port),
            counters,
            one_in,
        })
    }

    /// Connections proxied, explicit COMMITs that succeeded, and replies lost.
    pub(super) fn counts(&self) -> (u64, u64, u64) {
        let c = &self.counters;
        (
            c.connections.load(Ordering::Relaxed),
            c.commits.load(Ordering::Relaxed),
            c.lost.load(Ordering::Relaxed),
        )
    }
}

/// One client connection: the startup, then both directions until either side closes.
fn relay(
    mut client: TcpStream,
    upstream: &(String, u16),
    one_in: u64,
    rng: &mut u64,
    counters: &Counters,
) -> Result<()> {
    let mut server = TcpStream::connect((upstream.0.as_str(), upstream.1))?;
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    // The startup: untyped messages, the length first.
    loop {
        let message = read_untyped(&mut client)?;
        let code = u32::from_be_bytes([message[4], message[5], message[6], message[7]]);
        match code {
            SSL_REQUEST | GSSENC_REQUEST => client.write_all(b"N")?,
            CANCEL_REQUEST => return Ok(server.write_all(&message)?),
            _ => {
                server.write_all(&message)?;
                break;
            }
        }
    }
    counters.connections.fetch_add(1, Ordering::Relaxed);
    let pending = Arc::new(AtomicU64::new(0));
    let (mut from_client, mut to_server) = (client.try_clone()?, server.try_clone()?);
    let sent = pending.clone();
    let upward = thread::spawn(move || {
        while let Ok(message) = read_typed(&mut from_client) {
            if is_commit(&message) {
                sent.fetch_add(1, Ordering::SeqCst);
            }
            if to_server.write_all(&message).is_err() {
                break;
            }
        }
        let _ = to_server.shutdown(Shutdown::Both);
    });
    while let Ok(message) = read_typed(&mut server) {
        let committed = message[0] == b'C' && message[5..].starts_with(b"COMMIT\0");
        if committed && take_one(&pending) {
            counters.commits.fetch_add(1, Ordering::Relaxed);
            if next(rng).is_multiple_of(one_in.max(1)) {
                counters.lost.fetch_add(1, Ordering::Relaxed);
                break;
            }
        }
        if client.write_all(&message).is_err() {
            break;
        }
    }
    let _ = client.shutdown(Shutdown::Both);
    let _ = server.shutdown(Shutdown::Both);
    let _ = upward.join();
    Ok(())
}

/// Takes one pending COMMIT, if any.
fn take_one(pending: &AtomicU64) -> bool {
    pending
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
}

/// Whether a client message sends `COMMIT` (or `END`): a simple query, or a prepared statement's
/// `Parse`.
fn is_commit(message: &[u8]) -> bool {
    let body = &message[5..];
    let text = match message[0] {
        b'Q' => body,
        // Parse: the statement's name (NUL-terminated), then its text.
        b'P' => match body.iter().position(|b| *b == 0) {
            Some(end) => &body[end + 1..],
            None => return false,
        },
        _ => return false,
    };
    let text = text.split(|b| *b == 0).next().unwrap_or_default();
    let text = String::from_utf8_lossy(text);
    let word = text
        .trim()
        .trim_end_matches(';')
        .trim()
        .to_ascii_uppercase();
    word == "COMMIT" || word == "END" || word == "COMMIT TRANSACTION" || word == "COMMIT WORK"
}

/// One startup-phase message: its length (4 bytes, counting itself) and body.
fn read_untyped(stream: &mut TcpStream) -> Result<Vec<u8>> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len)?;
    let n = u32::from_be_bytes(len) as usize;
    anyhow::ensure!((8..1 << 20).contains(&n), "bad startup length {n}");
    let mut message = len.to_vec();
    message.resize(n, 0);
    stream.read_exact(&mut message[4..])?;
    Ok(message)
}

/// One typed message: its tag, length (counting itself) and body, as read.
fn read_typed(stream: &mut TcpStream) -> Result<Vec<u8>> {
    let mut head = [0u8; 5];
    stream.read_exact(&mut head)?;
    let n = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    anyhow::ensure!(n >= 4, "bad message length {n}");
    let mut message = head.to_vec();
    message.resize(n + 1, 0);
    stream.read_exact(&mut message[5..])?;
    Ok(message)
}

/// SplitMix64.
fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::is_commit;

    fn message(tag: u8, body: &[u8]) -> Vec<u8> {
        let mut m = vec![tag];
        m.extend_from_slice(&((body.len() + 4) as u32).to_be_bytes());
        m.extend_from_slice(body);
        m
    }

    #[test]
    fn only_an_explicit_commit_counts() {
        assert!(is_commit(&message(b'Q', b"COMMIT\0")));
        assert!(is_commit(&message(b'Q', b" commit ;\0")));
        assert!(is_commit(&message(b'P', b"\0COMMIT\0\0\0")));
        assert!(!is_commit(&message(b'Q', b"COMMIT PREPARED 'x'\0")));
        assert!(!is_commit(&message(b'Q', b"SELECT 'COMMIT'\0")));
        assert!(!is_commit(&message(b'Q', b"ROLLBACK\0")));
        assert!(!is_commit(&message(b'B', b"COMMIT\0")));
    }
}
