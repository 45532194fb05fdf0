//! A KubeVirt VM's addresses (`kubevirt.rs` tells the VM): the VM keeps them across its
//! pods, which own them in turn (the active owner, a live migration's target the alternate).

use std::collections::BTreeMap;

use tracing::{info, warn};

use super::call::{with_timeout, IpamCall};
use crate::calico_ipam::kubevirt::{Detected, Vmi};
use crate::datastore::Datastore;
use crate::error::{Error, Result, VmError};
use crate::ipam::allocator::{Ipam, IpamError};
use crate::ipam::lock::IpamLock;
use crate::ipam::owner::{Change, Owner, OwnerUpdate};
use crate::skel::result::{IpConfig, Route};
use crate::skel::CniResult;
use crate::support::net::IpNet;

/// Which verb asks for a pod's persistent VM (`persistent_vm`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum VmVerb {
    Add,
    DelOrCheck,
}

/// The VM whose addresses persist: a detected VM with `kubeVirtVMAddressPersistence` on.
/// With it off, a VM's pod is an ordinary pod, but an ADD of a migration target is refused
/// (it would get other addresses than the VM it takes over); its DEL and CHECK are an
/// ordinary pod's, as upstream's.
pub(super) async fn persistent_vm<D: Datastore>(
    ipam: &Ipam<'_, D>,
    detected: Detected,
    verb: VmVerb,
) -> Result<Option<Vmi>> {
    let Detected::Vm(vmi) = detected else {
        return Ok(None);
    };
    if ipam.vm_address_persistence().await {
        return Ok(Some(vmi));
    }
    if verb == VmVerb::Add && vmi.is_migration_target() {
        info!("Live migration target pod rejected: KubeVirtVMAddressPersistence is disabled");
        return Err(VmError::MigrationWithoutPersistence.into());
    }
    Ok(None)
}

/// A VM's pod gets the addresses its handle holds, if any, as their owner: the active one,
/// or for a live migration's target the alternate one (whose result has no routes: the
/// source's host still routes to the VM until the migration completes). Overwritten
/// whatever was there, as upstream (a stuck old pod, a failed migration's target).
pub(super) async fn reuse_vm_addresses<D: Datastore>(
    ipam: &Ipam<'_, D>,
    vmi: &Vmi,
    handle: &str,
    attrs: &BTreeMap<String, String>,
) -> Result<Option<CniResult>> {
    let mut held = match ipam.ips_by_handle(handle).await {
        Ok(h) => h,
        Err(IpamError::Datastore(e)) if e.is_not_found() => Vec::new(),
        Err(e) => {
            return Err(Error::chain(
                format!("failed to get existing IPs for VM handle {handle}"),
                e,
            ))
        }
    };
    let target = vmi.is_migration_target();
    if held.is_empty() {
        if target {
            return Err(VmError::MigrationWithoutAddresses(handle.to_string()).into());
        }
        return Ok(None);
    }
    held.sort_by_key(|ip| (ip.version(), ip.addr));
    let owner = Change::Set(attrs.clone());
    let update = match target {
        true => OwnerUpdate {
            alternate: owner,
            ..Default::default()
        },
        false => OwnerUpdate {
            active: owner,
            ..Default::default()
        },
    };
    let mut result = CniResult::default();
    for ip in &held {
        ipam.set_owners(ip.addr, ip.masked(), handle, &update)
            .await
            .map_err(|e| {
                Error::chain(
                    format!("failed to set owner attributes for IP {}", ip.addr),
                    e,
                )
            })?;
        let address = IpNet::host(ip.addr);
        result.ips.push(IpConfig {
            address,
            gateway: None,
            interface: None,
        });
        if !target {
            result.routes.push(Route {
                dst: address,
                gw: None,
            });
        }
    }
    info!(handle, addresses = ?held, migration_target = target, "the VM keeps its addresses");
    Ok(Some(result))
}

/// A VM's pod's DEL: this pod stops owning the VM's addresses (only where it still is their
/// owner), and they are released only when the VM is going away and no pod owns them any
/// more. A handle already gone is success (upstream's DEL fails there forever).
pub(super) async fn release_vm<D: Datastore>(ds: &D, call: &IpamCall<'_>, vmi: &Vmi) -> Result<()> {
    let handle = vmi.handle_id(&call.conf.name);
    let ipam = Ipam::new(ds, &call.ids.node);
    let me = Owner {
        namespace: call.ids.namespace.clone(),
        pod: call.ids.pod.clone(),
    };
    let _lock = IpamLock::acquire(call.conf.ipam_lock_file()).await;
    with_timeout(async {
        let held = match ipam.ips_by_handle(&handle).await {
            Ok(h) => h,
            Err(IpamError::Datastore(e)) if e.is_not_found() => {
                info!(handle, "no addresses held by the VM's handle");
                return Ok(());
            }
            Err(e) => return Err(Error::from(e)),
        };
        for ip in &held {
            let owners = match ipam.owners(ip.addr, ip.masked()).await {
                Ok(Some(o)) => o,
                Ok(None) => continue,
                Err(e) => {
                    warn!(ip = %ip.addr, error = %e, "cannot read the address's owners");
                    continue;
                }
            };
            let update = if me.matches(owners.active.as_ref()) {
                OwnerUpdate {
                    active: Change::Clear,
                    expect_active: Some(me.clone()),
                    ..Default::default()
                }
            } else if me.matches(owners.alternate.as_ref()) {
                OwnerUpdate {
                    alternate: Change::Clear,
                    expect_alternate: Some(me.clone()),
                    ..Default::default()
                }
            } else {
                continue;
            };
            ipam.set_owners(ip.addr, ip.masked(), &handle, &update)
                .await?;
        }
        let mut owned = false;
        for ip in &held {
            match ipam.owners(ip.addr, ip.masked()).await {
                Ok(o) => owned |= o.is_some_and(|o| o.any()),
                Err(e) => {
                    return Err(Error::chain(
                        format!(
                            "failed to verify owner attributes after cleanup for IP {}",
                            ip.addr
                        ),
                        e,
                    ))
                }
            }
        }
        if !vmi.going_away() || owned {
            info!(
                handle,
                going_away = vmi.going_away(),
                owned,
                "keeping the VM's addresses"
            );
            return Ok(());
        }
        info!(handle, "the VM is going away: releasing its addresses");
        match ipam.release_by_handle(&handle).await {
            Ok(()) => Ok(()),
            Err(IpamError::Datastore(e)) if e.is_not_found() => {
                warn!(handle, "the VM's handle was already released");
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    })
    .await?
}
