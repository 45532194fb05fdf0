//! calico-ipam DEL: releases the handle `<network>.<containerID>`, then the legacy one (a
//! KubeVirt VM's pod only stops owning the VM's addresses, `vm.rs`); and the `calico`
//! plugin's release of exactly the addresses a failed ADD assigned.

use std::net::IpAddr;

use tracing::{info, warn};

use super::call::{call_for, with_timeout, IpamCall};
use super::kube_reads::KubeReads;
use super::vm::{persistent_vm, release_vm, VmVerb};
use crate::datastore::{Datastore, Key};
use crate::error::{Error, Result};
use crate::ipam::allocator::{Ipam, IpamError};
use crate::ipam::lock::{peek_pending, IpamLock};
use crate::skel::CmdArgs;

/// Gives back exactly these addresses, and only where they still belong to this call's
/// handle: the rollback of a failed `calico` ADD. Unlike a DEL (which releases the whole
/// handle `<network>.<containerID>`), this never frees an address that another ADD of the
/// same sandbox holds under the same handle. A KubeVirt VM's pod's addresses are the VM's:
/// the pod only stops owning them, as its DEL would (upstream runs IPAM DEL here).
pub async fn release_addresses<D: KubeReads>(ds: &D, args: &CmdArgs, ips: &[IpAddr]) -> Result<()> {
    let call = call_for(args, None, false)?;
    let detected = ds.detect_vm(&call.conf, &call.ids, None, true).await?;
    if let Some(vmi) =
        persistent_vm(&Ipam::new(ds, &call.ids.node), detected, VmVerb::DelOrCheck).await?
    {
        info!(
            ?ips,
            "a VM's pod failed its ADD: it stops owning the VM's addresses"
        );
        return release_vm(ds, &call, &vmi).await;
    }
    let handle = call.ids.handle_id(&call.conf.name);
    let ipam = Ipam::new(ds, &call.ids.node);
    let lock = IpamLock::acquire(call.conf.ipam_lock_file()).await;
    ipam.keep_journal(lock.journal());
    info!(handle, ?ips, "releasing the addresses this call assigned");
    let not_ours = with_timeout(ipam.release_ips(ips, Some(&handle))).await??;
    if !not_ours.is_empty() {
        warn!(
            ?not_ours,
            "addresses no longer held by this handle were left alone"
        );
    }
    Ok(())
}

/// Releases these addresses whoever holds them (upstream `releaseIPAddrs` before an
/// `ipAddrs` re-ADD). Addresses not allocated are only logged.
pub async fn release_any<D: Datastore>(ds: &D, args: &CmdArgs, ips: &[IpAddr]) -> Result<()> {
    let call = call_for(args, None, false)?;
    let ipam = Ipam::new(ds, &call.ids.node);
    let lock = IpamLock::acquire(call.conf.ipam_lock_file()).await;
    ipam.keep_journal(lock.journal());
    let unallocated = with_timeout(ipam.release_ips(ips, None)).await??;
    if !unallocated.is_empty() {
        warn!(
            ?unallocated,
            "Asked to release address but it doesn't exist."
        );
    }
    Ok(())
}

/// DEL's release: the handle `<network>.<containerID>`, then the legacy one, within one 90 s
/// budget; a handle that does not exist is success.
///
/// Both handles are read together (one round trip) before the host's IPAM lock is taken:
/// a handle belongs to one container (a write to one that moved meanwhile loses its
/// compare-and-swap and reads it again), while the lock only spares contention on the host's
/// blocks. It is then held for the block reads and writes, one round trip shorter than
/// upstream's (which takes it first), and not at all when neither handle exists (a repeated
/// DEL).
pub async fn release<D: KubeReads>(ds: &D, call: &IpamCall<'_>) -> Result<()> {
    let detected = ds.detect_vm(&call.conf, &call.ids, None, true).await?;
    if let Some(vmi) =
        persistent_vm(&Ipam::new(ds, &call.ids.node), detected, VmVerb::DelOrCheck).await?
    {
        release_vm(ds, call, &vmi).await?;
    }
    // Also a VM's pod: its container's handle, had it one (persistence turned on since).
    release_container_handles(ds, call).await
}

/// The handle `<network>.<containerID>`, then the legacy one (see `release`).
async fn release_container_handles<D: Datastore>(ds: &D, call: &IpamCall<'_>) -> Result<()> {
    let (conf, ids) = (&*call.conf, &*call.ids);
    let ipam = Ipam::new(ds, &ids.node);
    let handles = [ids.handle_id(&conf.name), ids.legacy_handle_id()];
    let keys = handles.clone().map(|id| Key::Handle { id });
    let (first, legacy) =
        with_timeout(async { tokio::join!(ds.get(&keys[0]), ds.get(&keys[1])) }).await?;
    let held = [first, legacy]
        .into_iter()
        .zip(&handles)
        .filter_map(|(read, handle)| match read {
            Err(e) if e.is_not_found() => {
                info!(handle, "no addresses held by this handle");
                None
            }
            read => Some((handle, read)),
        })
        .collect::<Vec<_>>();
    // A block written beside a handle that did not land (`Journal::intend`) holds addresses
    // for it too.
    let pending = peek_pending(conf.ipam_lock_file(), &handles);
    if held.is_empty() && !pending {
        return Ok(());
    }
    let lock = IpamLock::acquire(conf.ipam_lock_file()).await;
    // The blocks it writes are kept for the next holder (`BlockCopies`).
    ipam.keep_journal(lock.journal());
    with_timeout(async {
        // In upstream's order: `<network>.<containerID>`, then the legacy one.
        for (handle, read) in held {
            info!(handle, "releasing addresses");
            let released = match read {
                Ok(kv) => ipam.release_read_handle(handle, kv).await,
                Err(e) => Err(IpamError::Datastore(e)),
            };
            match released {
                Ok(()) => {}
                Err(IpamError::Datastore(e)) if e.is_not_found() => {
                    info!(handle, "no addresses held by this handle");
                }
                Err(e) => return Err(Error::from(e)),
            }
        }
        // Then the blocks pending for either handle; their records go once released.
        for handle in &handles {
            let blocks = lock.pending_for(handle);
            for cidr in &blocks {
                let n = ipam.release_in_block(handle, *cidr).await?;
                if n > 0 {
                    info!(handle, block = %cidr, released = n, "released addresses a block held without their handle");
                }
            }
            if !blocks.is_empty() {
                lock.settle(handle);
            }
        }
        Ok(())
    })
    .await?
}
