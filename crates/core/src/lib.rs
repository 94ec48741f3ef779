//! runbox's core: everything about runs that does not depend on how they are
//! isolated or how they are reached over HTTP.
//!
//! * [`runs::Manager`] keeps the registry of runs; each run has one owner
//!   task driving its lifecycle state machine ([`runs::phase`]), and exec
//!   and files go through each run's agent ([`runs::relay`]).
//! * [`lane::Lane`] is the boundary to an isolation lane (OCI runtimes
//!   today, microVMs later); lanes live in other crates.
//! * [`store::Store`] persists run records so runs survive a daemon restart.
//! * [`images::ImageStore`] holds imported root filesystems.
//! * [`validate`] holds the input rules the API enforces.
//!
//! It does not own sockets to clients, HTTP, or any runtime binary.

pub mod accounting;
pub mod builds;
mod catalog;
pub mod checkpoints;
pub mod config;
pub mod datasets;
mod durable;
pub mod egress;
pub mod error;
pub mod fleet;
pub mod images;
pub mod lane;
pub mod lease;
pub mod ledger;
pub mod pools;
pub mod preview;
pub mod request;
pub mod runs;
pub mod sealed;
pub mod service;
pub mod store;
pub mod telemetry;
pub mod tenants;
pub mod userns;
pub mod validate;
pub mod volumes;
pub mod warm;

pub use config::Config;
pub use error::CoreError;
pub use lane::Lane;
pub use runs::Manager;
pub use service::RunService;
