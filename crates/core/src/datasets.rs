//! The operator's dataset catalog: disk images (a whole-device ext4 or XFS
//! filesystem each) kept on this server by the operator and mounted by
//! runs under a volume name, read-only by default, read-write only where
//! the catalog says `writable`.
//!
//! runbox never makes, copies or deletes an image. The lane loop-mounts an
//! image once, on the host, while any run holds it (readers share the
//! host's page cache) and bind-mounts it into each run like a named
//! volume. Holding follows the named volumes' rule (one writer, or any
//! number of readers), decided by the ledger ([`crate::ledger`]) from the
//! mounts each run's owner reports.
//!
//! A writable image carries a write-ahead marker, `<image>.dirty`, written
//! and synced before the first read-write mount and removed only after a
//! clean release (the host mount unmounted without error). A killed daemon
//! or host leaves it; a read-only mount of a dirty image is refused until
//! one read-write mount (whose mount replays the filesystem's journal) is
//! released cleanly. The catalog is fixed when the daemon starts.

use std::path::PathBuf;

use runbox_types::ErrorCode;
use serde::{Deserialize, Serialize};
use ulid::Ulid;

use crate::error::CoreError;

/// The suffix of an image's write-ahead marker.
pub const DIRTY_SUFFIX: &str = ".dirty";

/// One catalog entry, as the operator writes it (`--dataset`, or a
/// `[[dataset]]` table in the config file).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetEntry {
    /// The volume name runs mount it by (the named volumes' rules).
    pub name: String,
    /// The image on this server: absolute.
    pub path: PathBuf,
    /// Whether a run may mount it `rw`.
    #[serde(default)]
    pub writable: bool,
    /// The tenants that may mount it; empty: every tenant. The operator's
    /// own token always may.
    #[serde(default)]
    pub tenants: Vec<String>,
}

impl DatasetEntry {
    /// Parses a `--dataset` value: a JSON object with the fields above, or
    /// `NAME=PATH` (read-only, every tenant) with `:rw` after the path for
    /// a writable one.
    pub fn parse(spec: &str) -> Result<DatasetEntry, String> {
        let entry = if spec.trim_start().starts_with('{') {
            serde_json::from_str::<DatasetEntry>(spec)
                .map_err(|e| format!("{e} (fields: name, path, writable, tenants)"))?
        } else {
            let (name, rest) = spec
                .split_once('=')
                .ok_or("write NAME=PATH[:rw], or a JSON object with name and path")?;
            let (path, writable) = match rest.strip_suffix(":rw") {
                Some(path) => (path, true),
                None => (rest.strip_suffix(":ro").unwrap_or(rest), false),
            };
            DatasetEntry {
                name: name.to_owned(),
                path: PathBuf::from(path),
                writable,
                tenants: Vec::new(),
            }
        };
        crate::volumes::check_name(&entry.name).map_err(|e| e.to_string())?;
        if !entry.path.is_absolute()
            || entry.path.components().any(|c| {
                !matches!(
                    c,
                    std::path::Component::Normal(_) | std::path::Component::RootDir
                )
            })
        {
            return Err(format!(
                "dataset {:?}: path {:?} must be absolute and clean",
                entry.name,
                entry.path.display()
            ));
        }
        Ok(entry)
    }

    /// The marker beside the image.
    pub fn marker(&self) -> PathBuf {
        let mut name = self.path.clone().into_os_string();
        name.push(DIRTY_SUFFIX);
        PathBuf::from(name)
    }

    /// Whether `tenant` (None: the operator) may see and mount it.
    pub fn admits(&self, tenant: Option<&str>) -> bool {
        match tenant {
            None => true,
            Some(t) => self.tenants.is_empty() || self.tenants.iter().any(|x| x == t),
        }
    }

    /// Its stable id: derived from its name, so it is the same on every
    /// start and every node that lists the same catalog.
    pub fn id(&self) -> Ulid {
        use sha2::Digest;
        let digest = sha2::Sha256::digest(format!("runbox dataset\0{}", self.name));
        let mut bytes = [0u8; 16];
        bytes.copy_from_slice(&digest[..16]);
        Ulid::from(u128::from_be_bytes(bytes))
    }

    /// Why a mount in `mode` cannot be admitted now, if it cannot.
    pub fn unavailable(&self, rw: bool) -> Option<CoreError> {
        let state = self.state(rw);
        let why = state.unavailable?;
        let message = match why.as_str() {
            "missing" => format!(
                "dataset {:?} has no image on this server; the operator must put it in place",
                self.name
            ),
            _ => format!(
                "dataset {:?} is dirty: a writer did not release it cleanly; it needs one rw mount and a clean release before it can be mounted ro",
                self.name
            ),
        };
        Some(CoreError::invalid(ErrorCode::VolumeUnavailable, message))
    }

    /// What it is on this server now, for a mount in `mode` (`rw` false:
    /// what a read-only mount would meet).
    pub fn state(&self, rw: bool) -> runbox_types::DatasetState {
        let unavailable = if !self.path.is_file() {
            Some("missing")
        } else if !rw && self.marker().exists() {
            Some("dirty")
        } else {
            None
        };
        runbox_types::DatasetState {
            writable: self.writable,
            available: unavailable.is_none(),
            unavailable: unavailable.map(str::to_owned),
        }
    }

    /// The image's size in MiB (0 when it is missing).
    pub fn size_mb(&self) -> u64 {
        std::fs::metadata(&self.path).map_or(0, |m| m.len() >> 20)
    }
}

/// Checks a catalog as a whole: names unique. Logs what the operator
/// should know at start: missing images, dirty ones, and listed tenants
/// that do not exist (they grant nothing until made).
pub fn check_catalog(entries: &[DatasetEntry], tenants: &[String]) -> Result<(), String> {
    for (i, entry) in entries.iter().enumerate() {
        if entries[..i].iter().any(|e| e.name == entry.name) {
            return Err(format!("dataset {:?} is listed twice", entry.name));
        }
        if !entry.path.is_file() {
            tracing::warn!(dataset = %entry.name, "the dataset's image is missing; mounts of it fail until it is in place");
        } else if entry.marker().exists() {
            tracing::warn!(dataset = %entry.name, "the dataset is dirty (a writer did not release it cleanly); ro mounts are refused until one rw mount is released cleanly");
        }
        for t in &entry.tenants {
            if !tenants.contains(t) {
                tracing::warn!(dataset = %entry.name, tenant = %t, "the dataset lists a tenant that does not exist; it grants nothing until one is made");
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_parse_short_and_long() {
        let e = DatasetEntry::parse("imagenet=/srv/d/imagenet.img").unwrap();
        assert_eq!((e.name.as_str(), e.writable), ("imagenet", false));
        assert_eq!(e.marker(), PathBuf::from("/srv/d/imagenet.img.dirty"));
        let e = DatasetEntry::parse("scratch=/srv/d/s.img:rw").unwrap();
        assert!(e.writable);
        assert_eq!(e.path, PathBuf::from("/srv/d/s.img"));
        let e =
            DatasetEntry::parse(r#"{"name": "acme", "path": "/srv/a.img", "tenants": ["acme"]}"#)
                .unwrap();
        assert!(e.admits(Some("acme")) && !e.admits(Some("beta")) && e.admits(None));
        for bad in [
            "noequals",
            "bad name=/x.img",
            "x=relative.img",
            "x=/a/../b.img",
            r#"{"name": "x", "path": "/x", "extra": 1}"#,
        ] {
            assert!(DatasetEntry::parse(bad).is_err(), "{bad}");
        }
        assert_ne!(
            DatasetEntry::parse("a=/a").unwrap().id(),
            DatasetEntry::parse("b=/a").unwrap().id()
        );
    }

    #[test]
    fn a_catalog_names_each_dataset_once() {
        let a = DatasetEntry::parse("a=/x.img").unwrap();
        assert!(check_catalog(std::slice::from_ref(&a), &[]).is_ok());
        assert!(check_catalog(&[a.clone(), a], &[]).is_err());
    }
}
