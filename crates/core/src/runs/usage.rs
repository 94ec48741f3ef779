//! A short usage history per run: what it used, sampled every
//! [`SAMPLE_EVERY`], the newest [`KEEP`] samples kept in memory.
//!
//! One task per manager samples every running run (idle pool members
//! included: a claim keeps their history) through `Sandbox::usage`, off the
//! async threads, and the samples live in the run's handle, so they go with
//! the run. A history is node-local and lost on restart: it answers "what
//! did this run use lately", not accounting (usage for tenants is its own
//! piece of state, kept durably).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use time::OffsetDateTime;
use ulid::Ulid;

use super::actor::RunHandle;
use super::Manager;
use crate::error::CoreError;
use crate::lane::{Lane, Usage};

/// How often every running run is sampled.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(5);

/// Samples kept per run: an hour's at [`SAMPLE_EVERY`].
pub const KEEP: usize = 720;

/// One sample of what a run used.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UsageSample {
    /// When it was taken.
    pub at: OffsetDateTime,
    /// CPU used since the previous sample (since the run started, for the
    /// first), as a percentage of the run's CPU limit (0 to 100).
    pub cpu_pct: f64,
    /// Memory charged, page cache included.
    pub memory_bytes: u64,
    /// The page cache part of `memory_bytes`.
    pub memory_cache_bytes: u64,
    /// Bytes written to the run's own volume, where measured.
    pub disk_used_bytes: Option<u64>,
}

/// A run's samples, oldest first, and what the next CPU share is taken
/// against.
#[derive(Debug, Default)]
pub(crate) struct History {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    samples: VecDeque<UsageSample>,
    /// The previous reading: when, and the CPU time used by then.
    last: Option<(OffsetDateTime, u64)>,
}

impl History {
    /// Adds a reading taken `at`, for a run with `cpus` CPUs created at
    /// `created`; the oldest sample goes once [`KEEP`] are held.
    pub fn record(
        &self,
        at: OffsetDateTime,
        usage: Usage,
        disk_used_bytes: Option<u64>,
        cpus: f64,
        created: OffsetDateTime,
    ) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let (since, cpu_before) = inner.last.unwrap_or((created, 0));
        let wall_ns = (at - since).whole_nanoseconds().max(1) as f64;
        let used = usage.cpu_ns.saturating_sub(cpu_before) as f64;
        let cpu_pct = (used / wall_ns / cpus.max(0.01) * 100.0).clamp(0.0, 100.0);
        inner.last = Some((at, usage.cpu_ns));
        if inner.samples.len() == KEEP {
            inner.samples.pop_front();
        }
        inner.samples.push_back(UsageSample {
            at,
            cpu_pct: (cpu_pct * 100.0).round() / 100.0,
            memory_bytes: usage.memory_bytes,
            memory_cache_bytes: usage.memory_cache_bytes,
            disk_used_bytes,
        });
    }

    /// The samples taken in `[from, to]` (either end open when None),
    /// oldest first.
    pub fn window(
        &self,
        from: Option<OffsetDateTime>,
        to: Option<OffsetDateTime>,
    ) -> Vec<UsageSample> {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner
            .samples
            .iter()
            .filter(|s| from.is_none_or(|f| s.at >= f) && to.is_none_or(|t| s.at <= t))
            .copied()
            .collect()
    }
}

/// Takes one sample of every running run among `handles`.
fn sample_usage(handles: &[Arc<RunHandle>], lane: &dyn Lane) {
    for handle in handles {
        let snapshot = handle.snapshot();
        if !matches!(
            snapshot.phase,
            super::phase::Phase::Running
                | super::phase::Phase::Paused
                | super::phase::Phase::Pooled
        ) {
            continue;
        }
        let Some(usage) = lane.sandbox(handle.id).usage() else {
            continue;
        };
        let record = &snapshot.record;
        handle.usage.record(
            OffsetDateTime::now_utc(),
            usage,
            lane.sandbox(handle.id).disk_used(),
            record.limits.cpus,
            record.created_at,
        );
    }
}

impl Manager {
    /// Starts the sampler; it ends when the manager is dropped.
    pub(crate) fn spawn_usage_sampler(self: &Arc<Self>) {
        let manager: Weak<Manager> = Arc::downgrade(self);
        tokio::spawn(async move {
            let start = tokio::time::Instant::now() + SAMPLE_EVERY;
            let mut tick = tokio::time::interval_at(start, SAMPLE_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                // The manager is held only to copy out what a sample needs,
                // never across the blocking reads: a sample must not keep a
                // manager that is being shut down alive.
                let (handles, lane) = match manager.upgrade() {
                    Some(m) => (
                        m.registry().values().cloned().collect::<Vec<_>>(),
                        Arc::clone(&m.lane),
                    ),
                    None => return,
                };
                // cgroup files are read with blocking calls.
                let sampled =
                    tokio::task::spawn_blocking(move || sample_usage(&handles, lane.as_ref()))
                        .await;
                if let Err(e) = sampled {
                    tracing::error!(error = %e, "the usage sampler failed");
                }
            }
        });
    }

    /// Run `id`'s usage samples taken in `[from, to]`, oldest first.
    pub fn usage_history(
        &self,
        id: Ulid,
        from: Option<OffsetDateTime>,
        to: Option<OffsetDateTime>,
    ) -> Result<Vec<UsageSample>, CoreError> {
        Ok(self.handle(id)?.usage.window(from, to))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(cpu_ns: u64) -> Usage {
        Usage {
            cpu_ns,
            memory_bytes: 1 << 20,
            memory_cache_bytes: 1 << 10,
            memory_peak_bytes: None,
        }
    }

    #[test]
    fn cpu_is_shared_between_samples_and_capped() {
        let h = History::default();
        let t0 = OffsetDateTime::UNIX_EPOCH + Duration::from_secs(1_000);
        // Half a CPU-second over the first second, on one CPU.
        h.record(
            t0 + Duration::from_secs(1),
            usage(500_000_000),
            None,
            1.0,
            t0,
        );
        // Then a whole CPU-second in five seconds on two CPUs: 10 %.
        h.record(
            t0 + Duration::from_secs(6),
            usage(1_500_000_000),
            Some(7),
            2.0,
            t0,
        );
        // A counter that went backwards (a restarted cgroup) is no use.
        h.record(t0 + Duration::from_secs(7), usage(0), None, 1.0, t0);
        let all = h.window(None, None);
        let pcts: Vec<f64> = all.iter().map(|s| s.cpu_pct).collect();
        assert_eq!(pcts, [50.0, 10.0, 0.0]);
        assert_eq!(all[1].disk_used_bytes, Some(7));
    }

    #[test]
    fn windows_select_samples_and_the_oldest_go_first() {
        let h = History::default();
        let t0 = OffsetDateTime::UNIX_EPOCH;
        for i in 0..(KEEP as u64 + 10) {
            h.record(
                t0 + Duration::from_secs(5 * (i + 1)),
                usage(i),
                None,
                1.0,
                t0,
            );
        }
        let all = h.window(None, None);
        assert_eq!(all.len(), KEEP);
        assert_eq!(all[0].at, t0 + Duration::from_secs(5 * 11));
        let some = h.window(
            Some(t0 + Duration::from_secs(100)),
            Some(t0 + Duration::from_secs(110)),
        );
        assert_eq!(some.len(), 3);
        assert!(h
            .window(Some(t0), Some(t0 + Duration::from_secs(40)))
            .is_empty());
    }
}
