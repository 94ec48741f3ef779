//! User namespaces and idmapped mounts: what makes root in a run nobody on
//! the host while the run's files keep the owners its image gave them.
//!
//! A run's processes live in a user namespace whose ids 0-65535 map to a
//! host range of 65536 ids of its own. Its image layers stay shared,
//! read-only and owned as the image says (id N on disk for the image's id
//! N); each is bind-mounted for the run with an id mapping (an idmapped
//! mount: `mount_setattr(2)` with `MOUNT_ATTR_IDMAP`) under which on-disk
//! id N is host id base+N, so the run sees N again. Nothing is copied or
//! chowned, and the kernel does the translation on every access.
//!
//! An idmapped mount takes its mapping from a user namespace. The
//! namespaces made here hold no process: a short-lived child makes one,
//! the daemon writes its maps and keeps a descriptor, and the child exits.
//! A descriptor is all the kernel needs, for as long as it is open or a
//! mount uses it.
//!
//! Why by hand: `mount_setattr(2)` has no wrapper in rustix or nix, and
//! making a namespace without running a program in it needs a fork whose
//! child does nothing but `unshare`, `write`, `read` and `_exit`; neither
//! is a library's job today.

use std::ffi::CString;
use std::fmt::Write as _;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::path::Path;

/// One line of a `uid_map` or `gid_map`: `count` ids from `inside` in the
/// namespace are the host's ids from `outside`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Extent {
    /// The first id in the namespace.
    pub inside: u32,
    /// The host id it is.
    pub outside: u32,
    /// How many consecutive ids.
    pub count: u32,
}

impl Extent {
    /// `count` ids from 0 inside, `base` outside: a run's range.
    pub fn range(base: u32, count: u32) -> Extent {
        Extent {
            inside: 0,
            outside: base,
            count,
        }
    }
}

/// The text of a map file: one `inside outside count` line per extent.
fn map_text(map: &[Extent]) -> String {
    let mut text = String::new();
    for e in map {
        let _ = writeln!(text, "{} {} {}", e.inside, e.outside, e.count);
    }
    text
}

/// Two pipes' ends, closed when dropped.
struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
}

fn pipe() -> io::Result<Pipe> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors into the array it is given.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both were just opened and are owned by nothing else.
    Ok(unsafe {
        Pipe {
            read: OwnedFd::from_raw_fd(fds[0]),
            write: OwnedFd::from_raw_fd(fds[1]),
        }
    })
}

/// A short-lived child process that holds new namespaces while the
/// daemon looks at them through `/proc/<pid>/ns/`: it joins a user
/// namespace if asked, unshares, reports, and waits to be killed. Dropping
/// it kills and reaps the child; what the daemon opened or mounted of its
/// namespaces stays.
///
/// The child is told to go with a signal, not by closing a pipe: a holder
/// forked at the same moment by another thread inherits this one's pipe
/// ends, so an end-of-file could wait on that other child, and two could
/// wait on each other for ever.
pub(crate) struct Holder {
    pid: libc::pid_t,
}

impl Holder {
    /// Forks the holder: it enters user namespace `join` (when given),
    /// unshares `flags` (`CLONE_NEW*`), and waits. Fails when either step
    /// fails in the child.
    pub(crate) fn spawn(join: Option<BorrowedFd<'_>>, flags: libc::c_int) -> io::Result<Holder> {
        let ready = pipe()?;
        let join = join.map(|fd| fd.as_raw_fd());
        // SAFETY: getpid has no preconditions.
        let parent = unsafe { libc::getpid() };
        // SAFETY: the child runs only async-signal-safe calls (prctl,
        // getppid, close, close_range, setns, unshare, write, pause) on
        // descriptors it owns a copy of, until it is killed; it touches no
        // lock or allocation the parent's other threads may hold.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            return Err(io::Error::last_os_error());
        }
        if pid == 0 {
            // SAFETY: as above; the child never returns from this block.
            unsafe {
                // Die with the daemon (a daemon killed with -9 must not
                // leave a holder behind), even if it died already.
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                if libc::getppid() != parent {
                    libc::_exit(1);
                }
                libc::close(ready.read.as_raw_fd());
                let joined = match join {
                    Some(fd) => libc::setns(fd, libc::CLONE_NEWUSER) == 0,
                    None => true,
                };
                let ok = u8::from(joined && libc::unshare(flags) == 0);
                // Keep nothing of the daemon's open: not its state
                // directory's lock, not another holder's pipe.
                let keep = ready.write.as_raw_fd() as libc::c_uint;
                if keep > 0 {
                    libc::syscall(
                        libc::SYS_close_range,
                        0 as libc::c_uint,
                        keep - 1,
                        0 as libc::c_uint,
                    );
                }
                libc::syscall(
                    libc::SYS_close_range,
                    keep + 1,
                    libc::c_uint::MAX,
                    0 as libc::c_uint,
                );
                libc::write(ready.write.as_raw_fd(), (&raw const ok).cast(), 1);
                libc::close(ready.write.as_raw_fd());
                loop {
                    libc::pause();
                }
            }
        }
        drop(ready.write);
        // From here the child is reaped whatever happens.
        let holder = Holder { pid };
        let mut byte = 0u8;
        // SAFETY: reads one byte into a local.
        let n = unsafe { libc::read(ready.read.as_raw_fd(), (&raw mut byte).cast(), 1) };
        if n != 1 || byte != 1 {
            return Err(io::Error::other(
                "the helper process could not make its namespaces",
            ));
        }
        Ok(holder)
    }

    /// `/proc/<pid>/<rel>` of the holder.
    pub(crate) fn proc(&self, rel: &str) -> std::path::PathBuf {
        std::path::PathBuf::from(format!("/proc/{}/{rel}", self.pid))
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let mut status = 0;
        // SAFETY: signals and reaps our own child.
        unsafe {
            libc::kill(self.pid, libc::SIGKILL);
            libc::waitpid(self.pid, &mut status, 0);
        }
    }
}

/// Makes a user namespace whose uids and gids are both mapped by `map`,
/// and returns a descriptor that holds it. Needs `CAP_SETUID` and
/// `CAP_SETGID` (the daemon is root). Blocking: a fork and a few writes.
pub fn user_namespace(map: &[Extent]) -> io::Result<OwnedFd> {
    if map.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "an id map needs at least one extent",
        ));
    }
    let text = map_text(map);
    let holder = Holder::spawn(None, libc::CLONE_NEWUSER)?;
    // Each map is written with one write(2), as the kernel requires.
    std::fs::write(holder.proc("uid_map"), &text)?;
    std::fs::write(holder.proc("gid_map"), &text)?;
    let ns = std::fs::File::open(holder.proc("ns/user"))?;
    Ok(OwnedFd::from(ns))
}

/// Keeps user namespace `userns` at `path` (an empty file, made here if
/// missing) with a bind mount, as `ip netns` keeps network namespaces, so
/// a runtime can join it by path and a restarted daemon find it again.
pub fn pin(userns: BorrowedFd<'_>, path: &Path) -> io::Result<()> {
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)?;
    let source = format!("/proc/self/fd/{}", userns.as_raw_fd());
    rustix::mount::mount_bind(source.as_str(), path)?;
    Ok(())
}

/// Opens the namespace pinned at `path`.
pub fn open_pinned(path: &Path) -> io::Result<OwnedFd> {
    Ok(OwnedFd::from(std::fs::File::open(path)?))
}

/// Removes a pin made by [`pin`]: detaches the mount and removes the
/// file. Succeeds when there is nothing to remove.
pub fn unpin(path: &Path) -> io::Result<()> {
    match rustix::mount::unmount(path, rustix::mount::UnmountFlags::DETACH) {
        Ok(()) | Err(rustix::io::Errno::INVAL) | Err(rustix::io::Errno::NOENT) => {}
        Err(e) => return Err(e.into()),
    }
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// The inode of the user namespace that owns namespace `ns` (any kind but
/// a user namespace itself, whose parent it would be).
pub fn owner_inode(ns: BorrowedFd<'_>) -> io::Result<u64> {
    use std::os::unix::fs::MetadataExt;
    // NS_GET_USERNS, _IO(0xb7, 0x1): a descriptor of the owning namespace.
    const NS_GET_USERNS: libc::c_ulong = 0xb701;
    // SAFETY: the ioctl takes no argument and returns a new descriptor.
    let fd = unsafe { libc::ioctl(ns.as_raw_fd(), NS_GET_USERNS) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor the kernel just opened for us.
    let owner = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    Ok(owner.metadata()?.ino())
}

/// Bind-mounts `source` (not what is mounted below it) at `target`, which
/// must exist, with the id mapping of user namespace `userns`: on-disk id
/// N is seen as what N is inside `userns` on the host. Blocking.
pub fn idmapped_bind(source: &Path, target: &Path, userns: BorrowedFd<'_>) -> io::Result<()> {
    let tree = cloned_tree(source, libc::MOUNT_ATTR_IDMAP, Some(userns))?;
    rustix::mount::move_mount(
        tree.as_fd(),
        "",
        rustix::fs::CWD,
        target,
        rustix::mount::MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
    )?;
    Ok(())
}

/// A detached copy of the mount at `source` (not what is mounted below
/// it), ready for [`mount_into`]: mapped through user namespace `userns`
/// when given (as [`idmapped_bind`] maps), `nodev`, `nosuid`, and
/// read-only with `read_only`. Blocking.
pub fn detached_bind(
    source: &Path,
    userns: Option<BorrowedFd<'_>>,
    read_only: bool,
) -> io::Result<OwnedFd> {
    let mut set = libc::MOUNT_ATTR_NODEV | libc::MOUNT_ATTR_NOSUID;
    if read_only {
        set |= libc::MOUNT_ATTR_RDONLY;
    }
    if userns.is_some() {
        set |= libc::MOUNT_ATTR_IDMAP;
    }
    cloned_tree(source, set, userns)
}

/// A detached clone of the mount at `source` with mount attributes `set`
/// (`MOUNT_ATTR_*`; `MOUNT_ATTR_IDMAP` takes `userns`).
fn cloned_tree(source: &Path, set: u64, userns: Option<BorrowedFd<'_>>) -> io::Result<OwnedFd> {
    use rustix::mount::OpenTreeFlags;
    let tree = rustix::mount::open_tree(
        rustix::fs::CWD,
        source,
        OpenTreeFlags::OPEN_TREE_CLONE | OpenTreeFlags::OPEN_TREE_CLOEXEC,
    )?;
    let attr = libc::mount_attr {
        attr_set: set,
        attr_clr: 0,
        propagation: 0,
        userns_fd: userns.map_or(0, |fd| fd.as_raw_fd() as u64),
    };
    let empty = CString::default();
    // SAFETY: mount_setattr(2) reads `attr` (of the size given) and the
    // empty path; `tree` is a detached mount we own.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_EMPTY_PATH,
            &raw const attr,
            std::mem::size_of::<libc::mount_attr>(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(tree)
}

/// Attaches detached mount `tree` at `target` (absolute, resolved as the
/// process sees it: `..` and absolute symlinks stay inside its root) in
/// the mount namespace of process `pid`, a running sandbox's init. The
/// directory must exist. Blocking: a fork that joins the namespace, as a
/// thread cannot (`setns` refuses a process whose threads share its
/// filesystem context).
pub fn mount_into(pid: i32, tree: &OwnedFd, target: &str) -> io::Result<()> {
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/mnt"))?;
    let target = CString::new(target).map_err(|_| io::Error::other("a NUL in the mount path"))?;
    let empty = CString::default();
    // openat2(2)'s `struct open_how` (libc's is non-exhaustive).
    #[repr(C)]
    struct OpenHow {
        flags: u64,
        mode: u64,
        resolve: u64,
    }
    let how = OpenHow {
        flags: (libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) as u64,
        mode: 0,
        resolve: libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS,
    };
    let report = pipe()?;
    // SAFETY: the child makes only raw system calls (prctl, setns, openat2,
    // move_mount, write, _exit) on memory prepared before the fork; it
    // touches no lock or allocation the parent's other threads may hold.
    let child = unsafe { libc::fork() };
    if child < 0 {
        return Err(io::Error::last_os_error());
    }
    if child == 0 {
        // SAFETY: as above; the child never returns from this block.
        unsafe {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            let fail = |step: u8| -> ! {
                let errno = *libc::__errno_location();
                let mut out = [step, 0, 0, 0, 0];
                out[1..].copy_from_slice(&errno.to_ne_bytes());
                libc::write(report.write.as_raw_fd(), out.as_ptr().cast(), out.len());
                libc::_exit(1)
            };
            if libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNS) != 0 {
                fail(1);
            }
            let dir = libc::syscall(
                libc::SYS_openat2,
                libc::AT_FDCWD,
                target.as_ptr(),
                &raw const how,
                std::mem::size_of::<OpenHow>(),
            );
            if dir < 0 {
                fail(2);
            }
            let moved = libc::syscall(
                libc::SYS_move_mount,
                tree.as_raw_fd(),
                empty.as_ptr(),
                dir as libc::c_int,
                empty.as_ptr(),
                libc::MOVE_MOUNT_F_EMPTY_PATH | libc::MOVE_MOUNT_T_EMPTY_PATH,
            );
            if moved != 0 {
                fail(3);
            }
            libc::_exit(0)
        }
    }
    drop(report.write);
    let mut status = 0;
    // SAFETY: reaps our own child.
    if unsafe { libc::waitpid(child, &mut status, 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut out = [0u8; 5];
    // SAFETY: reads at most 5 bytes into a local.
    let n = unsafe { libc::read(report.read.as_raw_fd(), out.as_mut_ptr().cast(), out.len()) };
    if libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0 {
        return Ok(());
    }
    if n != 5 {
        return Err(io::Error::other("the mount helper died"));
    }
    let errno = i32::from_ne_bytes([out[1], out[2], out[3], out[4]]);
    let step = match out[0] {
        1 => "joining the sandbox's mount namespace",
        2 => "opening the mount path in the sandbox",
        _ => "attaching the mount in the sandbox",
    };
    let cause = io::Error::from_raw_os_error(errno);
    Err(io::Error::new(cause.kind(), format!("{step}: {cause}")))
}

/// Whether idmapped mounts work on the filesystem holding `dir`: maps a
/// scratch directory made there with a namespace shifting ids by 65536
/// and checks what the mount shows. The reason when they do not.
pub fn probe(dir: &Path) -> Result<(), String> {
    let scratch = tempfile::Builder::new()
        .prefix(".idmap-probe-")
        .tempdir_in(dir)
        .map_err(|e| format!("making a scratch directory in {}: {e}", dir.display()))?;
    let (source, target) = (scratch.path().join("source"), scratch.path().join("target"));
    for d in [&source, &target] {
        std::fs::create_dir(d).map_err(|e| format!("making {}: {e}", d.display()))?;
    }
    let ns = user_namespace(&[Extent::range(65536, 65536)])
        .map_err(|e| format!("making a user namespace: {e}"))?;
    idmapped_bind(&source, &target, ns.as_fd())
        .map_err(|e| format!("an idmapped mount on {}: {e}", dir.display()))?;
    let seen = std::fs::metadata(&target).map(|m| std::os::unix::fs::MetadataExt::uid(&m));
    let _ = rustix::mount::unmount(&target, rustix::mount::UnmountFlags::DETACH);
    match seen {
        Ok(65536) => Ok(()),
        Ok(uid) => Err(format!(
            "an idmapped mount on {} showed uid {uid}, not 65536",
            dir.display()
        )),
        Err(e) => Err(format!("reading the idmapped mount: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn uid(path: &Path) -> u32 {
        std::fs::symlink_metadata(path).unwrap().uid()
    }

    #[test]
    fn an_idmapped_bind_shows_on_disk_ids_through_the_map() {
        let dir = tempfile::tempdir().unwrap();
        let (source, target) = (dir.path().join("s"), dir.path().join("t"));
        std::fs::create_dir(&source).unwrap();
        std::fs::create_dir(&target).unwrap();
        let file = source.join("f");
        std::fs::write(&file, "x").unwrap();
        std::os::unix::fs::chown(&file, Some(1000), Some(1000)).unwrap();
        let ns = user_namespace(&[Extent::range(300_000, 65536)]).unwrap();
        idmapped_bind(&source, &target, ns.as_fd()).unwrap();
        let seen = (uid(&target), uid(&target.join("f")));
        let gid = std::fs::metadata(target.join("f")).unwrap().gid();
        rustix::mount::unmount(&target, rustix::mount::UnmountFlags::DETACH).unwrap();
        assert_eq!(seen, (300_000, 301_000));
        assert_eq!(gid, 301_000);
        // The source itself is untouched.
        assert_eq!(uid(&file), 1000);
    }

    #[test]
    fn a_map_may_move_one_range_onto_another() {
        // A layer written by a run of range 200000 shown to a run of range
        // 400000; host root stays root (overlayfs' own scratch files).
        let dir = tempfile::tempdir().unwrap();
        let (source, target) = (dir.path().join("s"), dir.path().join("t"));
        std::fs::create_dir(&source).unwrap();
        std::fs::create_dir(&target).unwrap();
        let file = source.join("f");
        std::fs::write(&file, "x").unwrap();
        std::os::unix::fs::chown(&file, Some(200_007), Some(200_007)).unwrap();
        let ns = user_namespace(&[
            Extent {
                inside: 0,
                outside: 0,
                count: 1,
            },
            Extent {
                inside: 200_000,
                outside: 400_000,
                count: 65536,
            },
        ])
        .unwrap();
        idmapped_bind(&source, &target, ns.as_fd()).unwrap();
        let seen = (uid(&target), uid(&target.join("f")));
        rustix::mount::unmount(&target, rustix::mount::UnmountFlags::DETACH).unwrap();
        assert_eq!(seen, (0, 400_007));
    }

    #[test]
    fn bad_maps_are_refused() {
        assert!(user_namespace(&[]).is_err());
        // Overlapping extents are refused by the kernel.
        let overlapping = [Extent::range(100_000, 10), Extent::range(100_005, 10)];
        assert!(user_namespace(&overlapping).is_err());
    }

    #[test]
    fn a_pinned_user_namespace_owns_the_network_namespace_made_in_it() {
        let dir = tempfile::tempdir().unwrap();
        let pinned = dir.path().join("userns");
        let ns = user_namespace(&[Extent::range(500_000, 65536)]).unwrap();
        pin(ns.as_fd(), &pinned).unwrap();
        drop(ns);
        let ns = open_pinned(&pinned).unwrap();
        let name = format!("runbox-idmap-test-{}", std::process::id());
        let netns = crate::netns::create_named_in(&name, ns.as_fd()).unwrap();
        let owned = (|| {
            let net = std::fs::File::open(&netns)?;
            let owner = owner_inode(net.as_fd())?;
            let userns = std::fs::metadata(&pinned)?.ino();
            // Loopback is up in it, as in every run's namespace.
            let listener = crate::netns::bind_in_netns(&netns, "127.0.0.1:0".parse().unwrap())?;
            let port = listener.local_addr()?.port();
            let connected = crate::netns::connect_in_netns(&netns, port).is_ok();
            io::Result::Ok((owner == userns, connected))
        })();
        crate::netns::delete_named(&name).unwrap();
        unpin(&pinned).unwrap();
        unpin(&pinned).unwrap();
        assert_eq!(owned.unwrap(), (true, true));
        assert!(!pinned.exists());
    }

    #[test]
    fn the_probe_passes_here() {
        let dir = tempfile::tempdir().unwrap();
        probe(dir.path()).unwrap();
        // It leaves nothing behind.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
