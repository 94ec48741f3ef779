//! The boundary between runbox's core and an isolation lane.
//!
//! A [`Lane`] makes sandboxes, re-adopts the ones a previous daemon left
//! running, and sweeps what nobody claims; each sandbox is then driven
//! through a per-sandbox handle, [`Sandbox`]: its agent's endpoint,
//! destroy, exit watch, capture, usage, suspend and resume. What a lane
//! can do on this host is stated once, up front, in its [`Capabilities`].
//!
//! A lane does not run commands or move files: every lane starts the same
//! agent inside the sandbox and says where it listens
//! ([`AgentEndpoint`]), so exec and files behave the same whatever isolates
//! the run, and a second lane (a microVM, say) is a crate of its own that
//! touches no handler.

use std::collections::HashSet;
use std::path::PathBuf;

use std::sync::Arc;

use async_trait::async_trait;
use runbox_types::{Limits, NetworkTier};
use ulid::Ulid;

/// Where the egress proxy listens inside every `allowlist` run: the run's own
/// loopback, port 3128 (the conventional proxy port). Lanes bind it in
/// [`Sandbox::egress_listener`]; the core points `HTTP_PROXY` at
/// [`EGRESS_PROXY_URL`].
pub const EGRESS_PROXY_ADDR: std::net::SocketAddr = std::net::SocketAddr::V4(
    std::net::SocketAddrV4::new(std::net::Ipv4Addr::new(127, 0, 0, 1), 3128),
);

/// [`EGRESS_PROXY_ADDR`] as a proxy URL, for `HTTP_PROXY` and friends.
pub const EGRESS_PROXY_URL: &str = "http://127.0.0.1:3128";

/// Where the SOCKS5 door listens in a run that asked for one
/// (`egressSocks5`): the run's loopback, port 1080 (SOCKS's own port).
pub const EGRESS_SOCKS5_ADDR: std::net::SocketAddr = std::net::SocketAddr::V4(
    std::net::SocketAddrV4::new(std::net::Ipv4Addr::new(127, 0, 0, 1), 1080),
);

/// [`EGRESS_SOCKS5_ADDR`] as a proxy URL for `ALL_PROXY`: `socks5h`, so
/// that names are resolved by the proxy (the run has no DNS of its own).
pub const EGRESS_SOCKS5_URL: &str = "socks5h://127.0.0.1:1080";

/// The listeners an `allowlist` run's egress proxy serves in its namespace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EgressDoor {
    /// The HTTP proxy, on [`EGRESS_PROXY_ADDR`]; every `allowlist` run.
    Http,
    /// The SOCKS5 door, on [`EGRESS_SOCKS5_ADDR`]; runs that ask.
    Socks5,
}

impl EgressDoor {
    /// Where the door listens inside the run.
    pub fn addr(self) -> std::net::SocketAddr {
        match self {
            EgressDoor::Http => EGRESS_PROXY_ADDR,
            EgressDoor::Socks5 => EGRESS_SOCKS5_ADDR,
        }
    }
}

/// The system CA bundle inside a run (Debian, Ubuntu and Alpine keep it
/// here); with [`SandboxSpec::trust_pem`] the lane replaces it by the
/// image's bundle plus those certificates.
pub const TRUST_BUNDLE_PATH: &str = "/etc/ssl/certs/ca-certificates.crt";

/// The extra certificates of [`SandboxSpec::trust_pem`] alone, inside a run.
pub const EXTRA_CA_PATH: &str = "/.runbox/ca.pem";

/// What the core asks a lane to build.
#[derive(Clone, Debug)]
pub struct SandboxSpec {
    /// The run's id; lanes derive every resource name from it.
    pub id: Ulid,
    /// The image's layer directories, base first, used read-only as the
    /// overlay's lower layers.
    pub image_layers: Vec<PathBuf>,
    /// Resource limits, already validated against the server maxima.
    pub limits: Limits,
    /// Network tier, already checked to be one the lane supports.
    pub network: NetworkTier,
    /// Extra CA certificates (PEM) the run must trust, appended to the
    /// image's system bundle (the egress proxy's interception CA).
    pub trust_pem: Option<String>,
    /// A fork's starting point: the directory of a [`Capture`] (its
    /// `upper`'s parent) whose writable layer the new run starts from,
    /// shared until either side writes. None: an empty writable layer.
    pub seed: Option<PathBuf>,
    /// A warm volume to mount (see [`WarmMount`]).
    pub warm: Option<WarmMount>,
    /// Named volumes to mount (made with [`Lane::create_volume`]).
    pub volumes: Vec<VolumeBind>,
}

/// A named volume a run mounts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeBind {
    /// The volume.
    pub id: Ulid,
    /// Where in the run (absolute, checked).
    pub path: String,
    /// Mounted read-only.
    pub read_only: bool,
    /// A dataset of the operator's catalog: its image, which the lane
    /// holds for the run ([`Lane::hold_dataset`]) instead of a named
    /// volume's directory.
    pub dataset: Option<crate::datasets::DatasetEntry>,
}

/// A run's warm volume: an overlay of its own writable layer over a
/// read-only template directory (or over nothing), mounted at `path`. The
/// volume's writes live in the run's disk, under its limit.
#[derive(Clone, Debug)]
pub struct WarmMount {
    /// Where in the run (absolute, checked).
    pub path: String,
    /// The template generation's files, never written; None: the volume
    /// starts empty.
    pub lower: Option<PathBuf>,
}

/// Where a sandbox's agent serves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AgentEndpoint {
    /// A Unix socket on the host (the OCI lane: the daemon binds it and
    /// hands the sandbox only the listening descriptor).
    Unix(PathBuf),
}

impl AgentEndpoint {
    /// A client of the agent at this endpoint (connects on first use).
    pub fn client(&self) -> runbox_agent_proto::AgentClient {
        match self {
            AgentEndpoint::Unix(path) => runbox_agent_proto::connect_unix(path.clone()),
        }
    }
}

/// Whether a lane can do one thing on this host; if not, why, in words
/// that say what the operator would have to change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Support {
    /// It can.
    Yes,
    /// It cannot, for this reason.
    No(String),
}

impl Support {
    /// `Ok` when supported, else the reason.
    pub fn check(&self) -> Result<(), &str> {
        match self {
            Support::Yes => Ok(()),
            Support::No(why) => Err(why),
        }
    }

    /// Whether it is supported.
    pub fn yes(&self) -> bool {
        *self == Support::Yes
    }
}

/// What a lane can do on this host, decided when it starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// `allowlist` runs: a loopback-only namespace with an egress proxy
    /// listener inside ([`Sandbox::egress_listener`]).
    pub allowlist: Support,
    /// `open` runs: a routed network of their own.
    pub open: Support,
    /// A limit on a run's disk (`limits.diskMb`); a lane never creates a
    /// run without the limit it was asked for.
    pub disk_limit: Support,
    /// Warm volumes ([`SandboxSpec::warm`]).
    pub warm_volumes: Support,
    /// Capturing a run's filesystem ([`Sandbox::capture`]): snapshots,
    /// forks and warm commits.
    pub capture: Support,
    /// Noticing a sandbox whose init exited ([`Sandbox::watch_exit`]);
    /// without it a dead run is found only when a call fails.
    pub exit_watch: Support,
    /// Connections into a run ([`Sandbox::dial`]): previews, ports.
    pub dial: Support,
    /// Suspending and resuming a run's processes ([`Sandbox::suspend`]).
    pub suspend: Support,
    /// Stopping a run down to its disk and booting it again on that disk
    /// ([`Sandbox::hibernate`], [`Lane::boot`]): hibernation, wake and the
    /// restart policy.
    pub hibernate: Support,
    /// Keeping a capture as a local layer in constant time
    /// ([`Lane::keep_layer`]): snapshots without writing a tar.
    pub layers: Support,
    /// A user namespace of its own for every new run: root in a run is an
    /// unprivileged id on the host.
    pub user_namespaces: Support,
}

impl Capabilities {
    /// A lane that can do nothing but make `none` runs; each field says
    /// `why`.
    pub fn none(why: &str) -> Capabilities {
        let no = || Support::No(why.to_owned());
        Capabilities {
            allowlist: no(),
            open: no(),
            disk_limit: no(),
            warm_volumes: no(),
            capture: no(),
            exit_watch: no(),
            dial: no(),
            suspend: no(),
            hibernate: no(),
            layers: no(),
            user_namespaces: no(),
        }
    }

    /// The names of what the lane can do, as a fleet's node row and
    /// `GET /v1/cluster` list them.
    pub fn names(&self) -> Vec<String> {
        [
            ("allowlist", &self.allowlist),
            ("open", &self.open),
            ("diskLimit", &self.disk_limit),
            ("warmVolumes", &self.warm_volumes),
            ("capture", &self.capture),
            ("exitWatch", &self.exit_watch),
            ("dial", &self.dial),
            ("suspend", &self.suspend),
            ("hibernate", &self.hibernate),
            ("layers", &self.layers),
            ("userNamespaces", &self.user_namespaces),
        ]
        .into_iter()
        .filter(|(_, support)| support.yes())
        .map(|(name, _)| name.to_owned())
        .collect()
    }

    /// Whether runs of `tier` can be made.
    pub fn network(&self, tier: NetworkTier) -> Result<(), &str> {
        match tier {
            NetworkTier::None => Ok(()),
            NetworkTier::Allowlist => self.allowlist.check(),
            NetworkTier::Open => self.open.check(),
        }
    }
}

/// A copy of a run's writable layer as it was at one instant, taken while
/// the run was frozen. Read-only; removed when dropped.
pub struct Capture {
    /// The overlay upper directory of the copy: everything the run changed.
    pub upper: PathBuf,
    /// Paths below `upper` the lane itself put there (mount points of
    /// what it injects: the agent, CA bundles, resolv.conf); never part of
    /// a snapshot.
    pub injected: Vec<String>,
    /// How long the run's processes were frozen.
    pub frozen: std::time::Duration,
    /// The upper directory of the run's warm volume in the copy, when the
    /// run has one: what the run changed in it.
    pub warm_upper: Option<PathBuf>,
    release: Option<Box<dyn FnOnce() + Send + Sync>>,
}

impl Capture {
    /// A capture at `upper` that `release` removes.
    pub fn new(
        upper: PathBuf,
        injected: Vec<String>,
        frozen: std::time::Duration,
        release: impl FnOnce() + Send + Sync + 'static,
    ) -> Capture {
        Capture {
            upper,
            injected,
            frozen,
            warm_upper: None,
            release: Some(Box::new(release)),
        }
    }

    /// The same capture, with the warm volume's upper directory.
    pub fn with_warm_upper(mut self, upper: Option<PathBuf>) -> Capture {
        self.warm_upper = upper;
        self
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        if let Some(release) = self.release.take() {
            release();
        }
    }
}

impl std::fmt::Debug for Capture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Capture")
            .field("upper", &self.upper)
            .field("frozen", &self.frozen)
            .finish_non_exhaustive()
    }
}

/// Where a run's changes are counted from ([`Sandbox::keep_point`]): a
/// storage transaction, and a time taken before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Since {
    /// Changes in later transactions count.
    pub transid: u64,
    /// A time no later than that transaction (how recent it is).
    pub at: std::time::SystemTime,
    /// The point the files were at then (for an inode, what it was), if
    /// one is kept.
    pub point: Option<Ulid>,
}

/// A history point a lane kept ([`Sandbox::keep_point`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeptPoint {
    /// The point.
    pub id: Ulid,
    /// The transaction it was made in: changes after it are newer.
    pub transid: u64,
    /// What the core said of it.
    pub meta: Vec<u8>,
}

/// A run's history as its lane keeps it ([`Sandbox::points`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct History {
    /// Its points, oldest first.
    pub points: Vec<KeptPoint>,
    /// The point its disk was last returned to, while later points are
    /// kept; None: the newest.
    pub head: Option<Ulid>,
}

/// What a local layer holds ([`Lane::keep_layer`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LayerSize {
    /// Bytes of file data.
    pub bytes: u64,
    /// Entries (files, directories, links, whiteouts).
    pub entries: u64,
}

/// Resolves, with a sentence saying what happened, once a sandbox's init
/// process (the agent) has exited. See [`Sandbox::watch_exit`].
pub type ExitWatch = std::pin::Pin<Box<dyn std::future::Future<Output = String> + Send>>;

/// Errors from a lane. Messages are for operators; the API shows a generic
/// message for them and logs this one.
#[derive(Debug, thiserror::Error)]
pub enum LaneError {
    /// The lane cannot do this on this host (for example a network tier).
    #[error("{0}")]
    Unsupported(String),
    /// Creating or destroying the sandbox failed.
    #[error("{0}")]
    Failed(String),
    /// An I/O error while handling lane files.
    #[error("{context}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

impl LaneError {
    /// Wraps an I/O error with what was being done.
    pub fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> LaneError {
        let context = context.into();
        move |source| LaneError::Io { context, source }
    }

    fn unsupported(what: &str) -> LaneError {
        LaneError::Unsupported(format!("this lane cannot {what}"))
    }
}

/// What a run uses at one moment, as its cgroup counts it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// CPU time used since it started, in nanoseconds.
    pub cpu_ns: u64,
    /// Memory charged to it now, page cache included.
    pub memory_bytes: u64,
    /// The page cache part of `memory_bytes`.
    pub memory_cache_bytes: u64,
    /// The most memory it was charged since it started, where the cgroup
    /// keeps that (v1 `memory.max_usage_in_bytes`, v2 `memory.peak`).
    pub memory_peak_bytes: Option<u64>,
}

/// One sandbox of a lane, by its run's id. Handles are cheap and stateless:
/// the lane finds everything from the id, so a handle works for a sandbox
/// made by a previous daemon, and for one that is half-made or already
/// gone. Every method is idempotent.
///
/// Cancellation: the core never drops these futures mid-way on purpose (it
/// spawns them), but a daemon crash can stop any of them anywhere. A lane
/// must therefore write down what it created before it creates it, so that
/// [`Lane::sweep`] can remove half-made sandboxes after a restart.
#[async_trait]
pub trait Sandbox: Send + Sync {
    /// The run's id.
    fn id(&self) -> Ulid;

    /// Which runtime isolates it (shown on the run, e.g. `runc`).
    fn runtime(&self) -> String;

    /// Where its agent serves.
    fn agent(&self) -> AgentEndpoint;

    /// Destroys it and everything the lane made for it. Succeeds when
    /// there is nothing left to destroy.
    async fn destroy(&self) -> Result<(), LaneError>;

    /// Ends every process of it, and returns once they are gone; what the
    /// lane made for it stays for [`Sandbox::destroy`]. Succeeds when none
    /// is running. A lane that cannot do this apart from the rest says so
    /// (the default), and then a delete waits for the whole teardown.
    async fn halt(&self) -> Result<(), LaneError> {
        Err(LaneError::Unsupported(
            "this lane ends a sandbox's processes only with the rest of it".into(),
        ))
    }

    /// A future that resolves when its init process exits, so the core
    /// notices a run that died on its own. Called once the run is up, and
    /// again for a run re-adopted after a restart.
    async fn watch_exit(&self) -> Result<ExitWatch, LaneError> {
        Err(LaneError::unsupported("watch a sandbox's init process"))
    }

    /// Freezes the run, copies its writable layer as it is in constant time
    /// where the storage can (a subvolume snapshot), and thaws it: commands
    /// in flight only pause. The copy goes when the [`Capture`] is dropped.
    async fn capture(&self) -> Result<Capture, LaneError> {
        Err(LaneError::unsupported("capture a run's filesystem"))
    }

    /// [`Sandbox::capture`] of a sandbox stopped down to its disk (a
    /// hibernated run): nothing runs, so nothing is frozen.
    async fn capture_stopped(&self) -> Result<Capture, LaneError> {
        Err(LaneError::unsupported("capture a stopped run's filesystem"))
    }

    /// What it uses now (CPU time, memory), where that is measured.
    fn usage(&self) -> Option<Usage> {
        None
    }

    /// Mounts `volumes` into the running sandbox (a pool member being
    /// handed to a create that asked for them), each as a create would
    /// have: its directory made, the volume bound there. On error the
    /// sandbox is not handed out (it is destroyed), so nothing is undone.
    async fn mount_volumes(&self, volumes: &[VolumeBind]) -> Result<(), LaneError> {
        let _ = volumes;
        Err(LaneError::unsupported("mount volumes into a running run"))
    }

    /// Bytes it has written to its own disk, where that is counted.
    fn disk_used(&self) -> Option<u64> {
        None
    }

    /// The host path where its warm volume shows as the run sees it (for
    /// reading its lockfiles), if it has one.
    fn warm_volume(&self) -> Option<PathBuf> {
        None
    }

    /// Moves the running sandbox between the `none` and `allowlist`
    /// tiers (both a namespace with loopback only; `allowlist` also gets a
    /// proxy listener): recorded, so [`Sandbox::egress_listener`] binds
    /// only for a run that is on `allowlist` now. Other changes are
    /// refused.
    async fn change_network(&self, network: NetworkTier) -> Result<(), LaneError> {
        let _ = network;
        Err(LaneError::unsupported("change a run's network tier"))
    }

    /// A listening TCP socket inside an `allowlist` run's network
    /// namespace, on `door`'s address, on which the daemon serves that
    /// run's egress proxy. Called after `create` and again after a restart
    /// re-adopts the run (the old socket died with the old daemon).
    async fn egress_listener(&self, door: EgressDoor) -> Result<std::net::TcpListener, LaneError> {
        let _ = door;
        Err(LaneError::unsupported(
            "give a run an egress proxy listener",
        ))
    }

    /// A TCP connection to `port` on its loopback, made from inside its
    /// network namespace: it works for every network tier, and needs no
    /// route into the run.
    async fn dial(&self, port: u16) -> Result<std::net::TcpStream, LaneError> {
        let _ = port;
        Err(LaneError::unsupported("connect into a run"))
    }

    /// Stops every process of the run where it is, memory kept.
    async fn suspend(&self) -> Result<(), LaneError> {
        Err(LaneError::unsupported("suspend a run"))
    }

    /// Lets a suspended run's processes go on.
    async fn resume(&self) -> Result<(), LaneError> {
        Err(LaneError::unsupported("resume a run"))
    }

    /// Keeps the run's disk as it is now as history point `point` of the
    /// run, described by `meta` (the core's bytes, kept beside it), unless
    /// nothing in the run's files changed after `since` (a point's
    /// [`KeptPoint::transid`] or [`Sandbox::settle_history`]'s answer):
    /// then nothing is kept and the answer is None. Constant time where the
    /// storage snapshots; the run is not frozen (a point is the files as
    /// they are at one instant).
    async fn keep_point(
        &self,
        point: Ulid,
        since: Option<Since>,
        meta: Vec<u8>,
    ) -> Result<Option<KeptPoint>, LaneError> {
        let _ = (point, since, meta);
        Err(LaneError::unsupported("keep history points"))
    }

    /// Commits what the run's disk holds now and answers the transaction
    /// after which a change is the run's own: called when a run with
    /// history comes up (the lane's own writes while booting are not the
    /// run's changes).
    async fn settle_history(&self) -> Result<u64, LaneError> {
        Err(LaneError::unsupported("keep history points"))
    }

    /// The run's history points, oldest first (half-made ones left out),
    /// and the point its disk was last returned to while later ones are
    /// kept.
    fn points(&self) -> History {
        History::default()
    }

    /// Replaces what is said of point `point`.
    fn describe_point(&self, point: Ulid, meta: Vec<u8>) -> Result<(), LaneError> {
        let _ = (point, meta);
        Err(LaneError::unsupported("keep history points"))
    }

    /// Records the point the run's disk was last returned to (None: the
    /// newest).
    fn set_history_head(&self, point: Option<Ulid>) -> Result<(), LaneError> {
        let _ = point;
        Err(LaneError::unsupported("keep history points"))
    }

    /// Deletes point `point`; nothing to do when it is gone.
    async fn drop_point(&self, point: Ulid) -> Result<(), LaneError> {
        let _ = point;
        Err(LaneError::unsupported("keep history points"))
    }

    /// [`Sandbox::drop_point`], answered once the storage has freed what
    /// only the point held and counts it so ([`Sandbox::disk_used`],
    /// [`Sandbox::history_bytes`] read true after it).
    async fn drop_point_and_reclaim(&self, point: Ulid) -> Result<(), LaneError> {
        self.drop_point(point).await
    }

    /// Makes room in the run's disk limit for its history, `limit` being
    /// the run's own (`limits.diskMb`): where the storage charges what
    /// history points hold to the run's disk (simple quotas), the limit
    /// becomes twice `limit`, so that the blocks the newest point keeps
    /// while a command overwrites them never make the run's own writes
    /// fail; points are dropped to keep the run and its history within
    /// `limit`. Called when a run's history starts.
    async fn history_room(&self, limit: Option<u64>) -> Result<(), LaneError> {
        let _ = limit;
        Ok(())
    }

    /// Point `point` as a [`Capture`] (for a snapshot or a fork of it):
    /// nothing is frozen or copied, and dropping it keeps the point.
    fn point_capture(&self, point: Ulid) -> Result<Capture, LaneError> {
        let _ = point;
        Err(LaneError::unsupported("keep history points"))
    }

    /// Bytes the run's history holds beyond its disk (what its points
    /// alone keep), where that is counted.
    fn history_bytes(&self) -> Option<u64> {
        None
    }

    /// Makes a hibernated run's disk what it was at point `point` (the
    /// point is kept). Crash-safe: the old disk is replaced only once the
    /// new one is whole. The run is booted with [`Lane::boot`] after.
    async fn restore_point(&self, point: Ulid) -> Result<(), LaneError> {
        let _ = point;
        Err(LaneError::unsupported("roll a run back"))
    }

    /// Stops the run down to its disk: its processes (suspended or not),
    /// agent, namespaces, cgroup and mounts go; its disk (the writable
    /// layer, a warm volume's layer) stays, for [`Lane::boot`]. Also what
    /// is left of a run whose init died, or of a boot that failed half-way.
    async fn hibernate(&self) -> Result<(), LaneError> {
        Err(LaneError::unsupported("hibernate a run"))
    }
}

/// An isolation lane: makes sandboxes, re-adopts them after a restart, and
/// sweeps what nobody claims.
#[async_trait]
pub trait Lane: Send + Sync + 'static {
    /// A short name for logs and the health endpoint, e.g. `oci/runc`.
    fn name(&self) -> String;

    /// What it can do on this host.
    fn capabilities(&self) -> &Capabilities;

    /// Bytes used and in all on the filesystem holding runs' disks, where
    /// that can be measured.
    fn storage(&self) -> Option<runbox_types::StorageInfo> {
        None
    }

    /// Creates and starts a sandbox whose agent is serving (or about to).
    /// On error nothing of the sandbox is left behind.
    async fn create(&self, spec: &SandboxSpec) -> Result<Arc<dyn Sandbox>, LaneError>;

    /// Boots run `spec.id` again on the disk [`Sandbox::hibernate`] kept
    /// (`spec.seed` is ignored): a new sandbox under the same id, with a
    /// fresh agent. First removes whatever is left of the previous one
    /// besides its disk. On error the run is as hibernated again: its disk
    /// kept, nothing else.
    async fn boot(&self, spec: &SandboxSpec) -> Result<Arc<dyn Sandbox>, LaneError> {
        let _ = spec;
        Err(LaneError::unsupported("boot a hibernated run"))
    }

    /// Where this lane keeps the local layers it makes of captures
    /// ([`Lane::keep_layer`]): layer `<id>` is the directory `<root>/<id>`,
    /// whose `upper` an image mounts. None when it makes none.
    fn layer_root(&self) -> Option<PathBuf> {
        None
    }

    /// Keeps what `capture` holds as local layer `id`: `<root>/<id>/upper`
    /// is what the run changed (overlayfs' whiteouts and opaque
    /// directories as it wrote them), less what the lane injected
    /// ([`Capture::injected`]) and less a warm volume, read-only from then
    /// on. Constant time where the storage can (a snapshot of the
    /// capture). On error nothing of the layer is left.
    async fn keep_layer(&self, capture: &Capture, id: Ulid) -> Result<LayerSize, LaneError> {
        let _ = (capture, id);
        Err(LaneError::unsupported("keep a capture as a layer"))
    }

    /// Deletes local layer `id`; nothing to do when it is gone.
    fn remove_layer(&self, id: &str) -> Result<(), LaneError> {
        let _ = id;
        Ok(())
    }

    /// Deletes every local layer whose id is not in `keep` (made, then not
    /// recorded, by a daemon that died); returns the ids deleted. Runs at
    /// start-up.
    fn sweep_layers(&self, keep: &HashSet<String>) -> Vec<String> {
        let _ = keep;
        Vec::new()
    }

    /// Makes named volume `id`: an empty directory of its own that holds
    /// at most `limit` bytes (data and metadata), kept until
    /// [`Lane::delete_volume`]. Files in it are stored with the ids runs
    /// see (a run with a user namespace mounts it mapped). On error
    /// nothing of it is left.
    async fn create_volume(&self, id: Ulid, limit: u64) -> Result<(), LaneError> {
        let _ = (id, limit);
        Err(LaneError::unsupported("make volumes"))
    }

    /// Makes volume `id` a copy of volume `from` as it is now, limited to
    /// `limit` bytes; constant time where the storage can. On error
    /// nothing of it is left.
    async fn clone_volume(&self, from: Ulid, id: Ulid, limit: u64) -> Result<(), LaneError> {
        let _ = (from, id, limit);
        Err(LaneError::unsupported("clone volumes"))
    }

    /// Deletes volume `id` and everything in it; nothing to do when it is
    /// gone.
    async fn delete_volume(&self, id: Ulid) -> Result<(), LaneError> {
        let _ = id;
        Ok(())
    }

    /// Holds catalog dataset `entry` for run `run`, mounting its image on
    /// the host first when no run holds it (`rw`: read-write, after the
    /// image's dirty marker is on disk); the host path runs bind-mount.
    /// Holding again is a no-op.
    fn hold_dataset(
        &self,
        entry: &crate::datasets::DatasetEntry,
        rw: bool,
        run: Ulid,
    ) -> Result<PathBuf, LaneError> {
        let _ = (entry, rw, run);
        Err(LaneError::unsupported("mount datasets"))
    }

    /// Run `run` no longer holds dataset `entry`; with no holder left the
    /// image is unmounted, and a clean unmount of a read-write mount
    /// removes its dirty marker.
    fn release_dataset(&self, entry: &crate::datasets::DatasetEntry, run: Ulid) {
        let _ = (entry, run);
    }

    /// Unmounts the datasets a previous daemon left mounted that no run
    /// holds now (`held`: the names restored runs hold); start-up.
    fn sweep_datasets(&self, catalog: &[crate::datasets::DatasetEntry], held: &HashSet<String>) {
        let _ = (catalog, held);
    }

    /// The host directory holding volume `id`'s files, for file operations
    /// without a run (confined beneath it); None where the lane keeps them
    /// out of the daemon's reach.
    fn volume_dir(&self, id: Ulid) -> Option<PathBuf> {
        let _ = id;
        None
    }

    /// Bytes volume `id` holds, where the storage counts them.
    fn volume_used(&self, id: Ulid) -> Option<u64> {
        let _ = id;
        None
    }

    /// Deletes every volume whose id is not in `keep` (made, then not
    /// recorded, by a daemon that died); returns the ids deleted. Runs at
    /// start-up.
    fn sweep_volumes(&self, keep: &HashSet<Ulid>) -> Vec<Ulid> {
        let _ = keep;
        Vec::new()
    }

    /// The handle of run `id`'s sandbox, whatever state it is in.
    fn sandbox(&self, id: Ulid) -> Arc<dyn Sandbox>;

    /// Run `id`'s sandbox if a previous daemon left it alive; None when it
    /// is not. A sandbox that daemon left frozen is thawed first (it died
    /// in the middle of a capture), unless the run was `suspended` on
    /// purpose, which it stays.
    async fn adopt(&self, id: Ulid, suspended: bool)
        -> Result<Option<Arc<dyn Sandbox>>, LaneError>;

    /// Destroys every sandbox this lane made that is not in `keep`, and
    /// returns the ids it destroyed. Runs at start-up, after the store's
    /// records have been reconciled.
    async fn sweep(&self, keep: &HashSet<Ulid>) -> Result<Vec<Ulid>, LaneError>;
}
