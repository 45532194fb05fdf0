//! End to end, the gRPC dataplane (`dataplane_options: {type: grpc, socket: unix://...}`):
//! the built `calico` binary run as kubelet runs it, on a real etcd, against a fake dataplane
//! agent (`common::grpc_dataplane`). ADD sends the agent an AddRequest instead of building a
//! veth pair, and writes what it answers into the endpoint and the result; DEL sends a
//! DelRequest; every failure of the agent (refusal, absence, silence) fails the ADD with
//! nothing left behind, within its timeout.

use std::time::Duration;

use crate::common::cni::{with_prev_result, Invocation, Outcome};
use crate::common::grpc_dataplane::{GrpcDataplane, Reply};
use crate::common::netns::{require_root, Netns};
use crate::common::world::{World, NODE, WEP_PREFIX};
use serde_json::{json, Value};

const WEP: &str = "node1-k8s-nginx-eth0";
/// What Calico/VPP's agent answers as the container MAC.
const VPP_MAC: &str = "02:00:00:00:00:00";

fn conf(w: &World, socket: &str) -> String {
    w.conf(json!({
        "mtu": 1400,
        "container_settings": {"allow_ip_forwarding": true},
        "dataplane_options": {"type": "grpc", "socket": socket, "vpp_option": "x", "n": 5},
    }))
}

fn add(pod: &Netns, id: &str) -> Invocation {
    Invocation::new("ADD", id, pod.path()).k8s("default", "nginx")
}

/// No interface in the pod or on the host made by us.
fn assert_no_veth(w: &World, pod: &Netns) {
    assert!(!pod.has_link("eth0"), "a veth in the pod");
    let links = w.host_sh("ip -o link show");
    assert!(!links.contains("cali"), "a host veth: {links}");
}

/// The CNI error of a failed ADD, within `limit`; nothing of the pod is left.
fn assert_failed_clean(w: &World, pod: &Netns, out: &Outcome, limit: Duration) -> Value {
    assert!(out.elapsed < limit, "took {:?}", out.elapsed);
    let err = out.assert_err();
    w.assert_clean();
    assert_no_veth(w, pod);
    err
}

/// (a) ADD sends upstream's AddRequest and uses the agent's answer; CHECK passes without
/// kernel state; (b) DEL sends a DelRequest and releases everything.
#[test]
fn add_check_and_del_through_the_agent() {
    require_root();
    let w = World::new();
    let pod = w.pod();
    let agent = GrpcDataplane::start(Reply::success("tun-vpp7", "02:00:00:00:00:0A"));
    let socket = agent.address();
    let conf = conf(&w, &socket);
    let inv = add(&pod, "grpc1");
    let r = w.calico(&inv, &conf).assert_ok().json();

    // The request, as upstream fills it.
    let adds = agent.adds();
    assert_eq!(adds.len(), 1, "{:?}", agent.received());
    let a = &adds[0];
    assert_eq!(a.interface_name, "eth0");
    assert_eq!(a.netns, pod.path());
    assert!(
        a.desired_host_interface_name.starts_with("cali")
            && a.desired_host_interface_name.len() == 15,
        "{}",
        a.desired_host_interface_name
    );
    let settings = a.settings.expect("settings");
    assert_eq!((settings.mtu, settings.allow_ip_forwarding), (1400, true));
    assert_eq!(a.container_ips.len(), 1);
    // As Calico IPAM gives it: the address with its block's prefix.
    let address = &a.container_ips[0].address;
    assert!(
        address.starts_with("10.65.") && address.ends_with("/26"),
        "{address}"
    );
    let ip = address.trim_end_matches("/26");
    // Calico IPAM gives no gateway: Go's rendering of a nil IP.
    assert_eq!(a.container_ips[0].gateway, "<nil>");
    assert_eq!(a.container_routes, ["0.0.0.0/0", "::/0"]);
    let wl = a.workload.clone().expect("workload");
    assert_eq!(wl.name, WEP);
    assert_eq!(wl.namespace, "default");
    assert_eq!(
        (
            wl.endpoint.as_str(),
            wl.node.as_str(),
            wl.orchestrator.as_str(),
            wl.pod.as_str()
        ),
        ("eth0", NODE, "k8s", "nginx")
    );
    // No Kubernetes API (policy type k8s) here: no labels, annotations or ports.
    assert!(wl.annotations.is_empty() && wl.ports.is_empty());
    // String options only, `type` and `socket` included.
    let mut options: Vec<(&str, &str)> = a
        .dataplane_options
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    options.sort();
    assert_eq!(
        options,
        [
            ("socket", socket.as_str()),
            ("type", "grpc"),
            ("vpp_option", "x")
        ]
    );

    // The result and the endpoint name what the agent answered (the MAC in Go's form).
    let ifaces = r["interfaces"].as_array().expect("interfaces");
    assert_eq!(ifaces[0]["name"], "tun-vpp7");
    assert_eq!(ifaces[1]["name"], "eth0");
    assert_eq!(ifaces[1]["mac"], "02:00:00:00:00:0a");
    assert_eq!(ifaces[1]["sandbox"], pod.path());
    // As upstream's gRPC dataplane: the result keeps IPAM's prefix (only the Linux
    // dataplane narrows the addresses to host networks); the endpoint has the host network.
    assert_eq!(r["ips"][0]["address"], address.as_str());
    assert_eq!(r["ips"][0]["interface"], 1);
    let wep = w.get(&format!("{WEP_PREFIX}default/{WEP}"));
    assert_eq!(wep["spec"]["interfaceName"], "tun-vpp7");
    assert_eq!(wep["spec"]["mac"], "02:00:00:00:00:0a");
    assert_eq!(wep["spec"]["containerID"], "grpc1");
    assert_eq!(wep["spec"]["ipNetworks"][0], format!("{ip}/32").as_str());
    assert_no_veth(&w, &pod);

    // CHECK: the datastore and IPAM agree; the kernel is the agent's, not compared.
    let check = w.calico(&inv.as_check(), &with_prev_result(&conf, &r));
    check.assert_ok();
    assert_eq!(agent.received().len(), 1, "CHECK asked the agent");

    // DEL.
    w.calico(&inv.as_del(), &conf).assert_ok_fast();
    let dels = agent.dels();
    assert_eq!(dels.len(), 1, "{:?}", agent.received());
    assert_eq!(dels[0].interface_name, "eth0");
    assert_eq!(dels[0].netns, pod.path());
    assert_eq!(dels[0].dataplane_options, a.dataplane_options);
    w.assert_clean();
}

/// A Del the agent refuses or cannot answer is reported. As upstream, the endpoint goes but
/// the addresses are kept until the agent has removed the interface: an address is never
/// handed out while an interface may still hold it. The runtime's retried DEL releases them.
#[test]
fn addresses_are_kept_until_the_agent_removed_the_interface() {
    require_root();
    let w = World::new();
    let pod = w.pod();
    let agent = GrpcDataplane::start(Reply::success("tun-vpp7", VPP_MAC));
    let conf = conf(&w, &agent.address());
    let inv = add(&pod, "grpc2");
    w.calico(&inv, &conf).assert_ok();
    agent.set_del(Reply::Fail("vpp restarting".into()));
    let err = w.calico(&inv.as_del(), &conf).assert_err_fast();
    assert_eq!(err["msg"], "grpc dataplane error: vpp restarting");
    let kept = || {
        assert!(w.keys(WEP_PREFIX).is_empty(), "the endpoint goes first");
        assert_eq!(
            w.keys("/calico/ipam/v2/handle/").len(),
            1,
            "the addresses stay"
        );
    };
    kept();
    // The agent gone altogether: the same.
    let gone = GrpcDataplane::start(Reply::success("tun-vpp7", VPP_MAC));
    let gone_conf = self::conf(&w, &gone.address());
    drop(gone);
    let err = w.calico(&inv.as_del(), &gone_conf).assert_err_fast();
    let msg = err["msg"].as_str().unwrap();
    assert!(
        msg.starts_with("rpc error: code = Unavailable desc = connection error: desc = \"transport: Error while dialing: dial unix "),
        "{msg}"
    );
    kept();
    // The agent removes the interface: the retried DEL releases them.
    agent.set_del(Reply::success("", ""));
    w.calico(&inv.as_del(), &conf).assert_ok_fast();
    w.assert_clean();
    drop(agent);
    let err = w.calico(&inv.as_del(), &conf).assert_err_fast();
    let msg = err["msg"].as_str().unwrap();
    assert!(
        msg.starts_with("rpc error: code = Unavailable desc = connection error: desc = \"transport: Error while dialing: dial unix "),
        "{msg}"
    );
    w.assert_clean();
}

/// The endpoint cannot be written after the agent plumbed the pod (another writer took its
/// name meanwhile): the agent is asked to remove the interface again, the addresses are
/// given back, and the other writer's endpoint is left alone.
#[test]
fn a_failed_endpoint_write_sends_del() {
    require_root();
    let w = World::new();
    let pod = w.pod();
    let agent = GrpcDataplane::start(Reply::success("tun-vpp7", VPP_MAC));
    let conf = conf(&w, &agent.address());
    let (added, add_seen) = std::sync::mpsc::channel();
    let (name_taken, taken) = std::sync::mpsc::channel::<()>();
    // The Add waits until the name is taken.
    agent.on_add(move || {
        let _ = added.send(());
        let _ = taken.recv_timeout(Duration::from_secs(20));
    });
    let key = format!("{WEP_PREFIX}default/{WEP}");
    let foreign = json!({"kind":"WorkloadEndpoint","apiVersion":"projectcalico.org/v3",
        "metadata":{"name":WEP,"namespace":"default","uid":"9d4e2e4e-1111-4222-8333-444455556666",
            "creationTimestamp":"2026-01-01T00:00:00Z"},
        "spec":{"orchestrator":"k8s","node":NODE,"pod":"nginx","endpoint":"eth0","containerID":"other"}});
    let out = std::thread::scope(|s| {
        let run = s.spawn(|| w.calico(&add(&pod, "grpc7"), &conf));
        add_seen
            .recv_timeout(Duration::from_secs(30))
            .expect("the agent got the Add");
        w.etcd.put(&key, &foreign.to_string());
        let _ = name_taken.send(());
        run.join().expect("the plugin run")
    });
    assert!(
        out.elapsed < Duration::from_secs(20),
        "took {:?}",
        out.elapsed
    );
    out.assert_err();
    let dels = agent.dels();
    assert_eq!(dels.len(), 1, "{:?}", agent.received());
    assert_eq!(
        (dels[0].interface_name.as_str(), dels[0].netns.as_str()),
        ("eth0", pod.path())
    );
    assert_eq!(w.get(&key)["spec"]["containerID"], "other");
    assert!(w.keys("/calico/ipam/v2/handle/").is_empty());
    w.etcd.delete_prefix(WEP_PREFIX);
    w.assert_clean();
}

/// (c) The agent refuses: upstream's error, nothing left.
#[test]
fn a_refused_add_leaves_nothing() {
    require_root();
    let w = World::new();
    let pod = w.pod();
    let agent = GrpcDataplane::start(Reply::Fail("no VPP interface for you".into()));
    let out = w.calico(&add(&pod, "grpc3"), &conf(&w, &agent.address()));
    let err = assert_failed_clean(&w, &pod, &out, Duration::from_secs(20));
    assert_eq!(err["msg"], "grpc dataplane error: no VPP interface for you");
    assert_eq!(agent.adds().len(), 1);
    // Nothing was added, so nothing is deleted.
    assert!(agent.dels().is_empty());
}

/// (d) Nothing listens on the socket: a connection error at once, nothing left.
#[test]
fn no_agent_fails_at_once_and_leaves_nothing() {
    require_root();
    let w = World::new();
    let pod = w.pod();
    let missing = w.scratch.path().join("no-agent.sock");
    let socket = format!("unix://{}", missing.display());
    let out = w.calico(&add(&pod, "grpc4"), &conf(&w, &socket));
    let err = assert_failed_clean(&w, &pod, &out, Duration::from_secs(5));
    assert_eq!(
        err["msg"],
        format!(
            "rpc error: code = Unavailable desc = connection error: desc = \"transport: Error while dialing: dial unix {}: connect: no such file or directory\"",
            missing.display()
        )
        .as_str()
    );
}

/// (e) The agent never answers: the ADD fails at upstream's 5 s, nothing left.
#[test]
fn a_silent_agent_times_out_after_5s() {
    require_root();
    let w = World::new();
    let pod = w.pod();
    let agent = GrpcDataplane::start(Reply::Stall);
    let out = w.calico(&add(&pod, "grpc5"), &conf(&w, &agent.address()));
    let err = assert_failed_clean(&w, &pod, &out, Duration::from_secs(15));
    assert!(out.elapsed >= Duration::from_secs(5), "{:?}", out.elapsed);
    assert_eq!(
        err["msg"],
        "rpc error: code = DeadlineExceeded desc = context deadline exceeded"
    );
    assert_eq!(agent.adds().len(), 1);
}

/// (e') ... or at the call's deadline, when that comes first: code 11, nothing left.
#[test]
fn a_silent_agent_is_cut_at_the_call_deadline() {
    require_root();
    let w = World::new();
    let pod = w.pod();
    let agent = GrpcDataplane::start(Reply::Stall);
    let mut inv = add(&pod, "grpc6");
    inv.extra_env
        .push(("CALICO_CALL_TIMEOUT_SECONDS".into(), "2".into()));
    let out = w.calico(&inv, &conf(&w, &agent.address()));
    let err = assert_failed_clean(&w, &pod, &out, Duration::from_secs(5));
    assert_eq!(err["code"], 11, "{err}");
    let msg = err["msg"].as_str().unwrap();
    assert!(
        msg.contains("deadline of 2s") && msg.contains("waiting for the gRPC dataplane (Add"),
        "{msg}"
    );
}
