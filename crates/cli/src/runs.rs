//! `runbox run create`, `ls`, `rm`, `renew` and `health`: the subcommands
//! that are one API call and a printout.

use std::process::ExitCode;

use clap::{Args, Subcommand, ValueEnum};
use runbox_client::types::{CreateRunRequest, LimitsRequest, NetworkTier, Run, RunStatus};
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

use crate::args::{env_map, parse_env_var, EnvVar};
use crate::connect::ConnectOpts;
use crate::table;

/// `runbox run ...`.
#[derive(Debug, Subcommand)]
pub enum RunCommand {
    /// Create a run from an image and print its id
    Create(CreateArgs),
}

/// What a run may reach on the network.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum NetworkArg {
    /// Loopback only
    None,
    /// Only allowlisted destinations, through runbox's proxy
    #[value(alias = "egress")]
    Allowlist,
    /// Whatever the host routes
    Open,
}

impl From<NetworkArg> for NetworkTier {
    fn from(arg: NetworkArg) -> Self {
        match arg {
            NetworkArg::None => NetworkTier::None,
            NetworkArg::Allowlist => NetworkTier::Allowlist,
            NetworkArg::Open => NetworkTier::Open,
        }
    }
}

/// What happens at a run's TTL.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum OnExpireArg {
    /// It is destroyed
    Delete,
    /// It is paused and kept for the server's retention; a resume gives
    /// it a fresh TTL
    Pause,
    /// It is hibernated (processes and memory lost, disk kept) and kept
    /// for the server's retention; a wake gives it a fresh TTL
    Hibernate,
    /// It is archived to the checkpoint store (nothing left on the node)
    /// and kept for the server's retention; a restore gives it a fresh TTL
    Archive,
}

/// What becomes of a run when its node of a fleet is declared gone.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum OnNodeLossArg {
    /// It comes back on another node from its latest checkpoint (lost
    /// when it has none)
    Restore,
    /// It is marked lost
    Lost,
}

/// When a create pulls its image.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum PullArg {
    /// Only when it is not stored
    IfNotPresent,
    /// Every time: a moved tag replaces the stored image for new runs
    Always,
    /// Never: a reference that is not stored fails
    Never,
}

/// `runbox run create`.
#[derive(Debug, Args)]
pub struct CreateArgs {
    /// A stored image's name, or a reference such as alpine:3.20 or
    /// 127.0.0.1:5000/team/app:1 (pulled first if not stored)
    #[arg(
        long,
        value_name = "IMAGE",
        required_unless_present = "checkpoint",
        conflicts_with = "checkpoint"
    )]
    pub image: Option<String>,
    /// Start from a checkpoint (`runbox checkpoint`) instead of an image:
    /// its disk, and its run's settings for every option not given here
    #[arg(long, value_name = "ID")]
    pub checkpoint: Option<ulid::Ulid>,
    /// When to pull the image [default: if-not-present]
    #[arg(long, value_enum, value_name = "WHEN")]
    pub pull: Option<PullArg>,
    /// Time to live in seconds [default: the server's, 30 minutes]
    #[arg(long, value_name = "SECS")]
    pub ttl: Option<u64>,
    /// CPU bandwidth in cores, fractions allowed (e.g. 0.5)
    #[arg(long, value_name = "F")]
    pub cpus: Option<f64>,
    /// Memory limit in MiB
    #[arg(long, value_name = "MB")]
    pub memory: Option<u64>,
    /// Maximum number of processes and threads
    #[arg(long, value_name = "N")]
    pub pids: Option<u64>,
    /// Disk limit for what the run writes: MiB, or with a unit (`512M`,
    /// `20G`) [default: the server's, 10 GiB]
    #[arg(long, value_name = "SIZE", value_parser = parse_disk_mb)]
    pub disk: Option<u64>,
    /// Environment variable for every command in the run (repeatable)
    #[arg(long = "env", short = 'e', value_name = "K=V", value_parser = parse_env_var)]
    pub env: Vec<EnvVar>,
    /// Network access [default: the server's, none]
    #[arg(long, value_enum, value_name = "TIER")]
    pub network: Option<NetworkArg>,
    /// Extra egress allowlist entry for this run (`host`, `.suffix`,
    /// `host:port`; needs --network allowlist; repeatable)
    #[arg(long = "egress-allow", value_name = "ENTRY", value_parser = crate::args::parse_egress_entry)]
    pub egress_allow: Vec<runbox_types::EgressEntry>,
    /// Leave the server's built-in list of registries and forges out of
    /// the run's allowlist
    #[arg(long)]
    pub no_egress_defaults: bool,
    /// A SOCKS5 door in the run (127.0.0.1:1080, named by ALL_PROXY) for
    /// tools that speak SOCKS5; same policy (needs --network allowlist)
    #[arg(long)]
    pub socks5: bool,
    /// An upstream proxy the run's egress leaves through, one the server
    /// admits: `http://` or `socks5://` `[user:password@]host:port`
    /// (needs --network allowlist)
    #[arg(long, value_name = "URL")]
    pub egress_upstream: Option<String>,
    /// Operator-declared secret the run may use through the proxy; the run
    /// sees only a placeholder (needs --network allowlist; repeatable)
    #[arg(long = "secret", value_name = "NAME")]
    pub secrets: Vec<String>,
    /// Secrets you bring, from a JSON file: an array of {name, value,
    /// hosts, header, scheme?, methods?, pathPrefixes?}; the run sees
    /// placeholders, the proxy sends each value only to its hosts, methods
    /// and paths (needs --network allowlist; repeatable)
    #[arg(long = "secrets-file", value_name = "FILE", value_parser = crate::args::parse_secrets_file)]
    pub secrets_files: Vec<crate::args::BroughtSecrets>,
    /// A size tier instead of --cpus/--memory/--pids/--disk: small, medium,
    /// large, xlarge, 2xlarge; a warm pool of the same image, network and
    /// size serves the create at once
    #[arg(long, value_name = "TIER", value_parser = parse_size,
          conflicts_with_all = ["cpus", "memory", "pids", "disk"])]
    pub size: Option<runbox_types::SizeTier>,
    /// A label shown on the run (repeatable)
    #[arg(long = "label", short = 'l', value_name = "K=V", value_parser = parse_env_var)]
    pub labels: Vec<EnvVar>,
    /// Give the run a warm volume for this repository (owner/name): it
    /// starts from the repository's template when there is one
    #[arg(long, value_name = "OWNER/NAME")]
    pub warm: Option<String>,
    /// Where the warm volume is mounted [default: /work]
    #[arg(long, value_name = "PATH", requires = "warm")]
    pub warm_path: Option<String>,
    /// Serve the run's ports without a token to requests naming them by
    /// host, <port>-<run id>.<domain> (E2B's addressing; docs/e2b.md)
    #[arg(long)]
    pub public_ports: bool,
    /// While the run is paused, refuse calls (run_paused) instead of
    /// resuming it; only `runbox resume` wakes it
    #[arg(long)]
    pub no_auto_resume: bool,
    /// What happens at the run's TTL [default: delete]
    #[arg(long, value_enum)]
    pub on_expire: Option<OnExpireArg>,
    /// What becomes of the run when its node of a fleet is declared gone
    /// [default: the server's --on-node-loss]
    #[arg(long, value_enum)]
    pub on_node_loss: Option<OnNodeLossArg>,
    /// Pause the run after this many seconds nobody uses it (0: off)
    /// [default: the server's --idle-pause-sec]
    #[arg(long, value_name = "SECS")]
    pub idle_pause: Option<u64>,
    /// Hibernate the run after this many seconds nobody uses it (0: off)
    /// [default: the server's --idle-hibernate-sec]
    #[arg(long, value_name = "SECS")]
    pub idle_hibernate: Option<u64>,
    /// Let the run's commands gain privileges through setuid programs
    /// (`sudo`, `su`); only where runs have a user namespace of their own
    #[arg(long)]
    pub allow_privilege_escalation: bool,
    /// Mount a volume: NAME, NAME:PATH, NAME:ro or NAME:PATH:ro (default
    /// path /volumes/NAME, default mode rw; repeatable, up to 8)
    #[arg(long = "volume", short = 'v', value_name = "NAME[:PATH][:ro]", value_parser = parse_volume)]
    pub volumes: Vec<runbox_types::VolumeMountRequest>,
    /// Keep a history point after every command and file change, the
    /// newest N of them, to diff and roll back to (0: none) [default: the
    /// server's --history-keep]
    #[arg(long, value_name = "N")]
    pub history: Option<u32>,
    /// Print the whole run as JSON instead of its id
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// A history point's id (a ULID).
fn parse_point(raw: &str) -> Result<ulid::Ulid, String> {
    runbox_types::parse_id(raw).ok_or_else(|| format!("{raw:?} is not a point id (a ULID)"))
}

impl CreateArgs {
    fn request(&self) -> CreateRunRequest {
        let asked = self.cpus.is_some()
            || self.memory.is_some()
            || self.pids.is_some()
            || self.disk.is_some();
        let limits = asked.then_some(LimitsRequest {
            cpus: self.cpus,
            memory_mb: self.memory,
            pids: self.pids,
            disk_mb: self.disk,
        });
        CreateRunRequest {
            image: self.image.clone().unwrap_or_default(),
            checkpoint: self.checkpoint,
            pull: self.pull.map(|p| match p {
                PullArg::IfNotPresent => runbox_types::PullPolicy::IfNotPresent,
                PullArg::Always => runbox_types::PullPolicy::Always,
                PullArg::Never => runbox_types::PullPolicy::Never,
            }),
            env: env_map(self.env.clone()),
            ttl_sec: self.ttl,
            network: self.network.map(NetworkTier::from),
            limits,
            egress_allow: (!self.egress_allow.is_empty()).then(|| self.egress_allow.clone()),
            egress_defaults: self.no_egress_defaults.then_some(false),
            egress_socks5: self.socks5.then_some(true),
            egress_upstream: self
                .egress_upstream
                .clone()
                .map(runbox_types::SecretValue::new),
            secrets: secret_requests(&self.secrets, &self.secrets_files),
            warm: self.warm.clone().map(|repo| runbox_types::WarmRequest {
                repo,
                path: self.warm_path.clone(),
            }),
            size: self.size,
            labels: (!self.labels.is_empty()).then(|| {
                self.labels
                    .iter()
                    .map(|l| (l.name.clone(), l.value.clone()))
                    .collect()
            }),
            public_ports: self.public_ports.then_some(true),
            auto_resume: self.no_auto_resume.then_some(false),
            on_expire: self.on_expire.map(|o| match o {
                OnExpireArg::Delete => runbox_types::OnExpire::Delete,
                OnExpireArg::Pause => runbox_types::OnExpire::Pause,
                OnExpireArg::Archive => runbox_types::OnExpire::Archive,
                OnExpireArg::Hibernate => runbox_types::OnExpire::Hibernate,
            }),
            on_node_loss: self.on_node_loss.map(|o| match o {
                OnNodeLossArg::Restore => runbox_types::OnNodeLoss::Restore,
                OnNodeLossArg::Lost => runbox_types::OnNodeLoss::Lost,
            }),
            idle: (self.idle_pause.is_some() || self.idle_hibernate.is_some()).then_some(
                runbox_types::IdlePolicy {
                    pause_after_sec: self.idle_pause,
                    hibernate_after_sec: self.idle_hibernate,
                },
            ),
            allow_privilege_escalation: self.allow_privilege_escalation.then_some(true),
            volumes: (!self.volumes.is_empty()).then(|| self.volumes.clone()),
            history: self
                .history
                .map(|keep| runbox_types::HistorySettings { keep }),
        }
    }
}

/// Parses `--volume`: `NAME`, `NAME:PATH`, `NAME:MODE` or `NAME:PATH:MODE`,
/// MODE `ro` or `rw`. The daemon checks the name and the path.
pub fn parse_volume(s: &str) -> Result<runbox_types::VolumeMountRequest, String> {
    let mut parts: Vec<&str> = s.split(':').collect();
    let mode = match parts.last() {
        Some(&"ro") if parts.len() > 1 => Some(runbox_types::VolumeMode::Ro),
        Some(&"rw") if parts.len() > 1 => Some(runbox_types::VolumeMode::Rw),
        _ => None,
    };
    if mode.is_some() {
        parts.pop();
    }
    match parts.as_slice() {
        [name] if !name.is_empty() => Ok(runbox_types::VolumeMountRequest {
            name: name.to_string(),
            path: None,
            mode,
        }),
        [name, path] if !name.is_empty() && !path.is_empty() => {
            Ok(runbox_types::VolumeMountRequest {
                name: name.to_string(),
                path: Some(path.to_string()),
                mode,
            })
        }
        _ => Err(format!(
            "{s:?} is not NAME, NAME:PATH, NAME:ro or NAME:PATH:ro"
        )),
    }
}

/// Parses `--size`: a tier's name.
pub fn parse_size(s: &str) -> Result<runbox_types::SizeTier, String> {
    runbox_types::SizeTier::ALL
        .into_iter()
        .find(|t| t.as_str() == s)
        .ok_or_else(|| format!("{s:?} is not a size tier: small, medium, large, xlarge or 2xlarge"))
}

/// Parses `--disk`: a number of MiB, or a number with a binary unit
/// (`M`/`MiB`, `G`/`GiB`, `T`/`TiB`; case does not matter).
fn parse_disk_mb(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{s:?} is not a size: write MiB (512) or a unit (512M, 20G)"))?;
    let factor = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "m" | "mb" | "mib" => 1,
        "g" | "gb" | "gib" => 1024,
        "t" | "tb" | "tib" => 1024 * 1024,
        other => return Err(format!("unknown size unit {other:?}: use M, G or T")),
    };
    n.checked_mul(factor)
        .ok_or_else(|| format!("{s:?} is too large"))
}

/// A byte count as people read it (binary units).
fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 || value >= 10.0 {
        format!("{value:.0} {}", UNITS[unit])
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// The DISK column: used of limit, either side `-` when unknown.
fn disk_cell(run: &Run) -> String {
    let used = run.disk_used_bytes.map(human_bytes);
    let limit = run.limits.disk_mb.map(|mb| human_bytes(mb << 20));
    match (used, limit) {
        (None, None) => "-".to_owned(),
        (used, limit) => format!(
            "{}/{}",
            used.unwrap_or_else(|| "-".into()),
            limit.unwrap_or_else(|| "unlimited".into())
        ),
    }
}

/// `runbox ls`.
#[derive(Debug, Args)]
pub struct LsArgs {
    /// Print the run list as JSON
    #[arg(long)]
    pub json: bool,
    /// Only runs with this label: KEY=VALUE, or KEY for any value (repeat:
    /// every one must hold)
    #[arg(long = "label", short = 'l', value_name = "KEY[=VALUE]")]
    pub labels: Vec<String>,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox rm`.
#[derive(Debug, Args)]
pub struct RmArgs {
    /// Ids of the runs to delete
    #[arg(required = true, value_name = "ID")]
    pub ids: Vec<String>,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox renew`.
#[derive(Debug, Args)]
pub struct RenewArgs {
    /// The run's id
    pub id: String,
    /// New time to live from now, in seconds (capped by the server)
    #[arg(long, value_name = "SECS")]
    pub ttl: u64,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox egress`.
#[derive(Debug, Args)]
pub struct EgressArgs {
    /// The run's id
    pub id: String,
    /// Move the run to this tier: none or allowlist
    #[arg(long, value_enum, value_name = "TIER")]
    pub network: Option<NetworkArg>,
    /// The run's allowlist entries from now on (`host`, `.suffix`,
    /// `host:port`; repeatable); without it and --clear-allow they stay
    #[arg(long = "allow", value_name = "ENTRY", value_parser = crate::args::parse_egress_entry)]
    pub allow: Vec<runbox_types::EgressEntry>,
    /// Remove every allowlist entry of the run
    #[arg(long, conflicts_with = "allow")]
    pub clear_allow: bool,
    /// Whether the server's built-in list of registries and forges applies
    #[arg(long, value_name = "BOOL")]
    pub egress_defaults: Option<bool>,
    /// Open (true) or close (false) the run's SOCKS5 door; tunnels open
    /// through it keep going
    #[arg(long, value_name = "BOOL")]
    pub socks5: Option<bool>,
    /// The run's upstream proxy from now on (as `runbox run create
    /// --egress-upstream`); "" removes it
    #[arg(long, value_name = "URL")]
    pub upstream: Option<String>,
    /// Operator-declared secret the run may use from now on (repeatable);
    /// with --secrets-file these replace the run's secrets
    #[arg(long = "secret", value_name = "NAME")]
    pub secrets: Vec<String>,
    /// Secrets you bring, from a JSON file (see runbox run create --help)
    #[arg(long = "secrets-file", value_name = "FILE", value_parser = crate::args::parse_secrets_file)]
    pub secrets_files: Vec<crate::args::BroughtSecrets>,
    /// Remove every secret of the run
    #[arg(long, conflicts_with_all = ["secrets", "secrets_files"])]
    pub clear_secrets: bool,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

impl EgressArgs {
    fn request(&self) -> runbox_types::UpdateEgressRequest {
        let secrets = secret_requests(&self.secrets, &self.secrets_files);
        runbox_types::UpdateEgressRequest {
            network: self.network.map(NetworkTier::from),
            egress_defaults: self.egress_defaults,
            egress_socks5: self.socks5,
            egress_upstream: self.upstream.clone().map(runbox_types::SecretValue::new),
            egress_allow: match (self.clear_allow, self.allow.is_empty()) {
                (true, _) => Some(Vec::new()),
                (false, true) => None,
                (false, false) => Some(self.allow.clone()),
            },
            secrets: match (self.clear_secrets, secrets) {
                (true, _) => Some(Vec::new()),
                (false, secrets) => secrets,
            },
        }
    }
}

/// `runbox egress`: prints the run's tier, entries and secrets after the
/// change.
pub async fn egress(args: EgressArgs) -> anyhow::Result<ExitCode> {
    let conn = args.conn.connect()?;
    let run = conn.check(
        conn.client
            .update_run_egress(&args.id, &args.request())
            .await,
    )?;
    println!(
        "{} network {}; entries: {}; secrets: {}",
        run.id,
        run.network.as_str(),
        list_or_none(
            &run.egress_allow
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
        ),
        list_or_none(&run.secrets)
    );
    Ok(ExitCode::SUCCESS)
}

/// `a, b` or `none`.
fn list_or_none(items: &[String]) -> String {
    if items.is_empty() {
        "none".to_owned()
    } else {
        items.join(", ")
    }
}

/// `--secret` names and `--secrets-file` contents as one `secrets` list;
/// None when neither was given.
fn secret_requests(
    names: &[String],
    files: &[crate::args::BroughtSecrets],
) -> Option<Vec<runbox_types::SecretRequest>> {
    let secrets: Vec<runbox_types::SecretRequest> = names
        .iter()
        .map(|name| name.as_str().into())
        .chain(
            files
                .iter()
                .flat_map(|f| f.0.iter().cloned().map(Into::into)),
        )
        .collect();
    (!secrets.is_empty()).then_some(secrets)
}

/// `runbox pause` and `runbox resume`.
#[derive(Debug, Args)]
pub struct IdsArgs {
    /// The runs' ids
    #[arg(required = true)]
    pub ids: Vec<String>,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox snapshot`.
#[derive(Debug, Args)]
pub struct SnapshotArgs {
    /// The run's id
    pub id: String,
    /// Image name for the snapshot [default: a generated snap-…]
    #[arg(long)]
    pub name: Option<String>,
    /// Snapshot the run's files as they were at this history point
    #[arg(long, value_name = "POINT", value_parser = parse_point)]
    pub point: Option<ulid::Ulid>,
    /// A label of the snapshot (repeatable), for GET /v1/snapshots?label=
    #[arg(long = "label", short = 'l', value_name = "K=V", value_parser = parse_env_var)]
    pub labels: Vec<EnvVar>,
    /// Print the snapshot as JSON instead of its image name
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox fork`.
#[derive(Debug, Args)]
pub struct ForkArgs {
    /// The run's id
    pub id: String,
    /// How many children
    #[arg(long, default_value_t = 1)]
    pub count: usize,
    /// Each child's time to live in seconds [default: the server's]
    #[arg(long, value_name = "SECS")]
    pub ttl: Option<u64>,
    /// Fork the run's files as they were at this history point
    #[arg(long, value_name = "POINT", value_parser = parse_point)]
    pub point: Option<ulid::Ulid>,
    /// Print the children as JSON instead of their ids
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox health`.
#[derive(Debug, Args)]
pub struct HealthArgs {
    /// Print the answer as JSON
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// Runs a `runbox run ...` subcommand.
pub async fn run_command(command: RunCommand) -> anyhow::Result<ExitCode> {
    match command {
        RunCommand::Create(args) => create(args).await,
    }
}

async fn create(args: CreateArgs) -> anyhow::Result<ExitCode> {
    let conn = args.conn.connect()?;
    let run = conn.check(conn.client.create_run(&args.request()).await)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&run)?);
    } else {
        println!("{}", run.id);
    }
    Ok(ExitCode::SUCCESS)
}

/// `runbox ls`.
pub async fn ls(args: LsArgs) -> anyhow::Result<ExitCode> {
    let conn = args.conn.connect()?;
    let selector: Vec<&str> = args.labels.iter().map(String::as_str).collect();
    let list = conn.check(conn.client.list_runs_labelled(&selector).await)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&list)?);
    } else {
        print!(
            "{}",
            runs_table(&list.runs, &list.server, OffsetDateTime::now_utc())
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// The runs as a table; a NODE column when any of them is on a node other
/// than `here` (the node that answered, in a fleet).
fn runs_table(runs: &[Run], here: &str, now: OffsetDateTime) -> String {
    let fleet = runs.iter().any(|run| run.server != here);
    let rows: Vec<Vec<String>> = runs
        .iter()
        .map(|run| {
            let mut row = vec![
                run.id.to_string(),
                run.image.clone(),
                status_name(run.status).to_owned(),
                run.network.as_str().to_owned(),
                run.limits.cpus.to_string(),
                format!("{} MiB", run.limits.memory_mb),
                disk_cell(run),
                table::until(run.expires_at, now),
                match &run.lease {
                    Some(lease) => format!("{} (gen {})", lease.holder, lease.generation),
                    None => "-".to_owned(),
                },
                // The operator's own runs have none.
                run.tenant.clone().unwrap_or_else(|| "-".to_owned()),
            ];
            if fleet {
                row.push(run.server.clone());
            }
            row
        })
        .collect();
    let mut headers = vec![
        "ID", "IMAGE", "STATUS", "NETWORK", "CPUS", "MEM", "DISK", "EXPIRES", "LEASE", "TENANT",
    ];
    if fleet {
        headers.push("NODE");
    }
    table::render(&headers, &rows)
}

fn status_name(status: RunStatus) -> &'static str {
    match status {
        RunStatus::Creating => "creating",
        RunStatus::Running => "running",
        RunStatus::Paused => "paused",
        RunStatus::Hibernated => "hibernated",
        RunStatus::Archived => "archived",
        RunStatus::Stopping => "stopping",
        RunStatus::Failed => "failed",
        RunStatus::Lost => "lost",
    }
}

/// `runbox rm`: deletes every run given, reporting each failure, and fails
/// if any failed.
pub async fn rm(args: RmArgs) -> anyhow::Result<ExitCode> {
    let conn = args.conn.connect()?;
    let mut failed = false;
    for id in &args.ids {
        match conn.check(conn.client.delete_run(id).await) {
            Ok(()) => println!("{id}"),
            Err(err) => {
                eprintln!("runbox: cannot delete {id}: {err:#}");
                failed = true;
            }
        }
    }
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// `runbox renew`: prints the new expiry time.
pub async fn renew(args: RenewArgs) -> anyhow::Result<ExitCode> {
    let conn = args.conn.connect()?;
    let run = conn.check(conn.client.renew_run(&args.id, args.ttl).await)?;
    println!("{} expires at {}", run.id, run.expires_at.format(&Rfc3339)?);
    Ok(ExitCode::SUCCESS)
}

/// `runbox pause`: pauses every run given, printing each one's status,
/// and fails if any could not be paused.
pub async fn pause(args: IdsArgs) -> anyhow::Result<ExitCode> {
    each_run(args, "pause", |client, id| async move {
        client.pause_run(&id).await
    })
    .await
}

/// `runbox resume`: resumes every run given, as `pause` does.
pub async fn resume(args: IdsArgs) -> anyhow::Result<ExitCode> {
    each_run(args, "resume", |client, id| async move {
        client.resume_run(&id).await
    })
    .await
}

/// `runbox hibernate`: hibernates every run given, as `pause` does.
pub async fn hibernate(args: IdsArgs) -> anyhow::Result<ExitCode> {
    each_run(args, "hibernate", |client, id| async move {
        client.hibernate_run(&id).await
    })
    .await
}

/// `runbox archive`: archives every run given, as `pause` does.
pub async fn archive(args: IdsArgs) -> anyhow::Result<ExitCode> {
    each_run(args, "archive", |client, id| async move {
        client.archive_run(&id).await
    })
    .await
}

/// `runbox move`.
#[derive(Debug, Args)]
pub struct MoveArgs {
    /// The runs' ids
    #[arg(required = true)]
    pub ids: Vec<String>,
    /// The node to move them to (`runbox cluster status` lists them);
    /// default: the best node that can take each
    #[arg(long, value_name = "NODE")]
    pub node: Option<String>,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox move`: moves every run given, printing `<id> <status> <node>`.
pub async fn move_runs(args: MoveArgs) -> anyhow::Result<ExitCode> {
    let conn = args.conn.connect()?;
    let mut failed = false;
    for id in args.ids {
        match conn.check(conn.client.move_run(&id, args.node.clone()).await) {
            Ok(run) => println!("{} {} {}", run.id, status_name(run.status), run.server),
            Err(err) => {
                eprintln!("runbox: cannot move {id}: {err:#}");
                failed = true;
            }
        }
    }
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// `runbox wake`: wakes every run given, as `pause` does.
pub async fn wake(args: IdsArgs) -> anyhow::Result<ExitCode> {
    each_run(args, "wake", |client, id| async move {
        client.wake_run(&id).await
    })
    .await
}

/// Applies `call` to every run in `args`, printing `<id> <status>` or the
/// error for each; fails if any failed.
async fn each_run<F, Fut>(args: IdsArgs, what: &str, call: F) -> anyhow::Result<ExitCode>
where
    F: Fn(runbox_client::Client, String) -> Fut,
    Fut: std::future::Future<Output = Result<Run, runbox_client::ClientError>>,
{
    let conn = args.conn.connect()?;
    let mut failed = false;
    for id in args.ids {
        match conn.check(call(conn.client.clone(), id.clone()).await) {
            Ok(run) => println!("{} {}", run.id, status_name(run.status)),
            Err(err) => {
                eprintln!("runbox: cannot {what} {id}: {err:#}");
                failed = true;
            }
        }
    }
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// `runbox snapshot`: prints the new image's name (create runs from it
/// with `run create --image NAME`).
pub async fn snapshot(args: SnapshotArgs) -> anyhow::Result<ExitCode> {
    let conn = args.conn.connect()?;
    let req = runbox_client::types::SnapshotRequest {
        name: args.name,
        labels: (!args.labels.is_empty()).then(|| {
            args.labels
                .iter()
                .map(|l| (l.name.clone(), l.value.clone()))
                .collect()
        }),
        point: args.point,
    };
    let snapshot = conn.check(conn.client.snapshot_run_with(&args.id, &req).await)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&snapshot)?);
    } else {
        println!("{}", snapshot.image);
    }
    Ok(ExitCode::SUCCESS)
}

/// `runbox fork`: prints one child id per line.
pub async fn fork(args: ForkArgs) -> anyhow::Result<ExitCode> {
    let conn = args.conn.connect()?;
    let req = runbox_types::ForkRequest {
        count: args.count,
        ttl_sec: args.ttl,
        point: args.point,
    };
    let forked = conn.check(conn.client.fork_run(&args.id, &req).await)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&forked)?);
    } else {
        for run in &forked.runs {
            println!("{}", run.id);
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `runbox health`: needs no token.
pub async fn health(args: HealthArgs) -> anyhow::Result<ExitCode> {
    let conn = args.conn.connect_anonymous()?;
    let health = conn.check(conn.client.health().await)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&health)?);
    } else {
        println!(
            "{} (runbox {} on {})",
            health.status, health.version, health.server
        );
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;
    use runbox_client::types::Limits;

    use super::*;

    #[derive(Debug, clap::Parser)]
    struct Wrap {
        #[command(subcommand)]
        command: RunCommand,
    }

    fn create_args(argv: &[&str]) -> CreateArgs {
        let argv = ["run", "create"].iter().chain(argv);
        match Wrap::try_parse_from(argv).unwrap().command {
            RunCommand::Create(args) => args,
        }
    }

    #[derive(Debug, clap::Parser)]
    struct EgressWrap {
        #[command(flatten)]
        args: EgressArgs,
    }

    fn egress_request(argv: &[&str]) -> Result<runbox_types::UpdateEgressRequest, clap::Error> {
        let argv = ["egress", "01ARZ3NDEKTSV4RRFFQ69G5FAV"].iter().chain(argv);
        EgressWrap::try_parse_from(argv).map(|w| w.args.request())
    }

    #[test]
    fn egress_changes_leave_out_what_is_not_given() {
        let req = egress_request(&["--allow", "a.example", "--allow", "b.example:8443"]).unwrap();
        let rule =
            egress_request(&["--allow", r#"{"host": "db.example", "ports": [5432]}"#]).unwrap();
        assert!(matches!(
            rule.egress_allow.as_deref(),
            Some([runbox_types::EgressEntry::Rule(r)]) if r.host == "db.example"
        ));
        assert!(egress_request(&["--allow", r#"{"hots": "x"}"#]).is_err());
        assert_eq!(
            req.egress_allow.as_deref(),
            Some(&["a.example".into(), "b.example:8443".into()][..])
        );
        assert_eq!((req.network, req.secrets), (None, None));
        let req =
            egress_request(&["--network", "none", "--clear-allow", "--clear-secrets"]).unwrap();
        assert_eq!(req.network, Some(NetworkTier::None));
        assert_eq!(req.egress_allow, Some(Vec::new()));
        assert_eq!(req.secrets, Some(Vec::new()));
        let req = egress_request(&["--secret", "GH"]).unwrap();
        assert_eq!(req.secrets, Some(vec!["GH".into()]));
        assert!(egress_request(&["--clear-allow", "--allow", "x.example"]).is_err());
        assert!(egress_request(&["--clear-secrets", "--secret", "GH"]).is_err());
        assert_eq!(req.egress_socks5, None);
        let req = egress_request(&["--socks5", "false"]).unwrap();
        assert_eq!(req.egress_socks5, Some(false));
        assert!(egress_request(&["--socks5", "maybe"]).is_err());
        let create = create_args(&["--image", "base", "--network", "allowlist", "--socks5"]);
        assert_eq!(create.request().egress_socks5, Some(true));
        assert_eq!(
            create_args(&["--image", "base"]).request().egress_socks5,
            None
        );
    }

    #[test]
    fn volumes_take_a_name_a_path_and_a_mode() {
        use runbox_types::VolumeMode::{Ro, Rw};
        let req = create_args(&[
            "--image",
            "base",
            "--volume",
            "data",
            "-v",
            "cache:/mnt/cache",
            "--volume",
            "sets:ro",
            "--volume",
            "models:/models:rw",
        ])
        .request();
        let got: Vec<(String, Option<String>, Option<runbox_types::VolumeMode>)> = req
            .volumes
            .unwrap()
            .into_iter()
            .map(|v| (v.name, v.path, v.mode))
            .collect();
        assert_eq!(
            got,
            [
                ("data".into(), None, None),
                ("cache".into(), Some("/mnt/cache".into()), None),
                ("sets".into(), None, Some(Ro)),
                ("models".into(), Some("/models".into()), Some(Rw)),
            ]
        );
        for bad in ["", ":ro", "a::ro", "a:/x:y:z", "a:"] {
            assert!(parse_volume(bad).is_err(), "{bad:?}");
        }
        assert!(create_args(&["--image", "base"])
            .request()
            .volumes
            .is_none());
    }

    #[test]
    fn create_sends_only_what_was_given() {
        let req = create_args(&["--image", "base"]).request();
        assert_eq!(req.image, "base");
        assert!(req.limits.is_none() && req.env.is_none() && req.ttl_sec.is_none());
        assert!(req.network.is_none());

        let req = create_args(&[
            "--image",
            "base",
            "--memory",
            "512",
            "--env",
            "A=1",
            "--network",
            "allowlist",
            "--ttl",
            "60",
        ])
        .request();
        let limits = req.limits.unwrap();
        assert_eq!(
            (limits.cpus, limits.memory_mb, limits.pids),
            (None, Some(512), None)
        );
        assert_eq!(req.env.unwrap().0["A"], "1");
        assert_eq!(req.network, Some(NetworkTier::Allowlist));
        assert_eq!(req.ttl_sec, Some(60));
    }

    #[test]
    fn disk_sizes_take_mib_or_a_unit() {
        assert_eq!(parse_disk_mb("512"), Ok(512));
        assert_eq!(parse_disk_mb("512M"), Ok(512));
        assert_eq!(parse_disk_mb("20G"), Ok(20 * 1024));
        assert_eq!(parse_disk_mb("1tib"), Ok(1024 * 1024));
        for bad in ["", "G", "1.5G", "10P", "-1", "99999999999999999999T"] {
            assert!(parse_disk_mb(bad).is_err(), "{bad:?}");
        }
        let req = create_args(&["--image", "base", "--disk", "2G"]).request();
        assert_eq!(req.limits.unwrap().disk_mb, Some(2048));
    }

    #[test]
    fn create_refuses_env_without_equals_sign() {
        let argv = ["run", "create", "--image", "base", "--env", "A"];
        let err = Wrap::try_parse_from(argv).unwrap_err().to_string();
        assert!(err.contains("NAME=VALUE"), "{err}");
    }

    #[test]
    fn the_run_table_shows_one_line_per_run() {
        let now = OffsetDateTime::UNIX_EPOCH;
        let run = Run {
            id: "01JABCDEFGHJKMNPQRSTVWXYZ0".parse().unwrap(),
            server: "node".to_owned(),
            server_origin: None,
            image: "base".to_owned(),
            network: NetworkTier::None,
            limits: Limits {
                cpus: 0.5,
                memory_mb: 1024,
                pids: 256,
                disk_mb: Some(10240),
            },
            runtime: "runc".to_owned(),
            created_at: now,
            expires_at: now + time::Duration::minutes(30),
            status: RunStatus::Running,
            lease: Some(runbox_client::types::Lease {
                holder: "alice".to_owned(),
                generation: 4,
                expires_at: now + time::Duration::minutes(5),
            }),
            lease_generation: Some(4),
            egress_allow: Vec::new(),
            egress_defaults: None,
            egress_socks5: None,
            egress_upstream: None,
            secrets: Vec::new(),
            egress: None,
            failure: None,
            disk_used_bytes: Some(3 << 20),
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
            tenant: Some("acme".to_owned()),
            token: None,
        };
        let text = runs_table(std::slice::from_ref(&run), "node", now);
        assert!(text.lines().next().unwrap().ends_with("TENANT"), "{text}");
        // A run of another node of the fleet: the NODE column says where.
        let elsewhere = runs_table(std::slice::from_ref(&run), "other", now);
        let head = elsewhere.lines().next().unwrap();
        assert!(head.ends_with("NODE"), "{elsewhere}");
        assert!(
            elsewhere.lines().nth(1).unwrap().ends_with("node"),
            "{elsewhere}"
        );
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2);
        assert!(lines[0].starts_with("ID "));
        for cell in [
            "01JABCDEFGHJKMNPQRSTVWXYZ0",
            "base",
            "running",
            "none",
            "0.5",
            "1024 MiB",
            "3.0 MiB/10 GiB",
            "in 30m00s",
            "alice (gen 4)",
            "acme",
        ] {
            assert!(
                lines[1].contains(cell),
                "{cell} missing from {:?}",
                lines[1]
            );
        }
    }
}
