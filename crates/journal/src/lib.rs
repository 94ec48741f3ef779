//! An append-only file of lines (JSON lines, in practice) rotated by size
//! with one backup: `<name>` and `<name>.1`. The audit log writes through
//! it one record at a time, the usage journal in batches that it flushes
//! to disk, so a crash loses at most the batch being written.
//!
//! A line is never split across the two files: the live file is rotated
//! before a write would take it past the limit. Errors are logged and
//! returned, never panics; a file that cannot be rotated keeps growing
//! rather than losing lines.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The file and its backup. Cheap to share behind an `Arc`; appends are
/// serialised.
pub struct Journal {
    /// The live file.
    path: PathBuf,
    /// The one backup, `<path>.1`.
    backup: PathBuf,
    /// Rotate before a write would take the live file past this size.
    max_bytes: u64,
    /// The open file and its size, held together so the size check and the
    /// write are one step.
    state: Mutex<LiveFile>,
}

/// The live file and how many bytes it holds.
struct LiveFile {
    file: File,
    size: u64,
}

/// Opens `path` for appending, creating it owner-only (journals name runs,
/// tenants, hosts and API paths).
fn open_append(path: &Path) -> std::io::Result<LiveFile> {
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(path)?;
    let size = file.metadata()?.len();
    Ok(LiveFile { file, size })
}

impl Journal {
    /// Opens (appending) or creates `path`; rotates to `<path>.1` when a
    /// write would take it past `max_bytes`.
    pub fn open(path: PathBuf, max_bytes: u64) -> std::io::Result<Journal> {
        let mut state = open_append(&path)?;
        // A line a crash cut short stays a line of its own (readers skip
        // it) rather than running into the next one.
        if state.size > 0 && !ends_with_newline(&path)? {
            state.file.write_all(b"\n")?;
            state.size += 1;
        }
        Ok(Journal {
            backup: backup_of(&path),
            path,
            max_bytes,
            state: Mutex::new(state),
        })
    }

    /// The live file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The backup's path.
    pub fn backup(&self) -> &Path {
        &self.backup
    }

    /// Appends `lines` (each without its newline), in order, as one write
    /// where they fit; with `sync`, flushed to disk before returning.
    pub fn append(&self, lines: &[Vec<u8>], sync: bool) -> std::io::Result<()> {
        if lines.is_empty() {
            return Ok(());
        }
        // A panic elsewhere while the lock was held leaves the file and size
        // as consistent as any failed write does; keep writing.
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let mut chunk: Vec<u8> = Vec::new();
        for line in lines {
            let len = line.len() as u64 + 1;
            let pending = chunk.len() as u64;
            if state.size + pending > 0 && state.size + pending + len > self.max_bytes {
                self.write(&mut state, &chunk)?;
                chunk.clear();
                self.rotate(&mut state);
            }
            chunk.extend_from_slice(line);
            chunk.push(b'\n');
        }
        self.write(&mut state, &chunk)?;
        if sync {
            state.file.sync_data()?;
        }
        Ok(())
    }

    fn write(&self, state: &mut LiveFile, bytes: &[u8]) -> std::io::Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        match state.file.write_all(bytes) {
            Ok(()) => {
                state.size += bytes.len() as u64;
                Ok(())
            }
            Err(e) => {
                tracing::warn!(path = %self.path.display(), error = %e, "cannot write to the journal");
                // A partial write moved the end of the file; re-read it so
                // rotation keeps working from the real size.
                if let Ok(meta) = state.file.metadata() {
                    state.size = meta.len();
                }
                Err(e)
            }
        }
    }

    /// Moves the live file to the backup (replacing an older one) and starts
    /// a new live file. On failure the current file stays in use: one
    /// oversized file is better than lost lines.
    fn rotate(&self, state: &mut LiveFile) {
        // What was written reaches the disk before it becomes the backup.
        let _ = state.file.sync_data();
        if let Err(e) = std::fs::rename(&self.path, &self.backup) {
            tracing::warn!(path = %self.path.display(), error = %e, "cannot rotate the journal");
            return;
        }
        match open_append(&self.path) {
            Ok(fresh) => *state = fresh,
            Err(e) => {
                // The old handle still points at the renamed file; writing
                // there keeps the lines, in the backup.
                tracing::warn!(path = %self.path.display(), error = %e, "cannot start a new journal file");
            }
        }
    }
}

fn ends_with_newline(path: &Path) -> std::io::Result<bool> {
    use std::io::{Read, Seek, SeekFrom};
    let mut file = File::open(path)?;
    file.seek(SeekFrom::End(-1))?;
    let mut last = [0u8; 1];
    file.read_exact(&mut last)?;
    Ok(last[0] == b'\n')
}

/// `<path>.1`.
pub fn backup_of(path: &Path) -> PathBuf {
    let mut backup = path.to_path_buf().into_os_string();
    backup.push(".1");
    PathBuf::from(backup)
}

/// The lines of the backup then the live file, oldest first: what a
/// reader of the whole journal reads. A last line cut short by a crash is
/// left out.
pub fn read_lines(path: &Path) -> std::io::Result<Vec<String>> {
    let mut lines = Vec::new();
    for file in [backup_of(path), path.to_path_buf()] {
        let text = match std::fs::read(&file) {
            Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        let complete = text.ends_with('\n');
        let mut these: Vec<String> = text.lines().map(str::to_owned).collect();
        if !complete {
            these.pop();
        }
        lines.extend(these);
    }
    Ok(lines)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn line(i: usize) -> Vec<u8> {
        format!("{{\"n\":{i:06}}}").into_bytes()
    }

    #[test]
    fn rotates_between_whole_lines_and_reads_back_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j.jsonl");
        let per_line = line(0).len() as u64 + 1;
        let journal = Journal::open(path.clone(), per_line * 5).unwrap();
        // One batch that crosses the limit, then single lines.
        journal
            .append(&(0..7).map(line).collect::<Vec<_>>(), true)
            .unwrap();
        for i in 7..9 {
            journal.append(&[line(i)], false).unwrap();
        }
        let read: Vec<String> = read_lines(&path).unwrap();
        let want: Vec<String> = (0..9)
            .map(|i| String::from_utf8(line(i)).unwrap())
            .collect();
        assert_eq!(read, want);
        assert!(std::fs::metadata(&path).unwrap().len() <= per_line * 5);
        assert!(std::fs::metadata(backup_of(&path)).unwrap().len() <= per_line * 5);
        // A second rotation replaces the backup: only two files ever.
        for i in 9..20 {
            journal.append(&[line(i)], false).unwrap();
        }
        let names = std::fs::read_dir(dir.path()).unwrap().count();
        assert_eq!(names, 2);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    #[test]
    fn a_line_cut_by_a_crash_is_left_out() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j.jsonl");
        std::fs::write(&path, "{\"a\":1}\n{\"b\":").unwrap();
        assert_eq!(read_lines(&path).unwrap(), vec!["{\"a\":1}".to_owned()]);
        // Reopened, the cut line is closed off and the next one is whole.
        let journal = Journal::open(path.clone(), 1 << 20).unwrap();
        journal.append(&[b"{\"c\":3}".to_vec()], true).unwrap();
        assert_eq!(
            read_lines(&path).unwrap(),
            vec!["{\"a\":1}", "{\"b\":", "{\"c\":3}"]
        );
    }
}
