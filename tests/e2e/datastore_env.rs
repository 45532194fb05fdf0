//! How the datastore's connection settings are read from the environment (audit row 21),
//! from the real binary against the test API server, as libcalico-go's envconfig and
//! client-go's loading rules read them upstream:
//!
//! * `K8S_INSECURE_SKIP_TLS_VERIFY` must be a Go boolean when set: `""` and `maybe` fail
//!   with envconfig's error, at the same place as upstream's;
//! * the datastore's token comes from `CALICO_K8SAPITOKEN` only, not `K8SAPITOKEN`;
//! * a `KUBECONFIG` of several files is merged (missing files skipped, the first file to
//!   name a cluster, user or context wins it, the first `current-context` wins), while the
//!   plugin's own client takes the NetConf's kubeconfig as one path;
//! * with no kubeconfig and no API server, `$HOME/.kube/config` is the default.
//!
//! With `CALICO_UPSTREAM_BIN` set, each scenario also runs upstream's v3.32.1 binary and
//! asserts the same outcome.

use std::path::PathBuf;

use serde_json::json;

use crate::common::cni::{upstream_calico, Bin, Invocation, Outcome};
use crate::common::kdd::KddWorld;
use crate::common::netns::{require_root, Netns};

fn binaries() -> Vec<(&'static str, Bin)> {
    let mut out = vec![("ours", Bin::new())];
    if let Some(up) = upstream_calico() {
        out.push(("upstream", Bin::with_calico(&up)));
    }
    out
}

/// `vars`, with every variable these tests are about set to "" or removed first, so the
/// test process's own environment plays no part.
fn env(vars: &[(&str, &str)]) -> Vec<(String, String)> {
    vars.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// An invocation whose environment has none of the datastore variables of the test
/// process (`unset` only covers CNI_*: the rest is given explicitly as empty where "" is
/// harmless, and HOME always).
fn inv(cid: &str, pod: &Netns, vars: &[(&str, &str)]) -> Invocation {
    let mut i = Invocation::new("ADD", cid, pod.path());
    let mut e = env(&[("HTTPS_PROXY", ""), ("https_proxy", ""), ("NO_PROXY", "")]);
    if !vars.iter().any(|(k, _)| *k == "HOME") {
        e.push(("HOME".into(), "/nonexistent".into()));
    }
    e.extend(env(vars));
    i.extra_env = e;
    i
}

/// A kubeconfig file with the given clusters, users, contexts (YAML lists' items) and
/// current context.
fn kubeconfig_text(
    clusters: &[String],
    users: &[String],
    contexts: &[String],
    current: &str,
) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n{}users:\n{}contexts:\n{}current-context: \"{current}\"\n",
        clusters.concat(),
        users.concat(),
        contexts.concat()
    )
}

fn cluster(name: &str, server: &str, trust: &str) -> String {
    format!("- name: {name}\n  cluster:\n    server: {server}\n    {trust}\n")
}

fn user(name: &str, token: &str) -> String {
    match token {
        "" => format!("- name: {name}\n  user: {{}}\n"),
        t => format!("- name: {name}\n  user:\n    token: {t}\n"),
    }
}

fn context(name: &str, cluster: &str, user: &str) -> String {
    format!("- name: {name}\n  context:\n    cluster: {cluster}\n    user: {user}\n")
}

fn ca_data(w: &KddWorld) -> String {
    format!(
        "certificate-authority-data: {}",
        calico_cni::support::encoding::base64_std(w.api.ca_pem().as_bytes())
    )
}

fn write(w: &KddWorld, name: &str, text: &str) -> PathBuf {
    let p = w.scratch.path().join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// A NetConf for the datastore alone: no policy type (with `k8s`, or a pod namespace, IPAM
/// also reads the namespace through the plugin's own client).
fn ipam_conf(w: &KddWorld, kubeconfig: Option<&std::path::Path>) -> String {
    let kc = kubeconfig.map_or(serde_json::Value::Null, |k| json!(k.display().to_string()));
    w.conf(json!({"policy": null, "kubernetes": {"kubeconfig": kc}}))
}

/// calico-ipam ADD then (when it worked) DEL, on the datastore alone.
fn ipam_add_del(w: &KddWorld, bin: &Bin, conf: &str, i: &Invocation) -> Outcome {
    let add = bin.run("calico-ipam", w.host.name(), i, conf);
    if add.code == 0 {
        bin.run("calico-ipam", w.host.name(), &i.as_del(), conf)
            .assert_ok_fast();
    }
    add
}

#[test]
fn k8s_insecure_skip_tls_verify_must_be_a_go_boolean() {
    require_root();
    let w = KddWorld::new();
    // A kubeconfig that does not say how to trust the server: only the override makes it.
    let kc = write(
        &w,
        "trustless",
        &kubeconfig_text(
            &[cluster("test", &w.api.url(), "")],
            &[user("test", &w.api.token())],
            &[context("test", "test", "test")],
            "test",
        ),
    );
    // From the environment: with a NetConf kubeconfig, IPAM would also read the pod's
    // namespace through the plugin's own client, which the override does not reach.
    let conf = ipam_conf(&w, None);
    let kc = kc.display().to_string();
    let pod = Netns::new("pod");
    for (who, bin) in binaries() {
        for (i, v) in ["true", "1", "T"].iter().enumerate() {
            let inv = inv(
                &format!("ins{i}-{who}"),
                &pod,
                &[("KUBECONFIG", &kc), ("K8S_INSECURE_SKIP_TLS_VERIFY", v)],
            );
            ipam_add_del(&w, &bin, &conf, &inv).assert_ok_fast();
        }
        let inv0 = inv(
            &format!("ins-off-{who}"),
            &pod,
            &[
                ("KUBECONFIG", &kc),
                ("CALICO_K8S_INSECURE_SKIP_TLS_VERIFY", "false"),
            ],
        );
        ipam_add_del(&w, &bin, &conf, &inv0).assert_err_fast();
        for v in ["", "maybe"] {
            let want = format!("failed to load config from env vars: envconfig.Process: assigning CALICO_K8S_INSECURE_SKIP_TLS_VERIFY to K8sInsecureSkipTLSVerify: converting '{v}' to type bool. details: strconv.ParseBool: parsing \"{v}\": invalid syntax");
            let i = inv(
                &format!("ins-bad-{who}"),
                &pod,
                &[("KUBECONFIG", &kc), ("K8S_INSECURE_SKIP_TLS_VERIFY", v)],
            );
            // calico-ipam returns the error as it is; calico's ADD says where it failed.
            let err = ipam_add_del(&w, &bin, &conf, &i).assert_err_fast();
            assert_eq!(err, json!({"code": 999, "msg": want}), "{who}");
            let err = bin
                .run("calico", w.host.name(), &i, &conf)
                .assert_err_fast();
            assert_eq!(
                err,
                json!({"code": 999, "msg": format!("error creating calico client: {want}")}),
                "{who}"
            );
            let err = bin
                .run("calico", w.host.name(), &i.as_del(), &conf)
                .assert_err_fast();
            assert_eq!(err, json!({"code": 999, "msg": want}), "{who}");
        }
    }
    w.assert_clean();
}

#[test]
fn the_datastore_token_comes_from_calico_k8sapitoken_only() {
    require_root();
    let w = KddWorld::new();
    let kc = write(
        &w,
        "tokenless",
        &kubeconfig_text(
            &[cluster("test", &w.api.url(), &ca_data(&w))],
            &[user("test", "")],
            &[context("test", "test", "test")],
            "test",
        ),
    );
    let mut conf: serde_json::Value = serde_json::from_str(&ipam_conf(&w, Some(&kc))).unwrap();
    conf["policy"] = json!({"k8s_auth_token": w.api.token()});
    let conf = conf.to_string();
    let pod = Netns::new("pod");
    let token = w.api.token();
    for (who, bin) in binaries() {
        // Neither the plain name nor the NetConf's token (exported as K8S_API_TOKEN)
        // reaches the datastore: its requests go without one.
        let i = inv(
            &format!("tok-plain-{who}"),
            &pod,
            &[("K8SAPITOKEN", &token)],
        );
        let err = ipam_add_del(&w, &bin, &conf, &i).assert_err_fast();
        assert!(
            err["msg"].as_str().unwrap().contains("nauthorized"),
            "{who}: {err}"
        );
        let i = inv(
            &format!("tok-pfx-{who}"),
            &pod,
            &[("CALICO_K8SAPITOKEN", &token)],
        );
        ipam_add_del(&w, &bin, &conf, &i).assert_ok_fast();
    }
    w.assert_clean();
}

#[test]
fn a_kubeconfig_list_is_merged_as_client_go_merges_it() {
    require_root();
    let w = KddWorld::new();
    // The first file names the real cluster and user but no current context; the second
    // names the same cluster and user wrongly, another context, and the current context.
    let first = write(
        &w,
        "first",
        &kubeconfig_text(
            &[cluster("test", &w.api.url(), &ca_data(&w))],
            &[user("test", &w.api.token())],
            &[context("test", "test", "test")],
            "",
        ),
    );
    let second = write(
        &w,
        "second",
        &kubeconfig_text(
            &[cluster(
                "test",
                "https://127.0.0.1:1",
                "insecure-skip-tls-verify: true",
            )],
            &[user("test", "wrong-token")],
            &[
                context("test", "test", "test"),
                context("other", "test", "test"),
            ],
            "test",
        ),
    );
    let (f, s) = (first.display().to_string(), second.display().to_string());
    let missing = w.scratch.path().join("missing").display().to_string();
    // The datastore's KUBECONFIG from the environment: no NetConf kubeconfig.
    let conf = ipam_conf(&w, None);
    let pod = Netns::new("pod");
    for (who, bin) in binaries() {
        let list = format!("{missing}:{f}:{s}:");
        let i = inv(&format!("kl-ok-{who}"), &pod, &[("KUBECONFIG", &list)]);
        ipam_add_del(&w, &bin, &conf, &i).assert_ok_fast();
        // The other order: the second file's cluster and user win, and fail.
        let list = format!("{s}:{f}");
        let i = inv(&format!("kl-rev-{who}"), &pod, &[("KUBECONFIG", &list)]);
        ipam_add_del(&w, &bin, &conf, &i).assert_err_fast();
        // Every file missing: no configuration at all.
        let list = format!("{missing}:{missing}2");
        let i = inv(&format!("kl-none-{who}"), &pod, &[("KUBECONFIG", &list)]);
        let err = ipam_add_del(&w, &bin, &conf, &i).assert_err_fast();
        assert_eq!(
            err["msg"],
            "invalid configuration: no configuration has been provided, try setting KUBERNETES_MASTER environment variable",
            "{who}"
        );
    }
    // In the NetConf, the list reaches the datastore (merged) and the plugin's own client,
    // which takes it as one path (upstream's `ExplicitPath`): a k8s pod's ADD fails there.
    let list = format!("{f}:{s}");
    let conf = w.conf(json!({"kubernetes": {"kubeconfig": list}}));
    for (who, bin) in binaries() {
        let name = format!("kl-conf-{who}");
        w.seed_pod("default", &name, json!({}));
        let i = inv(&name, &pod, &[]).k8s("default", &name);
        let out = bin.run("calico", w.host.name(), &i, &conf);
        let err = out.assert_err_fast();
        assert!(
            err["msg"]
                .as_str()
                .unwrap()
                .contains(&format!("stat {list}: no such file or directory")),
            "{who}: {err}"
        );
        bin.run("calico", w.host.name(), &i.as_del(), &conf);
    }
    w.assert_clean();
}

#[test]
fn home_kube_config_is_the_default_kubeconfig() {
    require_root();
    let w = KddWorld::new();
    let home = w.scratch.path().join("home");
    std::fs::create_dir_all(home.join(".kube")).unwrap();
    let empty_home = w.scratch.path().join("empty-home");
    std::fs::create_dir_all(&empty_home).unwrap();
    std::fs::copy(w.api.kubeconfig(), home.join(".kube/config")).unwrap();
    let conf = ipam_conf(&w, None);
    let pod = Netns::new("pod");
    let (home, empty_home) = (home.display().to_string(), empty_home.display().to_string());
    for (who, bin) in binaries() {
        let i = inv(&format!("home-{who}"), &pod, &[("HOME", &home)]);
        ipam_add_del(&w, &bin, &conf, &i).assert_ok_fast();
        for h in [empty_home.as_str(), ""] {
            let i = inv(&format!("nohome-{who}"), &pod, &[("HOME", h)]);
            let err = ipam_add_del(&w, &bin, &conf, &i).assert_err_fast();
            assert_eq!(
                err["msg"],
                "invalid configuration: no configuration has been provided, try setting KUBERNETES_MASTER environment variable",
                "{who} HOME={h:?}"
            );
        }
        // Not when the environment names an API server (here one that does not answer).
        let i = inv(
            &format!("home-ep-{who}"),
            &pod,
            &[("HOME", &home), ("K8S_API_ENDPOINT", "https://127.0.0.1:1")],
        );
        ipam_add_del(&w, &bin, &conf, &i).assert_err_fast();
    }
    w.assert_clean();
}
