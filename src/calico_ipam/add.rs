//! calico-ipam ADD: AutoAssign, or AssignIP for `IP=` in CNI_ARGS, to the handle
//! `<network>.<containerID>` (or a KubeVirt VM's persistent handle, `vm.rs`), with what the
//! `calico` plugin running it in-process has already read and locked (`Supplied`).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use tracing::{info, warn};

use super::call::{with_timeout, IpamCall, IPAM_TIMEOUT};
use super::kube_reads::KubeReads;
use super::vm::{persistent_vm, reuse_vm_addresses, VmVerb};
use crate::calico_ipam::kubevirt::PodVmi;
use crate::datastore::model::IpPool;
use crate::datastore::Datastore;
use crate::error::{Error, PoolRequestError, Result};
use crate::ipam::allocator::{AutoAssignArgs, Ipam, ViewReads, WriteBeside};
use crate::ipam::lock::IpamLock;
use crate::skel::result::{IpConfig, Route};
use crate::skel::CniResult;
use crate::support::net::IpNet;
use crate::support::timefmt;

/// What the caller supplies instead of calico-ipam reading it itself: the `calico` plugin
/// running it in-process has read the pod, and may have read the host's blocks under the
/// host's lock in its first round trip.
#[derive(Default)]
pub struct Supplied<'a> {
    /// The pod's KubeVirt VMI as the call read the pod (`Some(None)`: read, no VMI);
    /// `None` when the pod was not read (calico-ipam reads it if it may run a VM).
    pub pod_vmi: Option<Option<PodVmi>>,
    /// The namespace's labels (for pools' `namespaceSelector`), when the caller read them
    /// with the pod; else calico-ipam reads them itself (`pool_namespace_labels`).
    pub namespace_labels: Option<BTreeMap<String, String>>,
    /// The host's lock and AutoAssign's reads, when the caller made them.
    pub view: LockedView,
    /// The caller's write that goes out with the block write giving all the addresses
    /// (`Ipam::write_beside`).
    pub beside: Option<&'a dyn WriteBeside>,
}

/// The host's IPAM lock, held, and AutoAssign's reads of the host's blocks and pools, made
/// under it or completed under it (`Ipam::complete_view`).
#[derive(Default)]
pub struct LockedView {
    pub lock: Option<IpamLock>,
    pub reads: Option<ViewReads>,
}

/// Takes the host's IPAM lock (`lock_file`) and makes AutoAssign's reads for `node`, ahead
/// of ADD.
///
/// Where the holders keep the blocks they write (the Kubernetes datastore), the lock is
/// taken only once the reads are answered, and held for the writes: the node's other ADDs
/// and DELs wait for it, and these reads are the slower half of what it guards when many
/// pods start at once. The hinted blocks are then taken from the copies, under the lock (no
/// request), and a listing of this host's affinities that does not cover them is asked
/// again (`Ipam::complete_view`). On etcd, whose reads are fast and whose holders keep no
/// copies, the reads are made under the lock, where they cannot be behind another holder's
/// writes.
pub async fn read_locked_view<D: Datastore>(ds: &D, lock_file: &str, node: &str) -> LockedView {
    let ipam = Ipam::new(ds, node);
    if ds.keeps_block_copies() {
        let reads = ipam.read_view_unlocked().await;
        let lock = IpamLock::acquire(lock_file).await;
        let reads = ipam
            .complete_view(reads, lock.block_hint(), &lock.hinted_copies())
            .await;
        return LockedView {
            lock: Some(lock),
            reads: Some(reads),
        };
    }
    let lock = IpamLock::acquire(lock_file).await;
    let reads = ipam
        .read_view(lock.block_hint(), &lock.hinted_copies())
        .await;
    LockedView {
        lock: Some(lock),
        reads: Some(reads),
    }
}

/// The namespace's labels for AutoAssign's pools: none when `requested` names the address
/// (no pool is chosen, as upstream's AssignIP branch), those `read` with the pod, else the
/// namespace's as calico-ipam reads it (`KubeReads::namespace_labels`).
pub async fn pool_namespace_labels<D: KubeReads>(
    ds: &D,
    call: &IpamCall<'_>,
    requested: Option<IpAddr>,
    read: Option<BTreeMap<String, String>>,
) -> Result<BTreeMap<String, String>> {
    match (requested, read) {
        (Some(_), _) => Ok(BTreeMap::new()),
        (None, Some(labels)) => Ok(labels),
        (None, None) => ds.namespace_labels(&call.conf, &call.ids.namespace).await,
    }
}

pub async fn assign<D: KubeReads>(
    ds: &D,
    call: &IpamCall<'_>,
    ip: Option<IpAddr>,
    supplied: Supplied<'_>,
) -> Result<CniResult> {
    let Supplied {
        pod_vmi,
        namespace_labels,
        view: LockedView { lock, reads },
        beside,
    } = supplied;
    let namespace_labels = pool_namespace_labels(ds, call, ip, namespace_labels).await?;
    let ipam = Ipam::new(ds, &call.ids.node).write_beside(beside);
    let vm = persistent_vm(
        &ipam,
        ds.detect_vm(&call.conf, &call.ids, pod_vmi, false).await?,
        VmVerb::Add,
    )
    .await?;

    let handle = match &vm {
        Some(vmi) => vmi.handle_id(&call.conf.name),
        None => call.ids.handle_id(&call.conf.name),
    };
    let mut attrs = owner_attributes(call);
    info!(handle, node = %call.ids.node, container_id = %call.ids.container_id, "calico-ipam ADD");
    // A VM keeps the addresses its handle holds; it gets new ones (one per IP version,
    // however many of its pods ask at once) only when it holds none.
    let max = vm.as_ref().map(|_| 1);
    if let Some(vmi) = &vm {
        attrs.extend(
            vmi.attributes()
                .into_iter()
                .map(|(k, v)| (k.to_string(), v)),
        );
        if let Some(kept) = with_timeout(reuse_vm_addresses(&ipam, vmi, &handle, &attrs)).await?? {
            return Ok(kept);
        }
    }
    let want = Wanted {
        handle,
        attrs,
        max,
        namespace_labels,
    };
    match ip {
        Some(ip) => {
            let _lock = held_or_taken(lock, call).await;
            assign_requested(ds, &ipam, &call.ids.node, ip, &want).await
        }
        None => assign_automatically(&ipam, call, want, reads, lock).await,
    }
}

/// The host's IPAM lock: the one the caller holds, else taken now.
async fn held_or_taken(lock: Option<IpamLock>, call: &IpamCall<'_>) -> IpamLock {
    match lock {
        Some(l) => l,
        None => IpamLock::acquire(call.conf.ipam_lock_file()).await,
    }
}

/// What an ADD asks addresses for: the handle, the allocation's attributes, at most one per
/// IP version for a VM, the namespace's labels (for pools' `namespaceSelector`).
struct Wanted {
    handle: String,
    attrs: BTreeMap<String, String>,
    max: Option<usize>,
    namespace_labels: BTreeMap<String, String>,
}

/// The attributes an allocation records of its owner: the node and the time, and a
/// Kubernetes pod's name and namespace.
fn owner_attributes(call: &IpamCall<'_>) -> BTreeMap<String, String> {
    let mut attrs = BTreeMap::new();
    attrs.insert("node".to_string(), call.ids.node.clone());
    attrs.insert("timestamp".to_string(), timefmt::now_go_string());
    if call.ids.is_k8s() {
        attrs.insert("pod".to_string(), call.ids.pod.clone());
        attrs.insert("namespace".to_string(), call.ids.namespace.clone());
    }
    attrs
}

/// AssignIP of `IP=` in CNI_ARGS, under the host's lock (taken by the caller), after the
/// host's one-time IPAM upgrade.
async fn assign_requested<D: Datastore>(
    ds: &D,
    ipam: &Ipam<'_, D>,
    node: &str,
    ip: IpAddr,
    want: &Wanted,
) -> Result<CniResult> {
    let assigned = with_timeout(async {
        upgrade_host_once(ds, node).await?;
        Ok::<_, Error>(
            ipam.assign_ip(ip, &want.handle, &want.attrs, want.max)
                .await?,
        )
    })
    .await??;
    info!(%assigned, "assigned the requested address");
    // As AutoAssign's: one route per address (the address itself, /32 or /128).
    Ok(host_routed(&[assigned]))
}

/// AutoAssign from the NetConf's pools (or every pool that selects the node), with the
/// reads the caller made ahead, else read now under the host's lock (the caller's, else
/// taken once the pools are resolved); a family that falls short fails the call and gives
/// back what the other family got.
async fn assign_automatically<D: Datastore>(
    ipam: &Ipam<'_, D>,
    call: &IpamCall<'_>,
    want: Wanted,
    reads: Option<ViewReads>,
    lock: Option<IpamLock>,
) -> Result<CniResult> {
    let listed = reads.as_ref().and_then(ViewReads::pools);
    let ipv4_pools = resolve_pools(ipam, &call.conf.ipam.ipv4_pools, 4, listed).await?;
    let ipv6_pools = resolve_pools(ipam, &call.conf.ipam.ipv6_pools, 6, listed).await?;
    let req = AutoAssignArgs {
        num4: usize::from(call.conf.assign_ipv4()),
        num6: usize::from(call.conf.assign_ipv6()),
        handle_id: want.handle.clone(),
        attrs: want.attrs,
        ipv4_pools,
        ipv6_pools,
        max_blocks_per_host: 0,
        namespace_labels: want.namespace_labels,
        max_per_version: want.max,
    };
    let lock = held_or_taken(lock, call).await;
    ipam.keep_journal(lock.journal());
    let (v4, v6) = with_timeout(async {
        let reads = match reads {
            Some(reads) => reads,
            None => {
                ipam.read_view(lock.block_hint(), &lock.hinted_copies())
                    .await
            }
        };
        ipam.auto_assign_from(&req, reads).await
    })
    .await??;
    lock.remember_blocks(&ipam.assigned_blocks());
    for short in [&v4, &v6] {
        if let Some(why) = short.shortfall() {
            let got: Vec<IpNet> = v4.ips.iter().chain(&v6.ips).copied().collect();
            ipam.give_back(&got, &want.handle).await;
            return Err(PoolRequestError::Shortfall {
                version: short.version,
                reason: why,
            }
            .into());
        }
    }
    for ip in v4.ips.iter().chain(&v6.ips) {
        info!(address = %ip, "assigned address");
    }
    let all: Vec<IpNet> = v4.ips.iter().chain(&v6.ips).copied().collect();
    Ok(host_routed(&all))
}

/// A result of these addresses, each with its route (the address itself, /32 or /128).
fn host_routed(ips: &[IpNet]) -> CniResult {
    let mut result = CniResult::default();
    for ip in ips {
        result.ips.push(IpConfig {
            address: *ip,
            gateway: None,
            interface: None,
        });
        result.routes.push(Route { dst: *ip, gw: None });
    }
    result
}

/// Where calico-ipam records that this host's IPAM objects were upgraded (upstream's path).
pub const IPAM_UPGRADED_FILE: &str = "/var/run/calico/cni/ipam_upgraded";

/// `maybeUpgradeIPAM` of the `IP=` path: once per host (the marker file), label this node's
/// block affinities written by older releases, retrying with a doubling backoff until the
/// budget the caller set runs out; then write the marker. The texts are upstream's (its
/// prefix twice: once where the upgrade fails, once where its caller reports it).
async fn upgrade_host_once<D: Datastore>(ds: &D, node: &str) -> Result<()> {
    const PREFIX: &str = "failed to upgrade IPAM database";
    let marker = std::path::Path::new(IPAM_UPGRADED_FILE);
    if marker.exists() {
        return Ok(());
    }
    info!(
        node,
        "Upgrading any IPAM affinities from older versions...."
    );
    // Upstream retries until its context ends and then reports the last failure; the
    // caller's timeout is the same budget, so stop retrying just before it.
    let until = tokio::time::Instant::now() + crate::support::deadline::cap(IPAM_TIMEOUT).0;
    let mut delay = Duration::from_millis(100);
    loop {
        match ds.label_host_affinities(node).await {
            Ok(0) => {
                info!("No affinities needed to be upgraded.");
                break;
            }
            Ok(n) => {
                info!("Upgraded {n} block affinities belonging to this host.");
                break;
            }
            Err(e) if e.is_deadline() || tokio::time::Instant::now() + delay >= until => {
                return Err(Error::chain(PREFIX, Error::chain(PREFIX, e)));
            }
            Err(e) => {
                warn!(error = %e, "Failed to upgrade IPAM blocks of this host; retrying");
                tokio::time::sleep(delay).await;
                delay = delay.saturating_mul(2);
            }
        }
    }
    let touch = || -> Result<()> {
        if let Some(dir) = marker.parent() {
            std::fs::create_dir_all(dir).map_err(|e| {
                Error::chain(
                    format!("failed to create directory for file {IPAM_UPGRADED_FILE}"),
                    e,
                )
            })?;
        }
        std::fs::File::create(marker)
            .map(drop)
            .map_err(|e| Error::chain(format!("failed to create file {IPAM_UPGRADED_FILE}"), e))
    };
    touch().map_err(|e| {
        Error::chain(
            PREFIX,
            Error::chain(
                format!("failed to create IPAM upgrade marker file {IPAM_UPGRADED_FILE}"),
                e,
            ),
        )
    })
}

/// `ipv4_pools`/`ipv6_pools` entries are CIDRs or IPPool names (utils.ResolvePools).
async fn resolve_pools<D: Datastore>(
    ipam: &Ipam<'_, D>,
    entries: &[String],
    version: u8,
    listed: Option<&[IpPool]>,
) -> Result<Vec<IpNet>> {
    if entries.is_empty() {
        return Ok(Vec::new());
    }
    let read;
    let pools = match listed {
        Some(p) => p,
        None => {
            read = ipam.pools().await?;
            &read[..]
        }
    };
    let mut out = Vec::new();
    for entry in entries {
        let cidr = match entry.parse::<IpNet>() {
            Ok(c) => c,
            Err(_) => pools
                .iter()
                .find(|p| &p.metadata.name == entry)
                .and_then(|p| p.cidr())
                .ok_or_else(|| PoolRequestError::UnknownPool(entry.clone()))?,
        };
        if cidr.version() != version {
            return Err(PoolRequestError::WrongFamily {
                addr: cidr.addr,
                version,
            }
            .into());
        }
        out.push(cidr);
    }
    Ok(out)
}
