//! A real distribution registry (Debian's `docker-registry`) on loopback,
//! started per test with its own port and storage, and killed on drop.
//!
//! Images are pushed into it with `skopeo`, a client independent of the
//! one under test. Both come from `scripts/test-registry`; when they are
//! missing the tests fail and say so rather than skip.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

const REGISTRY_BIN: &str = "/usr/bin/docker-registry";

/// Fails the test unless `bin` exists, naming the script that installs it.
pub fn require(bin: &str) -> PathBuf {
    let path = if bin.starts_with('/') {
        PathBuf::from(bin)
    } else {
        std::env::var_os("PATH")
            .map(|paths| {
                std::env::split_paths(&paths)
                    .map(|p| p.join(bin))
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default()
            .into_iter()
            .find(|p| p.is_file())
            .unwrap_or_else(|| PathBuf::from(bin))
    };
    assert!(
        path.is_file(),
        "{bin} is not installed: the registry pull tests need docker-registry, skopeo and \
         htpasswd; run scripts/test-registry (as root) to install them"
    );
    path
}

/// How a test registry authenticates.
pub enum Auth {
    /// Anyone may push and pull.
    None,
    /// HTTP basic auth against an htpasswd file (bcrypt) with one user.
    Htpasswd { user: String, password: String },
    /// Bearer tokens from a token service (see `token.rs`).
    Token {
        realm: String,
        service: String,
        issuer: String,
        root_cert_pem: String,
    },
}

/// A running registry. Killed (by its PID, through its `Child`) on drop.
pub struct Registry {
    child: Child,
    /// `127.0.0.1:PORT`.
    pub addr: String,
    dir: TempDir,
    /// Credentials skopeo pushes with, if the registry wants any.
    push_creds: Option<String>,
}

/// How to push.
#[derive(Default, Clone, Copy)]
pub struct Push<'a> {
    /// Push every image of an index (`--all`).
    pub all: bool,
    /// Convert the manifest format (`--format v2s2` for Docker's).
    pub format: Option<&'a str>,
}

impl Registry {
    /// Starts an open registry.
    pub fn start() -> Self {
        Self::start_with(Auth::None)
    }

    /// Starts a registry with the given authentication.
    pub fn start_with(auth: Auth) -> Self {
        require(REGISTRY_BIN);
        let dir = tempfile::tempdir().unwrap();
        let storage = dir.path().join("storage");
        std::fs::create_dir(&storage).unwrap();
        let (auth_yaml, push_creds) = match &auth {
            Auth::None => (String::new(), None),
            Auth::Htpasswd { user, password } => {
                let htpasswd = require("htpasswd");
                let out = Command::new(htpasswd)
                    .args(["-Bbn", user, password])
                    .output()
                    .unwrap();
                assert!(
                    out.status.success(),
                    "htpasswd: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
                let file = dir.path().join("htpasswd");
                std::fs::write(&file, &out.stdout).unwrap();
                (
                    format!(
                        "auth:\n  htpasswd:\n    realm: runbox-test\n    path: {}\n",
                        file.display()
                    ),
                    Some(format!("{user}:{password}")),
                )
            }
            Auth::Token {
                realm,
                service,
                issuer,
                root_cert_pem,
            } => {
                let bundle = dir.path().join("token-ca.pem");
                std::fs::write(&bundle, root_cert_pem).unwrap();
                (
                    format!(
                        "auth:\n  token:\n    realm: {realm}\n    service: {service}\n    \
                         issuer: {issuer}\n    rootcertbundle: {}\n",
                        bundle.display()
                    ),
                    // Set by the test that knows the token service's users.
                    None,
                )
            }
        };
        // The port is picked by binding :0 and releasing it; another process
        // could take it in between, so a registry that fails to start for
        // that reason is retried on a new port.
        let log_path = dir.path().join("registry.log");
        for _attempt in 0..5 {
            let port = TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            let addr = format!("127.0.0.1:{port}");
            let config = format!(
                "version: 0.1\n\
                 log:\n  level: warn\n  formatter: text\n\
                 storage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\n\
                 http:\n  addr: {addr}\n  secret: runbox-test-secret\n{auth_yaml}",
                storage.display()
            );
            let config_path = dir.path().join("config.yml");
            std::fs::write(&config_path, config).unwrap();
            let log = std::fs::File::create(&log_path).unwrap();
            let mut child = Command::new(REGISTRY_BIN)
                .arg("serve")
                .arg(&config_path)
                .stdin(Stdio::null())
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .expect("start docker-registry");
            if wait_ready(&mut child, &addr, &log_path) {
                return Registry {
                    child,
                    addr,
                    dir,
                    push_creds,
                };
            }
            let _ = child.kill();
            let _ = child.wait();
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            assert!(
                log.contains("address already in use"),
                "docker-registry did not start; its log:\n{log}"
            );
        }
        panic!("docker-registry found no free port in 5 attempts");
    }

    /// Sets the credentials skopeo pushes with (`user:password`).
    pub fn set_push_creds(&mut self, creds: &str) {
        self.push_creds = Some(creds.to_string());
    }

    /// Pushes `layout:tag` (an OCI layout) to `dest` (`name:tag`).
    pub fn push(&self, layout: &Path, tag: &str, dest: &str, how: Push<'_>) {
        let skopeo = require("skopeo");
        let mut cmd = Command::new(skopeo);
        // Our own policy and auth files: nothing from the host's
        // /etc/containers or ~/.docker changes what is pushed.
        cmd.args([
            "--insecure-policy",
            "copy",
            "--quiet",
            "--dest-tls-verify=false",
        ]);
        cmd.arg("--authfile").arg(self.dir.path().join("auth.json"));
        if how.all {
            cmd.arg("--all");
        }
        match how.format {
            Some(format) => {
                cmd.args(["--format", format]);
            }
            None => {
                cmd.arg("--preserve-digests");
            }
        }
        if let Some(creds) = &self.push_creds {
            cmd.arg("--dest-creds").arg(creds);
        }
        cmd.arg(format!("oci:{}:{tag}", layout.display()));
        cmd.arg(format!("docker://{}/{dest}", self.addr));
        let out = cmd
            .env("HOME", self.dir.path())
            .output()
            .expect("run skopeo");
        assert!(
            out.status.success(),
            "skopeo copy to {dest} failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Everything the registry logged so far, access log included.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("registry.log")).unwrap_or_default()
    }

    /// How many times the blob `digest` was fetched (GET) so far.
    pub fn blob_gets(&self, digest: &str) -> usize {
        let needle = format!("/blobs/{digest} HTTP/");
        self.log()
            .lines()
            .filter(|l| l.contains("\"GET /v2/") && l.contains(&needle))
            .count()
    }

    /// Where the registry stores the blob `digest` on disk.
    pub fn blob_path(&self, digest: &str) -> PathBuf {
        let hex = digest.strip_prefix("sha256:").unwrap();
        self.dir
            .path()
            .join("storage/docker/registry/v2/blobs/sha256")
            .join(&hex[..2])
            .join(hex)
            .join("data")
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until the registry at `addr` answers `/v2/`; false if it exited.
fn wait_ready(child: &mut Child, addr: &str, log: &Path) -> bool {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return false;
        }
        if let Ok(mut conn) = TcpStream::connect(addr) {
            let _ = conn.set_read_timeout(Some(Duration::from_secs(2)));
            let req = format!("GET /v2/ HTTP/1.0\r\nHost: {addr}\r\n\r\n");
            let mut buf = [0u8; 32];
            if conn.write_all(req.as_bytes()).is_ok()
                && conn.read(&mut buf).is_ok_and(|n| n > 0)
                && buf.starts_with(b"HTTP/1.")
            {
                return true;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!(
        "docker-registry on {addr} did not become ready; its log:\n{}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
}
