//! The one interface every API surface calls: [`RunService`].
//!
//! The HTTP server is generic over it, so its router is tested against a
//! stub without a runtime, and a second surface (an E2B-compatible control
//! plane, an MCP server) can be mounted over the same service without
//! reaching into the core past it. [`Manager`] (behind an `Arc`) is the real
//! implementation; its methods document the cancellation rules, which every
//! implementation must keep.

use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use futures::stream::BoxStream;
use runbox_types::{
    CreateRunRequest, ExecRequest, Image, LeaseReleaseRequest, LeaseRenewRequest, LeaseRequest,
    PullEvent, PullRequest, Run,
};
use tokio::sync::mpsc;
use ulid::Ulid;

use crate::error::CoreError;
use crate::lease::Lease;
use crate::request::{RunReply, RunRequest};
use crate::runs::{ExecEvent, FileDownload, Manager, Scope, Session, WriteOptions};

/// The events of one exec, ending with exactly one [`ExecEvent::Exit`].
pub type ExecStream = BoxStream<'static, ExecEvent>;

/// An upload body as the service takes it.
pub type UploadStream = BoxStream<'static, Result<Bytes, std::io::Error>>;

/// A lease credential: owner and generation.
pub type LeaseCredential = Option<(String, u64)>;

/// A byte stream both ways.
pub trait Duplex: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin {}

impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin> Duplex for T {}

/// A connection to a port inside a run: a TCP connection made in the
/// run's namespace on this node; a tunnel through another node later.
pub type Connection = Box<dyn Duplex>;

/// Everything an API surface can ask of runbox. Cheap to clone (a handle).
pub trait RunService: Clone + Send + Sync + 'static {
    /// This node's id, shown as `server` on responses.
    fn server_id(&self) -> &str;
    /// Answers `req` for run `id` (see [`crate::request`]): what every
    /// typed call on one run below comes to, unless it moves bytes.
    fn call(
        &self,
        id: Ulid,
        req: RunRequest,
    ) -> impl Future<Output = Result<RunReply, CoreError>> + Send;
    /// Creates a run and waits until it can be used; a repeat of a create
    /// with the same `idempotency_key` answers with that create's run.
    fn create(
        &self,
        req: CreateRunRequest,
        idempotency_key: Option<String>,
        owner: crate::tenants::Owner,
    ) -> impl Future<Output = Result<Run, CoreError>> + Send;
    /// The tenant run `id` is stamped with (None: the operator's), for
    /// access checks: no more than that is read. Read from the published
    /// view, outside the run's owner, and safe there: the stamp is set at
    /// creation and never changes, and an id is never given to another
    /// run, so the check cannot be overtaken by the action it admits.
    fn tenant_of(&self, id: Ulid) -> Result<Option<String>, CoreError> {
        self.get(id).map(|run| run.tenant)
    }
    /// The tenant set.
    fn tenants(&self) -> Arc<dyn crate::tenants::TenantStore>;
    /// The egress classes the operator defines, by name (what a tenant
    /// may be bound to).
    fn egress_classes(&self) -> Vec<String> {
        Vec::new()
    }
    /// Live runs counted against each tenant's `maxRuns`.
    fn tenant_runs(&self) -> std::collections::HashMap<String, usize>;
    /// Removes a tenant with no runs left (its checkpoints and snapshots
    /// stay, for the operator).
    fn delete_tenant(&self, name: &str) -> Result<(), CoreError>;
    /// What each tenant used since `since` (`tenant`: only that one, ""
    /// for the operator's own runs), from the usage journal.
    fn usage_report(
        &self,
        since: Option<time::OffsetDateTime>,
        tenant: Option<String>,
    ) -> impl Future<Output = Result<runbox_types::UsageReport, CoreError>> + Send;
    /// Every lifecycle transition the usage journal holds, oldest first:
    /// creates, pauses, hibernations, wakes, restarts, expiries, deletes,
    /// whatever caused them (not egress byte counts).
    fn lifecycle_events(
        &self,
    ) -> impl Future<Output = Result<Vec<crate::accounting::UsageEvent>, CoreError>> + Send {
        async { Ok(Vec::new()) }
    }
    /// Every run the API shows, ordered by id.
    fn list(&self) -> Vec<Run>;
    /// Every run of the fleet, ordered by id: [`RunService::list`] without
    /// a fleet; with one, the other nodes' too, from the fleet's catalog
    /// (`503 cluster_unavailable` while it cannot be read).
    fn list_fleet(&self) -> impl Future<Output = Result<Vec<Run>, CoreError>> + Send {
        let runs = self.list();
        async move { Ok(runs) }
    }
    /// One run.
    fn get(&self, id: Ulid) -> Result<Run, CoreError>;
    /// The parts of a run's image config runbox honours (its user and
    /// working directory among them), as recorded when the run was made.
    fn image_config(&self, id: Ulid) -> Result<crate::images::ImageConfig, CoreError>;
    /// A run's usage samples taken in `[from, to]` (either end open),
    /// oldest first: a short, bounded, node-local history.
    fn usage_history(
        &self,
        id: Ulid,
        from: Option<time::OffsetDateTime>,
        to: Option<time::OffsetDateTime>,
    ) -> Result<Vec<crate::runs::UsageSample>, CoreError>;
    /// What a running run uses now (None where it is not measured).
    fn usage(&self, id: Ulid) -> Result<Option<crate::lane::Usage>, CoreError>;
    /// Destroys a run; answers once nothing of it is left.
    fn delete(&self, id: Ulid) -> impl Future<Output = Result<(), CoreError>> + Send {
        crate::request::ask(self.call(id, RunRequest::Delete))
    }
    /// Destroys a run; answers once its processes are gone.
    fn kill(&self, id: Ulid) -> impl Future<Output = Result<(), CoreError>> + Send {
        crate::request::ask(self.call(id, RunRequest::Kill))
    }
    /// Pauses a run (its processes frozen, memory kept).
    fn pause(&self, id: Ulid) -> impl Future<Output = Result<Run, CoreError>> + Send {
        crate::request::ask(self.call(id, RunRequest::Pause))
    }
    /// Resumes a paused run; wakes a hibernated one.
    fn resume(&self, id: Ulid) -> impl Future<Output = Result<Run, CoreError>> + Send {
        crate::request::ask(self.call(id, RunRequest::Resume))
    }
    /// Hibernates a run (stopped down to its disk).
    fn hibernate(&self, id: Ulid) -> impl Future<Output = Result<Run, CoreError>> + Send {
        crate::request::ask(self.call(id, RunRequest::Hibernate))
    }
    /// Archives a run to the checkpoint store.
    fn archive(&self, id: Ulid) -> impl Future<Output = Result<Run, CoreError>> + Send {
        crate::request::ask(self.call(id, RunRequest::Archive))
    }
    /// Wakes a hibernated or failed run (boots it on its disk), resumes a
    /// paused one.
    fn wake(&self, id: Ulid) -> impl Future<Output = Result<Run, CoreError>> + Send {
        crate::request::ask(self.call(id, RunRequest::Wake))
    }
    /// Sets a run's expiry to now + `ttl_sec`.
    fn renew(&self, id: Ulid, ttl_sec: u64) -> impl Future<Output = Result<Run, CoreError>> + Send {
        crate::request::ask(self.call(id, RunRequest::Renew { ttl_sec }))
    }
    /// Replaces a run's egress policy while it lives.
    fn update_egress(
        &self,
        id: Ulid,
        req: runbox_types::UpdateEgressRequest,
    ) -> impl Future<Output = Result<Run, CoreError>> + Send {
        crate::request::ask(self.call(id, RunRequest::UpdateEgress { req }))
    }
    /// Grants a run's writable lease.
    fn acquire_lease(
        &self,
        id: Ulid,
        req: LeaseRequest,
    ) -> impl Future<Output = Result<Lease, CoreError>> + Send {
        crate::request::ask(self.call(id, RunRequest::AcquireLease { req }))
    }
    /// Extends a lease.
    fn renew_lease(
        &self,
        id: Ulid,
        req: LeaseRenewRequest,
    ) -> impl Future<Output = Result<Lease, CoreError>> + Send {
        crate::request::ask(self.call(id, RunRequest::RenewLease { req }))
    }
    /// Releases a lease.
    fn release_lease(
        &self,
        id: Ulid,
        req: LeaseReleaseRequest,
    ) -> impl Future<Output = Result<(), CoreError>> + Send {
        crate::request::ask(self.call(id, RunRequest::ReleaseLease { req }))
    }
    /// Starts a command; the stream carries its output and exit.
    fn exec(
        &self,
        id: Ulid,
        req: ExecRequest,
    ) -> impl Future<Output = Result<ExecStream, CoreError>> + Send;
    /// Writes a file (below `/work`, or anywhere in the run with
    /// [`Scope::Root`]) as `options` say; returns the bytes written.
    fn put_file(
        &self,
        id: Ulid,
        scope: Scope,
        path: String,
        options: WriteOptions,
        body: UploadStream,
    ) -> impl Future<Output = Result<u64, CoreError>> + Send;
    /// Reads a file in a run's `scope`.
    fn get_file(
        &self,
        id: Ulid,
        scope: Scope,
        path: String,
    ) -> impl Future<Output = Result<FileDownload, CoreError>> + Send;
    /// Forks a run into new runs that start from its filesystem.
    fn fork(
        &self,
        id: Ulid,
        req: runbox_types::ForkRequest,
    ) -> impl Future<Output = Result<runbox_types::ForkResponse, CoreError>> + Send {
        crate::request::ask(self.call(id, RunRequest::Fork { req }))
    }
    /// A run's history points, newest first.
    fn history(
        &self,
        id: Ulid,
    ) -> impl Future<Output = Result<runbox_types::HistoryList, CoreError>> + Send {
        crate::request::ask(self.call(id, RunRequest::History))
    }
    /// What a history point changed.
    fn history_diff(
        &self,
        id: Ulid,
        point: Ulid,
        query: runbox_types::HistoryDiffQuery,
    ) -> impl Future<Output = Result<runbox_types::HistoryDiff, CoreError>> + Send {
        crate::request::ask(self.call(id, RunRequest::HistoryDiff { point, query }))
    }
    /// Returns a run's files to a history point.
    fn rollback(
        &self,
        id: Ulid,
        req: runbox_types::RollbackRequest,
    ) -> impl Future<Output = Result<Run, CoreError>> + Send {
        crate::request::ask(self.call(id, RunRequest::Rollback { req }))
    }
    /// Snapshots a run into a new image.
    fn snapshot(
        &self,
        id: Ulid,
        req: runbox_types::SnapshotRequest,
    ) -> impl Future<Output = Result<runbox_types::Snapshot, CoreError>> + Send {
        crate::request::ask(self.call(id, RunRequest::Snapshot { req }))
    }
    /// Checkpoints a run into the checkpoint store.
    fn checkpoint(
        &self,
        id: Ulid,
        req: runbox_types::CheckpointRequest,
    ) -> impl Future<Output = Result<runbox_types::Checkpoint, CoreError>> + Send {
        crate::request::ask(self.call(id, RunRequest::Checkpoint { req }))
    }
    /// Every checkpoint in the store.
    fn list_checkpoints(
        &self,
    ) -> impl Future<Output = Result<Vec<runbox_types::Checkpoint>, CoreError>> + Send;
    /// One checkpoint.
    fn get_checkpoint(
        &self,
        id: Ulid,
    ) -> impl Future<Output = Result<runbox_types::Checkpoint, CoreError>> + Send;
    /// Deletes a checkpoint from the store.
    fn delete_checkpoint(&self, id: Ulid) -> impl Future<Output = Result<(), CoreError>> + Send;
    /// Publishes a run's warm volume as its repository's template.
    fn warm_commit(
        &self,
        id: Ulid,
        req: runbox_types::WarmCommitRequest,
    ) -> impl Future<Output = Result<runbox_types::WarmCommit, CoreError>> + Send {
        crate::request::ask(self.call(id, RunRequest::WarmCommit { req }))
    }
    /// A run's warm volume as it is now (its lockfile hash).
    fn warm_status(
        &self,
        id: Ulid,
    ) -> impl Future<Output = Result<runbox_types::WarmStatus, CoreError>> + Send {
        crate::request::ask(self.call(id, RunRequest::WarmStatus))
    }
    /// The warm templates `owner` sees (root: all, each stamped).
    fn warm_templates(
        &self,
        owner: &crate::tenants::Owner,
    ) -> Result<runbox_types::WarmTemplateList, CoreError>;
    /// `owner`'s warm template of a repository (root: the operator's).
    fn warm_template(
        &self,
        repo: &str,
        owner: &crate::tenants::Owner,
    ) -> Result<runbox_types::WarmTemplate, CoreError>;
    /// Drops `owner`'s warm template of a repository.
    fn warm_invalidate(
        &self,
        repo: String,
        owner: crate::tenants::Owner,
    ) -> impl Future<Output = Result<(), CoreError>> + Send;
    /// Makes a named volume of `owner`'s.
    fn create_volume(
        &self,
        req: runbox_types::CreateVolumeRequest,
        owner: crate::tenants::Owner,
    ) -> impl Future<Output = Result<runbox_types::Volume, CoreError>> + Send;
    /// A new volume of `owner`'s holding what its volume `name` holds now.
    fn clone_volume(
        &self,
        name: String,
        req: runbox_types::CloneVolumeRequest,
        owner: crate::tenants::Owner,
    ) -> impl Future<Output = Result<runbox_types::Volume, CoreError>> + Send;
    /// The volumes `owner` sees (root: every one, each stamped).
    fn list_volumes(&self, owner: &crate::tenants::Owner) -> runbox_types::VolumeList;
    /// `owner`'s volume `name`.
    fn get_volume(
        &self,
        name: &str,
        owner: &crate::tenants::Owner,
    ) -> Result<runbox_types::Volume, CoreError>;
    /// Deletes `owner`'s volume `name`; refused while a run mounts it.
    fn delete_volume(
        &self,
        name: String,
        owner: crate::tenants::Owner,
    ) -> impl Future<Output = Result<(), CoreError>> + Send;
    /// `owner`'s volume `name`, for file operations without a run; with
    /// `write` the call is a writer (refused while a run mounts the
    /// volume, holding off mounts until the handle drops).
    fn volume_files(
        &self,
        key: crate::runs::VolumeKey,
        owner: crate::tenants::Owner,
        write: bool,
    ) -> impl Future<Output = Result<crate::runs::VolumeFiles, CoreError>> + Send;
    /// Describes a path in a run's `scope` (None: its base).
    fn stat_path(
        &self,
        id: Ulid,
        scope: Scope,
        path: Option<String>,
    ) -> impl Future<Output = Result<runbox_types::FileInfo, CoreError>> + Send {
        crate::request::ask(self.call(id, RunRequest::StatPath { scope, path }))
    }
    /// Lists a directory in a run's `scope`.
    fn list_path(
        &self,
        id: Ulid,
        scope: Scope,
        query: runbox_types::FsQuery,
    ) -> impl Future<Output = Result<runbox_types::FileList, CoreError>> + Send {
        crate::request::ask(self.call(id, RunRequest::ListPath { scope, query }))
    }
    /// Watches a directory in a run's `scope`: the first event is `ready`.
    fn watch_path(
        &self,
        id: Ulid,
        scope: Scope,
        query: runbox_types::FsQuery,
    ) -> impl Future<Output = Result<BoxStream<'static, runbox_types::WatchEvent>, CoreError>> + Send;
    /// Makes a directory (and its parents) in a run's `scope`.
    fn make_dir(
        &self,
        id: Ulid,
        scope: Scope,
        req: runbox_types::MakeDirRequest,
        user: Option<String>,
    ) -> impl Future<Output = Result<runbox_types::FileInfo, CoreError>> + Send {
        crate::request::ask(self.call(id, RunRequest::MakeDir { scope, req, user }))
    }
    /// Renames a path in a run's `scope`.
    fn move_path(
        &self,
        id: Ulid,
        scope: Scope,
        req: runbox_types::MoveRequest,
    ) -> impl Future<Output = Result<runbox_types::FileInfo, CoreError>> + Send {
        crate::request::ask(self.call(id, RunRequest::MovePath { scope, req }))
    }
    /// Removes a path in a run's `scope`.
    fn remove_path(
        &self,
        id: Ulid,
        scope: Scope,
        req: runbox_types::RemoveRequest,
    ) -> impl Future<Output = Result<runbox_types::RemoveReply, CoreError>> + Send {
        crate::request::ask(self.call(id, RunRequest::RemovePath { scope, req }))
    }
    /// Starts a background process in a run.
    fn start_process(
        &self,
        id: Ulid,
        req: ExecRequest,
    ) -> impl Future<Output = Result<runbox_types::Process, CoreError>> + Send {
        crate::request::ask(self.call(id, RunRequest::StartProcess { req }))
    }
    /// A run's running processes and recently ended background ones.
    fn processes(
        &self,
        id: Ulid,
    ) -> impl Future<Output = Result<runbox_types::ProcessList, CoreError>> + Send {
        crate::request::ask(self.call(id, RunRequest::Processes))
    }
    /// Waits up to `limit` for a process (pid or tag) to end; describes it.
    fn wait_process(
        &self,
        id: Ulid,
        process: String,
        limit: std::time::Duration,
    ) -> impl Future<Output = Result<runbox_types::Process, CoreError>> + Send {
        crate::request::ask(self.call(
            id,
            RunRequest::WaitProcess {
                process,
                limit_ms: u64::try_from(limit.as_millis()).unwrap_or(u64::MAX),
            },
        ))
    }
    /// Signals a process's group.
    fn signal_process(
        &self,
        id: Ulid,
        process: String,
        req: runbox_types::SignalRequest,
    ) -> impl Future<Output = Result<runbox_types::Process, CoreError>> + Send {
        crate::request::ask(self.call(id, RunRequest::SignalProcess { process, req }))
    }
    /// Writes to a process's stdin (and closes it when `close`).
    fn send_input(
        &self,
        id: Ulid,
        process: String,
        credential: LeaseCredential,
        data: Bytes,
        close: bool,
    ) -> impl Future<Output = Result<runbox_types::Process, CoreError>> + Send {
        crate::request::ask(self.call(
            id,
            RunRequest::SendInput {
                process,
                credential,
                data: data.to_vec(),
                close,
            },
        ))
    }
    /// Sets the terminal size of a process (pid or tag) on a terminal.
    fn resize_process(
        &self,
        id: Ulid,
        process: String,
        rows: u32,
        cols: u32,
    ) -> impl Future<Output = Result<(), CoreError>> + Send {
        crate::request::ask(self.call(
            id,
            RunRequest::ResizeProcess {
                process,
                rows,
                cols,
            },
        ))
    }
    /// Starts a command with its input open to the caller.
    fn exec_session(
        &self,
        id: Ulid,
        req: ExecRequest,
    ) -> impl Future<Output = Result<Session, CoreError>> + Send;
    /// Follows a process started earlier; with `interactive` (a lease
    /// credential) the session may send it input.
    fn attach(
        &self,
        id: Ulid,
        process: String,
        replay: bool,
        interactive: Option<LeaseCredential>,
    ) -> impl Future<Output = Result<Session, CoreError>> + Send;
    /// Mints a preview URL for a port of a run.
    fn mint_preview(
        &self,
        id: Ulid,
        req: runbox_types::PreviewRequest,
    ) -> impl Future<Output = Result<runbox_types::Preview, CoreError>> + Send {
        crate::request::ask(self.call(id, RunRequest::MintPreview { req }))
    }
    /// Checks a preview token.
    fn verify_preview(&self, token: &str) -> Result<crate::preview::Grant, CoreError>;
    /// A connection to a port on a run's loopback (for a preview).
    fn dial(
        &self,
        id: Ulid,
        port: u32,
    ) -> impl Future<Output = Result<Connection, CoreError>> + Send;
    /// A connection to a port on a run's loopback for a port-forward,
    /// admitted under the lease.
    fn open_port(
        &self,
        id: Ulid,
        port: u32,
        credential: LeaseCredential,
    ) -> impl Future<Output = Result<Connection, CoreError>> + Send;
    /// The warm pools.
    fn pools(&self) -> runbox_types::PoolList;
    /// Replaces the warm pools.
    fn set_pools(
        &self,
        set: runbox_types::PoolSet,
    ) -> impl Future<Output = Result<runbox_types::PoolList, CoreError>> + Send;
    /// Cordons (true) or uncordons the node.
    fn set_draining(&self, draining: bool) -> runbox_types::PoolList;
    /// What the node is and how full.
    fn info(&self) -> runbox_types::Info;
    /// Where run `id` is when another node of the fleet holds it. None
    /// when this node answers for it: it holds it, no node does, or it
    /// has just made it its own — handed here by a move, or asleep in a
    /// shared bucket on a node that is gone or does not answer, when this
    /// node is the best to restore it on (or the request was `relayed`
    /// here by another node, which chose this one); else the best node.
    fn locate(
        &self,
        id: Ulid,
        relayed: bool,
    ) -> impl Future<Output = Result<Option<crate::fleet::Located>, CoreError>> + Send {
        let _ = (id, relayed);
        async { Ok(None) }
    }
    /// Run `id` as the fleet's catalog has it (another node's, or lost
    /// with its node).
    fn catalog_run(&self, id: Ulid) -> impl Future<Output = Result<Run, CoreError>> + Send {
        async move { Err(CoreError::RunNotFound(id)) }
    }
    /// Deletes run `id`, lost with its node.
    fn end_lost(&self, id: Ulid) -> impl Future<Output = Result<(), CoreError>> + Send {
        async move { Err(CoreError::RunNotFound(id)) }
    }
    /// The runs this node holds (not those of other nodes), by id: what
    /// a drain that moves them away goes through.
    fn held_runs(&self) -> Vec<Ulid> {
        Vec::new()
    }
    /// Moves archived run `id` of this node to a node with room when this
    /// one has none to wake it; see
    /// [`crate::runs::Manager::relocate_asleep`].
    fn relocate_asleep(
        &self,
        id: Ulid,
    ) -> impl Future<Output = Result<Option<crate::fleet::Located>, CoreError>> + Send {
        let _ = id;
        async { Ok(None) }
    }
    /// Starts moving `owner`'s volume `name` to node `to`; see
    /// [`crate::runs::Manager::leave_volume`].
    fn leave_volume(
        &self,
        name: &str,
        owner: &crate::tenants::Owner,
        to: Option<String>,
    ) -> impl Future<Output = Result<crate::runs::VolumeDeparture, CoreError>> + Send {
        let _ = (owner, to);
        let name = name.to_owned();
        async move {
            Err(CoreError::Conflict {
                code: runbox_types::ErrorCode::NotMovable,
                message: format!("volume {name:?} cannot move: this node is not part of a fleet"),
            })
        }
    }
    /// Ends the move of volume `volume` this node started; see
    /// [`crate::runs::Manager::finish_volume_move`].
    fn finish_volume_move(
        &self,
        departure: &crate::runs::VolumeDeparture,
    ) -> impl Future<Output = Result<crate::fleet::VolumeMove, CoreError>> + Send {
        let _ = departure;
        async { Ok(crate::fleet::VolumeMove::Back) }
    }
    /// Makes the volume move `key` brings this node's, for `owner`; see
    /// [`crate::runs::Manager::arrive_volume`].
    fn arrive_volume(
        &self,
        key: &str,
        owner: &crate::tenants::Owner,
    ) -> impl Future<Output = Result<runbox_types::Volume, CoreError>> + Send {
        let _ = (key, owner);
        async {
            Err(CoreError::invalid(
                runbox_types::ErrorCode::BadRequest,
                "this node is not part of a fleet",
            ))
        }
    }
    /// Moves run `id` to node `to` (the best that can take it when None);
    /// see [`crate::runs::Manager::move_run`].
    fn move_run(
        &self,
        id: Ulid,
        to: Option<String>,
    ) -> impl Future<Output = Result<(crate::fleet::Located, bool), CoreError>> + Send {
        let _ = to;
        async move {
            Err(CoreError::Conflict {
                code: runbox_types::ErrorCode::NotMovable,
                message: format!("run {id} cannot move: this node is not part of a fleet"),
            })
        }
    }
    /// The node of the fleet a create of `req` by `owner` is best made on,
    /// when it is another (never this node when `here_full`).
    fn place(
        &self,
        req: &runbox_types::CreateRunRequest,
        owner: &crate::tenants::Owner,
        here_full: bool,
    ) -> impl Future<Output = Result<Option<crate::fleet::Located>, CoreError>> + Send {
        let _ = (req, owner, here_full);
        async { Ok(None) }
    }
    /// Whether this node belongs to a fleet (other nodes may hold runs).
    fn in_fleet(&self) -> bool {
        false
    }
    /// This node's proof that it sends `what` to another node (None: no
    /// fleet).
    fn prove(&self, what: &str) -> Option<String> {
        let _ = what;
        None
    }
    /// Whether `proof` is a node of the fleet's proof of `what`.
    fn proven(&self, what: &str, proof: &str) -> bool {
        let _ = (what, proof);
        false
    }
    /// The fleet's nodes (this one alone when it has no cluster).
    fn cluster(
        &self,
    ) -> impl Future<Output = Result<runbox_types::ClusterStatus, CoreError>> + Send {
        let node =
            crate::fleet::lone_node(self.info(), Vec::new(), time::OffsetDateTime::UNIX_EPOCH);
        async move { Ok(runbox_types::ClusterStatus { nodes: vec![node] }) }
    }
    /// Whether new runs get a user namespace of their own (what
    /// [`RunService::info`] reports as `userns`, without the rest).
    fn user_namespaces(&self) -> bool {
        self.info().userns == "private"
    }
    /// Imports an image from the bytes of a tar archive, as they arrive.
    fn import_image(
        &self,
        name: String,
        body: UploadStream,
    ) -> impl Future<Output = Result<Image, CoreError>> + Send;
    /// The checks of a pull that can fail before anything is fetched.
    fn check_pull(&self, req: &PullRequest) -> Result<(), CoreError>;
    /// Pulls an image, reporting progress to `progress`.
    fn pull_image(
        &self,
        req: PullRequest,
        progress: mpsc::UnboundedSender<PullEvent>,
    ) -> impl Future<Output = Result<Image, CoreError>> + Send;
    /// Every image.
    fn list_images(&self) -> Result<Vec<Image>, CoreError>;
    /// One image, with its config document.
    fn get_image(&self, name: &str) -> Result<Image, CoreError>;
    /// Removes an image no run uses.
    fn delete_image(&self, name: String) -> impl Future<Output = Result<(), CoreError>> + Send;
    /// Stores a build context for `owner` (see [`crate::builds`]).
    fn put_build_context(
        &self,
        owner: crate::tenants::Owner,
        kind: crate::builds::ContextKind,
        digest: String,
        body: UploadStream,
    ) -> impl Future<Output = Result<runbox_types::BuildContext, CoreError>> + Send {
        let _ = (owner, kind, digest, body);
        async { Err(no_builds()) }
    }
    /// Whether `owner` has a build context stored under `digest`.
    fn has_build_context(
        &self,
        owner: &crate::tenants::Owner,
        kind: crate::builds::ContextKind,
        digest: &str,
    ) -> Result<bool, CoreError> {
        let _ = (owner, kind, digest);
        Err(no_builds())
    }
    /// Reserves a build id for a build started later, with a note of what
    /// was asked (see [`Manager::reserve_build`]).
    fn reserve_build(
        &self,
        owner: &crate::tenants::Owner,
        request: serde_json::Value,
    ) -> Result<Ulid, CoreError> {
        let _ = (owner, request);
        Err(no_builds())
    }
    /// The note of reserved, unstarted build `id`, if `owner`'s.
    fn reserved_build(
        &self,
        id: Ulid,
        owner: &crate::tenants::Owner,
    ) -> Result<Option<serde_json::Value>, CoreError> {
        let _ = (id, owner);
        Err(no_builds())
    }
    /// Starts a build (see [`crate::builds`]).
    fn start_build(
        &self,
        req: runbox_types::BuildRequest,
        owner: crate::tenants::Owner,
        options: crate::builds::BuildOptions,
    ) -> impl Future<Output = Result<runbox_types::Build, CoreError>> + Send {
        let _ = (req, owner, options);
        async { Err(no_builds()) }
    }
    /// Up to `limit` lines of build `id`'s log from line `offset`.
    fn build_log(
        &self,
        id: Ulid,
        owner: &crate::tenants::Owner,
        offset: u64,
        limit: usize,
    ) -> Result<Vec<runbox_types::BuildLog>, CoreError> {
        let _ = (id, owner, offset, limit);
        Err(no_builds())
    }
    /// Names built image `from` also `to` (see [`Manager::tag_built_image`]).
    fn tag_built_image(
        &self,
        from: String,
        to: String,
        owner: crate::tenants::Owner,
    ) -> impl Future<Output = Result<Image, CoreError>> + Send {
        let _ = (from, to, owner);
        async { Err(no_builds()) }
    }
    /// Build `id`, if `owner` may see it.
    fn get_build(
        &self,
        id: Ulid,
        owner: &crate::tenants::Owner,
    ) -> Result<runbox_types::Build, CoreError> {
        let _ = (id, owner);
        Err(no_builds())
    }
    /// The builds `owner` may see, newest first.
    fn list_builds(
        &self,
        owner: &crate::tenants::Owner,
    ) -> Result<Vec<runbox_types::Build>, CoreError> {
        let _ = owner;
        Err(no_builds())
    }
    /// Build `id`'s events, its log from `offset` (see
    /// [`crate::builds::BuildEvent`]).
    fn build_events(
        &self,
        id: Ulid,
        owner: &crate::tenants::Owner,
        offset: u64,
    ) -> Result<BoxStream<'static, crate::builds::BuildEvent>, CoreError> {
        let _ = (id, owner, offset);
        Err(no_builds())
    }
    /// Cancels build `id`; answers once it has ended.
    fn cancel_build(
        &self,
        id: Ulid,
        owner: crate::tenants::Owner,
    ) -> impl Future<Output = Result<runbox_types::Build, CoreError>> + Send {
        let _ = (id, owner);
        async { Err(no_builds()) }
    }
}

/// What a service without builds answers.
fn no_builds() -> CoreError {
    CoreError::invalid(
        runbox_types::ErrorCode::BadRequest,
        "image builds are not available on this server",
    )
}

impl RunService for Arc<Manager> {
    fn server_id(&self) -> &str {
        &self.server_id
    }

    async fn call(&self, id: Ulid, req: RunRequest) -> Result<RunReply, CoreError> {
        Manager::answer(self, id, req).await
    }

    async fn create(
        &self,
        req: CreateRunRequest,
        idempotency_key: Option<String>,
        owner: crate::tenants::Owner,
    ) -> Result<Run, CoreError> {
        Manager::create(self, req, idempotency_key, owner).await
    }

    fn tenant_of(&self, id: Ulid) -> Result<Option<String>, CoreError> {
        // The record's stamp, without the disk and egress readings a view
        // of the run takes.
        Ok(self.handle(id)?.snapshot().record.tenant.clone())
    }

    fn tenants(&self) -> Arc<dyn crate::tenants::TenantStore> {
        self.context.tenants.clone()
    }

    fn egress_classes(&self) -> Vec<String> {
        self.config()
            .egress
            .as_ref()
            .map(|e| e.class_names())
            .unwrap_or_default()
    }

    fn tenant_runs(&self) -> std::collections::HashMap<String, usize> {
        Manager::tenant_runs(self)
    }

    fn delete_tenant(&self, name: &str) -> Result<(), CoreError> {
        Manager::delete_tenant(self, name)
    }

    async fn usage_report(
        &self,
        since: Option<time::OffsetDateTime>,
        tenant: Option<String>,
    ) -> Result<runbox_types::UsageReport, CoreError> {
        let usage = self.context.usage.clone();
        tokio::task::spawn_blocking(move || {
            // What is still in the writer's batch counts too.
            usage.flush();
            let events = usage
                .events()
                .map_err(CoreError::io("reading the usage journal"))?;
            Ok(crate::accounting::summarize(
                &events,
                since,
                time::OffsetDateTime::now_utc(),
                tenant.as_deref(),
            ))
        })
        .await
        .map_err(|e| CoreError::Store(format!("usage task failed: {e}")))?
    }

    async fn lifecycle_events(&self) -> Result<Vec<crate::accounting::UsageEvent>, CoreError> {
        let usage = self.context.usage.clone();
        tokio::task::spawn_blocking(move || {
            usage.flush();
            let mut events = usage
                .events()
                .map_err(CoreError::io("reading the usage journal"))?;
            events.retain(|e| e.event != crate::accounting::UsageKind::Egress);
            Ok(events)
        })
        .await
        .map_err(|e| CoreError::Store(format!("usage task failed: {e}")))?
    }

    fn list(&self) -> Vec<Run> {
        Manager::list(self)
    }

    async fn list_fleet(&self) -> Result<Vec<Run>, CoreError> {
        Manager::list_fleet(self).await
    }

    fn get(&self, id: Ulid) -> Result<Run, CoreError> {
        Manager::get(self, id)
    }

    fn image_config(&self, id: Ulid) -> Result<crate::images::ImageConfig, CoreError> {
        Manager::image_config(self, id)
    }

    fn usage(&self, id: Ulid) -> Result<Option<crate::lane::Usage>, CoreError> {
        Manager::usage(self, id)
    }

    fn usage_history(
        &self,
        id: Ulid,
        from: Option<time::OffsetDateTime>,
        to: Option<time::OffsetDateTime>,
    ) -> Result<Vec<crate::runs::UsageSample>, CoreError> {
        Manager::usage_history(self, id, from, to)
    }

    async fn exec(&self, id: Ulid, req: ExecRequest) -> Result<ExecStream, CoreError> {
        use futures::StreamExt;
        Ok(Manager::exec(self, id, req).await?.boxed())
    }

    async fn put_file(
        &self,
        id: Ulid,
        scope: Scope,
        path: String,
        options: WriteOptions,
        body: UploadStream,
    ) -> Result<u64, CoreError> {
        let written = Manager::put_file(self, id, scope, &path, options, body).await;
        self.settled(id, written).await
    }

    async fn list_checkpoints(&self) -> Result<Vec<runbox_types::Checkpoint>, CoreError> {
        Manager::list_checkpoints(self).await
    }

    async fn get_checkpoint(&self, id: Ulid) -> Result<runbox_types::Checkpoint, CoreError> {
        Manager::get_checkpoint(self, id).await
    }

    async fn delete_checkpoint(&self, id: Ulid) -> Result<(), CoreError> {
        Manager::delete_checkpoint(self, id).await
    }

    fn warm_templates(
        &self,
        owner: &crate::tenants::Owner,
    ) -> Result<runbox_types::WarmTemplateList, CoreError> {
        Manager::warm_templates(self, owner)
    }

    fn warm_template(
        &self,
        repo: &str,
        owner: &crate::tenants::Owner,
    ) -> Result<runbox_types::WarmTemplate, CoreError> {
        Manager::warm_template(self, repo, owner)
    }

    async fn warm_invalidate(
        &self,
        repo: String,
        owner: crate::tenants::Owner,
    ) -> Result<(), CoreError> {
        Manager::warm_invalidate(self, &repo, &owner).await
    }

    async fn create_volume(
        &self,
        req: runbox_types::CreateVolumeRequest,
        owner: crate::tenants::Owner,
    ) -> Result<runbox_types::Volume, CoreError> {
        Manager::create_volume(self, req, owner.tenant()).await
    }

    async fn clone_volume(
        &self,
        name: String,
        req: runbox_types::CloneVolumeRequest,
        owner: crate::tenants::Owner,
    ) -> Result<runbox_types::Volume, CoreError> {
        Manager::clone_volume(self, &name, req, owner.tenant()).await
    }

    fn list_volumes(&self, owner: &crate::tenants::Owner) -> runbox_types::VolumeList {
        Manager::list_volumes(self, owner.tenant())
    }

    fn get_volume(
        &self,
        name: &str,
        owner: &crate::tenants::Owner,
    ) -> Result<runbox_types::Volume, CoreError> {
        Manager::get_volume(self, name, owner.tenant())
    }

    async fn delete_volume(
        &self,
        name: String,
        owner: crate::tenants::Owner,
    ) -> Result<(), CoreError> {
        Manager::delete_volume(self, &name, owner.tenant()).await
    }

    async fn volume_files(
        &self,
        key: crate::runs::VolumeKey,
        owner: crate::tenants::Owner,
        write: bool,
    ) -> Result<crate::runs::VolumeFiles, CoreError> {
        Manager::volume_files(self, &key, owner.tenant(), write).await
    }

    async fn watch_path(
        &self,
        id: Ulid,
        scope: Scope,
        query: runbox_types::FsQuery,
    ) -> Result<BoxStream<'static, runbox_types::WatchEvent>, CoreError> {
        use futures::StreamExt;
        let stream = Manager::watch_path(
            self,
            id,
            scope,
            query.path.as_deref(),
            query.recursive.unwrap_or(false),
        )
        .await?;
        Ok(stream.boxed())
    }

    async fn exec_session(&self, id: Ulid, req: ExecRequest) -> Result<Session, CoreError> {
        Manager::exec_session(self, id, req).await
    }

    async fn attach(
        &self,
        id: Ulid,
        process: String,
        replay: bool,
        interactive: Option<LeaseCredential>,
    ) -> Result<Session, CoreError> {
        Manager::attach(self, id, &process, replay, interactive).await
    }

    fn verify_preview(&self, token: &str) -> Result<crate::preview::Grant, CoreError> {
        Manager::verify_preview(self, token)
    }

    async fn dial(&self, id: Ulid, port: u32) -> Result<Connection, CoreError> {
        Ok(Box::new(Manager::dial(self, id, port).await?))
    }

    async fn open_port(
        &self,
        id: Ulid,
        port: u32,
        credential: LeaseCredential,
    ) -> Result<Connection, CoreError> {
        Ok(Box::new(
            Manager::open_port(self, id, port, credential).await?,
        ))
    }

    fn pools(&self) -> runbox_types::PoolList {
        Manager::pools(self)
    }

    async fn set_pools(
        &self,
        set: runbox_types::PoolSet,
    ) -> Result<runbox_types::PoolList, CoreError> {
        Manager::set_pools(self, set).await
    }

    fn set_draining(&self, draining: bool) -> runbox_types::PoolList {
        Manager::set_draining(self, draining)
    }

    fn info(&self) -> runbox_types::Info {
        Manager::info(self)
    }

    async fn locate(
        &self,
        id: Ulid,
        relayed: bool,
    ) -> Result<Option<crate::fleet::Located>, CoreError> {
        Manager::locate(self, id, relayed).await
    }

    async fn move_run(
        &self,
        id: Ulid,
        to: Option<String>,
    ) -> Result<(crate::fleet::Located, bool), CoreError> {
        Manager::move_run(self, id, to).await
    }

    async fn relocate_asleep(&self, id: Ulid) -> Result<Option<crate::fleet::Located>, CoreError> {
        Manager::relocate_asleep(self, id).await
    }

    async fn leave_volume(
        &self,
        name: &str,
        owner: &crate::tenants::Owner,
        to: Option<String>,
    ) -> Result<crate::runs::VolumeDeparture, CoreError> {
        Manager::leave_volume(self, name, owner.tenant(), to).await
    }

    async fn finish_volume_move(
        &self,
        departure: &crate::runs::VolumeDeparture,
    ) -> Result<crate::fleet::VolumeMove, CoreError> {
        Manager::finish_volume_move(self, departure).await
    }

    async fn arrive_volume(
        &self,
        key: &str,
        owner: &crate::tenants::Owner,
    ) -> Result<runbox_types::Volume, CoreError> {
        Manager::arrive_volume(self, key, owner.tenant()).await
    }

    fn held_runs(&self) -> Vec<Ulid> {
        Manager::list(self).into_iter().map(|run| run.id).collect()
    }

    async fn catalog_run(&self, id: Ulid) -> Result<Run, CoreError> {
        Manager::catalog_run(self, id).await
    }

    async fn end_lost(&self, id: Ulid) -> Result<(), CoreError> {
        Manager::end_lost(self, id).await
    }

    async fn place(
        &self,
        req: &runbox_types::CreateRunRequest,
        owner: &crate::tenants::Owner,
        here_full: bool,
    ) -> Result<Option<crate::fleet::Located>, CoreError> {
        Manager::place(self, req, owner, here_full).await
    }

    fn in_fleet(&self) -> bool {
        self.fleet().is_some()
    }

    fn prove(&self, what: &str) -> Option<String> {
        self.fleet().map(|fleet| fleet.prove(what))
    }

    fn proven(&self, what: &str, proof: &str) -> bool {
        self.fleet().is_some_and(|fleet| fleet.proven(what, proof))
    }

    async fn cluster(&self) -> Result<runbox_types::ClusterStatus, CoreError> {
        let Some(fleet) = self.fleet() else {
            let node =
                crate::fleet::lone_node(Manager::info(self), self.capabilities(), self.started_at);
            return Ok(runbox_types::ClusterStatus { nodes: vec![node] });
        };
        let mut nodes = fleet.nodes().await?;
        for node in &mut nodes {
            node.local = node.id == self.server_id;
            // This node knows what its lane can do now.
            if node.local {
                node.capabilities = self.capabilities();
            }
        }
        Ok(runbox_types::ClusterStatus { nodes })
    }

    fn user_namespaces(&self) -> bool {
        self.lane.capabilities().user_namespaces.yes()
    }

    async fn get_file(
        &self,
        id: Ulid,
        scope: Scope,
        path: String,
    ) -> Result<FileDownload, CoreError> {
        let download = Manager::get_file(self, id, scope, &path).await;
        self.settled(id, download).await
    }

    async fn import_image(&self, name: String, body: UploadStream) -> Result<Image, CoreError> {
        // Unpacked on a blocking thread, which reads the body through this
        // bridge as it arrives.
        let reader = tokio_util::io::SyncIoBridge::new(tokio_util::io::StreamReader::new(body));
        Manager::import_image(self, name, reader).await
    }

    fn check_pull(&self, req: &PullRequest) -> Result<(), CoreError> {
        Manager::check_pull(self, req).map(|_| ())
    }

    async fn pull_image(
        &self,
        req: PullRequest,
        progress: mpsc::UnboundedSender<PullEvent>,
    ) -> Result<Image, CoreError> {
        Manager::pull_image(self, req, progress).await
    }

    fn list_images(&self) -> Result<Vec<Image>, CoreError> {
        Manager::list_images(self)
    }

    fn get_image(&self, name: &str) -> Result<Image, CoreError> {
        Manager::get_image(self, name)
    }

    async fn delete_image(&self, name: String) -> Result<(), CoreError> {
        Manager::delete_image(self, name).await
    }

    async fn put_build_context(
        &self,
        owner: crate::tenants::Owner,
        kind: crate::builds::ContextKind,
        digest: String,
        body: UploadStream,
    ) -> Result<runbox_types::BuildContext, CoreError> {
        let reader = tokio_util::io::SyncIoBridge::new(tokio_util::io::StreamReader::new(body));
        Manager::put_build_context(self, owner, kind, digest, reader).await
    }

    fn has_build_context(
        &self,
        owner: &crate::tenants::Owner,
        kind: crate::builds::ContextKind,
        digest: &str,
    ) -> Result<bool, CoreError> {
        Manager::has_build_context(self, owner, kind, digest)
    }

    fn reserve_build(
        &self,
        owner: &crate::tenants::Owner,
        request: serde_json::Value,
    ) -> Result<Ulid, CoreError> {
        Manager::reserve_build(self, owner, request)
    }

    fn reserved_build(
        &self,
        id: Ulid,
        owner: &crate::tenants::Owner,
    ) -> Result<Option<serde_json::Value>, CoreError> {
        Manager::reserved_build(self, id, owner)
    }

    async fn start_build(
        &self,
        req: runbox_types::BuildRequest,
        owner: crate::tenants::Owner,
        options: crate::builds::BuildOptions,
    ) -> Result<runbox_types::Build, CoreError> {
        Manager::start_build_with(self, req, owner, options).await
    }

    fn build_log(
        &self,
        id: Ulid,
        owner: &crate::tenants::Owner,
        offset: u64,
        limit: usize,
    ) -> Result<Vec<runbox_types::BuildLog>, CoreError> {
        Manager::build_log(self, id, owner, offset, limit)
    }

    async fn tag_built_image(
        &self,
        from: String,
        to: String,
        owner: crate::tenants::Owner,
    ) -> Result<Image, CoreError> {
        Manager::tag_built_image(self, &from, &to, &owner).await
    }

    fn get_build(
        &self,
        id: Ulid,
        owner: &crate::tenants::Owner,
    ) -> Result<runbox_types::Build, CoreError> {
        Manager::get_build(self, id, owner)
    }

    fn list_builds(
        &self,
        owner: &crate::tenants::Owner,
    ) -> Result<Vec<runbox_types::Build>, CoreError> {
        Manager::list_builds(self, owner)
    }

    fn build_events(
        &self,
        id: Ulid,
        owner: &crate::tenants::Owner,
        offset: u64,
    ) -> Result<BoxStream<'static, crate::builds::BuildEvent>, CoreError> {
        Manager::build_events(self, id, owner, offset)
    }

    async fn cancel_build(
        &self,
        id: Ulid,
        owner: crate::tenants::Owner,
    ) -> Result<runbox_types::Build, CoreError> {
        Manager::cancel_build(self, id, &owner).await
    }
}
