//! libcalico-go's validator (lib/validator/v3 at v3.32.1) for the two resources the CNI
//! plugin writes: a WorkloadEndpoint and a Profile. Felix and calicoctl refuse objects that
//! fail it, so the plugin must never store one; the error texts are upstream's
//! (`errors.ErrorValidation`), e.g.
//! `error with field Profiles[0] = 'Net1' (Reason: failed to validate Field: Profiles[0] because of Tag: name )`.
//!
//! Only the fields the CNI sets are checked; the order of the reported fields is the
//! validator's walk: metadata (name, labels), then spec fields in declaration order, then the
//! spec's struct-level rules.

use std::collections::BTreeMap;
use std::net::IpAddr;

use super::model::{Profile, WorkloadEndpoint};
use crate::support::net::IpNet;

/// The k8s DNS-1123 subdomain format Calico uses for resource names.
const NAME_FORMAT: &str = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*";
const NAME_MAX_LEN: usize = 253;
const LABEL_MAX_LEN: usize = 63;
const QUALIFIED_NAME_FORMAT: &str = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]";
const LABEL_VALUE_FORMAT: &str = "(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?";

/// A failed validation: the fields that failed, rendered as upstream's `ErrorValidation`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", render(.0))]
pub struct ValidationError(pub Vec<FieldError>);

/// One failed field: `<name> = '<value>' (<reason>)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    pub name: String,
    pub value: String,
    pub reason: String,
}

fn render(fields: &[FieldError]) -> String {
    let one = |f: &FieldError| format!("{} = '{}' ({})", f.name, f.value, f.reason);
    match fields {
        [] => "unknown validation error".to_string(),
        [f] => format!("error with field {}", one(f)),
        many => {
            let mut s = "error with the following fields:\n".to_string();
            for f in many {
                s.push_str(&format!("-  {}\n", one(f)));
            }
            s
        }
    }
}

/// Collects failures in walk order.
#[derive(Default)]
struct Errors(Vec<FieldError>);

impl Errors {
    /// A struct-level rule with its own reason.
    fn reason(&mut self, name: &str, value: &str, reason: impl Into<String>) {
        self.0.push(FieldError {
            name: name.to_string(),
            value: value.to_string(),
            reason: reason.into(),
        });
    }

    /// A failed validator tag: upstream's generic reason, trailing space included.
    fn tag(&mut self, field: &str, value: &str, tag: &str) {
        self.reason(
            field,
            value,
            format!("Reason: failed to validate Field: {field} because of Tag: {tag} "),
        );
    }

    fn finish(self) -> Result<(), ValidationError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(ValidationError(self.0))
        }
    }
}

fn is_alnum(b: u8) -> bool {
    b.is_ascii_alphanumeric()
}

/// One DNS-1123 label of the subdomain format (lower case).
fn is_lower_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// `^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$` (no length limit).
pub fn is_name(s: &str) -> bool {
    s.split('.').all(is_lower_label)
}

/// `^[a-zA-Z0-9]([-a-zA-Z0-9]*[a-zA-Z0-9])?$`
fn is_container_id(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.iter().all(|c| is_alnum(*c) || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// `*`, or `^[a-zA-Z0-9_.-]{1,15}$`.
fn is_interface(s: &str) -> bool {
    s == "*"
        || (!s.is_empty()
            && s.len() <= 15
            && s.bytes()
                .all(|c| is_alnum(c) || c == b'_' || c == b'.' || c == b'-'))
}

/// `([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]`
fn is_qualified_part(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.iter()
            .all(|c| is_alnum(*c) || *c == b'-' || *c == b'_' || *c == b'.')
        && is_alnum(b[0])
        && is_alnum(b[b.len() - 1])
}

/// apimachinery's `RegexError`: `<msg> (e.g. 'a',  or 'b', regex used for validation is '<re>')`.
fn regex_error(msg: &str, re: &str, examples: &[&str]) -> String {
    let mut out = format!("{msg} (e.g. ");
    for (i, ex) in examples.iter().enumerate() {
        if i > 0 {
            out.push_str(" or ");
        }
        out.push_str(&format!("'{ex}', "));
    }
    out.push_str(&format!("regex used for validation is '{re}')"));
    out
}

const LABEL_KEY_MSG: &str = "must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character";

/// apimachinery v0.35.6 `content.IsLabelKey` (`IsQualifiedName`): `[prefix/]name`.
fn qualified_name_errors(key: &str) -> Vec<String> {
    let mut errs = Vec::new();
    let parts: Vec<&str> = key.split('/').collect();
    let name = match parts.as_slice() {
        [name] => *name,
        [prefix, name] => {
            if prefix.is_empty() {
                errs.push("prefix part must be non-empty".to_string());
            } else {
                if prefix.len() > NAME_MAX_LEN {
                    errs.push(format!(
                        "prefix part must be no more than {NAME_MAX_LEN} bytes"
                    ));
                }
                if !is_name(prefix) {
                    errs.push(format!(
                        "prefix part {}",
                        regex_error(
                            "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character",
                            NAME_FORMAT,
                            &["example.com"],
                        )
                    ));
                }
            }
            name
        }
        _ => {
            errs.push(format!(
                "a valid label key {} with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')",
                regex_error(LABEL_KEY_MSG, QUALIFIED_NAME_FORMAT, &["MyName", "my.name", "123-abc"])
            ));
            return errs;
        }
    };
    if name.is_empty() {
        errs.push("name part must be non-empty".to_string());
    } else if name.len() > LABEL_MAX_LEN {
        errs.push(format!(
            "name part must be no more than {LABEL_MAX_LEN} bytes"
        ));
    }
    if !is_qualified_part(name) {
        errs.push(format!(
            "name part {}",
            regex_error(
                LABEL_KEY_MSG,
                QUALIFIED_NAME_FORMAT,
                &["MyName", "my.name", "123-abc"]
            )
        ));
    }
    errs
}

/// apimachinery v0.35.6 `content.IsLabelValue`.
fn label_value_errors(v: &str) -> Vec<String> {
    let mut errs = Vec::new();
    if v.len() > LABEL_MAX_LEN {
        errs.push(format!("must be no more than {LABEL_MAX_LEN} bytes"));
    }
    if !v.is_empty() && !is_qualified_part(v) {
        errs.push(regex_error(
            "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character",
            LABEL_VALUE_FORMAT,
            &["MyValue", "my_value", "12345"],
        ));
    }
    errs
}

/// `validateObjectMeta`: the name's length and format, then every label.
fn object_meta(e: &mut Errors, name: &str, labels: Option<&BTreeMap<String, String>>) {
    if name.len() > NAME_MAX_LEN {
        e.reason(
            "Metadata.Name",
            name,
            format!("name is too long by {} bytes", name.len() - NAME_MAX_LEN),
        );
    }
    if !is_name(name) {
        e.reason(
            "Metadata.Name",
            name,
            format!("name must consist of lower case alphanumeric characters, '-' or '.' (regex: {NAME_FORMAT})"),
        );
    }
    for (k, v) in labels.into_iter().flatten() {
        for r in qualified_name_errors(k) {
            e.reason("Metadata.Labels (label)", k, r);
        }
        for r in label_value_errors(v) {
            e.reason("Metadata.Labels (value)", v, r);
        }
    }
}

/// Go's `net.ParseMAC`: 6, 8 or 20 bytes as `xx:xx..`, `xx-xx..` or `xxxx.xxxx..`.
fn is_mac(s: &str) -> bool {
    let groups = |sep: char, width: usize| -> Option<usize> {
        let parts: Vec<&str> = s.split(sep).collect();
        parts
            .iter()
            .all(|p| p.len() == width && p.bytes().all(|c| c.is_ascii_hexdigit()))
            .then(|| parts.len() * width / 2)
    };
    let n = if s.len() >= 14 && s.as_bytes().get(4) == Some(&b'.') {
        groups('.', 4)
    } else {
        groups(':', 2).or_else(|| groups('-', 2))
    };
    matches!(n, Some(6) | Some(8) | Some(20))
}

/// The `net` tag: an IP, or a CIDR whose address is its network address.
fn is_net(s: &str) -> bool {
    match s.parse::<IpNet>() {
        Ok(n) => n.masked() == n,
        Err(_) => s.parse::<IpAddr>().is_ok(),
    }
}

/// The `cidr` tag: any CIDR or IP.
fn is_cidr(s: &str) -> bool {
    s.parse::<IpNet>().is_ok() || s.parse::<IpAddr>().is_ok()
}

/// A string field, its value, its validator tag and the tag's check.
type ScalarRule<'a> = (&'static str, &'a str, &'static str, fn(&str) -> bool);

/// Validates a WorkloadEndpoint as clientv3's Create/Update does.
pub fn workload_endpoint(wep: &WorkloadEndpoint) -> Result<(), ValidationError> {
    let mut e = Errors::default();
    object_meta(&mut e, &wep.metadata.name, wep.metadata.labels.as_ref());
    let s = &wep.spec;
    // The scalar spec fields in declaration order, each with its validator tag.
    let scalars: [ScalarRule; 7] = [
        ("Orchestrator", &s.orchestrator, "name", is_name),
        ("Workload", &s.workload, "name", is_name),
        ("Node", &s.node, "name", is_name),
        (
            "ContainerID",
            &s.container_id,
            "containerID",
            is_container_id,
        ),
        ("Pod", &s.pod, "name", is_name),
        ("Endpoint", &s.endpoint, "name", is_name),
        (
            "ServiceAccountName",
            &s.service_account_name,
            "name",
            is_name,
        ),
    ];
    for (field, value, tag, valid) in scalars {
        if !value.is_empty() && !valid(value) {
            e.tag(field, value, tag);
        }
    }
    for (i, n) in s.ip_networks.iter().enumerate() {
        if !is_net(n) {
            e.tag(&format!("IPNetworks[{i}]"), n, "net");
        }
    }
    for (i, p) in s.profiles.iter().enumerate() {
        if !is_name(p) {
            e.tag(&format!("Profiles[{i}]"), p, "name");
        }
    }
    if !is_interface(&s.interface_name) {
        e.tag("InterfaceName", &s.interface_name, "interface");
    }
    if !s.mac.is_empty() && !is_mac(&s.mac) {
        e.tag("MAC", &s.mac, "mac");
    }
    for (i, p) in s.allow_spoofed_source_prefixes.iter().enumerate() {
        if !is_cidr(p) {
            e.tag(&format!("AllowSpoofedSourcePrefixes[{i}]"), p, "cidr");
        }
    }
    // validateWorkloadEndpointSpec: every network is a single address.
    for n in &s.ip_networks {
        if let Ok(net) = n.parse::<IpNet>() {
            if net.prefix != net.bits() {
                e.reason("IPNetworks", n, "IP network contains multiple addresses");
            }
        }
    }
    e.finish()
}

/// The endpoint's NATs (`IPNATs[i]`, each `InternalIP` and `ExternalIP` tagged `ip`), as the
/// validator checks them once the pod's addresses are known.
pub fn ip_nats(nats: &[super::model::IpNat]) -> Result<(), ValidationError> {
    let mut e = Errors::default();
    for n in nats {
        for (field, value) in [
            ("InternalIP", &n.internal_ip),
            ("ExternalIP", &n.external_ip),
        ] {
            if !value.is_empty() && value.parse::<IpAddr>().is_err() {
                e.tag(field, value, "ip");
            }
        }
    }
    e.finish()
}

/// Validates a Profile as clientv3's Create does (for the two shapes the CNI writes).
pub fn profile(p: &Profile) -> Result<(), ValidationError> {
    let mut e = Errors::default();
    object_meta(&mut e, &p.metadata.name, p.metadata.labels.as_ref());
    if let Some(labels) = &p.spec.labels_to_apply {
        let bad = labels.iter().any(|(k, v)| {
            !qualified_name_errors(k).is_empty() || !label_value_errors(v).is_empty()
        });
        if bad {
            let shown: Vec<String> = labels.iter().map(|(k, v)| format!("{k}:{v}")).collect();
            e.tag(
                "LabelsToApply",
                &format!("map[{}]", shown.join(" ")),
                "labels",
            );
        }
    }
    e.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datastore::model::{ProfileSpec, WorkloadEndpointSpec};

    fn wep(name: &str, spec: WorkloadEndpointSpec) -> WorkloadEndpoint {
        WorkloadEndpoint::new("WorkloadEndpoint", name, Some("default"), spec)
    }

    fn good_spec() -> WorkloadEndpointSpec {
        WorkloadEndpointSpec {
            orchestrator: "cni".into(),
            node: "node1".into(),
            container_id: "abc123".into(),
            endpoint: "eth0".into(),
            ip_networks: vec!["10.0.0.1/32".into(), "fd00::1/128".into()],
            profiles: vec!["net1".into()],
            interface_name: "caliabc123".into(),
            mac: "2e:6c:01:02:03:04".into(),
            ..Default::default()
        }
    }

    #[test]
    fn a_good_endpoint_passes() {
        assert_eq!(
            workload_endpoint(&wep("node1-cni-abc123-eth0", good_spec())),
            Ok(())
        );
    }

    #[test]
    fn upper_case_network_name() {
        let spec = WorkloadEndpointSpec {
            profiles: vec!["Net1".into()],
            ..good_spec()
        };
        assert_eq!(
            workload_endpoint(&wep("node1-cni-abc123-eth0", spec))
                .unwrap_err()
                .to_string(),
            "error with field Profiles[0] = 'Net1' (Reason: failed to validate Field: Profiles[0] because of Tag: name )"
        );
    }

    #[test]
    fn several_fields_are_listed() {
        let spec = WorkloadEndpointSpec {
            node: "Node1".into(),
            ..good_spec()
        };
        assert_eq!(
            workload_endpoint(&wep("Node1-cni-abc123-eth0", spec)).unwrap_err().to_string(),
            "error with the following fields:\n\
             -  Metadata.Name = 'Node1-cni-abc123-eth0' (name must consist of lower case alphanumeric characters, '-' or '.' (regex: [a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*))\n\
             -  Node = 'Node1' (Reason: failed to validate Field: Node because of Tag: name )\n"
        );
        let spec = WorkloadEndpointSpec {
            container_id: "abc_1".into(),
            ..good_spec()
        };
        let err = workload_endpoint(&wep("node1-cni-abc_1-eth0", spec))
            .unwrap_err()
            .to_string();
        assert!(
            err.ends_with("-  ContainerID = 'abc_1' (Reason: failed to validate Field: ContainerID because of Tag: containerID )\n"),
            "{err}"
        );
    }

    #[test]
    fn names_labels_interfaces_macs() {
        let long = "a".repeat(254);
        let e = workload_endpoint(&wep(&long, good_spec())).unwrap_err();
        assert_eq!(e.0[0].reason, "name is too long by 1 bytes");
        let mut w = wep("node1-cni-abc123-eth0", good_spec());
        w.metadata.labels = Some(BTreeMap::from([("k".into(), "_v".into())]));
        let e = workload_endpoint(&w).unwrap_err();
        assert_eq!(e.0[0].name, "Metadata.Labels (value)");
        assert_eq!(
            e.0[0].reason,
            "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')"
        );
        for (iface, ok) in [
            ("caliabc", true),
            ("*", true),
            ("", false),
            ("a".repeat(16).as_str(), false),
        ] {
            let spec = WorkloadEndpointSpec {
                interface_name: iface.into(),
                ..good_spec()
            };
            assert_eq!(
                workload_endpoint(&wep("node1-cni-abc123-eth0", spec)).is_ok(),
                ok,
                "{iface}"
            );
        }
        assert!(is_mac("EE:ee:ee:ee:ee:ee") && is_mac("0000.5e00.5301") && !is_mac("ee:ee"));
        let spec = WorkloadEndpointSpec {
            ip_networks: vec!["10.0.0.0/24".into()],
            ..good_spec()
        };
        let e = workload_endpoint(&wep("node1-cni-abc123-eth0", spec)).unwrap_err();
        assert_eq!(e.0[0].reason, "IP network contains multiple addresses");
    }

    #[test]
    fn profiles() {
        let p = |name: &str| {
            Profile::new(
                "Profile",
                name,
                None,
                ProfileSpec {
                    labels_to_apply: Some(BTreeMap::from([(name.to_string(), String::new())])),
                    ..Default::default()
                },
            )
        };
        assert_eq!(profile(&p("net1")), Ok(()));
        assert_eq!(
            profile(&p("Net1")).unwrap_err().to_string(),
            "error with field Metadata.Name = 'Net1' (name must consist of lower case alphanumeric characters, '-' or '.' (regex: [a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*))"
        );
        let long = "n".repeat(64);
        assert_eq!(
            profile(&p(&long)).unwrap_err().to_string(),
            format!("error with field LabelsToApply = 'map[{long}:]' (Reason: failed to validate Field: LabelsToApply because of Tag: labels )")
        );
    }
}
