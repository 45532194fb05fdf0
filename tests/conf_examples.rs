//! The shipped conflists (`conf-examples/`) work as shipped: each is a conflist libcni
//! loads and validates (every plugin found and, asked with VERSION, supporting the list's
//! cniVersion), and each networks a pod end to end through libcni — ADD, CHECK, DEL with
//! nothing left — against a test datastore of its kind, with only the site's values
//! (datastore address, node name, log/lock/data paths) pointed at the test world.

mod common;

use std::path::Path;

use common::cluster::Cluster;
use common::examples::{self, Site};
use common::kdd::KddWorld;
use common::libcni::{driver_or_skip, ipv4_only_path, RuntimeEnv};
use common::netns::require_root;
use common::world::World;
use serde_json::{json, Value};

/// The datastore an example is written for.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Store {
    Etcd,
    Kubernetes,
}

/// Every example, with its datastore, whether its pods are Kubernetes pods (K8S_POD_* in
/// CNI_ARGS) and the addresses a pod gets (`ips` prefixes, in order).
const EXAMPLES: &[(&str, Store, bool, &[&str])] = &[
    (
        "10-calico-dual-stack.conflist",
        Store::Etcd,
        true,
        &["10.65.", "fd80:24e2:f998:72d6:"],
    ),
    ("10-calico-etcd.conflist", Store::Etcd, true, &["10.65."]),
    (
        "10-calico-host-local.conflist",
        Store::Etcd,
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
        "10-calico-portmap-bandwidth.conflist",
        Store::Etcd,
        true,
        &["10.65."],
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
        let (cluster, site): (Box<dyn Cluster>, Site) = match store {
            Store::Etcd => {
                let w = World::new();
                let site = Site {
                    etcd_endpoint: Some(w.etcd.endpoint()),
                    kubeconfig: None,
                    scratch: w.scratch.path().to_path_buf(),
                };
                (Box::new(w), site)
            }
            Store::Kubernetes => {
                let w = KddWorld::new();
                let site = Site {
                    etcd_endpoint: None,
                    kubeconfig: Some(w.api.kubeconfig()),
                    scratch: w.scratch.path().to_path_buf(),
                };
                (Box::new(w), site)
            }
        };
        let c = cluster.as_ref();
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
        let out = call("check");
        assert_eq!(out.code, 0, "{name}: libcni CHECK: {}", out.stderr);
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
        report_progress(name);
    }
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
fn report_progress(name: &str) {
    eprintln!("{name}: ADD, CHECK, DEL through libcni OK");
}
