//! Tenants: the callers a node serves besides its operator. Each has a
//! bearer token (kept only as its SHA-256), a name every run, snapshot and
//! checkpoint it makes is stamped with, and a [`TenantPolicy`] limiting
//! what it may run.
//!
//! The set sits behind [`TenantStore`] so that a fleet can keep it in a
//! shared database later; [`FileTenants`] keeps it in one JSON file in the
//! state directory (or only in memory, for tests), replaced whole on every
//! change.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use runbox_types::{
    CreateTenantRequest, ErrorCode, NetworkTier, SizeTier, TenantPolicy, UpdateTenantRequest,
};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use time::OffsetDateTime;

use crate::error::CoreError;

/// Most tenants one node keeps.
pub const MAX_TENANTS: usize = 100_000;

/// Most entries in a tenant's `images` list.
pub const MAX_IMAGE_RULES: usize = 64;

/// Longest image rule.
const MAX_IMAGE_RULE_LEN: usize = 256;

/// One tenant as runbox keeps it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TenantEntry {
    /// Its name.
    pub name: String,
    /// `sha256:<hex>` of its token.
    pub token_sha256: String,
    /// What it may use.
    #[serde(flatten)]
    pub policy: TenantPolicy,
    /// When it was added.
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    /// When its settings or token last changed.
    #[serde(with = "time::serde::rfc3339")]
    pub updated_at: OffsetDateTime,
}

impl TenantEntry {
    /// A new tenant as `req` asks, checked, and its token (which is not
    /// kept: the entry holds its hash).
    pub fn make(req: CreateTenantRequest) -> Result<(TenantEntry, String), CoreError> {
        check_name(&req.name)?;
        let policy = req.policy();
        check_policy(&policy)?;
        let token = mint_token()?;
        let now = OffsetDateTime::now_utc();
        let entry = TenantEntry {
            name: req.name,
            token_sha256: token_sha256(&token),
            policy,
            created_at: now,
            updated_at: now,
        };
        Ok((entry, token))
    }

    /// This tenant with the settings `req` gives, checked.
    pub fn updated(&self, req: UpdateTenantRequest) -> Result<TenantEntry, CoreError> {
        let mut entry = self.clone();
        if let Some(max_runs) = req.max_runs {
            entry.policy.max_runs = max_runs;
        }
        if let Some(images) = req.images {
            entry.policy.images = images;
        }
        if let Some(networks) = req.networks {
            entry.policy.networks = networks;
        }
        if let Some(sizes) = req.sizes {
            entry.policy.sizes = sizes;
        }
        if let Some(class) = req.egress_class {
            entry.policy.egress_class = (!class.is_empty()).then_some(class);
        }
        check_policy(&entry.policy)?;
        entry.updated_at = OffsetDateTime::now_utc();
        Ok(entry)
    }

    /// This tenant with a new token, and the token.
    pub fn rotated(&self) -> Result<(TenantEntry, String), CoreError> {
        let token = mint_token()?;
        let mut entry = self.clone();
        entry.token_sha256 = token_sha256(&token);
        entry.updated_at = OffsetDateTime::now_utc();
        Ok((entry, token))
    }

    /// The API's view, with its live run count.
    pub fn view(&self, runs: usize) -> runbox_types::Tenant {
        runbox_types::Tenant {
            name: self.name.clone(),
            policy: self.policy.clone(),
            runs,
            created_at: self.created_at,
            updated_at: self.updated_at,
        }
    }
}

/// Where the tenant set lives: one node's file today, a shared database
/// for a fleet later. Every method is quick (no network in the file
/// implementation); changes are durable when they return.
pub trait TenantStore: Send + Sync + 'static {
    /// The tenant whose token is `token`, if any.
    fn authenticate(&self, token: &str) -> Option<Arc<TenantEntry>>;
    /// The tenant named `name`.
    fn get(&self, name: &str) -> Option<Arc<TenantEntry>>;
    /// Every tenant, by name.
    fn list(&self) -> Vec<Arc<TenantEntry>>;
    /// Adds a tenant; answers it and its token (which is not kept).
    fn create(&self, req: CreateTenantRequest) -> Result<(Arc<TenantEntry>, String), CoreError>;
    /// Replaces the settings given.
    fn update(&self, name: &str, req: UpdateTenantRequest) -> Result<Arc<TenantEntry>, CoreError>;
    /// Gives the tenant a new token; the old one stops working at once.
    fn rotate(&self, name: &str) -> Result<(Arc<TenantEntry>, String), CoreError>;
    /// Removes the tenant.
    fn delete(&self, name: &str) -> Result<(), CoreError>;
}

/// The file on disk.
#[derive(Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct TenantFile {
    version: u32,
    tenants: Vec<TenantEntry>,
}

const FILE_VERSION: u32 = 1;

/// A tenant set in memory, by name and by the hash of each token (what
/// every [`TenantStore`] authenticates from).
#[derive(Clone, Default)]
pub struct TenantIndex {
    /// By name.
    pub by_name: BTreeMap<String, Arc<TenantEntry>>,
    /// By `sha256:<hex>` of the token.
    pub by_hash: HashMap<String, Arc<TenantEntry>>,
}

impl TenantIndex {
    /// The index of `entries`.
    pub fn of(entries: impl IntoIterator<Item = TenantEntry>) -> TenantIndex {
        let mut index = TenantIndex::default();
        for entry in entries {
            index.insert(Arc::new(entry));
        }
        index
    }

    /// The tenant whose token is `token`. The index is keyed by the
    /// token's hash, so the lookup's timing says nothing of the token.
    pub fn authenticate(&self, token: &str) -> Option<Arc<TenantEntry>> {
        self.by_hash.get(&token_sha256(token)).cloned()
    }

    /// Adds `entry`, or replaces the tenant of its name (and its token).
    pub fn insert(&mut self, entry: Arc<TenantEntry>) {
        if let Some(old) = self.by_name.insert(entry.name.clone(), entry.clone()) {
            self.by_hash.remove(&old.token_sha256);
        }
        self.by_hash.insert(entry.token_sha256.clone(), entry);
    }

    /// Removes tenant `name`; it, if it was there.
    pub fn remove(&mut self, name: &str) -> Option<Arc<TenantEntry>> {
        let old = self.by_name.remove(name)?;
        self.by_hash.remove(&old.token_sha256);
        Some(old)
    }
}

/// The tenant set in `<state>/tenants.json` (mode 0600), or in memory.
pub struct FileTenants {
    path: Option<PathBuf>,
    set: Mutex<TenantIndex>,
}

impl FileTenants {
    /// Opens the set kept at `path` (none there yet: an empty set).
    pub fn open(path: PathBuf) -> Result<FileTenants, CoreError> {
        let file: TenantFile = match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| {
                CoreError::Store(format!(
                    "{} is not a tenant file runbox can read: {e}",
                    path.display()
                ))
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => TenantFile::default(),
            Err(e) => return Err(CoreError::io(format!("reading {}", path.display()))(e)),
        };
        if file.version > FILE_VERSION {
            return Err(CoreError::Store(format!(
                "{} was written by a newer runbox (format {})",
                path.display(),
                file.version
            )));
        }
        let mut set = TenantIndex::default();
        for entry in file.tenants {
            set.insert(Arc::new(entry));
        }
        Ok(FileTenants {
            path: Some(path),
            set: Mutex::new(set),
        })
    }

    /// A set kept in memory only.
    pub fn in_memory() -> FileTenants {
        FileTenants {
            path: None,
            set: Mutex::new(TenantIndex::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, TenantIndex> {
        self.set.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Writes `set` whole, aside and renamed over the old file.
    fn save(&self, set: &TenantIndex) -> Result<(), CoreError> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        let file = TenantFile {
            version: FILE_VERSION,
            tenants: set.by_name.values().map(|e| (**e).clone()).collect(),
        };
        crate::durable::write_json_private(path, &file)
            .map_err(CoreError::io(format!("writing {}", path.display())))
    }

    /// Applies `change` to a copy of the set, saves it, and only then
    /// makes it the set: a failed write changes nothing.
    fn change<T>(
        &self,
        change: impl FnOnce(&mut TenantIndex) -> Result<T, CoreError>,
    ) -> Result<T, CoreError> {
        let mut set = self.lock();
        let mut next = set.clone();
        let answer = change(&mut next)?;
        self.save(&next)?;
        *set = next;
        Ok(answer)
    }
}

impl TenantStore for FileTenants {
    fn authenticate(&self, token: &str) -> Option<Arc<TenantEntry>> {
        self.lock().authenticate(token)
    }

    fn get(&self, name: &str) -> Option<Arc<TenantEntry>> {
        self.lock().by_name.get(name).cloned()
    }

    fn list(&self) -> Vec<Arc<TenantEntry>> {
        self.lock().by_name.values().cloned().collect()
    }

    fn create(&self, req: CreateTenantRequest) -> Result<(Arc<TenantEntry>, String), CoreError> {
        let (entry, token) = TenantEntry::make(req)?;
        let entry = Arc::new(entry);
        self.change(|set| {
            if set.by_name.contains_key(&entry.name) {
                return Err(exists(&entry.name));
            }
            if set.by_name.len() >= MAX_TENANTS {
                return Err(too_many());
            }
            set.insert(entry.clone());
            Ok(())
        })?;
        Ok((entry, token))
    }

    fn update(&self, name: &str, req: UpdateTenantRequest) -> Result<Arc<TenantEntry>, CoreError> {
        self.change(|set| {
            let old = set.by_name.get(name).ok_or_else(|| not_found(name))?;
            let entry = Arc::new(old.updated(req)?);
            set.insert(entry.clone());
            Ok(entry)
        })
    }

    fn rotate(&self, name: &str) -> Result<(Arc<TenantEntry>, String), CoreError> {
        self.change(|set| {
            let old = set.by_name.get(name).ok_or_else(|| not_found(name))?;
            let (entry, token) = old.rotated()?;
            let entry = Arc::new(entry);
            set.insert(entry.clone());
            Ok((entry, token))
        })
    }

    fn delete(&self, name: &str) -> Result<(), CoreError> {
        self.change(|set| set.remove(name).map(drop).ok_or_else(|| not_found(name)))
    }
}

/// `sha256:<hex>` of a token.
pub fn token_sha256(token: &str) -> String {
    let digest = Sha256::digest(token.as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

/// A new token: 32 random bytes as 64 hex digits (hex, so that E2B's SDKs
/// take it as `e2b_<token>`).
fn mint_token() -> Result<String, CoreError> {
    let mut bytes = [0u8; 32];
    rustix::rand::getrandom(&mut bytes, rustix::rand::GetRandomFlags::empty())
        .map_err(|e| CoreError::io("reading random bytes for a token")(e.into()))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// A create of a name that is taken.
pub fn exists(name: &str) -> CoreError {
    CoreError::Conflict {
        code: ErrorCode::TenantExists,
        message: format!(
            "a tenant named {name:?} exists already; pick another name, or rotate its token"
        ),
    }
}

/// A create past [`MAX_TENANTS`].
pub fn too_many() -> CoreError {
    CoreError::invalid(
        ErrorCode::BadTenant,
        format!("at most {MAX_TENANTS} tenants are kept; delete some first"),
    )
}

/// No tenant named `name`.
pub fn not_found(name: &str) -> CoreError {
    CoreError::invalid(
        ErrorCode::TenantNotFound,
        format!(
            "no tenant named {:?}; GET /v1/tenants lists them",
            bounded(name)
        ),
    )
}

/// At most 64 characters of `s`, for messages.
fn bounded(s: &str) -> String {
    s.chars().take(64).collect()
}

/// A tenant name: 1-32 of `a-z0-9_-`, starting with a letter.
pub fn check_name(name: &str) -> Result<(), CoreError> {
    let ok = (1..=32).contains(&name.len())
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(CoreError::invalid(
            ErrorCode::BadTenant,
            format!(
                "tenant name {:?} must be 1-32 of a-z, 0-9, '-' and '_', starting with a letter",
                bounded(name)
            ),
        ))
    }
}

/// A policy's lists: bounded, no duplicates, image rules well formed.
fn check_policy(policy: &TenantPolicy) -> Result<(), CoreError> {
    let bad = |message: String| Err(CoreError::invalid(ErrorCode::BadTenant, message));
    if policy.images.len() > MAX_IMAGE_RULES {
        return bad(format!("images takes at most {MAX_IMAGE_RULES} entries"));
    }
    for rule in &policy.images {
        let body = rule.strip_suffix('*').unwrap_or(rule);
        if rule.is_empty()
            || rule.len() > MAX_IMAGE_RULE_LEN
            || body.contains('*')
            || rule
                .chars()
                .any(|c| c.is_whitespace() || c.is_control() || c == '\u{feff}')
        {
            return bad(format!(
                "images entry {:?} must be an image name, or a prefix ending in '*' (at most {MAX_IMAGE_RULE_LEN} characters, no spaces, '*' only last)",
                bounded(rule)
            ));
        }
    }
    if has_duplicates(&policy.images)
        || has_duplicates(&policy.networks)
        || has_duplicates(&policy.sizes)
    {
        return bad("images, networks and sizes take each entry once".into());
    }
    if let Some(class) = &policy.egress_class {
        if check_name(class).is_err() {
            return bad(format!(
                "egressClass {:?} must be 1-32 of a-z, 0-9, '-' and '_', starting with a letter",
                bounded(class)
            ));
        }
    }
    Ok(())
}

fn has_duplicates<T: PartialEq>(items: &[T]) -> bool {
    items
        .iter()
        .enumerate()
        .any(|(i, a)| items[..i].contains(a))
}

/// Whether image rule `rule` admits image name `name`.
fn rule_admits(rule: &str, name: &str) -> bool {
    match rule.strip_suffix('*') {
        Some(prefix) => name.starts_with(prefix),
        None => rule == name,
    }
}

/// Who a create, a fork or a wake is for: the operator (no tenant) or one
/// tenant, whose policy applies.
#[derive(Clone, Debug, Default)]
pub struct Owner(pub Option<Arc<TenantEntry>>);

impl Owner {
    /// The operator.
    pub fn root() -> Owner {
        Owner(None)
    }

    /// The tenant's name, if any.
    pub fn tenant(&self) -> Option<&str> {
        self.0.as_deref().map(|t| t.name.as_str())
    }

    /// The tenant's `maxRuns` (0: no limit; the operator has none).
    pub fn max_runs(&self) -> u32 {
        self.0.as_deref().map_or(0, |t| t.policy.max_runs)
    }

    /// The egress class the tenant's runs are bound to, if any.
    pub fn egress_class(&self) -> Option<&str> {
        self.0
            .as_deref()
            .and_then(|t| t.policy.egress_class.as_deref())
    }

    /// Whether the caller may see something stamped with `stamp`: the
    /// operator sees everything, a tenant its own only.
    pub fn sees(&self, stamp: Option<&str>) -> bool {
        match self.tenant() {
            None => true,
            Some(tenant) => stamp == Some(tenant),
        }
    }

    /// Refuses an image the tenant may not run; `names` are what the
    /// create named and what it resolved to (either may match a rule).
    pub fn check_image(&self, names: &[&str]) -> Result<(), CoreError> {
        let Some(tenant) = &self.0 else {
            return Ok(());
        };
        let rules = &tenant.policy.images;
        if rules.is_empty()
            || names
                .iter()
                .any(|name| rules.iter().any(|rule| rule_admits(rule, name)))
        {
            return Ok(());
        }
        Err(CoreError::invalid(
            ErrorCode::TenantPolicy,
            format!(
                "tenant {:?} may not run image {:?}: its images rule allows only {}",
                tenant.name,
                bounded(names.first().copied().unwrap_or("")),
                rules.join(", ")
            ),
        ))
    }

    /// Whether the tenant may use `network` (its `networks` rule).
    pub fn check_network(&self, network: NetworkTier) -> Result<(), CoreError> {
        let Some(tenant) = &self.0 else {
            return Ok(());
        };
        let policy = &tenant.policy;
        if !policy.networks.is_empty() && !policy.networks.contains(&network) {
            let allowed: Vec<&str> = policy.networks.iter().map(|n| n.as_str()).collect();
            return Err(CoreError::invalid(
                ErrorCode::TenantPolicy,
                format!(
                    "tenant {:?} may not use network {:?}: its networks rule allows only {}",
                    tenant.name,
                    network.as_str(),
                    allowed.join(", ")
                ),
            ));
        }
        Ok(())
    }

    /// Refuses a network tier or size the tenant may not use.
    pub fn check_shape(
        &self,
        network: NetworkTier,
        size: Option<SizeTier>,
        free_limits: bool,
    ) -> Result<(), CoreError> {
        self.check_network(network)?;
        let Some(tenant) = &self.0 else {
            return Ok(());
        };
        let policy = &tenant.policy;
        if !policy.sizes.is_empty() {
            let allowed: Vec<&str> = policy.sizes.iter().map(|s| s.as_str()).collect();
            let refused = match size {
                _ if free_limits => Some("free-form limits".to_owned()),
                Some(size) if !policy.sizes.contains(&size) => {
                    Some(format!("size {:?}", size.as_str()))
                }
                None => Some("a run without a size".to_owned()),
                Some(_) => None,
            };
            if let Some(what) = refused {
                return Err(CoreError::invalid(
                    ErrorCode::TenantPolicy,
                    format!(
                        "tenant {:?} may not use {what}: its sizes rule allows only {} (give size)",
                        tenant.name,
                        allowed.join(", ")
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Refuses one more live run when the tenant has `live` and is at its
    /// `maxRuns`.
    pub fn check_quota(&self, live: usize, more: usize) -> Result<(), CoreError> {
        match &self.0 {
            Some(t) if t.policy.max_runs > 0 && live + more > t.policy.max_runs as usize => {
                Err(CoreError::TenantQuota {
                    tenant: t.name.clone(),
                    max: t.policy.max_runs,
                })
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(name: &str) -> CreateTenantRequest {
        CreateTenantRequest {
            name: name.into(),
            ..Default::default()
        }
    }

    #[test]
    fn tokens_authenticate_their_tenant_and_rotation_replaces_them() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tenants.json");
        let store = FileTenants::open(path.clone()).unwrap();
        let (a, token_a) = store.create(req("acme")).unwrap();
        let (_, token_b) = store.create(req("beta")).unwrap();
        assert_eq!(token_a.len(), 64);
        assert_eq!(store.authenticate(&token_a).unwrap().name, "acme");
        assert_eq!(store.authenticate(&token_b).unwrap().name, "beta");
        assert!(store.authenticate("nope").is_none());
        // Only the hash is on disk.
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(!text.contains(&token_a) && text.contains(&a.token_sha256));
        let (_, rotated) = store.rotate("acme").unwrap();
        assert!(store.authenticate(&token_a).is_none());
        assert_eq!(store.authenticate(&rotated).unwrap().name, "acme");
        // Reopened, the set is the same.
        let again = FileTenants::open(path).unwrap();
        assert_eq!(again.authenticate(&rotated).unwrap().name, "acme");
        assert_eq!(again.list().len(), 2);
        again.delete("acme").unwrap();
        assert!(again.authenticate(&rotated).is_none());
        assert_eq!(
            again.delete("acme").unwrap_err().code(),
            ErrorCode::TenantNotFound
        );
    }

    #[test]
    fn bad_names_and_policies_are_refused_and_change_nothing() {
        let store = FileTenants::in_memory();
        for name in ["", "Acme", "1a", "a b", "a/b", &"a".repeat(33), "a\u{0}"] {
            assert_eq!(
                store.create(req(name)).unwrap_err().code(),
                ErrorCode::BadTenant,
                "{name:?}"
            );
        }
        store.create(req("acme")).unwrap();
        assert_eq!(
            store.create(req("acme")).unwrap_err().code(),
            ErrorCode::TenantExists
        );
        for images in [vec!["a*b".to_owned()], vec!["".into()], vec!["x y".into()]] {
            let update = UpdateTenantRequest {
                images: Some(images),
                ..Default::default()
            };
            assert_eq!(
                store.update("acme", update).unwrap_err().code(),
                ErrorCode::BadTenant
            );
        }
        assert!(store.get("acme").unwrap().policy.images.is_empty());
    }

    #[test]
    fn policies_name_the_rule_that_refuses() {
        let entry = |policy| {
            Owner(Some(Arc::new(TenantEntry {
                name: "acme".into(),
                token_sha256: String::new(),
                policy,
                created_at: OffsetDateTime::UNIX_EPOCH,
                updated_at: OffsetDateTime::UNIX_EPOCH,
            })))
        };
        let owner = entry(TenantPolicy {
            max_runs: 2,
            images: vec!["python:*".into(), "alpine:3.20".into()],
            networks: vec![NetworkTier::None],
            sizes: vec![SizeTier::Small],
            egress_class: Some("ci".into()),
        });
        assert_eq!(owner.egress_class(), Some("ci"));
        assert_eq!(Owner::root().egress_class(), None);
        let mut bad = owner.0.as_deref().unwrap().policy.clone();
        bad.egress_class = Some("Not A Name".into());
        assert_eq!(check_policy(&bad).unwrap_err().code(), ErrorCode::BadTenant);
        owner.check_image(&["python:3.12"]).unwrap();
        owner.check_image(&["alpine", "alpine:3.20"]).unwrap();
        let e = owner.check_image(&["debian:12"]).unwrap_err();
        assert_eq!(e.code(), ErrorCode::TenantPolicy);
        assert!(e.to_string().contains("images rule"), "{e}");
        owner
            .check_shape(NetworkTier::None, Some(SizeTier::Small), false)
            .unwrap();
        let e = owner
            .check_shape(NetworkTier::Open, Some(SizeTier::Small), false)
            .unwrap_err();
        assert!(e.to_string().contains("networks rule"), "{e}");
        for (size, free) in [
            (Some(SizeTier::Large), false),
            (None, false),
            (Some(SizeTier::Small), true),
        ] {
            let e = owner
                .check_shape(NetworkTier::None, size, free)
                .unwrap_err();
            assert!(e.to_string().contains("sizes rule"), "{e}");
        }
        owner.check_quota(1, 1).unwrap();
        assert_eq!(
            owner.check_quota(2, 1).unwrap_err().code(),
            ErrorCode::TenantQuota
        );
        // The operator has no rules.
        Owner::root().check_image(&["anything"]).unwrap();
        Owner::root().check_quota(1_000_000, 1).unwrap();
    }
}
