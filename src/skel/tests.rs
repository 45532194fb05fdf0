//! Unit tests of every skel rule, through `run_with` with a fake env and buffers.

use std::collections::HashMap;

use super::result::{IpConfig, Route};
use super::*;

struct TestPlugin;

impl Plugin for TestPlugin {
    fn about(&self) -> String {
        "Test plugin v0".into()
    }
    fn default_result_version(&self) -> &'static str {
        "0.2.0"
    }
    fn add(&self, args: &CmdArgs) -> Result<CniResult, CniError> {
        if args.container_id == "fail" {
            return Err(CniError::internal("boom <x>"));
        }
        if args.container_id == "panic" {
            panic!("oops");
        }
        Ok(CniResult {
            ips: vec![IpConfig {
                address: "10.0.0.5/32".parse().unwrap(),
                gateway: None,
                interface: None,
            }],
            routes: vec![Route {
                dst: "0.0.0.0/0".parse().unwrap(),
                gw: None,
            }],
            ..Default::default()
        })
    }
    fn del(&self, _args: &CmdArgs) -> Result<(), CniError> {
        Ok(())
    }
    fn check(&self, _args: &CmdArgs) -> Result<(), CniError> {
        Ok(())
    }
}

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

fn run(vars: &[(&str, &str)], stdin: &str) -> Run {
    let map: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let env = move |k: &str| map.get(k).cloned();
    let mut input = stdin.as_bytes();
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = run_with(&TestPlugin, &env, &mut input, &mut out, &mut err);
    Run {
        code,
        stdout: String::from_utf8(out).unwrap(),
        stderr: String::from_utf8(err).unwrap(),
    }
}

fn err_of(r: &Run) -> serde_json::Value {
    assert_eq!(r.code, 1, "{}", r.stdout);
    serde_json::from_str(&r.stdout).unwrap()
}

const CONF: &str = r#"{"cniVersion":"1.0.0","name":"net1","type":"calico"}"#;

fn add_env<'a>(extra: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    let mut v = vec![
        ("CNI_COMMAND", "ADD"),
        ("CNI_CONTAINERID", "abc123"),
        ("CNI_NETNS", "/nonexistent/netns"),
        ("CNI_IFNAME", "eth0"),
        ("CNI_PATH", "/opt/cni/bin"),
    ];
    for (k, val) in extra {
        v.retain(|(kk, _)| kk != k);
        if !val.is_empty() {
            v.push((k, val));
        }
    }
    v
}

#[test]
fn no_command_prints_about() {
    let r = run(&[], "");
    assert_eq!(r.code, 0);
    assert_eq!(r.stdout, "");
    assert_eq!(
        r.stderr,
        "Test plugin v0\nCNI protocol versions supported: 0.1.0, 0.2.0, 0.3.0, 0.3.1, 0.4.0, 1.0.0, 1.1.0\n"
    );
}

#[test]
fn no_command_prints_about_whatever_else_is_set() {
    // libcni: a missing CNI_COMMAND is answered with the about text and exit 0, even when
    // every other variable is set and stdin holds a config.
    let r = run(&add_env(&[("CNI_COMMAND", "")]), CONF);
    assert_eq!((r.code, r.stdout.as_str()), (0, ""));
    assert!(r.stderr.starts_with("Test plugin v0\n"), "{}", r.stderr);
    // Even an invalid container ID is not looked at without a command.
    let r = run(
        &add_env(&[("CNI_COMMAND", ""), ("CNI_CONTAINERID", "-bad")]),
        "{bad",
    );
    assert_eq!((r.code, r.stdout.as_str()), (0, ""));
}

#[test]
fn env_is_validated_before_stdin_in_libcni_order() {
    // Bad container ID and bad JSON: the container ID (code 4) wins.
    let e = err_of(&run(&add_env(&[("CNI_CONTAINERID", "-bad")]), "{bad"));
    assert_eq!(
        (e["code"].as_u64(), e["msg"].as_str()),
        (Some(4), Some("invalid characters in containerID"))
    );
    // Bad ifname and a missing CNI_PATH: the invalid value is reported first.
    let e = err_of(&run(
        &add_env(&[("CNI_IFNAME", "a/b"), ("CNI_PATH", "")]),
        CONF,
    ));
    assert_eq!(
        e["msg"],
        "interface name contains / or : or whitespace characters"
    );
    // Bad ifname and a missing network name: code 4, not 7.
    let e = err_of(&run(
        &add_env(&[("CNI_IFNAME", ".")]),
        r#"{"cniVersion":"1.0.0"}"#,
    ));
    assert_eq!(e["code"], 4);
    // The ifname is checked for DEL too; a bad one on GC (not required there) is ignored.
    let e = err_of(&run(
        &add_env(&[("CNI_COMMAND", "DEL"), ("CNI_IFNAME", "..")]),
        CONF,
    ));
    assert_eq!(e["msg"], "interface name is . or ..");
    let r = run(
        &add_env(&[("CNI_COMMAND", "GC"), ("CNI_IFNAME", "..")]),
        CONF,
    );
    assert_eq!(err_of(&r)["msg"], "config version does not allow GC");
    // Unknown command: the config is still decoded first (code 6 before code 4).
    let e = err_of(&run(&add_env(&[("CNI_COMMAND", "FOO")]), "{bad"));
    assert_eq!(e["code"], 6);
}

#[test]
fn version_ignores_stdin() {
    let r = run(&[("CNI_COMMAND", "VERSION")], "not json at all");
    assert_eq!(r.code, 0);
    assert_eq!(
        r.stdout,
        "{\"cniVersion\":\"1.1.0\",\"supportedVersions\":[\"0.1.0\",\"0.2.0\",\"0.3.0\",\"0.3.1\",\"0.4.0\",\"1.0.0\",\"1.1.0\"]}\n"
    );
}

#[test]
fn missing_env_per_command() {
    let r = run(&[("CNI_COMMAND", "ADD")], CONF);
    let e = err_of(&r);
    assert_eq!(e["code"], 4);
    assert_eq!(
        e["msg"],
        "required env variables [CNI_CONTAINERID,CNI_NETNS,CNI_IFNAME,CNI_PATH] missing"
    );
    // DEL does not need CNI_NETNS.
    let r = run(&[("CNI_COMMAND", "DEL")], CONF);
    assert_eq!(
        err_of(&r)["msg"],
        "required env variables [CNI_CONTAINERID,CNI_IFNAME,CNI_PATH] missing"
    );
    let r = run(&[("CNI_COMMAND", "GC")], CONF);
    assert_eq!(
        err_of(&r)["msg"],
        "required env variables [CNI_PATH] missing"
    );
    let r = run(&add_env(&[("CNI_COMMAND", "DEL"), ("CNI_NETNS", "")]), CONF);
    assert_eq!(r.code, 0, "{}", r.stdout);
}

#[test]
fn error_json_format() {
    let r = run(&[("CNI_COMMAND", "ADD")], CONF);
    assert_eq!(
        r.stdout,
        "{\n    \"code\": 4,\n    \"msg\": \"required env variables [CNI_CONTAINERID,CNI_NETNS,CNI_IFNAME,CNI_PATH] missing\"\n}"
    );
    let r = run(&add_env(&[("CNI_CONTAINERID", "fail")]), CONF);
    assert_eq!(
        r.stdout,
        "{\n    \"code\": 999,\n    \"msg\": \"boom \\u003cx\\u003e\"\n}"
    );
}

#[test]
fn container_id_and_ifname_rules() {
    let e = err_of(&run(&add_env(&[("CNI_CONTAINERID", "-bad")]), CONF));
    assert_eq!(e["code"], 4);
    assert_eq!(e["msg"], "invalid characters in containerID");
    assert_eq!(e["details"], "-bad");
    for (ifname, msg) in [
        ("abcdefghijklmnop", "interface name is too long"),
        (".", "interface name is . or .."),
        ("..", "interface name is . or .."),
        (
            "a/b",
            "interface name contains / or : or whitespace characters",
        ),
        (
            "a:b",
            "interface name contains / or : or whitespace characters",
        ),
        (
            "a b",
            "interface name contains / or : or whitespace characters",
        ),
    ] {
        let e = err_of(&run(&add_env(&[("CNI_IFNAME", ifname)]), CONF));
        assert_eq!(e["code"], 4);
        assert_eq!(e["msg"], msg, "{ifname}");
    }
    let e = err_of(&run(&add_env(&[("CNI_IFNAME", "abcdefghijklmnop")]), CONF));
    assert_eq!(
        e["details"],
        "interface name should be less than 16 characters"
    );
}

#[test]
fn config_checks() {
    let e = err_of(&run(&add_env(&[]), "{bad"));
    assert_eq!(e["code"], 6);
    assert!(e["msg"]
        .as_str()
        .unwrap()
        .starts_with("error unmarshall network config: "));
    let e = err_of(&run(&add_env(&[]), r#"{"cniVersion":"1.0.0"}"#));
    assert_eq!(e["code"], 7);
    assert_eq!(e["msg"], "missing network name");
    let e = err_of(&run(&add_env(&[]), r#"{"name":"a b"}"#));
    assert_eq!(e["code"], 7);
    assert_eq!(e["msg"], "invalid characters found in network name");
    assert_eq!(e["details"], "a b");
}

#[test]
fn version_negotiation_and_gates() {
    let e = err_of(&run(&add_env(&[]), r#"{"cniVersion":"1.2.0","name":"n"}"#));
    assert_eq!(e["code"], 1);
    assert_eq!(e["msg"], "incompatible CNI versions");
    assert_eq!(
        e["details"],
        r#"config is "1.2.0", plugin supports ["0.1.0" "0.2.0" "0.3.0" "0.3.1" "0.4.0" "1.0.0" "1.1.0"]"#
    );
    // A 1.1.0 config gets a 1.1.0 result (the 1.0 shape).
    let r = run(&add_env(&[]), r#"{"cniVersion":"1.1.0","name":"n"}"#);
    assert_eq!(r.code, 0, "{}", r.stdout);
    let v: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(v["cniVersion"], "1.1.0");
    assert!(v["ips"][0].get("version").is_none());
    // No cniVersion but a cniVersions list: the list is the runtime's, not read (as libcni's
    // plugin side): no version given, the plugin's default result version.
    let r = run(
        &add_env(&[]),
        r#"{"cniVersions":["0.4.0","1.1.0","7.0.0"],"name":"n"}"#,
    );
    let v: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    assert_ne!(v["cniVersion"], "1.1.0");
    let r = run(
        &add_env(&[]),
        r#"{"cniVersion":"0.4.0","cniVersions":["1.1.0"],"name":"n"}"#,
    );
    let v: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(v["cniVersion"], "0.4.0");
    let check = |v: &str| {
        run(
            &add_env(&[("CNI_COMMAND", "CHECK")]),
            &format!(r#"{{"cniVersion":"{v}","name":"n"}}"#),
        )
    };
    assert_eq!(
        err_of(&check("0.3.1"))["msg"],
        "config version does not allow CHECK"
    );
    assert_eq!(
        err_of(&check("1.2.0"))["msg"],
        "plugin version does not allow CHECK"
    );
    assert_eq!(check("1.1.0").code, 0);
    assert_eq!(check("0.4.0").code, 0);
    assert_eq!(check("1.0.0").stdout, "");
    for cmd in ["GC", "STATUS"] {
        let r = run(&[("CNI_COMMAND", cmd), ("CNI_PATH", "/x")], CONF);
        assert_eq!(
            err_of(&r)["msg"],
            format!("config version does not allow {cmd}")
        );
        let r = run(
            &[("CNI_COMMAND", cmd), ("CNI_PATH", "/x")],
            r#"{"cniVersion":"1.2.0","name":"n"}"#,
        );
        assert_eq!(
            err_of(&r)["msg"],
            format!("plugin version does not allow {cmd}")
        );
        // At 1.1.0 the plugin's handler runs (the test plugin's default: silent success).
        let r = run(
            &[("CNI_COMMAND", cmd), ("CNI_PATH", "/x")],
            r#"{"cniVersion":"1.1.0","name":"n"}"#,
        );
        assert_eq!((r.code, r.stdout.as_str()), (0, ""));
    }
    let e = err_of(&run(&add_env(&[("CNI_COMMAND", "FOO")]), CONF));
    assert_eq!(e["code"], 4);
    assert_eq!(e["msg"], "unknown CNI_COMMAND: FOO");
}

#[test]
fn add_prints_result_in_config_version() {
    let r = run(&add_env(&[]), CONF);
    assert_eq!(r.code, 0);
    assert!(r.stdout.starts_with("{\n    \"cniVersion\": \"1.0.0\""));
    assert!(!r.stdout.ends_with('\n'));
    // No cniVersion: the plugin's default result version.
    let r = run(&add_env(&[]), r#"{"name":"n"}"#);
    assert_eq!(r.code, 0);
    assert!(
        r.stdout.contains("\"cniVersion\": \"0.2.0\""),
        "{}",
        r.stdout
    );
    assert!(r.stdout.contains("\"ip4\""));
}

#[test]
fn panics_become_errors() {
    let e = err_of(&run(&add_env(&[("CNI_CONTAINERID", "panic")]), CONF));
    assert_eq!(e["code"], 999);
    assert_eq!(e["msg"], "Calico CNI panicked during ADD: oops");
}

/// Our own netns is refused before the plugin runs: one error JSON, no result. ADD, DEL
/// and CHECK; `CNI_NETNS_OVERRIDE` (1 or any-case true) skips it; a path that cannot be
/// opened is left to the plugin.
#[test]
fn netns_guard() {
    let own = "/proc/thread-self/ns/net";
    let same = "plugin's netns and netns from CNI_NETNS should not be the same";
    for cmd in ["ADD", "DEL", "CHECK"] {
        let r = run(&add_env(&[("CNI_COMMAND", cmd), ("CNI_NETNS", own)]), CONF);
        let e = err_of(&r);
        assert_eq!(
            (e["code"].as_u64(), e["msg"].as_str()),
            (Some(8), Some(same))
        );
        assert!(
            r.stdout.starts_with("{\n    \"code\": 8"),
            "{cmd}: {}",
            r.stdout
        );
    }
    for o in ["1", "true", "TRUE", "True"] {
        let r = run(
            &add_env(&[("CNI_NETNS", own), ("CNI_NETNS_OVERRIDE", o)]),
            CONF,
        );
        assert_eq!(r.code, 0, "{o}: {}", r.stdout);
    }
    // Anything else is not an override.
    let r = run(
        &add_env(&[("CNI_NETNS", own), ("CNI_NETNS_OVERRIDE", "yes")]),
        CONF,
    );
    assert_eq!(err_of(&r)["code"], 8);
    let r = run(&add_env(&[("CNI_NETNS", "/does/not/exist")]), CONF);
    assert_eq!(r.code, 0);
    // A config error still comes first (libcni checks the version before the call).
    let e = err_of(&run(
        &add_env(&[("CNI_NETNS", own)]),
        r#"{"cniVersion":"9.9.9","name":"n"}"#,
    ));
    assert_eq!(e["code"], 1);
}

#[test]
fn netns_comparison() {
    use std::path::Path;
    let own = Path::new("/proc/thread-self/ns/net");
    assert_eq!(netns_is_same(own, own), Ok(true));
    assert_eq!(netns_is_same(Path::new("/proc/self/ns/net"), own), Ok(true));
    // Another namespace type of the same thread is another inode.
    assert_eq!(
        netns_is_same(Path::new("/proc/self/ns/mnt"), own),
        Ok(false)
    );
    // No CNI_NETNS to open: not this check's to refuse.
    assert_eq!(netns_is_same(Path::new("/no/such/netns"), own), Ok(false));
    // Our own netns unreadable: libcni's error.
    let e = netns_is_same(own, Path::new("/no/such/own")).unwrap_err();
    assert_eq!((e.code, e.msg.as_str()), (8, "get plugin's netns failed"));
    assert!(own_netns_path().exists());
}
