//! Pods as WorkloadEndpoints (libcalico-go `PodToWorkloadEndpoints`): what Calico derives
//! from a pod — name `<node>-k8s-<pod>-eth0`, labels plus the namespace / orchestrator /
//! service-account labels, profiles `kns.<ns>` and `ksa.<ns>.<sa>`, named ports, addresses
//! from the status or Calico's annotations, floating IPs and allowed source prefixes — and
//! the annotations the CNI patches into the pod's status in place of a stored endpoint.

use std::collections::BTreeMap;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::{Container, Pod};
use serde_json::{json, Value};

use crate::config::identifiers::{veth_name_for_workload, WepIdentifiers};
use crate::datastore::model::{IpNat, WorkloadEndpoint};
use crate::support::net::IpNet;

pub const ANNOTATION_CONTAINER_ID: &str = "cni.projectcalico.org/containerID";
pub const ANNOTATION_POD_IP: &str = "cni.projectcalico.org/podIP";
pub const ANNOTATION_POD_IPS: &str = "cni.projectcalico.org/podIPs";
const ANNOTATION_AWS_POD_IPS: &str = "vpc.amazonaws.com/pod-ips";
pub const ANNOTATION_FLOATING_IPS: &str = "cni.projectcalico.org/floatingIPs";
pub const ANNOTATION_SOURCE_PREFIXES: &str = "cni.projectcalico.org/allowedSourcePrefixes";

pub const LABEL_NAMESPACE: &str = "projectcalico.org/namespace";
pub const LABEL_ORCHESTRATOR: &str = "projectcalico.org/orchestrator";
pub const LABEL_SERVICE_ACCOUNT: &str = "projectcalico.org/serviceaccount";

fn annotations(pod: &Pod) -> &BTreeMap<String, String> {
    static EMPTY: BTreeMap<String, String> = BTreeMap::new();
    pod.metadata.annotations.as_ref().unwrap_or(&EMPTY)
}

/// A pod being deleted whose IPs the CNI already removed, or one that has terminated.
pub fn is_finished(pod: &Pod) -> bool {
    let ann = annotations(pod);
    if pod.metadata.deletion_timestamp.is_some()
        && (ann.get(ANNOTATION_POD_IP).is_some_and(String::is_empty)
            || ann
                .get(ANNOTATION_AWS_POD_IPS)
                .is_some_and(String::is_empty))
    {
        return true;
    }
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Failed" | "Succeeded" | "Completed")
    )
}

/// A pod address (`10.0.0.1` or `10.0.0.1/32`) as a network, as `ParseCIDROrIP` reads it.
fn parse_cidr_or_ip(s: &str) -> Result<IpNet, String> {
    if s.contains('/') {
        s.parse::<IpNet>()
            .map(|n| n.masked())
            .map_err(|_| format!("invalid CIDR address: {s}"))
    } else {
        s.parse::<IpAddr>()
            .map(IpNet::host)
            .map_err(|_| format!("invalid CIDR address: {s}"))
    }
}

/// The pod's addresses, in upstream's order of preference.
pub fn pod_ips(pod: &Pod) -> Result<Vec<IpNet>, String> {
    let ann = annotations(pod);
    let status = pod.status.as_ref();
    let status_ips: Vec<String> = status
        .and_then(|s| s.pod_ips.as_ref())
        .map(|ips| ips.iter().map(|i| i.ip.clone()).collect())
        .unwrap_or_default();
    let status_ip = status.and_then(|s| s.pod_ip.clone()).unwrap_or_default();
    let non_empty = |k: &str| ann.get(k).filter(|v| !v.is_empty()).cloned();
    let raw: Vec<String> = if !status_ips.is_empty() {
        status_ips
    } else if !status_ip.is_empty() {
        vec![status_ip]
    } else if let Some(ips) = non_empty(ANNOTATION_POD_IPS) {
        ips.split(',').map(str::to_string).collect()
    } else if let Some(ip) = non_empty(ANNOTATION_POD_IP) {
        vec![ip]
    } else if let Some(ips) = non_empty(ANNOTATION_AWS_POD_IPS) {
        ips.split(',').map(str::to_string).collect()
    } else {
        return Ok(Vec::new());
    };
    raw.iter().map(|s| parse_cidr_or_ip(s)).collect()
}

/// `cni.projectcalico.org/allowedSourcePrefixes`: a JSON list of CIDRs, masked.
pub fn source_prefixes(ann: &BTreeMap<String, String>) -> Result<Vec<String>, String> {
    let Some(raw) = ann
        .get(ANNOTATION_SOURCE_PREFIXES)
        .filter(|a| !a.is_empty())
    else {
        return Ok(Vec::new());
    };
    // libcalico-go decodes it with json-iterator, whose error texts are its own.
    let list = crate::support::gojson::iter_string_list(raw)
        .map_err(|e| format!("failed to parse '{raw}' as JSON: {e}"))?;
    list.iter()
        .map(|p| {
            p.parse::<IpNet>()
                .map(|n| n.masked().to_string())
                .map_err(|_| format!("failed to parse '{p}' as a CIDR: invalid CIDR address: {p}"))
        })
        .collect()
}

/// Floating IPs (`cni.projectcalico.org/floatingIPs`, a JSON list) NATed to the pod's
/// address of the same family.
fn floating_ips(raw: &str, pod_nets: &[IpNet]) -> Result<Vec<IpNat>, String> {
    let ips = crate::support::gojson::string_list(raw)
        .map_err(|e| format!("failed to parse '{raw}' as JSON: {e}"))?;
    let (mut v4, mut v6) = (None, None);
    for n in pod_nets {
        match n.addr {
            IpAddr::V4(_) if n.prefix != 32 => {
                return Err(format!(
                    "PodIP {n} is not a valid IPv4: Mask size is {}, not 32",
                    n.prefix
                ))
            }
            IpAddr::V4(a) => v4 = Some(a.to_string()),
            IpAddr::V6(_) if n.prefix != 128 => {
                return Err(format!(
                    "PodIP {n} is not a valid IPv6: Mask size is {}, not 128",
                    n.prefix
                ))
            }
            IpAddr::V6(a) => v6 = Some(a.to_string()),
        }
    }
    Ok(ips
        .into_iter()
        .filter_map(|ext| {
            let internal = if ext.contains(':') { &v6 } else { &v4 };
            internal.as_ref().map(|i| IpNat {
                internal_ip: i.clone(),
                external_ip: ext,
            })
        })
        .collect())
}

/// Container ports with a name or a host port become endpoint ports.
fn ports(containers: &[Container], out: &mut Vec<Value>) {
    for c in containers {
        for p in c.ports.iter().flatten() {
            if p.container_port == 0 || (p.host_port.unwrap_or(0) == 0 && p.name.is_none()) {
                continue;
            }
            // The canonical names, as upstream's conversion gives them
            // (`numorstring.ProtocolFromString`): Felix and calicoctl read these.
            let protocol = match p.protocol.as_deref() {
                Some("UDP") => "UDP",
                Some("SCTP") => "SCTP",
                Some("TCP") | Some("") | None => "TCP",
                Some(_) => continue,
            };
            out.push(json!({
                "name": p.name.clone().unwrap_or_default(),
                "protocol": protocol,
                "port": p.container_port,
                "hostPort": p.host_port.unwrap_or(0),
                "hostIP": p.host_ip.clone().unwrap_or_default(),
            }));
        }
    }
}

/// The WorkloadEndpoint Calico sees for this pod.
pub fn pod_to_endpoint(pod: &Pod) -> Result<WorkloadEndpoint, String> {
    let ns = pod.metadata.namespace.clone().unwrap_or_default();
    let name = pod.metadata.name.clone().unwrap_or_default();
    let spec = pod.spec.clone().unwrap_or_default();
    let node = spec.node_name.clone().unwrap_or_default();
    let sa = spec.service_account_name.clone().unwrap_or_default();
    let ann = annotations(pod);

    let ids = WepIdentifiers {
        node: node.clone(),
        orchestrator: "k8s".into(),
        workload: name.clone(),
        container_id: String::new(),
        namespace: ns.clone(),
        pod: name.clone(),
        endpoint: "eth0".into(),
    };
    let wep_name = ids.wep_name().map_err(|e| e.to_string())?;
    let mut nets = pod_ips(pod)?;
    if is_finished(pod) {
        nets.clear();
    }
    let mut labels = pod.metadata.labels.clone().unwrap_or_default();
    labels.insert(LABEL_NAMESPACE.into(), ns.clone());
    labels.insert(LABEL_ORCHESTRATOR.into(), "k8s".into());
    if !sa.is_empty() && sa.len() < 63 {
        labels.insert(LABEL_SERVICE_ACCOUNT.into(), sa.clone());
    }
    let mut profiles = vec![format!("kns.{ns}")];
    if !sa.is_empty() {
        let pns = if ns.is_empty() { "default" } else { &ns };
        profiles.push(format!("ksa.{pns}.{sa}"));
    }
    let ip_nats = match ann.get(ANNOTATION_FLOATING_IPS) {
        Some(raw) if !nets.is_empty() => floating_ips(raw, &nets)?,
        _ => Vec::new(),
    };
    let mut endpoint_ports = Vec::new();
    ports(&spec.containers, &mut endpoint_ports);
    ports(
        spec.init_containers.as_deref().unwrap_or(&[]),
        &mut endpoint_ports,
    );

    let mut w = WorkloadEndpoint::new("WorkloadEndpoint", &wep_name, Some(&ns), Default::default());
    w.api_version = "projectcalico.org/v3".into();
    w.metadata.uid = pod.metadata.uid.clone().unwrap_or_default();
    w.metadata.resource_version = pod.metadata.resource_version.clone().unwrap_or_default();
    w.metadata.generate_name = pod.metadata.generate_name.clone().unwrap_or_default();
    w.metadata.creation_timestamp = pod
        .metadata
        .creation_timestamp
        .as_ref()
        .and_then(|t| serde_json::to_value(t).ok())
        .and_then(|v| v.as_str().map(str::to_string));
    w.metadata.labels = Some(labels);
    let s = &mut w.spec;
    s.orchestrator = "k8s".into();
    s.node = node;
    s.pod = name.clone();
    s.container_id = ann
        .get(ANNOTATION_CONTAINER_ID)
        .cloned()
        .unwrap_or_default();
    s.endpoint = "eth0".into();
    s.interface_name = interface_name(&ns, &name);
    s.profiles = profiles;
    s.ip_networks = nets.iter().map(IpNet::to_string).collect();
    s.ports = endpoint_ports;
    s.ip_nats = ip_nats;
    s.service_account_name = sa;
    s.allow_spoofed_source_prefixes = source_prefixes(ann)?;
    Ok(w)
}

/// `VethNameForWorkload` (`identifiers::interface_prefix`).
fn interface_name(ns: &str, pod: &str) -> String {
    veth_name_for_workload(&crate::config::identifiers::interface_prefix(), ns, pod)
}

/// The strategic-merge patch of `pods/<pod>/status` that records the endpoint (ADD): the
/// addresses and the container ID; nothing when there are no addresses.
pub fn add_patch(ip_networks: &[String], container_id: &str) -> Value {
    let mut ann = serde_json::Map::new();
    if let Some(first) = ip_networks.first() {
        ann.insert(ANNOTATION_POD_IP.into(), json!(first));
        ann.insert(ANNOTATION_POD_IPS.into(), json!(ip_networks.join(",")));
        if !container_id.is_empty() {
            ann.insert(ANNOTATION_CONTAINER_ID.into(), json!(container_id));
        }
    }
    json!({"metadata": {"annotations": ann}})
}

/// The patch that removes the endpoint (DEL): empty address annotations, guarded by the
/// pod's resourceVersion and uid.
pub fn delete_patch(resource_version: &str, uid: &str) -> Value {
    let mut meta = serde_json::Map::new();
    meta.insert(
        "annotations".into(),
        json!({ANNOTATION_POD_IP: "", ANNOTATION_POD_IPS: ""}),
    );
    if !resource_version.is_empty() {
        meta.insert("resourceVersion".into(), json!(resource_version));
    }
    if !uid.is_empty() {
        meta.insert("uid".into(), json!(uid));
    }
    json!({ "metadata": meta })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(v: Value) -> Pod {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn pod_becomes_an_endpoint() {
        let p = pod(json!({
            "metadata": {"name": "web-1", "namespace": "prod", "uid": "u-1", "resourceVersion": "42",
                "generateName": "web-", "labels": {"app": "web"},
                "annotations": {"cni.projectcalico.org/containerID": "abc",
                    "cni.projectcalico.org/podIPs": "10.0.0.5/32,fd00::5/128",
                    "cni.projectcalico.org/floatingIPs": "[\"1.2.3.4\"]",
                    "cni.projectcalico.org/allowedSourcePrefixes": "[\"10.9.0.1/16\"]"}},
            "spec": {"nodeName": "node-1", "serviceAccountName": "sa1", "containers": [
                {"name": "c", "ports": [{"containerPort": 80, "name": "http"}, {"containerPort": 81},
                    {"containerPort": 53, "hostPort": 5353, "protocol": "UDP"}]}]}
        }));
        let w = pod_to_endpoint(&p).unwrap();
        assert_eq!(w.metadata.name, "node--1-k8s-web--1-eth0");
        assert_eq!(w.metadata.generate_name, "web-");
        assert_eq!(w.spec.container_id, "abc");
        assert_eq!(w.spec.ip_networks, vec!["10.0.0.5/32", "fd00::5/128"]);
        assert_eq!(w.spec.profiles, vec!["kns.prod", "ksa.prod.sa1"]);
        let labels = w.metadata.labels.unwrap();
        assert_eq!(labels["projectcalico.org/serviceaccount"], "sa1");
        assert_eq!(labels["app"], "web");
        assert_eq!(w.spec.ports.len(), 2);
        assert_eq!(w.spec.ports[1]["protocol"], "UDP");
        assert_eq!(w.spec.ip_nats[0].external_ip, "1.2.3.4");
        assert_eq!(w.spec.allow_spoofed_source_prefixes, vec!["10.9.0.0/16"]);
    }

    #[test]
    fn finished_pods_have_no_addresses() {
        let p = pod(json!({"metadata": {"name": "p", "namespace": "d"},
            "spec": {"nodeName": "n", "containers": []},
            "status": {"phase": "Succeeded", "podIP": "10.0.0.1"}}));
        assert!(pod_to_endpoint(&p).unwrap().spec.ip_networks.is_empty());
    }

    #[test]
    fn patches() {
        assert_eq!(
            add_patch(&["10.0.0.1/32".into(), "fd00::1/128".into()], "cid"),
            json!({"metadata":{"annotations":{"cni.projectcalico.org/podIP":"10.0.0.1/32",
                "cni.projectcalico.org/podIPs":"10.0.0.1/32,fd00::1/128",
                "cni.projectcalico.org/containerID":"cid"}}})
        );
        assert_eq!(
            delete_patch("7", "u"),
            json!({"metadata":{"annotations":{"cni.projectcalico.org/podIP":"","cni.projectcalico.org/podIPs":""},
                "resourceVersion":"7","uid":"u"}})
        );
    }
}
