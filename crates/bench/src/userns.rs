//! The userns phase: what a user namespace per run costs. Per runtime, the
//! run phases' daemon (whose runs get user namespaces: `--userns auto` on a
//! host that can) next to a daemon started with `--userns off`, the cases
//! interleaved in one loop, the order of the two daemons swapped every
//! round:
//!
//! - create + first exec: `POST /v1/runs`, then `/bin/true` until its exit
//!   event (the DELETE is not timed). With a user namespace a create also
//!   makes and pins the namespace, maps each image layer with an idmapped
//!   mount and chowns the empty writable layer;
//! - exec round trip of `/bin/true` in a running run;
//! - fork + first exec of a run that wrote [`FORK_FILES`] files: `POST
//!   .../fork` of one child, then `/bin/true` in it (the DELETE not timed).
//!   With a user namespace the child's writable layer is moved into its own
//!   range, a walk over the files the parent wrote.

use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use runbox_types::{ExecRequest, ForkRequest};
use serde::Serialize;

use crate::daemon::{exec_true, Daemon};
use crate::stats::{summarize, Summary};

/// Files the fork's parent writes before the fork cases.
pub const FORK_FILES: usize = 1000;

/// One runtime's results.
#[derive(Clone, Debug, Serialize)]
pub struct UsernsRuntime {
    /// The runtime of both daemons.
    pub runtime: String,
    /// Create + first exec, user namespaces on.
    pub create_on: Summary,
    /// The same, `--userns off`.
    pub create_off: Summary,
    /// Exec round trip, on.
    pub exec_on: Summary,
    /// Exec round trip, off.
    pub exec_off: Summary,
    /// Fork + first exec of a run with [`FORK_FILES`] files written, on.
    pub fork_on: Summary,
    /// The same, off.
    pub fork_off: Summary,
}

/// The phase's results.
#[derive(Clone, Debug, Serialize)]
pub struct UsernsReport {
    /// Files the forked run had written.
    pub fork_files: usize,
    /// One entry per runtime.
    pub runtimes: Vec<UsernsRuntime>,
}

/// Create + first exec on `daemon`; the run is deleted untimed.
async fn create_case(daemon: &mut Daemon) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let run = daemon.create_run().await?;
    exec_true(&daemon.client, &run.id.to_string()).await?;
    let took = started.elapsed();
    daemon.delete_run(run.id).await?;
    Ok(took)
}

/// Fork of `parent` + first exec in the child; the child is deleted
/// untimed.
async fn fork_case(daemon: &mut Daemon, parent: &str) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let forked = daemon
        .client
        .fork_run(
            parent,
            &ForkRequest {
                count: 1,
                ..Default::default()
            },
        )
        .await
        .with_context(|| format!("forking; log:\n{}", daemon.log_tail()))?;
    let child = forked.runs.first().context("a fork without a child")?.id;
    daemon.remember(child);
    exec_true(&daemon.client, &child.to_string()).await?;
    let took = started.elapsed();
    daemon.delete_run(child).await?;
    Ok(took)
}

/// A run on `daemon` that wrote [`FORK_FILES`] small files in 10
/// directories.
async fn fork_parent(daemon: &mut Daemon) -> anyhow::Result<String> {
    let id = daemon.create_run().await?.id.to_string();
    let script = format!(
        "for d in 0 1 2 3 4 5 6 7 8 9; do mkdir -p /work/tree/$d; i=0; \
         while [ $i -lt {} ]; do echo $i > /work/tree/$d/f$i; i=$((i+1)); done; done",
        FORK_FILES / 10
    );
    let out = daemon
        .client
        .exec(
            &id,
            &ExecRequest {
                cmd: vec!["sh".into(), "-c".into(), script],
                ..Default::default()
            },
        )
        .await?
        .collect_output()
        .await?;
    ensure!(out.exit.exit_code == 0, "writing the files failed");
    Ok(id)
}

/// Measures `on` (a daemon whose runs get user namespaces) against a
/// `--userns off` daemon of the same runtime started and stopped here.
pub async fn measure(
    on: &mut Daemon,
    runbox: &Path,
    agent: &Path,
    tar: Vec<u8>,
    iterations: usize,
    exec_iterations: usize,
    warmup: usize,
) -> anyhow::Result<UsernsRuntime> {
    let runtime = on.runtime.clone();
    let mode = on.client.info().await?.userns;
    ensure!(
        mode == "private",
        "the {runtime} daemon's runs have no user namespaces (userns {mode:?}): this host \
         cannot make them, so there is nothing to compare"
    );
    let flags = ["--userns".to_owned(), "off".to_owned()];
    let mut off = Daemon::start_with(runbox, agent, &runtime, &flags).await?;
    let measured = async {
        ensure!(
            off.client.info().await?.userns == "off",
            "--userns off ignored"
        );
        off.import(tar).await?;
        let mut create: [Vec<Duration>; 2] = Default::default();
        let mut exec: [Vec<Duration>; 2] = Default::default();
        let mut fork: [Vec<Duration>; 2] = Default::default();
        let runs = [
            on.create_run().await?.id.to_string(),
            off.create_run().await?.id.to_string(),
        ];
        for round in 0..warmup + exec_iterations {
            for k in order(round) {
                let client = if k == 0 { &on.client } else { &off.client };
                let took = exec_true(client, &runs[k]).await?;
                if round >= warmup {
                    exec[k].push(took);
                }
            }
        }
        for round in 0..warmup + iterations {
            for k in order(round) {
                let daemon = if k == 0 { &mut *on } else { &mut off };
                let took = create_case(daemon).await?;
                if round >= warmup {
                    create[k].push(took);
                }
            }
        }
        let parents = [fork_parent(on).await?, fork_parent(&mut off).await?];
        for round in 0..warmup + iterations {
            for k in order(round) {
                let daemon = if k == 0 { &mut *on } else { &mut off };
                let took = fork_case(daemon, &parents[k]).await?;
                if round >= warmup {
                    fork[k].push(took);
                }
            }
        }
        let summary = |s: &[Duration]| summarize(s).context("no samples");
        Ok::<_, anyhow::Error>(UsernsRuntime {
            runtime: runtime.clone(),
            create_on: summary(&create[0])?,
            create_off: summary(&create[1])?,
            exec_on: summary(&exec[0])?,
            exec_off: summary(&exec[1])?,
            fork_on: summary(&fork[0])?,
            fork_off: summary(&fork[1])?,
        })
    }
    .await;
    off.shutdown().await;
    measured
}

/// Which daemon goes first: swapped every round, so drift on a noisy host
/// falls on both alike.
fn order(round: usize) -> [usize; 2] {
    if round.is_multiple_of(2) {
        [0, 1]
    } else {
        [1, 0]
    }
}

/// The phase as markdown.
pub fn markdown(r: &UsernsReport) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "\n## User namespaces: on against off\n");
    let _ = writeln!(
        out,
        "Per runtime, a daemon whose runs get a user namespace of their own (the default) and \
         one started with `--userns off`, the cases interleaved, the daemons' order swapped \
         every round. Create and fork each end when `/bin/true` has run in the new run (its \
         DELETE untimed); the forked run had written {} files.\n",
        r.fork_files
    );
    let _ = writeln!(
        out,
        "| case | runtime | n | on p50 ms | off p50 ms | on ÷ off | on p95 ms | off p95 ms |\n\
         |---|---|--:|--:|--:|--:|--:|--:|"
    );
    for rt in &r.runtimes {
        for (name, on, off) in [
            ("create + first exec", &rt.create_on, &rt.create_off),
            ("exec round trip", &rt.exec_on, &rt.exec_off),
            ("fork + first exec", &rt.fork_on, &rt.fork_off),
        ] {
            let _ = writeln!(
                out,
                "| {name} | {} | {} | {:.2} | {:.2} | {:.2}× | {:.2} | {:.2} |",
                rt.runtime,
                on.n,
                on.p50_ms,
                off.p50_ms,
                on.p50_ms / off.p50_ms,
                on.p95_ms,
                off.p95_ms
            );
        }
    }
    out
}
