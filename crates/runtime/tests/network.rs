//! Network tiers and trust bundles against the real runtime, real network
//! namespaces and real nftables.
//!
//! Needs root, runc or crun, `ip`, `nft` and the static agent
//! (`scripts/build-agent`). Each test has its own state directory, its own
//! nftables table and its own addresses, all from 198.18.0.0/15 (reserved
//! for benchmarking, never routed publicly): the open runs' pool is
//! 198.18.N.0/24 and the stand-in "internet" host is a namespace of the
//! test's own at 198.19.N.2. No traffic goes anywhere else. [`Env`]'s drop
//! removes every run, link, table, namespace and mount a test made, whether
//! it passed or not.

use std::collections::HashSet;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use runbox_core::lane::{EgressDoor, Lane, LaneError, SandboxSpec, EGRESS_SOCKS5_ADDR};
use runbox_runtime::netns::in_netns;
use runbox_runtime::{
    bind_in_netns, OciLane, OciOptions, Runtime, EGRESS_PROXY_ADDR, EXTRA_CA_PATH,
    TRUST_BUNDLE_PATH,
};
use runbox_types::{Limits, NetworkTier};
use ulid::Ulid;

/// How long a connection that must fail may take to fail. Dropped packets
/// make it time out; the assertions are about failing, not about timing.
const REFUSED_WITHIN: Duration = Duration::from_millis(700);

const PEM: &str = "-----BEGIN CERTIFICATE-----\nMIIBrunboxTESTonly\n-----END CERTIFICATE-----\n";

/// Runs `cmd`, panicking with its stderr when it fails; returns stdout.
fn sh(cmd: &[&str]) -> String {
    let out = Command::new(cmd[0])
        .args(&cmd[1..])
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs `cmd` and ignores how it went (cleanup).
fn sh_quiet(cmd: &[&str]) {
    let _ = Command::new(cmd[0])
        .args(&cmd[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// A third octet for this test's addresses: random per process, distinct per
/// test within it.
fn unique_octet() -> u8 {
    static NEXT: OnceLock<AtomicU8> = OnceLock::new();
    NEXT.get_or_init(|| AtomicU8::new(Ulid::new().random() as u8))
        .fetch_add(1, Ordering::Relaxed)
}

/// A lowercase random tag for names.
fn tag() -> String {
    let id = Ulid::new().to_string().to_ascii_lowercase();
    id[id.len() - 8..].to_owned()
}

/// The static agent built by scripts/build-agent for this profile.
fn agent_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    let profile = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>");
    let bin = profile
        .parent()
        .expect("target")
        .join("x86_64-unknown-linux-gnu")
        .join(profile.file_name().expect("profile name"))
        .join("runbox-agent");
    assert!(
        bin.exists(),
        "{} is missing: run scripts/build-agent first (scripts/test does)",
        bin.display()
    );
    bin
}

/// Keeps `net.ipv4.ip_forward` as the host had it once the last test that
/// creates open runs is done (the lane turns it on and leaves it on).
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

/// One test's world: a state directory, options with its own table and
/// pool, the namespaces and links it made, and a runtime to drive the
/// lane. Dropping it sweeps everything away.
struct Env {
    rt: tokio::runtime::Runtime,
    state: tempfile::TempDir,
    options: OciOptions,
    runtime: Runtime,
    agent: PathBuf,
    octet: u8,
    /// Test namespaces to delete.
    netns: Mutex<Vec<String>>,
    /// Host links (of test namespaces) to delete.
    links: Mutex<Vec<String>>,
    _forward: Option<ForwardGuard>,
}

impl Env {
    fn new(open: bool) -> Env {
        assert!(
            rustix::process::geteuid().is_root(),
            "these tests create namespaces, links and nftables tables: run them as root"
        );
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("tokio runtime");
        let state = tempfile::Builder::new()
            .prefix("runbox-net-")
            .tempdir_in("/tmp")
            .expect("state dir");
        let agent = agent_bin();
        let wanted = std::env::var("RUNBOX_TEST_RUNTIMES")
            .ok()
            .and_then(|l| l.split(',').next().map(str::trim).map(str::to_owned))
            .filter(|s| !s.is_empty());
        let runtime = rt
            .block_on(runbox_runtime::select(
                wanted.as_deref(),
                state.path(),
                &agent,
            ))
            .unwrap_or_else(|e| panic!("{e}"));
        let octet = unique_octet();
        let options = OciOptions {
            open_pool: format!("198.18.{octet}.0/24").parse().expect("pool"),
            nft_table: format!("rbxt_{}", tag()),
            userns: None,
        };
        Env {
            rt,
            state,
            options,
            runtime,
            agent,
            octet,
            netns: Mutex::new(Vec::new()),
            links: Mutex::new(Vec::new()),
            _forward: open.then(ForwardGuard::acquire),
        }
    }

    fn lane(&self) -> OciLane {
        OciLane::with_options(
            self.runtime.clone(),
            self.state.path().to_path_buf(),
            self.agent.clone(),
            self.options.clone(),
        )
        .expect("lane")
    }

    fn spec(&self, network: NetworkTier, layer: &Path, trust_pem: Option<&str>) -> SandboxSpec {
        SandboxSpec {
            id: Ulid::new(),
            image_layers: vec![layer.to_path_buf()],
            limits: Limits {
                cpus: 1.0,
                memory_mb: 256,
                disk_mb: None,
                pids: 64,
            },
            network,
            trust_pem: trust_pem.map(str::to_owned),
            seed: None,
            warm: None,
            volumes: Vec::new(),
        }
    }

    /// A namespace standing in for the internet: `198.19.N.2/30` on a veth
    /// to the host (`198.19.N.1`), with a server on port 8080 that greets
    /// and hangs up. Returns the server's address.
    fn internet(&self) -> SocketAddr {
        let ns = format!("rbxt-{}", tag());
        let host_if = format!("rbt{}", tag());
        self.netns.lock().unwrap().push(ns.clone());
        self.links.lock().unwrap().push(host_if.clone());
        let (host_addr, server_addr) = (
            format!("198.19.{}.1/30", self.octet),
            format!("198.19.{}.2/30", self.octet),
        );
        sh(&["ip", "netns", "add", &ns]);
        sh(&[
            "ip", "link", "add", &host_if, "type", "veth", "peer", "name", "inet0", "netns", &ns,
        ]);
        sh(&["ip", "address", "add", &host_addr, "dev", &host_if]);
        sh(&["ip", "link", "set", "dev", &host_if, "up"]);
        sh(&[
            "ip",
            "-n",
            &ns,
            "address",
            "add",
            &server_addr,
            "dev",
            "inet0",
        ]);
        sh(&["ip", "-n", &ns, "link", "set", "dev", "inet0", "up"]);
        sh(&["ip", "-n", &ns, "link", "set", "dev", "lo", "up"]);
        let addr: SocketAddr = format!("198.19.{}.2:8080", self.octet).parse().unwrap();
        let listener = bind_in_netns(&Path::new("/run/netns").join(&ns), addr)
            .expect("binding the internet server");
        self.rt.spawn(async move {
            let listener = tokio::net::TcpListener::from_std(listener).expect("tokio listener");
            while let Ok((mut conn, _)) = listener.accept().await {
                use tokio::io::AsyncWriteExt;
                let _ = conn.write_all(b"hello from the internet\n").await;
            }
        });
        addr
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        // A fresh lane, as after a crash: sweeping with nothing kept
        // removes every run of this state dir, its links and set elements,
        // and the table.
        let lane = self.lane();
        if let Err(e) = self.rt.block_on(lane.sweep(&HashSet::new())) {
            eprintln!("cleanup: sweep failed: {e}");
        }
        sh_quiet(&["nft", "delete", "table", "inet", &self.options.nft_table]);
        for link in self.links.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            sh_quiet(&["ip", "link", "delete", "dev", link]);
        }
        for ns in self.netns.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            sh_quiet(&["ip", "netns", "delete", ns]);
        }
    }
}

/// An image layer: `/etc/hostname` and whatever `setup` adds.
fn layer(setup: impl FnOnce(&Path)) -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix("runbox-net-layer-")
        .tempdir_in("/tmp")
        .expect("layer dir");
    std::fs::create_dir_all(dir.path().join("etc/ssl/certs")).unwrap();
    std::fs::write(dir.path().join("etc/hostname"), "runbox-test-image\n").unwrap();
    setup(dir.path());
    dir
}

fn netns_path(id: Ulid) -> PathBuf {
    Path::new("/run/netns").join(format!("runbox-{id}"))
}

/// Connects from inside the namespace at `netns`; Ok is what the peer sent
/// before closing (or nothing, after a short read timeout).
fn talk_from(netns: &Path, addr: SocketAddr) -> std::io::Result<String> {
    in_netns(netns, || {
        let mut conn = TcpStream::connect_timeout(&addr, REFUSED_WITHIN)?;
        conn.set_read_timeout(Some(Duration::from_millis(500)))?;
        let mut got = String::new();
        match conn.read_to_string(&mut got) {
            Ok(_) => Ok(got),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(got),
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => Ok(got),
            Err(e) => Err(e),
        }
    })?
}

fn reachable_from(netns: &Path, addr: SocketAddr) -> bool {
    in_netns(netns, || {
        TcpStream::connect_timeout(&addr, REFUSED_WITHIN).is_ok()
    })
    .expect("joining the namespace")
}

/// The host's IPv4 addresses other than loopback.
fn host_addresses() -> Vec<Ipv4Addr> {
    let out = sh(&["ip", "-j", "-4", "address", "show"]);
    let list: serde_json::Value = serde_json::from_str(&out).expect("ip -j output");
    list.as_array()
        .into_iter()
        .flatten()
        .flat_map(|l| l["addr_info"].as_array().cloned().unwrap_or_default())
        .filter_map(|a| a["local"].as_str()?.parse::<Ipv4Addr>().ok())
        .filter(|a| !a.is_loopback())
        .collect()
}

fn link_exists(name: &str) -> bool {
    Command::new("ip")
        .args(["link", "show", "dev", name])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn table_exists(table: &str) -> bool {
    sh(&["nft", "list", "tables", "inet"])
        .lines()
        .any(|l| l.trim() == format!("table inet {table}"))
}

fn set_elements(table: &str) -> Vec<String> {
    let out = sh(&["nft", "-j", "list", "set", "inet", table, "open_ifs"]);
    let v: serde_json::Value = serde_json::from_str(&out).expect("nft json");
    v["nftables"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|i| i.get("set")?.get("elem")?.as_array().cloned())
        .flatten()
        .filter_map(|e| e.as_str().map(str::to_owned))
        .collect()
}

fn host_ifname(id: Ulid) -> String {
    runbox_runtime::open_net::host_ifname(id)
}

/// The pid of run `id`'s init process, from the runtime's state.
fn container_pid(env: &Env, id: Ulid) -> u32 {
    let root = runbox_runtime::oci::runtime_root(env.state.path(), &env.runtime.name);
    let out = Command::new(&env.runtime.path)
        .arg("--root")
        .arg(root)
        .args(["state", &format!("runbox-{id}")])
        .output()
        .expect("runtime state");
    let state: serde_json::Value = serde_json::from_slice(&out.stdout).expect("state json");
    state["pid"].as_u64().expect("pid") as u32
}

/// Reads `path` as the run sees it: resolved inside its root (absolute
/// symlinks included), across its mounts.
fn read_in_run(env: &Env, id: Ulid, path: &str) -> String {
    use rustix::fs::{Mode, OFlags, ResolveFlags};
    let root = format!("/proc/{}/root", container_pid(env, id));
    let dir = rustix::fs::open(
        root.as_str(),
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .expect("opening the run's root");
    let fd = rustix::fs::openat2(
        &dir,
        path.trim_start_matches('/'),
        OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::IN_ROOT,
    )
    .unwrap_or_else(|e| panic!("opening {path} in the run: {e}"));
    let mut data = String::new();
    std::fs::File::from(fd)
        .read_to_string(&mut data)
        .expect("reading");
    data
}

/// (a) A listener made with bind_in_netns lives in that namespace only.
#[test]
fn bind_in_netns_binds_inside_the_namespace() {
    let env = Env::new(false);
    let ns = format!("rbxt-{}", tag());
    env.netns.lock().unwrap().push(ns.clone());
    sh(&["ip", "netns", "add", &ns]);
    sh(&["ip", "-n", &ns, "link", "set", "dev", "lo", "up"]);
    let path = Path::new("/run/netns").join(&ns);

    let listener = bind_in_netns(&path, "0.0.0.0:0".parse().unwrap()).expect("bind");
    let port = listener.local_addr().unwrap().port();
    // Hold the same port on the host's loopback without listening, so that
    // nothing else on the host can answer there while we test (if something
    // already does, the negative check below is skipped).
    let host_holder = rustix::net::socket(
        rustix::net::AddressFamily::INET,
        rustix::net::SocketType::STREAM,
        None,
    )
    .unwrap();
    let held =
        rustix::net::bind(&host_holder, &SocketAddr::from((Ipv4Addr::LOCALHOST, port))).is_ok();

    let addr: SocketAddr = (Ipv4Addr::LOCALHOST, port).into();
    let thread = std::thread::spawn({
        let path = path.clone();
        move || {
            in_netns(&path, || {
                let mut c = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
                c.write_all(b"ping")
            })
        }
    });
    listener.set_nonblocking(false).unwrap();
    let (mut conn, _) = listener.accept().expect("accept from inside");
    let mut got = [0u8; 4];
    conn.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"ping");
    thread.join().unwrap().expect("joined").expect("connected");

    if held {
        let err = TcpStream::connect_timeout(&addr, REFUSED_WITHIN)
            .expect_err("the listener must not be reachable from the host");
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused, "{err}");
    }
    // Not a network namespace: refused.
    assert!(bind_in_netns(Path::new("/proc/self/ns/uts"), addr).is_err());
}

/// (b) An allowlist run has loopback only, and its egress listener takes
/// connections made inside it.
#[test]
fn allowlist_run_has_loopback_only_and_an_egress_listener() {
    let env = Env::new(false);
    let image = layer(|_| {});
    let lane = env.lane();
    assert!(lane.capabilities().network(NetworkTier::Allowlist).is_ok());
    env.rt.block_on(async {
        let spec = env.spec(NetworkTier::Allowlist, image.path(), None);
        let id = spec.id;
        lane.create(&spec).await.expect("create");
        let ns = format!("runbox-{id}");

        let links = sh(&["ip", "-n", &ns, "-o", "link"]);
        let names: Vec<&str> = links
            .lines()
            .filter_map(|l| l.split_whitespace().nth(1))
            .collect();
        assert_eq!(names, ["lo:"], "{links}");
        assert_eq!(sh(&["ip", "-n", &ns, "-4", "route", "show"]).trim(), "");
        assert_eq!(sh(&["ip", "-n", &ns, "-6", "route", "show"]).trim(), "");

        let listener = lane
            .sandbox(id)
            .egress_listener(EgressDoor::Http)
            .await
            .expect("egress listener");
        assert_eq!(listener.local_addr().unwrap(), EGRESS_PROXY_ADDR);
        let listener = tokio::net::TcpListener::from_std(listener).expect("non-blocking");
        let client = tokio::task::spawn_blocking(move || {
            in_netns(&netns_path(id), || {
                let mut c = TcpStream::connect_timeout(&EGRESS_PROXY_ADDR, Duration::from_secs(2))?;
                c.write_all(b"CONNECT example.test:443 HTTP/1.1\r\n\r\n")
            })
        });
        let (mut conn, _) = tokio::time::timeout(Duration::from_secs(5), listener.accept())
            .await
            .expect("a connection within 5 s")
            .expect("accept");
        let mut got = vec![0u8; 7];
        tokio::io::AsyncReadExt::read_exact(&mut conn, &mut got)
            .await
            .unwrap();
        assert_eq!(got, b"CONNECT");
        client.await.unwrap().unwrap().unwrap();
        drop(listener);
        // After a daemon restart the listener is made again.
        let again = lane
            .sandbox(id)
            .egress_listener(EgressDoor::Http)
            .await
            .expect("re-binding");
        drop(again);
        // The SOCKS5 door binds its own address; a second bind of a taken
        // address fails naming it.
        let socks = lane
            .sandbox(id)
            .egress_listener(EgressDoor::Socks5)
            .await
            .expect("SOCKS5 door");
        assert_eq!(socks.local_addr().unwrap(), EGRESS_SOCKS5_ADDR);
        let taken = lane
            .sandbox(id)
            .egress_listener(EgressDoor::Socks5)
            .await
            .expect_err("a taken address");
        assert!(taken.to_string().contains("127.0.0.1:1080"), "{taken}");
        drop(socks);

        // A run without the allowlist tier gets no proxy.
        let none = env.spec(NetworkTier::None, image.path(), None);
        lane.create(&none).await.expect("create none");
        match lane
            .sandbox(none.id)
            .egress_listener(EgressDoor::Http)
            .await
        {
            Err(LaneError::Unsupported(_)) => {}
            other => panic!("a none run got {other:?}"),
        }
        assert!(lane
            .sandbox(Ulid::new())
            .egress_listener(EgressDoor::Http)
            .await
            .is_err());

        lane.sandbox(id).destroy().await.expect("destroy");
        lane.sandbox(none.id).destroy().await.expect("destroy");
        assert!(!netns_path(id).exists());
    });
}

/// (c) An open run reaches the (test) internet, and nothing of the host nor
/// another run.
#[test]
fn open_run_reaches_the_internet_but_not_the_host_or_other_runs() {
    let env = Env::new(true);
    let image = layer(|_| {});
    let lane = env.lane();
    if let Some(why) = lane.open_unsupported() {
        panic!("the open tier is unavailable here: {why}");
    }
    let server = env.internet();
    // The runbox-like API: every host address, and loopback.
    let api_any = TcpListener::bind("0.0.0.0:0").unwrap();
    let api_loopback = TcpListener::bind("127.0.0.1:0").unwrap();
    let (any_port, lo_port) = (
        api_any.local_addr().unwrap().port(),
        api_loopback.local_addr().unwrap().port(),
    );

    env.rt.block_on(async {
        let a = env.spec(NetworkTier::Open, image.path(), None);
        let b = env.spec(NetworkTier::Open, image.path(), None);
        lane.create(&a).await.expect("create a");
        lane.create(&b).await.expect("create b");
        let (na, nb) = (netns_path(a.id), netns_path(b.id));
        let (sa, sb) = (
            lane.open_subnet(a.id).expect("a's subnet"),
            lane.open_subnet(b.id).expect("b's subnet"),
        );
        assert_ne!(sa, sb);

        // Out through NAT to the internet host.
        let greeting = tokio::task::spawn_blocking({
            let na = na.clone();
            move || talk_from(&na, server)
        })
        .await
        .unwrap()
        .expect("the run reaches the internet host");
        assert_eq!(greeting, "hello from the internet\n");

        // The API listener answers on the host itself ...
        assert!(TcpStream::connect_timeout(
            &SocketAddr::from((Ipv4Addr::LOCALHOST, any_port)),
            Duration::from_secs(1)
        )
        .is_ok());
        // ... and on no host address from inside the run: the gateway, the
        // host's side of the internet link, and every other address.
        let addresses = host_addresses();
        assert!(addresses.contains(&sa.host()), "{addresses:?}");
        let checks = tokio::task::spawn_blocking({
            let na = na.clone();
            move || {
                let mut reached = Vec::new();
                for addr in &addresses {
                    for port in [any_port, lo_port] {
                        let target = SocketAddr::from((*addr, port));
                        if reachable_from(&na, target) {
                            reached.push(target);
                        }
                    }
                }
                for port in [any_port, lo_port] {
                    // The run's loopback is its own.
                    let target = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
                    if reachable_from(&na, target) {
                        reached.push(target);
                    }
                }
                reached
            }
        })
        .await
        .unwrap();
        assert!(
            checks.is_empty(),
            "the run reached host services: {checks:?}"
        );

        // Run to run: b listens; a cannot reach it; the host can (so the
        // listener works and the drop is the filter's doing).
        let b_listener = bind_in_netns(&nb, "0.0.0.0:0".parse().unwrap()).expect("listening in b");
        let b_addr = SocketAddr::from((sb.run(), b_listener.local_addr().unwrap().port()));
        assert!(TcpStream::connect_timeout(&b_addr, Duration::from_secs(1)).is_ok());
        let a_reaches_b = tokio::task::spawn_blocking({
            let na = na.clone();
            move || reachable_from(&na, b_addr)
        })
        .await
        .unwrap();
        assert!(!a_reaches_b, "run a reached run b at {b_addr}");

        // DNS: the host's reachable nameservers, mounted read-only.
        let resolv = read_in_run(&env, a.id, "/etc/resolv.conf");
        let host_resolv = std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
        for line in host_resolv.lines().filter(|l| l.starts_with("nameserver")) {
            let addr = line.split_whitespace().nth(1).unwrap_or("");
            let usable = addr
                .parse::<Ipv4Addr>()
                .is_ok_and(|a| !a.is_loopback() && !a.is_unspecified());
            assert_eq!(resolv.contains(line), usable, "{line:?} in\n{resolv}");
        }

        lane.sandbox(a.id).destroy().await.expect("destroy a");
        lane.sandbox(b.id).destroy().await.expect("destroy b");
    });
}

/// (d) destroy removes the link and the set element; after a crash, a new
/// lane's sweep removes links, elements and the table.
#[test]
fn destroy_and_sweep_remove_every_trace() {
    let env = Env::new(true);
    let image = layer(|_| {});
    let table = env.options.nft_table.clone();
    env.rt.block_on(async {
        let lane = env.lane();
        let spec = env.spec(NetworkTier::Open, image.path(), None);
        let id = spec.id;
        let host_if = host_ifname(id);
        lane.create(&spec).await.expect("create");
        assert!(link_exists(&host_if));
        assert_eq!(set_elements(&table), std::slice::from_ref(&host_if));
        lane.sandbox(id).destroy().await.expect("destroy");
        assert!(!link_exists(&host_if), "{host_if} survived destroy");
        assert!(set_elements(&table).is_empty());
        assert!(!netns_path(id).exists());
        // Again, and for an id never seen.
        lane.sandbox(id).destroy().await.expect("destroy twice");
        lane.sandbox(Ulid::new())
            .destroy()
            .await
            .expect("destroy unknown");

        // A crash: the lane disappears with a run alive.
        let spec = env.spec(NetworkTier::Open, image.path(), None);
        let crashed = spec.id;
        lane.create(&spec).await.expect("create");
        std::mem::forget(lane);
        let host_if = host_ifname(crashed);
        assert!(link_exists(&host_if));

        let restarted = env.lane();
        let swept = restarted.sweep(&HashSet::new()).await.expect("sweep");
        assert_eq!(swept, [crashed]);
        assert!(!link_exists(&host_if), "{host_if} survived the sweep");
        assert!(!table_exists(&table), "table {table} survived the sweep");
        assert!(!netns_path(crashed).exists());
        assert!(!env
            .state
            .path()
            .join("runs")
            .join(crashed.to_string())
            .exists());
        // Idempotent.
        assert!(restarted
            .sweep(&HashSet::new())
            .await
            .expect("sweep")
            .is_empty());

        // A kept open run keeps its link, element and table.
        let spec = env.spec(NetworkTier::Open, image.path(), None);
        restarted.create(&spec).await.expect("create");
        // Strays no run directory names: an element, a link marked as this
        // table's, and one marked as another table's (not ours to touch).
        let stray_if = host_ifname(Ulid::new());
        let foreign_if = host_ifname(Ulid::new());
        for (name, alias) in [
            (&stray_if, format!("runbox:{table}:{}", Ulid::new())),
            (&foreign_if, format!("runbox:rbxt_other:{}", Ulid::new())),
        ] {
            let peer = format!("rbt{}", tag());
            env.links.lock().unwrap().push(name.clone());
            sh(&[
                "ip", "link", "add", name, "type", "veth", "peer", "name", &peer,
            ]);
            sh(&["ip", "link", "set", "dev", name, "alias", &alias]);
        }
        sh(&[
            "nft",
            "add",
            "element",
            "inet",
            &table,
            "open_ifs",
            &format!("{{ \"{stray_if}\" }}"),
        ]);
        let fresh = env.lane();
        let keep: HashSet<Ulid> = [spec.id].into();
        assert!(fresh.sweep(&keep).await.expect("sweep").is_empty());
        assert!(link_exists(&host_ifname(spec.id)));
        assert_eq!(set_elements(&table), [host_ifname(spec.id)]);
        assert!(!link_exists(&stray_if), "the stray {stray_if} survived");
        assert!(link_exists(&foreign_if), "another table's link was removed");
        // Its /30 is known again, so a new run gets another.
        assert!(fresh.open_subnet(spec.id).is_some());
        let other = env.spec(NetworkTier::Open, image.path(), None);
        fresh.create(&other).await.expect("create");
        assert_ne!(fresh.open_subnet(other.id), fresh.open_subnet(spec.id));
        fresh.sandbox(other.id).destroy().await.expect("destroy");
        fresh.sandbox(spec.id).destroy().await.expect("destroy");
    });
}

/// (e) The trust bundle is the image's plus the extra PEM, and the image's
/// bundle is read inside the image even through an absolute symlink.
#[test]
fn trust_bundle_appends_to_the_image_bundle_inside_the_root() {
    let env = Env::new(false);
    let lane = env.lane();
    let plain = layer(|root| {
        std::fs::write(
            root.join("etc/ssl/certs/ca-certificates.crt"),
            "IMAGE BUNDLE\n",
        )
        .unwrap()
    });
    let marker = format!("image-hostname-{}\n", Ulid::new());
    let linked = layer(|root| {
        std::fs::write(root.join("etc/hostname"), &marker).unwrap();
        std::os::unix::fs::symlink(
            "/etc/hostname",
            root.join("etc/ssl/certs/ca-certificates.crt"),
        )
        .unwrap();
    });
    let bare = layer(|_| {});
    env.rt.block_on(async {
        let spec = env.spec(NetworkTier::None, plain.path(), Some(PEM));
        lane.create(&spec).await.expect("create");
        assert_eq!(
            read_in_run(&env, spec.id, TRUST_BUNDLE_PATH),
            format!("IMAGE BUNDLE\n\n{PEM}")
        );
        assert_eq!(read_in_run(&env, spec.id, EXTRA_CA_PATH), PEM);
        lane.sandbox(spec.id).destroy().await.expect("destroy");

        let spec = env.spec(NetworkTier::None, linked.path(), Some(PEM));
        lane.create(&spec).await.expect("create");
        let expected = format!("{marker}\n{PEM}");
        let run_dir = env.state.path().join("runs").join(spec.id.to_string());
        assert_eq!(
            std::fs::read_to_string(run_dir.join("trust.pem")).unwrap(),
            expected
        );
        let in_run = read_in_run(&env, spec.id, TRUST_BUNDLE_PATH);
        assert_eq!(in_run, expected);
        let host_hostname = std::fs::read_to_string("/etc/hostname").unwrap_or_default();
        assert!(host_hostname.is_empty() || !in_run.contains(&host_hostname));
        lane.sandbox(spec.id).destroy().await.expect("destroy");

        let spec = env.spec(NetworkTier::None, bare.path(), Some(PEM));
        lane.create(&spec).await.expect("create");
        assert_eq!(
            read_in_run(&env, spec.id, TRUST_BUNDLE_PATH),
            format!("\n{PEM}")
        );
        lane.sandbox(spec.id).destroy().await.expect("destroy");

        // Without extra CAs the image's bundle is left alone.
        let spec = env.spec(NetworkTier::None, plain.path(), None);
        lane.create(&spec).await.expect("create");
        assert_eq!(
            read_in_run(&env, spec.id, TRUST_BUNDLE_PATH),
            "IMAGE BUNDLE\n"
        );
        lane.sandbox(spec.id).destroy().await.expect("destroy");
    });
}
