#![allow(dead_code)]
//! The shipped conflists (`conf-examples/`) as tests use them: loaded unchanged, then only
//! their site-specific values pointed at the test world (datastore address and credentials,
//! node name, log and lock files, host-local's data dir); every other field is the example's
//! own.
//!
//! Also the CNI templates of Calico v3.32.1's manifests (kept in `shared/k8s` beside the
//! clone) and the text upstream's node installer makes of one, which the examples taken from
//! a manifest and our `install` are held to.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::peers::shared_k8s_file;
use super::world::NODE;

/// The folder of `shared/k8s` holding each manifest's `cni_network_config`, unchanged, as
/// `<manifest>.json.tmpl`.
pub const TEMPLATES_DIR: &str = "cni-network-config-v3.32.1";

/// Every manifest of Calico v3.32.1 that carries a CNI template.
pub const TEMPLATES: [&str; 8] = [
    "calico.json.tmpl",
    "calico-bpf.json.tmpl",
    "calico-etcd.json.tmpl",
    "calico-policy-only.json.tmpl",
    "calico-typha.json.tmpl",
    "calico-vxlan.json.tmpl",
    "canal.json.tmpl",
    "canal-etcd.json.tmpl",
];

/// A manifest's template, as its text, or why it is not there.
pub fn template(name: &str) -> Result<String, String> {
    let path = shared_k8s_file(&format!("{TEMPLATES_DIR}/{name}"))?;
    std::fs::read_to_string(&path).map_err(|e| format!("read {}: {e}", path.display()))
}

/// The `install-cni` container's environment on the node the manifest examples are filled
/// in for: what the manifests set there (`KUBERNETES_NODE_NAME` from `spec.nodeName`,
/// `CNI_MTU` from the ConfigMap's `veth_mtu`, which every v3.32.1 manifest ships as "0",
/// `ETCD_ENDPOINTS` from `etcd_endpoints`, a site value in `calico-etcd.yaml`) and what
/// kubelet sets in every pod (the API service's address). With it, the `calico-etcd-secrets`
/// Secret holds the three etcd TLS files ([`TYPICAL_NODE_ETCD_TLS`]).
pub const TYPICAL_NODE: &[(&str, &str)] = &[
    ("KUBERNETES_NODE_NAME", "node-1"),
    ("CNI_MTU", "0"),
    ("ETCD_ENDPOINTS", "https://10.0.0.10:2379"),
    ("KUBERNETES_SERVICE_HOST", "10.96.0.1"),
    ("KUBERNETES_SERVICE_PORT", "443"),
];

/// Whether the etcd TLS files are mounted on the typical node.
pub const TYPICAL_NODE_ETCD_TLS: bool = true;

/// What upstream's installer (v3.32.1, `cni-plugin/pkg/install`) writes for `template` run
/// with the environment `env` (a variable absent from it is unset; one set to "" stays ""),
/// the etcd TLS files copied from the secrets mount or not, this `hostname` and the mounted
/// service-account token (empty outside a pod). Each `__NAME__` is replaced, everywhere and
/// in this order, by:
/// - `LOG_LEVEL`, `LOG_FILE_PATH`, `LOG_FILE_MAX_SIZE`, `LOG_FILE_MAX_AGE`,
///   `LOG_FILE_MAX_COUNT`, `DATASTORE_TYPE`: the variable, else `info`,
///   `/var/log/calico/cni/cni.log`, `100`, `30`, `10`, `kubernetes`;
/// - `KUBERNETES_NODE_NAME`: the variable, else the host name, lower-cased;
/// - `KUBECONFIG_FILEPATH`: `$CNI_NET_DIR/calico-kubeconfig` (`CNI_NET_DIR` defaults to
///   `/etc/cni/net.d`);
/// - `CNI_MTU`: the variable, else `1500`;
/// - `KUBERNETES_SERVICE_HOST`, `KUBERNETES_SERVICE_PORT`: the variable, else empty;
/// - `SERVICEACCOUNT_TOKEN`: the token; `CALICO_API_GROUP`: the variable, else
///   `crd.projectcalico.org/v1`;
/// - `ETCD_CERT_FILE`, `ETCD_CA_CERT_FILE`, `ETCD_KEY_FILE`:
///   `$CNI_NET_DIR/calico-tls/etcd-{cert,ca,key}` when copied, else empty;
/// - `ETCD_ENDPOINTS`, `ETCD_DISCOVERY_SRV`: the variable, else empty;
/// - `REQUIRE_MTU_FILE`: the variable, else `false`.
///
/// The text is written as it then is: no reformatting, no trailing newline added.
pub fn render_as_upstream(
    template: &str,
    env: &[(&str, &str)],
    etcd_tls: bool,
    hostname: &str,
    token: &str,
) -> String {
    let var = |name: &str, default: &str| -> String {
        env.iter()
            .rev()
            .find(|(k, _)| *k == name)
            .map_or(default, |(_, v)| *v)
            .to_string()
    };
    let net_dir = var("CNI_NET_DIR", "/etc/cni/net.d");
    let tls = |file: &str| {
        if etcd_tls {
            format!("{net_dir}/calico-tls/{file}")
        } else {
            String::new()
        }
    };
    let order: Vec<(&str, String)> = vec![
        ("__LOG_LEVEL__", var("LOG_LEVEL", "info")),
        (
            "__LOG_FILE_PATH__",
            var("LOG_FILE_PATH", "/var/log/calico/cni/cni.log"),
        ),
        ("__LOG_FILE_MAX_SIZE__", var("LOG_FILE_MAX_SIZE", "100")),
        ("__LOG_FILE_MAX_AGE__", var("LOG_FILE_MAX_AGE", "30")),
        ("__LOG_FILE_MAX_COUNT__", var("LOG_FILE_MAX_COUNT", "10")),
        ("__DATASTORE_TYPE__", var("DATASTORE_TYPE", "kubernetes")),
        (
            "__KUBERNETES_NODE_NAME__",
            var("KUBERNETES_NODE_NAME", &hostname.trim().to_lowercase()),
        ),
        (
            "__KUBECONFIG_FILEPATH__",
            format!("{net_dir}/calico-kubeconfig"),
        ),
        ("__CNI_MTU__", var("CNI_MTU", "1500")),
        (
            "__KUBERNETES_SERVICE_HOST__",
            var("KUBERNETES_SERVICE_HOST", ""),
        ),
        (
            "__KUBERNETES_SERVICE_PORT__",
            var("KUBERNETES_SERVICE_PORT", ""),
        ),
        ("__SERVICEACCOUNT_TOKEN__", token.to_string()),
        (
            "__CALICO_API_GROUP__",
            var("CALICO_API_GROUP", "crd.projectcalico.org/v1"),
        ),
        ("__ETCD_CERT_FILE__", tls("etcd-cert")),
        ("__ETCD_CA_CERT_FILE__", tls("etcd-ca")),
        ("__ETCD_KEY_FILE__", tls("etcd-key")),
        ("__ETCD_ENDPOINTS__", var("ETCD_ENDPOINTS", "")),
        ("__ETCD_DISCOVERY_SRV__", var("ETCD_DISCOVERY_SRV", "")),
        ("__REQUIRE_MTU_FILE__", var("REQUIRE_MTU_FILE", "false")),
    ];
    order
        .into_iter()
        .fold(template.to_string(), |text, (k, v)| text.replace(k, &v))
}

/// The `__NAME__` placeholders left in `text` (upper case, digits and `_` between double
/// underscores).
pub fn placeholders_left(text: &str) -> Vec<String> {
    let mut left = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find("__") {
        let after = &rest[start + 2..];
        let name_len = after
            .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(after.len());
        let name = &after[..name_len];
        match name.strip_suffix("__") {
            Some(inner) if !inner.is_empty() => {
                left.push(format!("__{name}"));
                rest = &after[name_len..];
            }
            _ => rest = after,
        }
    }
    left
}

/// conf-examples/ in this source tree.
pub fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("conf-examples")
}

/// Every `*.conflist` in conf-examples/, sorted by name.
pub fn all() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir())
        .expect("read conf-examples/")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "conflist"))
        .collect();
    v.sort();
    v
}

/// One example, parsed.
pub fn load(name: &str) -> Value {
    let path = dir().join(name);
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()))
}

/// Where the test world keeps what an example leaves to the site.
pub struct Site {
    /// The test etcd's client URL (plain http: the examples' TLS files are dropped).
    pub etcd_endpoint: Option<String>,
    /// The test API server's kubeconfig.
    pub kubeconfig: Option<PathBuf>,
    /// Log file, IPAM lock and host-local data go here.
    pub scratch: PathBuf,
}

/// The `calico` plugin objects of a conflist.
pub fn calico_plugins(list: &mut Value) -> Vec<&mut Value> {
    list["plugins"]
        .as_array_mut()
        .expect("plugins array")
        .iter_mut()
        .filter(|p| p["type"] == "calico")
        .collect()
}

/// Points `list`'s calico plugins at `site`. Panics when an example needs a datastore the
/// site does not have.
pub fn localize(list: &mut Value, site: &Site) {
    for p in calico_plugins(list) {
        let obj = p.as_object_mut().expect("plugin object");
        if obj.contains_key("etcd_endpoints") {
            let ep = site
                .etcd_endpoint
                .as_ref()
                .expect("an etcd example needs an etcd site");
            obj.insert("etcd_endpoints".into(), json!(ep));
            for k in ["etcd_key_file", "etcd_cert_file", "etcd_ca_cert_file"] {
                obj.remove(k);
            }
        }
        if let Some(k8s) = obj.get_mut("kubernetes").and_then(Value::as_object_mut) {
            if k8s.contains_key("kubeconfig") {
                let kc = site
                    .kubeconfig
                    .as_ref()
                    .expect("a kubernetes example needs an API server site");
                k8s.insert("kubeconfig".into(), json!(kc.display().to_string()));
            }
        }
        // On a real node calico/node writes /var/lib/calico/nodename (which ADD requires
        // unless told otherwise); here the node's name comes from the config.
        obj.insert("nodename".into(), json!(NODE));
        obj.insert("nodename_file_optional".into(), json!(true));
        obj.insert(
            "log_file_path".into(),
            json!(site.scratch.join("cni.log").display().to_string()),
        );
        obj.insert(
            "ipam_lock_file".into(),
            json!(site.scratch.join("ipam.lock").display().to_string()),
        );
        if let Some(ipam) = obj.get_mut("ipam").and_then(Value::as_object_mut) {
            if ipam.get("type").and_then(Value::as_str) == Some("host-local") {
                ipam.insert(
                    "dataDir".into(),
                    json!(site.scratch.join("host-local").display().to_string()),
                );
            }
        }
    }
}

/// Writes `list` to `<dir>/<name>` and returns the path.
/// Example `name`, localized for a test world's etcd and scratch directory.
pub fn load_for_etcd_world(
    name: &str,
    w: &super::world::World,
    kubeconfig: Option<PathBuf>,
) -> Value {
    let mut list = load(name);
    localize(
        &mut list,
        &Site {
            etcd_endpoint: Some(w.etcd.endpoint()),
            kubeconfig,
            scratch: w.scratch.path().to_path_buf(),
        },
    );
    list
}

pub fn write(dir: &Path, name: &str, list: &Value) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(
        &path,
        serde_json::to_vec_pretty(list).expect("serialise conflist"),
    )
    .unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    path
}
