//! The sleep phase: pausing and resuming a run, and waking a paused one with
//! the call that reaches it, next to the runtime's own `pause` and `resume`
//! of the same container.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use runbox_types::{CreateRunRequest, ExecRequest, RunStatus};
use serde::Serialize;

use crate::daemon::Daemon;
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
}

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

/// Runs the phase on `daemon`: `warmup` unmeasured rounds, then
/// `iterations` measured ones of each case, on one run.
pub async fn measure(
    daemon: &mut Daemon,
    iterations: usize,
    warmup: usize,
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
    daemon.delete_run(run.id).await?;
    let s = |i: usize| summarize(&series[i]).context("no samples");
    Ok(SleepReport {
        runtime: daemon.runtime.clone(),
        pause: s(0)?,
        resume: s(1)?,
        raw_pause: s(2)?,
        raw_resume: s(3)?,
        exec_running: s(4)?,
        exec_paused: s(5)?,
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
    }
}
