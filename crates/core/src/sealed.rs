//! Secrets at rest: the values of secrets a caller brings are kept in the
//! run's record sealed (AES-256-GCM) under a key of the node, never in
//! plain text, so a restarted daemon serves them again while a copy of the
//! state directory's records, a backup or a grep finds no value.
//!
//! What it does not protect against: someone who can read the state
//! directory's key file as well as the records (root on the host) can
//! open them, as they could read the daemon's memory. The key file is
//! `secrets.key` (0600) in the state directory; deleting it makes every
//! sealed value unreadable, and the runs holding them go on without them
//! (their requests carry the placeholder, never a value).
//!
//! The [`Sealer`] trait is what the rest of the core sees, so a fleet can
//! put the key in a key service without the records changing shape. In a
//! fleet the key is derived from the cluster key, the same on every node;
//! a node that sealed values under its own file before it joined still
//! opens them ([`Keyring`]).

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Seals and opens secret values, and fingerprints them for comparison.
pub trait Sealer: Send + Sync + std::fmt::Debug {
    /// `value` sealed, bound to `context` (opening needs the same context).
    fn seal(&self, context: &str, value: &[u8]) -> Result<String, String>;

    /// The value sealed under `context`, or why it cannot be opened.
    fn open(&self, context: &str, sealed: &str) -> Result<Vec<u8>, String>;

    /// A keyed digest of `value`: equal values give equal digests on this
    /// node, and the digest tells nothing about the value without the key
    /// (a plain hash of a short token could be searched).
    fn fingerprint(&self, value: &[u8]) -> String;
}

/// The version prefix of a sealed value.
const SEALED_V1: &str = "v1:";

/// The length of the key file.
const KEY_LEN: usize = 32;

/// A [`Sealer`] whose key is a file of the state directory.
pub struct KeyFileSealer {
    /// Seals and opens.
    aead: LessSafeKey,
    /// Keys [`Sealer::fingerprint`].
    mac_key: [u8; 32],
}

impl std::fmt::Debug for KeyFileSealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeyFileSealer")
    }
}

/// A subkey of `key` for one purpose, so the cipher and the fingerprint
/// never share a key.
fn derive(key: &[u8], purpose: &str) -> [u8; 32] {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes any key length");
    mac.update(purpose.as_bytes());
    mac.finalize().into_bytes().into()
}

impl KeyFileSealer {
    /// Loads the key at `path`, making it (32 random bytes, 0600) when
    /// there is none. A key file of the wrong length is an error, never
    /// replaced: the values sealed under it would be lost.
    pub fn open_or_create(path: &Path) -> Result<KeyFileSealer, String> {
        let key = match std::fs::read(path) {
            Ok(key) => key,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let mut key = vec![0u8; KEY_LEN];
                aws_lc_rs::rand::fill(&mut key)
                    .map_err(|_| format!("no random bytes for {}", path.display()))?;
                match std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(path)
                {
                    Ok(mut file) => {
                        file.write_all(&key)
                            .and_then(|()| file.sync_all())
                            .map_err(|e| format!("writing {}: {e}", path.display()))?;
                        if let Some(dir) = path.parent() {
                            crate::durable::sync_dir(dir)
                                .map_err(|e| format!("syncing {}: {e}", dir.display()))?;
                        }
                        key
                    }
                    // Another process made it first: use theirs.
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => std::fs::read(path)
                        .map_err(|e| format!("reading {}: {e}", path.display()))?,
                    Err(e) => return Err(format!("creating {}: {e}", path.display())),
                }
            }
            Err(e) => return Err(format!("reading {}: {e}", path.display())),
        };
        if key.len() != KEY_LEN {
            return Err(format!(
                "{} holds {} bytes, not {KEY_LEN}; it is not a runbox key (move it away to make a \
                 new one, and the secrets sealed under the old one are lost)",
                path.display(),
                key.len()
            ));
        }
        Ok(KeyFileSealer::from_key(&key))
    }

    /// A sealer from key material: 32 bytes of a key file, or a key derived
    /// from the cluster key.
    pub fn from_key(key: &[u8]) -> KeyFileSealer {
        let cipher = derive(key, "runbox secret sealing v1");
        let aead = LessSafeKey::new(
            UnboundKey::new(&AES_256_GCM, &cipher).expect("a 32-byte key fits AES-256-GCM"),
        );
        KeyFileSealer {
            aead,
            mac_key: derive(key, "runbox secret fingerprint v1"),
        }
    }
}

impl Sealer for KeyFileSealer {
    fn seal(&self, context: &str, value: &[u8]) -> Result<String, String> {
        // Random 96-bit nonces: the number of values sealed under one key
        // stays many orders of magnitude below where they could repeat.
        let mut nonce = [0u8; NONCE_LEN];
        aws_lc_rs::rand::fill(&mut nonce).map_err(|_| "no random bytes for a nonce".to_owned())?;
        let mut sealed = value.to_vec();
        self.aead
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(context.as_bytes()),
                &mut sealed,
            )
            .map_err(|_| "sealing failed".to_owned())?;
        let mut out = nonce.to_vec();
        out.extend_from_slice(&sealed);
        Ok(format!(
            "{SEALED_V1}{}",
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(out)
        ))
    }

    fn open(&self, context: &str, sealed: &str) -> Result<Vec<u8>, String> {
        let body = sealed
            .strip_prefix(SEALED_V1)
            .ok_or_else(|| "not a sealed value of this runbox version".to_owned())?;
        let mut bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(body)
            .map_err(|_| "the sealed value is damaged".to_owned())?;
        if bytes.len() < NONCE_LEN {
            return Err("the sealed value is damaged".to_owned());
        }
        let mut in_out = bytes.split_off(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(&bytes)
            .map_err(|_| "the sealed value is damaged".to_owned())?;
        let plain = self
            .aead
            .open_in_place(nonce, Aad::from(context.as_bytes()), &mut in_out)
            .map_err(|_| {
                "the sealed value does not open with this node's key (secrets.key was \
                 replaced, or the record was changed)"
                    .to_owned()
            })?;
        Ok(plain.to_vec())
    }

    fn fingerprint(&self, value: &[u8]) -> String {
        let mut mac =
            <Hmac<Sha256> as Mac>::new_from_slice(&self.mac_key).expect("HMAC takes any key");
        mac.update(value);
        mac.finalize()
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

/// Seals under one key and opens under it or any older one: a node that
/// joined a fleet seals under the fleet's key and still opens what it
/// sealed under its own before.
#[derive(Debug)]
pub struct Keyring {
    /// Seals, opens first and fingerprints.
    current: KeyFileSealer,
    /// Opened with when the current key does not open a value.
    older: Vec<KeyFileSealer>,
}

impl Keyring {
    /// A ring that seals under `current` and also opens under `older`.
    pub fn new(current: KeyFileSealer, older: Vec<KeyFileSealer>) -> Keyring {
        Keyring { current, older }
    }
}

impl Sealer for Keyring {
    fn seal(&self, context: &str, value: &[u8]) -> Result<String, String> {
        self.current.seal(context, value)
    }

    fn open(&self, context: &str, sealed: &str) -> Result<Vec<u8>, String> {
        let first = match self.current.open(context, sealed) {
            Ok(value) => return Ok(value),
            Err(why) => why,
        };
        self.older
            .iter()
            .find_map(|key| key.open(context, sealed).ok())
            .ok_or(first)
    }

    fn fingerprint(&self, value: &[u8]) -> String {
        self.current.fingerprint(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_keyring_seals_under_its_current_key_and_opens_under_any() {
        let own = KeyFileSealer::from_key(&[3; 32]);
        let before = own.seal("GH", b"old").unwrap();
        let ring = Keyring::new(KeyFileSealer::from_key(&[4; 32]), vec![own]);
        assert_eq!(ring.open("GH", &before).unwrap(), b"old");
        let after = ring.seal("GH", b"new").unwrap();
        assert_eq!(ring.open("GH", &after).unwrap(), b"new");
        // Sealed under the fleet's key: another node of the fleet opens it.
        let peer = KeyFileSealer::from_key(&[4; 32]);
        assert_eq!(peer.open("GH", &after).unwrap(), b"new");
        assert!(peer.open("GH", &before).is_err());
        assert_eq!(ring.fingerprint(b"x"), peer.fingerprint(b"x"));
        assert!(ring.open("OTHER", &after).is_err());
    }

    #[test]
    fn values_round_trip_only_under_their_context_and_key() {
        let sealer = KeyFileSealer::from_key(&[7; 32]);
        let sealed = sealer.seal("GH", b"s3cret").unwrap();
        assert!(!sealed.contains("s3cret"));
        assert_eq!(sealer.open("GH", &sealed).unwrap(), b"s3cret");
        // Sealing twice gives two texts (fresh nonces), both open.
        let again = sealer.seal("GH", b"s3cret").unwrap();
        assert_ne!(again, sealed);
        assert_eq!(sealer.open("GH", &again).unwrap(), b"s3cret");
        assert!(sealer.open("OTHER", &sealed).is_err());
        let other = KeyFileSealer::from_key(&[8; 32]);
        assert!(other
            .open("GH", &sealed)
            .unwrap_err()
            .contains("secrets.key"));
        for damaged in ["", "v1:", "v1:!!", "v2:abc", &sealed[..sealed.len() - 2]] {
            assert!(sealer.open("GH", damaged).is_err(), "{damaged:?}");
        }
    }

    #[test]
    fn fingerprints_are_keyed() {
        let a = KeyFileSealer::from_key(&[1; 32]);
        let b = KeyFileSealer::from_key(&[2; 32]);
        assert_eq!(a.fingerprint(b"x"), a.fingerprint(b"x"));
        assert_ne!(a.fingerprint(b"x"), a.fingerprint(b"y"));
        assert_ne!(a.fingerprint(b"x"), b.fingerprint(b"x"));
    }

    #[test]
    fn the_key_file_is_made_once_private_and_never_replaced() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secrets.key");
        let first = KeyFileSealer::open_or_create(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let sealed = first.seal("A", b"v").unwrap();
        let second = KeyFileSealer::open_or_create(&path).unwrap();
        assert_eq!(second.open("A", &sealed).unwrap(), b"v");
        std::fs::write(&path, b"short").unwrap();
        let err = KeyFileSealer::open_or_create(&path).unwrap_err();
        assert!(err.contains("not a runbox key"), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), b"short");
    }
}
