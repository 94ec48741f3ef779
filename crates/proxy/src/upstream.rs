//! Upstream proxies: a run's egress leaving through another proxy.
//!
//! A run (or the node, by default) may name an `http://` or `socks5://`
//! proxy, with credentials, that the operator's `upstream.allow` admits.
//! The run's own policy still decides first: only a destination the
//! allowlist admits is asked of the upstream. The upstream is then asked
//! for it by name (a CONNECT, or a SOCKS5 request with a domain), so the
//! upstream resolves it: names that only resolve behind it work, and
//! runbox's own lookup and guard are not consulted for names. Addresses
//! given as literals still meet the guard, so an upstream is not a way to
//! the node's internal networks the operator did not admit.
//!
//! Credentials never appear in errors, logs or the audit log
//! ([`Upstream::display`] leaves the password out, `Debug` too).

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;

use base64::Engine as _;
use fast_socks5::client::{Config as SocksConfig, Socks5Stream};
use fast_socks5::util::target_addr::TargetAddr;
use fast_socks5::{AuthenticationMethod, Socks5Command};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::guard::AddressGuard;
use crate::policy::Entry;
use crate::resolve::Resolver;

/// The longest user name or password SOCKS5 can carry (RFC 1929), and the
/// bound kept for HTTP ones too.
const MAX_CREDENTIAL: usize = 255;

/// The longest response head an HTTP upstream may send to a CONNECT.
const MAX_CONNECT_HEAD: usize = 16 * 1024;

/// How an upstream is spoken to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// HTTP CONNECT (`http://`).
    Http,
    /// SOCKS5 CONNECT with the destination's name (`socks5://`, `socks5h://`).
    Socks5,
}

/// One upstream proxy, checked.
#[derive(Clone, PartialEq, Eq)]
pub struct Upstream {
    kind: Kind,
    /// Lowercase name or IP literal (IPv6 without brackets).
    host: String,
    port: u16,
    user: Option<String>,
    password: Option<String>,
}

impl fmt::Debug for Upstream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.display())
    }
}

/// The host of an upstream proxy URL as it is written, once the URL is
/// known to be written whole: `scheme://`, with no whitespace or control
/// character anywhere (`url`, reading as a browser does, drops tabs and
/// line breaks, and takes `http:host` for `http://host`).
fn written_host(raw: &str) -> Result<&str, String> {
    if let Some(c) = raw.chars().find(|c| c.is_control() || c.is_whitespace()) {
        return Err(format!(
            "the upstream proxy URL holds {c:?}; write it without spaces or control characters"
        ));
    }
    let Some((_, rest)) = raw.split_once("://") else {
        return Err(
            "the upstream proxy is not a URL; write scheme://[user:password@]host:port".to_owned(),
        );
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    Ok(match host_port.strip_prefix('[') {
        Some(v6) => v6
            .split_once(']')
            .map_or(host_port, |(h, _)| &host_port[..h.len() + 2]),
        None => host_port.rsplit_once(':').map_or(host_port, |(h, _)| h),
    })
}

impl Upstream {
    /// Parses `http://[user[:password]@]host:port` or
    /// `socks5://[user[:password]@]host:port` (`socks5h://` is the same:
    /// names always go to the upstream). The error never quotes the
    /// password.
    pub fn parse(raw: &str) -> Result<Upstream, String> {
        let written = written_host(raw)?;
        let url = url::Url::parse(raw).map_err(|e| {
            format!(
                "the upstream proxy is not a URL ({e}); write scheme://[user:password@]host:port"
            )
        })?;
        let kind = match url.scheme() {
            "http" => Kind::Http,
            "socks5" | "socks5h" => Kind::Socks5,
            other => {
                return Err(format!(
                    "the upstream proxy's scheme {other:?} is not served; use http:// or socks5://"
                ))
            }
        };
        let host = match url.host() {
            Some(url::Host::Domain(name)) => name.trim_end_matches('.').to_ascii_lowercase(),
            Some(url::Host::Ipv4(ip)) => ip.to_string(),
            Some(url::Host::Ipv6(ip)) => ip.to_string(),
            None => return Err("the upstream proxy has no host".to_owned()),
        };
        // The host as read must be the host as written: `url` takes
        // `127.1` and `0x7f.1` for 127.0.0.1 on http://, and decodes
        // percent-escapes and IDNA in names; a proxy's address is not
        // guessed at.
        let as_written = written
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(written)
            .trim_end_matches('.')
            .to_ascii_lowercase();
        let numeric = host
            .rsplit('.')
            .next()
            .is_some_and(|label| !label.is_empty() && label.bytes().all(|b| b.is_ascii_digit()));
        // (socks5:// is not a scheme `url` knows, so its addresses come back
        // as names: one in Rust's strict dotted form is an address.)
        let dotted = host.parse::<std::net::Ipv4Addr>().is_ok();
        if matches!(url.host(), Some(url::Host::Domain(_))) && numeric && !dotted {
            return Err(format!(
                "the upstream proxy's host {as_written:?} is neither a name nor an IPv4 address \
                 in four dotted parts"
            ));
        }
        let same = match url.host() {
            Some(url::Host::Ipv6(ip)) => as_written.parse::<std::net::Ipv6Addr>() == Ok(ip),
            _ => as_written == host,
        };
        if !same {
            return Err(format!(
                "the upstream proxy's host {as_written:?} is not written as itself (it reads as \
                 {host}); write the name or the address as it is, e.g. 10.0.0.1 or proxy.corp"
            ));
        }
        // A proxy's port is never obvious, so it must be written; `url`
        // hides an explicit `:80` on http:// as the scheme's default.
        let port = match url.port() {
            Some(0) => return Err("the upstream proxy's port is 1-65535".to_owned()),
            Some(port) => port,
            None if kind == Kind::Http && writes_port_80(raw) => 80,
            None => return Err("the upstream proxy needs a port (host:port)".to_owned()),
        };
        let bare = matches!(url.path(), "" | "/");
        if !bare || url.query().is_some() || url.fragment().is_some() {
            return Err(
                "the upstream proxy is host:port only, without a path, query or fragment"
                    .to_owned(),
            );
        }
        let decode = |s: &str, what: &str| -> Result<Option<String>, String> {
            if s.is_empty() {
                return Ok(None);
            }
            let text = percent_encoding::percent_decode_str(s)
                .decode_utf8()
                .map_err(|_| format!("the upstream proxy's {what} is not UTF-8"))?
                .into_owned();
            if text.len() > MAX_CREDENTIAL {
                return Err(format!(
                    "the upstream proxy's {what} is longer than {MAX_CREDENTIAL} bytes"
                ));
            }
            if text.chars().any(char::is_control) {
                return Err(format!(
                    "the upstream proxy's {what} holds a control character"
                ));
            }
            Ok(Some(text))
        };
        let user = decode(url.username(), "user name")?;
        let password = decode(url.password().unwrap_or(""), "password")?;
        if password.is_some() && user.is_none() {
            return Err("the upstream proxy has a password without a user name".to_owned());
        }
        Ok(Upstream {
            kind,
            host,
            port,
            user,
            password,
        })
    }

    /// How it is spoken to.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// `scheme://[user@]host:port`: everything but the password, for the
    /// API, logs and the audit log.
    pub fn display(&self) -> String {
        let scheme = match self.kind {
            Kind::Http => "http",
            Kind::Socks5 => "socks5",
        };
        let user = self
            .user
            .as_deref()
            .map(|u| {
                let encoded: String = url::form_urlencoded::byte_serialize(u.as_bytes()).collect();
                format!("{encoded}@")
            })
            .unwrap_or_default();
        format!("{scheme}://{user}{}", self.address())
    }

    /// `host:port`, IPv6 in brackets.
    pub fn address(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// A TCP connection to the upstream, then its handshake asking for
    /// `host:port` (by name, or by address for a literal): the returned
    /// stream is the tunnel. The upstream's own address is looked up with
    /// the proxy's resolver and must not be one of runbox's endpoints; the
    /// operator's `upstream.allow` admitted it, so the internal-address
    /// guard does not apply to it.
    ///
    /// Cancellation: safe to drop; the connection closes.
    pub async fn open(
        &self,
        resolver: &Resolver,
        guard: &AddressGuard,
        host: &str,
        port: u16,
        connect_timeout: std::time::Duration,
        handshake_timeout: std::time::Duration,
    ) -> Result<TcpStream, String> {
        let addrs = match self.host.parse::<IpAddr>() {
            Ok(ip) => vec![ip],
            Err(_) => resolver
                .lookup(&self.host)
                .await
                .map_err(|e| format!("the upstream proxy {}: {e}", self.address()))?,
        };
        let mut last = format!("the upstream proxy {} has no addresses", self.address());
        let mut tcp = None;
        for ip in addrs {
            if guard.is_own(ip, self.port) {
                return Err(format!(
                    "the upstream proxy {} is an endpoint of runbox itself",
                    self.address()
                ));
            }
            let addr = SocketAddr::new(ip, self.port);
            match tokio::time::timeout(connect_timeout, TcpStream::connect(addr)).await {
                Ok(Ok(stream)) => {
                    tcp = Some(stream);
                    break;
                }
                Ok(Err(e)) => last = format!("cannot connect to the upstream proxy {addr}: {e}"),
                Err(_) => last = format!("timed out connecting to the upstream proxy {addr}"),
            }
        }
        let tcp = tcp.ok_or(last)?;
        let _ = tcp.set_nodelay(true);
        let handshake = async {
            match self.kind {
                Kind::Http => self.http_connect(tcp, host, port).await,
                Kind::Socks5 => self.socks5_connect(tcp, host, port).await,
            }
        };
        tokio::time::timeout(handshake_timeout, handshake)
            .await
            .map_err(|_| {
                format!(
                    "the upstream proxy {} did not answer in time",
                    self.address()
                )
            })?
    }

    /// `CONNECT host:port` to an HTTP upstream.
    ///
    /// Hand-written rather than hyper's client: hyper buffers reads, and
    /// bytes of the tunnel read past the response head (a server that
    /// speaks first) could not be handed back to the tunnel's plain socket.
    /// The head is read a byte at a time, once per connection.
    async fn http_connect(
        &self,
        mut tcp: TcpStream,
        host: &str,
        port: u16,
    ) -> Result<TcpStream, String> {
        let authority = if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        let mut request = format!("CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n");
        if let Some(user) = &self.user {
            let pair = format!("{user}:{}", self.password.as_deref().unwrap_or(""));
            let token = base64::engine::general_purpose::STANDARD.encode(pair);
            request.push_str(&format!("Proxy-Authorization: Basic {token}\r\n"));
        }
        request.push_str("\r\n");
        let failed = |e: std::io::Error| format!("the upstream proxy {}: {e}", self.address());
        tcp.write_all(request.as_bytes()).await.map_err(failed)?;
        let mut head = Vec::with_capacity(128);
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            if head.len() >= MAX_CONNECT_HEAD {
                return Err(format!(
                    "the upstream proxy {} sent a response head over {MAX_CONNECT_HEAD} bytes",
                    self.address()
                ));
            }
            if tcp.read(&mut byte).await.map_err(failed)? == 0 {
                return Err(format!(
                    "the upstream proxy {} closed the connection before answering CONNECT",
                    self.address()
                ));
            }
            head.push(byte[0]);
        }
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut response = httparse::Response::new(&mut headers);
        let code = match response.parse(&head) {
            Ok(httparse::Status::Complete(_)) => response.code.unwrap_or(0),
            _ => {
                return Err(format!(
                    "the upstream proxy {} answered CONNECT with something other than HTTP",
                    self.address()
                ))
            }
        };
        match code {
            200..=299 => Ok(tcp),
            // tinyproxy answers a bad Proxy-Authorization with 401.
            401 | 407 => Err(format!(
                "the upstream proxy {} wants credentials it was not given or refused them (407)",
                self.address()
            )),
            code => Err(format!(
                "the upstream proxy {} refused CONNECT {authority} ({code})",
                self.address()
            )),
        }
    }

    /// A SOCKS5 CONNECT, by name for names, to a SOCKS5 upstream.
    async fn socks5_connect(
        &self,
        tcp: TcpStream,
        host: &str,
        port: u16,
    ) -> Result<TcpStream, String> {
        let auth = self
            .user
            .as_ref()
            .map(|user| AuthenticationMethod::Password {
                username: user.clone(),
                password: self.password.clone().unwrap_or_default(),
            });
        let failed =
            |e: fast_socks5::SocksError| format!("the upstream proxy {}: {e}", self.address());
        let mut stream = Socks5Stream::use_stream(tcp, auth, SocksConfig::default())
            .await
            .map_err(failed)?;
        let target = match host.parse::<IpAddr>() {
            Ok(ip) => TargetAddr::Ip(SocketAddr::new(ip, port)),
            Err(_) => TargetAddr::Domain(host.to_owned(), port),
        };
        stream
            .request(Socks5Command::TCPConnect, target)
            .await
            .map_err(failed)?;
        Ok(stream.get_socket())
    }
}

/// The upstreams the operator admits (`upstream.allow`,
/// `--egress-upstream-allow`), in the allowlist's grammar (`policy::Entry`)
/// with one difference: an entry without a port admits any port (a
/// proxy's port is never 80 or 443 by custom). `host`, `host:port`,
/// `.suffix` and `*.suffix` match the upstream's host as written; a network
/// `prefix/len` matches an upstream given as an address in it.
#[derive(Clone, Debug, Default)]
pub struct UpstreamAllow(Vec<Entry>);

/// Whether the URL's authority ends in an explicit `:80`.
fn writes_port_80(raw: &str) -> bool {
    let rest = raw.split_once("://").map_or(raw, |(_, rest)| rest);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, hp)| hp);
    host_port.ends_with(":80")
}

impl UpstreamAllow {
    /// Parses the entries; the error names the malformed one.
    pub fn parse<S: AsRef<str>>(entries: &[S]) -> Result<UpstreamAllow, String> {
        entries
            .iter()
            .map(|e| Entry::from_str(e.as_ref().trim()).map_err(|e| e.to_string()))
            .collect::<Result<Vec<_>, _>>()
            .map(UpstreamAllow)
    }

    /// Whether no upstream is admitted.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `upstream` (its host as written, and its port) is admitted.
    pub fn admits(&self, upstream: &Upstream) -> bool {
        self.0.iter().any(|entry| {
            entry.matches_name(&upstream.host)
                && match entry {
                    Entry::HostPort(_, port) => *port == upstream.port,
                    _ => true,
                }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_urls_are_checked_and_never_echo_the_password() {
        let u = Upstream::parse("socks5://alice:s%40cret@Proxy.Example.com:1080").unwrap();
        assert_eq!(u.kind(), Kind::Socks5);
        assert_eq!(u.display(), "socks5://alice@proxy.example.com:1080");
        assert_eq!(format!("{u:?}"), "socks5://alice@proxy.example.com:1080");
        assert_eq!(u.password.as_deref(), Some("s@cret"));
        let u = Upstream::parse("socks5h://[2001:db8::1]:1080").unwrap();
        assert_eq!(u.address(), "[2001:db8::1]:1080");
        let u = Upstream::parse("http://10.0.0.1:3128").unwrap();
        assert_eq!(
            (u.kind(), u.display().as_str()),
            (Kind::Http, "http://10.0.0.1:3128")
        );
        for bad in [
            "proxy:1080",
            "ftp://proxy:21",
            "https://proxy:443",
            "socks5://proxy",
            "http://proxy",
            "socks5://proxy:0",
            "socks5://proxy:1080/path",
            "socks5://proxy:1080?q",
            "socks5://:hunter2@proxy:1080",
            "socks5://u:hunter2%0a@proxy:1080",
            "not a url",
            // Not written whole: `url` would guess.
            "http:proxy:3128",
            "http:/proxy:3128",
            "http://pro\txy:3128",
            "http://proxy\r\n:3128",
            " http://proxy:3128",
            "http://proxy:3128 ",
            "http://127.1:3128",
            "http://0x7f.0.0.1:3128",
            "http://0177.0.0.1:3128",
            "socks5://127.1:1080",
            "socks5://10.0.0.010:1080",
            "http://pro%78y:3128",
            "http://b\u{fc}cher.example:3128",
        ] {
            let err = Upstream::parse(bad).unwrap_err();
            assert!(!err.contains("hunter2"), "{bad}: {err}");
        }
        let long = format!("socks5://u:{}@proxy:1080", "p".repeat(256));
        assert!(Upstream::parse(&long).unwrap_err().contains("255"));
    }

    #[test]
    fn the_allow_list_admits_by_name_port_suffix_and_network() {
        let allow = UpstreamAllow::parse(&[
            "proxy.corp:3128",
            "socks.corp",
            ".vpn.example",
            "10.1.0.0/16",
        ])
        .unwrap();
        let admits = |url: &str| allow.admits(&Upstream::parse(url).unwrap());
        assert!(admits("http://proxy.corp:3128"));
        assert!(!admits("http://proxy.corp:8080"));
        assert!(admits("socks5://socks.corp:1080"));
        assert!(admits("socks5://a.vpn.example:1"));
        assert!(admits("socks5://vpn.example:1"));
        assert!(!admits("socks5://evilvpn.example:1"));
        assert!(admits("http://10.1.2.3:3128"));
        assert!(!admits("http://10.2.0.1:3128"));
        // A name is matched as a name, never by what it resolves to.
        assert!(!admits("http://internal.corp:3128"));
        assert!(UpstreamAllow::default().is_empty());
        for bad in [".com", "a b", "host:0", "host:x", "10.0.0.0/33", "[::1"] {
            assert!(UpstreamAllow::parse(&[bad]).is_err(), "{bad}");
        }
    }
}
