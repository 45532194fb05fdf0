//! The `calico-kubeconfig` the installer leaves for the plugin: the API server as the pod sees
//! it (`KUBERNETES_SERVICE_PROTOCOL://HOST:PORT`), the cluster CA from the service-account
//! mount (or `insecure-skip-tls-verify` with `SKIP_TLS_VERIFY=true`), and a token for the CNI
//! plugin's own service account from the TokenRequest API (24 h, as upstream asks), falling
//! back to the pod's mounted token only where the server has no TokenRequest API. Tokens are
//! never logged.

use std::path::{Path, PathBuf};
use std::time::Duration;

use http::Method;
use serde_json::{json, Value};

use super::InstallError;
use crate::datastore::kubernetes::client::{KubeClient, KubeSettings};
use crate::datastore::DatastoreError;

/// Upstream's validity of the CNI token: a day (calico-node refreshes it after that).
const TOKEN_VALIDITY_SECONDS: u64 = 24 * 60 * 60;
/// Upstream's default CNI service account (`CALICO_CNI_SERVICE_ACCOUNT` overrides it).
const DEFAULT_SERVICE_ACCOUNT: &str = "calico-cni-plugin";
/// Each API request's bound.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// The pod's view of the API server and its service-account mount (client-go's in-cluster
/// configuration).
pub struct InCluster {
    pub host: String,
    pub port: String,
    /// The mounted token.
    pub token: String,
    /// The mounted CA bundle (`ca.crt`), when present.
    pub ca_file: Option<PathBuf>,
    /// The mounted `namespace`: where the CNI service account lives.
    pub namespace: String,
}

impl InCluster {
    /// Reads the service-account mount at `dir`; `None` when it holds no token (not running
    /// as a Kubernetes pod, so no kubeconfig is written, as upstream).
    pub fn load(
        dir: &Path,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Option<InCluster>, InstallError> {
        let token_file = dir.join("token");
        if !token_file.is_file() {
            return Ok(None);
        }
        let read = |name: &str| {
            let path = dir.join(name);
            std::fs::read_to_string(&path).map_err(|source| InstallError::Io {
                what: "reading the service-account mount",
                path,
                source,
            })
        };
        let (host, port) = (
            env("KUBERNETES_SERVICE_HOST").unwrap_or_default(),
            env("KUBERNETES_SERVICE_PORT").unwrap_or_default(),
        );
        if host.is_empty() || port.is_empty() {
            return Err(InstallError::Refused(
                "unable to load in-cluster configuration, KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT must be defined".into(),
            ));
        }
        let ca = dir.join("ca.crt");
        Ok(Some(InCluster {
            host,
            port,
            token: read("token")?,
            ca_file: ca.is_file().then_some(ca),
            namespace: read("namespace")?.trim().to_string(),
        }))
    }

    /// `host:port`, with brackets around an IPv6 host (Go's `net.JoinHostPort`).
    fn endpoint(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// Asks the API server for the CNI plugin's token. The client is `KUBECONFIG`'s when set,
/// else the pod's own (upstream's `BuildClientSet`).
pub async fn cni_token(
    pod: &InCluster,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<String, InstallError> {
    let settings = match env("KUBECONFIG").filter(|k| !k.is_empty()) {
        Some(kubeconfig) => KubeSettings {
            kubeconfig,
            ..Default::default()
        },
        None => KubeSettings {
            server: format!("https://{}", pod.endpoint()),
            token: pod.token.trim().to_string(),
            ca_file: pod
                .ca_file
                .as_ref()
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_default(),
            ..Default::default()
        },
    };
    let account = env("CALICO_CNI_SERVICE_ACCOUNT")
        .filter(|a| !a.is_empty())
        .unwrap_or_else(|| DEFAULT_SERVICE_ACCOUNT.to_string());
    let client = KubeClient::new(&settings, REQUEST_TIMEOUT)
        .await
        .map_err(InstallError::Token)?;
    let path = format!(
        "/api/v1/namespaces/{}/serviceaccounts/{account}/token",
        pod.namespace
    );
    let request = json!({
        "kind": "TokenRequest",
        "apiVersion": "authentication.k8s.io/v1",
        "spec": {"audiences": [], "expirationSeconds": TOKEN_VALIDITY_SECONDS},
    });
    let resp = client
        .send_json(Method::POST, &path, "application/json", &request)
        .await
        .map_err(InstallError::Token)?;
    if resp.status == 404 && !token_request_supported(&client).await {
        tracing::info!("the API server has no TokenRequest API: using the pod's own token");
        return Ok(pod.token.trim().to_string());
    }
    if !resp.ok() {
        let status = resp.status_object();
        return Err(InstallError::Token(DatastoreError::Other(format!(
            "TokenRequest for serviceaccount {}/{account}: {} {}",
            pod.namespace, resp.status, status.message
        ))));
    }
    let body = resp.json().map_err(InstallError::Token)?;
    match body.pointer("/status/token").and_then(Value::as_str) {
        Some(t) if !t.is_empty() => Ok(t.to_string()),
        _ => Err(InstallError::Token(DatastoreError::Other(
            "TokenRequest answered without a token".into(),
        ))),
    }
}

/// Whether the core API lists `serviceaccounts/token` (upstream's discovery check).
async fn token_request_supported(client: &KubeClient) -> bool {
    let Ok(resp) = client.get("/api/v1").await else {
        return false;
    };
    let Ok(list) = resp.json() else {
        return false;
    };
    list["resources"]
        .as_array()
        .is_some_and(|rs| rs.iter().any(|r| r["name"] == "serviceaccounts/token"))
}

/// The kubeconfig text, in upstream's layout.
pub fn render(
    pod: &InCluster,
    token: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<String, InstallError> {
    let protocol = env("KUBERNETES_SERVICE_PROTOCOL")
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| "https".into());
    let tls = if env("SKIP_TLS_VERIFY").as_deref() == Some("true") {
        "insecure-skip-tls-verify: true".to_string()
    } else {
        let ca = match &pod.ca_file {
            Some(path) => std::fs::read(path).map_err(|source| InstallError::Io {
                what: "reading the cluster CA",
                path: path.clone(),
                source,
            })?,
            None => Vec::new(),
        };
        format!("certificate-authority-data: {}", base64_std(&ca))
    };
    Ok(format!(
        "# Kubeconfig file for Calico CNI plugin.
apiVersion: v1
kind: Config
clusters:
- name: local
  cluster:
    server: {protocol}://{endpoint}
    {tls}
users:
- name: calico
  user:
    token: {token}
contexts:
- name: calico-context
  context:
    cluster: local
    user: calico
current-context: calico-context
",
        endpoint = pod.endpoint(),
    ))
}

pub use crate::support::encoding::base64_std;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubeconfig_layout() {
        let pod = InCluster {
            host: "fd00::1".into(),
            port: "443".into(),
            token: "mounted".into(),
            ca_file: None,
            namespace: "kube-system".into(),
        };
        let text = render(&pod, "cni-token", &|k| {
            (k == "SKIP_TLS_VERIFY").then(|| "true".to_string())
        })
        .unwrap();
        assert!(text
            .contains("    server: https://[fd00::1]:443\n    insecure-skip-tls-verify: true\n"));
        assert!(text.contains("    token: cni-token\n"));
        assert!(text.ends_with("current-context: calico-context\n"));
        let text = render(&pod, "t", &|k| {
            (k == "KUBERNETES_SERVICE_PROTOCOL").then(|| "http".into())
        })
        .unwrap();
        assert!(text.contains("server: http://[fd00::1]:443\n    certificate-authority-data: \n"));
    }
}
