//! Builds the OCI runtime config (`config.json`) for one run.
//!
//! Owns every isolation setting a run's container gets from runc or crun:
//! the agent process and its capabilities, namespaces, mounts, the device
//! cgroup, masked and read-only `/proc` and `/sys` paths, resource limits and
//! (through [`crate::seccomp`]) the syscall filter. Docker's defaults are the
//! reference; where runbox is stricter the code says so.
//!
//! It does not own anything with side effects: preparing the overlay root,
//! creating the network namespace, creating the cgroup parent, writing the
//! bundle and invoking the runtime all belong to the caller. [`build`] is a
//! function of [`SpecParams`] and only validates what it is given; the one
//! thing it reads from the host is the daemon's own `RLIMIT_NOFILE` (see
//! [`NOFILE_LIMIT`]).

use std::path::{Component, Path, PathBuf};

use oci_spec::runtime::{
    Capabilities, Capability, LinuxBuilder, LinuxCapabilitiesBuilder, LinuxCpuBuilder,
    LinuxDeviceCgroup, LinuxDeviceCgroupBuilder, LinuxDeviceType, LinuxIdMapping,
    LinuxIdMappingBuilder, LinuxMemoryBuilder, LinuxNamespace, LinuxNamespaceBuilder,
    LinuxNamespaceType, LinuxPidsBuilder, LinuxResourcesBuilder, Mount, MountBuilder,
    PosixRlimitBuilder, PosixRlimitType, ProcessBuilder, RootBuilder, Spec, SpecBuilder,
    UserBuilder,
};
use oci_spec::OciSpecError;
use runbox_types::Limits;

use crate::seccomp;

/// Where the agent binary appears inside every run (bind-mounted read-only).
pub const AGENT_PATH: &str = "/.runbox/agent";

/// Mount options of a [`FileMount`]: read-only, and nothing in it runs or
/// acts as a device (the files are data: certificates, resolver config).
const FILE_MOUNT_OPTIONS: [&str; 5] = ["bind", "ro", "nosuid", "nodev", "noexec"];

/// The runtime-spec version written into `ociVersion`; runc 1.1 and crun 1.8
/// both accept it.
const OCI_VERSION: &str = "1.0.2";

/// CFS period in microseconds. 100 ms is the kernel's and Docker's default;
/// the quota is expressed against it.
const CPU_PERIOD_US: u64 = 100_000;

/// The kernel refuses CFS quotas below 1 ms, so cpus below 0.01 cannot work.
const MIN_CPU_QUOTA_US: f64 = 1_000.0;

/// `RLIMIT_NOFILE` for the agent (soft and hard), unless the daemon's own
/// hard limit is lower. Equal to the kernel's default `fs.nr_open`, the most
/// setrlimit accepts on a stock host.
pub const NOFILE_LIMIT: u64 = 1_048_576;

/// `HOST_NAME_MAX` on Linux: `sethostname` rejects anything longer.
const HOSTNAME_MAX: usize = 64;

/// Docker's default capability set minus `CAP_NET_RAW` (which only serves
/// `ping` and packet sniffing, and enables ARP/ICMP spoofing on shared
/// networks). Nothing here lets a process leave its namespaces: the ones
/// that would (`SYS_ADMIN`, `SYS_PTRACE`, `SYS_MODULE`, …) are absent.
const CAPABILITIES: [Capability; 13] = [
    Capability::Chown,
    Capability::DacOverride,
    Capability::Fsetid,
    Capability::Fowner,
    Capability::Mknod,
    Capability::Setgid,
    Capability::Setuid,
    Capability::Setfcap,
    Capability::Setpcap,
    Capability::NetBindService,
    Capability::SysChroot,
    Capability::Kill,
    Capability::AuditWrite,
];

/// Host information that must not be readable from inside a run; the
/// runtime bind-mounts `/dev/null` (files) or an empty read-only tmpfs
/// (directories) over each. Docker's list.
const MASKED_PATHS: [&str; 11] = [
    "/proc/asound",
    "/proc/acpi",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
];

/// Kernel knobs under `/proc` that are global rather than per-namespace;
/// the runtime remounts them read-only. Docker's list.
const READONLY_PATHS: [&str; 6] = [
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
    // On cgroup v1 the runtime mounts a tmpfs here to hold the controllers
    // (each read-only) and, in a user namespace, leaves that tmpfs
    // writable whatever the mount's own options say; remounted read-only
    // here, as on cgroup v2, where it is the cgroup2 mount itself.
    "/sys/fs/cgroup",
];

/// A host file the daemon prepared, bind-mounted read-only into the run.
///
/// The runtime resolves `destination` inside the run's root (a symlink there
/// stays inside the root) and creates it, with its parent directories, when
/// the image lacks it.
#[derive(Clone, Copy, Debug)]
pub struct FileMount<'a> {
    /// Absolute host path of the file.
    pub source: &'a Path,
    /// Absolute path inside the run, e.g. `/etc/resolv.conf`.
    pub destination: &'a str,
}

/// A directory bind-mounted into the run: a named volume.
#[derive(Clone, Copy, Debug)]
pub struct BindMount<'a> {
    /// Absolute host path of the directory.
    pub source: &'a Path,
    /// Absolute path inside the run.
    pub destination: &'a str,
    /// Mounted read-only.
    pub read_only: bool,
}

/// Everything [`build`] needs to describe one run.
#[derive(Clone, Copy, Debug)]
pub struct SpecParams<'a> {
    /// Absolute host path of the run's merged overlay root.
    pub rootfs: &'a Path,
    /// Absolute host path of the static agent binary, bind-mounted read-only
    /// at [`AGENT_PATH`].
    pub agent_binary: &'a Path,
    /// Arguments after the agent binary, e.g. `["--listen-fd", "3"]`.
    pub agent_args: &'a [String],
    /// The run's hostname (its own UTS namespace).
    pub hostname: &'a str,
    /// `Some`: join this network namespace (the daemon made it, loopback
    /// up). `None`: the runtime creates a new, empty one.
    pub netns_path: Option<&'a Path>,
    /// cgroupfs-style path such as `/runbox/01J…`, relative to the cgroup
    /// mount(s); works for cgroup v1 and v2 with runc and crun.
    pub cgroups_path: &'a str,
    /// CPU, memory and process limits.
    pub limits: &'a Limits,
    /// The host accounts swap in the memory cgroup: set memory+swap equal to
    /// the memory limit so the limit cannot be escaped by swapping.
    pub swap_limit: bool,
    /// `KEY=VALUE` environment of the agent process (not of what it runs).
    pub env: &'a [String],
    /// Files mounted read-only after every other mount, in this order.
    pub files: &'a [FileMount<'a>],
    /// A directory mounted read-write (the run's warm volume), before the
    /// files.
    pub volume: Option<FileMount<'a>>,
    /// Named volumes, after the warm volume, before the files.
    pub volumes: &'a [BindMount<'a>],
    /// The run's own user namespace, joined by path; None: the host's.
    pub userns: Option<UserNamespace<'a>>,
    /// The seccomp profile already compiled ([`seccomp_bpf_data`] of
    /// [`seccomp::compile`]), for a runtime that takes it so (crun): the
    /// config then carries it as [`SECCOMP_BPF_ANNOTATION`] beside the
    /// profile it was compiled from. None: the runtime compiles the profile.
    pub seccomp_bpf: Option<&'a str>,
}

/// crun's annotation for a seccomp program given ready-made (base64 of the
/// program's bytes); crun then loads it instead of compiling the config's
/// `linux.seccomp`. Other runtimes ignore it.
pub const SECCOMP_BPF_ANNOTATION: &str = "run.oci.seccomp_bpf_data";

/// A compiled seccomp program as [`SECCOMP_BPF_ANNOTATION`] carries it.
pub fn seccomp_bpf_data(program: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(program)
}

/// A run's user namespace as the runtime joins it.
#[derive(Clone, Copy, Debug)]
pub struct UserNamespace<'a> {
    /// Where the daemon pinned it (a bind mount of the namespace).
    pub path: &'a Path,
    /// The host id of the run's uid and gid 0; the namespace maps
    /// [`runbox_core::userns::RANGE`] ids from there. The config repeats
    /// the mapping, which runc requires even when it joins.
    pub base: u32,
}

/// Why [`build`] refused its input.
///
/// Environment values may be secrets, so errors about `env` name the
/// entry's index, never its content.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    /// A host path that must be absolute was not.
    #[error("{what} must be an absolute path, got {path:?}")]
    RelativePath {
        /// Which parameter.
        what: &'static str,
        /// The offending path.
        path: PathBuf,
    },
    /// `limits.cpus` is not a finite number of at least 0.01.
    #[error("cpus must be a finite number of at least 0.01, got {0}")]
    InvalidCpus(f64),
    /// A limit that must be positive was zero.
    #[error("{0} limit must be greater than zero")]
    ZeroLimit(&'static str),
    /// A limit too large to express in the OCI config.
    #[error("{0} limit is too large")]
    LimitTooLarge(&'static str),
    /// Not a valid Linux hostname (RFC 1123 labels, at most 64 bytes).
    #[error("invalid hostname {0:?}")]
    InvalidHostname(String),
    /// A file mount's destination is not a plain absolute path.
    #[error("invalid mount destination {0:?}: must be absolute, without '.' or '..'")]
    InvalidMountDestination(String),
    /// Not an absolute cgroupfs path without `..` components.
    #[error("invalid cgroups path {0:?}: must be absolute, without '..'")]
    InvalidCgroupsPath(String),
    /// An environment entry is not `KEY=VALUE` with a non-empty key.
    #[error("environment entry {0} is not KEY=VALUE")]
    InvalidEnv(usize),
    /// A string that ends up in an `execve` argument contains a NUL byte.
    #[error("{0} contains a NUL byte")]
    NulByte(&'static str),
    /// oci-spec refused to build part of the config.
    #[error("building the OCI config failed")]
    Oci(#[from] OciSpecError),
}

/// Builds the OCI runtime config for one run.
///
/// The process is the agent ([`AGENT_PATH`] followed by `agent_args`),
/// running as root with Docker's capabilities minus `CAP_NET_RAW` and the
/// [`seccomp::default_profile`] filter, in new pid, ipc, uts, mount, cgroup
/// and network namespaces (the network one joined instead when `netns_path`
/// is given), and in the run's own user namespace when `userns` is given
/// (else the host's).
///
/// Without a user namespace, root in the run is root on the host, so the
/// agent and everything it starts have `no_new_privileges`. With one, the
/// agent sets it on each command instead unless the run allows privilege
/// escalation (`ExecStart.allow_new_privileges`): a setuid program inside
/// can then make a command root in the run, which is an unprivileged id on
/// the host.
pub fn build(params: &SpecParams) -> Result<Spec, SpecError> {
    validate(params)?;

    let mut args = Vec::with_capacity(params.agent_args.len() + 1);
    args.push(AGENT_PATH.to_string());
    args.extend(params.agent_args.iter().cloned());

    let caps: Capabilities = CAPABILITIES.into_iter().collect();
    let capabilities = LinuxCapabilitiesBuilder::default()
        .bounding(caps.clone())
        .effective(caps.clone())
        .permitted(caps)
        // Empty inheritable and ambient sets: a non-root program exec'd by
        // the agent starts with no capabilities at all, as in current Docker.
        .inheritable(Capabilities::new())
        .ambient(Capabilities::new())
        .build()?;

    let nofile = nofile_limit();
    let process = ProcessBuilder::default()
        .terminal(false)
        .user(UserBuilder::default().uid(0u32).gid(0u32).build()?)
        .args(args)
        .env(params.env.to_vec())
        .cwd("/")
        .capabilities(capabilities)
        .rlimits(vec![PosixRlimitBuilder::default()
            .typ(PosixRlimitType::RlimitNofile)
            .soft(nofile)
            .hard(nofile)
            .build()?])
        .no_new_privileges(params.userns.is_none())
        .build()?;

    let mut spec = SpecBuilder::default()
        .version(OCI_VERSION)
        .root(
            RootBuilder::default()
                .path(params.rootfs)
                // The overlay's upper layer takes the run's writes.
                .readonly(false)
                .build()?,
        )
        .mounts(mounts(
            params.agent_binary,
            params.files,
            params.volume,
            params.volumes,
        )?)
        .process(process)
        .hostname(params.hostname)
        .linux(
            LinuxBuilder::default()
                .cgroups_path(params.cgroups_path)
                .namespaces(namespaces(params.netns_path, params.userns)?)
                .uid_mappings(id_mappings(params.userns)?)
                .gid_mappings(id_mappings(params.userns)?)
                .resources(
                    LinuxResourcesBuilder::default()
                        .devices(device_rules()?)
                        .cpu(
                            LinuxCpuBuilder::default()
                                .quota(cpu_quota(params.limits.cpus)?)
                                .period(CPU_PERIOD_US)
                                .build()?,
                        )
                        .memory(memory(params.limits.memory_mb, params.swap_limit)?)
                        .pids(
                            LinuxPidsBuilder::default()
                                .limit(to_i64(params.limits.pids, "pids")?)
                                .build()?,
                        )
                        .build()?,
                )
                // `devices` stays empty: the runtime-spec obliges runc and
                // crun to create /dev/null, zero, full, random, urandom, tty
                // and ptmx themselves, and both do.
                .masked_paths(MASKED_PATHS.map(String::from).to_vec())
                .readonly_paths(READONLY_PATHS.map(String::from).to_vec())
                .seccomp(seccomp::default_profile())
                .build()?,
        )
        .build()?;
    if let Some(data) = params.seccomp_bpf {
        spec.set_annotations(Some(
            [(SECCOMP_BPF_ANNOTATION.to_owned(), data.to_owned())].into(),
        ));
    }
    Ok(spec)
}

/// Rejects input that runc or crun would reject later with a worse message,
/// or that would silently weaken the run's limits.
fn validate(p: &SpecParams) -> Result<(), SpecError> {
    for (what, path) in [("rootfs", p.rootfs), ("agent binary", p.agent_binary)]
        .into_iter()
        .chain(p.netns_path.map(|n| ("netns path", n)))
        .chain(p.files.iter().map(|f| ("file mount source", f.source)))
        .chain(p.volume.iter().map(|f| ("volume mount source", f.source)))
        .chain(p.volumes.iter().map(|v| ("volume mount source", v.source)))
    {
        if !path.is_absolute() {
            return Err(SpecError::RelativePath {
                what,
                path: path.to_path_buf(),
            });
        }
    }
    let destinations = p
        .files
        .iter()
        .chain(p.volume.iter())
        .map(|f| f.destination)
        .chain(p.volumes.iter().map(|v| v.destination));
    for destination in destinations {
        // Only plain components: the destination is joined to the run's
        // root by the runtime, and `/` itself would hide the whole image.
        let plain = destination.strip_prefix('/').is_some_and(|rel| {
            !rel.contains('\0') && rel.split('/').all(|part| !matches!(part, "" | "." | ".."))
        });
        if !plain {
            return Err(SpecError::InvalidMountDestination(destination.to_string()));
        }
    }
    if !valid_hostname(p.hostname) {
        return Err(SpecError::InvalidHostname(p.hostname.to_string()));
    }
    let cg = Path::new(p.cgroups_path);
    // A `..` could climb out of runbox's subtree and put the run's limits
    // on some other cgroup.
    if !cg.is_absolute()
        || cg.components().count() < 2
        || cg.components().any(|c| c == Component::ParentDir)
    {
        return Err(SpecError::InvalidCgroupsPath(p.cgroups_path.to_string()));
    }
    if p.limits.memory_mb == 0 {
        return Err(SpecError::ZeroLimit("memory"));
    }
    if p.limits.pids == 0 {
        return Err(SpecError::ZeroLimit("pids"));
    }
    for (i, entry) in p.env.iter().enumerate() {
        // An empty key would be dropped or mangled by libc; a NUL byte would
        // truncate the entry when the runtime builds envp.
        if entry.starts_with('=') || !entry.contains('=') || entry.contains('\0') {
            return Err(SpecError::InvalidEnv(i));
        }
    }
    if p.agent_args.iter().any(|a| a.contains('\0')) {
        return Err(SpecError::NulByte("agent args"));
    }
    Ok(())
}

/// RFC 1123: dot-separated labels of 1–63 ASCII letters, digits and hyphens,
/// not starting or ending with a hyphen; at most [`HOSTNAME_MAX`] bytes.
fn valid_hostname(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= HOSTNAME_MAX
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

/// [`NOFILE_LIMIT`], lowered to this process's hard limit.
///
/// runc and crun apply rlimits from outside the container, and raising a
/// hard limit above the caller's needs `CAP_SYS_RESOURCE` in the initial user
/// namespace. Hosts that run the daemon without it (inside a container, or
/// this project's CI machines, whose hard limit is 20000) would otherwise fail
/// every run with "error setting rlimits".
fn nofile_limit() -> u64 {
    let hard = rustix::process::getrlimit(rustix::process::Resource::Nofile).maximum;
    // `None` is RLIM_INFINITY.
    hard.map_or(NOFILE_LIMIT, |h| h.min(NOFILE_LIMIT))
}

/// CFS quota in microseconds per [`CPU_PERIOD_US`] for `cpus` cores.
fn cpu_quota(cpus: f64) -> Result<i64, SpecError> {
    if !cpus.is_finite() || cpus <= 0.0 {
        return Err(SpecError::InvalidCpus(cpus));
    }
    let quota = (cpus * CPU_PERIOD_US as f64).round();
    if quota < MIN_CPU_QUOTA_US {
        return Err(SpecError::InvalidCpus(cpus));
    }
    // `as` saturates; compare in f64 first so a huge value is an error
    // instead of a silently clamped quota.
    if quota >= i64::MAX as f64 {
        return Err(SpecError::LimitTooLarge("cpu"));
    }
    Ok(quota as i64)
}

/// Memory limit in bytes, and memory+swap set to the same value when the
/// host accounts swap (otherwise the runtime would reject the swap field).
fn memory(memory_mb: u64, swap_limit: bool) -> Result<oci_spec::runtime::LinuxMemory, SpecError> {
    let bytes = memory_mb
        .checked_mul(1024 * 1024)
        .ok_or(SpecError::LimitTooLarge("memory"))?;
    let bytes = to_i64(bytes, "memory")?;
    let mut builder = LinuxMemoryBuilder::default().limit(bytes);
    if swap_limit {
        builder = builder.swap(bytes);
    }
    Ok(builder.build()?)
}

fn to_i64(value: u64, what: &'static str) -> Result<i64, SpecError> {
    i64::try_from(value).map_err(|_| SpecError::LimitTooLarge(what))
}

/// Namespaces: new pid, ipc, uts, mount, cgroup and network ones, except that
/// the network namespace is joined when the daemon prepared one.
fn namespaces(
    netns_path: Option<&Path>,
    userns: Option<UserNamespace<'_>>,
) -> Result<Vec<LinuxNamespace>, OciSpecError> {
    let mut out = Vec::with_capacity(7);
    if let Some(userns) = userns {
        out.push(
            LinuxNamespaceBuilder::default()
                .typ(LinuxNamespaceType::User)
                .path(userns.path)
                .build()?,
        );
    }
    for typ in [
        LinuxNamespaceType::Pid,
        LinuxNamespaceType::Ipc,
        LinuxNamespaceType::Uts,
        LinuxNamespaceType::Mount,
        LinuxNamespaceType::Cgroup,
    ] {
        out.push(LinuxNamespaceBuilder::default().typ(typ).build()?);
    }
    let mut net = LinuxNamespaceBuilder::default().typ(LinuxNamespaceType::Network);
    if let Some(path) = netns_path {
        net = net.path(path);
    }
    out.push(net.build()?);
    Ok(out)
}

/// The uid (or gid) mapping of the run's user namespace, as the daemon
/// wrote it; empty without one.
fn id_mappings(userns: Option<UserNamespace<'_>>) -> Result<Vec<LinuxIdMapping>, OciSpecError> {
    match userns {
        None => Ok(Vec::new()),
        Some(userns) => Ok(vec![LinuxIdMappingBuilder::default()
            .container_id(0u32)
            .host_id(userns.base)
            .size(runbox_core::userns::RANGE)
            .build()?]),
    }
}

/// Device cgroup: deny everything, then allow creating any node (`m`, so
/// tar and package managers can unpack device files, which stay unusable)
/// and read/write on the standard pseudo-devices and the run's own ptys.
/// runc would append the same allow-list itself; writing it down keeps
/// crun and runc identical.
fn device_rules() -> Result<Vec<LinuxDeviceCgroup>, OciSpecError> {
    use LinuxDeviceType::{A, B, C};
    let rule = |allow: bool, typ, major: Option<i64>, minor: Option<i64>, access: &str| {
        let mut b = LinuxDeviceCgroupBuilder::default()
            .allow(allow)
            .typ(typ)
            .access(access);
        if let Some(m) = major {
            b = b.major(m);
        }
        if let Some(m) = minor {
            b = b.minor(m);
        }
        b.build()
    };
    Ok(vec![
        rule(false, A, None, None, "rwm")?,
        rule(true, C, None, None, "m")?,
        rule(true, B, None, None, "m")?,
        rule(true, C, Some(1), Some(3), "rwm")?, // null
        rule(true, C, Some(1), Some(5), "rwm")?, // zero
        rule(true, C, Some(1), Some(7), "rwm")?, // full
        rule(true, C, Some(1), Some(8), "rwm")?, // random
        rule(true, C, Some(1), Some(9), "rwm")?, // urandom
        rule(true, C, Some(5), Some(0), "rwm")?, // tty
        rule(true, C, Some(5), Some(2), "rwm")?, // ptmx
        rule(true, C, Some(136), None, "rwm")?,  // /dev/pts/*
    ])
}

/// The filesystems every run gets, as Docker mounts them, plus the agent and
/// the daemon's files. `/tmp` is left to the image, as in Docker.
fn mounts(
    agent_binary: &Path,
    files: &[FileMount],
    volume: Option<FileMount>,
    volumes: &[BindMount],
) -> Result<Vec<Mount>, OciSpecError> {
    let m = |dest: &str, typ: &str, source: &Path, options: &[&str]| {
        MountBuilder::default()
            .destination(dest)
            .typ(typ)
            .source(source)
            .options(options.iter().map(|o| o.to_string()).collect::<Vec<_>>())
            .build()
    };
    let p = Path::new;
    let mut out = vec![
        m("/proc", "proc", p("proc"), &["nosuid", "noexec", "nodev"])?,
        m(
            "/dev",
            "tmpfs",
            p("tmpfs"),
            &["nosuid", "strictatime", "mode=755", "size=65536k"],
        )?,
        // A private devpts instance: the run cannot see or open the host's
        // ptys. gid=5 is the conventional `tty` group.
        m(
            "/dev/pts",
            "devpts",
            p("devpts"),
            &[
                "nosuid",
                "noexec",
                "newinstance",
                "ptmxmode=0666",
                "mode=0620",
                "gid=5",
            ],
        )?,
        m(
            "/dev/shm",
            "tmpfs",
            p("shm"),
            &["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
        )?,
        m(
            "/dev/mqueue",
            "mqueue",
            p("mqueue"),
            &["nosuid", "noexec", "nodev"],
        )?,
        m(
            "/sys",
            "sysfs",
            p("sysfs"),
            &["nosuid", "noexec", "nodev", "ro"],
        )?,
        // Read-only, and with the cgroup namespace the run sees only its own
        // subtree.
        m(
            "/sys/fs/cgroup",
            "cgroup",
            p("cgroup"),
            &["nosuid", "noexec", "nodev", "relatime", "ro"],
        )?,
        m(
            "/run",
            "tmpfs",
            p("tmpfs"),
            &["nosuid", "nodev", "mode=755"],
        )?,
        // Read-only so nothing in the run can replace the agent that the
        // daemon talks to; nosuid/nodev as defence in depth.
        m(
            AGENT_PATH,
            "bind",
            agent_binary,
            &["bind", "ro", "nosuid", "nodev"],
        )?,
    ];
    // Read-write like the root it lies in; no device nodes. The runtime
    // makes the destination (inside the root) when the image lacks it.
    if let Some(volume) = volume {
        out.push(m(
            volume.destination,
            "bind",
            volume.source,
            &["rbind", "rw", "nodev"],
        )?);
    }
    // Data shared between runs: no device nodes, and no set-id programs
    // (one run's could otherwise raise another's commands).
    for bind in volumes {
        let mode = if bind.read_only { "ro" } else { "rw" };
        out.push(m(
            bind.destination,
            "bind",
            bind.source,
            &["rbind", mode, "nodev", "nosuid"],
        )?);
    }
    // Last, so that a destination under /run lands on the run's tmpfs
    // rather than under it.
    for file in files {
        out.push(m(
            file.destination,
            "bind",
            file.source,
            &FILE_MOUNT_OPTIONS,
        )?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    const LIMITS: Limits = Limits {
        cpus: 0.5,
        memory_mb: 256,
        disk_mb: None,
        pids: 128,
    };

    /// Owns the slices that [`SpecParams`] borrows.
    struct Fixture {
        args: Vec<String>,
        env: Vec<String>,
    }

    impl Fixture {
        fn new() -> Self {
            Fixture {
                args: vec!["--listen-fd".to_string(), "3".to_string()],
                env: vec!["PATH=/usr/bin:/bin".to_string()],
            }
        }

        /// Valid parameters.
        fn params(&self) -> SpecParams<'_> {
            SpecParams {
                rootfs: Path::new("/var/lib/runbox/runs/x/merged"),
                agent_binary: Path::new("/usr/lib/runbox/agent"),
                agent_args: &self.args,
                hostname: "sandbox-1",
                netns_path: None,
                cgroups_path: "/runbox/01J",
                limits: &LIMITS,
                swap_limit: true,
                env: &self.env,
                files: &[],
                volume: None,
                volumes: &[],
                userns: None,
                seccomp_bpf: None,
            }
        }
    }

    /// Builds from valid parameters with `edit` applied, returning the JSON.
    fn build_json<'a>(
        f: &'a Fixture,
        edit: impl FnOnce(&mut SpecParams<'a>),
    ) -> Result<Value, SpecError> {
        let mut p = f.params();
        edit(&mut p);
        let spec = build(&p)?;
        Ok(serde_json::to_value(spec).expect("spec serializes"))
    }

    fn ok<'a>(f: &'a Fixture, edit: impl FnOnce(&mut SpecParams<'a>)) -> Value {
        build_json(f, edit).expect("valid params build")
    }

    fn strings(v: &Value) -> Vec<&str> {
        v.as_array()
            .expect("array")
            .iter()
            .map(|s| s.as_str().expect("string"))
            .collect()
    }

    fn mount<'a>(json: &'a Value, dest: &str) -> &'a Value {
        json["mounts"]
            .as_array()
            .expect("mounts")
            .iter()
            .find(|m| m["destination"] == dest)
            .unwrap_or_else(|| panic!("no mount at {dest}"))
    }

    #[test]
    fn process_runs_agent_as_root_without_new_privileges() {
        let f = Fixture::new();
        let json = ok(&f, |_| {});
        let proc = &json["process"];
        assert_eq!(
            strings(&proc["args"]),
            ["/.runbox/agent", "--listen-fd", "3"]
        );
        assert_eq!(proc["cwd"], "/");
        assert_eq!(proc["user"]["uid"], 0);
        assert_eq!(proc["user"]["gid"], 0);
        assert_eq!(proc["terminal"], false);
        assert_eq!(proc["noNewPrivileges"], true);
        assert_eq!(strings(&proc["env"]), ["PATH=/usr/bin:/bin"]);
        assert!(proc.get("oomScoreAdj").is_none());
        assert_eq!(proc["rlimits"][0]["type"], "RLIMIT_NOFILE");
        let nofile = &proc["rlimits"][0];
        assert_eq!(nofile["soft"], nofile["hard"]);
        let soft = nofile["soft"].as_u64().expect("number");
        assert!(soft > 0 && soft <= NOFILE_LIMIT);
        assert_eq!(json["hostname"], "sandbox-1");
        assert_eq!(json["root"]["path"], "/var/lib/runbox/runs/x/merged");
        assert_eq!(json["root"]["readonly"], false);
    }

    #[test]
    fn a_run_with_a_user_namespace_leaves_no_new_privileges_to_the_agent() {
        let f = Fixture::new();
        let pinned = Path::new("/var/lib/runbox/runs/x/userns");
        let json = ok(&f, |p| {
            p.userns = Some(UserNamespace {
                path: pinned,
                base: 0x7000_0000,
            })
        });
        assert_eq!(json["process"]["noNewPrivileges"], false);
        let user = json["linux"]["namespaces"]
            .as_array()
            .expect("namespaces")
            .iter()
            .find(|n| n["type"] == "user")
            .expect("a user namespace");
        assert_eq!(user["path"], "/var/lib/runbox/runs/x/userns");
        for map in ["uidMappings", "gidMappings"] {
            assert_eq!(
                json["linux"][map],
                serde_json::json!([{"containerID": 0, "hostID": 0x7000_0000u32, "size": 65536}])
            );
        }
    }

    #[test]
    fn capabilities_are_docker_defaults_without_net_raw() {
        let f = Fixture::new();
        let json = ok(&f, |_| {});
        let caps = &json["process"]["capabilities"];
        let mut expected = vec![
            "CAP_AUDIT_WRITE",
            "CAP_CHOWN",
            "CAP_DAC_OVERRIDE",
            "CAP_FOWNER",
            "CAP_FSETID",
            "CAP_KILL",
            "CAP_MKNOD",
            "CAP_NET_BIND_SERVICE",
            "CAP_SETFCAP",
            "CAP_SETGID",
            "CAP_SETPCAP",
            "CAP_SETUID",
            "CAP_SYS_CHROOT",
        ];
        expected.sort_unstable();
        for set in ["bounding", "effective", "permitted"] {
            let mut got = strings(&caps[set]);
            got.sort_unstable();
            assert_eq!(got, expected, "{set}");
            assert!(!got.contains(&"CAP_NET_RAW"));
        }
        for set in ["inheritable", "ambient"] {
            assert!(strings(&caps[set]).is_empty(), "{set} must be empty");
        }
    }

    #[test]
    fn namespaces_and_netns_path() {
        let f = Fixture::new();
        let json = ok(&f, |_| {});
        let ns = json["linux"]["namespaces"].as_array().expect("namespaces");
        let mut types: Vec<&str> = ns
            .iter()
            .map(|n| n["type"].as_str().expect("type"))
            .collect();
        types.sort_unstable();
        assert_eq!(types, ["cgroup", "ipc", "mount", "network", "pid", "uts"]);
        assert!(ns.iter().all(|n| n.get("path").is_none()));

        let json = ok(&f, |p| {
            p.netns_path = Some(Path::new("/run/netns/runbox-01J"))
        });
        let net = json["linux"]["namespaces"]
            .as_array()
            .expect("namespaces")
            .iter()
            .find(|n| n["type"] == "network")
            .expect("network namespace")
            .clone();
        assert_eq!(net["path"], "/run/netns/runbox-01J");
    }

    #[test]
    fn masked_and_readonly_paths() {
        let f = Fixture::new();
        let json = ok(&f, |_| {});
        let masked = strings(&json["linux"]["maskedPaths"]);
        for p in [
            "/proc/kcore",
            "/proc/keys",
            "/proc/timer_list",
            "/proc/sched_debug",
            "/proc/scsi",
            "/sys/firmware",
            "/sys/devices/virtual/powercap",
            "/proc/acpi",
            "/proc/asound",
        ] {
            assert!(masked.contains(&p), "{p} not masked");
        }
        assert_eq!(
            strings(&json["linux"]["readonlyPaths"]),
            [
                "/proc/bus",
                "/proc/fs",
                "/proc/irq",
                "/proc/sys",
                "/proc/sysrq-trigger",
                "/sys/fs/cgroup"
            ]
        );
    }

    #[test]
    fn resources() {
        let f = Fixture::new();
        let json = ok(&f, |_| {});
        let r = &json["linux"]["resources"];
        assert_eq!(r["cpu"]["quota"], 50_000);
        assert_eq!(r["cpu"]["period"], 100_000);
        assert_eq!(r["memory"]["limit"], 256 * 1024 * 1024);
        assert_eq!(r["memory"]["swap"], 256 * 1024 * 1024);
        assert_eq!(r["pids"]["limit"], 128);
        assert_eq!(json["linux"]["cgroupsPath"], "/runbox/01J");
        // Deny-all comes first so the allow rules are what remains.
        assert_eq!(r["devices"][0]["allow"], false);
        assert_eq!(r["devices"][0]["access"], "rwm");
        assert!(r["devices"]
            .as_array()
            .expect("device rules")
            .iter()
            .any(|d| d["allow"] == true && d["major"] == 1 && d["minor"] == 3));

        let two = Limits {
            cpus: 2.0,
            ..LIMITS
        };
        let json = ok(&f, |p| {
            p.limits = &two;
            p.swap_limit = false;
        });
        assert_eq!(json["linux"]["resources"]["cpu"]["quota"], 200_000);
        assert!(json["linux"]["resources"]["memory"].get("swap").is_none());
    }

    #[test]
    fn mounts_are_docker_like_and_agent_is_read_only() {
        let f = Fixture::new();
        let json = ok(&f, |_| {});
        let agent = mount(&json, AGENT_PATH);
        assert_eq!(agent["type"], "bind");
        assert_eq!(agent["source"], "/usr/lib/runbox/agent");
        assert_eq!(
            strings(&agent["options"]),
            ["bind", "ro", "nosuid", "nodev"]
        );
        assert_eq!(mount(&json, "/proc")["type"], "proc");
        assert_eq!(mount(&json, "/dev")["type"], "tmpfs");
        assert!(strings(&mount(&json, "/dev/pts")["options"]).contains(&"newinstance"));
        assert_eq!(mount(&json, "/dev/shm")["type"], "tmpfs");
        assert_eq!(mount(&json, "/dev/mqueue")["type"], "mqueue");
        assert!(strings(&mount(&json, "/sys")["options"]).contains(&"ro"));
        assert!(strings(&mount(&json, "/sys/fs/cgroup")["options"]).contains(&"ro"));
        assert_eq!(mount(&json, "/run")["type"], "tmpfs");
        assert!(json["mounts"]
            .as_array()
            .expect("mounts")
            .iter()
            .all(|m| m["destination"] != "/tmp"));
    }

    #[test]
    fn file_mounts_come_last_and_read_only() {
        let f = Fixture::new();
        let files = [
            FileMount {
                source: Path::new("/var/lib/runbox/runs/x/trust.pem"),
                destination: "/etc/ssl/certs/ca-certificates.crt",
            },
            FileMount {
                source: Path::new("/var/lib/runbox/runs/x/resolv.conf"),
                destination: "/etc/resolv.conf",
            },
        ];
        let json = ok(&f, |p| p.files = &files);
        let mounts = json["mounts"].as_array().expect("mounts");
        let last: Vec<&str> = mounts[mounts.len() - 2..]
            .iter()
            .map(|m| m["destination"].as_str().expect("destination"))
            .collect();
        assert_eq!(
            last,
            ["/etc/ssl/certs/ca-certificates.crt", "/etc/resolv.conf"]
        );
        let resolv = mount(&json, "/etc/resolv.conf");
        assert_eq!(resolv["type"], "bind");
        assert_eq!(resolv["source"], "/var/lib/runbox/runs/x/resolv.conf");
        assert_eq!(strings(&resolv["options"]), FILE_MOUNT_OPTIONS);
    }

    #[test]
    fn file_mounts_are_validated() {
        let f = Fixture::new();
        for dest in ["", "/", "etc/x", "/etc/../x", "/etc/./x", "/a\0b"] {
            let files = [FileMount {
                source: Path::new("/src"),
                destination: dest,
            }];
            let e = build_json(&f, |p| p.files = &files).expect_err("bad destination");
            assert!(
                matches!(e, SpecError::InvalidMountDestination(_)),
                "{dest:?}: {e}"
            );
        }
        let files = [FileMount {
            source: Path::new("src"),
            destination: "/etc/x",
        }];
        let e = build_json(&f, |p| p.files = &files).expect_err("relative source");
        assert!(matches!(e, SpecError::RelativePath { .. }));
    }

    #[test]
    fn seccomp_is_attached() {
        let f = Fixture::new();
        let json = ok(&f, |_| {});
        assert_eq!(json["linux"]["seccomp"]["defaultAction"], "SCMP_ACT_ERRNO");
    }

    #[test]
    fn json_round_trips_through_oci_spec() {
        let f = Fixture::new();
        let json = ok(&f, |_| {});
        let back: Spec = serde_json::from_value(json).expect("deserializes");
        assert_eq!(back.hostname().as_deref(), Some("sandbox-1"));
    }

    #[test]
    fn rejects_bad_input() {
        let f = Fixture::new();
        let relative = |e| matches!(e, SpecError::RelativePath { .. });
        let err = |edit: fn(&mut SpecParams<'_>)| build_json(&f, edit).expect_err("must fail");

        assert!(relative(err(|p| p.rootfs = Path::new("rootfs"))));
        assert!(relative(err(|p| p.agent_binary = Path::new("agent"))));
        assert!(relative(err(|p| p.netns_path = Some(Path::new("netns")))));

        for cpus in [0.0, -1.0, f64::NAN, f64::INFINITY, 0.001, 1e300] {
            let limits = Limits { cpus, ..LIMITS };
            let e = build_json(&f, |p| p.limits = &limits).expect_err("bad cpus");
            assert!(
                matches!(e, SpecError::InvalidCpus(_) | SpecError::LimitTooLarge(_)),
                "{cpus}: {e}"
            );
        }
        let limits = Limits {
            memory_mb: 0,
            ..LIMITS
        };
        assert!(matches!(
            build_json(&f, |p| p.limits = &limits),
            Err(SpecError::ZeroLimit("memory"))
        ));
        let limits = Limits { pids: 0, ..LIMITS };
        assert!(matches!(
            build_json(&f, |p| p.limits = &limits),
            Err(SpecError::ZeroLimit("pids"))
        ));
        let limits = Limits {
            memory_mb: u64::MAX,
            ..LIMITS
        };
        assert!(matches!(
            build_json(&f, |p| p.limits = &limits),
            Err(SpecError::LimitTooLarge("memory"))
        ));

        for name in ["", "-a", "a-", "a..b", "a_b", "a b", "é", &"a".repeat(65)] {
            let e = build_json(&f, |p| p.hostname = name).expect_err("bad hostname");
            assert!(matches!(e, SpecError::InvalidHostname(_)), "{name:?}: {e}");
        }
        assert!(build_json(&f, |p| p.hostname = "a-1.example").is_ok());

        for path in ["", "runbox/x", "/", "/runbox/../etc"] {
            let e = build_json(&f, |p| p.cgroups_path = path).expect_err("bad cgroup");
            assert!(matches!(e, SpecError::InvalidCgroupsPath(_)), "{path:?}");
        }

        for bad in ["NOEQUALS", "=value", "K=a\0b"] {
            let env = vec!["OK=1".to_string(), bad.to_string()];
            let e = build_json(&f, |p| p.env = &env).expect_err("bad env");
            assert!(matches!(e, SpecError::InvalidEnv(1)));
            // Values may be secrets: the message names the index only.
            assert!(!e.to_string().contains(bad));
        }
        let args = vec!["a\0b".to_string()];
        assert!(matches!(
            build_json(&f, |p| p.agent_args = &args),
            Err(SpecError::NulByte(_))
        ));
    }

    /// Whether this host can start a real container with `runtime`: root,
    /// the runtime, and a static `/bin/busybox` to run in it.
    fn can_run_containers(runtime: &str) -> bool {
        use std::process::{Command, Stdio};
        let found = Command::new(runtime)
            .arg("--version")
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        let ok =
            rustix::process::geteuid().is_root() && found && Path::new("/bin/busybox").exists();
        if !ok {
            eprintln!("skipping: needs root, {runtime} and /bin/busybox");
        }
        ok
    }

    /// Under `dir`: a root with busybox (`rootfs/`), an empty bundle
    /// directory (`bundle/`) and a stand-in for the agent binary, which
    /// the tests' configs mount but never run.
    fn busybox_bundle(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
        let (rootfs, bundle, agent) = (dir.join("rootfs"), dir.join("bundle"), dir.join("agent"));
        for d in [rootfs.join("bin"), bundle.clone()] {
            std::fs::create_dir_all(d).expect("create test dirs");
        }
        std::fs::copy("/bin/busybox", rootfs.join("bin/busybox")).expect("copy busybox");
        std::fs::write(&agent, "not executed\n").expect("write agent stand-in");
        (rootfs, bundle, agent)
    }

    /// What [`seccomp::compile`] makes of the profile is, byte for byte,
    /// the program crun compiles from the config's seccomp section; and a
    /// container given it through crun's annotation runs under it: `unshare
    /// -U`, which needs no capability, is refused by the filter alone.
    ///
    /// Needs root, `crun` and a static `/bin/busybox`; it returns early,
    /// passing, when any is missing.
    #[test]
    fn crun_is_given_the_program_it_would_compile() {
        use std::process::{Command, Stdio};

        if !can_run_containers("crun") {
            return;
        }
        let base = format!("runbox-bpftest-{}", std::process::id());
        let dir = std::env::temp_dir().join(&base);
        let root = dir.join("crun-root");
        // Removes both containers, their cgroups and the files even when an
        // assertion fails.
        struct Cleanup {
            root: PathBuf,
            dir: PathBuf,
            ids: [String; 2],
        }
        impl Drop for Cleanup {
            fn drop(&mut self) {
                for id in &self.ids {
                    let _ = Command::new("crun")
                        .arg("--root")
                        .arg(&self.root)
                        .args(["delete", "--force", id])
                        .stderr(Stdio::null())
                        .status();
                    if let Ok(controllers) = std::fs::read_dir("/sys/fs/cgroup") {
                        for c in controllers.flatten() {
                            let parent = c.path().join("runbox-spectest");
                            let _ = std::fs::remove_dir(parent.join(id));
                            // Fails harmlessly while another test uses it.
                            let _ = std::fs::remove_dir(parent);
                        }
                    }
                }
                let _ = std::fs::remove_dir_all(&self.dir);
            }
        }
        let ids = [format!("{base}-compiled"), format!("{base}-given")];
        let _cleanup = Cleanup {
            root: root.clone(),
            dir: dir.clone(),
            ids: ids.clone(),
        };
        let (rootfs, bundle, agent) = busybox_bundle(&dir);
        std::fs::create_dir_all(&root).expect("create crun's root");
        let log = dir.join("crun.log");
        let crun = |command: &str, id: &str| {
            // A created container's init keeps what it was given open until
            // it is started: only a run's output is read; errors are in
            // crun's log.
            let piped = || match command {
                "run" => Stdio::piped(),
                _ => Stdio::null(),
            };
            Command::new("crun")
                .arg("--root")
                .arg(&root)
                .arg("--log")
                .arg(&log)
                .args([command, "--bundle"])
                .arg(&bundle)
                .arg(id)
                .stdin(Stdio::null())
                .stdout(piped())
                .stderr(piped())
                .output()
                .expect("run crun")
        };
        let log_text = || std::fs::read_to_string(&log).unwrap_or_default();
        let f = Fixture::new();
        let config = |id: &str, annotation: Option<String>| {
            let cgroup = format!("/runbox-spectest/{id}");
            let mut params = f.params();
            params.rootfs = &rootfs;
            params.agent_binary = &agent;
            params.cgroups_path = &cgroup;
            let mut spec = build(&params).expect("spec builds");
            let script = "/bin/busybox unshare -U /bin/busybox true 2>/dev/null \
                && echo userns-allowed || echo userns-denied";
            spec.process_mut()
                .as_mut()
                .expect("spec has a process")
                .set_args(Some(
                    ["/bin/busybox", "sh", "-c", script]
                        .map(String::from)
                        .to_vec(),
                ));
            if let Some(data) = annotation {
                spec.set_annotations(Some([(SECCOMP_BPF_ANNOTATION.to_owned(), data)].into()));
            }
            spec.save(bundle.join("config.json"))
                .expect("write config.json");
        };

        // crun compiles the section when the container is created.
        config(&ids[0], None);
        let out = crun("create", &ids[0]);
        assert!(out.status.success(), "crun create: {}", log_text());
        let by_crun = std::fs::read(root.join(&ids[0]).join("seccomp.bpf"))
            .expect("crun keeps the program it compiled");
        let ours = seccomp::compile(&seccomp::default_profile()).expect("the profile compiles");
        assert_eq!(ours.len(), by_crun.len(), "program lengths differ");
        assert!(ours == by_crun, "the programs differ");

        // Given ready-made, it is the filter the container runs under.
        config(&ids[1], Some(seccomp_bpf_data(&ours)));
        let out = crun("run", &ids[1]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "crun run: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(stdout.trim(), "userns-denied");
    }

    /// Starts a real container from [`build`]'s output with runc and checks
    /// that runc accepts the spec and the seccomp profile, and that the
    /// profile and capabilities behave as intended inside.
    ///
    /// Needs root, `runc` and a static `/bin/busybox` (Debian:
    /// `busybox-static`); it returns early, passing, when any is missing.
    #[test]
    #[ignore = "starts a real container: needs root, runc and busybox-static"]
    fn runc_runs_the_spec() {
        use std::process::{Command, Stdio};
        use std::time::{Duration, Instant};

        if !can_run_containers("runc") {
            return;
        }

        let id = format!("runbox-spectest-{}", std::process::id());
        let cgroup = format!("/runbox-spectest/{id}");
        let dir = std::env::temp_dir().join(&id);
        // Removes the container, its cgroups and the files even when an
        // assertion fails.
        struct Cleanup {
            dir: PathBuf,
            id: String,
        }
        impl Drop for Cleanup {
            fn drop(&mut self) {
                let _ = Command::new("runc")
                    .arg("--root")
                    .arg(self.dir.join("runc-root"))
                    .args(["delete", "--force", &self.id])
                    .stderr(Stdio::null())
                    .status();
                if let Ok(controllers) = std::fs::read_dir("/sys/fs/cgroup") {
                    for c in controllers.flatten() {
                        let parent = c.path().join("runbox-spectest");
                        let _ = std::fs::remove_dir(parent.join(&self.id));
                        // Fails harmlessly while another test run uses it.
                        let _ = std::fs::remove_dir(parent);
                    }
                }
                let _ = std::fs::remove_dir_all(&self.dir);
            }
        }
        let _cleanup = Cleanup {
            dir: dir.clone(),
            id: id.clone(),
        };

        let (rootfs, bundle, agent) = busybox_bundle(&dir);
        std::fs::create_dir_all(dir.join("runc-root")).expect("create runc's root");

        let f = Fixture::new();
        let mut params = f.params();
        params.rootfs = &rootfs;
        params.agent_binary = &agent;
        params.cgroups_path = &cgroup;
        let mut spec = build(&params).expect("spec builds");
        // Busybox instead of the agent; each line reports one property.
        let script = "echo hi; \
            grep CapEff /proc/self/status; \
            /bin/busybox unshare -n /bin/busybox true 2>/dev/null \
                && echo unshare-allowed || echo unshare-denied; \
            echo x > /dev/null && echo devnull-ok; \
            (echo x > /.runbox/agent) 2>/dev/null \
                && echo agent-writable || echo agent-ro";
        spec.process_mut()
            .as_mut()
            .expect("spec has a process")
            .set_args(Some(
                ["/bin/busybox", "sh", "-c", script]
                    .map(String::from)
                    .to_vec(),
            ));
        spec.save(bundle.join("config.json"))
            .expect("write config.json");

        let mut child = Command::new("runc")
            .arg("--root")
            .arg(dir.join("runc-root"))
            .args(["run", "--bundle"])
            .arg(&bundle)
            .arg(&id)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn runc");
        // A hung container fails the test instead of hanging it.
        let deadline = Instant::now() + Duration::from_secs(60);
        while child.try_wait().expect("wait for runc").is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("runc did not finish within 60s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let out = child.wait_with_output().expect("collect runc output");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "runc failed: {stderr}\n{stdout}");

        // Docker's capabilities without CAP_NET_RAW (bit 13).
        let caps = stdout
            .lines()
            .find_map(|l| l.strip_prefix("CapEff:"))
            .map(|v| u64::from_str_radix(v.trim(), 16).expect("hex caps"))
            .expect("CapEff line");
        assert_eq!(caps, 0xa804_05fb, "{stdout}");
        for line in ["hi", "unshare-denied", "devnull-ok", "agent-ro"] {
            assert!(
                stdout.lines().any(|l| l == line),
                "no {line:?} in:\n{stdout}"
            );
        }
    }
}
