//! critest, the CRI conformance suite of cri-tools (v1.34, a peer `make deps` builds), run
//! against containerd 2 whose CNI is ours: the node's CNI bin and conf dirs set up by our
//! image's `install` as the calico-node DaemonSet runs it (calico chained with portmap, the
//! v3.30+ manifests' chain), on a real kube-apiserver v1.35 (the Kubernetes datastore).
//!
//! Focused on what the network plugin answers for: the Networking specs (DNS config,
//! hostname, port mapping with the container port only and with a host port) and the
//! PodSandbox specs (run, stop, remove, safe and unsafe sysctls). Each spec's result is
//! printed; every one must pass and none may be skipped.
//!
//! What stands in for a cluster, and why:
//! * critest pulls its images (`registry.k8s.io/e2e-test-images/busybox:1.29-2`, `nginx:1.14-2`)
//!   and nothing outside this machine can be reached: a registry on the node's loopback
//!   (Debian's docker-registry) serves stand-ins built from Debian's static busybox
//!   (`--registry-prefix`); the nginx stand-in is busybox's httpd on port 80.
//! * critest's sandboxes have no Pod in the API server (no kubelet made them), and Calico's
//!   plugin with `policy.type: k8s` reads the pod as upstream's does: a wrapper in front of
//!   `calico` creates the namespace and Pod a kubelet would have had, then execs the plugin.
//!   critest's sandbox names are mixed case, which no Pod's name may be: the wrapper passes
//!   the lowercased name (the Pod's) in CNI_ARGS, on every call.
//!
//! After critest, nothing of its sandboxes may be left: no veth, no host route, no IPAM
//! handle or allocation.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write as _;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::common::apt;
use crate::common::cni::{report_skip, run_command_within};
use crate::common::netns::require_root;
use crate::common::peers::{peer, shared_k8s_file};
use crate::common::real_node::{build_busybox_image, node_peers, wait_until, Daemon, RealNode};

const NODE: &str = "critest-node";
const CRD: &str = "/apis/crd.projectcalico.org/v1";
const POOL_CIDR: &str = "10.67.0.0/16";
const REGISTRY: &str = "127.0.0.1:5000";
/// critest's whole run, bounded.
const CRITEST_TIMEOUT: Duration = Duration::from_secs(900);
/// The specs: the Networking and PodSandbox describes of cri-tools' validate package.
const FOCUS: &str = r"\[k8s\.io\] (Networking|PodSandbox) ";

fn say(msg: &str) {
    let _ = writeln!(std::io::stderr(), "[critest] {msg}");
}

fn tools_ready() -> bool {
    [
        "/usr/sbin/runc",
        "/bin/busybox",
        "/usr/bin/docker-registry",
        "/usr/bin/skopeo",
        "/usr/bin/curl",
    ]
    .iter()
    .all(|p| Path::new(p).exists())
}

/// The network config the DaemonSet would hand `install` (manifests/calico.yaml's template,
/// calico then portmap), with the plugin's log, lock and nodename kept in `scratch`.
fn network_config(scratch: &Path) -> String {
    let template = fs::read_to_string(
        shared_k8s_file("cni-network-config-v3.32.1/calico.json.tmpl")
            .unwrap_or_else(|why| panic!("{why}")),
    )
    .expect("read calico.json.tmpl");
    let mut conf: serde_json::Value =
        serde_json::from_str(&template.replace("__CNI_MTU__", "1500")).expect("template JSON");
    let calico = &mut conf["plugins"][0];
    let s = scratch.display();
    calico["log_file_path"] = json!(format!("{s}/cni.log"));
    calico["log_level"] = json!("debug");
    calico["ipam_lock_file"] = json!(format!("{s}/ipam.lock"));
    calico["nodename_file_optional"] = json!(true);
    serde_json::to_string_pretty(&conf)
        .expect("a conflist")
        .replace("1500", "__CNI_MTU__")
}

/// Puts a wrapper in front of `calico` that, on ADD, creates the namespace (with the
/// `default` ServiceAccount a controller-manager would add) and Pod named by CNI_ARGS (as the API server would hold them for a kubelet's pod on this node), then execs
/// the plugin. `calico-ipam` keeps pointing at the real binary (IPAM stays in-process).
fn make_pods_for_sandboxes(bin_dir: &Path, api_port: u16, token: &str) {
    let real_dir = bin_dir.join(".critest");
    fs::create_dir_all(&real_dir).unwrap();
    let real = real_dir.join("calico");
    fs::rename(bin_dir.join("calico"), &real).unwrap();
    fs::remove_file(bin_dir.join("calico-ipam")).unwrap();
    std::os::unix::fs::symlink(".critest/calico", bin_dir.join("calico-ipam")).unwrap();
    let script = format!(
        r#"#!/bin/sh
# critest names its sandboxes in mixed case, which no Pod name may be: the pod a kubelet
# would have had is the lowercased name, for every command alike.
pod=$(echo "$CNI_ARGS" | tr ';' '\n' | sed -n 's/^K8S_POD_NAME=//p' | tr '[:upper:]' '[:lower:]')
ns=$(echo "$CNI_ARGS" | tr ';' '\n' | sed -n 's/^K8S_POD_NAMESPACE=//p')
export CNI_ARGS=$(echo "$CNI_ARGS" | sed "s/K8S_POD_NAME=[^;]*/K8S_POD_NAME=$pod/")
if [ "$CNI_COMMAND" = ADD ]; then
  api="https://127.0.0.1:{api_port}/api/v1"
  post() {{
    curl -sk -m 10 -o /dev/null -H "Authorization: Bearer {token}" \
      -H 'Content-Type: application/json' -X POST "$1" -d "$2"
  }}
  post "$api/namespaces" '{{"apiVersion":"v1","kind":"Namespace","metadata":{{"name":"'"$ns"'"}}}}'
  post "$api/namespaces/$ns/serviceaccounts" '{{"apiVersion":"v1","kind":"ServiceAccount","metadata":{{"name":"default"}}}}'
  post "$api/namespaces/$ns/pods" '{{"apiVersion":"v1","kind":"Pod","metadata":{{"name":"'"$pod"'","labels":{{"critest":"true"}}}},"spec":{{"nodeName":"{NODE}","containers":[{{"name":"c","image":"busybox"}}]}}}}'
fi
exec {real} "$@"
"#,
        real = real.display()
    );
    let wrapper = bin_dir.join("calico");
    fs::write(&wrapper, script).unwrap();
    fs::set_permissions(&wrapper, fs::Permissions::from_mode(0o755)).unwrap();
}

/// Debian's docker-registry on the node's loopback, serving critest's images: busybox (its
/// default container image) and the web server stand-in (busybox httpd on port 80).
fn start_registry(node: &RealNode) -> Daemon {
    let dir = node.dir.path().join("registry");
    fs::create_dir_all(dir.join("storage")).unwrap();
    fs::write(
        dir.join("config.yml"),
        format!(
            "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: {REGISTRY}\n",
            dir.join("storage").display()
        ),
    )
    .unwrap();
    let registry = Daemon::start(
        "docker-registry",
        node.host.path(),
        Path::new("/usr/bin/docker-registry"),
        &["serve".into(), dir.join("config.yml").display().to_string()],
        None,
        &dir.join("registry.log"),
    );
    wait_until("the registry", Duration::from_secs(30), || {
        registry.assert_running();
        let code = node.host_sh(&format!(
            "curl -s -o /dev/null -w '%{{http_code}}' http://{REGISTRY}/v2/"
        ));
        (code.trim() == "200").then_some(())
    });
    let images = node.dir.path().join("critest-images");
    fs::create_dir_all(&images).unwrap();
    let serve = [
        "/bin/sh",
        "-c",
        "mkdir -p /www && echo critest > /www/index.html && exec httpd -f -p 80 -h /www",
    ];
    // critest's `--registry-prefix` keeps an image's path but not its tag (it asks for
    // `:latest`): both are served.
    for (name, entrypoint) in [
        ("e2e-test-images/busybox:1.29-2", None),
        ("e2e-test-images/busybox:latest", None),
        ("e2e-test-images/nginx:1.14-2", Some(&serve[..])),
        ("e2e-test-images/nginx:latest", Some(&serve[..])),
    ] {
        let tar = build_busybox_image(&images, &format!("{REGISTRY}/{name}"), entrypoint);
        let out = node.host.exec(
            "skopeo",
            &[
                "copy",
                "--dest-tls-verify=false",
                &format!("docker-archive:{}", tar.display()),
                &format!("docker://{REGISTRY}/{name}"),
            ],
        );
        assert!(
            out.status.success(),
            "skopeo copy {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // Some specs pull the prefixed name but create their container from the image's own
    // name (`registry.k8s.io/...`): the node has those too, as if pulled before.
    for (name, entrypoint) in [
        ("registry.k8s.io/e2e-test-images/busybox:1.29-2", None),
        (
            "registry.k8s.io/e2e-test-images/nginx:1.14-2",
            Some(&serve[..]),
        ),
    ] {
        node.containerd()
            .import(&build_busybox_image(&images, name, entrypoint));
    }
    let hosts = node.containerd().registry_hosts_dir().join(REGISTRY);
    fs::create_dir_all(&hosts).unwrap();
    fs::write(
        hosts.join("hosts.toml"),
        format!(
            "server = \"http://{REGISTRY}\"\n[host.\"http://{REGISTRY}\"]\n  capabilities = [\"pull\", \"resolve\"]\n"
        ),
    )
    .unwrap();
    registry
}

/// Each spec ginkgo reported, with its state, from critest's JUnit report.
fn spec_results(junit: &Path) -> BTreeMap<String, String> {
    let xml = fs::read_to_string(junit).unwrap_or_default();
    let mut out = BTreeMap::new();
    for case in xml.split("<testcase ").skip(1) {
        let Some(name) = case
            .split("name=\"")
            .nth(1)
            .and_then(|r| r.split('"').next())
        else {
            continue;
        };
        let status = case
            .split("status=\"")
            .nth(1)
            .and_then(|r| r.split('"').next())
            .unwrap_or("?");
        out.insert(
            name.replace("&#34;", "\"").replace("&amp;", "&"),
            status.to_string(),
        );
    }
    out
}

#[test]
fn critest_networking_and_pod_sandbox_specs_pass_with_our_plugins() {
    require_root();
    let test = "critest";
    let started = Instant::now();
    let peers = match node_peers() {
        Ok(p) => p,
        Err(why) => return report_skip(test, &format!("no real Kubernetes peers: {why}")),
    };
    let (critest, crictl) = match (peer("critest"), peer("crictl")) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(why), _) | (_, Err(why)) => return report_skip(test, &why),
    };
    if let Err(why) = apt::ensure(
        &[
            "runc",
            "busybox-static",
            "docker-registry",
            "skopeo",
            "curl",
            "iptables",
        ],
        tools_ready,
    ) {
        return report_skip(test, &format!("critest's tools cannot run here: {why}"));
    }

    let mut node = RealNode::new(&peers, NODE);
    let api = node.api();
    let a = api.post(
        "/api/v1/nodes",
        json!({"apiVersion":"v1","kind":"Node","metadata":{"name":NODE}}),
    );
    assert_eq!(a.status, 201, "POST the node: {a:?}");
    // The node as the DaemonSet sets it up: our image's install, with calico-node's token.
    let (_, how) = node.install_calico("critest", POOL_CIDR, network_config);
    let (bin_dir, conf_dir) = (node.cni_bin(), node.cni_conf());
    say(&format!("node set up by {how}"));
    let conflist = fs::read_to_string(conf_dir.join("10-calico.conflist")).unwrap();
    let types: Vec<String> = serde_json::from_str::<serde_json::Value>(&conflist).unwrap()
        ["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["type"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(types, ["calico", "portmap"], "the installed chain");
    make_pods_for_sandboxes(&bin_dir, api.port(), &api.admin_token());

    node.start_containerd();
    let api = node.api();
    let _registry = start_registry(&node);
    let sock = format!("unix://{}", node.containerd().sock().display());
    let junit = node.dir.path().join("critest-junit.xml");
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--net={}", node.host.path()))
        .arg(&critest)
        .arg(format!("--runtime-endpoint={sock}"))
        .arg(format!("--image-endpoint={sock}"))
        .arg(format!("--registry-prefix={REGISTRY}"))
        .arg(format!("--ginkgo.focus={FOCUS}"))
        .arg(format!("--ginkgo.junit-report={}", junit.display()))
        .arg("--ginkgo.no-color")
        .arg("--ginkgo.v")
        .current_dir(node.dir.path());
    let out = run_command_within(cmd, "", CRITEST_TIMEOUT, "critest");
    let results = spec_results(&junit);
    for (spec, status) in results.iter().filter(|(_, s)| s.as_str() != "skipped") {
        say(&format!("{status:>8}  {spec}"));
    }
    say(&format!(
        "{} specs outside the focus skipped",
        results.values().filter(|s| s.as_str() == "skipped").count()
    ));
    // Whatever critest left (nothing, if its cleanup ran), removed through CRI.
    let _ = run_command_within(
        {
            let mut c = Command::new("nsenter");
            c.arg(format!("--net={}", node.host.path()))
                .arg(&crictl)
                .arg(format!("--runtime-endpoint={sock}"))
                .args(["rmp", "-fa"]);
            c
        },
        "",
        Duration::from_secs(120),
        "crictl rmp -fa",
    );
    let ran: Vec<&String> = results
        .iter()
        .filter(|(_, s)| s.as_str() != "skipped")
        .map(|(n, _)| n)
        .collect();
    assert_eq!(
        out.code,
        0,
        "critest failed:\n{}\n{}",
        out.stdout
            .lines()
            .rev()
            .take(80)
            .collect::<Vec<_>>()
            .join("\n"),
        out.stderr
    );
    let expected = [
        "runtime should support DNS config",
        "runtime should support set hostname",
        "runtime should support port mapping with only container port",
        "runtime should support port mapping with host port and container port",
        "runtime should support running PodSandbox",
        "runtime should support stopping PodSandbox",
        "runtime should support removing PodSandbox",
        "should support safe sysctls",
        "should support unsafe sysctls",
    ];
    for spec in expected {
        let hit: Vec<_> = results.iter().filter(|(n, _)| n.contains(spec)).collect();
        assert!(
            !hit.is_empty() && hit.iter().all(|(_, s)| s.as_str() == "passed"),
            "spec {spec:?}: {hit:?} (all: {results:?})"
        );
    }
    say(&format!(
        "{} specs ran, all passed, in {:?}",
        ran.len(),
        started.elapsed()
    ));

    // Nothing of critest's sandboxes is left on the node or in the datastore.
    wait_until(
        "critest's sandboxes to leave nothing",
        Duration::from_secs(60),
        || {
            let links = node.host_sh("ip -o link show | grep -o 'cali[0-9a-f]*' || true");
            let handles = api.list(&format!("{CRD}/ipamhandles")).len();
            let allocations: usize = api
                .list(&format!("{CRD}/ipamblocks"))
                .iter()
                .map(|b| {
                    b["spec"]["allocations"]
                        .as_array()
                        .map_or(0, |a| a.iter().filter(|x| !x.is_null()).count())
                })
                .sum();
            (links.trim().is_empty() && handles == 0 && allocations == 0)
                .then_some(())
                .or_else(|| {
                    say(&format!(
                        "left: links {:?}, {handles} handles, {allocations} allocations",
                        links.trim()
                    ));
                    None
                })
        },
    );
}
