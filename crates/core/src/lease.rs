//! Writable leases: exclusive, time-limited ownership of a run's writes,
//! fenced by a generation number. Pure state machine — no I/O, no clock of
//! its own (every call takes `now`) — so it is tested without a daemon.
//!
//! ```text
//!                 acquire (bumps generation)
//!   ┌──────────┐ ───────────────────────────► ┌──────────────────┐
//!   │   free   │                              │ held by H, gen G │ ◄─┐ renew(H, G)
//!   └──────────┘ ◄─────────────────────────── └──────────────────┘ ──┘ acquire(H) → gen G+1
//!        ▲          release(H, G)                   │
//!        │                                          │ now ≥ expiresAt
//!        │                                          ▼
//!        │    acquire by anyone (gen G+1)   ┌──────────────────┐
//!        └──────────── (via held) ───────── │ lapsed (= free   │
//!                                           │ for every check) │
//!                                           └──────────────────┘
//! ```
//!
//! Rules:
//! - The generation is the fencing token. It is issued by every grant and
//!   never goes down, not even after a release, so a credential, once
//!   superseded, stays superseded.
//! - Execs and file writes ([`Fence::begin`]) pass when no lease is active or
//!   when they carry the active lease's exact holder and generation.
//! - Expiry is lazy: nothing sweeps leases. A lapsed lease is treated as free
//!   by every check, and the next grant bumps the generation, which fences
//!   the old holder for good.
//! - A grant is refused while any exec or file write is in flight, so a
//!   takeover never happens under a running operation. An in-flight
//!   operation is never interrupted by expiry or by a new grant — there can
//!   be none, since grants wait for the run to be idle.
//!
//! What this does not do: authenticate owners. An owner name is what the
//! caller says it is; anyone with the API token can act under any name. A
//! lease coordinates cooperating clients (an agent and a human) and fences
//! stale ones; it is not an access-control boundary.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

pub use runbox_types::Lease;

/// The persistent part of a run's lease state: the current (possibly lapsed)
/// lease and the last generation issued. Stored with the run record, so a
/// lease and its generation survive a daemon restart.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LeaseBook {
    /// The last lease granted, until it is released (it may have lapsed).
    #[serde(default)]
    pub lease: Option<Lease>,
    /// The last generation issued; 0 when none ever was.
    #[serde(default)]
    pub generation: u64,
}

/// What a caller presents to act under a lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Credential<'a> {
    /// Who the caller says it is.
    pub owner: &'a str,
    /// The generation it was granted.
    pub generation: u64,
}

/// Why a lease operation or a fenced operation was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LeaseError {
    /// An exec or file write is in flight; grants wait for the run to be idle.
    #[error("{0} exec(s) or file write(s) are in flight on this run; a lease is granted only between operations, try again when they end")]
    Busy(usize),
    /// Someone else holds the active lease (or no credential was given).
    #[error("the run is leased to {holder:?} (generation {generation}) until {expires_at}; only that holder may exec or write until it releases the lease or the lease lapses")]
    Leased {
        /// The active holder.
        holder: String,
        /// The active generation.
        generation: u64,
        /// When the active lease lapses.
        expires_at: String,
    },
    /// The credential's generation was replaced by a later grant.
    #[error("generation {presented} was superseded by a later grant (current generation {current}); acquire the lease again")]
    Superseded {
        /// The generation presented.
        presented: u64,
        /// The latest generation issued.
        current: u64,
    },
    /// The lease named lapsed before this call; renewal cannot revive it.
    #[error("the lease lapsed at {expired_at}; acquire it again (the generation will change)")]
    Expired {
        /// When it lapsed.
        expired_at: String,
    },
    /// No lease is held that this credential could refer to.
    #[error("no lease with generation {presented} is held on this run; acquire one first")]
    NotLeased {
        /// The generation presented.
        presented: u64,
    },
}

fn rfc3339(t: OffsetDateTime) -> String {
    t.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|_| t.to_string())
}

impl LeaseBook {
    /// The lease in force at `now`, if any (a lapsed lease is not).
    pub fn active(&self, now: OffsetDateTime) -> Option<&Lease> {
        self.lease.as_ref().filter(|l| l.expires_at > now)
    }

    /// The refusal for a credential that does not match the active lease
    /// `lease`, or for no credential at all.
    fn refuse(&self, lease: &Lease, presented: Option<Credential<'_>>) -> LeaseError {
        match presented {
            Some(c) if c.generation < self.generation => LeaseError::Superseded {
                presented: c.generation,
                current: self.generation,
            },
            _ => LeaseError::Leased {
                holder: lease.holder.clone(),
                generation: lease.generation,
                expires_at: rfc3339(lease.expires_at),
            },
        }
    }

    /// The refusal for a renew or release whose credential names no lease
    /// that can be renewed or released.
    fn mismatch(&self, c: Credential<'_>, now: OffsetDateTime) -> LeaseError {
        match self.active(now) {
            Some(lease) => self.refuse(lease, Some(c)),
            None if c.generation < self.generation => LeaseError::Superseded {
                presented: c.generation,
                current: self.generation,
            },
            None => LeaseError::NotLeased {
                presented: c.generation,
            },
        }
    }

    /// The lease named by `c`, if it is the current one (lapsed or not).
    fn named(&self, c: Credential<'_>) -> Option<&Lease> {
        self.lease
            .as_ref()
            .filter(|l| l.holder == c.owner && l.generation == c.generation)
    }

    /// Grants the lease to `owner` for `ttl`: when it is free or lapsed, or
    /// when `owner` already holds it (a re-grant). Every grant issues a new
    /// generation. Refused while operations are in flight or while another
    /// owner holds an active lease.
    pub fn acquire(
        &mut self,
        owner: &str,
        ttl: Duration,
        now: OffsetDateTime,
        in_flight: usize,
    ) -> Result<Lease, LeaseError> {
        if let Some(lease) = self.active(now) {
            if lease.holder != owner {
                return Err(self.refuse(lease, None));
            }
        }
        if in_flight > 0 {
            return Err(LeaseError::Busy(in_flight));
        }
        self.generation += 1;
        let lease = Lease {
            holder: owner.to_owned(),
            generation: self.generation,
            expires_at: now + ttl,
        };
        self.lease = Some(lease.clone());
        Ok(lease)
    }

    /// Extends the active lease named by `c` to `now + ttl`. A lapsed lease
    /// cannot be renewed: between its expiry and now, anyone could write.
    pub fn renew(
        &mut self,
        c: Credential<'_>,
        ttl: Duration,
        now: OffsetDateTime,
    ) -> Result<Lease, LeaseError> {
        match self.named(c) {
            Some(lease) if lease.expires_at <= now => Err(LeaseError::Expired {
                expired_at: rfc3339(lease.expires_at),
            }),
            Some(_) => {
                let lease = self.lease.as_mut().expect("named() found it");
                lease.expires_at = now + ttl;
                Ok(lease.clone())
            }
            None => Err(self.mismatch(c, now)),
        }
    }

    /// Releases the lease named by `c`. Releasing one that lapsed but was not
    /// re-granted succeeds: it was free already and nobody else holds it.
    pub fn release(&mut self, c: Credential<'_>, now: OffsetDateTime) -> Result<(), LeaseError> {
        if self.named(c).is_some() {
            self.lease = None;
            Ok(())
        } else {
            Err(self.mismatch(c, now))
        }
    }

    /// Whether an exec or file write with `presented` may start at `now`.
    pub fn admit(
        &self,
        presented: Option<Credential<'_>>,
        now: OffsetDateTime,
    ) -> Result<(), LeaseError> {
        match self.active(now) {
            None => Ok(()),
            Some(lease) => match presented {
                Some(c) if c.owner == lease.holder && c.generation == lease.generation => Ok(()),
                _ => Err(self.refuse(lease, presented)),
            },
        }
    }
}

/// A run's lease state plus the operations in flight on it. The daemon keeps
/// one per run behind a mutex, so admitting an operation and granting a lease
/// can never interleave.
#[derive(Clone, Debug, Default)]
pub struct Fence {
    /// The persistent lease state.
    pub book: LeaseBook,
    /// Execs and file writes admitted and not yet ended.
    pub in_flight: usize,
}

impl Fence {
    /// A fence over a stored book, with nothing in flight (operations do not
    /// survive a restart).
    pub fn new(book: LeaseBook) -> Fence {
        Fence { book, in_flight: 0 }
    }

    /// Admits an exec or file write and counts it in flight. Every `Ok` must
    /// be matched by exactly one [`Fence::end`].
    pub fn begin(
        &mut self,
        presented: Option<Credential<'_>>,
        now: OffsetDateTime,
    ) -> Result<(), LeaseError> {
        self.book.admit(presented, now)?;
        self.in_flight += 1;
        Ok(())
    }

    /// Ends an operation admitted by [`Fence::begin`].
    pub fn end(&mut self) {
        debug_assert!(self.in_flight > 0, "Fence::end without begin");
        self.in_flight = self.in_flight.saturating_sub(1);
    }

    /// [`LeaseBook::acquire`] with this fence's in-flight count.
    pub fn acquire(
        &mut self,
        owner: &str,
        ttl: Duration,
        now: OffsetDateTime,
    ) -> Result<Lease, LeaseError> {
        self.book.acquire(owner, ttl, now, self.in_flight)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MIN: Duration = Duration::from_secs(60);

    fn t0() -> OffsetDateTime {
        OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap()
    }

    fn cred(owner: &str, generation: u64) -> Option<Credential<'_>> {
        Some(Credential { owner, generation })
    }

    #[test]
    fn no_lease_admits_everyone() {
        let book = LeaseBook::default();
        assert_eq!(book.admit(None, t0()), Ok(()));
        assert_eq!(book.admit(cred("anyone", 7), t0()), Ok(()));
    }

    #[test]
    fn every_grant_bumps_the_generation() {
        let mut book = LeaseBook::default();
        let a = book.acquire("alice", MIN, t0(), 0).unwrap();
        assert_eq!(a.generation, 1);
        // Re-acquire by the same owner: a new generation.
        let a2 = book.acquire("alice", MIN, t0(), 0).unwrap();
        assert_eq!(a2.generation, 2);
        // Re-grant to someone else after expiry: another one.
        let later = t0() + MIN * 2;
        let b = book.acquire("bob", MIN, later, 0).unwrap();
        assert_eq!(b.generation, 3);
        assert_eq!(b.holder, "bob");
        assert_eq!(b.expires_at, later + MIN);
    }

    #[test]
    fn an_active_lease_fences_others() {
        let mut book = LeaseBook::default();
        let lease = book.acquire("alice", MIN, t0(), 0).unwrap();
        assert_eq!(book.admit(cred("alice", lease.generation), t0()), Ok(()));
        assert!(matches!(
            book.admit(None, t0()),
            Err(LeaseError::Leased { ref holder, generation: 1, .. }) if holder == "alice"
        ));
        assert!(matches!(
            book.admit(cred("bob", 1), t0()),
            Err(LeaseError::Leased { .. })
        ));
        // A generation never issued is foreign too.
        assert!(matches!(
            book.admit(cred("alice", 9), t0()),
            Err(LeaseError::Leased { .. })
        ));
        assert!(matches!(
            book.acquire("bob", MIN, t0(), 0),
            Err(LeaseError::Leased { .. })
        ));
    }

    #[test]
    fn a_regrant_supersedes_the_old_credential() {
        let mut book = LeaseBook::default();
        let old = book.acquire("alice", MIN, t0(), 0).unwrap();
        let now = t0() + MIN; // lapsed exactly at expiry
        assert_eq!(book.active(now), None);
        // While lapsed and not re-granted, writes pass for everyone.
        assert_eq!(book.admit(None, now), Ok(()));
        let new = book.acquire("bob", MIN, now, 0).unwrap();
        let c = cred("alice", old.generation);
        assert!(matches!(
            book.admit(c, now),
            Err(LeaseError::Superseded {
                presented: 1,
                current: 2
            })
        ));
        assert!(matches!(
            book.renew(c.unwrap(), MIN, now),
            Err(LeaseError::Superseded { .. })
        ));
        assert!(matches!(
            book.release(c.unwrap(), now),
            Err(LeaseError::Superseded { .. })
        ));
        assert_eq!(book.admit(cred("bob", new.generation), now), Ok(()));
    }

    #[test]
    fn renew_extends_only_the_active_named_lease() {
        let mut book = LeaseBook::default();
        let lease = book.acquire("alice", MIN, t0(), 0).unwrap();
        let c = Credential {
            owner: "alice",
            generation: lease.generation,
        };
        let now = t0() + Duration::from_secs(30);
        let renewed = book.renew(c, MIN, now).unwrap();
        assert_eq!(renewed.expires_at, now + MIN);
        assert_eq!(renewed.generation, lease.generation);
        // Wrong owner with the right generation: not theirs.
        let bob = Credential {
            owner: "bob",
            generation: lease.generation,
        };
        assert!(matches!(
            book.renew(bob, MIN, now),
            Err(LeaseError::Leased { .. })
        ));
        // After it lapsed: refused even to the holder.
        let late = now + MIN * 2;
        assert!(matches!(
            book.renew(c, MIN, late),
            Err(LeaseError::Expired { .. })
        ));
    }

    #[test]
    fn release_frees_and_mismatches_are_refused() {
        let mut book = LeaseBook::default();
        let lease = book.acquire("alice", MIN, t0(), 0).unwrap();
        let c = Credential {
            owner: "alice",
            generation: lease.generation,
        };
        let bob = Credential {
            owner: "bob",
            generation: lease.generation,
        };
        assert!(book.release(bob, t0()).is_err());
        assert_eq!(book.release(c, t0()), Ok(()));
        assert_eq!(book.active(t0()), None);
        // Released: the same credential names nothing any more.
        assert!(matches!(
            book.release(c, t0()),
            Err(LeaseError::NotLeased { presented: 1 })
        ));
        assert!(matches!(
            book.renew(c, MIN, t0()),
            Err(LeaseError::NotLeased { .. })
        ));
        // The next grant still moves on from the last generation.
        assert_eq!(book.acquire("bob", MIN, t0(), 0).unwrap().generation, 2);
    }

    #[test]
    fn release_of_a_lapsed_lease_is_accepted() {
        let mut book = LeaseBook::default();
        let lease = book.acquire("alice", MIN, t0(), 0).unwrap();
        let c = Credential {
            owner: "alice",
            generation: lease.generation,
        };
        assert_eq!(book.release(c, t0() + MIN * 3), Ok(()));
        assert_eq!(book.lease, None);
    }

    #[test]
    fn grants_wait_for_operations_in_flight() {
        let mut fence = Fence::default();
        fence.begin(None, t0()).unwrap();
        assert_eq!(fence.acquire("alice", MIN, t0()), Err(LeaseError::Busy(1)));
        fence.end();
        let lease = fence.acquire("alice", MIN, t0()).unwrap();
        // The holder's own exec in flight blocks its re-grant too.
        fence.begin(cred("alice", lease.generation), t0()).unwrap();
        assert_eq!(fence.acquire("alice", MIN, t0()), Err(LeaseError::Busy(1)));
        // Another owner learns it is leased, not busy.
        assert!(matches!(
            fence.acquire("bob", MIN, t0()),
            Err(LeaseError::Leased { .. })
        ));
        fence.end();
        assert_eq!(fence.in_flight, 0);
    }

    #[test]
    fn the_book_round_trips_through_json() {
        let mut book = LeaseBook::default();
        book.acquire("alice", MIN, t0(), 0).unwrap();
        let json = serde_json::to_string(&book).unwrap();
        let back: LeaseBook = serde_json::from_str(&json).unwrap();
        assert_eq!(back, book);
        // Records written before leases existed have no book.
        let empty: LeaseBook = serde_json::from_str("{}").unwrap();
        assert_eq!(empty, LeaseBook::default());
    }

    /// One step of a random history.
    #[derive(Clone, Debug)]
    enum Op {
        Acquire {
            owner: usize,
            ttl: u64,
        },
        Renew {
            owner: usize,
            gen_back: u64,
            ttl: u64,
        },
        Release {
            owner: usize,
            gen_back: u64,
        },
        /// Begin an exec (ends later) with a credential or none.
        Exec {
            owner: Option<usize>,
            gen_back: u64,
        },
        /// A file write: begins and ends at once.
        Write {
            owner: Option<usize>,
            gen_back: u64,
        },
        EndOne,
        Advance {
            secs: u64,
        },
    }

    const OWNERS: [&str; 3] = ["alice", "bob", "carol"];

    fn op() -> impl Strategy<Value = Op> {
        let owner = 0..OWNERS.len();
        let gen_back = 0u64..3;
        let ttl = 1u64..120;
        prop_oneof![
            (owner.clone(), ttl.clone()).prop_map(|(owner, ttl)| Op::Acquire { owner, ttl }),
            (owner.clone(), gen_back.clone(), ttl).prop_map(|(owner, gen_back, ttl)| Op::Renew {
                owner,
                gen_back,
                ttl
            }),
            (owner.clone(), gen_back.clone())
                .prop_map(|(owner, gen_back)| Op::Release { owner, gen_back }),
            (proptest::option::of(owner.clone()), gen_back.clone())
                .prop_map(|(owner, gen_back)| Op::Exec { owner, gen_back }),
            (proptest::option::of(owner), gen_back)
                .prop_map(|(owner, gen_back)| Op::Write { owner, gen_back }),
            Just(Op::EndOne),
            (0u64..150).prop_map(|secs| Op::Advance { secs }),
        ]
    }

    proptest! {
        /// No operation with a stale or foreign credential passes while a
        /// lease is active; generations only grow; a grant never happens
        /// with an operation in flight; each holder's credential is the only
        /// one that passes.
        #[test]
        fn fencing_holds_over_random_histories(ops in proptest::collection::vec(op(), 1..80)) {
            let mut fence = Fence::default();
            let mut now = t0();
            // What each owner believes its latest generation is.
            let mut believed: [u64; 3] = [0; 3];
            let mut last_generation = 0u64;
            for op in ops {
                let before = fence.book.clone();
                match op {
                    Op::Acquire { owner, ttl } => {
                        let in_flight = fence.in_flight;
                        if let Ok(lease) = fence.acquire(OWNERS[owner], Duration::from_secs(ttl), now) {
                            prop_assert_eq!(in_flight, 0, "granted under an operation");
                            prop_assert!(lease.generation > last_generation);
                            if let Some(prev) = before.active(now) {
                                prop_assert_eq!(&prev.holder, OWNERS[owner], "took over an active lease");
                            }
                            believed[owner] = lease.generation;
                        }
                    }
                    Op::Renew { owner, gen_back, ttl } => {
                        let generation = believed[owner].saturating_sub(gen_back);
                        let c = Credential { owner: OWNERS[owner], generation };
                        if fence.book.renew(c, Duration::from_secs(ttl), now).is_ok() {
                            let prev = before.active(now);
                            prop_assert!(prev.is_some_and(|l| l.holder == c.owner && l.generation == c.generation),
                                "renewed a lease it does not hold");
                        }
                    }
                    Op::Release { owner, gen_back } => {
                        let generation = believed[owner].saturating_sub(gen_back);
                        let c = Credential { owner: OWNERS[owner], generation };
                        if fence.book.release(c, now).is_ok() {
                            if let Some(prev) = before.active(now) {
                                prop_assert!(prev.holder == c.owner && prev.generation == c.generation,
                                    "released someone else's active lease");
                            }
                        }
                    }
                    Op::Exec { owner, gen_back } | Op::Write { owner, gen_back } => {
                        let c = owner.map(|o| Credential {
                            owner: OWNERS[o],
                            generation: believed[o].saturating_sub(gen_back),
                        });
                        let passed = fence.begin(c, now).is_ok();
                        if let Some(active) = before.active(now) {
                            let exact = c.is_some_and(|c| c.owner == active.holder && c.generation == active.generation);
                            prop_assert_eq!(passed, exact, "fencing decided wrongly");
                        } else {
                            prop_assert!(passed, "refused with no active lease");
                        }
                        if passed && matches!(op, Op::Write { .. }) {
                            fence.end();
                        }
                    }
                    Op::EndOne => {
                        if fence.in_flight > 0 {
                            fence.end();
                        }
                    }
                    Op::Advance { secs } => now += Duration::from_secs(secs),
                }
                prop_assert!(fence.book.generation >= last_generation, "generation went down");
                last_generation = fence.book.generation;
                if let Some(lease) = &fence.book.lease {
                    prop_assert!(lease.generation <= fence.book.generation);
                }
            }
        }
    }
}
