//! The owner of one run: a task that holds the run's record, lease fence and
//! phase, and is the only code that changes them.
//!
//! Everything else holds a [`RunHandle`]: it reads the last published
//! [`Snapshot`] (lock-free, for `GET` and `list`) and sends typed
//! [`Command`]s with a oneshot for the answer. Because one task applies
//! every change in order, there is no lock to hold across a store commit:
//! the task awaits the commit (on a blocking thread) and only then makes the
//! change visible, and a command that arrives meanwhile simply waits its
//! turn. The same order makes late writes harmless: once the run is
//! stopping, a renew or lease change is refused, so it can never write back
//! a record that teardown has deleted.
//!
//! The task's life:
//! 1. for a new run, build it ([`RunActor::create`]): store the `Creating`
//!    record, create the sandbox, wait for the agent, start egress, store
//!    `Running`, answer the creator. If the creator has gone away by then
//!    (its client hung up), nobody knows the run's id: it is destroyed.
//! 2. serve commands until the run is stopped (delete, TTL) or dies (its
//!    init exits: [`crate::lane::Sandbox::watch_exit`]);
//! 3. tear the sandbox down under the shared teardown budget, retrying with
//!    backoff until it is gone ([`super::reaper`]); delete the record;
//!    leave the registry, then the ledger. Only then is the capacity slot
//!    free.
//!
//! Cancellation: nothing here runs inside a request's future, so a client
//! that disconnects cannot stop a lane call or a commit half-way. A
//! dropped reply channel only means nobody waits for the answer.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use runbox_agent_proto::AgentClient;
use runbox_types::{ErrorCode, ExitReason, Run, RunStatus};
use time::OffsetDateTime;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;
use ulid::Ulid;

use super::phase::{transition, Event, Phase};
use super::{error_chain, reaper, RunContext};
use crate::accounting::{UsageEvent, UsageKind};
use crate::config::{RestartPolicy, RESTART_BUDGET, RESTART_WINDOW};
use crate::error::CoreError;
use crate::lane::{AgentEndpoint, ExitWatch, SandboxSpec};
use crate::lease::{Credential, Fence, Lease};
use crate::store::{Durability, RunRecord};
use crate::telemetry::Outcome;

/// What a run looked like after its last change.
#[derive(Clone, Debug)]
pub(crate) struct Snapshot {
    /// The phase.
    pub phase: Phase,
    /// The record (its `status` always matches the phase).
    pub record: Arc<RunRecord>,
}

/// A lease change, applied by the run's owner.
pub(crate) enum LeaseOp {
    Acquire {
        owner: String,
        ttl: Duration,
    },
    Renew {
        owner: String,
        generation: u64,
        ttl: Duration,
    },
    Release {
        owner: String,
        generation: u64,
    },
}

type Reply<T> = oneshot::Sender<Result<T, CoreError>>;

/// The protocol of an agent not asked yet (a run adopted while paused).
const PROTOCOL_UNKNOWN: u32 = 0;

/// How an operation on a run is admitted.
#[derive(Clone, Debug)]
pub(crate) enum Access {
    /// It needs the run up but not its lease: reads, listings, watches,
    /// captures (snapshots, forks, warm commits), previews.
    Open,
    /// It changes the run: admitted under the lease with this credential,
    /// and counted in flight until its [`InFlight`] guard drops.
    Fenced(Option<(String, u64)>),
}

/// What the run's owner answers an admitted operation with.
pub(crate) struct Admitted {
    /// The agent's client.
    pub agent: AgentClient,
    /// The protocol revision the agent speaks.
    pub protocol: u32,
    /// The record as it was at admission.
    pub record: Arc<RunRecord>,
    /// Keeps the run from counting as idle while the operation lasts.
    pub busy: Busy,
}

/// How long a move waits for the calls open on an awake run to end before
/// it hibernates the run (what is still open then ends with it).
const MOVE_GRACE: Duration = Duration::from_secs(10);

/// What others ask of a run's owner.
pub(crate) enum Command {
    /// Admit an operation on the run: the one door every exec, file,
    /// process, session, preview, port, snapshot and fork call goes
    /// through. Every `Ok` for [`Access::Fenced`] is matched by one `End`
    /// (see [`InFlight`]).
    Admit {
        access: Access,
        reply: Reply<Admitted>,
    },
    /// A fenced operation ended.
    End,
    /// Set the expiry to now + `ttl`.
    Renew {
        ttl: Duration,
        reply: Reply<RunRecord>,
    },
    /// Change the lease.
    Lease {
        op: LeaseOp,
        reply: Reply<Option<Lease>>,
    },
    /// Destroy the run; answered once the first teardown attempt is over.
    Stop {
        reason: ExitReason,
        reply: Reply<()>,
        /// Answer once its processes are gone, before the rest of the
        /// teardown (see `RunActor::may_halt_for_delete`).
        halted: bool,
    },
    /// Hand an idle pool member out to a create: apply what the create
    /// asked for and start serving it as the create's run.
    Claim { claim: Box<Claim>, reply: Reply<()> },
    /// Freeze the run's processes (nothing to do when paused already).
    Pause { reply: Reply<()> },
    /// Let a paused run's processes go on (nothing to do when running);
    /// a hibernated run is woken.
    Resume { reply: Reply<()> },
    /// Stop the run down to its disk (nothing to do when hibernated).
    Hibernate { reply: Reply<()> },
    /// Boot a hibernated or failed run again, resume a paused one (nothing
    /// to do when running).
    Wake { reply: Reply<()> },
    /// Send the run's disk to the checkpoint store and drop it here
    /// (hibernating the run first).
    Archive { reply: Reply<()> },
    /// The run is another node's now (it moved, or the fleet's catalog
    /// says another node took it over): end this node's copy and nothing
    /// that is the run's own elsewhere (its archive, its key, its row).
    Relinquish { reply: Reply<()> },
    /// Move the run to node `to`: archive it (hibernating it first), hand
    /// it to `to` in the fleet's catalog, end this node's copy; one
    /// command, so no call restores it here in between. Answers whether
    /// it was awake (the new node boots it then).
    MoveOut { to: String, reply: Reply<bool> },
    /// Return the run's files to history point `point` (checked by the
    /// manager, which holds the run's history meanwhile): hibernate a
    /// running run, restore the point's files, boot it again.
    Rollback {
        point: Ulid,
        credential: Option<(String, u64)>,
        /// Ok once the files are the point's: with the error of the boot
        /// that followed when the run did not come back up.
        reply: Reply<Option<CoreError>>,
    },
    /// Put a new egress policy in force (checked by the manager).
    Egress {
        req: Box<runbox_types::UpdateEgressRequest>,
        reply: Reply<()>,
    },
}

/// What a create applies to the pool member it is served with.
#[derive(Clone)]
pub(crate) struct Claim {
    pub tenant: Option<String>,
    pub env: runbox_types::Env,
    pub ttl: Duration,
    pub egress: crate::egress::RunEgressRequest,
    pub labels: std::collections::BTreeMap<String, String>,
    pub public_ports: bool,
    pub auto_resume: bool,
    pub on_expire: runbox_types::OnExpire,
    pub on_node_loss: runbox_types::OnNodeLoss,
    pub idle: runbox_types::IdlePolicy,
    pub history: Option<runbox_types::HistorySettings>,
    pub idempotency: Option<crate::store::Idempotency>,
    pub allow_privilege_escalation: bool,
    /// Volumes to mount into the member before it is handed out.
    pub volumes: Vec<crate::volumes::RunVolumeRecord>,
}

/// How busy a run is: the operations open on it now, and when the last
/// one ended. Its idle policy reads it.
pub(crate) struct Activity {
    open: AtomicUsize,
    since: Mutex<tokio::time::Instant>,
}

impl Default for Activity {
    fn default() -> Activity {
        Activity {
            open: AtomicUsize::new(0),
            since: Mutex::new(tokio::time::Instant::now()),
        }
    }
}

impl Activity {
    /// Operations open now.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }

    /// When the run was last used.
    pub fn since(&self) -> tokio::time::Instant {
        *self.since.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn touch(&self) {
        *self.since.lock().unwrap_or_else(|p| p.into_inner()) = tokio::time::Instant::now();
    }
}

/// An operation open on a run (an exec stream, a session, a connection
/// into it, any call while it lasts): the run is not idle while one is
/// held, and its idle clock starts again when the last one drops.
pub(crate) struct Busy(Arc<RunHandle>);

impl Busy {
    pub fn new(handle: Arc<RunHandle>) -> Busy {
        handle.activity.open.fetch_add(1, Ordering::SeqCst);
        handle.activity.touch();
        Busy(handle)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.activity.touch();
        self.0.activity.open.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The shared side of a run: what handlers and the registry hold.
pub(crate) struct RunHandle {
    pub id: Ulid,
    commands: mpsc::UnboundedSender<Command>,
    state: watch::Receiver<Snapshot>,
    /// Cancelled when the run starts stopping; in-flight execs watch it.
    pub ended: CancellationToken,
    /// Why the run is stopping, set before `ended` is cancelled.
    pub end_reason: OnceLock<ExitReason>,
    /// The egress proxy's counters while it serves (`allowlist` runs; a
    /// new proxy, with new counters, each time the run boots).
    pub egress: Mutex<Option<Arc<dyn crate::egress::EgressHandle>>>,
    /// What is open on the run now, for its idle policy.
    pub activity: Activity,
    /// What it used lately, sampled by the daemon.
    pub usage: super::usage::History,
    /// Its history points (runs with `history`).
    pub history: super::history::HistoryCell,
}

impl RunHandle {
    /// The last published state.
    pub fn snapshot(&self) -> Snapshot {
        self.state.borrow().clone()
    }

    /// Waits up to `limit` for the run to leave [`Phase::Running`] (a
    /// pause, hibernate or stop its owner is carrying out); the snapshot
    /// then.
    pub async fn left_running(&self, limit: Duration) -> Snapshot {
        let mut state = self.state.clone();
        let _ = tokio::time::timeout(
            limit,
            state.wait_for(|s| !matches!(s.phase, super::phase::Phase::Running)),
        )
        .await;
        self.snapshot()
    }

    /// Waits until the run is no longer being created; returns the
    /// snapshot then (running, failed or stopping).
    pub async fn settled(&self) -> Snapshot {
        let mut state = self.state.clone();
        let settled = state
            .wait_for(|s| !matches!(s.phase, super::phase::Phase::Creating))
            .await
            .map(|snapshot| snapshot.clone());
        // The owner ended: whatever it last published.
        settled.unwrap_or_else(|_| self.snapshot())
    }

    /// The egress proxy's counters now.
    pub fn egress(&self) -> Option<Arc<dyn crate::egress::EgressHandle>> {
        self.egress
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Waits until a claimed member's owner has applied the claim (or the
    /// run ended); at once for other runs.
    pub async fn claimed(&self) -> Snapshot {
        let mut state = self.state.clone();
        let done = state
            .wait_for(|s| !matches!(s.phase, Phase::Pooled))
            .await
            .map(|snapshot| snapshot.clone());
        done.unwrap_or_else(|_| self.snapshot())
    }

    /// Sends a command and waits for its answer. A run whose owner has
    /// already ended is gone: [`CoreError::RunNotFound`].
    pub async fn ask<T>(&self, make: impl FnOnce(Reply<T>) -> Command) -> Result<T, CoreError> {
        let (reply, answer) = oneshot::channel();
        self.commands.send(make(reply)).map_err(|_| self.ended())?;
        answer.await.map_err(|_| self.ended())?
    }

    /// What a call to a run whose owner ended gets: the run moved to
    /// another node (a retry reaches it there), or it is gone.
    pub(crate) fn ended(&self) -> CoreError {
        match self.end_reason.get() {
            Some(ExitReason::RunMoved) => crate::fleet::moved(self.id),
            _ => CoreError::RunNotFound(self.id),
        }
    }

    /// Tells the owner an admitted operation ended; never blocks.
    pub fn end_operation(&self) {
        let _ = self.commands.send(Command::End);
    }
}

/// A new run's build order, handed to its owner.
pub(crate) struct Creation {
    pub spec: SandboxSpec,
    pub reply: oneshot::Sender<Result<Run, CoreError>>,
    /// Signalled by the creator once it holds the answer. A sent answer is
    /// not a received one: a creator dropped after the send but before it
    /// read the answer (its client hung up just then) lets this go
    /// unsignalled, and the run is destroyed like any unclaimed one.
    pub delivered: oneshot::Receiver<()>,
}

/// How long a created run waits for its creator to take the answer before
/// taking it as taken (a creator that is alive but never polled is a bug
/// elsewhere; the run then lives, listed, until its TTL).
const DELIVERY_TIMEOUT: Duration = Duration::from_secs(30);

/// How a re-adopted run starts.
pub(crate) enum Adopted {
    /// Alive, its agent answering.
    Running(AgentClient, u32),
    /// Paused before the restart, and frozen still; its agent is asked
    /// for its protocol when the run resumes.
    Paused(AgentClient),
    /// Hibernated (or being hibernated) before the restart: whatever is
    /// left of its sandbox besides the disk is stopped.
    Hibernated,
    /// Archived before the restart: whatever is left of its sandbox, disk
    /// included (an archive a crash cut short), is removed.
    Archived,
    /// Running or paused before the restart, its sandbox gone or its agent
    /// silent since, for this reason: the restart policy applies.
    Dead(String),
    /// Failed before the restart; kept until its TTL.
    Failed,
    /// Dead or expired: to be destroyed at once.
    Doomed(ExitReason),
}

/// The task that owns one run.
pub(crate) struct RunActor {
    context: Arc<RunContext>,
    handle: Arc<RunHandle>,
    commands: mpsc::UnboundedReceiver<Command>,
    publish: watch::Sender<Snapshot>,
    phase: Phase,
    record: RunRecord,
    fence: Fence,
    exit: Option<ExitWatch>,
    /// The agent's client and protocol, once it answered; only the owner
    /// hands them out, to admitted operations.
    agent: Option<(AgentClient, u32)>,
    /// Deletes waiting for the first teardown attempt.
    stop_waiters: Vec<Reply<()>>,
    /// Callers of a stop content to hear once the run's processes are
    /// gone (answered with the others if that comes no sooner).
    halt_waiters: Vec<Reply<()>>,
    /// Cancelled when the current sandbox stops (hibernate, death, end):
    /// its egress proxy goes with it.
    incarnation: CancellationToken,
    /// When the restart policy booted the run lately (within
    /// [`RESTART_WINDOW`]); in memory, so a daemon restart resets it.
    restarts: VecDeque<tokio::time::Instant>,
    /// After a failed automatic archive: when to try again, and how many
    /// tries failed in a row.
    archive_retry: Option<(tokio::time::Instant, u32)>,
}

impl RunActor {
    /// A run's handle and its owner, in `phase`; nothing runs until
    /// [`RunActor::spawn`].
    pub fn new(context: Arc<RunContext>, record: RunRecord, phase: Phase) -> RunActor {
        let (commands_tx, commands) = mpsc::unbounded_channel();
        let mut record = record;
        record.status = phase.status();
        let (publish, state) = watch::channel(Snapshot {
            phase: phase.clone(),
            record: Arc::new(record.clone()),
        });
        let handle = Arc::new(RunHandle {
            id: record.id,
            commands: commands_tx,
            state,
            ended: CancellationToken::new(),
            end_reason: OnceLock::new(),
            egress: Mutex::new(None),
            activity: Activity::default(),
            usage: Default::default(),
            history: Default::default(),
        });
        let token = handle.ended.child_token();
        RunActor {
            context,
            handle,
            commands,
            publish,
            fence: Fence::new(record.lease.clone()),
            phase,
            record,
            exit: None,
            agent: None,
            stop_waiters: Vec::new(),
            halt_waiters: Vec::new(),
            incarnation: token,
            restarts: VecDeque::new(),
            archive_retry: None,
        }
    }

    /// The handle others use.
    pub fn handle(&self) -> &Arc<RunHandle> {
        &self.handle
    }

    /// Starts the owner's task for a new run.
    pub fn spawn_create(self, creation: Creation) {
        tokio::spawn(async move {
            let mut actor = self;
            actor.create(creation).await;
            actor.serve().await;
        });
    }

    /// Starts the owner's task for a run found in the store at start-up.
    /// Returns a receiver that answers once a doomed run's first teardown
    /// attempt is over (at once for the others).
    pub fn spawn_adopted(self, adopted: Adopted) -> oneshot::Receiver<Result<(), CoreError>> {
        let (done, waiter) = oneshot::channel();
        tokio::spawn(async move {
            let mut actor = self;
            match adopted {
                Adopted::Running(agent, protocol) => {
                    actor.agent = Some((agent, protocol));
                    actor.serve_again().await;
                    let _ = done.send(Ok(()));
                }
                Adopted::Paused(agent) => {
                    // Its agent answers once the run resumes.
                    actor.agent = Some((agent, PROTOCOL_UNKNOWN));
                    actor.serve_again().await;
                    let _ = done.send(Ok(()));
                }
                Adopted::Failed => {
                    let _ = done.send(Ok(()));
                }
                Adopted::Hibernated => {
                    // Finishes a hibernation a crash cut short, or clears
                    // what a crash left of a wake: as recorded.
                    if let Err(e) = actor
                        .context
                        .lane
                        .sandbox(actor.record.id)
                        .hibernate()
                        .await
                    {
                        tracing::warn!(run = %actor.record.id, error = %error_chain(&e), "could not stop what is left of a hibernated run's sandbox; its wake or delete retries");
                    }
                    let _ = done.send(Ok(()));
                }
                Adopted::Archived => {
                    if let Err(e) = actor.context.lane.sandbox(actor.record.id).destroy().await {
                        tracing::warn!(run = %actor.record.id, error = %error_chain(&e), "could not remove what is left of an archived run's sandbox; its restore or delete retries");
                    }
                    let _ = done.send(Ok(()));
                }
                Adopted::Dead(why) => {
                    // Before the API opens: it shows the run restarted (or
                    // failed), never a dead one as running.
                    actor.died(why).await;
                    let _ = done.send(Ok(()));
                }
                Adopted::Doomed(reason) => {
                    actor.stop(reason);
                    actor.stop_waiters.push(done);
                }
            }
            actor.serve().await;
        });
        waiter
    }

    /// What a re-adopted live run needs again (its old proxy socket and
    /// exit watch died with the old daemon): the egress proxy, whose
    /// listener lives in the run's namespace (a frozen run keeps it), and
    /// the watch on its init.
    async fn serve_again(&mut self) {
        // Without its proxy the run has no way out at all: it keeps its
        // files and processes, and the log says why.
        let stop = self.incarnation.clone();
        if let Err(e) = self
            .context
            .start_egress(&self.handle, &self.record, stop)
            .await
        {
            tracing::error!(run = %self.record.id, error = %error_chain(&e), "could not restart the run's egress proxy; the run has no network");
        }
        self.watch().await;
    }

    /// Applies a lifecycle event: the only place a phase changes. The
    /// record's status follows the phase.
    fn apply(&mut self, event: Event) {
        match transition(&self.phase, event) {
            Ok(next) => {
                self.phase = next;
                self.record.status = self.phase.status();
                if let Phase::Failed(why) = &self.phase {
                    self.record.failure = Some(why.clone());
                }
            }
            Err(e) => {
                tracing::error!(run = %self.record.id, error = %e, "refused an invalid lifecycle transition")
            }
        }
    }

    /// Records a usage event of `kind` for this run now: its tenant and
    /// size, and its limits when it starts holding resources.
    fn note(&self, kind: UsageKind) {
        self.context.usage.record(self.usage_event(kind));
    }

    fn usage_event(&self, kind: UsageKind) -> UsageEvent {
        let mut event = UsageEvent::now(kind, self.record.id, self.record.tenant.clone());
        event.size = self.record.size;
        if matches!(
            kind,
            UsageKind::Create
                | UsageKind::Claim
                | UsageKind::Fork
                | UsageKind::Wake
                | UsageKind::Restore
        ) {
            event.limits = Some(self.record.limits);
        }
        event
    }

    /// Records `kind` for a run whose boot ends here: with `holding` (it
    /// has a sandbox), what its cgroup counted, read before the sandbox
    /// goes.
    fn note_ended(&self, kind: UsageKind, holding: bool) {
        let mut event = self.usage_event(kind);
        if holding {
            if let Some(used) = self.context.lane.sandbox(self.record.id).usage() {
                event.cpu_sec = Some(used.cpu_ns as f64 / 1e9);
                event.peak_memory_bytes = Some(used.memory_peak_bytes.unwrap_or(used.memory_bytes));
            }
        }
        self.context.usage.record(event);
    }

    /// Publishes the run as it is now, and reports it to the ledger.
    fn publish(&self) {
        self.context
            .ledger
            .report(self.record.id, super::entry(&self.record, &self.phase));
        self.publish.send_replace(Snapshot {
            phase: self.phase.clone(),
            record: Arc::new(self.record.clone()),
        });
        // After the snapshot: a resync that lists the runs after this
        // report's generation was taken sees this state.
        self.context.catalog(&self.record, &self.phase);
    }

    /// Moves the run to `Stopping`: nothing new is admitted, in-flight
    /// execs end with `reason`.
    fn stop(&mut self, reason: ExitReason) {
        let holding = matches!(
            self.phase,
            Phase::Running | Phase::Paused | Phase::Failed(_)
        );
        let kind = if reason == ExitReason::RunExpired {
            UsageKind::Expire
        } else {
            UsageKind::Delete
        };
        // Idle pool members and creates that never finished were never
        // billed; their end is not either.
        if !self.record.is_idle_member() && !matches!(self.phase, Phase::Creating) {
            self.note_ended(kind, holding);
        }
        self.end(Event::Stop(reason), reason);
    }

    /// See [`Command::MoveOut`]. A failure before the hand-off leaves the
    /// run here (archived once the archive committed: the next call
    /// restores it here); the hand-off is one compare-and-set in the
    /// catalog, so the run is never two nodes' at once.
    async fn move_out(&mut self, to: &str) -> Result<bool, CoreError> {
        let id = self.record.id;
        let fleet = self
            .context
            .fleet
            .get()
            .cloned()
            .ok_or_else(|| super::moves::not_movable(id, "this node is not part of a fleet"))?;
        let awake = matches!(self.phase, Phase::Running | Phase::Paused);
        if awake {
            // Calls that arrive now wait behind this command; those open
            // (an exec, a transfer) get a moment to end first.
            let until = tokio::time::Instant::now() + MOVE_GRACE;
            while self.handle.activity.open() > 0 && tokio::time::Instant::now() < until {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        if self.phase != Phase::Archived {
            self.archive().await?;
        }
        let mut record = self.record.clone();
        record.moved = true;
        let sealed = self.context.seal_record(&record).ok_or_else(|| {
            super::moves::not_movable(id, "this node has no sealing key for the run's record")
        })?;
        let handed = fleet.hand_off_run(id, to, &sealed).await?;
        self.relinquish();
        match handed {
            true => {
                tracing::info!(run = %id, node = %to, "run moved");
                Ok(awake)
            }
            // Another node took it over meanwhile: it is that node's.
            false => Err(crate::fleet::moved(id)),
        }
    }

    /// Ends this node's copy of a run another node holds now: no usage
    /// event (the run goes on), its key kept for the fleet, and its
    /// archive, if it has one, left to the node that holds it.
    fn relinquish(&mut self) {
        if matches!(self.phase, Phase::Stopping(_) | Phase::Gone) {
            return;
        }
        tracing::info!(run = %self.record.id, "the run is another node's now; ending this node's copy");
        self.record.idempotency = None;
        self.context.ledger.keep_key(self.record.id);
        self.end(Event::Stop(ExitReason::RunMoved), ExitReason::RunMoved);
    }

    /// Applies an event that ends the run (stop, failed create) and tells
    /// in-flight operations why.
    fn end(&mut self, event: Event, reason: ExitReason) {
        self.apply(event);
        let _ = self.handle.end_reason.set(reason);
        self.handle.ended.cancel();
        self.publish();
    }

    /// Step 1: builds the sandbox and answers the creator.
    async fn create(&mut self, creation: Creation) {
        let Creation {
            spec,
            reply,
            delivered,
        } = creation;
        let id = self.record.id;
        let started = std::time::Instant::now();
        let outcome = self.build(&spec, &reply).await;
        match outcome {
            Ok(()) => {
                tracing::info!(run = %id, image = %self.record.image, runtime = %self.record.runtime,
                    elapsed_ms = started.elapsed().as_millis() as u64, "run created");
                if self.record.pool.is_none() {
                    let kind = if spec.seed.is_some() {
                        UsageKind::Fork
                    } else {
                        UsageKind::Create
                    };
                    self.note(kind);
                }
                let run = self.context.view(&self.handle);
                let taken = reply.send(Ok(run)).is_ok()
                    && !matches!(
                        tokio::time::timeout(DELIVERY_TIMEOUT, delivered).await,
                        Ok(Err(_))
                    );
                if !taken {
                    tracing::info!(run = %id, "the client that created the run went away before the answer; destroying it");
                    self.stop(ExitReason::RunDeleted);
                }
            }
            Err(e) => {
                if !matches!(e, CoreError::RunNotFound(_)) {
                    tracing::error!(run = %id, error = %error_chain(&e), "creating a run failed");
                }
                self.end(Event::CreateFailed, ExitReason::RunDeleted);
                let _ = reply.send(Err(e));
            }
        }
    }

    async fn build(
        &mut self,
        spec: &SandboxSpec,
        reply: &oneshot::Sender<Result<Run, CoreError>>,
    ) -> Result<(), CoreError> {
        let context = self.context.clone();
        let mut laps = crate::telemetry::Laps::new();
        // Written as `Creating` before any resource exists, without waiting
        // for the disk: a crash before the durable `Running` commit below
        // may forget it, and then the start-up sweep still finds what the
        // lane made by the names it derives from the id.
        context
            .store
            .put_async_with(self.record.clone(), Durability::None)
            .await?;
        let id = self.record.id;
        let gone = |reply: &oneshot::Sender<_>| {
            // The creator hung up: stop early rather than finish a run
            // nobody can name.
            reply.is_closed().then_some(CoreError::RunNotFound(id))
        };
        if let Some(e) = gone(reply) {
            return Err(e);
        }
        laps.lap("record");
        let sandbox = context.lane.create(spec).await?;
        laps.lap("sandbox");
        self.record.runtime = sandbox.runtime();
        let endpoint = sandbox.agent();
        self.record.agent_socket = match &endpoint {
            AgentEndpoint::Unix(path) => path.clone(),
        };
        let agent = endpoint.client();
        // The durable commit of `Running` overlaps the agent's start: a
        // crash in between finds a running record whose sandbox reconcile
        // judges like any other, and a failed start deletes it again.
        let mut running = self.record.clone();
        running.status = RunStatus::Running;
        let (ready, stored) = tokio::join!(
            super::wait_ready(agent.clone(), context.config().agent_ready_timeout),
            context.store.put_async(running),
        );
        let protocol = ready.map_err(|e| {
            CoreError::Agent(format!("the new run's agent did not become ready: {e}"))
        })?;
        stored?;
        laps.lap("ready+stored");
        if let Some(e) = gone(reply) {
            return Err(e);
        }
        // An idle pool member's proxy starts with the create it serves.
        if !self.record.is_idle_member() {
            let stop = self.incarnation.clone();
            context
                .start_egress(&self.handle, &self.record, stop)
                .await?;
        }
        self.agent = Some((agent, protocol));
        self.apply(if self.record.is_idle_member() {
            Event::Parked
        } else {
            Event::Started
        });
        laps.lap("egress");
        self.watch().await;
        self.publish();
        laps.lap("watch");
        tracing::debug!(run = %id, steps = %laps, "run built");
        Ok(())
    }

    /// Starts watching the sandbox's init, where the lane can.
    async fn watch(&mut self) {
        match self.context.lane.sandbox(self.record.id).watch_exit().await {
            Ok(watch) => self.exit = Some(watch),
            Err(e) => {
                tracing::debug!(run = %self.record.id, error = %e, "not watching the run's init")
            }
        }
    }

    /// Step 2, then 3: serves commands until the run stops, then tears it
    /// down and leaves the registry.
    async fn serve(mut self) {
        while matches!(
            self.phase,
            Phase::Running
                | Phase::Paused
                | Phase::Pooled
                | Phase::Failed(_)
                | Phase::Hibernated
                | Phase::Archived
        ) {
            let expires = reaper::deadline(self.record.expires_at);
            let idle = self.idle_step();
            let idle_at = idle.map(|(at, _)| at);
            let watch = &mut self.exit;
            let exit = async {
                match watch.as_mut() {
                    Some(watch) => watch.await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                command = self.commands.recv() => match command {
                    Some(command) => self.handle_command(command).await,
                    // Unreachable while the registry holds the handle; if it
                    // ever happens, nobody can reach the run any more.
                    None => self.stop(ExitReason::RunDeleted),
                },
                why = exit => self.died(why).await,
                () = tokio::time::sleep_until(expires) => self.expired().await,
                () = sleep_until_some(idle_at) => {
                    if let Some((_, step)) = idle {
                        self.idle(step).await;
                    }
                }
            }
        }
        if matches!(self.phase, Phase::Stopping(_)) {
            self.teardown().await;
        }
        self.context.forget(self.record.id);
        let reason = self.handle.end_reason.get().copied();
        if reason == Some(ExitReason::RunMoved) {
            tracing::info!(run = %self.record.id, "this node's copy of a run that moved is gone");
            return;
        }
        self.context.remember_ended(self.record.id);
        tracing::info!(run = %self.record.id, ?reason, "run destroyed");
    }

    /// The sandbox's init exited on its own: the restart policy applies.
    async fn died(&mut self, why: String) {
        let id = self.record.id;
        self.exit = None;
        tracing::warn!(run = %id, reason = %why, "the run died");
        if self.phase == Phase::Pooled {
            // An idle member: nobody to tell; it goes, and its pool refills.
            self.end(Event::Died(why), ExitReason::RunDeleted);
            return;
        }
        self.end_incarnation();
        self.apply(Event::Died(why.clone()));
        let restart = match self.restart_refusal() {
            None => true,
            Some(refusal) => {
                if let Some(refusal) = refusal {
                    tracing::warn!(run = %id, "{refusal}; not restarting it");
                    self.record.failure = Some(format!("{why}; {refusal}"));
                    self.apply_failure();
                }
                false
            }
        };
        if restart {
            let now = tokio::time::Instant::now();
            self.restarts.push_back(now);
            self.record.restarts += 1;
            self.record.restarted_at = Some(OffsetDateTime::now_utc());
            match self.boot_with_retries().await {
                Ok(()) => {
                    self.apply(Event::Woken);
                    self.note(UsageKind::Restart);
                    self.context.report(|t| t.restarted());
                    self.record.failure = None;
                    tracing::info!(run = %id, restarts = self.record.restarts, "restarted the run after its init exited");
                }
                Err(e) => {
                    let failure = format!(
                        "{why}; booting it again failed {RESTART_BUDGET} times: {}",
                        error_chain(&e)
                    );
                    tracing::error!(run = %id, error = %failure, "could not restart the run");
                    self.apply(Event::WakeFailed(failure));
                }
            }
        }
        if let Err(e) = self.context.store.put_async(self.record.clone()).await {
            tracing::warn!(run = %id, error = %e, "could not store the run's restart or failure");
        }
        self.publish();
    }

    /// Why the restart policy does not restart the run now: `Some(None)`
    /// when it never does (policy `none`, a lane that cannot),
    /// `Some(Some(why))` when its budget is spent; None to restart.
    fn restart_refusal(&mut self) -> Option<Option<String>> {
        if self.context.config().restart_policy == RestartPolicy::None
            || !self.context.lane.capabilities().hibernate.yes()
        {
            return Some(None);
        }
        let now = tokio::time::Instant::now();
        while self
            .restarts
            .front()
            .is_some_and(|at| now.duration_since(*at) > RESTART_WINDOW)
        {
            self.restarts.pop_front();
        }
        (self.restarts.len() >= RESTART_BUDGET).then(|| {
            Some(format!(
                "it was restarted {RESTART_BUDGET} times in {} minutes; wake it with POST /v1/runs/{}/wake",
                RESTART_WINDOW.as_secs() / 60,
                self.record.id
            ))
        })
    }

    /// Keeps the record's failure in step with a `Failed` phase whose
    /// reason was rewritten.
    fn apply_failure(&mut self) {
        if let (Phase::Failed(_), Some(why)) = (&self.phase, &self.record.failure) {
            self.phase = Phase::Failed(why.clone());
        }
    }

    /// Merges `req` with the run's policy ([`super::egress_policy::plan`])
    /// and puts the result (its tier `none` or `allowlist`) in force:
    /// stored first, then, when the run has a sandbox (`live`), applied to
    /// it — the proxy's policy replaced, started (from `none`) or stopped
    /// (to `none`). If the sandbox cannot take it, the old policy is
    /// stored again and the error answered.
    async fn change_egress(
        &mut self,
        req: &runbox_types::UpdateEgressRequest,
        live: bool,
    ) -> Result<(), CoreError> {
        use runbox_types::NetworkTier::{Allowlist, None as Closed};
        let id = self.record.id;
        // Merged with the record as it is now, by its one owner.
        let (network, egress) = super::egress_policy::plan(&self.context, &self.record, req)?;
        if live && network == Allowlist && egress.has_secrets() && !self.record.proxy_ca {
            return Err(CoreError::invalid(
                ErrorCode::BadEgress,
                "this run's sandbox was started without runbox's interception CA (it was not on \
                 the allowlist tier then), so it could not use secrets; give the entries alone \
                 now and hibernate and wake the run (it boots trusting the CA), or create the \
                 run with network allowlist",
            ));
        }
        let before_network = std::mem::replace(&mut self.record.network, network);
        let before = std::mem::replace(&mut self.record.egress, egress);
        if let Err(e) = self.context.store.put_async(self.record.clone()).await {
            self.record.network = before_network;
            self.record.egress = before;
            return Err(e);
        }
        let lane_tier = if live && before_network != network {
            self.context.lane.sandbox(id).change_network(network).await
        } else {
            Ok(())
        };
        let applied = match (lane_tier, live, before_network, network) {
            (Err(e), ..) => Err(e.into()),
            (Ok(()), true, Allowlist, Allowlist) => match self.handle.egress() {
                Some(proxy) => {
                    // The door first: a run that cannot have it (a process
                    // of its own listens on the port) keeps its policy.
                    let lane = self.context.lane.clone();
                    let door =
                        change_socks5(lane, id, self.record.egress.socks5, proxy.clone()).await;
                    if door.is_ok() {
                        let sealer = self.context.config().sealer.clone();
                        let egress = &self.record.egress;
                        let brought = egress.open_brought(id, sealer.as_deref());
                        let upstream = egress.open_upstream(id, sealer.as_deref());
                        proxy.update(egress, brought, upstream);
                    }
                    door
                }
                None => Ok(()),
            },
            (Ok(()), true, Closed, Allowlist) => {
                let stop = self.incarnation.clone();
                self.context
                    .start_egress(&self.handle, &self.record, stop)
                    .await
            }
            (Ok(()), true, Allowlist, Closed) => {
                let proxy = self
                    .handle
                    .egress
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .take();
                if let Some(proxy) = proxy {
                    proxy.shutdown();
                }
                Ok(())
            }
            _ => Ok(()),
        };
        if let Err(e) = applied {
            if live && before_network != network {
                let lane = self.context.lane.sandbox(id);
                if let Err(back) = lane.change_network(before_network).await {
                    tracing::warn!(run = %id, error = %error_chain(&back), "could not record the run's tier back");
                }
            }
            self.record.network = before_network;
            self.record.egress = before;
            if let Err(store) = self.context.store.put_async(self.record.clone()).await {
                tracing::error!(run = %id, error = %error_chain(&store), "could not store a run's egress policy back after a change failed");
            }
            return Err(e);
        }
        tracing::info!(run = %id, network = network.as_str(), entries = self.record.egress.allow.len(), secrets = self.record.egress.secret_names().len(), live, "egress policy changed");
        self.publish();
        Ok(())
    }

    /// Stops serving the current sandbox: its egress proxy goes, its agent
    /// and exit watch are forgotten.
    fn end_incarnation(&mut self) {
        self.incarnation.cancel();
        self.incarnation = self.handle.ended.child_token();
        *self.handle.egress.lock().unwrap_or_else(|p| p.into_inner()) = None;
        self.agent = None;
        self.exit = None;
    }

    /// Boots the run again on its disk, up to [`RESTART_BUDGET`] tries.
    async fn boot_with_retries(&mut self) -> Result<(), CoreError> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            match self.boot().await {
                Ok(()) => return Ok(()),
                Err(e) if attempt >= RESTART_BUDGET => return Err(e),
                Err(e) => {
                    tracing::warn!(run = %self.record.id, attempt, error = %error_chain(&e), "booting the run again failed; retrying");
                    tokio::time::sleep(reaper::backoff(attempt as u32)).await;
                }
            }
        }
    }

    /// Boots a new sandbox on the run's disk, under its id, with what its
    /// record says (limits, egress, warm volume); on success it serves,
    /// its agent answering. On error what was made is stopped again.
    async fn boot(&mut self) -> Result<(), CoreError> {
        let (spec, _pin) = self.context.boot_spec(&self.record).await?;
        self.start_sandbox(&spec, false).await
    }

    /// Starts a sandbox for the run: booted on its disk, or (`fresh`) made
    /// anew with an empty writable layer over `spec`'s image layers (a
    /// restore). On success it serves, its agent answering; on error what
    /// was made is stopped again (a fresh one destroyed).
    async fn start_sandbox(&mut self, spec: &SandboxSpec, fresh: bool) -> Result<(), CoreError> {
        let id = self.record.id;
        let sandbox = match fresh {
            true => self.context.lane.create(spec).await?,
            false => self.context.lane.boot(spec).await?,
        };
        let started = async {
            let endpoint = sandbox.agent();
            let agent = endpoint.client();
            let protocol =
                super::wait_ready(agent.clone(), self.context.config().agent_ready_timeout)
                    .await
                    .map_err(|e| {
                        CoreError::Agent(format!("the booted run's agent did not answer: {e}"))
                    })?;
            let stop = self.incarnation.clone();
            self.context
                .start_egress(&self.handle, &self.record, stop)
                .await?;
            Ok::<_, CoreError>((endpoint, agent, protocol))
        }
        .await;
        let (endpoint, agent, protocol) = match started {
            Ok(started) => started,
            Err(e) => {
                self.end_incarnation();
                let cleanup = match fresh {
                    true => sandbox.destroy().await,
                    false => sandbox.hibernate().await,
                };
                if let Err(cleanup) = cleanup {
                    tracing::warn!(run = %id, error = %error_chain(&cleanup), "could not stop a sandbox whose boot failed");
                }
                return Err(e);
            }
        };
        self.record.runtime = sandbox.runtime();
        self.record.proxy_ca = spec.trust_pem.is_some();
        self.record.agent_socket = match &endpoint {
            AgentEndpoint::Unix(path) => path.clone(),
        };
        self.agent = Some((agent, protocol));
        // Changes from here on are the run's own, for its history.
        if self.record.history.is_some() {
            let at = std::time::SystemTime::now();
            match sandbox.settle_history().await {
                Ok(transid) => self.handle.history.booted(crate::lane::Since {
                    transid,
                    at,
                    point: None,
                }),
                Err(e) => {
                    tracing::warn!(run = %id, error = %error_chain(&e), "could not settle the run's disk for its history")
                }
            }
        }
        self.watch().await;
        // A fresh clock: a woken run is not idle yet.
        self.handle.activity.touch();
        Ok(())
    }

    /// Stops the run down to its disk. Stored first: a crash from here on
    /// finds a hibernated record, and the next daemon finishes the job.
    async fn hibernate(&mut self) -> Result<(), CoreError> {
        let id = self.record.id;
        if let Err(why) = self.context.lane.capabilities().hibernate.check() {
            return Err(CoreError::invalid(
                ErrorCode::HibernateUnsupported,
                format!("this server cannot hibernate runs: {why}"),
            ));
        }
        let started = std::time::Instant::now();
        let mut record = self.record.clone();
        record.status = RunStatus::Hibernated;
        self.context.store.put_async(record).await?;
        self.note_ended(UsageKind::Hibernate, true);
        self.end_incarnation();
        let stopped = self.context.lane.sandbox(id).hibernate().await;
        self.apply(Event::Hibernated);
        self.publish();
        match stopped {
            Ok(()) => {
                tracing::info!(run = %id, elapsed_us = started.elapsed().as_micros() as u64, "run hibernated")
            }
            // Hibernated as recorded; what is left goes at its wake or
            // delete, which stop it again first.
            Err(e) => {
                tracing::warn!(run = %id, error = %error_chain(&e), "run hibernated, but stopping its sandbox failed; its wake or delete retries")
            }
        }
        Ok(())
    }

    /// Boots a hibernated or failed run again: a hibernated one takes a
    /// capacity slot first (429 when there is none, the run left as it
    /// was). A failed boot marks the run failed, with the reason.
    async fn wake(&mut self) -> Result<(), CoreError> {
        let id = self.record.id;
        if let Err(why) = self.context.lane.capabilities().hibernate.check() {
            return Err(CoreError::invalid(
                ErrorCode::HibernateUnsupported,
                format!("this server cannot wake runs: {why}"),
            ));
        }
        let _slot = match self.phase {
            Phase::Hibernated => Some(self.context.take_slot(id).await?),
            _ => None,
        };
        let started = std::time::Instant::now();
        let was_failed = matches!(self.phase, Phase::Failed(_));
        let booted = self.boot().await;
        self.context
            .report(|t| t.woke(Outcome::of(&booted), started.elapsed()));
        match &booted {
            Ok(()) => {
                self.apply(Event::Woken);
                self.note(UsageKind::Wake);
                self.record.failure = None;
                if was_failed {
                    // An explicit wake of a failed run: a new budget.
                    self.restarts.clear();
                }
                self.refresh_expiry();
                tracing::info!(run = %id, elapsed_ms = started.elapsed().as_millis() as u64, "run woken");
            }
            Err(e) => {
                let why = format!("waking the run failed: {}", error_chain(e));
                tracing::error!(run = %id, error = %why, "could not wake the run");
                self.apply(Event::WakeFailed(why));
            }
        }
        if let Err(e) = self.context.store.put_async(self.record.clone()).await {
            tracing::warn!(run = %id, error = %e, "could not store the run's wake");
        }
        self.publish();
        match (booted, &self.phase) {
            (Ok(()), _) => Ok(()),
            (Err(_), Phase::Failed(why)) => Err(CoreError::RunFailed(id, why.clone())),
            (Err(e), _) => Err(e),
        }
    }

    /// Returns the run's files to history point `point`: a running or
    /// paused run is hibernated (its processes end), its disk replaced by
    /// a copy of the point's, and booted again; a hibernated one stays
    /// hibernated. The lease is asked first, as for any change. A failed
    /// restore leaves the run hibernated on its old disk (an error); a
    /// failed boot after it leaves the run on the point's disk, as a
    /// failed wake does (Ok, with the boot's error).
    async fn rollback(
        &mut self,
        point: Ulid,
        credential: Option<(String, u64)>,
        now: OffsetDateTime,
    ) -> Result<Option<CoreError>, CoreError> {
        let presented = credential.as_ref().map(|(owner, generation)| Credential {
            owner,
            generation: *generation,
        });
        self.fence.book.admit(presented, now)?;
        if let Err(why) = self.context.lane.capabilities().hibernate.check() {
            return Err(CoreError::invalid(
                ErrorCode::HibernateUnsupported,
                format!("this server cannot roll runs back (it cannot stop one down to its disk): {why}"),
            ));
        }
        let awake = matches!(self.phase, Phase::Running | Phase::Paused);
        if awake {
            self.hibernate().await?;
        }
        self.context
            .lane
            .sandbox(self.record.id)
            .restore_point(point)
            .await?;
        if awake {
            return Ok(self.wake().await.err());
        }
        Ok(None)
    }

    /// Sends the run's disk to the checkpoint store (as checkpoint `<run
    /// id>`, a new generation each time) and drops the local copy; a
    /// running or paused run is hibernated first. The stored record is the
    /// commit point: until it says `archived` the run is hibernated with its
    /// disk, and a failed upload leaves it so, the error on the run.
    async fn archive(&mut self) -> Result<(), CoreError> {
        let id = self.record.id;
        let store = self.context.checkpoint_store()?.clone();
        if matches!(self.phase, Phase::Running | Phase::Paused) {
            self.hibernate().await?;
        }
        if self.phase != Phase::Hibernated {
            return Err(self.refusal(&self.phase));
        }
        let started = std::time::Instant::now();
        let uploaded = async {
            let generation = store.next_generation(id).await?;
            let capture = self.context.lane.sandbox(id).capture_stopped().await?;
            let labels = [(
                crate::checkpoints::ARCHIVE_LABEL.to_owned(),
                "true".to_owned(),
            )]
            .into();
            self.context
                .upload_checkpoint(&self.record, capture, id, generation, labels)
                .await
        }
        .await;
        if let Err(e) = uploaded {
            self.record.archive_error = Some(error_chain(&e));
            if let Err(e) = self.context.store.put_async(self.record.clone()).await {
                tracing::warn!(run = %id, error = %e, "could not store the run's archive error");
            }
            self.publish();
            return Err(e);
        }
        let now = OffsetDateTime::now_utc();
        let mut record = self.record.clone();
        record.status = RunStatus::Archived;
        record.archived_at = Some(now);
        record.archive_error = None;
        // Its files are in the archive now: the warm generation is not.
        record.warm = None;
        self.context.store.put_async(record.clone()).await?;
        self.record = record;
        self.apply(Event::Archived);
        self.note(UsageKind::Archive);
        self.publish();
        if let Err(e) = self.context.lane.sandbox(id).destroy().await {
            tracing::warn!(run = %id, error = %error_chain(&e), "run archived, but removing its local disk failed; its restore or delete retries");
        }
        // Its history points went with its disk.
        self.handle.history.forget();
        tracing::info!(run = %id, elapsed_ms = started.elapsed().as_millis() as u64, "run archived");
        Ok(())
    }

    /// Brings an archived run back: its archive downloaded and verified
    /// (layers this node still has are used as they are), a fresh disk over
    /// them, a boot; a fresh TTL of its original length. A restore that
    /// fails (the store down, a damaged archive, no capacity) leaves the
    /// run archived and says why.
    async fn restore(&mut self) -> Result<(), CoreError> {
        let id = self.record.id;
        let store = self.context.checkpoint_store()?.clone();
        let _slot = self.context.take_slot(id).await?;
        // On a node of a fleet the catalog says first that this node
        // restores the run, so no other node takes it over meanwhile; a
        // run another node took over while this one was away is its copy
        // no more.
        if let Some(fleet) = self.context.fleet.get() {
            match fleet.hold_run(id).await {
                Ok(None) => {}
                Ok(Some(owner)) => {
                    tracing::warn!(run = %id, node = %owner, "an archived run this node kept was taken over by another node");
                    self.relinquish();
                    return Err(crate::fleet::moved(id));
                }
                // Without the database no node takes a run over; but a
                // run whose archive is in a bucket other nodes share may
                // have been taken over before it went away: that waits.
                Err(e) if store.location().starts_with("s3://") => return Err(e),
                Err(e) => {
                    tracing::debug!(run = %id, error = %e, "restoring without the catalog's say: no other node can reach this run's archive");
                }
            }
        }
        let restored = self.restore_held(&store).await;
        if restored.is_err() {
            // Archived as before, for the catalog too.
            self.publish();
        }
        restored
    }

    /// [`RunActor::restore`] once the run is this node's to restore.
    async fn restore_held(
        &mut self,
        store: &crate::checkpoints::CheckpointStore,
    ) -> Result<(), CoreError> {
        let id = self.record.id;
        let started = std::time::Instant::now();
        // Its own archive, or (back after its node was lost) one of its
        // checkpoints.
        let source = self.record.restore_from.unwrap_or(id);
        let layers = {
            let _restoring = self.context.restore_lock.lock().await;
            let commit = store.get(source).await.map_err(|e| match e.code() {
                ErrorCode::CheckpointNotFound if source == id => CoreError::invalid(
                    ErrorCode::CheckpointNotFound,
                    format!("run {id} is archived, but its archive is no longer in the checkpoint store; delete the run"),
                ),
                ErrorCode::CheckpointNotFound => CoreError::invalid(
                    ErrorCode::CheckpointNotFound,
                    format!("run {id} was to come back from checkpoint {source}, which is no longer in the checkpoint store; delete the run"),
                ),
                _ => e,
            })?;
            let archive = store.record(&commit).await?;
            if !self.context.images.has_layers(&archive.base) {
                return Err(CoreError::invalid(
                    ErrorCode::CheckpointBaseMissing,
                    format!(
                        "run {id} needs the layers of image {:?}, which this server no longer has",
                        archive.image
                    ),
                ));
            }
            self.context.restore_layers(store, &archive).await?
        };
        let mut restored = self.record.clone();
        restored.layers = layers;
        restored.warm = None;
        let (spec, _pin) = self.context.boot_spec(&restored).await?;
        let before = std::mem::replace(&mut self.record, restored);
        if let Err(e) = self.start_sandbox(&spec, true).await {
            self.record = before;
            tracing::error!(run = %id, error = %error_chain(&e), "could not restore the run");
            return Err(e);
        }
        self.apply(Event::Restored);
        self.note(UsageKind::Restore);
        self.record.archived_at = None;
        self.record.restore_from = None;
        if std::mem::take(&mut self.record.moved) {
            // Moved here from another node: its TTL goes on as it was.
        } else {
            let ttl = match self.record.ttl_sec {
                0 => self.context.config().default_ttl,
                secs => Duration::from_secs(secs),
            };
            self.record.expired = false;
            self.record.expires_at = OffsetDateTime::now_utc() + ttl;
        }
        if let Err(e) = self.context.store.put_async(self.record.clone()).await {
            tracing::warn!(run = %id, error = %e, "could not store the run's restore");
        }
        self.publish();
        // The run has its disk again; its archive is of no more use (a
        // checkpoint it came back from is the caller's, and stays).
        if source != id {
            // Nothing to delete.
        } else if let Err(e) = store.delete(id).await {
            tracing::warn!(run = %id, error = %error_chain(&e), "could not delete a restored run's archive; delete it with DELETE /v1/checkpoints/{id}");
        }
        tracing::info!(run = %id, elapsed_ms = started.elapsed().as_millis() as u64, "run restored");
        Ok(())
    }

    /// A run woken or resumed after its TTL passed gets a fresh one, as
    /// long as it was made with.
    fn refresh_expiry(&mut self) {
        if self.record.expired {
            let ttl = match self.record.ttl_sec {
                0 => self.context.config().default_ttl,
                secs => Duration::from_secs(secs),
            };
            self.record.expired = false;
            self.record.expires_at = OffsetDateTime::now_utc() + ttl;
        }
    }

    /// What the idle policy does next and when, if anything: pause or
    /// hibernate at the last use plus its interval. While something is
    /// open on the run (or its proxy has a request in flight) it is not
    /// idle, and the clock is looked at again each second.
    fn idle_step(&self) -> Option<(tokio::time::Instant, IdleStep)> {
        if self.phase == Phase::Hibernated && self.context.config().checkpoints.is_some() {
            // Archived after `--archive-after-sec` asleep, or at once when
            // its TTL asked for an archive that has not happened yet.
            let after = match (self.record.on_expire, self.record.expired) {
                (runbox_types::OnExpire::Archive, true) => Some(Duration::ZERO),
                _ => self.context.config().archive_after,
            };
            if let Some(after) = after {
                let mut at = self.handle.activity.since() + after;
                if let Some((retry, _)) = self.archive_retry {
                    at = at.max(retry);
                }
                return Some((at, IdleStep::Archive));
            }
        }
        let policy = self.record.idle;
        let (pause, hibernate) = (
            policy.pause_after_sec.filter(|&s| s > 0),
            policy.hibernate_after_sec.filter(|&s| s > 0),
        );
        let (step, after) = match (&self.phase, pause, hibernate) {
            (Phase::Running, Some(p), Some(h)) if h <= p => (IdleStep::Hibernate, h),
            (Phase::Running, Some(p), _) => (IdleStep::Pause, p),
            (Phase::Running | Phase::Paused, _, Some(h)) => (IdleStep::Hibernate, h),
            _ => return None,
        };
        if self.record.is_idle_member() {
            return None;
        }
        let activity = &self.handle.activity;
        // A frozen run's proxy connections wait for it; they are not use.
        let egress = match self.phase {
            Phase::Running => self.handle.egress().map_or(0, |m| m.active()),
            _ => 0,
        };
        if activity.open() > 0 || egress > 0 {
            return Some((
                tokio::time::Instant::now() + Duration::from_secs(1),
                IdleStep::Recheck,
            ));
        }
        Some((activity.since() + Duration::from_secs(after), step))
    }

    /// The idle policy's clock ran out: the run is paused or hibernated
    /// (if it is still idle: an operation may have come and gone).
    async fn idle(&mut self, step: IdleStep) {
        let id = self.record.id;
        match self.idle_step() {
            Some((at, now_step)) if now_step == step && at <= tokio::time::Instant::now() => {}
            _ => return,
        }
        let done = match step {
            IdleStep::Pause => self.pause().await,
            IdleStep::Hibernate => self.hibernate().await,
            IdleStep::Archive => {
                let archived = self.archive().await;
                match &archived {
                    Ok(()) => self.archive_retry = None,
                    Err(e) => {
                        // The store may be down: later, less and less often.
                        let failures = self.archive_retry.map_or(0, |(_, n)| n) + 1;
                        let delay = Duration::from_secs(30)
                            .saturating_mul(1 << failures.min(7))
                            .min(Duration::from_secs(3600));
                        tracing::warn!(run = %id, error = %error_chain(e), retry_in_sec = delay.as_secs(), "could not archive a hibernated run; it stays hibernated");
                        self.archive_retry = Some((tokio::time::Instant::now() + delay, failures));
                        return;
                    }
                }
                archived
            }
            IdleStep::Recheck => return,
        };
        match done {
            Ok(()) => tracing::info!(run = %id, ?step, "run idle; put to sleep"),
            Err(e) => {
                tracing::warn!(run = %id, ?step, error = %error_chain(&e), "could not put an idle run to sleep; trying again later");
                // Not at once again: the clock starts over.
                self.handle.activity.touch();
            }
        }
    }

    async fn handle_command(&mut self, command: Command) {
        let id = self.record.id;
        let now = OffsetDateTime::now_utc();
        match command {
            Command::Admit { access, reply } => {
                let answer = self.admit(access, now).await;
                let _ = reply.send(answer);
            }
            Command::End => self.fence.end(),
            Command::Renew { ttl, reply } => {
                let (before, expired) = (self.record.expires_at, self.record.expired);
                self.record.expires_at = now + ttl;
                // A new TTL: its end applies `onExpire` again.
                self.record.expired = false;
                let answer = match self.context.store.put_async(self.record.clone()).await {
                    Ok(()) => {
                        self.publish();
                        Ok(self.record.clone())
                    }
                    Err(e) => {
                        self.record.expires_at = before;
                        self.record.expired = expired;
                        Err(e)
                    }
                };
                let _ = reply.send(answer);
            }
            Command::Lease { op, reply } => {
                let answer = match &self.phase {
                    Phase::Running | Phase::Paused | Phase::Hibernated | Phase::Archived => {
                        self.change_lease(op, now).await
                    }
                    other => Err(self.refusal(other)),
                };
                let _ = reply.send(answer);
            }
            Command::Stop {
                reason,
                reply,
                halted,
            } => {
                tracing::debug!(run = %id, ?reason, "stopping the run");
                self.stop(reason);
                match halted {
                    true => self.halt_waiters.push(reply),
                    false => self.stop_waiters.push(reply),
                }
            }
            Command::Relinquish { reply } => {
                self.relinquish();
                self.stop_waiters.push(reply);
            }
            Command::MoveOut { to, reply } => {
                let answer = match &self.phase {
                    Phase::Running | Phase::Paused | Phase::Hibernated | Phase::Archived => {
                        self.move_out(&to).await
                    }
                    other => Err(self.refusal(other)),
                };
                let _ = reply.send(answer);
            }
            Command::Pause { reply } => {
                let answer = match &self.phase {
                    // Asleep already, more deeply for a hibernated run.
                    Phase::Paused | Phase::Hibernated | Phase::Archived => Ok(()),
                    Phase::Running => self.pause().await,
                    other => Err(self.refusal(other)),
                };
                let _ = reply.send(answer);
            }
            Command::Resume { reply } => {
                let answer = match &self.phase {
                    Phase::Running => Ok(()),
                    Phase::Paused => self.resume().await,
                    Phase::Hibernated => self.wake().await,
                    Phase::Archived => self.restore().await,
                    other => Err(self.refusal(other)),
                };
                let _ = reply.send(answer);
            }
            Command::Hibernate { reply } => {
                let answer = match &self.phase {
                    Phase::Hibernated | Phase::Archived => Ok(()),
                    Phase::Running | Phase::Paused => self.hibernate().await,
                    other => Err(self.refusal(other)),
                };
                let _ = reply.send(answer);
            }
            Command::Wake { reply } => {
                let answer = match &self.phase {
                    Phase::Running => Ok(()),
                    Phase::Paused => self.resume().await,
                    Phase::Hibernated | Phase::Failed(_) => self.wake().await,
                    Phase::Archived => self.restore().await,
                    other => Err(self.refusal(other)),
                };
                let _ = reply.send(answer);
            }
            Command::Archive { reply } => {
                let answer = match &self.phase {
                    Phase::Archived => Ok(()),
                    Phase::Running | Phase::Paused | Phase::Hibernated => self.archive().await,
                    other => Err(self.refusal(other)),
                };
                let _ = reply.send(answer);
            }
            Command::Rollback {
                point,
                credential,
                reply,
            } => {
                let answer = match &self.phase {
                    Phase::Running | Phase::Paused | Phase::Hibernated => {
                        self.rollback(point, credential, now).await
                    }
                    Phase::Archived => Err(CoreError::RunNotRunning(
                        id,
                        "archived; wake it (POST /v1/runs/{id}/resume) before rolling it back",
                    )),
                    other => Err(self.refusal(other)),
                };
                let _ = reply.send(answer);
            }
            Command::Egress { req, reply } => {
                let answer = match &self.phase {
                    Phase::Running | Phase::Paused => self.change_egress(&req, true).await,
                    Phase::Hibernated | Phase::Archived => self.change_egress(&req, false).await,
                    other => Err(self.refusal(other)),
                };
                let _ = reply.send(answer);
            }
            Command::Claim { claim, reply } => {
                let answer = match &self.phase {
                    Phase::Pooled => self.claim(*claim, now).await,
                    other => Err(self.refusal(other)),
                };
                let claimed = answer.is_ok();
                let _ = reply.send(answer);
                // After the answer (the claim is on the start path), in
                // order with this owner's later writes, made durable by a
                // flush in the background so the run's first exec does not
                // wait for the disk. A crash in the few milliseconds between
                // costs this run, never a second claim (see `claim`).
                if claimed {
                    match self
                        .context
                        .store
                        .put_async_with(self.record.clone(), Durability::None)
                        .await
                    {
                        Ok(()) => self.context.store.flush_in_background(),
                        Err(e) => {
                            tracing::warn!(run = %id, error = %e, "could not store a pool member's claim")
                        }
                    }
                }
            }
        }
    }

    /// Applies a claim: the create's environment, TTL, egress and labels,
    /// then the egress proxy (whose listener the member could not have
    /// served before). The caller stores the record after answering: after
    /// a crash, reconcile destroys every member whose record says idle
    /// rather than hand it out again, so a claim that had not reached the
    /// disk yet costs that run, never a second claim.
    async fn claim(&mut self, claim: Claim, now: OffsetDateTime) -> Result<(), CoreError> {
        self.record.env = claim.env;
        self.record.created_at = now;
        self.record.expires_at = now + claim.ttl;
        self.record.egress = claim.egress;
        self.record.labels = claim.labels;
        self.record.public_ports = claim.public_ports;
        self.record.auto_resume = claim.auto_resume;
        self.record.on_expire = claim.on_expire;
        self.record.on_node_loss = claim.on_node_loss;
        self.record.idle = claim.idle;
        self.record.history = claim.history;
        self.record.ttl_sec = claim.ttl.as_secs();
        self.record.idempotency = claim.idempotency;
        self.record.tenant = claim.tenant;
        self.record.allow_privilege_escalation = claim.allow_privilege_escalation;
        if !claim.volumes.is_empty() {
            let id = self.record.id;
            let catalog = self.context.config().datasets.clone();
            let binds = super::volumes::binds(&claim.volumes, &catalog);
            let mounted = self.context.lane.sandbox(id).mount_volumes(&binds).await;
            if let Err(e) = mounted {
                // Not handed out: what it held is free again before the
                // create goes on (cold).
                super::volumes::release_datasets(&self.context.lane, &catalog, id, &claim.volumes);
                self.context.ledger.forgo_volumes(id);
                return Err(e.into());
            }
            self.record.volumes = claim.volumes;
        }
        if let Some(member) = &mut self.record.pool {
            member.claimed = true;
        }
        self.apply(Event::Claimed);
        self.note(UsageKind::Claim);
        // Its idle clock starts now, not when it was parked.
        self.handle.activity.touch();
        self.publish();
        let stop = self.incarnation.clone();
        self.context
            .start_egress(&self.handle, &self.record, stop)
            .await
    }

    /// The run's TTL passed: it is destroyed, or with `onExpire: pause` or
    /// `hibernate` put to sleep so and kept for the retention (once: at the
    /// end of that, it is destroyed). A run hibernated already stays so.
    async fn expired(&mut self) {
        use runbox_types::OnExpire;
        let id = self.record.id;
        let keep = self.record.on_expire != OnExpire::Delete
            && !self.record.expired
            && matches!(
                self.phase,
                Phase::Running | Phase::Paused | Phase::Hibernated | Phase::Archived
            );
        if !keep {
            tracing::info!(run = %id, "run reached its TTL");
            self.stop(ExitReason::RunExpired);
            return;
        }
        let archive = self.record.on_expire == OnExpire::Archive;
        let hibernate = self.record.on_expire == OnExpire::Hibernate
            || matches!(self.phase, Phase::Hibernated | Phase::Archived)
            || archive;
        if archive && self.phase != Phase::Archived {
            // Stored and shown with the archive itself: a run that reads
            // `archived` already shows the retention it is kept for.
            self.record.expired = true;
            self.record.expires_at =
                OffsetDateTime::now_utc() + self.context.config().archive_retention;
        }
        let slept = match (&self.phase, archive, hibernate) {
            (Phase::Archived, _, _) => Ok(()),
            (_, true, _) => match self.archive().await {
                Ok(()) => Ok(()),
                // Kept hibernated; the idle tick tries the archive again.
                Err(e) if self.phase == Phase::Hibernated => {
                    tracing::warn!(run = %id, error = %error_chain(&e), "could not archive the run at its TTL; it stays hibernated and the archive is tried again");
                    Ok(())
                }
                Err(e) => Err(e),
            },
            (Phase::Hibernated, _, _) | (Phase::Paused, _, false) => Ok(()),
            (_, _, true) => self.hibernate().await,
            (_, _, false) => self.pause().await,
        };
        if let Err(e) = slept {
            tracing::warn!(run = %id, error = %error_chain(&e), "could not put the run to sleep at its TTL; destroying it");
            self.stop(ExitReason::RunExpired);
            return;
        }
        let retention = if archive {
            self.context.config().archive_retention
        } else if hibernate {
            self.context.config().hibernated_retention
        } else {
            self.context.config().paused_retention
        };
        let before = (self.record.expires_at, self.record.expired);
        self.record.expired = true;
        self.record.expires_at = OffsetDateTime::now_utc() + retention;
        if let Err(e) = self.context.store.put_async(self.record.clone()).await {
            // Kept as it was: paused, with the old expiry passed, so the
            // next turn of the loop tries again.
            tracing::warn!(run = %id, error = %e, "could not store the run's retention");
            (self.record.expires_at, self.record.expired) = before;
            tokio::time::sleep(Duration::from_secs(1)).await;
            return;
        }
        self.publish();
        tracing::info!(run = %id, until = %self.record.expires_at, "run reached its TTL; asleep and kept");
    }

    /// Freezes the run's processes where they are, then stores that it is
    /// paused. A crash in between finds a running record, whose run is
    /// thawed at adoption: it is running, as recorded.
    async fn pause(&mut self) -> Result<(), CoreError> {
        let id = self.record.id;
        if let Err(why) = self.context.lane.capabilities().suspend.check() {
            return Err(CoreError::invalid(
                ErrorCode::PauseUnsupported,
                format!("this server cannot pause runs: {why}"),
            ));
        }
        let sandbox = self.context.lane.sandbox(id);
        let started = std::time::Instant::now();
        sandbox.suspend().await?;
        self.apply(Event::Paused);
        self.note(UsageKind::Pause);
        if let Err(e) = self.context.store.put_async(self.record.clone()).await {
            // Not paused unless recorded: thawed again, and the caller told.
            let thawed = sandbox.resume().await;
            self.apply(Event::Resumed);
            self.note(UsageKind::Resume);
            self.publish();
            thawed?;
            return Err(e);
        }
        self.publish();
        tracing::info!(run = %id, elapsed_us = started.elapsed().as_micros() as u64, "run paused");
        Ok(())
    }

    /// Thaws a paused run, then stores that it runs. A crash in between
    /// finds a paused record, whose run is frozen again at adoption.
    async fn resume(&mut self) -> Result<(), CoreError> {
        let id = self.record.id;
        let started = std::time::Instant::now();
        self.context.lane.sandbox(id).resume().await?;
        // A run adopted while paused: its agent is asked what it speaks now
        // that it can answer.
        if let Some((agent, PROTOCOL_UNKNOWN)) = &self.agent {
            let agent = agent.clone();
            let protocol =
                super::wait_ready(agent.clone(), self.context.config().agent_ready_timeout)
                    .await
                    .map_err(|e| {
                        CoreError::Agent(format!("the resumed run's agent did not answer: {e}"))
                    })?;
            self.agent = Some((agent, protocol));
        }
        self.apply(Event::Resumed);
        self.note(UsageKind::Resume);
        self.refresh_expiry();
        if let Err(e) = self.context.store.put_async(self.record.clone()).await {
            tracing::warn!(run = %id, error = %e, "could not store that the run resumed; a restart pauses it again");
        }
        self.publish();
        tracing::info!(run = %id, elapsed_us = started.elapsed().as_micros() as u64, "run resumed");
        Ok(())
    }

    /// The one door: admits an operation if the run can take it, under
    /// the lease for a fenced one.
    async fn admit(&mut self, access: Access, now: OffsetDateTime) -> Result<Admitted, CoreError> {
        let presented = match &access {
            Access::Fenced(credential) => {
                Some(credential.as_ref().map(|(owner, generation)| Credential {
                    owner,
                    generation: *generation,
                }))
            }
            Access::Open => None,
        };
        if !matches!(
            self.phase,
            Phase::Running | Phase::Paused | Phase::Pooled | Phase::Hibernated | Phase::Archived
        ) {
            return Err(self.refusal(&self.phase));
        }
        // The lease is asked before a resume, so a caller it refuses does
        // not wake a paused run.
        if let Some(presented) = presented {
            self.fence.book.admit(presented, now)?;
        }
        // A paused run is resumed here, where every operation comes in:
        // commands wait their turn, so callers that arrive together share
        // one resume.
        if matches!(
            self.phase,
            Phase::Paused | Phase::Hibernated | Phase::Archived
        ) {
            if !self.record.auto_resume {
                return Err(CoreError::invalid(
                    ErrorCode::RunPaused,
                    format!(
                        "run {} is {} and does not wake on traffic (autoResume: false); \
                         wake it with POST /v1/runs/{}/resume",
                        self.record.id,
                        self.phase.name(),
                        self.record.id
                    ),
                ));
            }
            match self.phase {
                Phase::Paused => self.resume().await?,
                Phase::Archived => self.restore().await?,
                _ => self.wake().await?,
            }
        }
        // A pool member is reached only by its pool's warm-up: the API
        // cannot name it.
        let (agent, protocol) = match (&self.phase, &self.agent) {
            (Phase::Running | Phase::Pooled, Some(agent)) => agent.clone(),
            (Phase::Running | Phase::Pooled, None) => {
                return Err(CoreError::RunNotFound(self.record.id))
            }
            (other, _) => return Err(self.refusal(other)),
        };
        if let Some(presented) = presented {
            self.fence.begin(presented, now)?;
        }
        Ok(Admitted {
            agent,
            protocol,
            record: self.publish.borrow().record.clone(),
            busy: Busy::new(self.handle.clone()),
        })
    }

    /// Why a run in `phase` refuses an exec, a write or a lease change.
    fn refusal(&self, phase: &Phase) -> CoreError {
        match phase {
            Phase::Failed(why) => CoreError::RunFailed(self.record.id, why.clone()),
            Phase::Creating => CoreError::RunNotRunning(self.record.id, "still being created"),
            Phase::Running
            | Phase::Paused
            | Phase::Hibernated
            | Phase::Archived
            | Phase::Pooled
            | Phase::Gone => CoreError::RunNotFound(self.record.id),
            Phase::Stopping(_) => self.handle.ended(),
        }
    }

    /// Applies a lease change and stores the new lease state before it
    /// takes effect: if the store fails, nothing changed.
    async fn change_lease(
        &mut self,
        op: LeaseOp,
        now: OffsetDateTime,
    ) -> Result<Option<Lease>, CoreError> {
        let mut next = self.fence.clone();
        let out = match &op {
            LeaseOp::Acquire { owner, ttl } => next.acquire(owner, *ttl, now).map(Some),
            LeaseOp::Renew {
                owner,
                generation,
                ttl,
            } => next
                .book
                .renew(
                    Credential {
                        owner,
                        generation: *generation,
                    },
                    *ttl,
                    now,
                )
                .map(Some),
            LeaseOp::Release { owner, generation } => next
                .book
                .release(
                    Credential {
                        owner,
                        generation: *generation,
                    },
                    now,
                )
                .map(|()| None),
        }?;
        if next.book != self.fence.book {
            let mut record = self.record.clone();
            record.lease = next.book.clone();
            self.context.store.put_async(record.clone()).await?;
            self.record = record;
        }
        self.fence = next;
        self.publish();
        Ok(out)
    }

    /// Step 3: destroys the sandbox, retrying with backoff, answering every
    /// command meanwhile as a run that is gone.
    async fn teardown(&mut self) {
        let id = self.record.id;
        // A kill ends the processes while the stopping record is written,
        // and is answered once both are done. A crash in between leaves a
        // record that says running over a dead init, which the next start
        // judges as any run whose init died; the caller had no answer yet.
        let halt = self.may_halt_for_delete().then(|| self.halt_processes());
        let store = self.context.store.clone();
        let (stored, halted) = tokio::join!(store.put_async(self.record.clone()), async {
            match halt {
                Some(halt) => halt.await,
                None => false,
            }
        });
        match stored {
            Ok(()) if halted => {
                for waiter in self.halt_waiters.drain(..) {
                    let _ = waiter.send(Ok(()));
                }
            }
            Ok(()) => {}
            Err(e) => {
                tracing::warn!(run = %id, error = %e, "could not mark the run as stopping")
            }
        }
        let mut attempt = 0u32;
        loop {
            let result = {
                let _gate = self.context.teardown_gate.acquire().await;
                let _permit = self.context.budget.acquire().await;
                self.context.lane.sandbox(id).destroy().await
            };
            match result {
                Ok(()) => break,
                Err(e) => {
                    attempt += 1;
                    let delay = reaper::backoff(attempt);
                    let message = error_chain(&e);
                    tracing::error!(run = %id, attempt, retry_in_ms = delay.as_millis() as u64,
                        error = %message, "destroying the run failed; will retry");
                    self.record.failure = Some(format!("teardown failed: {message}"));
                    if let Err(e) = self.context.store.put_async(self.record.clone()).await {
                        tracing::warn!(run = %id, error = %e, "could not store the teardown error");
                    }
                    self.answer_stop_waiters();
                    self.refuse_commands_for(delay).await;
                }
            }
        }
        let moved = self.handle.end_reason.get() == Some(&ExitReason::RunMoved);
        if self.record.archived_at.is_some() && !moved {
            if let Some(store) = &self.context.config().checkpoints {
                match store.delete(id).await {
                    Ok(()) => {}
                    Err(e) if e.code() == ErrorCode::CheckpointNotFound => {}
                    Err(e) => {
                        tracing::warn!(run = %id, error = %error_chain(&e), "could not delete a destroyed run's archive; delete it with DELETE /v1/checkpoints/{id}")
                    }
                }
            }
        }
        if let Err(e) = self.context.store.delete_async(id).await {
            // Reconcile finds it at the next start and destroys it again,
            // which finds nothing left and deletes the record.
            tracing::error!(run = %id, error = %e, "could not delete the run record");
        }
        self.apply(Event::Destroyed);
        self.publish();
        self.answer_stop_waiters();
    }

    /// Whether a deleted run can be answered for before the rest of its
    /// teardown: once its record says it is stopping, durably (the API
    /// shows it no more, a crash from there finishes the teardown at the
    /// next start), and its processes are gone, it does nothing a caller
    /// could notice. The
    /// rest (mounts, namespace, cgroups, disk) follows in the background;
    /// meanwhile it counts against no limit (see [`crate::ledger`]). Not a
    /// run with volumes: another create may want them the moment the
    /// delete answers, and they are free only once unmounted.
    fn may_halt_for_delete(&self) -> bool {
        matches!(self.phase, Phase::Stopping(ExitReason::RunDeleted))
            && !self.halt_waiters.is_empty()
            && self.record.volumes.is_empty()
    }

    /// Ends the run's processes ([`Sandbox::halt`]); whether they are gone.
    fn halt_processes(&self) -> impl std::future::Future<Output = bool> + Send + 'static {
        let id = self.record.id;
        let sandbox = self.context.lane.sandbox(id);
        async move {
            match sandbox.halt().await {
                Ok(()) => true,
                Err(e) => {
                    tracing::debug!(run = %id, error = %error_chain(&e),
                        "the delete waits for the whole teardown");
                    false
                }
            }
        }
    }

    fn answer_stop_waiters(&mut self) {
        for waiter in self
            .stop_waiters
            .drain(..)
            .chain(self.halt_waiters.drain(..))
        {
            let _ = waiter.send(Ok(()));
        }
    }

    /// Waits `delay`, answering commands as a run that is gone.
    async fn refuse_commands_for(&mut self, delay: Duration) {
        let until = tokio::time::Instant::now() + delay;
        loop {
            tokio::select! {
                () = tokio::time::sleep_until(until) => return,
                command = self.commands.recv() => {
                    let gone = self.handle.ended();
                    match command {
                        Some(Command::Admit { reply, .. }) => { let _ = reply.send(Err(gone)); }
                        Some(Command::Renew { reply, .. }) => { let _ = reply.send(Err(gone)); }
                        Some(Command::Lease { reply, .. }) => { let _ = reply.send(Err(gone)); }
                        Some(Command::Stop { reply, .. }) => { let _ = reply.send(Err(gone)); }
                        Some(Command::Relinquish { reply }) => { let _ = reply.send(Ok(())); }
                        Some(Command::MoveOut { reply, .. }) => { let _ = reply.send(Err(gone)); }
                        Some(Command::Claim { reply, .. }) => { let _ = reply.send(Err(gone)); }
                        Some(Command::Pause { reply })
                        | Some(Command::Resume { reply })
                        | Some(Command::Hibernate { reply })
                        | Some(Command::Wake { reply })
                        | Some(Command::Archive { reply })
                        | Some(Command::Egress { reply, .. }) => { let _ = reply.send(Err(gone)); }
                        Some(Command::Rollback { reply, .. }) => { let _ = reply.send(Err(gone)); }
                        Some(Command::End) => self.fence.end(),
                        None => {}
                    }
                }
            }
        }
    }
}

/// What a run's idle policy does when its clock runs out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum IdleStep {
    Pause,
    Hibernate,
    /// Send the hibernated run's disk to the checkpoint store.
    Archive,
    /// The run was busy: look again.
    Recheck,
}

/// Sleeps until `at`, or forever without one.
async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// A fenced operation admitted by the run's owner; ends it when dropped.
pub(crate) struct InFlight(pub Arc<RunHandle>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.end_operation();
    }
}

/// Opens run `id`'s SOCKS5 door (`wanted`) or closes it, if it is not so
/// already.
async fn change_socks5(
    lane: Arc<dyn crate::lane::Lane>,
    id: Ulid,
    wanted: bool,
    proxy: Arc<dyn crate::egress::EgressHandle>,
) -> Result<(), CoreError> {
    if proxy.socks5() == wanted {
        return Ok(());
    }
    let door = crate::lane::EgressDoor::Socks5;
    let listener = match wanted {
        true => Some(
            lane.sandbox(id)
                .egress_listener(door)
                .await
                .map_err(|e| super::door_refused(door, e))?,
        ),
        false => None,
    };
    proxy.set_socks5(listener).map_err(|e| {
        CoreError::Lane(crate::lane::LaneError::Failed(format!(
            "opening the run's SOCKS5 door: {e}"
        )))
    })
}
