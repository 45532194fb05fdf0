//! The real kube-apiserver harness itself (tests/common/real_k8s.rs): it starts, the plugin's
//! token is the plugin's, its RBAC is upstream's, the audit log counts its requests, and
//! freezing holds its answers back.

mod common;

use std::time::{Duration, Instant};

use common::cni::report_skip;
use common::netns::{require_root, Netns};
use common::real_k8s::{RealK8s, PLUGIN_USER};
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
