//! Mounts every lane makes on the host: a run's overlay root, and the
//! questions about mounts that teardown asks.

use std::path::{Path, PathBuf};

use runbox_core::lane::LaneError;

/// Refuses paths that would corrupt an overlayfs option string.
pub fn check_mount_safe(path: &Path) -> Result<(), LaneError> {
    let s = path
        .to_str()
        .ok_or_else(|| LaneError::Failed(format!("{} is not UTF-8", path.display())))?;
    if !path.is_absolute() || s.contains([',', ':', '\n', '\\']) {
        return Err(LaneError::Failed(format!(
            "{s} must be an absolute path without ',', ':' or '\\' (overlayfs options cannot carry them)"
        )));
    }
    Ok(())
}

/// The kernel caps mount options at one page.
const MAX_MOUNT_OPTIONS: usize = 4095;

/// Mounts an overlay of `lowers` (base first) with `upper` and `work` at
/// `target`.
pub fn mount_overlay(
    lowers: &[PathBuf],
    upper: &Path,
    work: &Path,
    target: &Path,
) -> Result<(), LaneError> {
    if lowers.is_empty() {
        return Err(LaneError::Failed(
            "an image needs at least one layer".into(),
        ));
    }
    // overlayfs lists lower layers topmost first; images list them base first.
    let lowerdir: Vec<String> = lowers
        .iter()
        .rev()
        .map(|l| l.display().to_string())
        .collect();
    let options = format!(
        "lowerdir={},upperdir={},workdir={}",
        lowerdir.join(":"),
        upper.display(),
        work.display()
    );
    if options.len() > MAX_MOUNT_OPTIONS {
        return Err(LaneError::Failed(format!(
            "the image has too many layers ({}) for one overlay mount under this state directory; \
             use a shorter --state-dir or flatten the image",
            lowers.len()
        )));
    }
    let options = std::ffi::CString::new(options)
        .map_err(|_| LaneError::Failed("overlay options contain a NUL byte".into()))?;
    rustix::mount::mount(
        "overlay",
        target,
        "overlay",
        rustix::mount::MountFlags::empty(),
        Some(options.as_c_str()),
    )
    .map_err(|e| {
        LaneError::Failed(format!(
            "mounting the overlay root at {}: {e}",
            target.display()
        ))
    })
}

/// Whether something is mounted at `path` (it is the root of a mount,
/// bind mounts of the same device included): the kernel says so in one
/// `statx` (`STATX_ATTR_MOUNT_ROOT`, Linux 5.8), else /proc/self/mountinfo
/// is searched. (mountinfo alone made every check cost a read and parse of
/// every mount of the host: with hundreds of runs, most of the daemon's
/// time in a create and a teardown.)
pub fn is_mount_point(path: &Path) -> bool {
    use rustix::fs::{AtFlags, StatxAttributes, StatxFlags, CWD};
    match rustix::fs::statx(
        CWD,
        path,
        AtFlags::NO_AUTOMOUNT | AtFlags::SYMLINK_NOFOLLOW,
        StatxFlags::empty(),
    ) {
        Ok(st) if st.stx_attributes_mask.contains(StatxAttributes::MOUNT_ROOT) => {
            st.stx_attributes.contains(StatxAttributes::MOUNT_ROOT)
        }
        Ok(_) | Err(rustix::io::Errno::NOSYS) => in_mountinfo(path),
        Err(_) => false,
    }
}

/// Whether /proc/self/mountinfo lists a mount at `path`.
fn in_mountinfo(path: &Path) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let Some(wanted) = path.to_str() else {
        return false;
    };
    info.lines()
        .any(|line| line.split(' ').nth(4).map(unescape_mountinfo).as_deref() == Some(wanted))
}

/// Undoes mountinfo's octal escapes (`\040` for a space, ...).
fn unescape_mountinfo(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && bytes[i + 1..i + 4]
                .iter()
                .all(|b| (b'0'..=b'7').contains(b))
        {
            let value =
                (bytes[i + 1] - b'0') * 64 + (bytes[i + 2] - b'0') * 8 + (bytes[i + 3] - b'0');
            out.push(value);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes() {
        assert_eq!(unescape_mountinfo("/a\\040b"), "/a b");
        assert_eq!(unescape_mountinfo("/plain"), "/plain");
        assert_eq!(unescape_mountinfo("/odd\\04"), "/odd\\04");
    }

    /// The kernel's answer and mountinfo's agree: on mounts, on plain
    /// directories, on a bind mount of a directory onto another of the
    /// same file system (as root), and on what does not exist.
    #[test]
    fn a_mount_point_is_told_the_same_by_statx_and_mountinfo() {
        for (path, mounted) in [("/proc", true), ("/sys", true), ("/proc/self", false)] {
            let path = Path::new(path);
            assert_eq!(is_mount_point(path), mounted, "{}", path.display());
            assert_eq!(in_mountinfo(path), mounted, "{}", path.display());
        }
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::create_dir(&a).unwrap();
        std::fs::create_dir(&b).unwrap();
        assert!(!is_mount_point(&b) && !in_mountinfo(&b));
        assert!(!is_mount_point(&dir.path().join("missing")));
        if !rustix::process::geteuid().is_root() {
            return;
        }
        rustix::mount::mount_bind(&a, &b).unwrap();
        let (kernel, listed) = (is_mount_point(&b), in_mountinfo(&b));
        rustix::mount::unmount(&b, rustix::mount::UnmountFlags::DETACH).unwrap();
        assert!(kernel && listed);
        assert!(!is_mount_point(&a));
    }

    #[test]
    fn overlay_unsafe_paths_are_refused() {
        assert!(check_mount_safe(Path::new("/var/lib/runbox")).is_ok());
        for bad in ["relative", "/a,b", "/a:b", "/a\\b"] {
            assert!(check_mount_safe(Path::new(bad)).is_err(), "{bad}");
        }
    }
}
