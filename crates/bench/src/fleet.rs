//! The fleet phase: what a request for a run costs when it is sent
//! through a node of the fleet that does not hold the run, next to the
//! same request sent to the node that does, and what a create costs on a
//! node of a fleet next to a node alone. Two nodes join a private
//! PostgreSQL server (Debian's, started here in a temporary directory);
//! a third daemon has no cluster.

use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use runbox_fleet::testing::PgServer;
use serde::Serialize;

use crate::daemon::{exec_true, Daemon};
use crate::stats::{summarize, Summary};

/// The phase's results.
#[derive(Clone, Debug, Serialize)]
pub struct FleetReport {
    /// The runtime of the daemons measured.
    pub runtime: String,
    /// Exec of `/bin/true` sent to the node that holds the run.
    pub exec_direct: Summary,
    /// The same, sent through the other node.
    pub exec_through: Summary,
    /// `GET /v1/runs/{id}` to the node that holds the run.
    pub get_direct: Summary,
    /// The same through the other node.
    pub get_through: Summary,
    /// Create and delete of a run on a node of the fleet.
    pub create_fleet: Summary,
    /// Create and delete on a node alone.
    pub create_alone: Summary,
    /// `GET /v1/runs` of a node of the fleet (the catalog read).
    pub list_fleet: Summary,
    /// `GET /v1/runs` of a node alone.
    pub list_alone: Summary,
}

/// The cluster key of the phase's fleet.
const KEY: &str = "runbox-bench-fleet-key-of-at-least-32-bytes";

/// A node of the fleet in `pg` named `node`.
async fn join(
    pg: &PgServer,
    runbox: &Path,
    agent: &Path,
    runtime: &str,
    node: &str,
) -> anyhow::Result<Daemon> {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").context("a probe port")?;
        l.local_addr()?.port()
    };
    let listen = format!("127.0.0.1:{port}");
    let flags: Vec<String> = [
        "--cluster-db",
        &pg.url(),
        "--node-id",
        node,
        "--advertise",
        &listen,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let env = [
        ("RUNBOX_CLUSTER_KEY", KEY),
        ("RUNBOX_CLUSTER_DB_PASSWORD", pg.password.as_str()),
    ];
    Daemon::start_listening(runbox, agent, runtime, &listen, &flags, &env).await
}

/// Times `f` once.
async fn timed<T>(
    f: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<Duration> {
    let started = Instant::now();
    f.await?;
    Ok(started.elapsed())
}

/// Runs the phase with `alone`, a daemon without a cluster (the exec
/// phase's); the fleet's two nodes and its database are started and
/// stopped here.
pub async fn measure(
    alone: &mut Daemon,
    runbox: &Path,
    agent: &Path,
    tar: Vec<u8>,
    iterations: usize,
    create_iterations: usize,
    warmup: usize,
) -> anyhow::Result<FleetReport> {
    let runtime = alone.runtime.clone();
    let pg = tokio::task::spawn_blocking(PgServer::start)
        .await
        .context("starting PostgreSQL")?;
    let mut holder = join(&pg, runbox, agent, &runtime, "n1").await?;
    let other = match join(&pg, runbox, agent, &runtime, "n2").await {
        Ok(other) => other,
        Err(e) => {
            holder.shutdown().await;
            return Err(e);
        }
    };
    let measured = async {
        holder.import(tar.clone()).await?;
        other.import(tar).await?;
        let run = holder.create_run().await?;
        let id = run.id.to_string();
        // The catalog is written behind: wait until the other node finds it.
        let deadline = Instant::now() + Duration::from_secs(30);
        while other.client.get_run(&id).await.is_err() {
            anyhow::ensure!(
                Instant::now() < deadline,
                "the other node never found the run"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let mut exec = [Vec::new(), Vec::new()];
        let mut get = [Vec::new(), Vec::new()];
        for round in 0..warmup + iterations {
            for (k, daemon) in [&holder, &other].into_iter().enumerate() {
                let took = exec_true(&daemon.client, &id).await?;
                let read = timed(async { Ok(daemon.client.get_run(&id).await?) }).await?;
                if round >= warmup {
                    exec[k].push(took);
                    get[k].push(read);
                }
            }
        }
        let mut create = [Vec::new(), Vec::new()];
        let mut list = [Vec::new(), Vec::new()];
        for round in 0..warmup.min(3) + create_iterations {
            for (k, daemon) in [&mut holder, &mut *alone].into_iter().enumerate() {
                let started = Instant::now();
                let made = daemon.create_run().await?;
                let took = started.elapsed();
                daemon.delete_run(made.id).await?;
                let listed = timed(async { Ok(daemon.client.list_runs().await?) }).await?;
                if round >= warmup.min(3) {
                    create[k].push(took);
                    list[k].push(listed);
                }
            }
        }
        holder.delete_run(run.id).await?;
        let summary = |s: &[Duration]| summarize(s).context("no samples");
        Ok::<_, anyhow::Error>(FleetReport {
            runtime: runtime.clone(),
            exec_direct: summary(&exec[0])?,
            exec_through: summary(&exec[1])?,
            get_direct: summary(&get[0])?,
            get_through: summary(&get[1])?,
            create_fleet: summary(&create[0])?,
            create_alone: summary(&create[1])?,
            list_fleet: summary(&list[0])?,
            list_alone: summary(&list[1])?,
        })
    }
    .await;
    holder.shutdown().await;
    other.shutdown().await;
    drop(pg);
    measured
}

/// The phase as markdown.
pub fn markdown(r: &FleetReport) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "\n## A fleet of two nodes ({})\n", r.runtime);
    let _ = writeln!(
        out,
        "Two daemons on one PostgreSQL server (both on this machine, loopback); the run is on \
         node 1. Requests sent to node 1 directly and through node 2 are interleaved in one \
         loop; creates (each followed by its delete, untimed) on node 1 and on a daemon without \
         a cluster likewise, each followed by a timed `GET /v1/runs`.\n"
    );
    let _ = writeln!(
        out,
        "| request | n | p50 ms | p95 ms | p50 − direct ms | ÷ direct |\n|---|--:|--:|--:|--:|--:|"
    );
    for (name, s, base) in [
        (
            "exec `/bin/true`, to the run's node",
            &r.exec_direct,
            &r.exec_direct,
        ),
        (
            "exec `/bin/true`, through the other node",
            &r.exec_through,
            &r.exec_direct,
        ),
        (
            "`GET /v1/runs/{id}`, to the run's node",
            &r.get_direct,
            &r.get_direct,
        ),
        (
            "`GET /v1/runs/{id}`, through the other node",
            &r.get_through,
            &r.get_direct,
        ),
        ("create, a daemon alone", &r.create_alone, &r.create_alone),
        (
            "create, a node of the fleet",
            &r.create_fleet,
            &r.create_alone,
        ),
        (
            "`GET /v1/runs`, a daemon alone",
            &r.list_alone,
            &r.list_alone,
        ),
        (
            "`GET /v1/runs`, a node of the fleet (catalog)",
            &r.list_fleet,
            &r.list_alone,
        ),
    ] {
        let _ = writeln!(
            out,
            "| {name} | {} | {:.2} | {:.2} | {:+.2} | {:.2}× |",
            s.n,
            s.p50_ms,
            s.p95_ms,
            s.p50_ms - base.p50_ms,
            s.p50_ms / base.p50_ms
        );
    }
    out
}
