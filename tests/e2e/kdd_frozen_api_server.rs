//! A real kube-apiserver frozen (SIGSTOP) in the middle of an ADD, just before each of the
//! ADD's writes (when the audit log shows the request before it answered): the plugin gives
//! up at its deadline (its undo too, after the grace) while its next request waits in the
//! kernel; after the thaw the server handles what it still can of what was queued (here it
//! answers those requests 504 or 500: the client is gone). A failed ADD may leave what the
//! runtime's DEL then removes: an allocation with its handle, the pod's podIP annotation, a
//! handle counting an address its block does not hold, or a block holding an address for a
//! handle that does not count it, recorded as pending in the IPAM lock file's journal before
//! the two were written together (`Journal::intend`): the DEL looks there. Never state DEL
//! cannot clean: an address a block holds for a handle that does not count it with no such
//! record, or anything left after the DEL. The same holds when the plugin is killed
//! (SIGKILL) at each of those points instead of giving up at its deadline.
//!
//! Thawed after the call, the queued request's client is gone and the server answers it 504
//! without applying it. Thawed during the undo's grace (the plugin still connected), the
//! request the plugin gave up on is answered 504 too, and the undo's own requests go
//! through. Either way the one thing left until the DEL is the handle above: the allocator,
//! its block write gone unanswered at the deadline, cannot tell whether that write landed,
//! so it keeps the handle (over-counting, which DEL cleans) rather than decrement it and
//! risk an address no handle counts (which no DEL could find) should the write land later.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::common;
use crate::common::cluster::{block_allocations, Cluster};
use crate::common::cni::{Invocation, Outcome};
use crate::common::kdd::{RealKddWorld, CRD};
use crate::common::netns::{require_root, Netns};
use crate::common::real_k8s::Audited;
use serde_json::json;

/// The call's deadline: the frozen ADD gives up after it (and its undo after the grace).
const BUDGET_SECS: u64 = 3;

/// Makes the cluster as it was before the first ADD: no block, affinity or IPAMConfig.
fn forget_ipam(w: &RealKddWorld) {
    for plural in ["blockaffinities", "ipamblocks", "ipamconfigs"] {
        for o in w.crs(plural) {
            let name = o["metadata"]["name"].as_str().unwrap();
            w.api.remove(&format!("{CRD}/{plural}/{name}"));
        }
    }
}

/// (handles counting more addresses in a block than it holds for them, addresses a block
/// holds for a handle that does not count them). DEL releases by handle: the first is
/// cleaned by it; the second only where the IPAM lock file (`lock`) records the block as
/// pending for the handle (a handle written beside its block, `Journal::intend`): those are
/// the third list, the rest the second.
fn disagreements(w: &RealKddWorld, lock: &Path) -> (Vec<String>, Vec<String>, Vec<String>) {
    let journal = std::fs::read_to_string(lock).unwrap_or_default();
    let mut held: BTreeMap<(String, String), u64> = BTreeMap::new();
    for b in w.blocks() {
        let cidr = b["cidr"].as_str().unwrap().to_string();
        for a in block_allocations(&b) {
            *held.entry((a.handle, cidr.clone())).or_insert(0) += 1;
        }
    }
    let mut counted: BTreeMap<(String, String), u64> = BTreeMap::new();
    for h in w.crs("ipamhandles") {
        let id = h["spec"]["handleID"].as_str().unwrap().to_string();
        for (cidr, n) in h["spec"]["block"].as_object().cloned().unwrap_or_default() {
            counted.insert((id.clone(), cidr), n.as_u64().unwrap_or(0));
        }
    }
    let (mut over, mut under) = (vec![], vec![]);
    for (key, n) in &counted {
        let have = held.get(key).copied().unwrap_or(0);
        if have < *n {
            over.push(format!(
                "handle {} counts {n} in {}, the block holds {have}",
                key.0, key.1
            ));
        }
    }
    let mut pending = vec![];
    for (key, n) in &held {
        let c = counted.get(key).copied().unwrap_or(0);
        if c < *n {
            let d = format!(
                "block {} holds {n} for {}, whose handle counts {c}",
                key.1, key.0
            );
            let record = format!("pending {} {}", key.0, key.1);
            match journal.lines().any(|l| l == record) {
                true => pending.push(d),
                false => under.push(d),
            }
        }
    }
    (over, pending, under)
}

/// What a pod's ADD left: handles, allocations, the pod's address annotation.
fn leftovers(w: &RealKddWorld, pod: &str) -> String {
    let pod_ip = w.pod_object("default", pod)["metadata"]["annotations"]
        ["cni.projectcalico.org/podIP"]
        .clone();
    format!(
        "handles {:?}, allocations {:?}, podIP {pod_ip}",
        w.handles(),
        w.allocated()
            .iter()
            .map(|a| format!("{} {}", a.ip, a.handle))
            .collect::<Vec<_>>()
    )
}

/// The ADD started and, once the trap has frozen the server, killed with SIGKILL (an ADD
/// that finishes first is left to finish); its outcome (-9: killed).
fn killed_when_frozen(
    w: &RealKddWorld,
    trap: &common::real_k8s::FreezeTrap,
    inv: &Invocation,
    conf: &str,
) -> Outcome {
    let started = Instant::now();
    let mut child = w.bin.spawn("calico", w.host.name(), inv, conf);
    loop {
        if let Some(status) = child.try_wait().expect("wait for the plugin") {
            return Outcome {
                code: status.code().unwrap_or(-1),
                stdout: String::new(),
                stderr: String::new(),
                elapsed: started.elapsed(),
            };
        }
        if trap.fired() {
            // SAFETY: kill(2) on the PID this test spawned, not yet reaped.
            unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
            let status = child.wait().expect("reap the plugin");
            assert_eq!(
                std::os::unix::process::ExitStatusExt::signal(&status),
                Some(libc::SIGKILL)
            );
            return Outcome {
                code: -9,
                stdout: String::new(),
                stderr: String::new(),
                elapsed: started.elapsed(),
            };
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the ADD neither finished nor reached the freeze"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Once the thawed server has handled (or dropped) what the plugin, now gone, left queued:
/// the plugin's requests since `mark`. Its connections are closed on its side; the server
/// holds each in CLOSE_WAIT until it has read it to the end (every request in it
/// dispatched) and closed it. Then the plugin's audited requests must stay the same from
/// one audit marker to the next (each marker a request the server answers, and logs, after
/// what it answered before).
fn handled_after_the_thaw(w: &RealKddWorld, mark: usize) -> Vec<Audited> {
    let until = Instant::now() + Duration::from_secs(30);
    let closing = format!("ss -Htn state close-wait '( sport = :{} )'", w.api.port());
    loop {
        let held = w.host.sh(&closing);
        if held.trim().is_empty() {
            break;
        }
        assert!(
            Instant::now() < until,
            "30 s after the thaw the API server still holds closed connections:\n{held}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut reqs = w.api.plugin_requests_since(mark);
    loop {
        let again = w.api.plugin_requests_since(mark);
        if again.len() == reqs.len() {
            return again;
        }
        assert!(
            Instant::now() < until,
            "30 s after the thaw the plugin's requests still land: {}",
            listing(&again)
        );
        reqs = again;
    }
}

/// The positions of the writes among `reqs` (how many requests were answered before each).
fn write_positions(reqs: &[Audited]) -> Vec<usize> {
    reqs.iter()
        .enumerate()
        .filter(|(_, q)| q.is_write())
        .map(|(i, _)| i)
        .collect()
}

fn listing(reqs: &[Audited]) -> String {
    reqs.iter()
        .map(Audited::line)
        .collect::<Vec<_>>()
        .join(", ")
}

/// When the frozen server is thawed.
#[derive(Clone, Copy, Debug)]
enum Thaw {
    /// After the plugin has exited (its connection closed).
    AfterTheCall,
    /// After the plugin was killed (SIGKILL) while the server was frozen: nothing of the
    /// plugin's runs after that point, not its undo either.
    AfterASigkill,
    /// This long after the call started: past its deadline, while its undo waits (the
    /// grace), with the connection open.
    DuringTheUndo(Duration),
}

#[test]
fn kdd_add_with_the_api_server_frozen_at_each_write() {
    frozen_at_each_write(
        "kdd_add_with_the_api_server_frozen_at_each_write",
        Thaw::AfterTheCall,
    );
}

/// A SIGKILL at each write (the server frozen there, so that the kill lands between two
/// writes, or between the two halves of a pair sent together), then the runtime's DEL.
#[test]
fn kdd_add_killed_at_each_write() {
    frozen_at_each_write("kdd_add_killed_at_each_write", Thaw::AfterASigkill);
}

#[test]
fn kdd_add_with_the_api_server_frozen_at_each_write_and_thawed_during_the_undo() {
    frozen_at_each_write(
        "kdd_add_with_the_api_server_frozen_at_each_write_and_thawed_during_the_undo",
        Thaw::DuringTheUndo(Duration::from_millis(BUDGET_SECS * 1000 + 1000)),
    );
}

/// A DEL killed (SIGKILL) at each of its writes (the server frozen once the request before
/// it is answered, so that the kill lands between two writes, or between the writes sent
/// together: the endpoint's, the block's and the handle's), then the runtime's retried DEL.
/// Before the retry no address is held without its handle counting it or a record in the
/// IPAM lock file's journal leading to it; after it nothing is left.
#[test]
fn kdd_del_killed_at_each_write() {
    require_root();
    let Some(w) = RealKddWorld::real_or_skip("kdd_del_killed_at_each_write") else {
        return;
    };
    let lock = w.scratch.path().join("ipam-del.lock");
    let conf = w.conf(json!({"call_timeout_seconds": BUDGET_SECS,
        "ipam_lock_file": lock.display().to_string()}));
    // A pod that stays keeps the block and its affinity whatever the DELs do.
    w.seed_pod("default", "stays", json!({}));
    let stays = Netns::new("pod");
    let stays_inv = Invocation::new("ADD", "stays0000001", stays.path()).k8s("default", "stays");
    w.calico(&stays_inv, &conf).assert_ok();

    // An unfrozen ADD and DEL: which of the DEL's requests are writes.
    w.seed_pod("default", "base", json!({}));
    let pod = Netns::new("pod");
    let inv = Invocation::new("ADD", "base00000001", pod.path()).k8s("default", "base");
    w.calico(&inv, &conf).assert_ok();
    let mark = w.api.audit_mark();
    w.calico(&inv.as_del(), &conf).assert_ok();
    let base = w.api.plugin_requests_since(mark);
    eprintln!("the DEL's requests: {}", listing(&base));
    let before_writes = write_positions(&base);
    assert!(before_writes.len() >= 3, "{}", listing(&base));

    let mut findings = vec![];
    for (n, &k) in before_writes.iter().enumerate() {
        let name = format!("killdel{n}");
        w.seed_pod("default", &name, json!({}));
        let pod = Netns::new("pod");
        let cid = format!("killdel{n:05}");
        let inv = Invocation::new("ADD", &cid, pod.path()).k8s("default", &name);
        w.calico(&inv, &conf).assert_ok();
        let mark = w.api.audit_mark();
        let trap = w.api.freeze_after_plugin_requests(k);
        let out = killed_when_frozen(&w, &trap, &inv.as_del(), &conf);
        let fired = trap.fired();
        drop(trap);
        w.api.thaw();
        let reqs = handled_after_the_thaw(&w, mark);
        let what = format!(
            "frozen after {k} requests (before write {}: {})",
            n + 1,
            base[k].line()
        );
        eprintln!("{what}; fired {fired}; requests {}", listing(&reqs));
        eprintln!("  left: {}", leftovers(&w, &name));
        if !fired {
            out.assert_ok();
        }
        let (_, _, under) = disagreements(&w, &lock);
        for d in under {
            findings.push(format!("{what}: {d}"));
        }
        w.calico(&inv.as_del(), &conf).assert_ok();
        let journal = std::fs::read_to_string(&lock).unwrap_or_default();
        if journal.contains(&cid) {
            findings.push(format!(
                "{what}: the retried DEL left its record: {journal}"
            ));
        }
        w.api
            .remove(&format!("/api/v1/namespaces/default/pods/{name}"));
    }
    w.calico(&stays_inv.as_del(), &conf).assert_ok();
    w.assert_clean();
    assert!(findings.is_empty(), "{}", findings.join("\n"));
}

fn frozen_at_each_write(test: &str, thaw: Thaw) {
    require_root();
    let Some(w) = RealKddWorld::real_or_skip(test) else {
        return;
    };
    let conf = |n: usize| {
        let lock = w.scratch.path().join(format!("ipam-{n}.lock"));
        w.conf(json!({"call_timeout_seconds": BUDGET_SECS,
            "ipam_lock_file": lock.display().to_string()}))
    };

    // The unfrozen ADD (the first on this node: it claims a block): which of its requests
    // are writes.
    w.seed_pod("default", "base", json!({}));
    let pod = Netns::new("pod");
    let inv = Invocation::new("ADD", "base00000001", pod.path()).k8s("default", "base");
    let mark = w.api.audit_mark();
    w.calico(&inv, &conf(0)).assert_ok();
    let base = w.api.plugin_requests_since(mark);
    w.calico(&inv.as_del(), &conf(0)).assert_ok();
    w.assert_clean();
    forget_ipam(&w);
    eprintln!("the ADD's requests: {}", listing(&base));
    // Before each write, the number of requests answered.
    let before_writes = write_positions(&base);
    assert!(before_writes.len() >= 3, "{}", listing(&base));

    let (mut findings, mut over_counted) = (vec![], 0);
    for (n, &k) in before_writes.iter().enumerate() {
        let name = format!("frozen{n}");
        w.seed_pod("default", &name, json!({}));
        let pod = Netns::new("pod");
        let cid = format!("frozen{n:06}");
        let inv = Invocation::new("ADD", &cid, pod.path()).k8s("default", &name);
        let conf = conf(n + 1);
        let mark = w.api.audit_mark();
        let trap = w.api.freeze_after_plugin_requests(k);
        let out = match thaw {
            Thaw::AfterASigkill => killed_when_frozen(&w, &trap, &inv, &conf),
            _ => std::thread::scope(|s| {
                if let Thaw::DuringTheUndo(after) = thaw {
                    let api = &w.api;
                    s.spawn(move || {
                        std::thread::sleep(after);
                        api.thaw();
                    });
                }
                w.calico(&inv, &conf)
            }),
        };
        let fired = trap.fired();
        drop(trap);
        w.api.thaw();
        let reqs = handled_after_the_thaw(&w, mark);
        let what = format!(
            "frozen after {k} requests (before write {}: {}): ADD {}",
            n + 1,
            base[k].line(),
            if out.code == 0 { "succeeded" } else { "failed" }
        );
        eprintln!(
            "{what}; fired {fired}, thawed {thaw:?}; requests {}",
            listing(&reqs)
        );
        eprintln!("  left: {}", leftovers(&w, &name));
        if !fired {
            // The ADD made fewer requests this time: it must have succeeded.
            out.assert_ok();
        }
        let lock = w.scratch.path().join(format!("ipam-{}.lock", n + 1));
        let (over, pending, under) = disagreements(&w, &lock);
        for d in over.iter().chain(&pending) {
            eprintln!("  until DEL: {d}");
        }
        over_counted += over.len() + pending.len();
        for d in under {
            findings.push(format!("{what}: {d}"));
        }
        // The runtime's DEL removes whatever was left.
        w.calico(&inv.as_del(), &conf).assert_ok();
        w.assert_clean();
        w.api
            .remove(&format!("/api/v1/namespaces/default/pods/{name}"));
        forget_ipam(&w);
    }
    eprintln!(
        "{} freezes; {over_counted} left a handle counting an address its block does not \
         hold, until the DEL",
        before_writes.len()
    );
    assert!(findings.is_empty(), "{}", findings.join("\n"));
}
