//! The proxy server: HTTP/1.1 CONNECT and absolute-form requests from one
//! run's listener, decided by its allowlist, guarded, tunnelled or
//! intercepted, counted and audited.
//!
//! This module owns the sockets and the order of the checks; the checks
//! themselves live in `policy`, `guard`, `resolve`, `secrets` and `tls`. It
//! does not bind the listener (the runtime does, inside the run's network
//! namespace) and it never logs or echoes a header value: headers may carry
//! credentials, and after injection they carry real secrets.
//!
//! One request, in order:
//!
//! ```text
//!  1. target     CONNECT host:port | GET http://host[:port]/path   anything else → 400
//!  2. policy     run.allowlist.decide(host, port)                  deny → 403 naming the entry to add
//!  3. resolve    shared.resolver.lookup(host), once                failure → 502
//!  4. guard      shared.guard.check(ip, port) for EVERY address    any refused → 403 naming the class
//!  5. connect    the checked addresses in order, 10 s each         → 502, or 504 when every try timed out
//!  6. CONNECT    200, then either
//!                  a blind tunnel (copy_bidirectional), or — when a secret of the run covers the host —
//!                  TLS from the run with a leaf of the node CA, TLS to the upstream verified for real,
//!                  and per inner request: strip hop-by-hop headers, secrets::inject, forward
//!     http://    forwarded in origin-form; secrets are never injected over plain HTTP
//!  7. audit      one record per blind CONNECT, per plain request, per intercepted inner request
//! ```
//!
//! Bytes are counted once, on the run's side of the connection, so tunnels
//! and intercepted traffic count the same way as plain requests.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONNECTION, CONTENT_TYPE, HOST};
use http::uri::{PathAndQuery, Scheme};
use http::{HeaderMap, Method, Request, Response, StatusCode, Uri, Version};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1 as server_http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::audit::{self, AuditLog, AuditRecord};
use crate::guard::AddressGuard;
use crate::policy::{self, Allowlist, Decision};
use crate::resolve::Resolver;
use crate::secrets::{self, Secret};
use crate::tls::Authority;
use crate::upstream::Upstream;
/// Re-exported: `Shared::classes` is one, made by the proxy's users.
pub use arc_swap::ArcSwap;

/// How long a client may take to send a request head before the connection
/// is closed (slowloris protection).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// How long one connection attempt to one upstream address may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The buffer size of a blind tunnel, each way. Large buffers keep the
/// number of syscalls per gigabyte low; throughput on loopback is the target.
pub const TUNNEL_BUFFER: usize = 64 * 1024;

/// What every run's proxy shares: daemon-wide settings and services.
pub struct Shared {
    /// Name resolution.
    pub resolver: Resolver,
    /// The SSRF guard.
    pub guard: AddressGuard,
    /// The interception CA (needed only when some run has secrets).
    pub authority: Arc<Authority>,
    /// How upstream TLS servers are verified when intercepting.
    pub upstream_tls: Arc<rustls::ClientConfig>,
    /// Where decisions are recorded, if anywhere.
    pub audit: Option<Arc<AuditLog>>,
    /// The operator's egress classes by name, as the config defines them
    /// now: a reload swaps the map, and every run bound to a class reads
    /// it at its next request.
    pub classes: ArcSwap<std::collections::BTreeMap<String, Arc<EgressClass>>>,
}

/// A named egress policy of the operator's that tenants are bound to: a
/// bound run reaches only what both the class and its own policy admit,
/// and leaves through the class's upstream unless it names its own.
#[derive(Debug)]
pub struct EgressClass {
    /// Its name.
    pub name: String,
    /// What it admits (no built-in list: only its own rules).
    pub allowlist: Allowlist,
    /// Its upstream proxy, if any.
    pub upstream: Option<Arc<Upstream>>,
}

/// Per-run traffic counters, shown on the run's JSON.
#[derive(Debug, Default)]
pub struct Counters {
    /// Bytes from the run to upstreams.
    pub bytes_up: AtomicU64,
    /// Bytes from upstreams to the run.
    pub bytes_down: AtomicU64,
    /// Requests handled (CONNECTs and plain requests, allowed or not).
    pub requests: AtomicU64,
    /// Connections from the run open now.
    pub open: AtomicU64,
}

/// Counts one connection from the run as open while it is held.
struct OpenConnection(Arc<RunEgress>);

impl OpenConnection {
    fn new(run: Arc<RunEgress>) -> OpenConnection {
        run.counters.open.fetch_add(1, Ordering::Relaxed);
        OpenConnection(run)
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.counters.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What one run may reach and which secrets it may use. Replaced whole
/// when the run's policy changes; a request reads it once.
#[derive(Debug, Default)]
pub struct RunPolicy {
    /// Its allowlist.
    pub allowlist: Allowlist,
    /// The secrets it may use.
    pub secrets: Vec<Arc<Secret>>,
    /// The proxy its egress leaves through, if any: its own, or the
    /// node's default (see `upstream_is_own`).
    pub upstream: Option<Arc<Upstream>>,
    /// Whether `upstream` is the run's own; if not, its class's upstream
    /// comes first.
    pub upstream_is_own: bool,
    /// The egress class it is bound to, by name.
    pub class: Option<String>,
}

/// One run's egress settings.
pub struct RunEgress {
    /// The run's id, for the audit log.
    pub run: String,
    /// Its policy now: new connections (and each request inside an
    /// intercepted tunnel) read it; connections already open keep going.
    policy: ArcSwap<RunPolicy>,
    /// Its counters.
    pub counters: Arc<Counters>,
    /// Told the bytes (both ways) of each connection from the run that had
    /// an allowed request, when it closes (`--egress-usage-bytes`).
    pub on_close: Option<ConnectionBytes>,
}

impl RunEgress {
    /// A run's egress settings.
    pub fn new(
        run: String,
        policy: RunPolicy,
        counters: Arc<Counters>,
        on_close: Option<ConnectionBytes>,
    ) -> RunEgress {
        RunEgress {
            run,
            policy: ArcSwap::from_pointee(policy),
            counters,
            on_close,
        }
    }

    /// The policy in force now.
    pub fn policy(&self) -> Arc<RunPolicy> {
        self.policy.load_full()
    }

    /// Puts `policy` in force for every request from now on.
    pub fn set_policy(&self, policy: RunPolicy) {
        self.policy.store(Arc::new(policy));
    }
}

/// Takes the byte count of one closed connection.
pub type ConnectionBytes = Arc<dyn Fn(u64) + Send + Sync>;

/// One connection from the run: its bytes so far, and whether any of its
/// requests was allowed (a connection that only met refusals is not the
/// run's egress).
#[derive(Debug, Default)]
pub(crate) struct ConnectionUsage {
    bytes: AtomicU64,
    pub(crate) allowed: std::sync::atomic::AtomicBool,
}

/// Serves `listener` until `shutdown` is cancelled, then stops accepting and
/// drops every connection of this run.
///
/// Cancellation: cancelling `shutdown` is the orderly stop; `serve` returns
/// once every task it spawned has ended. Dropping the future instead stops
/// accepting at once and makes every spawned task end at its next poll (a
/// drop guard cancels them), without waiting for them.
pub async fn serve(
    listener: TcpListener,
    shared: Arc<Shared>,
    run: Arc<RunEgress>,
    shutdown: CancellationToken,
) {
    let close = shutdown.clone();
    serve_door(listener, shared, run, shutdown, close, Door::Http).await
}

/// Serves `listener` as the run's SOCKS5 door (see [`crate::socks`]) until
/// `close` is cancelled (the door closes; tunnels through it keep going) or
/// `shutdown` is (everything stops). Cancellation as for [`serve`].
pub async fn serve_socks5(
    listener: TcpListener,
    shared: Arc<Shared>,
    run: Arc<RunEgress>,
    shutdown: CancellationToken,
    close: CancellationToken,
) {
    serve_door(listener, shared, run, shutdown, close, Door::Socks5).await
}

/// The protocols a run's listener may speak.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Door {
    /// HTTP/1.1 CONNECT and absolute-form requests.
    Http,
    /// SOCKS5 CONNECT.
    Socks5,
}

/// Serves `listener` as `door` until `close` (stop accepting; connections
/// open keep going until they end or `shutdown`) or `shutdown` (stop
/// everything) is cancelled; returns once every connection has ended.
pub(crate) async fn serve_door(
    listener: TcpListener,
    shared: Arc<Shared>,
    run: Arc<RunEgress>,
    shutdown: CancellationToken,
    close: CancellationToken,
    door: Door,
) {
    // A child token, so that dropping this future also stops the tasks it
    // spawned, not only cancelling `shutdown`.
    let stop = shutdown.child_token();
    let _stop_on_drop = stop.clone().drop_guard();
    let ctx = Arc::new(Ctx {
        shared,
        run,
        tasks: TaskTracker::new(),
        stop,
    });
    loop {
        let accepted = tokio::select! {
            biased;
            _ = ctx.stop.cancelled() => break,
            _ = close.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((tcp, _peer)) => {
                let conn_ctx = Arc::clone(&ctx);
                let open = OpenConnection::new(ctx.run.clone());
                ctx.spawn(async move {
                    match door {
                        Door::Http => serve_connection(conn_ctx, tcp).await,
                        Door::Socks5 => crate::socks::serve_connection(conn_ctx, tcp).await,
                    }
                    drop(open);
                });
            }
            Err(e) => {
                // Usually EMFILE/ENFILE: back off a little rather than spin
                // on a listener that keeps failing.
                tracing::warn!(run = %ctx.run.run, error = %e, "egress proxy accept failed");
                tokio::select! {
                    _ = ctx.stop.cancelled() => break,
                    _ = close.cancelled() => break,
                    _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                }
            }
        }
    }
    drop(listener);
    ctx.tasks.close();
    ctx.tasks.wait().await;
}

/// The body of every response the proxy writes: either its own short text or
/// an upstream's streamed body.
type ProxyBody = UnsyncBoxBody<Bytes, hyper::Error>;

/// Why a request is answered by the proxy itself instead of an upstream. The
/// message is the response body; it names hosts and addresses, never a
/// header value.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Reject {
    /// The request target is not one the proxy accepts.
    #[error(
        "{0}; runbox's egress proxy accepts `CONNECT host:port` (for https and any \
         other TCP protocol) and absolute-form `http://host[:port]/path` requests"
    )]
    BadTarget(String),
    /// The allowlist does not admit the destination (text from `policy`).
    #[error("{0}")]
    Denied(String),
    /// The name did not resolve.
    #[error("{0}")]
    Resolve(String),
    /// The guard refused one of the resolved addresses.
    #[error("{}", internal_message(host, *ip, class))]
    Internal {
        /// The host asked for.
        host: String,
        /// The refused address.
        ip: IpAddr,
        /// The guard's class for it.
        class: &'static str,
    },
    /// Every connection attempt failed.
    #[error("cannot connect to {host}:{port}: {reason}")]
    Connect {
        /// The host asked for.
        host: String,
        /// Its port.
        port: u16,
        /// The last attempt's error.
        reason: String,
    },
    /// Every connection attempt timed out.
    #[error("timed out connecting to {host}:{port}")]
    ConnectTimeout {
        /// The host asked for.
        host: String,
        /// Its port.
        port: u16,
    },
    /// The upstream's certificate did not verify while intercepting.
    #[error("the upstream certificate of {host} did not verify ({reason}); runbox did not send the request")]
    UpstreamCertificate {
        /// The host asked for.
        host: String,
        /// What rustls said.
        reason: String,
    },
    /// Some other upstream failure (TLS, HTTP).
    #[error("{0}")]
    Upstream(String),
    /// An intercepted request named another host than its tunnel's.
    #[error(
        "this connection is a tunnel to {0}; its requests must carry that host in their Host header"
    )]
    Misdirected(String),
    /// The interception certificate could not be made.
    #[error("runbox could not make an interception certificate for {0}")]
    Interception(String),
}

impl Reject {
    /// The status code the run sees.
    fn status(&self) -> StatusCode {
        match self {
            Reject::BadTarget(_) => StatusCode::BAD_REQUEST,
            Reject::Denied(_) | Reject::Internal { .. } => StatusCode::FORBIDDEN,
            Reject::ConnectTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            Reject::Misdirected(_) => StatusCode::MISDIRECTED_REQUEST,
            Reject::Resolve(_)
            | Reject::Connect { .. }
            | Reject::UpstreamCertificate { .. }
            | Reject::Upstream(_) => StatusCode::BAD_GATEWAY,
            Reject::Interception(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The response the run sees.
    fn response(&self) -> Response<ProxyBody> {
        text_response(self.status(), format!("{self}\n"))
    }
}

/// The 403 body for an address the guard refused: which address, what kind,
/// and who can change that.
fn internal_message(host: &str, ip: IpAddr, class: &str) -> String {
    // An IP literal "resolves" to itself; say it once.
    let subject = if host == ip.to_string() {
        format!("{ip} is")
    } else {
        format!("{host} resolves to {ip},")
    };
    if class == "runbox" {
        // No exception admits runbox's own endpoints, so no setting is named.
        return format!("{subject} an endpoint of runbox itself, which runs can never reach");
    }
    format!(
        "{subject} {}; runbox does not proxy to internal addresses unless the operator \
         admits them with --egress-internal-allow",
        class_phrase(class)
    )
}

/// "a private address", "an unspecified address"... for the guard's class.
fn class_phrase(class: &str) -> String {
    match class {
        "host-address" => "one of this host's own addresses".to_owned(),
        "cgnat" => "a carrier-grade NAT (cgnat) address".to_owned(),
        c if c.starts_with(['a', 'e', 'i', 'o', 'u']) => format!("an {c} address"),
        c => format!("a {c} address"),
    }
}

/// A plain-text response from the proxy itself.
fn text_response(status: StatusCode, body: String) -> Response<ProxyBody> {
    let mut resp = Response::new(
        Full::new(Bytes::from(body))
            .map_err(|never| match never {})
            .boxed_unsync(),
    );
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
}

/// Everything a connection task needs, shared by all of one run's tasks.
pub(crate) struct Ctx {
    pub(crate) shared: Arc<Shared>,
    pub(crate) run: Arc<RunEgress>,
    /// Every task spawned for this run, so `serve` can wait for them.
    tasks: TaskTracker,
    /// Cancelled when `serve` stops; every task selects on it.
    stop: CancellationToken,
}

impl Ctx {
    /// Spawns `fut` as a task of this run: tracked, and dropped mid-way when
    /// the proxy stops (which closes whatever sockets it owns).
    fn spawn<F>(&self, fut: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let stop = self.stop.clone();
        self.tasks.spawn(async move {
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = fut => {}
            }
        });
    }

    /// Writes one egress decision to the debug log and the audit log. Never
    /// given a header value or a payload.
    fn record(
        &self,
        method: &str,
        target: &Target,
        allow: bool,
        rule: &str,
        secret: Option<String>,
    ) {
        let decision = if allow { "allow" } else { "deny" };
        tracing::debug!(
            run = %self.run.run,
            method,
            host = %target.host,
            port = target.port,
            decision,
            rule,
            secret = secret.as_deref().unwrap_or(""),
            "egress decision"
        );
        if let Some(log) = &self.shared.audit {
            log.append(&AuditRecord::Egress {
                t: audit::now(),
                run: self.run.run.clone(),
                method: method.to_owned(),
                host: target.host.clone(),
                port: target.port,
                decision: decision.to_owned(),
                rule: rule.to_owned(),
                secret,
                // Where an allowed request left through; a refused one
                // left through nothing.
                upstream: allow
                    .then(|| self.upstream())
                    .flatten()
                    .map(|u| u.display()),
            });
        }
    }

    /// Steps 2–4: the allowlist, one lookup, the guard on every address.
    /// Denials are audited here; an allow is audited by the caller, which
    /// knows whether it is one record or one per intercepted request.
    ///
    /// Cancellation: safe to drop; it only waits on the resolver.
    pub(crate) async fn admit(&self, method: &str, target: &Target) -> Result<Admitted, Reject> {
        let decision = self.decide(method, target)?;
        let Decision::Allow { entry, .. } = &decision else {
            unreachable!("decide answers allows only")
        };
        if let Some(upstream) = self.upstream() {
            // The upstream resolves names; an address literal still meets
            // the guard.
            if let Ok(ip) = target.host.parse::<IpAddr>() {
                self.guard(method, target, &[ip])?;
            }
            return Ok(Admitted {
                rule: decision.rule(),
                entry: entry.clone(),
                addrs: Vec::new(),
                via: Some(upstream),
            });
        }
        let addrs = match self.shared.resolver.lookup(&target.host).await {
            Ok(addrs) if !addrs.is_empty() => addrs,
            Ok(_) => {
                self.record(method, target, false, "resolve", None);
                return Err(Reject::Resolve(format!(
                    "cannot resolve {}: no addresses",
                    target.host
                )));
            }
            Err(e) => {
                self.record(method, target, false, "resolve", None);
                return Err(Reject::Resolve(e.to_string()));
            }
        };
        self.guard(method, target, &addrs)?;
        Ok(Admitted {
            rule: decision.rule(),
            entry: entry.clone(),
            addrs,
            via: None,
        })
    }

    /// Step 4: every address, not just the first: a DNS answer mixing a
    /// public and a private address must not become a way in, and the
    /// connect step may fall through to any of them. A refusal is audited.
    fn guard(&self, method: &str, target: &Target, addrs: &[IpAddr]) -> Result<(), Reject> {
        for ip in addrs {
            if let Err(refusal) = self.shared.guard.check(*ip, target.port) {
                let rule = format!("guard:{}", refusal.class);
                self.record(method, target, false, &rule, None);
                return Err(Reject::Internal {
                    host: target.host.clone(),
                    ip: *ip,
                    class: refusal.class,
                });
            }
        }
        Ok(())
    }

    /// Step 5: a connection to the admitted target, straight to its checked
    /// addresses or through the run's upstream proxy.
    ///
    /// Cancellation: safe to drop; a half-made connection closes.
    pub(crate) async fn open(
        &self,
        target: &Target,
        admitted: &Admitted,
    ) -> Result<TcpStream, Reject> {
        match &admitted.via {
            None => connect_upstream(target, &admitted.addrs).await,
            Some(upstream) => upstream
                .open(
                    &self.shared.resolver,
                    &self.shared.guard,
                    &target.host,
                    target.port,
                    CONNECT_TIMEOUT,
                    HEADER_READ_TIMEOUT,
                )
                .await
                .map_err(Reject::Upstream),
        }
    }

    /// Step 2 alone, with the run's policy now: the rule that admits
    /// `method` to `target`, or the 403 naming what would (the entry to
    /// add, the port or the method a rule lacks). A CONNECT is checked by
    /// host and port; its requests are checked again one by one when the
    /// tunnel is intercepted. Denials are audited here.
    fn decide(&self, method: &str, target: &Target) -> Result<Decision, Reject> {
        let decision = self
            .run
            .policy()
            .allowlist
            .decide(&target.host, target.port);
        match &decision {
            Decision::Deny { run_entry, near } => {
                self.record(method, target, false, "none", None);
                Err(Reject::Denied(policy::denial_message(
                    method,
                    &target.host,
                    target.port,
                    run_entry,
                    near.as_ref(),
                )))
            }
            Decision::Allow { entry, source } => {
                // A tunnel (CONNECT, SOCKS5) is checked by host and port;
                // its requests, one by one, once intercepted.
                let asked = Method::from_bytes(method.as_bytes()).unwrap_or(Method::GET);
                let tunnel = asked == Method::CONNECT || method == crate::socks::SOCKS5;
                if !tunnel && !entry.admits_method(&asked) {
                    let rule = format!("method:{}", decision.rule());
                    self.record(method, target, false, &rule, None);
                    return Err(Reject::Denied(format!(
                        "runbox: {method} {}:{} is blocked: the {} rule {entry} admits {} only.\n\
                         To allow it, add {method} to that rule's methods.\n",
                        target.host,
                        target.port,
                        source.as_str(),
                        entry.method_list()
                    )));
                }
                self.decide_class(method, target, tunnel, &asked)?;
                Ok(decision)
            }
        }
    }
}

impl Ctx {
    /// The run's class, if it is bound to one: `Err` when the class is gone
    /// (its runs reach nothing until it is back, or they end).
    fn class(&self) -> Result<Option<Arc<EgressClass>>, String> {
        let Some(name) = self.run.policy().class.clone() else {
            return Ok(None);
        };
        match self.shared.classes.load().get(&name) {
            Some(class) => Ok(Some(class.clone())),
            None => Err(name),
        }
    }

    /// Step 2, second half: the run's class must admit what its own policy
    /// did (host, port and, outside a tunnel, method).
    fn decide_class(
        &self,
        method: &str,
        target: &Target,
        tunnel: bool,
        asked: &Method,
    ) -> Result<(), Reject> {
        let class = match self.class() {
            Ok(None) => return Ok(()),
            Ok(Some(class)) => class,
            Err(name) => {
                tracing::warn!(run = %self.run.run, class = %name, "the run's egress class is no longer defined; its egress is refused");
                self.record(method, target, false, &format!("class:{name}"), None);
                return Err(Reject::Denied(format!(
                    "runbox: {method} {}:{} is blocked: this run is bound to the egress class \
                     {name:?}, which the server no longer defines; nothing leaves until the \
                     operator defines it again.\n",
                    target.host, target.port
                )));
            }
        };
        let admitted = match class.allowlist.decide(&target.host, target.port) {
            Decision::Allow { entry, .. } => tunnel || entry.admits_method(asked),
            Decision::Deny { .. } => false,
        };
        if admitted {
            return Ok(());
        }
        self.record(
            method,
            target,
            false,
            &format!("class:{}", class.name),
            None,
        );
        Err(Reject::Denied(format!(
            "runbox: {method} {}:{} is blocked: the run's own policy admits it, but its tenant's \
             egress class {:?} does not. The operator changes the class (egress_class in the \
             server's config).\n",
            target.host, target.port, class.name
        )))
    }

    /// The upstream proxy a request leaves through: the run's own, else
    /// its class's, else the node's default.
    fn upstream(&self) -> Option<Arc<Upstream>> {
        let policy = self.run.policy();
        if policy.upstream_is_own {
            return policy.upstream.clone();
        }
        let class = self.class().ok().flatten();
        class
            .and_then(|c| c.upstream.clone())
            .or_else(|| policy.upstream.clone())
    }
}

/// A destination that passed steps 2–4.
pub(crate) struct Admitted {
    /// The audit rule of the allowlist entry that admitted it.
    pub(crate) rule: String,
    /// That entry.
    pub(crate) entry: crate::rules::Rule,
    /// The checked addresses, in the resolver's order (none through an
    /// upstream proxy, which resolves the name itself).
    pub(crate) addrs: Vec<IpAddr>,
    /// The upstream proxy to reach it through, if any.
    pub(crate) via: Option<Arc<Upstream>>,
}

/// A request's destination.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Target {
    /// Lowercase DNS name without a trailing dot, or an IP literal in its
    /// canonical text (IPv6 without brackets).
    pub(crate) host: String,
    /// The destination port.
    pub(crate) port: u16,
}

impl Target {
    /// Step 1: the destination of a request to the proxy.
    fn of(method: &Method, uri: &Uri) -> Result<Target, Reject> {
        let bad = |why: &str| Err(Reject::BadTarget(why.to_owned()));
        let authority = if method == Method::CONNECT {
            // Authority-form only: `CONNECT host:port`.
            match (uri.scheme(), uri.authority(), uri.path_and_query()) {
                (None, Some(authority), None) => authority,
                _ => return bad("CONNECT needs an authority-form target (host:port)"),
            }
        } else {
            match uri.scheme() {
                Some(s) if *s == Scheme::HTTP => {}
                Some(s) if *s == Scheme::HTTPS => {
                    return bad("https:// targets must be tunnelled with CONNECT")
                }
                Some(_) => return bad("only the http:// scheme can be forwarded"),
                None => {
                    return bad("the request has no target host (origin-form); configure runbox as an HTTP proxy")
                }
            }
            match uri.authority() {
                Some(authority) => authority,
                None => return bad("the target has no host"),
            }
        };
        // Credentials in the target would be forwarded nowhere useful and
        // would end up in logs.
        if authority.as_str().contains('@') {
            return bad("the target must not carry userinfo (user@host)");
        }
        let Some(host) = canonical_host(authority.host()) else {
            return bad("the target host is not a DNS name or IP literal");
        };
        let port = match authority.port_u16() {
            Some(0) => return bad("port 0 is not a destination"),
            Some(port) => port,
            None if method == Method::CONNECT => return bad("CONNECT needs a port (host:port)"),
            None => 80,
        };
        Ok(Target { host, port })
    }

    /// The host as it goes into a Host header or an authority: IPv6 in
    /// brackets.
    fn host_for_uri(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        }
    }
}

/// Canonical form of a target host, or None when it is neither a DNS name
/// nor an IP literal. Names are lowercased and lose one trailing dot so that
/// policy, secrets and audit all see the same spelling.
pub(crate) fn canonical_host(raw: &str) -> Option<String> {
    if let Some(inner) = raw.strip_prefix('[').and_then(|r| r.strip_suffix(']')) {
        // Zone ids (`fe80::1%eth0`) do not parse and are refused.
        return inner.parse::<Ipv6Addr>().ok().map(|ip| ip.to_string());
    }
    let lower = raw.to_ascii_lowercase();
    let name = lower.strip_suffix('.').unwrap_or(&lower);
    if let Ok(ip) = name.parse::<Ipv4Addr>() {
        return Some(ip.to_string());
    }
    let valid = !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        });
    valid.then(|| name.to_owned())
}

/// Serves one accepted connection from the run until it closes.
///
/// Cancellation: dropping it closes the run's connection (spawned tunnels
/// are separate tasks and stop with the proxy's token).
async fn serve_connection(ctx: Arc<Ctx>, tcp: TcpStream) {
    // Small writes (TLS handshakes, interactive protocols) must not wait for
    // Nagle.
    let _ = tcp.set_nodelay(true);
    let (counted, usage) = counted_connection(&ctx, tcp);
    let io = TokioIo::new(counted);
    let svc_ctx = Arc::clone(&ctx);
    // The upstream connection of this client connection's last plain HTTP
    // request, kept for the next one (see `forward_plain`).
    let plain = PlainSlot::default();
    let svc = service_fn(move |req| {
        let ctx = Arc::clone(&svc_ctx);
        let plain = Arc::clone(&plain);
        let usage = usage.clone();
        async move { Ok::<_, Infallible>(handle(ctx, req, plain, usage).await) }
    });
    let conn = server_http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .serve_connection(io, svc)
        .with_upgrades();
    if let Err(e) = conn.await {
        tracing::debug!(run = %ctx.run.run, error = %e, "egress proxy connection ended with an error");
    }
}

/// The run's side of an accepted connection, counted, and — when the run's
/// connections are reported as usage — the connection's own usage, to be
/// marked once a request on it is allowed.
pub(crate) fn counted_connection(
    ctx: &Ctx,
    tcp: TcpStream,
) -> (Counted<TcpStream>, Option<Arc<ConnectionUsage>>) {
    let mut counted = Counted::new(tcp, Arc::clone(&ctx.run.counters));
    let usage = ctx.run.on_close.clone().map(|report| {
        let usage = Arc::new(ConnectionUsage::default());
        counted.connection = Some((usage.clone(), report));
        usage
    });
    (counted, usage)
}

/// Answers one request from the run: steps 1–7.
///
/// Cancellation: safe to drop (hyper drops it when the run disconnects);
/// an upstream connection made so far is closed with it.
async fn handle(
    ctx: Arc<Ctx>,
    req: Request<Incoming>,
    plain: PlainSlot,
    usage: Option<Arc<ConnectionUsage>>,
) -> Response<ProxyBody> {
    ctx.run.counters.requests.fetch_add(1, Ordering::Relaxed);
    let target = match Target::of(req.method(), req.uri()) {
        Ok(target) => target,
        Err(reject) => return reject.response(),
    };
    let method = req.method().as_str().to_owned();
    let admitted = match ctx.admit(&method, &target).await {
        Ok(admitted) => admitted,
        Err(reject) => return reject.response(),
    };
    if let Some(usage) = usage {
        usage.allowed.store(true, Ordering::Relaxed);
    }
    let result = if req.method() == Method::CONNECT {
        connect(ctx, req, target, admitted).await
    } else {
        forward_plain(ctx, req, target, admitted, &plain).await
    };
    result.unwrap_or_else(|reject| reject.response())
}

/// Step 5: connects to the checked addresses in order; never resolves again.
///
/// Cancellation: safe to drop; a half-open attempt is abandoned.
pub(crate) async fn connect_upstream(
    target: &Target,
    addrs: &[IpAddr],
) -> Result<TcpStream, Reject> {
    let mut last_error = None;
    for ip in addrs {
        let addr = SocketAddr::new(*ip, target.port);
        match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr)).await {
            Ok(Ok(tcp)) => {
                let _ = tcp.set_nodelay(true);
                return Ok(tcp);
            }
            Ok(Err(e)) => last_error = Some(e),
            Err(_elapsed) => {}
        }
    }
    match last_error {
        Some(e) => Err(Reject::Connect {
            host: target.host.clone(),
            port: target.port,
            reason: e.to_string(),
        }),
        // No attempt failed outright: every one timed out.
        None => Err(Reject::ConnectTimeout {
            host: target.host.clone(),
            port: target.port,
        }),
    }
}

/// Step 6: a CONNECT. Connects before answering, so a failure is a clear
/// status code rather than a tunnel that closes at once; the tunnel itself
/// runs in its own task once hyper hands over the connection.
///
/// Cancellation: safe to drop before it returns; the tunnel task is spawned
/// last.
async fn connect(
    ctx: Arc<Ctx>,
    mut req: Request<Incoming>,
    target: Target,
    admitted: Admitted,
) -> Result<Response<ProxyBody>, Reject> {
    let server_config = interception(&ctx, "CONNECT", &target, &admitted)?;
    let upstream = ctx.open(&target, &admitted).await?;
    let on_upgrade = hyper::upgrade::on(&mut req);
    let task_ctx = Arc::clone(&ctx);
    ctx.spawn(async move {
        match on_upgrade.await {
            Ok(upgraded) => {
                tunnel(
                    task_ctx,
                    upgraded,
                    upstream,
                    target,
                    admitted,
                    server_config,
                )
                .await
            }
            Err(e) => tracing::debug!(error = %e, "CONNECT upgrade failed"),
        }
    });
    Ok(Response::new(
        Empty::new().map_err(|never| match never {}).boxed_unsync(),
    ))
}

/// Whether a tunnel to `target` is intercepted, and with which server
/// config. Interception is decided by the host: whether a request carries a
/// secret, or has a method its rule admits, is only known per inner
/// request, after TLS is terminated. A tunnel that is not intercepted is
/// recorded here (under `verb`), as its requests will not be seen.
pub(crate) fn interception(
    ctx: &Ctx,
    verb: &str,
    target: &Target,
    admitted: &Admitted,
) -> Result<Option<Arc<rustls::ServerConfig>>, Reject> {
    let intercept = admitted.entry.intercepts()
        || ctx
            .run
            .policy()
            .secrets
            .iter()
            .any(|s| s.covers_host(&target.host));
    if !intercept {
        ctx.record(verb, target, true, &admitted.rule, None);
        return Ok(None);
    }
    match ctx.shared.authority.server_config(&target.host) {
        Ok(config) => Ok(Some(config)),
        Err(e) => {
            tracing::error!(host = %target.host, error = %e, "cannot make an interception certificate");
            Err(Reject::Interception(target.host.clone()))
        }
    }
}

/// The first byte of a TLS connection: a handshake record.
const TLS_HANDSHAKE_RECORD: u8 = 0x16;

/// Runs an established tunnel: intercepted when `server_config` is given and
/// the run opens with TLS, blind otherwise.
///
/// A host with a secret rule may also be reached with something other than
/// TLS (`git` over SSH to a forge whose API token is brokered); such a
/// tunnel is passed through blind, which is safe: a blind tunnel never
/// carries a secret value, only what the run itself has. Not so under a
/// rule that admits some methods only (`strict`): a tunnel whose requests
/// cannot be seen could send any, so it is closed instead.
///
/// Cancellation: safe to drop; every socket of the tunnel closes.
async fn tunnel(
    ctx: Arc<Ctx>,
    upgraded: hyper::upgrade::Upgraded,
    upstream: TcpStream,
    target: Target,
    admitted: Admitted,
    server_config: Option<Arc<rustls::ServerConfig>>,
) {
    // Unwrapping hyper's upgrade wrapper leaves plain tokio I/O on the run's
    // side (still counted): a lean copy loop, and a socket to peek at.
    match upgraded.downcast::<TokioIo<Counted<TcpStream>>>() {
        Ok(parts) => {
            let (run_side, early) = (parts.io.into_inner(), parts.read_buf);
            run_tunnel(
                ctx,
                run_side,
                early,
                upstream,
                target,
                admitted,
                server_config,
                "CONNECT",
            )
            .await
        }
        Err(upgraded) => {
            // Not reached with this module's own I/O type; kept correct all
            // the same, deciding by the host alone.
            let run_side = TokioIo::new(upgraded);
            match server_config {
                Some(config) => intercept_tunnel(ctx, run_side, upstream, target, config).await,
                None => blind_tunnel(run_side, Bytes::new(), upstream).await,
            }
        }
    }
}

/// Runs a tunnel opened by `verb` (`CONNECT`, `SOCKS5`) once the run's
/// socket is plain again; `early` holds bytes the run sent already.
///
/// Cancellation: safe to drop; every socket of the tunnel closes.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run_tunnel(
    ctx: Arc<Ctx>,
    run_side: Counted<TcpStream>,
    early: Bytes,
    upstream: TcpStream,
    target: Target,
    admitted: Admitted,
    server_config: Option<Arc<rustls::ServerConfig>>,
    verb: &str,
) {
    let Some(config) = server_config else {
        return blind_tunnel(run_side, early, upstream).await;
    };
    let strict = !admitted.entry.methods.is_empty();
    let rule = admitted.rule;
    if opens_with_tls(&run_side.inner, &early, &upstream).await {
        let run_side = Prefixed::new(early, run_side);
        intercept_tunnel(ctx, run_side, upstream, target, config).await;
    } else if strict {
        // Dropping both sides closes the tunnel.
        ctx.record(verb, &target, false, &format!("not-tls:{rule}"), None);
    } else {
        // No inner requests will be seen: this tunnel is the record.
        ctx.record(verb, &target, true, &rule, None);
        blind_tunnel(run_side, early, upstream).await;
    }
}

/// Whether the run opens its tunnel with a TLS handshake. Whoever speaks
/// first decides, without a timeout: a TLS client always speaks first, so
/// an upstream that speaks first (an SSH or SMTP banner) means not TLS.
///
/// Cancellation: safe to drop; it only peeks.
async fn opens_with_tls(run: &TcpStream, early: &[u8], upstream: &TcpStream) -> bool {
    if let Some(first) = early.first() {
        return *first == TLS_HANDSHAKE_RECORD;
    }
    let mut run_first = [0u8; 1];
    let mut upstream_first = [0u8; 1];
    tokio::select! {
        peeked = run.peek(&mut run_first) => {
            matches!(peeked, Ok(1)) && run_first[0] == TLS_HANDSHAKE_RECORD
        }
        _ = upstream.peek(&mut upstream_first) => false,
    }
}

/// A blind tunnel: bytes both ways until both sides are done. `early` holds
/// bytes the run sent right behind its CONNECT, which hyper read already
/// (a pipelined TLS ClientHello); they go first.
///
/// Cancellation: safe to drop; both sockets close.
async fn blind_tunnel<R>(mut run_side: R, early: Bytes, mut upstream: TcpStream)
where
    R: AsyncRead + AsyncWrite + Unpin,
{
    let result = match upstream.write_all(&early).await {
        Ok(()) => tokio::io::copy_bidirectional_with_sizes(
            &mut run_side,
            &mut upstream,
            TUNNEL_BUFFER,
            TUNNEL_BUFFER,
        )
        .await
        .map(drop),
        Err(e) => Err(e),
    };
    if let Err(e) = result {
        tracing::debug!(error = %e, "tunnel ended with an error");
    }
}

/// The client side of one upstream HTTP/1.1 connection over TLS.
type UpstreamSender = hyper::client::conn::http1::SendRequest<Incoming>;

/// The connection driver that goes with an [`UpstreamSender`].
type UpstreamConnection = hyper::client::conn::http1::Connection<
    TokioIo<tokio_rustls::client::TlsStream<TcpStream>>,
    Incoming,
>;

/// An intercepted tunnel: TLS from the run with a leaf of the node CA,
/// verified TLS to the upstream, and HTTP/1.1 in between so that secrets can
/// be injected per request. One upstream connection serves the run's
/// keep-alive requests in turn; when the upstream closes it, the run's
/// connection is closed too (after any response in flight), so the run
/// reconnects instead of meeting a dead upstream.
///
/// Cancellation: safe to drop; every socket of the tunnel closes.
async fn intercept_tunnel<R>(
    ctx: Arc<Ctx>,
    run_side: R,
    upstream: TcpStream,
    target: Target,
    server_config: Arc<rustls::ServerConfig>,
) where
    R: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    // Both handshakes at once: the upstream's round trips overlap the run's.
    let (run_tls, upstream) = tokio::join!(
        TlsAcceptor::from(server_config).accept(run_side),
        upstream_handshake(&ctx, &target, upstream),
    );
    let run_tls = match run_tls {
        Ok(tls) => tls,
        Err(e) => {
            // Usually a client that does not trust the node CA.
            tracing::debug!(host = %target.host, error = %e, "TLS from the run failed while intercepting");
            return;
        }
    };
    // A failed upstream is reported per inner request, as a 502 the run can
    // read (the tunnel is established by now).
    let (sender, upstream_conn) = match upstream {
        Ok((sender, conn)) => (Ok(tokio::sync::Mutex::new(sender)), Some(conn)),
        Err(reject) => (Err(reject), None),
    };
    let inner = Arc::new(Intercepted {
        ctx: Arc::clone(&ctx),
        target,
        upstream: sender,
    });
    let svc = service_fn(move |req| {
        let inner = Arc::clone(&inner);
        async move { Ok::<_, Infallible>(inner.handle(req).await) }
    });
    let server = server_http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .serve_connection(TokioIo::new(run_tls), svc);
    tokio::pin!(server);
    let upstream_done = async move {
        match upstream_conn {
            Some(conn) => {
                if let Err(e) = conn.await {
                    tracing::debug!(error = %e, "upstream connection ended with an error");
                }
            }
            // Nothing upstream to wait for: the run's side decides.
            None => std::future::pending().await,
        }
    };
    tokio::pin!(upstream_done);
    let mut upstream_open = true;
    let result = loop {
        tokio::select! {
            result = server.as_mut() => break result,
            () = upstream_done.as_mut(), if upstream_open => {
                upstream_open = false;
                server.as_mut().graceful_shutdown();
            }
        }
    };
    if let Err(e) = result {
        tracing::debug!(run = %ctx.run.run, error = %e, "intercepted connection ended with an error");
    }
}

/// TLS to the upstream, verified against `shared.upstream_tls` for
/// `target.host`, then an HTTP/1.1 client handshake.
///
/// Cancellation: safe to drop; the upstream socket closes.
async fn upstream_handshake(
    ctx: &Ctx,
    target: &Target,
    tcp: TcpStream,
) -> Result<(UpstreamSender, UpstreamConnection), Reject> {
    // An IP literal becomes an IP server name, checked against the
    // certificate's IP SANs.
    let server_name = rustls::pki_types::ServerName::try_from(target.host.clone())
        .map_err(|_| Reject::Upstream(format!("{} is not a valid TLS server name", target.host)))?;
    let tls = TlsConnector::from(Arc::clone(&ctx.shared.upstream_tls))
        .connect(server_name, tcp)
        .await
        .map_err(|e| {
            let rustls_error = e
                .get_ref()
                .and_then(|inner| inner.downcast_ref::<rustls::Error>());
            match rustls_error {
                Some(rustls::Error::InvalidCertificate(reason)) => Reject::UpstreamCertificate {
                    host: target.host.clone(),
                    reason: reason.to_string(),
                },
                _ => Reject::Upstream(format!("TLS handshake with {} failed: {e}", target.host)),
            }
        })?;
    hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .map_err(|e| Reject::Upstream(format!("HTTP handshake with {} failed: {e}", target.host)))
}

/// The state of one intercepted tunnel.
struct Intercepted {
    ctx: Arc<Ctx>,
    /// The CONNECT's destination: the only host its requests may name.
    target: Target,
    /// The upstream connection, or why there is none.
    upstream: Result<tokio::sync::Mutex<UpstreamSender>, Reject>,
}

impl Intercepted {
    /// Forwards one inner request, injecting the secrets its method and path
    /// admit.
    ///
    /// Cancellation: safe to drop; a request half-sent upstream leaves that
    /// upstream connection unusable, and the run's connection closes with it.
    async fn handle(&self, req: Request<Incoming>) -> Response<ProxyBody> {
        self.forward(req).await.unwrap_or_else(|reject| {
            let mut response = reject.response();
            if matches!(
                reject,
                Reject::Upstream(_) | Reject::UpstreamCertificate { .. }
            ) {
                // Without a usable upstream this connection is done; the
                // run's next attempt starts over with a new CONNECT.
                response
                    .headers_mut()
                    .insert(CONNECTION, HeaderValue::from_static("close"));
            }
            response
        })
    }

    async fn forward(&self, req: Request<Incoming>) -> Result<Response<ProxyBody>, Reject> {
        let (mut parts, body) = req.into_parts();
        if parts.uri.scheme().is_some()
            || parts.uri.authority().is_some()
            || !parts.uri.path().starts_with('/')
        {
            return Err(Reject::BadTarget(
                "requests inside an intercepted tunnel must be origin-form (/path)".to_owned(),
            ));
        }
        // The secret is bound to the tunnel's host. A Host header naming
        // another site would let a shared front end (a CDN) route the
        // credential to that site, so it is refused rather than forwarded.
        match parts.headers.get(HOST) {
            Some(value) if !host_header_names(value, &self.target) => {
                return Err(Reject::Misdirected(self.target.host.clone()));
            }
            Some(_) => {}
            None => {
                let value = HeaderValue::from_str(&authority_of(&self.target, 443))
                    .map_err(|_| Reject::Misdirected(self.target.host.clone()))?;
                parts.headers.insert(HOST, value);
            }
        }
        let upstream = match &self.upstream {
            Ok(upstream) => upstream,
            // Certificate failures do not heal within a connection; say the
            // same thing to every request on it.
            Err(Reject::UpstreamCertificate { host, reason }) => {
                return Err(Reject::UpstreamCertificate {
                    host: host.clone(),
                    reason: reason.clone(),
                })
            }
            Err(other) => return Err(Reject::Upstream(other.to_string())),
        };
        strip_hop_by_hop(&mut parts.headers);
        // Each request is checked against the policy in force now: the
        // host still admitted, its method under its rule; and only the
        // secrets in force now (one taken away since the tunnel opened is
        // not sent).
        let decision = self.ctx.decide(parts.method.as_str(), &self.target)?;
        let rule = decision.rule();
        let injected = secrets::inject(
            &self.ctx.run.policy().secrets,
            &self.target.host,
            &parts.method,
            parts.uri.path(),
            &mut parts.headers,
        );
        let secret = (!injected.is_empty()).then(|| injected.join(","));
        let method = parts.method.as_str().to_owned();
        self.ctx.record(&method, &self.target, true, &rule, secret);
        parts.version = Version::HTTP_11;
        let upstream_req = Request::from_parts(parts, body);
        let response = {
            let mut sender = upstream.lock().await;
            sender.ready().await.map_err(|e| {
                Reject::Upstream(format!(
                    "the connection to {} closed: {e}",
                    self.target.host
                ))
            })?;
            sender.send_request(upstream_req)
        };
        let response = response.await.map_err(|e| {
            Reject::Upstream(format!("the request to {} failed: {e}", self.target.host))
        })?;
        // An upstream that closes after this response closes the run's
        // connection too, said up front so the run does not reuse it.
        let closing = connection_has(response.headers(), "close");
        let mut response = relay_response(response);
        if closing {
            response
                .headers_mut()
                .insert(CONNECTION, HeaderValue::from_static("close"));
        }
        Ok(response)
    }
}

/// Whether the Connection header lists `option`.
fn connection_has(headers: &HeaderMap, option: &str) -> bool {
    headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .any(|token| token.trim().eq_ignore_ascii_case(option))
}

/// A stream that yields `prefix` before reading from `inner`: the bytes
/// hyper read past a CONNECT, put back in front of the TLS handshake.
struct Prefixed<S> {
    prefix: Bytes,
    inner: S,
}

impl<S> Prefixed<S> {
    fn new(prefix: Bytes, inner: S) -> Prefixed<S> {
        Prefixed { prefix, inner }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.prefix.is_empty() {
            let n = this.prefix.len().min(buf.remaining());
            buf.put_slice(&this.prefix.split_to(n));
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// Whether a Host header value names `target`'s host (the port is not
/// compared: the tunnel's port is used whatever it says).
fn host_header_names(value: &HeaderValue, target: &Target) -> bool {
    let Ok(text) = value.to_str() else {
        return false;
    };
    let Ok(authority) = text.parse::<http::uri::Authority>() else {
        return false;
    };
    !authority.as_str().contains('@')
        && canonical_host(authority.host()).as_deref() == Some(target.host.as_str())
}

/// `host[:port]` for a Host header, leaving out the scheme's default port.
fn authority_of(target: &Target, default_port: u16) -> String {
    if target.port == default_port {
        target.host_for_uri()
    } else {
        format!("{}:{}", target.host_for_uri(), target.port)
    }
}

/// An upstream connection kept between the plain HTTP requests of one
/// client connection.
struct PlainUpstream {
    /// The target it was opened for.
    host: String,
    port: u16,
    /// The checked address it is connected to.
    addr: IpAddr,
    sender: hyper::client::conn::http1::SendRequest<Incoming>,
}

/// One client connection's kept upstream connection, if any.
type PlainSlot = Arc<tokio::sync::Mutex<Option<PlainUpstream>>>;

/// How long a kept upstream connection may take to become ready for the
/// next request before a new one is opened instead.
const REUSE_READY_TIMEOUT: Duration = Duration::from_secs(1);

/// Step 6, plain HTTP: the request goes upstream in origin-form. Secrets are
/// never injected here: the value would cross the network in clear, so a
/// placeholder goes out as it came in.
///
/// A client that keeps its connection to the proxy alive gets its upstream
/// connection kept too, as long as its requests go to the same target: a
/// kept connection is used again only for the same host and port, and only
/// if the address it is connected to is among the addresses this request's
/// own lookup returned and the guard passed, so every request is still
/// decided, resolved and checked on its own. Anything else — another target,
/// an upstream that closed or answered `Connection: close` — opens a new one.
///
/// Cancellation: safe to drop; the upstream connection closes.
async fn forward_plain(
    ctx: Arc<Ctx>,
    req: Request<Incoming>,
    target: Target,
    admitted: Admitted,
    slot: &PlainSlot,
) -> Result<Response<ProxyBody>, Reject> {
    ctx.record(req.method().as_str(), &target, true, &admitted.rule, None);
    let mut kept = slot.lock().await.take().filter(|kept| {
        kept.host == target.host && kept.port == target.port && admitted.addrs.contains(&kept.addr)
    });
    if let Some(upstream) = &mut kept {
        let ready = tokio::time::timeout(REUSE_READY_TIMEOUT, upstream.sender.ready()).await;
        if !matches!(ready, Ok(Ok(()))) {
            kept = None;
        }
    }
    let mut upstream = match kept {
        Some(upstream) => upstream,
        None => {
            let tcp = ctx.open(&target, &admitted).await?;
            let addr = tcp
                .peer_addr()
                .map_err(|e| Reject::Upstream(format!("connecting to {}: {e}", target.host)))?
                .ip();
            let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
                .await
                .map_err(|e| {
                    Reject::Upstream(format!("HTTP handshake with {} failed: {e}", target.host))
                })?;
            ctx.spawn(async move {
                if let Err(e) = conn.await {
                    tracing::debug!(error = %e, "upstream connection ended with an error");
                }
            });
            PlainUpstream {
                host: target.host.clone(),
                port: target.port,
                addr,
                sender,
            }
        }
    };
    let (mut parts, body) = req.into_parts();
    let path = parts
        .uri
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"));
    parts.uri = Uri::from(path);
    parts.version = Version::HTTP_11;
    strip_hop_by_hop(&mut parts.headers);
    // RFC 9112 §3.2.2: the target's host replaces any Host header, so a
    // request cannot reach a site the allowlist did not admit by naming it
    // in Host on an admitted address.
    let host = HeaderValue::from_str(&authority_of(&target, 80))
        .map_err(|_| Reject::BadTarget("the target host cannot be a Host header".to_owned()))?;
    parts.headers.insert(HOST, host);
    let response = upstream
        .sender
        .send_request(Request::from_parts(parts, body))
        .await
        .map_err(|e| Reject::Upstream(format!("the request to {} failed: {e}", target.host)))?;
    // Kept for the next request; it becomes ready once this response's body
    // has been relayed, which the client's next request waits for anyway.
    *slot.lock().await = Some(upstream);
    Ok(relay_response(response))
}

/// An upstream response on its way to the run: hop-by-hop headers removed,
/// the body streamed.
fn relay_response(response: Response<Incoming>) -> Response<ProxyBody> {
    let (mut parts, body) = response.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    Response::from_parts(parts, body.boxed_unsync())
}

/// Hop-by-hop headers (RFC 9110 §7.6.1), which describe one connection and
/// must not be forwarded. Transfer-Encoding is left to hyper, which frames
/// each side's body itself.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "proxy-connection",
    "proxy-authorization",
    "proxy-authenticate",
    "keep-alive",
    "te",
    "trailer",
    "upgrade",
];

/// Removes hop-by-hop headers, including those the Connection header names.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named {
        // Connection may not name a header the proxy relies on.
        if name != HOST {
            headers.remove(&name);
        }
    }
    for name in HOP_BY_HOP {
        headers.remove(*name);
    }
}

/// The run's side of a connection, counting bytes: what is read from the run
/// goes up, what is written to it comes down. Everything the run exchanges
/// through the proxy passes here once, tunnels included.
pub(crate) struct Counted<S> {
    inner: S,
    counters: Arc<Counters>,
    /// This connection's own count, and who is told it when the connection
    /// closes (this is dropped), if anyone.
    connection: Option<(Arc<ConnectionUsage>, ConnectionBytes)>,
}

impl<S> Counted<S> {
    fn new(inner: S, counters: Arc<Counters>) -> Counted<S> {
        Counted {
            inner,
            counters,
            connection: None,
        }
    }

    fn add_to_connection(&self, n: usize) {
        if let Some((usage, _)) = &self.connection {
            usage.bytes.fetch_add(n as u64, Ordering::Relaxed);
        }
    }
}

impl<S> Drop for Counted<S> {
    /// The connection is closed (a tunnel's too: the tunnel owns this).
    fn drop(&mut self) {
        if let Some((usage, report)) = self.connection.take() {
            let bytes = usage.bytes.load(Ordering::Relaxed);
            if usage.allowed.load(Ordering::Relaxed) && bytes > 0 {
                report(bytes);
            }
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Counted<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let poll = Pin::new(&mut this.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = poll {
            let n = buf.filled().len().saturating_sub(before);
            this.counters
                .bytes_up
                .fetch_add(n as u64, Ordering::Relaxed);
            this.add_to_connection(n);
        }
        poll
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Counted<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = poll {
            this.counters
                .bytes_down
                .fetch_add(n as u64, Ordering::Relaxed);
            this.add_to_connection(n);
        }
        poll
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(n)) = poll {
            this.counters
                .bytes_down
                .fetch_add(n as u64, Ordering::Relaxed);
            this.add_to_connection(n);
        }
        poll
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    fn target(method: &str, uri: &str) -> Result<Target, String> {
        let method = Method::from_bytes(method.as_bytes()).map_err(|e| e.to_string())?;
        let uri: Uri = uri
            .parse()
            .map_err(|e: http::uri::InvalidUri| e.to_string())?;
        Target::of(&method, &uri).map_err(|e| e.to_string())
    }

    fn ok(host: &str, port: u16) -> Result<Target, String> {
        Ok(Target {
            host: host.to_owned(),
            port,
        })
    }

    #[test]
    fn connect_targets_need_host_and_port() {
        assert_eq!(target("CONNECT", "example.org:443"), ok("example.org", 443));
        assert_eq!(
            target("CONNECT", "Example.ORG.:8443"),
            ok("example.org", 8443)
        );
        assert_eq!(target("CONNECT", "[::1]:443"), ok("::1", 443));
        assert_eq!(target("CONNECT", "10.0.0.5:22"), ok("10.0.0.5", 22));
        for bad in [
            "example.org",
            "example.org:",
            "example.org:0",
            "example.org:x",
            "user@example.org:443",
            "/path",
            "http://x/",
        ] {
            assert!(target("CONNECT", bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn absolute_form_targets_are_http_only() {
        assert_eq!(
            target("GET", "http://example.org/x?y"),
            ok("example.org", 80)
        );
        assert_eq!(
            target("POST", "http://example.org:8080/"),
            ok("example.org", 8080)
        );
        assert_eq!(
            target("GET", "http://[2001:db8::1]/"),
            ok("2001:db8::1", 80)
        );
        let https = target("GET", "https://example.org/").unwrap_err();
        assert!(https.contains("CONNECT"), "{https}");
        let origin = target("GET", "/index.html").unwrap_err();
        assert!(origin.contains("origin-form"), "{origin}");
        assert!(target("GET", "http://u:p@example.org/").is_err());
        assert!(target("GET", "ftp://example.org/").is_err());
    }

    #[test]
    fn hosts_are_canonical_or_refused() {
        assert_eq!(
            canonical_host("A.Example.com."),
            Some("a.example.com".into())
        );
        assert_eq!(
            canonical_host("[::FFFF:7f00:1]"),
            Some("::ffff:127.0.0.1".into())
        );
        assert_eq!(canonical_host("[fe80::1%25eth0]"), None);
        assert_eq!(canonical_host("a..b"), None);
        assert_eq!(canonical_host(""), None);
        assert_eq!(canonical_host("."), None);
        assert_eq!(canonical_host("bad!host"), None);
        assert_eq!(canonical_host(&"a".repeat(64)), None);
    }

    #[test]
    fn hop_by_hop_headers_go_including_those_connection_names() {
        let mut headers = HeaderMap::new();
        for (name, value) in [
            ("connection", "keep-alive, X-Private, host"),
            ("keep-alive", "timeout=5"),
            ("x-private", "1"),
            ("proxy-authorization", "Basic abc"),
            ("proxy-connection", "keep-alive"),
            ("te", "trailers"),
            ("trailer", "x-sum"),
            ("upgrade", "websocket"),
            ("host", "example.org"),
            ("authorization", "Bearer x"),
        ] {
            headers.append(
                HeaderName::from_static(name),
                HeaderValue::from_static(value),
            );
        }
        strip_hop_by_hop(&mut headers);
        let mut left: Vec<_> = headers.keys().map(|k| k.as_str().to_owned()).collect();
        left.sort();
        assert_eq!(left, ["authorization", "host"]);
    }

    #[test]
    fn host_header_must_name_the_tunnel_host() {
        let t = Target {
            host: "api.example.org".into(),
            port: 443,
        };
        let names = |v: &'static str| host_header_names(&HeaderValue::from_static(v), &t);
        assert!(names("api.example.org"));
        assert!(names("API.example.org:443"));
        assert!(!names("other.example.org"));
        assert!(!names("user@api.example.org"));
        assert!(!names(""));
    }

    #[test]
    fn host_headers_leave_out_default_ports() {
        let t = |host: &str, port| Target {
            host: host.into(),
            port,
        };
        assert_eq!(authority_of(&t("a.org", 80), 80), "a.org");
        assert_eq!(authority_of(&t("a.org", 8080), 80), "a.org:8080");
        assert_eq!(authority_of(&t("::1", 443), 443), "[::1]");
        assert_eq!(authority_of(&t("::1", 8443), 443), "[::1]:8443");
    }

    #[test]
    fn internal_messages_name_address_class_and_setting() {
        let ip: IpAddr = "10.0.0.5".parse().unwrap();
        assert_eq!(
            internal_message("db.example", ip, "private"),
            "db.example resolves to 10.0.0.5, a private address; runbox does not proxy to \
             internal addresses unless the operator admits them with --egress-internal-allow"
        );
        assert!(internal_message("10.0.0.5", ip, "private").starts_with("10.0.0.5 is a private"));
        let own = internal_message("127.0.0.1", "127.0.0.1".parse().unwrap(), "runbox");
        assert!(
            own.contains("runbox itself") && !own.contains("--egress"),
            "{own}"
        );
    }

    #[test]
    fn class_phrases_read_well() {
        assert_eq!(class_phrase("private"), "a private address");
        assert_eq!(class_phrase("unspecified"), "an unspecified address");
        assert!(class_phrase("host-address").contains("own addresses"));
    }

    #[test]
    fn connection_options_are_tokens() {
        let mut headers = HeaderMap::new();
        headers.append(CONNECTION, HeaderValue::from_static("keep-alive"));
        headers.append(CONNECTION, HeaderValue::from_static("Upgrade, Close"));
        assert!(connection_has(&headers, "close"));
        assert!(!connection_has(&headers, "clos"));
    }

    #[tokio::test]
    async fn prefixed_streams_read_the_prefix_first() {
        let (near, mut far) = tokio::io::duplex(1024);
        let mut stream = Prefixed::new(Bytes::from_static(b"abc"), near);
        far.write_all(b"def").await.unwrap();
        let mut buf = [0u8; 6];
        stream.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"abcdef");
        stream.write_all(b"up").await.unwrap();
        let mut up = [0u8; 2];
        far.read_exact(&mut up).await.unwrap();
        assert_eq!(&up, b"up");
    }

    #[tokio::test]
    async fn counted_streams_count_each_direction() {
        let counters = Arc::new(Counters::default());
        let (near, mut far) = tokio::io::duplex(1024);
        let mut counted = Counted::new(near, Arc::clone(&counters));
        counted.write_all(b"hello").await.unwrap();
        far.write_all(b"hi there").await.unwrap();
        let mut buf = [0u8; 8];
        counted.read_exact(&mut buf).await.unwrap();
        assert_eq!(counters.bytes_down.load(Ordering::Relaxed), 5);
        assert_eq!(counters.bytes_up.load(Ordering::Relaxed), 8);
    }
}
