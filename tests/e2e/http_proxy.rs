//! HTTP proxies and the readiness gates' trust store (audit rows 11 and 12), from the real
//! binary run as kubelet runs it in a test host netns, against the test API server
//! (common/kube_api/) and a small proxy written for these tests (common/http_proxy.rs):
//!
//! * the API client goes through `HTTPS_PROXY` with a CONNECT tunnel (its credentials as
//!   `Proxy-Authorization`), still one connection and one TLS handshake per call, HTTP/2
//!   inside; `NO_PROXY` (a CIDR, an `ip:port`) and loopback servers go direct; a kubeconfig
//!   `proxy-url` is used whatever `NO_PROXY` says; a proxy that is down or refuses fails
//!   the call at once;
//! * readiness gates go through `HTTP_PROXY` (the request in absolute form) and
//!   `HTTPS_PROXY` (a tunnel), and trust Go's system roots: `SSL_CERT_FILE`,
//!   `SSL_CERT_DIR`, and Go's list of bundle files.
//!
//! With `CALICO_UPSTREAM_BIN` set, the same scenarios also run upstream's v3.32.1 binary
//! and assert what it must show alike (what differs by design is asserted for ours only).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::common::cni::{upstream_calico, Bin, Invocation, Outcome, FAST};
use crate::common::http_proxy::{tls_server, TestProxy};
use crate::common::kdd::KddWorld;
use crate::common::kube_api::KubeApi;
use crate::common::netns::{require_root, Netns, UPLINK_V4};

/// Ours, and upstream's when `CALICO_UPSTREAM_BIN` names it.
fn binaries() -> Vec<(&'static str, Bin)> {
    let mut out = vec![("ours", Bin::new())];
    if let Some(up) = upstream_calico() {
        out.push(("upstream", Bin::with_calico(&up)));
    }
    out
}

/// Every proxy variable, set to `vars` and the rest to "" (Go reads "" as unset), so that
/// the test process's own environment plays no part.
fn proxy_env(vars: &[(&str, &str)]) -> Vec<(String, String)> {
    let names = [
        "HTTP_PROXY",
        "http_proxy",
        "HTTPS_PROXY",
        "https_proxy",
        "NO_PROXY",
        "no_proxy",
        "REQUEST_METHOD",
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
    ];
    names
        .iter()
        .map(|n| {
            let v = vars.iter().find(|(k, _)| k == n).map_or("", |(_, v)| v);
            (n.to_string(), v.to_string())
        })
        .chain(
            vars.iter()
                .filter(|(k, _)| !names.contains(k))
                .map(|(k, v)| (k.to_string(), v.to_string())),
        )
        .collect()
}

/// A kubeconfig for `api` naming `server`, checking the certificate as 127.0.0.1's
/// (`tls-server-name`, the name it is for), with `extra` lines in the cluster.
fn kubeconfig(w: &KddWorld, name: &str, server: &str, extra: &str) -> PathBuf {
    let path = w.scratch.path().join(name);
    let text = format!(
        "apiVersion: v1
kind: Config
clusters:
- name: test
  cluster:
    server: {server}
    tls-server-name: 127.0.0.1
    certificate-authority-data: {ca}
{extra}users:
- name: test
  user:
    token: {token}
contexts:
- name: test
  context:
    cluster: test
    user: test
current-context: test
",
        ca = calico_cni::support::encoding::base64_std(w.api.ca_pem().as_bytes()),
        token = w.api.token(),
    );
    std::fs::write(&path, text).unwrap();
    path
}

fn conf_with(w: &KddWorld, kubeconfig: &Path, extra: Value) -> String {
    let mut c = json!({"kubernetes": {"kubeconfig": kubeconfig.display().to_string()}});
    crate::common::world::merge(&mut c, extra);
    w.conf(c)
}

/// ADD then DEL of pod `name` with `env`; returns the ADD's outcome (the DEL must succeed
/// when the ADD did).
fn add_del(w: &KddWorld, bin: &Bin, name: &str, conf: &str, env: &[(String, String)]) -> Outcome {
    w.seed_pod("default", name, json!({}));
    let pod = Netns::new("pod");
    let mut inv = Invocation::new("ADD", &format!("{name}-cid"), pod.path()).k8s("default", name);
    inv.extra_env = env.to_vec();
    let add = bin.run("calico", w.host.name(), &inv, conf);
    if add.code == 0 {
        bin.run("calico", w.host.name(), &inv.as_del(), conf)
            .assert_ok_fast();
    }
    add
}

/// The API server's address for a client in the host netns.
fn api_addr(api: &KubeApi) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], api.port()))
}

#[test]
fn the_api_client_goes_through_a_connect_proxy_with_its_credentials() {
    require_root();
    let w = KddWorld::on_every_address();
    let proxy = TestProxy::start_in(&w.host);
    // A name the node cannot resolve: only the proxy can reach it.
    let authority = format!("kube-api.proxy.test:{}", w.api.port());
    proxy.route(&authority, api_addr(&w.api));
    proxy.require_auth("calico", "pa:ss@word");
    let kc = kubeconfig(&w, "via-name", &format!("https://{authority}"), "");
    let conf = conf_with(&w, &kc, json!({}));
    let env = proxy_env(&[(
        "HTTPS_PROXY",
        &proxy.url_with_user("calico", "pa%3Ass%40word"),
    )]);
    let basic = format!(
        "Basic {}",
        calico_cni::support::encoding::base64_std(b"calico:pa:ss@word")
    );
    for (who, bin) in binaries() {
        proxy.clear();
        w.api.clear_requests();
        let handshakes = w.api.handshakes();
        let add = add_del(&w, &bin, &format!("p1-{who}"), &conf, &env);
        add.assert_ok_fast();
        let seen = proxy.seen();
        assert!(!seen.is_empty(), "{who}: nothing went through the proxy");
        for s in &seen {
            assert_eq!(
                (s.method.as_str(), s.target.as_str(), s.status),
                ("CONNECT", authority.as_str(), 200),
                "{who}: {s:?}"
            );
            assert_eq!(
                s.proxy_authorization.as_deref(),
                Some(basic.as_str()),
                "{who}"
            );
            assert!(
                s.head.contains(&format!("\r\nHost: {authority}\r\n")),
                "{who}: {}",
                s.head
            );
        }
        assert!(!w.api.requests().is_empty(), "{who}");
        if who == "ours" {
            // One connection per call, as without a proxy: ADD and DEL each tunnel once
            // and make one TLS handshake with the server, HTTP/2 inside the tunnel.
            assert_eq!(seen.len(), 2, "{seen:?}");
            assert_eq!(w.api.handshakes() - handshakes, 2);
            assert!(w.api.protocols().iter().skip(handshakes).all(|p| p == "h2"));
            assert!(seen[0]
                .head
                .contains("\r\nUser-Agent: Go-http-client/1.1\r\n"));
            // The password never shows, in any form.
            let log = std::fs::read_to_string(w.scratch.path().join("cni.log")).unwrap_or_default();
            for secret in ["pa:ss@word", "pa%3Ass%40word", &basic[6..]] {
                assert!(
                    !add.stderr.contains(secret) && !log.contains(secret),
                    "{secret} leaked"
                );
            }
        }
    }
    w.assert_clean();
}

#[test]
fn no_proxy_and_loopback_servers_go_direct() {
    require_root();
    let w = KddWorld::on_every_address();
    let proxy = TestProxy::start_in(&w.host);
    let port = w.api.port();
    let direct = format!("https://{UPLINK_V4}:{port}");
    let kc = kubeconfig(&w, "via-ip", &direct, "");
    let conf = conf_with(&w, &kc, json!({}));
    let dead = {
        let l = w
            .host
            .run_in(|| std::net::TcpListener::bind("127.0.0.1:0").unwrap());
        format!("http://{}", l.local_addr().unwrap())
    };
    for (who, bin) in binaries() {
        // Not excluded: through the proxy, to the address as written.
        proxy.clear();
        let env = proxy_env(&[("https_proxy", &proxy.url())]);
        add_del(&w, &bin, &format!("n0-{who}"), &conf, &env).assert_ok_fast();
        let seen = proxy.seen();
        assert!(
            !seen.is_empty()
                && seen
                    .iter()
                    .all(|s| s.target == format!("{UPLINK_V4}:{port}")),
            "{who}: {seen:?}"
        );
        // Excluded by a CIDR, by `ip:port` (lower-case name), or by `*`: direct.
        for (i, no_proxy) in [
            ("NO_PROXY", "example.com, 198.18.0.0/24".to_string()),
            ("no_proxy", format!("{UPLINK_V4}:{port}")),
            ("NO_PROXY", "*".to_string()),
        ]
        .into_iter()
        .enumerate()
        {
            proxy.clear();
            let env = proxy_env(&[("HTTPS_PROXY", &proxy.url()), (no_proxy.0, &no_proxy.1)]);
            add_del(&w, &bin, &format!("n{}-{who}", i + 1), &conf, &env).assert_ok_fast();
            assert!(
                proxy.seen().is_empty(),
                "{who} {no_proxy:?}: {:?}",
                proxy.seen()
            );
        }
        // The same CIDR with the wrong port in an `ip:port` entry does not exclude it.
        let env = proxy_env(&[
            ("HTTPS_PROXY", &dead),
            ("NO_PROXY", &format!("{UPLINK_V4}:1")),
        ]);
        let out = add_del(&w, &bin, &format!("n9-{who}"), &conf, &env);
        let err = out.assert_err_fast();
        assert!(
            err["msg"]
                .as_str()
                .unwrap()
                .contains("proxyconnect tcp: dial tcp"),
            "{who}: {err}"
        );
        // A server on loopback never goes through a proxy (here one that is down).
        let env = proxy_env(&[("HTTPS_PROXY", &dead), ("HTTP_PROXY", &dead)]);
        let conf_lo = w.conf(json!({}));
        add_del(&w, &bin, &format!("lo-{who}"), &conf_lo, &env).assert_ok_fast();
    }
    w.assert_clean();
}

#[test]
fn a_kubeconfig_proxy_url_is_used_whatever_no_proxy_says() {
    require_root();
    let w = KddWorld::on_every_address();
    let proxy = TestProxy::start_in(&w.host);
    let port = w.api.port();
    let extra = format!("    proxy-url: {}\n", proxy.url());
    // Even a loopback server: the kubeconfig's proxy is used for every request.
    for (name, server) in [
        ("pu-ip", format!("https://{UPLINK_V4}:{port}")),
        ("pu-lo", format!("https://127.0.0.1:{port}")),
    ] {
        let kc = kubeconfig(&w, name, &server, &extra);
        let conf = conf_with(&w, &kc, json!({}));
        let env = proxy_env(&[("NO_PROXY", "*"), ("HTTPS_PROXY", "http://127.0.0.1:1")]);
        for (who, bin) in binaries() {
            proxy.clear();
            add_del(&w, &bin, &format!("{name}-{who}"), &conf, &env).assert_ok_fast();
            let want = server.trim_start_matches("https://");
            let seen = proxy.seen();
            assert!(
                !seen.is_empty()
                    && seen
                        .iter()
                        .all(|s| s.method == "CONNECT" && s.target == want),
                "{who} {server}: {seen:?}"
            );
        }
    }
    // A proxy-url client-go refuses fails the client, with client-go's text.
    let kc = kubeconfig(
        &w,
        "pu-bad",
        &format!("https://{UPLINK_V4}:{port}"),
        "    proxy-url: ftp://127.0.0.1:21\n",
    );
    let conf = conf_with(&w, &kc, json!({}));
    for (who, bin) in binaries() {
        let out = add_del(&w, &bin, &format!("pu-bad-{who}"), &conf, &proxy_env(&[]));
        let err = out.assert_err_fast();
        assert_eq!(
            err["msg"],
            "error creating calico client: invalid configuration: invalid 'proxy-url' \"ftp://127.0.0.1:21\" for cluster \"test\": unsupported scheme \"ftp\", must be http, https, or socks5",
            "{who}"
        );
    }
    w.assert_clean();
}

#[test]
fn a_proxy_that_is_down_or_refuses_fails_the_call_at_once() {
    require_root();
    let w = KddWorld::on_every_address();
    let proxy = TestProxy::start_in(&w.host);
    proxy.require_auth("calico", "right");
    let port = w.api.port();
    let kc = kubeconfig(&w, "fail", &format!("https://{UPLINK_V4}:{port}"), "");
    let conf = conf_with(&w, &kc, json!({}));
    let dead = w
        .host
        .run_in(|| std::net::TcpListener::bind("127.0.0.1:0").unwrap());
    let dead_addr = dead.local_addr().unwrap();
    drop(dead);
    for (who, bin) in binaries() {
        let cases = [
            (
                format!("http://{dead_addr}"),
                format!("proxyconnect tcp: dial tcp {dead_addr}: connect: connection refused"),
            ),
            (
                proxy.url_with_user("calico", "wrong"),
                "Proxy Authentication Required".to_string(),
            ),
            (proxy.url(), "Proxy Authentication Required".to_string()),
        ];
        for (i, (url, want)) in cases.iter().enumerate() {
            let env = proxy_env(&[("HTTPS_PROXY", url)]);
            let out = add_del(&w, &bin, &format!("f{i}-{who}"), &conf, &env);
            let err = out.assert_err_fast();
            let msg = err["msg"].as_str().unwrap();
            assert!(
                msg.starts_with("error getting ClusterInformation: "),
                "{who}: {msg}"
            );
            assert!(msg.contains(want.as_str()), "{who}: {msg}");
            assert!(
                !msg.contains("wrong") && !out.stderr.contains("wrong"),
                "{who}: {msg}"
            );
        }
    }
    // A SOCKS proxy: Go's transport speaks SOCKS5; ours refuses it (docs/differences.md).
    let env = proxy_env(&[("HTTPS_PROXY", "socks5://127.0.0.1:1080")]);
    let err = add_del(&w, &Bin::new(), "f-socks", &conf, &env).assert_err_fast();
    assert!(
        err["msg"]
            .as_str()
            .unwrap()
            .contains("proxy scheme \"socks5\" is not supported"),
        "{err}"
    );
    w.assert_clean();
}

/// The readiness gates' HTTP client: Go's `http.Client{}` upstream, which proxies as the
/// environment says and trusts the system roots.
#[test]
fn readiness_gates_go_through_the_environments_proxy() {
    require_root();
    let w = KddWorld::on_every_address();
    let proxy = TestProxy::start_in(&w.host);
    proxy.require_auth("gate", "pw");
    // An HTTPS gate for a name only the proxy resolves, with a CA of its own.
    let (ca, tls) = tls_server(&["gate.proxy.test"], &[b"http/1.1"]);
    let gate = TestProxy::start_on(&w.host, "127.0.0.1", Some(tls));
    proxy.route(
        "gate.proxy.test:443",
        SocketAddr::from(([127, 0, 0, 1], gate.port())),
    );
    let ca_file = w.scratch.path().join("gate-ca.pem");
    std::fs::write(&ca_file, &ca).unwrap();
    let gates = json!({"readiness_gates": [
        "http://gate.proxy.test:8080/ready?x=1",
        "https://gate.proxy.test/healthz",
    ]});
    let conf = w.conf(gates);
    let proxy_url = proxy.url_with_user("gate", "pw");
    let env = proxy_env(&[
        ("HTTP_PROXY", &proxy_url),
        ("HTTPS_PROXY", &proxy_url),
        ("SSL_CERT_FILE", &ca_file.display().to_string()),
    ]);
    let basic = format!(
        "Basic {}",
        calico_cni::support::encoding::base64_std(b"gate:pw")
    );
    for (who, bin) in binaries() {
        proxy.clear();
        gate.clear();
        let add = add_del(&w, &bin, &format!("g-{who}"), &conf, &env);
        add.assert_ok();
        // Upstream waits 5 s before its first probe (docs/differences.md).
        assert!(add.elapsed < FAST, "{who}: {:?}", add.elapsed);
        let seen = proxy.seen();
        let get = seen
            .iter()
            .find(|s| s.method == "GET")
            .expect("the http gate's GET");
        assert_eq!(get.target, "http://gate.proxy.test:8080/ready?x=1", "{who}");
        assert_eq!(
            get.proxy_authorization.as_deref(),
            Some(basic.as_str()),
            "{who}"
        );
        let connect = seen
            .iter()
            .find(|s| s.method == "CONNECT")
            .expect("the https gate's tunnel");
        assert_eq!(connect.target, "gate.proxy.test:443", "{who}");
        assert_eq!(
            connect.proxy_authorization.as_deref(),
            Some(basic.as_str()),
            "{who}"
        );
        // The gate itself saw the request in origin form.
        let at_gate = gate.seen();
        assert_eq!(at_gate.len(), 1, "{who}: {at_gate:?}");
        assert_eq!(
            (at_gate[0].method.as_str(), at_gate[0].target.as_str()),
            ("GET", "/healthz")
        );
        // The API server, on loopback, was reached directly.
        assert!(
            seen.iter()
                .all(|s| !s.target.contains(&w.api.port().to_string())),
            "{who}"
        );
    }
    w.assert_clean();
}

/// An HTTPS gate at an address `NO_PROXY` excludes, trusted through `SSL_CERT_DIR` (and not
/// the `SSL_CERT_FILE` that replaces the bundle list), or through one of Go's bundle files
/// other than Debian's, in a mount namespace of the call's own where `/etc` holds only that
/// file.
#[test]
fn readiness_gates_trust_go_system_roots() {
    require_root();
    let w = KddWorld::on_every_address();
    let (ca, tls) = tls_server(&[UPLINK_V4], &[b"http/1.1"]);
    let gate = TestProxy::start_on(&w.host, "0.0.0.0", Some(tls));
    let url = format!("https://{UPLINK_V4}:{}/ready", gate.port());
    let conf = w.conf(json!({"readiness_gates": [url]}));
    let dir = w.scratch.path().join("certs.d");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("gate.pem"), &ca).unwrap();
    let ca_file = w.scratch.path().join("only-ca.pem");
    std::fs::write(&ca_file, &ca).unwrap();
    let dead = "http://127.0.0.1:1";
    for (who, bin) in binaries() {
        let env = proxy_env(&[
            ("HTTPS_PROXY", dead),
            ("NO_PROXY", UPLINK_V4),
            ("SSL_CERT_FILE", "/nonexistent/bundle.pem"),
            ("SSL_CERT_DIR", &format!("/nonexistent:{}", dir.display())),
        ]);
        let add = add_del(&w, &bin, &format!("r-dir-{who}"), &conf, &env);
        add.assert_ok();
        assert!(add.elapsed < FAST, "{who}: {:?}", add.elapsed);
        // Go's bundle list: each file alone in an otherwise empty /etc.
        for (i, file) in [
            "/etc/pki/tls/certs/ca-bundle.crt",
            "/etc/ssl/ca-bundle.pem",
            "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem",
            "/etc/ssl/cert.pem",
        ]
        .iter()
        .enumerate()
        {
            let parent = Path::new(file).parent().unwrap().display().to_string();
            w.seed_pod("default", &format!("r{i}-{who}"), json!({}));
            let pod = Netns::new("pod");
            let mut inv = Invocation::new("ADD", &format!("r{i}-{who}-cid"), pod.path())
                .k8s("default", &format!("r{i}-{who}"));
            inv.extra_env = proxy_env(&[("NO_PROXY", UPLINK_V4)]);
            inv.prefix = Some(format!(
                "mount -t tmpfs none /etc && mkdir -p {parent} && cp {} {file}",
                ca_file.display()
            ));
            let add = bin.run("calico", w.host.name(), &inv, &conf);
            add.assert_ok();
            assert!(add.elapsed < FAST, "{who} {file}: {:?}", add.elapsed);
            bin.run("calico", w.host.name(), &inv.as_del(), &conf)
                .assert_ok_fast();
        }
    }
    assert!(gate.seen().iter().all(|s| s.target == "/ready"));
    w.assert_clean();
}

/// An `https://` proxy URL: the proxy itself is reached over TLS, with the API client's own
/// TLS settings (here the kubeconfig's `insecure-skip-tls-verify`), and with Go's system
/// roots for the readiness gates; the tunnel and the server's TLS run inside that.
#[test]
fn an_https_proxy_is_reached_over_tls() {
    require_root();
    let w = KddWorld::on_every_address();
    let (proxy_ca, proxy_tls) = tls_server(&["127.0.0.1"], &[b"http/1.1"]);
    let proxy = TestProxy::start_tls_in(&w.host, proxy_tls);
    let (gate_ca, gate_tls) = tls_server(&["gate.proxy.test"], &[b"http/1.1"]);
    let gate = TestProxy::start_on(&w.host, "127.0.0.1", Some(gate_tls));
    proxy.route(
        "gate.proxy.test:443",
        SocketAddr::from(([127, 0, 0, 1], gate.port())),
    );
    let roots = w.scratch.path().join("roots.pem");
    std::fs::write(&roots, format!("{proxy_ca}{gate_ca}")).unwrap();
    let port = w.api.port();
    let kc = w.scratch.path().join("insecure");
    std::fs::write(
        &kc,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: https://{UPLINK_V4}:{port}\n    insecure-skip-tls-verify: true\nusers:\n- name: test\n  user:\n    token: {}\ncontexts:\n- name: test\n  context:\n    cluster: test\n    user: test\ncurrent-context: test\n",
            w.api.token()
        ),
    )
    .unwrap();
    let conf = conf_with(
        &w,
        &kc,
        json!({"readiness_gates": ["https://gate.proxy.test/ready"]}),
    );
    let env = proxy_env(&[
        ("HTTPS_PROXY", &proxy.url_with_user("u", "p")),
        ("SSL_CERT_FILE", &roots.display().to_string()),
    ]);
    assert!(proxy.url().starts_with("https://"));
    for (who, bin) in binaries() {
        proxy.clear();
        let add = add_del(&w, &bin, &format!("tls-{who}"), &conf, &env);
        add.assert_ok();
        assert!(add.elapsed < FAST, "{who}: {:?}", add.elapsed);
        let seen = proxy.seen();
        let api = format!("{UPLINK_V4}:{port}");
        assert!(seen.iter().any(|s| s.target == api), "{who}: {seen:?}");
        assert!(
            seen.iter().any(|s| s.target == "gate.proxy.test:443"),
            "{who}: {seen:?}"
        );
        assert!(
            seen.iter()
                .all(|s| s.method == "CONNECT" && s.status == 200),
            "{who}: {seen:?}"
        );
    }
    w.assert_clean();
}
