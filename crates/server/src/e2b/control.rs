//! E2B's control plane over runs: a sandbox is a run, `templateID` its
//! image, `timeout` its TTL, `envVars` its env, `metadata` its labels.
//! Errors are E2B's shape, `{"code": <status>, "message", "error_code"}`,
//! where `error_code` is runbox's stable code.

use std::collections::BTreeMap;

use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use runbox_core::RunService;
use runbox_types::{CreateRunRequest, Env, NetworkTier, Run, RunStatus};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use time::format_description::well_known::Rfc3339;
use ulid::Ulid;

use super::{access_token, traffic_token, ENVD_VERSION};
use crate::{ApiError, AppState};

/// The TTL of a sandbox created without `timeout`, as E2B's default.
const DEFAULT_TIMEOUT_SEC: u64 = 300;

/// The most sandboxes one list page holds.
const MAX_PAGE: usize = 1000;

/// An E2B-shaped error.
#[derive(Debug)]
pub(crate) struct E2bError {
    status: StatusCode,
    message: String,
    code: Option<&'static str>,
}

impl E2bError {
    pub(super) fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            code: None,
        }
    }

    pub(super) fn bad(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, message)
    }

    /// What runbox does not have yet: `501` with a message that says so.
    pub(super) fn unsupported(what: &str) -> Self {
        Self::new(
            StatusCode::NOT_IMPLEMENTED,
            format!("{what} is not supported by runbox; see docs/e2b.md"),
        )
    }
}

impl From<ApiError> for E2bError {
    fn from(e: ApiError) -> Self {
        Self {
            status: StatusCode::from_u16(e.code().status())
                .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            message: e.message().to_owned(),
            code: Some(e.code().as_str()),
        }
    }
}

impl From<runbox_core::CoreError> for E2bError {
    fn from(e: runbox_core::CoreError) -> Self {
        ApiError::from(e).into()
    }
}

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        let mut body = serde_json::json!({
            "code": self.status.as_u16(),
            "message": self.message,
        });
        if let Some(code) = self.code {
            body["error_code"] = Value::from(code);
        }
        (self.status, Json(body)).into_response()
    }
}

/// The control-plane routes (mounted under the token check).
pub fn routes<S: RunService>() -> Router<AppState<S>> {
    Router::new()
        .route("/sandboxes", post(create::<S>).get(list_v1::<S>))
        .route("/v2/sandboxes", post(create::<S>).get(list::<S>))
        .route("/sandboxes/{id}", get(detail::<S>).delete(kill::<S>))
        .route("/sandboxes/{id}/timeout", post(set_timeout::<S>))
        .route("/sandboxes/{id}/connect", post(connect::<S>))
        .route("/v2/sandboxes/{id}/connect", post(connect::<S>))
        .route("/sandboxes/{id}/refreshes", post(refresh::<S>))
        .route("/sandboxes/{id}/metrics", get(metrics::<S>))
        .route("/sandboxes/{id}/fork", post(fork::<S>))
        .route("/sandboxes/{id}/snapshots", post(snapshot::<S>))
        .route("/snapshots", get(list_snapshots::<S>))
        .route(
            "/templates/{id}",
            axum::routing::delete(delete_template::<S>),
        )
        .route("/templates/aliases/{alias}", get(template_alias::<S>))
        .route("/sandboxes/{id}/pause", post(pause::<S>))
        .route("/sandboxes/{id}/resume", post(resume::<S>))
        .route("/sandboxes/{id}/network", axum::routing::put(network::<S>))
        .route("/sandboxes/{id}/logs", get(logs))
        .route("/v2/sandboxes/{id}/logs", get(logs))
        .merge(super::volumes::control_routes())
        .merge(super::templates::routes())
}

/// A JSON body, checked; an empty body is `{}`.
fn body<T: for<'de> Deserialize<'de>>(bytes: &Bytes) -> Result<T, E2bError> {
    let bytes = if bytes.iter().all(u8::is_ascii_whitespace) {
        b"{}".as_slice()
    } else {
        bytes
    };
    serde_json::from_slice(bytes).map_err(|e| E2bError::bad(format!("the body is not valid: {e}")))
}

/// The sandbox a `/sandboxes/{id}...` route names, as
/// [`super::require_api_key`] parsed and admitted it; never parsed again
/// here, so a handler acts on the sandbox that was authorised.
struct SandboxPath(Ulid);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for SandboxPath {
    type Rejection = E2bError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _state: &S,
    ) -> Result<Self, E2bError> {
        match parts.extensions.get::<crate::auth::AdmittedRun>() {
            Some(admitted) => Ok(SandboxPath(admitted.0)),
            None => Err(E2bError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the sandbox this request names was not authorised",
            )),
        }
    }
}

/// `POST /v2/sandboxes` (and `/sandboxes`). Fields runbox cannot honour
/// are refused rather than ignored.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct NewSandbox {
    #[serde(rename = "templateID")]
    template_id: String,
    timeout: Option<u64>,
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
    #[serde(default)]
    env_vars: Option<BTreeMap<String, String>>,
    #[serde(rename = "allow_internet_access", alias = "allowInternetAccess")]
    allow_internet_access: Option<bool>,
    auto_pause: Option<bool>,
    auto_resume: Option<Value>,
    auto_pause_memory: Option<Value>,
    network: Option<Value>,
    mcp: Option<Value>,
    volume_mounts: Option<Value>,
    iam: Option<Value>,
    secure: Option<bool>,
    #[serde(flatten)]
    other: BTreeMap<String, Value>,
}

/// `volumeMounts` at create: `[{"name", "path"}]`, each a volume of the
/// caller's mounted read-write at `path` (the daemon checks names, paths
/// and holders as for its own creates).
fn volume_mounts(
    value: Option<&Value>,
) -> Result<Option<Vec<runbox_types::VolumeMountRequest>>, E2bError> {
    if is_null_or_empty(&value.cloned()) {
        return Ok(None);
    }
    let bad = || E2bError::bad("volumeMounts must be a list of {\"name\", \"path\"} objects");
    let list = value.and_then(Value::as_array).ok_or_else(bad)?;
    let mut out = Vec::with_capacity(list.len());
    for entry in list {
        let field = |key: &str| {
            entry
                .get(key)
                .and_then(Value::as_str)
                .map(str::to_owned)
                .ok_or_else(bad)
        };
        if entry
            .as_object()
            .is_some_and(|o| o.keys().any(|k| k != "name" && k != "path"))
        {
            return Err(bad());
        }
        // Each volume's default mode: read-write for a named volume (E2B
        // mounts its volumes so), read-only for a catalog dataset.
        out.push(runbox_types::VolumeMountRequest {
            name: field("name")?,
            path: Some(field("path")?),
            mode: None,
        });
    }
    Ok(Some(out))
}

/// A created or connected sandbox, as the SDKs read it.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct Sandbox {
    #[serde(rename = "templateID")]
    template_id: String,
    #[serde(rename = "sandboxID")]
    sandbox_id: String,
    #[serde(rename = "clientID")]
    client_id: String,
    envd_version: &'static str,
    envd_access_token: String,
    /// What opens the sandbox's ports when they are not public.
    traffic_access_token: Option<String>,
    domain: Option<String>,
}

fn sandbox<S: RunService>(state: &AppState<S>, run: &Run) -> Sandbox {
    Sandbox {
        template_id: run.image.clone(),
        sandbox_id: run.id.to_string(),
        client_id: state.service.server_id().to_owned(),
        envd_version: ENVD_VERSION,
        envd_access_token: access_token(&state.token, run.id),
        traffic_access_token: (!run.public_ports).then(|| traffic_token(&state.token, run.id)),
        domain: None,
    }
}

/// The keys of `network` that say what the sandbox may reach (see
/// `super::network`).
const EGRESS_KEYS: &[&str] = &[
    "allowOut",
    "allow_out",
    "denyOut",
    "deny_out",
    "rules",
    "egressProxy",
    "egress_proxy",
    "maskRequestHost",
    "mask_request_host",
];

/// Whether a create's sandbox serves its ports publicly: E2B's
/// `network.allowPublicTraffic`, true unless set false. The egress keys
/// are read by `super::network`.
fn public_traffic(network: Option<&Value>) -> Result<bool, E2bError> {
    let Some(Value::Object(network)) = network else {
        return match network {
            None | Some(Value::Null) => Ok(true),
            Some(_) => Err(E2bError::bad("network must be an object")),
        };
    };
    let mut public = true;
    for (key, value) in network {
        match (key.as_str(), value) {
            ("allowPublicTraffic" | "allow_public_traffic", Value::Bool(b)) => public = *b,
            ("allowPublicTraffic" | "allow_public_traffic", Value::Null) => {}
            (key, _) if EGRESS_KEYS.contains(&key) => {}
            ("allowPublicTraffic" | "allow_public_traffic", _) => {
                return Err(E2bError::bad(
                    "network.allowPublicTraffic must be true or false",
                ))
            }
            (_, Value::Null) => {}
            (_, Value::Array(a)) if a.is_empty() => {}
            (other, _) => return Err(E2bError::unsupported(&format!("`network.{other}`"))),
        }
    }
    Ok(public)
}

/// E2B's `autoResume: {enabled}`: whether traffic to the sandbox while it
/// is paused resumes it. Off unless enabled, as on E2B.
fn auto_resume(config: Option<&Value>) -> Result<bool, E2bError> {
    match config {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(enabled)) => Ok(*enabled),
        Some(Value::Object(o)) => match o.get("enabled") {
            None | Some(Value::Null) => Ok(false),
            Some(Value::Bool(enabled)) if o.len() == 1 => Ok(*enabled),
            Some(Value::Bool(_)) => Err(E2bError::bad("autoResume takes only `enabled`")),
            Some(_) => Err(E2bError::bad("autoResume.enabled must be true or false")),
        },
        Some(_) => Err(E2bError::bad(
            "autoResume must be an object: {\"enabled\": true}",
        )),
    }
}

fn is_null_or_empty(v: &Option<Value>) -> bool {
    match v {
        None | Some(Value::Null) => true,
        Some(Value::Object(o)) => o.is_empty(),
        Some(Value::Array(a)) => a.is_empty(),
        Some(_) => false,
    }
}

async fn create<S: RunService>(
    State(state): State<AppState<S>>,
    caller: crate::auth::Caller,
    headers: HeaderMap,
    uri: axum::http::Uri,
    bytes: Bytes,
) -> Result<Response, E2bError> {
    let mut req: NewSandbox = body(&bytes)?;
    if let Some(name) = req.other.keys().next() {
        return Err(E2bError::bad(format!("unknown field {name:?}")));
    }
    let auto_resume = auto_resume(req.auto_resume.as_ref())?;
    // A pause at the timeout keeps memory unless `autoPauseMemory: false`
    // asks for a filesystem-only one: runbox's hibernation.
    let keep_memory = match &req.auto_pause_memory {
        None | Some(Value::Null) => true,
        Some(Value::Bool(keep)) => *keep,
        Some(_) => return Err(E2bError::bad("autoPauseMemory must be true or false")),
    };
    let on_expire = match (req.auto_pause, keep_memory) {
        (Some(true), true) => runbox_types::OnExpire::Pause,
        (Some(true), false) => runbox_types::OnExpire::Hibernate,
        _ => runbox_types::OnExpire::Delete,
    };
    let public_ports = public_traffic(req.network.as_ref())?;
    let volumes = volume_mounts(req.volume_mounts.as_ref())?;
    for (name, value) in [("mcp", &req.mcp), ("iam", &req.iam)] {
        if !is_null_or_empty(value) {
            return Err(E2bError::unsupported(&format!("`{name}`")));
        }
    }
    let _ = req.secure;
    if req.template_id.is_empty() {
        return Err(E2bError::bad("templateID is empty; name an image"));
    }
    // `alias:tag` names a template's tag (see [`super::templates`]).
    req.template_id = super::templates::template_image(&req.template_id);
    let empty = serde_json::Map::new();
    let egress = super::network::egress(
        req.allow_internet_access,
        req.network
            .as_ref()
            .and_then(Value::as_object)
            .unwrap_or(&empty),
        false,
    )?;
    let network = egress.network;
    let allowlist = network == Some(NetworkTier::Allowlist);
    // E2B has no size tiers: a create takes the smallest tier the image has
    // a warm pool for (so pools serve the SDKs unchanged), else the
    // server's default limits.
    let tier = network.unwrap_or_default();
    let size = state
        .service
        .pools()
        .pools
        .iter()
        .filter(|p| p.image == req.template_id && p.network == tier)
        .map(|p| p.size)
        .min();
    let create = CreateRunRequest {
        image: req.template_id,
        size,
        env: req.env_vars.filter(|e| !e.is_empty()).map(Env),
        ttl_sec: Some(req.timeout.unwrap_or(DEFAULT_TIMEOUT_SEC)),
        network,
        egress_allow: allowlist.then_some(egress.allow),
        egress_defaults: allowlist.then_some(false),
        secrets: (allowlist && !egress.secrets.is_empty()).then_some(egress.secrets),
        egress_upstream: egress.upstream.filter(|_| allowlist),
        labels: req.metadata.filter(|m| !m.is_empty()),
        public_ports: Some(public_ports),
        auto_resume: Some(auto_resume),
        on_expire: Some(on_expire),
        // E2B's templates give their `user` account passwordless sudo, and
        // its SDKs use it. Where root in a run is an unprivileged host id,
        // sudo gains nothing outside the run, so it works here too.
        allow_privilege_escalation: Some(state.service.user_namespaces()),
        volumes,
        ..Default::default()
    };
    let key = match headers.get(crate::handlers::IDEMPOTENCY_KEY) {
        None => None,
        Some(v) => Some(
            v.to_str()
                .map_err(|_| E2bError::bad("Idempotency-Key must be visible ASCII characters"))?
                .to_owned(),
        ),
    };
    // On a node of a fleet: made where placement says, and sent to a node
    // with room when this one has none (as runbox's own creates are).
    let owner = caller.owner();
    let placeable = state.service.in_fleet() && !headers.contains_key(crate::forward::NODE_PROOF);
    let elsewhere = |at: runbox_core::fleet::Located| {
        let (state, headers, path) = (&state, &headers, uri.path());
        let body = bytes.to_vec();
        async move { crate::handlers::create_elsewhere(state, &at, headers, path, body).await }
    };
    if placeable {
        match state.service.place(&create, &owner, false).await {
            Ok(Some(at)) => return Ok(elsewhere(at).await),
            // The volumes it mounts are on a node that cannot take it;
            // without the database, the create is made here.
            Err(e) if e.code() != runbox_types::ErrorCode::ClusterUnavailable => {
                return Err(e.into())
            }
            _ => {}
        }
    }
    let again = placeable.then(|| create.clone());
    let run = match state.service.create(create, key, owner.clone()).await {
        Ok(run) => run,
        Err(runbox_core::CoreError::Capacity(max)) if again.is_some() => {
            let create = again.unwrap_or_default();
            return match state.service.place(&create, &owner, true).await {
                Ok(Some(at)) => Ok(elsewhere(at).await),
                _ => Err(runbox_core::CoreError::Capacity(max).into()),
            };
        }
        Err(e) => return Err(e.into()),
    };
    // A template's start command runs, and its ready command is waited
    // for, before the sandbox is handed over.
    if let Ok(image) = state.service.get_image(&run.image) {
        if let Err(e) = super::templates::start_template_commands(&state, run.id, &image).await {
            let _ = state.service.delete(run.id).await;
            return Err(e);
        }
    }
    Ok((StatusCode::CREATED, Json(sandbox(&state, &run))).into_response())
}

/// A sandbox in a list or a detail answer.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct Listed {
    #[serde(rename = "templateID")]
    template_id: String,
    #[serde(rename = "sandboxID")]
    sandbox_id: String,
    #[serde(rename = "clientID")]
    client_id: String,
    started_at: String,
    end_at: String,
    envd_version: &'static str,
    cpu_count: u64,
    #[serde(rename = "memoryMB")]
    memory_mb: u64,
    #[serde(rename = "diskSizeMB")]
    disk_size_mb: u64,
    state: &'static str,
    metadata: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    envd_access_token: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    lifecycle: Option<Lifecycle>,
    /// The volumes it mounts, as `{"name", "path"}`.
    volume_mounts: Vec<BTreeMap<&'static str, String>>,
}

/// What a sandbox does at its timeout and on traffic while paused.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct Lifecycle {
    auto_resume: bool,
    on_timeout: &'static str,
}

/// A run's E2B state: `running`, or `paused` (runbox's paused and
/// hibernated runs: E2B's full and filesystem-only pauses).
fn e2b_state(run: &Run) -> &'static str {
    match run.status {
        RunStatus::Paused | RunStatus::Hibernated | RunStatus::Archived => "paused",
        _ => "running",
    }
}

/// Whether a run sleeps (paused or hibernated).
fn asleep(run: &Run) -> bool {
    matches!(
        run.status,
        RunStatus::Paused | RunStatus::Hibernated | RunStatus::Archived
    )
}

/// A run's CPU limit as E2B's whole CPU count.
fn cpu_count(run: &Run) -> u64 {
    run.limits.cpus.ceil().max(1.0) as u64
}

fn rfc3339(t: time::OffsetDateTime) -> String {
    t.format(&Rfc3339).unwrap_or_default()
}

fn listed<S: RunService>(state: &AppState<S>, run: &Run, detail: bool) -> Listed {
    Listed {
        template_id: run.image.clone(),
        sandbox_id: run.id.to_string(),
        client_id: state.service.server_id().to_owned(),
        started_at: rfc3339(run.created_at),
        end_at: rfc3339(run.expires_at),
        envd_version: ENVD_VERSION,
        cpu_count: cpu_count(run),
        memory_mb: run.limits.memory_mb,
        disk_size_mb: run.limits.disk_mb.unwrap_or(0),
        state: e2b_state(run),
        metadata: run.labels.clone(),
        volume_mounts: run
            .volumes
            .iter()
            .map(|v| BTreeMap::from([("name", v.name.clone()), ("path", v.path.clone())]))
            .collect(),
        envd_access_token: detail.then(|| access_token(&state.token, run.id)),
        lifecycle: detail.then_some(Lifecycle {
            auto_resume: run.auto_resume,
            on_timeout: match run.on_expire {
                runbox_types::OnExpire::Pause
                | runbox_types::OnExpire::Hibernate
                | runbox_types::OnExpire::Archive => "pause",
                runbox_types::OnExpire::Delete => "kill",
            },
        }),
    }
}

/// Runs the E2B surface shows: running, paused, hibernated and archived ones (a
/// failed or stopping run is no sandbox any more).
/// The caller's sandboxes that are running or asleep, on every node of the
/// fleet.
async fn live<S: RunService>(
    state: &AppState<S>,
    caller: &crate::auth::Caller,
) -> Result<Vec<Run>, E2bError> {
    Ok(state
        .service
        .list_fleet()
        .await?
        .into_iter()
        .filter(|r| r.status == RunStatus::Running || asleep(r))
        .filter(|r| caller.sees(r.tenant.as_deref()))
        .collect())
}

async fn detail<S: RunService>(
    State(state): State<AppState<S>>,
    SandboxPath(id): SandboxPath,
) -> Result<Json<Listed>, E2bError> {
    let run = state.service.get(id)?;
    Ok(Json(listed(&state, &run, true)))
}

async fn kill<S: RunService>(
    State(state): State<AppState<S>>,
    SandboxPath(id): SandboxPath,
) -> Result<StatusCode, E2bError> {
    state.service.kill(id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Timeout {
    timeout: u64,
}

async fn set_timeout<S: RunService>(
    State(state): State<AppState<S>>,
    SandboxPath(id): SandboxPath,
    bytes: Bytes,
) -> Result<StatusCode, E2bError> {
    let req: Timeout = body(&bytes)?;
    // E2B's 0 is "time out now": the shortest TTL runbox has.
    state.service.renew(id, req.timeout.max(1)).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize)]
struct Refresh {
    duration: Option<u64>,
}

async fn refresh<S: RunService>(
    State(state): State<AppState<S>>,
    SandboxPath(id): SandboxPath,
    bytes: Bytes,
) -> Result<StatusCode, E2bError> {
    let req: Refresh = body(&bytes)?;
    let ttl = req.duration.unwrap_or(DEFAULT_TIMEOUT_SEC);
    state.service.renew(id, ttl).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize)]
struct Connect {
    timeout: Option<u64>,
    #[allow(dead_code)]
    memory: Option<Value>,
}

/// Connecting to a sandbox: a paused one is resumed, a hibernated one
/// woken (`201`), a running one
/// answered as it is (`200`); with `timeout`, its TTL becomes at least
/// that (a connect never shortens it).
async fn connect<S: RunService>(
    State(state): State<AppState<S>>,
    SandboxPath(id): SandboxPath,
    bytes: Bytes,
) -> Result<Response, E2bError> {
    let req: Connect = body(&bytes)?;
    let mut run = state.service.get(id)?;
    let status = if asleep(&run) {
        run = state.service.resume(id).await?;
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    if let Some(timeout) = req.timeout {
        let left = (run.expires_at - time::OffsetDateTime::now_utc()).whole_seconds();
        if left < timeout as i64 {
            run = state.service.renew(id, timeout).await?;
        }
    }
    Ok((status, Json(sandbox(&state, &run))).into_response())
}

/// The filters and page of `GET /v2/sandboxes`.
#[derive(Debug)]
struct ListQuery {
    metadata: BTreeMap<String, String>,
    states: Vec<String>,
    /// Only sandboxes started at or after this instant.
    started_after: Option<time::OffsetDateTime>,
    /// Only sandboxes of this template (image).
    template: Option<String>,
    limit: Option<usize>,
    next_token: Option<Ulid>,
    /// Newest first, as E2B lists by default.
    descending: bool,
}

impl Default for ListQuery {
    fn default() -> Self {
        ListQuery {
            metadata: BTreeMap::new(),
            states: Vec::new(),
            started_after: None,
            template: None,
            limit: None,
            next_token: None,
            descending: true,
        }
    }
}

impl ListQuery {
    /// Whether `run` passes the query's filters (not its page).
    fn admits(&self, run: &Run) -> bool {
        self.metadata
            .iter()
            .all(|(k, v)| run.labels.get(k) == Some(v))
            && self.started_after.is_none_or(|t| run.created_at >= t)
            && self
                .template
                .as_ref()
                .is_none_or(|t| template_matches(t, &run.image))
    }
}

/// Whether a template filter names `image`: its name, or its name with
/// E2B's default tag (`name:default`).
fn template_matches(filter: &str, image: &str) -> bool {
    filter == image || filter.strip_suffix(":default") == Some(image)
}

/// An RFC 3339 instant as the SDKs send it. A `+` offset that reached the
/// query unencoded reads as a space; it is taken back as `+`.
fn instant(raw: &str) -> Result<time::OffsetDateTime, E2bError> {
    let fixed = raw.trim().replace(' ', "+");
    time::OffsetDateTime::parse(&fixed, &Rfc3339).map_err(|_| {
        E2bError::bad(format!(
            "startedAfter {raw:?} is not an RFC 3339 time (2026-01-02T03:04:05Z)"
        ))
    })
}

fn list_query(raw: Option<&str>) -> Result<ListQuery, E2bError> {
    let mut q = ListQuery::default();
    for (key, value) in form_urlencoded::parse(raw.unwrap_or("").as_bytes()) {
        match key.as_ref() {
            // `metadata` is itself `k=v&...`, each side percent-encoded.
            "metadata" => {
                for (k, v) in form_urlencoded::parse(value.as_bytes()) {
                    let k = percent_encoding::percent_decode_str(&k).decode_utf8_lossy();
                    let v = percent_encoding::percent_decode_str(&v).decode_utf8_lossy();
                    q.metadata.insert(k.into_owned(), v.into_owned());
                }
            }
            "state" => q.states.extend(value.split(',').map(str::to_owned)),
            "limit" => q.limit = Some(page_limit(&value)?),
            "nextToken" => {
                q.next_token = Some(
                    runbox_types::parse_id(&value)
                        .ok_or_else(|| E2bError::bad("nextToken is not one this server gave"))?,
                )
            }
            "order" => match value.as_ref() {
                "asc" => q.descending = false,
                "desc" => q.descending = true,
                other => return Err(E2bError::bad(format!("order {other:?} is not asc or desc"))),
            },
            "startedAfter" => q.started_after = Some(instant(&value)?),
            "template" => q.template = Some(value.into_owned()),
            other => return Err(E2bError::bad(format!("unknown query parameter {other:?}"))),
        }
    }
    for state in &q.states {
        if state != "running" && state != "paused" {
            return Err(E2bError::bad(format!(
                "state {state:?} is not running or paused"
            )));
        }
    }
    Ok(q)
}

async fn list<S: RunService>(
    State(state): State<AppState<S>>,
    caller: crate::auth::Caller,
    RawQuery(raw): RawQuery,
) -> Result<Response, E2bError> {
    let q = list_query(raw.as_deref())?;
    let mut runs: Vec<Run> = live(&state, &caller)
        .await?
        .into_iter()
        .filter(|r| q.states.is_empty() || q.states.iter().any(|s| s == e2b_state(r)))
        .filter(|r| q.admits(r))
        .collect();
    // Ids are ULIDs: their order is their creation order.
    runs.sort_by_key(|r| r.id);
    if q.descending {
        runs.reverse();
    }
    if let Some(after) = q.next_token {
        runs.retain(|r| {
            if q.descending {
                r.id < after
            } else {
                r.id > after
            }
        });
    }
    Ok(paged(
        runs,
        q.limit,
        |r| listed(&state, r, false),
        |r| r.id.to_string(),
    ))
}

/// One page of `items` (at most `limit`, default [`MAX_PAGE`]) as JSON,
/// with `x-next-token` naming the last one when more follow.
fn paged<T, S: Serialize>(
    mut items: Vec<T>,
    limit: Option<usize>,
    show: impl Fn(&T) -> S,
    token: impl Fn(&T) -> String,
) -> Response {
    let limit = limit.unwrap_or(MAX_PAGE);
    let more = items.len() > limit;
    items.truncate(limit);
    let page: Vec<S> = items.iter().map(show).collect();
    let mut response = Json(page).into_response();
    if let Some(last) = items.last().filter(|_| more) {
        if let Ok(v) = HeaderValue::from_str(&token(last)) {
            response.headers_mut().insert("x-next-token", v);
        }
    }
    response
}

/// `GET /sandboxes` (v1): every running sandbox that passes the filters,
/// one page, newest first.
async fn list_v1<S: RunService>(
    State(state): State<AppState<S>>,
    caller: crate::auth::Caller,
    RawQuery(raw): RawQuery,
) -> Result<Json<Vec<Listed>>, E2bError> {
    let q = list_query(raw.as_deref())?;
    // The first API lists running sandboxes only.
    let mut runs: Vec<Run> = live(&state, &caller)
        .await?
        .into_iter()
        .filter(|r| r.status == RunStatus::Running && q.admits(r))
        .collect();
    runs.sort_by_key(|r| std::cmp::Reverse(r.id));
    Ok(Json(
        runs.iter().map(|r| listed(&state, r, false)).collect(),
    ))
}

/// One metrics sample as the SDKs read it.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct Metric {
    timestamp: String,
    timestamp_unix: i64,
    cpu_count: u64,
    cpu_used_pct: f64,
    mem_used: u64,
    mem_total: u64,
    mem_cache: u64,
    disk_used: u64,
    disk_total: u64,
}

/// How far apart the two usage readings of a metrics call are: CPU use is
/// their difference.
const CPU_SAMPLE: std::time::Duration = std::time::Duration::from_millis(100);

/// `start` and `end` of a metrics call: Unix seconds.
fn metrics_window(
    raw: Option<&str>,
) -> Result<(Option<time::OffsetDateTime>, Option<time::OffsetDateTime>), E2bError> {
    let (mut start, mut end) = (None, None);
    for (key, value) in form_urlencoded::parse(raw.unwrap_or("").as_bytes()) {
        let at = || {
            value
                .parse::<i64>()
                .ok()
                .and_then(|s| time::OffsetDateTime::from_unix_timestamp(s).ok())
                .ok_or_else(|| E2bError::bad(format!("{key} must be a Unix time in seconds")))
        };
        match key.as_ref() {
            "start" => start = Some(at()?),
            // Second precision: the whole last second is in the window.
            "end" => end = Some(at()? + time::Duration::nanoseconds(999_999_999)),
            other => return Err(E2bError::bad(format!("unknown query parameter {other:?}"))),
        }
    }
    if let (Some(s), Some(e)) = (start, end) {
        if s > e {
            return Err(E2bError::bad("start must not be after end"));
        }
    }
    Ok((start, end))
}

/// A run's metrics: the samples its history holds (every
/// `USAGE_SAMPLE_EVERY`, the last hour) in `[start, end]`; without a
/// window, all of them, or, before the first is taken, one taken now from
/// the run's cgroup. CPU use is a share of the run's CPU limit, memory is
/// what is charged (page cache included, as `memCache`), disk what was
/// written to the run's own volume.
async fn metrics<S: RunService>(
    State(state): State<AppState<S>>,
    SandboxPath(id): SandboxPath,
    RawQuery(raw): RawQuery,
) -> Result<Json<Vec<Metric>>, E2bError> {
    let (start, end) = metrics_window(raw.as_deref())?;
    let run = state.service.get(id)?;
    let history = state.service.usage_history(id, start, end)?;
    if !history.is_empty() || start.is_some() || end.is_some() {
        let metric = |s: runbox_core::runs::UsageSample| Metric {
            timestamp: rfc3339(s.at),
            timestamp_unix: s.at.unix_timestamp(),
            cpu_count: cpu_count(&run),
            cpu_used_pct: s.cpu_pct,
            mem_used: s.memory_bytes,
            mem_total: run.limits.memory_mb << 20,
            mem_cache: s.memory_cache_bytes,
            disk_used: s.disk_used_bytes.unwrap_or(0),
            disk_total: run.limits.disk_mb.unwrap_or(0) << 20,
        };
        return Ok(Json(history.into_iter().map(metric).collect()));
    }
    let unmeasured = || E2bError::unsupported("metrics of this sandbox's lane");
    let before = state.service.usage(id)?.ok_or_else(unmeasured)?;
    let started = std::time::Instant::now();
    tokio::time::sleep(CPU_SAMPLE).await;
    let after = state.service.usage(id)?.ok_or_else(unmeasured)?;
    let wall_ns = started.elapsed().as_nanos().max(1) as f64;
    let cpus = run.limits.cpus.max(0.01);
    let cpu_used_pct =
        (after.cpu_ns.saturating_sub(before.cpu_ns) as f64 / wall_ns / cpus * 100.0).min(100.0);
    let now = time::OffsetDateTime::now_utc();
    Ok(Json(vec![Metric {
        timestamp: rfc3339(now),
        timestamp_unix: now.unix_timestamp(),
        cpu_count: cpu_count(&run),
        cpu_used_pct: (cpu_used_pct * 100.0).round() / 100.0,
        mem_used: after.memory_bytes,
        mem_total: run.limits.memory_mb << 20,
        mem_cache: after.memory_cache_bytes,
        disk_used: run.disk_used_bytes.unwrap_or(0),
        disk_total: run.limits.disk_mb.unwrap_or(0) << 20,
    }]))
}

#[derive(Debug, Deserialize)]
struct ForkBody {
    timeout: Option<u64>,
    count: Option<usize>,
}

/// Forks map onto runbox's: each new sandbox starts from the source's
/// filesystem (not its memory).
async fn fork<S: RunService>(
    State(state): State<AppState<S>>,
    SandboxPath(id): SandboxPath,
    bytes: Bytes,
) -> Result<Response, E2bError> {
    let req: ForkBody = body(&bytes)?;
    let count = req.count.unwrap_or(1);
    if !(1..=20).contains(&count) {
        return Err(E2bError::bad("count must be 1 to 20"));
    }
    let reply = state
        .service
        .fork(
            id,
            runbox_types::ForkRequest {
                count,
                ttl_sec: Some(req.timeout.unwrap_or(DEFAULT_TIMEOUT_SEC)),
                point: None,
            },
        )
        .await?;
    let results: Vec<Value> = reply
        .runs
        .iter()
        .map(|run| serde_json::json!({ "sandbox": sandbox(&state, run) }))
        .collect();
    Ok((StatusCode::CREATED, Json(results)).into_response())
}

#[derive(Debug, Deserialize)]
struct SnapshotBody {
    name: Option<String>,
    #[allow(dead_code)]
    memory: Option<Value>,
}

/// A snapshot is a runbox snapshot: a new image, which `templateID` can
/// name to create sandboxes from it.
async fn snapshot<S: RunService>(
    State(state): State<AppState<S>>,
    SandboxPath(id): SandboxPath,
    bytes: Bytes,
) -> Result<Response, E2bError> {
    let req: SnapshotBody = body(&bytes)?;
    let snap = state
        .service
        .snapshot(
            id,
            runbox_types::SnapshotRequest {
                name: req.name,
                labels: None,
                point: None,
            },
        )
        .await?;
    Ok((StatusCode::CREATED, Json(snapshot_info(&snap.image))).into_response())
}

/// E2B's `SnapshotInfo` for a snapshot image.
fn snapshot_info(name: &str) -> Value {
    serde_json::json!({ "snapshotID": name, "names": [name] })
}

/// The filters and page of `GET /snapshots`.
#[derive(Debug, Default)]
struct SnapshotQuery {
    /// Only snapshots of this sandbox.
    sandbox: Option<String>,
    /// Only the snapshot of this name (a `:default` tag is its name).
    name: Option<String>,
    limit: Option<usize>,
    /// Where the previous page ended: `<created, ns>~<name>`.
    after: Option<(i128, String)>,
}

fn snapshot_query(raw: Option<&str>) -> Result<SnapshotQuery, E2bError> {
    let mut q = SnapshotQuery::default();
    for (key, value) in form_urlencoded::parse(raw.unwrap_or("").as_bytes()) {
        match key.as_ref() {
            "sandboxID" => q.sandbox = Some(value.into_owned()),
            "name" => q.name = Some(value.into_owned()),
            "limit" => q.limit = Some(page_limit(&value)?),
            "nextToken" => {
                let token = value
                    .split_once('~')
                    .and_then(|(t, name)| Some((t.parse().ok()?, name.to_owned())))
                    .ok_or_else(|| E2bError::bad("nextToken is not one this server gave"))?;
                q.after = Some(token);
            }
            other => return Err(E2bError::bad(format!("unknown query parameter {other:?}"))),
        }
    }
    Ok(q)
}

/// A page size, 1 to [`MAX_PAGE`].
fn page_limit(raw: &str) -> Result<usize, E2bError> {
    raw.parse()
        .ok()
        .filter(|l| (1..=MAX_PAGE).contains(l))
        .ok_or_else(|| E2bError::bad(format!("limit must be 1 to {MAX_PAGE}")))
}

/// `GET /snapshots`: snapshot images, newest first, filtered by the
/// sandbox they were taken from and by name, paged by `x-next-token`.
async fn list_snapshots<S: RunService>(
    State(state): State<AppState<S>>,
    caller: crate::auth::Caller,
    headers: HeaderMap,
    RawQuery(raw): RawQuery,
) -> Result<Response, E2bError> {
    let q = snapshot_query(raw.as_deref())?;
    let mut images = state.service.list_images()?;
    // A snapshot is an image of the node that took it: on a node of a
    // fleet, the other nodes' are read too (asked here, not by a node).
    if state.service.in_fleet() && !headers.contains_key(crate::forward::NODE_PROOF) {
        let others: Vec<runbox_types::ImageList> =
            crate::forward::read_others(&state.service, &state.token, "/v1/images").await;
        images.extend(others.into_iter().flat_map(|list| list.images));
    }
    // Newest first; images made in the same instant (times are kept to the
    // second or so) by name, descending, which for generated names
    // (`snap-<ulid>`) is newest first too.
    let key = |i: &runbox_types::Image| {
        (
            std::cmp::Reverse(i.created_at.unix_timestamp_nanos()),
            std::cmp::Reverse(i.name.clone()),
        )
    };
    let mut snaps: Vec<runbox_types::Image> = images
        .into_iter()
        .filter(|i| i.is_snapshot() && caller.sees(i.tenant.as_deref()))
        .filter(|i| {
            q.sandbox
                .as_deref()
                .is_none_or(|s| i.snapshot_of() == Some(s))
        })
        .filter(|i| {
            q.name
                .as_deref()
                .is_none_or(|n| template_matches(n, &i.name))
        })
        .collect();
    snaps.sort_by_key(key);
    if let Some((created, name)) = &q.after {
        let after = (std::cmp::Reverse(*created), std::cmp::Reverse(name.clone()));
        snaps.retain(|i| key(i) > after);
    }
    Ok(paged(
        snaps,
        q.limit,
        |i| snapshot_info(&i.name),
        |i| format!("{}~{}", i.created_at.unix_timestamp_nanos(), i.name),
    ))
}

/// `DELETE /templates/{id}`: how the SDKs delete a snapshot. Only snapshot
/// images go this way (another image is `404`, as on runbox's own
/// `DELETE /v1/snapshots/{name}`); one a sandbox still uses is `409`.
async fn delete_template<S: RunService>(
    State(state): State<AppState<S>>,
    caller: crate::auth::Caller,
    Path(id): Path<String>,
    method: axum::http::Method,
    uri: axum::http::Uri,
    headers: HeaderMap,
) -> Result<Response, E2bError> {
    let name = super::templates::template_image(&id);
    // A template built here goes whole: every tag the caller may delete.
    let built = super::templates::template_images(&state, &caller, &id);
    if !built.is_empty() {
        for image in built {
            state.service.delete_image(image).await?;
        }
        return Ok(StatusCode::NO_CONTENT.into_response());
    }
    let image = match visible_image(&state, &caller, &name) {
        Ok(image) => image,
        // Another node's snapshot, on a node of a fleet: its node deletes it.
        Err(e) => match crate::forward::ask_others(&state.service, &method, &uri, &headers).await {
            Some(answered) => return Ok(answered),
            None => return Err(e),
        },
    };
    if !image.is_snapshot() || !caller.sees(image.tenant.as_deref()) {
        return Err(E2bError::new(
            StatusCode::NOT_FOUND,
            format!("{name:?} is an image, not a snapshot; runbox deletes images with DELETE /v1/images/{name}"),
        ));
    }
    state.service.delete_image(name).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// Image `name` if the caller may see it (shared, or its own snapshot).
fn visible_image<S: RunService>(
    state: &AppState<S>,
    caller: &crate::auth::Caller,
    name: &str,
) -> Result<runbox_types::Image, E2bError> {
    let image = state.service.get_image(name)?;
    if image.tenant.is_some() && !caller.sees(image.tenant.as_deref()) {
        return Err(runbox_core::CoreError::ImageNotFound(name.to_owned()).into());
    }
    Ok(image)
}

/// `GET /templates/aliases/{alias}`: whether a template (an image) of
/// that name exists, as `Template.exists` asks.
async fn template_alias<S: RunService>(
    State(state): State<AppState<S>>,
    caller: crate::auth::Caller,
    Path(alias): Path<String>,
) -> Result<Json<Value>, E2bError> {
    let name = super::templates::template_image(&alias);
    let image = visible_image(&state, &caller, &name)?;
    Ok(Json(
        serde_json::json!({ "templateID": image.name, "public": false }),
    ))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PauseRequest {
    /// Keep memory (the default): runbox's pause. False asks for a
    /// filesystem-only pause: runbox's hibernation.
    memory: Option<bool>,
}

/// `POST /sandboxes/{id}/pause`: `204`; `409` when already paused.
async fn pause<S: RunService>(
    State(state): State<AppState<S>>,
    SandboxPath(id): SandboxPath,
    bytes: Bytes,
) -> Result<StatusCode, E2bError> {
    // An empty body reads as `{}`.
    let req: PauseRequest = body(&bytes)?;
    if asleep(&state.service.get(id)?) {
        return Err(E2bError::conflict(format!(
            "sandbox {id} is already paused"
        )));
    }
    if req.memory == Some(false) {
        state.service.hibernate(id).await?;
    } else {
        state.service.pause(id).await?;
    }
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ResumeRequest {
    timeout: Option<u64>,
    auto_pause: Option<bool>,
}

/// `POST /sandboxes/{id}/resume` (E2B's older call; the SDKs now connect):
/// resumes a paused sandbox (wakes a hibernated one) with a new timeout,
/// `201`; `409` when it runs.
async fn resume<S: RunService>(
    State(state): State<AppState<S>>,
    SandboxPath(id): SandboxPath,
    bytes: Bytes,
) -> Result<Response, E2bError> {
    // An empty body reads as `{}`.
    let req: ResumeRequest = body(&bytes)?;
    if req.auto_pause == Some(true) {
        return Err(E2bError::unsupported(
            "pausing a sandbox at its timeout (`autoPause`); pause it explicitly",
        ));
    }
    if !asleep(&state.service.get(id)?) {
        return Err(E2bError::conflict(format!("sandbox {id} is not paused")));
    }
    state.service.resume(id).await?;
    let run = state
        .service
        .renew(id, req.timeout.unwrap_or(DEFAULT_TIMEOUT_SEC))
        .await?;
    Ok((StatusCode::CREATED, Json(sandbox(&state, &run))).into_response())
}

/// `PUT /sandboxes/{id}/network`: replaces the sandbox's egress settings
/// (every one the body leaves out is cleared, as on E2B), live; `204`.
async fn network<S: RunService>(
    State(state): State<AppState<S>>,
    SandboxPath(id): SandboxPath,
    bytes: Bytes,
) -> Result<Response, E2bError> {
    let req: serde_json::Map<String, Value> = body(&bytes)?;
    let mut allow_internet = None;
    for (key, value) in &req {
        match (key.as_str(), value) {
            ("allow_internet_access" | "allowInternetAccess", Value::Bool(b)) => {
                allow_internet = Some(*b)
            }
            ("allow_internet_access" | "allowInternetAccess", Value::Null) => {}
            ("allow_internet_access" | "allowInternetAccess", _) => {
                return Err(E2bError::bad("allow_internet_access must be true or false"))
            }
            (key, _) if EGRESS_KEYS.contains(&key) => {}
            (other, _) => return Err(E2bError::bad(format!("unknown field {other:?}"))),
        }
    }
    let update = super::network::egress(allow_internet, &req, true)?.update();
    state.service.update_egress(id, update).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn logs() -> E2bError {
    E2bError::unsupported("sandbox logs")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volume_mounts_are_name_and_path_pairs_in_the_default_mode() {
        let value = serde_json::json!([{"name": "data", "path": "/mnt/data"}]);
        let mounts = volume_mounts(Some(&value)).unwrap().unwrap();
        assert_eq!(
            (
                mounts[0].name.as_str(),
                mounts[0].path.as_deref(),
                mounts[0].mode
            ),
            ("data", Some("/mnt/data"), None)
        );
        for empty in [serde_json::json!(null), serde_json::json!([])] {
            assert!(volume_mounts(Some(&empty)).unwrap().is_none());
        }
        assert!(volume_mounts(None).unwrap().is_none());
        for bad in [
            serde_json::json!({"name": "data"}),
            serde_json::json!(["data"]),
            serde_json::json!([{"name": "data"}]),
            serde_json::json!([{"name": "data", "path": 7}]),
            serde_json::json!([{"name": "data", "path": "/d", "mode": "ro"}]),
        ] {
            assert!(volume_mounts(Some(&bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn list_filters_parse_as_the_sdks_send_them() {
        // The Python SDK quotes each side, then form-encodes the pairs.
        let q = list_query(Some(
            "metadata=team%3Dinfra%26app%3Dmy%2520app&state=running,paused&limit=5",
        ))
        .unwrap();
        assert_eq!(q.metadata.get("team").unwrap(), "infra");
        assert_eq!(q.metadata.get("app").unwrap(), "my app");
        assert_eq!(q.states, ["running", "paused"]);
        assert_eq!(q.limit, Some(5));
        assert!(q.descending, "newest first unless asked");
        let q = list_query(Some(
            "startedAfter=2026-12-03T11:37:04.015000%2B00:00&template=base&order=asc",
        ))
        .unwrap();
        assert_eq!(
            q.started_after.unwrap(),
            instant("2026-12-03T11:37:04.015Z").unwrap()
        );
        assert_eq!(q.template.as_deref(), Some("base"));
        assert!(!q.descending);
        // An offset whose + arrived unencoded (a space once decoded).
        let q = list_query(Some("startedAfter=2026-12-03T12:00:00+01:00")).unwrap();
        assert_eq!(
            q.started_after.unwrap(),
            instant("2026-12-03T11:00:00Z").unwrap()
        );
        assert!(template_matches("base:default", "base"));
        assert!(!template_matches("other", "base"));
        for bad in [
            "limit=0",
            "limit=x",
            "state=dead",
            "nextToken=zz",
            "order=up",
            "what=1",
            "startedAfter=yesterday",
        ] {
            assert!(list_query(Some(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn metrics_windows_are_unix_seconds() {
        let (s, e) = metrics_window(Some("start=100&end=200")).unwrap();
        assert_eq!(s.unwrap().unix_timestamp(), 100);
        assert_eq!(e.unwrap().unix_timestamp(), 200);
        assert_eq!(metrics_window(None).unwrap(), (None, None));
        for bad in ["start=x", "end=1.5", "start=9&end=8", "step=1"] {
            assert!(metrics_window(Some(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn unsupported_create_fields_are_refused() {
        let req: NewSandbox = serde_json::from_str(
            r#"{"templateID":"base","autoPause":false,"metadata":{},"envVars":{}}"#,
        )
        .unwrap();
        assert!(req.other.is_empty());
        let req: NewSandbox =
            serde_json::from_str(r#"{"templateID":"base","surprise":1}"#).unwrap();
        assert!(req.other.contains_key("surprise"));
        assert!(is_null_or_empty(&None));
        assert!(!is_null_or_empty(&Some(
            serde_json::json!({"allowOut": ["x"]})
        )));
    }
}
