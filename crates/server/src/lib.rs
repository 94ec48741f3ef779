//! runbox's HTTP API. Handlers only parse and check the request, call a
//! [`RunService`] (the real one is `Arc<runbox_core::Manager>`; the router
//! tests use a stub), and map the result or error onto HTTP; no lifecycle
//! logic lives here.
//!
//! Authentication: every route except `GET /health` needs
//! `Authorization: Bearer <token>`: the root token, a tenant's or a run's
//! (see [`auth`]). E2B's control plane takes the root or a tenant token as
//! `X-API-Key`; E2B envd requests (see [`e2b`]) carry a run token instead.

pub mod auth;
mod builds;
mod conn;
pub mod e2b;
mod error;
mod forward;
mod handlers;
mod history;
pub mod metrics;
pub mod openapi;
mod preview;
mod process;
mod tenants;

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post, put};
use axum::Router;
use runbox_core::RunService;
use runbox_types::ErrorCode;
use subtle::ConstantTimeEq;
use tower_http::trace::TraceLayer;

pub use error::ApiError;
pub use preview::{preview_router, PreviewState, COOKIE_NAME, TUNNEL_PROTOCOL};

/// Largest JSON request body.
pub const MAX_JSON_BYTES: usize = 1 << 20;

/// What every handler can reach.
#[derive(Clone)]
pub struct AppState<S> {
    /// The service every handler calls.
    pub service: S,
    /// The bearer token clients must present.
    pub token: Arc<str>,
    /// Where state-changing calls are recorded, if anywhere.
    pub audit: Option<Arc<runbox_proxy::audit::AuditLog>>,
    /// Reads the config file again (`POST /v1/config/reload`); None when
    /// the daemon has none.
    pub reload: Option<Reloader>,
    /// The Prometheus metrics (`GET /metrics`).
    pub metrics: Arc<metrics::Metrics>,
}

/// Reads the daemon's config file again and applies what it can: the
/// report, or why the file was refused (nothing changed then).
pub type Reloader = Arc<dyn Fn() -> Result<runbox_types::ConfigReload, String> + Send + Sync>;

/// The API router.
pub fn router<S: RunService>(state: AppState<S>) -> Router {
    let streaming = Router::new()
        .route(
            "/v1/runs/{id}/files/{*path}",
            put(handlers::put_file::<S>).get(handlers::get_file::<S>),
        )
        .route(
            "/v1/volumes/{name}/files/{*path}",
            put(handlers::put_volume_file::<S>).get(handlers::get_volume_file::<S>),
        )
        .route(
            "/v1/images/{name}",
            post(handlers::import_image::<S>)
                .delete(handlers::delete_image::<S>)
                .get(handlers::get_image::<S>),
        )
        .route("/v1/build-contexts/{digest}", put(builds::put_context::<S>))
        // File and image bodies stream; their own maxima are enforced while
        // streaming, not by buffering.
        .layer(DefaultBodyLimit::disable());
    let api = Router::new()
        .route(
            "/v1/runs",
            post(handlers::create_run::<S>).get(handlers::list_runs::<S>),
        )
        .route(
            "/v1/runs/{id}",
            get(handlers::get_run::<S>).delete(handlers::delete_run::<S>),
        )
        .route("/v1/runs/{id}/renew", post(handlers::renew_run::<S>))
        .route(
            "/v1/runs/{id}/egress",
            axum::routing::patch(handlers::update_run_egress::<S>),
        )
        .route("/v1/runs/{id}/pause", post(handlers::pause_run::<S>))
        .route("/v1/runs/{id}/resume", post(handlers::resume_run::<S>))
        .route(
            "/v1/runs/{id}/hibernate",
            post(handlers::hibernate_run::<S>),
        )
        .route("/v1/runs/{id}/wake", post(handlers::wake_run::<S>))
        .route("/v1/runs/{id}/snapshot", post(handlers::snapshot_run::<S>))
        .route("/v1/runs/{id}/fork", post(handlers::fork_run::<S>))
        .route("/v1/runs/{id}/history", get(history::list::<S>))
        .route(
            "/v1/runs/{id}/history/{point}/diff",
            get(history::diff::<S>),
        )
        .route(
            "/v1/runs/{id}/history/{point}/fork",
            post(history::fork::<S>),
        )
        .route("/v1/runs/{id}/rollback", post(history::rollback::<S>))
        .route("/v1/runs/{id}/archive", post(handlers::archive_run::<S>))
        .route("/v1/runs/{id}/move", post(handlers::move_run::<S>))
        .route(
            "/v1/runs/{id}/checkpoint",
            post(handlers::checkpoint_run::<S>),
        )
        .route("/v1/checkpoints", get(handlers::list_checkpoints::<S>))
        .route(
            "/v1/checkpoints/{id}",
            get(handlers::get_checkpoint::<S>).delete(handlers::delete_checkpoint::<S>),
        )
        .route("/v1/runs/{id}/fs/stat", get(handlers::fs_stat::<S>))
        .route("/v1/runs/{id}/fs/list", get(handlers::fs_list::<S>))
        .route("/v1/runs/{id}/fs/watch", get(handlers::fs_watch::<S>))
        .route("/v1/runs/{id}/fs/mkdir", post(handlers::fs_mkdir::<S>))
        .route("/v1/runs/{id}/fs/move", post(handlers::fs_move::<S>))
        .route("/v1/runs/{id}/fs/remove", post(handlers::fs_remove::<S>))
        .route(
            "/v1/runs/{id}/warm-commit",
            post(handlers::warm_commit::<S>),
        )
        .route("/v1/runs/{id}/warm", get(handlers::warm_status::<S>))
        .route("/v1/warmcache", get(handlers::warm_templates::<S>))
        .route(
            "/v1/volumes",
            post(handlers::create_volume::<S>).get(handlers::list_volumes::<S>),
        )
        .route(
            "/v1/volumes/{name}",
            get(handlers::get_volume::<S>).delete(handlers::delete_volume::<S>),
        )
        .route(
            "/v1/volumes/{name}/clone",
            post(handlers::clone_volume::<S>),
        )
        .route("/v1/volumes/{name}/move", post(handlers::move_volume::<S>))
        .route(
            "/v1/volumes/{name}/fs/stat",
            get(handlers::volume_stat::<S>),
        )
        .route(
            "/v1/volumes/{name}/fs/list",
            get(handlers::volume_list::<S>),
        )
        .route(
            "/v1/volumes/{name}/fs/mkdir",
            post(handlers::volume_mkdir::<S>),
        )
        .route(
            "/v1/volumes/{name}/fs/move",
            post(handlers::volume_move::<S>),
        )
        .route(
            "/v1/volumes/{name}/fs/remove",
            post(handlers::volume_remove::<S>),
        )
        .route(
            "/v1/pools",
            get(handlers::list_pools::<S>).put(handlers::set_pools::<S>),
        )
        .route(
            "/v1/drain",
            post(handlers::drain::<S>).delete(handlers::undrain::<S>),
        )
        .route("/v1/info", get(handlers::info::<S>))
        .route("/v1/cluster", get(handlers::cluster::<S>))
        .route("/v1/audit", get(handlers::audit::<S>))
        .route(
            "/v1/warmcache/{owner}/{name}",
            get(handlers::warm_template::<S>).delete(handlers::warm_invalidate::<S>),
        )
        .route("/v1/runs/{id}/exec", post(handlers::exec::<S>))
        .route("/v1/runs/{id}/exec/ws", get(process::exec_ws::<S>))
        .route("/v1/runs/{id}/preview", post(preview::mint::<S>))
        .route(
            "/v1/runs/{id}/ports/{port}/connect",
            get(preview::tunnel::<S>),
        )
        .route(
            "/v1/runs/{id}/processes",
            post(process::start::<S>).get(process::list::<S>),
        )
        .route("/v1/runs/{id}/processes/{process}", get(process::get::<S>))
        .route(
            "/v1/runs/{id}/processes/{process}/wait",
            get(process::wait::<S>),
        )
        .route(
            "/v1/runs/{id}/processes/{process}/signal",
            post(process::signal::<S>),
        )
        .route(
            "/v1/runs/{id}/processes/{process}/stdin",
            post(process::stdin::<S>),
        )
        .route(
            "/v1/runs/{id}/processes/{process}/output",
            get(process::output::<S>),
        )
        .route(
            "/v1/runs/{id}/processes/{process}/ws",
            get(process::attach_ws::<S>),
        )
        .route("/v1/runs/{id}/lease", post(handlers::acquire_lease::<S>))
        .route(
            "/v1/runs/{id}/lease/renew",
            post(handlers::renew_lease::<S>),
        )
        .route(
            "/v1/runs/{id}/lease/release",
            post(handlers::release_lease::<S>),
        )
        .route("/v1/images", get(handlers::list_images::<S>))
        .route(
            "/v1/snapshots",
            get(handlers::list_snapshots::<S>).delete(handlers::delete_snapshot_by_query::<S>),
        )
        .route(
            "/v1/snapshots/{name}",
            axum::routing::delete(handlers::delete_snapshot::<S>),
        )
        .route("/v1/images/pull", post(handlers::pull_image::<S>))
        .route(
            "/v1/builds",
            post(builds::start::<S>).get(builds::list::<S>),
        )
        .route("/v1/builds/{id}", get(builds::get::<S>))
        .route("/v1/builds/{id}/events", get(builds::events::<S>))
        .route("/v1/builds/{id}/cancel", post(builds::cancel::<S>))
        .route(
            "/v1/tenants",
            post(tenants::create::<S>).get(tenants::list::<S>),
        )
        .route(
            "/v1/tenants/{name}",
            get(tenants::get::<S>)
                .patch(tenants::update::<S>)
                .delete(tenants::delete::<S>),
        )
        .route("/v1/tenants/{name}/rotate", post(tenants::rotate::<S>))
        .route("/v1/usage", get(tenants::usage::<S>))
        .route("/v1/config/reload", post(tenants::reload_config::<S>))
        .route("/metrics", get(metrics::scrape::<S>))
        .layer(DefaultBodyLimit::max(MAX_JSON_BYTES))
        .merge(streaming)
        // A volume another node of the fleet holds: sent there once the
        // caller is known (its node checks the caller again).
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            forward::volume_elsewhere::<S>,
        ))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            auth::require::<S>,
        ))
        // Outside the token check, so refusals are counted too.
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            metrics::count::<S>,
        ));
    // E2B's control plane checks the same token, and answers in E2B's shape.
    let e2b_control = e2b::control_routes::<S>()
        .layer(DefaultBodyLimit::max(MAX_JSON_BYTES))
        // A sandbox of another node's: sent there once the key is known
        // to be the fleet's (its node checks it again, with the sandbox).
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            e2b::fleet_hop::<S>,
        ))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            e2b::require_api_key::<S>,
        ))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            metrics::count::<S>,
        ));
    // E2B's volume content API checks each volume's own token.
    let e2b_volumes = e2b::volume_content_routes::<S>(state.clone()).route_layer(
        middleware::from_fn_with_state(state.clone(), metrics::count::<S>),
    );
    // E2B's template file uploads carry a signed link, no API key.
    let e2b_uploads = e2b::template_upload_routes::<S>().route_layer(
        middleware::from_fn_with_state(state.clone(), metrics::count::<S>),
    );
    Router::new()
        .route("/health", get(handlers::health::<S>))
        // Checks the node proof itself: no client token comes with it.
        .route(
            &format!("{}/{{*rest}}", preview::FLEET_PREVIEW_PREFIX),
            axum::routing::any(preview::from_another_node::<S>),
        )
        .merge(e2b_control)
        .merge(e2b_volumes)
        .merge(e2b_uploads)
        .route("/v1/openapi.json", get(openapi::serve))
        .merge(api)
        .fallback(|| async { ApiError::new(ErrorCode::NotFound, "no such route; see docs/api.md") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                ErrorCode::MethodNotAllowed,
                "this route does not take that method; see docs/api.md",
            )
        })
        // Requests that name a sandbox are E2B envd calls.
        .layer(middleware::from_fn_with_state(
            e2b::Dispatch {
                envd: e2b::envd_router(state.clone()),
                app: state.clone(),
            },
            e2b::dispatch::<S>,
        ))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            metrics::count_relayed::<S>,
        ))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            audit_calls::<S>,
        ))
        .layer(TraceLayer::new_for_http())
        .with_state(state)
}

/// Records every state-changing call (anything but GET, HEAD and OPTIONS,
/// and WebSocket sessions) in the audit log once it is answered: method, path without the query
/// string, status and the run concerned. Never a body, a header or a query
/// (they may hold credentials).
async fn audit_calls<S: RunService>(
    State(state): State<AppState<S>>,
    request: Request,
    next: Next,
) -> Response {
    let Some(audit) = state.audit.clone() else {
        return next.run(request).await;
    };
    let method = request.method().clone();
    if !audited(&request) {
        return next.run(request).await;
    }
    let path = request.uri().path().to_owned();
    let response = next.run(request).await;
    let caller = response
        .extensions()
        .get::<auth::AuditCaller>()
        .map(|c| c.0.clone());
    // The run the request was admitted to, as authorisation parsed it.
    let run = response
        .extensions()
        .get::<auth::AdmittedRun>()
        .map(|admitted| admitted.0.to_string());
    let tenant = response
        .extensions()
        .get::<auth::AuditTenant>()
        .and_then(|t| t.0.clone());
    let action = response
        .extensions()
        .get::<handlers::AuditAction>()
        .map(|a| a.0.clone());
    let record = runbox_proxy::audit::AuditRecord::Api {
        t: runbox_proxy::audit::now(),
        method: method.to_string(),
        // Bounded: a path is the client's to choose.
        path: path.chars().take(512).collect(),
        status: response.status().as_u16(),
        run,
        caller,
        tenant,
        action,
    };
    // The write is small but blocking; keep it off the async workers.
    tokio::task::spawn_blocking(move || audit.append(&record));
    response
}

/// Whether a request gets an audit record: anything but GET, HEAD and
/// OPTIONS, and WebSocket sessions (an interactive exec, an attach: a GET
/// that changes state).
pub(crate) fn audited(request: &Request) -> bool {
    use axum::http::Method;
    let upgrade = request
        .headers()
        .get(axum::http::header::UPGRADE)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"websocket"));
    upgrade
        || !matches!(
            *request.method(),
            Method::GET | Method::HEAD | Method::OPTIONS
        )
}

/// The token of an `Authorization: Bearer <token>` header.
pub(crate) fn bearer(headers: &axum::http::HeaderMap) -> Option<&str> {
    headers
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        // The scheme name is case-insensitive (RFC 9110 §11.1).
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim())
}

/// Whether `presented` is the daemon token.
pub(crate) fn token_matches(presented: Option<&str>, token: &str) -> bool {
    match presented {
        // ct_eq compares in time that depends only on the lengths.
        Some(presented) => bool::from(presented.as_bytes().ct_eq(token.as_bytes())),
        None => false,
    }
}

/// The subprotocol a WebSocket session speaks; the server selects it when
/// the client offers it.
pub const WS_PROTOCOL: &str = "runbox.v1";

/// The prefix of the subprotocol that carries the token on a WebSocket
/// upgrade, for clients that cannot set headers (browsers, Node's global
/// WebSocket): `Sec-WebSocket-Protocol: runbox.v1, runbox.bearer.<token>`.
pub const WS_TOKEN_PREFIX: &str = "runbox.bearer.";

/// The token offered as a WebSocket subprotocol, on an upgrade only.
pub(crate) fn ws_protocol_token(headers: &axum::http::HeaderMap) -> Option<&str> {
    headers.get(axum::http::header::UPGRADE)?;
    headers
        .get_all(axum::http::header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .find_map(|p| p.trim().strip_prefix(WS_TOKEN_PREFIX))
}

/// Serves the preview router on `listener` until `shutdown` resolves; its
/// handler reads the peer's address (for the audit log).
pub async fn serve_preview(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use axum::serve::ListenerExt;
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::warn!(error = %e, "could not set TCP_NODELAY");
        }
    });
    let router = router.layer(middleware::from_fn(conn::close_unread));
    axum::serve(
        listener,
        router.into_make_service_with_connect_info::<std::net::SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown)
    .await
}

/// Serves `router` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let router = router.layer(middleware::from_fn(conn::close_unread));
    axum::serve(
        conn::SeverableListener(listener),
        router.into_make_service_with_connect_info::<conn::Severable>(),
    )
    .with_graceful_shutdown(shutdown)
    .await
}
