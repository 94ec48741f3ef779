//! Locating the static runbox-agent binary that every run gets as PID 1.

use std::io::Read;
use std::path::{Path, PathBuf};

/// Where to look for the agent, first match wins: an explicit path, then
/// `runbox-agent` beside the running executable, then the static build
/// output of a development checkout (`target/x86_64-unknown-linux-gnu/...`).
pub fn locate(explicit: Option<&Path>) -> Result<PathBuf, String> {
    if let Some(path) = explicit {
        check(path)?;
        // The path goes into bind mounts, which need it absolute.
        return path
            .canonicalize()
            .map_err(|e| format!("{}: {e}", path.display()));
    }
    let exe =
        std::env::current_exe().map_err(|e| format!("cannot find the running executable: {e}"))?;
    let dir = exe.parent().unwrap_or(Path::new("/"));
    let mut candidates = vec![dir.join("runbox-agent")];
    // target/debug/runbox -> target/x86_64-unknown-linux-gnu/{debug,release}/runbox-agent
    if let Some(target) = dir.parent() {
        for profile in ["release", "debug"] {
            candidates.push(
                target
                    .join("x86_64-unknown-linux-gnu")
                    .join(profile)
                    .join("runbox-agent"),
            );
        }
    }
    let mut tried = Vec::new();
    for candidate in &candidates {
        match check(candidate) {
            Ok(()) => return Ok(candidate.clone()),
            Err(e) => tried.push(e),
        }
    }
    Err(format!(
        "no usable runbox-agent binary ({}); build it with `scripts/build-agent` or pass --agent PATH",
        tried.join("; ")
    ))
}

/// The agent must be a statically linked ELF executable: it runs inside
/// arbitrary images that may have no C library at all.
fn check(path: &Path) -> Result<(), String> {
    let mut file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut head = Vec::with_capacity(64 * 1024);
    file.by_ref()
        .take(64 * 1024)
        .read_to_end(&mut head)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if has_interpreter(&head)
        .ok_or_else(|| format!("{}: not a 64-bit ELF executable", path.display()))?
    {
        return Err(format!(
            "{}: dynamically linked; the agent must be built static",
            path.display()
        ));
    }
    Ok(())
}

/// Whether a 64-bit little-endian ELF image asks for a program interpreter
/// (that is, is dynamically linked). None when it is not such an image.
///
/// Hand-written rather than pulling an ELF crate: it reads three header
/// fields and one field per program header.
fn has_interpreter(elf: &[u8]) -> Option<bool> {
    const PT_INTERP: u32 = 3;
    if elf.get(..4)? != b"\x7fELF" || *elf.get(4)? != 2 || *elf.get(5)? != 1 {
        return None;
    }
    let u16_at = |o: usize| Some(u16::from_le_bytes(elf.get(o..o + 2)?.try_into().ok()?));
    let phoff = u64::from_le_bytes(elf.get(0x20..0x28)?.try_into().ok()?) as usize;
    let phentsize = u16_at(0x36)? as usize;
    let phnum = u16_at(0x38)? as usize;
    for i in 0..phnum {
        let at = phoff.checked_add(i.checked_mul(phentsize)?)?;
        let kind = u32::from_le_bytes(elf.get(at..at + 4)?.try_into().ok()?);
        if kind == PT_INTERP {
            return Some(true);
        }
    }
    Some(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dynamic_binaries_are_recognised() {
        let sh = std::fs::read("/bin/sh").unwrap();
        assert_eq!(has_interpreter(&sh), Some(true));
        assert_eq!(has_interpreter(b"#!/bin/sh\n"), None);
        assert_eq!(has_interpreter(b""), None);
        assert!(check(Path::new("/bin/sh")).is_err());
    }
}
