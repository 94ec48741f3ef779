//! The build context's rules: which files `.dockerignore` leaves out, and
//! which files a `COPY` source pattern names.
//!
//! Paths here are relative to the context's root, `/`-separated, without
//! `.` or `..` parts (the context's archive is checked for those before
//! any rule reads it).

use globset::{Glob, GlobBuilder, GlobMatcher};

use crate::PlanError;

/// The largest `.dockerignore` read.
pub const MAX_IGNORE_BYTES: usize = 1 << 20;

/// `.dockerignore`: patterns in order, the last that matches a path (or
/// one of its parent directories) deciding; `!pattern` takes a path back.
#[derive(Debug, Default)]
pub struct Ignore {
    rules: Vec<Rule>,
}

#[derive(Debug)]
struct Rule {
    matcher: GlobMatcher,
    /// `!pattern`: the path is kept.
    keep: bool,
}

impl Ignore {
    /// Reads `.dockerignore`'s text: one pattern a line, `#` comments,
    /// blank lines skipped, a leading `/` meaning the context's root (all
    /// patterns are anchored there).
    pub fn parse(text: &str) -> Result<Self, PlanError> {
        if text.len() > MAX_IGNORE_BYTES {
            return Err(PlanError::whole(format!(
                ".dockerignore is larger than {MAX_IGNORE_BYTES} bytes"
            )));
        }
        let mut rules = Vec::new();
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        for (index, line) in text.lines().enumerate() {
            // As Docker reads it: a comment starts the line; a `#` after
            // spaces is part of a pattern.
            if line.starts_with('#') {
                continue;
            }
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            let (keep, pattern) = match line.strip_prefix('!') {
                Some(rest) => (true, rest.trim()),
                None => (false, line),
            };
            let pattern = clean(pattern);
            if pattern.is_empty() {
                continue;
            }
            let matcher = glob(&pattern).map_err(|e| {
                PlanError::at(
                    index + 1,
                    format!(".dockerignore: bad pattern {pattern:?}: {e}"),
                )
            })?;
            rules.push(Rule { matcher, keep });
        }
        Ok(Self { rules })
    }

    /// Whether `path` is left out of the context.
    pub fn excludes(&self, path: &str) -> bool {
        let mut excluded = false;
        for rule in &self.rules {
            // A rule that names a directory names everything under it.
            let hit = ancestors_and_self(path).any(|p| rule.matcher.is_match(p));
            if hit {
                excluded = !rule.keep;
            }
        }
        excluded
    }
}

/// A `COPY` source as a matcher: `*`, `?` and `[...]` within one path
/// part, as Docker reads them.
pub fn source(pattern: &str) -> Result<GlobMatcher, PlanError> {
    // Docker matches sources part by part, so `**` is no more than `*`.
    let mut pattern = clean(pattern);
    while pattern.contains("**") {
        pattern = pattern.replace("**", "*");
    }
    glob(&pattern)
        .map_err(|e| PlanError::whole(format!("bad COPY source pattern {pattern:?}: {e}")))
}

/// Whether a `COPY` source is a pattern (else it names one path).
pub fn is_pattern(source: &str) -> bool {
    source.contains(['*', '?', '['])
}

fn glob(pattern: &str) -> Result<GlobMatcher, globset::Error> {
    // Braces are plain characters to Docker, alternatives to globset.
    let pattern = pattern.replace('{', "\\{").replace('}', "\\}");
    let glob: Glob = GlobBuilder::new(&pattern)
        .literal_separator(true)
        .backslash_escape(true)
        .build()?;
    Ok(glob.compile_matcher())
}

/// `path`, then each of its parent directories, longest first.
fn ancestors_and_self(path: &str) -> impl Iterator<Item = &str> {
    let mut next = Some(path);
    std::iter::from_fn(move || {
        let current = next?;
        next = current.rfind('/').map(|at| &current[..at]);
        Some(current)
    })
}

/// Anchors a pattern at the root and drops `.` parts and repeated `/`.
pub(crate) fn clean(pattern: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for part in pattern.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            part => parts.push(part),
        }
    }
    parts.join("/")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_matching_rule_decides() {
        let ignore = Ignore::parse(
            "# comment\n\nnode_modules\n*.log\n!keep.log\n/build/\ndocs/**/*.md\n!docs/README.md\n",
        )
        .unwrap();
        for (path, excluded) in [
            ("node_modules", true),
            ("node_modules/a/b.js", true),
            ("src/node_modules", false),
            ("debug.log", true),
            ("keep.log", false),
            ("sub/debug.log", false),
            ("build/out.bin", true),
            ("docs/a/b/c.md", true),
            ("docs/c.md", true),
            ("docs/README.md", false),
            ("src/main.rs", false),
        ] {
            assert_eq!(ignore.excludes(path), excluded, "{path}");
        }
    }

    #[test]
    fn docker_reading_of_odd_lines() {
        let ignore = Ignore::parse("\u{feff}secret\n  #not-a-comment\na/../b\n{x}\n").unwrap();
        assert!(ignore.excludes("secret"));
        assert!(ignore.excludes("#not-a-comment"));
        assert!(ignore.excludes("b"));
        assert!(ignore.excludes("{x}"));
    }

    #[test]
    fn bad_patterns_name_their_line() {
        let err = Ignore::parse("ok\n[unclosed\n").unwrap_err();
        assert_eq!(err.line, Some(2), "{err}");
    }

    #[test]
    fn sources_match_within_one_part() {
        let m = source("folder/*.txt").unwrap();
        assert!(m.is_match("folder/a.txt"));
        assert!(!m.is_match("folder/sub/a.txt"));
        assert!(is_pattern("*.txt") && !is_pattern("a.txt"));
        assert!(source("./a/./b").unwrap().is_match("a/b"));
        let m = source("**/x").unwrap();
        assert!(m.is_match("a/x") && !m.is_match("a/b/x") && !m.is_match("x"));
    }
}

/// How much a build context may hold.
#[derive(Debug, Clone, Copy)]
pub struct ContextLimits {
    /// Largest total of file sizes.
    pub max_bytes: u64,
    /// Most entries of any kind.
    pub max_entries: u64,
}

/// What a context archive holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ContextStats {
    /// Entries of every kind.
    pub entries: u64,
    /// Total of file sizes.
    pub bytes: u64,
}

/// Why a context archive was refused.
#[derive(Debug, thiserror::Error)]
pub enum ContextError {
    /// An entry the context may not hold; `why` says which rule.
    #[error("the build context's entry {path:?} {why}")]
    Refused {
        /// The entry's name as the archive gives it.
        path: String,
        /// The rule, in words.
        why: &'static str,
    },
    /// More bytes than the limit.
    #[error("the build context is larger than {0} bytes; leave what the build does not need out with .dockerignore")]
    TooLarge(u64),
    /// More entries than the limit.
    #[error("the build context has more than {0} entries; leave what the build does not need out with .dockerignore")]
    TooManyEntries(u64),
    /// Not a tar archive, or a damaged one.
    #[error("the build context is not a readable tar archive: {0}")]
    Corrupt(String),
}

/// Reads a context archive (a tar, already decompressed) through and
/// checks every entry before anything of it is unpacked: names relative
/// and inside the context (no `/` at the start, no `..`, no NUL), only
/// files, directories, symbolic links (kept as links, never followed by
/// the builder) and hard links to other entries; no device nodes or fifos;
/// no name starting `.wh.` (the mark of a removed file in a layer, which
/// the layer unpacker would read as one); within `limits`.
pub fn check_archive(
    reader: impl std::io::Read,
    limits: &ContextLimits,
) -> Result<ContextStats, ContextError> {
    let corrupt = |e: std::io::Error| ContextError::Corrupt(e.to_string());
    let mut archive = tar::Archive::new(reader);
    let mut stats = ContextStats::default();
    // Symbolic links seen so far: no later entry may be beneath one (it
    // would be written wherever the link points).
    let mut links = std::collections::BTreeSet::<String>::new();
    for entry in archive.entries().map_err(corrupt)? {
        let entry = entry.map_err(corrupt)?;
        stats.entries += 1;
        if stats.entries > limits.max_entries {
            return Err(ContextError::TooManyEntries(limits.max_entries));
        }
        let path = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
        let refuse = |why| ContextError::Refused {
            path: path.clone(),
            why,
        };
        use tar::EntryType as T;
        let kind = entry.header().entry_type();
        match kind {
            T::XGlobalHeader | T::XHeader | T::GNULongName | T::GNULongLink => continue,
            T::Regular | T::Continuous | T::GNUSparse | T::Directory | T::Symlink | T::Link => {}
            T::Char | T::Block | T::Fifo => {
                return Err(refuse(
                    "is a device node or fifo, which a build context cannot hold",
                ))
            }
            _ => return Err(refuse("is of a kind a build context cannot hold")),
        }
        check_name(&path).map_err(refuse)?;
        let normalised = clean(&path);
        if beneath_link(&links, &normalised) {
            return Err(refuse("is beneath a symbolic link of the context"));
        }
        if kind == T::Symlink {
            links.insert(normalised);
        } else {
            links.remove(&normalised);
        }
        if kind == T::Link {
            let target = entry
                .link_name_bytes()
                .map(|t| String::from_utf8_lossy(&t).into_owned())
                .unwrap_or_default();
            check_name(&target)
                .map_err(|_| refuse("is a hard link to a path outside the context"))?;
            if beneath_link(&links, &clean(&target)) {
                return Err(refuse(
                    "is a hard link through a symbolic link of the context",
                ));
            }
        }
        stats.bytes = stats
            .bytes
            .saturating_add(entry.header().size().map_err(corrupt)?);
        if stats.bytes > limits.max_bytes {
            return Err(ContextError::TooLarge(limits.max_bytes));
        }
    }
    Ok(stats)
}

/// Whether a parent directory of `path` is one of `links`.
fn beneath_link(links: &std::collections::BTreeSet<String>, path: &str) -> bool {
    ancestors_and_self(path).skip(1).any(|p| links.contains(p))
}

/// The naming rules of [`check_archive`] for one path.
fn check_name(path: &str) -> Result<(), &'static str> {
    if path.starts_with('/') {
        return Err("has an absolute path");
    }
    if path.contains('\0') {
        return Err("has a NUL byte in its name");
    }
    for part in path.split('/') {
        if part == ".." {
            return Err("climbs out of the context with ..");
        }
        if part.starts_with(".wh.") {
            return Err("has a name starting .wh., which is reserved for layer whiteouts");
        }
    }
    Ok(())
}

#[cfg(test)]
mod archive_tests {
    use super::*;

    const LIMITS: ContextLimits = ContextLimits {
        max_bytes: 1 << 20,
        max_entries: 100,
    };

    /// A tar of `(name, kind, data or link target)`, names written raw so
    /// hostile ones can be made.
    fn archive(entries: &[(&str, tar::EntryType, &[u8])]) -> Vec<u8> {
        let mut builder = tar::Builder::new(Vec::new());
        for (name, kind, data) in entries {
            let mut header = tar::Header::new_gnu();
            let raw = &mut header.as_gnu_mut().unwrap().name;
            raw[..name.len()].copy_from_slice(name.as_bytes());
            header.set_entry_type(*kind);
            header.set_mode(0o644);
            if matches!(kind, tar::EntryType::Symlink | tar::EntryType::Link) {
                let link = &mut header.as_gnu_mut().unwrap().linkname;
                link[..data.len()].copy_from_slice(data);
                header.set_size(0);
                header.set_cksum();
                builder.append(&header, std::io::empty()).unwrap();
            } else {
                header.set_size(data.len() as u64);
                header.set_cksum();
                builder.append(&header, *data).unwrap();
            }
        }
        builder.into_inner().unwrap()
    }

    #[test]
    fn an_ordinary_context_passes() {
        use tar::EntryType as T;
        let tar = archive(&[
            ("src/", T::Directory, b""),
            ("src/main.py", T::Regular, b"print(1)\n"),
            ("link", T::Symlink, b"/etc/passwd"),
            ("hard", T::Link, b"src/main.py"),
        ]);
        let stats = check_archive(tar.as_slice(), &LIMITS).unwrap();
        assert_eq!(
            stats,
            ContextStats {
                entries: 4,
                bytes: 9
            }
        );
    }

    #[test]
    fn hostile_entries_are_refused_by_name() {
        use tar::EntryType as T;
        for (entries, needle) in [
            (vec![("../x", T::Regular, &b"x"[..])], ".."),
            (vec![("a/../../x", T::Regular, &b"x"[..])], ".."),
            (vec![("/etc/x", T::Regular, &b"x"[..])], "absolute"),
            (vec![("dev", T::Char, &b""[..])], "device node"),
            (vec![("pipe", T::Fifo, &b""[..])], "fifo"),
            (vec![("d/.wh.gone", T::Regular, &b""[..])], ".wh."),
            (vec![("h", T::Link, &b"../../etc/shadow"[..])], "hard link"),
            (
                vec![
                    ("l", T::Symlink, &b"/etc"[..]),
                    ("l/passwd", T::Regular, &b"x"[..]),
                ],
                "beneath a symbolic link",
            ),
            (
                vec![
                    ("l", T::Symlink, &b"/etc"[..]),
                    ("./l/x/y", T::Directory, &b""[..]),
                ],
                "beneath a symbolic link",
            ),
            (
                vec![
                    ("l", T::Symlink, &b"/etc"[..]),
                    ("h", T::Link, &b"l/shadow"[..]),
                ],
                "through a symbolic link",
            ),
        ] {
            let err = check_archive(archive(&entries).as_slice(), &LIMITS).unwrap_err();
            assert!(err.to_string().contains(needle), "{err}");
        }
    }

    #[test]
    fn limits_and_damage() {
        use tar::EntryType as T;
        let big = vec![0u8; 2048];
        let small = ContextLimits {
            max_bytes: 1024,
            max_entries: 2,
        };
        let err =
            check_archive(archive(&[("f", T::Regular, &big)]).as_slice(), &small).unwrap_err();
        assert!(matches!(err, ContextError::TooLarge(1024)), "{err}");
        let many = archive(&[
            ("a", T::Regular, b""),
            ("b", T::Regular, b""),
            ("c", T::Regular, b""),
        ]);
        let err = check_archive(many.as_slice(), &small).unwrap_err();
        assert!(matches!(err, ContextError::TooManyEntries(2)), "{err}");
        let mut cut = archive(&[("f", T::Regular, &big)]);
        cut.truncate(700);
        assert!(matches!(
            check_archive(cut.as_slice(), &LIMITS),
            Err(ContextError::Corrupt(_))
        ));
        let junk = vec![0x55u8; 1024];
        assert!(check_archive(junk.as_slice(), &LIMITS).is_err());
    }
}
