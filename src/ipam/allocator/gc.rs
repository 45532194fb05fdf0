//! CNI 1.1 GC for Calico IPAM: releases this node's handles `<network>.<containerID>` whose
//! container is not among the runtime's valid attachments. Upstream has no GC verb (it
//! leaves leaked addresses to kube-controllers' periodic IPAM GC); this does the node's
//! share of that work when the runtime asks.
//!
//! What a handle belongs to is read from the blocks: each allocation records its handle and
//! the node it was made for (`secondary.node`). A handle is only ever released when it has
//! an allocation made for this node, is named `<network>.<containerID>` for this network,
//! is not a tunnel-address handle, and its container ID is not valid. Handles of other
//! nodes, other networks, the legacy (pre-v3) handles and tunnel addresses are never touched.

use std::collections::{BTreeMap, BTreeSet};

use tracing::{info, warn};

use crate::datastore::model::AllocationBlock;
use crate::datastore::{Datastore, ListKind};
use super::{Ipam, IpamError};

/// Handle-name prefixes of addresses calico/node assigns to tunnel devices.
const TUNNEL_HANDLE_PREFIXES: &[&str] = &[
    "ipip-tunnel-addr-",
    "vxlan-tunnel-addr-",
    "vxlan-v6-tunnel-addr-",
    "wireguard-tunnel-addr-",
    "wireguard-v6-tunnel-addr-",
];

/// This node's handles of one network, read from the blocks.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct NodeHandles {
    /// Container ID → handle, for every handle of this network with an allocation made for
    /// this node.
    pub by_container: BTreeMap<String, String>,
}

impl NodeHandles {
    /// The handles whose container is not valid.
    pub fn stale<'a>(&'a self, valid: &'a BTreeSet<String>) -> impl Iterator<Item = &'a str> {
        self.by_container
            .iter()
            .filter(|(cid, _)| !valid.contains(*cid))
            .map(|(_, h)| h.as_str())
    }
}

/// Whether `handle` names an address of a tunnel device.
pub fn is_tunnel_handle(handle: &str) -> bool {
    TUNNEL_HANDLE_PREFIXES.iter().any(|p| handle.starts_with(p))
}

/// The container ID of a handle `<network>.<containerID>` of this network.
pub fn container_of<'h>(handle: &'h str, network: &str) -> Option<&'h str> {
    if is_tunnel_handle(handle) {
        return None;
    }
    let cid = handle.strip_prefix(network)?.strip_prefix('.')?;
    (!cid.is_empty()).then_some(cid)
}

/// Lists the blocks and collects this node's handles of `network`.
pub async fn node_handles<D: Datastore>(
    ds: &D,
    node: &str,
    network: &str,
) -> Result<NodeHandles, IpamError> {
    let blocks = ds.list(&ListKind::Blocks { version: None }).await?;
    let mut out = NodeHandles::default();
    for kv in blocks {
        let block: AllocationBlock = match serde_json::from_value(kv.value) {
            Ok(b) => b,
            Err(e) => {
                warn!(key = %kv.key.describe(), error = %e, "GC: skipping a block that does not decode");
                continue;
            }
        };
        let attrs = block.attributes.as_deref().unwrap_or_default();
        for attr_index in block.allocations.iter().flatten() {
            let Some(attr) = attrs.get(*attr_index) else {
                continue;
            };
            let (Some(handle), Some(owner)) = (
                attr.handle_id.as_deref(),
                attr.secondary.as_ref().and_then(|s| s.get("node")),
            ) else {
                continue;
            };
            if owner != node {
                continue;
            }
            if let Some(cid) = container_of(handle, network) {
                out.by_container.insert(cid.to_string(), handle.to_string());
            }
        }
    }
    Ok(out)
}

/// What one GC released and what it could not.
#[derive(Debug, Default)]
pub struct GcOutcome {
    pub released: Vec<String>,
    /// One line per failure (`<handle>: <error>`).
    pub failures: Vec<String>,
}

/// Releases every stale handle of `handles`, carrying on past failures. The caller holds
/// the host's IPAM lock.
pub async fn release_stale<D: Datastore>(
    ds: &D,
    node: &str,
    handles: &NodeHandles,
    valid: &BTreeSet<String>,
) -> GcOutcome {
    let ipam = Ipam::new(ds, node);
    let mut out = GcOutcome::default();
    for handle in handles.stale(valid) {
        match ipam.release_by_handle(handle).await {
            Ok(()) => {
                info!(
                    handle,
                    "GC: released the addresses of a container that is gone"
                );
                out.released.push(handle.to_string());
            }
            Err(IpamError::Datastore(e)) if e.is_not_found() => {
                out.released.push(handle.to_string());
            }
            Err(e) => {
                warn!(handle, error = %e, "GC: failed to release a handle");
                out.failures.push(format!("{handle}: {e}"));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handle_names() {
        assert_eq!(
            container_of("k8s-pod-network.abc", "k8s-pod-network"),
            Some("abc")
        );
        assert_eq!(container_of("k8s-pod-network.", "k8s-pod-network"), None);
        assert_eq!(container_of("other-net.abc", "k8s-pod-network"), None);
        assert_eq!(
            container_of("k8s-pod-networkx.abc", "k8s-pod-network"),
            None
        );
        assert_eq!(container_of("abc", "k8s-pod-network"), None);
        assert_eq!(
            container_of("ipip-tunnel-addr-node1", "ipip-tunnel-addr-node1"),
            None
        );
        assert!(is_tunnel_handle("vxlan-tunnel-addr-n"));
        assert!(is_tunnel_handle("wireguard-tunnel-addr-n"));
        assert!(!is_tunnel_handle("k8s-pod-network.x"));
        let h = NodeHandles {
            by_container: BTreeMap::from([
                ("a".to_string(), "n.a".to_string()),
                ("b".to_string(), "n.b".to_string()),
            ]),
        };
        let valid = BTreeSet::from(["a".to_string()]);
        assert_eq!(h.stale(&valid).collect::<Vec<_>>(), vec!["n.b"]);
    }
}
