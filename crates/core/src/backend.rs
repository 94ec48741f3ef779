//! The boundary between runbox's core and an isolation lane.
//!
//! A backend creates and destroys sandboxes and says whether one is still
//! alive. It does not run commands or move files: every lane starts the same
//! agent inside the sandbox and tells the core where it listens, so exec and
//! files behave the same whatever isolates the run.

use std::collections::HashSet;
use std::path::PathBuf;

use async_trait::async_trait;
use runbox_types::{Limits, NetworkTier};
use ulid::Ulid;

/// Where the egress proxy listens inside every `allowlist` run: the run's own
/// loopback, port 3128 (the conventional proxy port). Backends bind it in
/// [`Backend::egress_listener`]; the core points `HTTP_PROXY` at
/// [`EGRESS_PROXY_URL`].
pub const EGRESS_PROXY_ADDR: std::net::SocketAddr = std::net::SocketAddr::V4(
    std::net::SocketAddrV4::new(std::net::Ipv4Addr::new(127, 0, 0, 1), 3128),
);

/// [`EGRESS_PROXY_ADDR`] as a proxy URL, for `HTTP_PROXY` and friends.
pub const EGRESS_PROXY_URL: &str = "http://127.0.0.1:3128";

/// The system CA bundle inside a run (Debian, Ubuntu and Alpine keep it
/// here); with [`SandboxSpec::trust_pem`] the backend replaces it by the
/// image's bundle plus those certificates.
pub const TRUST_BUNDLE_PATH: &str = "/etc/ssl/certs/ca-certificates.crt";

/// The extra certificates of [`SandboxSpec::trust_pem`] alone, inside a run.
pub const EXTRA_CA_PATH: &str = "/.runbox/ca.pem";

/// What the core asks a backend to build.
#[derive(Clone, Debug)]
pub struct SandboxSpec {
    /// The run's id; backends derive every resource name from it.
    pub id: Ulid,
    /// The image's layer directories, base first, used read-only as the
    /// overlay's lower layers.
    pub image_layers: Vec<PathBuf>,
    /// Resource limits, already validated against the server maxima.
    pub limits: Limits,
    /// Network tier, already checked to be one the backend supports.
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

/// A started sandbox.
#[derive(Clone, Debug)]
pub struct Sandbox {
    /// Which runtime isolates it (shown on the run, e.g. `runc`).
    pub runtime: String,
    /// The host-side Unix socket on which its agent serves.
    pub agent_socket: PathBuf,
}

/// A copy of a run's writable layer as it was at one instant, taken while
/// the run was frozen. Read-only; removed when dropped.
pub struct Capture {
    /// The overlay upper directory of the copy: everything the run changed.
    pub upper: PathBuf,
    /// Paths below `upper` the backend itself put there (mount points of
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

/// Resolves, with a sentence saying what happened, once a sandbox's init
/// process (the agent) has exited. See [`Backend::watch_exit`].
pub type ExitWatch = std::pin::Pin<Box<dyn std::future::Future<Output = String> + Send>>;

/// Errors from a backend. Messages are for operators; the API shows a generic
/// message for them and logs this one.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The backend cannot do this on this host (for example a network tier).
    #[error("{0}")]
    Unsupported(String),
    /// Creating or destroying the sandbox failed.
    #[error("{0}")]
    Failed(String),
    /// An I/O error while handling backend files.
    #[error("{context}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

impl BackendError {
    /// Wraps an I/O error with what was being done.
    pub fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> BackendError {
        let context = context.into();
        move |source| BackendError::Io { context, source }
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
}

/// An isolation lane. Implementations must make every method idempotent and
/// safe to call for ids they have never seen.
///
/// Cancellation: the core never drops these futures mid-way on purpose (it
/// spawns them), but a daemon crash can stop any of them anywhere. A backend
/// must therefore write down what it created before it creates it, so that
/// [`Backend::sweep`] can remove half-made sandboxes after a restart.
#[async_trait]
pub trait Backend: Send + Sync + 'static {
    /// A short name for logs and the health endpoint, e.g. `oci/runc`.
    fn name(&self) -> String;

    /// Whether runs of this tier can be created; if not, why (shown to the
    /// caller, so it says what the operator would have to change).
    fn check_network(&self, tier: NetworkTier) -> Result<(), String> {
        match tier {
            NetworkTier::None => Ok(()),
            other => Err(format!(
                "this backend provides only network \"none\", not {:?}",
                other.as_str()
            )),
        }
    }

    /// Whether runs can be given a disk limit (`limits.diskMb`); if not,
    /// why, saying what the operator would have to change. A backend never
    /// creates a run without the limit it was asked for.
    fn check_disk(&self) -> Result<(), String> {
        Err("this backend cannot limit a run's disk".into())
    }

    /// Bytes used and in all on the filesystem holding runs' disks, where
    /// that can be measured.
    fn storage(&self) -> Option<runbox_types::StorageInfo> {
        None
    }

    /// Bytes run `id` has written to its own disk, where that is counted.
    fn disk_used(&self, id: Ulid) -> Option<u64> {
        let _ = id;
        None
    }

    /// What run `id` uses now (CPU time, memory), where that is measured.
    fn usage(&self, id: Ulid) -> Option<Usage> {
        let _ = id;
        None
    }

    /// Whether runs can have a warm volume ([`SandboxSpec::warm`]); if not,
    /// why.
    fn check_warm(&self) -> Result<(), String> {
        Err("this backend cannot mount warm volumes".into())
    }

    /// The host path where run `id`'s warm volume shows as the run sees
    /// it (for reading its lockfiles), if it has one.
    fn warm_volume(&self, id: Ulid) -> Option<PathBuf> {
        let _ = id;
        None
    }

    /// Creates and starts a sandbox whose agent is serving (or about to) on
    /// the returned socket. On error nothing of the sandbox is left behind.
    async fn create(&self, spec: &SandboxSpec) -> Result<Sandbox, BackendError>;

    /// Destroys a sandbox and everything the backend made for it. Succeeds
    /// when there is nothing left to destroy.
    async fn destroy(&self, id: Ulid) -> Result<(), BackendError>;

    /// Whether the sandbox's init process (the agent) is still running.
    async fn is_alive(&self, id: Ulid) -> Result<bool, BackendError>;

    /// Destroys every sandbox this backend made that is not in `keep`, and
    /// returns the ids it destroyed. Runs at start-up, after the store's
    /// records have been reconciled.
    async fn sweep(&self, keep: &HashSet<Ulid>) -> Result<Vec<Ulid>, BackendError>;

    /// A listening TCP socket inside the `allowlist` run's network namespace,
    /// on which the daemon serves that run's egress proxy. Called after
    /// `create` and again after a restart re-adopts the run (the old socket
    /// died with the old daemon).
    async fn egress_listener(&self, id: Ulid) -> Result<std::net::TcpListener, BackendError> {
        let _ = id;
        Err(BackendError::Unsupported(
            "this backend has no egress proxy listener".into(),
        ))
    }

    /// A TCP connection to `port` on the loopback of run `id`, made from
    /// inside its network namespace: it works for every network tier, and
    /// needs no route into the run.
    async fn dial(&self, id: Ulid, port: u16) -> Result<std::net::TcpStream, BackendError> {
        let _ = (id, port);
        Err(BackendError::Unsupported(
            "this backend cannot connect into a run".into(),
        ))
    }

    /// Freezes the run, copies its writable layer as it is in constant time
    /// where the storage can (a subvolume snapshot), and thaws it: commands
    /// in flight only pause. The copy goes when the [`Capture`] is dropped.
    async fn capture(&self, id: Ulid) -> Result<Capture, BackendError> {
        let _ = id;
        Err(BackendError::Unsupported(
            "this backend cannot capture a run's filesystem".into(),
        ))
    }

    /// A future that resolves when the sandbox's init process exits, so the
    /// core notices a run that died on its own. Called once the run is up,
    /// and again for a run re-adopted after a restart. The default has no
    /// way to watch: such runs are only found dead when an exec fails.
    async fn watch_exit(&self, id: Ulid) -> Result<ExitWatch, BackendError> {
        let _ = id;
        Err(BackendError::Unsupported(
            "this backend cannot watch a sandbox's init process".into(),
        ))
    }
}
