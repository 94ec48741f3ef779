//! The snapshots phase: what a snapshot costs against the bytes a run
//! changed (next to `cp -a` of the same upper directory, the floor for any
//! copy), how long the run is frozen, what starting from a snapshot costs
//! next to a cold start from its base image, and what a fork of 1, 4 and 16
//! costs; and what a warm start costs against the size of the warm
//! template it mounts, next to `cp -a` of that template (what a cache that
//! copies the template into every run pays).
//!
//! Owns only the measuring; the daemon and its runs are [`Daemon`]'s (its
//! cleanup removes every run made here; snapshot images are deleted as they
//! are made).

use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use runbox_types::{ExecRequest, ForkRequest};
use serde::Serialize;

use crate::daemon::Daemon;
use crate::stats::{summarize, Summary};

/// Bytes a run changes before each snapshot series, in MiB.
const DIRTY_MIB: [u64; 4] = [1, 10, 100, 1000];

/// Children per fork series.
const FORK_COUNTS: [usize; 3] = [1, 4, 16];

/// Warm template sizes, in MiB of 1 MiB files (plus [`SMALL_FILES`]).
const TEMPLATE_MIB: [u64; 3] = [1, 100, 1000];

/// Small files in every warm template (a dependency tree is mostly those).
const SMALL_FILES: usize = 2000;

/// One row of the warm-start table.
#[derive(Clone, Debug, Serialize)]
pub struct WarmRow {
    /// MiB of file data in the template.
    pub mib: u64,
    /// Regular files in it.
    pub files: u64,
    /// The one `warm-commit` that made it.
    pub commit_ms: f64,
    /// Create with `warm` + first exec reading a template file.
    pub start: Summary,
    /// `cp -a` of the template on the same filesystem.
    pub cp: Summary,
}

/// One row of the dirty-bytes table.
#[derive(Clone, Debug, Serialize)]
pub struct DirtyRow {
    /// MiB the run wrote.
    pub mib: u64,
    /// `POST /v1/runs/{id}/snapshot`, client-side.
    pub snapshot: Summary,
    /// The run's frozen window, as the server reports it.
    pub frozen: Summary,
    /// `cp -a` of the run's upper directory on the same filesystem.
    pub cp: Summary,
    /// `btrfs subvolume snapshot -r` of the run's disk subvolume: the
    /// filesystem's own snapshot, the floor for a snapshot.
    pub btrfs: Summary,
}

/// The phase's results.
#[derive(Clone, Debug, Serialize)]
pub struct SnapshotReport {
    /// The runtime of the daemon measured.
    pub runtime: String,
    /// Iterations per series.
    pub iterations: usize,
    /// Snapshot cost by dirty size.
    pub dirty: Vec<DirtyRow>,
    /// Snapshot cost with 1 MiB changed, by image: (label, image MiB, cost).
    pub by_image: Vec<(String, u64, Summary)>,
    /// Create + first exec from a snapshot image (10 MiB changed).
    pub start_from_snapshot: Summary,
    /// Create + first exec from the snapshot's base image.
    pub cold_start: Summary,
    /// Fork of N children, by N.
    pub forks: Vec<(usize, Summary)>,
    /// Warm start by template size.
    pub warm: Vec<WarmRow>,
    /// Create + first exec without a warm volume, in the same loop.
    pub warm_cold: Summary,
}

async fn sh(daemon: &Daemon, id: &str, script: &str) -> anyhow::Result<()> {
    let req = ExecRequest {
        cmd: vec!["sh".into(), "-c".into(), script.into()],
        ..Default::default()
    };
    let out = daemon.client.exec(id, &req).await?.collect_output().await?;
    ensure!(
        out.exit.exit_code == 0,
        "{script:?} failed: {:?}",
        out.stderr
    );
    Ok(())
}

async fn first_exec(daemon: &mut Daemon, image: &str) -> anyhow::Result<(Duration, String)> {
    let started = Instant::now();
    let run = daemon.create_run_of(image).await?;
    sh(daemon, &run.id.to_string(), "true").await?;
    Ok((started.elapsed(), run.id.to_string()))
}

fn cp_a(from: &Path, to: &Path) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let status = std::process::Command::new("cp")
        .arg("-a")
        .arg(from)
        .arg(to)
        .status()
        .context("running cp -a")?;
    let took = started.elapsed();
    ensure!(status.success(), "cp -a failed");
    std::fs::remove_dir_all(to).context("removing the cp -a copy")?;
    Ok(took)
}

/// `btrfs subvolume snapshot -r` of subvolume `from` to `to`, timed; the
/// snapshot is deleted after.
fn btrfs_snapshot(from: &Path, to: &Path) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let status = std::process::Command::new("btrfs")
        .args(["-q", "subvolume", "snapshot", "-r"])
        .arg(from)
        .arg(to)
        .status()
        .context("running btrfs subvolume snapshot")?;
    let took = started.elapsed();
    ensure!(status.success(), "btrfs subvolume snapshot failed");
    let status = std::process::Command::new("btrfs")
        .args(["-q", "subvolume", "delete"])
        .arg(to)
        .status()
        .context("running btrfs subvolume delete")?;
    ensure!(status.success(), "btrfs subvolume delete failed");
    Ok(took)
}

/// Snapshots of a run that changed 1 MiB, from `image`.
async fn one_mib_snapshots(
    daemon: &mut Daemon,
    image: &str,
    iterations: usize,
) -> anyhow::Result<Summary> {
    let run = daemon.create_run_of(image).await?;
    let id = run.id.to_string();
    sh(
        daemon,
        &id,
        "dd if=/dev/urandom of=/work/dirty bs=1M count=1 2>/dev/null; sync",
    )
    .await?;
    let mut samples = Vec::new();
    for _ in 0..iterations {
        let started = Instant::now();
        let snap = daemon.client.snapshot_run(&id, None).await?;
        samples.push(started.elapsed());
        daemon.client.delete_snapshot(&snap.image).await?;
    }
    daemon.delete_run(run.id).await?;
    summarize(&samples).context("no samples")
}

/// Runs the phase on `daemon`. `work` is a scratch directory, `busybox`
/// the base image as a tarball, `image_mib` the size of the large image
/// the image-size series compares with.
pub async fn measure(
    daemon: &mut Daemon,
    iterations: usize,
    work: &Path,
    busybox: &[u8],
    image_mib: u64,
) -> anyhow::Result<SnapshotReport> {
    eprintln!("runbox-bench: snapshots: by image size ({image_mib} MiB image)");
    let dir = work.join("snapshot-fixture");
    let busybox = busybox.to_vec();
    let fixture = tokio::task::spawn_blocking(move || {
        crate::images::Fixture::build(&dir, image_mib, &busybox)
    })
    .await??;
    daemon
        .import_file("bench-large", &fixture.large_layout)
        .await?;
    let by_image = vec![
        (
            "base".to_owned(),
            0,
            one_mib_snapshots(daemon, "base", iterations).await?,
        ),
        (
            "bench-large".to_owned(),
            image_mib,
            one_mib_snapshots(daemon, "bench-large", iterations).await?,
        ),
    ];
    daemon.delete_image("bench-large").await?;

    let mut dirty = Vec::new();
    for mib in DIRTY_MIB {
        eprintln!("runbox-bench: snapshots: {mib} MiB changed");
        let run = daemon.create_run().await?;
        let id = run.id.to_string();
        sh(
            daemon,
            &id,
            &format!("dd if=/dev/urandom of=/work/dirty bs=1M count={mib} 2>/dev/null; sync"),
        )
        .await?;
        let upper = daemon.state_dir().join("runs").join(&id).join("disk/upper");
        let copy = daemon.state_dir().join("runs/.bench-cp");
        let disk = daemon.state_dir().join("runs").join(&id).join("disk");
        let subvolume_copy = daemon.state_dir().join("runs/.bench-snap");
        let (mut snaps, mut frozen, mut cps) = (Vec::new(), Vec::new(), Vec::new());
        let mut btrfs = Vec::new();
        for _ in 0..iterations {
            let started = Instant::now();
            let snap = daemon.client.snapshot_run(&id, None).await?;
            snaps.push(started.elapsed());
            frozen.push(Duration::from_secs_f64(snap.frozen_ms / 1e3));
            daemon.client.delete_snapshot(&snap.image).await?;
            cps.push(cp_a(&upper, &copy)?);
            btrfs.push(btrfs_snapshot(&disk, &subvolume_copy)?);
        }
        daemon.delete_run(run.id).await?;
        dirty.push(DirtyRow {
            mib,
            snapshot: summarize(&snaps).context("no samples")?,
            frozen: summarize(&frozen).context("no samples")?,
            cp: summarize(&cps).context("no samples")?,
            btrfs: summarize(&btrfs).context("no samples")?,
        });
    }

    eprintln!("runbox-bench: snapshots: start from a snapshot");
    let run = daemon.create_run().await?;
    let id = run.id.to_string();
    sh(
        daemon,
        &id,
        "dd if=/dev/urandom of=/work/dirty bs=1M count=10 2>/dev/null",
    )
    .await?;
    let snap = daemon
        .client
        .snapshot_run(&id, Some("bench-snapshot"))
        .await?;
    daemon.delete_run(run.id).await?;
    let (mut warm, mut cold) = (Vec::new(), Vec::new());
    for _ in 0..iterations.max(10) {
        for (image, samples) in [(snap.image.as_str(), &mut warm), ("base", &mut cold)] {
            let (took, id) = first_exec(daemon, image).await?;
            samples.push(took);
            daemon.delete_run(id.parse()?).await?;
        }
    }
    daemon.client.delete_snapshot(&snap.image).await?;

    let mut forks = Vec::new();
    let parent = daemon.create_run().await?;
    sh(
        daemon,
        &parent.id.to_string(),
        "dd if=/dev/urandom of=/work/dirty bs=1M count=10 2>/dev/null",
    )
    .await?;
    for count in FORK_COUNTS {
        eprintln!("runbox-bench: snapshots: fork of {count}");
        let mut samples = Vec::new();
        for _ in 0..iterations {
            let started = Instant::now();
            let forked = daemon
                .client
                .fork_run(
                    &parent.id.to_string(),
                    &ForkRequest {
                        count,
                        ttl_sec: None,
                        point: None,
                    },
                )
                .await?;
            samples.push(started.elapsed());
            for child in forked.runs {
                daemon.remember(child.id);
                daemon.delete_run(child.id).await?;
            }
        }
        forks.push((count, summarize(&samples).context("no samples")?));
    }
    daemon.delete_run(parent.id).await?;
    let (warm_rows, warm_cold) = warm_starts(daemon, iterations.max(10)).await?;
    Ok(SnapshotReport {
        runtime: daemon.runtime.clone(),
        iterations,
        dirty,
        by_image,
        start_from_snapshot: summarize(&warm).context("no samples")?,
        cold_start: summarize(&cold).context("no samples")?,
        forks,
        warm: warm_rows,
        warm_cold,
    })
}

/// Warm starts from templates of [`TEMPLATE_MIB`], each made by one setup
/// run and one commit, with cold starts in the same loop.
async fn warm_starts(
    daemon: &mut Daemon,
    iterations: usize,
) -> anyhow::Result<(Vec<WarmRow>, Summary)> {
    let warm_req = |repo: &str| runbox_types::CreateRunRequest {
        image: crate::daemon::IMAGE.into(),
        warm: Some(runbox_types::WarmRequest {
            repo: repo.into(),
            path: None,
        }),
        ..Default::default()
    };
    let (mut rows, mut cold) = (Vec::new(), Vec::new());
    for mib in TEMPLATE_MIB {
        eprintln!("runbox-bench: snapshots: warm start, {mib} MiB template");
        let repo = format!("bench/template-{mib}");
        let setup = daemon.create_run_with(warm_req(&repo)).await?;
        let id = setup.id.to_string();
        sh(
            daemon,
            &id,
            &format!(
                "set -e; mkdir -p /work/repo/big /work/repo/small; i=0; \
                 while [ $i -lt {mib} ]; do dd if=/dev/urandom of=/work/repo/big/$i bs=1M count=1 2>/dev/null; i=$((i+1)); done; \
                 i=0; while [ $i -lt {SMALL_FILES} ]; do echo $i > /work/repo/small/$i; i=$((i+1)); done; \
                 echo lock > /work/repo/Cargo.lock; sync"
            ),
        )
        .await?;
        let started = Instant::now();
        let commit = daemon.client.warm_commit(&id, None).await?;
        let commit_ms = started.elapsed().as_secs_f64() * 1e3;
        daemon.delete_run(setup.id).await?;
        let tree = daemon
            .state_dir()
            .join("runs/.warm/repos")
            .join(&repo)
            .join(&commit.template.generation)
            .join("tree");
        let copy = daemon.state_dir().join("runs/.bench-cp");
        let (mut starts, mut cps) = (Vec::new(), Vec::new());
        for _ in 0..iterations {
            let started = Instant::now();
            let run = daemon.create_run_with(warm_req(&repo)).await?;
            sh(
                daemon,
                &run.id.to_string(),
                "cat /work/repo/small/1 >/dev/null",
            )
            .await?;
            starts.push(started.elapsed());
            ensure!(
                run.warm.as_ref().is_some_and(|w| w.booted),
                "the warm run did not start from the template"
            );
            daemon.delete_run(run.id).await?;
            let (took, id) = first_exec(daemon, crate::daemon::IMAGE).await?;
            cold.push(took);
            daemon.delete_run(id.parse()?).await?;
            cps.push(cp_a(&tree, &copy)?);
        }
        daemon.client.warm_invalidate(&repo).await?;
        rows.push(WarmRow {
            mib,
            files: commit.template.files,
            commit_ms,
            start: summarize(&starts).context("no samples")?,
            cp: summarize(&cps).context("no samples")?,
        });
    }
    Ok((rows, summarize(&cold).context("no samples")?))
}

/// The phase as markdown.
pub fn markdown(r: &SnapshotReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\n## Snapshots and forks ({}, {} iterations per series)\n",
        r.runtime, r.iterations
    );
    let _ = writeln!(
        out,
        "Snapshot: `POST /v1/runs/{{id}}/snapshot` after the run wrote N MiB of random data to \
         /work, client-side; frozen: the window the server reports; `cp -a`: of the same upper \
         directory to the same filesystem; btrfs: `btrfs subvolume snapshot -r` of the run's \
         disk subvolume (a process of its own, so it includes a fork and exec).\n"
    );
    let _ = writeln!(
        out,
        "| MiB changed | snapshot p50 ms | p95 ms | frozen p50 ms | btrfs snapshot p50 ms | `cp -a` p50 ms | snapshot ÷ btrfs | snapshot ÷ `cp -a` |"
    );
    let _ = writeln!(out, "|--:|--:|--:|--:|--:|--:|--:|--:|");
    for row in &r.dirty {
        let _ = writeln!(
            out,
            "| {} | {:.2} | {:.2} | {:.3} | {:.2} | {:.2} | {:.2}× | {:.2}× |",
            row.mib,
            row.snapshot.p50_ms,
            row.snapshot.p95_ms,
            row.frozen.p50_ms,
            row.btrfs.p50_ms,
            row.cp.p50_ms,
            row.snapshot.p50_ms / row.btrfs.p50_ms,
            row.snapshot.p50_ms / row.cp.p50_ms
        );
    }
    let _ = writeln!(
        out,
        "\n| 1 MiB changed, image | image MiB over busybox | snapshot p50 ms | p95 ms |\n|---|--:|--:|--:|"
    );
    for (label, mib, s) in &r.by_image {
        let _ = writeln!(
            out,
            "| {label} | {mib} | {:.2} | {:.2} |",
            s.p50_ms, s.p95_ms
        );
    }
    let _ = writeln!(
        out,
        "\n| start (create + first exec) | n | p50 ms | p95 ms | ÷ cold |\n|---|--:|--:|--:|--:|"
    );
    for (label, s) in [
        ("from a snapshot (10 MiB changed)", &r.start_from_snapshot),
        ("cold, from its base image", &r.cold_start),
    ] {
        let _ = writeln!(
            out,
            "| {label} | {} | {:.2} | {:.2} | {:.2}× |",
            s.n,
            s.p50_ms,
            s.p95_ms,
            s.p50_ms / r.cold_start.p50_ms
        );
    }
    let _ = writeln!(
        out,
        "\n| fork of | n | p50 ms | p95 ms | p50 per child ms |\n|--:|--:|--:|--:|--:|"
    );
    for (count, s) in &r.forks {
        let _ = writeln!(
            out,
            "| {count} | {} | {:.2} | {:.2} | {:.2} |",
            s.n,
            s.p50_ms,
            s.p95_ms,
            s.p50_ms / *count as f64
        );
    }
    if !r.warm.is_empty() {
        let _ = writeln!(
            out,
            "\nWarm start: create with `warm: {{repo}}` + a first exec reading a template file; \
             cold: create + first exec without a volume, in the same loop (p50 {:.2} ms); \
             `cp -a`: of the template on the same filesystem, what copying it into each run would \
             cost; commit: the one `warm-commit` that made the template.\n",
            r.warm_cold.p50_ms
        );
        let _ = writeln!(
            out,
            "| template MiB | files | commit ms | warm start p50 ms | p95 ms | ÷ cold | `cp -a` p50 ms |\n|--:|--:|--:|--:|--:|--:|--:|"
        );
        for row in &r.warm {
            let _ = writeln!(
                out,
                "| {} | {} | {:.0} | {:.2} | {:.2} | {:.2}× | {:.2} |",
                row.mib,
                row.files,
                row.commit_ms,
                row.start.p50_ms,
                row.start.p95_ms,
                row.start.p50_ms / r.warm_cold.p50_ms,
                row.cp.p50_ms
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::stats::summary_of_ms as ms;

    #[test]
    fn the_tables_show_ratios_to_the_floor_and_per_child_costs() {
        let report = SnapshotReport {
            runtime: "crun".into(),
            iterations: 2,
            dirty: vec![DirtyRow {
                mib: 10,
                snapshot: ms(&[40, 40]),
                frozen: ms(&[1, 1]),
                cp: ms(&[10, 10]),
                btrfs: ms(&[8, 8]),
            }],
            by_image: vec![("big".into(), 200, ms(&[9, 9]))],
            start_from_snapshot: ms(&[55, 55]),
            cold_start: ms(&[50, 50]),
            forks: vec![(4, ms(&[100, 100]))],
            warm: vec![WarmRow {
                mib: 100,
                files: 2101,
                commit_ms: 900.0,
                start: ms(&[60, 60]),
                cp: ms(&[300, 300]),
            }],
            warm_cold: ms(&[50, 50]),
        };
        let text = markdown(&report);
        assert!(
            text.contains("| 10 | 40.00 | 40.00 | 1.000 | 8.00 | 10.00 | 5.00× | 4.00× |"),
            "{text}"
        );
        assert!(text.contains("| from a snapshot (10 MiB changed) | 2 | 55.00 | 55.00 | 1.10× |"));
        assert!(
            text.contains("| 4 | 2 | 100.00 | 100.00 | 25.00 |"),
            "{text}"
        );
        assert!(
            text.contains("| 100 | 2101 | 900 | 60.00 | 60.00 | 1.20× | 300.00 |"),
            "{text}"
        );
    }
}
