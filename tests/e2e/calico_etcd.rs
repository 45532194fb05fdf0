//! End to end on etcd v3, what only etcd has: the exact keys and JSON written (upstream's
//! WorkloadEndpoint, IPAM and Profile objects), the `cni` orchestrator (no Kubernetes pod),
//! unknown fields kept on read-modify-write, and etcd's own error texts. The scenarios that
//! do not depend on the datastore (result encoding, dataplane, ping, DEL idempotence, IP=,
//! host-local, dual stack, pools, bad input, readiness, ...) are in shared_scenarios.rs, run
//! on etcd and on the Kubernetes datastore.

use std::time::Duration;

use crate::common::cluster::block_allocations;
use crate::common::cni::{run_plugin_within, Invocation};
use crate::common::route_conflict;
use crate::common::world::{World, NODE, WEP_PREFIX};
use serde_json::{json, Value};

fn ip_of(result: &Value) -> String {
    let addr = result["ips"][0]["address"].as_str().expect("an address");
    addr.split('/').next().unwrap().to_string()
}

/// A k8s pod's ADD writes upstream's objects under upstream's keys, exactly. (The result,
/// the dataplane and DEL: shared_scenarios.rs `add_and_del_with_calico_ipam`.)
#[test]
fn k8s_add_writes_upstreams_etcd_objects() {
    let w = World::new();
    let pod = w.pod();
    let conf = w.conf(json!({}));
    let inv = Invocation::new("ADD", "a1b2c3d4e5f6", pod.path()).k8s("default", "nginx");
    let r = w.calico(&inv, &conf).assert_ok().json();
    let ip = ip_of(&r);
    let mac = r["interfaces"][1]["mac"].as_str().unwrap().to_string();
    // The first ordinal of node1's first block: the route is the block.
    let block_cidr = r["routes"][0]["dst"].as_str().unwrap().to_string();
    assert_eq!(block_cidr, format!("{ip}/26"));

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
    // IPAM objects under their keys.
    let handle = w.get("/calico/ipam/v2/handle/net1.a1b2c3d4e5f6");
    assert_eq!(handle["block"], json!({ &block_cidr: 1 }));
    assert_eq!(handle["deleted"], false);
    let block_key = format!(
        "/calico/ipam/v2/assignment/ipv4/block/{}",
        block_cidr.replace('/', "-")
    );
    let block = w.get(&block_key);
    assert_eq!(block["cidr"], block_cidr);
    assert_eq!(block["affinity"], format!("host:{NODE}"));
    assert_eq!(block["attributes"][0]["handle_id"], "net1.a1b2c3d4e5f6");
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
        json!({"ingress":[{"action":"Allow","source":{},"destination":{}}],"egress":[{"action":"Allow","source":{},"destination":{}}],"labelsToApply":{"net1":""}})
    );

    // DEL: the WEP and handle keys go, the empty block's key stays (affine, as upstream).
    w.calico(&inv.as_del(), &conf).assert_ok();
    w.assert_clean();
    assert_eq!(
        w.keys(&block_key),
        vec![block_key.clone()],
        "affine block kept"
    );
}

/// The interface failing after IPAM (a host route to the pod's address on another
/// interface): the endpoint, written while the interface was finished, is taken back, the
/// address is given back, no veth is left.
#[test]
fn a_failed_interface_leaves_no_endpoint() {
    let w = World::new();
    let conf = w.conf(json!({}));
    let p1 = w.pod();
    let first = Invocation::new("ADD", "first0000001", p1.path()).k8s("default", "first");
    let ip: std::net::Ipv4Addr = ip_of(&w.calico(&first, &conf).assert_ok().json())
        .parse()
        .unwrap();
    // The next address of the affine block is the second pod's; route it elsewhere.
    let next = route_conflict::route_next_elsewhere(|c| w.host_sh(c), ip);

    let p2 = w.pod();
    let second = Invocation::new("ADD", "second000001", p2.path()).k8s("default", "second");
    let since = w.etcd.revision();
    let e = w.calico(&second, &conf).assert_err();
    route_conflict::assert_route_refused(&e, next);
    // Its MAC known once the pair was up, the endpoint went out while the routes were
    // added, and was taken back.
    let written = w
        .etcd
        .values_since(&format!("{WEP_PREFIX}default/node1-k8s-second-eth0"), since);
    assert_eq!(written.len(), 1, "{written:?}");
    assert_eq!(
        written[0]["spec"]["ipNetworks"],
        json!([format!("{next}/32")])
    );
    assert_eq!(written[0]["spec"]["containerID"], "second000001");
    let mac = written[0]["spec"]["mac"].as_str().unwrap_or_default();
    assert_eq!(mac.len(), 17, "{mac}");
    assert_eq!(
        w.keys(WEP_PREFIX),
        [format!("{WEP_PREFIX}default/node1-k8s-first-eth0")]
    );
    assert_eq!(
        w.keys("/calico/ipam/v2/handle/"),
        ["/calico/ipam/v2/handle/net1.first0000001"]
    );
    let links = w.host_sh("ip -o link show | grep -c cali || true");
    assert_eq!(links.trim(), "1", "only the first pod's veth");

    route_conflict::unroute(|c| w.host_sh(c));
    w.calico(&second.as_del(), &conf).assert_ok();
    w.calico(&first.as_del(), &conf).assert_ok();
    w.assert_clean();
}

/// An ADD killed (SIGKILL) once its endpoint has landed and before it answered (held in
/// the wait for Felix's status file): the runtime's DEL removes the endpoint, the address
/// and the veth. (The endpoint goes out while the interface is finished; that step is
/// local and cannot be held from outside, so the kill comes after it: DEL meets the same
/// endpoint, handle and veth either way.)
#[test]
fn an_add_killed_with_its_endpoint_landed_leaves_nothing_after_del() {
    let w = World::new();
    let dir = w.scratch.path().join("endpoint-status");
    std::fs::create_dir_all(&dir).unwrap();
    let conf = w.conf(json!({"policy_setup_timeout_seconds": 60,
        "endpoint_status_dir": dir.display().to_string()}));
    let pod = w.pod();
    let inv = Invocation::new("ADD", "killed000001", pod.path()).k8s("default", "killed");
    let key = format!("{WEP_PREFIX}default/node1-k8s-killed-eth0");
    let mut child = w.bin.spawn("calico", w.host.name(), &inv, &conf);
    let started = std::time::Instant::now();
    while w.keys(&key).is_empty() {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the endpoint never landed"
        );
        assert!(child.try_wait().unwrap().is_none(), "the ADD ended first");
        std::thread::sleep(Duration::from_millis(5));
    }
    // SAFETY: kill(2) on the PID this test spawned, not yet reaped.
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    child.wait().unwrap();
    let wep = w.get(&key);
    assert_eq!(wep["spec"]["containerID"], "killed000001");
    assert_eq!(w.keys("/calico/ipam/v2/handle/").len(), 1);
    let links = w.host_sh("ip -o link show | grep -c cali || true");
    assert_eq!(links.trim(), "1", "the pod's veth");

    w.calico(&inv.as_del(), &conf).assert_ok();
    w.assert_clean();
}

/// A DEL killed (SIGKILL) at each of its writes — etcd frozen the moment the endpoint's
/// delete, the block's release or the handle's delete lands, so that the kill falls between
/// that write and the others sent with it — then the runtime's retried DEL. Before the
/// retry, no address is held without its handle or a record in the IPAM lock file's journal
/// leading to it (`pending <handle> <block>`); after it, nothing is left.
#[test]
fn a_del_killed_at_each_write_is_finished_by_its_retry() {
    let w = World::new();
    let conf = w.conf(json!({}));
    let lock = w.scratch.path().join("ipam.lock");
    // A pod that stays: the block keeps an address and its affinity whatever the DELs do.
    let stays = w.pod();
    let stays_inv = Invocation::new("ADD", "stays0000001", stays.path()).k8s("default", "stays");
    w.calico(&stays_inv, &conf).assert_ok();
    let writes = [
        ("the endpoint's delete", WEP_PREFIX.to_string()),
        (
            "the block's release",
            "/calico/ipam/v2/assignment/".to_string(),
        ),
        ("the handle's delete", "/calico/ipam/v2/handle/".to_string()),
    ];
    for (n, (what, prefix)) in writes.iter().enumerate() {
        let pod = w.pod();
        let cid = format!("killdel{n:05}");
        let inv = Invocation::new("ADD", &cid, pod.path()).k8s("default", &format!("kd{n}"));
        w.calico(&inv, &conf).assert_ok();
        let trap = w.etcd.freeze_on_write(prefix);
        let mut child = w.bin.spawn("calico", w.host.name(), &inv.as_del(), &conf);
        let started = std::time::Instant::now();
        while !trap.fired() {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "{what}: the DEL never wrote there"
            );
            assert!(
                child.try_wait().unwrap().is_none(),
                "{what}: the DEL ended first"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        // SAFETY: kill(2) on the PID this test spawned, not yet reaped.
        unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
        child.wait().unwrap();
        drop(trap);
        w.etcd.thaw();
        let journal = std::fs::read_to_string(&lock).unwrap_or_default();
        let handle = format!("net1.{cid}");
        let handle_left = !w
            .keys(&format!("/calico/ipam/v2/handle/{handle}"))
            .is_empty();
        for k in w.keys("/calico/ipam/v2/assignment/") {
            let block = w.get(&k);
            let held = block_allocations(&block).iter().any(|a| a.handle == handle);
            let record = format!("pending {handle} {}", block["cidr"].as_str().unwrap());
            assert!(
                !held || handle_left || journal.lines().any(|l| l == record),
                "{what}: {k} holds an address of {handle}, with neither its handle nor a \
                 record in the journal:\n{journal}"
            );
        }
        eprintln!(
            "killed at {what}: endpoint left {}, handle left {handle_left}, journal {journal:?}",
            !w.keys(&format!("{WEP_PREFIX}default/node1-k8s-kd{n}-eth0"))
                .is_empty()
        );
        w.calico(&inv.as_del(), &conf).assert_ok();
        let journal = std::fs::read_to_string(&lock).unwrap_or_default();
        assert!(!journal.contains(&handle), "{what}: {journal}");
    }
    w.calico(&stays_inv.as_del(), &conf).assert_ok();
    w.assert_clean();
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
        json!({"ingress":[{"action":"Allow","source":{"selector":"has(net1)"},"destination":{}}],"egress":[{"action":"Allow","source":{},"destination":{}}],"labelsToApply":{"net1":""}})
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
    w.assert_clean();
    // DEL is idempotent in cni mode too: again, never added, a netns gone, no netns at all.
    w.calico(&del, &conf).assert_ok();
    w.calico(&Invocation::new("DEL", "never", pod.path()), &conf)
        .assert_ok();
    let mut gone = Invocation::new("DEL", "gone", "/not/a/real/path1234567890");
    w.calico(&gone, &conf).assert_ok();
    gone.netns = String::new();
    w.calico(&gone, &conf).assert_ok();
    w.assert_clean();
}

/// A plain-CNI ADD (no pod in CNI_ARGS) is in namespace `default`: with a kubeconfig
/// configured, calico-ipam reads that namespace's labels for pools' `namespaceSelector`, in
/// process as upstream's separate calico-ipam does (upstream `GetIdentifiers`, then
/// `getNamespace`). When it cannot, the ADD fails before anything is allocated and leaves
/// nothing.
#[test]
fn cni_mode_add_reads_the_default_namespace_for_pools() {
    let w = World::new();
    let pod = w.pod();
    let conf = w.conf(json!({"kubernetes": {"kubeconfig": "/nonexistent/kubeconfig"}}));
    let inv = Invocation::new("ADD", "nsread", pod.path());
    let err = w.calico(&inv, &conf).assert_err();
    let msg = err["msg"].as_str().unwrap_or_default();
    assert!(msg.starts_with("failed to get namespace default"), "{err}");
    assert!(!pod.has_link("eth0"), "the pod interface was left");
    w.assert_clean();
}

/// A store calico/node has not set up: etcd's texts for a missing ClusterInformation, then
/// for a missing Node; nothing is left. (Readiness itself: shared_scenarios.rs
/// `datastore_not_ready_fails_add_and_del`.)
#[test]
fn missing_cluster_information_then_missing_node() {
    let w = World::bare();
    w.seed_pool("default-ipv4-ippool", "10.65.0.0/16", 26);
    let conf = w.conf(json!({}));
    let pod = w.pod();
    let add = Invocation::new("ADD", "nn1", pod.path());
    let err = w.calico(&add, &conf).assert_err();
    assert_eq!(
        err["msg"],
        "error getting ClusterInformation: resource does not exist: ClusterInformation(default) with error: <nil>"
    );
    w.assert_clean();
    w.seed_cluster_information(true);
    let err = w.calico(&add, &conf).assert_err();
    assert_eq!(err["code"], 999, "{err}");
    assert!(
        err["msg"].as_str().unwrap().contains("Node(node1)"),
        "{err}"
    );
    w.assert_clean();
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

/// A NetConf that takes the node name from a nodename file in the scratch directory (not
/// from `nodename`), which must exist: as a node whose calico/node writes the file.
fn nodename_file_conf(w: &World) -> (String, std::path::PathBuf) {
    let file = w.scratch.path().join("nodename");
    let conf = w.conf(json!({
        "nodename": null,
        "nodename_file": file.display().to_string(),
        "nodename_file_optional": false,
    }));
    (conf, file)
}

fn missing_nodename_text(file: &std::path::Path) -> String {
    format!(
        "stat {}: no such file or directory: check that the calico/node container is running and has mounted /var/lib/calico/",
        file.display()
    )
}

/// A pod scheduled before calico/node has written the nodename file: ADD waits for it and
/// then succeeds with the file's node name (upstream fails at once).
#[test]
fn add_waits_for_the_nodename_file() {
    let w = World::new();
    let (conf, file) = nodename_file_conf(&w);
    let pod = w.pod();
    let inv = Invocation::new("ADD", "boot1", pod.path()).k8s("default", "early");
    let delay = Duration::from_millis(1500);
    let writer = {
        let file = file.clone();
        std::thread::spawn(move || {
            std::thread::sleep(delay);
            std::fs::write(&file, format!("{NODE}\n")).expect("write the nodename file");
        })
    };
    let out = w.calico(&inv, &conf);
    writer.join().expect("writer thread");
    out.assert_ok();
    assert!(
        out.elapsed >= delay - Duration::from_millis(100),
        "did not wait: {:?}",
        out.elapsed
    );
    assert!(out.elapsed < Duration::from_secs(10), "{:?}", out.elapsed);
    let wep = w.get(&format!("{WEP_PREFIX}default/{NODE}-k8s-early-eth0"));
    assert_eq!(wep["spec"]["node"], NODE);
    let log = std::fs::read_to_string(w.scratch.path().join("cni.log")).expect("log file");
    assert!(log.contains("waiting for it"), "{log}");
    assert!(log.contains("the nodename file appeared"), "{log}");
    w.calico(&inv.as_del(), &conf).assert_ok();
    w.assert_clean();
}

/// The file never comes: ADD gives up at half the call's budget (4 s here) with upstream's
/// text, having touched nothing.
#[test]
fn add_without_the_nodename_file_fails_at_half_the_budget() {
    let w = World::new();
    let (conf, file) = nodename_file_conf(&w);
    let pod = w.pod();
    let mut inv = Invocation::new("ADD", "boot2", pod.path()).k8s("default", "never");
    inv.extra_env = vec![("CALICO_CALL_TIMEOUT_SECONDS".into(), "4".into())];
    let out = run_plugin_within(
        &w.bin.plugin("calico"),
        &w.bin.path(),
        Some(w.host.name()),
        &inv,
        &conf,
        Duration::from_secs(15),
    );
    let err = out.assert_err();
    assert_eq!(err["msg"], missing_nodename_text(&file), "{err}");
    assert!(
        out.elapsed >= Duration::from_millis(1800) && out.elapsed < Duration::from_secs(3),
        "took {:?}",
        out.elapsed
    );
    assert!(!pod.has_link("eth0"), "the pod's interface was built");
    w.assert_clean();
    let log = std::fs::read_to_string(w.scratch.path().join("cni.log")).expect("log file");
    assert!(
        log.contains("the nodename file did not appear in time"),
        "{log}"
    );
}

/// DEL at boot, before calico/node has (re)written the nodename file: the node name is
/// unknown, and DEL still removes the interface, releases the handle and deletes the
/// endpoint, found by container ID; another pod's endpoint and addresses stay. With
/// `nodename` set the name is known and DEL is the usual one.
#[test]
fn del_without_the_nodename_file_does_all_it_can() {
    let w = World::new();
    let (conf, file) = nodename_file_conf(&w);
    std::fs::write(&file, NODE).expect("write the nodename file");
    let (a, b, c) = (w.pod(), w.pod(), w.pod());
    let k8s = Invocation::new("ADD", "boota", a.path()).k8s("default", "old");
    let cni = Invocation::new("ADD", "bootb", b.path());
    let other = Invocation::new("ADD", "bootc", c.path()).k8s("default", "stays");
    for inv in [&k8s, &cni, &other] {
        w.calico(inv, &conf).assert_ok();
    }
    assert_eq!(w.keys(WEP_PREFIX).len(), 3);
    std::fs::remove_file(&file).expect("remove the nodename file");

    let limit = Duration::from_secs(20);
    let run = |inv: &Invocation| {
        run_plugin_within(
            &w.bin.plugin("calico"),
            &w.bin.path(),
            Some(w.host.name()),
            inv,
            &conf,
            limit,
        )
    };
    run(&k8s.as_del()).assert_ok_fast();
    run(&cni.as_del()).assert_ok_fast();
    assert!(!a.has_link("eth0") && !b.has_link("eth0"));
    let left = w.keys(WEP_PREFIX);
    assert_eq!(
        left,
        vec![format!("{WEP_PREFIX}default/{NODE}-k8s-stays-eth0")]
    );
    assert_eq!(
        w.keys("/calico/ipam/v2/handle/"),
        vec!["/calico/ipam/v2/handle/net1.bootc".to_string()]
    );
    let log = std::fs::read_to_string(w.scratch.path().join("cni.log")).expect("log file");
    assert!(log.contains("the node name is unknown"), "{log}");
    assert!(
        log.contains("found this container's endpoint without the node name"),
        "{log}"
    );
    // Again: nothing left to find, still a success.
    run(&k8s.as_del()).assert_ok_fast();

    // `nodename` in the NetConf: the usual DEL (by name), file or not.
    let named = w.conf(json!({
        "nodename_file": file.display().to_string(),
        "nodename_file_optional": false,
    }));
    run_plugin_within(
        &w.bin.plugin("calico"),
        &w.bin.path(),
        Some(w.host.name()),
        &other.as_del(),
        &named,
        limit,
    )
    .assert_ok_fast();
    w.assert_clean();
}

/// Mesos task labels (`args.org.apache.mesos.network_info.labels`), as upstream: keys and
/// values sanitized (a run of invalid characters is one `-`), and the label whose key is
/// exactly `projectcalico.org/namespace` names the endpoint's namespace.
#[test]
fn mesos_labels_become_endpoint_labels_and_namespace() {
    let w = World::new();
    let pod = w.pod();
    let conf = w.conf(
        json!({"args": {"org.apache.mesos": {"network_info": {"labels": {"labels": [
            {"key": "projectcalico.org/namespace", "value": "team/a"},
            {"key": "app$$name", "value": "web  server"},
            {"key": "projectcalico.org.namespace", "value": "not-the-namespace"},
        ]}}}}}),
    );
    let inv = Invocation::new("ADD", "mesos1", pod.path());
    w.calico(&inv, &conf).assert_ok();
    let wep = w.get(&format!("{WEP_PREFIX}team.a/node1-cni-mesos1-eth0"));
    assert_eq!(
        wep["metadata"]["labels"],
        json!({"app-name": "web-server", "projectcalico.org.namespace": "not-the-namespace",
            "projectcalico.org/namespace": "team.a", "projectcalico.org/orchestrator": "cni"})
    );
    w.calico(&inv.as_del(), &conf).assert_ok();
    w.assert_clean();
}
