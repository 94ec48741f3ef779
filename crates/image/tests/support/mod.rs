//! Shared helpers of the registry pull tests.
#![allow(dead_code)]

pub mod image;
pub mod registry;
pub mod sink;
pub mod token;
