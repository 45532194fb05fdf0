//! A whole Kubernetes node in a network namespace the test made (tests/common/real_node.rs):
//! etcd, kube-apiserver, containerd and kubelet, set up with our binary as Calico's
//! DaemonSet would set it up. Pods created through the API get their addresses from the
//! IPPool, reach each other and the host, carry Calico's annotations, and leave nothing when
//! deleted; 50 pods are churned through it while containerd and kubelet are killed with
//! SIGKILL and restarted, and nothing leaks. The suite prints how containerd called the
//! plugin and the median RunPodSandbox time.
//!
//! Without the kube-apiserver + kubelet bundle it prints `SKIPPED <why>` and passes.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use common::apt;
use common::cni::report_skip;
use common::installer::calico_node_account;
use common::netns::{require_root, UPLINK_V4};
use common::real_node::{
    install_cni, read_recorded_calls, record_calls, shared_k8s, wait_until, InstallInputs,
    RealNode, RecordedCall, BUSYBOX_IMAGE,
};
use serde_json::{json, Value};

const NODE: &str = "node-a";
const POOL_CIDR: &str = "10.66.0.0/16";
const POOL_PREFIX: &str = "10.66.";
const CRD: &str = "/apis/crd.projectcalico.org/v1";
const PODS: &str = "/api/v1/namespaces/default/pods";
const CHURN_PODS: usize = 50;
/// The node port pod a is published on.
const HOST_PORT: u16 = 18080;
const WAVE: usize = 10;
/// Bound on pods becoming Running (kubelet retries a sandbox after a runtime restart).
const RUNNING_TIMEOUT: Duration = Duration::from_secs(120);
/// Bound on deleted pods' teardown to finish. The sandboxes a runtime kill orphans (set up
/// by containerd, unknown to kubelet or left NotReady) are torn down only by kubelet's
/// container GC, which runs once a minute: up to ~60 s after the last delete, seen here.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(150);

/// Written straight to stderr: libtest does not capture it, so a passing run shows it.
fn say(msg: &str) {
    let _ = writeln!(std::io::stderr(), "[real_node] {msg}");
}

fn tools_ready() -> bool {
    [
        "/usr/bin/containerd",
        "/usr/bin/ctr",
        "/usr/sbin/runc",
        "/bin/busybox",
    ]
    .iter()
    .all(|p| Path::new(p).exists())
        && Path::new("/usr/lib/cni/portmap").exists()
        // The images hold /bin/busybox alone: it must be the static one (busybox-static).
        && std::process::Command::new("ldd")
            .arg("/bin/busybox")
            .output()
            .is_ok_and(|o| {
                !o.status.success() || String::from_utf8_lossy(&o.stdout).contains("not a dynamic")
            })
        && std::process::Command::new("ping")
            .arg("-V")
            .output()
            .is_ok_and(|o| o.status.success())
}

/// Calico's KDD network config (the DaemonSet's CNI_NETWORK_CONFIG) with its install-time
/// placeholders, localized only where a test must not write to the host: the log file and
/// the IPAM lock go to the scratch dir, and there is no calico/node to write
/// /var/lib/calico/nodename.
fn network_config(scratch: &Path) -> String {
    let s = scratch.display();
    format!(
        r#"{{
  "name": "k8s-pod-network",
  "cniVersion": "0.3.1",
  "plugins": [
    {{
      "type": "calico",
      "log_level": "debug",
      "log_file_path": "{s}/cni.log",
      "ipam_lock_file": "{s}/ipam.lock",
      "nodename_file_optional": true,
      "datastore_type": "kubernetes",
      "nodename": "__KUBERNETES_NODE_NAME__",
      "mtu": __CNI_MTU__,
      "ipam": {{"type": "calico-ipam"}},
      "policy": {{"type": "k8s"}},
      "kubernetes": {{"kubeconfig": "__KUBECONFIG_FILEPATH__"}}
    }},
    {{"type": "portmap", "snat": true, "capabilities": {{"portMappings": true}}}},
    {{"type": "bandwidth", "capabilities": {{"bandwidth": true}}}}
  ]
}}"#
    )
}

/// Every pod in `ips` answers a ping from the host (its route and veth are its own).
fn assert_reachable(node: &RealNode, ips: &BTreeMap<String, String>, what: &str) {
    let list: Vec<&str> = ips.values().map(String::as_str).collect();
    let out = node.host_sh(&format!(
        "for ip in {}; do ping -c 1 -W 2 $ip >/dev/null 2>&1 || echo unreachable $ip; done",
        list.join(" ")
    ));
    assert!(out.trim().is_empty(), "{what}: {out} (pods {ips:?})");
}

/// POSTs `obj` as the admin, asserting it was created.
fn created(node: &RealNode, path: &str, obj: Value) {
    let a = node.api().post(path, obj);
    assert_eq!(a.status, 201, "POST {path}: {a:?}");
}

fn pod(name: &str, command: &[&str], restart: &str) -> Value {
    json!({"apiVersion":"v1","kind":"Pod",
        "metadata":{"name":name,"namespace":"default","labels":{"app":"real-node"}},
        "spec":{"nodeName":NODE,"restartPolicy":restart,"automountServiceAccountToken":false,
            "terminationGracePeriodSeconds":0,
            "containers":[{"name":"c","image":BUSYBOX_IMAGE,"imagePullPolicy":"Never",
                "command":command}]}})
}

/// Waits until every pod in `names` is Running with an address; returns name -> address.
fn wait_running(node: &RealNode, names: &[String]) -> BTreeMap<String, String> {
    wait_until(
        &format!("{} pods Running", names.len()),
        RUNNING_TIMEOUT,
        || {
            let mut ips = BTreeMap::new();
            for p in node.api().list(PODS) {
                let name = p["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string();
                if names.contains(&name) && p["status"]["phase"] == "Running" {
                    if let Some(ip) = p["status"]["podIP"].as_str() {
                        ips.insert(name, ip.to_string());
                    }
                }
            }
            (ips.len() == names.len()).then_some(ips)
        },
    )
}

/// Everything a pod could leave behind: pods still in the API, cali* veths and pool routes
/// in the node netns, IPAM handles, block allocations.
fn leftovers(node: &RealNode) -> Vec<String> {
    let mut left = vec![];
    for p in node.api().list(PODS) {
        left.push(format!("pod {}", p["metadata"]["name"]));
    }
    for l in node.host_sh("ip -o link show").lines() {
        if l.contains(": cali") {
            left.push(format!("veth {}", l.split(':').nth(1).unwrap_or("").trim()));
        }
    }
    for r in node.host_sh("ip route show").lines() {
        if r.starts_with(POOL_PREFIX) {
            left.push(format!("route {r}"));
        }
    }
    for h in node.api().list(&format!("{CRD}/ipamhandles")) {
        left.push(format!("handle {}", h["metadata"]["name"]));
    }
    for b in node.api().list(&format!("{CRD}/ipamblocks")) {
        let allocs = b["spec"]["allocations"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let used = allocs.iter().filter(|a| !a.is_null()).count();
        if used > 0 {
            left.push(format!(
                "block {} has {used} allocations",
                b["metadata"]["name"]
            ));
        }
    }
    left
}

/// libcni's result cache entries (containerd's, not the plugin's) still there for
/// `sandboxes`: reported, not asserted; the node's teardown removes them.
fn libcni_cache_left(sandboxes: &BTreeSet<String>) -> Vec<String> {
    sandboxes
        .iter()
        .map(|s| format!("/var/lib/cni/results/k8s-pod-network-{s}-eth0"))
        .filter(|p| Path::new(p).exists())
        .collect()
}

/// Waits for [`leftovers`] to be empty, saying what is left whenever that changes.
fn settle(node: &RealNode, what: &str) -> Duration {
    let started = Instant::now();
    let mut last: Vec<String> = vec![];
    while started.elapsed() < SETTLE_TIMEOUT {
        let now = leftovers(node);
        if now.is_empty() {
            return started.elapsed();
        }
        if now != last {
            say(&format!("{what}, at {:?}: left {now:?}", started.elapsed()));
            last = now;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    panic!("{what}: still left after {SETTLE_TIMEOUT:?}: {last:#?}");
}

/// For each plugin process of the log (`[LEVEL][pid]`) that wrote an endpoint (a successful
/// ADD): the time from its first log line to its last.
fn plugin_add_times(log: &str) -> Vec<Duration> {
    let mut spans: BTreeMap<String, (f64, f64, bool)> = BTreeMap::new();
    for line in log.lines() {
        // "2026-11-26 11:16:07.265 [INFO][10333] ..."
        let mut parts = line.splitn(4, ' ');
        let (Some(_date), Some(time), Some(tag)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let Some(pid) = tag.rsplit('[').next().map(|p| p.trim_end_matches(']')) else {
            continue;
        };
        let secs: Vec<f64> = time.split(':').filter_map(|x| x.parse().ok()).collect();
        if secs.len() != 3 {
            continue;
        }
        let t = secs[0] * 3600.0 + secs[1] * 60.0 + secs[2];
        let e = spans.entry(pid.to_string()).or_insert((t, t, false));
        e.1 = t;
        e.2 |= line.contains("Wrote endpoint to datastore");
    }
    spans
        .values()
        .filter(|(_, _, add)| *add)
        .map(|(a, b, _)| Duration::from_secs_f64((b - a).max(0.0)))
        .collect()
}

/// The pids of plugin processes that began an in-process IPAM ADD but never logged writing
/// their endpoint.
fn plugin_adds_cut(log: &str) -> Vec<String> {
    let pid = |l: &str| {
        l.split("][")
            .nth(1)
            .and_then(|r| r.split(']').next())
            .map(str::to_string)
    };
    let started: BTreeSet<String> = log
        .lines()
        .filter(|l| l.contains("running calico-ipam ADD in-process"))
        .filter_map(pid)
        .collect();
    let done: BTreeSet<String> = log
        .lines()
        .filter(|l| l.contains("Wrote endpoint to datastore"))
        .filter_map(pid)
        .collect();
    started.difference(&done).cloned().collect()
}

fn median(mut v: Vec<Duration>) -> Duration {
    assert!(!v.is_empty(), "no durations");
    v.sort();
    v[v.len() / 2]
}

/// What the recorded calls say about how containerd (on kubelet's behalf) called us.
fn describe_calls(calls: &[RecordedCall]) -> Vec<String> {
    let mut out = vec![];
    let mut verbs: BTreeMap<String, usize> = BTreeMap::new();
    let mut versions = BTreeSet::new();
    let mut arg_keys = BTreeSet::new();
    let mut ifnames = BTreeSet::new();
    let mut netns = BTreeSet::new();
    let mut cni_path = BTreeSet::new();
    let mut runtime_config = BTreeSet::new();
    let mut prev_result = BTreeMap::new();
    let mut per_sandbox: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for c in calls {
        *verbs.entry(c.command().to_string()).or_default() += 1;
        versions.insert(c.stdin["cniVersion"].as_str().unwrap_or("?").to_string());
        for kv in c
            .env
            .get("CNI_ARGS")
            .map(String::as_str)
            .unwrap_or("")
            .split(';')
        {
            if let Some((k, _)) = kv.split_once('=') {
                arg_keys.insert(k.to_string());
            }
        }
        ifnames.insert(c.env.get("CNI_IFNAME").cloned().unwrap_or_default());
        let ns = c.env.get("CNI_NETNS").cloned().unwrap_or_default();
        netns.insert(match ns.rsplit_once('/') {
            Some((dir, _)) => format!("{dir}/<id>"),
            None => format!("{ns:?}"),
        });
        cni_path.insert(c.env.get("CNI_PATH").cloned().unwrap_or_default());
        if let Some(rc) = c.stdin["runtimeConfig"].as_object() {
            for (k, v) in rc {
                runtime_config.insert(format!("{k}={v}"));
            }
        }
        *prev_result
            .entry(format!(
                "{} prevResult={}",
                c.command(),
                !c.stdin["prevResult"].is_null()
            ))
            .or_insert(0) += 1;
        per_sandbox
            .entry(c.container_id().to_string())
            .or_default()
            .push(format!(
                "{}{}",
                c.command(),
                if c.env.get("CNI_NETNS").is_some_and(|n| !n.is_empty()) {
                    ""
                } else {
                    "(no netns)"
                }
            ));
    }
    out.push(format!(
        "verbs (calls): {}",
        verbs
            .iter()
            .map(|(k, n)| format!("{k} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    out.push(format!("cniVersion on stdin: {versions:?}"));
    out.push(format!("CNI_ARGS keys: {arg_keys:?}"));
    out.push(format!("CNI_IFNAME: {ifnames:?}; CNI_NETNS: {netns:?}"));
    out.push(format!("CNI_PATH: {cni_path:?}"));
    out.push(format!("runtimeConfig: {runtime_config:?}"));
    out.push(format!("prevResult on stdin: {prev_result:?}"));
    let mut shapes: BTreeMap<String, usize> = BTreeMap::new();
    for seq in per_sandbox.values() {
        *shapes.entry(seq.join(" ")).or_insert(0) += 1;
    }
    out.push(format!(
        "call sequences per sandbox (how many sandboxes had each): {shapes:?}"
    ));
    if let Some(c) = calls.iter().find(|c| c.command() == "ADD") {
        out.push(format!(
            "one ADD's CNI_ARGS: {}",
            c.env.get("CNI_ARGS").cloned().unwrap_or_default()
        ));
    }
    out
}

#[test]
fn pods_through_kubelet_and_containerd_get_addresses_and_leave_nothing() {
    require_root();
    let test = "real_node";
    let suite_started = Instant::now();
    let k8s = match shared_k8s() {
        Ok(d) => d,
        Err(why) => {
            report_skip(test, &format!("no real Kubernetes binaries: {why}"));
            return;
        }
    };
    if let Err(why) = apt::ensure(
        &[
            "containerd",
            "runc",
            "busybox-static",
            "iputils-ping",
            "iptables",
            "containernetworking-plugins",
        ],
        tools_ready,
    ) {
        report_skip(test, &format!("containerd cannot run here: {why}"));
        return;
    }

    // The control plane, and Calico's resources as an operator would apply them.
    let mut node = RealNode::new(&k8s, NODE);
    let api = node.api();
    created(
        &node,
        &format!("{CRD}/clusterinformations"),
        json!({"apiVersion":"crd.projectcalico.org/v1","kind":"ClusterInformation",
            "metadata":{"name":"default"},
            "spec":{"clusterGUID":"real-node","clusterType":"k8s,kdd","calicoVersion":"v3.32.1","datastoreReady":true}}),
    );
    created(
        &node,
        &format!("{CRD}/ippools"),
        json!({"apiVersion":"crd.projectcalico.org/v1","kind":"IPPool",
            "metadata":{"name":"default-ipv4-ippool"},
            "spec":{"cidr":POOL_CIDR,"blockSize":26,"ipipMode":"Never","vxlanMode":"Never",
                "natOutgoing":true,"nodeSelector":"all()"}}),
    );

    // The node, set up by the DaemonSet's install container: calico-node's mounted token
    // gets the calico-cni-plugin ServiceAccount's own from TokenRequest.
    let pod_token = calico_node_account(api);
    let scratch = node.dir.path().join("scratch");
    std::fs::create_dir_all(&scratch).unwrap();
    let (bin_dir, conf_dir) = (node.cni_bin(), node.cni_conf());
    let how = install_cni(&InstallInputs {
        bin_dir: &bin_dir,
        conf_dir: &conf_dir,
        network_config: &network_config(&scratch),
        host_netns: node.host.path(),
        service_host: "127.0.0.1",
        service_port: api.port(),
        pod_token: &pod_token,
        ca_pem: &api.ca_pem(),
        node_name: NODE,
        scratch: &scratch,
    });
    say(&format!("node {NODE} set up by {how}"));
    let rec = scratch.join("calls");
    record_calls(&bin_dir, &rec);
    let t = Instant::now();
    node.start_runtime();
    say(&format!(
        "node {NODE} Ready {:?} after containerd+kubelet start ({:?} into the suite)",
        t.elapsed(),
        suite_started.elapsed()
    ));

    // Two pods: addresses from the pool, annotations, host routes; a third pings both and
    // the host from inside its own netns and exits 0.
    let api = node.api();
    // a serves TCP on 8080, published on the node's port 18080 (portmap, through the
    // conflist's portMappings capability).
    let mut a = pod(
        "a",
        &[
            "/bin/sh",
            "-c",
            "while true; do echo pong | nc -l -p 8080; done",
        ],
        "Always",
    );
    a["spec"]["containers"][0]["ports"] =
        json!([{"containerPort": 8080, "hostPort": HOST_PORT, "protocol": "TCP"}]);
    created(&node, PODS, a);
    created(&node, PODS, pod("b", &["/bin/sleep", "3600"], "Always"));
    let ips = wait_running(&node, &["a".into(), "b".into()]);
    let handles: BTreeSet<String> = api
        .list(&format!("{CRD}/ipamhandles"))
        .iter()
        .filter_map(|h| h["metadata"]["name"].as_str().map(str::to_string))
        .collect();
    let routes = node.host_sh("ip route show");
    let mut sandboxes = BTreeSet::new();
    for (name, ip) in &ips {
        assert!(
            ip.starts_with(POOL_PREFIX),
            "{name}'s address {ip} is not from {POOL_CIDR}"
        );
        let p = api.get(&format!("{PODS}/{name}")).expect("pod");
        let ann = &p["metadata"]["annotations"];
        assert_eq!(
            ann["cni.projectcalico.org/podIP"],
            format!("{ip}/32"),
            "{name}: {ann}"
        );
        assert_eq!(
            ann["cni.projectcalico.org/podIPs"],
            format!("{ip}/32"),
            "{name}: {ann}"
        );
        let cid = ann["cni.projectcalico.org/containerID"]
            .as_str()
            .unwrap_or_else(|| panic!("{name} has no containerID annotation: {ann}"));
        assert_eq!(
            node.containerd().sandbox_id_of(name).as_deref(),
            Some(cid),
            "{name}'s containerID annotation is its sandbox"
        );
        assert!(
            handles.contains(&format!("k8s-pod-network.{cid}")),
            "{name}'s IPAM handle in {handles:?}"
        );
        assert!(
            routes
                .lines()
                .any(|r| r.starts_with(&format!("{ip} dev cali"))),
            "host route to {name} ({ip}) in {routes}"
        );
        sandboxes.insert(cid.to_string());
    }
    assert_ne!(ips["a"], ips["b"]);
    let ping = node.host.exec("ping", &["-c", "1", "-W", "3", &ips["a"]]);
    assert!(
        ping.status.success(),
        "host -> a: {}",
        String::from_utf8_lossy(&ping.stdout)
    );
    let script = format!(
        "ping -c 1 -W 3 {a} && ping -c 1 -W 3 {b} && ping -c 1 -W 3 {UPLINK_V4}",
        a = ips["a"],
        b = ips["b"]
    );
    created(
        &node,
        PODS,
        pod("pinger", &["/bin/sh", "-c", &script], "Never"),
    );
    let phase = wait_until("pinger to finish", RUNNING_TIMEOUT, || {
        let p = api.get(&format!("{PODS}/pinger"))?;
        let phase = p["status"]["phase"].as_str()?.to_string();
        (phase == "Succeeded" || phase == "Failed").then_some(phase)
    });
    assert_eq!(
        phase, "Succeeded",
        "pinger pinged a, b and the host from its pod"
    );
    // From outside the node (its uplink's far end) to the host port, DNATed to a.
    let outside = node.host.uplink_peer();
    let reply = wait_until("a's host port to answer", Duration::from_secs(30), || {
        let out = outside.exec(
            "busybox",
            &["nc", "-w", "3", UPLINK_V4, &HOST_PORT.to_string()],
        );
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.contains("pong").then_some(text)
    });
    say(&format!(
        "a's hostPort {HOST_PORT} answered from outside the node: {:?}",
        reply.trim()
    ));
    if let Some(id) = node.containerd().sandbox_id_of("pinger") {
        sandboxes.insert(id);
    }
    // The finished pod's sandbox is torn down while the pod object stays: its address
    // annotations are emptied.
    wait_until("pinger's annotations emptied", SETTLE_TIMEOUT, || {
        let p = api.get(&format!("{PODS}/pinger"))?;
        (p["metadata"]["annotations"]["cni.projectcalico.org/podIP"] == "").then_some(())
    });
    say(&format!(
        "a={} b={}: pinged each other and the host from a pod",
        ips["a"], ips["b"]
    ));
    for n in ["a", "b", "pinger"] {
        api.remove(&format!("{PODS}/{n}"));
    }
    let took = settle(&node, "after deleting a, b and pinger");
    let nat = node.host_sh("iptables-save -t nat");
    let portmap_left: Vec<&str> = nat
        .lines()
        .filter(|l| l.contains(&HOST_PORT.to_string()) || l.starts_with(":CNI-DN-"))
        .collect();
    assert!(
        portmap_left.is_empty(),
        "portmap rules left: {portmap_left:?}"
    );
    let cached = libcni_cache_left(&sandboxes);
    assert!(
        cached.is_empty(),
        "containerd's libcni cache after clean deletes: {cached:?}"
    );
    say(&format!(
        "a, b, pinger deleted: nothing left after {took:?}"
    ));

    // Churn: waves of pods created and deleted, containerd killed (SIGKILL) while one wave's
    // sandboxes are being set up and kubelet while another's are, both restarted.
    let churn_started = Instant::now();
    let mut seen_ips: BTreeSet<String> = BTreeSet::new();
    let mut held: BTreeMap<String, String> = BTreeMap::new();
    for wave in 0..CHURN_PODS / WAVE {
        let names: Vec<String> = (0..WAVE).map(|i| format!("churn-{wave}-{i}")).collect();
        for n in &names {
            created(&node, PODS, pod(n, &["/bin/sleep", "3600"], "Always"));
        }
        // The kills land while the wave's ADDs run: once the recorder has seen three of
        // them start (an ADD takes some 100s of ms here, and they come in a burst).
        let kill_point = || {
            let prefix = format!("K8S_POD_NAME=churn-{wave}-");
            wait_until(
                &format!("wave {wave}'s ADDs to start"),
                RUNNING_TIMEOUT,
                || {
                    let started = read_recorded_calls(&rec)
                        .iter()
                        .filter(|c| c.command() == "ADD")
                        .filter(|c| c.env.get("CNI_ARGS").is_some_and(|a| a.contains(&prefix)))
                        .count();
                    (started >= 3).then_some(started)
                },
            )
        };
        match wave {
            1 => {
                let started = kill_point();
                node.containerd().kill9();
                say(&format!(
                    "containerd killed (SIGKILL) with {started} of wave {wave}'s ADDs started"
                ));
                std::thread::sleep(Duration::from_secs(1));
                node.containerd().restart();
            }
            3 => {
                let started = kill_point();
                node.kubelet().daemon().kill9();
                say(&format!(
                    "kubelet killed (SIGKILL) with {started} of wave {wave}'s ADDs started"
                ));
                std::thread::sleep(Duration::from_secs(1));
                node.kubelet().daemon().restart();
            }
            _ => {}
        }
        let ips = wait_running(&node, &names);
        let distinct: BTreeSet<&String> = ips.values().collect();
        assert_eq!(
            distinct.len(),
            names.len(),
            "wave {wave}: addresses {ips:?}"
        );
        for ip in ips.values() {
            assert!(ip.starts_with(POOL_PREFIX), "{ip} not from the pool");
        }
        assert_reachable(&node, &ips, &format!("wave {wave}"));
        seen_ips.extend(ips.values().cloned());
        if wave == 1 || wave == 3 {
            // The pods of the waves whose runtime was killed stay while the later waves
            // churn (and kubelet's clean-ups of what the kills orphaned run).
            held.extend(ips);
        } else {
            for n in &names {
                api.remove(&format!("{PODS}/{n}"));
            }
        }
    }
    assert_reachable(&node, &held, "the pods of the kill waves, at the end");
    for n in held.keys() {
        api.remove(&format!("{PODS}/{n}"));
    }
    let calls = read_recorded_calls(&rec);
    let all_sandboxes: BTreeSet<String> =
        calls.iter().map(|c| c.container_id().to_string()).collect();
    let took = settle(&node, "after the churn");
    say(&format!(
        "churned {CHURN_PODS} pods ({} distinct addresses) in {:?}; all gone and nothing left {took:?} after the last delete",
        seen_ips.len(),
        churn_started.elapsed()
    ));

    // Findings.
    let cached = libcni_cache_left(&all_sandboxes);
    say(&format!(
        "containerd's libcni result cache after the churn: {} entries left{}",
        cached.len(),
        if cached.is_empty() {
            String::new()
        } else {
            format!(" {cached:?}")
        }
    ));
    let calls = read_recorded_calls(&rec);
    for line in describe_calls(&calls) {
        say(&format!("calls: {line}"));
    }
    let durations = node.containerd().run_pod_sandbox_durations();
    let churn: Vec<Duration> = durations
        .iter()
        .filter(|(n, _)| n.starts_with("churn-"))
        .map(|(_, d)| *d)
        .collect();
    say(&format!(
        "RunPodSandbox through kubelet (containerd's log; plugin installed by {how}, {WAVE} pods at a time): median {:?} over {} churn sandboxes (min {:?}, max {:?})",
        median(churn.clone()),
        churn.len(),
        churn.iter().min().unwrap(),
        churn.iter().max().unwrap(),
    ));
    let log = std::fs::read_to_string(scratch.join("cni.log")).unwrap_or_default();
    let add_times = plugin_add_times(&log);
    let cut = plugin_adds_cut(&log);
    say(&format!(
        "plugin ADDs that started IPAM but never wrote their endpoint (killed mid-call, or failed): {}: {cut:?}",
        cut.len()
    ));
    say(&format!(
        "plugin ADD (its log, first to last line of each successful ADD): median {:?} over {}; first pods (a, b, pinger) RunPodSandbox: {:?}",
        median(add_times.clone()),
        add_times.len(),
        durations
            .iter()
            .filter(|(n, _)| !n.starts_with("churn-"))
            .collect::<Vec<_>>()
    ));
    let errors: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("[ERROR]") || l.contains("[WARNING]"))
        .collect();
    say(&format!(
        "plugin log: {} lines, {} warnings/errors",
        log.lines().count(),
        errors.len()
    ));
    for e in errors.iter().take(10) {
        say(&format!("  {e}"));
    }
    assert!(
        calls.iter().filter(|c| c.command() == "ADD").count() >= CHURN_PODS + 3,
        "every pod's sandbox was added"
    );
    drop(node);
    say(&format!("suite took {:?}", suite_started.elapsed()));
}
