//! The calico/cni-compatible image that `make image` builds (target/image): an OCI image index
//! for linux/amd64 and linux/arm64, each image laid out as upstream's calico/cni v3.32.1 is
//! (the expected differences pinned below), every binary static and of its platform's
//! architecture; the reference plugins those of the pinned containernetworking/plugins module;
//! the arm64 binaries run (`-v`, VERSION, an ADD and a DEL on etcd) under qemu-user; podman
//! loads it and runs its `install` as Calico's DaemonSet runs the `install-cni` container
//! (host directories mounted at /host/...), and containerd's `ctr` imports it. `make test`
//! builds the image before the suites run; run by hand without it, these tests say SKIPPED
//! (and fail in CI, where the image must be there).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::cni::{
    report_skip, run_command_within, Invocation, Outcome, TempDir, PLUGIN_TIMEOUT,
};
use crate::common::image::{image, ImageFile, OciArchive, Podman};
use crate::common::installer::{cluster, token_for, NODE};
use crate::common::netns::{require_root, Netns};
use crate::common::real_k8s::RealK8s;
use crate::common::real_node::{wait_until, Daemon};
use crate::common::world::{World, POOL_CIDR, WEP_PREFIX};

/// What `-v` prints: the release the image replaces, ours as semver build metadata.
const VERSION: &str = concat!("v3.32.1+calico-cni-rs.", env!("CARGO_PKG_VERSION"));
/// The archive's one reference: the image it stands in for, the name a mirror serves it under.
const REF_NAME: &str = "calico/cni:v3.32.1";
/// The image's platforms, in the index's order.
const ARCHES: [&str; 2] = ["amd64", "arm64"];
/// The reference plugins the image ships, and their version: the containernetworking/plugins
/// module pinned in tools/peers/cni-plugins, stamped by tools/peers/build.sh.
const PLUGINS: [&str; 4] = ["host-local", "portmap", "loopback", "tuning"];
const PLUGINS_VERSION: &str = "v1.10.0";
/// Every executable file in /opt/cni/bin (calico-ipam and install are symlinks to calico).
const BINARIES: [&str; 5] = ["calico", "host-local", "portmap", "loopback", "tuning"];

/// What upstream's calico/cni v3.32.1 image adds to its base image (calico/base), from
/// projectcalico/calico v3.32.1's cni-plugin/Dockerfile and cni-plugin/Makefile: Calico's
/// license in /licenses, and in /opt/cni/bin its two Go programs (`install`, `calico`), the
/// `calico-ipam` symlink to `./calico`, four containernetworking plugins built from
/// projectcalico's fork (host-local, portmap, loopback, tuning) and flannel. Its platforms:
/// lib.Makefile's ARCHES.
const UPSTREAM_FILES: [(&str, Option<&str>); 9] = [
    ("licenses/LICENSE", None),
    ("opt/cni/bin/calico", None),
    ("opt/cni/bin/calico-ipam", Some("./calico")),
    ("opt/cni/bin/flannel", None),
    ("opt/cni/bin/host-local", None),
    ("opt/cni/bin/install", None),
    ("opt/cni/bin/loopback", None),
    ("opt/cni/bin/portmap", None),
    ("opt/cni/bin/tuning", None),
];
const UPSTREAM_ARCHES: [&str; 4] = ["amd64", "arm64", "ppc64le", "s390x"];

/// The differences from upstream's layout, each on purpose:
/// - no `flannel`: the Go module proxy refuses github.com/flannel-io/cni-plugin at every
///   version ("This module version is not available"), so it cannot be built from a pinned
///   module as the other plugins are (docs/swap-in.md);
/// - `install` is a symlink to `calico` (one binary, acting on the name it runs under), not a
///   second program;
/// - the containernetworking plugins' own license beside ours (they are built from their
///   module, not from a fork that carries Calico's);
/// - no ppc64le and s390x images (amd64 and arm64 only);
/// - FROM scratch: nothing of calico/base (which only the `calico` and `install` of upstream,
///   Go programs linked static, never use either).
const NOT_OURS: [&str; 1] = ["opt/cni/bin/flannel"];
const OURS_ONLY: [(&str, Option<&str>); 1] =
    [("licenses/LICENSE.containernetworking-plugins", None)];
const NOW_SYMLINKS: [(&str, &str); 1] = [("opt/cni/bin/install", "calico")];
const NOT_OUR_ARCHES: [&str; 2] = ["ppc64le", "s390x"];

/// What `file` calls each platform's machine.
fn machine(arch: &str) -> &'static str {
    match arch {
        "amd64" => "x86-64",
        "arm64" => "ARM aarch64",
        other => panic!("no such platform in the image: {other}"),
    }
}

fn run(cmd: Command, what: &str) -> Outcome {
    run_command_within(cmd, "", Duration::from_secs(300), what)
}

/// A symlink's target as a runtime resolves it in its directory (`./calico` is `calico`).
fn normalized(link: &str) -> &str {
    link.strip_prefix("./").unwrap_or(link)
}

/// The image archive, opened, with linux/`arch`'s root filesystem unpacked from it.
struct Unpacked {
    oci: OciArchive,
    roots: TempDir,
}

impl Unpacked {
    fn new(tar: &Path) -> Unpacked {
        let oci = OciArchive::open(tar);
        let roots = TempDir::new("image-rootfs");
        for arch in ARCHES {
            oci.unpack(arch, &roots.path().join(arch));
        }
        Unpacked { oci, roots }
    }

    fn root(&self, arch: &str) -> PathBuf {
        self.roots.path().join(arch)
    }

    fn bin(&self, arch: &str) -> PathBuf {
        self.root(arch).join("opt/cni/bin")
    }
}

/// `qemu-aarch64-static` (Debian's qemu-user-static), or `None` (SKIPPED; a failure in CI).
fn qemu_aarch64(test: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("qemu-aarch64-static"))
            .find(|p| p.is_file())
    });
    if found.is_none() {
        report_skip(
            test,
            "no qemu-aarch64-static: `make deps` installs Debian's qemu-user-static",
        );
    }
    found
}

/// The command that runs `binary` of linux/`arch` here: itself on amd64, under qemu-user on
/// arm64 (argv[0] is `binary`'s path, so a symlink's name is the name it runs under).
fn command_for(arch: &str, binary: &Path, qemu: Option<&Path>) -> Command {
    match arch {
        "amd64" => Command::new(binary),
        _ => {
            let mut c = Command::new(qemu.expect("qemu-aarch64-static for arm64"));
            c.arg(binary);
            c
        }
    }
}

#[test]
fn every_binary_the_image_ships_is_static() {
    let Some(tar) = image("every_binary_the_image_ships_is_static") else {
        return;
    };
    let image = Unpacked::new(&tar);
    for arch in ARCHES {
        let bin = image.bin(arch);
        for name in BINARIES {
            let path = bin.join(name);
            let mut file = Command::new("file");
            file.arg(&path);
            let out = run(file, "file");
            assert!(
                out.stdout.contains("statically linked")
                    || out.stdout.contains("static-pie linked"),
                "{arch} {name}: {}",
                out.stdout
            );
            assert!(
                out.stdout.contains(machine(arch)),
                "{arch} {name} is not a {} executable: {}",
                machine(arch),
                out.stdout
            );
            if arch == "amd64" {
                let mut ldd = Command::new("ldd");
                ldd.arg(&path);
                let out = run(ldd, "ldd");
                let said = format!("{}{}", out.stdout, out.stderr);
                assert!(
                    said.contains("not a dynamic executable") || said.contains("statically linked"),
                    "{name}: ldd says {said}"
                );
            }
        }
        // calico-ipam and install are the same binary, by name.
        for link in ["calico-ipam", "install"] {
            assert_eq!(
                std::fs::read_link(bin.join(link)).unwrap(),
                Path::new("calico"),
                "{arch} {link}"
            );
        }
    }
    let v = Command::new(image.bin("amd64").join("calico"))
        .arg("-v")
        .output()
        .unwrap();
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

/// The index names `calico/cni:v3.32.1` and holds one image per platform, each with
/// upstream's files (but the pinned differences), upstream's CMD, WORKDIR and PATH, our
/// version in its version label, and a config of its own platform.
#[test]
fn the_image_is_upstreams_calico_cni_layout_for_amd64_and_arm64() {
    let Some(tar) = image("the_image_is_upstreams_calico_cni_layout_for_amd64_and_arm64") else {
        return;
    };
    let image = Unpacked::new(&tar);
    let (_, name) = image.oci.image_index();
    assert_eq!(name, REF_NAME);
    let ours: Vec<&str> = UPSTREAM_ARCHES
        .into_iter()
        .filter(|a| !NOT_OUR_ARCHES.contains(a))
        .collect();
    assert_eq!(ours, ARCHES);
    let platforms: Vec<String> = ARCHES.iter().map(|a| format!("linux/{a}")).collect();
    assert_eq!(image.oci.platforms(), platforms);
    // Upstream's files, with the pinned differences applied.
    let mut expected: Vec<ImageFile> = UPSTREAM_FILES
        .iter()
        .filter(|(path, _)| !NOT_OURS.contains(path))
        .chain(OURS_ONLY.iter())
        .map(|&(path, link)| {
            let link = NOW_SYMLINKS
                .iter()
                .find(|(p, _)| *p == path)
                .map(|&(_, target)| target)
                .or(link);
            ImageFile {
                path: path.to_string(),
                link: link.map(|l| normalized(l).to_string()),
            }
        })
        .collect();
    expected.sort();
    for arch in ARCHES {
        let files: Vec<ImageFile> = OciArchive::files(&image.root(arch))
            .into_iter()
            .map(|f| ImageFile {
                link: f.link.as_deref().map(|l| normalized(l).to_string()),
                ..f
            })
            .collect();
        assert_eq!(files, expected, "linux/{arch}: the image's files");
        eprintln!("linux/{arch}: {files:?}");
        let config = image.oci.config(arch);
        assert_eq!(config["os"], "linux", "{arch}: {config}");
        assert_eq!(config["architecture"], arch, "{config}");
        let c = &config["config"];
        assert_eq!(c["Cmd"], serde_json::json!(["/opt/cni/bin/install"]), "{c}");
        assert_eq!(c["WorkingDir"], "/opt/cni/bin", "{c}");
        assert_eq!(
            c["Labels"]["org.opencontainers.image.version"], VERSION,
            "{c}"
        );
        assert!(
            c["Env"].as_array().is_some_and(|e| e.iter().any(|v| v
                .as_str()
                .is_some_and(|v| v.starts_with("PATH=/opt/cni/bin:")))),
            "{c}"
        );
        // The licenses: ours (Apache-2.0) and the reference plugins'.
        for l in ["LICENSE", "LICENSE.containernetworking-plugins"] {
            let text = std::fs::read_to_string(image.root(arch).join("licenses").join(l)).unwrap();
            assert!(text.contains("Apache License"), "{arch} {l}");
        }
    }
}

/// Each binary of each platform answers as it should on its own architecture (arm64 under
/// qemu-user): `calico` and `calico-ipam -v` print our version, VERSION lists the CNI
/// versions; each reference plugin answers VERSION and names the pinned release in its
/// about line (`--version`).
#[test]
fn each_binary_reports_its_version_on_its_architecture() {
    let test = "each_binary_reports_its_version_on_its_architecture";
    let Some(tar) = image(test) else {
        return;
    };
    let image = Unpacked::new(&tar);
    let qemu = qemu_aarch64(test);
    for arch in ARCHES {
        if arch == "arm64" && qemu.is_none() {
            continue;
        }
        let bin = image.bin(arch);
        let run_it = |name: &str, args: &[&str], env: &[(&str, &str)]| {
            let mut cmd = command_for(arch, &bin.join(name), qemu.as_deref());
            cmd.args(args).envs(env.iter().copied());
            let out = run(cmd, &format!("{arch} {name} {args:?}"));
            assert_eq!(out.code, 0, "{arch} {name}: {}{}", out.stdout, out.stderr);
            out
        };
        let output =
            |name: &str, args: &[&str], env: &[(&str, &str)]| run_it(name, args, env).stdout;
        for name in ["calico", "calico-ipam"] {
            assert_eq!(output(name, &["-v"], &[]).trim(), VERSION, "{arch} {name}");
        }
        for name in BINARIES {
            let v: serde_json::Value =
                serde_json::from_str(&output(name, &[], &[("CNI_COMMAND", "VERSION")])).unwrap();
            let supported = v["supportedVersions"]
                .as_array()
                .expect("supportedVersions");
            for cni in ["0.3.1", "1.0.0", "1.1.0"] {
                assert!(supported.iter().any(|s| s == cni), "{arch} {name}: {v}");
            }
        }
        // The plugins' about text goes to stderr (libcni's skel).
        for p in PLUGINS {
            let about = run_it(p, &["--version"], &[]).stderr;
            assert_eq!(
                about.lines().next(),
                Some(format!("CNI {p} plugin {PLUGINS_VERSION}").as_str()),
                "{arch} {p}: {about}"
            );
        }
    }
}

/// The arm64 `calico` and `calico-ipam`, taken from the image and run under qemu-user as
/// kubelet would run them, set a pod up on etcd and tear it down. Under qemu-user,
/// `/proc/self/exe` is qemu's own binary, so `calico` does not recognise `calico-ipam` as
/// itself and runs it as a separate process (on an arm64 node it runs IPAM in-process): the
/// test's CNI_PATH holds `calico-ipam` as a script that runs the image's arm64 `calico-ipam`
/// under qemu (a node with qemu registered in binfmt_misc would run it directly).
#[test]
fn arm64_calico_adds_and_deletes_a_pod_under_qemu() {
    let test = "arm64_calico_adds_and_deletes_a_pod_under_qemu";
    let Some(tar) = image(test) else {
        return;
    };
    let Some(qemu) = qemu_aarch64(test) else {
        return;
    };
    require_root();
    let image = Unpacked::new(&tar);
    let bin = image.bin("arm64");
    let cni_path = TempDir::new("image-arm64-cni-path");
    let ipam = cni_path.path().join("calico-ipam");
    std::fs::write(
        &ipam,
        format!(
            "#!/bin/sh\nexec {} {} \"$@\"\n",
            qemu.display(),
            bin.join("calico-ipam").display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&ipam, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let w = World::new();
    let pod = w.pod();
    let conf = w.conf(serde_json::json!({}));
    let call = |inv: &Invocation| {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", w.host.name()])
            .arg(&qemu)
            .arg(bin.join("calico"))
            .env("CNI_COMMAND", &inv.command)
            .env("CNI_CONTAINERID", &inv.container_id)
            .env("CNI_NETNS", &inv.netns)
            .env("CNI_IFNAME", &inv.ifname)
            .env("CNI_ARGS", &inv.args)
            .env("CNI_PATH", cni_path.path());
        run_command_within(
            cmd,
            &conf,
            PLUGIN_TIMEOUT,
            &format!("arm64 calico {}", inv.command),
        )
    };
    let add = Invocation::new("ADD", "a64a64a64a64", pod.path()).k8s("default", "arm");
    let out = call(&add);
    out.assert_ok();
    let r = out.json();
    let addr = r["ips"][0]["address"]
        .as_str()
        .expect("an address")
        .to_string();
    let pool: std::net::Ipv4Addr = POOL_CIDR.split('/').next().unwrap().parse().unwrap();
    let ip: std::net::Ipv4Addr = addr.split('/').next().unwrap().parse().unwrap();
    assert_eq!(
        ip.octets()[..2],
        pool.octets()[..2],
        "{addr} in {POOL_CIDR}"
    );
    let in_pod = pod.exec_ok("ip", &["-o", "addr", "show", "dev", "eth0"]);
    assert!(in_pod.contains(&addr), "{in_pod}");
    let weps = w.keys(WEP_PREFIX);
    assert_eq!(weps.len(), 1, "{weps:?}");
    // Calico IPAM's handle for the pod.
    assert_eq!(
        w.keys("/calico/ipam/v2/handle/"),
        ["/calico/ipam/v2/handle/net1.a64a64a64a64"]
    );
    call(&add.as_del()).assert_ok();
    w.assert_clean();
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
    let out = podman.run_container(
        None,
        &mounts,
        &[
            ("SLEEP", "false"),
            ("KUBERNETES_NODE_NAME", "node-1"),
            ("CNI_MTU", "1450"),
        ],
        &name,
        &[],
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
    assert!(
        !bin.join("bandwidth").exists(),
        "bandwidth is not in the image"
    );
    // The installed reference plugins answer VERSION as CNI plugins.
    for b in PLUGINS {
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
    // Both platforms' content, as a registry mirror would hold it.
    let out = c.ctr(&[
        "images",
        "import",
        "--all-platforms",
        &tar.display().to_string(),
    ]);
    assert_eq!(out.code, 0, "ctr import: {}{}", out.stdout, out.stderr);
    let out = c.ctr(&["images", "ls"]);
    let line = out
        .stdout
        .lines()
        .find(|l| l.split_whitespace().next().is_some_and(|r| r == REF_NAME))
        .unwrap_or_else(|| panic!("ctr images ls: {}", out.stdout));
    assert!(
        line.contains("application/vnd.oci.image.index.v1+json")
            && line.contains("linux/amd64,linux/arm64"),
        "an index of both platforms: {line}"
    );
}

/// The documented push to a registry mirror (docs/swap-in.md): `skopeo copy --all
/// --preserve-digests` of the archive to `<registry>/calico/cni:v3.32.1` puts the index and
/// both platforms' images there with the index's digest kept, so that tag and the digest an
/// ImageSet pins (`<registry>/calico/cni@sha256:...`, as the Tigera operator renders it) both
/// serve our image. Debian's docker-registry on the loopback of a netns of its own.
#[test]
fn the_archive_pushes_to_a_registry_as_calico_cni_with_its_digest() {
    let test = "the_archive_pushes_to_a_registry_as_calico_cni_with_its_digest";
    let Some(tar) = image(test) else {
        return;
    };
    for tool in ["/usr/bin/docker-registry", "/usr/bin/skopeo"] {
        if !Path::new(tool).exists() {
            assert!(
                std::env::var_os("CI").is_none(),
                "{tool} is missing: `make deps` installs it"
            );
            report_skip(test, &format!("no {tool}"));
            return;
        }
    }
    require_root();
    let oci = OciArchive::open(&tar);
    let (_, name) = oci.image_index();
    assert_eq!(name, REF_NAME);
    let digest = oci.top_index()["manifests"][0]["digest"]
        .as_str()
        .expect("the index's digest")
        .to_string();

    let ns = Netns::new("img-reg");
    let dir = TempDir::new("image-registry");
    let config = dir.path().join("config.yml");
    std::fs::write(
        &config,
        format!(
            "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: 127.0.0.1:5000\n",
            dir.path().join("storage").display()
        ),
    )
    .unwrap();
    let registry = Daemon::start(
        "docker-registry",
        ns.path(),
        Path::new("/usr/bin/docker-registry"),
        &["serve".into(), config.display().to_string()],
        None,
        &dir.path().join("registry.log"),
    );
    wait_until("the registry", Duration::from_secs(30), || {
        registry.assert_running();
        let code = ns.sh("curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:5000/v2/");
        (code.trim() == "200").then_some(())
    });
    let target = format!("docker://127.0.0.1:5000/{REF_NAME}");
    ns.exec_ok(
        "skopeo",
        &[
            "copy",
            "--all",
            "--preserve-digests",
            "--dest-tls-verify=false",
            &format!("oci-archive:{}", tar.display()),
            &target,
        ],
    );
    // By tag and by the index's digest, the registry serves the archive's index.
    let by_digest = format!("docker://127.0.0.1:5000/calico/cni@{digest}");
    for reference in [&target, &by_digest] {
        let raw = ns.exec_ok(
            "skopeo",
            &["inspect", "--raw", "--tls-verify=false", reference],
        );
        let file = dir.path().join("manifest.json");
        std::fs::write(&file, &raw).unwrap();
        let served = ns.exec_ok("skopeo", &["manifest-digest", &file.display().to_string()]);
        assert_eq!(served.trim(), digest, "{reference}");
        let index: serde_json::Value = serde_json::from_str(&raw).unwrap();
        assert_eq!(
            index["mediaType"], "application/vnd.oci.image.index.v1+json",
            "{raw}"
        );
    }
    // Each platform's image is there: a node of either architecture pulls its own.
    for arch in ARCHES {
        let out = ns.exec_ok(
            "skopeo",
            &[
                "--override-os",
                "linux",
                "--override-arch",
                arch,
                "inspect",
                "--tls-verify=false",
                &target,
            ],
        );
        let inspected: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(inspected["Architecture"], arch, "{out}");
        assert_eq!(
            inspected["Labels"]["org.opencontainers.image.version"], VERSION,
            "{out}"
        );
    }
}

/// The pod's service-account mount for a container: `token`, `ca.crt`, `namespace`.
fn service_account_mount(dir: &Path, k: &RealK8s, token: &str) -> String {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("token"), token).unwrap();
    std::fs::write(dir.join("ca.crt"), k.ca_pem()).unwrap();
    std::fs::write(dir.join("namespace"), "kube-system").unwrap();
    format!(
        "{}:/var/run/secrets/kubernetes.io/serviceaccount:ro",
        dir.display()
    )
}

#[test]
fn podman_runs_install_cni_against_the_real_api_server() {
    let test = "podman_runs_install_cni_against_the_real_api_server";
    let Some(tar) = image(test) else {
        return;
    };
    let Some((host, k)) = cluster(test) else {
        return;
    };
    let podman = Podman::new();
    let name = podman.load(&tar);
    let node_token = token_for(&k, "calico-node");
    let dirs = TempDir::new("image-daemonset");
    let (bin, net) = (
        dirs.path().join("opt/cni/bin"),
        dirs.path().join("etc/cni/net.d"),
    );
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::create_dir_all(&net).unwrap();
    // The DaemonSet's mounts and environment (calico.yaml's install-cni container).
    let mounts = [
        format!("{}:/host/opt/cni/bin", bin.display()),
        format!("{}:/host/etc/cni/net.d", net.display()),
        service_account_mount(&dirs.path().join("sa"), &k, &node_token),
    ];
    let port = k.port().to_string();
    let template = r#"{"name":"k8s-pod-network","cniVersion":"0.3.1","plugins":[{"type":"calico",
        "log_level":"__LOG_LEVEL__","log_file_path":"__LOG_FILE_PATH__","datastore_type":"kubernetes",
        "nodename":"__KUBERNETES_NODE_NAME__","mtu":__CNI_MTU__,"ipam":{"type":"calico-ipam"},
        "policy":{"type":"k8s"},"kubernetes":{"kubeconfig":"__KUBECONFIG_FILEPATH__"}},
        {"type":"portmap","snat":true,"capabilities":{"portMappings":true}}]}"#;
    let node_name = NODE.to_string();
    let out = podman.run_container(
        Some(host.path()),
        &mounts,
        &[
            ("SLEEP", "false"),
            ("CNI_CONF_NAME", "10-calico.conflist"),
            ("CNI_NETWORK_CONFIG", template),
            ("KUBERNETES_NODE_NAME", &node_name),
            ("KUBERNETES_SERVICE_HOST", "127.0.0.1"),
            ("KUBERNETES_SERVICE_PORT", &port),
        ],
        &name,
        &["/opt/cni/bin/install"],
    );
    assert_eq!(out.code, 0, "install-cni: {}{}", out.stdout, out.stderr);
    // Every file it wrote.
    let mut names: Vec<String> = std::fs::read_dir(&bin)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "calico",
            "calico-ipam",
            "host-local",
            "loopback",
            "portmap",
            "tuning"
        ]
    );
    let mut conf_names: Vec<String> = std::fs::read_dir(&net)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    conf_names.sort();
    assert_eq!(conf_names, ["10-calico.conflist", "calico-kubeconfig"]);
    let kc = std::fs::read_to_string(net.join("calico-kubeconfig")).unwrap();
    assert!(
        kc.contains(&format!("server: https://127.0.0.1:{}\n", k.port())),
        "{kc}"
    );
    let token = kc
        .lines()
        .find_map(|l| l.trim().strip_prefix("token: "))
        .unwrap();
    assert_ne!(token, node_token);
    let conf: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(net.join("10-calico.conflist")).unwrap())
            .unwrap();
    assert_eq!(conf["plugins"][0]["nodename"], NODE);
    assert_eq!(
        conf["plugins"][0]["kubernetes"]["kubeconfig"],
        "/etc/cni/net.d/calico-kubeconfig"
    );
    assert_eq!(conf["plugins"][1]["type"], "portmap");
    assert_eq!(conf["plugins"].as_array().map(Vec::len), Some(2));
}

#[test]
fn podman_runs_upgrade_ipam_against_the_real_api_server() {
    let test = "podman_runs_upgrade_ipam_against_the_real_api_server";
    let Some(tar) = image(test) else {
        return;
    };
    let Some((host, k)) = cluster(test) else {
        return;
    };
    let podman = Podman::new();
    let name = podman.load(&tar);
    // A node that ran host-local: its podCIDR, a running pod with a host-local address.
    k.put(
        &format!("/api/v1/nodes/{NODE}"),
        serde_json::json!({"apiVersion":"v1","kind":"Node","metadata":{"name":NODE},"spec":{"podCIDR":"10.77.1.0/24"}}),
    );
    k.put(
        "/api/v1/namespaces/default/pods/web-1",
        serde_json::json!({"apiVersion":"v1","kind":"Pod","metadata":{"name":"web-1","namespace":"default"},
            "spec":{"nodeName":NODE,"containers":[{"name":"c","image":"busybox"}]}}),
    );
    let status = k.request(
        "PATCH",
        "/api/v1/namespaces/default/pods/web-1/status",
        Some(serde_json::json!({"status":{"phase":"Running","podIP":"10.77.1.5","podIPs":[{"ip":"10.77.1.5"}]}})),
        "application/merge-patch+json",
    );
    assert_eq!(status.status, 200, "{status:?}");
    let dirs = TempDir::new("image-upgrade");
    let data = dirs.path().join("networks/k8s-pod-network");
    let bin = dirs.path().join("opt/cni/bin");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::write(data.join("10.77.1.5"), "cid-web-1\r\neth0").unwrap();
    // upgrade-ipam runs as calico-node, whose RBAC covers IPAM: the admin token stands in.
    let mounts = [
        format!(
            "{}:/var/lib/cni/networks",
            dirs.path().join("networks").display()
        ),
        format!("{}:/host/opt/cni/bin", bin.display()),
        service_account_mount(&dirs.path().join("sa"), &k, &k.admin_token()),
    ];
    let port = k.port().to_string();
    let node_name = NODE.to_string();
    let out = podman.run_container(
        Some(host.path()),
        &mounts,
        &[
            ("KUBERNETES_NODE_NAME", &node_name),
            ("CALICO_NETWORKING_BACKEND", "bird"),
            ("KUBERNETES_SERVICE_HOST", "127.0.0.1"),
            ("KUBERNETES_SERVICE_PORT", &port),
        ],
        &name,
        &["/opt/cni/bin/calico-ipam", "-upgrade"],
    );
    assert_eq!(out.code, 0, "upgrade-ipam: {}{}", out.stdout, out.stderr);
    assert!(
        out.stderr
            .contains("migration from host-local to calico-ipam complete"),
        "{}",
        out.stderr
    );
    let handle = k.get("/apis/crd.projectcalico.org/v1/ipamhandles/k8s-pod-network.cid-web-1");
    assert!(handle.is_some(), "the pod's address migrated");
    assert!(!data.exists(), "host-local's data dir removed");
}
