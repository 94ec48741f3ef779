//! The build routes: contexts in, builds started, watched and cancelled.
//! Builds belong to the caller's tenant (the operator's for the root
//! token); another tenant's build reads as missing.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::sse::{KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::{StreamExt, TryStreamExt};
use runbox_core::builds::BuildEvent;
use runbox_core::service::RunService;
use runbox_types::{build_sse, BuildRequest, ErrorCode};
use serde::Deserialize;
use ulid::Ulid;

use crate::auth::Caller;
use crate::error::ApiError;
use crate::handlers::{json_event, AppJson, AppPath};
use crate::AppState;

/// The `{id}` of a build route; a malformed one is a 404.
fn build_id(raw: &str) -> Result<Ulid, ApiError> {
    runbox_types::parse_id(raw).ok_or_else(|| {
        ApiError::new(
            ErrorCode::BuildNotFound,
            format!("no build with id {raw:?} (build ids are ULIDs)"),
        )
    })
}

/// `PUT /v1/build-contexts/{digest}`: the body is a tar (plain or gzip)
/// whose bytes hash to `digest`.
pub async fn put_context<S: RunService>(
    State(state): State<AppState<S>>,
    caller: Caller,
    AppPath(digest): AppPath<String>,
    body: Body,
) -> Result<Response, ApiError> {
    let stream = body
        .into_data_stream()
        .map_err(std::io::Error::other)
        .boxed();
    let context = state
        .service
        .put_build_context(
            caller.owner(),
            runbox_core::builds::ContextKind::Digest,
            digest,
            stream,
        )
        .await?;
    Ok((StatusCode::CREATED, Json(context)).into_response())
}

/// `POST /v1/builds`: answers `202` with the build at once; it goes on in
/// the background (a client that hangs up does not stop it).
pub async fn start<S: RunService>(
    State(state): State<AppState<S>>,
    caller: Caller,
    AppJson(req): AppJson<BuildRequest>,
) -> Result<Response, ApiError> {
    let build = state
        .service
        .start_build(req, caller.owner(), Default::default())
        .await?;
    Ok((StatusCode::ACCEPTED, Json(build)).into_response())
}

/// `GET /v1/builds`.
pub async fn list<S: RunService>(
    State(state): State<AppState<S>>,
    caller: Caller,
) -> Result<Response, ApiError> {
    Ok(Json(runbox_types::BuildList {
        server: state.service.server_id().to_owned(),
        builds: state.service.list_builds(&caller.owner())?,
    })
    .into_response())
}

/// `GET /v1/builds/{id}`.
pub async fn get<S: RunService>(
    State(state): State<AppState<S>>,
    caller: Caller,
    AppPath(raw): AppPath<String>,
) -> Result<Response, ApiError> {
    let id = build_id(&raw)?;
    Ok(Json(state.service.get_build(id, &caller.owner())?).into_response())
}

/// `POST /v1/builds/{id}/cancel`: answers once the build has ended.
pub async fn cancel<S: RunService>(
    State(state): State<AppState<S>>,
    caller: Caller,
    AppPath(raw): AppPath<String>,
) -> Result<Response, ApiError> {
    let id = build_id(&raw)?;
    Ok(Json(state.service.cancel_build(id, caller.owner()).await?).into_response())
}

/// The query of `GET /v1/builds/{id}/events`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventsQuery {
    /// The first log line wanted (earlier ones were seen).
    #[serde(default)]
    pub offset: u64,
}

/// `GET /v1/builds/{id}/events`: server-sent events, `step` and `log`,
/// then one `done` with the build as it ended.
pub async fn events<S: RunService>(
    State(state): State<AppState<S>>,
    caller: Caller,
    AppPath(raw): AppPath<String>,
    query: Result<Query<EventsQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(query) = query.map_err(|e| {
        ApiError::new(
            ErrorCode::BadRequest,
            format!("{e}; the events query takes offset=<line number>"),
        )
    })?;
    let id = build_id(&raw)?;
    let events = state
        .service
        .build_events(id, &caller.owner(), query.offset)?;
    let stream = events
        .map(|event| match event {
            BuildEvent::Step(step) => json_event(build_sse::STEP, &step),
            BuildEvent::Log(line) => json_event(build_sse::LOG, &line),
            BuildEvent::Done(build) => json_event(build_sse::DONE, &build),
        })
        .map(Ok::<_, Infallible>);
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response())
}
