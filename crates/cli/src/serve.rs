//! `runbox serve`: wires the state directory, the isolation lane, the run
//! manager (whose runs reap themselves at their TTL) and the HTTP server together, and runs until SIGINT or
//! SIGTERM. Runs outlive the daemon: stopping it (or `kill -9`) leaves them
//! running, and the next start re-adopts them.

use std::io::Write;
use std::net::SocketAddr;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use runbox_core::images::ImageStore;
use runbox_core::store::Store;
use runbox_core::{Config, Lane, Manager};
use runbox_runtime::OciLane;
use tokio_util::sync::CancellationToken;

/// The run store's image under the state directory (`--storage-gb`).
const STORAGE_IMAGE: &str = "storage.img";

/// Where `PUT /v1/pools` persists the pool set, in the state directory.
const POOLS_FILE: &str = "pools.json";

/// Arguments of `runbox serve`.
/// `--userns`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum UsernsArg {
    /// On where the host can do it, else off with a warning.
    Auto,
    /// Each run gets a user namespace of its own; the start fails where
    /// the host cannot do it.
    On,
    /// Runs share the host's user namespace.
    Off,
}

/// `--userns-range`, checked.
fn parse_userns_range(text: &str) -> Result<String, String> {
    runbox_core::userns::IdRanges::parse(text).map(|_| text.to_owned())
}

/// `--build-network`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BuildNetworkArg {
    /// No network: steps that download fail
    None,
    /// The allowlist proxy, with the default allowlist (package registries)
    Allowlist,
    /// Open egress, private and host addresses refused
    Open,
}

/// `--on-node-loss`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OnNodeLossArg {
    /// Bring the run back on another node from its latest checkpoint
    Restore,
    /// Mark the run lost
    Lost,
}

/// `--restart-policy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum RestartPolicyArg {
    /// Boot the run again on its own disk, under the same id
    Cold,
    /// Mark the run failed
    None,
}

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Address to listen on. Anything but loopback also needs
    /// --allow-non-loopback: the API can run commands as root in sandboxes.
    #[arg(long, default_value = "127.0.0.1:7439", env = "RUNBOX_LISTEN")]
    pub listen: SocketAddr,
    /// Directory for runbox's state (token, database, images, runs).
    #[arg(long, default_value = "/var/lib/runbox", env = "RUNBOX_STATE_DIR")]
    pub state_dir: PathBuf,
    /// OCI runtime to use (`runc`, `crun`, `runsc` or a path); default: the
    /// first of crun and runc that starts a probe container.
    #[arg(long, env = "RUNBOX_RUNTIME")]
    pub runtime: Option<String>,
    /// The static runbox-agent binary; default: beside this executable.
    #[arg(long, env = "RUNBOX_AGENT")]
    pub agent: Option<PathBuf>,
    /// Listen on a non-loopback address (put TLS in front of it).
    #[arg(long)]
    pub allow_non_loopback: bool,
    /// This node's id on every response; default: a ULID minted on first start.
    #[arg(long, env = "RUNBOX_SERVER_ID")]
    pub server_id: Option<String>,
    /// Most runs at once.
    #[arg(long, default_value_t = 256)]
    pub max_runs: usize,
    /// Most CPUs one run may ask for.
    #[arg(long, default_value_t = 16.0)]
    pub max_cpus: f64,
    /// Most memory (MiB) one run may ask for.
    #[arg(long, default_value_t = 65536)]
    pub max_memory_mb: u64,
    /// Most children one fork may make.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub max_fork_count: u64,
    /// History points a run keeps when its create names no `history`
    /// (0: runs keep none unless they ask).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=10_000))]
    pub history_keep: u32,
    /// Most history points a create may ask a run to keep.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub max_history: u32,
    /// Most processes one run may ask for.
    #[arg(long, default_value_t = 32768)]
    pub max_pids: u64,
    /// Most disk (MiB) one run may ask for; runs get 10 GiB (or this, if
    /// lower) when they ask for nothing.
    #[arg(long, default_value_t = 256 * 1024, conflicts_with = "no_disk_limits")]
    pub max_disk_mb: u64,
    /// Run without disk limits: runs may fill the filesystem holding the
    /// state directory. Only for storage that cannot enforce limits.
    #[arg(long)]
    pub no_disk_limits: bool,
    /// Keep runs' files in a btrfs image of this many GiB under the state
    /// directory (`storage.img`, sparse, made and loop-mounted on first
    /// start), so disk limits work whatever filesystem the host has.
    /// Without it (and without --no-disk-limits), a state directory whose
    /// filesystem cannot limit a run's disk gets such a store by default,
    /// sized from its free space (at most 100 GiB); one made before is kept.
    /// 0: no store of its own, the state directory as it is.
    #[arg(long, env = "RUNBOX_STORAGE_GB", value_name = "GB",
          value_parser = clap::value_parser!(u64).range(0..=1 << 20))]
    pub storage_gb: Option<u64>,
    /// The warm repo cache's directory; an empty value turns the cache off
    /// [default: <state-dir>/runs/.warm, on the run store, where commits
    /// clone file data instead of copying it].
    #[arg(long, env = "RUNBOX_CACHE_ROOT", value_name = "DIR")]
    pub cache_root: Option<String>,
    /// Most the warm repo cache keeps, in GiB of file data (fractions
    /// allowed); least recently used templates are evicted first.
    #[arg(long, default_value_t = 20.0, value_name = "GB")]
    pub cache_max_gb: f64,
    /// Seconds between the warm cache's eviction passes.
    #[arg(long, default_value_t = 30, value_name = "SECS",
          value_parser = clap::value_parser!(u64).range(1..=86400))]
    pub cache_tick_sec: u64,
    /// Warm pools at first start, as JSON ({"pools": [{"image", "network",
    /// "size", "warm", "warmMax", "warmup"}]}). Once PUT /v1/pools has been
    /// called, the set it persisted (<state-dir>/pools.json) is used instead.
    #[arg(long, env = "RUNBOX_POOLS", value_name = "FILE")]
    pub pools: Option<PathBuf>,
    /// How many runs the background makes or destroys at once (pool
    /// refills, forks, teardowns); 0 sizes it from the host.
    #[arg(long, default_value_t = 0, value_name = "N",
          value_parser = clap::value_parser!(u64).range(0..=4096))]
    pub refill_concurrency: u64,
    /// Seconds a pool's raised target lasts without claims before it
    /// decays back to `warm`.
    #[arg(long, default_value_t = 60, value_name = "SECS",
          value_parser = clap::value_parser!(u64).range(1..=86400))]
    pub pool_decay_sec: u64,
    /// Longest TTL (seconds) a run may ask for.
    #[arg(long, default_value_t = 86400)]
    pub max_ttl: u64,
    /// Seconds a run paused at its TTL (`onExpire: pause`) is kept before
    /// it is destroyed (default 7 days).
    #[arg(long, default_value_t = 7 * 86400, value_name = "SECS",
          value_parser = clap::value_parser!(u64).range(1..=366 * 86400))]
    pub paused_retention_sec: u64,
    /// Seconds a run hibernated at its TTL (`onExpire: hibernate`) is
    /// kept before it is destroyed (default 7 days).
    #[arg(long, default_value_t = 7 * 86400, value_name = "SECS",
          value_parser = clap::value_parser!(u64).range(1..=366 * 86400))]
    pub hibernated_retention_sec: u64,
    /// Pause a run after this many seconds nobody uses it (no exec,
    /// session, attach, connection or egress request open), unless its
    /// create says otherwise; 0 is off.
    #[arg(long, default_value_t = 0, value_name = "SECS",
          value_parser = clap::value_parser!(u64).range(0..=365 * 86400))]
    pub idle_pause_sec: u64,
    /// Hibernate a run after this many seconds nobody uses it, unless its
    /// create says otherwise; 0 is off.
    #[arg(long, default_value_t = 0, value_name = "SECS",
          value_parser = clap::value_parser!(u64).range(0..=365 * 86400))]
    pub idle_hibernate_sec: u64,
    /// What happens to a run whose init exits on its own: `cold` boots it
    /// again on its disk (at most 3 times in 10 minutes), `none` marks it
    /// failed.
    #[arg(long, value_enum, default_value_t = RestartPolicyArg::Cold)]
    pub restart_policy: RestartPolicyArg,
    /// What becomes of a run of this node, when the node is declared gone
    /// in its fleet, unless its create says otherwise (`onNodeLoss`):
    /// `restore` brings it back on another node from its latest checkpoint
    /// in the bucket the nodes share (`lost` when it has none), `lost`
    /// marks it lost. An archived run always wakes on another node.
    #[arg(long, value_enum, default_value_t = OnNodeLossArg::Restore)]
    pub on_node_loss: OnNodeLossArg,
    /// Where checkpoints go: an absolute directory [default:
    /// <state-dir>/checkpoints], or an S3-compatible bucket as
    /// `s3://bucket/prefix`, reached with the standard AWS environment
    /// (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`,
    /// `AWS_ENDPOINT_URL`, …), never credentials on the command line
    #[arg(long, value_name = "DIR|S3-URL")]
    pub checkpoint_store: Option<String>,
    /// Archive runs that have been hibernated this many seconds: their
    /// disks go to the checkpoint store and nothing stays on the node; 0 is
    /// off (runs are archived only when asked, or at their TTL with
    /// `onExpire: archive`)
    #[arg(long, default_value_t = 0, value_name = "SECS",
          value_parser = clap::value_parser!(u64).range(0..=10 * 366 * 86400))]
    pub archive_after_sec: u64,
    /// Seconds a run archived at its TTL (`onExpire: archive`) is kept
    /// before it is destroyed with its archive (default 30 days)
    #[arg(long, default_value_t = 30 * 86400, value_name = "SECS",
          value_parser = clap::value_parser!(u64).range(1..=10 * 366 * 86400))]
    pub archive_delete_after_sec: u64,
    /// Remove checkpoints this many hours old in the hourly sweep; 0 keeps
    /// them until deleted
    #[arg(long, default_value_t = 0, value_name = "HOURS",
          value_parser = clap::value_parser!(u64).range(0..=100 * 366 * 24))]
    pub checkpoint_ttl_hours: u64,
    /// Rotate the usage journal, usage.jsonl (to usage.jsonl.1), when it
    /// reaches this size
    #[arg(long, default_value_t = 64, value_name = "MIB",
          value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    pub usage_max_mb: u64,
    /// After SIGTERM or SIGINT, how long in-flight requests (exec streams
    /// among them) get to finish before the daemon stops anyway; runs keep
    /// running either way
    #[arg(long, default_value_t = 30, value_name = "SECONDS",
          value_parser = clap::value_parser!(u64).range(0..=3600))]
    pub shutdown_grace_sec: u64,
    /// Give each run a user namespace of its own, so that root in a run is
    /// an unprivileged id on the host (`on`), or let runs share the host's
    /// ids (`off`); `auto` is on where the host can do it
    #[arg(long, value_enum, default_value_t = UsernsArg::Auto, env = "RUNBOX_USERNS")]
    pub userns: UsernsArg,
    /// The host ids runs' user namespaces take, 65536 per run [default:
    /// 1879048192:268435456, 4096 runs above systemd's container range]
    #[arg(long, value_name = "START:COUNT", value_parser = parse_userns_range)]
    pub userns_range: Option<String>,
    /// The log level, in tracing's filter syntax (`info`, `debug`,
    /// `warn,runbox_core=debug`); RUNBOX_LOG wins over it [default: info]
    #[arg(long, value_name = "FILTER", value_parser = crate::logging::parse_level)]
    pub log_level: Option<String>,
    /// Largest file upload in bytes.
    #[arg(long, default_value_t = 16 << 30)]
    pub max_upload_bytes: u64,
    /// A volume's size in MiB when its create names none
    #[arg(long, value_name = "MIB", default_value_t = 10 * 1024)]
    pub volume_default_mb: u64,
    /// The largest volume a create may ask for, in MiB
    #[arg(long, value_name = "MIB", default_value_t = 1024 * 1024)]
    pub volume_max_mb: u64,
    /// A dataset of the operator's catalog: `NAME=IMAGE` (read-only),
    /// `NAME=IMAGE:rw` (writable), or a JSON object {"name", "path",
    /// "writable", "tenants"}; repeat for several (a `[[dataset]]` table
    /// each in the config file). IMAGE is a disk image holding a whole
    /// ext4 or XFS filesystem; runbox mounts it, never changes or deletes
    /// it. Fixed at start.
    #[arg(long = "dataset", value_name = "SPEC", value_parser = runbox_core::datasets::DatasetEntry::parse)]
    pub datasets: Vec<runbox_core::datasets::DatasetEntry>,
    /// A registry (`HOST[:PORT]`) that may be pulled from over plain HTTP;
    /// repeat for several. Loopback registries never need it.
    #[arg(long = "insecure-registry", value_name = "HOST[:PORT]")]
    pub insecure_registries: Vec<String>,
    #[command(flatten)]
    pub egress: crate::egress::EgressArgs,
    /// Serve preview URLs (POST /v1/runs/{id}/preview) on this address: a
    /// second HTTP listener that proxies signed, expiring URLs to ports
    /// inside runs. Anything but loopback also needs --allow-non-loopback
    #[arg(long, env = "RUNBOX_PREVIEW_LISTEN", value_name = "ADDR")]
    pub preview_listen: Option<SocketAddr>,
    /// Serve GET /metrics (Prometheus text) without a token on this address,
    /// for a scraper; the API serves it too, with the root token. Anything
    /// but loopback also needs --allow-non-loopback
    #[arg(long, env = "RUNBOX_METRICS_LISTEN", value_name = "ADDR")]
    pub metrics_listen: Option<SocketAddr>,
    /// Keep no metrics: GET /metrics answers 404 and nothing is counted
    #[arg(long, conflicts_with = "metrics_listen")]
    pub no_metrics: bool,
    /// Record no usage: nothing new is written to usage.jsonl (GET
    /// /v1/usage still sums what is there)
    #[arg(long)]
    pub no_usage: bool,
    /// Record the bytes (both ways) of each allowed egress connection of
    /// an allowlist run in usage.jsonl when it closes; `runbox usage` sums
    /// them per tenant
    #[arg(long, conflicts_with = "no_usage")]
    pub egress_usage_bytes: bool,
    /// The egress tier of image builds' runs
    #[arg(long, value_enum, default_value_t = BuildNetworkArg::Open)]
    pub build_network: BuildNetworkArg,
    /// How many cached build steps are kept; past it the oldest go
    #[arg(long, value_name = "N", default_value_t = 256)]
    pub build_cache_entries: usize,
    /// The key preview URLs are signed with, at least 32 bytes [default: a
    /// random key kept in <state-dir>/preview.key]. Changing it ends every
    /// preview URL minted before
    #[arg(
        long,
        env = "RUNBOX_PREVIEW_SECRET",
        hide_env_values = true,
        value_name = "SECRET"
    )]
    pub preview_secret: Option<String>,
    /// The base of minted preview URLs, when clients reach the preview
    /// listener by another name (a reverse proxy, a public host)
    /// [default: http://<preview-listen>]
    #[arg(
        long,
        env = "RUNBOX_PREVIEW_URL",
        value_name = "URL",
        requires = "preview_listen"
    )]
    pub preview_url: Option<String>,
    /// IPv4 network `open` runs take a /30 each from; must not overlap a
    /// network the host uses. Two daemons on one host need different pools
    /// [default: 10.231.0.0/16; a node of a fleet: a /20 of 10.224.0.0/12
    /// chosen by its node id]
    #[arg(long, env = "RUNBOX_OPEN_POOL", value_name = "CIDR")]
    pub open_pool: Option<String>,
    /// nftables table (family inet) for the `open` tier's rules; two daemons
    /// on one host need different tables [default: runbox; a node of a
    /// fleet: runbox_<node id>]
    #[arg(long, env = "RUNBOX_NFT_TABLE", value_name = "NAME")]
    pub nft_table: Option<String>,
    /// Join the fleet whose shared state is in this PostgreSQL database
    /// (postgres://user@host:port/database; the password is better given
    /// with RUNBOX_CLUSTER_DB_PASSWORD or --cluster-db-password-file).
    /// Needs --node-id, --advertise and the cluster key
    #[arg(
        long,
        env = "RUNBOX_CLUSTER_DB",
        hide_env_values = true,
        value_name = "URL",
        requires_all = ["node_id", "advertise"]
    )]
    pub cluster_db: Option<String>,
    /// A file holding the cluster database's password
    #[arg(long, value_name = "FILE", requires = "cluster_db")]
    pub cluster_db_password_file: Option<PathBuf>,
    /// This node's id in the fleet (1-32 of a-z, 0-9 and -, starting with a
    /// letter or digit); also its server id
    #[arg(
        long,
        env = "RUNBOX_NODE_ID",
        value_name = "ID",
        requires = "cluster_db"
    )]
    pub node_id: Option<String>,
    /// Where the other nodes of the fleet reach this one (host:port)
    #[arg(
        long,
        env = "RUNBOX_ADVERTISE",
        value_name = "HOST:PORT",
        requires = "cluster_db"
    )]
    pub advertise: Option<String>,
    /// Where clients may reach this node directly (an http or https
    /// origin); `GET /v1/cluster` lists it as the node's clientOrigin, and
    /// its runs' answers as their serverOrigin
    #[arg(
        long,
        env = "RUNBOX_CLIENT_ADVERTISE",
        value_name = "URL",
        requires = "cluster_db"
    )]
    pub client_advertise: Option<String>,
    /// A file holding the cluster key (at least 32 bytes), the same on every
    /// node [default: RUNBOX_CLUSTER_KEY]
    #[arg(long, value_name = "FILE", requires = "cluster_db")]
    pub cluster_key_file: Option<PathBuf>,
    /// Seconds without a heartbeat after which a node is suspect
    #[arg(long, default_value_t = 10, value_name = "SECS")]
    pub cluster_suspect_sec: u64,
    /// Seconds without a heartbeat after which a node is gone
    #[arg(long, default_value_t = 60, value_name = "SECS")]
    pub cluster_gone_sec: u64,
    /// The cell this node of a fleet belongs to: the warm-pool set PUT
    /// /v1/pools applies is the cell's, the same on every node of it
    #[arg(
        long,
        env = "RUNBOX_CELL",
        value_name = "NAME",
        requires = "cluster_db"
    )]
    pub cell: Option<String>,
    /// Destroy every run of this state directory and exit (for tests and
    /// uninstalling); does not start the API.
    #[arg(long, hide = true)]
    pub teardown: bool,
    /// A TOML file of settings: each key is a flag of this command without
    /// its dashes (`max_runs = 64`); flags and their environment variables
    /// win over it. SIGHUP reads it again
    #[arg(long, env = "RUNBOX_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
}

/// Runs the daemon until SIGINT or SIGTERM.
pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    let (args, config_table) = match args.config.clone() {
        Some(path) => {
            let table = crate::config_file::read(&path)?;
            let merged =
                crate::config_file::merge(&path, &table, &crate::config_file::command_line_args())?;
            (merged, Some(table))
        }
        None => (args, None),
    };
    if args.log_level.is_some() {
        crate::logging::set_level(args.log_level.as_deref(), "info");
    }
    let state_dir = prepare_state_dir(&args.state_dir)?;
    let _lock = lock_state_dir(&state_dir)?;
    if args.teardown {
        return teardown(&state_dir).await;
    }
    if !args.listen.ip().is_loopback() {
        if !args.allow_non_loopback {
            bail!(
                "refusing to listen on {}: the API runs commands as root in sandboxes; \
                 pass --allow-non-loopback (and put TLS in front) if you mean it",
                args.listen
            );
        }
        tracing::warn!(listen = %args.listen, "listening on a non-loopback address; anyone who can reach it and has the token controls every run");
    }
    let cluster = crate::join::options(&args)?;
    // In a fleet the secrets a client or a run holds (the root token, and
    // the run tokens and preview URLs made with keys) are the same on
    // every node: derived from the cluster key.
    let cluster_key = cluster.as_ref().map(|c| c.key.clone());
    let shared = |purpose: &str| {
        cluster_key
            .as_ref()
            .map(|key| runbox_fleet::shared_secret(key, purpose))
    };
    let token = match shared("root-token") {
        Some(token) => store_token(&state_dir.join("token"), &token)?,
        None => load_or_mint_token(&state_dir.join("token"))?,
    };
    let server_id = match (args.server_id.clone(), &cluster) {
        (Some(id), Some(cluster)) if id != cluster.node => bail!(
            "--server-id {id:?} and --node-id {:?} differ; in a cluster the node id is the server id, leave --server-id out",
            cluster.node
        ),
        (_, Some(cluster)) => cluster.node.clone(),
        (Some(id), None) => id,
        (None, None) => load_or_mint(&state_dir.join("server-id"), || {
            ulid::Ulid::new().to_string()
        })?,
    };
    let agent =
        runbox_runtime::agent_binary::locate(args.agent.as_deref()).map_err(anyhow::Error::msg)?;
    let runtime = runbox_runtime::select(args.runtime.as_deref(), &state_dir, &agent).await?;
    tracing::info!(runtime = %runtime.path.display(), agent = %agent.display(), "using runtime");
    // Joined before anything else starts: a node that cannot reach the
    // fleet's database says so and exits.
    let cluster = match cluster {
        Some(options) => Some(
            runbox_fleet::Cluster::join(
                options,
                runbox_fleet::Facts {
                    version: env!("CARGO_PKG_VERSION").to_owned(),
                    lane: runtime.name.clone(),
                    capacity: u32::try_from(args.max_runs).unwrap_or(u32::MAX),
                },
            )
            .await?,
        ),
        None => None,
    };
    // Host-wide names: a node of a fleet derives its own from its id, so
    // several nodes on one host need no flags to keep apart.
    let node = cluster.is_some().then_some(server_id.as_str());
    let open_pool = args
        .open_pool
        .clone()
        .unwrap_or_else(|| default_open_pool(node));
    let nft_table = args
        .nft_table
        .clone()
        .unwrap_or_else(|| default_nft_table(node));
    let mut options = network_options(&state_dir, Some((&open_pool, &nft_table)))?;
    let storage_gb = match (args.storage_gb, args.no_disk_limits) {
        (Some(0), _) | (None, true) => None,
        (Some(gb), _) => Some(gb),
        (None, false) => default_store_gb(&state_dir),
    };
    if let Some(gb) = storage_gb {
        let (image, runs) = (state_dir.join(STORAGE_IMAGE), state_dir.join("runs"));
        tokio::task::spawn_blocking(move || {
            runbox_runtime::storage::provision_loop(&image, gb << 30, &runs)
        })
        .await?
        .map_err(anyhow::Error::msg)
        .context("preparing the run store (--storage-gb)")?;
    }
    // Image layers and runs' layers may live on different filesystems.
    let userns_probe = || -> anyhow::Result<Result<(), String>> {
        for dir in [state_dir.join("runs"), state_dir.join("images")] {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            if let Err(why) = runbox_runtime::idmap::probe(&dir) {
                return Ok(Err(why));
            }
        }
        Ok(open_state_dir_to_runs(&state_dir))
    };
    let userns = match args.userns {
        UsernsArg::Off => false,
        UsernsArg::On => match userns_probe()? {
            Ok(()) => true,
            Err(why) => bail!(
                "runs cannot get user namespaces on this host ({why}); start with --userns off"
            ),
        },
        UsernsArg::Auto => match userns_probe()? {
            Ok(()) => true,
            Err(why) => {
                tracing::warn!(reason = %why, "runs cannot get user namespaces on this host; they share the host's (--userns on makes this an error)");
                false
            }
        },
    };
    if userns {
        let range = args.userns_range.as_deref().map_or_else(
            || {
                runbox_core::userns::IdRanges::new(
                    runbox_core::userns::DEFAULT_START,
                    runbox_core::userns::DEFAULT_COUNT,
                )
            },
            runbox_core::userns::IdRanges::parse,
        );
        let range = range.map_err(|e| anyhow::anyhow!("--userns-range: {e}"))?;
        tracing::info!(
            ranges = range.capacity(),
            "each run gets a user namespace of its own"
        );
        options.userns = Some(range);
    } else if args.userns == UsernsArg::Off {
        tracing::warn!("runs share the host's user namespace (--userns off): root in a run is root to the host kernel");
    }
    let oci = OciLane::with_options(runtime, state_dir.clone(), agent, options)?;
    if let Some(why) = oci.open_unsupported() {
        tracing::warn!(reason = %why, "the open network tier is not available on this host; such runs are refused");
    }
    let storage = oci.storage();
    match (storage.limits_unsupported(), args.no_disk_limits) {
        (None, _) => tracing::info!(storage = storage.describe(), "run storage"),
        (Some(_), true) => tracing::warn!(
            storage = storage.describe(),
            "disk limits are off (--no-disk-limits): a run can fill the disk holding the state directory"
        ),
        (Some(why), false) => tracing::warn!(
            storage = storage.describe(),
            reason = %why,
            "runs cannot get disk limits here, so creates are refused"
        ),
    }
    let lane: Arc<dyn Lane> = Arc::new(oci);

    let mut config = Config::new(server_id);
    config.max_limits.disk_mb = (!args.no_disk_limits).then_some(args.max_disk_mb);
    let mut config = live_settings(&config, &args);
    config.client_origin = args.client_advertise.clone();
    config.joins_fleet = cluster.is_some();
    config.datasets = args.datasets.clone();
    config.warm_cache = warm_cache_config(&args, &state_dir)?;
    let checkpoint_store = match &args.checkpoint_store {
        Some(location) => location.clone(),
        None => state_dir.join("checkpoints").display().to_string(),
    };
    let checkpoints = runbox_core::checkpoints::CheckpointStore::open(&checkpoint_store)
        .map_err(|e| anyhow::anyhow!("--checkpoint-store: {e}"))?;
    tracing::info!(store = checkpoints.location(), "checkpoint store");
    config.checkpoints = Some(std::sync::Arc::new(checkpoints));
    config.egress_usage_bytes = args.egress_usage_bytes;
    let pools_file = state_dir.join(POOLS_FILE);
    config.pools = load_pools(args.pools.as_deref(), &pools_file)?;
    config.pools_file = Some(pools_file);
    config.pool_decay = Duration::from_secs(args.pool_decay_sec);
    config.refill_concurrency = args.refill_concurrency as usize;
    // Bound before the manager starts: the egress proxy must know the API's
    // real address to refuse it, and re-adopted runs get their proxies at once.
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("listening on {}", args.listen))?;
    let bound = listener.local_addr()?;
    let metrics_listener = match args.metrics_listen {
        Some(addr) => {
            if !addr.ip().is_loopback() && !args.allow_non_loopback {
                bail!(
                    "refusing to serve metrics without a token on {addr}; pass \
                     --allow-non-loopback if you mean it"
                );
            }
            Some(
                tokio::net::TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("listening for metrics on {addr}"))?,
            )
        }
        None => None,
    };
    let preview_listener = match args.preview_listen {
        Some(addr) => {
            if !addr.ip().is_loopback() && !args.allow_non_loopback {
                bail!(
                    "refusing to serve previews on {addr}: anyone with a preview URL reaches a \
                     run's port; pass --allow-non-loopback (and put TLS in front) if you mean it"
                );
            }
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("listening for previews on {addr}"))?;
            let key = match (&args.preview_secret, shared("preview-key")) {
                (Some(secret), _) => runbox_core::preview::PreviewKey::from_secret(secret)
                    .map_err(anyhow::Error::msg)
                    .context("--preview-secret")?,
                (None, Some(fleet)) => runbox_core::preview::PreviewKey::from_secret(&fleet)
                    .map_err(anyhow::Error::msg)?,
                (None, None) => {
                    runbox_core::preview::PreviewKey::load_or_create(&state_dir.join("preview.key"))
                        .context("the preview key (<state-dir>/preview.key)")?
                }
            };
            let base_url = match &args.preview_url {
                Some(url) => preview_base(url)?,
                None => format!("http://{}", listener.local_addr()?),
            };
            config.preview = Some(runbox_core::config::PreviewConfig { key, base_url });
            Some(listener)
        }
        None => None,
    };
    // On a node of a fleet the interception CA is the fleet's: made here
    // first (as alone), then shared through the cluster database.
    if let (Some(cluster), Some(key)) = (&cluster, shared("interception-ca")) {
        let dir = state_dir.join("ca");
        runbox_proxy::tls::Authority::load_or_create(&dir)
            .context("loading or creating the interception CA")?;
        let sealer = runbox_core::sealed::KeyFileSealer::from_key(key.as_bytes());
        cluster.share_authority(&dir, &sealer).await?;
    }
    let egress = args.egress.build(&state_dir, bound)?;
    config.egress = Some(egress.config.clone());
    // The key that seals the values of secrets callers bring; see
    // runbox_core::sealed.
    let key_file = state_dir.join("secrets.key");
    let sealer: Arc<dyn runbox_core::sealed::Sealer> = match shared("sealing-key") {
        // The fleet's key seals; the node's own, if it sealed values before
        // it joined, still opens them.
        Some(fleet) => {
            use runbox_core::sealed::{KeyFileSealer, Keyring};
            let older = match key_file.exists() {
                true => vec![KeyFileSealer::open_or_create(&key_file)
                    .map_err(|e| anyhow::anyhow!("the secret sealing key: {e}"))?],
                false => Vec::new(),
            };
            Arc::new(Keyring::new(
                KeyFileSealer::from_key(fleet.as_bytes()),
                older,
            ))
        }
        None => Arc::new(
            runbox_core::sealed::KeyFileSealer::open_or_create(&key_file)
                .map_err(|e| anyhow::anyhow!("the secret sealing key: {e}"))?,
        ),
    };
    config.sealer = Some(sealer);
    let store = Store::open(&state_dir.join("runbox.db"))?;
    let images = ImageStore::open(state_dir.join("images"), config.max_image_bytes)?;
    if userns {
        keep_state_private(&state_dir)?;
    }
    let tenants = runbox_core::tenants::FileTenants::open(state_dir.join("tenants.json"))?;
    // In a fleet the tenant set is the fleet's (the node's own tenants from
    // before it joined are added to it).
    let tenants: Arc<dyn runbox_core::tenants::TenantStore> = match &cluster {
        Some(cluster) => {
            let local = runbox_core::tenants::TenantStore::list(&tenants);
            let fleet = cluster.tenants(&local).await?;
            // The fleet's set is the one from now on: the node's file is
            // kept aside, never read again (a later start would offer its
            // stale tokens to the fleet).
            let file = state_dir.join("tenants.json");
            if file.exists() {
                let aside = state_dir.join("tenants.json.joined");
                std::fs::rename(&file, &aside)
                    .with_context(|| format!("moving {} to {}", file.display(), aside.display()))?;
                tracing::info!(file = %aside.display(), "this node's tenants are the fleet's now; its own file is kept aside");
            }
            fleet
        }
        None => Arc::new(tenants),
    };
    tracing::info!(tenants = tenants.list().len(), "tenant set loaded");
    let usage: Arc<dyn runbox_core::accounting::UsageSink> = if args.no_usage {
        tracing::info!("usage accounting is off (--no-usage)");
        Arc::new(runbox_core::accounting::NoUsage)
    } else {
        Arc::new(
            runbox_core::accounting::UsageJournal::open(
                state_dir.join("usage.jsonl"),
                args.usage_max_mb << 20,
            )
            .context("opening usage.jsonl")?
            .for_node(cluster.as_ref().map(|_| config.server_id.clone())),
        )
    };
    let manager = Manager::start(config, lane, store, images, tenants, usage.clone()).await?;

    if let (Some(cluster), Some(cell)) = (&cluster, &args.cell) {
        let pools = cluster.cell_pools(cell);
        // The cell's set, once one was applied, stands over the node's own
        // (--pools, pools.json) from the start.
        match pools.current().await {
            Ok(Some(set)) => {
                tracing::info!(cell = %cell, pools = set.pools.len(), "using the cell's warm pools");
                manager.apply_cell_pools(set);
            }
            Ok(None) => {}
            Err(e) => bail!("reading cell {cell:?}'s warm pools: {e}"),
        }
        manager.set_cell_pools(pools.clone());
        let node = manager.clone();
        pools.follow(Arc::new(move |set| node.apply_cell_pools(set)));
    }
    if let Some(cluster) = &cluster {
        manager.set_fleet(cluster.clone());
        if let Err(e) = manager.check_ownership().await {
            if e.code() != runbox_types::ErrorCode::ClusterUnavailable {
                bail!("{e}");
            }
        }
        // Before it serves: a run that moved to another node while this
        // one was away is that node's, and ends here.
        match manager.fence().await {
            Ok(0) => {}
            Ok(n) => tracing::info!(
                runs = n,
                "ended this node's copies of runs other nodes hold now"
            ),
            Err(e) => {
                tracing::warn!(error = %e, "could not ask the fleet which runs moved away; asking again in the background")
            }
        }
        manager.spawn_fence();
        manager.spawn_node_loss();
        // Volume moves a crash or an outage left unsettled: before it
        // serves when the database answers, else in the background.
        manager.settle_volume_moves().await;
        manager.spawn_volume_settle();
        let node = manager.clone();
        cluster.spawn_heartbeat(Arc::new(move || {
            let info = node.info();
            let mut images = Vec::new();
            for image in runbox_core::RunService::list_images(&node).unwrap_or_default() {
                images.push(image.name);
                if !image.source.is_empty() {
                    images.push(image.source);
                }
            }
            images.sort();
            images.dedup();
            let pooled = runbox_core::RunService::pools(&node)
                .pools
                .into_iter()
                .filter(|p| p.ready > 0)
                .map(|p| p.image)
                .collect();
            let volumes = node.volumes_held();
            runbox_fleet::Load {
                volumes,
                capabilities: node.capabilities(),
                checkpoint_store: node
                    .config()
                    .checkpoints
                    .as_ref()
                    .map(|s| s.location().to_owned())
                    .filter(|l| l.starts_with("s3://")),
                runs: u32::try_from(info.capacity.live).unwrap_or(u32::MAX),
                pools_ready: u32::try_from(info.capacity.pooled).unwrap_or(u32::MAX),
                draining: info.draining,
                images,
                pooled,
            }
        }));
    }
    let shutdown = CancellationToken::new();
    // Tests and scripts that ask for port 0 read the real address here.
    // Written then renamed, so a reader never sees a half-written file.
    let tmp = state_dir.join("serve.addr.tmp");
    std::fs::write(&tmp, bound.to_string()).context("writing serve.addr")?;
    std::fs::rename(&tmp, state_dir.join("serve.addr")).context("writing serve.addr")?;
    tracing::info!(listen = %bound, state_dir = %state_dir.display(), runs = manager.list().len(), "runbox is serving");
    // Under systemd (Type=notify): ready once the API answers. Elsewhere
    // NOTIFY_SOCKET is unset and this does nothing.
    if let Err(e) = sd_notify::notify(&[sd_notify::NotifyState::Ready]) {
        tracing::warn!(error = %e, "could not tell systemd the daemon is ready");
    }
    if let Some(listener) = preview_listener {
        let addr = listener.local_addr()?;
        let tmp = state_dir.join("preview.addr.tmp");
        std::fs::write(&tmp, addr.to_string()).context("writing preview.addr")?;
        std::fs::rename(&tmp, state_dir.join("preview.addr")).context("writing preview.addr")?;
        tracing::info!(listen = %addr, "serving preview URLs");
        let router = runbox_server::preview_router(runbox_server::PreviewState {
            service: manager.clone(),
            audit: Some(egress.audit.clone()),
        });
        let stop = shutdown.clone();
        tokio::spawn(async move {
            let stopped = async move { stop.cancelled().await };
            if let Err(e) = runbox_server::serve_preview(listener, router, stopped).await {
                tracing::error!(error = %e, "the preview listener failed");
            }
        });
    }
    let reload = match (args.config.clone(), config_table) {
        (Some(path), Some(table)) => {
            let reloader = config_reloader(
                path,
                table,
                egress.audit.clone(),
                manager.clone(),
                egress.config.clone(),
            );
            // SIGHUP reads the file again, as POST /v1/config/reload does.
            let on_hup = reloader.clone();
            tokio::spawn(async move {
                use tokio::signal::unix::{signal, SignalKind};
                let Ok(mut hup) = signal(SignalKind::hangup()) else {
                    return;
                };
                while hup.recv().await.is_some() {
                    let reload = on_hup.clone();
                    let _ = tokio::task::spawn_blocking(move || reload()).await;
                }
            });
            Some(reloader)
        }
        _ => None,
    };
    let metrics = if args.no_metrics {
        tracing::info!("metrics are off (--no-metrics)");
        Arc::new(runbox_server::metrics::Metrics::off())
    } else {
        let metrics = Arc::new(runbox_server::metrics::Metrics::new());
        manager.set_telemetry(metrics.clone());
        let counted = metrics.clone();
        egress
            .audit
            .observe(Box::new(move |record| counted.count_audit(record)));
        metrics
    };
    let state = runbox_server::AppState {
        service: manager,
        token: token.into(),
        audit: Some(egress.audit),
        reload,
        metrics,
    };
    if let Some(listener) = metrics_listener {
        let addr = listener.local_addr()?;
        let tmp = state_dir.join("metrics.addr.tmp");
        std::fs::write(&tmp, addr.to_string()).context("writing metrics.addr")?;
        std::fs::rename(&tmp, state_dir.join("metrics.addr")).context("writing metrics.addr")?;
        tracing::info!(listen = %addr, "serving metrics without a token");
        let router = runbox_server::metrics::metrics_router(state.clone());
        let stop = shutdown.clone();
        tokio::spawn(async move {
            let stopped = async move { stop.cancelled().await };
            if let Err(e) = runbox_server::serve(listener, router, stopped).await {
                tracing::error!(error = %e, "the metrics listener failed");
            }
        });
    }
    let router = runbox_server::router(state);
    let stop = shutdown.clone();
    let server = runbox_server::serve(listener, router, async move {
        wait_for_signal().await;
        let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
        tracing::info!("shutting down; runs keep running and are re-adopted at the next start");
        stop.cancel();
    });
    // Graceful shutdown stops accepting and waits for open connections,
    // and an exec stream can stay open for as long as its command runs.
    // Give them the grace period, then stop anyway: the commands live on
    // in their runs.
    let grace_period = Duration::from_secs(args.shutdown_grace_sec);
    let grace = async {
        shutdown.cancelled().await;
        tokio::time::sleep(grace_period).await;
    };
    tokio::select! {
        served = server => served?,
        () = grace => tracing::warn!("open streams did not finish within {grace_period:?}; stopping anyway"),
    }
    shutdown.cancel();
    if let Some(cluster) = cluster {
        cluster.leave().await;
    }
    // What is still in the usage journal's batch reaches the disk.
    let _ = tokio::task::spawn_blocking(move || usage.flush()).await;
    Ok(())
}

/// Lets the runtime, which sets a run up from inside the run's user
/// namespace (as an id that is nobody on the host), walk from `/` to the
/// run's directory: every directory down to `<state-dir>/runs` must let
/// others through (`o+x`, no listing). The state directory and the run
/// store are given that; what else lies in the state directory is kept
/// to its owner (the image store, the checkpoints, the database) or was
/// already (the token, keys, journals). A directory above the state
/// directory that does not let others through is the reason returned.
fn open_state_dir_to_runs(state_dir: &Path) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    let runs = state_dir.join("runs");
    for dir in state_dir.ancestors().skip(1) {
        let mode = std::fs::metadata(dir)
            .map_err(|e| format!("reading {}: {e}", dir.display()))?
            .permissions()
            .mode();
        if mode & 0o001 == 0 {
            return Err(format!(
                "{} does not let other users through (mode {:o}), so a run's root cannot reach                  its files under {}; move the state directory or chmod o+x {}",
                dir.display(),
                mode & 0o7777,
                state_dir.display(),
                dir.display()
            ));
        }
    }
    for dir in [state_dir, runs.as_path()] {
        let mode = std::fs::metadata(dir)
            .map_err(|e| format!("reading {}: {e}", dir.display()))?
            .permissions()
            .mode();
        if mode & 0o001 == 0 {
            set_mode(dir, (mode & 0o7777) | 0o001)?;
        }
    }
    Ok(())
}

/// Sets `path`'s mode; nothing to do when it does not exist.
fn set_mode(path: &Path, mode: u32) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    match std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(format!("setting the mode of {}: {e}", path.display())),
    }
}

/// With the state directory open to runs' roots ([`open_state_dir_to_runs`]),
/// what in it is the daemon's alone stays so: the image store, the default
/// checkpoint store and the database.
fn keep_state_private(state_dir: &Path) -> anyhow::Result<()> {
    for (name, mode) in [
        ("images", 0o700),
        ("checkpoints", 0o700),
        ("runbox.db", 0o600),
    ] {
        set_mode(&state_dir.join(name), mode).map_err(anyhow::Error::msg)?;
    }
    Ok(())
}

/// `--preview-url` checked: http or https, no query, no trailing slash.
fn preview_base(url: &str) -> anyhow::Result<String> {
    let trimmed = url.trim_end_matches('/');
    let ok = (trimmed.starts_with("http://") || trimmed.starts_with("https://"))
        && !trimmed.contains(['?', '#', ' '])
        && trimmed
            .split("://")
            .nth(1)
            .is_some_and(|rest| !rest.is_empty());
    if !ok {
        bail!("--preview-url {url:?} must be an http:// or https:// URL without a query");
    }
    Ok(trimmed.to_owned())
}

/// The pool set at start: `<state-dir>/pools.json` once a PUT wrote it,
/// else `--pools`, else none.
fn load_pools(flag: Option<&Path>, persisted: &Path) -> anyhow::Result<runbox_types::PoolSet> {
    let read = |path: &Path| -> anyhow::Result<runbox_types::PoolSet> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the pools file {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("{} is not a pool set", path.display()))
    };
    if persisted.exists() {
        if let Some(flag) = flag {
            tracing::info!(persisted = %persisted.display(), ignored = %flag.display(),
                "using the pools set by PUT /v1/pools; delete pools.json to go back to --pools");
        }
        return read(persisted);
    }
    match flag {
        Some(path) => read(path),
        None => Ok(runbox_types::PoolSet::default()),
    }
}

/// The warm cache's settings from the flags; None when it is off.
fn warm_cache_config(
    args: &ServeArgs,
    state_dir: &Path,
) -> anyhow::Result<Option<runbox_core::config::WarmCacheConfig>> {
    let root = match &args.cache_root {
        Some(root) if root.is_empty() => {
            tracing::info!("the warm repo cache is off (--cache-root \"\")");
            return Ok(None);
        }
        Some(root) => PathBuf::from(root),
        None => state_dir
            .join("runs")
            .join(runbox_runtime::storage::WARM_CACHE_DIR),
    };
    let text = root.to_string_lossy();
    // Templates are overlay lower layers, whose paths overlayfs options
    // cannot quote.
    if !root.is_absolute() || text.contains([',', ':', '\\']) {
        bail!(
            "--cache-root {} must be an absolute path without ',', ':' or '\\'",
            root.display()
        );
    }
    if !args.cache_max_gb.is_finite() || args.cache_max_gb < 0.0 {
        bail!("--cache-max-gb must be a number of GiB, 0 or more");
    }
    Ok(Some(runbox_core::config::WarmCacheConfig {
        root,
        max_bytes: (args.cache_max_gb * (1u64 << 30) as f64) as u64,
        tick: Duration::from_secs(args.cache_tick_sec),
    }))
}

/// Largest run store made by default, in GiB.
const DEFAULT_STORE_MAX_GB: u64 = 100;

/// The size of the run store a daemon started without `--storage-gb` (or
/// `--no-disk-limits`) uses: the one under the state directory if there is
/// one; else, when the state directory's filesystem cannot limit a run's
/// disk (ext4, xfs, tmpfs: the common case), a new one of four fifths of
/// the free space, at most [`DEFAULT_STORE_MAX_GB`]; None to use the state
/// directory as it is (btrfs with quotas on, or no room for a store).
fn default_store_gb(state_dir: &Path) -> Option<u64> {
    let image = state_dir.join(STORAGE_IMAGE);
    if let Ok(meta) = std::fs::metadata(&image) {
        return Some(meta.len().div_ceil(1 << 30).max(1));
    }
    let runs = state_dir.join("runs");
    let probe = if runs.is_dir() { &runs } else { state_dir };
    let storage = runbox_runtime::storage::RunStorage::detect(probe);
    // A filesystem that can limit (btrfs with quotas) is used as it is.
    storage.limits_unsupported()?;
    // Runs of a daemon that had no store stay where they are.
    if std::fs::read_dir(&runs).is_ok_and(|mut d| d.next().is_some()) {
        return None;
    }
    let free = rustix::fs::statvfs(state_dir)
        .map(|st| st.f_bavail.saturating_mul(st.f_frsize))
        .unwrap_or(0);
    let gb = (free / 5 * 4) >> 30;
    if gb < 2 {
        tracing::warn!(
            state_dir = %state_dir.display(),
            free_bytes = free,
            "too little free space for a run store of its own; runs cannot get disk limits"
        );
        return None;
    }
    let gb = gb.min(DEFAULT_STORE_MAX_GB);
    tracing::info!(
        image = %image.display(),
        size_gb = gb,
        "making a run store of its own (a sparse btrfs image) so that runs get disk limits; \
         --storage-gb N sets its size, --no-disk-limits goes without"
    );
    Some(gb)
}

/// The config file's keys (`_` spelling) a reload puts in force at once;
/// every other key waits for a restart. They are the settings
/// [`live_settings`] makes, plus `log_level`. What they govern is read
/// when it is used: a new maximum bounds the next create or renew, a new
/// retention the next expiry, a new idle default the next create (a run
/// keeps the idle policy it was made with).
pub const LIVE_KEYS: &[&str] = &[
    "archive_after_sec",
    "archive_delete_after_sec",
    "build_cache_entries",
    "build_network",
    "checkpoint_ttl_hours",
    "egress_class",
    "hibernated_retention_sec",
    "history_keep",
    "idle_hibernate_sec",
    "idle_pause_sec",
    "insecure_registry",
    "log_level",
    "max_cpus",
    "max_disk_mb",
    "max_fork_count",
    "max_history",
    "max_memory_mb",
    "max_pids",
    "max_runs",
    "max_ttl",
    "max_upload_bytes",
    "paused_retention_sec",
    "on_node_loss",
    "restart_policy",
    "volume_default_mb",
    "volume_max_mb",
];

/// `current` with the settings a reload may change taken from `args`
/// (also how the start sets them, so the two never disagree). Whether
/// runs have disk limits at all (`--no-disk-limits`) is fixed at start:
/// only the size of the limit follows `max_disk_mb`.
fn live_settings(current: &Config, args: &ServeArgs) -> Config {
    let mut config = current.clone();
    config.max_runs = args.max_runs;
    config.max_fork_count = args.max_fork_count as usize;
    config.history_keep = args.history_keep;
    config.max_history = args.max_history;
    config.max_limits = runbox_types::Limits {
        cpus: args.max_cpus,
        memory_mb: args.max_memory_mb,
        pids: args.max_pids,
        disk_mb: current.max_limits.disk_mb.map(|_| args.max_disk_mb),
    };
    // Defaults never exceed the maxima, so a create without limits always
    // fits; they are the built-in ones, lowered to the maxima.
    let defaults = Config::new(String::new());
    config.default_limits = runbox_types::Limits {
        cpus: defaults.default_limits.cpus.min(args.max_cpus),
        memory_mb: defaults.default_limits.memory_mb.min(args.max_memory_mb),
        pids: defaults.default_limits.pids.min(args.max_pids),
        disk_mb: defaults
            .default_limits
            .disk_mb
            .zip(config.max_limits.disk_mb)
            .map(|(d, m)| d.min(m)),
    };
    config.max_ttl = Duration::from_secs(args.max_ttl);
    config.default_ttl = defaults.default_ttl.min(config.max_ttl);
    config.paused_retention = Duration::from_secs(args.paused_retention_sec);
    config.hibernated_retention = Duration::from_secs(args.hibernated_retention_sec);
    config.idle = runbox_types::IdlePolicy {
        pause_after_sec: (args.idle_pause_sec > 0).then_some(args.idle_pause_sec),
        hibernate_after_sec: (args.idle_hibernate_sec > 0).then_some(args.idle_hibernate_sec),
    };
    config.on_node_loss = match args.on_node_loss {
        OnNodeLossArg::Restore => runbox_types::OnNodeLoss::Restore,
        OnNodeLossArg::Lost => runbox_types::OnNodeLoss::Lost,
    };
    config.restart_policy = match args.restart_policy {
        RestartPolicyArg::Cold => runbox_core::config::RestartPolicy::Cold,
        RestartPolicyArg::None => runbox_core::config::RestartPolicy::None,
    };
    config.max_upload_bytes = args.max_upload_bytes;
    config.build_network = match args.build_network {
        BuildNetworkArg::None => runbox_types::NetworkTier::None,
        BuildNetworkArg::Allowlist => runbox_types::NetworkTier::Allowlist,
        BuildNetworkArg::Open => runbox_types::NetworkTier::Open,
    };
    config.build_cache_entries = args.build_cache_entries;
    config.volume_default_mb = args.volume_default_mb;
    config.volume_max_mb = args.volume_max_mb;
    config.insecure_registries = args.insecure_registries.clone();
    config.archive_after =
        (args.archive_after_sec > 0).then(|| Duration::from_secs(args.archive_after_sec));
    config.archive_retention = Duration::from_secs(args.archive_delete_after_sec);
    config.checkpoint_ttl = (args.checkpoint_ttl_hours > 0)
        .then(|| Duration::from_secs(args.checkpoint_ttl_hours * 3600));
    config
}

/// Reads config file `path` again, checked with the start's own code,
/// against the settings in force (first the file as the daemon started
/// with it): a bad file changes nothing and says why. A good one puts the
/// changed [`LIVE_KEYS`] in force in one swap, and reports (and audits)
/// what changed, what was applied, what waits for a restart and what a
/// flag or environment variable overrides. Egress classes go to the
/// node's proxy, which live runs read at their next request.
fn config_reloader(
    path: PathBuf,
    running: crate::config_file::Table,
    audit: Arc<runbox_proxy::audit::AuditLog>,
    manager: Arc<Manager>,
    egress: Arc<crate::egress::NodeProxy>,
) -> runbox_server::Reloader {
    let cli = crate::config_file::command_line_args();
    let running = std::sync::Mutex::new(crate::config_file::normalized(&running));
    Arc::new(move || {
        let _ = sd_notify::notify(&[sd_notify::NotifyState::Reloading]);
        let checked = crate::config_file::read(&path).and_then(|table| {
            crate::config_file::merge(&path, &table, &cli).map(|args| (table, args))
        });
        let (table, args) = match checked {
            Ok(checked) => checked,
            Err(e) => {
                let _ = sd_notify::notify(&[sd_notify::NotifyState::Ready]);
                let why = format!("{e:#}");
                tracing::error!(error = %why, "the config file was not reloaded; nothing changed");
                return Err(why);
            }
        };
        let table = crate::config_file::normalized(&table);
        // One reload at a time: SIGHUP and the API may race.
        let mut running = running.lock().unwrap_or_else(|p| p.into_inner());
        let changed = crate::config_file::changed_keys(&running, &table);
        let overridden = crate::config_file::overridden_keys(&table, &cli);
        let mut report = runbox_types::ConfigReload {
            changed: changed.clone(),
            ..Default::default()
        };
        for key in changed {
            if overridden.contains(&key) {
                report.overridden.push(key);
            } else if LIVE_KEYS.contains(&key.as_str()) {
                report.applied.push(key);
            } else {
                report.restart_required.push(key);
            }
        }
        if report.applied.iter().any(|k| k == "egress_class") {
            // Checked when the file was parsed; only a name given twice is
            // left, and then nothing changes.
            if let Err(e) = egress.set_classes(&args.egress.egress_classes) {
                let _ = sd_notify::notify(&[sd_notify::NotifyState::Ready]);
                let why = format!("{e:#}");
                tracing::error!(error = %why, "the config file was not reloaded; nothing changed");
                return Err(why);
            }
        }
        if !report.applied.is_empty() {
            manager.reconfigure(|current| live_settings(current, &args));
            crate::logging::set_level(args.log_level.as_deref(), "info");
            for key in &report.applied {
                match table.get(key) {
                    Some(value) => running.insert(key.clone(), value.clone()),
                    None => running.remove(key),
                };
            }
        }
        let _ = sd_notify::notify(&[sd_notify::NotifyState::Ready]);
        if report.changed.is_empty() {
            tracing::info!(config = %path.display(), "config reloaded: nothing changed");
        }
        if !report.applied.is_empty() {
            tracing::info!(config = %path.display(), keys = ?report.applied, "config reloaded: these settings are in force");
        }
        if !report.restart_required.is_empty() {
            tracing::warn!(config = %path.display(), keys = ?report.restart_required, "config reloaded: these settings change only at a restart");
        }
        if !report.overridden.is_empty() {
            tracing::warn!(config = %path.display(), keys = ?report.overridden, "config reloaded: a flag or environment variable overrides these keys");
        }
        audit.append(&runbox_proxy::audit::AuditRecord::ConfigReload {
            t: runbox_proxy::audit::now(),
            changed: report.changed.clone(),
            applied: report.applied.clone(),
            restart_required: report.restart_required.clone(),
            overridden: report.overridden.clone(),
        });
        Ok(report)
    })
}

async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        // Without signal handlers the daemon can still be stopped by kill -9.
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

fn prepare_state_dir(dir: &Path) -> anyhow::Result<PathBuf> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("creating the state directory {}", dir.display()))?;
    let dir = dir
        .canonicalize()
        .with_context(|| format!("resolving {}", dir.display()))?;
    Ok(dir)
}

/// Holds an exclusive lock on the state directory for the daemon's lifetime:
/// two daemons on one directory would destroy each other's runs.
fn lock_state_dir(dir: &Path) -> anyhow::Result<std::fs::File> {
    let path = dir.join("lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive).map_err(
        |_| {
            anyhow::anyhow!(
                "another runbox daemon is using {}; stop it first or pick another --state-dir",
                dir.display()
            )
        },
    )?;
    Ok(file)
}

/// Reads the token file, or mints a random token into it (mode 0600).
/// Keeps `token` (the fleet's root token) in `path`, where the CLI on this
/// host reads it, replacing what was there; the token.
fn store_token(path: &Path, token: &str) -> anyhow::Result<String> {
    match std::fs::read_to_string(path) {
        Ok(existing) if existing.trim() == token => return Ok(token.to_owned()),
        Ok(_) => tracing::info!(
            path = %path.display(),
            "the root token is now the fleet's (derived from the cluster key), the same on every node"
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    }
    let tmp = path.with_extension("tmp");
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(|| format!("creating {}", tmp.display()))?;
    writeln!(file, "{token}").with_context(|| format!("writing {}", tmp.display()))?;
    file.sync_all()
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))?;
    Ok(token.to_owned())
}

fn load_or_mint_token(path: &Path) -> anyhow::Result<String> {
    load_or_mint(path, || {
        let mut bytes = [0u8; 32];
        rand::fill(&mut bytes);
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    })
}

fn load_or_mint(path: &Path, mint: impl FnOnce() -> String) -> anyhow::Result<String> {
    match std::fs::read_to_string(path) {
        Ok(existing) if !existing.trim().is_empty() => return Ok(existing.trim().to_owned()),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    }
    let value = mint();
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    writeln!(file, "{value}").with_context(|| format!("writing {}", path.display()))?;
    Ok(value)
}

/// The open tier's pool when `--open-pool` is not given: a node of a fleet
/// takes a /20 of 10.224.0.0/12 chosen by a hash of its id (256 of them:
/// nodes sharing a host should still check theirs differ, or give the
/// flag), any other daemon 10.231.0.0/16.
fn default_open_pool(node: Option<&str>) -> String {
    match node {
        Some(node) => {
            // FNV-1a: a hash that stays the same across builds and
            // releases, which std's hasher does not promise.
            let hash = node.bytes().fold(0x811c_9dc5_u32, |h, b| {
                (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
            });
            let slot = (hash % 256) as u8;
            format!("10.{}.{}.0/20", 224 + slot / 16, (slot % 16) * 16)
        }
        None => "10.231.0.0/16".to_owned(),
    }
}

/// The open tier's nftables table when `--nft-table` is not given:
/// `runbox`, or `runbox_<node id>` for a node of a fleet (a node id's `-`
/// as `_`).
fn default_nft_table(node: Option<&str>) -> String {
    match node {
        Some(node) => format!("runbox_{}", node.replace('-', "_")),
        None => "runbox".to_owned(),
    }
}

/// The open tier's pool and nftables table. `given` (from the flags) is
/// recorded in `<state-dir>/network.json`; without it (teardown) the
/// recorded values are used, so a teardown sweeps exactly what this state
/// directory's daemon made.
fn network_options(
    state_dir: &Path,
    given: Option<(&str, &str)>,
) -> anyhow::Result<runbox_runtime::OciOptions> {
    #[derive(serde::Serialize, serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Recorded {
        open_pool: String,
        nft_table: String,
    }
    let path = state_dir.join("network.json");
    let recorded = match given {
        Some((pool, table)) => {
            let recorded = Recorded {
                open_pool: pool.to_owned(),
                nft_table: table.to_owned(),
            };
            let tmp = state_dir.join("network.json.tmp");
            std::fs::write(&tmp, serde_json::to_vec(&recorded)?).context("writing network.json")?;
            std::fs::rename(&tmp, &path).context("writing network.json")?;
            recorded
        }
        None => match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).context("reading network.json")?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let defaults = runbox_runtime::OciOptions::default();
                return Ok(defaults);
            }
            Err(e) => return Err(e).context("reading network.json"),
        },
    };
    let open_pool = recorded
        .open_pool
        .parse()
        .map_err(|e| anyhow::anyhow!("--open-pool {:?}: {e}", recorded.open_pool))?;
    Ok(runbox_runtime::OciOptions {
        open_pool,
        nft_table: recorded.nft_table,
        userns: None,
    })
}

/// Destroys every run recorded in or left behind under `state_dir`.
async fn teardown(state_dir: &Path) -> anyhow::Result<()> {
    let runtime = ["crun", "runc", "runsc"]
        .iter()
        .find_map(|name| runbox_runtime::Runtime::find(name))
        .context("no OCI runtime installed to tear runs down with")?;
    // The agent path is not used to destroy anything; the network options
    // are the ones the daemon of this state directory recorded, so teardown
    // never touches another daemon's table.
    let lane = OciLane::with_options(
        runtime,
        state_dir.to_path_buf(),
        PathBuf::from("/nonexistent-agent"),
        network_options(state_dir, None)?,
    )?;
    let db = state_dir.join("runbox.db");
    let mut ids = std::collections::HashSet::new();
    if db.exists() {
        let store = Store::open(&db)?;
        for record in store.list()? {
            lane.sandbox(record.id)
                .destroy()
                .await
                .with_context(|| format!("destroying run {}", record.id))?;
            store.delete(record.id)?;
            ids.insert(record.id);
        }
    }
    let swept = lane.sweep(&std::collections::HashSet::new()).await?;
    ids.extend(swept);
    // The store goes last: every run's files were in it.
    if state_dir.join(STORAGE_IMAGE).exists() {
        runbox_runtime::storage::release_loop(&state_dir.join("runs"))
            .map_err(anyhow::Error::msg)?;
    }
    println!("destroyed {} run(s)", ids.len());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fleet_node_derives_its_own_host_wide_names() {
        assert_eq!(default_nft_table(None), "runbox");
        assert_eq!(default_open_pool(None), "10.231.0.0/16");
        assert_eq!(default_nft_table(Some("node-1")), "runbox_node_1");
        let pools: std::collections::HashSet<String> = ["n1", "n2", "n3"]
            .iter()
            .map(|n| default_open_pool(Some(n)))
            .collect();
        assert_eq!(pools.len(), 3, "{pools:?}");
        for pool in &pools {
            let parsed: Result<runbox_runtime::OpenPool, _> = pool.parse();
            assert!(parsed.is_ok(), "{pool}");
            let second: u8 = pool.split('.').nth(1).unwrap().parse().unwrap();
            assert!(
                pool.starts_with("10.") && (224..240).contains(&second),
                "{pool}"
            );
            assert!(pool.ends_with("/20"), "{pool}");
        }
        // Stable: the same id, the same pool, on every build.
        assert_eq!(default_open_pool(Some("n1")), default_open_pool(Some("n1")));
    }
    use clap::{Args, FromArgMatches};

    fn args(cli: &[&str]) -> ServeArgs {
        let cmd = ServeArgs::augment_args(clap::Command::new("serve").no_binary_name(true));
        ServeArgs::from_arg_matches(&cmd.try_get_matches_from(cli).unwrap()).unwrap()
    }

    #[test]
    fn every_live_key_is_a_flag() {
        let cmd = ServeArgs::augment_args(clap::Command::new("serve"));
        for key in LIVE_KEYS {
            let flag = key.replace('_', "-");
            assert!(
                cmd.get_arguments()
                    .any(|a| a.get_long() == Some(flag.as_str())),
                "{key} is no flag"
            );
        }
    }

    #[test]
    fn live_settings_lower_defaults_to_maxima_and_keep_the_disk_limit_mode() {
        let start = live_settings(&Config::new(String::from("n")), &args(&[]));
        let lowered = live_settings(
            &start,
            &args(&[
                "--max-cpus",
                "0.5",
                "--max-memory-mb",
                "64",
                "--max-ttl",
                "30",
            ]),
        );
        assert_eq!(lowered.default_limits.cpus, 0.5);
        assert_eq!(lowered.default_limits.memory_mb, 64);
        assert_eq!(lowered.default_ttl, Duration::from_secs(30));
        assert_eq!(lowered.server_id, "n");
        // Raised again, the defaults go back to the built-in ones.
        let raised = live_settings(&lowered, &args(&[]));
        assert_eq!(raised.default_limits, start.default_limits);
        assert_eq!(raised.default_ttl, start.default_ttl);
        // A daemon without disk limits does not get them from a reload.
        let mut unlimited = start.clone();
        unlimited.max_limits.disk_mb = None;
        let reloaded = live_settings(&unlimited, &args(&["--max-disk-mb", "100"]));
        assert_eq!(reloaded.max_limits.disk_mb, None);
        assert_eq!(reloaded.default_limits.disk_mb, None);
        assert_eq!(
            live_settings(&start, &args(&["--max-disk-mb", "100"]))
                .default_limits
                .disk_mb,
            Some(100)
        );
    }
}
