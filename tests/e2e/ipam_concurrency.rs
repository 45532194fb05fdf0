//! IPAM under concurrency, with the real `calico-ipam` binary against one real etcd (or a
//! three-member cluster that loses a member): many simulated nodes (distinct node names,
//! each its own Node object and IPAM lock file) allocating and releasing in parallel
//! processes. The churn, the invariants checked afterwards and the final DEL of everything
//! are tests/common/ipam_churn.rs, shared with kdd_concurrency.rs; this file has the etcd
//! fixture.

use std::sync::Mutex;

use crate::common::cluster::affinity_of_key;
use crate::common::cni::{run_plugin, Bin, Invocation, Outcome, TempDir};
use crate::common::etcd::{key_value_lines, EtcdCluster, EtcdServer};
use crate::common::ipam_churn::{self, release_everything, verify, Affinity, IpamState, Nodes};
use crate::common::world::netconf;
use serde_json::{json, Value};

/// One etcd, or a multi-member cluster read through a member that is still alive.
enum Store {
    Single(EtcdServer),
    Multi(Mutex<EtcdCluster>, usize),
}

impl Store {
    fn put(&self, key: &str, value: &str) {
        match self {
            Store::Single(e) => e.put(key, value),
            Store::Multi(c, reader) => {
                c.lock().unwrap().ctl(*reader, &["put", key, value]);
            }
        }
    }

    fn get_prefix(&self, prefix: &str) -> Vec<(String, String)> {
        match self {
            Store::Single(e) => e.get_prefix(prefix),
            Store::Multi(c, reader) => {
                key_value_lines(&c.lock().unwrap().ctl(*reader, &["get", "--prefix", prefix]))
            }
        }
    }

    fn endpoints(&self) -> String {
        match self {
            Store::Single(e) => e.endpoint(),
            Store::Multi(c, _) => c.lock().unwrap().endpoints_csv(),
        }
    }
}

struct Cluster {
    etcd: Store,
    endpoints: String,
    bin: Bin,
    scratch: TempDir,
}

impl Cluster {
    fn new(nodes: usize, pool: &str, block_size: u8, ipam_config: Option<Value>) -> Cluster {
        Cluster::with_store(
            Store::Single(EtcdServer::start()),
            nodes,
            pool,
            block_size,
            ipam_config,
        )
    }

    fn with_store(
        etcd: Store,
        nodes: usize,
        pool: &str,
        block_size: u8,
        ipam_config: Option<Value>,
    ) -> Cluster {
        etcd.put(
            "/calico/resources/v3/projectcalico.org/clusterinformations/default",
            r#"{"kind":"ClusterInformation","apiVersion":"projectcalico.org/v3","metadata":{"name":"default"},"spec":{"datastoreReady":true}}"#,
        );
        for n in 0..nodes {
            etcd.put(
                &format!("/calico/resources/v3/projectcalico.org/nodes/node{n}"),
                &json!({"kind":"Node","apiVersion":"projectcalico.org/v3","metadata":{"name":format!("node{n}")},"spec":{}}).to_string(),
            );
        }
        etcd.put(
            "/calico/resources/v3/projectcalico.org/ippools/pool",
            &json!({"kind":"IPPool","apiVersion":"projectcalico.org/v3","metadata":{"name":"pool"},"spec":{"cidr":pool,"blockSize":block_size}}).to_string(),
        );
        if let Some(c) = ipam_config {
            etcd.put("/calico/ipam/v2/config", &c.to_string());
        }
        Cluster {
            endpoints: etcd.endpoints(),
            etcd,
            bin: Bin::new(),
            scratch: TempDir::new("ipam-conc"),
        }
    }

    fn conf(&self, node: usize) -> String {
        let lock = self.scratch.path().join(format!("lock{node}"));
        netconf(
            "net1",
            self.scratch.path(),
            json!({"etcd_endpoints": self.endpoints}),
            json!({"nodename": format!("node{node}"), "log_level": "warn",
                "ipam_lock_file": lock.display().to_string()}),
        )
    }
}

impl Nodes for Cluster {
    fn network(&self) -> &str {
        "net1"
    }
    fn ipam(&self, node: usize, cmd: &str, cid: &str) -> Outcome {
        let inv = Invocation::new(cmd, cid, "/dev/null")
            .k8s("default", cid)
            .via_calico();
        run_plugin(
            &self.bin.plugin("calico-ipam"),
            &self.bin.path(),
            None,
            &inv,
            &self.conf(node),
        )
    }
    fn is_transient(&self, msg: &str) -> bool {
        // Only provoked by killing a member of a multi-member cluster.
        msg.contains("error connecting to the datastore")
    }
    fn ipam_state(&self) -> IpamState {
        let parse = |prefix: &str| -> Vec<(String, Value)> {
            self.etcd
                .get_prefix(prefix)
                .into_iter()
                .map(|(k, v)| (k, serde_json::from_str(&v).unwrap()))
                .collect()
        };
        IpamState {
            blocks: parse("/calico/ipam/v2/assignment/")
                .into_iter()
                .map(|(_, b)| b)
                .collect(),
            handles: parse("/calico/ipam/v2/handle/")
                .into_iter()
                .map(|(k, h)| (k["/calico/ipam/v2/handle/".len()..].to_string(), h))
                .collect(),
            affinities: parse("/calico/ipam/v2/host/")
                .into_iter()
                .map(|(k, a)| {
                    let (node, cidr) = affinity_of_key(&k);
                    Affinity {
                        node,
                        cidr,
                        state: a["state"].as_str().unwrap_or_default().to_string(),
                        deleted: a["deleted"] == true,
                    }
                })
                .collect(),
        }
    }
}

#[test]
fn ten_nodes_fifty_pods_default_config() {
    let c = Cluster::new(10, "10.70.0.0/16", 26, None);
    ipam_churn::ten_nodes_fifty_pods_default_config(&c);
}

#[test]
fn ten_nodes_strict_affinity() {
    let config = json!({"strict_affinity": true, "auto_allocate_blocks": true});
    let c = Cluster::new(10, "10.71.0.0/16", 26, Some(config));
    ipam_churn::ten_nodes_strict_affinity(&c, 50);
}

#[test]
fn ten_nodes_one_block_each() {
    let config = json!({"auto_allocate_blocks": true, "maxBlocksPerHost": 1});
    let c = Cluster::new(10, "10.72.0.0/16", 27, Some(config));
    ipam_churn::ten_nodes_one_block_each(&c);
}

#[test]
fn small_pool_runs_out_cleanly() {
    let c = Cluster::new(10, "10.73.0.0/25", 28, None);
    ipam_churn::small_pool_runs_out_cleanly(&c);
}

#[test]
fn three_member_etcd_loses_a_member_mid_run() {
    let cluster = EtcdCluster::start(3);
    let c = Cluster::with_store(
        Store::Multi(Mutex::new(cluster), 0),
        6,
        "10.74.0.0/16",
        26,
        None,
    );
    let mut ledger = ipam_churn::churn(&c, 6, 40, |c| {
        if let Store::Multi(m, _) = &c.etcd {
            m.lock().unwrap().kill(2);
            eprintln!("killed etcd member m2");
        }
    });
    assert!(
        ledger.exhausted.is_empty() && ledger.failed.is_empty(),
        "allocations failed after the member loss"
    );
    assert_eq!(ledger.live.len() + ledger.deleted.len(), 240);
    verify(&c, &ledger);
    release_everything(&c, &mut ledger);
}
