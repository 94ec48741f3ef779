//! Fuzz target: arbitrary bytes as one layer's tar stream.
//!
//! Each input is unpacked into `base/dest` of a fresh temporary directory
//! that also holds an empty `sentinel` directory and a `victim` file. Any
//! error is fine; what must never happen is:
//! * anything written next to `dest` (new names in `base`, anything in
//!   `sentinel`, `victim` changed or hard-linked),
//! * a device node other than an overlayfs whiteout (0:0), or a FIFO or a
//!   socket, appearing under `dest`,
//! * an error whose rule name is not one of the documented ones,
//! * a panic, a hang or an out-of-memory.
//!
//! Escapes to absolute paths elsewhere on the machine cannot be seen from
//! here; `run.sh` runs the fuzzer with the rest of the filesystem mounted
//! read-only so such a bug fails loudly instead of damaging the host.

#![no_main]

use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

use libfuzzer_sys::fuzz_target;
use runbox_image::unpack::{unpack_layer, UnpackLimits};

/// Every rule [`runbox_image::unpack::UnpackError::rule`] may return.
const RULES: &[&str] = &[
    "absolute_path",
    "parent_dir",
    "nul_byte",
    "path_too_long",
    "symlink_parent",
    "hardlink_outside",
    "too_large",
    "too_many_entries",
    "bad_whiteout",
    "corrupt",
    "io",
];

const VICTIM_TEXT: &[u8] = b"victim";

fuzz_target!(|data: &[u8]| {
    // Header checksums would stop almost every mutation at the first
    // header; fixing them lets the fuzzer reach the unpacking logic.
    let mut layer = data.to_vec();
    fix_checksums(&mut layer);

    let base = tempfile::Builder::new()
        .prefix("runbox-fuzz-")
        .tempdir()
        .expect("creating a temporary directory");
    let dest = base.path().join("dest");
    let sentinel = base.path().join("sentinel");
    let victim = base.path().join("victim");
    fs::create_dir(&dest).unwrap();
    fs::create_dir(&sentinel).unwrap();
    fs::write(&victim, VICTIM_TEXT).unwrap();

    let limits = UnpackLimits {
        max_bytes: 16 << 20,
        max_entries: 10_000,
        max_path_bytes: 4096,
    };
    if let Err(err) = unpack_layer(&layer[..], &dest, &limits) {
        assert!(RULES.contains(&err.rule()), "unknown rule {:?}", err.rule());
        assert!(!err.to_string().is_empty());
    }

    let mut names: Vec<_> = fs::read_dir(base.path())
        .unwrap()
        .map(|entry| entry.unwrap().file_name())
        .collect();
    names.sort();
    assert_eq!(names, ["dest", "sentinel", "victim"], "wrote next to dest");
    assert_eq!(
        fs::read_dir(&sentinel).unwrap().count(),
        0,
        "wrote into sentinel"
    );
    assert_eq!(fs::read(&victim).unwrap(), VICTIM_TEXT, "changed victim");
    assert_eq!(
        fs::metadata(&victim).unwrap().nlink(),
        1,
        "hard-linked victim"
    );
    check_tree(&dest);
});

/// Walks `dir` without following symlinks and checks that only whiteout
/// devices exist among special files.
fn check_tree(dir: &Path) {
    for entry in fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        let meta = fs::symlink_metadata(entry.path()).unwrap();
        let kind = meta.file_type();
        if kind.is_dir() {
            check_tree(&entry.path());
        } else if kind.is_char_device() {
            assert_eq!(meta.rdev(), 0, "device node {:?}", entry.path());
        } else {
            assert!(
                !kind.is_block_device() && !kind.is_fifo() && !kind.is_socket(),
                "special file {:?}",
                entry.path()
            );
        }
    }
}

/// Walks the archive the way a tar reader would (a header, then its data
/// rounded up to 512 bytes) and rewrites each header's checksum. Stops at
/// the first all-zero block or a size it cannot read.
fn fix_checksums(tar: &mut [u8]) {
    let mut at = 0usize;
    while at + 512 <= tar.len() {
        let header = &mut tar[at..at + 512];
        if header.iter().all(|&b| b == 0) {
            return;
        }
        header[148..156].fill(b' ');
        let sum: u32 = header.iter().map(|&b| u32::from(b)).sum();
        let text = format!("{sum:06o}\0 ");
        header[148..156].copy_from_slice(&text.as_bytes()[..8]);
        let Some(size) = octal(&header[124..136]) else {
            return;
        };
        let Some(next) = usize::try_from(size)
            .ok()
            .and_then(|size| size.checked_next_multiple_of(512))
            .and_then(|data| data.checked_add(at + 512))
        else {
            return;
        };
        at = next;
    }
}

/// Parses a NUL/space-terminated octal header field.
fn octal(field: &[u8]) -> Option<u64> {
    let digits = field
        .iter()
        .copied()
        .skip_while(|&b| b == b' ')
        .take_while(|&b| b != 0 && b != b' ');
    let mut value = 0u64;
    for digit in digits {
        if !(b'0'..=b'7').contains(&digit) {
            return None;
        }
        value = value.checked_mul(8)?.checked_add(u64::from(digit - b'0'))?;
    }
    Some(value)
}
