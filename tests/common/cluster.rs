#![allow(dead_code)]
//! One fixture interface over both datastores, so an end-to-end scenario is written once and
//! run on etcd ([`World`]) and on the Kubernetes datastore ([`KddWorld`]). It holds what a
//! scenario needs independent of storage: the NetConf, running the binary, the pod and host
//! netns, seeding pools and pods, readiness, and storage-neutral views of what was stored
//! (handle IDs, allocated addresses, the endpoint's addresses). Exact keys and JSON stay in
//! the backend-specific suites.

use std::net::IpAddr;

use serde_json::{json, Value};

use super::cni::{Invocation, Outcome};
use super::kdd::{KddWorld, KubeStore, CRD};
use super::kube_api::KubeApi;
use super::netns::Netns;
use super::world::{World, WEP_PREFIX};

/// The node's pod CIDRs on the core Node a scenario can read (the Node in [`KddWorld`]).
pub const NODE_POD_CIDR_V4: &str = "10.244.1.0/24";
pub const NODE_POD_CIDR_V6: &str = "fd00:244:1::/64";

/// One address held in a block, and the handle that holds it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Allocation {
    pub ip: IpAddr,
    pub handle: String,
}

/// Each scenario (a `fn name(c: &impl Cluster)` in the invoking file, which imports
/// `World`, `RealKddWorld` and `require_root`) as `etcd::<name>` and `kdd::<name>` (on the
/// real kube-apiserver; `SKIPPED` and passing when the kube-apiserver bundle is absent); attributes
/// after `kdd:` apply to the Kubernetes-datastore test only (an `#[ignore]` with the reason
/// while the plugin is wrong).
#[macro_export]
macro_rules! on_both_backends {
    ($($(kdd: #[$kdd:meta])* $name:ident),* $(,)?) => {
        mod etcd {
            $(
                #[test]
                fn $name() {
                    super::require_root();
                    super::$name(&super::World::new());
                }
            )*
        }
        mod kdd {
            $(
                #[test]
                $(#[$kdd])*
                fn $name() {
                    super::require_root();
                    if let Some(w) = super::RealKddWorld::real_or_skip(stringify!($name)) {
                        super::$name(&w);
                    }
                }
            )*
        }
    };
}

/// A test cluster of one node (`node1`) on some datastore.
pub trait Cluster {
    /// "etcd" or "kdd", for messages.
    fn backend(&self) -> &'static str;
    /// The network name of [`Cluster::conf`]: handle IDs are `<network>.<container ID>`.
    fn network(&self) -> &'static str;
    /// The base NetConf (calico-ipam, this node, this datastore), `extra` merged in.
    fn conf(&self, extra: Value) -> String;
    /// A NetConf whose datastore cannot be reached (nothing listens there).
    fn unreachable_conf(&self) -> String;
    /// Runs `calico` in the host netns.
    fn calico(&self, inv: &Invocation, conf: &str) -> Outcome;
    /// Runs `calico-ipam` in the host netns.
    fn ipam(&self, inv: &Invocation, conf: &str) -> Outcome;
    /// The host netns's name (`ip netns exec <name>`).
    fn host_name(&self) -> &str;
    /// A per-test scratch directory.
    fn scratch(&self) -> &std::path::Path;
    /// The CNI_PATH the fixture runs the binary with.
    fn cni_path(&self) -> String;
    /// Runs a shell command in the host netns, returning stdout.
    fn host_sh(&self, cmd: &str) -> String;
    /// A fresh pod network namespace.
    fn pod(&self) -> Netns {
        Netns::new("pod")
    }

    /// Creates or replaces an IPPool.
    fn seed_pool(&self, name: &str, spec: Value);
    /// Deletes an IPPool.
    fn remove_pool(&self, name: &str);
    /// Makes the pod `ns/name` exist where the backend needs it (the Kubernetes datastore
    /// with policy type k8s reads it; etcd without policy needs nothing).
    fn prepare_pod(&self, ns: &str, name: &str);
    /// Sets ClusterInformation's `datastoreReady`.
    fn set_ready(&self, ready: bool);
    /// NetConf fields that let the plugin read this node's core Node (podCIDRs
    /// [`NODE_POD_CIDR_V4`] and [`NODE_POD_CIDR_V6`]), and whatever must live as long as they
    /// are used (on etcd, a test API server in the host netns that holds that Node).
    fn node_api(&self) -> (Value, Option<KubeApi>);

    /// Every IPAM block, in the stored form both backends share (`cidr`, `affinity`,
    /// `allocations`, `unallocated`, `attributes`, ...).
    fn blocks(&self) -> Vec<Value>;
    /// The handle IDs stored, sorted.
    fn handles(&self) -> Vec<String>;
    /// Block affinities as (node, block CIDR), sorted, whatever their state.
    fn affinities(&self) -> Vec<(String, String)>;
    /// The addresses of pod `ns/pod`'s endpoint (`a.b.c.d/32`, ...): the WorkloadEndpoint's
    /// ipNetworks on etcd, the pod's `cni.projectcalico.org/podIPs` annotation on the
    /// Kubernetes datastore. `None` when there is no endpoint / no address.
    fn endpoint_ips(&self, ns: &str, pod: &str) -> Option<Vec<String>>;
    /// The container (sandbox) ID recorded with pod `ns/pod`'s endpoint: the
    /// WorkloadEndpoint's containerID on etcd, the pod's `cni.projectcalico.org/containerID`
    /// annotation on the Kubernetes datastore (which, as upstream, outlives DEL).
    fn endpoint_container_id(&self, ns: &str, pod: &str) -> Option<String>;
    /// Nothing of any pod is left, in the datastore or in the host netns.
    fn assert_clean(&self);
    /// Removes pod `ns/pod`'s endpoint behind the plugin's back: the WorkloadEndpoint on
    /// etcd, the pod itself on the Kubernetes datastore.
    fn remove_endpoint(&self, ns: &str, pod: &str);
    /// Makes another node exist (etcd needs its Calico Node for IPAM; the Kubernetes
    /// datastore reads core Nodes only for labels).
    fn seed_other_node(&self, name: &str);
    /// Removes an IPAM handle object behind the plugin's back.
    fn remove_handle(&self, id: &str);
    /// Allocates the first free address of the first block to `handle`, with the
    /// allocation attribute `attribute` (`{"handle_id", "secondary", ...}`) as another
    /// writer (calico/node, an upstream calico-ipam) stores it, and writes the handle.
    fn seed_allocation(&self, handle: &str, attribute: Value);
    /// Allocates the first free address of the first block to a tunnel-address handle
    /// `ipip-tunnel-addr-<node>` for `node`, as calico/node does; returns the handle ID.
    fn seed_tunnel_address(&self, node: &str) -> String {
        let handle = format!("ipip-tunnel-addr-{node}");
        self.seed_allocation(
            &handle,
            json!({"handle_id": handle, "secondary": {"node": node, "type": "ipipTunnelAddress"}}),
        );
        handle
    }

    /// The addresses allocated across all blocks, sorted.
    fn allocated(&self) -> Vec<Allocation> {
        let mut all: Vec<Allocation> = self.blocks().iter().flat_map(block_allocations).collect();
        all.sort();
        all
    }

    /// The handle ID a container gets with [`Cluster::conf`]'s network.
    fn handle(&self, container_id: &str) -> String {
        format!("{}.{container_id}", self.network())
    }
}

/// The addresses a stored block holds (`allocations[ordinal]` = attribute index), with the
/// handle of the attribute each points to.
pub fn block_allocations(block: &Value) -> Vec<Allocation> {
    let cidr = block["cidr"].as_str().expect("block cidr");
    let base: IpAddr = cidr
        .split('/')
        .next()
        .unwrap()
        .parse()
        .expect("block address");
    let attrs = block["attributes"].as_array().cloned().unwrap_or_default();
    let allocations = block["allocations"].as_array().cloned().unwrap_or_default();
    allocations
        .iter()
        .enumerate()
        .filter_map(|(ordinal, a)| {
            let idx = a.as_u64()? as usize;
            let handle = attrs
                .get(idx)
                .and_then(|at| at["handle_id"].as_str())
                .unwrap_or_default()
                .to_string();
            Some(Allocation {
                ip: nth_address(base, ordinal as u128),
                handle,
            })
        })
        .collect()
}

/// `base + n`.
pub fn nth_address(base: IpAddr, n: u128) -> IpAddr {
    match base {
        IpAddr::V4(a) => IpAddr::V4((u32::from(a) + n as u32).into()),
        IpAddr::V6(a) => IpAddr::V6((u128::from(a) + n).into()),
    }
}

/// Host-netns dataplane left by a pod: a cali veth or a route into the test pools.
fn assert_host_dataplane_clean(c: &impl Cluster) {
    let links = c.host_sh("ip -o link show");
    assert!(
        !links.contains("cali"),
        "{}: veth left: {links}",
        c.backend()
    );
    let routes = c.host_sh("ip route show; ip -6 route show");
    for net in ["10.65.", "10.66.", "10.244.", "fd80:", "fd00:244:"] {
        assert!(
            !routes.contains(net),
            "{}: route left: {routes}",
            c.backend()
        );
    }
}

// ------------------------------------------------------------------------------ etcd

impl Cluster for World {
    fn backend(&self) -> &'static str {
        "etcd"
    }
    fn network(&self) -> &'static str {
        "net1"
    }
    fn conf(&self, extra: Value) -> String {
        World::conf(self, extra)
    }
    fn unreachable_conf(&self) -> String {
        World::conf(self, json!({"etcd_endpoints": "http://127.0.0.1:1"}))
    }
    fn calico(&self, inv: &Invocation, conf: &str) -> Outcome {
        World::calico(self, inv, conf)
    }
    fn ipam(&self, inv: &Invocation, conf: &str) -> Outcome {
        World::ipam(self, inv, conf)
    }
    fn host_name(&self) -> &str {
        self.host.name()
    }
    fn scratch(&self) -> &std::path::Path {
        self.scratch.path()
    }
    fn cni_path(&self) -> String {
        self.bin.path()
    }
    fn host_sh(&self, cmd: &str) -> String {
        World::host_sh(self, cmd)
    }
    fn seed_pool(&self, name: &str, spec: Value) {
        self.seed_pool_spec(name, spec);
    }
    fn remove_pool(&self, name: &str) {
        self.etcd.etcdctl(&[
            "del",
            &format!("/calico/resources/v3/projectcalico.org/ippools/{name}"),
        ]);
    }
    fn prepare_pod(&self, _ns: &str, _name: &str) {}
    fn set_ready(&self, ready: bool) {
        self.seed_cluster_information(ready);
    }
    fn node_api(&self) -> (Value, Option<KubeApi>) {
        let api = KubeApi::start_in_netns(self.host.path());
        api.put(
            &format!("/api/v1/nodes/{}", super::world::NODE),
            json!({"apiVersion":"v1","kind":"Node","metadata":{"name":super::world::NODE},
                "spec":{"podCIDR":NODE_POD_CIDR_V4,"podCIDRs":[NODE_POD_CIDR_V4,NODE_POD_CIDR_V6]}}),
        );
        let extra = json!({"kubernetes":{"kubeconfig": api.kubeconfig().display().to_string()}});
        (extra, Some(api))
    }
    fn blocks(&self) -> Vec<Value> {
        self.etcd
            .get_prefix("/calico/ipam/v2/assignment/")
            .into_iter()
            .map(|(k, v)| serde_json::from_str(&v).unwrap_or_else(|e| panic!("{k}: {e}")))
            .collect()
    }
    fn handles(&self) -> Vec<String> {
        let mut h: Vec<String> = self
            .keys("/calico/ipam/v2/handle/")
            .iter()
            .map(|k| k.trim_start_matches("/calico/ipam/v2/handle/").to_string())
            .collect();
        h.sort();
        h
    }
    fn affinities(&self) -> Vec<(String, String)> {
        let mut a: Vec<(String, String)> = self
            .keys("/calico/ipam/v2/host/")
            .iter()
            .map(|k| affinity_of_key(k))
            .collect();
        a.sort();
        a
    }
    fn endpoint_ips(&self, ns: &str, pod: &str) -> Option<Vec<String>> {
        let ips = wep_of(self, ns, pod)?["spec"]["ipNetworks"]
            .as_array()?
            .clone();
        Some(
            ips.iter()
                .map(|v| v.as_str().unwrap().to_string())
                .collect(),
        )
    }
    fn endpoint_container_id(&self, ns: &str, pod: &str) -> Option<String> {
        Some(
            wep_of(self, ns, pod)?["spec"]["containerID"]
                .as_str()?
                .to_string(),
        )
    }
    fn assert_clean(&self) {
        World::assert_clean(self);
        assert_host_dataplane_clean(self);
    }
    fn remove_endpoint(&self, ns: &str, pod: &str) {
        for (key, v) in self.etcd.get_prefix(&format!("{WEP_PREFIX}{ns}/")) {
            let wep: Value = serde_json::from_str(&v).unwrap();
            if wep["spec"]["pod"] == pod {
                self.etcd.etcdctl(&["del", &key]);
            }
        }
    }
    fn seed_other_node(&self, name: &str) {
        self.seed_node(name);
    }
    fn remove_handle(&self, id: &str) {
        self.etcd
            .etcdctl(&["del", &format!("/calico/ipam/v2/handle/{id}")]);
    }
    fn seed_allocation(&self, handle: &str, attribute: Value) {
        let (key, raw) = self
            .etcd
            .get_prefix("/calico/ipam/v2/assignment/")
            .into_iter()
            .next()
            .expect("a block");
        let mut block: Value = serde_json::from_str(&raw).unwrap();
        let cidr = allocate_first_free(&mut block, attribute);
        self.etcd.put(&key, &block.to_string());
        self.etcd.put(
            &format!("/calico/ipam/v2/handle/{handle}"),
            &json!({"block": {cidr: 1}, "deleted": false}).to_string(),
        );
    }
}

/// Gives the first free ordinal of a stored block to a new allocation attribute; returns
/// the block's CIDR.
fn allocate_first_free(block: &mut Value, attribute: Value) -> String {
    let ordinal = block["unallocated"]
        .as_array_mut()
        .expect("unallocated")
        .remove(0)
        .as_u64()
        .unwrap() as usize;
    let attrs = block["attributes"].as_array_mut().expect("attributes");
    attrs.push(attribute);
    let index = attrs.len() - 1;
    block["allocations"][ordinal] = json!(index);
    block["cidr"].as_str().unwrap().to_string()
}

/// (node, block CIDR) of an etcd affinity key, `/calico/ipam/v2/host/<node>/ipv4/block/<a.b.c.d-26>`.
pub fn affinity_of_key(key: &str) -> (String, String) {
    let parts: Vec<&str> = key.split('/').collect();
    let (addr, len) = parts[8].rsplit_once('-').expect("cidr in key");
    (parts[5].to_string(), format!("{addr}/{len}"))
}

/// The one WorkloadEndpoint of pod `ns/pod`, if any.
fn wep_of(w: &World, ns: &str, pod: &str) -> Option<Value> {
    let mut weps: Vec<Value> = w
        .etcd
        .get_prefix(&format!("{WEP_PREFIX}{ns}/"))
        .into_iter()
        .map(|(_, v)| serde_json::from_str(&v).unwrap())
        .filter(|w: &Value| w["spec"]["pod"] == pod)
        .collect();
    assert!(
        weps.len() <= 1,
        "several endpoints for {ns}/{pod}: {weps:?}"
    );
    weps.pop()
}

// ------------------------------------------------------------------------ Kubernetes

impl<A: KubeStore> Cluster for KddWorld<A> {
    fn backend(&self) -> &'static str {
        "kdd"
    }
    fn network(&self) -> &'static str {
        "k8s-pod-network"
    }
    fn conf(&self, extra: Value) -> String {
        KddWorld::conf(self, extra)
    }
    fn unreachable_conf(&self) -> String {
        // The same kubeconfig, pointing at a port nothing listens on.
        let text = std::fs::read_to_string(self.api.kubeconfig()).expect("kubeconfig");
        let text = text.replace(&self.api.url(), "https://127.0.0.1:1");
        let path = self.scratch.path().join("kubeconfig-unreachable");
        std::fs::write(&path, text).unwrap();
        KddWorld::conf(
            self,
            json!({"kubernetes":{"kubeconfig": path.display().to_string()}}),
        )
    }
    fn calico(&self, inv: &Invocation, conf: &str) -> Outcome {
        KddWorld::calico(self, inv, conf)
    }
    fn ipam(&self, inv: &Invocation, conf: &str) -> Outcome {
        KddWorld::ipam(self, inv, conf)
    }
    fn host_name(&self) -> &str {
        self.host.name()
    }
    fn scratch(&self) -> &std::path::Path {
        self.scratch.path()
    }
    fn cni_path(&self) -> String {
        self.bin.path()
    }
    fn host_sh(&self, cmd: &str) -> String {
        KddWorld::host_sh(self, cmd)
    }
    fn seed_pool(&self, name: &str, spec: Value) {
        KddWorld::seed_pool(self, name, spec);
    }
    fn remove_pool(&self, name: &str) {
        self.api.remove(&format!("{CRD}/ippools/{name}"));
    }
    fn prepare_pod(&self, ns: &str, name: &str) {
        if self.api.get(&format!("/api/v1/namespaces/{ns}")).is_none() {
            self.seed_namespace(ns, json!({}), json!({}));
        }
        self.seed_pod(ns, name, json!({}));
    }
    fn set_ready(&self, ready: bool) {
        self.api.put(
            &format!("{CRD}/clusterinformations/default"),
            json!({"apiVersion":"crd.projectcalico.org/v1","kind":"ClusterInformation",
                "metadata":{"name":"default"},
                "spec":{"clusterGUID":"abc","clusterType":"k8s,kdd","calicoVersion":"v3.32.1","datastoreReady":ready}}),
        );
    }
    fn node_api(&self) -> (Value, Option<KubeApi>) {
        (json!({}), None)
    }
    fn blocks(&self) -> Vec<Value> {
        self.crs("ipamblocks")
            .into_iter()
            .map(|b| b["spec"].clone())
            .collect()
    }
    fn handles(&self) -> Vec<String> {
        let mut h: Vec<String> = self
            .crs("ipamhandles")
            .iter()
            .map(|h| h["spec"]["handleID"].as_str().unwrap().to_string())
            .collect();
        h.sort();
        h
    }
    fn affinities(&self) -> Vec<(String, String)> {
        let mut a: Vec<(String, String)> = self
            .crs("blockaffinities")
            .iter()
            .map(|a| {
                (
                    a["spec"]["node"].as_str().unwrap().to_string(),
                    a["spec"]["cidr"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        a.sort();
        a
    }
    fn endpoint_ips(&self, ns: &str, pod: &str) -> Option<Vec<String>> {
        let p = self
            .api
            .get(&format!("/api/v1/namespaces/{ns}/pods/{pod}"))?;
        let ips = p["metadata"]["annotations"]["cni.projectcalico.org/podIPs"].as_str()?;
        (!ips.is_empty()).then(|| ips.split(',').map(str::to_string).collect())
    }
    fn endpoint_container_id(&self, ns: &str, pod: &str) -> Option<String> {
        let p = self
            .api
            .get(&format!("/api/v1/namespaces/{ns}/pods/{pod}"))?;
        let id = &p["metadata"]["annotations"]["cni.projectcalico.org/containerID"];
        Some(id.as_str()?.to_string())
    }
    fn assert_clean(&self) {
        KddWorld::assert_clean(self);
        for p in self.api.list("/api/v1/pods") {
            let ip = &p["metadata"]["annotations"]["cni.projectcalico.org/podIP"];
            assert!(ip.is_null() || ip == "", "pod still has an address: {p}");
        }
        assert_host_dataplane_clean(self);
    }
    fn remove_endpoint(&self, ns: &str, pod: &str) {
        self.api
            .remove(&format!("/api/v1/namespaces/{ns}/pods/{pod}"));
    }
    fn seed_other_node(&self, name: &str) {
        self.api.put(
            &format!("/api/v1/nodes/{name}"),
            json!({"apiVersion":"v1","kind":"Node","metadata":{"name": name}}),
        );
    }
    fn remove_handle(&self, id: &str) {
        self.api
            .remove(&format!("{CRD}/ipamhandles/{}", id.to_lowercase()));
    }
    fn seed_allocation(&self, handle: &str, attribute: Value) {
        let mut cr = self.crs("ipamblocks").into_iter().next().expect("a block");
        let cidr = allocate_first_free(&mut cr["spec"], attribute);
        let name = cr["metadata"]["name"].as_str().unwrap().to_string();
        self.api.put(&format!("{CRD}/ipamblocks/{name}"), cr);
        self.api.put(
            &format!("{CRD}/ipamhandles/{}", handle.to_lowercase()),
            json!({"apiVersion":"crd.projectcalico.org/v1","kind":"IPAMHandle",
                "metadata":{"name": handle.to_lowercase()},
                "spec":{"handleID": handle, "block": {cidr: 1}, "deleted": false}}),
        );
    }
}
