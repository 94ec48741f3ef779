//! User metadata kept as extended attributes: set on a file as it is
//! written, read back with a stat or a listing.
//!
//! Only the `user.` namespace is ever written (`trusted.` and `security.`
//! change what the kernel does with a file), and only regular files and
//! directories are read: the kernel keeps no `user.` attributes on
//! symlinks, and opening anything else (a FIFO, a device) to read them
//! could block or have effects.

use std::collections::HashMap;
use std::os::fd::AsFd;

use rustix::buffer::spare_capacity;
use rustix::fs::{FileType, Mode, OFlags, XattrFlags};
use rustix::io::Errno;

use crate::FileError;

/// The most attributes one write may set.
pub const MAX_XATTRS: usize = 64;

/// The longest attribute name the kernel takes (`XATTR_NAME_MAX`).
pub const MAX_NAME: usize = 255;

/// The longest value one write may set.
pub const MAX_VALUE: usize = 4096;

/// The namespace writes are confined to.
const WRITABLE: &str = "user.";

/// Checks a write's attributes before anything is made.
pub fn check(xattrs: &HashMap<String, String>) -> Result<(), FileError> {
    if xattrs.len() > MAX_XATTRS {
        return Err(FileError::InvalidRequest(
            "a write sets at most 64 extended attributes",
        ));
    }
    for (name, value) in xattrs {
        if !name.starts_with(WRITABLE) || name.len() == WRITABLE.len() {
            return Err(FileError::InvalidRequest(
                "extended attribute names must be user.<name>",
            ));
        }
        if name.len() > MAX_NAME || name.contains('\0') {
            return Err(FileError::InvalidRequest(
                "extended attribute names are at most 255 bytes, without NUL",
            ));
        }
        if value.len() > MAX_VALUE {
            return Err(FileError::InvalidRequest(
                "extended attribute values are at most 4096 bytes",
            ));
        }
    }
    Ok(())
}

/// Sets checked attributes on an open file.
pub fn set(fd: impl AsFd, xattrs: &HashMap<String, String>) -> Result<(), Errno> {
    for (name, value) in xattrs {
        rustix::fs::fsetxattr(&fd, name.as_str(), value.as_bytes(), XattrFlags::empty())?;
    }
    Ok(())
}

/// The attributes of `dir/name` whose names start with `prefix`, when it
/// is a regular file or a directory (`kind`, from a stat without
/// following). A filesystem without extended attributes has none.
pub fn read(
    dir: impl AsFd,
    name: &str,
    kind: FileType,
    prefix: &str,
) -> Result<HashMap<String, String>, Errno> {
    let mut out = HashMap::new();
    if prefix.is_empty() || !matches!(kind, FileType::RegularFile | FileType::Directory) {
        return Ok(out);
    }
    // NOFOLLOW and NONBLOCK: whatever replaced the entry since its stat
    // (a symlink, a FIFO) is neither followed nor waited on.
    let fd = match rustix::fs::openat(
        &dir,
        name,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY,
        Mode::empty(),
    ) {
        Ok(fd) => fd,
        Err(Errno::LOOP | Errno::NXIO) => return Ok(out),
        Err(e) => return Err(e),
    };
    let names = match list(&fd) {
        Ok(names) => names,
        Err(Errno::NOTSUP) => return Ok(out),
        Err(e) => return Err(e),
    };
    for raw in names.split(|b| *b == 0).filter(|n| !n.is_empty()) {
        let Ok(attr) = std::str::from_utf8(raw) else {
            continue;
        };
        if !attr.starts_with(prefix) {
            continue;
        }
        let mut value = Vec::with_capacity(MAX_VALUE);
        match rustix::fs::fgetxattr(&fd, attr, spare_capacity(&mut value)) {
            Ok(_) => {}
            // Removed since the listing, or larger than any value set here.
            Err(Errno::NODATA | Errno::RANGE) => continue,
            Err(e) => return Err(e),
        }
        out.insert(
            attr.to_owned(),
            String::from_utf8_lossy(&value).into_owned(),
        );
    }
    Ok(out)
}

/// The NUL-separated attribute names of an open file. The list may grow
/// between sizing and reading it; a few tries absorb that.
fn list(fd: impl AsFd) -> Result<Vec<u8>, Errno> {
    for _ in 0..3 {
        let len = rustix::fs::flistxattr_query(&fd)?;
        if len == 0 {
            return Ok(Vec::new());
        }
        let mut names = Vec::with_capacity(len);
        match rustix::fs::flistxattr(&fd, spare_capacity(&mut names)) {
            Ok(_) => return Ok(names),
            Err(Errno::RANGE) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(Errno::RANGE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_user_attributes_of_bounded_size_are_written() {
        let one = |k: &str, v: &str| HashMap::from([(k.to_owned(), v.to_owned())]);
        assert!(check(&one("user.e2b.author", "mish")).is_ok());
        for (k, v) in [
            ("trusted.x", "v"),
            ("security.selinux", "v"),
            ("user.", "v"),
            ("userx", "v"),
        ] {
            assert!(check(&one(k, v)).is_err(), "{k}");
        }
        assert!(check(&one(&format!("user.{}", "a".repeat(300)), "v")).is_err());
        assert!(check(&one("user.big", &"v".repeat(MAX_VALUE + 1))).is_err());
        let many: HashMap<_, _> = (0..=MAX_XATTRS)
            .map(|i| (format!("user.k{i}"), String::new()))
            .collect();
        assert!(check(&many).is_err());
    }
}
