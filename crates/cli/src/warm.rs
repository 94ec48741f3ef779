//! `runbox warm`: the warm repo cache — commit a run's volume as its
//! repository's template, check a volume's lockfiles, list and drop
//! templates.

use std::process::ExitCode;

use clap::{Args, Subcommand};

use crate::connect::ConnectOpts;
use crate::table;

/// `runbox warm ...`.
#[derive(Debug, Subcommand)]
pub enum WarmCommand {
    /// Publish a run's warm volume as its repository's template
    Commit(CommitArgs),
    /// Show a run's warm volume: its lockfile hash now, and the template's
    Status(StatusArgs),
    /// List templates
    Ls(LsArgs),
    /// Show one repository's template
    Show(RepoArgs),
    /// Drop a repository's template (runs using it keep it)
    Rm(RepoArgs),
}

/// `runbox warm commit`.
#[derive(Debug, Args)]
pub struct CommitArgs {
    /// The run's id
    pub id: String,
    /// Publish under this repository (owner/name) [default: the run's]
    #[arg(long)]
    pub repo: Option<String>,
    /// Print the answer as JSON
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox warm status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// The run's id
    pub id: String,
    /// Print the answer as JSON
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox warm ls`.
#[derive(Debug, Args)]
pub struct LsArgs {
    /// Print the answer as JSON
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox warm show` and `rm`.
#[derive(Debug, Args)]
pub struct RepoArgs {
    /// The repository, owner/name
    pub repo: String,
    /// Print the answer as JSON (show only)
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// Runs one `runbox warm` subcommand.
pub async fn run(command: WarmCommand) -> anyhow::Result<ExitCode> {
    match command {
        WarmCommand::Commit(args) => {
            let conn = args.conn.connect()?;
            let done = conn.check(
                conn.client
                    .warm_commit(&args.id, args.repo.as_deref())
                    .await,
            )?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&done)?);
            } else {
                println!(
                    "{} {} ({} files, {}) lock {}",
                    done.repo,
                    done.template.generation,
                    done.template.files,
                    table::size(done.template.bytes),
                    done.lock_hash
                );
            }
        }
        WarmCommand::Status(args) => {
            let conn = args.conn.connect()?;
            let status = conn.check(conn.client.warm_status(&args.id).await)?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&status)?);
            } else {
                let verdict = match &status.template_lock_hash {
                    None => "no template",
                    Some(t) if *t == status.lock_hash => "matches the template",
                    Some(_) => "differs from the template: reinstall and commit",
                };
                println!("{} at {}", status.repo, status.repo_dir);
                println!("lock {} ({verdict})", status.lock_hash);
                if !status.lockfiles.is_empty() {
                    println!("lockfiles {}", status.lockfiles.join(" "));
                }
            }
        }
        WarmCommand::Ls(args) => {
            let conn = args.conn.connect()?;
            let list = conn.check(conn.client.warm_templates().await)?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else {
                let rows: Vec<Vec<String>> = list
                    .templates
                    .iter()
                    .map(|t| {
                        vec![
                            t.repo.clone(),
                            t.tenant.clone().unwrap_or_else(|| "-".into()),
                            t.generation.clone(),
                            t.files.to_string(),
                            table::size(t.bytes),
                            table::date(t.last_used_at),
                            short_hash(&t.lock_hash),
                        ]
                    })
                    .collect();
                print!(
                    "{}",
                    table::render(
                        &[
                            "REPO",
                            "TENANT",
                            "GENERATION",
                            "FILES",
                            "SIZE",
                            "LAST USED",
                            "LOCK"
                        ],
                        &rows
                    )
                );
                println!(
                    "{} of {} in use",
                    table::size(list.bytes),
                    table::size(list.max_bytes)
                );
            }
        }
        WarmCommand::Show(args) => {
            let conn = args.conn.connect()?;
            let template = conn.check(conn.client.warm_template(&args.repo).await)?;
            println!("{}", serde_json::to_string_pretty(&template)?);
        }
        WarmCommand::Rm(args) => {
            let conn = args.conn.connect()?;
            conn.check(conn.client.warm_invalidate(&args.repo).await)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `sha256:0123456789ab…` → `0123456789ab`.
fn short_hash(hash: &str) -> String {
    hash.trim_start_matches("sha256:")
        .chars()
        .take(12)
        .collect()
}
