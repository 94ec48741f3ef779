//! Command-line parsing, by hand: the agent has four options, and every
//! dependency is weight in a binary that is bind-mounted into every run.
//!
//! Owns the grammar only; acting on it (binding sockets, creating the work
//! directory) is `main`'s job.

use std::ffi::OsString;
use std::os::fd::RawFd;
use std::path::PathBuf;

/// Work directory used when `--work-dir` is not given.
pub const DEFAULT_WORK_DIR: &str = "/work";

/// Usage text for `--help` and usage errors.
pub const USAGE: &str = "\
usage: runbox-agent (--listen-fd N | --socket PATH) [--work-dir DIR]
       runbox-agent --version

  --listen-fd N    serve on the listening Unix socket inherited as fd N
  --socket PATH    bind and serve on a Unix socket at PATH
  --work-dir DIR   root of file operations and default cwd (default /work)
  --version        print the version and exit";

/// What the command line asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Invocation {
    /// Print the version and exit.
    Version,
    /// Print the usage and exit.
    Help,
    /// Run the agent.
    Serve(ServeArgs),
}

/// Options for serving.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServeArgs {
    /// Where to accept connections.
    pub listen: Listen,
    /// Root of file operations and default cwd, as given (maybe relative).
    pub work_dir: PathBuf,
}

/// Where the agent accepts connections.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listen {
    /// A listening socket inherited from the daemon.
    Fd(RawFd),
    /// A socket path the agent binds itself.
    Socket(PathBuf),
}

/// A command line that cannot be acted on.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum UsageError {
    /// An option this agent does not know.
    #[error("unknown argument {0:?}")]
    Unknown(OsString),
    /// An option given without its value.
    #[error("{0} needs a value")]
    MissingValue(&'static str),
    /// `--listen-fd` with something that is not a descriptor number.
    #[error("--listen-fd needs a non-negative number, got {0:?}")]
    BadFd(OsString),
    /// Neither `--listen-fd` nor `--socket`.
    #[error("one of --listen-fd or --socket is required")]
    NoListener,
    /// Both, or one of them twice.
    #[error("give exactly one of --listen-fd or --socket")]
    TwoListeners,
}

/// Parses the arguments after the program name. Accepts `--opt value` and
/// `--opt=value`.
pub fn parse(args: impl IntoIterator<Item = OsString>) -> Result<Invocation, UsageError> {
    let mut args = args.into_iter();
    let mut listen = None;
    let mut work_dir = None;
    while let Some(arg) = args.next() {
        let text = arg.to_str().unwrap_or_default();
        let (name, inline) = match text.split_once('=') {
            Some((name, value)) if name.starts_with("--") => (name, Some(OsString::from(value))),
            _ => (text, None),
        };
        let mut value = |option: &'static str| {
            inline
                .clone()
                .or_else(|| args.next())
                .ok_or(UsageError::MissingValue(option))
        };
        match name {
            "--version" | "-V" => return Ok(Invocation::Version),
            "--help" | "-h" => return Ok(Invocation::Help),
            "--listen-fd" => {
                let raw = value("--listen-fd")?;
                let fd = raw
                    .to_str()
                    .and_then(|s| s.parse::<RawFd>().ok())
                    .filter(|fd| *fd >= 0)
                    .ok_or(UsageError::BadFd(raw))?;
                set_once(&mut listen, Listen::Fd(fd))?;
            }
            "--socket" => {
                let path = value("--socket")?;
                set_once(&mut listen, Listen::Socket(path.into()))?;
            }
            "--work-dir" => work_dir = Some(PathBuf::from(value("--work-dir")?)),
            _ => return Err(UsageError::Unknown(arg)),
        }
    }
    Ok(Invocation::Serve(ServeArgs {
        listen: listen.ok_or(UsageError::NoListener)?,
        work_dir: work_dir.unwrap_or_else(|| PathBuf::from(DEFAULT_WORK_DIR)),
    }))
}

fn set_once(slot: &mut Option<Listen>, listen: Listen) -> Result<(), UsageError> {
    if slot.replace(listen).is_some() {
        return Err(UsageError::TwoListeners);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_str(args: &[&str]) -> Result<Invocation, UsageError> {
        parse(args.iter().map(OsString::from))
    }

    #[test]
    fn parses_both_listeners() {
        assert_eq!(
            parse_str(&["--listen-fd", "3"]),
            Ok(Invocation::Serve(ServeArgs {
                listen: Listen::Fd(3),
                work_dir: PathBuf::from("/work"),
            }))
        );
        assert_eq!(
            parse_str(&["--socket=/tmp/a.sock", "--work-dir", "/tmp/w"]),
            Ok(Invocation::Serve(ServeArgs {
                listen: Listen::Socket("/tmp/a.sock".into()),
                work_dir: PathBuf::from("/tmp/w"),
            }))
        );
    }

    #[test]
    fn version_and_help_win() {
        assert_eq!(parse_str(&["--version"]), Ok(Invocation::Version));
        assert_eq!(
            parse_str(&["--socket", "x", "--help"]),
            Ok(Invocation::Help)
        );
    }

    #[test]
    fn refuses_bad_command_lines() {
        assert_eq!(parse_str(&[]), Err(UsageError::NoListener));
        assert_eq!(
            parse_str(&["--listen-fd", "3", "--socket", "x"]),
            Err(UsageError::TwoListeners)
        );
        assert_eq!(
            parse_str(&["--listen-fd", "-1"]),
            Err(UsageError::BadFd("-1".into()))
        );
        assert_eq!(
            parse_str(&["--listen-fd"]),
            Err(UsageError::MissingValue("--listen-fd"))
        );
        assert_eq!(
            parse_str(&["--bogus"]),
            Err(UsageError::Unknown("--bogus".into()))
        );
    }
}
