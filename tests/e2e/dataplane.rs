//! Root-only tests of the Linux dataplane (ADD's `build` and `finish`, through
//! `common::pod_network`, and `clean_up_namespace`) against the
//! real kernel: every test builds a "host" netns (with an uplink, like a node) and pod
//! netns, calls the library from a thread inside the host netns, and checks the result with
//! `ip` and `/proc/sys`.

use crate::common;
use crate::common::netns::{ping_available, HostNetns, Netns, UPLINK_IF};
use crate::common::pod_network::{network, PodRequest};
use calico_cni::dataplane::{
    clean_up_namespace, host_link_exists, DataplaneError, NetworkingResult,
};

fn request(pod: &Netns, host_veth: &str, ips: &[&str], routes: &[&str]) -> PodRequest {
    PodRequest::new(pod.path(), host_veth, ips, routes)
}

/// Networks the pod from a thread inside `host`, and checks that the calling thread is still
/// in the host netns afterwards.
fn run(host: &HostNetns, req: &PodRequest) -> Result<NetworkingResult, DataplaneError> {
    host.run_in(|| {
        let before = std::fs::read_link("/proc/thread-self/ns/net").unwrap();
        let r = network(req);
        let after = std::fs::read_link("/proc/thread-self/ns/net").unwrap();
        assert_eq!(before, after, "calling thread changed netns");
        r
    })
}

fn cleanup(host: &HostNetns, path: &str) -> Result<(), DataplaneError> {
    host.run_in(|| clean_up_namespace(path, "eth0"))
}

fn link_line(ns: &Netns, dev: &str) -> String {
    ns.ip(&["-d", "-o", "link", "show", "dev", dev])
}

fn assert_contains(haystack: &str, needle: &str) {
    assert!(
        haystack.contains(needle),
        "expected {needle:?} in:\n{haystack}"
    );
}

fn assert_sysctls(ns: &Netns, expected: &[(&str, &str)]) {
    for (key, want) in expected {
        assert_eq!(ns.sysctl(key), *want, "sysctl {key} in {}", ns.name());
    }
}

fn host_v4_sysctls(hv: &str) -> Vec<(String, &'static str)> {
    vec![
        (format!("net/ipv4/conf/{hv}/route_localnet"), "1"),
        (format!("net/ipv4/neigh/{hv}/proxy_delay"), "0"),
        (format!("net/ipv4/conf/{hv}/proxy_arp"), "1"),
        (format!("net/ipv4/conf/{hv}/forwarding"), "1"),
        (format!("net/ipv6/conf/{hv}/accept_ra"), "0"),
    ]
}

fn host_v6_sysctls(hv: &str) -> Vec<(String, &'static str)> {
    vec![
        (format!("net/ipv6/conf/{hv}/accept_dad"), "0"),
        (format!("net/ipv6/conf/{hv}/disable_ipv6"), "0"),
        (format!("net/ipv6/conf/{hv}/proxy_ndp"), "1"),
        (format!("net/ipv6/conf/{hv}/forwarding"), "1"),
        (format!("net/ipv6/conf/{hv}/accept_ra"), "0"),
    ]
}

fn check(ns: &Netns, owned: &[(String, &str)]) {
    let v: Vec<(&str, &str)> = owned.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    assert_sysctls(ns, &v);
}

#[test]
fn ipv4_pod() {
    let host = HostNetns::new();
    let pod = Netns::new("dp-pod");
    let hv = "cali0123456789a";
    let req = request(&pod, hv, &["10.65.0.5/26"], &["0.0.0.0/0"]);
    let res = run(&host, &req).expect("networking the pod");
    assert_eq!(res.host_veth, hv);

    // Container end: name, MTU, queues, kernel MAC reported, /32 address, routes.
    let cont = link_line(&pod, "eth0");
    assert_contains(&cont, "eth0@if");
    assert_contains(&cont, "mtu 1450");
    assert_contains(&cont, "state UP");
    assert_contains(&cont, "numtxqueues 1 numrxqueues 1");
    assert_contains(&cont, &format!("link/ether {} ", res.container_mac));
    assert_eq!(res.container_mac, res.container_mac.to_lowercase());
    let addr = pod.ip(&["-4", "-o", "addr", "show", "dev", "eth0"]);
    assert_contains(&addr, "inet 10.65.0.5/32 scope global eth0");
    assert_eq!(
        pod.ip(&["-4", "route"]),
        "default via 169.254.1.1 dev eth0 \n169.254.1.1 dev eth0 scope link \n"
    );

    // Host end: name, MAC, MTU, queues, peer in the pod netns, /32 route (proto boot: hidden).
    let h = link_line(&host, hv);
    assert_contains(&h, &format!("{hv}@if"));
    assert_contains(&h, "mtu 1450");
    assert_contains(&h, "state UP");
    assert_contains(&h, "link/ether ee:ee:ee:ee:ee:ee");
    assert_contains(&h, "numtxqueues 1 numrxqueues 1");
    assert_contains(&h, &format!("link-netns {}", pod.name()));
    assert_eq!(
        host.ip(&["route", "show", "10.65.0.5"]),
        format!("10.65.0.5 dev {hv} scope link \n")
    );
    // From the test thread (the real host netns) the link is not visible.
    assert!(!host_link_exists(hv).unwrap());
    assert!(host.run_in(|| host_link_exists(hv)).unwrap());
    assert!(!host.run_in(|| host_link_exists("calinothere")).unwrap());

    check(&host, &host_v4_sysctls(hv));
    assert_sysctls(&pod, &[("net/ipv4/ip_forward", "0")]);
    // No IPv6 routes are added for an IPv4-only pod (only the kernel's fe80::/64).
    assert!(!pod.ip(&["-6", "route"]).contains("default"));
}

#[test]
fn forwarding_mac_annotation_queues_default_mtu() {
    let host = HostNetns::new();
    let pod = Netns::new("dp-pod");
    let hv = "cali0000000000b";
    let mut req = request(&pod, hv, &["10.65.0.6/32"], &["0.0.0.0/0", "10.96.0.0/12"]);
    req.allow_ip_forwarding = true;
    req.container_mac = Some([0x02, 0x11, 0x22, 0x33, 0x44, 0x55]);
    req.num_queues = 2;
    req.mtu = 0;
    let res = run(&host, &req).expect("networking the pod");
    assert_eq!(res.container_mac, "02:11:22:33:44:55");

    let cont = link_line(&pod, "eth0");
    assert_contains(&cont, "link/ether 02:11:22:33:44:55");
    assert_contains(&cont, "mtu 1500");
    assert_contains(&cont, "numtxqueues 2 numrxqueues 2");
    let h = link_line(&host, hv);
    assert_contains(&h, "mtu 1500");
    assert_contains(&h, "numtxqueues 2 numrxqueues 2");
    assert_eq!(
        pod.ip(&["-4", "route"]),
        "default via 169.254.1.1 dev eth0 \n10.96.0.0/12 via 169.254.1.1 dev eth0 \n\
         169.254.1.1 dev eth0 scope link \n"
    );
    assert_sysctls(&pod, &[("net/ipv4/ip_forward", "1")]);
}

#[test]
fn dual_stack_pod() {
    let host = HostNetns::new();
    let pod = Netns::new("dp-pod");
    let hv = "cali0000000000c";
    let req = request(
        &pod,
        hv,
        &["10.65.0.7/26", "fd00:65::7/122"],
        &["0.0.0.0/0", "::/0"],
    );
    run(&host, &req).expect("networking the pod");

    let addr6 = pod.ip(&["-6", "-o", "addr", "show", "dev", "eth0"]);
    assert_contains(&addr6, "inet6 fd00:65::7/128 scope global");
    assert!(!addr6.contains("tentative"), "tentative address:\n{addr6}");
    assert_contains(
        &pod.ip(&["-6", "route"]),
        "default via fe80::ecee:eeff:feee:eeee dev eth0 metric 1024",
    );
    assert_eq!(
        pod.ip(&["-4", "route"]),
        "default via 169.254.1.1 dev eth0 \n169.254.1.1 dev eth0 scope link \n"
    );
    let hll = host.ip(&["-6", "-o", "addr", "show", "dev", hv]);
    assert_contains(&hll, "inet6 fe80::ecee:eeff:feee:eeee/64 scope link");
    assert!(!hll.contains("tentative"), "tentative address:\n{hll}");
    assert_contains(
        &host.ip(&["-6", "route", "show", "fd00:65::7"]),
        &format!("fd00:65::7 dev {hv} metric 1024"),
    );
    assert_eq!(
        host.ip(&["route", "show", "10.65.0.7"]),
        format!("10.65.0.7 dev {hv} scope link \n")
    );

    check(&host, &host_v4_sysctls(hv));
    check(&host, &host_v6_sysctls(hv));
    assert_sysctls(
        &pod,
        &[
            ("net/ipv6/conf/eth0/accept_dad", "0"),
            ("net/ipv6/conf/all/disable_ipv6", "0"),
            ("net/ipv6/conf/default/disable_ipv6", "0"),
            ("net/ipv6/conf/lo/disable_ipv6", "0"),
            ("net/ipv6/conf/all/forwarding", "0"),
            ("net/ipv4/ip_forward", "0"),
        ],
    );
}

#[test]
fn ipv6_only_pod() {
    let host = HostNetns::new();
    let pod = Netns::new("dp-pod");
    let hv = "cali0000000000d";
    let mut req = request(&pod, hv, &["fd00:65::8/128"], &["0.0.0.0/0", "::/0"]);
    req.allow_ip_forwarding = true;
    run(&host, &req).expect("networking the pod");
    // No IPv4 routes at all (the 0.0.0.0/0 route only applies to IPv4 pods).
    assert!(pod.ip(&["-4", "route"]).trim().is_empty());
    assert_contains(
        &pod.ip(&["-6", "route"]),
        "default via fe80::ecee:eeff:feee:eeee dev eth0 metric 1024",
    );
    check(&host, &host_v6_sysctls(hv));
    // IPv4-only host sysctls are not touched (proxy_arp stays at its default 0).
    assert_eq!(host.sysctl(&format!("net/ipv4/conf/{hv}/proxy_arp")), "0");
    assert_sysctls(&pod, &[("net/ipv6/conf/all/forwarding", "1")]);
}

#[test]
fn replaces_preexisting_host_link() {
    let host = HostNetns::new();
    let pod = Netns::new("dp-pod");
    let hv = "cali0000000000e";
    host.ip(&[
        "link", "add", hv, "type", "veth", "peer", "name", "calipeer",
    ]);
    let req = request(&pod, hv, &["10.65.0.9/32"], &["0.0.0.0/0"]);
    run(&host, &req).expect("networking the pod");
    assert!(!host.has_link("calipeer"), "old peer should be gone");
    let h = link_line(&host, hv);
    assert_contains(&h, "link/ether ee:ee:ee:ee:ee:ee");
    assert_contains(&h, &format!("link-netns {}", pod.name()));
}

#[test]
fn host_route_owned_by_another_interface() {
    let host = HostNetns::new();
    let pod = Netns::new("dp-pod");
    let hv = "cali0000000000f";
    host.ip(&[
        "route",
        "add",
        "10.65.0.10/32",
        "dev",
        UPLINK_IF,
        "scope",
        "link",
    ]);
    let req = request(&pod, hv, &["10.65.0.10/32"], &["0.0.0.0/0"]);
    let err = run(&host, &req).expect_err("route conflict").to_string();
    let uidx = host.ifindex(UPLINK_IF);
    // The host end is gone by now (rolled back), so take its index from the message.
    let hidx: u32 = err
        .split("(Ifindex: ")
        .nth(1)
        .and_then(|r| r.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no ifindex in {err}"));
    assert_eq!(
        err,
        format!(
            "error adding host side routes for interface: {hv}, error: route (Ifindex: {hidx}, \
             Dst: 10.65.0.10/32, Scope: link) already exists for an interface other than \
             '{hv}': route (Ifindex: {uidx}, Dst: 10.65.0.10/32, Scope: link, Iface: {UPLINK_IF})"
        )
    );
    // Unlike upstream, the pair this call created is removed again; the other route stays.
    assert!(!host.has_link(hv));
    assert!(!pod.has_link("eth0"));
    assert!(host
        .ip(&["route", "show", "10.65.0.10"])
        .contains(UPLINK_IF));
}

#[test]
fn an_existing_pod_interface_is_never_removed() {
    let host = HostNetns::new();
    let pod = Netns::new("dp-pod");
    // The pod already has an eth0 (its running interface, or a retried ADD's).
    pod.ip(&[
        "link", "add", "eth0", "type", "veth", "peer", "name", "other0",
    ]);
    let before = pod.ifindex("eth0");
    let hv = "cali00000000012";
    let req = request(&pod, hv, &["10.65.0.13/32"], &["0.0.0.0/0"]);
    let err = run(&host, &req).expect_err("eth0 exists").to_string();
    assert_eq!(err, "file exists");
    assert_eq!(
        pod.ifindex("eth0"),
        before,
        "the pod's own eth0 was touched"
    );
    assert!(pod.has_link("other0"));
    assert!(!host.has_link(hv));
}

#[test]
fn skip_host_routes() {
    let host = HostNetns::new();
    let pod = Netns::new("dp-pod");
    let hv = "cali00000000010";
    let mut req = request(&pod, hv, &["10.65.0.11/32"], &["0.0.0.0/0"]);
    req.skip_host_routes = true;
    run(&host, &req).expect("networking the pod");
    assert!(host.ip(&["route", "show", "10.65.0.11"]).trim().is_empty());
}

#[test]
fn missing_netns_fails_with_upstream_text() {
    let host = HostNetns::new();
    let req = PodRequest {
        netns_path: "/run/netns/dp-definitely-missing".to_string(),
        ..request(&host, "cali00000000011", &["10.65.0.12/32"], &[])
    };
    let err = run(&host, &req).expect_err("missing netns");
    assert_eq!(
        err.to_string(),
        "failed to Statfs \"/run/netns/dp-definitely-missing\": no such file or directory"
    );
}

#[test]
fn two_pods_ping_each_other() {
    if !ping_available() {
        eprintln!(
            "skipping two_pods_ping_each_other: `ping` missing (apt-get install -y iputils-ping)"
        );
        return;
    }
    let host = HostNetns::new();
    let a = Netns::new("dp-poda");
    let b = Netns::new("dp-podb");
    let routes = ["0.0.0.0/0", "::/0"];
    run(
        &host,
        &request(&a, "calia", &["10.65.1.1/32", "fd00:65:1::1/128"], &routes),
    )
    .unwrap();
    run(
        &host,
        &request(&b, "calib", &["10.65.1.2/32", "fd00:65:1::2/128"], &routes),
    )
    .unwrap();
    a.exec_ok("ping", &["-c", "1", "-W", "3", "10.65.1.2"]);
    b.exec_ok("ping", &["-c", "1", "-W", "3", "10.65.1.1"]);
    a.exec_ok("ping", &["-6", "-c", "1", "-W", "3", "fd00:65:1::2"]);
    b.exec_ok("ping", &["-6", "-c", "1", "-W", "3", "fd00:65:1::1"]);
    // A pod also reaches the host's own uplink address.
    a.exec_ok("ping", &["-c", "1", "-W", "3", common::netns::UPLINK_V4]);
}

#[test]
fn clean_up_namespace_removes_everything_and_is_idempotent() {
    let host = HostNetns::new();
    let pod = Netns::new("dp-pod");
    let hv = "cali00000000012";
    let req = request(
        &pod,
        hv,
        &["10.65.0.13/32", "fd00:65::13/128"],
        &["0.0.0.0/0", "::/0"],
    );
    run(&host, &req).expect("networking the pod");
    assert!(host.has_link(hv) && pod.has_link("eth0"));

    cleanup(&host, pod.path()).expect("first clean up");
    assert!(!pod.has_link("eth0"));
    assert!(!host.has_link(hv));
    assert!(host.ip(&["route", "show", "10.65.0.13"]).trim().is_empty());
    assert!(host
        .ip(&["-6", "route", "show", "fd00:65::13"])
        .trim()
        .is_empty());

    cleanup(&host, pod.path()).expect("second clean up");
    cleanup(&host, "").expect("empty netns path");
    cleanup(&host, "/run/netns/dp-definitely-missing").expect("missing netns");
    let err = cleanup(&host, "/dev").expect_err("not a netns");
    assert!(
        err.to_string()
            .starts_with("failed to enter netns: unknown FS magic on \"/dev\": "),
        "{err}"
    );
}

#[test]
fn redo_after_clean_up() {
    // ADD, DEL, ADD again with the same names (a runtime retrying a sandbox).
    let host = HostNetns::new();
    let pod = Netns::new("dp-pod");
    let req = request(&pod, "cali00000000013", &["10.65.0.14/32"], &["0.0.0.0/0"]);
    run(&host, &req).unwrap();
    cleanup(&host, pod.path()).unwrap();
    run(&host, &req).unwrap();
    assert!(pod.has_link("eth0"));
}
