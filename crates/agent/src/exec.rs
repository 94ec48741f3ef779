//! The Exec RPC: validates and starts one command.
//!
//! Owns, for each call:
//!
//! 1. Validating `ExecStart` and resolving the program, cwd and environment
//!    ([`prepare`]), so that the common mistakes come back as precise
//!    `error` outputs (`NOT_FOUND`, `PERMISSION_DENIED`, `BAD_CWD`,
//!    `INVALID`, `BAD_USER`, `TAG_IN_USE`) instead of a generic spawn
//!    failure.
//! 2. Starting the command in a new session, so its pid is also the id of a
//!    process group that signals, timeouts and cancellation address as one;
//!    on a new terminal (its controlling terminal) when asked for.
//! 3. Handing it to the process table (`procs`), which relays its I/O: to
//!    this call for a foreground command, whose cancellation kills the
//!    process group; for a background one (`detach`) the call ends after
//!    `started` and the command stays in the table.
//!
//! The input stream ending is not a cancellation: the command keeps running
//! (no more input can arrive from this call).
//!
//! Waiting for the child is not done here: see `reaper`, which owns
//! `waitpid` and hands each status over through a oneshot channel.

use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;

use runbox_agent_proto::pb::{
    exec_input, exec_output, AgentError, EnvVar, ErrorKind, ExecInput, ExecOutput, ExecStart,
    ExecStarted, ProcessInfo, PtySize,
};
use rustix::fs::Access;
use tokio::net::unix::pipe;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};

use crate::procs::{self, Started, Table};
use crate::reaper::{ExitStatus, Reaper};
use crate::term::{self, Sink, Source};

/// The PATH a command gets when its environment has none; the usual Linux
/// default, so images without a shell profile still find their tools.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Output messages buffered per call before the command's pipes stop being
/// read (and the command blocks on write): the backpressure bound.
pub const OUTPUT_CAPACITY: usize = 16;

/// Highest signal number Linux knows (`SIGRTMAX`); larger ones are ignored.
pub const MAX_SIGNAL: i32 = 64;

/// The response stream of one Exec or Attach call.
pub type OutputStream = ReceiverStream<Result<ExecOutput, Status>>;

/// The sending side of an [`OutputStream`].
pub type OutputTx = mpsc::Sender<Result<ExecOutput, Status>>;

/// Why a command could not be started. Each variant becomes one `error`
/// output; nothing here is a gRPC status, because the call itself was fine.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// The request is malformed.
    #[error("invalid exec request: {0}")]
    Invalid(&'static str),
    /// The working directory is unusable.
    #[error("working directory {cwd:?} {reason}")]
    BadCwd {
        /// The resolved working directory.
        cwd: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The user to run as does not exist in the run.
    #[error("{0}")]
    BadUser(String),
    /// A running process already has the tag.
    #[error("a running process already has the tag {0:?}")]
    TagInUse(String),
    /// No PATH entry (or the given path) holds the program.
    #[error("command not found: {0}")]
    NotFound(String),
    /// The program exists but cannot be executed.
    #[error("not executable: {0}")]
    NotExecutable(String),
    /// `fork` failed with `EAGAIN`: the run has as many processes as its
    /// `pids` limit allows (or the user its `RLIMIT_NPROC`).
    #[error("cannot start {0}: the run is at its process limit")]
    ProcessLimit(String),
    /// Starting the command failed for another reason.
    #[error("cannot start {program}")]
    Spawn {
        /// `argv[0]` as the client sent it.
        program: String,
        /// What `fork`/`exec` reported.
        #[source]
        source: io::Error,
    },
}

impl ExecError {
    /// Maps an error from `Command::spawn` the same way as the checks that
    /// run before it, so a race (a file removed in between) reads the same.
    fn from_spawn(program: &str, source: io::Error) -> Self {
        match source.raw_os_error() {
            Some(libc::ENOENT) => Self::NotFound(program.to_owned()),
            Some(libc::EACCES | libc::ENOEXEC) => Self::NotExecutable(program.to_owned()),
            // The kernel's own limits on argv and the environment (one
            // argument of 128 KiB or more, or all of them past ARG_MAX):
            // the caller's input, not a fault of the run.
            Some(libc::EAGAIN) => Self::ProcessLimit(program.to_owned()),
            Some(libc::E2BIG) => Self::Invalid(
                "the arguments and environment are too large for the kernel (E2BIG): keep each argument under 128 KiB and pass bulk data as a file",
            ),
            _ => Self::Spawn {
                program: program.to_owned(),
                source,
            },
        }
    }

    fn kind(&self) -> ErrorKind {
        match self {
            Self::Invalid(_) => ErrorKind::Invalid,
            Self::BadCwd { .. } => ErrorKind::BadCwd,
            Self::BadUser(_) => ErrorKind::BadUser,
            Self::TagInUse(_) => ErrorKind::TagInUse,
            Self::NotFound(_) => ErrorKind::NotFound,
            Self::NotExecutable(_) => ErrorKind::PermissionDenied,
            Self::ProcessLimit(_) => ErrorKind::ProcessLimit,
            Self::Spawn { .. } => ErrorKind::Io,
        }
    }

    /// The `error` output for this failure, with the source chain in the
    /// message since this is where the error leaves the agent.
    fn to_output(&self) -> ExecOutput {
        let mut message = self.to_string();
        let mut source = std::error::Error::source(self);
        while let Some(cause) = source {
            message.push_str(": ");
            message.push_str(&cause.to_string());
            source = cause.source();
        }
        ExecOutput {
            kind: Some(exec_output::Kind::Error(AgentError {
                kind: self.kind().into(),
                message,
            })),
        }
    }
}

/// Runs one Exec call: reads `start`, and returns the output stream while a
/// task starts the command and relays the rest.
///
/// Fails with `invalid_argument` only when the first message is not
/// `start`; everything that goes wrong with the command itself is reported
/// as an `error` output on the stream.
pub async fn exec(
    table: Arc<Table>,
    reaper: Arc<Reaper>,
    work_dir: PathBuf,
    mut input: Streaming<ExecInput>,
) -> Result<OutputStream, Status> {
    let start = match input.message().await? {
        Some(ExecInput {
            kind: Some(exec_input::Kind::Start(start)),
        }) => start,
        _ => {
            return Err(Status::invalid_argument(
                "the first exec message must be start",
            ))
        }
    };
    let (tx, rx) = mpsc::channel(OUTPUT_CAPACITY);
    // Everything from here on runs in its own task, not in this handler:
    // if the client cancels while the command is being started, the handler
    // future is dropped, and the command must still end up supervised (and
    // then killed, as the driver sees the closed channel).
    tokio::spawn(start_and_drive(table, reaper, work_dir, start, input, tx));
    Ok(ReceiverStream::new(rx))
}

/// Starts the command and hands it to the process table, or reports why it
/// could not start.
async fn start_and_drive(
    table: Arc<Table>,
    reaper: Arc<Reaper>,
    work_dir: PathBuf,
    start: ExecStart,
    input: Streaming<ExecInput>,
    tx: OutputTx,
) {
    let timeout_ms = start.timeout_ms;
    let detach = start.detach;
    if !start.tag.is_empty() {
        if let Err(why) = procs::check_tag(&start.tag) {
            let _ = tx.send(Ok(ExecError::Invalid(why).to_output())).await;
            return;
        }
    }
    let Some(claim) = table.claim_tag(&start.tag) else {
        let err = ExecError::TagInUse(start.tag.clone());
        let _ = tx.send(Ok(err.to_output())).await;
        return;
    };
    // Resolving the program stats files and spawning forks and waits for
    // exec: both block, so they run off the async workers.
    let spawned = tokio::task::spawn_blocking(move || {
        let plan = prepare(start, &work_dir)?;
        plan.spawn(&reaper)
    })
    .await;
    let started = match spawned {
        Ok(spawned) => spawned.and_then(Spawned::into_started),
        // The setup task panicked: a bug. Say so instead of hanging the call.
        Err(err) => {
            let message = format!("exec setup failed: {err}");
            let _ = tx.send(Err(Status::internal(message))).await;
            return;
        }
    };
    let started = match started {
        Ok(started) => started,
        Err(err) => {
            let _ = tx.send(Ok(err.to_output())).await;
            return;
        }
    };
    if detach {
        // The call only reports the start; the command is the table's.
        let pid = started.pid as u32;
        procs::supervise(&table, claim, started, timeout_ms, None);
        let started = ExecOutput {
            kind: Some(exec_output::Kind::Started(ExecStarted { pid })),
        };
        let _ = tx.send(Ok(started)).await;
    } else {
        let proc = procs::supervise(&table, claim, started, timeout_ms, Some(tx));
        procs::forward(input, proc).await;
    }
}

/// A validated command, ready to spawn.
#[derive(Debug)]
struct Plan {
    /// What to execute: `argv[0]` itself when it has a slash, otherwise the
    /// PATH entry that holds it.
    program: PathBuf,
    argv: Vec<String>,
    cwd: PathBuf,
    env: Vec<(String, String)>,
    stdin: bool,
    /// `ExecStart.user` as given, for the process table.
    user: String,
    /// Who runs it; None: the agent's own identity (root).
    identity: Option<crate::user::Identity>,
    tag: String,
    detach: bool,
    pty: Option<PtySize>,
    /// `ExecStart.allow_new_privileges`: else no_new_privs before exec.
    allow_new_privileges: bool,
}

/// Validates `start` and resolves what it names, without starting anything.
fn prepare(start: ExecStart, work_dir: &Path) -> Result<Plan, ExecError> {
    validate(&start)?;
    let cwd = resolve_cwd(&start.cwd, work_dir);
    check_cwd(&cwd)?;
    let identity = match start.user.as_str() {
        "" => None,
        spec => Some(crate::user::resolve(spec).map_err(ExecError::BadUser)?),
    };
    let mut env = build_env(start.env);
    // The daemon's default HOME is root's; a user with a home of its own
    // gets that one.
    if let Some(home) = identity
        .as_ref()
        .filter(|i| i.uid != 0)
        .and_then(|i| i.home.clone())
    {
        for (name, value) in env.iter_mut() {
            if name == "HOME" && value == "/root" {
                *value = home.clone();
            }
        }
    }
    let argv0 = &start.argv[0];
    let program = if argv0.contains('/') {
        // Relative paths with a slash are relative to the new cwd, as in a
        // shell; `Command` changes directory before exec, so pass it as is.
        PathBuf::from(argv0)
    } else {
        // The command's own PATH decides, not ours; std would pick the last
        // duplicate, so do the same.
        let path_var = env
            .iter()
            .rev()
            .find(|(name, _)| name == "PATH")
            .map_or(DEFAULT_PATH, |(_, value)| value.as_str());
        lookup(argv0, path_var, &cwd, probe_file)?
    };
    Ok(Plan {
        program,
        argv: start.argv,
        cwd,
        env,
        stdin: start.stdin,
        user: start.user,
        identity,
        tag: start.tag,
        detach: start.detach,
        pty: start.pty,
        allow_new_privileges: start.allow_new_privileges,
    })
}

impl Plan {
    /// Starts the command in its own session through the reaper, on a new
    /// terminal when it asked for one.
    fn spawn(self, reaper: &Reaper) -> Result<Spawned, ExecError> {
        let spawn_error = |source| ExecError::Spawn {
            program: self.argv[0].clone(),
            source,
        };
        let mut command = Command::new(&self.program);
        command
            .arg0(&self.argv[0])
            .args(&self.argv[1..])
            .current_dir(&self.cwd)
            .env_clear()
            .envs(self.env.iter().map(|(k, v)| (k, v)));
        let pty = match &self.pty {
            Some(size) => {
                let owner = self
                    .identity
                    .as_ref()
                    .map(|i| i.uid)
                    .filter(|&uid| uid != 0);
                let pty = term::open(size, owner).map_err(spawn_error)?;
                let copy = || pty.slave.try_clone().map(Stdio::from).map_err(spawn_error);
                command.stdin(copy()?).stdout(copy()?).stderr(copy()?);
                Some(pty)
            }
            None => {
                command
                    .stdin(if self.stdin {
                        Stdio::piped()
                    } else {
                        Stdio::null()
                    })
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped());
                None
            }
        };
        let identity = self.identity.clone();
        let terminal = pty.is_some();
        let no_new_privs = !self.allow_new_privileges;
        // SAFETY: the closure runs in the child between fork and exec, where
        // only async-signal-safe calls are allowed; `child_setup` and
        // `become_user` make only raw system calls (setsid, sigprocmask,
        // sigaction, ioctl, setgroups, setgid, setuid, prctl) and allocate
        // nothing (the group list was made before the fork).
        unsafe {
            command.pre_exec(move || {
                child_setup()?;
                // The terminal (already stdin) becomes the new session's
                // controlling terminal, so ^C and job control work.
                if terminal && libc::ioctl(0, libc::TIOCSCTTY, 0) != 0 {
                    return Err(io::Error::last_os_error());
                }
                if let Some(identity) = &identity {
                    become_user(identity)?;
                }
                // Set last and unconditionally unless allowed: the command
                // and everything it starts cannot gain privileges by exec.
                if no_new_privs && libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let started_unix_ms = procs::unix_ms(std::time::SystemTime::now());
        let (mut child, exit) = reaper
            .spawn(&mut command)
            .map_err(|err| ExecError::from_spawn(&self.argv[0], err))?;
        // The child has its copies of the terminal's slave side; the agent
        // keeps none, so the master reads end of file once the command and
        // whatever it left behind are gone.
        drop(command);
        // Pids fit in i32 on Linux.
        let pid = child.id() as i32;
        let fixed = ProcessInfo {
            pid: pid as u32,
            tag: self.tag,
            argv: self.argv,
            cwd: self.cwd.display().to_string(),
            user: self.user,
            started_unix_ms,
            detached: self.detach,
            pty: terminal,
            ..Default::default()
        };
        Ok(Spawned {
            pid,
            fixed,
            stdin: child.stdin.take().map(OwnedFd::from),
            stdout: child.stdout.take().map(OwnedFd::from),
            stderr: child.stderr.take().map(OwnedFd::from),
            master: pty.map(|pty| pty.master),
            exit,
        })
        // `child` is dropped without waiting: the reaper owns that.
    }
}

/// Runs in the child after fork: becomes a session (and so process group)
/// leader, and undoes signal state the agent's runtime changed, so the
/// command starts the way it would from a shell.
fn child_setup() -> io::Result<()> {
    rustix::process::setsid()?;
    // SAFETY: `set` and `action` are zero-initialised plain C structs that
    // live for the duration of the calls; sigemptyset, sigprocmask and
    // sigaction are async-signal-safe and only read or write those structs.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigprocmask(libc::SIG_SETMASK, &set, std::ptr::null_mut());
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = libc::SIG_DFL;
        for signal in 1..=MAX_SIGNAL {
            // Ignored dispositions (std ignores SIGPIPE) survive exec, and
            // handled ones would be reset anyway. SIGKILL, SIGSTOP and the
            // libc-reserved real-time signals refuse the change, harmlessly.
            libc::sigaction(signal, &action, std::ptr::null_mut());
        }
    }
    Ok(())
}

/// Drops to `identity`: supplementary groups, then the group, then the
/// user (after which the others could not be changed).
fn become_user(identity: &crate::user::Identity) -> io::Result<()> {
    // SAFETY: setgroups, setgid and setuid are async-signal-safe system
    // calls; the group slice lives in the closure for the whole call.
    unsafe {
        if libc::setgroups(identity.groups.len(), identity.groups.as_ptr()) != 0
            || libc::setgid(identity.gid) != 0
            || libc::setuid(identity.uid) != 0
        {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// A started command, with its descriptors still plain (they are
/// registered with the runtime on the async side).
struct Spawned {
    pid: i32,
    fixed: ProcessInfo,
    stdin: Option<OwnedFd>,
    stdout: Option<OwnedFd>,
    stderr: Option<OwnedFd>,
    /// The terminal's master side, for a command on a terminal.
    master: Option<OwnedFd>,
    exit: oneshot::Receiver<ExitStatus>,
}

impl Spawned {
    fn into_started(self) -> Result<Started, ExecError> {
        let pid = self.pid;
        let convert = move || -> io::Result<Started> {
            let missing = || io::Error::other("child pipe missing");
            if let Some(master) = self.master {
                let master = term::master(master)?;
                return Ok(Started {
                    pid,
                    fixed: self.fixed,
                    stdin: Some(Sink::Pty(Arc::clone(&master))),
                    stdout: Source::Pty(Arc::clone(&master)),
                    stderr: None,
                    exit: self.exit,
                    master: Some(master),
                });
            }
            Ok(Started {
                pid,
                fixed: self.fixed,
                stdin: self
                    .stdin
                    .map(pipe::Sender::from_owned_fd)
                    .transpose()?
                    .map(Sink::Pipe),
                stdout: Source::Pipe(pipe::Receiver::from_owned_fd(
                    self.stdout.ok_or_else(missing)?,
                )?),
                stderr: Some(Source::Pipe(pipe::Receiver::from_owned_fd(
                    self.stderr.ok_or_else(missing)?,
                )?)),
                exit: self.exit,
                master: None,
            })
        };
        convert().map_err(|source| {
            // The command runs but cannot be relayed: do not leave it behind.
            signal_group(pid, libc::SIGKILL);
            ExecError::Spawn {
                program: format!("pid {pid}"),
                source,
            }
        })
    }
}

/// Sends `signal` to the process group `pgid`, ignoring failure (the group
/// may already be gone).
pub fn signal_group(pgid: i32, signal: i32) {
    // kill(0) and kill(-1) would hit our own group or every process in the
    // run; a command's pgid is never 0 or 1, but make sure.
    if pgid <= 1 {
        return;
    }
    // SAFETY: kill takes no pointers and has no memory-safety
    // preconditions; with pgid > 1, -pgid addresses exactly that group.
    unsafe {
        libc::kill(-pgid, signal);
    }
}

/// Checks what the request can be checked for without the file system.
fn validate(start: &ExecStart) -> Result<(), ExecError> {
    let Some(argv0) = start.argv.first() else {
        return Err(ExecError::Invalid("argv must not be empty"));
    };
    if argv0.is_empty() {
        return Err(ExecError::Invalid("argv[0] must not be empty"));
    }
    let strings = start
        .argv
        .iter()
        .chain(std::iter::once(&start.cwd))
        .chain(start.env.iter().flat_map(|v| [&v.name, &v.value]));
    for s in strings {
        if s.contains('\0') {
            return Err(ExecError::Invalid(
                "argv, cwd and env must not contain NUL bytes",
            ));
        }
    }
    if start
        .env
        .iter()
        .any(|v| v.name.is_empty() || v.name.contains('='))
    {
        return Err(ExecError::Invalid(
            "environment variable names must be non-empty and must not contain '='",
        ));
    }
    Ok(())
}

/// Empty means the work directory; relative is relative to it; absolute
/// stays as is (exec is not confined to the work directory).
fn resolve_cwd(cwd: &str, work_dir: &Path) -> PathBuf {
    // `join` with an absolute path replaces the base, which is the intent.
    work_dir.join(cwd)
}

fn check_cwd(cwd: &Path) -> Result<(), ExecError> {
    let reason = match std::fs::metadata(cwd) {
        Ok(meta) if meta.is_dir() => return Ok(()),
        Ok(_) => "is not a directory".to_owned(),
        Err(err) if err.kind() == io::ErrorKind::NotFound => "does not exist".to_owned(),
        Err(err) => format!("cannot be used: {err}"),
    };
    Err(ExecError::BadCwd {
        cwd: cwd.to_owned(),
        reason,
    })
}

/// The command's environment: exactly what was given, plus a default PATH
/// when none was.
fn build_env(vars: Vec<EnvVar>) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = vars.into_iter().map(|v| (v.name, v.value)).collect();
    if !env.iter().any(|(name, _)| name == "PATH") {
        env.push(("PATH".to_owned(), DEFAULT_PATH.to_owned()));
    }
    env
}

/// What a PATH candidate turned out to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Probe {
    Missing,
    NotExecutable,
    Executable,
}

/// Finds `name` in `path_var` like a shell does: the first entry holding an
/// executable regular file wins. Empty entries mean the cwd; relative ones
/// are relative to it. A file found but not executable only matters when
/// nothing executable is found, and then turns "not found" into "not
/// executable".
fn lookup(
    name: &str,
    path_var: &str,
    cwd: &Path,
    probe: impl Fn(&Path) -> Probe,
) -> Result<PathBuf, ExecError> {
    let mut found_unexecutable = false;
    for dir in path_var.split(':') {
        let candidate = cwd.join(dir).join(name);
        match probe(&candidate) {
            Probe::Executable => return Ok(candidate),
            Probe::NotExecutable => found_unexecutable = true,
            Probe::Missing => {}
        }
    }
    Err(if found_unexecutable {
        ExecError::NotExecutable(name.to_owned())
    } else {
        ExecError::NotFound(name.to_owned())
    })
}

/// Looks at one PATH candidate on disk. Directories are skipped like missing
/// files, as shells do.
fn probe_file(path: &Path) -> Probe {
    match std::fs::metadata(path) {
        Ok(meta) if meta.is_file() => {
            if rustix::fs::access(path, Access::EXEC_OK).is_ok() {
                Probe::Executable
            } else {
                Probe::NotExecutable
            }
        }
        _ => Probe::Missing,
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn start(argv: &[&str]) -> ExecStart {
        ExecStart {
            argv: argv.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    fn var(name: &str, value: &str) -> EnvVar {
        EnvVar {
            name: name.into(),
            value: value.into(),
        }
    }

    #[test]
    fn validation_refuses_malformed_requests() {
        assert!(validate(&start(&["ls"])).is_ok());
        assert!(matches!(validate(&start(&[])), Err(ExecError::Invalid(_))));
        assert!(matches!(
            validate(&start(&[""])),
            Err(ExecError::Invalid(_))
        ));
        assert!(matches!(
            validate(&start(&["ls", "a\0b"])),
            Err(ExecError::Invalid(_))
        ));
        let mut s = start(&["ls"]);
        s.cwd = "x\0".into();
        assert!(matches!(validate(&s), Err(ExecError::Invalid(_))));
        for bad in [var("A", "\0"), var("", "x"), var("A=B", "x")] {
            let mut s = start(&["ls"]);
            s.env = vec![bad];
            assert!(matches!(validate(&s), Err(ExecError::Invalid(_))));
        }
    }

    #[test]
    fn env_is_exact_plus_default_path() {
        assert_eq!(
            build_env(vec![var("A", "1")]),
            [
                ("A".into(), "1".into()),
                ("PATH".into(), DEFAULT_PATH.into())
            ]
        );
        assert_eq!(
            build_env(vec![var("PATH", "/x"), var("B", "")]),
            [("PATH".into(), "/x".into()), ("B".into(), "".into())]
        );
    }

    #[test]
    fn cwd_resolution() {
        let work = Path::new("/work");
        assert_eq!(resolve_cwd("", work), Path::new("/work"));
        assert_eq!(resolve_cwd("sub/dir", work), Path::new("/work/sub/dir"));
        assert_eq!(resolve_cwd("/tmp", work), Path::new("/tmp"));
    }

    #[test]
    fn lookup_takes_first_executable() {
        let probe = |p: &Path| match p.to_str().unwrap() {
            "/a/tool" => Probe::NotExecutable,
            "/b/tool" | "/c/tool" => Probe::Executable,
            "/cwd/rel/tool" | "/cwd/here" => Probe::Executable,
            _ => Probe::Missing,
        };
        let cwd = Path::new("/cwd");
        assert_eq!(
            lookup("tool", "/a:/b:/c", cwd, probe).unwrap(),
            Path::new("/b/tool")
        );
        assert_eq!(
            lookup("tool", "/x:rel", cwd, probe).unwrap(),
            Path::new("/cwd/rel/tool")
        );
        // An empty entry means the working directory.
        assert_eq!(
            lookup("here", "/x::/y", cwd, probe).unwrap(),
            Path::new("/cwd/here")
        );
        assert!(matches!(
            lookup("tool", "/a:/x", cwd, probe),
            Err(ExecError::NotExecutable(name)) if name == "tool"
        ));
        assert!(matches!(
            lookup("nope", "/a:/b", cwd, probe),
            Err(ExecError::NotFound(name)) if name == "nope"
        ));
    }

    #[test]
    fn probe_looks_at_type_and_mode() {
        let dir = tempfile::tempdir().unwrap();
        let exe = dir.path().join("exe");
        let plain = dir.path().join("plain");
        std::fs::write(&exe, "#!/bin/sh\n").unwrap();
        std::fs::write(&plain, "").unwrap();
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(&plain, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(probe_file(&exe), Probe::Executable);
        // Even root cannot execute a file without any execute bit.
        assert_eq!(probe_file(&plain), Probe::NotExecutable);
        assert_eq!(probe_file(dir.path()), Probe::Missing);
        assert_eq!(probe_file(&dir.path().join("none")), Probe::Missing);
    }

    #[test]
    fn spawn_errors_map_like_the_checks() {
        let err = |errno| ExecError::from_spawn("x", io::Error::from_raw_os_error(errno));
        assert_eq!(err(libc::ENOENT).kind(), ErrorKind::NotFound);
        assert_eq!(err(libc::EACCES).kind(), ErrorKind::PermissionDenied);
        assert_eq!(err(libc::ENOEXEC).kind(), ErrorKind::PermissionDenied);
        assert_eq!(err(libc::ENOMEM).kind(), ErrorKind::Io);
        assert_eq!(err(libc::E2BIG).kind(), ErrorKind::Invalid);
        let Some(exec_output::Kind::Error(e)) = err(libc::ENOMEM).to_output().kind else {
            panic!("expected an error output");
        };
        assert!(e.message.starts_with("cannot start x: "), "{}", e.message);
    }
}
