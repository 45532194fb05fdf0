//! The end-to-end scenarios that do not depend on how Calico stores its objects, written
//! once over [`Cluster`] and run on both datastores: `etcd::<scenario>` against a real etcd
//! ([`World`]), `kdd::<scenario>` against a real kube-apiserver with Calico's CRDs and the
//! plugin's upstream RBAC ([`RealKddWorld`], with `policy.type: k8s` as the Kubernetes
//! datastore requires). Every pod here is a Kubernetes
//! pod (K8S_POD_* args); the cni-orchestrator scenarios stay in calico_etcd.rs (etcd only,
//! as upstream), and so do the assertions on exact keys and JSON (calico_etcd.rs,
//! calico_kdd.rs, ipam_datastore.rs).

use std::time::{Duration, Instant};

use crate::common::cluster::{Allocation, Cluster, NODE_POD_CIDR_V4, NODE_POD_CIDR_V6};
use crate::common::cni::{run_plugin, with_prev_result, Invocation, Outcome, TempDir};
use crate::common::kdd::RealKddWorld;
use crate::common::netns::{ping_available, require_root};
use crate::common::world::{sysctl, World, NODE};
use crate::on_both_backends;
use serde_json::{json, Value};

on_both_backends!(
    add_and_del_with_calico_ipam,
    two_pods_ping_each_other,
    result_encoding_per_cni_version,
    second_add_renetworks_and_keeps_one_endpoint,
    del_is_idempotent,
    ip_arg_assigns_that_address,
    datastore_not_ready_fails_add_and_del,
    datastore_unreachable_fails_fast,
    host_local_ipam_delegation,
    host_local_use_pod_cidr,
    dual_stack_pod,
    no_pool_and_exhausted_pool,
    bad_input_is_refused_and_leaves_nothing,
    calico_ipam_as_a_separate_process,
    ipam_block_filled_to_the_last_address_and_emptied,
    ipam_repeated_del,
    ipam_deselected_empty_blocks_lose_their_affinity,
    ipam_requested_ip_in_a_tunnel_only_pool,
);

const DEFAULT_POOL: &str = "default-ipv4-ippool";

fn ip_of(result: &Value) -> String {
    let addr = result["ips"][0]["address"].as_str().expect("an address");
    addr.split('/').next().unwrap().to_string()
}

fn alloc(ip: &str, handle: &str) -> Allocation {
    Allocation {
        ip: ip.parse().unwrap(),
        handle: handle.into(),
    }
}

/// A k8s pod's ADD, with the pod made to exist where the backend needs it.
fn k8s_add(c: &impl Cluster, cid: &str, netns: &str, ns: &str, pod: &str) -> Invocation {
    c.prepare_pod(ns, pod);
    Invocation::new("ADD", cid, netns).k8s(ns, pod)
}

/// `inv` with `IP=<ip>` appended to its CNI_ARGS.
fn with_ip(inv: Invocation, ip: &str) -> Invocation {
    let args = format!("{};IP={ip}", inv.args);
    inv.with_args(&args)
}

/// A calico-ipam call as `calico` makes it (k8s args, IgnoreUnknown), with no netns. The
/// namespace exists on both backends (on the Kubernetes datastore calico-ipam reads it, for
/// pools' namespaceSelector).
fn ipam_inv(cmd: &str, cid: &str) -> Invocation {
    Invocation::new(cmd, cid, "/dev/null")
        .k8s("default", &format!("pod-{cid}"))
        .via_calico()
}

fn pool_spec(cidr: &str, block_size: u8) -> Value {
    json!({"cidr":cidr,"ipipMode":"Never","vxlanMode":"Never","natOutgoing":true,
        "blockSize":block_size,"nodeSelector":"all()"})
}

fn assert_bad(c: &impl Cluster, out: Outcome, code: u64) -> Value {
    let err = out.assert_err();
    assert_eq!(err["code"], code, "{err}");
    c.assert_clean();
    err
}

// ------------------------------------------------------------------------ calico

fn add_and_del_with_calico_ipam(c: &impl Cluster) {
    let pod = c.pod();
    let conf = c.conf(json!({"mtu": 1440}));
    let inv = k8s_add(c, "a1b2c3d4e5f6", pod.path(), "default", "nginx");
    let r = c.calico(&inv, &conf).assert_ok().json();
    // Result: 1.0.0 shape, /32 address on interface 1, the block's route.
    assert_eq!(r["cniVersion"], "1.0.0");
    assert_eq!(r["interfaces"][0], json!({"name": "calic440f455693"}));
    assert_eq!(r["interfaces"][1]["name"], "eth0");
    assert_eq!(r["interfaces"][1]["mtu"], 1440);
    assert_eq!(r["interfaces"][1]["sandbox"], pod.path());
    let mac = r["interfaces"][1]["mac"].as_str().unwrap().to_string();
    assert_eq!(mac.len(), 17);
    let ip = ip_of(&r);
    assert!(ip.starts_with("10.65."), "{r}");
    assert_eq!(r["ips"][0]["address"], format!("{ip}/32"));
    assert_eq!(r["ips"][0]["interface"], 1);
    assert!(r["ips"][0].get("gateway").is_none());
    assert!(r.get("dns").is_none());
    // The first ordinal of node1's first block; the route is the block.
    assert_eq!(r["routes"][0]["dst"], format!("{ip}/26"));

    // What is stored: the endpoint's address, one handle holding it, an affine block.
    assert_eq!(
        c.endpoint_ips("default", "nginx"),
        Some(vec![format!("{ip}/32")])
    );
    let handle = c.handle("a1b2c3d4e5f6");
    assert_eq!(c.handles(), vec![handle.clone()]);
    assert_eq!(c.allocated(), vec![alloc(&ip, &handle)]);
    let blocks = c.blocks();
    assert_eq!(blocks.len(), 1);
    assert_eq!(blocks[0]["cidr"], format!("{ip}/26"));
    assert_eq!(blocks[0]["affinity"], format!("host:{NODE}"));
    let owner = &blocks[0]["attributes"][0]["secondary"];
    assert_eq!(owner["node"], NODE, "{owner}");
    assert_eq!(owner["pod"], "nginx", "{owner}");
    assert_eq!(owner["namespace"], "default", "{owner}");
    let stamp = owner["timestamp"].as_str().unwrap_or_default();
    assert!(stamp.ends_with(" +0000 UTC"), "Go's time.String(): {owner}");
    assert_eq!(c.affinities(), vec![(NODE.to_string(), format!("{ip}/26"))]);

    // Dataplane: host side.
    let link = c.host_sh("ip -d link show calic440f455693");
    assert!(link.contains("ee:ee:ee:ee:ee:ee"), "{link}");
    assert!(
        link.contains("mtu 1440") && link.contains("state UP"),
        "{link}"
    );
    let routes = c.host_sh("ip route show");
    assert!(
        routes.contains(&format!("{ip} dev calic440f455693 scope link")),
        "{routes}"
    );
    for (path, want) in [
        (
            "/proc/sys/net/ipv4/conf/calic440f455693/route_localnet",
            "1",
        ),
        ("/proc/sys/net/ipv4/conf/calic440f455693/proxy_arp", "1"),
        ("/proc/sys/net/ipv4/neigh/calic440f455693/proxy_delay", "0"),
        ("/proc/sys/net/ipv4/conf/calic440f455693/forwarding", "1"),
        ("/proc/sys/net/ipv6/conf/calic440f455693/accept_ra", "0"),
    ] {
        assert_eq!(sysctl(c.host_name(), path), want, "{path}");
    }
    // Container side.
    let addr = pod.sh("ip -o addr show eth0");
    assert!(addr.contains(&format!("inet {ip}/32")), "{addr}");
    let croutes = pod.sh("ip route show");
    assert!(
        croutes.contains("default via 169.254.1.1 dev eth0"),
        "{croutes}"
    );
    assert!(
        croutes.contains("169.254.1.1 dev eth0 scope link"),
        "{croutes}"
    );
    assert_eq!(sysctl(pod.name(), "/proc/sys/net/ipv4/ip_forward"), "0");
    let clink = pod.sh("ip link show eth0");
    assert!(
        clink.contains(&mac) && clink.contains("mtu 1440"),
        "{clink}"
    );

    // DEL removes everything; the empty block stays affine to the host, as upstream.
    let del = inv.as_del();
    c.calico(&del, &conf).assert_ok();
    c.assert_clean();
    assert_eq!(c.endpoint_ips("default", "nginx"), None);
    assert_eq!(c.affinities(), vec![(NODE.to_string(), format!("{ip}/26"))]);
    assert_eq!(c.blocks().len(), 1, "affine block kept");
    assert!(!pod.has_link("eth0"));
    // DEL again: still success.
    c.calico(&del, &conf).assert_ok();
    c.assert_clean();
}

fn two_pods_ping_each_other(c: &impl Cluster) {
    let conf = c.conf(json!({}));
    let (a, b) = (c.pod(), c.pod());
    let add_a = k8s_add(c, "pinga", a.path(), "default", "pod-a");
    let add_b = k8s_add(c, "pingb", b.path(), "default", "pod-b");
    let ipa = ip_of(&c.calico(&add_a, &conf).assert_ok().json());
    let ipb = ip_of(&c.calico(&add_b, &conf).assert_ok().json());
    assert_ne!(ipa, ipb);
    if ping_available() {
        let ping = a.exec("ping", &["-c", "2", "-W", "2", "-i", "0.2", &ipb]);
        assert!(
            ping.status.success(),
            "{}: ping {ipa} -> {ipb}: {}",
            c.backend(),
            String::from_utf8_lossy(&ping.stdout)
        );
        let ping = b.exec("ping", &["-c", "1", "-W", "2", &ipa]);
        assert!(ping.status.success(), "ping {ipb} -> {ipa}");
    } else {
        eprintln!("ping skipped: no usable `ping` (Debian's iputils-ping) on this machine");
    }
    for inv in [add_a, add_b] {
        c.calico(&inv.as_del(), &conf).assert_ok();
    }
    c.assert_clean();
}

fn result_encoding_per_cni_version(c: &impl Cluster) {
    for (i, version) in ["0.2.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]
        .iter()
        .enumerate()
    {
        let pod = c.pod();
        let conf = c.conf(json!({"cniVersion": version}));
        let inv = k8s_add(
            c,
            &format!("ver{i}"),
            pod.path(),
            "default",
            &format!("ver{i}"),
        );
        let out = c.calico(&inv, &conf);
        let r = out.assert_ok().json();
        assert_eq!(r["cniVersion"], *version);
        match *version {
            "0.2.0" => {
                let ip = r["ip4"]["ip"].as_str().unwrap();
                assert!(ip.ends_with("/32"), "{r}");
                assert!(r.get("interfaces").is_none());
                assert_eq!(r["dns"], json!({}));
            }
            "0.3.1" | "0.4.0" => {
                assert_eq!(r["ips"][0]["version"], "4");
                assert_eq!(r["ips"][0]["interface"], 1);
                assert!(r["interfaces"][1].get("mtu").is_none());
                assert_eq!(r["dns"], json!({}));
                // Go's struct order: cniVersion, interfaces, ips, routes, dns.
                let keys: Vec<&str> = out
                    .stdout
                    .lines()
                    .filter(|l| l.starts_with("    \""))
                    .map(|l| l.trim())
                    .collect();
                assert!(
                    keys[0].starts_with("\"cniVersion\"")
                        && keys.last().unwrap().starts_with("\"dns\""),
                    "{keys:?}"
                );
            }
            _ => {
                assert!(r.get("dns").is_none());
                assert!(r["ips"][0].get("version").is_none());
                assert!(
                    out.stdout.starts_with("{\n    \"cniVersion\""),
                    "{}",
                    out.stdout
                );
            }
        }
        c.calico(&inv.as_del(), &conf).assert_ok();
    }
    c.assert_clean();
}

fn second_add_renetworks_and_keeps_one_endpoint(c: &impl Cluster) {
    let pod = c.pod();
    let conf = c.conf(json!({}));
    let first = k8s_add(c, "cid-x", pod.path(), "ns1", "web");
    let ip1 = ip_of(&c.calico(&first, &conf).assert_ok().json());
    // A new sandbox for the same pod, same netns here (the old interface is replaced).
    let second = Invocation::new("ADD", "cid-y", pod.path()).k8s("ns1", "web");
    let r2 = c.calico(&second, &conf).assert_ok().json();
    let ip2 = ip_of(&r2);
    assert_ne!(ip1, ip2, "re-allocated under the new handle");
    assert_eq!(
        c.endpoint_ips("ns1", "web"),
        Some(vec![format!("{ip2}/32")])
    );
    assert_eq!(
        c.endpoint_container_id("ns1", "web").as_deref(),
        Some("cid-y")
    );
    assert_eq!(c.handles(), vec![c.handle("cid-x"), c.handle("cid-y")]);
    let links = c.host_sh("ip -o link show");
    assert_eq!(links.matches("cali").count(), 1, "one host veth: {links}");
    // The stale sandbox's DEL keeps the endpoint (another container's) but frees its own IP.
    let del_x = Invocation {
        command: "DEL".into(),
        netns: String::new(),
        ..first.clone()
    };
    c.calico(&del_x, &conf).assert_ok();
    assert_eq!(
        c.endpoint_ips("ns1", "web"),
        Some(vec![format!("{ip2}/32")])
    );
    assert_eq!(
        c.endpoint_container_id("ns1", "web").as_deref(),
        Some("cid-y")
    );
    assert_eq!(c.handles(), vec![c.handle("cid-y")]);
    assert_eq!(c.allocated(), vec![alloc(&ip2, &c.handle("cid-y"))]);
    c.calico(&second.as_del(), &conf).assert_ok();
    c.assert_clean();
}

fn del_is_idempotent(c: &impl Cluster) {
    let conf = c.conf(json!({}));
    let pod = c.pod();
    // Never added: the pod exists; then a pod the cluster does not know.
    c.prepare_pod("default", "p");
    let never = Invocation::new("DEL", "never", pod.path()).k8s("default", "p");
    c.calico(&never, &conf).assert_ok();
    let ghost = Invocation::new("DEL", "never", pod.path()).k8s("default", "ghost");
    c.calico(&ghost, &conf).assert_ok();
    // A netns that does not exist, and none at all.
    let mut gone = never.clone();
    gone.netns = "/not/a/real/path1234567890".into();
    c.calico(&gone, &conf).assert_ok();
    gone.netns = String::new();
    c.calico(&gone, &conf).assert_ok();
    // calico-ipam DEL with nothing allocated.
    c.ipam(&ipam_inv("DEL", "nothing"), &conf).assert_ok();
    // Added, then DELed twice.
    let add = k8s_add(c, "twice", pod.path(), "default", "p");
    c.calico(&add, &conf).assert_ok();
    c.calico(&add.as_del(), &conf).assert_ok();
    c.calico(&add.as_del(), &conf).assert_ok();
    c.assert_clean();
}

fn ip_arg_assigns_that_address(c: &impl Cluster) {
    let conf = c.conf(json!({}));
    let pod = c.pod();
    let inv = with_ip(
        k8s_add(c, "fixed1", pod.path(), "default", "fixed-a"),
        "10.65.7.7",
    );
    let r = c.calico(&inv, &conf).assert_ok().json();
    assert_eq!(r["ips"][0]["address"], "10.65.7.7/32");
    assert_eq!(
        c.endpoint_ips("default", "fixed-a"),
        Some(vec!["10.65.7.7/32".to_string()])
    );
    assert_eq!(c.allocated(), vec![alloc("10.65.7.7", &c.handle("fixed1"))]);
    let cidrs: Vec<Value> = c.blocks().iter().map(|b| b["cidr"].clone()).collect();
    assert_eq!(cidrs, vec![json!("10.65.7.0/26")]);
    // The same address again for another pod: upstream's error, nothing kept.
    let pod2 = c.pod();
    let again = with_ip(
        k8s_add(c, "fixed2", pod2.path(), "default", "fixed-b"),
        "10.65.7.7",
    );
    let err = c.calico(&again, &conf).assert_err();
    assert_eq!(
        err["msg"],
        "resource already exists: 10.65.7.7 with error: Address already assigned in block"
    );
    assert_eq!(c.handles(), vec![c.handle("fixed1")]);
    assert_eq!(c.endpoint_ips("default", "fixed-b"), None);
    assert!(!pod2.has_link("eth0"));
    // Outside every pool.
    let err = c
        .ipam(&with_ip(ipam_inv("ADD", "fixed3"), "192.168.9.9"), &conf)
        .assert_err();
    assert_eq!(
        err["msg"],
        "The provided IP address is not in a configured pool\n"
    );
    c.calico(&inv.as_del(), &conf).assert_ok();
    c.calico(&again.as_del(), &conf).assert_ok();
    c.assert_clean();
}

fn datastore_not_ready_fails_add_and_del(c: &impl Cluster) {
    c.set_ready(false);
    let conf = c.conf(json!({}));
    let pod = c.pod();
    let inv = k8s_add(c, "nr1", pod.path(), "default", "nr");
    let err = c.calico(&inv, &conf).assert_err();
    assert_eq!(err["code"], 999);
    assert_eq!(
        err["msg"],
        "Calico is currently not ready to process requests"
    );
    c.assert_clean();
    let err = c.calico(&inv.as_del(), &conf).assert_err();
    assert_eq!(
        err["msg"],
        "Calico is currently not ready to process requests"
    );
    // Ready again: the pod can be networked.
    c.set_ready(true);
    c.calico(&inv, &conf).assert_ok();
    c.calico(&inv.as_del(), &conf).assert_ok();
    c.assert_clean();
}

fn datastore_unreachable_fails_fast(c: &impl Cluster) {
    let conf = c.unreachable_conf();
    let pod = c.pod();
    let inv = k8s_add(c, "down1", pod.path(), "default", "down");
    let start = Instant::now();
    let err = c.calico(&inv, &conf).assert_err();
    eprintln!(
        "{}: unreachable datastore, ADD failed after {:?}: {err}",
        c.backend(),
        start.elapsed()
    );
    assert!(
        start.elapsed() < Duration::from_secs(15),
        "{}: took {:?}",
        c.backend(),
        start.elapsed()
    );
    assert_eq!(err["code"], 999, "{err}");
    assert!(!pod.has_link("eth0"));
    c.assert_clean();
}

fn host_local_ipam_delegation(c: &impl Cluster) {
    let data = c.scratch().join("host-local");
    let conf = c.conf(
        json!({"ipam": {"type": "host-local", "subnet": "10.66.0.0/24",
        "dataDir": data.display().to_string()}}),
    );
    let pod = c.pod();
    let inv = k8s_add(c, "hl1", pod.path(), "default", "hlpod");
    let r = c.calico(&inv, &conf).assert_ok().json();
    let ip = ip_of(&r);
    assert!(ip.starts_with("10.66.0."), "{r}");
    assert_eq!(r["ips"][0]["address"], format!("{ip}/32"));
    assert!(r["ips"][0].get("gateway").is_none());
    assert_eq!(
        c.endpoint_ips("default", "hlpod"),
        Some(vec![format!("{ip}/32")])
    );
    assert!(c.handles().is_empty(), "calico IPAM untouched");
    assert!(c.blocks().is_empty(), "calico IPAM untouched");
    assert!(data.join(c.network()).join(&ip).exists());
    let routes = c.host_sh("ip route");
    assert!(routes.contains(&format!("{ip} dev cali")), "{routes}");
    c.calico(&inv.as_del(), &conf).assert_ok();
    assert!(
        !data.join(c.network()).join(&ip).exists(),
        "host-local released the address"
    );
    c.assert_clean();
}

/// host-local with `usePodCidr` / `usePodCidrIPv6`: the ranges come from the core Node's
/// podCIDRs (through the Kubernetes datastore's own client on KDD; through a kubeconfig on
/// etcd); DEL gives the addresses back.
fn host_local_use_pod_cidr(c: &impl Cluster) {
    let (mut extra, _api) = c.node_api();
    let data = c.scratch().join("host-local");
    let net = data.join(c.network());

    // `subnet: usePodCidr`: the IPv4 pod CIDR.
    extra["ipam"] = json!({"type": "host-local", "dataDir": data.display().to_string(),
        "subnet": "usePodCidr"});
    let conf = c.conf(extra.clone());
    let pod = c.pod();
    let inv = k8s_add(c, "podcidr0", pod.path(), "default", "podcidr-v4");
    let r = c.calico(&inv, &conf).assert_ok().json();
    assert_eq!(r["ips"].as_array().unwrap().len(), 1, "{r}");
    let v4 = ip_of(&r);
    assert!(v4.starts_with("10.244.1."), "{r}");
    assert_eq!(r["ips"][0]["address"], format!("{v4}/32"));
    assert_eq!(
        c.endpoint_ips("default", "podcidr-v4"),
        Some(vec![format!("{v4}/32")])
    );
    assert!(net.join(&v4).exists());
    c.calico(&inv.as_del(), &conf).assert_ok();
    assert!(!net.join(&v4).exists(), "host-local released the address");
    c.assert_clean();
    drop(pod);

    // `ranges` with both: one address of each family.
    extra["ipam"] = json!({"type": "host-local", "dataDir": data.display().to_string(),
        "ranges": [[{"subnet": "usePodCidr"}], [{"subnet": "usePodCidrIPv6"}]]});
    let conf = c.conf(extra);
    let pod = c.pod();
    let inv = k8s_add(c, "podcidr1", pod.path(), "default", "podcidr");
    let r = c.calico(&inv, &conf).assert_ok().json();
    let ips: Vec<&str> = r["ips"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["address"].as_str().unwrap())
        .collect();
    assert_eq!(ips.len(), 2, "{r}");
    let v4 = ips[0].trim_end_matches("/32");
    let v6 = ips[1].trim_end_matches("/128");
    assert!(
        ips[0].ends_with("/32") && v4.starts_with(NODE_POD_CIDR_V4.trim_end_matches("0/24")),
        "{r}"
    );
    assert!(
        ips[1].ends_with("/128") && v6.starts_with(NODE_POD_CIDR_V6.trim_end_matches(":/64")),
        "{r}"
    );
    assert_eq!(
        c.endpoint_ips("default", "podcidr"),
        Some(ips.iter().map(|s| s.to_string()).collect())
    );
    assert!(c.handles().is_empty(), "calico IPAM untouched");
    assert!(net.join(v4).exists() && net.join(v6).exists());
    assert!(c.host_sh("ip route").contains(&format!("{v4} dev cali")));
    assert!(c.host_sh("ip -6 route").contains(&format!("{v6} dev cali")));
    assert!(pod
        .sh("ip -o addr show eth0")
        .contains(&format!("inet {v4}/32")));
    c.calico(&inv.as_del(), &conf).assert_ok();
    assert!(
        !net.join(v4).exists() && !net.join(v6).exists(),
        "host-local released both addresses"
    );
    c.assert_clean();
}

fn dual_stack_pod(c: &impl Cluster) {
    c.seed_pool(
        "default-ipv6-ippool",
        pool_spec("fd80:24e2:f998:72d6::/64", 122),
    );
    let conf = c.conf(json!({"ipam": {"assign_ipv6": "true"}}));
    let pod = c.pod();
    let inv = k8s_add(c, "ds1", pod.path(), "default", "dual");
    let r = c.calico(&inv, &conf).assert_ok().json();
    let ips = r["ips"].as_array().unwrap();
    assert_eq!(ips.len(), 2, "{r}");
    let v4 = ips[0]["address"].as_str().unwrap().to_string();
    let v6 = ips[1]["address"].as_str().unwrap().to_string();
    assert!(v4.ends_with("/32"), "{v4}");
    assert!(
        v6.starts_with("fd80:24e2:f998:72d6:") && v6.ends_with("/128"),
        "{v6}"
    );
    assert!(r["routes"][1]["dst"].as_str().unwrap().ends_with("/122"));
    // One handle holding both addresses; one block per family, both affine to the node.
    let handle = c.handle("ds1");
    assert_eq!(c.handles(), vec![handle.clone()]);
    let mut want = vec![
        alloc(v4.trim_end_matches("/32"), &handle),
        alloc(v6.trim_end_matches("/128"), &handle),
    ];
    want.sort();
    assert_eq!(c.allocated(), want);
    let affs = c.affinities();
    assert_eq!(affs.len(), 2, "{affs:?}");
    assert!(
        affs.iter().any(|(_, cidr)| cidr.ends_with("/122")),
        "{affs:?}"
    );
    assert_eq!(
        c.endpoint_ips("default", "dual"),
        Some(vec![v4.clone(), v6.clone()])
    );
    // CHECK agrees (both families: addresses, routes via 169.254.1.1 and via the host
    // end's link-local, both host routes, the IPv6 sysctls).
    let check = with_prev_result(&conf, &r);
    assert_eq!(c.calico(&inv.as_check(), &check).assert_ok().stdout, "");
    // Container: v6 default route via the host end's link-local, DAD off, nothing tentative.
    let routes = pod.sh("ip -6 route show");
    assert!(
        routes.contains("default via fe80::ecee:eeff:feee:eeee dev eth0"),
        "{routes}"
    );
    let addrs = pod.sh("ip -6 addr show dev eth0");
    assert!(!addrs.contains("tentative"), "{addrs}");
    assert_eq!(
        sysctl(pod.name(), "/proc/sys/net/ipv6/conf/eth0/accept_dad"),
        "0"
    );
    assert_eq!(
        sysctl(pod.name(), "/proc/sys/net/ipv6/conf/all/forwarding"),
        "0"
    );
    // Host: /128 route, v6 sysctls, the link-local the pod routes via.
    let veth = r["interfaces"][0]["name"].as_str().unwrap().to_string();
    let host_routes = c.host_sh("ip -6 route show");
    assert!(
        host_routes.contains(&format!("{} dev {veth}", v6.trim_end_matches("/128"))),
        "{host_routes}"
    );
    for (path, want) in [
        (format!("/proc/sys/net/ipv6/conf/{veth}/proxy_ndp"), "1"),
        (format!("/proc/sys/net/ipv6/conf/{veth}/forwarding"), "1"),
        (format!("/proc/sys/net/ipv6/conf/{veth}/accept_dad"), "0"),
        (format!("/proc/sys/net/ipv6/conf/{veth}/disable_ipv6"), "0"),
    ] {
        assert_eq!(sysctl(c.host_name(), &path), want, "{path}");
    }
    assert!(c
        .host_sh(&format!("ip -6 addr show dev {veth}"))
        .contains("fe80::ecee:eeff:feee:eeee"));
    c.calico(&inv.as_del(), &conf).assert_ok();
    c.assert_clean();
}

fn no_pool_and_exhausted_pool(c: &impl Cluster) {
    c.remove_pool(DEFAULT_POOL);
    let conf = c.conf(json!({}));
    let pod = c.pod();
    let inv = k8s_add(c, "np1", pod.path(), "default", "nopool");
    let err = assert_bad(c, c.calico(&inv, &conf), 999);
    assert!(
        err["msg"]
            .as_str()
            .unwrap()
            .contains("cannot find a qualified ippool"),
        "{err}"
    );
    // A /30 pool with /30 blocks: four addresses, then a clear error.
    c.seed_pool("tiny", pool_spec("10.65.9.0/30", 30));
    let mut added = Vec::new();
    for i in 0..4 {
        let p = c.pod();
        let inv = k8s_add(c, &format!("ex{i}"), p.path(), "default", &format!("ex{i}"));
        c.calico(&inv, &conf).assert_ok();
        added.push((inv, p));
    }
    let p = c.pod();
    let inv = k8s_add(c, "ex4", p.path(), "default", "ex4");
    let err = c.calico(&inv, &conf).assert_err();
    assert!(
        err["msg"]
            .as_str()
            .unwrap()
            .contains("Assigned 0 out of 1 requested IPv4 addresses"),
        "{err}"
    );
    assert!(!c.handles().contains(&c.handle("ex4")));
    assert_eq!(c.allocated().len(), 4);
    assert_eq!(c.endpoint_ips("default", "ex4"), None);
    assert!(!p.has_link("eth0"));
    for (inv, _p) in &added {
        c.calico(&inv.as_del(), &conf).assert_ok();
    }
    c.assert_clean();
}

fn bad_input_is_refused_and_leaves_nothing(c: &impl Cluster) {
    let conf = c.conf(json!({}));
    let pod = c.pod();
    let ok = k8s_add(c, "bad1", pod.path(), "default", "badpod");

    assert_bad(c, c.calico(&ok, "{not json"), 6);
    // No CNI_COMMAND at all: libcni's about text on stderr, exit 0, nothing done.
    let mut bare = ok.clone();
    bare.unset.push("CNI_COMMAND".into());
    let out = c.calico(&bare, &conf);
    assert_eq!((out.code, out.stdout.as_str()), (0, ""));
    assert!(
        out.stderr.starts_with("Calico CNI plugin"),
        "{}",
        out.stderr
    );
    c.assert_clean();
    for var in ["CNI_CONTAINERID", "CNI_IFNAME", "CNI_PATH", "CNI_NETNS"] {
        let mut inv = ok.clone();
        inv.unset.push(var.into());
        let err = assert_bad(c, c.calico(&inv, &conf), 4);
        assert!(err["msg"].as_str().unwrap().contains(var), "{err}");
    }
    let err = assert_bad(c, c.calico(&ok, &c.conf(json!({"cniVersion": "9.9.9"}))), 1);
    assert_eq!(err["msg"], "incompatible CNI versions");
    let err = assert_bad(
        c,
        c.calico(&ok.clone().ifname("way-too-long-ifname0"), &conf),
        4,
    );
    assert_eq!(err["msg"], "interface name is too long");
    assert_bad(c, c.calico(&ok.clone().ifname("a/b"), &conf), 4);
    // A netns that does not exist: the addresses are given back.
    let mut gone = ok.clone();
    gone.netns = "/var/run/netns/does-not-exist-xyz".into();
    assert_bad(c, c.calico(&gone, &conf), 999);
    assert_eq!(c.endpoint_ips("default", "badpod"), None);
}

/// When `calico-ipam` in CNI_PATH is not this very binary (here: a copy), it is exec'd as a
/// separate process as libcni would; its result and its errors come back through stdout.
fn calico_ipam_as_a_separate_process(c: &impl Cluster) {
    let dir = TempDir::new("sep-bin");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_calico"), dir.path().join("calico")).unwrap();
    std::fs::copy(env!("CARGO_BIN_EXE_calico"), dir.path().join("calico-ipam")).unwrap();
    let path = dir.path().display().to_string();
    let run = |inv: &Invocation, conf: &str| {
        run_plugin(
            &dir.path().join("calico"),
            &path,
            Some(c.host_name()),
            inv,
            conf,
        )
    };
    let conf = c.conf(json!({"cniVersion": "0.3.1"}));
    let pod = c.pod();
    let inv = k8s_add(c, "sep1", pod.path(), "default", "sep");
    let r = run(&inv, &conf).assert_ok().json();
    assert_eq!(r["cniVersion"], "0.3.1");
    assert!(r["ips"][0]["address"].as_str().unwrap().ends_with("/32"));
    assert_eq!(c.handles(), vec![c.handle("sep1")]);
    // An IPAM error (address outside every pool) arrives as the child printed it.
    let pod2 = c.pod();
    let bad = with_ip(
        k8s_add(c, "sep2", pod2.path(), "default", "sep-bad"),
        "192.0.2.77",
    );
    let err = run(&bad, &conf).assert_err();
    assert_eq!(err["code"], 999);
    assert_eq!(
        err["msg"],
        "The provided IP address is not in a configured pool\n"
    );
    run(&inv.as_del(), &conf).assert_ok();
    run(&bad.as_del(), &conf).assert_ok();
    c.assert_clean();
}

// -------------------------------------------------------------------- calico-ipam

/// A pool that is exactly one /29 block, and nothing else.
fn one_block_pool(c: &impl Cluster) {
    c.remove_pool(DEFAULT_POOL);
    c.seed_pool("p29", pool_spec("10.80.0.0/29", 29));
}

fn ipam_block_filled_to_the_last_address_and_emptied(c: &impl Cluster) {
    one_block_pool(c);
    let conf = c.conf(json!({}));
    for i in 0..8 {
        let cid = format!("c{i}");
        let r = c.ipam(&ipam_inv("ADD", &cid), &conf).assert_ok().json();
        assert_eq!(r["ips"][0]["address"], format!("10.80.0.{i}/29"));
        assert_eq!(r["routes"][0]["dst"], format!("10.80.0.{i}/29"));
    }
    let want: Vec<Allocation> = (0..8)
        .map(|i| alloc(&format!("10.80.0.{i}"), &c.handle(&format!("c{i}"))))
        .collect();
    assert_eq!(c.allocated(), want);
    let b = &c.blocks()[0];
    assert_eq!(b["cidr"], "10.80.0.0/29");
    assert_eq!(b["affinity"], format!("host:{NODE}"));
    assert_eq!(b["allocations"], json!([0, 1, 2, 3, 4, 5, 6, 7]));
    assert_eq!(b["unallocated"], json!([]));
    // Full: the next ADD fails with upstream's message and leaves nothing.
    let err = c.ipam(&ipam_inv("ADD", "c8"), &conf).assert_err();
    assert_eq!(
        err["msg"],
        "failed to request IPv4 addresses: Assigned 0 out of 1 requested IPv4 addresses; No IPs available in pools: [10.80.0.0/29]"
    );
    assert!(!c.handles().contains(&c.handle("c8")));

    // Release out of order: freed ordinals go to the tail, attributes are compacted.
    c.ipam(&ipam_inv("DEL", "c5"), &conf).assert_ok();
    c.ipam(&ipam_inv("DEL", "c2"), &conf).assert_ok();
    let b = &c.blocks()[0];
    assert_eq!(b["allocations"], json!([0, 1, null, 2, 3, null, 4, 5]));
    assert_eq!(b["unallocated"], json!([5, 2]));
    let handles: Vec<&str> = b["attributes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["handle_id"].as_str().unwrap())
        .collect();
    let want: Vec<String> = ["c0", "c1", "c3", "c4", "c6", "c7"]
        .iter()
        .map(|cid| c.handle(cid))
        .collect();
    assert_eq!(handles, want);
    assert!(!c.handles().contains(&c.handle("c5")));
    // The head of the free list is reused first.
    let r = c.ipam(&ipam_inv("ADD", "c9"), &conf).assert_ok().json();
    assert_eq!(r["ips"][0]["address"], "10.80.0.5/29");
    for cid in ["c0", "c1", "c3", "c4", "c6", "c7", "c9", "c2"] {
        c.ipam(&ipam_inv("DEL", cid), &conf).assert_ok();
    }
    let b = &c.blocks()[0];
    assert_eq!(
        b["allocations"],
        json!([null, null, null, null, null, null, null, null])
    );
    assert_eq!(b["attributes"], json!([]));
    assert_eq!(b["unallocated"].as_array().unwrap().len(), 8);
    // The empty block stays affine to the host (upstream frees it later, via GC or reclaim).
    assert_eq!(b["affinity"], format!("host:{NODE}"));
    assert_eq!(
        c.affinities(),
        vec![(NODE.to_string(), "10.80.0.0/29".to_string())]
    );
    c.assert_clean();
}

fn ipam_repeated_del(c: &impl Cluster) {
    let conf = c.conf(json!({}));
    c.ipam(&ipam_inv("ADD", "x1"), &conf).assert_ok();
    assert_eq!(c.handles(), vec![c.handle("x1")]);
    // DEL also releases the pre-v3 handle <ns>.<pod>; a second DEL is a no-op success.
    c.ipam(&ipam_inv("DEL", "x1"), &conf).assert_ok();
    c.ipam(&ipam_inv("DEL", "x1"), &conf).assert_ok();
    assert!(c.handles().is_empty());
    assert!(c.allocated().is_empty());
    c.assert_clean();
}

/// Empty affine blocks of pools that stop selecting the node are given up: on the next ADD
/// (getAffineBlocks) and when a release empties them (ensureConsistentAffinity).
fn ipam_deselected_empty_blocks_lose_their_affinity(c: &impl Cluster) {
    one_block_pool(c);
    let conf = c.conf(json!({}));
    let pool = |name: &str, cidr: &str, selector: &str| {
        let mut spec = pool_spec(cidr, 29);
        spec["nodeSelector"] = json!(selector);
        c.seed_pool(name, spec);
    };
    let p29 = (NODE.to_string(), "10.80.0.0/29".to_string());
    let q29 = (NODE.to_string(), "10.81.0.0/29".to_string());
    c.ipam(&ipam_inv("ADD", "d1"), &conf).assert_ok();
    c.ipam(&ipam_inv("DEL", "d1"), &conf).assert_ok();
    assert_eq!(
        c.affinities(),
        vec![p29.clone()],
        "an empty block stays affine"
    );
    // The pool now selects other nodes only; a second pool takes over.
    pool("p29", "10.80.0.0/29", "zone == 'x'");
    pool("q29", "10.81.0.0/29", "all()");
    let r = c.ipam(&ipam_inv("ADD", "d2"), &conf).assert_ok().json();
    assert_eq!(r["ips"][0]["address"], "10.81.0.0/29");
    assert_eq!(
        c.affinities(),
        vec![q29.clone()],
        "deselected affinity released"
    );
    let cidrs: Vec<Value> = c.blocks().iter().map(|b| b["cidr"].clone()).collect();
    assert_eq!(
        cidrs,
        vec![json!("10.81.0.0/29")],
        "the empty block went with it"
    );
    // ensureConsistentAffinity: deselect q29 while d2 holds an address, then release it.
    pool("q29", "10.81.0.0/29", "zone == 'x'");
    c.ipam(&ipam_inv("DEL", "d2"), &conf).assert_ok();
    assert!(c.affinities().is_empty());
    assert!(c.blocks().is_empty());
    // A selector that still matches keeps the affinity.
    pool("q29", "10.81.0.0/29", "all()");
    c.ipam(&ipam_inv("ADD", "d3"), &conf).assert_ok();
    c.ipam(&ipam_inv("DEL", "d3"), &conf).assert_ok();
    assert_eq!(c.affinities(), vec![q29]);
    c.assert_clean();
}

/// IP= in a pool that does not allow workloads: allowed in v3.32.1 (parity item 15).
fn ipam_requested_ip_in_a_tunnel_only_pool(c: &impl Cluster) {
    c.seed_pool(
        "tunnels",
        json!({"cidr":"10.123.0.0/24","allowedUses":["Tunnel"],"ipipMode":"Never","vxlanMode":"Never"}),
    );
    let conf = c.conf(json!({}));
    let inv = with_ip(ipam_inv("ADD", "t1"), "10.123.0.5");
    let r = c.ipam(&inv, &conf).assert_ok().json();
    assert_eq!(r["ips"][0]["address"], "10.123.0.5/32");
    assert_eq!(r["routes"][0]["dst"], "10.123.0.5/32");
    assert_eq!(c.allocated(), vec![alloc("10.123.0.5", &c.handle("t1"))]);
    let cidrs: Vec<Value> = c.blocks().iter().map(|b| b["cidr"].clone()).collect();
    assert_eq!(cidrs, vec![json!("10.123.0.0/26")]);
    c.ipam(&inv.as_del(), &conf).assert_ok();
    assert!(c.handles().is_empty());
    c.assert_clean();
}
