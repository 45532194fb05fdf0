//! The installer's environment contract (upstream's `pkg/install` at v3.32.1, read with
//! envconfig): names, defaults and parsing, as one plain value. Paths of the container's
//! mounts are upstream's fixed ones; `CALICO_INSTALL_*` moves them, for running the
//! installer outside a container (by hand on a VM, or in the tests).

use std::path::PathBuf;

use crate::support::gocompat::{parse_bool_go, parse_uint, NumError};

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

/// The settings upstream's installer reads, with envconfig (`loadConfig`) or `os.LookupEnv`
/// (`getEnv`), each with upstream's default. Both tell a variable set to `""` from an unset
/// one: only an unset variable takes the default; `""` is used as given (an empty path, an
/// empty name, an empty API group), and a boolean or a number set to `""` does not parse.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// `CNI_NET_DIR` (default `/etc/cni/net.d`): the host's CNI config directory as the host
    /// sees it; only used in the paths written into the conflist (the kubeconfig, the etcd
    /// TLS files), joined as upstream joins them (`<dir>/calico-kubeconfig`).
    pub cni_net_dir: String,
    /// `CNI_CONF_NAME` (default `10-calico.conflist`): appended to the host's config
    /// directory as upstream does (`<dir>/<name>`), so `""` names the directory itself.
    pub conf_name: String,
    /// `CNI_OLD_CONF_NAME` (default `10-calico.conflist`): removed when it differs.
    pub old_conf_name: String,
    /// `TLS_ASSETS_DIR` (default `/calico-secrets`): etcd-ca, etcd-cert, etcd-key, at
    /// `<dir>/etcd-ca` and so on (`""` is no directory: nothing is copied).
    pub tls_assets_dir: String,
    /// `SKIP_CNI_BINARIES`: names not to copy, split on `,` as envconfig splits a list: no
    /// entry is trimmed (`"flannel, portmap"` skips `flannel` and ` portmap`).
    pub skip_binaries: Vec<String>,
    /// `UPDATE_CNI_BINARIES` (default true): overwrite binaries already on the host.
    pub update_binaries: bool,
    /// `CNI_NETWORK_CONFIG`: the conflist template (`""` is none, as upstream).
    pub network_config: Option<String>,
    /// `CNI_NETWORK_CONFIG_FILE`: a file holding the template (wins over the variable).
    pub network_config_file: Option<PathBuf>,
    /// `SLEEP` (default true): stay up after installing (a DaemonSet container), or exit
    /// (an init container).
    pub sleep: bool,
    /// `CALICO_API_GROUP` (default `crd.projectcalico.org/v1`).
    pub api_group: String,
    /// `TEST_FILE_PERMISSION` as given (default `0600`): the conflist's mode, read by
    /// [`Settings::conf_mode`] where upstream reads it, once the conflist is rendered.
    pub conf_permission: String,
}

/// envconfig's `*ParseError`: a variable it could not convert to its field's type (upstream
/// logs it and exits before doing anything else).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "envconfig.Process: assigning {key} to {field}: converting '{value}' to type {type_name}. details: {source}"
)]
pub struct EnvconfigError {
    pub key: &'static str,
    /// The Go field's name (`UpdateCNIBinaries`).
    pub field: &'static str,
    /// The Go field's type (`bool`).
    pub type_name: &'static str,
    pub value: String,
    #[source]
    pub source: NumError,
}

/// A boolean field as envconfig reads it: unset is the default; anything else, `""`
/// included, goes through Go's `strconv.ParseBool`.
fn env_bool(
    env: &dyn Fn(&str) -> Option<String>,
    key: &'static str,
    field: &'static str,
    default: bool,
) -> Result<bool, EnvconfigError> {
    match env(key) {
        None => Ok(default),
        Some(value) => parse_bool_go(&value).map_err(|source| EnvconfigError {
            key,
            field,
            type_name: "bool",
            value,
            source,
        }),
    }
}

/// Go's `os.FileMode` bits that `os.WriteFile` and `os.Chmod` turn into the setuid, setgid
/// and sticky bits (`syscallMode`); every other bit above the permission bits is dropped.
const GO_MODE_SETUID: u64 = 1 << 23;
const GO_MODE_SETGID: u64 = 1 << 22;
const GO_MODE_STICKY: u64 = 1 << 20;

impl Settings {
    /// The settings, read in envconfig's order (the struct's fields, the first that does
    /// not convert is the error), then the variables upstream reads with `getEnv`.
    pub fn from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<Settings, EnvconfigError> {
        let get = |k: &str, default: &str| env(k).unwrap_or_else(|| default.to_string());
        let cni_net_dir = get("CNI_NET_DIR", "/etc/cni/net.d");
        let tls_assets_dir = get("TLS_ASSETS_DIR", "/calico-secrets");
        // envconfig: a list is empty when its text is blank, else the text split on ",".
        let skip_binaries = match env("SKIP_CNI_BINARIES") {
            Some(v) if !v.trim().is_empty() => v.split(',').map(String::from).collect(),
            _ => Vec::new(),
        };
        let update_binaries = env_bool(env, "UPDATE_CNI_BINARIES", "UpdateCNIBinaries", true)?;
        let network_config = env("CNI_NETWORK_CONFIG").filter(|v| !v.is_empty());
        let network_config_file = env("CNI_NETWORK_CONFIG_FILE")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from);
        let sleep = env_bool(env, "SLEEP", "ShouldSleep", true)?;
        Ok(Settings {
            cni_net_dir,
            conf_name: get("CNI_CONF_NAME", "10-calico.conflist"),
            old_conf_name: get("CNI_OLD_CONF_NAME", "10-calico.conflist"),
            tls_assets_dir,
            skip_binaries,
            update_binaries,
            network_config,
            network_config_file,
            sleep,
            api_group: get("CALICO_API_GROUP", "crd.projectcalico.org/v1"),
            conf_permission: get("TEST_FILE_PERMISSION", "0600"),
        })
    }

    /// The conflist's mode from `TEST_FILE_PERMISSION`, as upstream reads it
    /// (`strconv.ParseUint(s, 8, 32)` into an `os.FileMode`) and as `os.WriteFile` and
    /// `os.Chmod` then apply it: the permission bits, and setuid, setgid and sticky only
    /// from Go's own bits for them (`4755` is 0755; `40000644` is 04644).
    pub fn conf_mode(&self) -> Result<u32, NumError> {
        let m = parse_uint(&self.conf_permission, 8, 32)?;
        let mut mode = (m & 0o777) as u32;
        for (go, unix) in [
            (GO_MODE_SETUID, libc::S_ISUID),
            (GO_MODE_SETGID, libc::S_ISGID),
            (GO_MODE_STICKY, libc::S_ISVTX),
        ] {
            if m & go != 0 {
                mode |= unix;
            }
        }
        Ok(mode)
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
        assert_eq!(s.tls_assets_dir, "/calico-secrets");
        assert!(s.update_binaries && s.sleep);
        assert!(s.skip_binaries.is_empty());
        assert_eq!(s.api_group, "crd.projectcalico.org/v1");
        assert_eq!(s.conf_mode(), Ok(0o600));
        let p = Paths::from_env(&env_of(&[]));
        assert_eq!(p.host_net_dir, PathBuf::from("/host/etc/cni/net.d"));
        assert_eq!(p.host_bin_dirs.len(), 2);
    }

    #[test]
    fn empty_is_empty_not_the_default() {
        let s = Settings::from_env(&env_of(&[
            ("CNI_NET_DIR", ""),
            ("CNI_CONF_NAME", ""),
            ("CNI_OLD_CONF_NAME", ""),
            ("TLS_ASSETS_DIR", ""),
            ("CALICO_API_GROUP", ""),
            ("SKIP_CNI_BINARIES", ""),
            ("CNI_NETWORK_CONFIG", ""),
            ("CNI_NETWORK_CONFIG_FILE", ""),
            ("TEST_FILE_PERMISSION", ""),
        ]))
        .unwrap();
        assert_eq!(
            (
                s.cni_net_dir.as_str(),
                s.conf_name.as_str(),
                s.old_conf_name.as_str(),
                s.tls_assets_dir.as_str(),
                s.api_group.as_str()
            ),
            ("", "", "", "", "")
        );
        assert!(s.skip_binaries.is_empty());
        assert_eq!((&s.network_config, &s.network_config_file), (&None, &None));
        assert_eq!(
            s.conf_mode().unwrap_err().to_string(),
            r#"strconv.ParseUint: parsing "": invalid syntax"#
        );
        for (key, field) in [
            ("UPDATE_CNI_BINARIES", "UpdateCNIBinaries"),
            ("SLEEP", "ShouldSleep"),
        ] {
            let e = Settings::from_env(&env_of(&[(key, "")])).unwrap_err();
            assert_eq!(
                e.to_string(),
                format!(
                    "envconfig.Process: assigning {key} to {field}: converting '' to type bool. \
                     details: strconv.ParseBool: parsing \"\": invalid syntax"
                )
            );
        }
        // envconfig's order: UpdateCNIBinaries is met before ShouldSleep.
        let e = Settings::from_env(&env_of(&[("SLEEP", "x"), ("UPDATE_CNI_BINARIES", "y")]));
        assert_eq!(e.unwrap_err().key, "UPDATE_CNI_BINARIES");
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
        // envconfig does not trim: " portmap" is not "portmap".
        assert_eq!(s.skip_binaries, ["flannel", " portmap", "", ""]);
        assert!(!s.update_binaries && !s.sleep);
        assert_eq!(s.conf_mode(), Ok(0o644));
        let blank = Settings::from_env(&env_of(&[("SKIP_CNI_BINARIES", "  ")])).unwrap();
        assert!(blank.skip_binaries.is_empty());
        let e = Settings::from_env(&env_of(&[("SLEEP", "yes")])).unwrap_err();
        assert_eq!(
            e.to_string(),
            "envconfig.Process: assigning SLEEP to ShouldSleep: converting 'yes' to type bool. \
             details: strconv.ParseBool: parsing \"yes\": invalid syntax"
        );
        let mode = |p: &str| {
            Settings::from_env(&env_of(&[("TEST_FILE_PERMISSION", p)]))
                .unwrap()
                .conf_mode()
        };
        assert!(mode("rw").is_err());
        // As upstream's installer applied them (observed with its binary).
        for (p, want) in [
            ("644", 0o644),
            ("0", 0),
            ("4755", 0o755),
            ("1777", 0o777),
            ("40000644", 0o4644),
            ("20000644", 0o2644),
            ("10000644", 0o644),
            ("4000000644", 0o644),
            ("37777777777", 0o7777),
        ] {
            assert_eq!(mode(p), Ok(want), "{p}");
        }
    }
}
