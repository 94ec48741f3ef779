//! Host id ranges for runs' user namespaces: each run's uids and gids
//! 0-65535 are a range of 65536 host ids that no other live run has.
//!
//! The node's ranges come from `--userns-range START:COUNT` (by default
//! [`DEFAULT_START`] and [`DEFAULT_COUNT`]: above the ids ordinary host users,
//! system users and systemd's container range use, below 2^31, where some
//! tools start to misread ids as negative). The allocation itself is not
//! stored apart: each run's record names its range, and a restarted daemon
//! claims the ranges of the runs it finds again before it gives out any.
//! A range goes back when its run is destroyed.
//!
//! A fork's writable layer keeps the host ids its parent wrote it with (the
//! fork sees them in its own range through an idmapped mount), so a range
//! can have more than one holder: the run whose namespace it is, and every
//! run whose disk holds files in it ([`IdRanges::hold`]). It is free again
//! only when the last of them gives it back, so no unrelated run is given
//! the ids a live run's files are stored with.

use std::collections::BTreeMap;

/// Ids in one run's range.
pub const RANGE: u32 = 65536;

/// The first host id of the default pool: 0x70000000, just above the
/// range systemd gives containers (524288-1879048191).
pub const DEFAULT_START: u32 = 0x7000_0000;

/// Ids in the default pool: up to 2^31, 4096 ranges.
pub const DEFAULT_COUNT: u32 = 0x1000_0000;

/// The node's pool of ranges and which are taken.
#[derive(Clone, Debug)]
pub struct IdRanges {
    start: u32,
    slots: u32,
    /// Taken slots (range `i` starts at `start + i * RANGE`) and how many
    /// holders each has (at least one).
    taken: BTreeMap<u32, u32>,
}

impl IdRanges {
    /// The pool of `count` ids from `start`: whole ranges only, clear of
    /// host root's range (ids below 65536) and within the 32-bit id space
    /// (the last id, 2^32-1, is "no id" to the kernel).
    pub fn new(start: u32, count: u32) -> Result<IdRanges, String> {
        if start < RANGE {
            return Err(format!(
                "the user namespace range must start at {RANGE} or above (ids below are the host's own users), not {start}"
            ));
        }
        if count < RANGE {
            return Err(format!(
                "the user namespace range must hold at least one run's {RANGE} ids, not {count}"
            ));
        }
        if u64::from(start) + u64::from(count) > u64::from(u32::MAX) {
            return Err(format!(
                "the user namespace range {start}:{count} runs past the last host id ({})",
                u32::MAX - 1
            ));
        }
        Ok(IdRanges {
            start,
            slots: count / RANGE,
            taken: BTreeMap::new(),
        })
    }

    /// Parses `START:COUNT` (`--userns-range`).
    pub fn parse(text: &str) -> Result<IdRanges, String> {
        let (start, count) = text.split_once(':').ok_or_else(|| {
            format!("{text:?} is not START:COUNT (for example {DEFAULT_START}:{DEFAULT_COUNT})")
        })?;
        let number = |s: &str, what: &str| {
            s.trim()
                .parse::<u32>()
                .map_err(|_| format!("{what} {s:?} in {text:?} is not a number of 0-{}", u32::MAX))
        };
        IdRanges::new(number(start, "START")?, number(count, "COUNT")?)
    }

    /// How many ranges the pool has.
    pub fn capacity(&self) -> u32 {
        self.slots
    }

    /// How many are free.
    pub fn free(&self) -> u32 {
        self.slots - self.taken.len() as u32
    }

    /// Takes the lowest free range; its first host id. None when every
    /// range is taken.
    pub fn take(&mut self) -> Option<u32> {
        let slot = (0..self.slots).find(|s| !self.taken.contains_key(s))?;
        self.taken.insert(slot, 1);
        Some(self.base(slot))
    }

    /// Marks the range from `base` taken (a run found again at start);
    /// false when `base` is not a range of this pool or is taken already,
    /// so the caller gives that run another.
    pub fn claim(&mut self, base: u32) -> bool {
        match self.slot(base) {
            Some(slot) if !self.taken.contains_key(&slot) => {
                self.taken.insert(slot, 1);
                true
            }
            _ => false,
        }
    }

    /// Adds a holder to the range from `base`, taken or not (a disk whose
    /// files are stored with its ids); false when `base` is not a range of
    /// this pool, which then has nothing to keep.
    pub fn hold(&mut self, base: u32) -> bool {
        match self.slot(base) {
            Some(slot) => {
                *self.taken.entry(slot).or_insert(0) += 1;
                true
            }
            None => false,
        }
    }

    /// Gives one holder's share of the range from `base` back; the range is
    /// free once no one holds it. A base not taken is ignored.
    pub fn give_back(&mut self, base: u32) {
        if let Some(slot) = self.slot(base) {
            if let std::collections::btree_map::Entry::Occupied(mut held) = self.taken.entry(slot) {
                *held.get_mut() -= 1;
                if *held.get() == 0 {
                    held.remove();
                }
            }
        }
    }

    fn base(&self, slot: u32) -> u32 {
        self.start + slot * RANGE
    }

    fn slot(&self, base: u32) -> Option<u32> {
        let offset = base.checked_sub(self.start)?;
        (offset % RANGE == 0 && offset / RANGE < self.slots).then_some(offset / RANGE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_default_pool_is_valid_and_below_2_31() {
        let pool = IdRanges::new(DEFAULT_START, DEFAULT_COUNT).unwrap();
        assert_eq!(pool.capacity(), 4096);
        assert!(u64::from(DEFAULT_START) + u64::from(DEFAULT_COUNT) <= 1 << 31);
    }

    #[test]
    fn bad_pools_are_refused_with_the_reason() {
        for (text, want) in [
            ("0:65536", "start at 65536"),
            ("100000:10", "at least one run"),
            ("4294901760:131072", "past the last host id"),
            ("100000", "START:COUNT"),
            ("x:65536", "START \"x\""),
            ("100000:-1", "COUNT \"-1\""),
        ] {
            let err = IdRanges::parse(text).unwrap_err();
            assert!(err.contains(want), "{text}: {err}");
        }
        assert_eq!(IdRanges::parse("100000:200000").unwrap().capacity(), 3);
    }

    #[test]
    fn ranges_are_taken_lowest_first_claimed_and_given_back() {
        let mut pool = IdRanges::new(1 << 20, 3 * RANGE).unwrap();
        assert!(pool.claim((1 << 20) + RANGE));
        assert!(!pool.claim((1 << 20) + RANGE), "taken twice");
        assert!(!pool.claim((1 << 20) + 1), "not a range's start");
        assert!(!pool.claim(1 << 19), "below the pool");
        assert!(!pool.claim((1 << 20) + 3 * RANGE), "past the pool");
        assert_eq!(pool.take(), Some(1 << 20));
        assert_eq!(pool.take(), Some((1 << 20) + 2 * RANGE));
        assert_eq!(pool.take(), None);
        assert_eq!(pool.free(), 0);
        pool.give_back((1 << 20) + RANGE);
        pool.give_back(12345);
        assert_eq!(pool.free(), 1);
        assert_eq!(pool.take(), Some((1 << 20) + RANGE));
    }

    #[test]
    fn a_held_range_is_free_only_after_its_last_holder() {
        let mut pool = IdRanges::new(1 << 20, 2 * RANGE).unwrap();
        let parent = pool.take().unwrap();
        // A fork's disk holds the parent's range; the parent goes first.
        assert!(pool.hold(parent));
        pool.give_back(parent);
        assert_eq!(pool.free(), 1);
        assert_eq!(pool.take(), Some(parent + RANGE), "not the held one");
        pool.give_back(parent);
        assert_eq!(pool.free(), 1);
        assert_eq!(pool.take(), Some(parent));
        // Host ids and foreign ranges have nothing to hold.
        assert!(!pool.hold(0));
        assert!(!pool.hold(parent + 1));
        // A held range cannot be claimed as a namespace at start.
        let mut again = IdRanges::new(1 << 20, 2 * RANGE).unwrap();
        assert!(again.hold(parent));
        assert!(!again.claim(parent));
    }

    proptest! {
        /// Whatever the order of takes and give-backs, no two live holders
        /// share a range, and every range stays inside the pool.
        #[test]
        fn live_ranges_never_overlap(ops in proptest::collection::vec(any::<(u8, u8)>(), 1..200)) {
            let start = 10 * RANGE;
            let mut pool = IdRanges::new(start, 8 * RANGE).unwrap();
            // Namespaces (one per live run) and disks holding a range.
            let mut live: Vec<u32> = Vec::new();
            let mut disks: Vec<u32> = Vec::new();
            for (op, pick) in ops {
                match op % 4 {
                    0 | 1 => match pool.take() {
                        Some(base) => {
                            prop_assert!(!live.contains(&base) && !disks.contains(&base));
                            prop_assert!(base >= start && base + RANGE <= start + 8 * RANGE);
                            live.push(base);
                        }
                        None => {
                            let mut held: Vec<u32> = live.iter().chain(&disks).copied().collect();
                            held.sort_unstable();
                            held.dedup();
                            prop_assert_eq!(held.len(), 8);
                        }
                    },
                    // A fork of a live run: its disk holds the parent's range.
                    2 if !live.is_empty() => {
                        let base = live[usize::from(pick) % live.len()];
                        prop_assert!(pool.hold(base));
                        disks.push(base);
                    }
                    _ if !disks.is_empty() && pick % 2 == 0 => {
                        let base = disks.remove(usize::from(pick) % disks.len());
                        pool.give_back(base);
                    }
                    _ if !live.is_empty() => {
                        let base = live.remove(usize::from(pick) % live.len());
                        pool.give_back(base);
                    }
                    _ => {}
                }
                let mut held: Vec<u32> = live.iter().chain(&disks).copied().collect();
                held.sort_unstable();
                held.dedup();
                prop_assert_eq!(pool.free() as usize, 8 - held.len());
            }
        }
    }
}
