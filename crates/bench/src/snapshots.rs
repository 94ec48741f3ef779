//! The snapshots phase: what a snapshot costs against the bytes a run
//! changed (next to `cp -a` of the same upper directory, the floor for any
//! copy), how long the run is frozen, what starting from a snapshot costs
//! next to a cold start from its base image, and what a fork of 1, 4 and 16
//! costs.
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
        let (mut snaps, mut frozen, mut cps) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..iterations {
            let started = Instant::now();
            let snap = daemon.client.snapshot_run(&id, None).await?;
            snaps.push(started.elapsed());
            frozen.push(Duration::from_secs_f64(snap.frozen_ms / 1e3));
            daemon.client.delete_snapshot(&snap.image).await?;
            cps.push(cp_a(&upper, &copy)?);
        }
        daemon.delete_run(run.id).await?;
        dirty.push(DirtyRow {
            mib,
            snapshot: summarize(&snaps).context("no samples")?,
            frozen: summarize(&frozen).context("no samples")?,
            cp: summarize(&cps).context("no samples")?,
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
    Ok(SnapshotReport {
        runtime: daemon.runtime.clone(),
        iterations,
        dirty,
        by_image,
        start_from_snapshot: summarize(&warm).context("no samples")?,
        cold_start: summarize(&cold).context("no samples")?,
        forks,
    })
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
         directory to the same filesystem.\n"
    );
    let _ = writeln!(
        out,
        "| MiB changed | snapshot p50 ms | p95 ms | frozen p50 ms | `cp -a` p50 ms | snapshot ÷ `cp -a` |"
    );
    let _ = writeln!(out, "|--:|--:|--:|--:|--:|--:|");
    for row in &r.dirty {
        let _ = writeln!(
            out,
            "| {} | {:.2} | {:.2} | {:.3} | {:.2} | {:.2}× |",
            row.mib,
            row.snapshot.p50_ms,
            row.snapshot.p95_ms,
            row.frozen.p50_ms,
            row.cp.p50_ms,
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
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: &[u64]) -> Summary {
        let samples: Vec<Duration> = v.iter().map(|&m| Duration::from_millis(m)).collect();
        summarize(&samples).unwrap()
    }

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
            }],
            by_image: vec![("big".into(), 200, ms(&[9, 9]))],
            start_from_snapshot: ms(&[55, 55]),
            cold_start: ms(&[50, 50]),
            forks: vec![(4, ms(&[100, 100]))],
        };
        let text = markdown(&report);
        assert!(
            text.contains("| 10 | 40.00 | 40.00 | 1.000 | 10.00 | 4.00× |"),
            "{text}"
        );
        assert!(text.contains("| from a snapshot (10 MiB changed) | 2 | 55.00 | 55.00 | 1.10× |"));
        assert!(
            text.contains("| 4 | 2 | 100.00 | 100.00 | 25.00 |"),
            "{text}"
        );
    }
}
