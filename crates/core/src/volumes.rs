//! Named volumes: what they are on record, where records are kept, and the
//! rules for their names and for where runs mount them.
//!
//! A volume's record (id, name, owner, size) is kept behind
//! [`VolumeStore`]: the node's database today, a shared store for a fleet
//! later. Who holds a volume is not stored apart: each run's record lists
//! the volumes it mounts ([`RunVolumeRecord`]), so the holders are read off
//! the live runs, a restarted daemon finds them again with its runs, and a
//! destroyed run lets go of its volumes with nothing else to update.

use std::sync::Arc;

use redb::{ReadableDatabase, ReadableTable, TableDefinition};
use runbox_types::{ErrorCode, VolumeMode};
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use ulid::Ulid;

use crate::error::CoreError;
use crate::store::Store;

/// A named volume on record.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeRecord {
    /// Its id: what the lane stores it under.
    pub id: Ulid,
    /// Its name, unique among its owner's volumes.
    pub name: String,
    /// The tenant it belongs to; None: the operator's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// The MiB it may hold.
    pub size_mb: u64,
    /// When it was made.
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    /// Its labels.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub labels: std::collections::BTreeMap<String, String>,
    /// A move of it to or from another node of the fleet that has not
    /// ended: no run mounts it, nothing writes or deletes it meanwhile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moving: Option<VolumeMoving>,
}

/// A volume's move between nodes, as its record keeps it until the move
/// ends (see `runbox_core::runs` `volume_moves`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeMoving {
    /// The move (its objects in the checkpoint bucket are under it).
    pub id: Ulid,
    /// The node it goes to.
    pub to: String,
    /// This node is that node (the volume is not its own until the move
    /// ends as arrived; until then nothing finds it here).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub arriving: bool,
}

/// A volume a run mounts, as the run's record keeps it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RunVolumeRecord {
    /// The volume.
    pub id: Ulid,
    /// Its name when the run mounted it.
    pub name: String,
    /// Where in the run.
    pub path: String,
    /// How.
    pub mode: VolumeMode,
    /// A dataset of the operator's catalog (its id is derived from its
    /// name), not a named volume.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub dataset: bool,
}

impl RunVolumeRecord {
    /// The API view.
    pub fn to_api(&self) -> runbox_types::RunVolume {
        runbox_types::RunVolume {
            name: self.name.clone(),
            path: self.path.clone(),
            mode: self.mode,
        }
    }
}

/// Where volume records are kept. Records are small and few; every call
/// is a whole, durable step.
pub trait VolumeStore: Send + Sync + 'static {
    /// Every record.
    fn list(&self) -> Result<Vec<VolumeRecord>, CoreError>;
    /// Inserts or replaces a record.
    fn put(&self, record: &VolumeRecord) -> Result<(), CoreError>;
    /// Removes a record; no error if it is absent.
    fn delete(&self, id: Ulid) -> Result<(), CoreError>;
}

const VOLUMES: TableDefinition<&str, &[u8]> = TableDefinition::new("volumes");

fn store_err(e: impl std::fmt::Display) -> CoreError {
    CoreError::Store(e.to_string())
}

impl VolumeStore for Store {
    fn list(&self) -> Result<Vec<VolumeRecord>, CoreError> {
        let tx = self.db().begin_read().map_err(store_err)?;
        let table = match tx.open_table(VOLUMES) {
            Ok(table) => table,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
            Err(e) => return Err(store_err(e)),
        };
        let mut out = Vec::new();
        for entry in table.iter().map_err(store_err)? {
            let (key, value) = entry.map_err(store_err)?;
            match serde_json::from_slice::<VolumeRecord>(value.value()) {
                Ok(record) => out.push(record),
                Err(e) => {
                    tracing::warn!(volume = key.value(), error = %e, "skipping unreadable volume record")
                }
            }
        }
        Ok(out)
    }

    fn put(&self, record: &VolumeRecord) -> Result<(), CoreError> {
        let key = record.id.to_string();
        let value = serde_json::to_vec(record).map_err(store_err)?;
        let tx = self.db().begin_write().map_err(store_err)?;
        {
            let mut table = tx.open_table(VOLUMES).map_err(store_err)?;
            table
                .insert(key.as_str(), value.as_slice())
                .map_err(store_err)?;
        }
        tx.commit().map_err(store_err)
    }

    fn delete(&self, id: Ulid) -> Result<(), CoreError> {
        let key = id.to_string();
        let tx = self.db().begin_write().map_err(store_err)?;
        {
            let mut table = tx.open_table(VOLUMES).map_err(store_err)?;
            table.remove(key.as_str()).map_err(store_err)?;
        }
        tx.commit().map_err(store_err)
    }
}

/// The longest volume name.
pub const MAX_NAME: usize = 63;

/// Checks a volume name: 1-63 of letters, digits, `_`, `-` and `.`,
/// starting with a letter or digit (so it is one clean path component,
/// and E2B's names fit).
pub fn check_name(name: &str) -> Result<(), CoreError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(CoreError::invalid(
            ErrorCode::BadVolume,
            format!(
                "volume name {:?} must be 1-{MAX_NAME} letters, digits, '_', '-' or '.', starting with a letter or digit",
                crate::validate::truncate(name, 80)
            ),
        ))
    }
}

/// The top-level directories of a run's system a volume may not cover:
/// those runbox provides, and the operating system's own.
const SYSTEM_DIRS: &[&str] = &[
    "proc", "sys", "dev", "run", ".runbox", "bin", "sbin", "lib", "lib32", "lib64", "libx32",
    "usr", "etc", "boot",
];

/// Checks where a volume is mounted and returns it clean: absolute, no
/// `.` or `..`, not the root and not in [`SYSTEM_DIRS`].
pub fn mount_path(name: &str, path: &str) -> Result<String, CoreError> {
    let bad = |why: &str| {
        CoreError::invalid(
            ErrorCode::BadPath,
            format!(
                "volume {name:?}: mount path {:?} {why}",
                crate::validate::truncate(path, 80)
            ),
        )
    };
    if path.contains('\0') || path.chars().any(char::is_control) {
        return Err(bad("has control characters"));
    }
    if !path.starts_with('/') {
        return Err(bad("must be absolute, like /volumes/data"));
    }
    let mut parts = Vec::new();
    for part in path.split('/') {
        match part {
            "" => {}
            "." | ".." => return Err(bad("must not contain '.' or '..'")),
            part => parts.push(part),
        }
    }
    match parts.first() {
        None => Err(bad("is the root; name a directory such as /volumes/data")),
        Some(first) if SYSTEM_DIRS.contains(first) => Err(bad(&format!(
            "is inside /{first}, one of the system's own directories ({})",
            SYSTEM_DIRS
                .iter()
                .map(|d| format!("/{d}"))
                .collect::<Vec<_>>()
                .join(", ")
        ))),
        Some(_) if parts.len() > 16 => Err(bad("has more than 16 components")),
        Some(_) => Ok(format!("/{}", parts.join("/"))),
    }
}

/// Whether `a` and `b` (clean absolute paths) are the same or one holds
/// the other.
pub fn overlaps(a: &str, b: &str) -> bool {
    let within = |inner: &str, outer: &str| {
        inner == outer
            || inner
                .strip_prefix(outer)
                .is_some_and(|r| r.starts_with('/'))
    };
    within(a, b) || within(b, a)
}

fn arriving(record: &VolumeRecord) -> bool {
    record.moving.as_ref().is_some_and(|m| m.arriving)
}

/// The node's volume records, read once at start and kept in step with the
/// store. Lookups are by owner and name.
pub(crate) struct Volumes {
    store: Arc<dyn VolumeStore>,
    known: std::sync::Mutex<Vec<VolumeRecord>>,
}

impl Volumes {
    /// Loads every record from `store`.
    pub fn open(store: Arc<dyn VolumeStore>) -> Result<Volumes, CoreError> {
        let known = store.list()?;
        Ok(Volumes {
            store,
            known: std::sync::Mutex::new(known),
        })
    }

    fn known(&self) -> std::sync::MutexGuard<'_, Vec<VolumeRecord>> {
        self.known.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The volume `tenant` (None: the operator) has under `name` (not one
    /// still arriving from another node).
    pub fn find(&self, tenant: Option<&str>, name: &str) -> Option<VolumeRecord> {
        self.known()
            .iter()
            .find(|v| v.tenant.as_deref() == tenant && v.name == name && !arriving(v))
            .cloned()
    }

    /// Volume `id`'s record.
    pub fn get(&self, id: Ulid) -> Option<VolumeRecord> {
        self.known().iter().find(|v| v.id == id).cloned()
    }

    /// Whether volume `id` is on record.
    pub fn exists(&self, id: Ulid) -> bool {
        self.known().iter().any(|v| v.id == id)
    }

    /// The node volume `id` is moving to or from, when a move of it has
    /// not ended.
    pub fn moving(&self, id: Ulid) -> Option<VolumeMoving> {
        self.known()
            .iter()
            .find(|v| v.id == id)
            .and_then(|v| v.moving.clone())
    }

    /// Every record, by owner and name (not those still arriving).
    pub fn all(&self) -> Vec<VolumeRecord> {
        let mut all: Vec<VolumeRecord> = self
            .known()
            .iter()
            .filter(|v| !arriving(v))
            .cloned()
            .collect();
        all.sort_by(|a, b| (&a.tenant, &a.name).cmp(&(&b.tenant, &b.name)));
        all
    }

    /// The records of volumes whose moves have not ended.
    pub fn in_motion(&self) -> Vec<VolumeRecord> {
        self.known()
            .iter()
            .filter(|v| v.moving.is_some())
            .cloned()
            .collect()
    }

    /// Sets (or clears) volume `id`'s move, durably.
    pub fn set_moving(&self, id: Ulid, moving: Option<VolumeMoving>) -> Result<(), CoreError> {
        let mut known = self.known();
        let Some(record) = known.iter_mut().find(|v| v.id == id) else {
            return Err(CoreError::Store(format!("volume {id} is not on record")));
        };
        let mut changed = record.clone();
        changed.moving = moving;
        self.store.put(&changed)?;
        *record = changed;
        Ok(())
    }

    /// Every id on record.
    pub fn ids(&self) -> std::collections::HashSet<Ulid> {
        self.known().iter().map(|v| v.id).collect()
    }

    /// Records `record` durably, unless its owner has a volume of that
    /// name already (then the one on record).
    pub fn add(&self, record: VolumeRecord) -> Result<Result<(), VolumeRecord>, CoreError> {
        let mut known = self.known();
        if let Some(existing) = known
            .iter()
            .find(|v| v.tenant == record.tenant && v.name == record.name)
        {
            return Ok(Err(existing.clone()));
        }
        self.store.put(&record)?;
        known.push(record);
        Ok(Ok(()))
    }

    /// Forgets volume `id` (first in memory, so no new holder finds it,
    /// then on record).
    pub fn remove(&self, id: Ulid) -> Result<(), CoreError> {
        self.known().retain(|v| v.id != id);
        self.store.delete(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_one_clean_component() {
        for good in ["data", "A-1", "model_cache", "v1.2", &"x".repeat(63)] {
            assert!(check_name(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            ".",
            "..",
            "-x",
            "_x",
            "a/b",
            "a b",
            "é",
            "a\0",
            &"x".repeat(64),
        ] {
            let e = check_name(bad).unwrap_err();
            assert_eq!(e.code(), ErrorCode::BadVolume, "{bad:?}");
        }
    }

    #[test]
    fn mount_paths_are_clean_and_outside_system_directories() {
        assert_eq!(mount_path("d", "/volumes/d").unwrap(), "/volumes/d");
        assert_eq!(
            mount_path("d", "//data/./x/").unwrap_err().code(),
            ErrorCode::BadPath
        );
        assert_eq!(mount_path("d", "//data//x/").unwrap(), "/data/x");
        assert_eq!(mount_path("d", "/work").unwrap(), "/work");
        for bad in [
            "",
            "data",
            "/",
            "/a/../etc",
            "/etc",
            "/etc/x",
            "/usr/local",
            "/proc",
            "/dev/x",
            "/.runbox",
            "/bin",
            "/lib64/x",
            "/a\nb",
        ] {
            assert_eq!(
                mount_path("d", bad).unwrap_err().code(),
                ErrorCode::BadPath,
                "{bad:?}"
            );
        }
        assert!(mount_path("d", &"/a".repeat(17)).is_err());
    }

    #[test]
    fn overlapping_paths_are_found() {
        assert!(overlaps("/a", "/a"));
        assert!(overlaps("/a", "/a/b"));
        assert!(overlaps("/a/b", "/a"));
        assert!(!overlaps("/a", "/ab"));
        assert!(!overlaps("/a/b", "/a/c"));
    }

    #[test]
    fn records_survive_a_reopen_and_names_are_per_owner() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("db")).unwrap();
        let record = |name: &str, tenant: Option<&str>| VolumeRecord {
            moving: None,
            id: Ulid::new(),
            name: name.into(),
            tenant: tenant.map(str::to_owned),
            size_mb: 64,
            created_at: OffsetDateTime::UNIX_EPOCH,
            labels: Default::default(),
        };
        let volumes = Volumes::open(Arc::new(store.clone())).unwrap();
        let a = record("data", None);
        volumes.add(a.clone()).unwrap().unwrap();
        volumes.add(record("data", Some("acme"))).unwrap().unwrap();
        let again = volumes.add(record("data", None)).unwrap().unwrap_err();
        assert_eq!(again.id, a.id);
        let reopened = Volumes::open(Arc::new(store)).unwrap();
        assert_eq!(reopened.all().len(), 2);
        assert_eq!(reopened.find(None, "data").unwrap(), a);
        reopened.remove(a.id).unwrap();
        assert!(reopened.find(None, "data").is_none());
        assert!(reopened.find(Some("acme"), "data").is_some());
    }
}
