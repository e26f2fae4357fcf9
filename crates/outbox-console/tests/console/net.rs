//! Real sockets for the hardening tests: a console served on a loopback port ([`Served`]), raw
//! HTTP/1.1 requests (a partial one, a flood of them), and a reverse proxy that authenticates
//! its users and forwards to the console the way the docs' recipe configures nginx.

use std::net::SocketAddr;
use std::time::Duration;

use outbox_console::Console;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// A console served by `outbox_console::serve` on a loopback port until dropped.
pub struct Served {
    pub addr: SocketAddr,
    stop: CancellationToken,
}

impl Served {
    pub async fn start(console: Console) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("a port");
        let addr = listener.local_addr().expect("its address");
        let stop = CancellationToken::new();
        tokio::spawn(outbox_console::serve(listener, console, stop.clone()));
        Self { addr, stop }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// A response read off a socket: its status, its head, its body.
#[derive(Debug)]
pub struct Raw {
    pub status: u16,
    pub head: String,
    pub body: Vec<u8>,
}

impl Raw {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Sends `request` (a whole HTTP/1.1 request, `Connection: close`) to `addr` and reads the
/// answer to its end, within 10 s.
pub async fn exchange(addr: SocketAddr, request: &str) -> Raw {
    let work = async {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        stream.write_all(request.as_bytes()).await.expect("write");
        let mut bytes = Vec::new();
        stream.read_to_end(&mut bytes).await.expect("read");
        parse(&bytes)
    };
    tokio::time::timeout(Duration::from_secs(10), work)
        .await
        .expect("an answer within 10 s")
}

/// `GET path` with `headers` (each `Name: value`), `Host: 127.0.0.1`.
pub async fn raw_get(addr: SocketAddr, path: &str, headers: &[String]) -> Raw {
    let extra: String = headers.iter().map(|h| format!("{h}\r\n")).collect();
    let request =
        format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra}Connection: close\r\n\r\n");
    exchange(addr, &request).await
}

/// `POST path` with a form `body` and `headers`.
pub async fn raw_post(addr: SocketAddr, path: &str, headers: &[String], body: &str) -> Raw {
    let extra: String = headers.iter().map(|h| format!("{h}\r\n")).collect();
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra}Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    exchange(addr, &request).await
}

fn parse(bytes: &[u8]) -> Raw {
    let split = bytes
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or(bytes.len());
    let head = String::from_utf8_lossy(&bytes[..split]).into_owned();
    let body = bytes.get(split + 4..).unwrap_or_default().to_vec();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    Raw {
        status,
        head,
        body: if chunked { dechunk(&body) } else { body },
    }
}

fn dechunk(mut bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(line_end) = bytes.windows(2).position(|w| w == b"\r\n") {
        let size = usize::from_str_radix(
            String::from_utf8_lossy(&bytes[..line_end])
                .split(';')
                .next()
                .unwrap_or("0")
                .trim(),
            16,
        )
        .unwrap_or(0);
        if size == 0 {
            break;
        }
        let start = line_end + 2;
        out.extend_from_slice(&bytes[start..(start + size).min(bytes.len())]);
        bytes = bytes.get(start + size + 2..).unwrap_or_default();
    }
    out
}

/// A connection to `addr` from the loopback address `ip` (Linux answers on all of 127.0.0.0/8,
/// so a test can play several clients).
pub async fn connect_from(ip: &str, addr: SocketAddr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
    socket
        .bind(format!("{ip}:0").parse().expect("an address"))
        .expect("bind the client address");
    socket.connect(addr).await.expect("connect")
}

/// Whether the server closed `stream` within `within` (a read that returns 0 or fails).
pub async fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
    let mut byte = [0u8; 1024];
    let read = tokio::time::timeout(within, async {
        loop {
            match stream.read(&mut byte).await {
                Ok(0) | Err(_) => return true,
                Ok(_) => continue,
            }
        }
    });
    read.await.unwrap_or(false)
}

/// A reverse proxy on a loopback port in front of `upstream`, as the docs' recipe configures
/// nginx: it authenticates a user (here the test's stand-in for single sign-on: a header
/// `X-Test-Login: NAME`; without it 401), removes any user header the client sent, names the
/// user in `X-Forwarded-User`, and forwards with `Host` set to the upstream's loopback address
/// (nginx's default for `proxy_pass http://127.0.0.1:PORT`), keeping the browser's `Origin`.
pub async fn proxy(upstream: SocketAddr) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("a port");
    let addr = listener.local_addr().expect("its address");
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            tokio::spawn(forward(client, upstream));
        }
    });
    addr
}

async fn forward(mut client: TcpStream, upstream: SocketAddr) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let end = loop {
        let Ok(n) = client.read(&mut chunk).await else {
            return;
        };
        if n == 0 {
            return;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break end;
        }
    };
    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
    let rest = buf[end + 4..].to_vec();
    let mut lines = head.split("\r\n");
    let request_line = lines.next().unwrap_or_default().to_string();
    let mut user = None;
    let mut kept = Vec::new();
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        match name.trim().to_ascii_lowercase().as_str() {
            "x-test-login" => user = Some(value.trim().to_string()),
            "x-forwarded-user" | "host" => {}
            _ => kept.push(line.to_string()),
        }
    }
    let Some(user) = user else {
        let _ = client
            .write_all(
                b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            )
            .await;
        return;
    };
    let Ok(mut server) = TcpStream::connect(upstream).await else {
        return;
    };
    let mut out = format!("{request_line}\r\nHost: {upstream}\r\nX-Forwarded-User: {user}\r\n");
    for line in kept {
        out.push_str(&line);
        out.push_str("\r\n");
    }
    out.push_str("\r\n");
    if server.write_all(out.as_bytes()).await.is_err() || server.write_all(&rest).await.is_err() {
        return;
    }
    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
}
