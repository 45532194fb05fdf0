//! The node installer (`install` by argv[0], upstream's `pkg/install` contract) run as the
//! DaemonSet's `install-cni` container runs it, with its container paths moved into a temp
//! dir (`CALICO_INSTALL_*`): what it copies and writes, what it refuses before writing
//! anything, and its exit codes. The kubeconfig with a TokenRequest token is tested against
//! the real API server in `tests/e2e/real_k8s_install.rs`; the image itself in `tests/e2e/image.rs`.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::cni::run_command_within;
use crate::common::installer::{Node, VERSION};

fn conflist(node: &Node, name: &str) -> serde_json::Value {
    let text = fs::read_to_string(node.path("host/etc/cni/net.d").join(name)).expect("conflist");
    serde_json::from_str(&text).expect("conflist is JSON")
}

fn mode(p: &Path) -> u32 {
    fs::metadata(p).expect("stat").permissions().mode() & 0o7777
}

#[test]
fn installs_binaries_tls_assets_and_the_default_conflist() {
    let node = Node::new();
    for (f, text) in [
        ("etcd-ca", "ca"),
        ("etcd-cert", "cert"),
        ("etcd-key", "key"),
    ] {
        fs::write(node.path("secrets").join(f), text).unwrap();
    }
    fs::set_permissions(
        node.path("secrets/etcd-key"),
        fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    // A node that ran upstream's installer: an old conflist under another name.
    fs::write(node.path("host/etc/cni/net.d/10-calico.conflist"), "{}").unwrap();
    let out = node.run(&[
        ("CNI_CONF_NAME", "05-calico.conflist"),
        ("KUBERNETES_NODE_NAME", "node-7"),
        ("CNI_MTU", "1440"),
        ("DATASTORE_TYPE", "etcdv3"),
        ("ETCD_ENDPOINTS", "https://127.0.0.1:2379"),
    ]);
    assert_eq!(out.code, 0, "{}", out.stderr);

    for dir in ["host/opt/cni/bin", "host/secondary-bin-dir"] {
        let bin = node.path(dir);
        let calico = bin.join("calico");
        assert_eq!(mode(&calico), 0o755);
        assert!(
            fs::symlink_metadata(&calico).unwrap().is_file(),
            "a copy, not a link"
        );
        let v = Command::new(&calico).arg("-v").output().unwrap();
        assert_eq!(String::from_utf8_lossy(&v.stdout).trim(), VERSION);
        // calico-ipam is a link to the copied calico; install is not copied.
        assert_eq!(
            fs::read_link(bin.join("calico-ipam")).unwrap(),
            Path::new("calico")
        );
        assert!(!bin.join("install").exists());
        assert_eq!(
            fs::read(bin.join("portmap")).unwrap(),
            b"#!/bin/sh\nexit 0\n"
        );
        // No temporary file is left behind.
        let names: Vec<String> = fs::read_dir(&bin)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| !n.starts_with('.')), "{names:?}");
    }
    let tls = node.path("host/etc/cni/net.d/calico-tls");
    assert_eq!(fs::read_to_string(tls.join("etcd-cert")).unwrap(), "cert");
    assert_eq!(mode(&tls.join("etcd-key")), 0o600);

    let conf_path = node.path("host/etc/cni/net.d/05-calico.conflist");
    assert_eq!(mode(&conf_path), 0o600);
    let c = conflist(&node, "05-calico.conflist");
    assert_eq!(c["name"], "k8s-pod-network");
    let calico = &c["plugins"][0];
    assert_eq!(calico["type"], "calico");
    assert_eq!(calico["nodename"], "node-7");
    assert_eq!(calico["mtu"], 1440);
    assert_eq!(calico["datastore_type"], "etcdv3");
    assert_eq!(calico["ipam"]["type"], "calico-ipam");
    assert_eq!(calico["policy"]["type"], "k8s");
    assert_eq!(
        calico["kubernetes"]["kubeconfig"],
        "/etc/cni/net.d/calico-kubeconfig"
    );
    assert_eq!(c["plugins"][1]["type"], "portmap");
    // CNI_OLD_CONF_NAME's default is removed; no kubeconfig outside a pod.
    assert!(!node.path("host/etc/cni/net.d/10-calico.conflist").exists());
    assert!(!node.path("host/etc/cni/net.d/calico-kubeconfig").exists());
}

#[test]
fn etcd_placeholders_name_the_copied_tls_files() {
    let node = Node::new();
    fs::write(node.path("secrets/etcd-cert"), "cert").unwrap();
    let template = r#"{"name":"n","cniVersion":"0.3.1","plugins":[{"type":"calico",
        "etcd_endpoints":"__ETCD_ENDPOINTS__","etcd_discovery_srv":"__ETCD_DISCOVERY_SRV__",
        "etcd_cert_file":"__ETCD_CERT_FILE__","etcd_ca_cert_file":"__ETCD_CA_CERT_FILE__",
        "etcd_key_file":"__ETCD_KEY_FILE__","log_file_max_size":__LOG_FILE_MAX_SIZE__,
        "require_mtu_file":__REQUIRE_MTU_FILE__}]}"#;
    fs::write(node.path("template.json"), template).unwrap();
    let file = node.path("template.json").display().to_string();
    let out = node.run(&[
        ("CNI_NETWORK_CONFIG_FILE", &file),
        ("CNI_NETWORK_CONFIG", "not even JSON"),
        ("CNI_NET_DIR", "/etc/kubernetes/cni/net.d"),
        ("ETCD_ENDPOINTS", "https://10.0.0.1:2379"),
        ("ETCD_DISCOVERY_SRV", "example.org"),
        ("TEST_FILE_PERMISSION", "0644"),
    ]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let p = &conflist(&node, "10-calico.conflist")["plugins"][0];
    assert_eq!(p["etcd_endpoints"], "https://10.0.0.1:2379");
    assert_eq!(p["etcd_discovery_srv"], "example.org");
    assert_eq!(
        p["etcd_cert_file"],
        "/etc/kubernetes/cni/net.d/calico-tls/etcd-cert"
    );
    assert_eq!(p["etcd_ca_cert_file"], "");
    assert_eq!(p["etcd_key_file"], "");
    assert_eq!(p["log_file_max_size"], 100);
    assert_eq!(p["require_mtu_file"], false);
    assert_eq!(
        mode(&node.path("host/etc/cni/net.d/10-calico.conflist")),
        0o644
    );
}

#[test]
fn skip_and_no_update_leave_the_hosts_binaries() {
    let node = Node::new();
    fs::write(node.path("host/opt/cni/bin/portmap"), "host's own").unwrap();
    let out = node.run(&[
        ("UPDATE_CNI_BINARIES", "false"),
        ("SKIP_CNI_BINARIES", "calico-ipam"),
    ]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let bin = node.path("host/opt/cni/bin");
    assert_eq!(
        fs::read_to_string(bin.join("portmap")).unwrap(),
        "host's own"
    );
    assert!(!bin.join("calico-ipam").exists());
    assert!(bin.join("calico").is_file());
    // A second run with updates on replaces the host's file and leaves the copy alone.
    let out = node.run(&[]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(
        fs::read(bin.join("portmap")).unwrap(),
        b"#!/bin/sh\nexit 0\n"
    );
    assert!(out.stderr.contains("already up to date"), "{}", out.stderr);
}

#[test]
fn malformed_configs_are_refused_before_anything_is_written() {
    let node = Node::new();
    fs::write(node.path("secrets/etcd-cert"), "cert").unwrap();
    let before = node.host_snapshot();
    let cases: [(&[(&str, &str)], &str); 6] = [
        (
            &[(
                "CNI_NETWORK_CONFIG",
                r#"{"name":"n","plugins":[{"type":"calico","mtu":__CNI_MTU__}]"#,
            )],
            "not valid JSON",
        ),
        (&[("CNI_MTU", "")], "not valid JSON"),
        (
            &[("CNI_NETWORK_CONFIG", r#"{"name":"n","cniVersion":"0.3.1"}"#)],
            "neither \"plugins\" nor \"type\"",
        ),
        (
            &[(
                "CNI_NETWORK_CONFIG",
                r#"{"name":"n","plugins":[{"type":"calico"},{"snat":true}]}"#,
            )],
            "plugins[1] has no \"type\"",
        ),
        (
            &[("CNI_NETWORK_CONFIG_FILE", "/nonexistent/template")],
            "cannot read CNI_NETWORK_CONFIG_FILE",
        ),
        (&[("UPDATE_CNI_BINARIES", "maybe")], "UPDATE_CNI_BINARIES"),
    ];
    for (env, want) in cases {
        let out = node.run(env);
        assert_eq!(out.code, 2, "{env:?}: {}", out.stderr);
        assert!(out.stderr.contains(want), "{env:?}: {}", out.stderr);
        assert_eq!(node.host_snapshot(), before, "{env:?} wrote something");
    }
    // A service-account mount without the API server's address: refused too.
    fs::create_dir_all(node.path("serviceaccount")).unwrap();
    fs::write(node.path("serviceaccount/token"), "t").unwrap();
    let out = node.run(&[]);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(
        out.stderr.contains("KUBERNETES_SERVICE_HOST"),
        "{}",
        out.stderr
    );
    assert_eq!(node.host_snapshot(), before);
}

#[test]
fn a_calico_that_does_not_answer_with_our_version_keeps_the_old_conflist() {
    let node = Node::new();
    fs::write(
        node.path("host/etc/cni/net.d/10-calico.conflist"),
        "{\"name\":\"old\"}",
    )
    .unwrap();
    // The image's calico is not this build (a wrong binary in the image).
    fs::remove_file(node.path("image/calico")).unwrap();
    node.write_exec("image/calico", "#!/bin/sh\necho v0.0.0-other\n");
    let out = node.run(&[]);
    assert_eq!(out.code, 1, "{}", out.stderr);
    assert!(out.stderr.contains("v0.0.0-other"), "{}", out.stderr);
    assert_eq!(
        fs::read_to_string(node.path("host/etc/cni/net.d/10-calico.conflist")).unwrap(),
        "{\"name\":\"old\"}"
    );
}

#[test]
fn no_writable_bin_dir_is_a_failure_with_no_conflist() {
    let node = Node::new();
    let out = run_command_within(
        {
            let mut c = node.command(&[]);
            c.env("CALICO_INSTALL_HOST_BIN_DIRS", node.path("missing"));
            c
        },
        "",
        Duration::from_secs(60),
        "install",
    );
    assert_eq!(out.code, 1, "{}", out.stderr);
    assert!(
        out.stderr.contains("found no writeable directory"),
        "{}",
        out.stderr
    );
    assert!(!node.path("host/etc/cni/net.d/10-calico.conflist").exists());
}

#[test]
fn sleeping_installer_stays_up_and_ends_on_sigterm() {
    let node = Node::new();
    let mut child = node
        .command(&[("SLEEP", "true")])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn");
    let conf = node.path("host/etc/cni/net.d/10-calico.conflist");
    let started = Instant::now();
    while !conf.exists() && started.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(conf.exists(), "conflist written");
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        child.try_wait().unwrap().is_none(),
        "still up after installing"
    );
    // SAFETY: kill(2) on the child we spawned.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let started = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if started.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            panic!("the installer did not end on SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(0));
}

// The environment as upstream's installer reads it (os.LookupEnv and envconfig v1.4.0): a
// variable set to "" is "", not unset. Every expectation below is what upstream's own
// `install` binary (v3.32.1) did with the same environment, run in a chroot laid out as its
// container (`/opt/cni/bin`, `/host/...`, `/calico-secrets`); where upstream fails after
// writing, ours refuses before writing (exit 2).

fn net_dir(node: &Node) -> String {
    node.path("host/etc/cni/net.d").display().to_string()
}

#[test]
fn empty_paths_are_used_as_empty_in_the_conflist() {
    let node = Node::new();
    fs::write(node.path("secrets/etcd-cert"), "cert").unwrap();
    let template = r#"{"name":"n","cniVersion":"0.3.1","plugins":[{"type":"calico",
        "etcd_cert_file":"__ETCD_CERT_FILE__","calico_api_group":"__CALICO_API_GROUP__",
        "kubernetes":{"kubeconfig":"__KUBECONFIG_FILEPATH__"}}]}"#;
    let out = node.run(&[
        ("CNI_NET_DIR", ""),
        ("CALICO_API_GROUP", ""),
        ("CNI_NETWORK_CONFIG", template),
    ]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let p = &conflist(&node, "10-calico.conflist")["plugins"][0];
    // Upstream: `c.CNINetDir + "/calico-kubeconfig"` with CNINetDir "".
    assert_eq!(p["kubernetes"]["kubeconfig"], "/calico-kubeconfig");
    assert_eq!(p["etcd_cert_file"], "/calico-tls/etcd-cert");
    assert_eq!(p["calico_api_group"], "");
}

#[test]
fn empty_names_lists_and_templates_are_what_upstream_makes_of_them() {
    let node = Node::new();
    let out = node.run(&[
        ("CNI_OLD_CONF_NAME", ""),
        ("SKIP_CNI_BINARIES", ""),
        ("CNI_NETWORK_CONFIG", ""),
        ("CNI_NETWORK_CONFIG_FILE", ""),
    ]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    // An empty template is none: the default one.
    assert_eq!(
        conflist(&node, "10-calico.conflist")["name"],
        "k8s-pod-network"
    );
    // An empty list skips nothing.
    let bin = node.path("host/opt/cni/bin");
    assert!(bin.join("calico-ipam").exists() && bin.join("portmap").exists());
    // An empty CNI_OLD_CONF_NAME names the config directory itself: `os.Remove` of it fails
    // (it holds the conflist just written), a warning in upstream's words.
    let want = format!(
        "Failed to remove  error=remove {}/: directory not empty",
        net_dir(&node)
    );
    assert!(out.stderr.contains(&want), "{}", out.stderr);
    assert!(node.path("host/etc/cni/net.d/10-calico.conflist").is_file());
}

#[test]
fn an_empty_tls_assets_dir_is_no_directory() {
    let node = Node::new();
    fs::write(node.path("secrets/etcd-cert"), "cert").unwrap();
    // Run from the secrets directory: "" must not be read as the working directory.
    let mut cmd = node.command(&[("TLS_ASSETS_DIR", "")]);
    cmd.current_dir(node.path("secrets"));
    let out = run_command_within(cmd, "", Duration::from_secs(60), "install");
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(!node.path("host/etc/cni/net.d/calico-tls").exists());
    assert!(
        !out.stderr.contains("Installing any TLS assets"),
        "{}",
        out.stderr
    );
}

#[test]
fn values_upstream_cannot_use_are_refused_in_its_words_before_anything_is_written() {
    let node = Node::new();
    fs::write(node.path("secrets/etcd-cert"), "cert").unwrap();
    // The TLS directory of an earlier install: upstream removes it first thing, even when it
    // then fails; ours leaves it as it was.
    fs::create_dir_all(node.path("host/etc/cni/net.d/calico-tls")).unwrap();
    fs::write(node.path("host/etc/cni/net.d/calico-tls/etcd-cert"), "old").unwrap();
    let before = node.host_snapshot();
    let net = net_dir(&node);
    let bool_error = |key: &str, field: &str, value: &str| {
        format!(
            "envconfig.Process: assigning {key} to {field}: converting '{value}' to type bool. \
             details: strconv.ParseBool: parsing \"{value}\": invalid syntax"
        )
    };
    let cases: Vec<(Vec<(&str, &str)>, String)> = vec![
        // Upstream: fatal at loadConfig, before anything but the TLS directory's removal.
        (
            vec![("UPDATE_CNI_BINARIES", "")],
            bool_error("UPDATE_CNI_BINARIES", "UpdateCNIBinaries", ""),
        ),
        (vec![("SLEEP", "")], bool_error("SLEEP", "ShouldSleep", "")),
        (
            vec![("SLEEP", "yes")],
            bool_error("SLEEP", "ShouldSleep", "yes"),
        ),
        // envconfig's field order: UpdateCNIBinaries is met first.
        (
            vec![("SLEEP", ""), ("UPDATE_CNI_BINARIES", "")],
            bool_error("UPDATE_CNI_BINARIES", "UpdateCNIBinaries", ""),
        ),
        // Upstream: fatal after the binaries and the kubeconfig are written.
        (
            vec![("TEST_FILE_PERMISSION", "")],
            r#"strconv.ParseUint: parsing "": invalid syntax"#.into(),
        ),
        (
            vec![("TEST_FILE_PERMISSION", "0o644")],
            r#"strconv.ParseUint: parsing "0o644": invalid syntax"#.into(),
        ),
        (
            vec![("TEST_FILE_PERMISSION", "777777777777")],
            r#"strconv.ParseUint: parsing "777777777777": value out of range"#.into(),
        ),
        // Read before the conflist is written, so met before a bad name.
        (
            vec![("TEST_FILE_PERMISSION", ""), ("CNI_CONF_NAME", "")],
            r#"strconv.ParseUint: parsing "": invalid syntax"#.into(),
        ),
        // Upstream: `os.WriteFile` fails, after the binaries and the kubeconfig.
        (
            vec![("CNI_CONF_NAME", "")],
            format!("open {net}/: is a directory"),
        ),
        (
            vec![("CNI_CONF_NAME", ".")],
            format!("open {net}/.: is a directory"),
        ),
        (
            vec![("CNI_CONF_NAME", "new/")],
            format!("open {net}/new/: is a directory"),
        ),
        (
            vec![("CNI_CONF_NAME", "sub/10-calico.conflist")],
            format!("open {net}/sub/10-calico.conflist: no such file or directory"),
        ),
        // calico-tls is a directory again once the etcd-cert is copied into it.
        (
            vec![("CNI_CONF_NAME", "calico-tls")],
            format!("open {net}/calico-tls: is a directory"),
        ),
    ];
    for (env, want) in cases {
        let out = node.run(&env);
        assert_eq!(out.code, 2, "{env:?}: {}", out.stderr);
        assert!(
            out.stderr.contains(&want),
            "{env:?}: want {want}\n{}",
            out.stderr
        );
        assert_eq!(node.host_snapshot(), before, "{env:?} wrote something");
    }
}

#[test]
fn skip_cni_binaries_entries_are_not_trimmed() {
    let node = Node::new();
    node.write_exec("image/flannel", "#!/bin/sh\nexit 0\n");
    // envconfig splits on "," only: " portmap" is no binary's name, so portmap is copied.
    let out = node.run(&[("SKIP_CNI_BINARIES", "flannel, portmap")]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let bin = node.path("host/opt/cni/bin");
    assert!(!bin.join("flannel").exists());
    assert!(bin.join("portmap").is_file());
    assert!(bin.join("calico-ipam").exists());
}

#[test]
fn test_file_permission_is_applied_as_upstream_applies_it() {
    let node = Node::new();
    let conf = node.path("host/etc/cni/net.d/10-calico.conflist");
    // Octal, up to 32 bits, into an os.FileMode: the permission bits, and setuid, setgid
    // and sticky only from Go's own bits for them (as upstream's binary left the file).
    for (perm, want) in [
        ("644", 0o644),
        ("4755", 0o755),
        ("40000644", 0o4644),
        ("37777777777", 0o7777),
        ("0600", 0o600),
    ] {
        let out = node.run(&[("TEST_FILE_PERMISSION", perm)]);
        assert_eq!(out.code, 0, "{perm}: {}", out.stderr);
        assert_eq!(mode(&conf), want, "{perm}");
    }
}

#[test]
fn conf_names_are_appended_to_the_config_directory_as_upstream_does() {
    let node = Node::new();
    // `fmt.Sprintf("/host/etc/cni/net.d/%s", name)`: a leading "/" stays inside.
    let out = node.run(&[("CNI_CONF_NAME", "/05-calico.conflist")]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(node.path("host/etc/cni/net.d/05-calico.conflist").is_file());
    assert!(!Path::new("/05-calico.conflist").exists());
    // CNI_OLD_CONF_NAME naming an empty directory: `os.Remove` removes it.
    fs::create_dir(node.path("host/etc/cni/net.d/old")).unwrap();
    let out = node.run(&[("CNI_OLD_CONF_NAME", "old")]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(!node.path("host/etc/cni/net.d/old").exists());
}

#[test]
fn arguments_are_ignored_as_upstream_ignores_them_but_v_answers_the_version() {
    let node = Node::new();
    let before = node.host_snapshot();
    let mut cmd = node.command(&[]);
    cmd.arg("-v");
    let out = run_command_within(cmd, "", Duration::from_secs(60), "install -v");
    assert_eq!(
        (out.code, out.stdout.trim()),
        (0, VERSION),
        "{}",
        out.stderr
    );
    assert_eq!(node.host_snapshot(), before, "-v wrote something");
    let mut cmd = node.command(&[]);
    cmd.args(["--help", "anything"]);
    let out = run_command_within(cmd, "", Duration::from_secs(60), "install --help");
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(out.stderr.contains("Ignoring arguments"), "{}", out.stderr);
    assert!(node.path("host/etc/cni/net.d/10-calico.conflist").is_file());
}
