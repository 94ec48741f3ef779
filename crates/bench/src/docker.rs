//! A private Docker engine for the sleep phase's comparison: `dockerd` (from
//! Debian's `docker.io`, installed for the benchmark only by
//! `scripts/bench-docker`) started on its own socket, data root and exec
//! root under the work dir, with no bridge and no iptables rules, so it
//! touches none of the host's networking and leaves nothing behind: its
//! containers are removed, the daemon is stopped by its pid, and its
//! directories go with the work dir.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};

/// How long the engine may take to start.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// The image the benchmark's containers run, imported from the same root
/// filesystem as runbox's `base`.
pub const IMAGE: &str = "runbox-bench-base:latest";

/// A running private engine.
pub struct Docker {
    socket: PathBuf,
    child: Option<Child>,
    containers: Vec<String>,
}

impl Docker {
    /// Whether `dockerd` and `docker` are installed.
    pub fn available() -> bool {
        ["dockerd", "docker"].iter().all(|tool| {
            Command::new(tool)
                .arg("--version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
    }

    /// Starts `dockerd` with everything under `dir`, and imports `rootfs_tar`
    /// as [`IMAGE`].
    pub fn start(dir: &Path, rootfs_tar: &Path) -> anyhow::Result<Docker> {
        std::fs::create_dir_all(dir).context("creating the engine's directory")?;
        let socket = dir.join("docker.sock");
        let log = std::fs::File::create(dir.join("dockerd.log")).context("dockerd.log")?;
        let child = Command::new("dockerd")
            .arg("--host")
            .arg(format!("unix://{}", socket.display()))
            .arg("--data-root")
            .arg(dir.join("data"))
            .arg("--exec-root")
            .arg(dir.join("exec"))
            .arg("--pidfile")
            .arg(dir.join("dockerd.pid"))
            .args([
                "--bridge=none",
                "--iptables=false",
                "--ip6tables=false",
                "--ip-forward=false",
                "--ip-masq=false",
            ])
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting dockerd")?;
        let docker = Docker {
            socket,
            child: Some(child),
            containers: Vec::new(),
        };
        let deadline = Instant::now() + START_TIMEOUT;
        while docker.run(&["info"]).is_err() {
            if Instant::now() > deadline {
                bail!(
                    "dockerd did not answer within {START_TIMEOUT:?}: {}",
                    std::fs::read_to_string(dir.join("dockerd.log")).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        docker.run(&["import", &rootfs_tar.to_string_lossy(), IMAGE])?;
        Ok(docker)
    }

    /// `docker <args>` against this engine; its stdout.
    pub fn run(&self, args: &[&str]) -> anyhow::Result<String> {
        let out = Command::new("docker")
            .arg("--host")
            .arg(format!("unix://{}", self.socket.display()))
            .args(args)
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("docker {}", args.join(" ")))?;
        ensure!(
            out.status.success(),
            "docker {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// `docker <args>`, timed.
    pub fn timed(&self, args: &[&str]) -> anyhow::Result<Duration> {
        let started = Instant::now();
        self.run(args)?;
        Ok(started.elapsed())
    }

    /// Starts an idle container of [`IMAGE`] (no network, as runbox's
    /// `base` runs) and returns its id.
    pub fn idle_container(&mut self) -> anyhow::Result<String> {
        let id = self.run(&[
            "run",
            "--detach",
            "--network",
            "none",
            IMAGE,
            "sleep",
            "100000",
        ])?;
        self.containers.push(id.clone());
        Ok(id)
    }

    /// Removes the containers and stops the engine.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        for id in std::mem::take(&mut self.containers) {
            if let Err(e) = self.run(&["rm", "--force", &id]) {
                eprintln!("runbox-bench: {e:#}");
            }
        }
        if let Some(mut child) = self.child.take() {
            // SIGTERM: dockerd stops its containerd and cleans its mounts.
            if let Some(pid) = rustix::process::Pid::from_raw(child.id() as i32) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
            }
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                match child.try_wait() {
                    Ok(Some(_)) => break,
                    Ok(None) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(100))
                    }
                    _ => {
                        let _ = child.kill();
                        let _ = child.wait();
                        break;
                    }
                }
            }
        }
    }
}

impl Drop for Docker {
    fn drop(&mut self) {
        self.stop();
    }
}
