#![allow(dead_code)]
//! A real Kubernetes API server for the end-to-end suites: kube-apiserver (v1.35, a peer
//! `make deps` builds, common/peers.rs) on a real etcd, both inside a network namespace the
//! test made, bound to its 127.0.0.1, with Calico's CRDs and the upstream `calico-cni-plugin`
//! RBAC applied, and a kubeconfig carrying the plugin's own ServiceAccount token (from
//! TokenRequest), so every request the plugin makes is authorized as on a real cluster.
//!
//! * [`RealK8s::available`]: whether the binaries and manifests are there (tests print
//!   `SKIPPED <why>` and pass when they are not).
//! * [`RealK8s::start`]: etcd + kube-apiserver in a given netns, ready, CRDs Established, RBAC
//!   effective for the plugin's token. Everything is stopped by PID on drop.
//! * Admin access (a `system:masters` token over HTTP/2): [`RealK8s::get`], [`RealK8s::put`]
//!   (create or replace), [`RealK8s::post`], [`RealK8s::patch`], [`RealK8s::remove`],
//!   [`RealK8s::list`], [`RealK8s::request`].
//! * The audit log (every request at Metadata level; pod status patches at Request level, with
//!   the patch): [`RealK8s::audit_mark`] and [`RealK8s::plugin_requests_since`] count what the
//!   plugin's user sent between two points.
//! * [`RealK8s::freeze`] / [`RealK8s::thaw`]: SIGSTOP / SIGCONT of kube-apiserver by PID.
//!
//! One server per test (no controller-manager, so namespaces cannot be deleted and a shared
//! server would leak state between tests); start-up is measured in [`RealK8s::startup`].

use std::collections::BTreeMap;
use std::fs;
use std::io::BufRead;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{json, Value};
use tokio_rustls::rustls;

use super::cni::TempDir;
use super::etcd::EtcdServer;
use super::netns::Netns;
use super::peers::{peer, shared_k8s_file};

/// Calico's v3.32.1 CRDs and the plugin's RBAC, in `shared/k8s`.
const CRDS: &str = "calico-crds-v3.32.1.yaml";
const RBAC: &str = "calico-cni-plugin-rbac-v3.32.1.yaml";
/// The plugin's ServiceAccount (upstream's manifests) and its user name.
pub const PLUGIN_SA_NAMESPACE: &str = "kube-system";
pub const PLUGIN_SA: &str = "calico-cni-plugin";
pub const PLUGIN_USER: &str = "system:serviceaccount:kube-system:calico-cni-plugin";
/// How long one admin request may take (a frozen server makes them wait).
const ADMIN_TIMEOUT: Duration = Duration::from_secs(30);
const READY_TIMEOUT: Duration = Duration::from_secs(90);

/// What the harness needs: kube-apiserver (a peer, `make deps`), Calico's CRDs and RBAC
/// (`shared/k8s`) and etcd; or why one is missing.
pub struct Needs {
    pub apiserver: PathBuf,
    pub crds: PathBuf,
    pub rbac: PathBuf,
}

/// [`Needs`], or why one is missing.
pub fn needs() -> Result<Needs, String> {
    let apiserver = peer("kube-apiserver")?;
    let crds = shared_k8s_file(CRDS)?;
    let rbac = shared_k8s_file(RBAC)?;
    for bin in ["/usr/bin/etcd", "/usr/bin/etcdctl"] {
        if !Path::new(bin).is_file() {
            return Err(format!("{bin} is absent (Debian etcd-server, etcd-client)"));
        }
    }
    Ok(Needs {
        apiserver,
        crds,
        rbac,
    })
}

/// One request the audit log recorded.
#[derive(Clone, Debug)]
pub struct Audited {
    pub user: String,
    pub verb: String,
    /// The request URI, path and query.
    pub uri: String,
    pub code: u16,
    /// The request body, for the requests the policy logs at Request level (pod status
    /// patches); `Null` otherwise.
    pub request_object: Value,
}

impl Audited {
    /// `VERB /path` (the query left off), for listings.
    pub fn line(&self) -> String {
        let path = self.uri.split('?').next().unwrap_or_default();
        format!("{} {path} -> {}", self.verb, self.code)
    }
    pub fn path(&self) -> &str {
        self.uri.split('?').next().unwrap_or_default()
    }
    /// Whether it changed (or tried to change) something.
    pub fn is_write(&self) -> bool {
        matches!(
            self.verb.as_str(),
            "create" | "update" | "patch" | "delete" | "deletecollection"
        )
    }
}

/// An answer to an admin request.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub body: Value,
}

/// A running etcd + kube-apiserver.
pub struct RealK8s {
    // Field order = drop order for what has no Drop of its own; Drop below stops the
    // apiserver first.
    apiserver: Child,
    admin: Admin,
    etcd: EtcdServer,
    port: u16,
    admin_token: String,
    plugin_token: String,
    ca_pem: String,
    dir: TempDir,
    kubeconfigs: AtomicUsize,
    markers: AtomicUsize,
    startup: Duration,
    /// The netns it listens in (on its 127.0.0.1).
    netns: String,
}

impl RealK8s {
    /// Whether a real API server can be started here; `Err(why)` if not.
    pub fn available() -> Result<(), String> {
        needs().map(|_| ())
    }

    /// Starts etcd and kube-apiserver inside `netns` (on its 127.0.0.1), applies Calico's
    /// CRDs and the plugin's RBAC, creates the system namespaces' `default` ServiceAccounts,
    /// and writes the plugin's kubeconfig. Panics (after stopping what it started) if the
    /// server does not come up; call [`RealK8s::available`] first.
    pub fn start(netns: &Netns) -> RealK8s {
        let t0 = Instant::now();
        let k8s = needs().unwrap_or_else(|why| panic!("{why}"));
        let dir = TempDir::new("real-k8s");
        let etcd = EtcdServer::start_in_netns(Some(netns.name()));
        let t_etcd = t0.elapsed();
        let tls = Tls::new();
        let p = |f: &str| dir.path().join(f);
        fs::write(p("tls.crt"), &tls.server_cert_pem).unwrap();
        fs::write(p("tls.key"), &tls.server_key_pem).unwrap();
        fs::write(p("sa.key"), &tls.sa_key_pem).unwrap();
        fs::write(p("sa.pub"), &tls.sa_pub_pem).unwrap();
        let admin_token = hex(&random_bytes::<16>());
        fs::write(
            p("tokens.csv"),
            format!("{admin_token},admin,admin,\"system:masters\"\n"),
        )
        .unwrap();
        // Every request at Metadata level, once (at ResponseComplete); pod status patches at
        // Request level, so the patch the plugin sent is in the log. (A create's or update's
        // requestObject is logged as decoded, already pruned and defaulted: the log cannot
        // show a field the CRDs' schemas dropped; the suites assert the stored fields.)
        fs::write(
            p("audit-policy.yaml"),
            "apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [\"RequestReceived\"]
rules:
- level: Request
  verbs: [\"patch\"]
  resources: [{group: \"\", resources: [\"pods/status\"]}]
- level: Metadata
",
        )
        .unwrap();
        let port = free_port_in(netns);
        let log = fs::File::create(p("kube-apiserver.log")).unwrap();
        let s = |f: &str| p(f).display().to_string();
        let apiserver = Command::new("ip")
            .args(["netns", "exec", netns.name()])
            .arg(&k8s.apiserver)
            .arg(format!("--etcd-servers={}", etcd.endpoint()))
            .arg(format!("--secure-port={port}"))
            // All of the netns's addresses: a second node reaches it over the node link.
            .args(["--bind-address=0.0.0.0", "--advertise-address=127.0.0.1"])
            .arg(format!("--tls-cert-file={}", s("tls.crt")))
            .arg(format!("--tls-private-key-file={}", s("tls.key")))
            .arg(format!("--token-auth-file={}", s("tokens.csv")))
            .arg("--authorization-mode=RBAC")
            .arg(format!("--service-account-key-file={}", s("sa.pub")))
            .arg(format!(
                "--service-account-signing-key-file={}",
                s("sa.key")
            ))
            .arg("--service-account-issuer=https://kubernetes.default.svc.cluster.local")
            .arg("--service-cluster-ip-range=10.96.0.0/16")
            .arg(format!("--audit-policy-file={}", s("audit-policy.yaml")))
            .arg(format!("--audit-log-path={}", s("audit.log")))
            .arg("--audit-log-mode=blocking")
            .arg(format!("--cert-dir={}", s("certs")))
            .arg("--profiling=false")
            .arg("--v=1")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start kube-apiserver");
        let admin = Admin::start(netns.path(), port, tls.ca_der.clone());
        let mut k = RealK8s {
            apiserver,
            admin,
            etcd,
            port,
            admin_token,
            plugin_token: String::new(),
            ca_pem: tls.ca_pem,
            dir,
            kubeconfigs: AtomicUsize::new(0),
            markers: AtomicUsize::new(0),
            startup: Duration::ZERO,
            netns: netns.name().to_string(),
        };
        k.wait_ready();
        let t_ready = t0.elapsed();
        k.install_calico(&k8s);
        let t_crds = t0.elapsed();
        k.plugin_token = k.token_request();
        fs::write(k.kubeconfig(), k.kubeconfig_text(&k.plugin_token.clone())).unwrap();
        k.wait_plugin_authorized();
        k.startup = t0.elapsed();
        eprintln!(
            "real kube-apiserver ready in {:?} (etcd {t_etcd:?}, /readyz {t_ready:?}, CRDs \
             established {t_crds:?})",
            k.startup
        );
        k
    }

    /// How long [`RealK8s::start`] took, to ready with Calico installed.
    pub fn startup(&self) -> Duration {
        self.startup
    }

    fn log_tail(&self) -> String {
        let log =
            fs::read_to_string(self.dir.path().join("kube-apiserver.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Ok(Some(status)) = self.apiserver.try_wait() {
                panic!("kube-apiserver exited ({status}):\n{}", self.log_tail());
            }
            if let Ok(a) = self
                .admin
                .call("GET", "/readyz", None, "", &self.admin_token)
            {
                if a.status == 200 {
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "kube-apiserver not ready within {READY_TIMEOUT:?}:\n{}",
                self.log_tail()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Namespaces, the plugin's RBAC, Calico's CRDs (all sent at once), then waits until
    /// every CRD is Established and served.
    fn install_calico(&self, k8s: &Needs) {
        for ns in ["default", "kube-system"] {
            self.ensure_namespace(ns);
        }
        let mut objects = parse_yaml(&k8s.rbac);
        let crds = parse_yaml(&k8s.crds);
        let plurals: Vec<String> = crds
            .iter()
            .map(|c| c["spec"]["names"]["plural"].as_str().unwrap().to_string())
            .collect();
        objects.extend(crds);
        let pending: Vec<_> = objects
            .into_iter()
            .map(|o| {
                let path = collection_path(&o);
                (
                    path.clone(),
                    self.admin.send(
                        "POST",
                        &path,
                        Some(o),
                        "application/json",
                        &self.admin_token,
                    ),
                )
            })
            .collect();
        for (path, rx) in pending {
            let a = Admin::wait(rx).unwrap_or_else(|e| panic!("POST {path}: {e}"));
            assert!(a.status == 201 || a.status == 409, "POST {path}: {a:?}");
        }
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            // A server error while the server settles after the creates (etcd answering
            // "unexpected EOF", seen once under load) is polled again, as "not yet".
            let crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions";
            let listed = self.request("GET", crds, None, "");
            assert!(
                listed.status == 200 || listed.status >= 500,
                "GET {crds}: {listed:?}"
            );
            let items = match listed.status {
                200 => listed.body["items"].as_array().cloned().unwrap_or_default(),
                _ => Vec::new(),
            };
            let established = items
                .iter()
                .filter(|c| {
                    c["status"]["conditions"].as_array().is_some_and(|cs| {
                        cs.iter()
                            .any(|c| c["type"] == "Established" && c["status"] == "True")
                    })
                })
                .count();
            let served = self
                .get("/apis/crd.projectcalico.org/v1")
                .map(|d| {
                    let names: Vec<&str> = d["resources"]
                        .as_array()
                        .map(|r| r.iter().filter_map(|r| r["name"].as_str()).collect())
                        .unwrap_or_default();
                    plurals.iter().all(|p| names.contains(&p.as_str()))
                })
                .unwrap_or(false);
            if established == plurals.len() && served {
                break;
            }
            assert!(Instant::now() < deadline, "CRDs not established");
            std::thread::sleep(Duration::from_millis(30));
        }
        // Each resource's watch cache filled, as on a cluster that has been up a while: a
        // v1.35 server answers a cached read (`resourceVersion=0`) of a resource whose
        // cache is still initializing with 429 "storage is (re)initializing", which the
        // plugin meets only right after a server start (and then reads etcd instead); the
        // suites count the plugin's requests on a settled server.
        let mut warming: Vec<String> = plurals
            .iter()
            .map(|p| format!("/apis/crd.projectcalico.org/v1/{p}"))
            .chain(
                ["pods", "namespaces", "nodes", "serviceaccounts"]
                    .iter()
                    .map(|r| format!("/api/v1/{r}")),
            )
            .collect();
        while !warming.is_empty() {
            warming.retain(|path| {
                let a = self.request(
                    "GET",
                    &format!("{path}?resourceVersion=0&limit=1"),
                    None,
                    "",
                );
                a.status != 200
            });
            assert!(
                Instant::now() < deadline,
                "watch caches not ready: {warming:?}"
            );
            if !warming.is_empty() {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// Creates namespace `name` if missing, and its `default` ServiceAccount (no
    /// controller-manager runs to make it; pods name it).
    pub fn ensure_namespace(&self, name: &str) {
        let a = self.post(
            "/api/v1/namespaces",
            json!({"apiVersion":"v1","kind":"Namespace","metadata":{"name":name}}),
        );
        assert!(
            a.status == 201 || a.status == 409,
            "namespace {name}: {a:?}"
        );
        let a = self.post(
            &format!("/api/v1/namespaces/{name}/serviceaccounts"),
            json!({"apiVersion":"v1","kind":"ServiceAccount","metadata":{"name":"default","namespace":name}}),
        );
        assert!(
            a.status == 201 || a.status == 409,
            "default SA of {name}: {a:?}"
        );
    }

    /// Starts a client that, every `every`, sends a read (`GET /version`) and a write (a
    /// ConfigMap's create, which RBAC refuses: nothing is written) as ServiceAccount
    /// `kube-system/neighbour` (made here, with no RBAC of its own). Both pass API Priority
    /// and Fairness (before authorization) on the plugin's priority level (`workload-high`,
    /// the `kube-system-service-accounts` FlowSchema's), as a cluster's other kube-system
    /// ServiceAccounts, leases and controllers keep it and the server's read-only and
    /// mutating watermarks busy. Stopped when the guard drops.
    ///
    /// Why a benchmark wanted it: the v1.24 server the suites ran on before v1.35 had APF
    /// metrics (`sampleAndWaterMarkHistograms`) that caught up, on the first request after an idle spell,
    /// with three histogram observations per idle millisecond, under a lock. Where the plugin
    /// is its level's only client, each pod's first round trip pays CPU for the seconds since
    /// the previous pod: a plugin GET took 4.4-9.5 ms on an idle server after 1-30 s of
    /// quiet, 1.4-2.2 ms with this neighbour. v1.25 replaced those histograms (timing-ratio
    /// histograms, no catch-up), and in a cluster they are never idle; it stays so that the
    /// plugin's level is as busy as a cluster's.
    pub fn start_priority_level_neighbour(&self, every: Duration) -> Neighbour {
        let sa = "neighbour";
        let a = self.post(
            &format!("/api/v1/namespaces/{PLUGIN_SA_NAMESPACE}/serviceaccounts"),
            json!({"apiVersion":"v1","kind":"ServiceAccount",
                "metadata":{"name":sa,"namespace":PLUGIN_SA_NAMESPACE}}),
        );
        assert!(a.status == 201 || a.status == 409, "SA {sa}: {a:?}");
        let token = self.token_for(sa);
        let tx = self
            .admin
            .tx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .expect("admin client running");
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::Builder::new()
            .name("apf-neighbour".into())
            .spawn(move || {
                let refused_write = json!({"apiVersion":"v1","kind":"ConfigMap",
                    "metadata":{"name":"neighbour"}});
                let requests = [
                    ("GET", "/version".to_string(), None),
                    (
                        "POST",
                        format!("/api/v1/namespaces/{PLUGIN_SA_NAMESPACE}/configmaps"),
                        Some(refused_write),
                    ),
                ];
                while !stopped.load(Ordering::SeqCst) {
                    for (method, path, body) in &requests {
                        let (reply, rx) = std::sync::mpsc::channel();
                        let job = Job {
                            method: method.to_string(),
                            path: path.clone(),
                            body: body.clone(),
                            content_type: "application/json".into(),
                            token: token.clone(),
                            reply,
                        };
                        if tx.send(job).is_err() {
                            return;
                        }
                        // Its answer (or the admin client's timeout) before the next one.
                        let _ = rx.recv();
                    }
                    std::thread::sleep(every);
                }
            })
            .expect("spawn the APF neighbour");
        Neighbour {
            stop,
            thread: Some(thread),
        }
    }

    fn token_request(&self) -> String {
        self.token_for(PLUGIN_SA)
    }

    /// A TokenRequest's token for ServiceAccount `sa` of [`PLUGIN_SA_NAMESPACE`].
    fn token_for(&self, sa: &str) -> String {
        let a = self.post(
            &format!("/api/v1/namespaces/{PLUGIN_SA_NAMESPACE}/serviceaccounts/{sa}/token"),
            json!({"apiVersion":"authentication.k8s.io/v1","kind":"TokenRequest",
                "spec":{"expirationSeconds": 7200}}),
        );
        assert_eq!(a.status, 201, "TokenRequest: {a:?}");
        a.body["status"]["token"]
            .as_str()
            .expect("a token")
            .to_string()
    }

    /// Until the plugin's token authenticates and its RBAC is in the authorizer's cache: a
    /// request the ClusterRole allows answers 200.
    fn wait_plugin_authorized(&self) {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let a = self
                .admin
                .call(
                    "GET",
                    "/apis/crd.projectcalico.org/v1/ippools",
                    None,
                    "",
                    &self.plugin_token,
                )
                .expect("list pools as the plugin");
            if a.status == 200 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the plugin's token is not authorized: {a:?}"
            );
            std::thread::sleep(Duration::from_millis(30));
        }
    }

    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }
    pub fn port(&self) -> u16 {
        self.port
    }
    pub fn ca_pem(&self) -> String {
        self.ca_pem.clone()
    }
    /// The plugin's ServiceAccount token.
    pub fn plugin_token(&self) -> String {
        self.plugin_token.clone()
    }
    /// The admin's (`system:masters`) token.
    pub fn admin_token(&self) -> String {
        self.admin_token.clone()
    }
    pub fn apiserver_pid(&self) -> u32 {
        self.apiserver.id()
    }
    pub fn etcd(&self) -> &EtcdServer {
        &self.etcd
    }

    /// The plugin's kubeconfig: the server, its CA, the `calico-cni-plugin` token.
    pub fn kubeconfig(&self) -> PathBuf {
        self.dir.path().join("kubeconfig")
    }

    /// Another kubeconfig for this server with `token`.
    pub fn kubeconfig_with(&self, token: &str) -> PathBuf {
        let n = self.kubeconfigs.fetch_add(1, Ordering::SeqCst);
        let path = self.dir.path().join(format!("kubeconfig-{n}"));
        fs::write(&path, self.kubeconfig_text(token)).unwrap();
        path
    }

    fn kubeconfig_text(&self, token: &str) -> String {
        format!(
            "apiVersion: v1
kind: Config
clusters:
- name: real
  cluster:
    server: {url}
    certificate-authority-data: {ca}
users:
- name: calico-cni-plugin
  user:
    token: {token}
contexts:
- name: real
  context:
    cluster: real
    user: calico-cni-plugin
current-context: real
",
            url = self.url(),
            ca = calico_cni::install::kubeconfig::base64_std(self.ca_pem.as_bytes())
        )
    }

    // ----------------------------------------------------------------- admin requests

    /// Any request as the admin; panics if there is no answer (within 30 s).
    pub fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
        content_type: &str,
    ) -> Answer {
        self.admin
            .call(method, path, body, content_type, &self.admin_token)
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
    }

    /// Many requests at once, multiplexed on the admin's one connection, answered in the
    /// order given: (method, path, body, content type) each.
    pub fn request_all(&self, reqs: Vec<(String, String, Option<Value>, String)>) -> Vec<Answer> {
        let pending: Vec<_> = reqs
            .into_iter()
            .map(|(method, path, body, ct)| {
                let rx = self
                    .admin
                    .send(&method, &path, body, &ct, &self.admin_token);
                (format!("{method} {path}"), rx)
            })
            .collect();
        pending
            .into_iter()
            .map(|(what, rx)| Admin::wait(rx).unwrap_or_else(|e| panic!("{what}: {e}")))
            .collect()
    }

    pub fn get(&self, path: &str) -> Option<Value> {
        let a = self.request("GET", path, None, "");
        match a.status {
            200 => Some(a.body),
            404 => None,
            _ => panic!("GET {path}: {a:?}"),
        }
    }

    pub fn post(&self, collection: &str, obj: Value) -> Answer {
        self.request("POST", collection, Some(obj), "application/json")
    }

    /// A strategic-merge patch (core types) or merge patch (custom resources).
    pub fn patch(&self, path: &str, patch: Value) -> Value {
        let ct = if path.starts_with("/api/") {
            "application/strategic-merge-patch+json"
        } else {
            "application/merge-patch+json"
        };
        let a = self.request("PATCH", path, Some(patch), ct);
        assert_eq!(a.status, 200, "PATCH {path}: {a:?}");
        a.body
    }

    /// Creates the object at `path` or replaces it (keeping a pod's spec and a node's pod
    /// CIDRs, which cannot change, and taking the rest from `obj`), as the test server's put does; a new
    /// namespace gets its `default` ServiceAccount. Returns the stored object.
    pub fn put(&self, path: &str, mut obj: Value) -> Value {
        for _ in 0..5 {
            let a = match self.get(path) {
                None => {
                    let (collection, _) = path.rsplit_once('/').expect("an object path");
                    self.post(collection, obj.clone())
                }
                Some(old) => {
                    obj["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"].clone();
                    if path.starts_with("/api/v1/namespaces/") && path.contains("/pods/") {
                        obj["spec"] = old["spec"].clone();
                    }
                    // A Node's pod CIDRs, once set, cannot change.
                    if path.starts_with("/api/v1/nodes/") {
                        for f in ["podCIDR", "podCIDRs"] {
                            if !old["spec"][f].is_null() {
                                obj["spec"][f] = old["spec"][f].clone();
                            }
                        }
                    }
                    self.request("PUT", path, Some(obj.clone()), "application/json")
                }
            };
            match a.status {
                201 if is_namespace_path(path) => {
                    self.ensure_namespace(path.rsplit('/').next().unwrap());
                    return a.body;
                }
                200 | 201 => return a.body,
                409 => continue, // raced with a writer (the plugin): read again
                _ => panic!("put {path}: {a:?}"),
            }
        }
        panic!("put {path}: conflicts five times");
    }

    /// Deletes the object at `path` at once (no grace period: no kubelet confirms a pod's
    /// end); a missing object is fine.
    pub fn remove(&self, path: &str) {
        let a = self.request(
            "DELETE",
            &format!("{path}?gracePeriodSeconds=0"),
            Some(json!({"apiVersion":"v1","kind":"DeleteOptions","gracePeriodSeconds":0})),
            "application/json",
        );
        assert!(
            a.status == 200 || a.status == 202 || a.status == 404,
            "DELETE {path}: {a:?}"
        );
    }

    /// The items of a collection, each with its `kind` and `apiVersion` (a list's items
    /// carry neither), sorted by name as the server returns them.
    pub fn list(&self, collection: &str) -> Vec<Value> {
        let a = self.request("GET", collection, None, "");
        if a.status == 404 {
            return vec![];
        }
        assert_eq!(a.status, 200, "GET {collection}: {a:?}");
        let kind = a.body["kind"]
            .as_str()
            .unwrap_or_default()
            .trim_end_matches("List")
            .to_string();
        let api_version = a.body["apiVersion"].clone();
        a.body["items"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .map(|mut i| {
                i["kind"] = json!(kind);
                i["apiVersion"] = api_version.clone();
                i
            })
            .collect()
    }

    // ----------------------------------------------------------------- the audit log

    /// The API server's audit log (Metadata level: each request's user, verb, URI, and when
    /// it was received and answered).
    pub fn audit_path(&self) -> PathBuf {
        self.dir.path().join("audit.log")
    }

    fn audit_events(&self) -> Vec<Value> {
        let Ok(f) = fs::File::open(self.audit_path()) else {
            return vec![];
        };
        std::io::BufReader::new(f)
            .lines()
            .map_while(Result::ok)
            .filter_map(|l| serde_json::from_str::<Value>(&l).ok())
            .filter(|e| e["stage"] == "ResponseComplete" || e["stage"] == "Panic")
            .collect()
    }

    /// A point in the audit log: every request answered before this call is before it.
    pub fn audit_mark(&self) -> usize {
        self.settle_audit()
    }

    /// Sends a request of its own and waits until the log has it: whatever was answered
    /// before is then logged too (the log is written, blocking, as each answer completes).
    /// Returns the number of events before the marker.
    fn settle_audit(&self) -> usize {
        let n = self.markers.fetch_add(1, Ordering::SeqCst);
        let marker = format!("/api/v1/namespaces/default/configmaps/audit-marker-{n}");
        let a = self.request("GET", &marker, None, "");
        assert_eq!(a.status, 404, "marker {marker}: {a:?}");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let events = self.audit_events();
            if let Some(i) = events.iter().position(|e| e["requestURI"] == marker) {
                // A request answered just before the marker may have its event written a
                // moment after the marker's (different goroutines): give it that moment.
                std::thread::sleep(Duration::from_millis(100));
                return i;
            }
            assert!(
                Instant::now() < deadline,
                "audit marker {marker} never logged"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The requests the plugin's user made after `mark` (up to now), in log order.
    pub fn plugin_requests_since(&self, mark: usize) -> Vec<Audited> {
        let end = self.settle_audit();
        self.audit_events()[..end]
            .iter()
            .skip(mark)
            .map(audited)
            .filter(|a| a.user == PLUGIN_USER)
            .collect()
    }

    /// Every client's request after `mark` (up to now), whoever made it, in log order. The
    /// server's own (`system:apiserver`: its loops, such as the `kubernetes` service's
    /// endpoint reconciler every 10 s) are left out: no client sends them.
    pub fn client_requests_since(&self, mark: usize) -> Vec<Audited> {
        let end = self.settle_audit();
        self.audit_events()[..end]
            .iter()
            .skip(mark)
            .map(audited)
            .filter(|a| a.user != "system:apiserver")
            .collect()
    }

    /// Every logged request so far by the plugin's user (no settling).
    pub fn plugin_requests_now(&self) -> Vec<Audited> {
        self.audit_events()
            .iter()
            .map(audited)
            .filter(|a| a.user == PLUGIN_USER)
            .collect()
    }

    /// What the server held against the plugin's requests so far: refused by RBAC (403) or
    /// rejected (400, 422, e.g. by a CRD's schema or CEL rule).
    pub fn plugin_nonconformance(&self) -> Vec<String> {
        self.settle_audit();
        self.nonconformance_now()
    }

    /// [`RealK8s::plugin_nonconformance`] without waiting for the log to settle (the server
    /// may be frozen).
    fn nonconformance_now(&self) -> Vec<String> {
        let mut out = vec![];
        for e in self.audit_events() {
            if e["user"]["username"] != PLUGIN_USER {
                continue;
            }
            let a = audited(&e);
            if matches!(a.code, 400 | 403 | 422) {
                out.push(format!("{}: {}", a.line(), e["responseStatus"]["message"]));
            }
        }
        out
    }

    /// Panics with [`RealK8s::plugin_nonconformance`] unless it is empty.
    pub fn assert_plugin_conformant(&self) {
        let bad = self.plugin_nonconformance();
        assert!(
            bad.is_empty(),
            "the real API server refused or rejected the plugin's requests:\n{}",
            bad.join("\n")
        );
        self.assert_ipam_check_clean();
    }

    /// Upstream's `calicoctl ipam check` finds no problem (`make upstream-check` runs the
    /// real-cluster suites with it); nothing when `CALICO_UPSTREAM_BIN` holds no calicoctl.
    pub fn assert_ipam_check_clean(&self) {
        let Some(calicoctl) = std::env::var_os("CALICO_UPSTREAM_BIN")
            .map(|d| PathBuf::from(d).join("calicoctl"))
            .filter(|c| c.is_file())
        else {
            return;
        };
        // It reads the KubeControllersConfiguration (kube-controllers would have made it).
        let a = self.post(
            "/apis/crd.projectcalico.org/v1/kubecontrollersconfigurations",
            json!({"apiVersion": "crd.projectcalico.org/v1", "kind": "KubeControllersConfiguration",
                "metadata": {"name": "default"}, "spec": {"controllers": {"node": {}}}}),
        );
        assert!(a.status == 201 || a.status == 409, "{a:?}");
        let admin = self.kubeconfig_with(&self.admin_token);
        let out = Command::new("ip")
            .args(["netns", "exec", &self.netns])
            .arg(&calicoctl)
            .args(["ipam", "check", "--allow-version-mismatch"])
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .env("DATASTORE_TYPE", "kubernetes")
            .env("KUBECONFIG", &admin)
            .output()
            .expect("calicoctl ipam check");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains("found 0 problems"),
            "calicoctl ipam check: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// The audit log's path (to follow it while a test runs).
    pub fn audit_log(&self) -> PathBuf {
        self.audit_path()
    }

    // ----------------------------------------------------------------- freezing

    /// Freezes kube-apiserver (SIGSTOP): connections stay open, requests are accepted by the
    /// kernel and never answered until [`RealK8s::thaw`].
    pub fn freeze(&self) {
        signal(self.apiserver.id(), libc::SIGSTOP);
    }

    /// Lets a frozen kube-apiserver go on (SIGCONT): it then handles what was queued.
    pub fn thaw(&self) {
        signal(self.apiserver.id(), libc::SIGCONT);
    }
}

/// A freeze set to happen when the plugin's k-th request is answered (see
/// [`RealK8s::freeze_after_plugin_requests`]); dropping it stops watching (it never thaws).
pub struct FreezeTrap {
    fired: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FreezeTrap {
    /// Whether the server was frozen.
    pub fn fired(&self) -> bool {
        self.fired.load(Ordering::SeqCst)
    }
}

impl Drop for FreezeTrap {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl RealK8s {
    /// Freezes kube-apiserver (SIGSTOP) the moment the audit log shows the plugin's `k`-th
    /// request from now answered (k >= 1): that request has been applied and answered (the
    /// plugin may or may not have read the answer); whatever it sends next waits in the
    /// kernel until [`RealK8s::thaw`]. The log is followed by a thread polling every
    /// millisecond, so a request sent in that moment may get through before the freeze.
    pub fn freeze_after_plugin_requests(&self, k: usize) -> FreezeTrap {
        assert!(k >= 1, "k counts requests from 1");
        self.settle_audit();
        let path = self.audit_path();
        let start = fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        let pid = self.apiserver.id();
        let fired = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let (f, st) = (fired.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            use std::io::{Read, Seek, SeekFrom};
            let mut file = fs::File::open(&path).expect("open the audit log");
            file.seek(SeekFrom::Start(start)).unwrap();
            let (mut pending, mut seen) = (Vec::new(), 0);
            let mut buf = [0u8; 65536];
            while !st.load(Ordering::SeqCst) {
                let n = file.read(&mut buf).unwrap_or(0);
                if n == 0 {
                    std::thread::sleep(Duration::from_millis(1));
                    continue;
                }
                pending.extend_from_slice(&buf[..n]);
                while let Some(end) = pending.iter().position(|b| *b == b'\n') {
                    let line: Vec<u8> = pending.drain(..=end).collect();
                    let Ok(e) = serde_json::from_slice::<Value>(&line) else {
                        continue;
                    };
                    if e["stage"] == "ResponseComplete" && e["user"]["username"] == PLUGIN_USER {
                        seen += 1;
                        if seen == k {
                            signal(pid, libc::SIGSTOP);
                            f.store(true, Ordering::SeqCst);
                            return;
                        }
                    }
                }
            }
        });
        FreezeTrap {
            fired,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for RealK8s {
    fn drop(&mut self) {
        // What the server refused or rejected of the plugin's requests, for the log.
        let bad = self.nonconformance_now();
        if !bad.is_empty() {
            eprintln!(
                "kube-apiserver refused or rejected the plugin's requests:\n{}",
                bad.join("\n")
            );
        }
        // By PID: the child is kube-apiserver itself (`ip netns exec` execs it). A frozen
        // process dies of SIGKILL too. etcd stops in its own Drop.
        let _ = self.apiserver.kill();
        let _ = self.apiserver.wait();
        self.admin.stop();
    }
}

fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: kill(2) on a PID of our own child; no memory is involved.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

/// `/api/v1/namespaces/<name>`.
fn is_namespace_path(path: &str) -> bool {
    path.strip_prefix("/api/v1/namespaces/")
        .is_some_and(|rest| !rest.is_empty() && !rest.contains('/'))
}

fn audited(e: &Value) -> Audited {
    Audited {
        user: e["user"]["username"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
        verb: e["verb"].as_str().unwrap_or_default().to_string(),
        uri: e["requestURI"].as_str().unwrap_or_default().to_string(),
        code: e["responseStatus"]["code"].as_u64().unwrap_or(0) as u16,
        request_object: e["requestObject"].clone(),
    }
}

/// The documents of a YAML file, as JSON.
fn parse_yaml(path: &Path) -> Vec<Value> {
    let text = fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| {
            let v: Value = serde::Deserialize::deserialize(d)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            v
        })
        .filter(|v| !v.is_null())
        .collect()
}

/// Where an object of the manifests is created.
fn collection_path(o: &Value) -> String {
    let api_version = o["apiVersion"].as_str().expect("apiVersion");
    let kind = o["kind"].as_str().expect("kind");
    let prefix = if api_version.contains('/') {
        format!("/apis/{api_version}")
    } else {
        format!("/api/{api_version}")
    };
    let plural = match kind {
        "ServiceAccount" => "serviceaccounts",
        "ClusterRole" => "clusterroles",
        "ClusterRoleBinding" => "clusterrolebindings",
        "CustomResourceDefinition" => "customresourcedefinitions",
        other => panic!("no collection known for kind {other}"),
    };
    match o["metadata"]["namespace"].as_str() {
        Some(ns) => format!("{prefix}/namespaces/{ns}/{plural}"),
        None => format!("{prefix}/{plural}"),
    }
}

/// A port nothing listens on inside `netns` (a fresh netns: only what the test started).
fn free_port_in(netns: &Netns) -> u16 {
    netns.run_in(|| {
        std::net::TcpListener::bind("127.0.0.1:0")
            .expect("bind in the netns")
            .local_addr()
            .unwrap()
            .port()
    })
}

// --------------------------------------------------------------------------- TLS

/// The node link's addresses of a two-node cluster (real_node.rs's `NodePair`): the API
/// server's node first, whose address its certificate names.
pub const NODE_LINK_V4: [&str; 2] = ["10.99.0.11", "10.99.0.12"];

/// A CA, kube-apiserver's serving certificate for 127.0.0.1 (and the node link) signed by it, and the
/// ServiceAccount signing key.
struct Tls {
    ca_pem: String,
    ca_der: Vec<u8>,
    server_cert_pem: String,
    server_key_pem: String,
    sa_key_pem: String,
    sa_pub_pem: String,
}

impl Tls {
    fn new() -> Tls {
        let ca = super::test_ca::TestCa::new("real kube-apiserver test CA");
        let server = ca.server_cert(
            "kube-apiserver",
            &["127.0.0.1", "localhost", NODE_LINK_V4[0]],
        );
        let sa = rcgen::KeyPair::generate().expect("ServiceAccount signing key");
        Tls {
            ca_pem: ca.pem,
            ca_der: ca.der,
            server_cert_pem: server.cert_pem,
            server_key_pem: server.key_pem,
            sa_key_pem: sa.serialize_pem(),
            sa_pub_pem: sa.public_key_pem(),
        }
    }
}

/// The client [`RealK8s::start_priority_level_neighbour`] started; stops it (and waits for
/// its last request) on drop.
pub struct Neighbour {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Neighbour {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

// ------------------------------------------------------------------ the admin client

type Reply = std::sync::mpsc::Receiver<Result<Answer, String>>;

struct Job {
    method: String,
    path: String,
    body: Option<Value>,
    content_type: String,
    token: String,
    reply: std::sync::mpsc::Sender<Result<Answer, String>>,
}

/// An HTTP/2 client on a thread of its own that has joined the server's netns (its sockets
/// are made there, so 127.0.0.1 is the server's loopback), with a current-thread runtime;
/// requests from any test thread are multiplexed on one connection, reconnected when lost.
struct Admin {
    tx: Mutex<Option<tokio::sync::mpsc::UnboundedSender<Job>>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

type Sender = hyper::client::conn::http2::SendRequest<Full<Bytes>>;

impl Admin {
    fn start(netns_path: &str, port: u16, ca_der: Vec<u8>) -> Admin {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Job>();
        let ns = fs::File::open(netns_path).expect("open the netns");
        let thread = std::thread::Builder::new()
            .name(format!("k8s-admin-{port}"))
            .spawn(move || {
                nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                    .expect("enter the netns");
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                let tls = Arc::new(client_tls(&ca_der));
                rt.block_on(async move {
                    let sender: Arc<tokio::sync::Mutex<Option<Sender>>> = Arc::default();
                    while let Some(job) = rx.recv().await {
                        let (tls, sender) = (tls.clone(), sender.clone());
                        tokio::spawn(async move {
                            let r = tokio::time::timeout(
                                ADMIN_TIMEOUT,
                                Admin::run(&sender, &tls, port, &job),
                            )
                            .await
                            .unwrap_or_else(|_| Err(format!("no answer in {ADMIN_TIMEOUT:?}")));
                            let _ = job.reply.send(r);
                        });
                    }
                });
            })
            .expect("spawn the admin client thread");
        Admin {
            tx: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
        }
    }

    async fn connect(tls: &Arc<rustls::ClientConfig>, port: u16) -> Result<Sender, String> {
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let _ = tcp.set_nodelay(true);
        let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
        let stream = tokio_rustls::TlsConnector::from(tls.clone())
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS: {e}"))?;
        let (sender, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
                .await
                .map_err(|e| format!("HTTP/2: {e}"))?;
        tokio::spawn(conn);
        Ok(sender)
    }

    async fn run(
        sender: &tokio::sync::Mutex<Option<Sender>>,
        tls: &Arc<rustls::ClientConfig>,
        port: u16,
        job: &Job,
    ) -> Result<Answer, String> {
        let mut s = {
            let mut guard = sender.lock().await;
            match guard.as_ref() {
                Some(s) if !s.is_closed() => s.clone(),
                _ => {
                    let s = Admin::connect(tls, port).await?;
                    *guard = Some(s.clone());
                    s
                }
            }
        };
        let body = job
            .body
            .as_ref()
            .map(|b| Bytes::from(b.to_string()))
            .unwrap_or_default();
        let mut req = hyper::Request::builder()
            .method(job.method.as_str())
            .uri(format!("https://127.0.0.1:{port}{}", job.path))
            .header("authorization", format!("Bearer {}", job.token))
            .header("accept", "application/json");
        if !job.content_type.is_empty() {
            req = req.header("content-type", job.content_type.as_str());
        }
        let req = req.body(Full::new(body)).map_err(|e| e.to_string())?;
        s.ready().await.map_err(|e| format!("connection: {e}"))?;
        let resp = s
            .send_request(req)
            .await
            .map_err(|e| format!("request: {e}"))?;
        let status = resp.status().as_u16();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("body: {e}"))?
            .to_bytes();
        let body = serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
        Ok(Answer { status, body })
    }

    fn send(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
        content_type: &str,
        token: &str,
    ) -> Reply {
        let (reply, rx) = std::sync::mpsc::channel();
        let job = Job {
            method: method.to_string(),
            path: path.to_string(),
            body,
            content_type: content_type.to_string(),
            token: token.to_string(),
            reply,
        };
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        tx.as_ref()
            .expect("admin client running")
            .send(job)
            .expect("admin client thread alive");
        rx
    }

    fn wait(rx: Reply) -> Result<Answer, String> {
        rx.recv().map_err(|_| "admin client gone".to_string())?
    }

    fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
        content_type: &str,
        token: &str,
    ) -> Result<Answer, String> {
        Admin::wait(self.send(method, path, body, content_type, token))
    }

    fn stop(&self) {
        // Closing the channel ends the thread's loop; its runtime drops every connection.
        self.tx.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }
}

fn client_tls(ca_der: &[u8]) -> rustls::ClientConfig {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(rustls::pki_types::CertificateDer::from(ca_der.to_vec()))
        .expect("the test CA");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    cfg
}

fn random_bytes<const N: usize>() -> [u8; N] {
    use std::io::Read;
    let mut b = [0u8; N];
    fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .expect("read /dev/urandom");
    b
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

/// Counts of `VERB path` over a list of audited requests, for messages.
pub fn summary(reqs: &[Audited]) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for r in reqs {
        *m.entry(format!("{} {}", r.verb, r.path())).or_insert(0) += 1;
    }
    m
}
