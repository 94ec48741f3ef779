//! A registry token service (the "Docker token auth" flow) on loopback, so
//! the bearer-token dance is tested against the real registry's checks.
//!
//! It signs ES256 JWTs with a fresh P-256 key whose self-signed certificate
//! the registry trusts (`rootcertbundle`) and finds through the token's
//! `x5c` header. One user, given every action it asks for; anyone else is
//! given a token that grants nothing, as public registries do.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{SystemTime, UNIX_EPOCH};

use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use base64::Engine as _;
use ring::rand::SystemRandom;
use ring::signature::{EcdsaKeyPair, ECDSA_P256_SHA256_FIXED_SIGNING};
use serde_json::json;

pub const SERVICE: &str = "runbox-test-registry";
pub const ISSUER: &str = "runbox-test-issuer";

/// One token request as received: its query and whether it authenticated.
#[derive(Debug, Clone)]
pub struct TokenRequest {
    pub scopes: Vec<String>,
    pub user: Option<String>,
}

pub struct TokenService {
    /// `http://127.0.0.1:PORT/token`.
    pub realm: String,
    /// PEM of the certificate the registry must trust.
    pub cert_pem: String,
    pub requests: Arc<Mutex<Vec<TokenRequest>>>,
    addr: String,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

struct Signer {
    key: EcdsaKeyPair,
    cert_der: Vec<u8>,
    user: String,
    password: String,
}

impl TokenService {
    pub fn start(user: &str, password: &str) -> Self {
        let rng = SystemRandom::new();
        let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &rng).unwrap();
        let key = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8.as_ref(), &rng)
            .unwrap();
        let cert_key = rcgen::KeyPair::try_from(pkcs8.as_ref()).unwrap();
        let cert = rcgen::CertificateParams::new(vec!["runbox-test-token-issuer".to_string()])
            .unwrap()
            .self_signed(&cert_key)
            .unwrap();
        let signer = Arc::new(Signer {
            key,
            cert_der: cert.der().to_vec(),
            user: user.to_string(),
            password: password.to_string(),
        });

        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let stop = Arc::new(AtomicBool::new(false));
        let requests: Arc<Mutex<Vec<TokenRequest>>> = Arc::default();
        let thread = {
            let (stop, requests) = (stop.clone(), requests.clone());
            std::thread::spawn(move || {
                for conn in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        return;
                    }
                    if let Ok(conn) = conn {
                        // One at a time: requests are few and small.
                        let _ = serve(conn, &signer, &requests);
                    }
                }
            })
        };
        Self {
            realm: format!("http://{addr}/token"),
            cert_pem: cert.pem(),
            requests,
            addr,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for TokenService {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect(&self.addr);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(
    conn: TcpStream,
    signer: &Signer,
    requests: &Mutex<Vec<TokenRequest>>,
) -> std::io::Result<()> {
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let target = line.split_whitespace().nth(1).unwrap_or("").to_string();
    let mut authorization = None;
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h == "\r\n" {
            break;
        }
        if let Some((name, value)) = h.split_once(':') {
            if name.eq_ignore_ascii_case("authorization") {
                authorization = Some(value.trim().to_string());
            }
        }
    }
    let query = target.split_once('?').map(|(_, q)| q).unwrap_or("");
    let params: Vec<(String, String)> = query
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (unescape(k), unescape(v)))
        .collect();
    let scopes: Vec<String> = params
        .iter()
        .filter(|(k, _)| k == "scope")
        .flat_map(|(_, v)| v.split(' ').map(str::to_string).collect::<Vec<_>>())
        .collect();
    let user = authorization
        .as_deref()
        .and_then(|a| a.strip_prefix("Basic "))
        .and_then(|b| STANDARD.decode(b).ok())
        .and_then(|b| String::from_utf8(b).ok())
        .and_then(|up| {
            up.split_once(':')
                .map(|(u, p)| (u.to_string(), p.to_string()))
        });
    requests.lock().unwrap().push(TokenRequest {
        scopes: scopes.clone(),
        user: user.as_ref().map(|(u, _)| u.clone()),
    });
    let mut out = conn;
    let respond = |out: &mut TcpStream, status: &str, body: String| {
        write!(
            out,
            "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
             Connection: close\r\n\r\n{body}",
            body.len()
        )
    };
    let granted = match &user {
        Some((u, p)) if *u == signer.user && *p == signer.password => true,
        // Wrong credentials are refused outright; none at all get a token
        // that allows nothing.
        Some(_) => {
            return respond(
                &mut out,
                "401 Unauthorized",
                r#"{"details":"bad credentials"}"#.into(),
            )
        }
        None => false,
    };
    let access: Vec<serde_json::Value> = scopes
        .iter()
        .filter(|_| granted)
        .filter_map(|s| {
            let mut parts = s.splitn(3, ':');
            let (kind, name, actions) = (parts.next()?, parts.next()?, parts.next()?);
            Some(json!({"type": kind, "name": name, "actions": actions.split(',').collect::<Vec<_>>()}))
        })
        .collect();
    let token = signer.sign(user.as_ref().map(|(u, _)| u.as_str()).unwrap_or(""), access);
    respond(
        &mut out,
        "200 OK",
        json!({"token": token, "access_token": token, "expires_in": 300}).to_string(),
    )
}

impl Signer {
    fn sign(&self, subject: &str, access: Vec<serde_json::Value>) -> String {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let header =
            json!({"typ": "JWT", "alg": "ES256", "x5c": [STANDARD.encode(&self.cert_der)]});
        let claims = json!({
            "iss": ISSUER,
            "sub": subject,
            "aud": SERVICE,
            "exp": now + 300,
            "nbf": now - 10,
            "iat": now,
            "jti": format!("{now}-{}", access.len()),
            "access": access,
        });
        let input = format!(
            "{}.{}",
            URL_SAFE_NO_PAD.encode(header.to_string()),
            URL_SAFE_NO_PAD.encode(claims.to_string())
        );
        let sig = self
            .key
            .sign(&SystemRandom::new(), input.as_bytes())
            .unwrap();
        format!("{input}.{}", URL_SAFE_NO_PAD.encode(sig.as_ref()))
    }
}

/// Decodes `%XX` and `+` in a query component.
fn unescape(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}
