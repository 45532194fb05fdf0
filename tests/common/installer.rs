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

use super::cni::{run_command_within, Outcome, TempDir};

pub const CALICO: &str = env!("CARGO_BIN_EXE_calico");
pub const VERSION: &str = concat!("v", env!("CARGO_PKG_VERSION"));

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
