//! What the core reports about its work as it happens, for the daemon's
//! metrics: how runs come to be (a cold create, a pool claim, a fork, a
//! restore from a checkpoint) and how long that took, wakes, exec starts,
//! and restarts after an init exited. The server's Prometheus metrics
//! implement [`Telemetry`]; a manager without one reports nothing.
//!
//! Calls are made on the request's own task, so an implementation must be
//! cheap and must not block: counters and histograms, nothing more.

use std::time::Duration;

/// How a run came to be.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Start {
    /// Built from its image by a create.
    Cold,
    /// Handed out by a warm pool.
    Claim,
    /// A fork's child.
    Fork,
}

impl Start {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Start::Cold => "cold",
            Start::Claim => "claim",
            Start::Fork => "fork",
        }
    }
}

/// Whether an operation did what it was asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// It did.
    Ok,
    /// It failed, or was refused (capacity, quota, bad input).
    Error,
}

impl Outcome {
    /// `Ok` for an `Ok`.
    pub fn of<T, E>(result: &Result<T, E>) -> Outcome {
        match result {
            Ok(_) => Outcome::Ok,
            Err(_) => Outcome::Error,
        }
    }

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Error => "error",
        }
    }
}

/// Where the core's reports go.
pub trait Telemetry: Send + Sync {
    /// A create, claim or fork answered after `took` (a fork of N
    /// children reports once).
    fn started(&self, how: Start, outcome: Outcome, took: Duration);
    /// A hibernated or failed run woken (by a call or by traffic) after
    /// `took`.
    fn woke(&self, outcome: Outcome, took: Duration);
    /// A command started in a run (or refused) after `took`: from the
    /// request to the agent's word that it runs.
    fn exec_started(&self, outcome: Outcome, took: Duration);
    /// A run booted again after its init exited on its own.
    fn restarted(&self);
}

/// The steps of one piece of work and how long each took, for a debug log
/// line that says where the time of a create (or a boot) went.
#[derive(Debug)]
pub struct Laps {
    last: std::time::Instant,
    laps: Vec<(&'static str, Duration)>,
}

impl Default for Laps {
    fn default() -> Laps {
        Laps::new()
    }
}

impl Laps {
    /// Starts the clock.
    pub fn new() -> Laps {
        Laps {
            last: std::time::Instant::now(),
            laps: Vec::with_capacity(12),
        }
    }

    /// Ends step `name` now; the next step starts.
    pub fn lap(&mut self, name: &'static str) {
        let now = std::time::Instant::now();
        self.laps.push((name, now - self.last));
        self.last = now;
    }

    /// Records step `name` that ran beside the others and took `took`.
    pub fn beside(&mut self, name: &'static str, took: Duration) {
        self.laps.push((name, took));
    }
}

impl std::fmt::Display for Laps {
    /// `name=1.23ms name=0.40ms …`
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, (name, took)) in self.laps.iter().enumerate() {
            if i > 0 {
                f.write_str(" ")?;
            }
            write!(f, "{name}={:.2}ms", took.as_secs_f64() * 1e3)?;
        }
        Ok(())
    }
}
