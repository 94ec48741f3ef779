//! The SOCKS5 door: a second listener in a run that asked for one
//! (`egressSocks5`), for programs that speak SOCKS5 rather than HTTP
//! (`ssh -o ProxyCommand='nc -X 5 ...'`, database drivers, `curl
//! --socks5-hostname`).
//!
//! It opens the same tunnels as `CONNECT` on the HTTP door, decided by the
//! same policy: the allowlist by host and port, one lookup, the guard on
//! every address, the same interception of TLS for hosts with a secret or a
//! methods rule. Only `CONNECT` is served (no `BIND`, no `UDP ASSOCIATE`:
//! the guard and the audit log speak TCP), and no authentication is asked
//! for: the listener is on the run's own loopback, where only the run is.
//!
//! SOCKS5 has no room for a message, so a refusal is a reply code
//! ("connection not allowed by ruleset" for the policy and the guard); the
//! reason, with the entry that would admit the destination, is in the audit
//! log and the daemon's debug log, as for the HTTP door.
//!
//! The protocol's framing is `fast-socks5`'s; the decisions are this
//! crate's.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use fast_socks5::server::Socks5ServerProtocol;
use fast_socks5::util::target_addr::TargetAddr;
use fast_socks5::{ReplyError, Socks5Command};
use tokio::net::TcpStream;

use crate::proxy::{
    canonical_host, counted_connection, interception, run_tunnel, Ctx, Reject, Target,
    HEADER_READ_TIMEOUT,
};

/// The verb SOCKS5 tunnels are audited and decided under: a tunnel like
/// `CONNECT`, told apart in the audit log.
pub const SOCKS5: &str = "SOCKS5";

/// Serves one accepted connection on the SOCKS5 door until it closes.
///
/// Cancellation: safe to drop; the run's socket and the upstream close.
pub(crate) async fn serve_connection(ctx: Arc<Ctx>, tcp: TcpStream) {
    let _ = tcp.set_nodelay(true);
    let (run_side, usage) = counted_connection(&ctx, tcp);
    // The greeting and the request, within the same time a request head
    // gets on the HTTP door.
    let opened = tokio::time::timeout(HEADER_READ_TIMEOUT, async {
        Socks5ServerProtocol::accept_no_auth(run_side)
            .await?
            .read_command()
            .await
    })
    .await;
    let (proto, command, address) = match opened {
        Ok(Ok(opened)) => opened,
        Ok(Err(e)) => {
            tracing::debug!(run = %ctx.run.run, error = %e, "SOCKS5 greeting or request refused");
            return;
        }
        Err(_elapsed) => {
            tracing::debug!(run = %ctx.run.run, "SOCKS5 client sent no request in time");
            return;
        }
    };
    ctx.run.counters.requests.fetch_add(1, Ordering::Relaxed);
    if command != Socks5Command::TCPConnect {
        tracing::debug!(run = %ctx.run.run, ?command, "SOCKS5 command other than CONNECT refused");
        let _ = proto.reply_error(&ReplyError::CommandNotSupported).await;
        return;
    }
    let target = match target_of(address) {
        Ok(target) => target,
        Err(reject) => {
            tracing::debug!(run = %ctx.run.run, error = %reject, "SOCKS5 target refused");
            let _ = proto
                .reply_error(&ReplyError::AddressTypeNotSupported)
                .await;
            return;
        }
    };
    let opened = async {
        let admitted = ctx.admit(SOCKS5, &target).await?;
        let server_config = interception(&ctx, SOCKS5, &target, &admitted)?;
        let upstream = ctx.open(&target, &admitted).await?;
        Ok::<_, Reject>((admitted, server_config, upstream))
    };
    let (admitted, server_config, upstream) = match opened.await {
        Ok(opened) => opened,
        Err(reject) => {
            tracing::debug!(run = %ctx.run.run, host = %target.host, port = target.port, reason = %reject, "SOCKS5 CONNECT refused");
            let _ = proto.reply_error(&reply_for(&reject)).await;
            return;
        }
    };
    if let Some(usage) = usage {
        usage.allowed.store(true, Ordering::Relaxed);
    }
    // The bound address is not the run's business (it would name one of
    // the host's own addresses); clients do not use it for CONNECT.
    let unspecified = SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0));
    let run_side = match proto.reply_success(unspecified).await {
        Ok(run_side) => run_side,
        Err(e) => {
            tracing::debug!(run = %ctx.run.run, error = %e, "SOCKS5 client left before the tunnel opened");
            return;
        }
    };
    run_tunnel(
        ctx,
        run_side,
        Bytes::new(),
        upstream,
        target,
        admitted,
        server_config,
        SOCKS5,
    )
    .await;
}

/// A SOCKS5 destination as the proxy's target: names canonical as on the
/// HTTP door, addresses in their canonical text.
pub(crate) fn target_of(address: TargetAddr) -> Result<Target, Reject> {
    let (host, port) = match address {
        TargetAddr::Ip(addr) => (Some(addr.ip().to_string()), addr.port()),
        TargetAddr::Domain(name, port) => (canonical_host(&name), port),
    };
    let Some(host) = host else {
        return Err(Reject::BadTarget(
            "the SOCKS5 target host is not a DNS name or IP literal".to_owned(),
        ));
    };
    if port == 0 {
        return Err(Reject::BadTarget("port 0 is not a destination".to_owned()));
    }
    Ok(Target { host, port })
}

/// The reply code that says the most about a refusal.
pub(crate) fn reply_for(reject: &Reject) -> ReplyError {
    match reject {
        Reject::Denied(_) | Reject::Internal { .. } => ReplyError::ConnectionNotAllowed,
        Reject::Resolve(_) => ReplyError::HostUnreachable,
        Reject::Connect { .. } => ReplyError::ConnectionRefused,
        Reject::ConnectTimeout { .. } => ReplyError::TtlExpired,
        Reject::BadTarget(_) => ReplyError::AddressTypeNotSupported,
        _ => ReplyError::GeneralFailure,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_canonical_or_refused() {
        let name = |n: &str, port| target_of(TargetAddr::Domain(n.to_owned(), port));
        let t = name("API.Example.com.", 443).unwrap();
        assert_eq!((t.host.as_str(), t.port), ("api.example.com", 443));
        let t = target_of(TargetAddr::Ip("[2001:db8::1]:22".parse().unwrap())).unwrap();
        assert_eq!((t.host.as_str(), t.port), ("2001:db8::1", 22));
        // An address sent as a name is the same destination.
        let t = name("10.0.0.1", 5432).unwrap();
        assert_eq!(t.host, "10.0.0.1");
        for bad in ["", "a b", "x..y", "host/path", "a@b", "a:b"] {
            assert!(name(bad, 443).is_err(), "{bad:?} accepted");
        }
        assert!(name("example.com", 0).is_err());
    }

    #[test]
    fn refusals_get_the_closest_reply_code() {
        let denied = Reject::Denied("no".into());
        assert_eq!(reply_for(&denied).as_u8(), 0x02);
        let internal = Reject::Internal {
            host: "h".into(),
            ip: "10.0.0.1".parse().unwrap(),
            class: "private",
        };
        assert_eq!(reply_for(&internal).as_u8(), 0x02);
        assert_eq!(reply_for(&Reject::Resolve("x".into())).as_u8(), 0x04);
        let refused = Reject::Connect {
            host: "h".into(),
            port: 1,
            reason: "refused".into(),
        };
        assert_eq!(reply_for(&refused).as_u8(), 0x05);
        let timeout = Reject::ConnectTimeout {
            host: "h".into(),
            port: 1,
        };
        assert_eq!(reply_for(&timeout).as_u8(), 0x06);
    }
}
