//! Warm pools: runs made ahead of time for an (image, network, size tier),
//! handed out at create time so a start costs what an exec costs.
//!
//! This module is the bookkeeping, pure and synchronous: the configured
//! set, each pool's ready members, refills in flight, the adaptive target
//! and what the controller should do next ([`Pools::plan`]). The runs
//! themselves are ordinary runs with their own owners (see
//! `runs/pool.rs`, which makes, warms up, hands out and destroys them).
//!
//! Rules:
//! * A member is handed out once: [`Pools::take`] removes it from the ready
//!   queue under the lock, and a claimed run never returns to a pool.
//! * The target is `warm`; with `warmMax` it rises while claims come faster
//!   than the measured provision time covers (to the number of claims that
//!   came within the last provision lead: what one refill round must
//!   cover), and falls back to `warm` after a decay period without claims. Ready members above the target are destroyed once they
//!   have stayed above it for a full decay period.
//! * A failed refill (create or warmup) is kept as the pool's last error
//!   and retried with backoff; the pool stays short meanwhile.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use runbox_types::{NetworkTier, PoolSet, PoolSpec, PoolStatus, SizeTier};
use serde::{Deserialize, Serialize};
use ulid::Ulid;

/// The `warm` of a pool that gives neither `warm` nor `warmMax`.
pub const DEFAULT_WARM: u32 = 4;

/// The most ready runs one pool may ask for.
pub const MAX_WARM: u32 = 1024;

/// Claim times kept per pool for the demand estimate.
const RATE_WINDOW: usize = 1024;

/// The shortest provision lead the demand estimate assumes.
const MIN_LEAD: Duration = Duration::from_millis(50);

/// First delay after a failed refill; doubles up to [`MAX_RETRY`].
const FIRST_RETRY: Duration = Duration::from_millis(500);
const MAX_RETRY: Duration = Duration::from_secs(30);

/// What a pool is keyed by.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolKey {
    /// The image's local name.
    pub image: String,
    /// The network tier.
    pub network: NetworkTier,
    /// The size tier.
    pub size: SizeTier,
}

impl std::fmt::Display for PoolKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}/{}", self.image, self.network.as_str(), self.size)
    }
}

/// A run's pool membership, as its record keeps it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Membership {
    /// The pool it was made for.
    pub key: PoolKey,
    /// Whether a create has been served with it.
    pub claimed: bool,
}

/// One pool's configuration, defaults applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// Its key.
    pub key: PoolKey,
    /// Ready runs it keeps.
    pub warm: u32,
    /// Ceiling of the adaptive target.
    pub warm_max: Option<u32>,
    /// Run in every member before it joins.
    pub warmup: Option<Vec<String>>,
}

impl PoolConfig {
    /// The spec as the API shows it.
    pub fn to_spec(&self) -> PoolSpec {
        PoolSpec {
            image: self.key.image.clone(),
            network: Some(self.key.network),
            size: Some(self.key.size),
            warm: Some(self.warm),
            warm_max: self.warm_max,
            warmup: self.warmup.clone(),
        }
    }
}

/// Checks a pool set's shape and applies the defaults; `check` judges each
/// pool's image name and network (the caller knows the server). The error
/// says what to fix.
pub fn configs(
    set: &PoolSet,
    check: impl Fn(&PoolKey) -> Result<(), String>,
) -> Result<Vec<PoolConfig>, String> {
    let mut seen = HashSet::new();
    let mut out = Vec::with_capacity(set.pools.len());
    for (i, spec) in set.pools.iter().enumerate() {
        let key = PoolKey {
            image: spec.image.clone(),
            network: spec.network.unwrap_or_default(),
            size: spec.size.unwrap_or(SizeTier::Small),
        };
        let at = |why: String| format!("pools[{i}] ({key}): {why}");
        check(&key).map_err(at)?;
        if !seen.insert(key.clone()) {
            return Err(at(
                "another pool has the same image, network and size".into()
            ));
        }
        let warm = match (spec.warm, spec.warm_max) {
            (None, None) => DEFAULT_WARM,
            (warm, _) => warm.unwrap_or(0),
        };
        if warm > MAX_WARM || spec.warm_max.is_some_and(|m| m > MAX_WARM) {
            return Err(at(format!("warm and warmMax must be at most {MAX_WARM}")));
        }
        if let Some(max) = spec.warm_max {
            if max < warm {
                return Err(at(format!("warmMax ({max}) is below warm ({warm})")));
            }
        }
        if let Some(argv) = &spec.warmup {
            if argv.is_empty() || argv[0].is_empty() {
                return Err(at(
                    "warmup must name a program: [\"sh\", \"-c\", \"...\"]".into()
                ));
            }
        }
        out.push(PoolConfig {
            key,
            warm,
            warm_max: spec.warm_max,
            warmup: spec.warmup.clone(),
        });
    }
    Ok(out)
}

/// One pool's live state.
#[derive(Debug)]
struct Pool {
    config: PoolConfig,
    target: u32,
    ready: VecDeque<Ulid>,
    refilling: u32,
    claims: u64,
    misses: u64,
    last_error: Option<String>,
    failures: u32,
    retry_at: Option<Instant>,
    recent: VecDeque<Instant>,
    above_since: Option<Instant>,
    /// Smoothed time to make one member (create + warmup).
    provision: Option<Duration>,
}

impl Pool {
    fn new(config: PoolConfig) -> Pool {
        Pool {
            target: config.warm,
            config,
            ready: VecDeque::new(),
            refilling: 0,
            claims: 0,
            misses: 0,
            last_error: None,
            failures: 0,
            retry_at: None,
            recent: VecDeque::new(),
            above_since: None,
            provision: None,
        }
    }

    fn status(&self) -> PoolStatus {
        PoolStatus {
            image: self.config.key.image.clone(),
            network: self.config.key.network,
            size: self.config.key.size,
            warm: self.config.warm,
            warm_max: self.config.warm_max,
            warmup: self.config.warmup.clone(),
            target: self.target,
            ready: self.ready.len() as u32,
            refilling: self.refilling,
            claims: self.claims,
            misses: self.misses,
            last_error: self.last_error.clone(),
        }
    }

    /// Notes a claim (served or missed) and raises the target if claims
    /// come faster than members are made.
    fn demand(&mut self, now: Instant) {
        self.recent.push_back(now);
        while self.recent.len() > RATE_WINDOW {
            self.recent.pop_front();
        }
        let Some(max) = self.config.warm_max else {
            return;
        };
        // Members consumed during one provision lead: the claims of the
        // last lead time (a steady rate r needs r × lead; a burst needs all
        // of it at once).
        let lead = self
            .provision
            .unwrap_or(Duration::from_millis(100))
            .max(MIN_LEAD);
        let needed = self.recent.iter().filter(|t| now - **t < lead).count() as u32;
        let wanted = needed.max(self.config.warm).min(max);
        if wanted > self.target {
            self.target = wanted;
        }
    }
}

/// What the controller should do now.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Members to start making, by pool (already counted as refilling).
    pub refill: Vec<(PoolConfig, u32)>,
    /// Idle members to destroy (already out of every ready queue).
    pub destroy: Vec<Ulid>,
}

/// Every pool's state. Callers hold it behind a mutex.
#[derive(Debug)]
pub struct Pools {
    pools: BTreeMap<PoolKey, Pool>,
    /// Idle members of pools that no longer exist, or waiting to go.
    orphans: Vec<Ulid>,
    draining: bool,
    decay: Duration,
}

impl Pools {
    /// No pools; targets decay after `decay` without claims.
    pub fn new(decay: Duration) -> Pools {
        Pools {
            pools: BTreeMap::new(),
            orphans: Vec::new(),
            draining: false,
            decay,
        }
    }

    /// Replaces the configured set: pools that stay keep their members
    /// (their target restarts at the new `warm`), pools that go have their
    /// ready members destroyed.
    pub fn set(&mut self, configs: Vec<PoolConfig>) {
        let mut next = BTreeMap::new();
        for config in configs {
            let pool = match self.pools.remove(&config.key) {
                Some(mut pool) => {
                    if pool.config.warmup != config.warmup {
                        // Warmed for another command: made again.
                        self.orphans.extend(pool.ready.drain(..));
                    }
                    pool.target = config.warm;
                    pool.config = config.clone();
                    pool
                }
                None => Pool::new(config.clone()),
            };
            next.insert(config.key, pool);
        }
        for (_, pool) in std::mem::take(&mut self.pools) {
            self.orphans.extend(pool.ready);
        }
        self.pools = next;
    }

    /// The configured set.
    pub fn configs(&self) -> Vec<PoolConfig> {
        self.pools.values().map(|p| p.config.clone()).collect()
    }

    /// Every pool's status.
    pub fn status(&self) -> Vec<PoolStatus> {
        self.pools.values().map(Pool::status).collect()
    }

    /// Whether the node is cordoned.
    pub fn draining(&self) -> bool {
        self.draining
    }

    /// Cordons (true) or uncordons the node; cordoned, every ready member
    /// goes and nothing is refilled.
    pub fn set_draining(&mut self, draining: bool) {
        self.draining = draining;
        if draining {
            for pool in self.pools.values_mut() {
                self.orphans.extend(pool.ready.drain(..));
            }
        }
    }

    /// Whether `key` is a pool.
    pub fn has(&self, key: &PoolKey) -> bool {
        self.pools.contains_key(key)
    }

    /// Idle members: ready and being made.
    pub fn idle(&self) -> usize {
        self.pools
            .values()
            .map(|p| p.ready.len() + p.refilling as usize)
            .sum()
    }

    /// Hands out a ready member of pool `key`, if it has one; counts the
    /// claim either way (a miss is served cold by the caller).
    pub fn take(&mut self, key: &PoolKey, now: Instant) -> Option<Ulid> {
        let pool = self.pools.get_mut(key)?;
        pool.demand(now);
        match pool.ready.pop_front() {
            Some(id) => {
                pool.claims += 1;
                Some(id)
            }
            None => {
                pool.misses += 1;
                None
            }
        }
    }

    /// A member handed out could not be claimed (it died meanwhile); the
    /// claim is not counted as served.
    pub fn unclaimed(&mut self, key: &PoolKey) {
        if let Some(pool) = self.pools.get_mut(key) {
            pool.claims = pool.claims.saturating_sub(1);
        }
    }

    /// A refill of `key` made member `id` in `took`; it joins the ready
    /// queue, or goes (returned true) when the pool no longer wants it.
    #[must_use]
    pub fn ready(&mut self, key: &PoolKey, id: Ulid, took: Duration) -> bool {
        let draining = self.draining;
        let Some(pool) = self.pools.get_mut(key) else {
            return true;
        };
        pool.refilling = pool.refilling.saturating_sub(1);
        pool.failures = 0;
        pool.retry_at = None;
        pool.last_error = None;
        pool.provision = Some(match pool.provision {
            Some(p) => (p * 3 + took) / 4,
            None => took,
        });
        if draining {
            return true;
        }
        pool.ready.push_back(id);
        false
    }

    /// A refill of `key` failed with `why`; retried after a backoff.
    pub fn failed(&mut self, key: &PoolKey, why: String, now: Instant) {
        if let Some(pool) = self.pools.get_mut(key) {
            pool.refilling = pool.refilling.saturating_sub(1);
            pool.failures += 1;
            let doublings = pool.failures.saturating_sub(1).min(16);
            let delay = (FIRST_RETRY * 2u32.pow(doublings)).min(MAX_RETRY);
            pool.retry_at = Some(now + delay);
            pool.last_error = Some(why);
        }
    }

    /// A ready member died or is being replaced: out of its queue.
    pub fn remove(&mut self, id: Ulid) {
        for pool in self.pools.values_mut() {
            pool.ready.retain(|r| *r != id);
        }
    }

    /// Ready members of `key`, oldest first.
    pub fn ready_members(&self, key: &PoolKey) -> Vec<Ulid> {
        self.pools
            .get(key)
            .map(|p| p.ready.iter().copied().collect())
            .unwrap_or_default()
    }

    /// What to do now: members to make (counted as refilling from here) and
    /// members to destroy (out of the queues from here).
    pub fn plan(&mut self, now: Instant) -> Plan {
        let mut plan = Plan {
            destroy: std::mem::take(&mut self.orphans),
            ..Plan::default()
        };
        if self.draining {
            return plan;
        }
        for pool in self.pools.values_mut() {
            // Decay: quiet for a decay period, the target is `warm` again.
            if pool.recent.back().is_none_or(|t| now - *t >= self.decay) {
                pool.target = pool.config.warm;
            }
            let have = pool.ready.len() as u32 + pool.refilling;
            if have < pool.target {
                if pool.retry_at.is_some_and(|t| now < t) {
                    continue;
                }
                // After a failure, one at a time until one succeeds.
                let n = if pool.failures > 0 {
                    u32::from(pool.refilling == 0)
                } else {
                    pool.target - have
                };
                if n > 0 {
                    pool.refilling += n;
                    plan.refill.push((pool.config.clone(), n));
                }
            }
            let ready = pool.ready.len() as u32;
            if ready > pool.target {
                let since = *pool.above_since.get_or_insert(now);
                if now - since >= self.decay {
                    for _ in pool.target..ready {
                        if let Some(id) = pool.ready.pop_back() {
                            plan.destroy.push(id);
                        }
                    }
                    pool.above_since = None;
                }
            } else {
                pool.above_since = None;
            }
        }
        plan
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(image: &str) -> PoolKey {
        PoolKey {
            image: image.into(),
            network: NetworkTier::None,
            size: SizeTier::Small,
        }
    }

    fn config(image: &str, warm: u32, warm_max: Option<u32>) -> PoolConfig {
        PoolConfig {
            key: key(image),
            warm,
            warm_max,
            warmup: None,
        }
    }

    fn spec(json: &str) -> PoolSet {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn specs_get_defaults_and_bad_ones_say_why() {
        let ok = |_: &PoolKey| Ok(());
        let set = spec(
            r#"{"pools": [{"image": "base"}, {"image": "base", "size": "large", "warm": 0, "warmMax": 8}]}"#,
        );
        let got = configs(&set, ok).unwrap();
        assert_eq!(got[0].warm, DEFAULT_WARM);
        assert_eq!(got[0].key.size, SizeTier::Small);
        assert_eq!((got[1].warm, got[1].warm_max), (0, Some(8)));
        for (json, why) in [
            (
                r#"{"pools": [{"image": "a"}, {"image": "a", "network": "none"}]}"#,
                "same image",
            ),
            (
                r#"{"pools": [{"image": "a", "warm": 5, "warmMax": 2}]}"#,
                "below warm",
            ),
            (r#"{"pools": [{"image": "a", "warm": 100000}]}"#, "at most"),
            (r#"{"pools": [{"image": "a", "warmup": []}]}"#, "warmup"),
        ] {
            let err = configs(&spec(json), ok).unwrap_err();
            assert!(err.contains(why), "{json}: {err}");
        }
        let err = configs(&spec(r#"{"pools": [{"image": "Bad!"}]}"#), |k| {
            Err(format!("bad image {}", k.image))
        })
        .unwrap_err();
        assert!(
            err.starts_with("pools[0]") && err.contains("bad image Bad!"),
            "{err}"
        );
        assert!(
            serde_json::from_str::<PoolSet>(r#"{"pools": [{"image": "a", "cpus": 2}]}"#).is_err()
        );
    }

    #[test]
    fn refills_fill_to_the_target_and_members_are_handed_out_once() {
        let mut pools = Pools::new(Duration::from_secs(60));
        pools.set(vec![config("base", 2, None)]);
        let now = Instant::now();
        let plan = pools.plan(now);
        assert_eq!(plan.refill.len(), 1);
        assert_eq!(plan.refill[0].1, 2);
        assert!(pools.plan(now).refill.is_empty(), "in flight counts");
        let (a, b) = (Ulid::new(), Ulid::new());
        assert!(!pools.ready(&key("base"), a, Duration::from_millis(80)));
        assert!(!pools.ready(&key("base"), b, Duration::from_millis(80)));
        assert_eq!(pools.take(&key("base"), now), Some(a));
        assert_eq!(pools.take(&key("base"), now), Some(b));
        assert_eq!(pools.take(&key("base"), now), None);
        assert_eq!(pools.take(&key("other"), now), None);
        let status = &pools.status()[0];
        assert_eq!((status.claims, status.misses, status.ready), (2, 1, 0));
        assert_eq!(pools.plan(now).refill[0].1, 2);
    }

    #[test]
    fn a_failing_refill_backs_off_and_reports() {
        let mut pools = Pools::new(Duration::from_secs(60));
        pools.set(vec![config("base", 3, None)]);
        let now = Instant::now();
        assert_eq!(pools.plan(now).refill[0].1, 3);
        for _ in 0..3 {
            pools.failed(&key("base"), "warmup exited 1".into(), now);
        }
        assert!(pools.plan(now).refill.is_empty(), "backing off");
        let later = now + Duration::from_secs(60);
        assert_eq!(
            pools.plan(later).refill[0].1,
            1,
            "one at a time after failures"
        );
        assert_eq!(
            pools.status()[0].last_error.as_deref(),
            Some("warmup exited 1")
        );
        assert!(!pools.ready(&key("base"), Ulid::new(), Duration::from_millis(50)));
        assert!(pools.status()[0].last_error.is_none());
    }

    #[test]
    fn the_target_rises_under_a_burst_and_decays() {
        let decay = Duration::from_secs(2);
        let mut pools = Pools::new(decay);
        pools.set(vec![config("base", 2, Some(8))]);
        let start = Instant::now();
        pools.plan(start);
        for _ in 0..2 {
            assert!(!pools.ready(&key("base"), Ulid::new(), Duration::from_millis(500)));
        }
        // Ten claims in 100 ms against a 500 ms provision time.
        for i in 0..10 {
            pools.take(&key("base"), start + Duration::from_millis(10 * i));
        }
        assert_eq!(pools.status()[0].target, 8);
        let plan = pools.plan(start + Duration::from_millis(100));
        assert_eq!(plan.refill[0].1, 8);
        for _ in 0..8 {
            let _ = pools.ready(&key("base"), Ulid::new(), Duration::from_millis(500));
        }
        // Quiet for a decay period: the target is back at warm, and the
        // extra members go only after another full period above it.
        let quiet = start + Duration::from_millis(100) + decay;
        let plan = pools.plan(quiet);
        assert_eq!(pools.status()[0].target, 2);
        assert!(plan.destroy.is_empty());
        let plan = pools.plan(quiet + decay);
        assert_eq!(plan.destroy.len(), 6);
        assert_eq!(pools.status()[0].ready, 2);
    }

    #[test]
    fn a_new_set_drains_what_it_leaves_out_and_draining_stops_refills() {
        let mut pools = Pools::new(Duration::from_secs(60));
        pools.set(vec![config("a", 1, None), config("b", 1, None)]);
        let now = Instant::now();
        pools.plan(now);
        let (a, b) = (Ulid::new(), Ulid::new());
        let _ = pools.ready(&key("a"), a, Duration::ZERO);
        let _ = pools.ready(&key("b"), b, Duration::ZERO);
        pools.set(vec![config("a", 3, None)]);
        let plan = pools.plan(now);
        assert_eq!(plan.destroy, vec![b]);
        assert_eq!(plan.refill[0].1, 2, "a keeps its member and grows");
        pools.set_draining(true);
        let plan = pools.plan(now);
        assert_eq!(plan.destroy, vec![a]);
        assert!(plan.refill.is_empty());
        assert!(
            pools.ready(&key("a"), Ulid::new(), Duration::ZERO),
            "made while draining: goes"
        );
        pools.set_draining(false);
        assert_eq!(pools.plan(now).refill[0].1, 2);
    }
}
