//! `runbox cp`: copies one file between the local machine and a run's
//! `/work` or a volume, streaming both ways.
//!
//! One side is remote, written `ID:PATH` for a run: `PATH` is `/work/...`
//! or relative to `/work`; or `volume:NAME:PATH` for a volume, `PATH` from
//! the volume's top. A path that names a directory (`ID:`, `ID:/work/`,
//! `ID:out/`, `volume:data:/`) takes the local file's name. The other side
//! is a local path, or `-` for stdin / stdout.
//!
//! A download goes to a hidden temporary file next to the destination and is
//! renamed over it only once complete, so a failed or interrupted copy never
//! leaves a truncated file under the real name.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{anyhow, bail, Context as _};
use clap::Args;
use runbox_client::{LeaseCredential, UploadBody};

use crate::args::LeaseOpts;
use crate::connect::{Conn, ConnectOpts};

/// `runbox cp`.
#[derive(Debug, Args)]
#[command(after_help = "Examples:\n  \
    runbox cp ./input.csv 01J9Z...:/work/data/\n  \
    runbox cp 01J9Z...:out/report.pdf .\n  \
    tar cz src | runbox cp - 01J9Z...:src.tgz\n  \
    runbox cp ./corpus.jsonl volume:data:/seed/")]
pub struct CpArgs {
    /// Source: a local file, `-` for stdin, ID:PATH in a run, or
    /// volume:NAME:PATH in a volume
    pub src: String,
    /// Destination: a local file or directory, `-` for stdout, ID:PATH in a
    /// run, or volume:NAME:PATH in a volume (written when no run mounts it)
    pub dst: String,
    /// Needed for uploads while a lease is active (downloads are always open)
    #[command(flatten)]
    pub lease: LeaseOpts,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// One side of a copy.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Side {
    /// A local path.
    Local(PathBuf),
    /// `-`: stdin as a source, stdout as a destination.
    Stdio,
    /// A path in a run.
    Remote(Remote),
}

/// A path in a run's `/work`, or in a volume.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Remote {
    /// The run's id, or the volume's name.
    id: String,
    /// `id` names a volume.
    volume: bool,
    /// Relative to `/work`, normalised (no empty or `.` segments); empty when
    /// it names `/work` itself.
    path: String,
    /// The path was written as a directory (trailing `/`, `.` or empty).
    dir: bool,
}

impl Remote {
    /// `path` on this side, as the user would write it.
    fn shown(&self, path: &str) -> String {
        match self.volume {
            true => format!("{VOLUME_PREFIX}{}:/{path}", self.id),
            false => format!("{}:/work/{path}", self.id),
        }
    }
}

/// What `runbox cp SRC DST` does.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Transfer {
    Upload { from: Side, to: Remote },
    Download { from: Remote, to: Side },
}

/// Runs `runbox cp`.
pub async fn run(args: CpArgs) -> anyhow::Result<ExitCode> {
    // Parse before connecting, so that a mistyped command line is reported
    // as such and not as a missing token.
    let transfer = plan(&args.src, &args.dst)?;
    let conn = args.conn.connect()?;
    match transfer {
        Transfer::Upload { from, to } => {
            upload(&conn, from, to, args.lease.credential().as_ref()).await?
        }
        Transfer::Download { from, to } => download(&conn, from, to).await?,
    }
    Ok(ExitCode::SUCCESS)
}

fn plan(src: &str, dst: &str) -> anyhow::Result<Transfer> {
    match (parse_side(src)?, parse_side(dst)?) {
        (Side::Remote(_), Side::Remote(_)) => {
            bail!("both sides of cp are in a run; copy through a local file instead")
        }
        (Side::Remote(from), to) => {
            if from.dir {
                bail!("the source {src:?} names a directory; cp copies single files")
            }
            Ok(Transfer::Download { from, to })
        }
        (from, Side::Remote(to)) => Ok(Transfer::Upload { from, to }),
        _ => bail!(
            "one side of cp must be in a run, written ID:/work/PATH or ID:PATH \
             (got {src:?} and {dst:?}; write a local path containing `:` as ./NAME)"
        ),
    }
}

/// `-` is stdio; `X:Y` is remote when `X` is non-empty and has no `/` (so
/// `./a:b` and `/tmp/a:b` stay local); anything else is a local path.
fn parse_side(arg: &str) -> anyhow::Result<Side> {
    if arg == "-" {
        return Ok(Side::Stdio);
    }
    if let Some(rest) = arg.strip_prefix(VOLUME_PREFIX) {
        let (name, path) = rest
            .split_once(':')
            .filter(|(name, _)| !name.is_empty())
            .ok_or_else(|| anyhow!("write a volume side as volume:NAME:PATH (got {arg:?})"))?;
        let (path, dir) = normalised(path, path, "the volume")?;
        return Ok(Side::Remote(Remote {
            id: name.to_owned(),
            volume: true,
            path,
            dir,
        }));
    }
    match arg.split_once(':') {
        Some((id, path)) if !id.is_empty() && !id.contains('/') => {
            let (path, dir) = remote_path(path)?;
            Ok(Side::Remote(Remote {
                id: id.to_owned(),
                volume: false,
                path,
                dir,
            }))
        }
        _ if arg.is_empty() => bail!("an empty path is not a file"),
        _ => Ok(Side::Local(PathBuf::from(arg))),
    }
}

/// Confines a remote path to `/work` and normalises it; returns the path
/// relative to `/work` and whether it was written as a directory.
pub(crate) fn remote_path(raw: &str) -> anyhow::Result<(String, bool)> {
    let relative = match raw.strip_prefix('/') {
        None => raw,
        Some(absolute) => match absolute.strip_prefix("work") {
            Some(rest) if rest.is_empty() || rest.starts_with('/') => rest,
            _ => bail!("{raw} is outside /work; runbox copies files in /work only"),
        },
    };
    normalised(raw, relative, "/work")
}

/// The side that names a volume: `volume:NAME:PATH`.
const VOLUME_PREFIX: &str = "volume:";

/// `relative` (from the base: `/work`, or a volume's top) normalised, and
/// whether it was written as a directory; `raw` is what the user wrote.
fn normalised(raw: &str, relative: &str, base: &str) -> anyhow::Result<(String, bool)> {
    let mut parts = Vec::new();
    for part in relative.split('/') {
        match part {
            "" | "." => {}
            // The server refuses it too, but a path that climbs out
            // deserves the same clear message as one that starts outside.
            ".." => bail!("{raw} contains `..`; runbox copies files in {base} only"),
            part => parts.push(part),
        }
    }
    let dir =
        parts.is_empty() || relative.ends_with('/') || relative.ends_with("/.") || relative == ".";
    Ok((parts.join("/"), dir))
}

/// The last segment of a path, as a file name.
fn base_name(path: &Path) -> anyhow::Result<&str> {
    path.file_name()
        .and_then(|name| name.to_str())
        .ok_or_else(|| anyhow!("{} has no usable file name", path.display()))
}

async fn upload(
    conn: &Conn,
    from: Side,
    to: Remote,
    lease: Option<&LeaseCredential>,
) -> anyhow::Result<()> {
    let (body, name) = match &from {
        Side::Stdio => (UploadBody::from_reader(tokio::io::stdin(), None), None),
        Side::Local(path) => {
            let file = tokio::fs::File::open(path)
                .await
                .with_context(|| format!("cannot open {}", path.display()))?;
            let meta = file.metadata().await?;
            if meta.is_dir() {
                bail!(
                    "{} is a directory; cp copies single files (pack a directory with tar first)",
                    path.display()
                );
            }
            let body = UploadBody::from_file(file).await?;
            (body, Some(base_name(path)?))
        }
        Side::Remote(_) => unreachable!("plan never uploads from a run"),
    };
    let path = match (to.dir, name) {
        (false, _) => to.path.clone(),
        (true, Some(name)) if to.path.is_empty() => name.to_owned(),
        (true, Some(name)) => format!("{}/{name}", to.path),
        (true, None) => bail!(
            "name the file to write, e.g. {}",
            to.shown(if to.path.is_empty() {
                "input"
            } else {
                "…/input"
            })
        ),
    };
    let shown = to.shown(&path);
    if to.volume {
        if lease.is_some() {
            bail!("a volume has no lease; drop --owner and --generation");
        }
        let query = runbox_types::VolumeWriteQuery::default();
        return conn
            .check(
                conn.client
                    .put_volume_file(&to.id, &path, &query, body)
                    .await,
            )
            .map(drop)
            .with_context(|| format!("cannot upload to {shown}"));
    }
    conn.check(conn.client.put_file_as(&to.id, &path, lease, body).await)
        .with_context(|| format!("cannot upload to {shown}"))
}

async fn download(conn: &Conn, from: Remote, to: Side) -> anyhow::Result<()> {
    let context = || format!("cannot download {}", from.shown(&from.path));
    let get = || async {
        match from.volume {
            true => conn.client.get_volume_file(&from.id, &from.path).await,
            false => conn.client.get_file(&from.id, &from.path).await,
        }
    };
    match to {
        Side::Stdio => {
            let download = conn.check(get().await).with_context(context)?;
            let mut stdout = tokio::io::stdout();
            download.copy_to(&mut stdout).await.with_context(context)?;
        }
        Side::Local(dest) => {
            let dest = match tokio::fs::metadata(&dest).await {
                Ok(meta) if meta.is_dir() => {
                    // `plan` refuses directory sources, so there is a name.
                    let name = from.path.rsplit('/').next().unwrap_or(&from.path);
                    dest.join(name)
                }
                _ => dest,
            };
            let mut partial = PartialFile::create(&dest).await?;
            let copy = async {
                let download = conn.check(get().await).with_context(context)?;
                download
                    .copy_to(&mut partial.file)
                    .await
                    .with_context(context)?;
                anyhow::Ok(())
            };
            // On Ctrl-C, return (and remove the partial file) rather than die
            // with it on disk.
            tokio::select! {
                result = copy => result?,
                _ = tokio::signal::ctrl_c() => bail!("interrupted"),
            }
            partial.commit(&dest).await?;
        }
        Side::Remote(_) => unreachable!("plan never downloads into a run"),
    }
    Ok(())
}

/// A download in progress: a hidden file next to its destination, removed
/// when dropped unless committed.
struct PartialFile {
    path: PathBuf,
    file: tokio::fs::File,
    committed: bool,
}

impl PartialFile {
    async fn create(dest: &Path) -> anyhow::Result<PartialFile> {
        let name = base_name(dest)?;
        let dir = match dest.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent,
            _ => Path::new("."),
        };
        // create_new, so that two downloads (or an attacker's symlink in a
        // shared directory) never share a temporary file.
        for attempt in 0u32.. {
            let path = dir.join(format!(
                ".{name}.runbox-{}-{attempt}.part",
                std::process::id()
            ));
            let opened = tokio::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o666)
                .open(&path)
                .await;
            match opened {
                Ok(file) => {
                    return Ok(PartialFile {
                        path,
                        file,
                        committed: false,
                    })
                }
                Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists && attempt < 100 => {}
                Err(err) => {
                    return Err(err)
                        .with_context(|| format!("cannot create a file in {}", dir.display()))
                }
            }
        }
        unreachable!("the loop returns")
    }

    async fn commit(mut self, dest: &Path) -> anyhow::Result<()> {
        self.file
            .sync_all()
            .await
            .with_context(|| format!("cannot write {}", self.path.display()))?;
        tokio::fs::rename(&self.path, dest).await.with_context(|| {
            format!("cannot move the download into place at {}", dest.display())
        })?;
        self.committed = true;
        Ok(())
    }
}

impl Drop for PartialFile {
    fn drop(&mut self) {
        if !self.committed {
            // Best effort: there is nobody left to report a failure to.
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volume_sides_name_a_volume_and_a_path_from_its_top() {
        let side = parse_side("volume:data:/seed/a.csv").unwrap();
        let Side::Remote(remote) = side else {
            panic!("a volume side is remote")
        };
        assert_eq!(
            (
                remote.id.as_str(),
                remote.volume,
                remote.path.as_str(),
                remote.dir
            ),
            ("data", true, "seed/a.csv", false)
        );
        assert_eq!(remote.shown("x"), "volume:data:/x");
        let Side::Remote(top) = parse_side("volume:data:").unwrap() else {
            panic!("remote")
        };
        assert!(top.dir && top.path.is_empty());
        for bad in ["volume:", "volume::x", "volume:data", "volume:data:../x"] {
            assert!(parse_side(bad).is_err(), "{bad}");
        }
        assert!(matches!(
            plan("f", "volume:data:/in/").unwrap(),
            Transfer::Upload { .. }
        ));
    }

    fn remote(id: &str, path: &str, dir: bool) -> Remote {
        Remote {
            id: id.to_owned(),
            volume: false,
            path: path.to_owned(),
            dir,
        }
    }

    #[test]
    fn remote_paths_are_relative_to_work() {
        let cases = [
            ("ID:/work/a/b.txt", "a/b.txt", false),
            ("ID:a/b.txt", "a/b.txt", false),
            ("ID:/work//a/./b.txt", "a/b.txt", false),
            ("ID:/work/out/", "out", true),
            ("ID:/work", "", true),
            ("ID:/work/", "", true),
            ("ID:", "", true),
            ("ID:.", "", true),
            ("ID:workdir/x", "workdir/x", false),
        ];
        for (arg, path, dir) in cases {
            assert_eq!(
                parse_side(arg).unwrap(),
                Side::Remote(remote("ID", path, dir)),
                "{arg}"
            );
        }
    }

    #[test]
    fn remote_paths_outside_work_are_refused() {
        for arg in [
            "ID:/etc/passwd",
            "ID:/workdir/x",
            "ID:/",
            "ID:../x",
            "ID:/work/a/../../etc",
        ] {
            let err = parse_side(arg).unwrap_err().to_string();
            assert!(err.contains("/work only"), "{arg}: {err}");
        }
    }

    #[test]
    fn local_paths_and_stdio() {
        assert_eq!(parse_side("-").unwrap(), Side::Stdio);
        assert_eq!(parse_side("a.txt").unwrap(), Side::Local("a.txt".into()));
        assert_eq!(parse_side("./a:b").unwrap(), Side::Local("./a:b".into()));
        assert_eq!(
            parse_side("/tmp/a:b").unwrap(),
            Side::Local("/tmp/a:b".into())
        );
        assert!(parse_side("").is_err());
    }

    #[test]
    fn exactly_one_side_is_remote() {
        assert_eq!(
            plan("f", "ID:x").unwrap(),
            Transfer::Upload {
                from: Side::Local("f".into()),
                to: remote("ID", "x", false)
            }
        );
        assert_eq!(
            plan("ID:/work/x", "-").unwrap(),
            Transfer::Download {
                from: remote("ID", "x", false),
                to: Side::Stdio
            }
        );
        let err = plan("a", "b").unwrap_err().to_string();
        assert!(err.contains("ID:/work/PATH"), "{err}");
        assert!(plan("A:x", "B:y")
            .unwrap_err()
            .to_string()
            .contains("both sides"));
        assert!(plan("A:dir/", "here")
            .unwrap_err()
            .to_string()
            .contains("directory"));
    }

    #[tokio::test]
    async fn an_uncommitted_download_leaves_nothing_behind() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("out.bin");
        let partial = PartialFile::create(&dest).await.unwrap();
        assert!(partial.path.exists());
        drop(partial);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);

        let mut partial = PartialFile::create(&dest).await.unwrap();
        tokio::io::AsyncWriteExt::write_all(&mut partial.file, b"data")
            .await
            .unwrap();
        partial.commit(&dest).await.unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), b"data");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
