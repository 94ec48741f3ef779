//! The daemon's logs: the human format on a terminal, and one JSON object
//! per line otherwise, each with its syslog `priority` (journald's
//! numbers: 3 error, 4 warning, 6 info, 7 debug). Under systemd (stderr is
//! the journal's stream, `JOURNAL_STREAM`), each line also starts with
//! `<N>`, which journald takes as the entry's priority and strips, so
//! `journalctl -u runbox -p warning` lists the degradations and the stored
//! message is the JSON object alone.
//!
//! The level comes from `RUNBOX_LOG`, else `runbox serve --log-level` (or
//! the config file's `log_level`, which a reload applies at once), else
//! `RUST_LOG`, in `EnvFilter`'s syntax (`info`, `warn,runbox_core=debug`);
//! an environment value that does not parse is reported on stderr and the
//! default used, never silently ignored.
//!
//! The JSON lines are written here rather than by tracing-subscriber's
//! JSON formatter because that one has no place for the `priority` field
//! or the `<N>` prefix.

use std::fmt;
use std::io::IsTerminal;
use std::sync::OnceLock;

use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::EnvFilter;

/// The environment variable that sets the level.
pub const LEVEL_VAR: &str = "RUNBOX_LOG";

/// Syslog priority of a tracing level.
pub fn priority(level: &Level) -> u8 {
    match *level {
        Level::ERROR => 3,
        Level::WARN => 4,
        Level::INFO => 6,
        Level::DEBUG | Level::TRACE => 7,
    }
}

/// Whether stderr is the journal's stream: `JOURNAL_STREAM` is
/// `<device>:<inode>` of the stream systemd connected, and stderr is it.
fn stderr_is_journal() -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(stream) = std::env::var("JOURNAL_STREAM") else {
        return false;
    };
    let Some((dev, ino)) = stream.split_once(':') else {
        return false;
    };
    let (Ok(dev), Ok(ino)) = (dev.parse::<u64>(), ino.parse::<u64>()) else {
        return false;
    };
    // /proc/self/fd/2 names stderr's open file, whatever it is.
    std::fs::metadata("/proc/self/fd/2").is_ok_and(|m| m.dev() == dev && m.ino() == ino)
}

/// The filter from `RUNBOX_LOG` (else `RUST_LOG`, else `default`); a
/// value that does not parse is reported and `default` used.
pub fn filter(default: &str) -> EnvFilter {
    for var in [LEVEL_VAR, "RUST_LOG"] {
        let Ok(value) = std::env::var(var) else {
            continue;
        };
        return match EnvFilter::try_new(&value) {
            Ok(filter) => filter,
            Err(e) => {
                // Before the logger is up: a plain line on stderr.
                eprintln!("runbox: {var}={value:?} is not a log level ({e}); using {default:?}");
                EnvFilter::new(default)
            }
        };
    }
    EnvFilter::new(default)
}

/// Swaps the installed logger's filter; set once by [`init`].
type SetFilter = Box<dyn Fn(EnvFilter) -> Result<(), String> + Send + Sync>;
static SET_FILTER: OnceLock<SetFilter> = OnceLock::new();

/// Installs the logger: human lines on a terminal, JSON lines otherwise
/// (with the `<N>` prefix under journald). Its filter can be changed
/// later with [`set_level`].
pub fn init(default: &str) {
    let filter = filter(default);
    let builder = tracing_subscriber::fmt().with_writer(std::io::stderr);
    if std::io::stderr().is_terminal() {
        let builder = builder.with_env_filter(filter).with_filter_reloading();
        let handle = builder.reload_handle();
        if builder.try_init().is_ok() {
            let _ = SET_FILTER.set(Box::new(move |f| {
                handle.reload(f).map_err(|e| e.to_string())
            }));
        }
    } else {
        let builder = builder
            .event_format(JsonLines {
                journal: stderr_is_journal(),
            })
            .with_env_filter(filter)
            .with_filter_reloading();
        let handle = builder.reload_handle();
        if builder.try_init().is_ok() {
            let _ = SET_FILTER.set(Box::new(move |f| {
                handle.reload(f).map_err(|e| e.to_string())
            }));
        }
    }
}

/// Checks a `--log-level` value (clap's value parser).
pub fn parse_level(value: &str) -> Result<String, String> {
    EnvFilter::try_new(value)
        .map(|_| value.to_owned())
        .map_err(|e| {
            format!("not a log level ({e}); for example info, debug or warn,runbox_core=debug")
        })
}

/// Puts `level` (`--log-level`, checked by [`parse_level`]) in force, or,
/// when None, what the environment or `default` says. `RUNBOX_LOG` wins
/// over both: an operator chasing a problem keeps the level they set.
pub fn set_level(level: Option<&str>, default: &str) {
    if std::env::var_os(LEVEL_VAR).is_some() {
        return;
    }
    let filter = match level.map(EnvFilter::try_new) {
        Some(Ok(filter)) => filter,
        _ => filter(default),
    };
    if let Some(set) = SET_FILTER.get() {
        if let Err(e) = set(filter) {
            tracing::warn!(error = %e, "could not change the log level");
        }
    }
}

/// One JSON object per event: `t`, `level`, `priority`, `target`,
/// `message`, the event's fields, and the names of the spans it is in.
pub struct JsonLines {
    /// Prefix each line with `<priority>` for journald.
    pub journal: bool,
}

impl<S, N> FormatEvent<S, N> for JsonLines
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let line = json_line(
            event,
            ctx.event_scope().map(|scope| {
                scope
                    .from_root()
                    .map(|span| span.name().to_owned())
                    .collect::<Vec<_>>()
            }),
        );
        if self.journal {
            write!(writer, "<{}>", priority(event.metadata().level()))?;
        }
        writeln!(writer, "{line}")
    }
}

/// The JSON object of one event.
fn json_line(event: &Event<'_>, spans: Option<Vec<String>>) -> String {
    let meta = event.metadata();
    let mut object = Map::new();
    object.insert(
        "t".into(),
        Value::String(
            time::OffsetDateTime::now_utc()
                .format(&time::format_description::well_known::Rfc3339)
                .unwrap_or_default(),
        ),
    );
    object.insert("level".into(), Value::String(meta.level().to_string()));
    object.insert("priority".into(), Value::from(priority(meta.level())));
    object.insert("target".into(), Value::String(meta.target().to_owned()));
    let mut fields = Fields(Map::new());
    event.record(&mut fields);
    let mut fields = fields.0;
    if let Some(message) = fields.remove("message") {
        object.insert("message".into(), message);
    }
    for (key, value) in fields {
        // The fixed keys win; a field that shadows one gets a prefix.
        let key = if object.contains_key(&key) {
            format!("field.{key}")
        } else {
            key
        };
        object.insert(key, value);
    }
    if let Some(spans) = spans.filter(|s| !s.is_empty()) {
        object.insert("spans".into(), Value::from(spans));
    }
    Value::Object(object).to_string()
}

/// Collects an event's fields as JSON values.
struct Fields(Map<String, Value>);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0
            .insert(field.name().to_owned(), Value::String(format!("{value:?}")));
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.0
            .insert(field.name().to_owned(), Value::String(value.to_owned()));
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().to_owned(), Value::from(value));
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().to_owned(), Value::from(value));
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name().to_owned(), Value::from(value));
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().to_owned(), Value::from(value));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// A writer into a shared buffer.
    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Buffer {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn logged(journal: bool, emit: impl FnOnce()) -> String {
        let buffer = Buffer::default();
        let sink = buffer.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter(EnvFilter::new("debug"))
            .with_writer(move || sink.clone())
            .event_format(JsonLines { journal })
            .finish();
        tracing::subscriber::with_default(subscriber, emit);
        let bytes = buffer.0.lock().unwrap().clone();
        String::from_utf8(bytes).unwrap()
    }

    #[test]
    fn lines_are_json_with_their_priority() {
        let out = logged(false, || {
            tracing::warn!(
                run = "01J",
                bytes = 3u64,
                ok = true,
                "storage is \"nearly\" full"
            );
            let span = tracing::info_span!("create");
            let _in = span.enter();
            tracing::error!(message = "no", level = 9, "x");
            tracing::info!("plain");
        });
        let lines: Vec<Value> = out
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
            .collect();
        assert_eq!(lines.len(), 3, "{out}");
        assert_eq!(lines[0]["priority"], 4);
        assert_eq!(lines[0]["level"], "WARN");
        assert_eq!(lines[0]["message"], "storage is \"nearly\" full");
        assert_eq!(lines[0]["run"], "01J");
        assert_eq!(lines[0]["bytes"], 3);
        assert_eq!(lines[0]["ok"], true);
        assert_eq!(lines[1]["priority"], 3);
        assert_eq!(lines[1]["spans"], serde_json::json!(["create"]));
        assert_eq!(
            lines[1]["field.level"], 9,
            "a field cannot replace the level"
        );
        assert_eq!(lines[2]["priority"], 6);
        assert!(lines[2]["t"].as_str().unwrap().ends_with('Z'));
    }

    #[test]
    fn under_journald_lines_carry_the_priority_prefix() {
        let out = logged(true, || {
            tracing::warn!("degraded");
            tracing::debug!("detail");
        });
        let lines: Vec<&str> = out.lines().collect();
        assert!(lines[0].starts_with("<4>{"), "{out}");
        assert!(lines[1].starts_with("<7>{"), "{out}");
        let json: Value = serde_json::from_str(&lines[0][3..]).unwrap();
        assert_eq!(json["message"], "degraded");
    }

    #[test]
    fn a_bad_level_falls_back_and_is_not_ignored() {
        // EnvFilter refuses what cannot be a directive.
        assert!(EnvFilter::try_new("info,=[").is_err());
        assert!(EnvFilter::try_new("warn,runbox_core=debug").is_ok());
    }
}
