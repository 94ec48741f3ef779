//! The volumes phase: reading a named volume from inside a run against
//! reading the same file on the host, and what mounting a volume adds to a
//! create.
//!
//! - Sequential read of a [`FILE_MIB`] MiB file with `dd bs=1M` to
//!   `/dev/null`: in a run that mounts the volume (through an idmapped
//!   mount when runs have user namespaces), and on the host from the
//!   volume's directory in the run store, the two interleaved. Cold: after
//!   `sync` and dropping the page cache (`/proc/sys/vm/drop_caches`) before
//!   each read; warm: the file read once before, so it is in the page cache.
//! - Create + first exec (`/bin/true`) of a run that mounts the volume
//!   read-only, next to one that mounts nothing, interleaved; the DELETE is
//!   not timed.
//! - The same reads from a catalog dataset: an ext4 image holding the file
//!   (random bytes, so nothing is sparse), given to a daemon of its own with
//!   `--dataset`, mounted read-only in a run, against the host reading the
//!   file from the image's loop mount.

use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use runbox_types::{CreateRunRequest, CreateVolumeRequest, ExecRequest, VolumeMountRequest};
use serde::Serialize;

use crate::daemon::{exec_true, Daemon, IMAGE};
use crate::stats::{summarize, Summary};

/// The size of the file read.
pub const FILE_MIB: u64 = 1024;

const VOLUME: &str = "bench-data";

/// The phase's results.
#[derive(Clone, Debug, Serialize)]
pub struct VolumesReport {
    /// The runtime of the daemon measured.
    pub runtime: String,
    /// MiB read per sample.
    pub file_mib: u64,
    /// Whether the daemon's runs have user namespaces (the volume is then
    /// mounted through an idmapped mount).
    pub userns: String,
    /// Cold read in the run.
    pub run_cold: Summary,
    /// Cold read on the host.
    pub host_cold: Summary,
    /// Warm read in the run.
    pub run_warm: Summary,
    /// Warm read on the host.
    pub host_warm: Summary,
    /// Create + first exec, no volume.
    pub create_plain: Summary,
    /// Create + first exec, one volume mounted read-only.
    pub create_volume: Summary,
    /// A create served by a warm pool + first exec, no volume.
    pub claim_plain: Summary,
    /// The same with one volume (read-only) mounted into the member.
    pub claim_volume: Summary,
    /// The reads from a catalog dataset, when measured.
    pub catalog: Option<Reads>,
}

/// Cold and warm reads in a run and on the host.
#[derive(Clone, Debug, Serialize)]
pub struct Reads {
    /// Cold read in the run.
    pub run_cold: Summary,
    /// Cold read on the host.
    pub host_cold: Summary,
    /// Warm read in the run.
    pub run_warm: Summary,
    /// Warm read on the host.
    pub host_warm: Summary,
}

fn drop_caches() -> anyhow::Result<()> {
    let status = std::process::Command::new("sync")
        .status()
        .context("sync")?;
    ensure!(status.success(), "sync failed");
    std::fs::write("/proc/sys/vm/drop_caches", "3").context("dropping the page cache")
}

async fn read_in_run(daemon: &Daemon, id: &str, path: &str) -> anyhow::Result<Duration> {
    let req = ExecRequest {
        cmd: vec![
            "dd".into(),
            format!("if={path}"),
            "of=/dev/null".into(),
            "bs=1M".into(),
        ],
        ..Default::default()
    };
    let started = Instant::now();
    let out = daemon.client.exec(id, &req).await?.collect_output().await?;
    ensure!(
        out.exit.exit_code == 0,
        "dd in the run failed: {:?}",
        out.exit
    );
    Ok(started.elapsed())
}

fn read_on_host(path: &Path) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let status = std::process::Command::new("dd")
        .arg(format!("if={}", path.display()))
        .args(["of=/dev/null", "bs=1M"])
        .stderr(std::process::Stdio::null())
        .status()
        .context("running dd")?;
    ensure!(status.success(), "dd on the host failed");
    Ok(started.elapsed())
}

/// A create of the bench image in `size`, mounting the bench volume
/// read-only when `volume`.
fn create_request(size: Option<runbox_types::SizeTier>, volume: bool) -> CreateRunRequest {
    CreateRunRequest {
        image: IMAGE.into(),
        size,
        volumes: volume.then(|| {
            vec![VolumeMountRequest {
                name: VOLUME.into(),
                path: None,
                mode: Some(runbox_types::VolumeMode::Ro),
            }]
        }),
        ..Default::default()
    }
}

async fn create_case(daemon: &mut Daemon, volume: bool) -> anyhow::Result<Duration> {
    let req = create_request(None, volume);
    let started = Instant::now();
    let run = daemon.create_run_with(req).await?;
    exec_true(&daemon.client, &run.id.to_string()).await?;
    let took = started.elapsed();
    daemon.delete_run(run.id).await?;
    Ok(took)
}

/// Runs the phase on `daemon`: `reads` measured reads per case,
/// `creates` measured creates per case, each after `warmup` unmeasured.
pub async fn measure(
    daemon: &mut Daemon,
    reads: usize,
    creates: usize,
    warmup: usize,
) -> anyhow::Result<VolumesReport> {
    let userns = daemon.client.info().await?.userns;
    let volume = daemon
        .client
        .create_volume(&CreateVolumeRequest {
            name: VOLUME.into(),
            size_mb: Some(FILE_MIB + 256),
            labels: None,
        })
        .await
        .context("making the volume")?;
    let measured = async {
        let writer = daemon
            .create_run_with(CreateRunRequest {
                image: IMAGE.into(),
                volumes: Some(vec![VolumeMountRequest {
                    name: VOLUME.into(),
                    path: None,
                    mode: None,
                }]),
                ..Default::default()
            })
            .await?;
        let id = writer.id.to_string();
        let fill = ExecRequest {
            cmd: vec![
                "dd".into(),
                "if=/dev/zero".into(),
                format!("of=/volumes/{VOLUME}/big"),
                "bs=1M".into(),
                format!("count={FILE_MIB}"),
                "conv=fsync".into(),
            ],
            ..Default::default()
        };
        let out = daemon
            .client
            .exec(&id, &fill)
            .await?
            .collect_output()
            .await?;
        ensure!(
            out.exit.exit_code == 0,
            "writing the file failed: {:?}",
            out.exit
        );
        let host = daemon
            .state_dir()
            .join("runs/.volumes")
            .join(volume.id.to_string())
            .join("big");
        let named =
            read_cases(daemon, &id, &format!("/volumes/{VOLUME}/big"), &host, reads).await?;
        daemon.delete_run(writer.id).await?;
        let (mut plain, mut with) = (Vec::new(), Vec::new());
        for round in 0..warmup + creates {
            for volume in [round % 2 == 0, round % 2 != 0] {
                let took = create_case(daemon, volume).await?;
                if round >= warmup {
                    if volume { &mut with } else { &mut plain }.push(took);
                }
            }
        }
        // The same through a warm pool: the volume is mounted into the
        // member the create takes.
        daemon
            .client
            .set_pools(&crate::pools::pool(2, None, true))
            .await?;
        let (mut claim_plain, mut claim_volume) = (Vec::new(), Vec::new());
        for round in 0..warmup + creates {
            for volume in [round % 2 == 0, round % 2 != 0] {
                crate::pools::filled(daemon, 1).await?;
                let req = create_request(Some(runbox_types::SizeTier::Small), volume);
                let (took, _, pooled, id) =
                    crate::pools::create_then_exec(&daemon.client, &req).await?;
                let id = id.parse()?;
                daemon.remember(id);
                ensure!(
                    pooled,
                    "a create with a ready member was not served by the pool"
                );
                if round >= warmup {
                    if volume {
                        &mut claim_volume
                    } else {
                        &mut claim_plain
                    }
                    .push(took);
                }
                daemon.delete_run(id).await?;
            }
        }
        daemon
            .client
            .set_pools(&runbox_types::PoolSet::default())
            .await?;
        let summary = |s: &[Duration]| summarize(s).context("no samples");
        Ok::<_, anyhow::Error>(VolumesReport {
            runtime: daemon.runtime.clone(),
            file_mib: FILE_MIB,
            userns,
            run_cold: named.run_cold,
            host_cold: named.host_cold,
            run_warm: named.run_warm,
            host_warm: named.host_warm,
            create_plain: summary(&plain)?,
            create_volume: summary(&with)?,
            claim_plain: summary(&claim_plain)?,
            claim_volume: summary(&claim_volume)?,
            catalog: None,
        })
    }
    .await;
    if let Err(e) = daemon.client.delete_volume(VOLUME).await {
        eprintln!("runbox-bench: could not delete the bench volume: {e}");
    }
    measured
}

/// `reads` measured cold and warm reads of `in_run` in run `id` and of
/// `host` on the host, interleaved, after one unmeasured round.
async fn read_cases(
    daemon: &Daemon,
    id: &str,
    in_run: &str,
    host: &Path,
    reads: usize,
) -> anyhow::Result<Reads> {
    let (mut run_cold, mut host_cold, mut run_warm, mut host_warm) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round in 0..1 + reads {
        let measured = round >= 1;
        for cold in [true, false] {
            if !cold {
                read_on_host(host)?;
            }
            for run_first in [round % 2 == 0, round % 2 != 0] {
                if cold {
                    drop_caches()?;
                }
                let took = match run_first {
                    true => read_in_run(daemon, id, in_run).await?,
                    false => read_on_host(host)?,
                };
                if measured {
                    match (cold, run_first) {
                        (true, true) => &mut run_cold,
                        (true, false) => &mut host_cold,
                        (false, true) => &mut run_warm,
                        (false, false) => &mut host_warm,
                    }
                    .push(took);
                }
            }
        }
    }
    let summary = |s: &[Duration]| summarize(s).context("no samples");
    Ok(Reads {
        run_cold: summary(&run_cold)?,
        host_cold: summary(&host_cold)?,
        run_warm: summary(&run_warm)?,
        host_warm: summary(&host_warm)?,
    })
}

/// The catalog half: an ext4 image holding a [`FILE_MIB`] MiB file of
/// random bytes, a daemon of its own (`runbox`, `agent`, `runtime`) given it
/// with `--dataset`, and `reads` cold and warm reads in a run that mounts
/// it read-only against the host reading it from the image's loop mount.
pub async fn measure_catalog(
    runbox: &Path,
    agent: &Path,
    runtime: &str,
    rootfs: Vec<u8>,
    reads: usize,
) -> anyhow::Result<Reads> {
    let dir = tempfile::tempdir().context("a directory for the image")?;
    let tree = dir.path().join("tree");
    std::fs::create_dir(&tree)?;
    let status = std::process::Command::new("dd")
        .arg("if=/dev/urandom")
        .arg(format!("of={}", tree.join("big").display()))
        .args(["bs=1M", &format!("count={FILE_MIB}")])
        .stderr(std::process::Stdio::null())
        .status()
        .context("running dd")?;
    ensure!(status.success(), "writing the file failed");
    let image = dir.path().join("catalog.img");
    let out = std::process::Command::new("mkfs.ext4")
        .args(["-q", "-F", "-d"])
        .arg(&tree)
        .arg(&image)
        .arg(format!("{}M", FILE_MIB + 128))
        .output()
        .context("running mkfs.ext4")?;
    ensure!(
        out.status.success(),
        "mkfs.ext4: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::remove_file(tree.join("big"))?;
    let flag = vec![
        "--dataset".to_owned(),
        format!("benchcat={}", image.display()),
    ];
    let mut daemon = Daemon::start_with(runbox, agent, runtime, &flag).await?;
    daemon.import(rootfs).await?;
    let run = daemon
        .create_run_with(CreateRunRequest {
            image: IMAGE.into(),
            volumes: Some(vec![VolumeMountRequest {
                name: "benchcat".into(),
                path: None,
                mode: None,
            }]),
            ..Default::default()
        })
        .await?;
    let host = daemon.state_dir().join("runs/.datasets/benchcat/big");
    let reads = read_cases(
        &daemon,
        &run.id.to_string(),
        "/volumes/benchcat/big",
        &host,
        reads,
    )
    .await;
    daemon.delete_run(run.id).await?;
    // The image is released (unmounted) just after its last holder goes;
    // wait for it before the daemon and the image's directory go.
    let mount_point = daemon.state_dir().join("runs/.datasets/benchcat");
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::fs::read_to_string("/proc/self/mountinfo")?
        .contains(mount_point.to_str().unwrap_or("?"))
    {
        ensure!(Instant::now() < deadline, "the dataset was not released");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    reads
}

/// The phase as markdown.
pub fn markdown(r: &VolumesReport) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "\n## Volumes ({}, userns {})\n", r.runtime, r.userns);
    let _ = writeln!(
        out,
        "Sequential read of a {} MiB file (`dd bs=1M` to /dev/null) in a run that mounts the \
         volume and on the host from the volume's directory, interleaved; cold after dropping \
         the page cache, warm with the file cached. Then create + first exec with one volume \
         (read-only) next to none.\n",
        r.file_mib
    );
    let _ = writeln!(
        out,
        "| case | n | p50 ms | p95 ms | MiB/s at p50 | ÷ host |\n|---|--:|--:|--:|--:|--:|"
    );
    let mib_s = |s: &Summary| r.file_mib as f64 / (s.p50_ms / 1e3);
    for (name, s, host) in [
        ("cold read, in the run", &r.run_cold, &r.host_cold),
        ("cold read, on the host", &r.host_cold, &r.host_cold),
        ("warm read, in the run", &r.run_warm, &r.host_warm),
        ("warm read, on the host", &r.host_warm, &r.host_warm),
    ]
    .into_iter()
    .chain(r.catalog.iter().flat_map(|c| {
        [
            (
                "catalog dataset, cold read, in the run",
                &c.run_cold,
                &c.host_cold,
            ),
            (
                "catalog dataset, cold read, on the host",
                &c.host_cold,
                &c.host_cold,
            ),
            (
                "catalog dataset, warm read, in the run",
                &c.run_warm,
                &c.host_warm,
            ),
            (
                "catalog dataset, warm read, on the host",
                &c.host_warm,
                &c.host_warm,
            ),
        ]
    })) {
        let _ = writeln!(
            out,
            "| {name} | {} | {:.1} | {:.1} | {:.0} | {:.2}× |",
            s.n,
            s.p50_ms,
            s.p95_ms,
            mib_s(s),
            mib_s(s) / mib_s(host)
        );
    }
    let _ = writeln!(
        out,
        "\n| create + first exec | n | p50 ms | p95 ms |\n|---|--:|--:|--:|"
    );
    for (name, s) in [
        ("no volume", &r.create_plain),
        ("one volume, read-only", &r.create_volume),
        ("from a warm pool, no volume", &r.claim_plain),
        (
            "from a warm pool, one volume mounted into the member",
            &r.claim_volume,
        ),
    ] {
        let _ = writeln!(
            out,
            "| {name} | {} | {:.2} | {:.2} |",
            s.n, s.p50_ms, s.p95_ms
        );
    }
    let _ = writeln!(
        out,
        "\nA volume adds {:.2} ms to the median create + first exec, {:.2} ms to a pool claim's.",
        r.create_volume.p50_ms - r.create_plain.p50_ms,
        r.claim_volume.p50_ms - r.claim_plain.p50_ms
    );
    out
}
