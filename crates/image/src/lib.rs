//! runbox's image store (being built; see the module docs).
//!
//! * [`unpack`] turns one layer archive into a directory that overlayfs can
//!   use as a lower layer, refusing anything that could write outside it.
//! * [`pull`] fetches images from OCI distribution registries.
//! * [`layout`] reads OCI image layouts and `docker save` tarballs.
//!
//! It owns image bytes on disk and nothing about runs.

pub mod capture;
pub mod diff;
pub mod layout;
pub mod pull;
pub mod store;
pub mod tree;
pub mod unpack;
