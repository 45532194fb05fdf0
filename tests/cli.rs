//! The binary's own contract: argv[0] dispatch, flags, VERSION, the about text, `-t`.

mod common;

use std::process::{Command, Stdio};

use common::cni::{Bin, Invocation, TempDir};
use common::world::World;
use serde_json::json;

fn exec(
    path: &std::path::Path,
    args: &[&str],
    env: &[(&str, &str)],
    stdin: &str,
) -> (i32, String, String) {
    let mut c = Command::new(path);
    c.args(args).env_clear().env("PATH", "/usr/bin:/bin");
    for (k, v) in env {
        c.env(k, v);
    }
    let mut child = c
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        // VERSION exits without reading stdin: a broken pipe here is expected.
        .ok();
    let out = child.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn argv0_dispatch_and_version_flag() {
    let bin = Bin::new();
    for name in ["calico", "calico-ipam"] {
        let (code, out, _) = exec(&bin.plugin(name), &["-v"], &[], "");
        assert_eq!(code, 0);
        assert_eq!(out, format!("v{}\n", env!("CARGO_PKG_VERSION")));
        let (code, out, _) = exec(&bin.plugin(name), &["--version"], &[], "");
        assert_eq!((code, out.is_empty()), (0, false));
    }
    let dir = TempDir::new("argv0");
    let other = dir.path().join("not-calico");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_calico"), &other).unwrap();
    let (code, _, err) = exec(&other, &[], &[], "");
    assert_eq!(code, 2);
    assert!(
        err.contains("\"calico\"") && err.contains("\"calico-ipam\""),
        "{err}"
    );
    let (code, _, err) = exec(&bin.plugin("calico"), &["-x"], &[], "");
    assert_eq!(code, 2);
    assert!(err.contains("flag provided but not defined: -x"), "{err}");
}

#[test]
fn version_command_and_about_text() {
    let bin = Bin::new();
    for (name, about) in [
        ("calico", "Calico CNI plugin"),
        ("calico-ipam", "Calico CNI IPAM"),
    ] {
        let (code, out, _) = exec(
            &bin.plugin(name),
            &[],
            &[("CNI_COMMAND", "VERSION")],
            "garbage",
        );
        assert_eq!(code, 0);
        assert_eq!(
            out,
            "{\"cniVersion\":\"1.1.0\",\"supportedVersions\":[\"0.1.0\",\"0.2.0\",\"0.3.0\",\"0.3.1\",\"0.4.0\",\"1.0.0\",\"1.1.0\"]}\n"
        );
        let (code, out, err) = exec(&bin.plugin(name), &[], &[], "");
        assert_eq!((code, out.as_str()), (0, ""));
        assert!(err.starts_with(about), "{err}");
        assert!(err.contains(
            "CNI protocol versions supported: 0.1.0, 0.2.0, 0.3.0, 0.3.1, 0.4.0, 1.0.0, 1.1.0"
        ));
    }
}

#[test]
fn connection_test_flag() {
    let w = World::new();
    let conf = w.conf(json!({}));
    let run_t = |conf: &str| {
        let (code, out, _) =
            common::cni::run_flag(&w.bin.plugin("calico"), w.host.name(), "-t", conf);
        (code, out)
    };
    assert_eq!(run_t(&conf), (0, String::new()));
    let (code, out) = run_t(&w.conf(json!({"etcd_endpoints": "http://127.0.0.1:2370"})));
    assert_eq!(code, 1);
    let e: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(e["code"], 100);
    assert_eq!(e["msg"], "data store connection failed");
    w.seed_cluster_information(false);
    assert_eq!(run_t(&conf).0, 1);
}

/// CHECK is real (tests/cni_1_1.rs): without a previous result there is nothing to compare,
/// as the reference plugins say; below 0.4.0 the spec has no CHECK.
#[test]
fn check_needs_a_previous_result() {
    let w = World::new();
    let conf = w.conf(json!({}));
    let pod = w.pod();
    let inv = Invocation::new("CHECK", "chk1", pod.path());
    for plugin in ["calico", "calico-ipam"] {
        let err = w.bin.run(plugin, w.host.name(), &inv, &conf).assert_err();
        assert_eq!(err["msg"], "Required prevResult missing", "{plugin}");
    }
    let old = w.conf(json!({"cniVersion": "0.3.1"}));
    let err = w.calico(&inv, &old).assert_err();
    assert_eq!(err["msg"], "config version does not allow CHECK");
}
