//! The run lifecycle against a model: random sequences of API calls, clients
//! that hang up, sandboxes that die, time passing and daemon restarts, on a
//! [`Manager`] whose lane is a stand-in: each "sandbox" is an agent served
//! in-process on a Unix socket (exec echoes, files live in memory). After
//! every step the invariants below hold.
//!
//! Invariants, checked once the daemon has settled after each step:
//! 1. Every run is in exactly one phase: listed once, `running` or `failed`
//!    (nothing is left `creating` when no create is in flight).
//! 2. The runs the API lists, the records in the store and the sandboxes
//!    the lane holds are the same set, and equal the model's live runs
//!    (capacity is the registry's size, so it equals the live runs too).
//! 3. A deleted (or expired) run never answers again: get, exec, renew and
//!    lease say `run_not_found`, after restarts too, and no late write
//!    brings its record back.
//! 4. A run whose sandbox died is booted again on its disk (its files
//!    kept), up to three times in one daemon's life; after that it is
//!    `failed`, answers exec with `run_failed`, and keeps its slot until it
//!    is woken, deleted or expires.
//! 7. A hibernated run is listed as such, holds no sandbox but its disk
//!    and no capacity slot; the next call (or a wake) boots it again with
//!    its files, unless capacity is full, when it stays hibernated.
//! 5. A create beyond `max_runs` is refused and changes nothing.
//! 6. A leased run refuses writes without the lease; what was written is
//!    read back.
//!
//! This is the state machine's unit test, not proof that runs work: the
//! real runtime, agent and kernel are exercised by crates/e2e.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use proptest::prelude::*;
use runbox_agent_proto::pb;
use runbox_agent_proto::pb::agent_server::{Agent, AgentServer};
use runbox_core::images::ImageStore;
use runbox_core::lane::{
    AgentEndpoint, Capabilities, ExitWatch, Lane, LaneError, Sandbox, SandboxSpec, Support,
};
use runbox_core::runs::{ExecEvent, Scope};
use runbox_core::store::Store;
use runbox_core::{Config, CoreError, Manager, RunService};
use runbox_types::{CreateRunRequest, ErrorCode, ExecRequest, LeaseRequest, RunStatus};
use tokio::sync::watch;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status, Streaming};
use ulid::Ulid;

const MAX_RUNS: usize = 3;

// ---------------------------------------------------------------------------
// The stand-in agent: Hello, an echoing exec, in-memory files.

/// A fake sandbox's disk: its files, which outlive its agent.
type Disk = Arc<Mutex<HashMap<String, Vec<u8>>>>;

#[derive(Clone, Default)]
struct FakeAgent {
    files: Disk,
    /// A suspended sandbox: its agent cannot answer, as a frozen one
    /// cannot, so any call the core makes before resuming it fails.
    frozen: Arc<std::sync::atomic::AtomicBool>,
}

impl FakeAgent {
    fn awake(&self) -> Result<(), Status> {
        if self.frozen.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(Status::unavailable("the fake sandbox is frozen"));
        }
        Ok(())
    }
}

type OutStream<T> = std::pin::Pin<Box<dyn futures::Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl Agent for FakeAgent {
    async fn hello(
        &self,
        _: Request<pb::HelloRequest>,
    ) -> Result<Response<pb::HelloReply>, Status> {
        self.awake()?;
        Ok(Response::new(pb::HelloReply {
            version: "fake".into(),
            protocol: runbox_agent_proto::PROTOCOL,
        }))
    }

    type ExecStream = OutStream<pb::ExecOutput>;

    async fn exec(
        &self,
        request: Request<Streaming<pb::ExecInput>>,
    ) -> Result<Response<Self::ExecStream>, Status> {
        self.awake()?;
        let mut input = request.into_inner();
        let Some(pb::ExecInput {
            kind: Some(pb::exec_input::Kind::Start(start)),
        }) = input.message().await?
        else {
            return Err(Status::invalid_argument("first message must be start"));
        };
        let mut line = start.argv[1..].join(" ").into_bytes();
        line.push(b'\n');
        let out = |kind| Ok(pb::ExecOutput { kind: Some(kind) });
        let events = vec![
            out(pb::exec_output::Kind::Started(pb::ExecStarted { pid: 7 })),
            out(pb::exec_output::Kind::Stdout(line)),
            out(pb::exec_output::Kind::Exit(pb::ExecExit {
                exit_code: 0,
                signal: 0,
                timed_out: false,
            })),
        ];
        Ok(Response::new(Box::pin(futures::stream::iter(events))))
    }

    async fn write_file(
        &self,
        request: Request<Streaming<pb::WriteFileChunk>>,
    ) -> Result<Response<pb::WriteFileReply>, Status> {
        self.awake()?;
        use pb::write_file_chunk::Kind;
        let mut input = request.into_inner();
        let (mut path, mut data) = (None, Vec::new());
        while let Some(chunk) = input.message().await? {
            match chunk.kind {
                Some(Kind::Header(h)) => path = Some(h.path),
                Some(Kind::Data(d)) => data.extend_from_slice(&d),
                Some(Kind::Commit(_)) => {
                    let path = path.ok_or_else(|| Status::invalid_argument("no header"))?;
                    let n = data.len() as u64;
                    self.files.lock().unwrap().insert(path, data);
                    return Ok(Response::new(pb::WriteFileReply { bytes_written: n }));
                }
                None => {}
            }
        }
        Err(Status::aborted("no commit"))
    }

    // The model drives exec and files only; the fs operations are not part
    // of the lifecycle under test.
    async fn stat(&self, _: Request<pb::StatRequest>) -> Result<Response<pb::FileInfo>, Status> {
        Err(Status::unimplemented("not modelled"))
    }

    async fn list_dir(
        &self,
        _: Request<pb::ListDirRequest>,
    ) -> Result<Response<pb::ListDirReply>, Status> {
        Err(Status::unimplemented("not modelled"))
    }

    async fn make_dir(
        &self,
        _: Request<pb::MakeDirRequest>,
    ) -> Result<Response<pb::FileInfo>, Status> {
        Err(Status::unimplemented("not modelled"))
    }

    async fn r#move(&self, _: Request<pb::MoveRequest>) -> Result<Response<pb::FileInfo>, Status> {
        Err(Status::unimplemented("not modelled"))
    }

    async fn remove(
        &self,
        _: Request<pb::RemoveRequest>,
    ) -> Result<Response<pb::RemoveReply>, Status> {
        Err(Status::unimplemented("not modelled"))
    }

    async fn unpack(
        &self,
        _: Request<Streaming<pb::UnpackChunk>>,
    ) -> Result<Response<pb::UnpackReply>, Status> {
        Err(Status::unimplemented("not modelled"))
    }

    type AttachStream = OutStream<pb::ExecOutput>;

    async fn attach(
        &self,
        _: Request<tonic::Streaming<pb::ExecInput>>,
    ) -> Result<Response<Self::AttachStream>, Status> {
        Err(Status::unimplemented("not modelled"))
    }

    async fn list_processes(
        &self,
        _: Request<pb::ListProcessesRequest>,
    ) -> Result<Response<pb::ListProcessesReply>, Status> {
        Err(Status::unimplemented("not modelled"))
    }

    async fn signal_process(
        &self,
        _: Request<pb::SignalProcessRequest>,
    ) -> Result<Response<pb::ProcessInfo>, Status> {
        Err(Status::unimplemented("not modelled"))
    }

    async fn send_input(
        &self,
        _: Request<pb::SendInputRequest>,
    ) -> Result<Response<pb::ProcessInfo>, Status> {
        Err(Status::unimplemented("not modelled"))
    }

    async fn wait_process(
        &self,
        _: Request<pb::WaitProcessRequest>,
    ) -> Result<Response<pb::ProcessInfo>, Status> {
        Err(Status::unimplemented("not modelled"))
    }

    type WatchStream = OutStream<pb::WatchEvent>;

    async fn watch(
        &self,
        _: Request<pb::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        Err(Status::unimplemented("not modelled"))
    }

    type ReadFileStream = OutStream<pb::ReadFileChunk>;

    async fn read_file(
        &self,
        request: Request<pb::ReadFileRequest>,
    ) -> Result<Response<Self::ReadFileStream>, Status> {
        self.awake()?;
        use pb::read_file_chunk::Kind;
        let path = request.into_inner().path;
        let data = self
            .files
            .lock()
            .unwrap()
            .get(&path)
            .cloned()
            .ok_or_else(|| Status::not_found(format!("{path}: no such file")))?;
        let chunks = vec![
            Ok(pb::ReadFileChunk {
                kind: Some(Kind::Header(pb::ReadFileHeader {
                    size: data.len() as u64,
                    mode: 0o644,
                })),
            }),
            Ok(pb::ReadFileChunk {
                kind: Some(Kind::Data(data)),
            }),
        ];
        Ok(Response::new(Box::pin(futures::stream::iter(chunks))))
    }
}

// ---------------------------------------------------------------------------
// The stand-in lane. Its sandboxes run on the "kernel" runtime, which
// outlives daemon restarts, as real runs outlive the daemon.

struct FakeSandbox {
    server: tokio::task::JoinHandle<()>,
    died: watch::Sender<Option<String>>,
    frozen: Arc<std::sync::atomic::AtomicBool>,
}

struct FakeLane(Arc<FakeKernel>);

/// The fake sandboxes, shared by the lane and every handle.
struct FakeKernel {
    kernel: tokio::runtime::Handle,
    dir: PathBuf,
    sandboxes: Mutex<HashMap<Ulid, FakeSandbox>>,
    /// Every run's disk, from its create until it is destroyed.
    disks: Mutex<HashMap<Ulid, Disk>>,
    capabilities: Capabilities,
}

/// A handle on one fake sandbox, by id.
struct FakeHandle {
    kernel: Arc<FakeKernel>,
    id: Ulid,
}

impl FakeHandle {
    fn set_frozen(&self, frozen: bool) -> Result<(), LaneError> {
        let sandboxes = self.kernel.sandboxes.lock().unwrap();
        let sandbox = sandboxes
            .get(&self.id)
            .ok_or_else(|| LaneError::Failed(format!("no sandbox {}", self.id)))?;
        sandbox
            .frozen
            .store(frozen, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }
}

impl FakeLane {
    fn new(kernel: tokio::runtime::Handle, dir: PathBuf) -> FakeLane {
        let mut capabilities = Capabilities::none("the fake lane cannot");
        capabilities.disk_limit = Support::Yes;
        capabilities.exit_watch = Support::Yes;
        capabilities.suspend = Support::Yes;
        capabilities.hibernate = Support::Yes;
        FakeLane(Arc::new(FakeKernel {
            kernel,
            dir,
            sandboxes: Mutex::new(HashMap::new()),
            disks: Mutex::new(HashMap::new()),
            capabilities,
        }))
    }

    /// Runs holding anything (a disk at least).
    fn live(&self) -> BTreeSet<Ulid> {
        self.0.disks.lock().unwrap().keys().copied().collect()
    }

    /// Runs with a sandbox up.
    fn booted(&self) -> BTreeSet<Ulid> {
        self.0.sandboxes.lock().unwrap().keys().copied().collect()
    }

    /// The sandbox's init dies on its own.
    fn kill(&self, id: Ulid) {
        if let Some(sandbox) = self.0.sandboxes.lock().unwrap().get(&id) {
            sandbox.server.abort();
            let _ = sandbox.died.send(Some("the fake init was killed".into()));
        }
    }

    fn handle(&self, id: Ulid) -> Arc<FakeHandle> {
        Arc::new(FakeHandle {
            kernel: self.0.clone(),
            id,
        })
    }
}

impl FakeKernel {
    fn remove(&self, id: Ulid) {
        self.stop(id);
        self.disks.lock().unwrap().remove(&id);
    }

    /// Everything but the disk.
    fn stop(&self, id: Ulid) {
        if let Some(sandbox) = self.sandboxes.lock().unwrap().remove(&id) {
            sandbox.server.abort();
        }
        let _ = std::fs::remove_file(self.dir.join(format!("{id}.sock")));
    }

    /// Starts a sandbox whose agent serves `disk`.
    fn start(&self, id: Ulid, disk: Disk) -> Result<(), LaneError> {
        let socket = self.dir.join(format!("{id}.sock"));
        let listener = std::os::unix::net::UnixListener::bind(&socket)
            .map_err(LaneError::io("binding the fake agent socket"))?;
        listener
            .set_nonblocking(true)
            .map_err(LaneError::io("nonblocking"))?;
        let frozen = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let agent = FakeAgent {
            frozen: frozen.clone(),
            files: disk,
        };
        let server = self.kernel.spawn(async move {
            let listener = tokio::net::UnixListener::from_std(listener).expect("listener");
            let _ = tonic::transport::Server::builder()
                .add_service(AgentServer::new(agent))
                .serve_with_incoming(UnixListenerStream::new(listener))
                .await;
        });
        let (died, _) = watch::channel(None);
        self.sandboxes.lock().unwrap().insert(
            id,
            FakeSandbox {
                server,
                died,
                frozen,
            },
        );
        Ok(())
    }
}

#[async_trait]
impl Lane for FakeLane {
    fn name(&self) -> String {
        "fake".into()
    }

    fn capabilities(&self) -> &Capabilities {
        &self.0.capabilities
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<Arc<dyn Sandbox>, LaneError> {
        let disk = Disk::default();
        self.0.disks.lock().unwrap().insert(spec.id, disk.clone());
        self.0.start(spec.id, disk)?;
        Ok(self.handle(spec.id))
    }

    async fn boot(&self, spec: &SandboxSpec) -> Result<Arc<dyn Sandbox>, LaneError> {
        self.0.stop(spec.id);
        let disk = self.0.disks.lock().unwrap().get(&spec.id).cloned();
        let disk = disk.ok_or_else(|| LaneError::Failed(format!("no disk {}", spec.id)))?;
        self.0.start(spec.id, disk)?;
        Ok(self.handle(spec.id))
    }

    fn sandbox(&self, id: Ulid) -> Arc<dyn Sandbox> {
        self.handle(id)
    }

    async fn adopt(
        &self,
        id: Ulid,
        _suspended: bool,
    ) -> Result<Option<Arc<dyn Sandbox>>, LaneError> {
        let alive = self
            .0
            .sandboxes
            .lock()
            .unwrap()
            .get(&id)
            .is_some_and(|s| s.died.borrow().is_none());
        Ok(alive.then(|| self.sandbox(id)))
    }

    async fn sweep(&self, keep: &HashSet<Ulid>) -> Result<Vec<Ulid>, LaneError> {
        let doomed: Vec<Ulid> = self
            .live()
            .into_iter()
            .filter(|id| !keep.contains(id))
            .collect();
        for id in &doomed {
            self.0.remove(*id);
        }
        Ok(doomed)
    }
}

#[async_trait]
impl Sandbox for FakeHandle {
    fn id(&self) -> Ulid {
        self.id
    }

    fn runtime(&self) -> String {
        "fake".into()
    }

    fn agent(&self) -> AgentEndpoint {
        AgentEndpoint::Unix(self.kernel.dir.join(format!("{}.sock", self.id)))
    }

    async fn destroy(&self) -> Result<(), LaneError> {
        self.kernel.remove(self.id);
        Ok(())
    }

    async fn suspend(&self) -> Result<(), LaneError> {
        self.set_frozen(true)
    }

    async fn hibernate(&self) -> Result<(), LaneError> {
        self.kernel.stop(self.id);
        Ok(())
    }

    async fn resume(&self) -> Result<(), LaneError> {
        self.set_frozen(false)
    }

    async fn watch_exit(&self) -> Result<ExitWatch, LaneError> {
        let id = self.id;
        let mut rx = match self.kernel.sandboxes.lock().unwrap().get(&id) {
            Some(sandbox) => sandbox.died.subscribe(),
            None => return Err(LaneError::Failed(format!("no sandbox {id}"))),
        };
        Ok(Box::pin(async move {
            match rx.wait_for(|reason| reason.is_some()).await {
                Ok(reason) => reason.clone().unwrap_or_default(),
                // Destroyed: its init is gone with it.
                Err(_) => "destroyed".to_owned(),
            }
        }))
    }
}

// ---------------------------------------------------------------------------
// One daemon lifetime: its own runtime, dropped whole on "restart" like a
// process that is killed.

struct Daemon {
    rt: tokio::runtime::Runtime,
    manager: Option<Arc<Manager>>,
}

struct World {
    /// Where the sandboxes' agents run; kept for the world's lifetime.
    _kernel: tokio::runtime::Runtime,
    lane: Arc<FakeLane>,
    dir: tempfile::TempDir,
    daemon: Option<Daemon>,
    /// Daemon lifetimes so far; each opens its own copy of the database.
    lifetimes: usize,
}

impl World {
    fn new() -> World {
        let dir = tempfile::tempdir().unwrap();
        let kernel = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let sockets = dir.path().join("sockets");
        std::fs::create_dir(&sockets).unwrap();
        let lane = Arc::new(FakeLane::new(kernel.handle().clone(), sockets));
        let mut world = World {
            _kernel: kernel,
            lane,
            dir,
            daemon: None,
            lifetimes: 0,
        };
        world.start();
        let manager = world.manager();
        world.block_on(async move {
            let tar = busybox_like_tar();
            manager
                .import_image(
                    "base".into(),
                    futures::stream::iter([Ok(bytes::Bytes::from(tar))]).boxed(),
                )
                .await
                .expect("importing the image");
        });
        world
    }

    fn start(&mut self) {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let mut config = Config::new("node");
        config.max_runs = MAX_RUNS;
        let state = self.dir.path().to_owned();
        // A killed daemon's store file is what the next one opens. The dead
        // one's database handle cannot be closed from here (redb holds the
        // file lock until every handle is dropped), so each lifetime opens a
        // copy of the file as the previous one left it on disk: exactly what
        // a restarted process would find, commits not yet made durable lost.
        let db = state.join(format!("runbox-{}.db", self.lifetimes));
        if self.lifetimes > 0 {
            let previous = state.join(format!("runbox-{}.db", self.lifetimes - 1));
            std::fs::copy(previous, &db).unwrap();
        }
        self.lifetimes += 1;
        let lane: Arc<dyn Lane> = self.lane.clone();
        let manager = rt.block_on(async move {
            let store = Store::open(&db).unwrap();
            let images = ImageStore::open(state.join("images"), 1 << 30).unwrap();
            Manager::start(
                config,
                lane,
                store,
                images,
                std::sync::Arc::new(runbox_core::tenants::FileTenants::in_memory()),
                std::sync::Arc::new(runbox_core::accounting::NoUsage),
            )
            .await
            .unwrap()
        });
        self.daemon = Some(Daemon {
            rt,
            manager: Some(manager),
        });
    }

    /// Kills the daemon (every task of its runtime dropped) and starts a
    /// new one on the same state; the sandboxes live on.
    fn restart(&mut self) {
        if let Some(mut daemon) = self.daemon.take() {
            drop(daemon.manager.take());
            daemon.rt.shutdown_timeout(Duration::from_secs(5));
        }
        self.start();
    }

    fn manager(&self) -> Arc<Manager> {
        self.daemon.as_ref().unwrap().manager.clone().unwrap()
    }

    fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        self.daemon.as_ref().unwrap().rt.block_on(f)
    }

    /// The ids the API lists.
    fn listed(&self) -> BTreeSet<Ulid> {
        self.manager().list().iter().map(|r| r.id).collect()
    }
}

impl Drop for World {
    fn drop(&mut self) {
        if let Some(mut daemon) = self.daemon.take() {
            drop(daemon.manager.take());
            daemon.rt.shutdown_timeout(Duration::from_secs(5));
        }
    }
}

/// A one-file root filesystem archive.
fn busybox_like_tar() -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    let header = |kind, size, mode| {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_size(size);
        h.set_mode(mode);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(0);
        h
    };
    let mut dir = header(tar::EntryType::Directory, 0, 0o755);
    builder.append_data(&mut dir, "bin", &b""[..]).unwrap();
    let data = b"#!/bin/true\n";
    let mut file = header(tar::EntryType::Regular, data.len() as u64, 0o755);
    builder
        .append_data(&mut file, "bin/true", &data[..])
        .unwrap();
    builder.into_inner().unwrap()
}

// ---------------------------------------------------------------------------
// The operations and the model.

#[derive(Clone, Debug)]
enum Op {
    Create { short_ttl: bool },
    CreateHangUp { after_ms: u64 },
    Exec { run: usize },
    WriteRead { run: usize },
    Lease { run: usize },
    Renew { run: usize },
    Delete { run: usize },
    DeleteHangUp { run: usize, after_ms: u64 },
    Kill { run: usize },
    Pause { run: usize },
    Resume { run: usize },
    Hibernate { run: usize },
    Wake { run: usize },
    Wait { ms: u64 },
    Restart,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => any::<bool>().prop_map(|short_ttl| Op::Create { short_ttl }),
        2 => (0u64..20).prop_map(|after_ms| Op::CreateHangUp { after_ms }),
        3 => (0usize..8).prop_map(|run| Op::Exec { run }),
        2 => (0usize..8).prop_map(|run| Op::WriteRead { run }),
        2 => (0usize..8).prop_map(|run| Op::Lease { run }),
        2 => (0usize..8).prop_map(|run| Op::Renew { run }),
        3 => (0usize..8).prop_map(|run| Op::Delete { run }),
        1 => ((0usize..8), (0u64..5)).prop_map(|(run, after_ms)| Op::DeleteHangUp { run, after_ms }),
        2 => (0usize..8).prop_map(|run| Op::Kill { run }),
        2 => (0usize..8).prop_map(|run| Op::Pause { run }),
        1 => (0usize..8).prop_map(|run| Op::Resume { run }),
        2 => (0usize..8).prop_map(|run| Op::Hibernate { run }),
        1 => (0usize..8).prop_map(|run| Op::Wake { run }),
        1 => (100u64..1300).prop_map(|ms| Op::Wait { ms }),
        2 => Just(Op::Restart),
    ]
}

#[derive(Default, Debug)]
struct Model {
    /// Every id the API ever handed out, in order.
    known: Vec<Ulid>,
    /// Runs that exist, with when they expire.
    live: HashMap<Ulid, Instant>,
    /// Runs whose sandbox died.
    failed: HashSet<Ulid>,
    /// Runs that were deleted or expired.
    gone: HashSet<Ulid>,
    /// Leases held: owner and generation.
    leases: HashMap<Ulid, (String, u64)>,
    /// Runs paused (and not resumed by a call since).
    paused: HashSet<Ulid>,
    /// Runs hibernated (and not woken by a call since).
    hibernated: HashSet<Ulid>,
    /// How often each run died in this daemon's life (its restart budget).
    deaths: HashMap<Ulid, usize>,
    /// How often each run was restarted, as its record counts.
    restarts: HashMap<Ulid, u32>,
}

impl Model {
    fn pick(&self, i: usize) -> Option<Ulid> {
        (!self.known.is_empty()).then(|| self.known[i % self.known.len()])
    }

    fn forget(&mut self, id: Ulid) {
        self.live.remove(&id);
        self.paused.remove(&id);
        self.hibernated.remove(&id);
        self.failed.remove(&id);
        self.leases.remove(&id);
        self.gone.insert(id);
    }

    /// A call reached run `id` and was answered: it runs now.
    fn reached(&mut self, id: Ulid) {
        self.paused.remove(&id);
        self.hibernated.remove(&id);
    }

    /// Whether refusal `err` of a call to run `id` is a wake that found no
    /// capacity slot (the run stays hibernated).
    fn no_room_to_wake(&self, id: Ulid, err: &CoreError) -> bool {
        self.hibernated.contains(&id) && code(err) == ErrorCode::Capacity
    }
}

/// TTL of a short-lived run; the reaper must have removed it well after.
const SHORT_TTL: u64 = 1;
/// How far expiry may lag or lead the model's clock.
const SLACK: Duration = Duration::from_millis(700);

fn code(e: &CoreError) -> ErrorCode {
    e.code()
}

fn request(short_ttl: bool) -> CreateRunRequest {
    CreateRunRequest {
        image: "base".into(),
        ttl_sec: Some(if short_ttl { SHORT_TTL } else { 3600 }),
        ..Default::default()
    }
}

fn apply(world: &mut World, model: &mut Model, op: &Op) -> Result<(), TestCaseError> {
    let m = world.manager();
    match op.clone() {
        Op::Create { short_ttl } => {
            // Capacity only goes down while this create runs (a run of ours
            // may finish expiring), so: room before means success; full
            // with nothing stopping means a refusal; full while a run is
            // being torn down may go either way.
            let used = m.capacity_used();
            let runs = m.list();
            let asleep = runs
                .iter()
                .filter(|r| r.status == RunStatus::Hibernated)
                .count();
            // Counted but not listed: being torn down.
            let stopping = (used + asleep).saturating_sub(runs.len());
            // The server's clock starts during the create: the model's
            // starts before it, never later (a slow create under load must
            // not make the model expect a run the server expired).
            let started = Instant::now();
            let result = world.block_on(m.create(request(short_ttl), None, Default::default()));
            match result {
                Ok(run) => {
                    prop_assert!(
                        used < MAX_RUNS || stopping > 0,
                        "a create beyond max_runs was accepted"
                    );
                    prop_assert_eq!(run.status, RunStatus::Running);
                    let ttl = Duration::from_secs(if short_ttl { SHORT_TTL } else { 3600 });
                    model.known.push(run.id);
                    model.live.insert(run.id, started + ttl);
                }
                Err(err) => {
                    prop_assert!(used >= MAX_RUNS, "create refused with room left: {err}");
                    prop_assert_eq!(code(&err), ErrorCode::Capacity);
                }
            }
        }
        Op::CreateHangUp { after_ms } => {
            let full = m.capacity_used() >= MAX_RUNS;
            let outcome = world.block_on(async {
                tokio::time::timeout(
                    Duration::from_millis(after_ms),
                    m.create(request(false), None, Default::default()),
                )
                .await
            });
            match outcome {
                Ok(Ok(run)) => {
                    model.known.push(run.id);
                    model
                        .live
                        .insert(run.id, Instant::now() + Duration::from_secs(3600));
                }
                Ok(Err(e)) => prop_assert!(full, "create failed with room left: {e}"),
                // Hung up: whatever was begun must be undone (invariant 2).
                Err(_) => {}
            }
        }
        Op::Exec { run } => {
            let Some(id) = model.pick(run) else {
                return Ok(());
            };
            let req = ExecRequest {
                cmd: vec!["echo".into(), "hi".into()],
                owner: model.leases.get(&id).map(|l| l.0.clone()),
                generation: model.leases.get(&id).map(|l| l.1),
                ..Default::default()
            };
            let result = world.block_on(async {
                let stream = m.exec(id, req).await?;
                Ok::<_, CoreError>(stream.collect::<Vec<_>>().await)
            });
            if model.gone.contains(&id) {
                prop_assert_eq!(
                    code(&result.expect_err("gone run answered")),
                    ErrorCode::RunNotFound
                );
            } else if model.failed.contains(&id) {
                prop_assert_eq!(
                    code(&result.expect_err("failed run ran")),
                    ErrorCode::RunFailed
                );
            } else if let Ok(events) = result {
                let stdout: Vec<u8> = events
                    .iter()
                    .filter_map(|e| match e {
                        ExecEvent::Stdout(b) => Some(b.to_vec()),
                        _ => None,
                    })
                    .flatten()
                    .collect();
                prop_assert_eq!(stdout, b"hi\n".to_vec());
                // It reached the run: a sleeping one was woken first.
                model.reached(id);
            } else {
                let err = result.err().unwrap();
                if model.no_room_to_wake(id, &err) {
                    return Ok(());
                }
                // A short run may just have expired.
                prop_assert!(
                    code(&err) == ErrorCode::RunNotFound && expired(model, id),
                    "exec on a live run: {err}"
                );
                model.forget(id);
            }
        }
        Op::WriteRead { run } => {
            let Some(id) = model.pick(run) else {
                return Ok(());
            };
            if !model.live.contains_key(&id) || model.failed.contains(&id) {
                return Ok(());
            }
            let content = format!("from {id}");
            let body = futures::stream::iter([Ok(Bytes::from(content.clone()))]).boxed();
            // Without the lease, a leased run refuses the write.
            if model.leases.contains_key(&id) {
                let err = world
                    .block_on(m.put_file(id, Scope::Work, "f.txt".into(), Default::default(), body))
                    .expect_err("a write without the lease");
                if code(&err) == ErrorCode::RunNotFound && expired(model, id) {
                    model.forget(id);
                    return Ok(());
                }
                if model.no_room_to_wake(id, &err) {
                    return Ok(());
                }
                prop_assert_eq!(code(&err), ErrorCode::Leased);
                return Ok(());
            }
            let written = world.block_on(m.put_file(
                id,
                Scope::Work,
                "f.txt".into(),
                Default::default(),
                body,
            ));
            match written {
                Ok(n) => {
                    prop_assert_eq!(n, content.len() as u64);
                    // It reached the run: a sleeping one was woken first.
                    model.reached(id);
                }
                Err(e) if code(&e) == ErrorCode::RunNotFound && expired(model, id) => {
                    model.forget(id);
                    return Ok(());
                }
                Err(e) if model.no_room_to_wake(id, &e) => return Ok(()),
                Err(e) => return Err(TestCaseError::fail(format!("write: {e}"))),
            }
            let read = world.block_on(async {
                let file = m.get_file(id, Scope::Work, "f.txt".into()).await?;
                let parts: Vec<_> = file.body.collect().await;
                let mut data = Vec::new();
                for part in parts {
                    data.extend_from_slice(&part?);
                }
                Ok::<_, CoreError>(data)
            });
            match read {
                Ok(data) => prop_assert_eq!(data, content.into_bytes()),
                Err(e) if code(&e) == ErrorCode::RunNotFound && expired(model, id) => {
                    model.forget(id)
                }
                Err(e) => return Err(TestCaseError::fail(format!("read: {e}"))),
            }
        }
        Op::Lease { run } => {
            let Some(id) = model.pick(run) else {
                return Ok(());
            };
            let result = world.block_on(m.acquire_lease(
                id,
                LeaseRequest {
                    owner: "model".into(),
                    ttl_sec: Some(3600),
                },
            ));
            match result {
                Ok(lease) => {
                    prop_assert!(model.live.contains_key(&id) && !model.failed.contains(&id));
                    model.leases.insert(id, (lease.holder, lease.generation));
                }
                Err(e) if model.gone.contains(&id) => {
                    prop_assert_eq!(code(&e), ErrorCode::RunNotFound)
                }
                Err(e) if model.failed.contains(&id) => {
                    prop_assert_eq!(code(&e), ErrorCode::RunFailed)
                }
                Err(e) if model.leases.contains_key(&id) => {
                    // Held already (by this same owner the grant is refused
                    // as busy, never silently re-issued).
                    prop_assert!(
                        matches!(code(&e), ErrorCode::Leased | ErrorCode::Busy),
                        "{e}"
                    )
                }
                Err(e) if code(&e) == ErrorCode::RunNotFound && expired(model, id) => {
                    model.forget(id)
                }
                Err(e) => return Err(TestCaseError::fail(format!("lease: {e}"))),
            }
        }
        Op::Renew { run } => {
            let Some(id) = model.pick(run) else {
                return Ok(());
            };
            let result = world.block_on(m.renew(id, 3600));
            match result {
                Ok(renewed) => {
                    prop_assert!(!model.gone.contains(&id), "a gone run was renewed");
                    prop_assert_eq!(renewed.id, id);
                    model
                        .live
                        .insert(id, Instant::now() + Duration::from_secs(3600));
                }
                Err(e) if model.gone.contains(&id) => {
                    prop_assert_eq!(code(&e), ErrorCode::RunNotFound)
                }
                Err(e) if code(&e) == ErrorCode::RunNotFound && expired(model, id) => {
                    model.forget(id)
                }
                // Failed runs may be refused a renew; they still expire.
                Err(e) if model.failed.contains(&id) => {
                    prop_assert_eq!(code(&e), ErrorCode::RunFailed)
                }
                Err(e) => return Err(TestCaseError::fail(format!("renew: {e}"))),
            }
        }
        Op::Delete { run } => {
            let Some(id) = model.pick(run) else {
                return Ok(());
            };
            let result = world.block_on(m.delete(id));
            match result {
                Ok(()) => prop_assert!(!model.gone.contains(&id), "deleted twice"),
                Err(e) => {
                    prop_assert_eq!(code(&e), ErrorCode::RunNotFound);
                    prop_assert!(model.gone.contains(&id) || expired(model, id), "{e}");
                }
            }
            model.forget(id);
        }
        Op::DeleteHangUp { run, after_ms } => {
            let Some(id) = model.pick(run) else {
                return Ok(());
            };
            let _ = world.block_on(async {
                tokio::time::timeout(Duration::from_millis(after_ms), m.delete(id)).await
            });
            // A delete that was started completes without its caller; one
            // that never reached the owner leaves the run. Settle decides.
            world.block_on(settle(world));
            if !world.listed().contains(&id) {
                model.forget(id);
            }
        }
        Op::Kill { run } => {
            let Some(id) = model.pick(run) else {
                return Ok(());
            };
            // Only a sandbox that is up can die.
            if !model.live.contains_key(&id)
                || model.failed.contains(&id)
                || model.hibernated.contains(&id)
            {
                return Ok(());
            }
            // Within its budget it is booted again; past it, failed.
            let deaths = model.deaths.get(&id).copied().unwrap_or(0);
            let restarts = model.restarts.get(&id).copied().unwrap_or(0);
            let restart = deaths < 3;
            world.lane.kill(id);
            let settled = world.block_on(async {
                let deadline = Instant::now() + Duration::from_secs(5);
                while Instant::now() < deadline {
                    match m.get(id) {
                        Ok(run) if !restart && run.status == RunStatus::Failed => {
                            return Some(true)
                        }
                        Ok(run)
                            if restart
                                && run.status == RunStatus::Running
                                && run.restarts == restarts + 1 =>
                        {
                            return Some(true)
                        }
                        Ok(_) => {}
                        Err(_) => return Some(false),
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                None
            });
            match settled {
                Some(true) => {
                    let run = m.get(id).unwrap();
                    model.paused.remove(&id);
                    *model.deaths.entry(id).or_default() += 1;
                    if restart {
                        prop_assert!(run.restarted_at.is_some());
                        model.restarts.insert(id, restarts + 1);
                    } else {
                        prop_assert!(run.failure.is_some());
                        model.failed.insert(id);
                    }
                }
                Some(false) if expired(model, id) => model.forget(id),
                other => {
                    return Err(TestCaseError::fail(format!(
                        "a killed run was not {}: {other:?}",
                        if restart { "restarted" } else { "failed" }
                    )))
                }
            }
        }
        Op::Pause { run } | Op::Resume { run } => {
            let Some(id) = model.pick(run) else {
                return Ok(());
            };
            let pause = matches!(op, Op::Pause { .. });
            let result = world.block_on(async {
                if pause {
                    m.pause(id).await
                } else {
                    m.resume(id).await
                }
            });
            if model.gone.contains(&id) {
                prop_assert_eq!(
                    code(&result.expect_err("gone run answered")),
                    ErrorCode::RunNotFound
                );
            } else if model.failed.contains(&id) {
                prop_assert_eq!(
                    code(&result.expect_err("failed run paused")),
                    ErrorCode::RunFailed
                );
            } else {
                match result {
                    // Pausing a hibernated run leaves it hibernated.
                    Ok(run) if pause && model.hibernated.contains(&id) => {
                        prop_assert_eq!(run.status, RunStatus::Hibernated);
                    }
                    Ok(run) => {
                        let want = if pause {
                            RunStatus::Paused
                        } else {
                            RunStatus::Running
                        };
                        prop_assert_eq!(run.status, want);
                        if pause {
                            model.paused.insert(id);
                        } else {
                            model.reached(id);
                        }
                    }
                    Err(err) if model.no_room_to_wake(id, &err) => {}
                    Err(err) => {
                        prop_assert!(
                            code(&err) == ErrorCode::RunNotFound && expired(model, id),
                            "pause or resume of a live run: {err}"
                        );
                        model.forget(id);
                    }
                }
            }
        }
        Op::Hibernate { run } => {
            let Some(id) = model.pick(run) else {
                return Ok(());
            };
            let result = world.block_on(m.hibernate(id));
            if model.gone.contains(&id) {
                prop_assert_eq!(
                    code(&result.expect_err("gone run answered")),
                    ErrorCode::RunNotFound
                );
            } else if model.failed.contains(&id) {
                prop_assert_eq!(
                    code(&result.expect_err("failed run hibernated")),
                    ErrorCode::RunFailed
                );
            } else {
                match result {
                    Ok(run) => {
                        prop_assert_eq!(run.status, RunStatus::Hibernated);
                        prop_assert!(!world.lane.booted().contains(&id));
                        model.paused.remove(&id);
                        model.hibernated.insert(id);
                    }
                    Err(err) => {
                        prop_assert!(
                            code(&err) == ErrorCode::RunNotFound && expired(model, id),
                            "hibernate of a live run: {err}"
                        );
                        model.forget(id);
                    }
                }
            }
        }
        Op::Wake { run } => {
            let Some(id) = model.pick(run) else {
                return Ok(());
            };
            let result = world.block_on(m.wake(id));
            if model.gone.contains(&id) {
                prop_assert_eq!(
                    code(&result.expect_err("gone run answered")),
                    ErrorCode::RunNotFound
                );
                return Ok(());
            }
            match result {
                Ok(run) => {
                    prop_assert_eq!(run.status, RunStatus::Running);
                    prop_assert!(world.lane.booted().contains(&id));
                    model.reached(id);
                    // A failed run woken gets a new budget.
                    if model.failed.remove(&id) {
                        model.deaths.remove(&id);
                    }
                }
                Err(err) if model.no_room_to_wake(id, &err) => {}
                Err(err) => {
                    prop_assert!(
                        code(&err) == ErrorCode::RunNotFound && expired(model, id),
                        "wake of a live run: {err}"
                    );
                    model.forget(id);
                }
            }
        }
        Op::Wait { ms } => {
            std::thread::sleep(Duration::from_millis(ms));
        }
        Op::Restart => {
            world.restart();
            // Restart budgets live in the daemon's memory.
            model.deaths.clear();
        }
    }
    Ok(())
}

/// Whether the model's clock says run `id` may have expired.
fn expired(model: &Model, id: Ulid) -> bool {
    model
        .live
        .get(&id)
        .is_some_and(|at| Instant::now() + SLACK >= *at)
}

/// Waits until no run is being created or destroyed: the listing, the
/// capacity in use and the lane's sandboxes agree. Returns whether they
/// came to agree.
async fn settle(world: &World) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let m = world.manager();
        let runs = m.list();
        let listed: BTreeSet<Ulid> = runs.iter().map(|r| r.id).collect();
        let creating = runs.iter().any(|r| r.status == RunStatus::Creating);
        let asleep = runs
            .iter()
            .filter(|r| r.status == RunStatus::Hibernated)
            .count();
        if !creating && listed == world.lane.live() && m.capacity_used() + asleep == listed.len() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn check_invariants(world: &mut World, model: &mut Model) -> Result<(), TestCaseError> {
    let settled = world.block_on(settle(world));
    let m = world.manager();
    let runs = m.list();
    let listed: BTreeSet<Ulid> = runs.iter().map(|r| r.id).collect();
    // 1. Listed once each, in one phase, none half-made.
    prop_assert_eq!(listed.len(), runs.len());
    for run in &runs {
        prop_assert!(
            matches!(
                run.status,
                RunStatus::Running | RunStatus::Paused | RunStatus::Hibernated | RunStatus::Failed
            ),
            "{:?} is {:?}",
            run.id,
            run.status
        );
        // Paused and hibernated exactly when the model says (a restart
        // keeps them so); a hibernated run holds no sandbox.
        if !model.failed.contains(&run.id) {
            prop_assert_eq!(
                run.status == RunStatus::Paused,
                model.paused.contains(&run.id),
                "{:?} is {:?}",
                run.id,
                run.status
            );
            prop_assert_eq!(
                run.status == RunStatus::Hibernated,
                model.hibernated.contains(&run.id),
                "{:?} is {:?}",
                run.id,
                run.status
            );
            prop_assert_eq!(
                world.lane.booted().contains(&run.id),
                run.status != RunStatus::Hibernated,
                "{:?} is {:?}",
                run.id,
                run.status
            );
        }
    }
    // Runs the reaper was due to remove: gone now, or about to be.
    for (id, at) in model.live.clone() {
        if !listed.contains(&id) && Instant::now() + SLACK >= at {
            model.forget(id);
        }
    }
    for (id, at) in &model.live {
        prop_assert!(
            Instant::now() < *at + SLACK + Duration::from_secs(2),
            "run {id} outlived its TTL"
        );
    }
    // 2. Listing == lane == model.
    prop_assert!(
        settled,
        "never settled: listed {:?}, sandboxes {:?}",
        listed,
        world.lane.live()
    );
    let model_live: BTreeSet<Ulid> = model.live.keys().copied().collect();
    prop_assert_eq!(
        &listed,
        &model_live,
        "the API's runs differ from the model's"
    );
    let asleep = runs
        .iter()
        .filter(|r| r.status == RunStatus::Hibernated)
        .count();
    prop_assert!(listed.len() - asleep <= MAX_RUNS);
    // 3. Gone runs never answer.
    for id in &model.gone {
        prop_assert_eq!(code(&m.get(*id).unwrap_err()), ErrorCode::RunNotFound);
        let renewed = world.block_on(m.renew(*id, 60));
        prop_assert_eq!(code(&renewed.unwrap_err()), ErrorCode::RunNotFound);
    }
    // 4. Failed runs say so.
    for id in &model.failed {
        let run = m.get(*id).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(run.status, RunStatus::Failed);
    }
    Ok(())
}

/// Runs `ops`, checking the invariants after each, then restarts once more
/// (the store must hold exactly the live runs: a record brought back by a
/// late write would be listed again here) and deletes everything.
fn run_case(ops: &[Op]) -> Result<(), TestCaseError> {
    let mut world = World::new();
    let mut model = Model::default();
    for (step, op) in ops.iter().enumerate() {
        let at = |e: TestCaseError| TestCaseError::fail(format!("step {step} ({op:?}): {e}"));
        apply(&mut world, &mut model, op).map_err(at)?;
        check_invariants(&mut world, &mut model).map_err(at)?;
    }
    // A last restart: the store agrees with everything above.
    world.restart();
    check_invariants(&mut world, &mut model)?;
    // Deleting everything leaves nothing anywhere.
    let m = world.manager();
    for id in model.live.keys().copied().collect::<Vec<_>>() {
        let _ = world.block_on(m.delete(id));
        model.forget(id);
    }
    check_invariants(&mut world, &mut model)?;
    prop_assert!(world.lane.live().is_empty());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 24,
        max_shrink_iters: 64,
        ..ProptestConfig::default()
    })]

    #[test]
    fn the_lifecycle_keeps_its_invariants(ops in proptest::collection::vec(op(), 1..14)) {
        run_case(&ops)?;
    }
}

#[test]
fn a_fixed_story_keeps_its_invariants() {
    // Fill to capacity, kill one, restart, delete with a hang-up, let a
    // short run expire, and create again.
    let ops = [
        Op::Create { short_ttl: false },
        Op::Create { short_ttl: true },
        Op::Create { short_ttl: false },
        Op::Create { short_ttl: false },
        Op::Kill { run: 0 },
        Op::Lease { run: 2 },
        Op::WriteRead { run: 2 },
        Op::Restart,
        Op::Exec { run: 0 },
        Op::DeleteHangUp {
            run: 2,
            after_ms: 0,
        },
        Op::Wait { ms: 1300 },
        Op::CreateHangUp { after_ms: 1 },
        Op::Create { short_ttl: false },
        Op::Renew { run: 1 },
        Op::Delete { run: 0 },
    ];
    run_case(&ops).unwrap();
}

#[test]
fn a_fixed_story_of_sleep_death_and_waking_keeps_its_invariants() {
    // Hibernate one of a full node, fill its slot, find no room to wake
    // it, make room; kill a run past its restart budget and wake it.
    let ops = [
        Op::Create { short_ttl: false },
        Op::Create { short_ttl: false },
        Op::Create { short_ttl: false },
        Op::WriteRead { run: 0 },
        Op::Hibernate { run: 0 },
        Op::Create { short_ttl: false },
        Op::Wake { run: 0 },
        Op::Exec { run: 0 },
        Op::Delete { run: 1 },
        Op::Exec { run: 0 },
        Op::Kill { run: 2 },
        Op::Kill { run: 2 },
        Op::Kill { run: 2 },
        Op::Kill { run: 2 },
        Op::Exec { run: 2 },
        Op::Wake { run: 2 },
        Op::Pause { run: 3 },
        Op::Hibernate { run: 3 },
        Op::Restart,
        Op::WriteRead { run: 0 },
        Op::Kill { run: 0 },
        Op::Exec { run: 3 },
    ];
    run_case(&ops).unwrap();
}
