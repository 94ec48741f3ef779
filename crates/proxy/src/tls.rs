//! TLS interception for hosts with a secret rule: the per-node certificate
//! authority, per-host leaf certificates (cached), and the client config that
//! verifies upstream servers for real.
//!
//! The CA lives in a directory of its own:
//!
//! ```text
//!  dir/            0700
//!    ca.key        0600  PKCS#8 private key, written first
//!    ca.pem        0644  CA certificate, written last: its presence means the pair is complete
//! ```
//!
//! 1. `Authority::load_or_create` uses a stored pair only when both files
//!    parse, the certificate is a CA that has not expired, and the key matches
//!    it. Anything else (a crash between the two writes, a hand-edited file)
//!    is logged and replaced by a fresh CA; runs created afterwards get the new
//!    certificate.
//! 2. `Authority::server_config` mints a leaf per host (fresh P-256 key, 30
//!    days) and caches the resulting `ServerConfig` until a day before expiry.
//! 3. `upstream_client_config` is what the proxy uses on the other side: full
//!    webpki verification against the system roots plus operator-supplied ones.
//!
//! This module never decides *whether* to intercept (the policy does) and never
//! touches request contents (`secrets` does). Key material is never logged.

use std::collections::HashMap;
use std::fs::{self, DirBuilder, OpenOptions};
use std::io::Write;
use std::net::{IpAddr, Ipv6Addr};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, PublicKeyData, SanType, SerialNumber,
};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, DnsName, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use time::{Duration, OffsetDateTime};

/// Errors from the authority.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// Reading or writing the CA files failed.
    #[error("{context}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// Generating or parsing a certificate or key failed.
    #[error("{0}")]
    Certificate(String),
}

/// File holding the CA certificate (PEM).
const CA_CERT_FILE: &str = "ca.pem";
/// File holding the CA private key (PKCS#8 PEM).
const CA_KEY_FILE: &str = "ca.key";
/// Subject common name of a generated CA.
const CA_COMMON_NAME: &str = "runbox egress CA";
/// Subject organisation of a generated CA.
const CA_ORGANIZATION: &str = "runbox";
/// How far a generated CA's validity starts in the past, for clocks that lag.
const CA_BACKDATE: Duration = Duration::days(1);
/// How long a generated CA is valid.
const CA_LIFETIME: Duration = Duration::days(3650);
/// How far a leaf's validity starts in the past, for clients whose clocks lag.
const LEAF_BACKDATE: Duration = Duration::hours(1);
/// How long a leaf is valid.
const LEAF_LIFETIME: Duration = Duration::days(30);
/// A cached leaf with less than this left is minted anew.
const LEAF_RENEW_BEFORE: Duration = Duration::days(1);
/// Most hosts with a cached leaf. A run can make the proxy mint for as many
/// allowlisted hosts as it names; past this the whole cache is dropped rather
/// than tracked per entry, since re-minting is cheap (one P-256 key, one
/// signature).
const LEAF_CACHE_CAP: usize = 4096;
/// The only application protocol offered on either side: the proxy rewrites
/// HTTP/1.1 requests and speaks HTTP/1.1 upstream.
const ALPN_HTTP1: &[u8] = b"http/1.1";

/// The node's interception CA. Cheap to share (`Arc<Authority>`).
pub struct Authority {
    /// The CA certificate, PEM-encoded.
    ca_pem: String,
    /// Signs leaves: the CA's subject, key identifier method and key.
    issuer: Issuer<'static, KeyPair>,
    /// Every rustls config and all randomness come from this provider, never
    /// from a process-wide default.
    provider: Arc<CryptoProvider>,
    /// Minted leaves by normalised host.
    leaves: Mutex<HashMap<String, CachedLeaf>>,
}

/// A minted leaf, ready to serve.
struct CachedLeaf {
    config: Arc<ServerConfig>,
    not_after: OffsetDateTime,
}

impl std::fmt::Debug for Authority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The issuer holds the CA key, so none of the fields are shown.
        f.debug_struct("Authority").finish_non_exhaustive()
    }
}

impl Authority {
    /// Loads the CA from `dir` (`ca.pem`, `ca.key` mode 0600), creating it on
    /// first start. A half-written pair is never used.
    pub fn load_or_create(dir: &Path) -> Result<Authority, TlsError> {
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|source| {
                io_error(format!("creating CA directory {}", dir.display()), source)
            })?;

        let cert_path = dir.join(CA_CERT_FILE);
        let key_path = dir.join(CA_KEY_FILE);
        let cert_pem = read_if_exists(&cert_path)?;
        let key_pem = read_if_exists(&key_path)?;

        let (ca_pem, issuer) = match (cert_pem, key_pem) {
            (None, None) => {
                tracing::info!(dir = %dir.display(), "creating the egress interception CA");
                create_ca(dir, &provider)?
            }
            (Some(cert_pem), Some(key_pem)) => match parse_stored(&cert_pem, &key_pem) {
                Ok(loaded) => {
                    tighten_key_mode(&key_path);
                    loaded
                }
                Err(reason) => {
                    tracing::warn!(
                        dir = %dir.display(),
                        %reason,
                        "stored egress interception CA is unusable; replacing it with a new one"
                    );
                    create_ca(dir, &provider)?
                }
            },
            (cert, _) => {
                let present = if cert.is_some() {
                    CA_CERT_FILE
                } else {
                    CA_KEY_FILE
                };
                tracing::warn!(
                    dir = %dir.display(),
                    present,
                    "only one of the egress interception CA files exists; replacing both"
                );
                create_ca(dir, &provider)?
            }
        };

        Ok(Authority {
            ca_pem,
            issuer,
            provider,
            leaves: Mutex::new(HashMap::new()),
        })
    }

    /// The CA certificate in PEM, to install into runs' trust stores.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// A server config presenting a leaf for `host` (DNS name or IP literal)
    /// signed by this CA; leaves are cached per host.
    pub fn server_config(&self, host: &str) -> Result<Arc<rustls::ServerConfig>, TlsError> {
        let subject = LeafSubject::parse(host)?;
        let key = subject.cache_key();
        let now = OffsetDateTime::now_utc();

        if let Some(leaf) = self.lock_leaves().get(&key) {
            if leaf.not_after - now >= LEAF_RENEW_BEFORE {
                return Ok(leaf.config.clone());
            }
        }

        // Minted without the lock held so one slow mint does not stall every
        // other connection; two racing mints for one host both yield valid
        // leaves and the later one stays cached.
        let leaf = self.mint(&subject, now)?;
        let config = leaf.config.clone();
        let mut leaves = self.lock_leaves();
        if leaves.len() >= LEAF_CACHE_CAP && !leaves.contains_key(&key) {
            leaves.clear();
        }
        leaves.insert(key, leaf);
        Ok(config)
    }

    /// The leaf cache. A panic while it was held cannot leave an entry half
    /// written (entries are inserted whole), so a poisoned lock is still safe
    /// to use.
    fn lock_leaves(&self) -> std::sync::MutexGuard<'_, HashMap<String, CachedLeaf>> {
        self.leaves.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Signs a fresh leaf for `subject` and wraps it in a server config.
    fn mint(&self, subject: &LeafSubject, now: OffsetDateTime) -> Result<CachedLeaf, TlsError> {
        let mut params = CertificateParams::default();
        let mut name = DistinguishedName::new();
        let common_name = subject.to_string();
        // X.520 caps a common name at 64 characters; the SAN is what clients
        // check, so a longer name simply goes without a CN.
        if common_name.len() <= 64 {
            name.push(DnType::CommonName, common_name);
        }
        params.distinguished_name = name;
        params.subject_alt_names = vec![subject.san()?];
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        params.not_before = now - LEAF_BACKDATE;
        params.not_after = now + LEAF_LIFETIME;
        params.serial_number = Some(random_serial(&self.provider)?);

        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)
            .map_err(|e| cert_error(format!("generating a leaf key: {e}")))?;
        let cert = params
            .signed_by(&key, &self.issuer)
            .map_err(|e| cert_error(format!("signing a leaf for {subject}: {e}")))?;
        let key_der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));

        let mut config = ServerConfig::builder_with_provider(self.provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
            .map_err(|e| cert_error(format!("building a server config: {e}")))?
            .with_no_client_auth()
            .with_single_cert(vec![cert.der().clone()], key_der)
            .map_err(|e| cert_error(format!("building a server config for {subject}: {e}")))?;
        config.alpn_protocols = vec![ALPN_HTTP1.to_vec()];

        Ok(CachedLeaf {
            config: Arc::new(config),
            not_after: params.not_after,
        })
    }
}

/// What a leaf is issued for.
#[derive(Debug, Clone, PartialEq, Eq)]
enum LeafSubject {
    /// A DNS name, lowercase, without a trailing dot.
    Dns(String),
    /// An IP literal.
    Ip(IpAddr),
}

impl LeafSubject {
    /// Accepts a DNS name (a trailing dot is dropped) or an IP literal (IPv6
    /// with or without brackets); anything else cannot be put in a SAN.
    fn parse(host: &str) -> Result<LeafSubject, TlsError> {
        if let Some(inner) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
            return inner
                .parse::<Ipv6Addr>()
                .map(|ip| LeafSubject::Ip(IpAddr::V6(ip)))
                .map_err(|_| cert_error(format!("{host:?} is not a bracketed IPv6 address")));
        }
        if let Ok(ip) = host.parse::<IpAddr>() {
            return Ok(LeafSubject::Ip(ip));
        }
        let name = host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase();
        match DnsName::try_from(name.as_str()) {
            Ok(_) => Ok(LeafSubject::Dns(name)),
            Err(_) => Err(cert_error(format!(
                "{host:?} is neither a DNS name nor an IP address"
            ))),
        }
    }

    /// The leaf cache key: one leaf serves every spelling of the same host.
    fn cache_key(&self) -> String {
        self.to_string()
    }

    /// The subject alternative name clients verify.
    fn san(&self) -> Result<SanType, TlsError> {
        match self {
            LeafSubject::Ip(ip) => Ok(SanType::IpAddress(*ip)),
            LeafSubject::Dns(name) => name
                .clone()
                .try_into()
                .map(SanType::DnsName)
                .map_err(|e| cert_error(format!("{name:?} cannot be a certificate name: {e}"))),
        }
    }
}

impl std::fmt::Display for LeafSubject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LeafSubject::Dns(name) => f.write_str(name),
            LeafSubject::Ip(ip) => write!(f, "{ip}"),
        }
    }
}

/// The client config the proxy uses towards upstream servers: the system
/// roots, plus every certificate in `extra_roots` (a PEM bundle) when given.
pub fn upstream_client_config(
    extra_roots: Option<&Path>,
) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut roots = RootCertStore::empty();

    // The system store is best effort: a host with a broken bundle but an
    // operator-supplied one still works, and a host with neither fails below.
    let native = rustls_native_certs::load_native_certs();
    for error in &native.errors {
        tracing::warn!(%error, "could not load some system root certificates");
    }
    let (_, skipped) = roots.add_parsable_certificates(native.certs);
    if skipped > 0 {
        tracing::warn!(skipped, "skipped unusable system root certificates");
    }

    if let Some(path) = extra_roots {
        for cert in read_pem_bundle(path)? {
            roots.add(cert).map_err(|e| {
                cert_error(format!(
                    "a certificate in {} cannot be a trust anchor: {e}",
                    path.display()
                ))
            })?;
        }
    }

    if roots.is_empty() {
        return Err(cert_error(
            "no root certificates to verify upstream servers with: the system store is empty \
             and no extra bundle was given"
                .to_owned(),
        ));
    }

    let mut config = ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(|e| cert_error(format!("building the upstream client config: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![ALPN_HTTP1.to_vec()];
    Ok(Arc::new(config))
}

/// Every certificate in the PEM bundle at `path`; an unreadable, malformed or
/// empty bundle is an error naming the file.
fn read_pem_bundle(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = fs::read(path).map_err(|source| {
        io_error(
            format!("reading root certificates from {}", path.display()),
            source,
        )
    })?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| {
            cert_error(format!(
                "parsing root certificates in {}: {e}",
                path.display()
            ))
        })?;
    if certs.is_empty() {
        return Err(cert_error(format!(
            "{} holds no PEM certificates",
            path.display()
        )));
    }
    Ok(certs)
}

/// Generates a new CA and stores it in `dir`, replacing whatever was there.
fn create_ca(
    dir: &Path,
    provider: &CryptoProvider,
) -> Result<(String, Issuer<'static, KeyPair>), TlsError> {
    let now = OffsetDateTime::now_utc();
    let mut params = CertificateParams::default();
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, CA_COMMON_NAME);
    name.push(DnType::OrganizationName, CA_ORGANIZATION);
    params.distinguished_name = name;
    // Path length 0: this CA signs leaves only, never another CA.
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    params.not_before = now - CA_BACKDATE;
    params.not_after = now + CA_LIFETIME;
    params.serial_number = Some(random_serial(provider)?);

    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)
        .map_err(|e| cert_error(format!("generating the CA key: {e}")))?;
    let cert = params
        .self_signed(&key)
        .map_err(|e| cert_error(format!("signing the CA certificate: {e}")))?;
    let cert_pem = cert.pem();

    let cert_path = dir.join(CA_CERT_FILE);
    // ca.pem goes first so that, from here until the new pair is complete,
    // no ca.pem exists that a later start could pair with the wrong key.
    match fs::remove_file(&cert_path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => {
            return Err(io_error(
                format!("removing stale {}", cert_path.display()),
                source,
            ))
        }
    }
    write_atomically(dir, CA_KEY_FILE, key.serialize_pem().as_bytes(), 0o600)?;
    write_atomically(dir, CA_CERT_FILE, cert_pem.as_bytes(), 0o644)?;
    sync_dir(dir);

    Ok((cert_pem, Issuer::new(params, key)))
}

/// Checks a stored pair; the error says what is wrong without quoting the key.
fn parse_stored(
    cert_pem: &[u8],
    key_pem: &[u8],
) -> Result<(String, Issuer<'static, KeyPair>), String> {
    let cert_der = CertificateDer::from_pem_slice(cert_pem)
        .map_err(|e| format!("{CA_CERT_FILE} holds no PEM certificate: {e}"))?;
    // The key's own parse errors are not passed on: they could echo its bytes.
    let key_der = PrivatePkcs8KeyDer::from_pem_slice(key_pem)
        .map_err(|_| format!("{CA_KEY_FILE} holds no PKCS#8 private key"))?;
    let key = KeyPair::try_from(&key_der)
        .map_err(|_| format!("{CA_KEY_FILE} holds a private key that cannot be used"))?;

    let (_, cert) = x509_parser::parse_x509_certificate(&cert_der)
        .map_err(|e| format!("{CA_CERT_FILE} does not parse: {e}"))?;
    if !cert.is_ca() {
        return Err(format!("{CA_CERT_FILE} is not a CA certificate"));
    }
    if cert.validity().time_to_expiration().is_none() {
        return Err(format!("{CA_CERT_FILE} is expired or not yet valid"));
    }
    if cert.public_key().subject_public_key.data.as_ref() != key.der_bytes() {
        return Err(format!("{CA_KEY_FILE} does not match {CA_CERT_FILE}"));
    }

    let cert_pem =
        String::from_utf8(cert_pem.to_vec()).map_err(|_| format!("{CA_CERT_FILE} is not text"))?;
    let issuer = Issuer::from_ca_cert_der(&cert_der, key)
        .map_err(|e| format!("{CA_CERT_FILE} cannot issue certificates: {e}"))?;
    Ok((cert_pem, issuer))
}

/// The file's contents, or `None` when it does not exist.
fn read_if_exists(path: &Path) -> Result<Option<Vec<u8>>, TlsError> {
    match fs::read(path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(io_error(format!("reading {}", path.display()), source)),
    }
}

/// Restricts a loaded key file to its owner if someone widened its mode.
fn tighten_key_mode(path: &Path) {
    let Ok(meta) = fs::metadata(path) else { return };
    if meta.permissions().mode() & 0o077 != 0 {
        tracing::warn!(path = %path.display(), "CA key was readable by others; restricting it to mode 0600");
        if let Err(error) = fs::set_permissions(path, fs::Permissions::from_mode(0o600)) {
            tracing::warn!(path = %path.display(), %error, "could not restrict the CA key's mode");
        }
    }
}

/// Writes `name` in `dir` through a temporary file and a rename, so readers
/// see the old contents or the new ones, never a prefix.
fn write_atomically(dir: &Path, name: &str, contents: &[u8], mode: u32) -> Result<(), TlsError> {
    let target = dir.join(name);
    let temp = temp_path(dir, name);
    let result = (|| {
        // create_new: never follow or reuse something already at the temp path.
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&temp)?;
        file.write_all(contents)?;
        file.sync_all()?;
        fs::rename(&temp, &target)
    })();
    result.map_err(|source| {
        let _ = fs::remove_file(&temp);
        io_error(format!("writing {}", target.display()), source)
    })
}

/// A temporary name next to `name`, unique per process and call.
fn temp_path(dir: &Path, name: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    dir.join(format!(".{name}.{}.{n}.tmp", std::process::id()))
}

/// Makes the renames durable. Best effort: the files themselves are synced,
/// and a lost rename only means the CA is regenerated on the next start.
fn sync_dir(dir: &Path) {
    if let Err(error) = fs::File::open(dir).and_then(|d| d.sync_all()) {
        tracing::debug!(dir = %dir.display(), %error, "could not sync the CA directory");
    }
}

/// A positive, non-zero 128-bit serial from the provider's random source.
fn random_serial(provider: &CryptoProvider) -> Result<SerialNumber, TlsError> {
    let mut bytes = [0u8; 16];
    provider
        .secure_random
        .fill(&mut bytes)
        .map_err(|_| cert_error("the system random generator failed".to_owned()))?;
    // Clear the sign bit (serials are positive) and set the next one so the
    // serial is never zero and always encodes in 16 bytes.
    bytes[0] = (bytes[0] & 0x7f) | 0x40;
    Ok(SerialNumber::from_slice(&bytes))
}

fn io_error(context: String, source: std::io::Error) -> TlsError {
    TlsError::Io { context, source }
}

fn cert_error(message: String) -> TlsError {
    TlsError::Certificate(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    use rustls::pki_types::ServerName;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};
    use tokio_rustls::{TlsAcceptor, TlsConnector};

    fn provider() -> Arc<CryptoProvider> {
        Arc::new(rustls::crypto::aws_lc_rs::default_provider())
    }

    /// A client config trusting exactly the certificates in `ca_pem`.
    fn client_trusting(ca_pem: &str) -> Arc<ClientConfig> {
        let mut roots = RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
            roots
                .add(cert.expect("test CA parses"))
                .expect("test CA is a trust anchor");
        }
        let config = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("protocol versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
        Arc::new(config)
    }

    /// Serves one TLS connection with `server` on loopback and connects to it
    /// with `client` as `server_name`. The server echoes one byte back, so a
    /// successful result means both sides finished the handshake.
    async fn handshake(
        server: Arc<ServerConfig>,
        client: Arc<ClientConfig>,
        server_name: &str,
    ) -> Result<(), String> {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("local addr");
        let acceptor = TlsAcceptor::from(server);
        let server_task = tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.map_err(|e| e.to_string())?;
            let mut tls = acceptor.accept(tcp).await.map_err(|e| e.to_string())?;
            let mut byte = [0u8; 1];
            tls.read_exact(&mut byte).await.map_err(|e| e.to_string())?;
            tls.write_all(&byte).await.map_err(|e| e.to_string())?;
            tls.shutdown().await.map_err(|e| e.to_string())?;
            Ok::<(), String>(())
        });

        let name = ServerName::try_from(server_name.to_owned()).expect("server name");
        let client_result = async {
            let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
            let mut tls = TlsConnector::from(client)
                .connect(name, tcp)
                .await
                .map_err(|e| e.to_string())?;
            tls.write_all(b"x").await.map_err(|e| e.to_string())?;
            let mut byte = [0u8; 1];
            tls.read_exact(&mut byte).await.map_err(|e| e.to_string())?;
            Ok::<(), String>(())
        }
        .await;
        let server_result = server_task.await.expect("server task");
        client_result?;
        server_result
    }

    fn mode_of(path: &Path) -> u32 {
        fs::metadata(path).expect("metadata").permissions().mode() & 0o777
    }

    #[tokio::test]
    async fn leaf_for_dns_name_verifies_against_the_ca() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = Authority::load_or_create(dir.path()).expect("create CA");
        let client = client_trusting(ca.ca_pem());
        let server = ca.server_config("foo.test").expect("leaf");
        assert_eq!(server.alpn_protocols, vec![b"http/1.1".to_vec()]);

        handshake(server.clone(), client.clone(), "foo.test")
            .await
            .expect("handshake for the leaf's own name");
        let err = handshake(server, client, "bar.test")
            .await
            .expect_err("a leaf for foo.test must not pass as bar.test");
        assert!(
            err.contains("certificate") || err.contains("Certificate"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn leaf_for_ip_literal_verifies() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = Authority::load_or_create(dir.path()).expect("create CA");
        let client = client_trusting(ca.ca_pem());
        handshake(
            ca.server_config("127.0.0.1").expect("leaf"),
            client.clone(),
            "127.0.0.1",
        )
        .await
        .expect("IPv4 leaf");
        // Bracketed and bare IPv6 are the same host.
        let v6 = ca.server_config("[::1]").expect("leaf");
        assert!(Arc::ptr_eq(&v6, &ca.server_config("::1").expect("leaf")));
        handshake(v6, client, "::1").await.expect("IPv6 leaf");
    }

    #[test]
    fn rejects_hosts_that_cannot_be_named_in_a_certificate() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = Authority::load_or_create(dir.path()).expect("create CA");
        for host in [
            "",
            "a b",
            "foo..test",
            "[127.0.0.1]",
            "[::1",
            "exa\u{e9}mple.test",
            "-x.test",
        ] {
            assert!(
                matches!(ca.server_config(host), Err(TlsError::Certificate(_))),
                "{host:?} must be rejected"
            );
        }
    }

    #[test]
    fn cache_returns_the_same_leaf_per_host() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = Authority::load_or_create(dir.path()).expect("create CA");
        let first = ca.server_config("foo.test").expect("leaf");
        let again = ca.server_config("FOO.test.").expect("leaf");
        let other = ca.server_config("bar.test").expect("leaf");
        assert!(Arc::ptr_eq(&first, &again));
        assert!(!Arc::ptr_eq(&first, &other));
    }

    #[test]
    fn cache_re_mints_leaves_close_to_expiry() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = Authority::load_or_create(dir.path()).expect("create CA");
        let first = ca.server_config("foo.test").expect("leaf");
        ca.lock_leaves()
            .get_mut("foo.test")
            .expect("cached")
            .not_after = OffsetDateTime::now_utc() + Duration::hours(2);
        let renewed = ca.server_config("foo.test").expect("leaf");
        assert!(!Arc::ptr_eq(&first, &renewed));
    }

    #[test]
    fn reload_gives_the_same_ca_and_a_private_key_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca_dir = dir.path().join("ca");
        let first = Authority::load_or_create(&ca_dir).expect("create CA");
        assert_eq!(mode_of(&ca_dir), 0o700);
        assert_eq!(mode_of(&ca_dir.join(CA_KEY_FILE)), 0o600);
        let pem = fs::read_to_string(ca_dir.join(CA_CERT_FILE)).expect("ca.pem");
        assert_eq!(pem, first.ca_pem());

        let second = Authority::load_or_create(&ca_dir).expect("reload CA");
        assert_eq!(first.ca_pem(), second.ca_pem());
        // No temporary files left behind.
        let names: Vec<_> = fs::read_dir(&ca_dir)
            .expect("read dir")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
    }

    #[tokio::test]
    async fn leaves_from_a_reloaded_ca_verify_against_the_stored_certificate() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pem = Authority::load_or_create(dir.path())
            .expect("create CA")
            .ca_pem()
            .to_owned();
        let reloaded = Authority::load_or_create(dir.path()).expect("reload CA");
        handshake(
            reloaded.server_config("foo.test").expect("leaf"),
            client_trusting(&pem),
            "foo.test",
        )
        .await
        .expect("handshake");
    }

    #[test]
    fn generated_ca_has_the_documented_shape() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = Authority::load_or_create(dir.path()).expect("create CA");
        let der = CertificateDer::from_pem_slice(ca.ca_pem().as_bytes()).expect("pem");
        let (_, cert) = x509_parser::parse_x509_certificate(&der).expect("parse");
        assert!(cert.is_ca());
        let subject = cert.subject().to_string();
        assert!(subject.contains("CN=runbox egress CA"), "{subject}");
        assert!(subject.contains("O=runbox"), "{subject}");
        let constraints = cert
            .basic_constraints()
            .expect("extension parses")
            .expect("basic constraints present");
        assert_eq!(constraints.value.path_len_constraint, Some(0));
        let usage = cert.key_usage().expect("parses").expect("present").value;
        assert!(usage.key_cert_sign() && usage.crl_sign() && !usage.digital_signature());
        let lifetime =
            cert.validity().not_after.timestamp() - cert.validity().not_before.timestamp();
        assert!(lifetime > 3650 * 86_400, "{lifetime}");
    }

    #[test]
    fn lone_key_file_is_replaced() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pem = Authority::load_or_create(dir.path())
            .expect("create CA")
            .ca_pem()
            .to_owned();
        let key_before = fs::read(dir.path().join(CA_KEY_FILE)).expect("key");
        fs::remove_file(dir.path().join(CA_CERT_FILE)).expect("remove ca.pem");

        let ca = Authority::load_or_create(dir.path()).expect("regenerate CA");
        assert_ne!(ca.ca_pem(), pem);
        assert_ne!(
            fs::read(dir.path().join(CA_KEY_FILE)).expect("key"),
            key_before
        );
        assert_eq!(
            fs::read_to_string(dir.path().join(CA_CERT_FILE)).expect("ca.pem"),
            ca.ca_pem()
        );
        assert_eq!(mode_of(&dir.path().join(CA_KEY_FILE)), 0o600);
    }

    #[tokio::test]
    async fn mismatched_pair_is_replaced() {
        let one = tempfile::tempdir().expect("tempdir");
        let two = tempfile::tempdir().expect("tempdir");
        Authority::load_or_create(one.path()).expect("create CA one");
        Authority::load_or_create(two.path()).expect("create CA two");
        // ca.pem from one, ca.key from two.
        fs::copy(two.path().join(CA_KEY_FILE), one.path().join(CA_KEY_FILE)).expect("copy");
        let mismatched = fs::read_to_string(one.path().join(CA_CERT_FILE)).expect("ca.pem");

        let ca = Authority::load_or_create(one.path()).expect("regenerate CA");
        assert_ne!(ca.ca_pem(), mismatched);
        // The replacement is a working pair.
        handshake(
            ca.server_config("foo.test").expect("leaf"),
            client_trusting(ca.ca_pem()),
            "foo.test",
        )
        .await
        .expect("handshake");
    }

    #[test]
    fn garbage_files_are_replaced() {
        let dir = tempfile::tempdir().expect("tempdir");
        fs::write(dir.path().join(CA_CERT_FILE), "not a certificate").expect("write");
        fs::write(dir.path().join(CA_KEY_FILE), "not a key").expect("write");
        let ca = Authority::load_or_create(dir.path()).expect("regenerate CA");
        assert!(ca.ca_pem().starts_with("-----BEGIN CERTIFICATE-----"));
    }

    #[test]
    fn widened_key_mode_is_tightened_on_load() {
        let dir = tempfile::tempdir().expect("tempdir");
        let first = Authority::load_or_create(dir.path()).expect("create CA");
        let key = dir.path().join(CA_KEY_FILE);
        fs::set_permissions(&key, fs::Permissions::from_mode(0o644)).expect("chmod");
        let second = Authority::load_or_create(dir.path()).expect("reload CA");
        assert_eq!(first.ca_pem(), second.ca_pem());
        assert_eq!(mode_of(&key), 0o600);
    }

    /// A throwaway CA (not an `Authority`) and a server config for `host`
    /// signed by it, as an upstream server would present.
    fn upstream_server(host: &str) -> (String, Arc<ServerConfig>) {
        let ca_key = KeyPair::generate().expect("key");
        let mut ca_params = CertificateParams::default();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign];
        let ca_cert = ca_params.self_signed(&ca_key).expect("self-sign");
        let issuer = Issuer::new(ca_params, ca_key);

        let leaf_key = KeyPair::generate().expect("key");
        let mut leaf_params = CertificateParams::new(vec![host.to_owned()]).expect("params");
        leaf_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let leaf = leaf_params.signed_by(&leaf_key, &issuer).expect("sign");
        let config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_no_client_auth()
            .with_single_cert(
                vec![leaf.der().clone()],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf_key.serialize_der())),
            )
            .expect("server config");
        (ca_cert.pem(), Arc::new(config))
    }

    #[tokio::test]
    async fn upstream_config_trusts_the_extra_bundle_and_nothing_else() {
        let (trusted_ca, trusted_server) = upstream_server("upstream.test");
        let (_, untrusted_server) = upstream_server("upstream.test");
        let dir = tempfile::tempdir().expect("tempdir");
        let bundle = dir.path().join("roots.pem");
        fs::write(&bundle, &trusted_ca).expect("write bundle");

        let client = upstream_client_config(Some(&bundle)).expect("client config");
        assert_eq!(client.alpn_protocols, vec![b"http/1.1".to_vec()]);
        handshake(trusted_server, client.clone(), "upstream.test")
            .await
            .expect("server from the bundled CA");
        handshake(untrusted_server, client, "upstream.test")
            .await
            .expect_err("server from an unrelated CA");
    }

    #[test]
    fn upstream_config_rejects_bad_bundles_naming_the_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let missing = dir.path().join("missing.pem");
        let err = upstream_client_config(Some(&missing)).expect_err("missing bundle");
        assert!(err.to_string().contains("missing.pem"), "{err}");

        let empty = dir.path().join("empty.pem");
        fs::write(&empty, "no certificates here\n").expect("write");
        let err = upstream_client_config(Some(&empty)).expect_err("empty bundle");
        assert!(err.to_string().contains("empty.pem"), "{err}");
    }

    #[test]
    fn authority_is_shareable_across_tasks() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Authority>();
    }
}
