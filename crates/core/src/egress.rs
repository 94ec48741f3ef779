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
//! - A malformed entry or an undeclared secret is a 400, and so is a
//!   brought secret with a malformed policy or value (the message never
//!   holds the value).
//! - A brought secret's value is sealed (see `sealed`) before it reaches
//!   the run's record, and opened only to hand it to the run's proxy; one
//!   that does not open is left out, so the run's requests carry the
//!   placeholder, never anything else.
//! - An `allowlist` run whose proxy cannot be started is destroyed, never
//!   left running without one (it would simply have no network, but the
//!   caller asked for egress and must learn it has none).

use std::sync::Arc;

use runbox_types::{
    BroughtSecret, EgressEntry, EgressStats, Env, ErrorCode, NetworkTier, SecretRequest,
};
use tokio_util::sync::CancellationToken;
use ulid::Ulid;

use crate::error::CoreError;
use crate::sealed::Sealer;

/// Most `egressAllow` entries one run may have.
pub const MAX_RUN_ENTRIES: usize = 256;

/// Most `secrets` one run may ask for, declared and brought together.
pub const MAX_RUN_SECRETS: usize = 32;

/// The longest value a brought secret may have (it travels in a header).
pub const MAX_SECRET_VALUE: usize = 8 * 1024;

/// Most hosts, methods or path prefixes one brought secret may list.
pub const MAX_SECRET_LIST: usize = 64;

/// The longest path prefix of a brought secret.
pub const MAX_PATH_PREFIX: usize = 1024;

/// Names the run's environment already gives a meaning (the proxy and the
/// trust store); a secret under one would take that meaning away.
const RESERVED_NAMES: &[&str] = &[
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "ALL_PROXY",
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "GIT_SSL_CAINFO",
    "NODE_EXTRA_CA_CERTS",
    "PATH",
    "HOME",
];

use crate::lane::{
    EGRESS_PROXY_URL as PROXY_URL, EGRESS_SOCKS5_URL, EXTRA_CA_PATH, TRUST_BUNDLE_PATH,
};

/// The node's egress proxy, as the core uses it: checking what a run asks
/// for, and serving one run's proxy on a listener inside its namespace.
pub trait EgressProxy: Send + Sync + std::fmt::Debug {
    /// The canonical form of one `egressAllow` entry (a string stays a
    /// string, a rule a rule), or why it is malformed (shown to the
    /// caller).
    fn canonical_entry(&self, raw: &EgressEntry) -> Result<EgressEntry, String>;

    /// The secret names the operator declared, sorted.
    fn secret_names(&self) -> Vec<String>;

    /// Whether the built-in list of registries and forges is on.
    fn default_list(&self) -> bool {
        true
    }

    /// A brought secret checked (policy and value) and in canonical form,
    /// or why it is unusable (never naming the value).
    fn check_secret(&self, secret: &BroughtSecret) -> Result<BroughtSecret, String>;

    /// An upstream proxy URL a run asks for, checked (scheme, host, port,
    /// credentials) and admitted by the operator's list: its form without
    /// the password, for the API; or why not (never quoting the password).
    fn check_upstream(&self, url: &str) -> Result<String, String> {
        let _ = url;
        Err("this server takes no upstream proxies".to_owned())
    }

    /// The egress classes the operator defines, by name.
    fn class_names(&self) -> Vec<String> {
        Vec::new()
    }

    /// Whether the operator admits any upstream proxy for runs to name.
    fn takes_upstreams(&self) -> bool {
        false
    }

    /// What a run sees in place of secret `name`'s value.
    fn placeholder(&self, name: &str) -> String;

    /// The interception CA in PEM, for the trust store of runs with secrets.
    fn ca_pem(&self) -> String;

    /// Serves run `id`'s proxy (entries and secrets as checked at creation,
    /// `brought` and `upstream` opened) on `doors` until `stop` is
    /// cancelled, telling `on_close` the bytes of each connection with an
    /// allowed request when it closes. Needs a Tokio runtime.
    #[allow(clippy::too_many_arguments)]
    fn start(
        &self,
        id: Ulid,
        req: &RunEgressRequest,
        brought: Vec<BroughtSecret>,
        upstream: RunUpstream,
        doors: EgressListeners,
        stop: CancellationToken,
        on_close: Option<ConnectionBytes>,
    ) -> Result<Arc<dyn EgressHandle>, String>;
}

/// Where a run's egress leaves, as its proxy is told.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RunUpstream {
    /// The run names none: the server's default upstream, if any, else
    /// straight out.
    Default,
    /// Through this proxy (the URL, credentials included).
    Through(runbox_types::SecretValue),
    /// The run names one whose sealed URL cannot be opened: its egress is
    /// refused rather than sent another way.
    Unusable,
}

/// The listeners a run's proxy serves, bound in the run's namespace by its
/// lane (see [`crate::lane::EgressDoor`]).
#[derive(Debug)]
pub struct EgressListeners {
    /// The HTTP proxy.
    pub http: std::net::TcpListener,
    /// The SOCKS5 door, for a run that asked for one.
    pub socks5: Option<std::net::TcpListener>,
}

/// Takes the byte count (both ways) of one closed egress connection.
pub type ConnectionBytes = Arc<dyn Fn(u64) + Send + Sync>;

/// One run's proxy while it serves: its traffic so far, and its policy.
pub trait EgressHandle: Send + Sync {
    /// A snapshot of the counters.
    fn stats(&self) -> EgressStats;

    /// Connections the proxy holds open for the run now (a request in
    /// flight keeps a run from counting as idle).
    fn active(&self) -> u64 {
        0
    }

    /// Puts a new policy (entries and secrets as checked, `brought`
    /// opened) in force for the run's next connections and requests;
    /// connections already open keep going.
    fn update(&self, req: &RunEgressRequest, brought: Vec<BroughtSecret>, upstream: RunUpstream);

    /// Opens the SOCKS5 door on `listener`, or closes it (`None`): it stops
    /// accepting, and tunnels already open through it keep going.
    fn set_socks5(&self, listener: Option<std::net::TcpListener>) -> Result<(), String>;

    /// Whether the SOCKS5 door is open.
    fn socks5(&self) -> bool;

    /// Stops the proxy: its listener closes, and every connection through
    /// it with it.
    fn shutdown(&self);
}

/// A run's checked egress request: canonical entries, declared secret
/// names and brought secrets (sealed). Stored with the run, so a restarted
/// daemon serves the same proxy.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RunEgressRequest {
    /// `egressAllow`, canonical and without duplicates, in the given order.
    #[serde(default)]
    pub allow: Vec<EgressEntry>,
    /// Declared secret names, without duplicates.
    #[serde(default)]
    pub secrets: Vec<String>,
    /// Secrets the caller brought, their values sealed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub brought: Vec<SealedSecret>,
    /// The built-in list is left out (`egressDefaults: false`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_defaults: bool,
    /// The run has a SOCKS5 door (`egressSocks5: true`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub socks5: bool,
    /// The run's own upstream proxy: its URL without the password in the
    /// clear, the whole URL sealed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream: Option<SealedUpstream>,
    /// The egress class its tenant bound it to when it was made: what it
    /// reaches is what both the class (as the config defines it now) and
    /// its own policy admit. Kept on every tier, so a move to `allowlist`
    /// stays bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<String>,
}

/// A run's upstream proxy as its record keeps it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SealedUpstream {
    /// `scheme://[user@]host:port`, what the API shows.
    pub display: String,
    /// The whole URL, sealed (see [`Sealer`]) under [`UPSTREAM_SEAL_NAME`].
    pub sealed: String,
}

/// What the sealed upstream URL is bound to (a secret's name for the
/// others; no secret can be named so, as names are upper case).
const UPSTREAM_SEAL_NAME: &str = "egressUpstream";

impl RunEgressRequest {
    /// Whether the run has any secret, so TLS to some host is intercepted
    /// and the run must trust the interception CA.
    pub fn has_secrets(&self) -> bool {
        !self.secrets.is_empty() || !self.brought.is_empty()
    }

    /// Every secret name, declared first: what the API shows.
    pub fn secret_names(&self) -> Vec<String> {
        self.secrets
            .iter()
            .cloned()
            .chain(self.brought.iter().map(|b| b.name.clone()))
            .collect()
    }

    /// The run's upstream, opened for its proxy. One that does not open
    /// is [`RunUpstream::Unusable`] (with a warning): the run's egress is
    /// refused, never sent straight out.
    pub fn open_upstream(&self, id: Ulid, sealer: Option<&dyn Sealer>) -> RunUpstream {
        let Some(sealed) = &self.upstream else {
            return RunUpstream::Default;
        };
        let url = match sealer {
            Some(sealer) => sealer
                .open(UPSTREAM_SEAL_NAME, &sealed.sealed)
                .and_then(|bytes| {
                    String::from_utf8(bytes).map_err(|_| "the URL is not UTF-8".to_owned())
                }),
            None => Err("this server has no key to open it with".to_owned()),
        };
        match url {
            Ok(url) => RunUpstream::Through(runbox_types::SecretValue::new(url)),
            Err(why) => {
                tracing::warn!(run = %id, upstream = %sealed.display, error = %why, "the upstream proxy the run was created with cannot be opened; its egress is refused");
                RunUpstream::Unusable
            }
        }
    }

    /// The brought secrets with their values, for the run's proxy. One
    /// that does not open is left out with a warning: the run's requests
    /// then carry its placeholder, never a wrong value.
    pub fn open_brought(&self, id: Ulid, sealer: Option<&dyn Sealer>) -> Vec<BroughtSecret> {
        let mut opened = Vec::with_capacity(self.brought.len());
        for sealed in &self.brought {
            let value = match sealer {
                Some(sealer) => sealer.open(&sealed.name, &sealed.sealed).and_then(|bytes| {
                    String::from_utf8(bytes).map_err(|_| "the value is not UTF-8".to_owned())
                }),
                None => Err("this server has no key to open secrets with".to_owned()),
            };
            match value {
                Ok(value) => opened.push(sealed.with_value(value)),
                Err(why) => tracing::warn!(
                    run = %id,
                    secret = %sealed.name,
                    error = %why,
                    "a secret the run was created with cannot be opened; its requests go out with the placeholder"
                ),
            }
        }
        opened
    }
}

/// A brought secret as the run's record keeps it: the policy in the clear,
/// the value sealed under the node's key (bound to the name).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SealedSecret {
    /// The name (the run's placeholder variable).
    pub name: String,
    /// The header that carries it.
    pub header: String,
    /// Written before the value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheme: Option<String>,
    /// Canonical hosts.
    pub hosts: Vec<String>,
    /// Upper-case methods; empty: never sent.
    #[serde(default)]
    pub methods: Vec<String>,
    /// Path prefixes; empty: never sent.
    #[serde(default)]
    pub path_prefixes: Vec<String>,
    /// The value, sealed (see [`Sealer`]).
    pub sealed: String,
}

impl SealedSecret {
    /// The secret with `value` in place of the sealed one.
    fn with_value(&self, value: String) -> BroughtSecret {
        BroughtSecret {
            name: self.name.clone(),
            value: runbox_types::SecretValue::new(value),
            hosts: self.hosts.clone(),
            header: self.header.clone(),
            scheme: self.scheme.clone(),
            methods: Some(self.methods.clone()),
            path_prefixes: Some(self.path_prefixes.clone()),
        }
    }
}

/// What a create or a `PATCH .../egress` asks of a run's egress, as
/// given (a field left out is `None`).
#[derive(Clone, Copy, Debug, Default)]
pub struct EgressAsk<'a> {
    /// `egressAllow`.
    pub allow: Option<&'a [EgressEntry]>,
    /// `egressDefaults`.
    pub defaults: Option<bool>,
    /// `secrets`.
    pub secrets: Option<&'a [SecretRequest]>,
    /// `egressSocks5`.
    pub socks5: Option<bool>,
    /// `egressUpstream`.
    pub upstream: Option<&'a runbox_types::SecretValue>,
}

impl<'a> From<&'a runbox_types::UpdateEgressRequest> for EgressAsk<'a> {
    fn from(req: &'a runbox_types::UpdateEgressRequest) -> Self {
        EgressAsk {
            allow: req.egress_allow.as_deref(),
            defaults: req.egress_defaults,
            secrets: req.secrets.as_deref(),
            socks5: req.egress_socks5,
            upstream: req.egress_upstream.as_ref(),
        }
    }
}

/// Checks a create request's `egressAllow` and `secrets` against its tier
/// and the declared secrets, and seals the values of brought ones.
pub fn check_request(
    config: Option<&dyn EgressProxy>,
    sealer: Option<&dyn Sealer>,
    network: NetworkTier,
    ask: EgressAsk<'_>,
) -> Result<RunEgressRequest, CoreError> {
    let EgressAsk {
        allow,
        defaults,
        secrets,
        socks5,
        upstream,
    } = ask;
    if network != NetworkTier::Allowlist {
        if upstream.is_some_and(|u| !u.expose().is_empty()) {
            return Err(CoreError::invalid(
                ErrorCode::BadEgress,
                format!(
                    "egressUpstream is where the allowlist proxy sends a run's egress; a {:?} run \
                     has none, use network \"allowlist\"",
                    network.as_str()
                ),
            ));
        }
        if socks5 == Some(true) {
            return Err(CoreError::invalid(
                ErrorCode::BadEgress,
                format!(
                    "egressSocks5 is a door of the allowlist proxy; a {:?} run has none, use \
                     network \"allowlist\"",
                    network.as_str()
                ),
            ));
        }
        if allow.is_some() || defaults.is_some() {
            return Err(CoreError::invalid(
                ErrorCode::BadEgress,
                format!(
                    "egressAllow and egressDefaults apply only to network \"allowlist\"; a {:?} run has no allowlist",
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
    let mut entries: Vec<EgressEntry> = Vec::with_capacity(allow.len());
    for raw in allow {
        let canonical = config
            .canonical_entry(raw)
            .map_err(|e| CoreError::invalid(ErrorCode::BadEgressEntry, e))?;
        if !entries.contains(&canonical) {
            entries.push(canonical);
        }
    }
    let secrets = secrets.unwrap_or_default();
    if secrets.len() > MAX_RUN_SECRETS {
        return Err(CoreError::invalid(
            ErrorCode::BadEgress,
            format!(
                "secrets has {} entries; at most {MAX_RUN_SECRETS} are allowed",
                secrets.len()
            ),
        ));
    }
    let mut names: Vec<String> = Vec::new();
    let mut brought: Vec<SealedSecret> = Vec::new();
    let declared = config.secret_names();
    for request in secrets {
        match request {
            SecretRequest::Declared(name) => {
                if !declared.contains(name) {
                    return Err(CoreError::invalid(
                        ErrorCode::UnknownSecret,
                        format!(
                            "no secret named {:?} is declared on this server (declared: {}); \
                             to bring your own, give an object {{name, value, hosts, header, \
                             methods, pathPrefixes}} instead of a name",
                            bounded(name),
                            if declared.is_empty() {
                                "none".to_owned()
                            } else {
                                declared.join(", ")
                            }
                        ),
                    ));
                }
                if brought.iter().any(|b| &b.name == name) {
                    return Err(duplicate_secret(name));
                }
                if !names.contains(name) {
                    names.push(name.clone());
                }
            }
            SecretRequest::Brought(secret) => {
                let sealed = check_brought(config, sealer, secret, &declared)?;
                if names.contains(&sealed.name) || brought.iter().any(|b| b.name == sealed.name) {
                    return Err(duplicate_secret(&sealed.name));
                }
                brought.push(sealed);
            }
        }
    }
    // A rule's secret is one of the run's own.
    for entry in &entries {
        if let EgressEntry::Rule(runbox_types::EgressRule {
            secret: Some(name), ..
        }) = entry
        {
            if !names.contains(name) && !brought.iter().any(|b| &b.name == name) {
                return Err(CoreError::invalid(
                    ErrorCode::UnknownSecret,
                    format!(
                        "the egressAllow rule {entry} names secret {:?}, which the run does not \
                         have; add it to secrets (a declared name, or one you bring)",
                        bounded(name)
                    ),
                ));
            }
        }
    }
    Ok(RunEgressRequest {
        allow: entries,
        secrets: names,
        brought,
        no_defaults: defaults == Some(false),
        socks5: socks5 == Some(true),
        upstream: match upstream.filter(|u| !u.expose().is_empty()) {
            Some(url) => Some(seal_upstream(config, sealer, url)?),
            None => None,
        },
        // The tenant's, set by the caller.
        class: None,
    })
}

/// Checks an upstream URL against the node's proxy and seals it.
fn seal_upstream(
    config: &dyn EgressProxy,
    sealer: Option<&dyn Sealer>,
    url: &runbox_types::SecretValue,
) -> Result<SealedUpstream, CoreError> {
    let display = config.check_upstream(url.expose()).map_err(|why| {
        CoreError::invalid(ErrorCode::BadEgress, format!("egressUpstream: {why}"))
    })?;
    let Some(sealer) = sealer else {
        return Err(CoreError::invalid(
            ErrorCode::NetworkUnsupported,
            "this server has no key to keep an upstream proxy's credentials with",
        ));
    };
    let sealed = sealer
        .seal(UPSTREAM_SEAL_NAME, url.expose().as_bytes())
        .map_err(|e| CoreError::Store(format!("sealing egressUpstream: {e}")))?;
    Ok(SealedUpstream { display, sealed })
}

fn duplicate_secret(name: &str) -> CoreError {
    CoreError::invalid(
        ErrorCode::BadSecret,
        format!(
            "two secrets are named {:?}; a run's secrets need names of their own",
            bounded(name)
        ),
    )
}

/// Checks one brought secret and seals its value.
fn check_brought(
    config: &dyn EgressProxy,
    sealer: Option<&dyn Sealer>,
    secret: &BroughtSecret,
    declared: &[String],
) -> Result<SealedSecret, CoreError> {
    let name = bounded(&secret.name);
    let bad =
        |why: String| CoreError::invalid(ErrorCode::BadSecret, format!("secret {name:?}: {why}"));
    if declared.contains(&secret.name) {
        return Err(bad(
            "the operator declared a secret of that name; ask for it by name (a string), or give \
             yours another name"
                .to_owned(),
        ));
    }
    if RESERVED_NAMES.contains(&secret.name.as_str()) {
        return Err(bad(format!(
            "{} is set by runbox in every allowlist run; give the secret another name",
            secret.name
        )));
    }
    if secret.value.expose().len() > MAX_SECRET_VALUE {
        return Err(bad(format!(
            "the value is {} bytes long; at most {MAX_SECRET_VALUE} are allowed",
            secret.value.expose().len()
        )));
    }
    let lists = [
        ("hosts", secret.hosts.len()),
        ("methods", secret.methods.as_ref().map_or(0, Vec::len)),
        (
            "pathPrefixes",
            secret.path_prefixes.as_ref().map_or(0, Vec::len),
        ),
    ];
    for (field, len) in lists {
        if len > MAX_SECRET_LIST {
            return Err(bad(format!(
                "{field} has {len} entries; at most {MAX_SECRET_LIST} are allowed"
            )));
        }
    }
    if let Some(long) = secret
        .path_prefixes
        .iter()
        .flatten()
        .find(|p| p.len() > MAX_PATH_PREFIX)
    {
        return Err(bad(format!(
            "a path prefix is {} bytes long; at most {MAX_PATH_PREFIX} are allowed",
            long.len()
        )));
    }
    let canonical = config.check_secret(secret).map_err(bad)?;
    let Some(sealer) = sealer else {
        return Err(CoreError::invalid(
            ErrorCode::NetworkUnsupported,
            "this server cannot keep secrets a caller brings (it has no sealing key)",
        ));
    };
    let sealed = sealer
        .seal(&canonical.name, canonical.value.expose().as_bytes())
        .map_err(|e| CoreError::Store(format!("sealing a secret: {e}")))?;
    Ok(SealedSecret {
        name: canonical.name,
        header: canonical.header,
        scheme: canonical.scheme,
        hosts: canonical.hosts,
        methods: canonical.methods.unwrap_or_default(),
        path_prefixes: canonical.path_prefixes.unwrap_or_default(),
        sealed,
    })
}

fn bounded(s: &str) -> String {
    s.chars().take(64).collect()
}

/// The environment every command of an `allowlist` run starts with: the
/// proxy variables (both spellings, as programs read either; `ALL_PROXY`
/// names the SOCKS5 door when the run has one, which programs use where no
/// protocol's own variable applies), a placeholder per secret, and — when
/// the run has secrets, so TLS to their hosts is intercepted — the
/// trust-store variables common runtimes read. Other tiers have no proxy
/// and get nothing.
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
    if req.socks5 {
        for name in ["ALL_PROXY", "all_proxy"] {
            env.push((name.to_owned(), EGRESS_SOCKS5_URL.to_owned()));
        }
    }
    for name in ["NO_PROXY", "no_proxy"] {
        env.push((name.to_owned(), "localhost,127.0.0.1".to_owned()));
    }
    for name in req.secret_names() {
        let placeholder = proxy.placeholder(&name);
        env.push((name, placeholder));
    }
    if req.has_secrets() {
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

    /// The check with the request's fields one by one.
    fn check_request(
        config: Option<&dyn EgressProxy>,
        sealer: Option<&dyn Sealer>,
        network: NetworkTier,
        allow: Option<&[EgressEntry]>,
        defaults: Option<bool>,
        secrets: Option<&[SecretRequest]>,
    ) -> Result<RunEgressRequest, CoreError> {
        super::check_request(
            config,
            sealer,
            network,
            EgressAsk {
                allow,
                defaults,
                secrets,
                socks5: None,
                upstream: None,
            },
        )
    }

    fn check_request_socks5(on: bool) -> Result<RunEgressRequest, CoreError> {
        super::check_request(
            Some(&Checker),
            None,
            NetworkTier::Allowlist,
            EgressAsk {
                socks5: Some(on),
                ..Default::default()
            },
        )
    }

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    fn entries(v: &[&str]) -> Vec<EgressEntry> {
        v.iter().map(|s| EgressEntry::from(*s)).collect()
    }

    fn declared(v: &[&str]) -> Vec<SecretRequest> {
        v.iter().map(|s| SecretRequest::from(*s)).collect()
    }

    fn brought(name: &str, value: &str) -> SecretRequest {
        SecretRequest::Brought(BroughtSecret {
            name: name.into(),
            value: runbox_types::SecretValue::new(value),
            hosts: strings(&["API.example.com"]),
            header: "Authorization".into(),
            scheme: Some("Bearer".into()),
            methods: Some(strings(&["GET"])),
            path_prefixes: Some(strings(&["/v1/"])),
        })
    }

    #[test]
    fn brought_secrets_are_checked_sealed_and_opened_again() {
        let sealer = crate::sealed::KeyFileSealer::from_key(&[3; 32]);
        let check = |secrets: Vec<SecretRequest>| {
            check_request(
                Some(&Checker),
                Some(&sealer),
                NetworkTier::Allowlist,
                None,
                None,
                Some(&secrets),
            )
        };
        let id = Ulid::new();
        let req = check(vec!["GH_TOKEN".into(), brought("API_KEY", "v4lue-1")]).unwrap();
        assert_eq!(req.secrets, strings(&["GH_TOKEN"]));
        assert_eq!(req.secret_names(), strings(&["GH_TOKEN", "API_KEY"]));
        assert_eq!(req.brought[0].hosts, strings(&["api.example.com"]));
        // The record never holds the value; opening gives it back.
        let record = serde_json::to_string(&req).unwrap();
        assert!(!record.contains("v4lue-1"), "{record}");
        let opened = req.open_brought(id, Some(&sealer));
        assert_eq!(opened[0].value.expose(), "v4lue-1");
        assert_eq!(opened[0].methods.as_deref(), Some(&strings(&["GET"])[..]));
        // Under another key (or none) it is left out, never guessed.
        let other = crate::sealed::KeyFileSealer::from_key(&[4; 32]);
        assert!(req.open_brought(id, Some(&other)).is_empty());
        assert!(req.open_brought(id, None).is_empty());
        assert!(req.has_secrets());

        let code = |secrets| check(secrets).unwrap_err().code();
        // Names are the run's own: no duplicates, no declared name, no
        // variable runbox sets itself.
        assert_eq!(
            code(vec![brought("A", "1"), brought("A", "2")]),
            ErrorCode::BadSecret
        );
        assert_eq!(code(vec![brought("GH_TOKEN", "1")]), ErrorCode::BadSecret);
        assert_eq!(
            code(vec![brought("HTTPS_PROXY", "1")]),
            ErrorCode::BadSecret
        );
        assert_eq!(
            code(vec![brought("A", &"x".repeat(MAX_SECRET_VALUE + 1))]),
            ErrorCode::BadSecret
        );
        let SecretRequest::Brought(mut headless) = brought("A", "v4lue-2") else {
            unreachable!()
        };
        headless.header.clear();
        let err = check(vec![SecretRequest::Brought(headless)]).unwrap_err();
        assert_eq!(err.code(), ErrorCode::BadSecret);
        assert!(err.to_string().contains("secret \"A\": no header"), "{err}");
        assert!(!err.to_string().contains("v4lue-2"));
        let many: Vec<SecretRequest> = (0..=MAX_RUN_SECRETS)
            .map(|i| brought(&format!("S{i}"), "v"))
            .collect();
        assert_eq!(code(many), ErrorCode::BadEgress);
        // Without a key nothing brought is taken.
        let err = check_request(
            Some(&Checker),
            None,
            NetworkTier::Allowlist,
            None,
            None,
            Some(&[brought("A", "v")]),
        )
        .unwrap_err();
        assert_eq!(err.code(), ErrorCode::NetworkUnsupported);
    }

    /// A proxy that only answers the questions (pure logic under test);
    /// the real one is tested in runbox-proxy and end to end.
    #[derive(Debug)]
    struct Checker;

    impl EgressProxy for Checker {
        fn canonical_entry(&self, raw: &EgressEntry) -> Result<EgressEntry, String> {
            match raw {
                EgressEntry::Text(raw) if raw.contains(' ') => Err(format!("{raw:?} has a space")),
                EgressEntry::Text(raw) => Ok(raw.to_ascii_lowercase().into()),
                rule => Ok(rule.clone()),
            }
        }
        fn secret_names(&self) -> Vec<String> {
            strings(&["GH_TOKEN"])
        }
        fn check_secret(&self, secret: &BroughtSecret) -> Result<BroughtSecret, String> {
            if secret.header.is_empty() {
                return Err("no header".into());
            }
            let mut canonical = secret.clone();
            canonical.hosts = secret
                .hosts
                .iter()
                .map(|h| h.to_ascii_lowercase())
                .collect();
            Ok(canonical)
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
            _: Vec<BroughtSecret>,
            _: RunUpstream,
            _: EgressListeners,
            _: CancellationToken,
            _: Option<ConnectionBytes>,
        ) -> Result<Arc<dyn EgressHandle>, String> {
            Err("not serving".into())
        }
    }

    #[test]
    fn entries_are_canonical_and_deduplicated_and_secrets_declared() {
        let req = check_request(
            Some(&Checker),
            None,
            NetworkTier::Allowlist,
            Some(&entries(&["Example.org", "example.org", "pypi.org"])),
            None,
            Some(&declared(&["GH_TOKEN", "GH_TOKEN"])),
        )
        .unwrap();
        assert_eq!(req.allow, entries(&["example.org", "pypi.org"]));
        assert_eq!(req.secrets, strings(&["GH_TOKEN"]));
        let err = check_request(
            Some(&Checker),
            None,
            NetworkTier::Allowlist,
            Some(&entries(&["a b"])),
            None,
            None,
        )
        .unwrap_err();
        assert_eq!(err.code(), ErrorCode::BadEgressEntry);
        let err = check_request(
            Some(&Checker),
            None,
            NetworkTier::Allowlist,
            None,
            None,
            Some(&declared(&["NOPE"])),
        )
        .unwrap_err();
        assert_eq!(err.code(), ErrorCode::UnknownSecret);
        assert!(err.to_string().contains("declared: GH_TOKEN"), "{err}");
        let many: Vec<EgressEntry> = (0..=MAX_RUN_ENTRIES)
            .map(|i| format!("h{i}.org").into())
            .collect();
        let err = check_request(
            Some(&Checker),
            None,
            NetworkTier::Allowlist,
            Some(&many),
            None,
            None,
        )
        .unwrap_err();
        assert_eq!(err.code(), ErrorCode::BadEgress);
    }

    #[test]
    fn egress_fields_belong_to_the_allowlist_tier() {
        for tier in [NetworkTier::None, NetworkTier::Open] {
            let err = check_request(
                None,
                None,
                tier,
                Some(&entries(&["example.org"])),
                None,
                None,
            )
            .unwrap_err();
            assert_eq!(err.code(), ErrorCode::BadEgress);
            // An empty list is still a list where none can apply.
            let err = check_request(None, None, tier, Some(&[]), None, None).unwrap_err();
            assert_eq!(err.code(), ErrorCode::BadEgress);
            let err = check_request(None, None, tier, None, None, Some(&declared(&["TOKEN"])))
                .unwrap_err();
            assert_eq!(err.code(), ErrorCode::BadEgress);
            let err = check_request(None, None, tier, None, None, Some(&[])).unwrap_err();
            assert_eq!(err.code(), ErrorCode::BadEgress);
            let socks5 = |on| EgressAsk {
                socks5: Some(on),
                ..Default::default()
            };
            let err = super::check_request(None, None, tier, socks5(true)).unwrap_err();
            assert_eq!(err.code(), ErrorCode::BadEgress);
            assert!(err.to_string().contains("egressSocks5"), "{err}");
            // Asking for no door is no request at all.
            assert_eq!(
                super::check_request(None, None, tier, socks5(false)).unwrap(),
                RunEgressRequest::default()
            );
            assert_eq!(
                check_request(None, None, tier, None, None, None).unwrap(),
                RunEgressRequest::default()
            );
        }
    }

    #[test]
    fn allowlist_without_a_proxy_is_refused() {
        let err = check_request(None, None, NetworkTier::Allowlist, None, None, None).unwrap_err();
        assert_eq!(err.code(), ErrorCode::NetworkUnsupported);
    }

    #[test]
    fn the_run_environment_points_at_the_proxy_and_holds_only_placeholders() {
        let env = run_env(
            Some(&Checker),
            NetworkTier::Allowlist,
            &RunEgressRequest {
                secrets: strings(&["GH_TOKEN"]),
                ..Default::default()
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
        // No SOCKS5 door, no ALL_PROXY; with one, both spellings name it.
        assert!(!env.0.contains_key("ALL_PROXY"));
        let env = run_env(
            Some(&Checker),
            NetworkTier::Allowlist,
            &RunEgressRequest {
                socks5: true,
                ..Default::default()
            },
        );
        assert_eq!(
            env.0.get("ALL_PROXY").map(String::as_str),
            Some(EGRESS_SOCKS5_URL)
        );
        assert_eq!(
            env.0.get("all_proxy").map(String::as_str),
            Some("socks5h://127.0.0.1:1080")
        );
        assert_eq!(
            env.0.get("HTTPS_PROXY").map(String::as_str),
            Some(PROXY_URL)
        );
        let req = check_request_socks5(true).unwrap();
        assert!(req.socks5);
        // Other tiers have no proxy to point at.
        let req = RunEgressRequest {
            secrets: strings(&["GH_TOKEN"]),
            ..Default::default()
        };
        assert_eq!(
            run_env(Some(&Checker), NetworkTier::Open, &req),
            Env::default()
        );
        assert_eq!(run_env(None, NetworkTier::Allowlist, &req), Env::default());
    }
}
