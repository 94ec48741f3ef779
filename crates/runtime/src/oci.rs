//! The OCI runtime lane: each run is an OCI bundle started by `runc`, `crun`
//! or `runsc`, with runbox-agent as its PID 1.
//!
//! Per run, under `<state-dir>/runs/<id>/`:
//!
//! ```text
//! runtime       which runtime started it (written first, read by destroy)
//! network       the run's network tier (read by egress_listener)
//! disk/         the run's writable layer, limited to limits.diskMb
//!               (a btrfs subvolume with a qgroup, see crate::storage):
//!   upper/      the overlay's upper directory
//!   ovl-work/   overlayfs' scratch directory
//!   warm/       the warm volume's layer (runs with one):
//!     upper/    what the run wrote to its volume
//!     ovl-work/ overlayfs' scratch directory
//!     empty/    the lower layer of a volume without a template
//! rootfs/       the merged root: image (read-only lower) + upper
//! warm/         the merged warm volume: template (read-only lower) +
//!               disk/warm/upper, bind-mounted at the volume's path
//! config.json   the OCI runtime config
//! agent.sock    the agent's listening socket (created here, passed as fd 3)
//! runtime.log   the runtime's own log, read when it fails
//! init.pid      the container init's host pid (crate::watch)
//! trust.pem     image CA bundle + extra CAs     } only when the spec has
//! ca.pem        the extra CAs alone             } trust_pem (crate::trust)
//! net.json      the open run's /30 and names    } open tier only
//! resolv.conf   the open run's resolver config  } (crate::open_net)
//! ```
//!
//! Plus, outside that directory: the network namespace `/run/netns/runbox-<id>`,
//! the cgroup `/runbox/<id>` and the runtime's container `runbox-<id>` (state
//! under `<state-dir>/oci/<runtime>`); for open runs also a veth pair and an
//! nftables set element (see [`crate::open_net`]). Every one of them is
//! named after the run id, so [`Lane::sweep`] can find and remove what a
//! crash left behind.
//!
//! Network tiers: `none` and `allowlist` runs get the same namespace, with
//! loopback only: no other interface, no route. An `allowlist` run reaches
//! the outside only through the egress proxy, whose listening socket
//! [`Sandbox::egress_listener`] creates on the run's own loopback
//! ([`crate::netns::EGRESS_PROXY_ADDR`], and the SOCKS5 door's beside it
//! for runs that ask) for the daemon to serve. `open`
//! runs get a veth pair and NAT ([`crate::open_net`]); when the host cannot
//! do that (no nftables), creating one fails rather than falling back to
//! another tier.
//!
//! Creation steps, in order (each undone by `destroy`):
//! 1. create the run directory and record the runtime name and network tier;
//! 2. make the run's limited disk, mount the overlay; write the trust files
//!    when the spec has extra CAs;
//! 3. create the network namespace with loopback up (open: and its veth);
//!    steps 2 and 3 run side by side (the namespace on a blocking thread);
//! 4. bind the agent socket;
//! 5. write config.json;
//! 6. `<runtime> run --detach --preserve-fds 1`, handing the socket over as fd 3.
//!
//! The agent's socket is created by the daemon in a directory the sandbox
//! cannot see, and the sandbox only gets the listening file descriptor. So no
//! path inside the run leads to the socket, and a run cannot swap it for a
//! symlink that would make the daemon talk to something else.

use std::collections::HashSet;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use std::sync::Arc;

use async_trait::async_trait;
use runbox_core::lane::{
    AgentEndpoint, Capabilities, Capture, ExitWatch, History, KeptPoint, Lane, LaneError, Sandbox,
    SandboxSpec, Since, Support, VolumeBind,
};
use runbox_core::runs::error_chain;
use runbox_core::telemetry::Laps;
use runbox_types::NetworkTier;
use tokio::process::Command;
use ulid::Ulid;

use crate::netns::bind_in_netns;
use crate::open_net::{self, OpenNet, OpenPool, Subnet, RESOLV_CONF_PATH};
use crate::probe::Runtime;
use crate::spec::{self, FileMount, SpecParams};
use crate::storage::RunStorage;
use crate::trust::{self, EXTRA_CA_PATH, TRUST_BUNDLE_PATH};
use runbox_core::userns::{IdRanges, RANGE};
use runbox_host::idmap::Extent;
use runbox_host::mounts::{check_mount_safe, is_mount_point, mount_overlay};
use std::os::fd::{AsFd, OwnedFd};

/// How long destroy waits for the processes left in a run's cgroups.
const CGROUP_DRAIN: Duration = Duration::from_secs(5);

/// How long one runtime command (`run -d`, `delete`, ...) may take.
const RUNTIME_TIMEOUT: Duration = Duration::from_secs(60);

/// Environment of the agent process itself (commands get their own).
const AGENT_ENV: &[&str] = &["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"];

/// Host-wide settings of an [`OciLane`].
#[derive(Clone, Debug)]
pub struct OciOptions {
    /// The IPv4 network open runs take a /30 each from
    /// (default [`open_net::DEFAULT_OPEN_POOL`], 10.231.0.0/16). It must not
    /// overlap a network the host uses.
    pub open_pool: OpenPool,
    /// The nftables table (family `inet`) holding the open tier's rules
    /// (default [`open_net::DEFAULT_NFT_TABLE`]). Two daemons on one host
    /// need different tables and pools.
    pub nft_table: String,
    /// The host id ranges runs' user namespaces take; None: runs share the
    /// host's user namespace (`--userns off`).
    pub userns: Option<IdRanges>,
}

impl Default for OciOptions {
    fn default() -> OciOptions {
        OciOptions {
            open_pool: open_net::DEFAULT_OPEN_POOL,
            nft_table: open_net::DEFAULT_NFT_TABLE.to_owned(),
            userns: None,
        }
    }
}

/// The file in a run's directory naming the first host id of its user
/// namespace's range; a run without one shares the host's.
const IDBASE_FILE: &str = "idbase";

/// Where a run's user namespace is pinned (a bind mount of it).
const USERNS_FILE: &str = "userns";

/// Where a run's image layers are mounted with its id mapping, one
/// directory per layer, base first.
const LOWER_DIR: &str = "lower";

/// Where a run with a user namespace has its named volumes mapped (one
/// idmapped mount each, `volumes/<n>`), for the runtime to bind from.
const VOLUMES_DIR: &str = "volumes";

/// The file in a run's disk (beside `upper/`) naming the first host id
/// its files are owned from. It goes wherever the disk goes: into every
/// capture, a fork's disk and a kept layer, so each says how to map it
/// (and `runbox_image::capture` how to write it with the ids the run saw).
/// Absent: owned as the run saw them (a run without a user namespace).
pub const DISK_IDBASE_FILE: &str = runbox_image::capture::IDBASE_FILE;

/// The id base `dir` (a disk, capture or kept layer) records; 0 without.
fn recorded_base(dir: &Path) -> Result<u32, LaneError> {
    let path = dir.join(DISK_IDBASE_FILE);
    match std::fs::read_to_string(&path) {
        Ok(text) => text
            .trim()
            .parse()
            .map_err(|_| LaneError::Failed(format!("{} is not a host id", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(0),
        Err(e) => Err(LaneError::io(format!("reading {}", path.display()))(e)),
    }
}

/// The OCI runtime lane. Cheap to share: its sandboxes' handles
/// ([`OciSandbox`]) hold the same state.
pub struct OciLane(Arc<Shared>);

/// What the lane and every handle of its sandboxes share.
struct Shared {
    runtime: Runtime,
    state_dir: PathBuf,
    agent_binary: PathBuf,
    swap_limit: bool,
    open: OpenNet,
    storage: RunStorage,
    capabilities: Capabilities,
    /// The id ranges of runs' user namespaces, when runs get one.
    userns: Option<std::sync::Mutex<IdRanges>>,
    /// One lock per run around its freezer: a capture (freeze, snapshot,
    /// thaw) and a pause or resume of the same run happen one after the
    /// other, so a capture never thaws a run paused under it and a pause
    /// never waits on a freezer a capture is thawing.
    freezes: std::sync::Mutex<std::collections::HashMap<Ulid, Arc<tokio::sync::Mutex<()>>>>,
    /// Catalog datasets mounted on the host, and who holds each.
    datasets: runbox_host::datasets::Datasets,
    /// The seccomp profile compiled once, for a runtime that takes it
    /// ready-made (crun; see [`crate::seccomp::compile`]).
    seccomp_bpf: Option<String>,
}

/// One sandbox of the OCI lane, by its run's id: everything about it is
/// found from the id (its directory, container, namespace and cgroup).
pub struct OciSandbox {
    lane: Arc<Shared>,
    id: Ulid,
}

impl OciLane {
    /// A lane that starts runs with `runtime` and keeps its files under
    /// `state_dir`. `agent_binary` must be the static runbox-agent. Default
    /// [`OciOptions`].
    pub fn new(
        runtime: Runtime,
        state_dir: PathBuf,
        agent_binary: PathBuf,
    ) -> Result<OciLane, LaneError> {
        OciLane::with_options(runtime, state_dir, agent_binary, OciOptions::default())
    }

    /// [`OciLane::new`] with explicit options. Probes once whether the
    /// host can give runs the open tier (see [`Capabilities::open`]).
    pub fn with_options(
        runtime: Runtime,
        state_dir: PathBuf,
        agent_binary: PathBuf,
        options: OciOptions,
    ) -> Result<OciLane, LaneError> {
        for path in [&state_dir, &agent_binary] {
            check_mount_safe(path)?;
        }
        if !open_net::valid_table_name(&options.nft_table) {
            return Err(LaneError::Failed(format!(
                "invalid nftables table name {:?}: use a letter, then up to 31 letters, digits or '_'",
                options.nft_table
            )));
        }
        let runs = state_dir.join("runs");
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&runs)
            .map_err(LaneError::io(format!("creating {}", runs.display())))?;
        let open = OpenNet::new(options.open_pool, options.nft_table, &runs);
        let storage = RunStorage::detect(&runs);
        let support = |why: Option<&str>| match why {
            None => Support::Yes,
            Some(why) => Support::No(why.to_owned()),
        };
        let userns = options.userns.map(|mut ranges| {
            claim_ranges(&runs, &mut ranges);
            std::sync::Mutex::new(ranges)
        });
        let capabilities = Capabilities {
            allowlist: Support::Yes,
            open: support(open.unsupported()),
            disk_limit: support(storage.limits_unsupported()),
            warm_volumes: Support::Yes,
            capture: Support::Yes,
            exit_watch: Support::Yes,
            dial: Support::Yes,
            suspend: Support::Yes,
            hibernate: Support::Yes,
            layers: support(storage.snapshots_unsupported()),
            user_namespaces: match &userns {
                Some(_) => Support::Yes,
                None => Support::No("runbox serve --userns off".into()),
            },
        };
        let datasets = runbox_host::datasets::Datasets::new(&state_dir.join("runs"));
        let seccomp_bpf = (runtime.name == "crun")
            .then(|| crate::seccomp::compile(&crate::seccomp::default_profile()))
            .and_then(|compiled| match compiled {
                Ok(program) => Some(crate::spec::seccomp_bpf_data(&program)),
                Err(e) => {
                    tracing::warn!(error = %e, "could not compile the seccomp profile ahead; crun compiles it for every run");
                    None
                }
            });
        Ok(OciLane(Arc::new(Shared {
            seccomp_bpf,
            datasets,
            runtime,
            state_dir,
            agent_binary,
            swap_limit: host_has_swap_accounting(),
            open,
            storage,
            capabilities,
            userns,
            freezes: Default::default(),
        })))
    }

    /// Whether new runs get a user namespace of their own.
    pub fn user_namespaces(&self) -> bool {
        self.0.userns.is_some()
    }

    /// How runs' writable layers are stored, and whether they can be limited.
    pub fn storage(&self) -> &RunStorage {
        &self.0.storage
    }

    /// Why open-tier runs cannot be created on this host, if they cannot.
    pub fn open_unsupported(&self) -> Option<&str> {
        self.0.open.unsupported()
    }

    /// The /30 of open run `id` (its address is [`Subnet::run`], its gateway
    /// [`Subnet::host`]); None for other runs.
    pub fn open_subnet(&self, id: Ulid) -> Option<Subnet> {
        self.0.open.subnet_of(id)
    }

    /// The runtime new runs use.
    pub fn runtime(&self) -> &Runtime {
        &self.0.runtime
    }

    /// The concrete handle of run `id`'s sandbox.
    pub fn oci_sandbox(&self, id: Ulid) -> OciSandbox {
        OciSandbox {
            lane: self.0.clone(),
            id,
        }
    }
}

impl Shared {
    /// The network tier run `id` was created with; None when there is no
    /// such run.
    fn network_of(&self, id: Ulid) -> Option<NetworkTier> {
        let dir = self.run_dir(id);
        match std::fs::read_to_string(dir.join("network")) {
            Ok(recorded) => [NetworkTier::None, NetworkTier::Allowlist, NetworkTier::Open]
                .into_iter()
                .find(|t| t.as_str() == recorded.trim()),
            // Runs made before the tier was recorded could only be `none`.
            Err(_) if dir.join("runtime").exists() => Some(NetworkTier::None),
            Err(_) => None,
        }
    }

    fn run_dir(&self, id: Ulid) -> PathBuf {
        self.state_dir.join("runs").join(id.to_string())
    }

    /// The lock around run `id`'s freezer (see [`Shared::freezes`]).
    fn freeze_lock(&self, id: Ulid) -> Arc<tokio::sync::Mutex<()>> {
        self.freezes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(id)
            .or_default()
            .clone()
    }

    fn runtime_root(&self, name: &str) -> PathBuf {
        runtime_root(&self.state_dir, name)
    }

    /// The runtime that started run `id`: the one named in its directory,
    /// else the current one.
    fn runtime_of(&self, id: Ulid) -> Runtime {
        let named = std::fs::read_to_string(self.run_dir(id).join("runtime")).ok();
        match named.as_deref().map(str::trim) {
            Some(name) if name != self.runtime.name => {
                Runtime::find(name).unwrap_or_else(|| self.runtime.clone())
            }
            _ => self.runtime.clone(),
        }
    }

    /// The creation steps; with `boot`, on the disk a hibernated run kept
    /// (its directory and disk exist, nothing else does).
    async fn create_steps(&self, spec: &SandboxSpec, boot: bool) -> Result<(), LaneError> {
        let id = spec.id;
        let dir = self.run_dir(id);
        let mut laps = Laps::new();
        // Fail closed before anything exists: never a different tier.
        if spec.network == NetworkTier::Open {
            if let Some(why) = self.open.unsupported() {
                return Err(LaneError::Unsupported(why.to_owned()));
            }
        }
        // 1. The directory, which runtime owns the run, and its tier.
        if boot {
            // A rollback a crash cut short is finished first.
            self.storage.settle_disk(&dir)?;
            if !dir.join(crate::storage::DISK_DIR).is_dir() {
                return Err(LaneError::Failed(format!(
                    "run {id}'s disk is gone; it cannot be booted again"
                )));
            }
        } else {
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(&dir)
                .map_err(LaneError::io(format!("creating {}", dir.display())))?;
        }
        write(&dir.join("runtime"), self.runtime.name.as_bytes())?;
        write(&dir.join("network"), spec.network.as_str().as_bytes())?;
        laps.lap("dir");
        // The run's user namespace: its range is recorded before anything
        // uses it, so a crash cannot hand it out twice.
        let userns = self.user_namespace(id, &dir, boot)?;
        if let Some(userns) = &userns {
            // The runtime sets the run up from inside its user namespace,
            // as the run's root: it must get through the run's directory
            // to its root (and no one else but host root may).
            std::os::unix::fs::chown(&dir, None, Some(userns.base))
                .and_then(|()| {
                    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o710))
                })
                .map_err(LaneError::io(format!(
                    "opening {} to the run",
                    dir.display()
                )))?;
        }
        // 2. The run's disk and overlay root, and 3. the network namespace,
        // side by side: the namespace is made on a blocking thread while
        // this one mounts. Both finish before either error is returned, so
        // the caller's cleanup sees everything that was made.
        laps.lap("userns");
        let ns_fd = userns.as_ref().map(|u| u.fd.clone());
        let (netns, root) = tokio::join!(
            async {
                let started = std::time::Instant::now();
                (create_netns(id, ns_fd).await, started.elapsed())
            },
            async { self.make_root(spec, &dir, boot, userns.as_ref(), &mut laps) }
        );
        let (netns, netns_took) = netns;
        laps.lap("root+netns");
        laps.beside("netns", netns_took);
        let (rootfs, trust_files, volume) = root?;
        let netns = netns?;
        let volume_sources = self.volume_sources(spec, &dir, userns.as_ref())?;
        let resolv_conf = match spec.network {
            NetworkTier::None | NetworkTier::Allowlist => None,
            NetworkTier::Open => Some(self.open.setup(id, &dir, &netns_name(id)).await?),
        };
        laps.lap("volumes+net");
        // 4. The agent's socket.
        let socket = dir.join("agent.sock");
        remove_if_present(&socket)?;
        let listener = std::os::unix::net::UnixListener::bind(&socket)
            .map_err(LaneError::io(format!("binding {}", socket.display())))?;
        std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o600))
            .map_err(LaneError::io("restricting the agent socket"))?;
        // 5. The bundle config.
        let agent_args = ["--listen-fd".to_owned(), "3".to_owned()];
        let env: Vec<String> = AGENT_ENV.iter().map(|s| s.to_string()).collect();
        let cgroups_path = format!("/runbox/{id}");
        let mut files = Vec::new();
        if let Some(t) = &trust_files {
            files.push(FileMount {
                source: &t.bundle,
                destination: TRUST_BUNDLE_PATH,
            });
            files.push(FileMount {
                source: &t.extra,
                destination: EXTRA_CA_PATH,
            });
        }
        if let Some(path) = &resolv_conf {
            files.push(FileMount {
                source: path,
                destination: RESOLV_CONF_PATH,
            });
        }
        let params = SpecParams {
            rootfs: &rootfs,
            agent_binary: &self.agent_binary,
            agent_args: &agent_args,
            hostname: "runbox",
            netns_path: Some(&netns),
            cgroups_path: &cgroups_path,
            limits: &spec.limits,
            swap_limit: self.swap_limit,
            env: &env,
            files: &files,
            volume: match (&volume, &spec.warm) {
                (Some(source), Some(warm)) => Some(FileMount {
                    source,
                    destination: &warm.path,
                }),
                _ => None,
            },
            volumes: &spec
                .volumes
                .iter()
                .zip(&volume_sources)
                .map(|(v, source)| crate::spec::BindMount {
                    source,
                    destination: &v.path,
                    read_only: v.read_only,
                })
                .collect::<Vec<_>>(),
            userns: userns.as_ref().map(|u| crate::spec::UserNamespace {
                path: &u.pinned,
                base: u.base,
            }),
            seccomp_bpf: self.seccomp_bpf.as_deref(),
        };
        let config = spec::build(&params)
            .map_err(|e| LaneError::Failed(format!("building the OCI config: {e}")))?;
        let json =
            serde_json::to_vec_pretty(&config).map_err(|e| LaneError::Failed(e.to_string()))?;
        write(&dir.join("config.json"), &json)?;
        laps.lap("config");
        // 6. Start it, handing over the socket.
        let log = dir.join("runtime.log");
        let mut cmd = self
            .runtime
            .command(&self.runtime_root(&self.runtime.name), &log);
        cmd.args(["run", "--detach", "--preserve-fds", "1", "--pid-file"])
            .arg(dir.join(crate::watch::PID_FILE))
            .arg("--bundle")
            .arg(&dir)
            .arg(container_id(id));
        pass_fd_as_3(&mut cmd, listener.as_raw_fd());
        run_checked(cmd, &log, "starting the container").await?;
        drop(listener);
        laps.lap("runtime");
        tracing::debug!(run = %id, boot, steps = %laps, "sandbox started");
        Ok(())
    }

    /// The user namespace run `id` runs in, if it gets one: a new run
    /// takes a range when the lane gives runs user namespaces; a run booted
    /// again keeps the range its directory names (and one made without
    /// stays without). The namespace is made anew and pinned in the run's
    /// directory for the runtime to join.
    fn user_namespace(
        &self,
        id: Ulid,
        dir: &Path,
        boot: bool,
    ) -> Result<Option<RunUserns>, LaneError> {
        let recorded = dir.join(IDBASE_FILE);
        let base = if boot {
            match std::fs::read_to_string(&recorded) {
                Ok(text) => Some(text.trim().parse::<u32>().map_err(|_| {
                    LaneError::Failed(format!("{} is not a host id", recorded.display()))
                })?),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => return Err(LaneError::io(format!("reading {}", recorded.display()))(e)),
            }
        } else {
            match &self.userns {
                Some(ranges) => {
                    let base = lock_ranges(ranges).take().ok_or_else(|| {
                        LaneError::Failed(
                            "every user namespace range of --userns-range is taken; destroy runs or widen the range"
                                .into(),
                        )
                    })?;
                    if let Err(e) = write(&recorded, base.to_string().as_bytes()) {
                        lock_ranges(ranges).give_back(base);
                        return Err(e);
                    }
                    Some(base)
                }
                None => None,
            }
        };
        let Some(base) = base else {
            return Ok(None);
        };
        let pinned = dir.join(USERNS_FILE);
        runbox_host::idmap::unpin(&pinned)
            .map_err(LaneError::io(format!("unpinning {}", pinned.display())))?;
        let fd = runbox_host::idmap::user_namespace(&[Extent::range(base, RANGE)])
            .map_err(LaneError::io(format!("making run {id}'s user namespace")))?;
        runbox_host::idmap::pin(fd.as_fd(), &pinned)
            .map_err(LaneError::io(format!("pinning run {id}'s user namespace")))?;
        Ok(Some(RunUserns {
            base,
            fd: Arc::new(fd),
            pinned,
        }))
    }

    /// Each of `layers` bind-mounted under `dir/lower/` with the mapping
    /// that shows it to the run with its owners: an image's layers hold the
    /// image's own ids (0-based); a layer this lane kept from a run's
    /// capture holds that run's host ids, and its `idbase` says from
    /// which.
    fn mapped_layers(
        &self,
        layers: &[PathBuf],
        dir: &Path,
        userns: &RunUserns,
    ) -> Result<Vec<PathBuf>, LaneError> {
        let lower = dir.join(LOWER_DIR);
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&lower)
            .or_else(|e| match e.kind() {
                std::io::ErrorKind::AlreadyExists => Ok(()),
                _ => Err(e),
            })
            .map_err(LaneError::io(format!("creating {}", lower.display())))?;
        let kept = self.state_dir.join("runs").join(crate::storage::LAYERS_DIR);
        let mut namespaces: std::collections::HashMap<u32, OwnedFd> =
            std::collections::HashMap::new();
        let mut out = Vec::with_capacity(layers.len());
        for (i, layer) in layers.iter().enumerate() {
            let from = match layer.parent() {
                Some(dir) if layer.starts_with(&kept) => recorded_base(dir)?,
                _ => 0,
            };
            if from != 0 {
                if let std::collections::hash_map::Entry::Vacant(slot) = namespaces.entry(from) {
                    let fd = shifting_namespace(from, userns.base)
                        .map_err(LaneError::io("making a user namespace to map a kept layer"))?;
                    slot.insert(fd);
                }
            }
            let ns = match namespaces.get(&from) {
                Some(fd) => fd.as_fd(),
                None => userns.fd.as_fd(),
            };
            let target = lower.join(i.to_string());
            match std::fs::create_dir(&target) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(LaneError::io(format!("creating {}", target.display()))(e)),
            }
            if !is_mount_point(&target) {
                runbox_host::idmap::idmapped_bind(layer, &target, ns).map_err(LaneError::io(
                    format!("mapping layer {} for the run", layer.display()),
                ))?;
            }
            out.push(target);
        }
        Ok(out)
    }

    /// Where the runtime binds each of the run's named volumes from: the
    /// volume itself, or for a run with a user namespace an idmapped mount
    /// of it at `dir/volumes/<n>` that shows its files (stored with the
    /// ids runs see) in the run's range.
    fn volume_sources(
        &self,
        spec: &SandboxSpec,
        dir: &Path,
        userns: Option<&RunUserns>,
    ) -> Result<Vec<PathBuf>, LaneError> {
        let store = self
            .state_dir
            .join("runs")
            .join(crate::storage::VOLUMES_DIR);
        let mut out = Vec::with_capacity(spec.volumes.len());
        for (i, volume) in spec.volumes.iter().enumerate() {
            let source = match &volume.dataset {
                Some(entry) => self.datasets.hold(entry, !volume.read_only, spec.id)?,
                None => store.join(volume.id.to_string()),
            };
            if !source.is_dir() {
                return Err(LaneError::Failed(format!(
                    "volume {} is gone from the run store",
                    volume.id
                )));
            }
            let Some(userns) = userns else {
                out.push(source);
                continue;
            };
            let mounts = dir.join(VOLUMES_DIR);
            match std::fs::DirBuilder::new().mode(0o710).create(&mounts) {
                Ok(()) => std::os::unix::fs::chown(&mounts, None, Some(userns.base)).map_err(
                    LaneError::io(format!("opening {} to the run", mounts.display())),
                )?,
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(LaneError::io(format!("creating {}", mounts.display()))(e)),
            }
            let target = mounts.join(i.to_string());
            match std::fs::create_dir(&target) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(LaneError::io(format!("creating {}", target.display()))(e)),
            }
            if !is_mount_point(&target) {
                runbox_host::idmap::idmapped_bind(&source, &target, userns.fd.as_fd()).map_err(
                    LaneError::io(format!("mapping volume {} for the run", volume.id)),
                )?;
            }
            out.push(target);
        }
        Ok(out)
    }

    /// Mounts `volumes` into run `id`'s running sandbox: each target made
    /// in its root (resolved inside it, owned by the run's root), then the
    /// volume attached there in the sandbox's mount namespace, mapped
    /// into the run's range when it has a user namespace.
    fn mount_into_running(&self, id: Ulid, volumes: &[VolumeBind]) -> Result<(), LaneError> {
        let dir = self.run_dir(id);
        let pid: i32 = std::fs::read_to_string(dir.join(runbox_host::watch::PID_FILE))
            .ok()
            .and_then(|text| text.trim().parse().ok())
            .ok_or_else(|| LaneError::Failed(format!("run {id} has no init to mount into")))?;
        let pinned = dir.join(USERNS_FILE);
        let userns = match pinned.exists() {
            true => Some(
                runbox_host::idmap::open_pinned(&pinned)
                    .map_err(LaneError::io(format!("opening run {id}'s user namespace")))?,
            ),
            false => None,
        };
        let owner = match &userns {
            Some(_) => std::fs::read_to_string(dir.join(IDBASE_FILE))
                .ok()
                .and_then(|text| text.trim().parse::<u32>().ok())
                .map(|base| runbox_confine::ops::Owner {
                    uid: base,
                    gid: base,
                }),
            None => None,
        };
        let root = runbox_confine::WorkDir::file_system(dir.join("rootfs"));
        let store = self
            .state_dir
            .join("runs")
            .join(crate::storage::VOLUMES_DIR);
        for volume in volumes {
            let source = match &volume.dataset {
                Some(entry) => self.datasets.hold(entry, !volume.read_only, id)?,
                None => store.join(volume.id.to_string()),
            };
            if !source.is_dir() {
                return Err(LaneError::Failed(format!(
                    "volume {} is gone from the run store",
                    volume.id
                )));
            }
            let target = root
                .parse(&volume.path)
                .and_then(|rel| runbox_confine::ops::make_dir(&root, &rel, 0o755, owner))
                .map_err(|e| {
                    LaneError::Failed(format!("making {} in run {id}: {e}", volume.path))
                })?;
            if target.kind != runbox_agent_proto::pb::FileKind::Directory as i32 {
                return Err(LaneError::Failed(format!(
                    "{} in run {id} is not a directory",
                    volume.path
                )));
            }
            let tree = runbox_host::idmap::detached_bind(
                &source,
                userns.as_ref().map(|fd| fd.as_fd()),
                volume.read_only,
            )
            .and_then(|tree| runbox_host::idmap::mount_into(pid, &tree, &volume.path));
            tree.map_err(LaneError::io(format!(
                "mounting volume {} at {} in run {id}",
                volume.id, volume.path
            )))?;
        }
        Ok(())
    }

    /// `disk`, whose files are stored with the ids of the range from
    /// `stored`, bind-mounted at `dir/lower/disk` with the mapping that
    /// shows them in the run's range: a fork's layer, used where it is.
    fn shifted_disk(
        &self,
        disk: &Path,
        dir: &Path,
        stored: u32,
        userns: &RunUserns,
    ) -> Result<PathBuf, LaneError> {
        let target = dir.join(LOWER_DIR).join(crate::storage::DISK_DIR);
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&target)
            .map_err(LaneError::io(format!("creating {}", target.display())))?;
        if !is_mount_point(&target) {
            let ns = shifting_namespace(stored, userns.base).map_err(LaneError::io(
                "making a user namespace to map the run's disk",
            ))?;
            runbox_host::idmap::idmapped_bind(disk, &target, ns.as_fd())
                .map_err(LaneError::io("mapping the run's disk into its range"))?;
        }
        Ok(target)
    }

    /// Step 2 of [`Shared::create_steps`]: the run's disk, the overlay
    /// root on `rootfs/`, the trust files and the warm volume; returns the
    /// root and those.
    fn make_root(
        &self,
        spec: &SandboxSpec,
        dir: &Path,
        boot: bool,
        userns: Option<&RunUserns>,
        laps: &mut Laps,
    ) -> Result<(PathBuf, Option<trust::TrustFiles>, Option<PathBuf>), LaneError> {
        let limit = spec.limits.disk_mb.map(|mb| mb << 20);
        let rootfs = dir.join("rootfs");
        let disk = match &spec.seed {
            // A hibernated run: its own disk, limit and all, as it was.
            _ if boot => dir.join(crate::storage::DISK_DIR),
            // A fork: the parent's layer as it was, shared until written.
            // Its files keep the ids they are stored with, so their range
            // gets this run as one more holder (before the clone: the
            // parent may be destroyed meanwhile).
            Some(seed) => {
                let held = match (&self.userns, userns) {
                    (Some(ranges), Some(userns)) => {
                        let from = recorded_base(seed)?;
                        (from != userns.base && lock_ranges(ranges).hold(from)).then_some(from)
                    }
                    _ => None,
                };
                match self.storage.clone_disk(seed, dir, limit) {
                    Ok(disk) => disk,
                    Err(e) => {
                        if let (Some(from), Some(ranges)) = (held, &self.userns) {
                            lock_ranges(ranges).give_back(from);
                        }
                        return Err(e);
                    }
                }
            }
            None => self.storage.create(dir, limit)?,
        };
        laps.lap("disk");
        // A disk that already holds a layer (a fork's, a hibernated run's)
        // has these directories; overlayfs clears its scratch itself.
        let existing = boot || spec.seed.is_some();
        // Where the layer is used from: the disk itself, or for a disk
        // whose files are stored with another range's ids (a fork's), an
        // idmapped mount of it that shows them in this run's range. A fork
        // so costs the same whatever its parent wrote; what it writes is
        // stored with the ids its disk already has.
        let (view, disk_base) = match userns {
            Some(userns) => {
                let stored = match recorded_base(&disk)? {
                    // A new run's disk, or a booted one from before disks
                    // recorded their range: the run's own.
                    0 if spec.seed.is_none() || boot => userns.base,
                    // A fork of a parent that had no user namespace: its
                    // files hold host ids; moved into this run's range.
                    0 => {
                        runbox_image::tree::shift_owners(&disk, 0, userns.base).map_err(
                            LaneError::io("moving the fork's layer into its user namespace range"),
                        )?;
                        userns.base
                    }
                    stored => stored,
                };
                write(&disk.join(DISK_IDBASE_FILE), stored.to_string().as_bytes())?;
                if stored == userns.base {
                    (disk.clone(), stored)
                } else {
                    (self.shifted_disk(&disk, dir, stored, userns)?, stored)
                }
            }
            None => (disk.clone(), 0),
        };
        let (upper, work) = (view.join("upper"), view.join("ovl-work"));
        for d in [&upper, &work, &rootfs] {
            match std::fs::create_dir(d) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && existing => {}
                Err(e) => return Err(LaneError::io(format!("creating {}", d.display()))(e)),
            }
        }
        // /work is every run's default directory; it exists even when the
        // image has none, and lives in the run's own layer.
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(upper.join("work"))
            .map_err(LaneError::io("creating /work in the run's layer"))?;
        for layer in &spec.image_layers {
            check_mount_safe(layer)?;
        }
        let lowers = match userns {
            Some(userns) => {
                // The writable layer is the run's: its root, scratch and
                // /work are owned by the run's root (through the view: on
                // the disk, by the range its files are stored with).
                for d in [&upper, &work, &upper.join("work")] {
                    std::os::unix::fs::lchown(d, Some(userns.base), Some(userns.base))
                        .map_err(LaneError::io(format!("handing {} to the run", d.display())))?;
                }
                let lowers = self.mapped_layers(&spec.image_layers, dir, userns)?;
                laps.lap("mapped-layers");
                lowers
            }
            None => spec.image_layers.clone(),
        };
        mount_overlay(&lowers, &upper, &work, &rootfs)?;
        laps.lap("overlay");
        // Read from the merged root, so the run's own layer cannot matter
        // yet (it is empty) and every image layer does.
        let trust_files = match &spec.trust_pem {
            Some(pem) => Some(
                trust::write_trust_files(dir, &rootfs, pem)
                    .map_err(|e| LaneError::Failed(error_chain(&e)))?,
            ),
            None => None,
        };
        let volume = match &spec.warm {
            Some(warm) => Some(mount_warm(warm, &view, disk_base, dir, existing, userns)?),
            None => None,
        };
        Ok((rootfs, trust_files, volume))
    }

    /// Everything of run `id` but its directory and disk: the container
    /// (thawed first, so a frozen one can die), mounts, open-tier network,
    /// namespace and cgroups; with `forget_net`, also the open tier's
    /// record and /30 (a hibernating run; a destroyed one gives its /30
    /// back only once its directory is gone).
    async fn stop_steps(&self, id: Ulid, forget_net: bool) -> Result<(), LaneError> {
        let dir = self.run_dir(id);
        let runtime = self.runtime_of(id);
        let root = self.runtime_root(&runtime.name);
        let cid = container_id(id);
        if runtime.may_have_container(&root, &cid).await {
            // A frozen process does not die of SIGKILL until it is thawed.
            if let Ok(freezer) = crate::freezer::Freezer::of(id) {
                let _ = freezer.thaw();
            }
            // Kill the init ourselves through its pidfd and wait for it:
            // runc's own forced delete polls the dying container in 100 ms
            // steps, so a delete that finds it already dead is much faster.
            if let Ok(init) = crate::watch::open(&dir, id) {
                init.kill(Duration::from_secs(5)).await;
            }
            // `delete --force` kills (SIGKILL) and removes in one process;
            // runc, crun and runsc all have it. Only if the state is still
            // there afterwards is the runtime asked whether the container
            // really survived (a stray directory is not a container).
            let mut delete = runtime.command(&root, Path::new("/dev/null"));
            delete.args(["delete", "--force", &cid]);
            let out = run_quiet(delete).await;
            if runtime.may_have_container(&root, &cid).await
                && runtime.has_container(&root, &cid).await
            {
                return Err(LaneError::Failed(format!(
                    "{} could not delete container {cid}: {}",
                    runtime.name,
                    out.err().unwrap_or_default()
                )));
            }
        }
        let rootfs = dir.join("rootfs");
        let volume = dir.join(WARM_DIR);
        for mount in [&volume, &rootfs] {
            if is_mount_point(mount) {
                // Lazy: a process on the host holding a file open must not
                // keep the run alive; the kernel frees the mount when it
                // lets go.
                rustix::mount::unmount(mount, rustix::mount::UnmountFlags::DETACH).map_err(
                    |e| LaneError::Failed(format!("unmounting {}: {e}", mount.display())),
                )?;
            }
        }
        // Before the namespace: the veth goes at once with its host side,
        // while a deleted namespace is torn down by the kernel later.
        if forget_net {
            self.open.remove(id, &dir).await?;
        } else {
            self.open.teardown(id, &dir).await?;
        }
        delete_netns(id).await?;
        remove_cgroups(id).await;
        for mount in [&volume, &rootfs] {
            if is_mount_point(mount) {
                return Err(LaneError::Failed(format!(
                    "{} is still mounted",
                    mount.display()
                )));
            }
        }
        // The mapped layers under the root and the mapped volumes, and
        // the pinned namespace.
        for mapped in [LOWER_DIR, VOLUMES_DIR] {
            let Ok(entries) = std::fs::read_dir(dir.join(mapped)) else {
                continue;
            };
            for entry in entries.flatten() {
                let path = entry.path();
                if is_mount_point(&path) {
                    rustix::mount::unmount(&path, rustix::mount::UnmountFlags::DETACH).map_err(
                        |e| LaneError::Failed(format!("unmounting {}: {e}", path.display())),
                    )?;
                }
            }
        }
        let pinned = dir.join(USERNS_FILE);
        runbox_host::idmap::unpin(&pinned)
            .map_err(LaneError::io(format!("unpinning {}", pinned.display())))?;
        Ok(())
    }

    async fn destroy_steps(&self, id: Ulid) -> Result<(), LaneError> {
        self.freezes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id);
        let dir = self.run_dir(id);
        self.stop_steps(id, false).await?;
        let range = std::fs::read_to_string(dir.join(IDBASE_FILE))
            .ok()
            .and_then(|t| t.trim().parse::<u32>().ok());
        // A disk stored with another range's ids (a fork's) holds that one.
        let stored = recorded_base(&dir.join(crate::storage::DISK_DIR)).unwrap_or(0);
        if dir.is_dir() {
            self.storage.settle_disk(&dir)?;
        }
        self.storage.remove(&dir)?;
        // Its history points (kept beside the run directory) go with it.
        crate::storage::remove_history(&self.state_dir.join("runs"), &id.to_string())?;
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(LaneError::io(format!("removing {}", dir.display()))(e)),
        }
        // Only now, as with the /30 below: the range is free once nothing
        // of the run can hold it.
        if let (Some(base), Some(ranges)) = (range, &self.userns) {
            let mut ranges = lock_ranges(ranges);
            ranges.give_back(base);
            if stored != 0 && stored != base {
                ranges.give_back(stored);
            }
        }
        // Only now: while net.json exists the /30 counts as taken, so a
        // crash before this point cannot hand it to two runs.
        self.open.release(id);
        Ok(())
    }

    /// [`Sandbox::hibernate`]: [`Shared::stop_steps`], then the files that
    /// described the stopped sandbox (its socket, config, pid and log).
    async fn hibernate_steps(&self, id: Ulid) -> Result<(), LaneError> {
        let dir = self.run_dir(id);
        if !dir.is_dir() {
            return Err(LaneError::Failed(format!("run {id} has no directory")));
        }
        self.stop_steps(id, true).await?;
        for name in [
            "agent.sock",
            "config.json",
            crate::watch::PID_FILE,
            "runtime.log",
        ] {
            remove_if_present(&dir.join(name))?;
        }
        Ok(())
    }
}

/// A run's user namespace while its sandbox is being made.
struct RunUserns {
    /// The host id of its uid and gid 0.
    base: u32,
    /// The namespace.
    fd: Arc<OwnedFd>,
    /// Where it is pinned for the runtime.
    pinned: PathBuf,
}

/// A user namespace whose mapping shows files stored with the ids of the
/// range from `from` as the run's (from `base`), and host root as root
/// (overlayfs' own files): for an idmapped mount of a layer another range
/// wrote.
fn shifting_namespace(from: u32, base: u32) -> std::io::Result<OwnedFd> {
    runbox_host::idmap::user_namespace(&[
        Extent {
            inside: 0,
            outside: 0,
            count: 1,
        },
        Extent {
            inside: from,
            outside: base,
            count: RANGE,
        },
    ])
}

fn lock_ranges(ranges: &std::sync::Mutex<IdRanges>) -> std::sync::MutexGuard<'_, IdRanges> {
    ranges.lock().unwrap_or_else(|p| p.into_inner())
}

/// Marks taken the ranges the run directories under `runs` name (runs a
/// restarted daemon finds again), and holds the ranges their disks are
/// stored with where that is another (forks). A range named twice, or
/// outside the pool, is reported: such a run keeps it, but it is not
/// handed out.
fn claim_ranges(runs: &Path, ranges: &mut IdRanges) {
    let Ok(entries) = std::fs::read_dir(runs) else {
        return;
    };
    let mut disks = Vec::new();
    for entry in entries.flatten() {
        let Ok(text) = std::fs::read_to_string(entry.path().join(IDBASE_FILE)) else {
            continue;
        };
        let Ok(base) = text.trim().parse::<u32>() else {
            tracing::warn!(path = %entry.path().display(), "ignoring an unreadable user namespace range");
            continue;
        };
        if !ranges.claim(base) {
            tracing::warn!(
                run = %entry.file_name().to_string_lossy(),
                base,
                "a run's user namespace range is outside --userns-range or named twice"
            );
        }
        match recorded_base(&entry.path().join(crate::storage::DISK_DIR)) {
            Ok(stored) if stored != 0 && stored != base => disks.push(stored),
            _ => {}
        }
    }
    // After every namespace's claim: a held range is a taken one.
    for stored in disks {
        ranges.hold(stored);
    }
}

/// Removes a file that may not exist.
fn remove_if_present(path: &Path) -> Result<(), LaneError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(LaneError::io(format!("removing {}", path.display()))(e)),
    }
}

#[async_trait]
impl Lane for OciLane {
    fn name(&self) -> String {
        format!("oci/{}", self.0.runtime.name)
    }

    fn capabilities(&self) -> &Capabilities {
        &self.0.capabilities
    }

    fn storage(&self) -> Option<runbox_types::StorageInfo> {
        let st = rustix::fs::statvfs(self.0.state_dir.join("runs")).ok()?;
        let block = st.f_frsize;
        Some(runbox_types::StorageInfo {
            used_bytes: st.f_blocks.saturating_sub(st.f_bfree) * block,
            total_bytes: st.f_blocks * block,
        })
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<Arc<dyn Sandbox>, LaneError> {
        match self.0.create_steps(spec, false).await {
            Ok(()) => Ok(Arc::new(self.oci_sandbox(spec.id))),
            Err(e) => {
                if let Err(cleanup) = self.0.destroy_steps(spec.id).await {
                    tracing::error!(run = %spec.id, error = %cleanup, "cleaning up a failed create");
                }
                Err(e)
            }
        }
    }

    /// What is left of the last sandbox is stopped first (idempotent);
    /// a failed boot is stopped again, down to the disk.
    async fn boot(&self, spec: &SandboxSpec) -> Result<Arc<dyn Sandbox>, LaneError> {
        self.0.hibernate_steps(spec.id).await?;
        match self.0.create_steps(spec, true).await {
            Ok(()) => Ok(Arc::new(self.oci_sandbox(spec.id))),
            Err(e) => {
                if let Err(cleanup) = self.0.hibernate_steps(spec.id).await {
                    tracing::error!(run = %spec.id, error = %cleanup, "cleaning up a failed boot");
                }
                Err(e)
            }
        }
    }

    fn sandbox(&self, id: Ulid) -> Arc<dyn Sandbox> {
        Arc::new(self.oci_sandbox(id))
    }

    fn layer_root(&self) -> Option<PathBuf> {
        self.0.capabilities.layers.yes().then(|| {
            self.0
                .state_dir
                .join("runs")
                .join(crate::storage::LAYERS_DIR)
        })
    }

    /// A writable snapshot of the capture, stripped of what the lane put in
    /// the run, made read-only (`crate::storage::RunStorage::keep_capture`);
    /// then its size, from metadata.
    async fn keep_layer(
        &self,
        capture: &Capture,
        id: Ulid,
    ) -> Result<runbox_core::lane::LayerSize, LaneError> {
        let lane = self.0.clone();
        let dir = capture
            .upper
            .parent()
            .map(Path::to_path_buf)
            .ok_or_else(|| LaneError::Failed("a capture without a directory".into()))?;
        let strip = capture.injected.clone();
        tokio::task::spawn_blocking(move || {
            let runs = lane.state_dir.join("runs");
            let name = id.to_string();
            let layer = lane.storage.keep_capture(&dir, &runs, &name, &strip)?;
            match crate::storage::tree_size(&layer.join("upper")) {
                Ok((bytes, entries)) => Ok(runbox_core::lane::LayerSize { bytes, entries }),
                Err(e) => {
                    let _ = crate::storage::remove_layer(&runs, &name);
                    Err(LaneError::io(format!("measuring layer {name}"))(e))
                }
            }
        })
        .await
        .map_err(|e| LaneError::Failed(format!("keeping a layer: {e}")))?
    }

    fn remove_layer(&self, id: &str) -> Result<(), LaneError> {
        crate::storage::remove_layer(&self.0.state_dir.join("runs"), id)
    }

    async fn create_volume(&self, id: Ulid, limit: u64) -> Result<(), LaneError> {
        let shared = self.0.clone();
        tokio::task::spawn_blocking(move || {
            let runs = shared.state_dir.join("runs");
            shared
                .storage
                .create_volume(&runs, &id.to_string(), limit)
                .map(drop)
        })
        .await
        .map_err(|e| LaneError::Failed(format!("volume task failed: {e}")))?
    }

    async fn clone_volume(&self, from: Ulid, id: Ulid, limit: u64) -> Result<(), LaneError> {
        let shared = self.0.clone();
        tokio::task::spawn_blocking(move || {
            let runs = shared.state_dir.join("runs");
            shared
                .storage
                .clone_volume(&runs, &from.to_string(), &id.to_string(), limit)
                .map(drop)
        })
        .await
        .map_err(|e| LaneError::Failed(format!("volume task failed: {e}")))?
    }

    async fn delete_volume(&self, id: Ulid) -> Result<(), LaneError> {
        let runs = self.0.state_dir.join("runs");
        tokio::task::spawn_blocking(move || crate::storage::remove_volume(&runs, &id.to_string()))
            .await
            .map_err(|e| LaneError::Failed(format!("volume task failed: {e}")))?
    }

    fn hold_dataset(
        &self,
        entry: &runbox_core::datasets::DatasetEntry,
        rw: bool,
        run: Ulid,
    ) -> Result<PathBuf, LaneError> {
        self.0.datasets.hold(entry, rw, run)
    }

    fn release_dataset(&self, entry: &runbox_core::datasets::DatasetEntry, run: Ulid) {
        self.0.datasets.release(entry, run)
    }

    fn sweep_datasets(
        &self,
        catalog: &[runbox_core::datasets::DatasetEntry],
        held: &HashSet<String>,
    ) {
        self.0.datasets.sweep(catalog, held)
    }

    fn volume_dir(&self, id: Ulid) -> Option<PathBuf> {
        Some(
            self.0
                .state_dir
                .join("runs")
                .join(crate::storage::VOLUMES_DIR)
                .join(id.to_string()),
        )
    }

    fn volume_used(&self, id: Ulid) -> Option<u64> {
        self.0
            .storage
            .volume_used(&self.0.state_dir.join("runs"), &id.to_string())
    }

    fn sweep_volumes(&self, keep: &HashSet<Ulid>) -> Vec<Ulid> {
        let runs = self.0.state_dir.join("runs");
        let mut swept = Vec::new();
        for name in crate::storage::volume_ids(&runs) {
            let Ok(id) = name.parse::<Ulid>() else {
                continue;
            };
            if keep.contains(&id) {
                continue;
            }
            match crate::storage::remove_volume(&runs, &name) {
                Ok(()) => swept.push(id),
                Err(e) => {
                    tracing::warn!(volume = %name, error = %e, "could not remove an unrecorded volume")
                }
            }
        }
        swept
    }

    fn sweep_layers(&self, keep: &HashSet<String>) -> Vec<String> {
        let runs = self.0.state_dir.join("runs");
        let mut swept = Vec::new();
        for id in crate::storage::layer_ids(&runs) {
            if keep.contains(&id) {
                continue;
            }
            match crate::storage::remove_layer(&runs, &id) {
                Ok(()) => swept.push(id),
                Err(e) => {
                    tracing::warn!(layer = %id, error = %e, "could not remove an unrecorded layer")
                }
            }
        }
        swept
    }

    /// A run a dead daemon left frozen (it died in the middle of a capture)
    /// is thawed first: the runtime would report it `paused`, and its agent
    /// could not answer. A run suspended on purpose stays frozen.
    async fn adopt(
        &self,
        id: Ulid,
        suspended: bool,
    ) -> Result<Option<Arc<dyn Sandbox>>, LaneError> {
        if !suspended {
            if let Ok(freezer) = crate::freezer::Freezer::of(id) {
                if let Err(e) = freezer.thaw() {
                    tracing::warn!(run = %id, error = %e, "could not thaw a run");
                }
            }
        }
        let runtime = self.0.runtime_of(id);
        let root = self.0.runtime_root(&runtime.name);
        let status = runtime.status(&root, &container_id(id)).await;
        let alive = match status.as_deref() {
            Some("running") => true,
            // The runtime reports a frozen container as paused.
            Some("paused") => suspended,
            _ => false,
        };
        Ok(alive.then(|| self.sandbox(id)))
    }

    async fn sweep(&self, keep: &HashSet<Ulid>) -> Result<Vec<Ulid>, LaneError> {
        let lane = &self.0;
        let mut doomed = HashSet::new();
        // Run directories nobody claims.
        let runs = lane.state_dir.join("runs");
        // Captures a dead daemon left half-used; none is in progress yet.
        crate::storage::remove_all_captures(&runs);
        // History points of runs nobody claims.
        for run in crate::storage::history_runs(&runs) {
            let claimed = Ulid::from_string(&run).is_ok_and(|id| keep.contains(&id));
            if !claimed {
                if let Err(e) = crate::storage::remove_history(&runs, &run) {
                    tracing::warn!(run = %run, error = %e, "could not remove a gone run's history");
                }
                continue;
            }
            // Points a dead daemon made but never described: half-made.
            for point in crate::storage::point_ids(&runs, &run) {
                let meta = crate::storage::point_meta(&runs, &run, &point);
                if meta.is_none_or(|m| m.is_empty()) {
                    if let Err(e) = crate::storage::remove_point(&runs, &run, &point) {
                        tracing::warn!(run = %run, point = %point, error = %e, "could not remove a half-made history point");
                    }
                }
            }
        }
        for entry in std::fs::read_dir(&runs)
            .map_err(LaneError::io(format!("reading {}", runs.display())))?
        {
            let entry = entry.map_err(LaneError::io("reading the runs directory"))?;
            match entry
                .file_name()
                .to_str()
                .and_then(|n| Ulid::from_string(n).ok())
            {
                Some(id) if !keep.contains(&id) => {
                    doomed.insert(id);
                }
                // A rollback a crash cut short is finished now, so the
                // run has its disk before anything reads it.
                Some(_) => {
                    if let Err(e) = lane.storage.settle_disk(&entry.path()) {
                        tracing::warn!(run = ?entry.file_name(), error = %e, "could not finish a rollback a crash cut short");
                    }
                }
                None if entry.file_name() == crate::storage::CAPTURES_DIR
                    || entry.file_name() == crate::storage::WARM_CACHE_DIR
                    || entry.file_name() == crate::storage::LAYERS_DIR
                    || entry.file_name() == crate::storage::VOLUMES_DIR
                    || entry.file_name() == crate::storage::HISTORY_DIR
                    || entry.file_name() == runbox_host::datasets::DATASETS_DIR => {}
                None => {
                    tracing::warn!(path = %entry.path().display(), "ignoring a stray entry in the runs directory")
                }
            }
        }
        // Containers nobody claims, in any runtime's root of this state dir.
        let oci = lane.state_dir.join("oci");
        if let Ok(entries) = std::fs::read_dir(&oci) {
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                let Some(runtime) = Runtime::find(&name) else {
                    continue;
                };
                for cid in runtime.list(&entry.path()).await {
                    if let Some(id) = cid
                        .strip_prefix("runbox-")
                        .and_then(|s| Ulid::from_string(s).ok())
                    {
                        if !keep.contains(&id) {
                            doomed.insert(id);
                        }
                    }
                }
            }
        }
        let mut swept = Vec::new();
        for id in doomed {
            match lane.destroy_steps(id).await {
                Ok(()) => swept.push(id),
                Err(e) => {
                    tracing::error!(run = %id, error = %e, "could not remove a leftover sandbox")
                }
            }
        }
        // Open-tier leftovers no run directory names (and the table, when
        // no open run is left). Like a run that cannot be removed, this is
        // logged rather than hiding which runs were swept.
        if let Err(e) = lane.open.sweep(&runs).await {
            tracing::error!(error = %e, "could not remove leftover open-tier network state");
        }
        Ok(swept)
    }
}

impl OciSandbox {
    /// A constant-time copy of the run's disk: a read-only subvolume
    /// snapshot, taken with the run frozen when `freeze` (a running run),
    /// or as it is (a stopped one).
    async fn capture_disk(&self, freeze: bool) -> Result<Capture, LaneError> {
        let id = self.id;
        let dir = self.lane.run_dir(id);
        if !dir.join(crate::storage::DISK_DIR).is_dir() {
            return Err(LaneError::Unsupported(format!(
                "run {id} predates per-run disks and cannot be captured"
            )));
        }
        let runs = self.lane.state_dir.join("runs");
        let name = Ulid::new().to_string();
        let lock = freeze.then(|| self.lane.freeze_lock(id));
        let _one_at_a_time = match &lock {
            Some(lock) => Some(lock.lock().await),
            None => None,
        };
        // A run frozen already (paused) is captured as it is and stays so.
        let freezer = match freeze {
            true => {
                let freezer = crate::freezer::Freezer::of(id)?;
                (!freezer.frozen()?).then_some(freezer)
            }
            false => None,
        };
        if let Some(freezer) = &freezer {
            freezer.freeze().await?;
        }
        let started = std::time::Instant::now();
        let snapshot = self.lane.storage.snapshot_disk(&dir, &runs, &name);
        let frozen = started.elapsed();
        let thawed = freezer.as_ref().map_or(Ok(()), |f| f.thaw());
        let copy = snapshot?;
        if let Err(e) = thawed {
            let _ = crate::storage::remove_capture(&runs, &name);
            return Err(e);
        }
        let warm_upper = copy.join(WARM_DIR).join("upper");
        let warm_upper = warm_upper.is_dir().then_some(warm_upper);
        Ok(Capture::new(
            copy.join("upper"),
            injected_paths(&dir),
            frozen,
            move || {
                if let Err(e) = crate::storage::remove_capture(&runs, &name) {
                    tracing::warn!(error = %e, capture = %name, "could not remove a capture");
                }
            },
        )
        .with_warm_upper(warm_upper))
    }

    fn runs(&self) -> PathBuf {
        self.lane.state_dir.join("runs")
    }

    fn point_dir(&self, point: Ulid) -> PathBuf {
        self.runs()
            .join(crate::storage::HISTORY_DIR)
            .join(self.id.to_string())
            .join(point.to_string())
    }
}

/// What the runtime put in run directory `dir`'s layer for the run's own
/// mounts: the agent's directory always, the files only where they are
/// mounted (elsewhere the same path is the run's own file). Never part of
/// a snapshot or a diff.
fn injected_paths(dir: &Path) -> Vec<String> {
    let mut injected = vec![".runbox".to_owned()];
    if dir.join("trust.pem").exists() {
        injected.push(TRUST_BUNDLE_PATH.trim_start_matches('/').to_owned());
    }
    if dir.join("resolv.conf").exists() {
        injected.push(RESOLV_CONF_PATH.trim_start_matches('/').to_owned());
    }
    injected
}

/// How soon after a point a change may not have moved its file's times
/// yet (file times come from a coarse clock that ticks every 1 to 10 ms,
/// by the kernel's HZ): within it, whether anything changed is asked of
/// the new snapshot, not the live disk.
const SAME_TICK: std::time::Duration = std::time::Duration::from_millis(20);

/// The inodes of a disk (or a point of it) whose changes are the
/// storage's, not the run's: the disk's root (whose only entries are the
/// layers and scratch directories) and overlayfs' scratch directories,
/// which every copy-up and boot churns.
fn churned_inodes(disk: &Path) -> Vec<u64> {
    use std::os::unix::fs::MetadataExt;
    let warm = disk.join(WARM_DIR);
    [
        disk.to_path_buf(),
        disk.join("ovl-work"),
        disk.join("ovl-work/work"),
        disk.join("ovl-work/index"),
        warm.clone(),
        warm.join("ovl-work"),
        warm.join("ovl-work/work"),
        warm.join("ovl-work/index"),
    ]
    .iter()
    .filter_map(|p| std::fs::symlink_metadata(p).ok().map(|m| m.ino()))
    .collect()
}

#[async_trait]
impl Sandbox for OciSandbox {
    fn id(&self) -> Ulid {
        self.id
    }

    fn runtime(&self) -> String {
        self.lane.runtime_of(self.id).name
    }

    /// The socket the daemon bound in the run's directory (step 4).
    fn agent(&self) -> AgentEndpoint {
        AgentEndpoint::Unix(self.lane.run_dir(self.id).join("agent.sock"))
    }

    async fn destroy(&self) -> Result<(), LaneError> {
        self.lane.destroy_steps(self.id).await
    }

    /// SIGKILL to the init through its pidfd (thawed first: a frozen
    /// process does not die), which as PID 1 of the run's pid namespace
    /// takes every process of the run with it; the pidfd turns readable
    /// only once the namespace is empty. No init (none was started, it
    /// exited, the run is asleep): nothing runs.
    async fn halt(&self) -> Result<(), LaneError> {
        if let Ok(freezer) = crate::freezer::Freezer::of(self.id) {
            let _ = freezer.thaw();
        }
        let init = match crate::watch::open(&self.lane.run_dir(self.id), self.id) {
            Ok(init) => init,
            Err(e)
                if e.kind() == std::io::ErrorKind::NotFound
                    || e.raw_os_error() == Some(libc::ESRCH) =>
            {
                return Ok(())
            }
            Err(e) => return Err(LaneError::io(format!("watching run {}'s init", self.id))(e)),
        };
        init.end(Duration::from_secs(5))
            .await
            .map_err(LaneError::io(format!("ending run {}'s processes", self.id)))
    }

    /// A pidfd on the container's init ([`crate::watch`]).
    async fn watch_exit(&self) -> Result<ExitWatch, LaneError> {
        let id = self.id;
        let watch = crate::watch::open(&self.lane.run_dir(id), id)
            .map_err(LaneError::io(format!("watching the init of run {id}")))?;
        Ok(Box::pin(watch.exited()))
    }

    /// Freezes the run, snapshots its disk subvolume (constant time: only
    /// metadata is written while it is frozen) and thaws it.
    async fn capture(&self) -> Result<Capture, LaneError> {
        self.capture_disk(true).await
    }

    async fn capture_stopped(&self) -> Result<Capture, LaneError> {
        self.capture_disk(false).await
    }

    fn usage(&self) -> Option<runbox_core::lane::Usage> {
        crate::usage::of(self.id)
    }

    fn disk_used(&self) -> Option<u64> {
        self.lane.storage.used_bytes(&self.lane.run_dir(self.id))
    }

    async fn mount_volumes(&self, volumes: &[VolumeBind]) -> Result<(), LaneError> {
        let (lane, id, volumes) = (self.lane.clone(), self.id, volumes.to_vec());
        tokio::task::spawn_blocking(move || lane.mount_into_running(id, &volumes))
            .await
            .map_err(|e| LaneError::Failed(format!("volume task failed: {e}")))?
    }

    fn warm_volume(&self) -> Option<PathBuf> {
        let volume = self.lane.run_dir(self.id).join(WARM_DIR);
        is_mount_point(&volume).then_some(volume)
    }

    async fn change_network(&self, network: NetworkTier) -> Result<(), LaneError> {
        let id = self.id;
        let current = self.lane.network_of(id);
        let movable = |tier: Option<NetworkTier>| {
            matches!(tier, Some(NetworkTier::None | NetworkTier::Allowlist))
        };
        if !movable(current) || !movable(Some(network)) {
            return Err(LaneError::Unsupported(format!(
                "run {id} moves only between the none and allowlist tiers"
            )));
        }
        // Whole or not at all: a torn record would make the run's tier
        // unreadable.
        let dir = self.lane.run_dir(id);
        tokio::task::spawn_blocking(move || {
            let staged = dir.join("network.new");
            write(&staged, network.as_str().as_bytes())?;
            std::fs::rename(&staged, dir.join("network"))
                .map_err(LaneError::io("recording the network tier"))
        })
        .await
        .map_err(|e| LaneError::Failed(format!("recording the network tier: {e}")))?
    }

    /// Binds `door`'s address inside the run's namespace. Refused for runs
    /// that are not `allowlist` ones: a proxy inside a `none` run would
    /// give it the network it was created without.
    ///
    /// Cancellation: the socket is made on a blocking thread; if this future
    /// is dropped, the socket is closed when that thread returns it.
    async fn egress_listener(
        &self,
        door: runbox_core::lane::EgressDoor,
    ) -> Result<std::net::TcpListener, LaneError> {
        let id = self.id;
        match self.lane.network_of(id) {
            Some(NetworkTier::Allowlist) => {}
            Some(other) => {
                return Err(LaneError::Unsupported(format!(
                    "run {id} has network tier {}, which has no egress proxy",
                    other.as_str()
                )))
            }
            None => {
                return Err(LaneError::Failed(format!(
                    "run {id} does not exist or has an unreadable network record"
                )))
            }
        }
        let netns = Path::new("/run/netns").join(netns_name(id));
        let bind = netns.clone();
        let addr = door.addr();
        tokio::task::spawn_blocking(move || bind_in_netns(&bind, addr))
            .await
            .map_err(|e| LaneError::Failed(format!("binding the egress listener: {e}")))?
            .map_err(LaneError::io(format!(
                "binding {addr} in {} (is a process of the run listening there?)",
                netns.display()
            )))
    }

    async fn dial(&self, port: u16) -> Result<std::net::TcpStream, LaneError> {
        let id = self.id;
        let netns = Path::new(crate::netns::NETNS_DIR).join(netns_name(id));
        if !netns.exists() {
            return Err(LaneError::Failed(format!(
                "run {id} has no network namespace"
            )));
        }
        tokio::task::spawn_blocking(move || crate::netns::connect_in_netns(&netns, port))
            .await
            .map_err(|e| LaneError::Failed(format!("connecting into run {id}: {e}")))?
            .map_err(LaneError::io(format!(
                "connecting to port {port} in run {id}"
            )))
    }

    /// Freezes the run's cgroup ([`crate::freezer`]).
    async fn suspend(&self) -> Result<(), LaneError> {
        let lock = self.lane.freeze_lock(self.id);
        let _one_at_a_time = lock.lock().await;
        crate::freezer::Freezer::of(self.id)?.freeze().await
    }

    /// Thaws the run's cgroup.
    async fn resume(&self) -> Result<(), LaneError> {
        let lock = self.lane.freeze_lock(self.id);
        let _one_at_a_time = lock.lock().await;
        crate::freezer::Freezer::of(self.id)?.thaw()
    }

    async fn keep_point(
        &self,
        point: Ulid,
        since: Option<Since>,
        meta: Vec<u8>,
    ) -> Result<Option<KeptPoint>, LaneError> {
        let (lane, id) = (self.lane.clone(), self.id);
        let runs = self.runs();
        blocking(move || {
            let dir = lane.run_dir(id);
            let (run, name) = (id.to_string(), point.to_string());
            let changed = |path: &Path, since: Since| {
                let previous = since
                    .point
                    .map(|p| {
                        runs.join(crate::storage::HISTORY_DIR)
                            .join(&run)
                            .join(p.to_string())
                    })
                    .filter(|p| p.is_dir());
                crate::storage::changed_since(
                    path,
                    since.transid,
                    &churned_inodes(path),
                    previous.as_deref(),
                    Some(since.at),
                )
            };
            // Asked of the live disk first, its metadata committed (no
            // data flushed, no snapshot): a command that changed nothing
            // costs a search. A write within a clock tick of the last
            // point may not have moved its file's times yet; that case is
            // asked of the snapshot instead, which holds its data.
            let recent = since.is_some_and(|s| s.at.elapsed().is_ok_and(|age| age < SAME_TICK));
            if let (Some(since), false) = (since, recent) {
                let disk = dir.join(crate::storage::DISK_DIR);
                let live = crate::storage::commit_metadata(&disk)
                    .and_then(|()| changed(&disk, since))
                    .map_err(LaneError::io("looking for changes in the run's disk"))?;
                if !live {
                    return Ok(None);
                }
            }
            let path = lane.storage.point_disk(&dir, &runs, &run, &name)?;
            let kept = (|| {
                let changed = match since {
                    Some(since) if recent => changed(&path, since)?,
                    _ => true,
                };
                if !changed {
                    return Ok(None);
                }
                crate::storage::write_point_meta(&runs, &run, &name, &meta)?;
                let transid = crate::storage::created_transid(&path)?;
                Ok::<_, std::io::Error>(Some(transid))
            })();
            match kept {
                Ok(Some(transid)) => Ok(Some(KeptPoint {
                    id: point,
                    transid,
                    meta,
                })),
                Ok(None) => {
                    crate::storage::remove_point(&runs, &run, &name)?;
                    Ok(None)
                }
                Err(e) => {
                    let _ = crate::storage::remove_point(&runs, &run, &name);
                    Err(LaneError::io(format!("keeping history point {name}"))(e))
                }
            }
        })
        .await
    }

    async fn settle_history(&self) -> Result<u64, LaneError> {
        let disk = self.lane.run_dir(self.id).join(crate::storage::DISK_DIR);
        blocking(move || {
            crate::storage::settled_transid(&disk)
                .map_err(LaneError::io(format!("settling {}", disk.display())))
        })
        .await
    }

    fn points(&self) -> History {
        let runs = self.runs();
        let run = self.id.to_string();
        let points = crate::storage::point_ids(&runs, &run)
            .into_iter()
            .filter_map(|name| {
                let id = Ulid::from_string(&name).ok()?;
                let meta = crate::storage::point_meta(&runs, &run, &name)?;
                let transid = crate::storage::created_transid(&self.point_dir(id)).ok()?;
                Some(KeptPoint { id, transid, meta })
            })
            .collect();
        let head =
            crate::storage::history_head(&runs, &run).and_then(|h| Ulid::from_string(&h).ok());
        History { points, head }
    }

    fn describe_point(&self, point: Ulid, meta: Vec<u8>) -> Result<(), LaneError> {
        crate::storage::write_point_meta(
            &self.runs(),
            &self.id.to_string(),
            &point.to_string(),
            &meta,
        )
        .map_err(LaneError::io(format!("describing history point {point}")))
    }

    fn set_history_head(&self, point: Option<Ulid>) -> Result<(), LaneError> {
        let point = point.map(|p| p.to_string());
        crate::storage::write_history_head(&self.runs(), &self.id.to_string(), point.as_deref())
            .map_err(LaneError::io("recording the run's history head"))
    }

    async fn drop_point(&self, point: Ulid) -> Result<(), LaneError> {
        let (runs, run) = (self.runs(), self.id.to_string());
        blocking(move || crate::storage::remove_point(&runs, &run, &point.to_string())).await
    }

    async fn drop_point_and_reclaim(&self, point: Ulid) -> Result<(), LaneError> {
        let (runs, run) = (self.runs(), self.id.to_string());
        blocking(move || crate::storage::remove_point_and_reclaim(&runs, &run, &point.to_string()))
            .await
    }

    async fn history_room(&self, limit: Option<u64>) -> Result<(), LaneError> {
        let Some(limit) = limit else { return Ok(()) };
        if !self.lane.storage.charges_snapshots() {
            return Ok(());
        }
        let (lane, id) = (self.lane.clone(), self.id);
        blocking(move || {
            lane.storage
                .relimit_disk(&lane.run_dir(id), limit.saturating_mul(2))
        })
        .await
    }

    fn point_capture(&self, point: Ulid) -> Result<Capture, LaneError> {
        let dir = self.point_dir(point);
        if !dir.is_dir() {
            return Err(LaneError::Failed(format!("history point {point} is gone")));
        }
        // A capture of its own (constant time): the point may be dropped
        // while a fork, snapshot or diff reads this.
        let runs = self.runs();
        let name = Ulid::new().to_string();
        let copy = self.lane.storage.capture_point(&dir, &runs, &name)?;
        let warm_upper = copy.join(WARM_DIR).join("upper");
        let warm_upper = warm_upper.is_dir().then_some(warm_upper);
        let injected = injected_paths(&self.lane.run_dir(self.id));
        Ok(Capture::new(
            copy.join("upper"),
            injected,
            std::time::Duration::ZERO,
            move || {
                if let Err(e) = crate::storage::remove_capture(&runs, &name) {
                    tracing::warn!(error = %e, capture = %name, "could not remove a capture");
                }
            },
        )
        .with_warm_upper(warm_upper))
    }

    fn history_bytes(&self) -> Option<u64> {
        // With simple quotas the run's disk usage counts them already.
        if self.lane.storage.charges_snapshots() {
            return None;
        }
        let runs = self.runs();
        let run = self.id.to_string();
        let mut total = 0u64;
        for name in crate::storage::point_ids(&runs, &run) {
            let dir = runs
                .join(crate::storage::HISTORY_DIR)
                .join(&run)
                .join(&name);
            total = total.saturating_add(self.lane.storage.exclusive_bytes(&dir)?);
        }
        Some(total)
    }

    async fn restore_point(&self, point: Ulid) -> Result<(), LaneError> {
        let (lane, id) = (self.lane.clone(), self.id);
        let seed = self.point_dir(point);
        blocking(move || {
            if !seed.is_dir() {
                return Err(LaneError::Failed(format!("history point {point} is gone")));
            }
            lane.storage.replace_disk(&seed, &lane.run_dir(id))
        })
        .await
    }

    async fn hibernate(&self) -> Result<(), LaneError> {
        self.lane.hibernate_steps(self.id).await
    }
}

/// The warm volume's directory: in the run's disk (its layer) and in the
/// run directory (the merged mount).
const WARM_DIR: &str = "warm";

/// Makes the warm volume: its layer in the run's `disk` (counted against
/// the run's disk limit), and the overlay of it over the template (or an
/// empty directory) at `<dir>/warm`, which the config bind-mounts at the
/// volume's path. A fork's disk already holds the parent's layer, whose
/// scratch directory is reset. Returns the merged mount.
fn mount_warm(
    warm: &runbox_core::lane::WarmMount,
    disk: &Path,
    disk_base: u32,
    dir: &Path,
    forked: bool,
    userns: Option<&RunUserns>,
) -> Result<PathBuf, LaneError> {
    let layer = disk.join(WARM_DIR);
    let (upper, work, empty) = (
        layer.join("upper"),
        layer.join("ovl-work"),
        layer.join("empty"),
    );
    if forked {
        match std::fs::remove_dir_all(&work) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(LaneError::io(format!("resetting {}", work.display()))(e)),
        }
    }
    let merged = dir.join(WARM_DIR);
    for d in [&layer, &upper, &work, &empty, &merged] {
        match std::fs::DirBuilder::new().mode(0o755).create(d) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && forked => {}
            Err(e) => return Err(LaneError::io(format!("creating {}", d.display()))(e)),
        }
    }
    let lower = match (warm.lower.clone(), userns) {
        (lower, None) => lower.unwrap_or(empty),
        (lower, Some(userns)) => {
            // The volume's layer is the run's, in its range, and says with
            // which ids its files are stored (its commits are written back
            // with the ids the run saw).
            for d in [&layer, &upper, &work, &empty] {
                std::os::unix::fs::lchown(d, Some(userns.base), Some(userns.base))
                    .map_err(LaneError::io(format!("handing {} to the run", d.display())))?;
            }
            write(
                &layer.join(DISK_IDBASE_FILE),
                disk_base.to_string().as_bytes(),
            )?;
            match lower {
                // A template holds the ids the run saw: mapped like an
                // image layer.
                Some(template) => {
                    let mapped = dir.join(LOWER_DIR).join(WARM_DIR);
                    match std::fs::DirBuilder::new()
                        .recursive(true)
                        .mode(0o700)
                        .create(&mapped)
                    {
                        Ok(()) => {}
                        Err(e) => {
                            return Err(LaneError::io(format!("creating {}", mapped.display()))(e))
                        }
                    }
                    if !is_mount_point(&mapped) {
                        runbox_host::idmap::idmapped_bind(&template, &mapped, userns.fd.as_fd())
                            .map_err(LaneError::io("mapping the warm template for the run"))?;
                    }
                    mapped
                }
                None => empty,
            }
        }
    };
    check_mount_safe(&lower)?;
    mount_overlay(&[lower], &upper, &work, &merged)?;
    Ok(merged)
}

/// Runs `work` on a blocking thread (storage calls).
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, LaneError> + Send + 'static,
) -> Result<T, LaneError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| LaneError::Failed(format!("storage task failed: {e}")))?
}

/// The OCI container id of run `id`.
pub fn container_id(id: Ulid) -> String {
    format!("runbox-{id}")
}

/// The network namespace name of run `id`.
pub fn netns_name(id: Ulid) -> String {
    format!("runbox-{id}")
}

/// Where a runtime keeps the container state of runs under `state_dir`.
pub fn runtime_root(state_dir: &Path, runtime: &str) -> PathBuf {
    state_dir.join("oci").join(runtime)
}

fn write(path: &Path, data: &[u8]) -> Result<(), LaneError> {
    std::fs::write(path, data).map_err(LaneError::io(format!("writing {}", path.display())))
}

/// Creates run `id`'s network namespace, loopback up ([`crate::netns`]),
/// owned by the run's user namespace when it has one. On a blocking
/// thread: it mounts and spawns a short-lived thread or process.
async fn create_netns(id: Ulid, userns: Option<Arc<OwnedFd>>) -> Result<PathBuf, LaneError> {
    let name = netns_name(id);
    tokio::task::spawn_blocking(move || match userns {
        Some(userns) => crate::netns::create_named_in(&name, userns.as_fd()),
        None => crate::netns::create_named(&name),
    })
    .await
    .map_err(|e| LaneError::Failed(format!("creating the network namespace: {e}")))?
    .map_err(LaneError::io(format!(
        "creating the network namespace of run {id}"
    )))
}

async fn delete_netns(id: Ulid) -> Result<(), LaneError> {
    let name = netns_name(id);
    tokio::task::spawn_blocking(move || crate::netns::delete_named(&name))
        .await
        .map_err(|e| LaneError::Failed(format!("deleting the network namespace: {e}")))?
        .map_err(LaneError::io(format!(
            "deleting the network namespace of run {id}"
        )))
}

/// Removes the run's cgroup directories if the runtime left any (a crash
/// between create and delete can).
/// Kills whatever is still in run `id`'s cgroups, waits for it to go (up
/// to [`CGROUP_DRAIN`]), and removes them. The runtime kills its container,
/// but only one it has state for: a container whose `run` was still being
/// made when a daemon died has processes and no state yet, and the cgroup
/// is where they are found whatever the runtime knows.
async fn remove_cgroups(id: Ulid) {
    let rel = format!("runbox/{id}");
    let mut dirs = vec![Path::new("/sys/fs/cgroup").join(&rel)];
    if let Ok(controllers) = std::fs::read_dir("/sys/fs/cgroup") {
        dirs.extend(controllers.flatten().map(|e| e.path().join(&rel)));
    }
    dirs.retain(|d| d.is_dir());
    let deadline = tokio::time::Instant::now() + CGROUP_DRAIN;
    loop {
        let pids: Vec<i32> = dirs
            .iter()
            .filter_map(|d| std::fs::read_to_string(d.join("cgroup.procs")).ok())
            .flat_map(|text| {
                text.lines()
                    .filter_map(|l| l.trim().parse().ok())
                    .collect::<Vec<i32>>()
            })
            .collect();
        if pids.is_empty() {
            break;
        }
        if tokio::time::Instant::now() >= deadline {
            tracing::warn!(run = %id, pids = ?pids, "processes of the run did not die; its cgroups stay");
            return;
        }
        for pid in pids {
            // SAFETY: kill(2) on a pid read from the run's own cgroup.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for dir in dirs {
        let _ = std::fs::remove_dir(dir);
    }
}

fn host_has_swap_accounting() -> bool {
    let v2 = Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
    v2 || Path::new("/sys/fs/cgroup/memory/memory.memsw.limit_in_bytes").exists()
}

/// Makes `fd` the child's fd 3, without close-on-exec, for `--preserve-fds 1`.
pub(crate) fn pass_fd_as_3(cmd: &mut Command, fd: RawFd) {
    // SAFETY: the closure runs between fork and exec and calls only
    // async-signal-safe functions (dup2, fcntl) on descriptors it owns: `fd`
    // is kept open by the caller until the child has exited.
    unsafe {
        cmd.pre_exec(move || {
            if fd == 3 {
                let flags = libc::fcntl(3, libc::F_GETFD);
                if flags < 0 || libc::fcntl(3, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            } else if libc::dup2(fd, 3) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Runs a runtime command; on failure the error carries the runtime's own
/// words from `log` (or its stderr).
///
/// All three standard streams are /dev/null: a detached container inherits
/// them, so a pipe would keep the agent writing into the daemon (and keep
/// this call waiting for an end of file that never comes). The runtime
/// reports its errors through `--log` instead.
async fn run_checked(mut cmd: Command, log: &Path, what: &str) -> Result<(), LaneError> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true);
    let child = cmd
        .spawn()
        .map_err(LaneError::io(format!("{what}: spawning the runtime")))?;
    let out = tokio::time::timeout(RUNTIME_TIMEOUT, child.wait_with_output())
        .await
        .map_err(|_| {
            LaneError::Failed(format!(
                "{what}: the runtime did not finish within {RUNTIME_TIMEOUT:?}"
            ))
        })?
        .map_err(LaneError::io(format!("{what}: waiting for the runtime")))?;
    if out.status.success() {
        return Ok(());
    }
    let mut detail = crate::probe::log_errors(log);
    if detail.is_empty() {
        detail = "no error in the runtime's log".to_owned();
    }
    Err(LaneError::Failed(format!(
        "{what}: {} ({})",
        crate::probe::bounded(&detail, 2000),
        out.status
    )))
}

/// Runs a helper command to completion; Err carries its stderr.
async fn run_quiet(mut cmd: Command) -> Result<(), String> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let out = tokio::time::timeout(RUNTIME_TIMEOUT, cmd.output())
        .await
        .map_err(|_| "timed out".to_owned())?
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_derive_from_the_id() {
        let id = Ulid::new();
        assert_eq!(container_id(id), format!("runbox-{id}"));
        assert_eq!(netns_name(id), format!("runbox-{id}"));
    }
}
