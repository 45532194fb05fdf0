//! The "clientv3" layer over any backend (libcalico-go `clientv3/resources.go`): metadata on
//! create (uid, creationTimestamp) and update (CAS on resourceVersion), resourceVersion
//! never stored, kind/apiVersion forced, the WorkloadEndpoint labels, IPPool read defaults.

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use super::model::{Resource, API_VERSION_V3, LABEL_NAMESPACE, LABEL_ORCHESTRATOR};
use super::{to_value, Datastore, DatastoreError, Key, Kind, ListKind};
use crate::support::timefmt;

/// The stored form: no `resourceVersion`/`selfLink`, `kind`/`apiVersion` forced.
pub fn prepare_resource_for_storage(kind: Kind, value: &Value) -> Value {
    let mut v = value.clone();
    if let Value::Object(obj) = &mut v {
        obj.insert("kind".into(), Value::String(kind.name().into()));
        obj.insert("apiVersion".into(), Value::String(API_VERSION_V3.into()));
        if let Some(Value::Object(meta)) = obj.get_mut("metadata") {
            meta.remove("resourceVersion");
            meta.remove("selfLink");
        }
    }
    v
}

/// On read, the revision becomes `metadata.resourceVersion`.
pub fn set_resource_version(value: &mut Value, revision: &str) {
    if let Value::Object(obj) = value {
        let meta = obj
            .entry("metadata")
            .or_insert_with(|| Value::Object(Default::default()));
        if let Value::Object(m) = meta {
            m.insert("resourceVersion".into(), Value::String(revision.into()));
        }
    }
}

fn key_of<S>(kind: Kind, obj: &Resource<S>) -> Key {
    let ns = (kind.namespaced() && !obj.metadata.namespace.is_empty())
        .then_some(obj.metadata.namespace.as_str());
    Key::resource(kind, ns, &obj.metadata.name)
}

fn label_workload_endpoint(kind: Kind, value: &mut Value) {
    if kind != Kind::WorkloadEndpoint {
        return;
    }
    let ns = value
        .pointer("/metadata/namespace")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let orch = value
        .pointer("/spec/orchestrator")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    if let Some(Value::Object(meta)) = value.get_mut("metadata") {
        let labels = meta
            .entry("labels")
            .or_insert_with(|| Value::Object(Default::default()));
        if let Value::Object(l) = labels {
            l.insert(LABEL_NAMESPACE.into(), Value::String(ns));
            l.insert(LABEL_ORCHESTRATOR.into(), Value::String(orch));
        }
    }
}

fn invalid(msg: &str) -> DatastoreError {
    DatastoreError::Other(msg.to_string())
}

/// Creates a v3 resource; fills uid and creationTimestamp, then the new resourceVersion.
pub async fn create_resource<D: Datastore, S: Serialize + DeserializeOwned>(
    ds: &D,
    kind: Kind,
    obj: &mut Resource<S>,
) -> Result<(), DatastoreError> {
    if obj.metadata.name.is_empty() {
        return Err(invalid("name is required for create"));
    }
    if !obj.metadata.resource_version.is_empty() {
        return Err(invalid("resourceVersion must not be set on create"));
    }
    if obj.metadata.creation_timestamp.is_none() {
        obj.metadata.creation_timestamp = Some(timefmt::now_rfc3339());
    }
    if obj.metadata.uid.is_empty() {
        obj.metadata.uid = timefmt::new_uuid();
    }
    let mut value = to_value(obj)?;
    label_workload_endpoint(kind, &mut value);
    let rev = ds.create(&key_of(kind, obj), &value).await?;
    *obj = serde_json::from_value(value).map_err(DatastoreError::encode)?;
    obj.kind = kind.name().into();
    obj.api_version = API_VERSION_V3.into();
    obj.metadata.resource_version = rev;
    Ok(())
}

/// Compare-and-swap update of a v3 resource read earlier (it carries its resourceVersion).
pub async fn update_resource<D: Datastore, S: Serialize + DeserializeOwned>(
    ds: &D,
    kind: Kind,
    obj: &mut Resource<S>,
) -> Result<(), DatastoreError> {
    let rev = obj.metadata.resource_version.clone();
    if rev.is_empty() || obj.metadata.uid.is_empty() || obj.metadata.creation_timestamp.is_none() {
        return Err(invalid(
            "resourceVersion, uid and creationTimestamp are required for update",
        ));
    }
    let mut value = to_value(obj)?;
    label_workload_endpoint(kind, &mut value);
    let new_rev = ds.update(&key_of(kind, obj), &value, &rev).await?;
    *obj = serde_json::from_value(value).map_err(DatastoreError::encode)?;
    obj.metadata.resource_version = new_rev;
    Ok(())
}

/// A stored object as its typed resource (pools with their read defaults).
pub fn decode_resource<S: DeserializeOwned>(
    kind: Kind,
    kv: &super::KvPair,
) -> Result<Resource<S>, DatastoreError> {
    let mut value = kv.value.clone();
    if kind == Kind::IpPool {
        // Read defaults are applied on the JSON so every caller sees them.
        apply_pool_defaults(&mut value);
    }
    serde_json::from_value(value).map_err(|e| DatastoreError::decode(format!("{:?}", kv.key), e))
}

fn apply_pool_defaults(value: &mut Value) {
    let v6 = value
        .pointer("/spec/cidr")
        .and_then(Value::as_str)
        .is_some_and(|c| c.contains(':'));
    let Some(Value::Object(spec)) = value.get_mut("spec") else {
        return;
    };
    let unset = |v: Option<&Value>| match v {
        None | Some(Value::Null) => true,
        Some(Value::String(s)) => s.is_empty(),
        Some(Value::Number(n)) => n.as_i64() == Some(0),
        Some(Value::Array(a)) => a.is_empty(),
        _ => false,
    };
    let defaults: [(&str, Value); 6] = [
        ("blockSize", Value::from(if v6 { 122 } else { 26 })),
        ("allowedUses", serde_json::json!(["Workload", "Tunnel"])),
        ("nodeSelector", Value::from("all()")),
        ("ipipMode", Value::from("Never")),
        ("vxlanMode", Value::from("Never")),
        ("assignmentMode", Value::from("Automatic")),
    ];
    for (k, d) in defaults {
        if unset(spec.get(k)) {
            spec.insert(k.into(), d);
        }
    }
}

pub async fn get_resource<D: Datastore, S: DeserializeOwned>(
    ds: &D,
    kind: Kind,
    namespace: Option<&str>,
    name: &str,
) -> Result<Resource<S>, DatastoreError> {
    let kv = ds.get(&Key::resource(kind, namespace, name)).await?;
    decode_resource(kind, &kv)
}

pub async fn list_resources<D: Datastore, S: DeserializeOwned>(
    ds: &D,
    what: &ListKind,
) -> Result<Vec<Resource<S>>, DatastoreError> {
    let ListKind::Resources { kind, .. } = what else {
        return Err(invalid("list_resources needs ListKind::Resources"));
    };
    ds.list(what)
        .await?
        .iter()
        .map(|kv| decode_resource(*kind, kv))
        .collect()
}

pub async fn delete_resource<D: Datastore>(
    ds: &D,
    kind: Kind,
    namespace: Option<&str>,
    name: &str,
    revision: Option<&str>,
) -> Result<(), DatastoreError> {
    ds.delete(&Key::resource(kind, namespace, name), revision)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn storage_form_and_pool_defaults() {
        let v = json!({"kind":"x","metadata":{"name":"n","resourceVersion":"5","selfLink":"s"},"spec":{}});
        let s = prepare_resource_for_storage(Kind::Profile, &v);
        assert_eq!(
            s,
            json!({"kind":"Profile","apiVersion":"projectcalico.org/v3","metadata":{"name":"n"},"spec":{}})
        );
        let mut p = json!({"spec":{"cidr":"fd00::/64"}});
        apply_pool_defaults(&mut p);
        assert_eq!(p["spec"]["blockSize"], 122);
        assert_eq!(p["spec"]["nodeSelector"], "all()");
        assert_eq!(p["spec"]["allowedUses"], json!(["Workload", "Tunnel"]));
        let mut w = json!({"metadata":{"namespace":"ns1"},"spec":{"orchestrator":"k8s"}});
        label_workload_endpoint(Kind::WorkloadEndpoint, &mut w);
        assert_eq!(
            w["metadata"]["labels"],
            json!({"projectcalico.org/namespace":"ns1","projectcalico.org/orchestrator":"k8s"})
        );
    }
}
