//! End to end on etcd v3, what only etcd has: the exact keys and JSON written (upstream's
//! WorkloadEndpoint, IPAM and Profile objects), the `cni` orchestrator (no Kubernetes pod),
//! unknown fields kept on read-modify-write, and etcd's own error texts. The scenarios that
//! do not depend on the datastore (result encoding, dataplane, ping, DEL idempotence, IP=,
//! host-local, dual stack, pools, bad input, readiness, ...) are in shared_scenarios.rs, run
//! on etcd and on the Kubernetes datastore.

mod common;

use common::cni::Invocation;
use common::world::{World, NODE, WEP_PREFIX};
use serde_json::{json, Value};

fn ip_of(result: &Value) -> String {
    let addr = result["ips"][0]["address"].as_str().expect("an address");
    addr.split('/').next().unwrap().to_string()
}

/// A k8s pod's ADD writes upstream's objects under upstream's keys, exactly. (The result,
/// the dataplane and DEL: shared_scenarios.rs `add_and_del_with_calico_ipam`.)
#[test]
fn k8s_add_writes_upstreams_etcd_objects() {
    let w = World::new();
    let pod = w.pod();
    let conf = w.conf(json!({}));
    let inv = Invocation::new("ADD", "a1b2c3d4e5f6", pod.path()).k8s("default", "nginx");
    let r = w.calico(&inv, &conf).assert_ok().json();
    let ip = ip_of(&r);
    let mac = r["interfaces"][1]["mac"].as_str().unwrap().to_string();
    // The first ordinal of node1's first block: the route is the block.
    let block_cidr = r["routes"][0]["dst"].as_str().unwrap().to_string();
    assert_eq!(block_cidr, format!("{ip}/26"));

    // The WorkloadEndpoint, exactly.
    let key = format!("{WEP_PREFIX}default/node1-k8s-nginx-eth0");
    let wep = w.get(&key);
    assert_eq!(wep["kind"], "WorkloadEndpoint");
    assert_eq!(wep["apiVersion"], "projectcalico.org/v3");
    assert_eq!(wep["metadata"]["name"], "node1-k8s-nginx-eth0");
    assert_eq!(wep["metadata"]["namespace"], "default");
    assert!(wep["metadata"].get("resourceVersion").is_none());
    assert_eq!(wep["metadata"]["uid"].as_str().unwrap().len(), 36);
    assert!(wep["metadata"]["creationTimestamp"]
        .as_str()
        .unwrap()
        .ends_with('Z'));
    assert_eq!(
        wep["metadata"]["labels"],
        json!({"projectcalico.org/namespace":"default","projectcalico.org/orchestrator":"k8s"})
    );
    assert_eq!(
        wep["spec"],
        json!({"orchestrator":"k8s","node":NODE,"containerID":"a1b2c3d4e5f6","pod":"nginx","endpoint":"eth0",
            "ipNetworks":[format!("{ip}/32")],"profiles":["net1"],"interfaceName":"calic440f455693","mac":mac})
    );
    // IPAM objects under their keys.
    let handle = w.get("/calico/ipam/v2/handle/net1.a1b2c3d4e5f6");
    assert_eq!(handle["block"], json!({ &block_cidr: 1 }));
    assert_eq!(handle["deleted"], false);
    let block_key = format!(
        "/calico/ipam/v2/assignment/ipv4/block/{}",
        block_cidr.replace('/', "-")
    );
    let block = w.get(&block_key);
    assert_eq!(block["cidr"], block_cidr);
    assert_eq!(block["affinity"], format!("host:{NODE}"));
    assert_eq!(block["attributes"][0]["handle_id"], "net1.a1b2c3d4e5f6");
    assert_eq!(
        w.get(&format!(
            "/calico/ipam/v2/host/{NODE}/ipv4/block/{}",
            block_cidr.replace('/', "-")
        )),
        json!({"state":"confirmed","deleted":false})
    );
    // Profile created (policy.type empty, k8s rules).
    assert_eq!(
        w.get("/calico/resources/v3/projectcalico.org/profiles/net1")["spec"],
        json!({"ingress":[{"action":"Allow"}],"egress":[{"action":"Allow"}],"labelsToApply":{"net1":""}})
    );

    // DEL: the WEP and handle keys go, the empty block's key stays (affine, as upstream).
    w.calico(&inv.as_del(), &conf).assert_ok();
    w.assert_clean();
    assert_eq!(
        w.keys(&block_key),
        vec![block_key.clone()],
        "affine block kept"
    );
}

#[test]
fn cni_mode_add_del_profile_and_second_add() {
    let w = World::new();
    let pod = w.pod();
    let conf = w.conf(json!({}));
    let inv = Invocation::new("ADD", "abc123", pod.path());
    let out = w.calico(&inv, &conf);
    out.assert_ok();
    let r = out.json();
    let ip = ip_of(&r);
    assert_eq!(r["interfaces"][0]["name"], "caliabc123");
    let wep = w.get(&format!("{WEP_PREFIX}default/node1-cni-abc123-eth0"));
    assert_eq!(
        wep["spec"],
        json!({"orchestrator":"cni","node":NODE,"containerID":"abc123","endpoint":"eth0",
            "ipNetworks":[format!("{ip}/32")],"profiles":["net1"],"interfaceName":"caliabc123",
            "mac": r["interfaces"][1]["mac"]})
    );
    assert_eq!(
        wep["metadata"]["labels"],
        json!({"projectcalico.org/namespace":"default","projectcalico.org/orchestrator":"cni"})
    );
    assert_eq!(
        w.get("/calico/resources/v3/projectcalico.org/profiles/net1")["spec"],
        json!({"ingress":[{"action":"Allow","source":{"selector":"has(net1)"}}],"egress":[{"action":"Allow"}],"labelsToApply":{"net1":""}})
    );
    assert_eq!(
        w.get("/calico/ipam/v2/handle/net1.abc123")["block"]
            .as_object()
            .unwrap()
            .len(),
        1
    );

    // Second ADD, same container: same addresses and interfaces, no routes, no new IP.
    let again = w.calico(&inv, &conf);
    again.assert_ok();
    let r2 = again.json();
    assert_eq!(r2["ips"], r["ips"]);
    assert_eq!(r2["interfaces"], r["interfaces"]);
    assert!(r2.get("routes").is_none());
    // Same container on a second network: profile appended.
    let conf2 = w.conf(json!({"name": "net2"}));
    w.calico(&inv, &conf2).assert_ok();
    let wep = w.get(&format!("{WEP_PREFIX}default/node1-cni-abc123-eth0"));
    assert_eq!(wep["spec"]["profiles"], json!(["net1", "net2"]));
    assert_eq!(w.keys(WEP_PREFIX).len(), 1);

    let del = inv.as_del();
    w.calico(&del, &conf).assert_ok();
    w.assert_clean();
    // DEL is idempotent in cni mode too: again, never added, a netns gone, no netns at all.
    w.calico(&del, &conf).assert_ok();
    w.calico(&Invocation::new("DEL", "never", pod.path()), &conf)
        .assert_ok();
    let mut gone = Invocation::new("DEL", "gone", "/not/a/real/path1234567890");
    w.calico(&gone, &conf).assert_ok();
    gone.netns = String::new();
    w.calico(&gone, &conf).assert_ok();
    w.assert_clean();
}

/// A store calico/node has not set up: etcd's texts for a missing ClusterInformation, then
/// for a missing Node; nothing is left. (Readiness itself: shared_scenarios.rs
/// `datastore_not_ready_fails_add_and_del`.)
#[test]
fn missing_cluster_information_then_missing_node() {
    let w = World::bare();
    w.seed_pool("default-ipv4-ippool", "10.65.0.0/16", 26);
    let conf = w.conf(json!({}));
    let pod = w.pod();
    let add = Invocation::new("ADD", "nn1", pod.path());
    let err = w.calico(&add, &conf).assert_err();
    assert_eq!(
        err["msg"],
        "error getting ClusterInformation: resource does not exist: ClusterInformation(default) with error: <nil>"
    );
    w.assert_clean();
    w.seed_cluster_information(true);
    let err = w.calico(&add, &conf).assert_err();
    assert_eq!(err["code"], 999, "{err}");
    assert!(
        err["msg"].as_str().unwrap().contains("Node(node1)"),
        "{err}"
    );
    w.assert_clean();
}

#[test]
fn unknown_fields_survive_read_modify_write_and_logs_are_written() {
    let w = World::new();
    let conf = w.conf(json!({}));
    let (a, b) = (w.pod(), w.pod());
    w.calico(&Invocation::new("ADD", "rmw1", a.path()), &conf)
        .assert_ok();
    // A newer Calico adds fields to the block; our next write must keep them.
    let key = w.keys("/calico/ipam/v2/assignment/ipv4/block/").remove(0);
    let mut block = w.get(&key);
    block["futureField"] = json!({"x": 1});
    block["attributes"][0]["alternateOwnerAttrs"] = json!({"pod": "other"});
    w.etcd.put(&key, &block.to_string());
    w.calico(&Invocation::new("ADD", "rmw2", b.path()), &conf)
        .assert_ok();
    let after = w.get(&key);
    assert_eq!(after["futureField"], json!({"x": 1}));
    assert_eq!(
        after["attributes"][0]["alternateOwnerAttrs"],
        json!({"pod": "other"})
    );
    assert_eq!(after["attributes"].as_array().unwrap().len(), 2);
    assert_eq!(
        after["sequenceNumber"].as_u64().unwrap(),
        block["sequenceNumber"].as_u64().unwrap() + 1
    );
    let log = std::fs::read_to_string(w.scratch.path().join("cni.log")).expect("log file");
    assert!(
        log.contains("[INFO]") && log.contains("cni-plugin/") && log.contains("ipam/"),
        "{log}"
    );
    for (cid, ns) in [("rmw1", &a), ("rmw2", &b)] {
        w.calico(&Invocation::new("DEL", cid, ns.path()), &conf)
            .assert_ok();
    }
}
