//! calico-cni-rs: a single-binary Rust re-implementation of Project Calico's CNI plugins.
//! `calico` (network plugin) and `calico-ipam` (IPAM plugin) share this library; `main.rs`
//! dispatches on argv[0].

pub mod client;
pub mod config;
pub mod dataplane;
pub mod datastore;
pub mod deadline;
pub mod error;
pub mod gocompat;
pub mod identifiers;
pub mod install;
pub mod ipam;
pub mod logging;
pub mod net;
pub mod plugin;
pub mod skel;
pub mod timefmt;

/// The version printed by `-v` and in the "about" text.
pub const VERSION: &str = concat!("v", env!("CARGO_PKG_VERSION"));
