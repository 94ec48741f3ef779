//! Finding an OCI runtime that works on this host.
//!
//! "Installed" is not "works": crun 1.8 refuses hybrid cgroup v1 hosts until a
//! hugetlb hierarchy is mounted, runsc may lack the kernel features it wants.
//! So the probe starts a real, tiny container (the agent printing its version
//! from an empty root) with each candidate, and keeps the first that succeeds.
//! When none does, the error lists every candidate, why it failed, and how to
//! fix it.

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::process::Command;
use ulid::Ulid;

use crate::spec::{self, SpecParams};

/// Runtimes tried, in order, when none is named: crun starts containers
/// several times faster than runc, so it goes first.
pub const DEFAULT_CANDIDATES: &[&str] = &["crun", "runc"];

/// How long the probe container may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(30);

/// An OCI runtime binary.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Runtime {
    /// Its short name (`runc`, `crun`, `runsc`, or the file name of a path).
    pub name: String,
    /// The binary.
    pub path: PathBuf,
}

impl Runtime {
    /// Looks `name` up: a path is taken as is, a bare name is searched in PATH.
    pub fn find(name: &str) -> Option<Runtime> {
        let path = if name.contains('/') {
            let p = PathBuf::from(name);
            p.is_file().then_some(p)?
        } else {
            which(name)?
        };
        let short = path.file_name()?.to_string_lossy().into_owned();
        Some(Runtime { name: short, path })
    }

    /// A command for this runtime with its state under `root` and its log in `log`.
    pub fn command(&self, root: &Path, log: &Path) -> Command {
        let mut cmd = Command::new(&self.path);
        // Under systemd the daemon's NOTIFY_SOCKET is its own; runc and
        // crun would otherwise pass it into the run.
        cmd.env_remove("NOTIFY_SOCKET");
        cmd.arg("--root").arg(root);
        if self.name != "runsc" {
            cmd.arg("--log").arg(log).arg("--log-format").arg("json");
        }
        cmd
    }

    /// The container's status (`created`, `running`, `stopped`), or None when
    /// the runtime does not know it.
    pub async fn status(&self, root: &Path, cid: &str) -> Option<String> {
        let mut cmd = self.command(root, Path::new("/dev/null"));
        cmd.args(["state", cid])
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        let out = tokio::time::timeout(PROBE_TIMEOUT, cmd.output())
            .await
            .ok()?
            .ok()?;
        if !out.status.success() {
            return None;
        }
        let state: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
        state.get("status")?.as_str().map(str::to_owned)
    }

    /// Whether the runtime knows container `cid`.
    pub async fn has_container(&self, root: &Path, cid: &str) -> bool {
        self.status(root, cid).await.is_some()
    }

    /// Whether container `cid` may exist, without starting a process where
    /// the runtime's state layout is known: runc and crun keep each
    /// container's state in `<root>/<cid>/` (`state.json`, `status`). Other
    /// runtimes are asked (`state`).
    pub async fn may_have_container(&self, root: &Path, cid: &str) -> bool {
        match self.name.as_str() {
            "runc" | "crun" => root.join(cid).exists(),
            _ => self.has_container(root, cid).await,
        }
    }

    /// The ids of every container under `root`.
    pub async fn list(&self, root: &Path) -> Vec<String> {
        let mut cmd = self.command(root, Path::new("/dev/null"));
        cmd.args(["list", "--format", "json"])
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        let Ok(Ok(out)) = tokio::time::timeout(PROBE_TIMEOUT, cmd.output()).await else {
            return Vec::new();
        };
        let Ok(list) = serde_json::from_slice::<serde_json::Value>(&out.stdout) else {
            return Vec::new();
        };
        list.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|c| c.get("id")?.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// The first `name` on `PATH` (or the usual system directories without one).
pub(crate) fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")
        .unwrap_or_else(|| "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into());
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// Why no runtime could be used.
#[derive(Debug)]
pub struct NoRuntime {
    /// Each candidate and why it failed.
    pub attempts: Vec<(String, String)>,
}

impl fmt::Display for NoRuntime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "no OCI runtime works on this host; tried:")?;
        for (name, why) in &self.attempts {
            writeln!(f, "  - {name}: {why}")?;
        }
        write!(
            f,
            "install one with `apt-get install -y runc crun` (or pass --runtime PATH)"
        )
    }
}

impl std::error::Error for NoRuntime {}

/// Picks the runtime: `wanted` if given (it must work), else the first of
/// [`DEFAULT_CANDIDATES`] that starts a probe container. Probe files live
/// under `state_dir` and are removed afterwards.
pub async fn select(
    wanted: Option<&str>,
    state_dir: &Path,
    agent_binary: &Path,
) -> Result<Runtime, NoRuntime> {
    let candidates: Vec<&str> = match wanted {
        Some(name) => vec![name],
        None => DEFAULT_CANDIDATES.to_vec(),
    };
    let mut attempts = Vec::new();
    for name in candidates {
        let Some(runtime) = Runtime::find(name) else {
            let hint = match name {
                "runc" | "crun" => format!("not installed (apt-get install -y {name})"),
                "runsc" => "not installed (Debian: apt-get install -y runsc)".to_owned(),
                _ => "not found in PATH and not an existing file".to_owned(),
            };
            attempts.push((name.to_owned(), hint));
            continue;
        };
        match probe(&runtime, state_dir, agent_binary).await {
            Ok(()) => return Ok(runtime),
            Err(why) => {
                tracing::info!(runtime = %runtime.path.display(), %why, "runtime probe failed");
                attempts.push((format!("{} ({})", name, runtime.path.display()), why));
            }
        }
    }
    Err(NoRuntime { attempts })
}

/// Starts a throw-away container whose only process is `runbox-agent --version`.
async fn probe(runtime: &Runtime, state_dir: &Path, agent_binary: &Path) -> Result<(), String> {
    let id = Ulid::new();
    let bundle = state_dir.join(format!("probe-{id}"));
    let rootfs = bundle.join("rootfs");
    std::fs::create_dir_all(&rootfs).map_err(|e| format!("creating {}: {e}", rootfs.display()))?;
    let result = probe_in(runtime, state_dir, agent_binary, &bundle, &rootfs, id).await;
    let root = crate::oci::runtime_root(state_dir, &runtime.name);
    let mut delete = runtime.command(&root, Path::new("/dev/null"));
    delete
        .args(["delete", "--force", &format!("runbox-probe-{id}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let _ = delete.status().await;
    let _ = std::fs::remove_dir_all(&bundle);
    result
}

async fn probe_in(
    runtime: &Runtime,
    state_dir: &Path,
    agent_binary: &Path,
    bundle: &Path,
    rootfs: &Path,
    id: Ulid,
) -> Result<(), String> {
    let limits = runbox_types::Limits {
        cpus: 1.0,
        memory_mb: 64,
        disk_mb: None,
        pids: 16,
    };
    let args = ["--version".to_owned()];
    let cgroups_path = format!("/runbox/probe-{id}");
    let params = SpecParams {
        rootfs,
        agent_binary,
        agent_args: &args,
        hostname: "runbox-probe",
        netns_path: None,
        cgroups_path: &cgroups_path,
        limits: &limits,
        swap_limit: false,
        env: &[],
        files: &[],
        volume: None,
        volumes: &[],
        userns: None,
        seccomp_bpf: None,
    };
    let config = spec::build(&params).map_err(|e| format!("building the probe config: {e}"))?;
    let json = serde_json::to_vec(&config).map_err(|e| e.to_string())?;
    std::fs::write(bundle.join("config.json"), json)
        .map_err(|e| format!("writing the probe config: {e}"))?;
    let root = crate::oci::runtime_root(state_dir, &runtime.name);
    let log = bundle.join("runtime.log");
    // The probe hands over a socket exactly as a real run does, so a runtime
    // that cannot pass file descriptors fails here, not at the first create.
    let socket = bundle.join("probe.sock");
    let listener = std::os::unix::net::UnixListener::bind(&socket)
        .map_err(|e| format!("binding {}: {e}", socket.display()))?;
    let mut cmd = runtime.command(&root, &log);
    crate::oci::pass_fd_as_3(&mut cmd, std::os::fd::AsRawFd::as_raw_fd(&listener));
    cmd.args(["run", "--preserve-fds", "1", "--bundle"])
        .arg(bundle)
        .arg(format!("runbox-probe-{id}"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let child = cmd.spawn().map_err(|e| format!("cannot execute: {e}"))?;
    let out = tokio::time::timeout(PROBE_TIMEOUT, child.wait_with_output())
        .await
        .map_err(|_| format!("the probe container did not finish within {PROBE_TIMEOUT:?}"))?
        .map_err(|e| e.to_string())?;
    drop(listener);
    let stdout = String::from_utf8_lossy(&out.stdout);
    if out.status.success() && stdout.contains("runbox-agent") {
        return Ok(());
    }
    let mut why = log_errors(&log);
    if why.is_empty() {
        // A runtime that rejects a flag prints its whole usage after the
        // one line that matters; keep the first few lines.
        let stderr = String::from_utf8_lossy(&out.stderr);
        why = stderr
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .take(3)
            .collect::<Vec<_>>()
            .join("; ");
    }
    if why.is_empty() {
        why = format!(
            "the probe container exited with {} and printed {:?}",
            out.status,
            bounded(&stdout, 200)
        );
    }
    if why.contains("hybrid") {
        why.push_str(
            "; on a hybrid cgroup v1 host crun needs a hugetlb hierarchy: \
             `mkdir -p /sys/fs/cgroup/hugetlb && mount -t cgroup -o hugetlb cgroup /sys/fs/cgroup/hugetlb`",
        );
    }
    Err(bounded(&why, 2000))
}

/// The error lines of a runtime's JSON log (runc and crun both write
/// `{"level": "...", "msg": "..."}` per line), joined; plain text lines are
/// kept as they are.
pub fn log_errors(log: &Path) -> String {
    let Ok(text) = std::fs::read_to_string(log) else {
        return String::new();
    };
    let mut lines = Vec::new();
    for line in text.lines().rev().take(50) {
        match serde_json::from_str::<serde_json::Value>(line) {
            Ok(v) => {
                let level = v.get("level").and_then(|l| l.as_str()).unwrap_or("");
                if matches!(level, "error" | "fatal" | "panic") {
                    if let Some(msg) = v.get("msg").and_then(|m| m.as_str()) {
                        lines.push(msg.to_owned());
                    }
                }
            }
            Err(_) if !line.trim().is_empty() => lines.push(line.trim().to_owned()),
            Err(_) => {}
        }
    }
    lines.reverse();
    lines.join("; ")
}

/// Cuts `s` to at most `max` characters.
pub fn bounded(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_errors_picks_error_lines() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("log");
        std::fs::write(
            &log,
            "{\"level\":\"info\",\"msg\":\"fine\"}\n{\"level\":\"error\",\"msg\":\"cgroups in hybrid mode not supported\"}\n",
        )
        .unwrap();
        assert_eq!(log_errors(&log), "cgroups in hybrid mode not supported");
        assert_eq!(log_errors(&dir.path().join("missing")), "");
    }

    #[test]
    fn missing_runtime_is_explained() {
        let err = NoRuntime {
            attempts: vec![(
                "crun".into(),
                "not installed (apt-get install -y crun)".into(),
            )],
        };
        let text = err.to_string();
        assert!(text.contains("crun: not installed"));
        assert!(text.contains("apt-get install"));
    }
}
