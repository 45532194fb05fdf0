#![allow(dead_code)]
//! The image `make image` builds (target/image/calico-cni-rs.oci.tar), and podman confined to
//! a temp dir to run it, for tests/image.rs and the real node suite.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use super::cni::{report_skip, run_command_within, Outcome, TempDir};

fn run(cmd: Command, what: &str) -> Outcome {
    run_command_within(cmd, "", Duration::from_secs(300), what)
}

pub fn image_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("target/image")
}

/// The image archive, or `None` (SKIPPED) when it was not built; in CI it must exist.
pub fn image(test: &str) -> Option<PathBuf> {
    let tar = image_dir().join("calico-cni-rs.oci.tar");
    if tar.is_file() {
        return Some(tar);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "{} is missing: `make test` builds it with `make image` first",
        tar.display()
    );
    report_skip(test, "no image: run `make image` first");
    None
}

/// One podman installation confined to a temp dir (its own storage: the machine's image
/// store is left alone), as in tests/podman_cni.rs.
pub struct Podman {
    pub dir: TempDir,
}

impl Podman {
    pub fn new() -> Podman {
        Podman::with_dir(TempDir::new("image-podman"))
    }

    /// Its state under `parent` (removed with it).
    pub fn new_in(parent: &Path) -> Podman {
        let dir = parent.join("podman");
        std::fs::create_dir_all(&dir).unwrap();
        Podman::with_dir(TempDir(dir))
    }

    fn with_dir(dir: TempDir) -> Podman {
        let conf = r#"[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]
[engine]
events_logger = "file"
cgroup_manager = "cgroupfs"
runtime = "runc"
"#;
        std::fs::write(dir.path().join("containers.conf"), conf).unwrap();
        Podman { dir }
    }

    /// `podman <args>`, in `netns` when given (the container then shares it with
    /// `--network host`).
    pub fn cmd(&self, netns: Option<&str>, args: &[&str]) -> Command {
        let d = self.dir.path();
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net={ns}")).arg("podman");
                c
            }
            None => Command::new("podman"),
        };
        cmd.arg("--root")
            .arg(d.join("root"))
            .arg("--runroot")
            .arg(d.join("runroot"))
            .arg("--tmpdir")
            .arg(d.join("tmp"))
            .arg("--storage-driver")
            .arg("vfs")
            .args(args)
            .env("CONTAINERS_CONF", d.join("containers.conf"));
        cmd
    }

    /// `podman run --rm` of `image` with `mounts` (`host:container[:ro]`), `env` and
    /// `command` (the image's CMD when empty); in `netns` with `--network host` (the
    /// container shares it), else with no network.
    pub fn run_container(
        &self,
        netns: Option<&str>,
        mounts: &[String],
        env: &[(&str, &str)],
        image: &str,
        command: &[&str],
    ) -> Outcome {
        let network = if netns.is_some() { "host" } else { "none" };
        let mut args: Vec<String> = vec![
            "run".into(),
            "--rm".into(),
            "--network".into(),
            network.into(),
        ];
        for m in mounts {
            args.extend(["-v".into(), m.clone()]);
        }
        for (k, v) in env {
            args.extend(["-e".into(), format!("{k}={v}")]);
        }
        args.push(image.into());
        args.extend(command.iter().map(|c| c.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        run(
            self.cmd(netns, &args),
            &format!("podman run {image} {command:?}"),
        )
    }

    pub fn load(&self, tar: &Path) -> String {
        let out = run(
            self.cmd(None, &["load", "-i", &tar.display().to_string()]),
            "podman load",
        );
        assert_eq!(out.code, 0, "podman load: {}{}", out.stdout, out.stderr);
        // "Loaded image: localhost/calico-cni-rs:v0.1.0"
        let name = out
            .stdout
            .lines()
            .find_map(|l| {
                l.strip_prefix("Loaded image: ")
                    .or(l.strip_prefix("Loaded image(s): "))
            })
            .unwrap_or_else(|| panic!("podman load said {}", out.stdout))
            .trim()
            .to_string();
        name
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        let _ = run(
            self.cmd(None, &["rm", "--all", "--force", "--time", "0"]),
            "podman rm",
        );
    }
}
