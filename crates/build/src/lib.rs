//! What an image build does, as values: a base and the steps after it.
//!
//! A build is planned before anything runs: a Dockerfile
//! ([`dockerfile::plan`]) or a caller's step list becomes a [`Plan`] whose
//! every value is final (build arguments and `$variables` substituted,
//! relative working directories resolved), so the executor only runs steps
//! and each step's cache key is a function of the plan alone.
//!
//! Nothing here touches a run or a file: this crate is the pure part of the
//! builder, tested on its own.

pub mod context;
pub mod copy;
pub mod dockerfile;
pub mod list;
pub mod words;

use std::fmt;

/// A build: where it starts and what it does, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The base image reference, as a create or pull takes it.
    pub base: String,
    /// The steps, each with where it came from.
    pub steps: Vec<Located>,
    /// What the build ignores and says so (`VOLUME`, unused arguments).
    pub warnings: Vec<String>,
}

/// A step and where it came from, for logs and errors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Located {
    /// 1-based line of the Dockerfile (or 1-based index in a step list).
    pub line: usize,
    /// The instruction as written (one line, shortened), for progress.
    pub text: String,
    /// What it does.
    pub step: Step,
}

/// One step of a build.
///
/// Steps that change files ([`Step::Run`], [`Step::Copy`],
/// [`Step::Workdir`]) run in the build run and are captured as a layer;
/// the others change only the image's configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Run a command.
    Run {
        /// The program and its arguments (a shell form is already wrapped
        /// in the shell, `/bin/sh -c` unless `SHELL` changed it).
        argv: Vec<String>,
        /// Variables set for this command only: the build arguments in
        /// scope, which are not kept in the image.
        env: Vec<(String, String)>,
        /// The user for this command only (else the build's current
        /// `USER`).
        user: Option<String>,
    },
    /// Copy files from the build context.
    Copy {
        /// Which context: None for the build's own; else the digest of an
        /// archive uploaded for this step (E2B's per-step file uploads).
        context: Option<String>,
        /// Paths (or `*`/`?`/`[...]` patterns) relative to the context root.
        sources: Vec<String>,
        /// Where, absolute (a relative one is resolved against the working
        /// directory when planned); a trailing `/` means "into this
        /// directory".
        dest: String,
        /// `--chown`: `user[:group]`, names or numbers.
        chown: Option<String>,
        /// `--chmod`: the mode every copied file and directory gets.
        chmod: Option<u32>,
        /// `ADD`: a local tar archive source is unpacked at the
        /// destination instead of copied.
        unpack_archives: bool,
    },
    /// Set variables in the image's environment (and for later steps).
    Env(Vec<(String, String)>),
    /// Change (and create) the working directory: absolute.
    Workdir(String),
    /// Change the user later steps and the image run as.
    User(String),
    /// The image's default command.
    Cmd(Vec<String>),
    /// The image's entrypoint (it also clears an inherited `Cmd`).
    Entrypoint(Vec<String>),
    /// Ports the image says it listens on (`80`, `53/udp`): recorded only.
    Expose(Vec<String>),
    /// Labels of the image.
    Label(Vec<(String, String)>),
}

impl Step {
    /// Whether the step changes files (and so is run and captured).
    pub fn changes_files(&self) -> bool {
        matches!(
            self,
            Step::Run { .. } | Step::Copy { .. } | Step::Workdir(_)
        )
    }

    /// The step as bytes that differ whenever the step would do something
    /// else: every field, each length-prefixed so no two steps encode
    /// alike.
    fn encode(&self, out: &mut Vec<u8>) {
        fn field(out: &mut Vec<u8>, bytes: &[u8]) {
            out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
            out.extend_from_slice(bytes);
        }
        fn list(out: &mut Vec<u8>, items: &[String]) {
            field(out, &(items.len() as u64).to_le_bytes());
            for item in items {
                field(out, item.as_bytes());
            }
        }
        fn pairs(out: &mut Vec<u8>, items: &[(String, String)]) {
            field(out, &(items.len() as u64).to_le_bytes());
            for (k, v) in items {
                field(out, k.as_bytes());
                field(out, v.as_bytes());
            }
        }
        fn optional(out: &mut Vec<u8>, value: Option<&str>) {
            match value {
                Some(v) => {
                    field(out, b"1");
                    field(out, v.as_bytes());
                }
                None => field(out, b"0"),
            }
        }
        match self {
            Step::Run { argv, env, user } => {
                field(out, b"run");
                list(out, argv);
                pairs(out, env);
                optional(out, user.as_deref());
            }
            Step::Copy {
                context,
                sources,
                dest,
                chown,
                chmod,
                unpack_archives,
            } => {
                field(out, b"copy");
                optional(out, context.as_deref());
                list(out, sources);
                field(out, dest.as_bytes());
                optional(out, chown.as_deref());
                optional(out, chmod.map(|m| format!("{m:o}")).as_deref());
                field(out, &[u8::from(*unpack_archives)]);
            }
            Step::Env(env) => {
                field(out, b"env");
                pairs(out, env);
            }
            Step::Workdir(dir) => {
                field(out, b"workdir");
                field(out, dir.as_bytes());
            }
            Step::User(user) => {
                field(out, b"user");
                field(out, user.as_bytes());
            }
            Step::Cmd(argv) => {
                field(out, b"cmd");
                list(out, argv);
            }
            Step::Entrypoint(argv) => {
                field(out, b"entrypoint");
                list(out, argv);
            }
            Step::Expose(ports) => {
                field(out, b"expose");
                list(out, ports);
            }
            Step::Label(labels) => {
                field(out, b"label");
                pairs(out, labels);
            }
        }
    }
}

/// The cache key of the state after `step`, reached from the state keyed
/// `parent` (for the first step, the base image's digest or a name that
/// pins it); `inputs` are the digests of what the step reads from outside
/// the plan (a `COPY`'s files), in order. Equal keys mean equal files and
/// configuration, so a build can start from a cached state instead of
/// running the steps up to it. Lowercase hex SHA-256.
pub fn cache_key(parent: &str, step: &Step, inputs: &[String]) -> String {
    use sha2::{Digest, Sha256};
    let mut bytes = Vec::new();
    bytes.extend_from_slice(b"runbox-build-step-1\0");
    bytes.extend_from_slice(&(parent.len() as u64).to_le_bytes());
    bytes.extend_from_slice(parent.as_bytes());
    step.encode(&mut bytes);
    bytes.extend_from_slice(&(inputs.len() as u64).to_le_bytes());
    for input in inputs {
        bytes.extend_from_slice(&(input.len() as u64).to_le_bytes());
        bytes.extend_from_slice(input.as_bytes());
    }
    Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

impl fmt::Display for Located {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}", self.line, self.text)
    }
}

/// Why a build could not be planned: what is wrong and where.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}{message}", line.map(|l| format!("line {l}: ")).unwrap_or_default())]
pub struct PlanError {
    /// 1-based line, when the error belongs to one.
    pub line: Option<usize>,
    /// What to fix.
    pub message: String,
}

impl PlanError {
    pub(crate) fn at(line: usize, message: impl Into<String>) -> Self {
        Self {
            line: Some(line),
            message: message.into(),
        }
    }

    pub(crate) fn whole(message: impl Into<String>) -> Self {
        Self {
            line: None,
            message: message.into(),
        }
    }
}

/// Joins `path` onto the working directory `cwd` (absolute), as `WORKDIR`
/// and relative `COPY` destinations do; `.` and `..` are resolved without
/// leaving `/`. A trailing `/` is kept.
pub fn resolve(cwd: &str, path: &str) -> String {
    let joined = if path.starts_with('/') {
        path.to_owned()
    } else {
        format!("{}/{}", cwd.trim_end_matches('/'), path)
    };
    let mut parts: Vec<&str> = Vec::new();
    for part in joined.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            part => parts.push(part),
        }
    }
    let mut out = format!("/{}", parts.join("/"));
    let trailing = path.ends_with('/') || path.ends_with("/.") || path == ".";
    if trailing && out != "/" {
        out.push('/');
    }
    out
}

/// The longest step text kept for progress lines, in characters.
const TEXT_CHARS: usize = 120;

/// `text` cut to [`TEXT_CHARS`] characters, an ellipsis marking the cut.
pub(crate) fn shorten(text: String) -> String {
    if text.chars().count() > TEXT_CHARS {
        text.chars().take(TEXT_CHARS - 1).collect::<String>() + "…"
    } else {
        text
    }
}

/// [`resolve`] for a directory: no trailing `/` (but `/` itself).
pub fn resolve_dir(cwd: &str, path: &str) -> String {
    let resolved = resolve(cwd, path);
    match resolved.len() {
        1 => resolved,
        _ => resolved.trim_end_matches('/').to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_resolve_against_the_working_directory() {
        assert_eq!(resolve("/", "app"), "/app");
        assert_eq!(resolve("/app", "src/"), "/app/src/");
        assert_eq!(resolve("/app", "/etc"), "/etc");
        assert_eq!(resolve("/app", "../../.."), "/");
        assert_eq!(resolve("/app", "."), "/app/");
        assert_eq!(resolve("/a/b", "./c/../d"), "/a/b/d");
        assert_eq!(resolve_dir("/app", "src/"), "/app/src");
        assert_eq!(resolve_dir("/app", ".."), "/");
    }

    #[test]
    fn cache_keys_change_with_anything_that_changes_the_result() {
        let run = |cmd: &str| Step::Run {
            argv: vec!["/bin/sh".into(), "-c".into(), cmd.into()],
            env: vec![],
            user: None,
        };
        let key = cache_key("sha256:base", &run("make"), &[]);
        assert_eq!(key.len(), 64);
        assert_eq!(key, cache_key("sha256:base", &run("make"), &[]));
        assert_ne!(key, cache_key("sha256:other", &run("make"), &[]));
        assert_ne!(key, cache_key("sha256:base", &run("make "), &[]));
        assert_ne!(
            key,
            cache_key("sha256:base", &run("make"), &["sha256:ctx".into()])
        );
        // Field boundaries count: ["ab","c"] is not ["a","bc"].
        let argv = |a: &[&str]| Step::Cmd(a.iter().map(|s| s.to_string()).collect());
        assert_ne!(
            cache_key("p", &argv(&["ab", "c"]), &[]),
            cache_key("p", &argv(&["a", "bc"]), &[])
        );
        let user = Step::Run {
            argv: vec!["id".into()],
            env: vec![],
            user: Some("root".into()),
        };
        assert_ne!(
            cache_key("p", &user, &[]),
            cache_key(
                "p",
                &Step::Run {
                    argv: vec!["id".into()],
                    env: vec![],
                    user: None,
                },
                &[]
            )
        );
    }

    #[test]
    fn errors_name_their_line() {
        assert_eq!(PlanError::at(3, "bad").to_string(), "line 3: bad");
        assert_eq!(PlanError::whole("bad").to_string(), "bad");
    }
}
