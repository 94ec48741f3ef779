//! `runbox`: one binary for the daemon and its client.
//!
//! `runbox serve` runs the daemon (module `serve`; only with the default
//! `daemon` feature, which the client verbs do not need, so a build without
//! it drives a remote daemon from any Unix). Every other subcommand is a thin client over `runbox-client`: it parses
//! arguments, makes one or a few API calls, and prints the result for humans
//! (or as JSON with `--json`).
//!
//! The connection options (`--url`, `--token`, `--state-dir`) sit on each
//! client subcommand rather than on `runbox` itself: `serve` has a
//! `--state-dir` of its own, and clap cannot have a global option and a
//! subcommand option of one name. So both `runbox serve --state-dir X` and
//! `runbox ls --state-dir X` work, and the environment variables cover the
//! usual case.
//!
//! Errors are printed once, with their whole chain, as `runbox: ...`; the
//! exit status is 1 unless a subcommand says otherwise (`exec` passes the
//! command's own status through).

mod args;
mod checkpoints;
#[cfg(feature = "daemon")]
mod config_file;
mod connect;
mod cp;
#[cfg(feature = "daemon")]
mod egress;
mod exec;
mod fs;
mod history;
mod image;
mod image_build;
#[cfg(feature = "daemon")]
mod join;
mod lease;
#[cfg(feature = "daemon")]
mod logging;
mod mcp;
mod pools;
mod ports;
mod procs;
mod runs;
#[cfg(feature = "daemon")]
mod serve;
mod table;
mod tenants;
mod volumes;
mod warm;

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

/// Self-hosted sandboxes: create a run from an image, execute commands in it,
/// copy files in and out, throw it away.
#[derive(Debug, Parser)]
#[command(
    name = "runbox",
    version,
    after_help = "Client subcommands take the connection options --url, --token and --state-dir \
                  after the subcommand name (`runbox ls --url http://host:7439`), or from \
                  RUNBOX_URL, RUNBOX_TOKEN and RUNBOX_STATE_DIR. Without a token the client reads \
                  <state-dir>/token, which `runbox serve` writes.\n\n\
                  Logging goes to stderr; set RUNBOX_LOG (e.g. RUNBOX_LOG=debug) for more."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the daemon
    #[cfg(feature = "daemon")]
    Serve(Box<serve::ServeArgs>),
    /// Create runs
    #[command(subcommand)]
    Run(runs::RunCommand),
    /// Run a command in a run, streaming its output; exits with its status
    Exec(exec::ExecArgs),
    /// Open an interactive shell in a run (bash if it has one, else sh)
    Shell(procs::ShellArgs),
    /// List a run's processes: running ones, and background ones that ended
    Ps(procs::PsArgs),
    /// Attach to a process: its output (replayed, then live) and your input;
    /// ^] detaches from a process on a terminal, otherwise ^C leaves (the
    /// process keeps running)
    Attach(procs::AttachArgs),
    /// Send a signal to a process (default TERM)
    Kill(procs::KillArgs),
    /// Wait for a process to end; exits with its status
    Wait(procs::WaitArgs),
    /// Mint a signed, expiring URL that reaches a port inside a run
    Preview(ports::PreviewArgs),
    /// Forward a local port to a port inside a run
    PortForward(ports::PortForwardArgs),
    /// Copy a file into or out of a run's /work
    Cp(cp::CpArgs),
    /// List runs
    Ls(runs::LsArgs),
    /// Delete runs
    Rm(runs::RmArgs),
    /// Give a run a new time to live
    Renew(runs::RenewArgs),
    /// Change a running run's egress entries, secrets or tier (none or
    /// allowlist); open connections are not cut
    Egress(runs::EgressArgs),
    /// Freeze a run's processes where they are, memory kept (the next call
    /// that reaches it resumes it)
    Pause(runs::IdsArgs),
    /// Let paused runs' processes go on (hibernated runs are woken)
    Resume(runs::IdsArgs),
    /// Stop runs down to their disks: processes and memory are lost, CPU,
    /// memory, network and the capacity slot freed (the next call that
    /// reaches a run boots it again)
    Hibernate(runs::IdsArgs),
    /// Boot hibernated or failed runs again on their disks (archived runs
    /// are restored)
    Wake(runs::IdsArgs),
    /// Send runs' disks to the checkpoint store and drop them on the node
    /// (running runs are hibernated first; the next call restores them)
    Archive(runs::IdsArgs),
    /// Move runs to another node of the fleet, under the same id, token,
    /// settings and lease (an awake run is hibernated, archived and booted
    /// there: its processes end)
    Move(runs::MoveArgs),
    /// Record a run's filesystem as a new image (the run keeps running)
    Snapshot(runs::SnapshotArgs),
    /// Start new runs from a run's filesystem as it is now (or at a
    /// history point, --point)
    Fork(runs::ForkArgs),
    /// List a run's history points (runs created with --history N): one
    /// after every command and file change that changed a file
    History(history::HistoryArgs),
    /// Show what a history point changed: paths added, modified, removed
    /// (--patch for text diffs)
    Diff(history::DiffArgs),
    /// Return a run's files to a history point, by default the one before
    /// the last change (its processes end, as at a wake; later points are
    /// kept until the next change)
    Rollback(history::RollbackArgs),
    /// Send a run's disk and settings to the server's checkpoint store (the
    /// run keeps running); `runbox run create --checkpoint ID` starts runs
    /// from it
    Checkpoint(checkpoints::CheckpointArgs),
    /// List, show and delete checkpoints
    #[command(subcommand)]
    Checkpoints(checkpoints::CheckpointsCommand),
    /// The warm repo cache: commit a run's volume, check lockfiles, list
    /// and drop templates
    #[command(subcommand)]
    Warm(warm::WarmCommand),
    /// The server's tenants: their tokens and limits (root token only)
    #[command(subcommand)]
    Tenants(tenants::TenantsCommand),
    /// Named volumes: data that outlives runs, mounted with
    /// `runbox run create --volume NAME`
    #[command(subcommand)]
    Volumes(volumes::VolumesCommand),
    /// What each tenant used: run-hours by size, CPU-seconds, peak memory,
    /// egress (from the server's usage journal)
    Usage(tenants::UsageArgs),
    /// What was done, from the server's audit log: commands with their
    /// argv, user and cwd, files written and removed, egress, lifecycle
    /// calls, and who asked (root token only)
    Audit(tenants::AuditArgs),
    /// Stat, list, make, move and remove paths in a run's /work
    #[command(subcommand)]
    Fs(fs::FsCommand),
    /// Show or replace the warm pools
    #[command(subcommand)]
    Pools(pools::PoolsCommand),
    /// What the node is and how full: capacity, pools, storage
    Info(pools::ShowArgs),
    /// Cordon the node (refuse new runs, empty the pools), or --off
    Drain(pools::DrainArgs),
    /// The fleet: its nodes, where each stands, how full
    #[command(subcommand)]
    Cluster(pools::ClusterCommand),
    /// Take, renew or release a run's writable lease
    #[command(subcommand)]
    Lease(lease::LeaseCommand),
    /// Import, list and delete images
    #[command(subcommand)]
    Image(image::ImageCommand),
    /// Check that the daemon answers
    Health(runs::HealthArgs),
    /// Serve the Model Context Protocol (stdio, or streamable HTTP with
    /// --http): tools that create runs, exec, move files, snapshot and fork
    Mcp(mcp::McpArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    #[cfg(feature = "daemon")]
    let serving = matches!(cli.command, Command::Serve(_));
    #[cfg(not(feature = "daemon"))]
    let serving = false;
    #[cfg(feature = "daemon")]
    if serving {
        logging::init("info");
    }
    init_logging(if serving { "info" } else { "warn" });

    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("runbox: cannot start the async runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(dispatch(cli.command));
    if !serving {
        // A blocking read of stdin (`cp - ID:file` cut short by a server
        // error) would otherwise hold the exit until the user types EOF.
        runtime.shutdown_timeout(Duration::from_millis(100));
    }

    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("runbox: {err:#}");
            ExitCode::FAILURE
        }
    }
}

async fn dispatch(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        #[cfg(feature = "daemon")]
        Command::Serve(args) => serve::run(*args).await.map(|()| ExitCode::SUCCESS),
        Command::Run(command) => runs::run_command(command).await,
        Command::Exec(args) => exec::run(args).await,
        Command::Shell(args) => procs::shell(args).await,
        Command::Ps(args) => procs::ps(args).await,
        Command::Attach(args) => procs::attach(args).await,
        Command::Kill(args) => procs::kill(args).await,
        Command::Wait(args) => procs::wait(args).await,
        Command::Preview(args) => ports::preview(args).await,
        Command::PortForward(args) => ports::port_forward(args).await,
        Command::Cp(args) => cp::run(args).await,
        Command::Ls(args) => runs::ls(args).await,
        Command::Rm(args) => runs::rm(args).await,
        Command::Renew(args) => runs::renew(args).await,
        Command::Egress(args) => runs::egress(args).await,
        Command::Pause(args) => runs::pause(args).await,
        Command::Resume(args) => runs::resume(args).await,
        Command::Hibernate(args) => runs::hibernate(args).await,
        Command::Wake(args) => runs::wake(args).await,
        Command::Archive(args) => runs::archive(args).await,
        Command::Move(args) => runs::move_runs(args).await,
        Command::Snapshot(args) => runs::snapshot(args).await,
        Command::Fork(args) => runs::fork(args).await,
        Command::History(args) => history::history(args).await,
        Command::Diff(args) => history::diff(args).await,
        Command::Rollback(args) => history::rollback(args).await,
        Command::Checkpoint(args) => checkpoints::checkpoint(args).await,
        Command::Checkpoints(command) => checkpoints::run(command).await,
        Command::Lease(command) => lease::run(command).await,
        Command::Warm(command) => warm::run(command).await,
        Command::Tenants(command) => tenants::run(command).await,
        Command::Volumes(command) => volumes::run(command).await,
        Command::Usage(args) => tenants::usage(args).await,
        Command::Audit(args) => tenants::audit(args).await,
        Command::Pools(command) => pools::run(command).await,
        Command::Fs(command) => fs::run(command).await,
        Command::Info(args) => pools::info(args).await,
        Command::Drain(args) => pools::drain(args).await,
        Command::Cluster(command) => pools::cluster(command).await,
        Command::Image(command) => image::run(command).await,
        Command::Health(args) => runs::health(args).await,
        Command::Mcp(args) => mcp::run(args).await,
    }
}

/// Logs to stderr, filtered by `RUNBOX_LOG` (or `RUST_LOG`) or else
/// `default`. `try_init` leaves the door open for `serve`'s subscriber
/// (whichever comes first wins, and nothing panics).
fn init_logging(default: &str) {
    use tracing_subscriber::EnvFilter;

    let filter = std::env::var("RUNBOX_LOG")
        .ok()
        .and_then(|v| EnvFilter::try_new(v).ok())
        .or_else(|| EnvFilter::try_from_default_env().ok())
        .unwrap_or_else(|| EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_definition_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    #[test]
    #[cfg(feature = "daemon")]
    fn state_dir_works_on_serve_and_on_client_subcommands() {
        let cli = Cli::try_parse_from(["runbox", "serve", "--state-dir", "/tmp/a"]).unwrap();
        assert!(
            matches!(cli.command, Command::Serve(args) if args.state_dir.as_os_str() == "/tmp/a")
        );
        let cli = Cli::try_parse_from(["runbox", "ls", "--state-dir", "/tmp/b"]).unwrap();
        assert!(
            matches!(cli.command, Command::Ls(args) if args.conn.state_dir.as_os_str() == "/tmp/b")
        );
    }

    #[test]
    fn exec_takes_the_command_with_or_without_a_separator() {
        let parse = |argv: &[&str]| match Cli::try_parse_from(argv).unwrap().command {
            Command::Exec(args) => args,
            other => panic!("parsed as {other:?}"),
        };
        let args = parse(&["runbox", "exec", "ID", "--timeout", "5", "--", "ls", "-la"]);
        assert_eq!(args.id, "ID");
        assert_eq!(args.timeout, Some(5));
        assert_eq!(args.cmd, ["ls", "-la"]);
        let args = parse(&[
            "runbox",
            "exec",
            "ID",
            "-e",
            "A=1",
            "sh",
            "-c",
            "echo --timeout",
        ]);
        assert_eq!(args.cmd, ["sh", "-c", "echo --timeout"]);
        assert_eq!(args.env.len(), 1);
        // Options after the command belong to the command.
        let args = parse(&["runbox", "exec", "ID", "ls", "--timeout", "5"]);
        assert_eq!(args.timeout, None);
        assert_eq!(args.cmd, ["ls", "--timeout", "5"]);
        assert!(Cli::try_parse_from(["runbox", "exec", "ID"]).is_err());
    }

    #[test]
    fn lease_credentials_come_in_pairs() {
        let parse = |argv: &[&str]| Cli::try_parse_from(argv).map(|cli| cli.command);
        let cmd = parse(&[
            "runbox",
            "exec",
            "ID",
            "--owner",
            "al",
            "--generation",
            "3",
            "true",
        ])
        .unwrap();
        assert!(
            matches!(cmd, Command::Exec(a) if a.lease.credential().is_some_and(|c| c.owner == "al" && c.generation == 3))
        );
        assert!(parse(&["runbox", "exec", "ID", "--owner", "al", "true"]).is_err());
        assert!(parse(&["runbox", "cp", "a", "ID:b", "--generation", "3"]).is_err());
        assert!(parse(&[
            "runbox",
            "exec",
            "ID",
            "--owner",
            "al",
            "--generation",
            "x",
            "true"
        ])
        .is_err());
        let cmd = parse(&[
            "runbox",
            "lease",
            "release",
            "ID",
            "--owner",
            "al",
            "--generation",
            "2",
        ])
        .unwrap();
        assert!(
            matches!(cmd, Command::Lease(lease::LeaseCommand::Release(a)) if a.generation == 2)
        );
    }
}
