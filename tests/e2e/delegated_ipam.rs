//! Audit row 18: an IPAM plugin that `calico` runs from CNI_PATH (any `ipam.type` but an
//! in-process calico-ipam) and that fails is reported as libcni reports it
//! (`invoke/raw_exec.go`, `pluginErr`): byte for byte what upstream v3.32.1's `calico` printed
//! for the same fake plugins, for ADD and DEL, and by the same rules for CHECK (which upstream
//! does not delegate). A plugin whose file is busy (being written) is started again a second
//! later, up to five times, within the call's deadline (upstream's build gives up after one
//! second: docs/differences.md).
//!
//! The expected outputs were recorded from upstream's binary. With `CALICO_UPSTREAM_BIN` set
//! (the folder of upstream's `calico`, as for the differential suite), every ADD and DEL is
//! also made by upstream's binary, in the same world, and held to the same record.

use std::fs::OpenOptions;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::json;

use crate::common::cni::{report_skip, run_plugin, with_prev_result, Invocation, Outcome, TempDir};
use crate::common::world::World;

/// The fake plugin's name, as `ipam.type` names it.
const PLUGIN: &str = "fake-ipam";

/// One way for the plugin to fail (its shell after `#!/bin/sh`) and what `calico` printed.
struct Failure {
    what: &'static str,
    body: &'static str,
    printed: &'static str,
}

/// The failures and upstream's stdout for each, for ADD and DEL alike.
const FAILURES: &[Failure] = &[
    Failure {
        what: "exits 1 without a word",
        body: "exit 1",
        printed: r#"{
    "code": 0,
    "msg": "netplugin failed with no error message: exit status 1"
}"#,
    },
    Failure {
        what: "is killed",
        body: "kill -9 $$",
        printed: r#"{
    "code": 0,
    "msg": "netplugin failed with no error message: signal: killed"
}"#,
    },
    Failure {
        what: "writes only to stderr (Go's %q of it: quotes, tab, newline, HTML characters, \
               a printable and an unprintable non-ASCII rune, an invalid byte, control \
               characters, a zero-width space)",
        body: r#"printf 'boom "quoted"\ttab\nline2 <&> caf\303\251 nbsp\302\240 bad\377 ctl\001 del\177 zw\342\200\213\n' >&2
exit 1"#,
        printed: r#"{
    "code": 0,
    "msg": "netplugin failed: \"boom \\\"quoted\\\"\\ttab\\nline2 \u003c\u0026\u003e café nbsp\\u00a0 bad\\xff ctl\\x01 del\\x7f zw\\u200b\\n\""
}"#,
    },
    Failure {
        what: "writes what is not JSON to stdout (its stderr then unused)",
        body: "echo 'oops: not json'\necho 'on stderr' >&2\nexit 1",
        printed: r#"{
    "code": 0,
    "msg": "netplugin failed but error parsing its diagnostic message \"oops: not json\\n\": invalid character 'o' looking for beginning of value"
}"#,
    },
    Failure {
        what: "writes its own error object",
        body: r#"printf '{"code": 7, "msg": "bad config", "details": "some details"}'
exit 1"#,
        printed: r#"{
    "code": 7,
    "msg": "bad config",
    "details": "some details"
}"#,
    },
    Failure {
        what: "writes an error object with a code beyond 32 bits and keys in other cases",
        body: r#"printf '{"code": 5000000000, "MSG": "upper", "detaiLs": "x"}'
exit 1"#,
        printed: r#"{
    "code": 5000000000,
    "msg": "upper",
    "details": "x"
}"#,
    },
    Failure {
        what: "writes an error object whose code is a string (its details still decoded)",
        body: r#"printf '{"code": "7", "msg": "m", "details": "dd"}'
exit 1"#,
        printed: r#"{
    "code": 0,
    "msg": "netplugin failed but error parsing its diagnostic message \"{\\\"code\\\": \\\"7\\\", \\\"msg\\\": \\\"m\\\", \\\"details\\\": \\\"dd\\\"}\": json: cannot unmarshal string into Go struct field Error.code of type uint",
    "details": "dd"
}"#,
    },
    Failure {
        what: "writes an error object whose msg is a number (its code still decoded)",
        body: r#"printf '{"code": 12, "msg": 5}'
exit 1"#,
        printed: r#"{
    "code": 12,
    "msg": "netplugin failed but error parsing its diagnostic message \"{\\\"code\\\": 12, \\\"msg\\\": 5}\": json: cannot unmarshal number into Go struct field Error.msg of type string"
}"#,
    },
    Failure {
        what: "writes a negative code",
        body: r#"printf '{"code": -1, "msg": {"a":1}}'
exit 1"#,
        printed: r#"{
    "code": 0,
    "msg": "netplugin failed but error parsing its diagnostic message \"{\\\"code\\\": -1, \\\"msg\\\": {\\\"a\\\":1}}\": json: cannot unmarshal number -1 into Go struct field Error.code of type uint"
}"#,
    },
    Failure {
        what: "writes null",
        body: "printf 'null'\nexit 1",
        printed: r#"{
    "code": 0,
    "msg": ""
}"#,
    },
    Failure {
        what: "writes a JSON list",
        body: "printf '[1,2]'\nexit 1",
        printed: r#"{
    "code": 0,
    "msg": "netplugin failed but error parsing its diagnostic message \"[1,2]\": json: cannot unmarshal array into Go value of type types.Error"
}"#,
    },
    Failure {
        what: "writes an error object followed by more",
        body: r#"printf '{"code": 1} trailing'
exit 1"#,
        printed: r#"{
    "code": 0,
    "msg": "netplugin failed but error parsing its diagnostic message \"{\\\"code\\\": 1} trailing\": invalid character 't' after top-level value"
}"#,
    },
];

/// Plugins that cannot be started, and what `calico` printed (`{path}`: the plugin's path).
const START_FAILURES: &[(&str, &str, &str)] = &[
    (
        "its interpreter does not exist",
        "#!/nonexistent/sh\nexit 1\n",
        r#"{
    "code": 0,
    "msg": "netplugin failed with no error message: fork/exec {path}: no such file or directory"
}"#,
    ),
    (
        "it is not an executable format",
        "garbage without a shebang\n",
        r#"{
    "code": 0,
    "msg": "netplugin failed with no error message: fork/exec {path}: exec format error"
}"#,
    ),
];

/// A result the fake plugin gives for ADD when it is not the verb that fails.
const RESULT: &str = r#"{"cniVersion":"1.0.0","ips":[{"address":"10.66.0.5/24"}]}"#;

/// A CNI_PATH holding `calico` (the binary under test) and the fake plugin `script`.
struct CniDir {
    dir: TempDir,
}

impl CniDir {
    fn new(calico: &Path, script: &str) -> CniDir {
        let dir = TempDir::new("delegated-ipam");
        std::os::unix::fs::symlink(calico, dir.path().join("calico")).unwrap();
        let d = CniDir { dir };
        d.set_plugin(script);
        d
    }

    fn plugin(&self) -> PathBuf {
        self.dir.path().join(PLUGIN)
    }

    fn set_plugin(&self, script: &str) {
        std::fs::write(self.plugin(), script).unwrap();
        std::fs::set_permissions(self.plugin(), std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    fn call(&self, w: &World, inv: &Invocation, conf: &str) -> Outcome {
        let calico = self.dir.path().join("calico");
        let path = self.dir.path().display().to_string();
        run_plugin(&calico, &path, Some(w.host.name()), inv, conf)
    }
}

fn ours() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_calico"))
}

/// Upstream's `calico`, when `CALICO_UPSTREAM_BIN` names its folder.
fn upstream() -> Option<PathBuf> {
    let dir = std::env::var_os("CALICO_UPSTREAM_BIN")?;
    let calico = PathBuf::from(dir).join("calico");
    calico.is_file().then_some(calico)
}

/// The binaries to hold to the record: ours, and upstream's when it is there.
fn sides() -> Vec<(&'static str, PathBuf)> {
    let mut all = vec![("ours", ours())];
    all.extend(upstream().map(|u| ("upstream", u)));
    all
}

fn conf(w: &World) -> String {
    w.conf(json!({"ipam": {"type": PLUGIN}}))
}

/// `out` failed with exit code 1 and printed exactly `printed`.
fn assert_printed(out: &Outcome, printed: &str, what: &str) {
    assert_eq!(
        (out.code, out.stdout.as_str()),
        (1, printed),
        "{what}; stderr: {}",
        out.stderr
    );
}

#[test]
fn a_failing_plugin_is_reported_as_libcni_reports_it() {
    let w = World::new();
    let conf = conf(&w);
    let mut n = 0;
    for (side, calico) in sides() {
        for f in FAILURES {
            let dir = CniDir::new(&calico, &format!("#!/bin/sh\n{}\n", f.body));
            for command in ["ADD", "DEL"] {
                n += 1;
                let pod = w.pod();
                let inv = Invocation::new(command, &format!("dlg{n}"), pod.path());
                let out = dir.call(&w, &inv, &conf);
                assert_printed(
                    &out,
                    f.printed,
                    &format!("{side} {command}: a plugin that {}", f.what),
                );
            }
        }
        for (what, script, printed) in START_FAILURES {
            let dir = CniDir::new(&calico, script);
            let printed = printed.replace("{path}", &dir.plugin().display().to_string());
            for command in ["ADD", "DEL"] {
                n += 1;
                let pod = w.pod();
                let inv = Invocation::new(command, &format!("dlg{n}"), pod.path());
                let out = dir.call(&w, &inv, &conf);
                assert_printed(
                    &out,
                    &printed,
                    &format!("{side} {command}: a plugin {what}"),
                );
            }
        }
    }
    w.assert_clean();
}

/// CHECK (ours: upstream prints `OK` and asks nothing) reports the plugin's failure by the
/// same rules, after an ADD the plugin served.
#[test]
fn a_failing_check_is_reported_as_libcni_reports_it() {
    let w = World::new();
    let conf = conf(&w);
    for (n, f) in FAILURES.iter().enumerate() {
        let script = format!(
            "#!/bin/sh\ncase \"$CNI_COMMAND\" in\nADD) echo '{RESULT}'; exit 0;;\nDEL) exit 0;;\nesac\n{}\n",
            f.body
        );
        let dir = CniDir::new(&ours(), &script);
        let pod = w.pod();
        let add = Invocation::new("ADD", &format!("chk{n}"), pod.path());
        let result = dir.call(&w, &add, &conf);
        result.assert_ok();
        let check = dir.call(
            &w,
            &add.as_check(),
            &with_prev_result(&conf, &result.json()),
        );
        assert_printed(
            &check,
            f.printed,
            &format!("CHECK: a plugin that {}", f.what),
        );
        dir.call(&w, &add.as_del(), &conf).assert_ok();
    }
    w.assert_clean();
}

/// A plugin that succeeds: its result, and what it wrote to stderr passed on to ours (as
/// libcni does), not mistaken for a failure.
#[test]
fn a_plugin_that_succeeds_with_stderr_output() {
    let w = World::new();
    let conf = conf(&w);
    let script = format!(
        "#!/bin/sh\necho 'a warning' >&2\n[ \"$CNI_COMMAND\" = ADD ] && echo '{RESULT}'\nexit 0\n"
    );
    let dir = CniDir::new(&ours(), &script);
    let pod = w.pod();
    let add = Invocation::new("ADD", "ok1", pod.path());
    let out = dir.call(&w, &add, &conf);
    out.assert_ok();
    assert_eq!(out.json()["ips"][0]["address"], "10.66.0.5/32");
    assert!(out.stderr.contains("a warning"), "stderr: {}", out.stderr);
    dir.call(&w, &add.as_del(), &conf).assert_ok();
    w.assert_clean();
}

/// Holds `path` open for writing (what an installer copying the plugin does) for `hold`.
fn hold_open(path: &Path, hold: Duration) -> std::thread::JoinHandle<()> {
    let file = OpenOptions::new().append(true).open(path).unwrap();
    std::thread::spawn(move || {
        std::thread::sleep(hold);
        drop(file);
    })
}

/// Whether this kernel refuses to exec a file open for writing (`ETXTBSY`).
fn busy_files_are_refused(dir: &CniDir) -> bool {
    let file = OpenOptions::new().append(true).open(dir.plugin()).unwrap();
    let refused = std::process::Command::new(dir.plugin())
        .output()
        .err()
        .and_then(|e| e.raw_os_error())
        == Some(libc::ETXTBSY);
    drop(file);
    refused
}

#[test]
fn a_busy_plugin_is_started_again_within_the_deadline() {
    let w = World::new();
    let conf = conf(&w);
    let script = format!("#!/bin/sh\n[ \"$CNI_COMMAND\" = ADD ] && echo '{RESULT}'\nexit 0\n");
    let dir = CniDir::new(&ours(), &script);
    if !busy_files_are_refused(&dir) {
        report_skip(
            "a_busy_plugin_is_started_again_within_the_deadline",
            "this kernel runs a file that is open for writing (no ETXTBSY)",
        );
        return;
    }
    let path = dir.plugin().display().to_string();

    // Busy for 1.5 s: a later try starts it.
    let pod = w.pod();
    let add = Invocation::new("ADD", "busy1", pod.path());
    let holder = hold_open(&dir.plugin(), Duration::from_millis(1500));
    let out = dir.call(&w, &add, &conf);
    out.assert_ok();
    assert!(
        out.elapsed >= Duration::from_millis(1500),
        "{:?}",
        out.elapsed
    );
    assert!(out.elapsed < Duration::from_secs(4), "{:?}", out.elapsed);
    holder.join().unwrap();
    dir.call(&w, &add.as_del(), &conf).assert_ok();

    // Busy throughout: five tries more, a second apart, then libcni's words for the exec.
    let holder = hold_open(&dir.plugin(), Duration::from_secs(10));
    let del = Invocation::new("DEL", "busy2", pod.path());
    let out = dir.call(&w, &del, &conf);
    let printed = format!(
        "{{\n    \"code\": 0,\n    \"msg\": \"netplugin failed with no error message: fork/exec {path}: text file busy\"\n}}"
    );
    assert_printed(&out, &printed, "DEL of a plugin busy throughout");
    assert!(out.elapsed >= Duration::from_secs(5), "{:?}", out.elapsed);
    assert!(out.elapsed < Duration::from_secs(7), "{:?}", out.elapsed);

    // Still busy, with a 2 s budget: the call ends at its deadline, "try again later".
    let add = Invocation {
        extra_env: vec![("CALICO_CALL_TIMEOUT_SECONDS".into(), "2".into())],
        ..Invocation::new("ADD", "busy3", pod.path())
    };
    let out = dir.call(&w, &add, &conf);
    let err = out.assert_err();
    assert_eq!(err["code"], 11, "{err}");
    assert_eq!(
        err["msg"],
        format!(
            "calico: the call took longer than its deadline of 2s (CALICO_CALL_TIMEOUT_SECONDS) \
             while waiting to run the IPAM plugin {path} (ADD), whose file is busy"
        ),
        "{err}"
    );
    assert!(out.elapsed >= Duration::from_secs(2), "{:?}", out.elapsed);
    assert!(out.elapsed < Duration::from_secs(4), "{:?}", out.elapsed);

    // Upstream's build (Go's exec.Cmd cannot be started twice) waits one second, then
    // fails whether or not the file is still busy.
    if let Some(calico) = upstream() {
        let up = CniDir::new(&calico, &script);
        let up_holder = hold_open(&up.plugin(), Duration::from_millis(1500));
        let add = Invocation::new("ADD", "busy4", pod.path());
        let out = up.call(&w, &add, &conf);
        assert_printed(
            &out,
            "{\n    \"code\": 0,\n    \"msg\": \"netplugin failed with no error message: exec: already started\"\n}",
            "upstream ADD of a plugin busy for 1.5 s",
        );
        assert!(out.elapsed >= Duration::from_secs(1), "{:?}", out.elapsed);
        up_holder.join().unwrap();
    }
    holder.join().unwrap();
    w.assert_clean();
}

/// The result of a plugin that succeeds, read as libcni reads it (`fixupResultVersion`,
/// `create.Create`): upstream's texts for what is not a result, and a result without a
/// `cniVersion` in the config's version.
#[test]
fn a_plugins_result_is_read_as_libcni_reads_it() {
    let w = World::new();
    let conf = conf(&w);
    let refused: &[(&str, &str)] = &[
        (
            "",
            r#"{
    "code": 999,
    "msg": "failed to unmarshal raw result: unexpected end of JSON input"
}"#,
        ),
        (
            "[1]",
            r#"{
    "code": 999,
    "msg": "failed to unmarshal raw result: json: cannot unmarshal array into Go value of type map[string]interface {}"
}"#,
        ),
        (
            "null",
            r#"{
    "code": 999,
    "msg": "IPAM plugin returned no IP addresses in result"
}"#,
        ),
        (
            r#"{"cniVersion":"9.9.9","ips":[]}"#,
            r#"{
    "code": 999,
    "msg": "unsupported CNI result version \"9.9.9\""
}"#,
        ),
    ];
    let mut n = 0;
    for (side, calico) in sides() {
        for (stdout, printed) in refused {
            let dir = CniDir::new(&calico, &format!("#!/bin/sh\nprintf '%s' '{stdout}'\n"));
            n += 1;
            let pod = w.pod();
            let add = Invocation::new("ADD", &format!("res{n}"), pod.path());
            let out = dir.call(&w, &add, &conf);
            assert_printed(
                &out,
                printed,
                &format!("{side}: a plugin that printed {stdout:?}"),
            );
        }
        for version in [None, Some("")] {
            let mut result = json!({"ips": [{"address": "10.66.0.6/24"}]});
            if let Some(v) = version {
                result["cniVersion"] = v.into();
            }
            let script =
                format!("#!/bin/sh\n[ \"$CNI_COMMAND\" = ADD ] && echo '{result}'\nexit 0\n");
            let dir = CniDir::new(&calico, &script);
            n += 1;
            let pod = w.pod();
            let add = Invocation::new("ADD", &format!("res{n}"), pod.path());
            let out = dir.call(&w, &add, &conf);
            out.assert_ok();
            assert_eq!(
                out.json()["ips"][0]["address"],
                "10.66.0.6/32",
                "{side} {result}"
            );
            dir.call(&w, &add.as_del(), &conf).assert_ok();
        }
    }
    w.assert_clean();
}
