//! `runbox image build`: a Dockerfile built by the daemon, step by step.
//!
//! The context directory is archived (what `.dockerignore` excludes left
//! out) into a temporary file while it is hashed, uploaded under its digest,
//! and the build started with the Dockerfile's text; then the build's
//! events are followed: each step as it starts (a spinner while it runs),
//! its output as it comes. Ctrl-C cancels the build on the daemon (its run
//! is deleted, nothing is recorded) before exiting.

use std::collections::BTreeMap;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context as _;
use clap::Args;
use futures::StreamExt as _;
use runbox_client::{BuildUpdate, UploadBody};
use runbox_types::{BuildRequest, BuildStatus, BuildStepStatus};
use sha2::{Digest as _, Sha256};

use crate::connect::ConnectOpts;

/// `runbox image build`.
#[derive(Debug, Args)]
pub struct BuildArgs {
    /// The build context: the directory COPY and ADD read from
    #[arg(value_name = "CONTEXT")]
    pub context: PathBuf,
    /// The image to record (replaced if an earlier build made it)
    #[arg(short = 't', long = "tag", value_name = "NAME")]
    pub name: String,
    /// The Dockerfile [default: CONTEXT/Dockerfile]
    #[arg(short = 'f', long = "file", value_name = "FILE")]
    pub file: Option<PathBuf>,
    /// A build argument, NAME=VALUE (or NAME, taken from the environment)
    #[arg(long = "build-arg", value_name = "NAME[=VALUE]")]
    pub build_args: Vec<String>,
    /// The stage to build [default: the last]
    #[arg(long)]
    pub target: Option<String>,
    /// Run every step, even those a cached layer stands for
    #[arg(long)]
    pub no_cache: bool,
    /// Seconds the whole build may take [default: the daemon's, one hour]
    #[arg(long, value_name = "SECS")]
    pub timeout: Option<u64>,
    /// A label of the image, KEY=VALUE
    #[arg(long = "label", value_name = "KEY=VALUE")]
    pub labels: Vec<String>,
    /// Print only the image name at the end (and a failure's output)
    #[arg(short, long)]
    pub quiet: bool,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `NAME=VALUE` pairs; a bare `NAME` reads the environment when `from_env`.
fn pairs(items: &[String], what: &str, from_env: bool) -> anyhow::Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for item in items {
        match item.split_once('=') {
            Some((k, v)) if !k.is_empty() => {
                out.insert(k.to_owned(), v.to_owned());
            }
            None if from_env && !item.is_empty() => {
                if let Ok(v) = std::env::var(item) {
                    out.insert(item.clone(), v);
                }
            }
            _ => anyhow::bail!("{what} {item:?} is not NAME=VALUE"),
        }
    }
    Ok(out)
}

/// Archives `root` into a temporary file, leaving out what `.dockerignore`
/// excludes; returns the file and its digest (`sha256:<hex>`).
fn archive_context(root: &Path) -> anyhow::Result<(tempfile::NamedTempFile, String)> {
    let ignore_text = match std::fs::read_to_string(root.join(".dockerignore")) {
        Ok(text) => text,
        Err(e) if e.kind() == io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e).context("reading .dockerignore"),
    };
    let ignore = runbox_build::context::Ignore::parse(&ignore_text)
        .map_err(|e| anyhow::anyhow!(".dockerignore: {}", e.message))?;
    // A directory an exclusion covers is skipped whole unless a `!` line
    // might take something under it back.
    let negated = ignore_text.lines().any(|l| l.trim_start().starts_with('!'));
    let keep = |path: &Path, is_dir: bool| {
        let Some(rel) = path.to_str() else {
            return true;
        };
        if !ignore.excludes(rel) {
            return true;
        }
        is_dir && negated
    };
    let file =
        tempfile::NamedTempFile::new().context("creating a temporary file for the context")?;
    struct Hashing<W> {
        inner: W,
        hasher: Sha256,
    }
    impl<W: Write> Write for Hashing<W> {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            let n = self.inner.write(buf)?;
            self.hasher.update(&buf[..n]);
            Ok(n)
        }
        fn flush(&mut self) -> io::Result<()> {
            self.inner.flush()
        }
    }
    let out = Hashing {
        inner: io::BufWriter::new(
            file.as_file()
                .try_clone()
                .context("opening the context archive")?,
        ),
        hasher: Sha256::new(),
    };
    let mut out = crate::image::write_tree_tar_with(root, &keep, out)
        .with_context(|| format!("cannot archive {}", root.display()))?;
    out.flush().context("writing the context archive")?;
    let Hashing { inner, hasher } = out;
    drop(inner);
    let digest = format!("sha256:{:x}", hasher.finalize());
    Ok((file, digest))
}

/// Runs `runbox image build`.
pub async fn build(args: BuildArgs) -> anyhow::Result<ExitCode> {
    let context = &args.context;
    if !context.is_dir() {
        anyhow::bail!("the build context {} is not a directory", context.display());
    }
    let file = args
        .file
        .clone()
        .unwrap_or_else(|| context.join("Dockerfile"));
    let dockerfile = std::fs::read_to_string(&file)
        .with_context(|| format!("cannot read the Dockerfile {}", file.display()))?;
    let build_args = pairs(&args.build_args, "--build-arg", true)?;
    let labels = pairs(&args.labels, "--label", false)?;
    let conn = args.conn.connect()?;

    let root = context.clone();
    let (archive, digest) = tokio::task::spawn_blocking(move || archive_context(&root))
        .await
        .context("the archiving thread panicked")??;
    let upload = tokio::fs::File::open(archive.path())
        .await
        .context("reading the context archive")?;
    let body = UploadBody::from_file(upload)
        .await
        .context("reading the context archive")?;
    let stored = conn.check(conn.client.put_build_context(&digest, body).await)?;
    drop(archive);
    if !args.quiet {
        eprintln!(
            "context: {} entries, {} bytes ({})",
            stored.entries,
            stored.bytes,
            &digest[..19]
        );
    }
    let req = BuildRequest {
        name: args.name.clone(),
        dockerfile: Some(dockerfile),
        context: Some(digest),
        build_args: (!build_args.is_empty()).then_some(build_args),
        target: args.target.clone(),
        no_cache: args.no_cache,
        timeout_sec: args.timeout,
        labels: (!labels.is_empty()).then_some(labels),
        ..Default::default()
    };
    let build = conn.check(conn.client.start_build(&req).await)?;
    let id = build.id.to_string();
    let mut events = conn.check(conn.client.build_events(&id, 0).await)?;
    let spinner = if args.quiet {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new_spinner().with_style(
            indicatif::ProgressStyle::with_template("{spinner} {msg} {elapsed}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
        )
    };
    spinner.enable_steady_tick(std::time::Duration::from_millis(120));
    let total = std::cell::Cell::new(0usize);
    let say = |line: String| {
        if !args.quiet {
            spinner.suspend(|| eprintln!("{line}"));
        }
    };
    loop {
        let update = tokio::select! {
            update = events.next() => update,
            _ = tokio::signal::ctrl_c() => {
                spinner.finish_and_clear();
                eprintln!("runbox: cancelling build {id}");
                let _ = conn.client.cancel_build(&id).await;
                return Ok(ExitCode::from(130));
            }
        };
        let Some(update) = update else {
            anyhow::bail!("the build's event stream ended without a result");
        };
        match update.map_err(|e| conn.explain(e))? {
            BuildUpdate::Step(step) => {
                total.set(total.get().max(step.index));
                match step.status {
                    BuildStepStatus::Running => {
                        spinner.set_message(format!("[{}] {}", step.index, step.text));
                    }
                    BuildStepStatus::Done => say(format!(
                        "#{} done in {:.2} s",
                        step.index,
                        step.elapsed_ms.unwrap_or(0.0) / 1000.0
                    )),
                    _ => {}
                }
            }
            BuildUpdate::Log(line) => {
                let text = match (line.stream.as_str(), line.step) {
                    ("build", 0) => line.text,
                    ("build", step) => format!("#{step} {}", line.text),
                    (_, step) => format!("#{step}   {}", line.text),
                };
                say(text);
            }
            BuildUpdate::Done(build) => {
                spinner.finish_and_clear();
                return match build.status {
                    BuildStatus::Ready => {
                        println!("{}", build.name);
                        Ok(ExitCode::SUCCESS)
                    }
                    status => {
                        let error = build.error.unwrap_or(runbox_types::BuildFailure {
                            code: "unknown".into(),
                            message: format!("the build ended {status:?}"),
                            step: None,
                            exit_code: None,
                            output: Vec::new(),
                        });
                        if args.quiet && !error.output.is_empty() {
                            for line in &error.output {
                                eprintln!("  {line}");
                            }
                        }
                        eprintln!(
                            "runbox: build {id} failed: {} ({})",
                            error.message, error.code
                        );
                        Ok(ExitCode::FAILURE)
                    }
                };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_take_name_value_and_the_environment() {
        std::env::set_var("RUNBOX_TEST_BUILD_ARG", "from-env");
        let got = pairs(
            &["A=1".into(), "B=".into(), "RUNBOX_TEST_BUILD_ARG".into()],
            "--build-arg",
            true,
        )
        .unwrap();
        assert_eq!(got["A"], "1");
        assert_eq!(got["B"], "");
        assert_eq!(got["RUNBOX_TEST_BUILD_ARG"], "from-env");
        assert!(pairs(&["=x".into()], "--label", false).is_err());
        assert!(pairs(&["x".into()], "--label", false).is_err());
    }

    #[test]
    fn the_context_leaves_out_what_dockerignore_excludes() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join(".dockerignore"),
            "*.log\nbuild/\n!build/keep\n",
        )
        .unwrap();
        std::fs::write(dir.path().join("a.txt"), "a").unwrap();
        std::fs::write(dir.path().join("b.log"), "b").unwrap();
        std::fs::create_dir(dir.path().join("build")).unwrap();
        std::fs::write(dir.path().join("build/drop"), "x").unwrap();
        std::fs::write(dir.path().join("build/keep"), "y").unwrap();
        let (file, digest) = archive_context(dir.path()).unwrap();
        assert!(digest.starts_with("sha256:") && digest.len() == 71);
        let mut names: Vec<String> = tar::Archive::new(std::fs::File::open(file.path()).unwrap())
            .entries()
            .unwrap()
            .map(|e| e.unwrap().path().unwrap().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, [".dockerignore", "a.txt", "build", "build/keep"]);
        // The same tree gives the same archive: the daemon keeps one copy.
        let (_, again) = archive_context(dir.path()).unwrap();
        assert_eq!(digest, again);
    }
}
