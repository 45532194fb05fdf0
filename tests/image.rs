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
use common::image::{image, image_dir, Podman};
use common::installer::{cluster, token_for, NODE};
use common::real_k8s::RealK8s;

const VERSION: &str = concat!("v", env!("CARGO_PKG_VERSION"));
const BINARIES: [&str; 6] = [
    "calico",
    "host-local",
    "portmap",
    "loopback",
    "tuning",
    "bandwidth",
];

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
        {"type":"portmap","snat":true,"capabilities":{"portMappings":true}},
        {"type":"bandwidth","capabilities":{"bandwidth":true}}]}"#;
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
            "bandwidth",
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
    assert_eq!(conf["plugins"][2]["type"], "bandwidth");
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
