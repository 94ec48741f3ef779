//! `runbox volumes`: named volumes, data that outlives runs.

use std::process::ExitCode;

use clap::{Args, Subcommand};

use crate::connect::ConnectOpts;
use crate::table;

/// `runbox volumes …`.
#[derive(Debug, Subcommand)]
pub enum VolumesCommand {
    /// Make a volume (mount it with `runbox run create --volume NAME`)
    Create(CreateArgs),
    /// List the volumes, with the runs that mount them
    Ls(LsArgs),
    /// Show one volume as JSON
    Show(NameArgs),
    /// Make a new volume holding what a volume holds now (constant time)
    Clone(CloneArgs),
    /// Move a volume no run mounts to another node of the fleet
    Move(MoveArgs),
    /// Delete volumes no run mounts, and everything in them
    Rm(RmArgs),
}

/// `runbox volumes create`.
#[derive(Debug, Args)]
pub struct CreateArgs {
    /// Its name: 1-63 of letters, digits, '_', '-' and '.'
    pub name: String,
    /// The most it may hold, in MiB [default: the server's
    /// --volume-default-mb, 10 GiB]
    #[arg(long, value_name = "MIB")]
    pub size_mb: Option<u64>,
    /// A label (repeatable), for `runbox volumes ls --label`
    #[arg(long = "label", short = 'l', value_name = "K=V", value_parser = crate::args::parse_env_var)]
    pub labels: Vec<crate::args::EnvVar>,
    /// Print the volume as JSON
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox volumes clone`.
#[derive(Debug, Args)]
pub struct CloneArgs {
    /// The volume to copy
    pub source: String,
    /// The new volume's name
    pub name: String,
    /// Its size in MiB [default: the source's]
    #[arg(long, value_name = "MIB")]
    pub size_mb: Option<u64>,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox volumes move`.
#[derive(Debug, Args)]
pub struct MoveArgs {
    /// The volume
    pub name: String,
    /// The node to move it to [default: the one with the most room that
    /// shares this node's checkpoint bucket]
    #[arg(long, value_name = "NODE")]
    pub node: Option<String>,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox volumes ls`.
#[derive(Debug, Args)]
pub struct LsArgs {
    /// Print the list as JSON
    #[arg(long)]
    pub json: bool,
    /// Only volumes with this label: KEY=VALUE, or KEY for any value
    /// (repeat: every one must hold)
    #[arg(long = "label", short = 'l', value_name = "KEY[=VALUE]")]
    pub labels: Vec<String>,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// One volume by name.
#[derive(Debug, Args)]
pub struct NameArgs {
    /// The volume
    pub name: String,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox volumes rm`.
#[derive(Debug, Args)]
pub struct RmArgs {
    /// The volumes
    #[arg(required = true)]
    pub names: Vec<String>,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox volumes …`.
pub async fn run(command: VolumesCommand) -> anyhow::Result<ExitCode> {
    match command {
        VolumesCommand::Create(args) => {
            let conn = args.conn.connect()?;
            let req = runbox_types::CreateVolumeRequest {
                name: args.name,
                size_mb: args.size_mb,
                labels: (!args.labels.is_empty()).then(|| {
                    args.labels
                        .iter()
                        .map(|l| (l.name.clone(), l.value.clone()))
                        .collect()
                }),
            };
            let volume = conn.check(conn.client.create_volume(&req).await)?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&volume)?);
            } else {
                println!("{}", volume.name);
            }
        }
        VolumesCommand::Ls(args) => {
            let conn = args.conn.connect()?;
            let selector: Vec<&str> = args.labels.iter().map(String::as_str).collect();
            let list = conn.check(conn.client.list_volumes_labelled(&selector).await)?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else {
                print!("{}", render(&list.volumes));
            }
        }
        VolumesCommand::Show(args) => {
            let conn = args.conn.connect()?;
            let volume = conn.check(conn.client.get_volume(&args.name).await)?;
            println!("{}", serde_json::to_string_pretty(&volume)?);
        }
        VolumesCommand::Clone(args) => {
            let conn = args.conn.connect()?;
            let req = runbox_types::CloneVolumeRequest {
                name: args.name,
                size_mb: args.size_mb,
                labels: None,
            };
            let volume = conn.check(conn.client.clone_volume(&args.source, &req).await)?;
            println!("{}", volume.name);
        }
        VolumesCommand::Move(args) => {
            let conn = args.conn.connect()?;
            let volume = conn.check(conn.client.move_volume(&args.name, args.node).await)?;
            println!("{} {}", volume.name, volume.server);
        }
        VolumesCommand::Rm(args) => {
            let conn = args.conn.connect()?;
            let mut failed = false;
            for name in &args.names {
                match conn.check(conn.client.delete_volume(name).await) {
                    Ok(()) => println!("{name}"),
                    Err(err) => {
                        eprintln!("runbox: cannot delete volume {name}: {err:#}");
                        failed = true;
                    }
                }
            }
            if failed {
                return Ok(ExitCode::FAILURE);
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The volume table.
fn render(volumes: &[runbox_types::Volume]) -> String {
    let rows: Vec<Vec<String>> = volumes
        .iter()
        .map(|v| {
            let holders = if v.holders.is_empty() {
                "-".to_owned()
            } else {
                v.holders
                    .iter()
                    .map(|h| format!("{} ({})", h.run, h.mode.as_str()))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            // A dataset of the catalog: its kind and state stand where a
            // named volume's creation date does.
            let kind = match &v.dataset {
                None => table::date(v.created_at),
                Some(d) => {
                    let mode = if d.writable { "rw" } else { "ro" };
                    match &d.unavailable {
                        Some(why) => format!("dataset {mode}, {why}"),
                        None => format!("dataset {mode}"),
                    }
                }
            };
            vec![
                v.name.clone(),
                v.used_bytes.map_or_else(|| "-".to_owned(), table::size),
                table::size(v.size_mb << 20),
                v.tenant.clone().unwrap_or_else(|| "-".to_owned()),
                holders,
                kind,
            ]
        })
        .collect();
    table::render(
        &[
            "NAME",
            "USED",
            "SIZE",
            "TENANT",
            "MOUNTED BY",
            "CREATED (UTC) / DATASET",
        ],
        &rows,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_shows_holders_and_sizes() {
        let volume = runbox_types::Volume {
            id: ulid::Ulid::nil(),
            name: "data".into(),
            server: "node".into(),
            size_mb: 1024,
            used_bytes: Some(3 << 20),
            holders: vec![runbox_types::VolumeHolder {
                run: ulid::Ulid::nil(),
                mode: runbox_types::VolumeMode::Ro,
            }],
            created_at: time::OffsetDateTime::UNIX_EPOCH,
            tenant: None,
            labels: Default::default(),
            dataset: None,
        };
        let dataset = runbox_types::Volume {
            name: "corpus".into(),
            used_bytes: None,
            holders: vec![],
            dataset: Some(runbox_types::DatasetState {
                writable: false,
                available: false,
                unavailable: Some("missing".into()),
            }),
            ..volume.clone()
        };
        assert!(render(&[dataset]).contains("dataset ro, missing"));
        let text = render(&[volume]);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("NAME"), "{text}");
        assert!(
            lines[1].contains("data") && lines[1].contains("(ro)"),
            "{text}"
        );
        assert!(
            lines[1].contains("1.0 GiB") || lines[1].contains("1 GiB"),
            "{text}"
        );
    }
}
