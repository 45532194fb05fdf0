//! One case of the differential suite: the world it starts from (what is seeded in the
//! datastore, the API server and the node's files) and the calls it makes, in order. A case
//! is plain data: the corpus generates it, its JSON is hashed into the recording, and the
//! world and the runner only read it.

use serde::Serialize;
use serde_json::Value;

/// Where Calico's objects live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Store {
    /// etcd v3 (`etcd_endpoints`); pods, namespaces and Nodes, when a case has them, are
    /// still on the API server (the plugin reads them with `policy.type: k8s`).
    Etcd,
    /// The Kubernetes datastore, on the real kube-apiserver.
    Kdd,
}

impl Store {
    pub fn name(self) -> &'static str {
        match self {
            Store::Etcd => "etcd",
            Store::Kdd => "kdd",
        }
    }
}

/// An IPPool to seed.
#[derive(Clone, Debug, Serialize)]
pub struct Pool {
    pub name: String,
    pub cidr: String,
    pub block_size: u8,
    pub disabled: bool,
    /// `nodeSelector`; `all()` unless set.
    pub node_selector: String,
}

impl Pool {
    pub fn new(name: &str, cidr: &str, block_size: u8) -> Pool {
        Pool {
            name: name.into(),
            cidr: cidr.into(),
            block_size,
            disabled: false,
            node_selector: "all()".into(),
        }
    }
}

/// A pod on the API server (always on node `node1`).
#[derive(Clone, Debug, Serialize)]
pub struct PodSeed {
    pub namespace: String,
    pub name: String,
    pub labels: Value,
    pub annotations: Value,
    /// Merged into the pod object as it is created (ownerReferences, spec fields).
    pub extra: Value,
}

/// A namespace's labels and annotations (the namespace itself always exists, except one
/// named `missing-*`, which no case creates).
#[derive(Clone, Debug, Serialize)]
pub struct NamespaceSeed {
    pub name: String,
    pub labels: Value,
    pub annotations: Value,
}

/// What a case's world holds before its first call.
#[derive(Clone, Debug, Serialize)]
pub struct Seed {
    /// ClusterInformation `default`: `Some(ready)`, or `None` for none at all.
    pub cluster_ready: Option<bool>,
    /// Calico's Node `node1` (etcd) or the core Node (both datastores).
    pub node: bool,
    /// The Node's BGP address, as calico/node sets it (on the Kubernetes datastore, the core
    /// Node's `projectcalico.org/IPv4Address` annotation).
    pub node_bgp: bool,
    pub pools: Vec<Pool>,
    pub namespaces: Vec<NamespaceSeed>,
    pub pods: Vec<PodSeed>,
    /// `/var/lib/calico/nodename` holds `node1`.
    pub nodename_file: bool,
    /// `/var/lib/calico/mtu` holds this, when set.
    pub mtu_file: Option<String>,
    /// IPReservations: (name, reserved CIDRs).
    pub reservations: Vec<(String, Vec<String>)>,
    /// IPAMConfig `default` (etcd: `/calico/ipam/v2/config`), as its spec.
    pub ipam_config: Option<Value>,
    /// host-local's data for network `k8s-pod-network` (for `calico-ipam -upgrade`): files
    /// under `/var/lib/cni/networks/k8s-pod-network`, (name, content).
    pub host_local_files: Vec<(String, String)>,
    /// More objects on the API server, (path, object), created in order before the pods
    /// (KubeVirt's VMs and VMIs). A string `{uid:<path>}` in a later object or a pod is the
    /// UID the object created at `<path>` got.
    pub api_objects: Vec<(String, Value)>,
    /// A gRPC dataplane agent listens on `/var/run/calico/grpc.sock` (see world.rs).
    pub grpc_agent: bool,
}

impl Default for Seed {
    fn default() -> Seed {
        Seed {
            cluster_ready: Some(true),
            node: true,
            node_bgp: true,
            pools: vec![Pool::new("default-ipv4-ippool", "10.65.0.0/16", 26)],
            namespaces: vec![NamespaceSeed {
                name: "default".into(),
                labels: Value::Null,
                annotations: Value::Null,
            }],
            pods: vec![],
            nodename_file: true,
            mtu_file: None,
            reservations: vec![],
            ipam_config: None,
            host_local_files: vec![],
            api_objects: vec![],
            grpc_agent: false,
        }
    }
}

/// Who runs a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum By {
    /// The binary under test: ours in a replay, upstream's in a recording, each in turn in
    /// the live differential.
    Subject,
    /// Ours, whatever the subject (a mixed sequence).
    Ours,
    /// Upstream's, whatever the subject (a mixed sequence).
    Upstream,
}

/// Which pod network namespace a step passes as `CNI_NETNS`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum NetnsArg {
    /// The case's pod netns number `i` (made fresh for the case).
    Pod(usize),
    /// `CNI_NETNS` set to this (an empty string, or a path that does not exist).
    Literal(String),
}

/// One call.
#[derive(Clone, Debug, Serialize)]
pub struct Step {
    pub by: By,
    /// `calico` or `calico-ipam`.
    pub plugin: String,
    pub command: String,
    pub container_id: String,
    pub netns: NetnsArg,
    pub ifname: String,
    pub cni_args: String,
    /// The NetConf. Strings in it may hold placeholders the world fills in: `{etcd}` (the
    /// etcd endpoint) and `{kubeconfig}` (the plugin's kubeconfig).
    pub conf: Value,
    /// Sent instead of `conf` when set (malformed JSON).
    pub raw_stdin: Option<String>,
    /// Put the last successful ADD's result into the config as `prevResult`.
    pub prev_result: bool,
    /// Arguments (e.g. `-upgrade`); with arguments no CNI_* variables are set.
    pub argv: Vec<String>,
    /// More environment variables.
    pub env: Vec<(String, String)>,
}

/// A case: its id (`<store>/<family>/<what>`), the world, the calls.
#[derive(Clone, Debug, Serialize)]
pub struct Case {
    pub id: String,
    pub store: Store,
    pub seed: Seed,
    /// How many pod netns the case uses.
    pub pod_netns: usize,
    pub steps: Vec<Step>,
}

impl Case {
    /// Whether every step is the subject's (a case the recorded oracle holds).
    pub fn single_binary(&self) -> bool {
        self.steps.iter().all(|s| s.by == By::Subject)
    }

    /// A digest of the case's definition: a recording made from another definition is stale.
    pub fn digest(&self) -> String {
        use sha2::Digest;
        let json = serde_json::to_vec(self).unwrap_or_default();
        hex::encode(&sha2::Sha256::digest(&json)[..12])
    }
}
