//! The checkpoints phase: what a checkpoint costs to upload and to bring
//! back against the bytes a run changed, on the directory store and (with
//! `RUNBOX_BENCH_S3_STORE`, see `scripts/bench-s3`) an S3 server on
//! loopback, as throughput; and what an archived run's restore costs up to
//! its first exec result, next to a cold create in the same loop.
//!
//! The data is random (incompressible), so the throughput is the pipeline's
//! (tar, zstd, SHA-256 twice, the store), not the compressor's luck. Where
//! Docker's engine is installed (`scripts/bench-docker`), `docker commit` of
//! a container that wrote the same bytes stands beside.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use runbox_types::{CheckpointRequest, CreateRunRequest, ExecRequest};
use serde::Serialize;

use crate::daemon::Daemon;
use crate::stats::{summarize, Summary};

/// MiB a run writes before each checkpoint series.
const DIRTY_MIB: [u64; 3] = [10, 100, 1000];

/// MiB an archived run changed in the archive series.
const ARCHIVE_MIB: u64 = 100;

/// One row of the throughput table.
#[derive(Clone, Debug, Serialize)]
pub struct ThroughputRow {
    /// The store: `directory` or `s3`.
    pub store: String,
    /// MiB the run wrote.
    pub mib: u64,
    /// Bytes of the run's disk layer as a tar.
    pub tar_bytes: u64,
    /// `POST /v1/runs/{id}/checkpoint`, client-side.
    pub checkpoint: Summary,
    /// `POST /v1/runs {checkpoint}` on a node without the layers, then the
    /// first exec.
    pub restore: Summary,
}

/// One row of the archive table.
#[derive(Clone, Debug, Serialize)]
pub struct ArchiveRow {
    /// The store.
    pub store: String,
    /// `POST /v1/runs/{id}/archive` of a running run.
    pub archive: Summary,
    /// The exec that restores it, until its exit event.
    pub restore_exec: Summary,
    /// Create + first exec of a new run, in the same loop.
    pub cold: Summary,
}

/// The phase's results.
#[derive(Clone, Debug, Serialize)]
pub struct CheckpointReport {
    /// The runtime of the daemons measured.
    pub runtime: String,
    /// Iterations per series.
    pub iterations: usize,
    /// Upload and restore by size and store.
    pub throughput: Vec<ThroughputRow>,
    /// Archive and restore-to-first-exec, by store.
    pub archive: Vec<ArchiveRow>,
    /// `docker commit` by MiB changed, where the engine is installed.
    pub docker_commit: Vec<(u64, Summary)>,
}

/// `docker commit` of a container that wrote N MiB, for each of
/// [`DIRTY_MIB`]; empty without the engine.
fn docker_commits(
    work: &std::path::Path,
    rootfs_tar: &std::path::Path,
    iterations: usize,
) -> anyhow::Result<Vec<(u64, Summary)>> {
    use crate::docker::Docker;
    if !Docker::available() {
        eprintln!(
            "runbox-bench: checkpoints: dockerd is not installed (scripts/bench-docker installs it); \
             no docker commit column"
        );
        return Ok(Vec::new());
    }
    let mut docker = Docker::start(&work.join("docker-commit"), rootfs_tar)?;
    let mut measured = || {
        let mut rows = Vec::new();
        for mib in DIRTY_MIB {
            eprintln!("runbox-bench: checkpoints: docker commit, {mib} MiB changed");
            let id = docker.idle_container()?;
            docker.run(&["exec", &id, "sh", "-c", &dirty(mib)])?;
            let mut samples = Vec::new();
            for n in 0..iterations {
                let image = format!("runbox-bench-commit:{mib}-{n}");
                samples.push(docker.timed(&["commit", &id, &image])?);
                docker.run(&["rmi", &image])?;
            }
            rows.push((mib, summarize(&samples).context("no samples")?));
        }
        Ok(rows)
    };
    let rows = measured();
    docker.shutdown();
    rows
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

fn dirty(mib: u64) -> String {
    format!("dd if=/dev/urandom of=/work/dirty bs=1M count={mib} 2>/dev/null; sync")
}

/// Checkpoint and restore series on `daemon`, whose store is `store`.
async fn throughput(
    daemon: &mut Daemon,
    store: &str,
    iterations: usize,
) -> anyhow::Result<Vec<ThroughputRow>> {
    let mut rows = Vec::new();
    for mib in DIRTY_MIB {
        eprintln!("runbox-bench: checkpoints: {store}, {mib} MiB changed");
        let run = daemon.create_run().await?;
        let id = run.id.to_string();
        sh(daemon, &id, &dirty(mib)).await?;
        let (mut ups, mut downs, mut tar_bytes) = (Vec::new(), Vec::new(), 0);
        for _ in 0..iterations {
            let started = Instant::now();
            let checkpoint = daemon
                .client
                .checkpoint_run(&id, &CheckpointRequest::default())
                .await?;
            ups.push(started.elapsed());
            tar_bytes = checkpoint.disk_bytes;
            let started = Instant::now();
            let restored = daemon
                .create_run_with(CreateRunRequest {
                    checkpoint: Some(checkpoint.id),
                    ..Default::default()
                })
                .await?;
            sh(daemon, &restored.id.to_string(), "test -s /work/dirty").await?;
            downs.push(started.elapsed());
            daemon.delete_run(restored.id).await?;
            // The next restore downloads again.
            let image = format!("ckpt-{}-1", checkpoint.id.to_string().to_ascii_lowercase());
            daemon.delete_image(&image).await?;
            daemon
                .client
                .delete_checkpoint(&checkpoint.id.to_string())
                .await?;
        }
        daemon.delete_run(run.id).await?;
        rows.push(ThroughputRow {
            store: store.to_owned(),
            mib,
            tar_bytes,
            checkpoint: summarize(&ups).context("no samples")?,
            restore: summarize(&downs).context("no samples")?,
        });
    }
    Ok(rows)
}

/// Archive series: a run that changed [`ARCHIVE_MIB`] is archived, then
/// restored by an exec, `iterations` times, with a cold create beside.
async fn archives(
    daemon: &mut Daemon,
    store: &str,
    iterations: usize,
) -> anyhow::Result<ArchiveRow> {
    eprintln!("runbox-bench: checkpoints: {store}, archive and restore");
    let run = daemon.create_run().await?;
    let id = run.id.to_string();
    sh(daemon, &id, &dirty(ARCHIVE_MIB)).await?;
    let (mut archives, mut restores, mut colds) = (Vec::new(), Vec::new(), Vec::new());
    for n in 0..iterations {
        if n > 0 {
            // New bytes each time: the restore downloads them (what it
            // restored before is on the node, and is reused).
            sh(daemon, &id, &dirty(ARCHIVE_MIB)).await?;
        }
        let started = Instant::now();
        let archived = daemon
            .client
            .archive_run(&id)
            .await
            .with_context(|| format!("archiving a run; log:\n{}", daemon.log_tail()))?;
        archives.push(started.elapsed());
        ensure!(
            archived.status == runbox_types::RunStatus::Archived,
            "the run is {:?}, not archived",
            archived.status
        );
        let started = Instant::now();
        sh(daemon, &id, "test -s /work/dirty")
            .await
            .with_context(|| format!("restoring a run; log:\n{}", daemon.log_tail()))?;
        restores.push(started.elapsed());
        let started = Instant::now();
        let cold = daemon.create_run().await?;
        sh(daemon, &cold.id.to_string(), "true").await?;
        colds.push(started.elapsed());
        daemon.delete_run(cold.id).await?;
    }
    daemon.delete_run(run.id).await?;
    Ok(ArchiveRow {
        store: store.to_owned(),
        archive: summarize(&archives).context("no samples")?,
        restore_exec: summarize(&restores).context("no samples")?,
        cold: summarize(&colds).context("no samples")?,
    })
}

/// Runs the phase: on `daemon` (the directory store), and on `s3` when
/// given (a daemon whose store is a bucket).
pub async fn measure(
    daemon: &mut Daemon,
    s3: Option<&mut Daemon>,
    iterations: usize,
    work: &std::path::Path,
    rootfs_tar: &std::path::Path,
) -> anyhow::Result<CheckpointReport> {
    let mut throughput_rows = throughput(daemon, "directory", iterations).await?;
    let mut archive_rows = vec![archives(daemon, "directory", iterations).await?];
    if let Some(s3) = s3 {
        throughput_rows.extend(throughput(s3, "s3", iterations).await?);
        archive_rows.push(archives(s3, "s3", iterations).await?);
    }
    let (work, tar) = (work.to_owned(), rootfs_tar.to_owned());
    let docker_commit =
        tokio::task::spawn_blocking(move || docker_commits(&work, &tar, iterations)).await??;
    Ok(CheckpointReport {
        runtime: daemon.runtime.clone(),
        iterations,
        throughput: throughput_rows,
        archive: archive_rows,
        docker_commit,
    })
}

fn mb_per_s(bytes: u64, took: &Summary) -> f64 {
    bytes as f64 / 1e6 / Duration::from_secs_f64(took.p50_ms / 1e3).as_secs_f64()
}

/// The phase as markdown.
pub fn markdown(r: &CheckpointReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\n## Checkpoints and archives ({}, {} iterations per series)\n",
        r.runtime, r.iterations
    );
    let _ = writeln!(
        out,
        "Checkpoint: `POST /v1/runs/{{id}}/checkpoint` after the run wrote N MiB of random data \
         (incompressible) to /work, client-side, until the commit object is written. Restore: \
         `POST /v1/runs {{checkpoint}}` on a node that does not have the layer (download, verify, \
         unpack, create) plus a first exec reading the file. MB/s: the disk layer's tar bytes \
         over the p50.\n"
    );
    let _ = writeln!(
        out,
        "| store | MiB changed | checkpoint p50 ms | p95 ms | MB/s | restore + first exec p50 ms | p95 ms | MB/s |\n|---|--:|--:|--:|--:|--:|--:|--:|"
    );
    for row in &r.throughput {
        let _ = writeln!(
            out,
            "| {} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} |",
            row.store,
            row.mib,
            row.checkpoint.p50_ms,
            row.checkpoint.p95_ms,
            mb_per_s(row.tar_bytes, &row.checkpoint),
            row.restore.p50_ms,
            row.restore.p95_ms,
            mb_per_s(row.tar_bytes, &row.restore),
        );
    }
    if !r.docker_commit.is_empty() {
        let _ = writeln!(
            out,
            "\n`docker commit` of a container (Docker's engine, its default storage driver) that \
             wrote the same N MiB, for comparison with a snapshot (constant) and a checkpoint \
             (which also uploads):\n\n| MiB changed | `docker commit` p50 ms | p95 ms |\n|--:|--:|--:|"
        );
        for (mib, s) in &r.docker_commit {
            let _ = writeln!(out, "| {mib} | {:.0} | {:.0} |", s.p50_ms, s.p95_ms);
        }
    }
    let _ = writeln!(
        out,
        "\nArchive: `POST /v1/runs/{{id}}/archive` of a running run that changed {ARCHIVE_MIB} MiB \
         (hibernate, upload, drop the disk). Restore: the next exec, which restores the run \
         (download, verify, a fresh disk, boot) and runs, until its exit event. Cold: create + \
         first exec of a new run, in the same loop.\n"
    );
    let _ = writeln!(
        out,
        "| store | archive p50 ms | restore + exec p50 ms | p95 ms | cold p50 ms | restore ÷ cold |\n|---|--:|--:|--:|--:|--:|"
    );
    for row in &r.archive {
        let _ = writeln!(
            out,
            "| {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.2}× |",
            row.store,
            row.archive.p50_ms,
            row.restore_exec.p50_ms,
            row.restore_exec.p95_ms,
            row.cold.p50_ms,
            row.restore_exec.p50_ms / row.cold.p50_ms
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::stats::summary_of_ms as ms;

    #[test]
    fn the_tables_show_throughput_and_the_ratio_to_a_cold_start() {
        let report = CheckpointReport {
            runtime: "crun".into(),
            iterations: 2,
            throughput: vec![ThroughputRow {
                store: "directory".into(),
                mib: 100,
                tar_bytes: 100_000_000,
                checkpoint: ms(&[500, 500]),
                restore: ms(&[1000, 1000]),
            }],
            archive: vec![ArchiveRow {
                store: "s3".into(),
                archive: ms(&[800, 800]),
                restore_exec: ms(&[1200, 1200]),
                cold: ms(&[100, 100]),
            }],
            docker_commit: vec![(10, ms(&[300, 300]))],
        };
        let text = markdown(&report);
        assert!(
            text.contains("| directory | 100 | 500 | 500 | 200 | 1000 | 1000 | 100 |"),
            "{text}"
        );
        assert!(
            text.contains("| s3 | 800 | 1200 | 1200 | 100 | 12.00× |"),
            "{text}"
        );
        assert!(text.contains("| 10 | 300 | 300 |"), "{text}");
    }
}
