//! CNI results: one spec-1.0 model, encoded for every supported cniVersion exactly as Go's
//! libcni types print them (4-space `MarshalIndent`, no trailing newline), and parsed from
//! any of them (a delegated IPAM plugin may answer in an older version).
//!
//! - 1.0.0: keys sorted at every level; `dns` omitted when empty; `mtu` omitted when 0.
//! - 0.3.0 / 0.3.1 / 0.4.0: Go struct order, `"version"` per IP, `"dns": {}` always.
//! - 0.1.0 / 0.2.0: `ip4` / `ip6` (first IP of each family), routes by family.

use std::net::IpAddr;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::error::{CniError, CODE_DECODING_FAILURE, CODE_INCOMPATIBLE_VERSION};
use crate::support::net::IpNet;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CniResult {
    pub interfaces: Vec<Interface>,
    pub ips: Vec<IpConfig>,
    pub routes: Vec<Route>,
    pub dns: Dns,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Interface {
    #[serde(default)]
    pub name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub mac: String,
    /// 0 = not reported. Go's `int`: a negative MTU in the NetConf is reported as given.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub mtu: i64,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub sandbox: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IpConfig {
    pub address: IpNet,
    pub gateway: Option<IpAddr>,
    /// Index into `interfaces`.
    pub interface: Option<usize>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Route {
    pub dst: IpNet,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gw: Option<IpAddr>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dns {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nameservers: Vec<String>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub domain: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub search: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
}

impl Dns {
    pub fn is_empty(&self) -> bool {
        self == &Dns::default()
    }
}

fn is_zero(n: &i64) -> bool {
    *n == 0
}

// ---- wire shapes ----------------------------------------------------------------------

#[derive(Serialize, Deserialize)]
struct Ip100 {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    interface: Option<usize>,
    address: IpNet,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    gateway: Option<IpAddr>,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Result100 {
    cni_version: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    interfaces: Vec<Interface>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    ips: Vec<Ip100>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    routes: Vec<Route>,
    #[serde(default, skip_serializing_if = "Dns::is_empty")]
    dns: Dns,
}

#[derive(Serialize, Deserialize)]
struct Interface040 {
    #[serde(default)]
    name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    mac: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    sandbox: String,
}

#[derive(Serialize, Deserialize)]
struct Ip040 {
    #[serde(default)]
    version: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    interface: Option<usize>,
    address: IpNet,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    gateway: Option<IpAddr>,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Result040 {
    cni_version: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    interfaces: Vec<Interface040>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    ips: Vec<Ip040>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    routes: Vec<Route>,
    #[serde(default)]
    dns: Dns,
}

#[derive(Serialize, Deserialize)]
struct Ip020 {
    ip: IpNet,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    gateway: Option<IpAddr>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    routes: Vec<Route>,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Result020 {
    #[serde(default)]
    cni_version: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ip4: Option<Ip020>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ip6: Option<Ip020>,
    #[serde(default)]
    dns: Dns,
}

fn ip_config(address: IpNet, gateway: Option<IpAddr>, interface: Option<usize>) -> IpConfig {
    IpConfig {
        address,
        gateway,
        interface,
    }
}

/// Sorts object keys at every level (Go marshals maps in key order).
pub fn sort_keys(v: Value) -> Value {
    match v {
        Value::Object(m) => {
            let mut entries: Vec<(String, Value)> = m.into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            Value::Object(
                entries
                    .into_iter()
                    .map(|(k, v)| (k, sort_keys(v)))
                    .collect(),
            )
        }
        Value::Array(a) => Value::Array(a.into_iter().map(sort_keys).collect()),
        other => other,
    }
}

/// Go's `json.MarshalIndent(v, "", "    ")`, HTML-escaped as Go's encoder does.
pub fn to_go_json_indent<T: Serialize>(v: &T) -> Result<String, CniError> {
    let mut buf = Vec::new();
    let fmt = serde_json::ser::PrettyFormatter::with_indent(b"    ");
    let mut ser = serde_json::Serializer::with_formatter(&mut buf, fmt);
    v.serialize(&mut ser)
        .map_err(|e| CniError::internal(e.to_string()))?;
    let s = String::from_utf8(buf).map_err(|e| CniError::internal(e.to_string()))?;
    Ok(go_escape(&s))
}

/// Go escapes `<`, `>`, `&`, U+2028 and U+2029 inside strings (they cannot occur outside).
pub fn go_escape(s: &str) -> String {
    s.replace('<', "\\u003c")
        .replace('>', "\\u003e")
        .replace('&', "\\u0026")
        .replace('\u{2028}', "\\u2028")
        .replace('\u{2029}', "\\u2029")
}

/// The previous result of CHECK, parsed in the config's version (libcni's
/// `ParsePrevResult`). Its errors are untyped (999), as Go's skel reports them.
pub fn prev_result(stdin: &[u8]) -> Result<CniResult, CniError> {
    let conf: Value = serde_json::from_slice(stdin)
        .map_err(|e| CniError::internal(format!("failed to parse network config: {e}")))?;
    let Some(prev) = conf.get("prevResult").filter(|p| p.is_object()) else {
        return Err(CniError::internal("Required prevResult missing"));
    };
    let mut prev = prev.clone();
    if let (Some(v), Some(obj)) = (conf.get("cniVersion"), prev.as_object_mut()) {
        obj.insert("cniVersion".into(), v.clone());
    }
    let bytes = serde_json::to_vec(&prev).map_err(|e| CniError::internal(e.to_string()))?;
    CniResult::parse(&bytes)
        .map_err(|e| CniError::internal(format!("failed to parse prevResult: {}", e.msg)))
}

impl CniResult {
    /// Prints the result in `cni_version`'s format.
    pub fn encode(&self, cni_version: &str) -> Result<String, CniError> {
        match cni_version {
            "1.0.0" | "1.1.0" => self.encode_100(cni_version),
            "0.3.0" | "0.3.1" | "0.4.0" => self.encode_040(cni_version),
            "0.1.0" | "0.2.0" => self.encode_020(cni_version),
            other => Err(CniError::new(
                CODE_INCOMPATIBLE_VERSION,
                "incompatible CNI versions",
                super::version::incompatible_details(other),
            )),
        }
    }

    /// The 1.0 model as libcni prints it: through a map round trip, keys sorted at every
    /// level.
    fn encode_100(&self, cni_version: &str) -> Result<String, CniError> {
        let r = Result100 {
            cni_version: cni_version.into(),
            interfaces: self.interfaces.clone(),
            ips: self
                .ips
                .iter()
                .map(|i| Ip100 {
                    interface: i.interface,
                    address: i.address,
                    gateway: i.gateway,
                })
                .collect(),
            routes: self.routes.clone(),
            dns: self.dns.clone(),
        };
        let v = serde_json::to_value(&r).map_err(|e| CniError::internal(e.to_string()))?;
        to_go_json_indent(&sort_keys(v))
    }

    /// 0.3.x and 0.4.0: each address with its version.
    fn encode_040(&self, cni_version: &str) -> Result<String, CniError> {
        let r = Result040 {
            cni_version: cni_version.into(),
            interfaces: self
                .interfaces
                .iter()
                .map(|i| Interface040 {
                    name: i.name.clone(),
                    mac: i.mac.clone(),
                    sandbox: i.sandbox.clone(),
                })
                .collect(),
            ips: self
                .ips
                .iter()
                .map(|i| Ip040 {
                    version: if i.address.is_ipv4() { "4" } else { "6" }.into(),
                    interface: i.interface,
                    address: i.address,
                    gateway: i.gateway,
                })
                .collect(),
            routes: self.routes.clone(),
            dns: self.dns.clone(),
        };
        to_go_json_indent(&r)
    }

    /// 0.1.0 and 0.2.0: the first address of each family, with that family's routes.
    fn encode_020(&self, cni_version: &str) -> Result<String, CniError> {
        let family = |v4: bool| -> Option<Ip020> {
            let ip = self.ips.iter().find(|i| i.address.is_ipv4() == v4)?;
            Some(Ip020 {
                ip: ip.address,
                gateway: ip.gateway,
                routes: self
                    .routes
                    .iter()
                    .filter(|r| r.dst.is_ipv4() == v4)
                    .cloned()
                    .collect(),
            })
        };
        let r = Result020 {
            cni_version: cni_version.into(),
            ip4: family(true),
            ip6: family(false),
            dns: self.dns.clone(),
        };
        if r.ip4.is_none() && r.ip6.is_none() {
            return Err(CniError::internal("cannot convert: no valid IP addresses"));
        }
        to_go_json_indent(&r)
    }

    /// Parses a result printed in any supported version into the 1.0 model.
    pub fn parse(data: &[u8]) -> Result<CniResult, CniError> {
        let decode = |e: serde_json::Error| {
            CniError::new(
                CODE_DECODING_FAILURE,
                "failed to decode result",
                e.to_string(),
            )
        };
        let v: Value = serde_json::from_slice(data).map_err(decode)?;
        let version = v
            .get("cniVersion")
            .and_then(Value::as_str)
            .unwrap_or("0.1.0")
            .to_string();
        if version.starts_with("1.") {
            let r: Result100 = serde_json::from_value(v).map_err(decode)?;
            return Ok(CniResult {
                interfaces: r.interfaces,
                ips: r
                    .ips
                    .into_iter()
                    .map(|i| ip_config(i.address, i.gateway, i.interface))
                    .collect(),
                routes: r.routes,
                dns: r.dns,
            });
        }
        if version.starts_with("0.3.") || version == "0.4.0" {
            let r: Result040 = serde_json::from_value(v).map_err(decode)?;
            return Ok(CniResult {
                interfaces: r
                    .interfaces
                    .into_iter()
                    .map(|i| Interface {
                        name: i.name,
                        mac: i.mac,
                        mtu: 0,
                        sandbox: i.sandbox,
                    })
                    .collect(),
                ips: r
                    .ips
                    .into_iter()
                    .map(|i| ip_config(i.address, i.gateway, i.interface))
                    .collect(),
                routes: r.routes,
                dns: r.dns,
            });
        }
        let r: Result020 = serde_json::from_value(v).map_err(decode)?;
        let mut out = CniResult {
            dns: r.dns,
            ..Default::default()
        };
        for ip in [r.ip4, r.ip6].into_iter().flatten() {
            out.ips.push(ip_config(ip.ip, ip.gateway, None));
            out.routes.extend(ip.routes);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> CniResult {
        CniResult {
            interfaces: vec![
                Interface {
                    name: "calibadbeef".into(),
                    ..Default::default()
                },
                Interface {
                    name: "eth0".into(),
                    mac: "aa:bb:cc:dd:ee:ff".into(),
                    mtu: 1440,
                    sandbox: "/var/run/netns/x".into(),
                },
            ],
            ips: vec![IpConfig {
                address: "10.0.0.5/32".parse().unwrap(),
                gateway: None,
                interface: Some(1),
            }],
            routes: vec![Route {
                dst: "10.0.0.5/26".parse().unwrap(),
                gw: None,
            }],
            dns: Dns::default(),
        }
    }

    #[test]
    fn v100_sorted_keys() {
        let want = r#"{
    "cniVersion": "1.0.0",
    "interfaces": [
        {
            "name": "calibadbeef"
        },
        {
            "mac": "aa:bb:cc:dd:ee:ff",
            "mtu": 1440,
            "name": "eth0",
            "sandbox": "/var/run/netns/x"
        }
    ],
    "ips": [
        {
            "address": "10.0.0.5/32",
            "interface": 1
        }
    ],
    "routes": [
        {
            "dst": "10.0.0.5/26"
        }
    ]
}"#;
        assert_eq!(sample().encode("1.0.0").unwrap(), want);
        assert_eq!(CniResult::parse(want.as_bytes()).unwrap(), sample());
    }

    #[test]
    fn v040_struct_order_and_dns() {
        let want = r#"{
    "cniVersion": "0.3.1",
    "interfaces": [
        {
            "name": "calibadbeef"
        },
        {
            "name": "eth0",
            "mac": "aa:bb:cc:dd:ee:ff",
            "sandbox": "/var/run/netns/x"
        }
    ],
    "ips": [
        {
            "version": "4",
            "interface": 1,
            "address": "10.0.0.5/32"
        }
    ],
    "routes": [
        {
            "dst": "10.0.0.5/26"
        }
    ],
    "dns": {}
}"#;
        assert_eq!(sample().encode("0.3.1").unwrap(), want);
        let back = CniResult::parse(want.as_bytes()).unwrap();
        assert_eq!(back.ips, sample().ips);
        assert_eq!(back.interfaces[1].mtu, 0);
    }

    #[test]
    fn v020_legacy_shape() {
        let want = r#"{
    "cniVersion": "0.2.0",
    "ip4": {
        "ip": "10.0.0.5/32",
        "routes": [
            {
                "dst": "10.0.0.5/26"
            }
        ]
    },
    "dns": {}
}"#;
        assert_eq!(sample().encode("0.2.0").unwrap(), want);
        let back = CniResult::parse(want.as_bytes()).unwrap();
        assert_eq!(back.ips[0].interface, None);
        assert_eq!(back.routes, sample().routes);
        // Missing cniVersion parses as 0.1.0's shape.
        let legacy =
            CniResult::parse(br#"{"ip4":{"ip":"10.1.0.2/24","gateway":"10.1.0.1"}}"#).unwrap();
        assert_eq!(legacy.ips[0].gateway, Some("10.1.0.1".parse().unwrap()));
        let empty = CniResult::default();
        assert_eq!(
            empty.encode("0.2.0").unwrap_err().msg,
            "cannot convert: no valid IP addresses"
        );
    }

    #[test]
    fn dual_stack_and_escaping() {
        let mut r = sample();
        r.ips.push(IpConfig {
            address: "fd00::5/128".parse().unwrap(),
            gateway: None,
            interface: Some(1),
        });
        let s = r.encode("0.4.0").unwrap();
        assert!(s.contains("\"version\": \"6\""));
        assert_eq!(go_escape("a<b>&c"), "a\\u003cb\\u003e\\u0026c");
        let v1 = r.encode("0.2.0").unwrap();
        assert!(v1.contains("\"ip6\""));
    }
}
