//! The SSRF guard: which resolved addresses the proxy may connect to. Pure
//! apart from [`AddressGuard::from_host`], which reads the host's interfaces.
//!
//! The allowlist decides on names; a name can resolve to anything, so the
//! proxy checks every address it is about to connect to here, after the one
//! lookup and before the connection. This module owns the list of refused
//! address classes and the operator's exceptions (`egress_internal_allow`);
//! it does not resolve names (see `resolve`) nor connect.
//!
//! An address is judged in this order:
//!
//! 1. an operator exception whose network contains it (and whose ports, if
//!    any, include the port) admits it;
//! 2. an address of one of the host's own interfaces is refused
//!    (`host-address`): the daemon's API and every run's proxy listen there;
//! 3. an IPv6 address that carries an IPv4 address (IPv4-mapped,
//!    IPv4-compatible, NAT64 `64:ff9b::/96`, 6to4 `2002::/16`) is judged as
//!    that IPv4 address, so a refused IPv4 range cannot be reached through an
//!    IPv6 spelling;
//! 4. the special-purpose ranges below are refused by class; everything else
//!    is admitted.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

/// An operator exception (`egress_internal_allow`): `cidr` or
/// `cidr:port,port` (IPv6 as `[cidr]:port,port`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InternalAllow {
    /// The network admitted.
    pub net: ipnet::IpNet,
    /// The ports admitted; empty means every port.
    pub ports: Vec<u16>,
}

/// Why an exception is malformed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid internal-allow entry {entry:?}: {reason}")]
pub struct InternalAllowError {
    /// The entry as given.
    pub entry: String,
    /// What is wrong.
    pub reason: String,
}

impl FromStr for InternalAllow {
    type Err = InternalAllowError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_internal_allow(s).map_err(|reason| InternalAllowError {
            entry: s.to_string(),
            reason,
        })
    }
}

impl InternalAllow {
    /// Whether this exception admits `addr:port`.
    pub fn admits(&self, addr: IpAddr, port: u16) -> bool {
        self.net.contains(&addr) && (self.ports.is_empty() || self.ports.contains(&port))
    }
}

/// Parses one exception; the error is the reason only.
fn parse_internal_allow(raw: &str) -> Result<InternalAllow, String> {
    let s = raw.trim();
    if s.is_empty() {
        return Err("empty entry; write a network such as 10.0.0.0/8 or 10.0.0.5:5432".into());
    }
    let (net, ports) = if let Some(rest) = s.strip_prefix('[') {
        let Some((net, after)) = rest.split_once(']') else {
            return Err("unclosed `[`; write e.g. [fd00::/8] or [fd00::/8]:443".into());
        };
        let ports = if after.is_empty() {
            None
        } else if let Some(p) = after.strip_prefix(':') {
            Some(p)
        } else {
            return Err("unexpected text after `]`; write e.g. [fd00::/8]:443,8443".into());
        };
        let net = parse_net(net)?;
        if !matches!(net, IpNet::V6(_)) {
            return Err(
                "brackets are for IPv6 only; write an IPv4 network without them, e.g. 10.0.0.0/8:443"
                    .into(),
            );
        }
        (net, ports)
    } else {
        match s.matches(':').count() {
            0 => (parse_net(s)?, None),
            1 => {
                let (net, ports) = s.split_once(':').unwrap_or((s, ""));
                let net = parse_net(net)?;
                (net, Some(ports))
            }
            // Without brackets `fd00::1:443` could be an address or an
            // address and a port; refuse rather than guess.
            _ => {
                return Err(
                    "write an IPv6 network in brackets: [fd00::/8], or [fd00::/8]:443 with ports"
                        .into(),
                )
            }
        }
    };
    let ports = match ports {
        None => Vec::new(),
        Some(list) => parse_ports(list)?,
    };
    Ok(InternalAllow { net, ports })
}

/// Parses `addr/len` or a bare address (a single-address network).
fn parse_net(s: &str) -> Result<IpNet, String> {
    if s.contains('/') {
        s.parse::<IpNet>().map(|n| n.trunc()).map_err(|_| {
            format!("{s:?} is not a network; write a CIDR such as 10.0.0.0/8 or fd00::/8")
        })
    } else {
        s.parse::<IpAddr>().map(IpNet::from).map_err(|_| {
            format!("{s:?} is not an IP address; write an address or a CIDR such as 10.0.0.0/8")
        })
    }
}

/// Parses `port,port,...`: at least one, each 1-65535.
fn parse_ports(list: &str) -> Result<Vec<u16>, String> {
    if list.is_empty() {
        return Err("empty port list after `:`; write e.g. 10.0.0.5:5432,6379 or leave out `:` for every port".into());
    }
    let mut ports = Vec::new();
    for p in list.split(',') {
        if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!(
                "port {p:?} is not a number; write ports as digits separated by commas, e.g. :443,8443"
            ));
        }
        match p.parse::<u32>() {
            Ok(n) if (1..=65535).contains(&n) => ports.push(n as u16),
            _ => return Err(format!("port {p} is out of range; use 1-65535")),
        }
    }
    Ok(ports)
}

/// Why an address is refused: a short stable class name
/// (`loopback`, `private`, `link-local`, `cgnat`, `multicast`, `unspecified`,
/// `broadcast`, `reserved`, `documentation`, `host-address`, and `runbox` for
/// runbox's own endpoints, ...).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// The class of the refused address.
    pub class: &'static str,
}

/// Refused IPv4 ranges and their classes. Order matters only where ranges
/// overlap: the broadcast address lies inside 240/4.
const V4_REFUSED: &[(Ipv4Addr, u8, &str)] = &[
    (Ipv4Addr::new(255, 255, 255, 255), 32, "broadcast"),
    (Ipv4Addr::new(0, 0, 0, 0), 8, "unspecified"),
    (Ipv4Addr::new(10, 0, 0, 0), 8, "private"),
    (Ipv4Addr::new(172, 16, 0, 0), 12, "private"),
    (Ipv4Addr::new(192, 168, 0, 0), 16, "private"),
    (Ipv4Addr::new(127, 0, 0, 0), 8, "loopback"),
    // Cloud metadata services (169.254.169.254) live here.
    (Ipv4Addr::new(169, 254, 0, 0), 16, "link-local"),
    (Ipv4Addr::new(100, 64, 0, 0), 10, "cgnat"),
    (Ipv4Addr::new(224, 0, 0, 0), 4, "multicast"),
    (Ipv4Addr::new(240, 0, 0, 0), 4, "reserved"),
    // IETF protocol assignments (DS-Lite, NAT64 discovery, ...).
    (Ipv4Addr::new(192, 0, 0, 0), 24, "reserved"),
    (Ipv4Addr::new(192, 0, 2, 0), 24, "documentation"),
    (Ipv4Addr::new(198, 51, 100, 0), 24, "documentation"),
    (Ipv4Addr::new(203, 0, 113, 0), 24, "documentation"),
    (Ipv4Addr::new(198, 18, 0, 0), 15, "benchmarking"),
];

/// Refused IPv6 ranges (after embedded IPv4 addresses are handled).
const V6_REFUSED: &[(Ipv6Addr, u8, &str)] = &[
    (Ipv6Addr::LOCALHOST, 128, "loopback"),
    (Ipv6Addr::UNSPECIFIED, 128, "unspecified"),
    // Unique local addresses.
    (Ipv6Addr::new(0xfc00, 0, 0, 0, 0, 0, 0, 0), 7, "private"),
    // Deprecated site-local addresses, still routed internally by some networks.
    (Ipv6Addr::new(0xfec0, 0, 0, 0, 0, 0, 0, 0), 10, "private"),
    (Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 0), 10, "link-local"),
    (Ipv6Addr::new(0xff00, 0, 0, 0, 0, 0, 0, 0), 8, "multicast"),
    (
        Ipv6Addr::new(0x2001, 0x0db8, 0, 0, 0, 0, 0, 0),
        32,
        "documentation",
    ),
    (Ipv6Addr::new(0x0100, 0, 0, 0, 0, 0, 0, 0), 64, "discard"),
];

/// The IPv4 address an IPv6 address carries, for the forms that reach (or
/// are translated to) that IPv4 address: IPv4-mapped `::ffff:a.b.c.d`,
/// IPv4-compatible `::a.b.c.d`, NAT64 `64:ff9b::a.b.c.d` and 6to4
/// `2002:aabb:ccdd::/48`. `::` and `::1` are not IPv4-compatible addresses
/// but themselves.
fn embedded_v4(v6: Ipv6Addr) -> Option<Ipv4Addr> {
    let s = v6.segments();
    let low = Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8);
    if v6 == Ipv6Addr::LOCALHOST || v6 == Ipv6Addr::UNSPECIFIED {
        return None;
    }
    match s {
        [0, 0, 0, 0, 0, 0xffff, _, _] | [0, 0, 0, 0, 0, 0, _, _] => Some(low),
        [0x64, 0xff9b, 0, 0, 0, 0, _, _] => Some(low),
        [0x2002, a, b, ..] => Some(Ipv4Addr::new(
            (a >> 8) as u8,
            a as u8,
            (b >> 8) as u8,
            b as u8,
        )),
        _ => None,
    }
}

/// The class of a refused IPv4 address, if it is in a refused range.
fn v4_class(v4: Ipv4Addr) -> Option<&'static str> {
    V4_REFUSED.iter().find_map(|&(net, len, class)| {
        Ipv4Net::new(net, len)
            .ok()
            .filter(|n| n.contains(&v4))
            .map(|_| class)
    })
}

/// The class of a refused IPv6 address, judged by its own ranges only.
fn v6_class(v6: Ipv6Addr) -> Option<&'static str> {
    V6_REFUSED.iter().find_map(|&(net, len, class)| {
        Ipv6Net::new(net, len)
            .ok()
            .filter(|n| n.contains(&v6))
            .map(|_| class)
    })
}

/// Checks destination addresses.
#[derive(Clone, Debug, Default)]
pub struct AddressGuard {
    /// Operator exceptions, consulted before any refusal.
    allow: Vec<InternalAllow>,
    /// The host's own addresses, refused as `host-address`.
    host_addrs: Vec<IpAddr>,
    /// runbox's own endpoints (the API listener): refused as `runbox`
    /// whatever the exceptions say. An unspecified address stands for every
    /// address of the host on that port.
    own: Vec<std::net::SocketAddr>,
}

impl AddressGuard {
    /// A guard with these exceptions and these host addresses.
    pub fn new(allow: Vec<InternalAllow>, host_addrs: Vec<IpAddr>) -> AddressGuard {
        AddressGuard {
            allow,
            host_addrs,
            own: Vec::new(),
        }
    }

    /// Refuses `endpoint` (and, for an unspecified address, that port on
    /// loopback and every host address) even when an exception covers it:
    /// an operator admitting `127.0.0.0/8` for a local service must not
    /// hand runs the runbox API.
    pub fn forbid(mut self, endpoint: std::net::SocketAddr) -> AddressGuard {
        self.own.push(endpoint);
        self
    }

    /// Whether `addr:port` is one of runbox's own endpoints. Connecting to
    /// an unspecified address (`0.0.0.0`, `::`) reaches the host's own
    /// listeners, so it counts as every one of them.
    pub fn is_own(&self, addr: IpAddr, port: u16) -> bool {
        self.own.iter().any(|e| {
            e.port() == port
                && (e.ip() == addr
                    || addr.is_unspecified()
                    || (e.ip().is_unspecified()
                        && (addr.is_loopback()
                            || addr.is_unspecified()
                            || self.host_addrs.contains(&addr))))
        })
    }

    /// A guard with these exceptions and the addresses of this host's
    /// interfaces.
    pub fn from_host(allow: Vec<InternalAllow>) -> std::io::Result<AddressGuard> {
        let host_addrs = if_addrs::get_if_addrs()?
            .into_iter()
            .map(|iface| iface.ip())
            .collect();
        Ok(AddressGuard::new(allow, host_addrs))
    }

    /// Whether the proxy may connect to `addr:port`. IPv4-mapped IPv6
    /// addresses are judged as the IPv4 address they carry.
    pub fn check(&self, addr: IpAddr, port: u16) -> Result<(), Refusal> {
        let embedded = match addr {
            IpAddr::V4(_) => None,
            IpAddr::V6(v6) => embedded_v4(v6).map(IpAddr::V4),
        };
        // An exception written for an IPv4 network also covers that network's
        // IPv6 spellings, so judge both forms against it.
        let candidates = std::iter::once(addr).chain(embedded);
        if candidates.clone().any(|c| self.is_own(c, port)) {
            return Err(Refusal { class: "runbox" });
        }
        if self
            .allow
            .iter()
            .any(|a| candidates.clone().any(|c| a.admits(c, port)))
        {
            return Ok(());
        }
        if candidates.clone().any(|c| self.host_addrs.contains(&c)) {
            return Err(Refusal {
                class: "host-address",
            });
        }
        let class = match (addr, embedded) {
            (_, Some(IpAddr::V4(v4))) | (IpAddr::V4(v4), _) => v4_class(v4),
            (IpAddr::V6(v6), _) => v6_class(v6),
        };
        match class {
            Some(class) => Err(Refusal { class }),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn runbox_endpoints_are_refused_whatever_the_exceptions() {
        let guard = AddressGuard::new(
            vec![allow("127.0.0.0/8"), allow("10.0.0.0/8")],
            vec![ip("10.1.2.3")],
        )
        .forbid("127.0.0.1:7439".parse().unwrap());
        assert_eq!(
            guard.check(ip("127.0.0.1"), 7439),
            Err(Refusal { class: "runbox" })
        );
        assert_eq!(
            guard.check(ip("::ffff:127.0.0.1"), 7439),
            Err(Refusal { class: "runbox" })
        );
        assert_eq!(guard.check(ip("127.0.0.1"), 7440), Ok(()));
        // 0.0.0.0 and :: reach the host's own listeners.
        for addr in ["0.0.0.0", "::", "::ffff:0.0.0.0"] {
            assert_eq!(
                guard.check(ip(addr), 7439),
                Err(Refusal { class: "runbox" }),
                "{addr}"
            );
        }
        let guard = AddressGuard::new(vec![allow("0.0.0.0/0")], vec![ip("10.1.2.3")])
            .forbid("0.0.0.0:7439".parse().unwrap());
        for addr in ["127.0.0.1", "127.9.9.9", "10.1.2.3", "0.0.0.0"] {
            assert_eq!(
                guard.check(ip(addr), 7439),
                Err(Refusal { class: "runbox" }),
                "{addr}"
            );
        }
        assert_eq!(guard.check(ip("10.9.9.9"), 7439), Ok(()));
    }

    fn allow(s: &str) -> InternalAllow {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    fn class(guard: &AddressGuard, addr: &str, port: u16) -> Option<&'static str> {
        guard.check(ip(addr), port).err().map(|r| r.class)
    }

    #[test]
    fn refuses_each_ipv4_class() {
        let guard = AddressGuard::default();
        let table = [
            ("0.0.0.0", "unspecified"),
            ("0.255.1.2", "unspecified"),
            ("10.0.0.1", "private"),
            ("10.255.255.255", "private"),
            ("172.16.0.1", "private"),
            ("172.31.255.254", "private"),
            ("192.168.1.1", "private"),
            ("127.0.0.1", "loopback"),
            ("127.255.0.9", "loopback"),
            ("169.254.169.254", "link-local"),
            ("100.64.0.1", "cgnat"),
            ("100.127.255.255", "cgnat"),
            ("224.0.0.1", "multicast"),
            ("239.255.255.250", "multicast"),
            ("240.0.0.1", "reserved"),
            ("192.0.0.8", "reserved"),
            ("255.255.255.255", "broadcast"),
            ("192.0.2.1", "documentation"),
            ("198.51.100.7", "documentation"),
            ("203.0.113.200", "documentation"),
            ("198.18.0.1", "benchmarking"),
            ("198.19.255.255", "benchmarking"),
        ];
        for (addr, want) in table {
            assert_eq!(class(&guard, addr, 443), Some(want), "{addr}");
        }
    }

    #[test]
    fn refuses_each_ipv6_class() {
        let guard = AddressGuard::default();
        let table = [
            ("::1", "loopback"),
            ("::", "unspecified"),
            ("fc00::1", "private"),
            ("fd12:3456::1", "private"),
            ("fec0::1", "private"),
            ("fe80::1", "link-local"),
            ("ff02::1", "multicast"),
            ("2001:db8::1", "documentation"),
            ("100::1", "discard"),
        ];
        for (addr, want) in table {
            assert_eq!(class(&guard, addr, 443), Some(want), "{addr}");
        }
    }

    #[test]
    fn admits_public_addresses_and_range_edges() {
        let guard = AddressGuard::default();
        for addr in [
            "93.184.216.34",
            "1.1.1.1",
            "8.8.8.8",
            "172.15.255.255",
            "172.32.0.0",
            "100.63.255.255",
            "100.128.0.0",
            "192.0.1.255",
            "198.17.255.255",
            "198.20.0.0",
            "223.255.255.255",
            "2606:4700::1111",
            "2a00:1450:4001::200e",
            "::ffff:93.184.216.34",
            "64:ff9b::1.1.1.1",
            "2002:5db8:d822::1",
            "100:0:0:1::1",
        ] {
            assert_eq!(guard.check(ip(addr), 443), Ok(()), "{addr}");
        }
    }

    #[test]
    fn embedded_ipv4_is_judged_as_ipv4() {
        let guard = AddressGuard::default();
        let table = [
            ("::ffff:0.0.0.1", "unspecified"),
            ("::ffff:10.0.0.1", "private"),
            ("::ffff:172.16.0.1", "private"),
            ("::ffff:192.168.0.1", "private"),
            ("::ffff:127.0.0.1", "loopback"),
            ("::ffff:169.254.169.254", "link-local"),
            ("::ffff:100.64.0.1", "cgnat"),
            ("::ffff:224.0.0.1", "multicast"),
            ("::ffff:240.0.0.1", "reserved"),
            ("::ffff:192.0.0.1", "reserved"),
            ("::ffff:255.255.255.255", "broadcast"),
            ("::ffff:192.0.2.1", "documentation"),
            ("::ffff:198.18.0.1", "benchmarking"),
            ("::127.0.0.1", "loopback"),
            ("::10.1.2.3", "private"),
            ("64:ff9b::169.254.169.254", "link-local"),
            ("64:ff9b::7f00:1", "loopback"),
            ("2002:a9fe:a9fe::1", "link-local"),
            ("2002:7f00:1::", "loopback"),
            ("2002:c0a8:0101::1", "private"),
        ];
        for (addr, want) in table {
            assert_eq!(class(&guard, addr, 443), Some(want), "{addr}");
        }
    }

    #[test]
    fn refuses_host_addresses_in_any_spelling() {
        let guard = AddressGuard::new(vec![], vec![ip("203.0.114.7"), ip("2a01:4f8::7")]);
        assert_eq!(class(&guard, "203.0.114.7", 8080), Some("host-address"));
        assert_eq!(
            class(&guard, "::ffff:203.0.114.7", 80),
            Some("host-address")
        );
        assert_eq!(class(&guard, "2a01:4f8::7", 443), Some("host-address"));
        assert_eq!(class(&guard, "203.0.114.8", 443), None);
    }

    #[test]
    fn exceptions_admit_with_and_without_ports() {
        let guard = AddressGuard::new(
            vec![
                allow("10.1.0.0/16"),
                allow("192.168.5.5:5432,6379"),
                allow("[fd00::/8]:443"),
                allow("127.0.0.1:8080"),
            ],
            vec![ip("10.1.2.3")],
        );
        assert_eq!(
            class(&guard, "10.1.2.3", 22),
            None,
            "exception beats host-address"
        );
        assert_eq!(class(&guard, "10.1.255.255", 1), None);
        assert_eq!(class(&guard, "10.2.0.1", 443), Some("private"));
        assert_eq!(class(&guard, "192.168.5.5", 5432), None);
        assert_eq!(class(&guard, "192.168.5.5", 6379), None);
        assert_eq!(class(&guard, "192.168.5.5", 443), Some("private"));
        assert_eq!(class(&guard, "192.168.5.6", 5432), Some("private"));
        assert_eq!(class(&guard, "fd00::5", 443), None);
        assert_eq!(class(&guard, "fd00::5", 80), Some("private"));
        assert_eq!(class(&guard, "127.0.0.1", 8080), None);
        assert_eq!(class(&guard, "127.0.0.1", 8081), Some("loopback"));
        // An IPv4 exception covers that address's IPv6 spellings.
        assert_eq!(class(&guard, "::ffff:10.1.0.9", 22), None);
    }

    #[test]
    fn from_host_lists_interface_addresses() {
        let guard = AddressGuard::from_host(vec![]).unwrap();
        assert!(!guard.host_addrs.is_empty());
    }

    #[test]
    fn parses_exceptions() {
        assert_eq!(
            allow("10.0.0.0/8"),
            InternalAllow {
                net: "10.0.0.0/8".parse().unwrap(),
                ports: vec![]
            }
        );
        assert_eq!(allow("10.9.8.7/8").net, "10.0.0.0/8".parse().unwrap());
        assert_eq!(allow("10.0.0.5").net, "10.0.0.5/32".parse().unwrap());
        assert_eq!(allow("10.0.0.5:443,8443").ports, vec![443, 8443]);
        assert_eq!(allow("[fd00::/8]").net, "fd00::/8".parse().unwrap());
        assert_eq!(allow("[fd00::1]").net, "fd00::1/128".parse().unwrap());
        assert_eq!(allow("[fd00::/8]:443").ports, vec![443]);
    }

    #[test]
    fn refuses_malformed_exceptions_with_guidance() {
        let cases = [
            ("", "empty entry"),
            ("10.0.0.0/33", "not a network"),
            ("example.org", "not an IP address"),
            ("10.0.0.0/8:", "empty port list"),
            ("10.0.0.0/8:0", "out of range"),
            ("10.0.0.0/8:65536", "out of range"),
            ("10.0.0.0/8:https", "not a number"),
            ("10.0.0.0/8:443,", "not a number"),
            ("fd00::/8", "in brackets"),
            ("fd00::1:443", "in brackets"),
            ("[fd00::/8", "unclosed"),
            ("[fd00::/8]443", "after `]`"),
            ("[10.0.0.0/8]", "IPv6 only"),
        ];
        for (input, want) in cases {
            let err = input.parse::<InternalAllow>().expect_err(input);
            assert!(err.reason.contains(want), "{input:?}: {:?}", err.reason);
        }
    }

    /// Refused IPv4 ranges the property test draws from.
    const INTERNAL: &[(u32, u8)] = &[
        (0x0a00_0000, 8),
        (0xac10_0000, 12),
        (0xc0a8_0000, 16),
        (0x7f00_0000, 8),
        (0xa9fe_0000, 16),
    ];

    fn internal_v4() -> impl Strategy<Value = Ipv4Addr> {
        (0..INTERNAL.len(), any::<u32>()).prop_map(|(i, bits)| {
            let (base, len) = INTERNAL[i];
            Ipv4Addr::from(base | (bits >> len))
        })
    }

    proptest! {
        #[test]
        fn internal_addresses_are_refused_unless_excepted(
            v4 in internal_v4(),
            port in 1..=u16::MAX,
            mapped in any::<bool>(),
            excepted in prop::option::of((any::<u32>(), 0u8..=32, prop::collection::vec(1..=u16::MAX, 0..3))),
        ) {
            let allow: Vec<InternalAllow> = excepted
                .into_iter()
                .map(|(bits, len, ports)| InternalAllow {
                    net: IpNet::V4(Ipv4Net::new(Ipv4Addr::from(bits), len).unwrap().trunc()),
                    ports,
                })
                .collect();
            let covered = allow.iter().any(|a| a.admits(IpAddr::V4(v4), port));
            let guard = AddressGuard::new(allow, vec![]);
            let addr = if mapped { IpAddr::V6(v4.to_ipv6_mapped()) } else { IpAddr::V4(v4) };
            prop_assert_eq!(guard.check(addr, port).is_ok(), covered);
        }

        #[test]
        fn exception_round_trips_through_text(bits in any::<u32>(), len in 0u8..=32, ports in prop::collection::vec(1..=u16::MAX, 0..4)) {
            let net = IpNet::V4(Ipv4Net::new(Ipv4Addr::from(bits), len).unwrap().trunc());
            let text = if ports.is_empty() {
                net.to_string()
            } else {
                let list: Vec<String> = ports.iter().map(u16::to_string).collect();
                format!("{net}:{}", list.join(","))
            };
            prop_assert_eq!(text.parse::<InternalAllow>(), Ok(InternalAllow { net, ports }));
        }
    }
}
