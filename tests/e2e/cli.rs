//! The binary's own contract: argv[0] dispatch, flags, VERSION, the about text, `-t`.

use std::process::{Command, Stdio};

use crate::common;
use crate::common::cni::{Bin, Invocation, TempDir};
use crate::common::world::World;
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
        assert_eq!(
            out,
            format!("v3.32.1+calico-cni-rs.{}\n", env!("CARGO_PKG_VERSION"))
        );
        // Go's `flag` package: `--v` is `-v`; `-v=false` and a first argument that is not a
        // flag leave the plugin to run (here: the about text, no CNI_COMMAND); `-version`
        // is no flag of upstream's.
        let (code, out, _) = exec(&bin.plugin(name), &["--v"], &[], "");
        assert_eq!((code, out.is_empty()), (0, false));
        for args in [&["-v=false"][..], &["foo", "-v"]] {
            let (code, out, err) = exec(&bin.plugin(name), args, &[], "");
            assert_eq!((code, out.as_str()), (0, ""), "{args:?}");
            assert!(
                err.contains("CNI protocol versions supported"),
                "{args:?}: {err}"
            );
        }
        for (args, why) in [
            (&["-version"][..], "flag provided but not defined: -version"),
            (&["-v", "-x"], "flag provided but not defined: -x"),
            (
                &["-v=maybe"],
                "invalid boolean value \"maybe\" for -v: parse error",
            ),
        ] {
            let (code, out, err) = exec(&bin.plugin(name), args, &[], "");
            assert_eq!((code, out.as_str()), (2, ""), "{args:?}");
            assert!(
                err.starts_with(&format!("{why}\nUsage of ")),
                "{args:?}: {err}"
            );
        }
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

/// CHECK is real (tests/e2e/cni_1_1.rs): without a previous result there is nothing to compare,
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

/// stdout holds exactly one JSON value (the error object), nothing before or after it.
fn one_json_object(stdout: &str) -> serde_json::Value {
    let mut values = serde_json::Deserializer::from_str(stdout).into_iter::<serde_json::Value>();
    let first = values
        .next()
        .unwrap_or_else(|| panic!("no JSON on stdout: {stdout:?}"))
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {stdout:?}"));
    assert!(
        values.next().is_none(),
        "more than one JSON value: {stdout}"
    );
    first
}

const SAME_NETNS: &str = "plugin's netns and netns from CNI_NETNS should not be the same";

/// CNI_NETNS naming the namespace the plugin itself runs in (here the test host's, which
/// `ip netns exec` puts the binary in, as kubelet's host netns would be) is refused before
/// any work: code 8, one error object, no address allocated, no interface built. ADD, DEL
/// and CHECK, both plugins.
#[test]
fn own_netns_is_refused_before_any_work() {
    let w = World::new();
    let conf = w.conf(json!({}));
    let links_before = w.host_sh("ip -o link show | cut -d: -f2");
    let own = w.host.path();
    let add = Invocation::new("ADD", "ownns1", own).k8s("default", "ownpod");
    for plugin in ["calico-ipam", "calico"] {
        let out = w.bin.run(plugin, w.host.name(), &add, &conf);
        let err = out.assert_err_fast();
        assert_eq!(err, json!({"code": 8, "msg": SAME_NETNS}), "{plugin}");
        assert_eq!(one_json_object(&out.stdout), err);
        w.assert_clean();
        assert_eq!(
            w.host_sh("ip -o link show | cut -d: -f2"),
            links_before,
            "{plugin} ADD built a link in its own netns"
        );
        let del = w.bin.run(plugin, w.host.name(), &add.as_del(), &conf);
        assert_eq!(del.assert_err_fast(), json!({"code": 8, "msg": SAME_NETNS}));
        assert_eq!(one_json_object(&del.stdout)["code"], 8);
    }
    // CHECK too (our choice: it enters CNI_NETNS as ADD and DEL do).
    let prev = json!({"cniVersion":"1.0.0","ips":[{"address":"10.65.0.1/32"}]});
    let check_conf = common::cni::with_prev_result(&conf, &prev);
    let check = w.calico(&add.as_check(), &check_conf);
    assert_eq!(check.assert_err_fast()["code"], 8);
    // The same namespace under another path (/proc/<pid>/ns/net of a process in it) is the
    // same namespace.
    let pid = w
        .host_sh("sleep 30 >/dev/null 2>&1 & echo $!")
        .trim()
        .to_string();
    let by_proc = format!("/proc/{pid}/ns/net");
    let inv = Invocation::new("ADD", "ownns2", &by_proc);
    let err = w.ipam(&inv, &conf).assert_err_fast();
    let _ = Command::new("kill").arg(&pid).status();
    assert_eq!(err["msg"], SAME_NETNS);
    w.assert_clean();
}

/// `CNI_NETNS_OVERRIDE=1` (or any-case `true`) skips the check: calico-ipam, which never
/// enters the netns, then allocates and releases as usual.
#[test]
fn netns_override_skips_the_own_netns_check() {
    let w = World::new();
    let conf = w.conf(json!({}));
    for (i, value) in ["1", "TRUE"].into_iter().enumerate() {
        let mut inv = Invocation::new("ADD", &format!("override{i}"), w.host.path());
        inv.extra_env = vec![("CNI_NETNS_OVERRIDE".into(), value.into())];
        let r = w.ipam(&inv, &conf);
        r.assert_ok_fast();
        assert!(r.json()["ips"][0]["address"].is_string(), "{}", r.stdout);
        assert_eq!(w.keys("/calico/ipam/v2/handle/").len(), 1);
        w.ipam(&inv.as_del(), &conf).assert_ok_fast();
        w.assert_clean();
    }
}

/// A CNI_NETNS that does not exist is not this check's: calico-ipam (which never opens it)
/// allocates; calico reports its own error about the netns, not code 8.
#[test]
fn missing_netns_is_left_to_the_plugin() {
    let w = World::new();
    let conf = w.conf(json!({}));
    let inv = Invocation::new("ADD", "nons1", "/var/run/netns/no-such-netns-here");
    w.ipam(&inv, &conf).assert_ok_fast();
    w.ipam(&inv.as_del(), &conf).assert_ok_fast();
    w.assert_clean();
    let err = w.calico(&inv, &conf).assert_err_fast();
    assert_ne!(err["code"], 8, "{err}");
    assert_ne!(err["msg"], SAME_NETNS);
    w.assert_clean();
}
