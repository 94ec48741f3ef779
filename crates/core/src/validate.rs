//! Input rules the API enforces before anything touches a sandbox. Pure
//! functions, tested without I/O.

use std::collections::BTreeMap;
use std::time::Duration;

use runbox_types::{Env, ErrorCode, Limits, LimitsRequest};

use crate::error::CoreError;

/// Most variables one `env` map may hold.
pub const MAX_ENV_VARS: usize = 64;
/// Most bytes (names + values) one `env` map may hold.
pub const MAX_ENV_BYTES: usize = 64 * 1024;
/// Longest file path below `/work`, in bytes.
pub const MAX_PATH_BYTES: usize = 4096;
/// Longest single path component, in bytes.
pub const MAX_COMPONENT_BYTES: usize = 255;
/// Most arguments an exec command may have.
pub const MAX_ARGS: usize = 4096;
/// Most bytes all arguments together may hold.
pub const MAX_ARGS_BYTES: usize = 1 << 20;

/// Most bytes in one argument: the kernel refuses a longer one with `E2BIG`
/// (`MAX_ARG_STRLEN`, 32 pages, counts the terminating NUL).
pub const MAX_ARG_BYTES: usize = 128 * 1024 - 1;

/// Checks an `env` map: POSIX names (`[A-Za-z_][A-Za-z0-9_]*`), no NUL or line
/// breaks in values, at most [`MAX_ENV_VARS`] variables and [`MAX_ENV_BYTES`]
/// in total. The error names the offending variable but never its value.
pub fn env(env: &Env) -> Result<(), CoreError> {
    if env.0.len() > MAX_ENV_VARS {
        return Err(bad_env(format!(
            "env has {} variables; the most allowed is {MAX_ENV_VARS}",
            env.0.len()
        )));
    }
    let mut total = 0usize;
    for (name, value) in &env.0 {
        if !is_posix_name(name) {
            return Err(bad_env(format!(
                "env variable name {:?} is not a POSIX name (letters, digits and _, not starting with a digit)",
                truncate(name, 64)
            )));
        }
        if let Some(bad) = value.chars().find(|c| matches!(c, '\0' | '\n' | '\r')) {
            let what = match bad {
                '\0' => "a NUL byte",
                _ => "a line break",
            };
            return Err(bad_env(format!(
                "env variable {name} has {what} in its value"
            )));
        }
        total += name.len() + value.len();
    }
    if total > MAX_ENV_BYTES {
        return Err(bad_env(format!(
            "env holds {total} bytes; the most allowed is {MAX_ENV_BYTES}"
        )));
    }
    Ok(())
}

fn bad_env(message: String) -> CoreError {
    CoreError::invalid(ErrorCode::BadEnv, message)
}

fn is_posix_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c == '_' || c.is_ascii_alphabetic())
        && chars.all(|c| c == '_' || c.is_ascii_alphanumeric())
}

pub(crate) fn truncate(s: &str, max: usize) -> &str {
    match s.char_indices().nth(max) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

/// Checks a file path relative to `/work` and returns it normalised (no `.`
/// components, no repeated slashes). Refuses empty, absolute, `..`, NUL and
/// over-long paths. Symlinks are checked later, inside the run, by the agent.
pub fn work_path(path: &str) -> Result<String, CoreError> {
    let bad = |why: &str| CoreError::invalid(ErrorCode::BadPath, format!("file path {why}"));
    if path.contains('\0') {
        return Err(bad("contains a NUL byte"));
    }
    if path.starts_with('/') {
        return Err(bad("must be relative to /work, not absolute"));
    }
    let parts = components(path, bad)?;
    if parts.is_empty() {
        return Err(bad("is empty; name a file below /work"));
    }
    Ok(parts.join("/"))
}

/// Checks an absolute path in a run's root filesystem and returns it
/// normalised ("/a/b"); `base_ok` admits `/` itself (stat, list, watch).
/// Refuses relative, `..`, NUL and over-long paths; symlinks resolve inside
/// the run, in the agent.
pub fn root_path(path: &str, base_ok: bool) -> Result<String, CoreError> {
    let bad = |why: &str| CoreError::invalid(ErrorCode::BadPath, format!("file path {why}"));
    if path.contains('\0') {
        return Err(bad("contains a NUL byte"));
    }
    let Some(rest) = path.strip_prefix('/') else {
        return Err(bad("must be absolute (start with /)"));
    };
    let parts = components(rest, bad)?;
    if parts.is_empty() && !base_ok {
        return Err(bad("names / itself; name a file below it"));
    }
    Ok(format!("/{}", parts.join("/")))
}

/// The plain components of `path` (no empty, `.` or `..` ones), refusing
/// `..` and over-long paths or components; `bad` words the error.
fn components(path: &str, bad: impl Fn(&str) -> CoreError) -> Result<Vec<&str>, CoreError> {
    if path.len() > MAX_PATH_BYTES {
        return Err(bad(&format!("is longer than {MAX_PATH_BYTES} bytes")));
    }
    let mut parts = Vec::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => return Err(bad("must not contain `..`")),
            p if p.len() > MAX_COMPONENT_BYTES => {
                return Err(bad(&format!(
                    "has a component longer than {MAX_COMPONENT_BYTES} bytes"
                )))
            }
            p => parts.push(p),
        }
    }
    Ok(parts)
}

/// Checks an exec command line.
pub fn command(cmd: &[String]) -> Result<(), CoreError> {
    let bad = |m: String| CoreError::invalid(ErrorCode::BadCommand, m);
    match cmd.first() {
        None => {
            return Err(bad(
                "cmd is empty; give the program and its arguments".into()
            ))
        }
        Some(first) if first.is_empty() => return Err(bad("cmd[0] is empty".into())),
        _ => {}
    }
    if cmd.len() > MAX_ARGS {
        return Err(bad(format!(
            "cmd has {} arguments; the most is {MAX_ARGS}",
            cmd.len()
        )));
    }
    if let Some(i) = cmd.iter().position(|a| a.contains('\0')) {
        return Err(bad(format!("cmd[{i}] contains a NUL byte")));
    }
    if let Some(i) = cmd.iter().position(|a| a.len() > MAX_ARG_BYTES) {
        return Err(bad(format!(
            "cmd[{i}] holds {} bytes; the kernel takes at most {MAX_ARG_BYTES} in one argument, so pass bulk data as a file (PUT /v1/runs/{{id}}/files/...)",
            cmd[i].len()
        )));
    }
    let total: usize = cmd.iter().map(String::len).sum();
    if total > MAX_ARGS_BYTES {
        return Err(bad(format!(
            "cmd holds {total} bytes; the most is {MAX_ARGS_BYTES}"
        )));
    }
    Ok(())
}

/// Checks an exec working directory (absolute, or relative to `/work`).
pub fn cwd(cwd: &str) -> Result<(), CoreError> {
    let bad = |m: &str| CoreError::invalid(ErrorCode::BadCwd, format!("cwd {m}"));
    if cwd.contains('\0') {
        return Err(bad("contains a NUL byte"));
    }
    if cwd.len() > MAX_PATH_BYTES {
        return Err(bad(&format!("is longer than {MAX_PATH_BYTES} bytes")));
    }
    Ok(())
}

/// The longest `Idempotency-Key`.
pub const MAX_IDEMPOTENCY_KEY: usize = 128;

/// Checks an `Idempotency-Key`: 1-128 visible ASCII characters.
pub fn idempotency_key(key: String) -> Result<String, CoreError> {
    if key.is_empty()
        || key.len() > MAX_IDEMPOTENCY_KEY
        || !key.bytes().all(|b| b.is_ascii_graphic())
    {
        return Err(CoreError::invalid(
            ErrorCode::BadRequest,
            format!(
                "Idempotency-Key must be 1-{MAX_IDEMPOTENCY_KEY} visible ASCII characters \
                 (a UUID or ULID will do)"
            ),
        ));
    }
    Ok(key)
}

/// The smallest disk limit: below it a run cannot even write its first
/// files (the filesystem reserves metadata space per write).
pub const MIN_DISK_MB: u64 = 16;

/// Resolves requested limits against the defaults and checks them against
/// the maxima.
pub fn limits(
    req: Option<&LimitsRequest>,
    default: &Limits,
    max: &Limits,
) -> Result<Limits, CoreError> {
    let req = req.copied().unwrap_or_default();
    let limits = Limits {
        cpus: req.cpus.unwrap_or(default.cpus),
        memory_mb: req.memory_mb.unwrap_or(default.memory_mb),
        pids: req.pids.unwrap_or(default.pids),
        disk_mb: req.disk_mb.or(default.disk_mb),
    };
    let bad = |m: String| CoreError::invalid(ErrorCode::BadLimits, m);
    if !limits.cpus.is_finite() || limits.cpus < 0.01 {
        return Err(bad(format!(
            "limits.cpus must be at least 0.01, got {}",
            limits.cpus
        )));
    }
    if limits.cpus > max.cpus {
        return Err(bad(format!(
            "limits.cpus {} is above this server's maximum of {}",
            limits.cpus, max.cpus
        )));
    }
    // Below a few MiB not even the agent and a shell fit; refuse instead of
    // creating a run that cannot start.
    if limits.memory_mb < 16 {
        return Err(bad(format!(
            "limits.memoryMb must be at least 16, got {}",
            limits.memory_mb
        )));
    }
    if limits.memory_mb > max.memory_mb {
        return Err(bad(format!(
            "limits.memoryMb {} is above this server's maximum of {}",
            limits.memory_mb, max.memory_mb
        )));
    }
    if limits.pids < 8 {
        return Err(bad(format!(
            "limits.pids must be at least 8, got {}",
            limits.pids
        )));
    }
    if limits.pids > max.pids {
        return Err(bad(format!(
            "limits.pids {} is above this server's maximum of {}",
            limits.pids, max.pids
        )));
    }
    // No maximum means the operator turned disk limits off: a run that
    // asks for one must not get a limit that nothing enforces.
    match (limits.disk_mb, max.disk_mb) {
        (Some(_), None) => {
            return Err(bad(
                "limits.diskMb cannot be enforced: this server runs without disk limits \
                 (started with --no-disk-limits); leave it out"
                    .into(),
            ))
        }
        (Some(disk), _) if disk < MIN_DISK_MB => {
            return Err(bad(format!(
                "limits.diskMb must be at least {MIN_DISK_MB}, got {disk}"
            )))
        }
        (Some(disk), Some(max)) if disk > max => {
            return Err(bad(format!(
                "limits.diskMb {disk} is above this server's maximum of {max}"
            )))
        }
        _ => {}
    }
    Ok(limits)
}

/// Resolves a requested TTL: absent means `default`, zero is refused, above
/// `max` is capped to `max`.
pub fn ttl(req: Option<u64>, default: Duration, max: Duration) -> Result<Duration, CoreError> {
    match req {
        None => Ok(default),
        Some(0) => Err(CoreError::invalid(
            ErrorCode::BadTtl,
            "ttlSec must be at least 1",
        )),
        Some(secs) => Ok(Duration::from_secs(secs).min(max)),
    }
}

/// The longest idle interval a run may ask for: a year.
pub const MAX_IDLE_SEC: u64 = 365 * 24 * 3600;

/// A create's history settings: the request's, else the server's
/// `default` keep; a keep of 0 is none, above `max` refused.
pub fn history(
    req: Option<runbox_types::HistorySettings>,
    default: u32,
    max: u32,
) -> Result<Option<runbox_types::HistorySettings>, CoreError> {
    match req {
        Some(h) if h.keep > max => Err(CoreError::invalid(
            ErrorCode::BadHistory,
            format!(
                "history.keep must be at most {max} (--max-history), not {}; 0 turns history off",
                h.keep
            ),
        )),
        Some(h) => Ok((h.keep > 0).then_some(h)),
        None => Ok((default > 0).then_some(runbox_types::HistorySettings {
            keep: default.min(max),
        })),
    }
}

/// A create's idle policy with the server's `default` filled in where it
/// names nothing; zero (off) is kept as nothing.
pub fn idle(
    req: Option<runbox_types::IdlePolicy>,
    default: runbox_types::IdlePolicy,
) -> Result<runbox_types::IdlePolicy, CoreError> {
    let req = req.unwrap_or_default();
    let pick = |asked: Option<u64>, default: Option<u64>, name: &str| match asked {
        Some(secs) if secs > MAX_IDLE_SEC => Err(CoreError::invalid(
            ErrorCode::BadRequest,
            format!(
                "idle.{name} must be at most {MAX_IDLE_SEC} (a year), not {secs}; 0 turns it off"
            ),
        )),
        Some(0) => Ok(None),
        Some(secs) => Ok(Some(secs)),
        None => Ok(default.filter(|&secs| secs > 0)),
    };
    Ok(runbox_types::IdlePolicy {
        pause_after_sec: pick(
            req.pause_after_sec,
            default.pause_after_sec,
            "pauseAfterSec",
        )?,
        hibernate_after_sec: pick(
            req.hibernate_after_sec,
            default.hibernate_after_sec,
            "hibernateAfterSec",
        )?,
    })
}

/// Longest lease owner name, in characters (as JSON Schema's `maxLength`
/// counts them).
pub const MAX_OWNER_CHARS: usize = 128;

/// Lease lifetime when a request gives none.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(300);

/// Longest lease lifetime one grant or renewal may ask for.
pub const MAX_LEASE_TTL: Duration = Duration::from_secs(24 * 3600);

/// Checks a lease owner: 1-128 characters, no control characters, not only
/// whitespace.
pub fn owner(owner: &str) -> Result<(), CoreError> {
    if owner.trim().is_empty() {
        return Err(CoreError::invalid(
            ErrorCode::BadOwner,
            "owner must not be empty; name who takes the lease, e.g. \"alice@laptop\"",
        ));
    }
    if owner.chars().count() > MAX_OWNER_CHARS {
        return Err(CoreError::invalid(
            ErrorCode::BadOwner,
            format!("owner must be at most {MAX_OWNER_CHARS} characters"),
        ));
    }
    if owner.chars().any(char::is_control) {
        return Err(CoreError::invalid(
            ErrorCode::BadOwner,
            "owner must not contain control characters",
        ));
    }
    Ok(())
}

/// Checks a lease lifetime: 1 second to 24 hours; absent means 5 minutes.
/// Unlike a run's TTL it is never capped silently: a holder must know how
/// long it holds the run.
pub fn lease_ttl(req: Option<u64>) -> Result<Duration, CoreError> {
    match req {
        None => Ok(DEFAULT_LEASE_TTL),
        Some(secs) if secs == 0 || secs > MAX_LEASE_TTL.as_secs() => Err(CoreError::invalid(
            ErrorCode::BadTtl,
            format!(
                "a lease's ttlSec must be between 1 and {}",
                MAX_LEASE_TTL.as_secs()
            ),
        )),
        Some(secs) => Ok(Duration::from_secs(secs)),
    }
}

/// Checks the lease credential of an exec or file write: `owner` and
/// `generation` come together or not at all.
pub fn credential(
    owner: Option<&str>,
    generation: Option<u64>,
) -> Result<Option<(String, u64)>, CoreError> {
    match (owner, generation) {
        (None, None) => Ok(None),
        (Some(o), Some(g)) => {
            self::owner(o)?;
            Ok(Some((o.to_owned(), g)))
        }
        (Some(_), None) => Err(CoreError::invalid(
            ErrorCode::BadGeneration,
            "owner was given without generation; give both (the generation the lease grant returned) or neither",
        )),
        (None, Some(_)) => Err(CoreError::invalid(
            ErrorCode::BadOwner,
            "generation was given without owner; give both or neither",
        )),
    }
}

/// Parses a generation from a query string value.
pub fn generation(text: &str) -> Result<u64, CoreError> {
    // `u64::from_str` accepts a leading '+'; a fencing token is digits only.
    if text.is_empty() || text.len() > 20 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(CoreError::invalid(
            ErrorCode::BadGeneration,
            format!(
                "generation must be a non-negative integer, got {:?}",
                bounded_text(text)
            ),
        ));
    }
    text.parse().map_err(|_| {
        CoreError::invalid(
            ErrorCode::BadGeneration,
            "generation is larger than any generation runbox issues",
        )
    })
}

fn bounded_text(text: &str) -> String {
    text.chars().take(40).collect()
}

/// What the names of the builder's cached steps start with; no caller may
/// name an image so.
pub const BUILD_CACHE_PREFIX: &str = "build-cache-";

/// [`image_name`] for a name a caller gives a new image (an import, a
/// pull, a snapshot, a build): the builder's own prefix is refused too.
pub fn new_image_name(name: &str) -> Result<(), CoreError> {
    image_name(name)?;
    if name.starts_with(BUILD_CACHE_PREFIX) {
        return Err(CoreError::invalid(
            ErrorCode::BadImageName,
            format!("image names starting {BUILD_CACHE_PREFIX:?} are the image builder's; pick another name"),
        ));
    }
    Ok(())
}

/// Checks an image name: 1-64 characters of `[a-z0-9._-]`, starting with a
/// letter or digit (so it is always a safe directory name).
pub fn image_name(name: &str) -> Result<(), CoreError> {
    if name == "pull" {
        return Err(CoreError::invalid(
            ErrorCode::BadImageName,
            "\"pull\" is reserved (POST /v1/images/pull); pick another image name",
        ));
    }
    let ok = !name.is_empty()
        && name.len() <= 64
        && name.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '.' | '_' | '-'));
    if ok {
        Ok(())
    } else {
        Err(CoreError::invalid(
            ErrorCode::BadImageName,
            format!(
                "image name {:?} is invalid: use 1-64 characters of a-z, 0-9, '.', '_' and '-', starting with a letter or digit",
                truncate(name, 80)
            ),
        ))
    }
}

/// Checks an exec's `user` (the agent resolves it in the run): 1-256
/// characters, no control characters.
pub fn user(user: String) -> Result<String, CoreError> {
    if user.is_empty() || user.len() > 256 || user.chars().any(char::is_control) {
        return Err(CoreError::invalid(
            ErrorCode::BadUser,
            format!(
                "user {:?} is invalid: give a name, a uid, name:group or uid:gid",
                truncate(&user, 80)
            ),
        ));
    }
    Ok(user)
}

/// The most labels a run may have.
const MAX_LABELS: usize = 64;

/// Checks a run's labels: at most [`MAX_LABELS`]; keys 1-63 characters of
/// ASCII letters, digits, `.`, `_`, `-` and `/`; values at most 256
/// characters without control characters.
pub fn labels(labels: &BTreeMap<String, String>) -> Result<(), CoreError> {
    let bad = |message: String| CoreError::invalid(ErrorCode::BadLabels, message);
    if labels.len() > MAX_LABELS {
        return Err(bad(format!(
            "{} labels; a run may have at most {MAX_LABELS}",
            labels.len()
        )));
    }
    for (key, value) in labels {
        let key_ok = !key.is_empty()
            && key.len() <= 63
            && key
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '/'));
        if !key_ok {
            return Err(bad(format!(
                "label key {:?} is invalid: use 1-63 characters of letters, digits, '.', '_', '-' and '/'",
                truncate(key, 80)
            )));
        }
        if value.chars().count() > 256 || value.chars().any(char::is_control) {
            return Err(bad(format!(
                "the value of label {key:?} is invalid: at most 256 characters, none of them control characters"
            )));
        }
    }
    Ok(())
}

/// The limits of a create: a size tier's (its disk limit only where the
/// server has disk limits), or the requested ones over the defaults; never
/// both.
pub fn create_limits(
    size: Option<runbox_types::SizeTier>,
    requested: Option<&LimitsRequest>,
    defaults: &Limits,
    max: &Limits,
) -> Result<Limits, CoreError> {
    let Some(size) = size else {
        return limits(requested, defaults, max);
    };
    if requested.is_some() {
        return Err(CoreError::invalid(
            ErrorCode::BadLimits,
            "give either size or limits, not both",
        ));
    }
    let tier = size.limits();
    let disk_mb = defaults.disk_mb.and(tier.disk_mb);
    let fits = tier.cpus <= max.cpus
        && tier.memory_mb <= max.memory_mb
        && tier.pids <= max.pids
        && disk_mb.zip(max.disk_mb).is_none_or(|(d, m)| d <= m);
    if !fits {
        return Err(CoreError::invalid(
            ErrorCode::BadLimits,
            format!(
                "size {size} ({} CPUs, {} MiB, {} processes) is above this server's maxima; pick a smaller size",
                tier.cpus, tier.memory_mb, tier.pids
            ),
        ));
    }
    Ok(Limits { disk_mb, ..tier })
}

/// Checks a repository name for the warm cache, `owner/name`, and returns
/// it canonical (lower case: forges treat names without regard to case).
/// Each part is 1-100 characters of letters, digits, `-`, `_` and `.`,
/// starting with a letter or digit: never `.` or `..`, never a path.
pub fn repo(repo: &str) -> Result<String, CoreError> {
    let bad = || {
        CoreError::invalid(
            ErrorCode::BadRepo,
            format!(
                "repository {:?} is invalid: use owner/name, each 1-100 characters of letters, digits, '-', '_' and '.', starting with a letter or digit",
                truncate(repo, 80)
            ),
        )
    };
    let part_ok = |p: &str| {
        !p.is_empty()
            && p.len() <= 100
            && p.starts_with(|c: char| c.is_ascii_alphanumeric())
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    match repo.split_once('/') {
        Some((owner, name)) if part_ok(owner) && part_ok(name) => Ok(repo.to_ascii_lowercase()),
        _ => Err(bad()),
    }
}

/// Where in a run a warm volume may be mounted, checked and normalised:
/// an absolute path of at most 16 components, not `/`, and not in the
/// filesystems runbox provides (`/proc`, `/sys`, `/dev`, `/run`, and
/// `/.runbox`, where the agent lives).
pub fn warm_path(path: &str) -> Result<String, CoreError> {
    let bad = |why: &str| {
        CoreError::invalid(
            ErrorCode::BadPath,
            format!("warm path {:?} {why}", truncate(path, 80)),
        )
    };
    if path.contains('\0') {
        return Err(bad("contains a NUL byte"));
    }
    if !path.starts_with('/') {
        return Err(bad("must be absolute, like /work"));
    }
    if path.chars().any(char::is_control) {
        return Err(bad("has control characters"));
    }
    let parts = components(path, bad)?;
    match parts.first() {
        None => Err(bad("is the root; name a directory such as /work")),
        Some(&("proc" | "sys" | "dev" | "run" | ".runbox")) => Err(bad(
            "is inside a filesystem runbox provides (/proc, /sys, /dev, /run, /.runbox)",
        )),
        Some(_) if parts.len() > 16 => Err(bad("has more than 16 components")),
        Some(_) => Ok(format!("/{}", parts.join("/"))),
    }
}

/// Merges environments in order of precedence: later maps override earlier.
pub fn merge_env<'a>(layers: impl IntoIterator<Item = &'a Env>) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for layer in layers {
        out.extend(layer.0.iter().map(|(k, v)| (k.clone(), v.clone())));
    }
    out
}

/// The longest process tag.
pub const MAX_TAG: usize = 64;

/// Checks a process tag: 1-64 of letters, digits, `.`, `_`, `-`, and not
/// all digits (a reference that is all digits is a pid).
pub fn tag(tag: &str) -> Result<(), CoreError> {
    let bad = |why: &str| {
        CoreError::invalid(
            ErrorCode::BadProcess,
            format!("tag {:?} {why}", truncate(tag, 80)),
        )
    };
    if tag.is_empty() || tag.len() > MAX_TAG {
        return Err(bad("must be 1 to 64 characters"));
    }
    if !tag
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        return Err(bad("may contain only letters, digits, '.', '_' and '-'"));
    }
    if tag.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad("must not be all digits (it would read as a pid)"));
    }
    Ok(())
}

/// A reference to a process: its pid (all digits) or its tag.
pub fn process_ref(reference: &str) -> Result<runbox_agent_proto::pb::ProcessRef, CoreError> {
    if !reference.is_empty() && reference.bytes().all(|b| b.is_ascii_digit()) {
        return match reference.parse::<u32>() {
            Ok(pid) if pid > 0 => Ok(runbox_agent_proto::pb::ProcessRef {
                pid,
                tag: String::new(),
            }),
            _ => Err(CoreError::invalid(
                ErrorCode::BadProcess,
                format!("{:?} is not a pid", truncate(reference, 80)),
            )),
        };
    }
    tag(reference)?;
    Ok(runbox_agent_proto::pb::ProcessRef {
        pid: 0,
        tag: reference.to_owned(),
    })
}

/// The largest terminal side.
pub const MAX_PTY_SIDE: u32 = 10_000;

/// `TERM` for a terminal that names none.
pub const DEFAULT_TERM: &str = "xterm-256color";

/// Checks a terminal request: its size, and its type as `TERM`.
pub fn pty(
    spec: runbox_types::PtySpec,
) -> Result<(runbox_agent_proto::pb::PtySize, String), CoreError> {
    for (name, value) in [("rows", spec.rows), ("cols", spec.cols)] {
        if !(1..=MAX_PTY_SIDE).contains(&value) {
            return Err(CoreError::invalid(
                ErrorCode::BadProcess,
                format!("pty.{name} must be 1-{MAX_PTY_SIDE}, not {value}"),
            ));
        }
    }
    let term = spec.term.unwrap_or_else(|| DEFAULT_TERM.to_owned());
    if term.is_empty()
        || term.len() > 64
        || !term
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'+'))
    {
        return Err(CoreError::invalid(
            ErrorCode::BadProcess,
            format!(
                "pty.term {:?} is not a terminal type (like xterm-256color)",
                truncate(&term, 80)
            ),
        ));
    }
    Ok((
        runbox_agent_proto::pb::PtySize {
            rows: spec.rows,
            cols: spec.cols,
        },
        term,
    ))
}

#[cfg(test)]
mod tests {
    #[test]
    fn repositories_are_owner_and_name() {
        assert_eq!(repo("Acme/Web-App.v2").unwrap(), "acme/web-app.v2");
        assert_eq!(repo("a/b").unwrap(), "a/b");
        for bad in [
            "",
            "acme",
            "acme/",
            "/web",
            "acme/web/x",
            "../etc",
            "acme/..",
            "acme/.git",
            "acme/-x",
            "ac me/web",
            "acme/wéb",
            "acme\\web",
            "acme/web\n",
        ] {
            let e = repo(bad).unwrap_err();
            assert_eq!(e.code(), ErrorCode::BadRepo, "{bad:?}");
        }
        assert!(repo(&format!("a/{}", "x".repeat(101))).is_err());
    }

    #[test]
    fn warm_paths_are_absolute_and_outside_runbox_mounts() {
        assert_eq!(warm_path("/work").unwrap(), "/work");
        assert_eq!(warm_path("//src/./app/").unwrap(), "/src/app");
        for bad in [
            "",
            "work",
            "/",
            "/./",
            "/work/../etc",
            "/proc/x",
            "/dev",
            "/run/x",
            "/sys",
            "/.runbox/agent",
            "/a\0b",
            "/a/b\tc",
        ] {
            let e = warm_path(bad).unwrap_err();
            assert_eq!(e.code(), ErrorCode::BadPath, "{bad:?}");
        }
        assert!(warm_path(&"/a".repeat(17)).is_err());
    }

    #[test]
    fn lease_owners_are_checked() {
        assert!(owner("alice@laptop").is_ok());
        assert!(owner(&"é".repeat(128)).is_ok()); // 128 characters, 256 bytes
        for bad in ["", "  ", "a\u{7}b", "tab\there", "line\nbreak"] {
            let err = owner(bad).unwrap_err();
            assert_eq!(err.code(), ErrorCode::BadOwner, "{bad:?}");
        }
        for long in ["x".repeat(129), "é".repeat(129)] {
            assert_eq!(owner(&long).unwrap_err().code(), ErrorCode::BadOwner);
        }
    }

    #[test]
    fn lease_ttls_are_bounded_not_capped() {
        assert_eq!(lease_ttl(None).unwrap(), DEFAULT_LEASE_TTL);
        assert_eq!(lease_ttl(Some(1)).unwrap(), Duration::from_secs(1));
        assert_eq!(lease_ttl(Some(86_400)).unwrap(), MAX_LEASE_TTL);
        for bad in [0, 86_401, u64::MAX] {
            assert_eq!(lease_ttl(Some(bad)).unwrap_err().code(), ErrorCode::BadTtl);
        }
    }

    #[test]
    fn generations_are_plain_decimal_numbers() {
        assert_eq!(generation("0").unwrap(), 0);
        assert_eq!(generation("18446744073709551615").unwrap(), u64::MAX);
        for bad in [
            "",
            "+1",
            "-1",
            "1.0",
            "0x10",
            " 1",
            "abc",
            "18446744073709551616",
        ] {
            assert_eq!(
                generation(bad).unwrap_err().code(),
                ErrorCode::BadGeneration,
                "{bad:?}"
            );
        }
    }

    #[test]
    fn credentials_come_whole_or_not_at_all() {
        assert_eq!(credential(None, None).unwrap(), None);
        assert_eq!(
            credential(Some("al"), Some(2)).unwrap(),
            Some(("al".to_owned(), 2))
        );
        assert_eq!(
            credential(Some("al"), None).unwrap_err().code(),
            ErrorCode::BadGeneration
        );
        assert_eq!(
            credential(None, Some(2)).unwrap_err().code(),
            ErrorCode::BadOwner
        );
        assert_eq!(
            credential(Some(""), Some(2)).unwrap_err().code(),
            ErrorCode::BadOwner
        );
    }

    use super::*;
    use proptest::prelude::*;

    #[test]
    fn one_argument_past_the_kernel_limit_is_refused_up_front() {
        let fits = vec!["echo".to_owned(), "x".repeat(MAX_ARG_BYTES)];
        assert!(command(&fits).is_ok());
        let long = vec!["echo".to_owned(), "x".repeat(MAX_ARG_BYTES + 1)];
        let err = command(&long).unwrap_err();
        assert_eq!(err.code(), ErrorCode::BadCommand);
        assert!(err.to_string().contains("cmd[1]"), "{err}");
        assert!(
            err.to_string().contains(&MAX_ARG_BYTES.to_string()),
            "{err}"
        );
    }

    fn env_of(pairs: &[(&str, &str)]) -> Env {
        Env(pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect())
    }

    #[test]
    fn env_rules() {
        assert!(env(&env_of(&[("A", "1"), ("_B2", "x y")])).is_ok());
        for bad in ["", "1A", "A-B", "A B", "Ä", "A=B"] {
            let err = env(&env_of(&[(bad, "v")])).unwrap_err();
            assert_eq!(err.code(), ErrorCode::BadEnv, "{bad:?}");
        }
        let err = env(&env_of(&[("SECRET", "a\nb")])).unwrap_err();
        assert!(err.to_string().contains("SECRET"));
        assert!(!err.to_string().contains("a\nb"));
        assert!(env(&env_of(&[("N", "a\0b")])).is_err());
        assert!(env(&env_of(&[("N", "a\rb")])).is_err());
        let many: Vec<(String, String)> =
            (0..65).map(|i| (format!("V{i}"), String::new())).collect();
        assert!(env(&Env(many.into_iter().collect())).is_err());
        let big = "x".repeat(MAX_ENV_BYTES);
        assert!(env(&env_of(&[("BIG", &big)])).is_err());
    }

    #[test]
    fn work_path_rules() {
        assert_eq!(work_path("a/./b//c").unwrap(), "a/b/c");
        assert_eq!(work_path("f.txt").unwrap(), "f.txt");
        for bad in ["", ".", "/etc/passwd", "a/../b", "..", "a\0b", "//x"] {
            let err = work_path(bad).unwrap_err();
            assert_eq!(err.code(), ErrorCode::BadPath, "{bad:?}");
        }
        assert!(work_path(&"a".repeat(256)).is_err());
        assert!(work_path(&"a/".repeat(2100)).is_err());
    }

    #[test]
    fn root_path_rules() {
        assert_eq!(root_path("/etc//./hosts", false).unwrap(), "/etc/hosts");
        assert_eq!(root_path("/", true).unwrap(), "/");
        assert_eq!(root_path("/./", true).unwrap(), "/");
        for bad in ["", "/", "etc/hosts", "/a/../b", "/..", "/a\0b"] {
            let err = root_path(bad, false).unwrap_err();
            assert_eq!(err.code(), ErrorCode::BadPath, "{bad:?}");
        }
        assert!(root_path("relative", true).is_err());
        assert!(root_path(&format!("/{}", "a".repeat(256)), false).is_err());
    }

    #[test]
    fn limit_rules() {
        let d = Limits {
            cpus: 1.0,
            memory_mb: 1024,
            pids: 256,
            disk_mb: Some(10240),
        };
        let m = Limits {
            cpus: 4.0,
            memory_mb: 8192,
            pids: 1024,
            disk_mb: Some(20480),
        };
        assert_eq!(limits(None, &d, &m).unwrap(), d);
        let r = LimitsRequest {
            cpus: Some(0.5),
            memory_mb: Some(64),
            pids: None,
            disk_mb: Some(100),
        };
        assert_eq!(
            limits(Some(&r), &d, &m).unwrap(),
            Limits {
                cpus: 0.5,
                memory_mb: 64,
                pids: 256,
                disk_mb: Some(100),
            }
        );
        // Disk limits off: none by default, and asking for one is refused.
        let (d_off, m_off) = (Limits { disk_mb: None, ..d }, Limits { disk_mb: None, ..m });
        assert_eq!(limits(None, &d_off, &m_off).unwrap().disk_mb, None);
        let ask = LimitsRequest {
            disk_mb: Some(100),
            ..Default::default()
        };
        let err = limits(Some(&ask), &d_off, &m_off).unwrap_err();
        assert!(err.to_string().contains("--no-disk-limits"), "{err}");
        for r in [
            LimitsRequest {
                cpus: Some(0.0),
                ..Default::default()
            },
            LimitsRequest {
                cpus: Some(f64::NAN),
                ..Default::default()
            },
            LimitsRequest {
                cpus: Some(5.0),
                ..Default::default()
            },
            LimitsRequest {
                memory_mb: Some(1),
                ..Default::default()
            },
            LimitsRequest {
                memory_mb: Some(9000),
                ..Default::default()
            },
            LimitsRequest {
                pids: Some(0),
                ..Default::default()
            },
            LimitsRequest {
                pids: Some(2000),
                ..Default::default()
            },
            LimitsRequest {
                disk_mb: Some(1),
                ..Default::default()
            },
            LimitsRequest {
                disk_mb: Some(30000),
                ..Default::default()
            },
        ] {
            assert_eq!(
                limits(Some(&r), &d, &m).unwrap_err().code(),
                ErrorCode::BadLimits,
                "{r:?}"
            );
        }
    }

    #[test]
    fn ttl_rules() {
        let d = Duration::from_secs(1800);
        let m = Duration::from_secs(86400);
        assert_eq!(ttl(None, d, m).unwrap(), d);
        assert_eq!(ttl(Some(5), d, m).unwrap(), Duration::from_secs(5));
        assert_eq!(ttl(Some(10_000_000), d, m).unwrap(), m);
        assert!(ttl(Some(0), d, m).is_err());
    }

    #[test]
    fn image_name_rules() {
        for ok in ["base", "debian-12", "a.b_c", "0x"] {
            assert!(image_name(ok).is_ok(), "{ok}");
        }
        for bad in ["", "Base", "-x", ".x", "a/b", "..", &"a".repeat(65)] {
            assert!(image_name(bad).is_err(), "{bad}");
        }
    }

    proptest! {
        /// Whatever the input, an accepted path never climbs out of /work and
        /// is never absolute.
        #[test]
        fn accepted_paths_stay_below_work(s in "[a-z./\\x00]{0,40}") {
            if let Ok(p) = work_path(&s) {
                prop_assert!(!p.starts_with('/'));
                prop_assert!(!p.split('/').any(|c| c == ".." || c == "." || c.is_empty()));
                prop_assert!(!p.contains('\0'));
            }
        }
    }

    #[test]
    fn process_references_are_pids_or_tags() {
        assert_eq!(process_ref("42").unwrap().pid, 42);
        assert_eq!(process_ref("web-1").unwrap().tag, "web-1");
        for bad in ["0", "99999999999", "", "a b", "../x", "a/b", "\u{0}"] {
            let err = process_ref(bad).unwrap_err();
            assert_eq!(err.code(), ErrorCode::BadProcess, "{bad:?}");
        }
        assert!(tag("123").is_err());
        assert!(tag(&"t".repeat(65)).is_err());
        assert!(tag(&"t".repeat(64)).is_ok());
    }

    #[test]
    fn terminals_are_checked() {
        let spec = |rows, cols, term: Option<&str>| runbox_types::PtySpec {
            rows,
            cols,
            term: term.map(str::to_owned),
        };
        let (size, term) = pty(spec(24, 80, None)).unwrap();
        assert_eq!(
            (size.rows, size.cols, term.as_str()),
            (24, 80, DEFAULT_TERM)
        );
        assert_eq!(
            pty(spec(1, 1, Some("screen.xterm-256color"))).unwrap().1,
            "screen.xterm-256color"
        );
        for bad in [
            spec(0, 80, None),
            spec(24, 0, None),
            spec(10_001, 80, None),
            spec(24, 80, Some("")),
            spec(24, 80, Some("xterm\nPATH=/evil")),
            spec(24, 80, Some("a b")),
        ] {
            assert_eq!(pty(bad).unwrap_err().code(), ErrorCode::BadProcess);
        }
    }
}
