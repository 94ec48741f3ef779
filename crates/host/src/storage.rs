//! Where a run's writes go, and how many bytes it may write.
//!
//! Every run's writable layer (the overlay's upper and work directories)
//! lives in `<run dir>/disk/`. What `disk` is depends on the filesystem
//! under `<state-dir>/runs`, detected once at start:
//!
//! ```text
//! btrfs, quotas on      disk/ is a subvolume with a qgroup limit on the bytes
//!                       it references: past it, writes in the run fail with
//!                       EDQUOT ("Disk quota exceeded"). File data and metadata
//!                       (inodes, directory entries) both count, so a run
//!                       making millions of empty files hits the same limit.
//! btrfs, quotas off     disk/ is a subvolume; runs with a limit are refused
//! anything else         disk/ is a plain directory; runs with a limit are
//!                       refused, with what the operator can do about it
//! ```
//!
//! A run is never given a limit it does not get: when the storage cannot
//! enforce one, the create fails and says why ([`RunStorage::limits_unsupported`]).
//!
//! Why btrfs: this kernel has neither XFS nor ext4 quotas, while btrfs
//! qgroups work on any kernel with btrfs, on a partition or on a
//! loop-mounted image. And a subvolume can be snapshotted in constant time,
//! which is what run snapshots and forks need. [`provision_loop`] makes
//! such an image for hosts whose state directory is on another filesystem
//! (`runbox serve --storage-gb N`).
//!
//! The btrfs ioctls used here are called directly: their structures
//! come from `linux-raw-sys`, while the btrfs crates available either link
//! the C library (which has no qgroup limit call) or need libclang at build
//! time.

use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::io::Write as _;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use linux_raw_sys::btrfs as sys;
use runbox_core::lane::LaneError;

/// The name of a run's writable-layer directory inside its run directory.
pub const DISK_DIR: &str = "disk";

/// How the runs directory stores runs' writable layers.
#[derive(Debug)]
pub struct RunStorage {
    kind: Kind,
}

#[derive(Debug)]
enum Kind {
    /// btrfs with quotas: a subvolume per run, its qgroup limited.
    Quota { qgroups: PathBuf },
    /// btrfs without quotas: subvolumes, no limits.
    Subvolumes { why: String },
    /// Plain directories, no limits.
    Plain { why: String },
}

impl RunStorage {
    /// Looks at the filesystem holding `runs` (a directory that exists).
    pub fn detect(runs: &Path) -> RunStorage {
        let kind = match statfs_type(runs) {
            Ok(magic) if magic == u64::from(linux_raw_sys::general::BTRFS_SUPER_MAGIC) => {
                match btrfs_qgroups_dir(runs) {
                    Ok(Some(qgroups)) => Kind::Quota { qgroups },
                    Ok(None) => Kind::Subvolumes {
                        why: format!(
                            "quotas are off on the btrfs holding {}; turn them on with \
                             `btrfs quota enable {}` (or start the daemon with --storage-gb N \
                             to use a store of its own)",
                            runs.display(),
                            runs.display()
                        ),
                    },
                    Err(e) => Kind::Subvolumes {
                        why: format!(
                            "cannot read the btrfs quota state of {}: {e}",
                            runs.display()
                        ),
                    },
                }
            }
            Ok(magic) => Kind::Plain {
                why: format!(
                    "{} is on a {} filesystem, which cannot limit one run's disk use; \
                     start the daemon with --storage-gb N (a btrfs image under the state \
                     directory), put the state directory on btrfs with quotas on, or pass \
                     --no-disk-limits to run without disk limits",
                    runs.display(),
                    fs_name(magic)
                ),
            },
            Err(e) => Kind::Plain {
                why: format!("cannot tell what filesystem holds {}: {e}", runs.display()),
            },
        };
        RunStorage { kind }
    }

    /// Why runs cannot get a disk limit here, if they cannot.
    pub fn limits_unsupported(&self) -> Option<&str> {
        match &self.kind {
            Kind::Quota { .. } => None,
            Kind::Subvolumes { why } | Kind::Plain { why } => Some(why),
        }
    }

    /// Why captures cannot be taken (or kept as layers) here, if they
    /// cannot: they need subvolume snapshots.
    pub fn snapshots_unsupported(&self) -> Option<&str> {
        match &self.kind {
            Kind::Quota { .. } | Kind::Subvolumes { .. } => None,
            Kind::Plain { why } => Some(why),
        }
    }

    /// One line for the daemon's start-up log.
    pub fn describe(&self) -> &'static str {
        match self.kind {
            Kind::Quota { .. } => "btrfs subvolume per run, qgroup-limited",
            Kind::Subvolumes { .. } => "btrfs subvolume per run, no limits (quotas off)",
            Kind::Plain { .. } => "plain directories, no limits",
        }
    }

    /// Makes `<run_dir>/disk`, limited to `limit` bytes when given, and
    /// returns its path. Refuses a limit it cannot enforce.
    pub fn create(&self, run_dir: &Path, limit: Option<u64>) -> Result<PathBuf, LaneError> {
        let disk = run_dir.join(DISK_DIR);
        match (&self.kind, limit) {
            (Kind::Subvolumes { why } | Kind::Plain { why }, Some(_)) => {
                Err(LaneError::Unsupported(why.clone()))
            }
            (Kind::Plain { .. }, None) => {
                std::fs::DirBuilder::new()
                    .mode(0o700)
                    .create(&disk)
                    .map_err(LaneError::io(format!("creating {}", disk.display())))?;
                Ok(disk)
            }
            (Kind::Quota { .. } | Kind::Subvolumes { .. }, limit) => {
                let parent = open_dir(run_dir)
                    .map_err(LaneError::io(format!("opening {}", run_dir.display())))?;
                create_subvolume(&parent, OsStr::new(DISK_DIR)).map_err(LaneError::io(format!(
                    "creating the btrfs subvolume {}",
                    disk.display()
                )))?;
                if let Some(bytes) = limit {
                    let limited = open_dir(&disk).and_then(|sub| limit_subvolume(&sub, bytes));
                    if let Err(e) = limited {
                        let _ = destroy_subvolume(&parent, OsStr::new(DISK_DIR));
                        return Err(LaneError::io(format!(
                            "limiting {} to {bytes} bytes",
                            disk.display()
                        ))(e));
                    }
                }
                Ok(disk)
            }
        }
    }

    /// Removes `<run_dir>/disk` when it is a subvolume (the caller removes
    /// plain directories with the rest of the run directory). Deleting a
    /// subvolume is one call however much the run wrote; btrfs frees its
    /// blocks in the background.
    pub fn remove(&self, run_dir: &Path) -> Result<(), LaneError> {
        if matches!(self.kind, Kind::Plain { .. }) {
            return Ok(());
        }
        let disk = run_dir.join(DISK_DIR);
        match std::fs::symlink_metadata(&disk) {
            Ok(meta) if meta.is_dir() && is_subvolume_root(&meta) => {}
            Ok(_) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(LaneError::io(format!("reading {}", disk.display()))(e)),
        }
        let parent =
            open_dir(run_dir).map_err(LaneError::io(format!("opening {}", run_dir.display())))?;
        destroy_subvolume(&parent, OsStr::new(DISK_DIR)).map_err(LaneError::io(format!(
            "deleting the btrfs subvolume {}",
            disk.display()
        )))
    }

    /// Bytes `<run_dir>/disk` holds, as the quota counts them (updated when
    /// btrfs commits, at most 30 s late); None where nothing counts them.
    pub fn used_bytes(&self, run_dir: &Path) -> Option<u64> {
        self.subvolume_used(&run_dir.join(DISK_DIR))
    }

    /// Bytes the subvolume at `path` holds, as its qgroup counts them.
    fn subvolume_used(&self, path: &Path) -> Option<u64> {
        let Kind::Quota { qgroups } = &self.kind else {
            return None;
        };
        let sub = open_dir(path).ok()?;
        let id = subvolume_id(&sub).ok()?;
        let text = std::fs::read_to_string(qgroups.join(format!("0_{id}/referenced"))).ok()?;
        text.trim().parse().ok()
    }
}

/// Where frozen copies of runs' disks are made, inside the run store (one
/// filesystem, so a copy is a snapshot), named by a fresh ULID each.
pub const CAPTURES_DIR: &str = ".captures";

/// The warm repo cache's default directory inside the run store (one
/// filesystem with the runs, so a commit clones file data).
pub const WARM_CACHE_DIR: &str = ".warm";

impl RunStorage {
    /// Takes a read-only snapshot of `<run_dir>/disk` into
    /// `<runs>/.captures/<name>` and returns its path. Constant time: the
    /// blocks are shared until either side changes. Needs btrfs.
    pub fn snapshot_disk(
        &self,
        run_dir: &Path,
        runs: &Path,
        name: &str,
    ) -> Result<PathBuf, LaneError> {
        self.snapshot_disk_into(run_dir, &runs.join(CAPTURES_DIR), name)
    }

    /// Keeps `<run_dir>/disk` as history point `point` of run `run`: a
    /// read-only snapshot in `<runs>/.history/<run>/<point>`, sharing every
    /// block with the run until either side changes. Constant time. Needs
    /// btrfs. [`changed_since`] tells whether it differs from the point
    /// before it.
    pub fn point_disk(
        &self,
        run_dir: &Path,
        runs: &Path,
        run: &str,
        point: &str,
    ) -> Result<PathBuf, LaneError> {
        self.snapshot_disk_into(run_dir, &runs.join(HISTORY_DIR).join(run), point)
    }

    /// A read-only snapshot of history point `point` (a directory
    /// [`RunStorage::point_disk`] made) into `<runs>/.captures/<name>`:
    /// what a fork or snapshot of the point reads, so the point can be
    /// dropped meanwhile. Constant time.
    pub fn capture_point(
        &self,
        point: &Path,
        runs: &Path,
        name: &str,
    ) -> Result<PathBuf, LaneError> {
        self.snapshot_into(point, &runs.join(CAPTURES_DIR), name)
    }

    /// A read-only snapshot of `<run_dir>/disk` as `dir/name` (`dir` made
    /// when missing).
    fn snapshot_disk_into(
        &self,
        run_dir: &Path,
        dir: &Path,
        name: &str,
    ) -> Result<PathBuf, LaneError> {
        self.snapshot_into(&run_dir.join(DISK_DIR), dir, name)
    }

    /// A read-only snapshot of subvolume `source` as `dir/name` (`dir`
    /// made when missing).
    fn snapshot_into(&self, source: &Path, dir: &Path, name: &str) -> Result<PathBuf, LaneError> {
        if matches!(self.kind, Kind::Plain { .. }) {
            return Err(LaneError::Unsupported(
                "snapshots need the btrfs run store (start the daemon with --storage-gb N)".into(),
            ));
        }
        std::fs::DirBuilder::new()
            .mode(0o700)
            .recursive(true)
            .create(dir)
            .map_err(LaneError::io(format!("creating {}", dir.display())))?;
        let sub =
            open_dir(source).map_err(LaneError::io(format!("opening {}", source.display())))?;
        let parent = open_dir(dir).map_err(LaneError::io(format!("opening {}", dir.display())))?;
        snapshot_subvolume(&sub, &parent, OsStr::new(name))
            .map_err(LaneError::io(format!("snapshotting {}", source.display())))?;
        Ok(dir.join(name))
    }

    /// Makes `<run_dir>/disk` a writable snapshot of the capture `seed` (a
    /// directory [`RunStorage::snapshot_disk`] made), limited to `limit`
    /// bytes: a fork's disk, sharing every block with the parent's until
    /// either writes. Constant time. The overlay's scratch directory starts
    /// empty.
    pub fn clone_disk(
        &self,
        seed: &Path,
        run_dir: &Path,
        limit: Option<u64>,
    ) -> Result<PathBuf, LaneError> {
        self.clone_disk_as(seed, run_dir, DISK_DIR, limit)
    }

    /// [`RunStorage::clone_disk`] into `<run_dir>/<name>`.
    fn clone_disk_as(
        &self,
        seed: &Path,
        run_dir: &Path,
        name: &str,
        limit: Option<u64>,
    ) -> Result<PathBuf, LaneError> {
        match (&self.kind, limit) {
            (Kind::Plain { why }, _) | (Kind::Subvolumes { why }, Some(_)) => {
                return Err(LaneError::Unsupported(why.clone()))
            }
            _ => {}
        }
        let source =
            open_dir(seed).map_err(LaneError::io(format!("opening {}", seed.display())))?;
        let parent =
            open_dir(run_dir).map_err(LaneError::io(format!("opening {}", run_dir.display())))?;
        let disk = run_dir.join(name);
        snapshot_subvolume_with(&source, &parent, OsStr::new(name), 0).map_err(LaneError::io(
            format!("cloning {} into {}", seed.display(), disk.display()),
        ))?;
        let fresh = (|| {
            if let Some(bytes) = limit {
                limit_subvolume(&open_dir(&disk)?, bytes)?;
            }
            let work = disk.join("ovl-work");
            match std::fs::remove_dir_all(&work) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
            std::fs::create_dir(&work)
        })();
        if let Err(e) = fresh {
            let _ = destroy_subvolume(&parent, OsStr::new(name));
            return Err(LaneError::io(format!("preparing {}", disk.display()))(e));
        }
        Ok(disk)
    }
}

/// Where a disk being put in place by [`RunStorage::replace_disk`] is made.
const NEW_DISK_DIR: &str = "disk.new";

/// Where the disk [`RunStorage::replace_disk`] replaces waits for its
/// removal.
const OLD_DISK_DIR: &str = "disk.old";

impl RunStorage {
    /// Makes `<run_dir>/disk` a writable copy of `seed` (a history point),
    /// with the limit the old disk had, in constant time. Crash-safe: the
    /// copy is made beside the disk and swapped in by two renames; a crash
    /// anywhere leaves either the old disk or the new one, which
    /// [`RunStorage::settle_disk`] (called first here, and by every boot and
    /// removal) sorts out.
    pub fn replace_disk(&self, seed: &Path, run_dir: &Path) -> Result<(), LaneError> {
        self.settle_disk(run_dir)?;
        let disk = run_dir.join(DISK_DIR);
        let limit = self.subvolume_limit(&disk);
        let (new, old) = (run_dir.join(NEW_DISK_DIR), run_dir.join(OLD_DISK_DIR));
        self.clone_disk_as(seed, run_dir, NEW_DISK_DIR, limit)?;
        std::fs::rename(&disk, &old)
            .map_err(LaneError::io(format!("moving {} aside", disk.display())))?;
        std::fs::rename(&new, &disk)
            .map_err(LaneError::io(format!("putting {} in place", new.display())))?;
        self.settle_disk(run_dir)
    }

    /// Finishes a [`RunStorage::replace_disk`] a crash cut short: a new
    /// disk that was whole but not in place yet is put in place; what is
    /// left of the other is removed.
    pub fn settle_disk(&self, run_dir: &Path) -> Result<(), LaneError> {
        let (disk, new) = (run_dir.join(DISK_DIR), run_dir.join(NEW_DISK_DIR));
        if !disk.exists() && new.exists() {
            std::fs::rename(&new, &disk)
                .map_err(LaneError::io(format!("putting {} in place", new.display())))?;
        }
        for name in [NEW_DISK_DIR, OLD_DISK_DIR] {
            let path = run_dir.join(name);
            match std::fs::symlink_metadata(&path) {
                Ok(meta) if meta.is_dir() && is_subvolume_root(&meta) => {
                    let parent = open_dir(run_dir)
                        .map_err(LaneError::io(format!("opening {}", run_dir.display())))?;
                    destroy_subvolume(&parent, OsStr::new(name)).map_err(LaneError::io(
                        format!("deleting the btrfs subvolume {}", path.display()),
                    ))?;
                }
                Ok(_) => std::fs::remove_dir_all(&path)
                    .map_err(LaneError::io(format!("removing {}", path.display())))?,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(LaneError::io(format!("reading {}", path.display()))(e)),
            }
        }
        Ok(())
    }

    /// Whether a snapshot's blocks stay charged to the subvolume that wrote
    /// them (simple quotas): then a run's disk usage counts what its
    /// history points alone still hold.
    pub fn charges_snapshots(&self) -> bool {
        let Kind::Quota { qgroups } = &self.kind else {
            return false;
        };
        std::fs::read_to_string(qgroups.join("mode")).is_ok_and(|m| m.trim() == "squota")
    }

    /// Sets the limit of `<run_dir>/disk` to `bytes`.
    pub fn relimit_disk(&self, run_dir: &Path, bytes: u64) -> Result<(), LaneError> {
        let disk = run_dir.join(DISK_DIR);
        open_dir(&disk)
            .and_then(|sub| limit_subvolume(&sub, bytes))
            .map_err(LaneError::io(format!(
                "limiting {} to {bytes} bytes",
                disk.display()
            )))
    }

    /// The limit on the subvolume at `path`'s qgroup, if it has one.
    fn subvolume_limit(&self, path: &Path) -> Option<u64> {
        let Kind::Quota { qgroups } = &self.kind else {
            return None;
        };
        let id = subvolume_id(&open_dir(path).ok()?).ok()?;
        let text = std::fs::read_to_string(qgroups.join(format!("0_{id}/max_referenced"))).ok()?;
        // "none" when unlimited.
        text.trim().parse().ok()
    }

    /// Bytes only the subvolume at `path` holds (what removing it would
    /// free), as its qgroup counts them; None where nothing counts them.
    pub fn exclusive_bytes(&self, path: &Path) -> Option<u64> {
        let Kind::Quota { qgroups } = &self.kind else {
            return None;
        };
        let id = subvolume_id(&open_dir(path).ok()?).ok()?;
        let text = std::fs::read_to_string(qgroups.join(format!("0_{id}/exclusive"))).ok()?;
        text.trim().parse().ok()
    }
}

/// Where captures kept as image layers live in the run store, one
/// read-only subvolume each, named by the layer's id.
pub const LAYERS_DIR: &str = ".layers";

impl RunStorage {
    /// Keeps capture `capture` (a directory [`RunStorage::snapshot_disk`]
    /// made) as layer `id`: `<runs>/.layers/<id>` becomes a snapshot of it
    /// (constant time), less overlayfs' scratch directory, the warm
    /// volume's layer and the entries `strip` names under `upper`, then
    /// read-only. On error nothing of it is left. Returns its path.
    pub fn keep_capture(
        &self,
        capture: &Path,
        runs: &Path,
        id: &str,
        strip: &[String],
    ) -> Result<PathBuf, LaneError> {
        if let Some(why) = self.snapshots_unsupported() {
            return Err(LaneError::Unsupported(why.to_owned()));
        }
        let layers = runs.join(LAYERS_DIR);
        std::fs::DirBuilder::new()
            .mode(0o700)
            .recursive(true)
            .create(&layers)
            .map_err(LaneError::io(format!("creating {}", layers.display())))?;
        let source =
            open_dir(capture).map_err(LaneError::io(format!("opening {}", capture.display())))?;
        let parent =
            open_dir(&layers).map_err(LaneError::io(format!("opening {}", layers.display())))?;
        snapshot_subvolume_with(&source, &parent, OsStr::new(id), 0).map_err(LaneError::io(
            format!("keeping {} as layer {id}", capture.display()),
        ))?;
        let layer = layers.join(id);
        let prepared = (|| {
            for scratch in ["ovl-work", "warm"] {
                remove_entry(&layer.join(scratch))?;
            }
            let upper = layer.join("upper");
            for path in strip {
                // Lane-made relative paths; never anything that climbs.
                if Path::new(path)
                    .components()
                    .all(|c| matches!(c, std::path::Component::Normal(_)))
                {
                    remove_entry(&upper.join(path))?;
                }
            }
            set_readonly(&open_dir(&layer)?)
        })();
        if let Err(e) = prepared {
            let _ = destroy_subvolume(&parent, OsStr::new(id));
            return Err(LaneError::io(format!("preparing layer {id}"))(e));
        }
        Ok(layer)
    }
}

/// Removes a file or a directory tree; nothing to do when it is not there.
fn remove_entry(path: &Path) -> io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Deletes layer `id` of the run store; nothing to do when it is gone.
pub fn remove_layer(runs: &Path, id: &str) -> Result<(), LaneError> {
    remove_subvolume_in(&runs.join(LAYERS_DIR), id, "layer")
}

/// The ids of the layers in the run store.
pub fn layer_ids(runs: &Path) -> Vec<String> {
    names_in(&runs.join(LAYERS_DIR))
}

/// Where named volumes live in the run store, one subvolume each, named by
/// the volume's id.
pub const VOLUMES_DIR: &str = ".volumes";

impl RunStorage {
    /// Makes volume `id`: `<runs>/.volumes/<id>`, an empty subvolume limited
    /// to `limit` bytes, and returns its path. Needs btrfs with quotas (a
    /// volume without a limit could fill the run store). Its top directory
    /// is writable by every user of the runs that mount it (mode 0777):
    /// runs of different images run as different users, and the volume is
    /// all theirs.
    pub fn create_volume(&self, runs: &Path, id: &str, limit: u64) -> Result<PathBuf, LaneError> {
        self.make_volume(runs, id, limit, |parent| {
            create_subvolume(parent, OsStr::new(id)).map_err(LaneError::io(format!(
                "creating the btrfs subvolume for volume {id}"
            )))?;
            rustix::fs::chmodat(
                parent,
                id,
                rustix::fs::Mode::from_raw_mode(0o777),
                rustix::fs::AtFlags::empty(),
            )
            .map_err(|e| {
                let _ = destroy_subvolume(parent, OsStr::new(id));
                LaneError::io(format!("opening volume {id} to its users"))(e.into())
            })
        })
    }

    /// Makes volume `id` a writable snapshot of volume `from` (constant
    /// time: they share every block until either writes), limited to
    /// `limit` bytes, and returns its path.
    pub fn clone_volume(
        &self,
        runs: &Path,
        from: &str,
        id: &str,
        limit: u64,
    ) -> Result<PathBuf, LaneError> {
        let source = runs.join(VOLUMES_DIR).join(from);
        self.make_volume(runs, id, limit, |parent| {
            let source =
                open_dir(&source).map_err(LaneError::io(format!("opening volume {from}")))?;
            snapshot_subvolume_with(&source, parent, OsStr::new(id), 0)
                .map_err(LaneError::io(format!("cloning volume {from} into {id}")))
        })
    }

    /// Makes subvolume `<runs>/.volumes/<id>` with `make` (given the
    /// directory it goes in) and limits it to `limit` bytes; on error
    /// nothing of it is left.
    fn make_volume(
        &self,
        runs: &Path,
        id: &str,
        limit: u64,
        make: impl FnOnce(&File) -> Result<(), LaneError>,
    ) -> Result<PathBuf, LaneError> {
        if let Some(why) = self.limits_unsupported() {
            return Err(LaneError::Unsupported(why.to_owned()));
        }
        let volumes = runs.join(VOLUMES_DIR);
        std::fs::DirBuilder::new()
            .mode(0o711)
            .recursive(true)
            .create(&volumes)
            .map_err(LaneError::io(format!("creating {}", volumes.display())))?;
        let parent =
            open_dir(&volumes).map_err(LaneError::io(format!("opening {}", volumes.display())))?;
        make(&parent)?;
        let volume = volumes.join(id);
        let limited = open_dir(&volume).and_then(|sub| limit_subvolume(&sub, limit));
        if let Err(e) = limited {
            let _ = destroy_subvolume(&parent, OsStr::new(id));
            return Err(LaneError::io(format!(
                "limiting volume {id} to {limit} bytes"
            ))(e));
        }
        Ok(volume)
    }

    /// Bytes volume `id` holds, as its quota counts them.
    pub fn volume_used(&self, runs: &Path, id: &str) -> Option<u64> {
        self.subvolume_used(&runs.join(VOLUMES_DIR).join(id))
    }
}

/// Deletes volume `id` of the run store and all it holds (one call however
/// much that is); nothing to do when it is gone.
pub fn remove_volume(runs: &Path, id: &str) -> Result<(), LaneError> {
    remove_subvolume_in(&runs.join(VOLUMES_DIR), id, "volume")
}

/// The ids of the volumes in the run store.
pub fn volume_ids(runs: &Path) -> Vec<String> {
    names_in(&runs.join(VOLUMES_DIR))
}

/// Deletes subvolume `dir/id`; nothing to do when it (or `dir`) is gone.
fn remove_subvolume_in(dir: &Path, id: &str, what: &str) -> Result<(), LaneError> {
    let parent = match open_dir(dir) {
        Ok(parent) => parent,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(LaneError::io(format!("opening {}", dir.display()))(e)),
    };
    match destroy_subvolume(&parent, OsStr::new(id)) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(LaneError::io(format!("deleting {what} {id}"))(e)),
    }
}

/// The names of the entries of `dir`, sorted (none when it is missing).
fn names_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.file_name().to_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// Bytes of file data and entries below `dir`, not following links: what a
/// layer holds, found from metadata alone (no file is read).
pub fn tree_size(dir: &Path) -> io::Result<(u64, u64)> {
    let (mut bytes, mut entries) = (0u64, 0u64);
    let mut pending = vec![dir.to_path_buf()];
    while let Some(next) = pending.pop() {
        for entry in std::fs::read_dir(&next)? {
            let entry = entry?;
            let meta = entry.metadata()?;
            entries += 1;
            if meta.is_dir() {
                pending.push(entry.path());
            } else if meta.is_file() {
                bytes += meta.len();
            }
        }
    }
    Ok((bytes, entries))
}

/// Makes the subvolume open at `sub` read-only.
fn set_readonly(sub: &File) -> io::Result<()> {
    let mut flags = u64::from(sys::BTRFS_SUBVOL_RDONLY);
    // SAFETY: SUBVOL_SETFLAGS reads one u64 of flags.
    unsafe {
        ioctl(
            sub,
            linux_raw_sys::ioctl::BTRFS_IOC_SUBVOL_SETFLAGS,
            &mut flags,
        )
    }
}

/// Deletes a snapshot [`RunStorage::snapshot_disk`] made; nothing to do
/// when it is gone.
pub fn remove_capture(runs: &Path, name: &str) -> Result<(), LaneError> {
    remove_subvolume_in(&runs.join(CAPTURES_DIR), name, "capture")
}

/// Where runs' history points are kept in the run store:
/// `.history/<run>/<point>`, read-only snapshots of the run's disk
/// ([`RunStorage::point_disk`]), outside the run's directory so removing
/// that never meets a read-only subvolume.
pub const HISTORY_DIR: &str = ".history";

/// The file beside a point holding what the core says of it (its cause,
/// its summary): `<point>.json`. A point without one is half-made (the
/// daemon died between the snapshot and this file) and is never listed.
fn point_meta_path(runs: &Path, run: &str, point: &str) -> PathBuf {
    runs.join(HISTORY_DIR)
        .join(run)
        .join(format!("{point}.json"))
}

/// [`remove_point`], then waits until btrfs has freed the point's blocks
/// and committed, so the quota counters no longer count them.
pub fn remove_point_and_reclaim(runs: &Path, run: &str, point: &str) -> Result<(), LaneError> {
    let dir = runs.join(HISTORY_DIR).join(run);
    let id = open_dir(&dir.join(point))
        .and_then(|sub| subvolume_id(&sub))
        .ok();
    remove_point(runs, run, point)?;
    let Some(id) = id else { return Ok(()) };
    let parent = open_dir(&dir).map_err(LaneError::io(format!("opening {}", dir.display())))?;
    // BTRFS_IOC_SYNC commits and wakes btrfs' cleaner, which frees a
    // deleted subvolume's blocks (else it waits for the next periodic
    // commit, up to 30 s).
    // SAFETY: BTRFS_IOC_SYNC takes no argument.
    let synced = unsafe {
        libc::ioctl(
            parent.as_raw_fd(),
            linux_raw_sys::ioctl::BTRFS_IOC_SYNC as libc::Ioctl,
        )
    };
    if synced < 0 {
        return Err(LaneError::io("committing the run store")(
            io::Error::last_os_error(),
        ));
    }
    let mut args = sys::btrfs_ioctl_subvol_wait {
        subvolid: id,
        mode: sys::BTRFS_SUBVOL_SYNC_WAIT_FOR_ONE,
        count: 0,
    };
    // Not in linux-raw-sys: _IOW(0x94, 65, struct btrfs_ioctl_subvol_wait),
    // kernel 6.8+. ENOENT: cleaned already. Older kernels (ENOTTY): the
    // counters catch up at a later commit instead.
    const SUBVOL_SYNC_WAIT: u32 = 0x4010_9441;
    // SAFETY: SUBVOL_SYNC_WAIT reads a btrfs_ioctl_subvol_wait.
    match unsafe { ioctl(&parent, SUBVOL_SYNC_WAIT, &mut args) } {
        Ok(()) => {}
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::ENOENT | libc::ENOTTY | libc::EINVAL)
            ) => {}
        Err(e) => return Err(LaneError::io("waiting for a history point's removal")(e)),
    }
    // The freeing committed: the quota counters count it.
    commit(&parent)
}

/// Commits the filesystem holding `dir`.
fn commit(dir: &File) -> Result<(), LaneError> {
    // SAFETY: syncfs on a valid descriptor.
    if unsafe { libc::syncfs(dir.as_raw_fd()) } < 0 {
        return Err(LaneError::io("committing the run store")(
            io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// Deletes point `point` of run `run` and what is said of it; nothing to
/// do when it is gone.
pub fn remove_point(runs: &Path, run: &str, point: &str) -> Result<(), LaneError> {
    remove_subvolume_in(&runs.join(HISTORY_DIR).join(run), point, "history point")?;
    let meta = point_meta_path(runs, run, point);
    match std::fs::remove_file(&meta) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(LaneError::io(format!("removing {}", meta.display()))(e)),
    }
}

/// The points kept for run `run`, by name, sorted (point names are ULIDs,
/// so oldest first), whether or not their description was written.
pub fn point_ids(runs: &Path, run: &str) -> Vec<String> {
    let dir = runs.join(HISTORY_DIR).join(run);
    names_in(&dir)
        .into_iter()
        .filter(|name| !name.contains('.') && dir.join(name).is_dir())
        .collect()
}

/// Writes what is said of point `point` (replacing it whole: a reader sees
/// the old text or the new, never part of one).
pub fn write_point_meta(runs: &Path, run: &str, point: &str, meta: &[u8]) -> io::Result<()> {
    let path = point_meta_path(runs, run, point);
    let partial = path.with_extension("json.partial");
    // Durable before it is renamed into place, and the rename durable
    // before the call returns: after a power loss the description is the
    // old one or the new one, never an empty file.
    let mut file = File::create(&partial)?;
    file.write_all(meta)?;
    file.sync_all()?;
    std::fs::rename(&partial, &path)?;
    File::open(runs.join(HISTORY_DIR).join(run))?.sync_all()
}

/// What is said of point `point`; None for a half-made or missing one.
pub fn point_meta(runs: &Path, run: &str, point: &str) -> Option<Vec<u8>> {
    std::fs::read(point_meta_path(runs, run, point)).ok()
}

/// The file naming the point a run's disk was last returned to, while
/// points after that one are kept (see [`write_history_head`]).
const HEAD_FILE: &str = "head";

/// Records `point` as the one run `run`'s disk was returned to (None: the
/// newest point is, the usual case).
pub fn write_history_head(runs: &Path, run: &str, point: Option<&str>) -> io::Result<()> {
    let dir = runs.join(HISTORY_DIR).join(run);
    let path = dir.join(HEAD_FILE);
    match point {
        Some(point) => {
            std::fs::DirBuilder::new()
                .mode(0o700)
                .recursive(true)
                .create(&dir)?;
            let partial = dir.join("head.partial");
            std::fs::write(&partial, point)?;
            std::fs::rename(&partial, &path)
        }
        None => match std::fs::remove_file(&path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        },
    }
}

/// The point run `run`'s disk was last returned to, if one is recorded.
pub fn history_head(runs: &Path, run: &str) -> Option<String> {
    let text = std::fs::read_to_string(runs.join(HISTORY_DIR).join(run).join(HEAD_FILE)).ok()?;
    Some(text.trim().to_owned())
}

/// The runs that have a history directory.
pub fn history_runs(runs: &Path) -> Vec<String> {
    names_in(&runs.join(HISTORY_DIR))
}

/// Deletes every point of run `run`, then its history directory; nothing
/// to do when it has none.
pub fn remove_history(runs: &Path, run: &str) -> Result<(), LaneError> {
    for point in point_ids(runs, run) {
        remove_point(runs, run, &point)?;
    }
    // What is left is plain files (descriptions, the head).
    let dir = runs.join(HISTORY_DIR).join(run);
    match std::fs::remove_dir_all(&dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(LaneError::io(format!("removing {}", dir.display()))(e)),
    }
}

/// Deletes every capture left in the run store (a daemon that died while
/// capturing); at start-up, before any capture can be in progress.
pub fn remove_all_captures(runs: &Path) {
    let Ok(entries) = std::fs::read_dir(runs.join(CAPTURES_DIR)) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Err(e) = remove_capture(runs, &name) {
            tracing::warn!(error = %e, capture = %name, "could not remove a leftover capture");
        }
    }
}

/// Provisions the daemon's own run store: a btrfs filesystem in the sparse
/// file `image` (`size` bytes, made on first use), loop-mounted at
/// `mount_at`, with quotas on. Idempotent: a store already mounted there is
/// kept as it is. `mount_at` must be empty when it is not mounted yet, so
/// runs of an older layout are never hidden under the mount.
///
/// Spawns `mkfs.btrfs` (first use only) and `mount`; call it off the async
/// threads.
pub fn provision_loop(image: &Path, size: u64, mount_at: &Path) -> Result<(), String> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(mount_at)
        .map_err(|e| format!("creating {}: {e}", mount_at.display()))?;
    if !crate::mounts::is_mount_point(mount_at) {
        let mut entries = std::fs::read_dir(mount_at)
            .map_err(|e| format!("reading {}: {e}", mount_at.display()))?;
        if entries.next().is_some() {
            return Err(format!(
                "{} holds runs made before the daemon had its own store; remove them first \
                 (`runbox serve --teardown`) or start without --storage-gb",
                mount_at.display()
            ));
        }
        if !image.exists() {
            make_image(image, size)?;
        }
        let out = Command::new("mount")
            // No access-time writes: reading a run's files changes
            // nothing on its disk (its history sees only real changes).
            .args(["-t", "btrfs", "-o", "loop,noatime"])
            .arg(image)
            .arg(mount_at)
            .output()
            .map_err(|e| format!("running mount (util-linux): {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "mounting {} at {}: {}",
                image.display(),
                mount_at.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
    }
    match statfs_type(mount_at) {
        Ok(magic) if magic == u64::from(linux_raw_sys::general::BTRFS_SUPER_MAGIC) => {}
        Ok(magic) => {
            return Err(format!(
                "{} is a mounted {} filesystem, not the daemon's btrfs store",
                mount_at.display(),
                fs_name(magic)
            ))
        }
        Err(e) => return Err(format!("checking {}: {e}", mount_at.display())),
    }
    let root = open_dir(mount_at).map_err(|e| format!("opening {}: {e}", mount_at.display()))?;
    if btrfs_qgroups_dir(mount_at)
        .map_err(|e| format!("reading the quota state of {}: {e}", mount_at.display()))?
        .is_none()
    {
        enable_quotas(&root)
            .map_err(|e| format!("enabling quotas on {}: {e}", mount_at.display()))?;
    }
    let have = std::fs::metadata(image).map(|m| m.len()).unwrap_or(0);
    if size > have {
        tracing::warn!(
            image = %image.display(),
            have, asked = size,
            "the run store is smaller than --storage-gb asks; it is not grown automatically"
        );
    }
    Ok(())
}

/// Unmounts the store [`provision_loop`] mounted at `mount_at`, if it is
/// mounted (the loop device goes with it). Lazy, so a process holding a
/// file in it cannot make uninstalling fail.
pub fn release_loop(mount_at: &Path) -> Result<(), String> {
    if !crate::mounts::is_mount_point(mount_at) {
        return Ok(());
    }
    rustix::mount::unmount(mount_at, rustix::mount::UnmountFlags::DETACH)
        .map_err(|e| format!("unmounting {}: {e}", mount_at.display()))
}

/// Writes a new sparse image and formats it, under a temporary name so a
/// crash never leaves a half-made image under the real one.
fn make_image(image: &Path, size: u64) -> Result<(), String> {
    let partial = image.with_extension("partial");
    let _ = std::fs::remove_file(&partial);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&partial)
        .map_err(|e| format!("creating {}: {e}", partial.display()))?;
    file.set_len(size)
        .map_err(|e| format!("sizing {}: {e}", partial.display()))?;
    drop(file);
    let out = Command::new("mkfs.btrfs")
        .args(["-q", "-L", "runbox-runs"])
        .arg(&partial)
        .output()
        .map_err(|e| format!("running mkfs.btrfs (install btrfs-progs): {e}"))?;
    if !out.status.success() {
        let _ = std::fs::remove_file(&partial);
        return Err(format!(
            "mkfs.btrfs {}: {}",
            partial.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    std::fs::rename(&partial, image).map_err(|e| format!("renaming {}: {e}", partial.display()))
}

fn open_dir(path: &Path) -> io::Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

fn statfs_type(path: &Path) -> io::Result<u64> {
    let st = rustix::fs::statfs(path)?;
    // f_type is signed on some targets; the magic numbers are 32-bit.
    Ok(st.f_type as u64 & 0xffff_ffff)
}

fn fs_name(magic: u64) -> String {
    use linux_raw_sys::general as g;
    let known = [
        (g::EXT4_SUPER_MAGIC, "ext4"),
        (g::XFS_SUPER_MAGIC, "XFS"),
        (g::TMPFS_MAGIC, "tmpfs"),
        (g::OVERLAYFS_SUPER_MAGIC, "overlayfs"),
        (g::NFS_SUPER_MAGIC, "NFS"),
    ];
    known
        .iter()
        .find(|(m, _)| u64::from(*m) == magic)
        .map(|(_, n)| (*n).to_owned())
        .unwrap_or_else(|| format!("type {magic:#x}"))
}

/// The top directory of a subvolume has inode 256 (BTRFS_FIRST_FREE_OBJECTID).
fn is_subvolume_root(meta: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    meta.ino() == u64::from(sys::BTRFS_FIRST_FREE_OBJECTID)
}

/// `/sys/fs/btrfs/<fsid>/qgroups` of the btrfs holding `path` when quotas
/// are on there (the kernel shows that directory only then); None when off.
fn btrfs_qgroups_dir(path: &Path) -> io::Result<Option<PathBuf>> {
    let dir = open_dir(path)?;
    // SAFETY: all zeroes is a valid btrfs_ioctl_fs_info_args (plain data).
    let mut args: sys::btrfs_ioctl_fs_info_args = unsafe { std::mem::zeroed() };
    // SAFETY: BTRFS_IOC_FS_INFO fills `args`, which lives across the call,
    // on an open directory of the filesystem.
    unsafe { ioctl(&dir, linux_raw_sys::ioctl::BTRFS_IOC_FS_INFO, &mut args) }?;
    let f = args.fsid;
    let fsid = format!(
        "{:02x}{:02x}{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}",
        f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7], f[8], f[9], f[10], f[11], f[12], f[13], f[14], f[15]
    );
    let qgroups = Path::new("/sys/fs/btrfs").join(fsid).join("qgroups");
    Ok(qgroups.is_dir().then_some(qgroups))
}

/// Turns quotas on: simple quotas where the kernel has them (6.7+; they
/// charge each extent to the subvolume that wrote it, so snapshots cost
/// nothing to account), full qgroups otherwise.
fn enable_quotas(root: &File) -> io::Result<()> {
    for cmd in [
        sys::BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA,
        sys::BTRFS_QUOTA_CTL_ENABLE,
    ] {
        let mut args = sys::btrfs_ioctl_quota_ctl_args {
            cmd: u64::from(cmd),
            status: 0,
        };
        // SAFETY: QUOTA_CTL reads and writes a btrfs_ioctl_quota_ctl_args.
        match unsafe { ioctl(root, linux_raw_sys::ioctl::BTRFS_IOC_QUOTA_CTL, &mut args) } {
            Ok(()) => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(io::Error::other(
        "the kernel refuses to enable btrfs quotas",
    ))
}

fn vol_args(name: &OsStr) -> io::Result<sys::btrfs_ioctl_vol_args> {
    // SAFETY: all zeroes is a valid btrfs_ioctl_vol_args (plain data).
    let mut args: sys::btrfs_ioctl_vol_args = unsafe { std::mem::zeroed() };
    let bytes = name.as_bytes();
    if bytes.is_empty()
        || bytes.len() >= args.name.len()
        || bytes.contains(&0)
        || bytes.contains(&b'/')
    {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "bad subvolume name",
        ));
    }
    for (dst, src) in args.name.iter_mut().zip(bytes) {
        *dst = *src as libc::c_char;
    }
    Ok(args)
}

fn create_subvolume(parent: &File, name: &OsStr) -> io::Result<()> {
    let mut args = vol_args(name)?;
    // SAFETY: SUBVOL_CREATE reads the NUL-terminated name in `args`.
    unsafe {
        ioctl(
            parent,
            linux_raw_sys::ioctl::BTRFS_IOC_SUBVOL_CREATE,
            &mut args,
        )
    }
}

fn destroy_subvolume(parent: &File, name: &OsStr) -> io::Result<()> {
    let mut args = vol_args(name)?;
    // SAFETY: SNAP_DESTROY reads the NUL-terminated name in `args`.
    unsafe {
        ioctl(
            parent,
            linux_raw_sys::ioctl::BTRFS_IOC_SNAP_DESTROY,
            &mut args,
        )
    }
}

/// A read-only snapshot of the subvolume open at `source`, as `name` in
/// the directory open at `parent` (same filesystem).
fn snapshot_subvolume(source: &File, parent: &File, name: &OsStr) -> io::Result<()> {
    snapshot_subvolume_with(source, parent, name, u64::from(sys::BTRFS_SUBVOL_RDONLY))
}

/// A snapshot of the subvolume open at `source` with `flags` (0: writable).
fn snapshot_subvolume_with(
    source: &File,
    parent: &File,
    name: &OsStr,
    flags: u64,
) -> io::Result<()> {
    // SAFETY: all zeroes is a valid btrfs_ioctl_vol_args_v2 (plain data and
    // unions of plain data).
    let mut args: sys::btrfs_ioctl_vol_args_v2 = unsafe { std::mem::zeroed() };
    let bytes = name.as_bytes();
    // SAFETY: `name` is the union member SNAP_CREATE_V2 reads; writing a
    // plain array member of a zeroed union is sound.
    let slot = unsafe { &mut args.__bindgen_anon_2.name };
    if bytes.is_empty() || bytes.len() >= slot.len() || bytes.contains(&0) || bytes.contains(&b'/')
    {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "bad snapshot name",
        ));
    }
    for (dst, src) in slot.iter_mut().zip(bytes) {
        *dst = *src as libc::c_char;
    }
    args.fd = i64::from(source.as_raw_fd());
    args.flags = flags;
    // SAFETY: SNAP_CREATE_V2 reads a btrfs_ioctl_vol_args_v2.
    unsafe {
        ioctl(
            parent,
            linux_raw_sys::ioctl::BTRFS_IOC_SNAP_CREATE_V2,
            &mut args,
        )
    }
}

/// The id of the subvolume `dir` is in (its level-0 qgroup has the same id).
fn subvolume_id(dir: &File) -> io::Result<u64> {
    // SAFETY: all zeroes is a valid btrfs_ioctl_ino_lookup_args (plain data).
    let mut args: sys::btrfs_ioctl_ino_lookup_args = unsafe { std::mem::zeroed() };
    args.objectid = u64::from(sys::BTRFS_FIRST_FREE_OBJECTID);
    // SAFETY: INO_LOOKUP with treeid 0 writes the id of the fd's subvolume
    // into `args.treeid`.
    unsafe { ioctl(dir, linux_raw_sys::ioctl::BTRFS_IOC_INO_LOOKUP, &mut args) }?;
    Ok(args.treeid)
}

fn limit_subvolume(sub: &File, bytes: u64) -> io::Result<()> {
    let mut args = sys::btrfs_ioctl_qgroup_limit_args {
        qgroupid: subvolume_id(sub)?,
        lim: sys::btrfs_qgroup_limit {
            flags: u64::from(sys::BTRFS_QGROUP_LIMIT_MAX_RFER),
            max_rfer: bytes,
            max_excl: 0,
            rsv_rfer: 0,
            rsv_excl: 0,
        },
    };
    // SAFETY: QGROUP_LIMIT reads `args`.
    unsafe { ioctl(sub, linux_raw_sys::ioctl::BTRFS_IOC_QGROUP_LIMIT, &mut args) }
}

/// The transaction subvolume `path` was made in (its `otransid`): for a
/// snapshot, the point after which a change to its source is newer.
pub fn created_transid(path: &Path) -> io::Result<u64> {
    let dir = open_dir(path)?;
    // SAFETY: all zeroes is a valid btrfs_ioctl_get_subvol_info_args
    // (plain data).
    let mut args: sys::btrfs_ioctl_get_subvol_info_args = unsafe { std::mem::zeroed() };
    // SAFETY: GET_SUBVOL_INFO fills `args` for the fd's subvolume.
    unsafe {
        ioctl(
            &dir,
            linux_raw_sys::ioctl::BTRFS_IOC_GET_SUBVOL_INFO,
            &mut args,
        )
    }?;
    Ok(args.otransid)
}

/// Commits the running transaction of the filesystem holding `path`
/// (metadata: file data still in the page cache stays there), so that a
/// [`changed_since`] of a live subvolume sees every inode, name and
/// attribute changed so far: a write shows as its inode's new size or
/// times. Nothing to do, and next to no cost, when nothing is pending.
pub fn commit_metadata(path: &Path) -> io::Result<()> {
    let dir = open_dir(path)?;
    let mut transid: u64 = 0;
    // SAFETY: START_SYNC writes the transid it started into a u64.
    unsafe {
        ioctl(
            &dir,
            linux_raw_sys::ioctl::BTRFS_IOC_START_SYNC,
            &mut transid,
        )
    }?;
    // SAFETY: WAIT_SYNC reads the transid to wait for from a u64.
    unsafe {
        ioctl(
            &dir,
            linux_raw_sys::ioctl::BTRFS_IOC_WAIT_SYNC,
            &mut transid,
        )
    }
}

/// The last transaction that changed subvolume `path`, once everything
/// written to the filesystem so far is committed: a later
/// [`changed_since`] of a snapshot of it against this sees only what was
/// written after this call. Costs a commit of the filesystem (a few ms on
/// an idle one).
pub fn settled_transid(path: &Path) -> io::Result<u64> {
    let dir = open_dir(path)?;
    // SAFETY: syncfs on a valid descriptor.
    if unsafe { libc::syncfs(dir.as_raw_fd()) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: all zeroes is a valid btrfs_ioctl_get_subvol_info_args
    // (plain data).
    let mut args: sys::btrfs_ioctl_get_subvol_info_args = unsafe { std::mem::zeroed() };
    // SAFETY: GET_SUBVOL_INFO fills `args` for the fd's subvolume.
    unsafe {
        ioctl(
            &dir,
            linux_raw_sys::ioctl::BTRFS_IOC_GET_SUBVOL_INFO,
            &mut args,
        )
    }?;
    Ok(args.generation)
}

/// Whether anything in subvolume `path` was changed in a transaction
/// after `transid`: a file's data (an extent's generation), an inode (its
/// contents, size, mode, owner, links or times: the inode item's
/// transid), a name or an extended attribute (a directory or xattr
/// item's transid). Meant for a read-only snapshot (committed, so nothing
/// is pending in memory), against the transid its predecessor was made
/// in ([`created_transid`]): `false` means the two hold the same files.
///
/// Cost: the search skips every tree block older than `transid`, so it
/// reads what changed (and the blocks on the way to it), not the whole
/// tree, and stops at the first change. Reading a file can update its
/// access time, which counts as a change (relatime: at most once a day
/// per file, or when it was modified since).
///
/// Items of the inodes in `ignore` do not count (a directory the storage
/// itself churns, such as overlayfs' scratch directory, and the
/// subvolume's root, whose only entries are those). With `previous` (the
/// predecessor, a snapshot of the same subvolume, so inode numbers
/// match), a newer inode item that equals the predecessor's copy in all
/// but its access time (and bookkeeping) does not count: a file or
/// directory was only read (overlayfs updates the access times of the
/// layer below it whatever the store's mount says). Compared field by
/// field, not by time, so a change in the same clock tick as the
/// predecessor still counts. Without a predecessor, `after` (a time taken
/// before `transid` was committed) does it less exactly: an inode whose
/// change time is earlier only had its access time moved.
pub fn changed_since(
    path: &Path,
    transid: u64,
    ignore: &[u64],
    previous: Option<&Path>,
    after: Option<std::time::SystemTime>,
) -> io::Result<bool> {
    let dir = open_dir(path)?;
    let previous = previous.map(open_dir).transpose()?;
    let after = after.and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
    // Whether an inode item changed more than its access time.
    let inode_moved = |objectid: u64, data: &[u8]| -> io::Result<bool> {
        let Some(previous) = &previous else {
            // Its ctime (a btrfs_timespec at byte 124: seconds, then
            // nanoseconds) against `after`.
            let Some(after) = after else { return Ok(true) };
            let (Some(secs), Some(nanos)) = (data.get(124..132), data.get(132..136)) else {
                return Ok(true);
            };
            let secs = u64::from_le_bytes(secs.try_into().unwrap_or_default());
            let nanos = u32::from_le_bytes(nanos.try_into().unwrap_or_default());
            return Ok(std::time::Duration::new(secs, nanos.min(999_999_999)) >= after);
        };
        let Some(before) = inode_item(previous, objectid)? else {
            return Ok(true);
        };
        // btrfs_inode_item: size, nbytes, block group, nlink, uid, gid,
        // mode, rdev, flags at 16..72; sequence at 72; atime at 112;
        // ctime and mtime at 124..148.
        let same = |range: std::ops::Range<usize>| data.get(range.clone()) == before.get(range);
        Ok(!(same(16..72) && same(124..148)))
    };
    // The item's own transid, where its layout has one.
    let item_transid = |kind: u32, data: &[u8]| -> Option<u64> {
        let at = match kind {
            sys::BTRFS_INODE_ITEM_KEY => 8,
            sys::BTRFS_EXTENT_DATA_KEY => 0,
            sys::BTRFS_DIR_ITEM_KEY | sys::BTRFS_DIR_INDEX_KEY | sys::BTRFS_XATTR_ITEM_KEY => 17,
            _ => return None,
        };
        let bytes = data.get(at..at + 8)?;
        Some(u64::from_le_bytes(bytes.try_into().ok()?))
    };
    // SAFETY: all zeroes is a valid btrfs_ioctl_search_args (plain data).
    let mut args: sys::btrfs_ioctl_search_args = unsafe { std::mem::zeroed() };
    let key = &mut args.key;
    key.tree_id = 0; // the fd's own subvolume
    key.max_objectid = u64::MAX;
    key.max_offset = u64::MAX;
    key.max_type = u32::MAX;
    key.min_transid = transid.saturating_add(1);
    key.max_transid = u64::MAX;
    loop {
        args.key.nr_items = 4096;
        // SAFETY: TREE_SEARCH reads the key and writes at most `buf`'s
        // length of headers and items into `buf`, and the count into
        // `key.nr_items`.
        unsafe { ioctl(&dir, linux_raw_sys::ioctl::BTRFS_IOC_TREE_SEARCH, &mut args) }?;
        let found = args.key.nr_items;
        if found == 0 {
            return Ok(false);
        }
        // SAFETY: `buf` is plain bytes; c_char and u8 have one layout.
        let buf: &[u8] =
            unsafe { std::slice::from_raw_parts(args.buf.as_ptr().cast::<u8>(), args.buf.len()) };
        let header_len = std::mem::size_of::<sys::btrfs_ioctl_search_header>();
        let mut at = 0usize;
        let mut last = (0u64, 0u32, 0u64);
        for _ in 0..found {
            let Some(raw) = buf.get(at..at + header_len) else {
                return Err(io::Error::other(
                    "a tree search answer ended inside a header",
                ));
            };
            let field = |from: usize| {
                u64::from_ne_bytes(raw[from..from + 8].try_into().unwrap_or_default())
            };
            let half = |from: usize| {
                u32::from_ne_bytes(raw[from..from + 4].try_into().unwrap_or_default())
            };
            let (objectid, offset, kind, len) = (field(8), field(16), half(24), half(28) as usize);
            let Some(data) = buf.get(at + header_len..at + header_len + len) else {
                return Err(io::Error::other(
                    "a tree search answer ended inside an item",
                ));
            };
            let newer = !ignore.contains(&objectid)
                && item_transid(kind, data).is_some_and(|t| t > transid)
                && (kind != sys::BTRFS_INODE_ITEM_KEY || inode_moved(objectid, data)?);
            if newer {
                return Ok(true);
            }
            last = (objectid, kind, offset);
            at += header_len + len;
        }
        // Go on after the last item seen.
        let (objectid, kind, offset) = last;
        let key = &mut args.key;
        match offset.checked_add(1) {
            Some(next) => {
                (key.min_objectid, key.min_type, key.min_offset) = (objectid, kind, next);
            }
            None => match kind.checked_add(1) {
                Some(next) => {
                    (key.min_objectid, key.min_type, key.min_offset) = (objectid, next, 0)
                }
                None => match objectid.checked_add(1) {
                    Some(next) => (key.min_objectid, key.min_type, key.min_offset) = (next, 0, 0),
                    None => return Ok(false),
                },
            },
        }
    }
}

/// The inode item of inode `objectid` in the subvolume open at `dir`, if
/// it has one.
fn inode_item(dir: &File, objectid: u64) -> io::Result<Option<Vec<u8>>> {
    // SAFETY: all zeroes is a valid btrfs_ioctl_search_args (plain data).
    let mut args: sys::btrfs_ioctl_search_args = unsafe { std::mem::zeroed() };
    let key = &mut args.key;
    key.tree_id = 0;
    (key.min_objectid, key.max_objectid) = (objectid, objectid);
    (key.min_type, key.max_type) = (sys::BTRFS_INODE_ITEM_KEY, sys::BTRFS_INODE_ITEM_KEY);
    key.max_offset = u64::MAX;
    key.max_transid = u64::MAX;
    key.nr_items = 1;
    // SAFETY: TREE_SEARCH reads the key and writes at most `buf`'s length
    // of headers and items into `buf`, and the count into `key.nr_items`.
    unsafe { ioctl(dir, linux_raw_sys::ioctl::BTRFS_IOC_TREE_SEARCH, &mut args) }?;
    if args.key.nr_items == 0 {
        return Ok(None);
    }
    // SAFETY: `buf` is plain bytes; c_char and u8 have one layout.
    let buf: &[u8] =
        unsafe { std::slice::from_raw_parts(args.buf.as_ptr().cast::<u8>(), args.buf.len()) };
    let header_len = std::mem::size_of::<sys::btrfs_ioctl_search_header>();
    let len = buf
        .get(28..32)
        .map(|b| u32::from_ne_bytes(b.try_into().unwrap_or_default()) as usize)
        .unwrap_or(0);
    Ok(buf.get(header_len..header_len + len).map(<[u8]>::to_vec))
}

/// One btrfs ioctl on `fd`.
///
/// # Safety
/// `T` must be the argument structure `request` is defined with.
unsafe fn ioctl<T>(fd: &File, request: u32, args: &mut T) -> io::Result<()> {
    // SAFETY: `args` is a live, exclusive `T`, the structure `request`
    // reads and writes (the caller's promise).
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), request as libc::Ioctl, args as *mut T) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    /// A loop-mounted store in a temporary directory, unmounted on drop.
    struct Store {
        dir: tempfile::TempDir,
    }

    impl Store {
        fn new() -> Store {
            let dir = tempfile::tempdir().unwrap();
            provision_loop(&dir.path().join("img"), 1 << 30, &dir.path().join("runs")).unwrap();
            Store { dir }
        }
        fn runs(&self) -> PathBuf {
            self.dir.path().join("runs")
        }
    }

    impl Drop for Store {
        fn drop(&mut self) {
            release_loop(&self.runs()).unwrap();
        }
    }

    fn fill(path: &Path, bytes: usize) -> io::Result<()> {
        let mut f = File::create(path)?;
        let chunk = vec![7u8; 1 << 20];
        let mut left = bytes;
        while left > 0 {
            let n = left.min(chunk.len());
            f.write_all(&chunk[..n])?;
            left -= n;
        }
        f.sync_all()
    }

    #[test]
    fn a_limited_disk_refuses_writes_past_its_limit() {
        let store = Store::new();
        let storage = RunStorage::detect(&store.runs());
        assert!(storage.limits_unsupported().is_none(), "{storage:?}");
        let run = store.runs().join("r1");
        std::fs::create_dir(&run).unwrap();
        let disk = storage.create(&run, Some(8 << 20)).unwrap();
        let err = fill(&disk.join("big"), 16 << 20).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EDQUOT), "{err}");
        rustix::fs::sync();
        let used = storage.used_bytes(&run).unwrap();
        assert!(used > 4 << 20 && used <= 8 << 20, "used {used}");
        // A second run is not charged for the first one's bytes.
        let other = store.runs().join("r2");
        std::fs::create_dir(&other).unwrap();
        let disk2 = storage.create(&other, Some(8 << 20)).unwrap();
        fill(&disk2.join("small"), 2 << 20).unwrap();
        storage.remove(&run).unwrap();
        assert!(!disk.exists());
        storage.remove(&other).unwrap();
        // Removing what is gone succeeds.
        storage.remove(&other).unwrap();
    }

    #[test]
    fn a_snapshot_tells_whether_anything_changed_since_the_last() {
        let store = Store::new();
        let storage = RunStorage::detect(&store.runs());
        let run = store.runs().join("r1");
        std::fs::create_dir(&run).unwrap();
        let disk = storage.create(&run, None).unwrap();
        std::fs::write(disk.join("a"), b"one").unwrap();
        std::fs::create_dir(disk.join("d")).unwrap();
        std::fs::write(disk.join("d/b"), vec![1u8; 300 << 10]).unwrap();
        let mut n = 0;
        let mut snap = || {
            n += 1;
            storage
                .snapshot_disk(&run, &store.runs(), &format!("p{n}"))
                .unwrap()
        };
        let mut previous = snap();
        let mut changed = |change: &dyn Fn()| {
            change();
            let next = snap();
            let answer =
                changed_since(&next, created_transid(&previous).unwrap(), &[], None, None).unwrap();
            previous = next;
            answer
        };
        assert!(!changed(&|| {}), "nothing changed");
        assert!(
            changed(&|| std::fs::write(disk.join("new"), b"x").unwrap()),
            "a new file"
        );
        assert!(!changed(&|| {}), "nothing changed again");
        assert!(
            changed(&|| {
                use std::os::unix::fs::FileExt;
                File::options()
                    .write(true)
                    .open(disk.join("d/b"))
                    .unwrap()
                    .write_all_at(b"zz", 4096)
                    .unwrap();
            }),
            "an overwrite inside a file"
        );
        assert!(
            changed(&|| std::fs::remove_file(disk.join("a")).unwrap()),
            "a removal"
        );
        assert!(
            changed(&|| {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(disk.join("new"), std::fs::Permissions::from_mode(0o600))
                    .unwrap();
            }),
            "a chmod"
        );
        assert!(
            changed(&|| std::fs::rename(disk.join("new"), disk.join("d/moved")).unwrap()),
            "a rename"
        );
        assert!(!changed(&|| {}), "and nothing after all that");
    }

    #[test]
    fn changes_to_ignored_inodes_and_before_settling_do_not_count() {
        use std::os::unix::fs::MetadataExt;
        let store = Store::new();
        let storage = RunStorage::detect(&store.runs());
        let run = store.runs().join("r1");
        std::fs::create_dir(&run).unwrap();
        let disk = storage.create(&run, None).unwrap();
        std::fs::create_dir(disk.join("scratch")).unwrap();
        std::fs::create_dir(disk.join("upper")).unwrap();
        let first = storage.snapshot_disk(&run, &store.runs(), "p1").unwrap();
        // Churn in the scratch directory (a file made and removed) and in
        // the root's entries.
        std::fs::write(disk.join("scratch/tmp"), b"x").unwrap();
        std::fs::remove_file(disk.join("scratch/tmp")).unwrap();
        let ignore = [
            std::fs::metadata(&disk).unwrap().ino(),
            std::fs::metadata(disk.join("scratch")).unwrap().ino(),
        ];
        let second = storage.snapshot_disk(&run, &store.runs(), "p2").unwrap();
        let since = created_transid(&first).unwrap();
        assert!(changed_since(&second, since, &[], None, None).unwrap());
        assert!(!changed_since(&second, since, &ignore, None, None).unwrap());
        // A live subvolume, its metadata committed, tells the same
        // without a snapshot.
        std::fs::write(disk.join("upper/live"), b"x").unwrap();
        commit_metadata(&disk).unwrap();
        let newest = created_transid(&second).unwrap();
        assert!(changed_since(&disk, newest, &ignore, None, None).unwrap());
        // What was written before a settle is older than it.
        std::fs::write(disk.join("upper/boot"), b"x").unwrap();
        let settled = settled_transid(&disk).unwrap();
        let third = storage.snapshot_disk(&run, &store.runs(), "p3").unwrap();
        assert!(!changed_since(&third, settled, &ignore, None, None).unwrap());
        std::fs::write(disk.join("upper/later"), b"x").unwrap();
        let fourth = storage.snapshot_disk(&run, &store.runs(), "p4").unwrap();
        assert!(changed_since(&fourth, settled, &ignore, None, None).unwrap());
        for name in ["p1", "p2", "p3", "p4"] {
            remove_capture(&store.runs(), name).unwrap();
        }
    }

    #[test]
    fn a_dropped_point_is_reclaimed_and_counted_before_the_call_returns() {
        let store = Store::new();
        let storage = RunStorage::detect(&store.runs());
        let run = store.runs().join("r1");
        std::fs::create_dir(&run).unwrap();
        let disk = storage.create(&run, Some(64 << 20)).unwrap();
        fill(&disk.join("big"), 20 << 20).unwrap();
        storage.point_disk(&run, &store.runs(), "r1", "p1").unwrap();
        std::fs::remove_file(disk.join("big")).unwrap();
        storage.point_disk(&run, &store.runs(), "r1", "p2").unwrap();
        let held = storage.used_bytes(&run).unwrap() + history_held(&storage, &store.runs());
        assert!(held >= 20 << 20, "the first point holds the file: {held}");
        remove_point_and_reclaim(&store.runs(), "r1", "p1").unwrap();
        let left = storage.used_bytes(&run).unwrap() + history_held(&storage, &store.runs());
        assert!(left < 1 << 20, "freed and counted: {left}");
        remove_history(&store.runs(), "r1").unwrap();
    }

    /// What the points of run r1 hold beside its disk, where the quotas
    /// count it apart (full qgroups).
    fn history_held(storage: &RunStorage, runs: &Path) -> u64 {
        if storage.charges_snapshots() {
            return 0;
        }
        point_ids(runs, "r1")
            .iter()
            .filter_map(|p| storage.exclusive_bytes(&runs.join(HISTORY_DIR).join("r1").join(p)))
            .sum()
    }

    #[test]
    fn a_disk_is_replaced_by_a_point_whole_or_not_at_all() {
        let store = Store::new();
        let storage = RunStorage::detect(&store.runs());
        let run = store.runs().join("r1");
        std::fs::create_dir(&run).unwrap();
        let disk = storage.create(&run, Some(64 << 20)).unwrap();
        std::fs::create_dir(disk.join("ovl-work")).unwrap();
        std::fs::write(disk.join("ovl-work/stale"), b"x").unwrap();
        std::fs::write(disk.join("a"), b"one").unwrap();
        let point = storage.point_disk(&run, &store.runs(), "r1", "p1").unwrap();
        std::fs::write(disk.join("a"), b"two").unwrap();
        std::fs::write(disk.join("b"), b"new").unwrap();
        storage.replace_disk(&point, &run).unwrap();
        assert_eq!(std::fs::read(disk.join("a")).unwrap(), b"one");
        assert!(!disk.join("b").exists());
        assert!(
            std::fs::read_dir(disk.join("ovl-work"))
                .unwrap()
                .next()
                .is_none(),
            "overlayfs' scratch directory starts empty"
        );
        assert_eq!(
            storage.subvolume_limit(&disk),
            Some(64 << 20),
            "the limit is kept"
        );
        std::fs::write(disk.join("c"), b"writable").unwrap();
        assert!(!run.join(NEW_DISK_DIR).exists() && !run.join(OLD_DISK_DIR).exists());
        // A crash after the old disk was moved aside and before the new
        // one was put in place: the next settle puts it in place.
        std::fs::rename(&disk, run.join(OLD_DISK_DIR)).unwrap();
        storage
            .clone_disk_as(&point, &run, NEW_DISK_DIR, None)
            .unwrap();
        storage.settle_disk(&run).unwrap();
        assert_eq!(std::fs::read(disk.join("a")).unwrap(), b"one");
        assert!(!disk.join("c").exists());
        assert!(!run.join(NEW_DISK_DIR).exists() && !run.join(OLD_DISK_DIR).exists());
        // A crash before the renames: the half-made copy goes, the disk
        // stays.
        std::fs::write(disk.join("d"), b"kept").unwrap();
        storage
            .clone_disk_as(&point, &run, NEW_DISK_DIR, None)
            .unwrap();
        storage.settle_disk(&run).unwrap();
        assert_eq!(std::fs::read(disk.join("d")).unwrap(), b"kept");
        assert!(!run.join(NEW_DISK_DIR).exists());
        storage.remove(&run).unwrap();
        remove_history(&store.runs(), "r1").unwrap();
    }

    #[test]
    fn an_access_time_alone_is_no_change() {
        let store = Store::new();
        // The store is mounted noatime; here every read writes its access
        // time, as the first read after a write does under relatime.
        let remount = Command::new("mount")
            .args(["-o", "remount,strictatime"])
            .arg(store.runs())
            .status()
            .unwrap();
        assert!(remount.success());
        let storage = RunStorage::detect(&store.runs());
        let run = store.runs().join("r1");
        std::fs::create_dir(&run).unwrap();
        let disk = storage.create(&run, None).unwrap();
        std::fs::create_dir(disk.join("d")).unwrap();
        std::fs::write(disk.join("d/f"), b"x").unwrap();
        let first = storage.snapshot_disk(&run, &store.runs(), "p1").unwrap();
        // First reads since the writes: relatime updates both atimes.
        let _ = std::fs::read_dir(disk.join("d")).unwrap().count();
        let _ = std::fs::read(disk.join("d/f")).unwrap();
        let second = storage.snapshot_disk(&run, &store.runs(), "p2").unwrap();
        let since = created_transid(&first).unwrap();
        assert!(
            changed_since(&second, since, &[], None, None).unwrap(),
            "atime moved"
        );
        assert!(!changed_since(&second, since, &[], Some(&first), None).unwrap());
        // A real change right after it still counts, in the same clock
        // tick or not: a chmod (the inode alone), then a write.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(disk.join("d/f"), std::fs::Permissions::from_mode(0o600)).unwrap();
        let third = storage.snapshot_disk(&run, &store.runs(), "p3").unwrap();
        let since = created_transid(&second).unwrap();
        assert!(changed_since(&third, since, &[], Some(&second), None).unwrap());
        std::fs::write(disk.join("d/f"), b"y").unwrap();
        let fourth = storage.snapshot_disk(&run, &store.runs(), "p4").unwrap();
        let since = created_transid(&third).unwrap();
        assert!(changed_since(&fourth, since, &[], Some(&third), None).unwrap());
        for name in ["p1", "p2", "p3", "p4"] {
            remove_capture(&store.runs(), name).unwrap();
        }
    }

    #[test]
    fn history_points_are_kept_listed_and_removed() {
        let store = Store::new();
        let storage = RunStorage::detect(&store.runs());
        let run = store.runs().join("r1");
        std::fs::create_dir(&run).unwrap();
        let disk = storage.create(&run, None).unwrap();
        std::fs::write(disk.join("a"), b"one").unwrap();
        let first = storage.point_disk(&run, &store.runs(), "r1", "p1").unwrap();
        std::fs::write(disk.join("a"), b"two").unwrap();
        let second = storage.point_disk(&run, &store.runs(), "r1", "p2").unwrap();
        assert_eq!(std::fs::read(first.join("a")).unwrap(), b"one");
        assert_eq!(std::fs::read(second.join("a")).unwrap(), b"two");
        assert!(changed_since(&second, created_transid(&first).unwrap(), &[], None, None).unwrap());
        assert!(
            std::fs::write(first.join("b"), b"x").is_err(),
            "a point is read-only"
        );
        write_point_meta(&store.runs(), "r1", "p1", b"{\"n\":1}").unwrap();
        write_history_head(&store.runs(), "r1", Some("p1")).unwrap();
        assert_eq!(history_head(&store.runs(), "r1").as_deref(), Some("p1"));
        // Descriptions and the head are not points.
        assert_eq!(point_ids(&store.runs(), "r1"), ["p1", "p2"]);
        assert_eq!(point_meta(&store.runs(), "r1", "p1").unwrap(), b"{\"n\":1}");
        assert_eq!(point_meta(&store.runs(), "r1", "p2"), None, "half-made");
        assert_eq!(history_runs(&store.runs()), ["r1"]);
        write_history_head(&store.runs(), "r1", None).unwrap();
        write_history_head(&store.runs(), "r1", None).unwrap();
        assert_eq!(history_head(&store.runs(), "r1"), None);
        remove_point(&store.runs(), "r1", "p1").unwrap();
        remove_point(&store.runs(), "r1", "p1").unwrap();
        assert_eq!(point_meta(&store.runs(), "r1", "p1"), None);
        assert_eq!(point_ids(&store.runs(), "r1"), ["p2"]);
        // The run's own removal never meets a read-only point.
        storage.remove(&run).unwrap();
        std::fs::remove_dir_all(&run).unwrap();
        remove_history(&store.runs(), "r1").unwrap();
        remove_history(&store.runs(), "r1").unwrap();
        assert!(history_runs(&store.runs()).is_empty());
        assert!(point_ids(&store.runs(), "r1").is_empty());
    }

    #[test]
    fn provisioning_again_keeps_the_mounted_store() {
        let store = Store::new();
        std::fs::write(store.runs().join("marker"), b"x").unwrap();
        provision_loop(&store.dir.path().join("img"), 1 << 30, &store.runs()).unwrap();
        assert!(store.runs().join("marker").exists());
    }

    #[test]
    fn a_non_empty_directory_is_never_mounted_over() {
        let dir = tempfile::tempdir().unwrap();
        let runs = dir.path().join("runs");
        std::fs::create_dir(&runs).unwrap();
        std::fs::write(runs.join("old-run"), b"x").unwrap();
        let err = provision_loop(&dir.path().join("img"), 1 << 30, &runs).unwrap_err();
        assert!(err.contains("--teardown"), "{err}");
        assert!(!dir.path().join("img").exists());
    }

    #[test]
    fn plain_storage_refuses_limits_and_says_what_to_do() {
        let dir = tempfile::tempdir().unwrap();
        let storage = RunStorage::detect(dir.path());
        let why = storage.limits_unsupported().expect("not a quota store");
        assert!(why.contains("--storage-gb"), "{why}");
        let err = storage.create(dir.path(), Some(1 << 20)).unwrap_err();
        assert!(matches!(err, LaneError::Unsupported(_)), "{err}");
        assert!(!dir.path().join(DISK_DIR).exists());
        let disk = storage.create(dir.path(), None).unwrap();
        assert!(disk.is_dir());
        assert_eq!(storage.used_bytes(dir.path()), None);
    }
}
