//! The one error shape every API response uses, and the stable codes in it.

use serde::{Deserialize, Serialize};

/// `{"error": {"code": "...", "message": "..."}}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// A machine-readable code and a human message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorDetail {
    /// Stable code; see [`ErrorCode`].
    pub code: String,
    /// What went wrong and what to fix.
    pub message: String,
}

macro_rules! codes {
    ($($(#[$doc:meta])* $variant:ident = $code:literal, $status:literal;)*) => {
        /// Stable error codes. Clients match on these; they never change meaning.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum ErrorCode {
            $($(#[$doc])* $variant,)*
        }

        impl ErrorCode {
            /// Every code, for documentation and tests.
            pub const ALL: &'static [ErrorCode] = &[$(ErrorCode::$variant,)*];

            /// The code's wire spelling.
            pub fn as_str(self) -> &'static str {
                match self { $(ErrorCode::$variant => $code,)* }
            }

            /// The HTTP status that goes with the code.
            pub fn status(self) -> u16 {
                match self { $(ErrorCode::$variant => $status,)* }
            }

            /// Parses a wire spelling.
            pub fn parse(code: &str) -> Option<ErrorCode> {
                match code { $($code => Some(ErrorCode::$variant),)* _ => None }
            }
        }
    };
}

codes! {
    /// The body is not valid JSON or does not match the schema.
    BadRequest = "bad_request", 400;
    /// An environment variable breaks the rules (name, size, count, characters).
    BadEnv = "bad_env", 400;
    /// A file path is empty, absolute, contains `..` or NUL, or is too long
    /// (or a warm volume path is not a plain absolute path runbox allows).
    BadPath = "bad_path", 400;
    /// A limit is out of range or above the server maximum.
    BadLimits = "bad_limits", 400;
    /// A TTL is zero or above the maximum.
    BadTtl = "bad_ttl", 400;
    /// A lease owner is empty, too long or has control characters.
    BadOwner = "bad_owner", 400;
    /// A lease generation is missing, not a number, or given without an owner.
    BadGeneration = "bad_generation", 400;
    /// An image name breaks the naming rules.
    BadImageName = "bad_image_name", 400;
    /// A run's `history` settings are out of range (`keep` 1 to the
    /// server's `--max-history`), or history was asked of a server or run
    /// that cannot keep it.
    BadHistory = "bad_history", 400;
    /// A build's Dockerfile or step list cannot be run as written; the
    /// message names the line.
    BadDockerfile = "bad_dockerfile", 400;
    /// A build context that cannot be used: an archive refused (a path out
    /// of the context, a device node, too large), a digest that does not
    /// match, or one never uploaded.
    BadBuildContext = "bad_build_context", 400;
    /// An archive could not be unpacked.
    BadArchive = "bad_archive", 400;
    /// An image reference does not parse.
    BadReference = "bad_reference", 400;
    /// A registry would be reached over plain HTTP without the operator's leave.
    InsecureRegistry = "insecure_registry", 400;
    /// The registry has no image for this host's platform.
    NoMatchingPlatform = "no_matching_platform", 400;
    /// The registry refused the credentials (or asked for some).
    RegistryAuthFailed = "registry_auth_failed", 403;
    /// The registry has no such repository, tag or digest.
    RemoteNotFound = "remote_not_found", 404;
    /// The registry could not be reached or served something invalid.
    RegistryError = "registry_error", 502;
    /// The exec command is empty or malformed.
    BadCommand = "bad_command", 400;
    /// The user to run a command as (or to own a written file) does not
    /// exist in the run's `/etc/passwd` / `/etc/group`, or is malformed.
    BadUser = "bad_user", 400;
    /// The working directory does not exist in the run.
    BadCwd = "bad_cwd", 400;
    /// A guest port is not 1-65535.
    BadPort = "bad_port", 400;
    /// Preview URLs were asked of a server without `--preview-listen`.
    PreviewDisabled = "preview_disabled", 400;
    /// A preview token is malformed or its signature does not match.
    PreviewDenied = "preview_denied", 403;
    /// A preview token is past its expiry.
    PreviewExpired = "preview_expired", 403;
    /// Nothing accepts connections on the port inside the run.
    PortUnreachable = "port_unreachable", 502;
    /// A process tag breaks the rules, or a terminal size is out of range.
    BadProcess = "bad_process", 400;
    /// A signal name or number that Linux does not have.
    BadSignal = "bad_signal", 400;
    /// No such process in the run (ended foreground commands are not kept;
    /// ended background ones only for a while).
    ProcessNotFound = "process_not_found", 404;
    /// Another running process in the run has this tag.
    TagInUse = "tag_in_use", 409;
    /// The process has ended.
    ProcessEnded = "process_ended", 409;
    /// The process's stdin is closed, or it was started without one.
    StdinClosed = "stdin_closed", 409;
    /// The run's agent predates this operation (the run was created by an
    /// older runbox); create the run again.
    AgentTooOld = "agent_too_old", 409;
    /// The command was not found in the run.
    CommandNotFound = "command_not_found", 400;
    /// The command exists but could not be executed.
    CommandNotExecutable = "command_not_executable", 400;
    /// An `egressAllow` entry is malformed.
    BadEgressEntry = "bad_egress_entry", 400;
    /// `egressAllow` or `secrets` do not fit the run's network tier, or are too many.
    BadEgress = "bad_egress", 400;
    /// A run asks for a secret the operator did not declare.
    UnknownSecret = "unknown_secret", 400;
    /// A secret the caller brings is malformed (its name, header, hosts,
    /// methods, paths or value); the message names the field, never the value.
    BadSecret = "bad_secret", 400;
    /// The requested network tier is not available on this server.
    NetworkUnsupported = "network_unsupported", 400;
    /// The run would have a disk limit and this server's storage cannot
    /// enforce one; the message says what the operator can change.
    DiskLimitUnsupported = "disk_limit_unsupported", 400;
    /// The run is paused and was created with `autoResume: false`: resume
    /// it first (`POST /v1/runs/{id}/resume`).
    RunPaused = "run_paused", 409;
    /// This server's isolation lane cannot pause runs; the message says why.
    PauseUnsupported = "pause_unsupported", 400;
    /// This server's isolation lane cannot hibernate runs; the message says
    /// why.
    HibernateUnsupported = "hibernate_unsupported", 400;
    /// `allowPrivilegeEscalation` was asked of a server whose runs have no
    /// user namespace of their own (root in such a run is root on the host).
    EscalationUnsupported = "escalation_unsupported", 400;
    /// A volume name, size or mount breaks the rules, or a run asks for
    /// more than 8 volumes or one twice.
    BadVolume = "bad_volume", 400;
    /// No volume of the caller's has that name.
    VolumeNotFound = "volume_not_found", 404;
    /// The caller has a volume of that name already.
    VolumeExists = "volume_exists", 409;
    /// The volume is mounted in a way that excludes this: a writer holds
    /// it, or readers do and a writer was asked for, or a delete found it
    /// mounted. The message names a holding run.
    VolumeBusy = "volume_busy", 409;
    /// A catalog dataset cannot be mounted now: its image is missing on
    /// this server, or it is dirty (a writer did not release it cleanly)
    /// and a read-only mount was asked. The message says which and what
    /// to do.
    VolumeUnavailable = "volume_unavailable", 409;
    /// This server cannot make volumes (its run store has no quotas); the
    /// message says what the operator can change.
    VolumesUnsupported = "volumes_unsupported", 400;
    /// A warm volume was asked of a server whose warm repo cache is off.
    WarmCacheDisabled = "warm_cache_disabled", 400;
    /// A checkpoint's objects are missing, truncated or do not match their
    /// recorded digests; it is refused, never booted.
    CheckpointCorrupt = "checkpoint_corrupt", 422;
    /// A checkpoint needs image layers this node does not have and cannot
    /// pull (its base image was imported elsewhere, or changed).
    CheckpointBaseMissing = "checkpoint_base_missing", 409;
    /// The checkpoint is an archived run's disk; delete the run instead.
    CheckpointInUse = "checkpoint_in_use", 409;
    /// A label key or value breaks the rules, or there are too many.
    BadLabels = "bad_labels", 400;
    /// A pool set breaks the rules (a duplicate pool, `warmMax` below `warm`, ...).
    BadPools = "bad_pools", 400;
    /// A repository name is not `owner/name` with the allowed characters.
    BadRepo = "bad_repo", 400;
    /// No warm template for this repository.
    TemplateNotFound = "template_not_found", 404;
    /// The run has no warm volume (it was created without `warm`).
    RunNotWarm = "run_not_warm", 409;
    /// The server's storage is full; free some (delete runs, snapshots,
    /// templates) or give it more.
    StorageFull = "storage_full", 507;
    /// A write through a volume's file API reached the volume's size
    /// limit; remove files from it, or clone it into a larger one.
    VolumeFull = "volume_full", 507;
    /// An `Idempotency-Key` came with a different request than the create
    /// it was first used for, or that create's run is gone.
    IdempotencyKeyReused = "idempotency_key_reused", 409;
    /// The path is not a regular file (a directory, a device, ...).
    NotAFile = "not_a_file", 400;
    /// No or wrong bearer token.
    Unauthorized = "unauthorized", 401;
    /// The token is valid but does not open this route: operator routes
    /// take the root token only, a run token drives only its own run's
    /// exec, files, processes, sessions and previews.
    Forbidden = "forbidden", 403;
    /// The caller's tenant may not use this image, network tier or size
    /// tier; the message names the rule.
    TenantPolicy = "tenant_policy", 403;
    /// The config file does not parse, has an unknown key or a bad value;
    /// a reload then changes nothing.
    ConfigInvalid = "config_invalid", 400;
    /// The daemon was started without `--config`: there is nothing to
    /// reload.
    NoConfig = "no_config", 409;
    /// A tenant's name or settings break the rules.
    BadTenant = "bad_tenant", 400;
    /// No tenant with this name.
    TenantNotFound = "tenant_not_found", 404;
    /// A tenant with this name exists already.
    TenantExists = "tenant_exists", 409;
    /// The tenant still has runs; delete them first (or rotate its token
    /// to shut it out at once).
    TenantHasRuns = "tenant_has_runs", 409;
    /// A path leads outside `/work` (for example through a symlink).
    PathEscape = "path_escape", 403;
    /// The run's own file permissions refuse the operation (read-only file
    /// system, a busy executable, ...).
    PermissionDenied = "permission_denied", 403;
    /// No such run.
    RunNotFound = "run_not_found", 404;
    /// No such history point of the run (never made, or dropped as one of
    /// the oldest beyond the run's `keep`), or the run keeps no history.
    PointNotFound = "point_not_found", 404;
    /// No such image.
    ImageNotFound = "image_not_found", 404;
    /// No build with this id (or not one the caller may see).
    BuildNotFound = "build_not_found", 404;
    /// No checkpoint with this id in the checkpoint store.
    CheckpointNotFound = "checkpoint_not_found", 404;
    /// No such file in the run.
    FileNotFound = "file_not_found", 404;
    /// No such route.
    NotFound = "not_found", 404;
    /// The method is not allowed on this route.
    MethodNotAllowed = "method_not_allowed", 405;
    /// The run is not in a state that allows the operation.
    RunNotRunning = "run_not_running", 409;
    /// The run's sandbox died; the message says why. Delete it or let its
    /// TTL pass.
    RunFailed = "run_failed", 409;
    /// A move's destination exists (and `overwrite` was not given).
    FileExists = "file_exists", 409;
    /// A directory to remove (or to move over) is not empty.
    DirNotEmpty = "dir_not_empty", 409;
    /// An image with this name already exists.
    ImageExists = "image_exists", 409;
    /// The image is used by a run.
    ImageInUse = "image_in_use", 409;
    /// Another build of the same image name is running.
    BuildInProgress = "build_in_progress", 409;
    /// Another owner holds the run's writable lease (or no credential was given).
    Leased = "leased", 409;
    /// The lease generation presented was replaced by a later grant.
    Superseded = "superseded", 409;
    /// An exec or file write is in flight; a lease is granted only between operations.
    Busy = "busy", 409;
    /// A port runbox listens on inside the run (the SOCKS5 door's 1080) is taken by a process of the run.
    PortInUse = "port_in_use", 409;
    /// The lease named lapsed; it must be acquired again.
    LeaseExpired = "lease_expired", 409;
    /// No lease with that generation is held.
    NotLeased = "not_leased", 409;
    /// The run cannot move to another node: the message says why (no
    /// fleet, no checkpoint store the nodes share, a volume it mounts, a
    /// target node that cannot take it).
    NotMovable = "not_movable", 409;
    /// The run was lost with its node of a fleet (its `onNodeLoss` is
    /// `lost`, or there was nothing to bring it back from): only reading
    /// and deleting it work.
    RunLost = "run_lost", 409;
    /// A body or file is larger than the server accepts.
    TooLarge = "too_large", 413;
    /// The server is at its run capacity (`--max-runs`); retry after the
    /// `Retry-After` seconds.
    Capacity = "capacity", 429;
    /// The caller's tenant has `maxRuns` live runs already; retry after the
    /// `Retry-After` seconds, or delete some.
    TenantQuota = "tenant_quota", 429;
    /// The run has as many processes as its `pids` limit allows, so a
    /// command cannot start: wait for some to exit, or end some.
    ProcessLimit = "process_limit", 429;
    /// The server is cordoned (`POST /v1/drain`) and takes no new runs.
    Draining = "draining", 503;
    /// The checkpoint store could not be reached or refused the request;
    /// nothing was changed, retry after `Retry-After`.
    CheckpointStoreUnavailable = "checkpoint_store_unavailable", 503;
    /// The cluster database could not be reached; what needs it waits,
    /// retry after `Retry-After` (the node goes on serving its own runs).
    ClusterUnavailable = "cluster_unavailable", 503;
    /// The run is on a node of the fleet that is gone or cannot be
    /// reached; retry after `Retry-After`.
    NodeUnavailable = "node_unavailable", 503;
    /// The run moved to another node of the fleet while this call waited
    /// for it; the same call again reaches it there (retry after
    /// `Retry-After`).
    RunMoved = "run_moved", 503;
    /// The sandbox's agent did not answer as it should.
    AgentUnavailable = "agent_unavailable", 502;
    /// A fault in runbox itself; the detail is in the server log.
    Internal = "internal", 500;
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_statuses_are_sane() {
        for code in ErrorCode::ALL {
            assert_eq!(ErrorCode::parse(code.as_str()), Some(*code));
            assert!((400..600).contains(&code.status()), "{code}");
        }
    }

    #[test]
    fn every_code_is_documented_with_its_status() {
        let doc = include_str!("../../../docs/api.md");
        for code in ErrorCode::ALL {
            let row = format!("| `{}` | {} |", code.as_str(), code.status());
            assert!(doc.contains(&row), "docs/api.md has no row {row}");
        }
    }
}
