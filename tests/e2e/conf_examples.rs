//! The shipped conflists (`conf-examples/`) work as shipped: each is a conflist libcni
//! loads and validates (every plugin found and, asked with VERSION, supporting the list's
//! cniVersion), and each networks a pod end to end through libcni — ADD, CHECK (from
//! cniVersion 0.4.0; libcni refuses it below), DEL with nothing left — against a test
//! datastore of its kind, with only the site's values (datastore address, node name,
//! log/lock/data paths) pointed at the test world.
//!
//! The examples taken from a manifest are that manifest's own: each is, byte for byte, what
//! upstream's installer writes from the manifest's CNI template (kept unchanged in
//! `shared/k8s` beside the clone) on the node [`examples::TYPICAL_NODE`] describes. And our
//! `install` renders every one of Calico v3.32.1's eight manifest templates as upstream's
//! installer does.

use std::path::Path;

use crate::common;
use crate::common::cluster::Cluster;
use crate::common::cni::report_skip;
use crate::common::examples::{self, Site, TYPICAL_NODE, TYPICAL_NODE_ETCD_TLS};
use crate::common::installer::Node;
use crate::common::kdd::KddWorld;
use crate::common::kube_api::KubeApi;
use crate::common::libcni::{driver_or_skip, ipv4_only_path, RuntimeEnv};
use crate::common::netns::require_root;
use crate::common::world::{World, WEP_PREFIX};
use serde_json::{json, Value};

/// The datastore an example is written for.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Store {
    /// etcd, no API server (the plain CNI example's containers are not pods).
    Etcd,
    /// etcd with an API server at the example's kubeconfig: a pod's ADD makes its API client
    /// from it (and fails without one, as upstream's), calico-ipam reads the pod's
    /// namespace, and with `policy.type: k8s` the pod (labels, service account, annotations)
    /// is read.
    EtcdWithApi,
    Kubernetes,
}

/// Every example, with its datastore, whether its pods are Kubernetes pods (K8S_POD_* in
/// CNI_ARGS) and the addresses a pod gets (`ips` prefixes, in order).
const EXAMPLES: &[(&str, Store, bool, &[&str])] = &[
    (
        "10-calico-dual-stack.conflist",
        Store::EtcdWithApi,
        true,
        &["10.65.", "fd80:24e2:f998:72d6:"],
    ),
    (
        "10-calico-etcd.conflist",
        Store::EtcdWithApi,
        true,
        &["10.65."],
    ),
    (
        "10-calico-host-local.conflist",
        Store::EtcdWithApi,
        true,
        &["10.244.1."],
    ),
    (
        "10-calico-kubernetes.conflist",
        Store::Kubernetes,
        true,
        &["10.65."],
    ),
    (
        "10-calico-plain-cni.conflist",
        Store::Etcd,
        false,
        &["10.65."],
    ),
    (
        "10-calico-policy-only.conflist",
        Store::Kubernetes,
        true,
        // usePodCidr: the test Node's IPv4 podCIDR.
        &["10.244.1."],
    ),
    (
        "10-calico-portmap-bandwidth.conflist",
        Store::EtcdWithApi,
        true,
        &["10.65."],
    ),
];

/// Environment variables, as (name, value).
type Vars = &'static [(&'static str, &'static str)];

/// The examples that are a manifest's own: the example, a manifest template it is what
/// upstream's installer makes of on the typical node, and the variables that differ there
/// from [`TYPICAL_NODE`]. calico.yaml, calico-typha.yaml, calico-vxlan.yaml and
/// calico-bpf.yaml carry the same template; canal.yaml's differs from calico-policy-only's
/// only in taking the MTU from `veth_mtu` ("0" as shipped) where policy-only says 1500.
const FROM_MANIFESTS: &[(&str, &str, Vars)] = &[
    ("10-calico-kubernetes.conflist", "calico.json.tmpl", &[]),
    (
        "10-calico-kubernetes.conflist",
        "calico-typha.json.tmpl",
        &[],
    ),
    (
        "10-calico-kubernetes.conflist",
        "calico-vxlan.json.tmpl",
        &[],
    ),
    ("10-calico-kubernetes.conflist", "calico-bpf.json.tmpl", &[]),
    ("10-calico-etcd.conflist", "calico-etcd.json.tmpl", &[]),
    (
        "10-calico-policy-only.conflist",
        "calico-policy-only.json.tmpl",
        &[],
    ),
    (
        "10-calico-policy-only.conflist",
        "canal.json.tmpl",
        &[("CNI_MTU", "1500")],
    ),
];

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// A dotted version as numbers, for ordering.
fn version_key(v: &str) -> Vec<u32> {
    v.split('.')
        .map(|p| p.parse().unwrap_or_else(|_| panic!("bad version {v:?}")))
        .collect()
}

#[test]
fn every_example_is_listed_here() {
    let on_disk: Vec<String> = examples::all().iter().map(|p| file_name(p)).collect();
    let listed: Vec<String> = EXAMPLES.iter().map(|e| e.0.to_string()).collect();
    assert_eq!(on_disk, listed, "conf-examples/ and EXAMPLES differ");
}

/// Every manifest template, or `None` (reported as a skip, which fails in CI) when
/// `shared/k8s` is not beside the clone.
fn templates_or_skip(test: &str) -> Option<Vec<(&'static str, String)>> {
    let mut out = Vec::new();
    for name in examples::TEMPLATES {
        match examples::template(name) {
            Ok(text) => out.push((name, text)),
            Err(why) => {
                report_skip(test, &why);
                return None;
            }
        }
    }
    Some(out)
}

/// `base` with `extra`'s variables set over it.
fn env_with<'a>(
    base: &[(&'a str, &'a str)],
    extra: &[(&'a str, &'a str)],
) -> Vec<(&'a str, &'a str)> {
    let mut env: Vec<(&str, &str)> = base
        .iter()
        .filter(|(k, _)| !extra.iter().any(|(e, _)| e == k))
        .copied()
        .collect();
    env.extend_from_slice(extra);
    env
}

/// Both texts, line by line, marking the lines that differ.
fn line_diff(want: &str, got: &str) -> String {
    let (w, g): (Vec<&str>, Vec<&str>) = (want.lines().collect(), got.lines().collect());
    (0..w.len().max(g.len()))
        .map(|i| {
            let (a, b) = (w.get(i).copied(), g.get(i).copied());
            if a == b {
                format!("  {}", a.unwrap_or_default())
            } else {
                format!("- {}\n+ {}", a.unwrap_or("<none>"), b.unwrap_or("<none>"))
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Each example taken from a manifest is exactly what upstream's installer writes from that
/// manifest's template on the typical node (the file only adds a final newline), and every
/// manifest with calico-ipam or usePodCidr on calico has its example.
#[test]
fn manifest_examples_are_what_the_manifests_install() {
    let test = "manifest_examples_are_what_the_manifests_install";
    if templates_or_skip(test).is_none() {
        return;
    }
    for (example, template, extra) in FROM_MANIFESTS {
        let tmpl = examples::template(template).unwrap_or_else(|e| panic!("{e}"));
        let env = env_with(TYPICAL_NODE, extra);
        let want = examples::render_as_upstream(&tmpl, &env, TYPICAL_NODE_ETCD_TLS, "unused", "");
        assert!(
            examples::placeholders_left(&want).is_empty(),
            "{template}: the typical node leaves {:?}",
            examples::placeholders_left(&want)
        );
        let path = examples::dir().join(example);
        let got = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        assert_eq!(
            got,
            format!("{want}\n"),
            "{example} is not what {template} installs with {env:?}:\n{}",
            line_diff(&want, &got)
        );
    }
    // canal.yaml as shipped (veth_mtu "0") differs from the policy-only example in the MTU
    // alone.
    let canal = examples::template("canal.json.tmpl").unwrap_or_else(|e| panic!("{e}"));
    let canal: Value = serde_json::from_str(&examples::render_as_upstream(
        &canal,
        TYPICAL_NODE,
        TYPICAL_NODE_ETCD_TLS,
        "unused",
        "",
    ))
    .expect("canal's conflist is JSON");
    let mut policy_only = examples::load("10-calico-policy-only.conflist");
    policy_only["plugins"][0]["mtu"] = json!(0);
    assert_eq!(canal, policy_only, "canal.yaml's conflist");
    // The templates left without an example: canal-etcd's (calico delegated to by flannel).
    let covered: Vec<&str> = FROM_MANIFESTS.iter().map(|m| m.1).collect();
    let left: Vec<&str> = examples::TEMPLATES
        .iter()
        .copied()
        .filter(|t| !covered.contains(t))
        .collect();
    assert_eq!(left, ["canal-etcd.json.tmpl"]);
}

/// The host name as the installer reads it.
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").expect("hostname")
}

/// Our `install`, given each of the eight manifest templates as the DaemonSet gives it
/// (`CNI_NETWORK_CONFIG`, under the manifest's `CNI_CONF_NAME`), writes what upstream's
/// installer writes: on the typical node (every placeholder from the environment, the etcd
/// TLS files mounted) and with nothing set (the installer's own defaults: the host name,
/// MTU 1500, no TLS files, empty endpoints and API address). Outside a pod: no token.
#[test]
fn install_renders_every_manifest_template_as_upstream() {
    let test = "install_renders_every_manifest_template_as_upstream";
    let Some(templates) = templates_or_skip(test) else {
        return;
    };
    let host = hostname();
    for (name, text) in &templates {
        let conf_name = if name.starts_with("canal") {
            "10-canal.conflist"
        } else {
            "10-calico.conflist"
        };
        for (label, env, tls) in [
            ("the typical node", TYPICAL_NODE, TYPICAL_NODE_ETCD_TLS),
            ("nothing set", &[][..], false),
        ] {
            let node = Node::new();
            if tls {
                for f in ["etcd-ca", "etcd-cert", "etcd-key"] {
                    std::fs::write(node.path("secrets").join(f), f).expect("write secret");
                }
            }
            let mut vars = env.to_vec();
            vars.push(("CNI_CONF_NAME", conf_name));
            vars.push(("CNI_NETWORK_CONFIG", text));
            let out = node.run(&vars);
            assert_eq!(out.code, 0, "{name}, {label}: install: {}", out.stderr);
            let path = node.path("host/etc/cni/net.d").join(conf_name);
            let got = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("{name}, {label}: read {}: {e}", path.display()));
            let want = examples::render_as_upstream(text, &vars, tls, &host, "");
            assert_eq!(
                got,
                want,
                "{name}, {label}: our install differs from upstream's:\n{}",
                line_diff(&want, &got)
            );
            assert!(
                examples::placeholders_left(&got).is_empty(),
                "{name}, {label}: {:?} left",
                examples::placeholders_left(&got)
            );
        }
    }
}

/// The structure every runtime relies on, and libcni's own loading and validation.
#[test]
fn every_example_is_a_valid_conflist() {
    let driver = driver_or_skip("every_example_is_a_valid_conflist (libcni part)");
    let bin = common::cni::Bin::new();
    for path in examples::all() {
        let name = file_name(&path);
        let list = examples::load(&name);
        let net = list["name"].as_str().unwrap_or_default();
        assert!(
            !net.is_empty()
                && net
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c)),
            "{name}: network name {net:?}"
        );
        let version = list["cniVersion"]
            .as_str()
            .unwrap_or_else(|| panic!("{name}: cniVersion"));
        version_key(version);
        if let Some(versions) = list.get("cniVersions") {
            let versions: Vec<&str> = versions
                .as_array()
                .unwrap_or_else(|| panic!("{name}: cniVersions is an array"))
                .iter()
                .map(|v| v.as_str().unwrap_or_else(|| panic!("{name}: {v}")))
                .collect();
            assert!(
                versions.contains(&version),
                "{name}: cniVersion (what libcni < 1.2 uses) is one of cniVersions"
            );
            versions.iter().for_each(|v| {
                version_key(v);
            });
        }
        let plugins = list["plugins"]
            .as_array()
            .unwrap_or_else(|| panic!("{name}: plugins"));
        assert!(!plugins.is_empty(), "{name}: no plugins");
        assert_eq!(plugins[0]["type"], "calico", "{name}: calico comes first");
        for p in plugins {
            assert!(p["type"].is_string(), "{name}: plugin without type: {p}");
            assert!(
                p.get("name").is_none() && p.get("cniVersion").is_none(),
                "{name}: name and cniVersion belong to the list, libcni injects them: {p}"
            );
        }
        for calico in plugins.iter().filter(|p| p["type"] == "calico") {
            assert!(calico["ipam"]["type"].is_string(), "{name}: ipam.type");
        }
        let Some(driver) = driver else { continue };
        let caps = driver
            .validate(&path, &bin.path())
            .unwrap_or_else(|e| panic!("{name}: libcni ValidateNetworkList: {e}"));
        let mut declared: Vec<String> = plugins
            .iter()
            .filter_map(|p| p["capabilities"].as_object())
            .flat_map(|c| c.iter().filter(|(_, on)| **on == json!(true)))
            .map(|(k, _)| k.clone())
            .collect();
        declared.sort();
        let mut caps = caps;
        caps.sort();
        assert_eq!(caps, declared, "{name}: capabilities");
    }
}

/// `cniVersions`: a runtime with libcni ≥ 1.2 sends the highest version it knows to every
/// plugin of the list, so each plugin (and the IPAM plugin calico delegates to) must support
/// every listed version.
#[test]
fn cni_versions_are_supported_by_every_plugin() {
    let bin = common::cni::Bin::new();
    for path in examples::all() {
        let name = file_name(&path);
        let list = examples::load(&name);
        let Some(versions) = list["cniVersions"].as_array() else {
            continue;
        };
        let mut types: Vec<String> = Vec::new();
        for p in list["plugins"].as_array().into_iter().flatten() {
            types.extend(p["type"].as_str().map(String::from));
            if p["type"] == "calico" {
                types.extend(p["ipam"]["type"].as_str().map(String::from));
            }
        }
        for t in types {
            let out = std::process::Command::new(bin.plugin(&t))
                .env("CNI_COMMAND", "VERSION")
                .output()
                .unwrap_or_else(|e| panic!("{t} VERSION: {e}"));
            let info: Value = serde_json::from_slice(&out.stdout)
                .unwrap_or_else(|e| panic!("{t} VERSION output: {e}"));
            for v in versions {
                assert!(
                    info["supportedVersions"]
                        .as_array()
                        .is_some_and(|s| s.contains(v)),
                    "{name}: {t} does not support {v}: {info}"
                );
            }
        }
    }
}

/// What a runtime passes for a pod with a hostPort and bandwidth limits.
fn capability_args() -> Value {
    json!({
        "portMappings": [{"hostPort": 30080, "containerPort": 8080, "protocol": "tcp"}],
        "bandwidth": {"ingressRate": 10_000_000, "ingressBurst": 2_147_483_647_u64,
            "egressRate": 10_000_000, "egressBurst": 2_147_483_647_u64}
    })
}

#[test]
fn every_example_networks_a_pod_through_libcni() {
    require_root();
    let test = "every_example_networks_a_pod_through_libcni";
    let Some(driver) = driver_or_skip(test) else {
        return;
    };
    for (i, (name, store, k8s, prefixes)) in EXAMPLES.iter().enumerate() {
        let mut list = examples::load(name);
        // On etcd with policy k8s, the API server the pods are read from (kept for the
        // example's whole run).
        let mut pod_api: Option<KubeApi> = None;
        let etcd_world = matches!(store, Store::Etcd | Store::EtcdWithApi).then(World::new);
        let kdd_world = (*store == Store::Kubernetes).then(KddWorld::new);
        let (c, site): (&dyn Cluster, Site) = match (&etcd_world, &kdd_world) {
            (Some(w), _) => {
                if *store == Store::EtcdWithApi {
                    pod_api = Some(KubeApi::start_in_netns(w.host.path()));
                }
                let site = Site {
                    etcd_endpoint: Some(w.etcd.endpoint()),
                    kubeconfig: pod_api.as_ref().map(KubeApi::kubeconfig),
                    scratch: w.scratch.path().to_path_buf(),
                };
                (w, site)
            }
            (None, Some(w)) => {
                let site = Site {
                    etcd_endpoint: None,
                    kubeconfig: Some(w.api.kubeconfig()),
                    scratch: w.scratch.path().to_path_buf(),
                };
                (w, site)
            }
            (None, None) => unreachable!("every store has a world"),
        };
        if name.contains("dual-stack") {
            c.seed_pool(
                "default-ipv6-ippool",
                json!({"cidr":"fd80:24e2:f998:72d6::/64","ipipMode":"Never","vxlanMode":"Never",
                    "natOutgoing":false,"blockSize":122,"nodeSelector":"all()"}),
            );
        }
        examples::localize(&mut list, &site);
        let conflist = examples::write(c.scratch(), name, &list);
        let container_id = format!("example{i}");
        let pod_name = format!("pod{i}");
        let cni_args = if *k8s {
            c.prepare_pod("default", &pod_name);
            if let Some(api) = &pod_api {
                seed_pod(api, &pod_name);
            }
            format!(
                "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME={pod_name};\
                 K8S_POD_INFRA_CONTAINER_ID={container_id}"
            )
        } else {
            String::new()
        };
        let env = RuntimeEnv {
            cni_path: c.cni_path(),
            cache_dir: c.scratch().join("cni-cache"),
            ifname: "eth0".into(),
            cni_args,
            cap_args: Some(capability_args()),
            path: Some(ipv4_only_path(c.scratch())),
        };
        let pod = c.pod();
        let call = |verb: &str| {
            driver.call(
                c.host_name(),
                verb,
                &conflist,
                &container_id,
                pod.path(),
                &env,
            )
        };

        let out = call("add");
        assert_eq!(out.code, 0, "{name}: libcni ADD: {}", out.stderr);
        let r = out.json();
        assert_eq!(r["cniVersion"], list["cniVersion"], "{name}: {r}");
        let ips: Vec<&str> = r["ips"]
            .as_array()
            .map(|a| a.iter().filter_map(|ip| ip["address"].as_str()).collect())
            .unwrap_or_default();
        assert_eq!(ips.len(), prefixes.len(), "{name}: {r}");
        for (ip, prefix) in ips.iter().zip(prefixes.iter()) {
            assert!(ip.starts_with(prefix), "{name}: {ip} not in {prefix}*");
        }
        let policy_k8s = list["plugins"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|p| p["type"] == "calico" && p["policy"]["type"] == "k8s");
        if let (Some(w), Some(_), true) = (&etcd_world, &pod_api, policy_k8s) {
            // policy k8s: the endpoint is the pod's (its labels, its namespace's and service
            // account's profiles), not the network's.
            let weps = w.etcd.get_prefix(&format!("{WEP_PREFIX}default/"));
            assert_eq!(weps.len(), 1, "{name}: {weps:?}");
            let wep: Value = serde_json::from_str(&weps[0].1).expect("endpoint JSON");
            assert_eq!(
                wep["spec"]["profiles"],
                json!(["kns.default", "ksa.default.default"]),
                "{name}: {wep}"
            );
            let labels = &wep["metadata"]["labels"];
            assert_eq!(labels["app"], pod_name.as_str(), "{name}: {wep}");
            assert_eq!(
                labels["projectcalico.org/namespace"], "default",
                "{name}: {wep}"
            );
        }
        let out = call("check");
        let check_refused =
            version_key(list["cniVersion"].as_str().unwrap_or_default()) < vec![0, 4, 0];
        if check_refused {
            // libcni refuses CHECK below 0.4.0 without running a plugin.
            assert_ne!(out.code, 0, "{name}: libcni ran CHECK");
            assert!(
                out.stderr.contains("does not support the CHECK command"),
                "{name}: {}",
                out.stderr
            );
        } else {
            assert_eq!(out.code, 0, "{name}: libcni CHECK: {}", out.stderr);
        }
        let out = call("del");
        assert_eq!(out.code, 0, "{name}: libcni DEL: {}", out.stderr);
        c.assert_clean();
        let routes = c.host_sh("ip route show; ip -6 route show");
        for ip in &ips {
            let addr = ip.split('/').next().unwrap_or_default();
            assert!(
                !routes.contains(addr),
                "{name}: route to {addr} left: {routes}"
            );
        }
        let nat = c.host_sh("iptables-save -t nat");
        assert!(
            !nat.contains(&container_id),
            "{name}: portmap rules left: {nat}"
        );
        let host_local = site.scratch.join("host-local");
        if host_local.exists() {
            let left: Vec<String> = walk(&host_local)
                .into_iter()
                .filter(|f| f.contains("10.244.1."))
                .collect();
            assert!(
                left.is_empty(),
                "{name}: host-local allocations left: {left:?}"
            );
        }
        report_progress(name, check_refused);
    }
}

/// The namespace `default` and pod `default/<name>` on `node1`, on the API server an etcd
/// example with policy k8s reads pods from.
fn seed_pod(api: &KubeApi, name: &str) {
    if api.get("/api/v1/namespaces/default").is_none() {
        api.put(
            "/api/v1/namespaces/default",
            json!({"apiVersion":"v1","kind":"Namespace","metadata":{"name":"default"}}),
        );
    }
    api.put(
        &format!("/api/v1/namespaces/default/pods/{name}"),
        json!({"apiVersion":"v1","kind":"Pod",
            "metadata":{"name":name,"namespace":"default","labels":{"app":name}},
            "spec":{"nodeName":common::world::NODE,"serviceAccountName":"default",
                "containers":[{"name":"c","image":"busybox"}]}}),
    );
}

/// Every file under `dir`, as paths.
fn walk(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p.display().to_string());
        }
    }
    out
}

/// One example done (shown with --nocapture).
fn report_progress(name: &str, check_refused: bool) {
    let check = if check_refused {
        "CHECK (refused by libcni at this cniVersion)"
    } else {
        "CHECK"
    };
    eprintln!("{name}: ADD, {check}, DEL through libcni OK");
}
