//! The E2B-compatible surface: the unmodified E2B SDKs drive runbox.
//!
//! Two halves, both on the runbox listener:
//! - the control plane (`control`): `/sandboxes`, `/v2/sandboxes`, ... with
//!   the runbox token as `X-API-Key`; a sandbox is a run.
//! - envd (`envd`): what the SDKs reach on a sandbox's own URL, the Connect
//!   services `process.Process` and `filesystem.Filesystem`, `/files`,
//!   `/health` and `/envs`. A request is envd's when it names a sandbox,
//!   by the `E2b-Sandbox-Id` header (so `E2B_SANDBOX_URL` can point every
//!   sandbox at this one address) or by a `49983-<id>.<domain>` host; it
//!   authenticates with the sandbox's own access token (`X-Access-Token`),
//!   which the create answer carries and which opens that sandbox only.
//!
//! Everything here calls the [`RunService`] like the runbox API does; no
//! lifecycle logic lives here. docs/e2b.md says what is served and what
//! answers 501.

mod caller;
mod connect;
mod control;
mod envd;
mod network;
mod templates;
mod volumes;
mod wire;

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use base64::Engine;
use hmac::{Hmac, Mac};
use runbox_core::RunService;
use sha2::Sha256;
use tower::ServiceExt;
use ulid::Ulid;

use crate::AppState;

pub use control::routes as control_routes;
pub use templates::upload_routes as template_upload_routes;
pub use volumes::content_routes as volume_content_routes;

/// The port E2B's SDKs address envd on, in a sandbox's host name.
pub const ENVD_PORT: u16 = 49983;

/// The envd version runbox reports: the SDKs enable what this version has
/// (stdin control, closing stdin, octet-stream uploads, file metadata,
/// entries in watch events, watches on network mounts) and send no user
/// unless the caller names one.
pub const ENVD_VERSION: &str = "0.6.4";

/// The header naming the sandbox a request is for.
const SANDBOX_ID_HEADER: &str = "e2b-sandbox-id";

/// The header carrying a sandbox's access token.
const ACCESS_TOKEN_HEADER: &str = "x-access-token";

/// The sandbox an envd request is for, resolved by [`dispatch`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct SandboxId(pub Ulid);

/// A sandbox's envd access token: its run token (see [`crate::auth`]),
/// so it opens that sandbox only, on runbox's API as on envd's.
pub(crate) fn access_token(daemon_token: &str, id: Ulid) -> String {
    crate::auth::run_token(daemon_token, id)
}

/// An HMAC of a sandbox's id under the daemon token, kept apart by
/// `purpose`: one key derivation per kind of token.
fn sandbox_token(daemon_token: &str, purpose: &[u8], id: Ulid) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(daemon_token.as_bytes())
        .expect("HMAC accepts any key length");
    mac.update(purpose);
    mac.update(id.to_string().as_bytes());
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes())
}

/// An envd-shaped error: `{"code": <status>, "message": ...}`.
pub(crate) fn envd_error(status: StatusCode, message: impl Into<String>) -> Response {
    let body = serde_json::json!({ "code": status.as_u16(), "message": message.into() });
    (status, axum::Json(body)).into_response()
}

/// The header carrying a sandbox's traffic access token: what opens the
/// ports of a sandbox whose ports are not public.
const TRAFFIC_TOKEN_HEADER: &str = "e2b-traffic-access-token";

/// A sandbox's traffic access token, as [`access_token`] but for its ports.
pub(crate) fn traffic_token(daemon_token: &str, id: Ulid) -> String {
    sandbox_token(daemon_token, b"runbox e2b traffic access\0", id)
}

/// Which sandbox, and which of its ports, a request names, if any:
/// `Some(Err)` for a name that does not parse. The `E2b-Sandbox-Id` header
/// names envd's port.
fn named_sandbox(headers: &HeaderMap) -> Option<Result<(Ulid, u16), String>> {
    if let Some(value) = headers.get(SANDBOX_ID_HEADER) {
        let raw = value.to_str().unwrap_or("");
        return Some(
            runbox_types::parse_id(raw.trim())
                .map(|id| (id, ENVD_PORT))
                .ok_or_else(|| format!("E2b-Sandbox-Id {raw:?} is not a sandbox id")),
        );
    }
    // `<port>-<id>.<domain>`: only hosts whose first label has that shape.
    let host = headers.get(axum::http::header::HOST)?.to_str().ok()?;
    let label = host.split('.').next()?;
    let (port, id) = label.split_once('-')?;
    let port: u16 = port.parse().ok()?;
    let id = runbox_types::parse_id(id)?;
    if port == 0 {
        return Some(Err("port 0 is no port; name 1 to 65535".to_owned()));
    }
    Some(Ok((id, port)))
}

/// What [`dispatch`] routes with: envd's router, and the app for the
/// sandboxes a signed file URL may be for.
#[derive(Clone)]
pub struct Dispatch<S> {
    pub envd: Router,
    pub app: AppState<S>,
}

/// Sends a control-plane request for a sandbox another node of the fleet
/// holds (`/sandboxes/{id}...`, `/v2/sandboxes/{id}...`) to that node,
/// which checks the caller's key itself; the rest go on.
pub(crate) async fn fleet_hop<S: RunService>(
    State(app): State<AppState<S>>,
    request: Request,
    next: Next,
) -> Response {
    let named = {
        let mut segments = request.uri().path().trim_start_matches('/').split('/');
        let first = segments.next();
        let sandboxes = match first {
            Some("v2") => segments.next(),
            other => other,
        };
        match (sandboxes, segments.next()) {
            (Some("sandboxes"), Some(id)) => runbox_types::parse_id(id),
            _ => None,
        }
    };
    let Some(id) = named else {
        return next.run(request).await;
    };
    match crate::forward::elsewhere(&app.service, id, request).await {
        Ok(answered) => answered,
        Err(request) => next.run(request).await,
    }
}

/// Sends a request that names a sandbox to envd, and a signed file URL
/// that names none (the SDKs' URLs when `E2B_SANDBOX_URL` is set) to the
/// sandbox whose access token signed it; the rest go on.
pub(crate) async fn dispatch<S: RunService>(
    State(d): State<Dispatch<S>>,
    mut request: Request,
    next: Next,
) -> Response {
    // A sandbox another node of the fleet holds: its node answers.
    if let Some(Ok((id, _))) = named_sandbox(request.headers()) {
        request = match crate::forward::elsewhere(&d.app.service, id, request).await {
            Ok(answered) => return answered,
            Err(request) => request,
        };
    }
    let id = match named_sandbox(request.headers()) {
        Some(Ok((id, ENVD_PORT))) => id,
        Some(Ok((id, port))) => return port_request(&d.app, id, port, request).await,
        Some(Err(message)) => return envd_error(StatusCode::BAD_REQUEST, message),
        None => match signed_file_url(&request) {
            None => return next.run(request).await,
            Some(signed) => match signer(&d.app, &signed).await {
                Some(id) => {
                    // Signed by a sandbox another node holds: its node
                    // answers (and finds the signer itself).
                    request = match crate::forward::elsewhere(&d.app.service, id, request).await {
                        Ok(answered) => return answered,
                        Err(request) => request,
                    };
                    id
                }
                None => return envd_error(StatusCode::UNAUTHORIZED, "invalid signature"),
            },
        },
    };
    request.extensions_mut().insert(SandboxId(id));
    match d.envd.oneshot(request).await {
        Ok(response) => response,
        Err(never) => match never {},
    }
}

/// A request to a sandbox's port, by host: relayed when the sandbox's
/// ports are public (E2B's default) or the request carries its traffic
/// access token, as on E2B; refused otherwise.
async fn port_request<S: RunService>(
    app: &AppState<S>,
    id: Ulid,
    port: u16,
    mut request: Request,
) -> Response {
    use subtle::ConstantTimeEq;
    let run = match app.service.get(id) {
        Ok(run) if takes_traffic(&run) => run,
        // E2B's proxy answers a sandbox that is gone with this shape.
        _ => {
            let body = serde_json::json!({
                "code": 502,
                "message": "The sandbox was not found",
                "sandboxId": id.to_string(),
            });
            return (StatusCode::BAD_GATEWAY, axum::Json(body)).into_response();
        }
    };
    let presented = request
        .headers_mut()
        .remove(TRAFFIC_TOKEN_HEADER)
        .map(|v| v.as_bytes().to_vec())
        .unwrap_or_default();
    let token_ok = bool::from(presented.ct_eq(traffic_token(&app.token, id).as_bytes()));
    if !run.public_ports && !token_ok {
        return envd_error(
            StatusCode::FORBIDDEN,
            format!("the ports of sandbox {id} are not public: send its traffic access token as {TRAFFIC_TOKEN_HEADER}"),
        );
    }
    let Some(peer) = crate::conn::peer(&request) else {
        return envd_error(
            StatusCode::MISDIRECTED_REQUEST,
            "sandbox ports are served on the API listener",
        );
    };
    let state = crate::preview::PreviewState {
        service: app.service.clone(),
        audit: app.audit.clone(),
    };
    crate::preview::relay_by_host(state, id, port, request, peer).await
}

/// A file URL's signature and what it signs (E2B's v1 scheme): the `path`
/// and `username` query values as sent, the operation (`read` for GET,
/// `write` for POST) and the expiry, if any.
#[derive(Debug, PartialEq)]
struct SignedFileUrl {
    signature: String,
    path: String,
    user: String,
    operation: &'static str,
    expiration: Option<String>,
}

/// The signature a `/files` request carries, if any.
fn signed_file_url(request: &Request) -> Option<SignedFileUrl> {
    if request.uri().path() != "/files" {
        return None;
    }
    let operation = match *request.method() {
        axum::http::Method::GET => "read",
        axum::http::Method::POST => "write",
        _ => return None,
    };
    let mut signed = SignedFileUrl {
        signature: String::new(),
        path: String::new(),
        user: String::new(),
        operation,
        expiration: None,
    };
    let query = request.uri().query()?;
    for (key, value) in form_urlencoded::parse(query.as_bytes()) {
        match key.as_ref() {
            "signature" => signed.signature = value.into_owned(),
            "path" => signed.path = value.into_owned(),
            "username" => signed.user = value.into_owned(),
            "signature_expiration" => signed.expiration = Some(value.into_owned()),
            _ => {}
        }
    }
    (!signed.signature.is_empty()).then_some(signed)
}

/// The v1 signature of a file URL under a sandbox's access token:
/// `v1_` and the unpadded base64 of SHA-256 over
/// `path:operation:user:token[:expiration]`.
fn file_signature(signed: &SignedFileUrl, token: &str) -> String {
    use sha2::Digest;
    let mut raw = format!(
        "{}:{}:{}:{token}",
        signed.path, signed.operation, signed.user
    );
    if let Some(expiration) = &signed.expiration {
        raw.push(':');
        raw.push_str(expiration);
    }
    let digest = Sha256::digest(raw.as_bytes());
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest)
    )
}

/// Whether `signed` was signed with sandbox `id`'s access token.
fn signed_by(token: &str, id: Ulid, signed: &SignedFileUrl) -> bool {
    use subtle::ConstantTimeEq;
    let expected = file_signature(signed, &access_token(token, id));
    bool::from(expected.as_bytes().ct_eq(signed.signature.as_bytes()))
}

/// Whether E2B traffic (envd calls, ports, signed file URLs) reaches a
/// run: a running one, or a paused one that resumes on traffic (E2B's
/// `autoResume`; runbox's core resumes it when the call arrives). A paused
/// sandbox without it answers as E2B's does for a sandbox that is not
/// running.
fn takes_traffic(run: &runbox_types::Run) -> bool {
    match run.status {
        runbox_types::RunStatus::Running => true,
        runbox_types::RunStatus::Paused
        | runbox_types::RunStatus::Hibernated
        | runbox_types::RunStatus::Archived => run.auto_resume,
        _ => false,
    }
}

/// The running sandbox whose access token signed `signed`: one SHA-256
/// per running sandbox, so a URL needs no sandbox name.
async fn signer<S: RunService>(app: &AppState<S>, signed: &SignedFileUrl) -> Option<Ulid> {
    let find = |runs: Vec<runbox_types::Run>| {
        runs.into_iter()
            .filter(takes_traffic)
            .map(|r| r.id)
            .find(|id| signed_by(&app.token, *id, signed))
    };
    if let Some(id) = find(app.service.list()) {
        return Some(id);
    }
    // On a node of a fleet, the other nodes' sandboxes (from the catalog;
    // access tokens are the fleet's, so any node checks a signature).
    if !app.service.in_fleet() {
        return None;
    }
    find(app.service.list_fleet().await.ok()?)
}

/// The answer to a signed file URL that must be refused, if it must: a
/// signature that is not this sandbox's, or one past its expiry.
fn check_signed(token: &str, id: Ulid, signed: &SignedFileUrl) -> Option<Response> {
    if !signed_by(token, id, signed) {
        return Some(envd_error(StatusCode::UNAUTHORIZED, "invalid signature"));
    }
    let expiration = signed.expiration.as_deref()?;
    let Ok(expiration) = expiration.parse::<i64>() else {
        return Some(envd_error(
            StatusCode::BAD_REQUEST,
            "signature_expiration must be a Unix time in seconds",
        ));
    };
    (time::OffsetDateTime::now_utc().unix_timestamp() > expiration)
        .then(|| envd_error(StatusCode::UNAUTHORIZED, "signature is already expired"))
}

/// The prefix E2B's keys carry. SDK releases of mid-2026 refuse, before
/// sending anything, a key that is not `e2b_` followed by hex; runbox's
/// token is hex, so `e2b_<token>` passes their check and is taken here as
/// the token itself.
const API_KEY_PREFIX: &str = "e2b_";

/// The key a control-plane request presents: `X-API-Key` or a bearer token.
fn presented_api_key(headers: &HeaderMap) -> Option<&str> {
    headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .or_else(|| crate::bearer(headers))
}

/// The caller an API key names: the root or a tenant token, bare or
/// after `e2b_`. A run token is not an API key.
fn api_key_caller(
    presented: Option<&str>,
    authenticate: impl Fn(&str) -> Option<crate::auth::Caller>,
) -> Option<crate::auth::Caller> {
    let presented = presented?;
    let stripped = presented.strip_prefix(API_KEY_PREFIX);
    [Some(presented), stripped]
        .into_iter()
        .flatten()
        .find_map(|key| match authenticate(key)? {
            crate::auth::Caller::Run(_) => None,
            caller => Some(caller),
        })
}

/// The sandbox a control-plane route names (`/sandboxes/{id}...`,
/// `/v2/sandboxes/{id}...`): `None` for a route that names none, else the
/// router's percent-decoded `{id}` parsed as a run id, or the E2B-shaped
/// 404 for one that does not parse.
async fn route_sandbox<S: Send + Sync>(
    parts: &mut axum::http::request::Parts,
    state: &S,
) -> Result<Option<Ulid>, Response> {
    use axum::extract::{FromRequestParts, MatchedPath, Path};
    let names_one = parts.extensions.get::<MatchedPath>().is_some_and(|route| {
        let route = route.as_str();
        route
            .strip_prefix("/v2")
            .unwrap_or(route)
            .starts_with("/sandboxes/{id}")
    });
    if !names_one {
        return Ok(None);
    }
    let Path(params) = Path::<Vec<(String, String)>>::from_request_parts(parts, state)
        .await
        .map_err(|e| envd_error(StatusCode::BAD_REQUEST, e.body_text()))?;
    let raw = params
        .iter()
        .find(|(k, _)| k == "id")
        .map_or("", |(_, v)| v.as_str());
    match runbox_types::parse_id(raw) {
        Some(id) => Ok(Some(id)),
        None => Err(envd_error(
            StatusCode::NOT_FOUND,
            format!(
                "sandbox {:?} was not found (runbox sandbox ids are run ids)",
                raw.chars().take(64).collect::<String>()
            ),
        )),
    }
}

/// Checks the control plane's API key (`X-API-Key`, as the SDKs send it,
/// or a bearer token): the root token or a tenant's, bare or as
/// `e2b_<token>`. A tenant reaches its own sandboxes only: another's is
/// not found. Refusals are E2B-shaped.
pub(crate) async fn require_api_key<S: RunService>(
    State(state): State<AppState<S>>,
    request: Request,
    next: Next,
) -> Response {
    let presented = presented_api_key(request.headers());
    let Some(caller) = api_key_caller(presented, |key| {
        crate::auth::authenticate(&state, Some(key))
    }) else {
        return envd_error(
            StatusCode::UNAUTHORIZED,
            "missing or wrong API key: send the runbox token (or a tenant's), or e2b_ followed by it, as X-API-Key (E2B_API_KEY)",
        );
    };
    // The sandbox is read from the router's decoded parameter, the value
    // the handler acts on (see [`crate::auth::AdmittedRun`]).
    let (mut parts, body) = request.into_parts();
    let sandbox = route_sandbox(&mut parts, &state).await;
    let mut request = Request::from_parts(parts, body);
    let sandbox = match sandbox {
        Ok(sandbox) => sandbox,
        Err(refused) => return refused,
    };
    if let (Some(tenant), Some(id)) = (caller.tenant(), sandbox) {
        let owned = state
            .service
            .tenant_of(id)
            .is_ok_and(|stamp| stamp.as_deref() == Some(tenant));
        if !owned {
            return envd_error(StatusCode::NOT_FOUND, format!("sandbox {id} was not found"));
        }
    }
    let name = crate::auth::AuditCaller(caller.audit_name());
    let tenant = match sandbox {
        Some(id) => state.service.tenant_of(id).ok().flatten(),
        None => caller.tenant().map(str::to_owned),
    };
    request.extensions_mut().insert(caller);
    if let Some(id) = sandbox {
        request
            .extensions_mut()
            .insert(crate::auth::AdmittedRun(id));
    }
    let mut response = next.run(request).await;
    response.extensions_mut().insert(name);
    response
        .extensions_mut()
        .insert(crate::auth::AuditTenant(tenant));
    if let Some(id) = sandbox {
        response
            .extensions_mut()
            .insert(crate::auth::AdmittedRun(id));
    }
    response
}

/// Checks an envd request's access token, and that its sandbox exists
/// (a gone sandbox answers 502 "... was not found", as the SDKs expect).
async fn require_access<S: RunService>(
    State(state): State<AppState<S>>,
    request: Request,
    next: Next,
) -> Response {
    let Some(SandboxId(id)) = request.extensions().get::<SandboxId>().copied() else {
        return envd_error(StatusCode::BAD_REQUEST, "name the sandbox (E2b-Sandbox-Id)");
    };
    let presented = request
        .headers()
        .get(ACCESS_TOKEN_HEADER)
        .and_then(|v| v.to_str().ok());
    if let (None, Some(signed)) = (presented, signed_file_url(&request)) {
        // A signed file URL stands in for the token, for its one file and
        // operation.
        if let Some(refused) = check_signed(&state.token, id, &signed) {
            return refused;
        }
    } else {
        // The sandbox's own token, the root token, or its tenant's.
        let ok = match crate::auth::authenticate(&state, presented) {
            Some(crate::auth::Caller::Root) => true,
            Some(crate::auth::Caller::Run(run)) => run == id,
            Some(crate::auth::Caller::Tenant(t)) => state
                .service
                .tenant_of(id)
                .is_ok_and(|stamp| stamp.as_deref() == Some(t.name.as_str())),
            None => false,
        };
        if !ok {
            return envd_error(
                StatusCode::UNAUTHORIZED,
                "missing or wrong X-Access-Token for this sandbox",
            );
        }
    }
    match state.service.get(id) {
        Ok(run) if takes_traffic(&run) => next.run(request).await,
        Ok(_) => envd_error(
            StatusCode::BAD_GATEWAY,
            format!("The sandbox {id} is not running"),
        ),
        Err(_) => envd_error(
            StatusCode::BAD_GATEWAY,
            format!("The sandbox {id} was not found"),
        ),
    }
}

/// The envd router, with its state; [`dispatch`] hands it requests.
pub fn envd_router<S: RunService>(state: AppState<S>) -> Router {
    let watchers = Arc::new(envd::Watchers::default());
    envd::routes(envd::Envd {
        app: state.clone(),
        watchers,
    })
    .route_layer(axum::middleware::from_fn_with_state(
        state,
        require_access::<S>,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn sandboxes_are_named_by_header_or_host() {
        let id = Ulid::new();
        let mut h = HeaderMap::new();
        assert!(named_sandbox(&h).is_none());
        h.insert("host", HeaderValue::from_static("127.0.0.1:8080"));
        assert!(named_sandbox(&h).is_none());
        h.insert(
            "host",
            HeaderValue::from_str(&format!(
                "49983-{}.sandbox.example",
                id.to_string().to_lowercase()
            ))
            .unwrap(),
        );
        assert_eq!(named_sandbox(&h).unwrap().unwrap(), (id, ENVD_PORT));
        h.insert(
            "host",
            HeaderValue::from_str(&format!("3000-{id}.sandbox.example")).unwrap(),
        );
        assert_eq!(named_sandbox(&h).unwrap().unwrap(), (id, 3000));
        h.insert(
            "host",
            HeaderValue::from_str(&format!("0-{id}.sandbox.example")).unwrap(),
        );
        assert!(named_sandbox(&h).unwrap().is_err());
        h.insert(SANDBOX_ID_HEADER, HeaderValue::from_static("nope"));
        assert!(named_sandbox(&h).unwrap().is_err());
        h.insert(
            SANDBOX_ID_HEADER,
            HeaderValue::from_str(&id.to_string()).unwrap(),
        );
        assert_eq!(named_sandbox(&h).unwrap().unwrap(), (id, ENVD_PORT));
    }

    #[test]
    fn api_keys_may_carry_e2bs_prefix() {
        let mut h = HeaderMap::new();
        assert_eq!(presented_api_key(&h), None);
        h.insert("x-api-key", HeaderValue::from_static(" e2b_00ff "));
        assert_eq!(presented_api_key(&h), Some("e2b_00ff"));
        h.remove("x-api-key");
        h.insert("authorization", HeaderValue::from_static("Bearer e2b_abc"));
        assert_eq!(presented_api_key(&h), Some("e2b_abc"));
        let root =
            |key: &str| (key == "00ff" || key == "e2b_x").then_some(crate::auth::Caller::Root);
        let matches = |presented: Option<&str>| api_key_caller(presented, root).is_some();
        assert!(matches(Some("e2b_00ff")));
        assert!(matches(Some("00ff")));
        assert!(matches(Some("e2b_x")));
        assert!(!matches(Some("e2b_")));
        assert!(!matches(Some("e2b_00fe")));
        assert!(!matches(Some("e2b_e2b_00ff")));
        assert!(!matches(None));
        // A run token is not an API key.
        let run = |_: &str| Some(crate::auth::Caller::Run(Ulid::new()));
        assert!(api_key_caller(Some("e2b_00ff"), run).is_none());
    }

    #[test]
    fn file_url_signatures_are_e2bs_v1() {
        let signed = |path: &str, user: &str, expiration: Option<&str>| SignedFileUrl {
            signature: String::new(),
            path: path.into(),
            user: user.into(),
            operation: "read",
            expiration: expiration.map(str::to_owned),
        };
        // sha256("a.txt:read:user:tok"), base64 without padding, as E2B's
        // SDKs compute it.
        assert_eq!(
            file_signature(&signed("a.txt", "user", None), "tok"),
            "v1_wPjHOh/p+K3FbqiyGd5vwPNc/g4IPd8sigMxb1gqu9I"
        );
        let id = Ulid::new();
        let mut url = signed("a.txt", "", Some("4102444800"));
        url.signature = file_signature(&url, &access_token("daemon", id));
        assert!(signed_by("daemon", id, &url));
        assert!(check_signed("daemon", id, &url).is_none());
        assert!(!signed_by("daemon", Ulid::new(), &url));
        assert!(!signed_by("other", id, &url));
        url.operation = "write";
        assert!(!signed_by("daemon", id, &url), "a read URL does not write");
        let mut old = signed("a.txt", "", Some("1"));
        old.signature = file_signature(&old, &access_token("daemon", id));
        assert_eq!(
            check_signed("daemon", id, &old).unwrap().status(),
            StatusCode::UNAUTHORIZED
        );
    }

    #[test]
    fn access_tokens_are_per_sandbox() {
        let (a, b) = (Ulid::new(), Ulid::new());
        assert_eq!(access_token("t", a), access_token("t", a));
        assert_ne!(access_token("t", a), access_token("t", b));
        assert_ne!(access_token("t", a), access_token("u", a));
    }
}
