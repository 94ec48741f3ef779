//! Reading images that arrive as files: an OCI image layout (a directory, or a
//! tarball of one) and a `docker save` tarball.
//!
//! Both are read from a *staging directory*: the caller first extracts the
//! archive with [`stage_archive`] (plain files and directories only, names
//! checked), then [`read_staged`] finds the format, resolves the image for
//! this platform and returns its config and its layer blobs in order, each
//! with a digest that is verified against the blob's bytes.
//!
//! It does not unpack layers or store anything: that is the store's job.

use std::fs::{self, File};
use std::io::{self, Read};
use std::path::{Component, Path, PathBuf};

use serde::Deserialize;
use sha2::{Digest, Sha256};

/// Most bytes a staged archive may hold.
pub const MAX_STAGED_BYTES: u64 = 64 << 30;
/// Largest JSON document (index, manifest, config) that is parsed.
pub const MAX_JSON_BYTES: u64 = 4 << 20;

/// Why an archive could not be read as an image.
#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    /// The archive is neither an OCI layout nor a `docker save` tarball.
    #[error("not an image archive: {0}")]
    Unknown(String),
    /// The archive breaks a rule (entry names, sizes, links).
    #[error("bad image archive: {0}")]
    Bad(String),
    /// A blob's bytes do not match its digest.
    #[error("blob {name} has digest {actual}, expected {expected}")]
    DigestMismatch {
        /// The blob.
        name: String,
        /// What the manifest says.
        expected: String,
        /// What the bytes hash to.
        actual: String,
    },
    /// The layout has no image for this platform.
    #[error("no image for {wanted} in the archive (it has: {available})")]
    NoPlatform {
        /// The platform looked for.
        wanted: String,
        /// The platforms present.
        available: String,
    },
    /// Reading or writing failed.
    #[error("{context}")]
    Io {
        /// What was being done.
        context: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

fn io_err(context: impl Into<String>) -> impl FnOnce(io::Error) -> LayoutError {
    let context = context.into();
    move |source| LayoutError::Io { context, source }
}

/// One layer blob of a staged image, base layer first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagedLayer {
    /// `sha256:<hex>` of the blob as stored (compressed or not).
    pub digest: String,
    /// The blob file in the staging directory.
    pub path: PathBuf,
}

/// An image read from a staging directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagedImage {
    /// The image config JSON, digest-verified.
    pub config: Vec<u8>,
    /// The layers, base first.
    pub layers: Vec<StagedLayer>,
    /// Which format it came in (`oci-layout` or `docker-save`).
    pub format: &'static str,
}

/// Extracts a tar stream into `dir` (which must exist and be empty), as the
/// tools that write image archives lay them out (`docker save`, `podman
/// save`, `skopeo copy` to `docker-archive:` or `oci-archive:`, an OCI
/// layout tarred). Blocking.
///
/// Only directories and regular files are ever made below `dir`, so the
/// staging directory can never be a way to reach other files:
/// - entry names must be relative without `..` (refused otherwise);
/// - a link (symbolic or hard) whose target, resolved inside the archive,
///   is a regular file of the archive becomes a hard link to that staged
///   file: skopeo and older Docker name a shared layer twice that way. Any
///   other link (one that leaves the archive, or names a directory or
///   nothing) is left out; it matters only if the manifest names it, and
///   [`read_staged`] then says so;
/// - devices, FIFOs and tar's own global headers are left out: neither
///   format uses them.
pub fn stage_archive(reader: impl Read, dir: &Path, max_bytes: u64) -> Result<(), LayoutError> {
    let mut archive = tar::Archive::new(reader);
    let mut total = 0u64;
    // (the link's path, the path it resolves to), both inside `dir`.
    let mut links: Vec<(PathBuf, Option<PathBuf>)> = Vec::new();
    for entry in archive.entries().map_err(io_err("reading the archive"))? {
        let mut entry = entry.map_err(io_err("reading the archive"))?;
        let name = entry
            .path()
            .map_err(io_err("reading an entry name"))?
            .into_owned();
        let rel = inside_archive(Path::new(""), &name).ok_or_else(|| {
            LayoutError::Bad(format!(
                "entry {} is absolute or contains `..`",
                name.display()
            ))
        })?;
        let kind = entry.header().entry_type();
        let target = dir.join(&rel);
        if kind.is_dir() {
            fs::create_dir_all(&target).map_err(io_err(format!("creating {}", rel.display())))?;
            continue;
        }
        if kind.is_symlink() || kind.is_hard_link() {
            let to = entry
                .link_name()
                .map_err(io_err(format!("reading the target of {}", rel.display())))?
                .map(|t| t.into_owned());
            // A symbolic link is relative to its own directory, a hard
            // link's target to the archive's top.
            let base = match kind.is_symlink() {
                true => rel.parent().unwrap_or(Path::new("")).to_owned(),
                false => PathBuf::new(),
            };
            links.push((rel, to.and_then(|to| inside_archive(&base, &to))));
            continue;
        }
        if !kind.is_file() || rel.as_os_str().is_empty() {
            continue;
        }
        total = total.saturating_add(entry.header().size().unwrap_or(0));
        if total > max_bytes {
            return Err(LayoutError::Bad(format!(
                "the archive holds more than {max_bytes} bytes"
            )));
        }
        if let Some(parent) = target.parent() {
            fs::create_dir_all(parent)
                .map_err(io_err(format!("creating the parent of {}", rel.display())))?;
        }
        // Only directories and regular files exist below `dir` (both created
        // here), so no path component can be a link leading elsewhere.
        let mut out = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&target)
            .map_err(io_err(format!("writing {}", rel.display())))?;
        io::copy(&mut entry, &mut out).map_err(io_err(format!("writing {}", rel.display())))?;
    }
    // Links last, as their targets may come after them; a link to a link
    // resolves once its target has (a few rounds at most).
    for _ in 0..8 {
        let mut progress = false;
        for (link, to) in &mut links {
            let Some(source) = to.as_ref().map(|t| dir.join(t)) else {
                continue;
            };
            let is_file = fs::symlink_metadata(&source).is_ok_and(|m| m.file_type().is_file());
            let made = dir.join(&*link);
            if !is_file || fs::symlink_metadata(&made).is_ok() {
                continue;
            }
            if let Some(parent) = made.parent() {
                fs::create_dir_all(parent)
                    .map_err(io_err(format!("creating the parent of {}", link.display())))?;
            }
            fs::hard_link(&source, &made).map_err(io_err(format!("linking {}", link.display())))?;
            *to = None;
            progress = true;
        }
        if !progress {
            break;
        }
    }
    Ok(())
}

/// `name` taken from `base` inside an archive, normalised: None when it is
/// absolute or climbs above the archive's top.
fn inside_archive(base: &Path, name: &Path) -> Option<PathBuf> {
    let mut out = base.to_owned();
    for component in name.components() {
        match component {
            Component::Normal(part) => out.push(part),
            Component::CurDir => {}
            Component::ParentDir => {
                if !out.pop() {
                    return None;
                }
            }
            Component::RootDir | Component::Prefix(_) => return None,
        }
    }
    Some(out)
}

/// What to tell someone whose archive could not be read as an image.
const FORMS: &str = "runbox imports `docker save` and `podman save` output, `skopeo copy ... \
     docker-archive:FILE` or `oci-archive:FILE`, and an OCI image layout (a directory or its tar)";

/// The platform to pick from a multi-platform layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Platform {
    /// OCI os name, `linux`.
    pub os: String,
    /// OCI architecture name (`amd64`, `arm64`, ...).
    pub architecture: String,
}

impl Platform {
    /// This host's platform in OCI names.
    pub fn host() -> Platform {
        let architecture = match std::env::consts::ARCH {
            "x86_64" => "amd64",
            "aarch64" => "arm64",
            "x86" => "386",
            other => other,
        };
        Platform {
            os: "linux".into(),
            architecture: architecture.into(),
        }
    }
}

impl std::fmt::Display for Platform {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.os, self.architecture)
    }
}

#[derive(Deserialize)]
struct Index {
    #[serde(default)]
    manifests: Vec<Descriptor>,
}

#[derive(Deserialize, Clone)]
#[serde(rename_all = "camelCase")]
struct Descriptor {
    #[serde(default)]
    media_type: String,
    digest: String,
    #[serde(default)]
    platform: Option<DescPlatform>,
}

#[derive(Deserialize, Clone)]
struct DescPlatform {
    os: String,
    architecture: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Manifest {
    #[serde(default)]
    media_type: String,
    config: Descriptor,
    layers: Vec<Descriptor>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct DockerSaveEntry {
    config: String,
    layers: Vec<String>,
}

/// Finds the image in a staged archive and verifies every blob it uses.
pub fn read_staged(dir: &Path, platform: &Platform) -> Result<StagedImage, LayoutError> {
    if dir.join("index.json").is_file() && dir.join("oci-layout").is_file() {
        return read_oci_layout(dir, platform);
    }
    if dir.join("manifest.json").is_file() {
        return read_docker_save(dir);
    }
    Err(LayoutError::Unknown(format!(
        "found neither index.json + oci-layout (an OCI layout) nor manifest.json (a `docker save` \
         tarball); {FORMS}"
    )))
}

fn read_json<T: for<'de> Deserialize<'de>>(
    path: &Path,
    what: &str,
) -> Result<(Vec<u8>, T), LayoutError> {
    let bytes = read_bounded(path, what)?;
    let value = serde_json::from_slice(&bytes)
        .map_err(|e| LayoutError::Bad(format!("{what} is not valid: {e}")))?;
    Ok((bytes, value))
}

fn read_bounded(path: &Path, what: &str) -> Result<Vec<u8>, LayoutError> {
    let file = File::open(path).map_err(io_err(format!("opening {what}")))?;
    let mut bytes = Vec::new();
    file.take(MAX_JSON_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(io_err(format!("reading {what}")))?;
    if bytes.len() as u64 > MAX_JSON_BYTES {
        return Err(LayoutError::Bad(format!(
            "{what} is larger than {MAX_JSON_BYTES} bytes"
        )));
    }
    Ok(bytes)
}

/// The path of blob `digest` in an OCI layout, refusing anything but sha256.
fn blob_path(dir: &Path, digest: &str) -> Result<PathBuf, LayoutError> {
    let hex = crate::store::digest_hex(digest)
        .map_err(|_| LayoutError::Bad(format!("digest {digest:?} is not a sha256 digest")))?;
    Ok(dir.join("blobs").join("sha256").join(hex))
}

/// The staged blob `digest` of an OCI layout, which must be there.
fn staged_blob(dir: &Path, digest: &str) -> Result<PathBuf, LayoutError> {
    let path = blob_path(dir, digest)?;
    held(&path, &format!("the layout names blob {digest}"))?;
    Ok(path)
}

/// Checks that the archive holds `path` as a file; `names` says who named it.
fn held(path: &Path, names: &str) -> Result<(), LayoutError> {
    if fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_file()) {
        return Ok(());
    }
    Err(LayoutError::Bad(format!(
        "{names}, which the archive does not hold as a file (links that leave the archive or \
         name a directory are not followed); {FORMS}"
    )))
}

/// `sha256:<hex>` of a file's bytes.
pub fn file_digest(path: &Path) -> Result<String, LayoutError> {
    let mut file = File::open(path).map_err(io_err(format!("opening {}", path.display())))?;
    let mut hasher = Sha256::new();
    io::copy(&mut file, &mut hasher).map_err(io_err(format!("reading {}", path.display())))?;
    Ok(format!("sha256:{}", hex(&hasher.finalize())))
}

/// Lower-case hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn verify(path: &Path, expected: &str, name: &str) -> Result<(), LayoutError> {
    let actual = file_digest(path)?;
    if actual != expected {
        return Err(LayoutError::DigestMismatch {
            name: name.to_owned(),
            expected: expected.to_owned(),
            actual,
        });
    }
    Ok(())
}

const INDEX_TYPES: &[&str] = &[
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
];

fn read_oci_layout(dir: &Path, platform: &Platform) -> Result<StagedImage, LayoutError> {
    let (_, index): (_, Index) = read_json(&dir.join("index.json"), "index.json")?;
    let mut manifest_desc = pick(&index.manifests, platform)?;
    // A layout's index may point at a nested index (as `docker save` of a
    // multi-platform image writes); follow at most a few levels.
    for _ in 0..4 {
        if !INDEX_TYPES.contains(&manifest_desc.media_type.as_str()) {
            break;
        }
        let path = staged_blob(dir, &manifest_desc.digest)?;
        verify(&path, &manifest_desc.digest, "a nested index")?;
        let (_, nested): (_, Index) = read_json(&path, "a nested index")?;
        manifest_desc = pick(&nested.manifests, platform)?;
    }
    let manifest_path = staged_blob(dir, &manifest_desc.digest)?;
    verify(&manifest_path, &manifest_desc.digest, "the manifest")?;
    let (_, manifest): (_, Manifest) = read_json(&manifest_path, "the manifest")?;
    if INDEX_TYPES.contains(&manifest.media_type.as_str()) {
        return Err(LayoutError::Bad("indexes nest too deeply".into()));
    }
    let config_path = staged_blob(dir, &manifest.config.digest)?;
    verify(&config_path, &manifest.config.digest, "the config")?;
    let config = read_bounded(&config_path, "the config")?;
    let mut layers = Vec::new();
    for layer in &manifest.layers {
        check_layer_media_type(&layer.media_type)?;
        let path = staged_blob(dir, &layer.digest)?;
        verify(&path, &layer.digest, &format!("layer {}", layer.digest))?;
        layers.push(StagedLayer {
            digest: layer.digest.clone(),
            path,
        });
    }
    Ok(StagedImage {
        config,
        layers,
        format: "oci-layout",
    })
}

/// Refuses layer kinds runbox cannot unpack.
fn check_layer_media_type(media_type: &str) -> Result<(), LayoutError> {
    let ok = media_type.is_empty()
        || media_type.starts_with("application/vnd.oci.image.layer.v1.tar")
        || media_type.starts_with("application/vnd.docker.image.rootfs.diff.tar");
    let foreign = media_type.contains("nondistributable") || media_type.contains("foreign");
    if ok && !foreign {
        Ok(())
    } else {
        Err(LayoutError::Bad(format!(
            "layer media type {media_type:?} is not supported"
        )))
    }
}

/// Picks the manifest for `platform`: the only one when there is one, else
/// the one whose platform matches.
fn pick(manifests: &[Descriptor], platform: &Platform) -> Result<Descriptor, LayoutError> {
    match manifests {
        [] => Err(LayoutError::Bad("index.json lists no manifest".into())),
        [only] if only.platform.is_none() => Ok(only.clone()),
        many => many
            .iter()
            .find(|d| {
                d.platform
                    .as_ref()
                    .is_some_and(|p| p.os == platform.os && p.architecture == platform.architecture)
            })
            .cloned()
            .ok_or_else(|| LayoutError::NoPlatform {
                wanted: platform.to_string(),
                available: many
                    .iter()
                    .filter_map(|d| {
                        d.platform
                            .as_ref()
                            .map(|p| format!("{}/{}", p.os, p.architecture))
                    })
                    .collect::<Vec<_>>()
                    .join(", "),
            }),
    }
}

fn read_docker_save(dir: &Path) -> Result<StagedImage, LayoutError> {
    let (_, entries): (_, Vec<DockerSaveEntry>) =
        read_json(&dir.join("manifest.json"), "manifest.json")?;
    let entry = match entries.as_slice() {
        [one] => one,
        [] => return Err(LayoutError::Bad("manifest.json lists no image".into())),
        _ => {
            return Err(LayoutError::Bad(
                "the tarball holds several images; save one image per file".into(),
            ))
        }
    };
    let inside = |name: &str| -> Result<PathBuf, LayoutError> {
        let rel = Path::new(name);
        if rel.components().all(|c| matches!(c, Component::Normal(_))) {
            let path = dir.join(rel);
            held(&path, &format!("manifest.json names {name:?}"))?;
            Ok(path)
        } else {
            Err(LayoutError::Bad(format!(
                "manifest.json names {name:?}, which is not a plain relative path"
            )))
        }
    };
    let config_path = inside(&entry.config)?;
    let config = read_bounded(&config_path, "the config")?;
    // Docker names the config after its digest (`<hex>.json` in old saves,
    // `blobs/sha256/<hex>` in new ones); check it when the name says so.
    let stem = config_path
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("");
    if stem.len() == 64 && stem.bytes().all(|b| b.is_ascii_hexdigit()) {
        verify(&config_path, &format!("sha256:{stem}"), "the config")?;
    }
    let mut layers = Vec::new();
    for name in &entry.layers {
        let path = inside(name)?;
        // Old saves name layers `<id>/layer.tar` (no digest in the name), so
        // the digest is computed; new saves name them by digest and are checked.
        let digest = file_digest(&path)?;
        let named = path.file_name().and_then(|s| s.to_str()).unwrap_or("");
        if named.len() == 64
            && named.bytes().all(|b| b.is_ascii_hexdigit())
            && digest != format!("sha256:{named}")
        {
            return Err(LayoutError::DigestMismatch {
                name: name.clone(),
                expected: format!("sha256:{named}"),
                actual: digest,
            });
        }
        layers.push(StagedLayer { digest, path });
    }
    Ok(StagedImage {
        config,
        layers,
        format: "docker-save",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sha(bytes: &[u8]) -> String {
        format!("sha256:{}", hex(&Sha256::digest(bytes)))
    }

    fn put_blob(dir: &Path, bytes: &[u8]) -> String {
        let digest = sha(bytes);
        let path = blob_path(dir, &digest).unwrap();
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, bytes).unwrap();
        digest
    }

    fn oci_layout(dir: &Path, arches: &[&str]) -> Vec<String> {
        fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
        let mut manifests = Vec::new();
        let mut layer_digests = Vec::new();
        for arch in arches {
            let layer = put_blob(dir, format!("layer for {arch}").as_bytes());
            layer_digests.push(layer.clone());
            let config = put_blob(
                dir,
                format!(r#"{{"architecture":"{arch}","os":"linux"}}"#).as_bytes(),
            );
            let manifest = format!(
                r#"{{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"{config}","size":1}},"layers":[{{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"{layer}","size":1}}]}}"#
            );
            let digest = put_blob(dir, manifest.as_bytes());
            manifests.push(format!(
                r#"{{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"{digest}","size":1,"platform":{{"os":"linux","architecture":"{arch}"}}}}"#
            ));
        }
        fs::write(
            dir.join("index.json"),
            format!(
                r#"{{"schemaVersion":2,"manifests":[{}]}}"#,
                manifests.join(",")
            ),
        )
        .unwrap();
        layer_digests
    }

    #[test]
    fn oci_layout_picks_the_platform_and_verifies_blobs() {
        let dir = tempfile::tempdir().unwrap();
        let layers = oci_layout(dir.path(), &["arm64", "amd64"]);
        let amd64 = Platform {
            os: "linux".into(),
            architecture: "amd64".into(),
        };
        let image = read_staged(dir.path(), &amd64).unwrap();
        assert_eq!(image.format, "oci-layout");
        assert_eq!(
            image
                .layers
                .iter()
                .map(|l| l.digest.clone())
                .collect::<Vec<_>>(),
            vec![layers[1].clone()]
        );
        assert!(String::from_utf8_lossy(&image.config).contains("amd64"));
        let riscv = Platform {
            os: "linux".into(),
            architecture: "riscv64".into(),
        };
        let err = read_staged(dir.path(), &riscv).unwrap_err();
        assert!(
            err.to_string().contains("linux/arm64, linux/amd64"),
            "{err}"
        );
        // Tampering with a layer is caught.
        fs::write(blob_path(dir.path(), &layers[1]).unwrap(), b"evil").unwrap();
        assert!(matches!(
            read_staged(dir.path(), &amd64),
            Err(LayoutError::DigestMismatch { .. })
        ));
    }

    #[test]
    fn docker_save_reads_layers_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let config = br#"{"config":{"Env":["A=1"]}}"#;
        let config_name = format!("{}.json", &sha(config)[7..]);
        fs::write(dir.path().join(&config_name), config).unwrap();
        for (i, name) in ["aaa/layer.tar", "bbb/layer.tar"].iter().enumerate() {
            fs::create_dir_all(dir.path().join(name).parent().unwrap()).unwrap();
            fs::write(dir.path().join(name), format!("layer {i}")).unwrap();
        }
        fs::write(
            dir.path().join("manifest.json"),
            format!(r#"[{{"Config":"{config_name}","RepoTags":["x:1"],"Layers":["aaa/layer.tar","bbb/layer.tar"]}}]"#),
        )
        .unwrap();
        let image = read_staged(dir.path(), &Platform::host()).unwrap();
        assert_eq!(image.format, "docker-save");
        assert_eq!(image.layers[0].digest, sha(b"layer 0"));
        assert_eq!(image.layers[1].digest, sha(b"layer 1"));
        assert_eq!(image.config, config);
        // A manifest that points outside the staging directory is refused.
        fs::write(
            dir.path().join("manifest.json"),
            r#"[{"Config":"../x.json","Layers":[]}]"#,
        )
        .unwrap();
        assert!(matches!(
            read_staged(dir.path(), &Platform::host()),
            Err(LayoutError::Bad(_))
        ));
    }

    #[test]
    fn staging_refuses_escapes_and_leaves_foreign_links_out() {
        // An entry named outside the archive is refused.
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_size(1);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        h.as_gnu_mut().unwrap().name[..7].copy_from_slice(b"../evil");
        h.set_cksum();
        b.append(&h, &b"x"[..]).unwrap();
        let tar = b.into_inner().unwrap();
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(
            stage_archive(tar.as_slice(), dir.path(), 1 << 20),
            Err(LayoutError::Bad(_))
        ));
        // Links out of the archive, to directories or to nothing, devices
        // and FIFOs: left out, nothing made for them.
        let mut b = tar::Builder::new(Vec::new());
        for (name, target) in [
            ("blobs", "/etc"),
            ("up", "../../etc/passwd"),
            ("none", "nowhere"),
            ("d", "."),
        ] {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(tar::EntryType::Symlink);
            h.set_size(0);
            h.set_mode(0o777);
            b.append_link(&mut h, name, target).unwrap();
        }
        for (name, kind) in [
            ("fifo", tar::EntryType::Fifo),
            ("dev", tar::EntryType::Char),
        ] {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(kind);
            h.set_size(0);
            h.set_mode(0o644);
            b.append_data(&mut h, name, &b""[..]).unwrap();
        }
        let tar = b.into_inner().unwrap();
        let dir = tempfile::tempdir().unwrap();
        stage_archive(tar.as_slice(), dir.path(), 1 << 20).unwrap();
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
        let other = tempfile::tempdir().unwrap();
        let unknown = read_staged(other.path(), &Platform::host()).unwrap_err();
        assert!(matches!(unknown, LayoutError::Unknown(_)));
        assert!(unknown.to_string().contains("skopeo"), "{unknown}");
    }

    /// What `skopeo copy ... docker-archive:` and `podman save` write: layers
    /// by digest, a legacy `<id>/layer.tar` symlink to each (not named by
    /// the manifest), a hard link for a layer named twice.
    #[test]
    fn docker_archives_with_links_stage_as_files() {
        let layer = b"layer bytes".to_vec();
        let layer_name = format!("{}.tar", &sha(&layer)[7..]);
        let config = br#"{"config":{}}"#.to_vec();
        let config_name = format!("{}.json", &sha(&config)[7..]);
        let manifest = format!(
            r#"[{{"Config":"{config_name}","Layers":["{layer_name}","again/layer.tar","legacy/layer.tar"]}}]"#
        );
        let mut b = tar::Builder::new(Vec::new());
        let file = |b: &mut tar::Builder<Vec<u8>>, name: &str, bytes: &[u8]| {
            let mut h = tar::Header::new_gnu();
            h.set_size(bytes.len() as u64);
            h.set_mode(0o644);
            b.append_data(&mut h, name, bytes).unwrap();
        };
        // A link before its target, as archives may order them.
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Symlink);
        h.set_size(0);
        h.set_mode(0o777);
        b.append_link(&mut h, "legacy/layer.tar", format!("../{layer_name}"))
            .unwrap();
        file(&mut b, &layer_name, &layer);
        file(&mut b, &config_name, &config);
        file(&mut b, "manifest.json", manifest.as_bytes());
        file(&mut b, "repositories", b"{}");
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Link);
        h.set_size(0);
        h.set_mode(0o644);
        b.append_link(&mut h, "again/layer.tar", &layer_name)
            .unwrap();
        // An unreferenced symlink out of the archive: left out.
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Symlink);
        h.set_size(0);
        h.set_mode(0o777);
        b.append_link(&mut h, "escape/layer.tar", "../../../etc/shadow")
            .unwrap();
        let tar = b.into_inner().unwrap();
        let dir = tempfile::tempdir().unwrap();
        stage_archive(tar.as_slice(), dir.path(), 1 << 20).unwrap();
        let image = read_staged(dir.path(), &Platform::host()).unwrap();
        assert_eq!(image.layers.len(), 3);
        assert!(image.layers.iter().all(|l| l.digest == sha(&layer)));
        assert!(!dir.path().join("escape/layer.tar").exists());
        // No link is left below the staging directory.
        for entry in walk(dir.path()) {
            assert!(
                !fs::symlink_metadata(&entry)
                    .unwrap()
                    .file_type()
                    .is_symlink(),
                "{entry:?}"
            );
        }
        // A manifest that names the link out of the archive says so.
        fs::write(
            dir.path().join("manifest.json"),
            format!(r#"[{{"Config":"{config_name}","Layers":["escape/layer.tar"]}}]"#),
        )
        .unwrap();
        let refused = read_staged(dir.path(), &Platform::host()).unwrap_err();
        assert!(
            refused.to_string().contains("escape/layer.tar"),
            "{refused}"
        );
        assert!(refused.to_string().contains("oci-archive"), "{refused}");
    }

    fn walk(dir: &Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for entry in fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if fs::symlink_metadata(&path).unwrap().is_dir() {
                out.extend(walk(&path));
            }
            out.push(path);
        }
        out
    }
}
