//! A run's lifecycle phase and the one function that moves it.
//!
//! ```text
//!                  Started                      Stop(reason)
//!   ┌──────────┐ ─────────► ┌─────────┐ ───────────────────────┐
//!   │ Creating │            │ Running │                         ▼
//!   └──────────┘            └─────────┘                   ┌──────────┐  Destroyed  ┌──────┐
//!     │     │                    │ Died(why)              │ Stopping │ ──────────► │ Gone │
//!     │     │                    ▼                        └──────────┘             └──────┘
//!     │     │               ┌────────┐  Stop(reason)           ▲   ▲
//!     │     │               │ Failed │ ────────────────────────┘   │
//!     │     │               └────────┘                             │
//!     │     └──── CreateFailed / Stop (the creator went away) ─────┘
//!     └── (reconcile after a restart adopts Running or Failed records directly)
//!
//!   Creating ── Parked ──► Pooled ── Claimed ──► Running
//!                            │ Died(why) or Stop(reason)
//!                            └─────────────────────────► Stopping
//!
//!   Running ── Paused ──► Paused ── Resumed ──► Running
//!                           │ Died(why) ──► Failed;  Stop(reason) ──► Stopping
//!
//!   Running, Paused ── Hibernated ──► Hibernated ── Woken ──► Running
//!                                        │ WakeFailed(why) ──► Failed
//!                                        │ Stop(reason) ──► Stopping
//!   Failed ── Woken ──► Running  (a restart, or an explicit wake)
//!   Failed ── WakeFailed(why) ──► Failed(why)
//!
//!   Hibernated ── Archived ──► Archived ── Restored ──► Running
//!                                 │ Stop(reason) ──► Stopping
//! ```
//!
//! * `Creating`: the record is stored and the lane is building the
//!   sandbox. Counted against capacity; not usable yet.
//! * `Running`: the sandbox is up and its agent answered.
//! * `Paused`: the run's processes are frozen where they were (memory,
//!   open files and connections kept); shown, counted against capacity.
//!   Its owner resumes it before it admits any operation.
//! * `Pooled`: an idle warm-pool member, up and answering, that no create
//!   has claimed: hidden from the API and not counted against capacity;
//!   only the pool's own warm-up reaches it. A claim makes it `Running`; a
//!   member that dies is of no use to anyone and is destroyed at once.
//! * `Hibernated`: the sandbox is stopped down to its disk; shown, not
//!   counted against capacity. Its owner boots it again (a wake) before it
//!   admits any operation.
//! * `Archived`: the run's disk is in the checkpoint store and nothing of
//!   it is on the node but its record; shown, not counted. Its owner
//!   restores it (a fresh disk from the archive, then a boot) before it
//!   admits any operation; a restore that fails leaves it archived.
//! * `Failed`: the sandbox died on its own (its init exited) and the
//!   restart policy did not boot it again, or a wake failed. It keeps its
//!   disk and record until it is deleted or its TTL passes, so the caller
//!   can see why; execs and file operations are refused with the reason.
//!   A restart, or an explicit wake, boots it again (`Woken`).
//! * `Stopping`: the sandbox is being destroyed; retried with backoff until
//!   it succeeds. No operation is admitted any more.
//! * `Gone`: destroyed and forgotten; the run's owner exits.
//!
//! Room is left for `Snapshotting`: it would be
//! a new variant with its own arms in [`transition`], never a flag beside
//! the phase.
//!
//! Pure: no I/O, no clock. The run's owner ([`super::actor`]) is the only
//! caller, so a phase changes in exactly one place.

use runbox_types::{ExitReason, RunStatus};

/// Where a run is in its life.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Phase {
    /// The sandbox is being built.
    Creating,
    /// The sandbox is up and its agent answers.
    Running,
    /// The run's processes are frozen where they were, memory kept.
    Paused,
    /// Stopped down to its disk; booted again by a wake.
    Hibernated,
    /// Its disk is in the checkpoint store; restored by a wake.
    Archived,
    /// An idle pool member: up, hidden, not counted, waiting for a create.
    Pooled,
    /// The sandbox died on its own, for this reason.
    Failed(String),
    /// The sandbox is being destroyed, for this reason.
    Stopping(ExitReason),
    /// Destroyed; nothing of the run is left.
    Gone,
}

/// What happened to a run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// The sandbox is up and the agent answered.
    Started,
    /// A pool member's sandbox is up and the agent answered.
    Parked,
    /// A create took the idle pool member and its settings are applied.
    Claimed,
    /// The run's processes were frozen.
    Paused,
    /// A paused run's processes were let go on.
    Resumed,
    /// The run was stopped down to its disk.
    Hibernated,
    /// A new sandbox was booted on the run's disk and its agent answered.
    Woken,
    /// Booting the run again failed, for this reason.
    WakeFailed(String),
    /// A hibernated run's disk went to the checkpoint store and the local
    /// copy was dropped.
    Archived,
    /// An archived run was restored onto a fresh disk and booted.
    Restored,
    /// Building the sandbox failed.
    CreateFailed,
    /// The sandbox's init process exited on its own.
    Died(String),
    /// The run is to be destroyed (delete, TTL, its creator went away).
    Stop(ExitReason),
    /// Every resource of the run is gone.
    Destroyed,
}

/// A transition the lifecycle does not have. Reaching one is a bug in the
/// caller, reported instead of silently assigning the phase.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("a run that is {from} cannot take {event:?}")]
pub struct InvalidTransition {
    /// The phase the run was in.
    pub from: &'static str,
    /// What was asked of it.
    pub event: Event,
}

impl Phase {
    /// The phase's name, as the API spells the status.
    pub fn name(&self) -> &'static str {
        match self {
            Phase::Creating => "creating",
            Phase::Running => "running",
            Phase::Pooled => "pooled",
            Phase::Paused => "paused",
            Phase::Hibernated => "hibernated",
            Phase::Archived => "archived",
            Phase::Failed(_) => "failed",
            Phase::Stopping(_) => "stopping",
            Phase::Gone => "gone",
        }
    }

    /// The status the API and the store show for this phase.
    pub fn status(&self) -> RunStatus {
        match self {
            Phase::Creating => RunStatus::Creating,
            Phase::Running | Phase::Pooled => RunStatus::Running,
            Phase::Paused => RunStatus::Paused,
            Phase::Hibernated => RunStatus::Hibernated,
            Phase::Archived => RunStatus::Archived,
            Phase::Failed(_) => RunStatus::Failed,
            Phase::Stopping(_) | Phase::Gone => RunStatus::Stopping,
        }
    }

    /// Whether the API still shows the run. A run being destroyed is not
    /// shown: once a delete is accepted, the run never answers again.
    pub fn visible(&self) -> bool {
        matches!(
            self,
            Phase::Creating
                | Phase::Running
                | Phase::Paused
                | Phase::Hibernated
                | Phase::Archived
                | Phase::Failed(_)
        )
    }
}

/// The lifecycle: the phase `event` moves a run in phase `from` to.
pub fn transition(from: &Phase, event: Event) -> Result<Phase, InvalidTransition> {
    use Event as E;
    use Phase as P;
    let next = match (from, &event) {
        (P::Creating, E::Started) => P::Running,
        (P::Creating, E::Parked) => P::Pooled,
        (P::Pooled, E::Claimed) => P::Running,
        // Nobody can see a dead idle member; it goes at once.
        (P::Pooled, E::Died(_)) => P::Stopping(ExitReason::RunDeleted),
        (P::Creating, E::CreateFailed) => P::Stopping(ExitReason::RunDeleted),
        (P::Running | P::Paused, E::Died(why)) => P::Failed(why.clone()),
        (P::Running, E::Paused) => P::Paused,
        (P::Paused, E::Resumed) => P::Running,
        (P::Running | P::Paused, E::Hibernated) => P::Hibernated,
        (P::Hibernated | P::Failed(_), E::Woken) => P::Running,
        (P::Hibernated | P::Failed(_), E::WakeFailed(why)) => P::Failed(why.clone()),
        (P::Hibernated, E::Archived) => P::Archived,
        (P::Archived, E::Restored) => P::Running,
        (
            P::Creating
            | P::Running
            | P::Paused
            | P::Hibernated
            | P::Archived
            | P::Pooled
            | P::Failed(_),
            E::Stop(reason),
        ) => P::Stopping(*reason),
        (P::Stopping(_), E::Destroyed) => P::Gone,
        _ => {
            return Err(InvalidTransition {
                from: from.name(),
                event,
            })
        }
    };
    Ok(next)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn event() -> impl Strategy<Value = Event> {
        prop_oneof![
            Just(Event::Started),
            Just(Event::Parked),
            Just(Event::Claimed),
            Just(Event::Paused),
            Just(Event::Resumed),
            Just(Event::Hibernated),
            Just(Event::Woken),
            Just(Event::WakeFailed("boot failed".into())),
            Just(Event::Archived),
            Just(Event::Restored),
            Just(Event::CreateFailed),
            Just(Event::Died("init exited".into())),
            Just(Event::Stop(ExitReason::RunDeleted)),
            Just(Event::Stop(ExitReason::RunExpired)),
            Just(Event::Destroyed),
        ]
    }

    #[test]
    fn the_happy_path() {
        let mut phase = Phase::Creating;
        for event in [
            Event::Started,
            Event::Stop(ExitReason::RunDeleted),
            Event::Destroyed,
        ] {
            phase = transition(&phase, event).unwrap();
        }
        assert_eq!(phase, Phase::Gone);
    }

    #[test]
    fn a_failed_run_is_kept_until_stopped() {
        let failed = transition(&Phase::Running, Event::Died("oom".into())).unwrap();
        assert_eq!(failed, Phase::Failed("oom".into()));
        assert!(failed.visible());
        assert!(transition(&failed, Event::Started).is_err());
        assert!(transition(&failed, Event::Died("again".into())).is_err());
        let stopping = transition(&failed, Event::Stop(ExitReason::RunExpired)).unwrap();
        assert!(!stopping.visible());
    }

    #[test]
    fn a_pool_member_is_hidden_until_claimed_and_dies_unseen() {
        let pooled = transition(&Phase::Creating, Event::Parked).unwrap();
        assert_eq!(pooled, Phase::Pooled);
        assert!(!pooled.visible());
        assert_eq!(pooled.status(), RunStatus::Running);
        assert!(transition(&pooled, Event::Started).is_err());
        assert!(transition(&Phase::Running, Event::Claimed).is_err());
        let claimed = transition(&pooled, Event::Claimed).unwrap();
        assert_eq!(claimed, Phase::Running);
        assert!(claimed.visible());
        let dead = transition(&pooled, Event::Died("oom".into())).unwrap();
        assert_eq!(dead, Phase::Stopping(ExitReason::RunDeleted));
    }

    #[test]
    fn a_paused_run_is_shown_resumes_to_running_and_can_die_or_stop() {
        let paused = transition(&Phase::Running, Event::Paused).unwrap();
        assert_eq!(paused, Phase::Paused);
        assert!(paused.visible());
        assert_eq!(paused.status(), RunStatus::Paused);
        assert_eq!(transition(&paused, Event::Resumed).unwrap(), Phase::Running);
        assert!(transition(&paused, Event::Paused).is_err());
        assert!(transition(&Phase::Running, Event::Resumed).is_err());
        assert!(transition(&Phase::Pooled, Event::Paused).is_err());
        assert!(transition(&Phase::Failed("x".into()), Event::Paused).is_err());
        assert_eq!(
            transition(&paused, Event::Died("killed".into())).unwrap(),
            Phase::Failed("killed".into())
        );
        assert_eq!(
            transition(&paused, Event::Stop(ExitReason::RunExpired)).unwrap(),
            Phase::Stopping(ExitReason::RunExpired)
        );
    }

    #[test]
    fn a_hibernated_run_is_shown_wakes_to_running_or_fails() {
        for from in [Phase::Running, Phase::Paused] {
            let asleep = transition(&from, Event::Hibernated).unwrap();
            assert_eq!(asleep, Phase::Hibernated);
            assert!(asleep.visible());
            assert_eq!(asleep.status(), RunStatus::Hibernated);
        }
        let asleep = Phase::Hibernated;
        assert_eq!(transition(&asleep, Event::Woken).unwrap(), Phase::Running);
        assert_eq!(
            transition(&asleep, Event::WakeFailed("no disk".into())).unwrap(),
            Phase::Failed("no disk".into())
        );
        assert_eq!(
            transition(&asleep, Event::Stop(ExitReason::RunExpired)).unwrap(),
            Phase::Stopping(ExitReason::RunExpired)
        );
        // Asleep, it has no processes to die, pause or resume.
        assert!(transition(&asleep, Event::Died("x".into())).is_err());
        assert!(transition(&asleep, Event::Paused).is_err());
        assert!(transition(&asleep, Event::Resumed).is_err());
        assert!(transition(&Phase::Pooled, Event::Hibernated).is_err());
        assert!(transition(&Phase::Running, Event::Woken).is_err());
        // A failed run is booted again by a restart or a wake.
        let failed = Phase::Failed("init exited".into());
        assert_eq!(transition(&failed, Event::Woken).unwrap(), Phase::Running);
        assert!(transition(&failed, Event::Hibernated).is_err());
    }

    #[test]
    fn only_a_hibernated_run_is_archived_and_a_restore_runs_it() {
        let archived = transition(&Phase::Hibernated, Event::Archived).unwrap();
        assert_eq!(archived, Phase::Archived);
        assert!(archived.visible());
        assert_eq!(archived.status(), RunStatus::Archived);
        for from in [
            Phase::Running,
            Phase::Paused,
            Phase::Pooled,
            Phase::Failed("x".into()),
        ] {
            assert!(transition(&from, Event::Archived).is_err(), "{from:?}");
        }
        assert_eq!(
            transition(&archived, Event::Restored).unwrap(),
            Phase::Running
        );
        assert!(transition(&Phase::Hibernated, Event::Restored).is_err());
        // Archived, it has nothing to die, pause or boot on.
        for event in [
            Event::Died("x".into()),
            Event::Paused,
            Event::Woken,
            Event::Hibernated,
        ] {
            assert!(transition(&archived, event).is_err());
        }
        assert_eq!(
            transition(&archived, Event::Stop(ExitReason::RunExpired)).unwrap(),
            Phase::Stopping(ExitReason::RunExpired)
        );
    }

    #[test]
    fn invalid_transitions_say_what_was_asked() {
        let err = transition(&Phase::Gone, Event::Started).unwrap_err();
        assert_eq!(err.from, "gone");
        assert_eq!(err.to_string(), "a run that is gone cannot take Started");
        assert!(transition(&Phase::Running, Event::Destroyed).is_err());
        assert!(transition(&Phase::Creating, Event::Died("x".into())).is_err());
    }

    proptest! {
        /// Over any sequence of events: a refused event leaves the phase as
        /// it was (the caller keeps it), nothing leaves `Gone`, a run that
        /// started stopping is never visible again, a pool member is hidden
        /// until claimed, and a run once visible never goes back to the
        /// pool.
        #[test]
        fn phases_only_move_forward(events in proptest::collection::vec(event(), 0..40)) {
            let mut phase = Phase::Creating;
            let mut stopped = false;
            let mut served = false;
            for e in events {
                let before = phase.clone();
                match transition(&phase, e) {
                    Ok(next) => phase = next,
                    Err(_) => prop_assert_eq!(&phase, &before),
                }
                if before == Phase::Gone {
                    prop_assert_eq!(&phase, &Phase::Gone);
                }
                stopped |= matches!(phase, Phase::Stopping(_) | Phase::Gone);
                if stopped {
                    prop_assert!(!phase.visible());
                }
                served |= matches!(phase, Phase::Running | Phase::Paused | Phase::Hibernated | Phase::Archived | Phase::Failed(_));
                if served {
                    prop_assert_ne!(&phase, &Phase::Pooled);
                }
                prop_assert_eq!(phase.visible(), matches!(phase, Phase::Creating | Phase::Running | Phase::Paused | Phase::Hibernated | Phase::Archived | Phase::Failed(_)));
            }
        }
    }
}
