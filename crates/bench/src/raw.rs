//! The baselines: the OCI runtimes and bubblewrap driven directly, without
//! runbox in between.
//!
//! Owns the bench's own bundles (one per runtime, under the work directory),
//! their `--root` state directories and their cgroups
//! (`/runbox-bench/<bench pid>-<runtime>-<n>`), and removing all three again.
//! The bundle's config is runbox's own ([`runbox_runtime::spec::build`]):
//! same mounts, namespaces, capabilities, seccomp filter and limits, with
//! three differences: the process is `/bin/true` instead of the agent, the
//! runtime makes a new network namespace itself instead of joining one made
//! with `ip netns`, and the root is the busybox directory itself instead of a
//! per-run overlay mount.
//!
//! Every command gets its own process group, so that a ctrl-c at the
//! terminal reaches only the benchmark, and `/dev/null` for stdin and stdout;
//! stderr goes to a file that is read only when the command fails.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use oci_spec::runtime::Spec;
use runbox_runtime::spec::{self, SpecParams};
use runbox_types::Limits;
use tokio::process::Command;

/// The agent's environment in runbox's own configs.
const PATH_ENV: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// The cgroup directory (under every hierarchy) holding the bench's
/// containers.
const CGROUP_PARENT: &str = "runbox-bench";

/// Bound on one baseline command; far above any sane latency, it only keeps
/// a wedged runtime from hanging the benchmark.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);

/// What the `true` commands run: the busybox applet in the image.
pub const TRUE: &str = "/bin/true";

/// Whether `program --version` runs and succeeds.
pub fn installed(program: &str) -> bool {
    std::process::Command::new(program)
        .arg("--version")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The first line of `program --version`, for the report.
pub fn version(program: &str) -> String {
    std::process::Command::new(program)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .map(str::to_owned)
        })
        .unwrap_or_else(|| "unknown".to_owned())
}

/// Runs a prepared command and returns how long it took from spawn to exit,
/// or an error carrying its stderr when it failed.
///
/// Cancellation: dropping the future kills the command (`kill_on_drop`); a
/// runtime killed half-way may leave a container, which [`Bundle::cleanup`]
/// removes.
async fn timed(cmd: Command, stderr_file: &Path) -> anyhow::Result<Duration> {
    timed_within(cmd, stderr_file, COMMAND_TIMEOUT).await
}

/// [`timed`] with its own bound, for commands that take seconds (`tar -xf`
/// of a large layer).
pub async fn timed_within(
    mut cmd: Command,
    stderr_file: &Path,
    limit: Duration,
) -> anyhow::Result<Duration> {
    let stderr = std::fs::File::create(stderr_file).context("creating the stderr file")?;
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .process_group(0)
        .kill_on_drop(true);
    let start = Instant::now();
    let status = tokio::time::timeout(limit, cmd.status())
        .await
        .with_context(|| format!("{cmd:?} did not finish within {limit:?}"))?
        .with_context(|| format!("spawning {cmd:?}"))?;
    let elapsed = start.elapsed();
    if !status.success() {
        let err = std::fs::read_to_string(stderr_file).unwrap_or_default();
        bail!("{cmd:?} failed ({status}): {}", err.trim());
    }
    Ok(elapsed)
}

/// `<runtime> --root <root> exec <cid> /bin/true`, timed.
pub async fn exec(
    runtime: &str,
    root: &Path,
    cid: &str,
    stderr_file: &Path,
) -> anyhow::Result<Duration> {
    let mut cmd = Command::new(runtime);
    cmd.arg("--root").arg(root).args(["exec", cid, TRUE]);
    timed(cmd, stderr_file).await
}

/// `bwrap --ro-bind <rootfs> / --proc /proc --dev /dev --unshare-all
/// /bin/true`, timed: the cheapest sandbox start on the host, as a floor.
pub async fn bwrap(rootfs: &Path, stderr_file: &Path) -> anyhow::Result<Duration> {
    let mut cmd = Command::new("bwrap");
    cmd.arg("--ro-bind").arg(rootfs).arg("/").args([
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--unshare-all",
        TRUE,
    ]);
    timed(cmd, stderr_file).await
}

/// One runtime's bundle for `<runtime> run`: a config whose process is
/// `/bin/true`, rewritten before each run with a fresh cgroup.
pub struct Bundle {
    runtime: String,
    dir: PathBuf,
    root: PathBuf,
    spec: Spec,
    prefix: String,
    next: usize,
}

impl Bundle {
    /// A bundle for `runtime` under `work`, on `rootfs`, with `limits`.
    /// `agent` is only bind-mounted (as in runbox's own config), never run.
    pub fn new(
        runtime: &str,
        work: &Path,
        rootfs: &Path,
        agent: &Path,
        limits: &Limits,
    ) -> anyhow::Result<Bundle> {
        let dir = work.join(format!("bundle-{runtime}"));
        let root = work.join(format!("oci-{runtime}"));
        for d in [&dir, &root] {
            std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
        }
        let env = [PATH_ENV.to_owned()];
        let params = SpecParams {
            rootfs,
            agent_binary: agent,
            agent_args: &[],
            hostname: "runbox",
            netns_path: None,
            // Replaced before every run.
            cgroups_path: "/runbox-bench/placeholder",
            limits,
            swap_limit: host_has_swap_accounting(),
            env: &env,
            files: &[],
            volume: None,
            volumes: &[],
            userns: None,
            seccomp_bpf: None,
        };
        let mut spec = spec::build(&params).context("building the bundle config")?;
        spec.process_mut()
            .as_mut()
            .context("the config has no process")?
            .set_args(Some(vec![TRUE.to_owned()]));
        Ok(Bundle {
            runtime: runtime.to_owned(),
            dir,
            root,
            spec,
            prefix: cgroup_prefix(runtime),
            next: 0,
        })
    }

    /// The runtime this bundle is for.
    pub fn runtime(&self) -> &str {
        &self.runtime
    }

    /// Writes a config with a fresh cgroup (not timed), then times
    /// `<runtime> --root <root> run --bundle <dir> <cid>`: create, start,
    /// wait for `/bin/true`, delete.
    pub async fn run(&mut self, stderr_file: &Path) -> anyhow::Result<Duration> {
        let n = self.next;
        self.next += 1;
        let cgroup = format!("/{CGROUP_PARENT}/{}{n}", self.prefix);
        self.spec
            .linux_mut()
            .as_mut()
            .context("the config has no linux section")?
            .set_cgroups_path(Some(PathBuf::from(cgroup)));
        let config = self.dir.join("config.json");
        self.spec
            .save(&config)
            .with_context(|| format!("writing {}", config.display()))?;
        let mut cmd = Command::new(&self.runtime);
        cmd.arg("--root")
            .arg(&self.root)
            .arg("run")
            .arg("--bundle")
            .arg(&self.dir)
            .arg(format!("bench-{n}"));
        timed(cmd, stderr_file).await
    }

    /// Force-deletes any container left in this bundle's `--root` (a run
    /// interrupted half-way) and removes its cgroups.
    pub fn cleanup(&self) {
        if self.root.exists() {
            let listed = std::process::Command::new(&self.runtime)
                .arg("--root")
                .arg(&self.root)
                .args(["list", "-q"])
                .stdin(Stdio::null())
                .stderr(Stdio::null())
                .output();
            if let Ok(out) = listed {
                for cid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                    let deleted = std::process::Command::new(&self.runtime)
                        .arg("--root")
                        .arg(&self.root)
                        .args(["delete", "--force", cid])
                        .stdin(Stdio::null())
                        .stdout(Stdio::null())
                        .stderr(Stdio::null())
                        .status();
                    if !deleted.is_ok_and(|s| s.success()) {
                        eprintln!(
                            "runbox-bench: {} could not delete container {cid} in {}",
                            self.runtime,
                            self.root.display()
                        );
                    }
                }
            }
        }
        remove_cgroups(&self.prefix);
    }
}

/// The name prefix of this process's cgroups for `runtime`, so that two
/// benchmarks at once do not remove each other's.
fn cgroup_prefix(runtime: &str) -> String {
    format!("{}-{runtime}-", std::process::id())
}

/// Removes `/sys/fs/cgroup/*/runbox-bench/<prefix>*` (and the cgroup v2
/// equivalent), then `runbox-bench` itself where it is empty. The runtimes
/// remove a container's cgroup when they delete it; this is for the ones an
/// interrupted run left.
fn remove_cgroups(prefix: &str) {
    let base = Path::new("/sys/fs/cgroup");
    let mut parents = vec![base.join(CGROUP_PARENT)];
    if let Ok(hierarchies) = std::fs::read_dir(base) {
        parents.extend(hierarchies.flatten().map(|h| h.path().join(CGROUP_PARENT)));
    }
    for parent in parents {
        let Ok(children) = std::fs::read_dir(&parent) else {
            continue;
        };
        for child in children.flatten() {
            let is_ours = child.file_name().to_string_lossy().starts_with(prefix);
            if is_ours && child.path().is_dir() {
                if let Err(e) = std::fs::remove_dir(child.path()) {
                    eprintln!(
                        "runbox-bench: removing cgroup {}: {e}",
                        child.path().display()
                    );
                }
            }
        }
        // Fails while another benchmark still has cgroups there; fine.
        let _ = std::fs::remove_dir(&parent);
    }
}

/// Whether the host accounts swap in the memory cgroup; runbox sets the
/// memory+swap limit exactly then, and so must the bench's bundles.
fn host_has_swap_accounting() -> bool {
    let v2 = Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
    v2 || Path::new("/sys/fs/cgroup/memory/memory.memsw.limit_in_bytes").exists()
}
