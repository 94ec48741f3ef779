//! Who a command runs as: a user spec (`name`, `uid`, `name:group`,
//! `uid:gid`, as Docker and OCI images write `User`) resolved against the
//! run's own `/etc/passwd` and `/etc/group`.
//!
//! A name must exist in those files; a number need not (it runs with group
//! 0 then, as Docker does). Supplementary groups are the groups that list
//! the user by name. Parsed by hand because the files are the run's (a
//! libc lookup would consult NSS modules the agent must not load), and the
//! format is seven and four colon-separated fields.

/// The most of `/etc/passwd` or `/etc/group` read.
const MAX_FILE: u64 = 4 << 20;

/// A resolved identity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups (the primary one included).
    pub groups: Vec<u32>,
    /// The home directory from `/etc/passwd`, when the user is there.
    pub home: Option<String>,
}

/// A passwd line's fields we use.
struct Passwd {
    name: String,
    uid: u32,
    gid: u32,
    home: String,
}

fn read(path: &str) -> String {
    use std::io::Read;
    let mut text = String::new();
    if let Ok(file) = std::fs::File::open(path) {
        let _ = file.take(MAX_FILE).read_to_string(&mut text);
    }
    text
}

fn passwd(text: &str) -> impl Iterator<Item = Passwd> + '_ {
    text.lines().filter_map(|line| {
        let f: Vec<&str> = line.split(':').collect();
        if f.len() < 7 {
            return None;
        }
        Some(Passwd {
            name: f[0].to_owned(),
            uid: f[2].parse().ok()?,
            gid: f[3].parse().ok()?,
            home: f[5].to_owned(),
        })
    })
}

/// `(name, gid, members)` of each group line.
fn groups(text: &str) -> impl Iterator<Item = (String, u32, Vec<String>)> + '_ {
    text.lines().filter_map(|line| {
        let f: Vec<&str> = line.split(':').collect();
        if f.len() < 4 {
            return None;
        }
        let members = f[3]
            .split(',')
            .filter(|m| !m.is_empty())
            .map(str::to_owned)
            .collect();
        Some((f[0].to_owned(), f[2].parse().ok()?, members))
    })
}

/// The owner of what a file call makes: the user `spec` names (see
/// [`resolve`]), or None for an empty spec (the agent's own, root).
pub fn owner(spec: &str) -> Result<Option<runbox_confine::ops::Owner>, runbox_confine::FileError> {
    if spec.is_empty() {
        return Ok(None);
    }
    let identity = resolve(spec).map_err(runbox_confine::FileError::BadUser)?;
    Ok(Some(runbox_confine::ops::Owner {
        uid: identity.uid,
        gid: identity.gid,
    }))
}

/// Resolves `spec` with the run's account files; `Err` says what is wrong.
pub fn resolve(spec: &str) -> Result<Identity, String> {
    resolve_with(spec, &read("/etc/passwd"), &read("/etc/group"))
}

/// [`resolve`] against given file contents.
pub fn resolve_with(spec: &str, passwd_text: &str, group_text: &str) -> Result<Identity, String> {
    if spec.is_empty() || spec.len() > 256 || spec.chars().any(char::is_control) {
        return Err(format!("user {spec:?} is not a user name or id"));
    }
    let (user, group) = match spec.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (spec, None),
    };
    let entry = match user.parse::<u32>() {
        Ok(uid) => passwd(passwd_text).find(|p| p.uid == uid),
        Err(_) => Some(
            passwd(passwd_text)
                .find(|p| p.name == user)
                .ok_or_else(|| format!("no user {user:?} in the run's /etc/passwd"))?,
        ),
    };
    let uid = match (&entry, user.parse::<u32>()) {
        (_, Ok(uid)) => uid,
        (Some(p), _) => p.uid,
        (None, Err(_)) => unreachable!("a name without an entry is refused above"),
    };
    let gid = match group {
        Some("") => return Err(format!("user {spec:?} has an empty group")),
        Some(g) => match g.parse::<u32>() {
            Ok(gid) => gid,
            Err(_) => groups(group_text)
                .find(|(name, _, _)| name == g)
                .map(|(_, gid, _)| gid)
                .ok_or_else(|| format!("no group {g:?} in the run's /etc/group"))?,
        },
        None => entry.as_ref().map_or(0, |p| p.gid),
    };
    let mut all = vec![gid];
    if let (Some(p), None) = (&entry, group) {
        for (_, g, members) in groups(group_text) {
            if members.contains(&p.name) && !all.contains(&g) {
                all.push(g);
            }
        }
    }
    Ok(Identity {
        uid,
        gid,
        groups: all,
        home: entry.map(|p| p.home),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str =
        "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000::/home/app:/bin/sh\nbroken line\n";
    const GROUP: &str = "root:x:0:\napp:x:1000:\ndocker:x:999:app,other\nstaff:x:50:\n";

    #[test]
    fn names_and_numbers_resolve_as_docker_does() {
        let app = resolve_with("app", PASSWD, GROUP).unwrap();
        assert_eq!(
            (app.uid, app.gid, app.groups.clone()),
            (1000, 1000, vec![1000, 999])
        );
        assert_eq!(app.home.as_deref(), Some("/home/app"));
        let numeric = resolve_with("1000", PASSWD, GROUP).unwrap();
        assert_eq!(numeric.home.as_deref(), Some("/home/app"));
        let stranger = resolve_with("4242", PASSWD, GROUP).unwrap();
        assert_eq!((stranger.uid, stranger.gid, stranger.home), (4242, 0, None));
        let with_group = resolve_with("app:staff", PASSWD, GROUP).unwrap();
        assert_eq!((with_group.gid, with_group.groups), (50, vec![50]));
        assert_eq!(resolve_with("5:7", PASSWD, GROUP).unwrap().gid, 7);
    }

    #[test]
    fn unknown_names_and_junk_are_refused() {
        for spec in ["nobody", "app:nogroup", "app:", "", "a\nb"] {
            assert!(resolve_with(spec, PASSWD, GROUP).is_err(), "{spec:?}");
        }
    }
}
