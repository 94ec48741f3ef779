//! The interactive phase: a keystroke's echo over the WebSocket terminal,
//! next to the same echo on a terminal of the host; a request through a
//! preview URL, next to the same request sent straight to the server from
//! inside the run's network namespace (what the preview proxy adds), and
//! the throughput of both; and a port-forward's throughput, next to the
//! same download made from inside the namespace.
//!
//! The "direct" cases run on a thread of this process that joined the
//! run's network namespace once, so they pay neither the daemon nor a
//! thread per connection: they are the floor the runbox paths are read
//! against.

use std::fmt::Write as _;
use std::io::{Read as _, Write as _};
use std::os::fd::AsFd as _;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use futures::StreamExt as _;
use runbox_client::ExecEvent;
use runbox_types::{ExecRequest, PtySpec};
use serde::Serialize;

use crate::daemon::Daemon;
use crate::stats::{summarize, Summary};

/// The httpd's port inside the run.
const WEB_PORT: u16 = 8080;

/// Bytes of the preview's large file.
const LARGE_FILE: u64 = 256 << 20;

/// Bytes one port-forward download carries.
const TUNNEL_BYTES: u64 = 1 << 30;

/// Transfers per throughput case.
const TRANSFERS: usize = 3;

/// How long one sample may take.
const SAMPLE_TIMEOUT: Duration = Duration::from_secs(120);

/// The phase's results.
#[derive(Clone, Debug, Serialize)]
pub struct InteractiveReport {
    /// The runtime of the daemon measured.
    pub runtime: String,
    /// One byte to the WebSocket terminal until its echo came back.
    pub echo: Summary,
    /// The same on a terminal of the host, no runbox.
    pub echo_host: Summary,
    /// GET of a 1 KiB file through a preview URL.
    pub preview: Summary,
    /// The same GET sent from inside the run's network namespace.
    pub direct: Summary,
    /// MB/s of the large file through the preview URL, median.
    pub preview_mbps: f64,
    /// MB/s of the large file from inside the namespace, median.
    pub direct_mbps: f64,
    /// Bytes of the large file.
    pub large_bytes: u64,
    /// MB/s of a port-forward download, median.
    pub tunnel_mbps: f64,
    /// MB/s of the same download from inside the namespace, median.
    pub tunnel_direct_mbps: f64,
    /// Bytes of one download.
    pub tunnel_bytes: u64,
}

type Job = Box<dyn FnOnce() + Send>;

/// A thread that joined a network namespace and runs jobs there.
struct InNetns {
    jobs: std::sync::mpsc::Sender<Job>,
}

impl InNetns {
    fn join(path: &std::path::Path) -> anyhow::Result<InNetns> {
        let ns =
            std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
        let (jobs, rx) = std::sync::mpsc::channel::<Job>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let joined = rustix::thread::move_into_link_name_space(
                ns.as_fd(),
                Some(rustix::thread::LinkNameSpaceType::Network),
            );
            let ok = joined.is_ok();
            let _ = ready_tx.send(joined);
            if ok {
                while let Ok(job) = rx.recv() {
                    job();
                }
            }
        });
        ready_rx
            .recv()
            .context("the namespace thread died")?
            .context("joining the run's network namespace")?;
        Ok(InNetns { jobs })
    }

    async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> anyhow::Result<T> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.jobs
            .send(Box::new(move || {
                let _ = tx.send(f());
            }))
            .map_err(|_| anyhow::anyhow!("the namespace thread is gone"))?;
        Ok(rx.await?)
    }
}

/// One HTTP/1.0 GET on a new connection to the run's loopback; the time to
/// the end of the body, and its size.
fn get_direct(port: u16, path: &str) -> anyhow::Result<(Duration, u64)> {
    let started = Instant::now();
    let mut socket = std::net::TcpStream::connect(("127.0.0.1", port))?;
    socket.set_nodelay(true)?;
    write!(socket, "GET {path} HTTP/1.0\r\nHost: bench\r\n\r\n")?;
    let mut buf = vec![0u8; 256 * 1024];
    let mut total = 0u64;
    loop {
        let n = socket.read(&mut buf)?;
        if n == 0 {
            break;
        }
        total += n as u64;
    }
    Ok((started.elapsed(), total))
}

/// The echo of one byte on a terminal of the host (non-canonical, echo
/// on): the kernel's own cost, the floor.
fn host_echo(iterations: usize, warmup: usize) -> anyhow::Result<Vec<Duration>> {
    use rustix::termios::{tcgetattr, tcsetattr, LocalModes, OptionalActions};
    let master =
        rustix::pty::openpt(rustix::pty::OpenptFlags::RDWR | rustix::pty::OpenptFlags::NOCTTY)?;
    rustix::pty::grantpt(&master)?;
    rustix::pty::unlockpt(&master)?;
    let name = rustix::pty::ptsname(&master, Vec::new())?;
    let slave = rustix::fs::open(
        name.as_c_str(),
        rustix::fs::OFlags::RDWR | rustix::fs::OFlags::NOCTTY,
        rustix::fs::Mode::empty(),
    )?;
    let mut modes = tcgetattr(&slave)?;
    modes.local_modes.remove(LocalModes::ICANON);
    tcsetattr(&slave, OptionalActions::Now, &modes)?;
    let mut samples = Vec::with_capacity(iterations);
    let mut byte = [0u8; 1];
    for i in 0..warmup + iterations {
        let key = [b'a' + (i % 26) as u8];
        let started = Instant::now();
        rustix::io::write(&master, &key)?;
        rustix::io::read(&master, &mut byte)?;
        if i >= warmup {
            samples.push(started.elapsed());
        }
        // The slave's input queue would fill up: drain it, untimed.
        let mut sink = [0u8; 64];
        let _ = rustix::io::ioctl_fionbio(&slave, true);
        while rustix::io::read(&slave, &mut sink).is_ok_and(|n| n > 0) {}
    }
    Ok(samples)
}

fn mbps(bytes: u64, took: Duration) -> f64 {
    bytes as f64 / took.as_secs_f64() / 1e6
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

/// Runs the phase on `daemon`.
pub async fn measure(
    daemon: &mut Daemon,
    iterations: usize,
    warmup: usize,
) -> anyhow::Result<InteractiveReport> {
    let run = daemon.create_run().await?;
    let id = run.id.to_string();
    let client = daemon.client.clone();

    eprintln!("runbox-bench: interactive: keystroke echo");
    let session = client
        .exec_session(
            &id,
            &ExecRequest {
                cmd: vec![
                    "sh".into(),
                    "-c".into(),
                    "stty -icanon; echo ready; exec cat >/dev/null".into(),
                ],
                pty: Some(PtySpec {
                    rows: 24,
                    cols: 80,
                    term: None,
                }),
                ..Default::default()
            },
        )
        .await?;
    let mut events = session.events;
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("ready") {
        match tokio::time::timeout(SAMPLE_TIMEOUT, events.next()).await? {
            Some(Ok(ExecEvent::Stdout(chunk))) => seen.extend_from_slice(&chunk),
            Some(Ok(_)) => {}
            other => anyhow::bail!("the terminal session ended: {other:?}"),
        }
    }
    let mut echo = Vec::with_capacity(iterations);
    for i in 0..warmup + iterations {
        let key = b'a' + (i % 26) as u8;
        let started = Instant::now();
        session.writer.stdin(vec![key]).await?;
        loop {
            match tokio::time::timeout(SAMPLE_TIMEOUT, events.next()).await? {
                Some(Ok(ExecEvent::Stdout(chunk))) if chunk.contains(&key) => break,
                Some(Ok(_)) => {}
                other => anyhow::bail!("the terminal session ended: {other:?}"),
            }
        }
        if i >= warmup {
            echo.push(started.elapsed());
        }
    }
    drop(events);
    drop(session.writer);
    let echo_host = tokio::task::spawn_blocking(move || host_echo(iterations, warmup)).await??;

    eprintln!("runbox-bench: interactive: preview proxy");
    let setup = format!(
        "mkdir -p /work/www && head -c 1024 /dev/zero > /work/www/small.txt && \
         head -c {LARGE_FILE} /dev/zero > /work/www/large.bin && \
         head -c {TUNNEL_BYTES} /dev/zero > /work/www/tunnel.bin"
    );
    let out = client
        .exec(
            &id,
            &ExecRequest {
                cmd: vec!["sh".into(), "-c".into(), setup],
                ..Default::default()
            },
        )
        .await?
        .collect_output()
        .await?;
    ensure!(
        out.exit.exit_code == 0,
        "setting up the files failed: {out:?}"
    );
    client
        .start_process(
            &id,
            &ExecRequest {
                cmd: vec![
                    "sh".into(),
                    "-c".into(),
                    format!("exec httpd -f -p {WEB_PORT} -h /work/www"),
                ],
                ..Default::default()
            },
        )
        .await?;
    let netns = std::path::Path::new(runbox_runtime::netns::NETNS_DIR)
        .join(runbox_runtime::oci::netns_name(run.id));
    let inside = InNetns::join(&netns)?;
    let deadline = Instant::now() + SAMPLE_TIMEOUT;
    while inside
        .run(|| std::net::TcpStream::connect(("127.0.0.1", WEB_PORT)).is_err())
        .await?
    {
        ensure!(Instant::now() < deadline, "the httpd did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let preview = client.mint_preview(&id, WEB_PORT, None).await?;
    let http = reqwest::Client::new();
    let small_url = format!("{}small.txt", preview.url);
    let (mut via_preview, mut direct) = (Vec::new(), Vec::new());
    for i in 0..warmup + iterations {
        let started = Instant::now();
        let body = http.get(&small_url).send().await?.bytes().await?;
        let took = started.elapsed();
        ensure!(
            body.len() == 1024,
            "the preview answered {} bytes",
            body.len()
        );
        let (straight, size) = inside.run(|| get_direct(WEB_PORT, "/small.txt")).await??;
        ensure!(size > 1024, "the direct GET answered {size} bytes");
        if i >= warmup {
            via_preview.push(took);
            direct.push(straight);
        }
    }
    let large_url = format!("{}large.bin", preview.url);
    let (mut preview_rates, mut direct_rates) = (Vec::new(), Vec::new());
    for _ in 0..TRANSFERS {
        let started = Instant::now();
        let mut stream = http.get(&large_url).send().await?.bytes_stream();
        let mut total = 0u64;
        while let Some(chunk) = stream.next().await {
            total += chunk?.len() as u64;
        }
        ensure!(total == LARGE_FILE, "the preview carried {total} bytes");
        preview_rates.push(mbps(total, started.elapsed()));
        let (took, size) = inside.run(|| get_direct(WEB_PORT, "/large.bin")).await??;
        direct_rates.push(mbps(size, took));
    }

    eprintln!("runbox-bench: interactive: port-forward");
    let (mut tunnel_rates, mut tunnel_direct) = (Vec::new(), Vec::new());
    for _ in 0..TRANSFERS {
        let started = Instant::now();
        let mut tunnel = client.connect_port(&id, WEB_PORT, None).await?;
        tokio::io::AsyncWriteExt::write_all(
            &mut tunnel,
            b"GET /tunnel.bin HTTP/1.0\r\nHost: bench\r\n\r\n",
        )
        .await?;
        let mut buf = vec![0u8; 1 << 20];
        let mut total = 0u64;
        loop {
            let n = tokio::io::AsyncReadExt::read(&mut tunnel, &mut buf).await?;
            if n == 0 {
                break;
            }
            total += n as u64;
        }
        ensure!(total > TUNNEL_BYTES, "the tunnel carried {total} bytes");
        tunnel_rates.push(mbps(total, started.elapsed()));
        let (took, size) = inside.run(|| get_direct(WEB_PORT, "/tunnel.bin")).await??;
        tunnel_direct.push(mbps(size, took));
    }
    daemon.delete_run(run.id).await?;
    Ok(InteractiveReport {
        runtime: daemon.runtime.clone(),
        echo: summarize(&echo).context("no samples")?,
        echo_host: summarize(&echo_host).context("no samples")?,
        preview: summarize(&via_preview).context("no samples")?,
        direct: summarize(&direct).context("no samples")?,
        preview_mbps: median(preview_rates),
        direct_mbps: median(direct_rates),
        large_bytes: LARGE_FILE,
        tunnel_mbps: median(tunnel_rates),
        tunnel_direct_mbps: median(tunnel_direct),
        tunnel_bytes: TUNNEL_BYTES,
    })
}

/// The phase as markdown.
pub fn markdown(r: &InteractiveReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\n## Interactive sessions, previews, port forwarding ({})\n",
        r.runtime
    );
    let _ = writeln!(
        out,
        "Keystroke echo: one byte sent on `GET /v1/runs/{{id}}/exec/ws` to a terminal running \
         `cat` (`stty -icanon`, echo on) until the terminal's echo of it came back; host: the same \
         byte on a terminal of the host (no runbox, no container), the kernel's own cost.\n"
    );
    let _ = writeln!(
        out,
        "| keystroke echo | n | p50 ms | p95 ms | max ms |\n|---|--:|--:|--:|--:|\n\
         | runbox WebSocket terminal | {} | {:.3} | {:.3} | {:.3} |\n\
         | host terminal | {} | {:.3} | {:.3} | {:.3} |",
        r.echo.n,
        r.echo.p50_ms,
        r.echo.p95_ms,
        r.echo.max_ms,
        r.echo_host.n,
        r.echo_host.p50_ms,
        r.echo_host.p95_ms,
        r.echo_host.max_ms
    );
    let _ = writeln!(
        out,
        "\nPreview: `GET` of a 1 KiB file from busybox `httpd` in a `none` run through its \
         preview URL (keep-alive to the preview listener; the proxy connects into the run per \
         request), next to the same `GET` on a new connection from a thread inside the run's \
         network namespace.\n"
    );
    let _ = writeln!(
        out,
        "| 1 KiB GET | n | p50 ms | p95 ms | added p50 ms |\n|---|--:|--:|--:|--:|\n\
         | through the preview URL | {} | {:.3} | {:.3} | {:.3} |\n\
         | direct, inside the namespace | {} | {:.3} | {:.3} | - |",
        r.preview.n,
        r.preview.p50_ms,
        r.preview.p95_ms,
        r.preview.p50_ms - r.direct.p50_ms,
        r.direct.n,
        r.direct.p50_ms,
        r.direct.p95_ms
    );
    let _ = writeln!(
        out,
        "\n| throughput (median of {TRANSFERS}) | MB/s | of direct |\n|---|--:|--:|\n\
         | {} MiB file through the preview URL | {:.0} | {:.2} |\n\
         | the same file, direct | {:.0} | 1.00 |\n\
         | {} MiB file over a port-forward (`GET .../ports/{{port}}/connect`, then HTTP/1.0) | {:.0} | {:.2} |\n\
         | the same download, direct | {:.0} | 1.00 |",
        r.large_bytes >> 20,
        r.preview_mbps,
        r.preview_mbps / r.direct_mbps,
        r.direct_mbps,
        r.tunnel_bytes >> 20,
        r.tunnel_mbps,
        r.tunnel_mbps / r.tunnel_direct_mbps,
        r.tunnel_direct_mbps
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::stats::summary_of_ms as ms;

    #[test]
    fn the_tables_show_the_added_latency_and_the_ratios() {
        let report = InteractiveReport {
            runtime: "crun".into(),
            echo: ms(&[1, 1]),
            echo_host: ms(&[0, 0]),
            preview: ms(&[3, 3]),
            direct: ms(&[2, 2]),
            preview_mbps: 500.0,
            direct_mbps: 1000.0,
            large_bytes: 256 << 20,
            tunnel_mbps: 1500.0,
            tunnel_direct_mbps: 3000.0,
            tunnel_bytes: 1 << 30,
        };
        let text = markdown(&report);
        assert!(
            text.contains("| through the preview URL | 2 | 3.000 | 3.000 | 1.000 |"),
            "{text}"
        );
        assert!(
            text.contains("| 256 MiB file through the preview URL | 500 | 0.50 |"),
            "{text}"
        );
        assert!(
            text.contains("| 1024 MiB file over a port-forward"),
            "{text}"
        );
    }
}
