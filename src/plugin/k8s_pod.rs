//! The Kubernetes pod features of `calico` ADD (k8s.go `CmdAddK8s`): with `policy.type:
//! k8s` the pod and its namespace are read once (together, on one connection) and give the
//! endpoint its labels, ports, profiles, generateName and service account; annotations
//! (namespace first, the pod's overriding) choose IP pools and families, fix addresses
//! (`ipAddrs`, through Calico IPAM; `ipAddrsNoIpam`, without it), add floating IPs, a MAC
//! and allowed source prefixes. Error texts are upstream's.

use std::collections::BTreeMap;
use std::net::IpAddr;

use serde_json::Value;

use crate::calico_ipam::kubevirt::{self, PodVmi};
use crate::config::IpamKind;
use crate::config::NetConf;
use crate::datastore::kubernetes::client::KubeClient;
use crate::datastore::kubernetes::{core_objects, pods};
use crate::datastore::model::WorkloadEndpoint;
use crate::datastore::DatastoreError;
use crate::error::{AnnotationError, Error, HostLocalError, JsonValueError, Result};
use crate::support::gojson;

const ANN_IPV4_POOLS: &str = "cni.projectcalico.org/ipv4pools";
const ANN_IPV6_POOLS: &str = "cni.projectcalico.org/ipv6pools";
const ANN_IP_FAMILIES: &str = "cni.projectcalico.org/ipFamilies";
const ANN_IP_ADDRS: &str = "cni.projectcalico.org/ipAddrs";
const ANN_IP_ADDRS_NO_IPAM: &str = "cni.projectcalico.org/ipAddrsNoIpam";
const ANN_HW_ADDR: &str = "cni.projectcalico.org/hwAddr";

/// The node's pod CIDRs by family (k8s.go `getPodCidrs`, `getIPsByFamily`), for host-local's
/// `usePodCidr`; the node is `kubernetes.node_name`, else this node.
pub async fn node_pod_cidrs(call: &crate::plugin::Call) -> Result<(String, String)> {
    let conf = &call.conf;
    let node = if conf.kubernetes.node_name.is_empty() {
        call.ids.node.clone()
    } else {
        conf.kubernetes.node_name.clone()
    };
    let client = call.ds.plugin_kube_client(conf).await?;
    let n = core_objects::node(&client, &node).await?;
    let cidrs = n.spec.and_then(|s| s.pod_cidrs).unwrap_or_default();
    if cidrs.is_empty() {
        return Err(HostLocalError::NoPodCidr(node).into());
    }
    let (mut v4, mut v6) = (String::new(), String::new());
    for c in &cidrs {
        let net: crate::support::net::IpNet = c.parse().map_err(Error::Cidr)?;
        if net.version() == 4 {
            v4 = c.clone();
        } else {
            v6 = c.clone();
        }
    }
    if cidrs.len() > 1 && (v4.is_empty() || v6.is_empty()) {
        return Err(HostLocalError::PodCidrsOfOneFamily.into());
    }
    Ok((v4, v6))
}

/// What the pod and its namespace say.
#[derive(Clone, Debug, Default)]
pub struct PodInfo {
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    pub namespace_annotations: BTreeMap<String, String>,
    pub namespace_labels: BTreeMap<String, String>,
    pub ports: Vec<Value>,
    pub profiles: Vec<String>,
    pub generate_name: String,
    pub service_account: String,
    /// The endpoint the pod is on the Kubernetes datastore (scheduled, not host-networked).
    pub endpoint: Option<WorkloadEndpoint>,
    /// The KubeVirt VMI that controls the pod: `None` when the pod was not read, `Some(None)`
    /// when no VMI controls it (calico-ipam then need not read the pod again).
    pub kubevirt: Option<Option<PodVmi>>,
}

/// Reads the namespace and the pod (both requests in flight together; the namespace's
/// error first, as upstream reads it first), at the latest revision as upstream does.
pub async fn read(client: &KubeClient, namespace: &str, pod: &str) -> Result<PodInfo> {
    let (ns, p) = tokio::join!(
        core_objects::namespace(client, namespace),
        core_objects::pod(client, namespace, pod),
    );
    let ns = ns?;
    let p = p?;
    let wep = pods::pod_to_endpoint(&p).map_err(DatastoreError::PodConversion)?;
    let spec = p.spec.as_ref();
    let on_node = spec
        .and_then(|s| s.node_name.as_deref())
        .is_some_and(|n| !n.is_empty())
        && !spec.and_then(|s| s.host_network).unwrap_or(false);
    Ok(PodInfo {
        endpoint: on_node.then(|| wep.clone()),
        labels: wep.metadata.labels.clone().unwrap_or_default(),
        annotations: p.metadata.annotations.clone().unwrap_or_default(),
        namespace_annotations: ns.metadata.annotations.clone().unwrap_or_default(),
        namespace_labels: ns.metadata.labels.clone().unwrap_or_default(),
        ports: wep.spec.ports,
        profiles: wep.spec.profiles,
        generate_name: wep.metadata.generate_name,
        service_account: wep.spec.service_account_name,
        kubevirt: Some(kubevirt::pod_vmi(&p)),
    })
}

impl PodInfo {
    fn pod_or_namespace(&self, key: &str) -> String {
        match self.annotations.get(key).filter(|v| !v.is_empty()) {
            Some(v) => v.clone(),
            None => self
                .namespace_annotations
                .get(key)
                .cloned()
                .unwrap_or_default(),
        }
    }

    /// The IPAM stdin with the pool and family annotations applied (calico-ipam only), or
    /// None when there are none.
    pub fn ipam_stdin(&self, stdin: &[u8]) -> Result<Option<Vec<u8>>> {
        let v4 = self.pod_or_namespace(ANN_IPV4_POOLS);
        let v6 = self.pod_or_namespace(ANN_IPV6_POOLS);
        let families = self.pod_or_namespace(ANN_IP_FAMILIES);
        if v4.is_empty() && v6.is_empty() && families.is_empty() {
            return Ok(None);
        }
        let mut data: Value = serde_json::from_slice(stdin)?;
        let Some(ipam) = data.get_mut("ipam").and_then(Value::as_object_mut) else {
            return Err(AnnotationError::IpamStdinNotAnObject.into());
        };
        // Upstream returns Go's error as it is here.
        let list = |raw: &str| -> Result<Vec<String>> { Ok(gojson::string_list(raw)?) };
        if !v4.is_empty() {
            ipam.insert("ipv4_pools".into(), serde_json::json!(list(&v4)?));
        }
        if !v6.is_empty() {
            ipam.insert("ipv6_pools".into(), serde_json::json!(list(&v6)?));
        }
        if !families.is_empty() {
            let (mut a4, mut a6) = ("false", "false");
            for f in list(&families)? {
                match f.as_str() {
                    "IPv4" => a4 = "true",
                    "IPv6" => a6 = "true",
                    _ => return Err(AnnotationError::IpFamilies(families).into()),
                }
            }
            ipam.insert("assign_ipv4".into(), Value::String(a4.into()));
            ipam.insert("assign_ipv6".into(), Value::String(a6.into()));
        }
        Ok(Some(serde_json::to_vec(&data)?))
    }

    /// Where the addresses come from.
    pub fn address_source(&self, conf: &NetConf) -> Result<AddressSource> {
        let ip_addrs = self
            .annotations
            .get(ANN_IP_ADDRS)
            .cloned()
            .unwrap_or_default();
        let no_ipam = self
            .annotations
            .get(ANN_IP_ADDRS_NO_IPAM)
            .cloned()
            .unwrap_or_default();
        let ipam_type = &conf.ipam.ipam_type;
        let calico_ipam = IpamKind::of(ipam_type) == IpamKind::Calico;
        match (ip_addrs.is_empty(), no_ipam.is_empty()) {
            (true, true) => Ok(AddressSource::Ipam),
            (false, false) => Err(AnnotationError::BothAddressAnnotations.into()),
            (true, false) => {
                if !calico_ipam {
                    return Err(AnnotationError::IpamNotCalico {
                        annotation: "ipAddrsNoIpam",
                        ipam_type: ipam_type.clone(),
                    }
                    .into());
                }
                if !conf.feature_control.ip_addrs_no_ipam {
                    return Err(AnnotationError::FeatureDisabled("ip_addrs_no_ipam").into());
                }
                Ok(AddressSource::NoIpam(addresses(
                    &no_ipam,
                    ANN_IP_ADDRS_NO_IPAM,
                )?))
            }
            (false, true) => {
                if !calico_ipam {
                    return Err(AnnotationError::IpamNotCalico {
                        annotation: "ipAddrs",
                        ipam_type: ipam_type.clone(),
                    }
                    .into());
                }
                Ok(AddressSource::IpAddrs(addresses(&ip_addrs, ANN_IP_ADDRS)?))
            }
        }
    }

    /// `floatingIPs`: the external addresses, when the feature is on.
    pub fn floating_ips(&self, conf: &NetConf) -> Result<Vec<String>> {
        let Some(raw) = self
            .annotations
            .get(pods::ANNOTATION_FLOATING_IPS)
            .filter(|r| !r.is_empty())
        else {
            return Ok(Vec::new());
        };
        if !conf.feature_control.floating_ips {
            return Err(AnnotationError::FeatureDisabled("floating_ips").into());
        }
        gojson::string_list(raw).map_err(|e| json_value(raw, e).into())
    }

    /// `allowedSourcePrefixes`.
    pub fn source_prefixes(&self) -> Result<Vec<String>> {
        Ok(pods::source_prefixes(&self.annotations).map_err(DatastoreError::PodConversion)?)
    }

    /// `hwAddr`: the MAC for the pod's interface. Present, it must be one Go's
    /// `net.ParseMAC` takes (an empty value too is refused, as upstream), and an Ethernet
    /// one: the 8- and 20-octet forms parse, and the kernel then refuses them.
    pub fn hw_addr(&self) -> Result<Option<[u8; 6]>> {
        let Some(raw) = self.annotations.get(ANN_HW_ADDR) else {
            return Ok(None);
        };
        let octets = parse_mac(raw).ok_or_else(|| AnnotationError::InvalidMac {
            raw: raw.clone(),
            annotation: ANN_HW_ADDR,
        })?;
        let mac = <[u8; 6]>::try_from(octets.as_slice()).map_err(|_| {
            AnnotationError::MacNotEthernet {
                raw: raw.clone(),
                annotation: ANN_HW_ADDR,
            }
        })?;
        Ok(Some(mac))
    }
}

/// Go's `net.ParseMAC`: 6, 8 or 20 octets, as `xx:xx:…` or `xx-xx-…` (one separator
/// throughout) or `xxxx.xxxx.…`.
fn parse_mac(s: &str) -> Option<Vec<u8>> {
    let b = s.as_bytes();
    if b.len() < 14 {
        return None;
    }
    let valid_count = |n: usize| matches!(n, 6 | 8 | 20);
    let hex = |g: &[u8]| {
        std::str::from_utf8(g)
            .ok()
            .and_then(|g| u8::from_str_radix(g, 16).ok())
    };
    let all_hex = |g: &[u8]| g.iter().all(u8::is_ascii_hexdigit);
    if b[2] == b':' || b[2] == b'-' {
        if !(b.len() + 1).is_multiple_of(3) || !valid_count((b.len() + 1) / 3) {
            return None;
        }
        let sep = b[2];
        let mut out = Vec::new();
        for (i, group) in b.chunks(3).enumerate() {
            let (digits, rest) = group.split_at(2);
            let last = (i + 1) * 3 > b.len();
            if !all_hex(digits) || (!last && rest != [sep]) || (last && !rest.is_empty()) {
                return None;
            }
            out.push(hex(digits)?);
        }
        return Some(out);
    }
    if b[4] == b'.' {
        if !(b.len() + 1).is_multiple_of(5) || !valid_count(2 * (b.len() + 1) / 5) {
            return None;
        }
        let mut out = Vec::new();
        for (i, group) in b.chunks(5).enumerate() {
            let (digits, rest) = group.split_at(4);
            let last = (i + 1) * 5 > b.len();
            if !all_hex(digits) || (!last && rest != b".") || (last && !rest.is_empty()) {
                return None;
            }
            out.push(hex(&digits[..2])?);
            out.push(hex(&digits[2..])?);
        }
        return Some(out);
    }
    None
}

/// Where a pod's addresses come from.
#[derive(Clone, Debug, PartialEq)]
pub enum AddressSource {
    Ipam,
    /// Through Calico IPAM, one AssignIP per address.
    IpAddrs(Vec<IpAddr>),
    /// Used as given, with no IPAM record.
    NoIpam(Vec<IpAddr>),
}

/// `raw` refused by the JSON parser (Go's text: `failed to parse '<raw>' as JSON: ...`).
fn json_value(raw: &str, source: gojson::GoJsonError) -> JsonValueError {
    JsonValueError {
        raw: raw.to_string(),
        source,
    }
}

/// `validateAndExtractIPs`: a JSON list of at most one IPv4 and one IPv6 address.
fn addresses(raw: &str, annotation: &'static str) -> Result<Vec<IpAddr>> {
    let list: Vec<String> = gojson::string_list(raw).map_err(|e| {
        Error::chain(
            format!("failed to parse IPs {raw} for annotation \"{annotation}\""),
            json_value(raw, e),
        )
    })?;
    if list.is_empty() {
        return Err(AnnotationError::NoAddresses(annotation).into());
    }
    let (mut v4, mut v6) = (false, false);
    let mut out = Vec::new();
    for s in &list {
        let ip: IpAddr = s.parse().map_err(|source| Error::InvalidIp {
            input: s.clone(),
            source,
        })?;
        let seen = if ip.is_ipv4() { &mut v4 } else { &mut v6 };
        if *seen {
            return Err(AnnotationError::TwoAddressesOfFamily {
                family: if ip.is_ipv4() { 4 } else { 6 },
                annotation,
            }
            .into());
        }
        *seen = true;
        out.push(ip);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Upstream's texts, the parser's error kept under them.
    #[test]
    fn address_annotation_errors_keep_their_cause() {
        let e = addresses("[nope", ANN_IP_ADDRS).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "failed to parse IPs [nope for annotation \"{ANN_IP_ADDRS}\": failed to parse \
                 '[nope' as JSON: invalid character 'o' in literal null (expecting 'u')"
            )
        );
        let Error::Chain { source, .. } = &e else {
            panic!("not a chain: {e:?}");
        };
        assert!(matches!(**source, Error::JsonValue(_)), "{source:?}");
        let e = addresses(r#"["10.0.0.300"]"#, ANN_IP_ADDRS).unwrap_err();
        assert_eq!(e.to_string(), "invalid IP format: 10.0.0.300");
        assert!(matches!(e, Error::InvalidIp { .. }), "{e:?}");
    }

    fn info(pod: &[(&str, &str)], ns: &[(&str, &str)]) -> PodInfo {
        let m = |kv: &[(&str, &str)]| {
            kv.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        PodInfo {
            annotations: m(pod),
            namespace_annotations: m(ns),
            ..Default::default()
        }
    }

    fn conf(extra: &str) -> NetConf {
        NetConf::parse(
            format!(r#"{{"name":"n","ipam":{{"type":"calico-ipam"}}{extra}}}"#).as_bytes(),
        )
        .unwrap()
    }

    #[test]
    fn pools_pod_over_namespace() {
        let i = info(
            &[(ANN_IPV4_POOLS, r#"["pod-pool"]"#)],
            &[
                (ANN_IPV4_POOLS, r#"["ns-pool"]"#),
                (ANN_IP_FAMILIES, r#"["IPv6"]"#),
            ],
        );
        let out = i
            .ipam_stdin(br#"{"name":"n","ipam":{"type":"calico-ipam"}}"#)
            .unwrap()
            .unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["ipam"]["ipv4_pools"], serde_json::json!(["pod-pool"]));
        assert_eq!(v["ipam"]["assign_ipv4"], "false");
        assert_eq!(v["ipam"]["assign_ipv6"], "true");
        let bad = info(&[(ANN_IP_FAMILIES, r#"["IPv5"]"#)], &[]);
        assert_eq!(
            bad.ipam_stdin(br#"{"ipam":{}}"#).unwrap_err().to_string(),
            r#"error parsing ipFamilies: ["IPv5"]"#
        );
        assert!(info(&[], &[]).ipam_stdin(b"{}").unwrap().is_none());
    }

    #[test]
    fn address_annotations() {
        let c = conf("");
        assert_eq!(
            info(&[], &[]).address_source(&c).unwrap(),
            AddressSource::Ipam
        );
        let both = info(
            &[
                (ANN_IP_ADDRS, r#"["10.0.0.1"]"#),
                (ANN_IP_ADDRS_NO_IPAM, r#"["10.0.0.2"]"#),
            ],
            &[],
        );
        assert_eq!(
            both.address_source(&c).unwrap_err().to_string(),
            "can't have both annotations: 'ipAddrs' and 'ipAddrsNoIpam' in use at the same time"
        );
        let no_ipam = info(&[(ANN_IP_ADDRS_NO_IPAM, r#"["10.0.0.2"]"#)], &[]);
        assert_eq!(
            no_ipam.address_source(&c).unwrap_err().to_string(),
            "requested feature is not enabled: ip_addrs_no_ipam"
        );
        let c2 = conf(r#","feature_control":{"ip_addrs_no_ipam":true}"#);
        assert_eq!(
            no_ipam.address_source(&c2).unwrap(),
            AddressSource::NoIpam(vec!["10.0.0.2".parse().unwrap()])
        );
        let two = info(&[(ANN_IP_ADDRS, r#"["10.0.0.1","10.0.0.3"]"#)], &[]);
        assert_eq!(
            two.address_source(&c).unwrap_err().to_string(),
            "cannot have more than one IPv4 address for \"cni.projectcalico.org/ipAddrs\" annotation"
        );
        let empty = info(&[(ANN_IP_ADDRS, "[]")], &[]);
        assert_eq!(
            empty.address_source(&c).unwrap_err().to_string(),
            "annotation \"cni.projectcalico.org/ipAddrs\" specified but empty"
        );
        let hl = conf("");
        let mut hl = hl;
        hl.ipam.ipam_type = "host-local".into();
        assert_eq!(
            info(&[(ANN_IP_ADDRS, r#"["10.0.0.1"]"#)], &[])
                .address_source(&hl)
                .unwrap_err()
                .to_string(),
            "ipAddrs is not compatible with configured IPAM: host-local"
        );
    }

    #[test]
    fn floating_and_mac() {
        let i = info(
            &[
                (pods::ANNOTATION_FLOATING_IPS, r#"["1.1.1.1"]"#),
                (ANN_HW_ADDR, "c2:b0:57:49:47:f1"),
            ],
            &[],
        );
        assert_eq!(
            i.floating_ips(&conf("")).unwrap_err().to_string(),
            "requested feature is not enabled: floating_ips"
        );
        assert_eq!(
            i.floating_ips(&conf(r#","feature_control":{"floating_ips":true}"#))
                .unwrap(),
            vec!["1.1.1.1"]
        );
        assert_eq!(
            i.hw_addr().unwrap(),
            Some([0xc2, 0xb0, 0x57, 0x49, 0x47, 0xf1])
        );
    }

    #[test]
    fn macs_as_go_parses_them() {
        let six = Some(vec![0xaa, 0xbb, 0xcc, 0xdd, 0xee, 0x04]);
        assert_eq!(parse_mac("aa:bb:cc:dd:ee:04"), six);
        assert_eq!(parse_mac("AA-BB-CC-DD-EE-04"), six);
        assert_eq!(parse_mac("aabb.ccdd.ee04"), six);
        assert_eq!(
            parse_mac("02:00:5e:10:00:00:00:01").map(|m| m.len()),
            Some(8)
        );
        for bad in [
            "",
            "zz",
            "aa:bb:cc:dd:ee",
            "aa:bb-cc:dd:ee:ff",
            "aa:bb:cc:dd:ee:fg",
            "aabb.ccdd.eeff.",
            "aabbccddeeff",
        ] {
            assert_eq!(parse_mac(bad), None, "{bad}");
        }
        let hw = |v: &str| {
            info(&[(ANN_HW_ADDR, v)], &[])
                .hw_addr()
                .map_err(|e| e.to_string())
        };
        assert_eq!(
            hw("zz").unwrap_err(),
            "failed to parse MAC address zz provided via cni.projectcalico.org/hwAddr: address zz: invalid MAC address"
        );
        assert_eq!(
            hw("").unwrap_err(),
            "failed to parse MAC address  provided via cni.projectcalico.org/hwAddr: invalid MAC address"
        );
        assert!(hw("02:00:5e:10:00:00:00:01")
            .unwrap_err()
            .starts_with("failed to set container veth MAC"));
    }
}
