//! Builds test images as OCI image layouts on disk: tar layers (made with
//! the `tar` crate, gzipped with flate2), configs, manifests and indexes
//! written by hand, every digest computed here.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
pub const OCI_TAR: &str = "application/vnd.oci.image.layer.v1.tar";
pub const OCI_TAR_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";

pub fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{:x}", Sha256::digest(bytes))
}

/// One entry of a tar layer.
pub enum Entry<'a> {
    Dir(&'a str),
    File(&'a str, &'a [u8]),
}

/// A tar archive of `entries`, with fixed owners and times so that the same
/// entries always give the same bytes.
pub fn tar(entries: &[Entry<'_>]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for e in entries {
        let mut h = tar::Header::new_gnu();
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_700_000_000);
        match e {
            Entry::Dir(path) => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_mode(0o755);
                h.set_size(0);
                b.append_data(&mut h, path, std::io::empty()).unwrap();
            }
            Entry::File(path, data) => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_mode(0o644);
                h.set_size(data.len() as u64);
                b.append_data(&mut h, path, *data).unwrap();
            }
        }
    }
    b.into_inner().unwrap()
}

/// `bytes` gzipped, with no name and no time in the header.
pub fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = flate2::GzBuilder::new()
        .mtime(0)
        .write(Vec::new(), flate2::Compression::default());
    enc.write_all(bytes).unwrap();
    enc.finish().unwrap()
}

/// Reads the entry names of a (possibly gzipped) tar layer.
pub fn tar_names(blob: &[u8]) -> Vec<String> {
    let raw = if blob.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(blob), &mut out).unwrap();
        out
    } else {
        blob.to_vec()
    };
    let mut archive = tar::Archive::new(&raw[..]);
    archive
        .entries()
        .unwrap()
        .map(|e| e.unwrap().path().unwrap().to_string_lossy().into_owned())
        .collect()
}

/// A blob with its media type and digest.
#[derive(Clone, Debug)]
pub struct Blob {
    pub media_type: String,
    pub bytes: Vec<u8>,
    pub digest: String,
}

impl Blob {
    pub fn new(media_type: &str, bytes: Vec<u8>) -> Self {
        let digest = sha256(&bytes);
        Self {
            media_type: media_type.to_string(),
            bytes,
            digest,
        }
    }

    pub fn descriptor(&self) -> Value {
        json!({"mediaType": self.media_type, "digest": self.digest, "size": self.bytes.len()})
    }
}

/// A built image: its manifest, config and layers.
#[derive(Clone, Debug)]
pub struct Image {
    pub manifest: Blob,
    pub config: Blob,
    pub layers: Vec<Blob>,
}

/// An OCI image layout being written.
pub struct Layout {
    pub dir: PathBuf,
    refs: Vec<Value>,
}

impl Layout {
    pub fn new(dir: &Path) -> Self {
        std::fs::create_dir_all(dir.join("blobs/sha256")).unwrap();
        std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
        Self {
            dir: dir.to_path_buf(),
            refs: Vec::new(),
        }
    }

    pub fn add_blob(&mut self, blob: &Blob) {
        let hex = blob.digest.strip_prefix("sha256:").unwrap();
        std::fs::write(self.dir.join("blobs/sha256").join(hex), &blob.bytes).unwrap();
    }

    /// Adds an image with `layers` for `arch`, with a config whose
    /// diff_ids match the layers.
    pub fn add_image(&mut self, arch: &str, layers: Vec<Blob>) -> Image {
        self.add_image_as(OCI_MANIFEST, OCI_CONFIG, arch, layers)
    }

    /// Like [`Layout::add_image`] with the given manifest and config media
    /// types.
    pub fn add_image_as(
        &mut self,
        manifest_type: &str,
        config_type: &str,
        arch: &str,
        layers: Vec<Blob>,
    ) -> Image {
        // diff_ids are digests of the uncompressed tars.
        let diff_ids: Vec<String> = layers
            .iter()
            .map(|l| {
                if l.bytes.starts_with(&[0x1f, 0x8b]) {
                    let mut raw = Vec::new();
                    std::io::Read::read_to_end(
                        &mut flate2::read::GzDecoder::new(&l.bytes[..]),
                        &mut raw,
                    )
                    .unwrap();
                    sha256(&raw)
                } else {
                    sha256(&l.bytes)
                }
            })
            .collect();
        let config = json!({
            "architecture": arch,
            "os": "linux",
            "config": {"Env": ["PATH=/usr/bin:/bin"], "Cmd": ["/bin/sh"]},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        });
        let config = Blob::new(config_type, serde_json::to_vec(&config).unwrap());
        let manifest = json!({
            "schemaVersion": 2,
            "mediaType": manifest_type,
            "config": config.descriptor(),
            "layers": layers.iter().map(Blob::descriptor).collect::<Vec<_>>(),
        });
        let manifest = Blob::new(manifest_type, serde_json::to_vec_pretty(&manifest).unwrap());
        self.add_blob(&config);
        for l in &layers {
            self.add_blob(l);
        }
        self.add_blob(&manifest);
        Image {
            manifest,
            config,
            layers,
        }
    }

    /// Adds an index of `images`, each with its (os, arch) platform.
    pub fn add_index(&mut self, images: &[(&Image, &str, &str)]) -> Blob {
        let manifests: Vec<Value> = images
            .iter()
            .map(|(img, os, arch)| {
                let mut d = img.manifest.descriptor();
                d["platform"] = json!({"os": os, "architecture": arch});
                d
            })
            .collect();
        let index = json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": manifests});
        let index = Blob::new(OCI_INDEX, serde_json::to_vec_pretty(&index).unwrap());
        self.add_blob(&index);
        index
    }

    /// Names `blob` (a manifest or index) `tag` in the layout's index.json.
    pub fn tag(&mut self, tag: &str, blob: &Blob) {
        let mut d = blob.descriptor();
        d["annotations"] = json!({"org.opencontainers.image.ref.name": tag});
        self.refs.push(d);
        let index = json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": self.refs});
        std::fs::write(
            self.dir.join("index.json"),
            serde_json::to_vec(&index).unwrap(),
        )
        .unwrap();
    }
}
