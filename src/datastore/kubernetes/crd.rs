//! Calico's objects as custom resources of `crd.projectcalico.org/v1` (libcalico-go's
//! `backend/k8s`): which resource a key is, and the conversion between the model JSON the IPAM code
//! reads and writes (the etcd format) and the CR's spec — `affinityClaimTime` for the block's
//! `affinity_claim_time`, `strictAffinity` always written, string `deleted` on v1
//! affinities, `handleID` in the handle, camelCase IPAMConfig fields.

use serde_json::{json, Map, Value};

use super::names::{affinity_labels, affinity_name, cidr_to_name};
use crate::datastore::{DatastoreError, Key, Kind};

/// The annotation holding the v3 metadata the CR cannot carry.
pub const METADATA_ANNOTATION: &str = "projectcalico.org/metadata";

/// The API group and version Calico's CRs are served under.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Group {
    /// e.g. `crd.projectcalico.org/v1`.
    pub api_version: String,
}

impl Default for Group {
    fn default() -> Self {
        Group {
            api_version: Self::V1.into(),
        }
    }
}

impl Group {
    pub const V1: &'static str = "crd.projectcalico.org/v1";
    pub const V3: &'static str = "projectcalico.org/v3";

    /// From `calico_api_group` as libcalico-go reads it: `projectcalico.org/v3` (any case)
    /// is the v3 CRDs, anything else the v1 CRDs (empty too: see `configured` for
    /// discovery).
    pub fn new(configured: &str) -> Group {
        let api_version = match configured.eq_ignore_ascii_case(Self::V3) {
            true => Self::V3,
            false => Self::V1,
        };
        Group {
            api_version: api_version.into(),
        }
    }

    /// The group `calico_api_group` names, `None` when it is empty (the API server is then
    /// asked: `KubeDatastore::discovering`).
    pub fn configured(configured: &str) -> Option<Group> {
        (!configured.is_empty()).then(|| Group::new(configured))
    }

    /// libcalico-go's `UsingV3CRDs` on the API groups the server serves: the v3 CRDs only
    /// when `projectcalico.org` is served and `crd.projectcalico.org` is not (both: the
    /// aggregated API server in front of the v1 CRDs).
    pub fn from_served(groups: &[&str]) -> Group {
        let has = |g: &str| groups.contains(&g);
        Group::new(
            match has("projectcalico.org") && !has("crd.projectcalico.org") {
                true => Self::V3,
                false => Self::V1,
            },
        )
    }

    /// The `projectcalico.org/v3` CRDs: bool `deleted`, `IPAMConfiguration`.
    pub fn is_v3(&self) -> bool {
        self.api_version.starts_with("projectcalico.org/")
    }

    pub fn collection(&self, plural: &str) -> String {
        format!("/apis/{}/{plural}", self.api_version)
    }

    pub fn object(&self, plural: &str, name: &str) -> String {
        format!("/apis/{}/{plural}/{name}", self.api_version)
    }
}

/// A key stored as a custom resource: its plural, kind and name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CrdRef {
    pub plural: &'static str,
    pub kind: &'static str,
    pub name: String,
}

/// The CR a key is stored as, or None for keys that are not CRs (pods, nodes, profiles).
pub fn crd_ref(key: &Key, group: &Group) -> Option<CrdRef> {
    let r = |plural, kind, name: String| Some(CrdRef { plural, kind, name });
    match key {
        Key::Block { cidr } => r("ipamblocks", "IPAMBlock", cidr_to_name(&cidr.masked())),
        Key::BlockAffinity { host, cidr, .. } => r(
            "blockaffinities",
            "BlockAffinity",
            affinity_name(host, &cidr.masked()),
        ),
        Key::Handle { id } => r("ipamhandles", "IPAMHandle", id.to_lowercase()),
        Key::IpamConfig if group.is_v3() => {
            r("ipamconfigurations", "IPAMConfiguration", "default".into())
        }
        Key::IpamConfig => r("ipamconfigs", "IPAMConfig", "default".into()),
        Key::Resource { kind, name, .. } => match kind {
            Kind::IpPool => r("ippools", "IPPool", name.clone()),
            Kind::ClusterInformation => {
                r("clusterinformations", "ClusterInformation", name.clone())
            }
            Kind::IpReservation => r("ipreservations", "IPReservation", name.clone()),
            Kind::IpamConfiguration if group.is_v3() => {
                r("ipamconfigurations", "IPAMConfiguration", name.clone())
            }
            Kind::IpamConfiguration => r("ipamconfigs", "IPAMConfig", name.clone()),
            Kind::WorkloadEndpoint | Kind::Profile | Kind::Node => None,
        },
    }
}

fn obj(value: &Value) -> Map<String, Value> {
    value.as_object().cloned().unwrap_or_default()
}

/// The model value as a whole CR (kind, apiVersion, metadata, spec), for POST and PUT.
pub fn to_cr(
    key: &Key,
    value: &Value,
    cr: &CrdRef,
    group: &Group,
    revision: Option<&str>,
    uid: Option<&str>,
) -> Result<Value, DatastoreError> {
    let mut meta = Map::new();
    meta.insert("name".into(), Value::String(cr.name.clone()));
    if let Some(rv) = revision.filter(|r| !r.is_empty()) {
        meta.insert("resourceVersion".into(), Value::String(rv.into()));
    }
    if let Some(uid) = uid.filter(|u| !u.is_empty()) {
        meta.insert("uid".into(), Value::String(uid.into()));
    }
    let mut v3_meta = json!({"creationTimestamp": null});
    let spec = match key {
        Key::Block { .. } => block_spec(value),
        Key::BlockAffinity {
            host,
            cidr,
            affinity_type,
        } => {
            let labels: Map<String, Value> = affinity_labels(host, affinity_type, cidr)
                .into_iter()
                .map(|(k, v)| (k.to_string(), Value::String(v)))
                .collect();
            v3_meta["labels"] = Value::Object(labels.clone());
            meta.insert("labels".into(), Value::Object(labels));
            affinity_spec(value, host, cidr, affinity_type, group)
        }
        Key::Handle { id } => {
            let v = obj(value);
            json!({
                "handleID": id,
                "block": v.get("block").cloned().filter(|b| !b.is_null()).unwrap_or(json!({})),
                "deleted": v.get("deleted").cloned().unwrap_or(json!(false)),
            })
        }
        Key::IpamConfig => ipam_config_spec(value),
        Key::Resource { .. } => {
            // A v3 resource, as libcalico-go's `ConvertCalicoResourceToK8sResource` writes
            // it: its spec as is, and its metadata (all of it but the name, namespace,
            // resourceVersion and UID) in the metadata annotation, as Go's encoder writes
            // an ObjectMeta.
            let m = value.get("metadata").cloned().unwrap_or(json!({}));
            v3_meta = Value::Object(object_meta_annotation(&m));
            value.get("spec").cloned().unwrap_or(json!({}))
        }
    };
    let mut annotations = Map::new();
    annotations.insert(
        METADATA_ANNOTATION.into(),
        Value::String(serde_json::to_string(&v3_meta).unwrap_or_default()),
    );
    meta.insert("annotations".into(), Value::Object(annotations));
    Ok(json!({
        "kind": cr.kind,
        "apiVersion": group.api_version,
        "metadata": Value::Object(meta),
        "spec": spec,
    }))
}

/// A BlockAffinity CR's spec: the state, node, type (when there is one), masked CIDR and
/// `deleted` (a bool in the v3 group, a string in the v1 CRDs).
fn affinity_spec(
    value: &Value,
    host: &str,
    cidr: &crate::support::net::IpNet,
    affinity_type: &str,
    group: &Group,
) -> Value {
    let deleted = value
        .get("deleted")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let mut s = Map::new();
    s.insert(
        "state".into(),
        value.get("state").cloned().unwrap_or(json!("")),
    );
    s.insert("node".into(), Value::String(host.to_string()));
    if !affinity_type.is_empty() {
        s.insert("type".into(), Value::String(affinity_type.to_string()));
    }
    s.insert("cidr".into(), Value::String(cidr.masked().to_string()));
    s.insert(
        "deleted".into(),
        match group.is_v3() {
            true => Value::Bool(deleted),
            false => Value::String(deleted.to_string()),
        },
    );
    Value::Object(s)
}

/// A v3 resource's metadata as libcalico-go keeps it in the metadata annotation: Go's
/// `metav1.ObjectMeta` encoding (its field order, `omitempty` but for `creationTimestamp`)
/// without the name, namespace, resourceVersion and UID.
fn object_meta_annotation(m: &Value) -> Map<String, Value> {
    let mut out = Map::new();
    for field in [
        "generateName",
        "selfLink",
        "generation",
        "creationTimestamp",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "labels",
        "annotations",
        "ownerReferences",
        "finalizers",
        "managedFields",
    ] {
        let v = m.get(field).cloned().unwrap_or(Value::Null);
        let empty = match &v {
            Value::Null => true,
            Value::String(s) => s.is_empty(),
            Value::Number(n) => n.as_i64() == Some(0),
            Value::Array(a) => a.is_empty(),
            Value::Object(o) => o.is_empty(),
            Value::Bool(_) => false,
        };
        if field == "creationTimestamp" || !empty {
            // The structs inside in Go's field order too.
            let order: &[&str] = match field {
                "managedFields" => &[
                    "manager",
                    "operation",
                    "apiVersion",
                    "time",
                    "fieldsType",
                    "fieldsV1",
                    "subresource",
                ],
                "ownerReferences" => &[
                    "apiVersion",
                    "kind",
                    "name",
                    "uid",
                    "controller",
                    "blockOwnerDeletion",
                ],
                _ => &[],
            };
            let v = match (v, order.is_empty()) {
                (Value::Array(items), false) => Value::Array(
                    items
                        .into_iter()
                        .map(|i| Value::Object(in_go_order(&obj(&i), order)))
                        .collect(),
                ),
                (v, _) => v,
            };
            out.insert(field.into(), v);
        }
    }
    out
}

/// `m`'s keys in the order of a Go struct's fields (`order`), any others after them.
fn in_go_order(m: &Map<String, Value>, order: &[&str]) -> Map<String, Value> {
    let mut out = Map::new();
    for k in order {
        if let Some(v) = m.get(*k) {
            out.insert((*k).to_string(), v.clone());
        }
    }
    for (k, v) in m {
        if !order.contains(&k.as_str()) {
            out.insert(k.clone(), v.clone());
        }
    }
    out
}

/// The block in the etcd format → the IPAMBlock spec.
fn block_spec(value: &Value) -> Value {
    let v = obj(value);
    let mut s = Map::new();
    s.insert("cidr".into(), v.get("cidr").cloned().unwrap_or(Value::Null));
    if let Some(a) = v.get("affinity").filter(|a| !a.is_null()) {
        s.insert("affinity".into(), a.clone());
    }
    if let Some(t) = v.get("affinity_claim_time").filter(|t| !t.is_null()) {
        s.insert("affinityClaimTime".into(), t.clone());
    }
    // Go writes these arrays even when empty, and the CRD requires them.
    let array = |k: &str| {
        v.get(k)
            .cloned()
            .filter(|x| !x.is_null())
            .unwrap_or(json!([]))
    };
    s.insert("allocations".into(), array("allocations"));
    s.insert("unallocated".into(), array("unallocated"));
    s.insert("attributes".into(), array("attributes"));
    s.insert(
        "sequenceNumber".into(),
        v.get("sequenceNumber").cloned().unwrap_or(json!(0)),
    );
    if let Some(m) = v
        .get("sequenceNumberForAllocation")
        .filter(|m| !m.is_null())
    {
        s.insert("sequenceNumberForAllocation".into(), m.clone());
    }
    s.insert(
        "deleted".into(),
        v.get("deleted").cloned().unwrap_or(json!(false)),
    );
    s.insert("strictAffinity".into(), Value::Bool(false));
    Value::Object(s)
}

/// The etcd-format IPAMConfig (`strict_affinity`, `auto_allocate_blocks`, …) → the CR spec.
fn ipam_config_spec(value: &Value) -> Value {
    let v = obj(value);
    let flag = |k: &str| v.get(k).and_then(Value::as_bool).unwrap_or(false);
    let mut s = Map::new();
    s.insert(
        "strictAffinity".into(),
        Value::Bool(flag("strict_affinity")),
    );
    s.insert(
        "autoAllocateBlocks".into(),
        Value::Bool(flag("auto_allocate_blocks")),
    );
    for k in [
        "maxBlocksPerHost",
        "kubeVirtVMAddressPersistence",
        "ipCooldownSeconds",
    ] {
        if let Some(x) = v.get(k).filter(|x| !x.is_null()) {
            s.insert(k.into(), x.clone());
        }
    }
    Value::Object(s)
}

/// What a stored CR says, in the model's terms.
#[derive(Clone, Debug, PartialEq)]
pub struct FromCr {
    pub value: Value,
    pub revision: String,
    pub uid: String,
    /// Soft-deleted: the delete has begun and must be finished.
    pub deleted: bool,
}

/// A CR as served → the model value (etcd format; v3 resources as v3 objects).
pub fn from_cr(key: &Key, cr: &Value) -> Result<FromCr, DatastoreError> {
    let meta = cr.get("metadata").cloned().unwrap_or(json!({}));
    let text = |field: &str| {
        meta.get(field)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string()
    };
    let (revision, uid) = (text("resourceVersion"), text("uid"));
    let spec = obj(cr.get("spec").unwrap_or(&Value::Null));
    let deleted_flag = deleted_flag(key, &spec)?;
    let (value, deleted) = match key {
        Key::Block { .. } => {
            let mut v = spec.clone();
            v.remove("strictAffinity");
            if let Some(t) = v.remove("affinityClaimTime") {
                v.insert("affinity_claim_time".into(), t);
            }
            v.entry("affinity").or_insert(Value::Null);
            (Value::Object(v), deleted_flag)
        }
        Key::BlockAffinity { .. } => (
            json!({"state": spec.get("state").cloned().unwrap_or(json!("")), "deleted": deleted_flag}),
            deleted_flag,
        ),
        Key::Handle { .. } => (
            json!({"block": spec.get("block").cloned().unwrap_or(json!({})), "deleted": deleted_flag}),
            deleted_flag,
        ),
        Key::IpamConfig => (ipam_config_value(&spec), false),
        Key::Resource { kind, name, .. } => {
            let mut m = resource_metadata(&meta);
            m.insert("name".into(), Value::String(name.clone()));
            m.insert("resourceVersion".into(), Value::String(revision.clone()));
            if !uid.is_empty() {
                m.insert("uid".into(), Value::String(uid.clone()));
            }
            (
                json!({
                    "kind": kind.name(),
                    "apiVersion": "projectcalico.org/v3",
                    "metadata": Value::Object(m),
                    "spec": Value::Object(spec.clone()),
                }),
                false,
            )
        }
    };
    Ok(FromCr {
        value,
        revision,
        uid,
        deleted,
    })
}

/// An IPAM object's `deleted` (a bool, or a string Go's `strconv.ParseBool` takes).
fn deleted_flag(key: &Key, spec: &Map<String, Value>) -> Result<bool, DatastoreError> {
    match spec.get("deleted") {
        Some(Value::Bool(b)) => Ok(*b),
        Some(Value::String(s)) if s.is_empty() => Ok(false),
        Some(Value::String(s)) => crate::support::gocompat::parse_bool(s).ok_or_else(|| {
            DatastoreError::InvalidField {
                key: key.describe(),
                reason: format!(
                    "Failed to parse deleted value as bool: strconv.ParseBool: parsing \"{s}\": invalid syntax"
                ),
            }
        }),
        _ => Ok(false),
    }
}

/// The IPAMConfig CR's spec as the backend model stores it (snake_case flags, set ones
/// only; the other fields as they are).
fn ipam_config_value(spec: &Map<String, Value>) -> Value {
    let mut v = Map::new();
    let flag = |k: &str| spec.get(k).and_then(Value::as_bool).unwrap_or(false);
    if flag("strictAffinity") {
        v.insert("strict_affinity".into(), Value::Bool(true));
    }
    if flag("autoAllocateBlocks") {
        v.insert("auto_allocate_blocks".into(), Value::Bool(true));
    }
    for k in [
        "maxBlocksPerHost",
        "kubeVirtVMAddressPersistence",
        "ipCooldownSeconds",
    ] {
        if let Some(x) = spec.get(k).filter(|x| !x.is_null()) {
            v.insert(k.into(), x.clone());
        }
    }
    Value::Object(v)
}

/// libcalico-go's `ConvertK8sResourceToCalicoResource` of a resource CR's metadata: the
/// metadata annotation's metadata, the CR's own labels and other annotations merged in, and
/// its creation time where the annotation has none; without the annotation, the CR's
/// metadata as it is. (The caller sets the name, resourceVersion and UID.)
fn resource_metadata(meta: &Value) -> Map<String, Value> {
    let stored = meta
        .get("annotations")
        .and_then(|a| a.get(METADATA_ANNOTATION))
        .and_then(Value::as_str)
        .and_then(|s| serde_json::from_str::<Map<String, Value>>(s).ok());
    let Some(mut m) = stored else {
        return obj(meta);
    };
    for field in ["labels", "annotations"] {
        let mut merged = obj(meta.get(field).unwrap_or(&Value::Null));
        merged.remove(METADATA_ANNOTATION);
        merged.extend(obj(m.get(field).unwrap_or(&Value::Null)));
        match merged.is_empty() {
            true => m.remove(field),
            false => m.insert(field.into(), Value::Object(merged)),
        };
    }
    if m.get("creationTimestamp").is_none_or(Value::is_null) {
        if let Some(ts) = meta.get("creationTimestamp") {
            m.insert("creationTimestamp".into(), ts.clone());
        }
    }
    m
}

/// The same value with `deleted` set: the first half of a soft delete.
pub fn mark_deleted(key: &Key, value: &Value) -> Value {
    let mut v = value.clone();
    if matches!(
        key,
        Key::Block { .. } | Key::BlockAffinity { .. } | Key::Handle { .. }
    ) {
        if let Value::Object(m) = &mut v {
            m.insert("deleted".into(), Value::Bool(true));
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_group_as_libcalico_go_decides() {
        assert_eq!(Group::configured(""), None);
        assert_eq!(Group::new("PROJECTCALICO.org/V3").api_version, Group::V3);
        // Anything but v3 is the v1 CRDs (a bad value too, as upstream).
        assert_eq!(Group::new("projectcalico.org").api_version, Group::V1);
        assert_eq!(
            Group::new("crd.projectcalico.org/v1").api_version,
            Group::V1
        );
        let served = |g: &[&str]| Group::from_served(g).api_version;
        assert_eq!(served(&["apps", "projectcalico.org"]), Group::V3);
        assert_eq!(
            served(&["projectcalico.org", "crd.projectcalico.org"]),
            Group::V1
        );
        assert_eq!(served(&["crd.projectcalico.org"]), Group::V1);
        assert_eq!(served(&[]), Group::V1);
    }

    #[test]
    fn block_round_trip_and_spec_shape() {
        let key = Key::Block {
            cidr: "10.244.166.128/29".parse().unwrap(),
        };
        let etcd = json!({"cidr":"10.244.166.128/29","affinity":"host:node1","affinity_claim_time":"2025-01-02T03:04:05Z",
            "allocations":[0,null,null,null,null,null,null,null],"unallocated":[1,2,3,4,5,6,7],
            "attributes":[{"handle_id":"k8s-pod-network.abc","secondary":{"node":"node1"}}],
            "sequenceNumber":7,"sequenceNumberForAllocation":{"0":6},"deleted":false});
        let g = Group::default();
        let r = crd_ref(&key, &g).unwrap();
        assert_eq!(r.name, "10-244-166-128-29");
        let cr = to_cr(&key, &etcd, &r, &g, Some("12"), None).unwrap();
        assert_eq!(
            cr["spec"],
            json!({"cidr":"10.244.166.128/29","affinity":"host:node1","affinityClaimTime":"2025-01-02T03:04:05Z",
                "allocations":[0,null,null,null,null,null,null,null],"unallocated":[1,2,3,4,5,6,7],
                "attributes":[{"handle_id":"k8s-pod-network.abc","secondary":{"node":"node1"}}],
                "sequenceNumber":7,"sequenceNumberForAllocation":{"0":6},"deleted":false,"strictAffinity":false})
        );
        assert_eq!(cr["metadata"]["resourceVersion"], "12");
        assert_eq!(
            cr["metadata"]["annotations"][METADATA_ANNOTATION],
            "{\"creationTimestamp\":null}"
        );
        let back = from_cr(&key, &cr).unwrap();
        assert_eq!(back.value, etcd);
        // A fresh block: null attributes are written as [], no affinity field.
        let fresh = json!({"cidr":"10.0.0.0/26","affinity":null,"allocations":[],"unallocated":[],"attributes":null,"sequenceNumber":1,"sequenceNumberForAllocation":null,"deleted":false});
        let cr = to_cr(&key, &fresh, &r, &g, None, None).unwrap();
        assert_eq!(cr["spec"]["attributes"], json!([]));
        assert!(cr["spec"].get("affinity").is_none());
    }

    #[test]
    fn affinity_cr() {
        let cidr = "10.244.166.128/26".parse().unwrap();
        let key = Key::host_affinity("node1", cidr);
        let g = Group::default();
        let r = crd_ref(&key, &g).unwrap();
        assert_eq!(
            (r.plural, r.name.as_str()),
            ("blockaffinities", "node1-10-244-166-128-26")
        );
        let cr = to_cr(
            &key,
            &json!({"state":"confirmed","deleted":false}),
            &r,
            &g,
            None,
            None,
        )
        .unwrap();
        assert_eq!(
            cr["spec"],
            json!({"state":"confirmed","node":"node1","type":"host","cidr":"10.244.166.128/26","deleted":"false"})
        );
        assert_eq!(
            cr["metadata"]["labels"],
            json!({"projectcalico.org/affinity-type":"host",
                "projectcalico.org/hostname-hash":"7DS2CCNJGGLTHBDQLLFO6SX24SY2YDDEG3W2VN556FA2W4DLLV5A",
                "projectcalico.org/ip-version":"4"})
        );
        let ann = cr["metadata"]["annotations"][METADATA_ANNOTATION]
            .as_str()
            .unwrap();
        assert!(ann.starts_with(
            "{\"creationTimestamp\":null,\"labels\":{\"projectcalico.org/affinity-type\":\"host\""
        ));
        let back = from_cr(&key, &cr).unwrap();
        assert_eq!(back.value, json!({"state":"confirmed","deleted":false}));
        let mut soft = cr.clone();
        soft["spec"]["deleted"] = json!("true");
        assert!(from_cr(&key, &soft).unwrap().deleted);
    }

    #[test]
    fn handle_and_config() {
        let key = Key::Handle {
            id: "k8s-pod-network.ABC".into(),
        };
        let g = Group::default();
        let r = crd_ref(&key, &g).unwrap();
        assert_eq!(r.name, "k8s-pod-network.abc");
        let cr = to_cr(
            &key,
            &json!({"block":{"10.0.0.0/26":1}}),
            &r,
            &g,
            None,
            None,
        )
        .unwrap();
        assert_eq!(
            cr["spec"],
            json!({"handleID":"k8s-pod-network.ABC","block":{"10.0.0.0/26":1},"deleted":false})
        );
        let key = Key::IpamConfig;
        let r = crd_ref(&key, &g).unwrap();
        let cr = to_cr(
            &key,
            &json!({"auto_allocate_blocks":true,"kubeVirtVMAddressPersistence":"Enabled"}),
            &r,
            &g,
            None,
            None,
        )
        .unwrap();
        assert_eq!(
            cr["spec"],
            json!({"strictAffinity":false,"autoAllocateBlocks":true,"kubeVirtVMAddressPersistence":"Enabled"})
        );
        assert_eq!(
            from_cr(&key, &cr).unwrap().value,
            json!({"auto_allocate_blocks":true,"kubeVirtVMAddressPersistence":"Enabled"})
        );
    }
}
