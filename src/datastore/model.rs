//! Calico's stored objects as serde types, with upstream's exact JSON field names, order,
//! `omitempty` and `null` behaviour. Every struct keeps unknown
//! fields in `extra` so a read-modify-write never drops what a newer Calico wrote.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::support::net::IpNet;

pub const API_VERSION_V3: &str = "projectcalico.org/v3";
pub const LABEL_NAMESPACE: &str = "projectcalico.org/namespace";
pub const LABEL_ORCHESTRATOR: &str = "projectcalico.org/orchestrator";

fn is_false(b: &bool) -> bool {
    !*b
}
fn is_zero(n: &i64) -> bool {
    *n == 0
}

/// Kubernetes-style ObjectMeta, in Go's field order. `creationTimestamp` is always written
/// (`null` when unset), like Go's non-pointer `metav1.Time`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ObjectMeta {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub generate_name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub namespace: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub self_link: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub uid: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub resource_version: String,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub generation: i64,
    #[serde(default)]
    pub creation_timestamp: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deletion_timestamp: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub annotations: Option<BTreeMap<String, String>>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// A projectcalico.org/v3 resource: `kind`, `apiVersion`, `metadata`, `spec` (+ e.g. `status`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Resource<S> {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub kind: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub api_version: String,
    #[serde(default)]
    pub metadata: ObjectMeta,
    pub spec: S,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl<S> Resource<S> {
    pub fn new(kind: &str, name: &str, namespace: Option<&str>, spec: S) -> Self {
        Resource {
            kind: kind.to_string(),
            api_version: API_VERSION_V3.to_string(),
            metadata: ObjectMeta {
                name: name.to_string(),
                namespace: namespace.unwrap_or_default().to_string(),
                ..Default::default()
            },
            spec,
            extra: Map::new(),
        }
    }
}

pub type WorkloadEndpoint = Resource<WorkloadEndpointSpec>;
pub type IpPool = Resource<IpPoolSpec>;
pub type ClusterInformation = Resource<ClusterInformationSpec>;
pub type Profile = Resource<ProfileSpec>;
pub type Node = Resource<Value>;
pub type IpReservation = Resource<IpReservationSpec>;

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadEndpointSpec {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub orchestrator: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub workload: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub node: String,
    #[serde(
        default,
        rename = "containerID",
        skip_serializing_if = "String::is_empty"
    )]
    pub container_id: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub pod: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub endpoint: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub service_account_name: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ip_networks: Vec<String>,
    #[serde(default, rename = "ipNATs", skip_serializing_if = "Vec::is_empty")]
    pub ip_nats: Vec<IpNat>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub ipv4_gateway: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub ipv6_gateway: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub profiles: Vec<String>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub interface_name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub mac: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<Value>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow_spoofed_source_prefixes: Vec<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct IpNat {
    #[serde(rename = "internalIP")]
    pub internal_ip: String,
    #[serde(rename = "externalIP")]
    pub external_ip: String,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct IpPoolSpec {
    pub cidr: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub vxlan_mode: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub ipip_mode: String,
    #[serde(default, skip_serializing_if = "is_false")]
    pub nat_outgoing: bool,
    #[serde(default, skip_serializing_if = "is_false")]
    pub disabled: bool,
    #[serde(default, rename = "disableBGPExport", skip_serializing_if = "is_false")]
    pub disable_bgp_export: bool,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub block_size: i64,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub node_selector: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub namespace_selector: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allowed_uses: Vec<String>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub assignment_mode: String,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl IpPool {
    /// The pool's CIDR, masked.
    pub fn cidr(&self) -> Option<IpNet> {
        self.spec.cidr.parse::<IpNet>().ok().map(|n| n.masked())
    }

    /// Usable by IPAM: not disabled, not being deleted, not marked `Allocatable=False`.
    pub fn is_enabled(&self) -> bool {
        if self.spec.disabled || self.metadata.deletion_timestamp.is_some() {
            return false;
        }
        let conditions = self
            .extra
            .get("status")
            .and_then(|s| s.get("conditions"))
            .and_then(Value::as_array);
        !conditions.is_some_and(|cs| {
            cs.iter().any(|c| {
                c.get("type").and_then(Value::as_str) == Some("Allocatable")
                    && c.get("status").and_then(Value::as_str) == Some("False")
            })
        })
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterInformationSpec {
    #[serde(
        default,
        rename = "clusterGUID",
        skip_serializing_if = "String::is_empty"
    )]
    pub cluster_guid: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub cluster_type: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub calico_version: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub datastore_ready: Option<bool>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub variant: String,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// Profile rules are kept as JSON: the CNI only ever writes the two fixed shapes.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProfileSpec {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ingress: Vec<Value>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub egress: Vec<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels_to_apply: Option<BTreeMap<String, String>>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct IpReservationSpec {
    #[serde(
        default,
        rename = "reservedCIDRs",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub reserved_cidrs: Vec<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// One allocation's owner record inside a block.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct AllocationAttribute {
    #[serde(default, rename = "handle_id", skip_serializing_if = "Option::is_none")]
    pub handle_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secondary: Option<BTreeMap<String, String>>,
    #[serde(
        default,
        rename = "alternateOwnerAttrs",
        skip_serializing_if = "Option::is_none"
    )]
    pub alternate_owner_attrs: Option<BTreeMap<String, String>>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// An IPAM allocation block (etcd form, `model.AllocationBlock`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AllocationBlock {
    pub cidr: IpNet,
    #[serde(default)]
    pub affinity: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity_claim_time: Option<String>,
    #[serde(default)]
    pub allocations: Vec<Option<usize>>,
    #[serde(default)]
    pub unallocated: Vec<usize>,
    #[serde(default)]
    pub attributes: Option<Vec<AllocationAttribute>>,
    #[serde(default, rename = "sequenceNumber")]
    pub sequence_number: u64,
    #[serde(default, rename = "sequenceNumberForAllocation")]
    pub sequence_number_for_allocation: Option<BTreeMap<String, u64>>,
    #[serde(default)]
    pub deleted: bool,
    #[serde(
        default,
        rename = "hostAffinity",
        skip_serializing_if = "Option::is_none"
    )]
    pub host_affinity: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

pub const AFFINITY_PENDING: &str = "pending";
pub const AFFINITY_CONFIRMED: &str = "confirmed";
pub const AFFINITY_PENDING_DELETION: &str = "pendingDeletion";

/// A host's claim on a block (`model.BlockAffinity`): both fields always written.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct BlockAffinity {
    #[serde(default)]
    pub state: String,
    #[serde(default)]
    pub deleted: bool,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl BlockAffinity {
    pub fn with_state(state: &str) -> Self {
        BlockAffinity {
            state: state.to_string(),
            ..Default::default()
        }
    }

    /// Confirmed, or the empty state older Calico wrote.
    pub fn is_confirmed(&self) -> bool {
        self.state == AFFINITY_CONFIRMED || self.state.is_empty()
    }
}

/// An IPAM handle: how many addresses it holds in each block (keyed by block CIDR).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct IpamHandle {
    #[serde(default)]
    pub block: BTreeMap<String, i64>,
    #[serde(default)]
    pub deleted: bool,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// Global IPAM settings (`/calico/ipam/v2/config`); every field omitted when zero.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct IpamConfig {
    #[serde(default, skip_serializing_if = "is_false")]
    pub strict_affinity: bool,
    #[serde(default, skip_serializing_if = "is_false")]
    pub auto_allocate_blocks: bool,
    #[serde(default, rename = "maxBlocksPerHost", skip_serializing_if = "is_zero")]
    pub max_blocks_per_host: i64,
    #[serde(
        default,
        rename = "kubeVirtVMAddressPersistence",
        skip_serializing_if = "String::is_empty"
    )]
    pub kube_virt_vm_address_persistence: String,
    #[serde(default, rename = "ipCooldownSeconds", skip_serializing_if = "is_zero")]
    pub ip_cooldown_seconds: i64,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl IpamConfig {
    /// v3.32.1's defaults, which `GetIPAMConfig` stores when no config exists:
    /// `{"auto_allocate_blocks":true,"kubeVirtVMAddressPersistence":"Enabled"}`.
    pub fn defaults() -> Self {
        IpamConfig {
            auto_allocate_blocks: true,
            kube_virt_vm_address_persistence: "Enabled".into(),
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_round_trip_keeps_nulls_and_unknown_fields() {
        let raw = r#"{"cidr":"10.244.166.128/29","affinity":null,"allocations":[0,null],"unallocated":[1],"attributes":[{"handle_id":"h","secondary":{"node":"n"},"releasedAt":"x","future":1}],"sequenceNumber":1735787045000000001,"sequenceNumberForAllocation":{"0":1735787045000000000},"deleted":false,"newField":{"a":1}}"#;
        let b: AllocationBlock = serde_json::from_str(raw).unwrap();
        let out = serde_json::to_string(&b).unwrap();
        assert_eq!(
            out,
            r#"{"cidr":"10.244.166.128/29","affinity":null,"allocations":[0,null],"unallocated":[1],"attributes":[{"handle_id":"h","secondary":{"node":"n"},"releasedAt":"x","future":1}],"sequenceNumber":1735787045000000001,"sequenceNumberForAllocation":{"0":1735787045000000000},"deleted":false,"newField":{"a":1}}"#
        );
    }

    #[test]
    fn ipam_config_omits_zero_values() {
        assert_eq!(serde_json::to_string(&IpamConfig::default()).unwrap(), "{}");
        let c: IpamConfig = serde_json::from_str(r#"{"strict_affinity":true}"#).unwrap();
        assert!(c.strict_affinity && !c.auto_allocate_blocks);
    }

    #[test]
    fn metadata_writes_null_creation_timestamp() {
        let r = Resource::new("Profile", "net1", None, ProfileSpec::default());
        assert_eq!(
            serde_json::to_string(&r).unwrap(),
            r#"{"kind":"Profile","apiVersion":"projectcalico.org/v3","metadata":{"name":"net1","creationTimestamp":null},"spec":{}}"#
        );
    }
}
