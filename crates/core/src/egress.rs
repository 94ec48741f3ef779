//! The daemon's side of the `allowlist` tier: which entries and secrets a
//! run may have, the environment that points its programs at the proxy, and
//! starting that run's proxy on the listener the lane bound inside the
//! run's network namespace.
//!
//! What it does not own: the proxy itself, reached through the
//! [`EgressProxy`] trait (the daemon plugs in `runbox-proxy`; the core never
//! names its types), the namespace and the listener (the lane), or the
//! daemon-wide settings' parsing (the `serve` command builds the proxy).
//!
//! Fail-closed rules enforced here:
//! - `egressAllow` and `secrets` exist only on the `allowlist` tier; on
//!   `none` or `open` they are a 400, never silently ignored.
//! - A malformed entry or an undeclared secret is a 400.
//! - An `allowlist` run whose proxy cannot be started is destroyed, never
//!   left running without one (it would simply have no network, but the
//!   caller asked for egress and must learn it has none).

use std::sync::Arc;

use runbox_types::{EgressStats, Env, ErrorCode, NetworkTier};
use tokio_util::sync::CancellationToken;
use ulid::Ulid;

use crate::error::CoreError;

/// Most `egressAllow` entries one run may have.
pub const MAX_RUN_ENTRIES: usize = 256;

use crate::lane::{EGRESS_PROXY_URL as PROXY_URL, EXTRA_CA_PATH, TRUST_BUNDLE_PATH};

/// The node's egress proxy, as the core uses it: checking what a run asks
/// for, and serving one run's proxy on a listener inside its namespace.
pub trait EgressProxy: Send + Sync + std::fmt::Debug {
    /// The canonical form of one `egressAllow` entry, or why it is
    /// malformed (shown to the caller).
    fn canonical_entry(&self, raw: &str) -> Result<String, String>;

    /// The secret names the operator declared, sorted.
    fn secret_names(&self) -> Vec<String>;

    /// What a run sees in place of secret `name`'s value.
    fn placeholder(&self, name: &str) -> String;

    /// The interception CA in PEM, for the trust store of runs with secrets.
    fn ca_pem(&self) -> String;

    /// Serves run `id`'s proxy (entries and secrets as checked at creation)
    /// on `listener` until `stop` is cancelled, telling `on_close` the
    /// bytes of each connection with an allowed request when it closes.
    /// Needs a Tokio runtime.
    fn start(
        &self,
        id: Ulid,
        req: &RunEgressRequest,
        listener: std::net::TcpListener,
        stop: CancellationToken,
        on_close: Option<ConnectionBytes>,
    ) -> Result<Arc<dyn EgressMeter>, String>;
}

/// Takes the byte count (both ways) of one closed egress connection.
pub type ConnectionBytes = Arc<dyn Fn(u64) + Send + Sync>;

/// One run's proxy traffic so far.
pub trait EgressMeter: Send + Sync {
    /// A snapshot of the counters.
    fn stats(&self) -> EgressStats;

    /// Connections the proxy holds open for the run now (a request in
    /// flight keeps a run from counting as idle).
    fn active(&self) -> u64 {
        0
    }
}

/// A run's checked egress request: canonical entries and secret names.
/// Stored with the run, so a restarted daemon serves the same proxy.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RunEgressRequest {
    /// `egressAllow`, canonical and without duplicates, in the given order.
    #[serde(default)]
    pub allow: Vec<String>,
    /// Secret names, without duplicates.
    #[serde(default)]
    pub secrets: Vec<String>,
}

/// Checks a create request's `egressAllow` and `secrets` against its tier
/// and the declared secrets.
pub fn check_request(
    config: Option<&dyn EgressProxy>,
    network: NetworkTier,
    allow: Option<&[String]>,
    secrets: Option<&[String]>,
) -> Result<RunEgressRequest, CoreError> {
    if network != NetworkTier::Allowlist {
        if allow.is_some() {
            return Err(CoreError::invalid(
                ErrorCode::BadEgress,
                format!(
                    "egressAllow applies only to network \"allowlist\"; a {:?} run has no allowlist to extend",
                    network.as_str()
                ),
            ));
        }
        if secrets.is_some() {
            return Err(CoreError::invalid(
                ErrorCode::BadEgress,
                format!(
                    "secrets are injected by the allowlist proxy; a {:?} run has none, use network \"allowlist\"",
                    network.as_str()
                ),
            ));
        }
        return Ok(RunEgressRequest::default());
    }
    let Some(config) = config else {
        return Err(CoreError::invalid(
            ErrorCode::NetworkUnsupported,
            "this server has no egress proxy; use network \"none\"",
        ));
    };
    let allow = allow.unwrap_or_default();
    if allow.len() > MAX_RUN_ENTRIES {
        return Err(CoreError::invalid(
            ErrorCode::BadEgress,
            format!(
                "egressAllow has {} entries; at most {MAX_RUN_ENTRIES} are allowed",
                allow.len()
            ),
        ));
    }
    let mut entries: Vec<String> = Vec::with_capacity(allow.len());
    for raw in allow {
        let canonical = config
            .canonical_entry(raw)
            .map_err(|e| CoreError::invalid(ErrorCode::BadEgressEntry, e))?;
        if !entries.contains(&canonical) {
            entries.push(canonical);
        }
    }
    let mut names: Vec<String> = Vec::new();
    let declared = config.secret_names();
    for name in secrets.unwrap_or_default() {
        if !declared.contains(name) {
            return Err(CoreError::invalid(
                ErrorCode::UnknownSecret,
                format!(
                    "no secret named {:?} is declared on this server (declared: {})",
                    bounded(name),
                    if declared.is_empty() {
                        "none".to_owned()
                    } else {
                        declared.join(", ")
                    }
                ),
            ));
        }
        if !names.contains(name) {
            names.push(name.clone());
        }
    }
    Ok(RunEgressRequest {
        allow: entries,
        secrets: names,
    })
}

fn bounded(s: &str) -> String {
    s.chars().take(64).collect()
}

/// The environment every command of an `allowlist` run starts with: the
/// proxy variables (both spellings, as programs read either), a placeholder
/// per secret, and — when the run has secrets, so TLS to their hosts is
/// intercepted — the trust-store variables common runtimes read. Other
/// tiers have no proxy and get nothing.
pub fn run_env(
    proxy: Option<&dyn EgressProxy>,
    network: NetworkTier,
    req: &RunEgressRequest,
) -> Env {
    let Some(proxy) = proxy.filter(|_| network == NetworkTier::Allowlist) else {
        return Env::default();
    };
    let mut env = Vec::new();
    for name in ["HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"] {
        env.push((name.to_owned(), PROXY_URL.to_owned()));
    }
    for name in ["NO_PROXY", "no_proxy"] {
        env.push((name.to_owned(), "localhost,127.0.0.1".to_owned()));
    }
    for name in &req.secrets {
        env.push((name.clone(), proxy.placeholder(name)));
    }
    if !req.secrets.is_empty() {
        for name in [
            "SSL_CERT_FILE",
            "REQUESTS_CA_BUNDLE",
            "CURL_CA_BUNDLE",
            "GIT_SSL_CAINFO",
        ] {
            env.push((name.to_owned(), TRUST_BUNDLE_PATH.to_owned()));
        }
        env.push(("NODE_EXTRA_CA_CERTS".to_owned(), EXTRA_CA_PATH.to_owned()));
    }
    Env(env.into_iter().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    /// A proxy that only answers the questions (pure logic under test);
    /// the real one is tested in runbox-proxy and end to end.
    #[derive(Debug)]
    struct Checker;

    impl EgressProxy for Checker {
        fn canonical_entry(&self, raw: &str) -> Result<String, String> {
            if raw.contains(' ') {
                Err(format!("{raw:?} has a space"))
            } else {
                Ok(raw.to_ascii_lowercase())
            }
        }
        fn secret_names(&self) -> Vec<String> {
            strings(&["GH_TOKEN"])
        }
        fn placeholder(&self, name: &str) -> String {
            format!("placeholder:{name}")
        }
        fn ca_pem(&self) -> String {
            String::new()
        }
        fn start(
            &self,
            _: Ulid,
            _: &RunEgressRequest,
            _: std::net::TcpListener,
            _: CancellationToken,
            _: Option<ConnectionBytes>,
        ) -> Result<Arc<dyn EgressMeter>, String> {
            Err("not serving".into())
        }
    }

    #[test]
    fn entries_are_canonical_and_deduplicated_and_secrets_declared() {
        let req = check_request(
            Some(&Checker),
            NetworkTier::Allowlist,
            Some(&strings(&["Example.org", "example.org", "pypi.org"])),
            Some(&strings(&["GH_TOKEN", "GH_TOKEN"])),
        )
        .unwrap();
        assert_eq!(req.allow, strings(&["example.org", "pypi.org"]));
        assert_eq!(req.secrets, strings(&["GH_TOKEN"]));
        let err = check_request(
            Some(&Checker),
            NetworkTier::Allowlist,
            Some(&strings(&["a b"])),
            None,
        )
        .unwrap_err();
        assert_eq!(err.code(), ErrorCode::BadEgressEntry);
        let err = check_request(
            Some(&Checker),
            NetworkTier::Allowlist,
            None,
            Some(&strings(&["NOPE"])),
        )
        .unwrap_err();
        assert_eq!(err.code(), ErrorCode::UnknownSecret);
        assert!(err.to_string().contains("declared: GH_TOKEN"), "{err}");
        let many: Vec<String> = (0..=MAX_RUN_ENTRIES).map(|i| format!("h{i}.org")).collect();
        let err =
            check_request(Some(&Checker), NetworkTier::Allowlist, Some(&many), None).unwrap_err();
        assert_eq!(err.code(), ErrorCode::BadEgress);
    }

    #[test]
    fn egress_fields_belong_to_the_allowlist_tier() {
        for tier in [NetworkTier::None, NetworkTier::Open] {
            let err =
                check_request(None, tier, Some(&strings(&["example.org"])), None).unwrap_err();
            assert_eq!(err.code(), ErrorCode::BadEgress);
            // An empty list is still a list where none can apply.
            let err = check_request(None, tier, Some(&[]), None).unwrap_err();
            assert_eq!(err.code(), ErrorCode::BadEgress);
            let err = check_request(None, tier, None, Some(&strings(&["TOKEN"]))).unwrap_err();
            assert_eq!(err.code(), ErrorCode::BadEgress);
            let err = check_request(None, tier, None, Some(&[])).unwrap_err();
            assert_eq!(err.code(), ErrorCode::BadEgress);
            assert_eq!(
                check_request(None, tier, None, None).unwrap(),
                RunEgressRequest::default()
            );
        }
    }

    #[test]
    fn allowlist_without_a_proxy_is_refused() {
        let err = check_request(None, NetworkTier::Allowlist, None, None).unwrap_err();
        assert_eq!(err.code(), ErrorCode::NetworkUnsupported);
    }

    #[test]
    fn the_run_environment_points_at_the_proxy_and_holds_only_placeholders() {
        let env = run_env(
            Some(&Checker),
            NetworkTier::Allowlist,
            &RunEgressRequest {
                allow: vec![],
                secrets: strings(&["GH_TOKEN"]),
            },
        );
        let get = |k: &str| env.0.get(k).map(String::as_str);
        assert_eq!(get("HTTPS_PROXY"), Some(PROXY_URL));
        assert_eq!(get("no_proxy"), Some("localhost,127.0.0.1"));
        assert_eq!(get("GH_TOKEN"), Some("placeholder:GH_TOKEN"));
        assert_eq!(get("SSL_CERT_FILE"), Some(TRUST_BUNDLE_PATH));
        assert_eq!(get("NODE_EXTRA_CA_CERTS"), Some(EXTRA_CA_PATH));
        // No secrets: no CA variables (nothing is intercepted).
        let env = run_env(
            Some(&Checker),
            NetworkTier::Allowlist,
            &RunEgressRequest::default(),
        );
        assert!(!env.0.contains_key("SSL_CERT_FILE"));
        // Other tiers have no proxy to point at.
        let req = RunEgressRequest {
            allow: vec![],
            secrets: strings(&["GH_TOKEN"]),
        };
        assert_eq!(
            run_env(Some(&Checker), NetworkTier::Open, &req),
            Env::default()
        );
        assert_eq!(run_env(None, NetworkTier::Allowlist, &req), Env::default());
    }
}
