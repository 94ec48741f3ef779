//! A run's network namespace, made and used from the daemon itself.
//!
//! Owns one technique: a short-lived thread that enters a network namespace
//! (a new one with `unshare(CLONE_NEWNET)`, or an existing one with
//! `setns`), does its work there, and exits. Network namespaces are per
//! thread, so the daemon's other threads (and the tokio workers) never change
//! namespace, and a socket created by that thread stays in the namespace it
//! was created in after the thread is gone.
//!
//! Named namespaces follow iproute2's convention, so `ip netns`, `ip -n` and
//! the OCI lane's open-tier setup (`runbox_runtime::open_net`) see them: a bind mount of the
//! namespace on `/run/netns/<name>`, with `/run/netns` itself a shared
//! mount. Creating and deleting one costs a few system calls and no process
//! (`ip netns add` plus `ip link set lo up` were two processes per create,
//! `ip netns delete` one per delete).

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::AsFd;
use std::path::Path;

use rustix::net::{AddressFamily, SocketFlags, SocketType};
use rustix::thread::LinkNameSpaceType;

pub use runbox_core::lane::{EGRESS_PROXY_ADDR, EGRESS_PROXY_URL};

/// Pending connections the kernel queues on a listener made here.
const BACKLOG: i32 = 1024;

/// Where named network namespaces are mounted (iproute2's `NETNS_RUN_DIR`).
pub const NETNS_DIR: &str = "/run/netns";

/// Creates the network namespace `name` with its loopback up, mounted at
/// `/run/netns/<name>`, and returns that path. Fails if it exists already;
/// on error nothing is left behind.
pub fn create_named(name: &str) -> io::Result<std::path::PathBuf> {
    let path = mount_point(name)?;
    let made = std::thread::scope(|scope| {
        scope
            .spawn(|| -> io::Result<()> {
                // SAFETY: only CLONE_NEWNET is unshared, which changes this
                // thread's network namespace and nothing that other threads
                // share (no file table, no filesystem context); the thread
                // ends right after, taking the namespace change with it.
                unsafe { rustix::thread::unshare_unsafe(rustix::thread::UnshareFlags::NEWNET) }?;
                loopback_up()?;
                rustix::mount::mount_bind("/proc/thread-self/ns/net", &path)?;
                Ok(())
            })
            .join()
    });
    let result = match made {
        Ok(result) => result,
        Err(panic) => std::panic::resume_unwind(panic),
    };
    if let Err(e) = result {
        let _ = delete_named(name);
        return Err(e);
    }
    Ok(path)
}

/// [`create_named`], but the namespace is owned by user namespace
/// `userns` (a run's), so that the run's runtime, which enters `userns`,
/// may mount `sysfs` for it and the run's root has its (bounded)
/// capabilities there, not in a namespace the host owns.
pub fn create_named_in(
    name: &str,
    userns: std::os::fd::BorrowedFd<'_>,
) -> io::Result<std::path::PathBuf> {
    let path = mount_point(name)?;
    let made = (|| -> io::Result<()> {
        // A process, not a thread: a multithreaded process cannot enter a
        // user namespace.
        let holder = crate::idmap::Holder::spawn(Some(userns), libc::CLONE_NEWNET)?;
        rustix::mount::mount_bind(holder.proc("ns/net").as_path(), &path)?;
        drop(holder);
        in_netns(&path, loopback_up)?
    })();
    if let Err(e) = made {
        let _ = delete_named(name);
        return Err(e);
    }
    Ok(path)
}

/// The mount point of namespace `name` under [`NETNS_DIR`]: an empty file,
/// made exclusively so two creates of one name cannot both succeed.
fn mount_point(name: &str) -> io::Result<std::path::PathBuf> {
    if name.is_empty() || name.contains('/') || name.starts_with('.') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "bad namespace name",
        ));
    }
    let dir = Path::new(NETNS_DIR);
    std::fs::create_dir_all(dir)?;
    share_netns_dir(dir)?;
    let path = dir.join(name);
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)?;
    Ok(path)
}

/// Deletes the named network namespace: detaches its mount and removes the
/// mount point. The namespace itself goes when its last user (the run's
/// processes, a socket) lets go. Succeeds when there is nothing to delete.
pub fn delete_named(name: &str) -> io::Result<()> {
    let path = Path::new(NETNS_DIR).join(name);
    match rustix::mount::unmount(&path, rustix::mount::UnmountFlags::DETACH) {
        // EINVAL: not a mount point (a create that failed half-way).
        Ok(()) | Err(rustix::io::Errno::INVAL) | Err(rustix::io::Errno::NOENT) => {}
        Err(e) => return Err(e.into()),
    }
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Makes `/run/netns` a shared mount (binding it onto itself first if it is
/// not a mount point), as iproute2 does, so a namespace mounted there is
/// seen from every mount namespace that shares it.
fn share_netns_dir(dir: &Path) -> io::Result<()> {
    use rustix::mount::{mount_bind_recursive, mount_change, MountPropagationFlags};
    let shared = MountPropagationFlags::SHARED | MountPropagationFlags::REC;
    match mount_change(dir, shared) {
        Ok(()) => Ok(()),
        Err(rustix::io::Errno::INVAL) => {
            mount_bind_recursive(dir, dir)?;
            Ok(mount_change(dir, shared)?)
        }
        Err(e) => Err(e.into()),
    }
}

/// Sets `IFF_UP` on `lo` in the calling thread's network namespace.
///
/// Two ioctls by hand: a netlink crate would bring an async stack and a
/// message builder for one flag on one interface.
fn loopback_up() -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let sock = rustix::net::socket_with(
        AddressFamily::INET,
        SocketType::DGRAM,
        SocketFlags::CLOEXEC,
        None,
    )?;
    // SAFETY: ifreq is plain old data; all zeroes is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS reads the name and writes the flags of `req`, a
    // valid ifreq that lives across the call, on an open socket.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: SIOCGIFFLAGS filled the flags member of the union.
    unsafe { req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short };
    // SAFETY: as above; SIOCSIFFLAGS only reads `req`.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Runs `f` on a fresh thread that has joined the network namespace at
/// `netns` (a file such as `/run/netns/runbox-<id>`), and returns what `f`
/// returned. Sockets `f` creates belong to that namespace for good.
///
/// Errors when `netns` cannot be opened or is not a network namespace. A
/// panic in `f` is resumed on the caller's thread.
pub fn in_netns<T, F>(netns: &Path, f: F) -> io::Result<T>
where
    F: FnOnce() -> T + Send,
    T: Send,
{
    let ns = std::fs::File::open(netns)?;
    let joined = std::thread::scope(|scope| {
        // A fresh thread rather than a pooled one: it leaves with the
        // namespace it joined, so no later work can run there by accident.
        scope
            .spawn(|| {
                // `Some(Network)` makes the kernel refuse any other kind of
                // namespace file (EINVAL) instead of joining it.
                rustix::thread::move_into_link_name_space(
                    ns.as_fd(),
                    Some(LinkNameSpaceType::Network),
                )?;
                Ok(f())
            })
            .join()
    });
    match joined {
        Ok(result) => result,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

/// A listening TCP socket bound to `addr` inside the network namespace at
/// `netns`: `SO_REUSEADDR` (a daemon restarting re-binds the port while the
/// old socket's connections linger), non-blocking (ready for
/// `tokio::net::TcpListener::from_std`), close-on-exec.
pub fn bind_in_netns(netns: &Path, addr: SocketAddr) -> io::Result<TcpListener> {
    in_netns(netns, || listen(addr))?
}

/// How long a connection into a run may take to be accepted. Loopback
/// answers at once; only a listener whose queue is full makes it wait.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// A TCP connection to `port` on the loopback of the network namespace at
/// `netns` (127.0.0.1, else ::1 when nothing listens on IPv4).
pub fn connect_in_netns(netns: &Path, port: u16) -> io::Result<std::net::TcpStream> {
    in_netns(netns, || {
        let v4 = SocketAddr::from(([127, 0, 0, 1], port));
        match std::net::TcpStream::connect_timeout(&v4, CONNECT_TIMEOUT) {
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                let v6 = SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, port));
                // The IPv4 refusal is the more useful error when both fail.
                std::net::TcpStream::connect_timeout(&v6, CONNECT_TIMEOUT).map_err(|_| e)
            }
            other => other,
        }
        .and_then(|stream| {
            // Small writes (keystrokes, short responses) leave at once.
            stream.set_nodelay(true)?;
            Ok(stream)
        })
    })?
}

fn listen(addr: SocketAddr) -> io::Result<TcpListener> {
    let family = match addr {
        SocketAddr::V4(_) => AddressFamily::INET,
        SocketAddr::V6(_) => AddressFamily::INET6,
    };
    let fd = rustix::net::socket_with(
        family,
        SocketType::STREAM,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )?;
    rustix::net::sockopt::set_socket_reuseaddr(&fd, true)?;
    rustix::net::bind(&fd, &addr)?;
    rustix::net::listen(&fd, BACKLOG)?;
    Ok(TcpListener::from(fd))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proxy_url_matches_the_address() {
        assert_eq!(EGRESS_PROXY_URL, format!("http://{EGRESS_PROXY_ADDR}"));
    }

    #[test]
    fn own_namespace_listener_is_nonblocking_and_reusable() {
        // Joining our own namespace needs CAP_SYS_ADMIN; without it only the
        // plain listener is checked.
        let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let listener = match bind_in_netns(Path::new("/proc/self/ns/net"), addr) {
            Ok(l) => l,
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => listen(addr).unwrap(),
            Err(e) => panic!("binding in our own namespace: {e}"),
        };
        assert!(rustix::net::sockopt::socket_reuseaddr(&listener).unwrap());
        assert_eq!(
            listener.accept().unwrap_err().kind(),
            io::ErrorKind::WouldBlock
        );
        let port = listener.local_addr().unwrap().port();
        std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    }

    #[test]
    fn a_named_namespace_has_loopback_up_and_deletes_cleanly() {
        let name = format!("runbox-unit-{}", std::process::id());
        let path = match create_named(&name) {
            Ok(path) => path,
            // Creating namespaces needs root; without it only the refusal
            // of bad names is checked.
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
                assert!(create_named("../escape").is_err());
                return;
            }
            Err(e) => panic!("creating {name}: {e}"),
        };
        // A second create of the same name fails and leaves the first alone.
        assert!(create_named(&name).is_err());
        // Loopback is up inside: a listener there accepts a connection.
        let reached = in_netns(&path, || {
            let listener = listen("127.0.0.1:0".parse().unwrap()).unwrap();
            let port = listener.local_addr().unwrap().port();
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        })
        .unwrap();
        assert!(reached, "loopback is not up in the new namespace");
        // And it is not ours: our namespace and its differ.
        let ours = std::fs::metadata("/proc/self/ns/net").unwrap();
        let theirs = std::fs::metadata(&path).unwrap();
        use std::os::unix::fs::MetadataExt;
        assert_ne!(ours.ino(), theirs.ino());
        delete_named(&name).unwrap();
        assert!(!path.exists());
        delete_named(&name).unwrap();
        for bad in ["", "a/b", "..", ".hidden"] {
            assert_eq!(
                create_named(bad).unwrap_err().kind(),
                io::ErrorKind::InvalidInput
            );
        }
    }

    #[test]
    fn a_file_that_is_not_a_namespace_is_refused() {
        let err = in_netns(Path::new("/proc/self/ns/uts"), || ()).unwrap_err();
        // EINVAL for the wrong namespace type; EPERM without CAP_SYS_ADMIN.
        assert!(
            matches!(err.raw_os_error(), Some(libc::EINVAL) | Some(libc::EPERM)),
            "{err}"
        );
        assert!(in_netns(Path::new("/nonexistent/netns"), || ()).is_err());
    }
}
