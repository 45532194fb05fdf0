#![allow(dead_code)]
//! One end-to-end scenario on the Kubernetes datastore: a test "host" netns with an API
//! server listening on its loopback (so the plugin, run inside the host netns as kubelet
//! would run it, reaches it at 127.0.0.1), seeded as a cluster with Calico installed would
//! be (ClusterInformation ready, the core Node, an IPPool, namespace `default`), and a
//! kubeconfig for the plugin.
//!
//! The API server is either the real kube-apiserver ([`RealKddWorld`], Calico's CRDs and the
//! plugin's upstream RBAC, see real_k8s.rs) or the fault-injecting test server
//! ([`KddWorld::new`], kube_api/), kept for what a real server cannot be made to show.

use std::path::PathBuf;

use serde_json::{json, Value};

use super::cni::{report_skip, Bin, Invocation, Outcome, TempDir};
use super::kube_api::KubeApi;
use super::netns::HostNetns;
use super::real_k8s::RealK8s;
use super::world::{merge, netconf};
pub use super::world::{NODE, POOL_CIDR};

pub const CRD: &str = "/apis/crd.projectcalico.org/v1";

/// What a scenario needs of an API server: an admin's read/write access and the plugin's
/// kubeconfig.
pub trait KubeStore {
    /// Creates or replaces the object at `path`; the stored object.
    fn put(&self, path: &str, obj: Value) -> Value;
    fn get(&self, path: &str) -> Option<Value>;
    /// The objects of a collection, each with kind and apiVersion.
    fn list(&self, collection: &str) -> Vec<Value>;
    /// Deletes the object at `path` (a pod at once); a missing one is fine.
    fn remove(&self, path: &str);
    /// The plugin's kubeconfig.
    fn kubeconfig(&self) -> PathBuf;
    fn url(&self) -> String;
    /// Panics if the server refused (RBAC) or rejected anything the plugin sent (a real
    /// server only; the test server enforces no RBAC).
    fn assert_plugin_conformant(&self) {}
}

impl KubeStore for KubeApi {
    fn put(&self, path: &str, obj: Value) -> Value {
        KubeApi::put(self, path, obj)
    }
    fn get(&self, path: &str) -> Option<Value> {
        KubeApi::get(self, path)
    }
    fn list(&self, collection: &str) -> Vec<Value> {
        KubeApi::list(self, collection)
    }
    fn remove(&self, path: &str) {
        KubeApi::remove(self, path)
    }
    fn kubeconfig(&self) -> PathBuf {
        KubeApi::kubeconfig(self)
    }
    fn url(&self) -> String {
        KubeApi::url(self)
    }
}

impl KubeStore for RealK8s {
    fn put(&self, path: &str, obj: Value) -> Value {
        RealK8s::put(self, path, obj)
    }
    fn get(&self, path: &str) -> Option<Value> {
        RealK8s::get(self, path)
    }
    fn list(&self, collection: &str) -> Vec<Value> {
        RealK8s::list(self, collection)
    }
    fn remove(&self, path: &str) {
        RealK8s::remove(self, path)
    }
    fn kubeconfig(&self) -> PathBuf {
        RealK8s::kubeconfig(self)
    }
    fn url(&self) -> String {
        RealK8s::url(self)
    }
    fn assert_plugin_conformant(&self) {
        RealK8s::assert_plugin_conformant(self)
    }
}

/// Field order = drop order: the API server stops before its netns goes.
pub struct KddWorld<A: KubeStore = KubeApi> {
    pub api: A,
    pub host: HostNetns,
    pub bin: Bin,
    pub scratch: TempDir,
}

/// A [`KddWorld`] on the real kube-apiserver.
pub type RealKddWorld = KddWorld<RealK8s>;

impl KddWorld<KubeApi> {
    /// On the fault-injecting test API server.
    pub fn new() -> KddWorld<KubeApi> {
        let host = HostNetns::new();
        let api = KubeApi::start_in_netns(host.path());
        KddWorld::seeded(api, host)
    }

    /// On the test API server listening on every address of the host netns (its uplink's
    /// 198.18.0.1 too, which is not loopback).
    pub fn on_every_address() -> KddWorld<KubeApi> {
        let host = HostNetns::new();
        let api = KubeApi::start_in_netns_on(host.path(), "0.0.0.0");
        KddWorld::seeded(api, host)
    }
}

impl KddWorld<RealK8s> {
    /// On the real kube-apiserver; panics if it cannot run here.
    pub fn real() -> RealKddWorld {
        let host = HostNetns::new();
        let api = RealK8s::start(&host);
        KddWorld::seeded(api, host)
    }

    /// On the real kube-apiserver, or `None` (the test printed `SKIPPED <why>` and should
    /// return) when the kube-apiserver bundle is not there.
    pub fn real_or_skip(test: &str) -> Option<RealKddWorld> {
        match RealK8s::available() {
            Ok(()) => Some(KddWorld::real()),
            Err(why) => {
                report_skip(test, &why);
                None
            }
        }
    }
}

impl<A: KubeStore> KddWorld<A> {
    fn seeded(api: A, host: HostNetns) -> KddWorld<A> {
        let w = KddWorld {
            api,
            host,
            bin: Bin::new(),
            scratch: TempDir::new("kdd-scratch"),
        };
        w.api.put(
            &format!("{CRD}/clusterinformations/default"),
            json!({"apiVersion":"crd.projectcalico.org/v1","kind":"ClusterInformation",
                "metadata":{"name":"default"},
                "spec":{"clusterGUID":"abc","clusterType":"k8s,kdd","calicoVersion":"v3.32.1","datastoreReady":true}}),
        );
        w.api.put(
            &format!("/api/v1/nodes/{NODE}"),
            json!({"apiVersion":"v1","kind":"Node","metadata":{"name":NODE,"labels":{"kubernetes.io/hostname":NODE}},
                "spec":{"podCIDR":"10.244.1.0/24","podCIDRs":["10.244.1.0/24","fd00:244:1::/64"]}}),
        );
        w.seed_pool("default-ipv4-ippool", json!({"cidr":POOL_CIDR,"ipipMode":"Never","vxlanMode":"Never","natOutgoing":true,"blockSize":26,"nodeSelector":"all()"}));
        w.seed_namespace("default", json!({}), json!({}));
        w
    }

    pub fn seed_pool(&self, name: &str, spec: Value) {
        self.api.put(
            &format!("{CRD}/ippools/{name}"),
            json!({"apiVersion":"crd.projectcalico.org/v1","kind":"IPPool","metadata":{"name":name},"spec":spec}),
        );
    }

    pub fn seed_namespace(&self, name: &str, labels: Value, annotations: Value) {
        self.api.put(
            &format!("/api/v1/namespaces/{name}"),
            json!({"apiVersion":"v1","kind":"Namespace","metadata":{"name":name,"labels":labels,"annotations":annotations}}),
        );
    }

    /// A pod scheduled on this node; `extra` is merged into its metadata/spec.
    pub fn seed_pod(&self, ns: &str, name: &str, extra: Value) -> Value {
        let mut pod = json!({"apiVersion":"v1","kind":"Pod",
            "metadata":{"name":name,"namespace":ns,"labels":{"app":name}},
            "spec":{"nodeName":NODE,"serviceAccountName":"default","containers":[{"name":"c","image":"busybox",
                "ports":[{"name":"http","containerPort":8080,"protocol":"TCP"}]}]},
            "status":{"phase":"Pending"}});
        merge(&mut pod, extra);
        self.api
            .put(&format!("/api/v1/namespaces/{ns}/pods/{name}"), pod)
    }

    pub fn pod_object(&self, ns: &str, name: &str) -> Value {
        self.api
            .get(&format!("/api/v1/namespaces/{ns}/pods/{name}"))
            .expect("pod exists")
    }

    /// The NetConf for the Kubernetes datastore with policy type k8s, `extra` merged in.
    pub fn conf(&self, extra: Value) -> String {
        netconf(
            "k8s-pod-network",
            self.scratch.path(),
            json!({
                "datastore_type": "kubernetes",
                "policy": {"type": "k8s"},
                "kubernetes": {"kubeconfig": self.api.kubeconfig().display().to_string()},
            }),
            extra,
        )
    }

    pub fn calico(&self, inv: &Invocation, conf: &str) -> Outcome {
        self.bin.run("calico", self.host.name(), inv, conf)
    }

    pub fn ipam(&self, inv: &Invocation, conf: &str) -> Outcome {
        self.bin.run("calico-ipam", self.host.name(), inv, conf)
    }

    pub fn host_sh(&self, cmd: &str) -> String {
        let out = self.host.exec("sh", &["-c", cmd]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn crs(&self, plural: &str) -> Vec<Value> {
        self.api.list(&format!("{CRD}/{plural}"))
    }

    /// Nothing of any pod is left: no handle, no allocation, no pod address annotation, no
    /// cali veth or pool route in the host netns; and (on a real server) nothing the plugin
    /// sent was refused or rejected.
    pub fn assert_clean(&self) {
        self.api.assert_plugin_conformant();
        let handles = self.crs("ipamhandles");
        assert!(handles.is_empty(), "handles left: {handles:?}");
        for b in self.crs("ipamblocks") {
            assert!(
                b["spec"]["allocations"]
                    .as_array()
                    .is_some_and(|a| a.iter().all(Value::is_null)),
                "allocations left: {b}"
            );
        }
        for p in self.api.list("/api/v1/namespaces/default/pods") {
            let ip = &p["metadata"]["annotations"]["cni.projectcalico.org/podIP"];
            assert!(ip.is_null() || ip == "", "pod still has an address: {p}");
        }
        let links = self.host_sh("ip -o link show");
        assert!(!links.contains("cali"), "veth left: {links}");
        let routes = self.host_sh("ip route show");
        assert!(!routes.contains("10.65."), "route left: {routes}");
    }
}
