//! ADD builds the veth pair while IPAM allocates, and DEL removes the
//! interface while the datastore is worked on: the failure interleavings this opens, with
//! the real binary. Each leaves nothing behind (no veth, no route, no allocation or handle,
//! no WorkloadEndpoint) and exits promptly; what the call did not make survives.

use crate::common::cni::{Invocation, Outcome};
use crate::common::netns::Netns;
use crate::common::world::{World, NODE, WEP_PREFIX};
use serde_json::{json, Value};

fn fails_fast(out: &Outcome) -> Value {
    out.assert_err_fast()
}

fn ok_fast(out: &Outcome) {
    out.assert_ok_fast()
}

/// A successful ADD's result.
fn added(out: &Outcome) -> Value {
    ok_fast(out);
    out.json()
}

/// ADD invocations in both orchestrator modes.
fn invocations(tag: &str, pod: &Netns) -> Vec<Invocation> {
    vec![
        Invocation::new("ADD", &format!("{tag}c"), pod.path()),
        Invocation::new("ADD", &format!("{tag}k"), pod.path()).k8s("default", tag),
    ]
}

/// The veth pair was started before IPAM answered, and removed again.
fn assert_built_then_removed(out: &Outcome) {
    assert!(
        out.stderr.contains("Setting the host side veth name"),
        "the veth pair was not started: {}",
        out.stderr
    );
    assert!(
        out.stderr
            .contains("Removing the interface this call created"),
        "the veth pair was not removed: {}",
        out.stderr
    );
}

/// IPAM fails (a pool that does not exist, an exhausted pool, no IPv6 pool while the IPv6
/// link set-up runs) while the veth pair is being built: the pair is removed, the
/// error is IPAM's.
#[test]
fn ipam_failing_while_the_veth_is_built_leaves_nothing() {
    let w = World::new();
    let cases = [
        (
            json!({"ipam": {"ipv4_pools": ["10.99.0.0/24"]}}),
            "the given pool (10.99.0.0/24) does not exist, or is not enabled",
        ),
        (
            json!({"ipam": {"assign_ipv4": "false", "assign_ipv6": "true"}}),
            "cannot find a qualified ippool",
        ),
    ];
    for (i, (extra, msg)) in cases.into_iter().enumerate() {
        let conf = w.conf(extra);
        let pod = w.pod();
        for inv in invocations(&format!("nopool{i}"), &pod) {
            let out = w.calico(&inv, &conf);
            assert_eq!(fails_fast(&out)["msg"], msg);
            assert_built_then_removed(&out);
            assert!(!pod.has_link("eth0"));
            w.assert_clean();
        }
    }

    // A pool with one /30 block, used up by four pods: the fifth ADD fails in IPAM.
    let w = World::bare();
    w.seed_cluster_information(true);
    w.seed_node(NODE);
    w.seed_pool("tiny", "10.65.9.0/30", 30);
    let conf = w.conf(json!({}));
    let mut pods = Vec::new();
    for i in 0..4 {
        let pod = w.pod();
        let inv = Invocation::new("ADD", &format!("full{i}"), pod.path())
            .k8s("default", &format!("full{i}"));
        ok_fast(&w.calico(&inv, &conf));
        pods.push((pod, inv));
    }
    let pod = w.pod();
    for inv in invocations("full4", &pod) {
        let out = w.calico(&inv, &conf);
        let err = fails_fast(&out);
        assert!(
            err["msg"].as_str().unwrap().starts_with(
                "failed to request IPv4 addresses: Assigned 0 out of 1 requested IPv4 addresses"
            ),
            "{err}"
        );
        assert_built_then_removed(&out);
        assert!(!pod.has_link("eth0"));
        // The other pods keep their interfaces and addresses.
        for (p, _) in &pods {
            assert!(p.has_link("eth0"));
        }
        assert_eq!(w.keys(WEP_PREFIX).len(), 4);
    }
    for (_, inv) in &pods {
        ok_fast(&w.calico(&inv.as_del(), &conf));
    }
    w.assert_clean();
}

/// The veth pair fails (an interface name the pod netns already has, an MTU the kernel
/// refuses) while IPAM succeeds: the addresses are given back, the pod's own interface
/// survives.
#[test]
fn a_veth_failing_while_ipam_succeeds_gives_the_addresses_back() {
    let w = World::new();
    let pod = w.pod();
    pod.ip(&[
        "link", "add", "eth0", "type", "veth", "peer", "name", "keep0",
    ]);
    let idx = pod.ifindex("eth0");
    let conf = w.conf(json!({}));
    for inv in invocations("clash", &pod) {
        let out = w.calico(&inv, &conf);
        assert_eq!(fails_fast(&out)["msg"], "file exists");
        assert!(
            out.stderr.contains("Got result from IPAM plugin"),
            "{}",
            out.stderr
        );
        assert_eq!(pod.ifindex("eth0"), idx, "the pod's own eth0 was replaced");
        assert!(pod.has_link("keep0"));
        w.assert_clean();
    }

    let conf = w.conf(json!({"mtu": 65536}));
    let pod = w.pod();
    for inv in invocations("mtu", &pod) {
        let out = w.calico(&inv, &conf);
        assert_eq!(fails_fast(&out)["msg"], "invalid argument");
        assert!(
            out.stderr.contains("Got result from IPAM plugin"),
            "{}",
            out.stderr
        );
        assert!(!pod.has_link("eth0"));
        w.assert_clean();
    }
}

/// A host link that already has the pod's host-side name (a leftover) is replaced only
/// once IPAM has succeeded, as upstream does it: an ADD that fails in IPAM leaves it alone.
#[test]
fn a_leftover_host_veth_is_replaced_only_after_ipam() {
    let w = World::new();
    let conf = w.conf(json!({}));
    let pod = w.pod();
    let inv = Invocation::new("ADD", "left1", pod.path()).k8s("default", "left");
    let hv = added(&w.calico(&inv, &conf))["interfaces"][0]["name"]
        .as_str()
        .unwrap()
        .to_string();
    ok_fast(&w.calico(&inv.as_del(), &conf));
    w.host.ip(&[
        "link", "add", &hv, "type", "veth", "peer", "name", "leftpeer",
    ]);

    let bad = w.conf(json!({"ipam": {"ipv4_pools": ["10.99.0.0/24"]}}));
    let out = w.calico(&inv, &bad);
    fails_fast(&out);
    assert!(w.host.has_link(&hv) && w.host.has_link("leftpeer"));
    assert!(!pod.has_link("eth0"));

    let out = w.calico(&inv, &conf);
    ok_fast(&out);
    assert!(
        out.stderr.contains(&format!("Cleaning old hostVeth: {hv}")),
        "{}",
        out.stderr
    );
    assert!(
        !w.host.has_link("leftpeer"),
        "the leftover was not replaced"
    );
    assert!(pod.has_link("eth0"));
    ok_fast(&w.calico(&inv.as_del(), &conf));
    w.assert_clean();
}

/// A DEL whose datastore fails (not ready; unreachable) touches nothing, as upstream's: the
/// DEL fails, the interface, its routes, the endpoint and the address stay, and the retried
/// DEL (the datastore back) removes them all.
#[test]
fn a_del_whose_datastore_fails_touches_nothing() {
    let w = World::new();
    let conf = w.conf(json!({}));
    // An etcd nobody listens on: a port of the host netns that is closed.
    let unreachable = w.conf(json!({
        "etcd_endpoints": "http://127.0.0.1:1",
        "call_timeout_seconds": 3,
    }));
    for (i, k8s) in [false, true].into_iter().enumerate() {
        let pod = w.pod();
        let mut inv = Invocation::new("ADD", &format!("dsdel{i}"), pod.path());
        if k8s {
            inv = inv.k8s("default", &format!("dsdel{i}"));
        }
        let ip = added(&w.calico(&inv, &conf))["ips"][0]["address"]
            .as_str()
            .unwrap()
            .trim_end_matches("/32")
            .to_string();
        let route_gone = || w.host_sh(&format!("ip route show {ip}")).trim().is_empty();
        assert!(!route_gone());

        w.seed_cluster_information(false);
        let err = fails_fast(&w.calico(&inv.as_del(), &conf));
        assert_eq!(
            err["msg"],
            "Calico is currently not ready to process requests"
        );
        assert!(pod.has_link("eth0"));
        assert!(!route_gone());
        // The datastore still has the endpoint and the address.
        assert_eq!(w.keys(WEP_PREFIX).len(), 1);
        w.seed_cluster_information(true);
        ok_fast(&w.calico(&inv.as_del(), &conf));
        w.assert_clean();

        // The same with a datastore that cannot be reached at all.
        let pod = w.pod();
        inv.netns = pod.path().to_string();
        ok_fast(&w.calico(&inv, &conf));
        let out = w.calico(&inv.as_del(), &unreachable);
        fails_fast(&out);
        assert!(pod.has_link("eth0"));
        assert!(w.host_sh("ip -o link").contains("cali"));
        assert_eq!(w.keys(WEP_PREFIX).len(), 1);
        ok_fast(&w.calico(&inv.as_del(), &conf));
        w.assert_clean();
    }
}

/// A dual-stack ADD whose IPv6 half fails after the IPv4 half was assigned (no IPv6 pool, an
/// exhausted IPv6 pool), from `calico` and from `calico-ipam` on its own: the IPv4 address
/// and the handle are given back, nothing else is left, and the next ADD gets that address.
#[test]
fn a_dual_stack_add_whose_ipv6_half_fails_leaves_no_address_and_no_handle() {
    let w = World::bare();
    w.seed_cluster_information(true);
    w.seed_node(NODE);
    w.seed_pool("v4", "10.65.9.0/30", 30);
    let dual = json!({"ipam": {"assign_ipv4": "true", "assign_ipv6": "true"}});
    let conf = w.conf(dual.clone());
    let pod = w.pod();
    for (i, inv) in invocations("nov6", &pod).iter().enumerate() {
        let out = w.calico(inv, &conf);
        let err = fails_fast(&out);
        assert_eq!(err["msg"], "cannot find a qualified ippool", "{i}");
        assert!(!pod.has_link("eth0"));
        w.assert_clean();
        // calico-ipam run by hand (CNI_ARGS without K8S_* keys, which it refuses alone).
        if i == 0 {
            let ipam = w.ipam(inv, &conf);
            assert_eq!(fails_fast(&ipam)["msg"], "cannot find a qualified ippool");
            w.assert_clean();
        }
    }

    // An IPv6 pool of one /127 block: two pods fill it, the third ADD's IPv6 half fails.
    w.seed_pool("v6", "fd80:9::/127", 127);
    let mut held = Vec::new();
    for i in 0..2 {
        let pod = w.pod();
        let inv = Invocation::new("ADD", &format!("v6full{i}"), pod.path())
            .k8s("default", &format!("v6full{i}"));
        ok_fast(&w.calico(&inv, &conf));
        held.push((pod, inv));
    }
    let before = w.keys("/calico/ipam/v2/handle/");
    let pod = w.pod();
    for inv in invocations("v6full2", &pod) {
        let out = w.calico(&inv, &conf);
        let err = fails_fast(&out);
        assert!(
            err["msg"]
                .as_str()
                .unwrap()
                .starts_with("failed to request IPv6 addresses"),
            "{err}"
        );
        assert!(!pod.has_link("eth0"));
        assert_eq!(w.keys("/calico/ipam/v2/handle/"), before);
    }
    let by_hand = Invocation::new("ADD", "v6full2h", pod.path());
    assert!(fails_fast(&w.ipam(&by_hand, &conf))["msg"]
        .as_str()
        .unwrap()
        .starts_with("failed to request IPv6 addresses"));
    assert_eq!(w.keys("/calico/ipam/v2/handle/"), before);
    for (_, inv) in &held {
        ok_fast(&w.calico(&inv.as_del(), &conf));
    }
    w.assert_clean();
}

/// k8s DEL releases the addresses once the host veth's removal is notified (its routes are
/// gone by then), while the kernel finishes the teardown; when there is no host veth to
/// watch (removed beforehand), it waits for the whole removal as before. Either way nothing
/// is left.
#[test]
fn a_k8s_del_releases_the_addresses_once_the_host_veth_is_gone() {
    let w = World::new();
    let conf = w.conf(json!({}));
    let pod = w.pod();
    let inv = Invocation::new("ADD", "gone0", pod.path()).k8s("default", "gone0");
    added(&w.calico(&inv, &conf));
    let out = w.calico(&inv.as_del(), &conf);
    ok_fast(&out);
    let (gone, released, deleted) = (
        out.stderr
            .find("the host veth is gone; releasing the pod's addresses")
            .expect("the host veth's removal was not seen"),
        out.stderr.find("releasing addresses").expect("no release"),
        out.stderr
            .find("Deleted device in netns.")
            .expect("no removal"),
    );
    assert!(gone < released, "{}", out.stderr);
    assert!(deleted > gone, "{}", out.stderr);
    assert!(!pod.has_link("eth0"));
    w.assert_clean();

    // The host veth is already gone: nothing to watch for; the DEL waits for the removal.
    let pod = w.pod();
    let inv = Invocation::new("ADD", "gone1", pod.path()).k8s("default", "gone1");
    let second = added(&w.calico(&inv, &conf));
    let host_veth = second["interfaces"][0]["name"]
        .as_str()
        .unwrap()
        .to_string();
    w.host_sh(&format!("ip link del {host_veth}"));
    let out = w.calico(&inv.as_del(), &conf);
    ok_fast(&out);
    assert!(
        !out.stderr.contains("the host veth is gone"),
        "{}",
        out.stderr
    );
    w.assert_clean();
}
