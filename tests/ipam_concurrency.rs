//! IPAM under concurrency, with the real `calico-ipam` binary against one real etcd: many
//! simulated nodes (distinct node names, each its own Node object and IPAM lock file)
//! allocating and releasing in parallel processes. Afterwards the datastore must be
//! consistent: no address twice, every live handle holding exactly its addresses, every
//! released handle gone, every block's allocations + free list a partition of its ordinals,
//! and no block with more than one confirmed affinity.

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Mutex;

use common::cni::{run_plugin, Bin, Invocation, TempDir};
use common::etcd::{key_value_lines, EtcdCluster, EtcdServer};
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
        json!({
            "cniVersion": "1.0.0", "name": "net1", "type": "calico",
            "etcd_endpoints": self.endpoints, "nodename": format!("node{node}"),
            "log_level": "warn",
            "log_file_path": self.scratch.path().join("cni.log").display().to_string(),
            "ipam_lock_file": self.scratch.path().join(format!("lock{node}")).display().to_string(),
            "ipam": {"type": "calico-ipam"},
        })
        .to_string()
    }

    fn ipam(&self, node: usize, cmd: &str, cid: &str) -> common::cni::Outcome {
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
}

/// What the run left: live container → its address, and every DELeted container.
#[derive(Default)]
struct Ledger {
    live: BTreeMap<String, String>,
    deleted: BTreeSet<String>,
    exhausted: Vec<String>,
}

/// `nodes` parallel workers, each ADDing `pods` containers and DELing every third one.
fn churn(c: &Cluster, nodes: usize, pods: usize) -> Ledger {
    churn_with(c, nodes, pods, |_| {})
}

/// `churn`, calling `midway` (on its own thread) once the run is under way.
fn churn_with(
    c: &Cluster,
    nodes: usize,
    pods: usize,
    midway: impl FnOnce(&Cluster) + Send,
) -> Ledger {
    let ledger = Mutex::new(Ledger::default());
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(std::time::Duration::from_millis(1500));
            midway(c);
        });
        for n in 0..nodes {
            let ledger = &ledger;
            s.spawn(move || {
                let mut mine: Vec<String> = Vec::new();
                for p in 0..pods {
                    let cid = format!("n{n}-p{p}");
                    let out = c.ipam(n, "ADD", &cid);
                    if out.code == 0 {
                        let ip = out.json()["ips"][0]["address"]
                            .as_str()
                            .unwrap()
                            .to_string();
                        ledger.lock().unwrap().live.insert(cid.clone(), ip);
                        mine.push(cid);
                    } else {
                        let e = out.json();
                        let msg = e["msg"].as_str().unwrap_or_default().to_string();
                        if msg.contains("error connecting to the datastore") {
                            // A failed ADD is followed by a DEL, as kubelet does.
                            eprintln!("ADD {cid} failed on the datastore; cleaning up: {msg}");
                            c.ipam(n, "DEL", &cid).assert_ok();
                        } else {
                            assert!(
                                msg.contains("Assigned 0 out of 1 requested IPv4 addresses")
                                    || msg.contains("per host block limit"),
                                "unexpected ADD failure: {e}"
                            );
                        }
                        ledger.lock().unwrap().exhausted.push(cid.clone());
                    }
                    if p % 3 == 2 && !mine.is_empty() {
                        let victim = mine.remove(p % mine.len());
                        // Like kubelet, retry a DEL that failed on an unreachable datastore.
                        let mut del = c.ipam(n, "DEL", &victim);
                        for _ in 0..3 {
                            if del.code == 0
                                || !del.stdout.contains("error connecting to the datastore")
                            {
                                break;
                            }
                            del = c.ipam(n, "DEL", &victim);
                        }
                        assert_eq!(
                            del.code, 0,
                            "DEL {victim} failed: {} {}",
                            del.stdout, del.stderr
                        );
                        let mut l = ledger.lock().unwrap();
                        l.live.remove(&victim);
                        l.deleted.insert(victim);
                    }
                }
            });
        }
    });
    let l = ledger.into_inner().unwrap();
    eprintln!(
        "churn: {} live, {} deleted, {} refused (pool exhausted / block limit)",
        l.live.len(),
        l.deleted.len(),
        l.exhausted.len()
    );
    l
}

fn parse_all(c: &Cluster, prefix: &str) -> Vec<(String, Value)> {
    c.etcd
        .get_prefix(prefix)
        .into_iter()
        .map(|(k, v)| (k, serde_json::from_str(&v).unwrap()))
        .collect()
}

/// The invariants every run must keep.
fn verify(c: &Cluster, ledger: &Ledger) {
    let blocks = parse_all(c, "/calico/ipam/v2/assignment/");
    let handles: HashMap<String, Value> = parse_all(c, "/calico/ipam/v2/handle/")
        .into_iter()
        .map(|(k, v)| {
            (
                k.trim_start_matches("/calico/ipam/v2/handle/").to_string(),
                v,
            )
        })
        .collect();
    let mut owner_of_ip: HashMap<String, String> = HashMap::new();
    let mut per_handle_block: HashMap<(String, String), i64> = HashMap::new();
    for (key, b) in &blocks {
        let cidr = b["cidr"].as_str().unwrap();
        let net: std::net::Ipv4Addr = cidr.split('/').next().unwrap().parse().unwrap();
        let allocs = b["allocations"].as_array().unwrap();
        let free: Vec<u64> = b["unallocated"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        let attrs = b["attributes"].as_array().cloned().unwrap_or_default();
        // allocations + free list partition the ordinals.
        let mut seen = BTreeSet::new();
        for o in &free {
            assert!(
                allocs[*o as usize].is_null(),
                "{key}: ordinal {o} free and allocated"
            );
            assert!(seen.insert(*o), "{key}: ordinal {o} twice in the free list");
        }
        for (o, a) in allocs.iter().enumerate() {
            let Some(idx) = a.as_u64() else {
                assert!(
                    seen.contains(&(o as u64)),
                    "{key}: ordinal {o} neither free nor allocated"
                );
                continue;
            };
            let attr = attrs
                .get(idx as usize)
                .unwrap_or_else(|| panic!("{key}: bad attribute index"));
            let handle = attr["handle_id"].as_str().unwrap().to_string();
            let ip = std::net::Ipv4Addr::from(u32::from(net) + o as u32).to_string();
            assert!(
                owner_of_ip.insert(ip.clone(), handle.clone()).is_none(),
                "{ip} allocated twice"
            );
            *per_handle_block
                .entry((handle, cidr.to_string()))
                .or_insert(0) += 1;
        }
        // Every attribute is referenced (compaction).
        let used: BTreeSet<u64> = allocs.iter().filter_map(Value::as_u64).collect();
        assert_eq!(used.len(), attrs.len(), "{key}: unreferenced attributes");
    }
    // Live handles hold exactly their address; deleted handles are gone.
    for (cid, ip) in &ledger.live {
        let h = format!("net1.{cid}");
        let addr = ip.split('/').next().unwrap();
        assert_eq!(owner_of_ip.get(addr), Some(&h), "{cid} does not own {addr}");
        let handle = handles
            .get(&h)
            .unwrap_or_else(|| panic!("handle {h} missing"));
        let total: i64 = handle["block"]
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_i64().unwrap())
            .sum();
        assert_eq!(total, 1, "{h}: {handle}");
    }
    for cid in ledger.deleted.iter().chain(&ledger.exhausted) {
        let h = format!("net1.{cid}");
        assert!(
            !handles.contains_key(&h),
            "released handle {h} still present"
        );
        assert!(
            !owner_of_ip.values().any(|o| o == &h),
            "{h} still owns an address"
        );
    }
    // Handle counts agree with the blocks.
    for (h, v) in &handles {
        for (cidr, n) in v["block"].as_object().unwrap() {
            assert_eq!(
                per_handle_block
                    .get(&(h.clone(), cidr.clone()))
                    .copied()
                    .unwrap_or(0),
                n.as_i64().unwrap(),
                "handle {h} count for {cidr}"
            );
        }
    }
    assert_eq!(
        owner_of_ip.len(),
        ledger.live.len(),
        "allocations without a live container"
    );
    // At most one confirmed affinity per block, and it matches the block's own.
    let mut confirmed: HashMap<String, Vec<String>> = HashMap::new();
    for (key, a) in parse_all(c, "/calico/ipam/v2/host/") {
        if a["state"] == "confirmed" {
            let parts: Vec<&str> = key.split('/').collect();
            let (host, cidr) = (parts[5], parts[8].replacen('-', "/", 1));
            let cidr = cidr
                .rsplit_once('-')
                .map(|(a, b)| format!("{a}/{b}"))
                .unwrap_or(cidr);
            confirmed.entry(cidr).or_default().push(host.to_string());
        }
    }
    for (cidr, hosts) in &confirmed {
        assert_eq!(
            hosts.len(),
            1,
            "block {cidr} has several affinities: {hosts:?}"
        );
        let b = blocks.iter().find(|(_, b)| b["cidr"] == cidr.as_str());
        if let Some((_, b)) = b {
            assert_eq!(b["affinity"], format!("host:{}", hosts[0]), "block {cidr}");
        }
    }
}

#[test]
fn ten_nodes_fifty_pods_default_config() {
    let c = Cluster::new(10, "10.70.0.0/16", 26, None);
    let ledger = churn(&c, 10, 50);
    assert!(ledger.exhausted.is_empty());
    assert_eq!(ledger.live.len() + ledger.deleted.len(), 500);
    verify(&c, &ledger);
}

#[test]
fn ten_nodes_strict_affinity() {
    let c = Cluster::new(
        10,
        "10.71.0.0/16",
        26,
        Some(json!({"strict_affinity": true, "auto_allocate_blocks": true})),
    );
    let ledger = churn(&c, 10, 50);
    assert!(ledger.exhausted.is_empty());
    verify(&c, &ledger);
    // With strict affinity every address comes from the node's own block.
    for (key, b) in parse_all(&c, "/calico/ipam/v2/assignment/") {
        let aff = b["affinity"].as_str().unwrap_or_default().to_string();
        for a in b["attributes"].as_array().cloned().unwrap_or_default() {
            assert_eq!(
                format!("host:{}", a["secondary"]["node"].as_str().unwrap()),
                aff,
                "{key}"
            );
        }
    }
}

#[test]
fn ten_nodes_one_block_each() {
    // /27 blocks (32 addresses) and maxBlocksPerHost 1: each node's 50 ADDs (34 live at most)
    // overflow its block; the rest borrow from other nodes' blocks or hit the limit.
    let c = Cluster::new(
        10,
        "10.72.0.0/16",
        27,
        Some(json!({"auto_allocate_blocks": true, "maxBlocksPerHost": 1})),
    );
    let ledger = churn(&c, 10, 50);
    verify(&c, &ledger);
    let affs = parse_all(&c, "/calico/ipam/v2/host/");
    let mut per_host: HashMap<String, usize> = HashMap::new();
    for (k, _) in &affs {
        *per_host
            .entry(k.split('/').nth(5).unwrap().to_string())
            .or_insert(0) += 1;
    }
    assert!(per_host.values().all(|n| *n <= 1), "{per_host:?}");
}

#[test]
fn small_pool_runs_out_cleanly() {
    // 8 blocks of 16: 128 addresses for 10 × 30 ADDs (about 200 live at the peak).
    let c = Cluster::new(10, "10.73.0.0/25", 28, None);
    let ledger = churn(&c, 10, 30);
    assert!(!ledger.exhausted.is_empty(), "the pool should have run out");
    assert!(ledger.live.len() <= 128);
    verify(&c, &ledger);
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
    let ledger = churn_with(&c, 6, 40, |c| {
        if let Store::Multi(m, _) = &c.etcd {
            m.lock().unwrap().kill(2);
            eprintln!("killed etcd member m2");
        }
    });
    assert!(
        ledger.exhausted.is_empty(),
        "allocations failed after the member loss"
    );
    assert_eq!(ledger.live.len() + ledger.deleted.len(), 240);
    verify(&c, &ledger);
}
