//! A step list as a [`Plan`]: the form a caller sends when it has no
//! Dockerfile (runbox's JSON builds and E2B's template builds): each step a
//! kind and its arguments, as `RUN [command, user?]`, `COPY [source,
//! destination, owner?, mode?]` with the digest of its uploaded files,
//! `ENV [name, value, ...]`, `WORKDIR [path]`, `USER [user]`.

use crate::words::{self, Vars};
use crate::{resolve, resolve_dir, Located, Plan, PlanError, Step};

/// One step as sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListStep {
    /// `RUN`, `COPY`, `ENV`, `WORKDIR` or `USER` (any case).
    pub kind: String,
    /// Its arguments, laid out per kind (see the module).
    pub args: Vec<String>,
    /// For `COPY`: the digest of the archive uploaded for it.
    pub files: Option<String>,
}

/// What the list's steps start from besides the base image.
#[derive(Debug, Clone)]
pub struct ListOptions {
    /// The shell a `RUN` command is given to (`/bin/sh -c`, or E2B's
    /// `/bin/bash -l -c`).
    pub shell: Vec<String>,
    /// The working directory the steps start in (absolute).
    pub workdir: String,
    /// The environment the steps start with (the base image's).
    pub env: Vec<(String, String)>,
}

impl Default for ListOptions {
    fn default() -> Self {
        Self {
            shell: vec!["/bin/sh".to_owned(), "-c".to_owned()],
            workdir: "/".to_owned(),
            env: Vec::new(),
        }
    }
}

/// The most steps a list may have.
pub const MAX_STEPS: usize = 1000;

/// Plans `steps` on `base`.
pub fn plan(base: &str, steps: &[ListStep], options: &ListOptions) -> Result<Plan, PlanError> {
    if base.trim().is_empty() {
        return Err(PlanError::whole("the build names no base image"));
    }
    if steps.len() > MAX_STEPS {
        return Err(PlanError::whole(format!(
            "a build has at most {MAX_STEPS} steps"
        )));
    }
    let mut env: Vars = options.env.iter().cloned().collect();
    let mut workdir = options.workdir.clone();
    let mut planned = Vec::with_capacity(steps.len());
    for (index, step) in steps.iter().enumerate() {
        let line = index + 1;
        let kind = step.kind.to_ascii_uppercase();
        let args = &step.args;
        let arity = |min: usize, max: usize| {
            if (min..=max).contains(&args.len()) {
                Ok(())
            } else {
                Err(PlanError::at(
                    line,
                    format!("{kind} takes {min} to {max} arguments, got {}", args.len()),
                ))
            }
        };
        let planned_step = match kind.as_str() {
            "RUN" => {
                arity(1, 2)?;
                if args[0].trim().is_empty() {
                    return Err(PlanError::at(line, "RUN needs a command"));
                }
                let mut argv = options.shell.clone();
                argv.push(args[0].clone());
                Step::Run {
                    argv,
                    env: Vec::new(),
                    user: args.get(1).filter(|u| !u.is_empty()).cloned(),
                }
            }
            "COPY" => {
                arity(2, 4)?;
                let Some(files) = step.files.clone().filter(|f| is_digest(f)) else {
                    return Err(PlanError::at(
                        line,
                        "COPY needs the digest of its uploaded files (64 lowercase hex digits)",
                    ));
                };
                let source = crate::dockerfile::context_path(&args[0], line)?;
                if args[1].is_empty() {
                    return Err(PlanError::at(line, "COPY needs a destination"));
                }
                let chmod = match args.get(3).map(String::as_str) {
                    None | Some("") => None,
                    Some(mode) => Some(crate::dockerfile::parse_mode(mode, line)?),
                };
                Step::Copy {
                    context: Some(files),
                    sources: vec![source],
                    dest: resolve(&workdir, &args[1]),
                    chown: args.get(2).filter(|u| !u.is_empty()).cloned(),
                    chmod,
                    unpack_archives: false,
                }
            }
            "ENV" => {
                if args.is_empty() || args.len() % 2 != 0 {
                    return Err(PlanError::at(
                        line,
                        "ENV takes names and values in pairs: [name, value, ...]",
                    ));
                }
                let mut pairs = Vec::new();
                for pair in args.chunks(2) {
                    if pair[0].is_empty() || pair[0].contains(['=', '\0']) {
                        return Err(PlanError::at(
                            line,
                            format!("ENV name {:?} is empty or holds = or a NUL byte", pair[0]),
                        ));
                    }
                    // Values read earlier variables, as in a Dockerfile.
                    let value = words::single(&pair[1], &env, '\\')
                        .map_err(|e| PlanError::at(line, e.to_string()))?;
                    pairs.push((pair[0].clone(), value));
                }
                env.extend(pairs.iter().cloned());
                Step::Env(pairs)
            }
            "WORKDIR" => {
                arity(1, 1)?;
                if args[0].is_empty() {
                    return Err(PlanError::at(line, "WORKDIR needs a path"));
                }
                workdir = resolve_dir(&workdir, &args[0]);
                Step::Workdir(workdir.clone())
            }
            "USER" => {
                arity(1, 2)?;
                if args[0].is_empty() || args[0].contains(char::is_whitespace) {
                    return Err(PlanError::at(line, "USER needs one user[:group]"));
                }
                Step::User(args[0].clone())
            }
            other => {
                return Err(PlanError::at(
                    line,
                    format!("unknown step type {other:?}: RUN, COPY, ENV, WORKDIR or USER"),
                ))
            }
        };
        planned.push(Located {
            line,
            text: text_of(&kind, args),
            step: planned_step,
        });
    }
    Ok(Plan {
        base: base.trim().to_owned(),
        steps: planned,
        warnings: Vec::new(),
    })
}

fn is_digest(text: &str) -> bool {
    text.len() == 64 && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// `RUN apt-get update`, shortened, for progress lines; a `RUN` with a
/// user is `RUN <command> (as <user>)`.
fn text_of(kind: &str, args: &[String]) -> String {
    if let ("RUN", [command, user]) = (kind, args) {
        if !user.is_empty() {
            return crate::shorten(format!("RUN {} (as {user})", command.replace('\n', " ")));
        }
    }
    let mut text = kind.to_owned();
    for arg in args.iter().filter(|a| !a.is_empty()) {
        text.push(' ');
        text.push_str(&arg.replace('\n', " "));
    }
    crate::shorten(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(kind: &str, args: &[&str]) -> ListStep {
        ListStep {
            kind: kind.into(),
            args: args.iter().map(|s| s.to_string()).collect(),
            files: None,
        }
    }

    #[test]
    fn a_template_like_list() {
        let digest = "a".repeat(64);
        let options = ListOptions {
            shell: vec!["/bin/bash".into(), "-l".into(), "-c".into()],
            workdir: "/home/user".into(),
            env: vec![("PATH".into(), "/usr/bin".into())],
        };
        let mut copy = step("COPY", &["folder/*", "folder", "", "0755"]);
        copy.files = Some(digest.clone());
        let plan = plan(
            "ubuntu:22.04",
            &[
                copy,
                step("run", &["cat folder/test.txt", "root"]),
                step("ENV", &["A", "1", "PATH", "$PATH:/opt"]),
                step("WORKDIR", &["app"]),
                step("USER", &["user", "true"]),
            ],
            &options,
        )
        .unwrap();
        let steps: Vec<Step> = plan.steps.iter().map(|l| l.step.clone()).collect();
        assert_eq!(
            steps[0],
            Step::Copy {
                context: Some(digest),
                sources: vec!["folder/*".into()],
                dest: "/home/user/folder".into(),
                chown: None,
                chmod: Some(0o755),
                unpack_archives: false,
            }
        );
        assert_eq!(
            steps[1],
            Step::Run {
                argv: vec![
                    "/bin/bash".into(),
                    "-l".into(),
                    "-c".into(),
                    "cat folder/test.txt".into()
                ],
                env: vec![],
                user: Some("root".into()),
            }
        );
        assert_eq!(
            steps[2],
            Step::Env(vec![
                ("A".into(), "1".into()),
                ("PATH".into(), "/usr/bin:/opt".into())
            ])
        );
        assert_eq!(steps[3], Step::Workdir("/home/user/app".into()));
        assert_eq!(steps[4], Step::User("user".into()));
        assert_eq!(plan.steps[1].text, "RUN cat folder/test.txt (as root)");
    }

    #[test]
    fn mistakes_name_their_step() {
        let cases = [
            (step("FROB", &["x"]), "unknown step type"),
            (step("RUN", &[]), "1 to 2 arguments"),
            (step("RUN", &[" "]), "needs a command"),
            (step("COPY", &["a", "b"]), "digest"),
            (step("ENV", &["A"]), "pairs"),
            (step("ENV", &["A=B", "c"]), "holds ="),
            (step("WORKDIR", &[""]), "needs a path"),
            (step("USER", &["a b"]), "one user"),
        ];
        for (bad, needle) in cases {
            let err =
                plan("x", &[step("RUN", &["true"]), bad], &ListOptions::default()).unwrap_err();
            assert_eq!(err.line, Some(2), "{err}");
            assert!(err.to_string().contains(needle), "{err}");
        }
        let mut outside = step("COPY", &["../x", "/x"]);
        outside.files = Some("b".repeat(64));
        assert!(plan("x", &[outside], &ListOptions::default()).is_err());
        assert!(plan(" ", &[], &ListOptions::default()).is_err());
    }
}
