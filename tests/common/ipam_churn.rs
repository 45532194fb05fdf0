#![allow(dead_code)]
//! IPAM under concurrency, on whichever datastore: one worker per simulated node running real
//! `calico-ipam` processes, ADDing and DELing in parallel ([`churn`]); a [`Ledger`] of what
//! the results handed out; the invariants the stored IPAM state must keep afterwards
//! ([`verify`]); DEL of everything ([`release_everything`]); and the scenarios run on both
//! datastores. The datastores' fixtures (and the scenarios only one of them has) are in
//! ipam_concurrency.rs (etcd) and kdd_concurrency.rs (the Kubernetes datastore).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::cluster::block_allocations;
use super::cni::Outcome;

/// Nodes 0..n of one cluster, as the churn drives them.
pub trait Nodes: Sync {
    /// The network name: handle IDs are `<network>.<container ID>`.
    fn network(&self) -> &str;
    /// calico-ipam as `calico` calls it for container `cid` (pod `default/<cid>`) on `node`,
    /// with whatever the datastore needs to exist first.
    fn ipam(&self, node: usize, cmd: &str, cid: &str) -> Outcome;
    /// A failure the test provokes on purpose (a datastore member killed, an error the test
    /// API server injects): the call may fail with it, and is retried or undone as kubelet
    /// would.
    fn is_transient(&self, msg: &str) -> bool;
    /// The IPAM objects stored now.
    fn ipam_state(&self) -> IpamState;
    /// Prints what the datastore saw during a churn (default: nothing).
    fn report(&self) {}
    /// Asserts that whatever else a pod leaves is gone once everything is released
    /// (default: nothing beyond IPAM).
    fn assert_clean(&self) {}
}

/// The stored IPAM objects, in the form both datastores share.
pub struct IpamState {
    /// Every block (`cidr`, `affinity`, `allocations`, `unallocated`, `attributes`, ...).
    pub blocks: Vec<Value>,
    /// Handle ID → the handle (`block`: CIDR → count, `deleted`).
    pub handles: HashMap<String, Value>,
    pub affinities: Vec<Affinity>,
}

/// A block affinity.
#[derive(Debug)]
pub struct Affinity {
    pub node: String,
    pub cidr: String,
    pub state: String,
    pub deleted: bool,
}

/// What a run's results handed out, and how long its calls took.
#[derive(Default)]
pub struct Ledger {
    /// Live container → its address.
    pub live: BTreeMap<String, String>,
    /// Addresses currently handed out (by results), to their container.
    pub held: HashMap<String, String>,
    pub deleted: BTreeSet<String>,
    /// ADDs refused because the pool ran out / the host's block limit was hit.
    pub exhausted: Vec<String>,
    /// ADDs that failed on a provoked error ([`Nodes::is_transient`]), DELed afterwards.
    pub failed: Vec<String>,
    /// (command, duration) of every call.
    pub calls: Vec<(&'static str, Duration)>,
}

impl Ledger {
    pub fn report(&self, label: &str, wall: Duration) {
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
            "{label}: {} calls ({adds} ADD, {} DEL) in {wall:?} ({:.1} calls/s); per call mean {mean:?}, p50 {:?}, p95 {:?}, max {:?}; {} live, {} deleted, {} refused (exhausted), {} failed on a provoked error",
            ds.len(),
            ds.len() - adds,
            ds.len() as f64 / wall.as_secs_f64(),
            p(0.5),
            p(0.95),
            p(1.0),
            self.live.len(),
            self.deleted.len(),
            self.exhausted.len(),
            self.failed.len(),
        );
    }
}

/// An ADD error we can explain: the pool or the host's block limit is used up.
pub fn is_exhaustion(msg: &str) -> bool {
    msg.contains("Assigned 0 out of 1 requested IPv4 addresses")
        || msg.contains("per host block limit")
}

/// DEL, retried with a pause (as kubelet retries a DEL) while it fails on a provoked error;
/// any other failure is returned at once.
pub fn del(c: &impl Nodes, node: usize, cid: &str) -> Outcome {
    let mut out = c.ipam(node, "DEL", cid);
    for _ in 0..10 {
        if out.code == 0 || !c.is_transient(&out.stdout) {
            break;
        }
        let msg = out.stdout.split_whitespace().collect::<Vec<_>>().join(" ");
        eprintln!("DEL {cid} failed, retrying: {msg}");
        std::thread::sleep(Duration::from_millis(300));
        out = c.ipam(node, "DEL", cid);
    }
    out
}

/// `nodes` parallel workers, each ADDing `pods` containers and DELing every third one;
/// `midway` runs on its own thread 1.5 s into the run. No address may be handed to a second
/// container while the first still holds it; an ADD may fail only for exhaustion or a
/// provoked error (then it is DELed, as kubelet does).
pub fn churn<C: Nodes>(c: &C, nodes: usize, pods: usize, midway: impl FnOnce(&C) + Send) -> Ledger {
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
                        if c.is_transient(&msg) {
                            eprintln!("ADD {cid} failed on a provoked error; DEL: {msg}");
                            let del = del(c, n, &cid);
                            assert_eq!(del.code, 0, "DEL after failed ADD {cid}: {}", del.stdout);
                            ledger.lock().unwrap().failed.push(cid.clone());
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
                        let del = del(c, n, &victim);
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
    c.report();
    l
}

/// DELs every live container, each node's in parallel; then no handle and no allocation may
/// be left.
pub fn release_everything(c: &impl Nodes, ledger: &mut Ledger) {
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
                    let del = del(c, n, &cid);
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
    let state = verify(c, ledger);
    assert!(
        state.handles.is_empty(),
        "handles left: {:?}",
        state.handles
    );
    let left: Vec<_> = state.blocks.iter().flat_map(block_allocations).collect();
    assert!(left.is_empty(), "allocations left: {left:?}");
    c.assert_clean();
}

/// The invariants every run must keep, read from the stored objects (which are returned):
/// no address held twice; every block's allocations and free list partition its ordinals
/// and every attribute is referenced; live handles hold exactly their one address and
/// released ones are gone; handle counts agree with the blocks both ways; at most one
/// confirmed affinity per block, agreeing with the block's own, and none deleted.
pub fn verify(c: &impl Nodes, ledger: &Ledger) -> IpamState {
    let state = c.ipam_state();
    let IpamState {
        blocks,
        handles,
        affinities,
    } = &state;
    let mut owner_of_ip: HashMap<String, String> = HashMap::new();
    let mut per_handle_block: HashMap<(String, String), i64> = HashMap::new();
    for b in blocks {
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
    for (h, v) in handles {
        assert_eq!(v["deleted"], false, "handle {h}: {v}");
    }
    // Live handles hold exactly their address; released handles are gone.
    for (cid, ip) in &ledger.live {
        let h = format!("{}.{cid}", c.network());
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
        .chain(&ledger.failed)
    {
        let h = format!("{}.{cid}", c.network());
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
    for (h, v) in handles {
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
    let mut confirmed: HashMap<&str, Vec<&str>> = HashMap::new();
    for a in affinities {
        assert!(!a.deleted, "{a:?}");
        if a.state == "confirmed" {
            confirmed.entry(&a.cidr).or_default().push(&a.node);
        }
    }
    for (cidr, hosts) in &confirmed {
        assert_eq!(
            hosts.len(),
            1,
            "block {cidr} has several affinities: {hosts:?}"
        );
        if let Some(b) = blocks.iter().find(|b| b["cidr"] == *cidr) {
            assert_eq!(b["affinity"], format!("host:{}", hosts[0]), "block {cidr}");
        }
    }
    for b in blocks {
        if let Some(host) = b["affinity"].as_str().and_then(|a| a.strip_prefix("host:")) {
            assert_eq!(
                confirmed.get(b["cidr"].as_str().unwrap()),
                Some(&vec![host]),
                "block {} is affine to {host} without a confirmed affinity",
                b["cidr"]
            );
        }
    }
    state
}

/// With strict affinity every address comes from its node's own block.
pub fn assert_addresses_from_own_blocks(state: &IpamState) {
    for b in &state.blocks {
        let aff = b["affinity"].as_str().unwrap_or_default();
        for a in b["attributes"].as_array().cloned().unwrap_or_default() {
            let node = a["secondary"]["node"].as_str().unwrap();
            assert_eq!(format!("host:{node}"), aff, "{}", b["cidr"]);
        }
    }
}

/// No node holds more than `max` affinities.
pub fn assert_affinities_per_node_at_most(state: &IpamState, max: usize) {
    let mut per_node: HashMap<&str, usize> = HashMap::new();
    for a in &state.affinities {
        *per_node.entry(&a.node).or_insert(0) += 1;
    }
    assert!(per_node.values().all(|n| *n <= max), "{per_node:?}");
}

// ------------------------------------------------------------------------ scenarios

/// Ten nodes × 50 pods, a /16 pool of /26 blocks, the default IPAM config: nothing refused,
/// nothing failed.
pub fn ten_nodes_fifty_pods_default_config(c: &impl Nodes) {
    let mut ledger = churn(c, 10, 50, |_| {});
    assert!(ledger.exhausted.is_empty() && ledger.failed.is_empty());
    assert_eq!(ledger.live.len() + ledger.deleted.len(), 500);
    verify(c, &ledger);
    release_everything(c, &mut ledger);
}

/// Ten nodes × `pods` with strict affinity (a /16 pool of /26 blocks): nothing refused, and
/// every address comes from its node's own block.
pub fn ten_nodes_strict_affinity(c: &impl Nodes, pods: usize) {
    let mut ledger = churn(c, 10, pods, |_| {});
    assert!(ledger.exhausted.is_empty() && ledger.failed.is_empty());
    assert_addresses_from_own_blocks(&verify(c, &ledger));
    release_everything(c, &mut ledger);
}

/// Ten nodes × 50 pods with /27 blocks (32 addresses) and maxBlocksPerHost 1: each node's
/// ADDs (34 live at most) overflow its block; the rest borrow from other nodes' blocks or
/// hit the limit, and no node holds a second affinity.
pub fn ten_nodes_one_block_each(c: &impl Nodes) {
    let mut ledger = churn(c, 10, 50, |_| {});
    assert!(ledger.failed.is_empty());
    assert_affinities_per_node_at_most(&verify(c, &ledger), 1);
    release_everything(c, &mut ledger);
}

/// Ten nodes × 30 pods from a /25 pool of /28 blocks (128 addresses, about 200 wanted at the
/// peak): the pool runs out, cleanly.
pub fn small_pool_runs_out_cleanly(c: &impl Nodes) {
    let mut ledger = churn(c, 10, 30, |_| {});
    assert!(!ledger.exhausted.is_empty(), "the pool should have run out");
    assert!(ledger.failed.is_empty());
    assert!(ledger.live.len() <= 128);
    verify(c, &ledger);
    release_everything(c, &mut ledger);
}
