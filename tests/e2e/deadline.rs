//! A deadline on every call: with etcd frozen (SIGSTOP) during ADD, during
//! DEL and with ADDs queued on the IPAM lock, and with an IPAM plugin that never answers,
//! every call of the real binary returns within its bound (the deadline, plus the grace for
//! an ADD's undo, plus start-up slack) with a CNI error, and once etcd is thawed nothing is
//! half-made: no veth, no route, no allocated address or handle, no WorkloadEndpoint.
//!
//! The calls run with `call_timeout_seconds: 3` so the suite stays fast.

use std::time::{Duration, Instant};

use crate::common;
use crate::common::cni::{Invocation, Outcome};
use crate::common::world::{World, NODE};
use nix::fcntl::{Flock, FlockArg};
use serde_json::{json, Value};

/// The budget the calls are given.
const BUDGET: Duration = Duration::from_secs(3);
/// `calico_cni::support::deadline::GRACE`: how long an ADD's undo may run past the deadline.
const GRACE: Duration = calico_cni::support::deadline::GRACE;
/// Process start, `ip netns exec` and a loaded two-core machine.
const SLACK: Duration = Duration::from_secs(2);

/// What an ADD may take at most.
fn add_bound() -> Duration {
    BUDGET + GRACE + SLACK
}

/// What a DEL may take at most (no undo, no grace).
fn del_bound() -> Duration {
    BUDGET + SLACK
}

const LOCK_WAIT_LINE: &str = "About to acquire host-wide IPAM lock.";

fn conf(w: &World) -> String {
    w.conf(json!({"call_timeout_seconds": BUDGET.as_secs()}))
}

fn log_count(w: &World, needle: &str) -> usize {
    std::fs::read_to_string(w.scratch.path().join("cni.log"))
        .unwrap_or_default()
        .matches(needle)
        .count()
}

/// Waits until the shared log file holds `n` lines with `needle`.
fn wait_for_log(w: &World, needle: &str, n: usize) {
    let until = Instant::now() + Duration::from_secs(30);
    while log_count(w, needle) < n {
        assert!(Instant::now() < until, "never logged {n}× {needle:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Holds this world's IPAM lock (as a stuck call would) until dropped.
fn hold_lock(w: &World) -> Flock<std::fs::File> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(w.scratch.path().join("ipam.lock"))
        .unwrap();
    Flock::lock(file, FlockArg::LockExclusive).unwrap()
}

/// The call ended within `bound` with a code-11 deadline error; returns it.
fn expired(out: &Outcome, bound: Duration, what: &str) -> Value {
    eprintln!("{what}: {:?}", out.elapsed);
    assert!(
        out.elapsed < bound,
        "{what} took {:?} (bound {bound:?}); stderr: {}",
        out.elapsed,
        out.stderr
    );
    let err = out.assert_err();
    assert_eq!(err["code"], 11, "{what}: {err}");
    let msg = err["msg"].as_str().unwrap();
    assert!(
        msg.starts_with(
            "calico: the call took longer than its deadline of 3s (call_timeout_seconds) while "
        ),
        "{what}: {err}"
    );
    err
}

/// No pod interface, no host veth or route: what the dataplane undo leaves (`others`: how
/// many other pods of the test keep theirs).
fn assert_no_interfaces(w: &World, pods: &[&common::netns::Netns], others: usize) {
    for pod in pods {
        assert!(!pod.has_link("eth0"), "pod {} kept eth0", pod.name());
    }
    let links = w.host_sh("ip -o link show");
    assert_eq!(
        links.matches(": cali").count(),
        others,
        "veth left: {links}"
    );
    let routes = w.host_sh("ip route show");
    assert_eq!(
        routes.matches("10.65.").count(),
        others,
        "route left: {routes}"
    );
}

/// etcd frozen right after the claim's first write (the block affinity): the ADD ends at its
/// deadline with a clear error, and nothing of the pod exists.
#[test]
fn an_add_frozen_mid_claim_ends_at_its_deadline_and_leaves_nothing() {
    for k8s in [false, true] {
        let w = World::new();
        let conf = conf(&w);
        let pod = w.pod();
        let mut inv = Invocation::new("ADD", "frozen1", pod.path());
        if k8s {
            inv = inv.k8s("default", "frozen1");
        }
        let trap = w
            .etcd
            .freeze_on_write(&format!("/calico/ipam/v2/host/{NODE}/"));
        let out = w.calico(&inv, &conf);
        assert!(trap.fired(), "the claim never wrote an affinity");
        let err = expired(&out, add_bound(), &format!("ADD mid-claim (k8s {k8s})"));
        assert!(
            err["msg"].as_str().unwrap().contains("waiting for etcd"),
            "{err}"
        );
        assert!(out.elapsed >= BUDGET - Duration::from_millis(500));
        assert_no_interfaces(&w, &[&pod], 0);
        w.etcd.thaw();
        w.assert_clean();
    }
}

/// etcd frozen by the pod's address assignment, so the endpoint write hangs after the veth
/// is up: the ADD fails at its deadline and undoes within the grace. etcd comes back during
/// the grace, so the undo gives back the address too. (The endpoint create that etcd held
/// unanswered may still be applied when it comes back; the DEL the runtime sends after a
/// failed ADD removes it.)
#[test]
fn the_undo_of_an_add_runs_in_the_grace() {
    let w = World::new();
    let conf = conf(&w);
    // A first pod claims the node's block, so the next pod's first write under the blocks'
    // prefix is its assignment.
    let first = w.pod();
    let first_inv = Invocation::new("ADD", "warm1", first.path()).k8s("default", "warm1");
    w.calico(&first_inv, &conf).assert_ok();

    // The freeze races with the assignment's answer: a round where etcd froze before the
    // ADD had it (the ADD then fails in IPAM, before any interface), or only after the ADD
    // was done, is cleaned up and rerun.
    for round in 0..10 {
        let pod = w.pod();
        let cid = format!("undo{round}");
        let inv = Invocation::new("ADD", &cid, pod.path()).k8s("default", &cid);
        let wep_write = format!("workloadendpoints/default/node1-k8s-{cid}-eth0)");
        let trap = w.etcd.freeze_on_write("/calico/ipam/v2/assignment/");
        let (out, reached) = std::thread::scope(|s| {
            let add = s.spawn(|| w.calico(&inv, &conf));
            // The endpoint write expires at the deadline; the undo then waits for etcd.
            let reached = loop {
                if log_count(&w, &wep_write) > 0 {
                    break true;
                }
                if add.is_finished() {
                    break false;
                }
                std::thread::sleep(Duration::from_millis(10));
            };
            // The undo removes the pod interface first, then waits for etcd (the endpoint's
            // read, the addresses' release): thaw once the interface is gone.
            let until = Instant::now() + Duration::from_secs(10);
            while reached && pod.has_link("eth0") && !add.is_finished() {
                assert!(
                    Instant::now() < until,
                    "round {round}: the undo did not remove the pod interface"
                );
                std::thread::sleep(Duration::from_millis(10));
            }
            w.etcd.thaw();
            (add.join().unwrap(), reached)
        });
        assert!(trap.fired());
        if !reached && out.code == 0 {
            // The freeze came after the endpoint's write was answered (it goes out as soon
            // as the pair has its MAC, alongside the routes).
            eprintln!("round {round}: etcd froze after the ADD was done; again");
            w.calico(&inv.as_del(), &conf).assert_ok();
            continue;
        }
        if !reached {
            eprintln!("round {round}: etcd froze before the assignment was answered; again");
            expired(&out, add_bound(), "ADD frozen in IPAM");
            w.calico(&inv.as_del(), &conf).assert_ok();
            continue;
        }
        let err = expired(&out, add_bound(), "ADD undone in the grace");
        assert!(
            err["msg"].as_str().unwrap().contains("workloadendpoints"),
            "{err}"
        );
        assert!(out.elapsed >= BUDGET, "{:?}", out.elapsed);
        assert_no_interfaces(&w, &[&pod], 1);
        // The address and the handle were given back during the grace: the first pod's is
        // the only address allocated.
        assert_eq!(
            w.keys("/calico/ipam/v2/handle/"),
            vec!["/calico/ipam/v2/handle/net1.warm1"]
        );
        let allocated: usize = w
            .keys("/calico/ipam/v2/assignment/")
            .iter()
            .map(|k| {
                w.get(k)["allocations"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .filter(|a| !a.is_null())
                    .count()
            })
            .sum();
        assert_eq!(allocated, 1);
        w.calico(&inv.as_del(), &conf).assert_ok();
        w.calico(&first_inv.as_del(), &conf).assert_ok();
        w.assert_clean();
        return;
    }
    panic!("in every round etcd froze too early (before the assignment was answered) or too late (after the ADD was done)");
}

/// Six ADDs queued on the node's IPAM lock while the holder's claim hangs on a frozen etcd:
/// each ends at its own deadline (the lock wait is cut there), none waits for the others.
#[test]
fn adds_queued_on_the_ipam_lock_each_end_at_their_deadline() {
    let w = World::new();
    let conf = conf(&w);
    let pods: Vec<_> = (0..6).map(|_| w.pod()).collect();
    let held = hold_lock(&w);
    let trap = w
        .etcd
        .freeze_on_write(&format!("/calico/ipam/v2/host/{NODE}/"));
    let outs = std::thread::scope(|s| {
        let adds: Vec<_> = pods
            .iter()
            .enumerate()
            .map(|(i, pod)| {
                let inv = Invocation::new("ADD", &format!("queued{i}"), pod.path())
                    .k8s("default", &format!("queued{i}"));
                let (w, conf) = (&w, &conf);
                s.spawn(move || w.calico(&inv, conf))
            })
            .collect();
        wait_for_log(&w, LOCK_WAIT_LINE, pods.len());
        drop(held);
        adds.into_iter()
            .map(|a| a.join().unwrap())
            .collect::<Vec<_>>()
    });
    assert!(trap.fired());
    for (i, out) in outs.iter().enumerate() {
        expired(out, add_bound(), &format!("queued ADD {i}"));
    }
    let pod_refs: Vec<_> = pods.iter().collect();
    assert_no_interfaces(&w, &pod_refs, 0);
    w.etcd.thaw();
    w.assert_clean();
}

/// DEL with etcd frozen after its ready gate (while it waits for the IPAM lock): it ends at
/// its deadline, still removes the interface, goes on past the failed release to the
/// endpoint delete, and reports both failures in one error. A retried DEL finishes the job.
#[test]
fn a_del_under_a_frozen_etcd_ends_at_its_deadline_and_reports_every_step() {
    let w = World::new();
    let conf = conf(&w);
    let pod = w.pod();
    let inv = Invocation::new("ADD", "del1", pod.path());
    w.calico(&inv, &conf).assert_ok();
    let held = hold_lock(&w);
    let waits = log_count(&w, LOCK_WAIT_LINE);
    let out = std::thread::scope(|s| {
        let del = s.spawn(|| w.calico(&inv.as_del(), &conf));
        wait_for_log(&w, LOCK_WAIT_LINE, waits + 1);
        w.etcd.freeze();
        drop(held);
        del.join().unwrap()
    });
    let err = expired(&out, del_bound(), "DEL, etcd frozen");
    let msg = err["msg"].as_str().unwrap();
    let parts: Vec<&str> = msg.split("; ").collect();
    assert_eq!(parts.len(), 2, "{msg}");
    // The handles were read before the lock was taken: the release stops at the block.
    assert!(
        parts[0].contains("/calico/ipam/v2/assignment/ipv4/block/"),
        "{msg}"
    );
    assert!(
        parts[1].contains("workloadendpoints/default/node1-cni-del1-eth0"),
        "{msg}"
    );
    assert_no_interfaces(&w, &[&pod], 0);
    w.etcd.thaw();
    // The runtime retries the DEL: it releases what is left.
    w.calico(&inv.as_del(), &conf).assert_ok();
    w.assert_clean();
}

/// k8s DEL with etcd frozen from the start: it ends at its deadline having touched nothing
/// (as upstream, which removes nothing before the endpoint is read). The retry after the
/// thaw does it all; a second one finds nothing left.
#[test]
fn a_k8s_del_touches_nothing_when_etcd_never_answers() {
    let w = World::new();
    let conf = conf(&w);
    let pod = w.pod();
    let inv = Invocation::new("ADD", "del2", pod.path()).k8s("default", "del2");
    w.calico(&inv, &conf).assert_ok();
    w.etcd.freeze();
    let out = w.calico(&inv.as_del(), &conf);
    expired(&out, del_bound(), "k8s DEL, etcd frozen");
    assert!(pod.has_link("eth0"), "the interface was removed");
    w.etcd.thaw();
    w.calico(&inv.as_del(), &conf).assert_ok();
    w.calico(&inv.as_del(), &conf).assert_ok();
    w.assert_clean();
}

/// An IPAM plugin that never answers is killed (and reaped) at the deadline, which the
/// environment sets here (it wins over `call_timeout_seconds`); the plugin was given what
/// was left of the budget minus the grace, to finish its own undo in.
#[test]
fn a_hung_ipam_plugin_is_killed_at_the_deadline() {
    let w = World::new();
    let marks = w.scratch.path();
    let script = w.bin.plugin("hung-ipam");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\necho $$ > {0}/hung.pid\necho \"$CALICO_CALL_TIMEOUT_SECONDS\" > {0}/hung.budget\nexec sleep 600\n",
            marks.display()
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let conf = w.conf(json!({"call_timeout_seconds": 20, "ipam": {"type": "hung-ipam"}}));
    let pod = w.pod();
    let mut inv = Invocation::new("ADD", "hung1", pod.path()).k8s("default", "hung1");
    inv.extra_env = vec![("CALICO_CALL_TIMEOUT_SECONDS".into(), "6".into())];
    let out = w.calico(&inv, &conf);
    eprintln!("ADD, hung IPAM plugin: {:?}", out.elapsed);
    let budget = Duration::from_secs(6);
    assert!(out.elapsed >= budget, "took {:?}", out.elapsed);
    assert!(out.elapsed < budget + SLACK, "took {:?}", out.elapsed);
    let err = out.assert_err();
    assert_eq!(err["code"], 11, "{err}");
    assert!(
        err["msg"].as_str().unwrap().starts_with(
            "calico: the call took longer than its deadline of 6s (CALICO_CALL_TIMEOUT_SECONDS) while running the IPAM plugin"
        ),
        "{err}"
    );
    let read = |f: &str| {
        std::fs::read_to_string(marks.join(f))
            .unwrap()
            .trim()
            .to_string()
    };
    let given: u64 = read("hung.budget").parse().unwrap();
    // What was left (just under 6 s) minus the grace, in whole seconds.
    assert_eq!(given, 2, "the plugin was given {given}s");
    let pid = read("hung.pid");
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "the hung plugin {pid} is still there"
    );
    assert_no_interfaces(&w, &[&pod], 0);
    w.assert_clean();
}

/// The Kubernetes datastore: a stalled API server (requests read, never answered) and a slow
/// one (every answer 1 s late, each request well within its own 5 s timeout, but their sum
/// not within the budget). ADD and DEL end within their bounds with the deadline error.
#[test]
fn kdd_calls_end_at_their_deadline_on_a_stalled_or_slow_api_server() {
    let w = common::kdd::KddWorld::new();
    let conf = w.conf(json!({"call_timeout_seconds": BUDGET.as_secs()}));
    for (i, slow) in [false, true].into_iter().enumerate() {
        let name = format!("kdd{i}");
        w.seed_pod("default", &name, json!({}));
        let pod = common::netns::Netns::new("pod");
        let inv = Invocation::new("ADD", &format!("kddcid{i}"), pod.path()).k8s("default", &name);
        let what = if slow { "slow" } else { "stalled" };
        if slow {
            // Every answer 2 s late: any call needing two round trips (an ADD, a DEL) is
            // past its 3 s budget.
            w.api.set_latency(Duration::from_secs(2));
        } else {
            w.api.set_stall(true);
        }
        let err = expired(
            &w.calico(&inv, &conf),
            add_bound(),
            &format!("KDD ADD, {what}"),
        );
        assert!(
            err["msg"]
                .as_str()
                .unwrap()
                .contains("waiting for the Kubernetes API server"),
            "{err}"
        );
        assert!(!pod.has_link("eth0"));
        expired(
            &w.calico(&inv.as_del(), &conf),
            del_bound(),
            &format!("KDD DEL, {what}"),
        );
        w.api.set_stall(false);
        w.api.set_latency(Duration::ZERO);
        w.calico(&inv.as_del(), &conf).assert_ok();
        w.assert_clean();
    }
}
