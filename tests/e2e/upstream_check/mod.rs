//! `make upstream-check`: the rest of Calico v3.32.1 acting on what ours writes, each test run
//! once with our plugin and once with upstream's as the control, in fresh worlds.
//!
//! Every test here needs upstream's own binaries, built from its source outside this
//! repository (nothing of it is in the repository): `CALICO_UPSTREAM_BIN` names their folder
//! (`calico`, `calicoctl`, `calico-felix`, ...). They are `#[ignore]`d, so `make test` never
//! runs them; `make upstream-check` does, and fails, saying what is missing, when the folder
//! or a binary is not there. Felix execs `ipset`, `nft`, `conntrack` and the iptables tools:
//! `make upstream-check` installs them.
//!
//! - `felix`: Felix on etcd programs our workloads as it programs upstream's (the same
//!   iptables rules, ipsets and routes), enforces a policy on them, and forgets them after
//!   DEL; calicoctl reads the same endpoints, blocks and profile from both.
//! - `kube_controllers`: its IPAM garbage collection releases what ours leaks, and only that.
//! - `swap`: two nodes set up by upstream's `install`, one swapped to ours while its pods run
//!   and rolled back, on the Kubernetes datastore and on etcd.

mod felix;
mod kube_controllers;
mod swap;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::common::netns::Netns;

use serde_json::Value;

/// The folder of upstream's v3.32.1 binaries and one of them, or a panic that says how to
/// give it.
pub fn upstream(binary: &str) -> PathBuf {
    let Some(dir) = std::env::var_os("CALICO_UPSTREAM_BIN") else {
        panic!(
            "CALICO_UPSTREAM_BIN is not set: make upstream-check needs a folder holding \
             upstream Calico v3.32.1's binaries (calico, calicoctl, calico-felix), built from \
             its source outside this repository"
        );
    };
    let path = PathBuf::from(dir).join(binary);
    assert!(
        path.is_file(),
        "{} is missing: CALICO_UPSTREAM_BIN must hold upstream v3.32.1's {binary}",
        path.display()
    );
    path
}

/// Upstream's `calicoctl` in `netns`, on the datastore `env` names; its output.
pub fn calicoctl(netns: &str, env: &[(&str, String)], args: &[&str], stdin: &str) -> Output {
    use std::io::Write;
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", netns])
        .arg(upstream("calicoctl"))
        .args(args)
        // The worlds' ClusterInformation names calico/node's version, not calicoctl's.
        .arg("--allow-version-mismatch")
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("spawn calicoctl");
    if let Some(mut s) = child.stdin.take() {
        let _ = s.write_all(stdin.as_bytes());
    }
    child.wait_with_output().expect("calicoctl")
}

/// `calicoctl` that must succeed: its stdout.
pub fn calicoctl_ok(netns: &str, env: &[(&str, String)], args: &[&str], stdin: &str) -> String {
    let out = calicoctl(netns, env, args, stdin);
    assert!(
        out.status.success(),
        "calicoctl {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A resource as calicoctl prints it, without what differs between any two runs: UIDs,
/// resourceVersions, creation times, the IPAM attributes' timestamps and the pods' MACs
/// (the kernel's random choice).
pub fn without_run_identity(mut v: Value) -> Value {
    fn walk(v: &mut Value) {
        match v {
            Value::Object(m) => {
                for k in [
                    "uid",
                    "resourceVersion",
                    "creationTimestamp",
                    "timestamp",
                    "mac",
                ] {
                    if m.contains_key(k) {
                        m.insert(k.into(), Value::String("<run>".into()));
                    }
                }
                m.values_mut().for_each(walk);
            }
            Value::Array(a) => a.iter_mut().for_each(walk),
            _ => {}
        }
    }
    walk(&mut v);
    v
}

/// Who holds each allocated address: `address -> handle`, from IPv4 blocks' allocations and
/// attributes (a block's `spec` on the Kubernetes datastore, its value on etcd: the same
/// fields); panics if two allocations name one address.
pub fn block_holders(blocks: &[Value]) -> BTreeMap<String, String> {
    let mut held = BTreeMap::new();
    for b in blocks {
        let base: std::net::Ipv4Addr = b["cidr"]
            .as_str()
            .and_then(|c| c.split('/').next())
            .and_then(|a| a.parse().ok())
            .expect("an IPv4 block");
        let attrs = b["attributes"].as_array().cloned().unwrap_or_default();
        let allocations = b["allocations"].as_array().cloned().unwrap_or_default();
        for (ordinal, a) in allocations.iter().enumerate() {
            let Some(attr) = a.as_u64() else { continue };
            let address = std::net::Ipv4Addr::from(u32::from(base) + ordinal as u32).to_string();
            let handle = attrs[attr as usize]["handle_id"]
                .as_str()
                .unwrap_or_default();
            let before = held.insert(address.clone(), handle.to_string());
            assert!(
                before.is_none(),
                "{address} allocated twice: {before:?} and {handle}"
            );
        }
    }
    held
}

/// One of upstream's long-running components, started in a netns with only `env` (and a
/// PATH), its stdout and stderr in `log`; killed by PID on drop.
pub struct Daemon {
    child: Child,
    log: PathBuf,
}

impl Daemon {
    pub fn spawn(netns: &Netns, argv: &[&str], env: &[(&str, String)], log: &Path) -> Daemon {
        let out = std::fs::File::create(log).expect("daemon log");
        let err = out.try_clone().expect("daemon log");
        let child = Command::new("ip")
            .args(["netns", "exec", netns.name()])
            .args(argv)
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {argv:?}: {e}"));
        Daemon {
            child,
            log: log.to_path_buf(),
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Polls `done` every 100 ms for up to `limit`; a timeout fails with the log's end.
    pub fn wait_for(&self, what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
        let start = Instant::now();
        while !done() {
            if start.elapsed() > limit {
                let text = self.log_text();
                let lines: Vec<&str> = text.lines().collect();
                panic!(
                    "timed out after {limit:?} waiting for {what}; {} ends:\n{}",
                    self.log.display(),
                    lines[lines.len().saturating_sub(40)..].join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
