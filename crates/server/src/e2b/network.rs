//! E2B's egress settings — `network.allowOut`, `denyOut` and `rules` and
//! `allow_internet_access` on a create, the same on `PUT
//! /sandboxes/{id}/network` — in runbox's terms: a tier, allowlist entries
//! and brought secrets. What runbox cannot express is a 400 that says so,
//! never a wider policy than asked for.
//!
//! | E2B | runbox |
//! |---|---|
//! | `denyOut` holds `0.0.0.0/0`, or `allow_internet_access: false` | `allowlist` with `allowOut` (built-in list off), or `none` when nothing is allowed |
//! | `allowOut` IP or CIDR | a rule for that address or network, every port |
//! | `allowOut` `example.com` / `*.example.com` | the same entry (ports 80 and 443) |
//! | `rules: {domain: [{transform: {headers}}]}` | one brought secret per header, on that domain, every method and path |
//! | `egressProxy: {address, username?, password?}` | `egressUpstream: socks5://user:password@address` (an `allowlist` sandbox only; the operator must admit the address) |
//! | nothing denied | `open` (a create without `allow_internet_access` takes the server's default tier) |

use std::str::FromStr;

use runbox_proxy::policy::Entry;
use runbox_types::{
    BroughtSecret, EgressEntry, EgressRule, NetworkTier, PortSpec, SecretRequest, SecretValue,
    UpdateEgressRequest,
};
use serde_json::{Map, Value};

use super::control::E2bError;

/// The methods a header rule is sent on: all of them, as E2B does.
const EVERY_METHOD: &[&str] = &["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"];

/// What an E2B network setting asks of runbox.
#[derive(Debug, PartialEq)]
pub(super) struct Egress {
    /// The tier; None: the server's default (a create that said nothing).
    pub network: Option<NetworkTier>,
    /// Entries (`allowlist` only).
    pub allow: Vec<EgressEntry>,
    /// Header rules as brought secrets (`allowlist` only).
    pub secrets: Vec<SecretRequest>,
    /// `egressProxy` as an upstream URL (`allowlist` only).
    pub upstream: Option<SecretValue>,
}

impl Egress {
    /// The `PATCH .../egress` that puts this in force on a live run.
    pub fn update(self) -> UpdateEgressRequest {
        let network = self.network.unwrap_or(NetworkTier::Open);
        let allowlist = network == NetworkTier::Allowlist;
        UpdateEgressRequest {
            network: Some(network),
            egress_allow: allowlist.then_some(self.allow),
            egress_defaults: allowlist.then_some(false),
            egress_socks5: None,
            // An update replaces the whole setting: no egressProxy, none.
            egress_upstream: allowlist
                .then(|| self.upstream.unwrap_or_else(|| SecretValue::new(""))),
            secrets: allowlist.then_some(self.secrets),
        }
    }
}

/// A list of strings under `key` (either spelling), or empty.
fn strings(network: &Map<String, Value>, key: &str, snake: &str) -> Result<Vec<String>, E2bError> {
    match network.get(key).or_else(|| network.get(snake)) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| E2bError::bad(format!("network.{key} takes strings")))
            })
            .collect(),
        Some(_) => Err(E2bError::bad(format!(
            "network.{key} must be a list of strings"
        ))),
    }
}

/// Whether `entry` is an address or a network, as `denyOut` needs.
fn address_entry(raw: &str) -> Option<Entry> {
    match Entry::from_str(raw) {
        Ok(e @ Entry::Cidr(_)) => Some(e),
        Ok(Entry::Host(h)) if h.parse::<std::net::IpAddr>().is_ok() => Some(Entry::Host(h)),
        _ => None,
    }
}

/// Reads E2B's egress settings: `allow_internet` (create or update) and
/// the keys of `network` it owns. `update` says that a missing setting
/// means no restriction (an update replaces everything), where a create
/// leaves the tier to the server's default.
pub(super) fn egress(
    allow_internet: Option<bool>,
    network: &Map<String, Value>,
    update: bool,
) -> Result<Egress, E2bError> {
    for key in ["maskRequestHost", "mask_request_host"] {
        if !matches!(network.get(key), None | Some(Value::Null)) {
            return Err(E2bError::unsupported(&format!("`network.{key}`")));
        }
    }
    let allow_out = strings(network, "allowOut", "allow_out")?;
    let deny_out = strings(network, "denyOut", "deny_out")?;
    let mut deny_all = allow_internet == Some(false);
    for raw in &deny_out {
        match address_entry(raw) {
            Some(Entry::Cidr(net)) if net.prefix_len() == 0 => deny_all = true,
            Some(_) => {}
            None => {
                return Err(E2bError::bad(format!(
                    "network.denyOut entry {raw:?} is not an IP address or CIDR block (names \
                     cannot be denied)"
                )))
            }
        }
    }
    let mut allow = Vec::with_capacity(allow_out.len());
    for raw in &allow_out {
        let bad = |why: String| E2bError::bad(format!("network.allowOut entry {raw:?}: {why}"));
        let entry = Entry::from_str(raw).map_err(|e| bad(e.reason))?;
        allow.push(match entry {
            // An address or network: every port, as E2B's firewall admits.
            Entry::Cidr(_) => every_port(entry.to_string()),
            Entry::Host(h) if h.parse::<std::net::IpAddr>().is_ok() => every_port(h),
            Entry::Host(_) | Entry::Subdomains(_) => EgressEntry::Text(entry.to_string()),
            Entry::Suffix(_) | Entry::HostPort(..) => {
                return Err(bad(
                    "write a domain (example.com), a wildcard (*.example.com), an IP address or \
                     a CIDR block"
                        .into(),
                ))
            }
        });
    }
    let secrets = header_rules(network, &allow)?;
    let upstream = egress_proxy(network)?;
    if !deny_all {
        if upstream.is_some() {
            return Err(E2bError::bad(
                "network.egressProxy is used by runbox's egress proxy, which a sandbox with open \
                 internet access does not use; deny all traffic (0.0.0.0/0) and list what to \
                 reach in allowOut",
            ));
        }
        if !deny_out.is_empty() {
            return Err(E2bError::bad(
                "network.denyOut without 0.0.0.0/0 would leave the sandbox open except for some \
                 addresses, which runbox cannot enforce; deny all traffic (0.0.0.0/0) and list \
                 what to reach in allowOut",
            ));
        }
        if !secrets.is_empty() {
            return Err(E2bError::bad(
                "network.rules are applied by runbox's egress proxy, which a sandbox with open \
                 internet access does not use; deny all traffic (0.0.0.0/0) and list the rules' \
                 domains in allowOut",
            ));
        }
        let network = match (allow_internet, update) {
            (Some(true), _) | (None, true) => Some(NetworkTier::Open),
            _ => None,
        };
        return Ok(Egress {
            network,
            allow: Vec::new(),
            secrets: Vec::new(),
            upstream: None,
        });
    }
    let network = if allow.is_empty() {
        // Nothing leaves, so there is nothing to tunnel.
        NetworkTier::None
    } else {
        NetworkTier::Allowlist
    };
    Ok(Egress {
        network: Some(network),
        allow,
        secrets,
        upstream,
    })
}

/// `egressProxy: {address, username?, password?}` (a SOCKS5 proxy) as an
/// upstream URL; the server checks the address against what the operator
/// admits. `tls` (TLS to the proxy) is not served.
fn egress_proxy(network: &Map<String, Value>) -> Result<Option<SecretValue>, E2bError> {
    let proxy = match network
        .get("egressProxy")
        .or_else(|| network.get("egress_proxy"))
    {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(proxy)) => proxy,
        Some(_) => {
            return Err(E2bError::bad(
                "network.egressProxy must be an object {address, username?, password?}",
            ))
        }
    };
    let mut address = None;
    let (mut username, mut password) = (None, None);
    for (key, value) in proxy {
        let text = || {
            value
                .as_str()
                .ok_or_else(|| E2bError::bad(format!("network.egressProxy.{key} must be a string")))
        };
        match key.as_str() {
            "address" => address = Some(text()?),
            "username" => username = Some(text()?),
            "password" => password = Some(text()?),
            "tls" if matches!(value, Value::Null | Value::Bool(false)) => {}
            "tls" => return Err(E2bError::unsupported("`network.egressProxy.tls`")),
            other => {
                return Err(E2bError::bad(format!(
                    "network.egressProxy has no field {other:?}; it takes address, username and \
                     password"
                )))
            }
        }
    }
    let Some(address) = address.filter(|a| !a.is_empty()) else {
        return Err(E2bError::bad(
            "network.egressProxy needs an address (host:port)",
        ));
    };
    if address.contains(['/', '@', '?', '#']) || address.chars().any(char::is_whitespace) {
        return Err(E2bError::bad(format!(
            "network.egressProxy.address {address:?} is host:port only"
        )));
    }
    for (name, value) in [("username", username), ("password", password)] {
        if value.is_some_and(|v| v.len() > 255) {
            return Err(E2bError::bad(format!(
                "network.egressProxy.{name} is longer than 255 bytes"
            )));
        }
    }
    if password.is_some() && username.is_none() {
        return Err(E2bError::bad(
            "network.egressProxy.password needs a username",
        ));
    }
    let encode = |s: &str| {
        percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
    };
    let userinfo = match (username, password) {
        (Some(user), Some(pass)) => format!("{}:{}@", encode(user), encode(pass)),
        (Some(user), None) => format!("{}@", encode(user)),
        _ => String::new(),
    };
    Ok(Some(SecretValue::new(format!(
        "socks5://{userinfo}{address}"
    ))))
}

/// `host` on every port.
fn every_port(host: String) -> EgressEntry {
    EgressEntry::Rule(EgressRule {
        host,
        ports: Some(vec![PortSpec::Range("1-65535".into())]),
        ..Default::default()
    })
}

/// `rules: {domain: [{transform: {headers: {name: value}}}]}` as brought
/// secrets, one per header. A rule's domain must be reachable through
/// `allow` (E2B does not allow it by the rule alone).
fn header_rules(
    network: &Map<String, Value>,
    allow: &[EgressEntry],
) -> Result<Vec<SecretRequest>, E2bError> {
    let rules = match network.get("rules") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(rules)) => rules,
        Some(_) => {
            return Err(E2bError::bad(
                "network.rules must be an object: {\"api.example.com\": [{\"transform\": {\"headers\": {…}}}]}",
            ))
        }
    };
    let mut secrets = Vec::new();
    for (domain, list) in rules {
        let bad = |why: &str| E2bError::bad(format!("network.rules[{domain:?}]: {why}"));
        let host = match Entry::from_str(domain) {
            Ok(e @ (Entry::Host(_) | Entry::Subdomains(_))) => e,
            _ => return Err(bad("the key must be a domain such as api.example.com")),
        };
        let name = host.to_string();
        let reachable = allow.iter().any(|a| match a {
            EgressEntry::Text(text) => Entry::from_str(text).is_ok_and(|e| match &host {
                Entry::Host(h) => e.matches_name(h),
                _ => e == host,
            }),
            EgressEntry::Rule(_) => false,
        });
        if !reachable {
            return Err(bad(
                "the domain is not in allowOut; a rule does not allow traffic by itself",
            ));
        }
        let Value::Array(list) = list else {
            return Err(bad("must be a list of rules"));
        };
        for rule in list {
            let transform = match rule.as_object().map(|r| (r.len(), r.get("transform"))) {
                Some((1, Some(Value::Object(t)))) => t,
                _ => return Err(bad("each rule is {\"transform\": {\"headers\": {…}}}")),
            };
            let headers = match transform.get("headers") {
                Some(Value::Object(h)) if transform.len() == 1 => h,
                _ => return Err(bad("a transform takes headers only")),
            };
            for (header, value) in headers {
                let Value::String(value) = value else {
                    return Err(bad("header values must be strings"));
                };
                secrets.push(SecretRequest::Brought(BroughtSecret {
                    name: format!("E2B_RULE_{}", secrets.len() + 1),
                    value: SecretValue::new(value.clone()),
                    hosts: vec![name.clone()],
                    header: header.clone(),
                    scheme: None,
                    methods: Some(EVERY_METHOD.iter().map(|m| m.to_string()).collect()),
                    path_prefixes: Some(vec!["/".into()]),
                }));
            }
        }
    }
    Ok(secrets)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap()
    }

    fn code(result: Result<Egress, E2bError>) -> String {
        format!("{:?}", result.unwrap_err())
    }

    #[test]
    fn deny_all_with_allow_out_is_an_allowlist_without_the_built_in_list() {
        let e = egress(
            None,
            &map(serde_json::json!({"denyOut": ["0.0.0.0/0"],
                "allowOut": ["1.1.1.1", "10.0.0.0/8", "example.com", "*.example.org"]})),
            false,
        )
        .unwrap();
        assert_eq!(e.network, Some(NetworkTier::Allowlist));
        let shown: Vec<String> = e.allow.iter().map(ToString::to_string).collect();
        assert_eq!(
            shown,
            [
                r#"{"host":"1.1.1.1","ports":["1-65535"]}"#,
                r#"{"host":"10.0.0.0/8","ports":["1-65535"]}"#,
                "example.com",
                "*.example.org"
            ]
        );
        let update = e.update();
        assert_eq!(update.egress_defaults, Some(false));
        // Nothing allowed: no network at all.
        let closed = egress(Some(false), &Map::new(), false).unwrap();
        assert_eq!(closed.network, Some(NetworkTier::None));
        let closed = egress(
            None,
            &map(serde_json::json!({"deny_out": ["0.0.0.0/0"]})),
            true,
        );
        assert_eq!(closed.unwrap().network, Some(NetworkTier::None));
    }

    #[test]
    fn nothing_denied_is_open_or_the_default() {
        assert_eq!(egress(None, &Map::new(), false).unwrap().network, None);
        assert_eq!(
            egress(None, &Map::new(), true).unwrap().network,
            Some(NetworkTier::Open)
        );
        let open = egress(
            Some(true),
            &map(serde_json::json!({"allowOut": ["1.1.1.1"]})),
            false,
        );
        assert_eq!(open.unwrap().network, Some(NetworkTier::Open));
    }

    #[test]
    fn header_rules_become_secrets_on_allowed_domains_only() {
        let e = egress(
            None,
            &map(
                serde_json::json!({"denyOut": ["0.0.0.0/0"], "allowOut": ["api.example.com"],
                "rules": {"api.example.com": [{"transform": {"headers": {"X-Key": "v"}}}]}}),
            ),
            false,
        )
        .unwrap();
        let [SecretRequest::Brought(secret)] = &e.secrets[..] else {
            panic!("{:?}", e.secrets)
        };
        assert_eq!(
            (secret.header.as_str(), secret.value.expose()),
            ("X-Key", "v")
        );
        assert_eq!(secret.hosts, ["api.example.com"]);
        let not_allowed = egress(
            None,
            &map(serde_json::json!({"denyOut": ["0.0.0.0/0"],
                "rules": {"api.example.com": [{"transform": {"headers": {"X-Key": "v"}}}]}})),
            false,
        );
        assert!(code(not_allowed).contains("not in allowOut"));
    }

    #[test]
    fn an_egress_proxy_is_a_socks5_upstream_of_an_allowlist_sandbox() {
        let e = egress(
            None,
            &map(
                serde_json::json!({"denyOut": ["0.0.0.0/0"], "allowOut": ["1.1.1.1"],
                "egressProxy": {"address": "proxy.example:1080", "username": "a b",
                                "password": "p@ss:w/rd"}}),
            ),
            false,
        )
        .unwrap();
        let url = e.upstream.clone().unwrap();
        assert_eq!(
            url.expose(),
            "socks5://a%20b:p%40ss%3Aw%2Frd@proxy.example:1080"
        );
        let update = e.update();
        assert_eq!(update.egress_upstream, Some(url));
        // An update without it removes the run's upstream.
        let e = egress(
            None,
            &map(serde_json::json!({"denyOut": ["0.0.0.0/0"], "allowOut": ["1.1.1.1"]})),
            true,
        )
        .unwrap();
        assert_eq!(e.update().egress_upstream, Some(SecretValue::new("")));
        // Deny-all with nothing allowed: nothing leaves, nothing to tunnel.
        let e = egress(
            None,
            &map(serde_json::json!({"denyOut": ["0.0.0.0/0"],
                "egressProxy": {"address": "proxy.example:1080"}})),
            false,
        )
        .unwrap();
        assert_eq!(e.network, Some(NetworkTier::None));
        assert_eq!(e.update().egress_upstream, None);
    }

    #[test]
    fn what_runbox_cannot_enforce_is_refused() {
        for (body, says) in [
            (
                serde_json::json!({"denyOut": ["8.8.8.8"]}),
                "without 0.0.0.0/0",
            ),
            (
                serde_json::json!({"denyOut": ["example.com"]}),
                "names cannot be denied",
            ),
            (
                serde_json::json!({"rules": {"a.example": [{"transform": {"headers": {"K": "v"}}}]},
                                   "allowOut": ["a.example"]}),
                "open internet access",
            ),
            (
                serde_json::json!({"allowOut": [".example.com"]}),
                "write a domain",
            ),
            (
                serde_json::json!({"allowOut": "1.1.1.1"}),
                "list of strings",
            ),
            (
                serde_json::json!({"egressProxy": {"address": "p:1080"}}),
                "open internet access",
            ),
            (
                serde_json::json!({"denyOut": ["0.0.0.0/0"], "allowOut": ["1.1.1.1"],
                                   "egressProxy": {"address": "p:1080", "tls": true}}),
                "egressProxy.tls",
            ),
            (
                serde_json::json!({"denyOut": ["0.0.0.0/0"], "allowOut": ["1.1.1.1"],
                                   "egressProxy": {"address": "p:1080", "password": "pw-k"}}),
                "needs a username",
            ),
            (
                serde_json::json!({"denyOut": ["0.0.0.0/0"], "allowOut": ["1.1.1.1"],
                                   "egressProxy": {"address": "u@p:1080/x"}}),
                "host:port only",
            ),
            (
                serde_json::json!({"denyOut": ["0.0.0.0/0"], "allowOut": ["1.1.1.1"],
                                   "egressProxy": {"address": "p:1080", "user": "u"}}),
                "no field",
            ),
            (
                serde_json::json!({"denyOut": ["0.0.0.0/0"], "allowOut": ["1.1.1.1"],
                                   "egressProxy": "p:1080"}),
                "must be an object",
            ),
            (
                serde_json::json!({"maskRequestHost": "x"}),
                "maskRequestHost",
            ),
        ] {
            let err = code(egress(None, &map(body.clone()), false));
            assert!(err.contains(says), "{body}: {err}");
        }
    }
}
