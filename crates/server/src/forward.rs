//! Requests for a run another node of the fleet holds: sent on to that
//! node as they came, bytes streamed both ways without buffering (exec
//! output, file bodies), and an upgraded connection (a WebSocket session,
//! a port tunnel) joined end to end.
//!
//! The receiving node checks the caller itself (tokens are the fleet's),
//! and the request carries this node's proof (`Runbox-Node-Proof`, a MAC
//! under a key derived from the cluster key), so it is never sent on again
//! and a client cannot pose as a node.

use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;
use runbox_core::fleet::Located;
use runbox_types::ErrorCode;
use ulid::Ulid;

use crate::error::ApiError;

/// The header a node's proof travels in.
pub(crate) const NODE_PROOF: &str = "runbox-node-proof";

/// How long reaching the other node may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// What a proof covers: the request's method and its path with the query.
pub(crate) fn proof_subject(request: &Request) -> String {
    let path = request
        .uri()
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/");
    format!("{} {path}", request.method())
}

/// The node at `at` cannot be reached: a 503 that names it after `what`
/// ("run X is on").
fn unreachable(what: &str, at: &Located, why: impl std::fmt::Display) -> ApiError {
    ApiError::new(
        ErrorCode::NodeUnavailable,
        format!(
            "{what} node {} ({}), which cannot be reached from here ({why}); retry shortly",
            at.node, at.advertise
        ),
    )
}

/// A request for run `id` that another node of the fleet holds, sent on
/// to that node (or the 503 that says the node is gone); the request back
/// when it is this node's to answer: no fleet, a request another node sent
/// on, a run this node holds or no node does. For routes whose caller the
/// run's node checks (E2B's); runbox's own admit the caller here first.
pub(crate) async fn elsewhere<S: runbox_core::RunService>(
    service: &S,
    id: Ulid,
    request: Request,
) -> Result<Response, Request> {
    if !service.in_fleet() {
        return Err(request);
    }
    if !matches!(
        service.tenant_of(id),
        Err(runbox_core::CoreError::RunNotFound(_))
    ) {
        return Err(request);
    }
    // Sent here by another node: answered here (a run handed or left to
    // this node is made here first), never sent on again.
    let relayed = request
        .headers()
        .get(NODE_PROOF)
        .and_then(|p| p.to_str().ok())
        .is_some_and(|p| service.proven(&proof_subject(&request), p));
    if relayed || request.headers().contains_key(NODE_PROOF) {
        return match service.locate(id, relayed).await {
            Err(e) if relayed => Ok(ApiError::from(e).into_response()),
            _ => Err(request),
        };
    }
    let at = match service.locate(id, false).await {
        Ok(Some(at)) => at,
        Ok(None) => return Err(request),
        Err(e) => return Ok(ApiError::from(e).into_response()),
    };
    if at.lost {
        // Lost with its node: E2B's surface does not show it (runbox's
        // API reads and deletes it), so it is a sandbox that is not found.
        return Err(request);
    }
    if at.gone {
        return Ok(ApiError::from(runbox_core::fleet::node_gone(id, &at)).into_response());
    }
    match service.prove(&proof_subject(&request)) {
        Some(proof) => Ok(forward(id, &at, proof, request).await),
        None => Err(request),
    }
}

/// Sends `request` (for run `id`) to the node at `at`, with `proof`, and
/// answers with what that node answers.
pub(crate) async fn forward(id: Ulid, at: &Located, proof: String, request: Request) -> Response {
    send_on(&format!("run {id} is on"), at, proof, request).await
}

/// Sends `request` (about `what`, for messages) to the node at `at`, with
/// `proof`, and answers with what that node answers.
pub(crate) async fn send_on(what: &str, at: &Located, proof: String, request: Request) -> Response {
    let mut response = relay(what, at, proof, request).await;
    response.extensions_mut().insert(Relayed(at.node.clone()));
    response
}

/// An answer another node gave (or the 503 saying it could not be
/// reached): the node, for the metrics.
#[derive(Clone, Debug)]
pub(crate) struct Relayed(pub(crate) String);

/// [`send_on`]'s work.
async fn relay(what: &str, at: &Located, proof: String, mut request: Request) -> Response {
    let stream = match tokio::time::timeout(
        CONNECT_TIMEOUT,
        tokio::net::TcpStream::connect(at.advertise.as_str()),
    )
    .await
    {
        Ok(Ok(stream)) => stream,
        Ok(Err(e)) => return unreachable(what, at, e).into_response(),
        Err(_) => return unreachable(what, at, "no connection within 5s").into_response(),
    };
    let _ = stream.set_nodelay(true);
    let (mut sender, connection) =
        match hyper::client::conn::http1::handshake::<_, Body>(TokioIo::new(stream)).await {
            Ok(handshake) => handshake,
            Err(e) => return unreachable(what, at, e).into_response(),
        };
    tokio::spawn(async move {
        // Upgraded connections live on past the response.
        if let Err(e) = connection.with_upgrades().await {
            tracing::debug!(error = %e, "a connection to another node ended");
        }
    });
    // A stream the other node breaks off (a sandbox killed under a
    // command) breaks this connection the same way, so the client sees
    // what it would have seen from the run's node.
    let sever = crate::conn::severable(
        request
            .extensions()
            .get::<axum::extract::ConnectInfo<crate::conn::Severable>>()
            .cloned()
            .map(axum::Extension),
        request.version(),
    );
    // An upgrade asked for by the client is joined to the one the other
    // node grants.
    let inbound = request
        .headers()
        .contains_key(axum::http::header::UPGRADE)
        .then(|| hyper::upgrade::on(&mut request));
    let (mut parts, body) = request.into_parts();
    parts.uri = parts
        .uri
        .path_and_query()
        .map(|p| Uri::from(p.clone()))
        .unwrap_or_else(|| Uri::from_static("/"));
    // The Host a client sent is kept: E2B's `<port>-<id>.<domain>` names
    // the sandbox there.
    if !parts.headers.contains_key(axum::http::header::HOST) {
        if let Ok(host) = HeaderValue::from_str(&at.advertise) {
            parts.headers.insert(axum::http::header::HOST, host);
        }
    }
    match HeaderValue::from_str(&proof) {
        Ok(value) => {
            parts.headers.insert(NODE_PROOF, value);
        }
        Err(_) => {
            return ApiError::new(ErrorCode::Internal, "a node proof that is no header")
                .into_response()
        }
    }
    let outbound = Request::from_parts(parts, body);
    let mut response = match sender.send_request(outbound).await {
        Ok(response) => response,
        Err(e) => return unreachable(what, at, e).into_response(),
    };
    if response.status() == StatusCode::SWITCHING_PROTOCOLS {
        if let Some(inbound) = inbound {
            let outbound = hyper::upgrade::on(&mut response);
            tokio::spawn(async move {
                let (Ok(inbound), Ok(outbound)) = (inbound.await, outbound.await) else {
                    return;
                };
                let mut inbound = TokioIo::new(inbound);
                let mut outbound = TokioIo::new(outbound);
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
            });
        }
    }
    response.map(|body| {
        use http_body_util::BodyExt;
        Body::new(body.map_err(move |e| {
            if let Some(flag) = &sever {
                flag.arm();
            }
            e
        }))
    })
}

/// The other nodes of the fleet that are heard from (not gone), as
/// places to send to.
async fn other_nodes<S: runbox_core::RunService>(service: &S) -> Vec<Located> {
    let Ok(cluster) = service.cluster().await else {
        return Vec::new();
    };
    cluster
        .nodes
        .into_iter()
        .filter(|n| !n.local && n.state != runbox_types::NodeState::Gone)
        .filter_map(|n| {
            Some(Located {
                advertise: n.advertise?,
                node: n.id,
                tenant: None,
                gone: false,
                silent_sec: n.last_seen_sec,
                archived: false,
                lost: false,
                portable: false,
            })
        })
        .collect()
}

/// The other node of the fleet called `name` (an object's `server`), if
/// it is heard from.
pub(crate) async fn node_named<S: runbox_core::RunService>(
    service: &S,
    name: &str,
) -> Option<Located> {
    other_nodes(service)
        .await
        .into_iter()
        .find(|n| n.node == name)
}

/// The most a node's answer to a fleet-wide read may hold.
const FAN_OUT_MAX_BYTES: usize = 64 << 20;

/// `GET path` (runbox's own API) on every other node of the fleet heard
/// from, with the fleet's root token (`token`) and this node's proof: each
/// answer that is a 200 with a `T`. A node that cannot be reached or
/// answers otherwise is left out (logged), so a list is the reachable
/// fleet's. The caller filters what its caller may see.
pub(crate) async fn read_others<S, T>(service: &S, token: &str, path: &str) -> Vec<T>
where
    S: runbox_core::RunService,
    T: serde::de::DeserializeOwned,
{
    let subject = format!("GET {path}");
    let nodes = other_nodes(service).await;
    let reads = nodes.iter().map(|at| {
        let subject = subject.clone();
        async move {
            let proof = service.prove(&subject)?;
            let request = axum::http::Request::get(path)
                .header(axum::http::header::AUTHORIZATION, format!("Bearer {token}"))
                .body(Body::empty())
                .ok()?;
            let response = send_on("the list's part", at, proof, request).await;
            let status = response.status();
            let body = axum::body::to_bytes(response.into_body(), FAN_OUT_MAX_BYTES)
                .await
                .ok()?;
            if status != StatusCode::OK {
                tracing::info!(node = %at.node, %status, path, "a node's part of a fleet-wide list is left out");
                return None;
            }
            serde_json::from_slice::<T>(&body).ok()
        }
    });
    futures::future::join_all(reads)
        .await
        .into_iter()
        .flatten()
        .collect()
}

/// Every volume the other nodes of the fleet hold (read with the fleet's
/// root token `token`, for the caller to filter); none alone, or for a
/// request another node sent on (`headers` has its proof).
pub(crate) async fn volumes_elsewhere<S: runbox_core::RunService>(
    service: &S,
    token: &str,
    headers: &axum::http::HeaderMap,
) -> Vec<runbox_types::Volume> {
    if !service.in_fleet() || headers.contains_key(NODE_PROOF) {
        return Vec::new();
    }
    let lists: Vec<runbox_types::VolumeList> = read_others(service, token, "/v1/volumes").await;
    lists.into_iter().flat_map(|l| l.volumes).collect()
}

/// Sends `request` (bodiless) to each other node of the fleet in turn
/// until one answers with something other than 404: that answer, or None
/// when every node says 404 (or none could be reached). For an object
/// whose node the catalog does not record (an image, a snapshot).
pub(crate) async fn ask_others<S: runbox_core::RunService>(
    service: &S,
    method: &axum::http::Method,
    uri: &Uri,
    headers: &axum::http::HeaderMap,
) -> Option<Response> {
    if !service.in_fleet() || headers.contains_key(NODE_PROOF) {
        return None;
    }
    let path = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    let subject = format!("{method} {path}");
    for at in other_nodes(service).await {
        let proof = service.prove(&subject)?;
        let mut copy = axum::http::Request::builder()
            .method(method.clone())
            .uri(uri.clone());
        for (name, value) in headers {
            copy = copy.header(name, value);
        }
        let Ok(copy) = copy.body(Body::empty()) else {
            continue;
        };
        let response = send_on("the object", &at, proof, copy).await;
        if response.status() != StatusCode::NOT_FOUND {
            return Some(response);
        }
    }
    None
}

/// The headers a client's credentials travel in.
const CREDENTIALS: [&str; 2] = ["authorization", "x-api-key"];

/// The other node of the fleet that holds an object this one does not:
/// the first that answers `GET probe` (the object's own route) with 200
/// for the caller's own credentials (from `headers`), so a node never
/// reveals to a caller what its caller may not see. None: no node does.
pub(crate) async fn holder<S: runbox_core::RunService>(
    service: &S,
    probe: &str,
    headers: &axum::http::HeaderMap,
) -> Option<Located> {
    if !service.in_fleet() || headers.contains_key(NODE_PROOF) {
        return None;
    }
    for at in other_nodes(service).await {
        let proof = service.prove(&format!("GET {probe}"))?;
        let mut ask = axum::http::Request::get(probe);
        for name in CREDENTIALS {
            if let Some(value) = headers.get(name) {
                ask = ask.header(name, value);
            }
        }
        let Ok(ask) = ask.body(Body::empty()) else {
            return None;
        };
        if send_on("the object", &at, proof, ask).await.status() == StatusCode::OK {
            return Some(at);
        }
    }
    None
}

/// The routes that name a volume.
const VOLUME_ROUTE: &str = "/v1/volumes/{name}";

/// Sends a `/v1/volumes/{name}...` request for a volume this node does not
/// hold (for its caller) to the node of the fleet that does: found by
/// asking the other nodes for the volume with the caller's own
/// credentials, then sent there whole, its body streamed. The rest go on.
pub(crate) async fn volume_elsewhere<S: runbox_core::RunService>(
    axum::extract::State(state): axum::extract::State<crate::AppState<S>>,
    request: Request,
    next: axum::middleware::Next,
) -> Response {
    let named = request
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .is_some_and(|p| p.as_str().starts_with(VOLUME_ROUTE));
    if !named || !state.service.in_fleet() || request.headers().contains_key(NODE_PROOF) {
        return next.run(request).await;
    }
    let Some(owner) = request
        .extensions()
        .get::<crate::auth::Caller>()
        .map(crate::auth::Caller::owner)
    else {
        return next.run(request).await;
    };
    let (mut parts, body) = request.into_parts();
    let name = {
        use axum::extract::FromRequestParts;
        crate::handlers::AppPath::<Vec<(String, String)>>::from_request_parts(&mut parts, &state)
            .await
            .ok()
            .and_then(|crate::handlers::AppPath(params)| {
                params
                    .into_iter()
                    .find(|(k, _)| k == "name")
                    .map(|(_, v)| v)
            })
    };
    let request = Request::from_parts(parts, body);
    let Some(name) = name.filter(|name| state.service.get_volume(name, &owner).is_err()) else {
        return next.run(request).await;
    };
    let probe = format!(
        "{VOLUME_ROUTE_PREFIX}{}",
        form_urlencoded::byte_serialize(name.as_bytes()).collect::<String>()
    );
    if let Some(at) = holder(&state.service, &probe, request.headers()).await {
        if let Some(proof) = state.service.prove(&proof_subject(&request)) {
            // What only nodes send each other never travels with a
            // client's request under this node's proof.
            let mut request = request;
            request
                .headers_mut()
                .remove(crate::handlers::VOLUME_ARRIVAL);
            return send_on(&format!("volume {name:?} is on"), &at, proof, request).await;
        }
    }
    next.run(request).await
}

/// Where a volume's routes begin.
const VOLUME_ROUTE_PREFIX: &str = "/v1/volumes/";
