//! The calico/cni-compatible image that `make image` builds (target/image): every binary it
//! ships is static; podman loads it and runs its `install` as Calico's DaemonSet runs the
//! `install-cni` container (host directories mounted at /host/...), and containerd's `ctr`
//! imports it. `make test` builds the image before the suites run; run by hand without it,
//! these tests say SKIPPED (and fail in CI, where the image must be there).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::cni::{report_skip, run_command_within, Outcome, TempDir};

const VERSION: &str = concat!("v", env!("CARGO_PKG_VERSION"));
const BINARIES: [&str; 6] = [
    "calico",
    "host-local",
    "portmap",
    "loopback",
    "tuning",
    "bandwidth",
];

fn image_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("target/image")
}

/// The image archive, or `None` (SKIPPED) when it was not built; in CI it must exist.
fn image(test: &str) -> Option<PathBuf> {
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

fn run(cmd: Command, what: &str) -> Outcome {
    run_command_within(cmd, "", Duration::from_secs(300), what)
}

#[test]
fn every_binary_the_image_ships_is_static() {
    let Some(tar) = image("every_binary_the_image_ships_is_static") else {
        return;
    };
    let bin = image_dir().join("rootfs/opt/cni/bin");
    for name in BINARIES {
        let path = bin.join(name);
        let mut file = Command::new("file");
        file.arg("-L").arg(&path);
        let out = run(file, "file");
        assert!(
            out.stdout.contains("statically linked") || out.stdout.contains("static-pie linked"),
            "{name}: {}",
            out.stdout
        );
        let mut ldd = Command::new("ldd");
        ldd.arg(&path);
        let out = run(ldd, "ldd");
        let said = format!("{}{}", out.stdout, out.stderr);
        assert!(
            said.contains("not a dynamic executable") || said.contains("statically linked"),
            "{name}: ldd says {said}"
        );
    }
    // calico-ipam and install are the same binary, by name.
    for link in ["calico-ipam", "install"] {
        assert_eq!(
            std::fs::read_link(bin.join(link)).unwrap(),
            Path::new("calico")
        );
    }
    let v = Command::new(bin.join("calico")).arg("-v").output().unwrap();
    assert_eq!(String::from_utf8_lossy(&v.stdout).trim(), VERSION);
    // An OCI archive: the layout marker and the index.
    let mut t = Command::new("tar");
    t.arg("-tf").arg(&tar);
    let listing = run(t, "tar").stdout;
    assert!(listing.lines().any(|l| l == "oci-layout"), "{listing}");
    assert!(listing.lines().any(|l| l == "index.json"), "{listing}");
    let size = std::fs::metadata(&tar).unwrap().len();
    eprintln!("image archive: {size} bytes ({} MiB)", size / 1024 / 1024);
}

/// One podman installation confined to a temp dir (its own storage: the machine's image
/// store is left alone), as in tests/podman_cni.rs.
struct Podman {
    pub dir: TempDir,
}

impl Podman {
    fn new() -> Podman {
        let dir = TempDir::new("image-podman");
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
    fn cmd(&self, netns: Option<&str>, args: &[&str]) -> Command {
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

    fn load(&self, tar: &Path) -> String {
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

#[test]
fn podman_runs_the_images_install_as_the_daemonset_does() {
    let Some(tar) = image("podman_runs_the_images_install_as_the_daemonset_does") else {
        return;
    };
    let podman = Podman::new();
    let name = podman.load(&tar);
    let host = TempDir::new("image-host");
    let (bin, net) = (
        host.path().join("opt/cni/bin"),
        host.path().join("etc/cni/net.d"),
    );
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::create_dir_all(&net).unwrap();
    let mounts = [
        format!("{}:/host/opt/cni/bin", bin.display()),
        format!("{}:/host/etc/cni/net.d", net.display()),
    ];
    let started = Instant::now();
    let out = run(
        podman.cmd(
            None,
            &[
                "run",
                "--rm",
                "--network",
                "none",
                "-v",
                &mounts[0],
                "-v",
                &mounts[1],
                "-e",
                "SLEEP=false",
                "-e",
                "KUBERNETES_NODE_NAME=node-1",
                "-e",
                "CNI_MTU=1450",
                &name,
            ],
        ),
        "podman run install",
    );
    assert_eq!(out.code, 0, "install: {}{}", out.stdout, out.stderr);
    eprintln!("install in podman took {:?}", started.elapsed());
    // The image's default command is the installer; it copied every binary but itself.
    for b in BINARIES {
        assert!(bin.join(b).is_file(), "{b} installed");
    }
    assert!(!bin.join("install").exists());
    let v = Command::new(bin.join("calico")).arg("-v").output().unwrap();
    assert_eq!(String::from_utf8_lossy(&v.stdout).trim(), VERSION);
    let ipam = Command::new(bin.join("calico-ipam"))
        .arg("-v")
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&ipam.stdout).trim(), VERSION);
    let text = std::fs::read_to_string(net.join("10-calico.conflist")).unwrap();
    let c: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(c["plugins"][0]["nodename"], "node-1");
    assert_eq!(c["plugins"][0]["mtu"], 1450);
    // The installed reference plugins answer VERSION as CNI plugins.
    for b in ["host-local", "portmap", "loopback", "tuning", "bandwidth"] {
        let out = Command::new(bin.join(b))
            .env("CNI_COMMAND", "VERSION")
            .output()
            .unwrap();
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("supportedVersions"),
            "{b}: {}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
}

/// A containerd of its own (temp root, state and socket; no CRI), stopped by PID.
struct Containerd {
    dir: TempDir,
    child: std::process::Child,
}

impl Containerd {
    fn start() -> Containerd {
        let dir = TempDir::new("image-containerd");
        let d = dir.path();
        let conf = format!(
            "version = 2\nroot = \"{0}/root\"\nstate = \"{0}/state\"\ndisabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n[grpc]\n  address = \"{0}/containerd.sock\"\n",
            d.display()
        );
        std::fs::write(d.join("config.toml"), conf).unwrap();
        let child = Command::new("containerd")
            .arg("--config")
            .arg(d.join("config.toml"))
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(d.join("containerd.log")).unwrap())
            .spawn()
            .expect("start containerd");
        let c = Containerd { dir, child };
        let started = Instant::now();
        while !c.socket().exists() {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "containerd did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        c
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("containerd.sock")
    }

    fn ctr(&self, args: &[&str]) -> Outcome {
        let mut cmd = Command::new("ctr");
        cmd.arg("--address")
            .arg(self.socket())
            .args(["--namespace", "test"])
            .args(args);
        run(cmd, "ctr")
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn containerd_imports_the_image() {
    let Some(tar) = image("containerd_imports_the_image") else {
        return;
    };
    if Command::new("containerd")
        .arg("--version")
        .output()
        .is_err()
    {
        assert!(
            std::env::var_os("CI").is_none(),
            "containerd is missing: `make deps` installs it"
        );
        report_skip("containerd_imports_the_image", "no containerd");
        return;
    }
    let c = Containerd::start();
    let out = c.ctr(&["images", "import", &tar.display().to_string()]);
    assert_eq!(out.code, 0, "ctr import: {}{}", out.stdout, out.stderr);
    let out = c.ctr(&["images", "ls", "-q"]);
    assert!(
        out.stdout
            .lines()
            .any(|l| l.contains("calico-cni-rs:") && l.ends_with(VERSION)),
        "ctr images ls: {}",
        out.stdout
    );
}
