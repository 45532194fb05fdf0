//! End to end on etcd v3: the real binary as kubelet runs it, in test-made network
//! namespaces, against a real etcd; asserting the exact keys and JSON written, the veth,
//! addresses, routes and sysctls, and that failures leave nothing behind.

mod common;

use common::cni::Invocation;
use common::world::{sysctl, World, NODE, WEP_PREFIX};
use serde_json::{json, Value};

fn ip_of(result: &Value) -> String {
    let addr = result["ips"][0]["address"].as_str().expect("an address");
    addr.split('/').next().unwrap().to_string()
}

fn assert_clean(w: &World) {
    w.assert_clean();
}

#[test]
fn k8s_add_and_del_with_calico_ipam() {
    let w = World::new();
    let pod = w.pod();
    let conf = w.conf(json!({"mtu": 1440}));
    let inv = Invocation::new("ADD", "a1b2c3d4e5f6", pod.path()).k8s("default", "nginx");
    let out = w.calico(&inv, &conf);
    out.assert_ok();
    let r = out.json();
    // Result: 1.0.0 shape, sorted keys, /32 address on interface 1, block route.
    assert_eq!(r["cniVersion"], "1.0.0");
    assert_eq!(r["interfaces"][0], json!({"name": "calic440f455693"}));
    assert_eq!(r["interfaces"][1]["name"], "eth0");
    assert_eq!(r["interfaces"][1]["mtu"], 1440);
    assert_eq!(r["interfaces"][1]["sandbox"], pod.path());
    let mac = r["interfaces"][1]["mac"].as_str().unwrap().to_string();
    assert_eq!(mac.len(), 17);
    let ip = ip_of(&r);
    assert_eq!(r["ips"][0]["address"], format!("{ip}/32"));
    assert_eq!(r["ips"][0]["interface"], 1);
    assert!(r["ips"][0].get("gateway").is_none());
    // node1's first block in 10.65.0.0/16 by upstream's random walk; the first ordinal.
    assert_eq!(r["routes"][0]["dst"], format!("{ip}/26"));
    assert!(r.get("dns").is_none());

    // The WorkloadEndpoint, exactly.
    let key = format!("{WEP_PREFIX}default/node1-k8s-nginx-eth0");
    let wep = w.get(&key);
    assert_eq!(wep["kind"], "WorkloadEndpoint");
    assert_eq!(wep["apiVersion"], "projectcalico.org/v3");
    assert_eq!(wep["metadata"]["name"], "node1-k8s-nginx-eth0");
    assert_eq!(wep["metadata"]["namespace"], "default");
    assert!(wep["metadata"].get("resourceVersion").is_none());
    assert_eq!(wep["metadata"]["uid"].as_str().unwrap().len(), 36);
    assert!(wep["metadata"]["creationTimestamp"]
        .as_str()
        .unwrap()
        .ends_with('Z'));
    assert_eq!(
        wep["metadata"]["labels"],
        json!({"projectcalico.org/namespace":"default","projectcalico.org/orchestrator":"k8s"})
    );
    assert_eq!(
        wep["spec"],
        json!({"orchestrator":"k8s","node":NODE,"containerID":"a1b2c3d4e5f6","pod":"nginx","endpoint":"eth0",
            "ipNetworks":[format!("{ip}/32")],"profiles":["net1"],"interfaceName":"calic440f455693","mac":mac})
    );
    // IPAM objects.
    let handle = w.get("/calico/ipam/v2/handle/net1.a1b2c3d4e5f6");
    let block_cidr = handle["block"]
        .as_object()
        .unwrap()
        .keys()
        .next()
        .unwrap()
        .clone();
    assert_eq!(handle["block"][&block_cidr], 1);
    assert_eq!(handle["deleted"], false);
    let block_key = format!(
        "/calico/ipam/v2/assignment/ipv4/block/{}",
        block_cidr.replace('/', "-")
    );
    let block = w.get(&block_key);
    assert_eq!(block["affinity"], format!("host:{NODE}"));
    assert_eq!(block["attributes"][0]["handle_id"], "net1.a1b2c3d4e5f6");
    let sec = &block["attributes"][0]["secondary"];
    assert_eq!(sec["node"], NODE);
    assert_eq!(sec["pod"], "nginx");
    assert_eq!(sec["namespace"], "default");
    assert!(sec["timestamp"].as_str().unwrap().ends_with(" +0000 UTC"));
    assert_eq!(
        w.get(&format!(
            "/calico/ipam/v2/host/{NODE}/ipv4/block/{}",
            block_cidr.replace('/', "-")
        )),
        json!({"state":"confirmed","deleted":false})
    );
    // Profile created (policy.type empty, k8s rules).
    assert_eq!(
        w.get("/calico/resources/v3/projectcalico.org/profiles/net1")["spec"],
        json!({"ingress":[{"action":"Allow"}],"egress":[{"action":"Allow"}],"labelsToApply":{"net1":""}})
    );

    // Dataplane: host side.
    let link = w.host_sh("ip -d link show calic440f455693");
    assert!(link.contains("ee:ee:ee:ee:ee:ee"), "{link}");
    assert!(
        link.contains("mtu 1440") && link.contains("state UP"),
        "{link}"
    );
    let routes = w.host_sh("ip route show");
    assert!(
        routes.contains(&format!("{ip} dev calic440f455693 scope link")),
        "{routes}"
    );
    let h = w.host.name();
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
        assert_eq!(sysctl(h, path), want, "{path}");
    }
    // Container side.
    let addr = pod.exec("ip", &["-o", "addr", "show", "eth0"]);
    let addr = String::from_utf8_lossy(&addr.stdout);
    assert!(addr.contains(&format!("inet {ip}/32")), "{addr}");
    let croutes = String::from_utf8_lossy(&pod.exec("ip", &["route", "show"]).stdout).to_string();
    assert!(
        croutes.contains("default via 169.254.1.1 dev eth0"),
        "{croutes}"
    );
    assert!(
        croutes.contains("169.254.1.1 dev eth0 scope link"),
        "{croutes}"
    );
    assert_eq!(sysctl(pod.name(), "/proc/sys/net/ipv4/ip_forward"), "0");
    let clink =
        String::from_utf8_lossy(&pod.exec("ip", &["link", "show", "eth0"]).stdout).to_string();
    assert!(
        clink.contains(&mac) && clink.contains("mtu 1440"),
        "{clink}"
    );

    // DEL removes everything; the empty block stays affine to the host, as upstream.
    let del = inv.as_del();
    w.calico(&del, &conf).assert_ok();
    assert_clean(&w);
    assert!(w.keys(&block_key).len() == 1, "affine block kept");
    let eth0 = pod.exec("ip", &["link", "show", "eth0"]);
    assert!(!eth0.status.success());
    // DEL again: still success.
    w.calico(&del, &conf).assert_ok();
}

#[test]
fn cni_mode_add_del_profile_and_second_add() {
    let w = World::new();
    let pod = w.pod();
    let conf = w.conf(json!({}));
    let inv = Invocation::new("ADD", "abc123", pod.path());
    let out = w.calico(&inv, &conf);
    out.assert_ok();
    let r = out.json();
    let ip = ip_of(&r);
    assert_eq!(r["interfaces"][0]["name"], "caliabc123");
    let wep = w.get(&format!("{WEP_PREFIX}default/node1-cni-abc123-eth0"));
    assert_eq!(
        wep["spec"],
        json!({"orchestrator":"cni","node":NODE,"containerID":"abc123","endpoint":"eth0",
            "ipNetworks":[format!("{ip}/32")],"profiles":["net1"],"interfaceName":"caliabc123",
            "mac": r["interfaces"][1]["mac"]})
    );
    assert_eq!(
        wep["metadata"]["labels"],
        json!({"projectcalico.org/namespace":"default","projectcalico.org/orchestrator":"cni"})
    );
    assert_eq!(
        w.get("/calico/resources/v3/projectcalico.org/profiles/net1")["spec"],
        json!({"ingress":[{"action":"Allow","source":{"selector":"has(net1)"}}],"egress":[{"action":"Allow"}],"labelsToApply":{"net1":""}})
    );
    assert_eq!(
        w.get("/calico/ipam/v2/handle/net1.abc123")["block"]
            .as_object()
            .unwrap()
            .len(),
        1
    );

    // Second ADD, same container: same addresses and interfaces, no routes, no new IP.
    let again = w.calico(&inv, &conf);
    again.assert_ok();
    let r2 = again.json();
    assert_eq!(r2["ips"], r["ips"]);
    assert_eq!(r2["interfaces"], r["interfaces"]);
    assert!(r2.get("routes").is_none());
    // Same container on a second network: profile appended.
    let conf2 = w.conf(json!({"name": "net2"}));
    w.calico(&inv, &conf2).assert_ok();
    let wep = w.get(&format!("{WEP_PREFIX}default/node1-cni-abc123-eth0"));
    assert_eq!(wep["spec"]["profiles"], json!(["net1", "net2"]));
    assert_eq!(w.keys(WEP_PREFIX).len(), 1);

    let del = inv.as_del();
    w.calico(&del, &conf).assert_ok();
    assert_clean(&w);
}

#[test]
fn two_pods_ping_each_other() {
    let w = World::new();
    let conf = w.conf(json!({}));
    let (a, b) = (w.pod(), w.pod());
    let ra = w.calico(
        &Invocation::new("ADD", "pinga", a.path()).k8s("default", "pod-a"),
        &conf,
    );
    let rb = w.calico(
        &Invocation::new("ADD", "pingb", b.path()).k8s("default", "pod-b"),
        &conf,
    );
    let (ipa, ipb) = (ip_of(&ra.assert_ok().json()), ip_of(&rb.assert_ok().json()));
    assert_ne!(ipa, ipb);
    let ping = a.exec("ping", &["-c", "2", "-W", "2", "-i", "0.2", &ipb]);
    assert!(
        ping.status.success(),
        "ping {ipa} -> {ipb}: {}",
        String::from_utf8_lossy(&ping.stdout)
    );
    let ping = b.exec("ping", &["-c", "1", "-W", "2", &ipa]);
    assert!(ping.status.success());
    for (cid, ns, pod) in [("pinga", &a, "pod-a"), ("pingb", &b, "pod-b")] {
        w.calico(
            &Invocation::new("DEL", cid, ns.path()).k8s("default", pod),
            &conf,
        )
        .assert_ok();
    }
    assert_clean(&w);
}

#[test]
fn result_encoding_per_cni_version() {
    let w = World::new();
    for (i, version) in ["0.2.0", "0.3.1", "0.4.0", "1.0.0"].iter().enumerate() {
        let pod = w.pod();
        let conf = w.conf(json!({"cniVersion": version}));
        let cid = format!("ver{i}");
        let out = w.calico(&Invocation::new("ADD", &cid, pod.path()), &conf);
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
        w.calico(&Invocation::new("DEL", &cid, pod.path()), &conf)
            .assert_ok();
    }
    assert_clean(&w);
}

#[test]
fn k8s_second_add_renetworks_and_keeps_one_endpoint() {
    let w = World::new();
    let pod = w.pod();
    let conf = w.conf(json!({}));
    let first = Invocation::new("ADD", "cid-x", pod.path()).k8s("ns1", "web");
    let r1 = w.calico(&first, &conf);
    let ip1 = ip_of(&r1.assert_ok().json());
    // New sandbox for the same pod, same netns here (the old interface is replaced).
    let second = Invocation::new("ADD", "cid-y", pod.path()).k8s("ns1", "web");
    let r2 = w.calico(&second, &conf);
    let ip2 = ip_of(&r2.assert_ok().json());
    assert_ne!(ip1, ip2, "re-allocated under the new handle");
    assert_eq!(w.keys(WEP_PREFIX).len(), 1);
    let wep = w.get(&format!("{WEP_PREFIX}ns1/node1-k8s-web-eth0"));
    assert_eq!(wep["spec"]["containerID"], "cid-y");
    assert_eq!(wep["spec"]["ipNetworks"], json!([format!("{ip2}/32")]));
    // The stale sandbox's DEL keeps the WEP (other container ID) but frees its own IP.
    let del_x = Invocation {
        command: "DEL".into(),
        netns: String::new(),
        ..first.clone()
    };
    w.calico(&del_x, &conf).assert_ok();
    assert_eq!(w.keys(WEP_PREFIX).len(), 1);
    assert!(w.keys("/calico/ipam/v2/handle/net1.cid-x").is_empty());
    let del_y = second.as_del();
    w.calico(&del_y, &conf).assert_ok();
    assert_clean(&w);
}

#[test]
fn del_is_idempotent() {
    let w = World::new();
    let conf = w.conf(json!({}));
    let pod = w.pod();
    // Never added, netns exists.
    w.calico(&Invocation::new("DEL", "never", pod.path()), &conf)
        .assert_ok();
    w.calico(
        &Invocation::new("DEL", "never", pod.path()).k8s("default", "p"),
        &conf,
    )
    .assert_ok();
    // Netns that does not exist, and none at all.
    w.calico(
        &Invocation::new("DEL", "gone", "/not/a/real/path1234567890"),
        &conf,
    )
    .assert_ok();
    w.calico(&Invocation::new("DEL", "gone", ""), &conf)
        .assert_ok();
    // calico-ipam DEL with nothing allocated.
    w.ipam(&Invocation::new("DEL", "nothing", "b"), &conf)
        .assert_ok();
    assert_clean(&w);
}

#[test]
fn ip_arg_assigns_that_address() {
    let w = World::new();
    let conf = w.conf(json!({}));
    let pod = w.pod();
    let inv = Invocation::new("ADD", "fixed1", pod.path()).with_args("IP=10.65.7.7");
    let r = w.calico(&inv, &conf);
    assert_eq!(r.assert_ok().json()["ips"][0]["address"], "10.65.7.7/32");
    let handle = w.get("/calico/ipam/v2/handle/net1.fixed1");
    assert_eq!(handle["block"], json!({"10.65.7.0/26": 1}));
    // The same address again for another container: upstream's error.
    let pod2 = w.pod();
    let err = w
        .calico(
            &Invocation::new("ADD", "fixed2", pod2.path()).with_args("IP=10.65.7.7"),
            &conf,
        )
        .assert_err();
    assert_eq!(
        err["msg"],
        "resource already exists: 10.65.7.7 with error: Address already assigned in block"
    );
    assert!(w.keys("/calico/ipam/v2/handle/net1.fixed2").is_empty());
    // Outside every pool.
    let err = w
        .ipam(
            &Invocation::new("ADD", "fixed3", "b").with_args("IP=192.168.9.9"),
            &conf,
        )
        .assert_err();
    assert_eq!(
        err["msg"],
        "The provided IP address is not in a configured pool\n"
    );
    w.calico(&inv.as_del(), &conf).assert_ok();
    w.calico(&Invocation::new("DEL", "fixed2", pod2.path()), &conf)
        .assert_ok();
    assert_clean(&w);
}

#[test]
fn datastore_not_ready_fails_add_and_del() {
    let w = World::new();
    w.seed_cluster_information(false);
    let conf = w.conf(json!({}));
    let pod = w.pod();
    let err = w
        .calico(&Invocation::new("ADD", "nr1", pod.path()), &conf)
        .assert_err();
    assert_eq!(err["code"], 999);
    assert_eq!(
        err["msg"],
        "Calico is currently not ready to process requests"
    );
    assert_clean(&w);
    w.calico(&Invocation::new("DEL", "nr1", pod.path()), &conf)
        .assert_err();
    // No ClusterInformation at all.
    w.etcd.etcdctl(&[
        "del",
        "/calico/resources/v3/projectcalico.org/clusterinformations/default",
    ]);
    let err = w
        .calico(&Invocation::new("ADD", "nr1", pod.path()), &conf)
        .assert_err();
    assert_eq!(
        err["msg"],
        "error getting ClusterInformation: resource does not exist: ClusterInformation(default) with error: <nil>"
    );
}

#[test]
fn host_local_ipam_delegation() {
    let w = World::new();
    let data = w.scratch.path().join("host-local");
    let conf = w.conf(json!({"ipam": {"type": "host-local", "subnet": "10.66.0.0/24", "dataDir": data.display().to_string()}}));
    let pod = w.pod();
    let inv = Invocation::new("ADD", "hl1", pod.path()).k8s("default", "hlpod");
    let r = w.calico(&inv, &conf).assert_ok().json();
    let ip = ip_of(&r);
    assert!(ip.starts_with("10.66.0."), "{r}");
    assert_eq!(r["ips"][0]["address"], format!("{ip}/32"));
    assert!(r["ips"][0].get("gateway").is_none());
    let wep = w.get(&format!("{WEP_PREFIX}default/node1-k8s-hlpod-eth0"));
    assert_eq!(wep["spec"]["ipNetworks"], json!([format!("{ip}/32")]));
    assert!(
        w.keys("/calico/ipam/v2/handle/").is_empty(),
        "calico IPAM untouched"
    );
    let routes = w.host_sh("ip route");
    assert!(routes.contains(&format!("{ip} dev cali")), "{routes}");
    w.calico(&inv.as_del(), &conf).assert_ok();
    assert!(
        !data.join("net1").join(&ip).exists(),
        "host-local released the address"
    );
    assert_clean(&w);
}

// ------------------------------------------------------------------ bad input

fn assert_bad(w: &World, out: common::cni::Outcome, code: u64) -> Value {
    let err = out.assert_err();
    assert_eq!(err["code"], code, "{err}");
    assert_clean(w);
    err
}

#[test]
fn bad_input_is_refused_and_leaves_nothing() {
    let w = World::new();
    let conf = w.conf(json!({}));
    let pod = w.pod();
    let ok = Invocation::new("ADD", "bad1", pod.path()).k8s("default", "badpod");

    assert_bad(&w, w.calico(&ok, "{not json"), 6);
    // No CNI_COMMAND at all: libcni's about text on stderr, exit 0, nothing done.
    let mut bare = ok.clone();
    bare.unset.push("CNI_COMMAND".into());
    let out = w.calico(&bare, &conf);
    assert_eq!((out.code, out.stdout.as_str()), (0, ""));
    assert!(
        out.stderr.starts_with("Calico CNI plugin"),
        "{}",
        out.stderr
    );
    assert_clean(&w);
    for var in ["CNI_CONTAINERID", "CNI_IFNAME", "CNI_PATH", "CNI_NETNS"] {
        let mut inv = ok.clone();
        inv.unset.push(var.into());
        let out = w.calico(&inv, &conf);
        let err = assert_bad(&w, out, 4);
        assert!(err["msg"].as_str().unwrap().contains(var), "{err}");
    }
    let err = assert_bad(
        &w,
        w.calico(&ok, &w.conf(json!({"cniVersion": "9.9.9"}))),
        1,
    );
    assert_eq!(err["msg"], "incompatible CNI versions");
    let err = assert_bad(
        &w,
        w.calico(&ok.clone().ifname("way-too-long-ifname0"), &conf),
        4,
    );
    assert_eq!(err["msg"], "interface name is too long");
    assert_bad(&w, w.calico(&ok.clone().ifname("a/b"), &conf), 4);
    // Nonexistent netns: the IPs are given back.
    let mut gone = ok.clone();
    gone.netns = "/var/run/netns/does-not-exist-xyz".into();
    assert_bad(&w, w.calico(&gone, &conf), 999);
}

#[test]
fn no_pool_and_exhausted_pool() {
    let w = World::bare();
    w.seed_cluster_information(true);
    w.seed_node(NODE);
    let conf = w.conf(json!({}));
    let pod = w.pod();
    let err = assert_bad(
        &w,
        w.calico(&Invocation::new("ADD", "np1", pod.path()), &conf),
        999,
    );
    assert!(
        err["msg"]
            .as_str()
            .unwrap()
            .contains("cannot find a qualified ippool"),
        "{err}"
    );
    // A /30 pool with /30 blocks: four addresses, then a clear error.
    w.seed_pool("tiny", "10.65.9.0/30", 30);
    let mut pods = Vec::new();
    for i in 0..4 {
        let p = w.pod();
        w.calico(&Invocation::new("ADD", &format!("ex{i}"), p.path()), &conf)
            .assert_ok();
        pods.push(p);
    }
    let p = w.pod();
    let err = w
        .calico(&Invocation::new("ADD", "ex4", p.path()), &conf)
        .assert_err();
    assert!(
        err["msg"]
            .as_str()
            .unwrap()
            .contains("Assigned 0 out of 1 requested IPv4 addresses"),
        "{err}"
    );
    assert!(w.keys("/calico/ipam/v2/handle/net1.ex4").is_empty());
    assert!(!String::from_utf8_lossy(&p.exec("ip", &["link"]).stdout).contains("eth0"));
    for (i, p) in pods.iter().enumerate() {
        w.calico(&Invocation::new("DEL", &format!("ex{i}"), p.path()), &conf)
            .assert_ok();
    }
    assert_clean(&w);
}

#[test]
fn missing_node_object() {
    let w = World::bare();
    w.seed_cluster_information(true);
    w.seed_pool("default-ipv4-ippool", "10.65.0.0/16", 26);
    let conf = w.conf(json!({}));
    let pod = w.pod();
    let err = assert_bad(
        &w,
        w.calico(&Invocation::new("ADD", "nn1", pod.path()), &conf),
        999,
    );
    assert!(
        err["msg"].as_str().unwrap().contains("Node(node1)"),
        "{err}"
    );
}

#[test]
fn etcd_unreachable_fails_fast() {
    let w = World::new();
    let conf = w.conf(json!({"etcd_endpoints": "http://127.0.0.1:1"}));
    let pod = w.pod();
    let start = std::time::Instant::now();
    let out = w.calico(&Invocation::new("ADD", "down1", pod.path()), &conf);
    let err = out.assert_err();
    assert!(
        start.elapsed() < std::time::Duration::from_secs(15),
        "took {:?}",
        start.elapsed()
    );
    assert_eq!(err["code"], 999);
    assert_clean(&w);
}

#[test]
fn dual_stack_k8s_pod() {
    let w = World::new();
    w.seed_pool("default-ipv6-ippool", "fd80:24e2:f998:72d6::/64", 122);
    let conf = w.conf(json!({"ipam": {"assign_ipv6": "true"}}));
    let pod = w.pod();
    let inv = Invocation::new("ADD", "ds1", pod.path()).k8s("default", "dual");
    let r = w.calico(&inv, &conf).assert_ok().json();
    let ips = r["ips"].as_array().unwrap();
    assert_eq!(ips.len(), 2, "{r}");
    assert!(ips[0]["address"].as_str().unwrap().ends_with("/32"));
    let v6 = ips[1]["address"].as_str().unwrap().to_string();
    assert!(
        v6.starts_with("fd80:24e2:f998:72d6:") && v6.ends_with("/128"),
        "{v6}"
    );
    assert!(r["routes"][1]["dst"].as_str().unwrap().ends_with("/122"));
    let handle = w.get("/calico/ipam/v2/handle/net1.ds1");
    assert_eq!(handle["block"].as_object().unwrap().len(), 2);
    assert_eq!(w.keys("/calico/ipam/v2/assignment/ipv6/block/").len(), 1);
    assert_eq!(
        w.keys(&format!("/calico/ipam/v2/host/{NODE}/ipv6/block/"))
            .len(),
        1
    );
    let wep = w.get(&format!("{WEP_PREFIX}default/node1-k8s-dual-eth0"));
    assert_eq!(wep["spec"]["ipNetworks"].as_array().unwrap().len(), 2);
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
    let host_routes = w.host_sh("ip -6 route show");
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
        assert_eq!(sysctl(w.host.name(), &path), want, "{path}");
    }
    assert!(w
        .host_sh(&format!("ip -6 addr show dev {veth}"))
        .contains("fe80::ecee:eeff:feee:eeee"));
    w.calico(&inv.as_del(), &conf).assert_ok();
    assert_clean(&w);
}

#[test]
fn unknown_fields_survive_read_modify_write_and_logs_are_written() {
    let w = World::new();
    let conf = w.conf(json!({}));
    let (a, b) = (w.pod(), w.pod());
    w.calico(&Invocation::new("ADD", "rmw1", a.path()), &conf)
        .assert_ok();
    // A newer Calico adds fields to the block; our next write must keep them.
    let key = w.keys("/calico/ipam/v2/assignment/ipv4/block/").remove(0);
    let mut block = w.get(&key);
    block["futureField"] = json!({"x": 1});
    block["attributes"][0]["alternateOwnerAttrs"] = json!({"pod": "other"});
    w.etcd.put(&key, &block.to_string());
    w.calico(&Invocation::new("ADD", "rmw2", b.path()), &conf)
        .assert_ok();
    let after = w.get(&key);
    assert_eq!(after["futureField"], json!({"x": 1}));
    assert_eq!(
        after["attributes"][0]["alternateOwnerAttrs"],
        json!({"pod": "other"})
    );
    assert_eq!(after["attributes"].as_array().unwrap().len(), 2);
    assert_eq!(
        after["sequenceNumber"].as_u64().unwrap(),
        block["sequenceNumber"].as_u64().unwrap() + 1
    );
    let log = std::fs::read_to_string(w.scratch.path().join("cni.log")).expect("log file");
    assert!(
        log.contains("[INFO]") && log.contains("cni-plugin/") && log.contains("ipam/"),
        "{log}"
    );
    for (cid, ns) in [("rmw1", &a), ("rmw2", &b)] {
        w.calico(&Invocation::new("DEL", cid, ns.path()), &conf)
            .assert_ok();
    }
}

/// When `calico-ipam` in CNI_PATH is not this very binary (here: a copy), it is exec'd as a
/// separate process as libcni would: CNI_ARGS gets IgnoreUnknown, its result comes back
/// through stdout in the config's version, its errors pass through unchanged.
#[test]
fn calico_ipam_as_a_separate_process() {
    let w = World::new();
    let dir = common::cni::TempDir::new("sep-bin");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_calico"), dir.path().join("calico")).unwrap();
    std::fs::copy(env!("CARGO_BIN_EXE_calico"), dir.path().join("calico-ipam")).unwrap();
    let path = dir.path().display().to_string();
    let conf = w.conf(json!({"cniVersion": "0.3.1"}));
    let pod = w.pod();
    let inv = Invocation::new("ADD", "sep1", pod.path()).k8s("default", "sep");
    let run = |inv: &Invocation, conf: &str| {
        common::cni::run_plugin(
            &dir.path().join("calico"),
            &path,
            Some(w.host.name()),
            inv,
            conf,
        )
    };
    let r = run(&inv, &conf).assert_ok().json();
    assert_eq!(r["cniVersion"], "0.3.1");
    assert!(r["ips"][0]["address"].as_str().unwrap().ends_with("/32"));
    assert_eq!(w.keys("/calico/ipam/v2/handle/net1.sep1").len(), 1);
    // An IPAM error (address outside every pool) arrives as the child printed it.
    let bad = Invocation::new("ADD", "sep2", pod.path()).with_args("IP=192.0.2.77");
    let err = run(&bad, &conf).assert_err();
    assert_eq!(err["code"], 999);
    assert_eq!(
        err["msg"],
        "The provided IP address is not in a configured pool\n"
    );
    run(&inv.as_del(), &conf).assert_ok();
    assert_clean(&w);
}
