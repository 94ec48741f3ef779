//! Doing things inside a run's network namespace from the daemon.
//!
//! Owns one technique: a short-lived thread that joins a network namespace
//! with `setns(CLONE_NEWNET)`, does its work there, and exits. Network
//! namespaces are per thread, so the daemon's other threads (and the tokio
//! workers) never change namespace, and a socket created by that thread stays
//! in the namespace it was created in after the thread is gone.
//!
//! It does not create or delete namespaces; [`crate::oci`] does, with `ip netns`.

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::AsFd;
use std::path::Path;

use rustix::net::{AddressFamily, SocketFlags, SocketType};
use rustix::thread::LinkNameSpaceType;

pub use runbox_core::backend::{EGRESS_PROXY_ADDR, EGRESS_PROXY_URL};

/// Pending connections the kernel queues on a listener made here.
const BACKLOG: i32 = 1024;

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
