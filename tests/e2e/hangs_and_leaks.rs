//! Never hang, never leak: every failure path from the real binary
//! runs under a bounded wait (`run_plugin` kills and fails a call still running after
//! `PLUGIN_TIMEOUT`), exits with a CNI error, and leaves nothing behind — while what the
//! call did not create (a pod's running interface, another call's addresses) survives.

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::time::Duration;

use crate::common::cni::{Invocation, Outcome, FAST};
use crate::common::netns::Netns;
use crate::common::world::{World, NODE, WEP_PREFIX};
use serde_json::{json, Value};

fn fails_fast(out: &Outcome) -> Value {
    out.assert_err_fast()
}

fn ok_fast(out: &Outcome) {
    out.assert_ok_fast()
}

/// A pod netns that already has an `eth0` (a veth whose peer `keep0` stays in the pod).
fn pod_with_eth0(w: &World) -> (Netns, u32) {
    let pod = w.pod();
    pod.ip(&[
        "link", "add", "eth0", "type", "veth", "peer", "name", "keep0",
    ]);
    let idx = pod.ifindex("eth0");
    (pod, idx)
}

/// Item 1 (the dataplane logs an error from its helper thread) and item 2 (the rollback
/// must not delete an interface this call did not create), in both orchestrator modes.
#[test]
fn an_existing_pod_interface_fails_the_add_fast_and_survives_it() {
    let w = World::new();
    let conf = w.conf(json!({}));
    for (i, k8s) in [false, true].into_iter().enumerate() {
        let (pod, idx) = pod_with_eth0(&w);
        let mut inv = Invocation::new("ADD", &format!("busy{i}"), pod.path());
        if k8s {
            inv = inv.k8s("default", &format!("busy-{i}"));
        }
        let out = w.calico(&inv, &conf);
        let err = fails_fast(&out);
        assert_eq!(
            (err["code"].as_u64(), err["msg"].as_str()),
            (Some(999), Some("file exists"))
        );
        assert!(out.stderr.contains("Error adding veth"), "{}", out.stderr);
        assert_eq!(pod.ifindex("eth0"), idx, "the pod's own eth0 was replaced");
        assert!(pod.has_link("keep0"));
        w.assert_clean();
    }
}

/// Item 1: `CNI_IFNAME` naming any interface the pod netns already has, `lo` included.
#[test]
fn an_ifname_of_an_existing_interface_fails_fast() {
    let w = World::new();
    let conf = w.conf(json!({}));
    let pod = w.pod();
    let out = w.calico(
        &Invocation::new("ADD", "lo1", pod.path())
            .k8s("default", "lo-pod")
            .ifname("lo"),
        &conf,
    );
    assert_eq!(fails_fast(&out)["msg"], "file exists");
    assert!(pod.ip(&["link", "show", "lo"]).contains("UP"));
    w.assert_clean();
}

/// Item 1: a host booted with `ipv6.disable=1` has no /proc/sys/net/ipv6; the accept_ra
/// write fails with a warning (from a helper thread) and the ADD goes on. Simulated by an
/// empty tmpfs over /proc/sys/net/ipv6 in a private mount namespace.
#[test]
fn a_host_without_ipv6_sysctls_still_networks_ipv4_pods() {
    let w = World::new();
    let conf = w.conf(json!({}));
    let pod = w.pod();
    let mut inv = Invocation::new("ADD", "noipv6", pod.path()).k8s("default", "noipv6");
    inv.prefix = Some("mount -t tmpfs none /proc/sys/net/ipv6".into());
    let out = w.calico(&inv, &conf);
    ok_fast(&out);
    assert!(
        out.stderr.contains("[WARNING]") && out.stderr.contains("accept_ra=0"),
        "{}",
        out.stderr
    );
    let ip = out.json()["ips"][0]["address"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(pod.sh("ip -4 addr show dev eth0").contains(&ip));
    ok_fast(&w.calico(&inv.as_del(), &conf));
    w.assert_clean();
}

/// Item 1: the IPv6 link-local retry (a host whose new interfaces get random link-local
/// addresses never shows fe80::ecee:eeff:feee:eeee): the toggles log warnings, then the ADD
/// gives up with upstream's error and takes everything back, both families.
#[test]
fn the_link_local_retry_gives_up_cleanly() {
    let w = World::new();
    w.seed_pool("default-ipv6-ippool", "fd80:24e2:f998:72d6::/64", 122);
    w.host
        .set_sysctl("net/ipv6/conf/default/addr_gen_mode", "3");
    let conf = w.conf(json!({"ipam": {"assign_ipv6": "true"}}));
    let pod = w.pod();
    let out = w.calico(
        &Invocation::new("ADD", "ll1", pod.path()).k8s("default", "ll"),
        &conf,
    );
    let err = fails_fast(&out);
    assert!(
        err["msg"]
            .as_str()
            .unwrap()
            .starts_with("host-side veth got wrong link-local IP address: fe80::"),
        "{err}"
    );
    assert!(out.stderr.contains("toggling it down/up"), "{}", out.stderr);
    assert!(!pod.has_link("eth0"));
    w.assert_clean();
}

/// Item 1: values the kernel rejects (MTU 1, 67, 65536; 4097 queues) fail the ADD at once
/// and give everything back.
#[test]
fn values_the_kernel_rejects_fail_cleanly() {
    let w = World::new();
    for (i, extra) in [
        json!({"mtu": 1}),
        json!({"mtu": 67}),
        json!({"mtu": 65536}),
        json!({"num_queues": 4097}),
    ]
    .into_iter()
    .enumerate()
    {
        let conf = w.conf(extra.clone());
        let pod = w.pod();
        let out = w.calico(
            &Invocation::new("ADD", &format!("kv{i}"), pod.path())
                .k8s("default", &format!("kv{i}")),
            &conf,
        );
        let err = fails_fast(&out);
        assert_eq!(err["msg"], "invalid argument", "{extra}");
        assert!(!pod.has_link("eth0"));
        w.assert_clean();
    }
}

/// Item 1: an MTU below 1280 leaves the veth without IPv6 (its /proc/sys/net/ipv6 entries
/// vanish); an IPv4 pod is networked all the same, with a warning.
#[test]
fn an_mtu_below_1280_networks_an_ipv4_pod() {
    let w = World::new();
    let conf = w.conf(json!({"mtu": 1000}));
    let pod = w.pod();
    let inv = Invocation::new("ADD", "small", pod.path()).k8s("default", "small");
    let out = w.calico(&inv, &conf);
    ok_fast(&out);
    assert_eq!(out.json()["interfaces"][1]["mtu"], 1000);
    assert!(pod.ip(&["link", "show", "eth0"]).contains("mtu 1000"));
    ok_fast(&w.calico(&inv.as_del(), &conf));
    w.assert_clean();
}

/// Item 1: a full log filesystem (every write fails with ENOSPC, as on /dev/full) neither
/// blocks, fails nor slows a call: ADD, a failing ADD, and a DEL whose netns is gone.
#[test]
fn a_full_log_filesystem_changes_nothing() {
    let w = World::new();
    let conf = w.conf(json!({"log_file_path": "/dev/full"}));
    let pod = w.pod();
    let inv = Invocation::new("ADD", "full1", pod.path()).k8s("default", "full");
    ok_fast(&w.calico(&inv, &conf));
    // A failure path logs errors from a helper thread: still prompt.
    let (busy, _) = pod_with_eth0(&w);
    let out = w.calico(&Invocation::new("ADD", "full2", busy.path()), &conf);
    assert_eq!(fails_fast(&out)["msg"], "file exists");
    // The pod's netns is deleted before the runtime's DEL.
    let path = pod.path().to_string();
    drop(pod);
    let mut del = inv.as_del();
    del.netns = path;
    ok_fast(&w.calico(&del, &conf));
    w.assert_clean();
}

/// Item 3: an empty block without affinity (left by another host) is never "reclaimed"
/// (upstream's releaseBlockAffinity refuses an empty host): the ADD borrows from it at once.
#[test]
fn an_empty_block_without_affinity_is_borrowed_from() {
    let w = World::bare();
    w.seed_cluster_information(true);
    w.seed_node(NODE);
    // One block's worth of pool, taken by an empty, non-affine block.
    w.seed_pool("one-block", "10.65.3.0/29", 29);
    let block = r#"{"cidr":"10.65.3.0/29","affinity":null,"allocations":[null,null,null,null,null,null,null,null],"unallocated":[0,1,2,3,4,5,6,7],"attributes":[],"sequenceNumber":1,"sequenceNumberForAllocation":{},"deleted":false}"#;
    w.etcd
        .put("/calico/ipam/v2/assignment/ipv4/block/10.65.3.0-29", block);
    let conf = w.conf(json!({}));
    let pod = w.pod();
    let inv = Invocation::new("ADD", "borrow1", pod.path());
    let out = w.calico(&inv, &conf);
    ok_fast(&out);
    assert_eq!(out.json()["ips"][0]["address"], "10.65.3.0/32");
    let b = w.get("/calico/ipam/v2/assignment/ipv4/block/10.65.3.0-29");
    assert_eq!(b["affinity"], Value::Null, "borrowed, not claimed");
    assert_eq!(b["attributes"][0]["secondary"]["node"], NODE);
    assert!(w.keys(&format!("/calico/ipam/v2/host/{NODE}/")).is_empty());
    ok_fast(&w.calico(&inv.as_del(), &conf));
    // Emptied and non-affine, the block was deleted by that DEL; put it back. With strict
    // affinity there is nothing to borrow from: upstream's message.
    assert!(w.keys("/calico/ipam/v2/assignment/").is_empty());
    w.etcd
        .put("/calico/ipam/v2/assignment/ipv4/block/10.65.3.0-29", block);
    w.etcd.put(
        "/calico/ipam/v2/config",
        r#"{"strict_affinity":true,"auto_allocate_blocks":true}"#,
    );
    let err = fails_fast(&w.calico(&Invocation::new("ADD", "borrow2", pod.path()), &conf));
    assert_eq!(
        err["msg"],
        "failed to request IPv4 addresses: Assigned 0 out of 1 requested IPv4 addresses; No more free affine blocks and strict affinity enabled"
    );
    w.assert_clean();
}

/// Item 4: two ADDs of the same sandbox at once. Whatever the interleaving, the failed
/// one's rollback gives back only its own address: every address the endpoint lists stays
/// allocated to the handle, and the handle holds nothing else but what a DEL releases.
#[test]
fn two_adds_of_the_same_sandbox_never_free_the_winners_address() {
    let w = World::new();
    let conf = w.conf(json!({}));
    for round in 0..4 {
        let pod = w.pod();
        let cid = format!("race{round}");
        let inv = Invocation::new("ADD", &cid, pod.path()).k8s("default", &format!("race-{round}"));
        let (a, b) = std::thread::scope(|s| {
            let a = s.spawn(|| w.calico(&inv, &conf));
            let b = s.spawn(|| w.calico(&inv, &conf));
            (a.join().unwrap(), b.join().unwrap())
        });
        assert!(a.elapsed < FAST && b.elapsed < FAST);
        assert!(
            a.code == 0 || b.code == 0,
            "both failed: {} / {}",
            a.stdout,
            b.stdout
        );
        let wep = w.get(&format!("{WEP_PREFIX}default/node1-k8s-race--{round}-eth0"));
        let listed: Vec<String> = wep["spec"]["ipNetworks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().trim_end_matches("/32").to_string())
            .collect();
        // Every address allocated to the handle, from the blocks themselves.
        let handle = format!("net1.{cid}");
        let mut held = Vec::new();
        for k in w.keys("/calico/ipam/v2/assignment/ipv4/") {
            let blk = w.get(&k);
            let base: std::net::Ipv4Addr = blk["cidr"]
                .as_str()
                .unwrap()
                .split('/')
                .next()
                .unwrap()
                .parse()
                .unwrap();
            for (o, a) in blk["allocations"].as_array().unwrap().iter().enumerate() {
                if let Some(i) = a.as_u64() {
                    if blk["attributes"][i as usize]["handle_id"] == handle.as_str() {
                        held.push(std::net::Ipv4Addr::from(u32::from(base) + o as u32).to_string());
                    }
                }
            }
        }
        for ip in &listed {
            assert!(
                held.contains(ip),
                "round {round}: the endpoint's {ip} is not allocated (held {held:?})"
            );
        }
        // The handle's count matches the blocks.
        let counted: i64 = w.get(&format!("/calico/ipam/v2/handle/{handle}"))["block"]
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_i64().unwrap())
            .sum();
        assert_eq!(counted as usize, held.len(), "round {round}");
        ok_fast(&w.calico(&inv.as_del(), &conf));
    }
    w.assert_clean();
}

/// Item 5: interface names that cannot make a WorkloadEndpoint name are refused before
/// IPAM (nothing allocated), and a DEL still releases what the container holds; `%` is
/// refused up front with a clear error.
#[test]
fn unusable_interface_names_leak_nothing() {
    let w = World::new();
    let conf = w.conf(json!({}));
    for (i, ifname) in ["-x", "trailing-"].into_iter().enumerate() {
        for k8s in [false, true] {
            let pod = w.pod();
            let cid = format!("dash{i}{}", u8::from(k8s));
            let mut inv = Invocation::new("ADD", &cid, pod.path()).ifname(ifname);
            if k8s {
                inv = inv.k8s("default", &format!("dash{i}"));
            }
            let err = fails_fast(&w.calico(&inv, &conf));
            let which = if ifname.starts_with('-') {
                "begin"
            } else {
                "end"
            };
            assert_eq!(
                err["msg"],
                format!("error constructing WorkloadEndpoint name: error with field endpoint = '{ifname}' (field must not {which} with a '-')")
            );
            w.assert_clean();
            // An address the container holds anyway (e.g. from an older plugin) is released
            // by DEL, although the name cannot be built.
            let held = Invocation::new("ADD", &cid, "/dev/null").via_calico();
            w.ipam(&held, &conf).assert_ok();
            assert_eq!(
                w.keys(&format!("/calico/ipam/v2/handle/net1.{cid}")).len(),
                1
            );
            ok_fast(&w.calico(&inv.as_del(), &conf));
            w.assert_clean();
        }
    }
    let pod = w.pod();
    let inv = Invocation::new("ADD", "pct", pod.path()).ifname("eth%d");
    let err = fails_fast(&w.calico(&inv, &conf));
    assert_eq!(err["code"], 4);
    assert_eq!(err["details"], "eth%d");
    assert!(err["msg"].as_str().unwrap().contains('%'));
    assert!(!pod.sh("ip -o link").contains("eth0"));
    w.assert_clean();
}

/// Item 6: the IPAM lock file is 0600 in a 0755 directory and the log file 0644 in 0755
/// directories, whatever the umask; a lock held by another process delays an ADD only by
/// the bounded wait.
#[test]
fn lock_and_log_files_are_private_and_the_lock_wait_is_bounded() {
    let w = World::new();
    let lock_dir = w.scratch.path().join("run").join("calico");
    let log_dir = w.scratch.path().join("log").join("cni");
    let conf = w.conf(json!({
        "ipam_lock_file": lock_dir.join("ipam.lock").display().to_string(),
        "log_file_path": log_dir.join("cni.log").display().to_string(),
    }));
    let pod = w.pod();
    let mut inv = Invocation::new("ADD", "modes1", pod.path());
    inv.prefix = Some("umask 000".into());
    ok_fast(&w.calico(&inv, &conf));
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&lock_dir.join("ipam.lock")), 0o600);
    assert_eq!(mode(&lock_dir), 0o755);
    assert_eq!(mode(lock_dir.parent().unwrap()), 0o755);
    assert_eq!(mode(&log_dir.join("cni.log")), 0o644);
    assert_eq!(mode(&log_dir), 0o755);
    // An unprivileged user cannot even open the lock file to hold it.
    let nobody = std::process::Command::new("runuser")
        .args(["-u", "nobody", "--", "flock", "-n"])
        .arg(lock_dir.join("ipam.lock"))
        .arg("true")
        .output()
        .unwrap();
    assert!(!nobody.status.success());
    assert!(
        String::from_utf8_lossy(&nobody.stderr).contains("Permission denied"),
        "{}",
        String::from_utf8_lossy(&nobody.stderr)
    );

    // Someone holds the lock and never lets go: the ADD waits ~10 s, then goes on.
    let file = std::fs::File::open(lock_dir.join("ipam.lock")).unwrap();
    let held = nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive).unwrap();
    let pod2 = w.pod();
    let out = w.calico(&Invocation::new("ADD", "modes2", pod2.path()), &conf);
    out.assert_ok();
    assert!(
        out.elapsed >= Duration::from_secs(9) && out.elapsed < Duration::from_secs(30),
        "took {:?}",
        out.elapsed
    );
    assert!(
        out.stderr.contains("continuing without it"),
        "{}",
        out.stderr
    );
    drop(held);
    ok_fast(&w.calico(&inv.as_del(), &conf));
    ok_fast(&w.calico(&Invocation::new("DEL", "modes2", pod2.path()), &conf));
    w.assert_clean();
}

/// Item 7: host-local with `subnet: usePodCidr` (or `usePodCidrIPv6` in `ranges`) on DEL:
/// the placeholder becomes 0.0.0.0/0 (::/0) for host-local, which releases by container ID.
#[test]
fn host_local_use_pod_cidr_on_del() {
    let w = World::new();
    let data = w.scratch.path().join("host-local");
    let add_conf = w.conf(
        json!({"ipam": {"type": "host-local", "subnet": "10.66.0.0/24",
        "dataDir": data.display().to_string()}}),
    );
    let del_conf = w.conf(
        json!({"ipam": {"type": "host-local", "subnet": "usePodCidr",
        "ranges": [[{"subnet": "usePodCidrIPv6"}]], "dataDir": data.display().to_string()}}),
    );
    let pod = w.pod();
    let inv = Invocation::new("ADD", "hlpod1", pod.path()).k8s("default", "hlpod");
    let out = w.calico(&inv, &add_conf);
    ok_fast(&out);
    let ip = out.json()["ips"][0]["address"]
        .as_str()
        .unwrap()
        .trim_end_matches("/32")
        .to_string();
    assert!(data.join("net1").join(&ip).exists());
    ok_fast(&w.calico(&inv.as_del(), &del_conf));
    assert!(
        !data.join("net1").join(&ip).exists(),
        "host-local released the address"
    );
    w.assert_clean();
}

/// Issue 37 (two regressions found by fuzzing): every path a call opens from its input is a
/// regular file, or a namespace, before anything opens it; a FIFO there never blocks a call.
/// `CNI_NETNS` (ADD, DEL, calico-ipam ADD and DEL: the same-netns check compares by `stat`),
/// `ipam_lock_file` (the calls go on unlocked and DEL leaves nothing), `nodename_file` (as an
/// unreadable file) and the etcd TLS files (refused with an error naming the path). Each call
/// ends within seconds, far from the deadline, and nothing is left behind.
#[test]
fn fifos_named_by_the_input_never_block_a_call() {
    let w = World::new();
    let fifo = |name: &str| {
        let p = w.scratch.path().join(name);
        nix::unistd::mkfifo(&p, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        p.display().to_string()
    };
    let quick = |out: &Outcome| {
        assert!(
            out.elapsed < Duration::from_secs(5),
            "took {:?}",
            out.elapsed
        );
    };

    // CNI_NETNS a FIFO.
    let netns = fifo("netns");
    let conf = w.conf(json!({}));
    let add = Invocation::new("ADD", "fifo-netns", &netns).k8s("default", "fifo-netns");
    let out = w.calico(&add, &conf);
    quick(&out);
    let err = out.assert_err();
    assert_eq!(err["code"], 999, "{err}");
    assert!(
        err["msg"]
            .as_str()
            .unwrap()
            .starts_with(&format!("unknown FS magic on {netns:?}: ")),
        "{err}"
    );
    // As upstream: a DEL that cannot enter the netns fails (and releases nothing; the ADD
    // left nothing to release).
    let out = w.calico(&add.as_del(), &conf);
    quick(&out);
    let err = out.assert_err();
    assert_eq!(
        err["msg"].as_str().unwrap(),
        format!("failed to enter netns: unknown FS magic on {netns:?}: ef53"),
        "{err}"
    );
    let ipam_add = Invocation::new("ADD", "fifo-ipam", &netns);
    let out = w.ipam(&ipam_add, &conf);
    quick(&out);
    out.assert_ok();
    let out = w.ipam(&ipam_add.as_del(), &conf);
    quick(&out);
    out.assert_ok();
    w.assert_clean();

    // ipam_lock_file a FIFO: no lock, and nothing left after the DEL.
    // An ADD then a DEL of a fresh pod: both succeed, quickly; the ADD's stderr.
    let add_then_del = |conf: &str, id: &str| {
        let pod = w.pod();
        let add = Invocation::new("ADD", id, pod.path()).k8s("default", id);
        let out = w.calico(&add, conf);
        quick(&out);
        out.assert_ok();
        let del = w.calico(&add.as_del(), conf);
        quick(&del);
        del.assert_ok();
        out.stderr
    };
    let stderr = add_then_del(
        &w.conf(json!({"ipam_lock_file": fifo("fifo.lock")})),
        "fifo-lock",
    );
    assert!(stderr.contains("not a regular file"), "{stderr}");
    w.assert_clean();

    // log_file_path a FIFO (no reader): nothing is written to it, the call goes on.
    let log_fifo = fifo("cni-fifo.log");
    let stderr = add_then_del(&w.conf(json!({"log_file_path": log_fifo})), "fifo-log");
    assert!(stderr.contains("not a regular file"), "{stderr}");
    assert!(std::fs::metadata(&log_fifo).unwrap().file_type().is_fifo());
    w.assert_clean();

    // nodename_file a FIFO: read as no file (the node name comes from `hostname`).
    let conf = w.conf(json!({
        "nodename": null,
        "nodename_file": fifo("nodename"),
        "hostname": NODE,
    }));
    add_then_del(&conf, "fifo-nodename");
    w.assert_clean();

    // The etcd TLS files FIFOs: an error naming the file.
    for field in ["etcd_ca_cert_file", "etcd_cert_file", "etcd_key_file"] {
        let path = fifo(field);
        let mut tls = json!({
            "etcd_ca_cert_file": w.scratch.path().join("none-ca").display().to_string(),
            "etcd_cert_file": w.scratch.path().join("none-cert").display().to_string(),
            "etcd_key_file": w.scratch.path().join("none-key").display().to_string(),
        });
        for f in ["none-ca", "none-cert", "none-key"] {
            std::fs::write(w.scratch.path().join(f), "").unwrap();
        }
        tls[field] = json!(path);
        let conf = w.conf(tls);
        let pod = w.pod();
        let out = w.calico(&Invocation::new("ADD", "fifo-tls", pod.path()), &conf);
        quick(&out);
        let err = out.assert_err();
        assert!(
            err.to_string()
                .contains(&format!("{path}: not a regular file")),
            "{field}: {err}"
        );
        w.assert_clean();
    }

    // The Kubernetes datastore: a FIFO as the kubeconfig, as a file the kubeconfig names, and
    // as the policy's certificate authority: refused before any request, naming the file.
    let kubeconfig = |ca: &str| {
        let p = w
            .scratch
            .path()
            .join(format!("kubeconfig-{}", ca.replace('/', "_")));
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: \
             https://127.0.0.1:1\n    certificate-authority: {ca}\nusers:\n- name: u\n  \
             user:\n    token: t\ncontexts:\n- name: x\n  context:\n    cluster: c\n    \
             user: u\ncurrent-context: x\n"
        );
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    };
    let ca_fifo = fifo("ca-fifo");
    let kc_fifo = fifo("kubeconfig-fifo");
    let empty_ca = w.scratch.path().join("none-ca").display().to_string();
    let kdd = json!({"datastore_type": "kubernetes"});
    let cases = [
        (
            kdd.clone(),
            json!({"kubeconfig": kc_fifo}),
            json!({}),
            &kc_fifo,
        ),
        (
            kdd,
            json!({"kubeconfig": kubeconfig(&ca_fifo)}),
            json!({}),
            &ca_fifo,
        ),
        // etcd for Calico's data, the policy's own client for the pod.
        (
            json!({}),
            json!({"kubeconfig": kubeconfig(&empty_ca)}),
            json!({"type": "k8s", "k8s_certificate_authority": ca_fifo}),
            &ca_fifo,
        ),
    ];
    for (datastore, kubernetes, policy, path) in cases {
        let mut extra = datastore;
        extra["kubernetes"] = kubernetes;
        extra["policy"] = policy;
        let conf = w.conf(extra);
        let pod = w.pod();
        let add = Invocation::new("ADD", "fifo-kdd", pod.path()).k8s("default", "fifo-kdd");
        let out = w.calico(&add, &conf);
        quick(&out);
        let err = out.assert_err();
        assert!(
            err.to_string()
                .contains(&format!("{path}: not a regular file")),
            "{path}: {err}"
        );
        w.assert_clean();
        assert!(!pod.has_link("eth0"));
    }
}
