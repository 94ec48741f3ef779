//! Interactive sessions and processes: `exec -it`, `shell`, `attach`, `ps`,
//! `kill` and `wait`, and `exec -d` (a background process).
//!
//! An interactive session copies the local stdin to the command and its
//! output to the local stdout and stderr. With a terminal (`-t`) the local
//! terminal is put in raw mode for the session, so every key (`^C`, `^D`,
//! arrows) goes to the command, and window size changes are passed on.
//! Detaching from an attach is `^]` (as in telnet), which a terminal cannot
//! otherwise send.

use std::io::IsTerminal as _;
use std::os::fd::AsFd as _;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::Args;
use futures::StreamExt as _;
use runbox_client::types::{ExecRequest, Process, PtySpec, SignalRequest, SignalSpec};
use runbox_client::{ExecEvent, LeaseCredential, Session, SessionWriter};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use crate::args::LeaseOpts;
use crate::connect::{Conn, ConnectOpts};
use crate::table;

/// The key that detaches from `runbox attach` on a terminal: `^]`.
const DETACH_KEY: u8 = 0x1d;

/// `runbox ps`.
#[derive(Debug, Args)]
pub struct PsArgs {
    /// The run's id
    pub id: String,
    /// Print the answer as JSON
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox attach`.
#[derive(Debug, Args)]
pub struct AttachArgs {
    /// The run's id
    pub id: String,
    /// The process: its pid or tag
    pub process: String,
    /// Do not replay the output the process made before
    #[arg(long)]
    pub no_replay: bool,
    #[command(flatten)]
    pub lease: LeaseOpts,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox kill`.
#[derive(Debug, Args)]
pub struct KillArgs {
    /// The run's id
    pub id: String,
    /// The process: its pid or tag
    pub process: String,
    /// The signal: a name (TERM, INT, KILL, HUP, ...) or a number
    #[arg(long, short = 's', default_value = "TERM")]
    pub signal: String,
    #[command(flatten)]
    pub lease: LeaseOpts,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox wait`.
#[derive(Debug, Args)]
pub struct WaitArgs {
    /// The run's id
    pub id: String,
    /// The process: its pid or tag
    pub process: String,
    /// Give up after this many seconds (exit status 124)
    #[arg(long, value_name = "SECS", default_value_t = 3600)]
    pub timeout: u64,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox shell`.
#[derive(Debug, Args)]
pub struct ShellArgs {
    /// The run's id
    pub id: String,
    /// Run as this user [default: the image's User, else root]
    #[arg(long, short = 'u', value_name = "USER")]
    pub user: Option<String>,
    #[command(flatten)]
    pub lease: LeaseOpts,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// The shell `runbox shell` starts: bash when the image has it, else sh.
const SHELL: &str = "if command -v bash >/dev/null 2>&1; then exec bash -l; else exec sh -l; fi";

/// Runs `runbox shell`.
pub async fn shell(args: ShellArgs) -> anyhow::Result<ExitCode> {
    let conn = args.conn.connect()?;
    let req = ExecRequest {
        cmd: vec!["sh".into(), "-c".into(), SHELL.into()],
        user: args.user,
        owner: args.lease.owner,
        generation: args.lease.generation,
        ..Default::default()
    };
    interactive(&conn, &args.id, req, true).await
}

/// The local terminal's size, if stdout is one.
fn local_size() -> Option<(u32, u32)> {
    let size = rustix::termios::tcgetwinsize(std::io::stdout().as_fd()).ok()?;
    (size.ws_row > 0 && size.ws_col > 0).then(|| (u32::from(size.ws_row), u32::from(size.ws_col)))
}

/// Puts the local terminal in raw mode until dropped.
struct RawMode {
    saved: rustix::termios::Termios,
}

impl RawMode {
    fn enter() -> anyhow::Result<Option<Self>> {
        let stdin = std::io::stdin();
        if !stdin.is_terminal() {
            return Ok(None);
        }
        let saved =
            rustix::termios::tcgetattr(stdin.as_fd()).context("cannot read the terminal's mode")?;
        let mut raw = saved.clone();
        raw.make_raw();
        rustix::termios::tcsetattr(stdin.as_fd(), rustix::termios::OptionalActions::Flush, &raw)
            .context("cannot put the terminal in raw mode")?;
        Ok(Some(Self { saved }))
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        let _ = rustix::termios::tcsetattr(
            std::io::stdin().as_fd(),
            rustix::termios::OptionalActions::Flush,
            &self.saved,
        );
    }
}

/// Runs `runbox exec -i`/`-it`: a new command in a session.
pub async fn interactive(
    conn: &Conn,
    id: &str,
    mut req: ExecRequest,
    tty: bool,
) -> anyhow::Result<ExitCode> {
    if tty {
        let (rows, cols) = local_size().unwrap_or((24, 80));
        let term = std::env::var("TERM").ok().filter(|t| {
            !t.is_empty()
                && t.len() <= 64
                && t.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'+'))
        });
        req.pty = Some(PtySpec { rows, cols, term });
    }
    let timeout = req.timeout_sec;
    let session = match conn.client.exec_session(id, &req).await {
        Ok(session) => session,
        Err(err) => {
            if let Some((status, message)) = crate::exec::start_failure(&err) {
                eprintln!("runbox: {message}");
                return Ok(ExitCode::from(status));
            }
            return Err(conn.explain(err));
        }
    };
    run_session(conn, session, tty, false, timeout).await
}

/// Runs `runbox attach`.
pub async fn attach(args: AttachArgs) -> anyhow::Result<ExitCode> {
    let conn = args.conn.connect()?;
    let process = conn
        .client
        .process(&args.id, &args.process)
        .await
        .map_err(|e| conn.explain(e))?;
    let lease = args
        .lease
        .owner
        .clone()
        .zip(args.lease.generation)
        .map(|(owner, generation)| LeaseCredential { owner, generation });
    let session = conn
        .client
        .attach(&args.id, &args.process, !args.no_replay, lease.as_ref())
        .await
        .map_err(|e| conn.explain(e))?;
    if process.pty {
        if let Some((rows, cols)) = local_size() {
            let _ = session.writer.resize(rows, cols).await;
        }
    }
    run_session(&conn, session, process.pty, true, None).await
}

/// Relays a session until the command ends (its status becomes ours) or,
/// attached, the user detaches.
async fn run_session(
    conn: &Conn,
    session: Session,
    tty: bool,
    attached: bool,
    timeout: Option<u64>,
) -> anyhow::Result<ExitCode> {
    let Session {
        mut events, writer, ..
    } = session;
    let raw = if tty { RawMode::enter()? } else { None };
    let detach = attached && raw.is_some();
    let (detached_tx, detached_rx) = tokio::sync::oneshot::channel::<()>();
    // Resolves on a real detach only; the sender going away (stdin ended)
    // leaves it pending, and it is never polled again once resolved.
    let detached = async {
        if detached_rx.await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    tokio::pin!(detached);
    let input = tokio::spawn(pump_stdin(writer.clone(), detach, detached_tx));
    let resizes = tty.then(|| tokio::spawn(pass_resizes(writer.clone())));
    let mut stdout = tokio::io::stdout();
    let mut stderr = tokio::io::stderr();
    let outcome = loop {
        let event = tokio::select! {
            event = events.next() => event,
            () = &mut detached => break Ok(None),
        };
        let Some(event) = event else {
            break Err(conn.explain(runbox_client::ClientError::StreamEnded));
        };
        let event = match event {
            Ok(event) => event,
            Err(err) => break Err(conn.explain(err)),
        };
        let written = match event {
            ExecEvent::Started(_) | ExecEvent::Lost(_) => Ok(()),
            ExecEvent::Stdout(chunk) => write_now(&mut stdout, &chunk).await,
            ExecEvent::Stderr(chunk) => write_now(&mut stderr, &chunk).await,
            ExecEvent::Exit(exit) => break Ok(Some(exit)),
        };
        if written.is_err() {
            break Ok(None);
        }
    };
    input.abort();
    if let Some(task) = resizes {
        task.abort();
    }
    drop(raw);
    match outcome? {
        Some(exit) => {
            let (status, note) = crate::exec::exit_outcome(&exit, timeout);
            if let Some(note) = note {
                eprintln!("runbox: {note}");
            }
            Ok(ExitCode::from(status))
        }
        None => {
            if attached {
                eprintln!("runbox: detached; the process keeps running");
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

async fn write_now(
    out: &mut (impl tokio::io::AsyncWrite + Unpin),
    chunk: &[u8],
) -> std::io::Result<()> {
    out.write_all(chunk).await?;
    out.flush().await
}

/// Copies the local stdin to the session; at its end sends end-of-file.
/// With `detach`, `^]` ends the session instead.
async fn pump_stdin(
    writer: SessionWriter,
    detach: bool,
    detached: tokio::sync::oneshot::Sender<()>,
) {
    let mut stdin = tokio::io::stdin();
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match stdin.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let data = &buf[..n];
        if detach {
            if let Some(at) = data.iter().position(|&b| b == DETACH_KEY) {
                if at > 0 {
                    let _ = writer
                        .stdin(bytes::Bytes::copy_from_slice(&data[..at]))
                        .await;
                }
                let _ = detached.send(());
                return;
            }
        }
        if writer
            .stdin(bytes::Bytes::copy_from_slice(data))
            .await
            .is_err()
        {
            return;
        }
    }
    let _ = writer.eof().await;
}

/// Tells the session the terminal's new size on every SIGWINCH.
async fn pass_resizes(writer: SessionWriter) {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut changes) = signal(SignalKind::window_change()) else {
        return;
    };
    while changes.recv().await.is_some() {
        if let Some((rows, cols)) = local_size() {
            if writer.resize(rows, cols).await.is_err() {
                return;
            }
        }
    }
}

/// Runs `runbox exec -d`: starts a background process and prints it.
pub async fn start_background(
    conn: &Conn,
    id: &str,
    req: ExecRequest,
    json: bool,
) -> anyhow::Result<ExitCode> {
    match conn.client.start_process(id, &req).await {
        Ok(process) => {
            if json {
                println!("{}", serde_json::to_string_pretty(&process)?);
            } else {
                println!("{}", process.pid);
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(err) => {
            if let Some((status, message)) = crate::exec::start_failure(&err) {
                eprintln!("runbox: {message}");
                return Ok(ExitCode::from(status));
            }
            Err(conn.explain(err))
        }
    }
}

/// Runs `runbox ps`.
pub async fn ps(args: PsArgs) -> anyhow::Result<ExitCode> {
    let conn = args.conn.connect()?;
    let list = conn
        .client
        .processes(&args.id)
        .await
        .map_err(|e| conn.explain(e))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&list)?);
    } else {
        print!("{}", render(&list.processes));
    }
    Ok(ExitCode::SUCCESS)
}

/// The `ps` table.
fn render(processes: &[Process]) -> String {
    let rows: Vec<Vec<String>> = processes
        .iter()
        .map(|p| {
            let state = match (&p.exit, p.running) {
                (_, true) => "running".to_owned(),
                (Some(exit), false) => match exit.signal {
                    Some(signal) => format!("killed ({signal})"),
                    None => format!("exited ({})", exit.exit_code),
                },
                (None, false) => "ended".to_owned(),
            };
            let kind = match (p.background, p.pty) {
                (true, true) => "bg,pty",
                (true, false) => "bg",
                (false, true) => "fg,pty",
                (false, false) => "fg",
            };
            let mut cmd = p.cmd.join(" ");
            if cmd.chars().count() > 60 {
                cmd = cmd.chars().take(59).collect::<String>() + "…";
            }
            vec![
                p.pid.to_string(),
                p.tag.clone().unwrap_or_else(|| "-".into()),
                state,
                kind.to_owned(),
                table::date(p.started_at),
                cmd,
            ]
        })
        .collect();
    table::render(
        &["PID", "TAG", "STATE", "KIND", "STARTED", "COMMAND"],
        &rows,
    )
}

/// Runs `runbox kill`.
pub async fn kill(args: KillArgs) -> anyhow::Result<ExitCode> {
    let conn = args.conn.connect()?;
    let signal = match args.signal.parse::<i32>() {
        Ok(n) => SignalSpec::Number(n),
        Err(_) => SignalSpec::Name(args.signal.clone()),
    };
    if signal.number().is_none() {
        anyhow::bail!(
            "{:?} is not a signal: give a name (TERM, INT, KILL, HUP, ...) or a number 1-64",
            args.signal
        );
    }
    let req = SignalRequest {
        signal,
        owner: args.lease.owner,
        generation: args.lease.generation,
    };
    conn.client
        .signal_process(&args.id, &args.process, &req)
        .await
        .map_err(|e| conn.explain(e))?;
    Ok(ExitCode::SUCCESS)
}

/// Runs `runbox wait`: exits with the process's status once it ended.
pub async fn wait(args: WaitArgs) -> anyhow::Result<ExitCode> {
    let conn = args.conn.connect()?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(args.timeout);
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        // The server waits an hour at most per call.
        let step = left.as_secs().clamp(0, 3600);
        let process = conn
            .client
            .wait_process(&args.id, &args.process, step)
            .await
            .map_err(|e| conn.explain(e))?;
        if let Some(exit) = process.exit.filter(|_| !process.running) {
            let code = u8::try_from(exit.exit_code.clamp(0, 255)).unwrap_or(255);
            return Ok(ExitCode::from(code));
        }
        if left.is_zero() {
            eprintln!(
                "runbox: the process is still running after {}s",
                args.timeout
            );
            return Ok(ExitCode::from(124));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn process(pid: u32, running: bool) -> Process {
        Process {
            pid,
            tag: Some("web".into()),
            cmd: vec!["python3".into(), "-m".into(), "http.server".into()],
            cwd: "/work".into(),
            user: None,
            started_at: time::OffsetDateTime::UNIX_EPOCH,
            background: true,
            pty: false,
            stdin_open: false,
            running,
            exit: (!running).then_some(runbox_client::types::ProcessExit {
                exit_code: 3,
                signal: None,
                timed_out: false,
            }),
            ended_at: None,
        }
    }

    #[test]
    fn ps_shows_state_kind_and_command() {
        let out = render(&[process(7, true), process(9, false)]);
        let lines: Vec<&str> = out.lines().collect();
        assert!(lines[0].starts_with("PID"), "{out}");
        assert!(
            lines[1].contains("running") && lines[1].contains("python3 -m http.server"),
            "{out}"
        );
        assert!(lines[2].contains("exited (3)"), "{out}");
        assert!(lines[1].contains("bg"), "{out}");
    }
}
