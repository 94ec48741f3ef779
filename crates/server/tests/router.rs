//! Router tests: the real router over a stub service, no runtime. They pin
//! what the HTTP layer itself decides: authentication, the error shape of
//! every rejection, status codes, the SSE encoding of an exec, that a 5xx
//! never shows its detail, and (served on a loopback port, through the Rust
//! client) WebSocket sessions and port tunnels, whose ends the stub builds
//! from `RunService`'s own types. Requests addressed to one run reach the
//! stub as `RunRequest` values, as they reach a run's owner.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{HeaderValue, Request, StatusCode};
use futures::StreamExt;
use http_body_util::BodyExt;
use runbox_core::lane::LaneError;
use runbox_core::lease::Lease;
use runbox_core::request::{RunReply, RunRequest};
use runbox_core::runs::{ExecEvent, FileDownload, Scope};
use runbox_core::service::{Connection, ExecStream, LeaseCredential, UploadStream};
use runbox_core::{CoreError, RunService};
use runbox_types::{
    CreateRunRequest, ExecRequest, ExitEvent, ExitReason, Image, LeaseReleaseRequest,
    LeaseRenewRequest, LeaseRequest, Limits, NetworkTier, PullEvent, PullRequest, Run, RunStatus,
};
use tokio::sync::mpsc;
use tower::ServiceExt;
use ulid::Ulid;

const TOKEN: &str = "secret-token";
const KNOWN: &str = "01JABCDEFGHJKMNPQRSTVWXYZ0";

/// A service that knows one run, [`KNOWN`], and fails in telling ways.
#[derive(Clone)]
struct Stub;

fn known() -> Ulid {
    Ulid::from_string(KNOWN).unwrap()
}

fn run() -> Run {
    let now = time::OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap();
    Run {
        id: known(),
        server: "node".into(),
        server_origin: None,
        image: "base".into(),
        network: NetworkTier::None,
        limits: Limits {
            cpus: 1.0,
            memory_mb: 1024,
            pids: 256,
            disk_mb: Some(10240),
        },
        runtime: "runc".into(),
        created_at: now,
        expires_at: now,
        status: RunStatus::Running,
        lease: None,
        lease_generation: None,
        egress_allow: Vec::new(),
        egress_defaults: None,
        egress_socks5: None,
        egress_upstream: None,
        secrets: Vec::new(),
        egress: None,
        failure: None,
        disk_used_bytes: Some(4096),
        warm: None,
        size: None,
        labels: Default::default(),
        pooled: false,
        public_ports: false,
        auto_resume: true,
        on_expire: Default::default(),
        on_node_loss: Default::default(),
        recovered: None,
        idle: Default::default(),
        history: None,
        restarts: 0,
        allow_privilege_escalation: false,
        volumes: Vec::new(),
        restarted_at: None,
        archived_at: None,
        archive_error: None,
        tenant: None,
        token: None,
    }
}

fn stub_process() -> runbox_types::Process {
    runbox_types::Process {
        pid: 7,
        tag: None,
        cmd: vec!["sleep".into()],
        cwd: "/work".into(),
        user: None,
        started_at: time::OffsetDateTime::UNIX_EPOCH,
        background: true,
        pty: false,
        stdin_open: false,
        running: true,
        exit: None,
        ended_at: None,
    }
}

fn found(id: Ulid) -> Result<(), CoreError> {
    if id == known() {
        Ok(())
    } else {
        Err(CoreError::RunNotFound(id))
    }
}

impl RunService for Stub {
    fn server_id(&self) -> &str {
        "node"
    }
    async fn call(&self, id: Ulid, req: RunRequest) -> Result<RunReply, CoreError> {
        use RunReply as A;
        use RunRequest as Q;
        Ok(match req {
            Q::Get => A::Run(Box::new(self.get(id)?)),
            Q::Delete | Q::Kill => {
                Stub::delete(self, id).await?;
                A::Done
            }
            Q::Pause => A::Run(Box::new(Stub::pause(self, id).await?)),
            Q::Resume => A::Run(Box::new(Stub::resume(self, id).await?)),
            Q::Hibernate => A::Run(Box::new(Stub::hibernate(self, id).await?)),
            Q::Archive => A::Run(Box::new(Stub::archive(self, id).await?)),
            Q::Wake => A::Run(Box::new(Stub::wake(self, id).await?)),
            Q::Renew { ttl_sec } => A::Run(Box::new(Stub::renew(self, id, ttl_sec).await?)),
            Q::UpdateEgress { req } => A::Run(Box::new(Stub::update_egress(self, id, req).await?)),
            Q::AcquireLease { req } => A::Lease(Stub::acquire_lease(self, id, req).await?),
            Q::RenewLease { req } => A::Lease(Stub::renew_lease(self, id, req).await?),
            Q::ReleaseLease { req } => {
                Stub::release_lease(self, id, req).await?;
                A::Done
            }
            Q::Fork { req } => A::Fork(Stub::fork(self, id, req).await?),
            Q::Snapshot { req } => A::Snapshot(Stub::snapshot(self, id, req).await?),
            Q::Checkpoint { req } => A::Checkpoint(Stub::checkpoint(self, id, req).await?),
            Q::WarmCommit { req } => A::WarmCommit(Stub::warm_commit(self, id, req).await?),
            Q::WarmStatus => A::WarmStatus(Stub::warm_status(self, id).await?),
            Q::StatPath { scope, path } => {
                A::FileInfo(Stub::stat_path(self, id, scope, path).await?)
            }
            Q::ListPath { scope, query } => {
                A::FileList(Stub::list_path(self, id, scope, query).await?)
            }
            Q::MakeDir { scope, req, user } => {
                A::FileInfo(Stub::make_dir(self, id, scope, req, user).await?)
            }
            Q::MovePath { scope, req } => A::FileInfo(Stub::move_path(self, id, scope, req).await?),
            Q::RemovePath { scope, req } => {
                A::Removed(Stub::remove_path(self, id, scope, req).await?)
            }
            Q::StartProcess { req } => {
                A::Process(Box::new(Stub::start_process(self, id, req).await?))
            }
            Q::Processes => A::Processes(Stub::processes(self, id).await?),
            Q::WaitProcess { process, limit_ms } => A::Process(Box::new(
                Stub::wait_process(
                    self,
                    id,
                    process,
                    std::time::Duration::from_millis(limit_ms),
                )
                .await?,
            )),
            Q::SignalProcess { process, req } => A::Process(Box::new(
                Stub::signal_process(self, id, process, req).await?,
            )),
            Q::SendInput {
                process,
                credential,
                data,
                close,
            } => A::Process(Box::new(
                Stub::send_input(self, id, process, credential, data.into(), close).await?,
            )),
            Q::ResizeProcess {
                process,
                rows,
                cols,
            } => {
                Stub::resize_process(self, id, process, rows, cols).await?;
                A::Done
            }
            Q::MintPreview { req } => A::Preview(Stub::mint_preview(self, id, req).await?),
            Q::History | Q::HistoryDiff { .. } | Q::Rollback { .. } => {
                return Err(CoreError::invalid(
                    runbox_types::ErrorCode::PointNotFound,
                    "the stub keeps no history",
                ))
            }
        })
    }
    fn tenants(&self) -> std::sync::Arc<dyn runbox_core::tenants::TenantStore> {
        static TENANTS: std::sync::OnceLock<std::sync::Arc<runbox_core::tenants::FileTenants>> =
            std::sync::OnceLock::new();
        TENANTS
            .get_or_init(|| std::sync::Arc::new(runbox_core::tenants::FileTenants::in_memory()))
            .clone()
    }
    fn tenant_runs(&self) -> std::collections::HashMap<String, usize> {
        Default::default()
    }
    fn delete_tenant(&self, name: &str) -> Result<(), CoreError> {
        self.tenants().delete(name)
    }
    async fn usage_report(
        &self,
        since: Option<time::OffsetDateTime>,
        _tenant: Option<String>,
    ) -> Result<runbox_types::UsageReport, CoreError> {
        Ok(runbox_types::UsageReport {
            since,
            until: time::OffsetDateTime::UNIX_EPOCH,
            tenants: Default::default(),
            nodes: Vec::new(),
        })
    }
    async fn create(
        &self,
        req: CreateRunRequest,
        idempotency_key: Option<String>,
        _owner: runbox_core::tenants::Owner,
    ) -> Result<Run, CoreError> {
        if let Some(key) = idempotency_key {
            // Shows what arrived, so the test can see the header passed on.
            let mut run = run();
            run.image = format!("key:{key}");
            return Ok(run);
        }
        match req.image.as_str() {
            "boom" => Err(CoreError::Lane(LaneError::Failed(
                "runc said /secret/host/path".into(),
            ))),
            "unsupported" => Err(CoreError::Lane(LaneError::Unsupported(
                "nft is not installed; install nftables".into(),
            ))),
            "full" => Err(CoreError::Capacity(1)),
            "cordoned" => Err(CoreError::Draining),
            _ => Ok(run()),
        }
    }

    async fn list_checkpoints(&self) -> Result<Vec<runbox_types::Checkpoint>, CoreError> {
        Ok(Vec::new())
    }

    async fn get_checkpoint(&self, id: Ulid) -> Result<runbox_types::Checkpoint, CoreError> {
        Err(CoreError::invalid(
            runbox_types::ErrorCode::CheckpointNotFound,
            format!("no checkpoint with id {id}"),
        ))
    }

    async fn delete_checkpoint(&self, id: Ulid) -> Result<(), CoreError> {
        self.get_checkpoint(id).await.map(|_| ())
    }

    fn warm_templates(
        &self,
        _: &runbox_core::tenants::Owner,
    ) -> Result<runbox_types::WarmTemplateList, CoreError> {
        Ok(runbox_types::WarmTemplateList {
            templates: Vec::new(),
            bytes: 0,
            max_bytes: 1,
        })
    }
    fn warm_template(
        &self,
        repo: &str,
        _: &runbox_core::tenants::Owner,
    ) -> Result<runbox_types::WarmTemplate, CoreError> {
        // The real checks, so the router tests see hostile names refused.
        let repo = runbox_core::validate::repo(repo)?;
        Err(CoreError::invalid(
            runbox_types::ErrorCode::TemplateNotFound,
            format!("no template for {repo}"),
        ))
    }
    async fn warm_invalidate(
        &self,
        repo: String,
        owner: runbox_core::tenants::Owner,
    ) -> Result<(), CoreError> {
        self.warm_template(&repo, &owner).map(|_| ())
    }
    async fn create_volume(
        &self,
        req: runbox_types::CreateVolumeRequest,
        _: runbox_core::tenants::Owner,
    ) -> Result<runbox_types::Volume, CoreError> {
        self.get_volume(&req.name, &runbox_core::tenants::Owner::default())
    }
    async fn clone_volume(
        &self,
        name: String,
        _: runbox_types::CloneVolumeRequest,
        owner: runbox_core::tenants::Owner,
    ) -> Result<runbox_types::Volume, CoreError> {
        self.get_volume(&name, &owner)
    }
    fn list_volumes(&self, _: &runbox_core::tenants::Owner) -> runbox_types::VolumeList {
        runbox_types::VolumeList::default()
    }
    fn get_volume(
        &self,
        name: &str,
        _: &runbox_core::tenants::Owner,
    ) -> Result<runbox_types::Volume, CoreError> {
        Err(CoreError::invalid(
            runbox_types::ErrorCode::VolumeNotFound,
            format!("no volume named {name:?}"),
        ))
    }
    async fn delete_volume(
        &self,
        name: String,
        owner: runbox_core::tenants::Owner,
    ) -> Result<(), CoreError> {
        self.get_volume(&name, &owner).map(|_| ())
    }
    async fn volume_files(
        &self,
        key: runbox_core::runs::VolumeKey,
        owner: runbox_core::tenants::Owner,
        _write: bool,
    ) -> Result<runbox_core::runs::VolumeFiles, CoreError> {
        // The stub has no volume directories (the real file operations are
        // tested against the daemon, e2e).
        if let runbox_core::runs::VolumeKey::Name(name) = key {
            self.get_volume(&name, &owner)?;
        }
        Err(CoreError::invalid(
            runbox_types::ErrorCode::VolumesUnsupported,
            "the stub keeps no volume files",
        ))
    }
    async fn watch_path(
        &self,
        id: Ulid,
        _scope: Scope,
        _query: runbox_types::FsQuery,
    ) -> Result<futures::stream::BoxStream<'static, runbox_types::WatchEvent>, CoreError> {
        found(id)?;
        Ok(futures::stream::iter(vec![runbox_types::WatchEvent {
            kind: runbox_types::WatchKind::Ready,
            path: String::new(),
            from: None,
            is_dir: true,
        }])
        .boxed())
    }
    /// An echo: what comes in on stdin goes out on stdout; end of input
    /// ends the command with status 0, a signal with 128 + its number.
    async fn exec_session(
        &self,
        id: Ulid,
        _req: ExecRequest,
    ) -> Result<runbox_core::runs::Session, CoreError> {
        use runbox_core::runs::SessionInput;
        found(id)?;
        let (out, events) = mpsc::channel(16);
        let (session, mut input) = runbox_core::runs::Session::new(
            77,
            tokio_stream::wrappers::ReceiverStream::new(events).boxed(),
        );
        tokio::spawn(async move {
            let _ = out.send(ExecEvent::Started(77)).await;
            let exit = |code, signal| ExitEvent {
                point: None,
                exit_code: code,
                timed_out: false,
                signal,
                reason: ExitReason::Exited,
            };
            while let Some(next) = input.recv().await {
                let event = match next {
                    SessionInput::Stdin(data) => ExecEvent::Stdout(data),
                    SessionInput::Eof => ExecEvent::Exit(exit(0, None)),
                    SessionInput::Signal(n) => ExecEvent::Exit(exit(128 + n, Some(n))),
                    SessionInput::Resize { rows, cols } => {
                        ExecEvent::Stderr(format!("{rows}x{cols}").into())
                    }
                };
                let last = matches!(event, ExecEvent::Exit(_));
                if out.send(event).await.is_err() || last {
                    return;
                }
            }
        });
        Ok(session)
    }
    async fn attach(
        &self,
        id: Ulid,
        process: String,
        _replay: bool,
        _interactive: Option<LeaseCredential>,
    ) -> Result<runbox_core::runs::Session, CoreError> {
        found(id)?;
        runbox_core::validate::process_ref(&process)?;
        Err(CoreError::invalid(
            runbox_types::ErrorCode::ProcessNotFound,
            "no such process",
        ))
    }
    fn verify_preview(&self, _token: &str) -> Result<runbox_core::preview::Grant, CoreError> {
        Err(CoreError::invalid(
            runbox_types::ErrorCode::PreviewDenied,
            "the stub knows no tokens",
        ))
    }
    /// Port 7 echoes (in memory); nothing else listens.
    async fn dial(&self, id: Ulid, port: u32) -> Result<Connection, CoreError> {
        found(id)?;
        if port != 7 {
            return Err(CoreError::invalid(
                runbox_types::ErrorCode::PortUnreachable,
                "nothing listens in the stub",
            ));
        }
        let (ours, mut theirs) = tokio::io::duplex(1024);
        tokio::spawn(async move {
            let (mut read, mut write) = tokio::io::split(&mut theirs);
            let _ = tokio::io::copy(&mut read, &mut write).await;
        });
        Ok(Box::new(ours))
    }
    async fn open_port(
        &self,
        id: Ulid,
        port: u32,
        _credential: LeaseCredential,
    ) -> Result<Connection, CoreError> {
        self.dial(id, port).await
    }
    fn pools(&self) -> runbox_types::PoolList {
        runbox_types::PoolList {
            pools: Vec::new(),
            draining: false,
            migrated: None,
        }
    }
    async fn set_pools(
        &self,
        set: runbox_types::PoolSet,
    ) -> Result<runbox_types::PoolList, CoreError> {
        if set.pools.len() > 1 {
            return Err(CoreError::invalid(
                runbox_types::ErrorCode::BadPools,
                "one pool at most here",
            ));
        }
        Ok(self.pools())
    }
    fn set_draining(&self, draining: bool) -> runbox_types::PoolList {
        runbox_types::PoolList {
            pools: Vec::new(),
            draining,
            migrated: None,
        }
    }
    fn info(&self) -> runbox_types::Info {
        runbox_types::Info {
            server: "node".into(),
            version: "0".into(),
            runtime: "stub".into(),
            capacity: runbox_types::Capacity {
                max: 1,
                live: 1,
                creating: 0,
                pooled: 0,
            },
            pools: Vec::new(),
            draining: false,
            storage: None,
            userns: "off".into(),
            catalog: None,
        }
    }
    fn list(&self) -> Vec<Run> {
        vec![run()]
    }
    fn get(&self, id: Ulid) -> Result<Run, CoreError> {
        found(id).map(|()| run())
    }
    fn image_config(&self, id: Ulid) -> Result<runbox_core::images::ImageConfig, CoreError> {
        found(id)?;
        Ok(Default::default())
    }
    fn usage_history(
        &self,
        id: Ulid,
        _from: Option<time::OffsetDateTime>,
        _to: Option<time::OffsetDateTime>,
    ) -> Result<Vec<runbox_core::runs::UsageSample>, CoreError> {
        found(id)?;
        Ok(Vec::new())
    }
    fn usage(&self, id: Ulid) -> Result<Option<runbox_core::lane::Usage>, CoreError> {
        found(id)?;
        Ok(None)
    }

    async fn exec(&self, id: Ulid, _req: ExecRequest) -> Result<ExecStream, CoreError> {
        found(id)?;
        let events = vec![
            ExecEvent::Started(7),
            ExecEvent::Stdout("hi\n".into()),
            ExecEvent::Exit(ExitEvent {
                point: None,
                exit_code: 0,
                timed_out: false,
                signal: None,
                reason: ExitReason::Exited,
            }),
        ];
        Ok(futures::stream::iter(events).boxed())
    }
    async fn put_file(
        &self,
        id: Ulid,
        _scope: Scope,
        _path: String,
        _options: runbox_core::runs::WriteOptions,
        mut body: UploadStream,
    ) -> Result<u64, CoreError> {
        found(id)?;
        let mut total = 0;
        while let Some(piece) = body.next().await {
            total += piece.map_err(CoreError::io("reading the body"))?.len() as u64;
        }
        Ok(total)
    }
    async fn get_file(
        &self,
        id: Ulid,
        _scope: Scope,
        _path: String,
    ) -> Result<FileDownload, CoreError> {
        found(id)?;
        Ok(FileDownload {
            size: 3,
            body: futures::stream::iter([Ok(bytes::Bytes::from_static(b"abc"))]).boxed(),
        })
    }
    async fn import_image(&self, name: String, _body: UploadStream) -> Result<Image, CoreError> {
        Err(CoreError::ImageNotFound(name))
    }
    fn check_pull(&self, _req: &PullRequest) -> Result<(), CoreError> {
        Ok(())
    }
    async fn pull_image(
        &self,
        req: PullRequest,
        _progress: mpsc::UnboundedSender<PullEvent>,
    ) -> Result<Image, CoreError> {
        Err(CoreError::ImageNotFound(req.reference))
    }
    fn list_images(&self) -> Result<Vec<Image>, CoreError> {
        Ok(Vec::new())
    }
    fn get_image(&self, name: &str) -> Result<Image, CoreError> {
        Err(CoreError::ImageNotFound(name.to_owned()))
    }
    async fn delete_image(&self, name: String) -> Result<(), CoreError> {
        Err(CoreError::ImageNotFound(name))
    }
}

/// What the stub answers each request addressed to a run with.
impl Stub {
    async fn delete(&self, id: Ulid) -> Result<(), CoreError> {
        found(id)
    }

    async fn pause(&self, id: Ulid) -> Result<Run, CoreError> {
        found(id)?;
        Ok(Run {
            status: RunStatus::Paused,
            ..run()
        })
    }

    async fn resume(&self, id: Ulid) -> Result<Run, CoreError> {
        found(id)?;
        Ok(run())
    }

    async fn hibernate(&self, id: Ulid) -> Result<Run, CoreError> {
        found(id)?;
        Ok(Run {
            status: RunStatus::Hibernated,
            ..run()
        })
    }

    async fn archive(&self, id: Ulid) -> Result<Run, CoreError> {
        found(id)?;
        Ok(Run {
            status: RunStatus::Archived,
            ..run()
        })
    }

    async fn wake(&self, id: Ulid) -> Result<Run, CoreError> {
        found(id)?;
        Ok(run())
    }

    async fn renew(&self, id: Ulid, _ttl_sec: u64) -> Result<Run, CoreError> {
        found(id).map(|()| run())
    }

    async fn update_egress(
        &self,
        id: Ulid,
        _req: runbox_types::UpdateEgressRequest,
    ) -> Result<Run, CoreError> {
        found(id).map(|()| run())
    }

    async fn acquire_lease(&self, id: Ulid, _req: LeaseRequest) -> Result<Lease, CoreError> {
        found(id)?;
        Err(CoreError::RunFailed(id, "its init exited".into()))
    }

    async fn renew_lease(&self, id: Ulid, _req: LeaseRenewRequest) -> Result<Lease, CoreError> {
        Err(CoreError::RunNotFound(id))
    }

    async fn release_lease(&self, id: Ulid, _req: LeaseReleaseRequest) -> Result<(), CoreError> {
        found(id)
    }

    async fn fork(
        &self,
        id: Ulid,
        req: runbox_types::ForkRequest,
    ) -> Result<runbox_types::ForkResponse, CoreError> {
        found(id)?;
        Ok(runbox_types::ForkResponse {
            runs: (0..req.count).map(|_| run()).collect(),
            volumes_excluded: Vec::new(),
        })
    }

    async fn snapshot(
        &self,
        id: Ulid,
        req: runbox_types::SnapshotRequest,
    ) -> Result<runbox_types::Snapshot, CoreError> {
        found(id)?;
        Ok(runbox_types::Snapshot {
            image: req.name.unwrap_or_else(|| "snap-x".into()),
            parent: "base".into(),
            run: id,
            layer: "sha256:00".into(),
            layer_bytes: 0,
            frozen_ms: 0.1,
            elapsed_ms: 1.0,
            volumes_excluded: Vec::new(),
        })
    }

    async fn checkpoint(
        &self,
        id: Ulid,
        _req: runbox_types::CheckpointRequest,
    ) -> Result<runbox_types::Checkpoint, CoreError> {
        found(id)?;
        Err(CoreError::Conflict {
            code: runbox_types::ErrorCode::CheckpointStoreUnavailable,
            message: "the checkpoint store (s3://bucket) failed while uploading".into(),
        })
    }

    async fn warm_commit(
        &self,
        id: Ulid,
        _req: runbox_types::WarmCommitRequest,
    ) -> Result<runbox_types::WarmCommit, CoreError> {
        found(id)?;
        Err(CoreError::Conflict {
            code: runbox_types::ErrorCode::RunNotWarm,
            message: "no warm volume".into(),
        })
    }

    async fn warm_status(&self, id: Ulid) -> Result<runbox_types::WarmStatus, CoreError> {
        found(id)?;
        Err(CoreError::Conflict {
            code: runbox_types::ErrorCode::RunNotWarm,
            message: "no warm volume".into(),
        })
    }

    async fn stat_path(
        &self,
        id: Ulid,
        _scope: Scope,
        path: Option<String>,
    ) -> Result<runbox_types::FileInfo, CoreError> {
        found(id)?;
        // The real path rules, so the router tests see bad paths refused.
        runbox_core::validate::work_path(path.as_deref().unwrap_or("x"))?;
        Err(CoreError::invalid(
            runbox_types::ErrorCode::FileNotFound,
            "no such file",
        ))
    }

    async fn list_path(
        &self,
        id: Ulid,
        _scope: Scope,
        _query: runbox_types::FsQuery,
    ) -> Result<runbox_types::FileList, CoreError> {
        found(id)?;
        Ok(runbox_types::FileList {
            entries: Vec::new(),
            truncated: false,
        })
    }

    async fn make_dir(
        &self,
        id: Ulid,
        _scope: Scope,
        req: runbox_types::MakeDirRequest,
        _user: Option<String>,
    ) -> Result<runbox_types::FileInfo, CoreError> {
        found(id)?;
        runbox_core::validate::work_path(&req.path)?;
        Err(CoreError::invalid(
            runbox_types::ErrorCode::PathEscape,
            "leads outside",
        ))
    }

    async fn move_path(
        &self,
        id: Ulid,
        _scope: Scope,
        _req: runbox_types::MoveRequest,
    ) -> Result<runbox_types::FileInfo, CoreError> {
        found(id)?;
        Err(CoreError::Conflict {
            code: runbox_types::ErrorCode::FileExists,
            message: "exists".into(),
        })
    }

    async fn remove_path(
        &self,
        id: Ulid,
        _scope: Scope,
        _req: runbox_types::RemoveRequest,
    ) -> Result<runbox_types::RemoveReply, CoreError> {
        found(id)?;
        Ok(runbox_types::RemoveReply { removed: 1 })
    }

    async fn start_process(
        &self,
        id: Ulid,
        req: ExecRequest,
    ) -> Result<runbox_types::Process, CoreError> {
        found(id)?;
        let mut process = stub_process();
        process.cmd = req.cmd;
        process.tag = req.tag;
        Ok(process)
    }

    async fn processes(&self, id: Ulid) -> Result<runbox_types::ProcessList, CoreError> {
        found(id)?;
        Ok(runbox_types::ProcessList {
            processes: vec![stub_process()],
        })
    }

    async fn wait_process(
        &self,
        id: Ulid,
        process: String,
        limit: std::time::Duration,
    ) -> Result<runbox_types::Process, CoreError> {
        found(id)?;
        runbox_core::validate::process_ref(&process)?;
        let mut out = stub_process();
        // Shows what arrived.
        out.cwd = format!("waited {}s", limit.as_secs());
        Ok(out)
    }

    async fn signal_process(
        &self,
        id: Ulid,
        process: String,
        req: runbox_types::SignalRequest,
    ) -> Result<runbox_types::Process, CoreError> {
        found(id)?;
        runbox_core::validate::process_ref(&process)?;
        let number = req.signal.number().ok_or_else(|| {
            CoreError::invalid(runbox_types::ErrorCode::BadSignal, "not a signal")
        })?;
        let mut out = stub_process();
        out.cwd = format!("signal {number}");
        Ok(out)
    }

    async fn send_input(
        &self,
        id: Ulid,
        process: String,
        credential: LeaseCredential,
        data: bytes::Bytes,
        close: bool,
    ) -> Result<runbox_types::Process, CoreError> {
        found(id)?;
        runbox_core::validate::process_ref(&process)?;
        let mut out = stub_process();
        out.cwd = format!(
            "{} bytes close={close} owner={:?}",
            data.len(),
            credential.map(|c| c.0)
        );
        Ok(out)
    }

    async fn resize_process(
        &self,
        id: Ulid,
        _process: String,
        _rows: u32,
        _cols: u32,
    ) -> Result<(), CoreError> {
        found(id)
    }

    async fn mint_preview(
        &self,
        id: Ulid,
        req: runbox_types::PreviewRequest,
    ) -> Result<runbox_types::Preview, CoreError> {
        found(id)?;
        Ok(runbox_types::Preview {
            url: format!("http://preview/p/t{}/", req.port),
            token: format!("t{}", req.port),
            run: id,
            port: req.port as u16,
            expires_at: time::OffsetDateTime::UNIX_EPOCH,
        })
    }
}

fn app() -> axum::Router {
    runbox_server::router(runbox_server::AppState {
        service: Stub,
        token: Arc::from(TOKEN),
        audit: None,
        reload: None,
        metrics: Default::default(),
    })
}

/// Sends one request; returns the status and the body as text.
async fn call(
    method: &str,
    uri: &str,
    auth: Option<&str>,
    body: &str,
    json: bool,
) -> (StatusCode, String) {
    let mut req = Request::builder().method(method).uri(uri);
    if let Some(auth) = auth {
        req = req.header("authorization", auth);
    }
    if json {
        req = req.header("content-type", "application/json");
    }
    let response = app()
        .oneshot(req.body(Body::from(body.to_owned())).unwrap())
        .await
        .unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

async fn authed(method: &str, uri: &str, body: &str) -> (StatusCode, String) {
    call(
        method,
        uri,
        Some(&format!("Bearer {TOKEN}")),
        body,
        !body.is_empty(),
    )
    .await
}

/// The `error.code` of a JSON error body; panics on any other shape.
fn code(body: &str) -> String {
    let value: serde_json::Value = serde_json::from_str(body)
        .unwrap_or_else(|e| panic!("not a JSON error body ({e}): {body}"));
    let message = value["error"]["message"].as_str().unwrap_or("");
    assert!(!message.is_empty(), "an error without a message: {body}");
    value["error"]["code"]
        .as_str()
        .expect("error.code")
        .to_owned()
}

#[tokio::test]
async fn the_idempotency_key_reaches_the_service_and_a_bad_one_is_a_json_400() {
    let send = |value: HeaderValue| async move {
        let req = Request::builder()
            .method("POST")
            .uri("/v1/runs")
            .header("authorization", format!("Bearer {TOKEN}"))
            .header("content-type", "application/json")
            .header("idempotency-key", value)
            .body(Body::from(r#"{"image":"base"}"#))
            .unwrap();
        let response = app().oneshot(req).await.unwrap();
        let status = response.status();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8_lossy(&bytes).into_owned())
    };
    let (status, body) = send(HeaderValue::from_static("retry-1")).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert!(body.contains(r#""image":"key:retry-1""#), "{body}");
    let (status, body) = send(HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap()).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(code(&body), "bad_request");
}

#[tokio::test]
async fn health_is_open_and_everything_else_needs_the_token() {
    let (status, _) = call("GET", "/health", None, "", false).await;
    assert_eq!(status, StatusCode::OK);
    let routes = [
        ("GET", "/v1/runs".to_owned()),
        ("POST", "/v1/runs".to_owned()),
        ("GET", format!("/v1/runs/{KNOWN}")),
        ("DELETE", format!("/v1/runs/{KNOWN}")),
        ("POST", format!("/v1/runs/{KNOWN}/renew")),
        ("POST", format!("/v1/runs/{KNOWN}/exec")),
        ("POST", format!("/v1/runs/{KNOWN}/lease")),
        ("POST", format!("/v1/runs/{KNOWN}/lease/renew")),
        ("POST", format!("/v1/runs/{KNOWN}/lease/release")),
        ("PUT", format!("/v1/runs/{KNOWN}/files/a")),
        ("GET", format!("/v1/runs/{KNOWN}/files/a")),
        ("GET", "/v1/images".to_owned()),
        ("POST", "/v1/images/pull".to_owned()),
        ("POST", "/v1/images/x".to_owned()),
        ("GET", "/v1/images/x".to_owned()),
        ("DELETE", "/v1/images/x".to_owned()),
        ("POST", format!("/v1/runs/{KNOWN}/snapshot")),
        ("POST", format!("/v1/runs/{KNOWN}/fork")),
        ("GET", "/v1/snapshots".to_owned()),
        ("DELETE", "/v1/snapshots/x".to_owned()),
        ("DELETE", "/v1/snapshots?image=x".to_owned()),
        ("POST", format!("/v1/runs/{KNOWN}/warm-commit")),
        ("GET", format!("/v1/runs/{KNOWN}/warm")),
        ("GET", "/v1/warmcache".to_owned()),
        ("GET", "/v1/warmcache/acme/web".to_owned()),
        ("DELETE", "/v1/warmcache/acme/web".to_owned()),
        ("GET", format!("/v1/runs/{KNOWN}/fs/stat?path=a")),
        ("GET", format!("/v1/runs/{KNOWN}/fs/list")),
        ("GET", format!("/v1/runs/{KNOWN}/fs/watch")),
        ("POST", format!("/v1/runs/{KNOWN}/fs/mkdir")),
        ("POST", format!("/v1/runs/{KNOWN}/fs/move")),
        ("POST", format!("/v1/runs/{KNOWN}/fs/remove")),
        ("GET", "/v1/pools".to_owned()),
        ("PUT", "/v1/pools".to_owned()),
        ("POST", "/v1/drain".to_owned()),
        ("DELETE", "/v1/drain".to_owned()),
        ("GET", "/v1/info".to_owned()),
    ];
    for (method, uri) in &routes {
        for auth in [
            None,
            Some("Bearer wrong"),
            Some(TOKEN),
            Some("Basic c2VjcmV0"),
        ] {
            let (status, body) = call(method, uri, auth, "", false).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{method} {uri} {auth:?}");
            assert_eq!(code(&body), "unauthorized");
        }
    }
    // The scheme name is case-insensitive.
    let (status, _) = call(
        "GET",
        "/v1/runs",
        Some(&format!("bearer {TOKEN}")),
        "",
        false,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn fs_routes_refuse_parameters_that_do_not_apply() {
    let auth = format!("Bearer {TOKEN}");
    for (uri, status) in [
        (
            format!("/v1/runs/{KNOWN}/fs/stat?path=a&recursive=true"),
            400,
        ),
        (format!("/v1/runs/{KNOWN}/fs/stat?depth=2"), 400),
        (format!("/v1/runs/{KNOWN}/fs/list?recursive=false"), 400),
        (format!("/v1/runs/{KNOWN}/fs/watch?limit=5"), 400),
        (format!("/v1/runs/{KNOWN}/fs/list?bogus=1"), 400),
        (
            format!("/v1/runs/{KNOWN}/fs/list?path=a&depth=2&limit=5"),
            200,
        ),
    ] {
        let (got, body) = call("GET", &uri, Some(&auth), "", false).await;
        assert_eq!(got.as_u16(), status, "{uri}: {body}");
        if status == 400 {
            assert_eq!(code(&body), "bad_request", "{uri}");
        }
    }
}

#[tokio::test]
async fn every_rejection_has_the_json_error_shape() {
    let cases: &[(&str, String, &str, u16, &str)] = &[
        (
            "GET",
            "/v1/runs/not-a-ulid".into(),
            "",
            404,
            "run_not_found",
        ),
        (
            "GET",
            format!("/v1/runs/{}", Ulid::new()),
            "",
            404,
            "run_not_found",
        ),
        ("POST", "/v1/runs".into(), "{", 400, "bad_request"),
        (
            "POST",
            format!("/v1/runs/{KNOWN}/snapshot"),
            r#"{"label":"x"}"#,
            400,
            "bad_request",
        ),
        ("DELETE", "/v1/snapshots".into(), "", 400, "bad_request"),
        (
            "POST",
            format!("/v1/runs/{KNOWN}/warm-commit"),
            r#"{"repo":"a/b","path":"/x"}"#,
            400,
            "bad_request",
        ),
        (
            "POST",
            format!("/v1/runs/{KNOWN}/warm-commit"),
            "{}",
            409,
            "run_not_warm",
        ),
        (
            "GET",
            format!("/v1/runs/{KNOWN}/warm"),
            "",
            409,
            "run_not_warm",
        ),
        (
            "GET",
            "/v1/warmcache/acme/web".into(),
            "",
            404,
            "template_not_found",
        ),
        (
            "GET",
            "/v1/warmcache/..%2F..%2Fetc/passwd".into(),
            "",
            400,
            "bad_repo",
        ),
        ("GET", "/v1/warmcache/acme/..".into(), "", 400, "bad_repo"),
        (
            "DELETE",
            "/v1/warmcache/acme/.git".into(),
            "",
            400,
            "bad_repo",
        ),
        (
            "DELETE",
            "/v1/warmcache/ac%20me/web".into(),
            "",
            400,
            "bad_repo",
        ),
        (
            "GET",
            "/v1/warmcache/acme/web/extra".into(),
            "",
            404,
            "not_found",
        ),
        (
            "GET",
            "/v1/warmcache/%FF/web".into(),
            "",
            400,
            "bad_request",
        ),
        (
            "POST",
            "/v1/runs".into(),
            r#"{"image":"base","warm":{"repo":"a/b","size":1}}"#,
            400,
            "bad_request",
        ),
        (
            "POST",
            format!("/v1/runs/{KNOWN}/fork"),
            r#"{"count":-1}"#,
            400,
            "bad_request",
        ),
        (
            "POST",
            "/v1/runs".into(),
            r#"{"image":"base","colour":"red"}"#,
            400,
            "bad_request",
        ),
        (
            "POST",
            "/v1/runs".into(),
            r#"{"image":7}"#,
            400,
            "bad_request",
        ),
        (
            "POST",
            format!("/v1/runs/{KNOWN}/renew"),
            r#"{}"#,
            400,
            "bad_request",
        ),
        (
            "POST",
            format!("/v1/runs/{KNOWN}/exec"),
            r#"{"cmd":"ls"}"#,
            400,
            "bad_request",
        ),
        (
            "POST",
            format!("/v1/runs/{KNOWN}/lease"),
            r#"{"owner":"a"}"#,
            409,
            "run_failed",
        ),
        (
            "POST",
            format!("/v1/runs/{KNOWN}/lease/renew"),
            r#"{"owner":"a","generation":1}"#,
            404,
            "run_not_found",
        ),
        ("GET", "/v1/images/%FF".into(), "", 400, "bad_request"),
        ("DELETE", "/v1/images/%FF".into(), "", 400, "bad_request"),
        ("GET", "/v1/images/base".into(), "", 404, "image_not_found"),
        (
            "GET",
            format!("/v1/runs/{KNOWN}/files/%FF%FE"),
            "",
            400,
            "bad_request",
        ),
        (
            "PUT",
            format!("/v1/runs/{KNOWN}/files/a?colour=red"),
            "",
            400,
            "bad_request",
        ),
        (
            "PUT",
            format!("/v1/runs/{KNOWN}/files/a?owner=a&owner=b&generation=1"),
            "",
            400,
            "bad_request",
        ),
        (
            "PUT",
            format!("/v1/runs/{KNOWN}/files/a?owner=a"),
            "",
            400,
            "bad_generation",
        ),
        (
            "PUT",
            format!("/v1/runs/{KNOWN}/files/a?owner=a&generation=x"),
            "",
            400,
            "bad_generation",
        ),
        ("GET", "/v1/nowhere".into(), "", 404, "not_found"),
        ("PATCH", "/v1/runs".into(), "", 405, "method_not_allowed"),
        (
            "PUT",
            "/v1/images/base".into(),
            "",
            405,
            "method_not_allowed",
        ),
    ];
    for (method, uri, body, status, want) in cases {
        let (got, text) = authed(method, uri, body).await;
        assert_eq!(got.as_u16(), *status, "{method} {uri}: {text}");
        assert_eq!(code(&text), *want, "{method} {uri}");
    }
    // A JSON body without its content type says what to send.
    let (status, text) = call(
        "POST",
        "/v1/runs",
        Some(&format!("Bearer {TOKEN}")),
        r#"{"image":"base"}"#,
        false,
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(text.contains("Content-Type: application/json"), "{text}");
    // An oversized JSON body is a 413, not a parse error.
    let big = format!(r#"{{"image":"{}"}}"#, "x".repeat(2 << 20));
    let (status, text) = authed("POST", "/v1/runs", &big).await;
    assert_eq!((status.as_u16(), code(&text).as_str()), (413, "too_large"));
}

#[tokio::test]
async fn a_server_fault_never_shows_its_detail() {
    let (status, text) = authed("POST", "/v1/runs", r#"{"image":"boom"}"#).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(code(&text), "internal");
    assert!(!text.contains("/secret/host/path"), "{text}");
}

#[tokio::test]
async fn a_lane_refusal_says_why() {
    let (status, text) = authed("POST", "/v1/runs", r#"{"image":"unsupported"}"#).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(code(&text), "network_unsupported");
    assert!(text.contains("install nftables"), "{text}");
}

#[tokio::test]
async fn answers_have_their_documented_status_and_shape() {
    let (status, text) = authed("POST", "/v1/runs", r#"{"image":"base"}"#).await;
    assert_eq!(status, StatusCode::CREATED);
    let created: Run = serde_json::from_str(&text).unwrap();
    assert_eq!(created.id, known());
    let (status, _) = authed("DELETE", &format!("/v1/runs/{KNOWN}"), "").await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let (status, text) = authed("GET", "/v1/runs", "").await;
    assert_eq!(status, StatusCode::OK);
    assert!(text.contains(r#""server":"node""#), "{text}");
    let (status, text) = authed("GET", &format!("/v1/runs/{KNOWN}/files/a"), "").await;
    assert_eq!((status, text.as_str()), (StatusCode::OK, "abc"));
    let (status, _) = authed(
        "PUT",
        &format!("/v1/runs/{KNOWN}/files/a?owner=a&generation=2"),
        "data",
    )
    .await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    // An exec is an SSE stream: started, output (base64), exit.
    let (status, text) = authed(
        "POST",
        &format!("/v1/runs/{KNOWN}/exec"),
        r#"{"cmd":["true"]}"#,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let events: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("event: "))
        .collect();
    assert_eq!(events, ["started", "stdout", "exit"], "{text}");
    assert!(text.contains("data: aGkK"), "{text}");
    assert!(text.contains(r#""reason":"exited""#), "{text}");
}

#[tokio::test]
async fn capacity_and_draining_say_when_to_retry() {
    for (image, status, wanted, retry) in [
        ("full", 429, "capacity", "1"),
        ("cordoned", 503, "draining", "30"),
    ] {
        let req = Request::builder()
            .method("POST")
            .uri("/v1/runs")
            .header("authorization", format!("Bearer {TOKEN}"))
            .header("content-type", "application/json")
            .body(Body::from(format!(r#"{{"image":"{image}"}}"#)))
            .unwrap();
        let response = app().oneshot(req).await.unwrap();
        assert_eq!(response.status().as_u16(), status);
        assert_eq!(
            response.headers().get("retry-after"),
            Some(&HeaderValue::from_static(retry))
        );
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        let body = String::from_utf8_lossy(&bytes).into_owned();
        assert_eq!(code(&body), wanted, "{body}");
        // Both messages say what to do, not "internal error".
        assert!(
            body.contains("--max-runs") || body.contains("drain"),
            "{body}"
        );
    }
}

#[tokio::test]
async fn process_routes_check_their_input() {
    let base = format!("/v1/runs/{KNOWN}/processes");
    let refused: &[(&str, String, &str, u16, &str)] = &[
        // Hostile process references.
        ("GET", format!("{base}/0"), "", 400, "bad_process"),
        ("GET", format!("{base}/99999999999"), "", 400, "bad_process"),
        ("GET", format!("{base}/a%20b"), "", 400, "bad_process"),
        (
            "GET",
            format!("{base}/..%2F..%2Fetc"),
            "",
            400,
            "bad_process",
        ),
        ("GET", format!("{base}/%00"), "", 400, "bad_process"),
        (
            "GET",
            format!("{base}/{}", "x".repeat(65)),
            "",
            400,
            "bad_process",
        ),
        // Query strings: unknown, repeated, malformed.
        (
            "GET",
            format!("{base}/web/wait?timeout=3"),
            "",
            400,
            "bad_request",
        ),
        (
            "GET",
            format!("{base}/web/wait?timeoutSec=x"),
            "",
            400,
            "bad_request",
        ),
        (
            "POST",
            format!("{base}/web/stdin?close=maybe"),
            "",
            400,
            "bad_request",
        ),
        (
            "POST",
            format!("{base}/web/stdin?close=1&close=1"),
            "",
            400,
            "bad_request",
        ),
        (
            "POST",
            format!("{base}/web/stdin?generation=1"),
            "",
            400,
            "bad_owner",
        ),
        (
            "POST",
            format!("{base}/web/stdin?owner=a&generation=x"),
            "",
            400,
            "bad_generation",
        ),
        (
            "POST",
            format!("{base}/web/stdin?path=x"),
            "",
            400,
            "bad_request",
        ),
        // Signals.
        (
            "POST",
            format!("{base}/web/signal"),
            r#"{"signal":"NOPE"}"#,
            400,
            "bad_signal",
        ),
        (
            "POST",
            format!("{base}/web/signal"),
            r#"{"signal":0}"#,
            400,
            "bad_signal",
        ),
        (
            "POST",
            format!("{base}/web/signal"),
            r#"{"signal":65}"#,
            400,
            "bad_signal",
        ),
        (
            "POST",
            format!("{base}/web/signal"),
            r#"{"signal":"TERM","x":1}"#,
            400,
            "bad_request",
        ),
        (
            "POST",
            format!("{base}/web/signal"),
            r#"{}"#,
            400,
            "bad_request",
        ),
        // Starts: unknown fields and bad shapes are refused before the service.
        (
            "POST",
            base.clone(),
            r#"{"cmd":["x"],"detach":true}"#,
            400,
            "bad_request",
        ),
        (
            "POST",
            base.clone(),
            r#"{"cmd":["x"],"pty":{"rows":1}}"#,
            400,
            "bad_request",
        ),
        (
            "POST",
            base.clone(),
            r#"{"cmd":["x"],"pty":{"rows":1,"cols":1,"x":1}}"#,
            400,
            "bad_request",
        ),
        // Attach to what the stub does not know.
        (
            "GET",
            format!("{base}/web/output"),
            "",
            404,
            "process_not_found",
        ),
        (
            "GET",
            format!("{base}/web/output?replay=x"),
            "",
            400,
            "bad_request",
        ),
        // A run that does not exist.
        (
            "GET",
            format!("/v1/runs/{}/processes", Ulid::new()),
            "",
            404,
            "run_not_found",
        ),
    ];
    for (method, uri, body, status, expected) in refused {
        let (got, text) = authed(method, uri, body).await;
        assert_eq!(got.as_u16(), *status, "{method} {uri}: {text}");
        assert_eq!(code(&text), *expected, "{method} {uri}");
    }

    let (status, body) = authed("POST", &base, r#"{"cmd":["sleep","9"],"tag":"web"}"#).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let process: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(process["tag"], "web");
    assert_eq!(process["startedAt"], "1970-01-01T00:00:00Z");
    let (status, body) = authed("GET", &base, "").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (_, body) = authed("GET", &format!("{base}/web/wait?timeoutSec=5"), "").await;
    assert!(body.contains("waited 5s"), "{body}");
    let (_, body) = authed("GET", &format!("{base}/123/wait"), "").await;
    assert!(body.contains("waited 60s"), "default wait: {body}");
    for (signal, number) in [
        (r#""TERM""#, 15),
        (r#""sigint""#, 2),
        ("9", 9),
        (r#""SIG10""#, 10),
    ] {
        let (status, body) = authed(
            "POST",
            &format!("{base}/web/signal"),
            &format!(r#"{{"signal":{signal}}}"#),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{signal}: {body}");
        assert!(
            body.contains(&format!("signal {number}")),
            "{signal}: {body}"
        );
    }
    let (status, body) = call(
        "POST",
        &format!("{base}/web/stdin?close=true&owner=me&generation=2"),
        Some(&format!("Bearer {TOKEN}")),
        "hello",
        false,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body.contains("5 bytes close=true owner=Some"), "{body}");
    let big = "x".repeat(512 * 1024 + 1);
    let (status, body) = call(
        "POST",
        &format!("{base}/web/stdin"),
        Some(&format!("Bearer {TOKEN}")),
        &big,
        false,
    )
    .await;
    assert_eq!(status.as_u16(), 413, "{body}");
    assert_eq!(code(&body), "too_large");
    // The WebSocket routes need the token, and an upgrade.
    let (status, _) = call("GET", &format!("/v1/runs/{KNOWN}/exec/ws"), None, "", false).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    for uri in [
        format!("/v1/runs/{KNOWN}/exec/ws"),
        format!("{base}/web/ws"),
    ] {
        let (status, body) = authed("GET", &uri, "").await;
        assert_eq!(
            status.as_u16(),
            400,
            "a plain GET is not an upgrade: {body}"
        );
        assert_eq!(code(&body), "bad_request");
    }
}

#[tokio::test]
async fn preview_and_tunnel_routes_check_their_input() {
    let (status, body) = authed(
        "POST",
        &format!("/v1/runs/{KNOWN}/preview"),
        r#"{"port":8080,"ttlSec":60}"#,
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert!(body.contains("/p/t8080/"), "{body}");
    for (body, expected) in [
        (r#"{"port":80,"x":1}"#, "bad_request"),
        (r#"{"port":"80"}"#, "bad_request"),
        (r#"{}"#, "bad_request"),
    ] {
        let (status, text) = authed("POST", &format!("/v1/runs/{KNOWN}/preview"), body).await;
        assert_eq!(status.as_u16(), 400, "{body}: {text}");
        assert_eq!(code(&text), expected, "{body}");
    }
    // The tunnel needs the upgrade headers, a numeric port and known
    // query parameters, and the token like every route.
    let tunnel = format!("/v1/runs/{KNOWN}/ports/8080/connect");
    let (status, _) = call("GET", &tunnel, None, "", false).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, text) = authed("GET", &tunnel, "").await;
    assert_eq!(status.as_u16(), 400, "{text}");
    assert_eq!(code(&text), "bad_request");
    let upgrade = |uri: String| async move {
        let req = Request::builder()
            .method("GET")
            .uri(uri)
            .header("authorization", format!("Bearer {TOKEN}"))
            .header("connection", "upgrade")
            .header("upgrade", "runbox-tcp")
            .body(Body::empty())
            .unwrap();
        let response = app().oneshot(req).await.unwrap();
        let status = response.status();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        (
            status.as_u16(),
            String::from_utf8_lossy(&bytes).into_owned(),
        )
    };
    for (uri, status, expected) in [
        (format!("/v1/runs/{KNOWN}/ports/x/connect"), 400, "bad_port"),
        (
            format!("/v1/runs/{KNOWN}/ports/99999999999/connect"),
            400,
            "bad_port",
        ),
        (
            format!("/v1/runs/{KNOWN}/ports/80/connect?bogus=1"),
            400,
            "bad_request",
        ),
        (
            format!("/v1/runs/{KNOWN}/ports/80/connect"),
            502,
            "port_unreachable",
        ),
        (
            format!("/v1/runs/{}/ports/80/connect", Ulid::new()),
            404,
            "run_not_found",
        ),
    ] {
        let (got, text) = upgrade(uri.clone()).await;
        assert_eq!(got, status, "{uri}: {text}");
        assert_eq!(code(&text), expected, "{uri}");
    }
}

#[tokio::test]
async fn the_openapi_document_is_served_without_a_token() {
    let (status, body) = call("GET", "/v1/openapi.json", None, "", false).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, runbox_server::openapi::document_json());
    let value: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(value["openapi"], "3.1.0");
    // Everything else still needs the token.
    let (status, _) = call("GET", "/v1/runs", None, "", false).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn a_whole_number_written_as_a_float_is_that_integer() {
    // JSON Schema counts 8080.0 as an integer, and Python's json writes a
    // float that way.
    let preview = format!("/v1/runs/{KNOWN}/preview");
    for body in [r#"{"port":8080.0,"ttlSec":60}"#, r#"{"port":8.08e3}"#] {
        let (status, text) = authed("POST", &preview, body).await;
        assert_eq!(status, StatusCode::CREATED, "{body}: {text}");
        assert!(text.contains("/p/t8080/"), "{text}");
    }
    // A fraction, a number beyond the field, a duplicate key and an unknown
    // field are still refused, with the field named.
    for (body, names) in [
        (r#"{"port":8080.5}"#, "port"),
        (r#"{"port":-1.0}"#, "port"),
        (r#"{"port":1e30}"#, "port"),
        (r#"{"port":80,"port":81.0}"#, "port"),
        (r#"{"port":80.0,"x":1}"#, "x"),
    ] {
        let (status, text) = authed("POST", &preview, body).await;
        assert_eq!(status.as_u16(), 400, "{body}: {text}");
        assert_eq!(code(&text), "bad_request", "{body}");
        assert!(text.contains(names), "{body}: {text}");
    }
    // Any route with a JSON body, the same way.
    let (status, text) = authed(
        "POST",
        &format!("/v1/runs/{KNOWN}/renew"),
        r#"{"ttlSec":60.0}"#,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{text}");
}

/// The router served on a loopback port, for the clients that need a real
/// connection (WebSocket sessions, upgraded tunnels).
async fn served() -> runbox_client::Client {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app()).await;
    });
    runbox_client::Client::new(&format!("http://{addr}"), TOKEN).unwrap()
}

#[tokio::test]
async fn a_websocket_session_carries_input_and_output_both_ways() {
    let client = served().await;
    let req = ExecRequest {
        cmd: vec!["cat".into()],
        ..Default::default()
    };
    let mut session = client.exec_session(KNOWN, &req).await.expect("session");
    assert_eq!(session.pid, 77);
    session.writer.stdin("hello ").await.unwrap();
    session.writer.stdin("world").await.unwrap();
    session.writer.eof().await.unwrap();
    let mut stdout = Vec::new();
    let mut exit = None;
    while let Some(event) = session.events.next().await {
        match event.expect("event") {
            runbox_client::ExecEvent::Stdout(chunk) => stdout.extend_from_slice(&chunk),
            runbox_client::ExecEvent::Exit(e) => exit = Some(e),
            _ => {}
        }
    }
    assert_eq!(stdout, b"hello world");
    assert_eq!(exit.expect("an exit").exit_code, 0);
    // An unknown run is refused before the upgrade, with the API's error.
    let err = client
        .exec_session(&Ulid::new().to_string(), &req)
        .await
        .expect_err("unknown run");
    assert!(err.to_string().contains("run_not_found"), "{err}");
}

#[tokio::test]
async fn a_port_tunnel_is_a_byte_stream_both_ways() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let client = served().await;
    let mut tunnel = client.connect_port(KNOWN, 7, None).await.expect("tunnel");
    tunnel.write_all(b"ping").await.unwrap();
    let mut back = [0u8; 4];
    tunnel.read_exact(&mut back).await.unwrap();
    assert_eq!(&back, b"ping");
    let err = client
        .connect_port(KNOWN, 8, None)
        .await
        .expect_err("closed port");
    assert!(err.to_string().contains("port_unreachable"), "{err}");
}

#[tokio::test]
async fn checkpoint_routes_check_their_input_and_say_when_to_retry() {
    // An empty body is the default request; the store being down is a 503
    // that says when to retry and what failed.
    let req = Request::builder()
        .method("POST")
        .uri(format!("/v1/runs/{KNOWN}/checkpoint"))
        .header("authorization", format!("Bearer {TOKEN}"))
        .body(Body::empty())
        .unwrap();
    let response = app().oneshot(req).await.unwrap();
    assert_eq!(response.status().as_u16(), 503);
    assert_eq!(
        response.headers().get("retry-after"),
        Some(&HeaderValue::from_static("10"))
    );
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let body = String::from_utf8_lossy(&bytes).into_owned();
    assert_eq!(code(&body), "checkpoint_store_unavailable");
    assert!(body.contains("s3://bucket"), "{body}");
    // A body, when given, is checked.
    let (status, body) = authed(
        "POST",
        &format!("/v1/runs/{KNOWN}/checkpoint"),
        r#"{"labels":{"ok":"yes"},"extra":1}"#,
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body.contains("extra"), "{body}");
    let (status, body) = authed("GET", "/v1/checkpoints", "").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body, r#"{"checkpoints":[]}"#);
    for method in ["GET", "DELETE"] {
        let (status, body) = authed(method, "/v1/checkpoints/not-a-ulid", "").await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
        assert_eq!(code(&body), "checkpoint_not_found");
        let (status, body) = authed(method, &format!("/v1/checkpoints/{}", Ulid::new()), "").await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
        assert_eq!(code(&body), "checkpoint_not_found");
    }
    let (status, _) = call("GET", "/v1/checkpoints", None, "", false).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
}

/// The spellings of `id` a client may send besides the id itself: one
/// character percent-encoded, every character percent-encoded in upper
/// and in lower hex, the id in lower case.
fn spellings(id: &str) -> Vec<String> {
    let every = |lower: bool| {
        id.bytes()
            .map(|b| {
                let hex = format!("%{b:02X}");
                if lower {
                    hex.to_lowercase()
                } else {
                    hex
                }
            })
            .collect::<String>()
    };
    vec![
        format!("%{:02X}{}", id.as_bytes()[0], &id[1..]),
        format!("{}%{:02x}", &id[..25], id.as_bytes()[25]),
        every(false),
        every(true),
        id.to_lowercase(),
    ]
}

/// Spellings that a lenient decoder would fold onto `id` but that are not
/// it: a first character above 7 (the top bits wrap away), Crockford's
/// `O` for `0`.
fn not_spellings(id: &str) -> Vec<String> {
    let first = id.as_bytes()[0] - b'0';
    vec![
        format!("{}{}", (b'8' + first) as char, &id[1..]),
        id.replacen('0', "O", 1),
    ]
}

/// (method, path) of every route a router source file declares.
fn declared_routes(source: &str) -> Vec<(String, String)> {
    let mut routes = Vec::new();
    let mut rest = source;
    while let Some(at) = rest.find(".route(") {
        rest = &rest[at + ".route(".len()..];
        let Some(open) = rest.find('"') else { break };
        let after = &rest[open + 1..];
        let path = after[..after.find('"').expect("a closing quote")].to_owned();
        // Its handlers: up to the next route or the end of the function.
        let end = [after.find(".route("), after.find("\n}")]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(after.len());
        let chain = &after[..end];
        for method in ["get", "post", "put", "patch", "delete"] {
            let named = chain.match_indices(&format!("{method}(")).any(|(i, _)| {
                !chain[..i]
                    .chars()
                    .last()
                    .is_some_and(|c| c.is_alphanumeric() || c == '_')
            });
            if named || chain.contains(&format!("routing::{method}(")) {
                routes.push((method.to_uppercase(), path.clone()));
            }
        }
    }
    routes
}

/// `route` with its parameters filled: `{id}` as `id`, the rest with
/// values any of its handlers would take.
fn filled(route: &str, id: &str) -> String {
    route
        .replace("{id}", id)
        .replace("{*path}", "f.txt")
        .replace("{process}", "1")
        .replace("{port}", "8080")
}

/// The hole this closes: authorisation read the id from the raw path
/// (where `%30...` is no id, and was let through), the handler acted on
/// the decoded one. Every route that names a run, in every spelling of a
/// run the caller may not touch, is a 404 `run_not_found` and never
/// reaches a handler; for root, each spelling answers as the id does.
#[tokio::test]
async fn every_spelling_of_an_id_is_authorised_as_the_run_it_names() {
    let (_, tenant) = Stub
        .tenants()
        .create(runbox_types::CreateTenantRequest {
            name: "intruder".into(),
            ..Default::default()
        })
        .unwrap();
    let own_run = runbox_server::auth::run_token(TOKEN, Ulid::new());
    let mut routes: Vec<(String, String)> = declared_routes(include_str!("../src/lib.rs"))
        .into_iter()
        .filter(|(_, route)| route.starts_with("/v1/runs/{id}"))
        .collect();
    assert!(routes.len() >= 35, "{} run routes", routes.len());
    let e2b: Vec<(String, String)> = declared_routes(include_str!("../src/e2b/control.rs"))
        .into_iter()
        .filter(|(_, route)| route.contains("/sandboxes/{id}"))
        .collect();
    assert!(e2b.len() >= 12, "{} sandbox routes", e2b.len());
    routes.extend(e2b.iter().cloned());
    let mut wrong = Vec::new();
    for (method, route) in &routes {
        let is_e2b = !route.starts_with("/v1/");
        let plain = call(
            method,
            &filled(route, KNOWN),
            Some(&format!("Bearer {TOKEN}")),
            "{}",
            true,
        )
        .await;
        for spelling in spellings(KNOWN) {
            let uri = filled(route, &spelling);
            let as_root = call(method, &uri, Some(&format!("Bearer {TOKEN}")), "{}", true).await;
            if as_root.0 != plain.0 {
                wrong.push(format!(
                    "{method} {uri} as root: {}, the id answers {}",
                    as_root.0, plain.0
                ));
            }
            let callers: Vec<&str> = if is_e2b {
                vec![&tenant]
            } else {
                vec![&tenant, &own_run]
            };
            for caller in callers {
                let (status, body) =
                    call(method, &uri, Some(&format!("Bearer {caller}")), "{}", true).await;
                // A route only root may take (a move) is refused to
                // everyone else whatever the id, so it says nothing of it.
                let root_only = !is_e2b
                    && runbox_server::auth::rule(&method.parse().unwrap(), route)
                        == runbox_server::auth::Rule::Root;
                let refused = if is_e2b {
                    status == StatusCode::NOT_FOUND
                } else if root_only {
                    (status == StatusCode::FORBIDDEN && code(&body) == "forbidden")
                        || (status == StatusCode::NOT_FOUND && code(&body) == "run_not_found")
                } else {
                    status == StatusCode::NOT_FOUND && code(&body) == "run_not_found"
                };
                if !refused {
                    wrong.push(format!(
                        "{method} {uri} as {}: {status} {body}",
                        &caller[..4]
                    ));
                }
            }
        }
        for not_id in not_spellings(KNOWN) {
            let uri = filled(route, &not_id);
            let (status, body) =
                call(method, &uri, Some(&format!("Bearer {TOKEN}")), "{}", true).await;
            if status != StatusCode::NOT_FOUND {
                wrong.push(format!(
                    "{method} {uri} (not the id) as root: {status} {body}"
                ));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "spellings that were not held to their run:\n{}",
        wrong.join("\n")
    );
}

/// The lists that take a label selector refuse what is not one.
#[tokio::test]
async fn label_selectors_are_checked_on_every_list_that_takes_one() {
    for list in ["/v1/runs", "/v1/checkpoints"] {
        for (query, status, want) in [
            ("?label=team=a&label=job", 200, ""),
            ("?label=bad%20key", 400, "bad_labels"),
            ("?label=", 400, "bad_labels"),
            ("?team=a", 400, "bad_request"),
            ("?label=k=%01", 400, "bad_labels"),
        ] {
            let (got, body) = authed("GET", &format!("{list}{query}"), "").await;
            assert_eq!(got.as_u16(), status, "{list}{query}: {body}");
            if status != 200 {
                assert_eq!(code(&body), want, "{list}{query}");
            }
        }
    }
}
