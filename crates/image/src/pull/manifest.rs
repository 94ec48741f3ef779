//! Manifests and indexes as they come off the wire: media types, parsing,
//! the checks that make them safe to act on, and picking a platform.
//!
//! Everything here is untrusted input from a registry. Parsing keeps only
//! the fields the pull acts on and checks each descriptor's digest form
//! before it can reach a URL or a layer store. It does no I/O.
//!
//! Accepted: OCI image manifests and indexes, and Docker's v2 schema 2
//! manifests and manifest lists. Docker's schema 1 (signed, long deprecated)
//! is refused.

use serde::Deserialize;

use super::platform::Platform;
use super::reference::is_sha256_digest;
use super::{BlobKind, PullError};

/// OCI image manifest.
pub(crate) const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
/// OCI image index.
pub(crate) const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
/// Docker image manifest, v2 schema 2.
pub(crate) const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
/// Docker manifest list.
pub(crate) const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";

/// What the pull asks the registry for, most preferred first.
pub(crate) const ACCEPTED_MANIFESTS: &[&str] =
    &[OCI_INDEX, DOCKER_LIST, OCI_MANIFEST, DOCKER_MANIFEST];

const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
const DOCKER_CONFIG: &str = "application/vnd.docker.container.image.v1+json";

/// How a layer blob is compressed; the tar inside is the same either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// A plain tar archive.
    None,
    /// A gzip-compressed tar archive.
    Gzip,
    /// A zstd-compressed tar archive.
    Zstd,
}

/// What a layer's media type says about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LayerKind {
    /// A tar layer the registry serves, compressed as given.
    Tar(Compression),
    /// A non-distributable ("foreign") layer whose bytes live elsewhere.
    Foreign,
    /// Anything else (an artifact, a Helm chart, Wasm…).
    Unknown,
}

/// Classifies a layer media type.
pub(crate) fn classify_layer(media_type: &str) -> LayerKind {
    match media_type {
        "application/vnd.oci.image.layer.v1.tar"
        | "application/vnd.docker.image.rootfs.diff.tar" => LayerKind::Tar(Compression::None),
        "application/vnd.oci.image.layer.v1.tar+gzip"
        | "application/vnd.docker.image.rootfs.diff.tar.gzip" => LayerKind::Tar(Compression::Gzip),
        "application/vnd.oci.image.layer.v1.tar+zstd"
        | "application/vnd.docker.image.rootfs.diff.tar.zstd" => LayerKind::Tar(Compression::Zstd),
        "application/vnd.oci.image.layer.nondistributable.v1.tar"
        | "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip"
        | "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd"
        | "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip"
        | "application/vnd.docker.image.rootfs.foreign.diff.tar" => LayerKind::Foreign,
        _ => LayerKind::Unknown,
    }
}

/// Whether `media_type` is a container image configuration.
pub(crate) fn is_image_config(media_type: &str) -> bool {
    media_type == OCI_CONFIG || media_type == DOCKER_CONFIG
}

/// A content descriptor: what a manifest says about one blob.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Descriptor {
    pub(crate) media_type: String,
    pub(crate) digest: String,
    pub(crate) size: u64,
    // `urls` (where else the blob may be fetched from) is deliberately not
    // read: following them would let a manifest send the pull to any host.
}

/// The platform object of an index entry.
#[derive(Debug, Clone, Deserialize)]
struct WirePlatform {
    architecture: String,
    os: String,
    #[serde(default)]
    variant: Option<String>,
}

/// One entry of an image index or manifest list.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct IndexEntry {
    #[serde(default)]
    pub(crate) media_type: Option<String>,
    pub(crate) digest: String,
    pub(crate) size: u64,
    #[serde(default)]
    platform: Option<WirePlatform>,
}

impl IndexEntry {
    /// The entry's platform, if it names one.
    pub(crate) fn platform(&self) -> Option<Platform> {
        self.platform.as_ref().map(|p| Platform {
            os: p.os.clone(),
            architecture: p.architecture.clone(),
            variant: p.variant.clone().filter(|v| !v.is_empty()),
        })
    }
}

/// An image manifest (OCI or Docker v2 schema 2).
#[derive(Debug, Clone)]
pub(crate) struct ImageManifest {
    pub(crate) config: Descriptor,
    pub(crate) layers: Vec<Descriptor>,
}

/// An image index (OCI) or manifest list (Docker).
#[derive(Debug, Clone)]
pub(crate) struct Index {
    pub(crate) manifests: Vec<IndexEntry>,
}

/// A parsed manifest document.
#[derive(Debug, Clone)]
pub(crate) enum Parsed {
    Image(ImageManifest),
    Index(Index),
}

/// Every field of either document, each optional, so that one parse can
/// tell them apart (OCI allows `mediaType` to be absent).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Wire {
    #[serde(default)]
    schema_version: Option<i64>,
    #[serde(default)]
    media_type: Option<String>,
    #[serde(default)]
    config: Option<Descriptor>,
    #[serde(default)]
    layers: Option<Vec<Descriptor>>,
    #[serde(default)]
    manifests: Option<Vec<IndexEntry>>,
}

fn malformed(detail: impl Into<String>) -> PullError {
    PullError::Malformed {
        what: BlobKind::Manifest,
        detail: detail.into(),
    }
}

/// Parses a manifest or index and checks every descriptor in it.
pub(crate) fn parse(bytes: &[u8]) -> Result<Parsed, PullError> {
    let wire: Wire =
        serde_json::from_slice(bytes).map_err(|e| malformed(format!("not a manifest: {e}")))?;
    let unsupported = |media_type: String| PullError::UnsupportedMediaType {
        what: BlobKind::Manifest,
        media_type,
    };
    match wire.schema_version {
        Some(2) => {}
        Some(1) => return Err(unsupported("Docker image manifest v2 schema 1".into())),
        Some(v) => return Err(malformed(format!("schemaVersion {v} (expected 2)"))),
        None => return Err(malformed("no schemaVersion")),
    }
    let is_index = match wire.media_type.as_deref() {
        Some(OCI_INDEX | DOCKER_LIST) => true,
        Some(OCI_MANIFEST | DOCKER_MANIFEST) => false,
        Some(other) => return Err(unsupported(other.to_string())),
        // Without a media type, the shape decides: an index has `manifests`
        // and no `config`.
        None => wire.manifests.is_some() && wire.config.is_none(),
    };
    if is_index {
        let manifests = wire
            .manifests
            .ok_or_else(|| malformed("an index without \"manifests\""))?;
        for entry in &manifests {
            check_digest(&entry.digest)?;
        }
        return Ok(Parsed::Index(Index { manifests }));
    }
    let config = wire
        .config
        .ok_or_else(|| malformed("an image manifest without \"config\""))?;
    let layers = wire
        .layers
        .ok_or_else(|| malformed("an image manifest without \"layers\""))?;
    check_digest(&config.digest)?;
    for layer in &layers {
        check_digest(&layer.digest)?;
    }
    Ok(Parsed::Image(ImageManifest { config, layers }))
}

fn check_digest(digest: &str) -> Result<(), PullError> {
    if is_sha256_digest(digest) {
        Ok(())
    } else {
        Err(malformed(format!(
            "descriptor digest {digest:?} is not sha256:<64 lowercase hex digits>"
        )))
    }
}

/// Picks the index entry that serves `want`, or lists the platforms the
/// index does offer.
///
/// Entries that are not image manifests (a nested index, an attestation
/// manifest without a real platform) are never picked; among those that
/// match, an exact match beats a fallback, and earlier beats later.
pub(crate) fn select_platform<'a>(
    index: &'a Index,
    want: &Platform,
) -> Result<&'a IndexEntry, Vec<Platform>> {
    let mut best: Option<(u8, &IndexEntry)> = None;
    let mut available: Vec<Platform> = Vec::new();
    for entry in &index.manifests {
        let is_image = matches!(
            entry.media_type.as_deref(),
            None | Some(OCI_MANIFEST | DOCKER_MANIFEST)
        );
        let Some(platform) = entry.platform() else {
            continue;
        };
        // BuildKit stores attestations as index entries of "unknown/unknown".
        if !is_image || platform.os == "unknown" || platform.architecture == "unknown" {
            continue;
        }
        if let Some(rank) = want.rank_match(&platform) {
            if best.is_none_or(|(r, _)| rank < r) {
                best = Some((rank, entry));
            }
        }
        if !available.contains(&platform) {
            available.push(platform);
        }
    }
    best.map(|(_, e)| e).ok_or(available)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(n: u8) -> String {
        format!("sha256:{}", format!("{n:02x}").repeat(32))
    }

    #[test]
    fn layer_media_types() {
        use Compression::*;
        let cases = [
            (
                "application/vnd.oci.image.layer.v1.tar",
                LayerKind::Tar(None),
            ),
            (
                "application/vnd.oci.image.layer.v1.tar+gzip",
                LayerKind::Tar(Gzip),
            ),
            (
                "application/vnd.oci.image.layer.v1.tar+zstd",
                LayerKind::Tar(Zstd),
            ),
            (
                "application/vnd.docker.image.rootfs.diff.tar.gzip",
                LayerKind::Tar(Gzip),
            ),
            (
                "application/vnd.docker.image.rootfs.diff.tar",
                LayerKind::Tar(None),
            ),
            (
                "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
                LayerKind::Foreign,
            ),
            (
                "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
                LayerKind::Foreign,
            ),
            (
                "application/vnd.wasm.content.layer.v1+wasm",
                LayerKind::Unknown,
            ),
            ("application/octet-stream", LayerKind::Unknown),
        ];
        for (mt, want) in cases {
            assert_eq!(classify_layer(mt), want, "{mt}");
        }
        assert!(is_image_config(OCI_CONFIG));
        assert!(is_image_config(DOCKER_CONFIG));
        assert!(!is_image_config("application/vnd.cncf.helm.config.v1+json"));
    }

    fn manifest(media_type: Option<&str>, config_digest: &str) -> Vec<u8> {
        let mut v = serde_json::json!({
            "schemaVersion": 2,
            "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": 2},
            "layers": [
                {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": d(2), "size": 10},
                {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": d(3), "size": 20,
                 "urls": ["https://elsewhere.example/blob"]}
            ]
        });
        if let Some(mt) = media_type {
            v["mediaType"] = mt.into();
        }
        serde_json::to_vec(&v).unwrap()
    }

    #[test]
    fn parses_image_manifests() {
        for mt in [Some(OCI_MANIFEST), Some(DOCKER_MANIFEST), None] {
            let Parsed::Image(m) = parse(&manifest(mt, &d(1))).unwrap() else {
                panic!("not an image: {mt:?}");
            };
            assert_eq!(m.config.digest, d(1));
            assert_eq!(m.layers.len(), 2);
            assert_eq!(m.layers[1].size, 20);
        }
    }

    #[test]
    fn refuses_bad_manifests() {
        let err = parse(&manifest(Some(OCI_MANIFEST), "sha256:../../x")).unwrap_err();
        assert!(matches!(err, PullError::Malformed { .. }), "{err}");
        let err = parse(&manifest(Some("application/vnd.example+json"), &d(1))).unwrap_err();
        assert!(
            matches!(err, PullError::UnsupportedMediaType { .. }),
            "{err}"
        );
        let schema1 = br#"{"schemaVersion":1,"name":"x","tag":"latest","fsLayers":[]}"#;
        let err = parse(schema1).unwrap_err();
        assert!(err.to_string().contains("schema 1"), "{err}");
        for junk in [&b"not json"[..], b"{}", b"[]", br#"{"schemaVersion":2}"#] {
            assert!(parse(junk).is_err());
        }
        let negative = br#"{"schemaVersion":2,"config":{"mediaType":"a","digest":"sha256:00","size":-1},"layers":[]}"#;
        assert!(parse(negative).is_err());
    }

    fn index(entries: serde_json::Value) -> Index {
        let v =
            serde_json::json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries});
        match parse(&serde_json::to_vec(&v).unwrap()).unwrap() {
            Parsed::Index(i) => i,
            other => panic!("{other:?}"),
        }
    }

    fn entry(n: u8, os: &str, arch: &str, variant: Option<&str>) -> serde_json::Value {
        let mut p = serde_json::json!({"os": os, "architecture": arch});
        if let Some(v) = variant {
            p["variant"] = v.into();
        }
        serde_json::json!({"mediaType": OCI_MANIFEST, "digest": d(n), "size": 100, "platform": p})
    }

    #[test]
    fn selects_platforms() {
        let idx = index(serde_json::json!([
            entry(1, "linux", "amd64", None),
            entry(2, "linux", "arm", Some("v7")),
            entry(3, "linux", "arm64", Some("v9")),
            entry(4, "linux", "arm64", Some("v8")),
            entry(5, "unknown", "unknown", None),
        ]));
        let pick = |p: Platform| select_platform(&idx, &p).map(|e| e.digest.clone());
        assert_eq!(pick(Platform::new("linux", "amd64", None)), Ok(d(1)));
        assert_eq!(pick(Platform::new("linux", "arm64", None)), Ok(d(4)));
        assert_eq!(pick(Platform::new("linux", "arm", Some("v7"))), Ok(d(2)));
        let missing = pick(Platform::new("linux", "s390x", None)).unwrap_err();
        let names: Vec<String> = missing.iter().map(|p| p.to_string()).collect();
        assert_eq!(
            names,
            [
                "linux/amd64",
                "linux/arm/v7",
                "linux/arm64/v9",
                "linux/arm64/v8"
            ]
        );
    }

    #[test]
    fn docker_lists_and_untyped_indexes() {
        let v = serde_json::json!({"schemaVersion": 2, "mediaType": DOCKER_LIST, "manifests": [
            {"mediaType": DOCKER_MANIFEST, "digest": d(7), "size": 5,
             "platform": {"os": "linux", "architecture": "amd64"}}]});
        assert!(matches!(
            parse(&serde_json::to_vec(&v).unwrap()).unwrap(),
            Parsed::Index(_)
        ));
        let v = serde_json::json!({"schemaVersion": 2, "manifests": []});
        assert!(matches!(
            parse(&serde_json::to_vec(&v).unwrap()).unwrap(),
            Parsed::Index(_)
        ));
        let v = serde_json::json!({"schemaVersion": 2, "mediaType": OCI_INDEX,
            "manifests": [{"digest": "md5:00", "size": 1}]});
        assert!(parse(&serde_json::to_vec(&v).unwrap()).is_err());
    }

    #[test]
    fn nested_indexes_are_not_picked() {
        let idx = index(serde_json::json!([{
            "mediaType": OCI_INDEX, "digest": d(1), "size": 1,
            "platform": {"os": "linux", "architecture": "amd64"}
        }]));
        assert!(select_platform(&idx, &Platform::new("linux", "amd64", None)).is_err());
    }
}
