//! The usage journal: one event per thing a run does that someone pays
//! for (created, claimed, forked, paused, hibernated, woken, restarted,
//! snapshotted, checkpointed, archived, restored, deleted, expired), with
//! its tenant, its size or limits, and at the end of each of its boots the
//! CPU time and peak memory its cgroup counted. Summed per tenant it is a
//! bill: run-seconds by size, CPU-seconds, egress bytes.
//!
//! Events go through [`UsageSink`], so a fleet can send them to a shared
//! store later. [`UsageJournal`] is the node's: `<state>/usage.jsonl`,
//! rotated by size with one `.1` backup. Recording never blocks the run's
//! owner: events go over a channel to one writer thread, which writes them
//! in batches (every [`BATCH_EVERY`] or [`BATCH_MAX`] events) and flushes
//! each batch to disk, so a crash loses at most the batch in flight.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::mpsc;
use std::sync::Mutex;
use std::time::Duration;

use runbox_types::{Limits, SizeTier, UsageReport, UsageTotals};
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use ulid::Ulid;

/// How long the writer gathers events before writing them.
pub const BATCH_EVERY: Duration = Duration::from_millis(500);

/// Most events written as one batch.
pub const BATCH_MAX: usize = 512;

/// What happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UsageKind {
    /// A run was made by a create (cold).
    Create,
    /// A create took a warm pool member.
    Claim,
    /// A run was made by a fork of `parent`.
    Fork,
    /// Its processes were frozen (memory kept).
    Pause,
    /// They were let go on.
    Resume,
    /// It was stopped down to its disk.
    Hibernate,
    /// It was booted again on its disk.
    Wake,
    /// The restart policy booted it again after its init exited.
    Restart,
    /// Its disk went to the checkpoint store.
    Archive,
    /// It was restored from the checkpoint store and booted.
    Restore,
    /// A snapshot of it was taken.
    Snapshot,
    /// A checkpoint of it was taken.
    Checkpoint,
    /// It was deleted.
    Delete,
    /// Its TTL ended it.
    Expire,
    /// Bytes of one allowed egress connection, when it closed.
    Egress,
}

impl UsageKind {
    /// Whether the run holds CPU and memory from this event on (it runs,
    /// or is paused with its memory kept).
    fn starts_holding(self) -> bool {
        matches!(
            self,
            UsageKind::Create
                | UsageKind::Claim
                | UsageKind::Fork
                | UsageKind::Wake
                | UsageKind::Restore
        )
    }

    /// Whether the run stops holding CPU and memory here.
    fn stops_holding(self) -> bool {
        matches!(
            self,
            UsageKind::Hibernate | UsageKind::Archive | UsageKind::Delete | UsageKind::Expire
        )
    }
}

/// One line of the journal.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct UsageEvent {
    /// When.
    #[serde(with = "time::serde::rfc3339")]
    pub t: OffsetDateTime,
    /// What.
    pub event: UsageKind,
    /// The run.
    pub run: Ulid,
    /// Its tenant (absent: the operator's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Its size tier, when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<SizeTier>,
    /// Its limits (on the events that start it holding resources).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<Limits>,
    /// The run it was forked from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<Ulid>,
    /// CPU time of the boot that just ended, in seconds (on hibernate,
    /// delete and expire).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_sec: Option<f64>,
    /// The most memory that boot was charged, in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_memory_bytes: Option<u64>,
    /// Payload bytes of one egress connection, both ways (on `egress`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_bytes: Option<u64>,
    /// The node of a fleet that recorded it (runs move between nodes, so
    /// one run's events may be in several nodes' journals).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
}

impl UsageEvent {
    /// An event of `kind` for `run` now, with nothing else filled in.
    pub fn now(kind: UsageKind, run: Ulid, tenant: Option<String>) -> UsageEvent {
        UsageEvent {
            t: OffsetDateTime::now_utc(),
            event: kind,
            run,
            tenant,
            size: None,
            limits: None,
            parent: None,
            cpu_sec: None,
            peak_memory_bytes: None,
            egress_bytes: None,
            node: None,
        }
    }
}

/// Where usage events go. Recording must be quick and must not fail the
/// caller: a sink that cannot keep an event logs why.
pub trait UsageSink: Send + Sync + 'static {
    /// Records one event.
    fn record(&self, event: UsageEvent);
    /// Every event kept, oldest first.
    fn events(&self) -> std::io::Result<Vec<UsageEvent>>;
    /// Returns once every event recorded before the call is on disk.
    fn flush(&self);
}

/// A sink that keeps nothing (usage accounting off).
pub struct NoUsage;

impl UsageSink for NoUsage {
    fn record(&self, _event: UsageEvent) {}
    fn events(&self) -> std::io::Result<Vec<UsageEvent>> {
        Ok(Vec::new())
    }
    fn flush(&self) {}
}

enum Message {
    Event(Box<UsageEvent>),
    Flush(mpsc::Sender<()>),
}

/// `<state>/usage.jsonl`, written by one thread in batches.
pub struct UsageJournal {
    path: PathBuf,
    /// The node of a fleet this is, stamped on each event.
    node: Option<String>,
    sender: Mutex<mpsc::Sender<Message>>,
}

impl UsageJournal {
    /// Opens (appending) or creates the journal at `path`, rotated at
    /// `max_bytes`, and starts its writer thread.
    pub fn open(path: PathBuf, max_bytes: u64) -> std::io::Result<UsageJournal> {
        let journal = runbox_journal::Journal::open(path.clone(), max_bytes)?;
        let (sender, receiver) = mpsc::channel();
        std::thread::Builder::new()
            .name("usage-journal".into())
            .spawn(move || write_batches(&journal, &receiver))?;
        Ok(UsageJournal {
            path,
            node: None,
            sender: Mutex::new(sender),
        })
    }

    /// Stamps each event with node `node` (a node of a fleet).
    pub fn for_node(mut self, node: Option<String>) -> UsageJournal {
        self.node = node;
        self
    }

    fn send(&self, message: Message) -> bool {
        self.sender
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(message)
            .is_ok()
    }
}

/// The writer: waits for an event, gathers what follows for up to
/// [`BATCH_EVERY`], writes the batch and flushes it to disk.
fn write_batches(journal: &runbox_journal::Journal, receiver: &mpsc::Receiver<Message>) {
    while let Ok(first) = receiver.recv() {
        let mut lines = Vec::new();
        let mut waiting = Vec::new();
        let deadline = std::time::Instant::now() + BATCH_EVERY;
        let mut next = Some(first);
        while let Some(message) = next.take() {
            match message {
                Message::Event(event) => match serde_json::to_vec(&event) {
                    Ok(line) => lines.push(line),
                    Err(e) => tracing::warn!(error = %e, "cannot encode a usage event"),
                },
                // A flush ends the batch at once.
                Message::Flush(done) => {
                    waiting.push(done);
                    break;
                }
            }
            if lines.len() >= BATCH_MAX {
                break;
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            next = receiver.recv_timeout(left).ok();
        }
        if let Err(e) = journal.append(&lines, true) {
            tracing::warn!(path = %journal.path().display(), error = %e, events = lines.len(), "cannot write usage events");
        }
        for done in waiting {
            let _ = done.send(());
        }
    }
}

impl UsageSink for UsageJournal {
    fn record(&self, mut event: UsageEvent) {
        if event.node.is_none() {
            event.node = self.node.clone();
        }
        if !self.send(Message::Event(Box::new(event))) {
            tracing::warn!("the usage journal's writer has stopped; an event is lost");
        }
    }

    fn events(&self) -> std::io::Result<Vec<UsageEvent>> {
        let lines = runbox_journal::read_lines(&self.path)?;
        Ok(lines
            .iter()
            .filter_map(|line| serde_json::from_str(line).ok())
            .collect())
    }

    fn flush(&self) {
        let (done, wait) = mpsc::channel();
        if self.send(Message::Flush(done)) {
            let _ = wait.recv_timeout(Duration::from_secs(10));
        }
    }
}

/// Sums `events` between `since` and `until` per tenant (`tenant`: only
/// that one; `Some("")` is the operator's): run-seconds by size (a run
/// counts while it runs or is paused, from its create, claim, fork, wake
/// or restore to its hibernate, archive, delete or expiry; a run still
/// holding at `until` counts up to it), CPU-seconds, peak memory and
/// egress bytes, and the events of each kind.
pub fn summarize(
    events: &[UsageEvent],
    since: Option<OffsetDateTime>,
    until: OffsetDateTime,
    tenant: Option<&str>,
) -> UsageReport {
    let since_t = since.unwrap_or(OffsetDateTime::UNIX_EPOCH);
    let mut totals: BTreeMap<String, UsageTotals> = BTreeMap::new();
    // Per run: since when it holds resources, and under which size key.
    let mut holding: BTreeMap<Ulid, (OffsetDateTime, String, String)> = BTreeMap::new();
    let clip = |from: OffsetDateTime, to: OffsetDateTime| -> f64 {
        let (from, to) = (from.max(since_t), to.min(until));
        if to > from {
            (to - from).as_seconds_f64()
        } else {
            0.0
        }
    };
    let key_of = |e: &UsageEvent| e.tenant.clone().unwrap_or_default();
    let size_of = |e: &UsageEvent| e.size.map_or("custom", |s| s.as_str()).to_owned();
    let mut ordered: Vec<&UsageEvent> = events.iter().filter(|e| e.t <= until).collect();
    ordered.sort_by_key(|e| e.t);
    for event in ordered {
        let key = key_of(event);
        if tenant.is_some_and(|t| t != key) {
            continue;
        }
        let entry = totals.entry(key.clone()).or_default();
        let inside = event.t >= since_t;
        if inside {
            *entry.events.entry(kind_name(event.event)).or_insert(0) += 1;
            if let Some(cpu) = event.cpu_sec {
                entry.cpu_seconds += cpu;
            }
            if let Some(peak) = event.peak_memory_bytes {
                entry.peak_memory_bytes = entry.peak_memory_bytes.max(peak);
            }
            if let Some(bytes) = event.egress_bytes {
                entry.egress_bytes += bytes;
            }
        }
        if event.event.starts_holding() {
            holding
                .entry(event.run)
                .or_insert_with(|| (event.t, key, size_of(event)));
        } else if event.event.stops_holding() {
            if let Some((from, key, size)) = holding.remove(&event.run) {
                let seconds = clip(from, event.t);
                let entry = totals.entry(key).or_default();
                *entry.run_seconds.entry(size).or_insert(0.0) += seconds;
            }
        }
    }
    for (_, (from, key, size)) in holding {
        let seconds = clip(from, until);
        let entry = totals.entry(key).or_default();
        *entry.run_seconds.entry(size).or_insert(0.0) += seconds;
    }
    UsageReport {
        since,
        until,
        tenants: totals,
        nodes: Vec::new(),
    }
}

/// Adds another node's report of the same window to `report`: seconds,
/// bytes and events summed, the peak the greater of the two.
pub fn add_report(report: &mut UsageReport, other: UsageReport) {
    for (tenant, theirs) in other.tenants {
        let ours = report.tenants.entry(tenant).or_default();
        for (size, seconds) in theirs.run_seconds {
            *ours.run_seconds.entry(size).or_default() += seconds;
        }
        ours.cpu_seconds += theirs.cpu_seconds;
        ours.peak_memory_bytes = ours.peak_memory_bytes.max(theirs.peak_memory_bytes);
        ours.egress_bytes += theirs.egress_bytes;
        for (kind, count) in theirs.events {
            *ours.events.entry(kind).or_default() += count;
        }
    }
    report.nodes.extend(other.nodes);
}

/// A window's start as a caller writes it: RFC 3339
/// (`2026-12-01T00:00:00Z`), or a span back from `now` (`90m`, `24h`,
/// `7d`).
pub fn parse_since(text: &str, now: OffsetDateTime) -> Result<OffsetDateTime, String> {
    let text = text.trim();
    // Nothing was recorded before 1970, and a time before year 0 cannot
    // even be written back in the answer: earlier means the whole journal.
    let floor = |t: OffsetDateTime| t.max(OffsetDateTime::UNIX_EPOCH);
    if let Ok(t) = OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339) {
        return Ok(floor(t));
    }
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let n: i64 = digits
        .parse()
        .ok()
        .filter(|_| (1..=6).contains(&digits.len()))
        .ok_or_else(|| bad_since(text))?;
    let span = match unit {
        "m" => time::Duration::minutes(n),
        "h" => time::Duration::hours(n),
        "d" => time::Duration::days(n),
        _ => return Err(bad_since(text)),
    };
    now.checked_sub(span)
        .map(floor)
        .ok_or_else(|| bad_since(text))
}

fn bad_since(text: &str) -> String {
    format!(
        "since {:?} is neither an RFC 3339 time (2026-12-01T00:00:00Z) nor a span back from now (90m, 24h, 7d)",
        text.chars().take(64).collect::<String>()
    )
}

fn kind_name(kind: UsageKind) -> String {
    serde_json::to_value(kind)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_since_before_1970_means_the_whole_journal() {
        let now = OffsetDateTime::now_utc();
        for text in [
            "810049d",
            "999999d",
            "1969-12-31T23:59:59Z",
            "0000-01-01T00:00:00Z",
        ] {
            let since = parse_since(text, now).unwrap();
            assert_eq!(since, OffsetDateTime::UNIX_EPOCH, "{text}");
            // It can be written back in an answer.
            since
                .format(&time::format_description::well_known::Rfc3339)
                .unwrap();
        }
    }

    fn at(minute: i64, kind: UsageKind, run: Ulid, tenant: &str) -> UsageEvent {
        UsageEvent {
            t: OffsetDateTime::UNIX_EPOCH + time::Duration::minutes(minute),
            size: Some(SizeTier::Small),
            ..UsageEvent::now(kind, run, Some(tenant.to_owned()).filter(|t| !t.is_empty()))
        }
    }

    #[test]
    fn a_scripted_sequence_sums_to_a_bill() {
        let (a, b, c) = (Ulid::new(), Ulid::new(), Ulid::new());
        let mut events = vec![
            at(0, UsageKind::Create, a, "acme"),
            at(10, UsageKind::Pause, a, "acme"),
            at(20, UsageKind::Hibernate, a, "acme"),
            at(50, UsageKind::Wake, a, "acme"),
            at(60, UsageKind::Delete, a, "acme"),
            at(5, UsageKind::Claim, b, "beta"),
            at(15, UsageKind::Expire, b, "beta"),
            // Still running at the end of the window.
            at(30, UsageKind::Fork, c, ""),
        ];
        events[4].cpu_sec = Some(1.5);
        events[2].cpu_sec = Some(2.0);
        events[4].peak_memory_bytes = Some(100);
        events[6].egress_bytes = Some(42);
        let until = OffsetDateTime::UNIX_EPOCH + time::Duration::minutes(90);
        let report = summarize(&events, None, until, None);
        let acme = &report.tenants["acme"];
        // Held 0-20 and 50-60; hibernated 20-50 does not count.
        assert_eq!(acme.run_seconds["small"], 30.0 * 60.0);
        assert_eq!(acme.cpu_seconds, 3.5);
        assert_eq!(acme.peak_memory_bytes, 100);
        assert_eq!(acme.events["hibernate"], 1);
        assert_eq!(report.tenants["beta"].run_seconds["small"], 600.0);
        assert_eq!(report.tenants["beta"].egress_bytes, 42);
        assert_eq!(report.tenants[""].run_seconds["small"], 60.0 * 60.0);
        // A window clips the intervals; a tenant filter keeps one.
        let since = OffsetDateTime::UNIX_EPOCH + time::Duration::minutes(10);
        let report = summarize(&events, Some(since), until, Some("acme"));
        assert_eq!(report.tenants.len(), 1);
        assert_eq!(report.tenants["acme"].run_seconds["small"], 20.0 * 60.0);
    }

    #[test]
    fn windows_are_times_or_spans_back() {
        let now = OffsetDateTime::UNIX_EPOCH + time::Duration::days(30);
        assert_eq!(
            parse_since("24h", now).unwrap(),
            now - time::Duration::hours(24)
        );
        assert_eq!(
            parse_since("7d", now).unwrap(),
            now - time::Duration::days(7)
        );
        assert_eq!(
            parse_since("1970-01-02T00:00:00Z", now).unwrap(),
            OffsetDateTime::UNIX_EPOCH + time::Duration::days(1)
        );
        for bad in [
            "",
            "h",
            "24",
            "24w",
            "-1d",
            "1234567d",
            "99999999999d",
            "yesterday",
        ] {
            assert!(parse_since(bad, now).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_journal_survives_a_reopen_and_flushes_on_demand() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("usage.jsonl");
        let run = Ulid::new();
        {
            let journal = UsageJournal::open(path.clone(), 1 << 20).unwrap();
            journal.record(UsageEvent::now(UsageKind::Create, run, None));
            journal.record(UsageEvent::now(UsageKind::Delete, run, None));
            journal.flush();
            assert_eq!(journal.events().unwrap().len(), 2);
        }
        let journal = UsageJournal::open(path, 1 << 20).unwrap();
        journal.record(UsageEvent::now(UsageKind::Snapshot, run, None));
        journal.flush();
        let kinds: Vec<UsageKind> = journal.events().unwrap().iter().map(|e| e.event).collect();
        assert_eq!(
            kinds,
            vec![UsageKind::Create, UsageKind::Delete, UsageKind::Snapshot]
        );
    }
}
