//! What `calico` keeps on disk for the `azure-vnet-ipam` plugin (upstream's
//! cni-plugin/internal/pkg/azure, used by `AddIPAM`/`DeleteIPAM` in its utils package).
//!
//! azure-vnet-ipam releases an address only when DEL names it: the config must carry
//! `ipam.ipAddress` (no prefix length) and `ipam.subnet`. So ADD keeps, per network, the
//! subnet of the last address it was given (`<dir>/<network>/network.json`) and, per
//! attachment, the addresses it was given (`<dir>/<network>/<containerID>-<ifname>`); the
//! next ADD on the network asks for the same subnet, and DEL reads both back. The files are
//! upstream's, byte for byte (Go's `encoding/json` of its two structs: exported field names as
//! keys, a nil list as `null`, HTML characters escaped), written by rename as
//! `natefinch/atomic` writes them (a new file mode 0600, an existing file's mode kept), so an
//! attachment made by either implementation is released by the other.
//!
//! Reading follows upstream's loaders too: a file that cannot be read counts as absent (a
//! first ADD, a DEL of an attachment never recorded), and a file that can be read must
//! decode as Go would decode it into the struct (keys matched regardless of case, a `null`
//! field left alone, a wrong type refused with Go's text).

use std::fs::{self, DirBuilder, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::{Map, Value};
use tracing::{debug, info, warn};

use crate::skel::result::go_escape;
use crate::skel::CniResult;

/// The `ipam.type` this module serves.
pub const PLUGIN: &str = "azure-vnet-ipam";

/// Upstream's state directory (one subdirectory per network name).
pub const NETWORKS_DIR: &str = "/var/run/calico/azure/networks";

/// The file of a network's state, in its directory.
const NETWORK_FILE: &str = "network.json";

#[derive(Debug, thiserror::Error)]
pub enum AzureError {
    /// A state file that is not JSON.
    #[error("failed to decode {path}: {source}")]
    Decode {
        path: PathBuf,
        source: serde_json::Error,
    },
    /// A state file whose JSON does not fit the struct (Go's `UnmarshalTypeError` text).
    #[error("failed to decode {path}: json: cannot unmarshal {found} into Go {target}")]
    Type {
        path: PathBuf,
        found: &'static str,
        target: String,
    },
    /// The network configuration (stdin) could not be rewritten for the plugin.
    #[error("failed to parse network config for azure-vnet-ipam: {0}")]
    Config(serde_json::Error),
    /// The network configuration has no `ipam` object to add the plugin's values to.
    #[error("failed to parse network config for azure-vnet-ipam: no \"ipam\" object")]
    NoIpam,
    #[error("failed to create {path}: {source}")]
    CreateDir { path: PathBuf, source: io::Error },
    #[error("failed to write {path}: {source}")]
    Write { path: PathBuf, source: io::Error },
    #[error("failed to encode {path}: {source}")]
    Encode {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("failed to remove {path}: {source}")]
    Remove { path: PathBuf, source: io::Error },
}

type Result<T> = std::result::Result<T, AzureError>;

/// Where the state lives: upstream's directory (`NETWORKS_DIR`), or another for unit tests.
#[derive(Clone, Debug)]
pub struct Store {
    dir: PathBuf,
}

impl Default for Store {
    fn default() -> Self {
        Store {
            dir: PathBuf::from(NETWORKS_DIR),
        }
    }
}

/// upstream's `AzureNetwork`: the subnets an ADD on the network was last given from.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct AzureNetwork {
    #[serde(rename = "Name")]
    pub name: String,
    /// `None` is Go's nil list (`null` on disk).
    #[serde(rename = "Subnets")]
    pub subnets: Option<Vec<String>>,
}

/// upstream's `AzureEndpoint`: the addresses one attachment was given.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct AzureEndpoint {
    #[serde(rename = "Network")]
    pub network: String,
    #[serde(rename = "ContainerID")]
    pub container_id: String,
    #[serde(rename = "Interface")]
    pub interface: String,
    #[serde(rename = "Addresses")]
    pub addresses: Option<Vec<String>>,
}

impl AzureNetwork {
    pub fn subnets(&self) -> &[String] {
        self.subnets.as_deref().unwrap_or_default()
    }
}

impl AzureEndpoint {
    pub fn addresses(&self) -> &[String] {
        self.addresses.as_deref().unwrap_or_default()
    }
}

impl Store {
    #[cfg(test)]
    pub fn at(dir: &Path) -> Store {
        Store {
            dir: dir.to_path_buf(),
        }
    }

    fn network_dir(&self, network: &str) -> PathBuf {
        self.dir.join(network)
    }

    pub fn network_path(&self, network: &str) -> PathBuf {
        self.network_dir(network).join(NETWORK_FILE)
    }

    pub fn endpoint_path(&self, network: &str, container_id: &str, ifname: &str) -> PathBuf {
        self.network_dir(network)
            .join(format!("{container_id}-{ifname}"))
    }

    /// The network `name` as stored, or with no subnets when nothing readable is stored.
    pub fn load_network(&self, name: &str) -> Result<AzureNetwork> {
        let mut net = AzureNetwork {
            name: name.to_string(),
            subnets: None,
        };
        let path = self.network_path(name);
        let Some(fields) = read_object(&path, "AzureNetwork")? else {
            return Ok(net);
        };
        // The name is type-checked as Go does, but the network is the one asked for.
        let mut ignored = None;
        for (key, value) in &fields {
            match () {
                _ if key.eq_ignore_ascii_case("Name") => {
                    decode_string(&path, "AzureNetwork.Name", value, &mut ignored)?
                }
                _ if key.eq_ignore_ascii_case("Subnets") => {
                    net.subnets = decode_list(&path, "AzureNetwork.Subnets", value)?
                }
                _ => {}
            }
        }
        Ok(net)
    }

    /// The attachment's endpoint as stored, or with no addresses when nothing readable is
    /// stored.
    pub fn load_endpoint(
        &self,
        network: &str,
        container_id: &str,
        ifname: &str,
    ) -> Result<AzureEndpoint> {
        let mut ep = AzureEndpoint {
            network: network.to_string(),
            container_id: container_id.to_string(),
            interface: ifname.to_string(),
            addresses: None,
        };
        let path = self.endpoint_path(network, container_id, ifname);
        let Some(fields) = read_object(&path, "AzureEndpoint")? else {
            return Ok(ep);
        };
        // The identity fields are type-checked as Go does, but the file is the one named by
        // this attachment: its own name is what DEL removes.
        let mut ignored = None;
        for (key, value) in &fields {
            match () {
                _ if key.eq_ignore_ascii_case("Network") => {
                    decode_string(&path, "AzureEndpoint.Network", value, &mut ignored)?
                }
                _ if key.eq_ignore_ascii_case("ContainerID") => {
                    decode_string(&path, "AzureEndpoint.ContainerID", value, &mut ignored)?
                }
                _ if key.eq_ignore_ascii_case("Interface") => {
                    decode_string(&path, "AzureEndpoint.Interface", value, &mut ignored)?
                }
                _ if key.eq_ignore_ascii_case("Addresses") => {
                    ep.addresses = decode_list(&path, "AzureEndpoint.Addresses", value)?
                }
                _ => {}
            }
        }
        Ok(ep)
    }

    /// Stores the network (creating its directory).
    pub fn write_network(&self, net: &AzureNetwork) -> Result<()> {
        let dir = self.network_dir(&net.name);
        DirBuilder::new()
            .recursive(true)
            .mode(0o777)
            .create(&dir)
            .map_err(|source| AzureError::CreateDir {
                path: dir.clone(),
                source,
            })?;
        let path = self.network_path(&net.name);
        write_go_json(&path, net)?;
        info!(network = %net.name, subnets = ?net.subnets(), "Stored AzureNetwork");
        Ok(())
    }

    /// Stores the endpoint, in the directory its network's write made.
    pub fn write_endpoint(&self, ep: &AzureEndpoint) -> Result<()> {
        let path = self.endpoint_path(&ep.network, &ep.container_id, &ep.interface);
        write_go_json(&path, ep)?;
        info!(path = %path.display(), addresses = ?ep.addresses(), "Stored AzureEndpoint");
        Ok(())
    }

    pub fn delete_endpoint(&self, ep: &AzureEndpoint) -> Result<()> {
        let path = self.endpoint_path(&ep.network, &ep.container_id, &ep.interface);
        info!(path = %path.display(), "Deleting AzureEndpoint");
        fs::remove_file(&path).map_err(|source| AzureError::Remove { path, source })
    }

    /// After a successful ADD: the network's subnet becomes that of the first address, and
    /// the attachment's addresses are recorded (upstream's `AddIPAM`). A result without
    /// addresses records nothing (the caller refuses it).
    pub fn record(
        &self,
        network: &str,
        container_id: &str,
        ifname: &str,
        result: &CniResult,
    ) -> Result<()> {
        let Some(first) = result.ips.first() else {
            return Ok(());
        };
        let subnet = first.address.masked().to_string();
        self.write_network(&AzureNetwork {
            name: network.to_string(),
            subnets: Some(vec![subnet.clone()]),
        })?;
        info!(subnet = %subnet, "Stored azure subnet on disk");
        self.write_endpoint(&recorded_endpoint(network, container_id, ifname, result))
    }
}

/// The endpoint an ADD with `result` records: its addresses without prefix lengths.
pub fn recorded_endpoint(
    network: &str,
    container_id: &str,
    ifname: &str,
    result: &CniResult,
) -> AzureEndpoint {
    AzureEndpoint {
        network: network.to_string(),
        container_id: container_id.to_string(),
        interface: ifname.to_string(),
        addresses: Some(
            result
                .ips
                .iter()
                .map(|ip| ip.address.addr.to_string())
                .collect(),
        ),
    }
}

/// The subnet the recorded network asks for (`subnets[0]`), if any.
fn first_subnet(net: &AzureNetwork) -> Option<&str> {
    net.subnets().first().map(String::as_str)
}

/// ADD's configuration: `ipam.subnet` set to the network's stored subnet; unchanged when
/// none is stored (upstream's `MutateConfigAdd`).
pub fn add_stdin(stdin: &[u8], net: &AzureNetwork) -> Result<Vec<u8>> {
    let Some(subnet) = first_subnet(net) else {
        info!("No Azure subnets defined - don't mutate config (add)");
        return Ok(stdin.to_vec());
    };
    let out = with_ipam_values(stdin, &[("subnet", subnet)])?;
    info!(subnet, "Updated CNI network configuration for Azure Add");
    Ok(out)
}

/// DEL's configuration: `ipam.ipAddress` (the first recorded address, without a prefix
/// length) and `ipam.subnet` (the network's); unchanged when either is missing (upstream's
/// `MutateConfigDel`).
pub fn del_stdin(stdin: &[u8], net: &AzureNetwork, ep: &AzureEndpoint) -> Result<Vec<u8>> {
    let Some(address) = ep.addresses().first() else {
        info!("No addresses defined - don't mutate config (delete)");
        return Ok(stdin.to_vec());
    };
    let Some(subnet) = first_subnet(net) else {
        info!("No Azure subnets defined - don't mutate config (delete)");
        return Ok(stdin.to_vec());
    };
    let ip = address.split('/').next().unwrap_or_default();
    let out = with_ipam_values(stdin, &[("ipAddress", ip), ("subnet", subnet)])?;
    info!(
        subnet,
        ipAddress = ip,
        "Updated CNI network configuration for Azure Del"
    );
    Ok(out)
}

/// `stdin` with `values` set in its `ipam` object; everything else kept as it was.
fn with_ipam_values(stdin: &[u8], values: &[(&str, &str)]) -> Result<Vec<u8>> {
    let mut conf: Value = serde_json::from_slice(stdin).map_err(AzureError::Config)?;
    let Some(Value::Object(ipam)) = conf.get_mut("ipam") else {
        return Err(AzureError::NoIpam);
    };
    for (key, value) in values {
        ipam.insert((*key).to_string(), Value::from(*value));
    }
    serde_json::to_vec(&conf).map_err(AzureError::Config)
}

/// The JSON object in `path`; `None` when the file cannot be read (upstream's loaders
/// ignore that; what is not a regular file is not opened, `crate::support::input_file`) or holds
/// `null` (which Go decodes into a struct as nothing).
fn read_object(path: &Path, go_type: &str) -> Result<Option<Map<String, Value>>> {
    let raw = match crate::support::input_file::read(path) {
        Ok(raw) => raw,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            debug!(path = %path.display(), "no Azure state stored");
            return Ok(None);
        }
        Err(e) => {
            warn!(path = %path.display(), error = %e, "Azure state unreadable; taken as absent");
            return Ok(None);
        }
    };
    info!(path = %path.display(), content = %String::from_utf8_lossy(&raw), "Loaded Azure state");
    let value: Value = serde_json::from_slice(&raw).map_err(|source| AzureError::Decode {
        path: path.to_path_buf(),
        source,
    })?;
    match value {
        Value::Object(m) => Ok(Some(m)),
        Value::Null => Ok(None),
        other => Err(type_error(
            path,
            &other,
            format!("value of type azure.{go_type}"),
        )),
    }
}

fn type_error(path: &Path, found: &Value, target: String) -> AzureError {
    AzureError::Type {
        path: path.to_path_buf(),
        found: crate::config::gotypes::json_kind(found),
        target,
    }
}

/// A string field: `null` leaves `slot` as it was.
fn decode_string(path: &Path, field: &str, v: &Value, slot: &mut Option<String>) -> Result<()> {
    match v {
        Value::Null => Ok(()),
        Value::String(s) => {
            *slot = Some(s.clone());
            Ok(())
        }
        other => Err(type_error(
            path,
            other,
            format!("struct field {field} of type string"),
        )),
    }
}

/// A `[]string` field: `null` is the nil list.
fn decode_list(path: &Path, field: &str, v: &Value) -> Result<Option<Vec<String>>> {
    match v {
        Value::Null => Ok(None),
        Value::Array(items) => items
            .iter()
            .map(|item| match item {
                Value::String(s) => Ok(s.clone()),
                // A null element is Go's zero value.
                Value::Null => Ok(String::new()),
                other => Err(type_error(
                    path,
                    other,
                    format!("struct field {field} of type string"),
                )),
            })
            .collect::<Result<Vec<_>>>()
            .map(Some),
        other => Err(type_error(
            path,
            other,
            format!("struct field {field} of type []string"),
        )),
    }
}

/// `v` as Go's `json.Marshal` prints it, written by rename: a temporary file beside `path`
/// (mode 0600, or the mode `path` already has), fsynced, renamed over it.
fn write_go_json<T: Serialize>(path: &Path, v: &T) -> Result<()> {
    let json = serde_json::to_string(v).map_err(|source| AzureError::Encode {
        path: path.to_path_buf(),
        source,
    })?;
    let json = go_escape(&json);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    let written = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(json.as_bytes())?;
        f.sync_all()?;
        match fs::metadata(path) {
            Ok(existing) => {
                let mode = existing.permissions().mode() & 0o7777;
                f.set_permissions(fs::Permissions::from_mode(mode))?;
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        fs::rename(&tmp, path)
    })();
    if let Err(source) = written {
        let _ = fs::remove_file(&tmp);
        return Err(AzureError::Write {
            path: path.to_path_buf(),
            source,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::skel::result::IpConfig;
    use crate::support::net::IpNet;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("azure-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    fn result(addrs: &[&str]) -> CniResult {
        CniResult {
            ips: addrs
                .iter()
                .map(|a| IpConfig {
                    address: a.parse::<IpNet>().expect("test address"),
                    gateway: None,
                    interface: None,
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn record_writes_upstreams_files() {
        let dir = scratch("record");
        let store = Store::at(&dir);
        store
            .record(
                "net<1>",
                "cid",
                "eth0",
                &result(&["10.1.2.3/24", "fd00::5/64"]),
            )
            .expect("record");
        let net = fs::read_to_string(dir.join("net<1>/network.json")).expect("network file");
        assert_eq!(
            net,
            r#"{"Name":"net\u003c1\u003e","Subnets":["10.1.2.0/24"]}"#
        );
        let ep_path = dir.join("net<1>/cid-eth0");
        let ep = fs::read_to_string(&ep_path).expect("endpoint file");
        assert_eq!(
            ep,
            r#"{"Network":"net\u003c1\u003e","ContainerID":"cid","Interface":"eth0","Addresses":["10.1.2.3","fd00::5"]}"#
        );
        let mode = fs::metadata(&ep_path).expect("stat").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        // The loaders read them back; a rewrite keeps the file's mode.
        let loaded = store.load_endpoint("net<1>", "cid", "eth0").expect("load");
        assert_eq!(loaded.addresses(), ["10.1.2.3", "fd00::5"]);
        assert_eq!(
            store.load_network("net<1>").expect("load").subnets(),
            ["10.1.2.0/24"]
        );
        fs::set_permissions(&ep_path, fs::Permissions::from_mode(0o644)).expect("chmod");
        store.write_endpoint(&loaded).expect("rewrite");
        let mode = fs::metadata(&ep_path).expect("stat").permissions().mode() & 0o777;
        assert_eq!(mode, 0o644);
        store.delete_endpoint(&loaded).expect("delete");
        assert!(!ep_path.exists());
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn loading_decodes_as_go_does() {
        let dir = scratch("load");
        let store = Store::at(&dir);
        // Nothing stored: no subnets, no addresses.
        assert_eq!(store.load_network("n").expect("absent").subnets, None);
        assert_eq!(
            store
                .load_endpoint("n", "c", "i")
                .expect("absent")
                .addresses,
            None
        );
        fs::create_dir_all(dir.join("n")).expect("mkdir");
        // Keys in any case; null keeps the zero value.
        fs::write(
            dir.join("n/network.json"),
            r#"{"name":"n","SUBNETS":["10.0.0.0/8"]}"#,
        )
        .expect("write");
        assert_eq!(
            store.load_network("n").expect("load").subnets(),
            ["10.0.0.0/8"]
        );
        fs::write(dir.join("n/c-i"), r#"{"Network":null,"Addresses":null}"#).expect("write");
        assert_eq!(
            store.load_endpoint("n", "c", "i").expect("load").addresses,
            None
        );
        fs::write(dir.join("n/network.json"), r#"{"Subnets":"10.0.0.0/8"}"#).expect("write");
        let e = store.load_network("n").expect_err("wrong type");
        assert!(
            e.to_string().ends_with(
                "json: cannot unmarshal string into Go struct field AzureNetwork.Subnets of type []string"
            ),
            "{e}"
        );
        fs::write(dir.join("n/c-i"), "[1]").expect("write");
        let e = store.load_endpoint("n", "c", "i").expect_err("wrong type");
        assert!(
            e.to_string().ends_with(
                "json: cannot unmarshal array into Go value of type azure.AzureEndpoint"
            ),
            "{e}"
        );
        fs::write(dir.join("n/c-i"), "{").expect("write");
        assert!(matches!(
            store.load_endpoint("n", "c", "i"),
            Err(AzureError::Decode { .. })
        ));
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn configs_carry_the_stored_values() {
        let stdin = br#"{"name":"n","ipam":{"type":"azure-vnet-ipam","x":1}}"#;
        let none = AzureNetwork::default();
        assert_eq!(add_stdin(stdin, &none).expect("add"), stdin.to_vec());
        let net = AzureNetwork {
            name: "n".into(),
            subnets: Some(vec!["10.1.0.0/16".into()]),
        };
        let add: Value =
            serde_json::from_slice(&add_stdin(stdin, &net).expect("add")).expect("json");
        assert_eq!(
            add["ipam"],
            serde_json::json!({"type":"azure-vnet-ipam","x":1,"subnet":"10.1.0.0/16"})
        );
        let ep = AzureEndpoint {
            addresses: Some(vec!["10.1.0.7/16".into()]),
            ..Default::default()
        };
        let del: Value =
            serde_json::from_slice(&del_stdin(stdin, &net, &ep).expect("del")).expect("json");
        assert_eq!(del["ipam"]["ipAddress"], "10.1.0.7");
        assert_eq!(del["ipam"]["subnet"], "10.1.0.0/16");
        // Without a subnet, or without an address, DEL's config is left alone.
        assert_eq!(del_stdin(stdin, &none, &ep).expect("del"), stdin.to_vec());
        assert_eq!(
            del_stdin(stdin, &net, &AzureEndpoint::default()).expect("del"),
            stdin.to_vec()
        );
        assert!(matches!(
            add_stdin(br#"{"name":"n","ipam":[]}"#, &net),
            Err(AzureError::NoIpam)
        ));
    }
}
