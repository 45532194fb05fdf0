//! `make install`: DESTDIR and PREFIX aware, lays out `calico`, the relative `calico-ipam`
//! symlink and an inert example conflist (`*.conflist.example`, which no runtime loads, so a
//! node's own conflist is never replaced or shadowed). The test installs the binary this test
//! run built (`BIN=`), so no release build is needed.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::common::cni::{run_command_within, Outcome, TempDir};

const CALICO: &str = env!("CARGO_BIN_EXE_calico");

/// `make -s install <vars>` from the source tree, bounded.
fn make_install(vars: &[String]) -> Outcome {
    let mut cmd = Command::new("make");
    cmd.arg("-s")
        .arg("install")
        .arg(format!("BIN={CALICO}"))
        .args(vars)
        .current_dir(env!("CARGO_MANIFEST_DIR"));
    // An outer `make test` must not hand its settings to this one.
    for k in ["MAKEFLAGS", "MFLAGS", "MAKELEVEL"] {
        cmd.env_remove(k);
    }
    run_command_within(cmd, "", Duration::from_secs(120), "make install")
}

fn same_file_contents(a: &Path, b: &Path) -> bool {
    Command::new("cmp")
        .arg("-s")
        .arg(a)
        .arg(b)
        .status()
        .is_ok_and(|s| s.success())
}

/// `<bin> -v` and `CNI_COMMAND=VERSION <bin>`: the version line, and the supported versions.
fn run_installed(bin: &Path) -> (String, String) {
    let v = Command::new(bin).arg("-v").output().expect("run -v");
    let version = Command::new(bin)
        .env("CNI_COMMAND", "VERSION")
        .output()
        .expect("run VERSION");
    assert!(v.status.success() && version.status.success(), "{bin:?}");
    (
        String::from_utf8_lossy(&v.stdout).into_owned(),
        String::from_utf8_lossy(&version.stdout).into_owned(),
    )
}

fn assert_layout(root: &Path, prefix: &str, conf_dir: &str) {
    let bin_dir = root.join(prefix.trim_start_matches('/'));
    let calico = bin_dir.join("calico");
    let meta = std::fs::metadata(&calico).expect("calico installed");
    assert!(meta.is_file());
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(meta.permissions().mode() & 0o777, 0o755);
    assert!(
        same_file_contents(&calico, Path::new(CALICO)),
        "calico is BIN"
    );
    let ipam = bin_dir.join("calico-ipam");
    assert_eq!(
        std::fs::read_link(&ipam).expect("calico-ipam is a symlink"),
        Path::new("calico"),
        "relative symlink"
    );
    // Both names work from the installed place (argv[0] dispatch through the symlink).
    let (v1, version1) = run_installed(&calico);
    let (v2, version2) = run_installed(&ipam);
    assert_eq!(
        v1,
        format!("v3.32.1+calico-cni-rs.{}\n", env!("CARGO_PKG_VERSION"))
    );
    assert_eq!((v1, &version1), (v2, &version2));
    assert!(version1.contains("\"supportedVersions\""), "{version1}");

    let conf = root.join(conf_dir.trim_start_matches('/'));
    let example = conf.join("10-calico-kubernetes.conflist.example");
    assert!(
        same_file_contents(
            &example,
            &Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("conf-examples/10-calico-kubernetes.conflist")
        ),
        "example conflist installed as {}",
        example.display()
    );
}

#[test]
fn install_into_destdir_with_default_prefix() {
    let dest = TempDir::new("install");
    let root = dest.path();
    let out = make_install(&[format!("DESTDIR={}", root.display())]);
    assert_eq!(out.code, 0, "make install: {}{}", out.stdout, out.stderr);
    assert_layout(root, "/opt/cni/bin", "/etc/cni/net.d");
    // Nothing a runtime would load was written: the only file in the conf dir is inert.
    let names: Vec<String> = std::fs::read_dir(root.join("etc/cni/net.d"))
        .expect("conf dir")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, vec!["10-calico-kubernetes.conflist.example"]);
}

#[test]
fn reinstall_keeps_the_nodes_own_conflist_and_replaces_the_binaries() {
    let dest = TempDir::new("install");
    let root = dest.path();
    let conf = root.join("etc/cni/net.d");
    let bin = root.join("opt/cni/bin");
    std::fs::create_dir_all(&conf).expect("conf dir");
    std::fs::create_dir_all(&bin).expect("bin dir");
    // A node already configured: its own conflist, and upstream's two binaries.
    let own = conf.join("10-calico.conflist");
    std::fs::write(&own, "{\"name\":\"mine\"}").expect("own conflist");
    std::fs::write(bin.join("calico"), "old").expect("old calico");
    std::fs::write(bin.join("calico-ipam"), "old").expect("old calico-ipam");
    for _ in 0..2 {
        let out = make_install(&[format!("DESTDIR={}", root.display())]);
        assert_eq!(out.code, 0, "make install: {}{}", out.stdout, out.stderr);
        assert_layout(root, "/opt/cni/bin", "/etc/cni/net.d");
    }
    assert_eq!(
        std::fs::read_to_string(&own).expect("own conflist"),
        "{\"name\":\"mine\"}",
        "the node's conflist is untouched"
    );
}

#[test]
fn install_honours_prefix_and_conf_dir() {
    let dest = TempDir::new("install");
    let root = dest.path();
    let out = make_install(&[
        format!("DESTDIR={}", root.display()),
        "PREFIX=/usr/libexec/cni".into(),
        "CONF_DIR=/etc/cni/conf.d".into(),
    ]);
    assert_eq!(out.code, 0, "make install: {}{}", out.stdout, out.stderr);
    assert_layout(root, "/usr/libexec/cni", "/etc/cni/conf.d");
    assert!(!root.join("opt").exists() && !root.join("etc/cni/net.d").exists());
}
