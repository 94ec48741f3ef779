//! What every isolation lane needs from the host, whatever isolates its
//! runs: network namespaces ([`netns`]), the run store's per-run disks and
//! their snapshots ([`storage`]), the cgroup freezer ([`freezer`]), cgroup
//! usage ([`usage`]), CA bundles read safely out of an image ([`trust`]),
//! watching a sandbox's init through a pidfd ([`watch`]), overlay
//! mounts ([`mounts`]) and user namespaces with idmapped mounts ([`idmap`]). A lane crate (the OCI lane in `runbox-runtime`)
//! builds on these; none of them knows which lane calls it.

pub mod datasets;
pub mod freezer;
pub mod idmap;
pub mod mounts;
pub mod netns;
pub mod storage;
pub mod trust;
pub mod usage;
pub mod watch;
