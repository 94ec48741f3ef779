//! Imported root filesystems.
//!
//! Layout under `<state-dir>/images/`:
//!
//! ```text
//! <name>/image.json   metadata (name, size, import time)
//! <name>/rootfs/      the unpacked tree, used read-only as the overlay lower dir
//! .tmp-<ulid>/        an import in progress; removed at start-up
//! ```
//!
//! An import unpacks into a temporary directory and renames it into place, so
//! a crash mid-import leaves nothing that looks like an image. The
//! content-addressed layer store and registry pulls are a later addition; this
//! module only takes plain root filesystem tarballs.

use std::fs;
use std::io::{BufRead, BufReader, Read};
use std::path::{Component, Path, PathBuf};

use runbox_types::{ErrorCode, Image};
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use ulid::Ulid;

use crate::error::CoreError;
use crate::validate;

/// Most entries one archive may hold.
pub const MAX_ENTRIES: u64 = 1_000_000;

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ImageMeta {
    name: String,
    size_bytes: u64,
    #[serde(with = "time::serde::rfc3339")]
    created_at: OffsetDateTime,
}

/// The image directory.
#[derive(Clone, Debug)]
pub struct ImageStore {
    dir: PathBuf,
}

impl ImageStore {
    /// Opens the store at `dir`, creating it, and removes leftovers of
    /// imports that a crash interrupted.
    pub fn open(dir: PathBuf) -> Result<ImageStore, CoreError> {
        fs::create_dir_all(&dir).map_err(CoreError::io(format!("creating {}", dir.display())))?;
        for entry in fs::read_dir(&dir).map_err(CoreError::io("reading the image directory"))? {
            let entry = entry.map_err(CoreError::io("reading the image directory"))?;
            if entry.file_name().to_string_lossy().starts_with(".tmp-") {
                tracing::info!(path = %entry.path().display(), "removing an interrupted import");
                let _ = fs::remove_dir_all(entry.path());
            }
        }
        Ok(ImageStore { dir })
    }

    /// The root filesystem of image `name`.
    pub fn rootfs(&self, name: &str) -> Result<PathBuf, CoreError> {
        validate::image_name(name)?;
        let rootfs = self.dir.join(name).join("rootfs");
        if rootfs.is_dir() {
            Ok(rootfs)
        } else {
            Err(CoreError::ImageNotFound(name.to_owned()))
        }
    }

    /// Image `name` as the API shows it.
    pub fn get(&self, name: &str, server: &str) -> Result<Image, CoreError> {
        validate::image_name(name)?;
        let meta_path = self.dir.join(name).join("image.json");
        let raw = match fs::read(&meta_path) {
            Ok(raw) => raw,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(CoreError::ImageNotFound(name.to_owned()))
            }
            Err(e) => return Err(CoreError::io(format!("reading {}", meta_path.display()))(e)),
        };
        let meta: ImageMeta = serde_json::from_slice(&raw)
            .map_err(|e| CoreError::Store(format!("{}: {e}", meta_path.display())))?;
        Ok(Image {
            name: meta.name,
            server: server.to_owned(),
            size_bytes: meta.size_bytes,
            created_at: meta.created_at,
        })
    }

    /// Every image, ordered by name.
    pub fn list(&self, server: &str) -> Result<Vec<Image>, CoreError> {
        let mut names = Vec::new();
        for entry in
            fs::read_dir(&self.dir).map_err(CoreError::io("reading the image directory"))?
        {
            let entry = entry.map_err(CoreError::io("reading the image directory"))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if validate::image_name(&name).is_ok() {
                names.push(name);
            }
        }
        names.sort();
        Ok(names
            .iter()
            .filter_map(|n| self.get(n, server).ok())
            .collect())
    }

    /// Removes image `name`. The caller checks that no run uses it.
    pub fn remove(&self, name: &str) -> Result<(), CoreError> {
        validate::image_name(name)?;
        let path = self.dir.join(name);
        if !path.exists() {
            return Err(CoreError::ImageNotFound(name.to_owned()));
        }
        // Rename first so that a half-deleted tree never looks like an image.
        let doomed = self.dir.join(format!(".tmp-{}", Ulid::new()));
        fs::rename(&path, &doomed).map_err(CoreError::io(format!("removing image {name}")))?;
        fs::remove_dir_all(&doomed).map_err(CoreError::io(format!("removing image {name}")))
    }

    /// Imports a root filesystem from a tar stream (optionally gzip-compressed)
    /// as image `name`. Blocking: call it from a blocking thread.
    ///
    /// Unpacking rules: entries must stay inside the new root (absolute paths
    /// and `..` are refused, and the tar crate refuses to write through a
    /// symlink that leads outside), device nodes and FIFOs are skipped, and the
    /// unpacked size is capped at `max_bytes`. Any refusal removes everything
    /// unpacked so far.
    pub fn import(
        &self,
        name: &str,
        reader: impl Read,
        max_bytes: u64,
        server: &str,
    ) -> Result<Image, CoreError> {
        validate::image_name(name)?;
        if self.dir.join(name).exists() {
            return Err(CoreError::Conflict {
                code: ErrorCode::ImageExists,
                message: format!(
                    "an image named {name:?} already exists; remove it first or pick another name"
                ),
            });
        }
        let tmp = self.dir.join(format!(".tmp-{}", Ulid::new()));
        let result = self
            .unpack_into(&tmp, name, reader, max_bytes)
            .and_then(|()| {
                fs::rename(&tmp, self.dir.join(name)).map_err(|e| {
                    if e.kind() == std::io::ErrorKind::DirectoryNotEmpty
                        || e.raw_os_error() == Some(libc_eexist())
                    {
                        CoreError::Conflict {
                            code: ErrorCode::ImageExists,
                            message: format!("an image named {name:?} was imported concurrently"),
                        }
                    } else {
                        CoreError::io(format!("installing image {name}"))(e)
                    }
                })
            });
        if let Err(e) = result {
            let _ = fs::remove_dir_all(&tmp);
            return Err(e);
        }
        self.get(name, server)
    }

    fn unpack_into(
        &self,
        tmp: &Path,
        name: &str,
        reader: impl Read,
        max_bytes: u64,
    ) -> Result<(), CoreError> {
        let rootfs = tmp.join("rootfs");
        fs::create_dir_all(&rootfs).map_err(CoreError::io("creating the import directory"))?;
        let mut reader = BufReader::new(reader);
        let head = reader.fill_buf().map_err(bad_archive_io)?;
        let gz = head.starts_with(&[0x1f, 0x8b]);
        let reader: Box<dyn Read> = if gz {
            Box::new(flate2::read::GzDecoder::new(reader))
        } else {
            Box::new(reader)
        };
        let mut archive = tar::Archive::new(reader);
        archive.set_preserve_permissions(true);
        archive.set_preserve_ownerships(true);
        archive.set_unpack_xattrs(false);
        archive.set_overwrite(true);
        let mut size = 0u64;
        let mut count = 0u64;
        for entry in archive.entries().map_err(bad_archive_io)? {
            let mut entry = entry.map_err(bad_archive_io)?;
            count += 1;
            if count > MAX_ENTRIES {
                return Err(bad_archive(format!(
                    "archive has more than {MAX_ENTRIES} entries"
                )));
            }
            let path = entry.path().map_err(bad_archive_io)?.into_owned();
            check_entry_path(&path)?;
            let kind = entry.header().entry_type();
            if kind.is_character_special() || kind.is_block_special() || kind.is_fifo() {
                tracing::debug!(path = %path.display(), "skipping a device node or fifo");
                continue;
            }
            if kind.is_hard_link() {
                if let Some(target) = entry.link_name().map_err(bad_archive_io)? {
                    check_entry_path(&target)?;
                }
            }
            size = size.saturating_add(entry.header().size().unwrap_or(0));
            if size > max_bytes {
                return Err(CoreError::invalid(
                    ErrorCode::TooLarge,
                    format!("image unpacks to more than {max_bytes} bytes, this server's maximum"),
                ));
            }
            match entry.unpack_in(&rootfs) {
                Ok(true) => {}
                Ok(false) => {
                    return Err(bad_archive(format!(
                        "entry {} escapes the image root",
                        path.display()
                    )))
                }
                Err(e) => {
                    // tar's error hides its cause in `source`; show the chain.
                    let cause = std::error::Error::source(&e)
                        .map(|c| format!(": {c}"))
                        .unwrap_or_default();
                    return Err(bad_archive(format!(
                        "unpacking {}: {e}{cause}",
                        path.display()
                    )));
                }
            }
        }
        if count == 0 {
            return Err(bad_archive("the archive is empty".into()));
        }
        // The default working directory of every run.
        let work = rootfs.join("work");
        if !work.exists() {
            fs::create_dir(&work).map_err(CoreError::io("creating /work in the image"))?;
        }
        let meta = ImageMeta {
            name: name.to_owned(),
            size_bytes: size,
            created_at: OffsetDateTime::now_utc(),
        };
        let raw = serde_json::to_vec_pretty(&meta).map_err(|e| CoreError::Store(e.to_string()))?;
        fs::write(tmp.join("image.json"), raw).map_err(CoreError::io("writing image metadata"))
    }
}

fn libc_eexist() -> i32 {
    rustix::io::Errno::EXIST.raw_os_error()
}

fn check_entry_path(path: &Path) -> Result<(), CoreError> {
    for component in path.components() {
        match component {
            Component::Normal(_) | Component::CurDir => {}
            Component::ParentDir => {
                return Err(bad_archive(format!(
                    "entry {} contains `..`",
                    path.display()
                )));
            }
            Component::RootDir | Component::Prefix(_) => {
                return Err(bad_archive(format!(
                    "entry {} is an absolute path",
                    path.display()
                )));
            }
        }
    }
    Ok(())
}

fn bad_archive(message: String) -> CoreError {
    CoreError::invalid(ErrorCode::BadArchive, message)
}

fn bad_archive_io(e: std::io::Error) -> CoreError {
    bad_archive(format!("reading the archive: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tarball(build: impl FnOnce(&mut tar::Builder<Vec<u8>>)) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        build(&mut b);
        b.into_inner().unwrap()
    }

    fn file(b: &mut tar::Builder<Vec<u8>>, path: &str, data: &[u8]) {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(0);
        h.set_entry_type(tar::EntryType::Regular);
        // Write the name bytes directly so hostile names reach the unpacker.
        h.as_old_mut().name[..path.len()].copy_from_slice(path.as_bytes());
        h.set_cksum();
        b.append(&h, data).unwrap();
    }

    #[test]
    fn import_list_remove() {
        let dir = tempfile::tempdir().unwrap();
        let store = ImageStore::open(dir.path().to_path_buf()).unwrap();
        let tar = tarball(|b| file(b, "etc/hello", b"hi"));
        let image = store.import("base", tar.as_slice(), 1 << 20, "s").unwrap();
        assert_eq!(image.size_bytes, 2);
        let rootfs = store.rootfs("base").unwrap();
        assert_eq!(fs::read(rootfs.join("etc/hello")).unwrap(), b"hi");
        assert!(rootfs.join("work").is_dir());
        assert_eq!(store.list("s").unwrap().len(), 1);
        let again = store
            .import("base", tar.as_slice(), 1 << 20, "s")
            .unwrap_err();
        assert_eq!(again.code(), ErrorCode::ImageExists);
        store.remove("base").unwrap();
        assert_eq!(
            store.rootfs("base").unwrap_err().code(),
            ErrorCode::ImageNotFound
        );
    }

    #[test]
    fn hostile_archives_leave_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let store = ImageStore::open(dir.path().to_path_buf()).unwrap();
        let cases = [
            tarball(|b| file(b, "../escape", b"x")),
            tarball(|b| file(b, "/abs", b"x")),
            tarball(|_| {}),
            b"definitely not a tar archive, but long enough to look at....".repeat(20),
        ];
        for tar in cases {
            let err = store
                .import("bad", tar.as_slice(), 1 << 20, "s")
                .unwrap_err();
            assert_eq!(err.code(), ErrorCode::BadArchive, "{err}");
        }
        let big = tarball(|b| file(b, "big", &[0u8; 4096]));
        assert_eq!(
            store
                .import("bad", big.as_slice(), 100, "s")
                .unwrap_err()
                .code(),
            ErrorCode::TooLarge
        );
        let left: Vec<_> = fs::read_dir(dir.path()).unwrap().collect();
        assert!(left.is_empty(), "{left:?}");
    }

    #[test]
    fn symlink_escape_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let store = ImageStore::open(dir.path().to_path_buf()).unwrap();
        let tar = tarball(|b| {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(tar::EntryType::Symlink);
            h.set_size(0);
            h.set_uid(0);
            h.set_gid(0);
            h.set_mtime(0);
            b.append_link(&mut h, "link", outside.path()).unwrap();
            file(b, "link/owned", b"x");
        });
        let err = store
            .import("bad", tar.as_slice(), 1 << 20, "s")
            .unwrap_err();
        assert_eq!(err.code(), ErrorCode::BadArchive);
        assert!(!outside.path().join("owned").exists());
    }
}
