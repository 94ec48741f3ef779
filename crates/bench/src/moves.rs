//! The moves phase: what moving a run between two nodes of a fleet costs,
//! next to a cold create in the same loop. Two nodes join a private
//! PostgreSQL server and share the S3 bucket `RUNBOX_BENCH_S3_STORE`
//! names (`scripts/bench-s3` starts one on loopback).

use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use runbox_fleet::testing::PgServer;
use serde::Serialize;

use crate::daemon::{exec_true, Daemon};
use crate::stats::{summarize, Summary};

/// What each moved run has written (MiB), so the archive carries that much.
pub const CHANGED_MIB: u64 = 100;

/// Runs a drain moves away.
pub const DRAINED_RUNS: usize = 20;

/// The phase's results.
#[derive(Clone, Debug, Serialize)]
pub struct MovesReport {
    /// The runtime of the daemons measured.
    pub runtime: String,
    /// The bucket both nodes use.
    pub store: String,
    /// A run that wrote [`CHANGED_MIB`] moved from node 1 to node 2, from
    /// the move's call to its first exec's end there.
    pub move_to_exec: Summary,
    /// Of that, the move call (archive on node 1, restore and boot on node
    /// 2).
    pub move_call: Summary,
    /// A cold create and its first exec on node 2, in the same loop.
    pub create_to_exec: Summary,
    /// An archived run of node 1 (that wrote [`CHANGED_MIB`]) woken by an
    /// exec sent through node 2, to that exec's end.
    pub wake_through: Summary,
    /// The same, sent to node 1 itself.
    pub wake_direct: Summary,
    /// `drain --migrate` of a node holding [`DRAINED_RUNS`] idle runs,
    /// each time the whole call.
    pub drain: Summary,
}

/// Starts node `node` on `pg` with checkpoint store `store` (the fleet
/// phase's nodes, with the bucket).
async fn join(
    pg: &PgServer,
    runbox: &Path,
    agent: &Path,
    runtime: &str,
    node: &str,
    store: &str,
) -> anyhow::Result<Daemon> {
    crate::fleet::join(
        pg,
        runbox,
        agent,
        runtime,
        node,
        &["--checkpoint-store", store],
    )
    .await
}

/// A run on `daemon` that has written [`CHANGED_MIB`] MiB to its disk.
async fn changed_run(daemon: &mut Daemon) -> anyhow::Result<String> {
    let run = daemon.create_run().await?;
    let id = run.id.to_string();
    let req = runbox_types::ExecRequest {
        cmd: vec![
            "sh".into(),
            "-c".into(),
            format!("head -c {} /dev/urandom > /work/changed", CHANGED_MIB << 20),
        ],
        ..Default::default()
    };
    let out = daemon
        .client
        .exec(&id, &req)
        .await?
        .collect_output()
        .await?;
    anyhow::ensure!(out.exit.exit_code == 0, "writing the run's data failed");
    Ok(id)
}

/// Runs the phase with `runtime`; its nodes and database are started and
/// stopped here. Needs `RUNBOX_BENCH_S3_STORE`.
pub async fn measure(
    runbox: &Path,
    agent: &Path,
    runtime: &str,
    tar: Vec<u8>,
    iterations: usize,
    warmup: usize,
) -> anyhow::Result<MovesReport> {
    let store = std::env::var("RUNBOX_BENCH_S3_STORE")
        .ok()
        .filter(|s| s.starts_with("s3://"))
        .context(
            "the moves phase needs RUNBOX_BENCH_S3_STORE (an s3:// bucket the nodes share); \
             run it under scripts/bench-s3",
        )?;
    let pg = tokio::task::spawn_blocking(PgServer::start)
        .await
        .context("starting PostgreSQL")?;
    let mut from = join(&pg, runbox, agent, runtime, "n1", &store).await?;
    let mut to = match join(&pg, runbox, agent, runtime, "n2", &store).await {
        Ok(to) => to,
        Err(e) => {
            from.shutdown().await;
            return Err(e);
        }
    };
    let measured = async {
        from.import(tar.clone()).await?;
        to.import(tar).await?;
        let mut moved = [Vec::new(), Vec::new(), Vec::new()];
        let mut wake = [Vec::new(), Vec::new()];
        for round in 0..warmup.min(2) + iterations {
            let keep = round >= warmup.min(2);
            // A move to node 2 and its first exec there.
            let id = changed_run(&mut from).await?;
            let started = Instant::now();
            from.client.move_run(&id, Some("n2".into())).await?;
            let called = started.elapsed();
            exec_true(&to.client, &id).await?;
            let took = started.elapsed();
            to.client.delete_run(&id).await?;
            // A cold create and its first exec, beside it.
            let started = Instant::now();
            let made = to.create_run().await?;
            exec_true(&to.client, &made.id.to_string()).await?;
            let cold = started.elapsed();
            to.delete_run(made.id).await?;
            if keep {
                moved[0].push(took);
                moved[1].push(called);
                moved[2].push(cold);
            }
            // Wakes of an archived run, through node 2 and directly, in
            // turn.
            for k in [round % 2, (round + 1) % 2] {
                let id = changed_run(&mut from).await?;
                from.client.archive_run(&id).await?;
                let via = match k {
                    0 => &to.client,
                    _ => &from.client,
                };
                let started = Instant::now();
                exec_true(via, &id).await?;
                let took = started.elapsed();
                from.client.delete_run(&id).await?;
                if keep {
                    wake[k].push(took);
                }
            }
        }
        // Drains of a node holding DRAINED_RUNS idle runs, moved to the
        // other; back again for the next round.
        let mut drains = Vec::new();
        for round in 0..iterations.clamp(1, 3) {
            let (source, _) = match round % 2 {
                0 => (&mut from, &mut to),
                _ => (&mut to, &mut from),
            };
            for _ in 0..DRAINED_RUNS {
                source.create_run().await?;
            }
            let started = Instant::now();
            let list = source.client.drain_migrate().await?;
            drains.push(started.elapsed());
            let report = list.migrated.context("the drain moved nothing")?;
            anyhow::ensure!(
                report.failed.is_empty() && report.moved.len() == DRAINED_RUNS,
                "the drain left {} runs",
                report.failed.len()
            );
            source.client.set_draining(false).await?;
            for moved in &report.moved {
                source.client.delete_run(&moved.id.to_string()).await?;
            }
        }
        for daemon in [&from, &to] {
            for run in daemon.client.list_runs().await?.runs {
                let _ = daemon.client.delete_run(&run.id.to_string()).await;
            }
        }
        let summary = |s: &[Duration]| summarize(s).context("no samples");
        Ok::<_, anyhow::Error>(MovesReport {
            runtime: runtime.to_owned(),
            store: store.clone(),
            move_to_exec: summary(&moved[0])?,
            move_call: summary(&moved[1])?,
            create_to_exec: summary(&moved[2])?,
            wake_through: summary(&wake[0])?,
            wake_direct: summary(&wake[1])?,
            drain: summary(&drains)?,
        })
    }
    .await;
    from.shutdown().await;
    to.shutdown().await;
    drop(pg);
    measured
}

/// The phase as markdown.
pub fn markdown(r: &MovesReport) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "\n## Runs that move ({})\n", r.runtime);
    let _ = writeln!(
        out,
        "Two nodes of a fleet on one PostgreSQL server, both using the bucket `{}` (SeaweedFS on \
         loopback) as their checkpoint store. Each moved or woken run first wrote {CHANGED_MIB} \
         MiB of random bytes to its disk; moves and cold creates alternate in one loop, wakes \
         through the other node and on the run's own node in turn.\n",
        r.store
    );
    let _ = writeln!(
        out,
        "| case | n | p50 ms | p95 ms | ÷ cold create |\n|---|--:|--:|--:|--:|"
    );
    let base = r.create_to_exec.p50_ms;
    for (name, s) in [
        ("cold create + first exec (node 2)", &r.create_to_exec),
        ("move n1 → n2 + first exec there", &r.move_to_exec),
        ("of that, the move call", &r.move_call),
        (
            "wake of an archived run by an exec through node 2",
            &r.wake_through,
        ),
        (
            "wake of an archived run by an exec to its node",
            &r.wake_direct,
        ),
    ] {
        let _ = writeln!(
            out,
            "| {name} | {} | {:.1} | {:.1} | {:.2}× |",
            s.n,
            s.p50_ms,
            s.p95_ms,
            s.p50_ms / base
        );
    }
    let _ = writeln!(
        out,
        "\n`runbox drain --migrate` of a node holding {DRAINED_RUNS} idle runs (four moves at a \
         time): p50 {:.0} ms over {} drains ({:.0} ms a run).",
        r.drain.p50_ms,
        r.drain.n,
        r.drain.p50_ms / DRAINED_RUNS as f64
    );
    out
}
