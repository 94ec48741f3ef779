//! The process table: every command the agent runs, while it runs, and
//! background commands for a while after they ended.
//!
//! Owns, for each command:
//!
//! * Its output: both streams are always read, by one pump each. A chunk
//!   goes into a bounded replay buffer ([`REPLAY_BYTES`]) and to every
//!   attached reader, and for a foreground command to the call that started
//!   it. That call is the one reader with backpressure (a slow client slows
//!   the command down, so an exec's output is never lost); attached readers
//!   that fall behind skip output and are told how much (`lost`), so no
//!   reader can stall a background command.
//! * Its input: stdin bytes, close, signals and terminal resizes from any
//!   call go through one queue, applied in order by one task, so a signal
//!   sent after some bytes arrives after them.
//! * Its end: the driver waits for the exit status (from the reaper),
//!   enforces the timeout, kills a foreground command whose call went away,
//!   drains the pumps, then publishes the status: to the starting call as
//!   `exit`, to attached readers, and to waiters.
//!
//! Foreground commands leave the table when they end. Background ones stay,
//! with their replay buffer, until [`KEEP_EXITED`] newer ones ended or
//! [`KEEP_EXITED_FOR`] passed.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime};

use runbox_agent_proto::pb::{
    exec_input, exec_output, ExecExit, ExecInput, ExecOutput, ExecStarted, OutputLost, ProcessInfo,
    ProcessRef, PtySize, SendInputRequest, SignalProcessRequest, WaitProcessRequest,
};
use runbox_agent_proto::CHUNK_SIZE;
use tokio::sync::{broadcast, mpsc, oneshot, watch};
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::MetadataValue;
use tonic::{Code, Status, Streaming};

use crate::confine::KIND_METADATA_KEY;
use crate::exec::{signal_group, OutputStream, OutputTx, MAX_SIGNAL, OUTPUT_CAPACITY};
use crate::reaper::ExitStatus;
use crate::term::{self, Sink, Source};

/// Recent output kept per command for attaching readers, in bytes.
pub const REPLAY_BYTES: usize = 256 * 1024;

/// Ended background commands kept, newest first.
pub const KEEP_EXITED: usize = 64;

/// How long an ended background command is kept.
pub const KEEP_EXITED_FOR: Duration = Duration::from_secs(600);

/// Chunks an attached reader may be behind before it skips some.
const READER_BACKLOG: usize = 256;

/// Input messages queued per command before senders wait.
const INPUT_QUEUE: usize = 16;

/// How long to keep reading the output after the command exited. Processes
/// it left behind may hold the pipes (or the terminal) open forever; this
/// bounds the wait for their end while still catching output written just
/// before the exit.
const DRAIN_LIMIT: Duration = Duration::from_millis(200);

/// The longest tag.
pub const MAX_TAG: usize = 64;

/// One piece of output.
#[derive(Clone, Debug)]
pub struct Chunk {
    pub stderr: bool,
    pub data: Arc<[u8]>,
}

impl Chunk {
    fn to_output(&self) -> ExecOutput {
        let data = self.data.to_vec();
        let kind = if self.stderr {
            exec_output::Kind::Stderr(data)
        } else {
            exec_output::Kind::Stdout(data)
        };
        ExecOutput { kind: Some(kind) }
    }
}

/// What can be done to a running command's input.
#[derive(Debug)]
pub enum Input {
    Data(Vec<u8>),
    Close,
    Signal(i32),
    Resize(PtySize),
}

/// How a command ended.
#[derive(Clone, Copy, Debug)]
pub struct Ended {
    pub status: ExitStatus,
    pub timed_out: bool,
    pub at_unix_ms: i64,
}

impl Ended {
    fn exit(&self) -> ExecExit {
        ExecExit {
            exit_code: self.status.code,
            signal: self.status.signal,
            timed_out: self.timed_out,
        }
    }
}

/// What the table knows of one command.
#[derive(Debug)]
pub struct Proc {
    pub pid: i32,
    /// The description that does not change: pid, tag, argv and so on.
    fixed: ProcessInfo,
    output: Mutex<Output>,
    ended: watch::Sender<Option<Ended>>,
    input: mpsc::Sender<Input>,
    stdin_open: AtomicBool,
}

#[derive(Debug)]
struct Output {
    replay: VecDeque<Chunk>,
    replay_bytes: usize,
    /// Attached readers; None once the output is complete.
    live: Option<broadcast::Sender<Chunk>>,
}

impl Proc {
    /// The command as `ProcessInfo`.
    pub fn info(&self) -> ProcessInfo {
        let ended = *self.ended.borrow();
        ProcessInfo {
            running: ended.is_none(),
            exit: ended.as_ref().map(Ended::exit),
            ended_unix_ms: ended.map_or(0, |e| e.at_unix_ms),
            stdin_open: ended.is_none() && self.stdin_open.load(Ordering::Relaxed),
            ..self.fixed.clone()
        }
    }

    pub fn ended(&self) -> Option<Ended> {
        *self.ended.borrow()
    }

    fn lock_output(&self) -> MutexGuard<'_, Output> {
        self.output.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Adds a chunk to the replay buffer and hands it to attached readers,
    /// in one step, so a reader attaching concurrently sees it exactly once.
    fn publish(&self, chunk: &Chunk) {
        let mut out = self.lock_output();
        out.replay_bytes += chunk.data.len();
        out.replay.push_back(chunk.clone());
        while out.replay_bytes > REPLAY_BYTES {
            match out.replay.pop_front() {
                Some(old) => out.replay_bytes -= old.data.len(),
                None => break,
            }
        }
        if let Some(live) = &out.live {
            // No receivers is fine: nobody is attached.
            let _ = live.send(chunk.clone());
        }
    }

    /// Queues input for the command, in order with everything else queued.
    pub async fn send(&self, input: Input) -> Result<(), Status> {
        if self.ended().is_some() {
            return Err(not_running());
        }
        if let Input::Data(_) | Input::Close = input {
            if !self.stdin_open.load(Ordering::Relaxed) {
                return Err(stdin_closed());
            }
        }
        // Later writes fail at once instead of after the queue drained.
        if matches!(input, Input::Close) && !self.fixed.pty {
            self.stdin_open.store(false, Ordering::Relaxed);
        }
        self.input.send(input).await.map_err(|_| not_running())
    }

    /// Waits until the command ended, or `limit` passed.
    pub async fn wait(&self, limit: Duration) -> Option<Ended> {
        let mut rx = self.ended.subscribe();
        let _ = tokio::time::timeout(limit, rx.wait_for(Option::is_some)).await;
        self.ended()
    }
}

/// Every command the agent runs, in start order.
#[derive(Default, Debug)]
pub struct Table {
    inner: Mutex<Inner>,
}

#[derive(Default, Debug)]
struct Inner {
    procs: Vec<Arc<Proc>>,
    /// Tags claimed by commands being started.
    reserved: HashSet<String>,
}

/// A tag held until the command is in the table (or failed to start).
pub struct TagClaim {
    table: Arc<Table>,
    tag: Option<String>,
}

impl Drop for TagClaim {
    fn drop(&mut self) {
        if let Some(tag) = self.tag.take() {
            self.table.lock().reserved.remove(&tag);
        }
    }
}

/// Checks a tag's grammar: what `pid or tag` references can tell apart.
pub fn check_tag(tag: &str) -> Result<(), &'static str> {
    if tag.is_empty() || tag.len() > MAX_TAG {
        return Err("a tag must be 1 to 64 characters");
    }
    if !tag
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        return Err("a tag may contain only letters, digits, '.', '_' and '-'");
    }
    if tag.bytes().all(|b| b.is_ascii_digit()) {
        return Err("a tag must not be all digits (it would read as a pid)");
    }
    Ok(())
}

impl Table {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Claims `tag` for a command about to start; false when a running
    /// command (or another start) holds it.
    pub fn claim_tag(self: &Arc<Self>, tag: &str) -> Option<TagClaim> {
        if tag.is_empty() {
            return Some(TagClaim {
                table: Arc::clone(self),
                tag: None,
            });
        }
        let mut inner = self.lock();
        let running = inner
            .procs
            .iter()
            .any(|p| p.fixed.tag == tag && p.ended().is_none());
        if running || !inner.reserved.insert(tag.to_owned()) {
            return None;
        }
        Some(TagClaim {
            table: Arc::clone(self),
            tag: Some(tag.to_owned()),
        })
    }

    /// The command `process` names: by pid (the running one first, should
    /// an ended one have had the same pid), or by tag (the running one,
    /// else the latest that ended).
    pub fn find(&self, process: Option<&ProcessRef>) -> Result<Arc<Proc>, Status> {
        let Some(process) = process else {
            return Err(invalid("name the process by pid or tag"));
        };
        let inner = self.lock();
        let matches = |p: &&Arc<Proc>| {
            if process.pid != 0 {
                p.pid as u32 == process.pid
            } else {
                !process.tag.is_empty() && p.fixed.tag == process.tag
            }
        };
        let mut found: Vec<&Arc<Proc>> = inner.procs.iter().filter(matches).collect();
        found.sort_by_key(|p| (p.ended().is_none(), p.fixed.started_unix_ms));
        found.last().map(|p| Arc::clone(p)).ok_or_else(|| {
            let name = if process.pid != 0 {
                format!("pid {}", process.pid)
            } else {
                format!("tag {:?}", process.tag)
            };
            status(
                Code::NotFound,
                "no_process",
                format!("no process with {name} (ended processes are kept only for a while, and only background ones)"),
            )
        })
    }

    /// Every command in the table, in start order.
    pub fn list(&self) -> Vec<ProcessInfo> {
        let mut inner = self.lock();
        prune(&mut inner);
        inner.procs.iter().map(|p| p.info()).collect()
    }

    fn insert(&self, proc: Arc<Proc>, claim: TagClaim) {
        let mut inner = self.lock();
        // A pid can come back (the run's pid space wraps); the old entry
        // has ended, and a pid must name one process.
        inner.procs.retain(|p| p.pid != proc.pid);
        inner.procs.push(proc);
        drop(inner);
        drop(claim);
    }

    fn ended(&self, pid: i32, keep: bool) {
        let mut inner = self.lock();
        if !keep {
            inner.procs.retain(|p| p.pid != pid || p.ended().is_none());
        }
        prune(&mut inner);
    }
}

/// Drops ended commands beyond the count or age kept.
fn prune(inner: &mut Inner) {
    let now = unix_ms(SystemTime::now());
    let oldest = now - KEEP_EXITED_FOR.as_millis() as i64;
    let mut ended: Vec<(i64, i32)> = inner
        .procs
        .iter()
        .filter_map(|p| p.ended().map(|e| (e.at_unix_ms, p.pid)))
        .collect();
    ended.sort_unstable_by(|a, b| b.cmp(a));
    let drop: HashSet<i32> = ended
        .iter()
        .enumerate()
        .filter(|(i, (at, _))| *i >= KEEP_EXITED || *at < oldest)
        .map(|(_, (_, pid))| *pid)
        .collect();
    if !drop.is_empty() {
        inner
            .procs
            .retain(|p| p.ended().is_none() || !drop.contains(&p.pid));
    }
}

/// A command that has just been started, with its descriptors ready.
pub struct Started {
    pub pid: i32,
    pub fixed: ProcessInfo,
    pub stdin: Option<Sink>,
    pub stdout: Source,
    pub stderr: Option<Source>,
    pub exit: oneshot::Receiver<ExitStatus>,
    pub master: Option<term::Master>,
}

/// Puts a started command in the table and supervises it to its end.
///
/// `primary` is the call that started a foreground command: it receives
/// `started`, every chunk (with backpressure) and `exit`, and its going away
/// kills the command. A background command has none.
pub fn supervise(
    table: &Arc<Table>,
    claim: TagClaim,
    started: Started,
    timeout_ms: u64,
    primary: Option<OutputTx>,
) -> Arc<Proc> {
    let (input_tx, input_rx) = mpsc::channel(INPUT_QUEUE);
    let (live, _) = broadcast::channel(READER_BACKLOG);
    let proc = Arc::new(Proc {
        pid: started.pid,
        stdin_open: AtomicBool::new(started.stdin.is_some()),
        fixed: started.fixed,
        output: Mutex::new(Output {
            replay: VecDeque::new(),
            replay_bytes: 0,
            live: Some(live),
        }),
        ended: watch::channel(None).0,
        input: input_tx,
    });
    table.insert(Arc::clone(&proc), claim);
    let pumps = Pumps {
        stdout: started.stdout,
        stderr: started.stderr,
    };
    tokio::spawn(drive(
        Arc::clone(table),
        Arc::clone(&proc),
        pumps,
        started.stdin,
        started.master,
        input_rx,
        started.exit,
        timeout_ms,
        primary,
    ));
    proc
}

struct Pumps {
    stdout: Source,
    stderr: Option<Source>,
}

#[allow(clippy::too_many_arguments)] // One call site; the parts of one command.
async fn drive(
    table: Arc<Table>,
    proc: Arc<Proc>,
    pumps: Pumps,
    stdin: Option<Sink>,
    master: Option<term::Master>,
    input: mpsc::Receiver<Input>,
    mut exit: oneshot::Receiver<ExitStatus>,
    timeout_ms: u64,
    primary: Option<OutputTx>,
) {
    let pgid = proc.pid;
    let mut cancelled = false;
    if let Some(tx) = &primary {
        let started = ExecOutput {
            kind: Some(exec_output::Kind::Started(ExecStarted { pid: pgid as u32 })),
        };
        if tx.send(Ok(started)).await.is_err() {
            cancelled = true;
            signal_group(pgid, libc::SIGKILL);
        }
    }

    // Pumps start after `started` went out, so it is always first.
    let (stop_tx, stop_rx) = watch::channel(false);
    let out_task = tokio::spawn(pump(
        pumps.stdout,
        false,
        Arc::clone(&proc),
        primary.clone(),
        stop_rx.clone(),
    ));
    let err_task = pumps.stderr.map(|source| {
        tokio::spawn(pump(
            source,
            true,
            Arc::clone(&proc),
            primary.clone(),
            stop_rx,
        ))
    });
    let input_task = tokio::spawn(apply_input(input, stdin, master, Arc::clone(&proc)));

    let deadline = (timeout_ms > 0)
        .then(|| Instant::now().checked_add(Duration::from_millis(timeout_ms)))
        .flatten();
    let timer = async move {
        match deadline {
            Some(deadline) => tokio::time::sleep_until(deadline).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(timer);
    let mut timed_out = false;
    let watched = primary.clone();
    let primary_gone = async move {
        match &watched {
            Some(tx) => tx.closed().await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(primary_gone);

    let status = loop {
        tokio::select! {
            // Exit first: once the leader is reaped its pid may be recycled,
            // so no further signal should be aimed at its group.
            biased;
            status = &mut exit => break status,
            () = &mut timer, if !timed_out => {
                timed_out = true;
                signal_group(pgid, libc::SIGKILL);
            }
            () = &mut primary_gone, if !cancelled => {
                cancelled = true;
                signal_group(pgid, libc::SIGKILL);
            }
        }
    };
    input_task.abort();

    // The pumps finish the chunk in hand either way, so nothing already read
    // is lost.
    let readers = async {
        let _ = out_task.await;
        if let Some(task) = err_task {
            let _ = task.await;
        }
    };
    tokio::pin!(readers);
    if tokio::time::timeout(DRAIN_LIMIT, &mut readers)
        .await
        .is_err()
    {
        let _ = stop_tx.send(true);
        readers.await;
    }

    let ended = status.ok().map(|status| Ended {
        status,
        timed_out,
        at_unix_ms: unix_ms(SystemTime::now()),
    });
    // Only possible if the reaper task died: the status is unknown, and
    // the command is reported as killed rather than invented as a success.
    let ended = ended.unwrap_or(Ended {
        status: ExitStatus {
            code: 128 + libc::SIGKILL,
            signal: libc::SIGKILL,
        },
        timed_out,
        at_unix_ms: unix_ms(SystemTime::now()),
    });
    // The status first, then the end of the live output: a reader that sees
    // the output end finds the status set.
    proc.ended.send_replace(Some(ended));
    proc.lock_output().live = None;
    let keep = proc.fixed.detached;
    if !keep {
        // Nobody can attach any more; free the buffer now.
        let mut out = proc.lock_output();
        out.replay.clear();
        out.replay_bytes = 0;
    }
    table.ended(pgid, keep);

    if let (Some(tx), false) = (primary, cancelled) {
        let last = ExecOutput {
            kind: Some(exec_output::Kind::Exit(ended.exit())),
        };
        let _ = tx.send(Ok(last)).await;
    }
}

/// Reads one output stream until its end, a stop request, or (for a
/// foreground command) the starting call going away.
async fn pump(
    mut source: Source,
    stderr: bool,
    proc: Arc<Proc>,
    primary: Option<OutputTx>,
    mut stop: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; CHUNK_SIZE];
    loop {
        let n = tokio::select! {
            // Stop wins over ready data: a process that never stops writing
            // must not keep the command open.
            biased;
            _ = stop.wait_for(|stop| *stop) => return,
            read = source.read(&mut buf) => match read {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            },
        };
        let chunk = Chunk {
            stderr,
            data: Arc::from(&buf[..n]),
        };
        proc.publish(&chunk);
        if let Some(tx) = &primary {
            if tx.send(Ok(chunk.to_output())).await.is_err() {
                return;
            }
        }
    }
}

/// Applies queued input in order until the command ended.
///
/// Closing a terminal's input sends its end-of-file character (^D) instead:
/// the terminal stays, as other processes may use it.
async fn apply_input(
    mut input: mpsc::Receiver<Input>,
    mut stdin: Option<Sink>,
    master: Option<term::Master>,
    proc: Arc<Proc>,
) {
    while let Some(message) = input.recv().await {
        match message {
            Input::Data(data) => {
                if let Some(sink) = stdin.as_mut() {
                    // EPIPE: the command closed its stdin; drop later bytes.
                    if sink.write_all(&data).await.is_err() {
                        stdin = None;
                        proc.stdin_open.store(false, Ordering::Relaxed);
                    }
                }
            }
            Input::Close => {
                if master.is_some() {
                    if let Some(sink) = stdin.as_mut() {
                        let _ = sink.write_all(&[0x04]).await;
                    }
                } else {
                    stdin = None;
                    proc.stdin_open.store(false, Ordering::Relaxed);
                }
            }
            Input::Signal(signal) => {
                if (1..=MAX_SIGNAL).contains(&signal) {
                    signal_group(proc.pid, signal);
                }
            }
            Input::Resize(size) => {
                if let Some(master) = &master {
                    let _ = term::resize(master.get_ref(), &size);
                }
            }
        }
    }
}

/// Turns one protocol input message into queued input; false for messages
/// with no meaning here (a second `start` or `attach`, an empty one).
pub fn input_of(message: ExecInput) -> Option<Input> {
    match message.kind? {
        exec_input::Kind::Stdin(data) => Some(Input::Data(data)),
        exec_input::Kind::CloseStdin(_) => Some(Input::Close),
        exec_input::Kind::Signal(s) => Some(Input::Signal(s.signal)),
        exec_input::Kind::Resize(size) => Some(Input::Resize(size)),
        exec_input::Kind::Start(_) | exec_input::Kind::Attach(_) => None,
    }
}

/// Forwards a call's input messages to the command until the call
/// half-closes or the command ended. Input the command cannot take (its
/// stdin closed) is dropped, as writing to a closed pipe would be.
pub async fn forward(mut input: Streaming<ExecInput>, proc: Arc<Proc>) {
    // A broken input stream means the same as a finished one: no more input.
    while let Ok(Some(message)) = input.message().await {
        if let Some(input) = input_of(message) {
            if proc.send(input).await.is_err() && proc.ended().is_some() {
                return;
            }
        }
    }
}

/// Streams a command's output to an attaching call: `started`, the replay
/// buffer when asked for, live output, then `exit`.
pub async fn follow(proc: Arc<Proc>, replay: bool, tx: OutputTx) {
    let (backlog, live) = {
        let out = proc.lock_output();
        let backlog: Vec<Chunk> = if replay {
            out.replay.iter().cloned().collect()
        } else {
            Vec::new()
        };
        (backlog, out.live.as_ref().map(broadcast::Sender::subscribe))
    };
    let started = ExecOutput {
        kind: Some(exec_output::Kind::Started(ExecStarted {
            pid: proc.pid as u32,
        })),
    };
    if tx.send(Ok(started)).await.is_err() {
        return;
    }
    for chunk in backlog {
        if tx.send(Ok(chunk.to_output())).await.is_err() {
            return;
        }
    }
    if let Some(mut live) = live {
        loop {
            let message = tokio::select! {
                received = live.recv() => match received {
                    Ok(chunk) => chunk.to_output(),
                    Err(broadcast::error::RecvError::Lagged(chunks)) => ExecOutput {
                        kind: Some(exec_output::Kind::Lost(OutputLost { chunks })),
                    },
                    Err(broadcast::error::RecvError::Closed) => break,
                },
                () = tx.closed() => return,
            };
            if tx.send(Ok(message)).await.is_err() {
                return;
            }
        }
    }
    // The live output ends only after the status is set.
    if let Some(ended) = proc.ended() {
        let exit = ExecOutput {
            kind: Some(exec_output::Kind::Exit(ended.exit())),
        };
        let _ = tx.send(Ok(exit)).await;
    }
}

/// The Attach call: follows the command its first message names, and
/// passes the rest of its input on.
pub async fn attach(
    table: &Table,
    mut input: Streaming<ExecInput>,
) -> Result<OutputStream, Status> {
    let target = match input.message().await? {
        Some(ExecInput {
            kind: Some(exec_input::Kind::Attach(target)),
        }) => target,
        _ => return Err(invalid("the first attach message must be attach")),
    };
    let proc = table.find(target.process.as_ref())?;
    let (tx, rx) = mpsc::channel(OUTPUT_CAPACITY);
    tokio::spawn(follow(Arc::clone(&proc), target.replay, tx));
    tokio::spawn(forward(input, proc));
    Ok(ReceiverStream::new(rx))
}

/// The SignalProcess call.
pub async fn signal(table: &Table, request: SignalProcessRequest) -> Result<ProcessInfo, Status> {
    if !(1..=MAX_SIGNAL).contains(&request.signal) {
        return Err(invalid(format!(
            "signal {} is not a Linux signal number (1-{MAX_SIGNAL})",
            request.signal
        )));
    }
    let proc = table.find(request.process.as_ref())?;
    proc.send(Input::Signal(request.signal)).await?;
    Ok(proc.info())
}

/// The SendInput call.
pub async fn send_input(table: &Table, request: SendInputRequest) -> Result<ProcessInfo, Status> {
    let proc = table.find(request.process.as_ref())?;
    if let Some(size) = request.resize {
        proc.send(Input::Resize(size)).await?;
    }
    if !request.data.is_empty() {
        proc.send(Input::Data(request.data)).await?;
    }
    if request.close {
        proc.send(Input::Close).await?;
    }
    Ok(proc.info())
}

/// The WaitProcess call.
pub async fn wait(table: &Table, request: WaitProcessRequest) -> Result<ProcessInfo, Status> {
    let proc = table.find(request.process.as_ref())?;
    proc.wait(Duration::from_millis(request.timeout_ms)).await;
    Ok(proc.info())
}

/// Milliseconds since the Unix epoch.
pub fn unix_ms(at: SystemTime) -> i64 {
    at.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

fn status(code: Code, kind: &'static str, message: impl Into<String>) -> Status {
    let mut status = Status::new(code, message.into());
    status
        .metadata_mut()
        .insert(KIND_METADATA_KEY, MetadataValue::from_static(kind));
    status
}

pub fn invalid(message: impl Into<String>) -> Status {
    status(Code::InvalidArgument, "invalid", message)
}

fn stdin_closed() -> Status {
    status(
        Code::FailedPrecondition,
        "stdin_closed",
        "the process's stdin is closed (start it with stdin, or a terminal, to write to it)",
    )
}

fn not_running() -> Status {
    status(
        Code::FailedPrecondition,
        "not_running",
        "the process has ended",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_are_checked() {
        for good in ["web", "dev-server", "a.b_c", "v1", "0x"] {
            assert!(check_tag(good).is_ok(), "{good}");
        }
        for bad in ["", "123", "a b", "a/b", "ä", &"x".repeat(65)] {
            assert!(check_tag(bad).is_err(), "{bad}");
        }
    }

    fn fake(table: &Arc<Table>, pid: i32, tag: &str, ended_at: Option<i64>) -> Arc<Proc> {
        let (input, _) = mpsc::channel(1);
        let proc = Arc::new(Proc {
            pid,
            fixed: ProcessInfo {
                pid: pid as u32,
                tag: tag.into(),
                detached: true,
                started_unix_ms: i64::from(pid),
                ..Default::default()
            },
            output: Mutex::new(Output {
                replay: VecDeque::new(),
                replay_bytes: 0,
                live: None,
            }),
            ended: watch::channel(ended_at.map(|at| Ended {
                status: ExitStatus { code: 0, signal: 0 },
                timed_out: false,
                at_unix_ms: at,
            }))
            .0,
            input,
            stdin_open: AtomicBool::new(false),
        });
        let claim = TagClaim {
            table: Arc::clone(table),
            tag: None,
        };
        table.insert(Arc::clone(&proc), claim);
        proc
    }

    #[test]
    fn tags_are_unique_among_running_commands() {
        let table = Arc::new(Table::default());
        let claim = table.claim_tag("web").expect("free");
        assert!(table.claim_tag("web").is_none(), "reserved while starting");
        drop(claim);
        fake(&table, 10, "web", None);
        assert!(table.claim_tag("web").is_none(), "held while running");
        let old = unix_ms(SystemTime::now());
        let table2 = Arc::new(Table::default());
        fake(&table2, 11, "web", Some(old));
        assert!(table2.claim_tag("web").is_some(), "free once ended");
    }

    #[test]
    fn lookup_prefers_the_running_command() {
        let table = Arc::new(Table::default());
        let now = unix_ms(SystemTime::now());
        fake(&table, 20, "job", Some(now));
        fake(&table, 21, "job", None);
        let by_tag = ProcessRef {
            pid: 0,
            tag: "job".into(),
        };
        assert_eq!(table.find(Some(&by_tag)).unwrap().pid, 21);
        let by_pid = ProcessRef {
            pid: 20,
            tag: "".into(),
        };
        assert_eq!(table.find(Some(&by_pid)).unwrap().pid, 20);
        let missing = ProcessRef {
            pid: 99,
            tag: "".into(),
        };
        let err = table.find(Some(&missing)).err().unwrap();
        assert_eq!(err.code(), Code::NotFound);
        assert!(table.find(None).is_err());
        assert!(table
            .find(Some(&ProcessRef {
                pid: 0,
                tag: "".into()
            }))
            .is_err());
    }

    #[test]
    fn ended_commands_are_kept_for_a_while_and_a_count() {
        let table = Arc::new(Table::default());
        let now = unix_ms(SystemTime::now());
        let stale = now - KEEP_EXITED_FOR.as_millis() as i64 - 1;
        fake(&table, 2, "", Some(stale));
        for pid in 100..(100 + KEEP_EXITED as i32 + 5) {
            fake(&table, pid, "", Some(now + i64::from(pid)));
        }
        fake(&table, 3, "", None);
        let listed = table.list();
        assert!(listed.iter().all(|p| p.pid != 2), "stale entry kept");
        assert_eq!(listed.iter().filter(|p| !p.running).count(), KEEP_EXITED);
        assert!(listed.iter().any(|p| p.pid == 3 && p.running));
        // The newest ended ones are the ones kept.
        assert!(listed.iter().all(|p| p.pid != 100));
    }

    #[test]
    fn replay_is_bounded_and_keeps_the_newest_output() {
        let table = Arc::new(Table::default());
        let proc = fake(&table, 5, "", None);
        for i in 0..100u8 {
            proc.publish(&Chunk {
                stderr: false,
                data: Arc::from(vec![i; 8 * 1024]),
            });
        }
        let out = proc.lock_output();
        assert!(out.replay_bytes <= REPLAY_BYTES);
        assert_eq!(out.replay.back().unwrap().data[0], 99);
        assert_eq!(out.replay_bytes, REPLAY_BYTES);
    }
}
