//! The conflist the installer writes: the template (upstream's Linux default, or the
//! operator's `CNI_NETWORK_CONFIG[_FILE]`), the `__PLACEHOLDER__`s upstream substitutes (in
//! its order, with its defaults), and the check that refuses a config kubelet could not load
//! before anything is written. The rendered text may hold a token: it is never logged.

use serde_json::Value;

use super::settings::Settings;
use super::InstallError;

/// Upstream's default template on Linux: calico with calico-ipam and policy k8s on the
/// Kubernetes datastore (by default), then portmap.
pub const DEFAULT_TEMPLATE: &str = r#"{
  "name": "k8s-pod-network",
  "cniVersion": "0.3.1",
  "plugins": [
    {
      "type": "calico",
      "log_level": "__LOG_LEVEL__",
      "log_file_path": "__LOG_FILE_PATH__",
      "datastore_type": "__DATASTORE_TYPE__",
      "nodename": "__KUBERNETES_NODE_NAME__",
      "mtu": __CNI_MTU__,
      "ipam": {"type": "calico-ipam"},
      "policy": {"type": "k8s"},
      "kubernetes": {"kubeconfig": "__KUBECONFIG_FILEPATH__"},
      "require_mtu_file": __REQUIRE_MTU_FILE__,
      "calico_api_group": "__CALICO_API_GROUP__"
    },
    {
      "type": "portmap",
      "snat": true,
      "capabilities": {"portMappings": true}
    }
  ]
}"#;

/// Which etcd TLS files the host's `calico-tls` directory holds once the installer has
/// copied them (their paths go into the conflist only when present).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EtcdTls {
    pub ca: bool,
    pub cert: bool,
    pub key: bool,
}

/// What the placeholders are replaced with, besides the environment.
pub struct Inputs<'a> {
    pub settings: &'a Settings,
    /// The node's name when `KUBERNETES_NODE_NAME` is unset: the lower-cased hostname.
    pub hostname: &'a str,
    /// The mounted service-account token (empty outside a pod).
    pub service_account_token: &'a str,
    pub etcd_tls: EtcdTls,
}

/// `(placeholder, value)` in upstream's order of replacement (a value that itself holds a
/// later placeholder is replaced again, as upstream's sequence of ReplaceAlls does).
pub fn substitutions(
    inputs: &Inputs,
    env: &dyn Fn(&str) -> Option<String>,
) -> Vec<(&'static str, String)> {
    // getEnv: a variable set to "" is "" (not the default), as upstream's LookupEnv.
    let get = |k: &str, default: &str| env(k).unwrap_or_else(|| default.to_string());
    let s = inputs.settings;
    let tls_dir = format!("{}/calico-tls", s.cni_net_dir);
    let tls = |present: bool, file: &str| {
        if present {
            format!("{tls_dir}/{file}")
        } else {
            String::new()
        }
    };
    vec![
        ("__LOG_LEVEL__", get("LOG_LEVEL", "info")),
        (
            "__LOG_FILE_PATH__",
            get("LOG_FILE_PATH", "/var/log/calico/cni/cni.log"),
        ),
        ("__LOG_FILE_MAX_SIZE__", get("LOG_FILE_MAX_SIZE", "100")),
        ("__LOG_FILE_MAX_AGE__", get("LOG_FILE_MAX_AGE", "30")),
        ("__LOG_FILE_MAX_COUNT__", get("LOG_FILE_MAX_COUNT", "10")),
        ("__DATASTORE_TYPE__", get("DATASTORE_TYPE", "kubernetes")),
        (
            "__KUBERNETES_NODE_NAME__",
            get("KUBERNETES_NODE_NAME", inputs.hostname),
        ),
        (
            "__KUBECONFIG_FILEPATH__",
            format!("{}/calico-kubeconfig", s.cni_net_dir),
        ),
        ("__CNI_MTU__", get("CNI_MTU", "1500")),
        (
            "__KUBERNETES_SERVICE_HOST__",
            get("KUBERNETES_SERVICE_HOST", ""),
        ),
        (
            "__KUBERNETES_SERVICE_PORT__",
            get("KUBERNETES_SERVICE_PORT", ""),
        ),
        (
            "__SERVICEACCOUNT_TOKEN__",
            inputs.service_account_token.to_string(),
        ),
        ("__CALICO_API_GROUP__", s.api_group.clone()),
        ("__ETCD_CERT_FILE__", tls(inputs.etcd_tls.cert, "etcd-cert")),
        ("__ETCD_CA_CERT_FILE__", tls(inputs.etcd_tls.ca, "etcd-ca")),
        ("__ETCD_KEY_FILE__", tls(inputs.etcd_tls.key, "etcd-key")),
        ("__ETCD_ENDPOINTS__", get("ETCD_ENDPOINTS", "")),
        ("__ETCD_DISCOVERY_SRV__", get("ETCD_DISCOVERY_SRV", "")),
        ("__REQUIRE_MTU_FILE__", get("REQUIRE_MTU_FILE", "false")),
    ]
}

/// The template with every placeholder replaced, checked as kubelet's libcni will load it.
/// `source` names where the template came from, for the error.
pub fn render(
    template: &str,
    source: &str,
    inputs: &Inputs,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<String, InstallError> {
    let text = substitutions(inputs, env)
        .into_iter()
        .fold(template.to_string(), |t, (k, v)| t.replace(k, &v));
    check(&text).map_err(|why| {
        InstallError::Refused(format!(
            "CNI config from {source} (after substitution) {why}"
        ))
    })?;
    Ok(text)
}

/// What libcni needs of a network configuration: a JSON object with a `name`, and either a
/// non-empty `plugins` list of objects each with a `type`, or (a single `.conf`) a `type`.
/// The text is never quoted back: it may hold a token.
fn check(text: &str) -> Result<(), String> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("is not valid JSON: {e}"))?;
    let Some(obj) = v.as_object() else {
        return Err("is not a JSON object".into());
    };
    let nonempty_str = |v: Option<&Value>| v.and_then(Value::as_str).is_some_and(|s| !s.is_empty());
    if !nonempty_str(obj.get("name")) {
        return Err("has no \"name\" (a string): libcni refuses such a network".into());
    }
    match obj.get("plugins") {
        None if nonempty_str(obj.get("type")) => Ok(()),
        None => Err("has neither \"plugins\" nor \"type\"".into()),
        Some(Value::Array(plugins)) if plugins.is_empty() => {
            Err("has an empty \"plugins\" list".into())
        }
        Some(Value::Array(plugins)) => {
            for (i, p) in plugins.iter().enumerate() {
                if !p.is_object() {
                    return Err(format!("plugins[{i}] is not a JSON object"));
                }
                if !nonempty_str(p.get("type")) {
                    return Err(format!("plugins[{i}] has no \"type\" (a string)"));
                }
            }
            Ok(())
        }
        Some(_) => Err("has \"plugins\" that is not a list".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn settings() -> Settings {
        Settings::from_env(&|_| None).unwrap()
    }

    fn render_with(
        template: &str,
        pairs: &[(&str, &str)],
        tls: EtcdTls,
    ) -> Result<String, InstallError> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let s = settings();
        let inputs = Inputs {
            settings: &s,
            hostname: "node-1",
            service_account_token: "tok",
            etcd_tls: tls,
        };
        render(template, "test", &inputs, &|k| m.get(k).cloned())
    }

    #[test]
    fn default_template_with_upstream_defaults() {
        let text = render_with(DEFAULT_TEMPLATE, &[], EtcdTls::default()).unwrap();
        let v: Value = serde_json::from_str(&text).unwrap();
        let calico = &v["plugins"][0];
        assert_eq!(calico["log_level"], "info");
        assert_eq!(calico["log_file_path"], "/var/log/calico/cni/cni.log");
        assert_eq!(calico["datastore_type"], "kubernetes");
        assert_eq!(calico["nodename"], "node-1");
        assert_eq!(calico["mtu"], 1500);
        assert_eq!(calico["require_mtu_file"], false);
        assert_eq!(
            calico["kubernetes"]["kubeconfig"],
            "/etc/cni/net.d/calico-kubeconfig"
        );
        assert_eq!(calico["calico_api_group"], "crd.projectcalico.org/v1");
        assert_eq!(v["plugins"][1]["type"], "portmap");
        assert!(!text.contains("__"));
    }

    #[test]
    fn every_placeholder_from_the_environment() {
        let template = r#"{"name":"n","type":"calico","a":"__LOG_FILE_MAX_SIZE__/__LOG_FILE_MAX_AGE__/__LOG_FILE_MAX_COUNT__",
            "h":"__KUBERNETES_SERVICE_HOST__:__KUBERNETES_SERVICE_PORT__","t":"__SERVICEACCOUNT_TOKEN__",
            "e":"__ETCD_ENDPOINTS__|__ETCD_DISCOVERY_SRV__|__ETCD_CERT_FILE__|__ETCD_CA_CERT_FILE__|__ETCD_KEY_FILE__",
            "m":__CNI_MTU__,"r":__REQUIRE_MTU_FILE__,"n2":"__KUBERNETES_NODE_NAME__"}"#;
        let text = render_with(
            template,
            &[
                ("LOG_FILE_MAX_SIZE", "5"),
                ("LOG_FILE_MAX_AGE", "6"),
                ("LOG_FILE_MAX_COUNT", "7"),
                ("KUBERNETES_SERVICE_HOST", "10.96.0.1"),
                ("KUBERNETES_SERVICE_PORT", "443"),
                ("ETCD_ENDPOINTS", "https://e:2379"),
                ("ETCD_DISCOVERY_SRV", "example.org"),
                ("CNI_MTU", "1440"),
                ("REQUIRE_MTU_FILE", "true"),
                ("KUBERNETES_NODE_NAME", "from-env"),
            ],
            EtcdTls {
                ca: true,
                cert: true,
                key: false,
            },
        )
        .unwrap();
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["a"], "5/6/7");
        assert_eq!(v["h"], "10.96.0.1:443");
        assert_eq!(v["t"], "tok");
        assert_eq!(
            v["e"],
            "https://e:2379|example.org|/etc/cni/net.d/calico-tls/etcd-cert|/etc/cni/net.d/calico-tls/etcd-ca|"
        );
        assert_eq!(v["m"], 1440);
        assert_eq!(v["r"], true);
        assert_eq!(v["n2"], "from-env");
    }

    #[test]
    fn malformed_configs_are_refused_with_the_reason() {
        let cases = [
            (
                r#"{"name":"n","plugins":[{"type":"calico","mtu": __CNI_MTU__ x}]}"#,
                "not valid JSON",
            ),
            (r#"["x"]"#, "not a JSON object"),
            (r#"{"plugins":[{"type":"calico"}]}"#, "no \"name\""),
            (r#"{"name":"n"}"#, "neither \"plugins\" nor \"type\""),
            (r#"{"name":"n","plugins":[]}"#, "empty \"plugins\""),
            (
                r#"{"name":"n","plugins":[{"type":"calico"},{"snat":true}]}"#,
                "plugins[1] has no \"type\"",
            ),
            (r#"{"name":"n","plugins":{"type":"calico"}}"#, "not a list"),
        ];
        for (template, want) in cases {
            let e = render_with(template, &[], EtcdTls::default()).unwrap_err();
            assert!(e.to_string().contains(want), "{template}: {e}");
        }
        // MTU left empty by the environment: not JSON once substituted.
        let e = render_with(DEFAULT_TEMPLATE, &[("CNI_MTU", "")], EtcdTls::default()).unwrap_err();
        assert!(e.to_string().contains("not valid JSON"), "{e}");
        // The token never appears in the error.
        let e = render_with(
            r#"{"t":"__SERVICEACCOUNT_TOKEN__""#,
            &[],
            EtcdTls::default(),
        )
        .unwrap_err();
        assert!(!e.to_string().contains("tok"), "{e}");
    }
}
