//! Freezing a run's processes for a consistent capture, through the cgroup
//! freezer the runtime placed the run under (`/runbox/<id>`): cgroup v1's
//! `freezer.state`, or v2's `cgroup.freeze`. A frozen task stops where it is
//! (in user space or in a system call) and carries on after the thaw, so a
//! command in flight only pauses.
//!
//! The cgroup files are written directly: `runc pause` / `crun pause` do the
//! same writes, at the cost of a process each, on the run's critical path.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use runbox_core::lane::LaneError;
use ulid::Ulid;

/// How long the kernel gets to freeze every task of a run.
const FREEZE_TIMEOUT: Duration = Duration::from_secs(5);

/// A run's freezer.
pub struct Freezer {
    kind: Kind,
}

enum Kind {
    /// `freezer.state` of the v1 freezer hierarchy.
    V1(PathBuf),
    /// The v2 group's directory (`cgroup.freeze`, `cgroup.events`).
    V2(PathBuf),
}

impl Freezer {
    /// The freezer of run `id`, which must exist.
    pub fn of(id: Ulid) -> Result<Freezer, LaneError> {
        let v1 = PathBuf::from(format!("/sys/fs/cgroup/freezer/runbox/{id}/freezer.state"));
        if v1.exists() {
            return Ok(Freezer { kind: Kind::V1(v1) });
        }
        let v2 = PathBuf::from(format!("/sys/fs/cgroup/runbox/{id}"));
        if v2.join("cgroup.freeze").exists() {
            return Ok(Freezer { kind: Kind::V2(v2) });
        }
        Err(LaneError::Failed(format!(
            "run {id} has no cgroup freezer (neither {} nor {})",
            v1.display(),
            v2.join("cgroup.freeze").display()
        )))
    }

    /// Freezes every task and waits until the kernel says they all are.
    pub async fn freeze(&self) -> Result<(), LaneError> {
        match &self.kind {
            Kind::V1(state) => write(state, "FROZEN")?,
            Kind::V2(dir) => write(&dir.join("cgroup.freeze"), "1")?,
        }
        let deadline = Instant::now() + FREEZE_TIMEOUT;
        let mut pause = Duration::from_micros(100);
        loop {
            if self.frozen()? {
                return Ok(());
            }
            if Instant::now() > deadline {
                let _ = self.thaw();
                return Err(LaneError::Failed(format!(
                    "the run's tasks did not freeze within {FREEZE_TIMEOUT:?}"
                )));
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(10));
        }
    }

    /// Whether every task is frozen now.
    pub fn frozen(&self) -> Result<bool, LaneError> {
        match &self.kind {
            Kind::V1(state) => Ok(read(state)?.trim() == "FROZEN"),
            Kind::V2(dir) => Ok(read(&dir.join("cgroup.events"))?
                .lines()
                .any(|l| l.trim() == "frozen 1")),
        }
    }

    /// Lets the tasks run again.
    pub fn thaw(&self) -> Result<(), LaneError> {
        match &self.kind {
            Kind::V1(state) => write(state, "THAWED"),
            Kind::V2(dir) => write(&dir.join("cgroup.freeze"), "0"),
        }
    }
}

fn write(path: &std::path::Path, value: &str) -> Result<(), LaneError> {
    std::fs::write(path, value).map_err(LaneError::io(format!("writing {}", path.display())))
}

fn read(path: &std::path::Path) -> Result<String, LaneError> {
    std::fs::read_to_string(path).map_err(LaneError::io(format!("reading {}", path.display())))
}
