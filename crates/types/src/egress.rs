//! Egress wire types beyond the tier itself: the secrets a create asks for,
//! operator-declared or brought by the caller.

use std::fmt;

use serde::{Deserialize, Serialize};

/// One entry of `egressAllow`: the string grammar (`host`, `.suffix`,
/// `*.suffix`, `host:port`, an IP address, `prefix/len`) or a rule object.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(untagged)]
pub enum EgressEntry {
    /// An entry in the string grammar.
    Text(String),
    /// A rule.
    Rule(EgressRule),
}

impl From<&str> for EgressEntry {
    fn from(entry: &str) -> Self {
        EgressEntry::Text(entry.to_owned())
    }
}

impl From<String> for EgressEntry {
    fn from(entry: String) -> Self {
        EgressEntry::Text(entry)
    }
}

impl PartialEq<String> for EgressEntry {
    fn eq(&self, other: &String) -> bool {
        matches!(self, EgressEntry::Text(text) if text == other)
    }
}

impl PartialEq<&str> for EgressEntry {
    fn eq(&self, other: &&str) -> bool {
        matches!(self, EgressEntry::Text(text) if text == other)
    }
}

impl fmt::Display for EgressEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EgressEntry::Text(text) => f.write_str(text),
            EgressEntry::Rule(rule) => {
                f.write_str(&serde_json::to_string(rule).map_err(|_| fmt::Error)?)
            }
        }
    }
}

impl<'de> Deserialize<'de> for EgressEntry {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        text_or_object(
            deserializer,
            "an entry such as \"example.org\", or a rule {host, ports?, methods?, secret?, \
             intercept?}",
            EgressEntry::Text,
            EgressEntry::Rule,
        )
    }
}

/// An allowlist rule: a host with the ports, methods, secret and
/// interception that go with it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EgressRule {
    /// `host`, `.suffix`, `*.suffix`, an IP address or `prefix/len`; no
    /// port (see `ports`).
    pub host: String,
    /// Ports or `"lo-hi"` ranges (default: 80 and 443).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ports: Option<Vec<PortSpec>>,
    /// The methods that may be sent (default: every method). A rule with
    /// methods intercepts TLS to check each request, and closes a tunnel
    /// that does not speak TLS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub methods: Option<Vec<String>>,
    /// One of the run's secrets its requests may carry (by the secret's
    /// own host, method and path policy); intercepts TLS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
    /// Terminate TLS to its hosts, so each request is checked against the
    /// policy in force and audited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub intercept: Option<bool>,
}

/// One item of a rule's `ports`: a port, or an inclusive `"lo-hi"` range.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(untagged)]
pub enum PortSpec {
    /// One port, 1-65535.
    Port(u32),
    /// `"8000-8999"`.
    Range(String),
}

/// One entry of `secrets` on `POST /v1/runs`: the name of a secret the
/// operator declared, or a secret the caller brings with its value and the
/// policy it may be sent under.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(untagged)]
pub enum SecretRequest {
    /// An operator-declared secret, by name.
    Declared(String),
    /// A secret the caller brings.
    Brought(BroughtSecret),
}

impl SecretRequest {
    /// The name the run sees.
    pub fn name(&self) -> &str {
        match self {
            SecretRequest::Declared(name) => name,
            SecretRequest::Brought(secret) => &secret.name,
        }
    }
}

impl From<&str> for SecretRequest {
    fn from(name: &str) -> Self {
        SecretRequest::Declared(name.to_owned())
    }
}

impl From<String> for SecretRequest {
    fn from(name: String) -> Self {
        SecretRequest::Declared(name)
    }
}

impl From<BroughtSecret> for SecretRequest {
    fn from(secret: BroughtSecret) -> Self {
        SecretRequest::Brought(secret)
    }
}

impl<'de> Deserialize<'de> for SecretRequest {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        text_or_object(
            deserializer,
            "a declared secret's name, or an object {name, value, hosts, header, scheme?, \
             methods?, pathPrefixes?}",
            SecretRequest::Declared,
            SecretRequest::Brought,
        )
    }
}

/// Deserializes a string as `text(string)` and an object as
/// `object(T)`. Written by hand instead of `#[serde(untagged)]`, whose
/// error for a bad object is "did not match any variant": this passes the
/// object's own error (an unknown field, a missing one) to the caller.
fn text_or_object<'de, D, T, V>(
    deserializer: D,
    expecting: &'static str,
    text: fn(String) -> V,
    object: fn(T) -> V,
) -> Result<V, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    struct Visitor<T, V> {
        expecting: &'static str,
        text: fn(String) -> V,
        object: fn(T) -> V,
    }
    impl<'de, T: Deserialize<'de>, V> serde::de::Visitor<'de> for Visitor<T, V> {
        type Value = V;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(self.expecting)
        }

        fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<V, E> {
            Ok((self.text)(s.to_owned()))
        }

        fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<V, A::Error> {
            T::deserialize(serde::de::value::MapAccessDeserializer::new(map)).map(self.object)
        }
    }
    deserializer.deserialize_any(Visitor {
        expecting,
        text,
        object,
    })
}

/// `PATCH /v1/runs/{id}/egress`: a run's egress policy replaced while it
/// lives. A field left out keeps what the run has; a field given replaces
/// it whole (an empty list clears it). Connections already open are not
/// cut; new ones, and each request inside an intercepted tunnel, follow the
/// new policy.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct UpdateEgressRequest {
    /// The tier: `none` or `allowlist`, from either of them (an `open`
    /// run keeps its tier). To `none` closes the run's proxy and every
    /// connection through it, and clears its entries and secrets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<crate::NetworkTier>,
    /// The run's own allowlist entries (`allowlist` tier).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_allow: Option<Vec<EgressEntry>>,
    /// Whether the built-in list of registries and forges applies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_defaults: Option<bool>,
    /// Whether the run has a SOCKS5 door. Off closes the door; tunnels
    /// already open through it keep going.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_socks5: Option<bool>,
    /// The run's upstream proxy, as at create; `""` removes it (the
    /// server's default, if any, applies again).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>))]
    pub egress_upstream: Option<SecretValue>,
    /// The run's secrets, declared and brought (`allowlist` tier).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secrets: Option<Vec<SecretRequest>>,
}

/// A credential the caller holds and hands to one run: the run can use it
/// but never read it. The run's environment holds a placeholder,
/// `runbox-secret:NAME`, under `name`; the egress proxy puts the value in
/// `header` only on HTTPS requests to `hosts` whose method is in `methods`
/// and whose path starts with one of `pathPrefixes` (absent or empty: the
/// value is never sent). The hosts become reachable for the run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BroughtSecret {
    /// The environment variable the run finds the placeholder in (1-64
    /// characters of `A-Z`, `0-9`, `_`, not starting with a digit).
    pub name: String,
    /// The value. Never enters the run, never shown by the API, never
    /// logged, never written to disk in plain text.
    pub value: SecretValue,
    /// The hosts whose requests may carry it: `host` or `.suffix` (a
    /// domain and its subdomains), no ports.
    pub hosts: Vec<String>,
    /// The header that carries it, e.g. `Authorization`.
    pub header: String,
    /// Written before the value with one space when the proxy writes the
    /// whole header (the run sent none), e.g. `Bearer`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheme: Option<String>,
    /// The methods that may carry it, e.g. `["GET", "POST"]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub methods: Option<Vec<String>>,
    /// The path prefixes that may carry it, matched on whole segments
    /// (`/v1` covers `/v1/x`, never `/v10`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path_prefixes: Option<Vec<String>>,
}

/// A secret's value: shown by nothing. `Debug` prints a marker, so a stray
/// `{:?}` in a log line cannot leak it; only serialization (sending the
/// request) writes it out.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(transparent)]
pub struct SecretValue(String);

impl SecretValue {
    /// Wraps a value.
    pub fn new(value: impl Into<String>) -> SecretValue {
        SecretValue(value.into())
    }

    /// The value itself, for the code that seals or sends it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for SecretValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_names_or_brought_secrets() {
        let parsed: Vec<SecretRequest> = serde_json::from_str(
            r#"["GH", {"name": "API", "value": "v4lue", "hosts": ["api.example.com"],
                       "header": "Authorization", "scheme": "Bearer",
                       "methods": ["GET"], "pathPrefixes": ["/v1/"]}]"#,
        )
        .unwrap();
        assert_eq!(parsed[0], SecretRequest::Declared("GH".into()));
        let SecretRequest::Brought(b) = &parsed[1] else {
            panic!("{parsed:?}")
        };
        assert_eq!(b.value.expose(), "v4lue");
        assert_eq!(parsed[1].name(), "API");
        // Debug never shows the value; serialization round-trips it.
        assert!(!format!("{parsed:?}").contains("v4lue"));
        let again: Vec<SecretRequest> =
            serde_json::from_str(&serde_json::to_string(&parsed).unwrap()).unwrap();
        assert_eq!(again, parsed);
    }

    #[test]
    fn egress_entries_are_strings_or_rules() {
        let parsed: Vec<EgressEntry> = serde_json::from_str(
            r#"["example.org", {"host": "db.example.org", "ports": [5432, "6000-6001"]}]"#,
        )
        .unwrap();
        assert_eq!(parsed[0], "example.org");
        let EgressEntry::Rule(rule) = &parsed[1] else {
            panic!("{parsed:?}")
        };
        assert_eq!(
            rule.ports,
            Some(vec![
                PortSpec::Port(5432),
                PortSpec::Range("6000-6001".into())
            ])
        );
        assert_eq!(
            parsed[1].to_string(),
            r#"{"host":"db.example.org","ports":[5432,"6000-6001"]}"#
        );
        let err =
            serde_json::from_str::<EgressEntry>(r#"{"host": "x", "method": ["GET"]}"#).unwrap_err();
        assert!(err.to_string().contains("unknown field `method`"), "{err}");
        let err = serde_json::from_str::<EgressEntry>("[1]").unwrap_err();
        assert!(err.to_string().contains("a rule {host"), "{err}");
    }

    #[test]
    fn a_bad_object_says_what_is_wrong_with_it() {
        let err = serde_json::from_str::<SecretRequest>(
            r#"{"name": "A", "value": "v", "hosts": [], "header": "X", "extra": 1}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("unknown field `extra`"), "{err}");
        let err =
            serde_json::from_str::<SecretRequest>(r#"{"name": "A", "value": "v"}"#).unwrap_err();
        assert!(err.to_string().contains("missing field `hosts`"), "{err}");
        let err = serde_json::from_str::<SecretRequest>("7").unwrap_err();
        assert!(err.to_string().contains("declared secret's name"), "{err}");
    }
}
