//! Volumes: data that outlives runs. A named volume is made through the
//! API (a directory of its own in the run store, with a size limit); runs
//! mount volumes by name.

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use ulid::Ulid;

/// The most volumes one run mounts.
pub const MAX_RUN_VOLUMES: usize = 8;

/// `POST /v1/volumes`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateVolumeRequest {
    /// 1-63 of letters, digits, `_`, `-` and `.`, starting with a letter
    /// or digit; unique among the caller's volumes.
    #[cfg_attr(
        feature = "openapi",
        schema(pattern = "^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
    )]
    pub name: String,
    /// How many MiB the volume may hold (data and metadata); default the
    /// server's `--volume-default-mb`, at most `--volume-max-mb`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 1))]
    pub size_mb: Option<u64>,
    /// Labels (the run label rules: keys of letters, digits, `.`, `_`,
    /// `-`, `/`; values up to 256 characters), for `GET /v1/volumes?label=`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<std::collections::BTreeMap<String, String>>,
}

/// The most a user or group id of a volume file may be: the ids a run's
/// user namespace maps (0-65535).
pub const MAX_VOLUME_ID: u32 = 65535;

/// The query of `PUT /v1/volumes/{name}/files/{path}`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VolumeWriteQuery {
    /// Permission bits of the file (at most 0o777, default 0o644).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<u32>,
    /// Owner of the file and of the directories the write makes, as runs
    /// see it (0-65535; default 0). With `gid`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    /// Group of the file and of the directories the write makes (0-65535;
    /// default 0). With `uid`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
    /// Replace an existing file (default true; false: `409 file_exists`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overwrite: Option<bool>,
}

/// `POST /v1/volumes/{name}/fs/mkdir`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VolumeMakeDirRequest {
    /// From the volume's top (`a/b` or `/a/b`).
    #[cfg_attr(feature = "openapi", schema(min_length = 1))]
    pub path: String,
    /// Permission bits of the directories made (at most 0o7777, default
    /// 0o755).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(maximum = 4095))]
    pub mode: Option<u32>,
    /// Owner of the directories made, as runs see it (0-65535; default 0).
    /// With `gid`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(maximum = 65535))]
    pub uid: Option<u32>,
    /// Their group (0-65535; default 0). With `uid`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(maximum = 65535))]
    pub gid: Option<u32>,
}

/// `POST /v1/volumes/{name}/fs/move`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VolumeMoveRequest {
    /// From the volume's top.
    #[cfg_attr(feature = "openapi", schema(min_length = 1))]
    pub from: String,
    /// From the volume's top; its parent must exist.
    #[cfg_attr(feature = "openapi", schema(min_length = 1))]
    pub to: String,
    /// Replace an existing `to` (default: refuse with `409 file_exists`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overwrite: Option<bool>,
}

/// `POST /v1/volumes/{name}/fs/remove`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VolumeRemoveRequest {
    /// From the volume's top.
    #[cfg_attr(feature = "openapi", schema(min_length = 1))]
    pub path: String,
    /// Remove a directory with everything in it (default: only an empty one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recursive: Option<bool>,
}

/// `POST /v1/volumes/{name}/clone`: a new volume holding what the volume
/// holds now.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CloneVolumeRequest {
    /// The new volume's name (the rules of [`CreateVolumeRequest::name`]).
    #[cfg_attr(
        feature = "openapi",
        schema(pattern = "^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
    )]
    pub name: String,
    /// Its size in MiB; default the source's. At least what the source
    /// holds, at most `--volume-max-mb`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 1))]
    pub size_mb: Option<u64>,
    /// Its labels; default the source's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<std::collections::BTreeMap<String, String>>,
}

/// How a run mounts a volume.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum VolumeMode {
    /// Read and write; one such holder at a time, and none while others
    /// read.
    #[default]
    Rw,
    /// Read-only; any number of such holders while no one writes.
    Ro,
}

impl VolumeMode {
    /// The wire spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            VolumeMode::Rw => "rw",
            VolumeMode::Ro => "ro",
        }
    }
}

/// One entry of `volumes` on `POST /v1/runs`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VolumeMountRequest {
    /// The volume's name.
    pub name: String,
    /// Where it is mounted in the run: absolute, clean, outside the
    /// system's own directories; default `/volumes/<name>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// `rw` (default) or `ro`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<VolumeMode>,
}

/// A volume a run mounts, as the run shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct RunVolume {
    /// The volume's name.
    pub name: String,
    /// Where it is mounted in the run.
    pub path: String,
    /// How.
    pub mode: VolumeMode,
}

/// A run holding a volume.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct VolumeHolder {
    /// The run.
    pub run: Ulid,
    /// How it mounts the volume.
    pub mode: VolumeMode,
}

/// A volume.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Volume {
    /// Its id (a volume made again under a deleted one's name has another).
    pub id: Ulid,
    /// Its name.
    pub name: String,
    /// The node that holds it (a volume is one node's; in a fleet the
    /// list is every node's).
    #[serde(default)]
    pub server: String,
    /// The MiB it may hold.
    pub size_mb: u64,
    /// Bytes it holds, as the quota counts them (updated within about
    /// 30 s); absent where the run store counts nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used_bytes: Option<u64>,
    /// The runs that mount it now.
    pub holders: Vec<VolumeHolder>,
    /// When it was made.
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    /// The tenant it belongs to; absent: the operator's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Its labels.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub labels: std::collections::BTreeMap<String, String>,
    /// Present for a dataset of the operator's catalog (a disk image the
    /// operator keeps on this server, mounted by runs, never made or
    /// deleted through the API); absent for a named volume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dataset: Option<DatasetState>,
}

/// What a catalog dataset is on this server now.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct DatasetState {
    /// Whether a run may mount it `rw` (the catalog says so); `ro` is the
    /// default mode of a dataset mount.
    pub writable: bool,
    /// Whether a mount of it can be admitted now: its image is present and
    /// (for `ro`) clean.
    pub available: bool,
    /// Why not, when it is not: `missing` (no image on this server) or
    /// `dirty` (a writer did not release it cleanly: it needs one `rw`
    /// mount and a clean release before `ro` mounts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unavailable: Option<String>,
}

/// `GET /v1/volumes`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct VolumeList {
    /// Every volume the caller may see, by name.
    pub volumes: Vec<Volume>,
}
