//! calico-cni-rs: a single-binary Rust re-implementation of Project Calico's CNI plugins.
//! `calico` (network plugin, `plugin`), `calico-ipam` (IPAM plugin, `ipam_plugin`) and the
//! node installer (`install`) share this library; `main.rs` dispatches on argv[0].
//!
//! Layers, each importing only from those below it: `skel` (CNI, nothing of Calico) and the
//! three entry modules; `ipam_driver` (the IPAM a `calico` call delegates to) and
//! `dataplane`; `ipam` (the allocator library) and `cluster_ready`; `datastore`; `config`,
//! `identifiers`, `net`, `deadline`, `encoding`, `logging`.

pub mod client;
pub mod cluster_ready;
pub mod config;
pub mod dataplane;
pub mod datastore;
pub mod deadline;
pub mod encoding;
pub mod error;
pub mod gocompat;
pub mod identifiers;
pub mod input_file;
pub mod install;
pub mod ipam;
pub mod ipam_driver;
pub mod ipam_plugin;
pub mod logging;
pub mod net;
pub mod plugin;
pub mod skel;
#[cfg(test)]
mod test_support;
pub mod timefmt;

/// The version printed by `-v` and in the "about" text.
pub const VERSION: &str = concat!("v", env!("CARGO_PKG_VERSION"));
