//! `runbox-bench`: runbox's exec and start-up latency, measured side by side
//! with the raw OCI runtimes it drives (and bubblewrap as a floor), on the
//! same busybox root filesystem, what images cost, and what the egress proxy
//! costs, in one invocation.
//!
//! Four phases, each one or more tables:
//!
//! - **exec**: the round trip of `/bin/true` in a container that is already
//!   running. runbox: `POST /v1/runs/{id}/exec` until the exit event
//!   (HTTP → daemon → gRPC → agent), once after the other cases' turn and once
//!   right after another exec on the same connection (a tight loop).
//!   Baseline: `<runtime> exec` into the very same container (runbox's own,
//!   `runbox-<id>` under `<state>/oci/<runtime>`).
//! - **create**: from nothing to `/bin/true` having run. runbox: `POST
//!   /v1/runs`, then the first exec until its exit event (the run's deletion
//!   is timed on its own, outside the total). Baseline: `<runtime> run` of a
//!   bundle built with runbox's own config builder whose process is
//!   `/bin/true`. Reference: `bwrap --unshare-all`.
//! - **images** (see `images` for the generated layer): (1) unpacking a
//!   `--image-mib` layer, plain and gzip, with the image store's `add_layer`
//!   into a fresh store, next to GNU `tar -xf` into a fresh directory;
//!   (2) create + first exec from a busybox-only image and from busybox plus
//!   that layer, on every daemon; (3) with `docker-registry` and `skopeo`
//!   installed: `POST /v1/images/pull` of the large image from a registry on
//!   loopback, with no layer stored (fresh) and with every layer stored
//!   (cached), each followed by create + first exec from what it pulled, on a
//!   daemon of its own.
//! - **egress** (see `egress`; not among the defaults): the egress proxy's
//!   own code in this process, on loopback, next to the same traffic sent
//!   directly: blind-tunnel throughput, the latency a plain HTTP request
//!   gains through it, and the cost of TLS interception per request. It
//!   needs neither root nor a daemon, and runs before the other phases.
//! - **volumes** (see `volumes`; not among the defaults): a 1 GiB
//!   sequential read of a named volume in a run against the host, and what
//!   a volume adds to create + first exec.
//! - **userns** (see `userns`; not among the defaults): create + first
//!   exec, the exec round trip and fork + first exec, with a user namespace
//!   per run against `--userns off`, per runtime.
//!
//! Steps:
//! 1. build the busybox rootfs (`scripts/mkimage-busybox`) in a work dir;
//! 2. start one `runbox serve --runtime <rt>` per runtime, each with its own
//!    state dir, import the rootfs, create the run the exec phase uses;
//! 3. per phase: warm-up iterations, then measured ones; every iteration runs
//!    each case once, in an order rotated by one each time, so drift on a
//!    noisy host spreads over all cases alike (the pull cases cannot rotate:
//!    a cached pull needs the fresh one before it);
//! 4. clean up, also after an error or SIGINT/SIGTERM: delete the runs
//!    through the API, stop each daemon by pid, `runbox serve --teardown`,
//!    stop the registry by pid, force-delete the bench's own containers,
//!    remove its cgroups and the work directory;
//! 5. print the tables, and write every sample as JSON with `--json FILE`.
//!
//! What it does not do: assert anything. The numbers are reported, never
//! checked; no test runs this binary. Every phase but egress needs root,
//! runc and/or crun, and the release binaries: `cargo build --release -p
//! runbox-cli -p runbox-bench && scripts/build-agent --release`.

mod checkpoints;
mod daemon;
mod docker;
mod egress;
mod fleet;
mod image_tables;
mod images;
mod interactive;
mod loopback;
mod moves;
mod pools;
mod raw;
mod report;
mod sleep;
mod snapshots;
mod stats;
mod tenants;
mod userns;
mod volumes;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use clap::Parser;
use runbox_client::Client;
use runbox_types::{ExecRequest, Limits};
use ulid::Ulid;

use crate::daemon::Daemon;
use crate::images::{Fixture, Format, Registry, Unpack};
use crate::raw::Bundle;
use crate::report::{Host, Phase, Report, Role, Series};

/// Bound on one timed runbox call; far above any sane latency, it only keeps
/// a wedged daemon from hanging the benchmark.
const CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// Measures runbox's exec round trip and create-to-first-exec next to raw
/// runc/crun (and bubblewrap), what images cost (unpacking one next to GNU
/// tar, starting from a small and a large one, pulling one), and what the
/// egress proxy costs next to direct connections. Needs root, except for
/// `--phases egress` alone.
#[derive(Debug, Parser)]
#[command(name = "runbox-bench", version)]
struct Args {
    /// Measured iterations per case in the exec and create phases (and the
    /// images phase's start-cost table); the two flags below override it.
    #[arg(long)]
    iterations: Option<usize>,
    /// Measured iterations per case of the exec phase [default: 200].
    #[arg(long)]
    exec_iterations: Option<usize>,
    /// Measured iterations per case of the create phase, and of the images
    /// phase's start-cost table [default: 30].
    #[arg(long)]
    create_iterations: Option<usize>,
    /// Measured iterations per case of the images phase's unpack and pull
    /// tables (each takes seconds).
    #[arg(long, default_value_t = 10)]
    image_iterations: usize,
    /// Unmeasured iterations per case before the unpack and pull tables.
    #[arg(long, default_value_t = 1)]
    image_warmup: usize,
    /// MiB of file data in the images phase's generated layer.
    #[arg(long, default_value_t = 200)]
    image_mib: u64,
    /// Unmeasured iterations per case before each phase (the images phase's
    /// start-cost table and the egress phase's latency tables included; see
    /// --image-warmup for the others).
    #[arg(long, default_value_t = 10)]
    warmup: usize,
    /// OCI runtimes to compare, comma-separated [default: those of runc and
    /// crun that are installed].
    #[arg(long, value_delimiter = ',')]
    runtimes: Vec<String>,
    /// Phases to run, comma-separated (egress is not among the defaults).
    #[arg(long, value_delimiter = ',', default_value = "exec,create,images")]
    phases: Vec<PhaseName>,
    /// Measured requests per case of the egress phase's latency tables
    /// (after --warmup unmeasured ones).
    #[arg(long, default_value_t = 2000)]
    egress_iterations: usize,
    /// Measured transfers per case of the egress phase's throughput table
    /// (after one unmeasured one).
    #[arg(long, default_value_t = 5)]
    egress_transfers: usize,
    /// MiB per transfer in the egress phase's throughput table.
    #[arg(long, default_value_t = 1024)]
    egress_mib: u64,
    /// The `runbox` binary [default: beside this one].
    #[arg(long)]
    runbox: Option<PathBuf>,
    /// The static agent [default: target/x86_64-unknown-linux-gnu/<profile>/runbox-agent].
    #[arg(long)]
    agent: Option<PathBuf>,
    /// Leave out bubblewrap even when it is installed.
    #[arg(long)]
    no_bwrap: bool,
    /// Leave out the registry pulls even when docker-registry and skopeo
    /// are installed.
    #[arg(long)]
    no_pull: bool,
    /// Measured iterations per series of the snapshots phase (its start
    /// comparison takes at least 10)
    #[arg(long, default_value_t = 5)]
    snapshot_iterations: usize,
    /// Measured claims (and cold creates beside them) of the pools phase.
    #[arg(long, default_value_t = 30)]
    pool_iterations: usize,
    /// Measured keystrokes and preview requests of the interactive phase.
    #[arg(long, default_value_t = 1000)]
    interactive_iterations: usize,
    /// Measured rounds of the sleep phase (pause, resume, wake on exec).
    #[arg(long, default_value_t = 200)]
    sleep_iterations: usize,
    /// Measured iterations per series of the checkpoints phase. With
    /// `RUNBOX_BENCH_S3_STORE` (an `s3://` location, and the AWS
    /// environment to reach it; `scripts/bench-s3` sets both up) the phase
    /// also runs a daemon whose store is that bucket.
    #[arg(long, default_value_t = 3)]
    checkpoint_iterations: usize,
    /// Measured rounds of the moves phase (a move and a cold create, two
    /// wakes of archived runs); needs `RUNBOX_BENCH_S3_STORE`
    /// (`scripts/bench-s3`).
    #[arg(long, default_value_t = 5)]
    move_iterations: usize,
    /// Measured reads per case of the volumes phase (each reads 1 GiB).
    #[arg(long, default_value_t = 5)]
    volume_reads: usize,
    /// Also write the results, every sample included, as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum PhaseName {
    Exec,
    Create,
    Images,
    Egress,
    Snapshots,
    Pools,
    Interactive,
    Sleep,
    Checkpoints,
    Tenants,
    Fleet,
    Userns,
    Volumes,
    Moves,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = Args::parse();
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("runbox-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Everything resolved from the arguments before anything starts.
struct Plan {
    /// Whether any phase needs the daemons (all but egress do); when not,
    /// the fields up to `bwrap` are unchecked.
    daemons: bool,
    runbox: PathBuf,
    agent: PathBuf,
    runtimes: Vec<String>,
    bwrap: bool,
    warmup: usize,
    exec_iterations: Option<usize>,
    create_iterations: Option<usize>,
    images: Option<ImagePlan>,
    egress: Option<egress::Options>,
    snapshot_iterations: Option<usize>,
    /// MiB of the large image the snapshots phase compares with.
    snapshot_image_mib: u64,
    pool_iterations: Option<usize>,
    interactive_iterations: Option<usize>,
    sleep_iterations: Option<usize>,
    checkpoint_iterations: Option<usize>,
    tenant_iterations: Option<usize>,
    /// The fleet phase's (exec, create) iterations.
    fleet_iterations: Option<(usize, usize)>,
    /// The moves phase's rounds.
    move_iterations: Option<usize>,
    /// The userns phase's (create and fork, exec) iterations.
    userns_iterations: Option<(usize, usize)>,
    /// The volumes phase's (reads, creates) iterations.
    volume_iterations: Option<(usize, usize)>,
}

/// What the images phase does, when it runs.
struct ImagePlan {
    /// Measured iterations of the unpack and pull tables.
    iterations: usize,
    /// Their warm-up iterations.
    warmup: usize,
    /// Measured iterations of the start-cost table.
    start_iterations: usize,
    /// MiB of file data in the generated layer.
    mib: u64,
    /// Whether to measure registry pulls.
    pull: bool,
}

async fn run(args: Args) -> anyhow::Result<()> {
    ensure!(
        !needs_daemons(&args.phases) || rustix::process::geteuid().is_root(),
        "runbox-bench needs root (it starts runbox and the OCI runtimes); \
         only `--phases egress` runs without"
    );
    let plan = plan(&args)?;
    let work = tempfile::Builder::new()
        .prefix("runbox-bench-work-")
        .tempdir_in("/tmp")
        .context("creating the work directory")?;
    let mut bench = Bench {
        work: work.path().to_owned(),
        daemons: Vec::new(),
        exec_runs: Vec::new(),
        bundles: Vec::new(),
        fixture: None,
        registry: None,
        pull_daemon: None,
        unpacks: 0,
    };
    // The measurement is dropped mid-way on a signal; every resource it made
    // is recorded in `bench` first, so cleanup finds it either way.
    let outcome = tokio::select! {
        result = bench.measure(&plan) => result,
        signal = interrupted() => Err(anyhow::anyhow!("interrupted by {signal}")),
    };
    eprintln!("runbox-bench: cleaning up");
    bench.cleanup().await;
    drop(work);
    let report = outcome?;
    print!("{}", report::markdown(&report));
    if let Some(path) = &args.json {
        let json = serde_json::to_vec_pretty(&report)?;
        std::fs::write(path, json).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Whether any of `phases` starts daemons: every phase but egress does.
fn needs_daemons(phases: &[PhaseName]) -> bool {
    phases.iter().any(|p| *p != PhaseName::Egress)
}

fn plan(args: &Args) -> anyhow::Result<Plan> {
    let daemons = needs_daemons(&args.phases);
    let egress = args
        .phases
        .contains(&PhaseName::Egress)
        .then_some(egress::Options {
            transfers: args.egress_transfers,
            transfer_warmup: 1,
            transfer_bytes: args.egress_mib << 20,
            iterations: args.egress_iterations,
            warmup: args.warmup,
        });
    ensure!(
        args.egress_iterations > 0 && args.egress_transfers > 0 && args.egress_mib > 0,
        "--egress-iterations, --egress-transfers and --egress-mib must be at least 1"
    );
    if !daemons {
        return Ok(Plan {
            daemons,
            runbox: PathBuf::new(),
            agent: PathBuf::new(),
            runtimes: Vec::new(),
            bwrap: false,
            warmup: args.warmup,
            exec_iterations: None,
            create_iterations: None,
            images: None,
            egress,
            snapshot_iterations: None,
            snapshot_image_mib: args.image_mib,
            pool_iterations: None,
            interactive_iterations: None,
            sleep_iterations: None,
            checkpoint_iterations: None,
            tenant_iterations: None,
            fleet_iterations: None,
            move_iterations: None,
            userns_iterations: None,
            volume_iterations: None,
        });
    }
    let exe = std::env::current_exe().context("locating this executable")?;
    let profile_dir = exe.parent().context("this executable has no directory")?;
    let runbox = args
        .runbox
        .clone()
        .unwrap_or_else(|| profile_dir.join("runbox"));
    ensure!(
        runbox.is_file(),
        "{} is missing: build it with `cargo build --release -p runbox-cli` or pass --runbox",
        runbox.display()
    );
    let agent = match &args.agent {
        Some(agent) => agent.clone(),
        None => {
            let profile = profile_dir.file_name().context("no profile directory")?;
            let target = profile_dir.parent().context("no target directory")?;
            target
                .join("x86_64-unknown-linux-gnu")
                .join(profile)
                .join("runbox-agent")
        }
    };
    ensure!(
        agent.is_file(),
        "{} is missing: build it with `scripts/build-agent --release` or pass --agent",
        agent.display()
    );
    let agent = agent.canonicalize()?;
    let runtimes: Vec<String> = if args.runtimes.is_empty() {
        ["runc", "crun"]
            .into_iter()
            .filter(|r| raw::installed(r))
            .map(str::to_owned)
            .collect()
    } else {
        args.runtimes.clone()
    };
    ensure!(!runtimes.is_empty(), "neither runc nor crun is installed");
    for rt in &runtimes {
        ensure!(raw::installed(rt), "`{rt} --version` does not run");
    }
    let bwrap = !args.no_bwrap && raw::installed("bwrap");
    if !bwrap && !args.no_bwrap {
        eprintln!("runbox-bench: bwrap not found (apt-get install -y bubblewrap); leaving it out");
    }
    let exec_iterations = args.exec_iterations.or(args.iterations).unwrap_or(200);
    let create_iterations = args.create_iterations.or(args.iterations).unwrap_or(30);
    ensure!(
        exec_iterations > 0 && create_iterations > 0 && args.image_iterations > 0,
        "iterations must be at least 1"
    );
    ensure!(args.image_mib > 0, "--image-mib must be at least 1");
    let images = args.phases.contains(&PhaseName::Images);
    let pull = images && !args.no_pull && images::registry_tools();
    if images && !args.no_pull && !pull {
        eprintln!(
            "runbox-bench: docker-registry or skopeo not found (scripts/test-registry); \
             leaving out the pulls"
        );
    }
    if images {
        ensure!(
            raw::installed("tar"),
            "`tar --version` does not run (the images phase compares with GNU tar)"
        );
    }
    Ok(Plan {
        daemons,
        runbox,
        agent,
        runtimes,
        bwrap,
        warmup: args.warmup,
        exec_iterations: args
            .phases
            .contains(&PhaseName::Exec)
            .then_some(exec_iterations),
        create_iterations: args
            .phases
            .contains(&PhaseName::Create)
            .then_some(create_iterations),
        images: images.then_some(ImagePlan {
            iterations: args.image_iterations,
            warmup: args.image_warmup,
            start_iterations: create_iterations,
            mib: args.image_mib,
            pull,
        }),
        egress,
        snapshot_iterations: args
            .phases
            .contains(&PhaseName::Snapshots)
            .then_some(args.snapshot_iterations.max(1)),
        snapshot_image_mib: args.image_mib,
        pool_iterations: args
            .phases
            .contains(&PhaseName::Pools)
            .then_some(args.pool_iterations.max(1)),
        interactive_iterations: args
            .phases
            .contains(&PhaseName::Interactive)
            .then_some(args.interactive_iterations.max(1)),
        sleep_iterations: args
            .phases
            .contains(&PhaseName::Sleep)
            .then_some(args.sleep_iterations.max(1)),
        checkpoint_iterations: args
            .phases
            .contains(&PhaseName::Checkpoints)
            .then_some(args.checkpoint_iterations.max(1)),
        tenant_iterations: args
            .phases
            .contains(&PhaseName::Tenants)
            .then_some(exec_iterations),
        fleet_iterations: args
            .phases
            .contains(&PhaseName::Fleet)
            .then_some((exec_iterations, create_iterations)),
        move_iterations: args
            .phases
            .contains(&PhaseName::Moves)
            .then_some(args.move_iterations.max(1)),
        userns_iterations: args
            .phases
            .contains(&PhaseName::Userns)
            .then_some((create_iterations, exec_iterations)),
        volume_iterations: args
            .phases
            .contains(&PhaseName::Volumes)
            .then_some((args.volume_reads.max(1), create_iterations)),
    })
}

/// SIGINT or SIGTERM, whichever comes first.
async fn interrupted() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(term) => term,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            return "SIGINT";
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => "SIGINT",
        _ = term.recv() => "SIGTERM",
    }
}

/// One timed operation of a phase.
#[derive(Clone, Copy, Debug)]
enum Case {
    /// runbox exec of `/bin/true` in daemon `i`'s long-lived run.
    RunboxExec(usize),
    /// The same, timing the second of two execs sent back to back on one
    /// connection: a client running commands in a tight loop.
    RunboxExecBackToBack(usize),
    /// `<runtime> exec` into that same run's container.
    RuntimeExec(usize),
    /// runbox create + first exec (+ delete, timed apart) on daemon `i`.
    RunboxCreate(usize),
    /// `<runtime> run` of bundle `i`.
    RuntimeRun(usize),
    /// `bwrap --unshare-all /bin/true`.
    Bwrap,
    /// Unpacking the generated layer once.
    Unpack(Unpack),
    /// runbox create + first exec (+ delete, timed apart) on daemon `i` of
    /// the small (`false`) or the large (`true`) image.
    StartFrom(usize, bool),
}

/// What one step of a case measured: the total, and its parts where the
/// case has any (always the same parts in the same order).
struct Measured {
    total: Duration,
    parts: Vec<(&'static str, Duration)>,
}

impl From<Duration> for Measured {
    fn from(total: Duration) -> Measured {
        Measured {
            total,
            parts: Vec::new(),
        }
    }
}

/// The resources of one invocation.
struct Bench {
    work: PathBuf,
    daemons: Vec<Daemon>,
    /// Per daemon, the run the exec phase uses.
    exec_runs: Vec<Ulid>,
    /// Per runtime, the bundle the create phase runs.
    bundles: Vec<Bundle>,
    /// The images phase's layer and layouts, once built.
    fixture: Option<std::sync::Arc<Fixture>>,
    /// The local registry of the pull cases.
    registry: Option<Registry>,
    /// The daemon the pull cases use: its own, so that no other image
    /// shares the pulled layers.
    pull_daemon: Option<Daemon>,
    /// Unpacks done so far; each goes into `<work>/unpack/<n>`.
    unpacks: usize,
}

impl Bench {
    fn rootfs(&self) -> PathBuf {
        self.work.join("rootfs")
    }

    fn stderr_file(&self) -> PathBuf {
        self.work.join("stderr.log")
    }

    /// Sets up, runs the phases, and returns the report. Cleanup is the
    /// caller's.
    async fn measure(&mut self, plan: &Plan) -> anyhow::Result<Report> {
        // First, before any daemon runs beside it.
        let egress = match &plan.egress {
            Some(opts) => Some(egress::measure(opts).await?),
            None => None,
        };
        if !plan.daemons {
            return Ok(Report {
                host: host_info(plan),
                phases: Vec::new(),
                images: None,
                egress,
                snapshots: None,
                pools: None,
                interactive: None,
                sleep: None,
                checkpoints: None,
                tenants: None,
                fleet: None,
                moves: None,
                userns: None,
                volumes: None,
            });
        }
        let tar = self.make_rootfs()?;
        let mut limits: Option<Limits> = None;
        for rt in &plan.runtimes {
            eprintln!("runbox-bench: starting runbox serve --runtime {rt}");
            let daemon = Daemon::start(&plan.runbox, &plan.agent, rt).await?;
            self.daemons.push(daemon);
            let daemon = self.daemons.last_mut().context("no daemon")?;
            daemon.import(tar.clone()).await?;
            let run = tokio::time::timeout(CALL_TIMEOUT, daemon.create_run())
                .await
                .context("creating the exec run timed out")??;
            self.exec_runs.push(run.id);
            limits = Some(run.limits);
        }
        let limits = limits.context("no runtime to benchmark")?;
        // The bundles take the limits runbox gave its run, so both start
        // containers with the same cgroup settings.
        for rt in &plan.runtimes {
            let bundle = Bundle::new(rt, &self.work, &self.rootfs(), &plan.agent, &limits)?;
            self.bundles.push(bundle);
        }

        let mut phases = Vec::new();
        if let Some(iterations) = plan.exec_iterations {
            let daemons = self.daemons.len();
            let mut cases: Vec<Case> = (0..daemons).map(Case::RunboxExec).collect();
            cases.extend((0..daemons).map(Case::RunboxExecBackToBack));
            cases.extend((0..daemons).map(Case::RuntimeExec));
            let series = self.phase("exec", &cases, plan.warmup, iterations).await?;
            phases.push(Phase::new(
                "exec",
                "Exec round trip: `/bin/true` in a running container",
                "runbox: `POST /v1/runs/{id}/exec` until the exit event (client → HTTP → daemon → \
                 gRPC → agent); \"back to back\" times the second of two execs sent one right \
                 after the other, the others follow the previous case. Raw: `<runtime> --root <state>/oci/<runtime> exec runbox-<id> \
                 /bin/true` into the same container.",
                plan.warmup,
                iterations,
                series,
            ));
        }
        if let Some(iterations) = plan.create_iterations {
            let mut cases: Vec<Case> = (0..self.daemons.len()).map(Case::RunboxCreate).collect();
            cases.extend((0..self.bundles.len()).map(Case::RuntimeRun));
            if plan.bwrap {
                cases.push(Case::Bwrap);
            }
            let series = self
                .phase("create", &cases, plan.warmup, iterations)
                .await?;
            phases.push(Phase::new(
                "create",
                "Create to first exec: from nothing to `/bin/true` having run",
                "runbox: `POST /v1/runs` then exec `/bin/true` until the exit event (the \
                 DELETE is timed apart, not in the total). Raw: `<runtime> run` of a bundle \
                 built by runbox's own config builder with `/bin/true` as the process. bwrap: \
                 `bwrap --ro-bind <rootfs> / --proc /proc --dev /dev --unshare-all /bin/true`.",
                plan.warmup,
                iterations,
                series,
            ));
        }
        let images = match &plan.images {
            Some(images) => Some(self.images(plan, images, &tar).await?),
            None => None,
        };
        let snapshots = match plan.snapshot_iterations {
            Some(n) => {
                // crun's daemon when there is one: runtimes matter little
                // here (the work is the daemon's and the filesystem's).
                let i = plan.runtimes.iter().position(|r| r == "crun").unwrap_or(0);
                let work = self.work.clone();
                let mib = plan.snapshot_image_mib;
                Some(snapshots::measure(&mut self.daemons[i], n, &work, &tar, mib).await?)
            }
            None => None,
        };
        let pools = match plan.pool_iterations {
            Some(n) => {
                let i = plan.runtimes.iter().position(|r| r == "crun").unwrap_or(0);
                Some(pools::measure(&mut self.daemons[i], n).await?)
            }
            None => None,
        };
        let interactive = match plan.interactive_iterations {
            Some(n) => {
                let i = plan.runtimes.iter().position(|r| r == "crun").unwrap_or(0);
                Some(interactive::measure(&mut self.daemons[i], n, plan.warmup).await?)
            }
            None => None,
        };
        let sleep = match plan.sleep_iterations {
            Some(n) => {
                let i = plan.runtimes.iter().position(|r| r == "crun").unwrap_or(0);
                let tar = self.work.join("rootfs.tar");
                std::fs::write(&tar, self.make_rootfs()?).context("writing rootfs.tar")?;
                Some(sleep::measure(&mut self.daemons[i], n, plan.warmup, &self.work, &tar).await?)
            }
            None => None,
        };
        let checkpoints = match plan.checkpoint_iterations {
            Some(n) => {
                let i = plan.runtimes.iter().position(|r| r == "crun").unwrap_or(0);
                let runtime = self.daemons[i].runtime.clone();
                let mut s3 = match std::env::var("RUNBOX_BENCH_S3_STORE") {
                    Ok(store) if !store.is_empty() => {
                        eprintln!(
                            "runbox-bench: starting a daemon whose checkpoint store is {store}"
                        );
                        let extra = ["--checkpoint-store".to_owned(), store];
                        let daemon =
                            Daemon::start_with(&plan.runbox, &plan.agent, &runtime, &extra).await?;
                        daemon.import(tar.clone()).await?;
                        Some(daemon)
                    }
                    _ => None,
                };
                let rootfs_tar = self.work.join("rootfs.tar");
                std::fs::write(&rootfs_tar, &tar).context("writing rootfs.tar")?;
                let work = self.work.clone();
                let measured =
                    checkpoints::measure(&mut self.daemons[i], s3.as_mut(), n, &work, &rootfs_tar)
                        .await;
                if let Some(daemon) = s3 {
                    daemon.shutdown().await;
                }
                Some(measured?)
            }
            None => None,
        };
        let tenants = match plan.tenant_iterations {
            Some(n) => {
                let i = plan.runtimes.iter().position(|r| r == "crun").unwrap_or(0);
                Some(
                    tenants::measure(
                        &mut self.daemons[i],
                        &plan.runbox,
                        &plan.agent,
                        tar.clone(),
                        n,
                        plan.warmup,
                    )
                    .await?,
                )
            }
            None => None,
        };
        let fleet = match plan.fleet_iterations {
            Some((n, creates)) => {
                let i = plan.runtimes.iter().position(|r| r == "crun").unwrap_or(0);
                Some(
                    fleet::measure(
                        &mut self.daemons[i],
                        &plan.runbox,
                        &plan.agent,
                        tar.clone(),
                        n,
                        creates,
                        plan.warmup,
                    )
                    .await?,
                )
            }
            None => None,
        };
        let moves = match plan.move_iterations {
            Some(n) => {
                let i = plan.runtimes.iter().position(|r| r == "crun").unwrap_or(0);
                Some(
                    moves::measure(
                        &plan.runbox,
                        &plan.agent,
                        &plan.runtimes[i],
                        tar.clone(),
                        n,
                        plan.warmup,
                    )
                    .await?,
                )
            }
            None => None,
        };
        let userns = match plan.userns_iterations {
            Some((n, exec_n)) => {
                let mut runtimes = Vec::new();
                for daemon in &mut self.daemons {
                    runtimes.push(
                        userns::measure(
                            daemon,
                            &plan.runbox,
                            &plan.agent,
                            tar.clone(),
                            n,
                            exec_n,
                            plan.warmup,
                        )
                        .await?,
                    );
                }
                Some(userns::UsernsReport {
                    fork_files: userns::FORK_FILES,
                    runtimes,
                })
            }
            None => None,
        };
        let volumes = match plan.volume_iterations {
            Some((reads, creates)) => {
                let i = plan.runtimes.iter().position(|r| r == "crun").unwrap_or(0);
                let mut report =
                    volumes::measure(&mut self.daemons[i], reads, creates, plan.warmup).await?;
                let rootfs = self.make_rootfs()?;
                report.catalog = Some(
                    volumes::measure_catalog(
                        &plan.runbox,
                        &plan.agent,
                        &plan.runtimes[i],
                        rootfs,
                        reads,
                    )
                    .await?,
                );
                Some(report)
            }
            None => None,
        };
        Ok(Report {
            host: host_info(plan),
            tenants,
            fleet,
            moves,
            userns,
            volumes,
            phases,
            images,
            egress,
            snapshots,
            pools,
            interactive,
            sleep,
            checkpoints,
        })
    }

    /// Builds the busybox rootfs in the work dir and returns it as a tarball.
    fn make_rootfs(&self) -> anyhow::Result<Vec<u8>> {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/mkimage-busybox");
        let status = std::process::Command::new(&script)
            .arg(self.rootfs())
            .stdout(std::process::Stdio::null())
            .status()
            .with_context(|| format!("running {}", script.display()))?;
        ensure!(status.success(), "{} failed", script.display());
        let mut builder = tar::Builder::new(Vec::new());
        builder.follow_symlinks(false);
        builder
            .append_dir_all(".", self.rootfs())
            .context("taring the rootfs")?;
        Ok(builder.into_inner()?)
    }

    /// Runs `warmup + iterations` rounds of every case and returns one
    /// series per case (and per part of a case), warm-up left out.
    async fn phase(
        &mut self,
        name: &str,
        cases: &[Case],
        warmup: usize,
        iterations: usize,
    ) -> anyhow::Result<Vec<Series>> {
        let series = self.phase_by_case(name, cases, warmup, iterations).await?;
        Ok(series.into_iter().flatten().collect())
    }

    /// [`Bench::phase`], with the series grouped by case: the total first,
    /// then its parts.
    async fn phase_by_case(
        &mut self,
        name: &str,
        cases: &[Case],
        warmup: usize,
        iterations: usize,
    ) -> anyhow::Result<Vec<Vec<Series>>> {
        let mut series: Vec<Vec<Series>> = cases.iter().map(|c| vec![self.series(*c)]).collect();
        let rounds = warmup + iterations;
        let every = (rounds / 10).max(1);
        let started = Instant::now();
        for round in 0..rounds {
            for k in 0..cases.len() {
                let index = (round + k) % cases.len();
                let case = cases[index];
                let measured = self
                    .step(case)
                    .await
                    .with_context(|| format!("{name} phase, round {round}, {case:?}"))?;
                if round < warmup {
                    continue;
                }
                let rows = &mut series[index];
                rows[0].samples.push(measured.total);
                for (i, (part, took)) in measured.parts.into_iter().enumerate() {
                    if rows.len() <= i + 1 {
                        let mut row = self.series(case);
                        row.label = format!("{part} ({})", row.runtime.as_deref().unwrap_or(""));
                        row.role = Role::Part;
                        rows.push(row);
                    }
                    rows[i + 1].samples.push(took);
                }
            }
            if (round + 1) % every == 0 || round + 1 == rounds {
                eprintln!(
                    "runbox-bench: {name}: round {}/{rounds} ({warmup} warm-up), {:.0?}",
                    round + 1,
                    started.elapsed()
                );
            }
        }
        Ok(series)
    }

    /// An empty series for `case`'s total.
    fn series(&self, case: Case) -> Series {
        let (label, role, runtime) = match case {
            Case::RunboxExec(i) => {
                let rt = self.daemons[i].runtime.as_str();
                (format!("runbox exec ({rt})"), Role::Runbox, Some(rt))
            }
            Case::RunboxExecBackToBack(i) => {
                let rt = self.daemons[i].runtime.as_str();
                (
                    format!("runbox exec, back to back ({rt})"),
                    Role::Runbox,
                    Some(rt),
                )
            }
            Case::RuntimeExec(i) => {
                let rt = self.daemons[i].runtime.as_str();
                (format!("{rt} exec"), Role::Baseline, Some(rt))
            }
            Case::RunboxCreate(i) => {
                let rt = self.daemons[i].runtime.as_str();
                (
                    format!("runbox create + first exec ({rt})"),
                    Role::Runbox,
                    Some(rt),
                )
            }
            Case::RuntimeRun(i) => {
                let rt = self.bundles[i].runtime();
                (format!("{rt} run"), Role::Baseline, Some(rt))
            }
            Case::Bwrap => ("bwrap --unshare-all".to_owned(), Role::Reference, None),
            Case::Unpack(how) => {
                let label = match how {
                    Unpack::AddLayer(Format::Plain) => "runbox Store::add_layer, plain",
                    Unpack::Unpacker => "runbox unpack_layer alone (no digest), plain",
                    Unpack::Tar(Format::Plain) => "tar -xf, plain",
                    Unpack::AddLayer(Format::Gzip) => "runbox Store::add_layer, gzip",
                    Unpack::Tar(Format::Gzip) => "tar -xzf, gzip",
                };
                let role = match how {
                    Unpack::Tar(_) => Role::Baseline,
                    _ => Role::Runbox,
                };
                (label.to_owned(), role, None)
            }
            Case::StartFrom(i, large) => {
                let rt = self.daemons[i].runtime.as_str();
                let image = if large { "large" } else { "small" };
                (
                    format!("create + first exec, {image} image ({rt})"),
                    Role::Runbox,
                    Some(rt),
                )
            }
        };
        Series {
            label,
            role,
            runtime: runtime.map(str::to_owned),
            samples: Vec::new(),
        }
    }

    /// Runs one case once.
    async fn step(&mut self, case: Case) -> anyhow::Result<Measured> {
        let stderr = self.stderr_file();
        match case {
            Case::RunboxExec(i) => {
                let id = self.exec_runs[i].to_string();
                let daemon = &self.daemons[i];
                runbox_true(&daemon.client, &id)
                    .await
                    .with_context(|| format!("daemon log:\n{}", daemon.log_tail()))
                    .map(Measured::from)
            }
            Case::RunboxExecBackToBack(i) => {
                let id = self.exec_runs[i].to_string();
                let daemon = &self.daemons[i];
                // Only the second exec's time is kept: it is sent the moment
                // the first one's exit event arrives.
                let pair = async {
                    runbox_true(&daemon.client, &id).await?;
                    runbox_true(&daemon.client, &id).await
                };
                pair.await
                    .with_context(|| format!("daemon log:\n{}", daemon.log_tail()))
                    .map(Measured::from)
            }
            Case::RuntimeExec(i) => {
                let daemon = &self.daemons[i];
                let cid = runbox_runtime::oci::container_id(self.exec_runs[i]);
                raw::exec(&daemon.runtime, &daemon.runtime_root(), &cid, &stderr)
                    .await
                    .map(Measured::from)
            }
            Case::RunboxCreate(i) => create_first_exec(&mut self.daemons[i], daemon::IMAGE).await,
            Case::RuntimeRun(i) => self.bundles[i].run(&stderr).await.map(Measured::from),
            Case::Bwrap => raw::bwrap(&self.rootfs(), &stderr)
                .await
                .map(Measured::from),
            Case::Unpack(how) => {
                let fixture = self.fixture.as_ref().context("no image fixture")?;
                self.unpacks += 1;
                let scratch = self.work.join("unpack").join(self.unpacks.to_string());
                images::unpack_once(fixture, &scratch, how, &stderr)
                    .await
                    .map(Measured::from)
            }
            Case::StartFrom(i, large) => {
                let image = if large {
                    images::LARGE_IMAGE
                } else {
                    images::SMALL_IMAGE
                };
                create_first_exec(&mut self.daemons[i], image).await
            }
        }
    }

    /// Removes everything this invocation made; reports problems and goes on.
    async fn cleanup(&mut self) {
        for daemon in self.daemons.drain(..) {
            daemon.shutdown().await;
        }
        if let Some(daemon) = self.pull_daemon.take() {
            daemon.shutdown().await;
        }
        if let Some(mut registry) = self.registry.take() {
            registry.stop();
        }
        for bundle in &self.bundles {
            bundle.cleanup();
        }
    }
}

/// `POST /v1/runs` of `image` on `daemon`, then `/bin/true` in it until its
/// exit event: the total and its two steps, and the run's `DELETE`, timed
/// apart and not in the total.
async fn create_first_exec(daemon: &mut Daemon, image: &str) -> anyhow::Result<Measured> {
    let start = Instant::now();
    let run = tokio::time::timeout(CALL_TIMEOUT, daemon.create_run_of(image))
        .await
        .context("POST /v1/runs timed out")??;
    let created = Instant::now();
    let exec = runbox_true(&daemon.client, &run.id.to_string())
        .await
        .with_context(|| format!("daemon log:\n{}", daemon.log_tail()))?;
    let total = created.duration_since(start) + exec;
    let deleting = Instant::now();
    daemon.delete_run(run.id).await?;
    Ok(Measured {
        total,
        parts: vec![
            ("POST /v1/runs", created.duration_since(start)),
            ("first exec", exec),
            ("DELETE, not in the total", deleting.elapsed()),
        ],
    })
}

/// Execs `/bin/true` in run `id` and times it from sending the request to
/// receiving the exit event.
async fn runbox_true(client: &Client, id: &str) -> anyhow::Result<Duration> {
    let req = ExecRequest {
        cmd: vec![raw::TRUE.to_owned()],
        ..Default::default()
    };
    let start = Instant::now();
    let output = tokio::time::timeout(CALL_TIMEOUT, async {
        client.exec(id, &req).await?.collect_output().await
    })
    .await
    .context("exec timed out")?
    .context("exec")?;
    let elapsed = start.elapsed();
    if output.exit.exit_code != 0 {
        bail!(
            "/bin/true exited with {:?}: {}",
            output.exit,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(elapsed)
}

/// What the report says about the host.
fn host_info(plan: &Plan) -> Host {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let cpu = read("/proc/cpuinfo")
        .lines()
        .find_map(|l| l.strip_prefix("model name")?.split_once(':'))
        .map(|(_, v)| v.trim().to_owned())
        .unwrap_or_else(|| "unknown CPU".to_owned());
    let os_release = read("/etc/os-release");
    let mut os = os_release
        .lines()
        .find_map(|l| l.strip_prefix("PRETTY_NAME="))
        .map(|v| v.trim_matches('"').to_owned())
        .unwrap_or_else(|| "unknown OS".to_owned());
    let debian = read("/etc/debian_version");
    if !debian.trim().is_empty() {
        os = format!("{os} ({})", debian.trim());
    }
    let cgroups = if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
        "v2"
    } else if Path::new("/sys/fs/cgroup/unified").exists() {
        "v1 (hybrid, v2 mounted at /sys/fs/cgroup/unified)"
    } else {
        "v1"
    };
    let mut tools = BTreeMap::new();
    for rt in &plan.runtimes {
        tools.insert(rt.clone(), raw::version(rt));
    }
    if plan.bwrap {
        tools.insert("bwrap".to_owned(), raw::version("bwrap"));
    }
    if let Some(images) = &plan.images {
        tools.insert("tar".to_owned(), raw::version("tar"));
        if images.pull {
            tools.insert("skopeo".to_owned(), raw::version("skopeo"));
            tools.insert(
                "docker-registry".to_owned(),
                raw::version("docker-registry"),
            );
        }
    }
    Host {
        cpu,
        cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
        kernel: read("/proc/sys/kernel/osrelease").trim().to_owned(),
        os,
        cgroups: cgroups.to_owned(),
        tools,
    }
}
