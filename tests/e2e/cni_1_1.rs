//! CNI 1.1 verbs end to end, on both datastores, invoked as a CNI 1.1 runtime invokes them:
//! CHECK with the previous result as `prevResult` (and one test per kind of drift it must
//! name), STATUS and GC with CNI_PATH set and no container, netns or interface
//! (`cni.dev/valid-attachments` on GC's stdin).
//! The Kubernetes-datastore half runs on the real kube-apiserver (common/real_k8s.rs).

use std::time::{Duration, Instant};

use crate::common;
use crate::common::cluster::Cluster;
use crate::common::cni::{with_prev_result, Invocation, Outcome};
use crate::common::kdd::RealKddWorld;
use crate::common::netns::{require_root, Netns};
use crate::common::world::{merge, World};
use crate::on_both_backends;
use serde_json::{json, Value};

on_both_backends!(
    check_passes_after_add_and_fails_after_del,
    check_detects_deleted_host_route,
    check_detects_changed_host_mac,
    check_detects_removed_pod_address,
    check_detects_removed_pod_default_route,
    check_detects_missing_endpoint,
    check_detects_missing_handle,
    status_reports_readiness,
    gc_releases_exactly_the_stale_attachments,
);

/// A networked pod: its netns, its ADD invocation, the config and the ADD result.
struct Added {
    pod: Netns,
    inv: Invocation,
    conf: String,
    result: Value,
}

fn add_pod(c: &impl Cluster, cid: &str, name: &str) -> Added {
    let pod = c.pod();
    c.prepare_pod("default", name);
    let conf = c.conf(json!({"cniVersion": "1.1.0"}));
    let inv = Invocation::new("ADD", cid, pod.path()).k8s("default", name);
    let result = c.calico(&inv, &conf).assert_ok().json();
    assert_eq!(result["cniVersion"], "1.1.0");
    Added {
        pod,
        inv,
        conf,
        result,
    }
}

/// CHECK as libcni sends it: the config with the cached result as `prevResult`.
fn check(c: &impl Cluster, a: &Added) -> Outcome {
    c.calico(&a.inv.as_check(), &with_prev_result(&a.conf, &a.result))
}

fn ip_of(result: &Value) -> String {
    let addr = result["ips"][0]["address"].as_str().expect("an address");
    addr.split('/').next().unwrap().to_string()
}

fn host_veth(a: &Added) -> String {
    a.result["interfaces"][0]["name"]
        .as_str()
        .unwrap()
        .to_string()
}

/// ADD, drift, CHECK: the error names the drift; DEL (and, where DEL alone cannot, GC)
/// still cleans up.
fn drift(c: &impl Cluster, name: &str, make_drift: impl FnOnce(&Added), expect: &str) {
    let a = add_pod(c, &format!("{name}-cid"), name);
    assert_eq!(check(c, &a).assert_ok().stdout, "");
    make_drift(&a);
    let err = check(c, &a).assert_err();
    assert_eq!(err["code"], 999, "{err}");
    let msg = err["msg"].as_str().unwrap();
    assert!(
        msg.contains(expect),
        "{}: {msg:?} lacks {expect:?}",
        c.backend()
    );
    eprintln!("{}: drift reported as {msg:?}", c.backend());
    c.calico(&a.inv.as_del(), &a.conf).assert_ok();
    // Without its handle object DEL cannot find the address (upstream leaks it until
    // kube-controllers notices); GC releases it by address.
    let mut gc_conf: Value = serde_json::from_str(&a.conf).unwrap();
    gc_conf["cni.dev/valid-attachments"] = json!([]);
    c.calico(&runtime_call("GC"), &gc_conf.to_string())
        .assert_ok();
    c.assert_clean();
}

fn check_passes_after_add_and_fails_after_del(c: &impl Cluster) {
    let a = add_pod(c, "chk1", "chk");
    let out = check(c, &a);
    assert_eq!((out.code, out.stdout.as_str()), (0, ""), "{}", out.stderr);
    // The spec's gates: CHECK needs a 0.4.0+ config, and a previous result.
    let mut old: Value = serde_json::from_str(&a.conf).unwrap();
    old["cniVersion"] = json!("0.3.1");
    old["prevResult"] = a.result.clone();
    let inv = a.inv.as_check();
    let err = c.calico(&inv, &old.to_string()).assert_err();
    assert_eq!(
        (err["code"].clone(), err["msg"].clone()),
        (json!(1), json!("config version does not allow CHECK"))
    );
    let err = c.calico(&inv, &a.conf).assert_err();
    assert_eq!(err["msg"], "Required prevResult missing");
    // An older result version is read in the config's version, as libcni does.
    let mut v040 = a.result.clone();
    v040["cniVersion"] = json!("0.4.0");
    let mut conf040: Value = serde_json::from_str(&a.conf).unwrap();
    merge(
        &mut conf040,
        json!({"cniVersion": "0.4.0", "prevResult": v040}),
    );
    let ips = conf040["prevResult"]["ips"].as_array_mut().unwrap();
    for ip in ips {
        ip["version"] = json!("4");
    }
    assert_eq!(c.calico(&inv, &conf040.to_string()).assert_ok().stdout, "");
    // After DEL nothing matches any more.
    c.calico(&a.inv.as_del(), &a.conf).assert_ok();
    let err = check(c, &a).assert_err();
    assert!(err["msg"].as_str().unwrap().starts_with("CHECK: "), "{err}");
    c.assert_clean();
}

fn check_detects_deleted_host_route(c: &impl Cluster) {
    drift(
        c,
        "route",
        |a| {
            let ip = ip_of(&a.result);
            c.host_sh(&format!("ip route del {ip}/32 dev {}", host_veth(a)));
        },
        "/32 dev cali",
    );
}

fn check_detects_changed_host_mac(c: &impl Cluster) {
    drift(
        c,
        "mac",
        |a| {
            c.host_sh(&format!(
                "ip link set {} address ee:ee:ee:ee:ee:01",
                host_veth(a)
            ));
        },
        "has MAC ee:ee:ee:ee:ee:01, not ee:ee:ee:ee:ee:ee",
    );
}

fn check_detects_removed_pod_address(c: &impl Cluster) {
    drift(
        c,
        "addr",
        |a| {
            let ip = ip_of(&a.result);
            a.pod
                .ip(&["addr", "del", &format!("{ip}/32"), "dev", "eth0"]);
        },
        "lacks address",
    );
}

fn check_detects_removed_pod_default_route(c: &impl Cluster) {
    drift(
        c,
        "defroute",
        |a| {
            a.pod.ip(&["route", "del", "default"]);
        },
        "container route 0.0.0.0/0 via 169.254.1.1 dev eth0 is missing",
    );
}

fn check_detects_missing_endpoint(c: &impl Cluster) {
    drift(
        c,
        "nowep",
        |_| c.remove_endpoint("default", "nowep"),
        "WorkloadEndpoint default/node1-k8s-nowep-eth0 does not exist",
    );
}

fn check_detects_missing_handle(c: &impl Cluster) {
    drift(
        c,
        "nohandle",
        |_| c.remove_handle(&c.handle("nohandle-cid")),
        &format!("IPAM handle {} does not exist", c.handle("nohandle-cid")),
    );
}

/// STATUS or GC as a CNI 1.1 runtime runs it: no container, netns or interface.
fn runtime_call(command: &str) -> Invocation {
    Invocation {
        command: command.into(),
        unset: vec![
            "CNI_CONTAINERID".into(),
            "CNI_NETNS".into(),
            "CNI_IFNAME".into(),
            "CNI_ARGS".into(),
        ],
        ..Default::default()
    }
}

fn status_reports_readiness(c: &impl Cluster) {
    let conf = c.conf(json!({"cniVersion": "1.1.0"}));
    let status = runtime_call("STATUS");
    for plugin_ok in [c.calico(&status, &conf), c.ipam(&status, &conf)] {
        assert_eq!(
            (plugin_ok.code, plugin_ok.stdout.as_str()),
            (0, ""),
            "{}",
            plugin_ok.stderr
        );
    }
    // Not ready (an upgrade in progress): code 50 with the reason, from both plugins.
    c.set_ready(false);
    for out in [c.calico(&status, &conf), c.ipam(&status, &conf)] {
        let err = out.assert_err();
        assert_eq!(err["code"], 50, "{err}");
        assert!(
            err["msg"]
                .as_str()
                .unwrap()
                .contains("Calico is currently not ready to process requests"),
            "{err}"
        );
    }
    c.set_ready(true);
    // Unreachable: code 50 within the 2 s bound (plus the process's own start).
    let mut down: Value = serde_json::from_str(&c.unreachable_conf()).unwrap();
    down["cniVersion"] = json!("1.1.0");
    let started = Instant::now();
    let err = c.calico(&status, &down.to_string()).assert_err();
    assert_eq!(err["code"], 50, "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
    // A pre-1.1 config cannot ask for STATUS.
    let err = c.calico(&status, &c.conf(json!({}))).assert_err();
    assert_eq!(err["msg"], "config version does not allow STATUS");
    // STATUS is forwarded to the IPAM plugin: Debian's host-local (spec 1.0.0) refuses a
    // 1.1.0 config (its ADD would too), so STATUS failing is the truth.
    let hl = c.conf(json!({"cniVersion": "1.1.0", "ipam": {"type": "host-local",
        "subnet": "10.77.0.0/24", "dataDir": c.scratch().join("hl").display().to_string()}}));
    let err = c.calico(&status, &hl).assert_err();
    assert_ne!(err["code"], 50, "{err}");
    eprintln!("{}: host-local's answer to STATUS: {err}", c.backend());
}

fn gc_releases_exactly_the_stale_attachments(c: &impl Cluster) {
    // 20 pods of this network on this node.
    let pods: Vec<Added> = (0..20)
        .map(|i| add_pod(c, &format!("gc{i:02}"), &format!("gcpod{i:02}")))
        .collect();
    // Another network's addresses, another node's, and a tunnel address survive GC.
    let conf2 = c.conf(json!({"cniVersion": "1.1.0", "name": "net2"}));
    let other_net = Invocation::new("ADD", "othernet", "/dev/null")
        .k8s("default", "gcpod00")
        .via_calico();
    c.ipam(&other_net, &conf2).assert_ok();
    c.seed_other_node("node2");
    let conf_node2 = c.conf(json!({"cniVersion": "1.1.0", "nodename": "node2"}));
    let other_node = Invocation::new("ADD", "othernode", "/dev/null")
        .k8s("default", "gcpod01")
        .via_calico();
    c.ipam(&other_node, &conf_node2).assert_ok();
    let tunnel = c.seed_tunnel_address("node1");
    // KubeVirt VMs' persistent addresses as upstream's calico-ipam writes them: the handle
    // `<network>.vmi.<namespace>.<vm>`, owned on this node (one running here; one being
    // migrated here, its alternate owner on this node), never among a runtime's attachments.
    let vms = seed_vm_addresses(c);
    let before = c.allocated();
    assert_eq!(before.len(), 23 + vms.len(), "{before:?}");

    // The runtime still knows 12 of the 20 attachments.
    let valid: Vec<Value> = (0..12)
        .map(|i| json!({"containerID": format!("gc{i:02}"), "ifname": "eth0"}))
        .collect();
    let mut gc_conf: Value = serde_json::from_str(&pods[0].conf).unwrap();
    gc_conf["cni.dev/valid-attachments"] = json!(valid);
    let gc = runtime_call("GC");
    let out = c.calico(&gc, &gc_conf.to_string());
    assert_eq!((out.code, out.stdout.as_str()), (0, ""), "{}", out.stderr);

    let after = c.allocated();
    let released: Vec<_> = before.iter().filter(|a| !after.contains(a)).collect();
    let mut released_handles: Vec<String> = released.iter().map(|a| a.handle.clone()).collect();
    released_handles.sort();
    let want: Vec<String> = (12..20).map(|i| c.handle(&format!("gc{i:02}"))).collect();
    assert_eq!(released_handles, want);
    let handles = c.handles();
    for h in &want {
        assert!(!handles.contains(h), "{h} survived GC");
    }
    for keep in (0..12)
        .map(|i| c.handle(&format!("gc{i:02}")))
        .chain([
            "net2.othernet".to_string(),
            c.handle("othernode"),
            tunnel.clone(),
        ])
        .chain(vms.iter().cloned())
    {
        assert!(handles.contains(&keep), "{keep} was collected: {handles:?}");
    }
    // On etcd the endpoints of the 8 are gone too; the 12 keep theirs. (On the Kubernetes
    // datastore the pods are the endpoints and belong to the API server.)
    for i in 0..20 {
        let ips = c.endpoint_ips("default", &format!("gcpod{i:02}"));
        if i < 12 || c.backend() == "kdd" {
            assert!(ips.is_some(), "gcpod{i:02} lost its endpoint");
        } else {
            assert!(ips.is_none(), "gcpod{i:02} kept its endpoint");
        }
    }
    // GC again: nothing more to do. Without the list, GC refuses rather than guess.
    c.calico(&gc, &gc_conf.to_string()).assert_ok();
    assert_eq!(c.allocated(), after);
    let err = c.calico(&gc, &pods[0].conf).assert_err();
    assert_eq!(err["code"], 7, "{err}");
    assert_eq!(c.allocated(), after);

    // The valid pods' DELs, the collected ones' DELs (idempotent), then the rest by hand.
    for a in &pods {
        c.calico(&a.inv.as_del(), &a.conf).assert_ok();
    }
    c.ipam(&other_net.as_del(), &conf2).assert_ok();
    c.ipam(&other_node.as_del(), &conf_node2).assert_ok();
    let left: Vec<String> = c.allocated().into_iter().map(|a| a.handle).collect();
    let mut want_left = vms.clone();
    want_left.push(tunnel);
    want_left.sort();
    let mut left_sorted = left.clone();
    left_sorted.sort();
    assert_eq!(left_sorted, want_left);
}

/// Seeds KubeVirt VM addresses as v3.32.1's calico-ipam stores them; returns their handles.
fn seed_vm_addresses(c: &impl Cluster) -> Vec<String> {
    let running = c.handle("vmi.default.vm-running");
    c.seed_allocation(
        &running,
        json!({"handle_id": running, "secondary": {
            "node": "node1", "namespace": "default", "pod": "virt-launcher-vm-running-x7k2q",
            "timestamp": "2026-11-26 10:00:00.000000001 +0000 UTC",
            "vmi-name": "vm-running", "vmi-uid": "6a7c1f6e-0000-4000-8000-000000000001",
            "vm-uid": "6a7c1f6e-0000-4000-8000-000000000002"}}),
    );
    let migrating = c.handle("vmi.default.vm-migrating");
    c.seed_allocation(
        &migrating,
        json!({"handle_id": migrating,
            "secondary": {
                "node": "node2", "namespace": "default", "pod": "virt-launcher-vm-migrating-a",
                "vmi-name": "vm-migrating", "vmi-uid": "6a7c1f6e-0000-4000-8000-000000000003"},
            "alternateOwnerAttrs": {
                "node": "node1", "namespace": "default", "pod": "virt-launcher-vm-migrating-b",
                "vmi-name": "vm-migrating", "vmi-uid": "6a7c1f6e-0000-4000-8000-000000000003",
                "vmim-uid": "6a7c1f6e-0000-4000-8000-000000000004"}}),
    );
    vec![running, migrating]
}

/// STATUS is polled by the runtime every few seconds: with etcd frozen (SIGSTOP: the
/// connection opens, nothing answers) it still answers within its 2 s bound, code 50.
#[test]
fn status_with_etcd_frozen_answers_within_its_bound() {
    require_root();
    let w = World::new();
    let conf = w.conf(json!({"cniVersion": "1.1.0"}));
    let status = runtime_call("STATUS");
    w.calico(&status, &conf).assert_ok();
    let pid = w.etcd.pid() as i32;
    // SAFETY: signals to the etcd child this test started.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let outs = [w.calico(&status, &conf), w.ipam(&status, &conf)];
    unsafe { libc::kill(pid, libc::SIGCONT) };
    for out in outs {
        let err = out.assert_err();
        assert_eq!(err["code"], 50, "{err}");
        assert!(
            out.elapsed < Duration::from_secs(3),
            "STATUS took {:?}",
            out.elapsed
        );
        eprintln!("frozen etcd: STATUS answered {err} after {:?}", out.elapsed);
    }
    w.calico(&status, &conf).assert_ok();
}

/// With host-local, CHECK is also host-local's own CHECK (its allocation on disk).
#[test]
fn check_with_host_local_runs_its_check() {
    require_root();
    let w = World::new();
    let data = w.scratch.path().join("hl");
    let conf = w.conf(
        json!({"ipam": {"type": "host-local", "subnet": "10.66.0.0/24",
        "dataDir": data.display().to_string()}}),
    );
    let pod = w.pod();
    let inv = Invocation::new("ADD", "hlcheck", pod.path()).k8s("default", "hl");
    let result = w.calico(&inv, &conf).assert_ok().json();
    let check_conf = with_prev_result(&conf, &result);
    let check = inv.as_check();
    assert_eq!(w.calico(&check, &check_conf).assert_ok().stdout, "");
    // host-local forgets the address: its CHECK (and so ours) fails.
    let ip = ip_of(&result);
    std::fs::remove_file(data.join("net1").join(&ip)).expect("host-local's record");
    let err = w.calico(&check, &check_conf).assert_err();
    eprintln!("host-local drift: {err}");
    w.calico(&inv.as_del(), &conf).assert_ok();
}

/// CHECK of a plain-CNI (not Kubernetes) workload: its endpoint name and default routes.
#[test]
fn check_in_cni_mode() {
    require_root();
    let w = World::new();
    let conf = w.conf(json!({"cniVersion": "1.1.0"}));
    let pod = w.pod();
    let inv = Invocation::new("ADD", "cnimode1", pod.path());
    let result = w.calico(&inv, &conf).assert_ok().json();
    let check_conf = with_prev_result(&conf, &result);
    let check = inv.as_check();
    assert_eq!(w.calico(&check, &check_conf).assert_ok().stdout, "");
    for key in w.keys(common::world::WEP_PREFIX) {
        w.etcd.etcdctl(&["del", &key]);
    }
    let err = w.calico(&check, &check_conf).assert_err();
    assert!(
        err["msg"].as_str().unwrap().contains("does not exist"),
        "{err}"
    );
    w.calico(&inv.as_del(), &conf).assert_ok();
    w.assert_clean();
}
