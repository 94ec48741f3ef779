//! When runs are destroyed, and how hard destruction is retried.
//!
//! There is no sweeping loop: every run's owner ([`super::actor`]) sleeps
//! until its own expiry and stops itself, so expiring a thousand runs costs
//! a thousand timers and no scan. What this module owns is the policy every
//! owner follows:
//!
//! * [`deadline`]: a stored wall-clock expiry as a timer deadline;
//! * a shared background budget (a semaphore of [`budget_for`] permits, or
//!   `--refill-concurrency`), held across each `Sandbox::destroy` call and
//!   shared with pool refills and forks, so a mass expiry or a start-up
//!   full of dead runs tears down many at once but never floods the
//!   runtime; teardowns may hold only [`teardown_share`] of it, so refills
//!   always keep a slot;
//! * [`backoff`]: how long a run whose destruction failed waits before the
//!   next attempt. It keeps its record (status `stopping`, the error in
//!   `failure`) and its capacity slot until an attempt succeeds, and every
//!   failure is logged.

use std::time::Duration;

use time::OffsetDateTime;

/// The first retry delay after a failed teardown.
const FIRST_RETRY: Duration = Duration::from_millis(500);

/// The longest delay between teardown attempts.
const MAX_RETRY: Duration = Duration::from_secs(60);

/// The background budget (`--refill-concurrency 0`) on a host with `cpus`
/// processors: two thirds of them, at least 4 and at most 256. Refills,
/// forks and teardowns are mostly waiting on the runtime and the kernel.
pub fn budget_for(cpus: usize) -> usize {
    (cpus * 2 / 3).clamp(4, 256)
}

/// What teardowns may take of a budget of `budget`: all but its last
/// quarter (at least one slot), so refills always get some.
pub fn teardown_share(budget: usize) -> usize {
    budget.saturating_sub((budget / 4).max(1)).max(1)
}

/// The timer deadline for a run that expires at `expires_at`; already
/// passed when the expiry has.
pub fn deadline(expires_at: OffsetDateTime) -> tokio::time::Instant {
    let left = expires_at - OffsetDateTime::now_utc();
    let left = Duration::try_from(left).unwrap_or(Duration::ZERO);
    // Far-future expiries are capped so the addition cannot overflow; the
    // owner recomputes the deadline after every change anyway.
    tokio::time::Instant::now() + left.min(Duration::from_secs(365 * 24 * 3600))
}

/// The delay before teardown attempt `attempt + 1`, after `attempt` (≥ 1)
/// failures: doubling from [`FIRST_RETRY`], capped at [`MAX_RETRY`].
pub fn backoff(attempt: u32) -> Duration {
    let doublings = attempt.saturating_sub(1).min(16);
    (FIRST_RETRY * 2u32.pow(doublings)).min(MAX_RETRY)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_is_capped() {
        assert_eq!(backoff(1), Duration::from_millis(500));
        assert_eq!(backoff(2), Duration::from_secs(1));
        assert_eq!(backoff(3), Duration::from_secs(2));
        assert_eq!(backoff(8), Duration::from_secs(60));
        assert_eq!(backoff(u32::MAX), Duration::from_secs(60));
    }

    #[test]
    fn deadlines_in_the_past_are_now() {
        let before = tokio::time::Instant::now();
        let d = deadline(OffsetDateTime::now_utc() - time::Duration::hours(1));
        assert!(d <= tokio::time::Instant::now() && d >= before);
        let far = deadline(OffsetDateTime::now_utc() + time::Duration::days(10_000));
        assert!(far > tokio::time::Instant::now() + Duration::from_secs(300 * 24 * 3600));
    }

    #[test]
    fn the_budget_is_never_tiny_and_teardowns_leave_a_share() {
        assert_eq!(budget_for(1), 4);
        assert_eq!(budget_for(12), 8);
        assert_eq!(budget_for(1000), 256);
        assert_eq!(teardown_share(4), 3);
        assert_eq!(teardown_share(16), 12);
        assert_eq!(teardown_share(1), 1);
    }
}
