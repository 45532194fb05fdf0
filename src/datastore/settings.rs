//! Where the datastore is and how to reach it, resolved once per call exactly as v3.32.1
//! does it: `CreateClient` (cni-plugin/internal/pkg/utils) exports every non-empty NetConf
//! value into the process environment under its plain name (`ETCD_ENDPOINTS`, …), then
//! libcalico-go's `apiconfig.LoadClientConfig` reads the environment with envconfig, which
//! tries `CALICO_<NAME>` first and the plain name only when the prefixed one is unset.
//!
//! So, per setting: `CALICO_<NAME>` when present in the environment (even empty) → else the
//! NetConf value when non-empty → else `<NAME>` from the environment → else unset. The
//! environment is passed in, so these rules are unit-tested without touching the process.
//! The Kubernetes client's rate limit comes this way too: `K8S_CLIENT_QPS` (the NetConf's
//! `qps` when not 0) and `K8S_CLIENT_BURST` (`burst`), parsed as envconfig parses a float32
//! and an int; a value that does not parse fails the call, as it fails upstream's. So do the
//! booleans envconfig reads (`K8S_INSECURE_SKIP_TLS_VERIFY`, `K8S_DISABLE_NODE_POLL`,
//! `USE_POD_CIDR`) when set to anything Go's `strconv.ParseBool` refuses, `""` included; the
//! first field that fails, in the struct's order, is the one named.
//!
//! Exceptions to the rule above, as upstream's: the datastore's token has no environment
//! name of its own, so only `CALICO_K8SAPITOKEN` sets it (not `K8SAPITOKEN`, and not the
//! NetConf's `policy.k8s_auth_token`, exported as `K8S_API_TOKEN`); the booleans have no
//! NetConf value. Then apiconfig's defaults: no datastore type means etcd when endpoints
//! are given, else Kubernetes; on Kubernetes with neither a kubeconfig nor an API endpoint,
//! `$HOME/.kube/config` when `HOME` is set and that file exists. A `KUBECONFIG` of several
//! files (`a:b`) is merged as client-go merges them (`KubeSettings::kubeconfig_list`).

use crate::config::NetConf;
use crate::datastore::kubernetes::client::{is_kubeconfig_list, KubeSettings};
use crate::datastore::kubernetes::ratelimit::RateLimit;
use crate::support::gocompat::{parse_bool_go, NumError, NumErrorKind};

/// The resolved connection settings.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DatastoreSettings {
    /// `etcdv3` or `kubernetes` (anything else is refused by `resolve`).
    pub datastore_type: String,
    /// `ETCD_ENDPOINTS` split on `,` (blank entries dropped, spaces trimmed).
    pub etcd_endpoints: Vec<String>,
    pub etcd_discovery_srv: String,
    pub etcd_key_file: String,
    pub etcd_cert_file: String,
    pub etcd_ca_cert_file: String,
    /// Only used when both are set, as upstream.
    pub etcd_username: String,
    pub etcd_password: String,
    /// The Kubernetes datastore's API server (kubeconfig and the `K8S_*` overrides).
    pub kube: KubeSettings,
    pub calico_api_group: String,
    /// On etcd with policy type k8s, the API server an ADD reads the pod and its namespace
    /// from: connected to alongside etcd (`backend::connect`). None otherwise.
    pub policy_kube: Option<KubeSettings>,
    /// `USE_POD_CIDR` (IPAM from the nodes' pod CIDRs): read, and used by `-upgrade` only.
    pub use_pod_cidr: bool,
}

/// What reading the environment can refuse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SettingsError {
    #[error("unknown datastore type: {0}")]
    UnknownType(String),
    /// apiconfig's `LoadClientConfigFromEnvironment` failing on what envconfig could not
    /// convert.
    #[error("failed to load config from env vars: {0}")]
    Load(Box<EnvconfigError>),
}

/// envconfig's `*ParseError`: a value it cannot convert (named by the prefixed variable,
/// whichever name held it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("envconfig.Process: assigning {key} to {field}: converting '{value}' to type {type_name}. details: {source}")]
pub struct EnvconfigError {
    pub key: String,
    pub field: &'static str,
    pub value: String,
    pub type_name: &'static str,
    #[source]
    pub source: NumError,
}

impl SettingsError {
    fn parse(
        name: &str,
        field: &'static str,
        value: String,
        type_name: &'static str,
        source: NumError,
    ) -> SettingsError {
        SettingsError::Load(Box::new(EnvconfigError {
            key: format!("CALICO_{name}"),
            field,
            value,
            type_name,
            source,
        }))
    }
}

/// One envconfig-read setting: `CALICO_<name>` if present, else the NetConf value, else
/// `<name>`. (`CALICO_API_GROUP`'s own prefixed form is `CALICO_CALICO_API_GROUP`.)
fn setting(env: &dyn Fn(&str) -> Option<String>, name: &str, from_conf: &str) -> String {
    if let Some(v) = env(&format!("CALICO_{name}")) {
        return v;
    }
    if !from_conf.is_empty() {
        return from_conf.to_string();
    }
    env(name).unwrap_or_default()
}

/// `setting`, telling an unset value (`None`) from an empty one.
fn setting_opt(
    env: &dyn Fn(&str) -> Option<String>,
    name: &str,
    from_conf: &str,
) -> Option<String> {
    if let Some(v) = env(&format!("CALICO_{name}")) {
        return Some(v);
    }
    if !from_conf.is_empty() {
        return Some(from_conf.to_string());
    }
    env(name)
}

/// Go's `strconv.ParseFloat(s, 32)`. Hexadecimal floats are not taken.
fn parse_go_f32(s: &str) -> Result<f32, NumError> {
    let err = |kind| NumError {
        func: "ParseFloat",
        num: s.to_string(),
        kind,
    };
    let v: f32 = s.parse().map_err(|_| err(NumErrorKind::Syntax))?;
    let spelled_infinite = s
        .trim_start_matches(['+', '-'])
        .to_ascii_lowercase()
        .starts_with("inf");
    if v.is_infinite() && !spelled_infinite {
        return Err(err(NumErrorKind::Range));
    }
    Ok(v)
}

/// Go's `strconv.ParseInt(s, 0, 64)`: a sign, then `0x`, `0o`, `0b` or `0` (octal) for
/// another base, where `_` may separate digits.
fn parse_go_int(s: &str) -> Result<i64, NumError> {
    parse_go_int_kind(s).map_err(|kind| NumError {
        func: "ParseInt",
        num: s.to_string(),
        kind,
    })
}

fn parse_go_int_kind(s: &str) -> Result<i64, NumErrorKind> {
    let (neg, body) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    let lower = body.to_ascii_lowercase();
    let (base, digits) = if let Some(d) = lower.strip_prefix("0x") {
        (16, d.to_string())
    } else if let Some(d) = lower.strip_prefix("0o") {
        (8, d.to_string())
    } else if let Some(d) = lower.strip_prefix("0b") {
        (2, d.to_string())
    } else if lower.len() > 1 && lower.starts_with('0') {
        (8, lower[1..].to_string())
    } else {
        (10, lower.clone())
    };
    let digits = if base != 10 && digits.contains('_') {
        let well_placed =
            !digits.starts_with('_') && !digits.ends_with('_') && !digits.contains("__");
        if !well_placed {
            return Err(NumErrorKind::Syntax);
        }
        digits.replace('_', "")
    } else {
        digits
    };
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(base)) {
        return Err(NumErrorKind::Syntax);
    }
    let magnitude = u64::from_str_radix(&digits, base).map_err(|_| NumErrorKind::Range)?;
    let v = if neg {
        0i64.checked_sub_unsigned(magnitude)
    } else {
        i64::try_from(magnitude).ok()
    };
    v.ok_or(NumErrorKind::Range)
}

/// The datastore client's rate limit: `K8S_CLIENT_QPS` and `K8S_CLIENT_BURST` (the NetConf's
/// `qps` and `burst` exported under those names when not 0), on libcalico-go's defaults.
fn resolve_rate(
    conf: &NetConf,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<RateLimit, SettingsError> {
    let from_conf = |v: i64| if v != 0 { v.to_string() } else { String::new() };
    let qps = match setting_opt(env, "K8S_CLIENT_QPS", &from_conf(conf.qps)) {
        None => 0.0,
        Some(v) => parse_go_f32(&v)
            .map_err(|e| SettingsError::parse("K8S_CLIENT_QPS", "K8sClientQPS", v, "float32", e))?,
    };
    let burst = match setting_opt(env, "K8S_CLIENT_BURST", &from_conf(conf.burst)) {
        None => 0,
        Some(v) => parse_go_int(&v)
            .map_err(|e| SettingsError::parse("K8S_CLIENT_BURST", "K8sClientBurst", v, "int", e))?,
    };
    Ok(RateLimit::calico(qps, burst))
}

/// One of envconfig's booleans (no NetConf value): unset is false; a set value must be Go's
/// `strconv.ParseBool`'s, `""` included.
fn env_bool(
    env: &dyn Fn(&str) -> Option<String>,
    name: &str,
    field: &'static str,
) -> Result<bool, SettingsError> {
    match setting_opt(env, name, "") {
        None => Ok(false),
        Some(v) => parse_bool_go(&v).map_err(|e| SettingsError::parse(name, field, v, "bool", e)),
    }
}

/// apiconfig's `applyConfigDefaults` for the kubeconfig: `$HOME/.kube/config` when `HOME`
/// is set and the file exists (a Go `os.Stat`, so anything there counts).
fn default_kubeconfig(env: &dyn Fn(&str) -> Option<String>) -> Option<String> {
    let home = env("HOME").filter(|h| !h.is_empty())?;
    let path =
        crate::support::gocompat::clean_path(&std::path::Path::new(&home).join(".kube/config"));
    std::fs::metadata(&path).ok()?;
    Some(path.display().to_string())
}

impl DatastoreSettings {
    /// `apiconfig.LoadClientConfig("")` as `CreateClient` calls it: envconfig over the
    /// environment (the NetConf's values standing in for the plain names, as `CreateClient`
    /// exports them), then apiconfig's defaults. The datastore type is not checked here.
    pub fn load(
        conf: &NetConf,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<DatastoreSettings, SettingsError> {
        let get = |name: &str, from_conf: &str| setting(env, name, from_conf);
        let endpoints = get("ETCD_ENDPOINTS", &conf.etcd_endpoints);
        let mut datastore_type = get("DATASTORE_TYPE", &conf.datastore_type);
        let (user, password) = (get("ETCD_USERNAME", ""), get("ETCD_PASSWORD", ""));
        let (etcd_username, etcd_password) = if user.is_empty() || password.is_empty() {
            (String::new(), String::new())
        } else {
            (user, password)
        };
        let mut kubeconfig = get("KUBECONFIG", &conf.kubernetes.kubeconfig);
        let server = get("K8S_API_ENDPOINT", &conf.kubernetes.k8s_api_root);
        // envconfig's fields in their order: the strings, which cannot fail, then the
        // booleans, the QPS and the burst; the first that fails is the error.
        let insecure_skip_tls_verify = env_bool(
            env,
            "K8S_INSECURE_SKIP_TLS_VERIFY",
            "K8sInsecureSkipTLSVerify",
        )?;
        env_bool(env, "K8S_DISABLE_NODE_POLL", "K8sDisableNodePoll")?;
        let use_pod_cidr = env_bool(env, "USE_POD_CIDR", "K8sUsePodCIDR")?;
        let rate = resolve_rate(conf, env)?;
        if datastore_type.is_empty() {
            // Discovery alone does not select etcd: only endpoints do (apiconfig/load.go).
            datastore_type = if endpoints.is_empty() {
                "kubernetes".into()
            } else {
                "etcdv3".into()
            };
        }
        if datastore_type == "kubernetes" && kubeconfig.is_empty() && server.is_empty() {
            kubeconfig = default_kubeconfig(env).unwrap_or_default();
        }
        Ok(DatastoreSettings {
            datastore_type,
            etcd_endpoints: endpoints
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect(),
            etcd_discovery_srv: get("ETCD_DISCOVERY_SRV", &conf.etcd_discovery_srv),
            etcd_key_file: get("ETCD_KEY_FILE", &conf.etcd_key_file),
            etcd_cert_file: get("ETCD_CERT_FILE", &conf.etcd_cert_file),
            etcd_ca_cert_file: get("ETCD_CA_CERT_FILE", &conf.etcd_ca_cert_file),
            etcd_username,
            etcd_password,
            kube: KubeSettings {
                kubeconfig_list: is_kubeconfig_list(&kubeconfig),
                kubeconfig,
                server,
                // The field has no envconfig name: envconfig reads `CALICO_K8SAPITOKEN` and
                // nothing else (no plain-name fallback without a name); the
                // `K8S_API_TOKEN` the CNI exports is never read.
                token: env("CALICO_K8SAPITOKEN").unwrap_or_default(),
                ca_file: get("K8S_CA_FILE", ""),
                cert_file: get("K8S_CERT_FILE", ""),
                key_file: get("K8S_KEY_FILE", ""),
                insecure_skip_tls_verify,
                context: get("K8S_CURRENT_CONTEXT", ""),
                rate,
            },
            calico_api_group: get("CALICO_API_GROUP", &conf.calico_api_group),
            policy_kube: None,
            use_pod_cidr,
        })
    }

    /// `load`, then the datastore type checked (libcalico-go's `client.New`).
    pub fn resolve(
        conf: &NetConf,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<DatastoreSettings, SettingsError> {
        let s = Self::load(conf, env)?;
        if s.datastore_type != "etcdv3" && s.datastore_type != "kubernetes" {
            return Err(SettingsError::UnknownType(s.datastore_type));
        }
        Ok(s)
    }

    /// The API server the plugin itself reads pods, namespaces and nodes from (k8s.go
    /// `getK8sRestConfig`): the NetConf's kubeconfig with its `policy.k8s_*` overrides;
    /// `kubernetes.k8s_api_root` beats `policy.k8s_api_root`. Independent of the datastore.
    pub fn plugin_kube(conf: &NetConf) -> KubeSettings {
        let p = &conf.policy;
        let server = if conf.kubernetes.k8s_api_root.is_empty() {
            p.k8s_api_root.clone()
        } else {
            conf.kubernetes.k8s_api_root.clone()
        };
        KubeSettings {
            kubeconfig: conf.kubernetes.kubeconfig.clone(),
            server,
            token: p.k8s_auth_token.clone(),
            ca_file: p.k8s_certificate_authority.clone(),
            cert_file: p.k8s_client_certificate.clone(),
            key_file: p.k8s_client_key.clone(),
            rate: RateLimit::CLIENT_GO,
            ..Default::default()
        }
    }

    /// From the NetConf and this process's environment.
    pub fn from_process(conf: &NetConf) -> Result<DatastoreSettings, SettingsError> {
        Self::resolve(conf, &|k| std::env::var(k).ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn resolve(conf: &str, env: &[(&str, &str)]) -> Result<DatastoreSettings, SettingsError> {
        let env: HashMap<String, String> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let conf = NetConf::parse(conf.as_bytes()).unwrap();
        DatastoreSettings::resolve(&conf, &|k| env.get(k).cloned())
    }

    #[test]
    fn prefixed_environment_beats_netconf_beats_plain_environment() {
        let conf = r#"{"name":"n","etcd_endpoints":"http://conf:2379"}"#;
        let s = resolve(conf, &[]).unwrap();
        assert_eq!(s.etcd_endpoints, vec!["http://conf:2379"]);
        assert_eq!(s.datastore_type, "etcdv3");
        let s = resolve(conf, &[("ETCD_ENDPOINTS", "http://plain:2379")]).unwrap();
        assert_eq!(s.etcd_endpoints, vec!["http://conf:2379"]);
        let s = resolve(conf, &[("CALICO_ETCD_ENDPOINTS", "http://prefixed:2379")]).unwrap();
        assert_eq!(s.etcd_endpoints, vec!["http://prefixed:2379"]);
        // Present but empty still wins: no endpoints, so the kubernetes datastore.
        let s = resolve(conf, &[("CALICO_ETCD_ENDPOINTS", "")]).unwrap();
        assert!(s.etcd_endpoints.is_empty());
        assert_eq!(s.datastore_type, "kubernetes");
        // Without a NetConf value the plain name is read.
        let s = resolve(
            r#"{"name":"n"}"#,
            &[("ETCD_ENDPOINTS", "http://a:1,http://b:2")],
        )
        .unwrap();
        assert_eq!(s.etcd_endpoints, vec!["http://a:1", "http://b:2"]);
    }

    #[test]
    fn datastore_type_defaults_and_refusals() {
        assert_eq!(
            resolve(r#"{"name":"n"}"#, &[]).unwrap().datastore_type,
            "kubernetes"
        );
        // Discovery alone does not select etcd.
        let s = resolve(r#"{"name":"n","etcd_discovery_srv":"example.com"}"#, &[]).unwrap();
        assert_eq!(
            (s.datastore_type.as_str(), s.etcd_discovery_srv.as_str()),
            ("kubernetes", "example.com")
        );
        let s = resolve(
            r#"{"name":"n","datastore_type":"etcdv3"}"#,
            &[("DATASTORE_TYPE", "kubernetes")],
        )
        .unwrap();
        assert_eq!(s.datastore_type, "etcdv3");
        let s = resolve(
            r#"{"name":"n","datastore_type":"etcdv3"}"#,
            &[("CALICO_DATASTORE_TYPE", "kubernetes")],
        )
        .unwrap();
        assert_eq!(s.datastore_type, "kubernetes");
        assert_eq!(
            resolve(r#"{"name":"n","datastore_type":"Kubernetes"}"#, &[])
                .unwrap_err()
                .to_string(),
            "unknown datastore type: Kubernetes"
        );
    }

    #[test]
    fn credentials_files_and_groups() {
        let conf = r#"{"name":"n","etcd_endpoints":"http://e:1","etcd_ca_cert_file":"/conf/ca"}"#;
        let s = resolve(conf, &[("ETCD_USERNAME", "u")]).unwrap();
        assert_eq!(
            (s.etcd_username.as_str(), s.etcd_password.as_str()),
            ("", "")
        );
        let s = resolve(
            conf,
            &[("ETCD_USERNAME", "u"), ("CALICO_ETCD_PASSWORD", "p")],
        )
        .unwrap();
        assert_eq!(
            (s.etcd_username.as_str(), s.etcd_password.as_str()),
            ("u", "p")
        );
        let s = resolve(
            conf,
            &[
                ("CALICO_ETCD_CA_CERT_FILE", "/env/ca"),
                ("ETCD_KEY_FILE", "/env/key"),
            ],
        )
        .unwrap();
        assert_eq!(
            (s.etcd_ca_cert_file.as_str(), s.etcd_key_file.as_str()),
            ("/env/ca", "/env/key")
        );
        let s = resolve(
            r#"{"name":"n","calico_api_group":"projectcalico.org/v3"}"#,
            &[("CALICO_CALICO_API_GROUP", "crd.projectcalico.org/v1")],
        )
        .unwrap();
        assert_eq!(s.calico_api_group, "crd.projectcalico.org/v1");
        let s = resolve(
            r#"{"name":"n","kubernetes":{"kubeconfig":"/conf/kc","k8s_api_root":"https://a"}}"#,
            &[("KUBECONFIG", "/env/kc")],
        )
        .unwrap();
        assert_eq!(
            (s.kube.kubeconfig.as_str(), s.kube.server.as_str()),
            ("/conf/kc", "https://a")
        );
        // The token the NetConf gives is exported as K8S_API_TOKEN, which the datastore
        // never reads; only CALICO_K8SAPITOKEN reaches it (the field has no envconfig name,
        // so there is no plain name to fall back on).
        let s = resolve(
            r#"{"name":"n","policy":{"k8s_auth_token":"conf"}}"#,
            &[("K8S_API_TOKEN", "x"), ("K8SAPITOKEN", "y")],
        )
        .unwrap();
        assert_eq!(s.kube.token, "");
        let s = resolve(
            r#"{"name":"n"}"#,
            &[("K8SAPITOKEN", "y"), ("CALICO_K8SAPITOKEN", "z")],
        )
        .unwrap();
        assert_eq!(s.kube.token, "z");
    }

    #[test]
    fn booleans_as_envconfig_parses_them() {
        let plain = r#"{"name":"n"}"#;
        for (v, want) in [
            ("1", true),
            ("T", true),
            ("true", true),
            ("0", false),
            ("False", false),
        ] {
            let s = resolve(plain, &[("K8S_INSECURE_SKIP_TLS_VERIFY", v)]).unwrap();
            assert_eq!(s.kube.insecure_skip_tls_verify, want, "{v}");
        }
        assert!(!resolve(plain, &[]).unwrap().kube.insecure_skip_tls_verify);
        // The prefixed name wins, even empty, and then fails.
        let s = resolve(
            plain,
            &[
                ("CALICO_K8S_INSECURE_SKIP_TLS_VERIFY", "0"),
                ("K8S_INSECURE_SKIP_TLS_VERIFY", "1"),
            ],
        )
        .unwrap();
        assert!(!s.kube.insecure_skip_tls_verify);
        for (k, v) in [
            ("K8S_INSECURE_SKIP_TLS_VERIFY", ""),
            ("CALICO_K8S_INSECURE_SKIP_TLS_VERIFY", "maybe"),
        ] {
            assert_eq!(
                resolve(plain, &[(k, v)]).unwrap_err().to_string(),
                format!("failed to load config from env vars: envconfig.Process: assigning CALICO_K8S_INSECURE_SKIP_TLS_VERIFY to K8sInsecureSkipTLSVerify: converting '{v}' to type bool. details: strconv.ParseBool: parsing \"{v}\": invalid syntax")
            );
        }
        let e = resolve(plain, &[("K8S_DISABLE_NODE_POLL", "x")]).unwrap_err();
        assert!(e.to_string().contains("assigning CALICO_K8S_DISABLE_NODE_POLL to K8sDisableNodePoll: converting 'x' to type bool"), "{e}");
        assert!(resolve(plain, &[("USE_POD_CIDR", "yes")]).is_err());
        assert!(
            resolve(plain, &[("USE_POD_CIDR", "1")])
                .unwrap()
                .use_pod_cidr
        );
        // envconfig's field order: the boolean before the QPS; both before the type check.
        let e = resolve(
            plain,
            &[
                ("K8S_CLIENT_QPS", "x"),
                ("USE_POD_CIDR", "x"),
                ("DATASTORE_TYPE", "foo"),
            ],
        )
        .unwrap_err();
        assert!(e.to_string().contains("K8sUsePodCIDR"), "{e}");
        let e = resolve(plain, &[("K8S_CLIENT_QPS", "x"), ("DATASTORE_TYPE", "foo")]).unwrap_err();
        assert!(e.to_string().contains("K8sClientQPS"), "{e}");
    }

    #[test]
    fn kubeconfig_lists_and_the_home_default() {
        let s = resolve(r#"{"name":"n"}"#, &[("KUBECONFIG", "/a:/b")]).unwrap();
        assert!(s.kube.kubeconfig_list);
        let s = resolve(r#"{"name":"n"}"#, &[("KUBECONFIG", "/a:")]).unwrap();
        assert!(s.kube.kubeconfig_list, "an empty entry still makes a list");
        let s = resolve(r#"{"name":"n"}"#, &[("KUBECONFIG", "/a")]).unwrap();
        assert!(!s.kube.kubeconfig_list);
        let home = std::env::temp_dir().join(format!("settings-home-{}", std::process::id()));
        std::fs::create_dir_all(home.join(".kube")).unwrap();
        let home_s = format!("{}/", home.display());
        let plain = r#"{"name":"n"}"#;
        assert_eq!(
            resolve(plain, &[("HOME", &home_s)])
                .unwrap()
                .kube
                .kubeconfig,
            ""
        );
        std::fs::write(home.join(".kube/config"), "").unwrap();
        let want = format!("{}/.kube/config", home.display());
        assert_eq!(
            resolve(plain, &[("HOME", &home_s)])
                .unwrap()
                .kube
                .kubeconfig,
            want
        );
        // Not when a kubeconfig or an API server is named, nor on etcd.
        let s = resolve(
            r#"{"name":"n","kubernetes":{"k8s_api_root":"https://a"}}"#,
            &[("HOME", &home_s)],
        )
        .unwrap();
        assert_eq!(s.kube.kubeconfig, "");
        let s = resolve(
            r#"{"name":"n","datastore_type":"etcdv3","etcd_endpoints":"http://e:1"}"#,
            &[("HOME", &home_s)],
        )
        .unwrap();
        assert_eq!(s.kube.kubeconfig, "");
        assert_eq!(resolve(plain, &[("HOME", "")]).unwrap().kube.kubeconfig, "");
        std::fs::remove_dir_all(&home).unwrap();
    }

    #[test]
    fn plugin_client_settings_come_from_the_netconf() {
        let conf = NetConf::parse(
            br#"{"name":"n","kubernetes":{"kubeconfig":"/kc"},"policy":{"type":"k8s","k8s_api_root":"https://p:6443","k8s_auth_token":"t","k8s_certificate_authority":"/ca"}}"#,
        )
        .unwrap();
        let k = DatastoreSettings::plugin_kube(&conf);
        assert_eq!(
            (
                k.kubeconfig.as_str(),
                k.server.as_str(),
                k.token.as_str(),
                k.ca_file.as_str()
            ),
            ("/kc", "https://p:6443", "t", "/ca")
        );
    }

    #[test]
    fn rate_limit_from_k8s_client_variables_and_the_netconf() {
        let rate = |conf: &str, env: &[(&str, &str)]| resolve(conf, env).map(|s| s.kube.rate);
        let plain = r#"{"name":"n"}"#;
        // libcalico-go's defaults: client-go's QPS, burst 100.
        assert_eq!(rate(plain, &[]).unwrap(), RateLimit::calico(0.0, 0));
        assert_eq!(rate(plain, &[]).unwrap().effective(), Some((5.0, 100)));
        // The NetConf's qps and burst beat the plain variables; the prefixed ones beat both.
        let conf = r#"{"name":"n","qps":20,"burst":30}"#;
        assert_eq!(
            rate(conf, &[("K8S_CLIENT_QPS", "1"), ("K8S_CLIENT_BURST", "2")]).unwrap(),
            RateLimit {
                qps: 20.0,
                burst: 30
            }
        );
        assert_eq!(
            rate(
                conf,
                &[
                    ("CALICO_K8S_CLIENT_QPS", "0.5"),
                    ("CALICO_K8S_CLIENT_BURST", "0x10")
                ]
            )
            .unwrap(),
            RateLimit {
                qps: 0.5,
                burst: 16
            }
        );
        assert_eq!(
            rate(
                plain,
                &[("K8S_CLIENT_QPS", "2.5"), ("K8S_CLIENT_BURST", "010")]
            )
            .unwrap(),
            RateLimit { qps: 2.5, burst: 8 }
        );
        // 0 in the NetConf is unset; 0 in the environment is client-go's and Calico's default.
        assert_eq!(
            rate(r#"{"name":"n","qps":0}"#, &[("K8S_CLIENT_BURST", "0")]).unwrap(),
            RateLimit::calico(0.0, 0)
        );
        // What envconfig cannot convert fails, with its text.
        let e = resolve(plain, &[("K8S_CLIENT_QPS", "fast")]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "failed to load config from env vars: envconfig.Process: assigning CALICO_K8S_CLIENT_QPS to K8sClientQPS: converting 'fast' to type float32. details: strconv.ParseFloat: parsing \"fast\": invalid syntax"
        );
        assert!(resolve(plain, &[("CALICO_K8S_CLIENT_BURST", "")]).is_err());
        assert!(resolve(plain, &[("K8S_CLIENT_BURST", "1.5")]).is_err());
        assert!(resolve(plain, &[("K8S_CLIENT_QPS", "1e39")]).is_err());
        // The plugin's own client keeps client-go's defaults whatever the datastore's are.
        let k = DatastoreSettings::plugin_kube(&NetConf::parse(conf.as_bytes()).unwrap());
        assert_eq!(k.rate, RateLimit::CLIENT_GO);
    }

    #[test]
    fn go_integers_and_floats() {
        let int_kind = |s: &str| parse_go_int(s).map_err(|e| e.kind);
        assert_eq!(int_kind("-0b101"), Ok(-5));
        assert_eq!(int_kind("0o17"), Ok(15));
        assert_eq!(int_kind("1_000"), Err(NumErrorKind::Syntax));
        assert_eq!(int_kind("0x1_0"), Ok(16));
        assert_eq!(
            parse_go_int("9223372036854775808").unwrap_err().to_string(),
            "strconv.ParseInt: parsing \"9223372036854775808\": value out of range"
        );
        assert_eq!(int_kind("-9223372036854775808"), Ok(i64::MIN));
        assert_eq!(int_kind(""), Err(NumErrorKind::Syntax));
        assert_eq!(parse_go_f32("+Inf"), Ok(f32::INFINITY));
        assert!(parse_go_f32("NaN").unwrap().is_nan());
        assert_eq!(
            parse_go_f32(" 1").unwrap_err().to_string(),
            "strconv.ParseFloat: parsing \" 1\": invalid syntax"
        );
    }
}
