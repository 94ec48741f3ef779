//! Isolation drivers behind [`runbox_core::Backend`].
//!
//! Today one lane: OCI runtimes (`runc`, `crun`, `runsc`) driven through
//! their command-line interface, with overlayfs roots and a network namespace
//! per run. The security-relevant parts are kept apart: [`spec`] decides what
//! a sandbox may do, [`seccomp`] which system calls it may make.

pub mod agent_binary;
pub mod oci;
pub mod probe;
pub mod seccomp;
pub mod spec;

pub use oci::OciBackend;
pub use probe::{select, NoRuntime, Runtime};
