//! Turns an overlayfs upper directory (what a run changed) into an OCI layer
//! tar, so a run's state can be stored as one more image layer.
//!
//! The overlay's own markers become the OCI ones: a whiteout (a character
//! device 0:0) becomes an empty `.wh.<name>` entry, and an opaque directory
//! (xattr `trusted.overlay.opaque=y`) gets a `.wh..wh..opq` entry. Entries
//! are written in name order with their mode, owner and modification time,
//! so the same tree always gives the same tar and the same digest. Hard
//! links inside the tree stay hard links. Sockets are skipped (they cannot
//! be stored); extended attributes other than the opaque mark are not kept.
//!
//! It reads a tree nobody writes any more (a frozen copy of the upper
//! directory) and never follows a symlink.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

/// The xattr that marks a directory opaque for overlayfs.
const OPAQUE_XATTR: &str = "trusted.overlay.opaque";

/// A file beside an upper directory (in its parent) naming the first host
/// id of the user namespace range its files are owned in; ids from there
/// are written as the run saw them (base + N as N), so a layer never
/// carries one node's host ids. Absent: ids are written as they are.
pub const IDBASE_FILE: &str = "idbase";

/// Ids in one user namespace range.
const RANGE: u32 = 65536;

/// What was written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CaptureStats {
    /// Entries written (whiteouts included).
    pub entries: u64,
    /// Bytes of file data.
    pub bytes: u64,
}

/// Writes the tree at `upper` to `out` as an OCI layer tar. Entries whose
/// path relative to `upper` is in `skip` (like `.runbox` or
/// `etc/resolv.conf`: what the runtime put there for the run's own mounts)
/// are left out, with everything below them. Returns what was written.
pub fn upper_to_tar(upper: &Path, skip: &[&str], out: impl Write) -> io::Result<CaptureStats> {
    upper_to_tar_with(upper, skip, None, out)
}

/// A plain directory tree written into a layer at a path of its own, in
/// place of whatever the upper directory has there: a volume that was
/// mounted over that path in the run.
#[derive(Clone, Copy, Debug)]
pub struct Graft<'a> {
    /// Where, relative to the root (e.g. `work`).
    pub at: &'a Path,
    /// The tree (no overlay markers in it).
    pub dir: &'a Path,
}

/// [`upper_to_tar`], with `graft` written at its path as an opaque
/// directory (hiding what the image has there, as the mounted volume did).
pub fn upper_to_tar_with(
    upper: &Path,
    skip: &[&str],
    graft: Option<Graft>,
    out: impl Write,
) -> io::Result<CaptureStats> {
    let mut builder = tar::Builder::new(out);
    builder.mode(tar::HeaderMode::Complete);
    builder.follow_symlinks(false);
    let base = match upper
        .parent()
        .map(|p| fs::read_to_string(p.join(IDBASE_FILE)))
    {
        Some(Ok(text)) => Some(text.trim().parse::<u32>().map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{IDBASE_FILE} is not a host id"),
            )
        })?),
        Some(Err(e)) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => None,
    };
    let mut walk = Walk {
        builder,
        links: HashMap::new(),
        stats: CaptureStats::default(),
        skip: skip.iter().map(PathBuf::from).collect(),
        graft: graft.map(|g| (g.at.to_owned(), g.dir.to_owned())),
        base,
    };
    walk.dir(upper, Path::new(""))?;
    // A volume path the run never changed above (its parents are the
    // image's) is written last; unpacking makes the missing parents.
    if let Some((at, dir)) = walk.graft.take() {
        walk.grafted(&at, &dir)?;
    }
    walk.builder.into_inner()?.flush()?;
    Ok(walk.stats)
}

struct Walk<W: Write> {
    builder: tar::Builder<W>,
    /// Regular files with several links seen so far: (dev, ino) -> name.
    links: HashMap<(u64, u64), PathBuf>,
    stats: CaptureStats,
    skip: Vec<PathBuf>,
    /// Not yet written: where, and the tree.
    graft: Option<(PathBuf, PathBuf)>,
    /// The host id the tree's owners start from (see [`IDBASE_FILE`]).
    base: Option<u32>,
}

impl<W: Write> Walk<W> {
    fn dir(&mut self, dir: &Path, rel: &Path) -> io::Result<()> {
        let mut entries: Vec<_> = fs::read_dir(dir)?.collect::<Result<_, _>>()?;
        entries.sort_by_key(|e| e.file_name());
        for entry in entries {
            let name = entry.file_name();
            let at = rel.join(&name);
            if self.skip.contains(&at) {
                continue;
            }
            if self.graft.as_ref().is_some_and(|(g, _)| *g == at) {
                let (at, dir) = self.graft.take().expect("checked");
                self.grafted(&at, &dir)?;
                continue;
            }
            self.entry(&entry.path(), &at, &name)?;
        }
        Ok(())
    }

    /// Writes the tree `dir` at `rel` as an opaque directory.
    fn grafted(&mut self, rel: &Path, dir: &Path) -> io::Result<()> {
        let meta = fs::symlink_metadata(dir)?;
        let mut header = header_of(&meta);
        header.set_entry_type(tar::EntryType::Directory);
        self.append(&mut header, rel, io::empty())?;
        self.opaque_marker(rel, &meta)?;
        self.dir(dir, rel)
    }

    /// The OCI mark that directory `rel` hides the layers below.
    fn opaque_marker(&mut self, rel: &Path, meta: &fs::Metadata) -> io::Result<()> {
        let mut opq = tar::Header::new_gnu();
        opq.set_entry_type(tar::EntryType::Regular);
        opq.set_mode(0o644);
        opq.set_size(0);
        opq.set_mtime(meta.mtime().max(0) as u64);
        self.append(&mut opq, &rel.join(".wh..wh..opq"), io::empty())
    }

    fn entry(&mut self, path: &Path, rel: &Path, name: &OsStr) -> io::Result<()> {
        let meta = fs::symlink_metadata(path)?;
        let kind = meta.file_type();
        let mut header = header_of(&meta);
        if kind.is_char_device() && meta.rdev() == 0 {
            // A whiteout: the name is gone from the layers below.
            let mut wh = OsStr::new(".wh.").to_owned();
            wh.push(name);
            header.set_entry_type(tar::EntryType::Regular);
            header.set_mode(0o644);
            let at = rel.with_file_name(wh);
            return self.append(&mut header, &at, io::empty());
        }
        if kind.is_dir() {
            header.set_entry_type(tar::EntryType::Directory);
            self.user_xattrs(path)?;
            self.append(&mut header, rel, io::empty())?;
            if is_opaque(path) {
                self.opaque_marker(rel, &meta)?;
            }
            return self.dir(path, rel);
        }
        if kind.is_symlink() {
            header.set_entry_type(tar::EntryType::Symlink);
            let target = fs::read_link(path)?;
            self.unshift(&mut header)?;
            self.stats.entries += 1;
            return self.builder.append_link(&mut header, rel, target);
        }
        if kind.is_file() {
            if meta.nlink() > 1 {
                let key = (meta.dev(), meta.ino());
                if let Some(first) = self.links.get(&key).cloned() {
                    header.set_entry_type(tar::EntryType::Link);
                    self.unshift(&mut header)?;
                    self.stats.entries += 1;
                    return self.builder.append_link(&mut header, rel, first);
                }
                self.links.insert(key, rel.to_owned());
            }
            header.set_entry_type(tar::EntryType::Regular);
            header.set_size(meta.len());
            self.stats.bytes += meta.len();
            self.user_xattrs(path)?;
            let file = fs::File::open(path)?;
            return self.append(&mut header, rel, file);
        }
        if kind.is_char_device() || kind.is_block_device() || kind.is_fifo() {
            header.set_entry_type(if kind.is_char_device() {
                tar::EntryType::Char
            } else if kind.is_block_device() {
                tar::EntryType::Block
            } else {
                tar::EntryType::Fifo
            });
            let rdev = meta.rdev();
            header.set_device_major(rustix::fs::major(rdev))?;
            header.set_device_minor(rustix::fs::minor(rdev))?;
            return self.append(&mut header, rel, io::empty());
        }
        // Sockets: nothing to store.
        Ok(())
    }

    /// Writes `path`'s `user.*` extended attributes as a PAX header for
    /// the entry that follows (`SCHILY.xattr.<name>`, as GNU tar does);
    /// overlayfs' own (`trusted.*`) and the rest stay behind.
    fn user_xattrs(&mut self, path: &Path) -> io::Result<()> {
        let mut names = vec![0u8; 4096];
        let n = match rustix::fs::llistxattr(path, &mut names) {
            Ok(n) => n,
            // Too many to list in 4 KiB: more than any layer keeps.
            Err(rustix::io::Errno::RANGE) => return Ok(()),
            Err(rustix::io::Errno::NOTSUP) => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        let mut records: Vec<(String, Vec<u8>)> = Vec::new();
        for name in names[..n].split(|&b| b == 0).filter(|n| !n.is_empty()) {
            let Ok(name) = std::str::from_utf8(name) else {
                continue;
            };
            if !name.starts_with("user.") {
                continue;
            }
            let mut value = vec![0u8; 64 * 1024];
            match rustix::fs::lgetxattr(path, name, &mut value) {
                Ok(len) => {
                    value.truncate(len);
                    records.push((format!("SCHILY.xattr.{name}"), value));
                }
                // Removed since it was listed.
                Err(rustix::io::Errno::NODATA) => {}
                Err(e) => return Err(e.into()),
            }
        }
        if records.is_empty() {
            return Ok(());
        }
        self.builder
            .append_pax_extensions(records.iter().map(|(k, v)| (k.as_str(), v.as_slice())))
    }

    fn append(
        &mut self,
        header: &mut tar::Header,
        rel: &Path,
        data: impl io::Read,
    ) -> io::Result<()> {
        self.unshift(header)?;
        self.stats.entries += 1;
        self.builder.append_data(header, rel, data)
    }

    /// The entry's owner as the run saw it (see [`IDBASE_FILE`]).
    fn unshift(&self, header: &mut tar::Header) -> io::Result<()> {
        let Some(base) = self.base else {
            return Ok(());
        };
        let seen = |id: u64| match id.checked_sub(u64::from(base)) {
            Some(offset) if offset < u64::from(RANGE) => offset,
            _ => id,
        };
        // Markers (`.wh..wh..opq`) carry no owner at all.
        if let (Ok(uid), Ok(gid)) = (header.uid(), header.gid()) {
            header.set_uid(seen(uid));
            header.set_gid(seen(gid));
        }
        Ok(())
    }
}

/// A header with `meta`'s mode, owner and modification time, size 0.
fn header_of(meta: &fs::Metadata) -> tar::Header {
    let mut header = tar::Header::new_gnu();
    header.set_mode(meta.mode() & 0o7777);
    header.set_uid(u64::from(meta.uid()));
    header.set_gid(u64::from(meta.gid()));
    header.set_mtime(meta.mtime().max(0) as u64);
    header.set_size(0);
    header
}

fn is_opaque(dir: &Path) -> bool {
    let mut value = [0u8; 8];
    matches!(
        rustix::fs::lgetxattr(dir, OPAQUE_XATTR, &mut value),
        Ok(n) if value[..n] == *b"y"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_in_a_recorded_range_are_written_as_the_run_saw_them() {
        let dir = tempfile::tempdir().unwrap();
        let up = dir.path().join("upper");
        fs::create_dir_all(up.join("home")).unwrap();
        fs::write(up.join("home/mine"), b"x").unwrap();
        std::os::unix::fs::lchown(
            up.join("home/mine"),
            Some(300_000 + 1000),
            Some(300_000 + 5),
        )
        .unwrap();
        std::os::unix::fs::symlink("mine", up.join("home/link")).unwrap();
        std::os::unix::fs::lchown(up.join("home/link"), Some(300_000), Some(300_000)).unwrap();
        fs::write(up.join("host"), b"y").unwrap();
        // An opaque directory: its marker has no owner at all.
        fs::create_dir(up.join("fresh")).unwrap();
        rustix::fs::setxattr(
            up.join("fresh"),
            OPAQUE_XATTR,
            b"y",
            rustix::fs::XattrFlags::empty(),
        )
        .unwrap();
        fs::write(dir.path().join(IDBASE_FILE), "300000\n").unwrap();
        let mut tar = Vec::new();
        upper_to_tar(&up, &[], &mut tar).unwrap();
        let mut owners = std::collections::BTreeMap::new();
        for entry in tar::Archive::new(&tar[..]).entries().unwrap() {
            let entry = entry.unwrap();
            let h = entry.header();
            owners.insert(
                entry.path().unwrap().display().to_string(),
                (h.uid().unwrap_or(0), h.gid().unwrap_or(0)),
            );
        }
        assert_eq!(owners["home/mine"], (1000, 5));
        assert_eq!(owners["home/link"], (0, 0));
        // Outside the range (the host's root): as it is.
        assert_eq!(owners["host"], (0, 0));
        assert!(owners.contains_key("fresh/.wh..wh..opq"));
    }

    fn names(tar: &[u8]) -> Vec<String> {
        tar::Archive::new(tar)
            .entries()
            .unwrap()
            .map(|e| e.unwrap().path().unwrap().to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn a_graft_replaces_its_path_as_an_opaque_directory() {
        let dir = tempfile::tempdir().unwrap();
        let (up, vol) = (dir.path().join("upper"), dir.path().join("volume"));
        fs::create_dir_all(up.join("work")).unwrap();
        fs::create_dir_all(up.join("etc")).unwrap();
        fs::create_dir_all(vol.join("app")).unwrap();
        fs::write(vol.join("app/package.json"), b"{}").unwrap();
        let mut tar = Vec::new();
        let graft = Graft {
            at: Path::new("work"),
            dir: &vol,
        };
        upper_to_tar_with(&up, &[], Some(graft), &mut tar).unwrap();
        assert_eq!(
            names(&tar),
            [
                "etc",
                "work",
                "work/.wh..wh..opq",
                "work/app",
                "work/app/package.json"
            ]
        );
        // A path the upper lacks is written at the end.
        let mut tar = Vec::new();
        let graft = Graft {
            at: Path::new("src/app"),
            dir: &vol,
        };
        upper_to_tar_with(&up, &[], Some(graft), &mut tar).unwrap();
        assert_eq!(
            names(&tar),
            [
                "etc",
                "work",
                "src/app",
                "src/app/.wh..wh..opq",
                "src/app/app",
                "src/app/app/package.json"
            ]
        );
    }

    #[test]
    fn an_upper_directory_becomes_an_oci_layer() {
        let dir = tempfile::tempdir().unwrap();
        let up = dir.path();
        fs::create_dir_all(up.join("work/src")).unwrap();
        fs::write(up.join("work/src/a.txt"), b"hello").unwrap();
        fs::hard_link(up.join("work/src/a.txt"), up.join("work/b.txt")).unwrap();
        std::os::unix::fs::symlink("src/a.txt", up.join("work/link")).unwrap();
        fs::create_dir(up.join(".runbox")).unwrap();
        fs::write(up.join(".runbox/agent"), b"").unwrap();
        fs::create_dir(up.join("etc")).unwrap();
        fs::write(up.join("etc/resolv.conf"), b"").unwrap();
        // A whiteout and an opaque directory, as overlayfs makes them.
        rustix::fs::mknodat(
            rustix::fs::CWD,
            up.join("gone"),
            rustix::fs::FileType::CharacterDevice,
            rustix::fs::Mode::empty(),
            0,
        )
        .unwrap();
        fs::create_dir(up.join("fresh")).unwrap();
        rustix::fs::setxattr(
            up.join("fresh"),
            OPAQUE_XATTR,
            b"y",
            rustix::fs::XattrFlags::empty(),
        )
        .unwrap();
        let mut tar = Vec::new();
        let skip = [".runbox", "etc/resolv.conf"];
        let stats = upper_to_tar(up, &skip, &mut tar).unwrap();
        assert_eq!(stats.bytes, 5);
        let names = names(&tar);
        assert_eq!(
            names,
            [
                "etc",
                "fresh",
                "fresh/.wh..wh..opq",
                ".wh.gone",
                "work",
                "work/b.txt",
                "work/link",
                "work/src",
                "work/src/a.txt",
            ],
            "{names:?}"
        );
        let mut archive = tar::Archive::new(tar.as_slice());
        for entry in archive.entries().unwrap() {
            let entry = entry.unwrap();
            if entry.path().unwrap().ends_with("a.txt") {
                assert_eq!(entry.header().entry_type(), tar::EntryType::Link);
            }
        }
        // The same tree, the same bytes.
        let mut again = Vec::new();
        upper_to_tar(up, &skip, &mut again).unwrap();
        assert_eq!(tar, again);
    }
}
