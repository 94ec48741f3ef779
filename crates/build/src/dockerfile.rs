//! A Dockerfile as a [`Plan`].
//!
//! Parsing is `parse-dockerfile`'s; this module gives the instructions
//! their meaning: build arguments and `$variable` substitution
//! ([`crate::words`]), the shell and exec forms, working directories,
//! stages. A Dockerfile with several stages builds its target stage (the
//! last, or the one named), with the stages it is built `FROM`; stages it
//! does not need are not built.
//!
//! Planning takes two looks at the text: [`base`] finds the image the
//! build starts from (only the global `ARG`s are needed), the caller
//! resolves that image, and [`plan`] plans the steps knowing the base's
//! environment and working directory (a Dockerfile may read them, as in
//! `ENV PATH=$PATH:/opt/bin`).

use std::collections::BTreeMap;

use parse_dockerfile::{Command, Instruction, Source};

use crate::words::{self, Vars, WordError};
use crate::{resolve, resolve_dir, Located, Plan, PlanError, Step};

/// The largest Dockerfile accepted.
pub const MAX_BYTES: usize = 1 << 20;

/// What the caller gives besides the text.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// `--build-arg NAME=VALUE`.
    pub build_args: BTreeMap<String, String>,
    /// `--target STAGE`: the stage to build (else the last).
    pub target: Option<String>,
}

/// What the base image brings that a Dockerfile can read.
#[derive(Debug, Clone, Default)]
pub struct BaseConfig {
    /// Its environment.
    pub env: Vec<(String, String)>,
    /// Its working directory (else `/`).
    pub working_dir: Option<String>,
}

/// The image the build starts from: the target stage's `FROM`, followed
/// through the stages it names.
pub fn base(text: &str, options: &Options) -> Result<String, PlanError> {
    let file = Parsed::new(text, options)?;
    let chain = file.chain()?;
    file.base_of(chain[0])
}

/// The build's plan, given what its base image brings.
pub fn plan(text: &str, options: &Options, base: &BaseConfig) -> Result<Plan, PlanError> {
    let file = Parsed::new(text, options)?;
    let chain = file.chain()?;
    let mut state = State::new(base);
    for &stage in &chain {
        file.plan_stage(stage, &mut state)?;
    }
    let mut warnings = state.warnings;
    let unused: Vec<&str> = options
        .build_args
        .keys()
        .filter(|name| {
            !state.consumed.contains(*name)
                && !file.global_names.contains(name)
                && !PROXY_ARGS.contains(&name.as_str())
        })
        .map(String::as_str)
        .collect();
    if !unused.is_empty() {
        warnings.push(format!(
            "build arguments not used by the Dockerfile: {}",
            unused.join(", ")
        ));
    }
    Ok(Plan {
        base: file.base_of(chain[0])?,
        steps: state.steps,
        warnings,
    })
}

/// The parsed file and what planning needs of it throughout.
struct Parsed<'a> {
    text: &'a str,
    file: parse_dockerfile::Dockerfile<'a>,
    options: &'a Options,
    escape: char,
    /// The global `ARG`s (before the first `FROM`) with their values.
    globals: Vars,
    /// Every global `ARG`'s name, valued or not.
    global_names: Vec<String>,
}

/// One stage: its `FROM` and instructions, by index into the file.
struct StageRef<'b, 'a> {
    from: &'b parse_dockerfile::FromInstruction<'a>,
    name: Option<String>,
    instructions: &'b [Instruction<'a>],
}

impl<'a> Parsed<'a> {
    fn new(text: &'a str, options: &'a Options) -> Result<Self, PlanError> {
        if text.len() > MAX_BYTES {
            return Err(PlanError::whole(format!(
                "the Dockerfile is larger than {MAX_BYTES} bytes"
            )));
        }
        let file = parse_dockerfile::parse(text).map_err(|e| PlanError {
            line: Some(e.line()).filter(|&l| l > 0),
            message: format!("cannot parse the Dockerfile: {e}"),
        })?;
        let escape = file
            .parser_directives
            .escape
            .as_ref()
            .map_or('\\', |d| d.value.value);
        let mut parsed = Self {
            text,
            file,
            options,
            escape,
            globals: Vars::new(),
            global_names: Vec::new(),
        };
        let mut globals = Vars::new();
        let predefined = predefined();
        for arg in parsed.file.global_args() {
            let line = parsed.line_of(arg.arg.span.start);
            for (name, default) in parsed.arg_pairs(&arg.arguments.value, &globals, line)? {
                parsed.global_names.push(name.clone());
                let value = options
                    .build_args
                    .get(&name)
                    .cloned()
                    .or(default)
                    .or_else(|| predefined.get(&name).cloned());
                if let Some(value) = value {
                    globals.insert(name, value);
                }
            }
        }
        parsed.globals = globals;
        Ok(parsed)
    }

    fn line_of(&self, offset: usize) -> usize {
        1 + self.text[..offset.min(self.text.len())]
            .bytes()
            .filter(|&b| b == b'\n')
            .count()
    }

    fn stages(&self) -> Vec<StageRef<'_, 'a>> {
        self.file
            .stages()
            .map(|stage| StageRef {
                from: stage.from,
                name: stage
                    .from
                    .as_
                    .as_ref()
                    .map(|(_, name)| name.value.to_ascii_lowercase()),
                instructions: stage.instructions,
            })
            .collect()
    }

    /// The indexes of the stages the target is built from, first to last.
    fn chain(&self) -> Result<Vec<usize>, PlanError> {
        let stages = self.stages();
        let mut seen = std::collections::BTreeSet::new();
        for stage in &stages {
            if let Some(name) = &stage.name {
                if !seen.insert(name.clone()) {
                    return Err(PlanError::at(
                        self.line_of(stage.from.from.span.start),
                        format!("the stage name {name:?} is used twice (names ignore case)"),
                    ));
                }
            }
        }
        if stages.is_empty() {
            return Err(PlanError::whole(
                "the Dockerfile has no FROM instruction: it must start from an image",
            ));
        }
        let mut at = match &self.options.target {
            None => stages.len() - 1,
            Some(target) => {
                let wanted = target.to_ascii_lowercase();
                stages
                    .iter()
                    .position(|s| s.name.as_deref() == Some(wanted.as_str()))
                    .ok_or_else(|| {
                        PlanError::whole(format!(
                            "no stage named {target:?} (name one with FROM image AS name)"
                        ))
                    })?
            }
        };
        let mut chain = vec![at];
        loop {
            let from = self.stage_image(&stages[at])?;
            let parent = stages[..at]
                .iter()
                .position(|s| s.name.as_deref() == Some(from.to_ascii_lowercase().as_str()));
            match parent {
                Some(parent) => {
                    chain.push(parent);
                    at = parent;
                }
                None => break,
            }
        }
        chain.reverse();
        Ok(chain)
    }

    /// A stage's `FROM` image, its global arguments substituted.
    fn stage_image(&self, stage: &StageRef<'_, 'a>) -> Result<String, PlanError> {
        let line = self.line_of(stage.from.from.span.start);
        for flag in &stage.from.options {
            if flag.name.value != "platform" {
                return Err(PlanError::at(
                    line,
                    format!("FROM --{} is not supported", flag.name.value),
                ));
            }
        }
        let image = self.word(&stage.from.image.value, &self.globals, line)?;
        if image.is_empty() {
            return Err(PlanError::at(line, "FROM names no image"));
        }
        Ok(image)
    }

    fn base_of(&self, stage: usize) -> Result<String, PlanError> {
        let stages = self.stages();
        let image = self.stage_image(&stages[stage])?;
        if image.eq_ignore_ascii_case("scratch") {
            let line = self.line_of(stages[stage].from.from.span.start);
            return Err(PlanError::at(
                line,
                "FROM scratch is not supported: a build runs its steps in a run, which needs an image with a shell; start from a small image (busybox, alpine)",
            ));
        }
        Ok(image)
    }

    fn word(&self, text: &str, vars: &Vars, line: usize) -> Result<String, PlanError> {
        words::single(text, vars, self.escape).map_err(|e| word_error(line, e))
    }

    /// `ARG a`, `ARG a=1 b=2`: names with their defaults.
    fn arg_pairs(
        &self,
        text: &str,
        vars: &Vars,
        line: usize,
    ) -> Result<Vec<(String, Option<String>)>, PlanError> {
        let mut pairs = Vec::new();
        for raw in words::raw_split(text, self.escape).map_err(|e| word_error(line, e))? {
            let (name, default) = match raw.split_once('=') {
                Some((name, value)) => (name, Some(self.word(value, vars, line)?)),
                None => (raw.as_str(), None),
            };
            check_name(name, "ARG", line)?;
            pairs.push((name.to_owned(), default));
        }
        if pairs.is_empty() {
            return Err(PlanError::at(line, "ARG needs a name"));
        }
        Ok(pairs)
    }

    /// `ENV a=1 b="x y"` or the old `ENV a the rest`; `LABEL` likewise
    /// (pairs only).
    fn pairs(
        &self,
        text: &str,
        vars: &Vars,
        line: usize,
        what: &str,
    ) -> Result<Vec<(String, String)>, PlanError> {
        let raw = words::raw_split(text, self.escape).map_err(|e| word_error(line, e))?;
        let Some(first) = raw.first() else {
            return Err(PlanError::at(line, format!("{what} needs name=value")));
        };
        if !first.contains('=') {
            if raw.len() < 2 {
                return Err(PlanError::at(
                    line,
                    format!("{what} needs name=value pairs (got {first:?})"),
                ));
            }
            // The old form: the first word is the name, the rest its value.
            check_name(first, what, line)?;
            let rest = text.trim_start()[first.len()..].trim_start();
            return Ok(vec![(first.clone(), self.word(rest, vars, line)?)]);
        }
        let mut pairs = Vec::new();
        for word in &raw {
            let Some((name, value)) = word.split_once('=') else {
                return Err(PlanError::at(
                    line,
                    format!("{what} needs name=value pairs (got {word:?})"),
                ));
            };
            // A label's name may be quoted (`"com.example.x"=1`).
            let name = if what == "LABEL" {
                self.word(name, vars, line)?
            } else {
                check_name(name, what, line)?;
                name.to_owned()
            };
            if name.is_empty() {
                return Err(PlanError::at(line, format!("{what} has an empty name")));
            }
            pairs.push((name, self.word(value, vars, line)?));
        }
        Ok(pairs)
    }

    fn plan_stage(&self, index: usize, state: &mut State) -> Result<(), PlanError> {
        let stages = self.stages();
        let stage = &stages[index];
        // Arguments are scoped to their stage; a stage built FROM another
        // keeps its environment (it continues that stage's image).
        state.args.clear();
        for instruction in stage.instructions {
            self.plan_instruction(instruction, state)?;
        }
        Ok(())
    }

    fn plan_instruction(
        &self,
        instruction: &Instruction<'a>,
        state: &mut State,
    ) -> Result<(), PlanError> {
        let start = keyword_start(instruction);
        let line = self.line_of(start);
        let text = self.text_of(start);
        let vars = state.vars();
        let step = match instruction {
            Instruction::Arg(arg) => {
                for (name, default) in self.arg_pairs(&arg.arguments.value, &vars, line)? {
                    state.consumed.insert(name.clone());
                    let value = self
                        .options
                        .build_args
                        .get(&name)
                        .cloned()
                        .or(default)
                        .or_else(|| self.globals.get(&name).cloned())
                        .or_else(|| predefined().get(&name).cloned());
                    match value {
                        Some(value) => {
                            state.args.insert(name, value);
                        }
                        None => {
                            state.args.remove(&name);
                        }
                    }
                }
                None
            }
            Instruction::Env(env) => {
                let pairs = self.pairs(&env.arguments.value, &vars, line, "ENV")?;
                for (name, value) in &pairs {
                    state.env.insert(name.clone(), value.clone());
                }
                Some(Step::Env(pairs))
            }
            Instruction::Label(label) => Some(Step::Label(self.pairs(
                &label.arguments.value,
                &vars,
                line,
                "LABEL",
            )?)),
            Instruction::Maintainer(m) => Some(Step::Label(vec![(
                "maintainer".to_owned(),
                m.name.value.to_string(),
            )])),
            Instruction::Workdir(workdir) => {
                let path = self.word(&workdir.arguments.value, &vars, line)?;
                if path.is_empty() {
                    return Err(PlanError::at(line, "WORKDIR needs a path"));
                }
                let resolved = resolve_dir(&state.workdir, &path);
                state.workdir = resolved.clone();
                Some(Step::Workdir(resolved))
            }
            Instruction::User(user) => {
                let user = self.word(&user.arguments.value, &vars, line)?;
                if user.is_empty() || user.contains(char::is_whitespace) {
                    return Err(PlanError::at(line, "USER needs one user[:group]"));
                }
                Some(Step::User(user))
            }
            Instruction::Run(run) => {
                if let Some(flag) = run.options.first() {
                    return Err(PlanError::at(
                        line,
                        format!(
                            "RUN --{} is not supported: a build step runs with the build's own network and mounts nothing",
                            flag.name.value
                        ),
                    ));
                }
                let argv = match (&run.arguments, run.here_docs.as_slice()) {
                    (Command::Exec(list), []) => {
                        list.value.iter().map(|s| s.value.to_string()).collect()
                    }
                    (Command::Shell(command), []) => {
                        state.shell_form(&join_continuations(command.value, self.escape))
                    }
                    // `RUN <<EOF` alone: the document is the script.
                    (Command::Shell(command), [doc]) if command.value.trim().is_empty() => {
                        if doc.value.starts_with("#!") {
                            return Err(PlanError::at(
                                line,
                                "a here-document script with its own #! interpreter is not supported: name the interpreter (RUN <<EOF python3)",
                            ));
                        }
                        state.shell_form(&doc.value)
                    }
                    // `RUN <<EOF python3`: the shell reads the documents
                    // itself, so it gets the text as written, through the
                    // last document's end line. (The parser knows a
                    // document only as RUN's first word.)
                    (Command::Shell(_), [.., last]) => {
                        let end = last.span.end.min(self.text.len());
                        let end = self.text[end..]
                            .find('\n')
                            .map_or(self.text.len(), |at| end + at);
                        state.shell_form(self.text[run.run.span.end..end].trim())
                    }
                    _ => return Err(PlanError::at(line, "this form of RUN is not supported")),
                };
                if argv.is_empty() {
                    return Err(PlanError::at(line, "RUN needs a command"));
                }
                // An ENV wins over an ARG of the same name; proxy
                // arguments come without an ARG.
                let mut env: Vars = state
                    .args
                    .iter()
                    .filter(|(k, _)| !state.env.contains_key(*k))
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                for name in PROXY_ARGS {
                    if let Some(value) = self.options.build_args.get(name) {
                        env.entry(name.to_owned()).or_insert_with(|| value.clone());
                    }
                }
                Some(Step::Run {
                    argv,
                    env: env.into_iter().collect(),
                    user: None,
                })
            }
            Instruction::Cmd(cmd) => Some(Step::Cmd(self.command(&cmd.arguments, state, line)?)),
            Instruction::Entrypoint(entrypoint) => Some(Step::Entrypoint(self.command(
                &entrypoint.arguments,
                state,
                line,
            )?)),
            Instruction::Shell(shell) => {
                let shell: Vec<String> = shell
                    .arguments
                    .iter()
                    .map(|s| s.value.to_string())
                    .collect();
                if shell.is_empty() {
                    return Err(PlanError::at(
                        line,
                        "SHELL needs a JSON array: SHELL [\"/bin/bash\", \"-c\"]",
                    ));
                }
                state.shell = shell;
                None
            }
            Instruction::Copy(copy) => {
                let (chown, chmod) = self.copy_flags(&copy.options, "COPY", &vars, line)?;
                Some(self.copy(
                    &copy.src,
                    &copy.dest.value,
                    (chown, chmod),
                    false,
                    &vars,
                    state,
                    line,
                )?)
            }
            Instruction::Add(add) => {
                let (chown, chmod) = self.copy_flags(&add.options, "ADD", &vars, line)?;
                Some(self.copy(
                    &add.src,
                    &add.dest.value,
                    (chown, chmod),
                    true,
                    &vars,
                    state,
                    line,
                )?)
            }
            Instruction::Expose(expose) => {
                let mut ports = Vec::new();
                for raw in &expose.arguments {
                    for port in words::split(&raw.value, &vars, self.escape)
                        .map_err(|e| word_error(line, e))?
                    {
                        check_port(&port, line)?;
                        ports.push(port.to_ascii_lowercase());
                    }
                }
                Some(Step::Expose(ports))
            }
            Instruction::Volume(_) => {
                state.warnings.push(format!(
                    "line {line}: VOLUME has no effect: the path stays part of the image's files (mount a runbox volume at create instead)"
                ));
                None
            }
            Instruction::Healthcheck(_) | Instruction::Stopsignal(_) => {
                state.warnings.push(format!(
                    "line {line}: {text} is recorded nowhere and has no effect"
                ));
                None
            }
            Instruction::Onbuild(_) => {
                return Err(PlanError::at(line, "ONBUILD is not supported"));
            }
            Instruction::From(_) => None,
            _ => {
                return Err(PlanError::at(
                    line,
                    format!("{text}: this instruction is not supported"),
                ))
            }
        };
        if let Some(step) = step {
            state.steps.push(Located { line, text, step });
        }
        Ok(())
    }

    fn command(
        &self,
        command: &Command<'a>,
        state: &State,
        line: usize,
    ) -> Result<Vec<String>, PlanError> {
        match command {
            Command::Exec(list) => Ok(list.value.iter().map(|s| s.value.to_string()).collect()),
            Command::Shell(text) => {
                Ok(state.shell_form(&join_continuations(text.value, self.escape)))
            }
            _ => Err(PlanError::at(line, "this form of command is not supported")),
        }
    }

    /// `--chown`, `--chmod` (and `--link`, which changes nothing here) of
    /// a `COPY` or `ADD`.
    fn copy_flags(
        &self,
        flags: &[parse_dockerfile::Flag<'a>],
        what: &str,
        vars: &Vars,
        line: usize,
    ) -> Result<(Option<String>, Option<u32>), PlanError> {
        let (mut chown, mut chmod) = (None, None);
        for flag in flags {
            let value = flag.value.as_ref().map_or("", |v| v.value.as_ref());
            match flag.name.value.as_ref() {
                "chown" => chown = Some(self.word(value, vars, line)?),
                "chmod" => chmod = Some(parse_mode(&self.word(value, vars, line)?, line)?),
                "link" => {}
                "from" => {
                    return Err(PlanError::at(
                        line,
                        format!("{what} --from is not supported yet: copy from the build context, or build the other stage as an image of its own and start FROM it"),
                    ))
                }
                other => {
                    return Err(PlanError::at(line, format!("{what} --{other} is not supported")))
                }
            }
        }
        Ok((chown, chmod))
    }

    #[allow(clippy::too_many_arguments)]
    fn copy(
        &self,
        sources: &[Source<'a>],
        dest: &str,
        (chown, chmod): (Option<String>, Option<u32>),
        unpack_archives: bool,
        vars: &Vars,
        state: &State,
        line: usize,
    ) -> Result<Step, PlanError> {
        let what = if unpack_archives { "ADD" } else { "COPY" };
        let mut paths = Vec::new();
        for source in sources {
            let Source::Path(path) = source else {
                return Err(PlanError::at(
                    line,
                    format!("a here-document as a {what} source is not supported: put the file in the build context"),
                ));
            };
            let path = self.word(&path.value, vars, line)?;
            if path.contains("://") || path.starts_with("git@") {
                return Err(PlanError::at(
                    line,
                    format!("{path}: adding from a URL is not supported: download it in a RUN step (curl, wget, git)"),
                ));
            }
            paths.push(context_path(&path, line)?);
        }
        let dest = self.word(dest, vars, line)?;
        if dest.is_empty() {
            return Err(PlanError::at(line, format!("{what} needs a destination")));
        }
        if paths.len() > 1 && !dest.ends_with('/') {
            return Err(PlanError::at(
                line,
                format!(
                    "with several sources the destination must be a directory ending in /: {dest}/"
                ),
            ));
        }
        Ok(Step::Copy {
            context: None,
            sources: paths,
            dest: resolve(&state.workdir, &dest),
            chown,
            chmod,
            unpack_archives,
        })
    }

    /// The instruction's text from its keyword to the end of its line(s),
    /// on one line and shortened.
    fn text_of(&self, start: usize) -> String {
        let rest = &self.text[start..];
        let mut text = String::new();
        for part in rest.lines() {
            let part = part.trim();
            let continued = part.ends_with(self.escape);
            text.push_str(part.trim_end_matches(self.escape).trim_end());
            if !continued {
                break;
            }
            text.push(' ');
        }
        crate::shorten(text)
    }
}

/// Planning's running state through a stage (and the stages it continues).
struct State {
    steps: Vec<Located>,
    warnings: Vec<String>,
    /// The image's environment so far (the base's, then `ENV`s).
    env: Vars,
    /// The stage's `ARG`s with values.
    args: Vars,
    /// Build arguments some `ARG` declared.
    consumed: std::collections::BTreeSet<String>,
    workdir: String,
    shell: Vec<String>,
}

impl State {
    fn new(base: &BaseConfig) -> Self {
        Self {
            steps: Vec::new(),
            warnings: Vec::new(),
            env: base.env.iter().cloned().collect(),
            args: Vars::new(),
            consumed: Default::default(),
            workdir: base
                .working_dir
                .clone()
                .filter(|w| w.starts_with('/'))
                .unwrap_or_else(|| "/".to_owned()),
            shell: vec!["/bin/sh".to_owned(), "-c".to_owned()],
        }
    }

    /// What substitution reads: the arguments, overridden by the
    /// environment (an `ENV` wins over an `ARG` of the same name).
    fn vars(&self) -> Vars {
        let mut vars = self.args.clone();
        vars.extend(self.env.iter().map(|(k, v)| (k.clone(), v.clone())));
        vars
    }

    fn shell_form(&self, command: &str) -> Vec<String> {
        let mut argv = self.shell.clone();
        argv.push(command.to_owned());
        argv
    }
}

fn keyword_start(instruction: &Instruction<'_>) -> usize {
    match instruction {
        Instruction::Add(i) => i.add.span.start,
        Instruction::Arg(i) => i.arg.span.start,
        Instruction::Cmd(i) => i.cmd.span.start,
        Instruction::Copy(i) => i.copy.span.start,
        Instruction::Entrypoint(i) => i.entrypoint.span.start,
        Instruction::Env(i) => i.env.span.start,
        Instruction::Expose(i) => i.expose.span.start,
        Instruction::From(i) => i.from.span.start,
        Instruction::Healthcheck(i) => i.healthcheck.span.start,
        Instruction::Label(i) => i.label.span.start,
        Instruction::Maintainer(i) => i.maintainer.span.start,
        Instruction::Onbuild(i) => i.onbuild.span.start,
        Instruction::Run(i) => i.run.span.start,
        Instruction::Shell(i) => i.shell.span.start,
        Instruction::Stopsignal(i) => i.stopsignal.span.start,
        Instruction::User(i) => i.user.span.start,
        Instruction::Volume(i) => i.volume.span.start,
        Instruction::Workdir(i) => i.workdir.span.start,
        _ => 0,
    }
}

fn word_error(line: usize, e: WordError) -> PlanError {
    PlanError::at(line, e.to_string())
}

/// A variable's name, as Docker takes it: anything but empty (names such
/// as `spring.profiles.active` or `node-version` are common).
fn check_name(name: &str, what: &str, line: usize) -> Result<(), PlanError> {
    if name.is_empty() || name.contains(['\0', '$']) {
        Err(PlanError::at(
            line,
            format!("{what} name {name:?} is empty or holds $ or a NUL byte"),
        ))
    } else {
        Ok(())
    }
}

/// The arguments every build has without declaring them, as Docker
/// defines them: the platform (always the host's: a build runs here), and
/// the proxy variables, which reach `RUN` when given without an `ARG`.
fn predefined() -> Vars {
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    };
    let mut vars = Vars::new();
    for side in ["TARGET", "BUILD"] {
        vars.insert(format!("{side}PLATFORM"), format!("linux/{arch}"));
        vars.insert(format!("{side}OS"), "linux".to_owned());
        vars.insert(format!("{side}ARCH"), arch.to_owned());
        vars.insert(format!("{side}VARIANT"), String::new());
    }
    vars
}

/// Build arguments that reach `RUN` without an `ARG` and are never
/// reported unused.
const PROXY_ARGS: [&str; 10] = [
    "HTTP_PROXY",
    "http_proxy",
    "HTTPS_PROXY",
    "https_proxy",
    "FTP_PROXY",
    "ftp_proxy",
    "NO_PROXY",
    "no_proxy",
    "ALL_PROXY",
    "all_proxy",
];

/// A shell-form command as Docker hands it to the shell: each escape at a
/// line's end (spaces and tabs after it allowed), its line break, and the
/// blank and comment lines that follow it inside the continuation are
/// removed, so the lines join into one.
fn join_continuations(text: &str, escape: char) -> String {
    let mut out = String::with_capacity(text.len());
    let mut lines = text.split('\n').peekable();
    while let Some(line) = lines.next() {
        let line = line.strip_suffix('\r').unwrap_or(line);
        let trimmed = line.trim_end_matches([' ', '\t']);
        match trimmed.strip_suffix(escape) {
            Some(joined) if lines.peek().is_some() => {
                out.push_str(joined);
                // Blank and comment lines inside a continuation are not
                // part of the command.
                while let Some(next) = lines.peek() {
                    let next = next.trim();
                    if next.is_empty() || next.starts_with('#') {
                        lines.next();
                    } else {
                        break;
                    }
                }
            }
            _ => {
                out.push_str(line);
                if lines.peek().is_some() {
                    out.push('\n');
                }
            }
        }
    }
    out
}

pub(crate) fn parse_mode(value: &str, line: usize) -> Result<u32, PlanError> {
    u32::from_str_radix(value, 8)
        .ok()
        .filter(|&m| {
            m <= 0o7777 && !value.is_empty() && value.bytes().all(|b| (b'0'..=b'7').contains(&b))
        })
        .ok_or_else(|| {
            PlanError::at(
                line,
                format!("--chmod={value}: give an octal mode such as 755"),
            )
        })
}

fn check_port(port: &str, line: usize) -> Result<(), PlanError> {
    let (range, proto) = port.split_once('/').unwrap_or((port, "tcp"));
    let number = |s: &str| s.parse::<u16>().ok().filter(|&p| p > 0);
    let range_ok = match range.split_once('-') {
        Some((a, b)) => matches!((number(a), number(b)), (Some(a), Some(b)) if a <= b),
        None => number(range).is_some(),
    };
    if range_ok && matches!(proto.to_ascii_lowercase().as_str(), "tcp" | "udp" | "sctp") {
        Ok(())
    } else {
        Err(PlanError::at(
            line,
            format!("EXPOSE {port}: give a port (1-65535) or a range, optionally with /tcp, /udp or /sctp"),
        ))
    }
}

/// A source path as a path inside the build context: a leading `/` is the
/// context's root (as Docker reads it), and it may not climb out.
pub(crate) fn context_path(path: &str, line: usize) -> Result<String, PlanError> {
    let mut parts: Vec<&str> = Vec::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                if parts.pop().is_none() {
                    return Err(PlanError::at(
                        line,
                        format!("{path}: a source outside the build context cannot be copied"),
                    ));
                }
            }
            part => parts.push(part),
        }
    }
    Ok(if parts.is_empty() {
        ".".to_owned()
    } else {
        parts.join("/")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan_of(text: &str) -> Result<Plan, PlanError> {
        plan(text, &Options::default(), &BaseConfig::default())
    }

    fn steps(text: &str) -> Vec<Step> {
        plan_of(text)
            .unwrap()
            .steps
            .into_iter()
            .map(|l| l.step)
            .collect()
    }

    fn sh(command: &str) -> Vec<String> {
        vec!["/bin/sh".into(), "-c".into(), command.into()]
    }

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_common_dockerfile() {
        let text = "# syntax=docker/dockerfile:1\nFROM python:3.12-slim\nWORKDIR /app\nCOPY requirements.txt .\nRUN pip install -r requirements.txt \\\n    && rm -rf /root/.cache\nCOPY --chown=app:app src/ ./src/\nENV PORT=8000 MODE=\"prod mode\"\nEXPOSE 8000\nUSER app\nCMD [\"python\", \"-m\", \"src\"]\n";
        let plan = plan_of(text).unwrap();
        assert_eq!(plan.base, "python:3.12-slim");
        let lines: Vec<usize> = plan.steps.iter().map(|l| l.line).collect();
        assert_eq!(lines, [3, 4, 5, 7, 8, 9, 10, 11]);
        assert_eq!(
            plan.steps[2].text,
            "RUN pip install -r requirements.txt && rm -rf /root/.cache"
        );
        let steps: Vec<Step> = plan.steps.into_iter().map(|l| l.step).collect();
        assert_eq!(steps[0], Step::Workdir("/app".into()));
        assert_eq!(
            steps[1],
            Step::Copy {
                context: None,
                sources: strings(&["requirements.txt"]),
                dest: "/app/".into(),
                chown: None,
                chmod: None,
                unpack_archives: false
            }
        );
        assert!(
            matches!(&steps[2], Step::Run { argv, env, .. } if argv[..2] == ["/bin/sh", "-c"] && env.is_empty())
        );
        assert!(
            matches!(&steps[3], Step::Copy { sources, dest, chown: Some(c), .. } if sources == &["src"] && dest == "/app/src/" && c == "app:app")
        );
        assert_eq!(
            steps[4],
            Step::Env(vec![
                ("PORT".into(), "8000".into()),
                ("MODE".into(), "prod mode".into())
            ])
        );
        assert_eq!(steps[5], Step::Expose(strings(&["8000"])));
        assert_eq!(steps[6], Step::User("app".into()));
        assert_eq!(steps[7], Step::Cmd(strings(&["python", "-m", "src"])));
    }

    #[test]
    fn arguments_and_variables() {
        let text = "ARG TAG=3.20\nFROM alpine:${TAG}\nARG TAG\nARG WHO=world\nENV GREETING=\"hello $WHO\" OLD=$GREETING\nRUN echo $GREETING\nWORKDIR /srv/$WHO\nENV legacy form with spaces\n";
        let mut options = Options::default();
        options.build_args.insert("WHO".into(), "you".into());
        options.build_args.insert("UNUSED".into(), "x".into());
        let base_config = BaseConfig {
            env: vec![("PATH".into(), "/usr/bin".into())],
            working_dir: None,
        };
        assert_eq!(base(text, &options).unwrap(), "alpine:3.20");
        let plan = plan(text, &options, &base_config).unwrap();
        let steps: Vec<Step> = plan.steps.into_iter().map(|l| l.step).collect();
        // ENV reads the values from before the instruction.
        assert_eq!(
            steps[0],
            Step::Env(vec![
                ("GREETING".into(), "hello you".into()),
                ("OLD".into(), "".into())
            ])
        );
        // Build arguments reach RUN as variables, not the image.
        assert_eq!(
            steps[1],
            Step::Run {
                argv: sh("echo $GREETING"),
                env: vec![("TAG".into(), "3.20".into()), ("WHO".into(), "you".into())],
                user: None,
            }
        );
        assert_eq!(steps[2], Step::Workdir("/srv/you".into()));
        assert_eq!(
            steps[3],
            Step::Env(vec![("legacy".into(), "form with spaces".into())])
        );
        assert_eq!(
            plan.warnings,
            ["build arguments not used by the Dockerfile: UNUSED"]
        );
    }

    #[test]
    fn the_base_environment_and_directory_are_read() {
        let base_config = BaseConfig {
            env: vec![("PATH".into(), "/usr/bin".into())],
            working_dir: Some("/home/user".into()),
        };
        let plan = plan(
            "FROM x\nENV PATH=$PATH:/opt/bin\nCOPY a b\n",
            &Options::default(),
            &base_config,
        )
        .unwrap();
        assert_eq!(
            plan.steps[0].step,
            Step::Env(vec![("PATH".into(), "/usr/bin:/opt/bin".into())])
        );
        assert!(matches!(&plan.steps[1].step, Step::Copy { dest, .. } if dest == "/home/user/b"));
    }

    #[test]
    fn shell_exec_forms_heredocs_and_shell() {
        let s = steps("FROM x\nSHELL [\"/bin/bash\", \"-o\", \"pipefail\", \"-c\"]\nRUN echo a | cat\nRUN [\"/bin/echo\", \"b\"]\nRUN <<EOF\necho one\necho two\nEOF\nENTRYPOINT exec server\n");
        assert_eq!(
            s[0],
            Step::Run {
                argv: strings(&["/bin/bash", "-o", "pipefail", "-c", "echo a | cat"]),
                env: vec![],
                user: None,
            }
        );
        assert_eq!(
            s[1],
            Step::Run {
                argv: strings(&["/bin/echo", "b"]),
                env: vec![],
                user: None,
            }
        );
        assert!(matches!(&s[2], Step::Run { argv, .. } if argv[4].contains("echo one\necho two")));
        assert_eq!(
            s[3],
            Step::Entrypoint(strings(&[
                "/bin/bash",
                "-o",
                "pipefail",
                "-c",
                "exec server"
            ]))
        );
        let s = steps("FROM x\nRUN <<EOF cat > /f\nhi\nEOF\nRUN true\n");
        assert!(
            matches!(&s[0], Step::Run { argv, .. } if argv[2] == "<<EOF cat > /f\nhi\nEOF"),
            "{s:?}"
        );
        assert_eq!(s.len(), 2);
    }

    #[test]
    fn stages_build_the_target_and_what_it_starts_from() {
        let text = "FROM alpine AS base\nRUN echo base\nFROM busybox AS other\nRUN echo other\nFROM base AS final\nRUN echo final\n";
        let plan = plan_of(text).unwrap();
        assert_eq!(plan.base, "alpine");
        let runs: Vec<usize> = plan.steps.iter().map(|l| l.line).collect();
        assert_eq!(runs, [2, 6]);
        let options = Options {
            target: Some("OTHER".into()),
            ..Default::default()
        };
        assert_eq!(base(text, &options).unwrap(), "busybox");
        let options = Options {
            target: Some("nope".into()),
            ..Default::default()
        };
        assert!(base(text, &options)
            .unwrap_err()
            .message
            .contains("no stage named"));
    }

    #[test]
    fn mistakes_name_their_line() {
        let cases = [
            ("RUN echo\n", Some(1), "FROM"),
            ("FROM x\nBOGUS y\n", Some(2), "parse"),
            (
                "FROM x\nRUN --mount=type=cache,target=/c make\n",
                Some(2),
                "RUN --mount",
            ),
            (
                "FROM x\nCOPY --from=builder /a /b\n",
                Some(2),
                "COPY --from",
            ),
            ("FROM x\nCOPY a b c\n", Some(2), "ending in /"),
            (
                "FROM x\nCOPY ../secret /s\n",
                Some(2),
                "outside the build context",
            ),
            ("FROM x\nADD https://example.com/f /f\n", Some(2), "URL"),
            ("FROM x\nCOPY --chmod=999 a /a\n", Some(2), "octal"),
            ("FROM x\nEXPOSE 70000\n", Some(2), "EXPOSE"),
            ("FROM x\nENV =b\n", Some(2), "empty"),
            ("", None, "FROM"),
            ("FROM a AS Build\nFROM b AS build\n", Some(2), "used twice"),
            (
                "FROM x\nRUN <<EOF\n#!/usr/bin/env python3\nprint(1)\nEOF\n",
                Some(2),
                "#!",
            ),
            ("FROM x\nCOPY --chmod=+755 a /a\n", Some(2), "octal"),
            ("FROM x\nLABEL justaword\n", Some(2), "name=value"),
            ("FROM x\n\nWORKDIR ${A:?set A}\n", Some(3), "set A"),
            ("FROM x\nONBUILD RUN x\n", Some(2), "ONBUILD"),
            ("FROM scratch\nCOPY a /a\n", Some(1), "scratch"),
        ];
        for (text, line, needle) in cases {
            let err = plan_of(text).unwrap_err();
            assert_eq!(err.line, line, "{text:?}: {err}");
            assert!(err.to_string().contains(needle), "{text:?}: {err}");
        }
    }

    #[test]
    fn what_docker_accepts_is_accepted() {
        let text = "ARG TAG=1\nFROM x:$TAG\nENV spring.profiles.active=prod V=env\nARG V=arg\nARG TARGETARCH\nARG MODE=640\nLABEL legacy label value\nEXPOSE 53/UDP\nCOPY --chmod=$MODE a /a\nRUN apt-get install -y \\\n    # the tools\n\n    curl \\  \n    jq\nCMD echo a \\\n  b\n";
        let mut options = Options::default();
        options.build_args.insert("TAG".into(), "2".into());
        options
            .build_args
            .insert("HTTP_PROXY".into(), "http://proxy:3128".into());
        assert_eq!(base(text, &options).unwrap(), "x:2");
        let plan = plan(text, &options, &BaseConfig::default()).unwrap();
        // Neither the global TAG nor the proxy is reported unused.
        assert!(plan.warnings.is_empty(), "{:?}", plan.warnings);
        let steps: Vec<Step> = plan.steps.into_iter().map(|l| l.step).collect();
        assert_eq!(
            steps[0],
            Step::Env(vec![
                ("spring.profiles.active".into(), "prod".into()),
                ("V".into(), "env".into())
            ])
        );
        assert_eq!(
            steps[1],
            Step::Label(vec![("legacy".into(), "label value".into())])
        );
        assert_eq!(steps[2], Step::Expose(strings(&["53/udp"])));
        assert!(
            matches!(
                &steps[3],
                Step::Copy {
                    chmod: Some(0o640),
                    ..
                }
            ),
            "{:?}",
            steps[3]
        );
        let arch = match std::env::consts::ARCH {
            "x86_64" => "amd64",
            "aarch64" => "arm64",
            other => other,
        };
        assert_eq!(
            steps[4],
            Step::Run {
                argv: sh("apt-get install -y     curl     jq"),
                // V is the ENV's (an ENV wins over an ARG); the proxy
                // comes without an ARG.
                env: vec![
                    ("HTTP_PROXY".into(), "http://proxy:3128".into()),
                    ("MODE".into(), "640".into()),
                    ("TARGETARCH".into(), arch.into()),
                ],
                user: None,
            }
        );
        assert_eq!(steps[5], Step::Cmd(sh("echo a   b")));
    }

    #[test]
    fn volumes_and_health_checks_are_warned_about() {
        let plan =
            plan_of("FROM x\nVOLUME /data\nHEALTHCHECK CMD true\nSTOPSIGNAL SIGTERM\n").unwrap();
        assert!(plan.steps.is_empty());
        assert_eq!(plan.warnings.len(), 3, "{:?}", plan.warnings);
    }

    #[test]
    fn sources_stay_in_the_context() {
        assert_eq!(context_path("/a/./b/../c", 1).unwrap(), "a/c");
        assert_eq!(context_path("./", 1).unwrap(), ".");
        assert!(context_path("a/../../b", 1).is_err());
    }

    proptest::proptest! {
        /// Any text is planned or refused, never a panic.
        #[test]
        fn any_text_is_planned_or_refused(body in "(?s).{0,200}") {
            let text = format!("FROM x\n{body}");
            let _ = plan_of(&text);
            let _ = plan_of(&body);
        }
    }
}
