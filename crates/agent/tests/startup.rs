//! Starting the agent: the command line, the inherited listening socket the
//! daemon uses, and refusing to run on a descriptor that cannot serve.

mod common;

use std::process::{Command, Stdio};

use common::*;

fn agent_command() -> Command {
    Command::new(env!("CARGO_BIN_EXE_runbox-agent"))
}

#[test]
fn version_flag_prints_version() {
    let output = agent_command().arg("--version").output().unwrap();
    assert!(output.status.success());
    assert_eq!(
        String::from_utf8(output.stdout).unwrap(),
        format!("runbox-agent {}\n", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn usage_errors_exit_2() {
    for args in [&[][..], &["--bogus"], &["--listen-fd", "x"]] {
        let output = agent_command().args(args).output().unwrap();
        assert_eq!(output.status.code(), Some(2), "{args:?}");
        assert!(String::from_utf8_lossy(&output.stderr).contains("usage:"));
    }
}

#[test]
fn refuses_a_descriptor_that_is_not_a_listening_socket() {
    let dir = tempfile::tempdir().unwrap();
    // fd 0 is /dev/null here.
    let output = agent_command()
        .args(["--listen-fd", "0", "--work-dir"])
        .arg(dir.path().join("work"))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("fd 0 is not a listening Unix socket"),
        "{stderr}"
    );
}

#[tokio::test]
async fn serves_on_an_inherited_socket_and_creates_the_work_dir() {
    let mut agent = TestAgent::start_on_inherited_fd().await;
    assert!(agent.work.is_dir());
    let out = exec(&mut agent.client, start(&["pwd"])).await;
    assert_eq!(out.stdout_str().trim(), agent.work.to_str().unwrap());

    // The listening socket is not leaked into commands.
    let out = exec(&mut agent.client, sh("ls /proc/self/fd")).await;
    let mut fds: Vec<u32> = out
        .stdout_str()
        .split_whitespace()
        .map(|fd| fd.parse().unwrap())
        .collect();
    fds.sort();
    // 0-2 plus the descriptor `ls` opened to list the directory.
    assert_eq!(fds.len(), 4, "unexpected descriptors {fds:?}");
    assert_eq!(&fds[..3], [0, 1, 2]);
}
