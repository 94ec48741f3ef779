//! E2B's template build API over runbox's image builder: a template is an
//! image, a tag another name of the same image, a template build a runbox
//! build.
//!
//! - Names: E2B's `alias[:tag]` is image `alias` for the default tag and
//!   `alias.tag` for another (an alias holds no dot, so the two never
//!   meet). Team namespaces (`team/alias`) are refused.
//! - A build's E2B id is the UUID form of its runbox id (both 128 bits):
//!   `POST /v3/templates` reserves the id, `POST /v2/templates/{id}/builds/{build}`
//!   starts the build with the step list, and the status route reads the
//!   runbox build and its log.
//! - Files: each `COPY` step's files arrive as an archive, uploaded (with
//!   no API key, as E2B's SDKs do) to a link this module signs, and are
//!   stored under E2B's files hash ([`ContextKind::Keyed`]).
//! - E2B's defaults: every build starts as root by making the `user`
//!   account (passwordless sudo) and goes on as `user` in `/home/user`;
//!   `RUN` is given to `/bin/bash -l -c`; a `COPY` belongs to the current
//!   user unless it names one. The start and ready commands are kept as
//!   labels of the image, and a sandbox created from it starts the one
//!   and waits for the other ([`start_template_commands`]).

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use base64::Engine;
use futures::{StreamExt, TryStreamExt};
use hmac::{Hmac, Mac};
use runbox_core::builds::{BuildOptions, ContextKind};
use runbox_core::RunService;
use runbox_types::{Build, BuildRequest, BuildStatus, BuildStepSpec, ExecRequest, Image};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::Sha256;
use time::format_description::well_known::Rfc3339;
use ulid::Ulid;

use super::control::E2bError;
use crate::AppState;

/// The tag a template name without one means.
const DEFAULT_TAG: &str = "default";
/// The account E2B's templates run as.
const TEMPLATE_USER: &str = "user";
/// The shell E2B gives `RUN` commands and start and ready commands:
/// `/bin/bash -l -c`, or `/bin/sh -l -c` in an image without bash (the
/// command follows as `$1`).
const SHELL: [&str; 4] = [
    "/bin/sh",
    "-c",
    "if [ -x /bin/bash ]; then exec /bin/bash -l -c \"$1\"; fi; exec /bin/sh -l -c \"$1\"",
    "e2b",
];
/// How long a file upload link is good for (E2B's SDKs upload for up to
/// an hour).
const UPLOAD_LINK_FOR: Duration = Duration::from_secs(2 * 3600);
/// The image label holding a template's start command.
pub(super) const START_LABEL: &str = "e2b.start-cmd";
/// The image label holding a template's ready command.
pub(super) const READY_LABEL: &str = "e2b.ready-cmd";
/// The most log entries one status answer holds.
const MAX_LOG_PAGE: usize = 100;
/// How long a sandbox's create waits for its template's ready command.
const READY_WAIT: Duration = Duration::from_secs(600);
/// How often the ready command is tried.
const READY_EVERY: Duration = Duration::from_millis(500);

/// The steps every template build starts with, as root: the `user`
/// account with passwordless sudo, then `USER user` and `WORKDIR
/// /home/user`. Their number is [`IMPLICIT_STEPS`]; E2B's step `n` is
/// the build's step `n + IMPLICIT_STEPS`.
fn implicit_steps() -> Vec<BuildStepSpec> {
    let make_user = format!(
        "set -e\n\
         if ! id -u {u} >/dev/null 2>&1; then\n\
         \x20 if command -v useradd >/dev/null 2>&1; then useradd -m -s /bin/bash {u}\n\
         \x20 elif command -v adduser >/dev/null 2>&1; then adduser -D -s /bin/sh {u}\n\
         \x20 else\n\
         \x20   id=1000; while cut -d: -f3 /etc/passwd | grep -qx \"$id\"; do id=$((id + 1)); done\n\
         \x20   echo \"{u}:x:$id:$id::/home/{u}:/bin/sh\" >> /etc/passwd\n\
         \x20   grep -q '^{u}:' /etc/group || echo \"{u}:x:$id:\" >> /etc/group\n\
         \x20 fi\n\
         fi\n\
         passwd -d {u} >/dev/null 2>&1 || true\n\
         if getent group sudo >/dev/null 2>&1; then usermod -aG sudo {u} 2>/dev/null || addgroup {u} sudo 2>/dev/null || true; fi\n\
         mkdir -p /etc/sudoers.d /home/{u}\n\
         echo '{u} ALL=(ALL:ALL) NOPASSWD: ALL' > /etc/sudoers.d/{u}\n\
         chmod 0440 /etc/sudoers.d/{u}\n\
         chown \"{u}:$(id -g {u})\" /home/{u}",
        u = TEMPLATE_USER
    );
    vec![
        spec("USER", &["root"]),
        spec("RUN", &[&make_user]),
        spec("USER", &[TEMPLATE_USER]),
        spec("WORKDIR", &[&format!("/home/{TEMPLATE_USER}")]),
    ]
}

/// How many steps [`implicit_steps`] adds before the caller's.
const IMPLICIT_STEPS: usize = 4;

fn spec(kind: &str, args: &[&str]) -> BuildStepSpec {
    BuildStepSpec {
        kind: kind.to_owned(),
        args: args.iter().map(|a| (*a).to_owned()).collect(),
        files: None,
    }
}

/// The template routes under the API key.
pub(super) fn routes<S: RunService>() -> Router<AppState<S>> {
    Router::new()
        .route("/v3/templates", post(request::<S>))
        .route("/templates/{id}/files/{hash}", get(files::<S>))
        .route("/v2/templates/{id}/builds/{build}", post(start::<S>))
        .route("/templates/{id}/builds/{build}/status", get(status::<S>))
        .route(
            "/templates/tags",
            post(assign_tags::<S>).delete(remove_tags::<S>),
        )
        .route("/templates/{id}/tags", get(list_tags::<S>))
}

/// The file upload route: no API key, the link's signature stands for it.
pub fn upload_routes<S: RunService>() -> Router<AppState<S>> {
    Router::new().route(
        "/templatefiles/{ticket}",
        put(upload::<S>).layer(axum::extract::DefaultBodyLimit::disable()),
    )
}

/// A template name as E2B writes it: `alias[:tag]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct TemplateName {
    alias: String,
    /// None: the default tag.
    tag: Option<String>,
}

impl TemplateName {
    /// Parses `alias[:tag]` (trimmed, lower-cased, as E2B does).
    pub(super) fn parse(raw: &str) -> Result<TemplateName, E2bError> {
        let name = raw.trim().to_ascii_lowercase();
        if name.is_empty() {
            return Err(E2bError::bad("Name is required"));
        }
        if name.contains('/') {
            return Err(E2bError::bad(format!(
                "Invalid name: {name:?}: runbox has no team namespaces; name the template without \"team/\""
            )));
        }
        let (alias, tag) = match name.split_once(':') {
            Some((alias, tag)) => (alias, Some(tag)),
            None => (name.as_str(), None),
        };
        check_alias(alias)?;
        let tag = match tag {
            None => None,
            Some(tag) => {
                check_tag(tag)?;
                (tag != DEFAULT_TAG).then(|| tag.to_owned())
            }
        };
        Ok(TemplateName {
            alias: alias.to_owned(),
            tag,
        })
    }

    fn with_tag(&self, tag: &str) -> TemplateName {
        TemplateName {
            alias: self.alias.clone(),
            tag: (tag != DEFAULT_TAG).then(|| tag.to_owned()),
        }
    }

    /// The image that holds it.
    pub(super) fn image(&self) -> String {
        match &self.tag {
            None => self.alias.clone(),
            Some(tag) => format!("{}.{tag}", self.alias),
        }
    }

    fn tag(&self) -> &str {
        self.tag.as_deref().unwrap_or(DEFAULT_TAG)
    }
}

/// The image a sandbox's `templateID` names: `alias:tag` as a template
/// name, anything else as an image name.
pub(super) fn template_image(template_id: &str) -> String {
    match TemplateName::parse(template_id) {
        Ok(name) if template_id.contains(':') => name.image(),
        _ => template_id.to_owned(),
    }
}

fn check_alias(alias: &str) -> Result<(), E2bError> {
    let ok = !alias.is_empty()
        && alias.len() <= 64
        && alias.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
        && alias
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '_'));
    if ok {
        Ok(())
    } else {
        Err(E2bError::bad(format!(
            "Invalid name: {alias:?}: use 1-64 characters of a-z, 0-9, '-' and '_', starting with a letter or digit"
        )))
    }
}

fn check_tag(tag: &str) -> Result<(), E2bError> {
    let ok = !tag.is_empty()
        && tag.len() <= 63
        && tag
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '_' | '.'))
        && uuid::Uuid::parse_str(tag).is_err();
    if ok {
        Ok(())
    } else {
        Err(E2bError::bad(format!(
            "Invalid tag: {tag:?}: use 1-63 characters of a-z, 0-9, '-', '_' and '.' (not a UUID)"
        )))
    }
}

/// A build id in E2B's form.
fn build_uuid(id: Ulid) -> String {
    uuid::Uuid::from_u128(id.0).hyphenated().to_string()
}

/// A build id from E2B's form.
fn parse_build(raw: &str) -> Result<Ulid, E2bError> {
    uuid::Uuid::parse_str(raw)
        .map(|u| Ulid(u.as_u128()))
        .map_err(|_| E2bError::bad(format!("Invalid build ID: {raw:?} is not a UUID")))
}

/// The E2B build id of a built image (`source: build:<id>`), if it is one.
fn image_build(image: &Image) -> Option<String> {
    image
        .source
        .strip_prefix(runbox_core::builds::BUILD_SOURCE_PREFIX)
        .and_then(|id| Ulid::from_string(id).ok())
        .map(build_uuid)
}

/// Whether `owner` may use `image`: a shared one (the operator's) or its own.
fn visible(owner: &runbox_core::tenants::Owner, image: &Image) -> bool {
    image.tenant.is_none() || owner.sees(image.tenant.as_deref())
}

/// A JSON body, read leniently (E2B's SDKs send fields runbox ignores).
fn json_body<T: for<'de> Deserialize<'de>>(bytes: &Bytes) -> Result<T, E2bError> {
    serde_json::from_slice(bytes).map_err(|e| E2bError::bad(format!("Invalid request body: {e}")))
}

// ---------------------------------------------------------------------
// POST /v3/templates

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RequestBody {
    name: Option<String>,
    /// Deprecated form of `name`.
    alias: Option<String>,
    #[serde(default)]
    tags: Option<Vec<String>>,
}

/// What a reservation notes: the template and the tags its build gets.
#[derive(Debug, Serialize, Deserialize)]
struct Reserved {
    alias: String,
    tags: Vec<String>,
}

/// `POST /v3/templates`: reserves a build of template `name` (with its
/// `:tag` and `tags`); `202` with the ids. The build starts with the
/// `/v2/.../builds/{buildID}` call.
async fn request<S: RunService>(
    State(state): State<AppState<S>>,
    caller: crate::auth::Caller,
    bytes: Bytes,
) -> Result<Response, E2bError> {
    let body: RequestBody = json_body(&bytes)?;
    let raw = body
        .name
        .or(body.alias)
        .ok_or_else(|| E2bError::bad("Name is required"))?;
    let name = TemplateName::parse(&raw)?;
    let mut tags: Vec<String> = Vec::new();
    let given = name
        .tag
        .iter()
        .cloned()
        .chain(body.tags.unwrap_or_default());
    for tag in given {
        let tag = tag.trim().to_ascii_lowercase();
        check_tag(&tag)?;
        if !tags.contains(&tag) {
            tags.push(tag);
        }
    }
    if tags.is_empty() {
        tags.push(DEFAULT_TAG.to_owned());
    }
    for tag in &tags {
        runbox_core::validate::new_image_name(&name.with_tag(tag).image())?;
    }
    let owner = caller.owner();
    // A template of another tenant's is not built over.
    if let Ok(image) = state.service.get_image(&name.alias) {
        if !owner.sees(image.tenant.as_deref())
            || (image.tenant.is_none() && owner.tenant().is_some())
        {
            return Err(E2bError::new(
                StatusCode::FORBIDDEN,
                format!("Alias '{}' already used", name.alias),
            ));
        }
    }
    let note = Reserved {
        alias: name.alias.clone(),
        tags: tags.clone(),
    };
    let id = state.service.reserve_build(
        &owner,
        serde_json::to_value(&note).map_err(|e| E2bError::bad(e.to_string()))?,
    )?;
    Ok((
        StatusCode::ACCEPTED,
        Json(serde_json::json!({
            "templateID": name.alias,
            "buildID": build_uuid(id),
            "public": false,
            "names": [name.alias],
            "aliases": [name.alias],
            "tags": tags,
        })),
    )
        .into_response())
}

// ---------------------------------------------------------------------
// Files

fn check_hash(hash: &str) -> Result<(), E2bError> {
    if hash.len() == 64 && hash.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        Ok(())
    } else {
        Err(E2bError::bad(format!(
            "Invalid files hash {hash:?}: 64 lowercase hex digits"
        )))
    }
}

/// What an upload link stands for.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Ticket {
    /// The files hash.
    h: String,
    /// The tenant uploading (None: the operator).
    t: Option<String>,
    /// Good until (Unix seconds).
    e: i64,
}

/// The MAC of a ticket's payload under the daemon token.
fn ticket_mac(daemon_token: &str, payload: &str) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(daemon_token.as_bytes())
        .expect("HMAC accepts any key length");
    mac.update(b"runbox-template-files\0");
    mac.update(payload.as_bytes());
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes())
}

fn sign_ticket(daemon_token: &str, ticket: &Ticket) -> String {
    let json = serde_json::to_vec(ticket).expect("a ticket serialises");
    let payload = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(json);
    let mac = ticket_mac(daemon_token, &payload);
    format!("{payload}.{mac}")
}

/// The ticket `raw` carries, if its signature is the daemon's and it has
/// not expired.
fn read_ticket(daemon_token: &str, raw: &str, now: i64) -> Result<Ticket, E2bError> {
    let refused = || E2bError::new(StatusCode::UNAUTHORIZED, "invalid or expired upload link");
    let (payload, mac) = raw.split_once('.').ok_or_else(refused)?;
    let expected = ticket_mac(daemon_token, payload);
    if !bool::from(subtle::ConstantTimeEq::ct_eq(
        expected.as_bytes(),
        mac.as_bytes(),
    )) {
        return Err(refused());
    }
    let json = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload)
        .map_err(|_| refused())?;
    let ticket: Ticket = serde_json::from_slice(&json).map_err(|_| refused())?;
    if ticket.e < now {
        return Err(refused());
    }
    Ok(ticket)
}

/// Where the caller reached this daemon: the host the request came to
/// (`https` behind a proxy that says so).
fn origin(headers: &HeaderMap) -> String {
    let host = headers
        .get(axum::http::header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("127.0.0.1");
    let scheme = headers
        .get("x-forwarded-proto")
        .and_then(|h| h.to_str().ok())
        .filter(|p| *p == "https")
        .unwrap_or("http");
    format!("{scheme}://{host}")
}

/// `GET /templates/{id}/files/{hash}`: whether the files are here
/// (`present`), and always a link to upload them to (E2B's forced
/// uploads use it when present); `201`.
async fn files<S: RunService>(
    State(state): State<AppState<S>>,
    caller: crate::auth::Caller,
    headers: HeaderMap,
    Path((_id, hash)): Path<(String, String)>,
) -> Result<Response, E2bError> {
    check_hash(&hash)?;
    let owner = caller.owner();
    let present = state
        .service
        .has_build_context(&owner, ContextKind::Keyed, &hash)?;
    let ticket = Ticket {
        h: hash,
        t: owner.tenant().map(str::to_owned),
        e: time::OffsetDateTime::now_utc().unix_timestamp() + UPLOAD_LINK_FOR.as_secs() as i64,
    };
    let url = format!(
        "{}/templatefiles/{}",
        origin(&headers),
        sign_ticket(&state.token, &ticket)
    );
    Ok((
        StatusCode::CREATED,
        Json(serde_json::json!({ "present": present, "url": url })),
    )
        .into_response())
}

/// `PUT /templatefiles/{ticket}`: the files of one `COPY` step, a tar
/// (plain or gzip) checked entry by entry, stored under the hash the
/// link was signed for.
async fn upload<S: RunService>(
    State(state): State<AppState<S>>,
    Path(raw): Path<String>,
    body: Body,
) -> Result<Response, E2bError> {
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    let ticket = read_ticket(&state.token, &raw, now)?;
    let owner = match &ticket.t {
        None => runbox_core::tenants::Owner::root(),
        Some(name) => match state.service.tenants().get(name) {
            Some(entry) => runbox_core::tenants::Owner(Some(entry)),
            None => {
                return Err(E2bError::new(
                    StatusCode::UNAUTHORIZED,
                    "the tenant this upload link was made for no longer exists",
                ))
            }
        },
    };
    let stream = body
        .into_data_stream()
        .map_err(std::io::Error::other)
        .boxed();
    let stored = state
        .service
        .put_build_context(owner, ContextKind::Keyed, ticket.h, stream)
        .await?;
    Ok((StatusCode::CREATED, Json(stored)).into_response())
}

// ---------------------------------------------------------------------
// POST /v2/templates/{id}/builds/{build}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct StartBody {
    from_image: Option<String>,
    from_template: Option<String>,
    from_image_registry: Option<Value>,
    #[serde(default)]
    force: bool,
    #[serde(default)]
    steps: Vec<E2bStep>,
    start_cmd: Option<String>,
    ready_cmd: Option<String>,
}

/// One step as E2B's SDKs send it (the JS SDK adds fields of its own,
/// which are ignored).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct E2bStep {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    args: Vec<String>,
    files_hash: Option<String>,
    #[serde(default)]
    force: bool,
}

/// The part of a `COPY` source before its first pattern: E2B copies what
/// the pattern matched from there (`folder/*` copies `folder`'s matched
/// entries into the destination).
fn copy_base(source: &str) -> String {
    let parts: Vec<&str> = source
        .split('/')
        .filter(|p| !p.is_empty() && *p != ".")
        .collect();
    let fixed: Vec<&str> = parts
        .iter()
        .take_while(|p| !p.contains(['*', '?', '[', '{']))
        .copied()
        .collect();
    if fixed.is_empty() {
        ".".to_owned()
    } else {
        fixed.join("/")
    }
}

/// E2B's steps as runbox's step list, after [`implicit_steps`]: `COPY`
/// takes the part of its source before any pattern and, unless it names
/// an owner, belongs to the user current at that step; `ADD` is `COPY`
/// and `ARG` is `ENV`, as E2B's builder has them.
fn translate(steps: &[E2bStep]) -> Result<Vec<BuildStepSpec>, E2bError> {
    let mut out = implicit_steps();
    let mut user = TEMPLATE_USER.to_owned();
    for (index, step) in steps.iter().enumerate() {
        let n = index + 1;
        let kind = step.kind.to_ascii_uppercase();
        let spec = match kind.as_str() {
            "RUN" | "ENV" | "WORKDIR" => BuildStepSpec {
                kind,
                args: step.args.clone(),
                files: None,
            },
            "ARG" => BuildStepSpec {
                kind: "ENV".into(),
                args: step.args.clone(),
                files: None,
            },
            "USER" => {
                if let Some(name) = step.args.first() {
                    user = name.clone();
                }
                BuildStepSpec {
                    kind,
                    args: step.args.iter().take(1).cloned().collect(),
                    files: None,
                }
            }
            "COPY" | "ADD" => {
                let Some(hash) = step.files_hash.clone() else {
                    return Err(E2bError::bad(format!(
                        "step {n}: COPY needs filesHash (upload its files first)"
                    )));
                };
                check_hash(&hash)?;
                let [source, dest, rest @ ..] = step.args.as_slice() else {
                    return Err(E2bError::bad(format!(
                        "step {n}: COPY takes [source, destination, user?, mode?]"
                    )));
                };
                let owner = rest
                    .first()
                    .filter(|u| !u.is_empty())
                    .cloned()
                    .unwrap_or_else(|| user.clone());
                let mode = rest.get(1).cloned().unwrap_or_default();
                BuildStepSpec {
                    kind: "COPY".into(),
                    args: vec![copy_base(source), dest.clone(), owner, mode],
                    files: Some(hash),
                }
            }
            other => {
                return Err(E2bError::bad(format!(
                    "step {n}: unknown step type {other:?}; E2B's builder takes RUN, COPY, ADD, ENV, ARG, WORKDIR and USER"
                )))
            }
        };
        out.push(spec);
    }
    Ok(out)
}

/// The base image a build names: a template (`fromTemplate`, as a template
/// name), or an image reference (`fromImage`): a stored image pulled from
/// it, else a stored image of the name a pull of it would get
/// (`ubuntu:22.04` → `ubuntu-22.04`, `e2bdev/base` → `base`: what an
/// operator without registry access imports), else the reference, pulled.
fn base_of<S: RunService>(
    state: &AppState<S>,
    owner: &runbox_core::tenants::Owner,
    body: &StartBody,
) -> Result<String, E2bError> {
    let visible = |name: &str| {
        state
            .service
            .get_image(name)
            .ok()
            .filter(|i| visible(owner, i))
    };
    match (&body.from_template, &body.from_image) {
        (Some(template), _) => {
            let image = TemplateName::parse(template)?.image();
            visible(&image)
                .map(|i| i.name)
                .ok_or_else(|| E2bError::bad(format!("template {template:?} was not found")))
        }
        (None, Some(reference)) => {
            let reference = reference.trim();
            if reference.is_empty() {
                return Err(E2bError::bad("fromImage is empty"));
            }
            if let Some(image) = visible(reference) {
                return Ok(image.name);
            }
            let pulled = state
                .service
                .list_images()
                .unwrap_or_default()
                .into_iter()
                .any(|i| runbox_core::images::same_reference(&i.source, reference));
            if !pulled {
                let local = runbox_core::images::default_name(reference);
                if let Some(image) = visible(&local) {
                    return Ok(image.name);
                }
            }
            Ok(reference.to_owned())
        }
        (None, None) => Err(E2bError::bad(
            "Invalid request body: name the base in fromImage or fromTemplate",
        )),
    }
}

/// `POST /v2/templates/{id}/builds/{build}`: starts a reserved build with
/// its steps; `202`, after which its status is `building`.
async fn start<S: RunService>(
    State(state): State<AppState<S>>,
    caller: crate::auth::Caller,
    Path((id, build)): Path<(String, String)>,
    bytes: Bytes,
) -> Result<Response, E2bError> {
    let build_id = parse_build(&build)?;
    let owner = caller.owner();
    let Some(note) = state.service.reserved_build(build_id, &owner)? else {
        return Err(match state.service.get_build(build_id, &owner) {
            Ok(_) => E2bError::bad("build is not in waiting state"),
            Err(_) => E2bError::new(StatusCode::NOT_FOUND, format!("Build '{build}' not found")),
        });
    };
    let note: Reserved = serde_json::from_value(note)
        .map_err(|e| E2bError::bad(format!("the build's reservation is unreadable: {e}")))?;
    let template = TemplateName::parse(&id)?;
    if template.alias != note.alias {
        return Err(E2bError::bad(format!(
            "build {build} is of template {:?}, not {id:?}",
            note.alias
        )));
    }
    let body: StartBody = json_body(&bytes)?;
    if body
        .from_image_registry
        .as_ref()
        .is_some_and(|r| !r.is_null())
    {
        return Err(E2bError::bad(
            "registry credentials for a template's base are not taken here: pull the image into runbox first (POST /v1/images/pull with username and password) and name it in fromImage",
        ));
    }
    let from = base_of(&state, &owner, &body)?;
    let steps = translate(&body.steps)?;
    let mut labels = std::collections::BTreeMap::new();
    for (key, value) in [
        (START_LABEL, &body.start_cmd),
        (READY_LABEL, &body.ready_cmd),
    ] {
        if let Some(value) = value.as_deref().filter(|v| !v.trim().is_empty()) {
            labels.insert(key.to_owned(), value.to_owned());
        }
    }
    let mut names = note.tags.iter().map(|t| template.with_tag(t).image());
    let name = names.next().unwrap_or_else(|| template.image());
    let req = BuildRequest {
        name,
        steps: Some(steps),
        from: Some(from),
        no_cache: body.force || body.steps.iter().any(|s| s.force),
        labels: (!labels.is_empty()).then_some(labels),
        ..Default::default()
    };
    let options = BuildOptions {
        id: Some(build_id),
        shell: Some(SHELL.iter().map(|s| (*s).to_owned()).collect()),
        files: ContextKind::Keyed,
        also: names.collect(),
    };
    state.service.start_build(req, owner, options).await?;
    Ok(StatusCode::ACCEPTED.into_response())
}

// ---------------------------------------------------------------------
// GET /templates/{id}/builds/{build}/status

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct StatusQuery {
    logs_offset: Option<u64>,
    limit: Option<usize>,
    level: Option<String>,
}

/// E2B's step name of runbox step `index` (1-based; 0: the build itself):
/// the implicit steps and the base are `base`.
fn e2b_step(index: usize) -> String {
    if index > IMPLICIT_STEPS {
        (index - IMPLICIT_STEPS).to_string()
    } else {
        "base".to_owned()
    }
}

/// A failed build's reason, in E2B's words where E2B has them: a failed
/// command is `failed to run command '<cmd>': command failed: <why>`.
fn reason(build: &Build) -> Value {
    let Some(error) = &build.error else {
        return serde_json::json!({ "message": format!("the build ended {:?}", build.status) });
    };
    let step = match error.step {
        Some(index) => e2b_step(index),
        // Before any step ran: the base (its pull, its plan).
        None if build
            .steps
            .iter()
            .all(|s| s.status == runbox_types::BuildStepStatus::Pending) =>
        {
            "base".to_owned()
        }
        None if build.status == BuildStatus::Cancelled => "base".to_owned(),
        None => "finalize".to_owned(),
    };
    // The implicit steps' script is runbox's, not the caller's command.
    let command = error
        .step
        .filter(|i| *i > IMPLICIT_STEPS)
        .and_then(|i| build.steps.get(i - 1))
        .and_then(|s| s.text.strip_prefix("RUN "))
        .map(|text| match text.rsplit_once(" (as ") {
            Some((command, user)) if user.ends_with(')') => command.to_owned(),
            _ => text.to_owned(),
        });
    let message = match (command, error.exit_code) {
        (Some(cmd), Some(code)) => {
            format!("failed to run command '{cmd}': command failed: exit status {code}")
        }
        (Some(cmd), None) if error.code == "bad_user" => {
            let user = error
                .message
                .split('"')
                .nth(1)
                .or_else(|| error.message.split('\'').nth(1))
                .unwrap_or_default();
            format!(
                "failed to run command '{cmd}': command failed: unauthenticated: invalid username: '{user}'"
            )
        }
        (Some(cmd), None) => {
            format!("failed to run command '{cmd}': command failed: {}", error.message)
        }
        (None, _) if error.step.is_some_and(|i| i <= IMPLICIT_STEPS) => format!(
            "setting up the template's {TEMPLATE_USER:?} account failed (the base needs /bin/sh and a writable /etc/passwd): {}",
            error.message
        ),
        (None, _) => error.message.clone(),
    };
    serde_json::json!({ "message": message, "step": step })
}

/// `GET /templates/{id}/builds/{build}/status`: the status and the log
/// entries from `logsOffset` (at most `limit`, 100); an empty page once
/// the log is read out.
async fn status<S: RunService>(
    State(state): State<AppState<S>>,
    caller: crate::auth::Caller,
    Path((id, build)): Path<(String, String)>,
    Query(query): Query<StatusQuery>,
) -> Result<Response, E2bError> {
    let build_id = parse_build(&build)?;
    let owner = caller.owner();
    let answer = |status: &str, entries: Vec<Value>, reason: Option<Value>| {
        let logs: Vec<String> = entries
            .iter()
            .map(|e| {
                format!(
                    "[{}] {}\n",
                    e["timestamp"].as_str().unwrap_or_default(),
                    e["message"].as_str().unwrap_or_default()
                )
            })
            .collect();
        let mut body = serde_json::json!({
            "templateID": id,
            "buildID": build,
            "status": status,
            "logs": logs,
            "logEntries": entries,
        });
        if let Some(reason) = reason {
            body["reason"] = reason;
        }
        Json(body).into_response()
    };
    if state.service.reserved_build(build_id, &owner)?.is_some() {
        return Ok(answer("waiting", Vec::new(), None));
    }
    let found = state
        .service
        .get_build(build_id, &owner)
        .map_err(|_| E2bError::new(StatusCode::NOT_FOUND, format!("Build '{build}' not found")))?;
    let limit = query.limit.unwrap_or(MAX_LOG_PAGE).min(MAX_LOG_PAGE);
    let lines = state
        .service
        .build_log(build_id, &owner, query.logs_offset.unwrap_or(0), limit)?;
    let wanted = query.level.as_deref().map(level_rank).unwrap_or(0);
    let entries: Vec<Value> = lines
        .into_iter()
        .map(|line| {
            let level = if line.stream == "build" && line.text.starts_with("warning:") {
                "warn"
            } else {
                "info"
            };
            let timestamp = line.time.format(&Rfc3339).unwrap_or_default();
            (
                level,
                serde_json::json!({
                    "timestamp": timestamp,
                    "level": level,
                    "message": line.text,
                    "step": e2b_step(line.step),
                }),
            )
        })
        .filter(|(level, _)| level_rank(level) >= wanted)
        .map(|(_, entry)| entry)
        .collect();
    let (status, why) = match found.status {
        BuildStatus::Building => ("building", None),
        BuildStatus::Ready => ("ready", None),
        BuildStatus::Failed | BuildStatus::Cancelled => ("error", Some(reason(&found))),
    };
    Ok(answer(status, entries, why))
}

fn level_rank(level: &str) -> u8 {
    match level {
        "debug" => 0,
        "info" => 1,
        "warn" => 2,
        "error" => 3,
        _ => 0,
    }
}

// ---------------------------------------------------------------------
// Tags

/// The template images `caller` sees, by tag, for template `alias`.
fn tagged<S: RunService>(
    state: &AppState<S>,
    owner: &runbox_core::tenants::Owner,
    alias: &str,
) -> Vec<(String, Image)> {
    let prefix = format!("{alias}.");
    state
        .service
        .list_images()
        .unwrap_or_default()
        .into_iter()
        .filter(|i| visible(owner, i))
        .filter(|i| image_build(i).is_some())
        .filter_map(|i| {
            let tag = if i.name == alias {
                DEFAULT_TAG.to_owned()
            } else {
                i.name.strip_prefix(&prefix)?.to_owned()
            };
            Some((tag, i))
        })
        .collect()
}

#[derive(Debug, Deserialize)]
struct AssignBody {
    target: String,
    #[serde(default)]
    tags: Vec<String>,
}

/// `POST /templates/tags`: names the build `target` (`alias:tag`) points
/// at also by each of `tags`; `201`.
async fn assign_tags<S: RunService>(
    State(state): State<AppState<S>>,
    caller: crate::auth::Caller,
    bytes: Bytes,
) -> Result<Response, E2bError> {
    let body: AssignBody = json_body(&bytes)?;
    if body.tags.is_empty() {
        return Err(E2bError::bad("Invalid request body: name at least one tag"));
    }
    let target = TemplateName::parse(&body.target)?;
    let owner = caller.owner();
    let source = target.image();
    let image = state
        .service
        .get_image(&source)
        .ok()
        .filter(|i| visible(&owner, i) && image_build(i).is_some())
        .ok_or_else(|| {
            E2bError::new(
                StatusCode::NOT_FOUND,
                format!(
                    "Template '{}' with tag '{}' not found",
                    target.alias,
                    target.tag()
                ),
            )
        })?;
    let mut tags = Vec::new();
    for tag in &body.tags {
        check_tag(tag)?;
        if !tags.contains(tag) {
            tags.push(tag.clone());
        }
    }
    for tag in &tags {
        let to = target.with_tag(tag).image();
        if to != source {
            state
                .service
                .tag_built_image(source.clone(), to, owner.clone())
                .await?;
        }
    }
    Ok((
        StatusCode::CREATED,
        Json(serde_json::json!({
            "buildID": image_build(&image).unwrap_or_default(),
            "tags": tags,
        })),
    )
        .into_response())
}

#[derive(Debug, Deserialize)]
struct RemoveBody {
    name: String,
    #[serde(default)]
    tags: Vec<String>,
}

/// `DELETE /templates/tags`: removes tags (not `default`) of template
/// `name`; `204`.
async fn remove_tags<S: RunService>(
    State(state): State<AppState<S>>,
    caller: crate::auth::Caller,
    bytes: Bytes,
) -> Result<Response, E2bError> {
    let body: RemoveBody = json_body(&bytes)?;
    if body.name.contains(':') {
        return Err(E2bError::bad(
            "name the template without a tag; the tags to remove go in tags",
        ));
    }
    if body.tags.is_empty() {
        return Err(E2bError::bad("Invalid request body: name at least one tag"));
    }
    let template = TemplateName::parse(&body.name)?;
    let owner = caller.owner();
    let have = tagged(&state, &owner, &template.alias);
    for tag in &body.tags {
        check_tag(tag)?;
        if tag == DEFAULT_TAG {
            return Err(E2bError::bad(
                "the default tag cannot be removed; delete the template",
            ));
        }
        if !have
            .iter()
            .any(|(t, i)| t == tag && i.tenant.as_deref() == owner.tenant())
        {
            return Err(E2bError::new(
                StatusCode::NOT_FOUND,
                format!("Template '{}' with tag '{tag}' not found", template.alias),
            ));
        }
    }
    for tag in &body.tags {
        state
            .service
            .delete_image(template.with_tag(tag).image())
            .await?;
    }
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `GET /templates/{id}/tags`: the template's tags, each with its build.
async fn list_tags<S: RunService>(
    State(state): State<AppState<S>>,
    caller: crate::auth::Caller,
    Path(id): Path<String>,
) -> Result<Response, E2bError> {
    let template = TemplateName::parse(&id)?;
    let owner = caller.owner();
    let mut tags: Vec<Value> = tagged(&state, &owner, &template.alias)
        .into_iter()
        .map(|(tag, image)| {
            serde_json::json!({
                "tag": tag,
                "buildID": image_build(&image).unwrap_or_default(),
                "createdAt": image.created_at.format(&Rfc3339).unwrap_or_default(),
            })
        })
        .collect();
    if tags.is_empty() {
        return Err(E2bError::new(
            StatusCode::NOT_FOUND,
            format!("template '{}' was not found", template.alias),
        ));
    }
    tags.sort_by(|a, b| a["tag"].as_str().cmp(&b["tag"].as_str()));
    Ok(Json(tags).into_response())
}

/// The images of template `id` (every tag, the default last) that
/// `caller` may delete: its own, or any for the operator. None for an id
/// with a tag, or one that names no template built here.
pub(super) fn template_images<S: RunService>(
    state: &AppState<S>,
    caller: &crate::auth::Caller,
    id: &str,
) -> Vec<String> {
    let Ok(template) = TemplateName::parse(id) else {
        return Vec::new();
    };
    if id.contains(':') {
        return Vec::new();
    }
    let owner = caller.owner();
    let mut images: Vec<(String, Image)> = tagged(state, &owner, &template.alias)
        .into_iter()
        .filter(|(_, i)| owner.tenant().is_none() || i.tenant.as_deref() == owner.tenant())
        .collect();
    images.sort_by_key(|(tag, _)| tag == DEFAULT_TAG);
    images.into_iter().map(|(_, i)| i.name).collect()
}

// ---------------------------------------------------------------------
// Sandboxes from a template

/// Starts the start command of run `id`'s template image in the
/// background and waits until its ready command succeeds (tried every
/// half second, for up to ten minutes), as the image's user in its
/// working directory. Nothing to do for an image without them.
pub(super) async fn start_template_commands<S: RunService>(
    state: &AppState<S>,
    id: Ulid,
    image: &Image,
) -> Result<(), E2bError> {
    let start = image.labels.get(START_LABEL);
    let ready = image.labels.get(READY_LABEL);
    if start.is_none() && ready.is_none() {
        return Ok(());
    }
    let config = image.config.as_ref().map(|c| &c["config"]);
    let field = |key: &str| {
        config
            .and_then(|c| c[key].as_str())
            .filter(|v| !v.is_empty())
            .map(str::to_owned)
    };
    let command = |cmd: &str| ExecRequest {
        cmd: SHELL
            .iter()
            .map(|s| (*s).to_owned())
            .chain([cmd.to_owned()])
            .collect(),
        user: field("User"),
        cwd: field("WorkingDir"),
        ..Default::default()
    };
    if let Some(start) = start {
        let mut req = command(start);
        req.tag = Some("e2b-start".to_owned());
        state.service.start_process(id, req).await?;
    }
    let Some(ready) = ready else {
        return Ok(());
    };
    let until = tokio::time::Instant::now() + READY_WAIT;
    loop {
        let mut req = command(ready);
        req.timeout_sec = Some(60);
        let mut events = state.service.exec(id, req).await?;
        let mut code = None;
        while let Some(event) = events.next().await {
            if let runbox_core::runs::ExecEvent::Exit(exit) = event {
                code = Some(exit.exit_code);
            }
        }
        if code == Some(0) {
            return Ok(());
        }
        if tokio::time::Instant::now() >= until {
            return Err(E2bError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!(
                    "the template's ready command {ready:?} did not succeed within {} s",
                    READY_WAIT.as_secs()
                ),
            ));
        }
        tokio::time::sleep(READY_EVERY).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn template_names_map_to_image_names() {
        let name = TemplateName::parse(" My-App ").unwrap();
        assert_eq!(name.image(), "my-app");
        assert_eq!(TemplateName::parse("app:default").unwrap().image(), "app");
        assert_eq!(TemplateName::parse("app:v1.2").unwrap().image(), "app.v1.2");
        assert_eq!(name.with_tag("prod").image(), "my-app.prod");
        for bad in ["", "team/app", "app:", ":tag", "a.b", "app:a b", "-app"] {
            assert!(TemplateName::parse(bad).is_err(), "{bad:?}");
        }
        assert!(
            TemplateName::parse("app:6ba7b810-9dad-11d1-80b4-00c04fd430c8").is_err(),
            "a tag is never a UUID"
        );
        assert_eq!(template_image("base"), "base");
        assert_eq!(template_image("base:default"), "base");
        assert_eq!(template_image("app:v1"), "app.v1");
        assert_eq!(template_image("python3.11"), "python3.11");
    }

    #[test]
    fn build_ids_are_uuids_of_ulids() {
        let id = Ulid::new();
        let uuid = build_uuid(id);
        assert_eq!(uuid.len(), 36);
        assert_eq!(parse_build(&uuid).unwrap(), id);
        assert!(parse_build("not-a-uuid").is_err());
    }

    #[test]
    fn upload_tickets_are_signed_and_expire() {
        let ticket = Ticket {
            h: "a".repeat(64),
            t: Some("acme".into()),
            e: 1000,
        };
        let raw = sign_ticket("daemon", &ticket);
        assert_eq!(read_ticket("daemon", &raw, 999).unwrap(), ticket);
        assert!(
            read_ticket("other", &raw, 999).is_err(),
            "another daemon's key"
        );
        assert!(read_ticket("daemon", &raw, 1001).is_err(), "expired");
        let (payload, mac) = raw.split_once('.').unwrap();
        let forged = Ticket { t: None, ..ticket };
        let forged_payload = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .encode(serde_json::to_vec(&forged).unwrap());
        assert!(read_ticket("daemon", &format!("{forged_payload}.{mac}"), 999).is_err());
        assert!(read_ticket("daemon", payload, 999).is_err(), "no signature");
    }

    #[test]
    fn steps_translate_with_e2bs_defaults() {
        let step = |kind: &str, args: &[&str], hash: Option<&str>| E2bStep {
            kind: kind.into(),
            args: args.iter().map(|a| a.to_string()).collect(),
            files_hash: hash.map(str::to_owned),
            force: false,
        };
        let hash = "b".repeat(64);
        let out = translate(&[
            step("COPY", &["folder/*", "folder", "", ""], Some(&hash)),
            step("USER", &["root"], None),
            step("COPY", &["a/b.txt", "/x/c.txt", "", "0755"], Some(&hash)),
            step("COPY", &["*.txt", "t", "bob", ""], Some(&hash)),
            step("ARG", &["A", "1"], None),
            step("RUN", &["whoami", "root"], None),
        ])
        .unwrap();
        assert_eq!(out.len(), IMPLICIT_STEPS + 6);
        let mine = &out[IMPLICIT_STEPS..];
        assert_eq!(mine[0].args, ["folder", "folder", "user", ""]);
        assert_eq!(mine[0].files.as_deref(), Some(hash.as_str()));
        assert_eq!(mine[2].args, ["a/b.txt", "/x/c.txt", "root", "0755"]);
        assert_eq!(mine[3].args, [".", "t", "bob", ""]);
        assert_eq!(mine[4].kind, "ENV");
        assert_eq!(mine[5].args, ["whoami", "root"]);
        assert!(translate(&[step("COPY", &["a", "b"], None)]).is_err());
        assert!(translate(&[step("FROB", &[], None)]).is_err());
        assert_eq!(e2b_step(1), "base");
        assert_eq!(e2b_step(IMPLICIT_STEPS + 1), "1");
    }
}
