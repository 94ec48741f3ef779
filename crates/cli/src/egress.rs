//! `runbox serve`'s egress settings: flags, the optional JSON config file,
//! and building the proxy's shared services from them.
//!
//! Every setting is checked before the daemon serves: a malformed allowlist
//! entry, exception, secret declaration or missing secret value stops the
//! start with a message naming it — a daemon never serves a policy other
//! than the configured one.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

use anyhow::{bail, Context};
use runbox_core::egress::{EgressHandle, EgressProxy, RunEgressRequest, RunUpstream};
use runbox_proxy::audit::AuditLog;
use runbox_proxy::guard::{AddressGuard, InternalAllow};
use runbox_proxy::policy::{self, Allowlist, Entry};
use runbox_proxy::proxy::{Counters, EgressClass, RunEgress, RunPolicy, Shared};
use runbox_proxy::resolve::Resolver;
use runbox_proxy::rules::{Rule, RuleSpec};
use runbox_proxy::secrets::{Secret, SecretPolicy, SecretSpec};
use runbox_proxy::tls::{upstream_client_config, Authority};
use runbox_proxy::upstream::{Upstream, UpstreamAllow};
use runbox_types::{BroughtSecret, EgressEntry};

/// Egress flags of `runbox serve`.
#[derive(Debug, Default, clap::Args)]
pub struct EgressArgs {
    /// Allowlist entries for every `allowlist` run, on top of the built-in
    /// list: `host` (ports 80, 443), `.suffix` (a domain and its
    /// subdomains), `host:port`; comma- or space-separated, repeatable
    #[arg(
        long = "egress-allow",
        env = "RUNBOX_EGRESS_ALLOW",
        value_name = "ENTRIES"
    )]
    pub egress_allow: Vec<String>,
    /// Do not apply the built-in list of package registries and source forges
    #[arg(long, env = "RUNBOX_NO_DEFAULT_EGRESS")]
    pub no_default_egress: bool,
    /// An internal destination the proxy may reach after all: `CIDR` or
    /// `CIDR:PORT,PORT` (IPv6 as `[CIDR]:PORTS`); repeatable. Loopback,
    /// private, link-local (cloud metadata), CGNAT, multicast and the host's
    /// own addresses are refused otherwise
    #[arg(long = "egress-internal-allow", value_name = "CIDR[:PORTS]")]
    pub egress_internal_allow: Vec<String>,
    /// An egress class tenants can be bound to, as JSON {"name", "allow":
    /// [entries and rules], "upstream"?: URL}; repeatable (an
    /// `[[egress_class]]` table each in the config file). A bound run reaches
    /// what both the class and its own policy admit. A reload changes them
    /// for live runs at their next request
    #[arg(long = "egress-class", value_name = "JSON", value_parser = parse_class)]
    pub egress_classes: Vec<ClassSpec>,
    /// JSON file with `allow`, `defaultAllow`, `internalAllow` and `secrets`
    /// (secret declarations live only here)
    #[arg(long, env = "RUNBOX_EGRESS_CONFIG", value_name = "FILE")]
    pub egress_config: Option<PathBuf>,
    /// DNS server the proxy asks (default: the host's /etc/resolv.conf)
    #[arg(long, env = "RUNBOX_EGRESS_DNS", value_name = "ADDR:PORT")]
    pub egress_dns: Option<SocketAddr>,
    /// Extra CA certificates (PEM) that upstream servers are verified against
    /// when TLS is intercepted, besides the system roots
    #[arg(long, env = "RUNBOX_EGRESS_CA_BUNDLE", value_name = "FILE")]
    pub egress_ca_bundle: Option<PathBuf>,
    /// An upstream proxy runs may name (`egressUpstream`), in the allowlist
    /// grammar but any port where none is written: `host`, `host:port`,
    /// `.suffix`, `*.suffix` or `prefix/len`; repeatable. None: runs name
    /// none
    #[arg(long = "egress-upstream-allow", value_name = "ENTRY")]
    pub egress_upstream_allow: Vec<String>,
    /// The upstream proxy every allowlist run's egress leaves through unless
    /// the run names its own: `http://` or `socks5://`
    /// `[user:password@]host:port` (prefer the environment variable, which
    /// keeps credentials off the command line)
    #[arg(
        long,
        env = "RUNBOX_EGRESS_UPSTREAM",
        value_name = "URL",
        hide_env_values = true
    )]
    pub egress_upstream: Option<String>,
    /// Rotate audit.jsonl (to audit.jsonl.1) when it reaches this size
    #[arg(long, default_value_t = 64, value_name = "MIB")]
    pub audit_max_mb: u64,
}

/// The egress config file. Unknown keys are an error: a misspelt key must
/// not silently leave a policy out.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct FileConfig {
    #[serde(default)]
    allow: Vec<String>,
    #[serde(default)]
    default_allow: Option<bool>,
    #[serde(default, alias = "egress_internal_allow")]
    internal_allow: Vec<String>,
    #[serde(default)]
    secrets: Vec<SecretSpec>,
    #[serde(default)]
    upstream: UpstreamConfig,
}

/// One `--egress-class` (or `[[egress_class]]`), checked.
#[derive(Clone, Debug)]
pub struct ClassSpec(Arc<EgressClass>);

impl ClassSpec {
    /// Its name.
    pub fn name(&self) -> &str {
        &self.0.name
    }
}

/// Parses and checks an egress class: a name like a tenant's, rules in the
/// allowlist grammar, an upstream URL.
fn parse_class(raw: &str) -> Result<ClassSpec, String> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Wire {
        name: String,
        #[serde(default)]
        allow: Vec<EgressEntry>,
        #[serde(default)]
        upstream: Option<String>,
    }
    let wire: Wire = serde_json::from_str(raw).map_err(|e| {
        format!("an egress class is {{\"name\", \"allow\": [...], \"upstream\"?}}: {e}")
    })?;
    runbox_core::tenants::check_name(&wire.name).map_err(|_| {
        format!(
            "egress class name {:?} must be 1-32 of a-z, 0-9, '-' and '_', starting with a letter",
            wire.name.chars().take(64).collect::<String>()
        )
    })?;
    let mut rules = Vec::with_capacity(wire.allow.len());
    for raw in &wire.allow {
        let rule = parse_rule(raw).map_err(|e| format!("egress class {:?}: {e}", wire.name))?;
        if rule.secret.is_some() {
            return Err(format!(
                "egress class {:?}: rule {raw} names a secret; a class says what may be reached, \
                 its runs bring their own secrets",
                wire.name
            ));
        }
        rules.push(rule);
    }
    let upstream = match wire.upstream {
        Some(url) => Some(Arc::new(
            Upstream::parse(&url).map_err(|e| format!("egress class {:?}: {e}", wire.name))?,
        )),
        None => None,
    };
    Ok(ClassSpec(Arc::new(EgressClass {
        allowlist: Allowlist::new(false, &[], &rules),
        name: wire.name,
        upstream,
    })))
}

/// The classes by name; a name given twice is an error.
fn classes_by_name(specs: &[ClassSpec]) -> anyhow::Result<BTreeMap<String, Arc<EgressClass>>> {
    let mut classes = BTreeMap::new();
    for spec in specs {
        if classes
            .insert(spec.name().to_owned(), spec.0.clone())
            .is_some()
        {
            bail!("two egress classes are named {:?}", spec.name());
        }
    }
    Ok(classes)
}

impl NodeProxy {
    /// Puts `specs` in force as the node's egress classes (a config
    /// reload): every bound run reads them at its next request. A run whose
    /// class is gone reaches nothing (each refusal is logged).
    pub fn set_classes(&self, specs: &[ClassSpec]) -> anyhow::Result<()> {
        let classes = classes_by_name(specs)?;
        let names: Vec<&String> = classes.keys().collect();
        tracing::info!(classes = ?names, "egress classes in force");
        self.shared.classes.store(Arc::new(classes));
        Ok(())
    }
}

/// The config file's `upstream`.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct UpstreamConfig {
    /// Upstreams runs may name.
    #[serde(default)]
    allow: Vec<String>,
    /// The node's default upstream.
    #[serde(default)]
    default: Option<String>,
}

/// The node's egress proxy, plugged into the run manager: runbox-proxy's
/// policy, secrets and server behind the core's [`EgressProxy`] trait.
pub struct NodeProxy {
    /// The node's part of every run's policy.
    node: Arc<NodePolicy>,
    /// What every run's proxy shares: resolver, guard, CA, audit log.
    shared: Arc<Shared>,
}

/// The node's part of every run's policy.
struct NodePolicy {
    /// Whether the built-in list of registries and forges applies.
    default_list: bool,
    /// The deployment-wide entries.
    deployment: Vec<Entry>,
    /// Declared secrets, by name, with their values loaded.
    secrets: BTreeMap<String, Arc<Secret>>,
    /// The upstream proxies runs may name.
    upstream_allow: UpstreamAllow,
    /// Where runs that name none send their egress, if anywhere.
    upstream_default: Option<Arc<Upstream>>,
}

impl std::fmt::Debug for NodeProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the secrets' values.
        f.debug_struct("NodeProxy")
            .field("default_list", &self.node.default_list)
            .field("deployment", &self.node.deployment)
            .field("secrets", &self.node.secrets.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl NodePolicy {
    /// Run `id`'s policy: its entries and secrets over the node's.
    /// Entries were checked at creation; one that no longer parses (a
    /// record from another version) is dropped with a warning, which
    /// narrows the run's access, never widens it.
    fn for_run(
        &self,
        id: ulid::Ulid,
        req: &RunEgressRequest,
        brought: &[BroughtSecret],
        upstream: &RunUpstream,
    ) -> RunPolicy {
        let upstream_of = upstream;
        let upstream = match upstream {
            RunUpstream::Default => self.upstream_default.clone(),
            RunUpstream::Through(url) => match Upstream::parse(url.expose()) {
                Ok(upstream) => Some(Arc::new(upstream)),
                Err(e) => {
                    tracing::warn!(run = %id, error = %e, "the run's upstream proxy no longer parses; its egress is refused");
                    return RunPolicy::default();
                }
            },
            // Refused, never sent another way.
            RunUpstream::Unusable => return RunPolicy::default(),
        };
        let upstream_is_own = matches!(upstream_of, RunUpstream::Through(_));
        let entries: Vec<Rule> = req
            .allow
            .iter()
            .filter_map(|raw| match parse_rule(raw) {
                Ok(rule) => Some(rule),
                Err(e) => {
                    tracing::warn!(run = %id, error = %e, "dropping a stored egress entry that no longer parses");
                    None
                }
            })
            .collect();
        let mut secrets: Vec<Arc<Secret>> = req
            .secrets
            .iter()
            .filter_map(|name| self.secrets.get(name).cloned())
            .collect();
        // A brought secret's hosts are reachable for the run: the least
        // egress that makes it usable.
        let mut secret_hosts: Vec<Entry> = Vec::new();
        for secret in brought {
            match Secret::new(brought_policy(secret), secret.value.expose(), "the value") {
                Ok(loaded) => {
                    for host in &secret.hosts {
                        if let Ok(entry) = Entry::from_str(host) {
                            if !secret_hosts.contains(&entry) {
                                secret_hosts.push(entry);
                            }
                        }
                    }
                    secrets.push(Arc::new(loaded));
                }
                Err(e) => {
                    tracing::warn!(run = %id, error = %e, "dropping a stored secret that no longer checks out")
                }
            }
        }
        RunPolicy {
            allowlist: Allowlist::new(
                self.default_list && !req.no_defaults,
                &self.deployment,
                &entries,
            )
            .with_secret_hosts(&secret_hosts),
            secrets,
            upstream,
            upstream_is_own,
            class: req.class.clone(),
        }
    }
}

/// A run's proxy, as the run manager holds it.
struct RunProxy {
    /// The run's id.
    id: ulid::Ulid,
    /// The run's settings, shared with its proxy task.
    run: Arc<RunEgress>,
    /// The node's part of its policy.
    node: Arc<NodePolicy>,
    /// What its doors share.
    shared: Arc<Shared>,
    /// Stops its proxy task.
    stop: tokio_util::sync::CancellationToken,
    /// Closes its SOCKS5 door, while one is open.
    socks5: std::sync::Mutex<Option<tokio_util::sync::CancellationToken>>,
}

impl RunProxy {
    /// Serves the SOCKS5 door on `listener` until it is closed or the
    /// proxy stops.
    fn open_socks5(&self, listener: tokio::net::TcpListener) {
        let close = self.stop.child_token();
        tokio::spawn(runbox_proxy::proxy::serve_socks5(
            listener,
            self.shared.clone(),
            self.run.clone(),
            self.stop.clone(),
            close.clone(),
        ));
        let before = self
            .socks5
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .replace(close);
        if let Some(before) = before {
            before.cancel();
        }
    }
}

/// A listener the daemon's runtime drives.
fn tokio_listener(listener: std::net::TcpListener) -> Result<tokio::net::TcpListener, String> {
    listener
        .set_nonblocking(true)
        .map_err(|e| format!("preparing the egress listener: {e}"))?;
    tokio::net::TcpListener::from_std(listener)
        .map_err(|e| format!("registering the egress listener: {e}"))
}

impl EgressHandle for RunProxy {
    fn stats(&self) -> runbox_types::EgressStats {
        use std::sync::atomic::Ordering::Relaxed;
        let counters = &self.run.counters;
        runbox_types::EgressStats {
            bytes_up: counters.bytes_up.load(Relaxed),
            bytes_down: counters.bytes_down.load(Relaxed),
            requests: counters.requests.load(Relaxed),
        }
    }

    fn active(&self) -> u64 {
        self.run
            .counters
            .open
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    fn update(&self, req: &RunEgressRequest, brought: Vec<BroughtSecret>, upstream: RunUpstream) {
        self.run
            .set_policy(self.node.for_run(self.id, req, &brought, &upstream));
    }

    fn set_socks5(&self, listener: Option<std::net::TcpListener>) -> Result<(), String> {
        match listener {
            Some(listener) => {
                self.open_socks5(tokio_listener(listener)?);
                Ok(())
            }
            None => {
                let open = self.socks5.lock().unwrap_or_else(|p| p.into_inner()).take();
                if let Some(close) = open {
                    close.cancel();
                }
                Ok(())
            }
        }
    }

    fn socks5(&self) -> bool {
        self.socks5
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    fn shutdown(&self) {
        self.stop.cancel();
    }
}

impl EgressProxy for NodeProxy {
    fn canonical_entry(&self, raw: &EgressEntry) -> Result<EgressEntry, String> {
        match raw {
            EgressEntry::Text(text) => Entry::from_str(text)
                .map(|e| EgressEntry::Text(e.to_string()))
                .map_err(|e| e.to_string()),
            EgressEntry::Rule(_) => {
                let rule = parse_rule(raw)?;
                let spec = rule.to_spec();
                serde_json::to_value(&spec)
                    .and_then(serde_json::from_value)
                    .map(EgressEntry::Rule)
                    .map_err(|e| format!("egress rule {raw}: {e}"))
            }
        }
    }

    fn secret_names(&self) -> Vec<String> {
        self.node.secrets.keys().cloned().collect()
    }

    fn default_list(&self) -> bool {
        self.node.default_list
    }

    fn check_secret(&self, secret: &BroughtSecret) -> Result<BroughtSecret, String> {
        let policy = brought_policy(secret).canonical()?;
        // The value is checked as the proxy will send it.
        Secret::new(policy.clone(), secret.value.expose(), "the value").map_err(|e| e.reason)?;
        Ok(BroughtSecret {
            name: policy.name,
            value: secret.value.clone(),
            hosts: policy.hosts,
            header: policy.header,
            scheme: policy.scheme,
            methods: Some(policy.methods),
            path_prefixes: Some(policy.path_prefixes),
        })
    }

    fn check_upstream(&self, url: &str) -> Result<String, String> {
        let upstream = Upstream::parse(url)?;
        if !self.node.upstream_allow.admits(&upstream) {
            return Err(if self.node.upstream_allow.is_empty() {
                "this server admits no upstream proxies (the operator lists them with \
                 --egress-upstream-allow)"
                    .to_owned()
            } else {
                format!(
                    "{} is not an upstream proxy this server admits (the operator lists them \
                     with --egress-upstream-allow)",
                    upstream.address()
                )
            });
        }
        Ok(upstream.display())
    }

    fn class_names(&self) -> Vec<String> {
        self.shared.classes.load().keys().cloned().collect()
    }

    fn takes_upstreams(&self) -> bool {
        !self.node.upstream_allow.is_empty()
    }

    fn placeholder(&self, name: &str) -> String {
        runbox_proxy::secrets::placeholder(name)
    }

    fn ca_pem(&self) -> String {
        self.shared.authority.ca_pem().to_owned()
    }

    fn start(
        &self,
        id: ulid::Ulid,
        req: &RunEgressRequest,
        brought: Vec<BroughtSecret>,
        upstream: RunUpstream,
        doors: runbox_core::egress::EgressListeners,
        stop: tokio_util::sync::CancellationToken,
        on_close: Option<runbox_core::egress::ConnectionBytes>,
    ) -> Result<Arc<dyn EgressHandle>, String> {
        let listener = tokio_listener(doors.http)?;
        let socks5 = doors.socks5.map(tokio_listener).transpose()?;
        let run = Arc::new(RunEgress::new(
            id.to_string(),
            self.node.for_run(id, req, &brought, &upstream),
            Arc::new(Counters::default()),
            on_close,
        ));
        tokio::spawn(runbox_proxy::proxy::serve(
            listener,
            self.shared.clone(),
            run.clone(),
            stop.clone(),
        ));
        let proxy = RunProxy {
            id,
            run,
            node: self.node.clone(),
            shared: self.shared.clone(),
            stop,
            socks5: std::sync::Mutex::new(None),
        };
        if let Some(socks5) = socks5 {
            proxy.open_socks5(socks5);
        }
        Ok(Arc::new(proxy))
    }
}

/// An `egressAllow` entry as the proxy's rule; the error names the entry.
/// The wire's rule and the proxy's spec are one JSON shape (the proxy does
/// not depend on the wire types), so one becomes the other through JSON.
fn parse_rule(raw: &EgressEntry) -> Result<Rule, String> {
    match raw {
        EgressEntry::Text(text) => Entry::from_str(text)
            .map(Rule::from)
            .map_err(|e| e.to_string()),
        EgressEntry::Rule(wire) => {
            let spec: RuleSpec = serde_json::to_value(wire)
                .and_then(serde_json::from_value)
                .map_err(|e| format!("invalid egress rule {raw}: {e}"))?;
            Rule::parse(&spec).map_err(|why| format!("invalid egress rule {raw}: {why}"))
        }
    }
}

/// The proxy's form of a brought secret's policy.
fn brought_policy(secret: &BroughtSecret) -> SecretPolicy {
    SecretPolicy {
        name: secret.name.clone(),
        header: secret.header.clone(),
        scheme: secret.scheme.clone(),
        hosts: secret.hosts.clone(),
        methods: secret.methods.clone().unwrap_or_default(),
        path_prefixes: secret.path_prefixes.clone().unwrap_or_default(),
    }
}

/// Everything the proxy needs, built and checked.
pub struct Built {
    /// For the run manager.
    pub config: Arc<NodeProxy>,
    /// For the API's audit records too.
    pub audit: Arc<AuditLog>,
}

/// Parses and checks the deployment allowlist alone (flags and file): used
/// by `build` and by tests of the refusal to start.
fn deployment_entries(flags: &[String], file: &[String]) -> anyhow::Result<Vec<Entry>> {
    let mut entries = Vec::new();
    for value in flags {
        entries.extend(policy::parse_list(value).with_context(|| {
            "--egress-allow / RUNBOX_EGRESS_ALLOW is malformed; the daemon does not start with a list other than the configured one"
        })?);
    }
    for value in file {
        entries.push(
            Entry::from_str(value).context("the egress config file's \"allow\" is malformed")?,
        );
    }
    Ok(entries)
}

impl EgressArgs {
    /// Builds the egress services; `api` is the API's own address, which the
    /// proxy refuses whatever the exceptions say.
    pub fn build(&self, state_dir: &Path, api: SocketAddr) -> anyhow::Result<Built> {
        let file: FileConfig = match &self.egress_config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading the egress config {}", path.display()))?;
                serde_json::from_str(&text)
                    .with_context(|| format!("parsing the egress config {}", path.display()))?
            }
            None => FileConfig::default(),
        };
        let deployment = deployment_entries(&self.egress_allow, &file.allow)?;
        let default_list = !self.no_default_egress && file.default_allow.unwrap_or(true);
        let mut internal = Vec::new();
        for raw in self
            .egress_internal_allow
            .iter()
            .chain(&file.internal_allow)
        {
            internal.push(
                InternalAllow::from_str(raw)
                    .context("--egress-internal-allow (or internalAllow) is malformed")?,
            );
        }
        let mut secrets = BTreeMap::new();
        for spec in file.secrets {
            let name = spec.name.clone();
            let secret = Secret::load(spec, |var| std::env::var(var).ok())
                .context("a secret in the egress config cannot be used")?;
            if secrets.insert(name.clone(), Arc::new(secret)).is_some() {
                bail!("the egress config declares the secret {name:?} twice");
            }
        }
        let upstream_allow = UpstreamAllow::parse(
            &self
                .egress_upstream_allow
                .iter()
                .chain(&file.upstream.allow)
                .collect::<Vec<_>>(),
        )
        .map_err(anyhow::Error::msg)
        .context("--egress-upstream-allow (or upstream.allow) is malformed")?;
        let upstream_default = match self
            .egress_upstream
            .as_ref()
            .or(file.upstream.default.as_ref())
        {
            Some(url) => Some(Arc::new(
                Upstream::parse(url)
                    .map_err(anyhow::Error::msg)
                    .context("--egress-upstream (or upstream.default) is malformed")?,
            )),
            None => None,
        };
        let audit = Arc::new(
            AuditLog::open(
                state_dir.join("audit.jsonl"),
                self.audit_max_mb.max(1) << 20,
            )
            .context("opening audit.jsonl")?,
        );
        let authority = Authority::load_or_create(&state_dir.join("ca"))
            .context("loading or creating the interception CA")?;
        let upstream_tls = upstream_client_config(self.egress_ca_bundle.as_deref())
            .context("loading the roots upstream servers are verified against")?;
        // The API is refused whatever the exceptions say, also through
        // 0.0.0.0 and `::`, which reach the host's own listeners.
        let guard = AddressGuard::from_host(internal)
            .context("listing this host's addresses")?
            .forbid(api);
        let resolver = Resolver::new(self.egress_dns).context(
            "setting up DNS for the egress proxy (name a DNS server with --egress-dns ADDR:PORT)",
        )?;
        tracing::info!(
            default_list,
            deployment = deployment.len(),
            secrets = secrets.len(),
            upstreams_admitted = !upstream_allow.is_empty(),
            // Without its password.
            upstream = upstream_default
                .as_ref()
                .map(|u| u.display())
                .unwrap_or_default(),
            "egress proxy configured"
        );
        let shared = Arc::new(Shared {
            resolver,
            guard,
            authority: Arc::new(authority),
            upstream_tls,
            audit: Some(audit.clone()),
            classes: runbox_proxy::proxy::ArcSwap::from_pointee(classes_by_name(
                &self.egress_classes,
            )?),
        });
        Ok(Built {
            config: Arc::new(NodeProxy {
                node: Arc::new(NodePolicy {
                    default_list,
                    deployment,
                    secrets,
                    upstream_allow,
                    upstream_default,
                }),
                shared,
            }),
            audit,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_deployment_entries_stop_the_start() {
        assert!(deployment_entries(&["example.org, .example.com".into()], &[]).is_ok());
        for bad in [".com", "https://example.org", "*.com", "host:0"] {
            let err = deployment_entries(&[bad.to_owned()], &[]).unwrap_err();
            assert!(
                format!("{err:#}").contains("RUNBOX_EGRESS_ALLOW"),
                "{err:#}"
            );
        }
        assert!(deployment_entries(&[], &["a b".to_owned()]).is_err());
    }

    #[test]
    fn the_config_file_refuses_unknown_keys() {
        let err = serde_json::from_str::<FileConfig>(r#"{"allowed": ["x.org"]}"#).unwrap_err();
        assert!(err.to_string().contains("unknown field"), "{err}");
        let ok: FileConfig = serde_json::from_str(
            r#"{"allow": ["x.org"], "defaultAllow": false, "internalAllow": ["10.0.0.0/8:443"],
                "secrets": [{"name": "GH", "header": "Authorization", "scheme": "Bearer",
                             "valueEnv": "GH_TOKEN", "hosts": ["api.github.com"],
                             "methods": ["GET"], "pathPrefixes": ["/repos/"]}]}"#,
        )
        .unwrap();
        assert_eq!(ok.secrets.len(), 1);
        assert_eq!(ok.default_allow, Some(false));
    }
}
