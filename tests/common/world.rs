#![allow(dead_code)]
//! One end-to-end scenario's world: a test "host" netns, a real etcd inside it seeded as
//! calico/node would leave it (ClusterInformation ready, this Node, an IPPool), a CNI_PATH
//! with our binary, and helpers to run `calico`/`calico-ipam` as kubelet would.

use std::path::Path;

use serde_json::{json, Value};

use super::cni::{Bin, Invocation, Outcome, TempDir};
use super::etcd::EtcdServer;
use super::netns::{HostNetns, Netns};

pub const NODE: &str = "node1";
pub const WEP_PREFIX: &str = "/calico/resources/v3/projectcalico.org/workloadendpoints/";
pub const POOL_CIDR: &str = "10.65.0.0/16";

pub struct World {
    pub etcd: EtcdServer,
    pub host: HostNetns,
    pub bin: Bin,
    pub scratch: TempDir,
}

impl World {
    /// Host netns + etcd + seeded ClusterInformation, Node `node1` and pool 10.65.0.0/16.
    pub fn new() -> World {
        let w = World::bare();
        w.seed_cluster_information(true);
        w.seed_node(NODE);
        w.seed_pool("default-ipv4-ippool", POOL_CIDR, 26);
        w
    }

    /// Host netns + etcd, nothing seeded.
    pub fn bare() -> World {
        let host = HostNetns::new();
        let etcd = EtcdServer::start_in_netns(Some(host.name()));
        World {
            etcd,
            host,
            bin: Bin::new(),
            scratch: TempDir::new("cni-scratch"),
        }
    }

    pub fn seed_cluster_information(&self, ready: bool) {
        self.etcd.put(
            "/calico/resources/v3/projectcalico.org/clusterinformations/default",
            &json!({"kind":"ClusterInformation","apiVersion":"projectcalico.org/v3",
                "metadata":{"name":"default","uid":"6a1c1e4e-1111-4222-8333-444455556666","creationTimestamp":"2026-01-01T00:00:00Z"},
                "spec":{"clusterGUID":"abc","clusterType":"k8s,bgp","calicoVersion":"v3.32.0","datastoreReady":ready}})
            .to_string(),
        );
    }

    pub fn seed_node(&self, name: &str) {
        self.etcd.put(
            &format!("/calico/resources/v3/projectcalico.org/nodes/{name}"),
            &json!({"kind":"Node","apiVersion":"projectcalico.org/v3",
                "metadata":{"name":name,"uid":"7b2c2e4e-1111-4222-8333-444455556666","creationTimestamp":"2026-01-01T00:00:00Z",
                    "labels":{"kubernetes.io/hostname":name}},
                "spec":{"bgp":{"ipv4Address":"192.0.2.10/24"}}})
            .to_string(),
        );
    }

    pub fn seed_pool(&self, name: &str, cidr: &str, block_size: u8) {
        self.seed_pool_spec(name, json!({"cidr":cidr,"ipipMode":"Never","vxlanMode":"Never","natOutgoing":true,"blockSize":block_size,"nodeSelector":"all()"}));
    }

    pub fn seed_pool_spec(&self, name: &str, spec: Value) {
        self.etcd.put(
            &format!("/calico/resources/v3/projectcalico.org/ippools/{name}"),
            &json!({"kind":"IPPool","apiVersion":"projectcalico.org/v3",
                "metadata":{"name":name,"uid":"8c3d2e4e-1111-4222-8333-444455556666","creationTimestamp":"2026-01-01T00:00:00Z"},
                "spec":spec})
            .to_string(),
        );
    }

    /// The base NetConf for this world, with `extra` merged in at the top level (and into
    /// `ipam` when `extra.ipam` is an object).
    /// Unless `extra` says how to reach an API server (`kubernetes`, `policy.k8s_api_root`),
    /// the NetConf names [`NO_API_SERVER`].
    pub fn conf(&self, extra: Value) -> String {
        let mut datastore = json!({"etcd_endpoints": self.etcd.endpoint()});
        if extra.get("kubernetes").is_none() && extra["policy"].get("k8s_api_root").is_none() {
            datastore["kubernetes"] = json!({"k8s_api_root": NO_API_SERVER});
        }
        netconf("net1", self.scratch.path(), datastore, extra)
    }

    pub fn calico(&self, inv: &Invocation, conf: &str) -> Outcome {
        self.bin.run("calico", self.host.name(), inv, conf)
    }

    pub fn ipam(&self, inv: &Invocation, conf: &str) -> Outcome {
        self.bin.run("calico-ipam", self.host.name(), inv, conf)
    }

    /// A fresh pod network namespace.
    pub fn pod(&self) -> Netns {
        Netns::new("pod")
    }

    /// Runs a command in the host netns, returning stdout.
    pub fn host_sh(&self, cmd: &str) -> String {
        let out = self.host.exec("sh", &["-c", cmd]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Nothing of any pod is left: no WEP, no handle, no allocation, no cali veth or route
    /// into the pool in the host netns.
    pub fn assert_clean(&self) {
        let weps = self.keys(WEP_PREFIX);
        assert!(weps.is_empty(), "WEPs left: {weps:?}");
        let handles = self.keys("/calico/ipam/v2/handle/");
        assert!(handles.is_empty(), "handles left: {handles:?}");
        for k in self.keys("/calico/ipam/v2/assignment/") {
            let b = self.get(&k);
            assert!(
                b["allocations"]
                    .as_array()
                    .is_some_and(|a| a.iter().all(Value::is_null)),
                "allocations left in {k}: {b}"
            );
        }
        let links = self.host_sh("ip -o link show");
        assert!(!links.contains("cali"), "veth left: {links}");
        let routes = self.host_sh("ip route show; ip -6 route show");
        assert!(
            !routes.contains("10.65.") && !routes.contains("fd80:"),
            "route left: {routes}"
        );
    }

    pub fn keys(&self, prefix: &str) -> Vec<String> {
        self.etcd.keys(prefix)
    }

    pub fn get(&self, key: &str) -> Value {
        self.etcd.get_json(key)
    }
}

/// A NetConf for network `name` on node `node1` with calico-ipam, logging and the IPAM lock
/// in `scratch`, then the `datastore` fields and last `extra` merged in (see [`merge`]).
pub fn netconf(name: &str, scratch: &Path, datastore: Value, extra: Value) -> String {
    let mut base = json!({
        "cniVersion": "1.0.0",
        "name": name,
        "type": "calico",
        "nodename": NODE,
        "nodename_file_optional": true,
        "log_level": "debug",
        "log_file_path": scratch.join("cni.log").display().to_string(),
        "ipam_lock_file": scratch.join("ipam.lock").display().to_string(),
        "ipam": {"type": "calico-ipam"},
    });
    merge(&mut base, datastore);
    merge(&mut base, extra);
    base.to_string()
}

/// The API root of the etcd worlds' NetConf (`kubernetes.k8s_api_root`), where nothing
/// listens: a pod's ADD makes its API client even without policy type k8s, as upstream's does
/// (k8s.go NewK8sClient), and fails without one; with an API root but no kubeconfig and no
/// policy type k8s neither plugin reads anything through it. A test that reads pods gives
/// its own kubeconfig.
pub const NO_API_SERVER: &str = "https://127.0.0.1:1";

/// Merges `extra` into `base`: objects recursively, `null` removes a key.
pub fn merge(base: &mut Value, extra: Value) {
    if let (Value::Object(b), Value::Object(e)) = (base, extra) {
        for (k, v) in e {
            match (b.get_mut(&k), v) {
                (Some(bv @ Value::Object(_)), v @ Value::Object(_)) => merge(bv, v),
                (_, Value::Null) => {
                    b.remove(&k);
                }
                (_, v) => {
                    b.insert(k, v);
                }
            }
        }
    }
}

/// Reads a sysctl inside a netns.
pub fn sysctl(ns: &str, path: &str) -> String {
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", ns, "cat", path])
        .output()
        .expect("cat sysctl");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}
