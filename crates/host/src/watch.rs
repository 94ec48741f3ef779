//! Noticing that a run's sandbox died: a pidfd on the container's init.
//!
//! The runtime writes the init's host pid to `<run-dir>/init.pid` when it
//! starts the container (`--pid-file`). A pidfd (`pidfd_open(2)`) on that
//! pid becomes readable when the process exits, whoever its parent is, so
//! the daemon learns of the death at once without polling and without
//! spawning anything. The pidfd refers to the process itself, not to the
//! number, so a recycled pid can never fire it; the one check needed is at
//! open time (after a restart the number may already belong to another
//! process), which [`open`] makes by reading the process's cgroup.

use std::io;
use std::os::fd::OwnedFd;
use std::path::Path;

use rustix::process::{pidfd_open, Pid, PidfdFlags};
use tokio::io::unix::AsyncFd;
use ulid::Ulid;

/// The file the runtime writes the init's pid to, in the run directory.
pub const PID_FILE: &str = "init.pid";

/// An open watch on run `id`'s init.
pub struct InitWatch {
    fd: AsyncFd<OwnedFd>,
    pid: i32,
    id: Ulid,
}

/// Opens a watch on the init whose pid is in `run_dir/init.pid`, after
/// checking that the process is in run `id`'s cgroup (`/runbox/<id>`).
pub fn open(run_dir: &Path, id: Ulid) -> io::Result<InitWatch> {
    let text = std::fs::read_to_string(run_dir.join(PID_FILE))?;
    let pid: i32 = text
        .trim()
        .parse()
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "init.pid is not a pid"))?;
    let raw = Pid::from_raw(pid)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "init.pid is not a pid"))?;
    let fd = pidfd_open(raw, PidfdFlags::NONBLOCK)?;
    // Checked after opening: if the pid was someone else's then, the pidfd
    // is theirs and is refused here; if it is the init now, it stays so.
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    let ours = format!("/runbox/{id}");
    if !cgroups.lines().any(|l| l.ends_with(&ours)) {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("pid {pid} is not the init of run {id}"),
        ));
    }
    // SAFETY: `fd` is an OwnedFd moved into the AsyncFd, so it stays open
    // and names the same pidfd until the AsyncFd drops it.
    let fd = unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }
        .map_err(|e| io::Error::other(e.to_string()))?;
    Ok(InitWatch { fd, pid, id })
}

impl InitWatch {
    /// Sends SIGKILL to the init (and so, as PID 1 of its pid namespace, to
    /// every process of the run) and waits up to `limit` for it to be gone.
    /// Returns whether it is. Through the pidfd, so the signal can only
    /// reach that process, never a later holder of its pid.
    pub async fn kill(&self, limit: std::time::Duration) -> bool {
        if rustix::process::pidfd_send_signal(self.fd.get_ref(), rustix::process::Signal::KILL)
            .is_err()
        {
            // ESRCH: already exited. Anything else: let the runtime try.
            return false;
        }
        tokio::time::timeout(limit, self.fd.readable())
            .await
            .is_ok()
    }

    /// Sends SIGKILL to the init, as [`InitWatch::kill`], and returns once
    /// it is gone (an init that exited already is); an error when the
    /// signal could not be sent or the init outlived `limit`.
    pub async fn end(&self, limit: std::time::Duration) -> io::Result<()> {
        match rustix::process::pidfd_send_signal(self.fd.get_ref(), rustix::process::Signal::KILL) {
            Ok(()) => {}
            Err(rustix::io::Errno::SRCH) => return Ok(()),
            Err(e) => return Err(e.into()),
        }
        match tokio::time::timeout(limit, self.fd.readable()).await {
            Ok(ready) => ready.map(drop),
            Err(_) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("pid {} was still alive {limit:?} after SIGKILL", self.pid),
            )),
        }
    }

    /// Waits for the init to exit, then says what is known about why.
    pub async fn exited(self) -> String {
        // Readable means exited; an error from the reactor means the fd is
        // unusable, which is treated the same (the run cannot be trusted).
        let _ = self.fd.readable().await;
        let mut why = format!(
            "its init process (runbox-agent, host pid {}) exited; the run's processes are gone",
            self.pid
        );
        if let Some(kills) = oom_kills(self.id).filter(|&n| n > 0) {
            why.push_str(&format!(
                " (the kernel's out-of-memory killer acted {kills} time(s) in the run: raise limits.memoryMb)"
            ));
        }
        why
    }
}

/// How many processes the OOM killer killed in run `id`'s memory cgroup,
/// on cgroup v2 (`memory.events`) or v1 (`memory.oom_control`).
fn oom_kills(id: Ulid) -> Option<u64> {
    let v2 = format!("/sys/fs/cgroup/runbox/{id}/memory.events");
    let v1 = format!("/sys/fs/cgroup/memory/runbox/{id}/memory.oom_control");
    let text = std::fs::read_to_string(v2)
        .or_else(|_| std::fs::read_to_string(v1))
        .ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("oom_kill "))
        .and_then(|n| n.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_or_bad_pid_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        assert!(open(dir.path(), Ulid::new()).is_err());
        std::fs::write(dir.path().join(PID_FILE), "not a pid").unwrap();
        assert_eq!(
            open(dir.path(), Ulid::new()).err().unwrap().kind(),
            io::ErrorKind::InvalidData
        );
    }

    #[tokio::test]
    async fn a_process_outside_the_run_is_not_taken_for_its_init() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(PID_FILE), std::process::id().to_string()).unwrap();
        assert_eq!(
            open(dir.path(), Ulid::new()).err().unwrap().kind(),
            io::ErrorKind::NotFound
        );
    }
}
