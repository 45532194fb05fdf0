//! The Kubernetes client's client-side rate limit (`qps`, `burst`, `K8S_CLIENT_QPS`,
//! `K8S_CLIENT_BURST`), as upstream's client-go token buckets: a DEL against the test API
//! server, whose requests to one API group are spaced by 1/qps once the burst is spent, and
//! whose wait is refused at once when it would end past the call's deadline.

use std::collections::BTreeMap;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::common::cni::TempDir;
use crate::common::kube_api::KubeApi;
use serde_json::{json, Value};

/// A DEL of a pod that was never added, on the Kubernetes datastore at `api`, with `extra`
/// in the NetConf and `env` in the environment: its output and how long it took.
fn del(api: &KubeApi, bin: &TempDir, extra: Value, env: &[(&str, &str)]) -> (Output, Duration) {
    let mut conf = json!({
        "name": "k8s-pod-network", "cniVersion": "0.3.1", "type": "calico",
        "datastore_type": "kubernetes", "nodename": "node1",
        "kubernetes": {"kubeconfig": api.kubeconfig().display().to_string()},
        "policy": {"type": "k8s"}, "ipam": {"type": "calico-ipam"}, "log_level": "debug",
    });
    if let (Some(c), Some(e)) = (conf.as_object_mut(), extra.as_object()) {
        c.extend(e.clone());
    }
    let mut cmd = Command::new(bin.path().join("calico"));
    cmd.env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("CNI_COMMAND", "DEL")
        .env("CNI_CONTAINERID", "ratelimit0123456789")
        .env("CNI_NETNS", "/nonexistent/netns")
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", bin.path())
        .env(
            "CNI_ARGS",
            "K8S_POD_NAMESPACE=default;K8S_POD_NAME=p;K8S_POD_INFRA_CONTAINER_ID=ratelimit0123456789",
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let started = Instant::now();
    let mut child = cmd.spawn().expect("run calico");
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().expect("stdin");
        stdin
            .write_all(conf.to_string().as_bytes())
            .expect("write the NetConf");
    }
    let out = child.wait_with_output().expect("wait for calico");
    (out, started.elapsed())
}

/// A directory with `calico` and `calico-ipam` (so IPAM runs in-process, as on a node).
fn plugins() -> TempDir {
    let dir = TempDir::new("ratelimit-bin");
    for name in ["calico", "calico-ipam"] {
        std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_calico"), dir.path().join(name)).unwrap();
    }
    dir
}

/// The requests the server saw, counted per API group and version (client-go's REST
/// client, and so its bucket).
fn per_group(api: &KubeApi) -> BTreeMap<String, usize> {
    let mut n = BTreeMap::new();
    for r in api.requests() {
        let key = calico_cni::datastore::kubernetes::ratelimit::group_version(&r.path);
        *n.entry(key.to_string()).or_insert(0) += 1;
    }
    n
}

#[test]
fn a_tiny_qps_spaces_a_calls_requests_within_its_deadline() {
    let api = KubeApi::start();
    api.put(
        "/apis/crd.projectcalico.org/v1/clusterinformations/default",
        json!({"apiVersion":"crd.projectcalico.org/v1","kind":"ClusterInformation",
            "metadata":{"name":"default"},
            "spec":{"clusterGUID":"abc","clusterType":"k8s,kdd","calicoVersion":"v3.32.1","datastoreReady":true}}),
    );
    let bin = plugins();

    // Upstream's defaults (5 a second, burst 100): nothing waits.
    let (out, fast) = del(&api, &bin, json!({}), &[]);
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let counts = per_group(&api);
    let most = counts.values().copied().max().unwrap_or(0);
    assert!(
        most >= 2,
        "a DEL makes more than one request to a group: {counts:?}"
    );
    assert!(fast < Duration::from_millis(900), "took {fast:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("client-side throttling"), "{stderr}");

    // qps 1, burst 1 in the NetConf: each group's requests after its first wait a second.
    api.clear_requests();
    let (out, slow) = del(&api, &bin, json!({"qps": 1, "burst": 1}), &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(per_group(&api), counts, "the same requests");
    let floor = Duration::from_secs((most - 1) as u64);
    assert!(
        slow >= floor.saturating_sub(Duration::from_millis(50))
            && slow < floor + Duration::from_secs(3),
        "{counts:?}: took {slow:?}, expected about {floor:?}"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("client-side throttling"), "{stderr}");

    // The environment's K8S_CLIENT_* are read as upstream's apiconfig reads them: a token
    // every 5 s, with a 2 s deadline, is refused at once rather than waited for.
    api.clear_requests();
    let (out, refused) = del(
        &api,
        &bin,
        json!({"call_timeout_seconds": 2}),
        &[("CALICO_K8S_CLIENT_QPS", "0.2"), ("K8S_CLIENT_BURST", "1")],
    );
    assert!(!out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stdout.contains("waiting for the client-side rate limit")
            || stderr.contains("waiting for the client-side rate limit"),
        "{stdout}\n{stderr}"
    );
    assert!(refused < Duration::from_millis(1500), "took {refused:?}");

    // A value envconfig cannot convert fails the call, as upstream's.
    let (out, _) = del(&api, &bin, json!({}), &[("K8S_CLIENT_QPS", "fast")]);
    assert!(!out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("converting 'fast' to type float32"),
        "{stdout}"
    );
}
