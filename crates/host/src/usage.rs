//! What a run uses now, read from the cgroup the runtime placed it under
//! (`/runbox/<id>`): cgroup v1's `cpuacct.usage` and `memory.usage_in_bytes`
//! (with `memory.stat`'s `cache`), or v2's `cpu.stat` and `memory.current`
//! (with `memory.stat`'s `file`). Plain file reads, cheap enough for every
//! metrics call.

use std::path::Path;

use runbox_core::lane::Usage;
use ulid::Ulid;

fn read_u64(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// The value of `key` in a flat keyed file (`memory.stat`, `cpu.stat`).
fn keyed(path: &Path, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines().find_map(|line| {
        let (k, v) = line.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok())?
    })
}

/// Run `id`'s usage, or None when its cgroup is not there (gone, or a
/// layout this reader does not know).
pub fn of(id: Ulid) -> Option<Usage> {
    let v1_memory = Path::new("/sys/fs/cgroup/memory/runbox").join(id.to_string());
    if v1_memory.is_dir() {
        let cpu = Path::new("/sys/fs/cgroup/cpuacct/runbox").join(id.to_string());
        return Some(Usage {
            cpu_ns: read_u64(&cpu.join("cpuacct.usage"))?,
            memory_bytes: read_u64(&v1_memory.join("memory.usage_in_bytes"))?,
            memory_cache_bytes: keyed(&v1_memory.join("memory.stat"), "cache").unwrap_or(0),
            memory_peak_bytes: read_u64(&v1_memory.join("memory.max_usage_in_bytes")),
        });
    }
    let v2 = Path::new("/sys/fs/cgroup/runbox").join(id.to_string());
    if v2.join("memory.current").exists() {
        return Some(Usage {
            cpu_ns: keyed(&v2.join("cpu.stat"), "usage_usec")?.saturating_mul(1000),
            memory_bytes: read_u64(&v2.join("memory.current"))?,
            memory_cache_bytes: keyed(&v2.join("memory.stat"), "file").unwrap_or(0),
            memory_peak_bytes: read_u64(&v2.join("memory.peak")),
        });
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keyed_files_are_read_by_key() {
        let dir = tempfile::tempdir().unwrap();
        let stat = dir.path().join("memory.stat");
        std::fs::write(&stat, "rss 10\ncache 4096\nmapped_file 0\n").unwrap();
        assert_eq!(keyed(&stat, "cache"), Some(4096));
        assert_eq!(keyed(&stat, "ca"), None);
        assert_eq!(keyed(&dir.path().join("missing"), "cache"), None);
        assert!(of(Ulid::new()).is_none());
    }
}
