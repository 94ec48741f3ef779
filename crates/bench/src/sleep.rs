//! The sleep phase: pausing and resuming a run, and waking a paused one with
//! the call that reaches it, next to the runtime's own `pause` and `resume`
//! of the same container; hibernating a run and waking it with an exec,
//! next to a cold create of the same image in the same loop; the host
//! memory that hibernating idle runs gives back; and, where Docker's engine
//! is installed (`scripts/bench-docker`), `docker pause`/`unpause` and
//! `docker stop`/`start` of a container of the same root filesystem.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use runbox_types::{CreateRunRequest, ExecRequest, RunStatus};
use serde::Serialize;

use std::path::Path;

use crate::daemon::Daemon;
use crate::docker::Docker;
use crate::stats::{summarize, Summary};

/// The phase's results.
#[derive(Clone, Debug, Serialize)]
pub struct SleepReport {
    /// The runtime of the daemon measured.
    pub runtime: String,
    /// `POST /v1/runs/{id}/pause`, answered.
    pub pause: Summary,
    /// `POST /v1/runs/{id}/resume`, answered.
    pub resume: Summary,
    /// `<runtime> pause` of the same container.
    pub raw_pause: Summary,
    /// `<runtime> resume` of the same container.
    pub raw_resume: Summary,
    /// Exec of `/bin/true` in a running run, to its exit event.
    pub exec_running: Summary,
    /// The same exec reaching a paused run: it wakes the run first.
    pub exec_paused: Summary,
    /// `POST /v1/runs/{id}/hibernate`, answered.
    pub hibernate: Summary,
    /// Exec of `/bin/true` reaching a hibernated run, to its exit event:
    /// the wake (a new sandbox on its disk) and the exec.
    pub exec_hibernated: Summary,
    /// A cold create of the same image and its first exec, to the exec's
    /// exit event, in the same loop.
    pub exec_cold: Summary,
    /// What hibernating idle runs gives back.
    pub memory: MemoryFreed,
    /// Docker's engine on the same root filesystem, where installed.
    pub docker: Option<DockerSleep>,
}

/// Host memory before and after hibernating `runs` idle runs.
#[derive(Clone, Debug, Serialize)]
pub struct MemoryFreed {
    /// How many runs were hibernated.
    pub runs: usize,
    /// Memory their cgroups were charged just before (page cache included).
    pub charged_bytes: u64,
    /// `MemAvailable` just before.
    pub available_before: u64,
    /// `MemAvailable` once they were hibernated.
    pub available_after: u64,
}

/// The same operations through Docker's engine.
#[derive(Clone, Debug, Serialize)]
pub struct DockerSleep {
    /// `docker pause`, to its exit.
    pub pause: Summary,
    /// `docker unpause`, to its exit.
    pub unpause: Summary,
    /// `docker stop --time 0` (SIGKILL at once), to its exit.
    pub stop: Summary,
    /// `docker start` and then `docker exec … /bin/true`, to the exec's exit.
    pub start_exec: Summary,
}

/// How many idle runs the memory measurement hibernates.
const MEMORY_RUNS: usize = 50;

fn exec_true() -> ExecRequest {
    ExecRequest {
        cmd: vec!["/bin/true".into()],
        ..Default::default()
    }
}

async fn timed_exec(client: &runbox_client::Client, id: &str) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let out = client
        .exec(id, &exec_true())
        .await?
        .collect_output()
        .await?;
    ensure!(out.exit.exit_code == 0, "/bin/true failed: {:?}", out.exit);
    Ok(started.elapsed())
}

/// `<runtime> --root <state>/oci/<runtime> <verb> runbox-<id>`, timed.
fn raw(daemon: &Daemon, verb: &str, id: &str) -> anyhow::Result<Duration> {
    let root = daemon.state_dir().join("oci").join(&daemon.runtime);
    let started = Instant::now();
    let status = std::process::Command::new(&daemon.runtime)
        .arg("--root")
        .arg(&root)
        .args([verb, &format!("runbox-{id}")])
        .stdout(std::process::Stdio::null())
        .status()
        .with_context(|| format!("{} {verb}", daemon.runtime))?;
    let took = started.elapsed();
    ensure!(
        status.success(),
        "{} {verb} failed: {status}",
        daemon.runtime
    );
    Ok(took)
}

/// `MemAvailable` from /proc/meminfo, in bytes.
fn mem_available() -> anyhow::Result<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").context("reading /proc/meminfo")?;
    text.lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kib| kib << 10)
        .context("no MemAvailable in /proc/meminfo")
}

/// The memory run `id`'s cgroup is charged now (v1 or v2), 0 if it has none.
fn charged(id: &str) -> u64 {
    [
        format!("/sys/fs/cgroup/memory/runbox/{id}/memory.usage_in_bytes"),
        format!("/sys/fs/cgroup/runbox/{id}/memory.current"),
    ]
    .iter()
    .find_map(|p| std::fs::read_to_string(p).ok())
    .and_then(|t| t.trim().parse().ok())
    .unwrap_or(0)
}

/// Creates [`MEMORY_RUNS`] runs, lets them settle, and hibernates them all,
/// reading the host's available memory before and after.
async fn memory_freed(daemon: &mut Daemon) -> anyhow::Result<MemoryFreed> {
    eprintln!("runbox-bench: sleep: hibernating {MEMORY_RUNS} idle runs");
    let mut ids = Vec::with_capacity(MEMORY_RUNS);
    for _ in 0..MEMORY_RUNS {
        let run = daemon.client.create_run(&base()).await?;
        daemon.remember(run.id);
        ids.push(run.id);
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let charged_bytes = ids.iter().map(|id| charged(&id.to_string())).sum();
    let available_before = mem_available()?;
    for id in &ids {
        daemon.client.hibernate_run(&id.to_string()).await?;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let available_after = mem_available()?;
    for id in ids {
        daemon.delete_run(id).await?;
    }
    Ok(MemoryFreed {
        runs: MEMORY_RUNS,
        charged_bytes,
        available_before,
        available_after,
    })
}

fn base() -> CreateRunRequest {
    CreateRunRequest {
        image: "base".into(),
        ..Default::default()
    }
}

/// Docker's pause, unpause, stop and start-then-exec of one idle container.
fn docker_sleep(
    work: &Path,
    rootfs_tar: &Path,
    iterations: usize,
    warmup: usize,
) -> anyhow::Result<Option<DockerSleep>> {
    if !Docker::available() {
        eprintln!(
            "runbox-bench: sleep: dockerd is not installed (scripts/bench-docker installs it); \
             no Docker comparison"
        );
        return Ok(None);
    }
    eprintln!("runbox-bench: sleep: docker pause, unpause, stop and start");
    let mut docker = Docker::start(&work.join("docker"), rootfs_tar)?;
    let id = docker.idle_container()?;
    let mut series: [Vec<Duration>; 4] = Default::default();
    for round in 0..warmup + iterations {
        let samples = [
            docker.timed(&["pause", &id])?,
            docker.timed(&["unpause", &id])?,
            docker.timed(&["stop", "--time", "0", &id])?,
            {
                let started = Instant::now();
                docker.run(&["start", &id])?;
                docker.run(&["exec", &id, "/bin/true"])?;
                started.elapsed()
            },
        ];
        if round >= warmup {
            for (i, d) in samples.into_iter().enumerate() {
                series[i].push(d);
            }
        }
    }
    docker.shutdown();
    let s = |i: usize| summarize(&series[i]).context("no samples");
    Ok(Some(DockerSleep {
        pause: s(0)?,
        unpause: s(1)?,
        stop: s(2)?,
        start_exec: s(3)?,
    }))
}

/// Runs the phase on `daemon`: `warmup` unmeasured rounds, then
/// `iterations` measured ones of each case, on one run (hibernation and
/// the cold creates: a tenth as many, at least 10); `work` holds the Docker
/// engine's files and `rootfs_tar` is `base`'s root filesystem.
pub async fn measure(
    daemon: &mut Daemon,
    iterations: usize,
    warmup: usize,
    work: &Path,
    rootfs_tar: &Path,
) -> anyhow::Result<SleepReport> {
    eprintln!("runbox-bench: sleep: pause, resume and wake on exec");
    let run = daemon
        .client
        .create_run(&CreateRunRequest {
            image: "base".into(),
            ..Default::default()
        })
        .await?;
    daemon.remember(run.id);
    let id = run.id.to_string();
    let client = daemon.client.clone();
    let mut series: [Vec<Duration>; 6] = Default::default();
    for round in 0..warmup + iterations {
        let keep = round >= warmup;
        let mut push = |i: usize, d: Duration| {
            if keep {
                series[i].push(d);
            }
        };
        let started = Instant::now();
        let paused = client.pause_run(&id).await?;
        push(0, started.elapsed());
        ensure!(paused.status == RunStatus::Paused, "not paused: {paused:?}");
        let started = Instant::now();
        client.resume_run(&id).await?;
        push(1, started.elapsed());
        push(2, raw(daemon, "pause", &id)?);
        push(3, raw(daemon, "resume", &id)?);
        push(4, timed_exec(&client, &id).await?);
        client.pause_run(&id).await?;
        push(5, timed_exec(&client, &id).await?);
    }
    // Hibernate and wake on exec, next to a cold create and first exec.
    eprintln!("runbox-bench: sleep: hibernate, wake on exec, cold create");
    let deep = (iterations / 10).max(10);
    let mut deep_series: [Vec<Duration>; 3] = Default::default();
    for round in 0..warmup.min(3) + deep {
        let keep = round >= warmup.min(3);
        let started = Instant::now();
        let asleep = client.hibernate_run(&id).await?;
        let hibernated = started.elapsed();
        ensure!(
            asleep.status == RunStatus::Hibernated,
            "not hibernated: {asleep:?}"
        );
        let woken = timed_exec(&client, &id).await?;
        let started = Instant::now();
        let cold = client.create_run(&base()).await?;
        daemon.remember(cold.id);
        timed_exec(&client, &cold.id.to_string()).await?;
        let cold_exec = started.elapsed();
        daemon.delete_run(cold.id).await?;
        if keep {
            deep_series[0].push(hibernated);
            deep_series[1].push(woken);
            deep_series[2].push(cold_exec);
        }
    }
    daemon.delete_run(run.id).await?;
    let memory = memory_freed(daemon).await?;
    let docker = docker_sleep(work, rootfs_tar, iterations / 4, warmup.min(3))?;
    let s = |i: usize| summarize(&series[i]).context("no samples");
    let d = |i: usize| summarize(&deep_series[i]).context("no samples");
    Ok(SleepReport {
        runtime: daemon.runtime.clone(),
        pause: s(0)?,
        resume: s(1)?,
        raw_pause: s(2)?,
        raw_resume: s(3)?,
        exec_running: s(4)?,
        exec_paused: s(5)?,
        hibernate: d(0)?,
        exec_hibernated: d(1)?,
        exec_cold: d(2)?,
        memory,
        docker,
    })
}

/// The phase as markdown.
pub fn markdown(r: &SleepReport) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "\n## Pause and resume ({})\n", r.runtime);
    let _ = writeln!(
        out,
        "runbox: `POST /v1/runs/{{id}}/pause` and `.../resume` answered (the cgroup freezer, the \
         record stored, the answer sent). Raw: `{rt} pause` and `{rt} resume` of the same \
         container (process start included, as for the exec phase's raw case). Wake on exec: \
         exec `/bin/true` to its exit event in a paused run (the run's owner resumes it first), \
         next to the same exec in a running one.\n",
        rt = r.runtime
    );
    let _ = writeln!(
        out,
        "| case | n | p50 ms | p95 ms | ÷ raw |\n|---|--:|--:|--:|--:|"
    );
    let row = |out: &mut String, name: &str, s: &Summary, base: Option<&Summary>| {
        let ratio = base.map_or("".to_owned(), |b| format!("{:.2}×", s.p50_ms / b.p50_ms));
        let _ = writeln!(
            out,
            "| {name} | {} | {:.2} | {:.2} | {ratio} |",
            s.n, s.p50_ms, s.p95_ms
        );
    };
    row(&mut out, "runbox pause", &r.pause, Some(&r.raw_pause));
    row(
        &mut out,
        &format!("{} pause", r.runtime),
        &r.raw_pause,
        None,
    );
    row(&mut out, "runbox resume", &r.resume, Some(&r.raw_resume));
    row(
        &mut out,
        &format!("{} resume", r.runtime),
        &r.raw_resume,
        None,
    );
    row(&mut out, "exec, running run", &r.exec_running, None);
    row(
        &mut out,
        "exec, paused run (wakes it)",
        &r.exec_paused,
        Some(&r.exec_running),
    );
    let _ = writeln!(
        out,
        "\nThe last ratio is the paused exec over the running one."
    );
    let _ = writeln!(out, "\n## Hibernate and wake ({})\n", r.runtime);
    let _ = writeln!(
        out,
        "runbox: `POST .../hibernate` answered (record stored, container, mounts, namespace and \
         cgroup gone); wake on exec: exec `/bin/true` reaching the hibernated run, to its exit \
         event (a new sandbox booted on the run's disk, its agent answering, then the exec); \
         cold: `POST /v1/runs` of the same image and the same exec, in the same loop.\n"
    );
    let _ = writeln!(
        out,
        "| case | n | p50 ms | p95 ms | ÷ cold |\n|---|--:|--:|--:|--:|"
    );
    row(&mut out, "runbox hibernate", &r.hibernate, None);
    row(
        &mut out,
        "exec, hibernated run (wakes it)",
        &r.exec_hibernated,
        Some(&r.exec_cold),
    );
    row(&mut out, "cold create + exec", &r.exec_cold, None);
    if let Some(d) = &r.docker {
        row(&mut out, "docker pause", &d.pause, None);
        row(&mut out, "docker unpause", &d.unpause, None);
        row(&mut out, "docker stop --time 0", &d.stop, None);
        row(&mut out, "docker start + exec", &d.start_exec, None);
    }
    let m = &r.memory;
    let mib = |b: u64| b as f64 / f64::from(1 << 20);
    let _ = writeln!(
        out,
        "\nHibernating {} idle runs: their cgroups were charged {:.1} MiB; the host's \
         `MemAvailable` went from {:.1} MiB to {:.1} MiB ({:+.1} MiB).",
        m.runs,
        mib(m.charged_bytes),
        mib(m.available_before),
        mib(m.available_after),
        mib(m.available_after) - mib(m.available_before)
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::stats::summary_of_ms as ms;

    #[test]
    fn the_table_shows_runbox_next_to_the_runtime() {
        let report = SleepReport {
            runtime: "crun".into(),
            pause: ms(&[2, 2]),
            resume: ms(&[2, 2]),
            raw_pause: ms(&[4, 4]),
            raw_resume: ms(&[4, 4]),
            exec_running: ms(&[2, 2]),
            exec_paused: ms(&[3, 3]),
            hibernate: ms(&[20, 20]),
            exec_hibernated: ms(&[90, 90]),
            exec_cold: ms(&[100, 100]),
            memory: MemoryFreed {
                runs: 50,
                charged_bytes: 100 << 20,
                available_before: 1000 << 20,
                available_after: 1100 << 20,
            },
            docker: None,
        };
        let text = markdown(&report);
        assert!(
            text.contains("| runbox pause | 2 | 2.00 | 2.00 | 0.50× |"),
            "{text}"
        );
        assert!(
            text.contains("| crun resume | 2 | 4.00 | 4.00 |  |"),
            "{text}"
        );
        assert!(
            text.contains("| exec, paused run (wakes it) | 2 | 3.00 | 3.00 | 1.50× |"),
            "{text}"
        );
        assert!(
            text.contains("| exec, hibernated run (wakes it) | 2 | 90.00 | 90.00 | 0.90× |"),
            "{text}"
        );
        assert!(
            text.contains("from 1000.0 MiB to 1100.0 MiB (+100.0 MiB)"),
            "{text}"
        );
    }
}
