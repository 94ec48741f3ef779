//! The tenants phase: what authenticating a request costs when the daemon
//! holds 10,000 tenants. A daemon starts with a tenant file of 10,000
//! token hashes (written before it starts: adding them through the API
//! rewrites the file each time); tenant 5,000 makes a run; then execs of
//! `/bin/true` into it, interleaved, with the root token, that tenant's
//! token and the run's own token, next to the root token on a daemon with
//! no tenants, and on a third daemon with metrics and usage accounting off
//! (`--no-metrics --no-usage`), which is what the telemetry costs.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use runbox_client::Client;
use runbox_types::CreateRunRequest;
use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::daemon::{exec_true, Daemon, IMAGE};
use crate::stats::{summarize, Summary};

/// How many tenants the daemon holds.
pub const TENANTS: usize = 10_000;

/// The phase's results.
#[derive(Clone, Debug, Serialize)]
pub struct TenantsReport {
    /// The runtime of the daemons measured.
    pub runtime: String,
    /// Tenants the measured daemon held.
    pub tenants: usize,
    /// Exec round trip with the root token, no tenants on the daemon.
    pub root_plain: Summary,
    /// With the root token, 10,000 tenants.
    pub root: Summary,
    /// With the run's tenant's token.
    pub tenant: Summary,
    /// With the run's own token.
    pub run_token: Summary,
    /// With the root token, no tenants, metrics and usage off.
    pub telemetry_off: Summary,
}

/// Tenant `i`'s token: 64 hex digits.
fn token(i: usize) -> String {
    format!("{:064x}", 0xbe7c_0000_u64 + i as u64)
}

/// Writes `<state>/tenants.json` with [`TENANTS`] tenants.
fn seed(state: &Path) -> anyhow::Result<()> {
    let tenants: Vec<serde_json::Value> = (0..TENANTS)
        .map(|i| {
            let digest = Sha256::digest(token(i).as_bytes());
            let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
            serde_json::json!({
                "name": format!("t{i}"),
                "tokenSha256": format!("sha256:{hex}"),
                "maxRuns": 0, "images": [], "networks": [], "sizes": [],
                "createdAt": "2026-01-01T00:00:00Z", "updatedAt": "2026-01-01T00:00:00Z",
            })
        })
        .collect();
    let file = serde_json::json!({"version": 1, "tenants": tenants});
    std::fs::write(state.join("tenants.json"), serde_json::to_vec(&file)?)
        .context("writing tenants.json")
}

/// Runs the phase: `plain` is a daemon with no tenants (the exec phase's),
/// and a second daemon with the tenant file is started and stopped here.
pub async fn measure(
    plain: &mut Daemon,
    runbox: &Path,
    agent: &Path,
    tar: Vec<u8>,
    iterations: usize,
    warmup: usize,
) -> anyhow::Result<TenantsReport> {
    let runtime = plain.runtime.clone();
    let daemon = Daemon::start_prepared(runbox, agent, &runtime, &[], seed).await?;
    let off_flags = ["--no-metrics".to_owned(), "--no-usage".to_owned()];
    let mut off =
        match Daemon::start_prepared(runbox, agent, &runtime, &off_flags, |_| Ok(())).await {
            Ok(off) => off,
            Err(e) => {
                daemon.shutdown().await;
                return Err(e);
            }
        };
    let measured = async {
        off.import(tar.clone()).await?;
        daemon.import(tar).await?;
        let base = daemon.client.base_url().to_owned();
        let tenant = Client::new(&base, token(TENANTS / 2))?;
        let run = tenant
            .create_run(&CreateRunRequest {
                image: IMAGE.into(),
                ..Default::default()
            })
            .await
            .context("creating the tenant's run")?;
        let id = run.id.to_string();
        let run_token = Client::new(&base, run.token.as_deref().context("no run token")?)?;
        let plain_run = plain.create_run().await?;
        let plain_id = plain_run.id.to_string();
        let off_id = off.create_run().await?.id.to_string();
        let clients = [
            &plain.client,
            &daemon.client,
            &tenant,
            &run_token,
            &off.client,
        ];
        let ids = [&plain_id, &id, &id, &id, &off_id];
        let mut samples: [Vec<Duration>; 5] = Default::default();
        for round in 0..warmup + iterations {
            for (k, client) in clients.iter().enumerate() {
                let took = exec_true(client, ids[k]).await?;
                if round >= warmup {
                    samples[k].push(took);
                }
            }
        }
        tenant.delete_run(&id).await?;
        let summary = |s: &[Duration]| summarize(s).context("no samples");
        Ok::<_, anyhow::Error>(TenantsReport {
            runtime: runtime.clone(),
            tenants: TENANTS,
            root_plain: summary(&samples[0])?,
            root: summary(&samples[1])?,
            tenant: summary(&samples[2])?,
            run_token: summary(&samples[3])?,
            telemetry_off: summary(&samples[4])?,
        })
    }
    .await;
    daemon.shutdown().await;
    off.shutdown().await;
    measured
}

/// The phase as markdown.
pub fn markdown(r: &TenantsReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\n## Tokens with {} tenants ({})\n",
        r.tenants, r.runtime
    );
    let _ = writeln!(
        out,
        "Exec of `/bin/true` to its exit event, the five cases interleaved in one loop; the \
         daemon holds {} tenants (their token hashes), the run is tenant 5,000's. The last \
         row is a daemon with no tenants, metrics and usage off.\n",
        r.tenants
    );
    let _ = writeln!(
        out,
        "| token | n | p50 ms | p95 ms | ÷ root, no tenants |\n|---|--:|--:|--:|--:|"
    );
    for (name, s) in [
        ("root, a daemon with no tenants", &r.root_plain),
        ("root", &r.root),
        ("the run's tenant", &r.tenant),
        ("the run's own token", &r.run_token),
        (
            "root, no tenants, --no-metrics --no-usage",
            &r.telemetry_off,
        ),
    ] {
        let _ = writeln!(
            out,
            "| {name} | {} | {:.2} | {:.2} | {:.2}× |",
            s.n,
            s.p50_ms,
            s.p95_ms,
            s.p50_ms / r.root_plain.p50_ms
        );
    }
    out
}
