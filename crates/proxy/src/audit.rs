//! The append-only audit log, `audit.jsonl`: one JSON line per egress
//! decision and per state-changing API call, never a payload or a secret
//! value. Rotated by size to one `.1` backup.
//!
//! This module owns the record shape; the file and its rotation are
//! `runbox-journal`'s (one write per line under a mutex, so lines from
//! concurrent requests never interleave, and rotation only between whole
//! lines). It does not decide what is worth recording (the proxy and the
//! server do) and it never fails its caller: an audit write that cannot be
//! done is reported through `tracing` and the request goes on.

use std::path::PathBuf;

use time::format_description::well_known::Rfc3339;

/// One audit line.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "camelCase")]
pub enum AuditRecord {
    /// An egress decision by the proxy.
    Egress {
        /// RFC 3339 time.
        t: String,
        /// Run id.
        run: String,
        /// `CONNECT` or the HTTP method.
        method: String,
        /// Destination host as asked.
        host: String,
        /// Destination port.
        port: u16,
        /// `allow` or `deny`.
        decision: String,
        /// The rule that decided (see `policy::Decision::rule`) or the guard's
        /// refusal (`guard:<class>`).
        rule: String,
        /// The name of the secret injected, if any.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        secret: Option<String>,
        /// The upstream proxy the run's egress leaves through, without
        /// credentials (`socks5://user@host:port`), if any.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        upstream: Option<String>,
    },
    /// A request through a preview URL.
    Preview {
        /// RFC 3339 time.
        t: String,
        /// Run id.
        run: String,
        /// The port inside the run.
        port: u16,
        /// HTTP method.
        method: String,
        /// The path as the run saw it (no query string, no token).
        path: String,
        /// Response status (101 for a WebSocket that passed through).
        status: u16,
        /// The peer's address.
        client: String,
    },
    /// A state-changing API call.
    Api {
        /// RFC 3339 time.
        t: String,
        /// HTTP method.
        method: String,
        /// Request path (no query string).
        path: String,
        /// Response status.
        status: u16,
        /// The run concerned, if any.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        run: Option<String>,
        /// Who called: `root`, `tenant:<name>` or `run:<id>` (absent when
        /// the token was refused).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        caller: Option<String>,
        /// The tenant of the run concerned (else the calling tenant), if
        /// any.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tenant: Option<String>,
        /// What the call did, beyond its method and path.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        action: Option<Action>,
    },
    /// A run's lifecycle transition, as the usage journal holds it: what
    /// happened to the run whoever caused it (a TTL's end, an idle pause,
    /// a restart, beside the calls that asked for the rest). Never written
    /// to this log: readers see it merged in ([`AuditFilter`]).
    Lifecycle {
        /// RFC 3339 time.
        t: String,
        /// Run id.
        run: String,
        /// Its tenant, if any.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tenant: Option<String>,
        /// `create`, `claim`, `fork`, `pause`, `resume`, `hibernate`,
        /// `wake`, `restart`, `archive`, `restore`, `snapshot`,
        /// `checkpoint`, `delete` or `expire`.
        transition: String,
    },
    /// What a call did once its answer had gone: an interactive session's
    /// command, known only from the first WebSocket message.
    Session {
        /// RFC 3339 time.
        t: String,
        /// Run id.
        run: String,
        /// Who called (as for [`AuditRecord::Api`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        caller: Option<String>,
        /// The run's tenant, if any.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tenant: Option<String>,
        /// What it did.
        action: Action,
    },
    /// A reload of the config file that parsed: what differed from the
    /// running settings, what was applied, what waits for a restart.
    #[serde(rename_all = "camelCase")]
    ConfigReload {
        /// RFC 3339 time.
        t: String,
        /// Keys whose values differ.
        changed: Vec<String>,
        /// Keys now in force.
        applied: Vec<String>,
        /// Keys that take effect at the next start.
        restart_required: Vec<String>,
        /// Keys a flag or environment variable overrides.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        overridden: Vec<String>,
    },
    /// A change to the tenant set: names only, never a token.
    Tenants {
        /// RFC 3339 time.
        t: String,
        /// `create`, `update`, `rotate` or `delete`.
        change: String,
        /// The tenant.
        tenant: String,
    },
}

/// What a call did, in the words an operator investigating a run needs:
/// the command and where it ran, the files it touched. Never a file's
/// contents, an environment value or a secret's value; every text bounded.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "what", rename_all = "camelCase")]
pub enum Action {
    /// A command started.
    Command {
        /// Its argv, bounded: at most [`MAX_ARGS`] arguments of at most
        /// [`MAX_TEXT`] characters each (cut ones end in `…`).
        argv: Vec<String>,
        /// The user it ran as, when the call named one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        user: Option<String>,
        /// Its working directory, when the call named one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cwd: Option<String>,
        /// `exec`, `background` or `session`.
        mode: String,
    },
    /// A file written (a run's under `/work`, or a volume's).
    Write {
        /// The path as the call named it.
        path: String,
    },
    /// A file or directory removed.
    Remove {
        /// The path.
        path: String,
        /// Whether a directory went with what it held.
        recursive: bool,
    },
    /// A file or directory moved.
    Move {
        /// Where from.
        from: String,
        /// Where to.
        to: String,
    },
    /// A directory made.
    MakeDir {
        /// The path.
        path: String,
    },
    /// A run made (the record's `run` is the new one).
    Create {
        /// Its image, or `checkpoint:<id>`.
        image: String,
        /// Its network tier.
        network: String,
    },
    /// A run's egress changed: its tier, how many entries it has, the
    /// names (never the values) of its secrets.
    Egress {
        /// The tier asked for, if the call named one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        network: Option<String>,
        /// The entries given, if the call gave them.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        entries: Option<usize>,
        /// The secrets' names, if the call gave them.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        secrets: Option<Vec<String>>,
    },
}

/// The most arguments of a command an audit record keeps.
pub const MAX_ARGS: usize = 64;

/// The most characters of one text (an argument, a path) a record keeps.
pub const MAX_TEXT: usize = 512;

/// `text` cut at [`MAX_TEXT`] characters (marked with `…` when cut).
pub fn bounded(text: &str) -> String {
    match text.char_indices().nth(MAX_TEXT) {
        None => text.to_owned(),
        Some((at, _)) => format!("{}…", &text[..at]),
    }
}

impl Action {
    /// A command, its argv bounded (a cut list ends in `…`).
    pub fn command(argv: &[String], user: Option<&str>, cwd: Option<&str>, mode: &str) -> Action {
        let mut kept: Vec<String> = argv.iter().take(MAX_ARGS).map(|a| bounded(a)).collect();
        if argv.len() > MAX_ARGS {
            kept.push(format!("… {} more", argv.len() - MAX_ARGS));
        }
        Action::Command {
            argv: kept,
            user: user.filter(|u| !u.is_empty()).map(bounded),
            cwd: cwd.filter(|c| !c.is_empty()).map(bounded),
            mode: mode.to_owned(),
        }
    }
}

impl AuditRecord {
    /// The run the record concerns, if any.
    pub fn run(&self) -> Option<&str> {
        match self {
            AuditRecord::Egress { run, .. }
            | AuditRecord::Preview { run, .. }
            | AuditRecord::Lifecycle { run, .. }
            | AuditRecord::Session { run, .. } => Some(run),
            AuditRecord::Api { run, .. } => run.as_deref(),
            AuditRecord::ConfigReload { .. } | AuditRecord::Tenants { .. } => None,
        }
    }

    /// The tenant the record names, if any: the run's, the caller's, or
    /// the one a tenant change is about.
    pub fn tenant(&self) -> Option<&str> {
        match self {
            AuditRecord::Api { tenant, caller, .. }
            | AuditRecord::Session { tenant, caller, .. } => tenant
                .as_deref()
                .or_else(|| caller.as_deref()?.strip_prefix("tenant:")),
            AuditRecord::Tenants { tenant, .. } => Some(tenant),
            AuditRecord::Lifecycle { tenant, .. } => tenant.as_deref(),
            _ => None,
        }
    }

    /// Its time, as written.
    pub fn time(&self) -> &str {
        match self {
            AuditRecord::Egress { t, .. }
            | AuditRecord::Preview { t, .. }
            | AuditRecord::Api { t, .. }
            | AuditRecord::Session { t, .. }
            | AuditRecord::Lifecycle { t, .. }
            | AuditRecord::ConfigReload { t, .. }
            | AuditRecord::Tenants { t, .. } => t,
        }
    }
}

/// The records of JSON `lines`; lines that do not parse are left out.
pub fn parse_lines(lines: &[String]) -> Vec<AuditRecord> {
    lines
        .iter()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// Which records a reader wants: of one run, of one tenant (its calls and
/// whatever its runs did, egress included), from a moment on.
#[derive(Clone, Debug, Default)]
pub struct AuditFilter {
    /// Only records of this run.
    pub run: Option<String>,
    /// Only records of this tenant.
    pub tenant: Option<String>,
    /// Only records at or after this instant.
    pub since: Option<time::OffsetDateTime>,
}

impl AuditFilter {
    /// The records of `records` that pass, in time order.
    pub fn apply(&self, mut records: Vec<AuditRecord>) -> Vec<AuditRecord> {
        // By the instant, not the text: a time written with a fraction
        // sorts after one without in the same second as text.
        records.sort_by_cached_key(|r| time::OffsetDateTime::parse(r.time(), &Rfc3339).ok());
        // A tenant's runs are those its records name; their egress and
        // preview records carry no tenant of their own.
        let runs: std::collections::HashSet<String> = match &self.tenant {
            Some(tenant) => records
                .iter()
                .filter(|r| r.tenant() == Some(tenant))
                .filter_map(|r| r.run().map(str::to_owned))
                .collect(),
            None => Default::default(),
        };
        records
            .into_iter()
            .filter(|r| self.run.as_deref().is_none_or(|run| r.run() == Some(run)))
            .filter(|r| match &self.tenant {
                None => true,
                Some(tenant) => {
                    r.tenant() == Some(tenant) || r.run().is_some_and(|run| runs.contains(run))
                }
            })
            .filter(|r| match self.since {
                None => true,
                Some(since) => {
                    time::OffsetDateTime::parse(r.time(), &Rfc3339).is_ok_and(|t| t >= since)
                }
            })
            .collect()
    }
}

/// The log writer. Cheap to share (`Arc<AuditLog>`); appends are serialised.
/// The file is a [`runbox_journal::Journal`]: rotated by size with one
/// `.1` backup, owner-only.
pub struct AuditLog {
    journal: runbox_journal::Journal,
    /// Sees every record as it is appended (the daemon's metrics count
    /// egress decisions here); set once.
    observer: std::sync::OnceLock<Observer>,
}

/// A function that sees every appended record.
pub type Observer = Box<dyn Fn(&AuditRecord) + Send + Sync>;

impl AuditLog {
    /// Opens (appending) or creates `path`; rotates to `path.1` when a write
    /// would take it past `max_bytes`.
    pub fn open(path: PathBuf, max_bytes: u64) -> std::io::Result<AuditLog> {
        Ok(AuditLog {
            journal: runbox_journal::Journal::open(path, max_bytes)?,
            observer: std::sync::OnceLock::new(),
        })
    }

    /// Has `observer` see every record appended from now on; only the
    /// first observer given is kept. It runs on the appending task, so it
    /// must be cheap.
    pub fn observe(&self, observer: Observer) {
        let _ = self.observer.set(observer);
    }

    /// Every record, oldest first, from the backup and the live file (a
    /// line cut short by a crash, or one that does not parse, is left
    /// out). Blocking.
    pub fn records(&self) -> std::io::Result<Vec<AuditRecord>> {
        Ok(parse_lines(&runbox_journal::read_lines(
            self.journal.path(),
        )?))
    }

    /// Appends one record. Errors are logged, not returned: auditing must not
    /// take the proxy down.
    pub fn append(&self, record: &AuditRecord) {
        if let Some(observer) = self.observer.get() {
            observer(record);
        }
        let line = match serde_json::to_vec(record) {
            Ok(line) => line,
            Err(e) => {
                tracing::warn!(error = %e, "cannot serialise audit record");
                return;
            }
        };
        if let Err(e) = self.journal.append(&[line], false) {
            tracing::warn!(path = %self.journal.path().display(), error = %e, "cannot write audit record");
        }
    }
}

/// The current time in RFC 3339, for `t`.
pub fn now() -> String {
    time::OffsetDateTime::now_utc()
        .format(&Rfc3339)
        // Only a year outside 0..=9999 fails to format.
        .unwrap_or_else(|_| "1970-01-01T00:00:00Z".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::os::unix::fs::PermissionsExt;
    use std::path::Path;
    use std::sync::Arc;

    fn egress(i: usize) -> AuditRecord {
        AuditRecord::Egress {
            t: "2025-01-01T00:00:00Z".into(),
            run: format!("run-{i:06}"),
            method: "CONNECT".into(),
            host: "example.org".into(),
            port: 443,
            decision: "allow".into(),
            rule: "run:example.org".into(),
            secret: None,
            upstream: None,
        }
    }

    fn read_lines(path: &Path) -> Vec<AuditRecord> {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        assert!(text.is_empty() || text.ends_with('\n'), "last line is cut");
        text.lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
            .collect()
    }

    fn line_len(record: &AuditRecord) -> u64 {
        serde_json::to_vec(record).unwrap().len() as u64 + 1
    }

    #[test]
    fn lines_parse_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let log = AuditLog::open(path.clone(), 1 << 20).unwrap();
        let records = vec![
            egress(1),
            AuditRecord::Egress {
                t: now(),
                run: "r".into(),
                method: "GET".into(),
                host: "api.github.com".into(),
                port: 443,
                decision: "allow".into(),
                rule: "deployment:api.github.com".into(),
                secret: Some("GH_TOKEN".into()),
                upstream: Some("socks5://alice@proxy.corp:1080".into()),
            },
            AuditRecord::Api {
                t: now(),
                method: "POST".into(),
                path: "/v1/runs".into(),
                status: 201,
                run: Some("r".into()),
                caller: Some("tenant:acme".into()),
                tenant: Some("acme".into()),
                action: Some(Action::Create {
                    image: "base".into(),
                    network: "none".into(),
                }),
            },
            AuditRecord::Api {
                t: now(),
                method: "DELETE".into(),
                path: "/v1/runs/r".into(),
                status: 404,
                run: None,
                caller: None,
                tenant: None,
                action: None,
            },
        ];
        for r in &records {
            log.append(r);
        }
        assert_eq!(read_lines(&path), records);
    }

    #[test]
    fn commands_are_bounded() {
        let long = "x".repeat(MAX_TEXT + 10);
        let argv: Vec<String> = std::iter::once(long.clone())
            .chain((0..MAX_ARGS + 5).map(|i| i.to_string()))
            .collect();
        let Action::Command {
            argv: kept,
            user,
            cwd,
            mode,
        } = Action::command(&argv, Some(""), Some("/work"), "exec")
        else {
            panic!("not a command");
        };
        assert_eq!(kept.len(), MAX_ARGS + 1);
        assert_eq!(kept[0].chars().count(), MAX_TEXT + 1);
        assert!(kept[0].ends_with('…'));
        assert_eq!(kept[MAX_ARGS], "… 6 more");
        assert_eq!(
            (user, cwd.as_deref(), mode.as_str()),
            (None, Some("/work"), "exec")
        );
    }

    #[test]
    fn a_tenants_records_include_what_its_runs_did() {
        let api = |run: &str, caller: &str, tenant: Option<&str>, t: &str| AuditRecord::Api {
            t: t.into(),
            method: "POST".into(),
            path: format!("/v1/runs/{run}/exec"),
            status: 200,
            run: Some(run.into()),
            caller: Some(caller.into()),
            tenant: tenant.map(str::to_owned),
            action: None,
        };
        let egress = |run: &str, t: &str| AuditRecord::Egress {
            t: t.into(),
            run: run.into(),
            method: "CONNECT".into(),
            host: "example.org".into(),
            port: 443,
            decision: "allow".into(),
            rule: "run:example.org".into(),
            secret: None,
            upstream: None,
        };
        let records = [
            api("a1", "tenant:acme", Some("acme"), "2026-01-01T00:00:00Z"),
            api("b1", "tenant:beta", Some("beta"), "2026-01-01T00:00:01Z"),
            // Root acting on acme's run: acme's.
            api("a2", "root", Some("acme"), "2026-01-01T00:00:02Z"),
            egress("a1", "2026-01-01T00:00:03Z"),
            egress("b1", "2026-01-01T00:00:04Z"),
            egress("a2", "2026-01-02T00:00:00Z"),
        ];
        let lines: Vec<String> = records
            .iter()
            .map(|r| serde_json::to_string(r).unwrap())
            .chain(["not json".to_owned()])
            .collect();
        let parsed = parse_lines(&lines);
        assert_eq!(parsed.len(), records.len());
        let acme = AuditFilter {
            tenant: Some("acme".into()),
            ..Default::default()
        };
        let got: Vec<String> = acme
            .apply(parsed.clone())
            .iter()
            .map(|r| r.time().to_owned())
            .collect();
        assert_eq!(
            got,
            [
                "2026-01-01T00:00:00Z",
                "2026-01-01T00:00:02Z",
                "2026-01-01T00:00:03Z",
                "2026-01-02T00:00:00Z"
            ]
        );
        let since = AuditFilter {
            run: Some("a2".into()),
            since: Some(time::OffsetDateTime::parse("2026-01-01T12:00:00Z", &Rfc3339).unwrap()),
            ..Default::default()
        };
        assert_eq!(since.apply(parsed), vec![records[5].clone()]);
    }

    #[test]
    fn json_shape_is_stable() {
        let line = serde_json::to_string(&egress(7)).unwrap();
        assert_eq!(
            line,
            r#"{"kind":"egress","t":"2025-01-01T00:00:00Z","run":"run-000007","method":"CONNECT","host":"example.org","port":443,"decision":"allow","rule":"run:example.org"}"#
        );
        let api = AuditRecord::Api {
            t: "t".into(),
            method: "POST".into(),
            path: "/v1/runs".into(),
            status: 201,
            run: None,
            caller: None,
            tenant: None,
            action: None,
        };
        assert_eq!(
            serde_json::to_string(&api).unwrap(),
            r#"{"kind":"api","t":"t","method":"POST","path":"/v1/runs","status":201}"#
        );
    }

    #[test]
    fn appends_to_an_existing_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        AuditLog::open(path.clone(), 1 << 20)
            .unwrap()
            .append(&egress(1));
        AuditLog::open(path.clone(), 1 << 20)
            .unwrap()
            .append(&egress(2));
        assert_eq!(read_lines(&path), vec![egress(1), egress(2)]);
    }

    #[test]
    fn rotates_between_whole_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let per_line = line_len(&egress(0));
        // Room for exactly five lines: the sixth rotates, and so does the
        // eleventh, replacing the first backup.
        let log = AuditLog::open(path.clone(), per_line * 5).unwrap();
        for i in 0..8 {
            log.append(&egress(i));
        }
        let backup = dir.path().join("audit.jsonl.1");
        let mut names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, vec!["audit.jsonl", "audit.jsonl.1"]);
        let old = read_lines(&backup);
        let new = read_lines(&path);
        assert_eq!(old, (0..5).map(egress).collect::<Vec<_>>());
        assert_eq!(new, (5..8).map(egress).collect::<Vec<_>>());
        assert!(std::fs::metadata(&path).unwrap().len() <= per_line * 5);

        for i in 8..11 {
            log.append(&egress(i));
        }
        assert_eq!(read_lines(&backup), (5..10).map(egress).collect::<Vec<_>>());
        assert_eq!(read_lines(&path), vec![egress(10)]);
    }

    #[test]
    fn an_oversized_line_still_goes_into_an_empty_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let log = AuditLog::open(path.clone(), 10).unwrap();
        log.append(&egress(1));
        assert_eq!(read_lines(&path), vec![egress(1)]);
        log.append(&egress(2));
        assert_eq!(read_lines(&path), vec![egress(2)]);
        assert_eq!(
            read_lines(&dir.path().join("audit.jsonl.1")),
            vec![egress(1)]
        );
    }

    #[test]
    fn concurrent_appends_write_whole_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let per_line = line_len(&egress(0));
        let (threads, each) = (8, 200);
        // Large enough that nothing rotates, so every line can be counted.
        let log = Arc::new(AuditLog::open(path.clone(), per_line * 10_000).unwrap());
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let log = Arc::clone(&log);
                std::thread::spawn(move || {
                    for i in 0..each {
                        log.append(&egress(t * each + i));
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        let runs: HashSet<String> = read_lines(&path)
            .into_iter()
            .map(|r| match r {
                AuditRecord::Egress { run, .. } => run,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(runs.len(), threads * each);
    }

    #[test]
    fn concurrent_appends_across_rotations_keep_lines_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let per_line = line_len(&egress(0));
        let log = Arc::new(AuditLog::open(path.clone(), per_line * 7).unwrap());
        let handles: Vec<_> = (0..4)
            .map(|t| {
                let log = Arc::clone(&log);
                std::thread::spawn(move || {
                    for i in 0..50 {
                        log.append(&egress(t * 50 + i));
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        // read_lines parses every line and checks the last one is complete.
        let old = read_lines(&dir.path().join("audit.jsonl.1"));
        let new = read_lines(&path);
        assert_eq!(old.len(), 7);
        assert!(!new.is_empty() && new.len() <= 7);
    }

    #[test]
    fn files_are_owner_only() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let per_line = line_len(&egress(0));
        let log = AuditLog::open(path.clone(), per_line).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&path), 0o600);
        log.append(&egress(1));
        log.append(&egress(2));
        assert_eq!(mode(&path), 0o600);
        assert_eq!(mode(&dir.path().join("audit.jsonl.1")), 0o600);
    }

    #[test]
    fn now_is_rfc3339_utc() {
        let t = now();
        // YYYY-MM-DDTHH:MM:SS, an optional fraction, then Z for UTC.
        let b = t.as_bytes();
        assert!(t.len() >= 20 && t.ends_with('Z'), "{t}");
        for (i, c) in [(4, b'-'), (7, b'-'), (10, b'T'), (13, b':'), (16, b':')] {
            assert_eq!(b[i], c, "{t}");
        }
        let year: i32 = t[..4].parse().unwrap();
        assert!(year >= 2024, "{t}");
    }
}
