//! `runbox exec`: runs a command in a run, copies its output to the local
//! stdout and stderr as it arrives, and exits with its status, so that
//! `runbox exec` composes in scripts like the command itself would.
//!
//! Exit statuses, after the shell conventions:
//!
//! | outcome                           | status                     |
//! |-----------------------------------|----------------------------|
//! | the command exited                | its exit code              |
//! | a signal killed it                | 128 + signal               |
//! | `--timeout` elapsed               | 124                        |
//! | run expired / deleted, agent lost | the exit code, else 255    |
//! | command not found                 | 127                        |
//! | command not executable            | 126                        |
//! | any other error                   | 1                          |

use std::io::ErrorKind;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::Args;
use futures::StreamExt as _;
use runbox_client::types::{ErrorCode, ExecRequest, ExitEvent, ExitReason};
use runbox_client::{ClientError, ExecEvent};
use tokio::io::{AsyncWrite, AsyncWriteExt as _};

use crate::args::{env_map, parse_env_var, EnvVar, LeaseOpts};
use crate::connect::ConnectOpts;

/// What a shell reports for a process killed by SIGPIPE; used when our own
/// stdout is closed under us (`runbox exec ID -- yes | head`).
const BROKEN_PIPE_STATUS: u8 = 128 + 13;

/// `runbox exec`.
#[derive(Debug, Args)]
#[command(
    after_help = "Options go before the command; everything from the command on is passed \
                        to it. Use `--` when the command itself starts with `-`."
)]
pub struct ExecArgs {
    /// The run's id
    pub id: String,
    /// Kill the command's process group after this many seconds (exit status 124)
    #[arg(long, value_name = "SECS")]
    pub timeout: Option<u64>,
    /// Working directory: absolute, or relative to /work [default: /work]
    #[arg(long, value_name = "DIR")]
    pub cwd: Option<String>,
    /// Environment variable for this command (repeatable); overrides the run's
    #[arg(long = "env", short = 'e', value_name = "K=V", value_parser = parse_env_var)]
    pub env: Vec<EnvVar>,
    /// Run as this user (name, uid, name:group, uid:gid) [default: the
    /// image's User, else root]
    #[arg(long, short = 'u', value_name = "USER")]
    pub user: Option<String>,
    /// Pass the local stdin to the command as it comes (a WebSocket session)
    #[arg(long, short = 'i')]
    pub interactive: bool,
    /// Run the command on a terminal: the local terminal goes raw, keys
    /// such as ^C reach the command, and window size changes are passed on
    #[arg(long, short = 't')]
    pub tty: bool,
    /// Start a background process and print its pid; see `runbox ps`,
    /// `attach`, `kill` and `wait`
    #[arg(long, short = 'd', conflicts_with_all = ["interactive", "tty"])]
    pub detach: bool,
    /// With --detach: a name to find the process by instead of its pid
    #[arg(long, requires = "detach", value_name = "TAG")]
    pub tag: Option<String>,
    /// With --detach: keep the process's stdin open for `runbox attach`
    #[arg(long, requires = "detach")]
    pub open_stdin: bool,
    /// With --detach: print the process as JSON
    #[arg(long, requires = "detach")]
    pub json: bool,
    /// The command and its arguments; the command is looked up in the run's PATH
    #[arg(required = true, trailing_var_arg = true, value_name = "CMD")]
    pub cmd: Vec<String>,
    #[command(flatten)]
    pub lease: LeaseOpts,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// Runs `runbox exec`.
pub async fn run(args: ExecArgs) -> anyhow::Result<ExitCode> {
    let conn = args.conn.connect()?;
    let req = ExecRequest {
        cmd: args.cmd,
        cwd: args.cwd,
        timeout_sec: args.timeout,
        env: env_map(args.env),
        owner: args.lease.owner,
        generation: args.lease.generation,
        user: args.user,
        tag: args.tag,
        open_stdin: args.open_stdin,
        ..Default::default()
    };
    if args.detach {
        return crate::procs::start_background(&conn, &args.id, req, args.json).await;
    }
    if args.interactive || args.tty {
        return crate::procs::interactive(&conn, &args.id, req, args.tty).await;
    }
    let mut events = match conn.client.exec(&args.id, &req).await {
        Ok(events) => events,
        Err(err) => {
            if let Some((status, message)) = start_failure(&err) {
                eprintln!("runbox: {message}");
                return Ok(ExitCode::from(status));
            }
            return Err(conn.explain(err));
        }
    };

    let mut stdout = tokio::io::stdout();
    let mut stderr = tokio::io::stderr();
    while let Some(event) = events.next().await {
        let written = match conn.check(event)? {
            ExecEvent::Started(_) | ExecEvent::Lost(_) => Ok(()),
            ExecEvent::Stdout(chunk) => write_now(&mut stdout, &chunk).await,
            ExecEvent::Stderr(chunk) => write_now(&mut stderr, &chunk).await,
            ExecEvent::Exit(exit) => {
                let (status, note) = exit_outcome(&exit, req.timeout_sec);
                if let Some(note) = note {
                    eprintln!("runbox: {note}");
                }
                return Ok(ExitCode::from(status));
            }
        };
        match written {
            Ok(()) => {}
            // Nobody reads our output any more: stop like the command would
            // have, and let dropping the stream tell the server.
            Err(err) if err.kind() == ErrorKind::BrokenPipe => {
                return Ok(ExitCode::from(BROKEN_PIPE_STATUS))
            }
            Err(err) => return Err(err).context("cannot write the command's output"),
        }
    }
    // The decoder ends every stream with an exit event or an error.
    Err(conn.explain(ClientError::StreamEnded))
}

/// Writes and flushes at once: output should appear as the command makes
/// it, not when a buffer fills.
async fn write_now<W: AsyncWrite + Unpin>(out: &mut W, chunk: &[u8]) -> std::io::Result<()> {
    out.write_all(chunk).await?;
    out.flush().await
}

/// The exit status and message for a command that could not start, as a
/// shell would report it; `None` for errors that are not about the command.
pub(crate) fn start_failure(err: &ClientError) -> Option<(u8, String)> {
    let ClientError::Api { message, .. } = err else {
        return None;
    };
    match err.code()? {
        ErrorCode::CommandNotFound => Some((127, message.clone())),
        ErrorCode::CommandNotExecutable => Some((126, message.clone())),
        _ => None,
    }
}

/// The exit status to leave with, and a note for stderr when the status
/// alone would not tell the user what happened.
pub(crate) fn exit_outcome(exit: &ExitEvent, timeout: Option<u64>) -> (u8, Option<String>) {
    let code = u8::try_from(exit.exit_code.clamp(-1, 255)).unwrap_or(255);
    if exit.timed_out || exit.reason == ExitReason::Timeout {
        let note = match timeout {
            Some(secs) => format!("command timed out after {secs}s"),
            None => "command timed out".to_owned(),
        };
        return (124, Some(note));
    }
    let note = match exit.reason {
        ExitReason::Exited => None,
        ExitReason::Signaled => Some(match exit.signal {
            // SIGKILL nobody asked for is most often the memory limit.
            Some(9) => "command killed by signal 9 (out of memory?)".to_owned(),
            Some(signal) => format!("command killed by signal {signal}"),
            None => "command killed by a signal".to_owned(),
        }),
        ExitReason::RunExpired => Some("the run expired while the command was running".to_owned()),
        ExitReason::RunDeleted => {
            Some("the run was deleted while the command was running".to_owned())
        }
        ExitReason::RunMoved => Some(
            "the run moved to another node while the command was running (its processes ended)"
                .to_owned(),
        ),
        ExitReason::AgentLost => {
            Some("lost contact with the run's agent; the command's fate is unknown".to_owned())
        }
        ExitReason::Timeout => unreachable!("handled above"),
    };
    (code, note)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exit(exit_code: i32, reason: ExitReason) -> ExitEvent {
        ExitEvent {
            point: None,
            exit_code,
            timed_out: reason == ExitReason::Timeout,
            signal: None,
            reason,
        }
    }

    #[test]
    fn a_normal_exit_passes_its_code_through_silently() {
        assert_eq!(exit_outcome(&exit(0, ExitReason::Exited), None), (0, None));
        assert_eq!(
            exit_outcome(&exit(42, ExitReason::Exited), None),
            (42, None)
        );
    }

    #[test]
    fn a_timeout_is_124_with_a_note() {
        let (code, note) = exit_outcome(&exit(137, ExitReason::Timeout), Some(5));
        assert_eq!(code, 124);
        assert_eq!(note.unwrap(), "command timed out after 5s");
    }

    #[test]
    fn a_lost_command_is_255_unless_its_code_is_known() {
        let (code, note) = exit_outcome(&exit(-1, ExitReason::AgentLost), None);
        assert_eq!(code, 255);
        assert!(note.unwrap().contains("agent"));
        let (code, note) = exit_outcome(&exit(137, ExitReason::RunExpired), None);
        assert_eq!(code, 137);
        assert!(note.unwrap().contains("expired"));
        assert_eq!(exit_outcome(&exit(-1, ExitReason::RunDeleted), None).0, 255);
    }

    #[test]
    fn a_signal_says_which() {
        let mut event = exit(137, ExitReason::Signaled);
        event.signal = Some(9);
        let (code, note) = exit_outcome(&event, None);
        assert_eq!(code, 137);
        assert!(note.unwrap().contains("signal 9"));
    }

    #[test]
    fn commands_that_cannot_start_get_shell_statuses() {
        let api = |code: &str| ClientError::Api {
            status: 400,
            code: code.to_owned(),
            message: "nope: no such command".to_owned(),
        };
        assert_eq!(
            start_failure(&api("command_not_found")),
            Some((127, "nope: no such command".to_owned()))
        );
        assert_eq!(
            start_failure(&api("command_not_executable")).unwrap().0,
            126
        );
        assert_eq!(start_failure(&api("bad_cwd")), None);
        assert_eq!(start_failure(&ClientError::StreamEnded), None);
    }
}
