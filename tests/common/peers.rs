#![allow(dead_code)]
//! Where the programs the tests run beside ours are: the peers `make deps` builds from the Go
//! module proxy (tools/peers/build.sh: kube-apiserver and kubelet v1.35, containerd 2 and its
//! runc shim, critest and crictl, the reference CNI plugins), and the Calico manifests kept
//! in `shared/k8s` beside the clone (CRDs, the plugin's RBAC, the manifests' CNI templates).
//!
//! One place decides both: `CALICO_PEERS_BIN` overrides the peers' folder (default
//! `/var/cache/calico-cni-rs/peers/bin`, where `make deps` links the current build of each).

use std::path::{Path, PathBuf};

/// Where `make deps` links the peers it built.
const DEFAULT_PEERS_BIN: &str = "/var/cache/calico-cni-rs/peers/bin";

/// The peers' folder: `CALICO_PEERS_BIN`, else where `make deps` links them.
pub fn peers_bin() -> PathBuf {
    std::env::var_os("CALICO_PEERS_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_PEERS_BIN))
}

/// A peer program by name (`kube-apiserver`, `kubelet`, `containerd`, `critest`, `portmap`,
/// …), or why it is not there.
pub fn peer(name: &str) -> Result<PathBuf, String> {
    let path = peers_bin().join(name);
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "{} is absent: `make deps` builds it (tools/peers), CALICO_PEERS_BIN overrides",
            path.display()
        ))
    }
}

/// Every named peer, or why one is missing.
pub fn peers<const N: usize>(names: [&str; N]) -> Result<[PathBuf; N], String> {
    let mut out: [PathBuf; N] = std::array::from_fn(|_| PathBuf::new());
    for (slot, name) in out.iter_mut().zip(names) {
        *slot = peer(name)?;
    }
    Ok(out)
}

/// The data kept in `shared/k8s` beside the clone (Calico v3.32.1's CRDs, the plugin's RBAC,
/// the manifests' CNI templates): a file there, or why it is not there.
pub fn shared_k8s_file(name: &str) -> Result<PathBuf, String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../shared/k8s")
        .join(name);
    if path.exists() {
        Ok(path)
    } else {
        Err(format!(
            "{} is absent (shared/ beside the clone)",
            path.display()
        ))
    }
}
