//! Who an envd call acts as, and where its relative paths start.
//!
//! E2B's rule, which the SDKs and the agents written for them rely on:
//! - a call acts as the user it names (`Authorization: Basic <user>:`, or
//!   `username=` on `/files`), else as the sandbox's own user (the image's
//!   `User`; root when it sets none);
//! - a relative path, and `~`, are taken from that user's home directory,
//!   read from the run's `/etc/passwd`;
//! - a command started without `cwd` runs in the image's `WorkingDir` when
//!   it sets one, else in the user's home.
//!
//! runbox's own API keeps `/work` as its base; only the E2B surface follows
//! this rule. Nothing is cached: a sandbox may add users or change homes
//! between two calls, and the lookup is one small file read.

use std::collections::HashMap;

use axum::http::{header, HeaderMap};
use base64::Engine;
use futures::TryStreamExt;
use runbox_core::runs::Scope;
use runbox_core::RunService;
use ulid::Ulid;

use super::connect::{Code, RpcError};

/// The most of `/etc/passwd` or `/etc/group` read.
const MAX_PASSWD: usize = 1 << 20;

/// The user an envd call names (`Authorization: Basic <user>:`), if any.
pub(super) fn basic_user(headers: &HeaderMap) -> Result<Option<String>, RpcError> {
    let Some(value) = headers.get(header::AUTHORIZATION) else {
        return Ok(None);
    };
    let bad = || RpcError::new(Code::Unauthenticated, "Authorization must be Basic <user>:");
    let value = value.to_str().map_err(|_| bad())?;
    let (scheme, encoded) = value.split_once(' ').ok_or_else(bad)?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return Err(bad());
    }
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded.trim())
        .map_err(|_| bad())?;
    let decoded = String::from_utf8(decoded).map_err(|_| bad())?;
    let name = decoded.split(':').next().unwrap_or("");
    Ok((!name.is_empty()).then(|| name.to_owned()))
}

/// Who a call acts as: the user it names, with the run it is for.
#[derive(Clone, Debug)]
pub(super) struct Caller {
    pub run: Ulid,
    /// The user the call names; None acts as the sandbox's own user.
    pub user: Option<String>,
}

impl Caller {
    /// `path` made absolute by E2B's rule (see the module doc). An empty
    /// path is refused: every file call names one.
    pub async fn path<S: RunService>(&self, service: &S, path: &str) -> Result<String, RpcError> {
        if path.is_empty() {
            return Err(RpcError::invalid(
                "path is empty; name a path in the sandbox",
            ));
        }
        if path.starts_with('/') {
            return Ok(path.to_owned());
        }
        let home = self.home(service).await?;
        Ok(join(&home, path))
    }

    /// Where a command starts: `cwd` made absolute, or without one the
    /// image's working directory, else the user's home.
    pub async fn cwd<S: RunService>(
        &self,
        service: &S,
        cwd: Option<String>,
    ) -> Result<String, RpcError> {
        match cwd.filter(|c| !c.is_empty()) {
            Some(cwd) => self.path(service, &cwd).await,
            None => match service.image_config(self.run)?.working_dir {
                Some(dir) => Ok(dir),
                None => self.home(service).await,
            },
        }
    }

    /// The acting user's home directory in the run.
    pub async fn home<S: RunService>(&self, service: &S) -> Result<String, RpcError> {
        let (named, spec) = match &self.user {
            Some(user) => (true, user.clone()),
            None => (
                false,
                service
                    .image_config(self.run)?
                    .user
                    .unwrap_or_else(|| "root".to_owned()),
            ),
        };
        // A `user:group` spec names its user first.
        let name = spec.split(':').next().unwrap_or("").to_owned();
        let passwd = read_small(service, self.run, "/etc/passwd").await;
        match passwd.as_deref().and_then(|p| home_in(p, &name)) {
            Some(home) => Ok(home),
            None if name == "root" || name == "0" => Ok("/root".to_owned()),
            None if named => Err(RpcError::invalid(format!(
                "user {name:?} is not in the sandbox's /etc/passwd"
            ))),
            // The image's own user without an entry: the root directory,
            // as a shell without a home would start.
            None => Ok("/".to_owned()),
        }
    }
}

/// `rel` below `home`; `~` and `~/...` are the home itself.
fn join(home: &str, rel: &str) -> String {
    let rel = match rel.strip_prefix('~') {
        Some("") => return home.to_owned(),
        Some(rest) if rest.starts_with('/') => rest.trim_start_matches('/'),
        _ => rel,
    };
    format!("{}/{rel}", home.trim_end_matches('/'))
}

/// User and group names by id, as the run's own files give them: envd
/// names a file's owner and group, and so does runbox's E2B surface.
#[derive(Debug, Default)]
pub(super) struct Names {
    users: HashMap<u32, String>,
    groups: HashMap<u32, String>,
}

impl Names {
    /// Reads the run's `/etc/passwd` and `/etc/group`; what cannot be read
    /// leaves ids unnamed.
    pub async fn of<S: RunService>(service: &S, run: Ulid) -> Names {
        let (passwd, group) = tokio::join!(
            read_small(service, run, "/etc/passwd"),
            read_small(service, run, "/etc/group")
        );
        Names {
            users: ids(passwd.as_deref().unwrap_or("")),
            groups: ids(group.as_deref().unwrap_or("")),
        }
    }

    /// A uid's name, or the number where the run has none for it.
    pub fn user(&self, uid: u32) -> String {
        self.users
            .get(&uid)
            .cloned()
            .unwrap_or_else(|| uid.to_string())
    }

    /// A gid's name, or the number where the run has none for it.
    pub fn group(&self, gid: u32) -> String {
        self.groups
            .get(&gid)
            .cloned()
            .unwrap_or_else(|| gid.to_string())
    }
}

/// `name -> id` lines of a passwd or group file, as `id -> name` (the
/// first name wins, as with getpwuid).
fn ids(text: &str) -> HashMap<u32, String> {
    let mut out = HashMap::new();
    for line in text.lines() {
        let mut fields = line.split(':');
        let (Some(name), Some(_), Some(id)) = (fields.next(), fields.next(), fields.next()) else {
            continue;
        };
        if let Ok(id) = id.parse() {
            out.entry(id).or_insert_with(|| name.to_owned());
        }
    }
    out
}

/// A small file of the run's, if it can be read (at most [`MAX_PASSWD`]).
async fn read_small<S: RunService>(service: &S, run: Ulid, path: &str) -> Option<String> {
    let file = service
        .get_file(run, Scope::Root, path.to_owned())
        .await
        .ok()?;
    let mut out = Vec::new();
    let mut body = file.body;
    while let Some(chunk) = body.try_next().await.ok()? {
        out.extend_from_slice(&chunk);
        if out.len() > MAX_PASSWD {
            return None;
        }
    }
    String::from_utf8(out).ok()
}

/// The home directory of `user` (a name, or a numeric uid) in a passwd file.
fn home_in(passwd: &str, user: &str) -> Option<String> {
    passwd.lines().find_map(|line| {
        let fields: Vec<&str> = line.split(':').collect();
        if fields.len() < 7 {
            return None;
        }
        let matches = fields[0] == user || (user.parse::<u32>().is_ok() && fields[2] == user);
        (matches && fields[5].starts_with('/')).then(|| fields[5].to_owned())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/bash\n\
        daemon:x:1:1::/usr/sbin:/usr/sbin/nologin\n\
        broken line\n\
        user:x:1000:1000::/home/user:/bin/bash\n";

    #[test]
    fn homes_are_found_by_name_or_uid() {
        assert_eq!(home_in(PASSWD, "user").as_deref(), Some("/home/user"));
        assert_eq!(home_in(PASSWD, "1000").as_deref(), Some("/home/user"));
        assert_eq!(home_in(PASSWD, "root").as_deref(), Some("/root"));
        assert_eq!(home_in(PASSWD, "nobody"), None);
        assert_eq!(home_in(PASSWD, "broken line"), None);
    }

    #[test]
    fn ids_are_named_by_their_first_entry() {
        let users = ids(PASSWD);
        assert_eq!(users.get(&1000).map(String::as_str), Some("user"));
        assert_eq!(users.get(&0).map(String::as_str), Some("root"));
        let groups = ids("root:x:0:\nusers:x:100:a,b\nalias:x:100:\nbad:x:notanumber:\n");
        assert_eq!(groups.get(&100).map(String::as_str), Some("users"));
        assert_eq!(groups.len(), 2);
        let names = Names { users, groups };
        assert_eq!(names.user(1000), "user");
        assert_eq!(names.user(4242), "4242");
        assert_eq!(names.group(100), "users");
    }

    #[test]
    fn relative_paths_and_tilde_start_at_home() {
        assert_eq!(join("/home/user", "a.txt"), "/home/user/a.txt");
        assert_eq!(join("/home/user/", "d/a.txt"), "/home/user/d/a.txt");
        assert_eq!(join("/home/user", "~"), "/home/user");
        assert_eq!(join("/home/user", "~/x"), "/home/user/x");
        assert_eq!(join("/", "x"), "/x");
        // `~other` is a name like any other, not another user's home.
        assert_eq!(join("/root", "~other"), "/root/~other");
    }

    #[test]
    fn the_basic_user_is_read() {
        let mut h = HeaderMap::new();
        assert_eq!(basic_user(&h).unwrap(), None);
        h.insert(header::AUTHORIZATION, "Basic cm9vdDo=".parse().unwrap());
        assert_eq!(basic_user(&h).unwrap().as_deref(), Some("root"));
        h.insert(header::AUTHORIZATION, "Bearer x".parse().unwrap());
        assert!(basic_user(&h).is_err());
    }
}
