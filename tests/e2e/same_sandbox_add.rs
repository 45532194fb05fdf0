//! Two ADDs of the same sandbox at once (a runtime retrying while its first ADD still runs).
//! Whatever ADD reports success, the pod must have exactly that result: the
//! interface and its address in the pod netns, the host route, the WorkloadEndpoint and the
//! allocation under the container's handle. The other ADD either fails cleanly (a CNI error,
//! leaving nothing of its own and none of the winner's work undone) or reports the very same
//! result. Both orchestrator modes on etcd, the k8s mode on the Kubernetes datastore too (its
//! endpoint is the pod, which the later write would silently win), several rounds each.

use std::net::Ipv4Addr;
use std::path::Path;
use std::sync::{mpsc, Arc, Barrier};
use std::time::Duration;

use crate::common::cluster::{Allocation, Cluster};
use crate::common::cni::{Invocation, Outcome};
use crate::common::kdd::KddWorld;
use crate::common::netns::{require_root, Netns};
use crate::common::world::{World, WEP_PREFIX};
use serde_json::{json, Value};

const ROUNDS: usize = 6;
/// How long the first ADD is kept in its call (k8s mode) at most, waiting for the second.
const HOLD: Duration = Duration::from_secs(20);

/// Runs two copies of `inv` at once (released together by a barrier). With `hold`, the ADDs
/// wait for the endpoint's policy (`policy_setup_timeout_seconds`) and the status file that
/// ends the wait is written only once one of them has returned (or after `HOLD`): the first
/// ADD is then still running while the second one works, whatever the scheduling.
fn at_once(
    w: &(impl Cluster + Sync),
    inv: &Invocation,
    conf: &str,
    hold: Option<&Path>,
) -> Vec<Outcome> {
    let start = Arc::new(Barrier::new(2));
    let (tx, rx) = mpsc::channel();
    std::thread::scope(|s| {
        for _ in 0..2 {
            let (start, tx) = (start.clone(), tx.clone());
            s.spawn(move || {
                start.wait();
                let _ = tx.send(w.calico(inv, conf));
            });
        }
        let mut outs = Vec::new();
        if let Some(status_file) = hold {
            if let Ok(first) = rx.recv_timeout(HOLD) {
                outs.push(first);
            }
            std::fs::write(status_file, "").expect("write the endpoint status file");
        }
        while outs.len() < 2 {
            outs.push(rx.recv().expect("ADD thread"));
        }
        outs
    })
}

/// The single IPv4 address of a result.
fn ip_of(result: &Value) -> Ipv4Addr {
    let ips = result["ips"].as_array().expect("ips");
    assert_eq!(ips.len(), 1, "one address expected: {result}");
    let addr = ips[0]["address"].as_str().expect("address");
    addr.trim_end_matches("/32").parse().expect("an IPv4 /32")
}

/// The pod, the host, the endpoint and IPAM are exactly what `result` says, and nothing more
/// (`pod_name`: the pod `default/<pod_name>`).
fn assert_pod_has(
    w: &impl Cluster,
    pod: &Netns,
    pod_name: Option<&str>,
    cid: &str,
    result: &Value,
) {
    let ip = ip_of(result);
    let host_veth = result["interfaces"][0]["name"].as_str().expect("host veth");
    let mac = result["interfaces"][1]["mac"].as_str().expect("mac");

    // The pod netns: eth0 with that MAC and that address only.
    assert!(pod.has_link("eth0"), "the pod has no eth0; result {result}");
    let link = pod.ip(&["-o", "link", "show", "eth0"]);
    assert!(link.contains(mac), "eth0 is not {mac}: {link}");
    let addrs = pod.ip(&["-o", "-4", "addr", "show", "dev", "eth0"]);
    let inet: Vec<&str> = addrs
        .lines()
        .filter_map(|l| l.split_whitespace().skip_while(|t| *t != "inet").nth(1))
        .collect();
    assert_eq!(inet, vec![format!("{ip}/32")], "eth0's addresses: {addrs}");

    // The host: one cali veth, the route to the pod through it.
    let links = w.host_sh("ip -o link show | grep -o 'cali[0-9a-z]*' | sort -u");
    assert_eq!(links.trim(), host_veth, "host veths: {links}");
    let routes = w.host_sh("ip route show");
    assert!(
        routes.contains(&format!("{ip} dev {host_veth}")),
        "no host route to {ip} via {host_veth}: {routes}"
    );
    let pool_routes = routes.lines().filter(|l| l.starts_with("10.65.")).count();
    assert_eq!(pool_routes, 1, "host routes into the pool: {routes}");

    // The endpoint (the WorkloadEndpoint; the pod's annotations on the Kubernetes datastore);
    // a cni-mode endpoint is no pod's (`assert_wep_names`).
    if let Some(pod_name) = pod_name {
        assert_endpoint(w, pod_name, cid, ip);
    }

    // IPAM: the container's handle, holding this one address; nothing else is allocated.
    let handle = w.handle(cid);
    assert_eq!(w.handles(), vec![handle.clone()], "handles");
    assert_eq!(
        w.allocated(),
        vec![Allocation {
            ip: ip.into(),
            handle
        }],
        "allocations"
    );
}

/// Pod `default/<pod_name>`'s endpoint has this container and this address only.
fn assert_endpoint(w: &impl Cluster, pod_name: &str, cid: &str, ip: Ipv4Addr) {
    assert_eq!(
        w.endpoint_ips("default", pod_name),
        Some(vec![format!("{ip}/32")]),
        "the endpoint's addresses"
    );
    assert_eq!(
        w.endpoint_container_id("default", pod_name).as_deref(),
        Some(cid),
        "the endpoint's container"
    );
}

/// etcd: the WorkloadEndpoint also names the host veth and the pod's MAC of `result`, and
/// the handle counts one address.
fn assert_wep_names(w: &World, result: &Value) {
    for key in w.keys("/calico/ipam/v2/handle/") {
        let handle = w.get(&key);
        let held: u64 = handle["block"]
            .as_object()
            .expect("handle blocks")
            .values()
            .filter_map(Value::as_u64)
            .sum();
        assert_eq!(held, 1, "the handle holds {held} addresses: {handle}");
    }
    let weps = w.keys(WEP_PREFIX);
    assert_eq!(weps.len(), 1, "endpoints: {weps:?}");
    let wep = w.get(&weps[0]);
    let ip = ip_of(result);
    assert_eq!(
        wep["spec"]["ipNetworks"],
        json!([format!("{ip}/32")]),
        "{wep}"
    );
    assert_eq!(wep["spec"]["mac"], result["interfaces"][1]["mac"], "{wep}");
    assert_eq!(
        wep["spec"]["interfaceName"], result["interfaces"][0]["name"],
        "{wep}"
    );
}

/// One round: two ADDs of `inv` at once, then the checks (`extra` for the backend's own),
/// then DEL and nothing left.
fn round<C: Cluster + Sync>(
    w: &C,
    inv: &Invocation,
    pod: &Netns,
    conf: &str,
    hold: Option<&Path>,
    extra: &dyn Fn(&C, &Value),
) -> (usize, usize) {
    let outs = at_once(w, inv, conf, hold);
    let mut ok = Vec::new();
    let mut failed = 0;
    for out in &outs {
        if out.code == 0 {
            ok.push(out.json());
        } else {
            // A clean failure: a CNI error object.
            let err = out.assert_err();
            eprintln!("the other ADD failed: {err}");
            failed += 1;
        }
    }
    assert!(
        !ok.is_empty(),
        "neither ADD succeeded: {:?}",
        outs.iter().map(|o| &o.stdout).collect::<Vec<_>>()
    );
    for r in &ok[1..] {
        assert_eq!(r["ips"], ok[0]["ips"], "two successes, two results");
        assert_eq!(
            r["interfaces"], ok[0]["interfaces"],
            "two successes, two results"
        );
    }
    let pod_name = pod_of(inv);
    assert_pod_has(w, pod, pod_name, &inv.container_id, &ok[0]);
    extra(w, &ok[0]);

    w.calico(&inv.as_del(), conf).assert_ok();
    w.assert_clean();
    assert!(!pod.has_link("eth0"));
    (ok.len(), failed)
}

/// The pod an invocation names (`K8S_POD_NAME`); none in cni mode.
fn pod_of(inv: &Invocation) -> Option<&str> {
    inv.args
        .split(';')
        .find_map(|kv| kv.strip_prefix("K8S_POD_NAME="))
}

/// `ROUNDS` rounds of two ADDs at once; in k8s mode each first ADD is held in its call
/// until the second has returned (see `at_once`).
fn rounds<C: Cluster + Sync>(w: &C, k8s: bool, extra: &dyn Fn(&C, &Value)) {
    let status_dir = w.scratch().join("endpoint-status");
    std::fs::create_dir_all(&status_dir).expect("status dir");
    let conf = w.conf(json!({
        "policy_setup_timeout_seconds": 60,
        "endpoint_status_dir": status_dir.display().to_string(),
    }));
    let (mut oks, mut fails) = (0, 0);
    for i in 0..ROUNDS {
        let pod = w.pod();
        let cid = format!("same{}{i}", if k8s { "k" } else { "c" });
        let mut inv = Invocation::new("ADD", &cid, pod.path());
        let mut hold = None;
        if k8s {
            w.prepare_pod("default", &cid);
            inv = inv.k8s("default", &cid);
            hold = Some(status_dir.join(format!("k8s default%2F{cid} eth0")));
        }
        let (o, f) = round(w, &inv, &pod, &conf, hold.as_deref(), extra);
        oks += o;
        fails += f;
    }
    eprintln!(
        "{} k8s={k8s}: {oks} successes, {fails} clean failures in {ROUNDS} rounds",
        w.backend()
    );
}

/// k8s mode: a second ADD that ran after the first would re-network the pod (upstream's
/// re-ADD), so the first ADD is held in its call while the second runs.
#[test]
fn two_adds_of_one_sandbox_k8s() {
    require_root();
    rounds(&World::new(), true, &assert_wep_names);
}

/// The same on the Kubernetes datastore.
#[test]
fn kdd_two_adds_of_one_sandbox_k8s() {
    require_root();
    rounds(&KddWorld::new(), true, &|_, _| {});
}

/// cni mode: a second ADD after the first reports the endpoint's result (upstream's re-ADD),
/// so any interleaving must end with one result.
#[test]
fn two_adds_of_one_sandbox_cni() {
    require_root();
    rounds(&World::new(), false, &assert_wep_names);
}
