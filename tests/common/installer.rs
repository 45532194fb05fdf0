#![allow(dead_code)]
//! The node installer's world for the tests: an image's /opt/cni/bin (this build as `calico`,
//! with `calico-ipam` and `install` links) and a host's mounted directories, in one temp dir,
//! and the installer run as the DaemonSet's `install-cni` container runs it, with its container
//! paths moved there (`CALICO_INSTALL_*`).

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::json;

use super::cni::{report_skip, run_command_within, Outcome, TempDir};
use super::netns::{require_root, Netns};
use super::real_k8s::RealK8s;

pub const CALICO: &str = env!("CARGO_BIN_EXE_calico");
/// What `-v` prints: the release it replaces, ours as semver build metadata (src/lib.rs).
pub const VERSION: &str = concat!("v3.32.1+calico-cni-rs.", env!("CARGO_PKG_VERSION"));

/// An image's /opt/cni/bin and a host's mounted directories, in one temp dir.
pub struct Node {
    pub dir: TempDir,
}

impl Node {
    /// The image holds our binary as `calico` with `calico-ipam` and `install` links, and
    /// a reference plugin (`portmap`, any small executable will do).
    pub fn new() -> Node {
        let dir = TempDir::new("installer");
        let n = Node { dir };
        for d in [
            "image",
            "host/opt/cni/bin",
            "host/secondary-bin-dir",
            "host/etc/cni/net.d",
            "secrets",
            "run",
        ] {
            fs::create_dir_all(n.path(d)).expect("mkdir");
        }
        // What runs: this build under the name `install` (the image's own link may be
        // replaced by a test).
        std::os::unix::fs::symlink(CALICO, n.path("run/install")).expect("link");
        let calico = n.path("image/calico");
        if fs::hard_link(CALICO, &calico).is_err() {
            fs::copy(CALICO, &calico).expect("copy calico");
        }
        std::os::unix::fs::symlink("calico", n.path("image/calico-ipam")).expect("link");
        std::os::unix::fs::symlink("calico", n.path("image/install")).expect("link");
        n.write_exec("image/portmap", "#!/bin/sh\nexit 0\n");
        n
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    pub fn write_exec(&self, rel: &str, text: &str) {
        fs::write(self.path(rel), text).expect("write");
        fs::set_permissions(self.path(rel), fs::Permissions::from_mode(0o755)).expect("chmod");
    }

    pub fn command(&self, env: &[(&str, &str)]) -> Command {
        let mut cmd = Command::new(self.path("run/install"));
        self.configure(&mut cmd, env);
        cmd
    }

    /// The installer run inside `netns` (where a test's API server listens on 127.0.0.1).
    pub fn command_in(&self, netns: &str, env: &[(&str, &str)]) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", netns])
            .arg(self.path("run/install"));
        self.configure(&mut cmd, env);
        cmd
    }

    fn configure(&self, cmd: &mut Command, env: &[(&str, &str)]) {
        cmd.env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .env("CALICO_INSTALL_IMAGE_BIN_DIR", self.path("image"))
            .env(
                "CALICO_INSTALL_HOST_BIN_DIRS",
                format!(
                    "{}:{}",
                    self.path("host/opt/cni/bin").display(),
                    self.path("host/secondary-bin-dir").display()
                ),
            )
            .env(
                "CALICO_INSTALL_HOST_NET_DIR",
                self.path("host/etc/cni/net.d"),
            )
            .env(
                "CALICO_INSTALL_SERVICEACCOUNT_DIR",
                self.path("serviceaccount"),
            )
            .env("TLS_ASSETS_DIR", self.path("secrets"))
            .env("SLEEP", "false");
        for (k, v) in env {
            cmd.env(k, v);
        }
    }

    pub fn run(&self, env: &[(&str, &str)]) -> Outcome {
        run_command_within(self.command(env), "", Duration::from_secs(60), "install")
    }

    /// Every file under the host's directories, with its kind and mode: a snapshot to show
    /// that a refused run wrote nothing.
    pub fn host_snapshot(&self) -> Vec<(String, String)> {
        fn walk(dir: &Path, base: &Path, out: &mut Vec<(String, String)>) {
            let Ok(entries) = fs::read_dir(dir) else {
                return;
            };
            for e in entries.flatten() {
                let p = e.path();
                let meta = fs::symlink_metadata(&p).expect("stat");
                let rel = p.strip_prefix(base).unwrap().display().to_string();
                if meta.is_dir() {
                    out.push((rel, "dir".into()));
                    walk(&p, base, out);
                } else {
                    let content = fs::read(&p).map(|b| b.len()).unwrap_or(0);
                    out.push((rel, format!("{:o} {content}", meta.permissions().mode())));
                }
            }
        }
        let mut out = Vec::new();
        walk(&self.path("host"), &self.path("host"), &mut out);
        out.sort();
        out
    }
}

pub const POOL: &str = "10.77.0.0/16";
pub const NODE: &str = "install-node";
pub const NODE_SA_USER: &str = "system:serviceaccount:kube-system:calico-node";

/// A real API server with Calico installed as a cluster would have it, and the `calico-node`
/// ServiceAccount with upstream's rule for the CNI token.
pub fn cluster(test: &str) -> Option<(Netns, RealK8s)> {
    require_root();
    if let Err(why) = RealK8s::available() {
        report_skip(test, &why);
        return None;
    }
    let host = Netns::new("insthost");
    let k = RealK8s::start(&host);
    k.ensure_namespace("default");
    k.put(
        "/apis/crd.projectcalico.org/v1/clusterinformations/default",
        json!({"apiVersion":"crd.projectcalico.org/v1","kind":"ClusterInformation",
            "metadata":{"name":"default"},
            "spec":{"clusterGUID":"abc","clusterType":"k8s,kdd","calicoVersion":"v3.32.1","datastoreReady":true}}),
    );
    k.put(
        "/apis/crd.projectcalico.org/v1/ippools/pool-a",
        json!({"apiVersion":"crd.projectcalico.org/v1","kind":"IPPool","metadata":{"name":"pool-a"},
            "spec":{"cidr":POOL,"blockSize":26,"ipipMode":"Never","vxlanMode":"Never","natOutgoing":true,"nodeSelector":"all()"}}),
    );
    k.put(
        &format!("/api/v1/nodes/{NODE}"),
        json!({"apiVersion":"v1","kind":"Node","metadata":{"name":NODE}}),
    );
    calico_node_account(&k);
    Some((host, k))
}

/// The `calico-node` ServiceAccount with upstream's rule for the CNI token; its token (what
/// the DaemonSet's pods have mounted).
pub fn calico_node_account(k: &RealK8s) -> String {
    // calico-node's ServiceAccount and upstream's rule: it may create tokens for the CNI
    // plugin's ServiceAccount, and nothing else here.
    for (path, obj) in [
        (
            "/api/v1/namespaces/kube-system/serviceaccounts",
            json!({"apiVersion":"v1","kind":"ServiceAccount","metadata":{"name":"calico-node","namespace":"kube-system"}}),
        ),
        (
            "/apis/rbac.authorization.k8s.io/v1/clusterroles",
            json!({"apiVersion":"rbac.authorization.k8s.io/v1","kind":"ClusterRole","metadata":{"name":"calico-node-cni-token"},
                "rules":[{"apiGroups":[""],"resources":["serviceaccounts/token"],"resourceNames":["calico-cni-plugin"],"verbs":["create"]}]}),
        ),
        (
            "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
            json!({"apiVersion":"rbac.authorization.k8s.io/v1","kind":"ClusterRoleBinding","metadata":{"name":"calico-node-cni-token"},
                "roleRef":{"apiGroup":"rbac.authorization.k8s.io","kind":"ClusterRole","name":"calico-node-cni-token"},
                "subjects":[{"kind":"ServiceAccount","name":"calico-node","namespace":"kube-system"}]}),
        ),
    ] {
        let a = k.post(path, obj);
        assert!(a.status == 201 || a.status == 409, "{path}: {a:?}");
    }
    token_for(k, "calico-node")
}

/// A token for `kube-system/<account>` from TokenRequest, as the admin.
pub fn token_for(k: &RealK8s, account: &str) -> String {
    let a = k.post(
        &format!("/api/v1/namespaces/kube-system/serviceaccounts/{account}/token"),
        json!({"apiVersion":"authentication.k8s.io/v1","kind":"TokenRequest","spec":{"expirationSeconds":3600}}),
    );
    assert_eq!(a.status, 201, "TokenRequest for {account}: {a:?}");
    a.body["status"]["token"].as_str().unwrap().to_string()
}
