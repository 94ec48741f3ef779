//! The Watch RPC: what changes below a directory of the work directory,
//! from inotify.
//!
//! The directory is resolved like every other path ([`open_beneath`]), and
//! the watch is added through `/proc/self/fd/N` of that descriptor, so it
//! is on the very directory that was checked, whatever is renamed or
//! replaced meanwhile. Subdirectories (when recursive) are opened from
//! their parent's descriptor with `O_NOFOLLOW`: a symlink is never watched
//! through. The read loop runs on a blocking thread and ends when the
//! client goes away (the stream's receiver is dropped), which closes the
//! inotify descriptor and with it every watch.

use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::Arc;

use runbox_agent_proto::pb::{WatchEvent, WatchKind, WatchRequest};
use rustix::fs::inotify::{self, CreateFlags, ReadFlags, WatchFlags};
use rustix::fs::{Mode, OFlags};
use rustix::io::Errno;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

use crate::confine::{open_beneath, FileError, WorkDir};
use crate::files::blocking;

/// The most directories one recursive watch follows; past it, an
/// `overflow` event says events may be missing.
pub const MAX_WATCHED_DIRS: usize = 4096;

/// Events buffered per call before the reader waits for the client.
const CAPACITY: usize = 256;

/// How often the reader checks whether the client is still there.
const POLL_MS: i32 = 250;

/// The response stream of one Watch call.
pub type WatchStream = ReceiverStream<Result<WatchEvent, Status>>;

/// What each watched directory is.
struct Watched {
    path: String,
    dir: OwnedFd,
}

struct Watcher {
    inotify: OwnedFd,
    dirs: HashMap<i32, Watched>,
    recursive: bool,
    overflowed: bool,
}

fn mask() -> WatchFlags {
    WatchFlags::CREATE
        | WatchFlags::DELETE
        | WatchFlags::CLOSE_WRITE
        | WatchFlags::MOVED_FROM
        | WatchFlags::MOVED_TO
        | WatchFlags::ONLYDIR
        | WatchFlags::EXCL_UNLINK
}

fn join(base: &str, name: &str) -> String {
    if base.is_empty() {
        name.to_owned()
    } else {
        format!("{base}/{name}")
    }
}

impl Watcher {
    /// Watches `dir` (at `path`) and, when recursive, the directories in it.
    fn add(&mut self, dir: OwnedFd, path: String) -> Result<(), Errno> {
        if self.dirs.len() >= MAX_WATCHED_DIRS {
            self.overflowed = true;
            return Ok(());
        }
        let proc_path = format!("/proc/self/fd/{}", dir.as_raw_fd());
        let wd = inotify::add_watch(&self.inotify, proc_path.as_str(), mask())?;
        let subdirs = if self.recursive {
            subdirectories(&dir)?
        } else {
            Vec::new()
        };
        self.dirs.insert(
            wd,
            Watched {
                path: path.clone(),
                dir,
            },
        );
        for name in subdirs {
            if let Some(sub) = open_subdir(&self.dirs[&wd].dir, &name) {
                self.add(sub, join(&path, &name))?;
            }
        }
        Ok(())
    }
}

/// Names of the directories in `dir` (not symlinks to them).
fn subdirectories(dir: &OwnedFd) -> Result<Vec<String>, Errno> {
    let mut out = Vec::new();
    let listing = rustix::fs::openat(dir, ".", OFlags::RDONLY | OFlags::DIRECTORY, Mode::empty())?;
    for entry in rustix::fs::Dir::read_from(&listing)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name != "." && name != ".." && entry.file_type() == rustix::fs::FileType::Directory {
            out.push(name);
        }
    }
    Ok(out)
}

/// Opens directory `name` of `dir`, refusing a symlink.
fn open_subdir(dir: &OwnedFd, name: &str) -> Option<OwnedFd> {
    rustix::fs::openat(
        dir,
        name,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW,
        Mode::empty(),
    )
    .ok()
}

/// Runs one Watch call.
pub async fn watch(work: Arc<WorkDir>, req: WatchRequest) -> Result<WatchStream, Status> {
    let rel = work.parse_or_root(&req.path)?;
    let recursive = req.recursive;
    let watcher = blocking(move || -> Result<Watcher, FileError> {
        let root = work.open()?;
        let (path, original) = match &rel {
            None => (".".to_owned(), String::new()),
            Some(rel) => (rel.normalized(), rel.normalized()),
        };
        let dir = open_beneath(
            &root,
            &path,
            OFlags::PATH | OFlags::DIRECTORY,
            Mode::empty(),
        )
        .map_err(|errno| match errno {
            Errno::NOTDIR => FileError::NotADirectory {
                path: original.clone(),
                target: original.clone(),
            },
            other => FileError::from_errno(other, "watch", &path),
        })?;
        let inotify = inotify::init(CreateFlags::CLOEXEC | CreateFlags::NONBLOCK)
            .map_err(|e| FileError::from_errno(e, "watch", &path))?;
        let mut watcher = Watcher {
            inotify,
            dirs: HashMap::new(),
            recursive,
            overflowed: false,
        };
        watcher
            .add(dir, original)
            .map_err(|e| FileError::from_errno(e, "watch", &path))?;
        Ok(watcher)
    })
    .await??;
    let (tx, rx) = mpsc::channel(CAPACITY);
    let ready = event(WatchKind::Ready, String::new(), String::new(), true);
    let _ = tx.try_send(Ok(ready));
    tokio::task::spawn_blocking(move || pump(watcher, tx));
    Ok(ReceiverStream::new(rx))
}

fn event(kind: WatchKind, path: String, from: String, is_dir: bool) -> WatchEvent {
    WatchEvent {
        kind: kind as i32,
        path,
        from,
        is_dir,
    }
}

/// Reads inotify until the client goes away.
fn pump(mut w: Watcher, tx: mpsc::Sender<Result<WatchEvent, Status>>) {
    let mut buf = vec![MaybeUninit::<u8>::uninit(); 64 << 10];
    if w.overflowed {
        let _ = tx.blocking_send(Ok(event(
            WatchKind::Overflow,
            String::new(),
            String::new(),
            false,
        )));
        w.overflowed = false;
    }
    loop {
        if tx.is_closed() {
            return;
        }
        let mut fds = [rustix::event::PollFd::new(
            &w.inotify,
            rustix::event::PollFlags::IN,
        )];
        let timeout = rustix::event::Timespec {
            tv_sec: 0,
            tv_nsec: i64::from(POLL_MS) * 1_000_000,
        };
        match rustix::event::poll(&mut fds, Some(&timeout)) {
            Ok(0) | Err(Errno::INTR) => continue,
            Ok(_) => {}
            Err(_) => return,
        }
        let mut out = Vec::new();
        // Renames come as MOVED_FROM then MOVED_TO with one cookie.
        let mut moved_from: HashMap<u32, (String, bool)> = HashMap::new();
        let mut new_dirs = Vec::new();
        {
            let mut reader = inotify::Reader::new(w.inotify.as_fd(), &mut buf);
            loop {
                let ev = match reader.next() {
                    Ok(ev) => ev,
                    Err(Errno::AGAIN | Errno::INTR) => break,
                    Err(_) => return,
                };
                let flags = ev.events();
                if flags.contains(ReadFlags::QUEUE_OVERFLOW) {
                    out.push(event(
                        WatchKind::Overflow,
                        String::new(),
                        String::new(),
                        false,
                    ));
                    continue;
                }
                if flags.contains(ReadFlags::IGNORED) {
                    w.dirs.remove(&ev.wd());
                    continue;
                }
                let (Some(base), Some(name)) = (w.dirs.get(&ev.wd()), ev.file_name()) else {
                    continue;
                };
                let name = name.to_string_lossy().into_owned();
                let path = join(&base.path, &name);
                let is_dir = flags.contains(ReadFlags::ISDIR);
                if flags.contains(ReadFlags::CREATE) {
                    if is_dir && w.recursive {
                        new_dirs.push((ev.wd(), name.clone(), path.clone()));
                    }
                    out.push(event(WatchKind::Created, path, String::new(), is_dir));
                } else if flags.contains(ReadFlags::CLOSE_WRITE) {
                    out.push(event(WatchKind::Written, path, String::new(), false));
                } else if flags.contains(ReadFlags::DELETE) {
                    out.push(event(WatchKind::Removed, path, String::new(), is_dir));
                } else if flags.contains(ReadFlags::MOVED_FROM) {
                    moved_from.insert(ev.cookie(), (path, is_dir));
                } else if flags.contains(ReadFlags::MOVED_TO) {
                    match moved_from.remove(&ev.cookie()) {
                        Some((from, _)) => {
                            out.push(event(WatchKind::Renamed, path.clone(), from, is_dir))
                        }
                        None => out.push(event(
                            WatchKind::Created,
                            path.clone(),
                            String::new(),
                            is_dir,
                        )),
                    }
                    if is_dir && w.recursive {
                        new_dirs.push((ev.wd(), name.clone(), path));
                    }
                }
                if reader.is_buffer_empty() {
                    break;
                }
            }
        }
        // Moved out of the watched tree: gone from the client's view.
        for (_, (from, is_dir)) in moved_from {
            out.push(event(WatchKind::Removed, from, String::new(), is_dir));
        }
        for (wd, name, path) in new_dirs {
            let sub = w
                .dirs
                .get(&wd)
                .and_then(|parent| open_subdir(&parent.dir, &name));
            if let Some(sub) = sub {
                if w.add(sub, path).is_err() {
                    w.overflowed = true;
                }
            }
        }
        if std::mem::take(&mut w.overflowed) {
            out.push(event(
                WatchKind::Overflow,
                String::new(),
                String::new(),
                false,
            ));
        }
        for ev in out {
            if tx.blocking_send(Ok(ev)).is_err() {
                return;
            }
        }
    }
}
