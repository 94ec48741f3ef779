//! Image builds: a Dockerfile or a step list run step by step in a build
//! run, each file-changing step kept as a layer, the result an image in the
//! store.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use ulid::Ulid;

use crate::LimitsRequest;

/// `POST /v1/builds`: what to build and what to call it. Exactly one of
/// `dockerfile` and `steps`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BuildRequest {
    /// The image to record (image name rules). An image of that name made
    /// by an earlier build is replaced once this one succeeds.
    #[cfg_attr(feature = "openapi", schema(pattern = "^[a-z0-9][a-z0-9._-]{0,63}$"))]
    pub name: String,
    /// The Dockerfile's text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dockerfile: Option<String>,
    /// Steps instead of a Dockerfile, run on `from`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps: Option<Vec<BuildStepSpec>>,
    /// The base image of `steps` (a stored name or a registry reference).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    /// The digest (`sha256:<hex>`) of a context uploaded with
    /// `PUT /v1/build-contexts/{digest}`: what `COPY` and `ADD` read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<String>,
    /// `ARG` values (`--build-arg`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub build_args: Option<BTreeMap<String, String>>,
    /// The Dockerfile stage to build (default: the last).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// Run every step, even those a cached layer could stand for.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_cache: bool,
    /// How long the whole build may take; default and maximum the
    /// server's run TTL bounds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 1))]
    pub timeout_sec: Option<u64>,
    /// The build run's limits (default: the server's run defaults).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<LimitsRequest>,
    /// Labels of the built image (the run label rules).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
}

/// One step of a step list: a kind and its arguments.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BuildStepSpec {
    /// `RUN` (`[command, user?]`), `COPY` (`[source, destination, owner?,
    /// mode?]`), `ENV` (`[name, value, ...]`), `WORKDIR` (`[path]`) or
    /// `USER` (`[user]`).
    #[serde(rename = "type")]
    pub kind: String,
    /// The arguments, laid out per kind.
    #[serde(default)]
    pub args: Vec<String>,
    /// For `COPY`: the digest of an uploaded context the source is read
    /// from (default: the build's `context`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub files: Option<String>,
}

/// Where a build is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum BuildStatus {
    /// Steps are running.
    Building,
    /// The image is recorded.
    Ready,
    /// A step failed, or the build could not go on; nothing was recorded.
    Failed,
    /// Cancelled (`POST /v1/builds/{id}/cancel`); nothing was recorded.
    Cancelled,
}

impl BuildStatus {
    /// Whether the build has ended.
    pub fn is_final(self) -> bool {
        !matches!(self, BuildStatus::Building)
    }
}

/// Where one step is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum BuildStepStatus {
    /// Not started.
    Pending,
    /// Running now.
    Running,
    /// Done.
    Done,
    /// A cached layer stands for it: not run.
    Cached,
    /// It failed (and so did the build).
    Failed,
}

/// One step of a build, as the build reports it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct BuildStep {
    /// 1-based, in the order the steps run.
    pub index: usize,
    /// The Dockerfile line (or step list position) it comes from.
    pub line: usize,
    /// The instruction, shortened.
    pub text: String,
    /// Where it is.
    pub status: BuildStepStatus,
    /// How long it took, once done.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub elapsed_ms: Option<f64>,
}

/// Why a build failed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct BuildFailure {
    /// The error code (as in error bodies).
    pub code: String,
    /// What went wrong and what to fix.
    pub message: String,
    /// The step that failed, when one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<usize>,
    /// That step's exit code, when its command ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// Its last lines of output.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub output: Vec<String>,
}

/// A build.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Build {
    /// The build's id.
    #[cfg_attr(feature = "openapi", schema(value_type = String))]
    pub id: Ulid,
    /// The image it records.
    pub name: String,
    /// Where it is.
    pub status: BuildStatus,
    /// The base image.
    pub from: String,
    /// The steps, in order.
    pub steps: Vec<BuildStep>,
    /// The run the steps run in, while there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>))]
    pub run: Option<Ulid>,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<BuildFailure>,
    /// What the plan noticed and went on with.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
    /// The tenant it belongs to (none: the operator's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// When it was asked for.
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    /// When it ended.
    #[serde(
        default,
        with = "time::serde::rfc3339::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub finished_at: Option<OffsetDateTime>,
    /// The node that builds it.
    pub server: String,
}

/// `GET /v1/builds`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct BuildList {
    /// The node that answered.
    pub server: String,
    /// The caller's builds, newest first (running ones, and those ended
    /// within a day, the newest 200).
    pub builds: Vec<Build>,
}

/// One line of a build's output.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct BuildLog {
    /// Its position in the build's log, from 0: a client that lost the
    /// stream asks again from the next one (`?offset=`).
    pub offset: u64,
    /// The step it belongs to (0: the build itself).
    pub step: usize,
    /// `stdout`, `stderr` or `build` (what the builder says).
    pub stream: String,
    /// The line, without its newline.
    pub text: String,
    /// When the builder had it.
    #[serde(with = "time::serde::rfc3339")]
    pub time: OffsetDateTime,
}

/// What `PUT /v1/build-contexts/{digest}` stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct BuildContext {
    /// `sha256:<hex>` of the bytes as uploaded.
    pub digest: String,
    /// Entries in the archive.
    pub entries: u64,
    /// Bytes of file content in it.
    pub bytes: u64,
}

/// Event names of `GET /v1/builds/{id}/events` (Server-Sent Events).
pub mod build_sse {
    /// `data` is a [`super::BuildStep`] whose status changed.
    pub const STEP: &str = "step";
    /// `data` is a [`super::BuildLog`].
    pub const LOG: &str = "log";
    /// `data` is the [`super::Build`] as it ended; always the last event.
    pub const DONE: &str = "done";
}
