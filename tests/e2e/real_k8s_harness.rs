//! The real kube-apiserver harness itself (tests/common/real_k8s.rs): it starts, the plugin's
//! token is the plugin's, its RBAC is upstream's, the audit log counts its requests, and
//! freezing holds its answers back.

use std::time::{Duration, Instant};

use crate::common::cni::report_skip;
use crate::common::netns::{require_root, Netns};
use crate::common::real_k8s::{RealK8s, PLUGIN_USER};
use serde_json::json;

#[test]
fn real_apiserver_starts_with_calico_installed() {
    require_root();
    if let Err(why) = RealK8s::available() {
        report_skip("real_apiserver_starts_with_calico_installed", &why);
        return;
    }
    let host = Netns::new("k8shost");
    let k = RealK8s::start(&host);
    eprintln!("start-up: {:?}", k.startup());
    assert!(k.get("/apis/crd.projectcalico.org/v1/ippools").is_some());
    // The plugin's token is its ServiceAccount's, bound by upstream's RBAC: it may get a
    // pod's namespace but not list pods or write a Node.
    let mark = k.audit_mark();
    let kc = k.kubeconfig();
    assert!(std::fs::read_to_string(&kc)
        .unwrap()
        .contains(&k.plugin_token()));
    let pod_list = host.exec(
        "curl",
        &[
            "-sk",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "-H",
            &format!("Authorization: Bearer {}", k.plugin_token()),
            &format!("{}/api/v1/pods", k.url()),
        ],
    );
    assert_eq!(String::from_utf8_lossy(&pod_list.stdout), "403");
    let reqs = k.plugin_requests_since(mark);
    assert_eq!(reqs.len(), 1, "{reqs:?}");
    assert_eq!((reqs[0].verb.as_str(), reqs[0].code), ("list", 403));
    assert_eq!(reqs[0].user, PLUGIN_USER);
    // The check of what the server refused of the plugin sees it.
    let bad = k.plugin_nonconformance();
    assert_eq!(bad.len(), 1, "{bad:?}");
    assert!(bad[0].starts_with("list /api/v1/pods -> 403"), "{bad:?}");
    // Freezing holds every answer back until the thaw.
    k.put("/api/v1/namespaces/default", json!({"apiVersion":"v1","kind":"Namespace","metadata":{"name":"default","labels":{"a":"b"}}}));
    k.freeze();
    let t = Instant::now();
    let out = host.exec("curl", &["-sk", "-m", "1", &format!("{}/readyz", k.url())]);
    assert!(!out.status.success());
    assert!(t.elapsed() >= Duration::from_secs(1));
    k.thaw();
    assert_eq!(
        k.get("/api/v1/namespaces/default").unwrap()["metadata"]["labels"]["a"],
        "b"
    );
}

/// BENCH, not a test (`make bench`, benches/bench.py): the real kube-apiserver with Calico
/// installed, in the bench's host netns (`BENCH_KUBE_API_NETNS`, a name; it is the bench's
/// to delete), seeded as a node would find it: ClusterInformation ready, Nodes `bench-node` (and
/// `bench-node-before`, `bench-node-upstream`, `bench-node-control`),
/// the default IPPool (10.244.0.0/16, blocks of /26) and pods `pod-0`..`pod-<BENCH_PODS>` and
/// `pod-dbg` scheduled on the node. Writes into `BENCH_KUBE_API_DIR`: `kubeconfig` (the
/// plugin's own ServiceAccount token, as Calico's install writes it), `audit` (the audit
/// log's path: every request, per user, with its times) and `ready`; stops (everything by
/// PID) once `stop` appears there.
#[test]
#[ignore]
fn serve_for_bench() {
    let netns = std::env::var("BENCH_KUBE_API_NETNS").expect("BENCH_KUBE_API_NETNS");
    let dir =
        std::path::PathBuf::from(std::env::var("BENCH_KUBE_API_DIR").expect("BENCH_KUBE_API_DIR"));
    let pods: usize = std::env::var("BENCH_PODS")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(100);
    let host = Netns::existing(&netns);
    let k = RealK8s::start(&host);
    let crd = "/apis/crd.projectcalico.org/v1";
    k.put(
        &format!("{crd}/clusterinformations/default"),
        json!({"apiVersion":"crd.projectcalico.org/v1","kind":"ClusterInformation","metadata":{"name":"default"},
            "spec":{"clusterType":"k8s,kdd","calicoVersion":"v3.32.1","datastoreReady":true}}),
    );
    // The other nodes: where the bench runs another binary's calls (their own blocks), upstream's
    // and the same-build control's.
    for node in [
        "bench-node",
        "bench-node-before",
        "bench-node-upstream",
        "bench-node-control",
    ] {
        k.put(
            &format!("/api/v1/nodes/{node}"),
            json!({"apiVersion":"v1","kind":"Node","metadata":{"name":node,"labels":{"kubernetes.io/hostname":node}},"spec":{}}),
        );
    }
    k.put(
        &format!("{crd}/ippools/default-ipv4-ippool"),
        json!({"apiVersion":"crd.projectcalico.org/v1","kind":"IPPool","metadata":{"name":"default-ipv4-ippool"},
            "spec":{"cidr":"10.244.0.0/16","blockSize":26,"nodeSelector":"all()","ipipMode":"Never","vxlanMode":"Never"}}),
    );
    k.ensure_namespace("default");
    let names = (0..pods)
        .map(|i| format!("pod-{i}"))
        .chain(["pod-dbg".to_string()]);
    for name in names {
        let a = k.post(
            "/api/v1/namespaces/default/pods",
            json!({"apiVersion":"v1","kind":"Pod","metadata":{"name":name,"namespace":"default","labels":{"app":"bench"}},
                "spec":{"nodeName":"bench-node","automountServiceAccountToken":false,
                    "containers":[{"name":"c","image":"busybox","ports":[{"name":"http","containerPort":8080,"protocol":"TCP"}]}]}}),
        );
        assert_eq!(a.status, 201, "pod {name}: {a:?}");
    }
    std::fs::copy(k.kubeconfig(), dir.join("kubeconfig")).expect("write the kubeconfig");
    std::fs::write(dir.join("audit"), k.audit_log().display().to_string()).expect("write audit");
    std::fs::write(dir.join("ready"), "").expect("write ready");
    while !dir.join("stop").exists() {
        std::thread::sleep(Duration::from_millis(50));
    }
}
