//! The network tiers with egress end to end: the real daemon, the real
//! runtime and namespaces, curl inside the run (the client agent runs use),
//! and upstream servers on the host that the daemon's proxy reaches.
//!
//! What stands in for the internet — nothing here contacts a real host:
//! - [`TestDns`] on 127.0.0.1, the only resolver the proxy asks
//!   (`--egress-dns`): `allowed.test`, `secret.test` and `plain-tls.test`
//!   are 127.0.0.1, `internal.test` is 10.0.0.5, `meta.test` is
//!   169.254.169.254 (the last two exist to be refused);
//! - an HTTP and an HTTPS echo server on 127.0.0.1 (random ports), the HTTPS
//!   one with a certificate from a test CA made here, which the daemon
//!   trusts for intercepted hosts (`--egress-ca-bundle`) and the `curl`
//!   image's own bundle holds, as a real image's bundle holds public CAs;
//! - for `.suffix` and bare-host entries (ports 80 and 443 only), the same
//!   servers on 127.0.0.2:80 and :443 when those ports are free.
//!
//! Other names (`example.org`) are only ever asked of the proxy, which
//! refuses them before any lookup, and the refused internal addresses are
//! never connected to.
//!
//! Each daemon admits its loopback upstreams with `--egress-internal-allow`
//! on their ports only, has no built-in list (`--no-default-egress`), and
//! declares one secret, [`SECRET_NAME`], for `secret.test`, GET, paths under
//! `/allowed`, its value in the daemon's environment.
//!
//! The `open` tier is checked from the other side: its runs must reach no
//! address of the host, the API's included, and its links and nftables
//! rules must go with its runs.
//!
//! Every test has its own daemon, DNS and servers. The servers are tasks of
//! the test's runtime and end with it; the daemon's drop tears down every run
//! whatever the test did.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use runbox_e2e::{eventually, host_ipv4, netns_exists, raw_request, TestDaemon};
use runbox_proxy::audit::AuditRecord;
use runbox_proxy::testing::TestDns;
use runbox_types::{
    CreateRunRequest, EgressStats, Env, ErrorCode, ExecRequest, NetworkTier, Run, SecretRequest,
};
use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::net::TcpListener;

/// The one declared secret, as runs ask for it.
const SECRET_NAME: &str = "API_TOKEN";
/// The daemon environment variable holding its value.
const SECRET_ENV: &str = "RUNBOX_E2E_API_TOKEN";
/// The value: it must reach the upstream where policy allows, and never the
/// run, the audit log, the daemon's log or any file of its state.
const SECRET_VALUE: &str = "e2e-v4lue-3c9f1d7a52b8e640";
/// What the echo servers write where they received the value, so that the
/// run never learns it, not even from an echo.
const SECRET_SEEN: &str = "[the secret value]";
/// `runbox-secret:NAME`, what the run holds instead.
const PLACEHOLDER: &str = "runbox-secret:API_TOKEN";
/// The value of a secret a caller brings: like [`SECRET_VALUE`], it must
/// reach only its upstream.
const BROUGHT_VALUE: &str = "brought-8d1e5b0c37f94a26";
/// What the echo servers write where they received it.
const BROUGHT_SEEN: &str = "[the brought value]";

/// The image with curl (see [`runbox_e2e::curl_tar`]).
const IMAGE: &str = "curl";
/// The image's own CA bundle; runbox replaces it in runs with secrets by
/// this bundle plus the interception CA.
const BUNDLE_PATH: &str = "/etc/ssl/certs/ca-certificates.crt";
/// The test CA alone, inside the image.
const TEST_CA_PATH: &str = "/etc/test-ca.pem";
/// The interception CA alone, inside runs with secrets.
const RUNBOX_CA_PATH: &str = "/.runbox/ca.pem";
/// The common name of the test CA.
const TEST_CA_NAME: &str = "runbox e2e test internet CA";
/// The common name of runbox's interception CA.
const RUNBOX_CA_NAME: &str = "runbox egress CA";
/// The proxy's address inside allowlist runs.
const PROXY_URL: &str = "http://127.0.0.1:3128";

/// The test CA and the upstreams' TLS configuration, made once per process.
struct Pki {
    ca_pem: String,
    server: Arc<rustls::ServerConfig>,
}

fn pki() -> &'static Pki {
    static PKI: OnceLock<Pki> = OnceLock::new();
    PKI.get_or_init(|| {
        let ca_key = KeyPair::generate().expect("CA key");
        let mut ca_params = CertificateParams::default();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, TEST_CA_NAME);
        let ca_cert = ca_params.self_signed(&ca_key).expect("CA certificate");
        let issuer = Issuer::new(ca_params, ca_key);
        let leaf_key = KeyPair::generate().expect("leaf key");
        let names = [
            "secret.test",
            "plain-tls.test",
            "wild.test",
            "deep.sub.wild.test",
            "bare.test",
            "brought.test",
        ];
        let leaf = CertificateParams::new(names.map(str::to_owned).to_vec())
            .expect("leaf params")
            .signed_by(&leaf_key, &issuer)
            .expect("leaf certificate");
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let server = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .with_no_client_auth()
            .with_single_cert(
                vec![leaf.der().clone()],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf_key.serialize_der())),
            )
            .expect("TLS server config");
        Pki {
            ca_pem: ca_cert.pem(),
            server: Arc::new(server),
        }
    })
}

/// The `curl` image: busybox, the host's curl, and a CA bundle holding the
/// test CA. Its own bundle rather than the host's: a run's TLS must verify
/// against nothing but what the tests made (the host's public roots have no
/// use here), and finding the test CA in a run's bundle proves runbox kept
/// the image's roots when it added its own.
fn curl_image() -> Vec<u8> {
    static TAR: OnceLock<Vec<u8>> = OnceLock::new();
    TAR.get_or_init(|| {
        let ca = pki().ca_pem.as_bytes();
        runbox_e2e::curl_tar(&[(BUNDLE_PATH, ca), (TEST_CA_PATH, ca)])
    })
    .clone()
}

/// Starts an echo server on `addr` (TLS with the test certificate when
/// `tls`), as a task of the test's runtime; returns its port. `/bytes/N`
/// answers N bytes; anything else answers the method, the path and query,
/// every header as received, and the body's length.
async fn start_echo(addr: SocketAddr, tls: bool) -> std::io::Result<u16> {
    let listener = TcpListener::bind(addr).await?;
    let port = listener.local_addr()?.port();
    let acceptor = tls.then(|| tokio_rustls::TlsAcceptor::from(pki().server.clone()));
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let builder = hyper::server::conn::http1::Builder::new();
                let svc = service_fn(echo);
                match acceptor {
                    Some(acceptor) => {
                        if let Ok(tls) = acceptor.accept(tcp).await {
                            let _ = builder.serve_connection(TokioIo::new(tls), svc).await;
                        }
                    }
                    None => {
                        let _ = builder.serve_connection(TokioIo::new(tcp), svc).await;
                    }
                }
            });
        }
    });
    Ok(port)
}

/// Starts a TLS echo server on port 443 of a loopback address of its own
/// (the port a secret's host is reachable on without an entry); returns
/// the address.
async fn start_echo_on_443() -> IpAddr {
    for _ in 0..64 {
        let ip = IpAddr::V4(Ipv4Addr::new(
            127,
            rand_byte(),
            rand_byte(),
            rand_byte().max(2),
        ));
        if start_echo(SocketAddr::new(ip, 443), true).await.is_ok() {
            return ip;
        }
    }
    panic!("no free loopback address for port 443");
}

/// A byte that differs from call to call (no cryptographic quality needed).
fn rand_byte() -> u8 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::Instant::now()) as u8
}

/// The echo servers' response body: whole, or dripped out over time.
type EchoBody = http_body_util::combinators::BoxBody<Bytes, Infallible>;

async fn echo(req: Request<Incoming>) -> Result<Response<EchoBody>, Infallible> {
    if let Some(n) = req.uri().path().strip_prefix("/bytes/") {
        let n = n.parse::<usize>().unwrap_or(0);
        return Ok(Response::new(Full::new(Bytes::from(vec![b'x'; n])).boxed()));
    }
    // `/drip/N`: N KiB, one every 100 ms (a download that stays open).
    if let Some(n) = req.uri().path().strip_prefix("/drip/") {
        let n = n.parse::<usize>().unwrap_or(0);
        let chunks = futures::stream::unfold(0, move |sent| async move {
            if sent == n {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            let frame = hyper::body::Frame::data(Bytes::from(vec![b'x'; 1024]));
            Some((Ok::<_, Infallible>(frame), sent + 1))
        });
        return Ok(Response::new(
            http_body_util::StreamBody::new(chunks).boxed(),
        ));
    }
    let mut text = format!(
        "{} {}\n",
        req.method(),
        req.uri().path_and_query().map(|p| p.as_str()).unwrap_or("")
    );
    for (name, value) in req.headers() {
        text.push_str(&format!(
            "{name}: {}\n",
            String::from_utf8_lossy(value.as_bytes())
        ));
    }
    let body = req.into_body().collect().await.map(|b| b.to_bytes());
    text.push_str(&format!("body-bytes: {}\n", body.map_or(0, |b| b.len())));
    Ok(Response::new(
        Full::new(Bytes::from(
            text.replace(SECRET_VALUE, SECRET_SEEN)
                .replace(BROUGHT_VALUE, BROUGHT_SEEN),
        ))
        .boxed(),
    ))
}

/// One test's world: a daemon with the `curl` image, its DNS, the loopback
/// upstreams and the files the daemon reads.
struct World {
    daemon: TestDaemon,
    dns: TestDns,
    /// The plain HTTP upstream's port on 127.0.0.1.
    http_port: u16,
    /// The HTTPS upstream's port on 127.0.0.1.
    https_port: u16,
    _files: tempfile::TempDir,
}

impl World {
    /// A daemon on loopback with the common egress settings.
    async fn start() -> World {
        World::start_on("127.0.0.1:0", &[]).await
    }

    /// A daemon listening on `listen` with the common egress settings plus
    /// `extra` serve arguments.
    async fn start_on(listen: &str, extra: &[&str]) -> World {
        World::launch(None, listen, extra, &[]).await
    }

    /// [`World::start_on`] on `runtime` (else the probed one) with
    /// `file_allow` as the config file's `allow`. In `extra` and
    /// `file_allow`, `{http}` and `{https}` stand for the upstreams' ports
    /// (chosen here).
    async fn launch(
        runtime: Option<&str>,
        listen: &str,
        extra: &[&str],
        file_allow: &[&str],
    ) -> World {
        let dns = TestDns::start().await.expect("test DNS");
        let loopback = IpAddr::V4(Ipv4Addr::LOCALHOST);
        for name in ["allowed.test", "secret.test", "plain-tls.test"] {
            dns.set(name, &[loopback], 60);
        }
        dns.set("internal.test", &["10.0.0.5".parse().unwrap()], 60);
        dns.set("meta.test", &["169.254.169.254".parse().unwrap()], 60);
        let any_port = SocketAddr::new(loopback, 0);
        let http_port = start_echo(any_port, false).await.expect("HTTP upstream");
        let https_port = start_echo(any_port, true).await.expect("HTTPS upstream");

        let files = tempfile::tempdir().expect("tempdir");
        let ca = files.path().join("test-ca.pem");
        std::fs::write(&ca, &pki().ca_pem).unwrap();
        let config = files.path().join("egress.json");
        let ports = |s: &str| {
            s.replace("{http}", &http_port.to_string())
                .replace("{https}", &https_port.to_string())
        };
        let file_allow: Vec<String> = file_allow.iter().map(|e| ports(e)).collect();
        let extra: Vec<String> = extra.iter().map(|e| ports(e)).collect();
        let settings = serde_json::json!({"allow": file_allow, "secrets": [{
            "name": SECRET_NAME,
            "header": "Authorization",
            "scheme": "Bearer",
            "valueEnv": SECRET_ENV,
            "hosts": ["secret.test"],
            "methods": ["GET"],
            "pathPrefixes": ["/allowed"],
        }]});
        std::fs::write(&config, settings.to_string()).unwrap();

        let dns_addr = dns.addr().to_string();
        let upstreams = format!("127.0.0.1/32:{http_port},{https_port}");
        let mut args = vec![
            "--no-default-egress",
            "--egress-dns",
            &dns_addr,
            "--egress-internal-allow",
            &upstreams,
            "--egress-ca-bundle",
            ca.to_str().unwrap(),
            "--egress-config",
            config.to_str().unwrap(),
        ];
        args.extend(extra.iter().map(String::as_str));
        let daemon =
            TestDaemon::start_listening(runtime, listen, &args, &[(SECRET_ENV, SECRET_VALUE)])
                .await;
        daemon.import(IMAGE, curl_image()).await;
        World {
            daemon,
            dns,
            http_port,
            https_port,
            _files: files,
        }
    }

    /// The API's port.
    fn api_port(&self) -> u16 {
        self.daemon
            .url
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .expect("API port")
    }

    /// Creates an `allowlist` run of the curl image.
    async fn allowlist_run(&self, allow: &[&str], secrets: &[&str]) -> Run {
        self.daemon
            .create_with(CreateRunRequest {
                image: IMAGE.into(),
                network: Some(NetworkTier::Allowlist),
                egress_allow: Some(allow.iter().map(|s| (*s).into()).collect()),
                secrets: (!secrets.is_empty())
                    .then(|| secrets.iter().map(|s| (*s).into()).collect()),
                ..Default::default()
            })
            .await
    }

    /// Runs curl in run `id` with `args`.
    async fn curl(&self, id: &str, args: &[&str]) -> Curl {
        // -q first: no .curlrc. Without -o the body goes to stdout, followed
        // by the status line -w writes. --max-time bounds a failure only.
        let mut cmd: Vec<String> = ["curl", "-q", "-sS", "--max-time", "30", "-w"]
            .into_iter()
            .map(str::to_owned)
            .collect();
        cmd.push("\n%{http_code} %{http_connect}".to_owned());
        cmd.extend(args.iter().map(|a| a.to_string()));
        let out = self
            .daemon
            .exec(
                id,
                ExecRequest {
                    cmd,
                    ..Default::default()
                },
            )
            .await;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, codes) = stdout.rsplit_once('\n').unwrap_or(("", &stdout));
        let mut codes = codes.split(' ').map(|c| c.parse::<u16>().unwrap_or(0));
        Curl {
            exit: out.exit.exit_code,
            status: codes.next().unwrap_or(0),
            connect_status: codes.next().unwrap_or(0),
            body: body.to_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    /// Runs a shell script in run `id`; returns exit code, stdout, stderr.
    async fn sh(&self, id: &str, script: &str) -> (i32, String, String) {
        let out = self.daemon.sh(id, script).await;
        (
            out.exit.exit_code,
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// The run's egress counters.
    async fn counters(&self, id: &str) -> EgressStats {
        let run = self.daemon.client.get_run(id).await.expect("get run");
        run.egress
            .expect("an allowlist run shows its egress counters")
    }

    /// The audit log's raw text and records, once `until` holds for them
    /// (records are appended as requests finish, so wait for them); the
    /// caller asserts on what it gets.
    async fn audit(&self, until: impl Fn(&[AuditRecord]) -> bool) -> (String, Vec<AuditRecord>) {
        let path = self.daemon.state.path().join("audit.jsonl");
        let read = || {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let records = text
                .lines()
                .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("audit line {l}: {e}")))
                .collect::<Vec<AuditRecord>>();
            (text, records)
        };
        eventually(Duration::from_secs(10), || until(&read().1)).await;
        read()
    }
}

/// What curl reported.
#[derive(Debug)]
struct Curl {
    exit: i32,
    /// The final response's status (0 if none).
    status: u16,
    /// The CONNECT response's status (0 if no CONNECT was made).
    connect_status: u16,
    body: String,
    stderr: String,
}

/// One egress decision of the audit log, without its time.
#[derive(Debug, PartialEq, Eq)]
struct Decision {
    method: String,
    port: u16,
    /// `allow` or `deny`, then the rule: `deny guard:private`.
    outcome: String,
    secret: Option<String>,
}

/// The egress decisions recorded for `host` in run `run`, in order.
fn egress_for(records: &[AuditRecord], run: &str, host: &str) -> Vec<Decision> {
    records
        .iter()
        .filter_map(|r| match r {
            AuditRecord::Egress {
                run: r_run,
                method,
                host: r_host,
                port,
                decision,
                rule,
                secret,
                ..
            } if r_run == run && r_host == host => Some(Decision {
                method: method.clone(),
                port: *port,
                outcome: format!("{decision} {rule}"),
                secret: secret.clone(),
            }),
            _ => None,
        })
        .collect()
}

/// A [`Decision`] without a secret.
fn decision(method: &str, port: u16, outcome: &str) -> Decision {
    Decision {
        method: method.to_owned(),
        port,
        outcome: outcome.to_owned(),
        secret: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allowlisted_hosts_are_reached_through_the_proxy() {
    let w = World::start().await;
    let http = format!("allowed.test:{}", w.http_port);
    let https = format!("plain-tls.test:{}", w.https_port);
    // Duplicates are dropped, the order kept.
    let run = w.allowlist_run(&[&http, &https, &http], &[]).await;
    assert_eq!(run.egress_allow, vec![http.clone(), https.clone()]);
    assert_eq!(run.egress, Some(EgressStats::default()));
    let id = run.id.to_string();

    // Programs in the run are pointed at the proxy on the run's own loopback.
    let (_, env, _) = w.sh(&id, "env").await;
    for var in ["HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"] {
        assert!(env.contains(&format!("{var}={PROXY_URL}\n")), "{env}");
    }
    assert!(env.contains("NO_PROXY="), "{env}");

    // Plain HTTP: absolute-form, no CONNECT.
    let got = w.curl(&id, &[&format!("http://{http}/hello?x=1")]).await;
    assert_eq!((got.status, got.connect_status), (200, 0), "{got:?}");
    assert!(got.body.starts_with("GET /hello?x=1\n"), "{got:?}");
    assert!(got.body.contains(&format!("host: {http}\n")), "{got:?}");
    let got = w
        .curl(
            &id,
            &["--data-binary", "0123456789", &format!("http://{http}/up")],
        )
        .await;
    assert!(got.body.starts_with("POST /up\n"), "{got:?}");
    assert!(got.body.contains("body-bytes: 10\n"), "{got:?}");

    // HTTPS: CONNECT, then the upstream's own certificate (a blind tunnel).
    let got = w
        .curl(
            &id,
            &["--cacert", TEST_CA_PATH, &format!("https://{https}/blind")],
        )
        .await;
    assert_eq!((got.connect_status, got.status), (200, 200), "{got:?}");
    assert!(got.body.starts_with("GET /blind\n"), "{got:?}");

    // The run's counters grow with its traffic.
    let n: u64 = 1 << 20;
    let got = w
        .curl(
            &id,
            &["-o", "/dev/null", &format!("http://{http}/bytes/{n}")],
        )
        .await;
    assert_eq!(got.status, 200, "{got:?}");
    let counters = w.counters(&id).await;
    assert_eq!(counters.requests, 4, "{counters:?}");
    assert!(counters.bytes_down > n, "{counters:?}");
    assert!(counters.bytes_up > 10, "{counters:?}");
    let list = w.daemon.client.list_runs().await.unwrap();
    assert_eq!(list.runs[0].egress, Some(counters));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn denied_destinations_get_403_naming_the_entry_and_the_setting() {
    let w = World::start().await;
    let http = format!("allowed.test:{}", w.http_port);
    let id = w.allowlist_run(&[&http], &[]).await.id.to_string();

    let got = w.curl(&id, &["http://example.org/index.html"]).await;
    assert_eq!(got.status, 403, "{got:?}");
    let body = &got.body;
    assert!(
        body.contains("add \"example.org\" to egressAllow"),
        "{body}"
    );
    assert!(
        body.contains("--egress-allow") && body.contains("RUNBOX_EGRESS_ALLOW"),
        "{body}"
    );
    // Through CONNECT, curl reports the proxy's refusal and stops.
    let got = w.curl(&id, &["https://example.org/"]).await;
    assert_eq!(got.connect_status, 403, "{got:?}");
    assert_ne!(got.exit, 0, "{got:?}");

    // A host:port entry admits that port only, and the refusal names the
    // exact entry that would admit the one asked for.
    let got = w
        .curl(&id, &[&format!("http://allowed.test:{}/", w.https_port)])
        .await;
    assert_eq!(got.status, 403, "{got:?}");
    let entry = format!("add \"allowed.test:{}\" to egressAllow", w.https_port);
    assert!(got.body.contains(&entry), "{got:?}");
    let got = w.curl(&id, &["http://allowed.test/"]).await;
    assert_eq!(got.status, 403, "{got:?}");
    assert!(
        got.body.contains("add \"allowed.test\" to egressAllow"),
        "{got:?}"
    );

    let (_, records) = w
        .audit(|r| egress_for(r, &id, "example.org").len() >= 2)
        .await;
    let denials = egress_for(&records, &id, "example.org");
    assert_eq!(
        denials,
        [
            decision("GET", 80, "deny none"),
            decision("CONNECT", 443, "deny none")
        ],
        "{records:?}"
    );
    assert_eq!(w.counters(&id).await.requests, 4);
    // The metrics count the decisions as the audit log records them.
    let metrics = reqwest::Client::new()
        .get(format!("{}/metrics", w.daemon.url))
        .bearer_auth(&w.daemon.token)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let denied = metrics
        .lines()
        .find_map(|l| {
            l.strip_prefix("runbox_egress_decisions_total{decision=\"deny\",source=\"none\"} ")
        })
        .and_then(|v| v.trim().parse::<f64>().ok());
    assert_eq!(denied, Some(4.0), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deployment_entries_apply_to_every_allowlist_run() {
    let w = World::launch(
        None,
        "127.0.0.1:0",
        &[
            "--egress-allow",
            "allowed.test:{http}, allowed.test:{https}",
        ],
        &["plain-tls.test:{https}"],
    )
    .await;
    let (http, https) = (w.http_port, w.https_port);
    // A run without entries of its own gets the deployment's.
    let run = w.allowlist_run(&[], &[]).await;
    assert!(run.egress_allow.is_empty(), "{run:?}");
    let id = run.id.to_string();
    let got = w
        .curl(&id, &[&format!("http://allowed.test:{http}/flag")])
        .await;
    assert_eq!(got.status, 200, "{got:?}");
    let url = format!("https://plain-tls.test:{https}/file");
    let got = w.curl(&id, &["--cacert", TEST_CA_PATH, &url]).await;
    assert_eq!((got.connect_status, got.status), (200, 200), "{got:?}");
    let got = w.curl(&id, &[&format!("http://secret.test:{http}/")]).await;
    assert_eq!(got.status, 403, "{got:?}");

    // The audit names the list that admitted each request.
    let (_, records) = w
        .audit(|r| {
            egress_for(r, &id, "allowed.test").len() + egress_for(r, &id, "plain-tls.test").len()
                >= 2
        })
        .await;
    assert_eq!(
        egress_for(&records, &id, "allowed.test"),
        [decision(
            "GET",
            http,
            &format!("allow deployment:allowed.test:{http}")
        )],
        "{records:?}"
    );
    assert_eq!(
        egress_for(&records, &id, "plain-tls.test"),
        [decision(
            "CONNECT",
            https,
            &format!("allow deployment:plain-tls.test:{https}")
        )],
        "{records:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_is_the_only_way_out_of_an_allowlist_run() {
    let w = World::start().await;
    let http = format!("allowed.test:{}", w.http_port);
    let id = w.allowlist_run(&[&http], &[]).await.id.to_string();

    // Loopback only, and no route.
    let (_, out, _) = w.sh(&id, "ls /sys/class/net; ip route; ip -6 route").await;
    assert_eq!(out.split_whitespace().collect::<Vec<_>>(), ["lo"], "{out}");

    // Through the proxy it works...
    let got = w.curl(&id, &[&format!("http://{http}/")]).await;
    assert_eq!(got.status, 200, "{got:?}");
    // ...straight to the upstream's address it does not: 127.0.0.1 in the
    // run is the run's own loopback, where only the proxy listens.
    let direct = format!("http://127.0.0.1:{}/", w.http_port);
    let got = w.curl(&id, &["--noproxy", "*", &direct]).await;
    assert_eq!(got.exit, 7, "{got:?}");
    let (code, out, err) = w
        .sh(
            &id,
            &format!("echo hi | nc 127.0.0.1 {}; echo rc=$?", w.http_port),
        )
        .await;
    assert!(
        out.contains("rc=1") && !out.contains("HTTP"),
        "{code} {out} {err}"
    );
    // Nor to any host address: there is no route to one.
    if let Some(host_ip) = host_ipv4() {
        let listener = std::net::TcpListener::bind((host_ip.as_str(), 0)).expect("host listener");
        let port = listener.local_addr().unwrap().port();
        let got = w
            .curl(
                &id,
                &["--noproxy", "*", &format!("http://{host_ip}:{port}/")],
            )
            .await;
        assert_eq!(got.exit, 7, "{got:?}");
    }

    // Names do not resolve in the run; only the proxy resolves.
    let got = w
        .curl(&id, &["--noproxy", "*", &format!("http://{http}/")])
        .await;
    assert_eq!(got.exit, 6, "{got:?}");
    let (code, out, err) = w.sh(&id, "nslookup allowed.test").await;
    assert_ne!(code, 0, "{out} {err}");
    assert!(!out.contains("Address: 127.0.0.1"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn internal_destinations_and_the_api_are_refused() {
    let w = World::start().await;
    let api = w.api_port();
    w.dns
        .set("api.test", &[IpAddr::V4(Ipv4Addr::LOCALHOST)], 60);
    let api_entry = format!("127.0.0.1:{api}");
    let api_name_entry = format!("api.test:{api}");
    // The policy admits every one of these: what refuses them is the guard.
    let id = w
        .allowlist_run(
            &[
                "169.254.169.254",
                "meta.test",
                "internal.test",
                &api_entry,
                &api_name_entry,
            ],
            &[],
        )
        .await
        .id
        .to_string();

    let operator_setting = "--egress-internal-allow";
    let cases = [
        (
            "http://169.254.169.254/latest/meta-data/".to_owned(),
            "169.254.169.254 is a link-local address",
            true,
        ),
        (
            "http://meta.test/".to_owned(),
            "meta.test resolves to 169.254.169.254, a link-local address",
            true,
        ),
        (
            "http://internal.test/".to_owned(),
            "internal.test resolves to 10.0.0.5, a private address",
            true,
        ),
        (
            format!("http://127.0.0.1:{api}/v1/runs"),
            "127.0.0.1 is an endpoint of runbox itself",
            false,
        ),
        (
            format!("http://api.test:{api}/v1/runs"),
            "api.test resolves to 127.0.0.1, an endpoint of runbox itself",
            false,
        ),
    ];
    // NO_PROXY names 127.0.0.1; `--noproxy ''` sends even that through the
    // proxy (directly it is the run's own loopback).
    for (url, says, names_setting) in &cases {
        let got = w.curl(&id, &["--noproxy", "", url]).await;
        assert_eq!(got.status, 403, "{url}: {got:?}");
        assert!(got.body.contains(says), "{url}: {got:?}");
        // No setting admits runbox's own endpoints, so none is named.
        assert_eq!(
            got.body.contains(operator_setting),
            *names_setting,
            "{url}: {got:?}"
        );
    }
    // The same through CONNECT.
    for url in [
        "https://169.254.169.254/".to_owned(),
        "https://internal.test/".to_owned(),
        format!("https://127.0.0.1:{api}/"),
    ] {
        let got = w.curl(&id, &["--noproxy", "", &url]).await;
        assert_eq!(got.connect_status, 403, "{url}: {got:?}");
    }

    let hosts = [
        "169.254.169.254",
        "meta.test",
        "internal.test",
        "127.0.0.1",
        "api.test",
    ];
    let (_, records) = w
        .audit(|r| {
            hosts
                .iter()
                .map(|h| egress_for(r, &id, h).len())
                .sum::<usize>()
                >= 8
        })
        .await;
    let rules = |host: &str| -> Vec<String> {
        egress_for(&records, &id, host)
            .into_iter()
            .map(|d| d.outcome)
            .collect()
    };
    assert_eq!(rules("169.254.169.254"), ["deny guard:link-local"; 2]);
    assert_eq!(rules("meta.test"), ["deny guard:link-local"]);
    assert_eq!(rules("internal.test"), ["deny guard:private"; 2]);
    assert_eq!(rules("127.0.0.1"), ["deny guard:runbox"; 2]);
    assert_eq!(rules("api.test"), ["deny guard:runbox"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_stays_refused_whatever_the_internal_exceptions() {
    // All of loopback, and the unspecified addresses, which connect to the
    // host itself.
    let w = World::start_on(
        "127.0.0.1:0",
        &[
            "--egress-internal-allow",
            "127.0.0.0/8",
            "--egress-internal-allow",
            "0.0.0.0/32",
            "--egress-internal-allow",
            "[::/128]",
        ],
    )
    .await;
    let api = w.api_port();
    let loopback = IpAddr::V4(Ipv4Addr::LOCALHOST);
    w.dns.set("api.test", &[loopback], 60);
    w.dns
        .set("zero.test", &[IpAddr::V4(Ipv4Addr::UNSPECIFIED)], 60);
    let hosts = ["127.0.0.1", "api.test", "0.0.0.0", "zero.test", "[::]"];
    let mut entries: Vec<String> = hosts.iter().map(|h| format!("{h}:{api}")).collect();
    entries.push(format!("127.0.0.1:{}", w.http_port));
    let entries: Vec<&str> = entries.iter().map(String::as_str).collect();
    let id = w.allowlist_run(&entries, &[]).await.id.to_string();

    // The exception admits loopback services...
    let upstream = format!("http://127.0.0.1:{}/", w.http_port);
    let got = w.curl(&id, &["--noproxy", "", &upstream]).await;
    assert_eq!(got.status, 200, "{got:?}");
    // ...but never the API, by address or by name, plain or tunnelled.
    for host in hosts {
        let url = format!("http://{host}:{api}/health");
        let got = w.curl(&id, &["--noproxy", "", &url]).await;
        assert_eq!(got.status, 403, "{url}: {got:?}");
        assert!(
            got.body.contains("an endpoint of runbox itself"),
            "{url}: {got:?}"
        );
        let got = w.curl(&id, &["--noproxy", "", "-p", &url]).await;
        assert_eq!(got.connect_status, 403, "{url}: {got:?}");
        assert!(!got.body.contains("\"ok\""), "{url}: {got:?}");
    }
}

/// Starts echo servers on `ip`:80 (HTTP) and :443 (HTTPS); the error says
/// which port could not be bound.
async fn start_web_ports(ip: IpAddr) -> Result<(), String> {
    for (port, tls) in [(80, false), (443, true)] {
        start_echo(SocketAddr::new(ip, port), tls)
            .await
            .map_err(|e| format!("{ip}:{port}: {e}"))?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suffix_and_bare_host_entries_admit_what_they_say() {
    let second = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
    // A port the guard admits on 127.0.0.2 but no web port: only the
    // policy stands in the way there.
    let other = start_echo(SocketAddr::new(second, 0), false)
        .await
        .expect("upstream on 127.0.0.2");
    let web = start_web_ports(second).await;
    let (internal, target) = match &web {
        Ok(()) => (format!("127.0.0.2/32:80,443,{other}"), second),
        Err(e) => {
            // Without the web ports the names point at a private address
            // the guard refuses: a name the policy admitted then shows the
            // guard's refusal, one it denied the policy's. Nothing is
            // connected to either way.
            eprintln!(
                "cannot bind the web ports on 127.0.0.2 ({e}); checking admission by the guard's \
                 refusal instead of fetching"
            );
            (format!("127.0.0.2/32:{other}"), "10.0.0.7".parse().unwrap())
        }
    };
    let w = World::start_on("127.0.0.1:0", &["--egress-internal-allow", &internal]).await;
    for name in [
        "wild.test",
        "deep.sub.wild.test",
        "notwild.test",
        "wild.test.evil.test",
        "bare.test",
        "sub.bare.test",
    ] {
        w.dns.set(name, &[target], 60);
    }
    let run = w
        .allowlist_run(&[".wild.test", "bare.test", " BARE.test "], &[])
        .await;
    // Canonical: trimmed and lowercase, so the duplicate went.
    assert_eq!(run.egress_allow, [".wild.test", "bare.test"]);
    let id = run.id.to_string();

    let admitted = [
        "http://wild.test/a",
        "http://deep.sub.wild.test/b",
        "https://deep.sub.wild.test/c",
        "http://bare.test/d",
        "https://bare.test/e",
    ];
    for url in admitted {
        let got = w.curl(&id, &["--cacert", TEST_CA_PATH, url]).await;
        if web.is_ok() {
            assert_eq!(got.status, 200, "{url}: {got:?}");
            let path = &url[url.rfind('/').unwrap()..];
            assert!(
                got.body.starts_with(&format!("GET {path}\n")),
                "{url}: {got:?}"
            );
        } else if url.starts_with("https") {
            assert_eq!(got.connect_status, 403, "{url}: {got:?}");
        } else {
            assert_eq!(got.status, 403, "{url}: {got:?}");
            assert!(got.body.contains("a private address"), "{url}: {got:?}");
        }
    }
    let denied = [
        ("http://notwild.test/".to_owned(), "notwild.test".to_owned()),
        (
            "http://wild.test.evil.test/".to_owned(),
            "wild.test.evil.test".to_owned(),
        ),
        // A bare host is that host only, on 80 and 443 only.
        (
            "http://sub.bare.test/".to_owned(),
            "sub.bare.test".to_owned(),
        ),
        (
            format!("http://bare.test:{other}/"),
            format!("bare.test:{other}"),
        ),
        (
            format!("http://deep.sub.wild.test:{other}/"),
            format!("deep.sub.wild.test:{other}"),
        ),
    ];
    for (url, entry) in &denied {
        let got = w.curl(&id, &[url]).await;
        assert_eq!(got.status, 403, "{url}: {got:?}");
        assert!(
            got.body
                .contains(&format!("add \"{entry}\" to egressAllow")),
            "{url}: {got:?}"
        );
    }
}

/// POSTs `body` to /v1/runs and returns status, error code and message.
async fn create_raw(w: &World, body: serde_json::Value) -> (u16, String, String) {
    let (status, text) = raw_request(
        &w.daemon.url,
        "POST",
        "/v1/runs",
        &w.daemon.token,
        body.to_string().as_bytes(),
    )
    .await;
    let v: serde_json::Value =
        serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}"));
    (
        status,
        v["error"]["code"].as_str().unwrap_or_default().to_owned(),
        v["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_or_misplaced_egress_requests_are_refused() {
    let w = World::start().await;
    for entry in [
        "https://example.org",
        "a.*.example.org",
        "example.org/path",
        "user@example.org",
        "example.org:0",
        "example.org:65536",
        "two words",
        "",
        ".com",
    ] {
        let (status, code, message) = create_raw(
            &w,
            serde_json::json!({"image": IMAGE, "network": "allowlist", "egressAllow": ["ok.test", entry]}),
        )
        .await;
        assert_eq!(
            (status, code.as_str()),
            (400, ErrorCode::BadEgressEntry.as_str()),
            "{entry:?}: {message}"
        );
        // The message names the entry.
        assert!(
            message.contains(&format!("{entry:?}")),
            "{entry:?}: {message}"
        );
    }
    let (status, code, _) = create_raw(
        &w,
        serde_json::json!({"image": IMAGE, "network": "allowlist", "egressAllow": "ok.test"}),
    )
    .await;
    assert_eq!((status, code.as_str()), (400, "bad_request"));

    // egressAllow and secrets belong to the allowlist tier; elsewhere they
    // are refused, not ignored (an empty list included).
    for network in ["none", "open"] {
        for field in [
            serde_json::json!({"egressAllow": ["ok.test"]}),
            serde_json::json!({"egressAllow": []}),
            serde_json::json!({"secrets": [SECRET_NAME]}),
        ] {
            let mut body = serde_json::json!({"image": IMAGE, "network": network});
            body.as_object_mut()
                .unwrap()
                .extend(field.as_object().unwrap().clone());
            let (status, code, message) = create_raw(&w, body.clone()).await;
            assert_eq!(
                (status, code.as_str()),
                (400, ErrorCode::BadEgress.as_str()),
                "{body}: {message}"
            );
            assert!(message.contains("allowlist"), "{message}");
        }
    }

    // An undeclared secret: the message names it and what is declared.
    let (status, code, message) = create_raw(
        &w,
        serde_json::json!({"image": IMAGE, "network": "allowlist", "secrets": ["NOPE"]}),
    )
    .await;
    assert_eq!(
        (status, code.as_str()),
        (400, ErrorCode::UnknownSecret.as_str())
    );
    assert!(
        message.contains("NOPE") && message.contains(SECRET_NAME),
        "{message}"
    );

    // Too many entries.
    let many: Vec<String> = (0..257).map(|i| format!("h{i}.test")).collect();
    let (status, code, message) = create_raw(
        &w,
        serde_json::json!({"image": IMAGE, "network": "allowlist", "egressAllow": many}),
    )
    .await;
    assert_eq!(
        (status, code.as_str()),
        (400, ErrorCode::BadEgress.as_str()),
        "{message}"
    );

    // Secrets a caller brings: each malformed part is a 400 naming the
    // field, never the value; a wrong shape is the JSON's own error.
    let good = serde_json::json!({"name": "MINE", "value": BROUGHT_VALUE,
        "hosts": ["brought.test"], "header": "X-Key", "methods": ["GET"], "pathPrefixes": ["/"]});
    let with = |key: &str, value: serde_json::Value| {
        let mut secret = good.clone();
        secret[key] = value;
        secret
    };
    let value_with = |bad: &str| with("value", serde_json::json!(format!("{BROUGHT_VALUE}{bad}")));
    let cases = [
        (
            with("name", "mine".into()),
            "bad_secret",
            "environment variable",
        ),
        (with("name", SECRET_NAME.into()), "bad_secret", "declared"),
        (
            with("name", "HTTPS_PROXY".into()),
            "bad_secret",
            "set by runbox",
        ),
        (
            with("header", "Host".into()),
            "bad_secret",
            "managed by the proxy",
        ),
        (with("header", "X Key".into()), "bad_secret", "header name"),
        (
            with("hosts", serde_json::json!([])),
            "bad_secret",
            "no hosts",
        ),
        (
            with("hosts", serde_json::json!(["brought.test:443"])),
            "bad_secret",
            "no port",
        ),
        (
            with("methods", serde_json::json!(["GE T"])),
            "bad_secret",
            "HTTP method",
        ),
        (
            with("pathPrefixes", serde_json::json!(["/a/../b"])),
            "bad_secret",
            "dot segment",
        ),
        (
            with("scheme", "Bearer token".into()),
            "bad_secret",
            "single word",
        ),
        (
            value_with("\r\nX-Evil: 1"),
            "bad_secret",
            "control character",
        ),
        (value_with("\u{1}"), "bad_secret", "control character"),
        (value_with("\t"), "bad_secret", "control character"),
        (value_with("\u{7f}"), "bad_secret", "control character"),
        (
            with("header", "X".repeat(10_000).into()),
            "bad_secret",
            "at most 128",
        ),
        (with("value", "".into()), "bad_secret", "empty"),
        (with("value", "x".repeat(8193).into()), "bad_secret", "8192"),
        (
            with("extra", 1.into()),
            "bad_request",
            "unknown field `extra`",
        ),
        (with("value", 7.into()), "bad_request", "secrets"),
    ];
    for (secret, want, says) in cases {
        let body = serde_json::json!({"image": IMAGE, "network": "allowlist", "secrets": [secret]});
        let (status, code, message) = create_raw(&w, body).await;
        assert_eq!((status, code.as_str()), (400, want), "{secret}: {message}");
        assert!(message.contains(says), "{secret}: {message}");
        assert!(!message.contains(BROUGHT_VALUE), "{message}");
    }
    let body = serde_json::json!({"image": IMAGE, "network": "allowlist",
        "secrets": [good.clone(), good.clone()]});
    let (status, code, message) = create_raw(&w, body).await;
    assert_eq!((status, code.as_str()), (400, "bad_secret"), "{message}");
    let body = serde_json::json!({"image": IMAGE, "network": "none", "secrets": [good.clone()]});
    let (status, code, _) = create_raw(&w, body).await;
    assert_eq!((status, code.as_str()), (400, "bad_egress"));
    let holding = files_holding(w.daemon.state.path(), BROUGHT_VALUE.as_bytes());
    assert!(holding.is_empty(), "the value is in {holding:?}");

    assert!(w.daemon.client.list_runs().await.unwrap().runs.is_empty());
    // Refused creates are audited like the others.
    let (_, records) = w
        .audit(|r| {
            r.iter()
                .filter(|r| matches!(r, AuditRecord::Api { status: 400, .. }))
                .count()
                >= 39
        })
        .await;
    let refused = records
        .iter()
        .filter(|r| {
            matches!(r, AuditRecord::Api { method, path, status: 400, run: None, .. }
                if method == "POST" && path == "/v1/runs")
        })
        .count();
    assert_eq!(refused, 39, "{records:?}");

    // Without the fields, a `none` run has no proxy, no proxy variables
    // and no counters.
    let run = w
        .daemon
        .create_with(CreateRunRequest {
            image: IMAGE.into(),
            ..Default::default()
        })
        .await;
    assert_eq!(run.network, NetworkTier::None);
    assert_eq!(run.egress, None);
    let (_, env, _) = w.sh(&run.id.to_string(), "env").await;
    assert!(!env.to_ascii_lowercase().contains("proxy"), "{env}");
}

/// Runs `runbox serve` with `args` and `env` on a fresh state directory and
/// returns its stderr, asserting that it exits with an error before it
/// serves. (If it served, it is killed and the test fails.)
async fn serve_refuses(args: &[&str], env: &[(&str, &str)]) -> String {
    let state = tempfile::tempdir().unwrap();
    let stderr_path = state.path().join("stderr");
    let mut cmd = Command::new(runbox_e2e::runbox_bin());
    cmd.arg("serve")
        .arg("--listen")
        .arg("127.0.0.1:0")
        .arg("--state-dir")
        .arg(state.path())
        .arg("--agent")
        .arg(runbox_e2e::agent_bin())
        // A table name of its own, though a refused start creates none.
        .args(["--nft-table", "rbxt_refused"])
        // No run store of its own: a start refused after making one would
        // leave it mounted under a directory the test then deletes.
        .args(["--storage-gb", "0"])
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr_path).unwrap());
    // The test's own environment must not add a setting.
    for var in [
        "RUNBOX_EGRESS_ALLOW",
        "RUNBOX_EGRESS_CONFIG",
        "RUNBOX_EGRESS_DNS",
        "RUNBOX_EGRESS_CA_BUNDLE",
        "RUNBOX_NO_DEFAULT_EGRESS",
    ] {
        cmd.env_remove(var);
    }
    cmd.envs(env.iter().copied());
    let mut child = cmd.spawn().expect("runbox serve");
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for runbox serve") {
            break status;
        }
        if state.path().join("serve.addr").exists() {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "runbox serve {args:?} {env:?} started serving; stderr:\n{}",
                std::fs::read_to_string(&stderr_path).unwrap_or_default()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let stderr = std::fs::read_to_string(&stderr_path).unwrap_or_default();
    assert!(!status.success(), "{args:?} {env:?}: {stderr}");
    stderr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_deployment_settings_stop_the_start() {
    let files = tempfile::tempdir().unwrap();
    let write = |name: &str, json: serde_json::Value| {
        let path = files.path().join(name);
        std::fs::write(&path, json.to_string()).unwrap();
        path.to_str().unwrap().to_owned()
    };
    let misspelt = write("misspelt.json", serde_json::json!({"allowed": ["ok.test"]}));
    let unset = write(
        "unset.json",
        serde_json::json!({"secrets": [{
            "name": SECRET_NAME, "header": "Authorization", "valueEnv": "RUNBOX_E2E_NOT_SET",
            "hosts": ["secret.test"], "methods": ["GET"], "pathPrefixes": ["/"],
        }]}),
    );
    let bad_upstream = write(
        "upstream.json",
        serde_json::json!({"upstream": {"allow": [".com"]}}),
    );
    // (serve arguments, environment, what stderr must say)
    type Case<'a> = (Vec<&'a str>, Vec<(&'a str, &'a str)>, Vec<&'a str>);
    let cases: Vec<Case> = vec![
        (
            vec!["--egress-allow", ".com"],
            vec![],
            vec!["--egress-allow", "RUNBOX_EGRESS_ALLOW", ".com"],
        ),
        (
            vec![],
            vec![("RUNBOX_EGRESS_ALLOW", "ok.test, https://example.org")],
            vec!["RUNBOX_EGRESS_ALLOW", "https://example.org"],
        ),
        (
            vec!["--egress-internal-allow", "10.0.0.0/33"],
            vec![],
            vec!["--egress-internal-allow"],
        ),
        (
            vec!["--egress-config", &misspelt],
            vec![],
            vec!["misspelt.json", "unknown field"],
        ),
        (
            vec!["--egress-config", &unset],
            vec![],
            vec![SECRET_NAME, "RUNBOX_E2E_NOT_SET"],
        ),
        (
            vec!["--egress-upstream-allow", "a b"],
            vec![],
            vec!["--egress-upstream-allow", "a b"],
        ),
        (
            vec!["--egress-config", &bad_upstream],
            vec![],
            vec!["upstream.allow", ".com"],
        ),
        (
            vec![],
            vec![("RUNBOX_EGRESS_UPSTREAM", "ftp://u:pw-s3@proxy.test:21")],
            vec!["--egress-upstream", "\"ftp\" is not served"],
        ),
        (
            vec![],
            vec![("RUNBOX_EGRESS_UPSTREAM", "socks5://u:pw-s3@proxy.test")],
            vec!["needs a port"],
        ),
    ];
    for (args, env, says) in cases {
        let stderr = serve_refuses(&args, &env).await;
        assert!(!stderr.contains("pw-s3"), "a password in\n{stderr}");
        for s in says {
            assert!(
                stderr.contains(s),
                "{args:?} {env:?}: expected {s:?} in\n{stderr}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_reach_their_requests_only_and_never_the_run() {
    let w = World::start().await;
    let https = format!("secret.test:{}", w.https_port);
    let http = format!("secret.test:{}", w.http_port);
    let run = w.allowlist_run(&[&https, &http], &[SECRET_NAME]).await;
    assert_eq!(run.secrets, [SECRET_NAME]);
    let id = run.id.to_string();

    // The run holds the placeholder and uses it as it would the value.
    let (_, token, _) = w.sh(&id, &format!("printf %s \"${SECRET_NAME}\"")).await;
    assert_eq!(token, PLACEHOLDER);
    let auth = format!("Authorization: Bearer {token}");
    let injected = format!("authorization: Bearer {SECRET_SEEN}\n");
    let untouched = format!("authorization: Bearer {PLACEHOLDER}\n");
    let base = format!("https://{https}");

    // The allowed method and path: the value, in its header and nowhere
    // else (another header with the placeholder keeps the placeholder).
    let got = w
        .curl(
            &id,
            &[
                "-H",
                &auth,
                "-H",
                &format!("X-Other: {PLACEHOLDER}"),
                &format!("{base}/allowed/x?q=1"),
            ],
        )
        .await;
    assert_eq!(got.status, 200, "{got:?}");
    assert!(got.body.starts_with("GET /allowed/x?q=1\n"), "{got:?}");
    assert!(got.body.contains(&injected), "{got:?}");
    assert_eq!(got.body.matches(SECRET_SEEN).count(), 1, "{got:?}");
    assert!(
        got.body.contains(&format!("x-other: {PLACEHOLDER}\n")),
        "{got:?}"
    );
    // Without the header at all, the proxy writes it.
    let got = w.curl(&id, &[&format!("{base}/allowed")]).await;
    assert!(got.body.contains(&injected), "{got:?}");

    // Another method, another path, a path that only starts like the
    // prefix, one that leaves it through a dot segment, plain HTTP: the
    // placeholder, never the value.
    let post = format!("{base}/allowed");
    let others: [&[&str]; 5] = [
        &["-d", "x", &post],
        &[&format!("{base}/other")],
        &[&format!("{base}/allowedness")],
        &[&format!("{base}/allowed/../other")],
        &[&format!("http://{http}/allowed")],
    ];
    for args in others {
        let mut full: Vec<&str> = vec!["--path-as-is", "-H", &auth];
        full.extend_from_slice(args);
        let got = w.curl(&id, &full).await;
        assert_eq!(got.status, 200, "{args:?}: {got:?}");
        assert!(got.body.contains(&untouched), "{args:?}: {got:?}");
        assert!(!got.body.contains(SECRET_SEEN), "{args:?}: {got:?}");
    }

    // Inside the run: the environment, every process's environment and
    // every file hold the placeholder only. The value is searched for in
    // two halves joined by the shell, so it never crosses the API whole;
    // a file holding the placeholder shows that the search finds files.
    let (half_a, half_b) = SECRET_VALUE.split_at(SECRET_VALUE.len() / 2);
    let script = format!(
        r#"printf %s "${SECRET_NAME}" > /tmp/control
search() {{ find / \( -path /proc -o -path /sys \) -prune -o -type f -exec grep -l -F -e "$1" {{}} + 2>/dev/null; }}
echo "files with the value: $(search "$A$B" | tr '\n' ' ')"
echo "files with the placeholder: $(search "${SECRET_NAME}" | tr '\n' ' ')"
echo "environs with the value: $(cat /proc/[0-9]*/environ 2>/dev/null | tr '\0' '\n' | grep -c -F -e "$A$B")"
echo "environs with the placeholder: $(cat /proc/[0-9]*/environ 2>/dev/null | tr '\0' '\n' | grep -c -F -e "{SECRET_NAME}=${SECRET_NAME}")"
echo "env: $(env | grep -F -e "$A$B" -e "{SECRET_NAME}=")"
"#
    );
    let out = w
        .daemon
        .exec(
            &id,
            ExecRequest {
                cmd: vec!["sh".into(), "-c".into(), script],
                env: Some(Env(BTreeMap::from([
                    ("A".to_owned(), half_a.to_owned()),
                    ("B".to_owned(), half_b.to_owned()),
                ]))),
                ..Default::default()
            },
        )
        .await;
    let report = String::from_utf8_lossy(&out.stdout);
    let line = |prefix: &str| -> String {
        report
            .lines()
            .find_map(|l| l.strip_prefix(prefix))
            .unwrap_or_else(|| panic!("{prefix} missing: {report}"))
            .trim()
            .to_owned()
    };
    assert_eq!(line("files with the value:"), "", "{report}");
    assert_eq!(
        line("files with the placeholder:"),
        "/tmp/control",
        "{report}"
    );
    assert_eq!(line("environs with the value:"), "0", "{report}");
    assert_ne!(line("environs with the placeholder:"), "0", "{report}");
    assert_eq!(
        line("env:"),
        format!("{SECRET_NAME}={PLACEHOLDER}"),
        "{report}"
    );

    // On the host: nothing under the daemon's state directory holds the
    // value — the run's writable layer, its files, the database, the
    // audit log, the daemon's own log.
    let upper = w
        .daemon
        .state
        .path()
        .join("runs")
        .join(&id)
        .join("disk/upper");
    assert!(upper.join("tmp/control").is_file(), "{}", upper.display());
    let holding = files_holding(w.daemon.state.path(), SECRET_VALUE.as_bytes());
    assert!(holding.is_empty(), "the value is in {holding:?}");

    // The audit log: one record per request to secret.test, naming the
    // secret where it was injected and never its value.
    let (text, records) = w
        .audit(|r| {
            egress_for(r, &id, "secret.test").len() >= 7
                && r.iter()
                    .any(|r| matches!(r, AuditRecord::Api { status: 201, .. }))
        })
        .await;
    assert!(!text.contains(SECRET_VALUE), "{text}");
    let (tls, plain) = (w.https_port, w.http_port);
    let tls_rule = format!("allow run:secret.test:{tls}");
    let plain_rule = format!("allow run:secret.test:{plain}");
    let injected = |method: &str| Decision {
        secret: Some(SECRET_NAME.to_owned()),
        ..decision(method, tls, &tls_rule)
    };
    assert_eq!(
        egress_for(&records, &id, "secret.test"),
        [
            injected("GET"),
            injected("GET"),
            decision("POST", tls, &tls_rule),
            decision("GET", tls, &tls_rule),
            decision("GET", tls, &tls_rule),
            decision("GET", tls, &tls_rule),
            decision("GET", plain, &plain_rule),
        ],
        "{records:?}"
    );
    assert!(
        records.iter().any(|r| matches!(r,
            AuditRecord::Api { method, path, status: 201, run: Some(made), .. }
                if method == "POST" && path == "/v1/runs" && *made == id)),
        "{records:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_and_their_trust_files_work_on_every_runtime() {
    let runtimes = runbox_e2e::runtimes();
    assert!(!runtimes.is_empty(), "neither runc nor crun is installed");
    for runtime in runtimes {
        let w = World::launch(Some(&runtime), "127.0.0.1:0", &[], &[]).await;
        let secret = format!("secret.test:{}", w.https_port);
        let run = w.allowlist_run(&[&secret], &[SECRET_NAME]).await;
        assert_eq!(run.runtime, runtime);
        let id = run.id.to_string();
        let got = w.curl(&id, &[&format!("https://{secret}/allowed")]).await;
        assert_eq!(got.status, 200, "{runtime}: {got:?}");
        let injected = format!("authorization: Bearer {SECRET_SEEN}\n");
        assert!(got.body.contains(&injected), "{runtime}: {got:?}");
        // The trust files are the daemon's: read-only in the run.
        let (code, out, err) = w
            .sh(
                &id,
                &format!("echo x >> {BUNDLE_PATH} || echo x >> {RUNBOX_CA_PATH} || echo refused"),
            )
            .await;
        assert_eq!((code, out.as_str()), (0, "refused\n"), "{runtime}: {err}");

        // An image without a bundle of its own (busybox) gets the runbox
        // CA alone as its bundle.
        let bare = w
            .daemon
            .create_with(CreateRunRequest {
                image: "base".into(),
                network: Some(NetworkTier::Allowlist),
                egress_allow: Some(vec![secret.clone().into()]),
                secrets: Some(vec![SECRET_NAME.into()]),
                ..Default::default()
            })
            .await
            .id
            .to_string();
        let (_, bundle, err) = w.sh(&bare, &format!("cat {BUNDLE_PATH}")).await;
        let (_, runbox_ca, _) = w.sh(&bare, &format!("cat {RUNBOX_CA_PATH}")).await;
        assert!(runbox_ca.contains("BEGIN CERTIFICATE"), "{runtime}: {err}");
        assert_eq!(bundle.trim(), runbox_ca.trim(), "{runtime}");
    }
}

/// Regular files under `dir` (symlinks not followed) whose contents hold
/// `needle`.
fn files_holding(dir: &Path, needle: &[u8]) -> Vec<String> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let Ok(kind) = entry.file_type() else {
                continue;
            };
            let path = entry.path();
            if kind.is_dir() {
                stack.push(path);
            } else if entry.file_name() == "storage.img" {
                // The run store's image: its files are read through its
                // mount at runs/, and it is gigabytes of sparse zeroes.
                continue;
            } else if kind.is_file() {
                let data = std::fs::read(&path).unwrap_or_default();
                if data.windows(needle.len()).any(|w| w == needle) {
                    found.push(path.display().to_string());
                }
            }
        }
    }
    found
}

/// The issuer of the server certificate in `curl -v`'s output.
fn issuer_line(verbose: &str) -> &str {
    verbose
        .lines()
        .find(|l| l.trim_start_matches(['*', ' ']).starts_with("issuer:"))
        .unwrap_or("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_is_intercepted_only_for_the_hosts_of_a_requested_secret() {
    let w = World::start().await;
    let secret = format!("https://secret.test:{}/", w.https_port);
    let plain = format!("https://plain-tls.test:{}/", w.https_port);
    let entries = [
        format!("secret.test:{}", w.https_port),
        format!("plain-tls.test:{}", w.https_port),
    ];
    let entries: Vec<&str> = entries.iter().map(String::as_str).collect();
    let with = w
        .allowlist_run(&entries, &[SECRET_NAME])
        .await
        .id
        .to_string();

    // The run's default trust is the image's bundle plus the runbox CA.
    let (_, bundle, _) = w.sh(&with, &format!("cat {BUNDLE_PATH}")).await;
    let (_, runbox_ca, _) = w.sh(&with, &format!("cat {RUNBOX_CA_PATH}")).await;
    assert!(runbox_ca.contains("BEGIN CERTIFICATE"), "{runbox_ca}");
    assert!(bundle.contains(pki().ca_pem.trim()), "{bundle}");
    assert!(bundle.contains(runbox_ca.trim()), "{bundle}");
    let (_, env, _) = w.sh(&with, "env").await;
    for var in ["SSL_CERT_FILE", "CURL_CA_BUNDLE", "REQUESTS_CA_BUNDLE"] {
        assert!(env.contains(&format!("{var}={BUNDLE_PATH}\n")), "{env}");
    }

    // secret.test is intercepted: its certificate comes from the runbox CA,
    // so the test CA alone does not verify it and the default trust does.
    let cases = [
        (&secret, None, true, RUNBOX_CA_NAME),
        (&secret, Some(RUNBOX_CA_PATH), true, RUNBOX_CA_NAME),
        (&secret, Some(TEST_CA_PATH), false, RUNBOX_CA_NAME),
        // plain-tls.test is a blind tunnel: the upstream's own certificate.
        (&plain, None, true, TEST_CA_NAME),
        (&plain, Some(TEST_CA_PATH), true, TEST_CA_NAME),
        (&plain, Some(RUNBOX_CA_PATH), false, TEST_CA_NAME),
    ];
    for (url, ca, verifies, issuer) in cases {
        let mut args = vec!["-v"];
        if let Some(ca) = ca {
            args.extend(["--cacert", ca]);
        }
        args.push(url);
        let got = w.curl(&with, &args).await;
        assert_eq!(got.connect_status, 200, "{url} {ca:?}: {got:?}");
        if verifies {
            assert_eq!(got.status, 200, "{url} {ca:?}: {got:?}");
            assert!(
                issuer_line(&got.stderr).contains(&format!("CN={issuer}")),
                "{url} {ca:?}: {}",
                got.stderr
            );
        } else {
            // CURLE_PEER_FAILED_VERIFICATION
            assert_eq!(got.exit, 60, "{url} {ca:?}: {got:?}");
        }
    }

    // A run that did not ask for the secret gets no interception; like
    // every allowlist run it trusts runbox's CA beside the image's roots
    // (so a secret given to it later works). A `none` run has the image's
    // bundle alone and no runbox CA.
    let without = w.allowlist_run(&entries, &[]).await.id.to_string();
    let got = w
        .curl(&without, &["-v", "--cacert", TEST_CA_PATH, &secret])
        .await;
    assert_eq!(got.status, 200, "{got:?}");
    let test_ca = format!("CN={TEST_CA_NAME}");
    assert!(issuer_line(&got.stderr).contains(&test_ca), "{got:?}");
    let (_, bundle, _) = w.sh(&without, &format!("cat {BUNDLE_PATH}")).await;
    assert!(
        bundle.starts_with(&pki().ca_pem) && bundle.len() > pki().ca_pem.len(),
        "{bundle}"
    );
    let (code, _, _) = w.sh(&without, &format!("test -e {RUNBOX_CA_PATH}")).await;
    assert_eq!(code, 0, "{RUNBOX_CA_PATH} is missing in an allowlist run");
    let closed = run_on(&w, NetworkTier::None).await;
    let (_, bundle, _) = w.sh(&closed, &format!("cat {BUNDLE_PATH}")).await;
    assert_eq!(bundle, pki().ca_pem);
    let (code, _, _) = w.sh(&closed, &format!("test -e {RUNBOX_CA_PATH}")).await;
    assert_ne!(code, 0, "{RUNBOX_CA_PATH} exists in a none run");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allowlist_runs_keep_their_proxy_across_a_daemon_restart() {
    let mut w = World::start().await;
    let http = format!("allowed.test:{}", w.http_port);
    let id = w.allowlist_run(&[&http], &[]).await.id.to_string();
    let secret = format!("secret.test:{}", w.https_port);
    let with_secret = w
        .allowlist_run(&[&secret], &[SECRET_NAME])
        .await
        .id
        .to_string();
    let url = format!("http://{http}/before");
    assert_eq!(w.curl(&id, &[&url]).await.status, 200);
    assert_eq!(w.counters(&id).await.requests, 1);

    w.daemon.kill9();
    w.daemon.spawn().await;
    // The re-adopted runs get their proxies back with the same policy and
    // secrets; counters start again with the daemon.
    assert_eq!(w.counters(&id).await, EgressStats::default());
    let got = w.curl(&id, &[&format!("http://{http}/after")]).await;
    assert_eq!(got.status, 200, "{got:?}; log:\n{}", w.daemon.log());
    assert!(got.body.starts_with("GET /after\n"), "{got:?}");
    let got = w.curl(&id, &["http://example.org/"]).await;
    assert_eq!(got.status, 403, "{got:?}");
    assert_eq!(w.counters(&id).await.requests, 2);
    // Interception (the run's default trust verifies it) and injection.
    let got = w
        .curl(&with_secret, &[&format!("https://{secret}/allowed")])
        .await;
    assert_eq!(got.status, 200, "{got:?}; log:\n{}", w.daemon.log());
    assert!(
        got.body
            .contains(&format!("authorization: Bearer {SECRET_SEEN}\n")),
        "{got:?}"
    );
}

/// The secret a caller brings in [`brought_secrets_reach_their_host_method_and_path_only`].
fn vendor_key() -> SecretRequest {
    SecretRequest::Brought(runbox_types::BroughtSecret {
        name: "VENDOR_KEY".into(),
        value: runbox_types::SecretValue::new(BROUGHT_VALUE),
        // Spelt loosely: the server keeps the canonical form.
        hosts: vec!["Brought.Test.".into()],
        header: "X-Api-Key".into(),
        scheme: None,
        methods: Some(vec!["get".into(), "PUT".into()]),
        path_prefixes: Some(vec!["/v1/".into()]),
    })
}

/// Checks, in run `id`, that the brought secret goes out on its host's
/// allowed methods and paths only; returns how many requests it made.
async fn check_vendor_key(w: &World, id: &str) -> usize {
    let (_, token, _) = w.sh(id, "printf %s \"$VENDOR_KEY\"").await;
    assert_eq!(token, "runbox-secret:VENDOR_KEY");
    let header = format!("X-Api-Key: {token}");
    let injected = format!("x-api-key: {BROUGHT_SEEN}\n");
    let untouched = "x-api-key: runbox-secret:VENDOR_KEY\n";
    // Its host is reachable without an egressAllow entry, on 443.
    let allowed: [&[&str]; 3] = [
        &["-H", &header, "https://brought.test/v1/items?page=2"],
        // No header at all: the proxy writes it (no scheme: the value alone).
        &["https://brought.test/v1/items"],
        &[
            "-X",
            "PUT",
            "-H",
            &header,
            "https://brought.test/v1/items/7",
        ],
    ];
    for args in allowed {
        let got = w.curl(id, args).await;
        assert_eq!(
            got.status,
            200,
            "{args:?}: {got:?}; log:\n{}",
            w.daemon.log()
        );
        assert!(got.body.contains(&injected), "{args:?}: {got:?}");
    }
    // Another method, a path outside the prefix, the prefix without its
    // slash, a dot segment out of it: the placeholder, never the value.
    let refused: [&[&str]; 4] = [
        &["-d", "x", "https://brought.test/v1/items"],
        &["https://brought.test/v2/items"],
        &["https://brought.test/v1"],
        &["--path-as-is", "https://brought.test/v1/../admin"],
    ];
    for args in refused {
        let mut full: Vec<&str> = vec!["-H", &header];
        full.extend_from_slice(args);
        let got = w.curl(id, &full).await;
        assert_eq!(got.status, 200, "{args:?}: {got:?}");
        assert!(got.body.contains(untouched), "{args:?}: {got:?}");
        assert!(!got.body.contains(BROUGHT_SEEN), "{args:?}: {got:?}");
    }
    // Only its host's web ports, and no other host, open up.
    let got = w.curl(id, &["https://brought.test:8443/v1/items"]).await;
    assert_eq!(got.connect_status, 403, "{got:?}");
    let got = w
        .curl(id, &[&format!("http://allowed.test:{}/", w.http_port)])
        .await;
    assert_eq!(got.status, 403, "{got:?}");
    allowed.len() + refused.len() + 1
}

/// Secrets a caller brings on create: the value goes out only on its
/// host, methods and paths, inside TLS; the run, the API, the records, the
/// logs, a checkpoint and the state directory never hold it; a restarted
/// daemon and a fork serve it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn brought_secrets_reach_their_host_method_and_path_only() {
    let vendor = start_echo_on_443().await;
    let mut w = World::start_on(
        "127.0.0.1:0",
        &["--egress-internal-allow", "127.0.0.0/8:443"],
    )
    .await;
    w.dns.set("brought.test", &[vendor], 60);
    let run = w
        .daemon
        .create_with(CreateRunRequest {
            image: IMAGE.into(),
            network: Some(NetworkTier::Allowlist),
            secrets: Some(vec![SECRET_NAME.into(), vendor_key()]),
            ..Default::default()
        })
        .await;
    assert_eq!(run.secrets, [SECRET_NAME, "VENDOR_KEY"]);
    assert!(run.egress_allow.is_empty(), "{run:?}");
    let id = run.id.to_string();
    let requests = check_vendor_key(&w, &id).await;

    // The audit log names the secret and the rule that let the host in.
    let (text, records) = w
        .audit(|r| egress_for(r, &id, "brought.test").len() >= requests)
        .await;
    assert!(!text.contains(BROUGHT_VALUE), "{text}");
    let to_vendor = egress_for(&records, &id, "brought.test");
    assert_eq!(
        to_vendor[0],
        Decision {
            secret: Some("VENDOR_KEY".into()),
            ..decision("GET", 443, "allow secret:brought.test")
        },
        "{to_vendor:?}"
    );

    // The API shows names only.
    for path in [format!("/v1/runs/{id}"), "/v1/runs".to_owned()] {
        let (status, body) =
            runbox_e2e::raw_request(&w.daemon.url, "GET", &path, &w.daemon.token, b"").await;
        assert_eq!(status, 200, "{body}");
        assert!(
            body.contains("VENDOR_KEY") && !body.contains(BROUGHT_VALUE),
            "{body}"
        );
    }

    // A checkpoint leaves it out, and says so; a run made from it has
    // the declared secret only.
    let checkpoint = w
        .daemon
        .client
        .checkpoint_run(&id, &Default::default())
        .await
        .unwrap();
    assert_eq!(checkpoint.secrets_excluded, ["VENDOR_KEY"]);
    let restored = w
        .daemon
        .create_with(CreateRunRequest {
            checkpoint: Some(checkpoint.id),
            ..Default::default()
        })
        .await;
    assert_eq!(restored.secrets, [SECRET_NAME]);

    // A fork keeps it, and a daemon killed and started again serves it
    // again (the value sealed in the record, opened with the node's key).
    let fork = w.daemon.fork_one(&id).await;
    assert_eq!(fork.secrets, [SECRET_NAME, "VENDOR_KEY"]);
    check_vendor_key(&w, &fork.id.to_string()).await;
    w.daemon.kill9();
    w.daemon.spawn().await;
    check_vendor_key(&w, &id).await;

    // Nothing the host keeps holds the value: records, database, audit,
    // the daemon's log, checkpoints, the runs' files.
    let holding = files_holding(w.daemon.state.path(), BROUGHT_VALUE.as_bytes());
    assert!(holding.is_empty(), "the value is in {holding:?}");
    let key = w.daemon.state.path().join("secrets.key");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&key).unwrap().permissions().mode() & 0o777,
        0o600
    );
}

/// Rule-form entries: ports and methods narrow what a host admits (inside
/// an intercepted tunnel too, request by request), a network admits the
/// addresses in it, and a denial names the rule to widen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_rules_admit_their_ports_and_methods_only() {
    let w = World::start().await;
    let (http, https) = (w.http_port, w.https_port);
    let body = serde_json::json!({"image": IMAGE, "network": "allowlist", "egressAllow": [
        {"host": "Allowed.test", "ports": [http], "methods": ["get", "HEAD"]},
        {"host": "secret.test", "ports": [format!("{https}-{https}")], "methods": ["GET"]},
        {"host": "127.0.0.0/8", "ports": [http]},
        "plain-tls.test:".to_owned() + &https.to_string(),
    ]});
    let (status, text) = runbox_e2e::raw_request(
        &w.daemon.url,
        "POST",
        "/v1/runs",
        &w.daemon.token,
        body.to_string().as_bytes(),
    )
    .await;
    assert_eq!(status, 201, "{text}");
    let run: Run = serde_json::from_str(&text).unwrap();
    let id = run.id.to_string();
    // Canonical: lower case, upper-case methods, a one-port range a port.
    assert_eq!(
        run.egress_allow[0].to_string(),
        format!(r#"{{"host":"allowed.test","ports":[{http}],"methods":["GET","HEAD"]}}"#)
    );
    assert_eq!(
        run.egress_allow[1].to_string(),
        format!(r#"{{"host":"secret.test","ports":[{https}],"methods":["GET"]}}"#)
    );

    // Plain HTTP: the rule's methods and ports.
    let got = w
        .curl(&id, &[&format!("http://allowed.test:{http}/x")])
        .await;
    assert_eq!(got.status, 200, "{got:?}");
    let got = w
        .curl(&id, &["-d", "x", &format!("http://allowed.test:{http}/x")])
        .await;
    assert_eq!(got.status, 403, "{got:?}");
    assert!(
        got.body.contains("admits GET, HEAD only") && got.body.contains("add POST"),
        "{got:?}"
    );
    let got = w
        .curl(&id, &[&format!("http://allowed.test:{https}/x")])
        .await;
    assert_eq!(got.status, 403, "{got:?}");
    assert!(
        got.body
            .contains(&format!("add {https} to that rule's ports")),
        "{got:?}"
    );

    // HTTPS under a rule with methods: intercepted (every allowlist run
    // trusts runbox's CA), each request checked.
    let url = format!("https://secret.test:{https}/get");
    let got = w.curl(&id, &[&url]).await;
    assert_eq!(got.status, 200, "{got:?}; log:\n{}", w.daemon.log());
    let got = w.curl(&id, &["-X", "DELETE", &url]).await;
    assert_eq!((got.connect_status, got.status), (200, 403), "{got:?}");
    assert!(got.body.contains("add DELETE"), "{got:?}");
    // A tunnel that does not speak TLS cannot be checked: it is closed.
    let got = w
        .curl(&id, &["-p", &format!("http://secret.test:{https}/plain")])
        .await;
    assert_ne!(got.exit, 0, "{got:?}");
    assert_ne!(got.status, 200, "{got:?}");
    // A bare host:port entry stays a blind tunnel.
    let got = w
        .curl(
            &id,
            &[
                "--cacert",
                TEST_CA_PATH,
                &format!("https://plain-tls.test:{https}/"),
            ],
        )
        .await;
    assert_eq!(got.status, 200, "{got:?}");

    // A network: the addresses in it, on the rule's ports; never a name.
    // (NO_PROXY names 127.0.0.1: --noproxy "" sends it through the proxy.)
    assert_eq!(
        w.curl(
            &id,
            &["--noproxy", "", &format!("http://127.0.0.1:{http}/")]
        )
        .await
        .status,
        200
    );
    let got = w
        .curl(
            &id,
            &["--noproxy", "", &format!("http://127.0.0.1:{https}/")],
        )
        .await;
    assert_eq!(got.status, 403, "{got:?}");

    // The audit names the rule, and the method a rule refused.
    let (_, records) = w
        .audit(|r| {
            egress_for(r, &id, "secret.test")
                .iter()
                .any(|d| d.outcome.starts_with("deny method:"))
        })
        .await;
    let decisions = egress_for(&records, &id, "secret.test");
    let rule = format!(r#"run:{{"host":"secret.test","ports":[{https}],"methods":["GET"]}}"#);
    assert!(
        decisions.contains(&decision("GET", https, &format!("allow {rule}"))),
        "{decisions:?}"
    );
    assert!(
        decisions.contains(&decision("DELETE", https, &format!("deny method:{rule}"))),
        "{decisions:?}"
    );

    // Malformed rules are refused with the field named; a rule's secret
    // must be one of the run's.
    for (rule, code, says) in [
        (
            serde_json::json!({"host": "x.test:443"}),
            "bad_egress_entry",
            "in ports",
        ),
        (
            serde_json::json!({"host": "x.test", "ports": [0]}),
            "bad_egress_entry",
            "out of range",
        ),
        (
            serde_json::json!({"host": "x.test", "methods": []}),
            "bad_egress_entry",
            "methods is empty",
        ),
        (
            serde_json::json!({"host": "10.0.0.0/8", "methods": ["GET"]}),
            "bad_egress_entry",
            "network",
        ),
        (
            serde_json::json!({"host": "x.test", "secret": "NOPE"}),
            "unknown_secret",
            "NOPE",
        ),
        (
            serde_json::json!({"host": "x.test", "port": [1]}),
            "bad_request",
            "unknown field `port`",
        ),
    ] {
        let body =
            serde_json::json!({"image": IMAGE, "network": "allowlist", "egressAllow": [rule]});
        let (status, got, message) = create_raw(&w, body).await;
        assert_eq!((status, got.as_str()), (400, code), "{rule}: {message}");
        assert!(message.contains(says), "{rule}: {message}");
    }
}

/// `GET /v1/info`'s capability catalog says what this daemon does: each
/// value is checked against a call that depends on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_capability_catalog_says_what_the_daemon_does() {
    let w = World::start().await;
    let catalog = w.daemon.client.info().await.unwrap().catalog.unwrap();
    assert_eq!(
        (
            catalog.egress_control.as_str(),
            catalog.secret_brokering.as_str()
        ),
        ("hosts-and-cidrs", "native")
    );
    assert!(
        catalog.networks.contains(&NetworkTier::Allowlist),
        "{catalog:?}"
    );
    assert!(catalog.networks.contains(&NetworkTier::None), "{catalog:?}");
    assert_eq!(catalog.egress.declared_secrets, [SECRET_NAME]);
    // The world's daemon runs with --no-default-egress.
    assert!(!catalog.egress.default_list);
    assert!(catalog.egress.rules && catalog.egress.live_update);
    // The door itself is checked in the_socks5_door_reaches_allowlisted_ports_only.
    assert_eq!(
        (catalog.egress.socks5, catalog.egress.upstream_proxies),
        (true, false)
    );

    // hosts-and-cidrs: a network rule admits an address in it; native
    // brokering: a brought secret is taken, its value kept out.
    let http = w.http_port;
    let run = w
        .daemon
        .create_with(CreateRunRequest {
            image: IMAGE.into(),
            network: Some(NetworkTier::Allowlist),
            egress_allow: Some(vec![runbox_types::EgressEntry::Rule(
                runbox_types::EgressRule {
                    host: "127.0.0.0/8".into(),
                    ports: Some(vec![runbox_types::PortSpec::Port(u32::from(http))]),
                    ..Default::default()
                },
            )]),
            secrets: Some(vec![vendor_key()]),
            ..Default::default()
        })
        .await;
    let id = run.id.to_string();
    let got = w
        .curl(
            &id,
            &["--noproxy", "", &format!("http://127.0.0.1:{http}/")],
        )
        .await;
    assert_eq!(got.status, 200, "{got:?}");
    assert_eq!(run.secrets, ["VENDOR_KEY"]);

    // Persistence: same-sandbox resume, filesystem capture and clone.
    assert_eq!(
        (
            catalog.persistence.resume.as_str(),
            catalog.persistence.capture.as_str(),
            catalog.persistence.clone
        ),
        ("same-sandbox", "filesystem", true)
    );
    w.sh(&id, "echo kept > /tmp/kept").await;
    w.daemon.client.hibernate_run(&id).await.unwrap();
    assert_eq!(w.sh(&id, "cat /tmp/kept").await.1, "kept\n");
    let fork = w.daemon.fork_one(&id).await;
    assert_eq!(
        w.sh(&fork.id.to_string(), "cat /tmp/kept").await.1,
        "kept\n"
    );

    // Sizes: an available one gets the limits the catalog gives it; the
    // limits: the TTL is capped at maxTtlSec, a fork past maxForkCount is
    // refused.
    let small = catalog
        .sizes
        .iter()
        .find(|s| s.size == runbox_types::SizeTier::Small && s.available)
        .expect("small is available");
    let sized = w
        .daemon
        .create_with(CreateRunRequest {
            image: IMAGE.into(),
            size: Some(runbox_types::SizeTier::Small),
            ttl_sec: Some(catalog.limits.max_ttl_sec + 3600),
            ..Default::default()
        })
        .await;
    assert_eq!(sized.limits, small.limits);
    let lifetime = (sized.expires_at - sized.created_at).whole_seconds() as u64;
    assert!(lifetime <= catalog.limits.max_ttl_sec, "{lifetime}");
    let too_many = w
        .daemon
        .client
        .fork_run(
            &id,
            &runbox_types::ForkRequest {
                count: catalog.limits.max_fork_count + 1,
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    assert!(too_many.to_string().contains("count"), "{too_many}");
}

/// Sends `PATCH /v1/runs/{id}/egress` with `body`; the status and the
/// error code (empty on success).
async fn patch_egress(w: &World, id: &str, body: serde_json::Value) -> (u16, String, String) {
    let (status, text) = runbox_e2e::raw_request(
        &w.daemon.url,
        "PATCH",
        &format!("/v1/runs/{id}/egress"),
        &w.daemon.token,
        body.to_string().as_bytes(),
    )
    .await;
    let json: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
    let code = json["error"]["code"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    (status, code, text)
}

/// `PATCH /v1/runs/{id}/egress`: new connections follow the new policy at
/// once, a download already under way finishes, the tier goes between
/// `none` and `allowlist` (proxy and variables with it), secrets come and
/// go live, and the policy outlives a daemon restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_egress_change_reaches_new_connections_and_spares_open_ones() {
    let mut w = World::start().await;
    let allowed = format!("allowed.test:{}", w.http_port);
    let other = format!("secret.test:{}", w.http_port);
    let tls = format!("secret.test:{}", w.https_port);
    let id = w.allowlist_run(&[&allowed], &[]).await.id.to_string();

    // A slow download through the proxy (40 KiB over 4 s), under way while
    // the policy changes.
    let big = 40 * 1024;
    let (code, _, err) = w
        .sh(
            &id,
            &format!(
                "curl -q -sS -o /tmp/big -w '%{{http_code}} %{{size_download}}' \
                 http://{allowed}/drip/40 > /tmp/big.status 2>&1 </dev/null &"
            ),
        )
        .await;
    assert_eq!(code, 0, "{err}");
    let started = runbox_e2e::eventually_async(Duration::from_secs(20), || async {
        w.sh(&id, "test -s /tmp/big").await.0 == 0
    })
    .await;
    assert!(started, "the download did not start");

    let (status, code, text) =
        patch_egress(&w, &id, serde_json::json!({"egressAllow": [other]})).await;
    assert_eq!((status, code.as_str()), (200, ""), "{text}");
    let run: Run = serde_json::from_str(&text).unwrap();
    assert_eq!(run.egress_allow, std::slice::from_ref(&other));
    // New requests follow the new list at once ...
    let got = w.curl(&id, &[&format!("http://{allowed}/after")]).await;
    assert_eq!(got.status, 403, "{got:?}");
    let got = w.curl(&id, &[&format!("http://{other}/after")]).await;
    assert_eq!(got.status, 200, "{got:?}");
    // ... and the download that was under way finishes whole.
    assert_ne!(
        w.sh(&id, "test -s /tmp/big.status").await.0,
        0,
        "the download ended before the change"
    );
    let finished = runbox_e2e::eventually_async(Duration::from_secs(60), || async {
        w.sh(&id, "test -s /tmp/big.status").await.0 == 0
    })
    .await;
    assert!(finished, "the download did not finish");
    let (_, status_line, _) = w.sh(&id, "cat /tmp/big.status").await;
    assert_eq!(status_line.trim(), format!("200 {big}"));

    // A malformed change changes nothing.
    for (body, want) in [
        (
            serde_json::json!({"egressAllow": ["https://x.test"]}),
            "bad_egress_entry",
        ),
        (serde_json::json!({"network": "open"}), "bad_egress"),
        (serde_json::json!({"secrets": ["NOPE"]}), "unknown_secret"),
        (serde_json::json!({"egressAllow": "x.test"}), "bad_request"),
        (serde_json::json!({"allow": []}), "bad_request"),
    ] {
        let (status, code, text) = patch_egress(&w, &id, body.clone()).await;
        assert_eq!((status, code.as_str()), (400, want), "{body}: {text}");
    }
    let (status, code, _) =
        patch_egress(&w, "01ARZ3NDEKTSV4RRFFQ69G5FAV", serde_json::json!({})).await;
    assert_eq!((status, code.as_str()), (404, "run_not_found"));
    assert_eq!(
        w.daemon.client.get_run(&id).await.unwrap().egress_allow,
        std::slice::from_ref(&other)
    );

    // Secrets, live: given, the next request carries the value; taken
    // away, the placeholder goes out.
    let (status, _, text) = patch_egress(
        &w,
        &id,
        serde_json::json!({"egressAllow": [other, tls], "secrets": [SECRET_NAME]}),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let auth = format!("Authorization: Bearer {PLACEHOLDER}");
    let url = format!("https://{tls}/allowed");
    let got = w.curl(&id, &["-H", &auth, &url]).await;
    assert!(got.body.contains(SECRET_SEEN), "{got:?}");
    let (status, _, text) = patch_egress(&w, &id, serde_json::json!({"secrets": []})).await;
    assert_eq!(status, 200, "{text}");
    let got = w.curl(&id, &["-H", &auth, &url]).await;
    assert_eq!(got.status, 200, "{got:?}");
    assert!(
        !got.body.contains(SECRET_SEEN) && got.body.contains(PLACEHOLDER),
        "{got:?}"
    );

    // To none: the proxy and its variables go; back to allowlist: they
    // come back with the new entries only.
    let (status, _, text) = patch_egress(&w, &id, serde_json::json!({"network": "none"})).await;
    assert_eq!(status, 200, "{text}");
    let run: Run = serde_json::from_str(&text).unwrap();
    assert_eq!(
        (run.network, run.egress_allow.len()),
        (NetworkTier::None, 0)
    );
    let got = w
        .curl(
            &id,
            &[
                "--noproxy",
                "",
                "-x",
                PROXY_URL,
                &format!("http://{other}/"),
            ],
        )
        .await;
    assert_ne!(got.exit, 0, "{got:?}");
    assert_eq!(w.sh(&id, "printf %s \"$HTTP_PROXY\"").await.1, "");
    let (status, _, text) = patch_egress(
        &w,
        &id,
        serde_json::json!({"network": "allowlist", "egressAllow": [allowed]}),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(w.sh(&id, "printf %s \"$HTTP_PROXY\"").await.1, PROXY_URL);
    assert_eq!(
        w.curl(&id, &[&format!("http://{allowed}/")]).await.status,
        200
    );
    assert_eq!(
        w.curl(&id, &[&format!("http://{other}/")]).await.status,
        403
    );

    // The policy is the run's record: a restarted daemon serves it.
    w.daemon.kill9();
    w.daemon.spawn().await;
    assert_eq!(
        w.curl(&id, &[&format!("http://{allowed}/")]).await.status,
        200
    );
    assert_eq!(
        w.curl(&id, &[&format!("http://{other}/")]).await.status,
        403
    );

    // A hibernated run takes a change for its next boot.
    w.daemon.client.hibernate_run(&id).await.unwrap();
    let (status, _, text) =
        patch_egress(&w, &id, serde_json::json!({"egressAllow": [other]})).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(
        w.curl(&id, &[&format!("http://{other}/")]).await.status,
        200
    );
    assert_eq!(
        w.curl(&id, &[&format!("http://{allowed}/")]).await.status,
        403
    );

    // A run started on none has no interception CA: secrets wait for a
    // boot on the allowlist tier.
    let closed = run_on(&w, NetworkTier::None).await;
    let (status, code, text) = patch_egress(
        &w,
        &closed,
        serde_json::json!({"network": "allowlist", "secrets": [SECRET_NAME]}),
    )
    .await;
    assert_eq!((status, code.as_str()), (400, "bad_egress"), "{text}");
    assert!(text.contains("hibernate and wake"), "{text}");
    let (status, _, text) =
        patch_egress(&w, &closed, serde_json::json!({"network": "allowlist"})).await;
    assert_eq!(status, 200, "{text}");
    w.daemon.client.hibernate_run(&closed).await.unwrap();
    w.daemon.client.wake_run(&closed).await.unwrap();
    let (status, _, text) = patch_egress(
        &w,
        &closed,
        serde_json::json!({"egressAllow": [tls], "secrets": [SECRET_NAME]}),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let got = w.curl(&closed, &[&url]).await;
    assert!(got.body.contains(SECRET_SEEN), "{got:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allowlist_runs_get_their_proxy_and_secrets_back_when_woken() {
    let w = World::start().await;
    let secret = format!("secret.test:{}", w.https_port);
    let http = format!("allowed.test:{}", w.http_port);
    let id = w
        .allowlist_run(&[&secret, &http], &[SECRET_NAME])
        .await
        .id
        .to_string();
    assert_eq!(
        w.curl(&id, &[&format!("http://{http}/before")])
            .await
            .status,
        200
    );
    w.daemon.client.hibernate_run(&id).await.unwrap();
    assert!(!netns_exists(&id), "a hibernated run keeps its namespace");
    // The call that wakes it goes out through a new proxy with the same
    // policy, secrets and trust.
    let got = w.curl(&id, &[&format!("http://{http}/after")]).await;
    assert_eq!(got.status, 200, "{got:?}; log:\n{}", w.daemon.log());
    assert_eq!(w.curl(&id, &["http://example.org/"]).await.status, 403);
    let got = w.curl(&id, &[&format!("https://{secret}/allowed")]).await;
    assert_eq!(got.status, 200, "{got:?}; log:\n{}", w.daemon.log());
    assert!(
        got.body
            .contains(&format!("authorization: Bearer {SECRET_SEEN}\n")),
        "{got:?}"
    );
}

/// Keeps `net.ipv4.ip_forward` as the host had it once the last test that
/// creates open runs is done (the daemon turns it on and leaves it on).
struct ForwardGuard;

static FORWARD: Mutex<(usize, Option<String>)> = Mutex::new((0, None));
const IP_FORWARD: &str = "/proc/sys/net/ipv4/ip_forward";

impl ForwardGuard {
    fn acquire() -> ForwardGuard {
        let mut state = FORWARD.lock().unwrap_or_else(|e| e.into_inner());
        if state.0 == 0 {
            state.1 = std::fs::read_to_string(IP_FORWARD).ok();
        }
        state.0 += 1;
        ForwardGuard
    }
}

impl Drop for ForwardGuard {
    fn drop(&mut self) {
        let mut state = FORWARD.lock().unwrap_or_else(|e| e.into_inner());
        state.0 -= 1;
        if state.0 == 0 {
            if let Some(original) = state.1.take() {
                let _ = std::fs::write(IP_FORWARD, original);
            }
        }
    }
}

/// Creates an `open` run of the curl image.
async fn open_run(w: &World) -> String {
    run_on(w, NetworkTier::Open).await
}

/// Creates a run of the curl image on `network`; its id.
async fn run_on(w: &World, network: NetworkTier) -> String {
    w.daemon
        .create_with(CreateRunRequest {
            image: IMAGE.into(),
            network: Some(network),
            ..Default::default()
        })
        .await
        .id
        .to_string()
}

/// The host's IPv4 addresses (the API listens on 0.0.0.0), except
/// loopback, which inside a run is the run's own. Other daemons' open-run
/// links come and go; they are left out.
fn host_addresses() -> Vec<IpAddr> {
    let out = Command::new("ip")
        .args(["-4", "-o", "addr", "show"])
        .output()
        .expect("ip addr");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| {
            l.split_whitespace()
                .nth(1)
                .is_some_and(|i| !i.starts_with("rbx"))
        })
        .filter_map(|l| {
            let mut words = l.split_whitespace().skip(2);
            let _family = words.next()?;
            words.next()?.split('/').next()?.parse::<IpAddr>().ok()
        })
        .filter(|ip| !ip.is_loopback())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_reach_the_api_on_no_host_address() {
    let _forward = ForwardGuard::acquire();
    let host_ip = host_ipv4();
    // The allowlist proxy may reach the host's own address on any port,
    // the API's excepted.
    let exception = host_ip.as_ref().map(|ip| format!("{ip}/32"));
    let mut extra = vec!["--allow-non-loopback"];
    if let Some(exception) = &exception {
        extra.extend(["--egress-internal-allow", exception]);
    }
    let w = World::start_on("0.0.0.0:0", &extra).await;
    let api = w.api_port();

    let id = open_run(&w).await;
    // No proxy in the open tier: nothing points programs at one.
    let run = w.daemon.client.get_run(&id).await.unwrap();
    assert_eq!(run.egress, None);
    let (_, env, _) = w.sh(&id, "env").await;
    assert!(!env.to_ascii_lowercase().contains("proxy"), "{env}");
    let (_, route, _) = w.sh(&id, "ip -4 route show default").await;
    let gateway: IpAddr = route
        .split_whitespace()
        .skip_while(|w| *w != "via")
        .nth(1)
        .and_then(|g| g.parse().ok())
        .unwrap_or_else(|| panic!("no default route in an open run: {route:?}"));
    // The link itself works: the host reaches a listener in the run, and
    // the run's answers come back. What stops the run below is the filter.
    let (_, addr, _) = w.sh(&id, "ip -4 -o addr show dev eth0").await;
    let run_ip: IpAddr = addr
        .split_whitespace()
        .nth(3)
        .and_then(|a| a.split('/').next())
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no address on the open run's eth0: {addr:?}"));
    w.sh(&id, "(echo pong | nc -l -p 7070 >/dev/null 2>&1 &)")
        .await;
    let mut answer = String::new();
    let answered = eventually(Duration::from_secs(10), || {
        use std::io::Read;
        let Ok(mut tcp) = std::net::TcpStream::connect_timeout(
            &SocketAddr::new(run_ip, 7070),
            Duration::from_secs(2),
        ) else {
            return false;
        };
        answer.clear();
        let _ = tcp.set_read_timeout(Some(Duration::from_secs(5)));
        tcp.read_to_string(&mut answer).is_ok() && answer == "pong\n"
    })
    .await;
    assert!(
        answered,
        "the host cannot reach the open run at {run_ip}: {answer:?}"
    );

    let mut targets = vec![gateway];
    targets.extend(host_addresses());
    for ip in targets {
        // The API listens there: the host itself reaches it...
        let addr = SocketAddr::new(ip, api);
        assert!(
            std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5)).is_ok(),
            "the API does not answer on {addr} from the host"
        );
        // ...the run does not, on any path.
        let url = format!("http://{ip}:{api}/health");
        let got = w
            .curl(
                &id,
                &[
                    "--noproxy",
                    "*",
                    "--connect-timeout",
                    "3",
                    "--max-time",
                    "5",
                    &url,
                ],
            )
            .await;
        assert_ne!(got.exit, 0, "{url}: {got:?}");
        assert!(!got.body.contains("\"ok\""), "{url}: {got:?}");
        let (_, out, _) = w
            .sh(&id, &format!("echo x | nc -w 3 {ip} {api}; echo rc=$?"))
            .await;
        assert!(out.ends_with("rc=1\n"), "{ip}: {out}");
    }

    // Nor does an allowlist run's proxy, with an exception for the host's
    // address or without one.
    let mut entries = vec![format!("127.0.0.1:{api}")];
    entries.extend(host_ip.iter().map(|ip| format!("{ip}:{api}")));
    let entries: Vec<&str> = entries.iter().map(String::as_str).collect();
    let allowlist = w.allowlist_run(&entries, &[]).await.id.to_string();
    for entry in entries {
        let url = format!("http://{entry}/health");
        let got = w.curl(&allowlist, &["--noproxy", "", &url]).await;
        assert_eq!(got.status, 403, "{url}: {got:?}");
        assert!(
            got.body.contains("an endpoint of runbox itself"),
            "{url}: {got:?}"
        );
    }
}

/// The host links of `table`'s open runs, by the alias runbox marks them
/// with: `runbox:<table>:<run id>`.
fn links_of(table: &str) -> Vec<String> {
    let out = Command::new("ip")
        .args(["-j", "link", "show"])
        .output()
        .expect("ip link");
    let links: serde_json::Value = serde_json::from_slice(&out.stdout).expect("ip -j link");
    let prefix = format!("runbox:{table}:");
    links
        .as_array()
        .into_iter()
        .flatten()
        .filter(|l| {
            l["ifalias"]
                .as_str()
                .is_some_and(|a| a.starts_with(&prefix))
        })
        .map(|l| l["ifname"].as_str().unwrap_or_default().to_owned())
        .collect()
}

/// Whether `table` (family inet) exists, and the elements of its set of
/// open-run interfaces.
fn table_state(table: &str) -> (bool, Vec<String>) {
    let out = Command::new("nft")
        .args(["-j", "list", "table", "inet", table])
        .output()
        .expect("nft");
    if !out.status.success() {
        return (false, Vec::new());
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("nft -j");
    let elements = v["nftables"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|o| o.get("set"))
        .flat_map(|s| s["elem"].as_array().cloned().unwrap_or_default())
        .filter_map(|e| e.as_str().map(str::to_owned))
        .collect();
    (true, sorted(elements))
}

/// The host-side interface name of run `id`: `rbx` and the id's last ten
/// characters, lowercased.
fn host_ifname(id: &str) -> String {
    format!("rbx{}", id[id.len() - 10..].to_ascii_lowercase())
}

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_run_links_and_rules_go_with_their_runs() {
    let _forward = ForwardGuard::acquire();
    let mut w = World::start().await;
    let table = w.daemon.nft_table().to_owned();
    let deleted = open_run(&w).await;
    let died = open_run(&w).await;
    let kept = open_run(&w).await;
    let names = |ids: &[&str]| sorted(ids.iter().map(|id| host_ifname(id)).collect());
    assert_eq!(sorted(links_of(&table)), names(&[&deleted, &died, &kept]));
    assert_eq!(
        table_state(&table),
        (true, names(&[&deleted, &died, &kept]))
    );

    // Deleting a run removes its link and its set element.
    w.daemon.client.delete_run(&deleted).await.unwrap();
    assert_eq!(sorted(links_of(&table)), names(&[&died, &kept]));
    assert_eq!(table_state(&table), (true, names(&[&died, &kept])));
    assert!(!netns_exists(&deleted));

    // A run that dies while the daemon is down is booted again when it
    // comes back (the restart policy), with a network of its own again;
    // the live one keeps its network.
    let runtime = w.daemon.client.get_run(&died).await.unwrap().runtime;
    w.daemon.kill9();
    let root = w.daemon.state.path().join("oci").join(&runtime);
    let status = Command::new(&runtime)
        .arg("--root")
        .arg(&root)
        .args(["kill", &format!("runbox-{died}"), "KILL"])
        .status()
        .expect("runtime kill");
    assert!(status.success());
    let cid = format!("runbox-{died}");
    let stopped = eventually(Duration::from_secs(20), || {
        Command::new(&runtime)
            .arg("--root")
            .arg(&root)
            .args(["state", &cid])
            .output()
            .map(|o| !String::from_utf8_lossy(&o.stdout).contains("\"running\""))
            .unwrap_or(true)
    })
    .await;
    assert!(stopped, "the killed sandbox did not stop");
    w.daemon.spawn().await;
    assert_eq!(
        sorted(links_of(&table)),
        names(&[&died, &kept]),
        "log:\n{}",
        w.daemon.log()
    );
    assert_eq!(table_state(&table), (true, names(&[&died, &kept])));
    assert!(netns_exists(&died));
    assert_eq!(w.daemon.client.get_run(&died).await.unwrap().restarts, 1);
    for id in [&kept, &died] {
        let (_, route, _) = w.sh(id, "ip -4 route show default").await;
        assert!(route.contains("via"), "{route}");
    }

    // Hibernating a run removes its link and element; its wake brings
    // them back.
    w.daemon.client.hibernate_run(&died).await.unwrap();
    assert_eq!(sorted(links_of(&table)), names(&[&kept]));
    assert_eq!(table_state(&table), (true, names(&[&kept])));
    assert!(!netns_exists(&died));
    let (_, route, _) = w.sh(&died, "ip -4 route show default").await;
    assert!(route.contains("via"), "{route}");
    assert_eq!(sorted(links_of(&table)), names(&[&died, &kept]));
    w.daemon.client.delete_run(&died).await.unwrap();

    // Deleted after the restart: gone too, and once no open run is left a
    // restart removes the table itself.
    w.daemon.client.delete_run(&kept).await.unwrap();
    assert!(links_of(&table).is_empty());
    assert!(table_state(&table).1.is_empty());
    w.daemon.kill9();
    w.daemon.spawn().await;
    assert_eq!(table_state(&table), (false, vec![]));
    assert!(links_of(&table).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allowlist_pool_member_serves_its_claims_policy_only() {
    let w = World::start().await;
    w.daemon
        .client
        .set_pools(&runbox_types::PoolSet {
            pools: vec![runbox_types::PoolSpec {
                image: IMAGE.into(),
                network: Some(NetworkTier::Allowlist),
                size: Some(runbox_types::SizeTier::Small),
                warm: Some(2),
                warm_max: None,
                warmup: None,
            }],
        })
        .await
        .unwrap();
    let filled = eventually_ready(&w, 2).await;
    assert!(filled, "{:?}", w.daemon.client.pools().await.unwrap());
    let http = format!("allowed.test:{}", w.http_port);
    let claim =
        |allow: Option<Vec<String>>, secrets: Option<Vec<SecretRequest>>| CreateRunRequest {
            image: IMAGE.into(),
            network: Some(NetworkTier::Allowlist),
            size: Some(runbox_types::SizeTier::Small),
            egress_allow: allow.map(|a| a.into_iter().map(Into::into).collect()),
            secrets,
            ..Default::default()
        };
    // The claim's entries are the member's policy ...
    let run = w
        .daemon
        .create_with(claim(Some(vec![http.clone()]), None))
        .await;
    assert!(run.pooled, "{run:?}");
    assert_eq!(run.egress_allow, vec![http.clone()]);
    let id = run.id.to_string();
    let (_, env, _) = w.sh(&id, "env").await;
    assert!(env.contains(&format!("HTTP_PROXY={PROXY_URL}\n")), "{env}");
    let got = w.curl(&id, &[&format!("http://{http}/pooled")]).await;
    assert_eq!(got.status, 200, "{got:?}");
    // ... and a claim without them reaches nothing.
    let other = w.daemon.create_with(claim(None, None)).await;
    assert!(other.pooled);
    let got = w
        .curl(&other.id.to_string(), &[&format!("http://{http}/pooled")])
        .await;
    assert_eq!(got.status, 403, "{got:?}");
    // A claimed secret works in a pooled run (it trusts the CA already).
    eventually_ready(&w, 1).await;
    let secret = w
        .daemon
        .create_with(claim(
            Some(vec![format!("secret.test:{}", w.https_port)]),
            Some(vec![SECRET_NAME.into()]),
        ))
        .await;
    assert!(secret.pooled);
    let got = w
        .curl(
            &secret.id.to_string(),
            &[
                "-H",
                &format!("Authorization: Bearer {PLACEHOLDER}"),
                &format!("https://secret.test:{}/allowed/x", w.https_port),
            ],
        )
        .await;
    assert_eq!(got.status, 200, "{got:?}");
    assert!(
        got.body
            .contains(&format!("authorization: Bearer {SECRET_SEEN}\n")),
        "{got:?}"
    );
}

async fn eventually_ready(w: &World, ready: u32) -> bool {
    runbox_e2e::eventually_async(Duration::from_secs(60), || async {
        w.daemon
            .client
            .pools()
            .await
            .map(|l| l.pools.iter().all(|p| p.ready >= ready))
            .unwrap_or(false)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_bytes_of_allowed_connections_become_usage() {
    let w = World::start_on("127.0.0.1:0", &["--egress-usage-bytes"]).await;
    let http = format!("allowed.test:{}", w.http_port);
    let id = w.allowlist_run(&[&http], &[]).await.id.to_string();
    let n: u64 = 1 << 20;
    let got = w
        .curl(
            &id,
            &["-o", "/dev/null", &format!("http://{http}/bytes/{n}")],
        )
        .await;
    assert_eq!(got.status, 200, "{got:?}");
    // A connection that only met a refusal is not the run's egress.
    let got = w.curl(&id, &["http://example.org/"]).await;
    assert_eq!(got.status, 403, "{got:?}");
    let mut report = None;
    for _ in 0..100 {
        let usage = w.daemon.client.usage(None, None).await.unwrap();
        let operator = usage.tenants.get("").cloned().unwrap_or_default();
        if operator.events.get("egress").copied().unwrap_or(0) >= 1 {
            report = Some(operator);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let operator = report.expect("an egress usage event");
    assert!(operator.egress_bytes > n, "{operator:?}");
    let counters = w.counters(&id).await;
    assert!(
        operator.egress_bytes < counters.bytes_down + counters.bytes_up,
        "the refused connection is not counted: {operator:?} {counters:?}"
    );
    assert_eq!(operator.events["egress"], 1, "{operator:?}");
}

/// The SOCKS5 door (`egressSocks5`): curl through it reaches what the
/// allowlist admits (by name, resolved by the proxy, and through
/// `ALL_PROXY` alone), is refused elsewhere, is audited as SOCKS5; it opens
/// and closes live, outlives a restart, and is refused where it cannot be.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_socks5_door_reaches_allowlisted_ports_only() {
    let mut w = World::start().await;
    let allowed = format!("allowed.test:{}", w.http_port);
    let run = w
        .daemon
        .create_with(CreateRunRequest {
            image: IMAGE.into(),
            network: Some(NetworkTier::Allowlist),
            egress_allow: Some(vec![allowed.as_str().into()]),
            egress_socks5: Some(true),
            ..Default::default()
        })
        .await;
    assert_eq!(run.egress_socks5, Some(true));
    let id = run.id.to_string();
    let socks = "socks5h://127.0.0.1:1080";
    let url = format!("http://{allowed}/door");
    let got = w.curl(&id, &["-x", socks, &url]).await;
    assert_eq!((got.exit, got.status), (0, 200), "{got:?}");
    assert!(got.body.starts_with("GET /door\n"), "{got:?}");
    // ALL_PROXY names the door: without the HTTP variables curl uses it.
    let (code, out, err) = w
        .sh(
            &id,
            &format!(
                "echo \"$ALL_PROXY\"; unset HTTP_PROXY HTTPS_PROXY http_proxy https_proxy; \
                 curl -q -sS --max-time 30 http://{allowed}/all-proxy"
            ),
        )
        .await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.starts_with("socks5h://127.0.0.1:1080\nGET /all-proxy\n"),
        "{out}"
    );
    // Refused: not on the list, a port the entry does not name.
    for target in [
        "http://denied.test/",
        &format!("http://allowed.test:{}/", w.https_port),
    ] {
        let got = w.curl(&id, &["-x", socks, target]).await;
        assert_ne!(got.exit, 0, "{target}: {got:?}");
        assert_eq!(got.status, 0, "{target}: {got:?}");
    }
    let (_, records) = w
        .audit(|r| egress_for(r, &id, "denied.test").len() == 1)
        .await;
    assert_eq!(
        egress_for(&records, &id, "allowed.test")[0],
        decision("SOCKS5", w.http_port, &format!("allow run:{allowed}"))
    );
    assert_eq!(
        egress_for(&records, &id, "denied.test"),
        [decision("SOCKS5", 80, "deny none")]
    );

    // Closed live: nothing listens on 1080, ALL_PROXY goes; the HTTP
    // proxy is untouched. Open again: it serves.
    let (status, _, text) = patch_egress(&w, &id, serde_json::json!({"egressSocks5": false})).await;
    assert_eq!(status, 200, "{text}");
    let run: Run = serde_json::from_str(&text).unwrap();
    assert_eq!(run.egress_socks5, None);
    let got = w.curl(&id, &["-x", socks, &url]).await;
    assert_eq!(got.exit, 7, "{got:?}");
    let (_, out, _) = w.sh(&id, "echo \"all=${ALL_PROXY:-unset}\"").await;
    assert_eq!(out.trim(), "all=unset");
    assert_eq!(w.curl(&id, &[&url]).await.status, 200);
    let (status, _, text) = patch_egress(&w, &id, serde_json::json!({"egressSocks5": true})).await;
    assert_eq!(status, 200, "{text}");
    let got = w.curl(&id, &["-x", socks, &url]).await;
    assert_eq!((got.exit, got.status), (0, 200), "{got:?}");

    // A daemon restart re-opens it.
    w.daemon.kill9();
    w.daemon.spawn().await;
    let got = w.curl(&id, &["-x", socks, &url]).await;
    assert_eq!(
        (got.exit, got.status),
        (0, 200),
        "{got:?}; log:\n{}",
        w.daemon.log()
    );

    // A run without the door has nothing on 1080 and no ALL_PROXY.
    let plain = w.allowlist_run(&[&allowed], &[]).await.id.to_string();
    let got = w.curl(&plain, &["-x", socks, &url]).await;
    assert_eq!(got.exit, 7, "{got:?}");
    // Its own process on 1080: opening the door is a 409 naming the
    // address, and the run's policy stays as it was.
    let (code, out, err) = w
        .sh(
            &plain,
            "busybox httpd -p 127.0.0.1:1080 -h / && busybox netstat -ltn | grep -c 127.0.0.1:1080",
        )
        .await;
    assert_eq!((code, out.trim()), (0, "1"), "{err}");
    let (status, code, text) = patch_egress(
        &w,
        &plain,
        serde_json::json!({"egressSocks5": true, "egressAllow": []}),
    )
    .await;
    assert_eq!((status, code.as_str()), (409, "port_in_use"), "{text}");
    assert!(text.contains("127.0.0.1:1080"), "{text}");
    let run = w.daemon.client.get_run(&plain).await.unwrap();
    assert_eq!(run.egress_socks5, None);
    assert_eq!(
        run.egress_allow,
        vec![runbox_types::EgressEntry::from(allowed.as_str())]
    );
    assert_eq!(w.curl(&plain, &[&url]).await.status, 200);

    // Only an allowlist run has doors.
    let (status, code, text) = create_raw(
        &w,
        serde_json::json!({"image": IMAGE, "network": "none", "egressSocks5": true}),
    )
    .await;
    assert_eq!((status, code.as_str()), (400, "bad_egress"), "{text}");
    assert!(text.contains("egressSocks5"), "{text}");
    let (status, code, text) = create_raw(
        &w,
        serde_json::json!({"image": IMAGE, "network": "allowlist", "egressSocks5": "yes"}),
    )
    .await;
    assert_eq!(status, 400, "{code} {text}");
}

/// A real upstream proxy on loopback, started for one test and killed
/// (by its child handle) when dropped.
struct UpstreamProxy {
    child: std::process::Child,
    port: u16,
    log: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for UpstreamProxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A loopback port nothing listens on now.
fn free_port() -> u16 {
    let probe = std::net::TcpListener::bind("127.0.0.1:0").expect("probe port");
    probe.local_addr().unwrap().port()
}

impl UpstreamProxy {
    /// tinyproxy (HTTP CONNECT) on 127.0.0.1 asking for `user:password`.
    fn tinyproxy(user: &str, password: &str) -> UpstreamProxy {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let log = dir.path().join("tinyproxy.log");
        let conf = dir.path().join("tinyproxy.conf");
        std::fs::write(
            &conf,
            format!(
                "Port {port}\nListen 127.0.0.1\nTimeout 60\nBasicAuth {user} {password}\n\
                 LogFile \"{}\"\nLogLevel Connect\nMaxClients 20\n",
                log.display()
            ),
        )
        .unwrap();
        let child = std::process::Command::new("tinyproxy")
            .args(["-d", "-c"])
            .arg(&conf)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("tinyproxy (scripts/deps --test installs it)");
        UpstreamProxy::ready(child, port, log, dir)
    }

    /// microsocks (SOCKS5) on 127.0.0.1 asking for `user:password`.
    fn microsocks(user: &str, password: &str) -> UpstreamProxy {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let log = dir.path().join("microsocks.log");
        let out = std::fs::File::create(&log).unwrap();
        let child = std::process::Command::new("microsocks")
            .args([
                "-i",
                "127.0.0.1",
                "-p",
                &port.to_string(),
                "-u",
                user,
                "-P",
                password,
            ])
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .expect("microsocks (scripts/deps --test installs it)");
        UpstreamProxy::ready(child, port, log, dir)
    }

    fn ready(
        child: std::process::Child,
        port: u16,
        log: std::path::PathBuf,
        dir: tempfile::TempDir,
    ) -> UpstreamProxy {
        let proxy = UpstreamProxy {
            child,
            port,
            log,
            _dir: dir,
        };
        for _ in 0..100 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return proxy;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("the upstream proxy did not listen on {port}");
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// `egressUpstream`: a run's egress leaves through a real HTTP (tinyproxy)
/// or SOCKS5 (microsocks) proxy with credentials, names resolved by the
/// upstream; the policy still decides first; the URL's password is kept
/// like a secret; a failing upstream fails closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_proxies_carry_a_runs_egress() {
    let http_up = UpstreamProxy::tinyproxy("tp-user", "tp-pass-4c1f");
    let socks_up = UpstreamProxy::microsocks("ms-user", "ms-pass-9e2a");
    let w = World::start_on("127.0.0.1:0", &["--egress-upstream-allow", "127.0.0.1"]).await;
    let catalog = w.daemon.client.info().await.unwrap().catalog.unwrap();
    assert!(catalog.egress.upstream_proxies);

    // Through the HTTP upstream, by a name only the upstream resolves
    // (runbox's own DNS does not know `localhost`).
    let by_name = format!("localhost:{}", w.http_port);
    let tiny = format!("http://tp-user:tp-pass-4c1f@127.0.0.1:{}", http_up.port);
    let run = w
        .daemon
        .create_with(CreateRunRequest {
            image: IMAGE.into(),
            network: Some(NetworkTier::Allowlist),
            egress_allow: Some(vec![by_name.as_str().into()]),
            egress_upstream: Some(runbox_types::SecretValue::new(tiny.clone())),
            ..Default::default()
        })
        .await;
    let id = run.id.to_string();
    let shown = format!("http://tp-user@127.0.0.1:{}", http_up.port);
    assert_eq!(run.egress_upstream.as_deref(), Some(shown.as_str()));
    let got = w
        .curl(
            &id,
            &["--noproxy", "", &format!("http://{by_name}/via-http")],
        )
        .await;
    assert_eq!(got.status, 200, "{got:?}; log:\n{}", w.daemon.log());
    assert!(got.body.starts_with("GET /via-http\n"), "{got:?}");
    assert!(
        http_up
            .log()
            .contains(&format!("CONNECT localhost:{}", w.http_port)),
        "{}",
        http_up.log()
    );
    // The policy decides first: nothing else goes to the upstream.
    let got = w.curl(&id, &["http://denied.test/"]).await;
    assert_eq!(got.status, 403, "{got:?}");
    assert!(!http_up.log().contains("denied.test"));
    let (_, records) = w
        .audit(|r| !egress_for(r, &id, "localhost").is_empty())
        .await;
    let upstream_of = |host: &str| {
        records.iter().find_map(|r| match r {
            AuditRecord::Egress {
                run,
                host: h,
                upstream,
                decision,
                ..
            } if *run == id && h == host && decision == "allow" => Some(upstream.clone()),
            _ => None,
        })
    };
    assert_eq!(upstream_of("localhost"), Some(Some(shown.clone())));

    // Live to the SOCKS5 upstream, by address.
    let by_addr = format!("127.0.0.1:{}", w.http_port);
    let micro = format!("socks5://ms-user:ms-pass-9e2a@127.0.0.1:{}", socks_up.port);
    let (status, _, text) = patch_egress(
        &w,
        &id,
        serde_json::json!({"egressUpstream": micro, "egressAllow": [by_addr]}),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    assert!(!text.contains("ms-pass-9e2a"), "{text}");
    let got = w
        .curl(
            &id,
            &["--noproxy", "", &format!("http://{by_addr}/via-socks")],
        )
        .await;
    assert_eq!(got.status, 200, "{got:?}; log:\n{}", w.daemon.log());
    assert!(
        socks_up
            .log()
            .contains(&format!("connected to 127.0.0.1:{}", w.http_port)),
        "{}",
        socks_up.log()
    );

    // Wrong credentials: a 502 naming the upstream, never the password.
    let wrong = format!("socks5://ms-user:not-it-77@127.0.0.1:{}", socks_up.port);
    let (status, _, text) =
        patch_egress(&w, &id, serde_json::json!({"egressUpstream": wrong})).await;
    assert_eq!(status, 200, "{text}");
    let got = w
        .curl(&id, &["--noproxy", "", &format!("http://{by_addr}/wrong")])
        .await;
    assert_eq!(got.status, 502, "{got:?}");
    assert!(
        got.body.contains(&format!("127.0.0.1:{}", socks_up.port)),
        "{got:?}"
    );
    assert!(!got.body.contains("not-it-77"), "{got:?}");

    // Refused: an upstream the operator does not admit, a bad URL, one on
    // a tier without a proxy; the message never quotes the password.
    for (body, code) in [
        (
            serde_json::json!({"egressUpstream": "socks5://u:pw-x1@10.9.9.9:1080"}),
            "bad_egress",
        ),
        (
            serde_json::json!({"egressUpstream": "ftp://u:pw-x1@127.0.0.1:21"}),
            "bad_egress",
        ),
        (
            serde_json::json!({"egressUpstream": "socks5://u:pw-x1@127.0.0.1"}),
            "bad_egress",
        ),
        (serde_json::json!({"egressUpstream": 7}), "bad_request"),
        // Not written whole: refused, not guessed at.
        (
            serde_json::json!({"egressUpstream": format!("socks5://u:pw-x1@127.0.0.1:{}\r\n", socks_up.port)}),
            "bad_egress",
        ),
        (
            serde_json::json!({"egressUpstream": format!("http:u:pw-x1@127.0.0.1:{}", socks_up.port)}),
            "bad_egress",
        ),
        (
            serde_json::json!({"egressUpstream": format!("http://u:pw-x1@127.1:{}", socks_up.port)}),
            "bad_egress",
        ),
        (
            serde_json::json!({"egressUpstream": format!("socks5://u:pw-x1@127.0.0.1\t:{}", socks_up.port)}),
            "bad_egress",
        ),
    ] {
        let (status, got, text) = patch_egress(&w, &id, body.clone()).await;
        assert_eq!((status, got.as_str()), (400, code), "{body}: {text}");
        assert!(!text.contains("pw-x1"), "{text}");
    }
    let (status, code, text) = create_raw(
        &w,
        serde_json::json!({"image": IMAGE, "network": "none", "egressUpstream": micro}),
    )
    .await;
    assert_eq!((status, code.as_str()), (400, "bad_egress"), "{text}");

    // Down: fails closed, never straight out.
    let (status, _, text) =
        patch_egress(&w, &id, serde_json::json!({"egressUpstream": micro})).await;
    assert_eq!(status, 200, "{text}");
    drop(socks_up);
    let got = w
        .curl(&id, &["--noproxy", "", &format!("http://{by_addr}/down")])
        .await;
    assert_eq!(got.status, 502, "{got:?}");
    // "" removes it: straight out again.
    let (status, _, text) = patch_egress(&w, &id, serde_json::json!({"egressUpstream": ""})).await;
    assert_eq!(status, 200, "{text}");
    assert!(!text.contains("egressUpstream"), "{text}");
    let got = w
        .curl(&id, &["--noproxy", "", &format!("http://{by_addr}/direct")])
        .await;
    assert_eq!(got.status, 200, "{got:?}");

    // The passwords are nowhere in the state directory or the log.
    for password in ["tp-pass-4c1f", "ms-pass-9e2a", "not-it-77"] {
        assert!(
            files_holding(w.daemon.state.path(), password.as_bytes()).is_empty(),
            "{password} stored"
        );
        assert!(!w.daemon.log().contains(password), "{password} logged");
    }
}

/// Egress classes: a tenant bound to one gets runs that reach only what
/// both the class and their own policy admit; a config reload changes the
/// class for live runs at their next request, and a class removed leaves
/// its runs reaching nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_classes_narrow_their_tenants_runs_and_follow_a_reload() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.toml");
    let class = |allow: &[String]| {
        let list: Vec<String> = allow.iter().map(|a| format!("{a:?}")).collect();
        format!(
            "[[egress_class]]\nname = \"narrow\"\nallow = [{}]\n",
            list.join(", ")
        )
    };
    // The ports are the World's, known only once it starts: the first
    // file names ports the run's own entries never use.
    std::fs::write(&config, class(&["allowed.test:1".to_owned()])).unwrap();
    let path = config.to_str().unwrap().to_owned();
    let w = World::start_on("127.0.0.1:0", &["--config", &path]).await;
    let (http, https) = (w.http_port, w.https_port);
    let allowed = format!("allowed.test:{http}");
    let other = format!("secret.test:{http}");
    let tls = format!("plain-tls.test:{https}");
    // The class admits allowed.test and plain-tls.test, not secret.test.
    std::fs::write(&config, class(&[allowed.clone(), tls.clone()])).unwrap();
    let reload_raw = || {
        runbox_e2e::raw_request(
            &w.daemon.url,
            "POST",
            "/v1/config/reload",
            &w.daemon.token,
            b"",
        )
    };
    let reload = || async {
        let (status, text) = reload_raw().await;
        assert_eq!(status, 200, "{text}");
        serde_json::from_str::<runbox_types::ConfigReload>(&text).unwrap()
    };
    assert!(reload().await.applied.contains(&"egress_class".to_owned()));
    let catalog = w.daemon.client.info().await.unwrap().catalog.unwrap();
    assert_eq!(catalog.egress.classes, ["narrow"]);

    // A tenant is bound only to a class the server defines.
    let root = &w.daemon.client;
    let err = root
        .create_tenant(&runbox_types::CreateTenantRequest {
            name: "acme".into(),
            egress_class: Some("wide".into()),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(err.to_string().contains("narrow"), "{err}");
    let token = root
        .create_tenant(&runbox_types::CreateTenantRequest {
            name: "acme".into(),
            egress_class: Some("narrow".into()),
            ..Default::default()
        })
        .await
        .unwrap()
        .token;
    assert_eq!(
        root.get_tenant("acme")
            .await
            .unwrap()
            .policy
            .egress_class
            .as_deref(),
        Some("narrow")
    );
    let acme = runbox_client::Client::new(&w.daemon.url, &token).unwrap();
    let run = acme
        .create_run(&CreateRunRequest {
            image: IMAGE.into(),
            network: Some(NetworkTier::Allowlist),
            egress_allow: Some(vec![allowed.as_str().into(), other.as_str().into()]),
            ..Default::default()
        })
        .await
        .unwrap();
    let id = run.id.to_string();
    // Both admit it: through.
    let got = w.curl(&id, &[&format!("http://{allowed}/both")]).await;
    assert_eq!(got.status, 200, "{got:?}");
    // The run admits it, the class does not: 403 naming the class.
    let got = w.curl(&id, &[&format!("http://{other}/run-only")]).await;
    assert_eq!(got.status, 403, "{got:?}");
    assert!(got.body.contains("egress class \"narrow\""), "{got:?}");
    // The class admits it, the run does not: the run's own 403.
    let got = w
        .curl(&id, &["-p", &format!("http://{tls}/class-only")])
        .await;
    assert_eq!(got.connect_status, 403, "{got:?}");
    // The operator's own run is bound to nothing.
    let free = w.allowlist_run(&[&other], &[]).await.id.to_string();
    assert_eq!(
        w.curl(&free, &[&format!("http://{other}/free")])
            .await
            .status,
        200
    );

    // A reload widens the class: the live run's next request follows.
    std::fs::write(&config, class(&[allowed.clone(), other.clone()])).unwrap();
    let report = reload().await;
    assert_eq!(report.applied, ["egress_class"], "{report:?}");
    let got = w.curl(&id, &[&format!("http://{other}/widened")]).await;
    assert_eq!(got.status, 200, "{got:?}");
    let (_, records) = w
        .audit(|r| egress_for(r, &id, "secret.test").len() >= 2)
        .await;
    let outcomes: Vec<String> = egress_for(&records, &id, "secret.test")
        .into_iter()
        .map(|d| d.outcome)
        .collect();
    assert_eq!(
        outcomes,
        ["deny class:narrow".to_owned(), format!("allow run:{other}")]
    );

    // A malformed class refuses the whole reload; nothing changes.
    std::fs::write(
        &config,
        "[[egress_class]]\nname = \"narrow\"\nallow = [\"a b\"]\n",
    )
    .unwrap();
    let (status, text) = reload_raw().await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("egress_class"), "{text}");
    assert_eq!(
        w.curl(&id, &[&format!("http://{other}/kept")]).await.status,
        200
    );

    // The class removed: its runs reach nothing, and say why.
    std::fs::write(&config, "").unwrap();
    reload().await;
    let got = w.curl(&id, &[&format!("http://{allowed}/gone")]).await;
    assert_eq!(got.status, 403, "{got:?}");
    assert!(got.body.contains("no longer defines"), "{got:?}");
    assert_eq!(
        w.curl(&free, &[&format!("http://{other}/free")])
            .await
            .status,
        200
    );
}

/// Two PATCHes at once, each changing a field the other leaves out: both
/// changes hold, every time (each is merged with the policy by the run's
/// owner, in the step that applies it, never with a snapshot from before
/// the other).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_egress_changes_are_never_lost() {
    let w = World::start().await;
    let id = w.allowlist_run(&["first.test"], &[]).await.id.to_string();
    for round in 0..12 {
        let host = format!("round{round}.test");
        let defaults = round % 2 == 1;
        let (a, b) = tokio::join!(
            patch_egress(&w, &id, serde_json::json!({ "egressAllow": [&host] })),
            patch_egress(&w, &id, serde_json::json!({ "egressDefaults": defaults })),
        );
        assert_eq!(a.0, 200, "{}", a.2);
        assert_eq!(b.0, 200, "{}", b.2);
        let run = w.daemon.client.get_run(&id).await.unwrap();
        let allow: Vec<String> = run.egress_allow.iter().map(|e| e.to_string()).collect();
        let want = vec![host];
        assert_eq!(allow, want, "round {round}: the allow change was lost");
        assert_eq!(
            run.egress_defaults,
            (!defaults).then_some(false),
            "round {round}: the defaults change was lost"
        );
    }
    w.daemon.client.delete_run(&id).await.unwrap();
}
