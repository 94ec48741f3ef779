//! Entry-name rules: turns the raw bytes a tar header carries into a clean
//! path relative to the layer root, and recognises whiteout names.
//!
//! Pure byte logic with no filesystem access, so every rule here is tested
//! without root. It does not decide what happens on disk: `fs` and the parent
//! module do that with the names produced here.

/// Why a raw entry name (or hard-link target) was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NameError {
    /// The name starts with `/`.
    Absolute,
    /// A component is `..`.
    ParentDir,
    /// The name holds a NUL byte (only PAX and GNU long names can).
    Nul,
    /// The raw name is longer than the limit; carries its length.
    TooLong(usize),
}

/// A normalised entry name: components joined by single `/`, none of them
/// empty, `.` or `..`, and no NUL anywhere. Empty means the layer root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EntryName {
    path: Vec<u8>,
}

impl EntryName {
    /// The whole normalised path, without leading or trailing `/`.
    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.path
    }

    /// Whether this names the layer root itself (`""`, `.`, `./`).
    pub(crate) fn is_root(&self) -> bool {
        self.path.is_empty()
    }

    /// Everything before the last component (empty for top-level entries).
    pub(crate) fn parent(&self) -> &[u8] {
        match self.path.iter().rposition(|&b| b == b'/') {
            Some(slash) => &self.path[..slash],
            None => &[],
        }
    }

    /// The last component (empty only for the root).
    pub(crate) fn file_name(&self) -> &[u8] {
        match self.path.iter().rposition(|&b| b == b'/') {
            Some(slash) => &self.path[slash + 1..],
            None => &self.path,
        }
    }
}

/// Normalises a raw tar name.
///
/// The length limit is checked first, on the raw bytes, so that a hostile
/// multi-megabyte GNU long name costs nothing more than this comparison.
/// `.` components and empty ones (`a//b`, a trailing `/`) are dropped, which
/// also strips the leading `./` that most layer tools write.
pub(crate) fn normalise(raw: &[u8], max_len: usize) -> Result<EntryName, NameError> {
    if raw.len() > max_len {
        return Err(NameError::TooLong(raw.len()));
    }
    if raw.contains(&0) {
        return Err(NameError::Nul);
    }
    if raw.first() == Some(&b'/') {
        return Err(NameError::Absolute);
    }
    let mut path = Vec::with_capacity(raw.len());
    for component in raw.split(|&b| b == b'/') {
        match component {
            b"" | b"." => continue,
            b".." => return Err(NameError::ParentDir),
            _ => {
                if !path.is_empty() {
                    path.push(b'/');
                }
                path.extend_from_slice(component);
            }
        }
    }
    Ok(EntryName { path })
}

/// The prefix that marks a whiteout entry (OCI image spec, "Whiteouts").
const WHITEOUT_PREFIX: &[u8] = b".wh.";
/// The prefix the spec reserves for AUFS bookkeeping files.
const WHITEOUT_META_PREFIX: &[u8] = b".wh..wh.";
/// The opaque-directory marker.
const WHITEOUT_OPAQUE: &[u8] = b".wh..wh..opq";

/// What an entry's last component says about whiteouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Whiteout<'a> {
    /// An ordinary name.
    No,
    /// `.wh.NAME`: NAME, a sibling, is deleted in this layer.
    Delete(&'a [u8]),
    /// `.wh..wh..opq`: the parent directory hides everything below it.
    Opaque,
    /// Another `.wh..wh.` name: AUFS hard-link bookkeeping, meaningless to
    /// overlayfs, ignored the way other OCI unpackers ignore it.
    AufsMeta,
    /// `.wh.` followed by nothing, `.` or `..`: names no sibling.
    Bad,
}

/// Classifies an entry's last component.
pub(crate) fn whiteout(file_name: &[u8]) -> Whiteout<'_> {
    if file_name == WHITEOUT_OPAQUE {
        return Whiteout::Opaque;
    }
    if file_name.starts_with(WHITEOUT_META_PREFIX) {
        return Whiteout::AufsMeta;
    }
    match file_name.strip_prefix(WHITEOUT_PREFIX) {
        None => Whiteout::No,
        Some(b"" | b"." | b"..") => Whiteout::Bad,
        Some(deleted) => Whiteout::Delete(deleted),
    }
}

/// Longest path text put into an error; hostile names can be megabytes.
const SHOWN_MAX_CHARS: usize = 256;

/// Renders a raw name for an error message: lossy UTF-8, cut to a
/// readable length. Control characters are left for `{:?}` to escape.
pub(crate) fn shown(raw: &[u8]) -> String {
    let text = String::from_utf8_lossy(raw);
    if text.chars().count() <= SHOWN_MAX_CHARS {
        return text.into_owned();
    }
    let mut cut: String = text.chars().take(SHOWN_MAX_CHARS).collect();
    cut.push('…');
    cut
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn norm(raw: &str) -> Result<String, NameError> {
        normalise(raw.as_bytes(), 4096).map(|n| String::from_utf8(n.path).unwrap())
    }

    #[test]
    fn strips_dot_slash_and_empty_components() {
        assert_eq!(norm("./usr/bin/env").unwrap(), "usr/bin/env");
        assert_eq!(norm("usr//bin/./env").unwrap(), "usr/bin/env");
        assert_eq!(norm("./etc/").unwrap(), "etc");
        assert_eq!(norm("././a").unwrap(), "a");
        assert_eq!(norm(".hidden/..x/...").unwrap(), ".hidden/..x/...");
    }

    #[test]
    fn root_spellings() {
        for raw in ["", ".", "./", ".//.", "./."] {
            assert!(normalise(raw.as_bytes(), 10).unwrap().is_root(), "{raw:?}");
        }
    }

    #[test]
    fn refusals() {
        assert_eq!(norm("/etc/passwd"), Err(NameError::Absolute));
        assert_eq!(norm("//etc"), Err(NameError::Absolute));
        assert_eq!(norm(".."), Err(NameError::ParentDir));
        assert_eq!(norm("../x"), Err(NameError::ParentDir));
        assert_eq!(norm("a/../b"), Err(NameError::ParentDir));
        assert_eq!(norm("a/.."), Err(NameError::ParentDir));
        assert_eq!(norm("./../x"), Err(NameError::ParentDir));
        assert_eq!(norm("a\0b"), Err(NameError::Nul));
        assert_eq!(normalise(b"abcde", 4), Err(NameError::TooLong(5)));
        assert!(normalise(b"abcd", 4).is_ok());
    }

    #[test]
    fn parent_and_file_name() {
        let n = normalise(b"./a/b/c", 100).unwrap();
        assert_eq!(n.parent(), b"a/b");
        assert_eq!(n.file_name(), b"c");
        let top = normalise(b"c/", 100).unwrap();
        assert_eq!(top.parent(), b"");
        assert_eq!(top.file_name(), b"c");
    }

    #[test]
    fn whiteout_names() {
        assert_eq!(whiteout(b"file"), Whiteout::No);
        assert_eq!(whiteout(b".wh"), Whiteout::No);
        assert_eq!(whiteout(b".whfoo"), Whiteout::No);
        assert_eq!(whiteout(b".wh.foo"), Whiteout::Delete(b"foo"));
        assert_eq!(whiteout(b".wh..foo"), Whiteout::Delete(b".foo"));
        assert_eq!(whiteout(b".wh..wh..opq"), Whiteout::Opaque);
        assert_eq!(whiteout(b".wh..wh.plnk"), Whiteout::AufsMeta);
        assert_eq!(whiteout(b".wh."), Whiteout::Bad);
        assert_eq!(whiteout(b".wh.."), Whiteout::Bad);
        assert_eq!(whiteout(b".wh..."), Whiteout::Bad);
    }

    #[test]
    fn shown_cuts_long_names() {
        assert_eq!(shown(b"a/b"), "a/b");
        let long = shown(&[b'x'; 10_000]);
        assert_eq!(long.chars().count(), SHOWN_MAX_CHARS + 1);
        assert_eq!(shown(b"\xff"), "\u{fffd}");
    }

    proptest! {
        // Whatever the input, an accepted name has only plain components.
        #[test]
        fn accepted_names_are_confined(raw in proptest::collection::vec(
            prop_oneof![Just(b'/'), Just(b'.'), Just(b'a'), Just(0u8), any::<u8>()], 0..64)) {
            if let Ok(name) = normalise(&raw, 64) {
                prop_assert!(!name.as_bytes().contains(&0));
                if !name.is_root() {
                    for component in name.as_bytes().split(|&b| b == b'/') {
                        prop_assert!(component != b"" && component != b"." && component != b"..");
                    }
                }
                let rejoined = [name.parent(), name.file_name()].concat();
                prop_assert!(rejoined.len() + usize::from(!name.parent().is_empty()) == name.as_bytes().len());
            }
        }
    }
}
