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
    /// Create sent to a third node of the fleet without room
    /// (`--max-runs 0`), which places it on one of the others and relays
    /// the answer.
    pub create_relayed: Summary,
    /// `GET /v1/runs` of a node of the fleet (the catalog read).
    pub list_fleet: Summary,
    /// `GET /v1/runs` of a node alone.
    pub list_alone: Summary,
    /// The database's part of a create by a tenant with an idempotency
    /// key: placement, the key and the tenant's count, one after another.
    pub db_create: Summary,
    /// Of that, the placement query (two nodes).
    pub db_place: Summary,
    /// Of that, taking the key.
    pub db_key: Summary,
    /// Of that, the tenant's count.
    pub db_admit: Summary,
    /// Of that, the run's catalog row, written before the create answers.
    pub db_catalog: Summary,
    /// Placement with this many more nodes' rows in the database.
    pub many_nodes: usize,
    /// The placement query with [`FleetReport::many_nodes`] rows.
    pub db_place_many: Summary,
}

/// The database's part of a create, measured on a node joined here (no
/// daemon): placement, the idempotency key, the tenant's count and the
/// run's catalog row (a copy of `sample` under a new id), each timed, `iterations` times; then placement again with `many` more
/// nodes' rows (fresh, with room, a third storing the image).
async fn database_share(
    pg: &PgServer,
    tenant: &str,
    sample: &runbox_types::Run,
    iterations: usize,
    many: usize,
) -> anyhow::Result<[Vec<Duration>; 6]> {
    use runbox_core::fleet::{Fleet, Want};
    let cluster = pg
        .probe("probe", KEY.as_bytes(), 1_000_000)
        .await
        .map_err(|e| anyhow::anyhow!("joining the probe node: {e}"))?;
    let want = Want {
        images: vec!["bench".into(), "docker.io/library/bench:latest".into()],
        pullable: true,
        tenant: Some(tenant.to_owned()),
        here: "probe".into(),
        here_full: false,
        here_has: (false, false),
        volumes: Vec::new(),
        here_has_volumes: true,
        checkpoint_store: None,
        needs: Vec::new(),
        here_can: true,
    };
    let ledger = cluster.ledger();
    let mut out: [Vec<Duration>; 6] = Default::default();
    // Newer than any count a node wrote before.
    let seq0 = u64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_micros(),
    )?;
    for i in 0..iterations {
        let run = ulid::Ulid::new();
        let key = runbox_core::store::Idempotency {
            key: format!("bench-{run}"),
            request: "digest".into(),
            tenant: Some(tenant.to_owned()),
        };
        let started = Instant::now();
        cluster.place(&want).await?;
        let placed = started.elapsed();
        ledger.take_key(&key, run).await?;
        let keyed = started.elapsed();
        ledger.admit(tenant, 1_000_000, 1, seq0 + i as u64).await?;
        let admitted = started.elapsed();
        // With a sealed record of the size a run's record seals to (about
        // 2 KiB of JSON, base64 after the cipher).
        let made = runbox_core::fleet::Published {
            run: runbox_types::Run {
                id: run,
                ..sample.clone()
            },
            record: Some(format!("v1:{}", "A".repeat(2800))),
        };
        cluster.record_run_now(&made).await?;
        let recorded = started.elapsed();
        out[0].push(recorded);
        out[1].push(placed);
        out[2].push(keyed - placed);
        out[3].push(admitted - keyed);
        out[5].push(recorded - admitted);
    }
    let add = format!(
        "INSERT INTO runbox_nodes (id, advertise, version, lane, incarnation, capacity, runs,          heartbeat, images) SELECT 'many-' || g, '127.0.0.1:9', 'bench', 'bench', 'bench', 256,          g % 200, now() + interval '1 hour',          CASE WHEN g % 3 = 0 THEN ARRAY['bench'] ELSE ARRAY['other'] END          FROM generate_series(1, {many}) g"
    );
    pg.psql(&add);
    for _ in 0..iterations {
        let started = Instant::now();
        cluster.place(&want).await?;
        out[4].push(started.elapsed());
    }
    pg.psql("DELETE FROM runbox_nodes WHERE id LIKE 'many-%'");
    cluster.leave().await;
    Ok(out)
}

/// How many nodes' rows placement is measured over.
const MANY_NODES: usize = 1000;

/// The cluster key of the phase's fleet.
const KEY: &str = "runbox-bench-fleet-key-of-at-least-32-bytes";

/// A node of the fleet in `pg` named `node`.
pub(crate) async fn join(
    pg: &PgServer,
    runbox: &Path,
    agent: &Path,
    runtime: &str,
    node: &str,
    extra: &[&str],
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
    .chain(extra)
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
    let mut holder = join(&pg, runbox, agent, &runtime, "n1", &[]).await?;
    let other = match join(&pg, runbox, agent, &runtime, "n2", &[]).await {
        Ok(other) => other,
        Err(e) => {
            holder.shutdown().await;
            return Err(e);
        }
    };
    // No room of its own: every create sent to it is made on n1 or n2.
    let mut relay = match join(&pg, runbox, agent, &runtime, "n3", &["--max-runs", "0"]).await {
        Ok(relay) => relay,
        Err(e) => {
            holder.shutdown().await;
            other.shutdown().await;
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
        let mut create = [Vec::new(), Vec::new(), Vec::new()];
        let mut list = [Vec::new(), Vec::new(), Vec::new()];
        for round in 0..warmup.min(3) + create_iterations {
            // Each goes first in turn, so none always follows the same
            // other's delete.
            let mut cases: Vec<(usize, &mut Daemon)> =
                vec![(0, &mut holder), (1, &mut *alone), (2, &mut relay)];
            cases.rotate_left(round % 3);
            for (k, daemon) in cases {
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
        let tenant = "bench";
        holder
            .client
            .create_tenant(&runbox_types::CreateTenantRequest {
                name: tenant.into(),
                max_runs: 1_000_000,
                ..Default::default()
            })
            .await?;
        let db = database_share(&pg, tenant, &run, iterations, MANY_NODES).await?;
        let summary = |s: &[Duration]| summarize(s).context("no samples");
        Ok::<_, anyhow::Error>(FleetReport {
            runtime: runtime.clone(),
            exec_direct: summary(&exec[0])?,
            exec_through: summary(&exec[1])?,
            get_direct: summary(&get[0])?,
            get_through: summary(&get[1])?,
            create_fleet: summary(&create[0])?,
            create_alone: summary(&create[1])?,
            create_relayed: summary(&create[2])?,
            list_fleet: summary(&list[0])?,
            list_alone: summary(&list[1])?,
            db_create: summary(&db[0])?,
            db_place: summary(&db[1])?,
            db_key: summary(&db[2])?,
            db_admit: summary(&db[3])?,
            db_catalog: summary(&db[5])?,
            many_nodes: MANY_NODES,
            db_place_many: summary(&db[4])?,
        })
    }
    .await;
    holder.shutdown().await;
    other.shutdown().await;
    relay.shutdown().await;
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
         loop; creates (each followed by its delete, untimed) on node 1, on a daemon without \
         a cluster and through a third node with `--max-runs 0` (placed on node 1 or 2) \
         likewise, each followed by a timed `GET /v1/runs`.\n"
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
            "create, through a node without room (made on another)",
            &r.create_relayed,
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
    let _ = writeln!(
        out,
        "\nThe database's part of a create by a tenant with an idempotency key (every SDK \
         create), on loopback, measured on a node joined in the benchmark's own process: \
         placement, the key, the tenant's count and the run's catalog row (written before the \
         create answers), one after another (targets: ≤ 2 ms for the four, ≤ 5 ms for placement \
         over {} nodes' rows).\n",
        r.many_nodes
    );
    let _ = writeln!(
        out,
        "| database step | n | p50 ms | p95 ms |\n|---|--:|--:|--:|"
    );
    let many = format!("placement, {} more nodes' rows", r.many_nodes);
    for (name, s) in [
        ("placement, two nodes", &r.db_place),
        ("the idempotency key", &r.db_key),
        ("the tenant's count (row lock, sum, upsert)", &r.db_admit),
        ("the run's catalog row (one upsert)", &r.db_catalog),
        ("all four", &r.db_create),
        (many.as_str(), &r.db_place_many),
    ] {
        let _ = writeln!(
            out,
            "| {name} | {} | {:.2} | {:.2} |",
            s.n, s.p50_ms, s.p95_ms
        );
    }
    out
}
