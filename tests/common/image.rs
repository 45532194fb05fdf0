#![allow(dead_code)]
//! The image `make image` builds (target/image/calico-cni-rs.oci.tar, an OCI image index for
//! linux/amd64 and linux/arm64), read from the archive itself ([`OciArchive`]), and podman
//! confined to a temp dir to run it, for tests/e2e/image.rs and the real node suite.

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

/// The image archive unpacked into a temp dir (the OCI layout: `index.json`, `blobs/`), read
/// as a runtime reads it: the index, each platform's manifest, its config and its layers.
pub struct OciArchive {
    pub dir: TempDir,
}

/// A file in an image: its path (no leading `/`), and the target when it is a symlink.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ImageFile {
    pub path: String,
    pub link: Option<String>,
}

impl OciArchive {
    pub fn open(tar: &Path) -> OciArchive {
        let dir = TempDir::new("image-oci");
        let mut cmd = Command::new("tar");
        cmd.arg("-xf").arg(tar).arg("-C").arg(dir.path());
        let out = run(cmd, "tar -x the image archive");
        assert_eq!(out.code, 0, "tar: {}", out.stderr);
        OciArchive { dir }
    }

    /// A blob by its digest (`sha256:<hex>`), as JSON.
    pub fn blob_json(&self, digest: &str) -> serde_json::Value {
        let text = std::fs::read_to_string(self.blob(digest))
            .unwrap_or_else(|e| panic!("blob {digest}: {e}"));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("blob {digest} is not JSON: {e}"))
    }

    pub fn blob(&self, digest: &str) -> PathBuf {
        let (alg, hex) = digest
            .split_once(':')
            .unwrap_or_else(|| panic!("not a digest: {digest}"));
        self.dir.path().join("blobs").join(alg).join(hex)
    }

    /// `index.json`.
    pub fn top_index(&self) -> serde_json::Value {
        let text = std::fs::read_to_string(self.dir.path().join("index.json")).unwrap();
        serde_json::from_str(&text).unwrap()
    }

    /// The image index the archive's reference names (`index.json`'s one entry, an index),
    /// and that reference (`org.opencontainers.image.ref.name`).
    pub fn image_index(&self) -> (serde_json::Value, String) {
        let top = self.top_index();
        let entries = top["manifests"].as_array().expect("index.json manifests");
        assert_eq!(entries.len(), 1, "one reference in the archive: {top}");
        let e = &entries[0];
        assert_eq!(
            e["mediaType"], "application/vnd.oci.image.index.v1+json",
            "the reference names an image index: {top}"
        );
        let name = e["annotations"]["org.opencontainers.image.ref.name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        (self.blob_json(e["digest"].as_str().unwrap()), name)
    }

    /// `os/architecture` of every manifest in the image index, in its order.
    pub fn platforms(&self) -> Vec<String> {
        let (index, _) = self.image_index();
        index["manifests"]
            .as_array()
            .expect("manifests")
            .iter()
            .map(|m| {
                format!(
                    "{}/{}",
                    m["platform"]["os"].as_str().unwrap_or("?"),
                    m["platform"]["architecture"].as_str().unwrap_or("?")
                )
            })
            .collect()
    }

    /// The image manifest of linux/`arch`.
    pub fn manifest(&self, arch: &str) -> serde_json::Value {
        let (index, _) = self.image_index();
        let entry = index["manifests"]
            .as_array()
            .expect("manifests")
            .iter()
            .find(|m| m["platform"]["os"] == "linux" && m["platform"]["architecture"] == arch)
            .unwrap_or_else(|| panic!("no linux/{arch} manifest in {index}"))
            .clone();
        self.blob_json(entry["digest"].as_str().unwrap())
    }

    /// The image config of linux/`arch`.
    pub fn config(&self, arch: &str) -> serde_json::Value {
        let m = self.manifest(arch);
        self.blob_json(m["config"]["digest"].as_str().expect("config digest"))
    }

    /// The root filesystem of linux/`arch`: its layers unpacked in order into `dest`.
    pub fn unpack(&self, arch: &str, dest: &Path) {
        std::fs::create_dir_all(dest).unwrap();
        let m = self.manifest(arch);
        for layer in m["layers"].as_array().expect("layers") {
            let blob = self.blob(layer["digest"].as_str().expect("layer digest"));
            let mut cmd = Command::new("tar");
            cmd.arg("-xf").arg(&blob).arg("-C").arg(dest);
            let out = run(cmd, "tar -x a layer");
            assert_eq!(out.code, 0, "tar {}: {}", blob.display(), out.stderr);
        }
    }

    /// Every file and symlink of linux/`arch`'s root filesystem (not the directories),
    /// sorted; `root` is where [`OciArchive::unpack`] put it.
    pub fn files(root: &Path) -> Vec<ImageFile> {
        fn walk(root: &Path, dir: &Path, out: &mut Vec<ImageFile>) {
            for e in std::fs::read_dir(dir).unwrap() {
                let path = e.unwrap().path();
                let meta = std::fs::symlink_metadata(&path).unwrap();
                let rel = path.strip_prefix(root).unwrap().display().to_string();
                if meta.file_type().is_symlink() {
                    let target = std::fs::read_link(&path).unwrap();
                    out.push(ImageFile {
                        path: rel,
                        link: Some(target.display().to_string()),
                    });
                } else if meta.is_dir() {
                    walk(root, &path, out);
                } else {
                    out.push(ImageFile {
                        path: rel,
                        link: None,
                    });
                }
            }
        }
        let mut out = Vec::new();
        walk(root, root, &mut out);
        out.sort();
        out
    }
}

/// One podman installation confined to a temp dir (its own storage: the machine's image
/// store is left alone), as in tests/e2e/podman_cni.rs.
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
