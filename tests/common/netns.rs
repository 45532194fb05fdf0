#![allow(dead_code)]
//! Network namespaces made by a test and deleted when dropped, including a "host" netns that
//! looks like a real host (an uplink with an address and a default route, forwarding on), so
//! the plugin's host-side routes, veths and sysctls never touch the machine's own.

use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};

static COUNTER: AtomicUsize = AtomicUsize::new(0);

fn ip(args: &[&str]) -> Output {
    Command::new("ip").args(args).output().expect("run ip")
}

fn ip_ok(args: &[&str]) {
    let out = ip(args);
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A uniquely named netns with `lo` up.
pub struct Netns {
    name: String,
    path: String,
}

impl Netns {
    pub fn new(prefix: &str) -> Netns {
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let name = format!("t{}-{prefix}{n}", std::process::id());
        ip_ok(&["netns", "add", &name]);
        ip_ok(&["-n", &name, "link", "set", "lo", "up"]);
        let path = format!("/run/netns/{name}");
        Netns { name, path }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn path(&self) -> &str {
        &self.path
    }

    /// Runs `cmd args…` inside this netns.
    pub fn exec(&self, cmd: &str, args: &[&str]) -> Output {
        Command::new("ip")
            .args(["netns", "exec", &self.name, cmd])
            .args(args)
            .output()
            .expect("ip netns exec")
    }

    pub fn sh(&self, script: &str) -> String {
        String::from_utf8_lossy(&self.exec("sh", &["-c", script]).stdout).into_owned()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.name]);
    }
}

/// A "host": a netns with an uplink veth to a peer netns (198.51.100.2/24, default route via
/// .1) and IP forwarding on — Linux answers proxy ARP for 169.254.1.1 only when it has a
/// route to it through another interface.
pub struct HostNetns {
    host: Netns,
    uplink: Netns,
}

impl HostNetns {
    pub fn new() -> HostNetns {
        let host = Netns::new("host");
        let uplink = Netns::new("up");
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let (a, b) = (format!("up{n}"), format!("peer{n}"));
        ip_ok(&[
            "-n",
            host.name(),
            "link",
            "add",
            &a,
            "type",
            "veth",
            "peer",
            "name",
            &b,
            "netns",
            uplink.name(),
        ]);
        ip_ok(&[
            "-n",
            host.name(),
            "addr",
            "add",
            "198.51.100.2/24",
            "dev",
            &a,
        ]);
        ip_ok(&["-n", host.name(), "link", "set", &a, "up"]);
        ip_ok(&[
            "-n",
            uplink.name(),
            "addr",
            "add",
            "198.51.100.1/24",
            "dev",
            &b,
        ]);
        ip_ok(&["-n", uplink.name(), "link", "set", &b, "up"]);
        ip_ok(&[
            "-n",
            host.name(),
            "route",
            "add",
            "default",
            "via",
            "198.51.100.1",
        ]);
        let out = host.exec("sh", &["-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"]);
        assert!(out.status.success());
        HostNetns { host, uplink }
    }

    pub fn name(&self) -> &str {
        self.host.name()
    }

    pub fn path(&self) -> &str {
        self.host.path()
    }

    pub fn exec(&self, cmd: &str, args: &[&str]) -> Output {
        self.host.exec(cmd, args)
    }

    /// Runs `f` on a thread that has joined the host netns (for library-level tests).
    pub fn run_in<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        let file = std::fs::File::open(self.path()).expect("open host netns");
        std::thread::scope(|s| {
            s.spawn(move || {
                nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
                f()
            })
            .join()
            .expect("host netns thread")
        })
    }
}

pub fn have_ping() -> bool {
    Command::new("sh")
        .args(["-c", "command -v ping"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}
