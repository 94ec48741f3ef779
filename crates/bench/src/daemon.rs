//! One `runbox serve` process under test, with its own state directory.
//!
//! Owns the daemon's life: starting the real binary on `127.0.0.1:0`,
//! waiting for `<state>/serve.addr`, importing the benchmark's root
//! filesystem, remembering every run it creates, and tearing all of it down
//! again: runs deleted through the API, the daemon stopped by its pid, then
//! `runbox serve --teardown` for whatever is left. [`Drop`] does the last two
//! steps too, so an error or a panic does not leave containers behind. The
//! images phase also imports, pulls and deletes images through it.
//!
//! It does not time anything; `main` does.

use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use futures::StreamExt as _;
use runbox_client::{Client, PullUpdate, UploadBody};
use runbox_types::{CreateRunRequest, Image, PullEvent, PullRequest, Run};
use ulid::Ulid;

/// How long the daemon may take to start (it starts a probe container).
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// How long the daemon gets to stop on SIGTERM before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// Bound on any single API call made outside the timed sections.
const API_TIMEOUT: Duration = Duration::from_secs(60);

/// Bound on an import or a pull of a large image (hundreds of MiB on a slow,
/// busy host), outside or inside the timed sections alike.
pub const IMAGE_TIMEOUT: Duration = Duration::from_secs(600);

/// The image every run of the exec and create phases uses.
pub const IMAGE: &str = "base";

/// A running daemon.
pub struct Daemon {
    /// The OCI runtime it was told to use.
    pub runtime: String,
    /// A client holding the daemon's token.
    pub client: Client,
    runbox: PathBuf,
    state: Option<tempfile::TempDir>,
    child: Option<Child>,
    /// Runs created and not yet deleted.
    runs: Vec<Ulid>,
}

impl Daemon {
    /// Starts `runbox serve --runtime <runtime>` with a fresh state directory
    /// and waits until it serves.
    pub async fn start(runbox: &Path, agent: &Path, runtime: &str) -> anyhow::Result<Daemon> {
        Daemon::start_with(runbox, agent, runtime, &[]).await
    }

    /// [`Daemon::start`] with extra `serve` arguments (the environment is
    /// the benchmark's own, AWS variables included).
    pub async fn start_with(
        runbox: &Path,
        agent: &Path,
        runtime: &str,
        extra: &[String],
    ) -> anyhow::Result<Daemon> {
        Daemon::start_prepared(runbox, agent, runtime, extra, |_| Ok(())).await
    }

    /// [`Daemon::start_with`], with `prepare` given the state directory
    /// before the daemon starts (to seed state files).
    pub async fn start_prepared(
        runbox: &Path,
        agent: &Path,
        runtime: &str,
        extra: &[String],
        prepare: impl FnOnce(&Path) -> anyhow::Result<()>,
    ) -> anyhow::Result<Daemon> {
        Daemon::start_full(runbox, agent, runtime, "127.0.0.1:0", extra, &[], prepare).await
    }

    /// [`Daemon::start_with`] listening on `listen`, with `env` added to
    /// its environment.
    pub async fn start_listening(
        runbox: &Path,
        agent: &Path,
        runtime: &str,
        listen: &str,
        extra: &[String],
        env: &[(&str, &str)],
    ) -> anyhow::Result<Daemon> {
        Daemon::start_full(runbox, agent, runtime, listen, extra, env, |_| Ok(())).await
    }

    async fn start_full(
        runbox: &Path,
        agent: &Path,
        runtime: &str,
        listen: &str,
        extra: &[String],
        env: &[(&str, &str)],
        prepare: impl FnOnce(&Path) -> anyhow::Result<()>,
    ) -> anyhow::Result<Daemon> {
        let state = tempfile::Builder::new()
            .prefix(&format!("runbox-bench-{runtime}-"))
            .tempdir_in("/tmp")
            .context("creating a state directory")?;
        prepare(state.path())?;
        let log = std::fs::File::create(state.path().join("daemon.log"))
            .context("creating the daemon log")?;
        let child = Command::new(runbox)
            .arg("serve")
            .arg("--listen")
            .arg(listen)
            .arg("--state-dir")
            .arg(state.path())
            .arg("--agent")
            .arg(agent)
            .arg("--runtime")
            .arg(runtime)
            // Runs get disk limits in a store of the daemon's own, as
            // `scripts/setup` starts it (sparse: only what runs write counts).
            .args(["--storage-gb", "8"])
            // The interactive phase's preview URLs.
            .args(["--preview-listen", "127.0.0.1:0"])
            .args(extra)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            // Its own process group: a ctrl-c at the terminal reaches only
            // the benchmark, which then deletes the runs through this daemon
            // before stopping it.
            .process_group(0)
            .spawn()
            .with_context(|| format!("spawning {}", runbox.display()))?;
        let mut daemon = Daemon {
            runtime: runtime.to_owned(),
            client: Client::anonymous("http://127.0.0.1:1")?,
            runbox: runbox.to_owned(),
            state: Some(state),
            child: Some(child),
            runs: Vec::new(),
        };
        daemon.wait_until_serving().await?;
        Ok(daemon)
    }

    async fn wait_until_serving(&mut self) -> anyhow::Result<()> {
        let addr_file = self.state_dir().join("serve.addr");
        let deadline = Instant::now() + START_TIMEOUT;
        let addr = loop {
            if let Ok(addr) = std::fs::read_to_string(&addr_file) {
                break addr;
            }
            if let Some(child) = self.child.as_mut() {
                if let Some(status) = child.try_wait()? {
                    bail!(
                        "runbox serve exited with {status}; log:\n{}",
                        self.log_tail()
                    );
                }
            }
            if Instant::now() > deadline {
                bail!(
                    "runbox serve did not start within {START_TIMEOUT:?}; log:\n{}",
                    self.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let token = std::fs::read_to_string(self.state_dir().join("token"))
            .context("reading the daemon's token")?;
        self.client = Client::new(&format!("http://{}", addr.trim()), token.trim())?;
        Ok(())
    }

    /// The daemon's state directory.
    pub fn state_dir(&self) -> &Path {
        self.state
            .as_ref()
            .map(tempfile::TempDir::path)
            .unwrap_or(Path::new("/nonexistent"))
    }

    /// Where the daemon's runtime keeps its containers' state (`--root`).
    pub fn runtime_root(&self) -> PathBuf {
        runbox_runtime::oci::runtime_root(self.state_dir(), &self.runtime)
    }

    /// The last lines of the daemon's log, for error messages.
    pub fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.state_dir().join("daemon.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// Imports `tar` (an uncompressed tarball) as [`IMAGE`].
    pub async fn import(&self, tar: Vec<u8>) -> anyhow::Result<()> {
        let len = tar.len() as u64;
        let body = UploadBody::from_stream(
            futures::stream::once(async move { Ok::<_, std::io::Error>(bytes::Bytes::from(tar)) }),
            Some(len),
        );
        tokio::time::timeout(API_TIMEOUT, self.client.import_image(IMAGE, body))
            .await
            .context("importing the image timed out")?
            .with_context(|| format!("importing the image; log:\n{}", self.log_tail()))?;
        Ok(())
    }

    /// Imports the image archive at `path` (an OCI layout tarball here) as
    /// `name`, streaming it from the file.
    pub async fn import_file(&self, name: &str, path: &Path) -> anyhow::Result<Image> {
        let file = tokio::fs::File::open(path)
            .await
            .with_context(|| format!("opening {}", path.display()))?;
        let body = UploadBody::from_file(file).await?;
        tokio::time::timeout(IMAGE_TIMEOUT, self.client.import_image(name, body))
            .await
            .with_context(|| format!("importing image {name} timed out"))?
            .with_context(|| format!("importing image {name}; log:\n{}", self.log_tail()))
    }

    /// `POST /v1/images/pull` of `reference` as `name`, until the `done`
    /// event. Returns the image and every progress event, in order.
    pub async fn pull(
        &self,
        reference: &str,
        name: &str,
    ) -> anyhow::Result<(Image, Vec<PullEvent>)> {
        let req = PullRequest {
            reference: reference.to_owned(),
            name: Some(name.to_owned()),
            ..Default::default()
        };
        let pull = async {
            let mut stream = self.client.pull_image(&req).await?;
            let mut events = Vec::new();
            while let Some(update) = stream.next().await {
                match update? {
                    PullUpdate::Progress(event) => events.push(event),
                    PullUpdate::Done(image) => return Ok((image, events)),
                }
            }
            bail!("the pull stream ended without a result")
        };
        tokio::time::timeout(IMAGE_TIMEOUT, pull)
            .await
            .with_context(|| format!("pulling {reference} timed out"))?
            .with_context(|| format!("pulling {reference}; log:\n{}", self.log_tail()))
    }

    /// `DELETE /v1/images/{name}`; the daemon then removes the layers no
    /// other image uses before it answers.
    pub async fn delete_image(&self, name: &str) -> anyhow::Result<()> {
        tokio::time::timeout(IMAGE_TIMEOUT, self.client.delete_image(name))
            .await
            .with_context(|| format!("deleting image {name} timed out"))?
            .with_context(|| format!("deleting image {name}; log:\n{}", self.log_tail()))
    }

    /// `POST /v1/runs` of [`IMAGE`] with default settings, remembering the
    /// run for cleanup. Not bounded by a timeout: callers time it.
    pub async fn create_run(&mut self) -> anyhow::Result<Run> {
        self.create_run_of(IMAGE).await
    }

    /// `POST /v1/runs` of `image` with default settings, remembering the
    /// run for cleanup. Not bounded by a timeout: callers time it.
    pub async fn create_run_of(&mut self, image: &str) -> anyhow::Result<Run> {
        self.create_run_with(CreateRunRequest {
            image: image.into(),
            ..Default::default()
        })
        .await
    }

    /// `POST /v1/runs` of `req`, remembering the run for cleanup. Not
    /// bounded by a timeout: callers time it.
    pub async fn create_run_with(&mut self, req: CreateRunRequest) -> anyhow::Result<Run> {
        let run = self
            .client
            .create_run(&req)
            .await
            .with_context(|| format!("creating a run; log:\n{}", self.log_tail()))?;
        self.runs.push(run.id);
        Ok(run)
    }

    /// The runs made and not yet deleted.
    pub fn runs_made(&self) -> Vec<Ulid> {
        self.runs.clone()
    }

    /// Remembers a run made another way (a fork's child) for cleanup.
    pub fn remember(&mut self, id: Ulid) {
        self.runs.push(id);
    }

    /// `DELETE /v1/runs/{id}`, forgetting the run once it is gone.
    pub async fn delete_run(&mut self, id: Ulid) -> anyhow::Result<()> {
        tokio::time::timeout(API_TIMEOUT, self.client.delete_run(&id.to_string()))
            .await
            .context("deleting a run timed out")?
            .with_context(|| format!("deleting run {id}; log:\n{}", self.log_tail()))?;
        self.runs.retain(|r| *r != id);
        Ok(())
    }

    /// Deletes every remembered run, stops the daemon and tears down
    /// whatever of its state is left. Reports problems on stderr and goes on:
    /// cleanup must get as far as it can.
    pub async fn shutdown(mut self) {
        for id in self.runs.clone() {
            // One deleted another way (through another node) is gone already.
            let gone = self
                .client
                .get_run(&id.to_string())
                .await
                .is_err_and(|e| e.code() == Some(runbox_types::ErrorCode::RunNotFound));
            if gone {
                continue;
            }
            if let Err(e) = self.delete_run(id).await {
                eprintln!("runbox-bench: {e:#}");
            }
        }
        if let Some(mut child) = self.child.take() {
            stop(&mut child).await;
        }
        self.teardown();
    }

    /// `runbox serve --teardown`, then removes the state directory, unless
    /// the teardown failed: then it is kept (mounts may remain under it) and
    /// its path printed.
    fn teardown(&mut self) {
        let Some(state) = self.state.take() else {
            return;
        };
        let out = Command::new(&self.runbox)
            .arg("serve")
            .arg("--teardown")
            .arg("--state-dir")
            .arg(state.path())
            .stdin(Stdio::null())
            .output();
        let failure = match out {
            Ok(o) if o.status.success() => None,
            Ok(o) => Some(String::from_utf8_lossy(&o.stderr).trim().to_owned()),
            Err(e) => Some(e.to_string()),
        };
        if let Some(why) = failure {
            let kept = state.keep();
            eprintln!(
                "runbox-bench: tearing down {} failed, left in place: {why}",
                kept.display()
            );
        }
    }
}

impl Drop for Daemon {
    /// The error and panic path: no API calls (there may be no runtime to
    /// drive them), just kill the daemon and tear its runs down.
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.teardown();
    }
}

/// SIGTERM, then SIGKILL if the daemon has not exited after [`STOP_TIMEOUT`].
async fn stop(child: &mut Child) {
    let pid = rustix::process::Pid::from_raw(child.id() as i32);
    if let Some(pid) = pid {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
    }
    let deadline = Instant::now() + STOP_TIMEOUT;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!("runbox-bench: the daemon ignored SIGTERM; killing it");
    let _ = child.kill();
    let _ = child.wait();
}

/// Execs `/bin/true` in run `id` until its exit event; the time it took.
pub async fn exec_true(client: &Client, id: &str) -> anyhow::Result<Duration> {
    let req = runbox_types::ExecRequest {
        cmd: vec!["/bin/true".into()],
        ..Default::default()
    };
    let started = Instant::now();
    let out = client.exec(id, &req).await?.collect_output().await?;
    anyhow::ensure!(out.exit.exit_code == 0, "/bin/true failed: {:?}", out.exit);
    Ok(started.elapsed())
}
