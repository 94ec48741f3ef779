//! Allowlist rules: an entry together with the ports, methods, secret and
//! interception it comes with — the object form of an `egressAllow` entry
//! (`{host, ports?, methods?, secret?, intercept?}`) beside the string
//! grammar of [`crate::policy::Entry`], which is a rule with nothing but
//! its host. Pure: no I/O.
//!
//! A rule never admits more than its parts say: `ports` replaces the
//! entry's ports (80 and 443), `methods` narrows what may be sent (and so
//! needs the proxy to see requests: a rule with methods intercepts TLS),
//! `secret` names a secret whose own host, method and path policy still
//! decides whether it is sent.

use std::fmt;
use std::str::FromStr;

use http::Method;

use crate::policy::Entry;

/// A rule as written (the daemon's config, a run's `egressAllow`).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RuleSpec {
    /// `host`, `.suffix`, `*.suffix`, an IP address or `prefix/len`; no port.
    pub host: String,
    /// Ports (numbers, or `"lo-hi"` ranges); absent: 80 and 443.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ports: Option<Vec<PortSpec>>,
    /// Methods that may be sent; absent: every method.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub methods: Option<Vec<String>>,
    /// A secret the rule's requests may carry (by its own policy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
    /// Terminate TLS for the rule's hosts, so each request is seen,
    /// checked and audited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub intercept: Option<bool>,
}

/// One item of `ports`: a port or a range.
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(untagged)]
pub enum PortSpec {
    /// One port.
    Port(u32),
    /// `"lo-hi"`, both included.
    Range(String),
}

/// Ports `lo..=hi`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PortRange {
    /// The first port.
    pub lo: u16,
    /// The last port.
    pub hi: u16,
}

impl PortRange {
    fn contains(self, port: u16) -> bool {
        (self.lo..=self.hi).contains(&port)
    }

    fn to_spec(self) -> PortSpec {
        if self.lo == self.hi {
            PortSpec::Port(u32::from(self.lo))
        } else {
            PortSpec::Range(format!("{}-{}", self.lo, self.hi))
        }
    }
}

/// A checked rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    /// What it matches by name or address.
    pub entry: Entry,
    /// Its ports; None: the entry's own (80 and 443, or a `host:port`'s).
    pub ports: Option<Vec<PortRange>>,
    /// Methods that may be sent; empty: every method.
    pub methods: Vec<Method>,
    /// A secret its requests may carry.
    pub secret: Option<String>,
    /// Whether it asked for interception.
    pub intercept: bool,
}

impl From<Entry> for Rule {
    fn from(entry: Entry) -> Rule {
        Rule {
            entry,
            ports: None,
            methods: Vec::new(),
            secret: None,
            intercept: false,
        }
    }
}

/// The longest list of ports or methods one rule may have.
const MAX_LIST: usize = 64;

/// Parses one port or range; the error is the reason.
fn port_range(spec: &PortSpec) -> Result<PortRange, String> {
    let one = |n: u32| -> Result<u16, String> {
        u16::try_from(n)
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| format!("port {n} is out of range; use 1-65535"))
    };
    match spec {
        PortSpec::Port(n) => one(*n).map(|p| PortRange { lo: p, hi: p }),
        PortSpec::Range(text) => {
            let parse = |s: &str| {
                s.parse::<u32>()
                    .map_err(|_| format!("port range {text:?} is not of the form 8000-8999"))
                    .and_then(one)
            };
            let (lo, hi) = text
                .split_once('-')
                .ok_or_else(|| format!("port range {text:?} is not of the form 8000-8999"))?;
            let (lo, hi) = (parse(lo)?, parse(hi)?);
            if lo > hi {
                return Err(format!("port range {text:?} ends before it starts"));
            }
            Ok(PortRange { lo, hi })
        }
    }
}

impl Rule {
    /// Checks `spec`; the error is the reason, naming the field.
    pub fn parse(spec: &RuleSpec) -> Result<Rule, String> {
        let entry = Entry::from_str(&spec.host).map_err(|e| format!("host: {}", e.reason))?;
        if let Entry::HostPort(..) = entry {
            return Err(format!(
                "host {:?} has a port; in a rule, write the host alone and the port in ports",
                spec.host
            ));
        }
        let ports = match &spec.ports {
            None => None,
            Some(list) if list.is_empty() => {
                return Err("ports is empty; list ports, or leave it out for 80 and 443".into())
            }
            Some(list) if list.len() > MAX_LIST => {
                return Err(format!(
                    "ports has {} items; at most {MAX_LIST}",
                    list.len()
                ))
            }
            Some(list) => Some(
                list.iter()
                    .map(port_range)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| format!("ports: {e}"))?,
            ),
        };
        let mut methods = Vec::new();
        for m in spec.methods.iter().flatten() {
            let upper = m.to_ascii_uppercase();
            let method = (!upper.is_empty()
                && upper
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)))
            .then(|| Method::from_bytes(upper.as_bytes()).ok())
            .flatten()
            .ok_or_else(|| format!("methods: {m:?} is not an HTTP method; write e.g. GET"))?;
            if method == Method::CONNECT {
                return Err(
                    "methods: CONNECT is how a tunnel opens, not a request in one; \
                            leave it out"
                        .into(),
                );
            }
            if !methods.contains(&method) {
                methods.push(method);
            }
        }
        if spec.methods.as_ref().is_some_and(|m| m.is_empty()) {
            return Err("methods is empty; list methods, or leave it out for every method".into());
        }
        if methods.len() > MAX_LIST {
            return Err(format!(
                "methods has {} items; at most {MAX_LIST}",
                methods.len()
            ));
        }
        let intercept = spec.intercept.unwrap_or(false);
        if let Entry::Cidr(net) = &entry {
            if !methods.is_empty() || intercept || spec.secret.is_some() {
                return Err(format!(
                    "{net} is a network: methods, secret and intercept need names, whose \
                     certificates the proxy can verify; write a rule per host"
                ));
            }
        }
        Ok(Rule {
            entry,
            ports,
            methods,
            secret: spec.secret.clone(),
            intercept,
        })
    }

    /// Whether the rule is a bare entry (written back as a string).
    pub fn is_plain(&self) -> bool {
        self.ports.is_none() && self.methods.is_empty() && self.secret.is_none() && !self.intercept
    }

    /// Whether the rule admits `port`.
    pub fn admits_port(&self, port: u16) -> bool {
        match &self.ports {
            Some(ranges) => ranges.iter().any(|r| r.contains(port)),
            None => self.entry.default_ports(port),
        }
    }

    /// Whether the rule admits `host:port` by name (an IP literal counts
    /// as a name of itself).
    pub fn matches(&self, host: &str, port: u16) -> bool {
        self.entry.matches_name(host) && self.admits_port(port)
    }

    /// Whether a request with `method` may be sent under this rule.
    pub fn admits_method(&self, method: &Method) -> bool {
        self.methods.is_empty() || self.methods.contains(method)
    }

    /// Whether the proxy must see the rule's requests: it restricts
    /// methods, carries a secret or asked for interception.
    pub fn intercepts(&self) -> bool {
        self.intercept || !self.methods.is_empty() || self.secret.is_some()
    }

    /// The rule as it would be written, canonical.
    pub fn to_spec(&self) -> RuleSpec {
        RuleSpec {
            host: self.entry.to_string(),
            ports: self
                .ports
                .as_ref()
                .map(|r| r.iter().map(|r| r.to_spec()).collect()),
            methods: (!self.methods.is_empty())
                .then(|| self.methods.iter().map(|m| m.as_str().to_owned()).collect()),
            secret: self.secret.clone(),
            intercept: self.intercept.then_some(true),
        }
    }

    /// `GET, POST` for messages.
    pub fn method_list(&self) -> String {
        let names: Vec<&str> = self.methods.iter().map(Method::as_str).collect();
        names.join(", ")
    }
}

/// A bare entry as its string; any other rule as compact JSON.
impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_plain() {
            return write!(f, "{}", self.entry);
        }
        let json = serde_json::to_string(&self.to_spec()).map_err(|_| fmt::Error)?;
        f.write_str(&json)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(json: &str) -> Result<Rule, String> {
        let spec: RuleSpec = serde_json::from_str(json).map_err(|e| e.to_string())?;
        Rule::parse(&spec)
    }

    #[test]
    fn rules_narrow_ports_and_methods() {
        let r = rule(r#"{"host": "API.example.com", "ports": [443, "8000-8001"], "methods": ["get", "POST", "GET"]}"#)
            .unwrap();
        assert!(r.matches("api.example.com", 443) && r.matches("api.example.com", 8001));
        assert!(!r.matches("api.example.com", 80) && !r.matches("api.example.com", 8002));
        assert!(r.admits_method(&Method::GET) && !r.admits_method(&Method::DELETE));
        assert!(r.intercepts());
        assert_eq!(
            r.to_string(),
            r#"{"host":"api.example.com","ports":[443,"8000-8001"],"methods":["GET","POST"]}"#
        );
        let plain = rule(r#"{"host": ".example.org"}"#).unwrap();
        assert!(plain.is_plain() && !plain.intercepts());
        assert_eq!(plain.to_string(), ".example.org");
        assert!(plain.matches("a.example.org", 80) && !plain.matches("a.example.org", 22));
        let net = rule(r#"{"host": "192.0.2.0/24", "ports": ["1-65535"]}"#).unwrap();
        assert!(net.matches("192.0.2.9", 22) && !net.matches("192.0.3.1", 22));
        assert!(!net.matches("host.example", 443));
    }

    #[test]
    fn bad_rules_say_which_field() {
        for (json, says) in [
            (r#"{"host": "x.example:443"}"#, "write the host alone"),
            (r#"{"host": "x.example", "ports": []}"#, "ports is empty"),
            (r#"{"host": "x.example", "ports": [0]}"#, "out of range"),
            (r#"{"host": "x.example", "ports": [70000]}"#, "out of range"),
            (r#"{"host": "x.example", "ports": ["9-1"]}"#, "ends before"),
            (
                r#"{"host": "x.example", "ports": ["a-b"]}"#,
                "form 8000-8999",
            ),
            (
                r#"{"host": "x.example", "methods": []}"#,
                "methods is empty",
            ),
            (
                r#"{"host": "x.example", "methods": ["GE T"]}"#,
                "not an HTTP method",
            ),
            (
                r#"{"host": "x.example", "methods": ["CONNECT"]}"#,
                "CONNECT",
            ),
            (
                r#"{"host": "10.0.0.0/8", "intercept": true}"#,
                "is a network",
            ),
            (r#"{"host": "https://x.example"}"#, "host:"),
            (r#"{"host": "x.example", "extra": 1}"#, "unknown field"),
        ] {
            let err = rule(json).unwrap_err();
            assert!(err.contains(says), "{json}: {err}");
        }
    }
}
