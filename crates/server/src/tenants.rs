//! `/v1/tenants`: the operator adds, changes, rotates and removes tenants
//! (root token only, see [`crate::auth::rule`]). A token is answered once,
//! at creation or rotation; changes are audited by name.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use runbox_core::tenants::TenantEntry;
use runbox_core::{CoreError, RunService};
use runbox_types::{CreateTenantRequest, ErrorCode, TenantList, TenantToken, UpdateTenantRequest};

use crate::handlers::AppJson;
use crate::{ApiError, AppState};

/// Runs a tenant-store change off the async workers (it writes a file).
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, CoreError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::new(ErrorCode::Internal, format!("tenant task failed: {e}")))?
        .map_err(ApiError::from)
}

fn view<S: RunService>(state: &AppState<S>, entry: &TenantEntry) -> runbox_types::Tenant {
    let runs = state
        .service
        .tenant_runs()
        .get(&entry.name)
        .copied()
        .unwrap_or(0);
    entry.view(runs)
}

/// Records a tenant change in the audit log: its name and what was done.
fn audit<S: RunService>(state: &AppState<S>, change: &str, tenant: &str) {
    tracing::info!(tenant, change, "tenant set changed");
    if let Some(log) = state.audit.clone() {
        let record = runbox_proxy::audit::AuditRecord::Tenants {
            t: runbox_proxy::audit::now(),
            change: change.to_owned(),
            tenant: tenant.to_owned(),
        };
        tokio::task::spawn_blocking(move || log.append(&record));
    }
}

/// A tenant may be bound only to a class the server defines now.
fn known_class<S: RunService>(state: &AppState<S>, class: Option<&str>) -> Result<(), ApiError> {
    let Some(class) = class else {
        return Ok(());
    };
    let classes = state.service.egress_classes();
    if classes.iter().any(|c| c == class) {
        return Ok(());
    }
    Err(ApiError::new(
        ErrorCode::BadTenant,
        format!(
            "no egress class named {:?} is defined on this server ({}); the operator defines \
             them with --egress-class or [[egress_class]] in the config file",
            class.chars().take(64).collect::<String>(),
            if classes.is_empty() {
                "it defines none".to_owned()
            } else {
                format!("classes: {}", classes.join(", "))
            }
        ),
    ))
}

/// `POST /v1/tenants`: the tenant and its token, shown this once.
pub async fn create<S: RunService>(
    State(state): State<AppState<S>>,
    AppJson(req): AppJson<CreateTenantRequest>,
) -> Result<Response, ApiError> {
    known_class(&state, req.egress_class.as_deref())?;
    let store = state.service.tenants();
    let (entry, token) = blocking(move || store.create(req)).await?;
    audit(&state, "create", &entry.name);
    let body = TenantToken {
        tenant: view(&state, &entry),
        token,
    };
    Ok((StatusCode::CREATED, Json(body)).into_response())
}

/// `GET /v1/tenants`.
pub async fn list<S: RunService>(State(state): State<AppState<S>>) -> Json<TenantList> {
    let counts = state.service.tenant_runs();
    let tenants = state
        .service
        .tenants()
        .list()
        .iter()
        .map(|t| t.view(counts.get(&t.name).copied().unwrap_or(0)))
        .collect();
    Json(TenantList { tenants })
}

fn found<S: RunService>(
    state: &AppState<S>,
    name: &str,
) -> Result<std::sync::Arc<TenantEntry>, ApiError> {
    state.service.tenants().get(name).ok_or_else(|| {
        ApiError::new(
            ErrorCode::TenantNotFound,
            format!(
                "no tenant named {:?}; GET /v1/tenants lists them",
                name.chars().take(64).collect::<String>()
            ),
        )
    })
}

/// `GET /v1/tenants/{name}`.
pub async fn get<S: RunService>(
    State(state): State<AppState<S>>,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    let entry = found(&state, &name)?;
    Ok(Json(view(&state, &entry)).into_response())
}

/// `PATCH /v1/tenants/{name}`: replaces the settings given. A lower
/// `maxRuns` stops new runs only; runs it already has keep running.
pub async fn update<S: RunService>(
    State(state): State<AppState<S>>,
    Path(name): Path<String>,
    AppJson(req): AppJson<UpdateTenantRequest>,
) -> Result<Response, ApiError> {
    known_class(
        &state,
        req.egress_class.as_deref().filter(|c| !c.is_empty()),
    )?;
    let store = state.service.tenants();
    let entry = blocking(move || store.update(&name, req)).await?;
    audit(&state, "update", &entry.name);
    Ok(Json(view(&state, &entry)).into_response())
}

/// `POST /v1/tenants/{name}/rotate`: a new token; the old one stops
/// working at once.
pub async fn rotate<S: RunService>(
    State(state): State<AppState<S>>,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    let store = state.service.tenants();
    let (entry, token) = blocking(move || store.rotate(&name)).await?;
    audit(&state, "rotate", &entry.name);
    let body = TenantToken {
        tenant: view(&state, &entry),
        token,
    };
    Ok(Json(body).into_response())
}

/// `GET /v1/usage?since=&tenant=`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UsageQuery {
    since: Option<String>,
    tenant: Option<String>,
}

/// `GET /v1/usage`: run-seconds by size, CPU-seconds, peak memory, egress
/// bytes and event counts per tenant (`""` is the operator's own runs).
/// A tenant sees its own only, whatever it asks.
pub async fn usage<S: RunService>(
    State(state): State<AppState<S>>,
    caller: crate::auth::Caller,
    headers: axum::http::HeaderMap,
    query: Result<axum::extract::Query<UsageQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<runbox_types::UsageReport>, ApiError> {
    let axum::extract::Query(query) = query.map_err(|e| {
        ApiError::new(
            ErrorCode::BadRequest,
            format!("usage takes ?since=TIME|SPAN&tenant=NAME ({e})"),
        )
    })?;
    let since = query
        .since
        .as_deref()
        .map(|s| {
            runbox_core::accounting::parse_since(s, time::OffsetDateTime::now_utc())
                .map_err(|why| ApiError::new(ErrorCode::BadRequest, why))
        })
        .transpose()?;
    let tenant = match caller.tenant() {
        Some(own) => Some(own.to_owned()),
        None => query.tenant,
    };
    let mut report = state.service.usage_report(since, tenant.clone()).await?;
    // Each node journals its own runs: on a node of a fleet the report
    // sums every node's over the same window (the others read with the
    // fleet's root token, for the tenant this caller may see).
    if state.service.in_fleet() {
        report.nodes = vec![state.service.server_id().to_owned()];
    }
    if state.service.in_fleet() && !headers.contains_key(crate::forward::NODE_PROOF) {
        let path = {
            let mut query = form_urlencoded::Serializer::new(String::new());
            if let Some(since) = report.since {
                if let Ok(since) = since.format(&time::format_description::well_known::Rfc3339) {
                    query.append_pair("since", &since);
                }
            }
            if let Some(tenant) = &tenant {
                query.append_pair("tenant", tenant);
            }
            format!("/v1/usage?{}", query.finish())
        };
        let others: Vec<runbox_types::UsageReport> =
            crate::forward::read_others(&state.service, &state.token, &path).await;
        for other in others {
            runbox_core::accounting::add_report(&mut report, other);
        }
        report.nodes.sort();
    }
    Ok(Json(report))
}

/// `POST /v1/config/reload`: reads the config file again, as SIGHUP does.
pub async fn reload_config<S: RunService>(
    State(state): State<AppState<S>>,
) -> Result<Json<runbox_types::ConfigReload>, ApiError> {
    let Some(reload) = state.reload.clone() else {
        return Err(ApiError::new(
            ErrorCode::NoConfig,
            "this daemon was started without --config; there is nothing to reload",
        ));
    };
    let report = tokio::task::spawn_blocking(move || reload())
        .await
        .map_err(|e| ApiError::new(ErrorCode::Internal, format!("reload task failed: {e}")))?
        .map_err(|why| ApiError::new(ErrorCode::ConfigInvalid, why))?;
    Ok(Json(report))
}

/// `DELETE /v1/tenants/{name}`: refused while it has runs.
pub async fn delete<S: RunService>(
    State(state): State<AppState<S>>,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    let service = state.service.clone();
    let gone = name.clone();
    blocking(move || service.delete_tenant(&gone)).await?;
    audit(&state, "delete", &name);
    Ok(StatusCode::NO_CONTENT)
}
