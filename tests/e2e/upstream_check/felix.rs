//! Felix v3.32.1 on etcd, with the node's pods networked by ours and, as the control, by
//! upstream's plugin: Felix programs the same rules, ipsets and routes for both, a policy
//! denying one pod's traffic to the other is enforced and its removal restores traffic,
//! and after DEL Felix's state for the pod is gone. calicoctl reads the same endpoints,
//! profile and blocks from both.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::{calicoctl_ok, upstream, without_run_identity};
use crate::common::cni::{Bin, Invocation, TempDir};
use crate::common::netns::{ping_available, require_root, Netns};
use crate::common::world::World;

/// Felix in the world's host netns, in a mount namespace of its own where the node's
/// `/var/lib/calico` (Felix writes its MTU file there) is a scratch folder; its endpoint
/// status files go to another. Killed (by PID) on drop.
struct Felix {
    child: Child,
    log: PathBuf,
    status: TempDir,
    _lib: TempDir,
}

impl Felix {
    fn start_on_etcd(w: &World) -> Felix {
        let lib = TempDir::new("felix-lib");
        let status = TempDir::new("felix-status");
        let log = w.scratch.path().join("felix.log");
        std::fs::create_dir_all("/var/lib/calico").expect("mount point /var/lib/calico");
        let endpoint = w.etcd.endpoint();
        let env = [
            // Felix v3.32.1 connects with libcalico-go's variables (its FELIX_DATASTORETYPE
            // is not applied to the datastore connection).
            ("DATASTORE_TYPE", "etcdv3".to_string()),
            ("ETCD_ENDPOINTS", endpoint.clone()),
            ("FELIX_DATASTORETYPE", "etcdv3".into()),
            ("FELIX_ETCDENDPOINTS", endpoint),
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
        ];
        let script = format!(
            "mount --bind {} /var/lib/calico && exec {}",
            lib.path().display(),
            upstream("calico-felix").display()
        );
        let out = std::fs::File::create(&log).expect("felix log");
        let err = out.try_clone().expect("felix log");
        let child = Command::new("ip")
            .args(["netns", "exec", w.host.name()])
            .args([
                "unshare",
                "-m",
                "--propagation",
                "private",
                "sh",
                "-c",
                &script,
            ])
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .expect("spawn calico-felix");
        let felix = Felix {
            child,
            log,
            status,
            _lib: lib,
        };
        felix.wait_for("Felix's dataplane to be ready", || {
            readiness(w).is_some_and(|body| body.contains("InternalDataplaneMainLoop"))
                && felix
                    .log_text()
                    .contains("flushing the dataplane for the first time")
        });
        felix
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Felix's status file for a plain-CNI workload `cid` (it appears once the endpoint is
    /// programmed and up, and goes with the endpoint).
    fn status_file(&self, cid: &str) -> PathBuf {
        self.status
            .path()
            .join("endpoint-status")
            .join(format!("cni default%2F{cid} eth0"))
    }

    fn wait_for(&self, what: &str, mut done: impl FnMut() -> bool) {
        let start = Instant::now();
        while !done() {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "timed out waiting for {what}; Felix's log ends:\n{}",
                tail(&self.log_text(), 40)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Felix {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Felix's `/readiness` body, asked inside the host netns.
fn readiness(w: &World) -> Option<String> {
    w.host.run_in(|| {
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
#[derive(Debug, PartialEq)]
struct Run {
    /// Felix's dataplane with both pods, with the policy, after the second pod's DEL.
    dataplane: Vec<(&'static str, Value)>,
    /// calicoctl's view with both pods.
    calicoctl: Vec<(&'static str, Value)>,
}

/// One run with `bin`'s plugin; `None` when the plugin is ours.
fn run(bin: Option<Bin>) -> Run {
    let mut w = World::new();
    if let Some(bin) = bin {
        w.bin = bin;
    }
    let felix = Felix::start_on_etcd(&w);
    let ctl_env = [
        ("DATASTORE_TYPE", "etcdv3".to_string()),
        ("ETCD_ENDPOINTS", w.etcd.endpoint()),
    ];
    let conf = w.conf(json!({"mtu": 1500}));
    let (p1, p2) = (w.pod(), w.pod());
    let mut ips = Vec::new();
    for (cid, pod) in [("felix1", &p1), ("felix2", &p2)] {
        let out = w.calico(&Invocation::new("ADD", cid, pod.path()), &conf);
        out.assert_ok();
        let address = out.json()["ips"][0]["address"]
            .as_str()
            .expect("an address")
            .to_string();
        ips.push(address.split('/').next().unwrap_or_default().to_string());
        let status = felix.status_file(cid);
        felix.wait_for(&format!("{cid}'s status file"), || status.exists());
    }
    let (ip1, ip2) = (ips[0].clone(), ips[1].clone());
    let mut shown = Run {
        dataplane: vec![("two pods", dataplane(&w.host))],
        calicoctl: Vec::new(),
    };
    assert!(
        pings(&p2, &ip1) && pings(&p1, &ip2),
        "the pods reach each other"
    );

    let host = w.host.name().to_string();
    for (what, args) in [
        (
            "workloadendpoints",
            &["get", "workloadendpoints", "-o", "json"][..],
        ),
        ("profiles", &["get", "profiles", "-o", "json"]),
        ("blocks", &["ipam", "show", "--show-blocks"]),
    ] {
        let text = calicoctl_ok(&host, &ctl_env, args, "");
        let value = serde_json::from_str(&text).unwrap_or(Value::String(text));
        shown.calicoctl.push((what, without_run_identity(value)));
    }
    // (`calicoctl ipam check` compares with the Kubernetes API's pods: the real-cluster
    // suites run it.)

    // Ingress from pod 2 is denied everywhere; everything else passes on to the profile.
    let policy = json!({"apiVersion": "projectcalico.org/v3", "kind": "GlobalNetworkPolicy",
        "metadata": {"name": "deny-from-pod2"},
        "spec": {"selector": "all()", "types": ["Ingress"], "ingress": [
            {"action": "Deny", "source": {"nets": [format!("{ip2}/32")]}},
            {"action": "Pass"}]}});
    calicoctl_ok(&host, &ctl_env, &["apply", "-f", "-"], &policy.to_string());
    felix.wait_for("the policy to stop pod 2", || !pings(&p2, &ip1));
    assert!(pings(&p1, &ip2), "pod 1 still reaches pod 2");
    shown
        .dataplane
        .push(("with the policy", dataplane(&w.host)));
    calicoctl_ok(
        &host,
        &ctl_env,
        &["delete", "globalnetworkpolicy", "deny-from-pod2"],
        "",
    );
    felix.wait_for("pod 2 to reach pod 1 again", || pings(&p2, &ip1));

    let del2 = Invocation::new("DEL", "felix2", p2.path());
    w.calico(&del2, &conf).assert_ok();
    let status = felix.status_file("felix2");
    felix.wait_for("felix2's status file to go", || !status.exists());
    felix.wait_for("felix2's chains to go", || {
        !dataplane(&w.host).to_string().contains("califelix2")
    });
    shown
        .dataplane
        .push(("after pod 2's DEL", dataplane(&w.host)));
    let del1 = Invocation::new("DEL", "felix1", p1.path());
    w.calico(&del1, &conf).assert_ok();
    drop(felix);
    w.assert_clean();
    shown
}

#[test]
#[ignore = "needs upstream's binaries: make upstream-check"]
fn felix_programs_our_workloads_as_upstreams_on_etcd() {
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
        "ours differs from upstream's (- upstream, + ours):\n{}",
        differences.join("\n")
    );
    eprintln!(
        "felix on etcd: {} dataplane snapshots and {} calicoctl views identical",
        ours.dataplane.len(),
        ours.calicoctl.len()
    );
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
