//! `calico` and `calico-ipam` on the Kubernetes datastore, end to end: the real binary, run
//! as kubelet runs it inside a test host netns, against a real kube-apiserver with Calico's
//! CRDs and the upstream `calico-cni-plugin` RBAC, through a kubeconfig with that
//! ServiceAccount's token (common/real_k8s.rs); the requests it made are read from the
//! server's audit log.
//!
//! The fault-injecting test API server (common/kube_api/) is kept only for what a real
//! server cannot be made to show: `kdd_one_http2_connection_per_call` (TLS handshakes per
//! call, the HTTP version and the patch's content type are seen only by the test server),
//! `kdd_a_stalled_answer_fails_cleanly` (a request read and never answered; a frozen real
//! server stalls the handshake instead, see `kdd_bad_credentials_and_a_frozen_api_server_
//! fail_cleanly`), `kdd_round_trips_of_an_add_into_an_affine_block` (a latency added to
//! every answer, to count sequential round trips, and the handshake count) and
//! `etcd_with_policy_k8s_makes_nothing_while_the_pod_is_read` (the same latency, to see what is in
//! etcd while the pod's answer is held back).

use std::time::Duration;

use crate::common;
use crate::common::cni::{report_skip, Invocation};
use crate::common::kdd::{KddWorld, RealKddWorld, CRD, NODE};
use crate::common::kube_api::KubeApi;
use crate::common::netns::require_root;
use crate::common::real_k8s::{Audited, RealK8s};
use crate::common::route_conflict;
use serde_json::{json, Value};

/// The real-server world, or return (after `SKIPPED <why>`) when there is none.
macro_rules! real_world {
    ($test:literal) => {
        match RealKddWorld::real_or_skip($test) {
            Some(w) => w,
            None => return,
        }
    };
}

/// Whether the server accepted the request or answered as a store does (404 for a read of a
/// missing object, 409 for a lost race): not refused by RBAC (401/403), not rejected by the
/// CRDs' schemas (400/422), no server error.
fn accepted(q: &Audited) -> bool {
    matches!(q.code, 200..=299 | 404 | 409)
}

fn listing(reqs: &[Audited]) -> String {
    reqs.iter()
        .map(Audited::line)
        .collect::<Vec<_>>()
        .join("\n")
}

fn ip_of(result: &Value) -> String {
    let a = result["ips"][0]["address"].as_str().unwrap();
    a.split('/').next().unwrap().to_string()
}

#[test]
fn kdd_pod_add_and_del() {
    require_root();
    let w = real_world!("kdd_pod_add_and_del");
    w.seed_pod(
        "default",
        "nginx",
        json!({"metadata":{"generateName":"nginx-"}}),
    );
    let pod = common::netns::Netns::new("pod");
    let conf = w.conf(json!({}));
    let inv = Invocation::new("ADD", "a1b2c3d4e5f6", pod.path()).k8s("default", "nginx");
    let mark = w.api.audit_mark();
    let out = w.calico(&inv, &conf);
    out.assert_ok();
    let r = out.json();
    let ip = ip_of(&r);
    assert!(ip.starts_with("10.65."), "{r}");
    assert_eq!(r["interfaces"][0], json!({"name": "calic440f455693"}));

    // Every request the plugin's ServiceAccount made was allowed by upstream's RBAC.
    let reqs = w.api.plugin_requests_since(mark);
    eprintln!("ADD requests ({}):\n{}", reqs.len(), listing(&reqs));
    assert!(
        reqs.iter().all(accepted),
        "refused or rejected:\n{}",
        listing(&reqs)
    );

    // The pod's status was patched with the addresses and the container ID.
    let patch = reqs
        .iter()
        .find(|q| q.verb == "patch")
        .expect("a pod status patch");
    assert_eq!(patch.path(), "/api/v1/namespaces/default/pods/nginx/status");
    assert_eq!(
        patch.request_object,
        json!({"metadata":{"annotations":{"cni.projectcalico.org/podIP":format!("{ip}/32"),
            "cni.projectcalico.org/podIPs":format!("{ip}/32"),
            "cni.projectcalico.org/containerID":"a1b2c3d4e5f6"}}})
    );
    let p = w.pod_object("default", "nginx");
    assert_eq!(
        p["metadata"]["annotations"]["cni.projectcalico.org/podIP"],
        format!("{ip}/32")
    );

    // The IPAM objects as Calico writes them in the v1 CRDs (kept through the CRDs'
    // structural schemas: a field the schema does not know would have been pruned).
    let handles = w.crs("ipamhandles");
    assert_eq!(handles.len(), 1);
    let h = &handles[0];
    assert_eq!(h["metadata"]["name"], "k8s-pod-network.a1b2c3d4e5f6");
    assert_eq!(h["spec"]["handleID"], "k8s-pod-network.a1b2c3d4e5f6");
    assert_eq!(h["spec"]["deleted"], false);
    let block_cidr = h["spec"]["block"]
        .as_object()
        .unwrap()
        .keys()
        .next()
        .unwrap()
        .clone();
    let blocks = w.crs("ipamblocks");
    assert_eq!(blocks.len(), 1);
    let b = &blocks[0];
    assert_eq!(b["metadata"]["name"], block_cidr.replace(['.', '/'], "-"));
    assert_eq!(
        b["metadata"]["annotations"]["projectcalico.org/metadata"],
        "{\"creationTimestamp\":null}"
    );
    let spec = &b["spec"];
    assert_eq!(spec["cidr"], block_cidr);
    assert_eq!(spec["affinity"], format!("host:{NODE}"));
    assert!(spec["affinityClaimTime"].as_str().unwrap().ends_with('Z'));
    assert_eq!(spec["strictAffinity"], false);
    assert_eq!(spec["deleted"], false);
    assert!(spec.get("affinity_claim_time").is_none());
    assert_eq!(
        spec["attributes"][0]["handle_id"],
        "k8s-pod-network.a1b2c3d4e5f6"
    );
    assert_eq!(spec["attributes"][0]["secondary"]["pod"], "nginx");
    let affs = w.crs("blockaffinities");
    assert_eq!(affs.len(), 1);
    let a = &affs[0];
    assert_eq!(
        a["metadata"]["name"],
        format!("{NODE}-{}", block_cidr.replace(['.', '/'], "-"))
    );
    assert_eq!(
        a["spec"],
        json!({"state":"confirmed","node":NODE,"type":"host","cidr":block_cidr,"deleted":"false"})
    );
    assert_eq!(
        a["metadata"]["labels"]["projectcalico.org/hostname-hash"],
        "7DS2CCNJGGLTHBDQLLFO6SX24SY2YDDEG3W2VN556FA2W4DLLV5A"
    );
    let cfg = w.crs("ipamconfigs");
    assert_eq!(cfg.len(), 1);
    assert_eq!(cfg[0]["spec"]["autoAllocateBlocks"], true);
    assert_eq!(cfg[0]["spec"]["strictAffinity"], false);
    // No Profile is written on the Kubernetes datastore.
    assert!(!reqs.iter().any(|q| q.uri.contains("profiles")));

    // The dataplane is the same as on etcd.
    let routes = w.host_sh("ip route show");
    assert!(
        routes.contains(&format!("{ip} dev calic440f455693 scope link")),
        "{routes}"
    );

    // DEL: the addresses are patched out with the pod's revision and uid as preconditions.
    let mark = w.api.audit_mark();
    let del = inv.as_del();
    w.calico(&del, &conf).assert_ok();
    let reqs = w.api.plugin_requests_since(mark);
    eprintln!("DEL requests ({}):\n{}", reqs.len(), listing(&reqs));
    assert!(
        reqs.iter().all(accepted),
        "refused or rejected:\n{}",
        listing(&reqs)
    );
    let patch = reqs.iter().find(|q| q.verb == "patch").expect("patch-out");
    let body = &patch.request_object;
    assert_eq!(
        body["metadata"]["annotations"]["cni.projectcalico.org/podIP"],
        ""
    );
    assert_eq!(body["metadata"]["uid"], p["metadata"]["uid"]);
    assert!(body["metadata"]["resourceVersion"].is_string());
    w.assert_clean();
    // The container ID annotation is kept; the affine block stays.
    let p = w.pod_object("default", "nginx");
    assert_eq!(
        p["metadata"]["annotations"]["cni.projectcalico.org/containerID"],
        "a1b2c3d4e5f6"
    );
    assert_eq!(w.crs("blockaffinities").len(), 1);
    // DEL again: still success.
    w.calico(&del, &conf).assert_ok();
}

/// FAKE SERVER: TLS handshakes, the HTTP version and a patch's content type are seen only by
/// the test API server (a real server's audit log records none of them).
#[test]
fn kdd_one_http2_connection_per_call() {
    require_root();
    let w = KddWorld::new();
    w.seed_pod("default", "nginx", json!({}));
    let pod = common::netns::Netns::new("pod");
    let conf = w.conf(json!({}));
    let inv = Invocation::new("ADD", "a1b2c3d4e5f6", pod.path()).k8s("default", "nginx");
    for (what, inv) in [("ADD", inv.clone()), ("DEL", inv.as_del())] {
        w.api.clear_requests();
        let before = w.api.handshakes();
        w.calico(&inv, &conf).assert_ok();
        // One TLS connection for the whole call, over HTTP/2.
        assert_eq!(w.api.handshakes() - before, 1, "{what}");
        let reqs = w.api.requests();
        assert!(
            reqs.iter().all(|q| q.version == "HTTP/2.0"),
            "{what}: {reqs:?}"
        );
        let patch = reqs
            .iter()
            .find(|q| q.method == "PATCH")
            .expect("a pod status patch");
        assert_eq!(patch.path, "/api/v1/namespaces/default/pods/nginx/status");
        assert_eq!(patch.content_type, "application/strategic-merge-patch+json");
    }
    w.assert_clean();
}

/// FAKE SERVER: every read is a quorum read (no `resourceVersion=0`: the API server's watch
/// cache is never asked), as upstream's clients read; the pod is read once, the block not at
/// all (taken as this node's last ADD wrote it). A 429 with Retry-After (the API server's
/// flow control) is sent again after that wait, as client-go does.
#[test]
fn kdd_reads_are_quorum_reads_as_upstreams() {
    require_root();
    let w = KddWorld::new();
    let conf = w.conf(json!({}));
    let cached = |q: &common::kube_api::Recorded| {
        q.query
            .split('&')
            .any(|p| p.starts_with("resourceVersion="))
    };
    let pods = [
        common::netns::Netns::new("pod"),
        common::netns::Netns::new("pod"),
    ];
    let pod_path = |name: &str| format!("/api/v1/namespaces/default/pods/{name}");
    w.seed_pod("default", "web-1", json!({}));
    w.seed_pod("default", "web-2", json!({}));
    let first = Invocation::new("ADD", "c0ffee000001", pods[0].path()).k8s("default", "web-1");
    w.calico(&first, &conf).assert_ok();
    w.api.clear_requests();
    let second = Invocation::new("ADD", "c0ffee000002", pods[1].path()).k8s("default", "web-2");
    // The status patch is refused once by flow control.
    let status = format!("{}/status", pod_path("web-2"));
    w.api.fail_one("PATCH", &status, 0, 429);
    let started = std::time::Instant::now();
    w.calico(&second, &conf).assert_ok();
    let reqs = w.api.requests();
    let gets: Vec<_> = reqs.iter().filter(|q| q.method == "GET").collect();
    for q in &gets {
        assert!(
            !cached(q),
            "a read of the watch cache: {} {}?{}",
            q.method,
            q.path,
            q.query
        );
    }
    for wanted in [
        "/blockaffinities",
        "/ippools",
        "/pods/web-2",
        "/namespaces/default",
    ] {
        assert!(
            gets.iter().any(|q| q.path.contains(wanted)),
            "no GET of {wanted}: {gets:?}"
        );
    }
    let pod_reads = gets.iter().filter(|q| q.path == pod_path("web-2")).count();
    assert_eq!(pod_reads, 1, "the pod is read once: {gets:?}");
    assert!(
        !gets.iter().any(|q| q.path.contains("/ipamblocks/")),
        "the block was read: {gets:?}"
    );
    let patches: Vec<u16> = reqs
        .iter()
        .filter(|q| q.method == "PATCH" && q.path == status)
        .map(|q| q.status)
        .collect();
    assert_eq!(patches, [429, 200], "the status patch, retried once");
    assert!(
        started.elapsed() >= std::time::Duration::from_secs(1),
        "the retry waited Retry-After's second"
    );
    assert_eq!(w.api.fail_one_pending(), 0);
    for inv in [first.as_del(), second.as_del()] {
        w.calico(&inv, &conf).assert_ok();
    }
    w.assert_clean();
}

/// FAKE SERVER: with no pool, the ADD fails after one (quorum) list of the pools.
#[test]
fn kdd_no_pool_fails_after_one_list() {
    require_root();
    let w = KddWorld::new();
    for pool in w.api.list(&format!("{CRD}/ippools")) {
        let name = pool["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        w.api.remove(&format!("{CRD}/ippools/{name}"));
    }
    w.seed_pod("default", "web-1", json!({}));
    let conf = w.conf(json!({}));
    let pod = common::netns::Netns::new("pod");
    let inv = Invocation::new("ADD", "c0ffee000001", pod.path()).k8s("default", "web-1");
    w.calico(&inv, &conf).assert_err();
    let lists: Vec<String> = w
        .api
        .requests()
        .iter()
        .filter(|q| q.method == "GET" && q.path == format!("{CRD}/ippools"))
        .map(|q| q.query.clone())
        .collect();
    assert_eq!(lists, [""], "the pool lists");
    w.calico(&inv.as_del(), &conf).assert_ok();
    w.assert_clean();
}

#[test]
fn kdd_del_keeps_a_newer_sandboxs_addresses() {
    require_root();
    let w = real_world!("kdd_del_keeps_a_newer_sandboxs_addresses");
    w.seed_pod("default", "web", json!({}));
    let conf = w.conf(json!({}));
    let pod = common::netns::Netns::new("pod");
    let old = Invocation::new("ADD", "old111111111", pod.path()).k8s("default", "web");
    w.calico(&old, &conf).assert_ok();
    let pod2 = common::netns::Netns::new("pod");
    let new = Invocation::new("ADD", "new222222222", pod2.path()).k8s("default", "web");
    let r = w.calico(&new, &conf);
    r.assert_ok();
    let ip = ip_of(&r.json());
    // The stale sandbox's DEL must not clear the pod's (new) address.
    w.calico(&old.as_del(), &conf).assert_ok();
    let p = w.pod_object("default", "web");
    assert_eq!(
        p["metadata"]["annotations"]["cni.projectcalico.org/podIP"],
        format!("{ip}/32")
    );
    w.calico(&new.as_del(), &conf).assert_ok();
    w.assert_clean();
}

#[test]
fn kdd_pod_annotations() {
    require_root();
    let w = real_world!("kdd_pod_annotations");
    w.seed_pool("other", json!({"cidr":"10.66.0.0/16","ipipMode":"Never","vxlanMode":"Never","blockSize":26,"nodeSelector":"all()"}));
    w.seed_pod(
        "default",
        "fixed",
        json!({"metadata":{"annotations":{"cni.projectcalico.org/ipAddrs":"[\"10.66.0.7\"]",
            "cni.projectcalico.org/hwAddr":"c2:b0:57:49:47:f1"}}}),
    );
    w.seed_pod(
        "default",
        "pooled",
        json!({"metadata":{"annotations":{"cni.projectcalico.org/ipv4pools":"[\"other\"]"}}}),
    );
    w.seed_pod(
        "default",
        "both",
        json!({"metadata":{"annotations":{"cni.projectcalico.org/ipAddrs":"[\"10.66.0.8\"]",
            "cni.projectcalico.org/ipAddrsNoIpam":"[\"10.66.0.9\"]"}}}),
    );
    let conf = w.conf(json!({}));
    let p1 = common::netns::Netns::new("pod");
    let fixed = Invocation::new("ADD", "fixed0000001", p1.path()).k8s("default", "fixed");
    let r = w.calico(&fixed, &conf);
    r.assert_ok();
    assert_eq!(ip_of(&r.json()), "10.66.0.7");
    assert_eq!(r.json()["interfaces"][1]["mac"], "c2:b0:57:49:47:f1");
    // The pair was built before the pod was read; the annotated MAC is on the link itself.
    let link = p1.sh("ip -o link show eth0");
    assert!(link.contains("link/ether c2:b0:57:49:47:f1"), "{link}");
    let p2 = common::netns::Netns::new("pod");
    let pooled = Invocation::new("ADD", "pooled000001", p2.path()).k8s("default", "pooled");
    let r = w.calico(&pooled, &conf);
    r.assert_ok();
    assert!(ip_of(&r.json()).starts_with("10.66."), "{}", r.json());
    let p3 = common::netns::Netns::new("pod");
    let both = Invocation::new("ADD", "both00000001", p3.path()).k8s("default", "both");
    let e = w.calico(&both, &conf).assert_err();
    assert_eq!(
        e["msg"],
        "can't have both annotations: 'ipAddrs' and 'ipAddrsNoIpam' in use at the same time"
    );
    // Refused after the reads: the pair built with them is gone, on both sides.
    assert_eq!(p3.sh("ip -o link show | grep -c eth0 || true").trim(), "0");
    let links = w.host_sh("ip -o link show | grep -c cali || true");
    assert_eq!(links.trim(), "2", "only the two networked pods' veths");
    w.calico(&fixed.as_del(), &conf).assert_ok();
    w.calico(&pooled.as_del(), &conf).assert_ok();
    w.calico(&both.as_del(), &conf).assert_ok();
    w.assert_clean();
}

/// The interface failing after IPAM (here: a host route to the pod's address on another
/// interface): the pod's address annotations, which went out with the block write, are
/// patched out again (as DEL does) before the address is given back; no handle and no veth
/// are left.
#[test]
fn kdd_a_failed_interface_takes_back_the_pod_annotations() {
    require_root();
    let w = real_world!("kdd_a_failed_interface_takes_back_the_pod_annotations");
    w.seed_pod("default", "first", json!({}));
    w.seed_pod("default", "second", json!({}));
    let conf = w.conf(json!({}));
    let p1 = common::netns::Netns::new("pod");
    let first = Invocation::new("ADD", "first0000001", p1.path()).k8s("default", "first");
    let r = w.calico(&first, &conf);
    r.assert_ok();
    // The next address of the affine block is the second pod's; route it elsewhere.
    let ip: std::net::Ipv4Addr = ip_of(&r.json()).parse().unwrap();
    let next = route_conflict::route_next_elsewhere(|c| w.host_sh(c), ip);

    let p2 = common::netns::Netns::new("pod");
    let second = Invocation::new("ADD", "second000001", p2.path()).k8s("default", "second");
    let mark = w.api.audit_mark();
    let e = w.calico(&second, &conf).assert_err();
    route_conflict::assert_route_refused(&e, next);
    let reqs = w.api.plugin_requests_since(mark);
    let patches: Vec<&Value> = reqs
        .iter()
        .filter(|q| q.verb == "patch")
        .map(|q| &q.request_object["metadata"]["annotations"]["cni.projectcalico.org/podIP"])
        .collect();
    assert_eq!(
        patches,
        [&json!(format!("{next}/32")), &json!("")],
        "{}",
        listing(&reqs)
    );
    let pod = w.pod_object("default", "second");
    assert_eq!(
        pod["metadata"]["annotations"]["cni.projectcalico.org/podIP"],
        ""
    );
    let handles: Vec<String> = w
        .crs("ipamhandles")
        .iter()
        .map(|h| {
            h["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    assert_eq!(handles, ["k8s-pod-network.first0000001"]);
    assert_eq!(p2.sh("ip -o link show | grep -c eth0 || true").trim(), "0");
    let links = w.host_sh("ip -o link show | grep -c cali || true");
    assert_eq!(links.trim(), "1", "only the first pod's veth");

    route_conflict::unroute(|c| w.host_sh(c));
    w.calico(&second.as_del(), &conf).assert_ok();
    w.calico(&first.as_del(), &conf).assert_ok();
    w.assert_clean();
}

#[test]
fn kdd_bad_credentials_and_a_frozen_api_server_fail_cleanly() {
    require_root();
    let w = real_world!("kdd_bad_credentials_and_a_frozen_api_server_fail_cleanly");
    w.seed_pod("default", "p", json!({}));
    let pod = common::netns::Netns::new("pod");
    let inv = Invocation::new("ADD", "cid000000001", pod.path()).k8s("default", "p");
    // A wrong token: 401, a clear error, nothing made. The API server closes an HTTP/2
    // connection after answering an unauthenticated request on it, so the requests a call
    // has in flight beside it are refused: each is sent again, and the call always says
    // Unauthorized (an ADD and a DEL, twenty times each).
    let bad = w.api.kubeconfig_with("wrong-token");
    let conf = w.conf(json!({"kubernetes":{"kubeconfig": bad.display().to_string()}}));
    for round in 0..20 {
        for inv in [inv.clone(), inv.as_del()] {
            let out = w.calico(&inv, &conf);
            let e = out.assert_err();
            assert!(
                e["msg"].as_str().unwrap().contains("Unauthorized"),
                "{} {round}: {e}",
                inv.command
            );
            assert!(out.elapsed < Duration::from_secs(10));
        }
    }
    w.assert_clean();
    // A frozen server (SIGSTOP: the connection is accepted, the handshake never answered):
    // the call gives up within its bound.
    let conf = w.conf(json!({}));
    w.api.freeze();
    let out = w.calico(&inv, &conf);
    w.api.thaw();
    out.assert_err();
    assert!(out.elapsed < Duration::from_secs(20), "{:?}", out.elapsed);
    w.assert_clean();
}

/// FAKE SERVER: a request read and never answered (a real server frozen before the call
/// stalls the TLS handshake instead: kdd_bad_credentials_and_a_frozen_api_server_fail_cleanly).
#[test]
fn kdd_a_stalled_answer_fails_cleanly() {
    require_root();
    let w = KddWorld::new();
    w.seed_pod("default", "p", json!({}));
    let pod = common::netns::Netns::new("pod");
    let inv = Invocation::new("ADD", "cid000000001", pod.path()).k8s("default", "p");
    let conf = w.conf(json!({}));
    w.api.set_stall(true);
    let out = w.calico(&inv, &conf);
    out.assert_err();
    assert!(out.elapsed < Duration::from_secs(20), "{:?}", out.elapsed);
    w.api.set_stall(false);
    w.assert_clean();
}

#[test]
fn etcd_with_policy_k8s_reads_the_pod() {
    require_root();
    if let Err(why) = RealK8s::available() {
        return report_skip("etcd_with_policy_k8s_reads_the_pod", &why);
    }
    // The etcd datastore, with the pod's labels, ports and profiles from the API server.
    let w = common::world::World::new();
    let api = RealK8s::start(&w.host);
    api.put(
        "/api/v1/namespaces/prod",
        json!({"apiVersion":"v1","kind":"Namespace","metadata":{"name":"prod"}}),
    );
    api.put(
        "/api/v1/namespaces/prod/serviceaccounts/sa1",
        json!({"apiVersion":"v1","kind":"ServiceAccount","metadata":{"name":"sa1","namespace":"prod"}}),
    );
    api.put(
        "/api/v1/namespaces/prod/pods/web",
        json!({"apiVersion":"v1","kind":"Pod","metadata":{"name":"web","namespace":"prod","labels":{"app":"web"},"generateName":"web-"},
            "spec":{"nodeName":"node1","serviceAccountName":"sa1","containers":[{"name":"c","image":"busybox","ports":[{"name":"http","containerPort":80}]}]}}),
    );
    let conf = w.conf(json!({"policy":{"type":"k8s"},"kubernetes":{"kubeconfig":api.kubeconfig().display().to_string()}}));
    let pod = w.pod();
    let inv = Invocation::new("ADD", "cafe00000001", pod.path()).k8s("prod", "web");
    w.calico(&inv, &conf).assert_ok();
    let wep = w.get(&format!(
        "{}prod/node1-k8s-web-eth0",
        common::world::WEP_PREFIX
    ));
    assert_eq!(wep["metadata"]["generateName"], "web-");
    assert_eq!(
        wep["metadata"]["labels"],
        json!({"app":"web","projectcalico.org/namespace":"prod","projectcalico.org/orchestrator":"k8s",
            "projectcalico.org/serviceaccount":"sa1"})
    );
    assert_eq!(wep["spec"]["profiles"], json!(["kns.prod", "ksa.prod.sa1"]));
    assert_eq!(wep["spec"]["serviceAccountName"], "sa1");
    assert_eq!(
        wep["spec"]["ports"],
        json!([{"name":"http","protocol":"TCP","port":80,"hostPort":0,"hostIP":""}])
    );
    // No Profile is created with policy type k8s.
    assert!(w
        .keys("/calico/resources/v3/projectcalico.org/profiles/")
        .is_empty());
    w.calico(&inv.as_del(), &conf).assert_ok();
    w.assert_clean();
}

#[test]
fn kdd_request_budget_of_an_add_into_an_affine_block() {
    require_root();
    let w = real_world!("kdd_request_budget_of_an_add_into_an_affine_block");
    w.seed_pod("default", "first", json!({}));
    w.seed_pod("default", "second", json!({}));
    // The API group as the installer writes it into the conflist (an empty one costs one
    // request more, the discovery: `kdd_api_group_discovery`).
    let conf = w.conf(json!({"calico_api_group": "crd.projectcalico.org/v1"}));
    let p1 = common::netns::Netns::new("pod");
    let first = Invocation::new("ADD", "first0000001", p1.path()).k8s("default", "first");
    w.calico(&first, &conf).assert_ok();
    let p2 = common::netns::Netns::new("pod");
    let second = Invocation::new("ADD", "second000001", p2.path()).k8s("default", "second");
    let mark = w.api.audit_mark();
    w.calico(&second, &conf).assert_ok();
    // Counted by the real server's audit log, for the plugin's ServiceAccount.
    let reqs = w.api.plugin_requests_since(mark);
    eprintln!(
        "ADD into an affine block ({}):\n{}",
        reqs.len(),
        listing(&reqs)
    );
    // Upstream makes 16 requests, one after another; ours at most 11 (the block taken as
    // the first ADD wrote it, `BlockCopies`, instead of read; the Node read, as upstream's,
    // whatever the pools' selectors).
    assert!(
        reqs.len() <= 11,
        "{} requests:\n{}",
        reqs.len(),
        listing(&reqs)
    );
    assert!(reqs.iter().all(accepted), "{}", listing(&reqs));
    let mark = w.api.audit_mark();
    w.calico(&second.as_del(), &conf).assert_ok();
    let reqs = w.api.plugin_requests_since(mark);
    eprintln!("DEL of that pod ({}):\n{}", reqs.len(), listing(&reqs));
    assert!(
        reqs.len() <= DEL_BUDGET,
        "{} requests:\n{}",
        reqs.len(),
        listing(&reqs)
    );
    assert!(reqs.iter().all(accepted), "{}", listing(&reqs));
    w.calico(&first.as_del(), &conf).assert_ok();
    w.assert_clean();
}

/// Requests of a DEL of a pod whose block stays (today's count on the real server's audit log:
/// reads, the pod status patch, the block update, the handle update and delete).
const DEL_BUDGET: usize = 9;

/// FAKE SERVER: a latency added to every answer (to count sequential round trips) and the
/// TLS handshake count exist only on the test API server.
#[test]
fn kdd_round_trips_of_an_add_into_an_affine_block() {
    require_root();
    let w = KddWorld::new();
    w.seed_pod("default", "first", json!({}));
    w.seed_pod("default", "second", json!({}));
    let conf = w.conf(json!({}));
    let p1 = common::netns::Netns::new("pod");
    let first = Invocation::new("ADD", "first0000001", p1.path()).k8s("default", "first");
    w.calico(&first, &conf).assert_ok();
    let p2 = common::netns::Netns::new("pod");
    let second = Invocation::new("ADD", "second000001", p2.path()).k8s("default", "second");
    let before = w.api.handshakes();
    w.calico(&second, &conf).assert_ok();
    assert_eq!(w.api.handshakes() - before, 1);

    // Sequential round trips: with every answer held back 300 ms, two of them take 0.6 s
    // (three would take 0.9 s): the reads, the block read on the IPAM lock file's hint (the
    // block the previous ADD on this node assigned from) among them; the new handle, the
    // block's update (the block pending in the lock file's journal meanwhile) and the pod's
    // status together.
    w.seed_pod("default", "third", json!({}));
    let p3 = common::netns::Netns::new("pod");
    let third = Invocation::new("ADD", "third0000001", p3.path()).k8s("default", "third");
    w.api.set_latency(Duration::from_millis(300));
    let out = w.calico(&third, &conf);
    w.api.set_latency(Duration::ZERO);
    out.assert_ok();
    eprintln!("ADD with 300 ms per round trip: {:?}", out.elapsed);
    assert!(
        out.elapsed >= Duration::from_millis(600) && out.elapsed < Duration::from_millis(850),
        "{:?}",
        out.elapsed
    );
    let annotated = w.api.get("/api/v1/namespaces/default/pods/third").unwrap();
    assert_eq!(
        annotated["metadata"]["annotations"]["cni.projectcalico.org/podIP"],
        json!(format!("{}/32", ip_of(&out.json())))
    );
    // Its DEL, two: the reads (the pod, the ready gate, both handles and the hinted
    // block), then the endpoint's removal, the block's release and the handle's delete
    // together (the release once the interface is gone, which takes far less than 300 ms).
    w.api.set_latency(Duration::from_millis(300));
    let out = w.calico(&third.as_del(), &conf);
    w.api.set_latency(Duration::ZERO);
    out.assert_ok();
    eprintln!("DEL with 300 ms per round trip: {:?}", out.elapsed);
    assert!(
        out.elapsed >= Duration::from_millis(600) && out.elapsed < Duration::from_millis(850),
        "{:?}",
        out.elapsed
    );
    w.calico(&second.as_del(), &conf).assert_ok();
    w.calico(&first.as_del(), &conf).assert_ok();
    w.assert_clean();
}

/// FAKE SERVER (one request held unanswered while the others go through): an ADD killed
/// (SIGKILL) between its block's update and its handle's create, which it sends together,
/// either way round. The handle without the block over-counts (as upstream's order can
/// leave it); the block without the handle holds the address for a handle that does not
/// exist, and the IPAM lock file records the block as pending for that handle (written
/// before the two were sent). Either way the runtime's DEL releases everything and settles
/// the record. The pod's address annotations go out with them: killed once they landed and
/// before the block did, the pod names an address no block holds for it, and the DEL
/// patches them out as it does any endpoint of its container.
#[test]
fn kdd_add_killed_between_the_block_and_its_handle() {
    require_root();
    let w = KddWorld::new();
    w.seed_pod("default", "first", json!({}));
    let lock = w.scratch.path().join("killed.lock");
    let conf = w.conf(json!({"calico_api_group": "crd.projectcalico.org/v1",
        "ipam_lock_file": lock.display().to_string()}));
    let p1 = common::netns::Netns::new("pod");
    let first = Invocation::new("ADD", "first0000001", p1.path()).k8s("default", "first");
    w.calico(&first, &conf).assert_ok();
    let block = w.crs("ipamblocks")[0]["metadata"]["name"]
        .as_str()
        .unwrap()
        .to_string();
    let block_path = format!("{CRD}/ipamblocks/{block}");
    let handles = format!("{CRD}/ipamhandles");
    let holders = || -> Vec<String> {
        common::cluster::block_allocations(&w.api.get(&block_path).unwrap()["spec"])
            .into_iter()
            .map(|a| a.handle)
            .collect()
    };
    // (the request held, the one waited for before the kill)
    let cases = [
        (
            ("POST", handles.as_str()),
            ("PUT", block_path.as_str(), 200),
        ),
        (
            ("PUT", block_path.as_str()),
            ("POST", handles.as_str(), 201),
        ),
        (("PUT", block_path.as_str()), ("PATCH", "status", 200)),
    ];
    for (i, ((held_method, held_path), (method, path, status))) in cases.into_iter().enumerate() {
        let pod = format!("killed{i}");
        let status_path = format!("/api/v1/namespaces/default/pods/{pod}/status");
        let path = if path == "status" { &status_path } else { path };
        w.seed_pod("default", &pod, json!({}));
        let cid = format!("killed{i:06}");
        let handle = format!("k8s-pod-network.{cid}");
        w.api.fail_one(held_method, held_path, 0, 0);
        w.api.clear_requests();
        let netns = common::netns::Netns::new("pod");
        let inv = Invocation::new("ADD", &cid, netns.path()).k8s("default", &pod);
        let mut child = w.bin.spawn("calico", w.host.name(), &inv, &conf);
        let started = std::time::Instant::now();
        while !w
            .api
            .requests()
            .iter()
            .any(|r| r.method == method && r.path == path && r.status == status)
        {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "case {i}: {method} {path} never landed: {:?}",
                w.api.requests()
            );
            assert!(
                child.try_wait().unwrap().is_none(),
                "case {i}: the ADD ended first"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        // SAFETY: kill(2) on the PID this test spawned, not yet reaped.
        unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
        child.wait().unwrap();
        let stored_handle = w.api.get(&format!("{CRD}/ipamhandles/{handle}"));
        let record = |text: &str| {
            text.lines()
                .any(|l| l.starts_with(&format!("pending {handle} ")))
        };
        let pod_ip = || {
            w.api
                .get(&format!("/api/v1/namespaces/default/pods/{pod}"))
                .unwrap()["metadata"]["annotations"]["cni.projectcalico.org/podIP"]
                .clone()
        };
        match i {
            0 => {
                assert!(holders().contains(&handle), "{:?}", holders());
                assert!(stored_handle.is_none(), "{stored_handle:?}");
                assert!(record(&std::fs::read_to_string(&lock).unwrap()));
            }
            1 => {
                assert!(!holders().contains(&handle), "{:?}", holders());
                assert!(stored_handle.is_some());
            }
            _ => {
                assert!(!holders().contains(&handle), "{:?}", holders());
                assert!(
                    pod_ip().as_str().is_some_and(|ip| !ip.is_empty()),
                    "{}",
                    pod_ip()
                );
                assert!(record(&std::fs::read_to_string(&lock).unwrap()));
            }
        }
        // The runtime's DEL finds the address by the record, or the handle by its name.
        w.calico(&inv.as_del(), &conf).assert_ok();
        assert!(!holders().contains(&handle), "case {i}: {:?}", holders());
        assert!(w.api.get(&format!("{CRD}/ipamhandles/{handle}")).is_none());
        assert!(
            !record(&std::fs::read_to_string(&lock).unwrap()),
            "case {i}"
        );
        assert!(
            pod_ip().as_str().is_none_or(str::is_empty),
            "case {i}: {}",
            pod_ip()
        );
    }
    w.calico(&first.as_del(), &conf).assert_ok();
    w.assert_clean();
}

/// The host's IPAM lock file, held by the test (flock, as the plugin takes it) until dropped.
struct HeldIpamLock {
    _file: std::fs::File,
}

impl HeldIpamLock {
    fn take(path: &std::path::Path) -> HeldIpamLock {
        use std::os::fd::AsRawFd;
        let file = std::fs::File::open(path).unwrap();
        // SAFETY: flock(2) on a descriptor this struct owns.
        assert_eq!(unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) }, 0);
        HeldIpamLock { _file: file }
    }
}

/// Calls queued on the host's IPAM lock: the lock held by the test while the `queued` calls
/// run, until the plugin's requests in the audit log are `ready`, then released; each call
/// must succeed. Returns the plugin's requests from the moment the lock was taken.
fn queued_on_the_ipam_lock(
    w: &RealKddWorld,
    conf: &str,
    lock: &std::path::Path,
    queued: &[Invocation],
    ready: impl Fn(&[Audited]) -> bool,
) -> Vec<Audited> {
    let held = HeldIpamLock::take(lock);
    let mark = w.api.audit_mark();
    let mut calls: Vec<_> = queued
        .iter()
        .map(|inv| w.bin.spawn("calico", w.host.name(), inv, conf))
        .collect();
    let started = std::time::Instant::now();
    loop {
        let reqs = w.api.plugin_requests_since(mark);
        if ready(&reqs) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the queued calls did not make their requests ahead of the lock:\n{}",
            listing(&reqs)
        );
        for call in &mut calls {
            assert!(
                call.try_wait().unwrap().is_none(),
                "a call ended without the lock"
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(held);
    for mut call in calls {
        let status = loop {
            if let Some(status) = call.try_wait().unwrap() {
                break status;
            }
            if started.elapsed() > Duration::from_secs(30) {
                let _ = call.kill();
                let _ = call.wait();
                panic!("a queued call did not end within 30 s");
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        assert!(status.success(), "a queued call failed: {status:?}");
    }
    w.api.plugin_requests_since(mark)
}

/// `n` pods seeded, each with its netns and ADD (not yet run); the conflist with the IPAM
/// lock file at `lock`.
fn lock_test_pods(
    w: &RealKddWorld,
    name: &str,
    n: usize,
) -> (
    String,
    std::path::PathBuf,
    Vec<common::netns::Netns>,
    Vec<Invocation>,
) {
    let lock = w.scratch.path().join(format!("{name}.lock"));
    let conf = w.conf(json!({"calico_api_group": "crd.projectcalico.org/v1",
        "ipam_lock_file": lock.display().to_string()}));
    let netns: Vec<_> = (0..n).map(|_| common::netns::Netns::new("pod")).collect();
    let adds = netns
        .iter()
        .enumerate()
        .map(|(i, ns)| {
            let pod = format!("{name}{i}");
            w.seed_pod("default", &pod, json!({}));
            Invocation::new("ADD", &format!("{name}{i:06}"), ns.path()).k8s("default", &pod)
        })
        .collect();
    (conf, lock, netns, adds)
}

/// The URI of the only block there is.
fn the_block(w: &RealKddWorld) -> String {
    let blocks = w.crs("ipamblocks");
    assert_eq!(blocks.len(), 1, "{blocks:?}");
    let name = blocks[0]["metadata"]["name"].as_str().unwrap();
    format!("/apis/crd.projectcalico.org/v1/ipamblocks/{name}")
}

/// How many of `reqs` are `verb` on `uri` (or below it).
fn count(reqs: &[Audited], verb: &str, uri: &str) -> usize {
    reqs.iter()
        .filter(|q| q.verb == verb && q.uri.starts_with(uri))
        .count()
}

/// The block was updated exactly twice among `reqs`, and neither update was refused.
fn assert_two_block_updates_landed(reqs: &[Audited], block: &str) {
    let updates: Vec<u16> = reqs
        .iter()
        .filter(|q| q.verb == "update" && q.uri.starts_with(block))
        .map(|q| q.code)
        .collect();
    assert_eq!(updates, [200, 200], "{}", listing(reqs));
}

/// Two DELs on one node queued on the host's IPAM lock, each having read its pod's block
/// before taking the lock (in its first round trip): the second takes the block as the
/// first wrote it (`BlockCopies`, the newer revision) instead of its own read, which the
/// first wrote past. No compare-and-swap fails and nothing is read again while the node's
/// other calls wait (in a burst of pod deletions, a third of the DELs did both).
#[test]
fn kdd_dels_queued_on_the_ipam_lock_take_the_block_as_written() {
    require_root();
    let w = real_world!("kdd_dels_queued_on_the_ipam_lock_take_the_block_as_written");
    let (conf, lock, _netns, adds) = lock_test_pods(&w, "queueddel", 3);
    for add in &adds {
        w.calico(add, &conf).assert_ok();
    }
    let block = the_block(&w);
    let dels: Vec<Invocation> = adds[1..].iter().map(Invocation::as_del).collect();
    let reqs = queued_on_the_ipam_lock(&w, &conf, &lock, &dels, |r| count(r, "get", &block) == 2);
    assert_two_block_updates_landed(&reqs, &block);
    assert_eq!(
        count(&reqs, "get", &block),
        2,
        "read again:\n{}",
        listing(&reqs)
    );
    w.calico(&adds[0].as_del(), &conf).assert_ok();
    w.assert_clean();
}

/// Two ADDs on one node queued on the host's IPAM lock: on the Kubernetes datastore each
/// makes all its reads before it has the lock (the lock is held for the writes only), and
/// the second takes the block as the first wrote it: no block read, no failed
/// compare-and-swap, two addresses.
#[test]
fn kdd_adds_queued_on_the_ipam_lock_read_before_it() {
    require_root();
    let w = real_world!("kdd_adds_queued_on_the_ipam_lock_read_before_it");
    let (conf, lock, _netns, adds) = lock_test_pods(&w, "queuedadd", 3);
    w.calico(&adds[0], &conf).assert_ok();
    let block = the_block(&w);
    let reservations = "/apis/crd.projectcalico.org/v1/ipreservations";
    let pools = "/apis/crd.projectcalico.org/v1/ippools";
    let reqs = queued_on_the_ipam_lock(&w, &conf, &lock, &adds[1..], |r| {
        count(r, "list", reservations) == 2 && count(r, "list", pools) == 2
    });
    eprintln!("two ADDs queued on the lock:\n{}", listing(&reqs));
    assert_two_block_updates_landed(&reqs, &block);
    assert_eq!(count(&reqs, "get", &block), 0, "{}", listing(&reqs));
    assert!(reqs.iter().all(accepted), "{}", listing(&reqs));
    let stored = w.api.get(&block).unwrap();
    let held = common::cluster::block_allocations(&stored["spec"]);
    assert_eq!(held.len(), 3, "{held:?}");
    for add in &adds {
        w.calico(&add.as_del(), &conf).assert_ok();
    }
    w.assert_clean();
}

/// `calico -t` in the host netns: (exit code, stdout, time).
fn run_t(w: &RealKddWorld, conf: &str) -> (i32, String, Duration) {
    common::cni::run_flag(&w.bin.plugin("calico"), w.host.name(), "-t", conf)
}

#[test]
fn kdd_connection_test_flag() {
    require_root();
    let w = real_world!("kdd_connection_test_flag");
    let conf = w.conf(json!({}));
    let mark = w.api.audit_mark();
    let (code, out, _) = run_t(&w, &conf);
    assert_eq!((code, out.as_str()), (0, ""));
    // The datastore's ClusterInformation, then the API server's version.
    let reqs = w.api.plugin_requests_since(mark);
    let paths: Vec<&str> = reqs.iter().map(Audited::path).collect();
    assert!(
        paths.contains(&format!("{CRD}/clusterinformations/default").as_str()),
        "{paths:?}"
    );
    assert!(paths.contains(&"/version"), "{paths:?}");
    assert!(reqs.iter().all(|q| q.code == 200), "{}", listing(&reqs));
    // A wrong token fails; a frozen server fails within the 2 s bounds.
    let bad = w.api.kubeconfig_with("nope");
    let (code, out, _) = run_t(
        &w,
        &w.conf(json!({"kubernetes":{"kubeconfig": bad.display().to_string()}})),
    );
    assert_eq!(code, 1, "{out}");
    w.api.freeze();
    let (code, _, took) = run_t(&w, &conf);
    w.api.thaw();
    assert_eq!(code, 1);
    assert!(took < Duration::from_secs(10), "{took:?}");
}

#[test]
fn kdd_needs_policy_type_k8s() {
    require_root();
    // Profiles are derived from namespaces on the Kubernetes datastore and cannot be
    // written: without policy type k8s the ADD fails, with upstream's text, before IPAM.
    let w = real_world!("kdd_needs_policy_type_k8s");
    w.seed_pod("default", "p", json!({}));
    let pod = common::netns::Netns::new("pod");
    let conf = w.conf(json!({"policy": null}));
    let inv = Invocation::new("ADD", "nopolicy0001", pod.path()).k8s("default", "p");
    let e = w.calico(&inv, &conf).assert_err();
    assert_eq!(e["msg"], "Invalid name k8s-pod-network");
    w.assert_clean();
    assert!(w.crs("ipamhandles").is_empty());
}

#[test]
fn kdd_namespace_selector_uses_the_namespaces_labels() {
    require_root();
    let w = real_world!("kdd_namespace_selector_uses_the_namespaces_labels");
    w.seed_pool(
        "default-ipv4-ippool",
        json!({"cidr":"10.65.0.0/16","blockSize":26,"nodeSelector":"all()","namespaceSelector":"!has(env)"}),
    );
    w.seed_pool(
        "prod",
        json!({"cidr":"10.67.0.0/16","blockSize":26,"nodeSelector":"all()","namespaceSelector":"env == 'prod'"}),
    );
    w.seed_namespace("prod", json!({"env":"prod"}), json!({}));
    w.seed_pod("prod", "api", json!({}));
    w.seed_pod("default", "web", json!({}));
    let conf = w.conf(json!({}));
    let p1 = common::netns::Netns::new("pod");
    let api = Invocation::new("ADD", "prodapi00001", p1.path()).k8s("prod", "api");
    let r = w.calico(&api, &conf);
    r.assert_ok();
    assert!(ip_of(&r.json()).starts_with("10.67."), "{}", r.json());
    let p2 = common::netns::Netns::new("pod");
    let web = Invocation::new("ADD", "defweb000001", p2.path()).k8s("default", "web");
    let r = w.calico(&web, &conf);
    r.assert_ok();
    assert!(ip_of(&r.json()).starts_with("10.65."), "{}", r.json());
    w.calico(&api.as_del(), &conf).assert_ok();
    w.calico(&web.as_del(), &conf).assert_ok();
    w.assert_clean();
}

#[test]
fn etcd_with_policy_k8s_annotation_features() {
    require_root();
    if let Err(why) = RealK8s::available() {
        return report_skip("etcd_with_policy_k8s_annotation_features", &why);
    }
    // floatingIPs, allowedSourcePrefixes and ipAddrsNoIpam land in the stored endpoint (etcd),
    // each refused with upstream's text when its feature flag is off or its value is bad.
    let w = common::world::World::new();
    let api = RealK8s::start(&w.host);
    let (path, namespace) = default_namespace();
    api.put(path, namespace);
    let pod = |name: &str, annotations: Value| {
        let (path, pod) = annotated_pod(name, annotations);
        api.put(&path, pod);
    };
    pod(
        "float",
        json!({"cni.projectcalico.org/floatingIPs":"[\"192.0.2.9\"]",
            "cni.projectcalico.org/allowedSourcePrefixes":"[\"10.80.1.2/16\"]"}),
    );
    pod(
        "noipam",
        json!({"cni.projectcalico.org/ipAddrsNoIpam":"[\"10.99.0.5\"]"}),
    );
    pod(
        "badprefix",
        json!({"cni.projectcalico.org/allowedSourcePrefixes":"[\"nope\"]"}),
    );
    let kc = api.kubeconfig().display().to_string();
    let off = w.conf(json!({"policy":{"type":"k8s"},"kubernetes":{"kubeconfig":kc}}));
    let on = w.conf(
        json!({"policy":{"type":"k8s"},"kubernetes":{"kubeconfig":kc},
        "feature_control":{"floating_ips":true,"ip_addrs_no_ipam":true}}),
    );

    let p1 = w.pod();
    let float = Invocation::new("ADD", "float0000001", p1.path()).k8s("default", "float");
    let e = w.calico(&float, &off).assert_err();
    assert_eq!(e["msg"], "requested feature is not enabled: floating_ips");
    w.assert_clean();
    let r = w.calico(&float, &on);
    r.assert_ok();
    let ip = ip_of(&r.json());
    let wep = w.get(&format!(
        "{}default/node1-k8s-float-eth0",
        common::world::WEP_PREFIX
    ));
    assert_eq!(
        wep["spec"]["ipNATs"],
        json!([{"internalIP": ip, "externalIP": "192.0.2.9"}])
    );
    assert_eq!(
        wep["spec"]["allowSpoofedSourcePrefixes"],
        json!(["10.80.0.0/16"])
    );
    w.calico(&float.as_del(), &on).assert_ok();

    let p2 = w.pod();
    let noipam = Invocation::new("ADD", "noipam000001", p2.path()).k8s("default", "noipam");
    let e = w.calico(&noipam, &off).assert_err();
    assert_eq!(
        e["msg"],
        "requested feature is not enabled: ip_addrs_no_ipam"
    );
    let r = w.calico(&noipam, &on);
    r.assert_ok();
    assert_eq!(ip_of(&r.json()), "10.99.0.5");
    // No IPAM record for it.
    assert!(w.keys("/calico/ipam/v2/handle/").is_empty());
    w.calico(&noipam.as_del(), &on).assert_ok();

    let p3 = w.pod();
    let bad = Invocation::new("ADD", "badpfx000001", p3.path()).k8s("default", "badprefix");
    let e = w.calico(&bad, &on).assert_err();
    assert_eq!(
        e["msg"],
        "failed to parse 'nope' as a CIDR: invalid CIDR address: nope"
    );
    w.assert_clean();
}

/// A DEL that the API server fails midway is retried (as kubelet does) until it succeeds,
/// and then no handle and no address is left (a handle `still present` after a successful
/// DEL under load was a bug once). The handle's compare-and-delete goes out beside the
/// block's release: the handle's delete failing on the first attempt and again on the
/// retry, whose release finds the address already given back; and the block's update
/// failing while the handle's delete lands (the address is then found by the IPAM lock
/// file's record).
#[test]
fn kdd_a_del_retried_after_server_errors_leaves_no_handle() {
    require_root();
    let w = KddWorld::new();
    let conf = w.conf(json!({}));
    // (method, the handle's object or else the block's, answers to let through first)
    let cases: [&[(&str, bool, usize)]; 2] = [
        // The handle's DELETE fails; so does the retry's.
        &[("DELETE", true, 0), ("DELETE", true, 0)],
        // The block's update fails (the handle's DELETE beside it lands).
        &[("PUT", false, 0)],
    ];
    for (i, rules) in cases.into_iter().enumerate() {
        let cid = format!("rdel{i}");
        w.seed_pod("default", &cid, json!({}));
        let add = Invocation::new("ADD", &cid, "/dev/null")
            .k8s("default", &cid)
            .via_calico();
        w.ipam(&add, &conf).assert_ok();
        let handle = format!("{CRD}/ipamhandles/k8s-pod-network.{cid}");
        let block = format!(
            "{CRD}/ipamblocks/{}",
            w.crs("ipamblocks")[0]["metadata"]["name"].as_str().unwrap()
        );
        for (method, on_handle, skip) in rules {
            let path = if *on_handle { &handle } else { &block };
            w.api.fail_one(method, path, *skip, 500);
        }
        let mut attempts = Vec::new();
        loop {
            let out = w.ipam(&add.as_del(), &conf);
            let ok = out.code == 0;
            attempts.push(out.stdout);
            if ok {
                break;
            }
            assert!(attempts.len() < 5, "DEL kept failing: {attempts:?}");
        }
        assert_eq!(
            w.api.fail_one_pending(),
            0,
            "case {i}: a fault did not fire"
        );
        assert!(attempts.len() > 1, "case {i}: the first DEL did not fail");
        let left = w.crs("ipamhandles");
        assert!(
            left.is_empty(),
            "case {i}: DEL succeeded after {attempts:?} and left {left:?}"
        );
        w.assert_clean();
    }
}

/// calico-ipam's `IP=` path upgrades this host's block affinities once (v3.32.1
/// `maybeUpgradeIPAM` → `UpgradeHost`): an affinity an older release wrote without labels
/// gets the three labels host lookups select on (so the block is found as this host's
/// again), another node's is left alone, and the marker /var/run/calico/cni/ipam_upgraded
/// (here a scratch directory mounted there, in the call's own mount namespace) makes the
/// next `IP=` ADD skip the upgrade.
#[test]
fn kdd_ip_arg_upgrades_this_hosts_affinities_once() {
    require_root();
    let w = real_world!("kdd_ip_arg_upgrades_this_hosts_affinities_once");
    let old = |node: &str, cidr: &str| {
        let name = format!("{node}-{}", cidr.replace(['.', '/'], "-"));
        w.api.put(
            &format!("{CRD}/blockaffinities/{name}"),
            json!({"apiVersion":"crd.projectcalico.org/v1","kind":"BlockAffinity",
                "metadata":{"name": name},
                "spec":{"state":"confirmed","node":node,"cidr":cidr,"deleted":"false"}}),
        );
        name
    };
    let mine = old(NODE, "10.65.7.0/26");
    let theirs = old("node2", "10.65.9.0/26");
    let marker_dir = common::cni::TempDir::new("ipam-upgraded");
    let in_marker_dir = |inv: Invocation| Invocation {
        prefix: Some(format!(
            "mkdir -p /var/run/calico/cni && mount --bind {} /var/run/calico/cni",
            marker_dir.path().display()
        )),
        ..inv
    };
    let conf = w.conf(json!({}));
    let add = |cid: &str, ip: &str| {
        w.seed_pod("default", &format!("pod-{cid}"), json!({}));
        let inv = Invocation::new("ADD", cid, "/dev/null")
            .k8s("default", &format!("pod-{cid}"))
            .via_calico();
        let args = format!("{};IP={ip}", inv.args);
        let inv = in_marker_dir(inv.with_args(&args));
        let mark = w.api.audit_mark();
        w.ipam(&inv, &conf).assert_ok();
        w.api.plugin_requests_since(mark)
    };
    let affinity = |name: &str| w.api.get(&format!("{CRD}/blockaffinities/{name}")).unwrap();

    let reqs = add("up1", "10.65.7.5");
    eprintln!("first IP= ADD:\n{}", listing(&reqs));
    assert!(reqs.iter().all(accepted), "{}", listing(&reqs));
    let listed = reqs
        .iter()
        .filter(|q| q.verb == "list" && q.path().ends_with("/blockaffinities"))
        .count();
    assert_eq!(listed, 1, "{}", listing(&reqs));
    let labels = &affinity(&mine)["metadata"]["labels"];
    assert_eq!(
        labels["projectcalico.org/affinity-type"], "host",
        "{labels}"
    );
    assert_eq!(labels["projectcalico.org/ip-version"], "4", "{labels}");
    assert_eq!(
        labels["projectcalico.org/hostname-hash"],
        "7DS2CCNJGGLTHBDQLLFO6SX24SY2YDDEG3W2VN556FA2W4DLLV5A"
    );
    assert!(affinity(&theirs)["metadata"].get("labels").is_none());
    assert!(marker_dir.path().join("ipam_upgraded").exists());

    // Once upgraded, never again: no list of the affinities on the next IP= ADD.
    let reqs = add("up2", "10.65.7.6");
    assert!(
        !reqs.iter().any(|q| q.uri.contains("affinity-type")),
        "{}",
        listing(&reqs)
    );
    // And an ADD without IP= finds the labelled block as this host's: its next address,
    // not a new block.
    w.seed_pod("default", "pod-up3", json!({}));
    let inv = Invocation::new("ADD", "up3", "/dev/null")
        .k8s("default", "pod-up3")
        .via_calico();
    let r = w.ipam(&inv, &conf).assert_ok().json();
    assert!(ip_of(&r).starts_with("10.65.7."), "{r}");
}

/// DEL at boot before calico/node has written the nodename file, on the Kubernetes
/// datastore: the node name is unknown, and DEL still removes the interface, releases the
/// handle and clears the pod's addresses (its endpoint, read by namespace and pod); the
/// other pod keeps its own.
#[test]
fn kdd_del_without_the_nodename_file() {
    require_root();
    let w = real_world!("kdd_del_without_the_nodename_file");
    let file = w.scratch.path().join("nodename");
    let conf = w.conf(json!({
        "nodename": null,
        "nodename_file": file.display().to_string(),
        "nodename_file_optional": false,
    }));
    std::fs::write(&file, NODE).expect("write the nodename file");
    let (a, b) = (
        common::netns::Netns::new("pod"),
        common::netns::Netns::new("pod"),
    );
    let old = Invocation::new("ADD", "kddboot1", a.path()).k8s("default", "old");
    let stays = Invocation::new("ADD", "kddboot2", b.path()).k8s("default", "stays");
    for (inv, name) in [(&old, "old"), (&stays, "stays")] {
        w.seed_pod("default", name, json!({}));
        w.calico(inv, &conf).assert_ok();
    }
    std::fs::remove_file(&file).expect("remove the nodename file");
    w.calico(&old.as_del(), &conf).assert_ok_fast();
    assert!(!a.has_link("eth0"));
    let annotations = |pod: &str| w.pod_object("default", pod)["metadata"]["annotations"].clone();
    let ip = &annotations("old")["cni.projectcalico.org/podIP"];
    assert!(ip.is_null() || ip == "", "old still has an address: {ip}");
    assert!(annotations("stays")["cni.projectcalico.org/podIP"].is_string());
    let handles: Vec<Value> = w
        .crs("ipamhandles")
        .into_iter()
        .map(|h| h["spec"]["handleID"].clone())
        .collect();
    assert_eq!(handles, vec![json!("k8s-pod-network.kddboot2")]);
    let log = std::fs::read_to_string(w.scratch.path().join("cni.log")).expect("log file");
    assert!(
        log.contains("the node name is unknown")
            && log.contains("found this container's endpoint without the node name"),
        "{log}"
    );
    let named = w.conf(json!({
        "nodename_file": file.display().to_string(),
        "nodename_file_optional": false,
    }));
    w.calico(&stays.as_del(), &named).assert_ok_fast();
    w.assert_clean();
}

/// `calico_api_group` empty: the plugin asks the API server which group Calico's CRDs are
/// served under (`GET /apis`, once per call, alongside its first requests), as libcalico-go
/// does. On the v1 CRDs every object is written there; then, the v1 CRDs replaced by the
/// `projectcalico.org/v3` ones (the same resources, as a v3-CRD cluster serves them), the
/// same NetConf works there.
#[test]
fn kdd_api_group_discovery() {
    require_root();
    let w = real_world!("kdd_api_group_discovery");
    let conf = w.conf(json!({}));
    let discoveries = |reqs: &[Audited]| {
        reqs.iter()
            .filter(|q| q.verb == "get" && q.path() == "/apis")
            .count()
    };
    w.seed_pod("default", "v1pod", json!({}));
    let p1 = common::netns::Netns::new("pod");
    let inv = Invocation::new("ADD", "v1pod0000001", p1.path()).k8s("default", "v1pod");
    let mark = w.api.audit_mark();
    w.calico(&inv, &conf).assert_ok();
    let reqs = w.api.plugin_requests_since(mark);
    assert_eq!(discoveries(&reqs), 1, "{}", listing(&reqs));
    assert!(reqs.iter().all(accepted), "{}", listing(&reqs));
    assert_eq!(w.crs("ipamblocks").len(), 1);
    let mark = w.api.audit_mark();
    w.calico(&inv.as_del(), &conf).assert_ok();
    let reqs = w.api.plugin_requests_since(mark);
    assert_eq!(discoveries(&reqs), 1, "{}", listing(&reqs));
    w.assert_clean();

    // The v3 CRDs instead of the v1 ones.
    const V3: &str = "/apis/projectcalico.org/v3";
    let crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions";
    let v1_crds: Vec<Value> = w
        .api
        .list(crds)
        .into_iter()
        .filter(|c| c["spec"]["group"] == "crd.projectcalico.org")
        .collect();
    for c in &v1_crds {
        let name = c["metadata"]["name"].as_str().unwrap();
        w.api.remove(&format!("{crds}/{name}"));
        let plural = c["spec"]["names"]["plural"].as_str().unwrap();
        let mut names = c["spec"]["names"].clone();
        if plural == "ipamconfigs" {
            names = json!({"kind":"IPAMConfiguration","listKind":"IPAMConfigurationList",
                "plural":"ipamconfigurations","singular":"ipamconfiguration"});
        }
        let plural = names["plural"].as_str().unwrap().to_string();
        let a = w.api.post(
            crds,
            json!({"apiVersion":"apiextensions.k8s.io/v1","kind":"CustomResourceDefinition",
                "metadata":{"name": format!("{plural}.projectcalico.org")},
                "spec":{"group":"projectcalico.org","scope":"Cluster","names":names,
                    "versions":[{"name":"v3","served":true,"storage":true,
                        "schema":{"openAPIV3Schema":{"type":"object",
                            "x-kubernetes-preserve-unknown-fields":true}}}]}}),
        );
        assert_eq!(a.status, 201, "{a:?}");
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let groups: Vec<String> = w
            .api
            .get("/apis")
            .and_then(|a| a["groups"].as_array().cloned())
            .unwrap_or_default()
            .iter()
            .filter_map(|g| g["name"].as_str().map(String::from))
            .collect();
        let served = w
            .api
            .get(V3)
            .is_some_and(|d| d["resources"].as_array().map_or(0, |r| r.len()) >= v1_crds.len());
        if served && !groups.iter().any(|g| g == "crd.projectcalico.org") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "v3 CRDs not served: {groups:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    w.api.put(
        &format!("{V3}/clusterinformations/default"),
        json!({"apiVersion":"projectcalico.org/v3","kind":"ClusterInformation",
            "metadata":{"name":"default"},
            "spec":{"clusterGUID":"abc","clusterType":"k8s,kdd","calicoVersion":"v3.32.1","datastoreReady":true}}),
    );
    w.api.put(
        &format!("{V3}/ippools/default-ipv4-ippool"),
        json!({"apiVersion":"projectcalico.org/v3","kind":"IPPool",
            "metadata":{"name":"default-ipv4-ippool"},
            "spec":{"cidr":"10.65.0.0/16","ipipMode":"Never","vxlanMode":"Never","natOutgoing":true,
                "blockSize":26,"nodeSelector":"all()"}}),
    );
    w.seed_pod("default", "v3pod", json!({}));
    let p2 = common::netns::Netns::new("pod");
    let inv = Invocation::new("ADD", "v3pod0000001", p2.path()).k8s("default", "v3pod");
    let mark = w.api.audit_mark();
    let r = w.calico(&inv, &conf).assert_ok().json();
    let reqs = w.api.plugin_requests_since(mark);
    eprintln!("ADD on the v3 CRDs ({}):\n{}", reqs.len(), listing(&reqs));
    assert_eq!(discoveries(&reqs), 1, "{}", listing(&reqs));
    assert!(ip_of(&r).starts_with("10.65."), "{r}");
    let blocks = w.api.list(&format!("{V3}/ipamblocks"));
    assert_eq!(blocks.len(), 1);
    assert_eq!(blocks[0]["apiVersion"], "projectcalico.org/v3");
    assert_eq!(w.api.list(&format!("{V3}/ipamhandles")).len(), 1);
    assert_eq!(w.api.list(&format!("{V3}/blockaffinities")).len(), 1);
    assert_eq!(w.api.list(&format!("{V3}/ipamconfigurations")).len(), 1);
    w.calico(&inv.as_del(), &conf).assert_ok();
    assert!(w.api.list(&format!("{V3}/ipamhandles")).is_empty());
}

/// FAKE SERVER: etcd with policy type k8s. While the pod is read from the API server nothing
/// is made: no address is assigned and no interface built before the pod has said where its
/// addresses come from and what its interface is. Then, asking for nothing else, the pod gets an address of the default pool;
/// a pool annotation or `ipAddrs` gets theirs; an `hwAddr` MAC is set on its interface; a
/// refusal, or a route that cannot be added, leaves nothing. Killed while the pod's answer is
/// held back, the runtime's DEL leaves nothing. The test server holds every answer back (a
/// latency a real server cannot be made to add), so what is in etcd and on the links
/// meanwhile can be seen.
#[test]
fn etcd_with_policy_k8s_makes_nothing_while_the_pod_is_read() {
    require_root();
    let w = common::world::World::new();
    w.seed_pool("other", "10.66.0.0/16", 26);
    let api = KubeApi::start_in_netns(&format!("/run/netns/{}", w.host.name()));
    let (path, namespace) = default_namespace();
    api.put(path, namespace);
    let pod = |name: &str, annotations: Value| {
        let (path, pod) = annotated_pod(name, annotations);
        api.put(&path, pod);
    };
    pod("plain", json!({}));
    pod(
        "pooled",
        json!({"cni.projectcalico.org/ipv4pools":"[\"other\"]"}),
    );
    pod(
        "fixed",
        json!({"cni.projectcalico.org/ipAddrs":"[\"10.66.0.7\"]"}),
    );
    pod(
        "bad",
        json!({"cni.projectcalico.org/allowedSourcePrefixes":"[\"nope\"]"}),
    );
    pod("clash", json!({}));
    pod(
        "mac",
        json!({"cni.projectcalico.org/hwAddr":"c2:b0:57:49:47:f2"}),
    );
    pod(
        "badpools",
        json!({"cni.projectcalico.org/ipv4pools":"[not json"}),
    );
    pod("killed", json!({}));
    let kc = api.kubeconfig().display().to_string();
    let conf = w.conf(json!({"policy":{"type":"k8s"},"kubernetes":{"kubeconfig":kc}}));
    let handle = |cid: &str| format!("/calico/ipam/v2/handle/net1.{cid}");
    // Addresses allocated in the default pool's blocks.
    let in_default_pool = || -> usize {
        w.keys("/calico/ipam/v2/assignment/ipv4/block/10.65.")
            .iter()
            .map(|k| {
                w.get(k)["allocations"]
                    .as_array()
                    .map_or(0, |a| a.iter().filter(|x| !x.is_null()).count())
            })
            .sum()
    };
    // Whether the pod has an eth0.
    let has_eth0 = |pod: &common::netns::Netns| {
        pod.sh("ip -o link show | grep -c ' eth0@' || true").trim() == "1"
    };
    // The IPv4 address on the pod's eth0, if the host also has its /32 route to the pod.
    let networked = |pod: &common::netns::Netns| -> Option<String> {
        let addr = pod.sh("ip -4 -o addr show dev eth0 2>/dev/null | awk '{print $4}'");
        let ip = addr.trim().strip_suffix("/32")?.to_string();
        let route = w.host_sh(&format!("ip route show {ip}"));
        route.contains("dev cali").then_some(ip)
    };
    // ADDs `inv` while the API server holds its answers back for 1.5 s: whether `cid`'s
    // handle was ever in etcd, and whether the pod ever had an eth0, while the ADD waited for
    // the pod (polled for a second).
    let add_held_back = |inv: &Invocation, cid: &str, pod: &common::netns::Netns| {
        api.set_latency(Duration::from_millis(1500));
        let (out, assigned, built) = std::thread::scope(|s| {
            let add = s.spawn(|| w.calico(inv, &conf));
            let started = std::time::Instant::now();
            let (mut assigned, mut built) = (false, false);
            while started.elapsed() < Duration::from_secs(1) && !add.is_finished() {
                assigned = assigned || !w.keys(&handle(cid)).is_empty();
                built = built || has_eth0(pod);
                std::thread::sleep(Duration::from_millis(10));
            }
            assigned = assigned || !w.keys(&handle(cid)).is_empty();
            assert!(!add.is_finished(), "the ADD did not wait for the pod");
            (add.join().expect("the ADD's thread"), assigned, built)
        });
        api.set_latency(Duration::ZERO);
        (out, assigned, built)
    };

    // Nothing else asked for: an address of the default pool.
    let p1 = w.pod();
    let plain = Invocation::new("ADD", "plain0000001", p1.path()).k8s("default", "plain");
    let (out, assigned, built) = add_held_back(&plain, "plain0000001", &p1);
    out.assert_ok();
    assert!(!assigned, "an address was assigned before the pod was read");
    assert!(!built, "the interface was built before the pod was read");
    let ip = ip_of(&out.json());
    assert!(ip.starts_with("10.65."), "{}", out.json());
    assert_eq!(networked(&p1).as_deref(), Some(ip.as_str()));
    assert_eq!(in_default_pool(), 1);

    // The interface cannot be finished (the next address is routed elsewhere on the host):
    // it is removed and the address given back; nothing is left.
    let next = route_conflict::route_next_elsewhere(|c| w.host_sh(c), ip.parse().unwrap());
    let p9 = w.pod();
    let clash = Invocation::new("ADD", "clash0000001", p9.path()).k8s("default", "clash");
    let (out, assigned, built) = add_held_back(&clash, "clash0000001", &p9);
    route_conflict::assert_route_refused(&out.assert_err(), next);
    assert!(!assigned && !built);
    assert!(w.keys(&handle("clash0000001")).is_empty());
    assert_eq!(in_default_pool(), 1);
    assert!(!has_eth0(&p9));
    route_conflict::unroute(|c| w.host_sh(c));

    // A pool annotation: the address comes from its pool.
    let p2 = w.pod();
    let pooled = Invocation::new("ADD", "pooled000001", p2.path()).k8s("default", "pooled");
    let (out, assigned, built) = add_held_back(&pooled, "pooled000001", &p2);
    out.assert_ok();
    assert!(!assigned && !built);
    let ip = ip_of(&out.json());
    assert!(ip.starts_with("10.66."), "{}", out.json());
    assert_eq!(in_default_pool(), 1);
    assert_eq!(networked(&p2).as_deref(), Some(ip.as_str()));

    // ipAddrs: the same, but (as upstream, whose result for them has no routes) no host
    // route to the pod.
    let p3 = w.pod();
    let fixed = Invocation::new("ADD", "fixed0000001", p3.path()).k8s("default", "fixed");
    let (out, _, built) = add_held_back(&fixed, "fixed0000001", &p3);
    out.assert_ok();
    assert!(!built);
    assert_eq!(ip_of(&out.json()), "10.66.0.7");
    assert_eq!(in_default_pool(), 1);
    assert_eq!(networked(&p3), None, "no host route for ipAddrs");
    let addr = p3.sh("ip -4 -o addr show dev eth0 | awk '{print $4}'");
    assert_eq!(addr.trim(), "10.66.0.7/32");

    // An hwAddr MAC: set on the pod's interface.
    let p7 = w.pod();
    let mac = Invocation::new("ADD", "mac000000001", p7.path()).k8s("default", "mac");
    let (out, _, built) = add_held_back(&mac, "mac000000001", &p7);
    out.assert_ok();
    assert!(!built);
    let ip = ip_of(&out.json());
    assert_eq!(networked(&p7).as_deref(), Some(ip.as_str()));
    assert_eq!(
        p7.sh("cat /sys/class/net/eth0/address").trim(),
        "c2:b0:57:49:47:f2"
    );
    assert_eq!(in_default_pool(), 2);

    // Refused once the pod is read: nothing is left.
    let p4 = w.pod();
    let bad = Invocation::new("ADD", "bad000000001", p4.path()).k8s("default", "bad");
    let (out, assigned, built) = add_held_back(&bad, "bad000000001", &p4);
    let e = out.assert_err();
    assert_eq!(
        e["msg"],
        "failed to parse 'nope' as a CIDR: invalid CIDR address: nope"
    );
    assert!(!assigned && !built);
    assert_eq!(in_default_pool(), 2);
    assert!(w.keys(&handle("bad000000001")).is_empty());
    assert!(!has_eth0(&p4));
    // A pool annotation that cannot be read: the same.
    let p6 = w.pod();
    let badpools = Invocation::new("ADD", "badpools0001", p6.path()).k8s("default", "badpools");
    let (out, _, built) = add_held_back(&badpools, "badpools0001", &p6);
    out.assert_err();
    assert!(!built);
    assert_eq!(in_default_pool(), 2);
    assert!(w.keys(&handle("badpools0001")).is_empty());
    assert!(!has_eth0(&p6));

    // Killed while the pod's answer is held back (its GET has reached the server): the
    // runtime's DEL leaves nothing (checked below, with the others').
    let p8 = w.pod();
    let killed = Invocation::new("ADD", "killed000001", p8.path()).k8s("default", "killed");
    api.set_latency(Duration::from_secs(3));
    let mut child = w.bin.spawn("calico", w.host.name(), &killed, &conf);
    let started = std::time::Instant::now();
    let pod_asked = || {
        api.requests()
            .iter()
            .any(|r| r.path == "/api/v1/namespaces/default/pods/killed")
    };
    while !pod_asked() {
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "the ADD never asked for the pod"
        );
        assert!(child.try_wait().expect("wait").is_none(), "the ADD ended");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        !has_eth0(&p8),
        "an interface was built before the pod was read"
    );
    // SAFETY: kill(2) on the PID this test spawned, not yet reaped.
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    child.wait().expect("reap the killed ADD");
    api.set_latency(Duration::ZERO);
    assert!(w.keys(&handle("killed000001")).is_empty());

    for inv in [
        &plain, &clash, &pooled, &fixed, &mac, &bad, &badpools, &killed,
    ] {
        w.calico(&inv.as_del(), &conf).assert_ok();
    }
    w.assert_clean();
    assert!(!has_eth0(&p8));
}

/// The `default` namespace, as put on an API server: its path and object.
fn default_namespace() -> (&'static str, Value) {
    (
        "/api/v1/namespaces/default",
        json!({"apiVersion":"v1","kind":"Namespace","metadata":{"name":"default"}}),
    )
}

/// A pod of `default` on node1 with these annotations, as put on an API server: its path and
/// object.
fn annotated_pod(name: &str, annotations: Value) -> (String, Value) {
    (
        format!("/api/v1/namespaces/default/pods/{name}"),
        json!({"apiVersion":"v1","kind":"Pod","metadata":{"name":name,"namespace":"default","annotations":annotations},
            "spec":{"nodeName":"node1","containers":[{"name":"c","image":"busybox"}]}}),
    )
}
