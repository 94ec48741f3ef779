//! Loopback upstreams for the egress phase, and the TLS material they serve
//! with: a throwaway CA and one server certificate it signs.
//!
//! Owns three kinds of server, each on `127.0.0.1:0`, each serving on the
//! runtime it was started on until that runtime stops:
//!
//! - HTTP/1.1, plain or TLS with a [`TestCa`] certificate, answering every
//!   request with [`SMALL_BODY`] bytes, keep-alive allowed ([`start_http`]);
//! - a byte source and sink for throughput, one transfer per connection
//!   ([`start_bulk`]);
//! - a bare TCP relay to one loopback address, the floor for any proxy's
//!   tunnel ([`start_relay`]).
//!
//! It does not start the proxy nor time anything (`egress` does), and it
//! connects only to the loopback address a relay is given.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context as _;
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

/// Bytes of every body [`start_http`] answers with: a small API response.
pub const SMALL_BODY: usize = 256;

/// The size of every read and write of the bulk server, as the proxy's
/// own tunnel buffer.
pub const BULK_BUFFER: usize = 64 * 1024;

/// Bulk request: `BULK_DOWN` and a big-endian u64 N; the server sends N
/// bytes.
pub const BULK_DOWN: u8 = b'd';

/// Bulk request: `BULK_UP` and a big-endian u64 N; the server reads N bytes,
/// then answers [`BULK_ACK`].
pub const BULK_UP: u8 = b'u';

/// What the bulk server answers once it has read an upload.
pub const BULK_ACK: &[u8; 2] = b"ok";

/// A throwaway CA and a server config presenting a leaf it signed.
pub struct TestCa {
    /// The CA certificate, for clients (and the proxy) to trust.
    pub ca_der: CertificateDer<'static>,
    /// The same certificate in PEM, for `upstream_client_config`.
    pub ca_pem: String,
    /// A TLS server config whose leaf names `names`.
    pub server: Arc<rustls::ServerConfig>,
}

impl TestCa {
    /// A new CA and a leaf for `names` (DNS names; `*.suffix` wildcards
    /// allowed), both ECDSA P-256, served with TLS 1.3 or 1.2.
    pub fn new(names: &[&str]) -> anyhow::Result<TestCa> {
        let ca_key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
        let mut ca_params = CertificateParams::default();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "runbox-bench upstream CA");
        let ca_cert = ca_params.self_signed(&ca_key)?;
        let issuer = Issuer::new(ca_params, ca_key);

        let leaf_key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
        let leaf_params =
            CertificateParams::new(names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>())?;
        let leaf = leaf_params.signed_by(&leaf_key, &issuer)?;
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let server = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(
                vec![leaf.der().clone()],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf_key.serialize_der())),
            )
            .context("building the upstream server config")?;
        Ok(TestCa {
            ca_der: ca_cert.der().clone(),
            ca_pem: ca_cert.pem(),
            server: Arc::new(server),
        })
    }
}

/// Starts the HTTP/1.1 upstream (over TLS when `tls` is given) and returns
/// its port. Every request gets `200` and [`SMALL_BODY`] bytes; connections
/// stay open for more requests until the client closes them.
pub async fn start_http(tls: Option<Arc<rustls::ServerConfig>>) -> io::Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
    let body = Bytes::from(vec![b'x'; SMALL_BODY]);
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            // As any server tuned for small responses: no Nagle delay.
            let _ = tcp.set_nodelay(true);
            let acceptor = acceptor.clone();
            let body = body.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<Incoming>| {
                    let body = body.clone();
                    async move {
                        // The request body, if any, is left to hyper to drain.
                        drop(req);
                        Ok::<_, std::convert::Infallible>(Response::new(Full::new(body)))
                    }
                });
                let builder = hyper::server::conn::http1::Builder::new();
                match acceptor {
                    Some(acceptor) => {
                        if let Ok(tls) = acceptor.accept(tcp).await {
                            let _ = builder.serve_connection(TokioIo::new(tls), svc).await;
                        }
                    }
                    None => {
                        let _ = builder.serve_connection(TokioIo::new(tcp), svc).await;
                    }
                }
            });
        }
    });
    Ok(port)
}

/// Starts the bulk upstream and returns its port. Each connection carries
/// one transfer: [`BULK_DOWN`] or [`BULK_UP`], a big-endian u64 length, then
/// that many bytes in the direction asked, in [`BULK_BUFFER`] pieces; an
/// upload ends with [`BULK_ACK`] from the server.
pub async fn start_bulk() -> io::Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    tokio::spawn(async move {
        while let Ok((mut tcp, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut op = [0u8; 9];
                if tcp.read_exact(&mut op).await.is_err() {
                    return;
                }
                let mut length = [0u8; 8];
                length.copy_from_slice(&op[1..]);
                let mut left = u64::from_be_bytes(length);
                let mut buf = vec![0u8; BULK_BUFFER];
                while left > 0 {
                    let len = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
                    let done = match op[0] {
                        BULK_DOWN => tcp.write_all(&buf[..len]).await.map(|()| len),
                        BULK_UP => tcp.read(&mut buf[..len]).await,
                        _ => return,
                    };
                    match done {
                        Ok(0) | Err(_) => return,
                        Ok(done) => left -= done as u64,
                    }
                }
                if op[0] == BULK_UP {
                    let _ = tcp.write_all(BULK_ACK).await;
                }
            });
        }
    });
    Ok(port)
}

/// Starts a bare relay to `to` (a loopback address) and returns its port:
/// each accepted connection is joined to a new connection to `to`, and bytes
/// are copied both ways with `buffer`-byte buffers until both sides are done,
/// as the proxy's blind tunnel copies them, with nothing else: no request to
/// parse, no policy, no lookup, no counting.
pub async fn start_relay(to: SocketAddr, buffer: usize) -> io::Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            tokio::spawn(async move {
                let Ok(mut upstream) = TcpStream::connect(to).await else {
                    return;
                };
                let _ = client.set_nodelay(true);
                let _ = upstream.set_nodelay(true);
                let _ = tokio::io::copy_bidirectional_with_sizes(
                    &mut client,
                    &mut upstream,
                    buffer,
                    buffer,
                )
                .await;
            });
        }
    });
    Ok(port)
}
