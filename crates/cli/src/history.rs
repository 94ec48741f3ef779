//! `runbox history`, `runbox diff` and `runbox rollback`: a run's history
//! points (runs created with `--history N`).

use std::process::ExitCode;

use clap::Args;
use runbox_types::{HistoryDiff, HistoryPoint, PathChangeKind, PointKind};

use crate::connect::ConnectOpts;
use crate::table;

/// `runbox history`.
#[derive(Debug, Args)]
pub struct HistoryArgs {
    /// The run's id
    pub id: String,
    /// Print the history as JSON instead of a table
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox diff`.
#[derive(Debug, Args)]
pub struct DiffArgs {
    /// The run's id
    pub id: String,
    /// The point to show [default: the newest]
    pub point: Option<String>,
    /// Diff against this point instead of the point's parent
    #[arg(long, value_name = "POINT")]
    pub against: Option<String>,
    /// Show unified diffs of changed text files
    #[arg(long, short = 'p')]
    pub patch: bool,
    /// The most paths to show
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    pub limit: u64,
    /// Print the diff as JSON
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox rollback`.
#[derive(Debug, Args)]
pub struct RollbackArgs {
    /// The run's id
    pub id: String,
    /// The point to return the run's files to (`runbox history ID` lists
    /// them) [default: the one before the point the files are at: undo
    /// the last change]
    pub point: Option<String>,
    /// The lease owner, when the run is leased
    #[arg(long)]
    pub owner: Option<String>,
    /// The lease generation, with --owner
    #[arg(long, requires = "owner")]
    pub generation: Option<u64>,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox history`: the points, newest first.
pub async fn history(args: HistoryArgs) -> anyhow::Result<ExitCode> {
    let conn = args.conn.connect()?;
    let list = conn.check(conn.client.history(&args.id).await)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&list)?);
    } else {
        print!("{}", render(&list.points, list.head));
    }
    Ok(ExitCode::SUCCESS)
}

/// `runbox diff`: what a point changed.
pub async fn diff(args: DiffArgs) -> anyhow::Result<ExitCode> {
    let conn = args.conn.connect()?;
    let point = match args.point {
        Some(point) => point,
        None => {
            let list = conn.check(conn.client.history(&args.id).await)?;
            match list.points.first() {
                Some(newest) => newest.id.to_string(),
                None => anyhow::bail!("run {} has no history points yet", args.id),
            }
        }
    };
    let against = match args.against {
        Some(raw) => Some(
            runbox_types::parse_id(&raw)
                .ok_or_else(|| anyhow::anyhow!("--against {raw:?} is not a point id"))?,
        ),
        None => None,
    };
    let query = runbox_types::HistoryDiffQuery {
        against,
        patch: Some(args.patch),
        limit: Some(args.limit as usize),
    };
    let diff = conn.check(conn.client.history_diff(&args.id, &point, &query).await)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&diff)?);
    } else {
        print!("{}", render_diff(&diff));
    }
    Ok(ExitCode::SUCCESS)
}

/// `runbox rollback`: prints the run's id and status once it is back.
pub async fn rollback(args: RollbackArgs) -> anyhow::Result<ExitCode> {
    let conn = args.conn.connect()?;
    let point = match &args.point {
        Some(raw) => runbox_types::parse_id(raw)
            .ok_or_else(|| anyhow::anyhow!("{raw:?} is not a point id"))?,
        None => {
            let list = conn.check(conn.client.history(&args.id).await)?;
            undo_target(&list).ok_or_else(|| {
                anyhow::anyhow!(
                    "run {} has no change to undo (its files are at its first point)",
                    args.id
                )
            })?
        }
    };
    let req = runbox_types::RollbackRequest {
        point,
        owner: args.owner,
        generation: args.generation,
    };
    let run = conn.check(conn.client.rollback(&args.id, &req).await)?;
    println!(
        "{} {}",
        run.id,
        serde_json::to_value(run.status)?.as_str().unwrap_or("")
    );
    Ok(ExitCode::SUCCESS)
}

/// The point an undo returns to: the parent of the point the files are at.
fn undo_target(list: &runbox_types::HistoryList) -> Option<ulid::Ulid> {
    let head = list.head?;
    list.points.iter().find(|p| p.id == head)?.parent
}

/// What made a point, in a few words.
fn cause(point: &HistoryPoint) -> String {
    let c = &point.cause;
    match c.kind {
        PointKind::Create => "(the run as made)".to_owned(),
        PointKind::Rollback => "(before a rollback)".to_owned(),
        PointKind::Exec | PointKind::Process => {
            let argv = c.argv.as_deref().unwrap_or_default().join(" ");
            match c.exit_code {
                Some(code) => format!("{argv}  [exit {code}]"),
                None => argv,
            }
        }
        PointKind::File => format!(
            "{} {}",
            c.op.as_deref().unwrap_or("file"),
            c.path.as_deref().unwrap_or("")
        ),
    }
}

/// The history table; the point the files are at is marked `*`.
fn render(points: &[HistoryPoint], head: Option<ulid::Ulid>) -> String {
    let rows: Vec<Vec<String>> = points
        .iter()
        .map(|p| {
            let c = p.changes;
            vec![
                format!("{}{}", p.id, if Some(p.id) == head { " *" } else { "" }),
                table::date(p.created_at),
                format!("+{} ~{} -{}", c.added, c.modified, c.removed),
                table::size(c.bytes),
                cause(p),
            ]
        })
        .collect();
    table::render(&["POINT", "WHEN", "CHANGES", "BYTES", "CAUSE"], &rows)
}

/// A diff, one path per line (`A`, `M`, `D`), then the patches.
fn render_diff(diff: &HistoryDiff) -> String {
    let mut out = String::new();
    for change in &diff.changes {
        let mark = match change.change {
            PathChangeKind::Added => 'A',
            PathChangeKind::Modified => 'M',
            PathChangeKind::Removed => 'D',
        };
        out.push_str(&format!("{mark} {}\n", change.path));
    }
    if diff.truncated {
        out.push_str("… more paths changed (raise --limit)\n");
    }
    for change in &diff.changes {
        if let Some(patch) = &change.patch {
            out.push_str(patch);
        } else if change.binary {
            out.push_str(&format!("Binary file {} differs\n", change.path));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(kind: PointKind) -> HistoryPoint {
        HistoryPoint {
            id: ulid::Ulid::from_string("01JBXG0000000000000000000A").unwrap(),
            created_at: time::OffsetDateTime::UNIX_EPOCH,
            parent: None,
            cause: runbox_types::PointCause {
                kind,
                argv: Some(vec!["rm".into(), "-rf".into(), "/work/x".into()]),
                exit_code: Some(0),
                user: None,
                op: Some("write".into()),
                path: Some("/work/a".into()),
            },
            changes: runbox_types::ChangeSummary {
                added: 1,
                modified: 2,
                removed: 3,
                bytes: 2048,
            },
        }
    }

    #[test]
    fn an_undo_returns_to_the_parent_of_the_head() {
        let mut newest = point(PointKind::Exec);
        let first = point(PointKind::Create);
        let first_id = ulid::Ulid::from_string("01JBXG00000000000000000009").unwrap();
        newest.parent = Some(first_id);
        let list = runbox_types::HistoryList {
            points: vec![
                newest.clone(),
                HistoryPoint {
                    id: first_id,
                    ..first
                },
            ],
            head: Some(newest.id),
            keep: 20,
            bytes: None,
        };
        assert_eq!(undo_target(&list), Some(first_id));
        let at_first = runbox_types::HistoryList {
            head: Some(first_id),
            ..list
        };
        assert_eq!(undo_target(&at_first), None);
    }

    #[test]
    fn points_say_what_made_them_and_which_is_current() {
        let exec = point(PointKind::Exec);
        let text = render(&[exec.clone(), point(PointKind::File)], Some(exec.id));
        assert!(text.contains("rm -rf /work/x  [exit 0]"), "{text}");
        assert!(text.contains("write /work/a"), "{text}");
        assert!(text.contains("+1 ~2 -3"), "{text}");
        assert!(text.contains(&format!("{} *", exec.id)), "{text}");
    }
}
