#![allow(dead_code)]
//! A real etcd (Debian's etcd-server) for one test: free loopback ports, a temp data dir,
//! optionally inside a network namespace (loopback is per netns), killed on drop.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::cni::TempDir;

pub struct EtcdServer {
    child: Child,
    port: u16,
    netns: Option<String>,
    _dir: TempDir,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

impl EtcdServer {
    pub fn start() -> EtcdServer {
        EtcdServer::start_in_netns(None)
    }

    /// Starts etcd inside `netns` (by name) when given. Ports are picked on the real host's
    /// loopback; inside a fresh netns they are free too.
    pub fn start_in_netns(netns: Option<&str>) -> EtcdServer {
        let dir = TempDir::new("etcd");
        let (port, peer) = (free_port(), free_port());
        let client_url = format!("http://127.0.0.1:{port}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, "etcd"]);
                c
            }
            None => Command::new("etcd"),
        };
        cmd.args(["--name", "test", "--data-dir"])
            .arg(dir.path().join("data"))
            .args([
                "--listen-client-urls",
                &client_url,
                "--advertise-client-urls",
                &client_url,
            ])
            .args([
                "--listen-peer-urls",
                &peer_url,
                "--initial-advertise-peer-urls",
                &peer_url,
            ])
            .args(["--initial-cluster", &format!("test={peer_url}")])
            .args(["--logger=zap", "--log-level=error"])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let child = cmd
            .spawn()
            .expect("start etcd (apt-get install etcd-server)");
        let server = EtcdServer {
            child,
            port,
            netns: netns.map(str::to_string),
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let out = server
                .ctl_cmd(&["endpoint", "health"])
                .output()
                .expect("etcdctl");
            if out.status.success() {
                break;
            }
            assert!(Instant::now() < deadline, "etcd did not become healthy");
            std::thread::sleep(Duration::from_millis(50));
        }
        server
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn ctl_cmd(&self, args: &[&str]) -> Command {
        let mut c = match &self.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, "etcdctl"]);
                c
            }
            None => Command::new("etcdctl"),
        };
        c.env("ETCDCTL_API", "3")
            .args(["--endpoints", &format!("127.0.0.1:{}", self.port)])
            .args(args);
        c
    }

    /// Runs etcdctl against this server; returns stdout.
    pub fn etcdctl(&self, args: &[&str]) -> String {
        let out = self.ctl_cmd(args).output().expect("etcdctl");
        assert!(
            out.status.success(),
            "etcdctl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn put(&self, key: &str, value: &str) {
        self.etcdctl(&["put", key, value]);
    }

    /// The raw stored value, or None.
    pub fn get_raw(&self, key: &str) -> Option<String> {
        let out = self.etcdctl(&["get", "--print-value-only", key]);
        let v = out.trim_end_matches('\n');
        (!out.is_empty()).then(|| v.to_string())
    }

    pub fn get_json(&self, key: &str) -> Value {
        let raw = self.get_raw(key).unwrap_or_else(|| panic!("no key {key}"));
        serde_json::from_str(&raw).unwrap_or_else(|e| panic!("{key}: {e}: {raw}"))
    }

    pub fn keys(&self, prefix: &str) -> Vec<String> {
        self.etcdctl(&["get", "--prefix", "--keys-only", prefix])
            .lines()
            .filter(|l| !l.is_empty())
            .map(str::to_string)
            .collect()
    }

    /// Every (key, value) under `prefix`, in one etcdctl call (values are one-line JSON).
    pub fn get_prefix(&self, prefix: &str) -> Vec<(String, String)> {
        let out = self.etcdctl(&["get", "--prefix", prefix]);
        let lines: Vec<&str> = out.lines().collect();
        lines
            .chunks(2)
            .filter(|c| c.len() == 2)
            .map(|c| (c[0].to_string(), c[1].to_string()))
            .collect()
    }

    /// Kills the server (for fault tests).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A multi-member etcd cluster on loopback (for fault tests), killed on drop.
pub struct EtcdCluster {
    members: Vec<(Child, u16)>,
    _dir: TempDir,
}

impl EtcdCluster {
    pub fn start(size: usize) -> EtcdCluster {
        let dir = TempDir::new("etcd-cluster");
        let ports: Vec<(u16, u16)> = (0..size).map(|_| (free_port(), free_port())).collect();
        let initial = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("m{i}=http://127.0.0.1:{peer}"))
            .collect::<Vec<_>>()
            .join(",");
        let mut members = Vec::new();
        for (i, (port, peer)) in ports.iter().enumerate() {
            let client_url = format!("http://127.0.0.1:{port}");
            let peer_url = format!("http://127.0.0.1:{peer}");
            let child = Command::new("etcd")
                .args(["--name", &format!("m{i}"), "--data-dir"])
                .arg(dir.path().join(format!("m{i}")))
                .args([
                    "--listen-client-urls",
                    &client_url,
                    "--advertise-client-urls",
                    &client_url,
                ])
                .args([
                    "--listen-peer-urls",
                    &peer_url,
                    "--initial-advertise-peer-urls",
                    &peer_url,
                ])
                .args([
                    "--initial-cluster",
                    &initial,
                    "--initial-cluster-state",
                    "new",
                ])
                .args(["--logger=zap", "--log-level=error"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start etcd member");
            members.push((child, *port));
        }
        let c = EtcdCluster { members, _dir: dir };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !c.healthy() {
            assert!(
                Instant::now() < deadline,
                "etcd cluster did not become healthy"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        c
    }

    fn healthy(&self) -> bool {
        Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .args(["--endpoints", &self.endpoints_csv(), "endpoint", "health"])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false)
    }

    /// `http://127.0.0.1:a,http://127.0.0.1:b,...` (the `etcd_endpoints` form).
    pub fn endpoints_csv(&self) -> String {
        self.members
            .iter()
            .map(|(_, p)| format!("http://127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// A single-member handle for etcdctl reads (`get_prefix`, `put`) through member `i`.
    pub fn ctl(&self, i: usize, args: &[&str]) -> String {
        let out = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .args(["--endpoints", &format!("127.0.0.1:{}", self.members[i].1)])
            .args(args)
            .output()
            .expect("etcdctl");
        assert!(
            out.status.success(),
            "etcdctl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// SIGKILLs member `i`.
    pub fn kill(&mut self, i: usize) {
        let _ = self.members[i].0.kill();
        let _ = self.members[i].0.wait();
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for (c, _) in &mut self.members {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
