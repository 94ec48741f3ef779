//! Processes in a run: background commands, interactive sessions, and
//! attaching to a process started earlier. The agent keeps the process
//! table (see the agent's `procs`), so processes outlive API calls and
//! daemon restarts alike; this module relays to it.
//!
//! Starting a process, sending it input or a signal, and interactive
//! sessions are writes, fenced by the lease like an exec. Listing,
//! describing, waiting for and reading the output of a process are reads.

use std::time::Duration;

use bytes::Bytes;
use futures::stream::BoxStream;
use runbox_agent_proto::pb::{self, exec_input};
use runbox_types::{ErrorCode, ExecRequest, Process, ProcessExit, ProcessList};
use time::OffsetDateTime;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use ulid::Ulid;

use super::actor::Access;
use super::relay::{
    agent_error, agent_too_old, bounded, Admission, AgentFeature, ExecEvent, ExecMode, ExecState,
};
use super::Manager;
use crate::error::CoreError;
use crate::validate;

/// How long one process call (list, signal, input) may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// The longest a wait may be asked to last.
pub const MAX_WAIT: Duration = Duration::from_secs(3600);

/// Input to an interactive session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SessionInput {
    /// Bytes for the command's stdin (or terminal).
    Stdin(Bytes),
    /// Close stdin (on a terminal: send its end-of-file character).
    Eof,
    /// A signal for the command's process group.
    Signal(i32),
    /// The terminal's new size.
    Resize {
        /// Lines.
        rows: u32,
        /// Columns.
        cols: u32,
    },
}

/// An interactive session: the command's events, and a way to send it
/// input. Dropping `events` ends the session (and kills a command the
/// session started).
pub struct Session {
    /// The command's pid.
    pub pid: u32,
    /// Its output and exit.
    pub events: BoxStream<'static, ExecEvent>,
    /// Where its input goes.
    pub input: SessionWriter,
}

impl Session {
    /// A session over `events`, whatever produces them (an agent, a remote
    /// node, a test's stand-in): its input arrives, checked and in order, on
    /// the receiver returned; dropping the receiver ends the input side.
    pub fn new(
        pid: u32,
        events: BoxStream<'static, ExecEvent>,
    ) -> (Session, mpsc::Receiver<SessionInput>) {
        let (input, inputs) = mpsc::channel(8);
        let session = Session {
            pid,
            events,
            input: SessionWriter(input),
        };
        (session, inputs)
    }

    /// A session whose input goes to an agent's exec stream `agent`.
    fn to_agent(
        pid: u32,
        events: BoxStream<'static, ExecEvent>,
        agent: mpsc::Sender<pb::ExecInput>,
    ) -> Session {
        let (session, mut inputs) = Session::new(pid, events);
        // Ends when every writer is dropped or the agent's stream closes.
        tokio::spawn(async move {
            while let Some(input) = inputs.recv().await {
                let kind = match input {
                    SessionInput::Stdin(data) => exec_input::Kind::Stdin(data.to_vec()),
                    SessionInput::Eof => exec_input::Kind::CloseStdin(pb::CloseStdin {}),
                    SessionInput::Signal(signal) => {
                        exec_input::Kind::Signal(pb::ExecSignal { signal })
                    }
                    SessionInput::Resize { rows, cols } => {
                        exec_input::Kind::Resize(pb::PtySize { rows, cols })
                    }
                };
                if agent
                    .send(pb::ExecInput { kind: Some(kind) })
                    .await
                    .is_err()
                {
                    return;
                }
            }
        });
        session
    }
}

/// The input side of a [`Session`]; cheap to clone.
#[derive(Clone, Debug)]
pub struct SessionWriter(mpsc::Sender<SessionInput>);

impl SessionWriter {
    /// Sends one input in order; fails once the session is over.
    pub async fn send(&self, input: SessionInput) -> Result<(), CoreError> {
        if let SessionInput::Resize { rows, cols } = input {
            for (name, value) in [("rows", rows), ("cols", cols)] {
                if !(1..=validate::MAX_PTY_SIDE).contains(&value) {
                    return Err(CoreError::invalid(
                        ErrorCode::BadProcess,
                        format!("{name} must be 1-{}, not {value}", validate::MAX_PTY_SIDE),
                    ));
                }
            }
        }
        self.0
            .send(input)
            .await
            .map_err(|_| CoreError::invalid(ErrorCode::ProcessEnded, "the session has ended"))
    }
}

/// Maps an agent's process-call status onto an API error.
pub(super) fn process_error(status: tonic::Status) -> CoreError {
    if status.code() == tonic::Code::Unimplemented {
        return agent_too_old();
    }
    agent_error(&status, "process call", |kind| match kind {
        "no_process" => Some(ErrorCode::ProcessNotFound),
        "stdin_closed" => Some(ErrorCode::StdinClosed),
        "not_running" => Some(ErrorCode::ProcessEnded),
        "invalid" => Some(ErrorCode::BadProcess),
        _ => None,
    })
}

/// An agent's description of a process, checked and bounded.
pub(super) fn process_of(raw: pb::ProcessInfo) -> Process {
    const MAX_TEXT: usize = 4096;
    let clip = |s: String| -> String {
        if s.len() <= MAX_TEXT {
            s
        } else {
            bounded(&s)
        }
    };
    let at = |ms: i64| {
        OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
            .unwrap_or(OffsetDateTime::UNIX_EPOCH)
    };
    let tag = (!raw.tag.is_empty() && raw.tag.len() <= validate::MAX_TAG).then_some(raw.tag);
    Process {
        pid: raw.pid,
        tag,
        cmd: raw.argv.into_iter().take(1024).map(clip).collect(),
        cwd: clip(raw.cwd),
        user: (!raw.user.is_empty()).then(|| clip(raw.user)),
        started_at: at(raw.started_unix_ms),
        background: raw.detached,
        pty: raw.pty,
        stdin_open: raw.stdin_open,
        running: raw.running,
        exit: raw.exit.map(|e| ProcessExit {
            exit_code: e.exit_code,
            signal: (e.signal != 0).then_some(e.signal),
            timed_out: e.timed_out,
        }),
        ended_at: (!raw.running && raw.ended_unix_ms > 0).then(|| at(raw.ended_unix_ms)),
    }
}

async fn timed<T>(
    call: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    limit: Duration,
) -> Result<T, CoreError> {
    tokio::time::timeout(limit, call)
        .await
        .map_err(|_| CoreError::Agent("the agent did not answer the process call in time".into()))?
        .map(tonic::Response::into_inner)
        .map_err(process_error)
}

/// How long one wait of a background process's history watcher lasts
/// before it asks again.
const HISTORY_WAIT: Duration = Duration::from_secs(3600);

/// Waits for background process `pid` to end, then keeps the run's files
/// as a history point made by it. Gives up when the run ends or its agent
/// goes (a wake starts a new agent, which no longer has the process).
async fn watch_for_history(
    mut agent: runbox_agent_proto::AgentClient,
    handle: std::sync::Arc<super::actor::RunHandle>,
    pid: u32,
    recorder: super::history::Recorder,
    mut cause: runbox_types::PointCause,
) {
    loop {
        let request = pb::WaitProcessRequest {
            process: Some(pb::ProcessRef {
                pid,
                tag: String::new(),
            }),
            timeout_ms: HISTORY_WAIT.as_millis() as u64,
        };
        let waited = tokio::select! {
            reply = timed(agent.wait_process(request), HISTORY_WAIT + CALL_TIMEOUT) => reply,
            () = handle.ended.cancelled() => return,
        };
        match waited {
            Ok(info) if info.running => continue,
            Ok(info) => {
                cause.exit_code = Some(info.exit.map_or(-1, |e| e.exit_code));
                recorder.record(cause).await;
                return;
            }
            Err(_) => return,
        }
    }
}

impl Manager {
    /// Admits a process call on a run whose agent knows processes.
    async fn process_call(&self, id: Ulid, access: Access) -> Result<Admission, CoreError> {
        let admission = self.admit(id, access).await?;
        AgentFeature::Processes.check(admission.protocol)?;
        Ok(admission)
    }

    /// Starts a background process: it outlives this call, is listed, can
    /// be attached to, and its exit status is kept after it ended.
    pub async fn start_process(&self, id: Ulid, req: ExecRequest) -> Result<Process, CoreError> {
        let handle = self.handle(id)?;
        let mut opened = self
            .open_exec(handle.clone(), req, ExecMode::Background)
            .await?;
        if let Some((recorder, cause)) = opened.state.take_history() {
            let agent = opened.agent.clone();
            tokio::spawn(watch_for_history(
                agent, handle, opened.pid, recorder, cause,
            ));
        }
        let mut agent = opened.agent.clone();
        let request = pb::WaitProcessRequest {
            process: Some(pb::ProcessRef {
                pid: opened.pid,
                tag: String::new(),
            }),
            timeout_ms: 0,
        };
        Ok(process_of(
            timed(agent.wait_process(request), CALL_TIMEOUT).await?,
        ))
    }

    /// Starts a command with its input open to the caller: a terminal
    /// session, or stdin streamed as it comes.
    pub async fn exec_session(&self, id: Ulid, req: ExecRequest) -> Result<Session, CoreError> {
        if req.tag.is_some() || req.open_stdin {
            return Err(CoreError::invalid(
                ErrorCode::BadRequest,
                "tag and openStdin are for background processes: POST /v1/runs/{id}/processes",
            ));
        }
        let opened = self
            .open_exec(self.handle(id)?, req, ExecMode::Session)
            .await?;
        let (pid, input) = (opened.pid, opened.input.clone());
        Ok(Session::to_agent(pid, opened.into_events(), input))
    }

    /// Sets the terminal size of a process that runs on one (fenced by the
    /// lease).
    pub async fn resize_process(
        &self,
        id: Ulid,
        process: &str,
        rows: u32,
        cols: u32,
    ) -> Result<(), CoreError> {
        for (name, value) in [("rows", rows), ("cols", cols)] {
            if !(1..=validate::MAX_PTY_SIDE).contains(&value) {
                return Err(CoreError::invalid(
                    ErrorCode::BadProcess,
                    format!("{name} must be 1-{}, not {value}", validate::MAX_PTY_SIDE),
                ));
            }
        }
        let target = validate::process_ref(process)?;
        let Admission {
            mut agent,
            protocol,
            in_flight: _in_flight,
            ..
        } = self.process_call(id, Access::Fenced(None)).await?;
        // Older agents would take the call and ignore the size.
        AgentFeature::Resize.check(protocol)?;
        let request = pb::SendInputRequest {
            process: Some(target),
            resize: Some(pb::PtySize { rows, cols }),
            ..Default::default()
        };
        timed(agent.send_input(request), CALL_TIMEOUT).await?;
        Ok(())
    }

    /// Follows a process started earlier: `started`, its recent output when
    /// `replay`, then live output and its exit. With `credential` the
    /// session may also send input (admitted like an exec); the process
    /// keeps running when the session ends.
    pub async fn attach(
        &self,
        id: Ulid,
        process: &str,
        replay: bool,
        interactive: Option<Option<(String, u64)>>,
    ) -> Result<Session, CoreError> {
        let target = validate::process_ref(process)?;
        // An interactive attach is a write: it goes through the lease.
        let access = match interactive {
            Some(credential) => Access::Fenced(credential),
            None => Access::Open,
        };
        let Admission {
            handle,
            mut agent,
            in_flight,
            busy,
            ..
        } = self.process_call(id, access).await?;
        let (input, input_rx) = mpsc::channel(8);
        let first = pb::ExecInput {
            kind: Some(exec_input::Kind::Attach(pb::AttachTarget {
                process: Some(target),
                replay,
            })),
        };
        input
            .send(first)
            .await
            .map_err(|_| CoreError::Agent("attach input channel closed".into()))?;
        let mut output =
            tokio::time::timeout(CALL_TIMEOUT, agent.attach(ReceiverStream::new(input_rx)))
                .await
                .map_err(|_| {
                    CoreError::Agent("the agent did not accept the attach in time".into())
                })?
                .map_err(process_error)?
                .into_inner();
        let first = tokio::time::timeout(CALL_TIMEOUT, output.message())
            .await
            .map_err(|_| CoreError::Agent("the agent did not answer the attach in time".into()))?
            .map_err(process_error)?;
        let pid = match first.and_then(|m| m.kind) {
            Some(pb::exec_output::Kind::Started(s)) => s.pid,
            _ => return Err(CoreError::Agent("expected a started message".into())),
        };
        let state = ExecState::attached(output, input.clone(), handle, pid, in_flight, busy);
        let events = futures::StreamExt::boxed(futures::stream::unfold(state, ExecState::next));
        Ok(Session::to_agent(pid, events, input))
    }

    /// The run's running processes and recently ended background ones.
    pub async fn processes(&self, id: Ulid) -> Result<ProcessList, CoreError> {
        let mut agent = self.process_call(id, Access::Open).await?.agent;
        let reply = timed(
            agent.list_processes(pb::ListProcessesRequest {}),
            CALL_TIMEOUT,
        )
        .await?;
        Ok(ProcessList {
            processes: reply
                .processes
                .into_iter()
                .take(10_000)
                .map(process_of)
                .collect(),
        })
    }

    /// Waits up to `limit` for a process to end (zero: not at all), and
    /// describes it either way.
    pub async fn wait_process(
        &self,
        id: Ulid,
        process: &str,
        limit: Duration,
    ) -> Result<Process, CoreError> {
        let target = validate::process_ref(process)?;
        if limit > MAX_WAIT {
            return Err(CoreError::invalid(
                ErrorCode::BadRequest,
                format!("timeoutSec must be at most {}", MAX_WAIT.as_secs()),
            ));
        }
        let Admission {
            handle, mut agent, ..
        } = self.process_call(id, Access::Open).await?;
        let request = pb::WaitProcessRequest {
            process: Some(target),
            timeout_ms: limit.as_millis() as u64,
        };
        let call = timed(agent.wait_process(request), limit + CALL_TIMEOUT);
        tokio::select! {
            reply = call => Ok(process_of(reply?)),
            () = handle.ended.cancelled() => Err(CoreError::RunNotRunning(id, "stopping")),
        }
    }

    /// Sends a signal to a process's group.
    pub async fn signal_process(
        &self,
        id: Ulid,
        process: &str,
        req: runbox_types::SignalRequest,
    ) -> Result<Process, CoreError> {
        let target = validate::process_ref(process)?;
        let signal = req.signal.number().ok_or_else(|| {
            CoreError::invalid(
                ErrorCode::BadSignal,
                format!(
                    "{:?} is not a Linux signal: give a name (TERM, INT, KILL, ...) or a number 1-64",
                    req.signal
                ),
            )
        })?;
        let credential = validate::credential(req.owner.as_deref(), req.generation)?;
        let Admission {
            mut agent,
            in_flight: _in_flight,
            ..
        } = self.process_call(id, Access::Fenced(credential)).await?;
        let request = pb::SignalProcessRequest {
            process: Some(target),
            signal,
        };
        Ok(process_of(
            timed(agent.signal_process(request), CALL_TIMEOUT).await?,
        ))
    }

    /// Writes to a process's stdin, then closes it when `close`.
    pub async fn send_input(
        &self,
        id: Ulid,
        process: &str,
        credential: Option<(String, u64)>,
        data: Bytes,
        close: bool,
    ) -> Result<Process, CoreError> {
        let target = validate::process_ref(process)?;
        if data.len() > runbox_agent_proto::MAX_MESSAGE_BYTES / 2 {
            return Err(CoreError::invalid(
                ErrorCode::TooLarge,
                format!(
                    "one input may be at most {} bytes; send more in several",
                    runbox_agent_proto::MAX_MESSAGE_BYTES / 2
                ),
            ));
        }
        let Admission {
            mut agent,
            in_flight: _in_flight,
            ..
        } = self.process_call(id, Access::Fenced(credential)).await?;
        let request = pb::SendInputRequest {
            process: Some(target),
            data: data.to_vec(),
            close,
            resize: None,
        };
        Ok(process_of(
            timed(agent.send_input(request), CALL_TIMEOUT).await?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: tonic::Code, kind: &str) -> tonic::Status {
        let mut status = tonic::Status::new(code, "agent says \u{7}no");
        status
            .metadata_mut()
            .insert("runbox-kind", kind.parse().unwrap());
        status
    }

    #[test]
    fn agent_process_errors_map_to_stable_codes() {
        for (kind, code) in [
            ("no_process", ErrorCode::ProcessNotFound),
            ("stdin_closed", ErrorCode::StdinClosed),
            ("not_running", ErrorCode::ProcessEnded),
            ("invalid", ErrorCode::BadProcess),
            ("made-up", ErrorCode::AgentUnavailable),
        ] {
            let err = process_error(status(tonic::Code::NotFound, kind));
            assert_eq!(err.code(), code, "{kind}");
            assert!(
                !err.to_string().contains('\u{7}'),
                "control characters pass"
            );
        }
        let old = process_error(tonic::Status::unimplemented("unknown method"));
        assert_eq!(old.code(), ErrorCode::AgentTooOld);
    }

    #[test]
    fn an_agents_process_description_is_bounded() {
        let raw = pb::ProcessInfo {
            pid: 7,
            tag: "t".repeat(500),
            argv: vec!["x".repeat(10_000); 5000],
            cwd: "/work".into(),
            started_unix_ms: 1_000,
            running: false,
            ended_unix_ms: 2_000,
            exit: Some(pb::ExecExit {
                exit_code: 143,
                signal: 15,
                timed_out: false,
            }),
            ..Default::default()
        };
        let process = process_of(raw);
        assert_eq!(process.tag, None, "an over-long tag is not shown");
        assert_eq!(process.cmd.len(), 1024);
        assert!(process.cmd.iter().all(|a| a.chars().count() <= 513));
        assert_eq!(process.exit.unwrap().signal, Some(15));
        assert!(process.ended_at.is_some());
    }
}
