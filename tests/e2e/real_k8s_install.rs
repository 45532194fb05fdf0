//! The node installer against the real kube-apiserver (tests/common/real_k8s.rs), as the
//! DaemonSet's `install-cni` container runs it: the pod's service-account mount holds the
//! `calico-node` token (upstream's RBAC lets it create tokens for `calico-cni-plugin` only),
//! the installer asks TokenRequest for the CNI plugin's token and writes
//! `calico-kubeconfig` with it and the mounted CA; the installed plugin then sets up a pod
//! with the installed conflist and kubeconfig. The image's own `install` under podman is in
//! tests/e2e/image.rs.

use std::fs;
use std::os::unix::fs::PermissionsExt;

use serde_json::{json, Value};

use crate::common;
use crate::common::cni::{run_command_within, run_plugin, Invocation};
use crate::common::installer::{cluster, token_for, Node, NODE, NODE_SA_USER};
use crate::common::netns::Netns;
use crate::common::real_k8s::{RealK8s, PLUGIN_USER};

/// The pod's service-account mount: `token`, `ca.crt`, `namespace`.
fn mount_service_account(node: &Node, k: &RealK8s, token: &str) {
    let sa = node.path("serviceaccount");
    fs::create_dir_all(&sa).unwrap();
    fs::write(sa.join("token"), token).unwrap();
    fs::write(sa.join("ca.crt"), k.ca_pem()).unwrap();
    fs::write(sa.join("namespace"), "kube-system").unwrap();
}

fn kubeconfig_token(text: &str) -> String {
    text.lines()
        .find_map(|l| l.trim().strip_prefix("token: "))
        .expect("a token line")
        .to_string()
}

#[test]
fn install_writes_a_kubeconfig_with_the_cni_plugins_own_token() {
    let Some((host, k)) = cluster("install_writes_a_kubeconfig_with_the_cni_plugins_own_token")
    else {
        return;
    };
    let node = Node::new();
    let node_token = token_for(&k, "calico-node");
    mount_service_account(&node, &k, &node_token);
    let port = k.port().to_string();
    let mark = k.audit_mark();
    let out = run_command_within(
        node.command_in(
            host.name(),
            &[
                ("KUBERNETES_SERVICE_HOST", "127.0.0.1"),
                ("KUBERNETES_SERVICE_PORT", &port),
                ("KUBERNETES_NODE_NAME", NODE),
                (
                    "CNI_NET_DIR",
                    &node.path("host/etc/cni/net.d").display().to_string(),
                ),
                ("LOG_FILE_PATH", &node.path("cni.log").display().to_string()),
            ],
        ),
        "",
        std::time::Duration::from_secs(120),
        "install",
    );
    assert_eq!(out.code, 0, "{}", out.stderr);
    // One request from the installer: the TokenRequest, as calico-node.
    let reqs = k.client_requests_since(mark);
    let by_node: Vec<_> = reqs.iter().filter(|r| r.user == NODE_SA_USER).collect();
    assert_eq!(by_node.len(), 1, "{reqs:?}");
    assert_eq!(by_node[0].verb, "create");
    assert!(by_node[0]
        .path()
        .ends_with("/serviceaccounts/calico-cni-plugin/token"));

    let net = node.path("host/etc/cni/net.d");
    let kc_path = net.join("calico-kubeconfig");
    assert_eq!(
        fs::metadata(&kc_path).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let kc = fs::read_to_string(&kc_path).unwrap();
    assert!(
        kc.contains(&format!("    server: https://127.0.0.1:{port}\n")),
        "{kc}"
    );
    assert!(kc.contains("certificate-authority-data: "), "{kc}");
    let token = kubeconfig_token(&kc);
    assert_ne!(
        token, node_token,
        "the CNI plugin's own token, not the pod's"
    );

    // The installed plugin, with the installed conflist and kubeconfig, sets up a pod; every
    // request it makes is the CNI plugin's user.
    let conf: Value =
        serde_json::from_str(&fs::read_to_string(net.join("10-calico.conflist")).unwrap()).unwrap();
    let mut calico = conf["plugins"][0].clone();
    calico["name"] = conf["name"].clone();
    calico["cniVersion"] = conf["cniVersion"].clone();
    // No calico/node runs here to write /var/lib/calico/nodename.
    calico["nodename_file_optional"] = json!(true);
    let calico = calico.to_string();
    let pod_ns = Netns::new("instpod");
    k.put(
        "/api/v1/namespaces/default/pods/p1",
        json!({"apiVersion":"v1","kind":"Pod","metadata":{"name":"p1","namespace":"default"},
            "spec":{"nodeName":NODE,"containers":[{"name":"c","image":"busybox"}]}}),
    );
    let bin = node.path("host/opt/cni/bin");
    let inv = Invocation::new("ADD", "cid-install-1", pod_ns.path()).k8s("default", "p1");
    let mark = k.audit_mark();
    let add = run_in_host(&host, &bin, &inv, &calico);
    assert_eq!(add.code, 0, "ADD: {}{}", add.stdout, add.stderr);
    let ip = add.json()["ips"][0]["address"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(ip.starts_with("10.77."), "{ip}");
    // Every client's request but the harness's own (the admin's audit markers).
    let reqs: Vec<_> = k
        .client_requests_since(mark)
        .into_iter()
        .filter(|r| r.user != "admin")
        .collect();
    assert!(!reqs.is_empty());
    assert!(reqs.iter().all(|r| r.user == PLUGIN_USER), "{reqs:?}");
    let pod = k.get("/api/v1/namespaces/default/pods/p1").unwrap();
    assert_eq!(
        pod["metadata"]["annotations"]["cni.projectcalico.org/podIP"],
        ip.as_str()
    );
    let del = run_in_host(&host, &bin, &inv.as_del(), &calico);
    assert_eq!(del.code, 0, "DEL: {}{}", del.stdout, del.stderr);
}

fn run_in_host(
    host: &Netns,
    bin: &std::path::Path,
    inv: &Invocation,
    conf: &str,
) -> common::cni::Outcome {
    let cni_path = bin.display().to_string();
    run_plugin(&bin.join("calico"), &cni_path, Some(host.name()), inv, conf)
}

#[test]
fn install_without_the_right_to_a_cni_token_writes_nothing() {
    let Some((host, k)) = cluster("install_without_the_right_to_a_cni_token_writes_nothing") else {
        return;
    };
    let node = Node::new();
    // The namespace's default ServiceAccount may not create the CNI plugin's token.
    let a = k.post(
        "/api/v1/namespaces/kube-system/serviceaccounts",
        json!({"apiVersion":"v1","kind":"ServiceAccount","metadata":{"name":"nobody","namespace":"kube-system"}}),
    );
    assert!(a.status == 201 || a.status == 409, "{a:?}");
    mount_service_account(&node, &k, &token_for(&k, "nobody"));
    let before = node.host_snapshot();
    let port = k.port().to_string();
    let out = run_command_within(
        node.command_in(
            host.name(),
            &[
                ("KUBERNETES_SERVICE_HOST", "127.0.0.1"),
                ("KUBERNETES_SERVICE_PORT", &port),
            ],
        ),
        "",
        std::time::Duration::from_secs(120),
        "install",
    );
    assert_eq!(out.code, 1, "{}", out.stderr);
    assert!(
        out.stderr
            .contains("unable to create token for CNI kubeconfig"),
        "{}",
        out.stderr
    );
    assert!(out.stderr.contains("403"), "{}", out.stderr);
    assert_eq!(node.host_snapshot(), before, "nothing written");
    // SKIP_TLS_VERIFY with a token that may: the kubeconfig skips verification instead of
    // carrying the CA.
    mount_service_account(&node, &k, &token_for(&k, "calico-node"));
    let out = run_command_within(
        node.command_in(
            host.name(),
            &[
                ("KUBERNETES_SERVICE_HOST", "127.0.0.1"),
                ("KUBERNETES_SERVICE_PORT", &port),
                ("SKIP_TLS_VERIFY", "true"),
            ],
        ),
        "",
        std::time::Duration::from_secs(120),
        "install",
    );
    assert_eq!(out.code, 0, "{}", out.stderr);
    let kc = fs::read_to_string(node.path("host/etc/cni/net.d/calico-kubeconfig")).unwrap();
    assert!(kc.contains("    insecure-skip-tls-verify: true\n"), "{kc}");
    assert!(!kc.contains("certificate-authority-data"), "{kc}");
}
