//! The agent relay: exec and files, carried between an API call and the
//! run's agent over its Unix socket.
//!
//! Every exec and file write is admitted by the run's owner first (the lease
//! fence, and the phase: a failed run refuses them with its reason) and
//! counted in flight until its stream or future ends. Reads are not fenced,
//! but a run that is not running refuses them too.
//!
//! What comes from the agent is untrusted: sizes are checked against what
//! it declared, and its messages are bounded before they reach a client or
//! a log line.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::{Stream, StreamExt};
use runbox_agent_proto::pb::{
    self, exec_input, exec_output, read_file_chunk, unpack_chunk, write_file_chunk,
};
use runbox_agent_proto::{AgentClient, CHUNK_SIZE};
use runbox_types::{Env, ErrorCode, ExecRequest, ExitEvent, ExitReason};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use ulid::Ulid;

use super::actor::{Access, Busy, Command, InFlight, RunHandle};
use super::Manager;
use crate::egress;
use crate::error::CoreError;
use crate::store::RunRecord;
use crate::validate;

/// Environment every command starts with, before the run's and the exec's.
const BASE_ENV: &[(&str, &str)] = &[
    (
        "PATH",
        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    ),
    ("HOME", "/root"),
    ("TERM", "xterm"),
];

/// How long after its own timeout the daemon waits for the agent to report a
/// killed command before it gives up on the agent.
const TIMEOUT_GRACE: Duration = Duration::from_secs(5);

/// How long a single call to set up an agent stream may take.
const AGENT_CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// One event of an exec stream, as the core reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExecEvent {
    /// The command started with this pid.
    Started(u32),
    /// A chunk of standard output.
    Stdout(Bytes),
    /// A chunk of standard error.
    Stderr(Bytes),
    /// An attached reader fell behind and this many chunks were skipped.
    Lost(u64),
    /// The command ended; always the last event.
    Exit(ExitEvent),
}

/// A file being read out of a run.
pub struct FileDownload {
    /// Its size in bytes, as the agent declared it; the stream yields exactly
    /// this many bytes or ends with an error.
    pub size: u64,
    /// The contents.
    pub body: std::pin::Pin<Box<dyn Stream<Item = Result<Bytes, CoreError>> + Send>>,
}

/// What a [`Manager::unpack`] wrote, as the run's agent counted it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UnpackStats {
    /// Entries written: files, directories, symlinks and hard links.
    pub entries: u64,
    /// Bytes of file contents written (at most the archive's size).
    pub bytes: u64,
}

/// An operation its run's owner admitted: what the caller needs to go on.
pub(crate) struct Admission {
    /// The run.
    pub handle: Arc<RunHandle>,
    /// The run's agent.
    pub agent: AgentClient,
    /// The protocol revision the agent speaks.
    pub protocol: u32,
    /// The run's record at admission.
    pub record: Arc<RunRecord>,
    /// A fenced operation's in-flight guard; None for an open one.
    pub in_flight: Option<InFlight>,
    /// Keeps the run from counting as idle while it is held.
    pub busy: Busy,
}

impl Manager {
    /// Admits an operation on run `id` through its owner (see
    /// [`Command::Admit`]): the one door to a run.
    pub(crate) async fn admit(&self, id: Ulid, access: Access) -> Result<Admission, CoreError> {
        self.admit_handle(self.handle(id)?, access).await
    }

    /// [`Manager::admit`] of a run already looked up (an idle pool member
    /// being warmed up, which the API cannot name).
    pub(crate) async fn admit_handle(
        &self,
        handle: Arc<RunHandle>,
        access: Access,
    ) -> Result<Admission, CoreError> {
        let fenced = matches!(access, Access::Fenced(_));
        let admitted = handle.ask(|reply| Command::Admit { access, reply }).await?;
        // From here on a fenced operation is counted; the guard ends it.
        let in_flight = fenced.then(|| InFlight(handle.clone()));
        Ok(Admission {
            handle,
            agent: admitted.agent,
            protocol: admitted.protocol,
            record: admitted.record,
            in_flight,
            busy: admitted.busy,
        })
    }

    /// Starts a command in run `id`. Fails before streaming when the command
    /// cannot run (bad input, the lease refuses, the program does not exist
    /// or failed to start); the stream then carries its output and ends with
    /// exactly one [`ExecEvent::Exit`].
    ///
    /// Cancellation: dropping the returned stream cancels the agent call, and
    /// the agent kills the command's process group.
    pub async fn exec(
        &self,
        id: Ulid,
        req: ExecRequest,
    ) -> Result<impl Stream<Item = ExecEvent> + Send + 'static, CoreError> {
        self.exec_handle(self.handle(id)?, req).await
    }

    /// [`Manager::exec`] in a run already looked up.
    pub(crate) async fn exec_handle(
        &self,
        target: Arc<RunHandle>,
        req: ExecRequest,
    ) -> Result<impl Stream<Item = ExecEvent> + Send + 'static, CoreError> {
        if req.tag.is_some() || req.open_stdin {
            return Err(CoreError::invalid(
                ErrorCode::BadRequest,
                "tag and openStdin are for background processes: POST /v1/runs/{id}/processes",
            ));
        }
        let opened = self.open_exec(target, req, ExecMode::Foreground).await?;
        Ok(opened.into_events())
    }

    /// Checks an exec request, admits it, and starts the command in the
    /// run's agent; answers once the agent reported it started.
    pub(super) async fn open_exec(
        &self,
        target: Arc<RunHandle>,
        req: ExecRequest,
        mode: ExecMode,
    ) -> Result<Opened, CoreError> {
        let started = std::time::Instant::now();
        let opened = self.start_exec(target, req, mode).await;
        self.context
            .report(|t| t.exec_started(crate::telemetry::Outcome::of(&opened), started.elapsed()));
        opened
    }

    async fn start_exec(
        &self,
        target: Arc<RunHandle>,
        mut req: ExecRequest,
        mode: ExecMode,
    ) -> Result<Opened, CoreError> {
        if !req.cmd.is_empty() {
            validate::command(&req.cmd)?;
        }
        if let Some(cwd) = &req.cwd {
            validate::cwd(cwd)?;
        }
        let exec_env = req.env.take().unwrap_or_default();
        validate::env(&exec_env)?;
        let timeout = match req.timeout_sec {
            Some(0) => {
                return Err(CoreError::invalid(
                    ErrorCode::BadRequest,
                    "timeoutSec must be at least 1",
                ))
            }
            Some(secs) if secs > self.config().max_ttl.as_secs() => {
                return Err(CoreError::invalid(
                    ErrorCode::BadRequest,
                    format!(
                        "timeoutSec must be at most {}",
                        self.config().max_ttl.as_secs()
                    ),
                ))
            }
            Some(secs) => Some(Duration::from_secs(secs)),
            None => None,
        };
        let credential = validate::credential(req.owner.as_deref(), req.generation)?;
        let user = req.user.take().map(validate::user).transpose()?;
        let tag = req
            .tag
            .take()
            .map(|t| validate::tag(&t).map(|()| t))
            .transpose()?;
        let pty = req.pty.take().map(validate::pty).transpose()?;
        let stdin_text = req.stdin.take();
        if stdin_text
            .as_ref()
            .is_some_and(|t| t.len() > MAX_STDIN_TEXT)
        {
            return Err(CoreError::invalid(
                ErrorCode::TooLarge,
                format!("stdin is larger than {MAX_STDIN_TEXT} bytes; upload the data as a file instead"),
            ));
        }
        let needs_processes = pty.is_some() || mode != ExecMode::Foreground;
        let Admission {
            handle,
            mut agent,
            protocol,
            record,
            in_flight,
            busy,
        } = self
            .admit_handle(target, Access::Fenced(credential))
            .await?;
        if needs_processes {
            AgentFeature::Processes.check(protocol)?;
        }
        // A command leaves a history point when it ends (the first one of
        // a run keeps the files before it, too); a background process's is
        // taken by a watcher ([`Manager::start_process`]).
        let recorder = self.recorder(&handle, &record).await;
        let image = &record.image_config;
        // An exec without a command runs the image's Entrypoint + Cmd.
        let argv = if req.cmd.is_empty() {
            let argv: Vec<String> = image.entrypoint.iter().chain(&image.cmd).cloned().collect();
            if argv.is_empty() {
                return Err(CoreError::invalid(
                    ErrorCode::BadCommand,
                    "cmd is empty and the image has no Entrypoint or Cmd; give the program and its arguments",
                ));
            }
            validate::command(&argv)?;
            argv
        } else {
            std::mem::take(&mut req.cmd)
        };
        let base = Env(BASE_ENV
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect());
        let egress_env = egress::run_env(
            self.config().egress.as_deref(),
            record.network,
            &record.egress,
        );
        // A terminal's type is the request's, else a modern default; an
        // exec's own TERM still wins.
        let term_env = Env(pty
            .as_ref()
            .map(|(_, term)| [("TERM".to_owned(), term.clone())].into())
            .unwrap_or_default());
        // Later layers win: runbox's defaults, the image's Env, the egress
        // proxy's, the run's, the terminal's, the exec's.
        let env: Vec<pb::EnvVar> = validate::merge_env([
            &base,
            &image.env,
            &egress_env,
            &record.env,
            &term_env,
            &exec_env,
        ])
        .into_iter()
        .map(|(name, value)| pb::EnvVar { name, value })
        .collect();
        let history = recorder.map(|recorder| {
            let kind = match mode {
                ExecMode::Background => runbox_types::PointKind::Process,
                ExecMode::Foreground | ExecMode::Session => runbox_types::PointKind::Exec,
            };
            let cause = runbox_types::PointCause {
                argv: Some(argv.clone()),
                user: user.clone(),
                ..super::history::cause(kind)
            };
            (recorder, cause)
        });
        let start = pb::ExecStart {
            argv,
            cwd: req
                .cwd
                .or_else(|| image.working_dir.clone())
                .unwrap_or_default(),
            env,
            timeout_ms: timeout.map_or(0, |t| t.as_millis() as u64),
            stdin: match mode {
                ExecMode::Foreground => stdin_text.is_some(),
                ExecMode::Session => true,
                ExecMode::Background => req.open_stdin || stdin_text.is_some(),
            },
            // The request's, else the image's `User`, else root.
            user: user.or_else(|| image.user.clone()).unwrap_or_default(),
            detach: mode == ExecMode::Background,
            tag: tag.unwrap_or_default(),
            pty: pty.map(|(size, _)| size),
            allow_new_privileges: record.allow_privilege_escalation,
        };
        let (input, input_rx) = mpsc::channel(8);
        input
            .send(pb::ExecInput {
                kind: Some(exec_input::Kind::Start(start)),
            })
            .await
            .map_err(|_| CoreError::Agent("exec input channel closed".into()))?;
        let response = tokio::time::timeout(
            AGENT_CALL_TIMEOUT,
            agent.exec(ReceiverStream::new(input_rx)),
        )
        .await
        .map_err(|_| CoreError::Agent("the agent did not accept the exec call in time".into()))?
        .map_err(|s| CoreError::Agent(format!("exec call refused: {}", bounded(s.message()))))?;
        let mut output = response.into_inner();
        let first = tokio::time::timeout(AGENT_CALL_TIMEOUT, output.message())
            .await
            .map_err(|_| CoreError::Agent("the agent did not start the command in time".into()))?
            .map_err(|s| CoreError::Agent(format!("exec failed: {}", bounded(s.message()))))?;
        let pid = match first.and_then(|m| m.kind) {
            Some(exec_output::Kind::Started(s)) => s.pid,
            Some(exec_output::Kind::Error(e)) => {
                return Err(start_error(e, record.id, record.limits.pids))
            }
            other => {
                return Err(CoreError::Agent(format!(
                    "expected a started message, got {}",
                    message_kind(other.is_some())
                )))
            }
        };
        if let Some(text) = stdin_text {
            if mode == ExecMode::Background {
                // The start call is over; the process takes input by pid.
                let request = pb::SendInputRequest {
                    process: Some(pb::ProcessRef {
                        pid,
                        tag: String::new(),
                    }),
                    data: text.into_bytes(),
                    close: true,
                    resize: None,
                };
                tokio::time::timeout(AGENT_CALL_TIMEOUT, agent.send_input(request))
                    .await
                    .map_err(|_| {
                        CoreError::Agent("the agent did not take the input in time".into())
                    })?
                    .map_err(super::process::process_error)?;
            } else {
                // Fed from a task: the agent reads it only as the stream is
                // polled, which is the caller's to do.
                let input = input.clone();
                tokio::spawn(async move {
                    for part in text.as_bytes().chunks(CHUNK_SIZE) {
                        let data = pb::ExecInput {
                            kind: Some(exec_input::Kind::Stdin(part.to_vec())),
                        };
                        if input.send(data).await.is_err() {
                            return;
                        }
                    }
                    let close = pb::ExecInput {
                        kind: Some(exec_input::Kind::CloseStdin(pb::CloseStdin {})),
                    };
                    let _ = input.send(close).await;
                });
            }
        }
        let state = ExecState {
            output,
            _input: input.clone(),
            ended: handle.ended.clone(),
            handle,
            deadline: timeout.map(|t| tokio::time::Instant::now() + t + TIMEOUT_GRACE),
            started: Some(pid),
            done: false,
            history,
            _in_flight: in_flight,
            _busy: busy,
        };
        Ok(Opened {
            pid,
            state,
            input,
            agent,
        })
    }

    /// Writes `body` to `/work/<path>` in a run, replacing any file there only
    /// once the whole body has arrived. Returns the bytes written.
    ///
    /// Cancellation: dropping the future mid-way cancels the agent call; the
    /// agent then discards the partial upload and the target is untouched.
    pub async fn put_file<S, E>(
        &self,
        id: Ulid,
        scope: super::fs::Scope,
        path: &str,
        options: super::fs::WriteOptions,
        body: S,
    ) -> Result<u64, CoreError>
    where
        S: Stream<Item = Result<Bytes, E>> + Send,
        E: std::fmt::Display,
    {
        let super::fs::WriteOptions {
            user,
            credential,
            content_length,
            metadata,
        } = options;
        let path = scope.agent_path(Some(path), false)?;
        let user = user.map(validate::user).transpose()?;
        let xattrs = scope.metadata_xattrs(metadata)?;
        let max = self.config().max_upload_bytes;
        if content_length.is_some_and(|len| len > max) {
            return Err(too_large(max));
        }
        // Counted in flight until this future ends or is dropped.
        let Admission {
            handle,
            mut agent,
            protocol,
            record,
            in_flight: _in_flight,
            busy: _busy,
            ..
        } = self.admit(id, Access::Fenced(credential)).await?;
        scope.check(protocol)?;
        super::fs::check_metadata(protocol, &xattrs)?;
        let recorder = self.recorder(&handle, &record).await;
        let cause = super::history::file_cause("write", &scope.absolute(&path));
        let (tx, rx) = mpsc::channel::<pb::WriteFileChunk>(4);
        let user = super::fs::owner(&record, user);
        let header = pb::WriteFileHeader {
            path,
            mode: 0,
            user,
            root: scope.root(),
            xattrs,
        };
        tx.send(chunk(write_file_chunk::Kind::Header(header)))
            .await
            .map_err(|_| CoreError::Agent("upload channel closed".into()))?;
        let call = agent.write_file(ReceiverStream::new(rx));
        let (sent, reply) = stream_to_agent(
            tx,
            call,
            body,
            "upload",
            Some(max),
            |data| chunk(write_file_chunk::Kind::Data(data)),
            chunk(write_file_chunk::Kind::Commit(pb::WriteFileCommit {})),
        )
        .await?;
        if reply.bytes_written != sent {
            return Err(CoreError::Agent(format!(
                "the agent wrote {} bytes of {sent}",
                reply.bytes_written
            )));
        }
        super::history::after(recorder, cause).await;
        Ok(sent)
    }

    /// Unpacks a tar archive (uncompressed) into `dest`, a directory of
    /// run `id`'s root filesystem that the agent makes with its missing
    /// parents: an image build's COPY. `body` is the archive, its names
    /// relative to `dest`. Every entry written, and every directory the
    /// call makes, belongs to `user` (as an exec's; None: root, whatever
    /// the image's `User`); a non-zero `mode` gives files and directories
    /// exactly those bits (`COPY --chmod`), else each keeps the archive's.
    /// Needs an agent of protocol 8 ([`AgentFeature::Unpack`]).
    ///
    /// Admitted open, not under the lease: the builder owns the run it
    /// unpacks into and no one else holds it.
    ///
    /// Cancellation: not all-or-nothing. The agent writes entries as they
    /// arrive; an error, or dropping the future (which cancels the agent
    /// call), leaves those written so far in the run, which the builder
    /// then throws away.
    pub(crate) async fn unpack<S, E>(
        &self,
        id: Ulid,
        dest: &str,
        user: Option<String>,
        mode: u32,
        body: S,
    ) -> Result<UnpackStats, CoreError>
    where
        S: Stream<Item = Result<Bytes, E>> + Send,
        E: std::fmt::Display,
    {
        let dest = validate::root_path(dest, true)?;
        let user = user.map(validate::user).transpose()?;
        if mode & !0o7777 != 0 {
            return Err(CoreError::invalid(
                ErrorCode::BadRequest,
                format!("mode {mode:o} has bits beyond the permission, set-id and sticky bits"),
            ));
        }
        let Admission {
            mut agent,
            protocol,
            busy: _busy,
            ..
        } = self.admit(id, Access::Open).await?;
        AgentFeature::Unpack.check(protocol)?;
        let (tx, rx) = mpsc::channel::<pb::UnpackChunk>(4);
        let header = pb::UnpackHeader {
            dest,
            user: user.unwrap_or_default(),
            mode,
        };
        tx.send(unpack_chunk(unpack_chunk::Kind::Header(header)))
            .await
            .map_err(|_| CoreError::Agent("unpack channel closed".into()))?;
        let call = agent.unpack(ReceiverStream::new(rx));
        let (sent, reply) = stream_to_agent(
            tx,
            call,
            body,
            "archive",
            None,
            |data| unpack_chunk(unpack_chunk::Kind::Data(data)),
            unpack_chunk(unpack_chunk::Kind::Commit(pb::WriteFileCommit {})),
        )
        .await?;
        // Contents are a part of the archive; the agent's count is not
        // trusted beyond that.
        if reply.bytes > sent {
            return Err(CoreError::Agent(format!(
                "the agent reported {} bytes written from an archive of {sent}",
                reply.bytes
            )));
        }
        Ok(UnpackStats {
            entries: reply.entries,
            bytes: reply.bytes,
        })
    }

    /// Reads `/work/<path>` out of a run as a stream of exactly `size` bytes.
    pub async fn get_file(
        &self,
        id: Ulid,
        scope: super::fs::Scope,
        path: &str,
    ) -> Result<FileDownload, CoreError> {
        let path = scope.agent_path(Some(path), false)?;
        let Admission {
            mut agent,
            protocol,
            busy,
            ..
        } = self.admit(id, Access::Open).await?;
        scope.check(protocol)?;
        let mut stream = tokio::time::timeout(
            AGENT_CALL_TIMEOUT,
            agent.read_file(pb::ReadFileRequest {
                path,
                root: scope.root(),
            }),
        )
        .await
        .map_err(|_| CoreError::Agent("the agent did not answer the read in time".into()))?
        .map_err(file_error)?
        .into_inner();
        let first = tokio::time::timeout(AGENT_CALL_TIMEOUT, stream.message())
            .await
            .map_err(|_| CoreError::Agent("the agent did not answer the read in time".into()))?
            .map_err(file_error)?;
        let size = match first.and_then(|c| c.kind) {
            Some(read_file_chunk::Kind::Header(h)) => h.size,
            other => {
                return Err(CoreError::Agent(format!(
                    "expected a file header, got {}",
                    message_kind(other.is_some())
                )))
            }
        };
        // Never trust the agent's byte count: stop at `size`, and fail the
        // stream if fewer bytes arrive, so the HTTP length is never a lie.
        // The run is busy until the body is read out (or dropped).
        let body = futures::stream::unfold(
            (stream, 0u64, false, busy),
            move |(mut stream, mut seen, done, busy)| async move {
                if done {
                    return None;
                }
                let item = match stream.message().await {
                    Ok(Some(pb::ReadFileChunk {
                        kind: Some(read_file_chunk::Kind::Data(data)),
                    })) => {
                        let room = size - seen;
                        if data.len() as u64 > room {
                            Err(CoreError::Agent(
                                "the agent sent more bytes than it declared".into(),
                            ))
                        } else {
                            seen += data.len() as u64;
                            Ok(Bytes::from(data))
                        }
                    }
                    Ok(Some(_)) => Err(CoreError::Agent(
                        "unexpected message in a file stream".into(),
                    )),
                    Ok(None) if seen == size => return None,
                    Ok(None) => Err(CoreError::Agent(format!(
                        "file stream ended after {seen} of {size} bytes"
                    ))),
                    Err(status) => Err(file_error(status)),
                };
                let done = item.is_err();
                Some((item, (stream, seen, done, busy)))
            },
        );
        Ok(FileDownload {
            size,
            body: Box::pin(body),
        })
    }
}

/// Streams `body` to an agent call that takes it as `data` messages
/// (already sent its header on `tx`) and ends it with `commit`; `what`
/// names the body in errors ("upload", "archive"); past `max` bytes the
/// transfer stops as too large. Returns the bytes sent and the agent's
/// reply.
///
/// The agent may refuse early (a bad path, a bad entry) while the body
/// is still arriving: its answer says why, whichever side is seen first.
/// A pump that finds the agent no longer reading waits for that answer
/// (bounded) rather than report the closed channel, which is only the
/// refusal's echo.
async fn stream_to_agent<M, S, E, R>(
    tx: mpsc::Sender<M>,
    call: impl std::future::Future<Output = Result<tonic::Response<R>, tonic::Status>>,
    body: S,
    what: &str,
    max: Option<u64>,
    data: impl Fn(Vec<u8>) -> M,
    commit: M,
) -> Result<(u64, R), CoreError>
where
    S: Stream<Item = Result<Bytes, E>> + Send,
    E: std::fmt::Display,
{
    tokio::pin!(call);
    let stopped = || CoreError::Agent(format!("the agent stopped reading the {what}"));
    let pump = async {
        let mut body = std::pin::pin!(body);
        let mut total = 0u64;
        while let Some(piece) = body.next().await {
            let piece = piece.map_err(|e| {
                CoreError::invalid(ErrorCode::BadRequest, format!("the {what} broke off: {e}"))
            })?;
            total += piece.len() as u64;
            if let Some(max) = max.filter(|&max| total > max) {
                return Err(too_large(max));
            }
            for part in piece.chunks(CHUNK_SIZE) {
                tx.send(data(part.to_vec())).await.map_err(|_| stopped())?;
            }
        }
        tx.send(commit).await.map_err(|_| stopped())?;
        Ok::<u64, CoreError>(total)
    };
    let sent = tokio::select! {
        reply = &mut call => {
            return match reply {
                Ok(_) => Err(CoreError::Agent(format!(
                    "the agent finished the {what} before it was committed"
                ))),
                Err(status) => Err(file_error(status)),
            };
        }
        sent = pump => match sent {
            Ok(sent) => sent,
            Err(stopped @ CoreError::Agent(_)) => {
                return match tokio::time::timeout(AGENT_CALL_TIMEOUT, &mut call).await {
                    Ok(Err(status)) => Err(file_error(status)),
                    Ok(Ok(_)) | Err(_) => Err(stopped),
                };
            }
            Err(e) => return Err(e),
        },
    };
    drop(tx);
    let reply = tokio::time::timeout(AGENT_CALL_TIMEOUT, call)
        .await
        .map_err(|_| CoreError::Agent(format!("the agent did not confirm the {what} in time")))?
        .map_err(file_error)?
        .into_inner();
    Ok((sent, reply))
}

fn chunk(kind: write_file_chunk::Kind) -> pb::WriteFileChunk {
    pb::WriteFileChunk { kind: Some(kind) }
}

fn unpack_chunk(kind: unpack_chunk::Kind) -> pb::UnpackChunk {
    pb::UnpackChunk { kind: Some(kind) }
}

fn too_large(max: u64) -> CoreError {
    CoreError::invalid(
        ErrorCode::TooLarge,
        format!("the file is larger than this server's upload maximum of {max} bytes"),
    )
}

/// Maps an agent's refusal to start a command in run `id`, whose process
/// limit is `pids`, onto an API error.
fn start_error(e: pb::AgentError, id: Ulid, pids: u64) -> CoreError {
    let code = match pb::ErrorKind::try_from(e.kind).unwrap_or(pb::ErrorKind::Unspecified) {
        pb::ErrorKind::ProcessLimit => {
            return CoreError::invalid(
                ErrorCode::ProcessLimit,
                format!(
                    "{}: run {id} has as many processes as its limit allows (limits.pids {pids}); \
                     wait for some to exit, or end some (GET /v1/runs/{id}/processes, .../signal)",
                    bounded(&e.message)
                ),
            )
        }
        pb::ErrorKind::NotFound => ErrorCode::CommandNotFound,
        pb::ErrorKind::PermissionDenied => ErrorCode::CommandNotExecutable,
        pb::ErrorKind::BadCwd => ErrorCode::BadCwd,
        pb::ErrorKind::BadUser => ErrorCode::BadUser,
        pb::ErrorKind::TagInUse => ErrorCode::TagInUse,
        pb::ErrorKind::Invalid => ErrorCode::BadCommand,
        pb::ErrorKind::Io | pb::ErrorKind::Unspecified => {
            return CoreError::Agent(bounded(&e.message))
        }
    };
    CoreError::invalid(code, bounded(&e.message))
}

/// Maps an agent's file-operation status onto an API error, by the
/// `runbox-kind` metadata the agent attaches.
pub(super) fn file_error(status: tonic::Status) -> CoreError {
    agent_error(&status, "file operation", file_code)
}

/// The API code of a confined file operation's failure, by its
/// `runbox-kind` (`runbox_confine::FileError::kind`); None for `io`.
pub(super) fn file_code(kind: &str) -> Option<ErrorCode> {
    match kind {
        "invalid_path" => Some(ErrorCode::BadPath),
        "escape" => Some(ErrorCode::PathEscape),
        "not_found" => Some(ErrorCode::FileNotFound),
        "not_a_file" => Some(ErrorCode::NotAFile),
        "denied" => Some(ErrorCode::PermissionDenied),
        "exists" => Some(ErrorCode::FileExists),
        "bad_user" => Some(ErrorCode::BadUser),
        "not_empty" => Some(ErrorCode::DirNotEmpty),
        _ => None,
    }
}

/// Maps an agent's status onto an API error by its `runbox-kind`
/// metadata through `code_of`; a kind it does not know is the agent's
/// failure (`what` failed), with the agent's message bounded.
pub(super) fn agent_error(
    status: &tonic::Status,
    what: &str,
    code_of: impl Fn(&str) -> Option<ErrorCode>,
) -> CoreError {
    let kind = status
        .metadata()
        .get("runbox-kind")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let message = bounded(status.message());
    match code_of(kind) {
        Some(code) => CoreError::invalid(code, message),
        None => CoreError::Agent(format!("{what} failed: {message}")),
    }
}

/// Names what an agent sent instead of the expected message, without
/// echoing its (untrusted, possibly large) contents.
fn message_kind(present: bool) -> &'static str {
    if present {
        "another message"
    } else {
        "nothing"
    }
}

/// Caps a message that came from inside a run before it reaches a client or
/// a log line.
pub(crate) fn bounded(message: &str) -> String {
    const MAX: usize = 512;
    let mut out: String = message
        .chars()
        .filter(|c| !c.is_control())
        .take(MAX)
        .collect();
    if message.len() > MAX {
        out.push('…');
    }
    out
}

/// How an exec runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ExecMode {
    /// Streamed to the caller, killed when the caller goes away; stdin
    /// only as `stdin` text.
    Foreground,
    /// Like `Foreground`, with stdin open for the caller's input.
    Session,
    /// Detached: the agent keeps it, the call only starts it.
    Background,
}

/// A command the agent started.
pub(super) struct Opened {
    pub pid: u32,
    pub state: ExecState,
    /// Input to the agent call (stdin, signals, resizes).
    pub input: mpsc::Sender<pb::ExecInput>,
    pub agent: AgentClient,
}

impl Opened {
    /// The events of the command, ending with one exit.
    pub fn into_events(self) -> futures::stream::BoxStream<'static, ExecEvent> {
        futures::stream::unfold(self.state, ExecState::next).boxed()
    }
}

/// The most `stdin` text one exec takes.
const MAX_STDIN_TEXT: usize = 512 * 1024;

/// A protocol-3 operation asked of an older agent.
pub(super) fn agent_too_old() -> CoreError {
    AgentFeature::Processes.refusal()
}

/// What a run's agent can do beyond exec and files, each from the protocol
/// revision that brought it: the one place those revisions are named.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AgentFeature {
    /// Terminals, background processes, stdin sessions and attach.
    Processes,
    /// Resizing a terminal outside its session.
    Resize,
    /// Paths outside `/work` ([`super::Scope::Root`]).
    RootScope,
    /// File metadata kept as extended attributes.
    Metadata,
    /// Unpacking an archive into the run (image builds' COPY).
    Unpack,
}

impl AgentFeature {
    /// The first protocol revision with it.
    fn protocol(self) -> u32 {
        match self {
            AgentFeature::Processes => 3,
            AgentFeature::Resize | AgentFeature::RootScope => 4,
            AgentFeature::Metadata => 5,
            AgentFeature::Unpack => 8,
        }
    }

    /// The refusal of a run whose agent predates it.
    fn refusal(self) -> CoreError {
        let what = match self {
            AgentFeature::Processes => "terminals and background processes",
            AgentFeature::Resize => "resizing a terminal outside a session",
            AgentFeature::RootScope => "paths outside /work",
            AgentFeature::Metadata => "file metadata",
            AgentFeature::Unpack => "unpacking archives for image builds",
        };
        CoreError::invalid(
            ErrorCode::AgentTooOld,
            format!("this run's agent predates {what}; create the run again"),
        )
    }

    /// `Ok` when an agent speaking `protocol` has it.
    pub(crate) fn check(self, protocol: u32) -> Result<(), CoreError> {
        if protocol >= self.protocol() {
            Ok(())
        } else {
            Err(self.refusal())
        }
    }
}

impl ExecState {
    /// Takes the history point this command would leave, for a caller
    /// that watches its end another way (a background process).
    pub(super) fn take_history(
        &mut self,
    ) -> Option<(super::history::Recorder, runbox_types::PointCause)> {
        self.history.take()
    }
}

/// The state of one exec stream.
pub(super) struct ExecState {
    output: tonic::Streaming<pb::ExecOutput>,
    /// Kept open so the agent does not see stdin's end as a reason to stop;
    /// dropped with the stream.
    _input: mpsc::Sender<pb::ExecInput>,
    handle: Arc<RunHandle>,
    ended: CancellationToken,
    /// Counts the exec in flight until the stream is dropped (not for a
    /// read-only attach).
    _in_flight: Option<InFlight>,
    /// Keeps the run from counting as idle while the stream is open.
    _busy: Busy,
    /// When the daemon stops waiting for a timed-out command's exit report.
    deadline: Option<tokio::time::Instant>,
    started: Option<u32>,
    done: bool,
    /// Where the command's changes are kept as a history point when it
    /// ends, and what the point will say made it (runs with history).
    history: Option<(super::history::Recorder, runbox_types::PointCause)>,
}

impl Drop for ExecState {
    /// A caller that hangs up before the exit still leaves a point: the
    /// agent ends the command's process group as the call drops, and the
    /// point is taken a moment after, with the exit code unknown (-1).
    fn drop(&mut self) {
        let Some((recorder, mut cause)) = self.history.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        cause.exit_code = Some(-1);
        runtime.spawn(async move {
            tokio::time::sleep(HANG_UP_SETTLE).await;
            recorder.record(cause).await;
        });
    }
}

/// How long after a caller hung up on a command its point is taken: the
/// agent has ended the process group by then.
const HANG_UP_SETTLE: Duration = Duration::from_millis(200);

impl ExecState {
    /// The stream of an attach call whose `started` was read.
    pub(super) fn attached(
        output: tonic::Streaming<pb::ExecOutput>,
        input: mpsc::Sender<pb::ExecInput>,
        handle: Arc<RunHandle>,
        pid: u32,
        in_flight: Option<InFlight>,
        busy: Busy,
    ) -> Self {
        Self {
            output,
            _input: input,
            ended: handle.ended.clone(),
            handle,
            deadline: None,
            started: Some(pid),
            done: false,
            history: None,
            _in_flight: in_flight,
            _busy: busy,
        }
    }

    pub(super) async fn next(mut self) -> Option<(ExecEvent, ExecState)> {
        if let Some(pid) = self.started.take() {
            return Some((ExecEvent::Started(pid), self));
        }
        if self.done {
            return None;
        }
        let sleep = async {
            match self.deadline {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let mut event = tokio::select! {
            biased;
            _ = self.ended.cancelled() => {
                // The run is going: no point of it.
                self.history = None;
                let reason = self.handle.end_reason.get().copied().unwrap_or(ExitReason::RunDeleted);
                exit(137, Some(9), false, reason)
            }
            message = self.output.message() => match message {
                Ok(Some(pb::ExecOutput { kind: Some(kind) })) => match kind {
                    exec_output::Kind::Stdout(data) => return Some((ExecEvent::Stdout(Bytes::from(data)), self)),
                    exec_output::Kind::Stderr(data) => return Some((ExecEvent::Stderr(Bytes::from(data)), self)),
                    exec_output::Kind::Exit(e) => {
                        let signal = (e.signal != 0).then_some(e.signal);
                        let reason = match (e.timed_out, signal) {
                            (true, _) => ExitReason::Timeout,
                            (false, Some(_)) => ExitReason::Signaled,
                            (false, None) => ExitReason::Exited,
                        };
                        exit(e.exit_code, signal, e.timed_out, reason)
                    }
                    exec_output::Kind::Lost(lost) => return Some((ExecEvent::Lost(lost.chunks), self)),
                    exec_output::Kind::Started(_) | exec_output::Kind::Error(_) => {
                        tracing::warn!("agent sent an out-of-order exec message");
                        exit(-1, None, false, ExitReason::AgentLost)
                    }
                },
                Ok(Some(pb::ExecOutput { kind: None })) => {
                    tracing::warn!("agent sent an empty exec message");
                    exit(-1, None, false, ExitReason::AgentLost)
                }
                Ok(None) | Err(_) => {
                    // The stream broke. If the run is being destroyed that is
                    // the reason; otherwise the agent is gone.
                    match self.handle.end_reason.get() {
                        Some(reason) => exit(137, Some(9), false, *reason),
                        None => exit(-1, None, false, ExitReason::AgentLost),
                    }
                }
            },
            _ = sleep => {
                tracing::warn!("agent did not report a timed-out command; giving up on it");
                exit(137, Some(9), true, ExitReason::Timeout)
            }
        };
        // The point is taken before the exit is told: the exit event names
        // it, and a caller that reads the exit sees its changes kept.
        if let (Some((recorder, mut cause)), ExecEvent::Exit(exit)) =
            (self.history.take(), &mut event)
        {
            cause.exit_code = Some(exit.exit_code);
            exit.point = recorder.record(cause).await;
        }
        self.done = true;
        Some((event, self))
    }
}

fn exit(exit_code: i32, signal: Option<i32>, timed_out: bool, reason: ExitReason) -> ExecEvent {
    ExecEvent::Exit(ExitEvent {
        exit_code,
        point: None,
        timed_out,
        signal,
        reason,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agent_features_come_with_their_protocol_and_say_what_is_missing() {
        for (feature, first) in [
            (AgentFeature::Processes, 3),
            (AgentFeature::Resize, 4),
            (AgentFeature::RootScope, 4),
            (AgentFeature::Metadata, 5),
            (AgentFeature::Unpack, 8),
        ] {
            assert!(feature.check(first).is_ok(), "{feature:?}");
            assert!(feature.check(first + 1).is_ok(), "{feature:?}");
            let refused = feature.check(first - 1).unwrap_err();
            assert_eq!(refused.code(), ErrorCode::AgentTooOld);
            assert!(
                refused.to_string().contains("create the run again"),
                "{refused}"
            );
        }
    }

    fn status(kind: &str) -> tonic::Status {
        let mut status = tonic::Status::internal("agent says \u{7}no");
        status
            .metadata_mut()
            .insert("runbox-kind", kind.parse().unwrap());
        status
    }

    #[test]
    fn agent_file_errors_map_to_stable_codes() {
        for (kind, code) in [
            ("invalid_path", ErrorCode::BadPath),
            ("escape", ErrorCode::PathEscape),
            ("not_found", ErrorCode::FileNotFound),
            ("not_a_file", ErrorCode::NotAFile),
            ("denied", ErrorCode::PermissionDenied),
            ("io", ErrorCode::AgentUnavailable),
            ("made-up", ErrorCode::AgentUnavailable),
        ] {
            assert_eq!(file_error(status(kind)).code(), code, "{kind}");
        }
    }

    #[test]
    fn agent_text_is_bounded_and_stripped() {
        let long = "x".repeat(10_000);
        assert!(bounded(&long).chars().count() <= 513);
        assert_eq!(bounded("a\u{1b}[31mb\n"), "a[31mb");
    }
}
