//! Isolation lanes behind [`runbox_core::Lane`].
//!
//! Today one lane: OCI runtimes (`runc`, `crun`, `runsc`) driven through
//! their command-line interface, with overlayfs roots and a network namespace
//! per run. The security-relevant parts are kept apart: [`spec`] decides what
//! a sandbox may do, [`seccomp`] which system calls it may make, [`open_net`]
//! what an `open` run may reach, [`trust`] how image files are read safely,
//! and [`netns`] how the daemon acts inside a run's network namespace.

pub mod agent_binary;
pub mod oci;
pub mod open_net;
pub mod probe;
pub mod seccomp;
pub mod spec;

// The host modules every lane uses live in `runbox-host`; re-exported under
// their old paths.
pub use runbox_host::{freezer, idmap, netns, storage, trust, usage, watch};

pub use netns::{bind_in_netns, EGRESS_PROXY_ADDR, EGRESS_PROXY_URL};
pub use oci::{OciLane, OciOptions};
pub use open_net::{OpenPool, Subnet};
pub use probe::{select, NoRuntime, Runtime};
pub use trust::{EXTRA_CA_PATH, TRUST_BUNDLE_PATH};
