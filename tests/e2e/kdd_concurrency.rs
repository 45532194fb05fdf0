//! IPAM under concurrency on the Kubernetes datastore: many real `calico-ipam` processes for
//! ten simulated nodes (core Nodes node0..node9, each its own IPAM lock file) allocating and
//! releasing in parallel against one real kube-apiserver (Calico's CRDs, the plugin's
//! upstream RBAC; common/real_k8s.rs), the way tests/e2e/ipam_concurrency.rs does against one
//! etcd. Conflicts are the API server's: resourceVersion preconditions on update,
//! AlreadyExists on create.
//!
//! FAKE SERVER: `kdd_api_server_errors_mid_run` alone runs on the test API server
//! (common/kube_api/), which can answer a run of requests with injected 500s and 429s; a
//! real server cannot be made to.
//!
//! Checked (tests/common/ipam_churn.rs, shared with ipam_concurrency.rs): every call succeeds
//! or fails only with a known, explained error; no address is handed out to two live
//! containers at once (results, tracked while the run goes) nor held twice in the IPAMBlock
//! CRs; the blocks' allocations and free lists partition their ordinals; handle CR counts
//! agree with the blocks; at most one confirmed BlockAffinity per block, agreeing with the
//! block; and after DEL of everything, no handle and no allocation. This file has the
//! Kubernetes fixture and the API server's request counts.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::common::cluster::Cluster;
use crate::common::cni::{Invocation, Outcome};
use crate::common::ipam_churn::{self, release_everything, verify, Affinity, IpamState, Nodes};
use crate::common::kdd::{KddWorld, KubeStore, RealKddWorld, CRD};
use crate::common::kube_api::KubeApi;
use crate::common::netns::require_root;
use crate::common::real_k8s::RealK8s;
use serde_json::{json, Value};

/// A KddWorld with `nodes` core Nodes, one pool (instead of the default one) and an optional
/// IPAMConfig.
struct Kdd<A: KubeStore> {
    w: KddWorld<A>,
}

/// What the API server saw of a run, by the server's own record.
trait Traffic {
    fn report(&self);
}

impl Traffic for KubeApi {
    /// Requests per method and status, connections.
    fn report(&self) {
        let reqs = self.requests();
        let mut by_method: BTreeMap<String, usize> = BTreeMap::new();
        let mut by_status: BTreeMap<u16, usize> = BTreeMap::new();
        for r in &reqs {
            *by_method.entry(r.method.clone()).or_insert(0) += 1;
            *by_status.entry(r.status).or_insert(0) += 1;
        }
        eprintln!(
            "API server: {} requests {by_method:?}, statuses {by_status:?}, {} connections",
            reqs.len(),
            self.handshakes()
        );
        self.clear_requests();
    }
}

impl Traffic for RealK8s {
    /// The plugin's requests per verb and status so far, from the audit log.
    fn report(&self) {
        let reqs = self.plugin_requests_now();
        let mut by_verb: BTreeMap<String, usize> = BTreeMap::new();
        let mut by_status: BTreeMap<u16, usize> = BTreeMap::new();
        for r in &reqs {
            *by_verb.entry(r.verb.clone()).or_insert(0) += 1;
            *by_status.entry(r.code).or_insert(0) += 1;
        }
        eprintln!(
            "kube-apiserver (audit, the plugin's user, since start): {} requests {by_verb:?}, \
             statuses {by_status:?}",
            reqs.len()
        );
    }
}

/// A real-server world, or return (after `SKIPPED <why>`).
macro_rules! real_kdd {
    ($test:literal, $($arg:expr),*) => {
        match RealKddWorld::real_or_skip($test) {
            Some(w) => Kdd::new(w, $($arg),*),
            None => return,
        }
    };
}

impl<A: KubeStore + Traffic> Kdd<A> {
    fn new(
        w: KddWorld<A>,
        nodes: usize,
        pool: &str,
        block_size: u8,
        ipam_config: Option<Value>,
    ) -> Kdd<A> {
        Cluster::remove_pool(&w, "default-ipv4-ippool");
        w.seed_pool(
            "pool",
            json!({"cidr":pool,"blockSize":block_size,"ipipMode":"Never","vxlanMode":"Never","nodeSelector":"all()"}),
        );
        for n in 0..nodes {
            let name = format!("node{n}");
            w.api.put(
                &format!("/api/v1/nodes/{name}"),
                json!({"apiVersion":"v1","kind":"Node","metadata":{"name":name,"labels":{"kubernetes.io/hostname":name}},"spec":{}}),
            );
        }
        if let Some(spec) = ipam_config {
            w.api.put(
                &format!("{CRD}/ipamconfigs/default"),
                json!({"apiVersion":"crd.projectcalico.org/v1","kind":"IPAMConfig","metadata":{"name":"default"},"spec":spec}),
            );
        }
        Kdd { w }
    }

    fn conf(&self, node: usize) -> String {
        let lock = self.w.scratch.path().join(format!("lock{node}"));
        self.w.conf(
            json!({"nodename": format!("node{node}"), "log_level": "warn",
            "ipam_lock_file": lock.display().to_string()}),
        )
    }

    /// The pod kubelet would have: scheduled on `node`, in `default`.
    fn seed_pod(&self, node: usize, name: &str) {
        self.w.seed_pod(
            "default",
            name,
            json!({"spec":{"nodeName": format!("node{node}")}}),
        );
    }
}

impl<A: KubeStore + Traffic + Sync> Nodes for Kdd<A> {
    fn network(&self) -> &str {
        Cluster::network(&self.w)
    }
    /// calico-ipam as `calico` calls it for pod `default/<cid>` on `node`; an ADD first
    /// makes the pod kubelet would have.
    fn ipam(&self, node: usize, cmd: &str, cid: &str) -> Outcome {
        if cmd == "ADD" {
            self.seed_pod(node, cid);
        }
        let inv = Invocation::new(cmd, cid, "/dev/null")
            .k8s("default", cid)
            .via_calico();
        self.w.ipam(&inv, &self.conf(node))
    }
    /// An error the test API server was told to inject (`KubeApi::fail_next`), or a real
    /// server's throttling.
    fn is_transient(&self, msg: &str) -> bool {
        msg.contains("injected by the test API server")
            || msg.contains("Too many requests")
            || msg.contains("the server is currently unable to handle the request")
    }
    /// What the API server saw.
    fn report(&self) {
        self.w.api.report();
    }
    fn assert_clean(&self) {
        self.w.assert_clean();
    }
    fn ipam_state(&self) -> IpamState {
        IpamState {
            blocks: Cluster::blocks(&self.w),
            handles: self
                .w
                .crs("ipamhandles")
                .into_iter()
                .map(|h| {
                    (
                        h["spec"]["handleID"].as_str().unwrap().to_string(),
                        h["spec"].clone(),
                    )
                })
                .collect(),
            affinities: self
                .w
                .crs("blockaffinities")
                .iter()
                .map(|a| {
                    let s = &a["spec"];
                    Affinity {
                        node: s["node"].as_str().unwrap().to_string(),
                        cidr: s["cidr"].as_str().unwrap().to_string(),
                        state: s["state"].as_str().unwrap_or_default().to_string(),
                        // A string in the v1 CRD.
                        deleted: s["deleted"] != "false",
                    }
                })
                .collect(),
        }
    }
}

#[test]
fn kdd_ten_nodes_fifty_pods_default_config() {
    require_root();
    let c = real_kdd!(
        "kdd_ten_nodes_fifty_pods_default_config",
        10,
        "10.70.0.0/16",
        26,
        None
    );
    ipam_churn::ten_nodes_fifty_pods_default_config(&c);
}

#[test]
fn kdd_ten_nodes_strict_affinity() {
    require_root();
    let config = json!({"strictAffinity": true, "autoAllocateBlocks": true});
    let c = real_kdd!(
        "kdd_ten_nodes_strict_affinity",
        10,
        "10.71.0.0/16",
        26,
        Some(config)
    );
    // 30 per node (20 live at most) is enough to interleave every node's claims.
    ipam_churn::ten_nodes_strict_affinity(&c, 30);
}

#[test]
fn kdd_ten_nodes_one_block_each() {
    require_root();
    let config =
        json!({"autoAllocateBlocks": true, "strictAffinity": false, "maxBlocksPerHost": 1});
    let c = real_kdd!(
        "kdd_ten_nodes_one_block_each",
        10,
        "10.72.0.0/16",
        27,
        Some(config)
    );
    ipam_churn::ten_nodes_one_block_each(&c);
}

#[test]
fn kdd_small_pool_runs_out_cleanly() {
    require_root();
    let c = real_kdd!(
        "kdd_small_pool_runs_out_cleanly",
        10,
        "10.73.0.0/25",
        28,
        None
    );
    ipam_churn::small_pool_runs_out_cleanly(&c);
}

#[test]
fn kdd_api_server_errors_mid_run() {
    // FAKE SERVER (injected 500s and 429s). Midway, the API server answers 30 requests with
    // 500s, then 20 with 429s: the calls that meet them fail with the server's message (and
    // are DELed, as kubelet does) or retry; nothing is leaked or handed out twice.
    require_root();
    let c = Kdd::new(KddWorld::new(), 10, "10.74.0.0/16", 26, None);
    let mut ledger = ipam_churn::churn(&c, 10, 30, |c| {
        c.w.api.fail_next(30, 500);
        std::thread::sleep(Duration::from_millis(500));
        c.w.api.fail_next(20, 429);
        eprintln!("injected 30 × 500 and 20 × 429");
    });
    assert!(ledger.exhausted.is_empty());
    assert_eq!(
        ledger.live.len() + ledger.deleted.len() + ledger.failed.len(),
        300
    );
    verify(&c, &ledger);
    release_everything(&c, &mut ledger);
}
