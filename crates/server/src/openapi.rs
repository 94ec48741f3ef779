//! The OpenAPI 3.1 document of the API: the schemas are generated from the
//! wire types themselves (`runbox-types` with its `openapi` feature), the
//! operations from the table below, one row per route the router serves.
//! `tests/openapi.rs` fails when the table and the router disagree, or when
//! the committed `docs/openapi.json` differs from what this builds.
//!
//! The table is here rather than as attributes on the handlers because
//! most answers are built by hand (streams, upgrades, raw bodies), which
//! an attribute would have to restate anyway; one table reads as the API's
//! index.

use utoipa::openapi::path::{
    HttpMethod, OperationBuilder, Parameter, ParameterBuilder, ParameterIn, PathItem,
};
use utoipa::openapi::request_body::RequestBodyBuilder;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme};
use utoipa::openapi::{
    ContentBuilder, InfoBuilder, ObjectBuilder, OpenApi, OpenApiBuilder, PathsBuilder, Ref, RefOr,
    ResponseBuilder, Schema, Type,
};
use utoipa::OpenApi as _;

use runbox_types as t;

/// Every wire type, so the document's `components` hold them all.
#[derive(utoipa::OpenApi)]
#[openapi(components(schemas(
    t::ErrorBody,
    t::Health,
    t::CreateRunRequest,
    t::Run,
    t::RunList,
    t::RenewRequest,
    t::RunMoveRequest,
    t::VolumeNodeMoveRequest,
    t::DrainRequest,
    t::DrainMigration,
    t::MovedRun,
    t::UnmovedRun,
    t::UpdateEgressRequest,
    t::LeaseRequest,
    t::LeaseRenewRequest,
    t::LeaseReleaseRequest,
    t::LeaseResponse,
    t::ExecRequest,
    t::StartedEvent,
    t::ExitEvent,
    t::LostEvent,
    t::Image,
    t::ImageList,
    t::PullRequest,
    t::PullEvent,
    t::BuildRequest,
    t::BuildStepSpec,
    t::Build,
    t::BuildStatus,
    t::BuildStep,
    t::BuildStepStatus,
    t::BuildFailure,
    t::BuildList,
    t::BuildLog,
    t::BuildContext,
    t::SnapshotRequest,
    t::Snapshot,
    t::SnapshotList,
    t::ForkRequest,
    t::ForkResponse,
    t::HistorySettings,
    t::HistoryList,
    t::HistoryPoint,
    t::PointCause,
    t::PointKind,
    t::ChangeSummary,
    t::HistoryDiff,
    t::PathChange,
    t::PathChangeKind,
    t::PathState,
    t::RollbackRequest,
    t::CheckpointRequest,
    t::Checkpoint,
    t::CheckpointList,
    t::WarmCommitRequest,
    t::WarmCommit,
    t::WarmStatus,
    t::WarmTemplate,
    t::WarmTemplateList,
    t::FileInfo,
    t::FileList,
    t::MakeDirRequest,
    t::MoveRequest,
    t::RemoveRequest,
    t::RemoveReply,
    t::WatchEvent,
    t::PoolSet,
    t::PoolList,
    t::Info,
    t::ClusterStatus,
    t::ClusterNode,
    t::NodeState,
    t::Process,
    t::ProcessList,
    t::SignalRequest,
    t::PreviewRequest,
    t::Preview,
    t::Tenant,
    t::TenantPolicy,
    t::CreateTenantRequest,
    t::UpdateTenantRequest,
    t::TenantToken,
    t::TenantList,
    t::UsageReport,
    t::ConfigReload,
    t::PullOutcome,
    t::UsageTotals,
    t::CreateVolumeRequest,
    t::CloneVolumeRequest,
    t::Volume,
    t::VolumeList,
    t::VolumeMountRequest,
    t::RunVolume,
    t::VolumeHolder,
    t::VolumeMode,
    t::VolumeMakeDirRequest,
    t::DatasetState,
    t::VolumeMoveRequest,
    t::VolumeRemoveRequest,
    t::ws::ClientFrame,
    t::ws::ServerFrame,
)))]
struct Schemas;

/// What a route takes.
enum In {
    Nothing,
    Json(&'static str),
    /// A JSON body that may be left out (an empty body is its defaults).
    OptionalJson(&'static str),
    Bytes(&'static str),
}

/// What a route answers on success.
enum Out {
    Empty,
    Json(&'static str),
    /// Server-sent events; the description says which.
    Events(&'static str),
    Bytes(&'static str),
    /// `101 Switching Protocols`.
    Upgrade(&'static str),
}

/// A query parameter's JSON type.
#[derive(Clone, Copy)]
enum Kind {
    Str,
    Int,
    Bool,
}

impl Kind {
    fn json(self) -> Type {
        match self {
            Kind::Str => Type::String,
            Kind::Int => Type::Integer,
            Kind::Bool => Type::Boolean,
        }
    }
}

/// A query parameter: name, JSON type, description.
type Query = (&'static str, Kind, &'static str);

struct Op {
    method: HttpMethod,
    path: &'static str,
    id: &'static str,
    summary: &'static str,
    input: In,
    status: u16,
    output: Out,
    query: &'static [Query],
}

const CREDENTIAL: &[Query] = &[OWNER, GENERATION];

const VOLUME_FS_QUERY: &[Query] = &[
    (
        "path",
        Kind::Str,
        "from the volume's top (a/b or /a/b); absent for the top itself",
    ),
    ("depth", Kind::Int, "levels, 1-16 (default 1)"),
    ("limit", Kind::Int, "most entries, 1-10000 (default 10000)"),
];

const VOLUME_WRITE_QUERY: &[Query] = &[
    (
        "mode",
        Kind::Int,
        "permission bits, at most 0o777 (default 0o644)",
    ),
    (
        "uid",
        Kind::Int,
        "owner as runs see it, 0-65535, with gid (default 0)",
    ),
    (
        "gid",
        Kind::Int,
        "group as runs see it, 0-65535, with uid (default 0)",
    ),
    (
        "overwrite",
        Kind::Bool,
        "replace an existing file (default true)",
    ),
];

const HISTORY_DIFF_QUERY: &[Query] = &[
    (
        "against",
        Kind::Str,
        "a point id to diff against (default: the point's parent)",
    ),
    (
        "patch",
        Kind::Bool,
        "unified diffs of changed text files (default false)",
    ),
    ("limit", Kind::Int, "most paths, 1-10000 (default 1000)"),
];

const FS_QUERY: &[Query] = &[
    (
        "path",
        Kind::Str,
        "relative to /work; absent for /work itself",
    ),
    ("depth", Kind::Int, "levels, 1-16 (default 1)"),
    ("limit", Kind::Int, "most entries, 1-10000 (default 10000)"),
];

const FS_WATCH_QUERY: &[Query] = &[
    FS_QUERY[0],
    ("recursive", Kind::Bool, "the directories below too"),
];

const OWNER: Query = (
    "owner",
    Kind::Str,
    "the lease holder this acts for, with generation",
);
const GENERATION: Query = (
    "generation",
    Kind::Int,
    "the generation of that holder's lease",
);
const REPLAY: Query = (
    "replay",
    Kind::Bool,
    "send the output kept for the process first (default true)",
);

const STDIN_QUERY: &[Query] = &[
    ("close", Kind::Bool, "close stdin after writing the body"),
    OWNER,
    GENERATION,
];

const ATTACH_QUERY: &[Query] = &[REPLAY, OWNER, GENERATION];

const AUDIT_QUERY: &[Query] = &[
    ("run", Kind::Str, "only the records of this run (its id)"),
    (
        "tenant",
        Kind::Str,
        "only this tenant's: its calls, calls on its runs, and what its runs did",
    ),
    (
        "since",
        Kind::Str,
        "only records from then on: RFC 3339, or a span back from now (90m, 24h, 7d)",
    ),
    ("limit", Kind::Int, "the latest this many (default 1000)"),
];

/// A list's label selector (`?label=team=a&label=job`).
const LABEL_QUERY: &[Query] = &[(
    "label",
    Kind::Str,
    "KEY=VALUE (the label has that value) or KEY (the label is set); repeat it, every term must hold",
)];

/// Every route of the API router, in the order `docs/api.md` lists them.
fn operations() -> Vec<Op> {
    use HttpMethod::{Delete, Get, Patch, Post, Put};
    use In::{Bytes as InBytes, Json as Body, Nothing, OptionalJson};
    use Out::{Bytes as OutBytes, Empty, Events, Json, Upgrade};
    let op = |method, path, id, summary, input, status, output| Op {
        method,
        path,
        id,
        summary,
        input,
        status,
        output,
        query: &[],
    };
    vec![
        op(Get, "/health", "health", "Whether the daemon serves; needs no token", Nothing, 200, Json("Health")),
        op(Get, "/v1/openapi.json", "openapi", "This document; needs no token", Nothing, 200, OutBytes("application/json")),
        op(Post, "/v1/runs", "createRun", "Create a run (an Idempotency-Key header makes a retry safe)", Body("CreateRunRequest"), 201, Json("Run")),
        Op { query: LABEL_QUERY, ..op(Get, "/v1/runs", "listRuns", "Every run the caller may see, those whose labels match when a selector is given", Nothing, 200, Json("RunList")) },
        op(Get, "/v1/runs/{id}", "getRun", "One run", Nothing, 200, Json("Run")),
        op(Delete, "/v1/runs/{id}", "deleteRun", "Destroy a run", Nothing, 204, Empty),
        op(Post, "/v1/runs/{id}/move", "moveRun", "Move a run to another node of the fleet (root)", OptionalJson("RunMoveRequest"), 200, Json("Run")),
        op(Post, "/v1/runs/{id}/renew", "renewRun", "Set a run's expiry to now + ttlSec", Body("RenewRequest"), 200, Json("Run")),
        op(Patch, "/v1/runs/{id}/egress", "updateRunEgress", "Replace a run's egress entries, secrets and tier (none or allowlist) while it lives", Body("UpdateEgressRequest"), 200, Json("Run")),
        op(Post, "/v1/runs/{id}/pause", "pauseRun", "Freeze the run's processes where they are, memory kept; the next call that reaches it resumes it", Nothing, 200, Json("Run")),
        op(Post, "/v1/runs/{id}/resume", "resumeRun", "Let a paused run's processes go on; a hibernated run is woken", Nothing, 200, Json("Run")),
        op(Post, "/v1/runs/{id}/hibernate", "hibernateRun", "Stop the run down to its disk: processes and memory are lost, CPU, memory, network and capacity freed; the next call that reaches it boots it again", Nothing, 200, Json("Run")),
        op(Post, "/v1/runs/{id}/wake", "wakeRun", "Boot a hibernated or failed run again on its disk (a paused one is resumed)", Nothing, 200, Json("Run")),
        op(Post, "/v1/runs/{id}/archive", "archiveRun", "Send the run's disk to the checkpoint store and drop it on the node (a running run is hibernated first); the next call that reaches it restores it", Nothing, 200, Json("Run")),
        op(Post, "/v1/runs/{id}/lease", "acquireLease", "Take the run's writable lease", Body("LeaseRequest"), 200, Json("LeaseResponse")),
        op(Post, "/v1/runs/{id}/lease/renew", "renewLease", "Extend a lease", Body("LeaseRenewRequest"), 200, Json("LeaseResponse")),
        op(Post, "/v1/runs/{id}/lease/release", "releaseLease", "Give a lease up", Body("LeaseReleaseRequest"), 204, Empty),
        op(Post, "/v1/runs/{id}/exec", "exec", "Run a command; its output and exit as server-sent events", Body("ExecRequest"), 200, Events("started (StartedEvent), stdout and stderr (base64 chunks), lost (LostEvent), exit (ExitEvent, last)")),
        op(Get, "/v1/runs/{id}/exec/ws", "execSession", "An interactive command over a WebSocket (frames: ClientFrame in, ServerFrame and binary output out)", Nothing, 101, Upgrade("websocket")),
        Op { query: CREDENTIAL, ..op(Put, "/v1/runs/{id}/files/{path}", "putFile", "Write a file below /work, replacing it once the whole body arrived", InBytes("application/octet-stream"), 204, Empty) },
        op(Get, "/v1/runs/{id}/files/{path}", "getFile", "Read a file below /work", Nothing, 200, OutBytes("application/octet-stream")),
        Op { query: &FS_QUERY[..1], ..op(Get, "/v1/runs/{id}/fs/stat", "stat", "Describe a path below /work", Nothing, 200, Json("FileInfo")) },
        Op { query: &FS_QUERY[..3], ..op(Get, "/v1/runs/{id}/fs/list", "listDir", "List a directory below /work", Nothing, 200, Json("FileList")) },
        Op { query: FS_WATCH_QUERY, ..op(Get, "/v1/runs/{id}/fs/watch", "watch", "Changes below a directory of /work as server-sent events", Nothing, 200, Events("WatchEvent, named by its kind: ready first, then created, written, removed, renamed, overflow")) },
        op(Post, "/v1/runs/{id}/fs/mkdir", "makeDir", "Make a directory and its parents", Body("MakeDirRequest"), 200, Json("FileInfo")),
        op(Post, "/v1/runs/{id}/fs/move", "movePath", "Rename a path", Body("MoveRequest"), 200, Json("FileInfo")),
        op(Post, "/v1/runs/{id}/fs/remove", "removePath", "Remove a path", Body("RemoveRequest"), 200, Json("RemoveReply")),
        op(Post, "/v1/runs/{id}/processes", "startProcess", "Start a background process", Body("ExecRequest"), 201, Json("Process")),
        op(Get, "/v1/runs/{id}/processes", "listProcesses", "Running processes and recently ended background ones", Nothing, 200, Json("ProcessList")),
        op(Get, "/v1/runs/{id}/processes/{process}", "getProcess", "One process, by pid or tag", Nothing, 200, Json("Process")),
        Op { query: &[("timeoutSec", Kind::Int, "the longest to wait, 0-3600 (default 60)")], ..op(Get, "/v1/runs/{id}/processes/{process}/wait", "waitProcess", "Wait until a process ended or the time passed", Nothing, 200, Json("Process")) },
        op(Post, "/v1/runs/{id}/processes/{process}/signal", "signalProcess", "Signal a process's group", Body("SignalRequest"), 200, Json("Process")),
        Op { query: STDIN_QUERY, ..op(Post, "/v1/runs/{id}/processes/{process}/stdin", "sendStdin", "Write to a process's stdin", InBytes("application/octet-stream"), 200, Json("Process")) },
        Op { query: &[REPLAY], ..op(Get, "/v1/runs/{id}/processes/{process}/output", "processOutput", "A process's output (replayed, then live) as exec's server-sent events", Nothing, 200, Events("as exec's")) },
        Op { query: ATTACH_QUERY, ..op(Get, "/v1/runs/{id}/processes/{process}/ws", "attach", "Attach to a process over a WebSocket", Nothing, 101, Upgrade("websocket")) },
        op(Post, "/v1/runs/{id}/preview", "mintPreview", "A signed, expiring URL for a port inside the run (served by --preview-listen)", Body("PreviewRequest"), 201, Json("Preview")),
        Op { query: CREDENTIAL, ..op(Get, "/v1/runs/{id}/ports/{port}/connect", "connectPort", "One TCP connection to a port inside the run, after an upgrade to runbox-tcp", Nothing, 101, Upgrade("runbox-tcp")) },
        op(Post, "/v1/runs/{id}/snapshot", "snapshotRun", "Record the run's filesystem as a new image", Body("SnapshotRequest"), 201, Json("Snapshot")),
        op(Post, "/v1/runs/{id}/fork", "forkRun", "Start new runs from the run's filesystem (as it is, or at a history point)", Body("ForkRequest"), 201, Json("ForkResponse")),
        op(Get, "/v1/runs/{id}/history", "history", "The run's history points, newest first (runs created with history)", Nothing, 200, Json("HistoryList")),
        Op { query: HISTORY_DIFF_QUERY, ..op(Get, "/v1/runs/{id}/history/{point}/diff", "historyDiff", "The paths a history point changed, against its parent or another point", Nothing, 200, Json("HistoryDiff")) },
        op(Post, "/v1/runs/{id}/history/{point}/fork", "forkPoint", "Start new runs from the run's files as they were at a history point (one by default)", OptionalJson("ForkRequest"), 201, Json("ForkResponse")),
        op(Post, "/v1/runs/{id}/rollback", "rollback", "Return the run's files to a history point; a running run's processes end (it boots again on them)", Body("RollbackRequest"), 200, Json("Run")),
        op(Post, "/v1/runs/{id}/checkpoint", "checkpointRun", "Send the run's disk and settings to the checkpoint store; the run keeps running", OptionalJson("CheckpointRequest"), 201, Json("Checkpoint")),
        op(Post, "/v1/runs/{id}/warm-commit", "warmCommit", "Publish the run's warm volume as its repository's template", Body("WarmCommitRequest"), 201, Json("WarmCommit")),
        op(Get, "/v1/runs/{id}/warm", "warmStatus", "The run's warm volume and lockfile hashes", Nothing, 200, Json("WarmStatus")),
        op(Get, "/v1/warmcache", "warmTemplates", "Every warm template", Nothing, 200, Json("WarmTemplateList")),
        op(Get, "/v1/warmcache/{owner}/{name}", "warmTemplate", "One repository's warm template", Nothing, 200, Json("WarmTemplate")),
        op(Delete, "/v1/warmcache/{owner}/{name}", "warmInvalidate", "Drop a repository's warm template", Nothing, 204, Empty),
        op(Post, "/v1/volumes", "createVolume", "Make a named volume", Body("CreateVolumeRequest"), 201, Json("Volume")),
        Op { query: LABEL_QUERY, ..op(Get, "/v1/volumes", "listVolumes", "Every volume the caller may see, with its holders; those whose labels match when a selector is given", Nothing, 200, Json("VolumeList")) },
        op(Get, "/v1/volumes/{name}", "getVolume", "One volume", Nothing, 200, Json("Volume")),
        op(Delete, "/v1/volumes/{name}", "deleteVolume", "Delete a volume no run mounts, and all it holds", Nothing, 204, Empty),
        op(Post, "/v1/volumes/{name}/clone", "cloneVolume", "A new volume holding what the volume holds now (constant time)", Body("CloneVolumeRequest"), 201, Json("Volume")),
        op(Post, "/v1/volumes/{name}/move", "moveVolume", "Move an unmounted volume to another node of the fleet", OptionalJson("VolumeNodeMoveRequest"), 200, Json("Volume")),
        Op { query: VOLUME_WRITE_QUERY, ..op(Put, "/v1/volumes/{name}/files/{path}", "putVolumeFile", "Write a file into a volume no run mounts, replacing it once the whole body is on disk", InBytes("application/octet-stream"), 200, Json("FileInfo")) },
        op(Get, "/v1/volumes/{name}/files/{path}", "getVolumeFile", "Read a file of a volume", Nothing, 200, OutBytes("application/octet-stream")),
        Op { query: &VOLUME_FS_QUERY[..1], ..op(Get, "/v1/volumes/{name}/fs/stat", "statVolumePath", "Describe a path of a volume", Nothing, 200, Json("FileInfo")) },
        Op { query: VOLUME_FS_QUERY, ..op(Get, "/v1/volumes/{name}/fs/list", "listVolumeDir", "List a directory of a volume", Nothing, 200, Json("FileList")) },
        op(Post, "/v1/volumes/{name}/fs/mkdir", "makeVolumeDir", "Make a directory and its parents in a volume no run mounts", Body("VolumeMakeDirRequest"), 200, Json("FileInfo")),
        op(Post, "/v1/volumes/{name}/fs/move", "moveVolumePath", "Rename a path of a volume no run mounts", Body("VolumeMoveRequest"), 200, Json("FileInfo")),
        op(Post, "/v1/volumes/{name}/fs/remove", "removeVolumePath", "Remove a path of a volume no run mounts", Body("VolumeRemoveRequest"), 200, Json("RemoveReply")),
        op(Get, "/v1/images", "listImages", "Every image", Nothing, 200, Json("ImageList")),
        op(Post, "/v1/images/pull", "pullImage", "Pull an image from a registry; progress as server-sent events", Body("PullRequest"), 200, Events("PullEvent, named by its kind, the last one done or error")),
        op(Post, "/v1/images/{name}", "importImage", "Import a tar archive: an OCI layout, docker save output, or a root filesystem", InBytes("application/x-tar"), 201, Json("Image")),
        op(Get, "/v1/images/{name}", "getImage", "One image, with its config", Nothing, 200, Json("Image")),
        op(Delete, "/v1/images/{name}", "deleteImage", "Delete an image", Nothing, 204, Empty),
        op(Put, "/v1/build-contexts/{digest}", "putBuildContext", "Upload a build context: a tar (plain or gzip) whose bytes hash to the digest", InBytes("application/x-tar"), 201, Json("BuildContext")),
        op(Post, "/v1/builds", "startBuild", "Build an image from a Dockerfile or a step list; answers at once, the build goes on", Body("BuildRequest"), 202, Json("Build")),
        op(Get, "/v1/builds", "listBuilds", "The caller's builds, newest first", Nothing, 200, Json("BuildList")),
        op(Get, "/v1/builds/{id}", "getBuild", "One build", Nothing, 200, Json("Build")),
        Op { query: &[("offset", Kind::Int, "the first log line wanted")], ..op(Get, "/v1/builds/{id}/events", "buildEvents", "A build's steps and log as server-sent events, then done", Nothing, 200, Events("step (BuildStep), log (BuildLog), then one done (Build)")) },
        op(Post, "/v1/builds/{id}/cancel", "cancelBuild", "Cancel a build; answers once it has ended", Nothing, 200, Json("Build")),
        Op { query: LABEL_QUERY, ..op(Get, "/v1/snapshots", "listSnapshots", "Every snapshot the caller may see; those whose labels match when a selector is given", Nothing, 200, Json("SnapshotList")) },
        Op { query: &[("image", Kind::Str, "the snapshot's image name")], ..op(Delete, "/v1/snapshots", "deleteSnapshotByQuery", "Delete a snapshot named in the query", Nothing, 204, Empty) },
        op(Delete, "/v1/snapshots/{name}", "deleteSnapshot", "Delete a snapshot", Nothing, 204, Empty),
        Op { query: LABEL_QUERY, ..op(Get, "/v1/checkpoints", "listCheckpoints", "Every checkpoint in the store the caller may see, those whose labels match when a selector is given", Nothing, 200, Json("CheckpointList")) },
        op(Get, "/v1/checkpoints/{id}", "getCheckpoint", "One checkpoint", Nothing, 200, Json("Checkpoint")),
        op(Delete, "/v1/checkpoints/{id}", "deleteCheckpoint", "Delete a checkpoint from the store", Nothing, 204, Empty),
        op(Get, "/v1/pools", "listPools", "The warm pools", Nothing, 200, Json("PoolList")),
        op(Put, "/v1/pools", "setPools", "Replace the warm pools", Body("PoolSet"), 200, Json("PoolList")),
        op(Get, "/v1/info", "info", "What the node is and how full", Nothing, 200, Json("Info")),
        op(Get, "/v1/cluster", "cluster", "The fleet's nodes and where each stands", Nothing, 200, Json("ClusterStatus")),
        Op { query: AUDIT_QUERY, ..op(Get, "/v1/audit", "audit", "The audit log's records that match, oldest first, one JSON object a line", Nothing, 200, OutBytes("application/x-ndjson")) },
        op(Post, "/v1/drain", "drain", "Cordon the node; with migrate, move its runs to other nodes of the fleet", OptionalJson("DrainRequest"), 200, Json("PoolList")),
        op(Post, "/v1/tenants", "createTenant", "Add a tenant; its token is in the answer, once", Body("CreateTenantRequest"), 201, Json("TenantToken")),
        op(Get, "/v1/tenants", "listTenants", "Every tenant", Nothing, 200, Json("TenantList")),
        op(Get, "/v1/tenants/{name}", "getTenant", "One tenant", Nothing, 200, Json("Tenant")),
        op(Patch, "/v1/tenants/{name}", "updateTenant", "Change a tenant's limits", Body("UpdateTenantRequest"), 200, Json("Tenant")),
        op(Delete, "/v1/tenants/{name}", "deleteTenant", "Remove a tenant that has no runs", Nothing, 204, Empty),
        Op { query: &[("since", Kind::Str, "the window's start: RFC 3339, or a span back from now (90m, 24h, 7d)"), ("tenant", Kind::Str, "only this tenant (\"\" for the operator's own runs); a tenant's token always sees its own")], ..op(Get, "/v1/usage", "usage", "What each tenant used: run-seconds by size, CPU-seconds, egress bytes", Nothing, 200, Json("UsageReport")) },
        op(Get, "/metrics", "metrics", "Prometheus metrics (text format 0.0.4)", Nothing, 200, OutBytes("text/plain")),
        op(Post, "/v1/config/reload", "reloadConfig", "Read the config file again and apply what can change without a restart", Nothing, 200, Json("ConfigReload")),
        op(Post, "/v1/tenants/{name}/rotate", "rotateTenantToken", "Give a tenant a new token; the old one stops working at once", Nothing, 200, Json("TenantToken")),
        op(Delete, "/v1/drain", "undrain", "Uncordon the node", Nothing, 200, Json("PoolList")),
    ]
}

fn schema_ref(name: &str) -> RefOr<Schema> {
    RefOr::Ref(Ref::from_schema_name(name))
}

/// An image or snapshot name, as `validate::image_name` takes it ("pull"
/// is reserved for `POST /v1/images/pull`).
const IMAGE_NAME: &str = "^[a-z0-9][a-z0-9._-]{0,63}$";

/// A lease holder, as `validate::owner` takes it: no control characters,
/// not only whitespace (the length is `maxLength`).
const OWNER_PATTERN: &str = "^[^\\u0000-\\u001f\\u007f-\\u009f]*[^\\s\\u0000-\\u001f\\u007f-\\u009f][^\\u0000-\\u001f\\u007f-\\u009f]*$";

/// A file path as the daemon takes it, as far as a pattern says it cheaply:
/// no NUL. (`..` components, absolute paths and over-long ones are refused
/// too, with `400 bad_path`; a pattern that states them makes JSON Schema
/// generators crawl.)
const FILE_PATH: &str = "^[^\\u0000]*$";

/// A tenant's image rule, as `tenants::check_policy` takes it.
const IMAGE_RULE: &str = "^[^\\s\\u0000-\\u001f\\u007f-\\u009f*]*\\*?$";

/// A tenant's name, as `tenants::check_name` takes it.
const TENANT_NAME: &str = "^[a-z][a-z0-9_-]{0,31}$";

/// One half of a repository's `owner/name`, as `validate::repo` takes it.
const REPO_PART: &str = "^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$";

/// A parameter's schema with the rules the daemon enforces on it: a path
/// parameter by its name (and, for `name`, by the route it is in), a
/// query parameter by its name.
/// One term of a label selector: a label key, then `=` and a value of at
/// most 256 characters without control characters, or nothing.
const LABEL_TERM: &str = "^[A-Za-z0-9._/-]{1,63}(=[^\\x00-\\x1f\\x7f-\\x9f]{0,256})?$";

/// A run id as written: a ULID in either case.
const RUN_ID: &str = "^[0-7][0-9A-HJKMNP-TV-Za-hjkmnp-tv-z]{25}$";

fn parameter_schema(name: &str, path: &str, kind: Kind) -> ObjectBuilder {
    let schema = ObjectBuilder::new().schema_type(kind.json());
    let range =
        |schema: ObjectBuilder, min: f64, max: f64| schema.minimum(Some(min)).maximum(Some(max));
    match name {
        "port" => range(schema, 1.0, 65535.0),
        "name" if path.starts_with("/v1/warmcache/") => schema.pattern(Some(REPO_PART)),
        "name" if path.starts_with("/v1/tenants/") => schema.pattern(Some(TENANT_NAME)),
        "owner" if path.starts_with("/v1/warmcache/") => schema.pattern(Some(REPO_PART)),
        "name" | "image" => schema.pattern(Some(IMAGE_NAME)),
        "depth" => range(schema, 1.0, f64::from(runbox_core::runs::MAX_LIST_DEPTH)),
        "limit" => range(schema, 1.0, f64::from(runbox_core::runs::MAX_LIST_ENTRIES)),
        "timeoutSec" => range(schema, 0.0, runbox_core::runs::MAX_WAIT.as_secs() as f64),
        "generation" => schema.minimum(Some(0.0)),
        // A log line's number: JavaScript's largest exact integer bounds it.
        "offset" => range(schema, 0.0, 9_007_199_254_740_991.0),
        "digest" => schema.pattern(Some("^sha256:[0-9a-f]{64}$")),
        "run" => schema.pattern(Some(RUN_ID)),
        "path" => schema.pattern(Some(FILE_PATH)),
        "owner" => schema
            .min_length(Some(1))
            .max_length(Some(runbox_core::validate::MAX_OWNER_CHARS))
            .pattern(Some(OWNER_PATTERN)),
        // A pid (1 and up), or a tag: 1-64 letters, digits, '.', '_', '-',
        // not all digits.
        "process" => schema.max_length(Some(64)).pattern(Some(
            "^(?:[1-9][0-9]{0,8}|[A-Za-z0-9._-]*[A-Za-z._-][A-Za-z0-9._-]*)$",
        )),
        _ => schema,
    }
}

fn path_parameters(path: &str) -> Vec<Parameter> {
    path.split('/')
        .filter_map(|segment| segment.strip_prefix('{')?.strip_suffix('}'))
        .map(|name| {
            let description = match name {
                "id" if path.starts_with("/v1/checkpoints") => "the checkpoint's id (a ULID)",
                "id" => "the run's id (a ULID)",
                "path" => "a file path relative to /work, each segment percent-encoded",
                "process" => "a pid, or a tag",
                "port" => "a port inside the run, 1-65535",
                "name" if path.starts_with("/v1/tenants/") => "the tenant's name",
                "name" => "an image or snapshot name",
                "owner" => "the repository's owner",
                _ => "",
            };
            ParameterBuilder::new()
                .name(name)
                .parameter_in(ParameterIn::Path)
                .required(utoipa::openapi::Required::True)
                .description(Some(description))
                .schema(Some(parameter_schema(
                    name,
                    path,
                    if name == "port" { Kind::Int } else { Kind::Str },
                )))
                .build()
        })
        .collect()
}

fn query_parameters(op: &Op) -> Vec<Parameter> {
    op.query
        .iter()
        .map(|(name, kind, description)| {
            // `DELETE /v1/snapshots` names its snapshot only in the query.
            let required = op.id == "deleteSnapshotByQuery" && *name == "image";
            let builder = ParameterBuilder::new();
            let builder = if *name == "label" {
                builder
                    .style(Some(utoipa::openapi::path::ParameterStyle::Form))
                    .explode(Some(true))
            } else {
                builder
            };
            builder
                .name(*name)
                .parameter_in(ParameterIn::Query)
                .required(if required {
                    utoipa::openapi::Required::True
                } else {
                    utoipa::openapi::Required::False
                })
                .description(Some(*description))
                .schema(Some(if *name == "label" {
                    // Repeated: `?label=a&label=b`.
                    RefOr::T(Schema::Array(
                        utoipa::openapi::schema::ArrayBuilder::new()
                            .items(
                                ObjectBuilder::new()
                                    .schema_type(Type::String)
                                    .pattern(Some(LABEL_TERM)),
                            )
                            .max_items(Some(64))
                            .build(),
                    ))
                } else {
                    RefOr::T(Schema::Object(
                        parameter_schema(name, op.path, *kind).build(),
                    ))
                }))
                .build()
        })
        .collect()
}

fn error_response() -> utoipa::openapi::Response {
    ResponseBuilder::new()
        .description("an error: its code is stable (see docs/api.md), its message says what to fix")
        .content(
            "application/json",
            ContentBuilder::new()
                .schema(Some(schema_ref("ErrorBody")))
                .build(),
        )
        .build()
}

fn operation(op: &Op) -> utoipa::openapi::path::Operation {
    let mut builder = OperationBuilder::new()
        .operation_id(Some(op.id))
        .summary(Some(op.summary))
        .description(Some(callers(op)))
        .parameters(Some(
            path_parameters(op.path)
                .into_iter()
                .chain(query_parameters(op)),
        ));
    builder = match &op.input {
        In::Nothing => builder,
        In::Json(name) | In::OptionalJson(name) => builder.request_body(Some(
            RequestBodyBuilder::new()
                .required(Some(if matches!(op.input, In::OptionalJson(_)) {
                    utoipa::openapi::Required::False
                } else {
                    utoipa::openapi::Required::True
                }))
                .content(
                    "application/json",
                    ContentBuilder::new().schema(Some(schema_ref(name))).build(),
                )
                .build(),
        )),
        // An empty upload writes an empty file, and an empty stdin write
        // may still close stdin; an image import needs its archive.
        In::Bytes(media) => builder.request_body(Some(
            RequestBodyBuilder::new()
                .required(Some(if op.id == "importImage" {
                    utoipa::openapi::Required::True
                } else {
                    utoipa::openapi::Required::False
                }))
                .content(*media, ContentBuilder::new().build())
                .build(),
        )),
    };
    let ok = match &op.output {
        Out::Empty => ResponseBuilder::new().description("done").build(),
        Out::Json(name) => ResponseBuilder::new()
            .description("done")
            .content(
                "application/json",
                ContentBuilder::new().schema(Some(schema_ref(name))).build(),
            )
            .build(),
        Out::Events(what) => ResponseBuilder::new()
            .description(format!("server-sent events: {what}"))
            .content("text/event-stream", ContentBuilder::new().build())
            .build(),
        Out::Bytes(media) => ResponseBuilder::new()
            .description("the bytes")
            .content(*media, ContentBuilder::new().build())
            .build(),
        Out::Upgrade(protocol) => ResponseBuilder::new()
            .description(format!("switched to {protocol}"))
            .build(),
    };
    builder = builder
        .response(op.status.to_string(), ok)
        .response("4XX", error_response())
        .response("5XX", error_response());
    if matches!(op.path, "/health" | "/v1/openapi.json") {
        // Open routes: no token.
        builder = builder.security(SecurityRequirement::default());
    }
    builder.build()
}

/// Which tokens a route takes (see `crate::auth::rule`).
fn callers(op: &Op) -> &'static str {
    use crate::auth::Rule;
    if matches!(op.path, "/health" | "/v1/openapi.json") {
        return "Open: no token.";
    }
    use axum::http::Method;
    let method = match op.method {
        HttpMethod::Post => Method::POST,
        HttpMethod::Put => Method::PUT,
        HttpMethod::Patch => Method::PATCH,
        HttpMethod::Delete => Method::DELETE,
        _ => Method::GET,
    };
    match crate::auth::rule(&method, op.path) {
        Rule::Root => "Takes the root token (a tenant's is 403).",
        Rule::Tenant => {
            "Takes the root token or a tenant's (a tenant sees and changes its own things only)."
        }
        Rule::Run => "Takes the root token, the run's tenant's, or the run's own token.",
        Rule::RunOwner => "Takes the root token or the run's tenant's (a run token is 403).",
    }
}

/// The document.
pub fn document() -> OpenApi {
    let mut paths = PathsBuilder::new();
    for op in operations() {
        // The router's `{*path}` catch-all is a plain parameter here.
        paths = paths.path(op.path, PathItem::new(op.method.clone(), operation(&op)));
    }
    let mut components = Schemas::openapi().components.unwrap_or_default();
    components.security_schemes.insert(
        "bearer".to_owned(),
        SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
    );
    OpenApiBuilder::new()
        .info(
            InfoBuilder::new()
                .title("runbox")
                .version(env!("CARGO_PKG_VERSION"))
                .description(Some(
                    "Self-hosted sandboxes. Every route but /health and /v1/openapi.json needs \
                     Authorization: Bearer <token>. The prose, limits and error codes are in \
                     docs/api.md; preview URLs are served by a second listener (--preview-listen) \
                     and are not part of this document.",
                ))
                .build(),
        )
        .paths(paths.build())
        .components(Some(components))
        .security(Some(vec![SecurityRequirement::new(
            "bearer",
            Vec::<String>::new(),
        )]))
        .build()
}

/// Rules that tie one field to another, which the schema derive cannot
/// say; patched into the generated schemas by name.
fn cross_field_rules(document: &mut serde_json::Value) {
    let schemas = &mut document["components"]["schemas"];
    // A tenant's image rule: a name, or a prefix ending in `*`; no
    // whitespace or control characters (`tenants::check_policy`).
    for request in ["CreateTenantRequest", "UpdateTenantRequest"] {
        let items = &mut schemas[request]["properties"]["images"]["items"];
        if let Some(items) = items.as_object_mut() {
            items.insert("minLength".into(), 1.into());
            items.insert("maxLength".into(), 256.into());
            items.insert("pattern".into(), IMAGE_RULE.into());
        }
        // Each entry once; at most 64 image rules.
        for list in ["images", "networks", "sizes"] {
            if let Some(list) = schemas[request]["properties"][list].as_object_mut() {
                list.insert("uniqueItems".into(), true.into());
                if let Some(max) = (list.get("items").is_some()).then_some(64) {
                    list.insert("maxItems".into(), max.into());
                }
            }
        }
    }
    // `egressAllow` and `secrets` belong to `allowlist` runs (`egress` is its
    // alias): on any other tier they are refused, even empty.
    schemas["CreateRunRequest"]["if"] = serde_json::json!({
        "not": {
            "required": ["network"],
            "properties": {"network": {"enum": ["allowlist", "egress"]}}
        }
    });
    schemas["CreateRunRequest"]["then"] = serde_json::json!({
        "properties": {"egressAllow": {"type": "null"}, "secrets": {"type": "null"}}
    });
    // A lease holder and its generation come together or not at all, and
    // a holder is named as a lease takes it.
    let together = |given: &str, needs: &str, kind: &str| {
        serde_json::json!({
            "if": {"required": [given], "properties": {given: {"not": {"type": "null"}}}},
            "then": {"required": [needs], "properties": {needs: {"type": kind}}}
        })
    };
    let owner_rule = serde_json::json!({
        "minLength": 1,
        "maxLength": runbox_core::validate::MAX_OWNER_CHARS,
        "pattern": OWNER_PATTERN,
    });
    if let Some(schemas) = schemas.as_object_mut() {
        for schema in schemas.values_mut() {
            let Some(properties) = schema
                .get_mut("properties")
                .and_then(|properties| properties.as_object_mut())
            else {
                continue;
            };
            let Some(owner) = properties.get_mut("owner") else {
                continue;
            };
            if let (Some(owner), Some(rule)) = (owner.as_object_mut(), owner_rule.as_object()) {
                owner.extend(rule.clone());
            }
            let required = schema["required"].as_array().cloned().unwrap_or_default();
            if properties_pair_optional(schema, &required) {
                schema["allOf"] = serde_json::json!([
                    together("generation", "owner", "string"),
                    together("owner", "generation", "integer"),
                ]);
            }
        }
    }
    // A signal by number (1-64) or by name, with or without `SIG`, in any
    // case, as `SignalSpec::number` reads it.
    schemas["SignalSpec"]["oneOf"] = serde_json::json!([
        {"type": "integer", "minimum": 1, "maximum": 64, "description": "A Linux signal number."},
        {"type": "string", "pattern": signal_pattern(), "description": "A name (TERM, SIGINT, ...) or a number as text."}
    ]);
    // File paths: no NUL.
    for (schema, field) in [
        ("MakeDirRequest", "path"),
        ("RemoveRequest", "path"),
        ("MoveRequest", "from"),
        ("MoveRequest", "to"),
    ] {
        schemas[schema]["properties"][field]["pattern"] = FILE_PATH.into();
    }
    // A snapshot may not take the name the pull route has.
    schemas["SnapshotRequest"]["properties"]["name"]["not"] = serde_json::json!({"const": "pull"});
    // A warm-up command names its program first.
    let warmup = &mut schemas["PoolSpec"]["properties"]["warmup"];
    warmup["minItems"] = 1.into();
    warmup["prefixItems"] = serde_json::json!([{"type": "string", "minLength": 1}]);
}

/// Whether a schema has both `owner` and `generation`, neither required.
fn properties_pair_optional(schema: &serde_json::Value, required: &[serde_json::Value]) -> bool {
    ["owner", "generation"].iter().all(|name| {
        schema["properties"].get(*name).is_some() && !required.iter().any(|r| r == name)
    })
}

/// `^(?:SIG)?(?:HUP|INT|...|1-64)$`, matched in any case: JSON Schema's
/// regular expressions have no flag for that, so every letter is a class.
fn signal_pattern() -> String {
    let any_case = |word: &str| -> String {
        word.chars()
            .map(|c| {
                if c.is_ascii_alphabetic() {
                    format!("[{}{}]", c.to_ascii_uppercase(), c.to_ascii_lowercase())
                } else {
                    c.to_string()
                }
            })
            .collect()
    };
    let names: Vec<String> = runbox_types::SIGNALS
        .iter()
        .map(|(name, _)| any_case(name))
        .collect();
    format!(
        "^(?:{})?(?:{}|0*(?:[1-9]|[1-5][0-9]|6[0-4]))$",
        any_case("SIG"),
        names.join("|")
    )
}

/// Unsigned integers say their range: JSON Schema's `format` is only a
/// hint, and a u64 field takes values past `int64`'s. (utoipa spells the
/// unsigned formats `u-int64`; the format registry's spelling is `uint64`.)
fn integer_ranges(value: &mut serde_json::Value) {
    match value {
        serde_json::Value::Object(map) => {
            let unsigned: Option<(&str, serde_json::Value)> =
                match map.get("format").and_then(|f| f.as_str()) {
                    Some("u-int64" | "uint64") => Some(("uint64", u64::MAX.into())),
                    Some("u-int32" | "uint32") => Some(("uint32", u32::MAX.into())),
                    Some("u-int16" | "uint16") => Some(("uint16", u16::MAX.into())),
                    Some("u-int8" | "uint8") => Some(("uint8", u8::MAX.into())),
                    _ => None,
                };
            if let Some((format, max)) = unsigned {
                map.insert("format".to_owned(), format.into());
                map.entry("maximum").or_insert(max);
            }
            for child in map.values_mut() {
                integer_ranges(child);
            }
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(integer_ranges),
        _ => {}
    }
}

/// `GET /v1/usage?since=`: a time or a span back (`accounting::parse_since`).
fn usage_window(document: &mut serde_json::Value) {
    for route in ["/v1/usage", "/v1/audit"] {
        usage_window_of(document, route);
    }
}

/// [`usage_window`] for one route.
fn usage_window_of(document: &mut serde_json::Value, route: &str) {
    let Some(parameters) = document["paths"][route]["get"]["parameters"].as_array_mut() else {
        return;
    };
    for parameter in parameters {
        if parameter["name"] == "since" {
            parameter["schema"] = serde_json::json!({
                "anyOf": [
                    {"type": "string", "pattern": "^[0-9]{1,6}[mhd]$"},
                    {"type": "string", "format": "date-time"}
                ]
            });
        }
    }
}

/// Every request's `labels` map states the label rules
/// (`validate::labels`): at most 64, keys 1-63 of letters, digits, `.`,
/// `_`, `-` and `/`, values at most 256 characters without control
/// characters.
fn label_rules(document: &mut serde_json::Value) {
    let Some(schemas) = document["components"]["schemas"].as_object_mut() else {
        return;
    };
    for (name, schema) in schemas.iter_mut() {
        if !name.ends_with("Request") {
            continue;
        }
        // `get_mut`, not indexing: indexing would add a `labels` property
        // to every request schema that has none.
        let Some(labels) = schema
            .get_mut("properties")
            .and_then(|p| p.get_mut("labels"))
            .and_then(|l| l.as_object_mut())
        else {
            continue;
        };
        labels.insert("maxProperties".into(), serde_json::json!(64));
        labels.insert(
            "propertyNames".into(),
            serde_json::json!({"type": "string", "pattern": "^[A-Za-z0-9._/-]{1,63}$"}),
        );
        labels.insert(
            "additionalProperties".into(),
            serde_json::json!({
                "type": "string",
                "maxLength": 256,
                "pattern": "^[^\\x00-\\x1f\\x7f-\\x9f]*$"
            }),
        );
    }
}

/// The document as the committed file holds it: pretty JSON and a newline.
pub fn document_json() -> String {
    let mut value = match serde_json::to_value(document()) {
        Ok(value) => value,
        Err(e) => return format!("{{\"error\": \"{e}\"}}\n"),
    };
    cross_field_rules(&mut value);
    usage_window(&mut value);
    label_rules(&mut value);
    integer_ranges(&mut value);
    let mut text =
        serde_json::to_string_pretty(&value).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"));
    text.push('\n');
    text
}

/// `GET /v1/openapi.json`.
pub async fn serve() -> axum::response::Response {
    use axum::response::IntoResponse as _;
    static DOCUMENT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let body = DOCUMENT.get_or_init(document_json).clone();
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        body,
    )
        .into_response()
}
