//! runbox's HTTP API. Handlers only parse and check the request, call
//! [`runbox_core::Manager`], and map the result or error onto HTTP; no
//! lifecycle logic lives here.
//!
//! Authentication: every route except `GET /health` needs
//! `Authorization: Bearer <token>`, compared in constant time.

mod error;
mod handlers;

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::Router;
use runbox_core::Manager;
use runbox_types::ErrorCode;
use subtle::ConstantTimeEq;
use tower_http::trace::TraceLayer;

pub use error::ApiError;

/// Largest JSON request body.
pub const MAX_JSON_BYTES: usize = 1 << 20;

/// What every handler can reach.
#[derive(Clone)]
pub struct AppState {
    /// The run manager.
    pub manager: Arc<Manager>,
    /// The bearer token clients must present.
    pub token: Arc<str>,
}

/// The API router.
pub fn router(state: AppState) -> Router {
    let streaming = Router::new()
        .route(
            "/v1/runs/{id}/files/{*path}",
            put(handlers::put_file).get(handlers::get_file),
        )
        .route(
            "/v1/images/{name}",
            post(handlers::import_image)
                .delete(handlers::delete_image)
                .get(handlers::get_image),
        )
        // File and image bodies stream; their own maxima are enforced while
        // streaming, not by buffering.
        .layer(DefaultBodyLimit::disable());
    let api = Router::new()
        .route(
            "/v1/runs",
            post(handlers::create_run).get(handlers::list_runs),
        )
        .route(
            "/v1/runs/{id}",
            get(handlers::get_run).delete(handlers::delete_run),
        )
        .route("/v1/runs/{id}/renew", post(handlers::renew_run))
        .route("/v1/runs/{id}/exec", post(handlers::exec))
        .route("/v1/runs/{id}/lease", post(handlers::acquire_lease))
        .route("/v1/runs/{id}/lease/renew", post(handlers::renew_lease))
        .route("/v1/runs/{id}/lease/release", post(handlers::release_lease))
        .route("/v1/images", get(handlers::list_images))
        .route("/v1/images/pull", post(handlers::pull_image))
        .layer(DefaultBodyLimit::max(MAX_JSON_BYTES))
        .merge(streaming)
        .route_layer(middleware::from_fn_with_state(state.clone(), require_token));
    Router::new()
        .route("/health", get(handlers::health))
        .merge(api)
        .fallback(|| async { ApiError::new(ErrorCode::NotFound, "no such route; see docs/api.md") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                ErrorCode::MethodNotAllowed,
                "this route does not take that method; see docs/api.md",
            )
        })
        .layer(TraceLayer::new_for_http())
        .with_state(state)
}

async fn require_token(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let presented = request
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        // The scheme name is case-insensitive (RFC 9110 §11.1).
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim());
    let ok = match presented {
        // ct_eq compares in time that depends only on the lengths.
        Some(token) => bool::from(token.as_bytes().ct_eq(state.token.as_bytes())),
        None => false,
    };
    if ok {
        next.run(request).await
    } else {
        ApiError::new(
            ErrorCode::Unauthorized,
            "missing or wrong bearer token (Authorization: Bearer <token>)",
        )
        .into_response()
    }
}

/// Serves `router` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use axum::serve::ListenerExt;
    // Small writes (an exec's last events, short JSON answers) must leave at
    // once: with Nagle's algorithm on, they wait out the peer's delayed ACK
    // and a 3 ms exec takes 45 ms.
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::warn!(error = %e, "could not set TCP_NODELAY");
        }
    });
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await
}
