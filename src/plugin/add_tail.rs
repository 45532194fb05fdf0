//! ADD's tail, where everything it makes is made and, on failure, undone: IPAM alongside the
//! pod's interface (`alongside`), then the addresses and routes, the WorkloadEndpoint and the
//! result (`network_and_write`). A failure undoes exactly what this call made: the interface
//! it created, the addresses it was given and an endpoint whose write may have landed
//! unanswered, never a pre-existing interface, never an address another ADD of the same
//! sandbox holds under the same handle.
//!
//! On the Kubernetes datastore the endpoint of a pod no ADD has networked yet is the pod's
//! address and container ID annotations, all known once IPAM has chosen the addresses: it
//! is written with IPAM's block write (`EndpointBeside`), one round trip less. Until the
//! call succeeds, a failure takes it back (as DEL would) before the addresses are given
//! back; after a SIGKILL, the runtime's DEL removes it as any endpoint of its container.
//! Any other new endpoint whose MAC is known before the interface is finished (the Linux
//! pair, built in `prepare` for the addresses' families: etcd's endpoint stores the MAC)
//! is written while it is finished, under the same rules.
//!
//! Generic over the datastore, the IPAM and the dataplane, so that every failure interleaving
//! is unit-tested with the memory store and fakes (`tests` below), without root. The undo
//! runs within the call's grace (`deadline::cleanup_bound`).

use std::collections::BTreeMap;
use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Mutex;

use tracing::{debug, info, warn};

use crate::dataplane::{AddressRequest, Dataplane, PodFacts, PodInterface, VethRequest};
use crate::datastore::model::{IpNat, WorkloadEndpoint, WorkloadEndpointSpec};
use crate::datastore::resources::{delete_resource, get_resource};
use crate::datastore::{Datastore, DatastoreError, Kind};
use crate::deadline;
use crate::error::{Error, Result};
use crate::ipam::allocator::WriteBeside;
use crate::ipam_driver::IpamDriver;
use crate::net::IpNet;
use crate::plugin::endpoint;
use crate::skel::{CmdArgs, CniResult};

/// What ADD's tail works with.
pub struct Tail<'a, D, I> {
    pub ds: &'a D,
    pub ipam: &'a I,
    /// `container_settings.allow_ip_forwarding`.
    pub allow_ip_forwarding: bool,
    /// The endpoint IPAM writes with the addresses, if any.
    pub beside: Option<&'a EndpointBeside<'a, D>>,
}

/// The endpoint written ahead of the interface: with IPAM's block write (`WriteBeside`),
/// where all it holds is known once the addresses are (the Kubernetes datastore's, for a
/// pod no ADD has networked yet), or while the interface is finished, its MAC known. What
/// each write did is kept, for the tail to tell whether the endpoint is written (`holds`)
/// or must be taken back (`take_back`).
pub struct EndpointBeside<'a, D> {
    ds: &'a D,
    wep: WorkloadEndpoint,
    /// The last write's addresses and outcome.
    last: Mutex<Option<(Vec<String>, Written)>>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Written {
    Landed,
    /// No answer: it may have landed.
    Unknown,
    Refused,
}

impl<'a, D: Datastore> EndpointBeside<'a, D> {
    /// `wep` as it will be written, but for its addresses.
    pub fn new(ds: &'a D, wep: &WorkloadEndpoint) -> Self {
        EndpointBeside {
            ds,
            wep: wep.clone(),
            last: Mutex::new(None),
        }
    }

    fn last(&self) -> Option<(Vec<String>, Written)> {
        self.last.lock().ok().and_then(|l| l.clone())
    }

    /// Whether the endpoint is stored with exactly these addresses.
    fn holds(&self, ip_networks: &[String]) -> bool {
        matches!(self.last(), Some((ips, Written::Landed)) if ips == ip_networks)
    }

    /// Whether `wep` is stored: its addresses, and its MAC if this write had one (the
    /// Kubernetes datastore's endpoint has none).
    fn holds_endpoint(&self, wep: &WorkloadEndpoint) -> bool {
        self.holds(&wep.spec.ip_networks)
            && (self.wep.spec.mac.is_empty() || self.wep.spec.mac == wep.spec.mac)
    }

    /// Removes the endpoint a write may have stored, if it is still this call's (same
    /// container and addresses). Once: what it could not remove, DEL will.
    async fn take_back(&self) {
        let last = self.last.lock().ok().and_then(|mut l| l.take());
        if let Some((ips, Written::Landed | Written::Unknown)) = last {
            let mut wep = self.wep.clone();
            wep.spec.ip_networks = ips;
            remove_own_endpoint(self.ds, &wep).await;
        }
    }
}

impl<D: Datastore> WriteBeside for EndpointBeside<'_, D> {
    fn write<'w>(&'w self, ips: &'w [IpNet]) -> Pin<Box<dyn Future<Output = ()> + 'w>> {
        Box::pin(async move {
            let mut wep = self.wep.clone();
            wep.spec.ip_networks = ips
                .iter()
                .map(|n| IpNet::host(n.addr).to_string())
                .collect();
            // Another try, after a block write that lost: an endpoint stored with the same
            // addresses stays; one with others (or unanswered) goes first.
            if self.holds(&wep.spec.ip_networks) {
                return;
            }
            self.take_back().await;
            let outcome = match endpoint::write(self.ds, &mut wep).await {
                Ok(()) => Written::Landed,
                Err(e) if outcome_unknown(&e) => Written::Unknown,
                Err(e) => {
                    debug!(error = %e, "the endpoint written with the addresses was refused");
                    Written::Refused
                }
            };
            if let Ok(mut last) = self.last.lock() {
                *last = Some((wep.spec.ip_networks, outcome));
            }
        })
    }
}

/// Takes back the endpoint written with the addresses, if any.
async fn take_back_beside<D: Datastore>(beside: Option<&EndpointBeside<'_, D>>) {
    if let Some(b) = beside {
        b.take_back().await;
    }
}

/// What the annotations add to the interface and the endpoint.
#[derive(Default)]
pub struct Extras {
    pub container_mac: Option<[u8; 6]>,
    pub floating_ips: Vec<String>,
    pub skip_host_routes: bool,
    /// The pod's, for the gRPC dataplane.
    pub annotations: BTreeMap<String, String>,
}

/// Runs IPAM (`ipam`) and builds the veth pair at the same time. A failure of either undoes
/// the other: addresses without a pair are given back, a pair without addresses is removed.
/// When both fail, IPAM's error is the call's (it is what the sequential order reported).
pub async fn alongside<D: Datastore, I: IpamDriver, P: Dataplane>(
    tail: &Tail<'_, D, I>,
    args: &CmdArgs,
    dataplane: P,
    veth: VethRequest,
    ipam: impl Future<Output = Result<CniResult>>,
) -> Result<(CniResult, P::Interface)> {
    match tokio::join!(ipam, dataplane.prepare(veth)) {
        (Ok(result), Ok(link)) => Ok((result, link)),
        (Err(e), Ok(link)) => {
            undo("removing the veth pair after IPAM failed", async {
                if let Err(undo) = link.remove().await {
                    warn!(error = %undo, "failed to remove the pod interface after IPAM failed");
                }
                take_back_beside(tail.beside).await;
            })
            .await;
            Err(e)
        }
        (Err(e), Err(net)) => {
            warn!(error = %net, "the veth pair failed too (and was removed)");
            undo(
                "taking back the endpoint after IPAM failed",
                take_back_beside(tail.beside),
            )
            .await;
            Err(e)
        }
        (Ok(result), Err(e)) => {
            let assigned: Vec<IpAddr> = result.ips.iter().map(|ip| ip.address.addr).collect();
            undo(
                "releasing the addresses after a failed dataplane setup",
                async {
                    take_back_beside(tail.beside).await;
                    tail.ipam.give_back(args, &assigned).await;
                },
            )
            .await;
            Err(e.into())
        }
    }
}

/// The common tail of both modes: finish the interface, write the endpoint, shape the
/// result. A failure gives back this call's addresses and removes the veth pair it created.
#[allow(clippy::too_many_arguments)]
pub async fn network_and_write<D: Datastore, I: IpamDriver, L: PodInterface>(
    tail: &Tail<'_, D, I>,
    args: &CmdArgs,
    mut result: CniResult,
    mut link: L,
    mut wep: WorkloadEndpoint,
    routes: Vec<IpNet>,
    extras: Extras,
    mtu: u32,
) -> Result<CniResult> {
    let host_addresses = link.result_has_host_addresses();
    wep.spec.ip_networks = endpoint::ip_networks(&result);
    wep.spec.ip_nats = floating_nats(&result, &extras.floating_ips);
    let assigned: Vec<IpAddr> = result.ips.iter().map(|ip| ip.address.addr).collect();
    let addrs = address_request(
        &result,
        routes,
        tail.allow_ip_forwarding,
        extras.skip_host_routes,
    );
    let new_endpoint = wep.metadata.resource_version.is_empty();
    // A new endpoint not written with the addresses, whose MAC is known before the
    // interface is finished, is written while it is: one write less on the call's path.
    let early_mac = match tail.beside {
        None if new_endpoint => link.known_mac(&addrs),
        _ => None,
    };
    let written_early = early_mac.map(|mac| {
        let mut early = wep.clone();
        early.spec.mac = mac;
        EndpointBeside::new(tail.ds, &early)
    });
    let beside = tail.beside.or(written_early.as_ref());
    let pod = PodFacts {
        ips: &result.ips,
        endpoint: &wep,
        annotations: &extras.annotations,
    };
    let finished = match &written_early {
        Some(early) => {
            let (finished, ()) = tokio::join!(link.finish(&addrs, &pod), early.write(&addrs.ips));
            finished
        }
        None => link.finish(&addrs, &pod).await,
    };
    let net = match finished {
        Ok(n) => n,
        Err(e) => {
            undo(
                "releasing the addresses after a failed dataplane setup",
                async {
                    // The endpoint written with (or beside) the addresses goes before them.
                    take_back_beside(beside).await;
                    tail.ipam.give_back(args, &assigned).await;
                },
            )
            .await;
            return Err(e.into());
        }
    };
    info!(host_veth = %net.host_veth, mac = %net.container_mac, "Networked namespace");
    wep.spec.mac = net.container_mac.to_lowercase();
    wep.spec.interface_name = net.host_veth.clone();
    if beside.is_some_and(|b| b.holds_endpoint(&wep)) {
        info!(name = %wep.metadata.name, "Wrote endpoint to datastore (ahead of the interface)");
    } else {
        // One written with other addresses (its block write lost), another MAC, or
        // unanswered goes first.
        take_back_beside(beside).await;
        if let Err(e) = endpoint::write(tail.ds, &mut wep).await {
            undo("undoing a failed ADD", async {
                // The interface first: it is local and always possible (and its host route
                // must be gone before the address can go to another pod).
                if let Err(undo) = link.remove().await {
                    warn!(error = %undo, "failed to remove the pod interface after a failed ADD");
                }
                if new_endpoint && outcome_unknown(&e) {
                    remove_own_endpoint(tail.ds, &wep).await;
                }
                tail.ipam.give_back(args, &assigned).await;
            })
            .await;
            return Err(e);
        }
        info!(name = %wep.metadata.name, "Wrote endpoint to datastore");
    }
    finish_result(
        &mut result,
        host_addresses,
        &net.host_veth,
        &args.ifname,
        &net.container_mac,
        mtu,
        &args.netns,
    );
    Ok(result)
}

/// What the pod interface is given for IPAM's `result`: its addresses as /32 and /128,
/// and the pod's routes.
pub fn address_request(
    result: &CniResult,
    routes: Vec<IpNet>,
    allow_ip_forwarding: bool,
    skip_host_routes: bool,
) -> AddressRequest {
    AddressRequest {
        ips: result
            .ips
            .iter()
            .map(|ip| IpNet::host(ip.address.addr))
            .collect(),
        routes,
        allow_ip_forwarding,
        skip_host_routes,
    }
}

/// Runs one step of undoing a failed ADD within the call's grace; a step cut short is
/// logged (what it could not undo, DEL will).
pub async fn undo(what: &str, step: impl Future<Output = ()>) {
    if let Err(e) = deadline::cleanup_bound(what, step).await {
        warn!(error = %e, "the undo of a failed ADD was cut short; DEL will finish it");
    }
}

/// Whether a failed write may have landed all the same (no answer, rather than a refusal).
fn outcome_unknown(e: &Error) -> bool {
    matches!(
        e,
        Error::Datastore(DatastoreError::Deadline(_) | DatastoreError::Unavailable(_))
    )
}

/// After a failed ADD whose endpoint write landed, or went unanswered and may have: delete
/// the endpoint if it is this call's (same container and addresses), so that no endpoint is
/// left naming addresses that are being given back.
async fn remove_own_endpoint<D: Datastore>(ds: &D, wep: &WorkloadEndpoint) {
    let (ns, name) = (&wep.metadata.namespace, &wep.metadata.name);
    let read =
        get_resource::<_, WorkloadEndpointSpec>(ds, Kind::WorkloadEndpoint, Some(ns), name).await;
    let stored = match read {
        Ok(w) => w,
        Err(e) if e.is_not_found() => return,
        Err(e) => {
            warn!(error = %e, name, "cannot tell whether the endpoint was written");
            return;
        }
    };
    if stored.spec.container_id != wep.spec.container_id
        || stored.spec.ip_networks != wep.spec.ip_networks
    {
        return;
    }
    let rev = Some(stored.metadata.resource_version.as_str());
    match delete_resource(ds, Kind::WorkloadEndpoint, Some(ns), name, rev).await {
        Ok(()) => info!(name, "deleted the endpoint of a failed ADD"),
        Err(e) => warn!(error = %e, name, "failed to delete the endpoint of a failed ADD"),
    }
}

/// Floating IPs NATed to the pod's address of the same family.
fn floating_nats(result: &CniResult, floating: &[String]) -> Vec<IpNat> {
    let v4 = result.ips.iter().find(|i| i.address.addr.is_ipv4());
    let v6 = result.ips.iter().find(|i| i.address.addr.is_ipv6());
    floating
        .iter()
        .filter_map(|ext| {
            let internal = if ext.contains(':') { v6 } else { v4 };
            internal.map(|i| IpNat {
                internal_ip: i.address.addr.to_string(),
                external_ip: ext.clone(),
            })
        })
        .collect()
}

/// The addresses on interface 1 (the container end): as host networks where the dataplane
/// put them so (`host_addresses`), else as IPAM gave them; routes as IPAM gave them.
fn finish_result(
    result: &mut CniResult,
    host_addresses: bool,
    host_veth: &str,
    ifname: &str,
    mac: &str,
    mtu: u32,
    netns: &str,
) {
    result.interfaces = endpoint::interfaces(host_veth, ifname, mac, mtu, netns);
    for ip in &mut result.ips {
        if host_addresses {
            ip.address = IpNet::host(ip.address.addr);
        }
        ip.interface = Some(1);
    }
}

/// ADD's undo without root: Calico IPAM in-process on the memory store (so "given back" is
/// checked in the store itself), a fake dataplane that logs what it is asked, and the
/// store's fault injection on the endpoint write. Every interleaving the end-to-end suites
/// reach, and the lost answer they cannot.
#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::rc::Rc;

    use serde_json::json;

    use super::*;
    use crate::config::NetConf;
    use crate::dataplane::{netlink_errno, DataplaneError, NetworkingResult};
    use crate::datastore::memory::{Fault, KeyClass, MemoryDatastore};
    use crate::datastore::Key;
    use crate::identifiers::WepIdentifiers;
    use crate::ipam_driver::calico::Known;
    use crate::ipam_driver::fake::FakeIpam;
    use crate::ipam_driver::{pick, Prepared};

    const CNI_ARGS: &str = "IgnoreUnknown=1;K8S_POD_NAMESPACE=ns1;K8S_POD_NAME=pod1";

    /// Where each step of the fake dataplane fails, and what it was asked to do.
    #[derive(Clone, Default)]
    struct FakeDataplane {
        fail_prepare: bool,
        fail_finish: bool,
        /// The MAC the interface knows before `finish` (the Linux pair's, built for the
        /// addresses' families).
        known_mac: Option<&'static str>,
        log: Rc<RefCell<Vec<&'static str>>>,
    }

    /// The MAC the fake's `finish` reports, as `known_mac` gives it.
    const FINISHED_MAC: &str = "0a:58:0a:50:00:01";

    struct FakeInterface(FakeDataplane);

    impl Dataplane for FakeDataplane {
        type Interface = FakeInterface;
        async fn prepare(self, _req: VethRequest) -> Result<FakeInterface, DataplaneError> {
            self.log.borrow_mut().push("prepare");
            match self.fail_prepare {
                true => Err(DataplaneError::CreateVeth(netlink_errno(libc::EEXIST))),
                false => Ok(FakeInterface(self)),
            }
        }
    }

    impl PodInterface for FakeInterface {
        async fn finish(
            &mut self,
            _addrs: &AddressRequest,
            _pod: &PodFacts<'_>,
        ) -> Result<NetworkingResult, DataplaneError> {
            self.0.log.borrow_mut().push("finish");
            match self.0.fail_finish {
                true => Err(DataplaneError::GatewayRoute(netlink_errno(
                    libc::ENETUNREACH,
                ))),
                false => Ok(NetworkingResult {
                    host_veth: "cali0123456789a".into(),
                    container_mac: FINISHED_MAC.to_uppercase(),
                    container_index: 2,
                }),
            }
        }

        async fn remove(self) -> Result<(), DataplaneError> {
            self.0.log.borrow_mut().push("remove");
            Ok(())
        }

        fn known_mac(&self, _addrs: &AddressRequest) -> Option<String> {
            self.0.known_mac.map(str::to_string)
        }
    }

    /// A node, a pool of one /29 block and a ready ClusterInformation.
    fn store() -> MemoryDatastore {
        let ds = MemoryDatastore::new();
        ds.put_raw(
            &Key::resource(Kind::Node, None, "node1"),
            &json!({"kind":"Node","apiVersion":"projectcalico.org/v3","metadata":{"name":"node1"},"spec":{}}),
        );
        ds.put_raw(
            &Key::resource(Kind::IpPool, None, "pool1"),
            &json!({"kind":"IPPool","apiVersion":"projectcalico.org/v3","metadata":{"name":"pool1"},
                    "spec":{"cidr":"10.80.0.0/29","blockSize":29}}),
        );
        ds
    }

    struct Fixture {
        conf: NetConf,
        ids: WepIdentifiers,
        args: CmdArgs,
        lock_dir: std::path::PathBuf,
    }

    impl Fixture {
        fn new(name: &str) -> Fixture {
            let lock_dir =
                std::env::temp_dir().join(format!("add-tail-{name}-{}", std::process::id()));
            let stdin = json!({
                "cniVersion": "1.0.0", "name": "net1", "type": "calico",
                "nodename": "node1",
                "ipam_lock_file": lock_dir.join("ipam.lock"),
                "ipam": {"type": "calico-ipam"},
            })
            .to_string()
            .into_bytes();
            let conf = NetConf::parse(&stdin).unwrap();
            let ids = WepIdentifiers::from_cni_args("node1", "c1", "eth0", CNI_ARGS).unwrap();
            let args = CmdArgs {
                container_id: "c1".into(),
                netns: "/run/netns/pod".into(),
                ifname: "eth0".into(),
                args: CNI_ARGS.into(),
                stdin_data: stdin,
                ..Default::default()
            };
            Fixture {
                conf,
                ids,
                args,
                lock_dir,
            }
        }

        fn endpoint(&self) -> WorkloadEndpoint {
            let name = self.ids.wep_name().unwrap();
            let mut wep = endpoint::new_endpoint(&self.ids, &name, "net1");
            wep.spec.interface_name = self.ids.host_veth_name();
            wep
        }

        fn veth(&self) -> VethRequest {
            VethRequest {
                netns_path: self.args.netns.clone(),
                ifname: "eth0".into(),
                host_veth: self.ids.host_veth_name(),
                mtu: 1450,
                num_queues: 0,
                container_mac: None,
                families: None,
            }
        }

        /// ADD's tail end to end: Calico IPAM alongside the fake interface, then the
        /// endpoint; `ipam_fails` replaces the IPAM with one that fails.
        fn run(
            &self,
            ds: &MemoryDatastore,
            dp: FakeDataplane,
            ipam_fails: bool,
        ) -> Result<CniResult> {
            self.run_with(ds, dp, ipam_fails, false)
        }

        /// `run`; with `beside`, the endpoint is written with IPAM's block write.
        fn run_with(
            &self,
            ds: &MemoryDatastore,
            dp: FakeDataplane,
            ipam_fails: bool,
            beside: bool,
        ) -> Result<CniResult> {
            let known = Known {
                conf: &self.conf,
                ids: &self.ids,
            };
            let driver = pick(true, ds, known, &self.args.stdin_data);
            let written_beside = EndpointBeside::new(ds, &self.endpoint());
            let tail = Tail {
                ds,
                ipam: &driver,
                allow_ip_forwarding: false,
                beside: beside.then_some(&written_beside),
            };
            crate::client::block_on(async {
                let prepared = Prepared {
                    beside: tail.beside.map(|b| b as &dyn WriteBeside),
                    ..Default::default()
                };
                let ipam = async {
                    match ipam_fails {
                        true => Err(Error::msg("failed to request IPv4 addresses: no pool")),
                        false => driver.add(&self.args, prepared).await,
                    }
                };
                let (result, link) = alongside(&tail, &self.args, dp, self.veth(), ipam).await?;
                network_and_write(
                    &tail,
                    &self.args,
                    result,
                    link,
                    self.endpoint(),
                    vec!["0.0.0.0/0".parse().unwrap()],
                    Extras::default(),
                    1450,
                )
                .await
            })
            .unwrap()
        }
    }

    /// How the endpoint goes out before its write after the interface.
    #[derive(Clone, Copy, Debug)]
    enum Ahead {
        /// With IPAM's block write (`Tail::beside`, the Kubernetes datastore's).
        WithAddresses,
        /// While the interface is finished, its MAC known (`PodInterface::known_mac`).
        BesideInterface,
    }

    impl Ahead {
        const BOTH: [Ahead; 2] = [Ahead::WithAddresses, Ahead::BesideInterface];
    }

    impl Fixture {
        /// `run`, the endpoint written `ahead`.
        fn run_ahead(
            &self,
            ds: &MemoryDatastore,
            mut dp: FakeDataplane,
            ipam_fails: bool,
            ahead: Ahead,
        ) -> Result<CniResult> {
            match ahead {
                Ahead::WithAddresses => self.run_with(ds, dp, ipam_fails, true),
                Ahead::BesideInterface => {
                    dp.known_mac = Some(FINISHED_MAC);
                    self.run_with(ds, dp, ipam_fails, false)
                }
            }
        }
    }

    impl Drop for Fixture {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.lock_dir);
        }
    }

    /// What the store holds of the call: the handle, the addresses allocated in the block,
    /// the endpoint.
    fn held(ds: &MemoryDatastore) -> (bool, usize, bool) {
        let handle = ds
            .peek(&Key::Handle {
                id: "net1.c1".into(),
            })
            .is_some();
        let allocated = ds
            .dump()
            .into_iter()
            .filter(|kv| matches!(kv.key, Key::Block { .. }))
            .map(|kv| {
                kv.value["allocations"]
                    .as_array()
                    .map_or(0, |a| a.iter().filter(|x| !x.is_null()).count())
            })
            .sum();
        let endpoint = ds
            .dump()
            .into_iter()
            .any(|kv| KeyClass::of(&kv.key) == KeyClass::Resource(Kind::WorkloadEndpoint));
        (handle, allocated, endpoint)
    }

    #[test]
    fn success_writes_the_endpoint_and_undoes_nothing() {
        let (f, ds, dp) = (Fixture::new("ok"), store(), FakeDataplane::default());
        let result = f.run(&ds, dp.clone(), false).unwrap();
        assert_eq!(result.ips.len(), 1);
        assert_eq!(result.ips[0].address.to_string(), "10.80.0.0/32");
        assert_eq!(*dp.log.borrow(), ["prepare", "finish"]);
        assert_eq!(held(&ds), (true, 1, true));
    }

    #[test]
    fn ipam_failing_removes_the_interface_it_ran_beside() {
        let (f, ds, dp) = (Fixture::new("ipam"), store(), FakeDataplane::default());
        let e = f.run(&ds, dp.clone(), true).unwrap_err();
        assert_eq!(e.to_string(), "failed to request IPv4 addresses: no pool");
        assert_eq!(*dp.log.borrow(), ["prepare", "remove"]);
        assert_eq!(held(&ds), (false, 0, false));
    }

    #[test]
    fn the_interface_failing_gives_the_addresses_back() {
        let f = Fixture::new("prepare");
        let (ds, dp) = (
            store(),
            FakeDataplane {
                fail_prepare: true,
                ..Default::default()
            },
        );
        let e = f.run(&ds, dp.clone(), false).unwrap_err();
        assert!(
            matches!(e, Error::Dataplane(DataplaneError::CreateVeth(_))),
            "{e:?}"
        );
        assert_eq!(*dp.log.borrow(), ["prepare"]);
        assert_eq!(held(&ds), (false, 0, false));
    }

    #[test]
    fn both_failing_reports_ipam_and_leaves_nothing() {
        let f = Fixture::new("both");
        let (ds, dp) = (
            store(),
            FakeDataplane {
                fail_prepare: true,
                ..Default::default()
            },
        );
        let e = f.run(&ds, dp.clone(), true).unwrap_err();
        assert!(e.to_string().starts_with("failed to request IPv4"), "{e}");
        assert_eq!(held(&ds), (false, 0, false));
    }

    #[test]
    fn finishing_the_interface_failing_gives_the_addresses_back() {
        let f = Fixture::new("finish");
        let (ds, dp) = (
            store(),
            FakeDataplane {
                fail_finish: true,
                ..Default::default()
            },
        );
        let e = f.run(&ds, dp.clone(), false).unwrap_err();
        assert!(
            matches!(e, Error::Dataplane(DataplaneError::GatewayRoute(_))),
            "{e:?}"
        );
        // `finish` removes what it made itself; the undo only gives the addresses back.
        assert_eq!(*dp.log.borrow(), ["prepare", "finish"]);
        assert_eq!(held(&ds), (false, 0, false));
    }

    /// The endpoint write refused, not applied, or applied with its answer lost: the
    /// interface is removed first (its host route must be gone before the address can go to
    /// another pod), then an endpoint that landed unanswered is deleted, then the addresses
    /// are given back.
    #[test]
    fn a_failed_endpoint_write_undoes_everything_in_order() {
        let wep = KeyClass::Resource(Kind::WorkloadEndpoint);
        for (name, fault) in [
            ("refused", Fault::ConflictOnWrite(1)),
            ("unavailable", Fault::UnavailableOnWrite(1)),
            ("lost", Fault::LoseAnswerOfWrite(1)),
        ] {
            let (f, ds, dp) = (Fixture::new(name), store(), FakeDataplane::default());
            ds.inject(Fault::on(wep, fault));
            let e = f.run(&ds, dp.clone(), false).unwrap_err();
            assert!(matches!(e, Error::Datastore(_)), "{name}: {e:?}");
            assert_eq!(*dp.log.borrow(), ["prepare", "finish", "remove"], "{name}");
            assert_eq!(held(&ds), (false, 0, false), "{name}");
            assert!(ds.pending_faults().is_empty(), "{name}");
        }
    }

    /// An endpoint that another call wrote meanwhile (another container) is not this
    /// call's to delete, even when this call's write went unanswered.
    #[test]
    fn an_unanswered_write_never_deletes_someone_elses_endpoint() {
        for known_mac in [None, Some(FINISHED_MAC)] {
            let (f, ds) = (Fixture::new("other"), store());
            let dp = FakeDataplane {
                known_mac,
                ..Default::default()
            };
            let mut other = f.endpoint();
            other.spec.container_id = "c2".into();
            ds.put_raw(
                &Key::resource(Kind::WorkloadEndpoint, Some("ns1"), &other.metadata.name),
                &crate::datastore::to_value(&other).unwrap(),
            );
            // The create fails as "already exists", not as a lost answer: nothing is deleted.
            let e = f.run(&ds, dp, false).unwrap_err();
            assert!(matches!(e, Error::Datastore(_)), "{known_mac:?}: {e:?}");
            let (handle, allocated, endpoint) = held(&ds);
            assert_eq!((handle, allocated), (false, 0), "{known_mac:?}");
            assert!(endpoint, "the other container's endpoint is kept");
            let stored = stored_endpoint(&ds).unwrap();
            assert_eq!(stored["spec"]["containerID"], json!("c2"));
        }
    }

    /// The endpoint as stored, if it is.
    fn stored_endpoint(ds: &MemoryDatastore) -> Option<serde_json::Value> {
        ds.dump()
            .into_iter()
            .find(|kv| KeyClass::of(&kv.key) == KeyClass::Resource(Kind::WorkloadEndpoint))
            .map(|kv| kv.value)
    }

    /// The endpoint written ahead, with IPAM's block write (the Kubernetes datastore's) or
    /// while the interface is finished: on success, it is not written again.
    #[test]
    fn the_endpoint_written_ahead_is_not_written_again() {
        for ahead in Ahead::BOTH {
            let f = Fixture::new(&format!("ahead-ok-{ahead:?}"));
            let (ds, dp) = (store(), FakeDataplane::default());
            let result = f.run_ahead(&ds, dp.clone(), false, ahead).unwrap();
            assert_eq!(result.ips[0].address.to_string(), "10.80.0.0/32");
            assert_eq!(*dp.log.borrow(), ["prepare", "finish"], "{ahead:?}");
            assert_eq!(held(&ds), (true, 1, true), "{ahead:?}");
            let wep = KeyClass::Resource(Kind::WorkloadEndpoint);
            assert_eq!(ds.writes_to(wep), 1, "{ahead:?}");
            let stored = stored_endpoint(&ds).unwrap();
            assert_eq!(stored["spec"]["ipNetworks"], json!(["10.80.0.0/32"]));
            if let Ahead::BesideInterface = ahead {
                assert_eq!(stored["spec"]["mac"], json!(FINISHED_MAC));
            }
        }
    }

    /// The interface failing after the endpoint went ahead of it: the endpoint is taken
    /// back, whether its write was answered or its answer was lost, then the addresses are
    /// given back. A write refused or not applied leaves nothing to take back. (An endpoint
    /// written only after the interface would not have been written at all.)
    #[test]
    fn the_interface_failing_takes_back_the_endpoint_written_ahead_of_it() {
        let wep = KeyClass::Resource(Kind::WorkloadEndpoint);
        for ahead in Ahead::BOTH {
            for (name, fault) in [
                ("answered", None),
                ("lost", Some(Fault::LoseAnswerOfWrite(1))),
                ("unavailable", Some(Fault::UnavailableOnWrite(1))),
                ("refused", Some(Fault::ConflictOnWrite(1))),
            ] {
                let f = Fixture::new(&format!("ahead-finish-{name}-{ahead:?}"));
                let ds = store();
                let dp = FakeDataplane {
                    fail_finish: true,
                    ..Default::default()
                };
                if let Some(fault) = fault {
                    ds.inject(Fault::on(wep, fault));
                }
                let e = f.run_ahead(&ds, dp.clone(), false, ahead).unwrap_err();
                let case = format!("{name}, {ahead:?}");
                assert!(
                    matches!(e, Error::Dataplane(DataplaneError::GatewayRoute(_))),
                    "{case}: {e:?}"
                );
                assert_eq!(*dp.log.borrow(), ["prepare", "finish"], "{case}");
                assert_eq!(held(&ds), (false, 0, false), "{case}");
                assert!(ds.pending_faults().is_empty(), "{case}");
                // The write, and the delete where it landed.
                let landed = matches!(name, "answered" | "lost");
                assert_eq!(ds.writes_to(wep), if landed { 2 } else { 1 }, "{case}");
            }
        }
    }

    /// The endpoint's write ahead refused or unanswered: it is written again after the
    /// interface, as without it.
    #[test]
    fn an_endpoint_not_written_ahead_is_written_after_the_interface() {
        let wep = KeyClass::Resource(Kind::WorkloadEndpoint);
        for ahead in Ahead::BOTH {
            for (name, fault) in [
                ("refused", Fault::ConflictOnWrite(1)),
                ("unavailable", Fault::UnavailableOnWrite(1)),
            ] {
                let f = Fixture::new(&format!("ahead-again-{name}-{ahead:?}"));
                let (ds, dp) = (store(), FakeDataplane::default());
                ds.inject(Fault::on(wep, fault));
                f.run_ahead(&ds, dp.clone(), false, ahead).unwrap();
                let case = format!("{name}, {ahead:?}");
                assert_eq!(held(&ds), (true, 1, true), "{case}");
                assert_eq!(ds.writes_to(wep), 2, "{case}");
                assert!(ds.pending_faults().is_empty(), "{case}");
            }
        }
    }

    /// The MAC known before `finish` is not the one it reports (it built the pair again for
    /// other families): the endpoint written ahead is replaced by one with the right MAC.
    #[test]
    fn an_endpoint_written_ahead_with_another_mac_is_written_again() {
        let f = Fixture::new("ahead-mac");
        let ds = store();
        let dp = FakeDataplane {
            known_mac: Some("02:00:00:00:00:01"),
            ..Default::default()
        };
        f.run_with(&ds, dp.clone(), false, false).unwrap();
        assert_eq!(*dp.log.borrow(), ["prepare", "finish"]);
        assert_eq!(held(&ds), (true, 1, true));
        let stored = stored_endpoint(&ds).unwrap();
        assert_eq!(stored["spec"]["mac"], json!(FINISHED_MAC));
        // Written, taken back, written again.
        let wep = KeyClass::Resource(Kind::WorkloadEndpoint);
        assert_eq!(ds.writes_to(wep), 3);
    }

    /// A block write that failed (not applied) and is tried again for the same address: the
    /// endpoint that went with it stays (written once), naming the address given in the end.
    #[test]
    fn a_block_write_tried_again_takes_the_endpoint_with_it() {
        let (f, ds, dp) = (
            Fixture::new("beside-retry"),
            store(),
            FakeDataplane::default(),
        );
        ds.inject(Fault::on(KeyClass::Block, Fault::UnavailableOnWrite(2)));
        let result = f.run_with(&ds, dp.clone(), false, true).unwrap();
        assert!(ds.pending_faults().is_empty());
        assert_eq!(*dp.log.borrow(), ["prepare", "finish"]);
        assert_eq!(held(&ds), (true, 1, true));
        let wep = KeyClass::Resource(Kind::WorkloadEndpoint);
        assert_eq!(
            ds.writes_to(wep),
            1,
            "written once, kept for the same address"
        );
        let stored = ds
            .dump()
            .into_iter()
            .find(|kv| KeyClass::of(&kv.key) == wep)
            .unwrap();
        assert_eq!(
            stored.value["spec"]["ipNetworks"],
            json!([result.ips[0].address.to_string()])
        );
    }

    /// IPAM failing after the endpoint went with its block writes (each lost its
    /// compare-and-swap until IPAM gave up): the endpoint is taken back and the interface
    /// removed; nothing is left.
    #[test]
    fn ipam_failing_takes_back_the_endpoint_written_with_the_addresses() {
        let (f, ds, dp) = (
            Fixture::new("beside-ipam"),
            store(),
            FakeDataplane::default(),
        );
        let tries = crate::ipam::allocator::DATASTORE_RETRIES as u64;
        // The block's claim is its first write; every assignment after it loses.
        for n in 2..=tries + 1 {
            ds.inject(Fault::on(KeyClass::Block, Fault::ConflictOnWrite(n)));
        }
        let e = f.run_with(&ds, dp.clone(), false, true).unwrap_err();
        assert!(e.to_string().contains("Max retries"), "{e}");
        assert_eq!(*dp.log.borrow(), ["prepare", "remove"]);
        assert!(ds.pending_faults().is_empty());
        assert_eq!(held(&ds), (false, 0, false));
        // Every try was for the same address: written once, kept, then taken back.
        let writes = ds.writes_to(KeyClass::Resource(Kind::WorkloadEndpoint));
        assert_eq!(writes, 2, "{writes}");
    }

    /// Runs the tail with `FakeIpam` giving `ips`; the log and what was given back.
    fn run_with_fake_ipam(
        f: &Fixture,
        ds: &MemoryDatastore,
        dp: FakeDataplane,
        ips: Vec<&'static str>,
    ) -> (Result<CniResult>, Vec<&'static str>, Vec<IpAddr>) {
        let ipam = FakeIpam {
            ips,
            log: dp.log.clone(),
            ..Default::default()
        };
        let tail = Tail {
            ds,
            ipam: &ipam,
            allow_ip_forwarding: false,
            beside: None,
        };
        let out = crate::client::block_on(async {
            let add = ipam.add(&f.args, Prepared::default());
            let (result, link) = alongside(&tail, &f.args, dp.clone(), f.veth(), add).await?;
            let routes = vec!["0.0.0.0/0".parse().unwrap(), "::/0".parse().unwrap()];
            network_and_write(
                &tail,
                &f.args,
                result,
                link,
                f.endpoint(),
                routes,
                Extras::default(),
                1450,
            )
            .await
        })
        .unwrap();
        let log = dp.log.borrow().clone();
        (out, log, ipam.given_back.into_inner())
    }

    /// With any IPAM, a dual-stack result whose endpoint write fails: the interface goes
    /// first, then exactly the call's addresses, both families, are given back.
    #[test]
    fn any_ipam_gets_back_exactly_its_addresses_after_the_interface_is_gone() {
        let (f, ds, dp) = (
            Fixture::new("fake-order"),
            store(),
            FakeDataplane::default(),
        );
        ds.inject(Fault::on(
            KeyClass::Resource(Kind::WorkloadEndpoint),
            Fault::UnavailableOnWrite(1),
        ));
        let (out, log, given) = run_with_fake_ipam(&f, &ds, dp, vec!["10.9.0.7/32", "fd00::7/128"]);
        assert!(out.is_err());
        assert_eq!(
            log,
            ["ipam add", "prepare", "finish", "remove", "ipam give back"]
        );
        let want: Vec<IpAddr> = vec!["10.9.0.7".parse().unwrap(), "fd00::7".parse().unwrap()];
        assert_eq!(given, want);
    }

    /// With any IPAM, the interface failing gives back what IPAM gave, and nothing is
    /// removed (`prepare` removed what it made itself).
    #[test]
    fn any_ipam_gets_back_its_addresses_when_the_interface_fails() {
        let f = Fixture::new("fake-prepare");
        let (ds, dp) = (
            store(),
            FakeDataplane {
                fail_prepare: true,
                ..Default::default()
            },
        );
        let (out, log, given) = run_with_fake_ipam(&f, &ds, dp, vec!["10.9.0.8/32"]);
        assert!(matches!(out, Err(Error::Dataplane(_))));
        assert_eq!(log, ["ipam add", "prepare", "ipam give back"]);
        assert_eq!(given, vec!["10.9.0.8".parse::<IpAddr>().unwrap()]);
        assert_eq!(held(&ds), (false, 0, false));
    }
}
