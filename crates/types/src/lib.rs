//! runbox's HTTP API wire types: request and response bodies, error codes and
//! the exec event stream. Serde only — no I/O, no async runtime — so the
//! server, the Rust client and any future front end share one definition.
//!
//! Field names are camelCase on the wire. Request types reject unknown fields
//! so that a misspelt option is an error instead of a silently ignored wish.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use ulid::Ulid;

pub mod builds;
mod cluster;
mod egress;
pub mod error;
mod tenants;
mod volumes;

pub use builds::{
    build_sse, Build, BuildContext, BuildFailure, BuildList, BuildLog, BuildRequest, BuildStatus,
    BuildStep, BuildStepSpec, BuildStepStatus,
};
pub use cluster::{ClusterNode, ClusterStatus, NodeState};
pub use egress::{
    BroughtSecret, EgressEntry, EgressRule, PortSpec, SecretRequest, SecretValue,
    UpdateEgressRequest,
};
pub use error::{ErrorBody, ErrorCode, ErrorDetail};
pub use tenants::{
    ConfigReload, CreateTenantRequest, Tenant, TenantList, TenantPolicy, TenantToken,
    UpdateTenantRequest, UsageReport, UsageTotals,
};
pub use volumes::{
    CloneVolumeRequest, CreateVolumeRequest, DatasetState, RunVolume, Volume, VolumeHolder,
    VolumeList, VolumeMakeDirRequest, VolumeMode, VolumeMountRequest, VolumeMoveRequest,
    VolumeRemoveRequest, VolumeWriteQuery, MAX_RUN_VOLUMES, MAX_VOLUME_ID,
};

/// The id a caller wrote (a run's, a sandbox's, a checkpoint's, a
/// volume's), if it is one: a ULID's 26 Crockford base32 characters, in
/// either case (host names carry ids lower-cased). Only the id's own
/// spelling is taken: Crockford's aliases (`I`, `L`, `O`) and a first
/// character above `7` (which a lenient decoder folds onto another id)
/// name nothing, so one id has one spelling whatever the case.
pub fn parse_id(raw: &str) -> Option<Ulid> {
    let id = Ulid::from_string(raw).ok()?;
    // Encoding is canonical: a wrapped or aliased spelling differs.
    id.to_string().eq_ignore_ascii_case(raw).then_some(id)
}

/// Environment variables for a run or an exec.
///
/// Values are secrets as far as runbox is concerned: `Debug` prints names only,
/// so a stray `{:?}` in a log line cannot leak them.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(transparent)]
pub struct Env(pub BTreeMap<String, String>);

impl fmt::Debug for Env {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.0.keys()).finish()
    }
}

/// What a run may reach on the network.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum NetworkTier {
    /// A private network namespace with loopback only.
    #[default]
    None,
    /// Only allowlisted destinations through runbox's proxy (`egress` is an alias).
    #[serde(alias = "egress")]
    Allowlist,
    /// Whatever the host routes, except runbox's own endpoints.
    Open,
}

impl NetworkTier {
    /// The tier's name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            NetworkTier::None => "none",
            NetworkTier::Allowlist => "allowlist",
            NetworkTier::Open => "open",
        }
    }
}

/// A size tier: fixed limits, the only sizes [warm pools](PoolSpec) take
/// (free-form limits would split pools into too many to keep warm).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub enum SizeTier {
    /// 1 CPU, 512 MiB, 256 processes, 10 GiB of disk.
    #[serde(rename = "small")]
    Small,
    /// 2 CPUs, 1 GiB, 512 processes, 20 GiB of disk.
    #[serde(rename = "medium")]
    Medium,
    /// 4 CPUs, 4 GiB, 1024 processes, 40 GiB of disk.
    #[serde(rename = "large")]
    Large,
    /// 4 CPUs, 8 GiB, 2048 processes, 80 GiB of disk.
    #[serde(rename = "xlarge")]
    Xlarge,
    /// 8 CPUs, 16 GiB, 4096 processes, 160 GiB of disk.
    #[serde(rename = "2xlarge")]
    TwoXlarge,
}

impl SizeTier {
    /// Every tier, smallest first.
    pub const ALL: [SizeTier; 5] = [
        SizeTier::Small,
        SizeTier::Medium,
        SizeTier::Large,
        SizeTier::Xlarge,
        SizeTier::TwoXlarge,
    ];

    /// The tier's wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            SizeTier::Small => "small",
            SizeTier::Medium => "medium",
            SizeTier::Large => "large",
            SizeTier::Xlarge => "xlarge",
            SizeTier::TwoXlarge => "2xlarge",
        }
    }

    /// The tier's limits (its disk limit where the server has disk limits).
    pub fn limits(self) -> Limits {
        let (cpus, memory_mb, pids, disk_gb) = match self {
            SizeTier::Small => (1.0, 512, 256, 10),
            SizeTier::Medium => (2.0, 1024, 512, 20),
            SizeTier::Large => (4.0, 4096, 1024, 40),
            SizeTier::Xlarge => (4.0, 8192, 2048, 80),
            SizeTier::TwoXlarge => (8.0, 16384, 4096, 160),
        };
        Limits {
            cpus,
            memory_mb,
            pids,
            disk_mb: Some(disk_gb * 1024),
        }
    }
}

impl fmt::Display for SizeTier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Resource limits as requested; absent fields take the server's defaults.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LimitsRequest {
    /// CPU bandwidth in cores (fractions allowed, e.g. 0.5).
    pub cpus: Option<f64>,
    /// Memory limit in MiB; exceeding it gets the process OOM-killed.
    pub memory_mb: Option<u64>,
    /// Maximum number of processes and threads.
    pub pids: Option<u64>,
    /// The most the run may write to its own filesystem, in MiB (file data
    /// and metadata both count); past it writes fail with EDQUOT.
    pub disk_mb: Option<u64>,
}

/// Resource limits in force for a run.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Limits {
    /// CPU bandwidth in cores.
    pub cpus: f64,
    /// Memory limit in MiB.
    pub memory_mb: u64,
    /// Maximum number of processes and threads.
    pub pids: u64,
    /// Disk limit in MiB; null for a run without one (a server started
    /// with disk limits off, or a run made before they existed).
    #[serde(default)]
    pub disk_mb: Option<u64>,
}

/// `POST /v1/runs`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateRunRequest {
    /// A stored image's local name, or an image reference as Docker spells
    /// it (`alpine:3.20`, `127.0.0.1:5000/team/app:1`, `…@sha256:…`),
    /// pulled first when it is not stored (see `pull`). Required unless
    /// `checkpoint` is given.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub image: String,
    /// Start from a checkpoint instead of an image (`POST
    /// /v1/runs/{id}/checkpoint`): the new run gets the checkpointed disk
    /// and, for every field this request leaves out, the checkpointed
    /// run's settings (env, limits or size, network and egress, labels,
    /// TTL, idle policy, `onExpire`). Any number of runs may start from one
    /// checkpoint. Not with `image`, `pull` or `warm`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<Ulid>,
    /// When to pull `image` (default `if-not-present`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pull: Option<PullPolicy>,
    /// Environment given to every exec in the run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<Env>,
    /// Time to live in seconds (default 30 minutes, capped by the server).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 1))]
    pub ttl_sec: Option<u64>,
    /// Network tier (default `none`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkTier>,
    /// Resource limits (defaults: 1 CPU, 1024 MiB, 256 pids).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<LimitsRequest>,
    /// Extra allowlist entries for this run only (`allowlist` tier):
    /// `host`, `.suffix`, `*.suffix`, `host:port`, an IP address,
    /// `prefix/len`, or a rule `{host, ports?, methods?, secret?,
    /// intercept?}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_allow: Option<Vec<EgressEntry>>,
    /// Whether the server's built-in list of package registries and forges
    /// applies to the run (`allowlist` tier; default true, and never when
    /// the operator turned the list off). False: the run reaches only its
    /// own entries, its secrets' hosts and the deployment's list.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_defaults: Option<bool>,
    /// A SOCKS5 door in the run beside the HTTP proxy (`allowlist` tier;
    /// default false): `127.0.0.1:1080`, named by `ALL_PROXY`, for tools
    /// that speak SOCKS5. Its CONNECTs follow the same policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_socks5: Option<bool>,
    /// An upstream proxy the run's egress leaves through (`allowlist`
    /// tier): `http://` or `socks5://`, `[user[:password]@]host:port`,
    /// admitted by the operator's `upstream.allow`. Its credentials are
    /// kept like a brought secret's value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>))]
    pub egress_upstream: Option<SecretValue>,
    /// Secrets the run may use (`allowlist` tier): names the operator
    /// declared, and secrets the caller brings (at most 32, value and
    /// policy; their hosts become reachable). The run sees only
    /// placeholders; the proxy injects the values.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secrets: Option<Vec<SecretRequest>>,
    /// A private volume for a repository at `/work` (or `warm.path`),
    /// started from the repository's warm template when there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm: Option<WarmRequest>,
    /// A size tier instead of `limits`; a create with a tier whose image
    /// and network match a warm pool is served from it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<SizeTier>,
    /// Labels shown on the run (at most 64; keys 1-63 characters of
    /// letters, digits, `.`, `_`, `-` and `/`; values up to 256 characters).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
    /// Serve the run's ports, without a token, to requests that name them
    /// by host (`<port>-<run id>.<domain>`, E2B's addressing; see
    /// docs/e2b.md). Default false: a port is reachable only through a
    /// signed preview URL, a tunnel, or the sandbox's traffic token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub public_ports: Option<bool>,
    /// Whether a call that reaches the run while it is paused resumes it
    /// (default true). With false, such a call is refused with
    /// `run_paused` and only `POST .../resume` wakes the run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto_resume: Option<bool>,
    /// What happens at the run's TTL (default `delete`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_expire: Option<OnExpire>,
    /// What becomes of the run when its node of a fleet is declared gone
    /// (default: the server's `--on-node-loss`, itself `restore` by
    /// default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_node_loss: Option<OnNodeLoss>,
    /// Pause or hibernate the run when nobody uses it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle: Option<IdlePolicy>,
    /// Let the run's commands gain privileges through setuid and setgid
    /// programs and file capabilities (`sudo`, `su`, `ping`). Default
    /// false: every command runs with `no_new_privs`. Only on servers whose
    /// runs have a user namespace of their own (`GET /v1/info` `userns`
    /// `private`), where root in the run is an unprivileged id on the host;
    /// elsewhere refused with `escalation_unsupported`. Creates through
    /// the E2B surface ask for it whenever the server can give it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_privilege_escalation: Option<bool>,
    /// Volumes to mount (at most 8): their writes are the volume's, kept
    /// after the run, and count against the volume's size, not the run's
    /// disk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volumes: Option<Vec<VolumeMountRequest>>,
    /// Keep a history point after every command and file change, to diff
    /// and roll back to (default: the server's `--history-keep`, itself
    /// off). Needs the btrfs run store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub history: Option<HistorySettings>,
}

/// A run's history (`history` at create): a point after every command
/// and file change that changed a file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HistorySettings {
    /// How many points to keep, the oldest dropped first (1 to the
    /// server's `--max-history`); 0 turns history off.
    pub keep: u32,
}

/// What made a history point.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub enum PointKind {
    /// The run as it was made: the point to undo everything to.
    Create,
    /// A command (`exec`, a terminal session) that ended.
    Exec,
    /// A background process that ended.
    Process,
    /// A file call: a write, a directory made, a move or a removal.
    File,
    /// The files as they were just before a rollback (what changed since
    /// the point before, kept so the rollback can be undone).
    Rollback,
}

/// What made a history point, in detail.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct PointCause {
    /// What kind of call.
    pub kind: PointKind,
    /// A command's argv.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub argv: Option<Vec<String>>,
    /// A command's exit code (-1 when unknown: the caller hung up, or
    /// the agent was lost).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// The user a command ran as, when one was asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// A file call: `write`, `mkdir`, `move` or `remove`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub op: Option<String>,
    /// A file call's path (for a move, where it went).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
}

/// How many paths a point changed, against the point before it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ChangeSummary {
    /// Paths added.
    pub added: u64,
    /// Paths modified (contents, mode, owner, link target).
    pub modified: u64,
    /// Paths removed.
    pub removed: u64,
    /// Bytes of the files added or modified, as they are now.
    pub bytes: u64,
}

/// One point of a run's history: its files as they were right after
/// what made it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct HistoryPoint {
    /// Its id (a ULID: later points sort after earlier ones).
    pub id: Ulid,
    /// When it was made.
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    /// The point the run's files were at before it (what its diff is
    /// against); absent for the first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<Ulid>,
    /// What made it.
    pub cause: PointCause,
    /// What it changed against its parent.
    pub changes: ChangeSummary,
}

/// `GET /v1/runs/{id}/history`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct HistoryList {
    /// The points kept, newest first.
    pub points: Vec<HistoryPoint>,
    /// The point the run's files are at (or descend from): the newest,
    /// or the one a rollback returned to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head: Option<Ulid>,
    /// How many points the run keeps.
    pub keep: u32,
    /// Bytes the points hold beyond the run's own disk, where the storage
    /// counts them (they count against the run's disk limit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
}

/// A path's entry on one side of a diff.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct PathState {
    /// What it is.
    pub kind: FileKind,
    /// Permission bits (with set-id and sticky bits), as a number.
    pub mode: u32,
    /// Owner user id inside the run.
    pub uid: u32,
    /// Owner group id inside the run.
    pub gid: u32,
    /// Size in bytes.
    pub size: u64,
    /// A symlink's target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
}

/// How a path changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub enum PathChangeKind {
    /// It is there after and was not before.
    Added,
    /// It is there on both sides and differs.
    Modified,
    /// It was there before and is not after.
    Removed,
}

/// One changed path.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct PathChange {
    /// Absolute, as the run sees it.
    pub path: String,
    /// How it changed.
    pub change: PathChangeKind,
    /// Before (absent when added).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub before: Option<PathState>,
    /// After (absent when removed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<PathState>,
    /// With `patch=true`, a changed text file's unified diff.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub patch: Option<String>,
    /// With `patch=true`, true for a file shown without a patch: binary,
    /// larger than 1 MiB, or past the patch budget of the answer.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub binary: bool,
}

/// `GET /v1/runs/{id}/history/{point}/diff`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct HistoryDiff {
    /// The point diffed.
    pub point: Ulid,
    /// What it is diffed against: `against`, else its parent; absent:
    /// the run's image as it was made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub against: Option<Ulid>,
    /// The changed paths, in path order (at most `limit`).
    pub changes: Vec<PathChange>,
    /// More paths changed than are listed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
    /// The counts of the changes listed.
    pub summary: ChangeSummary,
}

/// `POST /v1/runs/{id}/rollback`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RollbackRequest {
    /// The point to return the run's files to.
    pub point: Ulid,
    /// The lease owner, when the run is leased.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// The lease generation, with `owner`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<u64>,
}

/// The query of `GET /v1/runs/{id}/history/{point}/diff`.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema, utoipa::IntoParams))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HistoryDiffQuery {
    /// Diff against this point instead of the point's parent.
    #[serde(default)]
    pub against: Option<Ulid>,
    /// Include unified diffs of changed text files (default false).
    #[serde(default)]
    pub patch: Option<bool>,
    /// The most paths to list (1-10000, default 1000).
    #[serde(default)]
    pub limit: Option<usize>,
}

/// What becomes of a run when its node of a fleet is declared gone
/// (`onNodeLoss`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub enum OnNodeLoss {
    /// It comes back on another node from its latest checkpoint in the
    /// bucket the nodes share (`recovered` says from what, and what was
    /// lost); with none, it is `lost`.
    #[default]
    Restore,
    /// It is `lost`: it reads so with the reason, and only a delete works.
    Lost,
}

/// Where a run that came back after its node was lost came back from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Recovered {
    /// The node that was lost.
    pub node: String,
    /// The checkpoint its files came back from.
    pub checkpoint: Ulid,
    /// When that checkpoint was taken: what the run wrote after it is gone.
    #[serde(with = "time::serde::rfc3339")]
    pub state_at: OffsetDateTime,
    /// What was lost, in words.
    pub lost: String,
}

/// What happens to a run when its TTL passes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub enum OnExpire {
    /// It is destroyed.
    #[default]
    Delete,
    /// It is paused and kept for the server's retention
    /// (`--paused-retention-sec`, default 7 days), then destroyed; a resume
    /// before then gives it a fresh TTL of the length it was created with.
    Pause,
    /// It is hibernated (processes and memory dropped, its disk kept) and
    /// kept for the server's retention (`--hibernated-retention-sec`,
    /// default 7 days), then destroyed; a wake before then gives it a fresh
    /// TTL of the length it was created with.
    Hibernate,
    /// It is archived (its disk sent to the checkpoint store, nothing left
    /// on the node) and kept for the server's retention
    /// (`--archive-delete-after-sec`, default 30 days), then destroyed with
    /// its archive; a restore before then gives it a fresh TTL of the
    /// length it was created with.
    Archive,
}

/// `idle` on `POST /v1/runs`: what happens to a run nobody uses. A run is
/// idle while no data-plane connection is open to it (an exec stream, a
/// WebSocket session, an attach, a process output stream, a preview
/// request, a port connection) and its egress proxy has no request in
/// flight; the clock starts when the last one closes. 0 turns a step off;
/// an absent field takes the server's default (`--idle-pause-sec`,
/// `--idle-hibernate-sec`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct IdlePolicy {
    /// Pause the run after this many idle seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(maximum = 31536000))]
    pub pause_after_sec: Option<u64>,
    /// Hibernate the run after this many idle seconds (counted from the
    /// same moment as `pauseAfterSec`, so it should be the longer one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(maximum = 31536000))]
    pub hibernate_after_sec: Option<u64>,
}

/// `warm` on `POST /v1/runs`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WarmRequest {
    /// The repository, `owner/name` (letters, digits, `-`, `_`, `.`;
    /// matched without regard to case).
    #[cfg_attr(
        feature = "openapi",
        schema(pattern = "^[A-Za-z0-9][A-Za-z0-9._-]{0,99}/[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
    )]
    pub repo: String,
    /// Where the volume is mounted in the run (absolute; default `/work`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
}

/// A run's warm volume, as the API shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct RunWarm {
    /// The repository (canonical: lower case).
    pub repo: String,
    /// Where the volume is mounted in the run.
    pub path: String,
    /// Whether the volume started from a template (false: it started empty).
    pub booted: bool,
    /// The template generation it started from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<String>,
    /// The lockfile hash of that template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lock_hash: Option<String>,
    /// Where that template's repository is in the run (the volume, or its
    /// one subdirectory holding lockfiles).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repo_dir: Option<String>,
}

/// `POST /v1/runs/{id}/warm-commit`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WarmCommitRequest {
    /// The repository to publish under (default: the run's own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repo: Option<String>,
}

/// A repository's warm template: one immutable generation of a volume.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct WarmTemplate {
    /// The repository (canonical: lower case).
    pub repo: String,
    /// The tenant whose template it is (absent: the operator's). Each
    /// tenant has its own set: a tenant's runs start from and commit to
    /// its own templates only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// The generation's id (a ULID); every commit makes a new one.
    pub generation: String,
    /// The hash of the lockfile set (`sha256:…`): paths and contents.
    pub lock_hash: String,
    /// The lockfiles hashed, relative to the repository directory.
    pub lockfiles: Vec<String>,
    /// Where the repository was in the committing run: the volume's path,
    /// or its one subdirectory holding lockfiles.
    pub repo_dir: String,
    /// The volume's path in the committing run.
    pub path: String,
    /// Bytes of file data.
    pub bytes: u64,
    /// Regular files.
    pub files: u64,
    /// The run that committed it.
    pub run: Ulid,
    /// When it was committed (RFC 3339).
    #[serde(with = "time::serde::rfc3339")]
    pub committed_at: OffsetDateTime,
    /// When a run last started from it, or it was committed (RFC 3339);
    /// eviction drops the least recently used first.
    #[serde(with = "time::serde::rfc3339")]
    pub last_used_at: OffsetDateTime,
}

/// `GET /v1/warmcache`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct WarmTemplateList {
    /// Every repository's current template, by repository.
    pub templates: Vec<WarmTemplate>,
    /// Bytes the cache holds (templates and generations runs still use).
    pub bytes: u64,
    /// The most it keeps (`--cache-max-gb`).
    pub max_bytes: u64,
}

/// The answer to a warm commit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct WarmCommit {
    /// The repository.
    pub repo: String,
    /// The lockfile hash of what was published.
    pub lock_hash: String,
    /// Where the repository is in the run.
    pub repo_dir: String,
    /// The template now published.
    pub template: WarmTemplate,
}

/// `GET /v1/runs/{id}/warm`: the volume as it is now.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct WarmStatus {
    /// The run's repository.
    pub repo: String,
    /// The hash of the volume's lockfile set now.
    pub lock_hash: String,
    /// The lockfiles hashed, relative to `repoDir`.
    pub lockfiles: Vec<String>,
    /// Where the repository is in the run now.
    pub repo_dir: String,
    /// The lockfile hash of the template the run started from, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub booted_lock_hash: Option<String>,
    /// The lockfile hash of the repository's current template, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template_lock_hash: Option<String>,
}

/// When a create pulls its image from a registry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "kebab-case")]
pub enum PullPolicy {
    /// Pull only when no stored image has this name or reference.
    #[default]
    IfNotPresent,
    /// Pull every time: a reference whose tag moved replaces the stored
    /// image for new runs (live runs keep what they mount); a local name is
    /// `400 bad_request`.
    Always,
    /// Never pull: a reference that is not stored is `404 image_not_found`.
    Never,
}

/// Where a run is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum RunStatus {
    /// Resources are being set up; not yet usable.
    Creating,
    /// The sandbox and its agent are up.
    Running,
    /// Paused: every process of the run is stopped where it was, its memory,
    /// open files and connections kept; it uses no CPU. The next call that
    /// reaches it (exec, files, processes, sessions, previews, ports,
    /// snapshots, forks) resumes it first; so does `POST .../resume`.
    Paused,
    /// Hibernated: its processes and memory are gone and it holds no CPU,
    /// memory, network namespace, proxy or capacity slot, only its disk
    /// (root-filesystem writes, `/work`, a warm volume) and its record. The
    /// next call that reaches it boots it again on that disk under the same
    /// id (a wake); so does `POST .../wake`.
    Hibernated,
    /// Archived: its disk is in the checkpoint store and nothing of it is on
    /// the node but its record. The next call that reaches it restores it
    /// (download, a fresh disk, boot) under the same id; so does
    /// `POST .../wake`.
    Archived,
    /// Being destroyed.
    Stopping,
    /// Its node of a fleet was declared gone and it could not come back
    /// (its `onNodeLoss` is `lost`, or there was nothing to restore it
    /// from); `failure` says why. Only a delete works.
    Lost,
    /// The sandbox died on its own (its init process exited) and the
    /// restart policy did not bring it back, or a wake failed; `failure`
    /// says why. It keeps its disk until it is deleted or its TTL passes;
    /// execs and file operations answer `run_failed`, and
    /// `POST .../wake` boots it again.
    Failed,
}

/// A run as the API shows it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Run {
    /// The run's ULID.
    pub id: Ulid,
    /// The node that hosts the run.
    pub server: String,
    /// Where clients may reach the node that hosts the run directly (its
    /// `--client-advertise` origin), on a node of a fleet that gives one.
    /// Any node answers for the run either way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_origin: Option<String>,
    /// The image the run was created from.
    pub image: String,
    /// The network tier in force.
    pub network: NetworkTier,
    /// The limits in force.
    pub limits: Limits,
    /// The OCI runtime that isolates the run (`runc`, `crun`, `runsc`).
    pub runtime: String,
    /// Creation time (RFC 3339).
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    /// When the reaper destroys the run unless it is renewed (RFC 3339).
    #[serde(with = "time::serde::rfc3339")]
    pub expires_at: OffsetDateTime,
    /// Lifecycle status.
    pub status: RunStatus,
    /// The writable lease in force, if any (a lapsed lease is not shown).
    #[serde(default)]
    pub lease: Option<Lease>,
    /// The last lease generation issued on the run (absent: none ever
    /// was): a credential with a lower one is superseded. On a node of a
    /// fleet the catalog keeps the highest ever published, so it never
    /// goes back wherever the run is answered from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_generation: Option<u64>,
    /// The run's own allowlist entries, canonical (`allowlist` tier).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub egress_allow: Vec<EgressEntry>,
    /// False when the built-in list of registries and forges does not
    /// apply to the run (`egressDefaults: false`); absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_defaults: Option<bool>,
    /// True when the run has a SOCKS5 door (`egressSocks5`); absent
    /// otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_socks5: Option<bool>,
    /// The run's own upstream proxy, without its password
    /// (`socks5://user@host:port`); absent when it has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_upstream: Option<String>,
    /// The secrets the run may use, by name (declared and brought; never
    /// a value).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<String>,
    /// Traffic through the run's egress proxy (`allowlist` tier) since the
    /// daemon started serving it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<EgressStats>,
    /// Why the run failed (status `failed` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
    /// Bytes the run has written to its own filesystem, as its disk limit
    /// counts them (the filesystem updates the count within about 30 s);
    /// absent where nothing counts them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_used_bytes: Option<u64>,
    /// The run's warm volume, if it was created with one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm: Option<RunWarm>,
    /// The size tier it was created with, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<SizeTier>,
    /// Its labels.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Whether the create was served by a warm pool (the run was made
    /// ahead of time and handed out; everything per-create applied then).
    #[serde(default)]
    pub pooled: bool,
    /// Whether its ports are served by host without a token
    /// (`publicPorts` at create).
    #[serde(default)]
    pub public_ports: bool,
    /// Whether a call that reaches it while it is paused resumes it
    /// (`autoResume` at create).
    #[serde(default = "yes")]
    pub auto_resume: bool,
    /// What happens at its TTL.
    #[serde(default)]
    pub on_expire: OnExpire,
    /// What becomes of it when its node is declared gone.
    #[serde(default)]
    pub on_node_loss: OnNodeLoss,
    /// It came back on another node after its node was lost: from what,
    /// and what was lost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovered: Option<Recovered>,
    /// When it pauses or hibernates on its own for want of use (the
    /// server's defaults filled in; 0 is off).
    #[serde(default)]
    pub idle: IdlePolicy,
    /// Its history settings; absent: it keeps no history.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub history: Option<HistorySettings>,
    /// How many times the daemon booted it again after its init exited on
    /// its own (the restart policy).
    #[serde(default)]
    pub restarts: u32,
    /// Whether its commands may gain privileges through setuid programs
    /// (`allowPrivilegeEscalation` at create, or its parent's for a fork).
    #[serde(default)]
    pub allow_privilege_escalation: bool,
    /// The volumes it mounts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<RunVolume>,
    /// When it was last booted again by the restart policy.
    #[serde(
        default,
        with = "time::serde::rfc3339::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub restarted_at: Option<OffsetDateTime>,
    /// When its disk went to the checkpoint store (status `archived`).
    #[serde(
        default,
        with = "time::serde::rfc3339::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub archived_at: Option<OffsetDateTime>,
    /// Why its last archive failed; it stays hibernated, and an automatic
    /// archive is tried again later.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub archive_error: Option<String>,
    /// The tenant that made it (absent: the operator's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Its run token: drives this run only (exec, files, processes,
    /// sessions, previews), for the agent inside it or a browser. On the
    /// answers to a create, a fork and `GET /v1/runs/{id}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}

fn yes() -> bool {
    true
}

/// Egress accounting of one run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct EgressStats {
    /// Bytes the run sent through its proxy.
    pub bytes_up: u64,
    /// Bytes the run received through its proxy.
    pub bytes_down: u64,
    /// Requests the proxy handled (CONNECTs and plain requests, allowed or
    /// denied).
    pub requests: u64,
}

/// A writable lease: while it is active, only its holder, presenting this
/// generation, may exec or write files in the run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Lease {
    /// The owner the lease was granted to.
    pub holder: String,
    /// The fencing token issued with this grant; every grant issues a new,
    /// higher one.
    pub generation: u64,
    /// When the lease lapses unless renewed (RFC 3339).
    #[serde(with = "time::serde::rfc3339")]
    pub expires_at: OffsetDateTime,
}

/// `POST /v1/runs/{id}/lease`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LeaseRequest {
    /// Who takes the lease (1-128 characters, no control characters).
    pub owner: String,
    /// How long it lasts unless renewed, in seconds (1-86400, default 300).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 86400))]
    pub ttl_sec: Option<u64>,
}

/// `POST /v1/runs/{id}/lease/renew`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LeaseRenewRequest {
    /// The holder.
    pub owner: String,
    /// The generation it was granted.
    pub generation: u64,
    /// New lifetime from now, in seconds (1-86400, default 300).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 86400))]
    pub ttl_sec: Option<u64>,
}

/// `POST /v1/runs/{id}/lease/release`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LeaseReleaseRequest {
    /// The holder.
    pub owner: String,
    /// The generation it was granted.
    pub generation: u64,
}

/// The answer to a lease grant or renewal.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct LeaseResponse {
    /// The lease in force.
    pub lease: Lease,
}

/// `GET /v1/runs`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct RunList {
    /// The node that answered.
    pub server: String,
    /// Runs ordered by id (so by creation time).
    pub runs: Vec<Run>,
}

/// `POST /v1/runs/{id}/renew`.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RenewRequest {
    /// New time to live from now, in seconds (capped by the server maximum).
    #[cfg_attr(feature = "openapi", schema(minimum = 1))]
    pub ttl_sec: u64,
}

/// `POST /v1/runs/{id}/move`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RunMoveRequest {
    /// The node to move the run to (its id in `GET /v1/cluster`); default:
    /// the best node that can take it, as placement picks for a create.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
}

/// `POST /v1/volumes/{name}/move` (to another node; a file's move within a
/// volume is [`VolumeMoveRequest`]).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VolumeNodeMoveRequest {
    /// The node to move the volume to (its id in `GET /v1/cluster`);
    /// default: the node with the most room that shares this node's
    /// checkpoint bucket and can make volumes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
}

/// `POST /v1/runs/{id}/snapshot`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SnapshotRequest {
    /// The image name to record the snapshot under (image name rules);
    /// default: a generated `snap-<ulid>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(pattern = "^[a-z0-9][a-z0-9._-]{0,63}$"))]
    pub name: Option<String>,
    /// Labels of the snapshot's image (the run label rules), for
    /// `GET /v1/snapshots?label=`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
    /// Snapshot the run's files as they were at this history point
    /// instead of as they are.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub point: Option<Ulid>,
}

/// A snapshot: an image made of a run's image layers plus one layer with
/// everything the run changed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Snapshot {
    /// The snapshot's image name: give it as `image` to create a run from it.
    pub image: String,
    /// The image the run was created from.
    pub parent: String,
    /// The run it was taken from.
    pub run: Ulid,
    /// The new layer's key: `local:<ulid>` for the run's copy kept in the
    /// run store as the layer (constant cost), or a `sha256:` digest
    /// (diff_id) for a layer written as a tar (a run with a warm volume).
    pub layer: String,
    /// Bytes of file data in the new layer.
    pub layer_bytes: u64,
    /// How long the run was frozen, in milliseconds.
    pub frozen_ms: f64,
    /// How long the whole snapshot took, in milliseconds.
    pub elapsed_ms: f64,
    /// The volumes the run mounts, by name: not part of it (a volume's
    /// data is the volume's); empty when it mounts none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes_excluded: Vec<String>,
}

/// `POST /v1/runs/{id}/checkpoint` (the body may be empty).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CheckpointRequest {
    /// Labels for the checkpoint (the rules of a run's labels); default:
    /// none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
}

/// A run's disk and settings, kept in the checkpoint store.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Checkpoint {
    /// Its id: give it as `checkpoint` to `POST /v1/runs`.
    pub id: Ulid,
    /// The run it was taken from.
    pub run: Ulid,
    /// That run's image.
    pub image: String,
    /// When it was taken.
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    /// When the store's sweep removes it (`--checkpoint-ttl-hours`); null:
    /// kept until deleted.
    #[serde(default, with = "time::serde::rfc3339::option")]
    pub expires_at: Option<OffsetDateTime>,
    /// Bytes it takes in the store (compressed layers and its record).
    pub stored_bytes: u64,
    /// Bytes of file data in the run's disk layer.
    pub disk_bytes: u64,
    /// Its labels.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// The node that took it.
    pub server: String,
    /// The tenant whose run it was taken from; absent: the operator's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// The volumes the run mounts, by name: not part of it (a volume's
    /// data is the volume's); empty when it mounts none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes_excluded: Vec<String>,
    /// The secrets the run's caller brought, by name: never part of a
    /// checkpoint (a run made from it has them only if its create brings
    /// them again); empty when there were none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets_excluded: Vec<String>,
}

/// `GET /v1/checkpoints`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CheckpointList {
    /// Every committed checkpoint, oldest first.
    pub checkpoints: Vec<Checkpoint>,
}

/// `POST /v1/runs/{id}/fork`.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ForkRequest {
    /// How many children (1 to the server's `--max-fork-count`, default 16).
    #[cfg_attr(feature = "openapi", schema(minimum = 1))]
    pub count: usize,
    /// Each child's time to live (default: the server's default TTL).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 1))]
    pub ttl_sec: Option<u64>,
    /// Fork the run's files as they were at this history point instead
    /// of as they are.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub point: Option<Ulid>,
}

/// The answer to a fork: the children, running.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ForkResponse {
    /// The new runs.
    pub runs: Vec<Run>,
    /// The volumes the parent mounts, by name: the children mount none of
    /// them (a volume's data is the volume's); empty when it mounts none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes_excluded: Vec<String>,
}

/// `POST /v1/runs/{id}/exec`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ExecRequest {
    /// The command and its arguments; `cmd[0]` is looked up in `PATH`.
    pub cmd: Vec<String>,
    /// Working directory: absolute, or relative to `/work` (the default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// Kill the command's process group after this many seconds (1 to the
    /// server's maximum TTL).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 1))]
    pub timeout_sec: Option<u64>,
    /// Extra environment for this command; overrides the run's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<Env>,
    /// The lease holder this exec acts for; needed while a lease is active.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// The generation of that holder's lease; given together with `owner`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<u64>,
    /// Who runs the command: `name`, `uid`, `name:group` or `uid:gid` as
    /// the run's `/etc/passwd` and `/etc/group` know them (default: the
    /// image's `User`, else root).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Text written to the command's standard input, which is then closed.
    /// Without it (and without `openStdin` or a terminal) stdin is empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin: Option<String>,
    /// Run the command on a new terminal of this size: one output stream
    /// (`stdout`), line editing, `^C` as SIGINT, `TERM` as given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<PtySpec>,
    /// Background processes only: a name to find the process by (1-64 of
    /// letters, digits, `.`, `_`, `-`; not all digits), unique among the
    /// run's running processes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    /// Background processes only: keep stdin open for later input
    /// (`POST .../processes/{p}/stdin`, or an attached WebSocket).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub open_stdin: bool,
}

/// A terminal's size and type.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PtySpec {
    /// Lines, 1-10000.
    pub rows: u32,
    /// Columns, 1-10000.
    pub cols: u32,
    /// `TERM` for the command (default: `xterm-256color`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub term: Option<String>,
}

/// A process in a run: a background one, or a foreground exec while it
/// runs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Process {
    /// Its pid inside the run (also its process group id).
    pub pid: u32,
    /// Its tag, if it was given one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    /// The command and its arguments.
    pub cmd: Vec<String>,
    /// Its working directory.
    pub cwd: String,
    /// Who it runs as, as given (absent: root).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// When it started (RFC 3339).
    #[serde(with = "time::serde::rfc3339")]
    pub started_at: OffsetDateTime,
    /// Started as a background process (kept after it ended).
    pub background: bool,
    /// It runs on a terminal.
    pub pty: bool,
    /// Its stdin takes input now.
    pub stdin_open: bool,
    /// Still running.
    pub running: bool,
    /// How it ended, once it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit: Option<ProcessExit>,
    /// When it ended (RFC 3339).
    #[serde(
        default,
        with = "time::serde::rfc3339::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub ended_at: Option<OffsetDateTime>,
}

/// How a process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ProcessExit {
    /// Exit status; 128 + signal when a signal ended it.
    pub exit_code: i32,
    /// The signal that ended it, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    /// Its `timeoutSec` elapsed and runbox killed it.
    pub timed_out: bool,
}

/// `GET /v1/runs/{id}/processes`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ProcessList {
    /// Running processes and recently ended background ones, in start
    /// order.
    pub processes: Vec<Process>,
}

/// `POST /v1/runs/{id}/processes/{process}/signal`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SignalRequest {
    /// A signal name (`TERM`, `SIGINT`, ...) or number.
    pub signal: SignalSpec,
    /// The lease holder this acts for; needed while a lease is active.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// The generation of that holder's lease.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<u64>,
}

/// A signal as a client names it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(untagged)]
pub enum SignalSpec {
    /// A Linux signal number.
    Number(i32),
    /// A name, with or without `SIG`, in any case.
    Name(String),
}

/// The Linux signals by name (x86-64 and arm64 agree on these numbers).
pub const SIGNALS: &[(&str, i32)] = &[
    ("HUP", 1),
    ("INT", 2),
    ("QUIT", 3),
    ("ILL", 4),
    ("TRAP", 5),
    ("ABRT", 6),
    ("BUS", 7),
    ("FPE", 8),
    ("KILL", 9),
    ("USR1", 10),
    ("SEGV", 11),
    ("USR2", 12),
    ("PIPE", 13),
    ("ALRM", 14),
    ("TERM", 15),
    ("CHLD", 17),
    ("CONT", 18),
    ("STOP", 19),
    ("TSTP", 20),
    ("TTIN", 21),
    ("TTOU", 22),
    ("URG", 23),
    ("XCPU", 24),
    ("XFSZ", 25),
    ("VTALRM", 26),
    ("PROF", 27),
    ("WINCH", 28),
    ("IO", 29),
    ("PWR", 30),
    ("SYS", 31),
];

impl SignalSpec {
    /// The signal's number, if it names one (1-64).
    pub fn number(&self) -> Option<i32> {
        match self {
            Self::Number(n) => (1..=64).contains(n).then_some(*n),
            Self::Name(name) => {
                let upper = name.to_ascii_uppercase();
                let bare = upper.strip_prefix("SIG").unwrap_or(&upper);
                // Digits only: `parse` would also take a sign.
                if !bare.is_empty() && bare.bytes().all(|b| b.is_ascii_digit()) {
                    let n = bare.parse::<i32>().unwrap_or(0);
                    return (1..=64).contains(&n).then_some(n);
                }
                SIGNALS
                    .iter()
                    .find(|(known, _)| *known == bare)
                    .map(|(_, n)| *n)
            }
        }
    }
}

/// `POST /v1/runs/{id}/preview`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PreviewRequest {
    /// The port inside the run (1-65535).
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 65535))]
    pub port: u32,
    /// How long the URL works, in seconds (1-604800, default 3600).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 604800))]
    pub ttl_sec: Option<u64>,
}

/// A minted preview URL.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Preview {
    /// The URL to open: the preview listener, `/p/{token}/`.
    pub url: String,
    /// The signed token in it.
    pub token: String,
    /// The run.
    pub run: Ulid,
    /// The port inside the run.
    pub port: u16,
    /// When the URL stops working (RFC 3339).
    #[serde(with = "time::serde::rfc3339")]
    pub expires_at: OffsetDateTime,
}

/// `GET /v1/runs/{id}/processes/{process}/output` and `.../wait`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProcessQuery {
    /// `output`: replay the recent output kept for the process first
    /// (default true).
    #[serde(default)]
    pub replay: Option<bool>,
    /// `wait`: the longest to wait, in seconds (0-3600, default 60).
    #[serde(default)]
    pub timeout_sec: Option<u64>,
}

/// Why an exec stream ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum ExitReason {
    /// The command exited by itself.
    Exited,
    /// A signal ended the command.
    Signaled,
    /// `timeoutSec` elapsed and runbox killed the process group.
    Timeout,
    /// The run reached its TTL and was destroyed under the command.
    RunExpired,
    /// The run was deleted under the command.
    RunDeleted,
    /// The run moved to another node of the fleet under the command (its
    /// processes ended with the hibernation a move begins with).
    RunMoved,
    /// The run's agent stopped answering; the command's fate is unknown.
    AgentLost,
}

/// The final event of an exec stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ExitEvent {
    /// Exit status; 128 + signal when a signal ended the command; -1 when
    /// unknown (`agentLost`).
    pub exit_code: i32,
    /// The history point the command's changes were kept as (runs with
    /// `history`; absent when it changed no file).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub point: Option<Ulid>,
    /// True when `timeoutSec` elapsed and the process group was killed.
    pub timed_out: bool,
    /// The signal that ended the command, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    /// Why the stream ended.
    pub reason: ExitReason,
}

/// The first event of an exec stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct StartedEvent {
    /// The command's pid inside the run.
    pub pid: u32,
}

/// Names of the server-sent events of an exec stream.
pub mod sse {
    /// `data` is a [`super::StartedEvent`] as JSON.
    pub const STARTED: &str = "started";
    /// `data` is a chunk of standard output, base64 (standard alphabet, padded).
    pub const STDOUT: &str = "stdout";
    /// `data` is a chunk of standard error, base64 (standard alphabet, padded).
    pub const STDERR: &str = "stderr";
    /// `data` is an [`super::ExitEvent`] as JSON; always the last event.
    pub const EXIT: &str = "exit";
    /// `data` is a [`super::LostEvent`] as JSON: a reader attached to a
    /// process fell behind and skipped output.
    pub const LOST: &str = "lost";
}

/// Output skipped for an attached reader that fell behind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct LostEvent {
    /// How many output chunks were skipped.
    pub chunks: u64,
}

/// An image as the API shows it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Image {
    /// The image's name.
    pub name: String,
    /// The node that stores the image.
    pub server: String,
    /// Bytes of file data in its layers, unpacked.
    pub size_bytes: u64,
    /// Import time (RFC 3339).
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    /// Where it came from: `rootfs`, `oci-layout`, `docker-save`, or the
    /// registry reference it was pulled from.
    pub source: String,
    /// Its layers, base first: `sha256:` digests (diff_ids), and
    /// `local:<ulid>` for a snapshot layer kept in the run store. Layers are
    /// stored once and shared.
    pub layers: Vec<String>,
    /// The image config document (OCI image configuration); only on
    /// `GET /v1/images/{name}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<serde_json::Value>,
    /// The tenant whose snapshot (or restored checkpoint) it is; absent:
    /// shared by everyone the tenant rules allow.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Its labels (a snapshot's, given when it was taken).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// On a pull's answer only: whether the image is new, was replaced by
    /// what the reference names now, or was up to date already.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pull: Option<PullOutcome>,
}

/// What a pull did to the image.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub enum PullOutcome {
    /// No image had this name: it is new.
    New,
    /// The reference names other content now (a moved tag): the image was
    /// replaced; runs made from it keep their layers.
    Updated,
    /// The image already holds what the reference names.
    UpToDate,
}

/// `POST /v1/images/pull`.
#[derive(Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PullRequest {
    /// What to pull: `[registry/]repository[:tag][@digest]`; Docker Hub and
    /// `:latest` are the defaults, as with `docker pull`.
    #[cfg_attr(
        feature = "openapi",
        schema(min_length = 1, max_length = 512, pattern = r"^\S+$")
    )]
    pub reference: String,
    /// The image's name here; default: derived from the repository and tag.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Registry user for basic or token auth.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    /// Registry password or token; never logged or stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password: Option<String>,
}

impl fmt::Debug for PullRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PullRequest")
            .field("reference", &self.reference)
            .field("name", &self.name)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// One progress event of a pull (`event: progress` on the pull stream).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "kind", rename_all = "camelCase")]
pub enum PullEvent {
    /// The image manifest for this platform is known.
    #[serde(rename_all = "camelCase")]
    Resolved {
        /// The manifest's digest.
        digest: String,
        /// How many layers it has.
        layers: usize,
    },
    /// A layer starts downloading.
    #[serde(rename_all = "camelCase")]
    LayerStarted {
        /// The layer's digest.
        digest: String,
        /// Its size in bytes.
        size: u64,
    },
    /// More of a layer arrived.
    #[serde(rename_all = "camelCase")]
    LayerProgress {
        /// The layer's digest.
        digest: String,
        /// Bytes so far.
        done: u64,
        /// Its size in bytes.
        size: u64,
    },
    /// The layer was already stored; nothing was fetched.
    #[serde(rename_all = "camelCase")]
    LayerSkipped {
        /// The layer's digest.
        digest: String,
    },
    /// The layer arrived, was verified and unpacked.
    #[serde(rename_all = "camelCase")]
    LayerDone {
        /// The layer's digest.
        digest: String,
    },
}

/// Names of the server-sent events of a pull stream.
pub mod pull_sse {
    /// `data` is a [`super::PullEvent`] as JSON.
    pub const PROGRESS: &str = "progress";
    /// `data` is the pulled [`super::Image`]; always the last event on success.
    pub const DONE: &str = "done";
    /// `data` is an [`super::ErrorDetail`]; always the last event on failure.
    pub const ERROR: &str = "error";
}

/// What a snapshot image's `source` starts with: `snapshot:<run>:<parent>`.
pub const SNAPSHOT_SOURCE_PREFIX: &str = "snapshot:";

impl Image {
    /// Whether this image is a snapshot of a run.
    pub fn is_snapshot(&self) -> bool {
        self.source.starts_with(SNAPSHOT_SOURCE_PREFIX)
    }

    /// The run a snapshot image was taken from (`snapshot:<run>:<parent>`).
    pub fn snapshot_of(&self) -> Option<&str> {
        self.source
            .strip_prefix(SNAPSHOT_SOURCE_PREFIX)?
            .split(':')
            .next()
    }
}

/// `GET /v1/snapshots`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct SnapshotList {
    /// The node that answered.
    pub server: String,
    /// Snapshot images ordered by name.
    pub snapshots: Vec<Image>,
}

/// `DELETE /v1/snapshots?image=NAME`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SnapshotQuery {
    /// The snapshot's image name.
    pub image: String,
}

/// `GET /v1/images`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ImageList {
    /// The node that answered.
    pub server: String,
    /// Images ordered by name.
    pub images: Vec<Image>,
}

/// One warm pool as configured: runs of `image` on `network` at `size`,
/// kept ready so a create of the same three is served at once.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolSpec {
    /// A stored image's local name.
    #[cfg_attr(feature = "openapi", schema(pattern = "^[a-z0-9][a-z0-9._-]{0,63}$"))]
    pub image: String,
    /// The network tier (default `none`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkTier>,
    /// The size tier (default `small`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<SizeTier>,
    /// Runs kept ready (default 4 when neither this nor `warmMax` is given;
    /// 0 keeps none until demand raises the target under a `warmMax`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(maximum = 1024))]
    pub warm: Option<u32>,
    /// The most the target rises to while claims come faster than runs are
    /// made (default: no rise; at least `warm`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(maximum = 1024))]
    pub warm_max: Option<u32>,
    /// A command run in every member before it joins the pool (to touch
    /// what a first command needs); a failure leaves the pool unfilled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warmup: Option<Vec<String>>,
}

/// `PUT /v1/pools`, and the pools file (`--pools`, `<state>/pools.json`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolSet {
    /// Every pool; pools not listed are drained.
    pub pools: Vec<PoolSpec>,
}

/// One pool as it is now.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct PoolStatus {
    /// Its image.
    pub image: String,
    /// Its network tier.
    pub network: NetworkTier,
    /// Its size tier.
    pub size: SizeTier,
    /// The configured number of ready runs.
    pub warm: u32,
    /// The configured ceiling of the adaptive target, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm_max: Option<u32>,
    /// The warmup command, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warmup: Option<Vec<String>>,
    /// The number of ready runs it aims for now (`warm`, or higher under
    /// demand up to `warmMax`).
    pub target: u32,
    /// Runs ready to be handed out.
    pub ready: u32,
    /// Runs being made for it.
    pub refilling: u32,
    /// Creates it has served since the daemon started.
    pub claims: u64,
    /// Creates that matched it while it had no ready run (served cold).
    pub misses: u64,
    /// Why the last refill failed, if the last one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

/// `GET /v1/pools`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct PoolList {
    /// Every pool, by image, network and size.
    pub pools: Vec<PoolStatus>,
    /// Whether the node is cordoned (pools drained, creates refused).
    pub draining: bool,
    /// What a drain that moved the node's runs away did with each
    /// (`POST /v1/drain` with `migrate`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migrated: Option<DrainMigration>,
}

/// `POST /v1/drain`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DrainRequest {
    /// Move every run off the node as well (each as `POST
    /// /v1/runs/{id}/move` would, a few at a time), after cordoning it;
    /// default: cordon only, the runs stay.
    #[serde(default)]
    pub migrate: bool,
}

/// The runs a drain moved away, and those it could not.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct DrainMigration {
    /// Each run moved, and its node now.
    pub moved: Vec<MovedRun>,
    /// Each run that stayed, and why.
    pub failed: Vec<UnmovedRun>,
}

/// A run a drain moved.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct MovedRun {
    /// The run.
    pub id: Ulid,
    /// The node it is on now.
    pub node: String,
}

/// A run a drain could not move.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct UnmovedRun {
    /// The run.
    pub id: Ulid,
    /// Why (the error a move of it answered).
    pub error: ErrorDetail,
}

/// Run counts of `GET /v1/info`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Capacity {
    /// `--max-runs`.
    pub max: usize,
    /// Runs counted against it: running, failed, being created or torn
    /// down (idle pool members excluded).
    pub live: usize,
    /// Of those, runs being created.
    pub creating: usize,
    /// Idle pool members, ready or being made.
    pub pooled: usize,
}

/// Storage of `GET /v1/info`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct StorageInfo {
    /// Bytes in use on the run store's filesystem.
    pub used_bytes: u64,
    /// Its size in bytes.
    pub total_bytes: u64,
}

/// `GET /v1/info`: what the node is and how full.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Info {
    /// The node's id.
    pub server: String,
    /// The daemon's version.
    pub version: String,
    /// The isolation lane, e.g. `oci/crun`.
    pub runtime: String,
    /// Run counts.
    pub capacity: Capacity,
    /// The warm pools.
    pub pools: Vec<PoolStatus>,
    /// Whether the node is cordoned.
    pub draining: bool,
    /// The run store, where it can be measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage: Option<StorageInfo>,
    /// How new runs' ids relate to the host's: `private` (each run has a
    /// user namespace of its own, and root in it is an unprivileged id on
    /// the host) or `off` (runs share the host's ids; `runbox serve
    /// --userns off`).
    #[serde(default)]
    pub userns: String,
    /// What this server can do, for a manager to read before it sends a
    /// policy (see docs/api.md "Capability catalog").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub catalog: Option<Catalog>,
}

/// What a server can do: what a manager that drives sandboxes for many
/// users reads before it sends a policy, so it enforces what the server
/// can and refuses what it cannot instead of guessing.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Catalog {
    /// What an egress policy can name: `none` (no allowlist tier),
    /// `hosts` or `hosts-and-cidrs`.
    pub egress_control: String,
    /// `native` when a secret a caller brings is injected at the edge and
    /// never enters the run; `none` when this server has no egress proxy.
    pub secret_brokering: String,
    /// The network tiers new runs may have.
    pub networks: Vec<NetworkTier>,
    /// The egress features.
    pub egress: EgressCatalog,
    /// What survives and what can be copied.
    pub persistence: PersistenceCatalog,
    /// The isolation lanes and what they isolate with.
    pub lanes: Vec<LaneCatalog>,
    /// The size tiers, with their limits and whether this server's maxima
    /// admit them.
    pub sizes: Vec<SizeCatalog>,
    /// The server's maxima.
    pub limits: LimitsCatalog,
}

/// The egress features of a server.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct EgressCatalog {
    /// Rule objects with ports, methods, secret and intercept.
    pub rules: bool,
    /// `PATCH /v1/runs/{id}/egress`.
    pub live_update: bool,
    /// Entries per run.
    pub max_entries: u32,
    /// Secrets per run.
    pub max_secrets: u32,
    /// Secret names the operator declared (a run asks for them by name).
    pub declared_secrets: Vec<String>,
    /// Whether the built-in list of registries and forges applies to
    /// runs that do not turn it off.
    pub default_list: bool,
    /// A SOCKS5 door for non-HTTP clients.
    pub socks5: bool,
    /// Routing a run's egress through an upstream proxy.
    pub upstream_proxies: bool,
    /// The egress classes tenants can be bound to, by name.
    #[serde(default)]
    pub classes: Vec<String>,
}

/// What survives a run's sleep and what can be copied from it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct PersistenceCatalog {
    /// `same-sandbox`: a paused, hibernated or archived run is resumed as
    /// itself (same id, same disk).
    pub resume: String,
    /// `filesystem`: snapshots, forks and checkpoints hold a run's files,
    /// not its memory or processes; `none` where runs cannot be captured.
    pub capture: String,
    /// Whether a run can be forked.
    pub clone: bool,
    /// `preserved`: the captured run keeps running.
    pub capture_source: String,
    /// `caller-managed` (checkpoints are kept until deleted) or
    /// `provider-managed` (the server deletes them after its TTL).
    pub retention: String,
    /// `new-resource`: a run made from a checkpoint or snapshot is a new
    /// run.
    pub restore_mount: String,
}

/// One isolation lane.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct LaneCatalog {
    /// Its name, e.g. `oci/crun`.
    pub name: String,
    /// `container`: namespaces, cgroups, seccomp and no new privileges on
    /// the host's kernel (no virtual machine).
    pub isolation: String,
    /// `private` or `off`, as `userns`.
    pub userns: String,
}

/// One size tier.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct SizeCatalog {
    /// The tier.
    pub size: SizeTier,
    /// Its limits here (no disk limit where the server has none).
    pub limits: Limits,
    /// Whether this server's maxima admit it.
    pub available: bool,
}

/// A server's maxima.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct LimitsCatalog {
    /// Live runs.
    pub max_runs: usize,
    /// A run's TTL, in seconds.
    pub max_ttl_sec: u64,
    /// The most a run may have.
    pub max: Limits,
    /// What a create without limits gets.
    pub defaults: Limits,
    /// Children of one fork.
    pub max_fork_count: usize,
    /// One upload, in bytes.
    pub max_upload_bytes: u64,
}

/// What a path is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum FileKind {
    /// A regular file.
    File,
    /// A directory.
    Directory,
    /// A symbolic link (described, never followed).
    Symlink,
    /// A FIFO, socket or device.
    Other,
}

/// One path in a run's `/work`, as `stat` and `list` describe it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct FileInfo {
    /// Relative to `/work`; empty for `/work` itself.
    pub path: String,
    /// What it is.
    pub kind: FileKind,
    /// Size in bytes.
    pub size: u64,
    /// Permission bits (with set-id and sticky bits), as a number.
    pub mode: u32,
    /// Owner user id inside the run.
    pub uid: u32,
    /// Owner group id inside the run.
    pub gid: u32,
    /// Last modification (RFC 3339).
    #[serde(with = "time::serde::rfc3339")]
    pub modified_at: OffsetDateTime,
    /// A symlink's target, as stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// Metadata stored with the file, by key: only the E2B surface keeps
    /// any (as `user.e2b.` extended attributes), so runbox's own API never
    /// shows it.
    #[serde(skip)]
    pub metadata: BTreeMap<String, String>,
}

/// `GET /v1/runs/{id}/fs/list`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct FileList {
    /// The entries, in path order.
    pub entries: Vec<FileInfo>,
    /// More entries exist than were returned (raise `limit`, narrow `path`).
    pub truncated: bool,
}

/// `POST /v1/runs/{id}/fs/mkdir`: a directory and its missing parents.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MakeDirRequest {
    /// Relative to `/work`.
    #[cfg_attr(feature = "openapi", schema(min_length = 1))]
    pub path: String,
    /// Permission bits of the directories made (at most 0o7777, default
    /// 0o755).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(maximum = 4095))]
    pub mode: Option<u32>,
    /// The lease holder, when the run is leased.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// The lease generation, with `owner`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<u64>,
}

/// `POST /v1/runs/{id}/fs/move`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MoveRequest {
    /// Relative to `/work`.
    #[cfg_attr(feature = "openapi", schema(min_length = 1))]
    pub from: String,
    /// Relative to `/work`; its parent must exist.
    #[cfg_attr(feature = "openapi", schema(min_length = 1))]
    pub to: String,
    /// Replace an existing `to` (default: refuse with `409 file_exists`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overwrite: Option<bool>,
    /// The lease holder, when the run is leased.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// The lease generation, with `owner`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<u64>,
}

/// `POST /v1/runs/{id}/fs/remove`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RemoveRequest {
    /// Relative to `/work`.
    #[cfg_attr(feature = "openapi", schema(min_length = 1))]
    pub path: String,
    /// Remove a directory with everything in it (default: only an empty one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recursive: Option<bool>,
    /// The lease holder, when the run is leased.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// The lease generation, with `owner`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<u64>,
}

/// The answer to a remove.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct RemoveReply {
    /// Entries removed, the path itself included.
    pub removed: u64,
}

/// The query of `GET /v1/runs/{id}/fs/stat` and `/fs/list`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FsQuery {
    /// Relative to `/work`; absent or empty for `/work` itself.
    #[serde(default)]
    pub path: Option<String>,
    /// Levels to list (1-16, default 1).
    #[serde(default)]
    pub depth: Option<u32>,
    /// The most entries to list (1-10000, default 10000).
    #[serde(default)]
    pub limit: Option<u32>,
    /// `watch`: the directories below too (default false).
    #[serde(default)]
    pub recursive: Option<bool>,
}

/// What a watch saw; the SSE event's name is `kind`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum WatchKind {
    /// The watch is in place: later changes are reported. Always first.
    Ready,
    /// A path appeared.
    Created,
    /// A file opened for writing was closed.
    Written,
    /// A path went away (or was moved out of the watched tree).
    Removed,
    /// `from` was renamed to `path`.
    Renamed,
    /// Events were lost; list the directory again.
    Overflow,
}

/// One event of `GET /v1/runs/{id}/fs/watch`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct WatchEvent {
    /// What happened.
    pub kind: WatchKind,
    /// Relative to `/work` (empty for `ready` and `overflow`).
    pub path: String,
    /// `renamed`: the old path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    /// Whether the path is a directory.
    pub is_dir: bool,
}

/// `GET /health`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Health {
    /// `ok` when the daemon serves requests.
    pub status: String,
    /// The daemon's version.
    pub version: String,
    /// The node's id.
    pub server: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_have_one_spelling_whatever_the_case() {
        let id = Ulid::new();
        let text = id.to_string();
        assert_eq!(parse_id(&text), Some(id));
        assert_eq!(parse_id(&text.to_lowercase()), Some(id));
        // A first character above 7 wraps onto the same 128 bits in a
        // lenient decoder; it is not this id (nor any other).
        let first = text.as_bytes()[0] - b'0';
        let wrapped = format!("{}{}", (b'8' + first) as char, &text[1..]);
        assert_eq!(Ulid::from_string(&wrapped).ok(), Some(id));
        assert_eq!(parse_id(&wrapped), None);
        // Crockford's aliases, padding, percent-encoding: not ids.
        let zeros = "00000000000000000000000000";
        assert_eq!(parse_id(zeros), Some(Ulid::nil()));
        for bad in [
            "O0000000000000000000000000",
            "0000000000000000000000000I",
            "0000000000000000000000000L",
            " 00000000000000000000000000",
            "%300000000000000000000000000",
            "",
            "0000000000000000000000000",
        ] {
            assert_eq!(parse_id(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn signals_are_named_or_numbered() {
        let name = |text: &str| SignalSpec::Name(text.to_owned()).number();
        assert_eq!(name("TERM"), Some(15));
        assert_eq!(name("sigint"), Some(2));
        assert_eq!(name("SIG9"), Some(9));
        assert_eq!(name("064"), Some(64));
        for bad in [
            "",
            "SIG",
            "+9",
            "-9",
            "65",
            "0",
            "SIGSIGTERM",
            "TERM ",
            "ſIGTERM",
        ] {
            assert_eq!(name(bad), None, "{bad:?}");
        }
        assert_eq!(SignalSpec::Number(64).number(), Some(64));
        assert_eq!(SignalSpec::Number(0).number(), None);
        assert_eq!(SignalSpec::Number(-15).number(), None);
    }

    #[test]
    fn env_debug_never_shows_values() {
        let env = Env(BTreeMap::from([("TOKEN".to_owned(), "s3cret".to_owned())]));
        let shown = format!("{env:?}");
        assert!(shown.contains("TOKEN"));
        assert!(!shown.contains("s3cret"));
    }

    #[test]
    fn egress_is_an_alias_for_allowlist() {
        let tier: NetworkTier = serde_json::from_str("\"egress\"").unwrap();
        assert_eq!(tier, NetworkTier::Allowlist);
        assert_eq!(serde_json::to_string(&tier).unwrap(), "\"allowlist\"");
    }

    #[test]
    fn unknown_fields_are_refused() {
        let err = serde_json::from_str::<CreateRunRequest>(r#"{"image":"base","imgae":"x"}"#);
        assert!(err.is_err());
    }
}

/// The frames of the WebSocket endpoints (`GET /v1/runs/{id}/exec/ws` and
/// `GET /v1/runs/{id}/processes/{process}/ws`). Binary frames carry bytes:
/// from the client, stdin; from the server, output, whose first byte says
/// which stream ([`ws::STDOUT`] or [`ws::STDERR`]). Text frames carry one
/// JSON object each, tagged by `type`.
pub mod ws {
    use serde::{Deserialize, Serialize};

    use super::{ExecRequest, ExitEvent, SignalSpec};

    /// First byte of a binary server frame of standard output.
    pub const STDOUT: u8 = 1;
    /// First byte of a binary server frame of standard error.
    pub const STDERR: u8 = 2;

    /// A text frame from the client.
    #[derive(Clone, Debug, Serialize, Deserialize)]
    #[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
    #[serde(tag = "type", rename_all = "camelCase")]
    pub enum ClientFrame {
        /// The command to run: the first frame on `exec/ws`, and only there.
        Start(Box<ExecRequest>),
        /// Text for stdin (binary frames are the other way to send it).
        Stdin {
            /// The text.
            data: String,
        },
        /// Close stdin; on a terminal, send its end-of-file character.
        Eof,
        /// A signal for the command's process group.
        Signal {
            /// A name (`INT`, `SIGTERM`) or number.
            signal: SignalSpec,
        },
        /// The terminal's new size.
        Resize {
            /// Lines, 1-10000.
            rows: u32,
            /// Columns, 1-10000.
            cols: u32,
        },
    }

    /// A text frame from the server.
    #[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
    #[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
    #[serde(tag = "type", rename_all = "camelCase")]
    pub enum ServerFrame {
        /// The command runs (or, attaching, was found) with this pid.
        Started {
            /// Its pid inside the run.
            pid: u32,
        },
        /// This reader fell behind and skipped output.
        Lost {
            /// How many output chunks were skipped.
            chunks: u64,
        },
        /// The command ended; the last frame before the server closes.
        Exit(ExitEvent),
        /// Something the client sent or asked for failed. After a failed
        /// `start` the server closes the socket; after a bad frame it goes
        /// on.
        Error {
            /// The HTTP status that goes with the code.
            status: u16,
            /// The stable code, as in HTTP error bodies.
            code: String,
            /// What to fix.
            message: String,
        },
    }
}
