//! `runbox fs`: stat, list, mkdir, move and remove in a run's /work.

use std::process::ExitCode;

use clap::{Args, Subcommand};
use runbox_types::{FileInfo, FileKind, MakeDirRequest, MoveRequest, RemoveRequest};

use crate::connect::ConnectOpts;
use crate::table;

/// `runbox fs ...`.
#[derive(Debug, Subcommand)]
pub enum FsCommand {
    /// List a directory of /work (default /work itself)
    Ls(LsArgs),
    /// Describe one path (a symlink is described, not followed)
    Stat(PathArgs),
    /// Make a directory and its missing parents
    Mkdir(PathArgs),
    /// Rename a path
    Mv(MvArgs),
    /// Remove a file, a symlink, or a directory (-r for a non-empty one)
    Rm(RmArgs),
}

/// `runbox fs ls`.
#[derive(Debug, Args)]
pub struct LsArgs {
    /// The run's id
    pub id: String,
    /// Relative to /work
    #[arg(default_value = "")]
    pub path: String,
    /// Levels to list (1-16)
    #[arg(long, short = 'd', default_value_t = 1)]
    pub depth: u32,
    /// Print the answer as JSON
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox fs stat` and `mkdir`.
#[derive(Debug, Args)]
pub struct PathArgs {
    /// The run's id
    pub id: String,
    /// Relative to /work
    pub path: String,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox fs mv`.
#[derive(Debug, Args)]
pub struct MvArgs {
    /// The run's id
    pub id: String,
    /// Relative to /work
    pub from: String,
    /// Relative to /work
    pub to: String,
    /// Replace an existing destination
    #[arg(long, short = 'f')]
    pub force: bool,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox fs rm`.
#[derive(Debug, Args)]
pub struct RmArgs {
    /// The run's id
    pub id: String,
    /// Relative to /work
    pub path: String,
    /// Remove a directory with everything in it
    #[arg(long, short = 'r')]
    pub recursive: bool,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

fn row(info: &FileInfo) -> Vec<String> {
    let kind = match info.kind {
        FileKind::File => "-",
        FileKind::Directory => "d",
        FileKind::Symlink => "l",
        FileKind::Other => "?",
    };
    let name = match &info.target {
        Some(target) => format!("{} -> {target}", info.path),
        None if info.path.is_empty() => ".".to_owned(),
        None => info.path.clone(),
    };
    vec![
        format!("{kind}{:04o}", info.mode),
        info.size.to_string(),
        table::date(info.modified_at),
        name,
    ]
}

/// Runs one `runbox fs` subcommand.
pub async fn run(command: FsCommand) -> anyhow::Result<ExitCode> {
    match command {
        FsCommand::Ls(args) => {
            let conn = args.conn.connect()?;
            let list = conn.check(conn.client.list_dir(&args.id, &args.path, args.depth).await)?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else {
                let rows: Vec<Vec<String>> = list.entries.iter().map(row).collect();
                print!(
                    "{}",
                    table::render(&["MODE", "SIZE", "MODIFIED", "PATH"], &rows)
                );
                if list.truncated {
                    println!("(truncated: narrow the path or the depth)");
                }
            }
        }
        FsCommand::Stat(args) => {
            let conn = args.conn.connect()?;
            let info = conn.check(conn.client.stat(&args.id, &args.path).await)?;
            println!("{}", serde_json::to_string_pretty(&info)?);
        }
        FsCommand::Mkdir(args) => {
            let conn = args.conn.connect()?;
            let req = MakeDirRequest {
                path: args.path,
                ..Default::default()
            };
            conn.check(conn.client.make_dir(&args.id, &req).await)?;
        }
        FsCommand::Mv(args) => {
            let conn = args.conn.connect()?;
            let req = MoveRequest {
                from: args.from,
                to: args.to,
                overwrite: Some(args.force),
                ..Default::default()
            };
            conn.check(conn.client.move_path(&args.id, &req).await)?;
        }
        FsCommand::Rm(args) => {
            let conn = args.conn.connect()?;
            let req = RemoveRequest {
                path: args.path,
                recursive: Some(args.recursive),
                ..Default::default()
            };
            conn.check(conn.client.remove_path(&args.id, &req).await)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}
