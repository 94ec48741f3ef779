//! `runbox checkpoint` and `runbox checkpoints`: runs' disks and settings in
//! the server's checkpoint store.

use std::process::ExitCode;

use clap::{Args, Subcommand};

use crate::args::{parse_env_var, EnvVar};
use crate::connect::ConnectOpts;
use crate::table;

/// `runbox checkpoint`.
#[derive(Debug, Args)]
pub struct CheckpointArgs {
    /// The run's id
    pub id: String,
    /// A label on the checkpoint (repeatable)
    #[arg(long = "label", short = 'l', value_name = "K=V", value_parser = parse_env_var)]
    pub labels: Vec<EnvVar>,
    /// Print the checkpoint as JSON instead of its id
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox checkpoints …`.
#[derive(Debug, Subcommand)]
pub enum CheckpointsCommand {
    /// List the checkpoints in the store
    Ls(LsArgs),
    /// Show one checkpoint as JSON
    Show(ShowArgs),
    /// Delete checkpoints from the store
    Rm(RmArgs),
}

/// `runbox checkpoints ls`.
#[derive(Debug, Args)]
pub struct LsArgs {
    /// Print the list as JSON
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox checkpoints show`.
#[derive(Debug, Args)]
pub struct ShowArgs {
    /// The checkpoint's id
    pub id: String,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox checkpoints rm`.
#[derive(Debug, Args)]
pub struct RmArgs {
    /// The checkpoints' ids
    #[arg(required = true)]
    pub ids: Vec<String>,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox checkpoint`: prints the new checkpoint's id.
pub async fn checkpoint(args: CheckpointArgs) -> anyhow::Result<ExitCode> {
    let conn = args.conn.connect()?;
    let req = runbox_types::CheckpointRequest {
        labels: (!args.labels.is_empty()).then(|| {
            args.labels
                .iter()
                .map(|l| (l.name.clone(), l.value.clone()))
                .collect()
        }),
    };
    let checkpoint = conn.check(conn.client.checkpoint_run(&args.id, &req).await)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&checkpoint)?);
    } else {
        println!("{}", checkpoint.id);
    }
    Ok(ExitCode::SUCCESS)
}

/// `runbox checkpoints …`.
pub async fn run(command: CheckpointsCommand) -> anyhow::Result<ExitCode> {
    match command {
        CheckpointsCommand::Ls(args) => {
            let conn = args.conn.connect()?;
            let list = conn.check(conn.client.list_checkpoints().await)?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else {
                print!("{}", render(&list.checkpoints));
            }
            Ok(ExitCode::SUCCESS)
        }
        CheckpointsCommand::Show(args) => {
            let conn = args.conn.connect()?;
            let checkpoint = conn.check(conn.client.get_checkpoint(&args.id).await)?;
            println!("{}", serde_json::to_string_pretty(&checkpoint)?);
            Ok(ExitCode::SUCCESS)
        }
        CheckpointsCommand::Rm(args) => {
            let conn = args.conn.connect()?;
            let mut failed = false;
            for id in &args.ids {
                match conn.check(conn.client.delete_checkpoint(id).await) {
                    Ok(()) => println!("{id}"),
                    Err(err) => {
                        eprintln!("runbox: cannot delete checkpoint {id}: {err:#}");
                        failed = true;
                    }
                }
            }
            Ok(if failed {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            })
        }
    }
}

/// The checkpoint table.
fn render(checkpoints: &[runbox_types::Checkpoint]) -> String {
    let rows: Vec<Vec<String>> = checkpoints
        .iter()
        .map(|c| {
            vec![
                c.id.to_string(),
                c.run.to_string(),
                c.image.clone(),
                table::size(c.stored_bytes),
                table::date(c.created_at),
            ]
        })
        .collect();
    table::render(&["ID", "RUN", "IMAGE", "STORED", "CREATED (UTC)"], &rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_shows_one_line_per_checkpoint() {
        let checkpoint = runbox_types::Checkpoint {
            id: "01JABCDEFGHJKMNPQRSTVWXYZ0".parse().unwrap(),
            run: "01JABCDEFGHJKMNPQRSTVWXYZ1".parse().unwrap(),
            image: "base".into(),
            created_at: time::OffsetDateTime::UNIX_EPOCH,
            expires_at: None,
            stored_bytes: 3 << 20,
            disk_bytes: 10 << 20,
            labels: Default::default(),
            server: "node".into(),
            tenant: None,
            volumes_excluded: Vec::new(),
            secrets_excluded: Vec::new(),
        };
        let out = render(&[checkpoint]);
        assert_eq!(out.lines().count(), 2, "{out}");
        assert!(
            out.lines()
                .nth(1)
                .unwrap()
                .starts_with("01JABCDEFGHJKMNPQRSTVWXYZ0   01JABCDEFGHJKMNPQRSTVWXYZ1   base"),
            "{out}"
        );
    }
}
