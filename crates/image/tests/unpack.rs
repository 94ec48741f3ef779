//! Layer unpacking against real tarballs, built here with the `tar` crate.
//!
//! Hostile names are written straight into the header fields (or into GNU
//! long-name / PAX records built by hand) so that they reach the unpacker
//! exactly as an attacker would send them, bypassing the `tar` builder's
//! own checks.
//!
//! The tests need root (chown, whiteout devices, `trusted.*` xattrs, an
//! overlay mount); without it they print why and pass vacuously.

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use runbox_image::unpack::{decompressed, unpack_layer, UnpackError, UnpackLimits, UnpackStats};
use tar::{EntryType, Header};

/// Returns early from a test that cannot run without root.
macro_rules! require_root {
    () => {
        if !rustix::process::geteuid().is_root() {
            eprintln!("skipped: layer unpacking tests need root");
            return;
        }
    };
}

// ---------------------------------------------------------------------------
// Building layers

/// One tar entry, described the way a hostile archive could spell it.
struct Raw<'a> {
    kind: EntryType,
    name: &'a [u8],
    link: Option<&'a [u8]>,
    data: &'a [u8],
    mode: u32,
    uid: u64,
    gid: u64,
    mtime: u64,
    device: (u32, u32),
    /// A type byte to write instead of `kind`'s (the `tar` crate writes
    /// `'0'` for both spellings of a regular file).
    type_byte: Option<u8>,
}

impl<'a> Raw<'a> {
    fn new(kind: EntryType, name: &'a str) -> Self {
        Self::bytes(kind, name.as_bytes())
    }

    fn bytes(kind: EntryType, name: &'a [u8]) -> Self {
        Self {
            kind,
            name,
            link: None,
            data: b"",
            mode: if kind == EntryType::Directory {
                0o755
            } else {
                0o644
            },
            uid: 0,
            gid: 0,
            mtime: 1_700_000_000,
            device: (0, 0),
            type_byte: None,
        }
    }
}

/// A layer under construction.
struct Layer {
    builder: tar::Builder<Vec<u8>>,
}

/// Copies `value` into a fixed-size, NUL-padded header field.
fn set_field(field: &mut [u8], value: &[u8]) {
    assert!(value.len() <= field.len(), "field too small for {value:?}");
    field.fill(0);
    field[..value.len()].copy_from_slice(value);
}

/// One PAX record, `"<len> <key>=<value>\n"`, where `<len>` counts itself.
fn pax_record(key: &str, value: &[u8]) -> Vec<u8> {
    let rest = key.len() + value.len() + 3; // ' ', '=', '\n'
    let mut len = rest + 1;
    while len != rest + len.to_string().len() {
        len = rest + len.to_string().len();
    }
    let mut record = format!("{len} {key}=").into_bytes();
    record.extend_from_slice(value);
    record.push(b'\n');
    record
}

impl Layer {
    fn new() -> Self {
        Self {
            builder: tar::Builder::new(Vec::new()),
        }
    }

    /// Appends an extension entry (GNU long name/link, PAX) holding `data`.
    fn extension(&mut self, kind: EntryType, data: &[u8]) -> &mut Self {
        let mut header = Header::new_gnu();
        set_field(&mut header.as_old_mut().name, b"././@LongLink");
        header.set_entry_type(kind);
        header.set_size(data.len() as u64);
        header.set_mode(0o644);
        header.set_cksum();
        self.builder.append(&header, data).unwrap();
        self
    }

    /// Appends `entry`, using GNU long-name/long-link entries for names
    /// over the 100-byte header fields.
    fn raw(&mut self, entry: Raw<'_>) -> &mut Self {
        let mut header = Header::new_gnu();
        if entry.name.len() > 100 {
            let mut long = entry.name.to_vec();
            long.push(0);
            self.extension(EntryType::GNULongName, &long);
            set_field(&mut header.as_old_mut().name, &entry.name[..100]);
        } else {
            set_field(&mut header.as_old_mut().name, entry.name);
        }
        if let Some(link) = entry.link {
            if link.len() > 100 {
                let mut long = link.to_vec();
                long.push(0);
                self.extension(EntryType::GNULongLink, &long);
                set_field(&mut header.as_old_mut().linkname, &link[..100]);
            } else {
                set_field(&mut header.as_old_mut().linkname, link);
            }
        }
        header.set_entry_type(entry.kind);
        if let Some(byte) = entry.type_byte {
            header.as_old_mut().linkflag = [byte];
        }
        header.set_size(entry.data.len() as u64);
        header.set_mode(entry.mode);
        header.set_uid(entry.uid);
        header.set_gid(entry.gid);
        header.set_mtime(entry.mtime);
        header.set_device_major(entry.device.0).unwrap();
        header.set_device_minor(entry.device.1).unwrap();
        header.set_cksum();
        self.builder.append(&header, entry.data).unwrap();
        self
    }

    /// Appends an entry whose name is given by a PAX `path` record (the
    /// header's own name field holds a decoy).
    fn pax_path(&mut self, name: &[u8], kind: EntryType, data: &[u8]) -> &mut Self {
        self.extension(EntryType::XHeader, &pax_record("path", name));
        self.raw(Raw {
            data,
            ..Raw::new(kind, "decoy")
        })
    }

    fn dir(&mut self, name: &str, mode: u32) -> &mut Self {
        self.raw(Raw {
            mode,
            ..Raw::new(EntryType::Directory, name)
        })
    }

    fn file(&mut self, name: &str, data: &[u8]) -> &mut Self {
        self.raw(Raw {
            data,
            ..Raw::new(EntryType::Regular, name)
        })
    }

    fn symlink(&mut self, name: &str, target: &str) -> &mut Self {
        self.raw(Raw {
            link: Some(target.as_bytes()),
            mode: 0o777,
            ..Raw::new(EntryType::Symlink, name)
        })
    }

    fn hard_link(&mut self, name: &str, target: &str) -> &mut Self {
        self.raw(Raw {
            link: Some(target.as_bytes()),
            ..Raw::new(EntryType::Link, name)
        })
    }

    fn finish(&mut self) -> Vec<u8> {
        self.builder.finish().unwrap();
        std::mem::take(self.builder.get_mut())
    }
}

// ---------------------------------------------------------------------------
// Where layers are unpacked

/// `base/dest` receives the layer; `base/sentinel` (an empty directory)
/// and `base/victim` (a file) sit next to it and must never change.
struct Sandbox {
    base: tempfile::TempDir,
    dest: PathBuf,
    sentinel: PathBuf,
    victim: PathBuf,
}

const VICTIM_TEXT: &[u8] = b"must not change\n";

impl Sandbox {
    fn new() -> Self {
        let base = tempfile::tempdir().unwrap();
        let dest = base.path().join("dest");
        let sentinel = base.path().join("sentinel");
        let victim = base.path().join("victim");
        fs::create_dir(&dest).unwrap();
        fs::create_dir(&sentinel).unwrap();
        fs::write(&victim, VICTIM_TEXT).unwrap();
        Self {
            base,
            dest,
            sentinel,
            victim,
        }
    }

    fn unpack(&self, layer: &[u8]) -> Result<UnpackStats, UnpackError> {
        self.unpack_with(layer, &UnpackLimits::default())
    }

    fn unpack_with(&self, layer: &[u8], limits: &UnpackLimits) -> Result<UnpackStats, UnpackError> {
        unpack_layer(layer, &self.dest, limits)
    }

    fn at(&self, rel: &str) -> PathBuf {
        self.dest.join(rel)
    }

    /// The sentinel path as text, for symlink targets and absolute names.
    fn sentinel_str(&self) -> &str {
        self.sentinel.to_str().unwrap()
    }

    /// Nothing next to `dest` changed: same names, an empty sentinel, an
    /// untouched victim with no extra hard links.
    fn assert_confined(&self) {
        let names: BTreeSet<OsString> = fs::read_dir(self.base.path())
            .unwrap()
            .map(|entry| entry.unwrap().file_name())
            .collect();
        let expected: BTreeSet<OsString> = ["dest", "sentinel", "victim"]
            .into_iter()
            .map(OsString::from)
            .collect();
        assert_eq!(names, expected, "something was written next to dest");
        assert_eq!(
            fs::read_dir(&self.sentinel).unwrap().count(),
            0,
            "something was written into the sentinel"
        );
        assert_eq!(fs::read(&self.victim).unwrap(), VICTIM_TEXT);
        assert_eq!(fs::metadata(&self.victim).unwrap().nlink(), 1);
    }
}

fn lstat(path: &Path) -> fs::Metadata {
    fs::symlink_metadata(path).unwrap_or_else(|err| panic!("{}: {err}", path.display()))
}

fn exists(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok()
}

fn opaque_xattr(path: &Path) -> Option<Vec<u8>> {
    let mut buf = [0u8; 16];
    rustix::fs::lgetxattr(path, "trusted.overlay.opaque", &mut buf)
        .ok()
        .map(|n| buf[..n].to_vec())
}

fn is_whiteout(path: &Path) -> bool {
    let meta = lstat(path);
    meta.file_type().is_char_device() && meta.rdev() == 0
}

// ---------------------------------------------------------------------------
// A normal layer

#[test]
fn normal_layer_round_trip() {
    require_root!();
    let sb = Sandbox::new();
    let pax_long = format!("./opt/{}/pax-file.txt", "deep-directory-name/".repeat(8));
    let gnu_long = format!("./srv/{}/gnu-file.txt", "another-long-component/".repeat(6));
    assert!(pax_long.len() > 100 && gnu_long.len() > 100);

    let layer = Layer::new()
        .dir("./", 0o755)
        .dir("./etc/", 0o755)
        .raw(Raw {
            data: b"127.0.0.1 localhost\n",
            mtime: 1_600_000_000,
            ..Raw::new(EntryType::Regular, "./etc/hosts")
        })
        .raw(Raw {
            data: b"#!/bin/su\n",
            mode: 0o4755,
            ..Raw::new(EntryType::Regular, "./usr/bin/su")
        })
        .raw(Raw {
            mode: 0o750,
            uid: 1000,
            gid: 1001,
            mtime: 1_500_000_000,
            ..Raw::new(EntryType::Directory, "./home/user/")
        })
        .raw(Raw {
            data: b"secret",
            mode: 0o600,
            uid: 1000,
            gid: 1001,
            ..Raw::new(EntryType::Regular, "./home/user/secret")
        })
        .raw(Raw {
            link: Some(b"/bin/busybox"),
            uid: 7,
            gid: 8,
            ..Raw::new(EntryType::Symlink, "./usr/bin/sh")
        })
        .hard_link("./usr/bin/su-again", "./usr/bin/su")
        .pax_path(pax_long.as_bytes(), EntryType::Regular, b"pax data")
        .file(&gnu_long, b"gnu data")
        .file("./var/empty", b"")
        .finish();

    let stats = sb.unpack(&layer).unwrap();
    assert_eq!(stats.entries, 11);
    assert_eq!(stats.bytes, 20 + 10 + 6 + 8 + 8);
    assert_eq!((stats.whiteouts, stats.skipped), (0, 0));

    assert_eq!(
        fs::read(sb.at("etc/hosts")).unwrap(),
        b"127.0.0.1 localhost\n"
    );
    assert_eq!(lstat(&sb.at("etc/hosts")).mode() & 0o7777, 0o644);
    assert_eq!(lstat(&sb.at("etc/hosts")).mtime(), 1_600_000_000);

    // setuid is kept (runs have no_new_privileges).
    let su = lstat(&sb.at("usr/bin/su"));
    assert_eq!(su.mode() & 0o7777, 0o4755);
    // The implicit parent `usr` is root-owned 0755.
    let usr = lstat(&sb.at("usr"));
    assert!(usr.is_dir());
    assert_eq!((usr.mode() & 0o7777, usr.uid(), usr.gid()), (0o755, 0, 0));

    let home = lstat(&sb.at("home/user"));
    assert_eq!(
        (home.mode() & 0o7777, home.uid(), home.gid()),
        (0o750, 1000, 1001)
    );
    // Set after `secret` was written into it.
    assert_eq!(home.mtime(), 1_500_000_000);
    let secret = lstat(&sb.at("home/user/secret"));
    assert_eq!(
        (secret.mode() & 0o7777, secret.uid(), secret.gid()),
        (0o600, 1000, 1001)
    );

    let sh = lstat(&sb.at("usr/bin/sh"));
    assert!(sh.file_type().is_symlink());
    assert_eq!((sh.uid(), sh.gid()), (7, 8));
    assert_eq!(
        fs::read_link(sb.at("usr/bin/sh")).unwrap(),
        Path::new("/bin/busybox")
    );

    let again = lstat(&sb.at("usr/bin/su-again"));
    assert_eq!(again.ino(), su.ino());
    assert_eq!(again.nlink(), 2);

    assert_eq!(fs::read(sb.at(&pax_long)).unwrap(), b"pax data");
    assert!(
        !exists(&sb.at("decoy")),
        "the PAX path must win over the header name"
    );
    assert_eq!(fs::read(sb.at(&gnu_long)).unwrap(), b"gnu data");
    assert_eq!(fs::read(sb.at("var/empty")).unwrap(), b"");
    sb.assert_confined();
}

#[test]
fn root_entry_sets_only_the_destination_mode() {
    require_root!();
    let sb = Sandbox::new();
    let layer = Layer::new().dir(".", 0o711).file("a", b"x").finish();
    sb.unpack(&layer).unwrap();
    assert_eq!(lstat(&sb.dest).mode() & 0o7777, 0o711);

    let sb = Sandbox::new();
    let layer = Layer::new().file("./", b"not a dir").finish();
    assert_eq!(sb.unpack(&layer).unwrap_err().rule(), "corrupt");
}

#[test]
fn pre_posix_directories_are_directories() {
    require_root!();
    let sb = Sandbox::new();
    // Type byte NUL plus a trailing slash: a directory in V7 tar.
    let layer = Layer::new()
        .raw(Raw {
            mode: 0o711,
            type_byte: Some(0),
            ..Raw::new(EntryType::Regular, "olddir/")
        })
        .raw(Raw {
            data: b"f",
            type_byte: Some(0),
            ..Raw::new(EntryType::Regular, "olddir/file")
        })
        .finish();
    sb.unpack(&layer).unwrap();
    assert!(lstat(&sb.at("olddir")).is_dir());
    assert_eq!(lstat(&sb.at("olddir")).mode() & 0o7777, 0o711);
    assert_eq!(fs::read(sb.at("olddir/file")).unwrap(), b"f");
}

#[test]
fn a_file_in_the_way_of_a_parent_is_an_error() {
    require_root!();
    let sb = Sandbox::new();
    let layer = Layer::new().file("a", b"").file("a/b", b"").finish();
    assert_refused(
        "file as parent",
        &layer,
        &UnpackLimits::default(),
        &sb,
        "io",
    );
}

#[test]
fn destination_must_be_empty() {
    require_root!();
    let sb = Sandbox::new();
    fs::write(sb.at("left-over"), b"").unwrap();
    let err = sb
        .unpack(&Layer::new().file("a", b"").finish())
        .unwrap_err();
    assert_eq!(err.rule(), "io");
}

// ---------------------------------------------------------------------------
// Compression

#[test]
fn gzip_zstd_and_plain_layers() {
    require_root!();
    let tar = Layer::new().file("hello.txt", b"hello, layer\n").finish();

    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(&tar).unwrap();
    let gz = gz.finish().unwrap();
    assert_eq!(&gz[..2], &[0x1f, 0x8b]);

    // Two gzip members back to back are one stream (as pigz may write).
    let (front, back) = tar.split_at(700);
    let mut multi = Vec::new();
    for part in [front, back] {
        let mut member = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        member.write_all(part).unwrap();
        multi.extend(member.finish().unwrap());
    }

    let zst = zstd::encode_all(&tar[..], 3).unwrap();
    assert_eq!(&zst[..4], &[0x28, 0xb5, 0x2f, 0xfd]);

    for (what, bytes) in [
        ("gzip", &gz),
        ("multi-member gzip", &multi),
        ("zstd", &zst),
        ("plain", &tar),
    ] {
        let sb = Sandbox::new();
        let reader = decompressed(&bytes[..]).unwrap();
        sb.unpack_with_reader(reader)
            .unwrap_or_else(|err| panic!("{what}: {err}"));
        assert_eq!(
            fs::read(sb.at("hello.txt")).unwrap(),
            b"hello, layer\n",
            "{what}"
        );
    }
}

impl Sandbox {
    fn unpack_with_reader(&self, reader: impl Read) -> Result<UnpackStats, UnpackError> {
        unpack_layer(reader, &self.dest, &UnpackLimits::default())
    }
}

#[test]
fn short_and_unknown_streams_pass_through() {
    for input in [
        &b""[..],
        b"a",
        b"\x1f",
        b"\x28\xb5\x2f",
        b"plain text, not compressed",
    ] {
        let mut out = Vec::new();
        decompressed(input).unwrap().read_to_end(&mut out).unwrap();
        assert_eq!(out, input);
    }
}

#[test]
fn corrupt_compression_is_corrupt() {
    require_root!();
    let sb = Sandbox::new();
    let mut bogus = vec![0x1f, 0x8b, 0x08, 0x00];
    bogus.extend([0xffu8; 64]);
    let reader = decompressed(&bogus[..]).unwrap();
    let err = sb.unpack_with_reader(reader).unwrap_err();
    assert_eq!(err.rule(), "corrupt", "{err}");
}

// ---------------------------------------------------------------------------
// Whiteouts

#[test]
fn whiteouts_become_overlayfs_whiteouts() {
    require_root!();
    let sb = Sandbox::new();
    let layer = Layer::new()
        .file("./.wh.gone", b"")
        .dir("./dir/", 0o755)
        .file("./dir/.wh..wh..opq", b"")
        .file("./dir/keep", b"kept")
        .file("./implicit/.wh..wh..opq", b"")
        .file("./sub/.wh.x", b"")
        .file("./.wh..wh.plnk", b"")
        .finish();
    let stats = sb.unpack(&layer).unwrap();
    assert_eq!(stats.whiteouts, 4);
    assert_eq!(stats.skipped, 1);

    assert!(is_whiteout(&sb.at("gone")));
    assert_eq!(lstat(&sb.at("gone")).mode() & 0o7777, 0);
    assert!(is_whiteout(&sb.at("sub/x")));
    assert_eq!(opaque_xattr(&sb.at("dir")).as_deref(), Some(&b"y"[..]));
    assert_eq!(opaque_xattr(&sb.at("implicit")).as_deref(), Some(&b"y"[..]));
    assert_eq!(fs::read(sb.at("dir/keep")).unwrap(), b"kept");
    // The markers themselves are never written.
    assert!(!exists(&sb.at(".wh.gone")));
    assert!(!exists(&sb.at("dir/.wh..wh..opq")));
    assert!(!exists(&sb.at(".wh..wh.plnk")));
    assert_eq!(opaque_xattr(&sb.at("sub")), None);
    sb.assert_confined();
}

#[test]
fn whiteouts_spare_entries_of_the_same_layer() {
    require_root!();
    let sb = Sandbox::new();
    let layer = Layer::new()
        // A file of this layer survives a whiteout of its own name.
        .file("file", b"mine")
        .file(".wh.file", b"")
        // A directory of this layer survives too, but its lower namesake
        // is gone, so it becomes opaque.
        .dir("dir/", 0o755)
        .file("dir/child", b"")
        .file(".wh.dir", b"")
        // A directory made over a whiteout is opaque for the same reason.
        .file(".wh.again", b"")
        .dir("again/", 0o755)
        // A file made over a whiteout simply replaces it.
        .file(".wh.plain", b"")
        .file("plain", b"new")
        // A parent made implicitly over a whiteout is an opaque directory.
        .file(".wh.implicit", b"")
        .file("implicit/child", b"c")
        .finish();
    sb.unpack(&layer).unwrap();
    assert_eq!(fs::read(sb.at("file")).unwrap(), b"mine");
    assert!(lstat(&sb.at("dir")).is_dir());
    assert!(exists(&sb.at("dir/child")));
    assert_eq!(opaque_xattr(&sb.at("dir")).as_deref(), Some(&b"y"[..]));
    assert!(lstat(&sb.at("again")).is_dir());
    assert_eq!(opaque_xattr(&sb.at("again")).as_deref(), Some(&b"y"[..]));
    assert_eq!(fs::read(sb.at("plain")).unwrap(), b"new");
    assert_eq!(fs::read(sb.at("implicit/child")).unwrap(), b"c");
    assert_eq!(opaque_xattr(&sb.at("implicit")).as_deref(), Some(&b"y"[..]));
    assert_eq!(lstat(&sb.at("implicit")).mode() & 0o7777, 0o755);
}

/// Unmounts on drop, so a failing assertion never leaves a mount behind.
struct Mounted(PathBuf);

impl Drop for Mounted {
    fn drop(&mut self) {
        if let Err(err) = rustix::mount::unmount(&self.0, rustix::mount::UnmountFlags::DETACH) {
            eprintln!("unmounting {}: {err}", self.0.display());
        }
    }
}

#[test]
fn overlay_mount_hides_whited_out_entries() {
    require_root!();
    let base = tempfile::tempdir().unwrap();
    let lower = base.path().join("lower");
    let upper = base.path().join("upper");
    let merged = base.path().join("merged");
    for dir in [&lower, &upper, &merged] {
        fs::create_dir(dir).unwrap();
    }

    let lower_layer = Layer::new()
        .file("file", b"lower")
        .file("keep", b"lower")
        .file("dir/old", b"lower")
        .file("plain/old", b"lower")
        .finish();
    unpack_layer(&lower_layer[..], &lower, &UnpackLimits::default()).unwrap();
    let upper_layer = Layer::new()
        .file(".wh.file", b"")
        .file("dir/.wh..wh..opq", b"")
        .file("dir/new", b"upper")
        .file("plain/new", b"upper")
        .finish();
    unpack_layer(&upper_layer[..], &upper, &UnpackLimits::default()).unwrap();

    // Two lower layers and no upper: a read-only overlay, leftmost on top.
    let options = format!("lowerdir={}:{}", upper.display(), lower.display());
    let options = std::ffi::CString::new(options).unwrap();
    rustix::mount::mount(
        "overlay",
        &merged,
        "overlay",
        rustix::mount::MountFlags::RDONLY,
        options.as_c_str(),
    )
    .expect("mounting overlay (needs root and overlayfs)");
    let _guard = Mounted(merged.clone());

    assert!(
        !exists(&merged.join("file")),
        "whiteout did not hide the file"
    );
    assert_eq!(fs::read(merged.join("keep")).unwrap(), b"lower");
    assert_eq!(fs::read(merged.join("dir/new")).unwrap(), b"upper");
    assert!(
        !exists(&merged.join("dir/old")),
        "opaque dir showed a lower entry"
    );
    // Without the marker the directories merge.
    assert_eq!(fs::read(merged.join("plain/old")).unwrap(), b"lower");
    assert_eq!(fs::read(merged.join("plain/new")).unwrap(), b"upper");
}

// ---------------------------------------------------------------------------
// Refusals

/// Builds a hostile layer; some need the sandbox's paths.
type BuildLayer = Box<dyn Fn(&Sandbox) -> Vec<u8>>;

/// Unpacks `layer` into a fresh sandbox, expects refusal by `rule`, and
/// checks that nothing outside `dest` changed.
fn assert_refused(what: &str, layer: &[u8], limits: &UnpackLimits, sb: &Sandbox, rule: &str) {
    match sb.unpack_with(layer, limits) {
        Ok(stats) => panic!("{what}: unpacked ({stats:?}), expected {rule}"),
        Err(err) => {
            assert_eq!(err.rule(), rule, "{what}: {err}");
            // Every refusal names an entry.
            assert!(!err.path().is_empty(), "{what}: {err}");
            assert!(!err.to_string().is_empty());
        }
    }
    sb.assert_confined();
}

#[test]
fn hostile_names_are_refused() {
    require_root!();
    let defaults = UnpackLimits::default();
    let cases: Vec<(&str, BuildLayer, &str)> = vec![
        (
            "absolute path into the sentinel",
            Box::new(|sb| {
                Layer::new()
                    .file(&format!("{}/x", sb.sentinel_str()), b"x")
                    .finish()
            }),
            "absolute_path",
        ),
        (
            "parent dir",
            Box::new(|_| Layer::new().file("../sentinel/x", b"x").finish()),
            "parent_dir",
        ),
        (
            "parent dir mid-path",
            Box::new(|_| Layer::new().file("./a/../../sentinel/x", b"x").finish()),
            "parent_dir",
        ),
        (
            "parent dir in a GNU long name",
            Box::new(|_| {
                let name = format!("{}/../../sentinel/x", "a".repeat(120));
                Layer::new().file(&name, b"x").finish()
            }),
            "parent_dir",
        ),
        (
            "NUL in a PAX path",
            Box::new(|_| {
                Layer::new()
                    .pax_path(b"a\0b", EntryType::Regular, b"")
                    .finish()
            }),
            "nul_byte",
        ),
        (
            "absolute path in a PAX path",
            Box::new(|sb| {
                let name = format!("{}/pax", sb.sentinel_str());
                Layer::new()
                    .pax_path(name.as_bytes(), EntryType::Regular, b"")
                    .finish()
            }),
            "absolute_path",
        ),
        (
            "name over the limit",
            Box::new(|_| Layer::new().file(&"n".repeat(5000), b"").finish()),
            "path_too_long",
        ),
    ];
    for (what, build, rule) in cases {
        let sb = Sandbox::new();
        assert_refused(what, &build(&sb), &defaults, &sb, rule);
    }
}

#[test]
fn writes_through_symlinks_are_refused() {
    require_root!();
    let defaults = UnpackLimits::default();
    let canary = Path::new("/etc/runbox-unpack-test-canary");
    let cases: Vec<(&str, BuildLayer)> = vec![
        (
            "link -> /etc, then link/<canary>",
            Box::new(|_| {
                Layer::new()
                    .symlink("link", "/etc")
                    .file("link/runbox-unpack-test-canary", b"x")
                    .finish()
            }),
        ),
        (
            "link -> absolute sentinel",
            Box::new(|sb| {
                Layer::new()
                    .symlink("link", sb.sentinel_str())
                    .file("link/x", b"x")
                    .finish()
            }),
        ),
        (
            "link -> .., then link/x",
            Box::new(|_| {
                Layer::new()
                    .symlink("link", "..")
                    .file("link/x", b"x")
                    .finish()
            }),
        ),
        (
            "link -> ../sentinel, then a directory under it",
            Box::new(|_| {
                Layer::new()
                    .symlink("link", "../sentinel")
                    .dir("link/sub/", 0o755)
                    .finish()
            }),
        ),
        (
            "deep symlink in the middle of a path",
            Box::new(|_| {
                Layer::new()
                    .dir("a/", 0o755)
                    .symlink("a/b", "../../sentinel")
                    .file("a/b/c/d", b"x")
                    .finish()
            }),
        ),
        (
            "whiteout through a symlink",
            Box::new(|_| {
                Layer::new()
                    .symlink("link", "../sentinel")
                    .file("link/.wh.x", b"")
                    .finish()
            }),
        ),
        (
            "opaque marker through a symlink",
            Box::new(|_| {
                Layer::new()
                    .symlink("link", "../sentinel")
                    .file("link/.wh..wh..opq", b"")
                    .finish()
            }),
        ),
        (
            "symlink replacing a directory, then a file under it",
            Box::new(|_| {
                Layer::new()
                    .dir("d/", 0o755)
                    .symlink("d", "../sentinel")
                    .file("d/x", b"x")
                    .finish()
            }),
        ),
    ];
    for (what, build) in cases {
        let sb = Sandbox::new();
        assert_refused(what, &build(&sb), &defaults, &sb, "symlink_parent");
        assert!(!exists(canary), "{what}: wrote into /etc");
    }
}

#[test]
fn hard_links_leaving_the_layer_are_refused() {
    require_root!();
    let defaults = UnpackLimits::default();
    let passwd_links = fs::metadata("/etc/passwd").map(|m| m.nlink()).ok();
    let cases: Vec<(&str, Layer)> = vec![
        ("to /etc/passwd", {
            let mut l = Layer::new();
            l.hard_link("x", "/etc/passwd");
            l
        }),
        ("to ../victim", {
            let mut l = Layer::new();
            l.hard_link("x", "../victim");
            l
        }),
        ("through a symlink parent", {
            let mut l = Layer::new();
            l.symlink("up", "..").hard_link("x", "up/victim");
            l
        }),
        ("through an absolute symlink parent", {
            let mut l = Layer::new();
            l.symlink("etc", "/etc").hard_link("x", "etc/passwd");
            l
        }),
        ("to a name not in the layer", {
            let mut l = Layer::new();
            l.hard_link("x", "missing");
            l
        }),
        ("to a directory", {
            let mut l = Layer::new();
            l.dir("d/", 0o755).hard_link("x", "d");
            l
        }),
        ("to the layer root", {
            let mut l = Layer::new();
            l.hard_link("x", "./");
            l
        }),
    ];
    for (what, mut layer) in cases {
        let sb = Sandbox::new();
        assert_refused(what, &layer.finish(), &defaults, &sb, "hardlink_outside");
        assert!(!exists(&sb.at("x")), "{what}");
    }
    assert_eq!(
        fs::metadata("/etc/passwd").map(|m| m.nlink()).ok(),
        passwd_links
    );
}

#[test]
fn hard_link_to_a_symlink_links_the_symlink_itself() {
    require_root!();
    let sb = Sandbox::new();
    let layer = Layer::new()
        .symlink("s", "/etc/passwd")
        .hard_link("t", "s")
        .finish();
    sb.unpack(&layer).unwrap();
    assert!(lstat(&sb.at("t")).file_type().is_symlink());
    assert_eq!(lstat(&sb.at("t")).ino(), lstat(&sb.at("s")).ino());
}

#[test]
fn limits_are_enforced() {
    require_root!();
    let small = UnpackLimits {
        max_bytes: 10,
        max_entries: 3,
        max_path_bytes: 20,
    };
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "one file over max_bytes",
            Layer::new().file("a", &[0; 11]).finish(),
            "too_large",
        ),
        (
            "files adding up over max_bytes",
            Layer::new().file("a", &[0; 6]).file("b", &[0; 6]).finish(),
            "too_large",
        ),
        (
            "a directory claiming data",
            Layer::new()
                .raw(Raw {
                    data: &[0; 64],
                    ..Raw::new(EntryType::Directory, "d/")
                })
                .finish(),
            "too_large",
        ),
        (
            "over max_entries",
            Layer::new()
                .dir("a/", 0o755)
                .dir("b/", 0o755)
                .dir("c/", 0o755)
                .dir("d/", 0o755)
                .finish(),
            "too_many_entries",
        ),
        (
            "name over max_path_bytes",
            Layer::new().file(&"x".repeat(21), b"").finish(),
            "path_too_long",
        ),
        (
            "symlink target over max_path_bytes",
            Layer::new().symlink("s", &"t".repeat(21)).finish(),
            "path_too_long",
        ),
    ];
    for (what, layer, rule) in cases {
        let sb = Sandbox::new();
        assert_refused(what, &layer, &small, &sb, rule);
    }

    // Exactly at every limit is fine.
    let sb = Sandbox::new();
    let layer = Layer::new()
        .file(&"x".repeat(20), &[1; 4])
        .file("b", &[2; 6])
        .symlink("s", &"t".repeat(20))
        .finish();
    let stats = sb.unpack_with(&layer, &small).unwrap();
    assert_eq!((stats.bytes, stats.entries), (10, 3));
}

#[test]
fn oversized_extension_headers_are_refused_without_buffering() {
    require_root!();
    let sb = Sandbox::new();
    // A 4 MiB PAX header: more than the per-entry header budget.
    let record = pax_record("comment", &vec![b'x'; 4 << 20]);
    let layer = Layer::new()
        .extension(EntryType::XHeader, &record)
        .file("a", b"")
        .finish();
    assert_refused(
        "huge PAX header",
        &layer,
        &UnpackLimits::default(),
        &sb,
        "too_large",
    );
}

#[test]
fn bad_whiteouts_are_refused() {
    require_root!();
    for name in ["./.wh.", "dir/.wh..", ".wh...", "a/b/.wh."] {
        let sb = Sandbox::new();
        let layer = Layer::new().file(name, b"").finish();
        assert_refused(name, &layer, &UnpackLimits::default(), &sb, "bad_whiteout");
    }
}

#[test]
fn broken_archives_are_corrupt() {
    require_root!();
    let good = Layer::new().file("a", &[7; 1000]).finish();

    // Cut inside the file's data.
    let sb = Sandbox::new();
    assert_refused(
        "truncated",
        &good[..800],
        &UnpackLimits::default(),
        &sb,
        "corrupt",
    );

    // A flipped byte in the header breaks its checksum.
    let mut bad_sum = good.clone();
    bad_sum[0] ^= 0x20;
    let sb = Sandbox::new();
    assert_refused(
        "bad checksum",
        &bad_sum,
        &UnpackLimits::default(),
        &sb,
        "corrupt",
    );

    // An entry type no layer has any use for (GNU volume label).
    let layer = Layer::new()
        .raw(Raw::new(EntryType::new(b'V'), "label"))
        .finish();
    let sb = Sandbox::new();
    assert_refused(
        "volume label",
        &layer,
        &UnpackLimits::default(),
        &sb,
        "corrupt",
    );

    // A uid chown(2) would read as "unchanged".
    let layer = Layer::new()
        .raw(Raw {
            uid: u64::from(u32::MAX),
            ..Raw::new(EntryType::Regular, "f")
        })
        .finish();
    let sb = Sandbox::new();
    assert_refused("uid -1", &layer, &UnpackLimits::default(), &sb, "corrupt");
}

// ---------------------------------------------------------------------------
// Devices and replacement

#[test]
fn device_nodes_are_skipped_and_fifos_made() {
    require_root!();
    let sb = Sandbox::new();
    let layer = Layer::new()
        .raw(Raw {
            device: (1, 3),
            ..Raw::new(EntryType::Char, "./dev/null")
        })
        .raw(Raw {
            device: (8, 0),
            ..Raw::new(EntryType::Block, "./dev/sda")
        })
        .raw(Raw {
            mode: 0o640,
            uid: 1234,
            gid: 99,
            ..Raw::new(EntryType::Fifo, "./run/fifo")
        })
        .file("./ok", b"ok")
        .finish();
    let stats = sb.unpack(&layer).unwrap();
    assert_eq!((stats.entries, stats.skipped), (4, 2));
    assert!(!exists(&sb.at("dev/null")));
    assert!(!exists(&sb.at("dev/sda")));
    let fifo = fs::symlink_metadata(sb.at("run/fifo")).unwrap();
    use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _};
    assert!(fifo.file_type().is_fifo());
    assert_eq!(
        (fifo.mode() & 0o7777, fifo.uid(), fifo.gid()),
        (0o640, 1234, 99)
    );
    assert_eq!(fs::read(sb.at("ok")).unwrap(), b"ok");
}

#[test]
fn only_user_xattrs_are_applied() {
    require_root!();
    let sb = Sandbox::new();
    let mut builder = tar::Builder::new(Vec::new());
    let add = |builder: &mut tar::Builder<Vec<u8>>, kind: EntryType, name: &str| {
        builder
            .append_pax_extensions([
                ("SCHILY.xattr.user.origin", &b"checkpoint"[..]),
                ("SCHILY.xattr.trusted.overlay.opaque", &b"y"[..]),
                ("SCHILY.xattr.security.capability", &b"\x01\x00\x00\x02"[..]),
                ("SCHILY.xattr.user.empty", &b""[..]),
            ])
            .unwrap();
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(kind);
        header.set_mode(0o755);
        header.set_uid(0);
        header.set_gid(0);
        header.set_mtime(0);
        header.set_size(0);
        builder
            .append_data(&mut header, name, std::io::empty())
            .unwrap();
    };
    add(&mut builder, EntryType::Directory, "d");
    add(&mut builder, EntryType::Regular, "d/f");
    let layer = builder.into_inner().unwrap();
    sb.unpack(&layer).unwrap();
    for path in [sb.at("d"), sb.at("d/f")] {
        let mut names = vec![0u8; 1024];
        let n = rustix::fs::llistxattr(&path, &mut names).unwrap();
        let mut names: Vec<&[u8]> = names[..n]
            .split(|&b| b == 0)
            .filter(|n| !n.is_empty())
            .collect();
        names.sort();
        assert_eq!(
            names,
            vec![&b"user.empty"[..], &b"user.origin"[..]],
            "{}",
            path.display()
        );
        let mut value = [0u8; 32];
        let n = rustix::fs::lgetxattr(&path, "user.origin", &mut value).unwrap();
        assert_eq!(&value[..n], b"checkpoint");
    }
    // Too many: refused.
    let mut builder = tar::Builder::new(Vec::new());
    let names: Vec<String> = (0..=runbox_image::unpack::MAX_XATTRS)
        .map(|i| format!("SCHILY.xattr.user.n{i}"))
        .collect();
    builder
        .append_pax_extensions(names.iter().map(|n| (n.as_str(), &b"v"[..])))
        .unwrap();
    let mut header = tar::Header::new_gnu();
    header.set_size(0);
    header.set_mode(0o644);
    header.set_uid(0);
    header.set_gid(0);
    header.set_mtime(0);
    builder
        .append_data(&mut header, "many", std::io::empty())
        .unwrap();
    let sb = Sandbox::new();
    assert!(sb.unpack(&builder.into_inner().unwrap()).is_err());
}

#[test]
fn later_entries_replace_earlier_ones() {
    require_root!();
    let sb = Sandbox::new();
    let victim_in_sentinel = format!("{}/victim", sb.sentinel_str());
    let layer = Layer::new()
        // A file replaced by a symlink.
        .file("a", b"one")
        .symlink("a", "target")
        // A symlink (pointing outside) replaced by a file: the data must go
        // into a new file, not through the link.
        .symlink("b", &victim_in_sentinel)
        .file("b", b"two")
        // A directory with contents replaced by a file.
        .dir("c/", 0o755)
        .file("c/child", b"")
        .file("c", b"three")
        // A file replaced by a directory.
        .file("d", b"")
        .dir("d/", 0o700)
        // A directory entry repeated: kept, with the later mode.
        .dir("e/", 0o755)
        .file("e/child", b"child")
        .dir("e/", 0o700)
        // A file replaced by a file.
        .file("f", b"first")
        .file("f", b"second")
        // A symlink to a directory outside replaced by a directory.
        .symlink("g", sb.sentinel_str())
        .dir("g/", 0o755)
        .file("g/inside", b"")
        // A file replaced by a hard link to another file.
        .file("h", b"old")
        .hard_link("h", "f")
        .finish();
    sb.unpack(&layer).unwrap();

    assert_eq!(fs::read_link(sb.at("a")).unwrap(), Path::new("target"));
    assert!(lstat(&sb.at("b")).is_file());
    assert_eq!(fs::read(sb.at("b")).unwrap(), b"two");
    assert_eq!(fs::read(sb.at("c")).unwrap(), b"three");
    assert!(lstat(&sb.at("d")).is_dir());
    assert_eq!(lstat(&sb.at("d")).mode() & 0o7777, 0o700);
    assert_eq!(lstat(&sb.at("e")).mode() & 0o7777, 0o700);
    assert_eq!(fs::read(sb.at("e/child")).unwrap(), b"child");
    assert_eq!(fs::read(sb.at("f")).unwrap(), b"second");
    assert!(lstat(&sb.at("g")).is_dir());
    assert!(exists(&sb.at("g/inside")));
    assert_eq!(lstat(&sb.at("h")).ino(), lstat(&sb.at("f")).ino());
    sb.assert_confined();
}
