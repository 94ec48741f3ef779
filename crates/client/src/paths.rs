//! Request URL building: the base URL's checks and the percent-encoding of
//! run ids, image names and file paths.
//!
//! URL parsers normalise `.` and `..` segments (and their encoded forms)
//! away, so a file path such as `a/../b` would silently reach a different
//! route than the one asked for. Such values are refused here instead of
//! being sent; the server stays the authority on everything else (length,
//! characters, confinement to `/work`).

use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};

use crate::ClientError;

/// Everything but RFC 3986 unreserved characters is encoded, `/` included:
/// one call encodes exactly one path segment.
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// Checks a base URL and returns it without a trailing slash, ready to have
/// `/v1/...` appended. A path prefix (`http://host/runbox`) is kept.
pub(crate) fn parse_base(raw: &str) -> Result<String, ClientError> {
    let url = url::Url::parse(raw).map_err(|source| ClientError::InvalidUrl {
        url: raw.to_owned(),
        source,
    })?;
    let unusable = |reason| ClientError::UnusableUrl {
        url: raw.to_owned(),
        reason,
    };
    // The SDK is built without TLS (the daemon serves plain HTTP, normally on
    // loopback); refusing https here beats an obscure error on first use.
    match url.scheme() {
        "http" => {}
        "https" => return Err(unusable("https is not supported by this client build")),
        _ => return Err(unusable("the scheme must be http")),
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(unusable("a query or fragment is not allowed"));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(unusable(
            "credentials do not belong in the url; pass the token instead",
        ));
    }
    Ok(url.as_str().trim_end_matches('/').to_owned())
}

/// A query parameter's value, encoded.
pub(crate) fn query_value(value: &str) -> String {
    utf8_percent_encode(value, SEGMENT).to_string()
}

/// The query string of a list's label selector (empty without terms).
pub(crate) fn label_query(selector: &[&str]) -> String {
    let terms: Vec<(&str, Option<&str>)> = selector.iter().map(|t| ("label", Some(*t))).collect();
    with_query("", &terms)
}

/// `path` with the parameters that have a value, encoded, as its query.
pub(crate) fn with_query(path: &str, params: &[(&str, Option<&str>)]) -> String {
    let query: Vec<String> = params
        .iter()
        .filter_map(|(k, v)| v.map(|v| format!("{k}={}", query_value(v))))
        .collect();
    match query.is_empty() {
        true => path.to_owned(),
        false => format!("{path}?{}", query.join("&")),
    }
}

/// The query string of a file write under a lease.
pub(crate) fn lease_query(owner: &str, generation: u64) -> String {
    format!(
        "?owner={}&generation={generation}",
        utf8_percent_encode(owner, SEGMENT)
    )
}

/// Encodes a value that fills one path segment (a run id, an image name).
pub(crate) fn segment(what: &'static str, value: &str) -> Result<String, ClientError> {
    check_segment(what, value, value)?;
    Ok(utf8_percent_encode(value, SEGMENT).to_string())
}

/// Encodes a file path relative to `/work`, segment by segment, keeping the
/// `/` between segments.
pub(crate) fn file_path(path: &str) -> Result<String, ClientError> {
    let mut encoded = String::with_capacity(path.len());
    for (i, part) in path.split('/').enumerate() {
        check_segment("file path", path, part)?;
        if i > 0 {
            encoded.push('/');
        }
        encoded.extend(utf8_percent_encode(part, SEGMENT));
    }
    Ok(encoded)
}

fn check_segment(what: &'static str, whole: &str, part: &str) -> Result<(), ClientError> {
    let reason = match part {
        "" if whole.is_empty() => "it is empty",
        "" if whole.starts_with('/') => "it must be relative (to /work)",
        "" => "it has an empty segment",
        "." | ".." => "`.` and `..` segments are not allowed",
        _ => return Ok(()),
    };
    Err(ClientError::InvalidPath {
        what,
        value: whole.to_owned(),
        reason,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_urls_lose_their_trailing_slash() {
        assert_eq!(
            parse_base("http://127.0.0.1:7439").unwrap(),
            "http://127.0.0.1:7439"
        );
        assert_eq!(
            parse_base("http://127.0.0.1:7439/").unwrap(),
            "http://127.0.0.1:7439"
        );
        assert_eq!(
            parse_base("http://host/runbox/").unwrap(),
            "http://host/runbox"
        );
    }

    #[test]
    fn unusable_base_urls_are_refused() {
        for bad in [
            "127.0.0.1:7439",
            "localhost:7439",
            "ftp://host",
            "https://host",
            "http://host/?a=b",
            "http://user:pw@host",
        ] {
            assert!(parse_base(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn segments_are_fully_encoded() {
        assert_eq!(segment("image name", "base-1.0_x~").unwrap(), "base-1.0_x~");
        assert_eq!(
            segment("image name", "a b/c?d#e%").unwrap(),
            "a%20b%2Fc%3Fd%23e%25"
        );
        assert_eq!(segment("image name", "é").unwrap(), "%C3%A9");
        assert!(segment("run id", "").is_err());
        assert!(segment("run id", "..").is_err());
    }

    #[test]
    fn file_paths_keep_their_slashes() {
        assert_eq!(
            file_path("out/result file.txt").unwrap(),
            "out/result%20file.txt"
        );
        assert_eq!(file_path("a/b%2F").unwrap(), "a/b%252F");
        assert_eq!(file_path(".hidden/x..y").unwrap(), ".hidden/x..y");
    }

    #[test]
    fn file_paths_that_a_url_would_rewrite_are_refused() {
        for bad in ["", "/etc/passwd", "a//b", "a/", "./a", "a/../b", ".."] {
            assert!(file_path(bad).is_err(), "{bad}");
        }
    }
}
