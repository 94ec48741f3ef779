//! `runbox-agent`: the PID 1 of every runbox sandbox.
//!
//! The daemon bind-mounts this static binary into the run's root file system
//! and starts it as the container's init, handing it a listening Unix socket
//! as an inherited descriptor. Over that socket it serves the protocol of
//! `runbox-agent-proto`: run commands, write and read files below the work
//! directory, and unpack archives for image builds.
//!
//! Start-up, in order:
//!
//! 1. Parse the command line (`cli`); `--version` answers right away, which
//!    is how the daemon probes a runtime.
//! 2. Make the process non-dumpable, so commands in the run (same uid, no
//!    `CAP_SYS_PTRACE`) cannot open `/proc/1/mem`, `/proc/1/environ` or
//!    `/proc/1/fd` and reach the agent's memory or its socket. Become a
//!    child subreaper when not PID 1, so orphans come to us in tests just as
//!    they do to an init.
//! 3. Mark inherited descriptors close-on-exec, so no command inherits
//!    them, and create the work directory if missing.
//! 4. Start the runtime, install the `SIGCHLD` reaper (`reaper`) before any
//!    command can start, and serve.
//!
//! Signals: as PID 1 of a pid namespace the agent only receives signals it
//! installed handlers for, and it installs none that exit; stopping the run
//! is the runtime's job (SIGKILL from the parent namespace).
//!
//! Everything the agent needs is inside this binary: the images it runs in
//! may have no libc, no shell, nothing.

mod cli;
mod exec;
mod files;
mod fsops;
mod procs;
mod reaper;
mod service;
mod term;
mod unpack;
mod user;
mod watch;

use std::io;
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use runbox_agent_proto::pb::agent_server::AgentServer;
use runbox_agent_proto::MAX_MESSAGE_BYTES;
use runbox_confine as confine;
use runbox_confine::xattrs;
use rustix::io::FdFlags;
use rustix::process::Pid;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::cli::{Invocation, Listen, ServeArgs};
use crate::confine::WorkDir;
use crate::reaper::Reaper;
use crate::service::AgentService;

/// Async worker threads. The agent only relays bytes; two workers are plenty,
/// and every thread counts against the run's pids limit.
const WORKER_THREADS: usize = 2;

/// Upper bound on threads doing blocking file-system work, for the same
/// pids-limit reason.
const MAX_BLOCKING_THREADS: usize = 16;

/// Pause after a failed `accept` (typically out of descriptors) so that a
/// persistent failure does not spin a core.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Why the agent could not start or stopped serving.
#[derive(Debug, thiserror::Error)]
enum FatalError {
    #[error("cannot become a child subreaper")]
    Subreaper(#[source] io::Error),
    #[error("cannot make the agent non-dumpable")]
    Dumpable(#[source] io::Error),
    #[error("cannot resolve the work directory {0:?}")]
    WorkDirPath(PathBuf, #[source] io::Error),
    #[error("cannot create the work directory {0:?}")]
    WorkDir(PathBuf, #[source] io::Error),
    #[error("cannot start the async runtime")]
    Runtime(#[source] io::Error),
    #[error("cannot install the SIGCHLD handler")]
    Reaper(#[source] io::Error),
    #[error("fd {0} is not a listening Unix socket; the daemon must pass one with --preserve-fds")]
    ListenFd(RawFd, #[source] io::Error),
    #[error("cannot listen on {0:?}")]
    Bind(PathBuf, #[source] io::Error),
    #[error("the gRPC server failed")]
    Serve(#[source] tonic::transport::Error),
}

fn main() -> ExitCode {
    let invocation = match cli::parse(std::env::args_os().skip(1)) {
        Ok(invocation) => invocation,
        Err(err) => {
            eprintln!("runbox-agent: {err}\n{}", cli::USAGE);
            return ExitCode::from(2);
        }
    };
    match invocation {
        Invocation::Version => {
            println!("runbox-agent {}", env!("CARGO_PKG_VERSION"));
            ExitCode::SUCCESS
        }
        Invocation::Help => {
            println!("{}", cli::USAGE);
            ExitCode::SUCCESS
        }
        Invocation::Serve(args) => match run(args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(err) => {
                // The one place the whole chain is printed.
                let mut message = format!("runbox-agent: {err}");
                let mut source = std::error::Error::source(&err);
                while let Some(cause) = source {
                    message.push_str(": ");
                    message.push_str(&cause.to_string());
                    source = cause.source();
                }
                eprintln!("{message}");
                ExitCode::FAILURE
            }
        },
    }
}

/// Prepares the process and serves until the listener fails.
fn run(args: ServeArgs) -> Result<(), FatalError> {
    hide_inherited_fds();
    // Commands exec'd from here get the default back (execve resets it), so
    // only the agent itself is protected, which is the point.
    rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)
        .map_err(|errno| FatalError::Dumpable(errno.into()))?;
    let this = rustix::process::getpid();
    if this != Pid::INIT {
        rustix::process::set_child_subreaper(Some(this))
            .map_err(|errno| FatalError::Subreaper(errno.into()))?;
    }

    let work_dir = std::path::absolute(&args.work_dir)
        .map_err(|err| FatalError::WorkDirPath(args.work_dir.clone(), err))?;
    create_work_dir(&work_dir)?;

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(WORKER_THREADS)
        .max_blocking_threads(MAX_BLOCKING_THREADS)
        .enable_all()
        .build()
        .map_err(FatalError::Runtime)?;
    runtime.block_on(serve(args.listen, work_dir))
}

/// Marks every descriptor above stderr close-on-exec, so commands inherit
/// nothing the agent itself inherited (the daemon's socket included).
///
/// Best effort: runc already closes all but the preserved descriptors, and a
/// kernel older than 5.11 lacks the flag; the agent works either way.
fn hide_inherited_fds() {
    // SAFETY: with CLOSE_RANGE_CLOEXEC, close_range closes nothing; it only
    // sets FD_CLOEXEC, so no descriptor owned anywhere in this process is
    // invalidated. It takes no pointers.
    unsafe {
        libc::close_range(
            3,
            libc::c_uint::MAX,
            libc::CLOSE_RANGE_CLOEXEC as libc::c_int,
        );
    }
}

fn create_work_dir(path: &Path) -> Result<(), FatalError> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(path)
        .map_err(|err| FatalError::WorkDir(path.to_owned(), err))
}

async fn serve(listen: Listen, work_dir: PathBuf) -> Result<(), FatalError> {
    // Before anything can spawn a child: no SIGCHLD may go unseen.
    let reaper = Reaper::start().map_err(FatalError::Reaper)?;
    let listener = match listen {
        Listen::Fd(fd) => inherited_listener(fd)?,
        Listen::Socket(path) => {
            UnixListener::bind(&path).map_err(|err| FatalError::Bind(path, err))?
        }
    };
    let service = AgentServer::new(AgentService::new(reaper, WorkDir::new(work_dir)))
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    tonic::transport::Server::builder()
        .add_service(service)
        .serve_with_incoming(accept_loop(listener))
        .await
        .map_err(FatalError::Serve)
}

/// Takes over the listening socket the daemon passed as `fd`.
fn inherited_listener(fd: RawFd) -> Result<UnixListener, FatalError> {
    // SAFETY: the daemon created this socket and handed it to us as `fd`
    // (runc --preserve-fds); nothing else in this process opened or owns it,
    // so the listener becomes its only owner. `cli` ensured fd >= 0.
    let listener = unsafe { std::os::unix::net::UnixListener::from_raw_fd(fd) };
    let check = move || -> io::Result<UnixListener> {
        // getsockname fails unless this is a Unix socket, and SO_ACCEPTCONN
        // tells whether it listens: anything else would make every accept
        // fail and the agent look alive while serving nothing.
        listener.local_addr()?;
        if !rustix::net::sockopt::socket_acceptconn(&listener)? {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "the socket is not listening",
            ));
        }
        // Commands must not inherit the agent's socket.
        rustix::io::fcntl_setfd(&listener, FdFlags::CLOEXEC)?;
        listener.set_nonblocking(true)?;
        UnixListener::from_std(listener)
    };
    check().map_err(|err| FatalError::ListenFd(fd, err))
}

/// Accepts connections for the server, riding out transient failures.
///
/// tonic's own accept loop retries failed accepts immediately, which spins
/// when descriptors run out; this one pauses first.
fn accept_loop(listener: UnixListener) -> ReceiverStream<io::Result<UnixStream>> {
    let (tx, rx) = mpsc::channel(1);
    tokio::spawn(async move {
        loop {
            match listener.accept().await {
                Ok((stream, _)) => {
                    if tx.send(Ok(stream)).await.is_err() {
                        break;
                    }
                }
                Err(_) => tokio::time::sleep(ACCEPT_BACKOFF).await,
            }
        }
    });
    ReceiverStream::new(rx)
}
