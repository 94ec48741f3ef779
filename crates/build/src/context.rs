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
        for (index, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
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
    glob(&clean(pattern))
        .map_err(|e| PlanError::whole(format!("bad COPY source pattern {pattern:?}: {e}")))
}

/// Whether a `COPY` source is a pattern (else it names one path).
pub fn is_pattern(source: &str) -> bool {
    source.contains(['*', '?', '['])
}

fn glob(pattern: &str) -> Result<GlobMatcher, globset::Error> {
    let glob: Glob = GlobBuilder::new(pattern)
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
fn clean(pattern: &str) -> String {
    pattern
        .split('/')
        .filter(|part| !part.is_empty() && *part != ".")
        .collect::<Vec<_>>()
        .join("/")
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
    }
}
