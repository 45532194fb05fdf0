//! Our plugin driven by libcni — the library containerd, CRI-O and podman run CNI plugins
//! with — through `tests/libcni/` (a tiny runtime on Debian's libcni 1.1.2). The conflist is
//! the shipped `conf-examples/10-calico-portmap-bandwidth.conflist` (calico → Debian's
//! portmap → bandwidth) on a test etcd, at cniVersion 1.0.0, 0.4.0 and 0.3.1:
//! AddNetworkList (each plugin gets the previous one's result as prevResult; libcni caches
//! the final result), CheckNetworkList (prevResult from the cache; the runtime's capability
//! arguments passed again, as runtimes do), traffic through the mapped host port, then
//! DelNetworkList leaving nothing behind, and a second DEL succeeding.
//!
//! The node has iptables but no ip6tables on the runtime's PATH ([`ipv4_only_path`]: Debian's
//! portmap 1.1.1 fails every CHECK where ip6tables works).

use std::fs::File;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use crate::common;
use crate::common::examples;
use crate::common::kube_api::KubeApi;
use crate::common::libcni::{driver_or_skip, ipv4_only_path, Driver, RuntimeEnv};
use crate::common::netns::{require_root, Netns, UPLINK_PEER_V4, UPLINK_V4};
use crate::common::world::{World, WEP_PREFIX};
use serde_json::{json, Value};

const NETWORK: &str = "k8s-pod-network";
const CONTAINER_PORT: u16 = 8080;
const HOST_PORT: u16 = 30080;

/// What kubelet asks for, through containerd, for a pod with a hostPort and bandwidth
/// annotations (rates in bit/s; kubelet's burst is MaxInt32).
fn capability_args() -> Value {
    json!({
        "portMappings": [
            {"hostPort": HOST_PORT, "containerPort": CONTAINER_PORT, "protocol": "tcp"}
        ],
        "bandwidth": {
            "ingressRate": 10_000_000, "ingressBurst": 2_147_483_647_u64,
            "egressRate": 10_000_000, "egressBurst": 2_147_483_647_u64
        }
    })
}

#[test]
fn chain_through_libcni_at_1_0_0() {
    chain_through_libcni("chain_through_libcni_at_1_0_0", "1.0.0");
}

#[test]
fn chain_through_libcni_at_0_4_0() {
    chain_through_libcni("chain_through_libcni_at_0_4_0", "0.4.0");
}

#[test]
fn chain_through_libcni_at_0_3_1() {
    chain_through_libcni("chain_through_libcni_at_0_3_1", "0.3.1");
}

/// The runtime's side of one pod: the conflist, libcni's environment and the sandbox.
struct Runtime<'a> {
    driver: &'a Driver,
    world: &'a World,
    conflist: std::path::PathBuf,
    env: RuntimeEnv,
    container_id: String,
}

impl Runtime<'_> {
    fn call(&self, verb: &str, pod: &Netns) -> common::cni::Outcome {
        self.driver.call(
            self.world.host.name(),
            verb,
            &self.conflist,
            &self.container_id,
            pod.path(),
            &self.env,
        )
    }

    fn cache_file(&self) -> std::path::PathBuf {
        self.env
            .cache_dir
            .join("results")
            .join(format!("{NETWORK}-{}-eth0", self.container_id))
    }
}

fn chain_through_libcni(test: &str, version: &str) {
    require_root();
    let Some(driver) = driver_or_skip(test) else {
        return;
    };
    let w = World::new();
    // The API server of the example's kubeconfig: the pod's ADD makes its client from it and
    // calico-ipam reads the pod's namespace there.
    let api = KubeApi::start_in_netns(w.host.path());
    api.put(
        "/api/v1/namespaces/default",
        json!({"apiVersion":"v1","kind":"Namespace","metadata":{"name":"default"}}),
    );
    let mut list = examples::load_for_etcd_world(
        "10-calico-portmap-bandwidth.conflist",
        &w,
        Some(api.kubeconfig()),
    );
    list["cniVersion"] = json!(version);
    let conflist = examples::write(w.scratch.path(), "net.conflist", &list);
    let container_id = format!("libcni{}", version.replace('.', ""));
    let rt = Runtime {
        driver,
        world: &w,
        conflist,
        env: RuntimeEnv {
            cni_path: w.bin.path(),
            cache_dir: w.scratch.path().join("cni-cache"),
            ifname: "eth0".into(),
            // As containerd passes them for a Kubernetes pod.
            cni_args: format!(
                "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web;\
                 K8S_POD_INFRA_CONTAINER_ID={container_id};K8S_POD_UID=0b5d6a4e-1111-4222-8333-444455556666"
            ),
            cap_args: Some(capability_args()),
            path: Some(ipv4_only_path(w.scratch.path())),
        },
        container_id,
    };
    let pod = w.pod();

    // ADD: the chain's final result, in the conflist's version.
    let out = rt.call("add", &pod);
    assert_eq!(out.code, 0, "libcni ADD failed: {}", out.stderr);
    let result = out.json();
    assert_result_shape(&result, version, pod.path());
    let ip = result["ips"][0]["address"]
        .as_str()
        .and_then(|a| a.strip_suffix("/32"))
        .unwrap_or_else(|| panic!("an IPv4 /32 in {result}"))
        .to_string();
    let host_veth = result["interfaces"][0]["name"]
        .as_str()
        .expect("host veth")
        .to_string();

    // libcni cached that result with the runtime's arguments, and hands it back converted
    // to the conflist's version.
    let cached: Value = serde_json::from_slice(
        &std::fs::read(rt.cache_file()).unwrap_or_else(|e| panic!("libcni cache file: {e}")),
    )
    .expect("cache file is JSON");
    assert_eq!(cached["kind"], "cniCacheV1");
    assert_eq!(cached["containerId"], rt.container_id.as_str());
    assert_eq!(cached["networkName"], NETWORK);
    assert_eq!(cached["ifName"], "eth0");
    assert_eq!(cached["capabilityArgs"], capability_args());
    assert_eq!(cached["result"], result, "cached result");
    let out = rt.call("cached", &pod);
    assert_eq!(out.code, 0, "libcni cached result: {}", out.stderr);
    assert_eq!(out.json(), result, "GetNetworkListCachedResult");

    // What each plugin of the chain built.
    let pod_routes = pod.ip(&["route", "show"]);
    assert!(
        pod_routes.contains("default via 169.254.1.1 dev eth0"),
        "pod routes: {pod_routes}"
    );
    assert!(
        w.host_sh("ip route show")
            .contains(&format!("{ip} dev {host_veth}")),
        "host route to {ip}"
    );
    assert_eq!(
        w.keys(&format!("{WEP_PREFIX}default/node1-k8s-web-eth0"))
            .len(),
        1,
        "WorkloadEndpoint"
    );
    assert_eq!(
        w.keys(&format!(
            "/calico/ipam/v2/handle/{NETWORK}.{}",
            rt.container_id
        ))
        .len(),
        1,
        "IPAM handle"
    );
    let nat = w.host_sh("iptables-save -t nat");
    assert!(
        nat.contains(&rt.container_id)
            && nat.contains(&format!("--to-destination {ip}:{CONTAINER_PORT}")),
        "portmap DNAT rules for {ip}:{CONTAINER_PORT}:\n{nat}"
    );
    let qdiscs = w.host_sh(&format!("tc qdisc show dev {host_veth}"));
    assert!(
        qdiscs.contains("tbf"),
        "bandwidth ingress tbf on {host_veth}: {qdiscs}"
    );
    let ifbs = w.host_sh("ip -o link show type ifb");
    assert!(ifbs.contains("bwp"), "bandwidth egress ifb: {ifbs:?}");

    // CHECK: libcni refuses it below 0.4.0 without running a plugin; from 0.4.0 every plugin
    // gets the cached result as prevResult and the capability arguments again.
    let out = rt.call("check", &pod);
    if version == "0.3.1" {
        assert_ne!(out.code, 0, "libcni ran CHECK at 0.3.1");
        assert!(
            out.stderr.contains("does not support the CHECK command"),
            "{}",
            out.stderr
        );
    } else {
        assert_eq!(out.code, 0, "libcni CHECK failed: {}", out.stderr);
        assert!(out.stdout.is_empty(), "CHECK printed {:?}", out.stdout);
    }

    // Traffic through the mapped host port: from the uplink's far end (an outside client,
    // PREROUTING) and from the node itself (OUTPUT), to the node's address.
    let server = PodServer::start(&pod, CONTAINER_PORT, 2);
    let target: SocketAddr = format!("{UPLINK_V4}:{HOST_PORT}").parse().expect("address");
    let from_outside = fetch(w.host.uplink_peer().path(), target);
    let from_node = fetch(w.host.path(), target);
    let seen = server.join();
    assert_eq!(from_outside, format!("hello from {ip}\n"), "outside client");
    assert_eq!(from_node, format!("hello from {ip}\n"), "node-local client");
    assert!(
        seen.iter().any(|a| a.ip().to_string() == UPLINK_PEER_V4),
        "the pod saw the outside client's own address (DNAT, no SNAT): {seen:?}"
    );

    // Drift is seen through libcni too: calico's CHECK compares the cached prevResult with
    // the node, and a missing host route fails the whole list's CHECK.
    if version != "0.3.1" {
        w.host
            .ip(&["route", "del", &format!("{ip}/32"), "dev", &host_veth]);
        let out = rt.call("check", &pod);
        assert_ne!(out.code, 0, "CHECK passed without the host route");
        assert!(
            out.stderr.contains(&ip) && out.stderr.contains("route"),
            "CHECK names the missing route: {}",
            out.stderr
        );
    }

    // DEL: everything each plugin made is gone, and libcni dropped its cache entry.
    let out = rt.call("del", &pod);
    assert_eq!(out.code, 0, "libcni DEL failed: {}", out.stderr);
    assert!(!rt.cache_file().exists(), "libcni cache entry left");
    assert_nothing_left(&w, &rt.container_id, &ip);

    // A second DEL (no cached result any more) succeeds and changes nothing.
    let out = rt.call("del", &pod);
    assert_eq!(out.code, 0, "second libcni DEL failed: {}", out.stderr);
    assert_nothing_left(&w, &rt.container_id, &ip);
}

/// The result as libcni returns it at `version`, built along the chain: calico's host veth
/// and the pod's `eth0` (in the sandbox) with one IPv4 /32 (with 0.3.x/0.4.0's `version`
/// field) and the route to its block, passed on as prevResult to portmap (which adds
/// nothing) and to bandwidth, which appends its ifb device.
fn assert_result_shape(r: &Value, version: &str, sandbox: &str) {
    assert_eq!(r["cniVersion"], version, "{r}");
    let ifs = r["interfaces"].as_array().expect("interfaces");
    assert_eq!(ifs.len(), 3, "{r}");
    assert!(ifs[0].get("sandbox").is_none(), "host side: {r}");
    assert!(
        ifs[0]["name"]
            .as_str()
            .is_some_and(|n| n.starts_with("cali")),
        "{r}"
    );
    assert_eq!(ifs[1]["name"], "eth0");
    assert_eq!(ifs[1]["sandbox"], sandbox);
    assert!(
        ifs[2]["name"]
            .as_str()
            .is_some_and(|n| n.starts_with("bwp")),
        "{r}"
    );
    assert!(ifs[2].get("sandbox").is_none(), "ifb is on the node: {r}");
    let ips = r["ips"].as_array().expect("ips");
    assert_eq!(ips.len(), 1, "{r}");
    assert_eq!(ips[0]["interface"], 1, "{r}");
    if version == "1.0.0" {
        assert!(
            ips[0].get("version").is_none(),
            "1.0.0 has no ips[].version: {r}"
        );
    } else {
        assert_eq!(ips[0]["version"], "4", "{r}");
    }
    assert!(
        r["routes"].as_array().is_some_and(
            |rs| rs.len() == 1 && rs[0]["dst"].as_str().is_some_and(|d| d.ends_with("/26"))
        ),
        "the block's route: {r}"
    );
}

/// No veth, route, WorkloadEndpoint, IPAM handle or allocation (World::assert_clean), no
/// portmap rule and no bandwidth ifb left in the node's netns.
fn assert_nothing_left(w: &World, container_id: &str, ip: &str) {
    w.assert_clean();
    let nat = w.host_sh("iptables-save -t nat");
    assert!(
        !nat.contains(container_id) && !nat.contains(ip) && !nat.contains("CNI-DN-"),
        "portmap rules left:\n{nat}"
    );
    let ifbs = w.host_sh("ip -o link show type ifb");
    assert!(ifbs.trim().is_empty(), "bandwidth ifb left: {ifbs}");
    let qdiscs = w.host_sh("tc qdisc show");
    assert!(!qdiscs.contains("tbf"), "tbf qdisc left: {qdiscs}");
}

/// Enters the network namespace at `path` on the current thread.
fn enter(path: &str) {
    let ns = File::open(path).unwrap_or_else(|e| panic!("open {path}: {e}"));
    nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
        .unwrap_or_else(|e| panic!("setns {path}: {e}"));
}

/// A TCP server in the pod's netns that greets `expected` clients (with the pod's own
/// address) and records who connected; it gives up after 20 s.
struct PodServer {
    handle: std::thread::JoinHandle<Vec<SocketAddr>>,
}

impl PodServer {
    fn start(pod: &Netns, port: u16, expected: usize) -> PodServer {
        let path = pod.path().to_string();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let handle = std::thread::spawn(move || {
            enter(&path);
            let listener = TcpListener::bind(("0.0.0.0", port)).expect("bind in the pod");
            listener
                .set_nonblocking(true)
                .expect("nonblocking listener");
            let _ = ready_tx.send(());
            let deadline = Instant::now() + Duration::from_secs(20);
            let mut seen = Vec::new();
            while seen.len() < expected && Instant::now() < deadline {
                match listener.accept() {
                    Ok((mut s, peer)) => {
                        let local = s.local_addr().map(|a| a.ip().to_string());
                        let _ = s.set_nonblocking(false);
                        let _ = writeln!(s, "hello from {}", local.unwrap_or_default());
                        seen.push(peer);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    Err(e) => panic!("accept in the pod: {e}"),
                }
            }
            seen
        });
        ready_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("pod server listening");
        PodServer { handle }
    }

    fn join(self) -> Vec<SocketAddr> {
        self.handle.join().expect("pod server thread")
    }
}

/// Connects to `to` from the netns at `from` and reads what the server says (5 s bounds).
fn fetch(from: &str, to: SocketAddr) -> String {
    let from = from.to_string();
    std::thread::spawn(move || {
        enter(&from);
        let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(5))
            .unwrap_or_else(|e| panic!("connect to {to} from {from}: {e}"));
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("read timeout");
        let mut got = String::new();
        s.read_to_string(&mut got)
            .unwrap_or_else(|e| panic!("read from {to}: {e}"));
        got
    })
    .join()
    .expect("client thread")
}
