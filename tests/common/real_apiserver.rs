#![allow(dead_code)]
//! A real kube-apiserver (../shared/k8s, v1.24) on its own etcd, both on the loopback of a
//! network namespace the test made, with the least the real_node suite needs: TLS for
//! 127.0.0.1, a `system:masters` admin token, RBAC, and the three service-account flags
//! TokenRequest needs. Requests go through curl run in that netns (bounded by --max-time).
//!
//! Kept to this one module so that a shared real-API-server harness can replace it.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};

use super::cni::run_command_within;
use super::etcd::EtcdServer;
use super::real_node::{wait_until, Daemon};

pub const ADMIN_TOKEN: &str = "calico-cni-rs-real-node-admin";
/// The secure port inside the node netns (nothing else listens there).
pub const PORT: u16 = 6443;
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// Bound on one request.
const REQUEST_SECS: u32 = 20;

/// One curl exchange.
#[derive(Debug)]
pub struct Reply {
    pub code: u16,
    pub body: String,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

pub struct RealApiServer {
    // Field order = drop order: the server before its etcd.
    server: Option<Daemon>,
    pub etcd: EtcdServer,
    netns_path: String,
    dir: PathBuf,
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl RealApiServer {
    /// Starts etcd and `kube_apiserver` (an unpacked binary) inside the netns `netns_name`;
    /// `dir` holds its certificates, keys and log. Returns once `/readyz` answers 200.
    pub fn start(kube_apiserver: &Path, netns_name: &str, dir: &Path) -> RealApiServer {
        let netns_path = format!("/run/netns/{netns_name}");
        let etcd = EtcdServer::start_in_netns(Some(netns_name));
        fs::create_dir_all(dir).expect("apiserver dir");
        let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"];
        let mut ca = vec![
            "req",
            "-x509",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=real-node-ca",
        ];
        ca.extend(ec);
        ca.extend(["-keyout", "ca.key", "-out", "ca.crt"]);
        openssl(dir, &ca);
        fs::write(
            dir.join("server.ext"),
            "subjectAltName=IP:127.0.0.1,IP:10.96.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
        )
        .unwrap();
        let mut req = vec!["req", "-nodes", "-subj", "/CN=kube-apiserver"];
        req.extend(ec);
        req.extend(["-keyout", "server.key", "-out", "server.csr"]);
        openssl(dir, &req);
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-in",
                "server.csr",
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                "server.ext",
                "-out",
                "server.crt",
            ],
        );
        openssl(dir, &["genrsa", "-out", "sa.key", "2048"]);
        fs::write(
            dir.join("tokens.csv"),
            format!("{ADMIN_TOKEN},admin,admin,system:masters\n"),
        )
        .unwrap();
        let p = |f: &str| dir.join(f).display().to_string();
        let args = vec![
            format!("--etcd-servers={}", etcd.endpoint()),
            format!("--secure-port={PORT}"),
            "--bind-address=127.0.0.1".into(),
            format!("--advertise-address={}", super::netns::UPLINK_V4),
            format!("--tls-cert-file={}", p("server.crt")),
            format!("--tls-private-key-file={}", p("server.key")),
            format!("--client-ca-file={}", p("ca.crt")),
            format!("--token-auth-file={}", p("tokens.csv")),
            "--authorization-mode=Node,RBAC".into(),
            format!("--service-account-key-file={}", p("sa.key")),
            format!("--service-account-signing-key-file={}", p("sa.key")),
            "--service-account-issuer=https://kubernetes.default.svc".into(),
            "--service-cluster-ip-range=10.96.0.0/24".into(),
            "--feature-gates=CustomResourceValidationExpressions=true".into(),
            format!("--cert-dir={}", p("certs")),
        ];
        let server = Daemon::start(
            "kube-apiserver",
            &netns_path,
            kube_apiserver,
            &args,
            &dir.join("kube-apiserver.log"),
        );
        let api = RealApiServer {
            server: Some(server),
            etcd,
            netns_path,
            dir: dir.to_path_buf(),
        };
        wait_until("kube-apiserver /readyz", READY_TIMEOUT, || {
            api.assert_running();
            (api.request("GET", "/readyz", "", None).code == 200).then_some(())
        });
        api
    }

    fn assert_running(&self) {
        if let Some(s) = &self.server {
            s.assert_running();
        }
    }

    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{PORT}")
    }

    pub fn ca_path(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }

    pub fn ca_pem(&self) -> String {
        fs::read_to_string(self.ca_path()).expect("read CA")
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.join("kube-apiserver.log")
    }

    /// A kubeconfig for `user` with bearer `token`, trusting this server's CA.
    pub fn kubeconfig(&self, token: &str) -> String {
        let ca = base64(self.ca_pem().as_bytes());
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: local\n  cluster:\n    server: {}\n    certificate-authority-data: \"{ca}\"\nusers:\n- name: user\n  user:\n    token: {token}\ncontexts:\n- name: ctx\n  context:\n    cluster: local\n    user: user\ncurrent-context: ctx\n",
            self.url()
        )
    }

    /// `method path` as the admin with an optional body of `content_type`.
    pub fn request(
        &self,
        method: &str,
        path: &str,
        content_type: &str,
        body: Option<&str>,
    ) -> Reply {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net={}", self.netns_path))
            .args(["curl", "-sS", "--cacert"])
            .arg(self.ca_path())
            .args(["--max-time", &REQUEST_SECS.to_string()])
            .args(["-w", "\n%{http_code}", "-X", method])
            .args(["-H", &format!("Authorization: Bearer {ADMIN_TOKEN}")]);
        if body.is_some() {
            cmd.args(["-H", &format!("Content-Type: {content_type}")])
                .args(["--data-binary", "@-"]);
        }
        cmd.arg(format!("{}{path}", self.url()));
        let limit = Duration::from_secs(u64::from(REQUEST_SECS) + 10);
        let out = run_command_within(
            cmd,
            body.unwrap_or(""),
            limit,
            &format!("curl {method} {path}"),
        );
        let (body, code) = out.stdout.rsplit_once('\n').unwrap_or(("", &out.stdout));
        Reply {
            code: code.trim().parse().unwrap_or(0),
            body: body.to_string(),
        }
    }

    pub fn get(&self, path: &str) -> Option<Value> {
        let r = self.request("GET", path, "", None);
        match r.code {
            200 => Some(r.json()),
            404 => None,
            c => panic!("GET {path}: {c} {}", r.body),
        }
    }

    /// The items of a list.
    pub fn list(&self, path: &str) -> Vec<Value> {
        let v = self
            .get(path)
            .unwrap_or_else(|| panic!("no list at {path}"));
        v["items"].as_array().cloned().unwrap_or_default()
    }

    /// POST, asserting 201 (or 200); returns the created object.
    pub fn create(&self, path: &str, obj: &Value) -> Value {
        let r = self.request("POST", path, "application/json", Some(&obj.to_string()));
        assert!(
            r.code == 201 || r.code == 200,
            "POST {path}: {} {}",
            r.code,
            r.body
        );
        r.json()
    }

    /// DELETE; 200/202 and 404 are fine.
    pub fn delete(&self, path: &str) {
        let r = self.request("DELETE", path, "", None);
        assert!(
            matches!(r.code, 200 | 202 | 404),
            "DELETE {path}: {} {}",
            r.code,
            r.body
        );
    }

    /// Applies every document of a multi-document YAML file (the server parses YAML itself:
    /// `Content-Type: application/yaml`), by kind: CRDs, ServiceAccounts, ClusterRoles,
    /// ClusterRoleBindings.
    pub fn apply_yaml_file(&self, path: &Path) -> usize {
        let text = fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let mut n = 0;
        for doc in split_yaml(&text) {
            let Some(kind) = top_level(&doc, "kind") else {
                continue;
            };
            let url = match kind.as_str() {
                "CustomResourceDefinition" => {
                    "/apis/apiextensions.k8s.io/v1/customresourcedefinitions".to_string()
                }
                "ServiceAccount" => {
                    let ns = metadata_field(&doc, "namespace").unwrap_or("default".into());
                    format!("/api/v1/namespaces/{ns}/serviceaccounts")
                }
                "ClusterRole" => "/apis/rbac.authorization.k8s.io/v1/clusterroles".into(),
                "ClusterRoleBinding" => {
                    "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings".into()
                }
                other => panic!("{}: no path known for kind {other}", path.display()),
            };
            let r = self.request("POST", &url, "application/yaml", Some(&doc));
            assert_eq!(
                r.code,
                201,
                "POST {kind} from {}: {}",
                path.display(),
                r.body
            );
            n += 1;
        }
        n
    }

    /// A token for ServiceAccount `ns/name` from the TokenRequest API.
    pub fn token_request(&self, ns: &str, name: &str, seconds: u64) -> String {
        let body = json!({"apiVersion":"authentication.k8s.io/v1","kind":"TokenRequest",
            "spec":{"expirationSeconds":seconds}});
        let v = self.create(
            &format!("/api/v1/namespaces/{ns}/serviceaccounts/{name}/token"),
            &body,
        );
        v["status"]["token"]
            .as_str()
            .unwrap_or_else(|| panic!("no token in {v}"))
            .to_string()
    }

    /// Waits until `kind` (plural, group/version path prefix) is served: a CRD is usable a
    /// moment after its creation.
    pub fn wait_served(&self, path: &str) {
        wait_until(&format!("{path} served"), READY_TIMEOUT, || {
            (self.request("GET", path, "", None).code == 200).then_some(())
        });
    }
}

/// The documents of a multi-document YAML text.
fn split_yaml(text: &str) -> Vec<String> {
    let mut docs = vec![String::new()];
    for line in text.lines() {
        if line.trim_end() == "---" {
            docs.push(String::new());
        } else {
            let d = docs.last_mut().unwrap();
            d.push_str(line);
            d.push('\n');
        }
    }
    docs.retain(|d| top_level(d, "kind").is_some());
    docs
}

/// `key: value` at column 0.
fn top_level(doc: &str, key: &str) -> Option<String> {
    doc.lines().find_map(|l| {
        l.strip_prefix(key)
            .and_then(|r| r.strip_prefix(':'))
            .map(|v| v.trim().to_string())
    })
}

/// `  key: value` directly under `metadata:`.
fn metadata_field(doc: &str, key: &str) -> Option<String> {
    let mut in_meta = false;
    for l in doc.lines() {
        if !l.starts_with(' ') {
            in_meta = l.trim_end() == "metadata:";
            continue;
        }
        if in_meta {
            if let Some(v) = l
                .strip_prefix("  ")
                .and_then(|r| r.strip_prefix(key))
                .and_then(|r| r.strip_prefix(':'))
            {
                return Some(v.trim().to_string());
            }
        }
    }
    None
}

/// Standard base64 with padding.
pub fn base64(data: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(T[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

impl Drop for RealApiServer {
    fn drop(&mut self) {
        if let Some(s) = self.server.take() {
            s.stop();
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn base64_pads() {
        assert_eq!(super::base64(b"ab"), "YWI=");
        assert_eq!(super::base64(b"abc"), "YWJj");
        assert_eq!(super::base64(b"a"), "YQ==");
    }
}
