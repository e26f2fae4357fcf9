//! A `COMMIT` whose reply is lost, on demand: a TCP proxy in front of PostgreSQL that passes
//! every message on unchanged until it is armed, and then, at the next `CommandComplete COMMIT`
//! the server sends, closes both sides instead of passing the reply on. The server has
//! committed; the client sees its connection die while it waits for the reply, and cannot
//! tell whether the transaction landed. One interleaving of the fault suite's reply-loss proxy
//! (`xtask/src/faults/reply_loss.rs`, which loses one reply in 25 at random), pinned to one
//! statement so a test can assert what the library makes of it.
//!
//! The proxy answers an `SSLRequest` with `N` itself (so the bytes it reads are the protocol's,
//! never TLS) and then forwards the startup and every message unchanged.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;

/// `SSLRequest` and `GSSENCRequest`: answered `N` by the proxy (no encryption).
const SSL_REQUEST: u32 = 80_877_103;
const GSSENC_REQUEST: u32 = 80_877_104;

/// The running proxy; its threads end with the test process.
pub struct ReplyLoss {
    /// The database URL with its host and port replaced by the proxy's.
    pub url: String,
    armed: Arc<AtomicBool>,
    lost: Arc<AtomicU64>,
}

impl ReplyLoss {
    /// Starts a proxy in front of the PostgreSQL server of `url` (`postgres://…@HOST:PORT/…`).
    pub fn start(url: &str) -> Self {
        let (prefix, rest) = url.split_once('@').expect("a URL with user@host");
        let (endpoint, path) = rest.split_once('/').expect("a URL with a database");
        let upstream = endpoint.to_string();
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let port = listener.local_addr().expect("the proxy's address").port();
        let (armed, lost) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicU64::new(0)),
        );
        let (a, l) = (armed.clone(), lost.clone());
        thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let (upstream, armed, lost) = (upstream.clone(), a.clone(), l.clone());
                thread::spawn(move || {
                    let _ = relay(client, &upstream, &armed, &lost);
                });
            }
        });
        Self {
            url: format!("{prefix}@127.0.0.1:{port}/{path}"),
            armed,
            lost,
        }
    }

    /// The reply to the next `COMMIT` that succeeds, on any connection, is lost.
    pub fn lose_next_commit_reply(&self) {
        self.armed.store(true, Ordering::SeqCst);
    }

    /// How many replies were lost so far.
    pub fn lost(&self) -> u64 {
        self.lost.load(Ordering::SeqCst)
    }
}

/// One client connection: its startup (an `SSLRequest` answered `N`), then both directions;
/// the server's messages are read whole, so an armed proxy can stop at a `COMMIT`'s reply.
fn relay(
    mut client: TcpStream,
    upstream: &str,
    armed: &AtomicBool,
    lost: &AtomicU64,
) -> std::io::Result<()> {
    let mut server = TcpStream::connect(upstream)?;
    let startup = loop {
        let mut len = [0u8; 4];
        client.read_exact(&mut len)?;
        let mut body = vec![0u8; (u32::from_be_bytes(len) as usize).saturating_sub(4)];
        client.read_exact(&mut body)?;
        let code = body
            .get(..4)
            .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]));
        if matches!(code, Some(SSL_REQUEST | GSSENC_REQUEST)) {
            client.write_all(b"N")?;
            continue;
        }
        break [len.to_vec(), body].concat();
    };
    server.write_all(&startup)?;
    let (mut from_client, mut to_server) = (client.try_clone()?, server.try_clone()?);
    thread::spawn(move || {
        let _ = std::io::copy(&mut from_client, &mut to_server);
        let _ = to_server.shutdown(Shutdown::Both);
    });
    loop {
        let mut header = [0u8; 5];
        server.read_exact(&mut header)?;
        let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
        let mut body = vec![0u8; len.saturating_sub(4)];
        server.read_exact(&mut body)?;
        if header[0] == b'C' && body.starts_with(b"COMMIT\0") && armed.swap(false, Ordering::SeqCst)
        {
            lost.fetch_add(1, Ordering::SeqCst);
            let _ = server.shutdown(Shutdown::Both);
            let _ = client.shutdown(Shutdown::Both);
            return Ok(());
        }
        client.write_all(&header)?;
        client.write_all(&body)?;
    }
}
