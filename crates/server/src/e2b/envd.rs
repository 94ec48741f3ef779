//! envd over runs: the Connect services `process.Process` and
//! `filesystem.Filesystem`, `GET/POST /files`, `/health` and `/envs`.
//!
//! A process is a runbox background process (so a second client can
//! `Connect` to it, list it, signal it), and its event stream is an
//! attach with replay. Paths are absolute in the run's root filesystem
//! ([`Scope::Root`]), confined to the run by its agent; a relative path is
//! taken from `/work`, the runbox working directory.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Extension, FromRequest, Multipart, Path, RawQuery, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use bytes::Bytes;
use futures::stream::{self, BoxStream, StreamExt, TryStreamExt};
use runbox_core::runs::{ExecEvent, Scope, WriteOptions};
use runbox_core::RunService;
use runbox_types::{
    ExecRequest, ExitReason, FileInfo, FileKind, FsQuery, PtySpec, SignalRequest, SignalSpec,
};
use serde::Deserialize;
use ulid::Ulid;

use super::caller::{basic_user, Caller, Names};
use super::connect::{self, Code, Framing, RpcError};
use super::wire;
use super::{envd_error, SandboxId};
use crate::conn::{severable, Sever, Severable};
use crate::AppState;

/// The most filesystem watchers open at once, over all sandboxes.
const MAX_WATCHERS: usize = 256;

/// The most events a watcher holds between two polls; older ones are
/// dropped first.
const MAX_WATCHER_EVENTS: usize = 4096;

/// The longest keepalive interval a client may ask for.
const MAX_KEEPALIVE: Duration = Duration::from_secs(300);

/// What the envd handlers reach.
#[derive(Clone)]
pub struct Envd<S> {
    pub app: AppState<S>,
    pub watchers: Arc<Watchers>,
}

/// The polling watchers (`CreateWatcher`, `GetWatcherEvents`,
/// `RemoveWatcher`): each a task filling a bounded buffer.
#[derive(Default)]
pub struct Watchers {
    open: Mutex<HashMap<String, Watcher>>,
}

struct Watcher {
    run: Ulid,
    events: Arc<Mutex<Vec<wire::FilesystemEvent>>>,
    task: tokio::task::AbortHandle,
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub fn routes<S: RunService>(state: Envd<S>) -> Router {
    Router::new()
        .route("/process.Process/{method}", post(process::<S>))
        .route("/filesystem.Filesystem/{method}", post(filesystem::<S>))
        .route(
            "/files",
            get(download::<S>)
                .post(upload::<S>)
                .layer(axum::extract::DefaultBodyLimit::disable()),
        )
        .route("/health", get(|| async { StatusCode::NO_CONTENT }))
        .route("/envs", get(envs::<S>))
        .fallback(|| async {
            envd_error(StatusCode::NOT_FOUND, "no such envd route; see docs/e2b.md")
        })
        .with_state(state)
}

fn selector(process: Option<wire::Selector>) -> Result<String, RpcError> {
    process
        .map(|s| s.reference())
        .ok_or_else(|| RpcError::invalid("name the process (process.pid or process.tag)"))
}

/// The interval of keepalive messages a stream sends, from
/// `Keepalive-Ping-Interval` (seconds).
fn keepalive(headers: &HeaderMap) -> Option<Duration> {
    let secs: u64 = headers
        .get("keepalive-ping-interval")?
        .to_str()
        .ok()?
        .parse()
        .ok()?;
    (secs > 0).then(|| Duration::from_secs(secs).min(MAX_KEEPALIVE))
}

/// `stream` with `ping` interleaved every `every`, ended (with
/// `deadline_exceeded`) when `deadline` passes.
fn paced<T: Send + 'static>(
    stream: BoxStream<'static, Result<T, RpcError>>,
    every: Option<Duration>,
    ping: fn() -> T,
    deadline: Option<Duration>,
) -> BoxStream<'static, Result<T, RpcError>> {
    let pings = match every {
        Some(every) => {
            let mut interval = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            stream::unfold(interval, move |mut i| async move {
                i.tick().await;
                Some((Ok(ping()), i))
            })
            .boxed()
        }
        None => stream::pending().boxed(),
    };
    // Pings run only while the stream does.
    let merged = stream::select_with_strategy(
        stream.map(Some).chain(stream::once(async { None })),
        pings.map(Some),
        |_: &mut ()| stream::PollNext::Left,
    )
    .take_while(|item| futures::future::ready(item.is_some()))
    .filter_map(futures::future::ready);
    let merged = merged.boxed();
    let Some(limit) = deadline else {
        return merged;
    };
    let timer = Box::pin(tokio::time::sleep(limit));
    stream::unfold(Some((merged, timer)), |state| async move {
        let (mut merged, mut timer) = state?;
        tokio::select! {
            item = merged.next() => item.map(|item| (item, Some((merged, timer)))),
            () = &mut timer => {
                let e = RpcError::new(Code::DeadlineExceeded, "the call's deadline (its timeout) passed");
                Some((Err(e), None))
            }
        }
    })
    .boxed()
}

// --- process.Process ---

async fn process<S: RunService>(
    State(envd): State<Envd<S>>,
    Extension(SandboxId(id)): Extension<SandboxId>,
    Path(method): Path<String>,
    version: axum::http::Version,
    sever: Sever,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let (framing, deadline) = match connect::call(&headers) {
        Ok(call) => call,
        Err(e) => return e.into_response(),
    };
    let service = envd.app.service.clone();
    let flag = severable(sever, version);
    match (method.as_str(), framing) {
        ("Start", Framing::Streaming) => {
            let events = start(service, id, &headers, body, deadline).await;
            stream_or_error(arming(events, flag))
        }
        ("Connect", Framing::Streaming) => {
            let events = connect_to(service, id, &headers, body, deadline).await;
            stream_or_error(arming(events, flag))
        }
        ("StreamInput", Framing::Streaming) => {
            let result = stream_input(service, id, body).await;
            connect::stream_response(stream::once(async move { result }).boxed())
        }
        (_, Framing::Streaming)
            if matches!(
                method.as_str(),
                "List" | "SendInput" | "SendSignal" | "Update" | "CloseStdin"
            ) =>
        {
            RpcError::invalid(format!(
                "{method} is a unary call; send it as application/json"
            ))
            .into_response()
        }
        (method, Framing::Unary) => {
            let bytes = match connect::unary_body(body).await {
                Ok(b) => b,
                Err(e) => return e.into_response(),
            };
            unary_process(service, id, method, &bytes).await
        }
        (method, Framing::Streaming) => RpcError::new(
            Code::Unimplemented,
            format!("process.Process has no streaming method {method:?}"),
        )
        .into_response(),
    }
}

fn stream_or_error<T: serde::Serialize + Send + 'static>(
    events: Result<BoxStream<'static, Result<T, RpcError>>, RpcError>,
) -> Response {
    match events {
        Ok(events) => connect::stream_response(events),
        Err(e) => connect::stream_response(stream::once(async move { Err::<T, _>(e) }).boxed()),
    }
}

/// `events`, arming `flag` (the connection's reset) before an error that
/// severs the stream goes out.
fn arming<T: Send + 'static>(
    events: Result<BoxStream<'static, Result<T, RpcError>>, RpcError>,
    flag: Option<Severable>,
) -> Result<BoxStream<'static, Result<T, RpcError>>, RpcError> {
    let Some(flag) = flag else {
        return events;
    };
    Ok(events?
        .inspect(move |item| {
            if matches!(item, Err(e) if e.sever) {
                flag.arm();
            }
        })
        .boxed())
}

async fn unary_process<S: RunService>(
    service: S,
    id: Ulid,
    method: &str,
    bytes: &[u8],
) -> Response {
    match method {
        "List" => connect::unary_response(list(service, id).await),
        "SendInput" => {
            let result = async {
                let req: wire::SendInputRequest = connect::decode(bytes)?;
                let process = selector(req.process)?;
                let data = req
                    .input
                    .ok_or_else(|| RpcError::invalid("input is missing"))?
                    .into_bytes();
                service
                    .send_input(id, process, None, Bytes::from(data), false)
                    .await?;
                Ok(wire::Empty {})
            }
            .await;
            connect::unary_response(result)
        }
        "CloseStdin" => {
            let result = async {
                let req: wire::CloseStdinRequest = connect::decode(bytes)?;
                let process = selector(req.process)?;
                service
                    .send_input(id, process, None, Bytes::new(), true)
                    .await?;
                Ok(wire::Empty {})
            }
            .await;
            connect::unary_response(result)
        }
        "SendSignal" => {
            let result = async {
                let req: wire::SendSignalRequest = connect::decode(bytes)?;
                let process = selector(req.process)?;
                let signal = req
                    .signal
                    .ok_or_else(|| RpcError::invalid("signal is missing"))?;
                let req = SignalRequest {
                    signal: SignalSpec::Number(signal.0),
                    owner: None,
                    generation: None,
                };
                service.signal_process(id, process, req).await?;
                Ok(wire::Empty {})
            }
            .await;
            connect::unary_response(result)
        }
        "Update" => {
            let result = async {
                let req: wire::UpdateRequest = connect::decode(bytes)?;
                let process = selector(req.process)?;
                let size = req
                    .pty
                    .and_then(|p| p.size)
                    .ok_or_else(|| RpcError::invalid("pty.size is missing"))?;
                service
                    .resize_process(id, process, size.rows, size.cols)
                    .await?;
                Ok(wire::Empty {})
            }
            .await;
            connect::unary_response(result)
        }
        "Start" | "Connect" | "StreamInput" => RpcError::invalid(format!(
            "{method} is a streaming call; send it as application/connect+json"
        ))
        .into_response(),
        other => RpcError::new(
            Code::Unimplemented,
            format!("process.Process has no method {other:?}"),
        )
        .into_response(),
    }
}

async fn list<S: RunService>(service: S, id: Ulid) -> Result<wire::ListResponse, RpcError> {
    let processes = service.processes(id).await?;
    Ok(wire::ListResponse {
        processes: processes
            .processes
            .into_iter()
            .filter(|p| p.running)
            .map(|p| {
                let mut cmd = p.cmd.into_iter();
                wire::ProcessInfo {
                    config: wire::ProcessConfig {
                        cmd: cmd.next().unwrap_or_default(),
                        args: cmd.collect(),
                        envs: Default::default(),
                        cwd: Some(p.cwd),
                    },
                    pid: p.pid,
                    tag: p.tag,
                }
            })
            .collect(),
    })
}

/// The program a `Start` runs: the SDKs run every command through
/// `/bin/bash -l -c`; a run without bash (the busybox `base` image) gets
/// `/bin/sh`, which takes the same flags.
async fn program<S: RunService>(service: &S, id: Ulid, cmd: String) -> String {
    if cmd != "/bin/bash" {
        return cmd;
    }
    match service.stat_path(id, Scope::Root, Some(cmd.clone())).await {
        Err(e) if e.code() == runbox_types::ErrorCode::FileNotFound => "/bin/sh".to_owned(),
        _ => cmd,
    }
}

async fn start<S: RunService>(
    service: S,
    id: Ulid,
    headers: &HeaderMap,
    body: Body,
    deadline: Option<Duration>,
) -> Result<BoxStream<'static, Result<wire::EventResponse, RpcError>>, RpcError> {
    let req: wire::StartRequest = connect::single_message(body).await?;
    let config = req
        .process
        .ok_or_else(|| RpcError::invalid("process is missing"))?;
    if config.cmd.is_empty() {
        return Err(RpcError::invalid("process.cmd is empty"));
    }
    let pty = match req.pty {
        Some(wire::Pty { size: Some(size) }) => Some(PtySpec {
            rows: size.rows,
            cols: size.cols,
            term: None,
        }),
        Some(_) => return Err(RpcError::invalid("pty.size is missing")),
        None => None,
    };
    let caller = Caller {
        run: id,
        user: basic_user(headers)?,
    };
    let cwd = caller.cwd(&service, config.cwd).await?;
    let mut cmd = vec![program(&service, id, config.cmd).await];
    cmd.extend(config.args);
    let exec = ExecRequest {
        cmd,
        cwd: Some(cwd),
        env: (!config.envs.is_empty()).then_some(runbox_types::Env(config.envs)),
        user: caller.user,
        pty: pty.clone(),
        tag: req.tag.filter(|t| !t.is_empty()),
        // The SDKs treat an absent `stdin` as true (older envd behaviour).
        open_stdin: req.stdin.unwrap_or(true),
        ..Default::default()
    };
    let process = service.start_process(id, exec).await?;
    let session = service
        .attach(id, process.pid.to_string(), true, None)
        .await?;
    Ok(events(
        session.events,
        pty.is_some(),
        keepalive(headers),
        deadline,
    ))
}

async fn connect_to<S: RunService>(
    service: S,
    id: Ulid,
    headers: &HeaderMap,
    body: Body,
    deadline: Option<Duration>,
) -> Result<BoxStream<'static, Result<wire::EventResponse, RpcError>>, RpcError> {
    let req: wire::ConnectRequest = connect::single_message(body).await?;
    let process = selector(req.process)?;
    let pty = service
        .processes(id)
        .await?
        .processes
        .into_iter()
        .find(|p| p.pid.to_string() == process || p.tag.as_deref() == Some(&process))
        .is_some_and(|p| p.pty);
    let session = service.attach(id, process, false, None).await?;
    Ok(events(session.events, pty, keepalive(headers), deadline))
}

/// A process's events as envd sends them. The call's deadline ends the
/// stream, not the process (as with envd: a background command outlives
/// its connection; `kill` ends it).
fn events(
    events: BoxStream<'static, ExecEvent>,
    pty: bool,
    every: Option<Duration>,
    deadline: Option<Duration>,
) -> BoxStream<'static, Result<wire::EventResponse, RpcError>> {
    let mapped = events
        .filter_map(move |event| {
            let event = match event {
                ExecEvent::Started(pid) => Some(wire::ProcessEvent::Start { pid }),
                ExecEvent::Stdout(b) if pty => {
                    Some(wire::ProcessEvent::Data(wire::DataEvent::Pty(b.to_vec())))
                }
                ExecEvent::Stdout(b) => Some(wire::ProcessEvent::Data(wire::DataEvent::Stdout(
                    b.to_vec(),
                ))),
                ExecEvent::Stderr(b) => Some(wire::ProcessEvent::Data(wire::DataEvent::Stderr(
                    b.to_vec(),
                ))),
                ExecEvent::Lost(_) => None,
                // The sandbox went from under the command: envd would be
                // gone with it, so the stream breaks rather than ends.
                ExecEvent::Exit(exit)
                    if matches!(
                        exit.reason,
                        ExitReason::RunDeleted | ExitReason::RunExpired | ExitReason::RunMoved
                    ) =>
                {
                    return futures::future::ready(Some(Err(RpcError::severed(
                        "the sandbox was killed under the process",
                    ))));
                }
                ExecEvent::Exit(exit) => Some(wire::ProcessEvent::End(wire::EndEvent {
                    exit_code: exit.exit_code,
                    exited: exit.signal.is_none() && exit.exit_code >= 0,
                    status: match exit.signal {
                        Some(signal) => format!("signal: {signal}"),
                        None => format!("exit status {}", exit.exit_code),
                    },
                    error: (exit.exit_code < 0)
                        .then(|| format!("the process was lost ({:?})", exit.reason)),
                })),
            };
            futures::future::ready(event.map(|event| Ok(wire::EventResponse { event })))
        })
        .boxed();
    paced(
        mapped,
        every,
        || wire::EventResponse {
            event: wire::ProcessEvent::Keepalive {},
        },
        deadline,
    )
}

/// `StreamInput`: the first message names the process; data messages are
/// its input, in order.
async fn stream_input<S: RunService>(
    service: S,
    id: Ulid,
    body: Body,
) -> Result<wire::Empty, RpcError> {
    let mut messages = std::pin::pin!(connect::request_messages::<wire::StreamInputRequest>(body));
    let process = match messages.next().await {
        Some(Ok(wire::StreamInputRequest::Start(start))) => selector(start.process)?,
        Some(Ok(_)) => return Err(RpcError::invalid("the first message must be start")),
        Some(Err(e)) => return Err(e),
        None => return Err(RpcError::invalid("the stream carried no message")),
    };
    while let Some(message) = messages.next().await {
        match message? {
            wire::StreamInputRequest::Data(data) => {
                let bytes = data
                    .input
                    .ok_or_else(|| RpcError::invalid("input is missing"))?
                    .into_bytes();
                service
                    .send_input(id, process.clone(), None, Bytes::from(bytes), false)
                    .await?;
            }
            wire::StreamInputRequest::Keepalive(_) => {}
            wire::StreamInputRequest::Start(_) => {
                return Err(RpcError::invalid("a stream names its process once"))
            }
        }
    }
    Ok(wire::Empty {})
}

// --- filesystem.Filesystem ---

fn permissions(kind: FileKind, mode: u32) -> String {
    let mut out = String::with_capacity(10);
    out.push(match kind {
        FileKind::Directory => 'd',
        FileKind::Symlink => 'L',
        _ => '-',
    });
    for shift in [6, 3, 0] {
        let bits = (mode >> shift) & 7;
        out.push(if bits & 4 != 0 { 'r' } else { '-' });
        out.push(if bits & 2 != 0 { 'w' } else { '-' });
        out.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    out
}

/// The most symlinks followed to describe one entry.
const MAX_LINK_HOPS: usize = 8;

/// `path` with `.` and `..` taken out, lexically (`..` at the root stays
/// there, as in a lookup).
fn normalize(path: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            part => parts.push(part),
        }
    }
    format!("/{}", parts.join("/"))
}

/// Where a symlink at `link` pointing at `target` leads, as an absolute path.
fn link_target(link: &str, target: &str) -> String {
    if target.starts_with('/') {
        return normalize(target);
    }
    let dir = link.rsplit_once('/').map_or("/", |(dir, _)| dir);
    normalize(&format!("{dir}/{target}"))
}

/// A symlink described as envd describes it: the type and size of what it
/// finally points at, and that target's absolute path. A link that leads
/// nowhere (or round in circles) keeps its own type.
async fn follow<S: RunService>(service: &S, id: Ulid, mut info: FileInfo) -> FileInfo {
    let Some(first) = info
        .target
        .clone()
        .filter(|_| info.kind == FileKind::Symlink)
    else {
        return info;
    };
    let mut at = link_target(&info.path, &first);
    for _ in 0..MAX_LINK_HOPS {
        match service.stat_path(id, Scope::Root, Some(at.clone())).await {
            Ok(next) if next.kind == FileKind::Symlink => match next.target {
                Some(target) => at = link_target(&at, &target),
                None => break,
            },
            Ok(end) => {
                info.kind = end.kind;
                info.size = end.size;
                info.target = Some(at);
                return info;
            }
            Err(_) => break,
        }
    }
    info.target = Some(link_target(&info.path, &first));
    info
}

/// A runbox description as envd's `EntryInfo`, owner and group named as
/// the run's own user database names them.
fn entry(info: FileInfo, names: &Names) -> wire::EntryInfo {
    let name = info
        .path
        .rsplit('/')
        .next()
        .filter(|n| !n.is_empty())
        .unwrap_or("/")
        .to_owned();
    wire::EntryInfo {
        name,
        kind: match info.kind {
            FileKind::File => "FILE_TYPE_FILE",
            FileKind::Directory => "FILE_TYPE_DIRECTORY",
            FileKind::Symlink => "FILE_TYPE_SYMLINK",
            _ => "FILE_TYPE_UNSPECIFIED",
        },
        path: info.path,
        size: info.size.to_string(),
        mode: info.mode,
        permissions: permissions(info.kind, info.mode),
        owner: names.user(info.uid),
        group: names.group(info.gid),
        modified_time: info
            .modified_at
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap_or_default(),
        is_symlink: info.kind == FileKind::Symlink,
        symlink_target: info.target,
        metadata: info.metadata,
    }
}

async fn filesystem<S: RunService>(
    State(envd): State<Envd<S>>,
    Extension(SandboxId(id)): Extension<SandboxId>,
    Path(method): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let (framing, deadline) = match connect::call(&headers) {
        Ok(call) => call,
        Err(e) => return e.into_response(),
    };
    let service = envd.app.service.clone();
    let caller = match basic_user(&headers) {
        Ok(user) => Caller { run: id, user },
        Err(e) => return e.into_response(),
    };
    if method == "WatchDir" {
        if framing != Framing::Streaming {
            return RpcError::invalid(
                "WatchDir is a streaming call; send it as application/connect+json",
            )
            .into_response();
        }
        let events = watch_dir(service, &caller, &headers, body, deadline).await;
        return stream_or_error(events);
    }
    if framing != Framing::Unary {
        return RpcError::new(
            Code::Unimplemented,
            format!("filesystem.Filesystem has no streaming method {method:?}"),
        )
        .into_response();
    }
    let bytes = match connect::unary_body(body).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    match method.as_str() {
        "Stat" => connect::unary_response(
            async {
                let req: wire::PathRequest = connect::decode(&bytes)?;
                let info = service
                    .stat_path(
                        id,
                        Scope::Root,
                        Some(caller.path(&service, &req.path).await?),
                    )
                    .await?;
                let info = follow(&service, id, info).await;
                let names = Names::of(&service, id).await;
                Ok(wire::EntryResponse {
                    entry: entry(info, &names),
                })
            }
            .await,
        ),
        "ListDir" => connect::unary_response(
            async {
                let req: wire::ListDirRequest = connect::decode(&bytes)?;
                let query = FsQuery {
                    path: Some(caller.path(&service, &req.path).await?),
                    depth: Some(req.depth.filter(|d| *d > 0).unwrap_or(1)),
                    ..Default::default()
                };
                let list = service.list_path(id, Scope::Root, query).await?;
                let names = Names::of(&service, id).await;
                let mut entries = Vec::with_capacity(list.entries.len());
                for info in list.entries {
                    entries.push(entry(follow(&service, id, info).await, &names));
                }
                Ok(wire::ListDirResponse { entries })
            }
            .await,
        ),
        "MakeDir" => connect::unary_response(
            async {
                let req: wire::PathRequest = connect::decode(&bytes)?;
                let path = caller.path(&service, &req.path).await?;
                // envd answers already_exists, which the SDKs turn into false.
                if service
                    .stat_path(id, Scope::Root, Some(path.clone()))
                    .await
                    .is_ok()
                {
                    return Err(RpcError::new(
                        Code::AlreadyExists,
                        format!("{path} already exists"),
                    ));
                }
                let req = runbox_types::MakeDirRequest {
                    path,
                    ..Default::default()
                };
                let info = service
                    .make_dir(id, Scope::Root, req, caller.user.clone())
                    .await?;
                let names = Names::of(&service, id).await;
                Ok(wire::EntryResponse {
                    entry: entry(info, &names),
                })
            }
            .await,
        ),
        "Move" => connect::unary_response(
            async {
                let req: wire::MoveRequest = connect::decode(&bytes)?;
                let req = runbox_types::MoveRequest {
                    from: caller.path(&service, &req.source).await?,
                    to: caller.path(&service, &req.destination).await?,
                    overwrite: Some(true),
                    ..Default::default()
                };
                let info = service.move_path(id, Scope::Root, req).await?;
                let names = Names::of(&service, id).await;
                Ok(wire::EntryResponse {
                    entry: entry(info, &names),
                })
            }
            .await,
        ),
        "Remove" => connect::unary_response(
            async {
                let req: wire::PathRequest = connect::decode(&bytes)?;
                let req = runbox_types::RemoveRequest {
                    path: caller.path(&service, &req.path).await?,
                    recursive: Some(true),
                    ..Default::default()
                };
                // Removing what is not there is done, as on envd.
                match service.remove_path(id, Scope::Root, req).await {
                    Err(e) if e.code() == runbox_types::ErrorCode::FileNotFound => {}
                    other => {
                        other?;
                    }
                }
                Ok(wire::Empty {})
            }
            .await,
        ),
        "CreateWatcher" => connect::unary_response(create_watcher(&envd, &caller, &bytes).await),
        "GetWatcherEvents" => connect::unary_response(watcher_events(&envd, id, &bytes)),
        "RemoveWatcher" => connect::unary_response((|| {
            let req: wire::WatcherRequest = connect::decode(&bytes)?;
            let mut open = envd.watchers.open.lock().expect("watchers lock");
            match open.get(&req.watcher_id) {
                Some(w) if w.run == id => {
                    open.remove(&req.watcher_id);
                    Ok(wire::Empty {})
                }
                _ => Err(RpcError::new(Code::NotFound, "no such watcher")),
            }
        })()),
        other => RpcError::new(
            Code::Unimplemented,
            format!("filesystem.Filesystem has no method {other:?}"),
        )
        .into_response(),
    }
}

/// A runbox change as envd events, named relative to the watched
/// directory. A rename is envd's pair: the old name renamed, the new one
/// created.
fn fs_events(base: &str, event: runbox_types::WatchEvent) -> Vec<wire::FilesystemEvent> {
    use runbox_types::WatchKind;
    let name = |path: &str| {
        path.strip_prefix(base)
            .map(|p| p.trim_start_matches('/'))
            .unwrap_or(path)
            .to_owned()
    };
    let one = |path: &str, kind| wire::FilesystemEvent {
        name: name(path),
        kind,
        entry: None,
    };
    // An upload fills a temporary file beside its target and renames it
    // into place. envd's clients see what envd's own upload does to the
    // target: create it, give it to its user (an attribute change, so
    // CHMOD), write it.
    let temporary = |path: &str| {
        path.rsplit('/')
            .next()
            .is_some_and(|n| n.starts_with(runbox_agent_proto::UPLOAD_TEMP_PREFIX))
    };
    if temporary(&event.path) {
        return Vec::new();
    }
    if event.kind == WatchKind::Renamed && event.from.as_deref().is_some_and(temporary) {
        return vec![
            one(&event.path, "EVENT_TYPE_CREATE"),
            one(&event.path, "EVENT_TYPE_CHMOD"),
            one(&event.path, "EVENT_TYPE_WRITE"),
        ];
    }
    match event.kind {
        WatchKind::Created => vec![one(&event.path, "EVENT_TYPE_CREATE")],
        WatchKind::Written => vec![one(&event.path, "EVENT_TYPE_WRITE")],
        WatchKind::Removed => vec![one(&event.path, "EVENT_TYPE_REMOVE")],
        WatchKind::Renamed => {
            let mut out = Vec::new();
            if let Some(from) = &event.from {
                out.push(one(from, "EVENT_TYPE_RENAME"));
            }
            out.push(one(&event.path, "EVENT_TYPE_CREATE"));
            out
        }
        WatchKind::Ready | WatchKind::Overflow => Vec::new(),
    }
}

/// Opens a runbox watch and waits for it to be in place.
async fn open_watch<S: RunService>(
    service: &S,
    caller: &Caller,
    path: &str,
    recursive: bool,
) -> Result<(String, BoxStream<'static, runbox_types::WatchEvent>), RpcError> {
    let id = caller.run;
    let path = caller.path(service, path).await?;
    let query = FsQuery {
        path: Some(path.clone()),
        recursive: Some(recursive),
        ..Default::default()
    };
    let mut events = service.watch_path(id, Scope::Root, query).await?;
    match events.next().await {
        Some(e) if e.kind == runbox_types::WatchKind::Ready => {}
        _ => {
            return Err(RpcError::new(
                Code::Unavailable,
                "the watch ended before it was in place",
            ))
        }
    }
    let base = path.trim_end_matches('/').to_owned();
    Ok((base, events))
}

/// A watch's changes as envd's events, in batches: the events one change
/// reads as (an upload is create, chmod, write) travel together, so a
/// poll never sees half of them. With `include_entry` (envd 0.6.3) each
/// event whose path is still there carries its entry, owner and group
/// named as the run named them when the watch began.
async fn envd_events<S: RunService>(
    service: S,
    id: Ulid,
    base: String,
    events: BoxStream<'static, runbox_types::WatchEvent>,
    include_entry: bool,
) -> BoxStream<'static, Vec<wire::FilesystemEvent>> {
    if !include_entry {
        return events.map(move |e| fs_events(&base, e)).boxed();
    }
    let names = Arc::new(Names::of(&service, id).await);
    // One change may read as several events of one path (an upload is
    // create, chmod, write): one stat serves them all, so they arrive as
    // soon as they would without entries, or nearly.
    events
        .then(move |change| {
            let (service, names) = (service.clone(), Arc::clone(&names));
            let mut batch = fs_events(&base, change);
            let base = base.clone();
            async move {
                let mut known: Option<(String, Option<Box<wire::EntryInfo>>)> = None;
                for event in &mut batch {
                    let path = format!("{base}/{}", event.name);
                    if known.as_ref().is_none_or(|(p, _)| *p != path) {
                        let found =
                            match service.stat_path(id, Scope::Root, Some(path.clone())).await {
                                Ok(info) => {
                                    Some(Box::new(entry(follow(&service, id, info).await, &names)))
                                }
                                Err(_) => None,
                            };
                        known = Some((path, found));
                    }
                    event.entry = known.as_ref().and_then(|(_, e)| e.clone());
                }
                batch
            }
        })
        .boxed()
}

async fn watch_dir<S: RunService>(
    service: S,
    caller: &Caller,
    headers: &HeaderMap,
    body: Body,
    deadline: Option<Duration>,
) -> Result<BoxStream<'static, Result<wire::WatchEvent, RpcError>>, RpcError> {
    let req: wire::WatchRequest = connect::single_message(body).await?;
    let (base, events) = open_watch(&service, caller, &req.path, req.recursive).await?;
    let changes = envd_events(service, caller.run, base, events, req.include_entry)
        .await
        .flat_map(stream::iter)
        .map(|e| Ok(wire::WatchEvent::Filesystem(e)));
    let all = stream::once(async { Ok(wire::WatchEvent::Start {}) })
        .chain(changes)
        .boxed();
    Ok(paced(
        all,
        keepalive(headers),
        || wire::WatchEvent::Keepalive {},
        deadline,
    ))
}

async fn create_watcher<S: RunService>(
    envd: &Envd<S>,
    caller: &Caller,
    bytes: &[u8],
) -> Result<wire::CreateWatcherResponse, RpcError> {
    let req: wire::WatchRequest = connect::decode(bytes)?;
    if envd.watchers.open.lock().expect("watchers lock").len() >= MAX_WATCHERS {
        return Err(RpcError::new(
            Code::ResourceExhausted,
            format!("at most {MAX_WATCHERS} watchers may be open; remove some"),
        ));
    }
    let id = caller.run;
    let (base, events) = open_watch(&envd.app.service, caller, &req.path, req.recursive).await?;
    let mut events = envd_events(
        envd.app.service.clone(),
        id,
        base,
        events,
        req.include_entry,
    )
    .await;
    let buffer = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&buffer);
    let task = tokio::spawn(async move {
        while let Some(batch) = events.next().await {
            let mut held = sink.lock().expect("watcher buffer lock");
            held.extend(batch);
            let excess = held.len().saturating_sub(MAX_WATCHER_EVENTS);
            held.drain(..excess);
        }
    });
    let watcher_id = Ulid::new().to_string();
    let mut open = envd.watchers.open.lock().expect("watchers lock");
    // Watchers of sandboxes that are gone go with them.
    open.retain(|_, w| envd.app.service.get(w.run).is_ok());
    open.insert(
        watcher_id.clone(),
        Watcher {
            run: id,
            events: buffer,
            task: task.abort_handle(),
        },
    );
    Ok(wire::CreateWatcherResponse { watcher_id })
}

fn watcher_events<S: RunService>(
    envd: &Envd<S>,
    id: Ulid,
    bytes: &[u8],
) -> Result<wire::WatcherEvents, RpcError> {
    let req: wire::WatcherRequest = connect::decode(bytes)?;
    let open = envd.watchers.open.lock().expect("watchers lock");
    match open.get(&req.watcher_id) {
        Some(w) if w.run == id => {
            let events = std::mem::take(&mut *w.events.lock().expect("watcher buffer lock"));
            Ok(wire::WatcherEvents { events })
        }
        _ => Err(RpcError::new(Code::NotFound, "no such watcher")),
    }
}

// --- /files, /envs ---

/// A `/files` query. `signature` and `signature_expiration` are read and
/// checked by `require_access` before the handler runs; they are named
/// here so that the query, which refuses unknown parameters, takes them.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileQuery {
    path: Option<String>,
    username: Option<String>,
    #[serde(rename = "signature")]
    _signature: Option<String>,
    #[serde(rename = "signature_expiration")]
    _signature_expiration: Option<String>,
}

/// An error of a plain envd route.
fn file_error(e: runbox_core::CoreError) -> Response {
    let api = crate::ApiError::from(e);
    let status = match api.code() {
        // The path is refused, whatever the reason it leaves the run.
        runbox_types::ErrorCode::PathEscape => StatusCode::BAD_REQUEST,
        code => StatusCode::from_u16(code.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
    };
    envd_error(
        status,
        format!("{} ({})", api.message(), api.code().as_str()),
    )
}

impl FileQuery {
    /// Who a `/files` call acts as: `username=`, else the Basic user.
    fn caller(&self, id: Ulid, headers: &HeaderMap) -> Result<Caller, RpcError> {
        let user = match self.username.as_deref().filter(|u| !u.is_empty()) {
            Some(user) => Some(user.to_owned()),
            None => basic_user(headers)?,
        };
        Ok(Caller { run: id, user })
    }

    /// The query's `path` made absolute for `caller`.
    async fn target<S: RunService>(
        &self,
        service: &S,
        caller: &Caller,
    ) -> Result<String, Response> {
        caller
            .path(service, self.path.as_deref().unwrap_or(""))
            .await
            .map_err(|e| envd_error(StatusCode::BAD_REQUEST, e.message))
    }
}

fn file_query(raw: Option<&str>) -> Result<FileQuery, (StatusCode, String)> {
    // A signature was checked before the request got here (`require_access`).
    serde_urlencoded::from_str(raw.unwrap_or(""))
        .map_err(|e| (StatusCode::BAD_REQUEST, format!("bad query: {e}")))
}

async fn download<S: RunService>(
    State(envd): State<Envd<S>>,
    Extension(SandboxId(id)): Extension<SandboxId>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> Response {
    let query = match file_query(raw.as_deref()) {
        Ok(q) => q,
        Err((status, message)) => return envd_error(status, message),
    };
    let caller = match query.caller(id, &headers) {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    let path = match query.target(&envd.app.service, &caller).await {
        Ok(p) => p,
        Err(response) => return response,
    };
    let file = match envd.app.service.get_file(id, Scope::Root, path).await {
        Ok(f) => f,
        Err(e) => return file_error(e),
    };
    let body = Body::from_stream(file.body.map_err(|e| std::io::Error::other(e.to_string())));
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(header::CONTENT_LENGTH, file.size)
        .body(body)
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// What a write answers for each file.
fn written(path: &str, metadata: &BTreeMap<String, String>) -> serde_json::Value {
    let name = path.rsplit('/').next().unwrap_or(path);
    let mut entry = serde_json::json!({ "name": name, "type": "file", "path": path });
    if !metadata.is_empty() {
        entry["metadata"] = serde_json::json!(metadata);
    }
    entry
}

/// The header prefix E2B's SDKs send a file's metadata under, one header
/// a key (envd 0.6.2).
const METADATA_HEADER_PREFIX: &str = "x-metadata-";

/// The metadata an upload carries (`X-Metadata-<key>: <value>`), keys
/// lowercased as header names are; the core checks the rest.
fn upload_metadata(headers: &HeaderMap) -> Result<BTreeMap<String, String>, String> {
    let mut out = BTreeMap::new();
    for (name, value) in headers {
        let Some(key) = name.as_str().strip_prefix(METADATA_HEADER_PREFIX) else {
            continue;
        };
        let value = value
            .to_str()
            .map_err(|_| format!("the value of metadata key {key:?} must be printable ASCII"))?;
        out.insert(key.to_owned(), value.to_owned());
    }
    Ok(out)
}

/// The most of a refused upload read before the refusal is sent.
const DRAIN_LIMIT: usize = 1 << 20;

/// How long reading a refused upload may take.
const DRAIN_TIME: std::time::Duration = std::time::Duration::from_secs(2);

/// Reads what is left of a multipart upload refused part-way, up to
/// [`DRAIN_LIMIT`] bytes or [`DRAIN_TIME`] in all: a client still sending
/// its body then reads the refusal, where a connection closed under it would
/// only say "broken pipe". A larger or slower body is left unread, and the
/// connection closes.
struct Drain {
    read: usize,
    until: tokio::time::Instant,
}

impl Drain {
    fn new() -> Drain {
        Drain {
            read: 0,
            until: tokio::time::Instant::now() + DRAIN_TIME,
        }
    }

    /// Reads the rest of `field`; false once the budget is spent.
    async fn field(&mut self, mut field: axum::extract::multipart::Field<'_>) -> bool {
        loop {
            match tokio::time::timeout_at(self.until, field.chunk()).await {
                Ok(Ok(Some(chunk))) => {
                    self.read += chunk.len();
                    if self.read > DRAIN_LIMIT {
                        return false;
                    }
                }
                Ok(Ok(None)) => return true,
                Ok(Err(_)) | Err(_) => return false,
            }
        }
    }

    /// Whether the budget is spent.
    fn spent(&self) -> bool {
        self.read > DRAIN_LIMIT || tokio::time::Instant::now() >= self.until
    }

    /// Reads the parts left in `form`.
    async fn rest(&mut self, form: &mut Multipart) {
        while let Ok(Ok(Some(next))) = tokio::time::timeout_at(self.until, form.next_field()).await
        {
            if !self.field(next).await {
                return;
            }
        }
    }
}

/// [`Drain`] the current part and the rest of the form, then answer
/// `status` with `message`.
macro_rules! refuse_drained {
    ($field:expr, $form:expr, $status:expr, $message:expr) => {{
        let mut drain = Drain::new();
        if drain.field($field).await {
            drain.rest(&mut $form).await;
        }
        return envd_error($status, $message);
    }};
}

async fn upload<S: RunService>(
    State(envd): State<Envd<S>>,
    Extension(SandboxId(id)): Extension<SandboxId>,
    RawQuery(raw): RawQuery,
    request: axum::extract::Request,
) -> Response {
    let query = match file_query(raw.as_deref()) {
        Ok(q) => q,
        Err((status, message)) => return envd_error(status, message),
    };
    let caller = match query.caller(id, request.headers()) {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    let metadata = match upload_metadata(request.headers()) {
        Ok(m) => m,
        Err(message) => return envd_error(StatusCode::BAD_REQUEST, message),
    };
    let content_type = request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    let service = envd.app.service.clone();
    if content_type.starts_with("multipart/form-data") {
        let mut form = match Multipart::from_request(request, &()).await {
            Ok(f) => f,
            Err(e) => return envd_error(StatusCode::BAD_REQUEST, e.body_text()),
        };
        let mut results = Vec::new();
        loop {
            let field = match form.next_field().await {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) => return envd_error(StatusCode::BAD_REQUEST, e.body_text()),
            };
            // One file: the query's path; several: each part's file name.
            let named = field.file_name().map(str::to_owned);
            let path = match query.path.clone().filter(|_| results.is_empty()).or(named) {
                Some(p) => p,
                None => refuse_drained!(
                    field,
                    form,
                    StatusCode::BAD_REQUEST,
                    "name the file: ?path= or the part's filename"
                ),
            };
            let path = match caller.path(&service, &path).await {
                Ok(p) => p,
                Err(e) => refuse_drained!(field, form, StatusCode::BAD_REQUEST, e.message),
            };
            // The part borrows the form; the upload takes a stream of its
            // own, fed from the part as the upload reads it.
            let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(4);
            let body = tokio_stream::wrappers::ReceiverStream::new(rx).boxed();
            // When the write is refused part-way (the upload stops taking
            // the stream), the rest of the part is drained (bounded), so the
            // client reads the refusal.
            // Answers whether that spent the drain's budget.
            let pump = async move {
                let mut field = field;
                while let Some(chunk) = field.next().await {
                    let chunk = chunk.map_err(std::io::Error::other);
                    let failed = chunk.is_err();
                    if tx.send(chunk).await.is_err() {
                        let mut drain = Drain::new();
                        drain.field(field).await;
                        return drain.spent();
                    }
                    if failed {
                        break;
                    }
                }
                false
            };
            let (written_ok, spent) = tokio::join!(
                service.put_file(
                    id,
                    Scope::Root,
                    path.clone(),
                    WriteOptions {
                        user: caller.user.clone(),
                        metadata: metadata.clone(),
                        ..Default::default()
                    },
                    body
                ),
                pump
            );
            if let Err(e) = written_ok {
                if !spent {
                    Drain::new().rest(&mut form).await;
                }
                return file_error(e);
            }
            results.push(written(&path, &metadata));
        }
        if results.is_empty() {
            return envd_error(StatusCode::BAD_REQUEST, "the form carried no file");
        }
        return axum::Json(results).into_response();
    }
    if !content_type.is_empty() && !content_type.starts_with("application/octet-stream") {
        return envd_error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "send the file as multipart/form-data or application/octet-stream",
        );
    }
    let path = match query.target(&service, &caller).await {
        Ok(p) => p,
        Err(response) => return response,
    };
    let gzip = match request
        .headers()
        .get(header::CONTENT_ENCODING)
        .map(|v| v.as_bytes().to_ascii_lowercase())
    {
        None => false,
        Some(v) if v == b"identity" => false,
        Some(v) if v == b"gzip" => true,
        Some(_) => {
            return envd_error(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "Content-Encoding may be gzip or identity",
            )
        }
    };
    let length = if gzip {
        None
    } else {
        request
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse().ok())
    };
    let raw = request
        .into_body()
        .into_data_stream()
        .map_err(std::io::Error::other);
    let body = if gzip {
        gunzip(raw.boxed())
    } else {
        raw.boxed()
    };
    match service
        .put_file(
            id,
            Scope::Root,
            path.clone(),
            WriteOptions {
                user: caller.user,
                content_length: length,
                metadata: metadata.clone(),
                ..Default::default()
            },
            body,
        )
        .await
    {
        Ok(_) => axum::Json(vec![written(&path, &metadata)]).into_response(),
        Err(e) => file_error(e),
    }
}

/// A gzip body decoded as it arrives (flate2's decoder writing into a
/// buffer that each chunk drains), so memory stays bounded.
fn gunzip(
    body: BoxStream<'static, Result<Bytes, std::io::Error>>,
) -> BoxStream<'static, Result<Bytes, std::io::Error>> {
    use std::io::Write;
    let decoder = flate2::write::GzDecoder::new(Vec::new());
    stream::unfold(Some((body, decoder)), |state| async move {
        let (mut body, mut decoder) = state?;
        loop {
            match body.next().await {
                Some(Ok(chunk)) => {
                    if let Err(e) = decoder.write_all(&chunk) {
                        return Some((Err(e), None));
                    }
                    let out = std::mem::take(decoder.get_mut());
                    if !out.is_empty() {
                        return Some((Ok(Bytes::from(out)), Some((body, decoder))));
                    }
                }
                Some(Err(e)) => return Some((Err(e), None)),
                None => {
                    return match decoder.finish() {
                        Ok(rest) if rest.is_empty() => None,
                        Ok(rest) => Some((Ok(Bytes::from(rest)), None)),
                        Err(e) => Some((Err(e), None)),
                    }
                }
            }
        }
    })
    .boxed()
}

/// `GET /envs`: the environment commands in the sandbox start with, read
/// from a command's own `/proc/self/environ`.
async fn envs<S: RunService>(
    State(envd): State<Envd<S>>,
    Extension(SandboxId(id)): Extension<SandboxId>,
) -> Response {
    let exec = ExecRequest {
        cmd: vec!["cat".into(), "/proc/self/environ".into()],
        timeout_sec: Some(10),
        ..Default::default()
    };
    let mut events = match envd.app.service.exec(id, exec).await {
        Ok(e) => e,
        Err(e) => return file_error(e),
    };
    let mut out = Vec::new();
    while let Some(event) = events.next().await {
        if let ExecEvent::Stdout(b) = event {
            out.extend_from_slice(&b);
            if out.len() > 1 << 20 {
                break;
            }
        }
    }
    let map: std::collections::BTreeMap<String, String> = out
        .split(|b| *b == 0)
        .filter_map(|pair| {
            let text = String::from_utf8_lossy(pair);
            let (k, v) = text.split_once('=')?;
            Some((k.to_owned(), v.to_owned()))
        })
        .collect();
    axum::Json(map).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn symlinks_lead_to_absolute_targets() {
        assert_eq!(link_target("/home/u/d/l", "f.txt"), "/home/u/d/f.txt");
        assert_eq!(link_target("/home/u/d/l", "../x/./f"), "/home/u/x/f");
        assert_eq!(link_target("/l", "../../etc/hosts"), "/etc/hosts");
        assert_eq!(link_target("/a/l", "/abs//t/"), "/abs/t");
        assert_eq!(normalize("/"), "/");
    }

    #[test]
    fn permissions_read_like_envd() {
        assert_eq!(permissions(FileKind::Directory, 0o755), "drwxr-xr-x");
        assert_eq!(permissions(FileKind::File, 0o640), "-rw-r-----");
    }

    #[test]
    fn renames_are_envds_pair() {
        let e = runbox_types::WatchEvent {
            kind: runbox_types::WatchKind::Renamed,
            path: "/work/d/b".into(),
            from: Some("/work/d/a".into()),
            is_dir: false,
        };
        let got = fs_events("/work/d", e);
        assert_eq!(got.len(), 2);
        assert_eq!(
            (got[0].name.as_str(), got[0].kind),
            ("a", "EVENT_TYPE_RENAME")
        );
        assert_eq!(
            (got[1].name.as_str(), got[1].kind),
            ("b", "EVENT_TYPE_CREATE")
        );
    }

    #[test]
    fn uploads_show_as_their_target() {
        let temp = format!("/work/{}0123", runbox_agent_proto::UPLOAD_TEMP_PREFIX);
        let created = runbox_types::WatchEvent {
            kind: runbox_types::WatchKind::Created,
            path: temp.clone(),
            from: None,
            is_dir: false,
        };
        assert!(fs_events("/work", created).is_empty());
        let renamed = runbox_types::WatchEvent {
            kind: runbox_types::WatchKind::Renamed,
            path: "/work/f.txt".into(),
            from: Some(temp),
            is_dir: false,
        };
        let kinds: Vec<_> = fs_events("/work", renamed).iter().map(|e| e.kind).collect();
        assert_eq!(
            kinds,
            ["EVENT_TYPE_CREATE", "EVENT_TYPE_CHMOD", "EVENT_TYPE_WRITE"]
        );
    }

    #[tokio::test]
    async fn gzip_uploads_decode_in_pieces() {
        use std::io::Write;
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        enc.write_all(&data).unwrap();
        let gz = enc.finish().unwrap();
        let chunks: Vec<Result<Bytes, std::io::Error>> = gz
            .chunks(1000)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        let out: Vec<u8> = gunzip(stream::iter(chunks).boxed())
            .try_fold(Vec::new(), |mut acc, b| async move {
                acc.extend_from_slice(&b);
                Ok(acc)
            })
            .await
            .unwrap();
        assert_eq!(out, data);
        let broken = gunzip(stream::iter(vec![Ok(Bytes::from_static(b"not gzip at all"))]).boxed())
            .try_collect::<Vec<_>>()
            .await;
        assert!(broken.is_err());
    }
}
