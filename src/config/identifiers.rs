//! Workload identifiers: orchestrator/pod/namespace from CNI_ARGS, WorkloadEndpoint names
//! (libcalico-go `names.WorkloadEndpointIdentifiers`), host veth names and IPAM handle IDs.

use sha1::{Digest, Sha1};

use crate::skel::args::{load_args, ArgKind, IGNORE_UNKNOWN};
use crate::skel::CniError;

/// CNI_ARGS keys of `types.K8sArgs`, which both plugins load (`utils.GetIdentifiers`).
pub const K8S_ARGS: &[(&str, ArgKind)] = &[
    IGNORE_UNKNOWN,
    ("IP", ArgKind::Ip),
    ("K8S_POD_NAME", ArgKind::Str),
    ("K8S_POD_NAMESPACE", ArgKind::Str),
    ("K8S_POD_INFRA_CONTAINER_ID", ArgKind::Str),
];

/// `types.CNITestArgs`, loaded separately and only where it parses (test-only upstream).
const CNI_TEST_ARGS: &[(&str, ArgKind)] = &[IGNORE_UNKNOWN, ("CNI_TEST_NAMESPACE", ArgKind::Str)];

pub const ORCH_K8S: &str = "k8s";
pub const ORCH_CNI: &str = "cni";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IdentifierError {
    #[error("error with field {field} = '{value}' (field must not begin with a '-')")]
    LeadingDash { field: &'static str, value: String },
    #[error("error with field {field} = '{value}' (field must not end with a '-')")]
    TrailingDash { field: &'static str, value: String },
    #[error("error with field {field} = '{value}' (field should be assigned)")]
    Missing { field: &'static str, value: String },
}

/// Who a WorkloadEndpoint belongs to.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WepIdentifiers {
    pub node: String,
    pub orchestrator: String,
    /// Pod name (k8s) or container ID (cni).
    pub workload: String,
    pub container_id: String,
    pub namespace: String,
    pub pod: String,
    pub endpoint: String,
}

impl WepIdentifiers {
    /// Identifiers from CNI_ARGS: k8s when both K8S_POD_NAMESPACE and K8S_POD_NAME are set,
    /// else plain CNI in namespace `default` (or CNI_TEST_NAMESPACE, test-only upstream).
    pub fn new(
        node: &str,
        container_id: &str,
        ifname: &str,
        pod_namespace: &str,
        pod_name: &str,
        test_namespace: &str,
    ) -> WepIdentifiers {
        if !pod_namespace.is_empty() && !pod_name.is_empty() {
            WepIdentifiers {
                node: node.into(),
                orchestrator: ORCH_K8S.into(),
                workload: pod_name.into(),
                container_id: container_id.into(),
                namespace: pod_namespace.into(),
                pod: pod_name.into(),
                endpoint: ifname.into(),
            }
        } else {
            WepIdentifiers {
                node: node.into(),
                orchestrator: ORCH_CNI.into(),
                workload: container_id.into(),
                container_id: container_id.into(),
                namespace: if test_namespace.is_empty() {
                    "default".into()
                } else {
                    test_namespace.into()
                },
                pod: String::new(),
                endpoint: ifname.into(),
            }
        }
    }

    /// Upstream's `GetIdentifiers`: CNI_ARGS loaded as `K8sArgs` (a bad `IP=` value or,
    /// without IgnoreUnknown, an unknown key fails), then `CNI_TEST_NAMESPACE` and
    /// `K8S_POD_UID` where they parse.
    pub fn from_cni_args(
        node: &str,
        container_id: &str,
        ifname: &str,
        cni_args: &str,
    ) -> Result<WepIdentifiers, CniError> {
        let k8s = load_args(cni_args, K8S_ARGS)?;
        let test = load_args(cni_args, CNI_TEST_ARGS).unwrap_or_default();
        let get = |m: &std::collections::BTreeMap<String, String>, k: &str| {
            m.get(k).cloned().unwrap_or_default()
        };
        let ids = WepIdentifiers::new(
            node,
            container_id,
            ifname,
            &get(&k8s, "K8S_POD_NAMESPACE"),
            &get(&k8s, "K8S_POD_NAME"),
            &get(&test, "CNI_TEST_NAMESPACE"),
        );
        Ok(ids)
    }

    pub fn is_k8s(&self) -> bool {
        self.orchestrator == ORCH_K8S
    }

    fn segments(&self) -> [(&'static str, &str); 4] {
        let (wfield, wval) = if self.is_k8s() {
            ("pod", self.pod.as_str())
        } else {
            ("workload", self.workload.as_str())
        };
        [
            ("node", self.node.as_str()),
            ("orchestrator", self.orchestrator.as_str()),
            (wfield, wval),
            ("endpoint", self.endpoint.as_str()),
        ]
    }

    /// The full WorkloadEndpoint name, e.g. `node1-k8s-mypod--1-eth0`.
    pub fn wep_name(&self) -> Result<String, IdentifierError> {
        join_segments(&self.segments(), false)
    }

    /// The name prefix used to find this workload's endpoint with any interface name,
    /// e.g. `node1-k8s-mypod--1-`.
    pub fn wep_prefix(&self) -> Result<String, IdentifierError> {
        let mut segs = self.segments();
        segs[3].1 = "";
        join_segments(&segs, true)
    }

    /// Whether `name` is this workload's endpoint (any interface name).
    pub fn name_matches(&self, name: &str) -> bool {
        let Ok(prefix) = self.wep_prefix() else {
            return false;
        };
        match name.strip_prefix(&prefix) {
            // The rest is one escaped segment: no lone '-' in it.
            Some(rest) => !rest.is_empty() && !rest.replace("--", "").contains('-'),
            None => false,
        }
    }

    /// The IPAM handle `<network>.<containerID>`.
    pub fn handle_id(&self, network: &str) -> String {
        format!("{network}.{}", self.container_id)
    }

    /// The handle pre-v3 Calico used: `<ns>.<pod>` (k8s) or `<containerID>`.
    pub fn legacy_handle_id(&self) -> String {
        if self.is_k8s() {
            format!("{}.{}", self.namespace, self.pod)
        } else {
            self.container_id.clone()
        }
    }

    /// The host-side veth name.
    pub fn host_veth_name(&self) -> String {
        if self.is_k8s() {
            veth_name_for_workload(&interface_prefix(), &self.namespace, &self.pod)
        } else {
            let cid: String = self.container_id.chars().take(11).collect();
            format!("cali{cid}")
        }
    }
}

/// Splits a WorkloadEndpoint name (or a prefix of one) into its segments — node,
/// orchestrator, workload, endpoint — at each single `-` (a doubled `--` is an escaped `-`).
/// The workload is the pod for the k8s orchestrator. None when there are more than four.
pub fn parse_wep_name(name: &str) -> Option<WepIdentifiers> {
    let mut parts: Vec<String> = vec![String::new()];
    let mut chars = name.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '-' {
            if chars.peek() == Some(&'-') {
                chars.next();
                parts.last_mut()?.push('-');
            } else {
                parts.push(String::new());
            }
        } else {
            parts.last_mut()?.push(c);
        }
    }
    if parts.len() > 4 {
        return None;
    }
    parts.resize(4, String::new());
    let [node, orchestrator, workload, endpoint] = <[String; 4]>::try_from(parts).ok()?;
    let pod = if orchestrator == ORCH_K8S {
        workload.clone()
    } else {
        String::new()
    };
    Some(WepIdentifiers {
        node,
        orchestrator,
        workload,
        pod,
        endpoint,
        ..Default::default()
    })
}

/// The host veth's prefix, as libcalico-go's `VethNameForWorkload` reads
/// `FELIX_INTERFACEPREFIX`: unset or empty is `cali`; else its first comma-separated entry,
/// as it is (an empty first entry is no prefix).
pub fn interface_prefix() -> String {
    match std::env::var("FELIX_INTERFACEPREFIX") {
        Ok(p) if !p.is_empty() => p.split(',').next().unwrap_or_default().to_string(),
        _ => "cali".to_string(),
    }
}

/// `<prefix>` + the first 11 hex digits of sha1("<namespace>.<pod>").
pub fn veth_name_for_workload(prefix: &str, namespace: &str, pod: &str) -> String {
    let digest = Sha1::digest(format!("{namespace}.{pod}").as_bytes());
    let h = hex::encode(digest);
    format!("{prefix}{}", &h[..11])
}

fn join_segments(
    segs: &[(&'static str, &str)],
    allow_prefix: bool,
) -> Result<String, IdentifierError> {
    let mut out = String::new();
    for (field, value) in segs {
        if value.is_empty() {
            if allow_prefix {
                return Ok(out);
            }
            return Err(IdentifierError::Missing {
                field,
                value: String::new(),
            });
        }
        if value.starts_with('-') {
            return Err(IdentifierError::LeadingDash {
                field,
                value: (*value).into(),
            });
        }
        if value.ends_with('-') {
            return Err(IdentifierError::TrailingDash {
                field,
                value: (*value).into(),
            });
        }
        out.push_str(&value.replace('-', "--"));
        out.push('-');
    }
    out.pop();
    Ok(out)
}

#[cfg(test)]
mod tests {
    #[test]
    fn wep_names_parse_back() {
        let ids = super::parse_wep_name("node--1-k8s-web--1-eth0").unwrap();
        assert_eq!(
            (
                ids.node.as_str(),
                ids.orchestrator.as_str(),
                ids.pod.as_str(),
                ids.endpoint.as_str()
            ),
            ("node-1", "k8s", "web-1", "eth0")
        );
        let prefix = super::parse_wep_name("node1-k8s-p-").unwrap();
        assert_eq!((prefix.pod.as_str(), prefix.endpoint.as_str()), ("p", ""));
        assert!(super::parse_wep_name("a-b-c-d-e").is_none());
    }

    use super::*;

    #[test]
    fn wep_names() {
        let ids = WepIdentifiers::new("named-hostname.somewhere", "abcd1234", "eth0", "", "", "");
        assert_eq!(
            ids.wep_name().unwrap(),
            "named--hostname.somewhere-cni-abcd1234-eth0"
        );
        assert_eq!(ids.namespace, "default");
        let k = WepIdentifiers::new("node1", "cid", "eth0", "default", "mypod-1", "");
        assert_eq!(k.wep_name().unwrap(), "node1-k8s-mypod--1-eth0");
        assert_eq!(k.wep_prefix().unwrap(), "node1-k8s-mypod--1-");
        assert!(k.name_matches("node1-k8s-mypod--1-eth0"));
        assert!(k.name_matches("node1-k8s-mypod--1-eth1"));
        assert!(!k.name_matches("node1-k8s-mypod--1-x-eth0"));
        assert!(!k.name_matches("node1-k8s-mypod--1-"));
        let bad = WepIdentifiers::new("-node", "cid", "eth0", "", "", "");
        assert_eq!(
            bad.wep_name().unwrap_err().to_string(),
            "error with field node = '-node' (field must not begin with a '-')"
        );
    }

    #[test]
    fn veth_and_handles() {
        assert_eq!(
            veth_name_for_workload("cali", "default", "nginx"),
            "calic440f455693"
        );
        let c = WepIdentifiers::new("n", "abc123", "eth0", "", "", "");
        assert_eq!(c.host_veth_name(), "caliabc123");
        assert_eq!(c.handle_id("net1"), "net1.abc123");
        assert_eq!(c.legacy_handle_id(), "abc123");
        let k = WepIdentifiers::new("n", "abc", "eth0", "ns1", "p1", "");
        assert_eq!(k.legacy_handle_id(), "ns1.p1");
    }
}
