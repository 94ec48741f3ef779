//! Small argument parsers shared by several subcommands.

use std::collections::BTreeMap;

use clap::Args;
use runbox_client::LeaseCredential;
use runbox_types::Env;

/// `--owner`/`--generation`: act under a writable lease. Needed while a lease
/// is active on the run; `runbox lease acquire` prints both.
#[derive(Clone, Debug, Default, Args)]
pub struct LeaseOpts {
    /// Lease holder to act as (with --generation)
    #[arg(
        long,
        env = "RUNBOX_LEASE_OWNER",
        value_name = "NAME",
        requires = "generation"
    )]
    pub owner: Option<String>,
    /// Generation of that holder's lease (with --owner)
    #[arg(
        long,
        env = "RUNBOX_LEASE_GENERATION",
        value_name = "N",
        requires = "owner"
    )]
    pub generation: Option<u64>,
}

impl LeaseOpts {
    /// The credential, when both parts were given.
    pub fn credential(&self) -> Option<LeaseCredential> {
        Some(LeaseCredential {
            owner: self.owner.clone()?,
            generation: self.generation?,
        })
    }
}

/// One `--env K=V` argument.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnvVar {
    /// The variable's name.
    pub name: String,
    /// Its value; may be empty, may contain `=`.
    pub value: String,
}

/// Parses `K=V`, splitting at the first `=` so that values may contain more.
/// Everything else (`K` alone, `=V`) is refused rather than guessed at; the
/// server checks the name's characters.
pub fn parse_env_var(arg: &str) -> Result<EnvVar, String> {
    match arg.split_once('=') {
        Some(("", _)) => Err(format!("{arg:?} has an empty variable name")),
        Some((name, value)) => Ok(EnvVar {
            name: name.to_owned(),
            value: value.to_owned(),
        }),
        None => Err(format!("{arg:?} is not of the form NAME=VALUE")),
    }
}

/// One `--egress-allow` / `--allow` value: an entry in the string grammar,
/// or a rule as JSON (`{"host": "db.example.com", "ports": [5432]}`).
pub fn parse_egress_entry(arg: &str) -> Result<runbox_types::EgressEntry, String> {
    if arg.trim_start().starts_with('{') {
        serde_json::from_str::<runbox_types::EgressRule>(arg)
            .map(runbox_types::EgressEntry::Rule)
            .map_err(|e| {
                format!(
                    "{arg:?} is not a rule {{host, ports?, methods?, secret?, intercept?}}: {e}"
                )
            })
    } else {
        Ok(runbox_types::EgressEntry::Text(arg.to_owned()))
    }
}

/// One `--secrets-file FILE`: the secrets the caller brings, read when the
/// command line is parsed (the values stay out of the command line, the
/// shell's history and `ps`).
#[derive(Clone, Debug)]
pub struct BroughtSecrets(pub Vec<runbox_types::BroughtSecret>);

/// Reads a JSON array of `{name, value, hosts, header, scheme?, methods?,
/// pathPrefixes?}` objects (or one such object). Errors name the file and
/// the JSON error, which never quotes a value.
pub fn parse_secrets_file(path: &str) -> Result<BroughtSecrets, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("reading {path}: {e}"))?;
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        Many(Vec<runbox_types::BroughtSecret>),
        One(runbox_types::BroughtSecret),
    }
    match serde_json::from_str::<OneOrMany>(&text) {
        Ok(OneOrMany::Many(v)) => Ok(BroughtSecrets(v)),
        Ok(OneOrMany::One(s)) => Ok(BroughtSecrets(vec![s])),
        Err(_) => {
            // The untagged error says nothing; the array's own does.
            let why = serde_json::from_str::<Vec<runbox_types::BroughtSecret>>(&text)
                .err()
                .map(|e| format!("line {} column {}: {}", e.line(), e.column(), redacted(&e)))
                .unwrap_or_default();
            Err(format!(
                "{path} is not a JSON array of secrets {{name, value, hosts, header, scheme?, \
                 methods?, pathPrefixes?}}: {why}"
            ))
        }
    }
}

/// A JSON error's category and position only: serde's message may quote
/// the text it failed on, which could be a value.
fn redacted(e: &serde_json::Error) -> String {
    let message = e.to_string();
    if message.starts_with("unknown field") || message.starts_with("missing field") {
        message
            .split(" at line")
            .next()
            .unwrap_or_default()
            .to_owned()
    } else {
        format!("{:?} error", e.classify()).to_lowercase()
    }
}

/// The request's `env`: `None` when no variable was given; the last of
/// repeated names wins, as in a shell.
pub fn env_map(vars: Vec<EnvVar>) -> Option<Env> {
    if vars.is_empty() {
        return None;
    }
    let map: BTreeMap<String, String> = vars.into_iter().map(|v| (v.name, v.value)).collect();
    Some(Env(map))
}

#[cfg(test)]
mod tests {
    #[test]
    fn secrets_files_hold_an_array_or_one_secret_and_errors_hide_values() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.json");
        let one = r#"{"name": "API_KEY", "value": "v4lue", "hosts": ["api.example.com"],
                      "header": "Authorization", "methods": ["GET"], "pathPrefixes": ["/"]}"#;
        std::fs::write(&path, format!("[{one}]")).unwrap();
        let p = path.to_str().unwrap();
        assert_eq!(super::parse_secrets_file(p).unwrap().0.len(), 1);
        std::fs::write(&path, one).unwrap();
        assert_eq!(super::parse_secrets_file(p).unwrap().0[0].name, "API_KEY");
        std::fs::write(
            &path,
            r#"[{"name": "A", "value": 42, "hosts": [], "header": "X"}]"#,
        )
        .unwrap();
        let err = super::parse_secrets_file(p).unwrap_err();
        assert!(err.contains("data error"), "{err}");
        std::fs::write(
            &path,
            r#"[{"name": "A", "value": "sekr1t", "hosts": [], "header": "X", "bad": 1}]"#,
        )
        .unwrap();
        let err = super::parse_secrets_file(p).unwrap_err();
        assert!(err.contains("unknown field `bad`"), "{err}");
        assert!(!err.contains("sekr1t"), "{err}");
        assert!(super::parse_secrets_file("/nonexistent/s.json").is_err());
    }

    use super::*;

    #[test]
    fn env_vars_split_at_the_first_equals_sign() {
        let var = parse_env_var("URL=http://x/?a=b").unwrap();
        assert_eq!(var.name, "URL");
        assert_eq!(var.value, "http://x/?a=b");
        assert_eq!(parse_env_var("EMPTY=").unwrap().value, "");
    }

    #[test]
    fn env_vars_without_a_name_or_equals_sign_are_refused() {
        assert!(parse_env_var("NAME").unwrap_err().contains("NAME=VALUE"));
        assert!(parse_env_var("=v")
            .unwrap_err()
            .contains("empty variable name"));
        assert!(parse_env_var("").is_err());
    }

    #[test]
    fn later_env_vars_override_earlier_ones() {
        assert_eq!(env_map(vec![]), None);
        let vars = ["A=1", "B=2", "A=3"].map(|a| parse_env_var(a).unwrap());
        let env = env_map(vars.to_vec()).unwrap();
        assert_eq!(env.0["A"], "3");
        assert_eq!(env.0.len(), 2);
    }
}
