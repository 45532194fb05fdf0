//! The differential suite's world: one test "host" netns holding an etcd and a real
//! kube-apiserver on it (v1.35, Calico's v3.32.1 CRDs, the plugin's upstream RBAC), and the
//! node's files. Every case starts it fresh: [`DiffWorld::reset`] wipes what the last case
//! left (Calico's keys and custom resources, pods, the pod netns, host veths, the node's
//! files) and seeds the case's objects, so both binaries start every case from the same
//! world.
//!
//! Each call runs as kubelet runs a plugin, inside the host netns, with an environment of
//! only the CNI variables, and in a mount namespace of its own where `/var/lib/calico`,
//! `/var/run/calico`, `/var/lib/cni`, `/var/log/calico` and `/etc/cni/net.d` are the
//! case's own folders: the paths upstream's binaries hard-code (the MTU file, the IPAM
//! lock, the upgrade marker, host-local's data) are the same for both binaries and never
//! the real host's.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};

use crate::common::cni::{run_command_within, Outcome, TempDir};
use crate::common::grpc_dataplane::{GrpcDataplane, Received, Reply};
use crate::common::netns::{HostNetns, Netns};
use crate::common::real_k8s::RealK8s;
use crate::common::world::merge;

use super::case::{Case, NetnsArg, Step, Store};
use super::etcd_kv::EtcdKv;
use super::observe::{netns_state, Norm, State};

pub const NODE: &str = "node1";
const CRD: &str = "/apis/crd.projectcalico.org/v1";
pub const KUBEVIRT: &str = "/apis/kubevirt.io/v1";
/// The node folders each call sees as its own: (folder in the case's files, mount point).
const NODE_DIRS: [(&str, &str); 5] = [
    ("var-lib-calico", "/var/lib/calico"),
    ("var-run-calico", "/run/calico"),
    ("var-lib-cni", "/var/lib/cni"),
    ("var-log-calico", "/var/log/calico"),
    ("etc-cni", "/etc/cni/net.d"),
];
/// The gRPC agent's socket, as the plugin sees it.
pub const GRPC_SOCKET: &str = "/var/run/calico/grpc.sock";
/// How long one call may take before the harness calls it a hang.
const CALL_LIMIT: Duration = Duration::from_secs(90);

/// Which binary a call runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Ours,
    Upstream,
}

impl Side {
    pub fn name(self) -> &'static str {
        match self {
            Side::Ours => "ours",
            Side::Upstream => "upstream",
        }
    }
}

/// A CNI_PATH: `calico`, `calico-ipam` (a symlink to it, as both images ship it), and the
/// reference plugins the cases name.
struct BinDir(TempDir);

impl BinDir {
    fn new(calico: &Path, label: &str) -> BinDir {
        let dir = TempDir::new(&format!("diff-bin-{label}"));
        std::os::unix::fs::symlink(calico, dir.path().join("calico")).expect("link calico");
        std::os::unix::fs::symlink("calico", dir.path().join("calico-ipam"))
            .expect("link calico-ipam");
        for p in ["host-local", "loopback", "portmap"] {
            let src = Path::new("/usr/lib/cni").join(p);
            if src.exists() {
                std::os::unix::fs::symlink(&src, dir.path().join(p)).expect("link a plugin");
            }
        }
        BinDir(dir)
    }
}

/// Field order is drop order: the pods and the agent go first, the servers, then the host.
pub struct DiffWorld {
    pods: Vec<Netns>,
    agent: Option<GrpcDataplane>,
    kv: EtcdKv,
    k8s: RealK8s,
    host: HostNetns,
    ours: BinDir,
    upstream: Option<BinDir>,
    files: TempDir,
    /// A kubeconfig with the admin's token.
    admin_kubeconfig: PathBuf,
    /// A kubeconfig with a token the API server refuses.
    bad_kubeconfig: PathBuf,
    /// The host netns's own state, before any case.
    host_baseline: State,
    /// Calico's resource kinds (the CRDs' plurals).
    plurals: Vec<String>,
    /// The namespaces any case has seeded (they cannot be deleted: no controller-manager).
    namespaces: Vec<String>,
    /// The state after the last reset or step.
    pub state: State,
    pub norm: Norm,
}

impl DiffWorld {
    /// Starts the servers; `upstream` is the folder of upstream's binaries, when there is
    /// one.
    pub fn start(upstream: Option<&Path>) -> DiffWorld {
        for (_, mount) in NODE_DIRS {
            std::fs::create_dir_all(mount).expect("a mount point for the node's folders");
        }
        let host = HostNetns::new();
        let k8s = RealK8s::start(&host);
        install_kubevirt(&k8s);
        let kv = EtcdKv::connect(host.path(), &k8s.etcd().endpoint());
        let plurals = k8s
            .get(CRD)
            .and_then(|d| {
                d["resources"].as_array().map(|r| {
                    r.iter()
                        .filter_map(|r| r["name"].as_str())
                        .filter(|n| !n.contains('/'))
                        .map(str::to_string)
                        .collect()
                })
            })
            .expect("Calico's resources are served");
        let ours = BinDir::new(Path::new(env!("CARGO_BIN_EXE_calico")), "ours");
        let admin_kubeconfig = k8s.kubeconfig_with(&k8s.admin_token());
        let bad_kubeconfig = k8s.kubeconfig_with("0123456789abcdef-not-a-token");
        let upstream = upstream.map(|dir| BinDir::new(&dir.join("calico"), "upstream"));
        let mut w = DiffWorld {
            pods: Vec::new(),
            agent: None,
            kv,
            k8s,
            host,
            ours,
            upstream,
            files: TempDir::new("diff-files"),
            admin_kubeconfig,
            bad_kubeconfig,
            host_baseline: State::new(),
            plurals,
            namespaces: vec!["default".into()],
            state: State::new(),
            norm: Norm::default(),
        };
        let mut baseline = State::new();
        netns_state(w.host.name(), "host", &Norm::default(), &mut baseline);
        w.host_baseline = baseline;
        w
    }

    fn node_dir(&self, name: &str) -> PathBuf {
        self.files.path().join(name)
    }

    /// The world as the case starts it: everything the last case left is gone, the case's
    /// objects and files are there, and its pod netns made. Sets [`DiffWorld::state`] and
    /// [`DiffWorld::norm`].
    pub fn reset(&mut self, case: &Case) {
        self.pods.clear();
        self.agent = None;
        self.remove_host_veths();
        // The node's files.
        let _ = std::fs::remove_dir_all(self.files.path());
        for (dir, _) in NODE_DIRS {
            std::fs::create_dir_all(self.node_dir(dir)).expect("a node folder");
        }
        let seed = &case.seed;
        if seed.nodename_file {
            std::fs::write(self.node_dir("var-lib-calico").join("nodename"), NODE)
                .expect("the nodename file");
        }
        if let Some(mtu) = &seed.mtu_file {
            std::fs::write(self.node_dir("var-lib-calico").join("mtu"), mtu).expect("the MTU file");
        }
        std::fs::copy(
            self.k8s.kubeconfig(),
            self.node_dir("etc-cni").join("calico-kubeconfig"),
        )
        .expect("the plugin's kubeconfig");
        // calico/node's rights, for what its init container runs (`calico-ipam -upgrade`).
        std::fs::copy(
            &self.admin_kubeconfig,
            self.node_dir("etc-cni").join("node-kubeconfig"),
        )
        .expect("calico/node's kubeconfig");
        // A token the API server does not know (an expired one).
        std::fs::copy(
            &self.bad_kubeconfig,
            self.node_dir("etc-cni").join("bad-kubeconfig"),
        )
        .expect("a kubeconfig with a wrong token");
        if !seed.host_local_files.is_empty() {
            let d = self
                .node_dir("var-lib-cni")
                .join("networks/k8s-pod-network");
            std::fs::create_dir_all(&d).expect("host-local's folder");
            for (name, content) in &seed.host_local_files {
                std::fs::write(d.join(name), content).expect("a host-local file");
            }
        }
        if seed.grpc_agent {
            let agent = GrpcDataplane::start(Reply::success("grpc-host0", "0a:58:0a:00:00:01"));
            std::fs::create_dir_all(self.node_dir("var-run-calico")).ok();
            std::os::unix::fs::symlink(
                agent.socket(),
                self.node_dir("var-run-calico").join("grpc.sock"),
            )
            .expect("link the agent's socket");
            self.agent = Some(agent);
        }
        self.seed_etcd(case);
        self.seed_api(case);
        self.pods = (0..case.pod_netns).map(|_| Netns::new("diffpod")).collect();
        let mut fixed = vec![
            (
                self.k8s.etcd().endpoint().replace("http://", ""),
                "<etcd-addr>".to_string(),
            ),
            (self.k8s.url().replace("https://", ""), "<api-addr>".into()),
            (self.files.path().display().to_string(), "<files>".into()),
            (
                self.ours.0.path().display().to_string(),
                "<cni-path>".into(),
            ),
        ];
        if let Some(u) = &self.upstream {
            fixed.push((u.0.path().display().to_string(), "<cni-path>".into()));
        }
        for (i, p) in self.pods.iter().enumerate() {
            fixed.push((p.path().to_string(), format!("<netns{i}>")));
            fixed.push((p.name().to_string(), format!("<netns{i}-name>")));
        }
        if let Some(a) = &self.agent {
            fixed.push((a.socket().display().to_string(), GRPC_SOCKET.into()));
        }
        let input = serde_json::to_string(case).unwrap_or_default();
        self.norm = Norm::new(fixed, &input);
        self.state = self.observe_state(case);
    }

    /// The host netns as it was before any case: links a case made removed (their routes
    /// and sysctls go with them), global sysctls a case changed written back.
    fn remove_host_veths(&self) {
        let capture = || {
            let mut now = State::new();
            netns_state(self.host.name(), "host", &Norm::default(), &mut now);
            now
        };
        let mut now = capture();
        let extra: Vec<String> = now
            .keys()
            .filter(|k| !self.host_baseline.contains_key(*k))
            .filter_map(|k| k.strip_prefix("host:link:").map(str::to_string))
            .collect();
        if !extra.is_empty() {
            for name in &extra {
                let _ = Command::new("ip")
                    .args(["-n", self.host.name(), "link", "del", name])
                    .output();
            }
            now = capture();
        }
        if now == self.host_baseline {
            return;
        }
        for (k, v) in &self.host_baseline {
            if let (Some(path), Some(v)) = (k.strip_prefix("host:sysctl:"), v.as_str()) {
                if now.get(k).and_then(Value::as_str) != Some(v) {
                    self.host.set_sysctl(path, v);
                }
            }
        }
        assert_eq!(
            capture(),
            self.host_baseline,
            "the host netns could not be set back as it was"
        );
    }

    fn seed_etcd(&self, case: &Case) {
        let seed = &case.seed;
        let mut pairs = Vec::new();
        if case.store == Store::Etcd {
            let v3 = "/calico/resources/v3/projectcalico.org";
            let meta = |name: &str, n: u8| {
                json!({"name": name, "uid": format!("00000000-0000-4000-8000-0000000000{n:02}"),
                    "creationTimestamp": "2026-01-01T00:00:00Z"})
            };
            if let Some(ready) = seed.cluster_ready {
                pairs.push((
                    format!("{v3}/clusterinformations/default"),
                    json!({"kind":"ClusterInformation","apiVersion":"projectcalico.org/v3",
                        "metadata": meta("default", 1),
                        "spec":{"clusterGUID":"abc","clusterType":"k8s,bgp","calicoVersion":"v3.32.1","datastoreReady":ready}}),
                ));
            }
            if seed.node {
                let mut md = meta(NODE, 2);
                md["labels"] = json!({"kubernetes.io/hostname": NODE});
                pairs.push((
                    format!("{v3}/nodes/{NODE}"),
                    json!({"kind":"Node","apiVersion":"projectcalico.org/v3","metadata": md,
                        "spec":{"bgp":{"ipv4Address":"192.0.2.10/24"},"orchRefs":[{"nodeName":NODE,"orchestrator":"k8s"}]}}),
                ));
            }
            for (i, p) in seed.pools.iter().enumerate() {
                pairs.push((
                    format!("{v3}/ippools/{}", p.name),
                    json!({"kind":"IPPool","apiVersion":"projectcalico.org/v3",
                        "metadata": meta(&p.name, 10 + i as u8), "spec": pool_spec(p)}),
                ));
            }
            for (i, (name, cidrs)) in seed.reservations.iter().enumerate() {
                pairs.push((
                    format!("{v3}/ipreservations/{name}"),
                    json!({"kind":"IPReservation","apiVersion":"projectcalico.org/v3",
                        "metadata": meta(name, 30 + i as u8), "spec": {"reservedCIDRs": cidrs}}),
                ));
            }
            if let Some(c) = &seed.ipam_config {
                pairs.push(("/calico/ipam/v2/config".into(), c.clone()));
            }
        }
        self.kv.replace(
            "/calico/",
            pairs.into_iter().map(|(k, v)| (k, v.to_string())).collect(),
        );
    }

    fn seed_api(&mut self, case: &Case) {
        let seed = &case.seed;
        let ct = "application/json".to_string();
        // Away with every Calico object and every pod of the namespaces cases use.
        let mut wipe: Vec<_> = self
            .plurals
            .iter()
            .map(|p| ("DELETE".to_string(), format!("{CRD}/{p}"), None, ct.clone()))
            .collect();
        for ns in &self.namespaces {
            wipe.push((
                "DELETE".into(),
                format!("/api/v1/namespaces/{ns}/pods?gracePeriodSeconds=0"),
                Some(json!({"apiVersion":"v1","kind":"DeleteOptions","gracePeriodSeconds":0})),
                ct.clone(),
            ));
        }
        wipe.push((
            "DELETE".into(),
            format!("/api/v1/nodes/{NODE}"),
            None,
            ct.clone(),
        ));
        for ns in &self.namespaces {
            for plural in ["virtualmachineinstances", "virtualmachines"] {
                wipe.push((
                    "DELETE".into(),
                    format!("{KUBEVIRT}/namespaces/{ns}/{plural}"),
                    None,
                    ct.clone(),
                ));
            }
        }
        for a in self.k8s.request_all(wipe) {
            assert!(
                a.status < 300 || a.status == 404,
                "wiping the API server: {a:?}"
            );
        }
        // The core Node (on both datastores: a Kubernetes node has one).
        if seed.node {
            let mut md = json!({"name":NODE,"labels":{"kubernetes.io/hostname":NODE}});
            if seed.node_bgp {
                md["annotations"] = json!({"projectcalico.org/IPv4Address": "192.0.2.10/24"});
            }
            self.k8s.put(
                &format!("/api/v1/nodes/{NODE}"),
                json!({"apiVersion":"v1","kind":"Node","metadata": md,
                    "spec":{"podCIDR":"10.244.1.0/24","podCIDRs":["10.244.1.0/24","fd00:244:1::/64"]}}),
            );
        }
        let mut namespaces: Vec<&str> = self.namespaces.iter().map(String::as_str).collect();
        for ns in &seed.namespaces {
            if !namespaces.contains(&ns.name.as_str()) {
                namespaces.push(&ns.name);
            }
        }
        let namespaces: Vec<String> = namespaces.into_iter().map(str::to_string).collect();
        for ns in &namespaces {
            let s = seed.namespaces.iter().find(|s| &s.name == ns);
            let labels = s.map(|s| s.labels.clone()).unwrap_or(Value::Null);
            let annotations = s.map(|s| s.annotations.clone()).unwrap_or(Value::Null);
            let mut md = json!({"name": ns});
            if !labels.is_null() {
                md["labels"] = labels;
            }
            if !annotations.is_null() {
                md["annotations"] = annotations;
            }
            self.k8s.put(
                &format!("/api/v1/namespaces/{ns}"),
                json!({"apiVersion":"v1","kind":"Namespace","metadata": md}),
            );
        }
        self.namespaces = namespaces;
        if case.store == Store::Kdd {
            let mut objects = Vec::new();
            let cr = |kind: &str, name: &str, spec: Value| json!({"apiVersion":"crd.projectcalico.org/v1","kind":kind,"metadata":{"name":name},"spec":spec});
            if let Some(ready) = seed.cluster_ready {
                objects.push((
                    "clusterinformations",
                    cr("ClusterInformation", "default",
                        json!({"clusterGUID":"abc","clusterType":"k8s,kdd","calicoVersion":"v3.32.1","datastoreReady":ready})),
                ));
            }
            for p in &seed.pools {
                objects.push(("ippools", cr("IPPool", &p.name, pool_spec(p))));
            }
            for (name, cidrs) in &seed.reservations {
                objects.push((
                    "ipreservations",
                    cr("IPReservation", name, json!({"reservedCIDRs": cidrs})),
                ));
            }
            if let Some(c) = &seed.ipam_config {
                objects.push(("ipamconfigs", cr("IPAMConfig", "default", c.clone())));
            }
            let reqs = objects
                .into_iter()
                .map(|(plural, o)| {
                    (
                        "POST".into(),
                        format!("{CRD}/{plural}"),
                        Some(o),
                        ct.clone(),
                    )
                })
                .collect();
            for a in self.k8s.request_all(reqs) {
                assert_eq!(a.status, 201, "seeding Calico's objects: {a:?}");
            }
        }
        // In order (a VMI names its VM, a pod its VMI), each object's UID given to those
        // after it that name it.
        let mut uids: Vec<(String, String)> = Vec::new();
        let with_uids = |v: &Value, uids: &[(String, String)]| -> Value {
            let mut text = v.to_string();
            for (path, uid) in uids {
                text = text.replace(&format!("{{uid:{path}}}"), uid);
            }
            serde_json::from_str(&text).expect("JSON")
        };
        for (path, o) in &seed.api_objects {
            let collection = path.rsplit_once('/').map(|(c, _)| c).unwrap_or(path);
            let r = (
                "POST".to_string(),
                collection.to_string(),
                Some(with_uids(o, &uids)),
                ct.clone(),
            );
            let a = self.k8s.request_all(vec![r]).remove(0);
            assert_eq!(a.status, 201, "seeding {path}: {a:?}");
            let uid = a.body["metadata"]["uid"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            uids.push((path.clone(), uid));
        }
        let mut reqs = Vec::new();
        for p in &seed.pods {
            let mut pod = json!({"apiVersion":"v1","kind":"Pod",
                "metadata":{"name":p.name,"namespace":p.namespace},
                "spec":{"nodeName":NODE,"serviceAccountName":"default","containers":[{"name":"c","image":"busybox",
                    "ports":[{"name":"http","containerPort":8080,"protocol":"TCP"}]}]}});
            if !p.labels.is_null() {
                pod["metadata"]["labels"] = p.labels.clone();
            }
            if !p.annotations.is_null() {
                pod["metadata"]["annotations"] = p.annotations.clone();
            }
            merge(&mut pod, p.extra.clone());
            reqs.push((
                "POST".to_string(),
                format!("/api/v1/namespaces/{}/pods", p.namespace),
                Some(with_uids(&pod, &uids)),
                ct.clone(),
            ));
        }
        for a in self.k8s.request_all(reqs) {
            assert_eq!(a.status, 201, "seeding a pod: {a:?}");
        }
    }

    /// The world's state now (see observe.rs).
    pub fn observe_state(&self, case: &Case) -> State {
        let mut s = State::new();
        let norm = &self.norm;
        for (k, v) in self.kv.dump("/calico/") {
            let v = serde_json::from_str(&v).unwrap_or(Value::String(v));
            s.insert(norm.text(&format!("etcd:{k}")), norm.value(&v));
        }
        let mut paths: Vec<String> = Vec::new();
        if case.store == Store::Kdd {
            paths.extend(self.plurals.iter().map(|p| format!("{CRD}/{p}")));
        }
        for ns in &self.namespaces {
            paths.push(format!("/api/v1/namespaces/{ns}/pods"));
        }
        paths.push(format!("/api/v1/nodes/{NODE}"));
        for (path, _) in &case.seed.api_objects {
            if !path.starts_with(CRD) && !path.starts_with("/api/v1/") {
                let collection = path.rsplit_once('/').map(|(c, _)| c).unwrap_or(path);
                if !paths.iter().any(|p| p == collection) {
                    paths.push(collection.to_string());
                }
            }
        }
        let reqs = paths
            .iter()
            .map(|p| ("GET".to_string(), p.clone(), None, String::new()))
            .collect();
        for (path, a) in paths.iter().zip(self.k8s.request_all(reqs)) {
            if a.status == 404 {
                continue;
            }
            assert_eq!(a.status, 200, "GET {path}: {a:?}");
            let items = match a.body["items"].as_array() {
                Some(items) => items.clone(),
                None => vec![a.body.clone()],
            };
            let resource = if path.ends_with("/pods") {
                "pods".to_string()
            } else if path.starts_with("/api/v1/nodes/") {
                "nodes".to_string()
            } else {
                path.rsplit('/').next().unwrap_or_default().to_string()
            };
            for o in items {
                let md = &o["metadata"];
                let name = match md["namespace"].as_str() {
                    Some(ns) => format!("{ns}/{}", md["name"].as_str().unwrap_or_default()),
                    None => md["name"].as_str().unwrap_or_default().to_string(),
                };
                let v = match resource.as_str() {
                    // What Calico writes of a pod and a Node: annotations and status; the
                    // Node's labels.
                    "pods" => {
                        json!({"annotations": md["annotations"], "labels": md["labels"], "status": o["status"]})
                    }
                    "nodes" => json!({"annotations": md["annotations"], "labels": md["labels"]}),
                    _ => o.clone(),
                };
                s.insert(norm.text(&format!("k8s:{resource}/{name}")), norm.value(&v));
            }
        }
        for (i, p) in self.pods.iter().enumerate() {
            netns_state(p.name(), &format!("pod{i}"), norm, &mut s);
        }
        netns_state(self.host.name(), "host", norm, &mut s);
        if let Some(a) = &self.agent {
            for (i, r) in a.received().iter().enumerate() {
                s.insert(format!("agent:{i}"), norm.value(&received_json(r)));
            }
        }
        s
    }

    /// Runs one step with `side`'s binary; `prev` is the last successful ADD's result.
    pub fn call(&self, step: &Step, side: Side, prev: Option<&Value>) -> Outcome {
        let bins = match side {
            Side::Ours => &self.ours,
            Side::Upstream => self
                .upstream
                .as_ref()
                .expect("upstream's binaries (CALICO_UPSTREAM_BIN)"),
        };
        let plugin = bins.0.path().join(&step.plugin);
        let mut cmd = Command::new(&plugin);
        cmd.args(&step.argv);
        self.enter_node(&mut cmd);
        cmd.env_clear().env(
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        );
        if step.argv.is_empty() {
            let netns = match &step.netns {
                NetnsArg::Pod(i) => self.pods[*i].path().to_string(),
                NetnsArg::Literal(s) => s.clone(),
            };
            for (k, v) in [
                ("CNI_COMMAND", step.command.as_str()),
                ("CNI_CONTAINERID", step.container_id.as_str()),
                ("CNI_NETNS", netns.as_str()),
                ("CNI_IFNAME", step.ifname.as_str()),
                ("CNI_ARGS", step.cni_args.as_str()),
                ("CNI_PATH", &bins.0.path().display().to_string()),
            ] {
                cmd.env(k, v);
            }
        }
        for (k, v) in &step.env {
            cmd.env(k, self.fill(v));
        }
        let stdin = match &step.raw_stdin {
            Some(raw) => raw.clone(),
            None => {
                let mut conf: Value =
                    serde_json::from_str(&self.fill(&step.conf.to_string())).expect("a conf");
                if step.prev_result {
                    if let Some(prev) = prev {
                        conf["prevResult"] = prev.clone();
                    }
                }
                conf.to_string()
            }
        };
        run_command_within(
            cmd,
            &stdin,
            CALL_LIMIT,
            &format!("{} {} {}", side.name(), step.plugin, step.command),
        )
    }

    /// Makes `cmd` run as a plugin runs on this node: in the host netns, in a mount
    /// namespace of its own (as `ip netns exec` makes one: `/` a slave, `/sys` this netns's)
    /// where the node's folders are the case's own (`NODE_DIRS`). Done in the child between
    /// fork and exec, with syscalls alone (no `ip`, `unshare`, `sh` or `mount` processes).
    fn enter_node(&self, cmd: &mut Command) {
        use std::ffi::CString;
        use std::os::fd::AsRawFd;
        use std::os::unix::process::CommandExt;
        let netns = std::fs::File::open(self.host.path()).expect("open the host netns");
        let c = |s: &str| CString::new(s).expect("a path without NUL");
        let binds: Vec<(CString, CString)> = NODE_DIRS
            .iter()
            .map(|(dir, mount)| (c(&self.node_dir(dir).display().to_string()), c(mount)))
            .collect();
        let (root, sys, sysfs) = (c("/"), c("/sys"), c("sysfs"));
        // SAFETY: the closure runs in the forked child before exec and only makes syscalls
        // on memory prepared before the fork (no allocation, no locks).
        unsafe {
            cmd.pre_exec(move || {
                let check = |r: libc::c_int| match r {
                    0 => Ok(()),
                    _ => Err(std::io::Error::last_os_error()),
                };
                check(libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET))?;
                check(libc::unshare(libc::CLONE_NEWNS))?;
                let none = std::ptr::null();
                check(libc::mount(
                    none,
                    root.as_ptr(),
                    none,
                    libc::MS_SLAVE | libc::MS_REC,
                    std::ptr::null(),
                ))?;
                check(libc::umount2(sys.as_ptr(), libc::MNT_DETACH))?;
                check(libc::mount(
                    sysfs.as_ptr(),
                    sys.as_ptr(),
                    sysfs.as_ptr(),
                    0,
                    std::ptr::null(),
                ))?;
                for (src, dst) in &binds {
                    check(libc::mount(
                        src.as_ptr(),
                        dst.as_ptr(),
                        none,
                        libc::MS_BIND,
                        std::ptr::null(),
                    ))?;
                }
                Ok(())
            });
        }
    }

    /// `s` with the world's placeholders filled in.
    fn fill(&self, s: &str) -> String {
        s.replace("{etcd}", &self.k8s.etcd().endpoint())
    }
}

/// What the gRPC agent was sent, as JSON (its maps in key order).
fn received_json(r: &Received) -> Value {
    let map = |m: &std::collections::HashMap<String, String>| -> Value {
        json!(m.iter().collect::<std::collections::BTreeMap<_, _>>())
    };
    match r {
        Received::Add(a) => {
            let w = a.workload.as_ref();
            json!({"add": {
                "interface_name": a.interface_name, "netns": a.netns,
                "desired_host_interface_name": a.desired_host_interface_name,
                "settings": a.settings.as_ref().map(|s| json!({"allow_ip_forwarding": s.allow_ip_forwarding, "mtu": s.mtu})),
                "container_ips": a.container_ips.iter().map(|i| json!({"address": i.address, "gateway": i.gateway})).collect::<Vec<_>>(),
                "container_routes": a.container_routes,
                "workload": w.map(|w| json!({"name": w.name, "namespace": w.namespace, "labels": map(&w.labels),
                    "annotations": map(&w.annotations), "endpoint": w.endpoint, "node": w.node,
                    "orchestrator": w.orchestrator, "pod": w.pod,
                    "ports": w.ports.iter().map(|p| json!({"name": p.name, "protocol": p.protocol, "port": p.port,
                        "host_port": p.host_port, "host_ip": p.host_ip})).collect::<Vec<_>>()})),
                "dataplane_options": map(&a.dataplane_options),
            }})
        }
        Received::Del(d) => json!({"del": {"interface_name": d.interface_name, "netns": d.netns,
            "dataplane_options": map(&d.dataplane_options)}}),
    }
}

/// KubeVirt's VirtualMachine and VirtualMachineInstance (kubevirt.io/v1, any content), as
/// the KubeVirt cases need them; served before returning.
fn install_kubevirt(k8s: &RealK8s) {
    let reqs = [
        ("VirtualMachine", "virtualmachines", "vm"),
        ("VirtualMachineInstance", "virtualmachineinstances", "vmi"),
    ]
    .into_iter()
    .map(|(kind, plural, short)| {
        let crd = json!({"apiVersion":"apiextensions.k8s.io/v1","kind":"CustomResourceDefinition",
            "metadata":{"name": format!("{plural}.kubevirt.io")},
            "spec":{"group":"kubevirt.io","scope":"Namespaced",
                "names":{"kind":kind,"plural":plural,"singular":kind.to_lowercase(),"shortNames":[short]},
                "versions":[{"name":"v1","served":true,"storage":true,
                    "schema":{"openAPIV3Schema":{"type":"object","x-kubernetes-preserve-unknown-fields":true}}}]}});
        (
            "POST".to_string(),
            "/apis/apiextensions.k8s.io/v1/customresourcedefinitions".to_string(),
            Some(crd),
            "application/json".to_string(),
        )
    })
    .collect();
    for a in k8s.request_all(reqs) {
        assert!(a.status == 201 || a.status == 409, "KubeVirt's CRDs: {a:?}");
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !k8s.get(KUBEVIRT).is_some_and(|d| {
        let names: Vec<&str> = d["resources"]
            .as_array()
            .map(|r| r.iter().filter_map(|r| r["name"].as_str()).collect())
            .unwrap_or_default();
        names.contains(&"virtualmachines") && names.contains(&"virtualmachineinstances")
    }) {
        assert!(
            std::time::Instant::now() < deadline,
            "KubeVirt's CRDs not served"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// An IPPool's spec as calico/node and calicoctl write it.
fn pool_spec(p: &super::case::Pool) -> Value {
    let mut spec = json!({"cidr": p.cidr, "blockSize": p.block_size, "ipipMode": "Never",
        "vxlanMode": "Never", "natOutgoing": true, "nodeSelector": p.node_selector,
        "allowedUses": ["Workload", "Tunnel"]});
    if p.disabled {
        spec["disabled"] = json!(true);
    }
    spec
}
