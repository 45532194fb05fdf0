//! `calico` GC (CNI 1.1): given the runtime's valid attachments of this network, removes what
//! gone attachments left on this node: their WorkloadEndpoints (etcd; on Kubernetes the
//! pods are the endpoints and belong to the API server) and their addresses (Calico IPAM
//! in-process, or the IPAM plugin's own GC). Every step runs; all failures are reported in
//! one error.
//!
//! A WorkloadEndpoint counts as this network's when Calico IPAM holds a handle
//! `<network>.<containerID>` for its container on this node, or (outside Kubernetes) when
//! its profiles name the network; endpoints of other networks and other nodes are kept.

use tracing::{info, warn};

use crate::calico_ipam::call::Known;
use crate::call::client;
use crate::call::cluster_ready::check_datastore_ready;
use crate::config::identifiers::ORCH_K8S;
use crate::datastore::model::{Resource, WorkloadEndpointSpec};
use crate::datastore::resources::{delete_resource, list_resources};
use crate::datastore::{Datastore, Kind, ListKind};
use crate::error::{Error, GcError, Result};
use crate::ipam::allocator::gc::{node_handles, NodeHandles};
use crate::plugin::ipam::{pick, runs_in_process, GcScope, IpamDriver, IpamKind};
use crate::plugin::{identifiers, load};
use crate::skel::attachments::{self, Attachment};
use crate::skel::{CmdArgs, CniError};

pub async fn cmd_gc(args: &CmdArgs) -> Result<(), CniError> {
    let valid = attachments::valid_attachments(&args.stdin_data)?;
    let conf = load(args)?;
    let ds = client::connect(&conf).await?;
    // Nothing is collected while an upgrade has the datastore marked not ready.
    check_datastore_ready(&ds).await?;
    let node = conf.node_name();
    let network = conf.name.as_str();
    let ipam_type = conf.ipam.ipam_type.as_str();
    let kind = IpamKind::of(ipam_type);
    let cids = attachments::container_ids(&valid);
    let mut failures: Vec<Error> = Vec::new();

    let handles = if kind == IpamKind::Calico {
        match node_handles(&ds, &node, network).await {
            Ok(h) => Some(h),
            Err(e) => {
                failures.push(Error::chain("listing IPAM blocks", e));
                None
            }
        }
    } else {
        None
    };

    if !ds.is_kubernetes() {
        let empty = NodeHandles::default();
        let owned = handles.as_ref().unwrap_or(&empty);
        delete_stale_endpoints(&ds, &node, network, owned, &valid, &mut failures).await;
    }

    // GC names no container: the identifiers only complete the driver's inputs.
    let ids = identifiers(args, &conf).unwrap_or_default();
    let known = Known {
        conf: &conf,
        ids: &ids,
    };
    let in_process = runs_in_process(kind, ipam_type, &args.path);
    let scope = GcScope {
        node: &node,
        handles: handles.as_ref(),
        valid: &cids,
    };
    let ipam = pick(in_process, &ds, known, &args.stdin_data);
    failures.extend(ipam.gc(args, &scope).await);

    if failures.is_empty() {
        return Ok(());
    }
    Err(CniError::from(Error::from(GcError::Steps {
        network: network.to_string(),
        node,
        failures,
    })))
}

/// Whether an attachment (container ID, interface) is still valid. An attachment listed
/// without an interface name keeps all of its container's endpoints.
fn is_valid(valid: &[Attachment], container_id: &str, ifname: &str) -> bool {
    valid.iter().any(|a| {
        a.container_id == container_id
            && (a.ifname.is_empty() || ifname.is_empty() || a.ifname == ifname)
    })
}

/// Deletes this node's endpoints of `network` whose attachment is gone.
async fn delete_stale_endpoints<D: Datastore>(
    ds: &D,
    node: &str,
    network: &str,
    handles: &NodeHandles,
    valid: &[Attachment],
    failures: &mut Vec<Error>,
) {
    let what = ListKind::Resources {
        kind: Kind::WorkloadEndpoint,
        namespace: None,
        name_prefix: None,
    };
    let weps: Vec<Resource<WorkloadEndpointSpec>> = match list_resources(ds, &what).await {
        Ok(w) => w,
        Err(e) => {
            failures.push(Error::chain("listing WorkloadEndpoints", e));
            return;
        }
    };
    for wep in weps {
        let spec = &wep.spec;
        if spec.node != node || spec.container_id.is_empty() {
            continue;
        }
        let ours = handles.by_container.contains_key(&spec.container_id)
            || (spec.orchestrator != ORCH_K8S && spec.profiles.iter().any(|p| p == network));
        if !ours || is_valid(valid, &spec.container_id, &spec.endpoint) {
            continue;
        }
        let (ns, name) = (wep.metadata.namespace.as_str(), wep.metadata.name.as_str());
        let rev = (!wep.metadata.resource_version.is_empty())
            .then_some(wep.metadata.resource_version.as_str());
        match delete_resource(ds, Kind::WorkloadEndpoint, Some(ns), name, rev).await {
            Ok(()) => info!(
                namespace = ns,
                name, "GC: deleted the endpoint of a container that is gone"
            ),
            Err(e) if e.is_not_found() => {}
            Err(e) => {
                warn!(namespace = ns, name, error = %e, "GC: failed to delete an endpoint");
                failures.push(Error::chain(format!("WorkloadEndpoint {ns}/{name}"), e));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validity_by_container_and_interface() {
        let valid = vec![
            Attachment {
                container_id: "a".into(),
                ifname: "eth0".into(),
            },
            Attachment {
                container_id: "b".into(),
                ifname: String::new(),
            },
        ];
        assert!(is_valid(&valid, "a", "eth0"));
        assert!(!is_valid(&valid, "a", "eth1"));
        assert!(is_valid(&valid, "b", "eth7"));
        assert!(!is_valid(&valid, "c", "eth0"));
    }
}
