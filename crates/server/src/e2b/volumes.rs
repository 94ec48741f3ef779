//! E2B's volumes: the control plane's `/volumes` (with the API key) and
//! the volume content API under `/volumecontent/{volumeID}` (with the
//! volume's own token), over runbox's named volumes.
//!
//! A volume's E2B id is its runbox id; its token is an HMAC of that id
//! under the daemon token (like a sandbox's access token, with its own
//! purpose), so it opens that volume's files only, needs no storage, and
//! changes when the daemon token does. The SDKs send content calls to
//! `E2B_VOLUME_API_URL` (or `https://api.<domain>`): point it at runbox's
//! listener.
//!
//! The content calls are runbox's volume file operations
//! (`runbox_core::runs::VolumeFiles`), with E2B's shapes: paths from the
//! volume's top, `force` to replace a file or to make missing parents, and
//! a write refused while a run mounts the volume (runbox's one-writer
//! rule; reads go on).

use axum::body::Body;
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use runbox_core::runs::{VolumeFiles, VolumeKey, VolumeWrite};
use runbox_core::tenants::Owner;
use runbox_core::RunService;
use runbox_types::{ErrorCode, FileInfo, FileKind};
use serde::{Deserialize, Serialize};
use ulid::Ulid;

use super::control::E2bError;
use crate::AppState;

/// A volume's content token (see the module doc).
pub(crate) fn volume_token(daemon_token: &str, id: Ulid) -> String {
    super::sandbox_token(daemon_token, b"runbox e2b volume content\0", id)
}

/// The control-plane routes (mounted under the API-key check).
pub fn control_routes<S: RunService>() -> Router<AppState<S>> {
    Router::new()
        .route("/volumes", get(list::<S>).post(create::<S>))
        .route("/volumes/{id}", get(info::<S>).delete(destroy::<S>))
}

/// The volume content routes, each checked against the volume's token.
pub fn content_routes<S: RunService>(state: AppState<S>) -> Router<AppState<S>> {
    Router::new()
        .route(
            "/volumecontent/{id}/path",
            get(stat::<S>).patch(patch::<S>).delete(remove::<S>),
        )
        .route(
            "/volumecontent/{id}/dir",
            get(list_dir::<S>).post(make_dir::<S>),
        )
        // File bodies stream (the volume's size bounds them); the JSON
        // bodies above keep axum's default limit.
        .route(
            "/volumecontent/{id}/file",
            get(read::<S>)
                .put(write::<S>)
                .layer(axum::extract::DefaultBodyLimit::disable()),
        )
        .route_layer(axum::middleware::from_fn_with_state(
            state,
            require_volume_token::<S>,
        ))
}

/// `POST /volumes` with `{"name"}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NewVolume {
    name: String,
}

/// A volume as the control plane answers it; `token` on create and info.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct E2bVolume {
    #[serde(rename = "volumeID")]
    volume_id: String,
    name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    token: Option<String>,
}

fn shown<S: RunService>(state: &AppState<S>, v: &runbox_types::Volume, token: bool) -> E2bVolume {
    E2bVolume {
        volume_id: v.id.to_string(),
        name: v.name.clone(),
        token: token.then(|| volume_token(&state.token, v.id)),
    }
}

/// The caller's own named volumes: a tenant's, or for the root token the
/// operator's (not every tenant's, as runbox's own list shows them). The
/// catalog's datasets are not E2B volumes: they take no content calls and
/// are never made or destroyed through the API.
fn own<S: RunService>(state: &AppState<S>, owner: &Owner) -> Vec<runbox_types::Volume> {
    state
        .service
        .list_volumes(owner)
        .volumes
        .into_iter()
        .filter(|v| v.tenant.as_deref() == owner.tenant() && v.dataset.is_none())
        .collect()
}

/// The caller's volume with E2B id `raw`.
fn by_id<S: RunService>(
    state: &AppState<S>,
    owner: &Owner,
    raw: &str,
) -> Result<runbox_types::Volume, E2bError> {
    let id = runbox_types::parse_id(raw);
    own(state, owner)
        .into_iter()
        .find(|v| Some(v.id) == id)
        .ok_or_else(|| {
            E2bError::new(
                StatusCode::NOT_FOUND,
                format!("volume {raw:?} was not found"),
            )
        })
}

async fn create<S: RunService>(
    State(state): State<AppState<S>>,
    caller: crate::auth::Caller,
    body: axum::body::Bytes,
) -> Result<Response, E2bError> {
    let req: NewVolume = serde_json::from_slice(&body)
        .map_err(|e| E2bError::bad(format!("the body is not valid: {e}")))?;
    // E2B's own rule, narrower than runbox's (which also takes '.').
    let e2b_name = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
    if req.name.is_empty() || !req.name.chars().all(e2b_name) {
        return Err(E2bError::bad(format!(
            "volume name {:?} must be letters, digits, '_' and '-'",
            req.name.chars().take(64).collect::<String>()
        )));
    }
    let made = state
        .service
        .create_volume(
            runbox_types::CreateVolumeRequest {
                name: req.name,
                size_mb: None,
                labels: None,
            },
            caller.owner(),
        )
        .await?;
    Ok((StatusCode::CREATED, Json(shown(&state, &made, true))).into_response())
}

async fn list<S: RunService>(
    State(state): State<AppState<S>>,
    caller: crate::auth::Caller,
    headers: axum::http::HeaderMap,
) -> Json<Vec<E2bVolume>> {
    let owner = caller.owner();
    let mut volumes = own(&state, &owner);
    volumes.extend(own_elsewhere(&state, &owner, &headers).await);
    Json(volumes.iter().map(|v| shown(&state, v, false)).collect())
}

async fn info<S: RunService>(
    State(state): State<AppState<S>>,
    caller: crate::auth::Caller,
    Path(id): Path<String>,
    request: crate::handlers::ElsewhereRequest,
) -> Result<Response, E2bError> {
    match by_id(&state, &caller.owner(), &id) {
        Ok(volume) => Ok(Json(shown(&state, &volume, true)).into_response()),
        Err(missing) => elsewhere(&state, request, missing).await,
    }
}

async fn destroy<S: RunService>(
    State(state): State<AppState<S>>,
    caller: crate::auth::Caller,
    Path(id): Path<String>,
    request: crate::handlers::ElsewhereRequest,
) -> Result<Response, E2bError> {
    let owner = caller.owner();
    let volume = match by_id(&state, &owner, &id) {
        Ok(volume) => volume,
        Err(missing) => return elsewhere(&state, request, missing).await,
    };
    state.service.delete_volume(volume.name, owner).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `missing` (this node's 404) as it is, or, on a node of a fleet, the
/// answer of the node that holds the volume (it checks the key again).
async fn elsewhere<S: RunService>(
    state: &AppState<S>,
    request: crate::handlers::ElsewhereRequest,
    missing: E2bError,
) -> Result<Response, E2bError> {
    request.ask(state).await.ok_or(missing)
}

/// Checks `Authorization: Bearer <token>` against the token of the volume
/// the route names (its `{id}` as the router decoded it, the value the
/// handler acts on); a wrong or missing token is `401`, whatever the
/// volume.
async fn require_volume_token<S: RunService>(
    State(state): State<AppState<S>>,
    request: Request,
    next: Next,
) -> Response {
    use axum::extract::FromRequestParts;
    use subtle::ConstantTimeEq;
    let (mut parts, body) = request.into_parts();
    let id = Path::<String>::from_request_parts(&mut parts, &state)
        .await
        .ok()
        .and_then(|Path(raw)| runbox_types::parse_id(&raw));
    let mut request = Request::from_parts(parts, body);
    let presented = crate::bearer(request.headers()).unwrap_or("");
    let valid = id.filter(|id| {
        bool::from(
            presented
                .as_bytes()
                .ct_eq(volume_token(&state.token, *id).as_bytes()),
        )
    });
    let Some(id) = valid else {
        return E2bError::new(
            StatusCode::UNAUTHORIZED,
            "missing or wrong volume token: send the token Volume.create or Volume.get_info answered as Authorization: Bearer",
        )
        .into_response();
    };
    request.extensions_mut().insert(AdmittedVolume(id));
    // A volume another node of the fleet holds: its node answers (the
    // token is the fleet's, so it checks it again).
    if let Some(at) = volume_node(&state, id, request.headers()).await {
        if let Some(proof) = state
            .service
            .prove(&crate::forward::proof_subject(&request))
        {
            return crate::forward::send_on(&format!("volume {id} is on"), &at, proof, request)
                .await;
        }
    }
    next.run(request).await
}

/// The other node of the fleet that holds volume `id`, when this one does
/// not (None alone, or for a request another node sent on).
async fn volume_node<S: RunService>(
    state: &AppState<S>,
    id: Ulid,
    headers: &axum::http::HeaderMap,
) -> Option<runbox_core::fleet::Located> {
    if !state.service.in_fleet() {
        return None;
    }
    let here = state.service.list_volumes(&Owner::root()).volumes;
    if here.iter().any(|v| v.id == id) {
        return None;
    }
    let server = crate::forward::volumes_elsewhere(&state.service, &state.token, headers)
        .await
        .into_iter()
        .find(|v| v.id == id)?
        .server;
    crate::forward::node_named(&state.service, &server).await
}

/// The caller's own volumes on the other nodes of the fleet (none alone,
/// or for a request another node sent on), read with the fleet's root
/// token and filtered as [`own`] filters this node's.
async fn own_elsewhere<S: RunService>(
    state: &AppState<S>,
    owner: &Owner,
    headers: &axum::http::HeaderMap,
) -> Vec<runbox_types::Volume> {
    crate::forward::volumes_elsewhere(&state.service, &state.token, headers)
        .await
        .into_iter()
        .filter(|v| v.tenant.as_deref() == owner.tenant() && v.dataset.is_none())
        .collect()
}

/// The volume a `/volumecontent/{id}/...` request was admitted to by
/// [`require_volume_token`]; handlers read it and never parse the path.
#[derive(Clone, Copy, Debug)]
struct AdmittedVolume(Ulid);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for AdmittedVolume {
    type Rejection = E2bError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _state: &S,
    ) -> Result<Self, E2bError> {
        parts
            .extensions
            .get::<AdmittedVolume>()
            .copied()
            .ok_or_else(|| {
                E2bError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "the volume this request names was not authorised",
                )
            })
    }
}

/// The query of a content call: `path` always, the rest where E2B takes
/// them; anything else is refused.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ContentQuery {
    path: Option<String>,
    depth: Option<u32>,
    uid: Option<u32>,
    gid: Option<u32>,
    mode: Option<u32>,
    force: Option<bool>,
}

type QueryResult = Result<Query<ContentQuery>, axum::extract::rejection::QueryRejection>;

/// The checked query: its `path` present and non-empty, and only the
/// parameters in `takes` besides it.
fn content_query(query: QueryResult, takes: &[&str]) -> Result<(ContentQuery, String), E2bError> {
    let Query(q) = query.map_err(|e| E2bError::bad(format!("the query is not valid: {e}")))?;
    let given = [
        ("depth", q.depth.is_some()),
        ("uid", q.uid.is_some()),
        ("gid", q.gid.is_some()),
        ("mode", q.mode.is_some()),
        ("force", q.force.is_some()),
    ];
    if let Some((name, _)) = given.iter().find(|(n, set)| *set && !takes.contains(n)) {
        return Err(E2bError::bad(format!("this call takes no {name}")));
    }
    let path = q.path.clone().unwrap_or_default();
    if path.is_empty() {
        return Err(E2bError::bad("path is missing; name a path in the volume"));
    }
    Ok((q, path))
}

/// The owner a content call names, either id kept from `current` when
/// only the other is given (E2B lets them come alone).
fn content_owner(
    uid: Option<u32>,
    gid: Option<u32>,
    current: Option<&FileInfo>,
) -> Result<Option<(u32, u32)>, E2bError> {
    let owner = match (uid, gid) {
        (None, None) => return Ok(None),
        (Some(u), Some(g)) => (u, g),
        (Some(u), None) => (u, current.map_or(0, |c| c.gid)),
        (None, Some(g)) => (current.map_or(0, |c| c.uid), g),
    };
    if owner.0 > runbox_types::MAX_VOLUME_ID || owner.1 > runbox_types::MAX_VOLUME_ID {
        return Err(E2bError::bad(format!(
            "uid and gid are ids as sandboxes see them, 0-{}",
            runbox_types::MAX_VOLUME_ID
        )));
    }
    Ok(Some(owner))
}

/// E2B's description of an entry. runbox keeps one time per entry, its
/// modification time, and answers it as all three.
#[derive(Debug, Serialize)]
struct EntryStat {
    name: String,
    #[serde(rename = "type")]
    kind: &'static str,
    path: String,
    size: u64,
    mode: u32,
    uid: u32,
    gid: u32,
    #[serde(with = "time::serde::rfc3339")]
    atime: time::OffsetDateTime,
    #[serde(with = "time::serde::rfc3339")]
    mtime: time::OffsetDateTime,
    #[serde(with = "time::serde::rfc3339")]
    ctime: time::OffsetDateTime,
    #[serde(skip_serializing_if = "Option::is_none")]
    target: Option<String>,
}

fn entry(info: FileInfo) -> EntryStat {
    let name = match info.path.rsplit('/').next() {
        Some("") | None => "/".to_owned(),
        Some(name) => name.to_owned(),
    };
    EntryStat {
        name,
        kind: match info.kind {
            FileKind::File => "file",
            FileKind::Directory => "directory",
            FileKind::Symlink => "symlink",
            FileKind::Other => "unknown",
        },
        path: info.path,
        size: info.size,
        mode: info.mode,
        uid: info.uid,
        gid: info.gid,
        atime: info.modified_at,
        mtime: info.modified_at,
        ctime: info.modified_at,
        target: info.target,
    }
}

async fn files<S: RunService>(
    state: &AppState<S>,
    id: Ulid,
    write: bool,
) -> Result<VolumeFiles, E2bError> {
    Ok(state
        .service
        .volume_files(VolumeKey::Id(id), Owner::root(), write)
        .await?)
}

/// Whether `path` exists in the volume (a stat that is not `404`).
async fn stat_if_any(files: &VolumeFiles, path: &str) -> Result<Option<FileInfo>, E2bError> {
    match files.stat(path).await {
        Ok(info) => Ok(Some(info)),
        Err(e) if e.code() == ErrorCode::FileNotFound => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// The parent of `path` ("/" for a name at the top).
fn parent(path: &str) -> String {
    let trimmed = path.trim_end_matches('/');
    match trimmed.rfind('/') {
        Some(0) | None => "/".to_owned(),
        Some(i) => trimmed[..i].to_owned(),
    }
}

/// Refuses when the parent of `path` is missing (`404`, as E2B does) or
/// is not a directory.
async fn parent_exists(files: &VolumeFiles, path: &str) -> Result<(), E2bError> {
    let up = parent(path);
    match stat_if_any(files, &up).await? {
        Some(info) if info.kind == FileKind::Directory => Ok(()),
        Some(_) => Err(E2bError::new(
            StatusCode::CONFLICT,
            format!("{up:?} is not a directory"),
        )),
        None => Err(E2bError::new(
            StatusCode::NOT_FOUND,
            format!("{up:?} was not found"),
        )),
    }
}

async fn stat<S: RunService>(
    State(state): State<AppState<S>>,
    AdmittedVolume(id): AdmittedVolume,
    query: QueryResult,
) -> Result<Json<EntryStat>, E2bError> {
    let (_, path) = content_query(query, &[])?;
    let files = files(&state, id, false).await?;
    Ok(Json(entry(files.stat(&path).await?)))
}

/// `PATCH .../path` with `{"uid"?, "gid"?, "mode"?}`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Metadata {
    uid: Option<u32>,
    gid: Option<u32>,
    mode: Option<u32>,
}

async fn patch<S: RunService>(
    State(state): State<AppState<S>>,
    AdmittedVolume(id): AdmittedVolume,
    query: QueryResult,
    body: axum::body::Bytes,
) -> Result<Json<EntryStat>, E2bError> {
    let (_, path) = content_query(query, &[])?;
    let meta: Metadata = serde_json::from_slice(&body)
        .map_err(|e| E2bError::bad(format!("the body is not valid: {e}")))?;
    let files = files(&state, id, true).await?;
    let current = files.stat(&path).await?;
    let owner = content_owner(meta.uid, meta.gid, Some(&current))?;
    Ok(Json(entry(files.set_attrs(&path, owner, meta.mode).await?)))
}

async fn remove<S: RunService>(
    State(state): State<AppState<S>>,
    AdmittedVolume(id): AdmittedVolume,
    query: QueryResult,
) -> Result<StatusCode, E2bError> {
    let (_, path) = content_query(query, &[])?;
    let files = files(&state, id, true).await?;
    if path.trim_start_matches('/').is_empty() {
        return Err(E2bError::new(
            StatusCode::NOT_FOUND,
            "the volume's top directory cannot be removed",
        ));
    }
    files.remove(&path, true).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn list_dir<S: RunService>(
    State(state): State<AppState<S>>,
    AdmittedVolume(id): AdmittedVolume,
    query: QueryResult,
) -> Result<Json<Vec<EntryStat>>, E2bError> {
    let (q, path) = content_query(query, &["depth"])?;
    let files = files(&state, id, false).await?;
    let listed = files.list(&path, Some(q.depth.unwrap_or(1)), None).await?;
    Ok(Json(listed.entries.into_iter().map(entry).collect()))
}

async fn make_dir<S: RunService>(
    State(state): State<AppState<S>>,
    AdmittedVolume(id): AdmittedVolume,
    query: QueryResult,
) -> Result<Response, E2bError> {
    let (q, path) = content_query(query, &["uid", "gid", "mode", "force"])?;
    let owner = content_owner(q.uid, q.gid, None)?;
    let force = q.force.unwrap_or(false);
    let files = files(&state, id, true).await?;
    match stat_if_any(&files, &path).await? {
        Some(existing) if force && existing.kind == FileKind::Directory => {
            return Ok((StatusCode::CREATED, Json(entry(existing))).into_response())
        }
        Some(_) => {
            return Err(E2bError::new(
                StatusCode::CONFLICT,
                format!("{path:?} already exists"),
            ))
        }
        None => {}
    }
    if !force {
        parent_exists(&files, &path).await?;
    }
    let made = files.make_dir(&path, q.mode, owner).await?;
    Ok((StatusCode::CREATED, Json(entry(made))).into_response())
}

async fn read<S: RunService>(
    State(state): State<AppState<S>>,
    AdmittedVolume(id): AdmittedVolume,
    query: QueryResult,
) -> Result<Response, E2bError> {
    let (_, path) = content_query(query, &[])?;
    let files = files(&state, id, false).await?;
    let download = files.read(&path).await?;
    Ok(crate::handlers::download_response(download, |e| {
        tracing::warn!(error = %e, "volume content download broke off");
    }))
}

async fn write<S: RunService>(
    State(state): State<AppState<S>>,
    AdmittedVolume(id): AdmittedVolume,
    query: QueryResult,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, E2bError> {
    let (q, path) = content_query(query, &["uid", "gid", "mode", "force"])?;
    let owner = content_owner(q.uid, q.gid, None)?;
    let force = q.force.unwrap_or(false);
    let content_length = crate::handlers::content_length(&headers)?;
    let files = files(&state, id, true).await?;
    if let Some(existing) = stat_if_any(&files, &path).await? {
        if existing.kind == FileKind::Directory {
            return Err(E2bError::new(
                StatusCode::CONFLICT,
                format!("{path:?} is a directory"),
            ));
        }
        if !force {
            return Err(E2bError::new(
                StatusCode::CONFLICT,
                format!("{path:?} already exists; write it with force to replace it"),
            ));
        }
    }
    parent_exists(&files, &path).await?;
    let options = VolumeWrite {
        mode: q.mode,
        owner,
        replace: force,
        content_length,
    };
    let written = files.write(&path, options, body.into_data_stream()).await?;
    Ok((StatusCode::CREATED, Json(entry(written))).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parents_and_names() {
        assert_eq!(parent("/a/b"), "/a");
        assert_eq!(parent("a"), "/");
        assert_eq!(parent("/a"), "/");
        assert_eq!(parent("/a/b/"), "/a");
        let info = |path: &str| FileInfo {
            path: path.into(),
            kind: FileKind::File,
            size: 0,
            mode: 0o644,
            uid: 0,
            gid: 0,
            modified_at: time::OffsetDateTime::UNIX_EPOCH,
            target: None,
            metadata: Default::default(),
        };
        assert_eq!(entry(info("/")).name, "/");
        assert_eq!(entry(info("/a/b.txt")).name, "b.txt");
    }

    #[test]
    fn owners_may_come_one_id_at_a_time() {
        assert_eq!(content_owner(None, None, None).unwrap(), None);
        assert_eq!(content_owner(Some(5), None, None).unwrap(), Some((5, 0)));
        assert!(content_owner(Some(70000), Some(0), None).is_err());
    }

    #[test]
    fn tokens_are_per_volume() {
        let (a, b) = (Ulid::new(), Ulid::new());
        assert_ne!(volume_token("k", a), volume_token("k", b));
        assert_ne!(volume_token("k", a), volume_token("other", a));
        assert_ne!(volume_token("k", a), super::super::traffic_token("k", a));
    }
}
