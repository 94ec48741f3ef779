//! Name resolution for the proxy: one lookup per request, cached by the
//! records' TTLs (hickory-resolver). IP literals never reach DNS.
//!
//! The proxy connects to an address this module returned and the guard
//! checked, never re-resolving, so what is resolved here is what is dialled.
//! This module does not judge addresses (`guard` does) nor names (`policy`
//! does); it only refuses strings that are not host names at all.
//!
//! 1. An IP literal (`1.2.3.4`, `::1`, `[::1]`) is returned as is.
//! 2. Anything else must be a syntactically valid DNS name. Shorthand such as
//!    `127.1` or `0x7f000001`, which some resolvers turn into addresses, is
//!    not one and is refused.
//! 3. The name is looked up fully qualified (a `.` appended), so search
//!    domains never apply, for A and AAAA at once, with TTL-bounded caching.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use hickory_resolver::config::{
    LookupIpStrategy, NameServerConfig, ResolveHosts, ResolverConfig, ResolverOpts,
};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::proto::rr::Name;
use hickory_resolver::TokioResolver;
use rustls::pki_types::DnsName;

/// Why a name did not resolve.
#[derive(Debug, thiserror::Error)]
#[error("cannot resolve {host:?}: {reason}")]
pub struct ResolveError {
    /// The name.
    pub host: String,
    /// Why.
    pub reason: String,
}

/// Time allowed for one query to one nameserver.
const QUERY_TIMEOUT: Duration = Duration::from_secs(2);
/// Tries per query before giving up.
const QUERY_ATTEMPTS: usize = 2;
/// Bound on a whole lookup (A and AAAA run in parallel, each with its
/// attempts), so a request never waits on DNS longer than this.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);
/// Cached responses; each lookup caches up to two (A and AAAA).
const CACHE_SIZE: u64 = 4096;
/// Longest time a positive answer is reused, whatever its TTL, so a changed
/// record is seen within minutes.
const POSITIVE_MAX_TTL: Duration = Duration::from_secs(300);
/// Longest time a negative answer is reused, so a name that starts to exist
/// works soon after.
const NEGATIVE_MAX_TTL: Duration = Duration::from_secs(30);

/// The proxy's resolver. Cheap to clone.
#[derive(Clone)]
pub struct Resolver {
    /// Shares its cache and connections between clones.
    inner: TokioResolver,
}

impl std::fmt::Debug for Resolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Resolver").finish_non_exhaustive()
    }
}

impl Resolver {
    /// Uses the host's resolver configuration (`/etc/resolv.conf`), or only
    /// `nameserver` when given (tests and operators with their own DNS).
    pub fn new(nameserver: Option<SocketAddr>) -> Result<Resolver, ResolveError> {
        let mut builder = match nameserver {
            None => TokioResolver::builder_tokio().map_err(|e| ResolveError {
                host: String::new(),
                reason: format!("the system resolver configuration is unusable: {e}"),
            })?,
            Some(addr) => {
                let mut server = NameServerConfig::udp_and_tcp(addr.ip());
                for connection in &mut server.connections {
                    connection.port = addr.port();
                }
                // No search domains and no default domain: only the names asked for.
                let config = ResolverConfig::from_name_servers(vec![server]);
                TokioResolver::builder_with_config(config, TokioRuntimeProvider::default())
            }
        };
        configure(builder.options_mut(), nameserver.is_some());
        let inner = builder.build().map_err(|e| ResolveError {
            host: String::new(),
            reason: format!("cannot start the resolver: {e}"),
        })?;
        Ok(Resolver { inner })
    }

    /// Every address of `host` (an IP literal resolves to itself).
    pub async fn lookup(&self, host: &str) -> Result<Vec<IpAddr>, ResolveError> {
        let fail = |reason: String| ResolveError {
            host: host.to_owned(),
            reason,
        };

        if let Some(inner) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
            return inner
                .parse::<Ipv6Addr>()
                .map(|ip| vec![IpAddr::V6(ip)])
                .map_err(|_| fail("not a valid bracketed IPv6 address".to_owned()));
        }
        if let Ok(ip) = host.parse::<IpAddr>() {
            return Ok(vec![ip]);
        }
        if DnsName::try_from(host).is_err() {
            return Err(fail("not a valid DNS name".to_owned()));
        }

        let fqdn = if host.ends_with('.') {
            host.to_owned()
        } else {
            format!("{host}.")
        };
        let name =
            Name::from_ascii(&fqdn).map_err(|e| fail(format!("not a valid DNS name: {e}")))?;

        let answer = tokio::time::timeout(LOOKUP_TIMEOUT, self.inner.lookup_ip(name))
            .await
            .map_err(|_| fail(format!("no answer within {}s", LOOKUP_TIMEOUT.as_secs())))?
            .map_err(|e| {
                if e.is_nx_domain() {
                    fail("no such domain".to_owned())
                } else if e.is_no_records_found() {
                    fail("the name has no addresses".to_owned())
                } else {
                    fail(e.to_string())
                }
            })?;

        let mut addrs: Vec<IpAddr> = Vec::new();
        for addr in answer.iter() {
            if !addrs.contains(&addr) {
                addrs.push(addr);
            }
        }
        if addrs.is_empty() {
            return Err(fail("the name has no addresses".to_owned()));
        }
        Ok(addrs)
    }
}

/// The options shared by both configurations.
fn configure(options: &mut ResolverOpts, own_nameserver: bool) {
    options.timeout = QUERY_TIMEOUT;
    options.attempts = QUERY_ATTEMPTS;
    options.cache_size = CACHE_SIZE;
    options.positive_max_ttl = Some(POSITIVE_MAX_TTL);
    options.negative_max_ttl = Some(NEGATIVE_MAX_TTL);
    options.ip_strategy = LookupIpStrategy::Ipv4AndIpv6;
    // Truncated UDP answers are retried over TCP regardless; this also
    // retries over TCP when UDP fails outright.
    options.try_tcp_on_error = true;
    if own_nameserver {
        // The given nameserver is the whole truth: /etc/hosts would let the
        // host's own entries (localhost, the node's name) answer instead.
        options.use_hosts_file = ResolveHosts::Never;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::TestDns;
    use std::net::{Ipv4Addr, SocketAddr};

    async fn setup() -> (TestDns, Resolver) {
        let dns = TestDns::start().await.expect("start test DNS");
        let resolver = Resolver::new(Some(dns.addr())).expect("resolver");
        (dns, resolver)
    }

    #[tokio::test]
    async fn name_resolves_to_the_served_addresses() {
        let (dns, resolver) = setup().await;
        let v4: IpAddr = Ipv4Addr::new(127, 0, 0, 1).into();
        let v6: IpAddr = Ipv6Addr::LOCALHOST.into();
        dns.set("allowed.test", &[v4, v6], 60);

        let mut addrs = resolver.lookup("allowed.test").await.expect("lookup");
        addrs.sort();
        assert_eq!(addrs, vec![v4, v6]);
        // A trailing dot is the same name.
        assert_eq!(
            resolver
                .lookup("allowed.test.")
                .await
                .expect("lookup")
                .len(),
            2
        );
    }

    #[tokio::test]
    async fn lookup_within_the_ttl_is_served_from_cache() {
        let (dns, resolver) = setup().await;
        let addr: IpAddr = Ipv4Addr::new(10, 1, 2, 3).into();
        dns.set("cached.test", &[addr], 300);

        assert_eq!(
            resolver.lookup("cached.test").await.expect("lookup"),
            vec![addr]
        );
        let after_first = dns.queries();
        assert!(after_first > 0);
        // A clone shares the cache.
        let clone = resolver.clone();
        assert_eq!(
            clone.lookup("cached.test").await.expect("lookup"),
            vec![addr]
        );
        assert_eq!(dns.queries(), after_first);
    }

    #[tokio::test]
    async fn ip_literals_never_query() {
        let (dns, resolver) = setup().await;
        let cases: [(&str, IpAddr); 4] = [
            ("127.0.0.1", Ipv4Addr::LOCALHOST.into()),
            ("10.0.0.7", Ipv4Addr::new(10, 0, 0, 7).into()),
            ("::1", Ipv6Addr::LOCALHOST.into()),
            (
                "[fd00::1]",
                "fd00::1".parse::<Ipv6Addr>().expect("v6").into(),
            ),
        ];
        for (host, want) in cases {
            assert_eq!(resolver.lookup(host).await.expect(host), vec![want]);
        }
        assert_eq!(dns.queries(), 0);
    }

    #[tokio::test]
    async fn nxdomain_is_an_error() {
        let (dns, resolver) = setup().await;
        let err = resolver.lookup("missing.test").await.expect_err("nxdomain");
        assert_eq!(err.host, "missing.test");
        assert_eq!(err.reason, "no such domain");
        assert!(dns.queries() > 0);
    }

    #[tokio::test]
    async fn name_without_addresses_is_an_error() {
        let (dns, resolver) = setup().await;
        dns.set("empty.test", &[], 60);
        let err = resolver
            .lookup("empty.test")
            .await
            .expect_err("no addresses");
        assert_eq!(err.reason, "the name has no addresses");
    }

    #[tokio::test]
    async fn invalid_names_are_errors_without_queries() {
        let (dns, resolver) = setup().await;
        for host in [
            "",
            ".",
            "a b.test",
            "foo..test",
            "127.1",
            "0x7f000001",
            "[127.0.0.1]",
            "[::1",
            "host:80",
            "ex\u{e4}mple.test",
        ] {
            let err = resolver.lookup(host).await.expect_err(host);
            assert!(err.reason.contains("not a valid"), "{host:?}: {err}");
        }
        assert_eq!(dns.queries(), 0);
    }

    #[tokio::test]
    async fn search_domains_never_apply() {
        let (dns, resolver) = setup().await;
        // Only the name asked for is queried, once per record type.
        dns.set("single", &[Ipv4Addr::new(10, 9, 8, 7).into()], 60);
        assert_eq!(
            resolver.lookup("single").await.expect("lookup"),
            vec![IpAddr::from(Ipv4Addr::new(10, 9, 8, 7))]
        );
        assert_eq!(dns.queries(), 2);
    }

    #[tokio::test]
    async fn unreachable_nameserver_fails_within_the_timeout() {
        // A bound but silent UDP socket: queries go nowhere.
        let silent = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        let addr: SocketAddr = silent.local_addr().expect("addr");
        let resolver = Resolver::new(Some(addr)).expect("resolver");
        let started = std::time::Instant::now();
        resolver.lookup("slow.test").await.expect_err("no answer");
        assert!(started.elapsed() <= LOOKUP_TIMEOUT + Duration::from_secs(1));
    }
}
