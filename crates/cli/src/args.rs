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
