#![allow(dead_code)]
//! A whole Kubernetes node inside a network namespace the test made: etcd and kube-apiserver
//! (real_k8s.rs, with Calico's CRDs and the plugin's RBAC), containerd 2 with its own config,
//! root, state, socket and runc root under a temp dir, and kubelet v1.35 on that containerd
//! (both peers `make deps` builds, [`node_peers`]; runc is Debian's); the
//! CNI bin and conf dirs are the test's, set up by [`install_cni`] as Calico's DaemonSet
//! would.
//!
//! Both daemons run under `nsenter --net` (not `ip netns exec`, which would give them a
//! private mount namespace and hide the pod netns and rootfs mounts from the test). Every
//! process is started here and stopped by PID: the daemons themselves, the containerd shims
//! (found by the socket path on their command line, which is this test's own) and the
//! container processes (found in this test's own cgroup root).
//!
//! What kubelet changes on the host is recorded first and restored on drop ([`HostState`]):
//! the kernel sysctls it tunes, the directories it and containerd create outside their
//! configured roots (/var/lib/kubelet/device-plugins, /var/log/pods, /var/log/containers,
//! /var/lib/cni, /run/containerd/s), and the cgroup root it runs pods under. Its iptables
//! chains live in the node netns and go with it.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::fcntl::{Flock, FlockArg};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::cni::{run_command_within, Outcome, TempDir};
use super::netns::{HostNetns, UPLINK_V4};
use super::real_k8s::RealK8s;
use super::real_k8s::NODE_LINK_V4;

/// The programs a node runs (peers `make deps` builds, common/peers.rs): kubelet v1.35,
/// containerd 2 with its runc shim and `ctr`, beside the API server's ([`real_k8s::needs`]).
#[derive(Clone, Debug)]
pub struct NodePeers {
    pub kubelet: PathBuf,
    pub containerd: PathBuf,
    pub ctr: PathBuf,
    /// The folder holding `containerd-shim-runc-v2` (containerd finds its shims on PATH).
    pub shim_dir: PathBuf,
}

/// [`NodePeers`], or why one is missing (the API server's needs included).
pub fn node_peers() -> Result<NodePeers, String> {
    super::real_k8s::needs()?;
    let [kubelet, containerd, ctr, shim] =
        super::peers::peers(["kubelet", "containerd", "ctr", "containerd-shim-runc-v2"])?;
    Ok(NodePeers {
        kubelet,
        containerd,
        ctr,
        shim_dir: shim.parent().map(Path::to_path_buf).unwrap_or_default(),
    })
}

/// Polls `f` every 100 ms until it gives a value; panics naming `what` after `limit`.
pub fn wait_until<T>(what: &str, limit: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let started = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            started.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The last `n` lines of a file (for failure messages).
pub fn tail(path: &Path, n: usize) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

fn kill(pid: u32, sig: i32) {
    // SAFETY: kill(2) on a PID this test started; at worst it is already gone.
    unsafe { libc::kill(pid as i32, sig) };
}

/// A long-running process started in a netns (`nsenter --net`, which execs it: the PID is
/// the daemon's), its output appended to a log file. Stopped on drop.
pub struct Daemon {
    name: String,
    netns_path: String,
    program: PathBuf,
    args: Vec<String>,
    /// `PATH` for the daemon (containerd finds its shims there), if not the test's.
    path_env: Option<String>,
    log: PathBuf,
    child: Mutex<Option<Child>>,
}

impl Daemon {
    pub fn start(
        name: &str,
        netns_path: &str,
        program: &Path,
        args: &[String],
        path_env: Option<String>,
        log: &Path,
    ) -> Daemon {
        let d = Daemon {
            name: name.into(),
            netns_path: netns_path.into(),
            program: program.into(),
            args: args.to_vec(),
            path_env,
            log: log.into(),
            child: Mutex::new(None),
        };
        d.spawn();
        d
    }

    fn spawn(&self) {
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap_or_else(|e| panic!("open {}: {e}", self.log.display()));
        let mut cmd = Command::new("nsenter");
        if let Some(path) = &self.path_env {
            cmd.env("PATH", path);
        }
        let child = cmd
            .arg(format!("--net={}", self.netns_path))
            .arg(&self.program)
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup log"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", self.name));
        *self.child.lock().unwrap() = Some(child);
    }

    pub fn pid(&self) -> u32 {
        self.child
            .lock()
            .unwrap()
            .as_ref()
            .map(Child::id)
            .unwrap_or(0)
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// Panics (with the log's tail) if the daemon has exited.
    pub fn assert_running(&self) {
        let mut guard = self.child.lock().unwrap();
        if let Some(c) = guard.as_mut() {
            if let Ok(Some(status)) = c.try_wait() {
                *guard = None;
                panic!(
                    "{} exited ({status}); log:\n{}",
                    self.name,
                    tail(&self.log, 30)
                );
            }
        }
    }

    /// Sends `sig` and waits (bounded) for the exit; SIGKILL after `grace`.
    fn signal_and_reap(&self, sig: i32, grace: Duration) {
        let Some(mut child) = self.child.lock().unwrap().take() else {
            return;
        };
        kill(child.id(), sig);
        let started = Instant::now();
        loop {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            if started.elapsed() > grace {
                kill(child.id(), libc::SIGKILL);
                let hard = Instant::now();
                while hard.elapsed() < Duration::from_secs(10) {
                    if let Ok(Some(_)) = child.try_wait() {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                panic!(
                    "{} (pid {}) survived SIGKILL for 10 s",
                    self.name,
                    child.id()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `kill -9`, reaped.
    pub fn kill9(&self) {
        self.signal_and_reap(libc::SIGKILL, Duration::from_secs(10));
    }

    /// Starts it again with the same arguments, the log appended to.
    pub fn restart(&self) {
        assert!(
            self.child.lock().unwrap().is_none(),
            "{} still runs",
            self.name
        );
        self.spawn();
    }

    /// SIGTERM, then SIGKILL after 10 s.
    pub fn stop(&self) {
        self.signal_and_reap(libc::SIGTERM, Duration::from_secs(10));
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
}

fn writeln_stderr(msg: &str) -> std::io::Result<()> {
    use std::io::Write as _;
    writeln!(std::io::stderr(), "{msg}")
}

fn sha256_file(path: &Path) -> String {
    let bytes = fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    hex::encode(Sha256::digest(&bytes))
}

/// A docker-archive image (what `ctr images import` reads) named `tag`, one layer holding
/// Debian's static busybox as /bin/busybox with a few applets, and `entrypoint` (if any).
pub fn build_busybox_image(work: &Path, tag: &str, entrypoint: Option<&[&str]>) -> PathBuf {
    let name = tag.replace(['/', ':'], "_");
    let root = work.join(format!("{name}-rootfs"));
    let img = work.join(format!("{name}-img"));
    for d in ["bin", "proc", "sys", "dev", "etc", "tmp", "run"] {
        fs::create_dir_all(root.join(d)).unwrap();
    }
    fs::create_dir_all(&img).unwrap();
    fs::copy("/bin/busybox", root.join("bin/busybox")).expect("copy /bin/busybox");
    for applet in [
        "sh", "ping", "sleep", "ip", "echo", "true", "cat", "nc", "top", "hostname", "httpd",
        "mkdir",
    ] {
        std::os::unix::fs::symlink("busybox", root.join("bin").join(applet)).unwrap();
    }
    let layer = img.join("layer.tar");
    let st = Command::new("tar")
        .args(["--numeric-owner", "--owner=0", "--group=0", "-C"])
        .arg(&root)
        .arg("-cf")
        .arg(&layer)
        .arg(".")
        .status()
        .expect("run tar");
    assert!(st.success(), "tar layer");
    let config = json!({
        "architecture": "amd64", "os": "linux",
        "config": {"Entrypoint": entrypoint, "Env": ["PATH=/bin"]},
        "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{}", sha256_file(&layer))]},
    });
    let config_bytes = serde_json::to_vec(&config).unwrap();
    let config_name = format!("{}.json", hex::encode(Sha256::digest(&config_bytes)));
    fs::write(img.join(&config_name), &config_bytes).unwrap();
    fs::write(
        img.join("manifest.json"),
        json!([{"Config": config_name, "RepoTags": [tag], "Layers": ["layer.tar"]}]).to_string(),
    )
    .unwrap();
    let out = work.join(format!("{name}.tar"));
    let st = Command::new("tar")
        .arg("-C")
        .arg(&img)
        .arg("-cf")
        .arg(&out)
        .arg(".")
        .status()
        .expect("run tar");
    assert!(st.success(), "tar image");
    out
}

/// Kernel tunables kubelet sets at start (container_manager_linux's setupKernelTunables).
const KUBELET_SYSCTLS: &[&str] = &[
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
];

/// Host paths kubelet or containerd create whatever their configured roots: removed on drop
/// when they were absent before. The first three are kubelet's alone (removed whole); the
/// others may be shared with other suites (only their empty directories are removed).
const KUBELET_DIRS: &[&str] = &["/var/lib/kubelet", "/var/log/pods", "/var/log/containers"];
const SHARED_DIRS: &[&str] = &["/var/lib/cni", "/run/containerd", "/opt/containerd"];

/// What the node changes on the host, recorded before and restored on drop.
pub struct HostState {
    sysctls: Vec<(String, String)>,
    absent: Vec<&'static str>,
    /// Entries of the kubelet dirs that existed before (only new ones are removed).
    entries_before: BTreeMap<&'static str, Vec<std::ffi::OsString>>,
    /// The cgroup root dirs made for this node, one per hierarchy.
    cgroups: Vec<PathBuf>,
}

fn entries(dir: &str) -> Vec<std::ffi::OsString> {
    fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.file_name())).collect())
        .unwrap_or_default()
}

/// Removes empty directories under and including `dir`, bottom-up.
fn remove_empty_dirs(dir: &Path) {
    if let Ok(rd) = fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove_empty_dirs(&e.path());
            }
        }
    }
    let _ = fs::remove_dir(dir);
}

impl HostState {
    /// Records the host and makes the cgroup root `name` in every cgroup hierarchy.
    pub fn record(cgroup_root: &str) -> HostState {
        let sysctls = KUBELET_SYSCTLS
            .iter()
            .filter_map(|k| {
                fs::read_to_string(format!("/proc/sys/{k}"))
                    .ok()
                    .map(|v| (k.to_string(), v.trim().to_string()))
            })
            .collect();
        let absent = KUBELET_DIRS
            .iter()
            .chain(SHARED_DIRS)
            .copied()
            .filter(|d| !Path::new(d).exists())
            .collect();
        let entries_before = KUBELET_DIRS.iter().map(|d| (*d, entries(d))).collect();
        let mut state = HostState {
            sysctls,
            absent,
            entries_before,
            cgroups: vec![],
        };
        for h in fs::read_dir("/sys/fs/cgroup")
            .expect("/sys/fs/cgroup")
            .flatten()
        {
            let path = h.path();
            if fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_symlink())
                || !path.join("cgroup.procs").exists()
            {
                continue;
            }
            let dir = path.join(cgroup_root);
            fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
            state.cgroups.push(dir.clone());
            // A new cpuset has no CPUs or memory nodes until given its parent's.
            for f in ["cpuset.cpus", "cpuset.mems"] {
                if let Ok(v) = fs::read_to_string(path.join(f)) {
                    fs::write(dir.join(f), v.trim()).expect("copy cpuset");
                }
            }
        }
        state
    }

    /// PIDs in this node's cgroups (the containers' processes).
    pub fn cgroup_pids(&self) -> Vec<u32> {
        fn walk(dir: &Path, out: &mut Vec<u32>) {
            if let Ok(s) = fs::read_to_string(dir.join("cgroup.procs")) {
                out.extend(s.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
            }
            if let Ok(rd) = fs::read_dir(dir) {
                for e in rd.flatten() {
                    if e.file_type().is_ok_and(|t| t.is_dir()) {
                        walk(&e.path(), out);
                    }
                }
            }
        }
        let mut pids = vec![];
        for c in &self.cgroups {
            walk(c, &mut pids);
        }
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// Kills every process left in this node's cgroups and removes the cgroups (bounded).
    fn remove_cgroups(&self) {
        fn dirs_deepest_first(dir: &Path, out: &mut Vec<PathBuf>) {
            if let Ok(rd) = fs::read_dir(dir) {
                for e in rd.flatten() {
                    if e.file_type().is_ok_and(|t| t.is_dir()) {
                        dirs_deepest_first(&e.path(), out);
                    }
                }
            }
            out.push(dir.to_path_buf());
        }
        let started = Instant::now();
        loop {
            for pid in self.cgroup_pids() {
                kill(pid, libc::SIGKILL);
            }
            let mut all = vec![];
            for c in &self.cgroups {
                dirs_deepest_first(c, &mut all);
            }
            for d in &all {
                let _ = fs::remove_dir(d);
            }
            if self.cgroups.iter().all(|c| !c.exists())
                || started.elapsed() > Duration::from_secs(10)
            {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for HostState {
    fn drop(&mut self) {
        self.remove_cgroups();
        for (k, v) in &self.sysctls {
            let _ = fs::write(format!("/proc/sys/{k}"), v);
        }
        for d in KUBELET_DIRS {
            if self.absent.contains(d) {
                let _ = fs::remove_dir_all(d);
            } else if let Some(before) = self.entries_before.get(d) {
                for e in entries(d) {
                    if !before.contains(&e) {
                        let p = Path::new(d).join(&e);
                        let _ = fs::remove_dir_all(&p).or_else(|_| fs::remove_file(&p));
                    }
                }
            }
        }
        for d in SHARED_DIRS {
            if self.absent.contains(d) {
                remove_empty_dirs(Path::new(d));
            }
        }
    }
}

/// Unmounts everything mounted at or under `dir` (deepest first, lazily).
pub fn unmount_under(dir: &Path) {
    let prefix = dir.display().to_string();
    let mut points: Vec<String> = fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(4).map(str::to_string))
        .filter(|m| m == &prefix || m.starts_with(&format!("{prefix}/")))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.len()));
    for p in points {
        let c = std::ffi::CString::new(p).unwrap();
        // SAFETY: umount2 with a valid C string; failure is harmless here.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    }
}

/// What containerd leaves outside its root and state when its sandboxes and shims are killed
/// rather than torn down: libcni's result cache entries (/var/lib/cni/results) and the shims'
/// sockets (/run/containerd/s/<sha256 of "<address>/<namespace>/<id>">). Removed by the ids
/// in this containerd's log, so nothing of another runtime is touched.
fn remove_runtime_leftovers(log: &Path, sock: &Path) {
    let text = fs::read_to_string(log).unwrap_or_default();
    let mut ids = std::collections::BTreeSet::new();
    for word in text.split(|c: char| !c.is_ascii_hexdigit()) {
        if word.len() == 64 {
            ids.insert(word.to_string());
        }
    }
    for id in ids {
        let _ = fs::remove_file(format!("/var/lib/cni/results/k8s-pod-network-{id}-eth0"));
        // containerd's own loopback network, removed only with the sandbox.
        let _ = fs::remove_file(format!("/var/lib/cni/results/cni-loopback-{id}-lo"));
        let key = format!("{}/k8s.io/{id}", sock.display());
        let _ = fs::remove_file(format!(
            "/run/containerd/s/{}",
            hex::encode(Sha256::digest(key.as_bytes()))
        ));
    }
}

/// containerd 2 with everything of its own under `dir`.
pub struct Containerd {
    daemon: Daemon,
    dir: PathBuf,
    ctr: PathBuf,
}

pub const PAUSE_IMAGE: &str = "localhost/pause:local";
pub const BUSYBOX_IMAGE: &str = "localhost/busybox:local";
const CTR_TIMEOUT: Duration = Duration::from_secs(60);

impl Containerd {
    pub fn start(
        peers: &NodePeers,
        dir: &Path,
        netns_path: &str,
        cni_bin: &Path,
        cni_conf: &Path,
    ) -> Containerd {
        fs::create_dir_all(dir).unwrap();
        let d = |s: &str| dir.join(s).display().to_string();
        // runc cannot apply the negative oomScoreAdj kubelet asks for (no CAP_SYS_RESOURCE
        // here: "can't get final child's PID from pipe: EOF"): clamp it to 0 in the bundle.
        let wrapper = dir.join("runc");
        fs::write(
            &wrapper,
            "#!/bin/sh\n\
             prev=\n\
             for a in \"$@\"; do\n\
             \x20 if [ \"$prev\" = --bundle ] || [ \"$prev\" = -b ]; then\n\
             \x20   sed -i 's/\"oomScoreAdj\":-[0-9]*/\"oomScoreAdj\":0/' \"$a/config.json\"\n\
             \x20 fi\n\
             \x20 prev=$a\n\
             done\n\
             exec /usr/sbin/runc \"$@\"\n",
        )
        .unwrap();
        fs::set_permissions(&wrapper, fs::Permissions::from_mode(0o755)).unwrap();
        // Config version 3 (containerd 2): the CRI plugin is split into its runtime part
        // (CNI, runc) and its image part (the pinned sandbox image).
        let config = format!(
            r#"version = 3
root = "{root}"
state = "{state}"
# Not needed, and some write outside the root (the opt plugin makes /opt/containerd).
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.erofs", "io.containerd.differ.v1.erofs",
  "io.containerd.internal.v1.opt", "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.internal.v1.tracing", "io.containerd.nri.v1.nri"]
[grpc]
  address = "{sock}"
[ttrpc]
  address = "{sock}.ttrpc"
[debug]
  level = "info"
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{PAUSE_IMAGE}"
  [plugins."io.containerd.cri.v1.images".registry]
    config_path = "{certs}"
[plugins."io.containerd.cri.v1.runtime"]
  disable_apparmor = true
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["{bin}"]
    conf_dir = "{conf}"
    max_conf_num = 1
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "{wrapper}"
        Root = "{runc_root}"
        SystemdCgroup = false
[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"#,
            root = d("root"),
            state = d("state"),
            sock = d("containerd.sock"),
            bin = cni_bin.display(),
            conf = cni_conf.display(),
            wrapper = wrapper.display(),
            runc_root = d("runc-root"),
            certs = d("certs.d"),
        );
        fs::write(dir.join("config.toml"), config).unwrap();
        let path = format!(
            "{}:{}",
            peers.shim_dir.display(),
            std::env::var("PATH").unwrap_or_else(|_| "/usr/sbin:/usr/bin:/sbin:/bin".into())
        );
        let daemon = Daemon::start(
            "containerd",
            netns_path,
            &peers.containerd,
            &["--config".into(), d("config.toml")],
            Some(path),
            &dir.join("containerd.log"),
        );
        let c = Containerd {
            daemon,
            dir: dir.to_path_buf(),
            ctr: peers.ctr.clone(),
        };
        c.wait_ready();
        c
    }

    fn wait_ready(&self) {
        wait_until("containerd's socket", Duration::from_secs(60), || {
            self.daemon.assert_running();
            (self.ctr(&["version"]).code == 0).then_some(())
        });
    }

    pub fn sock(&self) -> PathBuf {
        self.dir.join("containerd.sock")
    }

    /// The registry hosts folder (`<host:port>/hosts.toml`, containerd's `config_path`).
    pub fn registry_hosts_dir(&self) -> PathBuf {
        self.dir.join("certs.d")
    }

    pub fn log_path(&self) -> &Path {
        self.daemon.log_path()
    }

    pub fn daemon(&self) -> &Daemon {
        &self.daemon
    }

    /// `ctr -a SOCK -n k8s.io <args>`, bounded.
    pub fn ctr(&self, args: &[&str]) -> Outcome {
        let mut cmd = Command::new(&self.ctr);
        cmd.arg("-a")
            .arg(self.sock())
            .args(["-n", "k8s.io"])
            .args(args);
        run_command_within(cmd, "", CTR_TIMEOUT, &format!("ctr {}", args.join(" ")))
    }

    pub fn import(&self, tar: &Path) {
        let out = self.ctr(&["images", "import", &tar.display().to_string()]);
        assert_eq!(out.code, 0, "import {}: {}", tar.display(), out.stderr);
    }

    pub fn kill9(&self) {
        self.daemon.kill9();
    }

    pub fn restart(&self) {
        self.daemon.restart();
        self.wait_ready();
    }

    /// The PIDs of this containerd's shims (their command line names its socket).
    pub fn shim_pids(&self) -> Vec<u32> {
        let sock = self.sock().display().to_string();
        let mut pids = vec![];
        for e in fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let cmdline = fs::read(e.path().join("cmdline")).unwrap_or_default();
            let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
            let is_shim = args
                .first()
                .is_some_and(|a| a.ends_with(b"containerd-shim-runc-v2"));
            if is_shim && args.contains(&sock.as_bytes()) {
                pids.push(pid);
            }
        }
        pids
    }

    /// RunPodSandbox durations from the log: (pod name, attempt, duration) of every call that
    /// returned a sandbox id.
    pub fn run_pod_sandbox_durations(&self) -> Vec<(String, Duration)> {
        let log = fs::read_to_string(self.log_path()).unwrap_or_default();
        let mut started: BTreeMap<String, f64> = BTreeMap::new();
        let mut out = vec![];
        for line in log.lines() {
            let Some(call) = RunPodSandboxLine::parse(line) else {
                continue;
            };
            let Some(t) = line
                .strip_prefix("time=\"")
                .and_then(|r| r.split('"').next())
                .and_then(rfc3339_seconds)
            else {
                continue;
            };
            if call.sandbox_id.is_some() {
                if let Some(t0) = started.remove(&call.key) {
                    out.push((call.name, Duration::from_secs_f64((t - t0).max(0.0))));
                }
            } else if !call.failed {
                started.insert(call.key, t);
            }
        }
        out
    }

    /// The sandbox id RunPodSandbox returned for pod `name` (the last one).
    pub fn sandbox_id_of(&self, name: &str) -> Option<String> {
        let log = fs::read_to_string(self.log_path()).unwrap_or_default();
        log.lines()
            .rev()
            .filter_map(RunPodSandboxLine::parse)
            .filter(|call| call.name == name)
            .find_map(|call| call.sandbox_id)
    }
}

/// One `RunPodSandbox for <metadata>…` line of containerd's log, in either format of the
/// metadata: containerd 1.6's `&PodSandboxMetadata{Name:n,Uid:u,Namespace:ns,Attempt:0,}` or
/// containerd 2's protobuf text `name:\"n\" uid:\"u\" namespace:\"ns\" attempt:1` (one or
/// two spaces between fields, as protobuf-go varies them).
#[derive(Debug, PartialEq)]
pub struct RunPodSandboxLine {
    /// The call's pod and attempt (same for its start and its end).
    pub key: String,
    pub name: String,
    /// The id it returned, on the line of its end.
    pub sandbox_id: Option<String>,
    /// Whether this is the line of a failed end.
    pub failed: bool,
}

impl RunPodSandboxLine {
    pub fn parse(line: &str) -> Option<RunPodSandboxLine> {
        const MARK: &str = "msg=\"RunPodSandbox for ";
        let rest = &line[line.find(MARK)? + MARK.len()..];
        let (key, name, after) = if let Some(r) = rest.strip_prefix("&PodSandboxMetadata{") {
            let end = r.find('}')?;
            let meta = &r[..end];
            let name = meta.strip_prefix("Name:")?.split(',').next()?;
            (meta.to_string(), name.to_string(), &r[end + 1..])
        } else {
            let mut key = String::new();
            let mut name = None;
            let mut consumed = 0;
            for token in rest.split(' ') {
                if token.is_empty() {
                    consumed += 1;
                    continue;
                }
                let Some((field, value)) = token.split_once(':') else {
                    break;
                };
                if !matches!(field, "name" | "uid" | "namespace" | "attempt") {
                    break;
                }
                let value = value.trim_matches(|c| c == '\\' || c == '"');
                if field == "name" {
                    name = Some(value.to_string());
                }
                key.push_str(&format!("{field}={value},"));
                consumed += token.len() + 1;
            }
            (key, name?, &rest[consumed.min(rest.len())..])
        };
        let sandbox_id = after
            .split("returns sandbox id \\\"")
            .nth(1)
            .and_then(|r| r.split('\\').next())
            .map(str::to_string);
        Some(RunPodSandboxLine {
            key,
            name,
            failed: sandbox_id.is_none() && after.contains("failed"),
            sandbox_id,
        })
    }
}

/// What containerd's log (CRI, level info) says about pod sandboxes: which pod each sandbox
/// id belongs to, every StopPodSandbox call that returned, and the RunPodSandbox calls that
/// failed. containerd 1.6 logs `StopPodSandbox for \"<id>\"` when a call starts and
/// `StopPodSandbox for \"<id>\" returns successfully` (or `... failed`) when it ends.
#[derive(Debug, Default)]
pub struct SandboxLog {
    /// Sandbox id -> pod name, from RunPodSandbox's `returns sandbox id` lines.
    pub pod_of: BTreeMap<String, String>,
    /// Every StopPodSandbox that returned successfully: (sandbox id, duration), in the
    /// order they returned.
    pub stops: Vec<(String, Duration)>,
    /// Pod names of the RunPodSandbox calls that failed (kubelet retries them).
    pub run_failures: Vec<String>,
    /// (sandbox id, when) of every StopPodSandbox call that started, as
    /// [`utc_seconds_of_day`].
    pub stop_starts: Vec<(String, f64)>,
    /// When each RemovePodSandbox line was logged (kubelet's container GC, once a minute,
    /// stops and removes the dead sandboxes; containerd runs a CNI DEL for each, netns-less,
    /// through the config of the moment), as [`utc_seconds_of_day`].
    pub removes: Vec<f64>,
}

/// Now as seconds since midnight UTC, the clock of containerd's log timestamps.
pub fn utc_seconds_of_day() -> f64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("a clock after 1970");
    now.as_secs_f64() % 86_400.0
}

/// Seconds from `t0` to `t` (both [`rfc3339_seconds`]), across one midnight.
pub fn seconds_between(t0: f64, t: f64) -> f64 {
    if t < t0 {
        t + 86_400.0 - t0
    } else {
        t - t0
    }
}

impl SandboxLog {
    pub fn parse(log: &str) -> SandboxLog {
        let mut out = SandboxLog::default();
        let mut stop_started: BTreeMap<String, std::collections::VecDeque<f64>> = BTreeMap::new();
        for line in log.lines() {
            let Some(t) = line
                .strip_prefix("time=\"")
                .and_then(|r| r.split('"').next())
                .and_then(rfc3339_seconds)
            else {
                continue;
            };
            if let Some(call) = RunPodSandboxLine::parse(line) {
                if let Some(id) = call.sandbox_id {
                    out.pod_of.insert(id, call.name);
                } else if call.failed {
                    out.run_failures.push(call.name);
                }
            } else if line.contains("msg=\"RemovePodSandbox") {
                out.removes.push(t);
            } else if let Some(i) = line.find("msg=\"StopPodSandbox for \\\"") {
                let rest = &line[i + "msg=\"StopPodSandbox for \\\"".len()..];
                let Some((id, after)) = rest.split_once("\\\"") else {
                    continue;
                };
                if after.starts_with('"') {
                    out.stop_starts.push((id.to_string(), t));
                    stop_started.entry(id.to_string()).or_default().push_back(t);
                } else if let Some(t0) = stop_started.get_mut(id).and_then(|q| q.pop_front()) {
                    if after.starts_with(" returns successfully") {
                        out.stops.push((
                            id.to_string(),
                            Duration::from_secs_f64(seconds_between(t0, t)),
                        ));
                    }
                }
            }
        }
        out
    }

    /// The sandbox ids RunPodSandbox returned for pod `name`.
    pub fn ids_of(&self, name: &str) -> Vec<&str> {
        self.pod_of
            .iter()
            .filter(|(_, n)| n.as_str() == name)
            .map(|(id, _)| id.as_str())
            .collect()
    }

    /// Whether a StopPodSandbox of sandbox `id` has returned successfully.
    pub fn stopped(&self, id: &str) -> bool {
        self.stops.iter().any(|(s, _)| s == id)
    }

    /// (pod name, duration) of the first successful StopPodSandbox of each sandbox (the one
    /// that tore the network down; a later one finds the netns closed), in return order.
    pub fn first_stops(&self) -> Vec<(String, Duration)> {
        let mut seen = std::collections::BTreeSet::new();
        self.stops
            .iter()
            .filter(|(id, _)| seen.insert(id.clone()))
            .filter_map(|(id, d)| self.pod_of.get(id).map(|n| (n.clone(), *d)))
            .collect()
    }

    /// How many successful StopPodSandbox calls each sandbox had.
    pub fn stop_calls(&self) -> BTreeMap<&str, usize> {
        let mut m = BTreeMap::new();
        for (id, _) in &self.stops {
            *m.entry(id.as_str()).or_insert(0) += 1;
        }
        m
    }

    /// How many StopPodSandbox calls of sandbox `id` have started, and whether every one of
    /// them has returned (successfully or not).
    pub fn stop_progress(&self, id: &str) -> (usize, bool) {
        let started = self.stop_starts.iter().filter(|(s, _)| s == id).count();
        let returned = self.stops.iter().filter(|(s, _)| s == id).count();
        (started, started == returned)
    }
}

impl Containerd {
    /// [`SandboxLog`] of this containerd's log so far.
    pub fn sandbox_log(&self) -> SandboxLog {
        SandboxLog::parse(&fs::read_to_string(self.log_path()).unwrap_or_default())
    }
}

/// Writes `contents` to `path` atomically: a temporary file in the same directory (a dot
/// name with no `.conf`/`.conflist`/`.json` extension, which libcni ignores) renamed over it.
pub fn write_atomically(path: &Path, contents: &[u8]) {
    let tmp = temp_sibling(path);
    fs::write(&tmp, contents).unwrap_or_else(|e| panic!("write {}: {e}", tmp.display()));
    fs::rename(&tmp, path)
        .unwrap_or_else(|e| panic!("rename {} -> {}: {e}", tmp.display(), path.display()));
}

/// Copies `src` over `dest` atomically (a copy beside `dest`, renamed over it), mode 0755:
/// a plugin exec'd meanwhile is the old file or the new one, never half of one.
pub fn copy_atomically(src: &Path, dest: &Path) {
    let tmp = temp_sibling(dest);
    fs::copy(src, &tmp)
        .unwrap_or_else(|e| panic!("copy {} -> {}: {e}", src.display(), tmp.display()));
    fs::set_permissions(&tmp, fs::Permissions::from_mode(0o755)).unwrap();
    fs::rename(&tmp, dest)
        .unwrap_or_else(|e| panic!("rename {} -> {}: {e}", tmp.display(), dest.display()));
}

fn temp_sibling(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .unwrap_or_else(|| panic!("{} has no file name", path.display()))
        .to_string_lossy();
    path.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

/// The CNI bin dir as "bare binaries" (no installer): `calico` copied from `calico`,
/// `calico-ipam` a symlink to it (so IPAM runs in-process), and Debian's ptp, host-local,
/// portmap and loopback copied from /usr/lib/cni.
pub fn install_bare_binaries(bin_dir: &Path, calico: &Path) {
    fs::create_dir_all(bin_dir).unwrap();
    copy_atomically(calico, &bin_dir.join("calico"));
    std::os::unix::fs::symlink("calico", bin_dir.join("calico-ipam"))
        .unwrap_or_else(|e| panic!("symlink calico-ipam in {}: {e}", bin_dir.display()));
    for p in ["ptp", "host-local", "portmap", "loopback"] {
        copy_atomically(&Path::new("/usr/lib/cni").join(p), &bin_dir.join(p));
    }
}

/// Where the timed network plugins' real binaries live ([`time_network_plugins`]).
pub const TIMED_DIR: &str = ".timed";

/// Puts a bash wrapper in front of each network plugin (`calico`, `ptp`: the chain's first
/// plugin, whose time includes its IPAM) that appends `<start> <end> <plugin> <command>
/// <container id>` (epoch seconds, `$EPOCHREALTIME`) to `log` for every call. The binaries
/// move to [`TIMED_DIR`]; `calico-ipam` points there, so IPAM still runs in-process. Both
/// plugins pay the same wrapper (bash's start-up, ~2 ms), so their difference is the
/// plugins' own; portmap is left alone.
pub fn time_network_plugins(bin_dir: &Path, log: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let timed = bin_dir.join(TIMED_DIR);
    fs::create_dir_all(&timed).unwrap_or_else(|e| panic!("create {}: {e}", timed.display()));
    for p in ["calico", "ptp"] {
        fs::rename(bin_dir.join(p), timed.join(p))
            .unwrap_or_else(|e| panic!("move {p} to {}: {e}", timed.display()));
        let wrapper = format!(
            "#!/bin/bash\nt0=$EPOCHREALTIME\n{real} \"$@\"\nrc=$?\necho \"$t0 $EPOCHREALTIME {p} $CNI_COMMAND $CNI_CONTAINERID\" >> {log}\nexit $rc\n",
            real = timed.join(p).display(),
            log = log.display(),
        );
        write_atomically(&bin_dir.join(p), wrapper.as_bytes());
        fs::set_permissions(bin_dir.join(p), fs::Permissions::from_mode(0o755))
            .unwrap_or_else(|e| panic!("chmod the {p} wrapper: {e}"));
    }
    let ipam = bin_dir.join("calico-ipam");
    fs::remove_file(&ipam).unwrap_or_else(|e| panic!("remove {}: {e}", ipam.display()));
    std::os::unix::fs::symlink(Path::new(TIMED_DIR).join("calico"), &ipam)
        .unwrap_or_else(|e| panic!("symlink {}: {e}", ipam.display()));
}

/// Seconds since midnight (enough to subtract times of one run) of containerd's
/// `2026-11-26T10:36:19.880123456Z`.
fn rfc3339_seconds(t: &str) -> Option<f64> {
    let time = t.split('T').nth(1)?.trim_end_matches('Z');
    let mut parts = time.split(':');
    let h: f64 = parts.next()?.parse().ok()?;
    let m: f64 = parts.next()?.parse().ok()?;
    let s: f64 = parts.next()?.parse().ok()?;
    Some(h * 3600.0 + m * 60.0 + s)
}

/// kubelet on the node's containerd, registering node `name`.
pub struct Kubelet {
    daemon: Daemon,
}

impl Kubelet {
    /// kubelet for `node` (its name, address, containerd and cgroup root), with the
    /// credentials of `kubeconfig`.
    pub fn start(node: &RealNode, kubeconfig: &Path) -> Kubelet {
        let dir = &node.dir.path().join("kubelet");
        let containerd = node.containerd();
        let cgroup_root = &node.cgroup_root;
        let node_ip = &node.node_ip;
        fs::create_dir_all(dir.join("root")).unwrap();
        // The test machine's disk is the node's: kubelet's default eviction (imagefs under
        // 15 % free) and image GC (over 85 % used) would refuse pods and delete the locally
        // imported images on a build machine with a full disk, which is not what is tested.
        let config = format!(
            "apiVersion: kubelet.config.k8s.io/v1beta1\n\
             kind: KubeletConfiguration\n\
             containerRuntimeEndpoint: unix://{sock}\n\
             failCgroupV1: false\n\
             cgroupDriver: cgroupfs\n\
             cgroupRoot: /{cgroup_root}\n\
             failSwapOn: false\n\
             address: 127.0.0.1\n\
             readOnlyPort: 0\n\
             healthzPort: 0\n\
             authentication:\n  anonymous: {{enabled: false}}\n  webhook: {{enabled: false}}\n\
             authorization: {{mode: AlwaysAllow}}\n\
             kubeAPIQPS: 100\n\
             kubeAPIBurst: 200\n\
             serializeImagePulls: false\n\
             evictionHard: {{memory.available: 1Mi, nodefs.available: 1%, nodefs.inodesFree: 1%, imagefs.available: 1%}}\n\
             imageGCHighThresholdPercent: 100\n\
             imageGCLowThresholdPercent: 99\n\
             volumePluginDir: {dir}/volume-plugins\n",
            dir = dir.display(),
            sock = containerd.sock().display(),
        );
        fs::write(dir.join("config.yaml"), config).unwrap();
        let p = |s: &str| dir.join(s).display().to_string();
        let args = vec![
            format!("--config={}", p("config.yaml")),
            format!("--kubeconfig={}", kubeconfig.display()),
            format!("--root-dir={}", p("root")),
            format!("--cert-dir={}", p("pki")),
            format!("--hostname-override={}", node.name),
            format!("--node-ip={node_ip}"),
            "--v=2".into(),
        ];
        Kubelet {
            daemon: Daemon::start(
                "kubelet",
                node.host.path(),
                &node.peers.kubelet,
                &args,
                None,
                &dir.join("kubelet.log"),
            ),
        }
    }

    pub fn daemon(&self) -> &Daemon {
        &self.daemon
    }
}

/// What the installer needs, as Calico's install gets it in the DaemonSet: the network
/// config template (CNI_NETWORK_CONFIG), the API server's address
/// (KUBERNETES_SERVICE_HOST/PORT), the service account's token and CA, the node's name.
pub struct InstallInputs<'a> {
    pub bin_dir: &'a Path,
    pub conf_dir: &'a Path,
    /// The DaemonSet's `CNI_NETWORK_CONFIG` template.
    pub network_config: &'a str,
    /// The node's network namespace, as a path (the API server listens on its 127.0.0.1).
    pub host_netns: &'a str,
    pub service_host: &'a str,
    pub service_port: u16,
    /// The pod's mounted service-account token (calico-node's): the installer asks
    /// TokenRequest for the CNI plugin's own token with it.
    pub pod_token: &'a str,
    pub ca_pem: &'a str,
    pub node_name: &'a str,
    /// Where the installer may keep its own files (the service-account mount, podman).
    pub scratch: &'a Path,
    /// More of the DaemonSet's environment (the etcd manifest's `ETCD_ENDPOINTS`).
    pub extra_env: &'a [(&'a str, &'a str)],
}

impl InstallInputs<'_> {
    /// The `install-cni` container's environment and its service-account mount's folder
    /// (written here).
    fn daemonset_env(&self) -> (Vec<(String, String)>, PathBuf) {
        fs::create_dir_all(self.bin_dir).unwrap();
        fs::create_dir_all(self.conf_dir).unwrap();
        let sa = self.scratch.join("serviceaccount");
        fs::create_dir_all(&sa).unwrap();
        fs::write(sa.join("token"), self.pod_token).unwrap();
        fs::write(sa.join("ca.crt"), self.ca_pem).unwrap();
        fs::write(sa.join("namespace"), "kube-system").unwrap();
        let env: Vec<(String, String)> = [
            ("SLEEP", "false"),
            ("CNI_NETWORK_CONFIG", self.network_config),
            ("CNI_NET_DIR", &self.conf_dir.display().to_string()),
            ("KUBERNETES_NODE_NAME", self.node_name),
            ("KUBERNETES_SERVICE_HOST", self.service_host),
            ("KUBERNETES_SERVICE_PORT", &self.service_port.to_string()),
            ("CNI_MTU", "1500"),
        ]
        .iter()
        .chain(self.extra_env)
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        (env, sa)
    }
}

pub const CONFLIST_NAME: &str = "10-calico.conflist";

/// Which manifest's network config [`manifest_network_config`] gives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ManifestDatastore {
    /// calico.yaml's (the Kubernetes datastore).
    Kubernetes,
    /// calico-etcd.yaml's (its `__ETCD_*__` placeholders).
    Etcd,
}

/// A manifest's network config (the DaemonSet's `CNI_NETWORK_CONFIG`) with its install-time
/// placeholders, localized only where a test must not write to the host or nodes share this
/// machine's disk: the log file and the IPAM lock in `scratch`, and the node's name from the
/// installer (no calico/node writes /var/lib/calico/nodename).
pub fn manifest_network_config(scratch: &Path, datastore: ManifestDatastore) -> String {
    let s = scratch.display();
    let datastore = match datastore {
        ManifestDatastore::Kubernetes => r#""datastore_type": "kubernetes","#,
        ManifestDatastore::Etcd => {
            r#""etcd_endpoints": "__ETCD_ENDPOINTS__",
      "etcd_key_file": "__ETCD_KEY_FILE__",
      "etcd_cert_file": "__ETCD_CERT_FILE__",
      "etcd_ca_cert_file": "__ETCD_CA_CERT_FILE__","#
        }
    };
    format!(
        r#"{{
  "name": "k8s-pod-network",
  "cniVersion": "0.3.1",
  "plugins": [
    {{
      "type": "calico",
      "log_level": "debug",
      "log_file_path": "{s}/cni.log",
      "ipam_lock_file": "{s}/ipam.lock",
      "nodename_file_optional": true,
      {datastore}
      "nodename": "__KUBERNETES_NODE_NAME__",
      "mtu": __CNI_MTU__,
      "ipam": {{"type": "calico-ipam"}},
      "policy": {{"type": "k8s"}},
      "kubernetes": {{"kubeconfig": "__KUBECONFIG_FILEPATH__"}}
    }},
    {{"type": "portmap", "snat": true, "capabilities": {{"portMappings": true}}}}
  ]
}}"#
    )
}

/// The binary the node gets: this test build's, or `REAL_NODE_CALICO` (e.g. a release
/// build, to time RunPodSandbox with the binary a cluster would run).
pub fn plugin_binary() -> PathBuf {
    std::env::var_os("REAL_NODE_CALICO")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_calico")))
}

/// Sets the node up as Calico's DaemonSet does: our image's `install` (the `install-cni`
/// container) run by podman with the DaemonSet's mounts and environment. Without the image
/// (a build by hand without `make image`; never in CI) or with `REAL_NODE_CALICO`, the same
/// installer runs from an image layout made of that binary and Debian's plugins. Returns
/// which of the two ran.
pub fn install_cni(i: &InstallInputs) -> &'static str {
    let (env, sa) = i.daemonset_env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let net_dir = i.conf_dir.display().to_string();
    let image = super::image::image("real_node install_cni")
        .filter(|_| std::env::var_os("REAL_NODE_CALICO").is_none());
    let (out, how) = match image {
        Some(tar) => {
            let podman = super::image::Podman::new_in(i.scratch);
            let name = podman.load(&tar);
            let mounts = [
                format!("{}:/host/opt/cni/bin", i.bin_dir.display()),
                format!("{net_dir}:/host/etc/cni/net.d"),
                format!(
                    "{}:/var/run/secrets/kubernetes.io/serviceaccount:ro",
                    sa.display()
                ),
            ];
            (
                podman.run_container(
                    Some(i.host_netns),
                    &mounts,
                    &env,
                    &name,
                    &["/opt/cni/bin/install"],
                ),
                "the image's install under podman (the image's static calico)",
            )
        }
        None => {
            let image_dir = i.scratch.join("image-bin");
            image_layout(&image_dir, &plugin_binary(), None);
            let mut cmd = Command::new("nsenter");
            cmd.arg(format!("--net={}", i.host_netns))
                .arg(image_dir.join("install"))
                .env("CALICO_INSTALL_IMAGE_BIN_DIR", &image_dir)
                .env("CALICO_INSTALL_HOST_BIN_DIRS", i.bin_dir)
                .env("CALICO_INSTALL_HOST_NET_DIR", i.conf_dir)
                .env("CALICO_INSTALL_SERVICEACCOUNT_DIR", &sa)
                .envs(env.iter().copied());
            (
                super::cni::run_command_within(cmd, "", Duration::from_secs(300), "install"),
                "the installer from an image layout of this build (REAL_NODE_CALICO or the test build)",
            )
        }
    };
    assert_eq!(out.code, 0, "install-cni: {}{}", out.stdout, out.stderr);
    assert!(i.conf_dir.join(CONFLIST_NAME).is_file());
    assert!(i.conf_dir.join("calico-kubeconfig").is_file());
    how
}

/// An image's /opt/cni/bin in `dir` (made afresh): `calico` (a copy of `calico`),
/// `calico-ipam` (a link to it), `install` (`install`, or a link to `calico` as in our
/// image) and the reference plugins the image ships, from the peers build.
fn image_layout(dir: &Path, calico: &Path, install: Option<&Path>) {
    let _ = fs::remove_dir_all(dir);
    fs::create_dir_all(dir).unwrap();
    let copy = |src: &Path, name: &str| {
        let dest = dir.join(name);
        fs::copy(src, &dest).unwrap_or_else(|e| panic!("copy {}: {e}", src.display()));
        fs::set_permissions(&dest, fs::Permissions::from_mode(0o755)).unwrap();
    };
    copy(calico, "calico");
    std::os::unix::fs::symlink("calico", dir.join("calico-ipam")).unwrap();
    match install {
        Some(install) => copy(install, "install"),
        None => std::os::unix::fs::symlink("calico", dir.join("install")).unwrap(),
    }
    for p in ["portmap", "loopback", "host-local", "tuning"] {
        let src = super::peers::peer(p).unwrap_or_else(|why| panic!("{why}"));
        copy(&src, p);
    }
}

/// Upstream's `install` as its image's `install-cni` container runs it, with no container
/// runtime: in a private mount namespace, chrooted into a folder laid out as its image
/// (`/opt/cni/bin` holding upstream's binaries from `upstream_bin` and the reference
/// plugins), with the node's CNI folders bind-mounted at /host/opt/cni/bin and
/// /host/etc/cni/net.d and the service-account files at their in-cluster path, in the node's
/// netns. The mounts go with the namespace.
pub fn install_upstream_cni(i: &InstallInputs, upstream_bin: &Path) -> &'static str {
    let (env, sa) = i.daemonset_env();
    let root = i.scratch.join("upstream-install-root");
    image_layout(
        &root.join("opt/cni/bin"),
        &upstream_bin.join("calico"),
        Some(&upstream_bin.join("install")),
    );
    for d in ["host/opt/cni/bin", "host/etc/cni/net.d", "tmp"] {
        fs::create_dir_all(root.join(d)).unwrap();
    }
    let secrets = root.join("var/run/secrets/kubernetes.io/serviceaccount");
    fs::create_dir_all(&secrets).unwrap();
    for f in ["token", "ca.crt", "namespace"] {
        fs::copy(sa.join(f), secrets.join(f)).unwrap();
    }
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--net={}", i.host_netns))
        .args(["unshare", "--mount", "--propagation", "private", "--"])
        .args(["sh", "-c"])
        .arg(
            "mount --bind \"$1\" \"$3/host/opt/cni/bin\" && \
             mount --bind \"$2\" \"$3/host/etc/cni/net.d\" && \
             exec chroot \"$3\" /opt/cni/bin/install",
        )
        .arg("sh")
        .args([i.bin_dir, i.conf_dir, &root])
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    let out = run_command_within(cmd, "", Duration::from_secs(300), "upstream install");
    assert_eq!(
        out.code, 0,
        "upstream install-cni: {}{}",
        out.stdout, out.stderr
    );
    assert!(i.conf_dir.join(CONFLIST_NAME).is_file());
    assert!(i.conf_dir.join("calico-kubeconfig").is_file());
    "upstream's install, chrooted into its image's layout"
}

/// Test instrumentation, not part of the install: puts a recorder in front of `calico` in
/// `bin_dir`. Each call leaves `<rec>/callXXXXXXXX.env` (its CNI_* variables), `.in` (its
/// stdin) and `.t` (its start, in seconds), then the recorder execs the real binary: the
/// process the runtime waits for, and kills when its request is cancelled, is the plugin
/// itself. The real binary moves to `bin_dir/.recorded/calico` (argv[0] still ends in
/// `calico`) and `calico-ipam` points at it, so calico still finds its IPAM to be itself
/// and runs it in-process.
pub fn record_calls(bin_dir: &Path, rec: &Path) {
    fs::create_dir_all(rec).unwrap();
    let real_dir = bin_dir.join(".recorded");
    fs::create_dir_all(&real_dir).unwrap();
    let real = real_dir.join("calico");
    fs::rename(bin_dir.join("calico"), &real).unwrap();
    fs::remove_file(bin_dir.join("calico-ipam")).unwrap();
    std::os::unix::fs::symlink(".recorded/calico", bin_dir.join("calico-ipam")).unwrap();
    let script = format!(
        "#!/bin/sh\n\
         f=$(mktemp {rec}/callXXXXXXXX)\n\
         date +%s.%N > \"$f.t\"\n\
         env | grep '^CNI_' > \"$f.env\"\n\
         cat > \"$f.in\"\n\
         exec {real} \"$@\" < \"$f.in\"\n",
        rec = rec.display(),
        real = real.display()
    );
    let wrapper = bin_dir.join("calico");
    fs::write(&wrapper, script).unwrap();
    fs::set_permissions(&wrapper, fs::Permissions::from_mode(0o755)).unwrap();
}

/// One recorded plugin call.
#[derive(Debug, Clone)]
pub struct RecordedCall {
    pub env: BTreeMap<String, String>,
    pub stdin: Value,
    pub start: f64,
}

impl RecordedCall {
    pub fn command(&self) -> &str {
        self.env
            .get("CNI_COMMAND")
            .map(String::as_str)
            .unwrap_or("")
    }
    pub fn container_id(&self) -> &str {
        self.env
            .get("CNI_CONTAINERID")
            .map(String::as_str)
            .unwrap_or("")
    }
}

fn env_has_command(env: &BTreeMap<String, String>) -> bool {
    env.get("CNI_COMMAND").is_some_and(|c| !c.is_empty())
}

/// The calls recorded so far, in start order (a call still being recorded is left out).
pub fn read_recorded_calls(rec: &Path) -> Vec<RecordedCall> {
    let mut calls = vec![];
    for e in fs::read_dir(rec).into_iter().flatten().flatten() {
        let p = e.path();
        if p.extension().is_some() {
            continue;
        }
        let with = |ext: &str| fs::read_to_string(p.with_extension(ext)).unwrap_or_default();
        let env: BTreeMap<String, String> = with("env")
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        // A call that started while this was read has not written its variables and
        // stdin yet.
        let stdin: Value = serde_json::from_str(&with("in")).unwrap_or(Value::Null);
        if !env_has_command(&env) || stdin.is_null() {
            continue;
        }
        calls.push(RecordedCall {
            env,
            stdin,
            start: with("t").trim().parse().unwrap_or(0.0),
        });
    }
    calls.sort_by(|a, b| a.start.total_cmp(&b.start));
    calls
}

/// Locked (flock) by each [`RealNode`] for its whole life: one node on this host at a time,
/// whichever test process runs it. What a node records and restores ([`HostState`]:
/// kubelet's sysctls, the directories it and containerd make outside their roots, removed
/// when they were absent before) is the host's, not the node's: two nodes overlapping (the
/// real node suite's and critest's, which share one test binary, or two runs at once) would
/// each restore, or remove, what the other still uses.
const ONE_NODE_AT_A_TIME: &str = "/run/calico-cni-rs-real-node.lock";

/// Waits for the host to be free of other nodes; it is again when the lock is dropped (or
/// its process ends).
fn lock_the_host() -> Flock<fs::File> {
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(ONE_NODE_AT_A_TIME)
        .unwrap_or_else(|e| panic!("open {ONE_NODE_AT_A_TIME}: {e}"));
    Flock::lock(file, FlockArg::LockExclusive)
        .unwrap_or_else(|(_, e)| panic!("flock {ONE_NODE_AT_A_TIME}: {e}"))
}

/// Numbers the nodes of this process (their cgroup roots).
static NODES: AtomicUsize = AtomicUsize::new(0);

/// The node: its netns (with an uplink, 198.18.0.1), the API server, containerd, kubelet.
/// A node of a [`NodePair`] shares the other's API server and the host's lock.
pub struct RealNode {
    pub name: String,
    kubelet: Option<Kubelet>,
    containerd: Option<Containerd>,
    pub api: Option<Arc<RealK8s>>,
    pub host: HostNetns,
    /// The address kubelet registers and the installer is given for the API server: the
    /// uplink's and 127.0.0.1 for a node alone, the node link's for a pair.
    pub node_ip: String,
    pub api_host: String,
    state: Option<HostState>,
    pub dir: TempDir,
    pub peers: NodePeers,
    pub cgroup_root: String,
    /// Dropped last, after the teardown has restored the host.
    _host: Arc<Flock<fs::File>>,
}

/// Two nodes on one API server (in node `a`'s netns), joined by a veth (`nodelink0`,
/// [`NODE_LINK_V4`]) over which each reaches the API server and the other's pods: the
/// test routes each pod's address to its node ([`NodePair::route_pods`]), as BGP would.
/// Field order is drop order: `b` goes first, then `a` and the API server.
pub struct NodePair {
    pub b: RealNode,
    pub a: RealNode,
}

pub const NODE_LINK_IF: &str = "nodelink0";

impl NodePair {
    pub fn new(peers: &NodePeers, names: [&str; 2]) -> NodePair {
        let mut a = RealNode::new(peers, names[0]);
        let b = RealNode {
            name: names[1].into(),
            kubelet: None,
            containerd: None,
            api: a.api.clone(),
            host: HostNetns::new(),
            node_ip: NODE_LINK_V4[1].into(),
            api_host: NODE_LINK_V4[0].into(),
            state: None,
            dir: TempDir::new("real-node"),
            peers: peers.clone(),
            cgroup_root: next_cgroup_root(),
            _host: a._host.clone(),
        };
        a.node_ip = NODE_LINK_V4[0].into();
        a.api_host = NODE_LINK_V4[0].into();
        let out = run_command_within(
            {
                let mut c = Command::new("ip");
                c.args(["-n", a.host.name(), "link", "add", NODE_LINK_IF])
                    .args(["type", "veth", "peer", "name", NODE_LINK_IF])
                    .args(["netns", b.host.name()]);
                c
            },
            "",
            Duration::from_secs(10),
            "ip link add nodelink0",
        );
        assert_eq!(out.code, 0, "{}", out.stderr);
        for (node, ip) in [(&a, NODE_LINK_V4[0]), (&b, NODE_LINK_V4[1])] {
            // calico/node turns forwarding on in a real cluster.
            node.host_sh(&format!(
                "set -e; ip addr add {ip}/24 dev {NODE_LINK_IF}; ip link set {NODE_LINK_IF} up; \
                 sysctl -qw net.ipv4.ip_forward=1"
            ));
        }
        NodePair { b, a }
    }

    /// Routes each pod address of `pods` (whether it runs on `a`, its address) to its node,
    /// on the other node: what BGP would do.
    pub fn route_pods(&self, pods: &[(bool, String)]) {
        for (on_a, ip) in pods {
            let (other, via) = if *on_a {
                (&self.b, NODE_LINK_V4[0])
            } else {
                (&self.a, NODE_LINK_V4[1])
            };
            other.host_sh(&format!(
                "ip route replace {ip}/32 via {via} dev {NODE_LINK_IF}"
            ));
        }
    }

    pub fn both(&self) -> [&RealNode; 2] {
        [&self.a, &self.b]
    }
}

fn next_cgroup_root() -> String {
    format!(
        "calico-real-node-{}-{}",
        std::process::id(),
        NODES.fetch_add(1, Ordering::SeqCst)
    )
}

/// Which installer sets a node's CNI up.
#[derive(Clone, Copy, Debug)]
pub enum Installer<'a> {
    /// Ours, as the image's `install-cni` runs it ([`install_cni`]).
    Ours,
    /// Upstream's `install`, from the folder of upstream's binaries (`CALICO_UPSTREAM_BIN`),
    /// with those binaries as its image's /opt/cni/bin ([`install_upstream_cni`]).
    Upstream(&'a Path),
}

impl RealNode {
    pub fn api(&self) -> &RealK8s {
        self.api.as_deref().expect("api server")
    }
    pub fn containerd(&self) -> &Containerd {
        self.containerd.as_ref().expect("containerd")
    }
    pub fn kubelet(&self) -> &Kubelet {
        self.kubelet.as_ref().expect("kubelet")
    }
    pub fn cni_bin(&self) -> PathBuf {
        self.dir.path().join("cni/bin")
    }
    pub fn cni_conf(&self) -> PathBuf {
        self.dir.path().join("cni/net.d")
    }
    /// Where the node's installer and plugin keep their files (the plugin's log, its IPAM
    /// lock, the installer's service-account mount).
    pub fn scratch(&self) -> PathBuf {
        self.dir.path().join("scratch")
    }

    /// The netns and the API server with Calico's CRDs and RBAC.
    pub fn new(peers: &NodePeers, name: &str) -> RealNode {
        let host_lock = Arc::new(lock_the_host());
        let dir = TempDir::new("real-node");
        let host = HostNetns::new();
        let api = RealK8s::start(&host);
        RealNode {
            name: name.into(),
            kubelet: None,
            containerd: None,
            api: Some(Arc::new(api)),
            host,
            node_ip: UPLINK_V4.into(),
            api_host: "127.0.0.1".into(),
            state: None,
            dir,
            peers: peers.clone(),
            cgroup_root: next_cgroup_root(),
            _host: host_lock,
        }
    }

    /// containerd (with the pause and busybox images imported) and kubelet; waits for the
    /// node to be Ready (which needs the CNI config in place).
    pub fn start_runtime(&mut self) {
        self.start_containerd();
        let kubeconfig = self.api().kubeconfig_with(&self.api().admin_token());
        let kubeconfig = if self.api_host == "127.0.0.1" {
            kubeconfig
        } else {
            // The API server as this node reaches it.
            let text = fs::read_to_string(&kubeconfig).expect("kubeconfig");
            let here = self.dir.path().join("kubelet.kubeconfig");
            fs::write(
                &here,
                text.replace(
                    &self.api().url(),
                    &format!("https://{}:{}", self.api_host, self.api().port()),
                ),
            )
            .expect("write kubeconfig");
            here
        };
        let k = Kubelet::start(self, &kubeconfig);
        self.kubelet = Some(k);
        self.wait_ready(Duration::from_secs(90));
    }

    /// containerd alone, with the pause and busybox images imported (critest drives it
    /// through CRI as kubelet would).
    pub fn start_containerd(&mut self) {
        self.state = Some(HostState::record(&self.cgroup_root));
        let cd = Containerd::start(
            &self.peers,
            &self.dir.path().join("containerd"),
            self.host.path(),
            &self.cni_bin(),
            &self.cni_conf(),
        );
        let images = self.dir.path().join("images");
        fs::create_dir_all(&images).unwrap();
        cd.import(&build_busybox_image(
            &images,
            PAUSE_IMAGE,
            Some(&["/bin/sleep", "2147483647"]),
        ));
        cd.import(&build_busybox_image(&images, BUSYBOX_IMAGE, None));
        self.containerd = Some(cd);
    }

    pub fn wait_ready(&self, limit: Duration) {
        wait_until("the node to be Ready", limit, || {
            self.kubelet().daemon().assert_running();
            self.containerd().daemon().assert_running();
            let node = self.api().get(&format!("/api/v1/nodes/{}", self.name))?;
            node["status"]["conditions"]
                .as_array()?
                .iter()
                .any(|c| c["type"] == "Ready" && c["status"] == "True")
                .then_some(())
        });
    }

    /// What an operator applies before Calico's DaemonSet runs, on the Kubernetes
    /// datastore: the ClusterInformation and one IPv4 pool (`pool_cidr`, /26 blocks).
    pub fn apply_calico_resources(&self, cluster_guid: &str, pool_cidr: &str) {
        let api = self.api();
        let crd = "/apis/crd.projectcalico.org/v1";
        for (path, obj) in [
            (
                format!("{crd}/clusterinformations"),
                json!({"apiVersion":"crd.projectcalico.org/v1","kind":"ClusterInformation",
                    "metadata":{"name":"default"},
                    "spec":{"clusterGUID":cluster_guid,"clusterType":"k8s,kdd",
                        "calicoVersion":"v3.32.1","datastoreReady":true}}),
            ),
            (
                format!("{crd}/ippools"),
                json!({"apiVersion":"crd.projectcalico.org/v1","kind":"IPPool",
                    "metadata":{"name":"default-ipv4-ippool"},
                    "spec":{"cidr":pool_cidr,"blockSize":26,"ipipMode":"Never",
                        "vxlanMode":"Never","natOutgoing":true,"nodeSelector":"all()"}}),
            ),
        ] {
            let a = api.post(&path, obj);
            assert_eq!(a.status, 201, "POST {path}: {a:?}");
        }
    }

    /// Calico as an operator and its DaemonSet set a node up: [`Self::apply_calico_resources`],
    /// then our image's `install` run as the `install-cni` container ([`Self::install`]).
    /// Returns the scratch folder and how the installer ran ([`install_cni`]).
    pub fn install_calico(
        &self,
        cluster_guid: &str,
        pool_cidr: &str,
        network_config: impl FnOnce(&Path) -> String,
    ) -> (PathBuf, &'static str) {
        self.apply_calico_resources(cluster_guid, pool_cidr);
        let how = self.install(Installer::Ours, &network_config(&self.scratch()), &[]);
        (self.scratch(), how)
    }

    /// The DaemonSet's `install-cni` container on this node, by `installer`, with
    /// calico-node's mounted token (the installer gets the calico-cni-plugin
    /// ServiceAccount's own from TokenRequest), the DaemonSet's `CNI_NETWORK_CONFIG`
    /// (`network_config`) and `extra_env` (the etcd manifest's `ETCD_ENDPOINTS`). Returns
    /// how the installer ran.
    pub fn install(
        &self,
        installer: Installer,
        network_config: &str,
        extra_env: &[(&str, &str)],
    ) -> &'static str {
        let api = self.api();
        let pod_token = super::installer::calico_node_account(api);
        let scratch = self.scratch();
        fs::create_dir_all(&scratch).unwrap();
        let inputs = InstallInputs {
            bin_dir: &self.cni_bin(),
            conf_dir: &self.cni_conf(),
            network_config,
            host_netns: self.host.path(),
            service_host: &self.api_host,
            service_port: api.port(),
            pod_token: &pod_token,
            ca_pem: &api.ca_pem(),
            node_name: &self.name,
            scratch: &scratch,
            extra_env,
        };
        match installer {
            Installer::Ours => install_cni(&inputs),
            Installer::Upstream(bin) => install_upstream_cni(&inputs, bin),
        }
    }

    pub fn host_sh(&self, script: &str) -> String {
        self.host.sh(script)
    }

    /// Stops everything the node started, in order.
    fn teardown(&mut self) {
        if let Some(k) = self.kubelet.take() {
            k.daemon().stop();
        }
        // Containers first (they live in this node's cgroups), then the shims, then containerd.
        if let Some(state) = &self.state {
            for pid in state.cgroup_pids() {
                kill(pid, libc::SIGKILL);
            }
        }
        let containerd_log = self.containerd.as_ref().map(|c| c.log_path().to_path_buf());
        if let Some(cd) = self.containerd.take() {
            for pid in cd.shim_pids() {
                kill(pid, libc::SIGKILL);
            }
            cd.daemon().stop();
            let started = Instant::now();
            while !cd.shim_pids().is_empty() && started.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        if let Some(log) = &containerd_log {
            remove_runtime_leftovers(log, &self.dir.path().join("containerd/containerd.sock"));
        }
        unmount_under(self.dir.path());
        self.api.take();
        self.state.take();
    }
}

impl RealNode {
    /// On a failure: the daemons' last log lines (kubelet's errors only) and the plugin's.
    fn dump_logs(&self) {
        use std::io::Write as _;
        let mut err = std::io::stderr();
        let kubelet_log = self.dir.path().join("kubelet/kubelet.log");
        let errors: Vec<String> = fs::read_to_string(&kubelet_log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.starts_with('E'))
            .map(|l| l.chars().take(400).collect())
            .collect();
        let _ = writeln!(
            err,
            "--- kubelet errors (last 25) ---\n{}",
            errors[errors.len().saturating_sub(25)..].join("\n")
        );
        for (what, path) in [
            (
                "containerd",
                self.dir.path().join("containerd/containerd.log"),
            ),
            ("cni.log", self.dir.path().join("scratch/cni.log")),
            (
                "kube-apiserver",
                self.dir.path().join("apiserver/kube-apiserver.log"),
            ),
        ] {
            let _ = writeln!(err, "--- {what} (last 25 lines) ---\n{}", tail(&path, 25));
        }
    }
}

impl Drop for RealNode {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.dump_logs();
        }
        self.teardown();
        if std::env::var_os("REAL_NODE_KEEP").is_some() {
            // Debugging aid: the logs and state stay (everything started is stopped).
            let _ = writeln_stderr(&format!("kept {}", self.dir.path().display()));
            self.dir.0 = PathBuf::new();
        }
    }
}
