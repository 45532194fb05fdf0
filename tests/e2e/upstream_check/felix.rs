//! Felix v3.32.1 on etcd, with the node's pods networked by ours and, as the control, by
//! upstream's plugin: Felix programs the same rules, ipsets and routes for both, a policy
//! denying one pod's traffic to the other is enforced and its removal restores traffic,
//! and after DEL Felix's state for the pod is gone. calicoctl reads the same endpoints,
//! profile and blocks from both.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};

use super::{calicoctl_ok, upstream, without_run_identity, Daemon};
use crate::common::cni::{Bin, Invocation, Outcome, TempDir};
use crate::common::kdd::KddWorld;
use crate::common::netns::{ping_available, require_root, Netns};
use crate::common::world::World;

/// Felix in the world's host netns, in a mount namespace of its own where the node's
/// `/var/lib/calico` (Felix writes its MTU file there) is a scratch folder; its endpoint
/// status files go to another. Killed (by PID) on drop.
struct Felix {
    daemon: Daemon,
    status: TempDir,
    /// `cni` or `k8s`: the status files' first word.
    orchestrator: &'static str,
    _lib: TempDir,
}

impl Felix {
    /// Felix for node `node1` in `host`, on the datastore `datastore` names (libcalico-go's
    /// variables: Felix v3.32.1 connects with those, its FELIX_DATASTORETYPE is not applied
    /// to the connection); its log in `scratch`. Returns once its dataplane is in sync.
    fn start(
        host: &Netns,
        scratch: &Path,
        datastore: &[(&str, String)],
        orchestrator: &'static str,
    ) -> Felix {
        let lib = TempDir::new("felix-lib");
        let status = TempDir::new("felix-status");
        std::fs::create_dir_all("/var/lib/calico").expect("mount point /var/lib/calico");
        let mut env: Vec<(&str, String)> = datastore.to_vec();
        env.extend([
            ("FELIX_FELIXHOSTNAME", crate::common::world::NODE.into()),
            ("FELIX_LOGSEVERITYSCREEN", "info".into()),
            ("FELIX_LOGFILEPATH", "none".into()),
            ("FELIX_LOGSEVERITYSYS", "none".into()),
            ("FELIX_HEALTHENABLED", "true".into()),
            ("FELIX_HEALTHHOST", "127.0.0.1".into()),
            ("FELIX_USAGEREPORTINGENABLED", "false".into()),
            ("FELIX_REPORTINGINTERVALSECS", "0".into()),
            ("FELIX_IPTABLESBACKEND", "Legacy".into()),
            (
                "FELIX_ENDPOINTSTATUSPATHPREFIX",
                status.path().display().to_string(),
            ),
            // A build without cgo has no libbpf: skip the one BPF clean-up the iptables
            // dataplane makes at start.
            ("FELIX_DebugSkipCTLBCleanup", "true".into()),
        ]);
        let script = format!(
            "mount --bind {} /var/lib/calico && exec {}",
            lib.path().display(),
            upstream("calico-felix").display()
        );
        let argv = [
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            &script,
        ];
        let daemon = Daemon::spawn(host, &argv, &env, &scratch.join("felix.log"));
        let felix = Felix {
            daemon,
            status,
            orchestrator,
            _lib: lib,
        };
        felix.wait_for("Felix's dataplane to be ready", || {
            readiness(host).is_some_and(|body| body.contains("InternalDataplaneMainLoop"))
                && felix
                    .daemon
                    .log_text()
                    .contains("flushing the dataplane for the first time")
        });
        felix
    }

    /// Felix's status file for workload `name` of namespace `default` (a container ID
    /// outside Kubernetes, a pod's name in it): it appears once the endpoint is programmed
    /// and up, and goes with the endpoint.
    fn status_file(&self, name: &str) -> PathBuf {
        self.status
            .path()
            .join("endpoint-status")
            .join(format!("{} default%2F{name} eth0", self.orchestrator))
    }

    fn wait_for(&self, what: &str, done: impl FnMut() -> bool) {
        self.daemon.wait_for(what, Duration::from_secs(30), done);
    }
}

/// Felix's `/readiness` body, asked inside the host netns.
fn readiness(host: &Netns) -> Option<String> {
    host.run_in(|| {
        let mut s = TcpStream::connect(("127.0.0.1", 9099)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        s.write_all(b"GET /readiness HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            .ok()?;
        let mut body = String::new();
        s.read_to_string(&mut body).ok()?;
        body.starts_with("HTTP/1.0 200").then_some(body)
    })
}

/// What Felix has programmed in the host netns, normalized only of counters: every
/// iptables table, every ipset, the routes.
fn dataplane(host: &Netns) -> Value {
    let mut tables = serde_json::Map::new();
    for t in ["filter", "nat", "mangle", "raw"] {
        let text = host.exec_ok("iptables-legacy-save", &["-t", t]);
        let rules: Vec<String> = text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .map(|l| match l.split_once(' ') {
                // `:chain policy [packets:bytes]`
                Some((chain, rest)) if chain.starts_with(':') => {
                    format!("{chain} {}", rest.split(' ').next().unwrap_or_default())
                }
                _ => l.to_string(),
            })
            .collect();
        tables.insert(t.into(), json!(rules));
    }
    // In any order, without each set's random hash seed and the host's link-local address
    // (made from its uplink's random MAC).
    let mut ipsets: Vec<String> = host
        .exec_ok("ipset", &["save"])
        .lines()
        .filter(|l| !l.contains(" fe80::"))
        .map(|l| l.split(" initval ").next().unwrap_or(l).to_string())
        .collect();
    ipsets.sort();
    let routes: Vec<String> = [vec!["-4", "route", "show"], vec!["-6", "route", "show"]]
        .iter()
        .flat_map(|args| {
            host.ip(args)
                .lines()
                // The kernel's link-local routes come and go with DAD.
                .filter(|l| !l.starts_with("fe80::"))
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect();
    json!({"iptables": tables, "ipsets": ipsets, "routes": routes})
}

fn pings(from: &Netns, to: &str) -> bool {
    from.exec("ping", &["-c", "1", "-W", "1", to])
        .status
        .success()
}

/// What one run shows at each step.
struct Run {
    /// Felix's dataplane with both pods, with the policy, after the second pod's DEL.
    dataplane: Vec<(&'static str, Value)>,
    /// calicoctl's view with both pods.
    calicoctl: Vec<(&'static str, Value)>,
}

/// One datastore's side of a run: how its pods are networked and torn down, and how the
/// policy that stops pod 2 reaching pod 1 (and nothing else) is made and removed.
struct Node<'a> {
    host: &'a Netns,
    felix: &'a Felix,
    ctl_env: &'a [(&'a str, String)],
    /// The workloads' names in Felix's status files (container IDs, or pods' names).
    names: [&'a str; 2],
    add: &'a dyn Fn(usize, &Netns) -> Outcome,
    del: &'a dyn Fn(usize, &Netns),
    deny: &'a dyn Fn(&str),
    allow: &'a dyn Fn(),
    /// calicoctl's views to compare (each parsed as JSON when it is).
    views: &'a [(&'static str, &'a [&'a str])],
}

/// Two pods networked, reaching each other; the policy applied and removed; pod 2 deleted;
/// what Felix programmed and calicoctl shows along the way.
fn exercise(n: &Node) -> Run {
    let (p1, p2) = (Netns::new("pod"), Netns::new("pod"));
    let mut ips = Vec::new();
    let mut ifaces = Vec::new();
    for (i, pod) in [&p1, &p2].into_iter().enumerate() {
        let out = (n.add)(i, pod);
        out.assert_ok();
        let result = out.json();
        let address = result["ips"][0]["address"].as_str().expect("an address");
        ips.push(address.split('/').next().unwrap_or_default().to_string());
        ifaces.push(
            result["interfaces"][0]["name"]
                .as_str()
                .expect("a host veth")
                .to_string(),
        );
        let status = n.felix.status_file(n.names[i]);
        n.felix
            .wait_for(&format!("{}'s status file", n.names[i]), || status.exists());
    }
    let (ip1, ip2) = (&ips[0], &ips[1]);
    let mut shown = Run {
        dataplane: vec![("two pods", dataplane(n.host))],
        calicoctl: Vec::new(),
    };
    assert!(
        pings(&p2, ip1) && pings(&p1, ip2),
        "the pods reach each other"
    );
    for (what, args) in n.views {
        let text = calicoctl_ok(n.host.name(), n.ctl_env, args, "");
        let value = serde_json::from_str(&text).unwrap_or(Value::String(text));
        shown.calicoctl.push((what, without_run_identity(value)));
    }
    let endpoints = shown.calicoctl[0].1.to_string();
    assert!(
        ifaces.iter().all(|i| endpoints.contains(i.as_str())),
        "calicoctl lists both endpoints: {endpoints}"
    );

    (n.deny)(ip2);
    n.felix
        .wait_for("the policy to stop pod 2", || !pings(&p2, ip1));
    assert!(pings(&p1, ip2), "pod 1 still reaches pod 2");
    shown.dataplane.push(("the policy", dataplane(n.host)));
    (n.allow)();
    n.felix
        .wait_for("pod 2 to reach pod 1 again", || pings(&p2, ip1));

    (n.del)(1, &p2);
    let status = n.felix.status_file(n.names[1]);
    n.felix
        .wait_for("pod 2's status file to go", || !status.exists());
    n.felix.wait_for("pod 2's chains to go", || {
        !dataplane(n.host).to_string().contains(&ifaces[1])
    });
    shown.dataplane.push(("pod 2 deleted", dataplane(n.host)));
    (n.del)(0, &p1);
    shown
}

/// etcd, plain CNI containers: the policy is a GlobalNetworkPolicy denying ingress from pod
/// 2's address (everything else passes on to the profile).
fn run_on_etcd(bin: Option<Bin>) -> Run {
    let mut w = World::new();
    if let Some(bin) = bin {
        w.bin = bin;
    }
    let ctl_env = [
        ("DATASTORE_TYPE", "etcdv3".to_string()),
        ("ETCD_ENDPOINTS", w.etcd.endpoint()),
    ];
    let felix = Felix::start(&w.host, w.scratch.path(), &ctl_env, "cni");
    let conf = w.conf(json!({"mtu": 1500}));
    let cids = ["felix1", "felix2"];
    let host = w.host.name().to_string();
    let run = exercise(&Node {
        host: &w.host,
        felix: &felix,
        ctl_env: &ctl_env,
        names: cids,
        add: &|i, pod| w.calico(&Invocation::new("ADD", cids[i], pod.path()), &conf),
        del: &|i, pod| {
            w.calico(&Invocation::new("DEL", cids[i], pod.path()), &conf)
                .assert_ok();
        },
        deny: &|ip2| {
            let policy = json!({"apiVersion": "projectcalico.org/v3", "kind": "GlobalNetworkPolicy",
                "metadata": {"name": "deny-from-pod2"},
                "spec": {"selector": "all()", "types": ["Ingress"], "ingress": [
                    {"action": "Deny", "source": {"nets": [format!("{ip2}/32")]}},
                    {"action": "Pass"}]}});
            calicoctl_ok(&host, &ctl_env, &["apply", "-f", "-"], &policy.to_string());
        },
        allow: &|| {
            let args = ["delete", "globalnetworkpolicy", "deny-from-pod2"];
            calicoctl_ok(&host, &ctl_env, &args, "");
        },
        views: &[
            (
                "workloadendpoints",
                &["get", "workloadendpoints", "-o", "json"],
            ),
            ("profiles", &["get", "profiles", "-o", "json"]),
            ("blocks", &["ipam", "show", "--show-blocks"]),
        ],
    });
    // (`calicoctl ipam check` compares with the Kubernetes API's pods: see the KDD run.)
    drop(felix);
    w.assert_clean();
    run
}

/// The Kubernetes datastore (a real kube-apiserver), pods with policy type k8s: the policy
/// is a NetworkPolicy denying all ingress to pod 1. Felix and calicoctl use the admin's
/// credentials; the plugin its own RBAC.
fn run_on_kdd(bin: Option<Bin>) -> Run {
    let mut w = KddWorld::real();
    if let Some(bin) = bin {
        w.bin = bin;
    }
    w.api.ensure_namespace("default");
    let admin = w.api.kubeconfig_with(&w.api.admin_token());
    let ctl_env = [
        ("DATASTORE_TYPE", "kubernetes".to_string()),
        ("KUBECONFIG", admin.display().to_string()),
    ];
    let felix = Felix::start(&w.host, w.scratch.path(), &ctl_env, "k8s");
    // `calicoctl ipam check` reads it (kube-controllers would have made it).
    let kcc = json!({"apiVersion": "projectcalico.org/v3", "kind": "KubeControllersConfiguration",
        "metadata": {"name": "default"}, "spec": {"controllers": {"node": {}}}});
    calicoctl_ok(
        w.host.name(),
        &ctl_env,
        &["apply", "-f", "-"],
        &kcc.to_string(),
    );
    let conf = w.conf(json!({"mtu": 1500}));
    let pods = ["pod1", "pod2"];
    for pod in pods {
        w.seed_pod("default", pod, json!({}));
    }
    let cid = |i: usize| format!("felixk8s{i}");
    let policy_path = "/apis/networking.k8s.io/v1/namespaces/default/networkpolicies";
    let ipam_check = ["ipam", "check"];
    let run = exercise(&Node {
        host: &w.host,
        felix: &felix,
        ctl_env: &ctl_env,
        names: pods,
        add: &|i, pod| {
            let inv = Invocation::new("ADD", &cid(i), pod.path()).k8s("default", pods[i]);
            w.calico(&inv, &conf)
        },
        del: &|i, pod| {
            let inv = Invocation::new("DEL", &cid(i), pod.path()).k8s("default", pods[i]);
            w.calico(&inv, &conf).assert_ok();
        },
        deny: &|_| {
            let policy = json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                "metadata": {"name": "deny-to-pod1", "namespace": "default"},
                "spec": {"podSelector": {"matchLabels": {"app": "pod1"}}, "policyTypes": ["Ingress"]}});
            let a = w.api.post(policy_path, policy);
            assert_eq!(a.status, 201, "{a:?}");
        },
        allow: &|| w.api.remove(&format!("{policy_path}/deny-to-pod1")),
        views: &[
            (
                "workloadendpoints",
                &["get", "workloadendpoints", "-o", "json"],
            ),
            ("profiles", &["get", "profiles", "-o", "json"]),
            ("blocks", &["ipam", "show", "--show-blocks"]),
            ("ipam check", &ipam_check),
        ],
    });
    let check = calicoctl_ok(w.host.name(), &ctl_env, &ipam_check, "");
    assert!(
        check.contains("found 0 problems"),
        "after the DELs: {check}"
    );
    drop(felix);
    w.assert_clean();
    run
}

/// Upstream's plugin as the control, then ours: every snapshot and view the same.
fn compare(store: &str, run: fn(Option<Bin>) -> Run) {
    require_root();
    assert!(ping_available(), "ping is needed (make deps installs it)");
    let control = run(Some(Bin::with_calico(&upstream("calico"))));
    let ours = run(None);
    let mut differences = Vec::new();
    let pairs = control
        .dataplane
        .iter()
        .map(|(step, v)| (format!("Felix's dataplane with {step}"), v))
        .chain(
            control
                .calicoctl
                .iter()
                .map(|(w, v)| (format!("calicoctl's {w}"), v)),
        )
        .zip(ours.dataplane.iter().chain(&ours.calicoctl).map(|(_, v)| v));
    for ((what, want), got) in pairs {
        if got != want {
            differences.push(format!("{what}:\n{}", line_diff(want, got)));
        }
    }
    assert!(
        differences.is_empty() && ours.dataplane.len() == control.dataplane.len(),
        "{store}: ours differs from upstream's (- upstream, + ours):\n{}",
        differences.join("\n")
    );
    eprintln!(
        "felix on {store}: {} dataplane snapshots and {} calicoctl views identical",
        ours.dataplane.len(),
        ours.calicoctl.len()
    );
}

#[test]
#[ignore = "needs upstream's binaries: make upstream-check"]
fn felix_programs_our_workloads_as_upstreams_on_etcd() {
    compare("etcd", run_on_etcd);
}

#[test]
#[ignore = "needs upstream's binaries: make upstream-check"]
fn felix_programs_our_workloads_as_upstreams_on_kdd() {
    compare("the Kubernetes datastore", run_on_kdd);
}

/// The lines of `want` and `got` (pretty JSON) that only one has.
fn line_diff(want: &Value, got: &Value) -> String {
    let pretty = |v: &Value| serde_json::to_string_pretty(v).unwrap_or_default();
    let (w, g) = (pretty(want), pretty(got));
    let (w, g): (Vec<&str>, Vec<&str>) = (w.lines().collect(), g.lines().collect());
    let only = |a: &[&str], b: &[&str], sign: char| {
        a.iter()
            .filter(|l| !b.contains(l))
            .map(|l| format!("{sign} {}", l.trim()))
            .collect::<Vec<_>>()
    };
    let mut out = only(&w, &g, '-');
    out.extend(only(&g, &w, '+'));
    if out.is_empty() {
        out.push("  (the same lines in another order)".into());
    }
    out.join("\n")
}
