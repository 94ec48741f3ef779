//! Tenants: the API's callers besides the operator, each with its own
//! token, its own runs and the limits the operator gave it.

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use crate::{NetworkTier, SizeTier};

/// A tenant as the API shows it (never its token).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Tenant {
    /// Its name: 1-32 of `a-z`, `0-9`, `-` and `_`, starting with a letter.
    pub name: String,
    /// What it may use.
    #[serde(flatten)]
    pub policy: TenantPolicy,
    /// Its live runs on this node now.
    #[serde(default)]
    pub runs: usize,
    /// When it was added.
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    /// When its settings or token last changed.
    #[serde(with = "time::serde::rfc3339")]
    pub updated_at: OffsetDateTime,
}

/// What a tenant may use. An empty list allows everything of its kind.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct TenantPolicy {
    /// Live runs it may have at once on this node (forks count against
    /// their parent's tenant); 0 means no limit of its own (the node's
    /// `--max-runs` still holds).
    #[serde(default)]
    pub max_runs: u32,
    /// Images it may create runs from: exact names (`alpine:3.20`), or a
    /// prefix ending in `*` (`python:*`, `registry.example.com/team/*`).
    /// Its own snapshots are always allowed. Empty: any stored image.
    #[serde(default)]
    pub images: Vec<String>,
    /// Network tiers it may use. Empty: any the node has.
    #[serde(default)]
    pub networks: Vec<NetworkTier>,
    /// Size tiers it may use; with a list, a create must name one of them
    /// (free-form `limits` are refused). Empty: any size or limits.
    #[serde(default)]
    pub sizes: Vec<SizeTier>,
    /// The operator's egress class its runs are bound to: each run reaches
    /// only what both the class and the run's own policy admit. Absent:
    /// none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_class: Option<String>,
}

/// `POST /v1/tenants`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateTenantRequest {
    /// Its name: 1-32 of `a-z`, `0-9`, `-` and `_`, starting with a letter.
    #[cfg_attr(
        feature = "openapi",
        schema(min_length = 1, max_length = 32, pattern = "^[a-z][a-z0-9_-]{0,31}$")
    )]
    pub name: String,
    /// Live runs it may have at once; 0 (the default) means no limit of
    /// its own.
    #[serde(default)]
    pub max_runs: u32,
    /// Images it may create runs from (see [`TenantPolicy::images`]);
    /// empty: any.
    #[serde(default)]
    pub images: Vec<String>,
    /// Network tiers it may use; empty: any.
    #[serde(default)]
    pub networks: Vec<NetworkTier>,
    /// Size tiers it may use; empty: any.
    #[serde(default)]
    pub sizes: Vec<SizeTier>,
    /// The egress class its runs are bound to (see
    /// [`TenantPolicy::egress_class`]); one the server's config defines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(
        feature = "openapi",
        schema(min_length = 1, max_length = 32, pattern = "^[a-z][a-z0-9_-]{0,31}$")
    )]
    pub egress_class: Option<String>,
}

impl CreateTenantRequest {
    /// The policy it asks for.
    pub fn policy(&self) -> TenantPolicy {
        TenantPolicy {
            max_runs: self.max_runs,
            images: self.images.clone(),
            networks: self.networks.clone(),
            sizes: self.sizes.clone(),
            egress_class: self.egress_class.clone(),
        }
    }
}

/// `PATCH /v1/tenants/{name}`: the fields given replace the tenant's.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct UpdateTenantRequest {
    /// Live runs it may have at once; 0 means no limit of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_runs: Option<u32>,
    /// Images it may create runs from (see [`TenantPolicy::images`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub images: Option<Vec<String>>,
    /// Network tiers it may use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub networks: Option<Vec<NetworkTier>>,
    /// Size tiers it may use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sizes: Option<Vec<SizeTier>>,
    /// The egress class its new runs are bound to; `""` unbinds it. Runs
    /// it has keep the class they were made with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_class: Option<String>,
}

/// The answer to a tenant's creation or token rotation: the token, shown
/// this once (runbox keeps only its hash).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct TenantToken {
    /// The tenant.
    pub tenant: Tenant,
    /// Its bearer token (64 hex digits). E2B's SDKs take it as
    /// `E2B_API_KEY=e2b_<token>`.
    pub token: String,
}

/// `GET /v1/tenants`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct TenantList {
    /// Every tenant, by name.
    pub tenants: Vec<Tenant>,
}

/// `POST /v1/config/reload` (and SIGHUP): what a reload of the config file
/// found and did.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ConfigReload {
    /// The keys whose values differ from what the daemon runs with.
    pub changed: Vec<String>,
    /// Of those, the ones now in force.
    pub applied: Vec<String>,
    /// Of those, the ones that take effect only at the next start.
    pub restart_required: Vec<String>,
    /// Of those, the ones a command-line flag or its environment variable
    /// sets, so the file's value is not used (now or at a restart).
    #[serde(default)]
    pub overridden: Vec<String>,
}

/// `GET /v1/usage`: what each tenant used between `since` and `until`
/// (the operator's runs under the empty name).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct UsageReport {
    /// The window's start (absent: the journal's beginning).
    #[serde(
        default,
        with = "time::serde::rfc3339::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub since: Option<OffsetDateTime>,
    /// The window's end: when the report was made.
    #[serde(with = "time::serde::rfc3339")]
    pub until: OffsetDateTime,
    /// Per tenant ("" for the operator's own runs).
    pub tenants: std::collections::BTreeMap<String, UsageTotals>,
    /// On a node of a fleet: the nodes whose journals it sums (each node
    /// keeps its runs' journal; one that cannot be reached is left out,
    /// and missing here). Empty alone.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nodes: Vec<String>,
}

/// One tenant's usage in a window.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct UsageTotals {
    /// Seconds its runs held CPU and memory (running or paused), by size
    /// tier (`custom` for runs with free-form limits).
    pub run_seconds: std::collections::BTreeMap<String, f64>,
    /// CPU time its runs used, in seconds, counted at the end of each boot
    /// (a run still running has not reported its current boot yet).
    pub cpu_seconds: f64,
    /// The most memory one boot of its runs was charged, in bytes.
    pub peak_memory_bytes: u64,
    /// Payload bytes of its allowed egress connections (with
    /// `--egress-usage-bytes`).
    pub egress_bytes: u64,
    /// How many events of each kind (`create`, `claim`, `fork`, ...).
    pub events: std::collections::BTreeMap<String, u64>,
}
