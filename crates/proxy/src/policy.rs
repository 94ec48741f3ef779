//! Allowlist entries, their grammar, the built-in default list and the
//! allow/deny decision. Pure: no I/O.
//!
//! This module owns the text form of an egress entry (what an operator types
//! into `--egress-allow` and what a run puts in `egressAllow`), the built-in
//! list of package registries and forges, and the name-level decision. It
//! does not own addresses: a name that is admitted here is still resolved and
//! checked by the SSRF guard (`guard`) before any connection.
//!
//! Matching is on whole labels only: `.example.com` admits `example.com` and
//! `a.example.com`, never `evilexample.com`. Entries and hosts are compared
//! in one canonical form (lowercase, no trailing dot, IPv6 without brackets
//! and compressed), so two spellings of one name cannot decide differently.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;
use std::sync::LazyLock;

use crate::rules::Rule;

/// Where an entry came from; a denial names the setting that would admit the
/// destination, and an allow names the entry that did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// runbox's built-in list of package registries and forges.
    Default,
    /// The deployment-wide list (`--egress-allow`, `RUNBOX_EGRESS_ALLOW`).
    Deployment,
    /// The run's own `egressAllow`.
    Run,
    /// The host of a secret the run's caller brought: reachable because
    /// the secret names it.
    Secret,
}

impl Source {
    /// The prefix used in audit rules: `default`, `deployment` or `run`.
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Default => "default",
            Source::Deployment => "deployment",
            Source::Run => "run",
            Source::Secret => "secret",
        }
    }
}

/// One allowlist entry.
///
/// Grammar: `host` (ports 80 and 443), `.suffix` (the host and every
/// subdomain; at least two labels, so `.com` is refused), `*.suffix` (the
/// subdomains only), `host:port` (that port only), `prefix/len` (the
/// addresses of that network given as the destination, ports 80 and 443:
/// a name is never resolved to be matched against a network, which would
/// let a run send data out through DNS with names it makes up). Hosts are lowercase DNS names
/// (IDNA A-labels) or IP literals (`[v6]:port` for an IPv6 literal with a
/// port).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Entry {
    /// `host`: exactly that host, ports 80 and 443.
    Host(String),
    /// `.suffix`: the suffix itself and its subdomains, ports 80 and 443.
    Suffix(String),
    /// `*.suffix`: the suffix's subdomains, not the suffix itself, ports
    /// 80 and 443.
    Subdomains(String),
    /// `host:port`: exactly that host and port.
    HostPort(String, u16),
    /// `prefix/len`: destinations given as an address of that network,
    /// ports 80 and 443.
    Cidr(ipnet::IpNet),
}

/// Why an entry is malformed; the message says what to write instead.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid egress entry {entry:?}: {reason}")]
pub struct EntryError {
    /// The entry as given.
    pub entry: String,
    /// What is wrong with it and what would be right.
    pub reason: String,
}

/// The ports a `host` or `.suffix` entry admits.
const WEB_PORTS: [u16; 2] = [80, 443];

/// The longest DNS name, without its trailing dot (RFC 1035).
const MAX_NAME: usize = 253;

/// The longest DNS label (RFC 1035).
const MAX_LABEL: usize = 63;

impl FromStr for Entry {
    type Err = EntryError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_entry(s).map_err(|reason| EntryError {
            entry: s.to_string(),
            reason,
        })
    }
}

/// Parses one entry; the error is the reason only, [`Entry::from_str`] adds
/// the entry itself.
fn parse_entry(raw: &str) -> Result<Entry, String> {
    // Surrounding whitespace is a copy-paste artefact, not a different entry.
    let s = raw.trim();
    if s.is_empty() {
        return Err("empty entry; write a host such as example.org".into());
    }
    if !s.is_ascii() {
        return Err(
            "non-ASCII name; use the IDNA A-label form (xn--…), e.g. xn--bcher-kva.example".into(),
        );
    }
    if s.chars().any(|c| c.is_ascii_whitespace()) {
        return Err(
            "whitespace inside an entry; write one host per entry, separated by commas".into(),
        );
    }
    if s.contains("://") {
        return Err(
            "a URL scheme is not part of an entry; write the host only, e.g. example.org".into(),
        );
    }
    if s.contains('@') {
        return Err("user information (`user@`) is not part of an entry; write the host only, e.g. example.org".into());
    }
    if let Some(rest) = s.strip_prefix("*.") {
        if rest.contains(['*', ':']) {
            return Err("write *.example.org alone: one leading *. and no port".into());
        }
        let name = strip_trailing_dot(rest).to_ascii_lowercase();
        check_dns_name(&name)?;
        if !name.contains('.') {
            return Err(format!(
                "*.{name} would admit every name under a top-level domain; write e.g. *.example.{name}"
            ));
        }
        return Ok(Entry::Subdomains(name));
    }
    if s.contains('*') {
        return Err(
            "a wildcard is only *.example.org (the subdomains); use .example.org for a domain \
             and its subdomains"
                .into(),
        );
    }
    if let Some((addr, len)) = s.split_once('/') {
        if addr.parse::<IpAddr>().is_ok() {
            let net: ipnet::IpNet = s.parse().map_err(|_| {
                format!(
                    "{len:?} is not a prefix length for {addr}; write e.g. 192.0.2.0/24 or 2001:db8::/32"
                )
            })?;
            return Ok(Entry::Cidr(net.trunc()));
        }
    }
    if s.contains(['/', '?', '#']) {
        return Err(
            "paths are not part of an entry; write the host only, e.g. example.org (or example.org:8443)"
                .into(),
        );
    }
    if s.contains('_') {
        return Err(
            "underscores are not allowed in host names; only letters, digits, hyphens and dots"
                .into(),
        );
    }
    let s = s.to_ascii_lowercase();

    // Bracketed IPv6 literal, with or without a port.
    if let Some(rest) = s.strip_prefix('[') {
        let Some((addr, after)) = rest.split_once(']') else {
            return Err(
                "unclosed `[`; write an IPv6 address as [2001:db8::1] or [2001:db8::1]:8443".into(),
            );
        };
        let addr: Ipv6Addr = addr
            .parse()
            .map_err(|_| format!("{addr:?} is not an IPv6 address; write e.g. [2001:db8::1]"))?;
        let host = addr.to_string();
        return if after.is_empty() {
            Ok(Entry::Host(host))
        } else if let Some(port) = after.strip_prefix(':') {
            Ok(Entry::HostPort(host, parse_port(port)?))
        } else {
            Err("unexpected text after `]`; write [2001:db8::1] or [2001:db8::1]:8443".into())
        };
    }

    if let Some(suffix) = s.strip_prefix('.') {
        if suffix.contains(':') {
            return Err(
                "a .suffix entry admits ports 80 and 443 only; write host:port for one host on another port"
                    .into(),
            );
        }
        let name = strip_trailing_dot(suffix);
        if name.parse::<IpAddr>().is_ok() {
            return Err(
                "a .suffix cannot be an IP address; write the address alone, e.g. 192.0.2.1".into(),
            );
        }
        check_dns_name(name)?;
        if !name.contains('.') {
            return Err(format!(
                "a .suffix needs at least two labels (.{name} would admit a whole top-level domain); write e.g. .example.{name}"
            ));
        }
        return Ok(Entry::Suffix(name.to_string()));
    }

    let (host, port) = match s.matches(':').count() {
        0 => (s.as_str(), None),
        1 => {
            let (h, p) = s.split_once(':').unwrap_or((s.as_str(), ""));
            (h, Some(parse_port(p)?))
        }
        _ => {
            return Err(
                "write an IPv6 address in brackets: [2001:db8::1] or [2001:db8::1]:8443".into(),
            )
        }
    };
    if host.is_empty() {
        return Err("missing host before the port; write e.g. example.org:8443".into());
    }
    let host = canonical_name_or_v4(host)?;
    Ok(match port {
        None => Entry::Host(host),
        Some(p) => Entry::HostPort(host, p),
    })
}

/// Strips one trailing dot (the DNS root), if present.
fn strip_trailing_dot(s: &str) -> &str {
    s.strip_suffix('.').unwrap_or(s)
}

/// Validates a host that is not bracketed: a dotted-quad IPv4 address or a
/// DNS name. Returns the canonical form.
fn canonical_name_or_v4(host: &str) -> Result<String, String> {
    let name = strip_trailing_dot(host);
    if let Ok(v4) = name.parse::<Ipv4Addr>() {
        return Ok(v4.to_string());
    }
    check_dns_name(name)?;
    Ok(name.to_string())
}

/// Validates a lowercase DNS name without its trailing dot.
fn check_dns_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("empty host name; write a host such as example.org".into());
    }
    if name.len() > MAX_NAME {
        return Err(format!(
            "host name is {} characters long; the limit is {MAX_NAME}",
            name.len()
        ));
    }
    let mut last = "";
    for label in name.split('.') {
        if label.is_empty() {
            return Err(
                "empty label (two dots in a row, or a leading dot); write e.g. a.example.org"
                    .into(),
            );
        }
        if label.len() > MAX_LABEL {
            return Err(format!(
                "label {label:?} is {} characters long; the limit is {MAX_LABEL}",
                label.len()
            ));
        }
        if let Some(c) = label
            .chars()
            .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-'))
        {
            return Err(format!(
                "{c:?} is not allowed in a host name; only letters, digits, hyphens and dots"
            ));
        }
        if label.starts_with('-') || label.ends_with('-') {
            return Err(format!(
                "label {label:?} starts or ends with a hyphen, which DNS names never do"
            ));
        }
        last = label;
    }
    // An all-digit last label is not a DNS name but a mistyped or shortened
    // IPv4 address (`127.1`, `010.0.0.1`), which resolvers read in
    // surprising ways; only dotted quads are accepted as addresses.
    if last.bytes().all(|b| b.is_ascii_digit()) {
        return Err(
            "not a DNS name nor an IPv4 address; write an IPv4 address as four decimal numbers, e.g. 192.0.2.1"
                .into(),
        );
    }
    Ok(())
}

/// Parses a port: digits only, 1-65535.
fn parse_port(p: &str) -> Result<u16, String> {
    if p.is_empty() {
        return Err("empty port after `:`; write e.g. example.org:8443".into());
    }
    if !p.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!(
            "port {p:?} is not a number; write e.g. example.org:8443"
        ));
    }
    match p.parse::<u32>() {
        Ok(n) if (1..=65535).contains(&n) => Ok(n as u16),
        _ => Err(format!("port {p} is out of range; use 1-65535")),
    }
}

/// Writes a canonical host, bracketing an IPv6 literal.
fn write_host(f: &mut fmt::Formatter<'_>, host: &str) -> fmt::Result {
    if host.contains(':') {
        write!(f, "[{host}]")
    } else {
        f.write_str(host)
    }
}

impl fmt::Display for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Entry::Host(h) => write_host(f, h),
            Entry::Suffix(s) => write!(f, ".{s}"),
            Entry::Subdomains(s) => write!(f, "*.{s}"),
            Entry::HostPort(h, p) => {
                write_host(f, h)?;
                write!(f, ":{p}")
            }
            Entry::Cidr(net) => write!(f, "{net}"),
        }
    }
}

impl Entry {
    /// Whether this entry admits `host:port`. `host` must already be in
    /// canonical form (see [`normalize_host`]).
    pub fn matches(&self, host: &str, port: u16) -> bool {
        self.matches_name(host) && self.default_ports(port)
    }

    /// Whether the entry, without ports of a rule, admits `port`.
    pub fn default_ports(&self, port: u16) -> bool {
        match self {
            Entry::HostPort(_, p) => port == *p,
            _ => WEB_PORTS.contains(&port),
        }
    }

    /// Whether this entry names `host`, ignoring ports: exact for `host` and
    /// `host:port`, on a label boundary for `.suffix`. `host` must already be
    /// in canonical form (see [`normalize_host`]).
    pub fn matches_name(&self, host: &str) -> bool {
        match self {
            Entry::Host(h) | Entry::HostPort(h, _) => host == h,
            Entry::Suffix(s) => {
                host == s
                    || host
                        .strip_suffix(s.as_str())
                        .is_some_and(|head| head.ends_with('.'))
            }
            Entry::Subdomains(s) => host
                .strip_suffix(s.as_str())
                .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
            Entry::Cidr(net) => host.parse::<IpAddr>().is_ok_and(|ip| net.contains(&ip)),
        }
    }
}

/// Brings a host as asked into the form entries are stored in: lowercase, one
/// trailing dot stripped, IPv6 brackets stripped, IP literals in their
/// canonical text form.
pub fn normalize_host(host: &str) -> String {
    let lower = host.to_ascii_lowercase();
    let unbracketed = lower
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(&lower);
    let name = strip_trailing_dot(unbracketed);
    match name.parse::<IpAddr>() {
        Ok(ip) => ip.to_string(),
        Err(_) => name.to_string(),
    }
}

/// Parses a deployment list: entries separated by commas and/or whitespace.
/// Any malformed entry fails the whole list (never a silent drop).
pub fn parse_list(s: &str) -> Result<Vec<Entry>, EntryError> {
    s.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|piece| !piece.is_empty())
        .map(str::parse)
        .collect()
}

/// The outcome of checking a destination against an allowlist.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Admitted by `entry` from `source`.
    Allow {
        /// The admitting rule.
        entry: Rule,
        /// Where it came from.
        source: Source,
    },
    /// Not admitted. `run_entry` is the exact per-run `egressAllow` entry that
    /// would admit it (e.g. `"example.org"` or `"example.org:8443"`).
    Deny {
        /// The entry to add.
        run_entry: String,
        /// A rule that names the host but not the port, and the port asked
        /// for: the denial names it as the one to widen.
        near: Option<(Rule, Source)>,
    },
}

impl Decision {
    /// The audit `rule` field: `"run:<entry>"`, `"deployment:<entry>"`,
    /// `"default:<entry>"`, or `"none"` for a denial.
    pub fn rule(&self) -> String {
        match self {
            Decision::Allow { entry, source } => format!("{}:{entry}", source.as_str()),
            Decision::Deny { .. } => "none".to_string(),
        }
    }

    /// Whether the destination was admitted.
    pub fn is_allow(&self) -> bool {
        matches!(self, Decision::Allow { .. })
    }
}

/// The built-in list, parsed once. Every entry is checked by a unit test, so
/// a parse failure here is a build defect, not a runtime condition.
static DEFAULTS: LazyLock<Vec<Entry>> = LazyLock::new(|| {
    DEFAULT_ALLOW
        .iter()
        .map(|e| {
            e.parse()
                .unwrap_or_else(|err| panic!("DEFAULT_ALLOW holds a malformed entry: {err}"))
        })
        .collect()
});

/// The entries in force for one run: defaults (unless switched off), the
/// deployment's, and the run's own.
#[derive(Clone, Debug, Default)]
pub struct Allowlist {
    /// In the order they are consulted: the run's, the hosts of its
    /// brought secrets, the deployment's, the defaults. The first match
    /// decides, so an allow names the most specific setting that admitted
    /// it.
    entries: Vec<(Rule, Source)>,
}

impl Allowlist {
    /// Builds the list. `defaults` switches the built-in list on or off.
    pub fn new<R: Clone + Into<Rule>>(
        defaults: bool,
        deployment: &[Entry],
        run: &[R],
    ) -> Allowlist {
        let mut entries = Vec::with_capacity(run.len() + deployment.len() + DEFAULT_ALLOW.len());
        entries.extend(run.iter().map(|r| (r.clone().into(), Source::Run)));
        entries.extend(
            deployment
                .iter()
                .map(|e| (Rule::from(e.clone()), Source::Deployment)),
        );
        if defaults {
            entries.extend(
                DEFAULTS
                    .iter()
                    .map(|e| (Rule::from(e.clone()), Source::Default)),
            );
        }
        Allowlist { entries }
    }

    /// The list with the hosts of the run's brought secrets admitted too,
    /// after the run's own entries.
    pub fn with_secret_hosts(mut self, hosts: &[Entry]) -> Allowlist {
        let at = self
            .entries
            .iter()
            .take_while(|(_, source)| *source == Source::Run)
            .count();
        for (i, entry) in hosts.iter().enumerate() {
            self.entries
                .insert(at + i, (Rule::from(entry.clone()), Source::Secret));
        }
        self
    }

    /// Decides for `host` (already lowercased by the caller or not: this
    /// normalises) and `port`, by name.
    pub fn decide(&self, host: &str, port: u16) -> Decision {
        let host = normalize_host(host);
        let mut near = None;
        for (rule, source) in &self.entries {
            if rule.matches(&host, port) {
                return Decision::Allow {
                    entry: rule.clone(),
                    source: *source,
                };
            }
            if near.is_none() && rule.ports.is_some() && rule.entry.matches_name(&host) {
                near = Some((rule.clone(), *source));
            }
        }
        Decision::Deny {
            run_entry: run_entry_for(&host, port),
            near,
        }
    }
}

/// The narrowest entry that admits `host:port`: `host` for the web ports,
/// `host:port` otherwise. `host` is canonical.
fn run_entry_for(host: &str, port: u16) -> String {
    let host = if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_string()
    };
    if WEB_PORTS.contains(&port) {
        host
    } else {
        format!("{host}:{port}")
    }
}

/// The text of the proxy's 403 body for a denied destination: names the exact
/// per-run `egressAllow` entry and the deployment setting that would admit it,
/// or the rule that names the host but not the port.
pub fn denial_message(
    method: &str,
    host: &str,
    port: u16,
    run_entry: &str,
    near: Option<&(Rule, Source)>,
) -> String {
    let shown = if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_string()
    };
    if let Some((rule, source)) = near {
        return format!(
            "runbox: {method} {shown}:{port} is blocked: the {} rule {rule} names this host but \
             not port {port}.\nTo allow it, add {port} to that rule's ports.\n",
            source.as_str()
        );
    }
    format!(
        "runbox: {method} {shown}:{port} is blocked: it is not on this run's egress allowlist.\n\
         To allow it for this run, add \"{run_entry}\" to egressAllow when you create the run.\n\
         To allow it for every run, add \"{run_entry}\" to the deployment list \
         (runbox serve --egress-allow, or the RUNBOX_EGRESS_ALLOW environment variable).\n"
    )
}

/// The built-in default list, one comment per entry saying what it serves.
///
/// Left out on purpose: generic object stores (`storage.googleapis.com`,
/// `*.s3.amazonaws.com`, `*.blob.core.windows.net`), where anyone can host
/// anything and a run could write out data; redirectors such as `aka.ms`,
/// which lead anywhere; and `registry.k8s.io`, which redirects to per-region
/// cloud buckets. A deployment that needs them adds them itself.
///
/// "Two-way" marks a host that accepts uploads on the same name that serves
/// downloads: allowing installs from it also allows publishing to it, given
/// credentials.
pub const DEFAULT_ALLOW: &[&str] = &[
    // --- JavaScript ---
    // npm registry: package metadata and tarballs. Two-way (npm publish).
    "registry.npmjs.org",
    // Yarn classic's registry front for npm. Two-way (yarn publish).
    "registry.yarnpkg.com",
    // Yarn Berry releases fetched by Corepack and `yarn set version`.
    "repo.yarnpkg.com",
    // Node.js release archives and headers (nodejs.org/dist), used by nvm, fnm, node-gyp.
    "nodejs.org",
    // --- Python ---
    // PyPI simple index and JSON API (uploads go to upload.pypi.org, not listed).
    "pypi.org",
    // PyPI distribution files (wheels and sdists).
    "files.pythonhosted.org",
    // --- Go ---
    // Go module proxy, also the source of toolchains for GOTOOLCHAIN downloads.
    "proxy.golang.org",
    // Go checksum database.
    "sum.golang.org",
    // go.dev/dl: Go release archives (redirects to dl.google.com).
    "go.dev",
    // Google's download host for Go release archives; serves Google's own files only.
    "dl.google.com",
    // --- Rust ---
    // Cargo's sparse registry index (crates.io itself, the publishing API, is left out).
    "index.crates.io",
    // Crate archives.
    "static.crates.io",
    // rustup toolchains, components and the rustup-init binaries.
    "static.rust-lang.org",
    // The rustup install script.
    "sh.rustup.rs",
    // --- Ruby ---
    // RubyGems API and gem downloads. Two-way (gem push).
    "rubygems.org",
    // RubyGems compact index used by Bundler.
    "index.rubygems.org",
    // --- JVM ---
    // Maven Central (publishing goes through central.sonatype.com, not listed).
    "repo.maven.apache.org",
    // Maven Central, older name still used by many builds.
    "repo1.maven.org",
    // Gradle wrapper distributions.
    "services.gradle.org",
    // Gradle distributions and release files.
    "downloads.gradle.org",
    // Gradle plugin portal metadata. Two-way (publishPlugins).
    "plugins.gradle.org",
    // Gradle plugin portal artifacts; plugins.gradle.org redirects here.
    "plugins-artifacts.gradle.org",
    // --- PHP ---
    // Composer package metadata (Packagist); archives come from GitHub below.
    "repo.packagist.org",
    // --- .NET ---
    // NuGet v3 feed: package metadata and .nupkg downloads (pushes go to www.nuget.org, not listed).
    "api.nuget.org",
    // dot.net/v1/dotnet-install.sh, which redirects to builds.dotnet.microsoft.com.
    "dot.net",
    // .NET SDK and runtime archives and the dotnet-install scripts.
    "builds.dotnet.microsoft.com",
    // --- Elixir / Erlang ---
    // Hex package registry and tarballs (hex.pm, the API and publishing host, is left out).
    "repo.hex.pm",
    // Hex and rebar3 builds installed by `mix local.hex` / `mix local.rebar`.
    "builds.hex.pm",
    // --- Dart ---
    // pub.dev package API and archives. Two-way (dart pub publish). Some archive
    // downloads redirect to storage.googleapis.com, which stays out (see above).
    "pub.dev",
    // --- Haskell ---
    // Hackage index and package tarballs. Two-way (cabal upload).
    "hackage.haskell.org",
    // GHC, cabal-install and Stack binaries installed by ghcup.
    "downloads.haskell.org",
    // The ghcup install script.
    "get-ghcup.haskell.org",
    // --- OS packages ---
    // Debian archive mirror redirector (apt, plain HTTP on port 80 included).
    "deb.debian.org",
    // Debian security updates.
    "security.debian.org",
    // Ubuntu archive (amd64, i386).
    "archive.ubuntu.com",
    // Ubuntu security updates.
    "security.ubuntu.com",
    // Ubuntu archive for other architectures (arm64, ppc64el, s390x, riscv64).
    "ports.ubuntu.com",
    // Alpine packages (apk).
    "dl-cdn.alpinelinux.org",
    // --- Source forges ---
    // GitHub: git over HTTPS and release downloads. Two-way (git push).
    "github.com",
    // GitHub REST API: Composer dist archives and release lookups by install
    // scripts. Two-way (the API accepts writes).
    "api.github.com",
    // GitHub source archives (tarball and zipball downloads).
    "codeload.github.com",
    // GitHub release assets and LFS objects (older redirect target).
    "objects.githubusercontent.com",
    // GitHub release assets (current redirect target for release downloads).
    "release-assets.githubusercontent.com",
    // Raw files from GitHub repositories (install scripts, ghcup metadata).
    "raw.githubusercontent.com",
    // GitLab: git over HTTPS, archives, package registry. Two-way (git push, package uploads).
    "gitlab.com",
    // Bitbucket: git over HTTPS and archives. Two-way (git push).
    "bitbucket.org",
    // Codeberg: git over HTTPS and archives. Two-way (git push).
    "codeberg.org",
    // --- Container images (anonymous pulls) ---
    // Docker Hub registry API. Two-way (OCI push).
    "registry-1.docker.io",
    // Docker Hub token service, needed even for anonymous pulls.
    "auth.docker.io",
    // Docker Hub layer blobs (CDN, download only).
    "production.cloudflare.docker.com",
    // GitHub Container Registry. Two-way (OCI push).
    "ghcr.io",
    // GHCR layer blobs (download only).
    "pkg-containers.githubusercontent.com",
    // Quay registry API. Two-way (OCI push).
    "quay.io",
    // Quay layer blobs, served from these CDN names (download only).
    "cdn.quay.io",
    "cdn01.quay.io",
    "cdn02.quay.io",
    "cdn03.quay.io",
    // Microsoft Container Registry. The OCI protocol is two-way, though only
    // Microsoft publishes here.
    "mcr.microsoft.com",
    // MCR layer blobs from regional endpoints (westus.data.mcr.microsoft.com, ...).
    ".data.mcr.microsoft.com",
];

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    fn entry(s: &str) -> Entry {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    fn reason(s: &str) -> String {
        s.parse::<Entry>().expect_err(s).reason
    }

    #[test]
    fn parses_each_form() {
        assert_eq!(entry("example.org"), Entry::Host("example.org".into()));
        assert_eq!(entry(".example.com"), Entry::Suffix("example.com".into()));
        assert_eq!(entry(".co.uk"), Entry::Suffix("co.uk".into()));
        assert_eq!(
            entry("example.org:8443"),
            Entry::HostPort("example.org".into(), 8443)
        );
        assert_eq!(entry("localhost"), Entry::Host("localhost".into()));
        assert_eq!(entry("192.0.2.1"), Entry::Host("192.0.2.1".into()));
        assert_eq!(
            entry("192.0.2.1:5432"),
            Entry::HostPort("192.0.2.1".into(), 5432)
        );
        assert_eq!(entry("[2001:db8::1]"), Entry::Host("2001:db8::1".into()));
        assert_eq!(
            entry("[2001:DB8:0:0::1]:8443"),
            Entry::HostPort("2001:db8::1".into(), 8443)
        );
    }

    #[test]
    fn normalises_case_and_trailing_dot() {
        assert_eq!(entry("Example.ORG"), Entry::Host("example.org".into()));
        assert_eq!(entry("example.org."), Entry::Host("example.org".into()));
        assert_eq!(entry(".Example.com."), Entry::Suffix("example.com".into()));
        assert_eq!(
            entry("example.org.:8080"),
            Entry::HostPort("example.org".into(), 8080)
        );
        assert_eq!(entry("  example.org "), Entry::Host("example.org".into()));
    }

    #[test]
    fn refuses_with_guidance() {
        let cases: &[(&str, &str)] = &[
            ("", "empty entry"),
            ("exa mple.org", "whitespace"),
            (
                "https://example.org",
                "write the host only, e.g. example.org",
            ),
            ("example.org/path", "paths are not part"),
            ("example.org?x=1", "paths are not part"),
            (
                "ex*.example.org",
                "use .example.org for a domain and its subdomains",
            ),
            ("user@example.org", "user information"),
            ("example.org:0", "out of range"),
            ("example.org:65536", "out of range"),
            ("example.org:99999999999", "out of range"),
            ("example.org:https", "not a number"),
            ("example.org:+443", "not a number"),
            ("example.org:", "empty port"),
            (":443", "missing host"),
            ("a..b", "empty label"),
            ("example.org..", "empty label"),
            (".", "empty host name"),
            ("my_host.example", "underscores"),
            ("bücher.example", "IDNA A-label form (xn--"),
            (".com", "at least two labels"),
            (".localhost", "at least two labels"),
            (".192.0.2.1", "cannot be an IP"),
            (".example.org:443", "ports 80 and 443 only"),
            ("-bad.example", "hyphen"),
            ("bad-.example", "hyphen"),
            ("2001:db8::1", "brackets"),
            ("[2001:db8::1", "unclosed"),
            ("[2001:db8::1]x", "after `]`"),
            ("[example.org]", "not an IPv6 address"),
            ("127.1", "four decimal numbers"),
            ("010.0.0.1", "four decimal numbers"),
            ("exa!mple.org", "not allowed in a host name"),
        ];
        for (input, want) in cases {
            let got = reason(input);
            assert!(got.contains(want), "{input:?}: {got:?} lacks {want:?}");
        }
    }

    #[test]
    fn refuses_overlong_labels_and_names() {
        let label = "a".repeat(64);
        assert!(reason(&format!("{label}.example")).contains("limit is 63"));
        let ok = format!("{}.example", "a".repeat(63));
        assert!(ok.parse::<Entry>().is_ok());
        let long = vec!["abcdefghi"; 26].join("."); // 26*10-1 = 259
        assert!(reason(&long).contains("limit is 253"));
    }

    #[test]
    fn error_message_names_the_entry() {
        let err = "https://example.org".parse::<Entry>().unwrap_err();
        let msg = err.to_string();
        assert!(msg.starts_with("invalid egress entry \"https://example.org\": "));
    }

    #[test]
    fn display_is_canonical() {
        for (input, shown) in [
            ("Example.org.", "example.org"),
            (".Example.com", ".example.com"),
            ("example.org:08443", "example.org:8443"),
            ("[2001:DB8::0:1]", "[2001:db8::1]"),
            ("[2001:db8::1]:443", "[2001:db8::1]:443"),
        ] {
            assert_eq!(entry(input).to_string(), shown);
        }
    }

    #[test]
    fn parse_list_splits_on_commas_and_whitespace() {
        let list = parse_list("a.example, .b.example\n c.example:8443,,\t[2001:db8::1],").unwrap();
        assert_eq!(
            list,
            vec![
                Entry::Host("a.example".into()),
                Entry::Suffix("b.example".into()),
                Entry::HostPort("c.example".into(), 8443),
                Entry::Host("2001:db8::1".into()),
            ]
        );
        assert_eq!(parse_list("").unwrap(), vec![]);
        assert_eq!(parse_list(" , ,\n").unwrap(), vec![]);
        let err = parse_list("a.example, b.*.example, c.example").unwrap_err();
        assert_eq!(err.entry, "b.*.example");
    }

    #[test]
    fn decide_matches_each_form() {
        let run = parse_list("api.example.com .svc.example db.example.net:5432 [2001:db8::1]:8443")
            .unwrap();
        let list = Allowlist::new(false, &[], &run);
        let allowed = [
            ("api.example.com", 443),
            ("api.example.com", 80),
            ("API.Example.COM.", 443),
            ("svc.example", 443),
            ("a.b.svc.example", 80),
            ("db.example.net", 5432),
            ("[2001:db8::1]", 8443),
            ("2001:DB8::1", 8443),
        ];
        for (host, port) in allowed {
            assert!(list.decide(host, port).is_allow(), "{host}:{port}");
        }
        let denied = [
            ("api.example.com", 8443),
            ("x.api.example.com", 443),
            ("evilsvc.example", 443),
            ("svc.example", 8080),
            ("db.example.net", 443),
            ("db.example.net", 5433),
            ("[2001:db8::1]", 443),
            ("example.com", 443),
            ("api.example.com..", 443),
        ];
        for (host, port) in denied {
            assert!(!list.decide(host, port).is_allow(), "{host}:{port}");
        }
    }

    #[test]
    fn run_then_deployment_then_default() {
        let run = vec![entry("github.com")];
        let deployment = vec![entry("github.com"), entry(".internal.example")];
        let list = Allowlist::new(true, &deployment, &run);
        assert_eq!(list.decide("github.com", 443).rule(), "run:github.com");
        assert_eq!(
            list.decide("x.internal.example", 443).rule(),
            "deployment:.internal.example"
        );
        assert_eq!(list.decide("pypi.org", 443).rule(), "default:pypi.org");
        assert_eq!(list.decide("example.org", 443).rule(), "none");

        let without_defaults = Allowlist::new::<Entry>(false, &deployment, &[]);
        assert!(!without_defaults.decide("pypi.org", 443).is_allow());
        assert_eq!(
            without_defaults.decide("github.com", 443).rule(),
            "deployment:github.com"
        );
    }

    #[test]
    fn default_allowlist_is_empty() {
        let list = Allowlist::default();
        assert!(!list.decide("github.com", 443).is_allow());
    }

    #[test]
    fn deny_names_the_narrowest_run_entry() {
        let list = Allowlist::new::<Entry>(false, &[], &[]);
        let run_entry = |host: &str, port| match list.decide(host, port) {
            Decision::Deny { run_entry, .. } => run_entry,
            d => panic!("{d:?}"),
        };
        assert_eq!(run_entry("Example.org.", 443), "example.org");
        assert_eq!(run_entry("example.org", 80), "example.org");
        assert_eq!(run_entry("example.org", 8443), "example.org:8443");
        assert_eq!(run_entry("[2001:db8::1]", 443), "[2001:db8::1]");
        assert_eq!(run_entry("[2001:db8::1]", 8443), "[2001:db8::1]:8443");
        assert_eq!(run_entry("192.0.2.1", 22), "192.0.2.1:22");
        // The suggested entry is itself valid and admits the destination.
        for (host, port) in [("example.org", 8443), ("[2001:db8::1]", 8443), ("a.b", 443)] {
            let e = entry(&run_entry(host, port));
            assert!(Allowlist::new(false, &[], &[e])
                .decide(host, port)
                .is_allow());
        }
    }

    #[test]
    fn denial_message_names_the_fix() {
        let msg = denial_message("CONNECT", "example.org", 8443, "example.org:8443", None);
        assert!(msg.contains("CONNECT example.org:8443"));
        assert!(msg.contains("not on this run's egress allowlist"));
        assert!(msg.contains("\"example.org:8443\" to egressAllow"));
        assert!(msg.contains("runbox serve --egress-allow"));
        assert!(msg.contains("RUNBOX_EGRESS_ALLOW"));
        assert!(msg.ends_with('\n'));
        let v6 = denial_message("GET", "2001:db8::1", 80, "[2001:db8::1]", None);
        assert!(v6.contains("GET [2001:db8::1]:80"));
    }

    #[test]
    fn default_entries_parse_canonically_without_duplicates() {
        let mut seen = HashSet::new();
        for raw in DEFAULT_ALLOW {
            let e = entry(raw);
            assert_eq!(&e.to_string(), raw, "not canonical");
            assert!(seen.insert(e), "duplicate {raw}");
        }
        assert_eq!(DEFAULTS.len(), DEFAULT_ALLOW.len());
    }

    #[test]
    fn default_list_leaves_out_publishing_apis_and_open_stores() {
        let list = Allowlist::new::<Entry>(true, &[], &[]);
        for host in [
            "crates.io",
            "www.nuget.org",
            "hex.pm",
            "upload.pypi.org",
            "storage.googleapis.com",
            "aka.ms",
            "registry.k8s.io",
            "s3.amazonaws.com",
        ] {
            assert!(!list.decide(host, 443).is_allow(), "{host}");
        }
        assert!(list.decide("westus.data.mcr.microsoft.com", 443).is_allow());
    }

    #[test]
    fn subdomain_wildcards_and_networks() {
        assert_eq!(
            entry("*.Example.COM"),
            Entry::Subdomains("example.com".into())
        );
        assert_eq!(entry("*.example.com").to_string(), "*.example.com");
        assert_eq!(entry("192.0.2.7/24").to_string(), "192.0.2.0/24");
        assert_eq!(entry("2001:db8::1/32").to_string(), "2001:db8::/32");
        let list = Allowlist::new(false, &[], &[entry("*.example.com"), entry("192.0.2.0/24")]);
        assert!(list.decide("a.example.com", 443).is_allow());
        assert!(list.decide("a.b.example.com", 80).is_allow());
        assert!(!list.decide("example.com", 443).is_allow());
        assert!(!list.decide("xexample.com", 443).is_allow());
        assert!(list.decide("192.0.2.200", 443).is_allow());
        assert!(!list.decide("192.0.2.200", 22).is_allow());
        assert!(!list.decide("192.0.3.1", 443).is_allow());
        // A network matches addresses given as such, never names.
        assert!(!list.decide("host-in-net.example.org", 443).is_allow());
        for (bad, says) in [
            ("*.com", "top-level"),
            ("*.*.example.com", "one leading"),
            ("a.*.example.com", "wildcard is only"),
            ("*.example.com:443", "one leading"),
            ("10.0.0.0/33", "prefix length"),
            ("example.com/24", "paths are not part"),
        ] {
            assert!(reason(bad).contains(says), "{bad}: {}", reason(bad));
        }
    }

    #[test]
    fn a_rule_that_names_the_host_but_not_the_port_is_the_one_a_denial_names() {
        let spec: crate::rules::RuleSpec =
            serde_json::from_str(r#"{"host": "db.example.com", "ports": [5432]}"#).unwrap();
        let rule = Rule::parse(&spec).unwrap();
        let list = Allowlist::new(false, &[], &[rule]);
        assert!(list.decide("db.example.com", 5432).is_allow());
        let Decision::Deny { run_entry, near } = list.decide("db.example.com", 5433) else {
            panic!()
        };
        assert_eq!(run_entry, "db.example.com:5433");
        let message = denial_message("CONNECT", "db.example.com", 5433, &run_entry, near.as_ref());
        assert!(
            message.contains(r#"the run rule {"host":"db.example.com","ports":[5432]}"#)
                && message.contains("add 5433 to that rule's ports"),
            "{message}"
        );
    }

    #[test]
    fn secret_hosts_come_after_the_run_and_before_the_deployment() {
        let list = Allowlist::new(
            false,
            &[entry("api.example.com")],
            &[entry("x.example.org")],
        )
        .with_secret_hosts(&[entry("api.example.com"), entry(".vendor.example")]);
        assert_eq!(
            list.decide("x.example.org", 443).rule(),
            "run:x.example.org"
        );
        assert_eq!(
            list.decide("api.example.com", 443).rule(),
            "secret:api.example.com"
        );
        assert_eq!(
            list.decide("eu.vendor.example", 443).rule(),
            "secret:.vendor.example"
        );
        assert!(!list.decide("api.example.com", 8443).is_allow());
    }

    fn label() -> impl Strategy<Value = String> {
        "[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?"
    }

    fn dns_name(min_labels: usize) -> impl Strategy<Value = String> {
        (
            prop::collection::vec(label(), min_labels - 1..4),
            "[a-z][a-z0-9]{0,5}",
        )
            .prop_map(|(mut labels, tld)| {
                labels.push(tld);
                labels.join(".")
            })
    }

    fn any_entry() -> impl Strategy<Value = Entry> {
        let host = prop_oneof![
            dns_name(1),
            any::<[u8; 4]>().prop_map(|b| Ipv4Addr::from(b).to_string()),
            any::<[u8; 16]>().prop_map(|b| Ipv6Addr::from(b).to_string()),
        ];
        prop_oneof![
            host.clone().prop_map(Entry::Host),
            dns_name(2).prop_map(Entry::Suffix),
            (host, 1..=u16::MAX).prop_map(|(h, p)| Entry::HostPort(h, p)),
        ]
    }

    proptest! {
        #[test]
        fn display_round_trips(e in any_entry()) {
            prop_assert_eq!(e.to_string().parse::<Entry>(), Ok(e));
        }

        #[test]
        fn parsing_is_idempotent(s in "[a-zA-Z0-9.:\\[\\]-]{0,30}") {
            if let Ok(e) = s.parse::<Entry>() {
                prop_assert_eq!(e.to_string().parse::<Entry>(), Ok(e));
            }
        }

        #[test]
        fn suffix_matches_only_on_label_boundaries(
            suffix in dns_name(2),
            head in "[a-z0-9-]{1,8}",
            sub in label(),
        ) {
            let list = Allowlist::new(false, &[], &[Entry::Suffix(suffix.clone())]);
            let sub_host = format!("{sub}.{suffix}");
            prop_assert!(list.decide(&suffix, 443).is_allow());
            prop_assert!(list.decide(&sub_host, 443).is_allow());
            // Glued on without a dot: a different registrable name.
            let glued = format!("{head}{suffix}");
            prop_assert!(!list.decide(&glued, 443).is_allow());
            // The suffix with its first label dropped is a parent, not a match.
            if let Some((_, parent)) = suffix.split_once('.') {
                prop_assert!(!list.decide(parent, 443).is_allow());
            }
        }

        #[test]
        fn host_matches_exactly(host in dns_name(1), other in dns_name(1), port in 1..=u16::MAX) {
            let list = Allowlist::new(false, &[], &[Entry::Host(host.clone())]);
            prop_assert_eq!(list.decide(&host, port).is_allow(), port == 80 || port == 443);
            if other != host {
                prop_assert!(!list.decide(&other, 443).is_allow());
            }
            let sub_host = format!("x.{host}");
            prop_assert!(!list.decide(&sub_host, 443).is_allow());
        }
    }
}
