//! Child reaping: the one place that calls `waitpid`.
//!
//! As PID 1 of the run (or a child subreaper in tests) the agent inherits
//! every orphaned process, and must reap them all or the run fills up with
//! zombies. One task does it: on each `SIGCHLD` it drains `waitpid(-1,
//! WNOHANG)` and hands the status of each command it started to whoever
//! waits for it; orphans' statuses are simply discarded.
//!
//! Because reaping is global, nothing else may wait for a child: neither
//! `tokio::process` nor `std::process::Child::wait`. Commands are therefore
//! started through [`Reaper::spawn`], which holds the registry lock across
//! `fork`/`exec` and registration. The reaper takes the same lock before
//! calling `waitpid`, so it can never collect a child before its waiter is
//! registered, nor collect one that `Command::spawn` is itself waiting for
//! after a failed `exec` (std panics if someone else reaped it).
//!
//! This module does not own process groups or signals sent to commands; see
//! `exec`.

use std::collections::HashMap;
use std::io;
use std::process::{Child, Command};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use rustix::io::Errno;
use rustix::process::WaitOptions;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::oneshot;

/// How a command ended, in the terms of the protocol's `ExecExit`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitStatus {
    /// The exit code, or 128 + signal when a signal ended the process.
    pub code: i32,
    /// The terminating signal, 0 when the process exited by itself.
    pub signal: i32,
}

impl ExitStatus {
    /// Decodes a raw `waitpid` status word.
    ///
    /// The 128 + signal convention is the shell's, so `kill -9` reads as 137
    /// here exactly as it does in `$?`.
    pub fn from_raw(raw: i32) -> Self {
        if libc::WIFSIGNALED(raw) {
            let signal = libc::WTERMSIG(raw);
            Self {
                code: 128 + signal,
                signal,
            }
        } else {
            // `waitpid` without WUNTRACED/WCONTINUED only reports
            // terminations, so anything not signalled has exited.
            Self {
                code: libc::WEXITSTATUS(raw),
                signal: 0,
            }
        }
    }
}

/// Registry of started commands waiting for their exit status.
#[derive(Debug, Default)]
pub struct Reaper {
    waiters: Mutex<HashMap<i32, oneshot::Sender<ExitStatus>>>,
}

impl Reaper {
    /// Installs the `SIGCHLD` handler and starts the reaping task on the
    /// current tokio runtime.
    ///
    /// Call it before anything can spawn a child, so that no `SIGCHLD` is
    /// missed; one pass runs right away anyway, for children that ended
    /// before the handler existed.
    pub fn start() -> io::Result<Arc<Self>> {
        let mut sigchld = signal(SignalKind::child())?;
        let reaper = Arc::new(Self::default());
        let task_reaper = Arc::clone(&reaper);
        tokio::spawn(async move {
            loop {
                task_reaper.reap_all();
                // Signals coalesce, so each wake-up drains every zombie.
                if sigchld.recv().await.is_none() {
                    break;
                }
            }
        });
        Ok(reaper)
    }

    /// Spawns `command` and registers it, atomically with respect to
    /// reaping. The returned receiver yields its exit status once.
    ///
    /// Never call `wait` on the returned child; dropping it is fine (std
    /// neither kills nor waits on drop).
    ///
    /// This blocks for the duration of `fork` and `exec`; call it from a
    /// blocking context.
    pub fn spawn(
        &self,
        command: &mut Command,
    ) -> io::Result<(Child, oneshot::Receiver<ExitStatus>)> {
        let mut waiters = self.lock();
        let child = command.spawn()?;
        let (tx, rx) = oneshot::channel();
        // Pids are positive and fit in i32 on Linux (pid_max <= 2^22).
        waiters.insert(child.id() as i32, tx);
        Ok((child, rx))
    }

    /// Collects every child that has ended and notifies the waiters of
    /// those this agent started.
    fn reap_all(&self) {
        let mut waiters = self.lock();
        loop {
            // `wait` is waitpid(-1): any child. (rustix's `waitpid(None)` means
            // pid 0, our own process group, which commands have left.)
            match rustix::process::wait(WaitOptions::NOHANG) {
                Ok(Some((pid, status))) => {
                    if let Some(tx) = waiters.remove(&pid.as_raw_nonzero().get()) {
                        // The waiter may be gone (its call was cancelled);
                        // the child is reaped either way.
                        let _ = tx.send(ExitStatus::from_raw(status.as_raw()));
                    }
                }
                Err(Errno::INTR) => {}
                // Ok(None): children remain but none has ended; ECHILD: no
                // children at all.
                Ok(None) | Err(_) => break,
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<i32, oneshot::Sender<ExitStatus>>> {
        // A panic while holding the lock cannot leave the map inconsistent
        // (each operation is a single insert or remove), so poisoning is
        // not a reason to stop reaping.
        self.waiters.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_are_passed_through() {
        assert_eq!(ExitStatus::from_raw(0), ExitStatus { code: 0, signal: 0 });
        // WEXITSTATUS lives in bits 8..16.
        assert_eq!(
            ExitStatus::from_raw(3 << 8),
            ExitStatus { code: 3, signal: 0 }
        );
        assert_eq!(
            ExitStatus::from_raw(255 << 8),
            ExitStatus {
                code: 255,
                signal: 0
            }
        );
    }

    #[test]
    fn signals_become_128_plus_signal() {
        assert_eq!(
            ExitStatus::from_raw(libc::SIGKILL),
            ExitStatus {
                code: 137,
                signal: 9
            }
        );
        // Bit 7 flags a core dump; it must not change the signal.
        assert_eq!(
            ExitStatus::from_raw(libc::SIGSEGV | 0x80),
            ExitStatus {
                code: 139,
                signal: 11
            }
        );
    }
}
