//! The run registry and lifecycle: create, exec, files, renew, delete, the
//! reaper, and reconciliation after a restart.
//!
//! ```text
//!                create()                       delete() / reaper (TTL)
//!   (request) ───────────► Creating ──ok──► Running ──────────────► Stopping ──► (gone)
//!                              │                                        ▲
//!                              └──── backend or agent failure ──────────┘
//!
//!   daemon start: every stored record is either re-adopted (Running, sandbox
//!   alive, agent answers, not expired) or destroyed; then the backend sweeps
//!   whatever it made that no record claims.
//! ```
//!
//! Ownership: the registry map is the single owner of live runs. A run leaves
//! the map *before* its sandbox is destroyed, so no new operation can start on
//! a dying run; operations already in flight are told through the run's
//! `ended` token and end with an exit reason that says why.
//!
//! Persistence: a record is written as `Creating` before any resource exists,
//! so a crash at any point leaves something reconciliation can find.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use futures::{Stream, StreamExt};
use runbox_agent_proto::pb::{self, exec_input, exec_output, read_file_chunk, write_file_chunk};
use runbox_agent_proto::{AgentClient, CHUNK_SIZE};
use runbox_types::{
    CreateRunRequest, Env, ErrorCode, ExecRequest, ExitEvent, ExitReason, Image,
    LeaseReleaseRequest, LeaseRenewRequest, LeaseRequest, NetworkTier, PullEvent, PullRequest, Run,
    RunStatus,
};
use time::OffsetDateTime;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use ulid::Ulid;

use crate::backend::{Backend, SandboxSpec};
use crate::config::Config;
use crate::egress;
use crate::error::CoreError;
use crate::images::ImageStore;
use crate::lease::{Credential, Fence, Lease, LeaseError};
use crate::store::{RunRecord, Store};
use crate::validate;

/// Environment every command starts with, before the run's and the exec's.
const BASE_ENV: &[(&str, &str)] = &[
    (
        "PATH",
        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    ),
    ("HOME", "/root"),
    ("TERM", "xterm"),
];

/// How long after its own timeout the daemon waits for the agent to report a
/// killed command before it gives up on the agent.
const TIMEOUT_GRACE: Duration = Duration::from_secs(5);

/// How long a single call to set up an agent stream may take.
const AGENT_CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// One event of an exec stream, as the core reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExecEvent {
    /// The command started with this pid.
    Started(u32),
    /// A chunk of standard output.
    Stdout(Bytes),
    /// A chunk of standard error.
    Stderr(Bytes),
    /// The command ended; always the last event.
    Exit(ExitEvent),
}

/// A file being read out of a run.
pub struct FileDownload {
    /// Its size in bytes, as the agent declared it; the stream yields exactly
    /// this many bytes or ends with an error.
    pub size: u64,
    /// The contents.
    pub body: std::pin::Pin<Box<dyn Stream<Item = Result<Bytes, CoreError>> + Send>>,
}

/// A live run.
///
/// Lock order: `fence` before `record`; neither is held across an await.
struct RunHandle {
    record: Mutex<RunRecord>,
    /// The writable lease and the operations in flight. Admitting an
    /// operation and granting a lease both happen under this lock, so they
    /// never interleave.
    fence: Mutex<Fence>,
    agent: AgentClient,
    /// Cancelled when the run is being destroyed; in-flight execs watch it.
    ended: CancellationToken,
    /// Why the run ended, set before `ended` is cancelled.
    end_reason: OnceLock<ExitReason>,
    /// The egress proxy's counters, once it serves (`allowlist` runs).
    egress: OnceLock<Arc<runbox_proxy::proxy::Counters>>,
}

impl RunHandle {
    fn record(&self) -> RunRecord {
        lock(&self.record).clone()
    }
}

/// Locks a mutex, recovering from poisoning: every critical section here is
/// a few assignments that leave the data consistent even if a panic stopped
/// them, so a panic elsewhere must not wedge the registry.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The run manager. Cheap to share (`Arc<Manager>`).
pub struct Manager {
    config: Config,
    backend: Arc<dyn Backend>,
    store: Store,
    images: ImageStore,
    runs: Mutex<HashMap<Ulid, Arc<RunHandle>>>,
    /// Runs being created, counted against `max_runs`.
    creating: Mutex<HashSet<Ulid>>,
    /// Serialises "image is in use" checks with run creation.
    image_lock: Mutex<()>,
    /// Runs whose destruction failed; the reaper retries them.
    undead: Mutex<HashSet<Ulid>>,
}

impl Manager {
    /// Builds a manager and reconciles stored runs with what is alive: live
    /// runs are re-adopted, everything else is destroyed.
    pub async fn start(
        config: Config,
        backend: Arc<dyn Backend>,
        store: Store,
        images: ImageStore,
    ) -> Result<Arc<Manager>, CoreError> {
        let manager = Arc::new(Manager {
            config,
            backend,
            store,
            images,
            runs: Mutex::new(HashMap::new()),
            creating: Mutex::new(HashSet::new()),
            image_lock: Mutex::new(()),
            undead: Mutex::new(HashSet::new()),
        });
        manager.reconcile().await?;
        Ok(manager)
    }

    /// The settings in force.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The backend's name.
    pub fn backend_name(&self) -> String {
        self.backend.name()
    }

    async fn reconcile(&self) -> Result<(), CoreError> {
        let now = OffsetDateTime::now_utc();
        let mut keep = HashSet::new();
        for mut record in self.store.list()? {
            let id = record.id;
            let alive = record.status == RunStatus::Running
                && record.expires_at > now
                && self.backend.is_alive(id).await.unwrap_or(false);
            if alive {
                let agent = runbox_agent_proto::connect_unix(record.agent_socket.clone());
                match wait_ready(agent.clone(), Duration::from_secs(3)).await {
                    Ok(()) => {
                        tracing::info!(run = %id, "re-adopted a live run");
                        record.status = RunStatus::Running;
                        keep.insert(id);
                        let handle = Arc::new(new_handle(record, agent));
                        // Without its proxy the run has no way out at all:
                        // it keeps its files and processes, and the log says
                        // why its egress is gone.
                        if let Err(e) = self.start_egress(&handle).await {
                            tracing::error!(run = %id, error = %error_chain(&e), "could not restart the run's egress proxy; the run has no network");
                        }
                        lock(&self.runs).insert(id, handle);
                        continue;
                    }
                    Err(e) => {
                        tracing::warn!(run = %id, error = %e, "run's agent does not answer; destroying it")
                    }
                }
            }
            tracing::info!(run = %id, status = ?record.status, "cleaning up a run that did not survive");
            if let Err(e) = self.backend.destroy(id).await {
                tracing::error!(run = %id, error = %error_chain(&e), "destroying a dead run failed; will retry");
                lock(&self.undead).insert(id);
                keep.insert(id);
                continue;
            }
            self.store.delete(id)?;
        }
        match self.backend.sweep(&keep).await {
            Ok(swept) if !swept.is_empty() => {
                tracing::info!(count = swept.len(), "removed leftover sandboxes")
            }
            Ok(_) => {}
            Err(e) => {
                tracing::error!(error = %error_chain(&e), "sweeping leftover sandboxes failed")
            }
        }
        Ok(())
    }

    /// Creates a run and waits until its agent answers.
    pub async fn create(&self, req: CreateRunRequest) -> Result<Run, CoreError> {
        let env = req.env.unwrap_or_default();
        validate::env(&env)?;
        let limits = validate::limits(
            req.limits.as_ref(),
            &self.config.default_limits,
            &self.config.max_limits,
        )?;
        let ttl = validate::ttl(req.ttl_sec, self.config.default_ttl, self.config.max_ttl)?;
        let network = req.network.unwrap_or_default();
        if let Err(why) = self.backend.check_network(network) {
            return Err(CoreError::invalid(
                ErrorCode::NetworkUnsupported,
                format!(
                    "network {:?} is not available on this server ({why}); use another tier",
                    network.as_str()
                ),
            ));
        }
        let egress = egress::check_request(
            self.config.egress.as_deref(),
            network,
            req.egress_allow.as_deref(),
            req.secrets.as_deref(),
        )?;
        let id = Ulid::new();
        {
            let runs = lock(&self.runs).len();
            let mut creating = lock(&self.creating);
            if runs + creating.len() >= self.config.max_runs {
                return Err(CoreError::Capacity(self.config.max_runs));
            }
            creating.insert(id);
        }
        let now = OffsetDateTime::now_utc();
        let record = RunRecord {
            id,
            image: req.image,
            network,
            limits,
            env,
            created_at: now,
            expires_at: now + ttl,
            status: RunStatus::Creating,
            runtime: String::new(),
            agent_socket: Default::default(),
            image_config: Default::default(),
            lease: Default::default(),
            egress,
        };
        let result = self.create_inner(record).await;
        lock(&self.creating).remove(&id);
        result
    }

    /// Creates the sandbox of `record` (status `Creating`, just built from a
    /// checked request) and waits until its agent answers.
    async fn create_inner(&self, mut record: RunRecord) -> Result<Run, CoreError> {
        let id = record.id;
        let image_layers = {
            // Holding the image lock until the record is stored means a
            // concurrent image delete either sees this run or runs first.
            let _guard = lock(&self.image_lock);
            let layers = self.images.layers(&record.image)?;
            record.image_config = self.images.config(&record.image)?;
            self.store.put(&record)?;
            layers
        };
        let spec = SandboxSpec {
            id,
            image_layers,
            limits: record.limits,
            network: record.network,
            // Only runs with secrets get TLS intercepted, so only they need
            // to trust the interception CA.
            trust_pem: match &self.config.egress {
                Some(config) if !record.egress.secrets.is_empty() => Some(config.ca_pem()),
                _ => None,
            },
        };
        let started = std::time::Instant::now();
        let outcome = async {
            let sandbox = self.backend.create(&spec).await?;
            record.runtime = sandbox.runtime;
            record.agent_socket = sandbox.agent_socket;
            let agent = runbox_agent_proto::connect_unix(record.agent_socket.clone());
            wait_ready(agent.clone(), self.config.agent_ready_timeout)
                .await
                .map_err(|e| {
                    CoreError::Agent(format!("the new run's agent did not become ready: {e}"))
                })?;
            Ok::<_, CoreError>(agent)
        }
        .await;
        let agent = match outcome {
            Ok(agent) => agent,
            Err(e) => {
                tracing::error!(run = %id, error = %error_chain(&e), "creating a run failed");
                self.destroy_resources(id).await;
                return Err(e);
            }
        };
        record.status = RunStatus::Running;
        let handle = Arc::new(new_handle(record.clone(), agent));
        if let Err(e) = self.start_egress(&handle).await {
            tracing::error!(run = %id, error = %error_chain(&e), "starting the run's egress proxy failed");
            self.destroy_resources(id).await;
            return Err(e);
        }
        if let Err(e) = self.store.put(&record) {
            handle.ended.cancel();
            self.destroy_resources(id).await;
            return Err(e);
        }
        tracing::info!(run = %id, image = %record.image, runtime = %record.runtime,
            elapsed_ms = started.elapsed().as_millis() as u64, "run created");
        let run = self.view(&handle);
        lock(&self.runs).insert(id, handle);
        Ok(run)
    }

    /// Every live run, ordered by id.
    pub fn list(&self) -> Vec<Run> {
        let mut runs: Vec<Run> = lock(&self.runs).values().map(|h| self.view(h)).collect();
        runs.sort_by_key(|r| r.id);
        runs
    }

    /// One live run.
    pub fn get(&self, id: Ulid) -> Result<Run, CoreError> {
        Ok(self.view(&*self.handle(id)?))
    }

    /// The API view of a live run: its record plus live counters.
    fn view(&self, handle: &RunHandle) -> Run {
        let mut run = handle.record().to_run(&self.config.server_id);
        run.egress = handle.egress.get().map(|c| egress::stats(c));
        run
    }

    /// Serves an `allowlist` run's proxy on a listener the backend binds in
    /// the run's network namespace; stops with the run. Other tiers: nothing.
    async fn start_egress(&self, handle: &RunHandle) -> Result<(), CoreError> {
        let record = handle.record();
        if record.network != NetworkTier::Allowlist {
            return Ok(());
        }
        let config = self.config.egress.as_ref().ok_or_else(|| {
            CoreError::invalid(
                ErrorCode::NetworkUnsupported,
                "this server has no egress proxy; use network \"none\"",
            )
        })?;
        let listener = self.backend.egress_listener(record.id).await?;
        let counters = config.start(
            record.id,
            &record.egress,
            listener,
            handle.ended.child_token(),
        )?;
        let _ = handle.egress.set(counters);
        Ok(())
    }

    fn handle(&self, id: Ulid) -> Result<Arc<RunHandle>, CoreError> {
        lock(&self.runs)
            .get(&id)
            .cloned()
            .ok_or(CoreError::RunNotFound(id))
    }

    /// Sets a run's expiry to now + `ttl_sec` (capped by the server maximum).
    pub fn renew(&self, id: Ulid, ttl_sec: u64) -> Result<Run, CoreError> {
        let ttl = validate::ttl(Some(ttl_sec), self.config.default_ttl, self.config.max_ttl)?;
        let handle = self.handle(id)?;
        let record = {
            let mut record = lock(&handle.record);
            record.expires_at = OffsetDateTime::now_utc() + ttl;
            record.clone()
        };
        self.store.put(&record)?;
        Ok(record.to_run(&self.config.server_id))
    }

    /// Destroys a run now.
    pub async fn delete(&self, id: Ulid) -> Result<(), CoreError> {
        let handle = lock(&self.runs)
            .remove(&id)
            .ok_or(CoreError::RunNotFound(id))?;
        self.end(id, &handle, ExitReason::RunDeleted).await;
        Ok(())
    }

    async fn end(&self, id: Ulid, handle: &RunHandle, reason: ExitReason) {
        let _ = handle.end_reason.set(reason);
        {
            // Under the fence lock, so a lease change either lands before the
            // run is marked as ending or sees it ended and stores nothing (a
            // late store write would resurrect the deleted record).
            let _fence = lock(&handle.fence);
            handle.ended.cancel();
        }
        {
            let mut record = lock(&handle.record);
            record.status = RunStatus::Stopping;
            if let Err(e) = self.store.put(&record) {
                tracing::warn!(run = %id, error = %e, "could not mark run as stopping");
            }
        }
        self.destroy_resources(id).await;
        tracing::info!(run = %id, ?reason, "run destroyed");
    }

    /// Destroys the sandbox and forgets the record; on failure the reaper
    /// retries later.
    async fn destroy_resources(&self, id: Ulid) {
        match self.backend.destroy(id).await {
            Ok(()) => {
                if let Err(e) = self.store.delete(id) {
                    tracing::error!(run = %id, error = %e, "could not delete run record");
                }
                lock(&self.undead).remove(&id);
            }
            Err(e) => {
                tracing::error!(run = %id, error = %error_chain(&e), "destroying run failed; will retry");
                lock(&self.undead).insert(id);
            }
        }
    }

    /// Destroys expired runs and retries failed destructions. Returns the
    /// number of runs reaped.
    pub async fn reap_once(&self) -> usize {
        let now = OffsetDateTime::now_utc();
        let expired: Vec<(Ulid, Arc<RunHandle>)> = {
            let mut runs = lock(&self.runs);
            let ids: Vec<Ulid> = runs
                .iter()
                .filter(|(_, h)| lock(&h.record).expires_at <= now)
                .map(|(id, _)| *id)
                .collect();
            ids.into_iter()
                .filter_map(|id| runs.remove(&id).map(|h| (id, h)))
                .collect()
        };
        let count = expired.len();
        for (id, handle) in expired {
            self.end(id, &handle, ExitReason::RunExpired).await;
        }
        let undead: Vec<Ulid> = lock(&self.undead).iter().copied().collect();
        for id in undead {
            self.destroy_resources(id).await;
        }
        count
    }

    /// Runs the reaper until `shutdown` is cancelled.
    pub async fn reaper(self: Arc<Self>, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(self.config.reap_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            self.reap_once().await;
        }
    }

    /// Whether a live or starting run uses image `name`.
    fn image_in_use(&self, name: &str) -> Result<bool, CoreError> {
        Ok(self.store.list()?.iter().any(|r| r.image == name))
    }

    /// Imports an image from a tar stream. Blocking work runs on a blocking
    /// thread; `reader` is read there.
    pub async fn import_image(
        &self,
        name: String,
        reader: impl std::io::Read + Send + 'static,
    ) -> Result<Image, CoreError> {
        let images = self.images.clone();
        let max = self.config.max_image_bytes;
        let server = self.config.server_id.clone();
        tokio::task::spawn_blocking(move || images.import(&name, reader, max, &server))
            .await
            .map_err(|e| CoreError::Store(format!("image import task failed: {e}")))?
    }

    /// Pulls an image from a registry into the layer store and records it.
    /// Progress goes to `progress` (a closed receiver is not an error: the
    /// pull goes on). Checks that can fail fast (reference, name, name taken)
    /// are done before anything is fetched.
    ///
    /// Cancellation: dropping the future aborts the layer in flight; layers
    /// already stored stay (and are reused by the next pull).
    pub async fn pull_image(
        &self,
        req: PullRequest,
        progress: mpsc::UnboundedSender<PullEvent>,
    ) -> Result<Image, CoreError> {
        let (reference, name) = self.check_pull(&req)?;
        let opts = runbox_image::pull::PullOptions {
            insecure_registries: self.config.insecure_registries.clone(),
            auth: match (req.username, req.password) {
                (Some(username), Some(password)) => {
                    runbox_image::pull::RegistryAuth::Basic { username, password }
                }
                (None, None) => runbox_image::pull::RegistryAuth::Anonymous,
                _ => {
                    return Err(CoreError::invalid(
                        ErrorCode::BadRequest,
                        "give both username and password, or neither",
                    ))
                }
            },
            ..Default::default()
        };
        let sink = crate::images::StoreSink {
            store: self.images.store().clone(),
        };
        let report = move |event: runbox_image::pull::ProgressEvent| {
            use runbox_image::pull::ProgressEvent as P;
            let event = match event {
                P::Resolved { digest, layers } => PullEvent::Resolved { digest, layers },
                P::LayerStarted { digest, size } => PullEvent::LayerStarted { digest, size },
                P::LayerProgress { digest, done, size } => {
                    PullEvent::LayerProgress { digest, done, size }
                }
                P::LayerSkipped { digest } => PullEvent::LayerSkipped { digest },
                P::LayerDone { digest } => PullEvent::LayerDone { digest },
            };
            let _ = progress.send(event);
        };
        // Layers a pull has stored are not referenced until it records the
        // image: hold off garbage collection until then.
        let guard = self.images.import_guard();
        let pulled = runbox_image::pull::pull(&reference, &opts, &sink, &report)
            .await
            .map_err(crate::images::pull_error)?;
        let image = self
            .images
            .record_pulled(&name, &pulled, &self.config.server_id);
        drop(guard);
        let image = image?;
        tracing::info!(image = %name, reference = %pulled.reference, digest = %pulled.manifest_digest, "image pulled");
        Ok(image)
    }

    /// Validates a pull request; returns the reference and the local name.
    pub fn check_pull(&self, req: &PullRequest) -> Result<(String, String), CoreError> {
        let reference = req.reference.trim();
        if reference.is_empty()
            || reference.len() > 512
            || reference
                .chars()
                .any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(CoreError::invalid(
                ErrorCode::BadReference,
                "reference must be 1-512 characters without spaces, e.g. docker.io/library/busybox:1.36",
            ));
        }
        let name = req
            .name
            .clone()
            .unwrap_or_else(|| crate::images::default_name(reference));
        validate::image_name(&name)?;
        if self
            .images
            .get(&name, &self.config.server_id, false)
            .is_ok()
        {
            return Err(CoreError::Conflict {
                code: ErrorCode::ImageExists,
                message: format!(
                    "an image named {name:?} already exists; remove it or pull with another name"
                ),
            });
        }
        Ok((reference.to_owned(), name))
    }

    /// Every image.
    pub fn list_images(&self) -> Result<Vec<Image>, CoreError> {
        self.images.list(&self.config.server_id)
    }

    /// One image, with its config document.
    pub fn get_image(&self, name: &str) -> Result<Image, CoreError> {
        self.images.get(name, &self.config.server_id, true)
    }

    /// Removes an image no run uses.
    pub async fn delete_image(&self, name: String) -> Result<(), CoreError> {
        validate::image_name(&name)?;
        let images = self.images.clone();
        {
            let _guard = lock(&self.image_lock);
            if self.image_in_use(&name)? {
                return Err(CoreError::Conflict {
                    code: ErrorCode::ImageInUse,
                    message: format!("image {name:?} is used by a run; delete the run first"),
                });
            }
            // The record goes under the lock, so no run can start from the
            // image once the in-use check passed; its layers go off the lock.
            images.forget(&name)?;
        }
        tokio::task::spawn_blocking(move || images.collect_garbage())
            .await
            .map_err(|e| CoreError::Store(format!("image removal task failed: {e}")))?
    }

    /// Grants the run's writable lease to `req.owner` (see [`crate::lease`]).
    pub fn acquire_lease(&self, id: Ulid, req: LeaseRequest) -> Result<Lease, CoreError> {
        validate::owner(&req.owner)?;
        let ttl = validate::lease_ttl(req.ttl_sec)?;
        let lease = self.update_fence(id, |fence, now| fence.acquire(&req.owner, ttl, now))?;
        tracing::info!(run = %id, holder = %lease.holder, generation = lease.generation, "lease granted");
        Ok(lease)
    }

    /// Extends the active lease named by `req.owner` and `req.generation`.
    pub fn renew_lease(&self, id: Ulid, req: LeaseRenewRequest) -> Result<Lease, CoreError> {
        validate::owner(&req.owner)?;
        let ttl = validate::lease_ttl(req.ttl_sec)?;
        let c = Credential {
            owner: &req.owner,
            generation: req.generation,
        };
        self.update_fence(id, |fence, now| fence.book.renew(c, ttl, now))
    }

    /// Releases the lease named by `req.owner` and `req.generation`.
    pub fn release_lease(&self, id: Ulid, req: LeaseReleaseRequest) -> Result<(), CoreError> {
        validate::owner(&req.owner)?;
        let c = Credential {
            owner: &req.owner,
            generation: req.generation,
        };
        self.update_fence(id, |fence, now| fence.book.release(c, now))?;
        tracing::info!(run = %id, holder = %req.owner, generation = req.generation, "lease released");
        Ok(())
    }

    /// Applies a lease change to run `id` and stores the new lease state
    /// before it takes effect: if the store fails, nothing changed.
    fn update_fence<T>(
        &self,
        id: Ulid,
        change: impl FnOnce(&mut Fence, OffsetDateTime) -> Result<T, LeaseError>,
    ) -> Result<T, CoreError> {
        let handle = self.handle(id)?;
        let mut fence = lock(&handle.fence);
        if handle.ended.is_cancelled() {
            return Err(CoreError::RunNotFound(id));
        }
        let mut next = fence.clone();
        let out = change(&mut next, OffsetDateTime::now_utc())?;
        if next.book != fence.book {
            let record = {
                let mut record = lock(&handle.record);
                record.lease = next.book.clone();
                record.clone()
            };
            if let Err(e) = self.store.put(&record) {
                lock(&handle.record).lease = fence.book.clone();
                return Err(e);
            }
        }
        *fence = next;
        Ok(out)
    }

    /// Starts a command in a run. Returns once the command has started (or
    /// failed to start); the stream then carries its output and ends with
    /// exactly one [`ExecEvent::Exit`].
    ///
    /// Cancellation: dropping the returned stream cancels the agent call, and
    /// the agent kills the command's process group.
    pub async fn exec(
        &self,
        id: Ulid,
        req: ExecRequest,
    ) -> Result<impl Stream<Item = ExecEvent> + Send + 'static, CoreError> {
        if !req.cmd.is_empty() {
            validate::command(&req.cmd)?;
        }
        if let Some(cwd) = &req.cwd {
            validate::cwd(cwd)?;
        }
        let exec_env = req.env.unwrap_or_default();
        validate::env(&exec_env)?;
        let timeout = match req.timeout_sec {
            Some(0) => {
                return Err(CoreError::invalid(
                    ErrorCode::BadRequest,
                    "timeoutSec must be at least 1",
                ))
            }
            Some(secs) if secs > self.config.max_ttl.as_secs() => {
                return Err(CoreError::invalid(
                    ErrorCode::BadRequest,
                    format!(
                        "timeoutSec must be at most {}",
                        self.config.max_ttl.as_secs()
                    ),
                ))
            }
            Some(secs) => Some(Duration::from_secs(secs)),
            None => None,
        };
        let credential = validate::credential(req.owner.as_deref(), req.generation)?;
        let handle = self.handle(id)?;
        let in_flight = begin(&handle, credential.as_ref())?;
        let record = handle.record();
        let image = &record.image_config;
        // An exec without a command runs the image's Entrypoint + Cmd.
        let argv = if req.cmd.is_empty() {
            let argv: Vec<String> = image.entrypoint.iter().chain(&image.cmd).cloned().collect();
            if argv.is_empty() {
                return Err(CoreError::invalid(
                    ErrorCode::BadCommand,
                    "cmd is empty and the image has no Entrypoint or Cmd; give the program and its arguments",
                ));
            }
            validate::command(&argv)?;
            argv
        } else {
            req.cmd
        };
        let base = Env(BASE_ENV
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect());
        let egress_env = egress::run_env(record.network, &record.egress);
        // Later layers win: runbox's defaults, the image's Env, the egress
        // proxy's, the run's, the exec's.
        let env: Vec<pb::EnvVar> =
            validate::merge_env([&base, &image.env, &egress_env, &record.env, &exec_env])
                .into_iter()
                .map(|(name, value)| pb::EnvVar { name, value })
                .collect();
        let start = pb::ExecStart {
            argv,
            cwd: req
                .cwd
                .or_else(|| image.working_dir.clone())
                .unwrap_or_default(),
            env,
            timeout_ms: timeout.map_or(0, |t| t.as_millis() as u64),
            stdin: false,
        };
        let (input, input_rx) = mpsc::channel(8);
        input
            .send(pb::ExecInput {
                kind: Some(exec_input::Kind::Start(start)),
            })
            .await
            .map_err(|_| CoreError::Agent("exec input channel closed".into()))?;
        let mut agent = handle.agent.clone();
        let response = tokio::time::timeout(
            AGENT_CALL_TIMEOUT,
            agent.exec(ReceiverStream::new(input_rx)),
        )
        .await
        .map_err(|_| CoreError::Agent("the agent did not accept the exec call in time".into()))?
        .map_err(|s| CoreError::Agent(format!("exec call refused: {}", bounded(s.message()))))?;
        let mut output = response.into_inner();
        let first = tokio::time::timeout(AGENT_CALL_TIMEOUT, output.message())
            .await
            .map_err(|_| CoreError::Agent("the agent did not start the command in time".into()))?
            .map_err(|s| CoreError::Agent(format!("exec failed: {}", bounded(s.message()))))?;
        let pid = match first.and_then(|m| m.kind) {
            Some(exec_output::Kind::Started(s)) => s.pid,
            Some(exec_output::Kind::Error(e)) => return Err(start_error(e)),
            other => {
                return Err(CoreError::Agent(format!(
                    "expected a started message, got {}",
                    message_kind(other.is_some())
                )))
            }
        };
        let state = ExecState {
            output,
            _input: input,
            ended: handle.ended.clone(),
            handle,
            deadline: timeout.map(|t| tokio::time::Instant::now() + t + TIMEOUT_GRACE),
            started: Some(pid),
            done: false,
            _in_flight: in_flight,
        };
        Ok(futures::stream::unfold(state, ExecState::next).boxed())
    }

    /// Writes `body` to `/work/<path>` in a run, replacing any file there only
    /// once the whole body has arrived. Returns the bytes written.
    ///
    /// Cancellation: dropping the future mid-way cancels the agent call; the
    /// agent then discards the partial upload and the target is untouched.
    pub async fn put_file<S, E>(
        &self,
        id: Ulid,
        path: &str,
        credential: Option<(String, u64)>,
        content_length: Option<u64>,
        body: S,
    ) -> Result<u64, CoreError>
    where
        S: Stream<Item = Result<Bytes, E>> + Send,
        E: std::fmt::Display,
    {
        let path = validate::work_path(path)?;
        let max = self.config.max_upload_bytes;
        if content_length.is_some_and(|len| len > max) {
            return Err(too_large(max));
        }
        let handle = self.handle(id)?;
        // Counted in flight until this future ends or is dropped.
        let _in_flight = begin(&handle, credential.as_ref())?;
        let (tx, rx) = mpsc::channel::<pb::WriteFileChunk>(4);
        let header = pb::WriteFileHeader { path, mode: 0 };
        tx.send(chunk(write_file_chunk::Kind::Header(header)))
            .await
            .map_err(|_| CoreError::Agent("upload channel closed".into()))?;
        let mut agent = handle.agent.clone();
        let call = agent.write_file(ReceiverStream::new(rx));
        tokio::pin!(call);
        let pump = async {
            let mut body = std::pin::pin!(body);
            let mut total = 0u64;
            while let Some(piece) = body.next().await {
                let piece = piece.map_err(|e| {
                    CoreError::invalid(
                        ErrorCode::BadRequest,
                        format!("the upload body broke off: {e}"),
                    )
                })?;
                total += piece.len() as u64;
                if total > max {
                    return Err(too_large(max));
                }
                for part in piece.chunks(CHUNK_SIZE) {
                    tx.send(chunk(write_file_chunk::Kind::Data(part.to_vec())))
                        .await
                        .map_err(|_| {
                            CoreError::Agent("the agent stopped reading the upload".into())
                        })?;
                }
            }
            tx.send(chunk(write_file_chunk::Kind::Commit(
                pb::WriteFileCommit {},
            )))
            .await
            .map_err(|_| CoreError::Agent("the agent stopped reading the upload".into()))?;
            Ok::<u64, CoreError>(total)
        };
        // The agent may refuse early (a bad path) while the body is still
        // arriving; whichever side finishes first decides.
        let sent = tokio::select! {
            reply = &mut call => {
                return match reply {
                    Ok(_) => Err(CoreError::Agent("the agent finished the upload before it was committed".into())),
                    Err(status) => Err(file_error(status)),
                };
            }
            sent = pump => sent?,
        };
        drop(tx);
        let reply = tokio::time::timeout(AGENT_CALL_TIMEOUT, call)
            .await
            .map_err(|_| CoreError::Agent("the agent did not confirm the upload in time".into()))?
            .map_err(file_error)?
            .into_inner();
        if reply.bytes_written != sent {
            return Err(CoreError::Agent(format!(
                "the agent wrote {} bytes of {sent}",
                reply.bytes_written
            )));
        }
        Ok(sent)
    }

    /// Reads `/work/<path>` out of a run as a stream of exactly `size` bytes.
    pub async fn get_file(&self, id: Ulid, path: &str) -> Result<FileDownload, CoreError> {
        let path = validate::work_path(path)?;
        let handle = self.handle(id)?;
        let mut agent = handle.agent.clone();
        let mut stream = tokio::time::timeout(
            AGENT_CALL_TIMEOUT,
            agent.read_file(pb::ReadFileRequest { path }),
        )
        .await
        .map_err(|_| CoreError::Agent("the agent did not answer the read in time".into()))?
        .map_err(file_error)?
        .into_inner();
        let first = tokio::time::timeout(AGENT_CALL_TIMEOUT, stream.message())
            .await
            .map_err(|_| CoreError::Agent("the agent did not answer the read in time".into()))?
            .map_err(file_error)?;
        let size = match first.and_then(|c| c.kind) {
            Some(read_file_chunk::Kind::Header(h)) => h.size,
            other => {
                return Err(CoreError::Agent(format!(
                    "expected a file header, got {}",
                    message_kind(other.is_some())
                )))
            }
        };
        // Never trust the agent's byte count: stop at `size`, and fail the
        // stream if fewer bytes arrive, so the HTTP length is never a lie.
        let body = futures::stream::unfold(
            (stream, 0u64, false),
            move |(mut stream, mut seen, done)| async move {
                if done {
                    return None;
                }
                let item = match stream.message().await {
                    Ok(Some(pb::ReadFileChunk {
                        kind: Some(read_file_chunk::Kind::Data(data)),
                    })) => {
                        let room = size - seen;
                        if data.len() as u64 > room {
                            Err(CoreError::Agent(
                                "the agent sent more bytes than it declared".into(),
                            ))
                        } else {
                            seen += data.len() as u64;
                            Ok(Bytes::from(data))
                        }
                    }
                    Ok(Some(_)) => Err(CoreError::Agent(
                        "unexpected message in a file stream".into(),
                    )),
                    Ok(None) if seen == size => return None,
                    Ok(None) => Err(CoreError::Agent(format!(
                        "file stream ended after {seen} of {size} bytes"
                    ))),
                    Err(status) => Err(file_error(status)),
                };
                let done = item.is_err();
                Some((item, (stream, seen, done)))
            },
        );
        Ok(FileDownload {
            size,
            body: Box::pin(body),
        })
    }
}

fn new_handle(record: RunRecord, agent: AgentClient) -> RunHandle {
    RunHandle {
        fence: Mutex::new(Fence::new(record.lease.clone())),
        record: Mutex::new(record),
        agent,
        ended: CancellationToken::new(),
        end_reason: OnceLock::new(),
        egress: OnceLock::new(),
    }
}

/// An exec or file write admitted by the run's fence; ends it when dropped.
struct InFlight(Arc<RunHandle>);

impl Drop for InFlight {
    fn drop(&mut self) {
        lock(&self.0.fence).end();
    }
}

/// Admits an exec or file write under the run's lease, if any.
fn begin(
    handle: &Arc<RunHandle>,
    credential: Option<&(String, u64)>,
) -> Result<InFlight, CoreError> {
    let presented = credential.map(|(owner, generation)| Credential {
        owner,
        generation: *generation,
    });
    lock(&handle.fence).begin(presented, OffsetDateTime::now_utc())?;
    Ok(InFlight(handle.clone()))
}

fn chunk(kind: write_file_chunk::Kind) -> pb::WriteFileChunk {
    pb::WriteFileChunk { kind: Some(kind) }
}

fn too_large(max: u64) -> CoreError {
    CoreError::invalid(
        ErrorCode::TooLarge,
        format!("the file is larger than this server's upload maximum of {max} bytes"),
    )
}

/// Calls `Hello` until the agent answers or `limit` passes.
async fn wait_ready(mut agent: AgentClient, limit: Duration) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + limit;
    let mut delay = Duration::from_millis(2);
    loop {
        let attempt =
            tokio::time::timeout(Duration::from_secs(2), agent.hello(pb::HelloRequest {})).await;
        let error = match attempt {
            Ok(Ok(reply)) => {
                let reply = reply.into_inner();
                if reply.protocol < runbox_agent_proto::PROTOCOL {
                    return Err(format!(
                        "agent speaks protocol {}, need {}",
                        reply.protocol,
                        runbox_agent_proto::PROTOCOL
                    ));
                }
                return Ok(());
            }
            Ok(Err(status)) => bounded(status.message()),
            Err(_) => "no answer within 2s".to_owned(),
        };
        if tokio::time::Instant::now() + delay > deadline {
            return Err(error);
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_millis(100));
    }
}

/// Maps an agent's refusal to start a command onto an API error.
fn start_error(e: pb::AgentError) -> CoreError {
    let code = match pb::ErrorKind::try_from(e.kind).unwrap_or(pb::ErrorKind::Unspecified) {
        pb::ErrorKind::NotFound => ErrorCode::CommandNotFound,
        pb::ErrorKind::PermissionDenied => ErrorCode::CommandNotExecutable,
        pb::ErrorKind::BadCwd => ErrorCode::BadCwd,
        pb::ErrorKind::Invalid => ErrorCode::BadCommand,
        pb::ErrorKind::Io | pb::ErrorKind::Unspecified => {
            return CoreError::Agent(bounded(&e.message))
        }
    };
    CoreError::invalid(code, bounded(&e.message))
}

/// Maps an agent's file-operation status onto an API error, by the
/// `runbox-kind` metadata the agent attaches.
fn file_error(status: tonic::Status) -> CoreError {
    let kind = status
        .metadata()
        .get("runbox-kind")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let message = bounded(status.message());
    let code = match kind {
        "invalid_path" => ErrorCode::BadPath,
        "escape" => ErrorCode::PathEscape,
        "not_found" => ErrorCode::FileNotFound,
        "not_a_file" => ErrorCode::NotAFile,
        "denied" => ErrorCode::PermissionDenied,
        _ => return CoreError::Agent(format!("file operation failed: {message}")),
    };
    CoreError::invalid(code, message)
}

/// Names what an agent sent instead of the expected message, without
/// echoing its (untrusted, possibly large) contents.
fn message_kind(present: bool) -> &'static str {
    if present {
        "another message"
    } else {
        "nothing"
    }
}

/// Caps a message that came from inside a run before it reaches a client or
/// a log line.
fn bounded(message: &str) -> String {
    const MAX: usize = 512;
    let mut out: String = message
        .chars()
        .filter(|c| !c.is_control())
        .take(MAX)
        .collect();
    if message.len() > MAX {
        out.push('…');
    }
    out
}

/// The state of one exec stream.
struct ExecState {
    output: tonic::Streaming<pb::ExecOutput>,
    /// Kept open so the agent does not see stdin's end as a reason to stop;
    /// dropped with the stream.
    _input: mpsc::Sender<pb::ExecInput>,
    handle: Arc<RunHandle>,
    ended: CancellationToken,
    /// Counts the exec in flight until the stream is dropped.
    _in_flight: InFlight,
    /// When the daemon stops waiting for a timed-out command's exit report.
    deadline: Option<tokio::time::Instant>,
    started: Option<u32>,
    done: bool,
}

impl ExecState {
    async fn next(mut self) -> Option<(ExecEvent, ExecState)> {
        if let Some(pid) = self.started.take() {
            return Some((ExecEvent::Started(pid), self));
        }
        if self.done {
            return None;
        }
        let sleep = async {
            match self.deadline {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let event = tokio::select! {
            biased;
            _ = self.ended.cancelled() => {
                let reason = self.handle.end_reason.get().copied().unwrap_or(ExitReason::RunDeleted);
                exit(137, Some(9), false, reason)
            }
            message = self.output.message() => match message {
                Ok(Some(pb::ExecOutput { kind: Some(kind) })) => match kind {
                    exec_output::Kind::Stdout(data) => return Some((ExecEvent::Stdout(Bytes::from(data)), self)),
                    exec_output::Kind::Stderr(data) => return Some((ExecEvent::Stderr(Bytes::from(data)), self)),
                    exec_output::Kind::Exit(e) => {
                        let signal = (e.signal != 0).then_some(e.signal);
                        let reason = match (e.timed_out, signal) {
                            (true, _) => ExitReason::Timeout,
                            (false, Some(_)) => ExitReason::Signaled,
                            (false, None) => ExitReason::Exited,
                        };
                        exit(e.exit_code, signal, e.timed_out, reason)
                    }
                    exec_output::Kind::Started(_) | exec_output::Kind::Error(_) => {
                        tracing::warn!("agent sent an out-of-order exec message");
                        exit(-1, None, false, ExitReason::AgentLost)
                    }
                },
                Ok(Some(pb::ExecOutput { kind: None })) => {
                    tracing::warn!("agent sent an empty exec message");
                    exit(-1, None, false, ExitReason::AgentLost)
                }
                Ok(None) | Err(_) => {
                    // The stream broke. If the run is being destroyed that is
                    // the reason; otherwise the agent is gone.
                    match self.handle.end_reason.get() {
                        Some(reason) => exit(137, Some(9), false, *reason),
                        None => exit(-1, None, false, ExitReason::AgentLost),
                    }
                }
            },
            _ = sleep => {
                tracing::warn!("agent did not report a timed-out command; giving up on it");
                exit(137, Some(9), true, ExitReason::Timeout)
            }
        };
        self.done = true;
        Some((event, self))
    }
}

fn exit(exit_code: i32, signal: Option<i32>, timed_out: bool, reason: ExitReason) -> ExecEvent {
    ExecEvent::Exit(ExitEvent {
        exit_code,
        timed_out,
        signal,
        reason,
    })
}

/// Formats an error with its whole source chain, for logs.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// Keys of a map, for logs that must not show values.
pub fn names(env: &BTreeMap<String, String>) -> Vec<&str> {
    env.keys().map(String::as_str).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(kind: &str) -> tonic::Status {
        let mut status = tonic::Status::internal("agent says \u{7}no");
        status
            .metadata_mut()
            .insert("runbox-kind", kind.parse().unwrap());
        status
    }

    #[test]
    fn agent_file_errors_map_to_stable_codes() {
        for (kind, code) in [
            ("invalid_path", ErrorCode::BadPath),
            ("escape", ErrorCode::PathEscape),
            ("not_found", ErrorCode::FileNotFound),
            ("not_a_file", ErrorCode::NotAFile),
            ("denied", ErrorCode::PermissionDenied),
            ("io", ErrorCode::AgentUnavailable),
            ("made-up", ErrorCode::AgentUnavailable),
        ] {
            assert_eq!(file_error(status(kind)).code(), code, "{kind}");
        }
    }

    #[test]
    fn agent_text_is_bounded_and_stripped() {
        let long = "x".repeat(10_000);
        assert!(bounded(&long).chars().count() <= 513);
        assert_eq!(bounded("a\u{1b}[31mb\n"), "a[31mb");
    }
}
