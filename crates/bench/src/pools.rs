//! The pools phase: a create served by a warm pool, to its first exec's
//! result, next to a cold create of the same image in the same loop; a
//! burst of concurrent creates against an adaptive pool; and what an idle
//! member costs the host.
//!
//! Owns only the measuring; the daemon and its runs are [`Daemon`]'s
//! (runs made here are remembered and deleted; the pools are emptied at
//! the end).

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use runbox_types::{CreateRunRequest, ExecRequest, PoolSet, PoolSpec, SizeTier};
use serde::Serialize;

use crate::daemon::{Daemon, IMAGE};
use crate::stats::{summarize, Summary};

/// Concurrent creates in the burst.
const BURST: usize = 50;

/// Idle members in the density measurement.
const DENSITY: u32 = 200;

/// How long a pool may take to fill.
const FILL_TIMEOUT: Duration = Duration::from_secs(600);

/// The phase's results.
#[derive(Clone, Debug, Serialize)]
pub struct PoolReport {
    /// The runtime of the daemon measured.
    pub runtime: String,
    /// Create served by a pool + first exec.
    pub claim: Summary,
    /// Of that, the create alone.
    pub claim_create: Summary,
    /// Cold create of the same image + first exec, same loop.
    pub cold: Summary,
    /// The burst: each create + first exec.
    pub burst: Summary,
    /// Of the burst, creates a pool served.
    pub burst_pooled: usize,
    /// The pool's target after the burst.
    pub burst_target: u32,
    /// Idle members measured for density.
    pub members: u32,
    /// Host memory (MemTotal - MemAvailable) per idle member, KiB.
    pub host_kib_per_member: u64,
    /// The agent's resident set in an idle member, median, KiB.
    pub agent_rss_kib: u64,
    /// Time to fill the pool to that many members.
    pub fill_secs: f64,
}

pub(crate) fn pool(warm: u32, warm_max: Option<u32>, warmup: bool) -> PoolSet {
    PoolSet {
        pools: vec![PoolSpec {
            image: IMAGE.into(),
            network: None,
            size: Some(SizeTier::Small),
            warm: Some(warm),
            warm_max,
            // The first command's files touched once before a member joins.
            warmup: warmup.then(|| vec!["/bin/true".to_owned()]),
        }],
    }
}

fn small() -> CreateRunRequest {
    CreateRunRequest {
        image: IMAGE.into(),
        size: Some(SizeTier::Small),
        ..Default::default()
    }
}

/// Waits until the pool has `ready` members.
pub(crate) async fn filled(daemon: &Daemon, ready: u32) -> anyhow::Result<()> {
    let deadline = Instant::now() + FILL_TIMEOUT;
    loop {
        let list = daemon.client.pools().await?;
        if list.pools.iter().all(|p| p.ready >= ready) {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "the pool did not reach {ready} ready members: {list:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Create `req` + exec `/bin/true`; the time and whether a pool served it.
async fn create_and_exec(
    client: &runbox_client::Client,
    req: &CreateRunRequest,
) -> anyhow::Result<(Duration, bool, String)> {
    let (took, _, pooled, id) = create_then_exec(client, req).await?;
    Ok((took, pooled, id))
}

/// [`create_and_exec`], with the create's own time as well.
pub(crate) async fn create_then_exec(
    client: &runbox_client::Client,
    req: &CreateRunRequest,
) -> anyhow::Result<(Duration, Duration, bool, String)> {
    let started = Instant::now();
    let run = client.create_run(req).await?;
    let created = started.elapsed();
    let exec = ExecRequest {
        cmd: vec!["/bin/true".into()],
        ..Default::default()
    };
    let out = client
        .exec(&run.id.to_string(), &exec)
        .await?
        .collect_output()
        .await?;
    let took = started.elapsed();
    ensure!(out.exit.exit_code == 0, "/bin/true failed: {:?}", out.exit);
    Ok((took, created, run.pooled, run.id.to_string()))
}

/// `MemTotal - MemAvailable`, KiB.
fn host_used_kib() -> anyhow::Result<u64> {
    let text = std::fs::read_to_string("/proc/meminfo")?;
    let field = |name: &str| -> Option<u64> {
        text.lines()
            .find(|l| l.starts_with(name))?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    };
    let total = field("MemTotal:").context("no MemTotal")?;
    let available = field("MemAvailable:").context("no MemAvailable")?;
    Ok(total - available)
}

/// The median VmRSS of the agents of the runs in the run store, KiB.
fn agent_rss_kib(daemon: &Daemon) -> anyhow::Result<u64> {
    let mut rss = Vec::new();
    for entry in std::fs::read_dir(daemon.state_dir().join("runs"))?.flatten() {
        let Ok(pid) = std::fs::read_to_string(entry.path().join("init.pid")) else {
            continue;
        };
        let status = std::fs::read_to_string(format!("/proc/{}/status", pid.trim()));
        if let Some(kib) = status.ok().and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))?
                .split_whitespace()
                .nth(1)?
                .parse::<u64>()
                .ok()
        }) {
            rss.push(kib);
        }
    }
    rss.sort_unstable();
    rss.get(rss.len() / 2).copied().context("no agent found")
}

/// Runs the phase on `daemon`.
pub async fn measure(daemon: &mut Daemon, iterations: usize) -> anyhow::Result<PoolReport> {
    eprintln!("runbox-bench: pools: claim vs cold");
    daemon.client.set_pools(&pool(4, None, true)).await?;
    filled(daemon, 4).await?;
    let cold_req = CreateRunRequest {
        image: IMAGE.into(),
        size: Some(SizeTier::Medium),
        ..Default::default()
    };
    let (mut claims, mut creates, mut colds) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..iterations {
        filled(daemon, 1).await?;
        let (took, created, pooled, id) = create_then_exec(&daemon.client, &small()).await?;
        creates.push(created);
        daemon.remember(id.parse()?);
        ensure!(
            pooled,
            "a create with a ready member was not served by the pool"
        );
        claims.push(took);
        daemon.delete_run(id.parse()?).await?;
        let (took, pooled, id) = create_and_exec(&daemon.client, &cold_req).await?;
        daemon.remember(id.parse()?);
        ensure!(!pooled, "the cold create was served by a pool");
        colds.push(took);
        daemon.delete_run(id.parse()?).await?;
    }

    eprintln!("runbox-bench: pools: a burst of {BURST} against warm 4, warmMax 16");
    daemon.client.set_pools(&pool(4, Some(16), false)).await?;
    filled(daemon, 4).await?;
    let client = daemon.client.clone();
    let burst = futures::future::join_all((0..BURST).map(|_| {
        let client = client.clone();
        async move { create_and_exec(&client, &small()).await }
    }))
    .await;
    let mut samples = Vec::new();
    let mut pooled = 0;
    for result in burst {
        let (took, was_pooled, id) = result?;
        daemon.remember(id.parse()?);
        samples.push(took);
        pooled += usize::from(was_pooled);
    }
    let burst_target = daemon.client.pools().await?.pools[0].target;
    for id in daemon.runs_made() {
        daemon.delete_run(id).await?;
    }

    eprintln!("runbox-bench: pools: {DENSITY} idle members");
    daemon.client.set_pools(&PoolSet::default()).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = host_used_kib()?;
    let started = Instant::now();
    daemon.client.set_pools(&pool(DENSITY, None, false)).await?;
    filled(daemon, DENSITY).await?;
    let fill_secs = started.elapsed().as_secs_f64();
    // Let the page cache and the kernel's lazy work settle.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = host_used_kib()?;
    let agent_rss_kib = agent_rss_kib(daemon)?;
    daemon.client.set_pools(&PoolSet::default()).await?;
    let deadline = Instant::now() + FILL_TIMEOUT;
    while daemon.client.info().await?.capacity.pooled > 0 {
        ensure!(Instant::now() < deadline, "the pool did not drain");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(PoolReport {
        runtime: daemon.runtime.clone(),
        claim: summarize(&claims).context("no samples")?,
        claim_create: summarize(&creates).context("no samples")?,
        cold: summarize(&colds).context("no samples")?,
        burst: summarize(&samples).context("no samples")?,
        burst_pooled: pooled,
        burst_target,
        members: DENSITY,
        host_kib_per_member: after.saturating_sub(before) / u64::from(DENSITY),
        agent_rss_kib,
        fill_secs,
    })
}

/// The phase as markdown.
pub fn markdown(r: &PoolReport) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "\n## Warm pools ({})\n", r.runtime);
    let _ = writeln!(
        out,
        "Claim: `POST /v1/runs {{image, size: small}}` served by a pool of `warm: 4` with \
         `warmup: [\"/bin/true\"]`, then exec `/bin/true` until its exit event; cold: the same \
         image at size `medium` (no pool), same loop.\n"
    );
    let _ = writeln!(
        out,
        "| start to first exec | n | p50 ms | p95 ms | cold ÷ claim |\n|---|--:|--:|--:|--:|"
    );
    let _ = writeln!(
        out,
        "| claim from a pool | {} | {:.2} | {:.2} | {:.1}× |",
        r.claim.n,
        r.claim.p50_ms,
        r.claim.p95_ms,
        r.cold.p50_ms / r.claim.p50_ms
    );
    let _ = writeln!(
        out,
        "| cold create | {} | {:.2} | {:.2} | 1.0× |",
        r.cold.n, r.cold.p50_ms, r.cold.p95_ms
    );
    let _ = writeln!(
        out,
        "\nOf the claim, the create alone (`POST /v1/runs` answered): p50 {:.2} ms, p95 {:.2} ms; \
         the rest is the run's first exec.",
        r.claim_create.p50_ms, r.claim_create.p95_ms
    );
    let _ = writeln!(
        out,
        "\nBurst: {} concurrent creates + first exec against `warm: 4, warmMax: 16`: {} served by \
         the pool, {} cold; the target rose to {}.\n",
        r.burst.n,
        r.burst_pooled,
        r.burst.n - r.burst_pooled,
        r.burst_target
    );
    let _ = writeln!(
        out,
        "| burst | p50 ms | p95 ms | max ms |\n|---|--:|--:|--:|\n| create + first exec | {:.2} | {:.2} | {:.2} |",
        r.burst.p50_ms, r.burst.p95_ms, r.burst.max_ms
    );
    let _ = writeln!(
        out,
        "\nDensity: {} idle `small` members, filled in {:.1} s: {} KiB of host memory each \
         (MemTotal − MemAvailable, before and after), the agent's resident set {} KiB.",
        r.members, r.fill_secs, r.host_kib_per_member, r.agent_rss_kib
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::stats::summary_of_ms as ms;

    #[test]
    fn the_tables_show_the_ratio_and_the_burst() {
        let report = PoolReport {
            runtime: "crun".into(),
            claim: ms(&[5, 5]),
            claim_create: ms(&[2, 2]),
            cold: ms(&[50, 50]),
            burst: ms(&[4, 6, 80]),
            burst_pooled: 2,
            burst_target: 9,
            members: 200,
            host_kib_per_member: 900,
            agent_rss_kib: 3000,
            fill_secs: 12.5,
        };
        let text = markdown(&report);
        assert!(
            text.contains("| claim from a pool | 2 | 5.00 | 5.00 | 10.0× |"),
            "{text}"
        );
        assert!(
            text.contains("2 served by the pool, 1 cold; the target rose to 9"),
            "{text}"
        );
        assert!(text.contains("900 KiB of host memory each"), "{text}");
    }
}
