//! calico-ipam CHECK and GC.

use std::borrow::Cow;
use std::net::IpAddr;

use super::call::IpamCall;
use super::kube_reads::KubeReads;
use super::vm::{persistent_vm, VmVerb};
use crate::calico_ipam::kubevirt;
use crate::config::identifiers::WepIdentifiers;
use crate::config::NetConf;
use crate::datastore::Datastore;
use crate::error::{Context, Result};
use crate::ipam::allocator::gc::{GcOutcome, NodeHandles};
use crate::ipam::allocator::Ipam;
use crate::ipam::lock::IpamLock;
use crate::skel::CniResult;

/// The IPAM half of CHECK, shared with `calico`'s in-process path: the container's handle,
/// or a KubeVirt VM's pod's VM handle, holds the previous result's addresses.
pub async fn check_with<D: KubeReads>(
    ds: &D,
    conf: &NetConf,
    ids: &WepIdentifiers,
    prev: &CniResult,
) -> Result<()> {
    let ips: Vec<IpAddr> = prev.ips.iter().map(|i| i.address.addr).collect();
    let mut handle = ids.handle_id(&conf.name);
    if kubevirt::may_be_vm_pod(ids) {
        let call = IpamCall {
            conf: Cow::Borrowed(conf),
            ids: Cow::Borrowed(ids),
        };
        let detected = ds
            .detect_vm(&call.conf, &call.ids, None, false)
            .await
            .context("CHECK")?;
        if let Some(vmi) =
            persistent_vm(&Ipam::new(ds, &ids.node), detected, VmVerb::DelOrCheck).await?
        {
            handle = vmi.handle_id(&conf.name);
        }
    }
    crate::ipam::verify::handle_holds(ds, &handle, &ips)
        .await
        .context("CHECK")
}

/// Releases the stale handles of `handles` under the host's IPAM lock.
pub async fn gc_with<D: Datastore>(
    ds: &D,
    conf: &NetConf,
    node: &str,
    handles: &NodeHandles,
    valid: &std::collections::BTreeSet<String>,
) -> GcOutcome {
    let _lock = IpamLock::acquire(conf.ipam_lock_file()).await;
    crate::ipam::allocator::gc::release_stale(ds, node, handles, valid).await
}
