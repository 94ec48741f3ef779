//! Run history routes: the points, what one changed, a rollback, and a
//! fork of a point (see `runbox_core::runs` history).

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use runbox_core::RunService;
use runbox_types::{ErrorCode, ForkRequest, HistoryDiffQuery, RollbackRequest};
use ulid::Ulid;

use crate::error::ApiError;
use crate::handlers::{with_token, AppJson, AppPath, OptionalJson, RunId};
use crate::AppState;

/// The `{point}` of a history route.
fn point_param(params: &[(String, String)]) -> Result<Ulid, ApiError> {
    let raw = params
        .iter()
        .find(|(k, _)| k == "point")
        .map(|(_, v)| v.as_str())
        .unwrap_or("");
    runbox_types::parse_id(raw).ok_or_else(|| {
        ApiError::new(
            ErrorCode::PointNotFound,
            format!(
                "no history point {:?} (point ids are ULIDs)",
                raw.chars().take(64).collect::<String>()
            ),
        )
    })
}

/// `GET /v1/runs/{id}/history`: the run's points, newest first.
pub async fn list<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
) -> Result<Response, ApiError> {
    Ok(Json(state.service.history(id).await?).into_response())
}

/// `GET /v1/runs/{id}/history/{point}/diff[?against=P&patch=true&limit=N]`.
pub async fn diff<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
    AppPath(params): AppPath<Vec<(String, String)>>,
    query: Result<Query<HistoryDiffQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let point = point_param(&params)?;
    let Query(query) = query.map_err(|e| {
        ApiError::new(
            ErrorCode::BadRequest,
            format!(
                "{}; the query takes against (a point id), patch (true or false) and limit (1-{})",
                e.body_text(),
                runbox_core::runs::MAX_DIFF_PATHS
            ),
        )
    })?;
    Ok(Json(state.service.history_diff(id, point, query).await?).into_response())
}

/// `POST /v1/runs/{id}/rollback {point}`: the run's files return to the
/// point; a running run is booted again on them.
pub async fn rollback<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
    AppJson(req): AppJson<RollbackRequest>,
) -> Result<Response, ApiError> {
    Ok(Json(state.service.rollback(id, req).await?).into_response())
}

/// `POST /v1/runs/{id}/history/{point}/fork [{count, ttlSec}]`: new runs
/// from the run's files as they were at the point (one by default).
pub async fn fork<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
    AppPath(params): AppPath<Vec<(String, String)>>,
    OptionalJson(req): OptionalJson<Option<ForkRequest>>,
) -> Result<Response, ApiError> {
    let point = point_param(&params)?;
    let mut req = req.unwrap_or(ForkRequest {
        count: 1,
        ..Default::default()
    });
    if req.point.is_some_and(|p| p != point) {
        return Err(ApiError::new(
            ErrorCode::BadRequest,
            "the body's point differs from the path's; leave it out",
        ));
    }
    req.point = Some(point);
    let mut forked = state.service.fork(id, req).await?;
    forked.runs = forked
        .runs
        .into_iter()
        .map(|run| with_token(&state, run))
        .collect();
    Ok((StatusCode::CREATED, Json(forked)).into_response())
}
