//! IPAM under concurrency on the Kubernetes datastore: many real `calico-ipam` processes for
//! ten simulated nodes (core Nodes node0..node9, each its own IPAM lock file) allocating and
//! releasing in parallel against one test API server, the way tests/ipam_concurrency.rs does
//! against one etcd. Conflicts are the API server's: resourceVersion preconditions on
//! update, AlreadyExists on create.
//!
//! Checked: every call succeeds or fails only with a known, explained error; no address is
//! handed out to two live containers at once (results, tracked while the run goes) nor held
//! twice in the IPAMBlock CRs; the blocks' allocations and free lists partition their
//! ordinals; handle CR counts agree with the blocks; at most one confirmed BlockAffinity per
//! block, agreeing with the block; and after DEL of everything, no handle and no allocation.

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::cluster::{block_allocations, Cluster};
use common::cni::{Invocation, Outcome};
use common::kdd::{KddWorld, CRD};
use common::netns::require_root;
use serde_json::{json, Value};

const NETWORK: &str = "k8s-pod-network";

/// A KddWorld with `nodes` core Nodes, one pool (instead of the default one) and an optional
/// IPAMConfig.
struct Kdd {
    w: KddWorld,
}

impl Kdd {
    fn new(nodes: usize, pool: &str, block_size: u8, ipam_config: Option<Value>) -> Kdd {
        require_root();
        let w = KddWorld::new();
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

    /// calico-ipam as `calico` calls it for pod `default/<cid>` on `node`.
    fn ipam(&self, node: usize, cmd: &str, cid: &str) -> Outcome {
        let inv = Invocation::new(cmd, cid, "/dev/null")
            .k8s("default", cid)
            .via_calico();
        self.w.ipam(&inv, &self.conf(node))
    }

    /// DEL, retried with a pause (as kubelet retries a DEL) while it fails on an error the
    /// test API server injected; any other failure is returned at once.
    fn del(&self, node: usize, cid: &str) -> Outcome {
        let mut out = self.ipam(node, "DEL", cid);
        for _ in 0..10 {
            if out.code == 0 || !is_injected(&out.stdout) {
                break;
            }
            let msg = out.stdout.split_whitespace().collect::<Vec<_>>().join(" ");
            eprintln!("DEL {cid} failed, retrying: {msg}");
            std::thread::sleep(Duration::from_millis(300));
            out = self.ipam(node, "DEL", cid);
        }
        out
    }
}

/// What the run left and how long its calls took.
#[derive(Default)]
struct Ledger {
    /// Live container → its address.
    live: BTreeMap<String, String>,
    /// Addresses currently handed out (by results), to their container.
    held: HashMap<String, String>,
    deleted: BTreeSet<String>,
    /// ADDs refused because the pool ran out / the host's block limit was hit.
    exhausted: Vec<String>,
    /// ADDs that failed on an API server error (injected), DELed afterwards.
    api_failures: Vec<String>,
    /// (command, duration) of every call.
    calls: Vec<(&'static str, Duration)>,
}

impl Ledger {
    fn report(&self, label: &str, wall: Duration) {
        let mut ds: Vec<Duration> = self.calls.iter().map(|(_, d)| *d).collect();
        ds.sort();
        let n = ds.len().max(1);
        let mean = ds.iter().sum::<Duration>() / n as u32;
        let p = |q: f64| {
            ds.get(((n - 1) as f64 * q) as usize)
                .copied()
                .unwrap_or_default()
        };
        let adds = self.calls.iter().filter(|(c, _)| *c == "ADD").count();
        eprintln!(
            "{label}: {} calls ({adds} ADD, {} DEL) in {wall:?} ({:.1} calls/s); per call mean {mean:?}, p50 {:?}, p95 {:?}, max {:?}; {} live, {} deleted, {} refused (exhausted), {} failed on the API server",
            ds.len(),
            ds.len() - adds,
            ds.len() as f64 / wall.as_secs_f64(),
            p(0.5),
            p(0.95),
            p(1.0),
            self.live.len(),
            self.deleted.len(),
            self.exhausted.len(),
            self.api_failures.len(),
        );
    }
}

/// An ADD error we can explain: the pool or the host's block limit is used up.
fn is_exhaustion(msg: &str) -> bool {
    msg.contains("Assigned 0 out of 1 requested IPv4 addresses")
        || msg.contains("per host block limit")
}

/// An error the test API server was told to inject (`KubeApi::fail_next`).
fn is_injected(msg: &str) -> bool {
    msg.contains("injected by the test API server")
        || msg.contains("Too many requests")
        || msg.contains("the server is currently unable to handle the request")
}

/// `nodes` parallel workers, each ADDing `pods` containers and DELing every third one;
/// `midway` runs on its own thread 1.5 s into the run.
fn churn(c: &Kdd, nodes: usize, pods: usize, midway: impl FnOnce(&Kdd) + Send) -> Ledger {
    let ledger = Mutex::new(Ledger::default());
    let wall = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(1500));
            midway(c);
        });
        for n in 0..nodes {
            let ledger = &ledger;
            s.spawn(move || {
                let mut mine: Vec<String> = Vec::new();
                for p in 0..pods {
                    let cid = format!("n{n}-p{p}");
                    c.seed_pod(n, &cid);
                    let out = c.ipam(n, "ADD", &cid);
                    ledger.lock().unwrap().calls.push(("ADD", out.elapsed));
                    if out.code == 0 {
                        let ip = out.json()["ips"][0]["address"]
                            .as_str()
                            .unwrap()
                            .to_string();
                        let mut l = ledger.lock().unwrap();
                        if let Some(other) = l.held.insert(ip.clone(), cid.clone()) {
                            panic!("{ip} handed to {cid} while {other} still holds it");
                        }
                        l.live.insert(cid.clone(), ip);
                        mine.push(cid);
                    } else {
                        let e = out.json();
                        let msg = e["msg"].as_str().unwrap_or_default().to_string();
                        if is_injected(&msg) {
                            // A failed ADD is followed by a DEL, as kubelet does.
                            let del = c.del(n, &cid);
                            assert_eq!(del.code, 0, "DEL after failed ADD {cid}: {}", del.stdout);
                            ledger.lock().unwrap().api_failures.push(cid.clone());
                        } else {
                            assert!(is_exhaustion(&msg), "unexpected ADD failure of {cid}: {e}");
                            ledger.lock().unwrap().exhausted.push(cid.clone());
                        }
                    }
                    if p % 3 == 2 && !mine.is_empty() {
                        let victim = mine.remove(p % mine.len());
                        // No longer handed out from the moment its release may begin.
                        {
                            let mut l = ledger.lock().unwrap();
                            let ip = l.live.remove(&victim).unwrap();
                            l.held.remove(&ip);
                        }
                        let del = c.del(n, &victim);
                        assert_eq!(
                            del.code, 0,
                            "DEL {victim} failed: {} {}",
                            del.stdout, del.stderr
                        );
                        let mut l = ledger.lock().unwrap();
                        l.calls.push(("DEL", del.elapsed));
                        l.deleted.insert(victim);
                    }
                }
            });
        }
    });
    let l = ledger.into_inner().unwrap();
    l.report("churn", wall.elapsed());
    api_report(c);
    l
}

/// What the API server saw: requests per method, conflicts, connections.
fn api_report(c: &Kdd) {
    let reqs = c.w.api.requests();
    let mut by_method: BTreeMap<String, usize> = BTreeMap::new();
    let mut by_status: BTreeMap<u16, usize> = BTreeMap::new();
    for r in &reqs {
        *by_method.entry(r.method.clone()).or_insert(0) += 1;
        *by_status.entry(r.status).or_insert(0) += 1;
    }
    eprintln!(
        "API server: {} requests {by_method:?}, statuses {by_status:?}, {} connections",
        reqs.len(),
        c.w.api.handshakes()
    );
    c.w.api.clear_requests();
}

/// DELs every live container, each node's in parallel; then nothing may be left.
fn release_everything(c: &Kdd, ledger: &mut Ledger) {
    let wall = Instant::now();
    let live = std::mem::take(&mut ledger.live);
    let calls = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        let mut per_node: BTreeMap<usize, Vec<String>> = BTreeMap::new();
        for cid in live.keys() {
            let n: usize = cid[1..cid.find('-').unwrap()].parse().unwrap();
            per_node.entry(n).or_default().push(cid.clone());
        }
        for (n, cids) in per_node {
            let calls = &calls;
            s.spawn(move || {
                for cid in cids {
                    let del = c.del(n, &cid);
                    assert_eq!(del.code, 0, "DEL {cid}: {} {}", del.stdout, del.stderr);
                    calls.lock().unwrap().push(("DEL", del.elapsed));
                }
            });
        }
    });
    ledger.deleted.extend(live.into_keys());
    ledger.held.clear();
    let teardown = Ledger {
        calls: calls.into_inner().unwrap(),
        ..Default::default()
    };
    teardown.report("release everything", wall.elapsed());
    verify(c, ledger);
    let handles = c.w.crs("ipamhandles");
    assert!(handles.is_empty(), "handles left: {handles:?}");
    assert!(Cluster::allocated(&c.w).is_empty());
    c.w.assert_clean();
}

/// The invariants every run must keep, read from the CRs.
fn verify(c: &Kdd, ledger: &Ledger) {
    let blocks = Cluster::blocks(&c.w);
    let handles: HashMap<String, Value> =
        c.w.crs("ipamhandles")
            .into_iter()
            .map(|h| {
                assert_eq!(h["spec"]["deleted"], false, "{h}");
                (
                    h["spec"]["handleID"].as_str().unwrap().to_string(),
                    h["spec"].clone(),
                )
            })
            .collect();
    let mut owner_of_ip: HashMap<String, String> = HashMap::new();
    let mut per_handle_block: HashMap<(String, String), i64> = HashMap::new();
    for b in &blocks {
        let cidr = b["cidr"].as_str().unwrap().to_string();
        let allocs = b["allocations"].as_array().unwrap();
        let free: Vec<u64> = b["unallocated"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        // allocations + free list partition the ordinals.
        let mut seen = BTreeSet::new();
        for o in &free {
            assert!(
                allocs[*o as usize].is_null(),
                "{cidr}: ordinal {o} free and allocated"
            );
            assert!(
                seen.insert(*o),
                "{cidr}: ordinal {o} twice in the free list"
            );
        }
        for (o, a) in allocs.iter().enumerate() {
            assert!(
                a.is_u64() || seen.contains(&(o as u64)),
                "{cidr}: ordinal {o} neither free nor allocated"
            );
        }
        // Every attribute is referenced (compaction).
        let used: BTreeSet<u64> = allocs.iter().filter_map(Value::as_u64).collect();
        let attrs = b["attributes"].as_array().map_or(0, Vec::len);
        assert_eq!(used.len(), attrs, "{cidr}: unreferenced attributes");
        for a in block_allocations(b) {
            let ip = a.ip.to_string();
            assert!(
                owner_of_ip.insert(ip.clone(), a.handle.clone()).is_none(),
                "{ip} allocated twice"
            );
            *per_handle_block
                .entry((a.handle, cidr.clone()))
                .or_insert(0) += 1;
        }
    }
    // Live handles hold exactly their address; released handles are gone.
    for (cid, ip) in &ledger.live {
        let h = format!("{NETWORK}.{cid}");
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
    for cid in ledger
        .deleted
        .iter()
        .chain(&ledger.exhausted)
        .chain(&ledger.api_failures)
    {
        let h = format!("{NETWORK}.{cid}");
        assert!(
            !handles.contains_key(&h),
            "released handle {h} still present"
        );
        assert!(
            !owner_of_ip.values().any(|o| o == &h),
            "{h} still owns an address"
        );
    }
    // Handle counts agree with the blocks, both ways.
    for (h, v) in &handles {
        for (cidr, n) in v["block"].as_object().unwrap() {
            let held = per_handle_block.get(&(h.clone(), cidr.clone())).copied();
            assert_eq!(
                held.unwrap_or(0),
                n.as_i64().unwrap(),
                "handle {h} count for {cidr}"
            );
        }
    }
    for ((h, cidr), n) in &per_handle_block {
        let counted = handles.get(h).and_then(|v| v["block"][cidr].as_i64());
        assert_eq!(
            counted,
            Some(*n),
            "{cidr} holds {n} for {h}, the handle says {counted:?}"
        );
    }
    assert_eq!(
        owner_of_ip.len(),
        ledger.live.len(),
        "allocations without a live container"
    );
    // At most one confirmed affinity per block, and the block names the same node.
    let mut confirmed: HashMap<String, Vec<String>> = HashMap::new();
    for a in c.w.crs("blockaffinities") {
        let s = &a["spec"];
        assert_eq!(s["deleted"], "false", "{a}");
        if s["state"] == "confirmed" {
            confirmed
                .entry(s["cidr"].as_str().unwrap().to_string())
                .or_default()
                .push(s["node"].as_str().unwrap().to_string());
        }
    }
    for (cidr, hosts) in &confirmed {
        assert_eq!(
            hosts.len(),
            1,
            "block {cidr} has several affinities: {hosts:?}"
        );
        if let Some(b) = blocks.iter().find(|b| b["cidr"] == cidr.as_str()) {
            assert_eq!(b["affinity"], format!("host:{}", hosts[0]), "block {cidr}");
        }
    }
    for b in &blocks {
        if let Some(host) = b["affinity"].as_str().and_then(|a| a.strip_prefix("host:")) {
            assert_eq!(
                confirmed.get(b["cidr"].as_str().unwrap()),
                Some(&vec![host.to_string()]),
                "block {} is affine to {host} without a confirmed BlockAffinity",
                b["cidr"]
            );
        }
    }
}

#[test]
fn kdd_ten_nodes_fifty_pods_default_config() {
    let c = Kdd::new(10, "10.70.0.0/16", 26, None);
    let mut ledger = churn(&c, 10, 50, |_| {});
    assert!(ledger.exhausted.is_empty() && ledger.api_failures.is_empty());
    assert_eq!(ledger.live.len() + ledger.deleted.len(), 500);
    verify(&c, &ledger);
    release_everything(&c, &mut ledger);
}

#[test]
fn kdd_ten_nodes_strict_affinity() {
    let c = Kdd::new(
        10,
        "10.71.0.0/16",
        26,
        Some(json!({"strictAffinity": true, "autoAllocateBlocks": true})),
    );
    // 30 per node (20 live at most) is enough to interleave every node's claims.
    let mut ledger = churn(&c, 10, 30, |_| {});
    assert!(ledger.exhausted.is_empty() && ledger.api_failures.is_empty());
    verify(&c, &ledger);
    // With strict affinity every address comes from the node's own block.
    for b in Cluster::blocks(&c.w) {
        let aff = b["affinity"].as_str().unwrap_or_default().to_string();
        for a in b["attributes"].as_array().cloned().unwrap_or_default() {
            let node = a["secondary"]["node"].as_str().unwrap();
            assert_eq!(format!("host:{node}"), aff, "{}", b["cidr"]);
        }
    }
    release_everything(&c, &mut ledger);
}

#[test]
fn kdd_ten_nodes_one_block_each() {
    // /27 blocks (32 addresses) and maxBlocksPerHost 1: each node's 50 ADDs (34 live at most)
    // overflow its block; the rest borrow from other nodes' blocks or hit the limit.
    let c = Kdd::new(
        10,
        "10.72.0.0/16",
        27,
        Some(json!({"autoAllocateBlocks": true, "strictAffinity": false, "maxBlocksPerHost": 1})),
    );
    let mut ledger = churn(&c, 10, 50, |_| {});
    assert!(ledger.api_failures.is_empty());
    verify(&c, &ledger);
    let mut per_host: HashMap<String, usize> = HashMap::new();
    for a in c.w.crs("blockaffinities") {
        *per_host
            .entry(a["spec"]["node"].as_str().unwrap().to_string())
            .or_insert(0) += 1;
    }
    assert!(per_host.values().all(|n| *n <= 1), "{per_host:?}");
    release_everything(&c, &mut ledger);
}

#[test]
fn kdd_small_pool_runs_out_cleanly() {
    // 8 blocks of 16: 128 addresses for 10 × 30 ADDs (about 200 live at the peak).
    let c = Kdd::new(10, "10.73.0.0/25", 28, None);
    let mut ledger = churn(&c, 10, 30, |_| {});
    assert!(!ledger.exhausted.is_empty(), "the pool should have run out");
    assert!(ledger.api_failures.is_empty());
    assert!(ledger.live.len() <= 128);
    verify(&c, &ledger);
    release_everything(&c, &mut ledger);
}

#[test]
fn kdd_api_server_errors_mid_run() {
    // Midway, the API server answers 30 requests with 500s, then 20 with 429s: the calls
    // that meet them fail with the server's message (and are DELed, as kubelet does) or
    // retry; nothing is leaked or handed out twice.
    let c = Kdd::new(10, "10.74.0.0/16", 26, None);
    let mut ledger = churn(&c, 10, 30, |c| {
        c.w.api.fail_next(30, 500);
        std::thread::sleep(Duration::from_millis(500));
        c.w.api.fail_next(20, 429);
        eprintln!("injected 30 × 500 and 20 × 429");
    });
    assert!(ledger.exhausted.is_empty());
    assert_eq!(
        ledger.live.len() + ledger.deleted.len() + ledger.api_failures.len(),
        300
    );
    verify(&c, &ledger);
    release_everything(&c, &mut ledger);
}
