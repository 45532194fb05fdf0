//! Calico's network configuration (`NetConf`, cni-plugin/pkg/types) with upstream defaults,
//! plus the values derived from it and the host: node name, MTU, datastore settings.
//!
//! Go's `encoding/json` matches keys case-insensitively and ignores unknown keys; we fold
//! key case for the known fields before decoding, and serde ignores the rest.
//!
//! The serde structs below are the one declaration of the fields: the keys folded are read
//! off them (`fields`), and a test ties Go's type schema (`gotypes`) to them.

mod fields;
pub(crate) mod gotypes;
pub mod identifiers;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::support::gocompat::path_error;
use fields::Shape;

pub const DEFAULT_NODENAME_FILE: &str = "/var/lib/calico/nodename";
pub const MTU_FILE: &str = "/var/lib/calico/mtu";
pub const DEFAULT_IPAM_LOCK_FILE: &str = "/var/run/calico/ipam.lock";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// stdin that is not JSON, or does not decode as a NetConf.
    #[error("failed to load netconf: {0}")]
    Json(#[source] serde_json::Error),
    /// A field of a type Go's decoder refuses (its text, `gotypes::check_netconf`).
    #[error("failed to load netconf: {0}")]
    FieldType(String),
    #[error("stat {0}: no such file or directory: check that the calico/node container is running and has mounted /var/lib/calico/")]
    NodenameFileMissing(String),
    #[error("failed to read MTU file: {0}")]
    MtuFile(#[source] std::io::Error),
    /// `require_mtu_file` and no file: Go's `open <file>: <errno text>`.
    #[error("failed to read MTU file: {}", path_error("open", .file, .source))]
    MtuFileMissing {
        file: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("failed to read MTU file: {0}")]
    MtuValue(#[source] crate::support::gocompat::NumError),
    /// A negative `policy_setup_timeout_seconds`.
    #[error("invalid pod startup delay of {0}")]
    PodStartupDelay(i64),
    #[error("invalid characters detected in the given network name. Only letters a-z, numbers 0-9, and symbols _.- are supported")]
    NetworkName,
    #[error("{0}")]
    Datastore(String),
    #[error("invalid dataplane type: {0}")]
    DataplaneType(String),
    #[error("GRPC dataplane socket not configured")]
    GrpcSocket,
    #[error("invalid GRPC dataplane socket {socket:?}: {reason}")]
    GrpcAddress { socket: String, reason: String },
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct NetConf {
    /// Not read: skel takes `cniVersion` from stdin itself (version checks, result format).
    #[serde(rename = "cniVersion")]
    pub cni_version: String,
    pub name: String,
    /// Not read: the binary's name, not this, selects the plugin.
    #[serde(rename = "type")]
    pub plugin_type: String,
    pub mtu: i64,
    pub num_queues: i64,
    pub nodename: String,
    pub nodename_file: String,
    pub nodename_file_optional: bool,
    pub hostname: String,
    pub require_mtu_file: bool,
    pub datastore_type: String,
    pub etcd_endpoints: String,
    pub etcd_discovery_srv: String,
    pub etcd_key_file: String,
    pub etcd_cert_file: String,
    pub etcd_ca_cert_file: String,
    /// Accepted for upstream's conflists, not read: a libcalico-go v1 setting that upstream's
    /// NetConf still declares and its v3 datastore client does not use.
    pub etcd_scheme: String,
    /// As `etcd_scheme` (upstream marks it deprecated).
    pub etcd_authority: String,
    pub kubernetes: KubernetesConf,
    pub policy: PolicyConf,
    pub ipam: IpamConf,
    pub include_default_routes: bool,
    pub ipam_lock_file: String,
    pub log_level: String,
    pub log_file_path: String,
    /// The log file is rotated when it would grow past this many MiB (0: 100; below 0 it is
    /// never written), as upstream's timberjack (`logging::rotate`).
    pub log_file_max_size: i64,
    /// Rotated log files older than this many days are removed (0: 30; below 0: none).
    pub log_file_max_age: i64,
    /// Rotated log files of more than this many rotations are removed (0: 10; below 0:
    /// none).
    pub log_file_max_count: i64,
    pub feature_control: FeatureControl,
    pub container_settings: ContainerSettings,
    pub readiness_gates: Vec<String>,
    pub policy_setup_timeout_seconds: i64,
    /// The whole call's deadline in seconds (0: the default; `crate::support::deadline`).
    pub call_timeout_seconds: i64,
    pub endpoint_status_dir: String,
    pub dataplane_options: Option<Map<String, Value>>,
    pub args: Value,
    pub calico_api_group: String,
    /// The Kubernetes datastore client's requests a second once its burst is spent, when
    /// not 0; exported as upstream exports it, as `K8S_CLIENT_QPS` (`datastore::settings`,
    /// `datastore::kubernetes::ratelimit`; default 5).
    pub qps: i64,
    /// That client's burst, when not 0 (`K8S_CLIENT_BURST`; default 100).
    pub burst: i64,
    /// Accepted for upstream's conflists, not read: upstream's untagged `RuntimeConfig`
    /// (DNS settings, used by its Windows dataplane only). `prevResult` is read from stdin
    /// by CHECK itself, so it has no field here.
    #[serde(rename = "RuntimeConfig")]
    pub runtime_config: Option<Value>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct KubernetesConf {
    pub kubeconfig: String,
    pub k8s_api_root: String,
    pub node_name: String,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct PolicyConf {
    #[serde(rename = "type")]
    pub policy_type: String,
    pub k8s_api_root: String,
    pub k8s_auth_token: String,
    pub k8s_client_certificate: String,
    pub k8s_client_key: String,
    pub k8s_certificate_authority: String,
}

/// Which IPAM the NetConf names: what the steps that depend on it (pool annotations, the
/// expected families, routes, host-local's pod CIDR) ask, instead of comparing strings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IpamKind {
    /// No `ipam.type`.
    None,
    /// `calico-ipam`, in-process or not: its addresses live in the Calico datastore.
    Calico,
    /// `host-local`, which knows `usePodCidr`.
    HostLocal,
    Other,
}

impl IpamKind {
    pub fn of(ipam_type: &str) -> IpamKind {
        match ipam_type {
            "" => IpamKind::None,
            "calico-ipam" => IpamKind::Calico,
            "host-local" => IpamKind::HostLocal,
            _ => IpamKind::Other,
        }
    }
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct IpamConf {
    #[serde(rename = "type")]
    pub ipam_type: String,
    pub assign_ipv4: Option<String>,
    pub assign_ipv6: Option<String>,
    pub ipv4_pools: Vec<String>,
    pub ipv6_pools: Vec<String>,
    /// Not read here: host-local's `subnet` (and `ranges`, which has no field) are rewritten
    /// from the raw stdin when calico hands it to host-local (`delegate::exec`).
    pub subnet: String,
    /// host-local's routes (k8s.go's pod routes); not in upstream's Go struct, which reads
    /// them from the raw IPAM config.
    pub routes: Option<Value>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct FeatureControl {
    pub ip_addrs_no_ipam: bool,
    pub floating_ips: bool,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct ContainerSettings {
    pub allow_ip_forwarding: bool,
}

/// The fields of `NetConf`, nested structs included, as serde decodes them.
fn netconf_fields() -> &'static [(&'static str, Shape)] {
    static SHAPE: OnceLock<Shape> = OnceLock::new();
    SHAPE.get_or_init(fields::shape_of::<NetConf>).fields()
}

/// Renames keys that match a field name case-insensitively, in nested structs too. Go's
/// decoder takes the object's keys in order, each (an exact or a case-insensitive match)
/// decoded into the field over what an earlier one put there: the last of them wins.
fn fold_keys(obj: &mut Map<String, Value>, fields: &[(&'static str, Shape)]) {
    for (name, _) in fields {
        let matching: Vec<String> = obj
            .keys()
            .filter(|k| k.eq_ignore_ascii_case(name))
            .cloned()
            .collect();
        let Some(last) = matching.last().cloned() else {
            continue;
        };
        let value = obj.remove(&last);
        for k in &matching {
            obj.remove(k);
        }
        if let Some(v) = value {
            obj.insert((*name).to_string(), v);
        }
    }
    for (name, shape) in fields {
        // A field that is no struct has no fields: nothing to fold inside it.
        if let Some(Value::Object(inner)) = obj.get_mut(*name) {
            fold_keys(inner, shape.fields());
        }
    }
}

impl NetConf {
    /// Decodes stdin the way upstream's `json.Unmarshal` into `types.NetConf` does.
    pub fn parse(data: &[u8]) -> Result<NetConf, ConfigError> {
        let mut v: Value = serde_json::from_slice(data).map_err(ConfigError::Json)?;
        gotypes::check_netconf(&v).map_err(ConfigError::FieldType)?;
        if let Value::Object(obj) = &mut v {
            fold_keys(obj, netconf_fields());
            // Go decodes JSON null into a struct field as "leave it zero".
            obj.retain(|_, v| !v.is_null());
        }
        serde_json::from_value(v).map_err(ConfigError::Json)
    }

    /// IPv4 assignment unless `ipam.assign_ipv4` is exactly "false".
    pub fn assign_ipv4(&self) -> bool {
        self.ipam.assign_ipv4.as_deref() != Some("false")
    }

    /// IPv6 assignment only when `ipam.assign_ipv6` is exactly "true".
    pub fn assign_ipv6(&self) -> bool {
        self.ipam.assign_ipv6.as_deref() == Some("true")
    }

    pub fn num_queues(&self) -> u32 {
        if self.num_queues <= 0 {
            1
        } else {
            u32::try_from(self.num_queues).unwrap_or(1)
        }
    }

    pub fn ipam_lock_file(&self) -> &str {
        if self.ipam_lock_file.is_empty() {
            DEFAULT_IPAM_LOCK_FILE
        } else {
            &self.ipam_lock_file
        }
    }

    pub fn nodename_file(&self) -> &str {
        if self.nodename_file.is_empty() {
            DEFAULT_NODENAME_FILE
        } else {
            &self.nodename_file
        }
    }

    /// The network name's own rule (skel's stricter check normally fires first).
    pub fn validate_name(&self) -> Result<(), ConfigError> {
        let ok = !self.name.is_empty()
            && self
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.' || b == b'-');
        ok.then_some(()).ok_or(ConfigError::NetworkName)
    }

    /// Whether `dataplane_options` choose the gRPC dataplane (`dataplane::grpc`).
    pub fn uses_grpc_dataplane(&self) -> bool {
        self.dataplane_options
            .as_ref()
            .and_then(|o| o.get("type"))
            .and_then(Value::as_str)
            == Some("grpc")
    }

    /// `dataplane_options` as upstream's `GetDataplane`: without a `type` the Linux
    /// dataplane; `grpc` needs a `socket` that names a target (`grpc_target`); any other
    /// type is refused.
    pub fn check_dataplane(&self) -> Result<(), ConfigError> {
        let Some(opts) = &self.dataplane_options else {
            return Ok(());
        };
        let Some(kind) = opts.get("type") else {
            return Ok(());
        };
        if kind.as_str() != Some("grpc") {
            return Err(ConfigError::DataplaneType(go_percent_s(kind)));
        }
        match opts.get("socket").and_then(Value::as_str) {
            Some(socket) => grpc_target(socket).map(drop),
            None => Err(ConfigError::GrpcSocket),
        }
    }

    /// The nodename-file gate of `calico` (`nodename_file_optional` lifts it). ADD waits
    /// for the file first (`plugin::nodename`); DEL goes on without it.
    pub fn check_nodename_file(&self) -> Result<(), ConfigError> {
        if self.nodename_file_passes() {
            Ok(())
        } else {
            Err(ConfigError::NodenameFileMissing(
                self.nodename_file().to_string(),
            ))
        }
    }

    /// Whether the nodename-file gate passes now: the file exists, or it is optional.
    pub fn nodename_file_passes(&self) -> bool {
        self.nodename_file_optional || Path::new(self.nodename_file()).exists()
    }

    /// Node name: `nodename` > nodename file > `hostname` > OS hostname (lower-cased).
    /// Unlike upstream we trim the file's trailing whitespace: a newline is never part of a
    /// node name.
    pub fn node_name(&self) -> String {
        if !self.nodename.is_empty() {
            return self.nodename.clone();
        }
        if let Ok(s) = crate::support::input_file::read_to_string(Path::new(self.nodename_file())) {
            let s = s.trim();
            if !s.is_empty() {
                return s.to_string();
            }
        }
        if !self.hostname.is_empty() {
            tracing::warn!(
                "Configuration option 'hostname' is deprecated, use 'nodename' instead."
            );
            return self.hostname.clone();
        }
        nix::unistd::gethostname()
            .ok()
            .and_then(|h| h.into_string().ok())
            .map(|h| h.trim().to_lowercase())
            .unwrap_or_default()
    }

    /// The veth MTU: `mtu`, else /var/lib/calico/mtu, else 0 (kernel default).
    pub fn resolve_mtu(&self) -> Result<u32, ConfigError> {
        self.resolve_mtu_from(Path::new(MTU_FILE))
    }

    pub fn resolve_mtu_from(&self, file: &Path) -> Result<u32, ConfigError> {
        let from_file = match crate::support::input_file::read_to_string(file) {
            Ok(s) => Some(crate::support::gocompat::atoi(s.trim()).map_err(ConfigError::MtuValue)?),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if self.require_mtu_file {
                    return Err(ConfigError::MtuFileMissing {
                        file: file.to_path_buf(),
                        source: e,
                    });
                }
                None
            }
            Err(e) => return Err(ConfigError::MtuFile(e)),
        };
        // A negative MTU is upstream's "configured": the file is not used, and nothing is
        // set (the kernel's default stays).
        if self.mtu != 0 {
            return Ok(u32::try_from(self.mtu).unwrap_or(0));
        }
        Ok(from_file.and_then(|m| u32::try_from(m).ok()).unwrap_or(0))
    }

    /// The labels of `args.org.apache.mesos.network_info.labels.labels`, keys and values
    /// sanitized, in order (a later key wins). A label whose key is exactly
    /// `projectcalico.org/namespace`, as given (before sanitizing, as upstream matches it),
    /// names the endpoint's namespace instead.
    pub fn mesos_labels(&self) -> MesosLabels {
        let mut out = MesosLabels::default();
        let labels = self
            .args
            .pointer("/org.apache.mesos/network_info/labels/labels")
            .and_then(Value::as_array);
        for l in labels.into_iter().flatten() {
            if let (Some(k), Some(v)) = (
                l.get("key").and_then(Value::as_str),
                l.get("value").and_then(Value::as_str),
            ) {
                if k == MESOS_NAMESPACE_LABEL {
                    out.namespace = Some(sanitize_label(v));
                } else {
                    out.labels.insert(sanitize_label(k), sanitize_label(v));
                }
            }
        }
        out
    }
}

/// The Mesos label whose value is the endpoint's namespace.
const MESOS_NAMESPACE_LABEL: &str = "projectcalico.org/namespace";

/// What a Mesos task's labels give its endpoint.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MesosLabels {
    /// From the `projectcalico.org/namespace` label.
    pub namespace: Option<String>,
    /// The others.
    pub labels: BTreeMap<String, String>,
}

/// Upstream's Mesos label sanitiser: `/`→`.`, each run of other invalid characters→one `-`,
/// runs of `.`/`-` containing a `.` collapse to `.`, leading/trailing `.`/`-` trimmed.
fn sanitize_label(s: &str) -> String {
    let valid = |c: char| c.is_ascii_alphanumeric() || c == '.' || c == '-' || c == '_';
    let mut mapped = String::with_capacity(s.len());
    let mut in_invalid_run = false;
    for c in s.chars() {
        let invalid = c != '/' && !valid(c);
        if !invalid {
            mapped.push(if c == '/' { '.' } else { c });
        } else if !in_invalid_run {
            mapped.push('-');
        }
        in_invalid_run = invalid;
    }
    let mut out = String::new();
    let mut run = String::new();
    for c in mapped.chars() {
        if c == '.' || c == '-' {
            run.push(c);
            continue;
        }
        if !run.is_empty() {
            out.push_str(if run.contains('.') { "." } else { &run });
            run.clear();
        }
        out.push(c);
    }
    if !run.is_empty() {
        out.push_str(if run.contains('.') { "." } else { &run });
    }
    out.trim_matches(|c| c == '.' || c == '-').to_string()
}

/// Where the gRPC dataplane listens, as grpc-go reads a target with upstream's default
/// scheme `passthrough`: `unix:///path` and `unix:path` are a Unix socket; `dns:///host:port`
/// and `passthrough:///addr` are a TCP address; anything else (`host:port`, and a bare path,
/// which then fails to dial) is handed to TCP as it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GrpcTarget {
    Unix(PathBuf),
    Tcp(String),
}

/// The `socket` option as a target (see [`GrpcTarget`]). `unix://host/path` (an authority)
/// and `unix-abstract:` are refused, before IPAM.
pub fn grpc_target(socket: &str) -> Result<GrpcTarget, ConfigError> {
    let refuse = |reason: &str| ConfigError::GrpcAddress {
        socket: socket.to_string(),
        reason: reason.to_string(),
    };
    let path = if let Some(rest) = socket.strip_prefix("unix://") {
        if !rest.starts_with('/') {
            return Err(refuse(
                "a unix:// address takes an absolute path (unix:///path) and no authority",
            ));
        }
        rest
    } else if let Some(rest) = socket.strip_prefix("unix:") {
        rest
    } else if socket.starts_with("unix-abstract:") {
        return Err(refuse("abstract Unix sockets are not supported"));
    } else {
        let addr = ["dns:///", "passthrough:///"]
            .iter()
            .find_map(|p| socket.strip_prefix(p))
            .unwrap_or(socket);
        return Ok(GrpcTarget::Tcp(addr.to_string()));
    };
    if path.is_empty() {
        return Err(refuse("no socket path"));
    }
    Ok(GrpcTarget::Unix(PathBuf::from(path)))
}

/// Go's `%s` of a decoded JSON value (`any`): strings as they are, maps and slices by their
/// elements, anything else as Go's bad-verb text (`%!s(float64=5)`).
fn go_percent_s(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "%!s(<nil>)".into(),
        Value::Bool(b) => format!("%!s(bool={b})"),
        Value::Number(n) => format!("%!s(float64={})", go_float(n)),
        Value::Array(a) => format!(
            "[{}]",
            a.iter().map(go_percent_s).collect::<Vec<_>>().join(" ")
        ),
        Value::Object(o) => {
            let mut keys: Vec<&String> = o.keys().collect();
            keys.sort();
            let items: Vec<String> = keys
                .into_iter()
                .map(|k| format!("{k}:{}", go_percent_s(&o[k])))
                .collect();
            format!("map[{}]", items.join(" "))
        }
    }
}

/// Go's `%v` of a float64 (`strconv.FormatFloat(f, 'g', -1, 64)`, with Go's exponent form).
fn go_float(n: &serde_json::Number) -> String {
    let f = n.as_f64().unwrap_or_default();
    let exp = if f == 0.0 {
        0
    } else {
        f.abs().log10().floor() as i32
    };
    if (-4..21).contains(&exp) {
        let s = format!("{f}");
        return s;
    }
    let s = format!("{f:e}");
    match s.split_once('e') {
        Some((m, e)) => {
            let e: i32 = e.parse().unwrap_or_default();
            format!("{m}e{}{:02}", if e < 0 { '-' } else { '+' }, e.abs())
        }
        None => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_case_folding() {
        let c = NetConf::parse(
            br#"{"cniVersion":"1.0.0","Name":"net1","type":"calico","IPAM":{"Type":"calico-ipam"},"unknown":1,"mtu":null}"#,
        )
        .unwrap();
        assert_eq!(c.name, "net1");
        assert_eq!(c.ipam.ipam_type, "calico-ipam");
        assert!(c.assign_ipv4() && !c.assign_ipv6());
        assert_eq!(c.num_queues(), 1);
        assert_eq!(c.ipam_lock_file(), DEFAULT_IPAM_LOCK_FILE);
        assert_eq!(c.nodename_file(), DEFAULT_NODENAME_FILE);
        // Every nested struct folds too; of several keys for one field, the last wins.
        let c = NetConf::parse(
            br#"{"Policy":{"TYPE":"k8s"},"feature_control":{"Floating_IPs":true},"runtimeconfig":{},"QPS":5,"Kubernetes":{"Kubeconfig":"a","kubeconfig":"b"}}"#,
        )
        .unwrap();
        let last = NetConf::parse(
            br#"{"name":"n","mtu":0,"MTU":1400,"kubernetes":{"kubeconfig":"b","Kubeconfig":"a"}}"#,
        )
        .unwrap();
        assert_eq!((last.mtu, last.kubernetes.kubeconfig.as_str()), (1400, "a"));
        assert_eq!(c.policy.policy_type, "k8s");
        assert!(c.feature_control.floating_ips);
        assert!(c.runtime_config.is_some());
        assert_eq!(c.qps, 5);
        assert_eq!(c.kubernetes.kubeconfig, "b");
    }

    #[test]
    fn assign_flags_are_strings() {
        let c =
            NetConf::parse(br#"{"name":"n","ipam":{"assign_ipv4":"false","assign_ipv6":"true"}}"#)
                .unwrap();
        assert!(!c.assign_ipv4() && c.assign_ipv6());
        let e = NetConf::parse(br#"{"name":"n","ipam":{"assign_ipv4":false}}"#).unwrap_err();
        assert!(e.to_string().starts_with("failed to load netconf: "), "{e}");
    }

    #[test]
    fn mtu_resolution() {
        let dir = std::env::temp_dir().join(format!("mtu-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("mtu");
        let c = NetConf::parse(br#"{"name":"n"}"#).unwrap();
        assert_eq!(c.resolve_mtu_from(&f).unwrap(), 0);
        std::fs::write(&f, "1440\n").unwrap();
        assert_eq!(c.resolve_mtu_from(&f).unwrap(), 1440);
        let c2 = NetConf::parse(br#"{"name":"n","mtu":9000}"#).unwrap();
        assert_eq!(c2.resolve_mtu_from(&f).unwrap(), 9000);
        std::fs::write(&f, "abc").unwrap();
        assert_eq!(
            c2.resolve_mtu_from(&f).unwrap_err().to_string(),
            "failed to read MTU file: strconv.Atoi: parsing \"abc\": invalid syntax"
        );
        std::fs::remove_file(&f).unwrap();
        let c3 = NetConf::parse(br#"{"name":"n","require_mtu_file":true}"#).unwrap();
        assert!(c3.resolve_mtu_from(&f).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn datastore_settings_and_names() {
        let c = NetConf::parse(
            br#"{"name":"n","nodename":"node1","etcd_endpoints":"http://127.0.0.1:1, http://127.0.0.1:2"}"#,
        )
        .unwrap();
        assert_eq!(c.node_name(), "node1");
        assert!(NetConf::parse(br#"{"name":"a b"}"#)
            .unwrap()
            .validate_name()
            .is_err());
        // `device_type` is HEAD-only: v3.32.1 ignores it like any unknown key.
        assert!(NetConf::parse(br#"{"name":"n","device_type":"x"}"#).is_ok());
    }

    #[test]
    fn dataplane_options() {
        let check = |j: &str| NetConf::parse(j.as_bytes()).unwrap().check_dataplane();
        assert!(check(r#"{"name":"n"}"#).is_ok());
        assert!(check(r#"{"name":"n","dataplane_options":{"extra":"x"}}"#).is_ok());
        assert_eq!(
            check(r#"{"name":"n","dataplane_options":{"type":"invalid-dataplane-type"}}"#)
                .unwrap_err()
                .to_string(),
            "invalid dataplane type: invalid-dataplane-type"
        );
        assert!(matches!(
            check(r#"{"name":"n","dataplane_options":{"type":5}}"#).unwrap_err(),
            ConfigError::DataplaneType(t) if t == "%!s(float64=5)"
        ));
        for (v, shown) in [
            ("true", "%!s(bool=true)"),
            ("null", "%!s(<nil>)"),
            ("1.5", "%!s(float64=1.5)"),
            ("1e21", "%!s(float64=1e+21)"),
            (r#"["a",1]"#, "[a %!s(float64=1)]"),
            (r#"{"b":1,"a":"x"}"#, "map[a:x b:%!s(float64=1)]"),
        ] {
            let j = format!(r#"{{"name":"n","dataplane_options":{{"type":{v}}}}}"#);
            assert!(
                matches!(check(&j).unwrap_err(), ConfigError::DataplaneType(t) if t == shown),
                "{v}"
            );
        }
        assert!(matches!(
            check(r#"{"name":"n","dataplane_options":{"type":"grpc"}}"#).unwrap_err(),
            ConfigError::GrpcSocket
        ));
        assert!(
            check(r#"{"name":"n","dataplane_options":{"type":"grpc","socket":"unix:///x"}}"#)
                .is_ok()
        );
        assert!(
            check(r#"{"name":"n","dataplane_options":{"type":"grpc","socket":"host:1"}}"#).is_ok(),
            "a TCP target, as grpc-go's passthrough resolver takes it"
        );
        assert!(matches!(
            check(r#"{"name":"n","dataplane_options":{"type":"grpc","socket":"unix://h/x"}}"#),
            Err(ConfigError::GrpcAddress { .. })
        ));
        assert_eq!(
            grpc_target("unix:///run/x.sock").ok(),
            Some(GrpcTarget::Unix("/run/x.sock".into()))
        );
        assert_eq!(
            grpc_target("unix:rel.sock").ok(),
            Some(GrpcTarget::Unix("rel.sock".into()))
        );
        assert_eq!(
            grpc_target("10.0.0.1:50051").ok(),
            Some(GrpcTarget::Tcp("10.0.0.1:50051".into()))
        );
        assert_eq!(
            grpc_target("dns:///agent:50051").ok(),
            Some(GrpcTarget::Tcp("agent:50051".into()))
        );
        assert_eq!(
            grpc_target("/run/x.sock").ok(),
            Some(GrpcTarget::Tcp("/run/x.sock".into()))
        );
    }

    #[test]
    fn mesos_label_sanitising() {
        assert_eq!(sanitize_label("a/b/c"), "a.b.c");
        assert_eq!(sanitize_label("/a/b/c"), "a.b.c");
        assert_eq!(sanitize_label("k"), "k");
        assert_eq!(sanitize_label("a b"), "a-b");
        // Upstream's own cases.
        assert_eq!(sanitize_label("-my-val"), "my-val");
        assert_eq!(sanitize_label("$my..val"), "my.val");
        assert_eq!(sanitize_label("m$y.val"), "m-y.val");
        assert_eq!(sanitize_label("//my/val/"), "my.val");
        assert_eq!(
            sanitize_label("some_val-with.lots*of^weird#characters"),
            "some_val-with.lots-of-weird-characters"
        );
        // A run of invalid characters (multi-byte ones too) is one `-`; a `/` ends a run.
        assert_eq!(sanitize_label("a$$ b"), "a-b");
        assert_eq!(sanitize_label("grüße wörld"), "gr-e-w-rld");
        assert_eq!(sanitize_label("a$/$b"), "a.b");
        assert_eq!(sanitize_label("a-$-b"), "a---b");
    }

    #[test]
    fn mesos_namespace_label_is_matched_as_given() {
        let conf = |labels: Value| {
            let text = serde_json::json!({
                "name": "n",
                "args": {"org.apache.mesos": {"network_info": {"labels": {"labels": labels}}}},
            });
            NetConf::parse(text.to_string().as_bytes()).unwrap()
        };
        let got = conf(serde_json::json!([
            {"key": "projectcalico.org/namespace", "value": "team/a"},
            {"key": "app", "value": "web"},
        ]))
        .mesos_labels();
        assert_eq!(got.namespace.as_deref(), Some("team.a"));
        assert_eq!(got.labels, BTreeMap::from([("app".into(), "web".into())]));
        // Keys that only sanitize to it stay labels.
        let got = conf(serde_json::json!([
            {"key": "projectcalico.org.namespace", "value": "x"},
            {"key": "/projectcalico.org/namespace", "value": "y"},
        ]))
        .mesos_labels();
        assert_eq!(got.namespace, None);
        assert_eq!(
            got.labels,
            BTreeMap::from([("projectcalico.org.namespace".into(), "y".into())])
        );
    }
}
