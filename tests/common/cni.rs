#![allow(dead_code)]
//! Running the built binary the way kubelet does: CNI_* env + config on stdin, result on
//! stdout, exit code; inside a test "host" netns so routes and sysctls never touch the real
//! host. `Bin` lays out a CNI_PATH with `calico`, the `calico-ipam` symlink and Debian's
//! reference plugins.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// A per-test scratch directory, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(prefix: &str) -> TempDir {
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let p = std::env::temp_dir().join(format!("{prefix}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("create temp dir");
        TempDir(p)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A CNI_PATH directory: calico, calico-ipam -> calico, and /usr/lib/cni plugins.
pub struct Bin {
    pub dir: TempDir,
}

impl Bin {
    pub fn new() -> Bin {
        Bin::with_calico(Path::new(env!("CARGO_BIN_EXE_calico")))
    }

    /// The same layout around another `calico` binary (upstream's, to run a scenario with
    /// both).
    pub fn with_calico(exe: &Path) -> Bin {
        let dir = TempDir::new("cni-bin");
        std::os::unix::fs::symlink(exe, dir.path().join("calico")).expect("symlink calico");
        std::os::unix::fs::symlink("calico", dir.path().join("calico-ipam"))
            .expect("symlink calico-ipam");
        for p in ["host-local", "portmap", "bandwidth", "ptp", "loopback"] {
            let src = Path::new("/usr/lib/cni").join(p);
            if src.exists() {
                let _ = std::os::unix::fs::symlink(&src, dir.path().join(p));
            }
        }
        Bin { dir }
    }

    pub fn path(&self) -> String {
        self.dir.path().display().to_string()
    }

    pub fn plugin(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Runs plugin `name` (`calico`, `calico-ipam`) from this CNI_PATH inside the netns
    /// `host`, as kubelet would run it there.
    pub fn run(&self, name: &str, host: &str, inv: &Invocation, conf: &str) -> Outcome {
        run_plugin(&self.plugin(name), &self.path(), Some(host), inv, conf)
    }

    /// `run`, not waited for (`spawn_plugin`).
    pub fn spawn(
        &self,
        name: &str,
        host: &str,
        inv: &Invocation,
        conf: &str,
    ) -> std::process::Child {
        spawn_plugin(&self.plugin(name), &self.path(), Some(host), inv, conf)
    }
}

/// Upstream's `calico` binary, when `CALICO_UPSTREAM_BIN` names the folder holding it (as
/// for the differential suite).
pub fn upstream_calico() -> Option<PathBuf> {
    let dir = std::env::var_os("CALICO_UPSTREAM_BIN")?;
    let calico = PathBuf::from(dir).join("calico");
    calico.is_file().then_some(calico)
}

/// One plugin invocation's environment.
#[derive(Clone, Debug, Default)]
pub struct Invocation {
    pub command: String,
    pub container_id: String,
    pub netns: String,
    pub ifname: String,
    pub args: String,
    pub extra_env: Vec<(String, String)>,
    /// Leave these CNI_* variables out entirely.
    pub unset: Vec<String>,
    /// A shell snippet run (as root, in the host netns, in a private mount namespace)
    /// just before the plugin is exec'd, e.g. to make /proc/sys/net/ipv6 vanish.
    pub prefix: Option<String>,
}

impl Invocation {
    pub fn new(command: &str, container_id: &str, netns: &str) -> Invocation {
        Invocation {
            command: command.into(),
            container_id: container_id.into(),
            netns: netns.into(),
            ifname: "eth0".into(),
            ..Default::default()
        }
    }

    pub fn k8s(mut self, namespace: &str, pod: &str) -> Invocation {
        self.args = format!(
            "K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={pod};K8S_POD_INFRA_CONTAINER_ID={}",
            self.container_id
        );
        self
    }

    /// CNI_ARGS as `calico` passes them to its IPAM plugin: `IgnoreUnknown=1` first.
    pub fn via_calico(mut self) -> Invocation {
        self.args = if self.args.is_empty() {
            "IgnoreUnknown=1".into()
        } else {
            format!("IgnoreUnknown=1;{}", self.args)
        };
        self
    }

    pub fn with_args(mut self, args: &str) -> Invocation {
        self.args = args.into();
        self
    }

    /// The same invocation as a DEL.
    pub fn as_del(&self) -> Invocation {
        Invocation {
            command: "DEL".into(),
            ..self.clone()
        }
    }

    /// The same invocation as a CHECK (its stdin needs the previous result: see
    /// [`with_prev_result`]).
    pub fn as_check(&self) -> Invocation {
        Invocation {
            command: "CHECK".into(),
            ..self.clone()
        }
    }

    pub fn ifname(mut self, ifname: &str) -> Invocation {
        self.ifname = ifname.into();
        self
    }
}

/// `conf` with `result` as its `prevResult`, as libcni sends CHECK (and DEL).
pub fn with_prev_result(conf: &str, result: &serde_json::Value) -> String {
    let mut v: serde_json::Value = serde_json::from_str(conf).expect("conf is JSON");
    v["prevResult"] = result.clone();
    v.to_string()
}

/// What a plugin run produced.
#[derive(Debug)]
pub struct Outcome {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
    /// How long the process ran.
    pub elapsed: Duration,
}

/// No plugin call may hang: every run is bounded, and one that does not exit in time is
/// killed and fails the test.
pub const PLUGIN_TIMEOUT: Duration = Duration::from_secs(60);

/// The bound on a call that fails (or succeeds) fast: not waiting on any timeout of its own.
pub const FAST: Duration = Duration::from_secs(20);

impl Outcome {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| {
            panic!(
                "stdout is not JSON ({e}): {:?}\nstderr: {}",
                self.stdout, self.stderr
            )
        })
    }

    pub fn assert_ok(&self) -> &Outcome {
        assert_eq!(
            self.code, 0,
            "plugin failed: stdout={} stderr={}",
            self.stdout, self.stderr
        );
        self
    }

    /// `assert_ok`, within `FAST`.
    pub fn assert_ok_fast(&self) {
        self.assert_ok();
        assert!(self.elapsed < FAST, "took {:?}", self.elapsed);
    }

    /// `assert_err`, within `FAST`; returns the error object.
    pub fn assert_err_fast(&self) -> serde_json::Value {
        assert!(self.elapsed < FAST, "took {:?}", self.elapsed);
        self.assert_err()
    }

    /// Asserts a CNI error JSON and a non-zero exit; returns the error object.
    pub fn assert_err(&self) -> serde_json::Value {
        assert_ne!(
            self.code, 0,
            "plugin unexpectedly succeeded: {}",
            self.stdout
        );
        let v = self.json();
        assert!(
            v.get("code").is_some() && v.get("msg").is_some(),
            "not a CNI error: {v}"
        );
        v
    }
}

/// Runs `plugin` (a path) with `inv` and `stdin`, inside `host_netns` when given, and
/// asserts that it exits within `PLUGIN_TIMEOUT`.
pub fn run_plugin(
    plugin: &Path,
    cni_path: &str,
    host_netns: Option<&str>,
    inv: &Invocation,
    stdin: &str,
) -> Outcome {
    run_plugin_within(plugin, cni_path, host_netns, inv, stdin, PLUGIN_TIMEOUT)
}

/// `run_plugin` with an explicit bound: a process still running after `limit` is killed
/// and the test fails, naming the hang.
pub fn run_plugin_within(
    plugin: &Path,
    cni_path: &str,
    host_netns: Option<&str>,
    inv: &Invocation,
    stdin: &str,
    limit: Duration,
) -> Outcome {
    let cmd = plugin_command(plugin, cni_path, host_netns, inv);
    let what = format!("{} {}", plugin.display(), inv.command);
    run_command_within(cmd, stdin, limit, &what)
}

/// The plugin started as `run_plugin` starts it, its output discarded, not waited for: the
/// process is the plugin's own (`ip netns exec` execs it), for a test to kill.
pub fn spawn_plugin(
    plugin: &Path,
    cni_path: &str,
    host_netns: Option<&str>,
    inv: &Invocation,
    stdin: &str,
) -> std::process::Child {
    let mut child = plugin_command(plugin, cni_path, host_netns, inv)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {}: {e}", plugin.display()));
    if let Some(mut input) = child.stdin.take() {
        let _ = input.write_all(stdin.as_bytes());
    }
    child
}

/// The command that runs `plugin` for `inv`, as kubelet would run it in `host_netns`.
fn plugin_command(
    plugin: &Path,
    cni_path: &str,
    host_netns: Option<&str>,
    inv: &Invocation,
) -> Command {
    let mut cmd = match (host_netns, &inv.prefix) {
        (Some(ns), Some(prefix)) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, "unshare", "-m", "sh", "-c"])
                .arg(format!("{prefix} && exec \"$0\""))
                .arg(plugin);
            c
        }
        (Some(ns), None) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(plugin);
            c
        }
        (None, _) => Command::new(plugin),
    };
    let env = [
        ("CNI_COMMAND", inv.command.as_str()),
        ("CNI_CONTAINERID", inv.container_id.as_str()),
        ("CNI_NETNS", inv.netns.as_str()),
        ("CNI_IFNAME", inv.ifname.as_str()),
        ("CNI_ARGS", inv.args.as_str()),
        ("CNI_PATH", cni_path),
    ];
    for (k, v) in env {
        cmd.env_remove(k);
        if !inv.unset.iter().any(|u| u == k) {
            cmd.env(k, v);
        }
    }
    for (k, v) in &inv.extra_env {
        cmd.env(k, v);
    }
    cmd
}

/// Runs `cmd` with `stdin`, capturing stdout and stderr; a process still running after
/// `limit` is killed and the test fails, naming the hang as `what`.
pub fn run_command_within(mut cmd: Command, stdin: &str, limit: Duration, what: &str) -> Outcome {
    let started = Instant::now();
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {what}: {e}"));
    let pid = child.id() as i32;
    if let Some(mut input) = child.stdin.take() {
        let _ = input.write_all(stdin.as_bytes());
    }
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let out = match rx.recv_timeout(limit) {
        Ok(out) => out.unwrap_or_else(|e| panic!("wait for {what}: {e}")),
        Err(_) => {
            // SAFETY: kill(2) on the PID we spawned; at worst it is already gone.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            let out = rx.recv().ok().and_then(|o| o.ok());
            panic!(
                "{what} did not exit within {limit:?} (hang); stderr: {}",
                out.map(|o| String::from_utf8_lossy(&o.stderr).into_owned())
                    .unwrap_or_default()
            );
        }
    };
    Outcome {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        elapsed: started.elapsed(),
    }
}

/// Runs `plugin <flag>` (e.g. `calico -t`) in `netns` with `stdin`: (exit code, stdout, time).
pub fn run_flag(
    plugin: &Path,
    netns: &str,
    flag: &str,
    stdin: &str,
) -> (i32, String, std::time::Duration) {
    use std::io::Write;
    let start = std::time::Instant::now();
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", netns])
        .arg(plugin)
        .arg(flag)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            if let Some(mut input) = c.stdin.take() {
                input.write_all(stdin.as_bytes())?;
            }
            c.wait_with_output()
        })
        .expect("run the plugin");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        start.elapsed(),
    )
}

/// Reports a test that cannot run here, visibly: written straight to the process's stderr,
/// which libtest does not capture (an `eprintln!` of a passing test would be swallowed).
/// In CI (`CI` set) a skip is a failure: CI has every tool, so a missing one is a bug.
pub fn report_skip(test: &str, reason: &str) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {reason}");
    if std::env::var_os("CI").is_some_and(|v| !v.is_empty()) {
        panic!("SKIPPED {test} in CI (CI is set, where nothing may be skipped): {reason}");
    }
}
