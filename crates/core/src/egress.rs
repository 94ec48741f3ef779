//! The daemon's side of the `allowlist` tier: which entries and secrets a
//! run may have, the environment that points its programs at the proxy, and
//! starting that run's proxy on the listener the backend bound inside the
//! run's network namespace.
//!
//! What it does not own: the proxy itself (`runbox-proxy`), the namespace and
//! the listener (the backend), or the daemon-wide settings' parsing (the
//! `serve` command builds an [`EgressConfig`]).
//!
//! Fail-closed rules enforced here:
//! - `egressAllow` and `secrets` exist only on the `allowlist` tier; on
//!   `none` or `open` they are a 400, never silently ignored.
//! - A malformed entry or an undeclared secret is a 400.
//! - An `allowlist` run whose proxy cannot be started is destroyed, never
//!   left running without one (it would simply have no network, but the
//!   caller asked for egress and must learn it has none).

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use runbox_proxy::policy::{Allowlist, Entry};
use runbox_proxy::proxy::{Counters, RunEgress, Shared};
use runbox_proxy::secrets::{placeholder, Secret};
use runbox_types::{EgressStats, Env, ErrorCode, NetworkTier};
use tokio_util::sync::CancellationToken;
use ulid::Ulid;

use crate::error::CoreError;

/// Most `egressAllow` entries one run may have.
pub const MAX_RUN_ENTRIES: usize = 256;

use crate::backend::{EGRESS_PROXY_URL as PROXY_URL, EXTRA_CA_PATH, TRUST_BUNDLE_PATH};

/// Daemon-wide egress settings.
pub struct EgressConfig {
    /// Whether the built-in list of registries and forges applies.
    pub default_list: bool,
    /// The deployment-wide entries.
    pub deployment: Vec<Entry>,
    /// Declared secrets, by name, with their values loaded.
    pub secrets: BTreeMap<String, Arc<Secret>>,
    /// What every run's proxy shares: resolver, guard, CA, audit log.
    pub shared: Arc<Shared>,
}

impl fmt::Debug for EgressConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EgressConfig")
            .field("default_list", &self.default_list)
            .field("deployment", &self.deployment)
            .field("secrets", &self.secrets.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
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
    config: Option<&EgressConfig>,
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
        let entry = Entry::from_str(raw)
            .map_err(|e| CoreError::invalid(ErrorCode::BadEgressEntry, e.to_string()))?;
        let canonical = entry.to_string();
        if !entries.contains(&canonical) {
            entries.push(canonical);
        }
    }
    let mut names: Vec<String> = Vec::new();
    for name in secrets.unwrap_or_default() {
        if !config.secrets.contains_key(name) {
            let declared: Vec<&str> = config.secrets.keys().map(String::as_str).collect();
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

impl EgressConfig {
    /// The interception CA in PEM, for the run's trust store.
    pub fn ca_pem(&self) -> String {
        self.shared.authority.ca_pem().to_owned()
    }

    /// The proxy settings of one run. Entries were checked at creation;
    /// one that no longer parses (a record from another version) is
    /// dropped with a warning, which narrows the run's access, never widens it.
    fn run_egress(&self, id: Ulid, req: &RunEgressRequest, counters: Arc<Counters>) -> RunEgress {
        let entries: Vec<Entry> = req
            .allow
            .iter()
            .filter_map(|raw| match Entry::from_str(raw) {
                Ok(e) => Some(e),
                Err(e) => {
                    tracing::warn!(run = %id, error = %e, "dropping a stored egress entry that no longer parses");
                    None
                }
            })
            .collect();
        let secrets = req
            .secrets
            .iter()
            .filter_map(|name| self.secrets.get(name).cloned())
            .collect();
        RunEgress {
            run: id.to_string(),
            allowlist: Allowlist::new(self.default_list, &self.deployment, &entries),
            secrets,
            counters,
        }
    }

    /// Starts serving run `id`'s proxy on `listener` until `stop` is
    /// cancelled. Returns the run's counters.
    pub fn start(
        &self,
        id: Ulid,
        req: &RunEgressRequest,
        listener: std::net::TcpListener,
        stop: CancellationToken,
    ) -> Result<Arc<Counters>, CoreError> {
        listener
            .set_nonblocking(true)
            .map_err(CoreError::io("preparing the egress listener"))?;
        let listener = tokio::net::TcpListener::from_std(listener)
            .map_err(CoreError::io("registering the egress listener"))?;
        let counters = Arc::new(Counters::default());
        let run = Arc::new(self.run_egress(id, req, counters.clone()));
        tokio::spawn(runbox_proxy::proxy::serve(
            listener,
            self.shared.clone(),
            run,
            stop,
        ));
        Ok(counters)
    }
}

/// The environment every command of an `allowlist` run starts with: the
/// proxy variables (both spellings, as programs read either), a placeholder
/// per secret, and — when the run has secrets, so TLS to their hosts is
/// intercepted — the trust-store variables common runtimes read. Other
/// tiers have no proxy and get nothing.
pub fn run_env(network: NetworkTier, req: &RunEgressRequest) -> Env {
    if network != NetworkTier::Allowlist {
        return Env::default();
    }
    let mut env = Vec::new();
    for name in ["HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"] {
        env.push((name.to_owned(), PROXY_URL.to_owned()));
    }
    for name in ["NO_PROXY", "no_proxy"] {
        env.push((name.to_owned(), "localhost,127.0.0.1".to_owned()));
    }
    for name in &req.secrets {
        env.push((name.clone(), placeholder(name)));
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

/// A snapshot of a run's counters.
pub fn stats(counters: &Counters) -> EgressStats {
    EgressStats {
        bytes_up: counters.bytes_up.load(Ordering::Relaxed),
        bytes_down: counters.bytes_down.load(Ordering::Relaxed),
        requests: counters.requests.load(Ordering::Relaxed),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
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
            NetworkTier::Allowlist,
            &RunEgressRequest {
                allow: vec![],
                secrets: strings(&["GH_TOKEN"]),
            },
        );
        let get = |k: &str| env.0.get(k).map(String::as_str);
        assert_eq!(get("HTTPS_PROXY"), Some(PROXY_URL));
        assert_eq!(get("no_proxy"), Some("localhost,127.0.0.1"));
        assert_eq!(get("GH_TOKEN"), Some("runbox-secret:GH_TOKEN"));
        assert_eq!(get("SSL_CERT_FILE"), Some(TRUST_BUNDLE_PATH));
        assert_eq!(get("NODE_EXTRA_CA_CERTS"), Some(EXTRA_CA_PATH));
        // No secrets: no CA variables (nothing is intercepted).
        let env = run_env(NetworkTier::Allowlist, &RunEgressRequest::default());
        assert!(!env.0.contains_key("SSL_CERT_FILE"));
        // Other tiers have no proxy to point at.
        let req = RunEgressRequest {
            allow: vec![],
            secrets: strings(&["GH_TOKEN"]),
        };
        assert_eq!(run_env(NetworkTier::Open, &req), Env::default());
    }
}
