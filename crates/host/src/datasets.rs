//! Catalog datasets on the host: each image loop-mounted once, at
//! `<runs>/.datasets/<name>`, while any run holds it, and unmounted when
//! the last holder goes (see `runbox_core::datasets` for the rules).
//!
//! The loop device comes from `mount -o loop` (util-linux), which sets it
//! to detach itself when the filesystem is unmounted, so nothing but the
//! mount needs cleaning up.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use runbox_core::datasets::DatasetEntry;
use runbox_core::lane::LaneError;
use ulid::Ulid;

use crate::mounts::is_mount_point;

/// Where dataset images are mounted in the run store.
pub const DATASETS_DIR: &str = ".datasets";

/// The datasets mounted on this host and the runs holding each.
#[derive(Debug)]
pub struct Datasets {
    dir: PathBuf,
    holders: Mutex<HashMap<String, HashSet<Ulid>>>,
}

impl Datasets {
    /// Datasets mounted below `runs/.datasets`.
    pub fn new(runs: &Path) -> Datasets {
        Datasets {
            dir: runs.join(DATASETS_DIR),
            holders: Mutex::new(HashMap::new()),
        }
    }

    fn mount_point(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Holds `entry` for `run`, mounting it first when it is not (`rw`:
    /// read-write, after its marker is on disk). A mount left from before
    /// with no holder is mounted again in the mode asked.
    pub fn hold(&self, entry: &DatasetEntry, rw: bool, run: Ulid) -> Result<PathBuf, LaneError> {
        let mut holders = self.holders.lock().unwrap_or_else(|e| e.into_inner());
        let held = holders.entry(entry.name.clone()).or_default();
        let target = self.mount_point(&entry.name);
        if is_mount_point(&target) && held.is_empty() && read_only(&target) == Some(rw) {
            // Mounted in the other mode by a daemon that died: no run
            // uses it, so it is released first.
            self.unmount(entry, &target)?;
        }
        if !is_mount_point(&target) {
            if !entry.path.is_file() {
                return Err(LaneError::Failed(format!(
                    "dataset {:?} has no image on this server",
                    entry.name
                )));
            }
            std::fs::DirBuilder::new()
                .recursive(true)
                .create(&target)
                .map_err(LaneError::io(format!("creating {}", target.display())))?;
            if rw {
                write_marker(&entry.marker()).map_err(LaneError::io(format!(
                    "writing the dirty marker of dataset {:?}",
                    entry.name
                )))?;
            }
            mount(&entry.path, &target, rw).map_err(|e| {
                LaneError::Failed(format!("mounting dataset {:?}: {e}", entry.name))
            })?;
            tracing::info!(dataset = %entry.name, rw, "dataset mounted");
        }
        held.insert(run);
        Ok(target)
    }

    /// `run` holds `entry` no longer; the last holder's going unmounts it,
    /// and a clean unmount of a read-write mount removes the marker.
    pub fn release(&self, entry: &DatasetEntry, run: Ulid) {
        let mut holders = self.holders.lock().unwrap_or_else(|e| e.into_inner());
        let Some(held) = holders.get_mut(&entry.name) else {
            return;
        };
        held.remove(&run);
        if !held.is_empty() {
            return;
        }
        holders.remove(&entry.name);
        let target = self.mount_point(&entry.name);
        if let Err(e) = self.unmount(entry, &target) {
            tracing::warn!(dataset = %entry.name, error = %e, "could not release a dataset cleanly; its marker stays");
        }
    }

    /// Unmounts what is mounted here that no run holds (`held`).
    pub fn sweep(&self, catalog: &[DatasetEntry], held: &HashSet<String>) {
        let Ok(dir) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for name in dir
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
        {
            if held.contains(&name) {
                continue;
            }
            let target = self.mount_point(&name);
            if !is_mount_point(&target) {
                let _ = std::fs::remove_dir(&target);
                continue;
            }
            match catalog.iter().find(|d| d.name == name) {
                Some(entry) => {
                    if let Err(e) = self.unmount(entry, &target) {
                        tracing::warn!(dataset = %name, error = %e, "could not unmount a dataset no run holds");
                    }
                }
                // Not in the catalog any more: unmount, and leave any
                // marker where it is (its image is not known here).
                None => {
                    if let Err(e) = unmount(&target) {
                        tracing::warn!(dataset = %name, error = %e, "could not unmount a dataset the catalog no longer lists");
                    }
                }
            }
        }
    }

    /// Unmounts `target` (not lazily: a busy mount stays and says so);
    /// a read-write mount released this way is clean, so its marker goes.
    fn unmount(&self, entry: &DatasetEntry, target: &Path) -> Result<(), LaneError> {
        if !is_mount_point(target) {
            return Ok(());
        }
        let was_rw = read_only(target) == Some(false);
        unmount(target).map_err(LaneError::io(format!(
            "unmounting dataset {:?}",
            entry.name
        )))?;
        let _ = std::fs::remove_dir(target);
        if was_rw {
            remove_marker(&entry.marker()).map_err(LaneError::io(format!(
                "removing the dirty marker of dataset {:?}",
                entry.name
            )))?;
        }
        tracing::info!(dataset = %entry.name, "dataset released");
        Ok(())
    }
}

/// Whether the filesystem at `path` is mounted read-only.
fn read_only(path: &Path) -> Option<bool> {
    rustix::fs::statvfs(path)
        .ok()
        .map(|s| s.f_flag.contains(rustix::fs::StatVfsMountFlags::RDONLY))
}

/// `mount -o loop,ro|rw,nodev,nosuid IMAGE TARGET`: the filesystem type is
/// detected (ext4 or XFS, or anything the kernel mounts).
fn mount(image: &Path, target: &Path, rw: bool) -> Result<(), String> {
    let options = format!("loop,{},nodev,nosuid", if rw { "rw" } else { "ro" });
    let out = std::process::Command::new("mount")
        .arg("-o")
        .arg(&options)
        .arg(image)
        .arg(target)
        .output()
        .map_err(|e| format!("running mount: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_owned())
    }
}

fn unmount(target: &Path) -> std::io::Result<()> {
    rustix::mount::unmount(target, rustix::mount::UnmountFlags::empty()).map_err(Into::into)
}
/// Writes `marker` durably (the file and its directory entry synced).
pub fn write_marker(marker: &Path) -> std::io::Result<()> {
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(marker)?;
    std::io::Write::write_all(
        &mut file,
        b"a read-write mount of this image has not been released cleanly\n",
    )?;
    file.sync_all()?;
    sync_parent(marker)
}

/// Removes `marker` durably; nothing to do when it is gone.
pub fn remove_marker(marker: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(marker) {
        Ok(()) => sync_parent(marker),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

fn sync_parent(path: &Path) -> std::io::Result<()> {
    match path.parent() {
        Some(dir) => std::fs::File::open(dir)?.sync_all(),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_come_and_go() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("d.img"), b"x").unwrap();
        let e = DatasetEntry {
            name: "d".into(),
            path: dir.path().join("d.img"),
            writable: true,
            tenants: vec![],
        };
        assert!(e.state(false).available);
        write_marker(&e.marker()).unwrap();
        assert_eq!(e.state(false).unavailable.as_deref(), Some("dirty"));
        assert!(e.state(true).available, "a rw mount is how it heals");
        remove_marker(&e.marker()).unwrap();
        remove_marker(&e.marker()).unwrap();
        assert!(e.state(false).available);
        std::fs::remove_file(&e.path).unwrap();
        assert_eq!(e.state(true).unavailable.as_deref(), Some("missing"));
    }
}
