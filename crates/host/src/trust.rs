//! The CA certificates a run trusts when the daemon adds some of its own
//! (the egress proxy's interception CA).
//!
//! Owns two files in the run directory and where they appear in the run:
//!
//! ```text
//! <run dir>/trust.pem  image bundle + "\n" + extra PEM  -> TRUST_BUNDLE_PATH (read-only)
//! <run dir>/ca.pem     extra PEM only                   -> EXTRA_CA_PATH     (read-only)
//! ```
//!
//! The image's bundle is read from the run's merged root, which is
//! attacker-controlled data: every path in it is resolved with `openat2`
//! and `RESOLVE_IN_ROOT`, so a symlink to `/etc/shadow` means the image's
//! own `/etc/shadow`, never the host's; it must be a regular file (a device
//! node is never opened on the host) no larger than [`MAX_IMAGE_BUNDLE`].
//!
//! It does not decide which environment variables point at these files;
//! the daemon does (`SSL_CERT_FILE`, `REQUESTS_CA_BUNDLE` and
//! `CURL_CA_BUNDLE` to [`TRUST_BUNDLE_PATH`]; `NODE_EXTRA_CA_CERTS`, which
//! Node adds to its built-in roots, to [`EXTRA_CA_PATH`]).

use std::io::{self, Read};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{FileType, Mode, OFlags, ResolveFlags};

pub use runbox_core::lane::{EXTRA_CA_PATH, TRUST_BUNDLE_PATH};

/// The largest image bundle read. Debian's is about 220 KiB; anything near
/// this is not a CA bundle.
pub const MAX_IMAGE_BUNDLE: u64 = 8 << 20;

/// Why the trust files could not be prepared.
#[derive(Debug, thiserror::Error)]
pub enum TrustError {
    /// The image's bundle exists but could not be read.
    #[error("reading the image's {TRUST_BUNDLE_PATH}")]
    Read(#[source] io::Error),
    /// Writing one of the run's trust files failed.
    #[error("writing {}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
}

/// The host paths of a run's trust files.
#[derive(Clone, Debug)]
pub struct TrustFiles {
    /// Image bundle plus the extra PEM, for [`TRUST_BUNDLE_PATH`].
    pub bundle: PathBuf,
    /// The extra PEM alone, for [`EXTRA_CA_PATH`].
    pub extra: PathBuf,
}

/// Writes `trust.pem` and `ca.pem` into `run_dir` from the image bundle found
/// in `rootfs` (empty when the image has none) and `extra_pem`.
pub fn write_trust_files(
    run_dir: &Path,
    rootfs: &Path,
    extra_pem: &str,
) -> Result<TrustFiles, TrustError> {
    let relative = TRUST_BUNDLE_PATH.trim_start_matches('/');
    let mut bundle = read_in_root(rootfs, relative, MAX_IMAGE_BUNDLE)
        .map_err(TrustError::Read)?
        .unwrap_or_default();
    bundle.push(b'\n');
    bundle.extend_from_slice(extra_pem.as_bytes());
    let files = TrustFiles {
        bundle: run_dir.join("trust.pem"),
        extra: run_dir.join("ca.pem"),
    };
    write_public(&files.bundle, &bundle)?;
    write_public(&files.extra, extra_pem.as_bytes())?;
    Ok(files)
}

/// Writes a file every user in the run may read (the mount shows the file's
/// own mode, and non-root programs verify TLS too).
fn write_public(path: &Path, data: &[u8]) -> Result<(), TrustError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let write = || -> io::Result<()> {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o644)
            .open(path)?;
        file.write_all(data)
    };
    write().map_err(|source| TrustError::Write {
        path: path.to_path_buf(),
        source,
    })
}

/// Reads `path` (relative, resolved as if `root` were `/`) from the tree at
/// `root`, at most `max_len` bytes. `Ok(None)` when it does not exist.
///
/// Symlinks, absolute ones included, and `..` cannot leave `root`; magic
/// links (`/proc/self/...`) and other mounts are refused. Anything but a
/// regular file is an error, and is never opened for reading: opening a
/// device node can have effects of its own.
pub fn read_in_root(root: &Path, path: &str, max_len: u64) -> io::Result<Option<Vec<u8>>> {
    let dir = rustix::fs::open(
        root,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let found = rustix::fs::openat2(
        &dir,
        path,
        OFlags::PATH | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS | ResolveFlags::NO_XDEV,
    );
    let handle = match found {
        Ok(fd) => fd,
        // ENOTDIR: a path component is a file, so the bundle is not there.
        Err(e) if e == rustix::io::Errno::NOENT || e == rustix::io::Errno::NOTDIR => {
            return Ok(None)
        }
        Err(e) => return Err(e.into()),
    };
    let stat = rustix::fs::fstat(&handle)?;
    if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{path} is not a regular file"),
        ));
    }
    if stat.st_size as u64 > max_len {
        return Err(too_large(path, max_len));
    }
    // Re-open the very inode the O_PATH handle found, for reading; the path
    // is never looked up again.
    let readable: OwnedFd = rustix::fs::open(
        format!("/proc/self/fd/{}", handle.as_raw_fd()),
        OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOCTTY,
        Mode::empty(),
    )?;
    let mut data = Vec::new();
    std::fs::File::from(readable)
        .take(max_len + 1)
        .read_to_end(&mut data)?;
    // The size check above is advisory: a file can grow between fstat and read.
    if data.len() as u64 > max_len {
        return Err(too_large(path, max_len));
    }
    Ok(Some(data))
}

fn too_large(path: &str, max_len: u64) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("{path} is larger than {max_len} bytes"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    const BUNDLE: &str = "etc/ssl/certs/ca-certificates.crt";

    fn root_with(setup: impl FnOnce(&Path)) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("etc/ssl/certs")).unwrap();
        std::fs::write(dir.path().join("etc/hostname"), "inside-the-image\n").unwrap();
        setup(dir.path());
        dir
    }

    #[test]
    fn reads_a_regular_bundle() {
        let root = root_with(|r| std::fs::write(r.join(BUNDLE), "IMAGE CERTS\n").unwrap());
        let got = read_in_root(root.path(), BUNDLE, 100).unwrap();
        assert_eq!(got.as_deref(), Some(&b"IMAGE CERTS\n"[..]));
    }

    #[test]
    fn a_missing_bundle_is_none() {
        let root = root_with(|_| {});
        assert_eq!(read_in_root(root.path(), BUNDLE, 100).unwrap(), None);
        // A file where a directory should be.
        assert_eq!(
            read_in_root(root.path(), "etc/hostname/x", 100).unwrap(),
            None
        );
        // A dangling symlink.
        let root = root_with(|r| symlink("/nonexistent", r.join(BUNDLE)).unwrap());
        assert_eq!(read_in_root(root.path(), BUNDLE, 100).unwrap(), None);
    }

    #[test]
    fn symlinks_resolve_inside_the_root() {
        for target in [
            "/etc/hostname",
            "../../../../../../../../etc/hostname",
            "/../../etc/hostname",
        ] {
            let root = root_with(|r| symlink(target, r.join(BUNDLE)).unwrap());
            let got = read_in_root(root.path(), BUNDLE, 100).unwrap();
            assert_eq!(got.as_deref(), Some(&b"inside-the-image\n"[..]), "{target}");
        }
    }

    #[test]
    fn magic_links_are_refused() {
        let root = root_with(|r| symlink("/proc/self/root/etc/hostname", r.join(BUNDLE)).unwrap());
        // Inside the root there is no /proc, so this is simply absent; the
        // magic link itself is refused when the root has a real /proc.
        assert_eq!(read_in_root(root.path(), BUNDLE, 100).unwrap(), None);
        let proc_root = Path::new("/proc");
        assert!(read_in_root(proc_root, "self/root/etc/hostname", 100).is_err());
    }

    #[test]
    fn only_regular_files_within_the_cap_are_read() {
        let root = root_with(|r| {
            rustix::fs::mknodat(
                rustix::fs::CWD,
                r.join(BUNDLE),
                FileType::Fifo,
                Mode::from_raw_mode(0o644),
                0,
            )
            .unwrap()
        });
        // A FIFO would block a reader forever; it is refused without opening.
        let err = read_in_root(root.path(), BUNDLE, 100).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);

        let root = root_with(|r| std::fs::create_dir(r.join(BUNDLE)).unwrap());
        assert!(read_in_root(root.path(), BUNDLE, 100).is_err());

        let root = root_with(|r| std::fs::write(r.join(BUNDLE), vec![b'x'; 101]).unwrap());
        let err = read_in_root(root.path(), BUNDLE, 100).unwrap_err();
        assert!(err.to_string().contains("larger than"), "{err}");
        assert!(read_in_root(root.path(), BUNDLE, 101).is_ok());
    }

    #[test]
    fn trust_files_hold_image_bundle_then_extra() {
        let root = root_with(|r| std::fs::write(r.join(BUNDLE), "IMAGE").unwrap());
        let run = tempfile::tempdir().unwrap();
        let files = write_trust_files(run.path(), root.path(), "EXTRA\n").unwrap();
        assert_eq!(std::fs::read(&files.bundle).unwrap(), b"IMAGE\nEXTRA\n");
        assert_eq!(std::fs::read(&files.extra).unwrap(), b"EXTRA\n");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&files.bundle)
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o644);

        let empty = root_with(|_| {});
        let files = write_trust_files(run.path(), empty.path(), "EXTRA\n").unwrap();
        assert_eq!(std::fs::read(&files.bundle).unwrap(), b"\nEXTRA\n");
    }
}
