//! Registry pulls: fetching an image from an OCI distribution registry into
//! a [`LayerSink`], verifying every byte on the way.
//!
//! This module owns the conversation with the registry (through the
//! `oci-client` crate, which also does the bearer-token dance when a
//! registry answers `401` with `WWW-Authenticate: Bearer`), the choice of
//! transport, platform resolution, and the integrity checks. It does not
//! own where layers end up, nor unpacking them: the image store implements
//! [`LayerSink`], and [`crate::unpack`] turns a stored layer into a
//! directory.
//!
//! # One pull, step by step
//!
//! 1. Parse and normalise the reference (`busybox` is
//!    `docker.io/library/busybox:latest`).
//! 2. Decide HTTPS or plain HTTP before any connection: plain HTTP only for
//!    loopback registries and those listed in
//!    [`PullOptions::insecure_registries`].
//! 3. Fetch the manifest the reference names, bounded by
//!    [`PullOptions::max_manifest_bytes`]; when pulled by digest, check the
//!    bytes against it.
//! 4. If it is an index (OCI) or manifest list (Docker), pick the entry for
//!    [`PullOptions::platform`] and fetch that manifest, checked against the
//!    digest and size the index gives.
//! 5. Check the manifest before fetching any blob: a container config, and
//!    only tar layers the registry itself serves (foreign layers are
//!    refused, and no `urls` in a descriptor is ever followed).
//! 6. Fetch the config, bounded by [`PullOptions::max_config_bytes`], and
//!    check its digest.
//! 7. For each layer, base first: skip it if the sink
//!    [has it](LayerSink::has_layer); otherwise stream it into a
//!    [`LayerWriter`] while hashing, and [finish](LayerWriter::finish) it
//!    only when its size and sha256 match the manifest. Anything else
//!    [aborts](LayerWriter::abort) it.
//!
//! Layers are fetched one at a time, in order: the sink sees them in the
//! order the image stacks them, and a failure stops the pull at once.
//!
//! # Cancellation
//!
//! [`pull`] may be dropped at any await point. The layer being written is
//! then aborted (its writer's [`LayerWriter::abort`] runs on drop); layers
//! already finished stay in the sink, which is correct since each was
//! verified on its own. Nothing else is left behind.

use std::error::Error as StdError;
use std::fmt;
use std::io;
use std::time::Duration;

use futures::StreamExt;
use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::errors::{DigestError, OciDistributionError, OciErrorCode};
use oci_client::manifest::OciDescriptor;
use oci_client::secrets::RegistryAuth as OciAuth;
use oci_client::{Client, Reference};
use sha2::{Digest as _, Sha256};

mod manifest;
mod platform;
mod reference;

/// The normalised form of an image reference as a user typed it
/// (`busybox` → `docker.io/library/busybox:latest`), the form a pulled
/// image records as its source. No I/O.
pub fn normalise(input: &str) -> Result<String, PullError> {
    Ok(reference::ImageRef::parse(input)?.normalised())
}

pub use manifest::Compression;
pub use platform::{oci_architecture, Platform};

use manifest::{Descriptor, LayerKind, Parsed};
use reference::{ImageRef, Scheme};

/// Default bound on a manifest or index: far above any real one (Docker
/// Hub's largest indexes are tens of KiB), far below harm.
pub const DEFAULT_MAX_MANIFEST_BYTES: u64 = 4 << 20;
/// Default bound on an image config.
pub const DEFAULT_MAX_CONFIG_BYTES: u64 = 4 << 20;

/// How long to wait for a TCP (and TLS) connection to a registry.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a read may stall before the pull gives up; generous, since a
/// registry behind a slow proxy can pause between chunks of a large layer.
const READ_TIMEOUT: Duration = Duration::from_secs(120);
/// Progress is reported at most once per this many bytes of a layer (and
/// at its end), so that a fast link does not flood the callback.
const PROGRESS_STEP: u64 = 256 << 10;

const USER_AGENT: &str = concat!("runbox/", env!("CARGO_PKG_VERSION"));

/// Credentials for a registry.
#[derive(Clone, Default, PartialEq, Eq)]
pub enum RegistryAuth {
    /// No credentials. Registries that hand out anonymous bearer tokens
    /// (Docker Hub, GHCR for public images) still work.
    #[default]
    Anonymous,
    /// A user name and password (or access token). Sent as HTTP basic auth
    /// to registries that ask for it, or to the token service of those that
    /// answer with a bearer challenge.
    Basic {
        /// The user name.
        username: String,
        /// The password or access token.
        password: String,
    },
}

impl fmt::Debug for RegistryAuth {
    // Written out so that the password never reaches a log line.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Anonymous => f.write_str("Anonymous"),
            Self::Basic { username, .. } => f
                .debug_struct("Basic")
                .field("username", username)
                .field("password", &"<redacted>")
                .finish(),
        }
    }
}

/// What a pull may do.
#[derive(Debug, Clone)]
pub struct PullOptions {
    /// Registries (`host[:port]`, matched exactly, any case) that may be
    /// reached over plain HTTP. Loopback registries (`localhost`,
    /// 127.0.0.0/8, `::1`) always may.
    pub insecure_registries: Vec<String>,
    /// Credentials for the registry of the reference.
    pub auth: RegistryAuth,
    /// The platform to resolve multi-platform images to.
    pub platform: Platform,
    /// Bound on each manifest or index, in bytes.
    pub max_manifest_bytes: u64,
    /// Bound on the image config, in bytes.
    pub max_config_bytes: u64,
}

impl Default for PullOptions {
    /// No insecure registries, anonymous, the host platform, default bounds.
    fn default() -> Self {
        Self {
            insecure_registries: Vec::new(),
            auth: RegistryAuth::Anonymous,
            platform: Platform::host(),
            max_manifest_bytes: DEFAULT_MAX_MANIFEST_BYTES,
            max_config_bytes: DEFAULT_MAX_CONFIG_BYTES,
        }
    }
}

/// What a pull reports as it goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProgressEvent {
    /// The image manifest is known (after platform resolution).
    Resolved {
        /// Digest of the image manifest.
        digest: String,
        /// How many layers it has.
        layers: usize,
    },
    /// A layer starts downloading.
    LayerStarted {
        /// The layer's digest.
        digest: String,
        /// Its size in bytes, per the manifest.
        size: u64,
    },
    /// More of a layer has arrived.
    LayerProgress {
        /// The layer's digest.
        digest: String,
        /// Bytes received so far.
        done: u64,
        /// Its size in bytes, per the manifest.
        size: u64,
    },
    /// The sink already had this layer; nothing was fetched.
    LayerSkipped {
        /// The layer's digest.
        digest: String,
    },
    /// A layer arrived whole, was verified and handed over.
    LayerDone {
        /// The layer's digest.
        digest: String,
    },
}

/// One layer of a pulled image, as its manifest describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerInfo {
    /// `sha256:<64 lowercase hex>` of the (compressed) blob. Checked to be
    /// of exactly this form, so a sink may use it in a file name.
    pub digest: String,
    /// The layer's media type (OCI or Docker; tar, gzip or zstd).
    pub media_type: String,
    /// The blob's size in bytes.
    pub size: u64,
    /// The uncompressed tar's digest as the image config lists it
    /// (`rootfs.diff_ids`), checked to be a well-formed sha256 digest; None
    /// when the config lists none (or not one per layer).
    pub diff_id: Option<String>,
}

impl LayerInfo {
    /// How the blob is compressed, from its media type.
    pub fn compression(&self) -> Compression {
        match manifest::classify_layer(&self.media_type) {
            LayerKind::Tar(c) => c,
            // A pull never produces a LayerInfo of another kind.
            LayerKind::Foreign | LayerKind::Unknown => Compression::None,
        }
    }
}

/// Where pulled layers go. The image store implements it; tests implement a
/// simple one.
///
/// The pull calls it from an async task: [`LayerWriter::write`] should
/// return quickly (a write to a file is fine; waiting on the network is
/// not).
pub trait LayerSink: Send + Sync {
    /// Whether this layer is already stored: its blob digest, or its
    /// diff_id (the same content, compressed differently). If so, it is not
    /// fetched at all.
    fn has_layer(&self, layer: &LayerInfo) -> bool;

    /// Starts receiving one layer blob.
    ///
    /// The bytes that follow are unverified until
    /// [`LayerWriter::finish`] is called: the pull hashes them as they
    /// stream and finishes the writer only if size and digest match, and
    /// aborts it otherwise. An implementation should therefore write to a
    /// temporary place and make the layer visible in `finish`.
    fn begin(&self, layer: &LayerInfo) -> io::Result<Box<dyn LayerWriter>>;
}

/// Receives one layer blob, chunk by chunk. See [`LayerSink::begin`].
pub trait LayerWriter: Send {
    /// Appends the next chunk of the blob.
    fn write(&mut self, chunk: &[u8]) -> io::Result<()>;

    /// The blob is complete and its size and sha256 match the manifest:
    /// commit it. If this fails, the implementation cleans up after itself.
    fn finish(self: Box<Self>) -> io::Result<()>;

    /// The blob will not be completed (bad digest, network error, or the
    /// pull was dropped): discard whatever was written.
    fn abort(self: Box<Self>);
}

/// A pulled image: its metadata, verified; its layers are in the sink.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PulledImage {
    /// The normalised reference, e.g. `docker.io/library/busybox:latest`.
    pub reference: String,
    /// Digest of the image manifest (the platform's, for a multi-platform
    /// image).
    pub manifest_digest: String,
    /// Digest of the index or manifest list the manifest was picked from,
    /// if the reference named one.
    pub index_digest: Option<String>,
    /// The image manifest's raw JSON, as served (and digest-checked).
    pub manifest: Vec<u8>,
    /// The image config's raw JSON, digest-checked.
    pub config: Vec<u8>,
    /// The layers, base first.
    pub layers: Vec<LayerInfo>,
}

/// Which kind of document or blob an error is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlobKind {
    /// A manifest, index or manifest list.
    Manifest,
    /// The image config.
    Config,
    /// A layer.
    Layer,
}

impl fmt::Display for BlobKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Manifest => "manifest",
            Self::Config => "config",
            Self::Layer => "layer",
        })
    }
}

/// Why a pull failed.
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    /// The reference cannot be parsed.
    #[error("invalid image reference {reference:?}: {reason}")]
    BadReference {
        /// The reference as given.
        reference: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Plain HTTP was asked for a registry that may not use it.
    #[error(
        "registry {registry} may not be reached over plain HTTP; \
         to allow it, pass --insecure-registry {registry}"
    )]
    InsecureRegistry {
        /// The registry, `host[:port]`.
        registry: String,
    },
    /// The registry answered a TLS handshake in plain HTTP.
    #[error(
        "registry {registry} speaks plain HTTP, not HTTPS; if that is intended, \
         pass --insecure-registry {registry}"
    )]
    RegistryNotHttps {
        /// The registry, `host[:port]`.
        registry: String,
    },
    /// The registry refused the credentials, or wants some and got none.
    #[error("authentication with registry {registry} failed: {detail}")]
    AuthFailed {
        /// The registry, `host[:port]`.
        registry: String,
        /// What happened.
        detail: String,
    },
    /// The registry has no such repository, tag or digest.
    #[error("{what} not found: {reference}")]
    NotFound {
        /// What was missing.
        what: BlobKind,
        /// The reference (or `reference@digest`) that was asked for.
        reference: String,
    },
    /// A multi-platform image has nothing for the requested platform.
    #[error(
        "no manifest for platform {wanted} in {reference}; it has: {list}",
        list = platform_list(.available)
    )]
    NoMatchingPlatform {
        /// The normalised reference.
        reference: String,
        /// The platform asked for.
        wanted: Platform,
        /// The platforms the index offers.
        available: Vec<Platform>,
    },
    /// Content does not hash to the digest it was asked for by.
    #[error("{what} {expected} failed verification: its content hashes to {actual}")]
    DigestMismatch {
        /// What was being fetched.
        what: BlobKind,
        /// The digest it was asked for by.
        expected: String,
        /// The digest of what arrived.
        actual: String,
    },
    /// Content is not the size its descriptor says.
    #[error("{what} {digest} should be {expected} bytes, got {actual}")]
    SizeMismatch {
        /// What was being fetched.
        what: BlobKind,
        /// Its digest.
        digest: String,
        /// The size its descriptor gives.
        expected: u64,
        /// How many bytes arrived (at the point the pull stopped).
        actual: u64,
    },
    /// A manifest or config is over its bound.
    #[error("{what} is {size} bytes, over the limit of {limit}")]
    TooLarge {
        /// What was too large.
        what: BlobKind,
        /// Its size (declared or received).
        size: u64,
        /// The bound from [`PullOptions`].
        limit: u64,
    },
    /// Something other than a container image, or an unsupported format.
    #[error("unsupported {what} media type {media_type}")]
    UnsupportedMediaType {
        /// Which part has it.
        what: BlobKind,
        /// The media type.
        media_type: String,
    },
    /// A non-distributable (foreign) layer.
    #[error(
        "layer {digest} is non-distributable ({media_type}): the registry does not \
         serve its content, and runbox does not fetch layers from elsewhere"
    )]
    ForeignLayer {
        /// The layer's digest.
        digest: String,
        /// Its media type.
        media_type: String,
    },
    /// A manifest or config that is not what it claims to be.
    #[error("malformed {what}: {detail}")]
    Malformed {
        /// Which document.
        what: BlobKind,
        /// What is wrong.
        detail: String,
    },
    /// The registry could not be reached, or failed a request.
    #[error("request to registry {registry} failed")]
    Network {
        /// The registry, `host[:port]`.
        registry: String,
        /// The underlying error.
        #[source]
        source: Box<dyn StdError + Send + Sync>,
    },
    /// The layer sink failed.
    #[error("storing layer {digest} failed")]
    Sink {
        /// The layer's digest.
        digest: String,
        /// The sink's error.
        #[source]
        source: io::Error,
    },
}

fn platform_list(platforms: &[Platform]) -> String {
    if platforms.is_empty() {
        return "no platforms at all".into();
    }
    let names: Vec<String> = platforms.iter().map(Platform::to_string).collect();
    names.join(", ")
}

/// Pulls `reference` into `sink`, reporting to `progress`.
///
/// See the [module docs](self) for the steps and the cancellation rule.
pub async fn pull(
    reference: &str,
    opts: &PullOptions,
    sink: &dyn LayerSink,
    progress: &(dyn Fn(ProgressEvent) + Send + Sync),
) -> Result<PulledImage, PullError> {
    let image = ImageRef::parse(reference)?;
    let scheme = reference::decide_scheme(&image, &opts.insecure_registries)?;
    pull_over(&image, scheme, opts, sink, progress).await
}

/// [`pull`] after the transport is decided; split out so tests can force
/// one.
async fn pull_over(
    image: &ImageRef,
    scheme: Scheme,
    opts: &PullOptions,
    sink: &dyn LayerSink,
    progress: &(dyn Fn(ProgressEvent) + Send + Sync),
) -> Result<PulledImage, PullError> {
    let session = Session::new(image, scheme, &opts.auth)?;

    // Steps 3 and 4: the manifest, through the index if there is one.
    let (top, top_digest) = session
        .manifest(&image.inner, image.inner.digest(), None, opts)
        .await?;
    let (manifest_bytes, manifest_digest, index_digest, parsed) = match manifest::parse(&top)? {
        Parsed::Image(m) => (top, top_digest, None, m),
        Parsed::Index(index) => {
            let entry = manifest::select_platform(&index, &opts.platform).map_err(|available| {
                PullError::NoMatchingPlatform {
                    reference: session.normalised.clone(),
                    wanted: opts.platform.clone(),
                    available,
                }
            })?;
            let child_ref = image.inner.clone_with_digest(entry.digest.clone());
            let (bytes, digest) = session
                .manifest(&child_ref, Some(&entry.digest), Some(entry.size), opts)
                .await?;
            match manifest::parse(&bytes)? {
                Parsed::Image(m) => (bytes, digest, Some(top_digest), m),
                Parsed::Index(_) => {
                    return Err(PullError::Malformed {
                        what: BlobKind::Manifest,
                        detail: format!("index entry {} is itself an index", entry.digest),
                    })
                }
            }
        }
    };

    // Step 5: refuse what cannot be pulled before fetching any blob.
    if !manifest::is_image_config(&parsed.config.media_type) {
        return Err(PullError::UnsupportedMediaType {
            what: BlobKind::Config,
            media_type: parsed.config.media_type.clone(),
        });
    }
    let mut layers = Vec::with_capacity(parsed.layers.len());
    for layer in &parsed.layers {
        match manifest::classify_layer(&layer.media_type) {
            LayerKind::Tar(_) => {}
            LayerKind::Foreign => {
                return Err(PullError::ForeignLayer {
                    digest: layer.digest.clone(),
                    media_type: layer.media_type.clone(),
                })
            }
            LayerKind::Unknown => {
                return Err(PullError::UnsupportedMediaType {
                    what: BlobKind::Layer,
                    media_type: layer.media_type.clone(),
                })
            }
        }
        layers.push(LayerInfo {
            digest: layer.digest.clone(),
            media_type: layer.media_type.clone(),
            size: layer.size,
            diff_id: None,
        });
    }
    progress(ProgressEvent::Resolved {
        digest: manifest_digest.clone(),
        layers: layers.len(),
    });

    // Step 6: the config.
    let config = session
        .config(&parsed.config, opts.max_config_bytes)
        .await?;

    // Each layer's diff_id, where the config lists them: what the store
    // keys layers by and checks each unpacked blob against.
    if let Some(ids) = serde_json::from_slice::<serde_json::Value>(&config)
        .ok()
        .and_then(|c| crate::store::config_diff_ids(&c, layers.len()))
    {
        for (layer, id) in layers.iter_mut().zip(ids) {
            layer.diff_id = Some(id);
        }
    }

    // Step 7: the layers, base first.
    for (layer, desc) in layers.iter().zip(&parsed.layers) {
        if sink.has_layer(layer) {
            progress(ProgressEvent::LayerSkipped {
                digest: layer.digest.clone(),
            });
            continue;
        }
        session.layer(layer, desc, sink, progress).await?;
        progress(ProgressEvent::LayerDone {
            digest: layer.digest.clone(),
        });
    }

    Ok(PulledImage {
        reference: session.normalised,
        manifest_digest,
        index_digest,
        manifest: manifest_bytes,
        config,
        layers,
    })
}

/// One pull's connection to one registry.
struct Session {
    client: Client,
    auth: OciAuth,
    anonymous: bool,
    /// The reference blobs are fetched through (its repository is what
    /// matters).
    image: Reference,
    registry: String,
    normalised: String,
}

impl Session {
    fn new(image: &ImageRef, scheme: Scheme, auth: &RegistryAuth) -> Result<Self, PullError> {
        let registry = image.registry().to_string();
        let config = ClientConfig {
            protocol: match scheme {
                Scheme::Https => ClientProtocol::Https,
                Scheme::Http => ClientProtocol::Http,
            },
            // Platform resolution is done here, where the error can list
            // what the index has.
            platform_resolver: None,
            connect_timeout: Some(CONNECT_TIMEOUT),
            read_timeout: Some(READ_TIMEOUT),
            user_agent: USER_AGENT,
            ..ClientConfig::default()
        };
        // try_from rather than new: new falls back to a default client
        // (HTTPS, no timeouts) when the config is rejected.
        let client = Client::try_from(config).map_err(|e| PullError::Network {
            registry: registry.clone(),
            source: Box::new(e),
        })?;
        let (auth, anonymous) = match auth {
            RegistryAuth::Anonymous => (OciAuth::Anonymous, true),
            RegistryAuth::Basic { username, password } => {
                (OciAuth::Basic(username.clone(), password.clone()), false)
            }
        };
        Ok(Self {
            client,
            auth,
            anonymous,
            image: image.inner.clone(),
            registry,
            normalised: image.normalised(),
        })
    }

    /// Fetches a manifest and returns it with its sha256 digest, checked
    /// against `expected_digest` and `expected_size` when given.
    async fn manifest(
        &self,
        reference: &Reference,
        expected_digest: Option<&str>,
        expected_size: Option<u64>,
        opts: &PullOptions,
    ) -> Result<(Vec<u8>, String), PullError> {
        let limit = opts.max_manifest_bytes;
        if let Some(size) = expected_size.filter(|&s| s > limit) {
            return Err(PullError::TooLarge {
                what: BlobKind::Manifest,
                size,
                limit,
            });
        }
        // oci-client reads the whole body before returning it, so a bound
        // can only be checked afterwards (see the report on its limits);
        // it still keeps an oversized manifest from going any further.
        let (body, _) = self
            .client
            .pull_manifest_raw(reference, &self.auth, manifest::ACCEPTED_MANIFESTS)
            .await
            .map_err(|e| self.map_error(e, BlobKind::Manifest, &reference.whole()))?;
        let size = body.len() as u64;
        if size > limit {
            return Err(PullError::TooLarge {
                what: BlobKind::Manifest,
                size,
                limit,
            });
        }
        // oci-client checks the digest too; this check is ours so that it
        // does not depend on how the registry labelled its response.
        let digest = sha256_hex(&body);
        if let Some(expected) = expected_digest {
            if digest != expected {
                return Err(PullError::DigestMismatch {
                    what: BlobKind::Manifest,
                    expected: expected.to_string(),
                    actual: digest,
                });
            }
        }
        if let Some(expected) = expected_size.filter(|&s| s != size) {
            return Err(PullError::SizeMismatch {
                what: BlobKind::Manifest,
                digest,
                expected,
                actual: size,
            });
        }
        Ok((body.to_vec(), digest))
    }

    /// Fetches and checks the image config.
    async fn config(&self, desc: &Descriptor, limit: u64) -> Result<Vec<u8>, PullError> {
        if desc.size > limit {
            return Err(PullError::TooLarge {
                what: BlobKind::Config,
                size: desc.size,
                limit,
            });
        }
        let mut config = Vec::with_capacity(desc.size as usize);
        self.blob(desc, BlobKind::Config, |chunk, _| {
            config.extend_from_slice(chunk);
            Ok(())
        })
        .await?;
        // The store parses it later; refusing non-JSON here keeps a pull
        // from reporting success for something that is not an image.
        if let Err(e) =
            serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(&config)
        {
            return Err(PullError::Malformed {
                what: BlobKind::Config,
                detail: format!("not a JSON object: {e}"),
            });
        }
        Ok(config)
    }

    /// Streams one layer into the sink.
    async fn layer(
        &self,
        layer: &LayerInfo,
        desc: &Descriptor,
        sink: &dyn LayerSink,
        progress: &(dyn Fn(ProgressEvent) + Send + Sync),
    ) -> Result<(), PullError> {
        let sink_err = |source| PullError::Sink {
            digest: layer.digest.clone(),
            source,
        };
        progress(ProgressEvent::LayerStarted {
            digest: layer.digest.clone(),
            size: layer.size,
        });
        let mut writer = WriterGuard(Some(sink.begin(layer).map_err(sink_err)?));
        let mut reported = 0u64;
        self.blob(desc, BlobKind::Layer, |chunk, done| {
            writer.write(chunk).map_err(sink_err)?;
            if done - reported >= PROGRESS_STEP || done == layer.size {
                reported = done;
                progress(ProgressEvent::LayerProgress {
                    digest: layer.digest.clone(),
                    done,
                    size: layer.size,
                });
            }
            Ok(())
        })
        .await?;
        // Only now, with size and digest checked, is the layer committed;
        // any early return above drops the guard, which aborts it.
        writer.finish().map_err(sink_err)
    }

    /// Streams a blob to `on_chunk` (with the running byte count), checking
    /// it against the descriptor's size as it goes and its digest at the
    /// end. `on_chunk` sees unverified bytes.
    async fn blob(
        &self,
        desc: &Descriptor,
        what: BlobKind,
        mut on_chunk: impl FnMut(&[u8], u64) -> Result<(), PullError>,
    ) -> Result<(), PullError> {
        // Built afresh so that the descriptor's `urls` are dropped:
        // oci-client would otherwise try them when the registry fails,
        // letting a manifest send this pull to any host.
        let oci_desc = OciDescriptor {
            media_type: desc.media_type.clone(),
            digest: desc.digest.clone(),
            size: i64::try_from(desc.size).unwrap_or(i64::MAX),
            ..OciDescriptor::default()
        };
        let target = format!(
            "{}/{}@{}",
            self.image.registry(),
            self.image.repository(),
            desc.digest
        );
        let mut stream = self
            .client
            .pull_blob_stream(&self.image, &oci_desc)
            .await
            .map_err(|e| self.map_error(e, what, &target))?;
        let size_mismatch = |actual| PullError::SizeMismatch {
            what,
            digest: desc.digest.clone(),
            expected: desc.size,
            actual,
        };
        if let Some(len) = stream.content_length.filter(|&l| l != desc.size) {
            return Err(size_mismatch(len));
        }
        let mut hasher = Sha256::new();
        let mut done = 0u64;
        let mut library_digest_error = None;
        while let Some(item) = stream.next().await {
            match item {
                Ok(chunk) => {
                    done += chunk.len() as u64;
                    // Stop at the first byte too many rather than let a
                    // registry stream without end.
                    if done > desc.size {
                        return Err(size_mismatch(done));
                    }
                    hasher.update(&chunk);
                    on_chunk(&chunk, done)?;
                }
                // oci-client verifies the digest too, and reports a
                // mismatch as an error after the last chunk; the check
                // below gives the precise answer.
                Err(e) if is_digest_error(&e) => {
                    library_digest_error = Some(e);
                    break;
                }
                Err(e) => {
                    return Err(PullError::Network {
                        registry: self.registry.clone(),
                        source: Box::new(e),
                    })
                }
            }
        }
        if done != desc.size {
            return Err(size_mismatch(done));
        }
        let actual = format!("sha256:{:x}", hasher.finalize());
        if actual != desc.digest {
            return Err(PullError::DigestMismatch {
                what,
                expected: desc.digest.clone(),
                actual,
            });
        }
        // The bytes match the manifest but not, say, the registry's own
        // digest header: odd enough not to trust.
        if let Some(e) = library_digest_error {
            return Err(PullError::Network {
                registry: self.registry.clone(),
                source: Box::new(e),
            });
        }
        Ok(())
    }

    /// Turns an oci-client error into a [`PullError`] that says what to do.
    fn map_error(&self, err: OciDistributionError, what: BlobKind, target: &str) -> PullError {
        let registry = self.registry.clone();
        let auth_failed = |registry: String| {
            let detail = if self.anonymous {
                "the registry requires credentials and none were given".to_string()
            } else {
                "the registry refused the credentials".to_string()
            };
            PullError::AuthFailed { registry, detail }
        };
        let not_found = || PullError::NotFound {
            what,
            reference: target.to_string(),
        };
        match err {
            OciDistributionError::UnauthorizedError { .. } => auth_failed(registry),
            OciDistributionError::AuthenticationFailure(reason) => PullError::AuthFailed {
                registry,
                detail: format!("the token service refused: {}", reason.trim()),
            },
            OciDistributionError::RegistryError { ref envelope, .. } => {
                let code = envelope.errors.first().map(|e| &e.code);
                match code {
                    Some(
                        OciErrorCode::ManifestUnknown
                        | OciErrorCode::BlobUnknown
                        | OciErrorCode::NameUnknown
                        | OciErrorCode::NotFound,
                    ) => not_found(),
                    Some(OciErrorCode::Unauthorized | OciErrorCode::Denied) => {
                        auth_failed(registry)
                    }
                    _ => PullError::Network {
                        registry,
                        source: Box::new(err),
                    },
                }
            }
            OciDistributionError::ServerError { code: 404, .. } => not_found(),
            OciDistributionError::ServerError {
                code: 401 | 403, ..
            } => auth_failed(registry),
            OciDistributionError::DigestError(DigestError::VerificationError {
                expected,
                actual,
            }) => PullError::DigestMismatch {
                what,
                expected,
                actual,
            },
            OciDistributionError::UnsupportedMediaTypeError(media_type) => {
                PullError::UnsupportedMediaType { what, media_type }
            }
            other if answered_tls_with_http(&other) => PullError::RegistryNotHttps { registry },
            other => PullError::Network {
                registry,
                source: Box::new(other),
            },
        }
    }
}

/// A layer writer that is aborted unless finished, so that every way out
/// of [`Session::layer`] (an error, a dropped future) discards the blob.
struct WriterGuard(Option<Box<dyn LayerWriter>>);

impl WriterGuard {
    fn write(&mut self, chunk: &[u8]) -> io::Result<()> {
        match self.0.as_mut() {
            Some(w) => w.write(chunk),
            None => Err(io::Error::other("layer writer already finished")),
        }
    }

    fn finish(mut self) -> io::Result<()> {
        match self.0.take() {
            Some(w) => w.finish(),
            None => Err(io::Error::other("layer writer already finished")),
        }
    }
}

impl Drop for WriterGuard {
    fn drop(&mut self) {
        if let Some(w) = self.0.take() {
            w.abort();
        }
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    format!("sha256:{:x}", Sha256::digest(bytes))
}

/// Whether a blob stream error is oci-client's digest check failing.
fn is_digest_error(e: &io::Error) -> bool {
    e.get_ref()
        .is_some_and(|inner| inner.downcast_ref::<DigestError>().is_some())
}

/// Whether an error is a TLS client getting a plain-HTTP answer.
///
/// rustls reports the first byte of `HTTP/1.x` as a record of an invalid
/// content type. Matching on text is crude, but this only picks a more
/// helpful error; a miss still reports the network error.
fn answered_tls_with_http(err: &(dyn StdError + 'static)) -> bool {
    let mut cur = Some(err);
    while let Some(e) = cur {
        let text = e.to_string();
        if text.contains("InvalidContentType") || text.contains("HTTP response to HTTPS") {
            return true;
        }
        cur = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    struct NoSink;
    impl LayerSink for NoSink {
        fn has_layer(&self, _: &LayerInfo) -> bool {
            false
        }
        fn begin(&self, _: &LayerInfo) -> io::Result<Box<dyn LayerWriter>> {
            Err(io::Error::other("unused"))
        }
    }

    #[test]
    fn auth_debug_hides_the_password() {
        let auth = RegistryAuth::Basic {
            username: "u".into(),
            password: "hunter2".into(),
        };
        let text = format!(
            "{:?}",
            PullOptions {
                auth,
                ..PullOptions::default()
            }
        );
        assert!(text.contains("\"u\""));
        assert!(!text.contains("hunter2"));
    }

    #[test]
    fn default_options() {
        let o = PullOptions::default();
        assert_eq!(o.platform, Platform::host());
        assert_eq!(o.auth, RegistryAuth::Anonymous);
        assert!(o.insecure_registries.is_empty());
        assert_eq!(o.max_manifest_bytes, 4 << 20);
    }

    #[test]
    fn error_messages_say_what_to_do() {
        let e = PullError::NoMatchingPlatform {
            reference: "h/x:1".into(),
            wanted: Platform::new("linux", "s390x", None),
            available: vec![
                Platform::new("linux", "amd64", None),
                Platform::new("linux", "arm", Some("v7")),
            ],
        };
        assert_eq!(
            e.to_string(),
            "no manifest for platform linux/s390x in h/x:1; it has: linux/amd64, linux/arm/v7"
        );
        let e = PullError::RegistryNotHttps {
            registry: "r.example:5000".into(),
        };
        assert!(e.to_string().contains("--insecure-registry r.example:5000"));
    }

    #[test]
    fn guard_aborts_unless_finished() {
        #[derive(Default)]
        struct Log(Mutex<Vec<&'static str>>);
        struct W(std::sync::Arc<Log>);
        impl LayerWriter for W {
            fn write(&mut self, _: &[u8]) -> io::Result<()> {
                Ok(())
            }
            fn finish(self: Box<Self>) -> io::Result<()> {
                self.0 .0.lock().unwrap().push("finish");
                Ok(())
            }
            fn abort(self: Box<Self>) {
                self.0 .0.lock().unwrap().push("abort");
            }
        }
        let log = std::sync::Arc::new(Log::default());
        drop(WriterGuard(Some(Box::new(W(log.clone())))));
        let mut g = WriterGuard(Some(Box::new(W(log.clone()))));
        g.write(b"x").unwrap();
        g.finish().unwrap();
        assert_eq!(*log.0.lock().unwrap(), ["abort", "finish"]);
    }

    /// A registry reached over HTTPS that answers in plain HTTP gets an
    /// error naming the flag. The "registry" is a socket on loopback that
    /// answers anything with a plain-HTTP 400, as Go's server does when it
    /// receives a TLS handshake.
    #[tokio::test]
    async fn https_to_a_plain_http_server_names_the_flag() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            // Enough for oci-client's probe of /v2/ and the manifest GET.
            for _ in 0..4 {
                let Ok((mut conn, _)) = listener.accept().await else {
                    return;
                };
                let mut buf = [0u8; 1024];
                let _ = conn.read(&mut buf).await;
                let _ = conn
                    .write_all(b"HTTP/1.0 400 Bad Request\r\n\r\nClient sent an HTTP request to an HTTPS server.\n")
                    .await;
            }
        });
        let image = ImageRef::parse(&format!("https://{addr}/x:1")).unwrap();
        let err = pull_over(
            &image,
            Scheme::Https,
            &PullOptions::default(),
            &NoSink,
            &|_| {},
        )
        .await
        .unwrap_err();
        server.abort();
        match &err {
            PullError::RegistryNotHttps { registry } => assert_eq!(registry, &addr.to_string()),
            other => panic!("unexpected error: {other} ({other:?})"),
        }
    }
}
