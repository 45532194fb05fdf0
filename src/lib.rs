//! calico-cni-rs: a single-binary Rust re-implementation of Project Calico's CNI plugins.
//! `calico` (network plugin, `plugin`), `calico-ipam` (IPAM plugin, `calico_ipam`) and the
//! node installer (`install`) share this library; `main.rs` dispatches on argv[0].
//!
//! Layers, each importing only from those below it (docs/architecture.md; the table is
//! `LAYERS` in tests/e2e/module_graph.rs): `plugin` and `install`; `calico_ipam`; `call`;
//! `error`; `delegate` and `dataplane`; `ipam`; `datastore`; `logging`; `config`; `skel`;
//! `support`.

pub mod calico_ipam;
pub mod call;
pub mod config;
pub mod dataplane;
pub mod datastore;
pub mod delegate;
pub mod error;
pub mod install;
pub mod ipam;
pub mod logging;
pub mod plugin;
pub mod skel;
pub mod support;
#[cfg(test)]
mod test_support;

/// The Calico release this build replaces: what upstream's `calico -v` prints.
pub const UPSTREAM_VERSION: &str = "v3.32.1";

/// The version printed by `-v` and in the "about" text: upstream's version string with ours
/// as semver build metadata, `v3.32.1+calico-cni-rs.<our version>`. One word, as upstream's
/// `-v` prints, and a tool comparing it as a semver sees exactly `v3.32.1` (build metadata
/// does not count in precedence), while a person sees which implementation runs.
pub const VERSION: &str = concat!("v3.32.1+calico-cni-rs.", env!("CARGO_PKG_VERSION"));

#[cfg(test)]
mod version_tests {
    #[test]
    fn version_names_the_release_it_replaces_then_ours() {
        let (upstream, ours) = super::VERSION.split_once('+').unwrap();
        assert_eq!(upstream, super::UPSTREAM_VERSION);
        assert_eq!(ours, format!("calico-cni-rs.{}", env!("CARGO_PKG_VERSION")));
        // Semver build metadata: dot-separated [0-9A-Za-z-] identifiers, none empty.
        assert!(ours
            .split('.')
            .all(|id| !id.is_empty() && id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')));
    }
}
