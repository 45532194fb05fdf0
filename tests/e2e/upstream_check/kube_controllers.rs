//! kube-controllers v3.32.1 (its node controller, whose IPAM garbage collection releases
//! what no pod holds) on the Kubernetes datastore, with pods networked by ours and, as the
//! control, by upstream's plugin: a Pod deleted without a CNI DEL has its address, handle
//! and block attribute released after the leak grace period; a deleted Node's addresses
//! and affinity go; the live pods' addresses are never released, also while pods come and
//! go; no address is ever held twice; `calicoctl ipam release` gives back one address by
//! hand. The IPAM state it leaves is the same for both.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{json, Value};

use super::{block_holders, calicoctl_ok, upstream, without_run_identity, Daemon};
use crate::common::cni::{Bin, Invocation};
use crate::common::kdd::{KddWorld, RealKddWorld};
use crate::common::netns::{require_root, Netns};

/// Who holds each allocated address of the world's blocks ([`block_holders`]).
fn holders(w: &RealKddWorld) -> BTreeMap<String, String> {
    let specs: Vec<Value> = w
        .crs("ipamblocks")
        .iter()
        .map(|b| b["spec"].clone())
        .collect();
    block_holders(&specs)
}

/// The IPAM objects, without what differs between runs: times, and the blocks' sequence
/// numbers (which start from the clock) as offsets from the block's.
fn ipam_state(w: &RealKddWorld) -> Value {
    let mut state = serde_json::Map::new();
    for plural in ["ipamblocks", "ipamhandles", "blockaffinities"] {
        let objects: Vec<Value> = w
            .crs(plural)
            .into_iter()
            .map(|o| {
                let mut spec = o["spec"].clone();
                if let Some(claimed) = spec.get_mut("affinityClaimTime") {
                    *claimed = json!("<time>");
                }
                let base = spec["sequenceNumber"].as_i64().unwrap_or_default();
                if let Some(Value::Object(seqs)) = spec.get_mut("sequenceNumberForAllocation") {
                    for v in seqs.values_mut() {
                        *v = json!(v.as_i64().unwrap_or_default() - base);
                    }
                }
                if let Some(seq) = spec.get_mut("sequenceNumber") {
                    *seq = json!("<seq>");
                }
                json!({"name": o["metadata"]["name"], "spec": spec})
            })
            .collect();
        state.insert(plural.into(), without_run_identity(json!(objects)));
    }
    Value::Object(state)
}

/// One run with `bin`'s plugin (`None`: ours): what IPAM holds once the controller has
/// collected the leaks.
fn run(bin: Option<Bin>) -> Value {
    let mut w = KddWorld::real();
    if let Some(bin) = bin {
        w.bin = bin;
    }
    w.api.ensure_namespace("default");
    let admin = w.api.kubeconfig_with(&w.api.admin_token());
    let env = [
        ("DATASTORE_TYPE", "kubernetes".to_string()),
        ("KUBECONFIG", admin.display().to_string()),
    ];
    // Leaks are confirmed after 5 s; the policy-name migration (which waits for a calico-node
    // DaemonSet that no test cluster runs, holding the node controller's syncer) is off.
    let kcc = json!({"apiVersion": "projectcalico.org/v3", "kind": "KubeControllersConfiguration",
        "metadata": {"name": "default"},
        "spec": {"controllers": {
            "node": {"reconcilerPeriod": "1m", "leakGracePeriod": "5s"},
            "policyMigration": {"enabled": "Disabled"}}}});
    let host = w.host.name().to_string();
    calicoctl_ok(&host, &env, &["apply", "-f", "-"], &kcc.to_string());
    w.api.put(
        "/api/v1/nodes/node2",
        json!({"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": "node2", "labels": {"kubernetes.io/hostname": "node2"}}}),
    );

    // live-1, live-2 and leaked on node1; elsewhere on node2.
    let pods = [
        ("live-1", "node1"),
        ("live-2", "node1"),
        ("leaked", "node1"),
        ("elsewhere", "node2"),
    ];
    let mut netns: BTreeMap<&str, Netns> = BTreeMap::new();
    for (i, (pod, node)) in pods.iter().enumerate() {
        w.seed_pod("default", pod, json!({"spec": {"nodeName": node}}));
        let ns = Netns::new("pod");
        let inv = Invocation::new("ADD", &format!("kc{i}"), ns.path()).k8s("default", pod);
        w.calico(&inv, &w.conf(json!({"nodename": node})))
            .assert_ok();
        netns.insert(pod, ns);
    }
    // calicoctl releases one pod's address by hand, as an operator cleaning a leak would.
    let released = Netns::new("pod");
    let inv = Invocation::new("ADD", "kc4", released.path()).k8s("default", "released");
    w.seed_pod("default", "released", json!({}));
    let out = w.calico(&inv, &w.conf(json!({})));
    out.assert_ok();
    let address = out.json()["ips"][0]["address"]
        .as_str()
        .and_then(|a| a.split('/').next())
        .expect("an address")
        .to_string();
    let said = calicoctl_ok(
        &host,
        &env,
        &["ipam", "release", &format!("--ip={address}")],
        "",
    );
    assert!(
        said.contains(&format!("Successfully released IP address {address}")),
        "{said}"
    );
    assert!(!holders(&w).contains_key(&address), "{address} is released");
    w.api.remove("/api/v1/namespaces/default/pods/released");
    drop(released);

    let live: BTreeMap<String, String> = holders(&w)
        .into_iter()
        .filter(|(_, h)| h.ends_with(".kc0") || h.ends_with(".kc1"))
        .collect();
    assert_eq!(live.len(), 2, "{live:?}");

    let controllers = Daemon::spawn(
        &w.host,
        &[
            upstream("kube-controllers").to_str().expect("a path"),
            "-status-file",
            w.scratch
                .path()
                .join("status.json")
                .to_str()
                .expect("a path"),
        ],
        &[
            env[0].clone(),
            env[1].clone(),
            ("ENABLED_CONTROLLERS", "node".into()),
            ("LOG_LEVEL", "info".into()),
        ],
        &w.scratch.path().join("kube-controllers.log"),
    );
    // The leaked pod's object goes without a DEL; node2 goes with its pod.
    w.api.remove("/api/v1/namespaces/default/pods/leaked");
    w.api.remove("/api/v1/namespaces/default/pods/elsewhere");
    w.api.remove("/api/v1/nodes/node2");
    // Meanwhile pods come and go on node1: no address is handed out twice, and the live
    // pods keep theirs.
    for i in 10..16 {
        let pod = format!("churn-{i}");
        w.seed_pod("default", &pod, json!({}));
        let ns = Netns::new("pod");
        let inv = Invocation::new("ADD", &format!("kc{i}"), ns.path()).k8s("default", &pod);
        let conf = w.conf(json!({}));
        w.calico(&inv, &conf).assert_ok();
        let held = holders(&w);
        assert!(live.iter().all(|(a, h)| held.get(a) == Some(h)), "{held:?}");
        w.calico(&inv.as_del(), &conf).assert_ok();
        w.api
            .remove(&format!("/api/v1/namespaces/default/pods/{pod}"));
    }
    controllers.wait_for("the leaks to be collected", Duration::from_secs(90), || {
        let held = holders(&w);
        let affinities = w.crs("blockaffinities");
        held.values()
            .all(|h| !h.ends_with(".kc2") && !h.ends_with(".kc3"))
            && affinities.iter().all(|a| a["spec"]["node"] != "node2")
    });
    // Two more grace periods: the live pods' addresses stay.
    std::thread::sleep(Duration::from_secs(12));
    assert_eq!(holders(&w), live, "only the live pods' addresses are held");
    let handles = w.crs("ipamhandles");
    assert_eq!(handles.len(), 2, "only the live pods' handles: {handles:?}");
    let state = ipam_state(&w);
    drop(controllers);

    for (i, pod) in ["live-1", "live-2"].iter().enumerate() {
        let ns = &netns[pod];
        let inv = Invocation::new("DEL", &format!("kc{i}"), ns.path()).k8s("default", pod);
        w.calico(&inv, &w.conf(json!({}))).assert_ok();
    }
    // The leaked pods' interfaces go with their namespaces.
    netns.clear();
    let check = calicoctl_ok(&host, &env, &["ipam", "check"], "");
    assert!(check.contains("found 0 problems"), "{check}");
    w.assert_clean();
    state
}

#[test]
#[ignore = "needs upstream's binaries: make upstream-check"]
fn kube_controllers_collects_our_leaks_as_upstreams() {
    require_root();
    let control = run(Some(Bin::with_calico(&upstream("calico"))));
    let ours = run(None);
    assert_eq!(
        ours, control,
        "the IPAM state after garbage collection: ours (left) and upstream's"
    );
    eprintln!("kube-controllers: the same IPAM state after collecting both runs' leaks");
}
