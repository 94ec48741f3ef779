//! Route handlers: parse, check, call the [`RunService`], map the answer.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::Body;
use axum::extract::rejection::{JsonRejection, PathRejection};
use axum::extract::{FromRequest, FromRequestParts, Path, RawQuery, State};
use axum::http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::{StreamExt, TryStreamExt};
use runbox_types::{
    pull_sse, CreateRunRequest, ErrorCode, ErrorDetail, ExecRequest, Health, Image, ImageList,
    LeaseReleaseRequest, LeaseRenewRequest, LeaseRequest, LeaseResponse, PullEvent, PullRequest,
    RenewRequest, Run, RunList,
};
use ulid::Ulid;

use runbox_core::runs::Scope;
use runbox_core::RunService;

use crate::auth::Caller;
use crate::{ApiError, AppState};

/// `Json` whose rejections use runbox's error shape, and which takes an
/// integer written with a fraction of zero (`8080.0`) as the integer, as
/// JSON Schema does (Python's `json.dumps(8080.0)` writes it that way).
pub struct AppJson<T>(pub T);

impl<T, S> FromRequest<S> for AppJson<T>
where
    T: serde::de::DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: axum::extract::Request, state: &S) -> Result<Self, ApiError> {
        // axum checks the content type, the size limit and the syntax.
        let Json(raw) = Json::<Box<serde_json::value::RawValue>>::from_request(req, state).await?;
        // Every request body is an object; serde would take a struct from
        // an array too.
        if !raw.get().starts_with('{') {
            return Err(ApiError::new(
                ErrorCode::BadRequest,
                "the body must be a JSON object",
            ));
        }
        let strict = |e: serde_path_to_error::Error<serde_json::Error>| {
            ApiError::new(
                ErrorCode::BadRequest,
                format!("Failed to deserialize the JSON body into the target type: {e}"),
            )
        };
        let first = match serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_str(
            raw.get(),
        )) {
            Ok(value) => return Ok(AppJson(value)),
            Err(e) => e,
        };
        // Only when the body failed as written, and only if spelling a
        // number differently changes it: the strict parse above is the one
        // that refuses duplicate keys.
        let Ok(UniqueKeys(mut value)) = serde_json::from_str(raw.get()) else {
            return Err(strict(first));
        };
        if !integral_numbers(&mut value) {
            return Err(strict(first));
        }
        serde_path_to_error::deserialize(value)
            .map(AppJson)
            .map_err(strict)
    }
}

/// [`AppJson`] for a body that may be left out: a request whose body is
/// known to be empty (`Content-Length: 0`, or none) gets `T`'s default.
pub struct OptionalJson<T>(pub T);

impl<T, S> FromRequest<S> for OptionalJson<T>
where
    T: serde::de::DeserializeOwned + Default,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: axum::extract::Request, state: &S) -> Result<Self, ApiError> {
        use axum::body::HttpBody;
        if req.body().size_hint().exact() == Some(0) {
            return Ok(OptionalJson(T::default()));
        }
        let AppJson(value) = AppJson::from_request(req, state).await?;
        Ok(OptionalJson(value))
    }
}

/// A JSON value whose objects have no key twice: `serde_json::Value` keeps
/// the last of a repeated key, where a struct refuses it.
struct UniqueKeys(serde_json::Value);

impl<'de> serde::Deserialize<'de> for UniqueKeys {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer
            .deserialize_any(UniqueKeysVisitor)
            .map(UniqueKeys)
    }
}

struct UniqueKeysVisitor;

impl<'de> serde::de::Visitor<'de> for UniqueKeysVisitor {
    type Value = serde_json::Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(serde_json::Value::Null)
    }
    fn visit_bool<E>(self, v: bool) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_f64<E>(self, v: f64) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items = Vec::new();
        while let Some(UniqueKeys(item)) = seq.next_element()? {
            items.push(item);
        }
        Ok(serde_json::Value::Array(items))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut fields = serde_json::Map::new();
        while let Some((key, UniqueKeys(value))) = map.next_entry::<String, UniqueKeys>()? {
            if fields.contains_key(&key) {
                return Err(serde::de::Error::custom(format_args!(
                    "duplicate field `{key}`"
                )));
            }
            fields.insert(key, value);
        }
        Ok(serde_json::Value::Object(fields))
    }
}

/// Rewrites every number that is a whole value written as a float (`2.0`,
/// `1e3`) as that integer; answers whether it changed anything. A float
/// beyond what u64 or i64 hold stays a float.
fn integral_numbers(value: &mut serde_json::Value) -> bool {
    match value {
        serde_json::Value::Number(n) if n.is_f64() => {
            let f = n.as_f64().unwrap_or(f64::NAN);
            let whole = if f.fract() != 0.0 {
                None
            } else if (0.0..18_446_744_073_709_551_616.0).contains(&f) {
                Some(serde_json::Number::from(f as u64))
            } else if (-9_223_372_036_854_775_808.0..0.0).contains(&f) {
                Some(serde_json::Number::from(f as i64))
            } else {
                None
            };
            match whole {
                Some(whole) => {
                    *n = whole;
                    true
                }
                None => false,
            }
        }
        serde_json::Value::Array(items) => items
            .iter_mut()
            .fold(false, |changed, item| integral_numbers(item) | changed),
        serde_json::Value::Object(fields) => fields
            .values_mut()
            .fold(false, |changed, field| integral_numbers(field) | changed),
        _ => false,
    }
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> ApiError {
        if rejection.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
            return ApiError::new(
                ErrorCode::TooLarge,
                format!(
                    "the JSON body is larger than {} bytes",
                    crate::MAX_JSON_BYTES
                ),
            );
        }
        let message = match &rejection {
            JsonRejection::MissingJsonContentType(_) => {
                "send the body as JSON with Content-Type: application/json".to_owned()
            }
            other => other.body_text(),
        };
        ApiError::new(ErrorCode::BadRequest, message)
    }
}

/// `Path` whose rejections (a segment that is not UTF-8, say) use runbox's
/// error shape instead of axum's plain-text answer.
#[derive(FromRequestParts)]
#[from_request(via(axum::extract::Path), rejection(ApiError))]
pub struct AppPath<T>(pub T);

impl From<PathRejection> for ApiError {
    fn from(rejection: PathRejection) -> ApiError {
        ApiError::new(ErrorCode::BadRequest, rejection.body_text())
    }
}

/// What a call did, for its audit record (see `audit_calls`).
#[derive(Clone, Debug)]
pub(crate) struct AuditAction(pub runbox_proxy::audit::Action);

/// The answer to a call, marked with what it did (or tried to: a refused
/// call is recorded with its action too).
pub(crate) fn audited<T: IntoResponse>(
    action: runbox_proxy::audit::Action,
    result: Result<T, ApiError>,
) -> Response {
    let mut response = result.into_response();
    response.extensions_mut().insert(AuditAction(action));
    response
}

/// The run a `/v1/runs/{id}...` request names, as [`crate::auth::require`]
/// parsed and admitted it. It is never parsed again here: what a handler
/// acts on is what was authorised.
pub struct RunId(pub Ulid);

impl<S: Send + Sync> FromRequestParts<S> for RunId {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        match parts.extensions.get::<crate::auth::AdmittedRun>() {
            Some(admitted) => Ok(RunId(admitted.0)),
            // A run route the authorisation layer does not guard: a bug,
            // and refused rather than acted on.
            None => Err(ApiError::new(
                ErrorCode::Internal,
                "the run this request names was not authorised",
            )),
        }
    }
}

/// The `{id}` of a checkpoint route; a malformed one is a 404.
pub struct CheckpointId(pub Ulid);

impl<S: Send + Sync> FromRequestParts<S> for CheckpointId {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let Path(raw): Path<String> = Path::from_request_parts(parts, state).await?;
        runbox_types::parse_id(&raw)
            .map(CheckpointId)
            .ok_or_else(|| {
                ApiError::new(
                    ErrorCode::CheckpointNotFound,
                    format!("no checkpoint with id {raw:?} (checkpoint ids are ULIDs)"),
                )
            })
    }
}

/// `GET /health`.
pub async fn health<S: RunService>(State(state): State<AppState<S>>) -> Json<Health> {
    Json(Health {
        status: "ok".to_owned(),
        version: env!("CARGO_PKG_VERSION").to_owned(),
        server: state.service.server_id().to_owned(),
    })
}

/// `POST /v1/runs`.
///
/// An `Idempotency-Key` header makes a retry safe: a repeat of the same
/// create answers with the run the first one made.
pub async fn create_run<S: RunService>(
    State(state): State<AppState<S>>,
    caller: Caller,
    headers: HeaderMap,
    AppJson(req): AppJson<CreateRunRequest>,
) -> Result<Response, ApiError> {
    let key = match headers.get(IDEMPOTENCY_KEY) {
        None => None,
        Some(value) => Some(value.to_str().map(str::to_owned).map_err(|_| {
            ApiError::new(
                ErrorCode::BadRequest,
                "Idempotency-Key must be visible ASCII characters",
            )
        })?),
    };
    let action = runbox_proxy::audit::Action::Create {
        image: match req.checkpoint {
            Some(checkpoint) => format!("checkpoint:{checkpoint}"),
            None => runbox_proxy::audit::bounded(&req.image),
        },
        network: req.network.unwrap_or_default().as_str().to_owned(),
    };
    // On a node of a fleet, a create sent here by a client may be made on
    // another node (placement), and one this node has no room for is sent
    // to a node that has; one another node sent on is made here.
    let placeable = state.service.in_fleet() && !headers.contains_key(crate::forward::NODE_PROOF);
    let owner = caller.owner();
    if placeable {
        // A checkpoint this node's store does not hold is made on the node
        // whose store does (asked with the caller's own credentials).
        if let Some(checkpoint) = req.checkpoint {
            if let Err(e) = state.service.get_checkpoint(checkpoint).await {
                let probe = format!("/v1/checkpoints/{checkpoint}");
                match crate::forward::holder(&state.service, &probe, &headers).await {
                    Some(at) => {
                        return Ok(audited(
                            action,
                            Ok(create_on(&state, &at, &headers, &req).await),
                        ))
                    }
                    None => {
                        tracing::debug!(error = %e, %checkpoint, "no node holds the checkpoint")
                    }
                }
            }
        }
        match state.service.place(&req, &owner, false).await {
            Ok(Some(at)) => {
                return Ok(audited(
                    action,
                    Ok(create_on(&state, &at, &headers, &req).await),
                ))
            }
            Ok(None) => {}
            // Placement is a preference: without the database the create
            // is made here (and the ledger says whether it may be).
            Err(e) if e.code() == ErrorCode::ClusterUnavailable => {
                tracing::debug!(error = %e, "no placement; the create is made here")
            }
            // The volumes it mounts are on a node that cannot take it.
            Err(e) => return Ok(audited(action, Err::<(), _>(e.into()))),
        }
    }
    let again = placeable.then(|| req.clone());
    let run = match state.service.create(req, key, owner.clone()).await {
        Ok(run) => run,
        Err(runbox_core::CoreError::Capacity(max)) if again.is_some() => {
            let req = again.unwrap_or_default();
            return Ok(audited(
                action,
                match state.service.place(&req, &owner, true).await {
                    Ok(Some(at)) => Ok(create_on(&state, &at, &headers, &req).await),
                    _ => Err(ApiError::from(runbox_core::CoreError::Capacity(max))),
                },
            ));
        }
        Err(e) => return Ok(audited(action, Err::<(), _>(e.into()))),
    };
    // The record names the run made, and its tenant.
    let admitted = crate::auth::AdmittedRun(run.id);
    let tenant = crate::auth::AuditTenant(run.tenant.clone());
    let mut response = audited(
        action,
        Ok::<_, ApiError>((StatusCode::CREATED, Json(with_token(&state, run)))),
    );
    response.extensions_mut().insert(admitted);
    response.extensions_mut().insert(tenant);
    Ok(response)
}

/// Sends create `req` (with the caller's credentials and idempotency key
/// from `headers`) to the node at `at`, which makes it there.
async fn create_on<S: RunService>(
    state: &AppState<S>,
    at: &runbox_core::fleet::Located,
    headers: &HeaderMap,
    req: &CreateRunRequest,
) -> Response {
    match serde_json::to_vec(req) {
        Ok(body) => create_elsewhere(state, at, headers, "/v1/runs", body).await,
        Err(e) => ApiError::new(ErrorCode::Internal, e.to_string()).into_response(),
    }
}

/// Sends a create (JSON `body` to `path`, with the caller's credentials
/// and idempotency key from `headers`) to the node at `at`, with this
/// node's proof, and answers with what that node answers.
pub(crate) async fn create_elsewhere<S: RunService>(
    state: &AppState<S>,
    at: &runbox_core::fleet::Located,
    headers: &HeaderMap,
    path: &str,
    body: Vec<u8>,
) -> Response {
    let Some(proof) = state.service.prove(&format!("POST {path}")) else {
        return ApiError::new(ErrorCode::Internal, "a fleet without proofs").into_response();
    };
    let mut request = axum::http::Request::post(path);
    let carried = [
        axum::http::header::AUTHORIZATION,
        axum::http::HeaderName::from_static("x-api-key"),
        axum::http::HeaderName::from_static(IDEMPOTENCY_KEY),
    ];
    for name in carried {
        if let Some(value) = headers.get(&name) {
            request = request.header(name, value);
        }
    }
    match request
        .header(axum::http::header::CONTENT_TYPE, "application/json")
        .body(Body::from(body))
    {
        Ok(request) => {
            crate::forward::send_on("the create was placed on", at, proof, request).await
        }
        Err(e) => ApiError::new(ErrorCode::Internal, e.to_string()).into_response(),
    }
}

/// `run` with its run token, for the caller that made or owns it.
pub(crate) fn with_token<S: RunService>(state: &AppState<S>, mut run: Run) -> Run {
    run.token = Some(crate::auth::run_token(&state.token, run.id));
    run
}

/// The header that makes a create safe to retry.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// The most `label` terms one list takes.
const MAX_SELECTOR_TERMS: usize = 64;

/// A list's label selector: `?label=key=value` (the label has that value)
/// and `?label=key` (the label is set, to anything), every term required.
/// Anything else in the query is refused, not ignored.
#[derive(Debug, Default)]
pub(crate) struct LabelSelector(Vec<(String, Option<String>)>);

impl LabelSelector {
    /// Parses a list route's query string.
    pub(crate) fn parse(query: Option<&str>) -> Result<LabelSelector, ApiError> {
        let mut terms = Vec::new();
        for (key, value) in form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
            if key != "label" {
                return Err(ApiError::new(
                    ErrorCode::BadRequest,
                    format!(
                        "this list takes only label=KEY or label=KEY=VALUE in its query, not {:?}",
                        key.chars().take(64).collect::<String>()
                    ),
                ));
            }
            let (key, value) = match value.split_once('=') {
                Some((k, v)) => (k.to_owned(), Some(v.to_owned())),
                None => (value.into_owned(), None),
            };
            // The grammar of the labels themselves.
            let probe = [(key.clone(), value.clone().unwrap_or_default())].into();
            runbox_core::validate::labels(&probe)?;
            terms.push((key, value));
        }
        if terms.len() > MAX_SELECTOR_TERMS {
            return Err(ApiError::new(
                ErrorCode::BadLabels,
                format!("at most {MAX_SELECTOR_TERMS} label terms in one selector"),
            ));
        }
        Ok(LabelSelector(terms))
    }

    /// Whether `labels` satisfy every term.
    pub(crate) fn matches(&self, labels: &std::collections::BTreeMap<String, String>) -> bool {
        self.0.iter().all(|(key, value)| match value {
            Some(value) => labels.get(key) == Some(value),
            None => labels.contains_key(key),
        })
    }
}

/// `GET /v1/runs[?label=...]`.
pub async fn list_runs<S: RunService>(
    State(state): State<AppState<S>>,
    caller: Caller,
    RawQuery(query): RawQuery,
) -> Result<Json<RunList>, ApiError> {
    let selector = LabelSelector::parse(query.as_deref())?;
    let mut runs = state.service.list_fleet().await?;
    runs.retain(|r| caller.sees(r.tenant.as_deref()) && selector.matches(&r.labels));
    Ok(Json(RunList {
        server: state.service.server_id().to_owned(),
        runs,
    }))
}

/// `GET /v1/runs/{id}`.
pub async fn get_run<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
) -> Result<Response, ApiError> {
    Ok(Json(with_token(&state, state.service.get(id)?)).into_response())
}

/// `DELETE /v1/runs/{id}`.
pub async fn delete_run<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
) -> Result<StatusCode, ApiError> {
    state.service.delete(id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /v1/runs/{id}/renew`.
pub async fn renew_run<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
    AppJson(req): AppJson<RenewRequest>,
) -> Result<Response, ApiError> {
    Ok(Json(state.service.renew(id, req.ttl_sec).await?).into_response())
}

/// `PATCH /v1/runs/{id}/egress`: replaces the run's egress policy while
/// it lives.
pub async fn update_run_egress<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
    AppJson(req): AppJson<runbox_types::UpdateEgressRequest>,
) -> Response {
    let action = runbox_proxy::audit::Action::Egress {
        network: req.network.map(|n| n.as_str().to_owned()),
        entries: req.egress_allow.as_ref().map(Vec::len),
        secrets: req.secrets.as_ref().map(|s| {
            s.iter()
                .map(|s| runbox_proxy::audit::bounded(s.name()))
                .collect()
        }),
    };
    audited(
        action,
        state
            .service
            .update_egress(id, req)
            .await
            .map(Json)
            .map_err(ApiError::from),
    )
}

/// `POST /v1/runs/{id}/pause`: freezes the run's processes, memory kept.
pub async fn pause_run<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
) -> Result<Response, ApiError> {
    Ok(Json(state.service.pause(id).await?).into_response())
}

/// `POST /v1/runs/{id}/resume`: lets a paused run's processes go on.
pub async fn resume_run<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
) -> Result<Response, ApiError> {
    Ok(Json(state.service.resume(id).await?).into_response())
}

/// `POST /v1/runs/{id}/hibernate`: stops the run down to its disk.
pub async fn hibernate_run<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
) -> Result<Response, ApiError> {
    Ok(Json(state.service.hibernate(id).await?).into_response())
}

/// `POST /v1/runs/{id}/archive`: sends the run's disk to the checkpoint
/// store and drops it here.
pub async fn archive_run<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
) -> Result<Response, ApiError> {
    Ok(Json(state.service.archive(id).await?).into_response())
}

/// `POST /v1/runs/{id}/move`: moves the run to another node of the fleet
/// (archived here, handed over, restored there when it was awake);
/// answers as the new node answers for the run.
pub async fn move_run<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
    headers: axum::http::HeaderMap,
    OptionalJson(req): OptionalJson<runbox_types::RunMoveRequest>,
) -> Result<Response, ApiError> {
    let (target, awake) = state.service.move_run(id, req.node).await?;
    arrive(
        &state,
        id,
        &target,
        awake,
        headers.get(axum::http::header::AUTHORIZATION),
    )
    .await
}

/// Tells node `target` that run `id` moved there (with the caller's
/// `authorization`): it makes the run from the catalog when it is first
/// asked for it, so a wake when the run was `awake`, else a read; that
/// node's answer.
async fn arrive<S: RunService>(
    state: &AppState<S>,
    id: ulid::Ulid,
    target: &runbox_core::fleet::Located,
    awake: bool,
    authorization: Option<&axum::http::HeaderValue>,
) -> Result<Response, ApiError> {
    let (method, path) = match awake {
        true => (axum::http::Method::POST, format!("/v1/runs/{id}/wake")),
        false => (axum::http::Method::GET, format!("/v1/runs/{id}")),
    };
    let mut request = axum::extract::Request::new(axum::body::Body::empty());
    *request.method_mut() = method;
    *request.uri_mut() = path
        .parse()
        .map_err(|_| ApiError::new(ErrorCode::Internal, "a run path that is no URI"))?;
    if let Some(token) = authorization {
        request
            .headers_mut()
            .insert(axum::http::header::AUTHORIZATION, token.clone());
    }
    let proof = state
        .service
        .prove(&crate::forward::proof_subject(&request))
        .ok_or_else(|| ApiError::new(ErrorCode::Internal, "a fleet without proofs"))?;
    Ok(crate::forward::send_on(&format!("run {id} moved to"), target, proof, request).await)
}

/// A call for run `id`, lost with its node (`route` and `method` say
/// which): a read answers with the run as the catalog has it, a delete
/// ends it, anything else is `409 run_lost` with the reason.
pub(crate) async fn lost_run<S: RunService>(
    state: &AppState<S>,
    id: ulid::Ulid,
    method: &axum::http::Method,
    route: &str,
) -> Response {
    let answer = async {
        match (method.as_str(), route) {
            ("GET", "/v1/runs/{id}") => {
                Ok(Json(state.service.catalog_run(id).await?).into_response())
            }
            ("DELETE", "/v1/runs/{id}") => {
                state.service.end_lost(id).await?;
                Ok(StatusCode::NO_CONTENT.into_response())
            }
            _ => {
                let run = state.service.catalog_run(id).await?;
                Err(ApiError::new(
                    ErrorCode::RunLost,
                    run.failure
                        .unwrap_or_else(|| format!("run {id} was lost with its node; delete it")),
                ))
            }
        }
    }
    .await;
    answer.unwrap_or_else(|e: ApiError| e.into_response())
}

/// How many runs a drain moves at once.
const MIGRATE_AT_ONCE: usize = 4;

/// Moves every run this node holds away, [`MIGRATE_AT_ONCE`] at a time,
/// each to the best node that can take it: what became of each.
async fn migrate<S: RunService>(
    state: &AppState<S>,
    authorization: Option<&axum::http::HeaderValue>,
) -> runbox_types::DrainMigration {
    use futures::StreamExt;
    let outcomes: Vec<(ulid::Ulid, Result<String, runbox_types::ErrorDetail>)> =
        futures::stream::iter(state.service.held_runs())
            .map(|id| async move {
                let moved = async {
                    let (target, awake) = state.service.move_run(id, None).await?;
                    let answer = arrive(state, id, &target, awake, authorization).await?;
                    if !answer.status().is_success() {
                        let body = axum::body::to_bytes(answer.into_body(), 64 << 10)
                            .await
                            .unwrap_or_default();
                        let detail = serde_json::from_slice::<runbox_types::ErrorBody>(&body)
                            .map(|b| b.error)
                            .unwrap_or_else(|_| runbox_types::ErrorDetail {
                                code: ErrorCode::Internal.as_str().to_owned(),
                                message: format!("node {} did not take the run", target.node),
                            });
                        return Ok(Err(detail));
                    }
                    Ok::<_, ApiError>(Ok(target.node))
                }
                .await;
                let outcome = match moved {
                    Ok(outcome) => outcome,
                    Err(e) => Err(e.detail()),
                };
                (id, outcome)
            })
            .buffer_unordered(MIGRATE_AT_ONCE)
            .collect()
            .await;
    let mut report = runbox_types::DrainMigration::default();
    for (id, outcome) in outcomes {
        match outcome {
            Ok(node) => report.moved.push(runbox_types::MovedRun { id, node }),
            Err(error) => report.failed.push(runbox_types::UnmovedRun { id, error }),
        }
    }
    report.moved.sort_by_key(|m| m.id);
    report.failed.sort_by_key(|m| m.id);
    report
}

/// `POST /v1/runs/{id}/wake`: boots a hibernated or failed run again.
pub async fn wake_run<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
) -> Result<Response, ApiError> {
    Ok(Json(state.service.wake(id).await?).into_response())
}

/// `POST /v1/runs/{id}/snapshot`: records the run's filesystem as an image.
pub async fn snapshot_run<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
    AppJson(req): AppJson<runbox_types::SnapshotRequest>,
) -> Result<Response, ApiError> {
    let snapshot = state.service.snapshot(id, req).await?;
    Ok((StatusCode::CREATED, Json(snapshot)).into_response())
}

/// `POST /v1/runs/{id}/checkpoint`: sends the run's disk and settings to
/// the checkpoint store.
pub async fn checkpoint_run<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
    OptionalJson(req): OptionalJson<runbox_types::CheckpointRequest>,
) -> Result<Response, ApiError> {
    let checkpoint = state.service.checkpoint(id, req).await?;
    Ok((StatusCode::CREATED, Json(checkpoint)).into_response())
}

/// `GET /v1/checkpoints[?label=...]`.
pub async fn list_checkpoints<S: RunService>(
    State(state): State<AppState<S>>,
    caller: Caller,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Result<Json<runbox_types::CheckpointList>, ApiError> {
    let selector = LabelSelector::parse(query.as_deref())?;
    let mut checkpoints = state.service.list_checkpoints().await?;
    // Each node's store holds what its runs checkpointed: on a node of a
    // fleet the list is every store's, read from the other nodes with the
    // fleet's root token and filtered here. Nodes that share a bucket list
    // the same checkpoints, each shown once.
    if state.service.in_fleet() && !headers.contains_key(crate::forward::NODE_PROOF) {
        let others: Vec<runbox_types::CheckpointList> =
            crate::forward::read_others(&state.service, &state.token, "/v1/checkpoints").await;
        checkpoints.extend(others.into_iter().flat_map(|l| l.checkpoints));
        checkpoints.sort_by_key(|c| (c.created_at, c.id));
        checkpoints.dedup_by_key(|c| c.id);
    }
    checkpoints.retain(|c| caller.sees(c.tenant.as_deref()) && selector.matches(&c.labels));
    Ok(Json(runbox_types::CheckpointList { checkpoints }))
}

/// Checkpoint `id` if `caller` may see it; another tenant's is as absent
/// as one that never was.
async fn own_checkpoint<S: RunService>(
    state: &AppState<S>,
    caller: &Caller,
    id: ulid::Ulid,
) -> Result<runbox_types::Checkpoint, ApiError> {
    let checkpoint = state.service.get_checkpoint(id).await?;
    if !caller.sees(checkpoint.tenant.as_deref()) {
        return Err(ApiError::new(
            ErrorCode::CheckpointNotFound,
            format!("no checkpoint {id}"),
        ));
    }
    Ok(checkpoint)
}

/// `GET /v1/checkpoints/{id}`.
pub async fn get_checkpoint<S: RunService>(
    State(state): State<AppState<S>>,
    caller: Caller,
    CheckpointId(id): CheckpointId,
    request: ElsewhereRequest,
) -> Result<Response, ApiError> {
    match own_checkpoint(&state, &caller, id).await {
        Ok(checkpoint) => Ok(Json(checkpoint).into_response()),
        Err(e) => request.or_elsewhere(&state, e).await,
    }
}

/// `DELETE /v1/checkpoints/{id}`.
pub async fn delete_checkpoint<S: RunService>(
    State(state): State<AppState<S>>,
    caller: Caller,
    CheckpointId(id): CheckpointId,
    request: ElsewhereRequest,
) -> Result<Response, ApiError> {
    if let Err(e) = own_checkpoint(&state, &caller, id).await {
        return request.or_elsewhere(&state, e).await;
    }
    state.service.delete_checkpoint(id).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// A bodiless request for an object of one node's (a checkpoint in its
/// store, a snapshot image), kept so that on a node of a fleet it can be
/// sent to the node that holds the object when this one answers 404.
pub struct ElsewhereRequest {
    method: axum::http::Method,
    uri: axum::http::Uri,
    headers: HeaderMap,
}

impl<S: Send + Sync> FromRequestParts<S> for ElsewhereRequest {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(ElsewhereRequest {
            method: parts.method.clone(),
            uri: parts.uri.clone(),
            headers: parts.headers.clone(),
        })
    }
}

impl ElsewhereRequest {
    /// `missing` (this node's "no such object") as it is, or, on a node of
    /// a fleet, the answer of the first other node that has the object
    /// (its node checks the caller again).
    pub(crate) async fn or_elsewhere<S: RunService>(
        self,
        state: &AppState<S>,
        missing: ApiError,
    ) -> Result<Response, ApiError> {
        if missing.code().status() != 404 {
            return Err(missing);
        }
        self.ask(state).await.ok_or(missing)
    }

    /// The answer of the first other node of the fleet that has the
    /// object (None alone, or when none has it).
    pub(crate) async fn ask<S: RunService>(self, state: &AppState<S>) -> Option<Response> {
        crate::forward::ask_others(&state.service, &self.method, &self.uri, &self.headers).await
    }
}

/// `POST /v1/runs/{id}/fork`: new runs starting from the run's filesystem.
pub async fn fork_run<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
    AppJson(req): AppJson<runbox_types::ForkRequest>,
) -> Result<Response, ApiError> {
    let mut forked = state.service.fork(id, req).await?;
    forked.runs = forked
        .runs
        .into_iter()
        .map(|run| with_token(&state, run))
        .collect();
    Ok((StatusCode::CREATED, Json(forked)).into_response())
}

/// `POST /v1/runs/{id}/warm-commit`: publishes the run's warm volume as its
/// repository's template, in the run's tenant's set.
pub async fn warm_commit<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
    AppJson(req): AppJson<runbox_types::WarmCommitRequest>,
) -> Result<Response, ApiError> {
    let committed = state.service.warm_commit(id, req).await?;
    Ok((StatusCode::CREATED, Json(committed)).into_response())
}

/// `GET /v1/runs/{id}/warm`: the warm volume's lockfile hash now.
pub async fn warm_status<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
) -> Result<Json<runbox_types::WarmStatus>, ApiError> {
    Ok(Json(state.service.warm_status(id).await?))
}

/// `GET /v1/warmcache`: the caller's templates (root: every one).
pub async fn warm_templates<S: RunService>(
    State(state): State<AppState<S>>,
    caller: Caller,
) -> Result<Json<runbox_types::WarmTemplateList>, ApiError> {
    Ok(Json(state.service.warm_templates(&caller.owner())?))
}

/// `GET /v1/warmcache/{owner}/{name}`: the caller's template of the
/// repository (root: the operator's).
pub async fn warm_template<S: RunService>(
    State(state): State<AppState<S>>,
    caller: Caller,
    AppPath((owner, name)): AppPath<(String, String)>,
) -> Result<Json<runbox_types::WarmTemplate>, ApiError> {
    Ok(Json(state.service.warm_template(
        &format!("{owner}/{name}"),
        &caller.owner(),
    )?))
}

/// `DELETE /v1/warmcache/{owner}/{name}`: drops the caller's template.
pub async fn warm_invalidate<S: RunService>(
    State(state): State<AppState<S>>,
    caller: Caller,
    AppPath((owner, name)): AppPath<(String, String)>,
) -> Result<StatusCode, ApiError> {
    state
        .service
        .warm_invalidate(format!("{owner}/{name}"), caller.owner())
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /v1/volumes`: a named volume of the caller's.
pub async fn create_volume<S: RunService>(
    State(state): State<AppState<S>>,
    caller: Caller,
    AppJson(req): AppJson<runbox_types::CreateVolumeRequest>,
) -> Result<Response, ApiError> {
    let volume = state.service.create_volume(req, caller.owner()).await?;
    Ok((StatusCode::CREATED, Json(volume)).into_response())
}

/// `POST /v1/volumes/{name}/clone`: a new volume of the caller's holding
/// what the volume holds now.
pub async fn clone_volume<S: RunService>(
    State(state): State<AppState<S>>,
    caller: Caller,
    AppPath(name): AppPath<String>,
    AppJson(req): AppJson<runbox_types::CloneVolumeRequest>,
) -> Result<Response, ApiError> {
    let volume = state
        .service
        .clone_volume(name, req, caller.owner())
        .await?;
    Ok((StatusCode::CREATED, Json(volume)).into_response())
}

/// The header in which a node that moves a volume tells the node it goes
/// to which move it is (`<volume>/<move>`), with its node proof.
pub(crate) const VOLUME_ARRIVAL: &str = "runbox-volume-arrival";

/// `POST /v1/volumes/{name}/move`: moves the caller's volume, unmounted,
/// to another node of the fleet through the checkpoint bucket (see
/// `runbox_core::runs::Manager::leave_volume`); the volume as its new node
/// answers. From another node, with [`VOLUME_ARRIVAL`]: that node's move
/// of the volume to this one. Each runs to its end however the caller
/// goes, so a disconnect leaves the volume on one node.
pub async fn move_volume<S: RunService>(
    State(state): State<AppState<S>>,
    caller: Caller,
    AppPath(name): AppPath<String>,
    headers: HeaderMap,
    OptionalJson(req): OptionalJson<runbox_types::VolumeNodeMoveRequest>,
) -> Result<Response, ApiError> {
    let owner = caller.owner().clone();
    if let Some(key) = headers.get(VOLUME_ARRIVAL) {
        if !headers.contains_key(crate::forward::NODE_PROOF) {
            return Err(ApiError::new(
                ErrorCode::BadRequest,
                format!("{VOLUME_ARRIVAL} is for the nodes of a fleet; leave it out"),
            ));
        }
        let key = key
            .to_str()
            .map_err(|_| ApiError::new(ErrorCode::BadRequest, "a volume move that is no text"))?
            .to_owned();
        let service = state.service.clone();
        let arrived = tokio::spawn(async move { service.arrive_volume(&key, &owner).await })
            .await
            .map_err(|e| {
                ApiError::new(ErrorCode::Internal, format!("volume arrival task: {e}"))
            })??;
        return Ok(Json(arrived).into_response());
    }
    let credentials: Vec<(HeaderName, HeaderValue)> = ["authorization", "x-api-key"]
        .into_iter()
        .filter_map(|h| {
            headers
                .get(h)
                .map(|v| (HeaderName::from_static(h), v.clone()))
        })
        .collect();
    let task = tokio::spawn(async move {
        let departure = state.service.leave_volume(&name, &owner, req.node).await?;
        // A target that hangs is given up on (the compare-and-set turns
        // away an arrival after that): two minutes, and a second for every
        // 5 MiB of the volume's files.
        let deadline = Duration::from_secs(120 + departure.bytes / (5 << 20));
        let told = async {
            let response = tell_volume(&state, &name, &departure, &credentials)
                .await
                .unwrap_or_else(IntoResponse::into_response);
            let status = response.status();
            let body = axum::body::to_bytes(response.into_body(), 1 << 20)
                .await
                .unwrap_or_default();
            (status, body)
        };
        let (status, body) = tokio::time::timeout(deadline, told)
            .await
            .unwrap_or((StatusCode::GATEWAY_TIMEOUT, Default::default()));
        let end = state.service.finish_volume_move(&departure).await?;
        match end {
            runbox_core::fleet::VolumeMove::Arrived => {
                let volume = serde_json::from_slice::<runbox_types::Volume>(&body)
                    .ok()
                    .filter(|_| status.is_success())
                    .unwrap_or(runbox_types::Volume {
                        server: departure.target.node.clone(),
                        holders: Vec::new(),
                        ..departure.view
                    });
                Ok(Json(volume).into_response())
            }
            _ => {
                let why = serde_json::from_slice::<runbox_types::ErrorBody>(&body)
                    .map(|b| b.error.message)
                    .unwrap_or_else(|_| format!("it answered {status}"));
                Err(ApiError::new(
                    ErrorCode::NotMovable,
                    format!(
                        "volume {name:?} stays on node {}: node {} did not take it: {why}",
                        state.service.server_id(),
                        departure.target.node
                    ),
                ))
            }
        }
    });
    task.await
        .map_err(|e| ApiError::new(ErrorCode::Internal, format!("volume move task: {e}")))?
}

/// Tells the node `departure` goes to of the move, with the caller's
/// `credentials`: its answer.
async fn tell_volume<S: RunService>(
    state: &AppState<S>,
    name: &str,
    departure: &runbox_core::runs::VolumeDeparture,
    credentials: &[(HeaderName, HeaderValue)],
) -> Result<Response, ApiError> {
    let path = format!(
        "/v1/volumes/{}/move",
        form_urlencoded::byte_serialize(name.as_bytes()).collect::<String>()
    );
    let mut request = axum::extract::Request::new(axum::body::Body::empty());
    *request.method_mut() = axum::http::Method::POST;
    *request.uri_mut() = path
        .parse()
        .map_err(|_| ApiError::new(ErrorCode::Internal, "a volume path that is no URI"))?;
    for (name, value) in credentials {
        request.headers_mut().insert(name.clone(), value.clone());
    }
    let key = HeaderValue::from_str(&departure.key)
        .map_err(|_| ApiError::new(ErrorCode::Internal, "a volume move key that is no header"))?;
    request.headers_mut().insert(VOLUME_ARRIVAL, key);
    let proof = state
        .service
        .prove(&crate::forward::proof_subject(&request))
        .ok_or_else(|| ApiError::new(ErrorCode::Internal, "a fleet without proofs"))?;
    Ok(crate::forward::send_on(
        &format!("volume {name:?} moves to"),
        &departure.target,
        proof,
        request,
    )
    .await)
}

/// `GET /v1/volumes[?label=...]`: the caller's volumes (root: every one).
pub async fn list_volumes<S: RunService>(
    State(state): State<AppState<S>>,
    caller: Caller,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Result<Json<runbox_types::VolumeList>, ApiError> {
    let selector = LabelSelector::parse(query.as_deref())?;
    let mut list = state.service.list_volumes(&caller.owner());
    // A volume is one node's (its `server`): on a node of a fleet the list
    // is the fleet's, the other nodes' read with the fleet's root token and
    // filtered here as this node's are.
    let others = crate::forward::volumes_elsewhere(&state.service, &state.token, &headers).await;
    if !others.is_empty() {
        let owner = caller.owner();
        list.volumes.extend(
            others
                .into_iter()
                .filter(|v| owner.tenant().is_none() || v.tenant.as_deref() == owner.tenant()),
        );
        list.volumes
            .sort_by(|a, b| (&a.name, &a.server).cmp(&(&b.name, &b.server)));
    }
    list.volumes.retain(|v| selector.matches(&v.labels));
    Ok(Json(list))
}

/// `GET /v1/volumes/{name}`.
pub async fn get_volume<S: RunService>(
    State(state): State<AppState<S>>,
    caller: Caller,
    AppPath(name): AppPath<String>,
) -> Result<Json<runbox_types::Volume>, ApiError> {
    Ok(Json(state.service.get_volume(&name, &caller.owner())?))
}

/// `DELETE /v1/volumes/{name}`.
pub async fn delete_volume<S: RunService>(
    State(state): State<AppState<S>>,
    caller: Caller,
    AppPath(name): AppPath<String>,
) -> Result<StatusCode, ApiError> {
    state.service.delete_volume(name, caller.owner()).await?;
    Ok(StatusCode::NO_CONTENT)
}

use runbox_core::runs::VolumeKey;

/// An owner as a volume call names it: `uid` and `gid` both (0-65535) or
/// neither.
fn volume_owner(uid: Option<u32>, gid: Option<u32>) -> Result<Option<(u32, u32)>, ApiError> {
    match (uid, gid) {
        (None, None) => Ok(None),
        (Some(u), Some(g))
            if u <= runbox_types::MAX_VOLUME_ID && g <= runbox_types::MAX_VOLUME_ID =>
        {
            Ok(Some((u, g)))
        }
        (Some(_), Some(_)) => Err(ApiError::new(
            ErrorCode::BadRequest,
            format!(
                "uid and gid are ids as runs see them, 0-{}",
                runbox_types::MAX_VOLUME_ID
            ),
        )),
        _ => Err(ApiError::new(
            ErrorCode::BadRequest,
            "give uid and gid together, or neither",
        )),
    }
}

/// `PUT /v1/volumes/{name}/files/{*path}`: streams the body into the
/// volume (a writer: refused while a run mounts it).
pub async fn put_volume_file<S: RunService>(
    State(state): State<AppState<S>>,
    caller: Caller,
    AppPath(params): AppPath<Vec<(String, String)>>,
    query: Result<
        axum::extract::Query<runbox_types::VolumeWriteQuery>,
        axum::extract::rejection::QueryRejection,
    >,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let action = runbox_proxy::audit::Action::Write {
        path: runbox_proxy::audit::bounded(&format!(
            "volume:{}:/{}",
            volume_name(&params),
            file_path(&params).trim_start_matches('/')
        )),
    };
    let result: Result<Json<runbox_types::FileInfo>, ApiError> = async {
        let query = query.map(|q| q.0).map_err(|e| {
            ApiError::new(
                ErrorCode::BadRequest,
                format!("this route's query takes mode, uid, gid and overwrite ({e})"),
            )
        })?;
        let options = runbox_core::runs::VolumeWrite {
            mode: query.mode,
            owner: volume_owner(query.uid, query.gid)?,
            replace: query.overwrite.unwrap_or(true),
            content_length: content_length(&headers)?,
        };
        let name = volume_name(&params).to_owned();
        let files = named_volume(&state, &caller, name, true).await?;
        let body = body.into_data_stream();
        Ok(Json(files.write(file_path(&params), options, body).await?))
    }
    .await;
    audited(action, result)
}

/// `GET /v1/volumes/{name}/files/{*path}`: streams a volume's file back.
pub async fn get_volume_file<S: RunService>(
    State(state): State<AppState<S>>,
    caller: Caller,
    AppPath(params): AppPath<Vec<(String, String)>>,
) -> Result<Response, ApiError> {
    let name = volume_name(&params).to_owned();
    let files = named_volume(&state, &caller, name.clone(), false).await?;
    let download = files.read(file_path(&params)).await?;
    Ok(download_response(download, move |e| {
        tracing::warn!(volume = %name, error = %e, "volume file download broke off");
    }))
}

/// The caller's volume `name`, for file calls (`write`: as a writer).
async fn named_volume<S: RunService>(
    state: &AppState<S>,
    caller: &Caller,
    name: String,
    write: bool,
) -> Result<runbox_core::runs::VolumeFiles, ApiError> {
    let key = VolumeKey::Name(name);
    Ok(state
        .service
        .volume_files(key, caller.owner(), write)
        .await?)
}

/// The volume name from `/v1/volumes/{name}/...`.
fn volume_name(params: &[(String, String)]) -> &str {
    params
        .iter()
        .find(|(k, _)| k == "name")
        .map(|(_, v)| v.as_str())
        .unwrap_or("")
}

/// `GET /v1/volumes/{name}/fs/stat?path=P`.
pub async fn volume_stat<S: RunService>(
    State(state): State<AppState<S>>,
    caller: Caller,
    AppPath(name): AppPath<String>,
    query: Result<
        axum::extract::Query<runbox_types::FsQuery>,
        axum::extract::rejection::QueryRejection,
    >,
) -> Result<Json<runbox_types::FileInfo>, ApiError> {
    let query = fs_query(query, &[])?;
    let files = named_volume(&state, &caller, name, false).await?;
    Ok(Json(files.stat(query.path.as_deref().unwrap_or("")).await?))
}

/// `GET /v1/volumes/{name}/fs/list?path=P&depth=N&limit=N`.
pub async fn volume_list<S: RunService>(
    State(state): State<AppState<S>>,
    caller: Caller,
    AppPath(name): AppPath<String>,
    query: Result<
        axum::extract::Query<runbox_types::FsQuery>,
        axum::extract::rejection::QueryRejection,
    >,
) -> Result<Json<runbox_types::FileList>, ApiError> {
    let query = fs_query(query, &["depth", "limit"])?;
    let files = named_volume(&state, &caller, name, false).await?;
    let path = query.path.as_deref().unwrap_or("");
    Ok(Json(files.list(path, query.depth, query.limit).await?))
}

/// `POST /v1/volumes/{name}/fs/mkdir`.
pub async fn volume_mkdir<S: RunService>(
    State(state): State<AppState<S>>,
    caller: Caller,
    AppPath(name): AppPath<String>,
    AppJson(req): AppJson<runbox_types::VolumeMakeDirRequest>,
) -> Response {
    let action = runbox_proxy::audit::Action::MakeDir {
        path: runbox_proxy::audit::bounded(&format!("volume:{name}:{}", req.path)),
    };
    let result: Result<Json<runbox_types::FileInfo>, ApiError> = async {
        let owner = volume_owner(req.uid, req.gid)?;
        let files = named_volume(&state, &caller, name, true).await?;
        Ok(Json(files.make_dir(&req.path, req.mode, owner).await?))
    }
    .await;
    audited(action, result)
}

/// `POST /v1/volumes/{name}/fs/move`.
pub async fn volume_move<S: RunService>(
    State(state): State<AppState<S>>,
    caller: Caller,
    AppPath(name): AppPath<String>,
    AppJson(req): AppJson<runbox_types::VolumeMoveRequest>,
) -> Response {
    let action = runbox_proxy::audit::Action::Move {
        from: runbox_proxy::audit::bounded(&format!("volume:{name}:{}", req.from)),
        to: runbox_proxy::audit::bounded(&format!("volume:{name}:{}", req.to)),
    };
    let result: Result<Json<runbox_types::FileInfo>, ApiError> = async {
        let files = named_volume(&state, &caller, name, true).await?;
        let overwrite = req.overwrite.unwrap_or(false);
        Ok(Json(files.move_path(&req.from, &req.to, overwrite).await?))
    }
    .await;
    audited(action, result)
}

/// `POST /v1/volumes/{name}/fs/remove`.
pub async fn volume_remove<S: RunService>(
    State(state): State<AppState<S>>,
    caller: Caller,
    AppPath(name): AppPath<String>,
    AppJson(req): AppJson<runbox_types::VolumeRemoveRequest>,
) -> Response {
    let action = runbox_proxy::audit::Action::Remove {
        path: runbox_proxy::audit::bounded(&format!("volume:{name}:{}", req.path)),
        recursive: req.recursive.unwrap_or(false),
    };
    let result: Result<Json<runbox_types::RemoveReply>, ApiError> = async {
        let files = named_volume(&state, &caller, name, true).await?;
        let recursive = req.recursive.unwrap_or(false);
        Ok(Json(files.remove(&req.path, recursive).await?))
    }
    .await;
    audited(action, result)
}

/// The query of an fs route: `path` on every one, `depth` and `limit` on
/// list, `recursive` on watch (`takes` names what this route takes besides
/// `path`); anything else is a 400 rather than ignored.
fn fs_query(
    query: Result<
        axum::extract::Query<runbox_types::FsQuery>,
        axum::extract::rejection::QueryRejection,
    >,
    takes: &[&str],
) -> Result<runbox_types::FsQuery, ApiError> {
    let taken = || {
        std::iter::once("path")
            .chain(takes.iter().copied())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let query = query.map(|q| q.0).map_err(|e| {
        ApiError::new(
            ErrorCode::BadRequest,
            format!("this route's query takes {} ({e})", taken()),
        )
    })?;
    let given = [
        ("depth", query.depth.is_some()),
        ("limit", query.limit.is_some()),
        ("recursive", query.recursive.is_some()),
    ];
    if let Some((name, _)) = given
        .iter()
        .find(|(name, set)| *set && !takes.contains(name))
    {
        return Err(ApiError::new(
            ErrorCode::BadRequest,
            format!(
                "{name} does not apply here: this route's query takes {}",
                taken()
            ),
        ));
    }
    Ok(query)
}

/// `GET /v1/runs/{id}/fs/stat?path=P`.
pub async fn fs_stat<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
    query: Result<
        axum::extract::Query<runbox_types::FsQuery>,
        axum::extract::rejection::QueryRejection,
    >,
) -> Result<Json<runbox_types::FileInfo>, ApiError> {
    let query = fs_query(query, &[])?;
    Ok(Json(
        state.service.stat_path(id, Scope::Work, query.path).await?,
    ))
}

/// `GET /v1/runs/{id}/fs/list?path=P&depth=N&limit=N`.
pub async fn fs_list<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
    query: Result<
        axum::extract::Query<runbox_types::FsQuery>,
        axum::extract::rejection::QueryRejection,
    >,
) -> Result<Json<runbox_types::FileList>, ApiError> {
    let query = fs_query(query, &["depth", "limit"])?;
    Ok(Json(state.service.list_path(id, Scope::Work, query).await?))
}

/// `GET /v1/runs/{id}/fs/watch?path=P&recursive=true`: server-sent events,
/// one per change, named by their kind; `ready` first.
pub async fn fs_watch<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
    query: Result<
        axum::extract::Query<runbox_types::FsQuery>,
        axum::extract::rejection::QueryRejection,
    >,
) -> Result<Response, ApiError> {
    let query = fs_query(query, &["recursive"])?;
    let events = state.service.watch_path(id, Scope::Work, query).await?;
    let stream = events.map(|event| {
        let name = serde_json::to_value(event.kind)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        Ok::<_, Infallible>(json_event(&name, &event))
    });
    Ok(event_stream(stream))
}

/// `POST /v1/runs/{id}/fs/mkdir`.
pub async fn fs_mkdir<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
    AppJson(req): AppJson<runbox_types::MakeDirRequest>,
) -> Response {
    let action = runbox_proxy::audit::Action::MakeDir {
        path: runbox_proxy::audit::bounded(&req.path),
    };
    audited(
        action,
        state
            .service
            .make_dir(id, Scope::Work, req, None)
            .await
            .map(Json)
            .map_err(ApiError::from),
    )
}

/// `POST /v1/runs/{id}/fs/move`.
pub async fn fs_move<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
    AppJson(req): AppJson<runbox_types::MoveRequest>,
) -> Response {
    let action = runbox_proxy::audit::Action::Move {
        from: runbox_proxy::audit::bounded(&req.from),
        to: runbox_proxy::audit::bounded(&req.to),
    };
    audited(
        action,
        state
            .service
            .move_path(id, Scope::Work, req)
            .await
            .map(Json)
            .map_err(ApiError::from),
    )
}

/// `POST /v1/runs/{id}/fs/remove`.
pub async fn fs_remove<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
    AppJson(req): AppJson<runbox_types::RemoveRequest>,
) -> Response {
    let action = runbox_proxy::audit::Action::Remove {
        path: runbox_proxy::audit::bounded(&req.path),
        recursive: req.recursive.unwrap_or(false),
    };
    audited(
        action,
        state
            .service
            .remove_path(id, Scope::Work, req)
            .await
            .map(Json)
            .map_err(ApiError::from),
    )
}

/// The most records `GET /v1/audit` answers by default, and at most.
const AUDIT_LIMIT: usize = 1000;
const AUDIT_MAX: usize = runbox_core::runs::MAX_LIST_ENTRIES as usize;

/// `GET /v1/audit?run=&tenant=&since=&limit=`: the audit log's records
/// that match, oldest first, the latest `limit` of them, one JSON object a
/// line (`application/x-ndjson`).
pub async fn audit<S: RunService>(
    State(state): State<AppState<S>>,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    let mut filter = runbox_proxy::audit::AuditFilter::default();
    let mut limit = AUDIT_LIMIT;
    let bad = |what: String| ApiError::new(ErrorCode::BadRequest, what);
    for (key, value) in form_urlencoded::parse(query.as_deref().unwrap_or("").as_bytes()) {
        match key.as_ref() {
            "run" => {
                let id = runbox_types::parse_id(&value)
                    .ok_or_else(|| bad(format!("run {value:?} is not a run id")))?;
                filter.run = Some(id.to_string());
            }
            "tenant" => filter.tenant = Some(value.into_owned()),
            "since" => {
                let now = time::OffsetDateTime::now_utc();
                filter.since =
                    Some(runbox_core::accounting::parse_since(&value, now).map_err(bad)?);
            }
            "limit" => {
                limit = value
                    .parse()
                    .ok()
                    .filter(|n| (1..=AUDIT_MAX).contains(n))
                    .ok_or_else(|| bad(format!("limit is 1-{AUDIT_MAX}")))?;
            }
            other => {
                return Err(bad(format!(
                    "this route takes run, tenant, since and limit, not {:?}",
                    other.chars().take(64).collect::<String>()
                )))
            }
        }
    }
    let Some(log) = state.audit.clone() else {
        return Err(ApiError::new(
            ErrorCode::NotFound,
            "this daemon keeps no audit log",
        ));
    };
    let read_failed = |e: String| {
        ApiError::from(runbox_core::CoreError::Store(format!(
            "reading the audit log: {e}"
        )))
    };
    let mut records = tokio::task::spawn_blocking(move || log.records())
        .await
        .map_err(|e| read_failed(e.to_string()))?
        .map_err(|e| read_failed(e.to_string()))?;
    // What happened to runs whoever caused it, from the usage journal.
    records.extend(
        state
            .service
            .lifecycle_events()
            .await?
            .into_iter()
            .map(|e| {
                let transition = serde_json::to_value(e.event)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_owned))
                    .unwrap_or_default();
                runbox_proxy::audit::AuditRecord::Lifecycle {
                    t: e.t
                        .format(&time::format_description::well_known::Rfc3339)
                        .unwrap_or_default(),
                    run: e.run.to_string(),
                    tenant: e.tenant,
                    transition,
                }
            }),
    );
    let records = filter.apply(records);
    let skip = records.len().saturating_sub(limit);
    let mut body = Vec::new();
    for record in &records[skip..] {
        // Records are plain data: serialising them cannot fail.
        if serde_json::to_writer(&mut body, record).is_ok() {
            body.push(b'\n');
        }
    }
    Ok((
        [(
            CONTENT_TYPE,
            HeaderValue::from_static("application/x-ndjson"),
        )],
        body,
    )
        .into_response())
}

/// `GET /v1/pools`.
pub async fn list_pools<S: RunService>(
    State(state): State<AppState<S>>,
) -> Json<runbox_types::PoolList> {
    Json(state.service.pools())
}

/// `PUT /v1/pools`: replaces the pool set; pools left out drain.
pub async fn set_pools<S: RunService>(
    State(state): State<AppState<S>>,
    AppJson(set): AppJson<runbox_types::PoolSet>,
) -> Result<Json<runbox_types::PoolList>, ApiError> {
    Ok(Json(state.service.set_pools(set).await?))
}

/// `POST /v1/drain`: cordons the node; with `migrate`, moves its runs
/// to other nodes of the fleet too.
pub async fn drain<S: RunService>(
    State(state): State<AppState<S>>,
    headers: axum::http::HeaderMap,
    OptionalJson(req): OptionalJson<runbox_types::DrainRequest>,
) -> Json<runbox_types::PoolList> {
    let mut list = state.service.set_draining(true);
    if req.migrate {
        let authorization = headers.get(axum::http::header::AUTHORIZATION);
        let report = migrate(&state, authorization).await;
        tracing::info!(
            moved = report.moved.len(),
            failed = report.failed.len(),
            "drain moved the node's runs away"
        );
        list.migrated = Some(report);
    }
    Json(list)
}

/// `DELETE /v1/drain`: uncordons it.
pub async fn undrain<S: RunService>(
    State(state): State<AppState<S>>,
) -> Json<runbox_types::PoolList> {
    Json(state.service.set_draining(false))
}

/// `GET /v1/info`.
pub async fn info<S: RunService>(State(state): State<AppState<S>>) -> Json<runbox_types::Info> {
    Json(state.service.info())
}

/// `GET /v1/cluster`: the fleet's nodes (this one alone without a
/// cluster).
pub async fn cluster<S: RunService>(
    State(state): State<AppState<S>>,
) -> Result<Json<runbox_types::ClusterStatus>, ApiError> {
    Ok(Json(state.service.cluster().await?))
}

/// `POST /v1/runs/{id}/lease`: grants the run's writable lease.
pub async fn acquire_lease<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
    AppJson(req): AppJson<LeaseRequest>,
) -> Result<Json<LeaseResponse>, ApiError> {
    let lease = state.service.acquire_lease(id, req).await?;
    Ok(Json(LeaseResponse { lease }))
}

/// `POST /v1/runs/{id}/lease/renew`: extends the holder's lease.
pub async fn renew_lease<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
    AppJson(req): AppJson<LeaseRenewRequest>,
) -> Result<Json<LeaseResponse>, ApiError> {
    let lease = state.service.renew_lease(id, req).await?;
    Ok(Json(LeaseResponse { lease }))
}

/// `POST /v1/runs/{id}/lease/release`: gives the lease up.
pub async fn release_lease<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
    AppJson(req): AppJson<LeaseReleaseRequest>,
) -> Result<StatusCode, ApiError> {
    state.service.release_lease(id, req).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /v1/runs/{id}/exec`: a server-sent event stream of the command's
/// output and its exit.
pub async fn exec<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
    AppJson(req): AppJson<ExecRequest>,
) -> Response {
    let action = runbox_proxy::audit::Action::command(
        &req.cmd,
        req.user.as_deref(),
        req.cwd.as_deref(),
        "exec",
    );
    let started = state.service.exec(id, req).await;
    audited(
        action,
        started
            .map(crate::process::exec_events)
            .map_err(ApiError::from),
    )
}

/// A server-sent event stream with keep-alive comments every 15 s, marked
/// so proxies do not buffer it.
pub(crate) fn event_stream(
    stream: impl futures::Stream<Item = Result<Event, Infallible>> + Send + 'static,
) -> Response {
    let mut response = Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response();
    response
        .headers_mut()
        .insert("x-accel-buffering", HeaderValue::from_static("no"));
    response
}

pub(crate) fn json_event(name: &str, value: &impl serde::Serialize) -> Event {
    // Serialising these plain structs cannot fail.
    Event::default()
        .event(name)
        .data(serde_json::to_string(value).unwrap_or_default())
}

/// The file path from `/v1/runs/{id}/files/{*path}`.
fn file_path(params: &[(String, String)]) -> &str {
    params
        .iter()
        .find(|(k, _)| k == "path")
        .map(|(_, v)| v.as_str())
        .unwrap_or("")
}

pub(crate) fn content_length(headers: &HeaderMap) -> Result<Option<u64>, ApiError> {
    match headers.get(CONTENT_LENGTH) {
        None => Ok(None),
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|s| s.parse().ok())
            .map(Some)
            .ok_or_else(|| ApiError::new(ErrorCode::BadRequest, "Content-Length is not a number")),
    }
}

/// `PUT /v1/runs/{id}/files/{*path}`: streams the body into `/work/<path>`.
pub async fn put_file<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
    AppPath(params): AppPath<Vec<(String, String)>>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let action = runbox_proxy::audit::Action::Write {
        path: runbox_proxy::audit::bounded(file_path(&params)),
    };
    let written = async {
        let length = content_length(&headers)?;
        let credential = lease_credential(query.as_deref())?;
        let body = body
            .into_data_stream()
            .map_err(std::io::Error::other)
            .boxed();
        state
            .service
            .put_file(
                id,
                Scope::Work,
                file_path(&params).to_owned(),
                runbox_core::runs::WriteOptions {
                    credential,
                    content_length: length,
                    ..Default::default()
                },
                body,
            )
            .await?;
        Ok(StatusCode::NO_CONTENT)
    }
    .await;
    audited(action, written)
}

/// The lease credential of a file write: `?owner=NAME&generation=N`, both
/// or neither. Any other parameter, or one given twice, is refused rather
/// than ignored: a misspelt `generation` must not turn into "no credential".
fn lease_credential(query: Option<&str>) -> Result<Option<(String, u64)>, ApiError> {
    let mut pairs = crate::process::query_pairs(query, &["owner", "generation"])?;
    crate::process::credential(&mut pairs)
}

/// `GET /v1/runs/{id}/files/{*path}`: streams `/work/<path>` back.
pub async fn get_file<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
    AppPath(params): AppPath<Vec<(String, String)>>,
) -> Result<Response, ApiError> {
    let download = state
        .service
        .get_file(id, Scope::Work, file_path(&params).to_owned())
        .await?;
    Ok(download_response(download, move |e| {
        tracing::warn!(run = %id, error = %e, "file download broke off");
    }))
}

/// A file download's `200`: its length first, then its bytes. An error
/// after the status line (`broke` is told of it) breaks the body: the only
/// way left to tell the client, and its length check catches it.
pub(crate) fn download_response(
    download: runbox_core::runs::FileDownload,
    broke: impl Fn(&runbox_core::CoreError) + Send + Sync + 'static,
) -> Response {
    let body = Body::from_stream(download.body.map_err(move |e| {
        broke(&e);
        std::io::Error::other(e.to_string())
    }));
    Response::builder()
        .status(StatusCode::OK)
        .header(CONTENT_TYPE, "application/octet-stream")
        .header(CONTENT_LENGTH, download.size)
        .body(body)
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// `POST /v1/images/{name}`: imports a root filesystem tarball.
pub async fn import_image<S: RunService>(
    State(state): State<AppState<S>>,
    AppPath(name): AppPath<String>,
    body: Body,
) -> Result<Response, ApiError> {
    let stream = body
        .into_data_stream()
        .map_err(std::io::Error::other)
        .boxed();
    let image = state.service.import_image(name, stream).await?;
    Ok((StatusCode::CREATED, Json(image)).into_response())
}

/// `POST /v1/images/pull`: a server-sent event stream of `progress` events,
/// then one `done` (the Image) or one `error`. The pull runs in a task of
/// its own: a client that disconnects does not stop it, and the image
/// appears when it is done.
pub async fn pull_image<S: RunService>(
    State(state): State<AppState<S>>,
    caller: Caller,
    AppJson(req): AppJson<PullRequest>,
) -> Result<Response, ApiError> {
    // Fail fast, as a plain JSON error, on what can be checked up front.
    state.service.check_pull(&req)?;
    // A tenant pulls only what its images rule lets it run (the image is
    // shared once pulled).
    let mut names = vec![req.reference.as_str()];
    names.extend(req.name.as_deref());
    caller.owner().check_image(&names)?;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<PullEvent>();
    let manager = state.service.clone();
    let task = tokio::spawn(async move { manager.pull_image(req, tx).await });
    let progress = tokio_stream::wrappers::UnboundedReceiverStream::new(rx)
        .map(|event| json_event(pull_sse::PROGRESS, &event));
    let last = futures::stream::once(async move {
        match task.await {
            Ok(Ok(image)) => json_event(pull_sse::DONE, &image),
            Ok(Err(e)) => {
                let e = ApiError::from(e);
                json_event(
                    pull_sse::ERROR,
                    &ErrorDetail {
                        code: e.code().as_str().to_owned(),
                        message: e.message().to_owned(),
                    },
                )
            }
            Err(e) => {
                tracing::error!(error = %e, "pull task failed");
                json_event(
                    pull_sse::ERROR,
                    &ErrorDetail {
                        code: "internal".into(),
                        message: "internal error; see the server log".into(),
                    },
                )
            }
        }
    });
    let stream = progress.chain(last).map(Ok::<_, Infallible>);
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response())
}

/// `GET /v1/images`.
pub async fn list_images<S: RunService>(
    State(state): State<AppState<S>>,
    caller: Caller,
) -> Result<Json<ImageList>, ApiError> {
    let mut images = state.service.list_images()?;
    images.retain(|i| i.tenant.is_none() || caller.sees(i.tenant.as_deref()));
    Ok(Json(ImageList {
        server: state.service.server_id().to_owned(),
        images,
    }))
}

/// Image `name` if `caller` may see it: shared images, and its own
/// snapshots; another tenant's is as absent as one that never was.
fn visible_image<S: RunService>(
    state: &AppState<S>,
    caller: &Caller,
    name: &str,
) -> Result<Image, ApiError> {
    let image = state.service.get_image(name)?;
    if image.tenant.is_some() && !caller.sees(image.tenant.as_deref()) {
        return Err(runbox_core::CoreError::ImageNotFound(name.to_owned()).into());
    }
    Ok(image)
}

/// `GET /v1/snapshots`: the images made by snapshots.
pub async fn list_snapshots<S: RunService>(
    State(state): State<AppState<S>>,
    caller: Caller,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Result<Json<runbox_types::SnapshotList>, ApiError> {
    let selector = LabelSelector::parse(query.as_deref())?;
    let mut images = state.service.list_images()?;
    // A snapshot is an image of the node that took it (its `server`): on
    // a node of a fleet the list is the fleet's, the other nodes' read
    // with the fleet's root token, filtered here.
    if state.service.in_fleet() && !headers.contains_key(crate::forward::NODE_PROOF) {
        let others: Vec<ImageList> =
            crate::forward::read_others(&state.service, &state.token, "/v1/images").await;
        images.extend(others.into_iter().flat_map(|list| list.images));
        images.sort_by(|a, b| (&a.name, &a.server).cmp(&(&b.name, &b.server)));
    }
    Ok(Json(runbox_types::SnapshotList {
        server: state.service.server_id().to_owned(),
        snapshots: images
            .into_iter()
            .filter(|i| {
                i.is_snapshot() && caller.sees(i.tenant.as_deref()) && selector.matches(&i.labels)
            })
            .collect(),
    }))
}

/// `DELETE /v1/snapshots/{name}`.
pub async fn delete_snapshot<S: RunService>(
    State(state): State<AppState<S>>,
    caller: Caller,
    AppPath(name): AppPath<String>,
    request: ElsewhereRequest,
) -> Result<Response, ApiError> {
    match remove_snapshot(&state, &caller, name).await {
        Ok(done) => Ok(done.into_response()),
        // Another node's snapshot, on a node of a fleet: its node deletes
        // it (and checks the caller again).
        Err(e) => request.or_elsewhere(&state, e).await,
    }
}

/// `DELETE /v1/snapshots?image=NAME`.
pub async fn delete_snapshot_by_query<S: RunService>(
    State(state): State<AppState<S>>,
    caller: Caller,
    query: Result<
        axum::extract::Query<runbox_types::SnapshotQuery>,
        axum::extract::rejection::QueryRejection,
    >,
) -> Result<StatusCode, ApiError> {
    let axum::extract::Query(query) = query.map_err(|e| {
        ApiError::new(
            ErrorCode::BadRequest,
            format!("give the snapshot as ?image=NAME ({e})"),
        )
    })?;
    remove_snapshot(&state, &caller, query.image).await
}

/// Deletes snapshot image `name`; other images are not snapshots (404).
async fn remove_snapshot<S: RunService>(
    state: &AppState<S>,
    caller: &Caller,
    name: String,
) -> Result<StatusCode, ApiError> {
    let image = visible_image(state, caller, &name)?;
    if !image.is_snapshot() || !caller.sees(image.tenant.as_deref()) {
        return Err(ApiError::new(
            ErrorCode::ImageNotFound,
            format!(
                "{name:?} is an image, not a snapshot; delete it with DELETE /v1/images/{name}"
            ),
        ));
    }
    state.service.delete_image(name).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `GET /v1/images/{name}`: the image with its config document.
pub async fn get_image<S: RunService>(
    State(state): State<AppState<S>>,
    caller: Caller,
    AppPath(name): AppPath<String>,
) -> Result<Response, ApiError> {
    Ok(Json(visible_image(&state, &caller, &name)?).into_response())
}

/// `DELETE /v1/images/{name}`: a tenant deletes its own snapshots only;
/// shared images are the operator's.
pub async fn delete_image<S: RunService>(
    State(state): State<AppState<S>>,
    caller: Caller,
    AppPath(name): AppPath<String>,
) -> Result<StatusCode, ApiError> {
    if caller.tenant().is_some() {
        let image = visible_image(&state, &caller, &name)?;
        if image.tenant.is_none() {
            return Err(ApiError::new(
                ErrorCode::Forbidden,
                format!("image {name:?} is shared; only the operator deletes it"),
            ));
        }
    }
    state.service.delete_image(name).await?;
    Ok(StatusCode::NO_CONTENT)
}
