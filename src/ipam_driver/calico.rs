//! Calico IPAM on an open datastore, as `calico-ipam` does it (cni-plugin/pkg/ipamplugin):
//! ADD assigns addresses (AutoAssign, or AssignIP for `IP=` in CNI_ARGS) to the handle
//! `<network>.<containerID>`; DEL releases that handle and the legacy one; CHECK verifies the
//! handle still holds the previous result's addresses; GC releases this node's handles of
//! containers that are gone (`ipam::allocator::gc`). The `calico-ipam` process
//! (`ipam_plugin`) and the `calico` plugin running it in-process (`InProcess`) share this.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use tracing::{debug, info, warn};

use crate::config::NetConf;
use crate::datastore::backend::Backend;
use crate::datastore::kubernetes::core_objects;
use crate::datastore::model::IpPool;
use crate::datastore::{Datastore, Key};
use crate::error::{Context, Error, Result};
use crate::identifiers::WepIdentifiers;
use crate::ipam::allocator::gc::{GcOutcome, NodeHandles};
use crate::ipam::allocator::{AutoAssignArgs, Ipam, IpamError, ViewReads, WriteBeside};
use crate::ipam::lock::{peek_pending, IpamLock};
use crate::ipam::owner::{Change, Owner, OwnerUpdate};
use crate::ipam_driver::kubevirt::{self, Detected, PodVmi, Vmi};
use crate::net::IpNet;
use crate::skel::args::{load_args, ArgKind, IGNORE_UNKNOWN};
use crate::skel::result::{IpConfig, Route};
use crate::skel::{CmdArgs, CniResult};
use crate::timefmt;

/// Upstream's budget for one assignment or release, counted after the lock is taken.
pub const IPAM_TIMEOUT: Duration = Duration::from_secs(90);

/// `ipamArgs` of ipam_plugin.go: the second CNI_ARGS pass of ADD knows only these keys, so
/// `K8S_*` keys without `IgnoreUnknown=1` fail there (`calico` always prepends it).
const IPAM_ARGS: &[(&str, ArgKind)] = &[IGNORE_UNKNOWN, ("IP", ArgKind::Ip)];

/// What one Calico IPAM call works with: parsed from its stdin, or borrowed from the
/// `calico` plugin that runs it in-process.
pub struct Call<'a> {
    pub conf: Cow<'a, NetConf>,
    pub ids: Cow<'a, WepIdentifiers>,
}

/// What the `calico` plugin has already made of the same stdin and CNI_ARGS: an in-process
/// calico-ipam uses it instead of parsing the NetConf, reading the nodename file and
/// building the identifiers again.
#[derive(Clone, Copy)]
pub struct Known<'a> {
    /// The NetConf parsed from the very stdin calico-ipam is given.
    pub conf: &'a NetConf,
    /// The identifiers from the same node name, container ID, interface and CNI_ARGS (with
    /// `IgnoreUnknown=1` prepended, as calico-ipam sees them).
    pub ids: &'a WepIdentifiers,
}

/// Calico IPAM in the `calico` process, on the call's datastore, with what the call has
/// already parsed (`known`, valid for the stdin it was parsed from: `stdin`).
pub struct InProcess<'a, D> {
    pub ds: &'a D,
    pub known: Known<'a>,
    pub stdin: &'a [u8],
}

impl<D: Datastore> InProcess<'_, D> {
    /// What the call knows of `args`, when `args` carries the very stdin it was parsed from
    /// (ADD rewrites the IPAM's stdin for some pod annotations: that one is parsed anew).
    fn known_for(&self, args: &CmdArgs) -> Option<Known<'_>> {
        (args.stdin_data == self.stdin).then_some(self.known)
    }

    pub async fn add(&self, args: &CmdArgs, prepared: Prepared<'_>) -> Result<CniResult> {
        debug!("running calico-ipam ADD in-process");
        let args = ipam_args(args);
        let call = prepare(&args, self.known_for(&args), true)?;
        assign(self.ds, &call, requested_ip(&args)?, prepared).await
    }

    pub async fn del(&self, args: &CmdArgs) -> Result<()> {
        debug!("running calico-ipam DEL in-process");
        let args = ipam_args(args);
        release(self.ds, &prepare(&args, self.known_for(&args), false)?).await
    }

    pub async fn check(&self, prev: &CniResult) -> Result<()> {
        check_with(self.ds, self.known.conf, self.known.ids, prev).await
    }

    pub async fn gc(
        &self,
        node: &str,
        handles: &NodeHandles,
        valid: &std::collections::BTreeSet<String>,
    ) -> GcOutcome {
        gc_with(self.ds, self.known.conf, node, handles, valid).await
    }
}

/// The arguments calico-ipam sees (calico runs with `IgnoreUnknown=1` prepended).
pub fn ipam_args(args: &CmdArgs) -> CmdArgs {
    CmdArgs {
        args: crate::skel::args::prepend_ignore_unknown(&args.args),
        ..args.clone()
    }
}

/// The node name and the identifiers (`K8sArgs`) for a parsed NetConf, and the checks both
/// the `calico-ipam` process and the in-process driver make.
pub fn identify(args: &CmdArgs, conf: NetConf, for_add: bool) -> Result<Call<'static>> {
    let node = conf.node_name();
    let ids = WepIdentifiers::from_cni_args(&node, &args.container_id, &args.ifname, &args.args)?;
    checked(
        Call {
            conf: Cow::Owned(conf),
            ids: Cow::Owned(ids),
        },
        for_add,
    )
}

/// ADD also needs a buildable WorkloadEndpoint name (upstream fails there before any IPAM
/// work); DEL does not, so an address allocated under a name that cannot be built is still
/// released (upstream's DEL fails there forever).
fn checked(call: Call<'_>, for_add: bool) -> Result<Call<'_>> {
    if for_add {
        call.ids.wep_name()?;
    }
    Ok(call)
}

/// The in-process entry points' `load` and `identify`: what the caller knows, else parsed.
fn prepare<'a>(args: &CmdArgs, known: Option<Known<'a>>, for_add: bool) -> Result<Call<'a>> {
    match known {
        Some(k) => checked(
            Call {
                conf: Cow::Borrowed(k.conf),
                ids: Cow::Borrowed(k.ids),
            },
            for_add,
        ),
        None => identify(args, NetConf::parse(&args.stdin_data)?, for_add),
    }
}

/// The `IP=` of ADD's second CNI_ARGS pass.
pub fn requested_ip(args: &CmdArgs) -> Result<Option<IpAddr>> {
    let ipam_args = load_args(&args.args, IPAM_ARGS)?;
    Ok(ipam_args
        .get("IP")
        .filter(|s| !s.is_empty())
        .and_then(|s| s.parse().ok()))
}

/// The namespace's labels for pools' `namespaceSelector`: read from the Kubernetes API when
/// the NetConf names a kubeconfig or `policy.type: k8s` (as upstream), else none.
pub async fn namespace_labels(
    conf: &NetConf,
    namespace: &str,
    ds: &Backend,
) -> Result<BTreeMap<String, String>> {
    if (conf.kubernetes.kubeconfig.is_empty() && conf.policy.policy_type != "k8s")
        || namespace.is_empty()
    {
        return Ok(BTreeMap::new());
    }
    let fail = || format!("failed to get namespace {namespace}");
    let client = ds.plugin_kube_client(conf).await.with_context(fail)?;
    let ns = core_objects::namespace(&client, namespace)
        .await
        .with_context(fail)?;
    Ok(ns.metadata.labels.unwrap_or_default())
}

/// What the `calico` plugin hands the calico-ipam it runs in-process.
#[derive(Default)]
pub struct Prepared<'a> {
    /// The pod's KubeVirt VMI as the call read the pod (`Some(None)`: read, no VMI);
    /// `None` when the pod was not read (calico-ipam reads it if it may run a VM).
    pub pod_vmi: Option<Option<PodVmi>>,
    /// The namespace's labels (for pools' `namespaceSelector`).
    pub namespace_labels: BTreeMap<String, String>,
    /// AutoAssign's up-front reads, already made: under `lock`, or completed under it
    /// (`Ipam::complete_view`).
    pub reads: Option<ViewReads>,
    /// The host's IPAM lock, already held.
    pub lock: Option<IpamLock>,
    /// The caller's write that goes out with the block write giving all the addresses
    /// (`Ipam::write_beside`).
    pub beside: Option<&'a dyn WriteBeside>,
}

/// Gives back exactly these addresses, and only where they still belong to this call's
/// handle: the rollback of a failed `calico` ADD. Unlike a DEL (which releases the whole
/// handle `<network>.<containerID>`), this never frees an address that another ADD of the
/// same sandbox holds under the same handle. A KubeVirt VM's pod's addresses are the VM's:
/// the pod only stops owning them, as its DEL would (upstream runs IPAM DEL here).
pub async fn release_addresses<D: Datastore>(ds: &D, args: &CmdArgs, ips: &[IpAddr]) -> Result<()> {
    let call = prepare(args, None, false)?;
    let detected = detect_vm(ds, &call, None, true).await?;
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
    let call = prepare(args, None, false)?;
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

pub async fn assign<D: Datastore>(
    ds: &D,
    call: &Call<'_>,
    ip: Option<IpAddr>,
    prepared: Prepared<'_>,
) -> Result<CniResult> {
    let Prepared {
        pod_vmi,
        namespace_labels,
        reads,
        lock,
        beside,
    } = prepared;
    let lock_file = call.conf.ipam_lock_file();
    let ipam = Ipam::new(ds, &call.ids.node).write_beside(beside);
    let vm = persistent_vm(
        &ipam,
        detect_vm(ds, call, pod_vmi, false).await?,
        VmVerb::Add,
    )
    .await?;
    let handle = match &vm {
        Some(vmi) => vmi.handle_id(&call.conf.name),
        None => call.ids.handle_id(&call.conf.name),
    };
    let mut attrs = BTreeMap::new();
    attrs.insert("node".to_string(), call.ids.node.clone());
    attrs.insert("timestamp".to_string(), timefmt::now_go_string());
    if call.ids.is_k8s() {
        attrs.insert("pod".to_string(), call.ids.pod.clone());
        attrs.insert("namespace".to_string(), call.ids.namespace.clone());
    }
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

    if let Some(ip) = ip {
        let _lock = match lock {
            Some(l) => l,
            None => IpamLock::acquire(lock_file).await,
        };
        let assigned = with_timeout(async {
            upgrade_host_once(ds, &call.ids.node).await?;
            Ok::<_, Error>(ipam.assign_ip(ip, &handle, &attrs, max).await?)
        })
        .await??;
        info!(%assigned, "assigned the requested address");
        // As AutoAssign's: one route per address (the address itself, /32 or /128).
        return Ok(CniResult {
            ips: vec![IpConfig {
                address: assigned,
                gateway: None,
                interface: None,
            }],
            routes: vec![Route {
                dst: assigned,
                gw: None,
            }],
            ..Default::default()
        });
    }

    let listed = reads.as_ref().and_then(ViewReads::pools);
    let ipv4_pools = resolve_pools(&ipam, &call.conf.ipam.ipv4_pools, 4, listed).await?;
    let ipv6_pools = resolve_pools(&ipam, &call.conf.ipam.ipv6_pools, 6, listed).await?;
    let req = AutoAssignArgs {
        num4: usize::from(call.conf.assign_ipv4()),
        num6: usize::from(call.conf.assign_ipv6()),
        handle_id: handle.clone(),
        attrs,
        ipv4_pools,
        ipv6_pools,
        max_blocks_per_host: 0,
        namespace_labels,
        max_per_version: max,
    };
    let lock = match lock {
        Some(l) => l,
        None => IpamLock::acquire(lock_file).await,
    };
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
    // A family that fell short fails the call; give back what the other family got.
    for short in [&v4, &v6] {
        if let Some(why) = short.shortfall() {
            let got: Vec<IpNet> = v4.ips.iter().chain(&v6.ips).copied().collect();
            ipam.give_back(&got, &handle).await;
            return Err(Error::msg(format!(
                "failed to request IPv{} addresses: {why}",
                short.version
            )));
        }
    }
    let mut result = CniResult::default();
    for ip in v4.ips.iter().chain(&v6.ips) {
        info!(address = %ip, "assigned address");
        result.ips.push(IpConfig {
            address: *ip,
            gateway: None,
            interface: None,
        });
        result.routes.push(Route { dst: *ip, gw: None });
    }
    Ok(result)
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
    let until = tokio::time::Instant::now() + crate::deadline::cap(IPAM_TIMEOUT).0;
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

/// DEL's release: the handle `<network>.<containerID>`, then the legacy one, within one 90 s
/// budget; a handle that does not exist is success.
///
/// Both handles are read together (one round trip) before the host's IPAM lock is taken:
/// a handle belongs to one container (a write to one that moved meanwhile loses its
/// compare-and-swap and reads it again), while the lock only spares contention on the host's
/// blocks. It is then held for the block reads and writes, one round trip shorter than
/// upstream's (which takes it first), and not at all when neither handle exists (a repeated
/// DEL).
pub async fn release<D: Datastore>(ds: &D, call: &Call<'_>) -> Result<()> {
    let detected = detect_vm(ds, call, None, true).await?;
    if let Some(vmi) =
        persistent_vm(&Ipam::new(ds, &call.ids.node), detected, VmVerb::DelOrCheck).await?
    {
        release_vm(ds, call, &vmi).await?;
    }
    // Also a VM's pod: its container's handle, had it one (persistence turned on since).
    release_container_handles(ds, call).await
}

/// The handle `<network>.<containerID>`, then the legacy one (see `release`).
async fn release_container_handles<D: Datastore>(ds: &D, call: &Call<'_>) -> Result<()> {
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

/// Which verb asks for a pod's persistent VM (`persistent_vm`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum VmVerb {
    Add,
    DelOrCheck,
}

/// The pod's KubeVirt VM, when the datastore can tell (`Datastore::as_backend`).
async fn detect_vm<D: Datastore>(
    ds: &D,
    call: &Call<'_>,
    known: Option<Option<PodVmi>>,
    for_del: bool,
) -> Result<Detected> {
    match ds.as_backend() {
        Some(b) => kubevirt::detect(&call.conf, b, &call.ids, known, for_del).await,
        None => Ok(Detected::NotAVm),
    }
}

/// The VM whose addresses persist: a detected VM with `kubeVirtVMAddressPersistence` on.
/// With it off, a VM's pod is an ordinary pod, but an ADD of a migration target is refused
/// (it would get other addresses than the VM it takes over); its DEL and CHECK are an
/// ordinary pod's, as upstream's.
async fn persistent_vm<D: Datastore>(
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
        return Err(Error::msg(
            "live migration target pod is not allowed when KubeVirtVMAddressPersistence is disabled",
        ));
    }
    Ok(None)
}

/// A VM's pod gets the addresses its handle holds, if any, as their owner: the active one,
/// or for a live migration's target the alternate one (whose result has no routes: the
/// source's host still routes to the VM until the migration completes). Overwritten
/// whatever was there, as upstream (a stuck old pod, a failed migration's target).
async fn reuse_vm_addresses<D: Datastore>(
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
            return Err(Error::msg(format!(
                "migration target pod but no IP allocated to VM handle {handle}"
            )));
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
async fn release_vm<D: Datastore>(ds: &D, call: &Call<'_>, vmi: &Vmi) -> Result<()> {
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

/// Upstream's 90 s budget for the IPAM work, cut at the call's deadline.
async fn with_timeout<T>(f: impl std::future::Future<Output = T>) -> Result<T> {
    let (until, capped) = crate::deadline::cap_at(IPAM_TIMEOUT);
    tokio::time::timeout_at(until, f)
        .await
        .map_err(|_| match capped {
            true => crate::deadline::expired("assigning or releasing IPAM addresses").into(),
            false => Error::msg("context deadline exceeded"),
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
                .ok_or_else(|| {
                    Error::msg(format!(
                        "error parsing pool \"{entry}\": invalid CIDR address: {entry}"
                    ))
                })?,
        };
        if cidr.version() != version {
            return Err(Error::msg(format!(
                "\"{}\" isn't a IPv{version} address",
                cidr.addr
            )));
        }
        out.push(cidr);
    }
    Ok(out)
}

/// The IPAM half of CHECK, shared with `calico`'s in-process path: the container's handle,
/// or a KubeVirt VM's pod's VM handle, holds the previous result's addresses.
pub async fn check_with<D: Datastore>(
    ds: &D,
    conf: &NetConf,
    ids: &WepIdentifiers,
    prev: &CniResult,
) -> Result<()> {
    let ips: Vec<IpAddr> = prev.ips.iter().map(|i| i.address.addr).collect();
    let mut handle = ids.handle_id(&conf.name);
    if kubevirt::may_be_vm_pod(ids) {
        let call = Call {
            conf: Cow::Borrowed(conf),
            ids: Cow::Borrowed(ids),
        };
        let detected = detect_vm(ds, &call, None, false).await.context("CHECK")?;
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
