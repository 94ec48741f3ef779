//! Image references and the plain-HTTP decision.
//!
//! Owns turning what a user typed (`busybox`, `ghcr.io/o/x:1`,
//! `127.0.0.1:5000/x@sha256:…`, `http://host:5000/x`) into a normalised
//! reference, and deciding — before any connection is made — whether the
//! registry is reached over HTTPS or plain HTTP. It does no I/O.
//!
//! Normalisation follows Docker's: no registry means `docker.io`, a
//! single-component name on Docker Hub lives under `library/`, and no tag
//! and no digest means `:latest`.

use std::net::IpAddr;

use oci_client::Reference;

use super::PullError;

/// How the registry is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scheme {
    Https,
    Http,
}

/// A parsed, normalised image reference.
#[derive(Debug, Clone)]
pub(crate) struct ImageRef {
    /// The reference in oci-client's form (registry, repository, tag, digest).
    pub(crate) inner: Reference,
    /// A scheme the user asked for with an `http://` or `https://` prefix.
    pub(crate) requested: Option<Scheme>,
}

impl ImageRef {
    /// Parses `input`, accepting an optional `http://` or `https://` prefix.
    pub(crate) fn parse(input: &str) -> Result<Self, PullError> {
        let bad = |reason: String| PullError::BadReference {
            reference: input.to_string(),
            reason,
        };
        let trimmed = input.trim();
        let (requested, rest) = if let Some(rest) = strip_prefix_ci(trimmed, "http://") {
            (Some(Scheme::Http), rest)
        } else if let Some(rest) = strip_prefix_ci(trimmed, "https://") {
            (Some(Scheme::Https), rest)
        } else if trimmed.contains("://") {
            return Err(bad(
                "the only schemes accepted are http:// and https://".into()
            ));
        } else {
            (None, trimmed)
        };
        if rest.is_empty() {
            return Err(bad("the reference is empty".into()));
        }
        let inner: Reference = rest.parse().map_err(|e| bad(format!("{e}")))?;
        // oci-spec lets upper case through; registries (and Docker) do not.
        if inner.repository().bytes().any(|b| b.is_ascii_uppercase()) {
            return Err(bad("repository names must be lower case".into()));
        }
        // A scheme names a registry, so `http://busybox` (which would mean
        // Docker Hub over plain HTTP) is almost certainly a typo.
        if requested.is_some() && !rest.contains('/') {
            return Err(bad(
                "a reference with a scheme must name its registry (http://HOST[:PORT]/NAME)".into(),
            ));
        }
        if let Some(digest) = inner.digest() {
            // oci-spec checks the length only; the digest ends up in URLs and
            // is compared byte for byte, so insist on the canonical form.
            if !is_sha256_digest(digest) {
                return Err(bad(format!(
                    "digest {digest} is not of the form sha256:<64 lowercase hex digits>"
                )));
            }
        }
        Ok(Self { inner, requested })
    }

    /// The registry as written in the reference (`docker.io`, `host:5000`).
    pub(crate) fn registry(&self) -> &str {
        self.inner.registry()
    }

    /// The normalised reference, without any scheme.
    pub(crate) fn normalised(&self) -> String {
        self.inner.whole()
    }
}

fn strip_prefix_ci<'a>(s: &'a str, prefix: &str) -> Option<&'a str> {
    if s.len() >= prefix.len() && s.is_char_boundary(prefix.len()) {
        let (head, tail) = s.split_at(prefix.len());
        head.eq_ignore_ascii_case(prefix).then_some(tail)
    } else {
        None
    }
}

/// Whether `digest` is `sha256:` followed by 64 lowercase hex digits.
///
/// Digests from manifests are untrusted and may become file names in a
/// layer store, so this is the only form that goes any further.
pub(crate) fn is_sha256_digest(digest: &str) -> bool {
    digest.strip_prefix("sha256:").is_some_and(|hex| {
        hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    })
}

/// The host part of `host[:port]`, without the brackets of an IPv6 literal.
fn host_of(registry: &str) -> &str {
    if let Some(rest) = registry.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    // A bare IPv6 address has colons but no port.
    if registry.matches(':').count() > 1 {
        return registry;
    }
    match registry.rsplit_once(':') {
        Some((host, port)) if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => host,
        _ => registry,
    }
}

/// Whether `registry` (`host[:port]`) names this machine's loopback.
///
/// Only literal names count: `localhost`, 127.0.0.0/8 and `::1`. A name that
/// merely resolves to loopback is not trusted, since resolution can change
/// between this decision and the connection.
pub(crate) fn is_loopback(registry: &str) -> bool {
    let host = host_of(registry);
    if host.eq_ignore_ascii_case("localhost") {
        return true;
    }
    match host.parse::<IpAddr>() {
        Ok(IpAddr::V4(v4)) => v4.is_loopback(),
        Ok(IpAddr::V6(v6)) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
        Err(_) => false,
    }
}

/// Whether `registry` is listed in `insecure` (exact `host[:port]`, any case).
fn is_listed(registry: &str, insecure: &[String]) -> bool {
    insecure
        .iter()
        .any(|entry| entry.trim().eq_ignore_ascii_case(registry))
}

/// Decides how to reach `image`'s registry, before any connection.
///
/// * `https://` is always honoured.
/// * Loopback registries and those listed in `insecure` use plain HTTP
///   (with or without an `http://` prefix): these are where people run
///   registries without certificates.
/// * `http://` for any other registry is refused, naming the flag that
///   would allow it.
/// * Everything else uses HTTPS.
pub(crate) fn decide_scheme(image: &ImageRef, insecure: &[String]) -> Result<Scheme, PullError> {
    let registry = image.registry();
    let plain_allowed = is_loopback(registry) || is_listed(registry, insecure);
    match image.requested {
        Some(Scheme::Https) => Ok(Scheme::Https),
        _ if plain_allowed => Ok(Scheme::Http),
        Some(Scheme::Http) => Err(PullError::InsecureRegistry {
            registry: registry.to_string(),
        }),
        None => Ok(Scheme::Https),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    fn norm(s: &str) -> String {
        ImageRef::parse(s).unwrap().normalised()
    }

    #[test]
    fn docker_hub_defaults() {
        assert_eq!(norm("busybox"), "docker.io/library/busybox:latest");
        assert_eq!(norm("busybox:1.36"), "docker.io/library/busybox:1.36");
        assert_eq!(norm("library/busybox"), "docker.io/library/busybox:latest");
        assert_eq!(norm("someone/tool:v2"), "docker.io/someone/tool:v2");
        assert_eq!(
            norm("docker.io/busybox"),
            "docker.io/library/busybox:latest"
        );
        assert_eq!(
            norm("index.docker.io/busybox"),
            "docker.io/library/busybox:latest"
        );
    }

    #[test]
    fn other_registries_keep_their_names() {
        assert_eq!(norm("ghcr.io/o/x:1"), "ghcr.io/o/x:1");
        assert_eq!(norm("127.0.0.1:5000/x"), "127.0.0.1:5000/x:latest");
        assert_eq!(norm("localhost/x"), "localhost/x:latest");
        assert_eq!(norm("localhost:5000/a/b/c:t"), "localhost:5000/a/b/c:t");
        // oci-spec's grammar has no IPv6 literals.
        assert!(ImageRef::parse("[::1]:5000/x").is_err());
        // Tags keep their case; registries are host names, any case.
        assert_eq!(norm("Reg.Example/x:Tag"), "Reg.Example/x:Tag");
        // A first component without '.' or ':' is a Docker Hub namespace.
        assert_eq!(norm("registry/x"), "docker.io/registry/x:latest");
    }

    #[test]
    fn digests() {
        assert_eq!(
            norm(&format!("busybox@{D}")),
            format!("docker.io/library/busybox@{D}")
        );
        assert_eq!(
            norm(&format!("h.example:5000/x:t@{D}")),
            format!("h.example:5000/x:t@{D}")
        );
        let r = ImageRef::parse(&format!("x@{D}")).unwrap();
        assert_eq!(r.inner.digest(), Some(D));
        // Upper-case hex and other algorithms are refused.
        let upper = D.to_uppercase().replace("SHA256", "sha256");
        assert!(ImageRef::parse(&format!("x@{upper}")).is_err());
        assert!(ImageRef::parse(&format!("x@sha512:{}", "a".repeat(128))).is_err());
        assert!(ImageRef::parse("x@sha256:abc").is_err());
    }

    #[test]
    fn schemes() {
        let r = ImageRef::parse("http://127.0.0.1:5000/x:t").unwrap();
        assert_eq!(r.requested, Some(Scheme::Http));
        assert_eq!(r.normalised(), "127.0.0.1:5000/x:t");
        let r = ImageRef::parse("HTTPS://h.example/x").unwrap();
        assert_eq!(r.requested, Some(Scheme::Https));
        assert!(ImageRef::parse("ftp://h.example/x").is_err());
        assert!(ImageRef::parse("http://busybox").is_err());
        assert!(ImageRef::parse("http://").is_err());
    }

    #[test]
    fn bad_references() {
        for bad in [
            "",
            "  ",
            "UPPER/case",
            "x:bad tag",
            "x::y",
            "/x",
            "x/",
            "a//b",
        ] {
            let err = ImageRef::parse(bad).unwrap_err();
            assert!(
                matches!(err, PullError::BadReference { .. }),
                "{bad:?}: {err}"
            );
        }
    }

    #[test]
    fn loopback_names() {
        for yes in [
            "localhost",
            "localhost:5000",
            "LOCALHOST:1",
            "127.0.0.1",
            "127.0.0.1:5000",
            "127.8.9.10:80",
            "[::1]:5000",
            "[::1]",
            "::1",
        ] {
            assert!(is_loopback(yes), "{yes}");
        }
        for no in [
            "registry.example:5000",
            "10.0.0.1:5000",
            "128.0.0.1",
            "localhost.example",
            "mylocalhost:5000",
            "[::2]:5000",
            "docker.io",
            "0.0.0.0:5000",
        ] {
            assert!(!is_loopback(no), "{no}");
        }
    }

    fn decide(reference: &str, insecure: &[&str]) -> Result<Scheme, PullError> {
        let insecure: Vec<String> = insecure.iter().map(|s| s.to_string()).collect();
        decide_scheme(&ImageRef::parse(reference).unwrap(), &insecure)
    }

    #[test]
    fn insecure_decision() {
        // Loopback: plain HTTP without asking.
        assert_eq!(decide("127.0.0.1:5000/x", &[]).unwrap(), Scheme::Http);
        assert_eq!(
            decide("http://localhost:5000/x", &[]).unwrap(),
            Scheme::Http
        );
        assert_eq!(
            decide("https://localhost:5000/x", &[]).unwrap(),
            Scheme::Https
        );
        // Elsewhere: HTTPS unless listed.
        assert_eq!(
            decide("registry.example:5000/x", &[]).unwrap(),
            Scheme::Https
        );
        assert_eq!(decide("busybox", &[]).unwrap(), Scheme::Https);
        let err = decide("http://registry.example:5000/x", &[]).unwrap_err();
        match &err {
            PullError::InsecureRegistry { registry } => {
                assert_eq!(registry, "registry.example:5000")
            }
            other => panic!("{other}"),
        }
        assert!(err
            .to_string()
            .contains("--insecure-registry registry.example:5000"));
        // Listed: plain HTTP, with or without the prefix; the port is part of the name.
        let listed = ["Registry.Example:5000"];
        assert_eq!(
            decide("registry.example:5000/x", &listed).unwrap(),
            Scheme::Http
        );
        assert_eq!(
            decide("http://registry.example:5000/x", &listed).unwrap(),
            Scheme::Http
        );
        assert_eq!(
            decide("https://registry.example:5000/x", &listed).unwrap(),
            Scheme::Https
        );
        assert!(decide("http://registry.example:5001/x", &listed).is_err());
        assert!(decide("http://registry.example/x", &listed).is_err());
    }

    #[test]
    fn sha256_digest_form() {
        assert!(is_sha256_digest(D));
        assert!(!is_sha256_digest(&D.replace("sha256", "sha512")));
        assert!(!is_sha256_digest(&format!("{D}0")));
        assert!(!is_sha256_digest("sha256:../../../../etc/passwd"));
        assert!(!is_sha256_digest(&D.replace('a', "A")));
    }
}
