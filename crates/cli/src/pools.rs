//! `runbox pools`, `runbox info`, `runbox drain` and `runbox cluster`: the
//! node's warm pools, its capacity, cordoning it, and the fleet it is in.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Subcommand};

use crate::connect::ConnectOpts;
use crate::table;

/// `runbox pools ...`.
#[derive(Debug, Subcommand)]
pub enum PoolsCommand {
    /// Show each pool: target, ready members, refills, last error
    Ls(ShowArgs),
    /// Replace the pool set with a file's ({"pools": [...]}); pools left
    /// out drain
    Set(SetArgs),
}

/// `runbox pools ls` and `runbox info`.
#[derive(Debug, Args)]
pub struct ShowArgs {
    /// Print the answer as JSON
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox pools set`.
#[derive(Debug, Args)]
pub struct SetArgs {
    /// The pool set, as JSON; `-` reads standard input
    pub file: PathBuf,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox drain`.
#[derive(Debug, Args)]
pub struct DrainArgs {
    /// Uncordon instead: take new runs again and refill the pools
    #[arg(long, conflicts_with = "migrate")]
    pub off: bool,
    /// Move every run off the node too, to the other nodes of its fleet
    /// (each under the same id; awake runs are booted there, their
    /// processes end)
    #[arg(long)]
    pub migrate: bool,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

fn pool_rows(pools: &[runbox_types::PoolStatus]) -> String {
    let rows: Vec<Vec<String>> = pools
        .iter()
        .map(|p| {
            vec![
                p.image.clone(),
                p.network.as_str().to_owned(),
                p.size.to_string(),
                match p.warm_max {
                    Some(max) => format!("{}/{}..{max}", p.target, p.warm),
                    None => p.target.to_string(),
                },
                p.ready.to_string(),
                p.refilling.to_string(),
                format!("{}/{}", p.claims, p.misses),
                p.last_error.clone().unwrap_or_default(),
            ]
        })
        .collect();
    table::render(
        &[
            "IMAGE",
            "NETWORK",
            "SIZE",
            "TARGET",
            "READY",
            "REFILLING",
            "SERVED/COLD",
            "LAST ERROR",
        ],
        &rows,
    )
}

/// Runs one `runbox pools` subcommand.
pub async fn run(command: PoolsCommand) -> anyhow::Result<ExitCode> {
    let (list, json) = match command {
        PoolsCommand::Ls(args) => {
            let conn = args.conn.connect()?;
            (conn.check(conn.client.pools().await)?, args.json)
        }
        PoolsCommand::Set(args) => {
            let text = if args.file.as_os_str() == "-" {
                std::io::read_to_string(std::io::stdin()).context("reading standard input")?
            } else {
                std::fs::read_to_string(&args.file)
                    .with_context(|| format!("reading {}", args.file.display()))?
            };
            let set: runbox_types::PoolSet = serde_json::from_str(&text)
                .with_context(|| format!("{} is not a pool set", args.file.display()))?;
            let conn = args.conn.connect()?;
            (conn.check(conn.client.set_pools(&set).await)?, false)
        }
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&list)?);
    } else {
        print!("{}", pool_rows(&list.pools));
        if list.draining {
            println!("draining: the node takes no new runs (runbox drain --off)");
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `runbox info`.
pub async fn info(args: ShowArgs) -> anyhow::Result<ExitCode> {
    let conn = args.conn.connect()?;
    let info = conn.check(conn.client.info().await)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&info)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "server   {} (runbox {}, {})",
        info.server, info.version, info.runtime
    );
    let c = info.capacity;
    println!(
        "runs     {} of {} ({} being created), {} idle in pools",
        c.live, c.max, c.creating, c.pooled
    );
    if let Some(s) = info.storage {
        println!(
            "storage  {} of {} used",
            table::size(s.used_bytes),
            table::size(s.total_bytes)
        );
    }
    match info.userns.as_str() {
        "private" => println!("users    each run has a user namespace of its own"),
        "off" => println!("users    runs share the host's user namespace (--userns off)"),
        _ => {}
    }
    if info.draining {
        println!("draining: the node takes no new runs");
    }
    if !info.pools.is_empty() {
        print!("{}", pool_rows(&info.pools));
    }
    Ok(ExitCode::SUCCESS)
}

/// `runbox drain`.
pub async fn drain(args: DrainArgs) -> anyhow::Result<ExitCode> {
    let conn = args.conn.connect()?;
    let list = match args.migrate {
        true => conn.check(conn.client.drain_migrate().await)?,
        false => conn.check(conn.client.set_draining(!args.off).await)?,
    };
    println!(
        "{}",
        if list.draining {
            "draining: new runs are refused and the pools are emptied"
        } else {
            "serving: new runs are taken and the pools refill"
        }
    );
    let Some(migrated) = list.migrated else {
        return Ok(ExitCode::SUCCESS);
    };
    for moved in &migrated.moved {
        println!("{} moved to {}", moved.id, moved.node);
    }
    for failed in &migrated.failed {
        eprintln!(
            "runbox: {} stays: {} ({})",
            failed.id, failed.error.message, failed.error.code
        );
    }
    println!(
        "{} run(s) moved, {} stayed",
        migrated.moved.len(),
        migrated.failed.len()
    );
    Ok(match migrated.failed.is_empty() {
        true => ExitCode::SUCCESS,
        false => ExitCode::FAILURE,
    })
}

/// `runbox cluster ...`.
#[derive(Debug, Subcommand)]
pub enum ClusterCommand {
    /// Each node of the fleet: where it stands, how full, its address
    Status(ShowArgs),
}

/// Runs one `runbox cluster` subcommand.
pub async fn cluster(command: ClusterCommand) -> anyhow::Result<ExitCode> {
    let ClusterCommand::Status(args) = command;
    let conn = args.conn.connect()?;
    let status = conn.check(conn.client.cluster().await)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&status)?);
        return Ok(ExitCode::SUCCESS);
    }
    let rows: Vec<Vec<String>> = status
        .nodes
        .iter()
        .map(|n| {
            vec![
                match n.local {
                    true => format!("{} *", n.id),
                    false => n.id.clone(),
                },
                n.state.as_str().to_owned(),
                format!("{}/{}", n.runs, n.capacity),
                n.pools_ready.to_string(),
                format!("{:.1}s", n.last_seen_sec),
                n.advertise.clone().unwrap_or_else(|| "-".into()),
                format!("{} {}", n.version, n.lane),
            ]
        })
        .collect();
    print!(
        "{}",
        table::render(
            &[
                "NODE",
                "STATE",
                "RUNS",
                "POOLED",
                "SEEN",
                "ADVERTISE",
                "VERSION"
            ],
            &rows
        )
    );
    Ok(ExitCode::SUCCESS)
}
