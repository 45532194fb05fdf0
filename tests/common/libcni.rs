#![allow(dead_code)]
//! The libcni driver: `tests/libcni/main.go`, a tiny CNI runtime on libcni (the library
//! containerd, CRI-O and podman run plugins with), built once per test process from Debian's
//! golang-go + golang-github-appc-cni-dev (libcni 1.1.2), offline, in GOPATH mode. When Go
//! or the libcni sources are missing the fixture installs them with apt; a test skips (and
//! says why on stderr) only when that fails.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use super::apt;
use super::cni::{report_skip, run_command_within, Outcome};

/// Where Debian's golang-github-appc-cni-dev puts the CNI library.
const GOPATH: &str = "/usr/share/gocode";
const LIBCNI_SRC: &str = "/usr/share/gocode/src/github.com/containernetworking/cni/libcni";
const PACKAGES: &[&str] = &["golang-go", "golang-github-appc-cni-dev"];
/// Bound on the one-time build (0.5 s with a warm Go cache, a few seconds cold).
const BUILD_TIMEOUT: Duration = Duration::from_secs(300);
/// Bound on one driver run; the driver's own context deadline (`LIBCNI_TIMEOUT_SECONDS`,
/// which makes libcni kill a plugin) is shorter, so a hung plugin shows as a libcni error.
pub const DRIVER_TIMEOUT: Duration = Duration::from_secs(90);
const DRIVER_CONTEXT_SECONDS: &str = "75";

/// The built driver binary.
#[derive(Debug)]
pub struct Driver {
    pub path: PathBuf,
}

static DRIVER: OnceLock<Result<Driver, String>> = OnceLock::new();

/// The driver, built on first use; `Err` says why it cannot be built here.
pub fn driver() -> Result<&'static Driver, &'static str> {
    DRIVER.get_or_init(build).as_ref().map_err(String::as_str)
}

/// The driver, or `None` after reporting (visibly) why `test` is skipped.
pub fn driver_or_skip(test: &str) -> Option<&'static Driver> {
    match driver() {
        Ok(d) => Some(d),
        Err(why) => {
            report_skip(test, why);
            None
        }
    }
}

fn go_ready() -> bool {
    Path::new(LIBCNI_SRC).is_dir()
        && Command::new("go")
            .arg("version")
            .output()
            .is_ok_and(|o| o.status.success())
}

/// Builds tests/libcni into target/tmp/libcni-driver/libcni-driver (one file, replaced
/// atomically each run; Go's build cache beside it).
fn build() -> Result<Driver, String> {
    apt::ensure(PACKAGES, go_ready).map_err(|e| format!("Go/libcni cannot be installed: {e}"))?;
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/libcni");
    let out_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("libcni-driver");
    std::fs::create_dir_all(&out_dir).map_err(|e| format!("create {}: {e}", out_dir.display()))?;
    let tmp = out_dir.join(format!("libcni-driver.{}", std::process::id()));
    let path = out_dir.join("libcni-driver");
    let mut cmd = Command::new("go");
    cmd.args(["build", "-o"])
        .arg(&tmp)
        .arg(".")
        .current_dir(&src)
        .env("GOPATH", GOPATH)
        .env("GO111MODULE", "off")
        .env("GOFLAGS", "")
        .env("CGO_ENABLED", "0")
        .env("GOCACHE", out_dir.join("gocache"));
    let out = run_command_within(cmd, "", BUILD_TIMEOUT, "go build (libcni driver)");
    if out.code != 0 {
        let _ = std::fs::remove_file(&tmp);
        return Err(format!(
            "go build of {} failed: {}",
            src.display(),
            out.stderr
        ));
    }
    std::fs::rename(&tmp, &path).map_err(|e| format!("rename {}: {e}", tmp.display()))?;
    Ok(Driver { path })
}

/// What a runtime hands libcni besides the conflist: where the plugins are, the result
/// cache, CNI_ARGS and the capability arguments (`runtimeConfig`).
#[derive(Clone, Debug, Default)]
pub struct RuntimeEnv {
    pub cni_path: String,
    pub cache_dir: PathBuf,
    pub ifname: String,
    pub cni_args: String,
    /// A JSON object, e.g. `{"portMappings":[...],"bandwidth":{...}}`.
    pub cap_args: Option<serde_json::Value>,
    /// PATH for the runtime and its plugins (portmap runs iptables from it); `None` for
    /// [`DEFAULT_PATH`].
    pub path: Option<String>,
}

pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

impl Driver {
    /// `libcni-driver <args...>` inside `netns` (the node's netns: the plugins it execs
    /// inherit it), bounded by [`DRIVER_TIMEOUT`].
    pub fn run(&self, netns: Option<&str>, args: &[&str], env: &RuntimeEnv) -> Outcome {
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&self.path);
                c
            }
            None => Command::new(&self.path),
        };
        cmd.args(args)
            .env("CNI_PATH", &env.cni_path)
            .env("CNI_CACHE_DIR", &env.cache_dir)
            .env(
                "CNI_IFNAME",
                if env.ifname.is_empty() {
                    "eth0"
                } else {
                    &env.ifname
                },
            )
            .env("CNI_ARGS", &env.cni_args)
            .env("LIBCNI_TIMEOUT_SECONDS", DRIVER_CONTEXT_SECONDS)
            .env("PATH", env.path.as_deref().unwrap_or(DEFAULT_PATH));
        match &env.cap_args {
            Some(v) => cmd.env("CAP_ARGS", v.to_string()),
            None => cmd.env_remove("CAP_ARGS"),
        };
        for k in ["CNI_COMMAND", "CNI_CONTAINERID", "CNI_NETNS"] {
            cmd.env_remove(k);
        }
        let what = format!("libcni-driver {}", args.join(" "));
        run_command_within(cmd, "", DRIVER_TIMEOUT, &what)
    }

    /// `add|check|del|cached` of `conflist` for one container.
    pub fn call(
        &self,
        host: &str,
        verb: &str,
        conflist: &Path,
        container_id: &str,
        netns: &str,
        env: &RuntimeEnv,
    ) -> Outcome {
        let conf = conflist.display().to_string();
        self.run(Some(host), &[verb, &conf, container_id, netns], env)
    }

    /// libcni's ValidateNetworkList: the capabilities, or the error text.
    pub fn validate(&self, conflist: &Path, cni_path: &str) -> Result<Vec<String>, String> {
        let env = RuntimeEnv {
            cni_path: cni_path.into(),
            ..Default::default()
        };
        let out = self.run(None, &["validate", &conflist.display().to_string()], &env);
        if out.code != 0 {
            return Err(out.stderr);
        }
        serde_json::from_str(&out.stdout).map_err(|e| format!("{e}: {}", out.stdout))
    }
}

/// A PATH for the runtime with iptables but without ip6tables, made in `scratch`, then
/// `/usr/local/bin:/usr/bin:/bin`. Debian's portmap 1.1.1 CHECKs a pod's DNAT chain in the
/// IPv4 *and* the IPv6 nat table whenever both tools work, so its CHECK fails for every pod
/// (an IPv4 pod has no IPv6 chain; a dual-stack pod's IPv4 rules are not in ip6tables):
/// containernetworking/plugins#819, fixed in 1.2.0. Without ip6tables it checks the IPv4
/// table only, as on an IPv4-only node.
pub fn ipv4_only_path(scratch: &Path) -> String {
    let dir = scratch.join("sbin-ipv4-only");
    std::fs::create_dir_all(&dir).expect("create the PATH dir");
    for tool in ["iptables", "iptables-save", "iptables-restore"] {
        let real = Path::new("/usr/sbin").join(tool);
        assert!(
            real.exists(),
            "{} missing (apt-get install iptables)",
            real.display()
        );
        let link = dir.join(tool);
        if !link.exists() {
            std::os::unix::fs::symlink(&real, &link).expect("symlink iptables");
        }
    }
    format!("{}:/usr/local/bin:/usr/bin:/bin", dir.display())
}
