//! CNI 1.1 GC for Calico IPAM: releases this node's handles `<network>.<containerID>` whose
//! container is not among the runtime's valid attachments. Upstream has no GC verb (it
//! leaves leaked addresses to kube-controllers' periodic IPAM GC); this does the node's
//! share of that work when the runtime asks.
//!
//! What a handle belongs to is read from the blocks: each allocation records its handle and
//! the node it was made for (`secondary.node`). A handle is released only when it is provably
//! a container's on this node and network: named `<network>.<containerID>`, every one of its
//! allocations made for this node and carrying no KubeVirt owner, not a tunnel address, and
//! its container ID not valid. Anything else is kept: other nodes' and networks' handles, the
//! legacy (pre-v3) handles, tunnel addresses, and a KubeVirt VM's persistent handle
//! `<network>.vmi.<namespace>.<vm>` (its VM outlives any one pod, so it is never among a
//! runtime's attachments; releasing it would let the address be handed out twice).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use tracing::{debug, info, warn};

use super::{Ipam, IpamError};
use crate::datastore::model::AllocationBlock;
use crate::datastore::{Datastore, ListKind};

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
    /// Handle → the addresses the blocks record for it (to release a handle whose own
    /// object is gone, by address).
    pub addresses: BTreeMap<String, Vec<IpAddr>>,
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

/// The allocation attributes that mark a KubeVirt VM's address (libcalico-go's
/// `IPAMBlockAttributeVMIName` and friends).
const VM_ATTRIBUTES: &[&str] = &["vmi-name", "vmi-uid", "vm-uid", "vmim-uid"];

/// Whether `rest` (a handle after `<network>.`) has the shape of a KubeVirt VM's handle.
pub fn is_vm_handle_rest(rest: &str) -> bool {
    rest.starts_with("vmi.")
}

/// Whether `id` has the characters a runtime's container ID may have (CNI: alphanumerics,
/// `_`, `-` and `.`).
fn is_container_id_shape(id: &str) -> bool {
    !id.is_empty()
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

/// Whether `handle` names an address of a tunnel device.
pub fn is_tunnel_handle(handle: &str) -> bool {
    TUNNEL_HANDLE_PREFIXES.iter().any(|p| handle.starts_with(p))
}

/// The container ID of a handle `<network>.<containerID>` of this network; `None` for any
/// other shape (a VM's handle among them).
pub fn container_of<'h>(handle: &'h str, network: &str) -> Option<&'h str> {
    if is_tunnel_handle(handle) {
        return None;
    }
    let cid = handle.strip_prefix(network)?.strip_prefix('.')?;
    (is_container_id_shape(cid) && !is_vm_handle_rest(cid)).then_some(cid)
}

/// Why an allocation of this network's handle is not a container's on this node, if it
/// is not.
fn not_a_container_here(
    attr: &crate::datastore::model::AllocationAttribute,
    handle: &str,
    network: &str,
    node: &str,
) -> Option<&'static str> {
    let owner = attr.secondary.as_ref().and_then(|s| s.get("node"));
    let vm_owned = [attr.secondary.as_ref(), attr.alternate_owner_attrs.as_ref()]
        .into_iter()
        .flatten()
        .any(|attrs| VM_ATTRIBUTES.iter().any(|k| attrs.contains_key(*k)));
    if vm_owned || attr.alternate_owner_attrs.is_some() {
        Some("a KubeVirt VM's address")
    } else if owner.map(String::as_str) != Some(node) {
        Some("allocated for another node")
    } else if container_of(handle, network).is_none() {
        Some("not a container's handle")
    } else {
        None
    }
}

/// Lists the blocks and collects this node's handles of `network`.
pub async fn node_handles<D: Datastore>(
    ds: &D,
    node: &str,
    network: &str,
) -> Result<NodeHandles, IpamError> {
    let blocks = ds.list(&ListKind::Blocks { version: None }).await?;
    let mut out = NodeHandles::default();
    // Handles with an allocation that is not a container's here, and why.
    let mut kept: BTreeMap<String, &'static str> = BTreeMap::new();
    for kv in blocks {
        let block: AllocationBlock = match serde_json::from_value(kv.value) {
            Ok(b) => b,
            Err(e) => {
                warn!(key = %kv.key.describe(), error = %e, "GC: skipping a block that does not decode");
                continue;
            }
        };
        let attrs = block.attributes.as_deref().unwrap_or_default();
        for (ordinal, attr_index) in block.allocations.iter().enumerate() {
            let Some(attr) = attr_index.and_then(|i| attrs.get(i)) else {
                continue;
            };
            // Only this network's handles are GC's business; the rest are not even looked at.
            let Some(handle) = attr.handle_id.as_deref() else {
                continue;
            };
            if !handle
                .strip_prefix(network)
                .is_some_and(|rest| rest.starts_with('.'))
            {
                continue;
            }
            if let Some(why) = not_a_container_here(attr, handle, network, node) {
                kept.entry(handle.to_string()).or_insert(why);
                continue;
            }
            if let Some(cid) = container_of(handle, network) {
                out.by_container.insert(cid.to_string(), handle.to_string());
                out.addresses
                    .entry(handle.to_string())
                    .or_default()
                    .push(block.ip_of(ordinal));
            }
        }
    }
    for (handle, why) in &kept {
        if out.addresses.remove(handle).is_some() {
            out.by_container.retain(|_, h| h != handle);
        }
        if *why == "allocated for another node" {
            debug!(handle = %handle, why, "GC: keeping a handle");
        } else {
            info!(handle = %handle, why, "GC: keeping a handle");
        }
    }
    Ok(out)
}

/// What one GC released and what it could not.
#[derive(Debug, Default)]
pub struct GcOutcome {
    pub released: Vec<String>,
    pub failures: Vec<HandleNotReleased>,
}

/// A stale handle GC could not release.
#[derive(Debug, thiserror::Error)]
#[error("{handle}: {source}")]
pub struct HandleNotReleased {
    pub handle: String,
    #[source]
    pub source: IpamError,
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
        let released = match ipam.release_by_handle(handle).await {
            // The handle object is gone but the blocks still name it: release by address,
            // only where a block still records this handle.
            Err(IpamError::Datastore(e)) if e.is_not_found() => {
                let ips = handles.addresses.get(handle).map(Vec::as_slice);
                ipam.release_ips(ips.unwrap_or_default(), Some(handle))
                    .await
                    .map(|_| ())
            }
            other => other,
        };
        match released {
            Ok(()) => {
                info!(
                    handle,
                    "GC: released the addresses of a container that is gone"
                );
                out.released.push(handle.to_string());
            }
            Err(e) => {
                warn!(handle, error = %e, "GC: failed to release a handle");
                out.failures.push(HandleNotReleased {
                    handle: handle.to_string(),
                    source: e,
                });
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
        // A KubeVirt VM's handle is never a container's.
        assert_eq!(
            container_of("k8s-pod-network.vmi.default.vm1", "k8s-pod-network"),
            None
        );
        assert_eq!(container_of("k8s-pod-network.a/b", "k8s-pod-network"), None);
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
            ..Default::default()
        };
        let valid = BTreeSet::from(["a".to_string()]);
        assert_eq!(h.stale(&valid).collect::<Vec<_>>(), vec!["n.b"]);
    }

    fn attr(v: serde_json::Value) -> crate::datastore::model::AllocationAttribute {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn only_a_container_here_is_collectable() {
        let why = |v| not_a_container_here(&attr(v), "net.c1", "net", "node1");
        assert_eq!(
            why(serde_json::json!({"secondary": {"node": "node1"}})),
            None
        );
        assert_eq!(
            why(serde_json::json!({"secondary": {"node": "node2"}})),
            Some("allocated for another node")
        );
        assert_eq!(
            why(serde_json::json!({})),
            Some("allocated for another node")
        );
        assert_eq!(
            why(serde_json::json!({"secondary": {"node": "node1", "vmi-name": "vm"}})),
            Some("a KubeVirt VM's address")
        );
        assert_eq!(
            why(serde_json::json!({"secondary": {"node": "node1"},
                "alternateOwnerAttrs": {"node": "node2"}})),
            Some("a KubeVirt VM's address")
        );
        let vm = attr(serde_json::json!({"secondary": {"node": "node1"}}));
        assert_eq!(
            not_a_container_here(&vm, "net.vmi.ns.vm", "net", "node1"),
            Some("not a container's handle")
        );
    }
}
