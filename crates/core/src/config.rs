//! Server-wide settings that bound what a run may ask for.

use std::time::Duration;

use runbox_types::Limits;

/// Defaults and maxima the core applies to every request.
#[derive(Clone, Debug)]
pub struct Config {
    /// This node's id, shown as `server` on every response.
    pub server_id: String,
    /// Where clients may reach this node directly (`--client-advertise`,
    /// on a node of a fleet), shown as a run's `serverOrigin`.
    pub client_origin: Option<String>,
    /// Whether this node joins a fleet (its `Fleet` is handed over once
    /// the manager has started): work shared with the other nodes waits
    /// for it.
    pub joins_fleet: bool,
    /// Limits a run gets when it asks for none.
    pub default_limits: Limits,
    /// The most a run may ask for.
    pub max_limits: Limits,
    /// TTL of a run that asks for none.
    pub default_ttl: Duration,
    /// The longest TTL a create or renew may ask for.
    pub max_ttl: Duration,
    /// How long a run paused at its TTL (`onExpire: pause`) is kept before
    /// it is destroyed.
    pub paused_retention: Duration,
    /// How long a run hibernated at its TTL (`onExpire: hibernate`) is kept
    /// before it is destroyed.
    pub hibernated_retention: Duration,
    /// A run's idle policy when its create names none (zero: off).
    pub idle: runbox_types::IdlePolicy,
    /// How many history points a run keeps when its create names no
    /// `history` (0: none).
    pub history_keep: u32,
    /// The most history points a create may ask a run to keep.
    pub max_history: u32,
    /// What happens to a run whose init exits on its own.
    pub restart_policy: RestartPolicy,
    /// How many runs may exist at once. runs may exist at once.
    pub max_runs: usize,
    /// The most children one fork may make.
    pub max_fork_count: usize,
    /// The largest file an upload may write.
    pub max_upload_bytes: u64,
    /// A volume's size when its create names none, in MiB.
    pub volume_default_mb: u64,
    /// The largest volume a create may ask for, in MiB.
    pub volume_max_mb: u64,
    /// The operator's dataset catalog (fixed at start).
    pub datasets: Vec<crate::datasets::DatasetEntry>,
    /// The largest unpacked image an import may write.
    pub max_image_bytes: u64,
    /// How long a new sandbox's agent gets to answer its first call.
    pub agent_ready_timeout: Duration,
    /// Registries (`host[:port]`) that may be pulled from over plain HTTP;
    /// loopback registries always may.
    pub insecure_registries: Vec<String>,
    /// The egress proxy's settings; without them the `allowlist` tier is
    /// refused.
    pub egress: Option<std::sync::Arc<dyn crate::egress::EgressProxy>>,
    /// Seals the values of secrets callers bring (the node's key); without
    /// it such secrets are refused.
    pub sealer: Option<std::sync::Arc<dyn crate::sealed::Sealer>>,
    /// The warm repo cache; None disables `warm` on creates.
    pub warm_cache: Option<WarmCacheConfig>,
    /// The warm pools at start (`--pools`, or the persisted set).
    pub pools: runbox_types::PoolSet,
    /// Where `PUT /v1/pools` persists the set; None: not persisted.
    pub pools_file: Option<std::path::PathBuf>,
    /// How long a pool's raised target lasts without claims.
    pub pool_decay: Duration,
    /// The background budget shared by refills, forks and teardowns; 0
    /// sizes it from the host.
    pub refill_concurrency: usize,
    /// Preview URLs; None: the server has no preview listener.
    pub preview: Option<PreviewConfig>,
    /// The checkpoint store; None: checkpoints are refused.
    pub checkpoints: Option<std::sync::Arc<crate::checkpoints::CheckpointStore>>,
    /// How long a checkpoint is kept (None: until deleted).
    pub checkpoint_ttl: Option<Duration>,
    /// Archive runs hibernated this long (None: only when asked, or at
    /// their TTL with `onExpire: archive`).
    pub archive_after: Option<Duration>,
    /// What becomes of a run whose create names no `onNodeLoss` when its
    /// node is declared gone (`--on-node-loss`).
    pub on_node_loss: runbox_types::OnNodeLoss,
    /// Record the bytes of each allowed egress connection in the usage
    /// journal when it closes (`--egress-usage-bytes`).
    pub egress_usage_bytes: bool,
    /// How long a run archived at its TTL (`onExpire: archive`) is kept
    /// before it is destroyed with its archive.
    pub archive_retention: Duration,
    /// The egress tier of build runs (`--build-network`; default open,
    /// with the guard that keeps runs off private and host addresses).
    pub build_network: runbox_types::NetworkTier,
    /// How many cached build steps are kept (`--build-cache-entries`);
    /// past it the oldest go after each build.
    pub build_cache_entries: usize,
}

/// What the daemon does when a run's init exits on its own.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RestartPolicy {
    /// Boot it again on its own disk under the same id, within a budget
    /// ([`RESTART_BUDGET`] restarts in [`RESTART_WINDOW`]).
    #[default]
    Cold,
    /// Mark it failed at once.
    None,
}

/// How many restarts a run gets within [`RESTART_WINDOW`] before it is
/// marked failed instead; also how many boots in a row may fail.
pub const RESTART_BUDGET: usize = 3;

/// The window [`RESTART_BUDGET`] counts restarts in.
pub const RESTART_WINDOW: Duration = Duration::from_secs(10 * 60);

/// How preview URLs are signed and where they point.
#[derive(Clone, Debug)]
pub struct PreviewConfig {
    /// The signing key.
    pub key: crate::preview::PreviewKey,
    /// The URL the preview listener is reached at, without a trailing
    /// slash, e.g. `http://127.0.0.1:7440`.
    pub base_url: String,
}

/// Where the warm repo cache lives and how big it may grow.
#[derive(Clone, Debug)]
pub struct WarmCacheConfig {
    /// Its root directory. On the run store's filesystem, commits clone
    /// file data instead of copying it.
    pub root: std::path::PathBuf,
    /// The most it keeps, in bytes of file data (least recently used
    /// templates go first).
    pub max_bytes: u64,
    /// How often the maintenance tick evicts.
    pub tick: Duration,
}

impl Config {
    /// The documented defaults for a node called `server_id`.
    pub fn new(server_id: impl Into<String>) -> Config {
        Config {
            server_id: server_id.into(),
            client_origin: None,
            joins_fleet: false,
            default_limits: Limits {
                cpus: 1.0,
                memory_mb: 1024,
                pids: 256,
                disk_mb: Some(10 * 1024),
            },
            max_limits: Limits {
                cpus: 16.0,
                memory_mb: 64 * 1024,
                pids: 32768,
                disk_mb: Some(1024 * 1024),
            },
            default_ttl: Duration::from_secs(30 * 60),
            max_ttl: Duration::from_secs(24 * 60 * 60),
            paused_retention: Duration::from_secs(7 * 24 * 60 * 60),
            hibernated_retention: Duration::from_secs(7 * 24 * 60 * 60),
            idle: runbox_types::IdlePolicy::default(),
            history_keep: 0,
            max_history: 100,
            restart_policy: RestartPolicy::Cold,
            max_runs: 256,
            max_fork_count: 16,
            max_upload_bytes: 16 << 30,
            volume_default_mb: 10 * 1024,
            volume_max_mb: 1024 * 1024,
            datasets: Vec::new(),
            max_image_bytes: 32 << 30,
            agent_ready_timeout: Duration::from_secs(10),
            insecure_registries: Vec::new(),
            egress: None,
            sealer: None,
            warm_cache: None,
            pools: runbox_types::PoolSet::default(),
            pools_file: None,
            pool_decay: Duration::from_secs(60),
            refill_concurrency: 0,
            preview: None,
            checkpoints: None,
            checkpoint_ttl: None,
            archive_after: None,
            on_node_loss: runbox_types::OnNodeLoss::Restore,
            archive_retention: Duration::from_secs(30 * 24 * 60 * 60),
            egress_usage_bytes: false,
            build_network: runbox_types::NetworkTier::Open,
            build_cache_entries: 256,
        }
    }
}
