//! Preview tokens: a run id, a guest port and an expiry, signed with the
//! operator's key (HMAC-SHA256), so the preview listener can check a URL
//! without any state and without the API token.
//!
//! A token is base64url (no padding) of 43 bytes:
//!
//! | bytes | what |
//! |---|---|
//! | 0 | version, 1 |
//! | 1..17 | the run's ULID, big-endian |
//! | 17..19 | the guest port, big-endian |
//! | 19..27 | the expiry, Unix seconds, big-endian |
//! | 27..43 | the first 16 bytes of HMAC-SHA256(key, bytes 0..27) |
//!
//! Tokens cannot be revoked one by one: deleting the run ends them all (its
//! id is never reused), and a new key ends every token.

use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::Path;

use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use ulid::Ulid;

/// The token's layout version.
const VERSION: u8 = 1;

/// Bytes of a token before the tag.
const BODY: usize = 27;

/// Bytes of the tag kept: 128 bits, past any online guessing.
const TAG: usize = 16;

/// The shortest operator secret accepted.
pub const MIN_SECRET: usize = 32;

/// What a valid token grants.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grant {
    /// The run.
    pub run: Ulid,
    /// The port inside it.
    pub port: u16,
    /// Unix seconds after which the token is refused.
    pub expires: i64,
}

/// Why a token is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// Not a token of this format, or its signature does not match.
    #[error("the preview token is not valid")]
    Invalid,
    /// Valid, but past its expiry.
    #[error("the preview token has expired; mint a new one")]
    Expired,
}

/// The signing key.
#[derive(Clone)]
pub struct PreviewKey {
    key: Vec<u8>,
}

impl std::fmt::Debug for PreviewKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PreviewKey(<redacted>)")
    }
}

impl PreviewKey {
    /// A key from the operator's secret (at least [`MIN_SECRET`] bytes).
    pub fn from_secret(secret: &str) -> Result<PreviewKey, String> {
        if secret.len() < MIN_SECRET {
            return Err(format!(
                "the preview secret must be at least {MIN_SECRET} bytes (for example `openssl rand -hex 32`)"
            ));
        }
        Ok(PreviewKey {
            key: secret.as_bytes().to_vec(),
        })
    }

    /// The key in `path`, made (32 random bytes, hex, owner-only) when the
    /// file does not exist yet.
    pub fn load_or_create(path: &Path) -> std::io::Result<PreviewKey> {
        match std::fs::read_to_string(path) {
            Ok(text) => PreviewKey::from_secret(text.trim()).map_err(|why| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("{}: {why}", path.display()),
                )
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let mut bytes = [0u8; 32];
                rustix::rand::getrandom(&mut bytes, rustix::rand::GetRandomFlags::empty())?;
                let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
                let tmp = path.with_extension("tmp");
                let mut file = std::fs::OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .mode(0o600)
                    .open(&tmp)?;
                file.write_all(hex.as_bytes())?;
                file.sync_all()?;
                std::fs::rename(&tmp, path)?;
                Ok(PreviewKey {
                    key: hex.into_bytes(),
                })
            }
            Err(e) => Err(e),
        }
    }

    fn mac(&self) -> Hmac<Sha256> {
        // HMAC takes a key of any length.
        Hmac::<Sha256>::new_from_slice(&self.key).expect("HMAC accepts any key length")
    }

    /// Mints a token for `grant`.
    pub fn mint(&self, grant: Grant) -> String {
        let mut bytes = Vec::with_capacity(BODY + TAG);
        bytes.push(VERSION);
        bytes.extend_from_slice(&u128::from(grant.run).to_be_bytes());
        bytes.extend_from_slice(&grant.port.to_be_bytes());
        bytes.extend_from_slice(&grant.expires.to_be_bytes());
        let mut mac = self.mac();
        mac.update(&bytes);
        bytes.extend_from_slice(&mac.finalize().into_bytes()[..TAG]);
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
    }

    /// Checks `token` at `now` (Unix seconds).
    pub fn verify(&self, token: &str, now: i64) -> Result<Grant, TokenError> {
        // The length check first: nothing longer is decoded.
        if token.len() != ((BODY + TAG) * 4).div_ceil(3) {
            return Err(TokenError::Invalid);
        }
        let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(token)
            .map_err(|_| TokenError::Invalid)?;
        if bytes.len() != BODY + TAG || bytes[0] != VERSION {
            return Err(TokenError::Invalid);
        }
        let (body, tag) = bytes.split_at(BODY);
        let mut mac = self.mac();
        mac.update(body);
        // Constant-time comparison of the truncated tag.
        mac.verify_truncated_left(tag)
            .map_err(|_| TokenError::Invalid)?;
        let run = u128::from_be_bytes(body[1..17].try_into().map_err(|_| TokenError::Invalid)?);
        let port = u16::from_be_bytes([body[17], body[18]]);
        let expires = i64::from_be_bytes(body[19..27].try_into().map_err(|_| TokenError::Invalid)?);
        if now >= expires {
            return Err(TokenError::Expired);
        }
        Ok(Grant {
            run: Ulid::from(run),
            port,
            expires,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> PreviewKey {
        PreviewKey::from_secret(&"k".repeat(32)).unwrap()
    }

    fn grant() -> Grant {
        Grant {
            run: Ulid::new(),
            port: 8080,
            expires: 2_000_000_000,
        }
    }

    #[test]
    fn a_token_round_trips_and_is_url_safe() {
        let grant = grant();
        let token = key().mint(grant);
        assert_eq!(token.len(), 58);
        assert!(token
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'));
        assert_eq!(key().verify(&token, 1_000).unwrap(), grant);
    }

    #[test]
    fn expired_tampered_and_foreign_tokens_are_refused() {
        let token = key().mint(grant());
        assert_eq!(
            key().verify(&token, 2_000_000_000),
            Err(TokenError::Expired)
        );
        // Every single-character change is caught.
        for i in 0..token.len() {
            let mut bytes = token.clone().into_bytes();
            bytes[i] = if bytes[i] == b'A' { b'B' } else { b'A' };
            let changed = String::from_utf8(bytes).unwrap();
            if changed != token {
                assert!(key().verify(&changed, 0).is_err(), "position {i}");
            }
        }
        let other = PreviewKey::from_secret(&"o".repeat(32)).unwrap();
        assert_eq!(other.verify(&token, 0), Err(TokenError::Invalid));
        for junk in [
            "",
            "x",
            &"A".repeat(58),
            &"A".repeat(5000),
            "../../etc/passwd",
        ] {
            assert_eq!(key().verify(junk, 0), Err(TokenError::Invalid), "{junk}");
        }
    }

    #[test]
    fn short_secrets_are_refused_and_keys_persist() {
        assert!(PreviewKey::from_secret("short").is_err());
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("preview.key");
        let first = PreviewKey::load_or_create(&path).unwrap();
        let token = first.mint(grant());
        let again = PreviewKey::load_or_create(&path).unwrap();
        assert!(again.verify(&token, 0).is_ok());
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }
}
