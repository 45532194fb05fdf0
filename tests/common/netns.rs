#![allow(dead_code)]
//! Network-namespace fixtures for root-only tests.
//!
//! * [`Netns`]: a uniquely named `ip netns add` namespace with `lo` up, deleted on drop (also
//!   when the test fails), with helpers to run commands in it and to run Rust code on a thread
//!   that has joined it.
//! * [`HostNetns`]: a namespace that stands in for a node. It has what a real host has: an
//!   uplink veth to a peer namespace with IPv4/IPv6 addresses and default routes (so proxy ARP
//!   answers for 169.254.1.1 work), and IPv4/IPv6 forwarding on.

use std::fs::File;
use std::ops::Deref;
use std::os::fd::AsFd;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// Panics with a clear message unless running as root (`ip netns add` needs it).
pub fn require_root() {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "these tests create network namespaces and must run as root"
    );
}

/// Whether a usable `ping` binary (Debian's iputils-ping) is installed.
pub fn ping_available() -> bool {
    Command::new("ping")
        .arg("-V")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// Runs a command, panicking with its stderr if it fails; returns stdout.
pub fn run_ok(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("failed to run {cmd}: {e}"));
    assert!(
        out.status.success(),
        "{cmd} {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A network namespace created with `ip netns add`, deleted on drop.
#[derive(Debug)]
pub struct Netns {
    name: String,
    path: String,
}

impl Netns {
    /// Creates `<prefix>-<pid>-<n>` and brings its `lo` up.
    pub fn new(prefix: &str) -> Netns {
        require_root();
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let name = format!("{prefix}-{}-{n}", std::process::id());
        run_ok("ip", &["netns", "add", &name]);
        let path = format!("/run/netns/{name}");
        let ns = Netns { name, path };
        ns.ip(&["link", "set", "lo", "up"]);
        ns
    }

    /// A namespace someone else made and will delete (the bench's host netns): never
    /// deleted from here.
    pub fn existing(name: &str) -> std::mem::ManuallyDrop<Netns> {
        std::mem::ManuallyDrop::new(Netns {
            name: name.to_string(),
            path: format!("/run/netns/{name}"),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// `/run/netns/<name>`, what a runtime passes as `CNI_NETNS`.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// `sh -c script` inside the netns; stdout.
    pub fn sh(&self, script: &str) -> String {
        String::from_utf8_lossy(&self.exec("sh", &["-c", script]).stdout).into_owned()
    }

    /// `ip netns exec <name> <cmd> <args...>`; the caller inspects the result.
    pub fn exec(&self, cmd: &str, args: &[&str]) -> Output {
        Command::new("ip")
            .args(["netns", "exec", &self.name, cmd])
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("failed to run ip netns exec {cmd}: {e}"))
    }

    /// Like [`Netns::exec`] but panics on failure and returns stdout.
    pub fn exec_ok(&self, cmd: &str, args: &[&str]) -> String {
        let out = self.exec(cmd, args);
        assert!(
            out.status.success(),
            "in netns {}: {cmd} {args:?} failed: {}{}",
            self.name,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `ip -n <name> <args...>`, panicking on failure; returns stdout.
    pub fn ip(&self, args: &[&str]) -> String {
        let mut full = vec!["-n", self.name.as_str()];
        full.extend_from_slice(args);
        run_ok("ip", &full)
    }

    /// `ip -n <name> <args...>` returning the raw output (for expected failures).
    pub fn ip_output(&self, args: &[&str]) -> Output {
        Command::new("ip")
            .args(["-n", &self.name])
            .args(args)
            .output()
            .expect("run ip")
    }

    /// Whether a link of that name exists in this netns.
    pub fn has_link(&self, name: &str) -> bool {
        self.ip_output(&["link", "show", "dev", name])
            .status
            .success()
    }

    /// The ifindex of a link in this netns.
    pub fn ifindex(&self, name: &str) -> u32 {
        let out = self.ip(&["-o", "link", "show", "dev", name]);
        out.split(':')
            .next()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or_else(|| panic!("cannot parse ifindex from {out:?}"))
    }

    /// Reads `/proc/sys/<key>` (e.g. `net/ipv4/ip_forward`) as seen from this netns.
    pub fn sysctl(&self, key: &str) -> String {
        self.run_in(|| std::fs::read_to_string(format!("/proc/sys/{key}")))
            .unwrap_or_else(|e| panic!("read /proc/sys/{key} in {}: {e}", self.name))
            .trim()
            .to_string()
    }

    /// Writes `/proc/sys/<key>` in this netns.
    pub fn set_sysctl(&self, key: &str, value: &str) {
        self.run_in(|| std::fs::write(format!("/proc/sys/{key}"), value))
            .unwrap_or_else(|e| panic!("write /proc/sys/{key} in {}: {e}", self.name));
    }

    /// Runs `f` on a fresh thread that has joined this netns (the thread then exits), so
    /// library code can be called "from inside" it. Panics in `f` propagate.
    pub fn run_in<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        let ns = File::open(self.path()).unwrap_or_else(|e| panic!("open {}: {e}", self.path()));
        std::thread::scope(|s| {
            let handle = s.spawn(move || {
                nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                    .expect("setns into test netns");
                f()
            });
            match handle.join() {
                Ok(v) => v,
                Err(panic) => std::panic::resume_unwind(panic),
            }
        })
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

/// Uplink addressing inside every [`HostNetns`] (each lives in its own netns, so the same
/// numbers can be reused by concurrent tests).
pub const UPLINK_IF: &str = "uplink0";
pub const UPLINK_V4: &str = "198.18.0.1";
pub const UPLINK_PEER_V4: &str = "198.18.0.2";
pub const UPLINK_V6: &str = "fd00:198:18::1";
pub const UPLINK_PEER_V6: &str = "fd00:198:18::2";

/// A namespace standing in for a node: uplink veth `uplink0` (198.18.0.1/24,
/// fd00:198:18::1/64) to a peer netns holding the default gateway (.2 / ::2), plus
/// `net.ipv4.ip_forward=1` and `net.ipv6.conf.all.forwarding=1`. Dereferences to its [`Netns`].
#[derive(Debug)]
pub struct HostNetns {
    // Field order = drop order: the host goes first, then its uplink peer.
    host: Netns,
    peer: Netns,
}

impl HostNetns {
    pub fn new() -> HostNetns {
        let host = Netns::new("cnihost");
        let peer = Netns::new("cniuplink");
        host.ip(&[
            "link",
            "add",
            UPLINK_IF,
            "type",
            "veth",
            "peer",
            "name",
            "downlink0",
            "netns",
            peer.name(),
        ]);
        host.ip(&["addr", "add", &format!("{UPLINK_V4}/24"), "dev", UPLINK_IF]);
        host.ip(&[
            "addr",
            "add",
            &format!("{UPLINK_V6}/64"),
            "dev",
            UPLINK_IF,
            "nodad",
        ]);
        host.ip(&["link", "set", UPLINK_IF, "up"]);
        peer.ip(&[
            "addr",
            "add",
            &format!("{UPLINK_PEER_V4}/24"),
            "dev",
            "downlink0",
        ]);
        peer.ip(&[
            "addr",
            "add",
            &format!("{UPLINK_PEER_V6}/64"),
            "dev",
            "downlink0",
            "nodad",
        ]);
        peer.ip(&["link", "set", "downlink0", "up"]);
        host.ip(&["route", "add", "default", "via", UPLINK_PEER_V4]);
        host.ip(&["-6", "route", "add", "default", "via", UPLINK_PEER_V6]);
        host.set_sysctl("net/ipv4/ip_forward", "1");
        host.set_sysctl("net/ipv6/conf/all/forwarding", "1");
        HostNetns { host, peer }
    }

    /// The namespace at the far end of the uplink (the "router").
    pub fn uplink_peer(&self) -> &Netns {
        &self.peer
    }
}

impl Default for HostNetns {
    fn default() -> Self {
        Self::new()
    }
}

impl Deref for HostNetns {
    type Target = Netns;
    fn deref(&self) -> &Netns {
        &self.host
    }
}
