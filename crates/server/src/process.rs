//! Routes for processes and interactive sessions: background processes
//! (start, list, describe, wait, signal, stdin, output as server-sent
//! events) and the two WebSocket endpoints (a new interactive exec, and
//! attaching to a process). The frame format is `runbox_types::ws`.

use std::collections::HashMap;
use std::convert::Infallible;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Query, RawQuery, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::Json;
use base64::Engine;
use futures::{SinkExt, StreamExt};
use runbox_core::runs::{ExecEvent, Session, SessionInput, SessionWriter};
use runbox_core::RunService;
use runbox_types::ws::{ClientFrame, ServerFrame};
use runbox_types::{
    sse, ErrorCode, ExecRequest, LostEvent, Process, ProcessList, ProcessQuery, SignalRequest,
    StartedEvent,
};

use crate::handlers::{event_stream, json_event, AppJson, AppPath, RunId};
use crate::{ApiError, AppState};

/// The largest WebSocket message taken from a client.
const MAX_WS_MESSAGE: usize = 1 << 20;

/// The largest body of one `stdin` write.
const MAX_STDIN_BODY: usize = 512 * 1024;

/// How long the first frame of `exec/ws` may take to arrive.
const START_FRAME_TIMEOUT: Duration = Duration::from_secs(30);

/// How often an idle WebSocket is pinged, so proxies keep it open and a
/// dead peer is noticed.
const PING_INTERVAL: Duration = Duration::from_secs(20);

/// The default wait of `.../wait`.
const DEFAULT_WAIT: Duration = Duration::from_secs(60);

/// The `{process}` segment of a process route.
fn process_param(params: &[(String, String)]) -> String {
    params
        .iter()
        .find(|(k, _)| k == "process")
        .map(|(_, v)| v.clone())
        .unwrap_or_default()
}

/// `POST /v1/runs/{id}/processes`: starts a background process.
pub async fn start<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
    AppJson(req): AppJson<ExecRequest>,
) -> Response {
    let action = runbox_proxy::audit::Action::command(
        &req.cmd,
        req.user.as_deref(),
        req.cwd.as_deref(),
        "background",
    );
    let started = state.service.start_process(id, req).await;
    crate::handlers::audited(
        action,
        started
            .map(|process| (StatusCode::CREATED, Json(process)))
            .map_err(ApiError::from),
    )
}

/// `GET /v1/runs/{id}/processes`.
pub async fn list<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
) -> Result<Json<ProcessList>, ApiError> {
    Ok(Json(state.service.processes(id).await?))
}

fn process_query(
    query: Result<Query<ProcessQuery>, QueryRejection>,
) -> Result<ProcessQuery, ApiError> {
    query.map(|Query(q)| q).map_err(|e| {
        ApiError::new(
            ErrorCode::BadRequest,
            format!("bad query string: {}", e.body_text()),
        )
    })
}

/// `GET /v1/runs/{id}/processes/{process}`.
pub async fn get<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
    AppPath(params): AppPath<Vec<(String, String)>>,
) -> Result<Json<Process>, ApiError> {
    let process = process_param(&params);
    Ok(Json(
        state
            .service
            .wait_process(id, process, Duration::ZERO)
            .await?,
    ))
}

/// `GET /v1/runs/{id}/processes/{process}/wait?timeoutSec=N`.
pub async fn wait<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
    AppPath(params): AppPath<Vec<(String, String)>>,
    query: Result<Query<ProcessQuery>, QueryRejection>,
) -> Result<Json<Process>, ApiError> {
    let query = process_query(query)?;
    let limit = query.timeout_sec.map_or(DEFAULT_WAIT, Duration::from_secs);
    Ok(Json(
        state
            .service
            .wait_process(id, process_param(&params), limit)
            .await?,
    ))
}

/// `POST /v1/runs/{id}/processes/{process}/signal`.
pub async fn signal<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
    AppPath(params): AppPath<Vec<(String, String)>>,
    AppJson(req): AppJson<SignalRequest>,
) -> Result<Json<Process>, ApiError> {
    Ok(Json(
        state
            .service
            .signal_process(id, process_param(&params), req)
            .await?,
    ))
}

/// `POST /v1/runs/{id}/processes/{process}/stdin?close=true`: the body is
/// written to the process's stdin.
pub async fn stdin<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
    AppPath(params): AppPath<Vec<(String, String)>>,
    RawQuery(query): RawQuery,
    body: Bytes,
) -> Result<Json<Process>, ApiError> {
    let mut pairs = query_pairs(query.as_deref(), &["owner", "generation", "close"])?;
    let close = match pairs.remove("close").as_deref() {
        None | Some("false") | Some("0") => false,
        Some("true") | Some("1") | Some("") => true,
        Some(other) => {
            return Err(ApiError::new(
                ErrorCode::BadRequest,
                format!("close must be true or false, not {other:?}"),
            ))
        }
    };
    let credential = credential(&mut pairs)?;
    if body.len() > MAX_STDIN_BODY {
        return Err(ApiError::new(
            ErrorCode::TooLarge,
            format!("one stdin write may be at most {MAX_STDIN_BODY} bytes"),
        ));
    }
    Ok(Json(
        state
            .service
            .send_input(id, process_param(&params), credential, body, close)
            .await?,
    ))
}

/// `GET /v1/runs/{id}/processes/{process}/output?replay=true`: the
/// process's output as server-sent events (as exec's), ending with `exit`.
/// Closing the stream leaves the process running.
pub async fn output<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
    AppPath(params): AppPath<Vec<(String, String)>>,
    query: Result<Query<ProcessQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let query = process_query(query)?;
    let session = state
        .service
        .attach(
            id,
            process_param(&params),
            query.replay.unwrap_or(true),
            None,
        )
        .await?;
    Ok(exec_events(session.events))
}

/// An exec's events as a server-sent event response.
pub fn exec_events(events: futures::stream::BoxStream<'static, ExecEvent>) -> Response {
    let b64 = base64::engine::general_purpose::STANDARD;
    let stream = events.map(move |event| {
        let sse_event = match event {
            ExecEvent::Started(pid) => json_event(sse::STARTED, &StartedEvent { pid }),
            ExecEvent::Stdout(data) => axum::response::sse::Event::default()
                .event(sse::STDOUT)
                .data(b64.encode(&data)),
            ExecEvent::Stderr(data) => axum::response::sse::Event::default()
                .event(sse::STDERR)
                .data(b64.encode(&data)),
            ExecEvent::Lost(chunks) => json_event(sse::LOST, &LostEvent { chunks }),
            ExecEvent::Exit(exit) => json_event(sse::EXIT, &exit),
        };
        Ok::<_, Infallible>(sse_event)
    });
    event_stream(stream)
}

/// `GET /v1/runs/{id}/exec/ws`: an interactive exec. The first client
/// frame is `start`; then stdin, signals and resizes go in, output and the
/// exit come out. The command is killed when the socket closes.
pub async fn exec_ws<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
    caller: crate::auth::Caller,
    upgrade: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Result<Response, ApiError> {
    let upgrade = upgrade.map_err(not_an_upgrade)?;
    // The run must exist before the upgrade: a wrong id is a plain 404.
    state.service.get(id)?;
    Ok(upgrade
        .max_message_size(MAX_WS_MESSAGE)
        .protocols([crate::WS_PROTOCOL])
        .on_upgrade(move |socket| async move {
            let mut socket = socket;
            let req: ExecRequest = match first_frame(&mut socket).await {
                Ok(req) => req,
                Err(err) => return fail(socket, err).await,
            };
            // The session's command is known only now; the upgrade's own
            // record went when it was answered.
            if let Some(audit) = state.audit.clone() {
                let record = runbox_proxy::audit::AuditRecord::Session {
                    t: runbox_proxy::audit::now(),
                    run: id.to_string(),
                    caller: Some(caller.audit_name()),
                    tenant: state.service.tenant_of(id).ok().flatten(),
                    action: runbox_proxy::audit::Action::command(
                        &req.cmd,
                        req.user.as_deref(),
                        req.cwd.as_deref(),
                        "session",
                    ),
                };
                tokio::task::spawn_blocking(move || audit.append(&record));
            }
            match state.service.exec_session(id, req).await {
                Ok(session) => relay(socket, session).await,
                Err(err) => fail(socket, ApiError::from(err)).await,
            }
        }))
}

/// A WebSocket route called without a valid upgrade.
fn not_an_upgrade(rejection: WebSocketUpgradeRejection) -> ApiError {
    ApiError::new(
        ErrorCode::BadRequest,
        format!(
            "this route is a WebSocket endpoint; connect with an HTTP/1.1 upgrade ({})",
            rejection.body_text()
        ),
    )
}

/// `GET /v1/runs/{id}/processes/{process}/ws?replay=true&owner=&generation=`:
/// attaches to a process interactively. Closing the socket detaches; the
/// process keeps running.
pub async fn attach_ws<S: RunService>(
    State(state): State<AppState<S>>,
    RunId(id): RunId,
    AppPath(params): AppPath<Vec<(String, String)>>,
    RawQuery(query): RawQuery,
    upgrade: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Result<Response, ApiError> {
    let upgrade = upgrade.map_err(not_an_upgrade)?;
    let mut pairs = query_pairs(query.as_deref(), &["owner", "generation", "replay"])?;
    let replay = match pairs.remove("replay").as_deref() {
        None | Some("true") | Some("1") | Some("") => true,
        Some("false") | Some("0") => false,
        Some(other) => {
            return Err(ApiError::new(
                ErrorCode::BadRequest,
                format!("replay must be true or false, not {other:?}"),
            ))
        }
    };
    let credential = credential(&mut pairs)?;
    // Attached before the upgrade, so a wrong process or lease is a plain
    // HTTP error.
    let session = state
        .service
        .attach(id, process_param(&params), replay, Some(credential))
        .await?;
    Ok(upgrade
        .max_message_size(MAX_WS_MESSAGE)
        .protocols([crate::WS_PROTOCOL])
        .on_upgrade(move |socket| relay(socket, session)))
}

/// Reads the `start` frame of `exec/ws`.
async fn first_frame(socket: &mut WebSocket) -> Result<ExecRequest, ApiError> {
    let frame = tokio::time::timeout(START_FRAME_TIMEOUT, socket.recv())
        .await
        .map_err(|_| {
            ApiError::new(
                ErrorCode::BadRequest,
                "no start frame within 30 s; send {\"type\":\"start\",\"cmd\":[...]} first",
            )
        })?;
    let text = match frame {
        Some(Ok(Message::Text(text))) => text,
        _ => {
            return Err(ApiError::new(
                ErrorCode::BadRequest,
                "the first frame must be a text frame {\"type\":\"start\",\"cmd\":[...]}",
            ))
        }
    };
    match serde_json::from_str::<ClientFrame>(text.as_str()) {
        Ok(ClientFrame::Start(req)) => Ok(*req),
        Ok(_) => Err(ApiError::new(
            ErrorCode::BadRequest,
            "the first frame must be start",
        )),
        Err(e) => Err(ApiError::new(
            ErrorCode::BadRequest,
            format!("the start frame does not parse: {e}"),
        )),
    }
}

fn text(frame: &ServerFrame) -> Message {
    // Serialising these plain enums cannot fail.
    Message::Text(serde_json::to_string(frame).unwrap_or_default().into())
}

fn error_frame(err: &ApiError) -> Message {
    text(&ServerFrame::Error {
        status: err.code().status(),
        code: err.code().as_str().to_owned(),
        message: err.message().to_owned(),
    })
}

/// Reports a failure and closes: 1008 (policy) for the client's mistakes,
/// 1011 for the server's.
async fn fail(mut socket: WebSocket, err: ApiError) {
    let _ = socket.send(error_frame(&err)).await;
    let code = if err.code().status() >= 500 {
        1011
    } else {
        1008
    };
    let _ = socket
        .send(Message::Close(Some(CloseFrame {
            code,
            reason: err.code().as_str().into(),
        })))
        .await;
}

/// Relays a session both ways until the command ended (then closes with
/// 1000) or the client went away (then drops the session).
///
/// Input is read by its own task: a command that does not read its stdin
/// must not stop its output from flowing, nor the other way round.
async fn relay(socket: WebSocket, session: Session) {
    let Session {
        pid,
        mut events,
        input,
    } = session;
    let (mut sink, stream) = socket.split();
    let (errors_tx, mut errors) = tokio::sync::mpsc::channel::<ApiError>(4);
    let mut reader = tokio::spawn(read_input(stream, input, errors_tx));
    if sink
        .send(text(&ServerFrame::Started { pid }))
        .await
        .is_err()
    {
        reader.abort();
        return;
    }
    let mut ping = tokio::time::interval(PING_INTERVAL);
    ping.reset();
    loop {
        let message = tokio::select! {
            event = events.next() => match event {
                // Started was sent above.
                Some(ExecEvent::Started(_)) => continue,
                Some(ExecEvent::Stdout(data)) => binary(runbox_types::ws::STDOUT, &data),
                Some(ExecEvent::Stderr(data)) => binary(runbox_types::ws::STDERR, &data),
                Some(ExecEvent::Lost(chunks)) => text(&ServerFrame::Lost { chunks }),
                Some(ExecEvent::Exit(exit)) => {
                    let _ = sink.send(text(&ServerFrame::Exit(exit))).await;
                    let _ = sink
                        .send(Message::Close(Some(CloseFrame {
                            code: 1000,
                            reason: "exited".into(),
                        })))
                        .await;
                    break;
                }
                None => break,
            },
            Some(err) = errors.recv() => error_frame(&err),
            _ = ping.tick() => Message::Ping(Bytes::new()),
            // The client closed or broke the socket.
            _ = &mut reader => break,
        };
        if sink.send(message).await.is_err() {
            break;
        }
    }
    reader.abort();
}

fn binary(stream: u8, data: &[u8]) -> Message {
    let mut frame = Vec::with_capacity(data.len() + 1);
    frame.push(stream);
    frame.extend_from_slice(data);
    Message::Binary(frame.into())
}

/// Turns client frames into session input until the socket closes. A bad
/// frame is answered with an error frame and skipped.
async fn read_input(
    mut stream: futures::stream::SplitStream<WebSocket>,
    input: SessionWriter,
    errors: tokio::sync::mpsc::Sender<ApiError>,
) {
    while let Some(Ok(message)) = stream.next().await {
        let parsed = match message {
            Message::Binary(data) => Ok(SessionInput::Stdin(data)),
            Message::Text(text) => control(text.as_str()),
            Message::Close(_) => return,
            Message::Ping(_) | Message::Pong(_) => continue,
        };
        let result = match parsed {
            Ok(item) => input.send(item).await.map_err(ApiError::from),
            Err(err) => Err(err),
        };
        if let Err(err) = result {
            if err.code() == ErrorCode::ProcessEnded {
                // The session is over; the output side says how.
                continue;
            }
            let _ = errors.send(err).await;
        }
    }
}

/// A text frame as session input.
fn control(text: &str) -> Result<SessionInput, ApiError> {
    let frame: ClientFrame = serde_json::from_str(text).map_err(|e| {
        ApiError::new(
            ErrorCode::BadRequest,
            format!("the frame does not parse: {e}"),
        )
    })?;
    Ok(match frame {
        ClientFrame::Start(_) => {
            return Err(ApiError::new(
                ErrorCode::BadRequest,
                "start may only be the first frame of exec/ws",
            ))
        }
        ClientFrame::Stdin { data } => SessionInput::Stdin(Bytes::from(data)),
        ClientFrame::Eof => SessionInput::Eof,
        ClientFrame::Signal { signal } => {
            let number = signal.number().ok_or_else(|| {
                ApiError::new(
                    ErrorCode::BadSignal,
                    format!("{signal:?} is not a Linux signal (a name like INT, or 1-64)"),
                )
            })?;
            SessionInput::Signal(number)
        }
        ClientFrame::Resize { rows, cols } => SessionInput::Resize { rows, cols },
    })
}

/// The query string's parameters, each at most once and each one of
/// `allowed`: a misspelt parameter is refused, never ignored.
pub fn query_pairs(
    query: Option<&str>,
    allowed: &[&str],
) -> Result<HashMap<String, String>, ApiError> {
    let mut out = HashMap::new();
    let Some(query) = query.filter(|q| !q.is_empty()) else {
        return Ok(out);
    };
    let pairs: Vec<(String, String)> = serde_urlencoded::from_str(query).map_err(|e| {
        ApiError::new(
            ErrorCode::BadRequest,
            format!("the query string does not parse: {e}"),
        )
    })?;
    for (key, value) in pairs {
        if !allowed.contains(&key.as_str()) {
            return Err(ApiError::new(
                ErrorCode::BadRequest,
                format!(
                    "unknown query parameter {key:?}; this route takes {}",
                    allowed.join(", ")
                ),
            ));
        }
        if out.insert(key.clone(), value).is_some() {
            return Err(ApiError::new(
                ErrorCode::BadRequest,
                format!("query parameter {key:?} is given more than once"),
            ));
        }
    }
    Ok(out)
}

/// The lease credential among query parameters: owner and generation,
/// both or neither.
pub fn credential(pairs: &mut HashMap<String, String>) -> Result<Option<(String, u64)>, ApiError> {
    let owner = pairs.remove("owner");
    let generation = pairs
        .remove("generation")
        .as_deref()
        .map(runbox_core::validate::generation)
        .transpose()?;
    Ok(runbox_core::validate::credential(
        owner.as_deref(),
        generation,
    )?)
}
