//! The images phase's fixtures and its non-API steps: the generated layer,
//! the OCI layouts built around it, unpacking it once (runbox's store or GNU
//! tar), and the local registry the pull cases fetch from.
//!
//! Owns everything it writes under its directories: the layer blobs and
//! layouts (made once per invocation, deterministic, so runs compare), the
//! directory each unpack goes into (kept until the work directory is
//! removed; [`unpack_once`] says why), and the `docker-registry` process
//! (stopped by its pid, also on drop).
//!
//! It does not time API calls nor start daemons; `image_tables` does.
//!
//! # The generated layer
//!
//! `--image-mib` MiB of file data under `bench/`, in three kinds of file, so
//! that both per-byte and per-file costs show:
//!
//! - 60 % in 4 large files (`bench/large/`);
//! - 25 % in files of 64 KiB to 1 MiB (`bench/medium/`);
//! - 15 % in files of 0 to 8 KiB (about 4 KiB on average, thousands of them)
//!   spread over 256 directories two levels deep (`bench/small/xx/yy/`).
//!
//! Contents come in 4 KiB blocks, 40 % of them random bytes and the rest
//! words of a small vocabulary, so that gzip shrinks the layer roughly as
//! much as a real one. Every entry is owned by root with a fixed mtime.

use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use runbox_image::store::Store;
use runbox_image::unpack::{self, UnpackLimits};
use sha2::{Digest as _, Sha256};

use crate::daemon::IMAGE_TIMEOUT;
use crate::raw;
use crate::report::LayerShape;

/// The image with only the busybox layer.
pub const SMALL_IMAGE: &str = "bench-small";
/// The image with the busybox layer and the generated one.
pub const LARGE_IMAGE: &str = "bench-large";
/// Where the large image's variants are pushed in the local registry
/// (tagged `1`, `2`, …, see [`Fixture::write_variant`]).
pub const REPOSITORY: &str = "bench/large";

/// The mtime of every generated entry (2023-11-14).
const MTIME: u64 = 1_700_000_000;
/// The size of a content block.
const BLOCK: usize = 4096;
/// Percentage of content blocks that are random bytes.
const RANDOM_PERCENT: u64 = 40;
/// Words in the text vocabulary.
const WORDS: usize = 1024;
/// Fan-out of each of the two directory levels holding the small files.
const FANOUT: usize = 16;
/// The environment of both images.
const PATH_ENV: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// A layer's compression, as the blob is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// An uncompressed tarball.
    Plain,
    /// The same tarball, gzip-compressed (default level), as registries
    /// serve layers.
    Gzip,
}

/// One way of unpacking the generated layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unpack {
    /// `Store::add_layer` into a fresh store: decompress, unpack with every
    /// check, hash the blob against its digest, rename into place.
    AddLayer(Format),
    /// `unpack::unpack_layer` of the plain tarball into a fresh directory:
    /// the unpacker alone, without the store's digest check.
    Unpacker,
    /// `tar -xf` (plain) or `tar -xzf` (gzip) into a fresh directory.
    Tar(Format),
}

/// A blob on disk with its digest.
#[derive(Clone, Debug)]
pub struct Blob {
    /// The file.
    pub path: PathBuf,
    /// `sha256:<hex>` of its bytes.
    pub digest: String,
    /// Its size in bytes.
    pub size: u64,
}

/// Everything the images phase reads, built once.
pub struct Fixture {
    /// The generated layer, uncompressed.
    pub plain: Blob,
    /// The generated layer, gzip-compressed.
    pub gzip: Blob,
    /// The busybox layer, gzip-compressed, and its diff id.
    busybox: LayoutLayer,
    /// An OCI layout tarball of the busybox-only image.
    pub small_layout: PathBuf,
    /// An OCI layout tarball of busybox plus the generated layer.
    pub large_layout: PathBuf,
    /// What the generated layer holds, for the report.
    pub shape: LayerShape,
}

impl Fixture {
    /// Generates the layer (`mib` MiB of file data) and both layouts under
    /// `dir`, which must not exist. `busybox` is the busybox root filesystem
    /// as a plain tarball. Blocking; takes seconds (mostly gzip).
    pub fn build(dir: &Path, mib: u64, busybox: &[u8]) -> anyhow::Result<Fixture> {
        std::fs::create_dir(dir).with_context(|| format!("creating {}", dir.display()))?;
        let (plain, mut shape) = write_layer(&dir.join("layer.tar"), mib)?;
        let gzip = gzip_file(&plain.path, &dir.join("layer.tar.gz"))?;
        shape.plain_bytes = plain.size;
        shape.gzip_bytes = gzip.size;

        let busybox_gz = dir.join("busybox.tar.gz");
        let busybox_blob = gzip_file_from(busybox, &busybox_gz)?;
        let busybox_layer = LayoutLayer {
            blob: busybox_blob,
            diff_id: sha256_of(busybox),
        };
        let big_layer = LayoutLayer {
            blob: gzip.clone(),
            diff_id: plain.digest.clone(),
        };
        let small_layout = dir.join("small-layout.tar");
        write_layout(&small_layout, &[&busybox_layer])?;
        let large_layout = dir.join("large-layout.tar");
        write_layout(&large_layout, &[&busybox_layer, &big_layer])?;
        Ok(Fixture {
            plain,
            gzip,
            busybox: busybox_layer,
            small_layout,
            large_layout,
            shape,
        })
    }

    /// Writes variant `n` (from 1) of the large image's layout to
    /// `dir/large-<n>.tar`: the same two layers, byte for byte once
    /// decompressed, but with `n` in the gzip header's mtime field, so that
    /// both blobs, and so both layer digests, differ from every other
    /// variant's. Pulling a new variant is a pull with no layer stored,
    /// without deleting any layer first (see [`unpack_once`] on why deleting
    /// would skew what follows). Blocking.
    pub fn write_variant(&self, dir: &Path, n: u32) -> anyhow::Result<PathBuf> {
        let big = LayoutLayer {
            blob: self.gzip.clone(),
            diff_id: self.plain.digest.clone(),
        };
        let mut layers = Vec::new();
        for (name, layer) in [("busybox", &self.busybox), ("layer", &big)] {
            let path = dir.join(format!("{name}-{n}.tar.gz"));
            layers.push(LayoutLayer {
                blob: restamp_gzip(&layer.blob.path, &path, n)?,
                diff_id: layer.diff_id.clone(),
            });
        }
        let layout = dir.join(format!("large-{n}.tar"));
        write_layout(&layout, &[&layers[0], &layers[1]])?;
        for layer in &layers {
            std::fs::remove_file(&layer.blob.path)?;
        }
        Ok(layout)
    }

    fn blob(&self, format: Format) -> &Blob {
        match format {
            Format::Plain => &self.plain,
            Format::Gzip => &self.gzip,
        }
    }
}

/// Unpacks the generated layer once, the way `how` says, into `scratch`, a
/// fresh directory (which must not exist), and returns how long that took.
/// Then, untimed, flushes the page cache's dirty pages (`sync`), so that the
/// writeback of one iteration does not fall into the next.
///
/// What it unpacked stays until the work directory goes, at the very end:
/// on ext4 without a journal, the kernel does not reuse an inode for a
/// minute (or six) after its file was deleted, and each file created
/// meanwhile scans past every such inode of its block group; creating a tree of thousands of
/// files right after deleting one then takes seconds of kernel time, for
/// tar and runbox alike, and that is what the figures would show.
///
/// Timed is the unpack alone: no store opening, no directory creation. No
/// variant fsyncs, so each measures writing into the page cache.
pub async fn unpack_once(
    fixture: &Fixture,
    scratch: &Path,
    how: Unpack,
    stderr_file: &Path,
) -> anyhow::Result<Duration> {
    std::fs::create_dir(scratch).with_context(|| format!("creating {}", scratch.display()))?;
    let expected = fixture.shape.file_bytes;
    let took = match how {
        Unpack::AddLayer(format) => {
            let blob = fixture.blob(format).clone();
            let root = scratch.join("store");
            // On the blocking pool, so that a SIGINT is still noticed.
            tokio::task::spawn_blocking(move || -> anyhow::Result<Duration> {
                let store = Store::open(root, UnpackLimits::default())?;
                let file = File::open(&blob.path)
                    .with_context(|| format!("opening {}", blob.path.display()))?;
                let start = Instant::now();
                let record = store.add_layer(&blob.digest, file)?;
                let took = start.elapsed();
                ensure!(
                    record.unpacked_bytes == expected,
                    "add_layer unpacked {} bytes, expected {expected}",
                    record.unpacked_bytes
                );
                Ok(took)
            })
            .await
            .context("the unpack task failed")??
        }
        Unpack::Unpacker => {
            let blob = fixture.plain.clone();
            let dest = scratch.join("layer");
            tokio::task::spawn_blocking(move || -> anyhow::Result<Duration> {
                std::fs::create_dir(&dest)?;
                let file = File::open(&blob.path)
                    .with_context(|| format!("opening {}", blob.path.display()))?;
                let start = Instant::now();
                let stats = unpack::unpack_layer(file, &dest, &UnpackLimits::default())?;
                let took = start.elapsed();
                ensure!(
                    stats.bytes == expected,
                    "unpack_layer unpacked {} bytes, expected {expected}",
                    stats.bytes
                );
                Ok(took)
            })
            .await
            .context("the unpack task failed")??
        }
        Unpack::Tar(format) => {
            let dest = scratch.join("layer");
            std::fs::create_dir(&dest)?;
            let mut cmd = tokio::process::Command::new("tar");
            cmd.arg(match format {
                Format::Plain => "-xf",
                Format::Gzip => "-xzf",
            })
            .arg(&fixture.blob(format).path)
            .arg("-C")
            .arg(&dest);
            raw::timed_within(cmd, stderr_file, IMAGE_TIMEOUT).await?
        }
    };
    tokio::task::spawn_blocking(rustix::fs::sync)
        .await
        .context("the sync task failed")?;
    Ok(took)
}

/// Bytes free for an unprivileged user on the filesystem holding `path`.
pub fn available_bytes(path: &Path) -> anyhow::Result<u64> {
    let stat = rustix::fs::statvfs(path).with_context(|| format!("statvfs {}", path.display()))?;
    Ok(stat.f_bavail.saturating_mul(stat.f_frsize))
}

/// Whether `docker-registry` and `skopeo` are installed (scripts/test-registry).
pub fn registry_tools() -> bool {
    ["docker-registry", "skopeo"].iter().all(|tool| {
        std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("command -v {tool}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })
}

/// A `docker-registry` (the distribution registry) on 127.0.0.1, storing
/// under a directory of the benchmark's.
pub struct Registry {
    child: Option<Child>,
    port: u16,
    log: PathBuf,
}

impl Registry {
    /// Starts a registry storing under `dir` (created) and waits until it
    /// accepts connections.
    pub async fn start(dir: &Path) -> anyhow::Result<Registry> {
        std::fs::create_dir(dir).with_context(|| format!("creating {}", dir.display()))?;
        // Taken and released: the registry binds it a moment later. Another
        // process could take it in between; then the start fails, loudly.
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let config = dir.join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    \
                 rootdirectory: {}\nhttp:\n  addr: 127.0.0.1:{port}\n",
                dir.join("data").display()
            ),
        )?;
        let log = dir.join("registry.log");
        let child = std::process::Command::new("docker-registry")
            .arg("serve")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(File::create(&log)?)
            .stderr(File::create(&log)?)
            // Its own process group, like the daemons: a ctrl-c reaches only
            // the benchmark, whose cleanup stops it.
            .process_group(0)
            .spawn()
            .context("starting docker-registry")?;
        let mut registry = Registry {
            child: Some(child),
            port,
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
            {
                return Ok(registry);
            }
            if let Some(child) = registry.child.as_mut() {
                if let Some(status) = child.try_wait()? {
                    bail!(
                        "docker-registry exited with {status}: {}",
                        registry.log_text()
                    );
                }
            }
            if Instant::now() > deadline {
                bail!("docker-registry did not listen within 30 s");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// `127.0.0.1:<port>/<repo_tag>`, as a pull reference.
    pub fn reference(&self, repo_tag: &str) -> String {
        format!("127.0.0.1:{}/{repo_tag}", self.port)
    }

    /// Pushes the OCI layout tarball `layout` to `repo_tag` with skopeo
    /// (which keeps the blobs as they are, digests included). skopeo
    /// unpacks the archive under `tmp`.
    pub async fn push(&self, layout: &Path, repo_tag: &str, tmp: &Path) -> anyhow::Result<()> {
        let mut cmd = tokio::process::Command::new("skopeo");
        cmd.args(["copy", "--quiet", "--dest-tls-verify=false"])
            .arg(format!("oci-archive:{}", layout.display()))
            .arg(format!("docker://{}", self.reference(repo_tag)))
            .env("TMPDIR", tmp)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        let out = tokio::time::timeout(IMAGE_TIMEOUT, cmd.output())
            .await
            .context("skopeo copy timed out")?
            .context("running skopeo")?;
        if !out.status.success() {
            bail!(
                "skopeo copy failed ({}): {}; registry log: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim(),
                self.log_text()
            );
        }
        Ok(())
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .trim()
            .to_owned()
    }

    /// Stops the registry: SIGKILL to its pid, then reaps it. It holds no
    /// state worth a graceful stop; its storage goes with the work dir.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        self.stop();
    }
}

/// SplitMix64: small, fast and seeded, so the layer is the same every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `lo..hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo)
    }
}

/// File contents of a given length, produced block by block (see the
/// module docs).
struct Content<'a> {
    rng: &'a mut Rng,
    words: &'a [Vec<u8>],
    left: u64,
    block: Vec<u8>,
    at: usize,
}

impl<'a> Content<'a> {
    fn new(rng: &'a mut Rng, words: &'a [Vec<u8>], len: u64) -> Self {
        Self {
            rng,
            words,
            left: len,
            block: Vec::with_capacity(BLOCK + 16),
            at: 0,
        }
    }

    fn refill(&mut self) {
        self.block.clear();
        self.at = 0;
        if self.rng.range(0, 100) < RANDOM_PERCENT {
            while self.block.len() < BLOCK {
                let word = self.rng.next();
                self.block.extend_from_slice(&word.to_le_bytes());
            }
        } else {
            while self.block.len() < BLOCK {
                let word = &self.words[self.rng.range(0, WORDS as u64) as usize];
                self.block.extend_from_slice(word);
                let sep = if self.rng.range(0, 12) == 0 {
                    b'\n'
                } else {
                    b' '
                };
                self.block.push(sep);
            }
        }
        self.block.truncate(BLOCK);
    }
}

impl Read for Content<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 || buf.is_empty() {
            return Ok(0);
        }
        if self.at == self.block.len() {
            self.refill();
        }
        let n = buf
            .len()
            .min(self.block.len() - self.at)
            .min(usize::try_from(self.left).unwrap_or(usize::MAX));
        buf[..n].copy_from_slice(&self.block[self.at..self.at + n]);
        self.at += n;
        self.left -= n as u64;
        Ok(n)
    }
}

/// A writer that hashes and counts what passes through it.
struct Hashing<W> {
    inner: W,
    hasher: Sha256,
    bytes: u64,
}

impl<W: Write> Hashing<W> {
    fn new(inner: W) -> Self {
        Self {
            inner,
            hasher: Sha256::new(),
            bytes: 0,
        }
    }

    /// Flushes and returns `sha256:<hex>` and the byte count.
    fn finish(mut self) -> io::Result<(String, u64)> {
        self.inner.flush()?;
        Ok((hex_digest(self.hasher.finalize().as_slice()), self.bytes))
    }
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

fn hex_digest(hash: &[u8]) -> String {
    let hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

fn sha256_of(bytes: &[u8]) -> String {
    hex_digest(Sha256::digest(bytes).as_slice())
}

fn header(kind: tar::EntryType, size: u64, mode: u32) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_size(size);
    h.set_mode(mode);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(MTIME);
    h
}

/// Writes the generated layer (see the module docs) as a plain tarball.
fn write_layer(path: &Path, mib: u64) -> anyhow::Result<(Blob, LayerShape)> {
    let mut rng = Rng(0x5eed_f1a7);
    let words: Vec<Vec<u8>> = (0..WORDS)
        .map(|_| {
            let len = rng.range(2, 13);
            (0..len).map(|_| b'a' + rng.range(0, 26) as u8).collect()
        })
        .collect();
    let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut tar = tar::Builder::new(Hashing::new(BufWriter::with_capacity(1 << 20, file)));
    let mut shape = LayerShape::default();
    let mut dir = |tar: &mut tar::Builder<_>, name: &str| -> io::Result<()> {
        shape.dirs += 1;
        let mut h = header(tar::EntryType::Directory, 0, 0o755);
        tar.append_data(&mut h, name, io::empty())
    };
    let total = mib << 20;
    let large_total = total * 60 / 100;
    let medium_total = total * 25 / 100;
    let small_total = total - large_total - medium_total;
    for d in ["bench/", "bench/large/", "bench/medium/", "bench/small/"] {
        dir(&mut tar, d)?;
    }
    let mut small_dirs = Vec::new();
    for a in 0..FANOUT {
        dir(&mut tar, &format!("bench/small/{a:02x}/"))?;
        for b in 0..FANOUT {
            let name = format!("bench/small/{a:02x}/{b:02x}/");
            dir(&mut tar, &name)?;
            small_dirs.push(name);
        }
    }

    let add_file = |tar: &mut tar::Builder<_>,
                    rng: &mut Rng,
                    name: &str,
                    size: u64,
                    mode: u32|
     -> io::Result<()> {
        let mut h = header(tar::EntryType::Regular, size, mode);
        tar.append_data(&mut h, name, Content::new(rng, &words, size))
    };
    let large_each = large_total / 4;
    for i in 0..4 {
        let size = if i == 3 {
            large_total - 3 * large_each
        } else {
            large_each
        };
        add_file(
            &mut tar,
            &mut rng,
            &format!("bench/large/blob-{i}.bin"),
            size,
            0o644,
        )?;
        shape.large_files += 1;
        shape.file_bytes += size;
    }
    let mut left = medium_total;
    while left > 0 {
        let size = rng.range(64 << 10, 1 << 20).min(left);
        let name = format!("bench/medium/m{:04}.so", shape.medium_files);
        add_file(&mut tar, &mut rng, &name, size, 0o755)?;
        shape.medium_files += 1;
        shape.file_bytes += size;
        left -= size;
    }
    let mut left = small_total;
    while left > 0 {
        let size = rng.range(0, 8 << 10).min(left);
        let parent = &small_dirs[shape.small_files as usize % small_dirs.len()];
        let name = format!("{parent}f{:06}.txt", shape.small_files);
        add_file(&mut tar, &mut rng, &name, size, 0o644)?;
        shape.small_files += 1;
        shape.file_bytes += size;
        // Empty files stay in: real layers have them too.
        left -= size;
    }
    let (digest, size) = tar.into_inner()?.finish()?;
    Ok((
        Blob {
            path: path.to_owned(),
            digest,
            size,
        },
        shape,
    ))
}

/// gzips `src` (default level, as `docker push` and most builders use) into
/// `dst`.
fn gzip_file(src: &Path, dst: &Path) -> anyhow::Result<Blob> {
    let input = File::open(src).with_context(|| format!("opening {}", src.display()))?;
    gzip_reader(BufReader::with_capacity(1 << 20, input), dst)
}

fn gzip_file_from(bytes: &[u8], dst: &Path) -> anyhow::Result<Blob> {
    gzip_reader(bytes, dst)
}

fn gzip_reader(mut input: impl Read, dst: &Path) -> anyhow::Result<Blob> {
    let output = File::create(dst).with_context(|| format!("creating {}", dst.display()))?;
    let mut enc = flate2::write::GzEncoder::new(
        Hashing::new(BufWriter::with_capacity(1 << 20, output)),
        flate2::Compression::default(),
    );
    io::copy(&mut input, &mut enc).with_context(|| format!("writing {}", dst.display()))?;
    let (digest, size) = enc.finish()?.finish()?;
    Ok(Blob {
        path: dst.to_owned(),
        digest,
        size,
    })
}

/// Copies the gzip file `src` to `dst` with `mtime` in its header (RFC 1952:
/// bytes 4 to 7, little-endian). The header has no checksum of its own
/// unless FHCRC is set, which flate2 never sets; the trailer's CRC covers the
/// uncompressed data only, so the copy is valid and decompresses to the same
/// bytes.
fn restamp_gzip(src: &Path, dst: &Path, mtime: u32) -> anyhow::Result<Blob> {
    let mut input = BufReader::with_capacity(
        1 << 20,
        File::open(src).with_context(|| src.display().to_string())?,
    );
    let mut header = [0u8; 10];
    input.read_exact(&mut header)?;
    ensure!(
        header[..3] == [0x1f, 0x8b, 8] && header[3] & 0x02 == 0,
        "{} is not a gzip file without a header CRC",
        src.display()
    );
    header[4..8].copy_from_slice(&mtime.to_le_bytes());
    let output = File::create(dst).with_context(|| format!("creating {}", dst.display()))?;
    let mut out = Hashing::new(BufWriter::with_capacity(1 << 20, output));
    out.write_all(&header)?;
    io::copy(&mut input, &mut out)?;
    let (digest, size) = out.finish()?;
    Ok(Blob {
        path: dst.to_owned(),
        digest,
        size,
    })
}

/// A layer of a layout: its (gzip) blob and the digest of its uncompressed
/// tar (the config's `diff_id`).
struct LayoutLayer {
    blob: Blob,
    diff_id: String,
}

/// Writes a tarball of an OCI image layout holding one image for this
/// host's platform, with `layers` (base first) as gzip layers.
fn write_layout(path: &Path, layers: &[&LayoutLayer]) -> anyhow::Result<()> {
    let architecture = runbox_image::pull::oci_architecture(std::env::consts::ARCH);
    let config = serde_json::json!({
        "architecture": architecture,
        "os": "linux",
        "config": {"Env": [PATH_ENV]},
        "rootfs": {
            "type": "layers",
            "diff_ids": layers.iter().map(|l| l.diff_id.as_str()).collect::<Vec<_>>(),
        },
    });
    let config = serde_json::to_vec(&config)?;
    let layer_descs: Vec<serde_json::Value> = layers
        .iter()
        .map(|l| {
            serde_json::json!({
                "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                "digest": l.blob.digest,
                "size": l.blob.size,
            })
        })
        .collect();
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": sha256_of(&config),
            "size": config.len(),
        },
        "layers": layer_descs,
    }))?;
    let index = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": sha256_of(&manifest),
            "size": manifest.len(),
            "platform": {"os": "linux", "architecture": architecture},
        }],
    }))?;

    let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut tar = tar::Builder::new(BufWriter::with_capacity(1 << 20, file));
    let blob_name = |digest: &str| format!("blobs/sha256/{}", &digest["sha256:".len()..]);
    for dir in ["blobs/", "blobs/sha256/"] {
        let mut h = header(tar::EntryType::Directory, 0, 0o755);
        tar.append_data(&mut h, dir, io::empty())?;
    }
    let small = |tar: &mut tar::Builder<_>, name: &str, bytes: &[u8]| -> io::Result<()> {
        let mut h = header(tar::EntryType::Regular, bytes.len() as u64, 0o644);
        tar.append_data(&mut h, name, bytes)
    };
    small(&mut tar, "oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#)?;
    for layer in layers {
        let blob = File::open(&layer.blob.path)
            .with_context(|| format!("opening {}", layer.blob.path.display()))?;
        let mut h = header(tar::EntryType::Regular, layer.blob.size, 0o644);
        tar.append_data(&mut h, blob_name(&layer.blob.digest), blob)?;
    }
    small(&mut tar, &blob_name(&sha256_of(&config)), &config)?;
    small(&mut tar, &blob_name(&sha256_of(&manifest)), &manifest)?;
    small(&mut tar, "index.json", &index)?;
    tar.into_inner()?.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_is_deterministic_and_exactly_as_long_as_asked() {
        let words = vec![b"ab".to_vec(); WORDS];
        let read = |seed| {
            let mut rng = Rng(seed);
            let mut out = Vec::new();
            Content::new(&mut rng, &words, 10_000)
                .read_to_end(&mut out)
                .unwrap();
            out
        };
        let one = read(7);
        assert_eq!(one.len(), 10_000);
        assert_eq!(one, read(7));
        assert_ne!(one, read(8));
    }

    #[test]
    fn a_restamped_gzip_has_another_digest_and_the_same_contents() {
        let dir = tempfile::tempdir().unwrap();
        let data = b"the same bytes either way".repeat(100);
        let original = gzip_file_from(&data, &dir.path().join("a.gz")).unwrap();
        let copy = restamp_gzip(&original.path, &dir.path().join("b.gz"), 7).unwrap();
        assert_ne!(copy.digest, original.digest);
        assert_eq!(copy.size, original.size);
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(File::open(&copy.path).unwrap())
            .read_to_end(&mut out)
            .unwrap();
        assert_eq!(out, data);
    }

    #[test]
    fn a_small_layer_has_every_kind_of_file_and_unpacks() {
        let dir = tempfile::tempdir().unwrap();
        let (blob, shape) = write_layer(&dir.path().join("l.tar"), 1).unwrap();
        assert_eq!(shape.file_bytes, 1 << 20);
        assert_eq!(shape.large_files, 4);
        assert!(shape.medium_files >= 1 && shape.small_files > 10);
        assert_eq!(shape.dirs, 4 + 16 + 256);
        let mut sum = 0;
        let mut files = 0;
        let mut archive = tar::Archive::new(File::open(&blob.path).unwrap());
        for entry in archive.entries().unwrap() {
            let entry = entry.unwrap();
            if entry.header().entry_type().is_file() {
                sum += entry.size();
                files += 1;
            }
        }
        assert_eq!(sum, shape.file_bytes);
        assert_eq!(
            files,
            shape.large_files + shape.medium_files + shape.small_files
        );
        let bytes = std::fs::read(&blob.path).unwrap();
        assert_eq!(sha256_of(&bytes), blob.digest);
        assert_eq!(bytes.len() as u64, blob.size);
    }
}
