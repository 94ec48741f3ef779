//! The egress phase: what runbox's egress proxy costs, measured with the
//! proxy's own code (`runbox_proxy::proxy::serve`) on real loopback sockets,
//! next to the same traffic sent straight to the upstream.
//!
//! Four tables:
//!
//! 1. **throughput**: `--egress-mib` MiB per sample, each way, through a
//!    blind CONNECT tunnel, through a SOCKS5 tunnel of the same run
//!    (`serve_socks5`), directly to the same loopback source or sink, and
//!    through a bare relay (`loopback::start_relay`) as the floor of any
//!    user-space tunnel;
//! 2. **HTTP latency**: a small GET, through the proxy in absolute-form and
//!    directly, on a new connection per request and on a keep-alive one;
//! 3. **HTTPS latency**: a small GET on a new connection, directly, through
//!    a blind CONNECT tunnel, and through an intercepting one (the host is
//!    covered by a secret, so the proxy terminates TLS with a leaf of its
//!    CA, injects the secret and opens verified TLS upstream), with the leaf
//!    cached and, separately, for a host never seen before (the leaf is
//!    minted on that request); minting a leaf is also timed on its own;
//! 4. **policy**: a plain GET on a new connection through a run's policy of
//!    1, 100 and 1000 rules (the admitting one last), and an intercepted
//!    HTTPS GET that carries the brokered secret against the same request
//!    on a path the secret does not cover (intercepted, nothing injected).
//!
//! Setup, untimed:
//!
//! 1. the upstreams (`loopback`) and a DNS server for their names
//!    (`runbox_proxy::testing::TestDns`) on a runtime of their own with one
//!    worker thread, standing in for other processes;
//! 2. the proxy, built as `runbox serve` builds it: the built-in allowlist
//!    on plus one `host:port` entry per upstream, the SSRF guard from the
//!    host's addresses with a loopback exception for the upstream ports
//!    (`--egress-internal-allow`), a resolver asking that DNS server, an
//!    interception CA and an audit log in a temporary directory, the
//!    upstream CA as an extra root (`--egress-ca-bundle`), one secret; served
//!    on a multi-thread runtime of its own with one worker per CPU, as the
//!    daemon's;
//! 3. the client is this process's main thread. Clients never resume a TLS
//!    session (each request is a new client, as a new `curl` would be); the
//!    proxy's upstream side resumes as it does in production.
//!
//! Every round runs each case of a table once, in an order rotated by one
//! each round, as the other phases do; warm-up rounds are not counted.
//! Besides its wall time, each sample records the CPU time the proxy
//! runtime's workers ran meanwhile (`/proc/self/task/<tid>/schedstat`),
//! which says how much of a proxied sample is the proxy's own work and
//! what one core of proxy would sustain, and each table records the DNS
//! queries the proxy sent. Every sample checks what it got (status, body
//! length, byte count) and, at the end, the audit log must name the secret
//! on every intercepted request, so the interception rows are known to have
//! gone through injection. Nothing about timings is asserted.
//!
//! Cancellation: dropping the phase's future drops its runtimes (in the
//! background) and with them the proxy and the upstreams.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _};
use bytes::Bytes;
use http_body_util::{BodyExt as _, Empty};
use hyper::header::{AUTHORIZATION, HOST};
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::runtime::Runtime;
use tokio_util::sync::CancellationToken;

use runbox_proxy::audit::{AuditLog, AuditRecord};
use runbox_proxy::guard::{AddressGuard, InternalAllow};
use runbox_proxy::policy::{Allowlist, Entry};
use runbox_proxy::proxy::{
    serve, serve_socks5, Counters, RunEgress, RunPolicy, Shared, TUNNEL_BUFFER,
};
use runbox_proxy::resolve::Resolver;
use runbox_proxy::rules::Rule;
use runbox_proxy::secrets::{placeholder, Secret, SecretSpec};
use runbox_proxy::testing::TestDns;
use runbox_proxy::tls::{upstream_client_config, Authority};

use crate::loopback::{self, TestCa, BULK_ACK, BULK_BUFFER, BULK_DOWN, BULK_UP, SMALL_BODY};
use crate::report::{EgressReport, Role, Series, Table, TableSeries};

/// The plain HTTP upstream's name.
const HTTP_HOST: &str = "http.bench.test";
/// The HTTPS upstream's name for blind tunnels: no secret covers it.
const BLIND_HOST: &str = "blind.bench.test";
/// The HTTPS upstream's name for intercepted tunnels: the secret covers it.
const INTERCEPT_HOST: &str = "secret.bench.test";
/// The bulk upstream's name.
const BULK_HOST: &str = "bulk.bench.test";
/// Hosts `h<n>.` of this suffix are intercepted once each, so that each
/// request meets a host without a cached leaf. They resolve to the HTTPS
/// upstream, whose certificate has a wildcard for them.
const NEW_HOST_SUFFIX: &str = "new.bench.test";
/// Hosts `h<n>.` of this suffix get a leaf minted with no request at all.
const MINT_ALONE_SUFFIX: &str = "alone.bench.test";
/// The path every GET asks for; the secret admits it.
const PATH: &str = "/api/small";
/// A path the secret's prefixes do not cover.
const OTHER_PATH: &str = "/other/small";
/// The secret the run has.
const SECRET_NAME: &str = "API_TOKEN";
/// Its value, which only the upstream of an intercepted request sees.
const SECRET_VALUE: &str = "bench-secret-value";
/// The audit log's rotation size, `runbox serve`'s default (64 MiB).
const AUDIT_MAX_BYTES: u64 = 64 << 20;
/// The name of the proxy runtime's threads, to find them in `/proc`.
const PROXY_THREADS: &str = "bench-proxy";
/// Bound on one sample; only keeps a wedged proxy from hanging the bench.
const STEP_TIMEOUT: Duration = Duration::from_secs(120);

/// What the egress phase does.
#[derive(Clone, Debug)]
pub struct Options {
    /// Measured transfers per direction and path.
    pub transfers: usize,
    /// Unmeasured transfers before them.
    pub transfer_warmup: usize,
    /// Bytes per transfer.
    pub transfer_bytes: u64,
    /// Measured requests per latency case.
    pub iterations: usize,
    /// Unmeasured requests before them.
    pub warmup: usize,
}

/// Sets up, runs the three tables in turn and checks the audit log.
pub async fn measure(opts: &Options) -> anyhow::Result<EgressReport> {
    let new_hosts = opts.warmup + opts.iterations;
    eprintln!("runbox-bench: egress: starting the proxy and the loopback upstreams");
    let setup = Setup::start(new_hosts).await?;
    let mut bench = Egress {
        opts: opts.clone(),
        setup,
        auth: format!("Bearer {}", placeholder(SECRET_NAME)),
        direct_keep_alive: None,
        proxy_keep_alive: None,
        new_hosts: 0,
        minted: 0,
        buf: vec![0u8; BULK_BUFFER],
    };
    let mut tables = Vec::new();
    let mut dns_queries = Vec::new();
    for which in 0..4 {
        let before = bench.setup.dns_queries();
        let table = match which {
            0 => bench.throughput().await?,
            1 => bench.http().await?,
            2 => bench.https().await?,
            _ => bench.policy().await?,
        };
        dns_queries.push((table.name.clone(), bench.setup.dns_queries() - before));
        tables.push(table);
    }
    // Every intercepted request of the HTTPS table, and the injecting one
    // of the policy table.
    bench.check_audit(3 * (opts.warmup + opts.iterations))?;
    Ok(EgressReport {
        proxy_workers: bench.setup.proxy_workers,
        dns_queries,
        tables,
    })
}

/// The proxy, its upstreams and what clients need to reach them.
struct Setup {
    /// The proxy's listener.
    proxy: SocketAddr,
    /// The same run's SOCKS5 door.
    socks: SocketAddr,
    /// The run it serves, whose policy the policy table swaps.
    run: Arc<RunEgress>,
    /// The run's entries.
    entries: Vec<Entry>,
    /// Its secret.
    secret: Arc<Secret>,
    /// The bare relay to the bulk upstream, on the proxy's runtime.
    relay_port: u16,
    http_port: u16,
    https_port: u16,
    bulk_port: u16,
    /// The proxy's interception CA, shared with it: minting alone uses it.
    authority: Arc<Authority>,
    /// Client TLS trusting the upstream CA only (direct and blind cases).
    upstream_trust: Arc<rustls::ClientConfig>,
    /// Client TLS trusting the runbox CA only (intercepted cases).
    runbox_trust: Arc<rustls::ClientConfig>,
    /// The proxy's audit log.
    audit: PathBuf,
    proxy_workers: usize,
    /// `/proc/self/task/<tid>/schedstat` of each of the proxy's workers.
    proxy_threads: Vec<PathBuf>,
    shutdown: CancellationToken,
    dns: Option<TestDns>,
    proxy_rt: Option<Runtime>,
    upstream_rt: Option<Runtime>,
    _dir: tempfile::TempDir,
}

impl Setup {
    /// Starts the upstreams, the DNS server and the proxy, with `new_hosts`
    /// names under [`NEW_HOST_SUFFIX`] admitted and resolvable.
    async fn start(new_hosts: usize) -> anyhow::Result<Setup> {
        let dir = tempfile::Builder::new()
            .prefix("runbox-bench-egress-")
            .tempdir()
            .context("creating the egress phase's directory")?;
        let upstream_rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("bench-upstream")
            .enable_all()
            .build()?;
        // As `runbox serve`'s runtime: one worker per CPU.
        let proxy_rt = tokio::runtime::Builder::new_multi_thread()
            .thread_name(PROXY_THREADS)
            .enable_all()
            .build()?;
        let proxy_workers = proxy_rt.metrics().num_workers();

        let wildcard = format!("*.{NEW_HOST_SUFFIX}");
        let ca = TestCa::new(&[BLIND_HOST, INTERCEPT_HOST, &wildcard])?;
        let server_tls = Arc::clone(&ca.server);
        let (dns, http_port, https_port, bulk_port) = upstream_rt
            .spawn(async move {
                let dns = TestDns::start().await?;
                let http = loopback::start_http(None).await?;
                let https = loopback::start_http(Some(server_tls)).await?;
                let bulk = loopback::start_bulk().await?;
                std::io::Result::Ok((dns, http, https, bulk))
            })
            .await?
            .context("starting the loopback upstreams")?;
        let loopback_ip = Ipv4Addr::LOCALHOST.into();
        let new_names: Vec<String> = (0..new_hosts)
            .map(|n| format!("h{n}.{NEW_HOST_SUFFIX}"))
            .collect();
        for name in [HTTP_HOST, BLIND_HOST, INTERCEPT_HOST, BULK_HOST]
            .into_iter()
            .chain(new_names.iter().map(String::as_str))
        {
            dns.set(name, &[loopback_ip], 3600);
        }

        let upstream_ca = dir.path().join("upstream-ca.pem");
        std::fs::write(&upstream_ca, &ca.ca_pem)?;
        let authority = Arc::new(
            Authority::load_or_create(&dir.path().join("ca"))
                .context("creating the interception CA")?,
        );
        let audit = dir.path().join("audit.jsonl");
        let guard = AddressGuard::from_host(vec![InternalAllow {
            net: "127.0.0.1/32".parse()?,
            ports: vec![http_port, https_port, bulk_port],
        }])?;
        let mut entries = vec![
            format!("{HTTP_HOST}:{http_port}"),
            format!("{BLIND_HOST}:{https_port}"),
            format!("{INTERCEPT_HOST}:{https_port}"),
            format!("{BULK_HOST}:{bulk_port}"),
        ];
        entries.extend(new_names.iter().map(|n| format!("{n}:{https_port}")));
        let entries = entries
            .iter()
            .map(|e| e.parse::<Entry>().with_context(|| format!("entry {e}")))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let secret = Secret::load(
            SecretSpec {
                name: SECRET_NAME.to_owned(),
                header: "Authorization".to_owned(),
                scheme: Some("Bearer".to_owned()),
                value_env: "RUNBOX_BENCH_API_TOKEN".to_owned(),
                hosts: vec![INTERCEPT_HOST.to_owned(), format!(".{NEW_HOST_SUFFIX}")],
                methods: vec!["GET".to_owned()],
                path_prefixes: vec!["/api/".to_owned()],
            },
            |_| Some(SECRET_VALUE.to_owned()),
        )?;
        let secret = Arc::new(secret);
        let run = Arc::new(RunEgress::new(
            "bench".to_owned(),
            RunPolicy {
                allowlist: Allowlist::new(true, &[], &entries),
                secrets: vec![Arc::clone(&secret)],
                upstream: None,
                upstream_is_own: false,
                class: None,
            },
            Arc::new(Counters::default()),
            None,
        ));
        let served = Arc::clone(&run);

        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let proxy = listener.local_addr()?;
        let socks_listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        socks_listener.set_nonblocking(true)?;
        let socks = socks_listener.local_addr()?;
        let socks_run = Arc::clone(&run);
        let shutdown = CancellationToken::new();
        let dns_addr = dns.addr();
        let upstream_tls = upstream_client_config(Some(&upstream_ca))?;
        let shared_authority = Arc::clone(&authority);
        let audit_path = audit.clone();
        let stop = shutdown.clone();
        // Everything that registers with a reactor is made on the proxy's
        // runtime, so that its sockets are driven there.
        let relay_port = proxy_rt
            .spawn(async move {
                let shared = Arc::new(Shared {
                    resolver: Resolver::new(Some(dns_addr))?,
                    guard,
                    authority: shared_authority,
                    upstream_tls,
                    audit: Some(Arc::new(AuditLog::open(audit_path, AUDIT_MAX_BYTES)?)),
                    classes: Default::default(),
                });
                let listener = tokio::net::TcpListener::from_std(listener)?;
                let socks_listener = tokio::net::TcpListener::from_std(socks_listener)?;
                tokio::spawn(serve_socks5(
                    socks_listener,
                    Arc::clone(&shared),
                    socks_run,
                    stop.clone(),
                    stop.clone(),
                ));
                tokio::spawn(serve(listener, shared, served, stop));
                let bulk = SocketAddr::from((Ipv4Addr::LOCALHOST, bulk_port));
                let relay_port = loopback::start_relay(bulk, TUNNEL_BUFFER).await?;
                anyhow::Ok(relay_port)
            })
            .await?
            .context("starting the proxy")?;

        // The workers name themselves once they run; give them a moment.
        let mut proxy_threads = thread_schedstats(PROXY_THREADS)?;
        for _ in 0..100 {
            if proxy_threads.len() >= proxy_workers {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
            proxy_threads = thread_schedstats(PROXY_THREADS)?;
        }
        ensure!(
            proxy_threads.len() == proxy_workers,
            "found {} threads of the proxy's runtime, not its {proxy_workers} workers",
            proxy_threads.len()
        );

        let runbox_ca = CertificateDer::from_pem_slice(authority.ca_pem().as_bytes())
            .context("parsing the interception CA")?;
        Ok(Setup {
            proxy,
            socks,
            run,
            entries,
            secret,
            relay_port,
            http_port,
            https_port,
            bulk_port,
            authority,
            upstream_trust: client_tls(ca.ca_der)?,
            runbox_trust: client_tls(runbox_ca)?,
            audit,
            proxy_workers,
            proxy_threads,
            shutdown,
            dns: Some(dns),
            proxy_rt: Some(proxy_rt),
            upstream_rt: Some(upstream_rt),
            _dir: dir,
        })
    }
}

impl Setup {
    /// The run's policy with `fillers` rules that admit nothing the bench
    /// asks for ahead of its entries.
    fn policy(&self, fillers: usize) -> RunPolicy {
        let mut rules: Vec<Rule> = (0..fillers)
            .map(|i| Rule::from(Entry::HostPort(format!("filler{i}.bench.test"), 443)))
            .collect();
        rules.extend(self.entries.iter().cloned().map(Rule::from));
        RunPolicy {
            allowlist: Allowlist::new::<Rule>(true, &[], &rules),
            secrets: vec![Arc::clone(&self.secret)],
            upstream: None,
            upstream_is_own: false,
            class: None,
        }
    }

    /// DNS queries the proxy has sent so far.
    fn dns_queries(&self) -> u64 {
        self.dns.as_ref().map_or(0, TestDns::queries)
    }

    /// The CPU time the proxy's workers have run so far (0 when unreadable:
    /// the figure is reported, never relied on).
    fn proxy_cpu(&self) -> Duration {
        let nanos: u64 = self
            .proxy_threads
            .iter()
            .filter_map(|path| std::fs::read_to_string(path).ok())
            .filter_map(|stat| stat.split_whitespace().next()?.parse::<u64>().ok())
            .sum();
        Duration::from_nanos(nanos)
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        self.shutdown.cancel();
        drop(self.dns.take());
        // Dropping a runtime blocks, which an async context forbids; these
        // stop without waiting, and their tasks (servers, proxy) with them.
        if let Some(rt) = self.proxy_rt.take() {
            rt.shutdown_background();
        }
        if let Some(rt) = self.upstream_rt.take() {
            rt.shutdown_background();
        }
    }
}

/// A client TLS config trusting `ca` alone, offering HTTP/1.1, never
/// resuming a session.
fn client_tls(ca: CertificateDer<'static>) -> anyhow::Result<Arc<rustls::ClientConfig>> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca)?;
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.resumption = rustls::client::Resumption::disabled();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The client half of one HTTP/1.1 connection.
type Sender = hyper::client::conn::http1::SendRequest<Empty<Bytes>>;

/// One timed operation.
#[derive(Clone, Copy, Debug)]
enum Case {
    /// One bulk transfer, downloading (`true`) or uploading, by one path.
    Transfer { down: bool, via: Via },
    /// One plain GET, through the proxy or directly, on a new connection
    /// or the kept-alive one.
    Get { proxy: bool, keep_alive: bool },
    /// One HTTPS GET on a new connection.
    Https(Https),
    /// `Authority::server_config` of a host without a cached leaf.
    Mint,
    /// A plain GET on a new connection through a policy of this many rules.
    Rules(usize),
}

/// The path of a bulk transfer.
#[derive(Clone, Copy, Debug)]
enum Via {
    /// Straight to the upstream.
    Direct,
    /// Through a blind CONNECT tunnel of the proxy.
    Tunnel,
    /// Through the bare relay.
    Relay,
    /// Through a SOCKS5 tunnel of the proxy.
    Socks,
}

/// The path of an HTTPS request.
#[derive(Clone, Copy, Debug)]
enum Https {
    /// Straight to the upstream.
    Direct,
    /// Through a blind CONNECT tunnel.
    Blind,
    /// Through an intercepting CONNECT; the host's leaf is cached.
    Intercepted,
    /// Through an intercepting CONNECT to a host seen for the first time.
    InterceptedNewHost,
    /// As `Intercepted`, on a path the secret does not cover.
    InterceptedWithout,
}

/// The phase's state between samples.
struct Egress {
    opts: Options,
    setup: Setup,
    /// The Authorization header every HTTPS request carries: the secret's
    /// placeholder, which only interception replaces.
    auth: String,
    /// The keep-alive connections, opened by their first (warm-up) request.
    direct_keep_alive: Option<Sender>,
    proxy_keep_alive: Option<Sender>,
    /// Hosts under [`NEW_HOST_SUFFIX`] used so far.
    new_hosts: usize,
    /// Hosts under [`MINT_ALONE_SUFFIX`] minted so far.
    minted: usize,
    /// The client's transfer buffer.
    buf: Vec<u8>,
}

impl Egress {
    /// Table 1: bulk transfers.
    async fn throughput(&mut self) -> anyhow::Result<Table> {
        let transfer = |down, via| Case::Transfer { down, via };
        let cases = [
            transfer(true, Via::Direct),
            transfer(true, Via::Tunnel),
            transfer(true, Via::Relay),
            transfer(false, Via::Direct),
            transfer(false, Via::Tunnel),
            transfer(false, Via::Relay),
            transfer(true, Via::Socks),
            transfer(false, Via::Socks),
        ];
        let (warmup, iterations) = (self.opts.transfer_warmup, self.opts.transfers);
        let samples = self
            .rounds("throughput", &cases, warmup, iterations)
            .await?;
        let bytes = Some(self.opts.transfer_bytes);
        let cpu = "CPU time of the proxy runtime's threads (MB/s: per CPU-second)";
        let rows = vec![
            row("direct, download", Role::Baseline, bytes, None, Of::Time(0)),
            row(
                "blind CONNECT tunnel, download",
                Role::Runbox,
                bytes,
                Some(0),
                Of::Time(1),
            ),
            row(cpu, Role::Part, bytes, None, Of::ProxyCpu(1)),
            row(
                "bare relay, download",
                Role::Reference,
                bytes,
                Some(0),
                Of::Time(2),
            ),
            row(cpu, Role::Part, bytes, None, Of::ProxyCpu(2)),
            row("direct, upload", Role::Baseline, bytes, None, Of::Time(3)),
            row(
                "blind CONNECT tunnel, upload",
                Role::Runbox,
                bytes,
                Some(5),
                Of::Time(4),
            ),
            row(cpu, Role::Part, bytes, None, Of::ProxyCpu(4)),
            row(
                "bare relay, upload",
                Role::Reference,
                bytes,
                Some(5),
                Of::Time(5),
            ),
            row(cpu, Role::Part, bytes, None, Of::ProxyCpu(5)),
            // Against the CONNECT tunnel's rows (1 and 6): the doors side
            // by side.
            row(
                "SOCKS5 tunnel, download (vs CONNECT)",
                Role::Runbox,
                bytes,
                Some(1),
                Of::Time(6),
            ),
            row(cpu, Role::Part, bytes, None, Of::ProxyCpu(6)),
            row(
                "SOCKS5 tunnel, upload (vs CONNECT)",
                Role::Runbox,
                bytes,
                Some(6),
                Of::Time(7),
            ),
            row(cpu, Role::Part, bytes, None, Of::ProxyCpu(7)),
        ];
        Ok(Table::new(
            "egress-throughput",
            "Egress proxy: bulk transfer through a blind CONNECT or SOCKS5 tunnel",
            &format!(
                "One TCP connection per sample carries {} MiB in {} KiB reads and writes, from \
                 a loopback source to the client (download) or from the client to a loopback \
                 sink (upload); timed from the request's first byte to the last byte received \
                 (download) or to the sink's acknowledgement (upload). Tunnel: the same transfer \
                 after a CONNECT to the proxy (untimed). SOCKS5: after a SOCKS5 CONNECT (by \
                 name) to the same run's SOCKS5 door (untimed). Bare relay: the same transfer through \
                 a relay that only copies, as the tunnel does ({} KiB buffers each way, on the \
                 proxy's runtime), without parsing, policy, lookup or counting. CPU time: what \
                 the worker threads of the proxy's runtime ran during the sample; MB/s is 10^6 \
                 bytes per second at the median (of wall time, or of that CPU time).",
                self.opts.transfer_bytes >> 20,
                BULK_BUFFER >> 10,
                TUNNEL_BUFFER >> 10
            ),
            warmup,
            iterations,
            fill(rows, &samples),
        ))
    }

    /// Table 2: plain HTTP GETs.
    async fn http(&mut self) -> anyhow::Result<Table> {
        let get = |proxy, keep_alive| Case::Get { proxy, keep_alive };
        let cases = [
            get(false, false),
            get(true, false),
            get(false, true),
            get(true, true),
        ];
        let (warmup, iterations) = (self.opts.warmup, self.opts.iterations);
        let samples = self.rounds("http", &cases, warmup, iterations).await?;
        let cpu = "CPU time of the proxy runtime's threads";
        let rows = vec![
            row(
                "direct, new connection",
                Role::Baseline,
                None,
                None,
                Of::Time(0),
            ),
            row(
                "proxy (absolute-form), new connection",
                Role::Runbox,
                None,
                Some(0),
                Of::Time(1),
            ),
            row(cpu, Role::Part, None, None, Of::ProxyCpu(1)),
            row(
                "direct, keep-alive connection",
                Role::Baseline,
                None,
                None,
                Of::Time(2),
            ),
            row(
                "proxy (absolute-form), keep-alive connection to the proxy",
                Role::Runbox,
                None,
                Some(3),
                Of::Time(3),
            ),
            row(cpu, Role::Part, None, None, Of::ProxyCpu(3)),
        ];
        Ok(Table::new(
            "egress-http",
            "Egress proxy: latency of a small HTTP GET",
            &format!(
                "`GET {PATH}` answered with {SMALL_BODY} bytes by a loopback HTTP/1.1 server; \
                 timed from the TCP connect (new connection) or from sending the request \
                 (keep-alive) to the last body byte. Proxy: `GET http://{HTTP_HOST}:<port>{PATH}` \
                 to the proxy, which checks the allowlist, resolves the name (cached), checks \
                 the address, writes an audit record and forwards the request upstream: on a new \
                 connection, or, while the client keeps its connection alive and asks for the \
                 same target, on the upstream connection of its previous request. CPU \
                 time: what the worker threads of the proxy's runtime ran from the start of the \
                 sample until the client had the response."
            ),
            warmup,
            iterations,
            fill(rows, &samples),
        )
        .with_added_column())
    }

    /// Table 4: what the run's policy costs: the number of rules on a new
    /// connection, and injecting a brokered secret.
    async fn policy(&mut self) -> anyhow::Result<Table> {
        let cases = [
            Case::Rules(1),
            Case::Rules(100),
            Case::Rules(1000),
            Case::Https(Https::Intercepted),
            Case::Https(Https::InterceptedWithout),
        ];
        let (warmup, iterations) = (self.opts.warmup, self.opts.iterations);
        let samples = self.rounds("policy", &cases, warmup, iterations).await?;
        // The table leaves the run with its usual policy.
        self.setup.run.set_policy(self.setup.policy(0));
        let rows = vec![
            row(
                "new connection, 1 rule",
                Role::Baseline,
                None,
                None,
                Of::Time(0),
            ),
            row(
                "new connection, 100 rules",
                Role::Runbox,
                None,
                Some(0),
                Of::Time(1),
            ),
            row(
                "new connection, 1000 rules",
                Role::Runbox,
                None,
                Some(0),
                Of::Time(2),
            ),
            row(
                "intercepted HTTPS GET, secret not sent (path outside its prefixes)",
                Role::Baseline,
                None,
                None,
                Of::Time(4),
            ),
            row(
                "intercepted HTTPS GET carrying the brokered secret",
                Role::Runbox,
                None,
                Some(3),
                Of::Time(3),
            ),
        ];
        Ok(Table::new(
            "egress-policy",
            "Egress proxy: what a run's policy costs",
            &format!(
                "Rules: `GET http://{HTTP_HOST}:<port>{PATH}` through the proxy on a new \
                 connection, as in the HTTP table, with the run's policy holding 1, 100 or 1000 \
                 rules, the one that admits the request last (the others `fillerN.bench.test` \
                 on port 443); the policy is swapped in before each sample, untimed. Secret: an \
                 HTTPS GET on a new connection through an intercepting CONNECT (leaf cached), \
                 once on `{PATH}`, where the proxy replaces the placeholder with the secret's \
                 value, and once on `{OTHER_PATH}`, which the secret's prefixes do not cover: \
                 the same work but the injection."
            ),
            warmup,
            iterations,
            fill(rows, &samples),
        )
        .with_added_column())
    }

    /// Table 3: HTTPS GETs, each on a new connection, and leaf minting.
    async fn https(&mut self) -> anyhow::Result<Table> {
        let cases = [
            Case::Https(Https::Direct),
            Case::Https(Https::Blind),
            Case::Https(Https::Intercepted),
            Case::Https(Https::InterceptedNewHost),
            Case::Mint,
        ];
        let (warmup, iterations) = (self.opts.warmup, self.opts.iterations);
        let samples = self.rounds("https", &cases, warmup, iterations).await?;
        let cpu = "CPU time of the proxy runtime's threads";
        let rows = vec![
            row("direct", Role::Baseline, None, None, Of::Time(0)),
            row(
                "blind CONNECT tunnel",
                Role::Runbox,
                None,
                Some(0),
                Of::Time(1),
            ),
            row(cpu, Role::Part, None, None, Of::ProxyCpu(1)),
            row(
                "intercepted CONNECT, leaf cached",
                Role::Runbox,
                None,
                Some(0),
                Of::Time(2),
            ),
            row(cpu, Role::Part, None, None, Of::ProxyCpu(2)),
            row(
                "intercepted CONNECT, first request to a new host",
                Role::Runbox,
                None,
                Some(0),
                Of::Time(3),
            ),
            row(cpu, Role::Part, None, None, Of::ProxyCpu(3)),
            row(
                "minting a leaf alone (`Authority::server_config` of a new host)",
                Role::Reference,
                None,
                None,
                Of::Time(4),
            ),
        ];
        Ok(Table::new(
            "egress-https",
            "Egress proxy: latency of an HTTPS GET on a new connection",
            &format!(
                "`GET {PATH}` with an `Authorization: Bearer <placeholder>` header, answered with \
                 {SMALL_BODY} bytes by a loopback HTTPS server (ECDSA P-256 certificate from a \
                 test CA); timed from the TCP connect to the last body byte, the client's TLS \
                 handshake included; the client never resumes a TLS session. Blind: CONNECT to \
                 a host no secret covers, TLS end to end with the upstream. Intercepted: CONNECT \
                 to a host the secret covers; the client trusts the runbox CA, the proxy \
                 answers with its leaf for the host, opens TLS to the upstream (verified, and \
                 resumed, as in production) and injects the secret. A new host costs, on top, \
                 a DNS lookup, minting its leaf and a full upstream handshake. Minting alone is \
                 timed on the client's thread, outside any request. CPU time: what the worker \
                 threads of the proxy's runtime ran from the start of the sample until the \
                 client had the response."
            ),
            warmup,
            iterations,
            fill(rows, &samples),
        )
        .with_added_column())
    }

    /// Runs `warmup + iterations` rounds of every case, each round in an
    /// order rotated by one, and returns the measured samples per case.
    async fn rounds(
        &mut self,
        name: &str,
        cases: &[Case],
        warmup: usize,
        iterations: usize,
    ) -> anyhow::Result<Vec<Samples>> {
        let mut samples: Vec<Samples> = cases
            .iter()
            .map(|_| Samples {
                took: Vec::with_capacity(iterations),
                proxy_cpu: Vec::with_capacity(iterations),
            })
            .collect();
        let rounds = warmup + iterations;
        let every = (rounds / 10).max(1);
        let started = Instant::now();
        for round in 0..rounds {
            for k in 0..cases.len() {
                let index = (round + k) % cases.len();
                let case = cases[index];
                let cpu_before = self.setup.proxy_cpu();
                let took = tokio::time::timeout(STEP_TIMEOUT, self.step(case))
                    .await
                    .with_context(|| format!("egress {name}, round {round}, {case:?}: timed out"))?
                    .with_context(|| format!("egress {name}, round {round}, {case:?}"))?;
                let cpu = self.setup.proxy_cpu().saturating_sub(cpu_before);
                if round >= warmup {
                    samples[index].took.push(took);
                    samples[index].proxy_cpu.push(cpu);
                }
            }
            if (round + 1) % every == 0 || round + 1 == rounds {
                eprintln!(
                    "runbox-bench: egress {name}: round {}/{rounds} ({warmup} warm-up), {:.0?}",
                    round + 1,
                    started.elapsed()
                );
            }
        }
        Ok(samples)
    }

    /// Runs one case once and returns its time.
    async fn step(&mut self, case: Case) -> anyhow::Result<Duration> {
        match case {
            Case::Transfer { down, via } => self.transfer(down, via).await,
            Case::Get { proxy, keep_alive } => self.get(proxy, keep_alive).await,
            Case::Https(how) => self.https_get(how).await,
            Case::Rules(count) => {
                self.setup.run.set_policy(self.setup.policy(count - 1));
                self.get(true, false).await
            }
            Case::Mint => {
                let host = format!("h{}.{MINT_ALONE_SUFFIX}", self.minted);
                self.minted += 1;
                let start = Instant::now();
                self.setup
                    .authority
                    .server_config(&host)
                    .context("minting a leaf")?;
                Ok(start.elapsed())
            }
        }
    }

    /// One bulk transfer, on a connection of its own.
    async fn transfer(&mut self, down: bool, via: Via) -> anyhow::Result<Duration> {
        let port = self.setup.bulk_port;
        let mut tcp = match via {
            Via::Direct => connect(SocketAddr::from((Ipv4Addr::LOCALHOST, port))).await?,
            Via::Tunnel => open_tunnel(self.setup.proxy, &format!("{BULK_HOST}:{port}")).await?,
            Via::Socks => open_socks(self.setup.socks, BULK_HOST, port).await?,
            Via::Relay => {
                connect(SocketAddr::from((
                    Ipv4Addr::LOCALHOST,
                    self.setup.relay_port,
                )))
                .await?
            }
        };
        let total = self.opts.transfer_bytes;
        let mut request = [0u8; 9];
        request[0] = if down { BULK_DOWN } else { BULK_UP };
        request[1..].copy_from_slice(&total.to_be_bytes());
        let start = Instant::now();
        tcp.write_all(&request).await?;
        if down {
            let mut received = 0u64;
            while received < total {
                let n = tcp.read(&mut self.buf).await?;
                if n == 0 {
                    bail!("the download ended after {received} of {total} bytes");
                }
                received += n as u64;
            }
        } else {
            let mut sent = 0u64;
            while sent < total {
                let len = self
                    .buf
                    .len()
                    .min(usize::try_from(total - sent).unwrap_or(usize::MAX));
                tcp.write_all(&self.buf[..len]).await?;
                sent += len as u64;
            }
            let mut ack = [0u8; 2];
            tcp.read_exact(&mut ack)
                .await
                .context("waiting for the sink's acknowledgement")?;
            ensure!(&ack == BULK_ACK, "the sink answered {ack:?}");
        }
        Ok(start.elapsed())
    }

    /// One plain GET. A keep-alive connection is opened, untimed, by its
    /// first request and reused after.
    async fn get(&mut self, proxy: bool, keep_alive: bool) -> anyhow::Result<Duration> {
        let port = self.setup.http_port;
        let host = format!("{HTTP_HOST}:{port}");
        let (to, uri) = if proxy {
            (self.setup.proxy, format!("http://{host}{PATH}"))
        } else {
            (
                SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
                PATH.to_owned(),
            )
        };
        if keep_alive {
            let slot = if proxy {
                &mut self.proxy_keep_alive
            } else {
                &mut self.direct_keep_alive
            };
            let sender = match slot {
                Some(sender) => sender,
                None => slot.insert(http_handshake(connect(to).await?).await?),
            };
            let start = Instant::now();
            request(sender, &uri, &host, None).await?;
            return Ok(start.elapsed());
        }
        let start = Instant::now();
        let mut sender = http_handshake(connect(to).await?).await?;
        request(&mut sender, &uri, &host, None).await?;
        Ok(start.elapsed())
    }

    /// One HTTPS GET on a new connection.
    async fn https_get(&mut self, how: Https) -> anyhow::Result<Duration> {
        let setup = &self.setup;
        let path = match how {
            Https::InterceptedWithout => OTHER_PATH,
            _ => PATH,
        };
        let (host, proxy, trust) = match how {
            Https::Direct => (INTERCEPT_HOST.to_owned(), false, &setup.upstream_trust),
            Https::Blind => (BLIND_HOST.to_owned(), true, &setup.upstream_trust),
            Https::Intercepted | Https::InterceptedWithout => {
                (INTERCEPT_HOST.to_owned(), true, &setup.runbox_trust)
            }
            Https::InterceptedNewHost => {
                let host = format!("h{}.{NEW_HOST_SUFFIX}", self.new_hosts);
                self.new_hosts += 1;
                (host, true, &setup.runbox_trust)
            }
        };
        let authority = format!("{host}:{}", setup.https_port);
        let name = ServerName::try_from(host)?;
        let connector = tokio_rustls::TlsConnector::from(Arc::clone(trust));
        let start = Instant::now();
        let tcp = if proxy {
            open_tunnel(setup.proxy, &authority).await?
        } else {
            connect(SocketAddr::from((Ipv4Addr::LOCALHOST, setup.https_port))).await?
        };
        let tls = connector
            .connect(name, tcp)
            .await
            .context("TLS handshake")?;
        let mut sender = http_handshake(tls).await?;
        request(&mut sender, path, &authority, Some(&self.auth)).await?;
        Ok(start.elapsed())
    }

    /// Checks that the audit log names the secret on exactly `expected`
    /// requests: every intercepted one, none other.
    fn check_audit(&self, expected: usize) -> anyhow::Result<()> {
        let text = std::fs::read_to_string(&self.setup.audit).context("reading the audit log")?;
        let injected = text
            .lines()
            .filter_map(|line| serde_json::from_str::<AuditRecord>(line).ok())
            .filter(|r| {
                matches!(
                    r,
                    AuditRecord::Egress {
                        secret: Some(_),
                        ..
                    }
                )
            })
            .count();
        ensure!(
            injected == expected,
            "the audit log names the secret on {injected} requests, not on the {expected} \
             intercepted ones: the interception rows did not measure what they say"
        );
        Ok(())
    }
}

/// The samples of one case.
struct Samples {
    /// Wall time.
    took: Vec<Duration>,
    /// CPU time of the proxy's worker threads over the same span.
    proxy_cpu: Vec<Duration>,
}

/// Which samples of a case a row shows.
#[derive(Clone, Copy)]
enum Of {
    /// Case `i`'s wall time.
    Time(usize),
    /// The proxy's CPU time during case `i`.
    ProxyCpu(usize),
}

/// A table row, and which samples go in it.
fn row(
    label: &str,
    role: Role,
    bytes: Option<u64>,
    versus: Option<usize>,
    of: Of,
) -> (TableSeries, Of) {
    let series = Series {
        label: label.to_owned(),
        role,
        runtime: None,
        samples: Vec::new(),
    };
    (
        TableSeries {
            series,
            bytes,
            versus,
        },
        of,
    )
}

/// The rows with their samples put in.
fn fill(rows: Vec<(TableSeries, Of)>, samples: &[Samples]) -> Vec<TableSeries> {
    rows.into_iter()
        .map(|(mut row, of)| {
            row.series.samples = match of {
                Of::Time(i) => samples[i].took.clone(),
                Of::ProxyCpu(i) => samples[i].proxy_cpu.clone(),
            };
            row
        })
        .collect()
}

/// The `schedstat` files of this process's threads named `name`.
fn thread_schedstats(name: &str) -> anyhow::Result<Vec<PathBuf>> {
    let mut found = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").context("listing /proc/self/task")? {
        let dir = task?.path();
        // A thread may end between the listing and the read.
        let Ok(comm) = std::fs::read_to_string(dir.join("comm")) else {
            continue;
        };
        if comm.trim_end() == name {
            found.push(dir.join("schedstat"));
        }
    }
    Ok(found)
}

/// A TCP connection to `to`, without Nagle's delay (as the proxy's own).
async fn connect(to: SocketAddr) -> anyhow::Result<TcpStream> {
    let tcp = TcpStream::connect(to)
        .await
        .with_context(|| format!("connecting to {to}"))?;
    tcp.set_nodelay(true)?;
    Ok(tcp)
}

/// A connection to the proxy with `CONNECT authority` answered by 200: the
/// tunnel, with nothing of it read yet.
async fn open_tunnel(proxy: SocketAddr, authority: &str) -> anyhow::Result<TcpStream> {
    let mut tcp = connect(proxy).await?;
    let request = format!("CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n");
    tcp.write_all(request.as_bytes()).await?;
    // Nothing comes through the tunnel before the client speaks (the
    // upstreams here never speak first), so whatever arrives now is the
    // response head alone.
    let mut head = Vec::with_capacity(256);
    let mut buf = [0u8; 1024];
    let end = loop {
        let n = tcp.read(&mut buf).await?;
        ensure!(
            n > 0,
            "the proxy closed the connection inside the CONNECT response: {:?}",
            String::from_utf8_lossy(&head)
        );
        head.extend_from_slice(&buf[..n]);
        if let Some(end) = head.windows(4).position(|w| w == b"\r\n\r\n") {
            break end + 4;
        }
        ensure!(
            head.len() < 16 * 1024,
            "the CONNECT response head is too long"
        );
    };
    let text = String::from_utf8_lossy(&head);
    ensure!(
        text.starts_with("HTTP/1.1 200"),
        "CONNECT {authority}: {text:?}"
    );
    ensure!(
        end == head.len(),
        "CONNECT {authority}: bytes after the response head"
    );
    Ok(tcp)
}

/// A connection to the SOCKS5 door with a CONNECT to `host:port` (by
/// name) answered "succeeded": the tunnel, with nothing of it read yet.
async fn open_socks(door: SocketAddr, host: &str, port: u16) -> anyhow::Result<TcpStream> {
    let mut tcp = connect(door).await?;
    // Greeting (no authentication), then the request; the door answers
    // each in turn.
    tcp.write_all(&[5, 1, 0]).await?;
    let mut chosen = [0u8; 2];
    tcp.read_exact(&mut chosen).await?;
    ensure!(chosen == [5, 0], "the SOCKS5 door chose {chosen:?}");
    let mut request = vec![5, 1, 0, 3, u8::try_from(host.len())?];
    request.extend_from_slice(host.as_bytes());
    request.extend_from_slice(&port.to_be_bytes());
    tcp.write_all(&request).await?;
    // The reply's bound address is IPv4: 10 bytes in all.
    let mut reply = [0u8; 10];
    tcp.read_exact(&mut reply).await?;
    ensure!(
        reply[..2] == [5, 0] && reply[3] == 1,
        "SOCKS5 CONNECT {host}:{port}: reply {reply:?}"
    );
    Ok(tcp)
}

/// An HTTP/1.1 client handshake on `io`; its connection is driven by a task
/// of its own until the returned sender is dropped.
async fn http_handshake<S>(io: S) -> anyhow::Result<Sender>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
        .await
        .context("HTTP handshake")?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender)
}

/// `GET uri` with `Host: host` (and `Authorization: auth`) on `sender`,
/// until the last body byte; it must be 200 with [`SMALL_BODY`] bytes.
async fn request(
    sender: &mut Sender,
    uri: &str,
    host: &str,
    auth: Option<&str>,
) -> anyhow::Result<()> {
    sender.ready().await.context("the connection closed")?;
    let mut req = Request::get(uri).header(HOST, host);
    if let Some(auth) = auth {
        req = req.header(AUTHORIZATION, auth);
    }
    let response = sender
        .send_request(req.body(Empty::new())?)
        .await
        .with_context(|| format!("GET {uri}"))?;
    let status = response.status();
    let body = response.into_body().collect().await?.to_bytes();
    ensure!(
        status == StatusCode::OK,
        "GET {uri}: {status}: {}",
        String::from_utf8_lossy(&body)
    );
    ensure!(
        body.len() == SMALL_BODY,
        "GET {uri}: {} bytes instead of {SMALL_BODY}",
        body.len()
    );
    Ok(())
}
