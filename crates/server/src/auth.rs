//! Who is calling, and what they may reach.
//!
//! Three kinds of token open the API: the **root** token (the daemon's,
//! `<state>/token`) opens everything; a **tenant** token (made through
//! `/v1/tenants`, kept only as a hash) opens the tenant's own runs,
//! snapshots and checkpoints and the shared routes; a **run** token
//! (answered by a create) drives one run: its exec, files, processes,
//! sessions and previews. A run token is an HMAC of the run's id under the
//! root token, so it needs no storage and ends with its run (or with a new
//! root token).
//!
//! [`rule`] says, for each route, which callers it takes; [`require`]
//! enforces it once for every route, so no handler can forget. A tenant
//! asking for another tenant's run gets the same 404 as for a run that
//! does not exist; a valid token on a route that is not its own is 403; a
//! missing or wrong token is 401.

use std::sync::Arc;

use axum::extract::{MatchedPath, Request, State};
use axum::http::Method;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use base64::Engine;
use hmac::{Hmac, Mac};
use runbox_core::tenants::{Owner, TenantEntry};
use runbox_core::RunService;
use runbox_types::ErrorCode;
use sha2::Sha256;
use subtle::ConstantTimeEq;
use ulid::Ulid;

use crate::{ApiError, AppState};

/// Who a request is from.
#[derive(Clone, Debug)]
pub enum Caller {
    /// The operator.
    Root,
    /// A tenant.
    Tenant(Arc<TenantEntry>),
    /// The holder of one run's token.
    Run(Ulid),
}

impl Caller {
    /// Who a create by this caller is for.
    pub fn owner(&self) -> Owner {
        match self {
            Caller::Tenant(t) => Owner(Some(t.clone())),
            Caller::Root | Caller::Run(_) => Owner::root(),
        }
    }

    /// Whether the caller may see something stamped with tenant `stamp`.
    pub fn sees(&self, stamp: Option<&str>) -> bool {
        match self {
            Caller::Root => true,
            Caller::Tenant(t) => stamp == Some(t.name.as_str()),
            Caller::Run(_) => false,
        }
    }

    /// The tenant, if the caller is one.
    pub fn tenant(&self) -> Option<&str> {
        match self {
            Caller::Tenant(t) => Some(&t.name),
            _ => None,
        }
    }

    /// How the audit log names the caller (never a token).
    pub fn audit_name(&self) -> String {
        match self {
            Caller::Root => "root".to_owned(),
            Caller::Tenant(t) => format!("tenant:{}", t.name),
            Caller::Run(id) => format!("run:{id}"),
        }
    }
}

/// The prefix of a run token.
pub const RUN_TOKEN_PREFIX: &str = "run_";

/// Run `id`'s token: `run_<id>_<HMAC-SHA256 of the id under the root
/// token, base64url>`.
pub fn run_token(root: &str, id: Ulid) -> String {
    format!("{RUN_TOKEN_PREFIX}{id}_{}", run_mac(root, id))
}

fn run_mac(root: &str, id: Ulid) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(root.as_bytes()).expect("any key length");
    mac.update(b"runbox run token\0");
    mac.update(id.to_string().as_bytes());
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes())
}

/// The run a presented run token opens, if it is one and its MAC holds.
pub fn run_of_token(root: &str, presented: &str) -> Option<Ulid> {
    let rest = presented.strip_prefix(RUN_TOKEN_PREFIX)?;
    let (id, mac) = (rest.get(..26)?, rest.get(26..)?.strip_prefix('_')?);
    let id = runbox_types::parse_id(id)?;
    let expected = run_mac(root, id);
    bool::from(mac.as_bytes().ct_eq(expected.as_bytes())).then_some(id)
}

/// The caller a presented token names, if any.
pub fn authenticate<S: RunService>(state: &AppState<S>, presented: Option<&str>) -> Option<Caller> {
    let presented = presented?;
    if crate::token_matches(Some(presented), &state.token) {
        return Some(Caller::Root);
    }
    if presented.starts_with(RUN_TOKEN_PREFIX) {
        return run_of_token(&state.token, presented).map(Caller::Run);
    }
    state
        .service
        .tenants()
        .authenticate(presented)
        .map(Caller::Tenant)
}

/// Which callers a route takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// The root token only.
    Root,
    /// Root or a tenant (the handler keeps a tenant to its own things).
    Tenant,
    /// Root, the run's tenant, or the run's own token.
    Run,
    /// Root or the run's tenant.
    RunOwner,
}

/// The rule of a route (its matched path and method).
pub fn rule(method: &Method, path: &str) -> Rule {
    let Some(rest) = path.strip_prefix(RUN_ROUTE) else {
        return match path {
            "/v1/tenants" | "/v1/tenants/{name}" | "/v1/tenants/{name}/rotate" => Rule::Root,
            "/v1/pools" | "/v1/drain" | "/v1/info" | "/v1/cluster" | "/v1/config/reload"
            | "/metrics" | "/v1/audit" => Rule::Root,
            // An import is the operator's; a delete of a shared image is
            // refused to tenants by the handler.
            "/v1/images/{name}" if method == Method::POST => Rule::Root,
            _ => Rule::Tenant,
        };
    };
    let driven = [
        "/exec",
        "/exec/ws",
        "/fs/",
        "/files/",
        "/processes",
        "/preview",
        "/ports/",
    ];
    if rest == "/move" {
        // Where a run lives is the operator's to choose.
        return Rule::Root;
    }
    // A run's history is driven like its files (the agent in it may undo
    // its own commands); a fork of a point makes runs, as a fork does.
    if rest.starts_with("/history") && !rest.ends_with("/fork") || rest == "/rollback" {
        return Rule::Run;
    }
    if rest.is_empty() {
        if method == Method::GET {
            Rule::Run
        } else {
            Rule::RunOwner
        }
    } else if driven.iter().any(|p| rest.starts_with(p)) || rest == "/warm" {
        Rule::Run
    } else {
        Rule::RunOwner
    }
}

/// The run a request was admitted to: its route's `{id}` as the router
/// percent-decoded it, parsed once by [`require`] and checked against the
/// caller there. It is the only way a handler learns which run a request
/// names ([`crate::handlers::RunId`] reads it), so the run a handler acts
/// on is always the run that was authorised.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AdmittedRun(pub Ulid);

/// The run a `/v1/runs/{id}...` request names: the router's decoded `{id}`
/// parsed as a ULID (Crockford base32, so case does not matter). An id
/// that does not parse names no run: 404 for every caller, before any
/// handler runs.
pub(crate) async fn route_run<S: Send + Sync>(
    parts: &mut axum::http::request::Parts,
    state: &S,
) -> Result<Ulid, ApiError> {
    use axum::extract::FromRequestParts;
    let crate::handlers::AppPath(params) =
        crate::handlers::AppPath::<Vec<(String, String)>>::from_request_parts(parts, state).await?;
    let raw = params
        .iter()
        .find(|(k, _)| k == "id")
        .map(|(_, v)| v.as_str())
        .unwrap_or("");
    runbox_types::parse_id(raw).ok_or_else(|| {
        ApiError::new(
            ErrorCode::RunNotFound,
            format!(
                "no run with id {:?} (run ids are ULIDs)",
                raw.chars().take(64).collect::<String>()
            ),
        )
    })
}

/// Authenticates every API request and enforces its route's [`Rule`];
/// the [`Caller`] goes into the request's extensions for the handler.
pub(crate) async fn require<S: RunService>(
    State(state): State<AppState<S>>,
    mut request: Request,
    next: Next,
) -> Response {
    let headers = request.headers();
    let presented = crate::bearer(headers).or_else(|| crate::ws_protocol_token(headers));
    let Some(caller) = authenticate(&state, presented) else {
        return ApiError::new(
            ErrorCode::Unauthorized,
            "missing or wrong bearer token (Authorization: Bearer <token>)",
        )
        .into_response();
    };
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_default();
    // The run is read from the router's decoded parameter, the same value
    // the handler will act on (never from the raw path, where `%30...` is
    // not an id but decodes to one).
    let run = if route.starts_with(RUN_ROUTE) {
        let (mut parts, body) = request.into_parts();
        let parsed = route_run(&mut parts, &state).await;
        request = Request::from_parts(parts, body);
        match parsed {
            Ok(id) => Some(id),
            Err(refused) => return refused.into_response(),
        }
    } else {
        None
    };
    // A run another node of the fleet holds: admitted here against the
    // tenant the fleet's catalog has for it, then answered by its node.
    // A request another node sent on (with its proof) is never sent on
    // again; a proof that does not hold is refused.
    let sent_on = match request.headers().get(crate::forward::NODE_PROOF) {
        Some(proof) => {
            let subject = crate::forward::proof_subject(&request);
            let holds = proof
                .to_str()
                .is_ok_and(|proof| state.service.proven(&subject, proof));
            if !holds {
                return ApiError::new(
                    ErrorCode::Unauthorized,
                    "a node proof that does not hold (another cluster key, or too old)",
                )
                .into_response();
            }
            true
        }
        None => false,
    };
    // A run token names its run: for another id it is refused here,
    // before anything is looked up.
    if let (Some(id), Caller::Run(own)) = (run, &caller) {
        if id != *own {
            return ApiError::from(runbox_core::CoreError::RunNotFound(id)).into_response();
        }
    }
    if let (Some(id), true) = (run, state.service.in_fleet()) {
        if matches!(
            state.service.tenant_of(id),
            Err(runbox_core::CoreError::RunNotFound(_))
        ) {
            // A request another node sent here is answered here (a run
            // handed or left to this node is made here first).
            match state.service.locate(id, sent_on).await {
                Ok(Some(_)) if sent_on => {}
                Ok(Some(at)) => {
                    let stamp = Some(at.tenant.clone());
                    if let Err(refused) =
                        admit_as(&state, &caller, request.method(), &route, run, stamp)
                    {
                        return refused.into_response();
                    }
                    let response = if at.lost {
                        crate::handlers::lost_run(&state, id, request.method(), &route).await
                    } else if at.gone {
                        return ApiError::from(runbox_core::fleet::node_gone(id, &at))
                            .into_response();
                    } else {
                        send_to(&state, id, &at, request).await
                    };
                    return admitted(response, &caller, id, at.tenant);
                }
                Ok(None) => {}
                Err(e) => return ApiError::from(e).into_response(),
            }
        } else if wakes(&route) {
            // An archived run of this node that this node has no room to
            // wake: moved to a node that has, and the call sent there (one
            // another node sent here is answered `run_moved`: that node
            // sends it again, to the run's new node).
            if let Err(refused) = admit(&state, &caller, request.method(), &route, run) {
                return refused.into_response();
            }
            match state.service.relocate_asleep(id).await {
                Ok(Some(_)) if sent_on => {
                    return ApiError::from(runbox_core::fleet::moved(id)).into_response()
                }
                Ok(Some(at)) => {
                    let response = send_to(&state, id, &at, request).await;
                    return admitted(response, &caller, id, at.tenant);
                }
                Ok(None) => {}
                Err(e) => return ApiError::from(e).into_response(),
            }
        }
    }
    if let Err(refused) = admit(&state, &caller, request.method(), &route, run) {
        return refused.into_response();
    }
    let name = AuditCaller(caller.audit_name());
    // Only for a request the audit log records: reads stay off this path.
    let tenant = match run {
        Some(id) if state.audit.is_some() && crate::audited(&request) => {
            state.service.tenant_of(id).ok().flatten()
        }
        Some(_) => None,
        None => caller.tenant().map(str::to_owned),
    };
    request.extensions_mut().insert(caller);
    if let Some(id) = run {
        request.extensions_mut().insert(AdmittedRun(id));
    }
    let mut response = next.run(request).await;
    response.extensions_mut().insert(name);
    if let Some(id) = run {
        response.extensions_mut().insert(AdmittedRun(id));
    }
    // A create names its own (the run it made, its tenant).
    if response.extensions().get::<AuditTenant>().is_none() {
        response.extensions_mut().insert(AuditTenant(tenant));
    }
    response
}

/// Sends `request` for run `id` on to the node at `at`, with this node's
/// proof: that node's answer.
async fn send_to<S: RunService>(
    state: &AppState<S>,
    id: ulid::Ulid,
    at: &runbox_core::fleet::Located,
    request: Request,
) -> Response {
    let subject = crate::forward::proof_subject(&request);
    match state.service.prove(&subject) {
        Some(proof) => crate::forward::forward(id, at, proof, request).await,
        None => ApiError::new(ErrorCode::Internal, "a fleet without proofs").into_response(),
    }
}

/// `response`, answered here for `caller` on run `id` of `tenant`, as the
/// audit log records it.
fn admitted(
    mut response: Response,
    caller: &Caller,
    id: ulid::Ulid,
    tenant: Option<String>,
) -> Response {
    response
        .extensions_mut()
        .insert(AuditCaller(caller.audit_name()));
    response.extensions_mut().insert(AdmittedRun(id));
    response.extensions_mut().insert(AuditTenant(tenant));
    response
}

/// Whether a call on `route` wakes an asleep run (runs commands or reads
/// or writes its files), where reading, deleting or leasing it does not.
fn wakes(route: &str) -> bool {
    let Some(rest) = route.strip_prefix(RUN_ROUTE) else {
        return false;
    };
    [
        "/exec",
        "/files/",
        "/fs/",
        "/processes",
        "/ports/",
        "/wake",
        "/resume",
    ]
    .iter()
    .any(|p| rest.starts_with(p))
}

/// The routes of one run; their `{id}` is checked by [`require`].
const RUN_ROUTE: &str = "/v1/runs/{id}";

/// How the audit log names the caller of an answered request.
#[derive(Clone, Debug)]
pub(crate) struct AuditCaller(pub String);

/// The tenant an answered request concerns, for the audit log: the run's
/// (read when it was admitted, so a delete still names it), else the
/// calling tenant.
#[derive(Clone, Debug)]
pub(crate) struct AuditTenant(pub Option<String>);

/// Whether `caller` may make this request to `route`, which names `run`
/// (parsed by [`route_run`]) if it is a run's route: Ok, or the refusal.
pub(crate) fn admit<S: RunService>(
    state: &AppState<S>,
    caller: &Caller,
    method: &Method,
    route: &str,
    run: Option<Ulid>,
) -> Result<(), ApiError> {
    admit_as(state, caller, method, route, run, None)
}

/// [`admit`], with the run's tenant stamp given (`stamp`, for a run
/// another node holds) instead of read from this node.
fn admit_as<S: RunService>(
    state: &AppState<S>,
    caller: &Caller,
    method: &Method,
    route: &str,
    run: Option<Ulid>,
    stamp: Option<Option<String>>,
) -> Result<(), ApiError> {
    let rule = rule(method, route);
    let forbidden = |what: &str| Err(ApiError::new(ErrorCode::Forbidden, what.to_owned()));
    match (caller, rule) {
        (Caller::Root, _) => Ok(()),
        (_, Rule::Root) => forbidden("this route is the operator's: it takes the root token"),
        (Caller::Run(_), Rule::Tenant) => forbidden(
            "a run token drives its own run only (exec, files, processes, sessions, previews)",
        ),
        (Caller::Tenant(_), Rule::Tenant) => Ok(()),
        (Caller::Run(_) | Caller::Tenant(_), Rule::Run | Rule::RunOwner) => {
            // A run rule on a route that names no run: nothing to admit to.
            let Some(id) = run else {
                return Err(ApiError::new(
                    ErrorCode::NotFound,
                    "no such route; see docs/api.md",
                ));
            };
            match caller {
                Caller::Run(own) if id != *own => {
                    Err(runbox_core::CoreError::RunNotFound(id).into())
                }
                Caller::Run(_) if rule == Rule::RunOwner => forbidden(
                    "a run token drives its run (exec, files, processes, sessions, previews); \
                     its lifecycle takes the root or its tenant's token",
                ),
                Caller::Tenant(t) => match stamp.map_or_else(|| state.service.tenant_of(id), Ok) {
                    Ok(stamp) if stamp.as_deref() == Some(t.name.as_str()) => Ok(()),
                    // Another tenant's run is as absent as one that never was.
                    _ => Err(runbox_core::CoreError::RunNotFound(id).into()),
                },
                _ => Ok(()),
            }
        }
    }
}

/// The caller a handler runs for (put there by [`require`]).
impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _state: &S,
    ) -> Result<Caller, ApiError> {
        parts
            .extensions
            .get::<Caller>()
            .cloned()
            .ok_or_else(|| ApiError::new(ErrorCode::Internal, "the request was not authenticated"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_tokens_open_their_run_only() {
        let (a, b) = (Ulid::new(), Ulid::new());
        let token = run_token("root", a);
        assert!(token.starts_with("run_"));
        assert_eq!(run_of_token("root", &token), Some(a));
        assert_eq!(run_of_token("other root", &token), None);
        let forged = token.replace(&a.to_string(), &b.to_string());
        assert_eq!(run_of_token("root", &forged), None);
        for bad in ["", "run_", "run_x", &token[..token.len() - 1], "run_é"] {
            assert_eq!(run_of_token("root", bad), None, "{bad:?}");
        }
    }

    #[test]
    fn routes_have_the_rules_the_table_in_api_md_gives() {
        use Method as M;
        assert_eq!(rule(&M::GET, "/v1/info"), Rule::Root);
        assert_eq!(rule(&M::GET, "/v1/cluster"), Rule::Root);
        assert_eq!(rule(&M::POST, "/v1/tenants"), Rule::Root);
        assert_eq!(rule(&M::POST, "/v1/images/{name}"), Rule::Root);
        assert_eq!(rule(&M::DELETE, "/v1/images/{name}"), Rule::Tenant);
        assert_eq!(rule(&M::POST, "/v1/runs"), Rule::Tenant);
        assert_eq!(rule(&M::GET, "/v1/runs/{id}"), Rule::Run);
        assert_eq!(rule(&M::DELETE, "/v1/runs/{id}"), Rule::RunOwner);
        assert_eq!(rule(&M::POST, "/v1/runs/{id}/exec"), Rule::Run);
        assert_eq!(rule(&M::PUT, "/v1/runs/{id}/files/{*path}"), Rule::Run);
        assert_eq!(
            rule(&M::GET, "/v1/runs/{id}/processes/{process}/ws"),
            Rule::Run
        );
        assert_eq!(rule(&M::POST, "/v1/runs/{id}/fork"), Rule::RunOwner);
        assert_eq!(rule(&M::POST, "/v1/runs/{id}/move"), Rule::Root);
        assert_eq!(rule(&M::POST, "/v1/runs/{id}/lease"), Rule::RunOwner);
    }
}
