//! calico-ipam's datastore writes compared field by field with upstream's JSON
//! (libcalico-go's `model` for blocks, handles, affinities and IPAMConfig): a /29 block filled to its last address through the real
//! binary and emptied again, the handle and affinity objects, IPAMConfig defaults.

use crate::common;
use crate::common::cni::{run_plugin, Bin, Invocation, TempDir};
use crate::common::etcd::EtcdServer;
use serde_json::{json, Value};

const BLOCK: &str = "/calico/ipam/v2/assignment/ipv4/block/10.80.0.0-29";
const AFFINITY: &str = "/calico/ipam/v2/host/node1/ipv4/block/10.80.0.0-29";

struct Env {
    etcd: EtcdServer,
    bin: Bin,
    scratch: TempDir,
}

impl Env {
    fn new() -> Env {
        let etcd = EtcdServer::start();
        etcd.put(
            "/calico/resources/v3/projectcalico.org/nodes/node1",
            r#"{"kind":"Node","apiVersion":"projectcalico.org/v3","metadata":{"name":"node1"},"spec":{}}"#,
        );
        // A pool that is exactly one /29 block.
        etcd.put(
            "/calico/resources/v3/projectcalico.org/ippools/p29",
            r#"{"kind":"IPPool","apiVersion":"projectcalico.org/v3","metadata":{"name":"p29"},"spec":{"cidr":"10.80.0.0/29","blockSize":29}}"#,
        );
        Env {
            etcd,
            bin: Bin::new(),
            scratch: TempDir::new("ipam-ds"),
        }
    }

    fn ipam(&self, cmd: &str, cid: &str) -> common::cni::Outcome {
        let conf = json!({"cniVersion":"1.0.0","name":"net1","etcd_endpoints":self.etcd.endpoint(),
            "nodename":"node1","log_file_path":self.scratch.path().join("cni.log").display().to_string(),
            "ipam_lock_file":self.scratch.path().join("lock").display().to_string(),"ipam":{"type":"calico-ipam"}});
        let inv = Invocation::new(cmd, cid, "/dev/null")
            .k8s("ns1", &format!("pod-{cid}"))
            .via_calico();
        run_plugin(
            &self.bin.plugin("calico-ipam"),
            &self.bin.path(),
            None,
            &inv,
            &conf.to_string(),
        )
    }
}

/// The block with its time-dependent fields checked and then blanked.
fn block(env: &Env) -> Value {
    let raw = env.etcd.get_raw(BLOCK).expect("block");
    let mut b: Value = serde_json::from_str(&raw).unwrap();
    // Field order as upstream's struct.
    let keys: Vec<&String> = b.as_object().unwrap().keys().collect();
    assert_eq!(
        keys,
        [
            "cidr",
            "affinity",
            "affinity_claim_time",
            "allocations",
            "unallocated",
            "attributes",
            "sequenceNumber",
            "sequenceNumberForAllocation",
            "deleted"
        ]
    );
    assert!(b["affinity_claim_time"].as_str().unwrap().ends_with('Z'));
    b["affinity_claim_time"] = json!("T");
    for a in b["attributes"].as_array_mut().into_iter().flatten() {
        let ts = a["secondary"]["timestamp"].as_str().unwrap();
        assert!(ts.ends_with(" +0000 UTC"), "{ts}");
        a["secondary"]["timestamp"] = json!("TS");
    }
    b
}

fn attr(cid: &str) -> Value {
    json!({"handle_id": format!("net1.{cid}"), "secondary": {"namespace": "ns1", "node": "node1", "pod": format!("pod-{cid}"), "timestamp": "TS"}})
}

#[test]
fn block_filled_to_the_last_address_and_emptied() {
    let env = Env::new();
    assert!(env.etcd.get_raw("/calico/ipam/v2/config").is_none());
    let mut seqs = Vec::new();
    for i in 0..8 {
        let cid = format!("c{i}");
        let r = env.ipam("ADD", &cid).assert_ok().json();
        assert_eq!(r["ips"][0]["address"], format!("10.80.0.{i}/29"));
        assert_eq!(r["routes"][0]["dst"], format!("10.80.0.{i}/29"));
        let b = block(&env);
        let mut allocations = vec![Value::Null; 8];
        for (j, a) in allocations.iter_mut().enumerate().take(i + 1) {
            *a = json!(j);
        }
        assert_eq!(b["cidr"], "10.80.0.0/29");
        assert_eq!(b["affinity"], "host:node1");
        assert_eq!(b["allocations"], json!(allocations));
        assert_eq!(b["unallocated"], json!((i + 1..8).collect::<Vec<_>>()));
        assert_eq!(
            b["attributes"],
            json!((0..=i).map(|j| attr(&format!("c{j}"))).collect::<Vec<_>>())
        );
        assert_eq!(b["deleted"], false);
        let seq = b["sequenceNumber"].as_u64().unwrap();
        // The allocation records the sequence number the block had before this write.
        assert_eq!(b["sequenceNumberForAllocation"][i.to_string()], seq - 1);
        seqs.push(seq);
        assert_eq!(
            env.etcd
                .get_json(&format!("/calico/ipam/v2/handle/net1.{cid}")),
            json!({"block": {"10.80.0.0/29": 1}, "deleted": false})
        );
    }
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{seqs:?}");
    assert_eq!(
        env.etcd.get_json(AFFINITY),
        json!({"state": "confirmed", "deleted": false})
    );
    // Full: the next ADD fails with upstream's message and leaves nothing.
    let err = env.ipam("ADD", "c8").assert_err();
    assert_eq!(
        err["msg"],
        "failed to request IPv4 addresses: Assigned 0 out of 1 requested IPv4 addresses; No IPs available in pools: [10.80.0.0/29]"
    );
    assert!(env.etcd.get_raw("/calico/ipam/v2/handle/net1.c8").is_none());

    // Release out of order: freed ordinals go to the tail, attributes are compacted.
    env.ipam("DEL", "c5").assert_ok();
    env.ipam("DEL", "c2").assert_ok();
    let b = block(&env);
    assert_eq!(b["allocations"], json!([0, 1, null, 2, 3, null, 4, 5]));
    assert_eq!(b["unallocated"], json!([5, 2]));
    assert_eq!(
        b["attributes"],
        json!(["c0", "c1", "c3", "c4", "c6", "c7"]
            .iter()
            .map(|c| attr(c))
            .collect::<Vec<_>>())
    );
    assert!(env.etcd.get_raw("/calico/ipam/v2/handle/net1.c5").is_none());
    // The head of the free list is reused first.
    let r = env.ipam("ADD", "c9").assert_ok().json();
    assert_eq!(r["ips"][0]["address"], "10.80.0.5/29");
    for c in ["c0", "c1", "c3", "c4", "c6", "c7", "c9", "c2"] {
        env.ipam("DEL", c).assert_ok();
    }
    let b = block(&env);
    assert_eq!(
        b["allocations"],
        json!([null, null, null, null, null, null, null, null])
    );
    assert_eq!(b["attributes"], json!([]));
    assert_eq!(b["unallocated"].as_array().unwrap().len(), 8);
    // The empty block stays affine to the host (upstream frees it later, via GC or reclaim).
    assert_eq!(b["affinity"], "host:node1");
    assert!(env.etcd.keys("/calico/ipam/v2/handle/").is_empty());
    // v3.32.1's GetIPAMConfig stored its defaults on the first assignment.
    assert_eq!(
        env.etcd.get_raw("/calico/ipam/v2/config").as_deref(),
        Some(r#"{"auto_allocate_blocks":true,"kubeVirtVMAddressPersistence":"Enabled"}"#)
    );
}

#[test]
fn legacy_handle_and_repeated_del() {
    let env = Env::new();
    env.ipam("ADD", "x1").assert_ok();
    // DEL also releases the pre-v3 handle <ns>.<pod>; a second DEL is a no-op success.
    env.ipam("DEL", "x1").assert_ok();
    env.ipam("DEL", "x1").assert_ok();
    assert!(env.etcd.keys("/calico/ipam/v2/handle/").is_empty());
}

fn put_pool(env: &Env, name: &str, cidr: &str, selector: &str) {
    env.etcd.put(
        &format!("/calico/resources/v3/projectcalico.org/ippools/{name}"),
        &json!({"kind":"IPPool","apiVersion":"projectcalico.org/v3","metadata":{"name":name},
            "spec":{"cidr":cidr,"blockSize":29,"nodeSelector":selector}})
        .to_string(),
    );
}

/// Empty affine blocks of pools that stop selecting the node are given up: on the next ADD
/// (getAffineBlocks) and when a release empties them (ensureConsistentAffinity).
#[test]
fn deselected_empty_blocks_lose_their_affinity() {
    let env = Env::new();
    env.ipam("ADD", "d1").assert_ok();
    env.ipam("DEL", "d1").assert_ok();
    assert!(
        env.etcd.get_raw(AFFINITY).is_some(),
        "an empty block stays affine"
    );
    // The pool now selects other nodes only; a second pool takes over.
    put_pool(&env, "p29", "10.80.0.0/29", "zone == 'x'");
    put_pool(&env, "q29", "10.81.0.0/29", "all()");
    let r = env.ipam("ADD", "d2").assert_ok().json();
    assert_eq!(r["ips"][0]["address"], "10.81.0.0/29");
    assert!(
        env.etcd.get_raw(AFFINITY).is_none(),
        "deselected affinity released"
    );
    assert!(
        env.etcd.get_raw(BLOCK).is_none(),
        "the empty block went with it"
    );
    // ensureConsistentAffinity: deselect q29 while d2 holds an address, then release it.
    put_pool(&env, "q29", "10.81.0.0/29", "zone == 'x'");
    env.ipam("DEL", "d2").assert_ok();
    assert!(env
        .etcd
        .get_raw("/calico/ipam/v2/host/node1/ipv4/block/10.81.0.0-29")
        .is_none());
    assert!(env
        .etcd
        .get_raw("/calico/ipam/v2/assignment/ipv4/block/10.81.0.0-29")
        .is_none());
    // A selector that still matches keeps the affinity.
    put_pool(&env, "q29", "10.81.0.0/29", "all()");
    env.ipam("ADD", "d3").assert_ok();
    env.ipam("DEL", "d3").assert_ok();
    assert!(env
        .etcd
        .get_raw("/calico/ipam/v2/host/node1/ipv4/block/10.81.0.0-29")
        .is_some());
}

/// Item 22, as v3.32.1: a block whose pool is disabled is kept (only enabled pools are
/// looked at); a release with the Node gone keeps the affinity; a nodeSelector that does
/// not parse fails the ADD with the parser's text (and never releases anything).
#[test]
fn deselected_affinity_release_is_conservative() {
    let env = Env::new();
    env.ipam("ADD", "k1").assert_ok();
    env.ipam("DEL", "k1").assert_ok();
    // Disabled and deselected: the empty affine block is kept.
    env.etcd.put(
        "/calico/resources/v3/projectcalico.org/ippools/p29",
        r#"{"kind":"IPPool","apiVersion":"projectcalico.org/v3","metadata":{"name":"p29"},"spec":{"cidr":"10.80.0.0/29","blockSize":29,"nodeSelector":"zone == 'x'","disabled":true}}"#,
    );
    put_pool(&env, "q29", "10.81.0.0/29", "all()");
    let r = env.ipam("ADD", "k2").assert_ok().json();
    assert_eq!(r["ips"][0]["address"], "10.81.0.0/29");
    assert!(
        env.etcd.get_raw(AFFINITY).is_some(),
        "a disabled pool's block is kept"
    );
    // The Node is gone when q29 stops selecting it: the release keeps the affinity.
    put_pool(&env, "q29", "10.81.0.0/29", "zone == 'x'");
    env.etcd
        .etcdctl(&["del", "/calico/resources/v3/projectcalico.org/nodes/node1"]);
    env.ipam("DEL", "k2").assert_ok();
    assert!(env
        .etcd
        .get_raw("/calico/ipam/v2/host/node1/ipv4/block/10.81.0.0-29")
        .is_some());
    // A selector that does not parse: the ADD fails with the parser's own text.
    env.etcd.put(
        "/calico/resources/v3/projectcalico.org/nodes/node1",
        r#"{"kind":"Node","apiVersion":"projectcalico.org/v3","metadata":{"name":"node1"},"spec":{}}"#,
    );
    let bad = "zone ==== 'x'";
    put_pool(&env, "q29", "10.81.0.0/29", bad);
    let want = calico_cni::ipam::selector::parse(bad)
        .unwrap_err()
        .to_string();
    let err = env.ipam("ADD", "k3").assert_err();
    assert_eq!(err["msg"], want.as_str());
    assert!(env
        .etcd
        .get_raw("/calico/ipam/v2/host/node1/ipv4/block/10.81.0.0-29")
        .is_some());
}

/// A claimer that crashed after writing its `pending` affinity (no block yet): the next ADD
/// on that host finishes the claim — block created, affinity confirmed.
#[test]
fn pending_affinity_left_by_a_crash_is_recovered() {
    let env = Env::new();
    env.etcd
        .put(AFFINITY, r#"{"state":"pending","deleted":false}"#);
    let r = env.ipam("ADD", "p1").assert_ok().json();
    assert_eq!(r["ips"][0]["address"], "10.80.0.0/29");
    assert_eq!(
        env.etcd.get_json(AFFINITY),
        json!({"state": "confirmed", "deleted": false})
    );
    assert_eq!(block(&env)["affinity"], "host:node1");
    // A pending affinity whose block exists and is ours is confirmed too.
    env.etcd
        .put(AFFINITY, r#"{"state":"pending","deleted":false}"#);
    env.ipam("ADD", "p2").assert_ok();
    assert_eq!(
        env.etcd.get_json(AFFINITY),
        json!({"state": "confirmed", "deleted": false})
    );
    // An affinity to a block another host owns is stale and removed.
    let other = "/calico/ipam/v2/host/node2/ipv4/block/10.80.0.0-29";
    env.etcd.put(
        "/calico/resources/v3/projectcalico.org/nodes/node2",
        r#"{"kind":"Node","apiVersion":"projectcalico.org/v3","metadata":{"name":"node2"},"spec":{}}"#,
    );
    env.etcd
        .put(other, r#"{"state":"confirmed","deleted":false}"#);
    let conf = json!({"cniVersion":"1.0.0","name":"net1","etcd_endpoints":env.etcd.endpoint(),
        "nodename":"node2","log_file_path":env.scratch.path().join("cni.log").display().to_string(),
        "ipam_lock_file":env.scratch.path().join("lock2").display().to_string(),"ipam":{"type":"calico-ipam"}});
    let out = run_plugin(
        &env.bin.plugin("calico-ipam"),
        &env.bin.path(),
        None,
        &Invocation::new("ADD", "n2", "/dev/null"),
        &conf.to_string(),
    );
    // node2 borrows from node1's block (strict affinity off) after dropping its stale claim.
    let r = out.assert_ok().json();
    assert_eq!(r["ips"][0]["address"], "10.80.0.2/29");
    assert!(env.etcd.get_raw(other).is_none(), "stale affinity removed");
    let b = block(&env);
    assert_eq!(b["affinity"], "host:node1");
    assert_eq!(b["attributes"][2]["secondary"]["node"], "node2");
}

/// IP= in a pool that does not allow workloads: allowed in v3.32.1 (item 15).
#[test]
fn requested_ip_in_a_tunnel_only_pool() {
    let env = Env::new();
    env.etcd.put(
        "/calico/resources/v3/projectcalico.org/ippools/tunnels",
        r#"{"kind":"IPPool","apiVersion":"projectcalico.org/v3","metadata":{"name":"tunnels"},"spec":{"cidr":"10.123.0.0/24","allowedUses":["Tunnel"]}}"#,
    );
    let conf = json!({"cniVersion":"1.0.0","name":"net1","etcd_endpoints":env.etcd.endpoint(),
        "nodename":"node1","log_file_path":env.scratch.path().join("cni.log").display().to_string(),
        "ipam_lock_file":env.scratch.path().join("lock").display().to_string(),"ipam":{"type":"calico-ipam"}});
    let inv = Invocation::new("ADD", "t1", "/dev/null").with_args("IP=10.123.0.5");
    let run = |inv: &Invocation| {
        run_plugin(
            &env.bin.plugin("calico-ipam"),
            &env.bin.path(),
            None,
            inv,
            &conf.to_string(),
        )
    };
    // v3.32.1 checks no allowedUses on this path (the check is newer): the address is given,
    // with a route to itself as AutoAssign's results have.
    let r = run(&inv).assert_ok().json();
    assert_eq!(r["ips"][0]["address"], "10.123.0.5/32");
    assert_eq!(r["routes"][0]["dst"], "10.123.0.5/32");
    assert_eq!(
        env.etcd.get_json("/calico/ipam/v2/handle/net1.t1"),
        json!({"block": {"10.123.0.0/26": 1}, "deleted": false})
    );
    run(&inv.as_del()).assert_ok();
    assert!(env.etcd.keys("/calico/ipam/v2/handle/").is_empty());
}
