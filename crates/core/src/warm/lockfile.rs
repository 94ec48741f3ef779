//! The lockfile hash: what says whether a warm template still fits a
//! repository's dependencies.
//!
//! The set is every file of [`LOCKFILES`] at the repository root, hashed by
//! name and content. The root is the volume itself when it has any of them,
//! else its one subdirectory that has (a repository cloned into
//! `/work/<name>`); with none, or several such subdirectories, the set is
//! empty. An empty set hashes deterministically, so a lockfile-less
//! repository keeps its template until it is invalidated by hand.
//!
//! The volume is the run's, so everything in it is hostile: names are read
//! relative to directory descriptors, never through a symlink (a lockfile
//! or subdirectory that is a symlink does not count), and only regular
//! files are read.

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::OwnedFd;
use std::path::Path;

use rustix::fs::{FileType, Mode, OFlags};
use sha2::{Digest, Sha256};

/// Files that pin a repository's dependencies, by the ecosystems' own names.
pub const LOCKFILES: &[&str] = &[
    "go.mod",
    "go.sum",
    "package-lock.json",
    "npm-shrinkwrap.json",
    "pnpm-lock.yaml",
    "yarn.lock",
    "bun.lock",
    "bun.lockb",
    "deno.lock",
    "Cargo.lock",
    "poetry.lock",
    "uv.lock",
    "Pipfile.lock",
    "pdm.lock",
    "requirements.txt",
    "Gemfile.lock",
    "composer.lock",
    "mix.lock",
    "pubspec.lock",
    "Package.resolved",
    "Podfile.lock",
    "gradle.lockfile",
    "packages.lock.json",
    "flake.lock",
];

/// Subdirectories looked at, at most, when the volume root has no lockfile
/// (a volume with more entries than this is not scanned further).
const MAX_SCANNED: usize = 4096;

/// A lockfile set and its hash.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LockSet {
    /// `sha256:<hex>` over the files' names and contents, in name order.
    pub hash: String,
    /// The repository's directory relative to the volume: empty for the
    /// volume itself, else the one subdirectory's name.
    pub subdir: String,
    /// The lockfiles found, in name order.
    pub files: Vec<String>,
}

/// Hashes the lockfile set of the volume at `root`.
pub fn lock_set(root: &Path) -> io::Result<LockSet> {
    let root = rustix::fs::open(
        root,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let at_root = present(&root)?;
    if !at_root.is_empty() {
        return hash(&root, String::new(), at_root);
    }
    let mut found: Option<(String, OwnedFd, Vec<&'static str>)> = None;
    let mut several = false;
    let dir = rustix::fs::Dir::read_from(&root)?;
    let mut scanned = 0;
    for entry in dir {
        let entry = entry?;
        let Ok(name) = entry.file_name().to_str() else {
            continue;
        };
        if name == "." || name == ".." || entry.file_type() != FileType::Directory {
            continue;
        }
        scanned += 1;
        if scanned > MAX_SCANNED {
            break;
        }
        let Ok(sub) = rustix::fs::openat(
            &root,
            name,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        ) else {
            continue;
        };
        let files = present(&sub)?;
        if files.is_empty() {
            continue;
        }
        if found.is_some() {
            several = true;
            break;
        }
        found = Some((name.to_owned(), sub, files));
    }
    match found {
        Some((name, sub, files)) if !several => hash(&sub, name, files),
        _ => hash(&root, String::new(), Vec::new()),
    }
}

/// The lockfiles that are regular files in `dir`.
fn present(dir: &OwnedFd) -> io::Result<Vec<&'static str>> {
    let mut out = Vec::new();
    for name in LOCKFILES {
        match rustix::fs::statat(dir, *name, rustix::fs::AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::RegularFile => {
                out.push(*name)
            }
            Ok(_) | Err(rustix::io::Errno::NOENT | rustix::io::Errno::NOTDIR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    out.sort_unstable();
    Ok(out)
}

fn hash(dir: &OwnedFd, subdir: String, files: Vec<&'static str>) -> io::Result<LockSet> {
    let mut hasher = Sha256::new();
    hasher.update(b"runbox-lockset-1\0");
    let mut buf = vec![0u8; 64 << 10];
    for name in &files {
        let fd = rustix::fs::openat(
            dir,
            *name,
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        let st = rustix::fs::fstat(&fd)?;
        if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
            // Swapped between the look and the open.
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{name} changed while it was hashed"),
            ));
        }
        hasher.update(name.as_bytes());
        hasher.update(b"\0");
        let mut file = File::from(fd);
        let mut content = Sha256::new();
        loop {
            let n = file.read(&mut buf)?;
            if n == 0 {
                break;
            }
            content.update(&buf[..n]);
        }
        hasher.update(content.finalize());
    }
    let digest = hasher.finalize();
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    Ok(LockSet {
        hash: format!("sha256:{hex}"),
        subdir,
        files: files.iter().map(|s| s.to_string()).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    #[test]
    fn the_hash_keys_on_names_and_contents_at_the_root() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        let empty = lock_set(root).unwrap();
        assert!(empty.files.is_empty() && empty.subdir.is_empty());
        assert_eq!(empty, lock_set(root).unwrap(), "deterministic");

        fs::write(root.join("Cargo.lock"), "a").unwrap();
        fs::write(root.join("README.md"), "not a lockfile").unwrap();
        let one = lock_set(root).unwrap();
        assert_eq!(one.files, ["Cargo.lock"]);
        assert_ne!(one.hash, empty.hash);
        fs::write(root.join("README.md"), "changed").unwrap();
        assert_eq!(
            lock_set(root).unwrap().hash,
            one.hash,
            "other files do not count"
        );
        fs::write(root.join("Cargo.lock"), "b").unwrap();
        assert_ne!(lock_set(root).unwrap().hash, one.hash, "content counts");
        fs::write(root.join("Cargo.lock"), "a").unwrap();
        fs::rename(root.join("Cargo.lock"), root.join("uv.lock")).unwrap();
        assert_ne!(lock_set(root).unwrap().hash, one.hash, "the name counts");
    }

    #[test]
    fn one_subdirectory_with_lockfiles_is_the_repository() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        fs::create_dir_all(root.join("app")).unwrap();
        fs::create_dir_all(root.join("docs")).unwrap();
        fs::write(root.join("app/package-lock.json"), "{}").unwrap();
        let set = lock_set(root).unwrap();
        assert_eq!((set.subdir.as_str(), set.files.len()), ("app", 1));
        // The same files at the root hash the same: paths are the repo's.
        let flat = tempfile::tempdir().unwrap();
        fs::write(flat.path().join("package-lock.json"), "{}").unwrap();
        assert_eq!(lock_set(flat.path()).unwrap().hash, set.hash);
        // Two candidates: ambiguous, so nothing.
        fs::write(root.join("docs/yarn.lock"), "").unwrap();
        let set = lock_set(root).unwrap();
        assert!(set.files.is_empty() && set.subdir.is_empty());
    }

    #[test]
    fn symlinks_and_special_files_never_count() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        std::os::unix::fs::symlink("/etc/passwd", root.join("Cargo.lock")).unwrap();
        fs::create_dir(root.join("real")).unwrap();
        fs::write(root.join("real/go.sum"), "x").unwrap();
        std::os::unix::fs::symlink("real", root.join("link")).unwrap();
        fs::create_dir(root.join("other")).unwrap();
        fs::create_dir(root.join("other/yarn.lock")).unwrap();
        let set = lock_set(root).unwrap();
        // Only `real` counts: the symlinked lockfile and directory do not,
        // and a directory named like a lockfile is not one.
        assert_eq!(
            (set.subdir.as_str(), set.files),
            ("real", vec!["go.sum".to_owned()])
        );
    }
}
