//! A `COPY` step's files, chosen from the build context's archive.
//!
//! [`select`] reads a context archive that
//! [`check_archive`](crate::context::check_archive) has passed and writes a
//! new archive holding exactly what the step puts in the image, its names
//! relative to the one directory it is unpacked in
//! ([`Selection::dir`]). This module owns Docker's rules for which files a
//! `COPY` takes and where each lands. It does not unpack, create the
//! destination, apply `--chown` or `--chmod`, or touch a run: the caller
//! does, with the archive written here.
//!
//! How [`select`] works:
//!
//! 1. Index the context in one pass (file contents skipped by seeking): a
//!    tree of names, a later entry for a name replacing an earlier one as
//!    an unpacker would, directories the archive only implies made
//!    explicit. Only names and positions are kept, never contents.
//! 2. Hide what `.dockerignore` leaves out, keeping the directories above
//!    anything it takes back (`!pattern`).
//! 3. Resolve each source to the names it matches, and each to its names
//!    in the output: a directory's contents go into the destination, a
//!    file to `dest/<basename>` or to `dest` itself.
//! 4. Write the output in name order, hard links last (so their targets
//!    come first), each file's contents streamed from the context by
//!    seeking back to it.
//!
//! The output depends only on the context's final tree and the step, so
//! its digest can key a build cache.

use std::collections::{BTreeMap, HashMap};
use std::io::{self, Read, Seek, SeekFrom, Write};

use sha2::{Digest, Sha256};

use crate::context::{clean, is_pattern, source, Ignore};
use crate::PlanError;

/// What [`select`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    /// The absolute directory the archive is unpacked in (created by the
    /// unpacker with its parents): the destination, or its parent when a
    /// single file is copied to a new name.
    pub dir: String,
    /// Entries written, of every kind.
    pub entries: u64,
    /// Bytes of file contents written.
    pub bytes: u64,
    /// `sha256:<hex>` of the archive written, byte for byte.
    pub digest: String,
}

/// Why a `COPY` could not choose its files.
///
/// Everything but [`CopyError::Io`] is the build's own mistake (a client
/// error); `Io` is the daemon's trouble reading or writing.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    /// The step names no source.
    #[error("COPY needs a source")]
    NoSources,
    /// A named source is not in the context, or `.dockerignore` hides it.
    #[error(
        "COPY source {0:?} was not found in the build context (or .dockerignore leaves it out)"
    )]
    NotFound(String),
    /// A pattern matches nothing (BuildKit refuses this too).
    #[error("no file in the build context matches the COPY source {0:?} (or .dockerignore leaves them out)")]
    NoMatch(String),
    /// Several sources or a pattern, but a destination that is not a
    /// directory.
    #[error("when COPY has several sources or a pattern, the destination must be a directory and end with a /: {0}")]
    NotADirectory(String),
    /// A source pattern that cannot be read.
    #[error(transparent)]
    Pattern(#[from] PlanError),
    /// A context entry [`select`] cannot use; `why` says which rule.
    #[error("the build context's entry {path:?} {why}")]
    Entry {
        /// The entry's name as the archive gives it.
        path: String,
        /// The rule, in words.
        why: &'static str,
    },
    /// Reading the context or writing the output failed.
    #[error("reading the build context or writing the files to copy failed")]
    Io(#[from] io::Error),
}

impl CopyError {
    /// Whether the build is at fault (a client error) rather than the
    /// daemon's input or output.
    pub fn is_user_error(&self) -> bool {
        !matches!(self, CopyError::Io(_))
    }
}

/// Writes to `out` an uncompressed tar of what `COPY sources dest` puts in
/// the image, as Docker does it, names relative to [`Selection::dir`].
///
/// - `context` is the build context's uncompressed tar, already passed by
///   [`check_archive`](crate::context::check_archive); it is read from its
///   start, twice over: `Seek` lets the second pass fetch each file's
///   contents (and a hard link's, when its target is not copied) without
///   a temporary file.
/// - `ignore` (the context's `.dockerignore`) hides what it excludes as if
///   it were absent; `.dockerignore` and the Dockerfile are ordinary files.
/// - `sources` are relative to the context's root (`.` or `/` is the root);
///   one with `*`, `?` or `[...]` is a pattern matched part by part.
/// - `dest` is absolute (a relative one is taken from `/`); a trailing `/`
///   makes it a directory, as does `dest_is_dir` (the caller found one
///   there).
///
/// A directory source copies its contents into `dest`; a file (or a
/// symbolic link, never followed) goes to `dest/<basename>` when `dest` is
/// a directory, else becomes `dest` itself. Several sources or a pattern
/// need a directory `dest`. Modes and modification times are kept, owners
/// written as 0 (the unpacker sets them); symbolic links keep their
/// targets; a hard link stays one when its target is copied too, else
/// carries the contents. The same context and step give the same bytes.
pub fn select(
    mut context: impl Read + Seek,
    ignore: Option<&Ignore>,
    sources: &[String],
    dest: &str,
    dest_is_dir: bool,
    out: impl Write,
) -> Result<Selection, CopyError> {
    if sources.is_empty() {
        return Err(CopyError::NoSources);
    }
    let index = Index::read(&mut context)?;
    let view = index.visible(ignore);
    let (dir, names) = place(&view, sources, dest, dest_is_dir)?;
    let actions = plan(&index, &names)?;
    let (entries, bytes, digest) = write(&mut context, &actions, out)?;
    Ok(Selection {
        dir,
        entries,
        bytes,
        digest,
    })
}

/// Where a file's contents lie in the context archive, and its metadata
/// (shared by every hard link to it).
#[derive(Debug)]
struct Data {
    /// Where its header starts (a sparse file is read from here).
    header: u64,
    /// Where its contents start (any other file is read from here).
    file: u64,
    /// Its length once unpacked.
    size: u64,
    /// A GNU sparse file, whose stored bytes are not its contents.
    sparse: bool,
    mode: u32,
    mtime: u64,
}

/// What a name of the context is.
#[derive(Debug, Clone)]
enum Node {
    Dir {
        mode: u32,
        mtime: u64,
    },
    /// A file, its contents `Index::data[data]`; `linked` when this name
    /// reached them through a hard link entry.
    File {
        data: usize,
        linked: bool,
    },
    Symlink {
        target: Vec<u8>,
        mode: u32,
        mtime: u64,
    },
    /// A hard link to a name that was not a file when the link was read.
    BadLink,
}

/// The mode of a directory the archive implies without an entry of its
/// own (a tool that lists only files makes such archives).
const IMPLIED_DIR: Node = Node::Dir {
    mode: 0o755,
    mtime: 0,
};

/// The context's final tree: every name, relative and clean, with what it
/// is. Every parent of a name is a [`Node::Dir`] in it.
#[derive(Debug, Default)]
struct Index {
    nodes: BTreeMap<String, Node>,
    data: Vec<Data>,
}

impl Index {
    /// Step 1: reads the archive through once, seeking past contents.
    fn read<R: Read + Seek>(reader: &mut R) -> Result<Self, CopyError> {
        reader.seek(SeekFrom::Start(0))?;
        let mut index = Index::default();
        let mut archive = tar::Archive::new(&mut *reader);
        for entry in archive.entries_with_seek()? {
            let entry = entry?;
            let name = match std::str::from_utf8(&entry.path_bytes()) {
                Ok(name) => name.to_owned(),
                Err(_) => {
                    return Err(CopyError::Entry {
                        path: String::from_utf8_lossy(&entry.path_bytes()).into_owned(),
                        why: "has a name that is not UTF-8, which COPY cannot match",
                    })
                }
            };
            let damaged = |_| CopyError::Entry {
                path: name.clone(),
                why: "has a damaged header",
            };
            let header = entry.header();
            let mode = header.mode().map_err(damaged)? & 0o7777;
            let mtime = header.mtime().map_err(damaged)?;
            let path = clean(&name);
            use tar::EntryType as T;
            let node = match header.entry_type() {
                // The root's own entry (`./`) is the destination's, which
                // the unpacker makes.
                T::Directory if path.is_empty() => continue,
                T::Directory => Node::Dir { mode, mtime },
                kind @ (T::Regular | T::Continuous | T::GNUSparse) => {
                    index.data.push(Data {
                        header: entry.raw_header_position(),
                        file: entry.raw_file_position(),
                        size: entry.size(),
                        sparse: kind == T::GNUSparse,
                        mode,
                        mtime,
                    });
                    Node::File {
                        data: index.data.len() - 1,
                        linked: false,
                    }
                }
                T::Symlink => Node::Symlink {
                    target: entry.link_name_bytes().unwrap_or_default().into_owned(),
                    mode,
                    mtime,
                },
                // A hard link is the file its target is now (a later
                // entry for the target's name is another file).
                T::Link => {
                    let target = entry
                        .link_name_bytes()
                        .map(|t| clean(&String::from_utf8_lossy(&t)))
                        .unwrap_or_default();
                    match index.nodes.get(&target) {
                        Some(&Node::File { data, .. }) => Node::File { data, linked: true },
                        Some(link @ Node::Symlink { .. }) => link.clone(),
                        _ => Node::BadLink,
                    }
                }
                T::XGlobalHeader | T::XHeader | T::GNULongName | T::GNULongLink => continue,
                _ => {
                    return Err(CopyError::Entry {
                        path: name,
                        why: "is of a kind a build context cannot hold",
                    })
                }
            };
            if path.is_empty() {
                return Err(CopyError::Entry {
                    path: name,
                    why: "names the context's root but is not a directory",
                });
            }
            index.insert(path, node);
        }
        Ok(index)
    }

    /// Puts `node` at `path` as an unpacker that replaces what is in the
    /// way would: parents become directories, and a non-directory takes
    /// what was beneath its name away.
    fn insert(&mut self, path: String, node: Node) {
        for parent in parents(&path) {
            if !matches!(self.nodes.get(parent), Some(Node::Dir { .. })) {
                self.nodes.insert(parent.to_owned(), IMPLIED_DIR);
            }
        }
        if !matches!(node, Node::Dir { .. }) {
            let beneath: Vec<String> = beneath(&self.nodes, &path)
                .map(|(name, _)| name.clone())
                .collect();
            for name in beneath {
                self.nodes.remove(&name);
            }
        }
        self.nodes.insert(path, node);
    }

    /// Step 2: the names `ignore` leaves in, with the directories above
    /// each (an excluded directory is still walked into, as Docker does,
    /// when a `!pattern` takes something beneath it back).
    fn visible(&self, ignore: Option<&Ignore>) -> BTreeMap<&str, &Node> {
        let Some(ignore) = ignore else {
            return self.nodes.iter().map(|(k, v)| (k.as_str(), v)).collect();
        };
        let mut view = BTreeMap::new();
        for (path, node) in &self.nodes {
            if ignore.excludes(path) {
                continue;
            }
            view.insert(path.as_str(), node);
            for parent in parents(path) {
                if let Some((name, node)) = self.nodes.get_key_value(parent) {
                    view.insert(name.as_str(), node);
                }
            }
        }
        view
    }
}

/// Step 3: the destination directory and, for each output name, the
/// context name it comes from (a later source winning a name, as a later
/// copy overwrites an earlier one).
fn place<'a>(
    view: &BTreeMap<&'a str, &'a Node>,
    sources: &[String],
    dest: &str,
    dest_is_dir: bool,
) -> Result<(String, BTreeMap<String, &'a str>), CopyError> {
    let into_dir = crate::resolve("/", dest).ends_with('/') || dest_is_dir;
    let dest_path = crate::resolve_dir("/", dest);
    if (sources.len() > 1 || sources.iter().any(|s| is_pattern(s))) && !into_dir {
        return Err(CopyError::NotADirectory(dest.to_owned()));
    }
    let mut names = BTreeMap::new();
    let mut renamed = false;
    for source_text in sources {
        let matches: Vec<&'a str> = if is_pattern(source_text) {
            let matcher = source(source_text)?;
            let found: Vec<&'a str> = view
                .keys()
                .copied()
                .filter(|p| matcher.is_match(p))
                .collect();
            if found.is_empty() {
                return Err(CopyError::NoMatch(source_text.clone()));
            }
            found
        } else {
            let path = clean(source_text);
            if path.is_empty() {
                vec![""]
            } else {
                match view.get_key_value(path.as_str()) {
                    Some((&name, _)) => vec![name],
                    None => return Err(CopyError::NotFound(source_text.clone())),
                }
            }
        };
        for path in matches {
            match view.get(path) {
                // The root, or a directory: its contents.
                None | Some(Node::Dir { .. }) => {
                    let skip = if path.is_empty() { 0 } else { path.len() + 1 };
                    for (&name, node) in beneath(view, path) {
                        put(&mut names, name[skip..].to_owned(), name, node);
                    }
                }
                Some(node) => {
                    let name = if into_dir {
                        basename(path)
                    } else {
                        renamed = true;
                        basename(&dest_path)
                    };
                    put(&mut names, name.to_owned(), path, node);
                }
            }
        }
    }
    let dir = match renamed {
        true => crate::resolve_dir("/", &format!("{dest_path}/..")),
        false => dest_path,
    };
    Ok((dir, names))
}

/// Names `name` in the output after `path`; a non-directory takes away
/// what an earlier source put beneath the same name.
fn put<'a>(names: &mut BTreeMap<String, &'a str>, name: String, path: &'a str, node: &Node) {
    if !matches!(node, Node::Dir { .. }) {
        let beneath: Vec<String> = beneath(names, &name).map(|(n, _)| n.clone()).collect();
        for n in beneath {
            names.remove(&n);
        }
    }
    names.insert(name, path);
}

/// One entry to write.
#[derive(Debug)]
enum Action<'a> {
    Dir {
        mode: u32,
        mtime: u64,
    },
    File(&'a Data),
    Symlink {
        target: &'a [u8],
        mode: u32,
        mtime: u64,
    },
    HardLink {
        to: String,
        data: &'a Data,
    },
}

/// The entries to write, in order: every name's in name order (a parent
/// before its children), then the hard links (their targets written).
fn plan<'a>(
    index: &'a Index,
    names: &BTreeMap<String, &str>,
) -> Result<Vec<(String, Action<'a>)>, CopyError> {
    // Each file's contents are written once, at the name the context gave
    // them first (the hard link's target, when both are copied); its
    // other names become hard links to that one.
    let mut first: HashMap<usize, &str> = HashMap::new();
    for (name, path) in names {
        if let Some(&Node::File {
            data,
            linked: false,
        }) = index.nodes.get(*path)
        {
            first.entry(data).or_insert(name);
        }
    }
    let mut actions = Vec::with_capacity(names.len());
    let mut links = Vec::new();
    for (name, path) in names {
        let action = match &index.nodes[*path] {
            &Node::Dir { mode, mtime } => Action::Dir { mode, mtime },
            &Node::File {
                data,
                linked: false,
            } => Action::File(&index.data[data]),
            &Node::File { data, linked: true } => match first.get(&data) {
                Some(to) => {
                    links.push((
                        name.clone(),
                        Action::HardLink {
                            to: (*to).to_owned(),
                            data: &index.data[data],
                        },
                    ));
                    continue;
                }
                None => {
                    first.insert(data, name);
                    Action::File(&index.data[data])
                }
            },
            Node::Symlink {
                target,
                mode,
                mtime,
            } => Action::Symlink {
                target,
                mode: *mode,
                mtime: *mtime,
            },
            Node::BadLink => {
                return Err(CopyError::Entry {
                    path: (*path).to_owned(),
                    why: "is a hard link to a name that is not an earlier file of the context",
                })
            }
        };
        actions.push((name.clone(), action));
    }
    actions.extend(links);
    Ok(actions)
}

/// Step 4: writes `actions` as a tar to `out`; returns its entries, its
/// bytes of contents and its digest.
fn write<R: Read + Seek>(
    context: &mut R,
    actions: &[(String, Action<'_>)],
    out: impl Write,
) -> Result<(u64, u64, String), CopyError> {
    let mut builder = tar::Builder::new(Hashing {
        inner: out,
        hasher: Sha256::new(),
    });
    let mut bytes = 0u64;
    for (name, action) in actions {
        // Every field set here, nothing from the clock or the host: the
        // same actions give the same bytes.
        let mut header = tar::Header::new_gnu();
        header.set_uid(0);
        header.set_gid(0);
        header.set_size(0);
        use tar::EntryType as T;
        match action {
            Action::Dir { mode, mtime } => {
                header.set_entry_type(T::Directory);
                header.set_mode(*mode);
                header.set_mtime(*mtime);
                builder.append_data(&mut header, format!("{name}/"), io::empty())?;
            }
            Action::File(data) => {
                header.set_entry_type(T::Regular);
                header.set_mode(data.mode);
                header.set_mtime(data.mtime);
                header.set_size(data.size);
                append_file(&mut builder, context, &mut header, name, data)?;
                bytes += data.size;
            }
            Action::Symlink {
                target,
                mode,
                mtime,
            } => {
                header.set_entry_type(T::Symlink);
                header.set_mode(*mode);
                header.set_mtime(*mtime);
                link_name(&mut builder, &mut header, target)?;
                builder.append_data(&mut header, name, io::empty())?;
            }
            Action::HardLink { to, data } => {
                header.set_entry_type(T::Link);
                header.set_mode(data.mode);
                header.set_mtime(data.mtime);
                builder.append_link(&mut header, name, to)?;
            }
        }
    }
    let hashing = builder.into_inner()?;
    let mut inner = hashing.inner;
    inner.flush()?;
    let digest: String = hashing
        .hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    Ok((actions.len() as u64, bytes, format!("sha256:{digest}")))
}

/// Appends a file, its contents read from the context: straight from
/// their place for an ordinary file; through the tar reader from its header
/// for a sparse one (whose holes are not stored).
fn append_file<R: Read + Seek, W: Write>(
    builder: &mut tar::Builder<W>,
    context: &mut R,
    header: &mut tar::Header,
    name: &str,
    data: &Data,
) -> io::Result<()> {
    if !data.sparse {
        context.seek(SeekFrom::Start(data.file))?;
        let contents = Exact {
            inner: context.take(data.size),
            left: data.size,
        };
        return builder.append_data(header, name, contents);
    }
    context.seek(SeekFrom::Start(data.header))?;
    // Read from this entry's header on, the archive's first entry is this
    // one (a long name before it is left behind; the name is not needed).
    let mut archive = tar::Archive::new(context);
    let mut entries = archive.entries()?;
    let entry = entries
        .next()
        .ok_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, CHANGED))??;
    if entry.size() != data.size {
        return Err(io::Error::other(CHANGED));
    }
    let contents = Exact {
        inner: entry,
        left: data.size,
    };
    builder.append_data(header, name, contents)
}

/// Why a context that read well once no longer does.
const CHANGED: &str = "the build context changed after it was read";

/// `inner`, which must yield exactly `left` more bytes: the tar writer
/// pads by what it read, so a short read (the context changed after its
/// check) would write a damaged archive.
struct Exact<R> {
    inner: R,
    left: u64,
}

impl<R: Read> Read for Exact<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 {
            return Ok(0);
        }
        let max = buf
            .len()
            .min(usize::try_from(self.left).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..max])?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, CHANGED));
        }
        self.left -= n as u64;
        Ok(n)
    }
}

/// Sets a symbolic link's target byte for byte (the tar writer's own
/// setter would tidy it as a path), with a GNU long-link entry before the
/// header when it is longer than the header's field.
fn link_name<W: Write>(
    builder: &mut tar::Builder<W>,
    header: &mut tar::Header,
    target: &[u8],
) -> io::Result<()> {
    let field = &mut header
        .as_gnu_mut()
        .expect("new_gnu makes a GNU header")
        .linkname;
    if target.len() > field.len() {
        let mut long = tar::Header::new_gnu();
        long.as_gnu_mut().expect("a GNU header").name[..13].copy_from_slice(b"././@LongLink");
        long.set_mode(0o644);
        long.set_uid(0);
        long.set_gid(0);
        long.set_mtime(0);
        long.set_entry_type(tar::EntryType::GNULongLink);
        // NUL-terminated, as GNU tar writes it.
        long.set_size(target.len() as u64 + 1);
        long.set_cksum();
        builder.append(&long, target.chain(&[0u8][..]))?;
    }
    let n = target.len().min(field.len());
    field[..n].copy_from_slice(&target[..n]);
    Ok(())
}

/// A writer that hashes what it passes on.
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

/// The parents of a clean relative path, shortest first: `a`, `a/b` for
/// `a/b/c`.
fn parents(path: &str) -> impl Iterator<Item = &str> {
    path.match_indices('/').map(move |(at, _)| &path[..at])
}

/// A clean relative path's last part.
fn basename(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

/// The entries of `map` strictly beneath `path` (all of them for the root,
/// `""`), in name order.
fn beneath<'m, K: std::borrow::Borrow<str> + Ord, V>(
    map: &'m BTreeMap<K, V>,
    path: &str,
) -> impl Iterator<Item = (&'m K, &'m V)> + 'm {
    use std::ops::Bound;
    let (start, end) = if path.is_empty() {
        (Bound::Unbounded, Bound::Unbounded)
    } else {
        // Every name starting `path/` sorts from `path/` to before `path0`
        // (`0` follows `/`).
        (
            Bound::Included(format!("{path}/")),
            Bound::Excluded(format!("{path}0")),
        )
    };
    map.range::<str, _>((
        start.as_ref().map(String::as_str),
        end.as_ref().map(String::as_str),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;
    use tar::EntryType as T;

    /// A context entry: name, kind, mode, and contents or link target.
    type In<'a> = (&'a str, T, u32, &'a [u8]);

    /// A context tar of `entries`, each with its own mtime and a host's
    /// owner, as a client's tar would have.
    fn context(entries: &[In<'_>]) -> Vec<u8> {
        let mut builder = tar::Builder::new(Vec::new());
        for (i, (name, kind, mode, data)) in entries.iter().enumerate() {
            let mut header = tar::Header::new_gnu();
            header.set_entry_type(*kind);
            header.set_mode(*mode);
            header.set_mtime(1_000 + i as u64);
            header.set_uid(1000);
            header.set_gid(1000);
            header.set_username("alice").unwrap();
            if matches!(kind, T::Symlink | T::Link) {
                header.set_size(0);
                builder
                    .append_link(&mut header, name, std::str::from_utf8(data).unwrap())
                    .unwrap();
            } else {
                header.set_size(data.len() as u64);
                builder.append_data(&mut header, name, *data).unwrap();
            }
        }
        builder.into_inner().unwrap()
    }

    /// An entry of the output: name, kind, mode, and contents or link
    /// target.
    #[derive(Debug, PartialEq, Eq)]
    struct Out {
        name: String,
        kind: T,
        mode: u32,
        body: String,
    }

    fn out(name: &str, kind: T, mode: u32, body: &str) -> Out {
        Out {
            name: name.into(),
            kind,
            mode,
            body: body.into(),
        }
    }

    /// Reads an output archive back, checking the owner fields on the way.
    fn entries(archive: &[u8]) -> Vec<Out> {
        let mut archive = tar::Archive::new(archive);
        let mut outs = Vec::new();
        for entry in archive.entries().unwrap() {
            let mut entry = entry.unwrap();
            let header = entry.header();
            assert_eq!((header.uid().unwrap(), header.gid().unwrap()), (0, 0));
            assert_eq!(header.username_bytes(), Some(&b""[..]));
            assert_eq!(header.groupname_bytes(), Some(&b""[..]));
            let kind = header.entry_type();
            let mode = header.mode().unwrap();
            let name = String::from_utf8(entry.path_bytes().into_owned()).unwrap();
            let body = match entry.link_name_bytes() {
                Some(target) => String::from_utf8(target.into_owned()).unwrap(),
                None => {
                    let mut body = String::new();
                    entry.read_to_string(&mut body).unwrap();
                    body
                }
            };
            outs.push(Out {
                name,
                kind,
                mode,
                body,
            });
        }
        outs
    }

    fn run(
        context: &[u8],
        ignore: Option<&str>,
        sources: &[&str],
        dest: &str,
        dest_is_dir: bool,
    ) -> Result<(Selection, Vec<u8>), CopyError> {
        let ignore = ignore.map(|text| Ignore::parse(text).unwrap());
        let sources: Vec<String> = sources.iter().map(|s| s.to_string()).collect();
        let mut archive = Vec::new();
        let selection = select(
            Cursor::new(context),
            ignore.as_ref(),
            &sources,
            dest,
            dest_is_dir,
            &mut archive,
        )?;
        Ok((selection, archive))
    }

    /// The directory and entries of a `COPY` that must succeed.
    fn copy(context: &[u8], sources: &[&str], dest: &str) -> (String, Vec<Out>) {
        let (selection, archive) = run(context, None, sources, dest, false).unwrap();
        (selection.dir, entries(&archive))
    }

    fn app() -> Vec<u8> {
        context(&[
            ("Dockerfile", T::Regular, 0o644, b"FROM x\n"),
            ("src/", T::Directory, 0o750, b""),
            ("src/main.py", T::Regular, 0o755, b"print(1)\n"),
            ("src/lib/", T::Directory, 0o700, b""),
            ("src/lib/util.py", T::Regular, 0o600, b"x = 1\n"),
            ("README.md", T::Regular, 0o644, b"hi\n"),
        ])
    }

    #[test]
    fn a_directory_source_copies_its_contents_with_their_modes() {
        let (dir, outs) = copy(&app(), &["src"], "/app/");
        assert_eq!(dir, "/app");
        assert_eq!(
            outs,
            [
                out("lib/", T::Directory, 0o700, ""),
                out("lib/util.py", T::Regular, 0o600, "x = 1\n"),
                out("main.py", T::Regular, 0o755, "print(1)\n"),
            ]
        );
        // No trailing `/`: the directory's contents still go into dest.
        let (dir, again) = copy(&app(), &["./src/"], "/app");
        assert_eq!((dir.as_str(), again), ("/app", outs));
    }

    #[test]
    fn mtimes_are_kept() {
        let (selection, archive) = run(&app(), None, &["src/lib"], "/l", false).unwrap();
        assert_eq!(selection.entries, 1);
        let mut archive = tar::Archive::new(archive.as_slice());
        let entry = archive.entries().unwrap().next().unwrap().unwrap();
        assert_eq!(entry.header().mtime().unwrap(), 1_004);
    }

    #[test]
    fn the_root_copies_the_whole_context() {
        for root in [".", "./", "/"] {
            let (dir, outs) = copy(&app(), &[root], "/app");
            assert_eq!(dir, "/app");
            let names: Vec<&str> = outs.iter().map(|o| o.name.as_str()).collect();
            assert_eq!(
                names,
                [
                    "Dockerfile",
                    "README.md",
                    "src/",
                    "src/lib/",
                    "src/lib/util.py",
                    "src/main.py"
                ]
            );
        }
    }

    #[test]
    fn a_file_goes_into_a_directory_or_becomes_the_destination() {
        let main = |name: &str| vec![out(name, T::Regular, 0o755, "print(1)\n")];
        assert_eq!(
            copy(&app(), &["src/main.py"], "/app/"),
            ("/app".into(), main("main.py"))
        );
        assert_eq!(
            copy(&app(), &["src/main.py"], "/app/run.py"),
            ("/app".into(), main("run.py"))
        );
        assert_eq!(
            copy(&app(), &["src/main.py"], "/run.py"),
            ("/".into(), main("run.py"))
        );
        // The caller found a directory at /app.
        let (selection, archive) = run(&app(), None, &["src/main.py"], "/app", true).unwrap();
        assert_eq!(
            (selection.dir, entries(&archive)),
            ("/app".into(), main("main.py"))
        );
    }

    #[test]
    fn several_sources_or_a_pattern_need_a_directory() {
        for sources in [&["src/main.py", "README.md"][..], &["*.md"][..]] {
            let err = run(&app(), None, sources, "/app", false).unwrap_err();
            assert!(matches!(err, CopyError::NotADirectory(_)), "{err}");
            assert!(
                err.to_string()
                    .contains("the destination must be a directory and end with a /"),
                "{err}"
            );
            assert!(err.is_user_error());
            run(&app(), None, sources, "/app/", false).unwrap();
            run(&app(), None, sources, "/app", true).unwrap();
        }
        let (_, outs) = copy(&app(), &["src/main.py", "README.md"], "/app/");
        let names: Vec<&str> = outs.iter().map(|o| o.name.as_str()).collect();
        assert_eq!(names, ["README.md", "main.py"]);
    }

    #[test]
    fn patterns_match_part_by_part_and_each_match_is_as_if_named() {
        let (_, outs) = copy(&app(), &["src/*.py"], "/app/");
        assert_eq!(outs, [out("main.py", T::Regular, 0o755, "print(1)\n")]);
        // A matching directory: its contents.
        let (_, outs) = copy(&app(), &["s?c"], "/app/");
        assert_eq!(outs.len(), 3);
        assert_eq!(outs[0].name, "lib/");
        // Files matched at any depth land flat in dest.
        let (_, outs) = copy(&app(), &["*/*/*.py", "[RD]*"], "/app/");
        let names: Vec<&str> = outs.iter().map(|o| o.name.as_str()).collect();
        assert_eq!(names, ["Dockerfile", "README.md", "util.py"]);
    }

    #[test]
    fn missing_sources_and_empty_patterns_are_named() {
        let err = run(&app(), None, &["nope.txt"], "/app/", false).unwrap_err();
        assert!(
            matches!(&err, CopyError::NotFound(s) if s == "nope.txt"),
            "{err}"
        );
        assert!(err.to_string().contains("not found in the build context"));
        let err = run(&app(), None, &["src/*.rs"], "/app/", false).unwrap_err();
        assert!(
            matches!(&err, CopyError::NoMatch(s) if s == "src/*.rs"),
            "{err}"
        );
        // A file is no directory to look into.
        let err = run(&app(), None, &["README.md/x"], "/app/", false).unwrap_err();
        assert!(matches!(err, CopyError::NotFound(_)), "{err}");
        let err = run(&app(), None, &["[x"], "/app/", false).unwrap_err();
        assert!(matches!(err, CopyError::Pattern(_)) && err.is_user_error());
        let err = run(&app(), None, &[], "/app/", false).unwrap_err();
        assert!(matches!(err, CopyError::NoSources));
    }

    #[test]
    fn ignored_files_are_as_if_absent() {
        let tar = context(&[
            (
                ".dockerignore",
                T::Regular,
                0o644,
                b"*.log\nsecret\n!secret/keep\n",
            ),
            ("debug.log", T::Regular, 0o644, b"x"),
            ("secret/", T::Directory, 0o700, b""),
            ("secret/key", T::Regular, 0o600, b"k"),
            ("secret/keep", T::Regular, 0o644, b"kept"),
            ("a.txt", T::Regular, 0o644, b"a"),
        ]);
        let ignore = Some("*.log\nsecret\n!secret/keep\n");
        let (_, archive) = run(&tar, ignore, &["."], "/app/", false).unwrap();
        let names: Vec<String> = entries(&archive).into_iter().map(|o| o.name).collect();
        // The directory above a file taken back stays, with its mode.
        assert_eq!(names, [".dockerignore", "a.txt", "secret/", "secret/keep"]);
        for (source, want) in [("debug.log", "debug.log"), ("secret/key", "secret/key")] {
            let err = run(&tar, ignore, &[source], "/app/", false).unwrap_err();
            assert!(matches!(&err, CopyError::NotFound(s) if s == want), "{err}");
        }
        let err = run(&tar, ignore, &["*.log"], "/app/", false).unwrap_err();
        assert!(matches!(err, CopyError::NoMatch(_)), "{err}");
        let (_, archive) = run(&tar, ignore, &["secret"], "/s/", false).unwrap();
        assert_eq!(entries(&archive), [out("keep", T::Regular, 0o644, "kept")]);
    }

    #[test]
    fn symbolic_links_are_copied_as_links() {
        let long = format!("../{}/target", "x".repeat(150));
        let tar = context(&[
            ("d/", T::Directory, 0o755, b""),
            ("d/link", T::Symlink, 0o777, b"/etc/passwd"),
            ("d/long", T::Symlink, 0o777, long.as_bytes()),
            ("top", T::Symlink, 0o777, b"d"),
        ]);
        let (_, outs) = copy(&tar, &["d"], "/x/");
        assert_eq!(
            outs,
            [
                out("link", T::Symlink, 0o777, "/etc/passwd"),
                out("long", T::Symlink, 0o777, &long),
            ]
        );
        // Named, a link is copied, not followed.
        let (dir, outs) = copy(&tar, &["top"], "/x/y");
        assert_eq!(dir, "/x");
        assert_eq!(outs, [out("y", T::Symlink, 0o777, "d")]);
    }

    #[test]
    fn hard_links_stay_links_only_to_what_is_copied() {
        let tar = context(&[
            ("data/", T::Directory, 0o755, b""),
            ("data/file", T::Regular, 0o640, b"shared"),
            ("data/same", T::Link, 0o640, b"data/file"),
            ("other/", T::Directory, 0o755, b""),
            ("other/a", T::Link, 0o640, b"data/file"),
            ("other/b", T::Link, 0o640, b"data/file"),
        ]);
        let (_, outs) = copy(&tar, &["data"], "/d/");
        assert_eq!(
            outs,
            [
                out("file", T::Regular, 0o640, "shared"),
                out("same", T::Link, 0o640, "file"),
            ]
        );
        // The target left behind: the first link carries the contents, the
        // second stays a link to it.
        let (_, outs) = copy(&tar, &["other"], "/o/");
        assert_eq!(
            outs,
            [
                out("a", T::Regular, 0o640, "shared"),
                out("b", T::Link, 0o640, "a"),
            ]
        );
        let (_, outs) = copy(&tar, &["data/same"], "/s");
        assert_eq!(outs, [out("s", T::Regular, 0o640, "shared")]);
        // A link whose target sorts after it still comes after it.
        let (_, outs) = copy(&tar, &["other/a", "data/file"], "/m/");
        assert_eq!(
            outs,
            [
                out("file", T::Regular, 0o640, "shared"),
                out("a", T::Link, 0o640, "file"),
            ]
        );
    }

    #[test]
    fn a_hard_link_to_nothing_fails_only_when_copied() {
        let tar = context(&[
            ("ok", T::Regular, 0o644, b"1"),
            ("bad", T::Link, 0o644, b"missing"),
        ]);
        copy(&tar, &["ok"], "/x/");
        let err = run(&tar, None, &["."], "/x/", false).unwrap_err();
        assert!(
            matches!(&err, CopyError::Entry { path, .. } if path == "bad"),
            "{err}"
        );
        assert!(err.is_user_error());
    }

    #[test]
    fn implied_directories_and_later_entries() {
        // No directory entries; `f` written twice; `g` a file, then a
        // directory, then a file again.
        let tar = context(&[
            ("a/b/c.txt", T::Regular, 0o644, b"c"),
            ("f", T::Regular, 0o644, b"old"),
            ("f", T::Regular, 0o600, b"new"),
            ("g", T::Regular, 0o644, b"file"),
            ("g/h", T::Regular, 0o644, b"h"),
            ("g", T::Regular, 0o644, b"again"),
        ]);
        let (_, outs) = copy(&tar, &["a"], "/x/");
        assert_eq!(
            outs,
            [
                out("b/", T::Directory, 0o755, ""),
                out("b/c.txt", T::Regular, 0o644, "c"),
            ]
        );
        assert_eq!(
            copy(&tar, &["f"], "/f").1,
            [out("f", T::Regular, 0o600, "new")]
        );
        let (_, outs) = copy(&tar, &["."], "/x/");
        let names: Vec<&str> = outs.iter().map(|o| o.name.as_str()).collect();
        assert_eq!(names, ["a/", "a/b/", "a/b/c.txt", "f", "g"]);
    }

    #[test]
    fn a_later_source_wins_a_name() {
        let tar = context(&[
            ("one/x", T::Regular, 0o644, b"dir one"),
            ("two/x/", T::Directory, 0o755, b""),
            ("two/x/y", T::Regular, 0o644, b"y"),
            ("x", T::Regular, 0o644, b"top"),
        ]);
        let (_, outs) = copy(&tar, &["two", "x"], "/d/");
        assert_eq!(outs, [out("x", T::Regular, 0o644, "top")]);
        let (_, outs) = copy(&tar, &["x", "two"], "/d/");
        let names: Vec<&str> = outs.iter().map(|o| o.name.as_str()).collect();
        assert_eq!(names, ["x/", "x/y"]);
    }

    #[test]
    fn long_names_survive() {
        let name = format!("deep/{}/file.txt", "d".repeat(120));
        let tar = context(&[(name.as_str(), T::Regular, 0o644, b"deep")]);
        let (_, outs) = copy(&tar, &["deep"], "/x/");
        assert_eq!(outs[1].name, name["deep/".len()..]);
        assert_eq!(outs[1].body, "deep");
    }

    #[test]
    fn sparse_files_are_written_whole() {
        // A GNU sparse entry by hand: 12 bytes, "hello" stored at 4.
        fn octal(field: &mut [u8], value: u64) {
            let text = format!("{value:0width$o}\0", width = field.len() - 1);
            field.copy_from_slice(text.as_bytes());
        }
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(T::GNUSparse);
        header.set_path("holes").unwrap();
        header.set_mode(0o644);
        header.set_size(5);
        let gnu = header.as_gnu_mut().unwrap();
        octal(&mut gnu.sparse[0].offset, 4);
        octal(&mut gnu.sparse[0].numbytes, 5);
        // GNU tar ends the map with an empty chunk at the end of the file.
        octal(&mut gnu.sparse[1].offset, 12);
        octal(&mut gnu.sparse[1].numbytes, 0);
        octal(&mut gnu.realsize, 12);
        header.set_cksum();
        let mut builder = tar::Builder::new(Vec::new());
        builder.append(&header, &b"hello"[..]).unwrap();
        let tar = builder.into_inner().unwrap();
        let (selection, archive) = run(&tar, None, &["holes"], "/h", false).unwrap();
        assert_eq!(selection.bytes, 12);
        assert_eq!(
            entries(&archive),
            [out("h", T::Regular, 0o644, "\0\0\0\0hello\0\0\0")]
        );
    }

    #[test]
    fn the_same_copy_writes_the_same_bytes() {
        let (first, a) = run(&app(), None, &["."], "/app/", false).unwrap();
        let (second, b) = run(&app(), None, &["."], "/app/", false).unwrap();
        assert_eq!(a, b);
        assert_eq!(first, second);
        let hex: String = Sha256::digest(&a)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(first.digest, format!("sha256:{hex}"));
        assert_eq!((first.entries, first.bytes), (6, 7 + 9 + 6 + 3));
        let (other, _) = run(&app(), None, &["src"], "/app/", false).unwrap();
        assert_ne!(other.digest, first.digest);
    }

    #[test]
    fn a_changed_context_is_an_io_error() {
        let tar = app();
        let mut archive = Vec::new();
        // An index read from the whole archive, contents from a cut one.
        let mut cut = Cursor::new(tar.clone());
        let index = Index::read(&mut cut).unwrap();
        let view = index.visible(None);
        let (_, names) = place(&view, &[".".into()], "/x/", false).unwrap();
        let actions = plan(&index, &names).unwrap();
        let mut short = Cursor::new(&tar[..1024]);
        let err = write(&mut short, &actions, &mut archive).unwrap_err();
        assert!(matches!(err, CopyError::Io(_)) && !err.is_user_error());
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        /// A context entry from a small alphabet, so names collide and
        /// nest.
        fn entry() -> impl Strategy<Value = (String, u8)> {
            (
                proptest::collection::vec(proptest::sample::select(vec!["a", "b", "c.txt"]), 1..4),
                0u8..4,
            )
                .prop_map(|(parts, kind)| (parts.join("/"), kind))
        }

        proptest! {
            #[test]
            fn outputs_are_well_formed(
                list in proptest::collection::vec(entry(), 0..12),
                sources in proptest::collection::vec(proptest::sample::select(
                    vec![".", "a", "b", "a/b", "*", "a/*", "c.txt", "?/c.txt"]), 1..3),
                dest in proptest::sample::select(vec!["/d", "/d/", "/"]),
                dest_is_dir: bool,
            ) {
                let entries: Vec<In<'_>> = list
                    .iter()
                    .map(|(name, kind)| match kind {
                        0 => (name.as_str(), T::Directory, 0o755, &b""[..]),
                        1 => (name.as_str(), T::Symlink, 0o777, &b"../x"[..]),
                        2 => (name.as_str(), T::Link, 0o644, &b"a"[..]),
                        _ => (name.as_str(), T::Regular, 0o644, &b"data"[..]),
                    })
                    .collect();
                let tar = context(&entries);
                match run(&tar, Some("b/b\n"), &sources, dest, dest_is_dir) {
                    Err(e) => prop_assert!(e.is_user_error(), "{}", e),
                    Ok((selection, archive)) => {
                        prop_assert!(selection.dir.starts_with('/'));
                        let outs = entries_of(&archive);
                        // What .dockerignore leaves out never shows.
                        if sources == ["."] {
                            prop_assert!(outs.iter().all(|(n, _, _)| !n.starts_with("b/b")));
                        }
                        prop_assert_eq!(outs.len() as u64, selection.entries);
                        let mut seen = std::collections::BTreeSet::new();
                        for (name, kind, link) in outs {
                            let clean = name.trim_end_matches('/');
                            prop_assert!(!clean.is_empty() && !clean.starts_with('/'));
                            prop_assert!(clean.split('/').all(|p| !p.is_empty() && p != "." && p != ".."));
                            // Each name once, its parent written before it,
                            // a hard link's target too.
                            if let Some((parent, _)) = clean.rsplit_once('/') {
                                prop_assert!(seen.contains(parent), "{} before its parent", name);
                            }
                            if kind == T::Link {
                                prop_assert!(seen.contains(link.as_str()), "{} before {}", name, link);
                            }
                            prop_assert!(seen.insert(clean.to_owned()), "{} twice", name);
                        }
                    }
                }
            }
        }

        fn entries_of(archive: &[u8]) -> Vec<(String, T, String)> {
            let mut archive = tar::Archive::new(archive);
            archive
                .entries()
                .unwrap()
                .map(|e| {
                    let e = e.unwrap();
                    let name = String::from_utf8(e.path_bytes().into_owned()).unwrap();
                    let link = e
                        .link_name_bytes()
                        .map(|l| String::from_utf8(l.into_owned()).unwrap())
                        .unwrap_or_default();
                    (name, e.header().entry_type(), link)
                })
                .collect()
        }
    }
}
