//! A whole Kubernetes node in a network namespace the test made (tests/common/real_node.rs):
//! etcd, kube-apiserver, containerd and kubelet, set up with our binary as Calico's
//! DaemonSet would set it up. Pods created through the API get their addresses from the
//! IPPool, reach each other and the host, carry Calico's annotations, and leave nothing when
//! deleted; 50 pods are churned through it while containerd and kubelet are killed with
//! SIGKILL and restarted, and nothing leaks. The suite prints how containerd called the
//! plugin and the median RunPodSandbox time.
//!
//! `bench_pod_start` (ignored; `benches/pod_start.sh`) is a benchmark on the same harness:
//! pod start and stop as kubelet sees them (containerd's RunPodSandbox and StopPodSandbox,
//! and the time until a wave of pods is all Ready), with Debian's ptp + host-local and with
//! our calico on etcd and on the Kubernetes datastore (and optionally another calico build),
//! interleaved on one node. Why: the plugin's own ADD time (`make bench`) is a part of what
//! a user waits for; this shows how much of a pod's start the CNI choice is on a real node.
//!
//! Without the kube-apiserver + kubelet bundle it prints `SKIPPED <why>` and passes.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::common;
use crate::common::apt;
use crate::common::cni::report_skip;
use crate::common::netns::{require_root, UPLINK_V4};
use crate::common::real_k8s::Neighbour;
use crate::common::real_node::{
    copy_atomically, install_bare_binaries, manifest_network_config, node_peers, plugin_binary,
    read_recorded_calls, record_calls, seconds_between, time_network_plugins, utc_seconds_of_day,
    wait_until, write_atomically, ManifestDatastore, RealNode, RecordedCall, BUSYBOX_IMAGE,
    TIMED_DIR,
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
    ["/usr/sbin/runc", "/bin/busybox"]
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

/// Calico's KDD network config, localized ([`manifest_network_config`]).
fn network_config(scratch: &Path) -> String {
    manifest_network_config(scratch, ManifestDatastore::Kubernetes)
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
/// `sandboxes`. After clean deletes none may stay; after the churn's kills some may, and
/// they are only reported (the node's teardown removes them).
fn libcni_cache_left(sandboxes: &BTreeSet<String>) -> Vec<String> {
    sandboxes
        .iter()
        .map(|s| format!("/var/lib/cni/results/k8s-pod-network-{s}-eth0"))
        .filter(|p| Path::new(p).exists())
        .collect()
}

/// Waits for [`leftovers`] to be empty, saying what is left whenever that changes; then
/// upstream's `calicoctl ipam check` must find nothing (when `CALICO_UPSTREAM_BIN` has it).
fn settle(node: &RealNode, what: &str) -> Duration {
    let started = Instant::now();
    let mut last: Vec<String> = vec![];
    while started.elapsed() < SETTLE_TIMEOUT {
        let now = leftovers(node);
        if now.is_empty() {
            let settled = started.elapsed();
            node.api().assert_ipam_check_clean();
            return settled;
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
    let peers = match node_peers() {
        Ok(p) => p,
        Err(why) => {
            report_skip(test, &format!("no real Kubernetes binaries: {why}"));
            return;
        }
    };
    if let Err(why) = apt::ensure(
        &[
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
    let mut node = RealNode::new(&peers, NODE);
    let (scratch, how) = node.install_calico("real-node", POOL_CIDR, network_config);
    let bin_dir = node.cni_bin();
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
    // libcni removes its cache entry only once the chain's DEL has returned, which is after
    // the plugin's last step (the veth's delete) that `settle` waits for: wait for it too.
    let started = Instant::now();
    loop {
        let cached = libcni_cache_left(&sandboxes);
        if cached.is_empty() {
            break;
        }
        assert!(
            started.elapsed() < SETTLE_TIMEOUT,
            "containerd's libcni cache {SETTLE_TIMEOUT:?} after clean deletes: {cached:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
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

// ------------------------------------------------------------------ the pod-start bench

/// The bench's node (its own name: the etcd datastore's Node resource is seeded for it).
const BENCH_NODE: &str = "node-bench";
const BENCH_CONFLIST: &str = "10-bench.conflist";
const BENCH_PTP_SUBNET: &str = "10.252.0.0/16";
const BENCH_ETCD_POOL: &str = "10.67.0.0/16";
const BENCH_KDD_POOL: &str = "10.66.0.0/16";
/// The `BENCH_BEFORE` binary's pools: its blocks are its own, as on a node of its own (each
/// binary's IPAM lock holders keep the blocks they wrote, `BlockCopies`).
const BENCH_ETCD_BEFORE_POOL: &str = "10.69.0.0/16";
const BENCH_KDD_BEFORE_POOL: &str = "10.68.0.0/16";
/// Upstream Calico's pools (`CALICO_UPSTREAM_BIN`), for the same reason.
const BENCH_ETCD_UPSTREAM_POOL: &str = "10.71.0.0/16";
const BENCH_KDD_UPSTREAM_POOL: &str = "10.70.0.0/16";
/// Bound on a pod (or a wave of pods) becoming Ready, and on deleted pods' sandboxes
/// being stopped.
const BENCH_TIMEOUT: Duration = Duration::from_secs(180);
/// How often, by default, a neighbour ServiceAccount's read and write keep the plugin's API
/// Priority and Fairness level busy (`RealK8s::start_priority_level_neighbour`): 10 of each
/// a second, fewer than a cluster's kube-system ServiceAccounts send.
const BENCH_NEIGHBOUR_MS: usize = 100;
/// How often the bench polls the API for Ready pods.
const BENCH_POLL: Duration = Duration::from_millis(50);
/// After a switch of conflist (and binary): containerd's CRI reloads its CNI config on the
/// conf dir's inotify event, within milliseconds; every pod's address and plugin log are
/// checked against the config it was meant to get anyway.
const BENCH_SWITCH_PAUSE: Duration = Duration::from_secs(1);
/// How long deleted pods' sandboxes must see no new StopPodSandbox before the bench goes on.
/// kubelet stops a deleted pod's sandbox a second time some 1-2 s after the first (its PLEG
/// relist sees the container gone and re-syncs the terminating pod; containerd runs the CNI
/// DEL again, netns-less): that DEL must run under the config the pod was made with, and not
/// during the next measurement.
const BENCH_QUIET: Duration = Duration::from_secs(3);
/// kubelet's container GC period (ContainerGCPeriod, not configurable): a pass starts a
/// minute after the previous one ended.
const KUBELET_GC_PERIOD: f64 = 60.0;

/// One CNI configuration of the bench.
#[derive(Clone)]
struct BenchConfig {
    /// Its row in the report and its pods' name prefix.
    name: &'static str,
    conflist: String,
    /// The calico binary that must be `<cni_bin>/calico` (`None` for ptp).
    calico: Option<std::path::PathBuf>,
    /// The range its pods' addresses come from.
    cidr: &'static str,
    /// The calico log every ADD of this config writes to (it names the sandbox id).
    plugin_log: Option<std::path::PathBuf>,
    /// Measured without the neighbour on the plugin's APF level (`BENCH_POD_NEIGHBOUR_AB`).
    quiet: bool,
}

impl BenchConfig {
    fn ip_ok(&self, ip: &str) -> bool {
        let (net, len) = self.cidr.split_once('/').expect("a CIDR");
        let (net, ip) = (
            net.parse::<std::net::Ipv4Addr>().expect("an IPv4 CIDR"),
            ip.parse::<std::net::Ipv4Addr>(),
        );
        let len: u32 = len.parse().expect("a prefix length");
        let mask = u32::MAX.checked_shl(32 - len).unwrap_or(0);
        ip.is_ok_and(|ip| u32::from(ip) & mask == u32::from(net) & mask)
    }
}

/// The chain every config shares after its main plugin: portmap, as the v3.30+ manifests
/// chain it (bandwidth left them when Felix took over bandwidth shaping).
fn bench_chain_tail() -> Value {
    json!([
        {"type": "portmap", "snat": true, "capabilities": {"portMappings": true}}
    ])
}

fn bench_conflist(main: Value) -> String {
    let mut plugins = vec![main];
    plugins.extend(bench_chain_tail().as_array().cloned().unwrap_or_default());
    serde_json::to_string_pretty(&json!({
        "name": "k8s-pod-network",
        "cniVersion": "0.3.1",
        "plugins": plugins,
    }))
    .expect("a conflist")
}

/// Calico's plugin config for the bench: file logging at info (we measure speed;
/// `BENCH_POD_LOG_LEVEL=debug` for a run that shows where an ADD spends its time), the
/// IPAM lock in `dir`, no calico/node (nodename_file_optional), `datastore` merged in.
fn bench_calico(dir: &Path, datastore: Value, kubeconfig: &Path) -> Value {
    std::fs::create_dir_all(dir).expect("config scratch dir");
    let mut c = json!({
        "type": "calico",
        "log_level": std::env::var("BENCH_POD_LOG_LEVEL").unwrap_or_else(|_| "info".into()),
        "log_file_path": dir.join("cni.log"),
        "ipam_lock_file": dir.join("ipam.lock"),
        "nodename_file_optional": true,
        "nodename": BENCH_NODE,
        "mtu": 1500,
        "ipam": {"type": "calico-ipam"},
        "policy": {"type": "k8s"},
        "kubernetes": {"kubeconfig": kubeconfig},
    });
    for (k, v) in datastore.as_object().expect("datastore fields") {
        c[k] = v.clone();
    }
    c
}

fn bench_pod(name: &str, batch: &str) -> Value {
    json!({"apiVersion":"v1","kind":"Pod",
        "metadata":{"name":name,"namespace":"default",
            "labels":{"app":"pod-bench","bench-batch":batch}},
        "spec":{"nodeName":BENCH_NODE,"restartPolicy":"Always","automountServiceAccountToken":false,
            "terminationGracePeriodSeconds":0,
            "containers":[{"name":"c","image":BUSYBOX_IMAGE,"imagePullPolicy":"Never",
                // Exits on SIGTERM (a PID 1 has no default handler): its delete does not
                // wait out kubelet's minimum 2 s grace period.
                "command":["/bin/sh","-c","trap 'exit 0' TERM; /bin/sleep 3600 & wait"]}]}})
}

/// The pod's address if it is Ready.
fn ready_ip(p: &Value) -> Option<String> {
    let ready = p["status"]["conditions"]
        .as_array()?
        .iter()
        .any(|c| c["type"] == "Ready" && c["status"] == "True");
    ready.then(|| p["status"]["podIP"].as_str().map(str::to_string))?
}

/// Polls (every [`BENCH_POLL`]) the pods labelled `bench-batch=<batch>` until all of
/// `names` are Ready; returns name -> address.
fn wait_batch_ready(node: &RealNode, batch: &str, names: &[String]) -> BTreeMap<String, String> {
    let started = Instant::now();
    loop {
        let mut ips = BTreeMap::new();
        for p in node
            .api()
            .list(&format!("{PODS}?labelSelector=bench-batch%3D{batch}"))
        {
            if let (Some(name), Some(ip)) = (p["metadata"]["name"].as_str(), ready_ip(&p)) {
                ips.insert(name.to_string(), ip);
            }
        }
        if names.iter().all(|n| ips.contains_key(n)) {
            return ips;
        }
        assert!(
            started.elapsed() < BENCH_TIMEOUT,
            "{batch}: only {} of {} pods Ready after {BENCH_TIMEOUT:?}",
            ips.len(),
            names.len()
        );
        std::thread::sleep(BENCH_POLL);
    }
}

/// Every pod got its address from `cfg` and, for calico, its sandbox was added by `cfg`'s
/// plugin (its log names the sandbox): a pod set up by the previous config (containerd
/// not yet reloaded) fails the bench.
fn check_config(node: &RealNode, cfg: &BenchConfig, ips: &BTreeMap<String, String>) {
    let log = cfg
        .plugin_log
        .as_ref()
        .map(|p| std::fs::read_to_string(p).unwrap_or_default());
    let sandboxes = node.containerd().sandbox_log();
    for (name, ip) in ips {
        assert!(
            cfg.ip_ok(ip),
            "{name} got {ip}, not from {} ({}): containerd had not loaded the {} conflist",
            cfg.cidr,
            cfg.name,
            cfg.name
        );
        if let Some(log) = &log {
            let ids = sandboxes.ids_of(name);
            assert!(
                !ids.is_empty() && ids.iter().all(|id| log.contains(id)),
                "{name} (sandboxes {ids:?}) was not added by the {} plugin (its log does not name it): a stale config or binary",
                cfg.name
            );
        }
    }
}

/// Deletes `names` (sequential DELETEs, no grace period), waits until they are gone from
/// the API and containerd has stopped each one's sandboxes (the CNI DEL is done), then until
/// no StopPodSandbox of those sandboxes has started for [`BENCH_QUIET`]. Returns how many
/// StopPodSandbox calls each sandbox had by then.
fn delete_and_wait_stopped(node: &RealNode, names: &[String]) -> BTreeMap<String, usize> {
    for n in names {
        node.api().remove(&format!("{PODS}/{n}"));
    }
    let ids: Vec<String> = wait_until(
        &format!("{} deleted pods' sandboxes to stop", names.len()),
        BENCH_TIMEOUT,
        || {
            let left = node
                .api()
                .list(&format!("{PODS}?labelSelector=app%3Dpod-bench"));
            if left
                .iter()
                .any(|p| names.iter().any(|n| p["metadata"]["name"] == n.as_str()))
            {
                return None;
            }
            let log = node.containerd().sandbox_log();
            let mut ids = vec![];
            for n in names {
                let of = log.ids_of(n);
                if of.is_empty() || !of.iter().all(|id| log.stopped(id)) {
                    return None;
                }
                ids.extend(of.iter().map(|id| id.to_string()));
            }
            Some(ids)
        },
    );
    let progress = || {
        let log = node.containerd().sandbox_log();
        ids.iter()
            .map(|id| (id.clone(), log.stop_progress(id)))
            .collect::<BTreeMap<_, _>>()
    };
    let started = Instant::now();
    let mut last = progress();
    let mut since = Instant::now();
    loop {
        std::thread::sleep(Duration::from_millis(250));
        let now = progress();
        if now != last {
            (last, since) = (now, Instant::now());
        } else if since.elapsed() >= BENCH_QUIET && last.values().all(|(_, done)| *done) {
            return last.into_iter().map(|(id, (n, _))| (id, n)).collect();
        }
        assert!(
            started.elapsed() < BENCH_TIMEOUT,
            "{names:?}: StopPodSandbox calls still coming after {BENCH_TIMEOUT:?}: {last:?}"
        );
    }
}

/// If kubelet's next container GC pass may come within `need`, waits until it is over, so
/// that no measurement shares the node with the GC: it stops and removes every dead
/// sandbox, and containerd runs a CNI DEL for each (netns-less) through the config of the
/// moment. The GC's phase is that of its last pass that removed something (containerd's
/// RemovePodSandbox lines); a pass with nothing to remove leaves no trace and takes no
/// time, keeping the phase. Returns how long it waited.
fn avoid_kubelet_gc(node: &RealNode, need: Duration) -> Duration {
    let started = Instant::now();
    let log = node.containerd().sandbox_log();
    let Some(&last) = log.removes.last() else {
        return Duration::ZERO;
    };
    let since = seconds_between(last, utc_seconds_of_day());
    let into_period = since % KUBELET_GC_PERIOD;
    let until_next = KUBELET_GC_PERIOD - into_period;
    let just_due = since >= KUBELET_GC_PERIOD && into_period < 3.0;
    if until_next > need.as_secs_f64() + 2.0 && !just_due {
        return Duration::ZERO;
    }
    // A RemovePodSandbox after `last`, then 1.5 s without another; or none by the due
    // time + 5 s: that pass had nothing to remove.
    let seen = log.removes.len();
    let give_up = Instant::now() + Duration::from_secs_f64(until_next.min(KUBELET_GC_PERIOD) + 5.0);
    loop {
        std::thread::sleep(Duration::from_millis(250));
        let log = node.containerd().sandbox_log();
        let new = log.removes.len() > seen;
        let quiet = log
            .removes
            .last()
            .is_some_and(|&t| seconds_between(t, utc_seconds_of_day()) >= 1.5);
        if (new && quiet) || (!new && Instant::now() > give_up) {
            break;
        }
    }
    started.elapsed()
}

/// Makes `cfg` the node's CNI config: its calico binary (if another) and its conflist,
/// each replaced atomically; then gives containerd a moment to reload.
fn switch_to(node: &RealNode, cfg: &BenchConfig, current_calico: &mut std::path::PathBuf) {
    if let Some(bin) = &cfg.calico {
        if bin != current_calico {
            // Behind the timing wrapper, when there is one.
            let timed = node.cni_bin().join(TIMED_DIR);
            let dir = if timed.is_dir() {
                timed
            } else {
                node.cni_bin()
            };
            copy_atomically(bin, &dir.join("calico"));
            // Written back now, not during the measurements that follow (the datastores'
            // fsyncs would queue behind 12 MB of writeback).
            let synced = std::fs::File::open(dir.join("calico")).and_then(|f| f.sync_all());
            synced.unwrap_or_else(|e| panic!("fsync the calico binary: {e}"));
            *current_calico = bin.clone();
        }
    }
    write_atomically(
        &node.cni_conf().join(BENCH_CONFLIST),
        cfg.conflist.as_bytes(),
    );
    std::thread::sleep(BENCH_SWITCH_PAUSE);
}

/// Nearest-rank percentile of milliseconds.
fn percentile(v: &[f64], p: f64) -> f64 {
    assert!(!v.is_empty(), "no samples");
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * s.len() as f64).ceil().max(1.0) as usize;
    s[rank.min(s.len()) - 1]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// A pod's (config name, round, kind) from its name `<config>-r<round>-<solo|wNN>`.
fn bench_pod_parts(name: &str) -> Option<(&str, usize, &str)> {
    let mut it = name.rsplitn(3, '-');
    let kind = it.next()?;
    let round = it.next()?.strip_prefix('r')?.parse().ok()?;
    Some((it.next()?, round, kind))
}

#[derive(Default, serde::Serialize)]
struct BenchSamples {
    /// RunPodSandbox (containerd's log) of the pod created alone, ms.
    run_alone_ms: Vec<f64>,
    /// RunPodSandbox of the pods of the waves, ms.
    run_wave_ms: Vec<f64>,
    /// First StopPodSandbox of every measured pod's sandbox, ms.
    stop_ms: Vec<f64>,
    /// Of those, the pods alone's. A wave's stops queue behind each other on the node, so
    /// each one's duration is mostly its place in that queue (70–900 ms in a wave of 20):
    /// the pods alone's are the measure of a stop, the waves' that of a burst.
    stop_alone_ms: Vec<f64>,
    /// The waves' pods'.
    stop_wave_ms: Vec<f64>,
    /// The pod alone: POST to Ready seen in the API, ms.
    solo_ready_ms: Vec<f64>,
    /// A wave: first POST to all Ready seen in the API, ms.
    wave_ready_ms: Vec<f64>,
    /// RunPodSandbox calls that failed (kubelet retried them).
    run_failures: usize,
    /// `BENCH_POD_PLUGIN_TIMES`: the network plugin's own ADD of each pod alone (its
    /// wrapper's start to end), ms.
    plugin_add_ms: Vec<f64>,
    /// The same for the DEL of each measured pod's sandbox (its first), ms.
    plugin_del_ms: Vec<f64>,
    /// Sandboxes with more than one StopPodSandbox.
    stopped_more_than_once: usize,
    /// StopPodSandbox calls that started after the bench had moved on ([`BENCH_QUIET`]
    /// was not long enough): their CNI DEL may have run under another config, during
    /// another measurement.
    late_stops: usize,
    /// RemovePodSandbox lines (kubelet's GC) logged during this config's measurements.
    gc_during_measurements: usize,
    /// StopPodSandbox calls of other pods' sandboxes (earlier batches, other configs) that
    /// started during this config's measurements.
    other_stops_during_measurements: usize,
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .trim()
        .to_string()
}

fn env_usize(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Ok(v) if !v.is_empty() => v
            .parse()
            .unwrap_or_else(|e| panic!("{name}={v:?} is not a count: {e}")),
        _ => default,
    }
}

fn first_line_of(program: &str, args: &[&str]) -> String {
    std::process::Command::new(program)
        .args(args)
        .output()
        .map(|o| {
            let text = String::from_utf8_lossy(&o.stdout).into_owned()
                + &String::from_utf8_lossy(&o.stderr);
            text.lines().next().unwrap_or("").trim().to_string()
        })
        .unwrap_or_else(|e| format!("({program}: {e})"))
}

/// Pod start through the real node, per CNI configuration: how long containerd's
/// RunPodSandbox (and StopPodSandbox) takes with Debian's ptp + host-local and with our
/// calico on either datastore (with `BENCH_BEFORE`, another calico build or the same one as a
/// control; with `CALICO_UPSTREAM_BIN`, upstream Calico's own plugin), one pod
/// alone and inside a wave of pods created at once, and how long the wave takes to be all
/// Ready. The configs are interleaved round-robin on one node (the order rotating each
/// round), so machine noise and the node's own state (kubelet, containerd, API server) fall
/// on all of them alike. It reads what a user waits for (pod start as kubelet sees it)
/// rather than the plugin's own ADD time, which `make bench` measures.
///
/// `BENCH_POD_ROUNDS` (8), `BENCH_POD_WAVE` (20), `BENCH_POD_ALONE` (3 pods alone per round
/// and config), `BENCH_BEFORE` (a calico binary) and `BENCH_BEFORE_LABEL` (its rows' name,
/// `before`), `CALICO_UPSTREAM_BIN` (the folder of upstream Calico's binaries: rows
/// `upstream-etcd`, `upstream-kdd`), `BENCH_POD_LOG_LEVEL` (the plugin's, info),
/// `BENCH_POD_PLUGIN_TIMES=1` (the network plugin's own ADD and DEL time on the node, through
/// a timing wrapper: a profile, as it adds the wrapper's start-up to every pod),
/// `BENCH_POD_OUT` (the report also to a file), `BENCH_POD_JSON` (raw numbers),
/// `BENCH_POD_AUDIT` (a copy of the API server's audit log, to time the plugin's requests),
/// `BENCH_POD_NEIGHBOUR_MS` (100; 0: none: the period of a neighbour's request on the
/// plugin's API Priority and Fairness level, as in a cluster), `BENCH_POD_NEIGHBOUR_AB=1`
/// (every config also measured without the neighbour, as `<config>-quiet`),
/// `REAL_NODE_CALICO` (our binary; default the test build). `benches/pod_start.sh` runs it.
#[test]
#[ignore = "a benchmark (minutes): benches/pod_start.sh"]
fn bench_pod_start() {
    require_root();
    let test = "bench_pod_start";
    let peers = match node_peers() {
        Ok(p) => p,
        Err(why) => {
            report_skip(test, &format!("no real Kubernetes binaries: {why}"));
            return;
        }
    };
    let plugins_ready = || {
        tools_ready()
            && ["ptp", "host-local", "portmap", "loopback"]
                .iter()
                .all(|p| Path::new("/usr/lib/cni").join(p).exists())
    };
    if let Err(why) = apt::ensure(
        &[
            "runc",
            "busybox-static",
            "iputils-ping",
            "iptables",
            "containernetworking-plugins",
        ],
        plugins_ready,
    ) {
        report_skip(test, &format!("containerd cannot run here: {why}"));
        return;
    }
    let rounds = env_usize("BENCH_POD_ROUNDS", 8);
    let wave = env_usize("BENCH_POD_WAVE", 20);
    // Pods started alone, one after another, per round and config: the cheap samples (a
    // second or two each), against noise of about ±15 % per sample.
    let alone = env_usize("BENCH_POD_ALONE", 3).max(1);
    assert!(
        rounds > 0 && wave > 0 && wave < 100,
        "rounds {rounds}, wave {wave}"
    );
    let ours =
        std::fs::canonicalize(plugin_binary()).expect("the calico binary (REAL_NODE_CALICO)");
    let before = std::env::var_os("BENCH_BEFORE")
        .filter(|b| !b.is_empty())
        .map(|b| {
            std::fs::canonicalize(&b)
                .unwrap_or_else(|e| panic!("BENCH_BEFORE={}: {e}", Path::new(&b).display()))
        });
    let upstream = std::env::var_os("CALICO_UPSTREAM_BIN")
        .filter(|d| !d.is_empty())
        .map(|d| {
            std::fs::canonicalize(&d)
                .unwrap_or_else(|e| panic!("CALICO_UPSTREAM_BIN={}: {e}", Path::new(&d).display()))
        });
    if upstream.is_none() {
        say("bench: CALICO_UPSTREAM_BIN is unset: upstream Calico's own plugin is not measured");
    }
    let load_start = loadavg();
    let started = Instant::now();

    let mut node = RealNode::new(&peers, BENCH_NODE);
    let api = node.api();
    // The Kubernetes datastore: ClusterInformation and the pool, as the existing test does.
    created(
        &node,
        &format!("{CRD}/clusterinformations"),
        json!({"apiVersion":"crd.projectcalico.org/v1","kind":"ClusterInformation",
            "metadata":{"name":"default"},
            "spec":{"clusterGUID":"pod-bench","clusterType":"k8s,kdd","calicoVersion":"v3.32.1","datastoreReady":true}}),
    );
    for (name, cidr) in [
        ("kdd-pool", BENCH_KDD_POOL),
        ("kdd-before-pool", BENCH_KDD_BEFORE_POOL),
        ("kdd-upstream-pool", BENCH_KDD_UPSTREAM_POOL),
    ] {
        created(
            &node,
            &format!("{CRD}/ippools"),
            json!({"apiVersion":"crd.projectcalico.org/v1","kind":"IPPool",
                "metadata":{"name":name},
                "spec":{"cidr":cidr,"blockSize":26,"ipipMode":"Never","vxlanMode":"Never",
                    "natOutgoing":true,"nodeSelector":"all()"}}),
        );
    }
    // The etcd datastore, in the API server's own etcd (Calico's keys live under /calico/,
    // the API server's under /registry/), seeded as benches/bench.py does.
    let etcd = api.etcd();
    let now = first_line_of("date", &["-u", "+%Y-%m-%dT%H:%M:%SZ"]);
    let meta = |name: &str| json!({"name": name, "creationTimestamp": now});
    let v3 = "/calico/resources/v3/projectcalico.org";
    etcd.put(
        &format!("{v3}/clusterinformations/default"),
        &json!({"kind":"ClusterInformation","apiVersion":"projectcalico.org/v3",
            "metadata":meta("default"),"spec":{"datastoreReady":true}})
        .to_string(),
    );
    etcd.put(
        &format!("{v3}/nodes/{BENCH_NODE}"),
        &json!({"kind":"Node","apiVersion":"projectcalico.org/v3",
            "metadata":meta(BENCH_NODE),"spec":{}})
        .to_string(),
    );
    for (name, cidr) in [
        ("etcd-pool", BENCH_ETCD_POOL),
        ("etcd-before-pool", BENCH_ETCD_BEFORE_POOL),
        ("etcd-upstream-pool", BENCH_ETCD_UPSTREAM_POOL),
    ] {
        etcd.put(
            &format!("{v3}/ippools/{name}"),
            &json!({"kind":"IPPool","apiVersion":"projectcalico.org/v3","metadata":meta(name),
                "spec":{"cidr":cidr,"blockSize":26,"ipipMode":"Never","vxlanMode":"Never",
                    "natOutgoing":true,"nodeSelector":"all()"}})
            .to_string(),
        );
    }

    // The configs, and the CNI bin dir as bare binaries.
    let scratch = node.dir.path().join("scratch");
    std::fs::create_dir_all(&scratch).expect("scratch dir");
    let kubeconfig = api.kubeconfig();
    let etcd_fields = json!({"datastore_type": "etcdv3", "etcd_endpoints": etcd.endpoint()});
    let kdd_fields = json!({"datastore_type": "kubernetes",
        "calico_api_group": "crd.projectcalico.org/v1"});
    // Each config allocates from its own pool (`ipam.ipv4_pools`).
    let calico_cfg = |name: &'static str, bin: &Path, etcd_store: bool, pool: &'static str| {
        let mut fields = if etcd_store {
            etcd_fields.clone()
        } else {
            kdd_fields.clone()
        };
        fields["ipam"] = json!({"type": "calico-ipam", "ipv4_pools": [pool]});
        BenchConfig {
            name,
            conflist: bench_conflist(bench_calico(&scratch.join(name), fields, &kubeconfig)),
            calico: Some(bin.to_path_buf()),
            cidr: pool,
            plugin_log: Some(scratch.join(name).join("cni.log")),
            quiet: false,
        }
    };
    let mut configs = vec![
        BenchConfig {
            name: "ptp",
            conflist: bench_conflist(json!({
                "type": "ptp", "ipMasq": false, "mtu": 1500,
                "ipam": {"type": "host-local", "subnet": BENCH_PTP_SUBNET,
                    "dataDir": scratch.join("host-local"), "routes": [{"dst": "0.0.0.0/0"}]}
            })),
            calico: None,
            cidr: BENCH_PTP_SUBNET,
            plugin_log: None,
            quiet: false,
        },
        calico_cfg("calico-etcd", &ours, true, BENCH_ETCD_POOL),
        calico_cfg("calico-kdd", &ours, false, BENCH_KDD_POOL),
    ];
    if let Some(b) = &before {
        // `BENCH_BEFORE_LABEL`: the rows' name (`control` when it is the same build).
        let label = std::env::var("BENCH_BEFORE_LABEL")
            .ok()
            .filter(|l| !l.is_empty())
            .unwrap_or_else(|| "before".into());
        let row = |store: &str| -> &'static str {
            Box::leak(format!("{label}-{store}").into_boxed_str())
        };
        configs.push(calico_cfg(row("etcd"), b, true, BENCH_ETCD_BEFORE_POOL));
        configs.push(calico_cfg(row("kdd"), b, false, BENCH_KDD_BEFORE_POOL));
    }
    // Upstream Calico's own `calico` (`CALICO_UPSTREAM_BIN`, the folder of its binaries), as
    // a configuration of its own: swapped in as `<cni_bin>/calico`, which `calico-ipam` links
    // to (it picks its role by the name it runs under, as ours does).
    if let Some(dir) = &upstream {
        let bin = dir.join("calico");
        configs.push(calico_cfg(
            "upstream-etcd",
            &bin,
            true,
            BENCH_ETCD_UPSTREAM_POOL,
        ));
        configs.push(calico_cfg(
            "upstream-kdd",
            &bin,
            false,
            BENCH_KDD_UPSTREAM_POOL,
        ));
    }
    // `BENCH_POD_CONFIGS=ptp,calico-etcd,before-etcd`: only these rows (ptp, the baseline,
    // always), for a longer look at fewer.
    if let Some(only) = std::env::var("BENCH_POD_CONFIGS")
        .ok()
        .filter(|v| !v.is_empty())
    {
        let names: Vec<&str> = only.split(',').map(str::trim).collect();
        configs.retain(|c| c.name == "ptp" || names.contains(&c.name));
        assert!(
            configs.len() > 1,
            "BENCH_POD_CONFIGS={only} names no config"
        );
    }
    let neighbour_ms = env_usize("BENCH_POD_NEIGHBOUR_MS", BENCH_NEIGHBOUR_MS);
    // `BENCH_POD_NEIGHBOUR_AB=1`: every config again, measured with no neighbour (its row
    // named `<config>-quiet`), interleaved with the rest: what the neighbour changes.
    if neighbour_ms > 0 && env_usize("BENCH_POD_NEIGHBOUR_AB", 0) > 0 {
        let quiet: Vec<BenchConfig> = configs
            .iter()
            .map(|c| BenchConfig {
                name: Box::leak(format!("{}-quiet", c.name).into_boxed_str()),
                quiet: true,
                ..c.clone()
            })
            .collect();
        configs.extend(quiet);
    }
    install_bare_binaries(&node.cni_bin(), &ours);
    let plugin_times = std::env::var_os("BENCH_POD_PLUGIN_TIMES")
        .filter(|v| !v.is_empty() && v != "0")
        .map(|_| scratch.join("plugin-times.log"));
    if let Some(log) = &plugin_times {
        time_network_plugins(&node.cni_bin(), log);
    }
    let mut current_calico = ours.clone();
    std::fs::create_dir_all(node.cni_conf()).expect("CNI conf dir");
    // kubelet reports the node Ready only once containerd has a CNI config.
    write_atomically(
        &node.cni_conf().join(BENCH_CONFLIST),
        configs[0].conflist.as_bytes(),
    );
    node.start_runtime();
    let api = node.api();
    // The plugin's APF priority level kept busy, as in a cluster (see the report's line),
    // except while a quiet config is measured.
    let neighbour: std::cell::RefCell<Option<Neighbour>> = Default::default();
    let neighbour_for = |cfg: &BenchConfig| {
        let mut n = neighbour.borrow_mut();
        let want = neighbour_ms > 0 && !cfg.quiet;
        if want && n.is_none() {
            *n = Some(
                api.start_priority_level_neighbour(Duration::from_millis(neighbour_ms as u64)),
            );
        } else if !want {
            *n = None;
        }
    };
    say(&format!(
        "bench: node Ready {:?} after start; configs {:?}, {rounds} rounds, waves of {wave}",
        started.elapsed(),
        configs.iter().map(|c| c.name).collect::<Vec<_>>()
    ));

    // Sandbox id -> its StopPodSandbox calls when the bench moved on.
    let settled: std::cell::RefCell<BTreeMap<String, usize>> = Default::default();
    // Creates `names` (one pod: a POST; more: concurrent POSTs, one thread each, which the
    // admin client multiplexes on its HTTP/2 connection), waits until all are Ready, checks
    // they got `cfg`, deletes them and waits for their sandboxes to be stopped and quiet.
    // Returns the time from before the first POST to all Ready.
    let batch_of = |cfg: &BenchConfig, batch: &str, names: &[String]| -> Duration {
        let t0 = Instant::now();
        if let [name] = names {
            created(&node, PODS, bench_pod(name, batch));
        } else {
            std::thread::scope(|s| {
                for n in names {
                    let node = &node;
                    s.spawn(move || created(node, PODS, bench_pod(n, batch)));
                }
            });
        }
        let ips = wait_batch_ready(&node, batch, names);
        let all_ready = t0.elapsed();
        check_config(&node, cfg, &ips);
        let distinct: BTreeSet<&String> = ips.values().collect();
        assert_eq!(distinct.len(), names.len(), "{batch}: addresses {ips:?}");
        settled
            .borrow_mut()
            .extend(delete_and_wait_stopped(&node, names));
        all_ready
    };
    // Warm-up (round 0, not counted): one pod per config, so the first measured pods do not
    // pay for first use (image, binaries in the page cache, the datastores' first blocks).
    for cfg in &configs {
        switch_to(&node, cfg, &mut current_calico);
        neighbour_for(cfg);
        let name = format!("{}-r0-solo", cfg.name);
        let took = batch_of(cfg, &name, std::slice::from_ref(&name));
        say(&format!("bench: warm-up {}: Ready in {took:?}", cfg.name));
    }
    // kubelet's container GC removes the warm-up's sandboxes within a minute: from then on
    // its phase is known and the measurements keep out of its way.
    wait_until(
        "kubelet's container GC to remove the warm-up's sandboxes",
        Duration::from_secs(90),
        || (!node.containerd().sandbox_log().removes.is_empty()).then_some(()),
    );
    let settle_gc = avoid_kubelet_gc(&node, Duration::from_secs(KUBELET_GC_PERIOD as u64));
    say(&format!(
        "bench: warm-up done, kubelet's GC seen ({settle_gc:?} more) {:?} into the run",
        started.elapsed()
    ));

    let mut samples: BTreeMap<&str, BenchSamples> = configs
        .iter()
        .map(|c| (c.name, BenchSamples::default()))
        .collect();
    // What each kind of measurement took (creation to quiet after the delete), the longest
    // so far: how long it needs to be clear of kubelet's GC.
    let (mut need_solo, mut need_wave) = (Duration::from_secs(12), Duration::from_secs(30));
    // (config, its pods' name prefix, start, end) of every measurement, as
    // [`utc_seconds_of_day`].
    let mut windows: Vec<(&str, String, f64, f64)> = vec![];
    let mut gc_waits = Duration::ZERO;
    for round in 1..=rounds {
        let mut order: Vec<&BenchConfig> = configs.iter().collect();
        order.rotate_left((round - 1) % configs.len());
        for cfg in order {
            switch_to(&node, cfg, &mut current_calico);
            neighbour_for(cfg);
            gc_waits += avoid_kubelet_gc(&node, need_solo);
            let mut took = Duration::ZERO;
            for k in 0..alone {
                let (t, w0) = (Instant::now(), utc_seconds_of_day());
                let name = format!("{}-r{round}-solo{k}", cfg.name);
                took = batch_of(cfg, &name, std::slice::from_ref(&name));
                windows.push((cfg.name, name.clone(), w0, utc_seconds_of_day()));
                need_solo = need_solo.max(t.elapsed());
                let s = samples.get_mut(cfg.name).expect("a config's samples");
                s.solo_ready_ms.push(ms(took));
                if k + 1 < alone {
                    gc_waits += avoid_kubelet_gc(&node, need_solo);
                }
            }

            gc_waits += avoid_kubelet_gc(&node, need_wave);
            let (t, w0) = (Instant::now(), utc_seconds_of_day());
            let batch = format!("{}-r{round}-wave", cfg.name);
            let names: Vec<String> = (0..wave)
                .map(|i| format!("{}-r{round}-w{i:02}", cfg.name))
                .collect();
            let all_ready = batch_of(cfg, &batch, &names);
            windows.push((
                cfg.name,
                format!("{}-r{round}-w", cfg.name),
                w0,
                utc_seconds_of_day(),
            ));
            need_wave = need_wave.max(t.elapsed());

            let s = samples.get_mut(cfg.name).expect("a config's samples");
            s.wave_ready_ms.push(ms(all_ready));
            say(&format!(
                "bench: round {round}/{rounds} {}: alone Ready {took:?}, {wave} Ready {all_ready:?}",
                cfg.name
            ));
        }
    }

    // containerd's own timings of the measured (round >= 1) pods.
    let log = node.containerd().sandbox_log();
    let runs = node.containerd().run_pod_sandbox_durations();
    for (name, d) in &runs {
        let Some((cfg, round, kind)) = bench_pod_parts(name) else {
            continue;
        };
        if let Some(s) = samples.get_mut(cfg).filter(|_| round >= 1) {
            if kind.starts_with("solo") {
                s.run_alone_ms.push(ms(*d));
            } else {
                s.run_wave_ms.push(ms(*d));
            }
        }
    }
    for (name, d) in log.first_stops() {
        if let Some((cfg, round, kind)) = bench_pod_parts(&name) {
            if let Some(s) = samples.get_mut(cfg).filter(|_| round >= 1) {
                s.stop_ms.push(ms(d));
                if kind.starts_with("solo") {
                    s.stop_alone_ms.push(ms(d));
                } else {
                    s.stop_wave_ms.push(ms(d));
                }
            }
        }
    }
    if let Some(path) = &plugin_times {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let mut seen = BTreeSet::new();
        for line in text.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            let [t0, t1, _, command, id] = f[..] else {
                continue;
            };
            let (Ok(t0), Ok(t1)) = (t0.parse::<f64>(), t1.parse::<f64>()) else {
                continue;
            };
            let Some((cfg, round, kind)) = log.pod_of.get(id).and_then(|p| bench_pod_parts(p))
            else {
                continue;
            };
            let Some(s) = samples.get_mut(cfg).filter(|_| round >= 1) else {
                continue;
            };
            let took = (t1 - t0) * 1000.0;
            match command {
                "ADD" if kind.starts_with("solo") => s.plugin_add_ms.push(took),
                "DEL" if seen.insert(id.to_string()) => s.plugin_del_ms.push(took),
                _ => {}
            }
        }
    }
    for name in &log.run_failures {
        if let Some((cfg, _, _)) = bench_pod_parts(name) {
            if let Some(s) = samples.get_mut(cfg) {
                s.run_failures += 1;
            }
        }
    }
    for (id, n) in log.stop_calls() {
        let cfg = log.pod_of.get(id).and_then(|p| bench_pod_parts(p));
        if let Some(s) = cfg
            .and_then(|(c, _, _)| samples.get_mut(c))
            .filter(|_| n > 1)
        {
            s.stopped_more_than_once += 1;
        }
    }
    for (cfg, prefix, w0, w1) in &windows {
        let inside = |t: f64| seconds_between(*w0, t) <= seconds_between(*w0, *w1);
        let gc = log.removes.iter().filter(|&&t| inside(t)).count();
        let others = log
            .stop_starts
            .iter()
            .filter(|(id, t)| {
                inside(*t)
                    && !log
                        .pod_of
                        .get(id)
                        .is_some_and(|p| p.starts_with(prefix.as_str()))
            })
            .count();
        if let Some(s) = samples.get_mut(cfg) {
            s.gc_during_measurements += gc;
            s.other_stops_during_measurements += others;
        }
    }
    for (id, n) in settled.borrow().iter() {
        let (now, _) = log.stop_progress(id);
        let cfg = log.pod_of.get(id).and_then(|p| bench_pod_parts(p));
        if let Some(s) = cfg.and_then(|(c, _, _)| samples.get_mut(c)) {
            s.late_stops += now.saturating_sub(*n);
        }
    }
    let left = api.list(&format!("{PODS}?labelSelector=app%3Dpod-bench"));
    assert!(left.is_empty(), "bench pods left: {}", left.len());
    let veths = node
        .host_sh("ip -o link show")
        .lines()
        .filter(|l| l.contains(": cali") || l.contains(": veth"))
        .count();
    neighbour.borrow_mut().take();
    let load_end = loadavg();
    let took = started.elapsed();

    // The report.
    let mut out = String::new();
    let w = &mut out;
    use std::fmt::Write as _;
    let _ = writeln!(
        w,
        "## Pod start through a real node (kubelet + containerd + kube-apiserver)\n"
    );
    let _ = writeln!(
        w,
        "- machine: {} CPUs ({}), kernel {}; {}; {}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        std::fs::read_to_string("/proc/cpuinfo")
            .unwrap_or_default()
            .lines()
            .find_map(|l| l
                .strip_prefix("model name")
                .map(|r| r.trim_start_matches([' ', '\t', ':']).to_string()))
            .unwrap_or_default(),
        first_line_of("uname", &["-r"]),
        first_line_of(&node.peers.containerd.display().to_string(), &["--version"]),
        first_line_of(&node.peers.kubelet.display().to_string(), &["--version"]),
    );
    let _ = writeln!(
        w,
        "- /proc/loadavg at start: {load_start}; at end: {load_end}"
    );
    let _ = writeln!(
        w,
        "- {rounds} rounds (+1 warm-up pod per config, not counted), configs interleaved round-robin, the first rotating each round; per round and config: {alone} pods alone, one after another (create, Ready, delete, sandbox stopped), then {wave} pods created at once (concurrent POSTs, one thread each), all Ready (API polled every {} ms), deleted; after each delete, {}s with no new StopPodSandbox before going on",
        BENCH_POLL.as_millis(),
        BENCH_QUIET.as_secs()
    );
    let _ = writeln!(
        w,
        "- {}",
        if neighbour_ms > 0 {
            format!("the plugin's API Priority and Fairness level (workload-high) kept busy as in a cluster: another kube-system ServiceAccount sends a read (GET /version) and a write RBAC refuses every {neighbour_ms} ms (`BENCH_POD_NEIGHBOUR_MS`; 0: none). (A v1.24 API server charged the first request after an idle spell with CPU for every idle millisecond, APF's sample-and-watermark histograms; v1.25 replaced them: on this v1.35 server the neighbour is what a cluster's other clients send){}", if configs.iter().any(|c| c.quiet) { "; rows named `-quiet` were measured without it (`BENCH_POD_NEIGHBOUR_AB=1`)" } else { "" })
        } else {
            "no neighbour on the plugin's API Priority and Fairness level (`BENCH_POD_NEIGHBOUR_MS=0`): nothing else on the plugin's APF level".to_string()
        }
    );
    let _ = writeln!(
        w,
        "- RunPodSandbox and StopPodSandbox: containerd's log (call start to return; StopPodSandbox: the first call of each sandbox, which runs the CNI DEL). \"All Ready\": as the API shows it, which follows kubelet's PLEG relist (1 s period): expect ±0.5 s of noise per sample"
    );
    let _ = writeln!(
        w,
        "- kubelet's container GC (once a minute; a CNI DEL for every dead sandbox through the config of the moment) is kept out of the measurements: the bench waited {gc_waits:.0?} in all for it"
    );
    let _ = writeln!(
        w,
        "- calico: {}{}",
        ours.display(),
        before
            .as_ref()
            .map(|b| format!("; before: {}", b.display()))
            .unwrap_or_default()
            + &upstream
                .as_ref()
                .map(|u| format!("; upstream: {}", u.join("calico").display()))
                .unwrap_or_default()
    );
    let _ = writeln!(
        w,
        "- run took {took:.0?}; after it {veths} pod veths were left on the node\n"
    );
    let _ = writeln!(
        w,
        "| config | RunPodSandbox alone, median (ms) | alone, p90 (ms) | RunPodSandbox in a wave of {wave}, median (ms) | StopPodSandbox, median (ms) | alone | in a wave | {wave} pods all Ready, median (s) | ×ptp RunPodSandbox alone | ×ptp StopPodSandbox | alone | in a wave | ×ptp {wave} all Ready |"
    );
    let _ = writeln!(w, "|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let median_of = |v: &[f64]| percentile(v, 50.0);
    let base = &samples["ptp"];
    for cfg in &configs {
        let s = &samples[cfg.name];
        let _ = writeln!(
            w,
            "| {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
            cfg.name,
            median_of(&s.run_alone_ms),
            percentile(&s.run_alone_ms, 90.0),
            median_of(&s.run_wave_ms),
            median_of(&s.stop_ms),
            median_of(&s.stop_alone_ms),
            median_of(&s.stop_wave_ms),
            median_of(&s.wave_ready_ms) / 1000.0,
            median_of(&s.run_alone_ms) / median_of(&base.run_alone_ms),
            median_of(&s.stop_ms) / median_of(&base.stop_ms),
            median_of(&s.stop_alone_ms) / median_of(&base.stop_alone_ms),
            median_of(&s.stop_wave_ms) / median_of(&base.stop_wave_ms),
            median_of(&s.wave_ready_ms) / median_of(&base.wave_ready_ms),
        );
    }
    let _ = writeln!(w);
    for cfg in &configs {
        let s = &samples[cfg.name];
        let _ = writeln!(
            w,
            "- {}: samples: {} alone, {} in waves, {} stops; one pod POST to Ready median {:.0} ms; RunPodSandbox failures (retried by kubelet) {}; sandboxes stopped more than once {} (calls after the bench moved on, i.e. kubelet's GC: {}); during its measurements: kubelet GC lines {}, StopPodSandbox of other pods {}",
            cfg.name,
            s.run_alone_ms.len(),
            s.run_wave_ms.len(),
            s.stop_ms.len(),
            median_of(&s.solo_ready_ms),
            s.run_failures,
            s.stopped_more_than_once,
            s.late_stops,
            s.gc_during_measurements,
            s.other_stops_during_measurements,
        );
    }
    if plugin_times.is_some() {
        let _ = writeln!(
            w,
            "\nThe network plugin's own time on the node (`BENCH_POD_PLUGIN_TIMES`: a bash wrapper around `calico` and `ptp`, the chain's first plugin, its IPAM included; the wrapper's start-up, ~2 ms, is in every figure; portmap is not in it):\n"
        );
        let _ = writeln!(
            w,
            "| config | ADD of a pod alone, median (ms) | p90 (ms) | − ptp (ms) | DEL, median (ms) | − ptp (ms) |"
        );
        let _ = writeln!(w, "|---|---|---|---|---|---|");
        let med = |v: &[f64]| if v.is_empty() { f64::NAN } else { median_of(v) };
        for cfg in &configs {
            let s = &samples[cfg.name];
            let _ = writeln!(
                w,
                "| {} | {:.1} | {:.1} | {:+.1} | {:.1} | {:+.1} |",
                cfg.name,
                med(&s.plugin_add_ms),
                if s.plugin_add_ms.is_empty() {
                    f64::NAN
                } else {
                    percentile(&s.plugin_add_ms, 90.0)
                },
                med(&s.plugin_add_ms) - med(&base.plugin_add_ms),
                med(&s.plugin_del_ms),
                med(&s.plugin_del_ms) - med(&base.plugin_del_ms),
            );
        }
    }
    let _ = writeln!(std::io::stdout(), "\n{out}");
    if let Some(path) = std::env::var_os("BENCH_POD_OUT").filter(|p| !p.is_empty()) {
        std::fs::write(&path, &out)
            .unwrap_or_else(|e| panic!("BENCH_POD_OUT {}: {e}", Path::new(&path).display()));
    }
    if let Some(path) = std::env::var_os("BENCH_POD_JSON").filter(|p| !p.is_empty()) {
        let raw = json!({
            "rounds": rounds, "wave": wave,
            "loadavg_start": load_start, "loadavg_end": load_end,
            "calico": ours, "before": before, "upstream": upstream,
            "seconds": took.as_secs_f64(),
            "configs": samples,
        });
        std::fs::write(&path, serde_json::to_string_pretty(&raw).expect("JSON"))
            .unwrap_or_else(|e| panic!("BENCH_POD_JSON {}: {e}", Path::new(&path).display()));
    }
    if let Some(path) = std::env::var_os("BENCH_POD_AUDIT").filter(|p| !p.is_empty()) {
        std::fs::copy(node.api().audit_path(), &path)
            .unwrap_or_else(|e| panic!("BENCH_POD_AUDIT {}: {e}", Path::new(&path).display()));
    }
    for (cfg, s) in &samples {
        let expected = rounds * (wave + alone);
        assert!(
            s.run_alone_ms.len() == rounds * alone && s.run_wave_ms.len() == rounds * wave,
            "{cfg}: RunPodSandbox samples {} + {} of {expected}",
            s.run_alone_ms.len(),
            s.run_wave_ms.len()
        );
    }
    drop(node);
}

/// containerd's RunPodSandbox log lines, in containerd 1.6's format and containerd 2's (the
/// metadata as protobuf text, one or two spaces between fields), parse to the same call.
#[test]
fn run_pod_sandbox_lines_of_both_containerd_formats() {
    use common::real_node::RunPodSandboxLine;
    let v1_start = r#"time="2026-01-01T00:00:00Z" level=info msg="RunPodSandbox for &PodSandboxMetadata{Name:a,Uid:u1,Namespace:default,Attempt:0,}""#;
    let v1_end = r#"time="2026-01-01T00:00:01Z" level=info msg="RunPodSandbox for &PodSandboxMetadata{Name:a,Uid:u1,Namespace:default,Attempt:0,} returns sandbox id \"abc\"""#;
    let v2_start = r#"time="2026-01-01T00:00:00Z" level=info msg="RunPodSandbox for name:\"a\"  uid:\"u1\"  namespace:\"default\"""#;
    let v2_end = r#"time="2026-01-01T00:00:01Z" level=info msg="RunPodSandbox for name:\"a\" uid:\"u1\" namespace:\"default\" returns sandbox id \"abc\"""#;
    let v2_failed = r#"time="2026-01-01T00:00:01Z" level=error msg="RunPodSandbox for name:\"a\"  uid:\"u1\"  namespace:\"default\"  attempt:2 failed, error" error="rpc error""#;
    for (start, end) in [(v1_start, v1_end), (v2_start, v2_end)] {
        let s = RunPodSandboxLine::parse(start).expect("a start line");
        let e = RunPodSandboxLine::parse(end).expect("an end line");
        assert_eq!(
            (s.name.as_str(), s.sandbox_id, s.failed),
            ("a", None, false)
        );
        assert_eq!(e.name, "a");
        assert_eq!(e.sandbox_id.as_deref(), Some("abc"));
        assert_eq!(s.key, e.key, "start and end of one call share a key");
    }
    let f = RunPodSandboxLine::parse(v2_failed).expect("a failed line");
    assert!(f.failed && f.sandbox_id.is_none() && f.name == "a");
    assert!(f.key.contains("attempt=2"));
    assert!(RunPodSandboxLine::parse(r#"msg="StopPodSandbox for \"abc\"""#).is_none());
}
