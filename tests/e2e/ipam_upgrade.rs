//! `calico-ipam -upgrade` (host-local → Calico IPAM) end to end: the real binary, run as
//! the upgrade-ipam init container runs it (no stdin; `KUBERNETES_NODE_NAME` and the API
//! server from the environment), inside a test host netns, against the test API server.
//! The host paths (host-local's data dir, the CNI binaries it deletes) are moved into a
//! scratch directory with the binary's test-only variables.

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::cni::TempDir;
use crate::common::kdd::{KddWorld, CRD, NODE};
use crate::common::netns::require_root;
use serde_json::{json, Value};

const IPIP_ANNOTATION: &str = "projectcalico.org/IPv4IPIPTunnelAddr";

/// host-local's data dir and the two binaries upstream deletes, under a scratch dir.
struct HostPaths {
    _scratch: TempDir,
    data_dir: PathBuf,
    binaries: Vec<PathBuf>,
}

impl HostPaths {
    fn new() -> HostPaths {
        let scratch = TempDir::new("upgrade-host");
        let data_dir = scratch.path().join("networks").join("k8s-pod-network");
        let bin = scratch.path().join("opt-cni-bin");
        fs::create_dir_all(&bin).unwrap();
        let binaries = vec![bin.join("calico"), bin.join("host-local")];
        for b in &binaries {
            fs::write(b, "#!/bin/sh\n").unwrap();
        }
        HostPaths {
            _scratch: scratch,
            data_dir,
            binaries,
        }
    }

    /// host-local's files: `(name, contents)`.
    fn with_files(self, files: &[(&str, &str)]) -> HostPaths {
        fs::create_dir_all(&self.data_dir).unwrap();
        for (name, contents) in files {
            fs::write(self.data_dir.join(name), contents).unwrap();
        }
        self
    }

    fn env(&self) -> Vec<(String, String)> {
        let bins: Vec<String> = self
            .binaries
            .iter()
            .map(|b| b.display().to_string())
            .collect();
        vec![
            (
                "CALICO_IPAM_UPGRADE_TEST_HOST_LOCAL_DIR".into(),
                self.data_dir.display().to_string(),
            ),
            (
                "CALICO_IPAM_UPGRADE_TEST_BINARIES_TO_DISABLE".into(),
                bins.join(":"),
            ),
        ]
    }
}

/// A running `calico-ipam -upgrade`; its stderr (the log) is collected as it comes.
struct Upgrade {
    child: Child,
    log: Arc<Mutex<Vec<String>>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Upgrade {
    fn start(w: &KddWorld, paths: &HostPaths, node: Option<&str>) -> Upgrade {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", w.host.name()])
            .arg(w.bin.plugin("calico-ipam"))
            .arg("-upgrade")
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("KUBECONFIG", w.api.kubeconfig())
            .envs(paths.env())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if let Some(n) = node {
            cmd.env("KUBERNETES_NODE_NAME", n);
        }
        let mut child = cmd.spawn().expect("run calico-ipam -upgrade");
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let sink = log.clone();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                sink.lock().unwrap().push(line);
            }
        });
        Upgrade {
            child,
            log,
            reader: Some(reader),
        }
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    /// Waits for a log line containing `text`.
    fn wait_for_line(&self, text: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            if let Some(l) = self.log.lock().unwrap().iter().find(|l| l.contains(text)) {
                return l.clone();
            }
            assert!(
                Instant::now() < deadline,
                "no log line with {text:?} within {within:?}:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The exit code; the process is killed (and the test fails) after `within`.
    fn wait(mut self, within: Duration) -> (i32, String) {
        let deadline = Instant::now() + within;
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                if let Some(r) = self.reader.take() {
                    let _ = r.join();
                }
                panic!("still running after {within:?}:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        (status.code().unwrap_or(-1), self.log())
    }
}

impl Drop for Upgrade {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The cluster's pool: the range host-local handed out (the nodes' podCIDRs).
fn seed_cluster_pool(w: &KddWorld) {
    w.seed_pool(
        "cluster-cidr",
        json!({"cidr":"10.244.0.0/16","ipipMode":"Always","vxlanMode":"Never","natOutgoing":true,
            "blockSize":26,"nodeSelector":"all()"}),
    );
}

fn seed_running_pod(w: &KddWorld, ns: &str, name: &str, node: &str, ip: &str) {
    w.seed_pod(
        ns,
        name,
        json!({"spec":{"nodeName":node},"status":{"phase":"Running","podIP":ip,"podIPs":[{"ip":ip}]}}),
    );
}

fn datastore_ready(w: &KddWorld) -> Value {
    w.api
        .get(&format!("{CRD}/clusterinformations/default"))
        .expect("ClusterInformation")["spec"]["datastoreReady"]
        .clone()
}

/// Every allocation of every block: address → (handle, attributes).
fn allocations(w: &KddWorld) -> BTreeMap<String, (String, Value)> {
    let mut out = BTreeMap::new();
    for b in w.crs("ipamblocks") {
        let spec = &b["spec"];
        let cidr: Vec<&str> = spec["cidr"].as_str().unwrap().split('/').collect();
        let base: std::net::Ipv4Addr = cidr[0].parse().unwrap();
        for (ord, a) in spec["allocations"].as_array().unwrap().iter().enumerate() {
            let Some(i) = a.as_u64() else { continue };
            let attr = &spec["attributes"][i as usize];
            let ip = std::net::Ipv4Addr::from(u32::from(base) + ord as u32);
            out.insert(
                ip.to_string(),
                (
                    attr["handle_id"].as_str().unwrap_or_default().to_string(),
                    attr["secondary"].clone(),
                ),
            );
        }
    }
    out
}

/// Handle ID → its block counts.
fn handles(w: &KddWorld) -> BTreeMap<String, Value> {
    w.crs("ipamhandles")
        .into_iter()
        .map(|h| {
            (
                h["spec"]["handleID"].as_str().unwrap().to_string(),
                h["spec"]["block"].clone(),
            )
        })
        .collect()
}

#[test]
fn kdd_upgrade_migrates_host_local_allocations() {
    require_root();
    let w = KddWorld::new();
    seed_cluster_pool(&w);
    w.seed_namespace("prod", json!({}), json!({}));
    seed_running_pod(&w, "default", "web-1", NODE, "10.244.1.5");
    seed_running_pod(&w, "prod", "web-2", NODE, "10.244.1.6");
    // Another node's pod: not listed, so its (stale) file here is dropped unmigrated.
    seed_running_pod(&w, "default", "elsewhere", "node2", "10.244.1.7");
    let paths = HostPaths::new().with_files(&[
        // host-local since plugins v0.8.6: `<containerID>\r\n<ifname>`; before: the ID.
        ("10.244.1.5", "cid-web-1\r\neth0"),
        ("10.244.1.6", "cid-web-2"),
        ("10.244.1.7", "cid-elsewhere\r\neth0"),
        ("last_reserved_ip.0", "10.244.1.7"),
        ("lock", ""),
    ]);
    w.api.clear_requests();
    let started = Instant::now();
    let (code, log) = Upgrade::start(&w, &paths, Some(NODE)).wait(Duration::from_secs(60));
    eprintln!("{log}");
    assert_eq!(code, 0, "{log}");
    assert!(
        log.contains("migration from host-local to calico-ipam complete"),
        "{log}"
    );
    // Upstream waits 5 s after deleting the binaries.
    assert!(started.elapsed() >= Duration::from_secs(5));

    // The two pods' addresses with their pods' attributes, and the node's IPIP tunnel
    // address (the podCIDR's first address): nothing else.
    let allocs = allocations(&w);
    assert_eq!(
        allocs,
        BTreeMap::from([
            (
                "10.244.1.1".to_string(),
                (
                    "ipip-tunnel-addr-node1".to_string(),
                    json!({"node": NODE, "type": "ipipTunnelAddress"})
                )
            ),
            (
                "10.244.1.5".to_string(),
                (
                    "k8s-pod-network.cid-web-1".to_string(),
                    json!({"namespace": "default", "node": NODE, "pod": "web-1"})
                )
            ),
            (
                "10.244.1.6".to_string(),
                (
                    "k8s-pod-network.cid-web-2".to_string(),
                    json!({"namespace": "prod", "node": NODE, "pod": "web-2"})
                )
            ),
        ]),
        "{log}"
    );
    let blocks = w.crs("ipamblocks");
    assert_eq!(blocks.len(), 1);
    assert_eq!(blocks[0]["spec"]["cidr"], "10.244.1.0/26");
    assert_eq!(blocks[0]["spec"]["affinity"], format!("host:{NODE}"));
    let one = json!({"10.244.1.0/26": 1});
    assert_eq!(
        handles(&w),
        BTreeMap::from([
            ("ipip-tunnel-addr-node1".to_string(), one.clone()),
            ("k8s-pod-network.cid-web-1".to_string(), one.clone()),
            ("k8s-pod-network.cid-web-2".to_string(), one),
        ])
    );
    // The tunnel address is on the Node (the KDD form of the Calico Node's field).
    let node = w.api.get(&format!("/api/v1/nodes/{NODE}")).unwrap();
    assert_eq!(
        node["metadata"]["annotations"][IPIP_ANNOTATION],
        "10.244.1.1"
    );
    assert_eq!(node["spec"]["podCIDR"], "10.244.1.0/24");

    // Files, data dir and binaries are gone; the datastore is ready again, after having
    // been marked not ready for the migration.
    assert!(!paths.data_dir.exists());
    for b in &paths.binaries {
        assert!(!b.exists(), "{} left", b.display());
    }
    assert_eq!(datastore_ready(&w), json!(true));
    let ci_writes: Vec<Value> = w
        .api
        .requests()
        .into_iter()
        .filter(|r| r.method == "PUT" && r.path.ends_with("/clusterinformations/default"))
        .map(|r| serde_json::from_str::<Value>(&r.body).unwrap()["spec"]["datastoreReady"].clone())
        .collect();
    assert_eq!(ci_writes, vec![json!(false), json!(true)]);
    // This node's pods, listed once by field selector.
    let lists: Vec<String> = w
        .api
        .requests()
        .into_iter()
        .filter(|r| r.path == "/api/v1/pods")
        .map(|r| r.query)
        .collect();
    assert_eq!(lists, vec![format!("fieldSelector=spec.nodeName%3D{NODE}")]);
}

#[test]
fn kdd_upgrade_with_nothing_to_migrate() {
    require_root();
    let w = KddWorld::new();
    // No host-local data dir: nothing is read or written.
    let paths = HostPaths::new();
    w.api.clear_requests();
    let (code, log) = Upgrade::start(&w, &paths, Some(NODE)).wait(Duration::from_secs(30));
    assert_eq!(code, 0, "{log}");
    assert!(
        log.contains("host-local IPAM data dir not found; no migration necessary"),
        "{log}"
    );
    assert!(w.api.requests().is_empty(), "{:?}", w.api.requests());
    assert!(paths.binaries.iter().all(|b| b.exists()));

    // An empty data dir on a node that already has its tunnel address: the dir is removed
    // and nothing else changes (the cluster is never marked not ready).
    let node = w.api.get(&format!("/api/v1/nodes/{NODE}")).unwrap();
    let mut node = node.clone();
    node["metadata"]["annotations"] = json!({IPIP_ANNOTATION: "10.65.0.1"});
    w.api.put(&format!("/api/v1/nodes/{NODE}"), node);
    let paths = paths.with_files(&[]);
    w.api.clear_requests();
    let (code, log) = Upgrade::start(&w, &paths, Some(NODE)).wait(Duration::from_secs(30));
    assert_eq!(code, 0, "{log}");
    assert!(log.contains("host-local IPAM data dir empty"), "{log}");
    assert!(!paths.data_dir.exists());
    assert!(paths.binaries.iter().all(|b| b.exists()));
    let writes: Vec<String> = w
        .api
        .requests()
        .into_iter()
        .filter(|r| r.method != "GET")
        .map(|r| format!("{} {}", r.method, r.path))
        .collect();
    assert!(writes.is_empty(), "{writes:?}");
    assert!(w.crs("ipamblocks").is_empty());
    assert_eq!(datastore_ready(&w), json!(true));
}

#[test]
fn kdd_upgrade_refuses_without_a_node_name() {
    require_root();
    let w = KddWorld::new();
    let paths = HostPaths::new().with_files(&[("10.244.1.5", "cid")]);
    w.api.clear_requests();
    let (code, log) = Upgrade::start(&w, &paths, None).wait(Duration::from_secs(30));
    assert_eq!(code, 1, "{log}");
    assert!(
        log.contains("KUBERNETES_NODE_NAME not specified, refusing to migrate..."),
        "{log}"
    );
    assert!(w.api.requests().is_empty());
    assert!(paths.data_dir.join("10.244.1.5").exists());
}

#[test]
fn kdd_upgrade_retries_until_it_can_finish() {
    require_root();
    let w = KddWorld::new();
    seed_cluster_pool(&w);
    seed_running_pod(&w, "default", "web-1", NODE, "10.244.1.5");
    // A file that is not named by an address fails the migration half way, with the
    // cluster marked not ready; upstream starts over every second until it can finish.
    let paths = HostPaths::new().with_files(&[
        ("10.244.1.5", "cid-web-1\r\neth0"),
        ("not-an-ip", "cid-x\r\neth0"),
    ]);
    let up = Upgrade::start(&w, &paths, Some(NODE));
    let line = up.wait_for_line(
        "failed to migrate ipam, retrying...",
        Duration::from_secs(60),
    );
    assert!(
        line.contains("failed to parse IP not-an-ip: invalid CIDR address: not-an-ip/32"),
        "{line}"
    );
    assert_eq!(datastore_ready(&w), json!(false));
    // Files before it (in name order) were migrated and removed.
    assert!(!paths.data_dir.join("10.244.1.5").exists());
    assert!(allocations(&w).contains_key("10.244.1.5"));
    fs::remove_file(paths.data_dir.join("not-an-ip")).unwrap();
    let (code, log) = up.wait(Duration::from_secs(60));
    assert_eq!(code, 0, "{log}");
    assert_eq!(datastore_ready(&w), json!(true));
    assert!(!paths.data_dir.exists());
    assert_eq!(
        allocations(&w).keys().cloned().collect::<Vec<_>>(),
        vec!["10.244.1.1".to_string(), "10.244.1.5".to_string()]
    );
}
