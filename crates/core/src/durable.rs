//! Files that must survive a crash whole: written aside, flushed, renamed
//! over the old one, and the directory flushed, so a reader (or the next
//! start) sees the old contents or the new ones, never a mix.

use std::fs;
use std::io::{self, Write};
use std::path::Path;

/// Writes `value` as pretty JSON to `path` that way.
pub(crate) fn write_json(path: &Path, value: &impl serde::Serialize) -> io::Result<()> {
    write_json_mode(path, value, 0o666)
}

/// As [`write_json`], but the file is readable by its owner only (mode
/// 0600).
pub(crate) fn write_json_private(path: &Path, value: &impl serde::Serialize) -> io::Result<()> {
    write_json_mode(path, value, 0o600)
}

/// [`write_json`] with the file created with `mode` (less the umask).
fn write_json_mode(path: &Path, value: &impl serde::Serialize, mode: u32) -> io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let bytes = serde_json::to_vec_pretty(value).map_err(io::Error::other)?;
    let aside = path.with_extension("json.new");
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&aside)?;
    file.write_all(&bytes)?;
    file.sync_all()?;
    fs::rename(&aside, path)?;
    match path.parent() {
        Some(dir) => sync_dir(dir),
        None => Ok(()),
    }
}

/// Flushes a directory's entries (a rename or unlink in it) to disk.
pub(crate) fn sync_dir(dir: &Path) -> io::Result<()> {
    fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_write_replaces_the_file_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.json");
        super::write_json(&path, &vec![1, 2]).unwrap();
        super::write_json(&path, &vec![3]).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path)
                .unwrap()
                .split_whitespace()
                .collect::<String>(),
            "[3]"
        );
        assert!(!dir.path().join("x.json.new").exists());
    }
}
