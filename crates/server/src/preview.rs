//! The preview listener and port forwarding.
//!
//! The preview listener (`--preview-listen`) is a second HTTP server with
//! no bearer token: a request carries a signed preview token instead,
//! either in its path (`/p/{token}/...`, which is stripped before the run
//! sees it) or in the `runbox_preview` cookie that the first such answer
//! sets, so root-relative links (`/app.js`) of a page opened through the
//! URL work too. The request goes to the token's port inside the run,
//! connected from inside its network namespace; WebSocket (and any other)
//! upgrades pass through as raw bytes once the run answers 101. Every
//! request is audited.
//!
//! Port forwarding is an API route (with the API's token): an HTTP/1.1
//! upgrade to `runbox-tcp`, after which the connection carries the bytes
//! of one TCP connection to the guest port.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{ConnectInfo, RawQuery, Request, State};
use axum::http::header::{CONNECTION, COOKIE, HOST, LOCATION, SET_COOKIE, UPGRADE};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use hyper_util::rt::TokioIo;
use runbox_core::RunService;
use runbox_types::ErrorCode;

use crate::handlers::{AppJson, AppPath, RunId};
use crate::{ApiError, AppState};

/// The cookie a preview answer sets, so a page's root-relative requests
/// find their way.
pub const COOKIE_NAME: &str = "runbox_preview";

/// The upgrade protocol of the port-forward route.
pub const TUNNEL_PROTOCOL: &str = "runbox-tcp";

/// Each direction's buffer when splicing a tunnel or an upgraded
/// connection: tokio's default (8 KiB) costs a system call per 8 KiB and
/// holds a tunnel to well under 1 GB/s.
const SPLICE_BUFFER: usize = 256 * 1024;

/// Headers that belong to one hop and are not passed on (RFC 9110 §7.6.1),
/// besides those `Connection` names.
const HOP_BY_HOP: &[&str] = &[
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
];

/// What the preview listener's handler needs.
#[derive(Clone)]
pub struct PreviewState<S> {
    /// The service that checks tokens and connects into runs.
    pub service: S,
    /// Where accesses are recorded, if anywhere.
    pub audit: Option<Arc<runbox_proxy::audit::AuditLog>>,
}

/// The preview listener's router: every path is a preview request.
pub fn preview_router<S: RunService>(state: PreviewState<S>) -> Router {
    Router::new().fallback(proxy::<S>).with_state(state)
}

/// `POST /v1/runs/{id}/preview`: mints a preview URL.
pub async fn mint<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
    AppJson(req): AppJson<runbox_types::PreviewRequest>,
) -> Result<(StatusCode, Json<runbox_types::Preview>), ApiError> {
    Ok((
        StatusCode::CREATED,
        Json(state.service.mint_preview(id, req).await?),
    ))
}

/// Where a request's token is, and the path the run should see.
#[derive(Debug, PartialEq, Eq)]
struct Located {
    token: String,
    /// The path without `/p/{token}`; empty when the URL was exactly
    /// `/p/{token}` (answered with a redirect to `/p/{token}/`).
    path: String,
    /// The token came in the path (not the cookie).
    in_path: bool,
}

fn locate(uri: &Uri, headers: &HeaderMap) -> Option<Located> {
    let path = uri.path();
    if let Some(rest) = path.strip_prefix("/p/") {
        let (token, tail) = match rest.find('/') {
            Some(at) => (&rest[..at], &rest[at..]),
            None => (rest, ""),
        };
        return Some(Located {
            token: token.to_owned(),
            path: tail.to_owned(),
            in_path: true,
        });
    }
    cookie_token(headers).map(|token| Located {
        token,
        path: path.to_owned(),
        in_path: false,
    })
}

/// The `runbox_preview` cookie's value, if the request has one.
fn cookie_token(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| *name == COOKIE_NAME)
        .map(|(_, value)| value.to_owned())
}

/// The `Cookie` header without ours: the run never sees the token.
fn strip_cookie(headers: &mut HeaderMap) {
    let kept: Vec<String> = headers
        .get_all(COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .map(str::trim)
        .filter(|pair| !pair.is_empty() && !pair.starts_with(&format!("{COOKIE_NAME}=")))
        .map(str::to_owned)
        .collect();
    headers.remove(COOKIE);
    if !kept.is_empty() {
        if let Ok(value) = HeaderValue::from_str(&kept.join("; ")) {
            headers.insert(COOKIE, value);
        }
    }
}

fn is_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(UPGRADE)
        && headers
            .get_all(CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
}

/// Drops hop-by-hop headers; keeps `Connection: upgrade` and `Upgrade`
/// when the request is an upgrade, which must reach the run.
fn strip_hop_by_hop(headers: &mut HeaderMap, upgrade: bool) {
    let named: Vec<HeaderName> = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .filter(|name| !(upgrade && name == UPGRADE))
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(*name);
    }
    if upgrade {
        headers.insert(CONNECTION, HeaderValue::from_static("upgrade"));
    } else {
        headers.remove(CONNECTION);
        headers.remove(UPGRADE);
    }
}

async fn proxy<S: RunService>(
    State(state): State<PreviewState<S>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    request: Request,
) -> Response {
    let method = request.method().to_string();
    let Some(located) = locate(request.uri(), request.headers()) else {
        return ApiError::new(
            ErrorCode::PreviewDenied,
            "no preview token: open a URL minted by POST /v1/runs/{id}/preview",
        )
        .into_response();
    };
    let grant = match state.service.verify_preview(&located.token) {
        Ok(grant) => grant,
        Err(e) => return ApiError::from(e).into_response(),
    };
    let path = located.path.clone();
    // A run another node of the fleet holds: that node's API listener
    // serves the request (the preview key is the fleet's, so the token
    // was checked here as it would be there).
    let request = match elsewhere(&state, grant.run, request).await {
        Ok(response) => {
            audit_access(&state, grant, method, &path, response.status(), peer);
            return response;
        }
        Err(request) => request,
    };
    let response = if located.in_path && located.path.is_empty() {
        // `/p/{token}` itself: relative links need the trailing slash.
        let query = request
            .uri()
            .query()
            .map(|q| format!("?{q}"))
            .unwrap_or_default();
        let mut response = StatusCode::PERMANENT_REDIRECT.into_response();
        if let Ok(location) = HeaderValue::from_str(&format!("/p/{}/{query}", located.token)) {
            response.headers_mut().insert(LOCATION, location);
        }
        response
    } else {
        match forward(&state, grant, request, &located, peer).await {
            Ok(response) => response,
            Err(e) => e.into_response(),
        }
    };
    audit_access(&state, grant, method, &path, response.status(), peer);
    response
}

/// Where the API listener takes a preview request another node of the
/// fleet sent on (with its proof): the rest of the path is the preview
/// path as the client sent it.
pub(crate) const FLEET_PREVIEW_PREFIX: &str = "/v1/fleet/preview";

/// Sends preview `request` for run `id` to the run's node when another
/// node of the fleet holds it; the request back when this node serves it.
async fn elsewhere<S: RunService>(
    state: &PreviewState<S>,
    id: ulid::Ulid,
    request: Request,
) -> Result<Response, Request> {
    if !state.service.in_fleet() {
        return Err(request);
    }
    if !matches!(
        state.service.tenant_of(id),
        Err(runbox_core::CoreError::RunNotFound(_))
    ) {
        return Err(request);
    }
    let at = match state.service.locate(id, false).await {
        Ok(Some(at)) if at.gone => {
            return Ok(ApiError::from(runbox_core::fleet::node_gone(id, &at)).into_response())
        }
        Ok(Some(at)) => at,
        Ok(None) => return Err(request),
        Err(e) => return Ok(ApiError::from(e).into_response()),
    };
    let (mut parts, body) = request.into_parts();
    let original = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/");
    let Ok(uri) = format!("{FLEET_PREVIEW_PREFIX}{original}").parse::<Uri>() else {
        return Ok(
            ApiError::new(ErrorCode::BadRequest, "a preview path that is no URI").into_response(),
        );
    };
    parts.uri = uri;
    let request = Request::from_parts(parts, body);
    let Some(proof) = state
        .service
        .prove(&crate::forward::proof_subject(&request))
    else {
        return Err(request);
    };
    Ok(crate::forward::forward(id, &at, proof, request).await)
}

/// The API listener's side of [`elsewhere`]: a preview request another
/// node sent on, served here when its node proof holds.
pub(crate) async fn from_another_node<S: RunService>(
    State(app): State<AppState<S>>,
    request: Request,
) -> Response {
    let subject = crate::forward::proof_subject(&request);
    let proven = request
        .headers()
        .get(crate::forward::NODE_PROOF)
        .and_then(|p| p.to_str().ok())
        .is_some_and(|p| app.service.proven(&subject, p));
    let Some(peer) = crate::conn::peer(&request).filter(|_| proven) else {
        return ApiError::new(
            ErrorCode::Unauthorized,
            "this route takes preview requests another node of the fleet sends on, with its proof",
        )
        .into_response();
    };
    let (mut parts, body) = request.into_parts();
    let original = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .and_then(|p| p.strip_prefix(FLEET_PREVIEW_PREFIX))
        .unwrap_or("/")
        .to_owned();
    let Ok(uri) = original.parse::<Uri>() else {
        return ApiError::new(ErrorCode::BadRequest, "a preview path that is no URI")
            .into_response();
    };
    parts.uri = uri;
    parts.headers.remove(crate::forward::NODE_PROOF);
    let state = PreviewState {
        service: app.service.clone(),
        audit: app.audit.clone(),
    };
    proxy(
        State(state),
        ConnectInfo(peer),
        Request::from_parts(parts, body),
    )
    .await
}

/// Records one access to a run's port in the audit log, if there is one.
fn audit_access<S>(
    state: &PreviewState<S>,
    grant: runbox_core::preview::Grant,
    method: String,
    path: &str,
    status: StatusCode,
    peer: SocketAddr,
) {
    if let Some(audit) = state.audit.clone() {
        let record = runbox_proxy::audit::AuditRecord::Preview {
            t: runbox_proxy::audit::now(),
            run: grant.run.to_string(),
            port: grant.port,
            method,
            // Bounded: a path is the client's to choose.
            path: path.chars().take(512).collect(),
            status: status.as_u16(),
            client: peer.to_string(),
        };
        tokio::task::spawn_blocking(move || audit.append(&record));
    }
}

/// Relays one request to `port` of run `run` the way a preview does, for a
/// request that named the port by host (E2B's `<port>-<id>.<domain>`; the
/// caller decided it may): the whole path goes to the run, from inside its
/// network namespace, upgrades included, and the access is audited.
pub(crate) async fn relay_by_host<S: RunService>(
    state: PreviewState<S>,
    run: ulid::Ulid,
    port: u16,
    request: Request,
    peer: SocketAddr,
) -> Response {
    let grant = runbox_core::preview::Grant {
        run,
        port,
        expires: i64::MAX,
    };
    let method = request.method().to_string();
    let located = Located {
        token: String::new(),
        path: request.uri().path().to_owned(),
        in_path: false,
    };
    let response = match forward(&state, grant, request, &located, peer).await {
        Ok(response) => response,
        Err(e) => e.into_response(),
    };
    audit_access(
        &state,
        grant,
        method,
        &located.path,
        response.status(),
        peer,
    );
    response
}

/// Sends one request to the run and relays the answer (and, after a 101,
/// the upgraded connection).
async fn forward<S: RunService>(
    state: &PreviewState<S>,
    grant: runbox_core::preview::Grant,
    mut request: Request,
    located: &Located,
    peer: SocketAddr,
) -> Result<Response, ApiError> {
    let stream = state.service.dial(grant.run, u32::from(grant.port)).await?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| unreachable_error(grant, &e))?;
    tokio::spawn(async move {
        // Errors here end the one request; the answer already says so.
        let _ = connection.with_upgrades().await;
    });

    let upgrade = is_upgrade(request.headers());
    let client_side = upgrade.then(|| hyper::upgrade::on(&mut request));
    let query = request
        .uri()
        .query()
        .map(|q| format!("?{q}"))
        .unwrap_or_default();
    let target: Uri = format!("{}{query}", located.path)
        .parse()
        .map_err(|_| ApiError::new(ErrorCode::BadRequest, "the request path does not parse"))?;
    let host = request.headers().get(HOST).cloned();
    let headers = request.headers_mut();
    strip_cookie(headers);
    strip_hop_by_hop(headers, upgrade);
    headers.insert(
        HeaderName::from_static("x-forwarded-for"),
        HeaderValue::from_str(&peer.ip().to_string()).unwrap_or(HeaderValue::from_static("")),
    );
    headers.insert(
        HeaderName::from_static("x-forwarded-proto"),
        HeaderValue::from_static("http"),
    );
    if let Some(host) = host {
        headers.insert(HeaderName::from_static("x-forwarded-host"), host);
    }
    if located.in_path {
        if let Ok(prefix) = HeaderValue::from_str(&format!("/p/{}", located.token)) {
            headers.insert(HeaderName::from_static("x-forwarded-prefix"), prefix);
        }
    }
    *request.uri_mut() = target;
    *request.version_mut() = axum::http::Version::HTTP_11;

    let mut response = sender
        .send_request(request)
        .await
        .map_err(|e| unreachable_error(grant, &e))?;
    if response.status() == StatusCode::SWITCHING_PROTOCOLS {
        if let Some(client_side) = client_side {
            let run_side = hyper::upgrade::on(&mut response);
            tokio::spawn(async move {
                if let (Ok(client), Ok(run)) = tokio::join!(client_side, run_side) {
                    let _ = tokio::io::copy_bidirectional_with_sizes(
                        &mut TokioIo::new(client),
                        &mut TokioIo::new(run),
                        SPLICE_BUFFER,
                        SPLICE_BUFFER,
                    )
                    .await;
                }
            });
        }
    }
    let mut response = response.map(Body::new);
    if located.in_path {
        let max_age = grant.expires - time::OffsetDateTime::now_utc().unix_timestamp();
        let cookie = format!(
            "{COOKIE_NAME}={}; Path=/; Max-Age={}; HttpOnly; SameSite=Lax",
            located.token,
            max_age.max(0)
        );
        if let Ok(value) = HeaderValue::from_str(&cookie) {
            response.headers_mut().append(SET_COOKIE, value);
        }
    }
    Ok(response)
}

fn unreachable_error(grant: runbox_core::preview::Grant, e: &hyper::Error) -> ApiError {
    ApiError::new(
        ErrorCode::PortUnreachable,
        format!(
            "port {} in run {} did not answer as an HTTP server: {e}",
            grant.port, grant.run
        ),
    )
}

/// `GET /v1/runs/{id}/ports/{port}/connect` with `Upgrade: runbox-tcp`:
/// one TCP connection to the guest port, as raw bytes after the 101.
pub async fn tunnel<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
    AppPath(params): AppPath<Vec<(String, String)>>,
    RawQuery(query): RawQuery,
    mut request: Request,
) -> Result<Response, ApiError> {
    let offered = request
        .headers()
        .get(UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case(TUNNEL_PROTOCOL));
    if !is_upgrade(request.headers()) || !offered {
        return Err(ApiError::new(
            ErrorCode::BadRequest,
            format!(
                "this route is a tunnel: send Connection: Upgrade and Upgrade: {TUNNEL_PROTOCOL}"
            ),
        ));
    }
    let port = params
        .iter()
        .find(|(k, _)| k == "port")
        .map(|(_, v)| v.as_str())
        .unwrap_or("");
    let port: u32 = port.parse().map_err(|_| {
        ApiError::new(
            ErrorCode::BadPort,
            format!("port must be 1-65535, not {port:?}"),
        )
    })?;
    let mut pairs = crate::process::query_pairs(query.as_deref(), &["owner", "generation"])?;
    let credential = crate::process::credential(&mut pairs)?;
    // Connected before the upgrade: a closed port is a plain 502.
    let mut guest = state.service.open_port(id, port, credential).await?;
    let upgrade = hyper::upgrade::on(&mut request);
    tokio::spawn(async move {
        if let Ok(client) = upgrade.await {
            let _ = tokio::io::copy_bidirectional_with_sizes(
                &mut TokioIo::new(client),
                &mut guest,
                SPLICE_BUFFER,
                SPLICE_BUFFER,
            )
            .await;
        }
    });
    let mut response = StatusCode::SWITCHING_PROTOCOLS.into_response();
    response
        .headers_mut()
        .insert(CONNECTION, HeaderValue::from_static("upgrade"));
    response
        .headers_mut()
        .insert(UPGRADE, HeaderValue::from_static(TUNNEL_PROTOCOL));
    Ok(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (k, v) in pairs {
            map.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        map
    }

    #[test]
    fn the_token_is_found_in_the_path_or_the_cookie() {
        let uri: Uri = "/p/TOKEN/app/x.js?v=1".parse().unwrap();
        assert_eq!(
            locate(&uri, &HeaderMap::new()),
            Some(Located {
                token: "TOKEN".into(),
                path: "/app/x.js".into(),
                in_path: true
            })
        );
        let uri: Uri = "/p/TOKEN".parse().unwrap();
        assert_eq!(locate(&uri, &HeaderMap::new()).unwrap().path, "");
        let uri: Uri = "/app.js".parse().unwrap();
        let with_cookie = headers(&[("cookie", "a=1; runbox_preview=T2; b=2")]);
        assert_eq!(
            locate(&uri, &with_cookie),
            Some(Located {
                token: "T2".into(),
                path: "/app.js".into(),
                in_path: false
            })
        );
        assert_eq!(locate(&uri, &HeaderMap::new()), None);
    }

    #[test]
    fn the_run_never_sees_the_token_cookie_or_hop_by_hop_headers() {
        let mut map = headers(&[
            ("cookie", "a=1; runbox_preview=SECRET"),
            ("cookie", "b=2"),
            ("connection", "keep-alive, x-private"),
            ("x-private", "1"),
            ("keep-alive", "timeout=5"),
            ("te", "trailers"),
            ("accept", "*/*"),
        ]);
        strip_cookie(&mut map);
        strip_hop_by_hop(&mut map, false);
        assert_eq!(map.get(COOKIE).unwrap(), "a=1; b=2");
        for gone in ["connection", "x-private", "keep-alive", "te"] {
            assert!(!map.contains_key(gone), "{gone}");
        }
        assert_eq!(map.get("accept").unwrap(), "*/*");
        let mut only_ours = headers(&[("cookie", "runbox_preview=SECRET")]);
        strip_cookie(&mut only_ours);
        assert!(!only_ours.contains_key(COOKIE));
    }

    #[test]
    fn an_upgrade_keeps_its_headers() {
        let mut map = headers(&[
            ("connection", "Upgrade"),
            ("upgrade", "websocket"),
            ("sec-websocket-key", "x"),
        ]);
        assert!(is_upgrade(&map));
        strip_hop_by_hop(&mut map, true);
        assert_eq!(map.get(UPGRADE).unwrap(), "websocket");
        assert_eq!(map.get(CONNECTION).unwrap(), "upgrade");
        assert!(map.contains_key("sec-websocket-key"));
    }
}
