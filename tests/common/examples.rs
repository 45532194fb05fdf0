#![allow(dead_code)]
//! The shipped conflists (`conf-examples/`) as tests use them: loaded unchanged, then only
//! their site-specific values pointed at the test world (datastore address and credentials,
//! node name, log and lock files, host-local's data dir); every other field is the example's
//! own.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::world::NODE;

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
pub fn load_for_etcd_world(name: &str, w: &super::world::World) -> Value {
    let mut list = load(name);
    localize(
        &mut list,
        &Site {
            etcd_endpoint: Some(w.etcd.endpoint()),
            kubeconfig: None,
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
