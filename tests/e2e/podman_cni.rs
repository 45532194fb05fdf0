//! Our plugin under a real container engine: Debian's podman 4.3 with its CNI backend
//! (libcni inside podman) runs two busybox containers on a network whose conflist is the
//! shipped `conf-examples/10-calico-plain-cni.conflist` (on a test etcd). They get their
//! addresses from calico-ipam and reach each other; removing them leaves nothing.
//!
//! podman runs inside the test's node netns (`nsenter --net`, which keeps the mount
//! namespace, so the container netns podman bind-mounts under /run/netns stay visible to
//! the next podman command): the plugins it execs inherit that netns, so host veths and
//! routes land there and the etcd on that netns's 127.0.0.1 is reachable; the real host's
//! network is never touched. Its state (storage, run and tmp dirs) lives in a temp dir, with
//! a containers.conf carrying the two fixes this machine kind needs
//! (this machine kind runs podman rootful in a VM): rlimits within the hard limits (no CAP_SYS_RESOURCE)
//! and runc instead of crun (cgroups v1 hybrid). libcni's result cache is podman's default,
//! /var/lib/cni, and its entries are checked gone.
//!
//! Where podman, runc or a static busybox cannot be installed, the test says so on stderr and
//! skips.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::common::apt;
use crate::common::cni::{report_skip, run_command_within, Outcome, TempDir};
use crate::common::examples;
use crate::common::netns::require_root;
use crate::common::world::{World, WEP_PREFIX};
use serde_json::Value;

const PACKAGES: &[&str] = &["podman", "runc", "busybox-static"];
const BUSYBOX: &str = "/bin/busybox";
/// Bound on each podman command.
const PODMAN_TIMEOUT: Duration = Duration::from_secs(90);

fn podman_ready() -> bool {
    let runs = |cmd: &str, arg: &str| {
        Command::new(cmd)
            .arg(arg)
            .output()
            .is_ok_and(|o| o.status.success())
    };
    runs("podman", "--version") && runs("runc", "--version") && is_static(BUSYBOX)
}

/// Whether `path` is a statically linked executable (it must run alone in the rootfs).
fn is_static(path: &str) -> bool {
    Command::new("ldd").arg(path).output().is_ok_and(|o| {
        !o.status.success() || String::from_utf8_lossy(&o.stdout).contains("not a dynamic")
    }) && Path::new(path).exists()
}

/// One podman installation confined to a temp dir, run inside the node netns.
struct Podman {
    netns_path: String,
    dir: TempDir,
    rootfs: PathBuf,
}

impl Podman {
    fn new(w: &World, network_dir: &Path) -> Podman {
        let dir = TempDir::new("podman");
        let rootfs = dir.path().join("rootfs");
        for d in ["bin", "proc", "sys", "dev", "etc", "tmp", "run"] {
            std::fs::create_dir_all(rootfs.join(d)).expect("rootfs dirs");
        }
        std::fs::copy(BUSYBOX, rootfs.join("bin/busybox")).expect("copy busybox");
        for applet in ["sh", "ip", "nc", "ping", "sleep", "echo", "true"] {
            std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet))
                .expect("busybox applet");
        }
        let conf = format!(
            r#"[containers]
# No CAP_SYS_RESOURCE here, and hard limits nofile=20000 / nproc=96365: podman's defaults fail.
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]

[engine]
events_logger = "file"
cgroup_manager = "cgroupfs"
# crun refuses cgroups v1 "hybrid" mode; runc works.
runtime = "runc"

[network]
network_backend = "cni"
cni_plugin_dirs = ["{}"]
network_config_dir = "{}"
"#,
            w.bin.path(),
            network_dir.display()
        );
        std::fs::write(dir.path().join("containers.conf"), conf).expect("containers.conf");
        Podman {
            netns_path: w.host.path().to_string(),
            dir,
            rootfs,
        }
    }

    /// `podman <args>` in the node netns with this installation's state dirs.
    fn run(&self, args: &[&str]) -> Outcome {
        let d = self.dir.path();
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net={}", self.netns_path))
            .arg("podman")
            .arg("--root")
            .arg(d.join("root"))
            .arg("--runroot")
            .arg(d.join("runroot"))
            .arg("--tmpdir")
            .arg(d.join("tmp"))
            .args(args)
            .env("CONTAINERS_CONF", d.join("containers.conf"));
        run_command_within(
            cmd,
            "",
            PODMAN_TIMEOUT,
            &format!("podman {}", args.join(" ")),
        )
    }

    fn run_ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert_eq!(
            out.code, 0,
            "podman {args:?} failed: {}{}",
            out.stdout, out.stderr
        );
        out.stdout
    }

    /// The busybox root filesystem (`--rootfs` is a flag: this path is then the first
    /// positional argument, after all options).
    fn rootfs(&self) -> String {
        self.rootfs.display().to_string()
    }

    fn inspect(&self, name: &str) -> Value {
        let out = self.run_ok(&["inspect", name]);
        let v: Value = serde_json::from_str(&out).expect("podman inspect is JSON");
        v[0].clone()
    }
}

impl Drop for Podman {
    /// Whatever a failed test left running goes (and with it its CNI DEL).
    fn drop(&mut self) {
        let _ = self.run(&["rm", "--all", "--force", "--time", "0"]);
    }
}

#[test]
fn two_containers_reach_each_other_and_leave_nothing() {
    require_root();
    let test = "two_containers_reach_each_other_and_leave_nothing";
    if let Err(why) = apt::ensure(PACKAGES, podman_ready) {
        report_skip(test, &format!("podman cannot run here: {why}"));
        return;
    }
    let w = World::new();
    let list = examples::load_for_etcd_world("10-calico-plain-cni.conflist", &w, None);
    let network = list["name"].as_str().expect("network name").to_string();
    let netconf = w.scratch.path().join("netconf");
    std::fs::create_dir_all(&netconf).expect("netconf dir");
    examples::write(&netconf, &format!("{network}.conflist"), &list);
    let podman = Podman::new(&w, &netconf);

    let networks = podman.run_ok(&["network", "ls", "--format", "{{.Name}} {{.Driver}}"]);
    assert!(
        networks.contains(&format!("{network} calico")),
        "podman lists the network: {networks}"
    );

    // Container a: a TCP server.
    let rootfs = podman.rootfs();
    let a_id = podman
        .run_ok(&[
            "run",
            "-d",
            "--name",
            "a",
            "--network",
            &network,
            "--rootfs",
            &rootfs,
            "/bin/sh",
            "-c",
            "while true; do echo pong from a | nc -l -p 8080; done",
        ])
        .trim()
        .to_string();
    let a = podman.inspect("a");
    let a_ip = a["NetworkSettings"]["Networks"][&network]["IPAddress"]
        .as_str()
        .unwrap_or_else(|| panic!("a's address in {a}"))
        .to_string();
    let a_netns = a["NetworkSettings"]["SandboxKey"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(a_ip.starts_with("10.65."), "a's address {a_ip}");
    let wep = format!("{WEP_PREFIX}default/node1-cni-{a_id}-eth0");
    assert_eq!(w.keys(&wep), vec![wep.clone()], "a's WorkloadEndpoint");
    assert_eq!(
        w.get(&wep)["spec"]["ipNetworks"][0],
        format!("{a_ip}/32").as_str()
    );
    assert!(
        w.host_sh("ip route show")
            .contains(&format!("{a_ip} dev cali")),
        "host route to a"
    );

    // Container b: its own address, then a's server and a ping to a.
    let script = format!(
        "ip -4 -o addr show dev eth0; \
         for i in 1 2 3 4 5 6 7 8 9 10; do nc -w 3 {a_ip} 8080 && break; sleep 0.3; done; \
         ping -c 1 -W 3 {a_ip} >/dev/null && echo ping ok"
    );
    let out = podman.run_ok(&[
        "run",
        "--rm",
        "--name",
        "b",
        "--network",
        &network,
        "--cap-add",
        "NET_RAW",
        "--rootfs",
        &rootfs,
        "/bin/sh",
        "-c",
        &script,
    ]);
    let b_ip = out
        .split_whitespace()
        .find_map(|t| t.strip_suffix("/32"))
        .unwrap_or_else(|| panic!("b's address in {out:?}"));
    assert!(
        b_ip.starts_with("10.65.") && b_ip != a_ip,
        "b's address {b_ip}"
    );
    assert!(out.contains("pong from a"), "b reached a's server: {out:?}");
    assert!(out.contains("ping ok"), "b pinged a: {out:?}");

    // Removal: podman's CNI DEL undoes everything (b already went with --rm).
    podman.run_ok(&["rm", "--force", "--time", "0", "a"]);
    let left = podman.run_ok(&["ps", "--all", "--quiet"]);
    assert!(left.trim().is_empty(), "containers left: {left}");
    w.assert_clean();
    assert!(
        a_netns.is_empty() || !Path::new(&a_netns).exists(),
        "a's netns {a_netns} left"
    );
    let cached = std::fs::read_dir("/var/lib/cni/results")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(&format!("{network}-")))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    assert!(cached.is_empty(), "libcni cache entries left: {cached:?}");
}
