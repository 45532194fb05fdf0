//! The installer's environment contract (upstream's `pkg/install` at v3.32.1, read with
//! envconfig): names, defaults and parsing, as one plain value. Paths of the container's
//! mounts are upstream's fixed ones; `CALICO_INSTALL_*` moves them, for running the
//! installer outside a container (by hand on a VM, or in the tests).

use std::path::PathBuf;

use super::InstallError;
use crate::gocompat::parse_bool;

/// Where the installer reads and writes: upstream's container paths unless moved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Paths {
    /// The image's binaries, copied to the host (`/opt/cni/bin`).
    pub image_bin_dir: PathBuf,
    /// The host's CNI binary directories, as mounted into the pod (`/host/opt/cni/bin`,
    /// `/host/secondary-bin-dir`); a missing or read-only one is skipped.
    pub host_bin_dirs: Vec<PathBuf>,
    /// The host's CNI configuration directory, as mounted (`/host/etc/cni/net.d`).
    pub host_net_dir: PathBuf,
    /// The pod's service-account mount (`/var/run/secrets/kubernetes.io/serviceaccount`).
    pub service_account_dir: PathBuf,
}

impl Paths {
    /// Upstream's paths, each movable: `CALICO_INSTALL_IMAGE_BIN_DIR`,
    /// `CALICO_INSTALL_HOST_BIN_DIRS` (colon-separated), `CALICO_INSTALL_HOST_NET_DIR`,
    /// `CALICO_INSTALL_SERVICEACCOUNT_DIR`.
    pub fn from_env(env: &dyn Fn(&str) -> Option<String>) -> Paths {
        let path = |k: &str, default: &str| PathBuf::from(env(k).unwrap_or(default.into()));
        let host_bin_dirs = match env("CALICO_INSTALL_HOST_BIN_DIRS") {
            Some(dirs) => dirs
                .split(':')
                .filter(|d| !d.is_empty())
                .map(PathBuf::from)
                .collect(),
            None => vec!["/host/opt/cni/bin".into(), "/host/secondary-bin-dir".into()],
        };
        Paths {
            image_bin_dir: path("CALICO_INSTALL_IMAGE_BIN_DIR", "/opt/cni/bin"),
            host_bin_dirs,
            host_net_dir: path("CALICO_INSTALL_HOST_NET_DIR", "/host/etc/cni/net.d"),
            service_account_dir: path(
                "CALICO_INSTALL_SERVICEACCOUNT_DIR",
                "/var/run/secrets/kubernetes.io/serviceaccount",
            ),
        }
    }
}

/// The settings upstream's installer reads with envconfig (each with upstream's default).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// `CNI_NET_DIR`: the host's CNI config directory as the host sees it; only used in the
    /// paths written into the conflist (the kubeconfig, the etcd TLS files).
    pub cni_net_dir: String,
    /// `CNI_CONF_NAME` (default `10-calico.conflist`).
    pub conf_name: String,
    /// `CNI_OLD_CONF_NAME` (default `10-calico.conflist`): removed when it differs.
    pub old_conf_name: String,
    /// `TLS_ASSETS_DIR` (default `/calico-secrets`): etcd-ca, etcd-cert, etcd-key.
    pub tls_assets_dir: PathBuf,
    /// `SKIP_CNI_BINARIES`: comma-separated names not to copy.
    pub skip_binaries: Vec<String>,
    /// `UPDATE_CNI_BINARIES` (default true): overwrite binaries already on the host.
    pub update_binaries: bool,
    /// `CNI_NETWORK_CONFIG`: the conflist template.
    pub network_config: Option<String>,
    /// `CNI_NETWORK_CONFIG_FILE`: a file holding the template (wins over the variable).
    pub network_config_file: Option<PathBuf>,
    /// `SLEEP` (default true): stay up after installing (a DaemonSet container), or exit
    /// (an init container).
    pub sleep: bool,
    /// `CALICO_API_GROUP` (default `crd.projectcalico.org/v1`).
    pub api_group: String,
    /// `TEST_FILE_PERMISSION` (default 0600): the conflist's mode.
    pub conf_mode: u32,
}

/// A boolean as envconfig reads it (Go's `strconv.ParseBool`); unset or empty is the default.
fn go_bool(
    env: &dyn Fn(&str) -> Option<String>,
    k: &str,
    default: bool,
) -> Result<bool, InstallError> {
    match env(k).filter(|v| !v.is_empty()) {
        None => Ok(default),
        Some(v) => parse_bool(&v).ok_or_else(|| {
            InstallError::Refused(format!(
                "envconfig.Process: assigning {k} to {}: converting '{v}' to type bool: invalid syntax",
                field_name(k)
            ))
        }),
    }
}

/// Upstream's Go field name for an env name, as envconfig's errors name it.
fn field_name(k: &str) -> &'static str {
    match k {
        "UPDATE_CNI_BINARIES" => "UpdateCNIBinaries",
        "SLEEP" => "ShouldSleep",
        _ => "value",
    }
}

impl Settings {
    pub fn from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<Settings, InstallError> {
        let or = |k: &str, default: &str| {
            env(k)
                .filter(|v| !v.is_empty())
                .unwrap_or_else(|| default.to_string())
        };
        let mode_text = or("TEST_FILE_PERMISSION", "0600");
        let conf_mode = u32::from_str_radix(&mode_text, 8)
            .ok()
            .filter(|m| *m <= 0o7777)
            .ok_or_else(|| {
                InstallError::Refused(format!(
                    "TEST_FILE_PERMISSION {mode_text:?} is not an octal file mode"
                ))
            })?;
        Ok(Settings {
            cni_net_dir: or("CNI_NET_DIR", "/etc/cni/net.d"),
            conf_name: or("CNI_CONF_NAME", "10-calico.conflist"),
            old_conf_name: or("CNI_OLD_CONF_NAME", "10-calico.conflist"),
            tls_assets_dir: PathBuf::from(or("TLS_ASSETS_DIR", "/calico-secrets")),
            skip_binaries: env("SKIP_CNI_BINARIES")
                .unwrap_or_default()
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect(),
            update_binaries: go_bool(env, "UPDATE_CNI_BINARIES", true)?,
            network_config: env("CNI_NETWORK_CONFIG").filter(|v| !v.is_empty()),
            network_config_file: env("CNI_NETWORK_CONFIG_FILE")
                .filter(|v| !v.is_empty())
                .map(PathBuf::from),
            sleep: go_bool(env, "SLEEP", true)?,
            api_group: or("CALICO_API_GROUP", "crd.projectcalico.org/v1"),
            conf_mode,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::env_of;

    #[test]
    fn upstream_defaults() {
        let s = Settings::from_env(&env_of(&[])).unwrap();
        assert_eq!(s.cni_net_dir, "/etc/cni/net.d");
        assert_eq!(s.conf_name, "10-calico.conflist");
        assert_eq!(s.old_conf_name, "10-calico.conflist");
        assert_eq!(s.tls_assets_dir, PathBuf::from("/calico-secrets"));
        assert!(s.update_binaries && s.sleep);
        assert!(s.skip_binaries.is_empty());
        assert_eq!(s.api_group, "crd.projectcalico.org/v1");
        assert_eq!(s.conf_mode, 0o600);
        let p = Paths::from_env(&env_of(&[]));
        assert_eq!(p.host_net_dir, PathBuf::from("/host/etc/cni/net.d"));
        assert_eq!(p.host_bin_dirs.len(), 2);
    }

    #[test]
    fn lists_booleans_and_modes() {
        let s = Settings::from_env(&env_of(&[
            ("SKIP_CNI_BINARIES", "flannel, portmap,,"),
            ("UPDATE_CNI_BINARIES", "false"),
            ("SLEEP", "0"),
            ("TEST_FILE_PERMISSION", "0644"),
        ]))
        .unwrap();
        assert_eq!(s.skip_binaries, ["flannel", "portmap"]);
        assert!(!s.update_binaries && !s.sleep);
        assert_eq!(s.conf_mode, 0o644);
        let e = Settings::from_env(&env_of(&[("SLEEP", "yes")])).unwrap_err();
        assert!(e.to_string().contains("SLEEP"), "{e}");
        assert!(Settings::from_env(&env_of(&[("TEST_FILE_PERMISSION", "rw")])).is_err());
    }
}
