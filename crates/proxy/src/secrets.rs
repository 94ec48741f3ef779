//! Brokered secrets: operator declarations, the placeholder a run sees, and
//! the header rewrite the proxy applies on the way out. Pure apart from
//! reading the daemon's environment in [`Secret::load`].
//!
//! A run never holds a secret's value. It holds a placeholder,
//! `runbox-secret:NAME`, and the proxy swaps in the value on requests that
//! the operator's policy admits: the right host, method and path. Everything
//! here fails closed: a declaration without methods or paths never applies,
//! an ambiguous path (dot segments, doubled or encoded slashes) never
//! carries a value, and a placeholder whose policy does not match goes out
//! unchanged, so the upstream sees the placeholder, never the value.
//!
//! This module does not decide whether a request may leave at all (see
//! `policy` and `guard`) and does not terminate TLS (see `tls`).

use std::fmt;

use http::header::{HeaderName, HeaderValue};

use crate::policy::{normalize_host, Entry};

/// An operator's declaration (from the daemon's config file).
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SecretSpec {
    /// The name runs ask for; also the placeholder's variable name.
    pub name: String,
    /// The header that carries it, e.g. `Authorization`.
    pub header: String,
    /// Written before the value with one space, e.g. `Bearer`.
    #[serde(default)]
    pub scheme: Option<String>,
    /// The daemon environment variable holding the value.
    #[serde(alias = "value_env")]
    pub value_env: String,
    /// Hosts (allowlist grammar without ports: `host` or `.suffix`) whose
    /// requests may carry it.
    pub hosts: Vec<String>,
    /// Methods that may carry it; empty means none (fail closed).
    #[serde(default)]
    pub methods: Vec<String>,
    /// Path prefixes that may carry it; empty means none (fail closed).
    #[serde(default, alias = "path_prefixes")]
    pub path_prefixes: Vec<String>,
}

/// Why a declaration or its value is unusable.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("secret {name:?}: {reason}")]
pub struct SecretError {
    /// The secret's name.
    pub name: String,
    /// What is wrong.
    pub reason: String,
}

/// A loaded secret. `Debug` never prints the value.
#[derive(Clone)]
pub struct Secret {
    /// The name, as validated.
    name: String,
    /// The header that carries the value.
    header: HeaderName,
    /// The header value written when the run sent no such header:
    /// `<scheme> <value>` or the value alone. Marked sensitive.
    full: HeaderValue,
    /// The bare value, swapped in for the placeholder.
    value: Vec<u8>,
    /// `runbox-secret:NAME`.
    placeholder: Vec<u8>,
    /// `host` or `.suffix` entries, never with a port.
    hosts: Vec<Entry>,
    /// Methods that may carry the value; empty means none.
    methods: Vec<http::Method>,
    /// Path prefixes that may carry the value; empty means none.
    path_prefixes: Vec<String>,
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let hosts: Vec<String> = self.hosts.iter().map(Entry::to_string).collect();
        f.debug_struct("Secret")
            .field("name", &self.name)
            .field("hosts", &hosts)
            .finish_non_exhaustive()
    }
}

/// Headers the proxy itself sets or that frame the message; a secret
/// written into one of them would corrupt the request or the connection.
const CONTROLLED_HEADERS: &[&str] = &[
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "te",
    "trailer",
    "upgrade",
    "keep-alive",
];

/// Whether `s` is a non-empty HTTP token (RFC 9110 `tchar`s).
fn is_token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// Whether `name` matches `[A-Z_][A-Z0-9_]{0,63}`.
fn is_valid_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    let first_ok = bytes
        .next()
        .is_some_and(|b| b.is_ascii_uppercase() || b == b'_');
    first_ok
        && name.len() <= 64
        && bytes.all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
}

/// A secret's policy, without its value: what an operator declares beside
/// `valueEnv`, and what a caller brings beside `value`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SecretPolicy {
    /// The name the run sees the placeholder under.
    pub name: String,
    /// The header that carries the value.
    pub header: String,
    /// Written before the value with one space.
    pub scheme: Option<String>,
    /// `host` or `.suffix` entries, no ports.
    pub hosts: Vec<String>,
    /// Methods that may carry the value; empty means none.
    pub methods: Vec<String>,
    /// Path prefixes that may carry the value; empty means none.
    pub path_prefixes: Vec<String>,
}

impl SecretPolicy {
    /// Checks the policy and brings it into canonical form: hosts as the
    /// allowlist writes them, methods in upper case. The error is the
    /// reason only.
    pub fn canonical(&self) -> Result<SecretPolicy, String> {
        let checked = check_policy(self)?;
        Ok(SecretPolicy {
            name: self.name.clone(),
            header: self.header.clone(),
            scheme: self.scheme.clone(),
            hosts: checked.hosts.iter().map(Entry::to_string).collect(),
            methods: checked
                .methods
                .iter()
                .map(|m| m.as_str().to_owned())
                .collect(),
            path_prefixes: self.path_prefixes.clone(),
        })
    }
}

/// The longest header name a secret may name (real ones are far shorter).
const MAX_HEADER_NAME: usize = 128;

/// The longest scheme a secret's value may be sent with (`Bearer`, `token`).
const MAX_SCHEME: usize = 64;

/// A policy's parsed parts.
struct CheckedPolicy {
    header: HeaderName,
    hosts: Vec<Entry>,
    methods: Vec<http::Method>,
}

/// Checks everything of a policy but its value; the error is the reason.
fn check_policy(spec: &SecretPolicy) -> Result<CheckedPolicy, String> {
    if !is_valid_name(&spec.name) {
        return Err(
            "the name becomes an environment variable: use 1-64 characters of A-Z, 0-9 and _, \
             not starting with a digit, e.g. GITHUB_TOKEN"
                .into(),
        );
    }

    if spec.header.len() > MAX_HEADER_NAME {
        return Err(format!(
            "the header name is {} bytes long; at most {MAX_HEADER_NAME} are allowed",
            spec.header.len()
        ));
    }
    // An RFC 9110 token (`http` refuses anything else).
    let header = HeaderName::from_bytes(spec.header.as_bytes()).map_err(|_| {
        format!(
            "header {:?} is not a valid HTTP header name; write e.g. Authorization",
            spec.header
        )
    })?;
    if CONTROLLED_HEADERS.contains(&header.as_str()) || header.as_str().starts_with("proxy-") {
        return Err(format!(
            "header {:?} is managed by the proxy and cannot carry a secret; use e.g. Authorization",
            spec.header
        ));
    }

    if let Some(scheme) = &spec.scheme {
        if scheme.len() > MAX_SCHEME {
            return Err(format!(
                "the scheme is {} bytes long; at most {MAX_SCHEME} are allowed",
                scheme.len()
            ));
        }
        if !is_token(scheme) {
            return Err(format!(
                "scheme {scheme:?} must be a single word without spaces, e.g. Bearer; \
                 leave it out to send the value alone"
            ));
        }
    }

    if spec.hosts.is_empty() {
        return Err(
            "no hosts; list the hosts that may receive it, e.g. api.github.com or .example.com"
                .into(),
        );
    }
    let mut hosts = Vec::with_capacity(spec.hosts.len());
    for h in &spec.hosts {
        match h.parse::<Entry>() {
            Ok(e @ (Entry::Host(_) | Entry::Suffix(_) | Entry::Subdomains(_))) => {
                if !hosts.contains(&e) {
                    hosts.push(e)
                }
            }
            Ok(Entry::HostPort(..)) => {
                return Err(format!(
                    "host {h:?} has a port; secret hosts take no port, write the host alone"
                ))
            }
            Ok(Entry::Cidr(_)) => {
                return Err(format!(
                    "host {h:?} is a network; a secret goes only to names whose certificate the \
                     proxy verifies, write a host such as api.example.com"
                ))
            }
            Err(e) => return Err(format!("host {h:?}: {}", e.reason)),
        }
    }

    let mut methods = Vec::with_capacity(spec.methods.len());
    for m in &spec.methods {
        let upper = m.to_ascii_uppercase();
        let method = is_token(&upper)
            .then(|| http::Method::from_bytes(upper.as_bytes()).ok())
            .flatten()
            .ok_or_else(|| format!("method {m:?} is not an HTTP method; write e.g. GET or POST"))?;
        if !methods.contains(&method) {
            methods.push(method);
        }
    }

    for p in &spec.path_prefixes {
        if !p.starts_with('/') {
            return Err(format!("path prefix {p:?} must start with /, e.g. /repos/"));
        }
        if p.bytes()
            .any(|b| b.is_ascii_whitespace() || b.is_ascii_control() || b == b'?' || b == b'#')
        {
            return Err(format!(
                "path prefix {p:?} must be a plain path without spaces, `?` or `#`"
            ));
        }
        if path_is_ambiguous(p) {
            return Err(format!(
                "path prefix {p:?} has a dot segment, a doubled slash, a backslash or an encoded \
                 `/`, `\\` or `.`, which no request carrying a secret may have; write the plain \
                 path, e.g. /repos/"
            ));
        }
    }
    Ok(CheckedPolicy {
        header,
        hosts,
        methods,
    })
}

impl Secret {
    /// Validates `spec` and reads its value through `env` (the daemon's
    /// environment in production). A missing or empty value is an error.
    pub fn load(
        spec: SecretSpec,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Secret, SecretError> {
        let var = spec.value_env.clone();
        let policy = SecretPolicy {
            name: spec.name,
            header: spec.header,
            scheme: spec.scheme,
            hosts: spec.hosts,
            methods: spec.methods,
            path_prefixes: spec.path_prefixes,
        };
        let fail = |reason: String| SecretError {
            name: policy.name.clone(),
            reason,
        };
        check_policy(&policy).map_err(fail)?;
        if var.is_empty() {
            return Err(fail(
                "valueEnv is empty; name the daemon environment variable that holds the value"
                    .into(),
            ));
        }
        // From here on, messages name the variable and never the value.
        let value = match env(&var) {
            None => {
                return Err(fail(format!(
                    "environment variable {var} is not set in the daemon's environment"
                )))
            }
            Some(v) => v,
        };
        Secret::new(policy, &value, &format!("environment variable {var}"))
    }

    /// A secret from its policy and value; `origin` names where the value
    /// came from in errors (which never show the value itself).
    pub fn new(policy: SecretPolicy, value: &str, origin: &str) -> Result<Secret, SecretError> {
        let fail = |reason: String| SecretError {
            name: policy.name.clone(),
            reason,
        };
        let checked = check_policy(&policy).map_err(fail)?;
        if value.is_empty() {
            return Err(fail(format!("{origin} is empty")));
        }
        // No control character at all (RFC 9110 allows a tab inside a
        // field value; no credential holds one, and a tab or DEL is more
        // likely a paste gone wrong than part of the secret).
        if let Some(c) = value.chars().find(|c| c.is_control()) {
            return Err(fail(format!(
                "{origin} contains the control character {c:?}, which cannot go in a header"
            )));
        }
        let text = match &policy.scheme {
            Some(scheme) => format!("{scheme} {value}"),
            None => value.to_owned(),
        };
        let mut full = HeaderValue::from_str(&text).map_err(|_| {
            fail(format!(
                "{origin} contains characters not allowed in an HTTP header"
            ))
        })?;
        full.set_sensitive(true);

        Ok(Secret {
            placeholder: placeholder(&policy.name).into_bytes(),
            name: policy.name,
            header: checked.header,
            full,
            value: value.as_bytes().to_vec(),
            hosts: checked.hosts,
            methods: checked.methods,
            path_prefixes: policy.path_prefixes,
        })
    }

    /// The secret's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The header that carries the value.
    pub fn header(&self) -> &HeaderName {
        &self.header
    }

    /// Whether `host` is one of the secret's hosts (interception is decided
    /// by this alone).
    pub fn covers_host(&self, host: &str) -> bool {
        let host = normalize_host(host);
        self.hosts.iter().any(|e| e.matches_name(&host))
    }

    /// Whether a request with this method and path may carry the value
    /// (the host is checked separately by [`Secret::covers_host`]).
    fn admits(&self, method: &http::Method, path: &str) -> bool {
        self.methods.contains(method)
            && !path_is_ambiguous(path)
            && self
                .path_prefixes
                .iter()
                .any(|prefix| prefix_matches(prefix, path))
    }

    /// Replaces every placeholder occurrence in `bytes`, or `None` when
    /// there is none.
    fn replace_placeholder(&self, bytes: &[u8]) -> Option<Vec<u8>> {
        let needle = self.placeholder.as_slice();
        let mut out = Vec::with_capacity(bytes.len() + self.value.len());
        let mut found = false;
        let mut i = 0;
        while i < bytes.len() {
            let rest = &bytes[i..];
            // `runbox-secret:TOKEN` is also the start of
            // `runbox-secret:TOKEN_2`; only a whole name is this secret's.
            let whole = rest.starts_with(needle)
                && rest
                    .get(needle.len())
                    .is_none_or(|b| !(b.is_ascii_alphanumeric() || *b == b'_'));
            if whole {
                out.extend_from_slice(&self.value);
                i += needle.len();
                found = true;
            } else {
                out.push(bytes[i]);
                i += 1;
            }
        }
        found.then_some(out)
    }
}

/// Whether `path` is under `prefix` on a segment boundary: `/v1` covers
/// `/v1`, `/v1/x` and `/v1?q`, never `/v10`.
fn prefix_matches(prefix: &str, path: &str) -> bool {
    path.strip_prefix(prefix).is_some_and(|rest| {
        rest.is_empty() || prefix.ends_with('/') || rest.starts_with('/') || rest.starts_with('?')
    })
}

/// Whether the path part (before `?`) could mean something other than what
/// a plain prefix comparison sees: dot segments, doubled slashes,
/// backslashes, a fragment, or a percent-encoded `/`, `\` or `.`. Upstreams
/// normalise such paths in different ways, so no secret rides on them.
fn path_is_ambiguous(path: &str) -> bool {
    let path_part = path.split_once('?').map_or(path, |(p, _)| p);
    if path_part.contains("//") || path_part.contains(['\\', '#']) {
        return true;
    }
    let lower = path_part.to_ascii_lowercase();
    if ["%2f", "%5c", "%2e"].iter().any(|enc| lower.contains(enc)) {
        return true;
    }
    path_part.split('/').any(|seg| seg == "." || seg == "..")
}

/// The placeholder a run sees in its environment: `runbox-secret:NAME`.
pub fn placeholder(name: &str) -> String {
    format!("runbox-secret:{name}")
}

/// Applies `secrets` to one outgoing request to `host`: for each secret whose
/// host, method and path policy all match, replaces its placeholder in its
/// header (or writes the header when absent). A placeholder of a secret whose
/// policy does not match is left as it is: the upstream sees the placeholder,
/// never the value. Returns the names of the secrets injected.
pub fn inject(
    secrets: &[std::sync::Arc<Secret>],
    host: &str,
    method: &http::Method,
    path: &str,
    headers: &mut http::HeaderMap,
) -> Vec<String> {
    let mut injected = Vec::new();
    for secret in secrets {
        if !(secret.covers_host(host) && secret.admits(method, path)) {
            continue;
        }
        let current: Vec<HeaderValue> = headers.get_all(&secret.header).iter().cloned().collect();
        if current.is_empty() {
            headers.insert(secret.header.clone(), secret.full.clone());
            injected.push(secret.name.clone());
            continue;
        }
        // The run set the header itself: fill in the placeholder where it
        // asked for it, and leave a header without one alone.
        let mut replaced = false;
        let rewritten: Vec<HeaderValue> = current
            .into_iter()
            .map(|v| {
                let Some(bytes) = secret.replace_placeholder(v.as_bytes()) else {
                    return v;
                };
                match HeaderValue::from_bytes(&bytes) {
                    Ok(mut new) => {
                        new.set_sensitive(true);
                        replaced = true;
                        new
                    }
                    // Unreachable for a value `load` accepted; keeping the
                    // placeholder is the safe outcome either way.
                    Err(_) => v,
                }
            })
            .collect();
        if replaced {
            headers.remove(&secret.header);
            for v in rewritten {
                headers.append(secret.header.clone(), v);
            }
            injected.push(secret.name.clone());
        }
    }
    injected
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderMap, Method};
    use proptest::prelude::*;
    use std::sync::Arc;

    const VALUE: &str = "s3cr3t-VALUE-42";

    fn spec() -> SecretSpec {
        SecretSpec {
            name: "GH_TOKEN".into(),
            header: "Authorization".into(),
            scheme: Some("Bearer".into()),
            value_env: "RUNBOX_GH_TOKEN".into(),
            hosts: vec!["api.github.com".into(), ".githubusercontent.com".into()],
            methods: vec!["get".into(), "POST".into()],
            path_prefixes: vec!["/repos/".into(), "/user".into()],
        }
    }

    fn env(var: &str) -> Option<String> {
        (var == "RUNBOX_GH_TOKEN").then(|| VALUE.to_string())
    }

    fn load(spec: SecretSpec) -> Result<Secret, SecretError> {
        Secret::load(spec, env)
    }

    fn secret() -> Arc<Secret> {
        Arc::new(load(spec()).unwrap())
    }

    fn reason(spec: SecretSpec) -> String {
        load(spec).unwrap_err().reason
    }

    fn run(
        secrets: &[Arc<Secret>],
        host: &str,
        method: Method,
        path: &str,
        headers: &mut HeaderMap,
    ) -> Vec<String> {
        inject(secrets, host, &method, path, headers)
    }

    fn auth(headers: &HeaderMap) -> Vec<&[u8]> {
        headers
            .get_all("authorization")
            .iter()
            .map(HeaderValue::as_bytes)
            .collect()
    }

    #[test]
    fn loads_a_valid_spec() {
        let s = load(spec()).unwrap();
        assert_eq!(s.name(), "GH_TOKEN");
        assert_eq!(s.header(), "authorization");
        assert_eq!(s.methods, vec![Method::GET, Method::POST]);
    }

    #[test]
    fn spec_deserialises_from_camel_and_snake_case() {
        let camel: SecretSpec = serde_json::from_str(
            r#"{"name":"A","header":"X-Key","valueEnv":"V","hosts":["a.example"],"methods":["GET"],"pathPrefixes":["/"]}"#,
        )
        .unwrap();
        let snake: SecretSpec = serde_json::from_str(
            r#"{"name":"A","header":"X-Key","value_env":"V","hosts":["a.example"],"methods":["GET"],"path_prefixes":["/"]}"#,
        )
        .unwrap();
        assert_eq!(camel, snake);
        assert!(serde_json::from_str::<SecretSpec>(
            r#"{"name":"A","header":"X-Key","valueEnv":"V","hosts":[],"extra":1}"#
        )
        .is_err());
    }

    #[test]
    fn refuses_bad_names() {
        for name in [
            "",
            "gh_token",
            "1TOKEN",
            "GH-TOKEN",
            "TOKEN ",
            &"A".repeat(65),
        ] {
            let mut s = spec();
            s.name = name.to_string();
            assert!(reason(s).contains("environment variable"), "{name:?}");
        }
        let mut s = spec();
        s.name = format!("_{}", "A".repeat(63));
        assert!(load(s).is_ok());
    }

    #[test]
    fn refuses_bad_or_controlled_headers() {
        for header in ["", "Auth orization", "X:Key", "Authorization\n"] {
            let mut s = spec();
            s.header = header.into();
            assert!(
                reason(s).contains("not a valid HTTP header name"),
                "{header:?}"
            );
        }
        for header in [
            "Host",
            "Content-Length",
            "transfer-encoding",
            "Connection",
            "Proxy-Authorization",
            "TE",
            "Trailer",
            "Upgrade",
            "Keep-Alive",
        ] {
            let mut s = spec();
            s.header = header.into();
            assert!(reason(s).contains("managed by the proxy"), "{header:?}");
        }
        // A token, but no header anyone sends: bounded.
        let mut s = spec();
        s.header = "X".repeat(10_000);
        assert!(reason(s).contains("at most 128"));
        let mut s = spec();
        s.scheme = Some("B".repeat(65));
        assert!(reason(s).contains("at most 64"));
    }

    #[test]
    fn refuses_bad_scheme_env_hosts_methods_paths() {
        let mut s = spec();
        s.scheme = Some("Bearer token".into());
        assert!(reason(s).contains("single word"));
        let mut s = spec();
        s.scheme = Some(String::new());
        assert!(reason(s).contains("single word"));
        let mut s = spec();
        s.value_env = String::new();
        assert!(reason(s).contains("valueEnv is empty"));
        let mut s = spec();
        s.hosts = vec![];
        assert!(reason(s).contains("no hosts"));
        let mut s = spec();
        s.hosts = vec!["api.github.com:443".into()];
        assert!(reason(s).contains("has a port"));
        let mut s = spec();
        s.hosts = vec!["https://api.github.com".into()];
        assert!(reason(s).contains("write the host only"));
        let mut s = spec();
        s.methods = vec!["GE T".into()];
        assert!(reason(s).contains("not an HTTP method"));
        let mut s = spec();
        s.path_prefixes = vec!["repos/".into()];
        assert!(reason(s).contains("must start with /"));
        let mut s = spec();
        s.path_prefixes = vec!["/repos?x".into()];
        assert!(reason(s).contains("without spaces"));
    }

    #[test]
    fn value_errors_name_the_variable_never_the_value() {
        let missing = Secret::load(spec(), |_| None).unwrap_err();
        assert!(missing.reason.contains("RUNBOX_GH_TOKEN is not set"));
        let empty = Secret::load(spec(), |_| Some(String::new())).unwrap_err();
        assert!(empty.reason.contains("RUNBOX_GH_TOKEN is empty"));
        // Every control character, a tab and DEL included.
        for bad in [
            "abc\r\nX-Evil: 1",
            "abc\n",
            "a\0b",
            "abc\tdef",
            "abc\x7f",
            "a\x01b",
            "ab\u{85}c",
        ] {
            let err = Secret::load(spec(), |_| Some(bad.to_string())).unwrap_err();
            assert!(err.reason.contains("control character"), "{bad:?}: {err}");
            assert!(!err.to_string().contains("abc"), "{err}");
        }
    }

    fn policy() -> SecretPolicy {
        let s = spec();
        SecretPolicy {
            name: s.name,
            header: s.header,
            scheme: s.scheme,
            hosts: s.hosts,
            methods: s.methods,
            path_prefixes: s.path_prefixes,
        }
    }

    #[test]
    fn a_policy_with_its_value_given_is_checked_the_same_way() {
        let secret = Secret::new(policy(), VALUE, "the value").unwrap();
        assert_eq!(secret.name(), "GH_TOKEN");
        let err = Secret::new(policy(), "a\nb", "the value").unwrap_err();
        assert!(
            err.reason
                .starts_with("the value contains the control character"),
            "{err}"
        );
        assert!(Secret::new(policy(), "", "the value")
            .unwrap_err()
            .reason
            .contains("is empty"));
        let canonical = SecretPolicy {
            hosts: vec!["API.GitHub.com.".into(), "api.github.com".into()],
            methods: vec!["get".into(), "GET".into(), "post".into()],
            ..policy()
        }
        .canonical()
        .unwrap();
        assert_eq!(canonical.hosts, ["api.github.com"]);
        assert_eq!(canonical.methods, ["GET", "POST"]);
        for prefix in ["/a/../b", "/a//b", "/a\\b", "/a%2Fb", "/%2e%2e/x", "/./x"] {
            let bad = SecretPolicy {
                path_prefixes: vec![prefix.into()],
                ..policy()
            };
            let err = bad.canonical().unwrap_err();
            assert!(err.contains("dot segment"), "{prefix}: {err}");
        }
    }

    #[test]
    fn debug_never_prints_the_value() {
        let s = secret();
        let shown = format!("{s:?} {s:#?}");
        assert!(shown.contains("GH_TOKEN"));
        assert!(shown.contains("api.github.com"));
        assert!(!shown.contains(VALUE));
        let mut headers = HeaderMap::new();
        run(&[s], "api.github.com", Method::GET, "/user", &mut headers);
        assert!(!format!("{headers:?}").contains(VALUE));
    }

    #[test]
    fn covers_hosts_exactly_and_by_suffix() {
        let s = secret();
        for host in [
            "api.github.com",
            "API.GitHub.com.",
            "githubusercontent.com",
            "raw.githubusercontent.com",
        ] {
            assert!(s.covers_host(host), "{host}");
        }
        for host in [
            "github.com",
            "x.api.github.com",
            "evilgithubusercontent.com",
            "api.github.com.evil",
        ] {
            assert!(!s.covers_host(host), "{host}");
        }
    }

    #[test]
    fn writes_an_absent_header_with_its_scheme() {
        let mut headers = HeaderMap::new();
        let names = run(
            &[secret()],
            "api.github.com",
            Method::GET,
            "/repos/a/b",
            &mut headers,
        );
        assert_eq!(names, vec!["GH_TOKEN"]);
        let value = headers.get("authorization").unwrap();
        assert_eq!(value.as_bytes(), format!("Bearer {VALUE}").as_bytes());
        assert!(value.is_sensitive());

        let mut bare = spec();
        bare.scheme = None;
        let mut headers = HeaderMap::new();
        run(
            &[Arc::new(load(bare).unwrap())],
            "api.github.com",
            Method::GET,
            "/user",
            &mut headers,
        );
        assert_eq!(
            headers.get("authorization").unwrap().as_bytes(),
            VALUE.as_bytes()
        );
    }

    #[test]
    fn replaces_placeholders_in_every_value() {
        let mut headers = HeaderMap::new();
        headers.append(
            "authorization",
            HeaderValue::from_static("token runbox-secret:GH_TOKEN"),
        );
        headers.append(
            "authorization",
            HeaderValue::from_static("x runbox-secret:GH_TOKEN,runbox-secret:GH_TOKEN"),
        );
        headers.append("authorization", HeaderValue::from_static("Basic other"));
        let names = run(
            &[secret()],
            "api.github.com",
            Method::POST,
            "/repos/",
            &mut headers,
        );
        assert_eq!(names, vec!["GH_TOKEN"]);
        let want = [
            format!("token {VALUE}"),
            format!("x {VALUE},{VALUE}"),
            "Basic other".to_string(),
        ];
        let got: Vec<&[u8]> = auth(&headers);
        assert_eq!(got, want.iter().map(|s| s.as_bytes()).collect::<Vec<_>>());
        let values: Vec<&HeaderValue> = headers.get_all("authorization").iter().collect();
        assert!(values[0].is_sensitive() && values[1].is_sensitive());
    }

    #[test]
    fn placeholder_matches_whole_names_only() {
        let mut headers = HeaderMap::new();
        headers.insert(
            "authorization",
            HeaderValue::from_static("runbox-secret:GH_TOKEN_2 runbox-secret:GH_TOKENx"),
        );
        let names = run(
            &[secret()],
            "api.github.com",
            Method::GET,
            "/user",
            &mut headers,
        );
        assert!(names.is_empty());
        assert_eq!(
            auth(&headers),
            vec![b"runbox-secret:GH_TOKEN_2 runbox-secret:GH_TOKENx".as_slice()]
        );
    }

    #[test]
    fn leaves_a_header_the_run_set_itself() {
        let mut headers = HeaderMap::new();
        headers.insert("authorization", HeaderValue::from_static("Bearer mine"));
        let names = run(
            &[secret()],
            "api.github.com",
            Method::GET,
            "/user",
            &mut headers,
        );
        assert!(names.is_empty());
        assert_eq!(auth(&headers), vec![b"Bearer mine".as_slice()]);
    }

    #[test]
    fn placeholder_stays_when_policy_does_not_match() {
        let cases = [
            ("github.com", Method::GET, "/user"),
            ("api.github.com", Method::DELETE, "/user"),
            ("api.github.com", Method::GET, "/orgs/x"),
            ("api.github.com", Method::GET, "/users"),
            ("api.github.com", Method::GET, "/repos/../admin"),
        ];
        for (host, method, path) in cases {
            let mut headers = HeaderMap::new();
            headers.insert(
                "authorization",
                HeaderValue::from_static("Bearer runbox-secret:GH_TOKEN"),
            );
            let names = run(&[secret()], host, method.clone(), path, &mut headers);
            assert!(names.is_empty(), "{host} {method} {path}");
            assert_eq!(
                auth(&headers),
                vec![b"Bearer runbox-secret:GH_TOKEN".as_slice()]
            );
        }
    }

    #[test]
    fn empty_methods_or_prefixes_never_apply() {
        for strip_methods in [true, false] {
            let mut s = spec();
            if strip_methods {
                s.methods.clear();
            } else {
                s.path_prefixes.clear();
            }
            let s = Arc::new(load(s).unwrap());
            let mut headers = HeaderMap::new();
            assert!(run(&[s], "api.github.com", Method::GET, "/user", &mut headers).is_empty());
            assert!(headers.is_empty());
        }
    }

    #[test]
    fn prefixes_match_on_segment_boundaries() {
        assert!(prefix_matches("/user", "/user"));
        assert!(prefix_matches("/user", "/user/emails"));
        assert!(prefix_matches("/user", "/user?page=2"));
        assert!(!prefix_matches("/user", "/users"));
        assert!(!prefix_matches("/user", "/use"));
        assert!(prefix_matches("/repos/", "/repos/a/b"));
        assert!(prefix_matches("/repos/", "/repos/"));
        assert!(!prefix_matches("/repos/", "/repos"));
        assert!(prefix_matches("/", "/anything"));
    }

    #[test]
    fn ambiguous_paths_never_carry_a_secret() {
        for path in [
            "/repos/../admin",
            "/repos/./a",
            "/repos/a/..",
            "/repos//a",
            "/repos/a\\b",
            "/repos/a%2fb",
            "/repos/a%2Fb",
            "/repos/a%5cb",
            "/repos/%2e%2e/admin",
            "/repos/%2E/a",
            "/repos/a#frag",
        ] {
            assert!(path_is_ambiguous(path), "{path}");
            let mut headers = HeaderMap::new();
            assert!(run(
                &[secret()],
                "api.github.com",
                Method::GET,
                path,
                &mut headers
            )
            .is_empty());
        }
        for path in [
            "/repos/a/b",
            "/repos/a.b/..c",
            "/repos/a?x=../..",
            "/user?u=a//b",
        ] {
            assert!(!path_is_ambiguous(path), "{path}");
        }
    }

    #[test]
    fn several_secrets_apply_independently() {
        let mut other = spec();
        other.name = "NPM".into();
        other.header = "X-Npm-Key".into();
        other.scheme = None;
        other.hosts = vec!["registry.npmjs.org".into()];
        let secrets = [secret(), Arc::new(load(other).unwrap())];
        let mut headers = HeaderMap::new();
        headers.insert("x-npm-key", HeaderValue::from_static("runbox-secret:NPM"));
        let names = run(
            &secrets,
            "api.github.com",
            Method::GET,
            "/user",
            &mut headers,
        );
        assert_eq!(names, vec!["GH_TOKEN"]);
        assert_eq!(headers.get("x-npm-key").unwrap(), "runbox-secret:NPM");
    }

    proptest! {
        #[test]
        fn value_only_leaves_when_host_method_and_path_match(
            host in prop::sample::select(vec![
                "api.github.com", "API.GITHUB.COM.", "raw.githubusercontent.com", "githubusercontent.com",
                "github.com", "evilgithubusercontent.com", "api.github.com.evil.org", "example.org",
            ]),
            method in prop::sample::select(vec![
                Method::GET, Method::POST, Method::PUT, Method::DELETE, Method::HEAD, Method::PATCH,
            ]),
            head in prop::sample::select(vec!["/repos", "/repos/", "/user", "/users", "/", "", "/orgs", "/REPOS/"]),
            tail in prop::sample::select(vec![
                "", "/", "a", "/a/b", "?q=1", "/../x", "/./x", "//x", "\\x", "/%2e%2e/x", "/a%2Fb", "#x", "/a?b=../c",
            ]),
            existing in prop::sample::select(vec![
                None, Some("Bearer runbox-secret:GH_TOKEN"), Some("runbox-secret:GH_TOKEN_X"), Some("Bearer mine"),
            ]),
        ) {
            let path = format!("{head}{tail}");
            let mut headers = HeaderMap::new();
            if let Some(v) = existing {
                headers.insert("authorization", HeaderValue::from_static(v));
            }
            // The run may also put the placeholder elsewhere; it must stay there.
            headers.insert("x-other", HeaderValue::from_static("runbox-secret:GH_TOKEN"));
            let s = secret();
            let names = inject(std::slice::from_ref(&s), host, &method, &path, &mut headers);

            let host_ok = s.covers_host(host);
            let method_ok = method == Method::GET || method == Method::POST;
            let path_part = path.split('?').next().unwrap_or("");
            let path_ok = (path == "/user"
                || path.starts_with("/user/")
                || path.starts_with("/user?")
                || path.starts_with("/repos/"))
                && !path_part.contains("..")
                && !path_part.contains("/./")
                && !path_part.contains("//")
                && !path_part.contains('\\')
                && !path_part.contains('#')
                && !path_part.to_ascii_lowercase().contains("%2");
            let all_match = host_ok && method_ok && path_ok;

            let leaked = headers
                .iter()
                .any(|(_, v)| v.as_bytes().windows(VALUE.len()).any(|w| w == VALUE.as_bytes()));
            prop_assert_eq!(leaked, !names.is_empty());
            if leaked {
                prop_assert!(all_match);
            }
            let header_takes_it = matches!(existing, None | Some("Bearer runbox-secret:GH_TOKEN"));
            prop_assert_eq!(!names.is_empty(), all_match && header_takes_it);
            prop_assert_eq!(headers.get("x-other").unwrap(), "runbox-secret:GH_TOKEN");
        }
    }
}
