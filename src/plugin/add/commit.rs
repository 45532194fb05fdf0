//! ADD's commit: IPAM alongside the pod's interface (`addresses_and_interface`), then the
//! addresses and routes, the WorkloadEndpoint and the result (`finish_and_write`). Each
//! step records what it made in the call's `Made`; a step that fails leaves the rest to the
//! caller's one rollback (`rollback.rs`), which undoes exactly what this call made.
//!
//! The endpoint goes out ahead of the interface where all it holds is known earlier
//! (`plan::EndpointWrite`): on the Kubernetes datastore a pod's endpoint (its address and
//! container ID annotations) goes with IPAM's block write, one round trip less; any other
//! new endpoint whose MAC is known before the interface is finished (the Linux pair, built
//! for the addresses' families: etcd's endpoint stores the MAC) is written while it is
//! finished. Until the call succeeds, the rollback takes it back (as DEL would) before the
//! addresses are given back; after a SIGKILL, the runtime's DEL removes it as any endpoint
//! of its container.
//!
//! Generic over the datastore, the IPAM and the dataplane, so that every failure
//! interleaving is unit-tested with the memory store and fakes (`tests` below), without
//! root.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::IpAddr;

use tracing::{info, warn};

use super::rollback::Made;
use crate::dataplane::{AddressRequest, Dataplane, PodFacts, VethRequest};
use crate::datastore::model::{IpNat, WorkloadEndpoint};
use crate::datastore::validate;
use crate::datastore::Datastore;
use crate::error::Result;
use crate::plugin::endpoint;
use crate::plugin::ipam::IpamDriver;
use crate::plugin::plan::EndpointWrite;
use crate::skel::{CmdArgs, CniResult};
use crate::support::net::IpNet;

/// What `finish_and_write` needs besides the addresses and the endpoint.
pub struct Finish<'a> {
    pub args: &'a CmdArgs,
    /// The pod's route destinations.
    pub routes: Vec<IpNet>,
    /// The MTU the result reports (`AddCx::result_mtu`).
    pub mtu: i64,
    /// `container_settings.allow_ip_forwarding`.
    pub allow_ip_forwarding: bool,
    /// How a new endpoint goes out ahead of its write after the interface (with the
    /// addresses: already done by IPAM's block write).
    pub endpoint_write: EndpointWrite,
    /// The pod's `floatingIPs`, NATed to its addresses.
    pub floating_ips: Vec<String>,
    /// No host routes (a KubeVirt migration target's).
    pub skip_host_routes: bool,
    /// The pod's annotations, for the gRPC dataplane.
    pub annotations: BTreeMap<String, String>,
}

/// Runs IPAM (`ipam`) and builds the pod's interface for `veth` at the same time,
/// recording what each made (the addresses under `args`' handle). When both fail, IPAM's
/// error is the call's (it is what the sequential order reported).
pub async fn addresses_and_interface<D: Datastore, I: IpamDriver, P: Dataplane>(
    made: &Made<'_, D, I, P>,
    args: &CmdArgs,
    veth: VethRequest,
    ipam: impl Future<Output = Result<CniResult>>,
) -> Result<CniResult> {
    let (assigned, built) = tokio::join!(ipam, made.build_interface(veth));
    if let Ok(result) = &assigned {
        made.addresses_given(args, &addresses_of(result));
    }
    match (assigned, built) {
        (Ok(result), Ok(())) => Ok(result),
        (Ok(_), Err(e)) => Err(e.into()),
        (Err(e), Ok(())) => Err(e),
        (Err(e), Err(net)) => {
            warn!(error = %net, "the veth pair failed too (and was removed)");
            Err(e)
        }
    }
}

/// The addresses of an IPAM result.
pub fn addresses_of(result: &CniResult) -> Vec<IpAddr> {
    result.ips.iter().map(|ip| ip.address.addr).collect()
}

/// Finishes the interface with `result`'s addresses, writes the endpoint and shapes the
/// result.
pub async fn finish_and_write<D: Datastore, I: IpamDriver, P: Dataplane>(
    made: &Made<'_, D, I, P>,
    mut result: CniResult,
    mut wep: WorkloadEndpoint,
    finish: Finish<'_>,
) -> Result<CniResult> {
    let Finish {
        args,
        routes,
        mtu,
        allow_ip_forwarding,
        endpoint_write,
        floating_ips,
        skip_host_routes,
        annotations,
    } = finish;
    wep.spec.ip_networks = endpoint::ip_networks(&result);
    wep.spec.ip_nats = floating_nats(&result, &floating_ips);
    validate::ip_nats(&wep.spec.ip_nats)?;
    let addrs = address_request(&result, routes, allow_ip_forwarding, skip_host_routes);
    let writes = made.endpoint();
    writes.plan(&wep);
    // A new endpoint whose MAC is known before the interface is finished is written while
    // it is: one write less on the call's path.
    let new_endpoint = wep.metadata.resource_version.is_empty();
    let known_mac = match endpoint_write {
        EndpointWrite::WithInterface if new_endpoint => made.known_mac(&addrs),
        _ => None,
    };
    let pod = PodFacts {
        ips: &result.ips,
        endpoint: &wep,
        annotations: &annotations,
    };
    let finished = match known_mac {
        Some(mac) => {
            let (finished, ()) = tokio::join!(
                made.finish_interface(&addrs, &pod),
                writes.write_planned(&addrs.ips, Some(mac))
            );
            finished
        }
        None => made.finish_interface(&addrs, &pod).await,
    };
    let net = finished?;
    info!(host_veth = %net.host_veth, mac = %net.container_mac, "Networked namespace");
    wep.spec.mac = net.container_mac.to_lowercase();
    wep.spec.interface_name = net.host_veth.clone();
    match writes.write_complete(&mut wep).await? {
        true => {
            info!(name = %wep.metadata.name, "Wrote endpoint to datastore (ahead of the interface)")
        }
        false => info!(name = %wep.metadata.name, "Wrote endpoint to datastore"),
    }
    finish_result(
        &mut result,
        made.result_has_host_addresses(),
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

/// Floating IPs NATed to the pod's address of the same family (by a `:` in the floating IP,
/// as upstream tells them). One of a family the pod has no address in gets Go's text of a
/// nil address, `<nil>`, which the validator then refuses.
fn floating_nats(result: &CniResult, floating: &[String]) -> Vec<IpNat> {
    let v4 = result.ips.iter().find(|i| i.address.addr.is_ipv4());
    let v6 = result.ips.iter().find(|i| i.address.addr.is_ipv6());
    floating
        .iter()
        .map(|ext| {
            let internal = if ext.contains(':') { v6 } else { v4 };
            IpNat {
                internal_ip: internal
                    .map(|i| i.address.addr.to_string())
                    .unwrap_or_else(|| "<nil>".into()),
                external_ip: ext.clone(),
            }
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
    mtu: i64,
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
    use serde_json::json;

    use super::*;
    use crate::calico_ipam::call::Known;
    use crate::config::identifiers::WepIdentifiers;
    use crate::config::NetConf;
    use crate::dataplane::DataplaneError;
    use crate::datastore::memory::{Fault, KeyClass, MemoryDatastore};
    use crate::datastore::{Key, Kind};
    use crate::error::Error;

    use crate::plugin::add::interface::tests::{FakeDataplane, FINISHED_MAC};
    use crate::plugin::ipam::fake::FakeIpam;
    use crate::plugin::ipam::{pick, AddHints, WriteBeside};

    const CNI_ARGS: &str = "IgnoreUnknown=1;K8S_POD_NAMESPACE=ns1;K8S_POD_NAME=pod1";

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
            self.add(
                ds,
                dp,
                Script {
                    ipam_fails,
                    beside,
                    ..Default::default()
                },
            )
        }

        /// An ADD as `cmd_add` runs it, from the pod's read to the endpoint, as far as
        /// `script` lets it; on failure, the one rollback.
        fn add(
            &self,
            ds: &MemoryDatastore,
            dp: FakeDataplane,
            script: Script,
        ) -> Result<CniResult> {
            let known = Known {
                conf: &self.conf,
                ids: &self.ids,
            };
            let driver = pick(true, ds, known, &self.args.stdin_data);
            crate::call::client::block_on(async {
                let made = Made::new(ds, &driver, dp);
                let outcome = async {
                    if script.pod_read_fails {
                        return Err(Error::msg("pods \"pod1\" not found"));
                    }
                    let wep = self.endpoint();
                    if script.beside {
                        made.endpoint().plan(&wep);
                    }
                    let hints = AddHints {
                        beside: script.beside.then(|| made.endpoint() as &dyn WriteBeside),
                        ..Default::default()
                    };
                    let ipam = async {
                        match script.ipam_fails {
                            true => Err(Error::msg("failed to request IPv4 addresses: no pool")),
                            false => driver.add(&self.args, Default::default(), hints).await,
                        }
                    };
                    let result =
                        addresses_and_interface(&made, &self.args, self.veth(), ipam).await?;
                    finish_and_write(&made, result, wep, self.finish(script.beside)).await
                }
                .await;
                if outcome.is_err() {
                    made.rollback().await;
                }
                outcome
            })
            .unwrap()
        }

        fn finish(&self, beside: bool) -> Finish<'_> {
            Finish {
                args: &self.args,
                routes: vec!["0.0.0.0/0".parse().unwrap()],
                mtu: 1450,
                allow_ip_forwarding: false,
                endpoint_write: match beside {
                    true => EndpointWrite::WithAddresses,
                    false => EndpointWrite::WithInterface,
                },
                floating_ips: Vec::new(),
                skip_host_routes: false,
                annotations: BTreeMap::new(),
            }
        }
    }

    /// What an ADD meets, step by step (`Fixture::add`).
    #[derive(Clone, Copy, Debug, Default)]
    struct Script {
        pod_read_fails: bool,
        ipam_fails: bool,
        /// The endpoint goes with IPAM's block write.
        beside: bool,
    }

    /// How the endpoint goes out before its write after the interface.
    #[derive(Clone, Copy, Debug)]
    enum WrittenWith {
        /// With IPAM's block write (`Tail::beside`, the Kubernetes datastore's).
        WithAddresses,
        /// While the interface is finished, its MAC known (`PodInterface::known_mac`).
        WithInterface,
    }

    impl WrittenWith {
        const BOTH: [WrittenWith; 2] = [WrittenWith::WithAddresses, WrittenWith::WithInterface];
    }

    impl Fixture {
        /// `run`, the endpoint written `ahead`.
        fn run_ahead(
            &self,
            ds: &MemoryDatastore,
            mut dp: FakeDataplane,
            ipam_fails: bool,
            ahead: WrittenWith,
        ) -> Result<CniResult> {
            match ahead {
                WrittenWith::WithAddresses => self.run_with(ds, dp, ipam_fails, true),
                WrittenWith::WithInterface => {
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
        assert_eq!(*dp.log.borrow(), ["build", "finish"]);
        assert_eq!(held(&ds), (true, 1, true));
    }

    #[test]
    fn ipam_failing_removes_the_interface_it_ran_beside() {
        let (f, ds, dp) = (Fixture::new("ipam"), store(), FakeDataplane::default());
        let e = f.run(&ds, dp.clone(), true).unwrap_err();
        assert_eq!(e.to_string(), "failed to request IPv4 addresses: no pool");
        assert_eq!(*dp.log.borrow(), ["build", "remove"]);
        assert_eq!(held(&ds), (false, 0, false));
    }

    #[test]
    fn the_interface_failing_gives_the_addresses_back() {
        let f = Fixture::new("build");
        let (ds, dp) = (
            store(),
            FakeDataplane {
                fail_build: true,
                ..Default::default()
            },
        );
        let e = f.run(&ds, dp.clone(), false).unwrap_err();
        assert!(
            matches!(e, Error::Dataplane(DataplaneError::CreateVeth(_))),
            "{e:?}"
        );
        assert_eq!(*dp.log.borrow(), ["build"]);
        assert_eq!(held(&ds), (false, 0, false));
    }

    #[test]
    fn both_failing_reports_ipam_and_leaves_nothing() {
        let f = Fixture::new("both");
        let (ds, dp) = (
            store(),
            FakeDataplane {
                fail_build: true,
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
        assert_eq!(*dp.log.borrow(), ["build", "finish"]);
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
            assert_eq!(*dp.log.borrow(), ["build", "finish", "remove"], "{name}");
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
        for ahead in WrittenWith::BOTH {
            let f = Fixture::new(&format!("ahead-ok-{ahead:?}"));
            let (ds, dp) = (store(), FakeDataplane::default());
            let result = f.run_ahead(&ds, dp.clone(), false, ahead).unwrap();
            assert_eq!(result.ips[0].address.to_string(), "10.80.0.0/32");
            assert_eq!(*dp.log.borrow(), ["build", "finish"], "{ahead:?}");
            assert_eq!(held(&ds), (true, 1, true), "{ahead:?}");
            let wep = KeyClass::Resource(Kind::WorkloadEndpoint);
            assert_eq!(ds.writes_to(wep), 1, "{ahead:?}");
            let stored = stored_endpoint(&ds).unwrap();
            assert_eq!(stored["spec"]["ipNetworks"], json!(["10.80.0.0/32"]));
            if let WrittenWith::WithInterface = ahead {
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
        for ahead in WrittenWith::BOTH {
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
                assert_eq!(*dp.log.borrow(), ["build", "finish"], "{case}");
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
        for ahead in WrittenWith::BOTH {
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
        assert_eq!(*dp.log.borrow(), ["build", "finish"]);
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
        assert_eq!(*dp.log.borrow(), ["build", "finish"]);
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
        assert_eq!(*dp.log.borrow(), ["build", "remove"]);
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
        let out = crate::call::client::block_on(async {
            let made = Made::new(ds, &ipam, dp.clone());
            let outcome = async {
                let add = ipam.add(&f.args, (), AddHints::default());
                let result = addresses_and_interface(&made, &f.args, f.veth(), add).await?;
                let mut finish = f.finish(false);
                finish.routes = vec!["0.0.0.0/0".parse().unwrap(), "::/0".parse().unwrap()];
                finish_and_write(&made, result, f.endpoint(), finish).await
            }
            .await;
            if outcome.is_err() {
                made.rollback().await;
            }
            outcome
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
            ["ipam add", "build", "finish", "remove", "ipam give back"]
        );
        let want: Vec<IpAddr> = vec!["10.9.0.7".parse().unwrap(), "fd00::7".parse().unwrap()];
        assert_eq!(given, want);
    }

    /// With any IPAM, the interface failing gives back what IPAM gave, and nothing is
    /// removed (`build` removed what it made itself).
    #[test]
    fn any_ipam_gets_back_its_addresses_when_the_interface_fails() {
        let f = Fixture::new("fake-build");
        let (ds, dp) = (
            store(),
            FakeDataplane {
                fail_build: true,
                ..Default::default()
            },
        );
        let (out, log, given) = run_with_fake_ipam(&f, &ds, dp, vec!["10.9.0.8/32"]);
        assert!(matches!(out, Err(Error::Dataplane(_))));
        assert_eq!(log, ["ipam add", "build", "ipam give back"]);
        assert_eq!(given, vec!["10.9.0.8".parse::<IpAddr>().unwrap()]);
        assert_eq!(held(&ds), (false, 0, false));
    }

    /// Every interleaving of success and failure of the steps an ADD takes: the pod's read,
    /// IPAM's assignment, the interface built and finished, and the endpoint's write
    /// (refused, lost, unavailable),
    /// with the endpoint going with the addresses or beside the interface. A success holds
    /// the handle, one address, the endpoint and one interface; a failure holds nothing, and
    /// no interface stands.
    #[test]
    fn every_interleaving_holds_all_or_nothing() {
        let wep = KeyClass::Resource(Kind::WorkloadEndpoint);
        let faults = [
            None,
            Some(Fault::ConflictOnWrite(1)),
            Some(Fault::LoseAnswerOfWrite(1)),
            Some(Fault::UnavailableOnWrite(1)),
        ];
        let mut cases = 0;
        for bits in 0u32..(1 << 6) {
            let bit = |n: u32| bits & (1 << n) != 0;
            let script = Script {
                pod_read_fails: bit(0),
                ipam_fails: bit(1),
                beside: bit(2),
            };
            let dp = FakeDataplane {
                fail_build: bit(3),
                fail_finish: bit(4),
                known_mac: bit(5).then_some(FINISHED_MAC),
                ..Default::default()
            };
            for fault in &faults {
                cases += 1;
                let f = Fixture::new(&format!("every-{bits}"));
                let ds = store();
                if let Some(fault) = fault {
                    ds.inject(Fault::on(wep, *fault));
                }
                let standing = dp.standing.clone();
                standing.set(0);
                let out = f.add(&ds, dp.clone(), script);
                let case = format!("{script:?}, {bits:#b}, {fault:?}: {out:?}");
                let interfaces = standing.get();
                match out {
                    Ok(_) => {
                        assert_eq!(held(&ds), (true, 1, true), "{case}");
                        assert_eq!(interfaces, 1, "{case}");
                    }
                    Err(_) => {
                        assert_eq!(held(&ds), (false, 0, false), "{case}");
                        assert_eq!(interfaces, 0, "{case}");
                    }
                }
                dp.log.borrow_mut().clear();
            }
        }
        assert_eq!(cases, 256);
    }
}
