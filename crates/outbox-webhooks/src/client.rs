//! The sender's HTTP/1 client: it resolves the endpoint's host itself, refuses addresses that
//! are not public (checked on the address it connects to, so a name that resolves elsewhere
//! later changes nothing), speaks TLS through rustls with the platform's roots, keeps idle
//! keep-alive connections per host and port, follows no redirect, and bounds every step.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::{self, pki_types::ServerName};

use crate::WebhookConfig;

/// An address range an operator allows sends to, such as `10.1.0.0/16` or `127.0.0.1/32`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Subnet {
    network: IpAddr,
    prefix: u8,
}

impl Subnet {
    /// Whether `ip` is in the range.
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.network, canonical(ip)) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

impl FromStr for Subnet {
    type Err = crate::Error;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let invalid = || crate::Error::Invalid(format!("{s:?} is not a subnet such as 10.0.0.0/8"));
        let (addr, prefix) = s.split_once('/').ok_or_else(invalid)?;
        let network = canonical(addr.parse::<IpAddr>().map_err(|_| invalid())?);
        let prefix: u8 = prefix.parse().map_err(|_| invalid())?;
        let most = if network.is_ipv4() { 32 } else { 128 };
        if prefix > most {
            return Err(invalid());
        }
        Ok(Self { network, prefix })
    }
}

/// Which addresses sends may reach: public ones, and the subnets an operator allows.
#[derive(Debug, Clone, Default)]
pub struct AddressPolicy {
    allowed: Vec<Subnet>,
}

impl AddressPolicy {
    /// Public addresses and `subnet` (and any allowed before).
    pub fn allow(mut self, subnet: Subnet) -> Self {
        self.allowed.push(subnet);
        self
    }

    /// Whether a send may connect to `ip`.
    pub fn permits(&self, ip: IpAddr) -> bool {
        is_public(canonical(ip)) || self.allowed.iter().any(|s| s.contains(ip))
    }
}

/// An IPv4 address written as IPv6 (`::ffff:a.b.c.d`) as the IPv4 address it is.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// Not loopback, private, link-local (which holds the clouds' metadata address
/// 169.254.169.254), shared (100.64.0.0/10), unspecified, broadcast, multicast, documentation,
/// benchmarking or reserved; for IPv6 not unique-local (fc00::/7, where clouds put their
/// metadata service too), link-local, site-local, IPv4-compatible (::/96), NAT64 or
/// documentation; a 6to4 address (2002::/16) is judged by the IPv4 address it carries.
fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            !(v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || v4.is_multicast()
                || v4.is_documentation()
                || a == 0
                || (a == 100 && (64..128).contains(&b))
                || (a == 192 && b == 0 && v4.octets()[2] == 0)
                || (a == 198 && (18..20).contains(&b))
                || a >= 240)
        }
        IpAddr::V6(v6) => {
            let s = v6.segments();
            // 6to4 (2002::/16) carries an IPv4 address: judged as that address.
            if s[0] == 0x2002 {
                let [a, b] = s[1].to_be_bytes();
                let [c, d] = s[2].to_be_bytes();
                return is_public(IpAddr::V4(std::net::Ipv4Addr::new(a, b, c, d)));
            }
            !(v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || s[..6] == [0; 6]
                || (s[0] & 0xfe00) == 0xfc00
                || (s[0] & 0xffc0) == 0xfe80
                || (s[0] & 0xffc0) == 0xfec0
                || (s[0] == 0x64 && s[1] == 0xff9b)
                || (s[0] == 0x2001 && s[1] == 0x0db8))
        }
    }
}

/// Why a send got no answer.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SendError {
    /// The host resolves only to addresses the policy refuses.
    #[error("refused: {0}")]
    Refused(String),
    /// Resolving, connecting or the TLS handshake did not end in time, or failed.
    #[error("connect: {0}")]
    Connect(String),
    /// The request did not end within the total timeout.
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    /// The connection failed during the request.
    #[error("request: {0}")]
    Request(String),
    /// Not sent: the endpoint gave no answer to this process's last send, and another
    /// delivery is probing it (see `probe.rs`).
    #[error("not sent: {0}")]
    Held(String),
}

impl SendError {
    /// Whether the endpoint gave no answer (as opposed to a send refused before it began).
    pub(crate) fn silent(&self) -> bool {
        matches!(
            self,
            SendError::Connect(_) | SendError::Timeout(_) | SendError::Request(_)
        )
    }
}

/// A receiver's answer.
#[derive(Debug, Clone)]
pub(crate) struct Answer {
    pub(crate) status: u16,
    pub(crate) retry_after: Option<Duration>,
    /// The first 4 KiB of the body (lossy UTF-8).
    pub(crate) body: String,
}

/// The most body bytes read from an answer: past it the connection is dropped, not reused.
const BODY_READ: usize = 64 * 1024;

type Key = (bool, String, u16);

/// The client: idle connections per (TLS, host, port).
pub(crate) struct Client {
    config: WebhookConfig,
    tls: TlsConnector,
    idle: Mutex<HashMap<Key, Vec<SendRequest<Full<Bytes>>>>>,
}

impl Client {
    pub(crate) fn new(config: WebhookConfig) -> Self {
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls_native_certs::load_native_certs().certs {
            let _ = roots.add(cert);
        }
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("rustls' default protocol versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
        Self {
            config,
            tls: TlsConnector::from(Arc::new(tls)),
            idle: Mutex::new(HashMap::new()),
        }
    }

    /// POSTs `body` with `headers` to `url`, within the total timeout.
    pub(crate) async fn post(
        &self,
        url: &hyper::Uri,
        headers: &[(&str, String)],
        body: Bytes,
    ) -> Result<Answer, SendError> {
        let total = self.config.total_timeout;
        tokio::time::timeout(total, self.post_unbounded(url, headers, body))
            .await
            .unwrap_or(Err(SendError::Timeout(total)))
    }

    async fn post_unbounded(
        &self,
        url: &hyper::Uri,
        headers: &[(&str, String)],
        body: Bytes,
    ) -> Result<Answer, SendError> {
        let tls = url.scheme_str() == Some("https");
        // An IPv6 literal's brackets are the URL's, not the address's.
        let host = url
            .host()
            .unwrap_or_default()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string();
        let port = url.port_u16().unwrap_or(if tls { 443 } else { 80 });
        let key = (tls, host.clone(), port);
        let idle = self.idle_connection(&key);
        let reused = idle.is_some();
        let mut sender = match idle {
            Some(sender) => sender,
            None => self.connect(tls, &host, port).await?,
        };
        let path = url.path_and_query().map_or("/", |p| p.as_str());
        let request = |headers: &[(&str, String)], body: Bytes| {
            let mut request = hyper::Request::post(path)
                .header(hyper::header::HOST, host_header(&host, port, tls))
                .header(hyper::header::CONTENT_TYPE, "application/json")
                .header(hyper::header::USER_AGENT, "outbox-webhooks/1");
            for (name, value) in headers {
                request = request.header(*name, value);
            }
            request
                .body(Full::new(body))
                .map_err(|e| SendError::Request(e.to_string()))
        };
        let response = match sender.send_request(request(headers, body.clone())?).await {
            Ok(response) => response,
            // A kept connection the receiver closed meanwhile, before the request went out:
            // once more on a new one.
            Err(e) if reused && (e.is_canceled() || e.is_closed()) => {
                sender = self.connect(tls, &host, port).await?;
                sender
                    .send_request(request(headers, body)?)
                    .await
                    .map_err(|e| SendError::Request(e.to_string()))?
            }
            Err(e) => return Err(SendError::Request(e.to_string())),
        };
        let status = response.status().as_u16();
        let retry_after = response
            .headers()
            .get(hyper::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(parse_retry_after);
        let (body, complete) = read_prefix(response.into_body()).await;
        if complete {
            self.keep(key, sender);
        }
        Ok(Answer {
            status,
            retry_after,
            body: String::from_utf8_lossy(
                &body[..body
                    .len()
                    .min(outbox_events::persistence::webhooks::RESPONSE_BODY_KEPT)],
            )
            .into_owned(),
        })
    }

    fn idle_connection(&self, key: &Key) -> Option<SendRequest<Full<Bytes>>> {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let list = idle.get_mut(key)?;
        while let Some(sender) = list.pop() {
            if !sender.is_closed() && sender.is_ready() {
                return Some(sender);
            }
        }
        None
    }

    fn keep(&self, key: Key, sender: SendRequest<Full<Bytes>>) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let list = idle.entry(key).or_default();
        if list.len() < self.config.idle_per_host {
            list.push(sender);
        }
    }

    /// Resolves `host`, keeps the addresses the policy permits, connects to the first that
    /// answers (TLS for `https`), within the connect timeout.
    async fn connect(
        &self,
        tls: bool,
        host: &str,
        port: u16,
    ) -> Result<SendRequest<Full<Bytes>>, SendError> {
        let timeout = self.config.connect_timeout;
        let started = Instant::now();
        let connect = async {
            let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host, port))
                .await
                .map_err(|e| SendError::Connect(format!("resolving {host}: {e}")))?
                .collect();
            let permitted: Vec<SocketAddr> = addrs
                .iter()
                .copied()
                .filter(|a| self.config.addresses.permits(a.ip()))
                .collect();
            if permitted.is_empty() {
                let shown: Vec<String> = addrs.iter().map(|a| a.ip().to_string()).collect();
                return Err(SendError::Refused(format!(
                    "{host} resolves to {} only, which sends may not reach (allow a subnet to permit it)",
                    shown.join(", ")
                )));
            }
            let mut last = String::new();
            for addr in permitted {
                match TcpStream::connect(addr).await {
                    Ok(stream) => {
                        let _ = stream.set_nodelay(true);
                        return self.handshake(tls, host, stream).await;
                    }
                    Err(e) => last = format!("{addr}: {e}"),
                }
            }
            Err(SendError::Connect(last))
        };
        tokio::time::timeout(timeout, connect)
            .await
            .unwrap_or_else(|_| {
                Err(SendError::Connect(format!(
                    "no connection to {host}:{port} within {:?}",
                    started.elapsed()
                )))
            })
    }

    async fn handshake(
        &self,
        tls: bool,
        host: &str,
        stream: TcpStream,
    ) -> Result<SendRequest<Full<Bytes>>, SendError> {
        if tls {
            let name = ServerName::try_from(host.to_string())
                .map_err(|e| SendError::Connect(format!("{host}: {e}")))?;
            let stream = self
                .tls
                .connect(name, stream)
                .await
                .map_err(|e| SendError::Connect(format!("TLS with {host}: {e}")))?;
            http1(TokioIo::new(stream)).await
        } else {
            http1(TokioIo::new(stream)).await
        }
    }
}

async fn http1<S>(io: TokioIo<S>) -> Result<SendRequest<Full<Bytes>>, SendError>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (sender, connection) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(|e| SendError::Connect(e.to_string()))?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(sender)
}

fn host_header(host: &str, port: u16, tls: bool) -> String {
    let default = if tls { 443 } else { 80 };
    let host = if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_string()
    };
    if port == default {
        host
    } else {
        format!("{host}:{port}")
    }
}

/// Reads up to [`BODY_READ`] bytes of the body: `(bytes, whether the body ended)`.
async fn read_prefix(mut body: hyper::body::Incoming) -> (Vec<u8>, bool) {
    let mut out = Vec::new();
    loop {
        match body.frame().await {
            None => return (out, true),
            Some(Err(_)) => return (out, false),
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    out.extend_from_slice(&data);
                    if out.len() > BODY_READ {
                        return (out, false);
                    }
                }
            }
        }
    }
}

/// `Retry-After` in seconds (an HTTP date is read as the wait until it).
fn parse_retry_after(value: &str) -> Option<Duration> {
    if let Ok(seconds) = value.trim().parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = chrono::DateTime::parse_from_rfc2822(value.trim()).ok()?;
    let wait = at.with_timezone(&chrono::Utc) - chrono::Utc::now();
    Some(wait.to_std().unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn private_loopback_link_local_and_metadata_addresses_are_refused() {
        let policy = AddressPolicy::default();
        for refused in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "::1",
            "fd00:ec2::254",
            "fe80::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "192.0.0.8",
            "fec0::1",
            "::127.0.0.1",
            "2002:7f00:1::",
            "2002:a9fe:a9fe::",
        ] {
            assert!(!policy.permits(ip(refused)), "{refused}");
        }
        for public in [
            "93.184.216.34",
            "1.1.1.1",
            "192.0.1.1",
            "2606:4700:4700::1111",
            "2002:5db8:d822::",
        ] {
            assert!(policy.permits(ip(public)), "{public}");
        }
    }

    #[test]
    fn an_allowed_subnet_is_reachable_and_nothing_beside_it() {
        let policy = AddressPolicy::default().allow("127.0.0.0/8".parse().unwrap());
        assert!(policy.permits(ip("127.0.0.1")));
        assert!(policy.permits(ip("::ffff:127.0.0.1")));
        assert!(!policy.permits(ip("10.0.0.1")));
        assert!("10.0.0.0/33".parse::<Subnet>().is_err());
        assert!("10.0.0.0".parse::<Subnet>().is_err());
        let one: Subnet = "192.168.1.7/32".parse().unwrap();
        assert!(one.contains(ip("192.168.1.7")) && !one.contains(ip("192.168.1.8")));
        let all: Subnet = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains(ip("10.0.0.1")));
    }

    #[test]
    fn retry_after_reads_seconds_and_dates() {
        assert_eq!(parse_retry_after("7"), Some(Duration::from_secs(7)));
        assert_eq!(
            parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT"),
            Some(Duration::ZERO)
        );
        assert_eq!(parse_retry_after("soon"), None);
    }
}
