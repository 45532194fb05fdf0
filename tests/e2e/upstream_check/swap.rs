//! A rolling swap and a rollback on a live two-node cluster, on the Kubernetes datastore and
//! on etcd: two nodes (kubelet + containerd 2 each, each in its own netns, joined by a
//! link) on one kube-apiserver v1.35 with Calico's CRDs and the `calico-cni-plugin` RBAC,
//! both set up first by upstream's `install` from the manifest's network config with
//! upstream's binaries, pods on both reaching each other. Node A is then swapped to ours
//! (our `install`, as the image's `install-cni` runs it) while its pods run, and rolled back
//! to upstream's. After every step: each pod keeps its address and reaches every other pod,
//! the blocks hold exactly the live pods' addresses, each under its own sandbox's handle,
//! and no other handle exists; each pod's address comes from a block affine to its node;
//! each pod's annotations and workload endpoint read as upstream's for the first pod;
//! upstream's `calicoctl ipam check` finds no problem; the conflist and kubeconfig are what
//! the installer that ran last writes.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::Duration;

use serde_json::{json, Value};

use super::{block_holders, calicoctl_ok, upstream, without_run_identity};
use crate::common::cni::run_command_within;
use crate::common::netns::require_root;
use crate::common::real_k8s::NODE_LINK_V4;
use crate::common::real_node::{
    manifest_network_config, node_peers, wait_until, Installer, ManifestDatastore, NodePair,
    RealNode, BUSYBOX_IMAGE, CONFLIST_NAME,
};

const NODES: [&str; 2] = ["swap-a", "swap-b"];
const POOL: &str = "10.67.0.0/16";
const PODS: &str = "/api/v1/namespaces/default/pods";
const CRD: &str = "/apis/crd.projectcalico.org/v1";
const V3: &str = "/calico/resources/v3/projectcalico.org";
const BLOCKS_KEY: &str = "/calico/ipam/v2/assignment/ipv4/block/";
const HANDLES_KEY: &str = "/calico/ipam/v2/handle/";
const RUNNING_TIMEOUT: Duration = Duration::from_secs(120);
const GONE_TIMEOUT: Duration = Duration::from_secs(90);

fn say(msg: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "[swap] {msg}");
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Store {
    Kdd,
    Etcd,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Side {
    A,
    B,
}

/// What an installer leaves in the node's /etc/cni/net.d: the conflist, and the kubeconfig
/// without its token (each install asks for a new one).
#[derive(Debug, PartialEq)]
struct NetDir {
    conflist: String,
    kubeconfig: String,
}

/// A pod as the cluster shows it at one step.
#[derive(Clone, Debug)]
struct LivePod {
    side: Side,
    ip: String,
    sandbox: String,
}

struct Swap {
    pair: NodePair,
    store: Store,
    upstream_bin: PathBuf,
    /// calicoctl's datastore, as it runs in node A's netns.
    ctl_env: Vec<(&'static str, String)>,
    /// Calico's etcd as the nodes reach it (etcd datastore).
    etcd_endpoints: String,
    /// The pods that should be running, and where.
    pods: BTreeMap<String, Side>,
    /// The first pod's annotations and workload endpoint, normalized: every other pod's
    /// must read the same.
    reference: Option<(Value, Value)>,
}

impl Swap {
    fn new(store: Store) -> Swap {
        require_root();
        let upstream_bin = upstream("install")
            .parent()
            .expect("the upstream folder")
            .to_path_buf();
        for b in ["calico", "calicoctl"] {
            upstream(b);
        }
        let peers = node_peers().unwrap_or_else(|why| panic!("{why}"));
        let pair = NodePair::new(&peers, NODES);
        let api = pair.a.api();
        let admin = api.kubeconfig_with(&api.admin_token());
        let mut ctl_env = vec![("KUBECONFIG", admin.display().to_string())];
        let mut etcd_endpoints = String::new();
        match store {
            Store::Kdd => {
                pair.a.apply_calico_resources("swap-cluster", POOL);
                ctl_env.push(("DATASTORE_TYPE", "kubernetes".into()));
            }
            Store::Etcd => {
                // Calico's keys in the API server's own etcd (under /calico/, the API
                // server's under /registry/), seeded as calico/node and an operator would.
                let etcd = api.etcd();
                let meta =
                    |name: &str| json!({"name": name, "creationTimestamp": "2026-12-02T00:00:00Z"});
                etcd.put(
                    &format!("{V3}/clusterinformations/default"),
                    &json!({"kind":"ClusterInformation","apiVersion":"projectcalico.org/v3",
                        "metadata":meta("default"),"spec":{"clusterGUID":"swap-cluster",
                            "calicoVersion":"v3.32.1","datastoreReady":true}})
                    .to_string(),
                );
                for node in NODES {
                    etcd.put(
                        &format!("{V3}/nodes/{node}"),
                        &json!({"kind":"Node","apiVersion":"projectcalico.org/v3",
                            "metadata":meta(node),"spec":{}})
                        .to_string(),
                    );
                }
                etcd.put(
                    &format!("{V3}/ippools/default-ipv4-ippool"),
                    &json!({"kind":"IPPool","apiVersion":"projectcalico.org/v3",
                        "metadata":meta("default-ipv4-ippool"),
                        "spec":{"cidr":POOL,"blockSize":26,"ipipMode":"Never","vxlanMode":"Never",
                            "natOutgoing":true,"nodeSelector":"all()"}})
                    .to_string(),
                );
                ctl_env.push(("DATASTORE_TYPE", "etcdv3".into()));
                ctl_env.push(("ETCD_ENDPOINTS", etcd.endpoint()));
                etcd_endpoints = format!("http://{}:{}", NODE_LINK_V4[0], etcd.port());
            }
        }
        let s = Swap {
            pair,
            store,
            upstream_bin,
            ctl_env,
            etcd_endpoints,
            pods: BTreeMap::new(),
            reference: None,
        };
        // `calicoctl ipam check` reads it (kube-controllers would have made it).
        let kcc = json!({"apiVersion": "projectcalico.org/v3", "kind": "KubeControllersConfiguration",
            "metadata": {"name": "default"}, "spec": {"controllers": {"node": {}}}});
        s.calicoctl(&["apply", "-f", "-"], &kcc.to_string());
        s
    }

    fn node(&self, side: Side) -> &RealNode {
        match side {
            Side::A => &self.pair.a,
            Side::B => &self.pair.b,
        }
    }

    fn calicoctl(&self, args: &[&str], stdin: &str) -> String {
        calicoctl_ok(self.pair.a.host.name(), &self.ctl_env, args, stdin)
    }

    /// The manifest's network config (calico.yaml's for the Kubernetes datastore,
    /// calico-etcd.yaml's for etcd), localized to the node ([`manifest_network_config`]).
    fn network_config(&self, node: &RealNode) -> String {
        let datastore = match self.store {
            Store::Kdd => ManifestDatastore::Kubernetes,
            Store::Etcd => ManifestDatastore::Etcd,
        };
        manifest_network_config(&node.scratch(), datastore)
    }

    /// Runs `installer` on the node (the DaemonSet's `install-cni`); what it left.
    fn install(&self, side: Side, installer: Installer) -> NetDir {
        let node = self.node(side);
        let etcd_env = [("ETCD_ENDPOINTS", self.etcd_endpoints.as_str())];
        let extra: &[(&str, &str)] = match self.store {
            Store::Kdd => &[],
            Store::Etcd => &etcd_env,
        };
        let how = node.install(installer, &self.network_config(node), extra);
        say(&format!("{:?} on {}: {how}", self.store, node.name));
        let conf = node.cni_conf();
        let read =
            |f: &str| std::fs::read_to_string(conf.join(f)).unwrap_or_else(|e| panic!("{f}: {e}"));
        let kubeconfig = read("calico-kubeconfig")
            .lines()
            .map(|l| match l.trim_start().strip_prefix("token:") {
                Some(_) => "    token: <token>",
                None => l,
            })
            .collect::<Vec<_>>()
            .join("\n");
        NetDir {
            conflist: read(CONFLIST_NAME),
            kubeconfig,
        }
    }

    /// The node's installed `calico` is upstream's (`true`) or another.
    fn runs_upstream(&self, side: Side) -> bool {
        let installed = std::fs::read(self.node(side).cni_bin().join("calico")).expect("calico");
        installed == std::fs::read(self.upstream_bin.join("calico")).expect("upstream calico")
    }

    fn create_pod(&mut self, name: &str, side: Side) {
        let node = self.node(side).name.clone();
        let pod = json!({"apiVersion":"v1","kind":"Pod",
            "metadata":{"name":name,"namespace":"default","labels":{"app":"swap"}},
            "spec":{"nodeName":node,"restartPolicy":"Always","automountServiceAccountToken":false,
                "terminationGracePeriodSeconds":0,
                "containers":[{"name":"c","image":BUSYBOX_IMAGE,"imagePullPolicy":"Never",
                    "command":["/bin/sleep","2147483647"]}]}});
        let a = self.pair.a.api().post(PODS, pod);
        assert_eq!(a.status, 201, "POST pod {name}: {a:?}");
        self.pods.insert(name.to_string(), side);
    }

    /// Deletes the pod and waits for it to be gone from the API and for kubelet's CNI DEL
    /// on its node to have released its sandbox's handle.
    fn delete_pod(&mut self, name: &str) {
        let side = self.pods[name];
        let sandbox = self
            .node(side)
            .containerd()
            .sandbox_id_of(name)
            .unwrap_or_else(|| panic!("{name} has no sandbox"));
        let handle = format!("k8s-pod-network.{sandbox}");
        let api = self.pair.a.api();
        api.remove(&format!("{PODS}/{name}"));
        wait_until(
            &format!("pod {name} gone and its handle released"),
            GONE_TIMEOUT,
            || {
                (api.get(&format!("{PODS}/{name}")).is_none() && !self.ipam().1.contains(&handle))
                    .then_some(())
            },
        );
        self.pods.remove(name);
    }

    /// Every expected pod Running with an address; routed to its node from the other.
    fn running(&self) -> BTreeMap<String, LivePod> {
        let api = self.pair.a.api();
        let live = wait_until(
            &format!("{} pods Running", self.pods.len()),
            RUNNING_TIMEOUT,
            || {
                let mut live = BTreeMap::new();
                for p in api.list(PODS) {
                    let name = p["metadata"]["name"].as_str().unwrap_or_default();
                    let Some(side) = self.pods.get(name) else {
                        continue;
                    };
                    if p["status"]["phase"] != "Running" {
                        continue;
                    }
                    let ip = p["status"]["podIP"].as_str()?.to_string();
                    let sandbox = self.node(*side).containerd().sandbox_id_of(name)?;
                    live.insert(
                        name.to_string(),
                        LivePod {
                            side: *side,
                            ip,
                            sandbox,
                        },
                    );
                }
                (live.len() == self.pods.len()).then_some(live)
            },
        );
        let routes = live
            .values()
            .map(|p| (p.side == Side::A, p.ip.clone()))
            .collect::<Vec<_>>();
        self.pair.route_pods(&routes);
        live
    }

    /// The blocks' allocations and the handles, from the datastore.
    fn ipam(&self) -> (Vec<Value>, BTreeSet<String>) {
        match self.store {
            Store::Kdd => {
                let api = self.pair.a.api();
                let blocks = api
                    .list(&format!("{CRD}/ipamblocks"))
                    .iter()
                    .map(|b| b["spec"].clone())
                    .collect();
                let handles = api
                    .list(&format!("{CRD}/ipamhandles"))
                    .iter()
                    .map(|h| {
                        h["spec"]["handleID"]
                            .as_str()
                            .unwrap_or_default()
                            .to_string()
                    })
                    .collect();
                (blocks, handles)
            }
            Store::Etcd => {
                let etcd = self.pair.a.api().etcd();
                let blocks = etcd
                    .get_prefix(BLOCKS_KEY)
                    .iter()
                    .map(|(_, v)| serde_json::from_str(v).expect("a block"))
                    .collect();
                let handles = etcd
                    .keys(HANDLES_KEY)
                    .iter()
                    .map(|k| k.trim_start_matches(HANDLES_KEY).to_string())
                    .collect();
                (blocks, handles)
            }
        }
    }

    /// The pod's process's PID (its sandbox's), to enter its netns.
    fn sandbox_pid(&self, pod: &LivePod) -> u32 {
        let out = self.node(pod.side).containerd().ctr(&["task", "ls"]);
        out.stdout
            .lines()
            .find_map(|l| {
                let mut f = l.split_whitespace();
                (f.next() == Some(pod.sandbox.as_str()))
                    .then(|| f.next().and_then(|p| p.parse().ok()))
                    .flatten()
            })
            .unwrap_or_else(|| panic!("no task for sandbox {}: {}", pod.sandbox, out.stdout))
    }

    /// Every pod pings every other, from its own netns (across the node link for pods of
    /// different nodes).
    fn assert_connected(&self, live: &BTreeMap<String, LivePod>, step: &str) {
        let mut failed = vec![];
        for (from, p) in live {
            let pid = self.sandbox_pid(p);
            let targets: Vec<&str> = live
                .iter()
                .filter(|(to, _)| *to != from)
                .map(|(_, q)| q.ip.as_str())
                .collect();
            let mut sh = std::process::Command::new("sh");
            sh.arg("-c").arg(format!(
                "for ip in {}; do nsenter -t {pid} -n ping -c 1 -W 2 $ip >/dev/null 2>&1 \
                 || echo $ip; done",
                targets.join(" ")
            ));
            let out = run_command_within(sh, "", Duration::from_secs(60), "ping");
            for ip in out.stdout.split_whitespace() {
                failed.push(format!("{from} -> {ip}"));
            }
        }
        assert!(
            failed.is_empty(),
            "{step}: unreachable {failed:?} ({live:?})"
        );
    }

    /// The pod's Calico annotations and its workload endpoint, with what is its own (its
    /// address, sandbox, name, node, interface) replaced by placeholders.
    fn pod_view(&self, name: &str, p: &LivePod, weps: &[Value]) -> (Value, Value) {
        let pod = self
            .pair
            .a
            .api()
            .get(&format!("{PODS}/{name}"))
            .expect("the pod");
        let own = |s: &str| {
            s.replace(&p.ip, "<ip>")
                .replace(&p.sandbox, "<sandbox>")
                .replace(name, "<pod>")
        };
        let annotations: BTreeMap<String, String> = pod["metadata"]["annotations"]
            .as_object()
            .into_iter()
            .flatten()
            .filter(|(k, _)| k.starts_with("cni.projectcalico.org/"))
            .map(|(k, v)| (k.clone(), own(v.as_str().unwrap_or_default())))
            .collect();
        let wep = weps
            .iter()
            .find(|w| w["spec"]["pod"] == name)
            .unwrap_or_else(|| panic!("no workload endpoint for {name}: {weps:?}"));
        let mut wep = without_run_identity(wep.clone());
        wep["metadata"]["name"] = json!("<name>");
        wep["spec"]["pod"] = json!("<pod>");
        wep["spec"]["node"] = json!("<node>");
        wep["spec"]["interfaceName"] = json!("<interface>");
        wep["spec"]["containerID"] = json!(own(wep["spec"]["containerID"].as_str().unwrap_or("")));
        wep["spec"]["ipNetworks"] = json!(wep["spec"]["ipNetworks"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|n| own(n.as_str().unwrap_or_default()))
            .collect::<Vec<_>>());
        (json!(annotations), wep)
    }

    /// What every step must show; returns the live pods.
    fn check(&mut self, step: &str) -> BTreeMap<String, LivePod> {
        say(&format!("{:?}: {step}", self.store));
        let live = self.running();
        let ips: BTreeSet<&str> = live.values().map(|p| p.ip.as_str()).collect();
        assert_eq!(ips.len(), live.len(), "{step}: an address twice: {live:?}");
        // The blocks hold exactly the live pods' addresses, each under its sandbox's
        // handle; no other handle exists.
        let (blocks, handles) = self.ipam();
        let held = block_holders(&blocks);
        let expected: BTreeMap<String, String> = live
            .values()
            .map(|p| (p.ip.clone(), format!("k8s-pod-network.{}", p.sandbox)))
            .collect();
        assert_eq!(held, expected, "{step}: the blocks' allocations");
        let expected_handles: BTreeSet<String> = expected.values().cloned().collect();
        assert_eq!(handles, expected_handles, "{step}: the handles");
        // Each address is from a block affine to its pod's node.
        for (name, p) in &live {
            let ip: Ipv4Addr = p.ip.parse().expect("an IPv4 address");
            let block = blocks
                .iter()
                .find(|b| {
                    let cidr = b["cidr"].as_str().unwrap_or_default();
                    let base: Ipv4Addr = cidr
                        .split('/')
                        .next()
                        .unwrap_or("")
                        .parse()
                        .unwrap_or(Ipv4Addr::UNSPECIFIED);
                    (u32::from(ip) & !63) == u32::from(base)
                })
                .unwrap_or_else(|| panic!("{step}: no block holds {name}'s {ip}"));
            assert_eq!(
                block["affinity"],
                json!(format!("host:{}", self.node(p.side).name)),
                "{step}: {name}'s block"
            );
        }
        // Annotations and workload endpoints read as the first pod's (upstream's).
        let weps: Vec<Value> = serde_json::from_str::<Value>(&self.calicoctl(
            &["get", "workloadendpoints", "-n", "default", "-o", "json"],
            "",
        ))
        .expect("calicoctl's JSON")["items"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        assert_eq!(
            weps.len(),
            live.len(),
            "{step}: workload endpoints {weps:?}"
        );
        for (name, p) in &live {
            let view = self.pod_view(name, p, &weps);
            if self.store == Store::Kdd {
                let a = &view.0;
                assert_eq!(
                    a["cni.projectcalico.org/podIP"], "<ip>/32",
                    "{step}: {name}"
                );
                assert_eq!(
                    a["cni.projectcalico.org/podIPs"], "<ip>/32",
                    "{step}: {name}"
                );
                assert_eq!(
                    a["cni.projectcalico.org/containerID"], "<sandbox>",
                    "{step}: {name}"
                );
            }
            match &self.reference {
                None => self.reference = Some(view),
                Some(r) => assert_eq!(&view, r, "{step}: {name} reads unlike the first pod"),
            }
        }
        let check = self.calicoctl(&["ipam", "check"], "");
        assert!(check.contains("found 0 problems"), "{step}: {check}");
        self.assert_connected(&live, step);
        live
    }

    fn ip_of<'a>(live: &'a BTreeMap<String, LivePod>, name: &str) -> &'a str {
        &live[name].ip
    }
}

/// The whole sequence on one datastore.
fn swap_and_roll_back(store: Store) {
    let started = std::time::Instant::now();
    let mut s = Swap::new(store);
    let upstream_bin = s.upstream_bin.clone();
    let upstream_install = Installer::Upstream(&upstream_bin);

    // Both nodes set up by upstream's installer; pods on both.
    let upstream_a = s.install(Side::A, upstream_install);
    let upstream_b = s.install(Side::B, upstream_install);
    assert_ne!(upstream_a, upstream_b, "each node's config names the node");
    s.pair.a.start_runtime();
    s.pair.b.start_runtime();
    assert!(s.runs_upstream(Side::A) && s.runs_upstream(Side::B));
    s.create_pod("swap-pod-1", Side::A);
    s.create_pod("swap-pod-2", Side::A);
    s.create_pod("swap-pod-3", Side::B);
    let before = s.check("upstream on both nodes");

    // Node A swapped to ours while its pods run: the same config, ours' binaries.
    let ours_a = s.install(Side::A, Installer::Ours);
    assert!(!s.runs_upstream(Side::A), "node A runs ours");
    assert_eq!(ours_a, upstream_a, "node A's net.d after our install");
    let swapped = s.check("node A swapped to ours");
    for pod in ["swap-pod-1", "swap-pod-2", "swap-pod-3"] {
        assert_eq!(
            Swap::ip_of(&swapped, pod),
            Swap::ip_of(&before, pod),
            "{pod} keeps its address"
        );
    }
    s.create_pod("swap-pod-4", Side::A);
    let with_new = s.check("ours networked a new pod on A");
    let block = |ip: &str| u32::from(ip.parse::<Ipv4Addr>().expect("IPv4")) & !63;
    assert_eq!(
        block(Swap::ip_of(&with_new, "swap-pod-4")),
        block(Swap::ip_of(&before, "swap-pod-1")),
        "the new pod's address is from A's block"
    );
    s.delete_pod("swap-pod-1");
    s.check("ours DELed a pod upstream had networked");

    // Rolled back: upstream's installer again, and its plugin DELs what ours made.
    let back_a = s.install(Side::A, upstream_install);
    assert!(s.runs_upstream(Side::A), "node A runs upstream again");
    assert_eq!(back_a, upstream_a, "node A's net.d after the rollback");
    s.check("node A rolled back to upstream");
    s.delete_pod("swap-pod-4");
    s.check("upstream DELed the pod ours had networked");
    s.create_pod("swap-pod-5", Side::A);
    s.check("upstream networked a new pod on A");

    for pod in ["swap-pod-2", "swap-pod-3", "swap-pod-5"] {
        s.delete_pod(pod);
    }
    s.check("every pod deleted");
    say(&format!(
        "{store:?}: swapped to ours and rolled back, every step clean, in {:.0?}",
        started.elapsed()
    ));
}

#[test]
#[ignore = "needs upstream's binaries: make upstream-check"]
fn rolling_swap_and_rollback_on_kdd() {
    swap_and_roll_back(Store::Kdd);
}

#[test]
#[ignore = "needs upstream's binaries: make upstream-check"]
fn rolling_swap_and_rollback_on_etcd() {
    swap_and_roll_back(Store::Etcd);
}
