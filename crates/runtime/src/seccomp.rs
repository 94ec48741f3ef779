//! The seccomp filter every run gets.
//!
//! Owns the list of system calls a sandboxed process may make and the few
//! argument checks that go with it (`clone` namespace flags, `personality`
//! values, `socket` families). It does not own loading the filter: the OCI
//! runtime (runc or crun) installs it just before it executes the agent,
//! after which the filter is inherited by everything the agent starts.
//!
//! Compiling the profile into the kernel's BPF program is most of what a
//! runtime spends on a container start (libseccomp's compile of this
//! profile took 20-35 ms of crun's ~45 ms on the 2-CPU test machine).
//! runc compiles it every time; crun takes the program ready-made (its
//! `run.oci.seccomp_bpf_data` annotation), so [`compile`] does that once per
//! daemon, with the same library and the same translation crun applies, and
//! the lane hands every crun container the result.
//!
//! # Relation to Docker's default profile
//!
//! Docker's `profiles/seccomp/default.json` is the behavioural reference: an
//! allow-list where anything not listed fails with `EPERM`. Docker's file is a
//! template that the daemon resolves per container (by host architecture,
//! kernel version and the container's capabilities); the OCI format has no such
//! conditions, so [`default_profile`] is the resolved result for runbox's fixed
//! capability set (Docker's defaults minus `CAP_NET_RAW`, see
//! [`crate::spec`]). Concretely:
//!
//! - Syscalls that Docker gates on a capability runbox never grants are left
//!   out: `CAP_SYS_ADMIN` (mount, unshare, setns, bpf, perf_event_open, …),
//!   `CAP_SYS_PTRACE`, `CAP_SYS_MODULE`, `CAP_SYS_BOOT`, `CAP_SYS_TIME`,
//!   `CAP_SYS_PACCT`, `CAP_SYS_RAWIO`, `CAP_SYS_NICE` (the NUMA memory-policy
//!   calls), `CAP_SYS_TTY_CONFIG`, `CAP_SYSLOG`, `CAP_DAC_READ_SEARCH`.
//!   `chroot` stays, because runbox keeps `CAP_SYS_CHROOT` as Docker does.
//! - Without `CAP_SYS_ADMIN`, Docker allows `clone` only without namespace
//!   flags and makes `clone3` fail with `ENOSYS` (its flags live in memory, out
//!   of seccomp's reach, so libc must fall back to `clone`). Same here.
//!
//! Where runbox differs from Docker, and why:
//!
//! - `ptrace`, `process_vm_readv` and `process_vm_writev` are denied. Docker
//!   allows them to every container on kernels ≥ 4.8; a sandbox for untrusted
//!   code has no need to inspect its own processes' memory, and denying them
//!   removes a large kernel surface. Debuggers inside a sandbox will not work.
//! - `name_to_handle_at` is denied. Docker allows it; it is only useful
//!   together with `open_by_handle_at` (which needs `CAP_DAC_READ_SEARCH`) and
//!   it leaks stable inode handles of the host filesystem.
//! - `io_uring_*` are denied, as in current Docker releases (older ones allowed
//!   them): io_uring has been a steady source of kernel exploits and performs
//!   work that seccomp cannot see.
//! - Syscalls added after Linux 6.7 (`mseal`, `listmount`, `statmount`, the
//!   `lsm_*` and `*xattrat` calls, …) are not named: Debian 12's libseccomp
//!   (2.5.4-1+deb12u1, whose table ends at 6.7) cannot resolve them. They get
//!   the default `EPERM` under crun; runc answers any syscall numbered above
//!   the highest one in the filter with `ENOSYS`, so libc fallbacks still
//!   work there. runc 1.1 and crun 1.8 skip names their libseccomp does not
//!   know, so the 6.x names that are listed (`cachestat`, `fchmodat2`,
//!   `map_shadow_stack`, `futex_wait`/`futex_wake`/`futex_requeue`) do no
//!   harm on a host with an older libseccomp either.
//! - `socket` is refused for `AF_VSOCK`, as some Docker releases do: on a host
//!   that is itself a virtual machine, vsock reaches the hypervisor, which is
//!   outside every boundary runbox draws.
//!
//! The OCI profile cannot restrict a rule to one architecture, so the
//! architecture-specific names below are listed once; libseccomp maps each
//! name to its number on every architecture in the filter and skips it where
//! the syscall does not exist. The filter covers the architectures a process
//! on this host can make system calls with ([`host_architectures`]): on
//! x86-64 the 64-bit, 32-bit and x32 ABIs, on arm64 the 64-bit and 32-bit
//! ones, as Docker resolves it per host. Naming others (an arm ABI on an
//! x86-64 kernel) would only add dead branches that every system call of a
//! run walks past, and that every compile pays for.

use oci_spec::runtime::{
    Arch, LinuxSeccomp, LinuxSeccompAction, LinuxSeccompArg, LinuxSeccompArgBuilder,
    LinuxSeccompOperator, LinuxSyscall,
};

/// `errno` for everything not allowed: `EPERM`, as Docker, so that callers see
/// "not permitted" rather than a crash.
const EPERM: u32 = 1;

/// `errno` for `clone3`: `ENOSYS` makes glibc and musl retry with `clone`,
/// whose flags the filter can inspect.
const ENOSYS: u32 = 38;

/// `CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER
/// | CLONE_NEWPID | CLONE_NEWNET`. All but the user namespace need
/// `CAP_SYS_ADMIN`, which runs lack; a user namespace needs nothing, but would
/// hand the process a full capability set inside it and with that the kernel
/// surface (mounts, netfilter, …) that the capability set keeps out of reach.
const CLONE_NAMESPACE_FLAGS: u64 = 0x7E02_0000;

/// `AF_VSOCK` from `<sys/socket.h>`.
const AF_VSOCK: u64 = 40;

/// `personality(2)` values that only query or select ordinary Linux
/// behaviour: `PER_LINUX`, `PER_LINUX32`, `UNAME26`, `PER_LINUX32|UNAME26`
/// and `0xffffffff` (query). Anything else (e.g. `ADDR_NO_RANDOMIZE`,
/// `READ_IMPLIES_EXEC`) weakens exploit mitigations.
const PERSONALITY_VALUES: [u64; 5] = [0x0, 0x8, 0x2_0000, 0x2_0008, 0xffff_ffff];

/// Paths, directories and file metadata: the everyday work of any program.
/// `mknod` is safe to allow because the device cgroup refuses to open any
/// device node outside the standard set.
const FILESYSTEM: &[&str] = &[
    "access",
    "faccessat",
    "faccessat2",
    "chdir",
    "fchdir",
    "getcwd",
    "chmod",
    "fchmod",
    "fchmodat",
    "fchmodat2",
    "chown",
    "fchown",
    "fchownat",
    "lchown",
    "umask",
    "creat",
    "open",
    "openat",
    "openat2",
    "mkdir",
    "mkdirat",
    "mknod",
    "mknodat",
    "rmdir",
    "rename",
    "renameat",
    "renameat2",
    "link",
    "linkat",
    "symlink",
    "symlinkat",
    "unlink",
    "unlinkat",
    "readlink",
    "readlinkat",
    "stat",
    "lstat",
    "fstat",
    "newfstatat",
    "statx",
    "statfs",
    "fstatfs",
    "getdents",
    "getdents64",
    "truncate",
    "ftruncate",
    "utime",
    "utimes",
    "utimensat",
    "futimesat",
    "fallocate",
    "fadvise64",
    "readahead",
    "cachestat",
    "flock",
    "sync",
    "syncfs",
    "fsync",
    "fdatasync",
    "sync_file_range",
];

/// Extended attributes; what a process may touch is still decided by file
/// permissions and the kernel's per-namespace xattr rules.
const XATTRS: &[&str] = &[
    "getxattr",
    "lgetxattr",
    "fgetxattr",
    "setxattr",
    "lsetxattr",
    "fsetxattr",
    "listxattr",
    "llistxattr",
    "flistxattr",
    "removexattr",
    "lremovexattr",
    "fremovexattr",
];

/// File descriptors and moving data between them. `ioctl` is allowed
/// wholesale, as in Docker: the dangerous requests are refused by the kernel
/// for lack of capabilities or by the device cgroup.
const FD_IO: &[&str] = &[
    "read",
    "readv",
    "pread64",
    "preadv",
    "preadv2",
    "write",
    "writev",
    "pwrite64",
    "pwritev",
    "pwritev2",
    "lseek",
    "close",
    "close_range",
    "dup",
    "dup2",
    "dup3",
    "fcntl",
    "ioctl",
    "pipe",
    "pipe2",
    "splice",
    "tee",
    "vmsplice",
    "sendfile",
    "copy_file_range",
];

/// Linux native AIO (databases use it). io_uring is deliberately absent; see
/// the module documentation.
const AIO: &[&str] = &[
    "io_setup",
    "io_destroy",
    "io_submit",
    "io_cancel",
    "io_getevents",
    "io_pgetevents",
];

/// Waiting for many descriptors at once and being told about file changes.
/// `fanotify_mark` is harmless on its own: creating the fanotify group
/// (`fanotify_init`) needs `CAP_SYS_ADMIN` and is not allowed.
const EVENTS: &[&str] = &[
    "poll",
    "ppoll",
    "select",
    "pselect6",
    "epoll_create",
    "epoll_create1",
    "epoll_ctl",
    "epoll_ctl_old",
    "epoll_wait",
    "epoll_wait_old",
    "epoll_pwait",
    "epoll_pwait2",
    "eventfd",
    "eventfd2",
    "inotify_init",
    "inotify_init1",
    "inotify_add_watch",
    "inotify_rm_watch",
    "fanotify_mark",
];

/// Address-space management. `memfd_secret` and the protection-key calls only
/// hide memory from the process's own other threads or the kernel's direct
/// map; `mlock` is bounded by `RLIMIT_MEMLOCK` and the memory cgroup.
const MEMORY: &[&str] = &[
    "brk",
    "mmap",
    "munmap",
    "mremap",
    "mprotect",
    "madvise",
    "mincore",
    "msync",
    "mlock",
    "mlock2",
    "mlockall",
    "munlock",
    "munlockall",
    "membarrier",
    "memfd_create",
    "memfd_secret",
    "remap_file_pages",
    "pkey_alloc",
    "pkey_free",
    "pkey_mprotect",
    "map_shadow_stack",
];

/// Starting, running and reaping processes and threads. `clone` and
/// `clone3` are not here: they get argument checks in [`default_profile`].
/// `prctl` is allowed wholesale as in Docker; its privileged options check
/// capabilities themselves.
const PROCESSES: &[&str] = &[
    "fork",
    "vfork",
    "execve",
    "execveat",
    "exit",
    "exit_group",
    "wait4",
    "waitid",
    "set_tid_address",
    "set_robust_list",
    "get_robust_list",
    "futex",
    "futex_waitv",
    "futex_wait",
    "futex_wake",
    "futex_requeue",
    "rseq",
    "restart_syscall",
    "prctl",
    "getpid",
    "getppid",
    "gettid",
    "getpgid",
    "setpgid",
    "getpgrp",
    "getsid",
    "setsid",
    "process_mrelease",
];

/// User and group identity. Changing it is gated by `CAP_SETUID` and
/// `CAP_SETGID`, which runs keep (as in Docker) so that images can drop root.
const IDENTITY: &[&str] = &[
    "getuid",
    "geteuid",
    "getgid",
    "getegid",
    "getresuid",
    "getresgid",
    "getgroups",
    "setuid",
    "setgid",
    "setreuid",
    "setregid",
    "setresuid",
    "setresgid",
    "setfsuid",
    "setfsgid",
    "setgroups",
    "capget",
    "capset",
];

/// CPU scheduling and I/O priority. Raising priority or choosing real-time
/// policies needs `CAP_SYS_NICE`, which runs do not have, so these can only
/// lower or inspect.
const SCHEDULING: &[&str] = &[
    "sched_yield",
    "sched_getaffinity",
    "sched_setaffinity",
    "sched_getattr",
    "sched_setattr",
    "sched_getparam",
    "sched_setparam",
    "sched_getscheduler",
    "sched_setscheduler",
    "sched_get_priority_max",
    "sched_get_priority_min",
    "sched_rr_get_interval",
    "getpriority",
    "setpriority",
    "ioprio_get",
    "ioprio_set",
    "getcpu",
];

/// Signals, including pidfds. The PID namespace keeps them inside the run.
const SIGNALS: &[&str] = &[
    "kill",
    "tkill",
    "tgkill",
    "rt_sigaction",
    "rt_sigprocmask",
    "rt_sigreturn",
    "rt_sigpending",
    "rt_sigsuspend",
    "rt_sigtimedwait",
    "rt_sigqueueinfo",
    "rt_tgsigqueueinfo",
    "sigaltstack",
    "signalfd",
    "signalfd4",
    "pause",
    "pidfd_open",
    "pidfd_send_signal",
];

/// Reading clocks, sleeping and timers. `adjtimex` and `clock_adjtime` are
/// here because they are also the way to *read* the kernel's clock state;
/// changing it needs `CAP_SYS_TIME`. Setting the clock outright
/// (`settimeofday`, `clock_settime`, `stime`) is left out.
const TIME: &[&str] = &[
    "clock_gettime",
    "clock_getres",
    "clock_nanosleep",
    "clock_adjtime",
    "adjtimex",
    "gettimeofday",
    "time",
    "times",
    "nanosleep",
    "alarm",
    "getitimer",
    "setitimer",
    "timer_create",
    "timer_delete",
    "timer_gettime",
    "timer_settime",
    "timer_getoverrun",
    "timerfd_create",
    "timerfd_gettime",
    "timerfd_settime",
];

/// Resource limits and information about the system. Raising a hard limit
/// needs `CAP_SYS_RESOURCE`, which runs do not have.
const SYSTEM_INFO: &[&str] = &[
    "getrlimit",
    "setrlimit",
    "prlimit64",
    "getrusage",
    "sysinfo",
    "uname",
    "getrandom",
];

/// Socket operations on an existing socket. Creating one (`socket`) has its
/// own rule; raw and packet sockets are refused by the kernel because runs
/// lack `CAP_NET_RAW`.
const SOCKETS: &[&str] = &[
    "socketpair",
    "bind",
    "connect",
    "listen",
    "accept",
    "accept4",
    "getsockname",
    "getpeername",
    "getsockopt",
    "setsockopt",
    "sendto",
    "sendmsg",
    "sendmmsg",
    "recvfrom",
    "recvmsg",
    "recvmmsg",
    "shutdown",
];

/// System V IPC and POSIX message queues; the IPC namespace confines both to
/// the run.
const IPC: &[&str] = &[
    "msgget",
    "msgsnd",
    "msgrcv",
    "msgctl",
    "semget",
    "semop",
    "semtimedop",
    "semctl",
    "shmget",
    "shmat",
    "shmdt",
    "shmctl",
    "mq_open",
    "mq_unlink",
    "mq_timedsend",
    "mq_timedreceive",
    "mq_notify",
    "mq_getsetattr",
];

/// Processes restricting themselves further (browsers, language runtimes,
/// build tools): a stacked seccomp filter or a Landlock ruleset can only take
/// rights away.
const SELF_SANDBOXING: &[&str] = &[
    "seccomp",
    "landlock_create_ruleset",
    "landlock_add_rule",
    "landlock_restrict_self",
];

/// `chroot` is gated on `CAP_SYS_CHROOT` in Docker's profile; runs keep that
/// capability (package managers and build tools use it), so it is allowed.
const CHROOT: &[&str] = &["chroot"];

/// Names used only by 32-bit ABIs (x86 on x86_64, arm on aarch64): 32-bit
/// uid variants, 64-bit file offset variants and the multiplexers
/// `socketcall` and `ipc`. They must be listed because the filter also covers
/// those architectures, and 32-bit binaries call these instead of the 64-bit
/// names above.
const COMPAT_32BIT: &[&str] = &[
    "chown32",
    "fchown32",
    "lchown32",
    "getuid32",
    "geteuid32",
    "getgid32",
    "getegid32",
    "getresuid32",
    "getresgid32",
    "getgroups32",
    "setuid32",
    "setgid32",
    "setreuid32",
    "setregid32",
    "setresuid32",
    "setresgid32",
    "setfsuid32",
    "setfsgid32",
    "setgroups32",
    "fcntl64",
    "stat64",
    "lstat64",
    "fstat64",
    "fstatat64",
    "statfs64",
    "fstatfs64",
    "truncate64",
    "ftruncate64",
    "_llseek",
    "mmap2",
    "sendfile64",
    "fadvise64_64",
    "_newselect",
    "ugetrlimit",
    "waitpid",
    "sigprocmask",
    "sigreturn",
    "socketcall",
    "ipc",
    "send",
    "recv",
];

/// The 64-bit `time_t` variants that 32-bit ABIs gained for the year-2038
/// problem; each duplicates a call allowed above.
const TIME64_32BIT: &[&str] = &[
    "clock_gettime64",
    "clock_getres_time64",
    "clock_nanosleep_time64",
    "clock_adjtime64",
    "futex_time64",
    "io_pgetevents_time64",
    "mq_timedreceive_time64",
    "mq_timedsend_time64",
    "ppoll_time64",
    "pselect6_time64",
    "recvmmsg_time64",
    "rt_sigtimedwait_time64",
    "sched_rr_get_interval_time64",
    "semtimedop_time64",
    "timer_gettime64",
    "timer_settime64",
    "timerfd_gettime64",
    "timerfd_settime64",
    "utimensat_time64",
];

/// x86 only: thread-local storage setup (`arch_prctl`, the thread-area
/// calls) and `modify_ldt`, which 16-bit code, Wine and some old runtimes
/// need. Docker allows the same on its x86 architectures.
const X86_ONLY: &[&str] = &[
    "arch_prctl",
    "modify_ldt",
    "get_thread_area",
    "set_thread_area",
];

/// 32-bit arm only (also reachable on aarch64 through the compat ABI): TLS,
/// cache maintenance for JITs, and arm's argument orderings of
/// `fadvise64_64`/`sync_file_range`. Docker allows the same on arm.
const ARM_ONLY: &[&str] = &[
    "arm_fadvise64_64",
    "arm_sync_file_range",
    "sync_file_range2",
    "breakpoint",
    "cacheflush",
    "set_tls",
];

/// Every group that is allowed without looking at arguments.
const UNCONDITIONAL: &[&[&str]] = &[
    FILESYSTEM,
    XATTRS,
    FD_IO,
    AIO,
    EVENTS,
    MEMORY,
    PROCESSES,
    IDENTITY,
    SCHEDULING,
    SIGNALS,
    TIME,
    SYSTEM_INFO,
    SOCKETS,
    IPC,
    SELF_SANDBOXING,
    CHROOT,
    COMPAT_32BIT,
    TIME64_32BIT,
    X86_ONLY,
    ARM_ONLY,
];

/// The seccomp profile for every run: an allow-list equivalent to Docker's
/// default profile for a container without `CAP_SYS_ADMIN`, with the
/// differences listed in the module documentation.
///
/// The filter covers x86_64 with its 32-bit (x86) and x32 ABIs, and aarch64
/// with its 32-bit arm ABI, so one profile serves both host kinds and a
/// 32-bit binary cannot slip past it through the compat entry point.
pub fn default_profile() -> LinuxSeccomp {
    let mut syscalls = vec![allow(
        UNCONDITIONAL.iter().flat_map(|g| g.iter().copied()),
        Vec::new(),
    )];

    // `socket` for every family but vsock. On 32-bit x86 the same call can
    // arrive through `socketcall`, whose arguments sit in memory where seccomp
    // cannot read them; that gap exists in Docker's profile too.
    syscalls.push(allow(
        ["socket"],
        vec![arg(0, AF_VSOCK, LinuxSeccompOperator::ScmpCmpNe)],
    ));

    // One rule per accepted value: conditions within a rule are ANDed, so
    // the alternatives must be separate rules.
    for value in PERSONALITY_VALUES {
        syscalls.push(allow(
            ["personality"],
            vec![arg(0, value, LinuxSeccompOperator::ScmpCmpEq)],
        ));
    }

    // `clone` only when `flags & CLONE_NAMESPACE_FLAGS == 0`. MASKED_EQ
    // compares `arg & value` with `value_two`. (s390 passes flags as the
    // second argument; runbox does not target s390, so index 0 is right.)
    let no_namespaces = arg(
        0,
        CLONE_NAMESPACE_FLAGS,
        LinuxSeccompOperator::ScmpCmpMaskedEq,
    );
    syscalls.push(allow(["clone"], vec![no_namespaces]));

    // `clone3` takes its flags in a struct the filter cannot read, so it
    // cannot be checked like `clone`. ENOSYS (not EPERM) tells libc to fall
    // back to `clone`, which is checked.
    let mut clone3 = LinuxSyscall::default();
    clone3
        .set_names(vec!["clone3".to_string()])
        .set_action(LinuxSeccompAction::ScmpActErrno)
        .set_errno_ret(Some(ENOSYS));
    syscalls.push(clone3);

    let mut profile = LinuxSeccomp::default();
    profile
        .set_default_action(LinuxSeccompAction::ScmpActErrno)
        .set_default_errno_ret(Some(EPERM))
        .set_architectures(Some(host_architectures()))
        .set_syscalls(Some(syscalls));
    profile
}

/// The ABIs a process on this host can make system calls with: the
/// native one and the compatibility ones the kernel of that architecture
/// may offer. Elsewhere, none named: libseccomp adds the native one itself.
pub fn host_architectures() -> Vec<Arch> {
    if cfg!(target_arch = "x86_64") {
        vec![Arch::ScmpArchX86_64, Arch::ScmpArchX86, Arch::ScmpArchX32]
    } else if cfg!(target_arch = "aarch64") {
        vec![Arch::ScmpArchAarch64, Arch::ScmpArchArm]
    } else {
        Vec::new()
    }
}

/// `profile` compiled to the BPF program the kernel loads, as crun 1.8
/// compiles an OCI profile: with libseccomp (the same library, so the same
/// program), the profile's architectures added, then each rule's names in
/// order with its action and conditions; a rule whose action is the
/// default is left out, a name the library does not know is skipped, and
/// a rule with two conditions on one argument becomes one rule per
/// condition. The tests compare the result with what crun itself compiles.
///
/// Blocking (tens of milliseconds): done once, off the create path. An
/// error (an action, operator or architecture this does not translate)
/// means the runtime compiles the profile itself, as it would anyway.
pub fn compile(profile: &LinuxSeccomp) -> Result<Vec<u8>, String> {
    use libseccomp::{ScmpArgCompare, ScmpCompareOp, ScmpFilterContext, ScmpSyscall};
    use std::io::{Read, Seek};

    let errno_or = |errno: Option<u32>| errno.unwrap_or(EPERM);
    let default = action(
        profile.default_action(),
        errno_or(profile.default_errno_ret()),
    )?;
    let mut filter = ScmpFilterContext::new_filter(default).map_err(|e| e.to_string())?;
    for arch in profile.architectures().iter().flatten() {
        filter
            .add_arch(scmp_arch(*arch)?)
            .map_err(|e| format!("adding {arch:?}: {e}"))?;
    }
    for rule in profile.syscalls().iter().flatten() {
        let rule_action = action(rule.action(), errno_or(rule.errno_ret()))?;
        if rule_action == default {
            continue;
        }
        let mut compares = Vec::new();
        for arg in rule.args().iter().flatten().take(6) {
            let index = u32::try_from(arg.index())
                .ok()
                .filter(|i| *i < 6)
                .ok_or_else(|| format!("argument index {} is not 0-5", arg.index()))?;
            let op = match arg.op() {
                LinuxSeccompOperator::ScmpCmpNe => ScmpCompareOp::NotEqual,
                LinuxSeccompOperator::ScmpCmpLt => ScmpCompareOp::Less,
                LinuxSeccompOperator::ScmpCmpLe => ScmpCompareOp::LessOrEqual,
                LinuxSeccompOperator::ScmpCmpEq => ScmpCompareOp::Equal,
                LinuxSeccompOperator::ScmpCmpGe => ScmpCompareOp::GreaterEqual,
                LinuxSeccompOperator::ScmpCmpGt => ScmpCompareOp::Greater,
                LinuxSeccompOperator::ScmpCmpMaskedEq => ScmpCompareOp::MaskedEqual(arg.value()),
            };
            let datum = match arg.op() {
                LinuxSeccompOperator::ScmpCmpMaskedEq => arg.value_two().unwrap_or(0),
                _ => arg.value(),
            };
            compares.push((index, ScmpArgCompare::new(index, op, datum)));
        }
        let mut indices: Vec<u32> = compares.iter().map(|(i, _)| *i).collect();
        indices.sort_unstable();
        let repeated = indices.windows(2).any(|w| w[0] == w[1]);
        for name in rule.names() {
            let Ok(syscall) = ScmpSyscall::from_name(name) else {
                continue;
            };
            let added = if compares.is_empty() {
                filter.add_rule(rule_action, syscall)
            } else if repeated {
                compares.iter().try_for_each(|(_, c)| {
                    filter.add_rule_conditional(rule_action, syscall, std::slice::from_ref(c))
                })
            } else {
                let all: Vec<ScmpArgCompare> = compares.iter().map(|(_, c)| *c).collect();
                filter.add_rule_conditional(rule_action, syscall, &all)
            };
            added.map_err(|e| format!("adding the rule for {name}: {e}"))?;
        }
    }
    let mut out = memfd()?;
    filter
        .export_bpf(&mut out)
        .map_err(|e| format!("exporting the filter: {e}"))?;
    let mut program = Vec::new();
    out.rewind()
        .and_then(|()| out.read_to_end(&mut program))
        .map_err(|e| format!("reading the exported filter: {e}"))?;
    // A classic BPF program: whole 8-byte instructions, at most 4096.
    if program.is_empty() || program.len() % 8 != 0 || program.len() / 8 > 4096 {
        return Err(format!(
            "the exported filter is {} bytes long",
            program.len()
        ));
    }
    Ok(program)
}

/// An anonymous in-memory file, for libseccomp to export into.
fn memfd() -> Result<std::fs::File, String> {
    rustix::fs::memfd_create("runbox-seccomp", rustix::fs::MemfdFlags::CLOEXEC)
        .map(std::fs::File::from)
        .map_err(|e| format!("making a memfd: {e}"))
}

fn action(action: LinuxSeccompAction, errno: u32) -> Result<libseccomp::ScmpAction, String> {
    use libseccomp::ScmpAction;
    let errno = i32::try_from(errno).map_err(|_| format!("errno {errno} is out of range"))?;
    Ok(match action {
        LinuxSeccompAction::ScmpActKill | LinuxSeccompAction::ScmpActKillThread => {
            ScmpAction::KillThread
        }
        LinuxSeccompAction::ScmpActKillProcess => ScmpAction::KillProcess,
        LinuxSeccompAction::ScmpActTrap => ScmpAction::Trap,
        LinuxSeccompAction::ScmpActErrno => ScmpAction::Errno(errno),
        LinuxSeccompAction::ScmpActTrace => ScmpAction::Trace(errno as u16),
        LinuxSeccompAction::ScmpActAllow => ScmpAction::Allow,
        LinuxSeccompAction::ScmpActLog => ScmpAction::Log,
        other => return Err(format!("action {other:?} is not compiled here")),
    })
}

fn scmp_arch(arch: Arch) -> Result<libseccomp::ScmpArch, String> {
    use libseccomp::ScmpArch;
    Ok(match arch {
        Arch::ScmpArchX86_64 => ScmpArch::X8664,
        Arch::ScmpArchX86 => ScmpArch::X86,
        Arch::ScmpArchX32 => ScmpArch::X32,
        Arch::ScmpArchAarch64 => ScmpArch::Aarch64,
        Arch::ScmpArchArm => ScmpArch::Arm,
        other => return Err(format!("architecture {other:?} is not compiled here")),
    })
}

/// An allow rule for `names`, with `args` as conditions (empty: always).
fn allow<'a>(names: impl IntoIterator<Item = &'a str>, args: Vec<LinuxSeccompArg>) -> LinuxSyscall {
    let mut rule = LinuxSyscall::default();
    rule.set_names(names.into_iter().map(String::from).collect())
        .set_action(LinuxSeccompAction::ScmpActAllow)
        .set_args(if args.is_empty() { None } else { Some(args) });
    rule
}

/// A condition on argument `index`. `value_two` is always 0: it is only read
/// by `SCMP_CMP_MASKED_EQ`, where it is the value `arg & value` must equal.
fn arg(index: usize, value: u64, op: LinuxSeccompOperator) -> LinuxSeccompArg {
    LinuxSeccompArgBuilder::default()
        .index(index)
        .value(value)
        .value_two(0u64)
        .op(op)
        .build()
        // LinuxSeccompArg has no setters, only this builder; it cannot fail
        // because every field has a default and there is no validator.
        .expect("seccomp arg builder has defaults for every field")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// Rules with their names, for lookups.
    fn rules_for(profile: &LinuxSeccomp, name: &str) -> Vec<LinuxSyscall> {
        profile
            .syscalls()
            .as_ref()
            .expect("profile has syscalls")
            .iter()
            .filter(|r| r.names().iter().any(|n| n == name))
            .cloned()
            .collect()
    }

    fn unconditionally_allowed(profile: &LinuxSeccomp, name: &str) -> bool {
        rules_for(profile, name).iter().any(|r| {
            r.action() == LinuxSeccompAction::ScmpActAllow
                && r.args().as_ref().is_none_or(|a| a.is_empty())
        })
    }

    #[test]
    fn defaults_to_eperm() {
        let p = default_profile();
        assert_eq!(p.default_action(), LinuxSeccompAction::ScmpActErrno);
        assert_eq!(p.default_errno_ret(), Some(1));
        let arches = p.architectures().clone().expect("architectures set");
        #[cfg(target_arch = "x86_64")]
        assert_eq!(
            arches,
            [Arch::ScmpArchX86_64, Arch::ScmpArchX86, Arch::ScmpArchX32]
        );
        #[cfg(target_arch = "aarch64")]
        assert_eq!(arches, [Arch::ScmpArchAarch64, Arch::ScmpArchArm]);
    }

    #[test]
    fn no_duplicate_names() {
        let p = default_profile();
        let rules = p.syscalls().as_ref().expect("syscalls");
        let mut unconditional = HashSet::new();
        for rule in rules {
            let mut in_rule = HashSet::new();
            for n in rule.names() {
                assert!(in_rule.insert(n.as_str()), "{n} twice in one rule");
            }
        }
        for n in UNCONDITIONAL.iter().flat_map(|g| g.iter()) {
            assert!(unconditional.insert(*n), "{n} listed twice");
        }
        // A name with argument checks must not also be allowed
        // unconditionally, or the checks would be void.
        for rule in rules.iter().filter(|r| r.args().is_some()) {
            for n in rule.names() {
                assert!(!unconditional.contains(n.as_str()), "{n} both ways");
            }
        }
        assert!(!unconditional.contains("clone3"));
    }

    #[test]
    fn denies_privileged_syscalls() {
        let p = default_profile();
        for name in [
            "mount",
            "umount2",
            "unshare",
            "setns",
            "ptrace",
            "bpf",
            "kexec_load",
            "kexec_file_load",
            "init_module",
            "finit_module",
            "reboot",
            "settimeofday",
            "clock_settime",
            "acct",
            "iopl",
            "ioperm",
            "vhangup",
            "syslog",
            "perf_event_open",
            "open_by_handle_at",
            "name_to_handle_at",
            "fanotify_init",
            "lookup_dcookie",
            "keyctl",
            "add_key",
            "request_key",
            "userfaultfd",
            "quotactl",
            "pivot_root",
            "swapon",
            "swapoff",
            "io_uring_setup",
            "process_vm_readv",
            "sethostname",
            "fsopen",
            "open_tree",
            "move_mount",
        ] {
            assert!(rules_for(&p, name).is_empty(), "{name} must not be listed");
        }
    }

    #[test]
    fn allows_ordinary_syscalls() {
        let p = default_profile();
        for name in [
            "read", "write", "execve", "openat2", "chroot", "mmap", "futex", "wait4", "statx",
        ] {
            assert!(unconditionally_allowed(&p, name), "{name} must be allowed");
        }
        assert!(!rules_for(&p, "clone").is_empty(), "clone must be allowed");
    }

    #[test]
    fn clone_masks_namespace_flags() {
        let p = default_profile();
        let rules = rules_for(&p, "clone");
        assert_eq!(rules.len(), 1);
        let rule = &rules[0];
        assert_eq!(rule.action(), LinuxSeccompAction::ScmpActAllow);
        let args = rule.args().as_ref().expect("clone has an argument check");
        assert_eq!(args.len(), 1);
        assert_eq!(args[0].index(), 0);
        assert_eq!(args[0].op(), LinuxSeccompOperator::ScmpCmpMaskedEq);
        assert_eq!(args[0].value(), 0x7E02_0000);
        assert_eq!(args[0].value_two().unwrap_or(0), 0);
    }

    #[test]
    fn clone3_is_enosys() {
        let p = default_profile();
        let rules = rules_for(&p, "clone3");
        assert_eq!(rules.len(), 1);
        assert_eq!(rules[0].action(), LinuxSeccompAction::ScmpActErrno);
        assert_eq!(rules[0].errno_ret(), Some(38));
    }

    #[test]
    fn personality_only_safe_values() {
        let p = default_profile();
        let mut values: Vec<u64> = rules_for(&p, "personality")
            .iter()
            .map(|r| {
                let args = r.args().as_ref().expect("personality is checked");
                assert_eq!(args.len(), 1);
                assert_eq!(args[0].op(), LinuxSeccompOperator::ScmpCmpEq);
                args[0].value()
            })
            .collect();
        values.sort_unstable();
        assert_eq!(values, vec![0x0, 0x8, 0x20000, 0x20008, 0xffff_ffff]);
    }

    #[test]
    fn serializes_as_oci_json() {
        let json = serde_json::to_value(default_profile()).expect("serializes");
        assert_eq!(json["defaultAction"], "SCMP_ACT_ERRNO");
        assert_eq!(json["defaultErrnoRet"], 1);
        let clone = json["syscalls"]
            .as_array()
            .expect("syscalls array")
            .iter()
            .find(|r| r["names"][0] == "clone")
            .expect("clone rule");
        assert_eq!(clone["args"][0]["op"], "SCMP_CMP_MASKED_EQ");
        assert_eq!(clone["args"][0]["value"], 0x7E02_0000_u64);
    }
}
